//! 4-bit records of [`super::FastBalancedCbc`], for matrices whose rows lie on 4-bit grids
//! with one scale per group of input columns.
//!
//! A pack written with `sieve pack --values int4[:G]` stores f16 values that are `q · s` exactly
//! (`sieve_formats::value_grid::INT4`: `|q| <= 7`, one f16 scale per row and group of G
//! consecutive input columns, G in {32, 64, 128}). The blob is unchanged; at load
//! [`Int4Records::build`] detects the grids (widest G first) and, when every (row, column group)
//! has one, keeps half a byte per value:
//!
//! ```text
//! record of (group of 16 rows g, column c), 2 + ceil(N / 2) bytes, unaligned:
//!   u16 row mask (little-endian) | nibble 0 | nibble 1 | ... | nibble N-1 (0 fill)
//!   nibble t = q of the t-th set row, 4-bit two's complement, low nibble of a byte first
//! groups one after the other, each the K records of its columns in order (as the int8 and
//! f16 records are); then TAIL zero bytes.
//! scales: f16, [(g · column_groups + j) · 16 + i] = scale of row 16 g + i in columns
//!   j G .. (j + 1) G (0 for rows past M and for runs without stored values)
//! ```
//!
//! At N = 8 (sp 0.5) a record is 6 bytes against 10 for int8 and 18 for f16, and the scales add
//! 32 bytes per 16 rows and G columns (5% at G = 64). Products sum `q · x` per column group and
//! scale each group's 16 sums once (one FMA per group), so they differ from the f16 kernels'
//! only by f32 rounding.
//!
//! Kernels, per group of rows, column group and active column:
//! * AVX-512 + VBMI2: one 8-byte load of the nibbles, `pdep` of them into the high nibbles of 8
//!   bytes (two for N > 8; each byte is then `16 q` as an `i8`, sign included), `vpexpandb` by
//!   the row mask, `vpmovsxbd`, `vcvtdq2ps`, one FMA with the broadcast activation (the 1/16 is
//!   applied with the scales);
//! * AVX-512 without VBMI2: the same bytes, `vpmovsxbd`, `vcvtdq2ps`, `vexpandps` by the mask;
//! * AVX2: the nibbles spread to bytes with vector shifts (`pdep` is microcoded on Zen 1/2),
//!   then per 8 rows `vpmovsxbd`, `vcvtdq2ps`, `vpermps` by the rank table, a mask, one FMA;
//! * portable: a scalar walk of the set bits.

use super::{Prepared, SimdLevel, GROUP};
use half::f16;
use rayon::prelude::*;
use sieve_formats::matrix::is_zero;
use sieve_formats::value_grid::INT4;
use sieve_formats::DenseMatrix;

/// Column-group sizes the detector tries, widest first: a matrix on the grids of G columns is
/// also on those of every divisor of G, and wider groups store fewer scales.
pub(super) const COLUMN_GROUPS: [usize; 3] = [128, 64, 32];
/// Columns per entry of [`Prepared::bounds`]; every column-group size is a multiple of it.
pub(super) const BOUND_STEP: usize = 32;
/// Bytes after the last group: a kernel reads 8 bytes of nibbles after any record's mask.
const TAIL: usize = 16;

/// The 4-bit records of a matrix (module notes).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Int4Records {
    /// Bytes per record: the mask and `ceil(N / 2)` bytes of nibbles.
    record: usize,
    /// N, the values per record.
    slots: usize,
    /// `groups · K · record` bytes, then [`TAIL`] zeros.
    data: Vec<u8>,
    /// The scales (module notes).
    scales: GroupScales,
}

/// The 4-bit grids a matrix's rows lie on, as the kernels read their scales.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct GroupScales {
    /// G, the input columns that share a scale.
    pub(super) columns: usize,
    /// `ceil(K / G)`.
    pub(super) column_groups: usize,
    /// f16 (exact: the detector accepts only f16 scales), `[(g · column_groups + j) · 16 + i]`
    /// = row `16 g + i`, columns `j G .. (j + 1) G`; 0 for rows past M and for runs without
    /// stored values.
    per_group: Vec<f16>,
}

impl GroupScales {
    /// The grids of the widest [`COLUMN_GROUPS`] size every row of `w` lies on, with the
    /// scales per row (`M · column_groups` entries, row-major: what a build divides by), or
    /// `None`.
    pub(super) fn detect(w: &DenseMatrix) -> Option<(Self, Vec<f32>)> {
        let (m, k) = (w.rows(), w.cols());
        let (columns, per_row) = COLUMN_GROUPS
            .iter()
            .find_map(|&g| Some((g, detect_scales(w, g)?)))?;
        let column_groups = k.div_ceil(columns);
        let mut per_group = vec![f16::ZERO; m.div_ceil(GROUP) * column_groups * GROUP];
        for (r, rs) in per_row.chunks(column_groups.max(1)).enumerate() {
            let (g, i) = (r / GROUP, r % GROUP);
            for (j, &s) in rs.iter().enumerate() {
                per_group[(g * column_groups + j) * GROUP + i] = f16::from_f32(s);
            }
        }
        let scales = Self {
            columns,
            column_groups,
            per_group,
        };
        Some((scales, per_row))
    }

    /// The 16 scales of column group `j` of row group `g`.
    pub(super) fn of(&self, g: usize, j: usize) -> &[f16] {
        let at = (g * self.column_groups + j) * GROUP;
        &self.per_group[at..at + GROUP]
    }

    /// The scales' bytes.
    pub(super) fn bytes(&self) -> usize {
        2 * self.per_group.len()
    }
}

/// The nibble of grid index `q` (`|q| <= 7`).
fn nibble(q: i8) -> u8 {
    q as u8 & 0x0f
}

/// The grid index of a nibble (4-bit two's complement).
fn index(nibble: u8) -> i8 {
    ((nibble << 4) as i8) >> 4
}

impl Int4Records {
    /// The records of `w` (the decoded matrix, at most `slots` nonzeros per group and column)
    /// when every row lies on 4-bit grids of one of the [`COLUMN_GROUPS`] sizes, else `None`.
    pub(super) fn build(w: &DenseMatrix, slots: usize) -> Option<Self> {
        if slots > GROUP {
            return None;
        }
        let (m, k) = (w.rows(), w.cols());
        let (scales, row_scales) = GroupScales::detect(w)?;
        let (columns, column_groups) = (scales.columns, scales.column_groups);
        let groups = m.div_ceil(GROUP);
        let record = 2 + slots.div_ceil(2);
        let group_len = k * record;
        let mut data = vec![0u8; groups * group_len + TAIL];
        let src = w.data();
        data[..groups * group_len]
            .par_chunks_mut(group_len.max(1))
            .enumerate()
            .for_each(|(g, out)| {
                let rows = g * GROUP..((g + 1) * GROUP).min(m);
                for c in 0..k {
                    let mut mask = 0u16;
                    let at = c * record;
                    let mut t = 0;
                    for (i, r) in rows.clone().enumerate() {
                        // Exactly the entries the f16 records hold (module notes of the parent).
                        let v = src[r * k + c];
                        if !is_zero(v) {
                            mask |= 1 << i;
                            // v = q · s exactly (detected), so the quotient is q exactly.
                            let s = row_scales[r * column_groups + c / columns];
                            let q = (v.to_f32() / s).round() as i8;
                            out[at + 2 + t / 2] |= nibble(q) << (4 * (t % 2));
                            t += 1;
                        }
                    }
                    debug_assert!(t <= slots);
                    out[at..at + 2].copy_from_slice(&mask.to_le_bytes());
                }
            });
        Some(Self {
            record,
            slots,
            data,
            scales,
        })
    }

    /// G, the input columns that share a scale.
    pub(super) fn columns(&self) -> usize {
        self.scales.columns
    }

    /// Bytes one matrix-vector product streams: records and scales.
    pub(super) fn layout_bytes(&self) -> usize {
        self.data.len() - TAIL + self.scales.bytes()
    }

    fn group_len(&self, cols: usize) -> usize {
        cols * self.record
    }

    /// The active inputs of column group `j`: indices `a..b` into `p.cols`.
    fn active_range(&self, cols: usize, j: usize, p: &Prepared) -> (usize, usize) {
        let c0 = j * self.scales.columns;
        let c1 = ((j + 1) * self.scales.columns).min(cols);
        (
            p.bounds[c0 / BOUND_STEP] as usize,
            p.bounds[c1.div_ceil(BOUND_STEP)] as usize,
        )
    }

    /// `sums[i] = W[16 g + i] · x` through the kernels of `level`.
    pub(super) fn group(
        &self,
        level: SimdLevel,
        cols: usize,
        g: usize,
        p: &Prepared,
        sums: &mut [f32; GROUP],
    ) {
        match level {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the level is supported (callers cap it by `or_portable`); the records were
            // built by `build` for this matrix (K columns, TAIL bytes after the last group),
            // `g < groups` and `p` was prepared for it (its columns, its bounds).
            SimdLevel::Avx512Vbmi2 if p.finite => unsafe {
                if self.slots > 8 {
                    x86::group_avx512::<true, true>(self, cols, g, p, sums)
                } else {
                    x86::group_avx512::<true, false>(self, cols, g, p, sums)
                }
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            SimdLevel::Avx512 if p.finite => unsafe {
                if self.slots > 8 {
                    x86::group_avx512::<false, true>(self, cols, g, p, sums)
                } else {
                    x86::group_avx512::<false, false>(self, cols, g, p, sums)
                }
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            SimdLevel::Avx2 if p.finite => unsafe { x86::group_avx2(self, cols, g, p, sums) },
            _ => self.group_portable(cols, g, p, sums),
        }
    }

    fn group_portable(&self, cols: usize, g: usize, p: &Prepared, sums: &mut [f32; GROUP]) {
        let base = g * self.group_len(cols);
        *sums = [0.0; GROUP];
        for j in 0..self.scales.column_groups {
            let (a, b) = self.active_range(cols, j, p);
            if a == b {
                continue;
            }
            let mut part = [0f32; GROUP];
            for (&c, &xv) in p.cols[a..b].iter().zip(&p.xs[a..b]) {
                let at = base + c as usize * self.record;
                let mut bits = u16::from_le_bytes([self.data[at], self.data[at + 1]]);
                let mut t = 0;
                while bits != 0 {
                    let i = bits.trailing_zeros() as usize;
                    let q = index(self.data[at + 2 + t / 2] >> (4 * (t % 2)) & 0x0f);
                    part[i] += q as f32 * xv;
                    t += 1;
                    bits &= bits - 1;
                }
            }
            for ((s, p), k) in sums.iter_mut().zip(&part).zip(self.scales.of(g, j)) {
                *s += p * k.to_f32();
            }
        }
    }

    /// Writes group `g`'s rows (`rows.len() / cols` of them) as dense f16 (zeros already in
    /// place): `q · s` is the stored value exactly. The AVX-512 levels convert a record's 16
    /// rows at once (the scalar walk made prefill ~35% slower than with 8-bit records).
    pub(super) fn decode_group(&self, level: SimdLevel, cols: usize, g: usize, rows: &mut [f16]) {
        debug_assert!(rows.len() <= GROUP * cols);
        #[cfg(target_arch = "x86_64")]
        if level >= SimdLevel::Avx512 {
            // SAFETY: the level is supported (the caller capped it by `or_portable`); the
            // records were built for `cols` columns (TAIL bytes after the last group), `g <
            // groups`, and `rows` holds the group's rows, `cols` entries each.
            unsafe { x86::decode_group_avx512(self, cols, g, rows) };
            return;
        }
        let _ = level;
        let base = g * self.group_len(cols);
        for c in 0..cols {
            let at = base + c * self.record;
            let scales = self.scales.of(g, c / self.scales.columns);
            let mut bits = u16::from_le_bytes([self.data[at], self.data[at + 1]]);
            let mut t = 0;
            while bits != 0 {
                let i = bits.trailing_zeros() as usize;
                let q = index(self.data[at + 2 + t / 2] >> (4 * (t % 2)) & 0x0f);
                rows[i * cols + c] = f16::from_f32(q as f32 * scales[i].to_f32());
                t += 1;
                bits &= bits - 1;
            }
        }
    }
}

/// Per row and column group of `columns`, the scale that puts the row's stored values there on
/// a 4-bit grid (`m · ceil(K / columns)` entries, row-major), or `None` when one is off grid.
fn detect_scales(w: &DenseMatrix, columns: usize) -> Option<Vec<f32>> {
    let (m, k) = (w.rows(), w.cols());
    let src = w.data();
    let per_row: Vec<Vec<f32>> = (0..m)
        .into_par_iter()
        .map_init(
            || (Vec::with_capacity(columns), Vec::with_capacity(columns)),
            |(stored, q): &mut (Vec<f16>, Vec<i8>), r| {
                src[r * k..(r + 1) * k]
                    .chunks(columns)
                    .map(|run| {
                        stored.clear();
                        stored.extend(run.iter().filter(|v| !is_zero(**v)));
                        q.resize(stored.len(), 0);
                        INT4.detect(stored, q)
                    })
                    .collect::<Option<Vec<f32>>>()
            },
        )
        .collect::<Option<_>>()?;
    Some(per_row.concat())
}

/// Index bounds of the active inputs per [`BOUND_STEP`] columns: entry `b` is how many active
/// inputs lie in columns `0 .. b · BOUND_STEP` (`ceil(K / BOUND_STEP) + 1` entries).
pub(super) fn bounds(cols: &[u32], k: usize) -> Vec<u32> {
    let steps = k.div_ceil(BOUND_STEP);
    let mut out = Vec::with_capacity(steps + 1);
    let mut t = 0usize;
    for b in 0..=steps {
        let end = (b * BOUND_STEP) as u32;
        while t < cols.len() && cols[t] < end {
            t += 1;
        }
        out.push(t as u32);
    }
    // The last entry counts every active input (K may not be a multiple of the step).
    *out.last_mut().expect("at least one entry") = cols.len() as u32;
    out
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::{Prepared, GROUP};
    use super::Int4Records;
    use crate::tiled_cbc::columns::RANKS;
    use std::arch::x86_64::*;

    /// The high nibbles of 8 bytes: `pdep` there puts nibble t of the source at byte t, as
    /// `16 q` in two's complement.
    const HIGH_NIBBLES: u64 = 0xf0f0_f0f0_f0f0_f0f0;

    /// Bytes ahead of a column group's records that are prefetched when it starts. The
    /// hardware prefetchers alone left the 4-bit product at 10.8 GB/s from DRAM at dp 0.5
    /// (`examples/balanced_bench.rs`, SmolLM2's shapes, N = 8, G = 64: 4.0 ms per token); a
    /// column group's span (384 bytes) fetched 1.5-6 KiB ahead gave 15.5-16 GB/s (2.7-2.8 ms),
    /// flat over that range, and 384 bytes ahead nothing.
    const PREFETCH_AHEAD: usize = 2048;

    /// Prefetches `span` bytes from `PREFETCH_AHEAD` past `base + at` (the next row group's
    /// records when near a group's end: the next bytes of the stream). Prefetches never
    /// fault, so addresses past the records are harmless (`wrapping_add`).
    #[inline(always)]
    unsafe fn prefetch_ahead(base: *const u8, at: usize, span: usize) {
        let from = base.wrapping_add(at + PREFETCH_AHEAD);
        let mut off = 0;
        while off < span {
            _mm_prefetch::<_MM_HINT_T0>(from.wrapping_add(off) as *const i8);
            off += 64;
        }
    }

    /// The record of column `c` at `base`: its row mask and its nibbles as 16 `i8` of `16 q`
    /// (bytes past N hold the next records' bits: the mask's popcount bounds what is used).
    #[inline(always)]
    unsafe fn record<const WIDE: bool>(r: &Int4Records, base: *const u8, c: u32) -> (u16, __m128i) {
        let at = base.add(c as usize * r.record);
        let mask = (at as *const u16).read_unaligned();
        let nibbles = (at.add(2) as *const u64).read_unaligned();
        let lo = _pdep_u64(nibbles, HIGH_NIBBLES) as i64;
        let bytes = if WIDE {
            _mm_set_epi64x(_pdep_u64(nibbles >> 32, HIGH_NIBBLES) as i64, lo)
        } else {
            _mm_cvtsi64_si128(lo)
        };
        (mask, bytes)
    }

    /// Per column group: per active column the record's bytes placed by its mask (`vpexpandb`
    /// with VBMI2, else `vexpandps` after the conversion), `vpmovsxbd`, `vcvtdq2ps`, one FMA
    /// (two sums for alternate columns); then one FMA by the group's 16 scales. `WIDE`: N > 8.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL, BMI2, F16C (and VBMI2 when `VBMI2`); `r` built by
    /// `Int4Records::build` for a matrix of `cols` columns, `g < groups`, `p` prepared for it.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,bmi2,f16c")]
    unsafe fn group_vbmi2_impl<const WIDE: bool>(
        r: &Int4Records,
        cols: usize,
        g: usize,
        p: &Prepared,
        out: &mut [f32; GROUP],
    ) {
        #[inline(always)]
        unsafe fn one<const WIDE: bool>(
            r: &Int4Records,
            base: *const u8,
            c: u32,
            xv: f32,
            acc: &mut __m512,
        ) {
            let (m, bytes) = record::<WIDE>(r, base, c);
            let e = _mm_maskz_expand_epi8(m, bytes);
            let f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(e));
            *acc = _mm512_fmadd_ps(f, _mm512_set1_ps(xv), *acc);
        }
        let base = r.data.as_ptr().add(g * r.group_len(cols));
        let mut total = _mm512_setzero_ps();
        let span = r.scales.columns * r.record;
        for j in 0..r.scales.column_groups {
            prefetch_ahead(base, j * span, span);
            let (a, e) = r.active_range(cols, j, p);
            if a == e {
                continue;
            }
            let (mut s0, mut s1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            let mut t = a;
            while t + 2 <= e {
                one::<WIDE>(
                    r,
                    base,
                    *p.cols.get_unchecked(t),
                    *p.xs.get_unchecked(t),
                    &mut s0,
                );
                let (c, x) = (*p.cols.get_unchecked(t + 1), *p.xs.get_unchecked(t + 1));
                one::<WIDE>(r, base, c, x, &mut s1);
                t += 2;
            }
            if t < e {
                one::<WIDE>(
                    r,
                    base,
                    *p.cols.get_unchecked(t),
                    *p.xs.get_unchecked(t),
                    &mut s0,
                );
            }
            let sc = r.scales.of(g, j).as_ptr();
            let sc = _mm512_cvtph_ps(_mm256_loadu_si256(sc as *const __m256i));
            total = _mm512_fmadd_ps(_mm512_add_ps(s0, s1), sc, total);
        }
        _mm512_storeu_ps(
            out.as_mut_ptr(),
            _mm512_mul_ps(total, _mm512_set1_ps(1.0 / 16.0)),
        );
    }

    /// [`Int4Records::decode_group`] with AVX-512: per record the nibbles' bytes, `vpmovsxbd`,
    /// `vcvtdq2ps`, `vexpandps` by the row mask, one multiply by the 16 row scales / 16, one
    /// `vcvtps2ph`; the set rows' values are then stored one by one (the rows are `cols`
    /// apart).
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL, BMI2 and F16C; `r` built for a matrix of `cols`
    /// columns, `g < groups`, `rows.len() <= 16 · cols` (the rows of group `g`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,bmi2,f16c")]
    pub unsafe fn decode_group_avx512(
        r: &Int4Records,
        cols: usize,
        g: usize,
        rows: &mut [half::f16],
    ) {
        let base = r.data.as_ptr().add(g * r.group_len(cols));
        let present = rows.len() / cols.max(1);
        let mut tmp = [0u16; GROUP];
        let mut scales = _mm512_setzero_ps();
        for c in 0..cols {
            if c % r.scales.columns == 0 {
                let sc = r.scales.of(g, c / r.scales.columns).as_ptr();
                let sc = _mm512_cvtph_ps(_mm256_loadu_si256(sc as *const __m256i));
                scales = _mm512_mul_ps(sc, _mm512_set1_ps(1.0 / 16.0));
            }
            let (m, bytes) = if r.slots > 8 {
                record::<true>(r, base, c as u32)
            } else {
                record::<false>(r, base, c as u32)
            };
            if m == 0 {
                continue;
            }
            let f = _mm512_maskz_expand_ps(m, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
            let h = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm512_mul_ps(f, scales));
            _mm256_storeu_si256(tmp.as_mut_ptr() as *mut __m256i, h);
            let mut bits = m;
            while bits != 0 {
                let i = bits.trailing_zeros() as usize;
                debug_assert!(i < present);
                *rows.get_unchecked_mut(i * cols + c) = half::f16::from_bits(tmp[i]);
                bits &= bits - 1;
            }
        }
    }

    /// [`group_vbmi2_impl`] without VBMI2: the bytes converted first, then `vexpandps`.
    ///
    /// # Safety
    /// As for [`group_vbmi2_impl`], without VBMI2.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,bmi2,f16c")]
    unsafe fn group_expandps_impl<const WIDE: bool>(
        r: &Int4Records,
        cols: usize,
        g: usize,
        p: &Prepared,
        out: &mut [f32; GROUP],
    ) {
        let base = r.data.as_ptr().add(g * r.group_len(cols));
        let mut total = _mm512_setzero_ps();
        let span = r.scales.columns * r.record;
        for j in 0..r.scales.column_groups {
            prefetch_ahead(base, j * span, span);
            let (a, e) = r.active_range(cols, j, p);
            if a == e {
                continue;
            }
            let mut acc = [_mm512_setzero_ps(); 2];
            for t in a..e {
                let (m, bytes) = record::<WIDE>(r, base, *p.cols.get_unchecked(t));
                let f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
                let s = acc.get_unchecked_mut(t & 1);
                *s = _mm512_fmadd_ps(
                    _mm512_maskz_expand_ps(m, f),
                    _mm512_set1_ps(*p.xs.get_unchecked(t)),
                    *s,
                );
            }
            let sc = r.scales.of(g, j).as_ptr();
            let sc = _mm512_cvtph_ps(_mm256_loadu_si256(sc as *const __m256i));
            total = _mm512_fmadd_ps(_mm512_add_ps(acc[0], acc[1]), sc, total);
        }
        _mm512_storeu_ps(
            out.as_mut_ptr(),
            _mm512_mul_ps(total, _mm512_set1_ps(1.0 / 16.0)),
        );
    }

    /// The AVX-512 kernels: `VBMI2` picks `vpexpandb`, `WIDE` is N > 8.
    ///
    /// # Safety
    /// As for [`group_vbmi2_impl`] (VBMI2 only when `VBMI2`).
    pub unsafe fn group_avx512<const VBMI2: bool, const WIDE: bool>(
        r: &Int4Records,
        cols: usize,
        g: usize,
        p: &Prepared,
        out: &mut [f32; GROUP],
    ) {
        if VBMI2 {
            group_vbmi2_impl::<WIDE>(r, cols, g, p, out)
        } else {
            group_expandps_impl::<WIDE>(r, cols, g, p, out)
        }
    }

    /// Per column group and active column: the 16 nibbles spread to bytes of `16 q` with
    /// vector shifts (low nibbles shifted up, high ones masked, the two interleaved), then per
    /// 8 rows `vpmovsxbd`, `vcvtdq2ps`, `vpermps` by the rank of each set bit, a mask of the
    /// set bits, one FMA; one FMA by the scales per column group.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA, F16C and POPCNT; otherwise as for [`group_vbmi2_impl`].
    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    pub unsafe fn group_avx2(
        r: &Int4Records,
        cols: usize,
        g: usize,
        p: &Prepared,
        out: &mut [f32; GROUP],
    ) {
        let base = r.data.as_ptr().add(g * r.group_len(cols));
        let lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        let high = _mm_set1_epi8(0xf0u8 as i8);
        let mut total = [_mm256_setzero_ps(); 2];
        let mut spread = [0u8; 16];
        for j in 0..r.scales.column_groups {
            let (a, e) = r.active_range(cols, j, p);
            if a == e {
                continue;
            }
            let mut acc = [_mm256_setzero_ps(); 2];
            for t in a..e {
                let at = base.add(*p.cols.get_unchecked(t) as usize * r.record);
                let m = (at as *const u16).read_unaligned();
                let raw = _mm_loadl_epi64(at.add(2) as *const __m128i);
                let lo = _mm_and_si128(_mm_slli_epi16::<4>(raw), high);
                let hi = _mm_and_si128(raw, high);
                _mm_storeu_si128(
                    spread.as_mut_ptr() as *mut __m128i,
                    _mm_unpacklo_epi8(lo, hi),
                );
                let vx = _mm256_set1_ps(*p.xs.get_unchecked(t));
                let mut from = 0usize;
                for (h, s) in acc.iter_mut().enumerate() {
                    let mb = ((m >> (8 * h)) & 0xff) as usize;
                    if mb == 0 {
                        continue;
                    }
                    let raw = _mm_loadl_epi64(spread.as_ptr().add(from) as *const __m128i);
                    let f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
                    let idx = _mm256_loadu_si256(RANKS.as_ptr().add(mb) as *const __m256i);
                    let placed = _mm256_permutevar8x32_ps(f, idx);
                    let sel = _mm256_set1_epi32(mb as i32);
                    let keep = _mm256_cmpeq_epi32(_mm256_and_si256(sel, lane_bits), lane_bits);
                    let placed = _mm256_and_ps(placed, _mm256_castsi256_ps(keep));
                    *s = _mm256_fmadd_ps(placed, vx, *s);
                    from += mb.count_ones() as usize;
                }
            }
            let sc = r.scales.of(g, j).as_ptr();
            for (h, (tot, s)) in total.iter_mut().zip(&acc).enumerate() {
                let k = _mm256_cvtph_ps(_mm_loadu_si128(sc.add(8 * h) as *const __m128i));
                *tot = _mm256_fmadd_ps(*s, k, *tot);
            }
        }
        let sixteenth = _mm256_set1_ps(1.0 / 16.0);
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(total[0], sixteenth));
        _mm256_storeu_ps(out.as_mut_ptr().add(8), _mm256_mul_ps(total[1], sixteenth));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nibbles_round_trip_every_index() {
        for q in -8i8..=7 {
            assert_eq!(index(nibble(q)), q);
        }
    }

    #[test]
    fn bounds_count_the_active_inputs_before_each_step() {
        let cols = [0u32, 5, 31, 32, 33, 95, 96, 130];
        assert_eq!(bounds(&cols, 131), vec![0, 3, 5, 6, 7, 8]);
        assert_eq!(bounds(&[], 10), vec![0, 0]);
        assert_eq!(bounds(&[0], 1), vec![0, 1]);
    }
}
