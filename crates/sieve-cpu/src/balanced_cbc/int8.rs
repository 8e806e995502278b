//! 8-bit records of [`super::FastBalancedCbc`], for matrices whose rows lie on int8 grids.
//!
//! A pack written with `sieve pack --values int8` stores f16 values that are `q · s_r` exactly
//! (`sieve_formats::value_grid`: one f32 scale per row, `|q| <= 127`). The blob is unchanged;
//! at load [`Int8Records::build`] detects the grids and, when every row has one, keeps 1 byte
//! per value instead of 2: per (group of 16 rows, input column) a record of `N + 2` bytes, the
//! `u16` row mask (little-endian, unaligned) then N `i8` indices, the nonzeros in row order
//! then 0 fill; the groups one after the other as the f16 interleaved records are. The row
//! scales are applied once per group at the end of a product (16 multiplies), so the kernels
//! sum `q · x`; as `q · s_r` is the stored value exactly, a product differs from the f16
//! kernels' only by f32 rounding. Records are not padded to an even length: at N = 8 a record
//! is 10 bytes against 18 for f16.
//!
//! Kernels, per group and active column (the f16 ones with bytes):
//! * AVX-512 + VBMI2: a masked byte load of the N indices, `vpexpandb` (register form) by the
//!   row mask, `vpmovsxbd` to 16 i32, `vcvtdq2ps`, one FMA with the broadcast activation;
//! * AVX-512 without VBMI2: a masked byte load, `vpmovsxbd`, `vcvtdq2ps`, `vexpandps`, one FMA;
//! * AVX2: per 8 rows an 8-byte load, `vpmovsxbd`, `vcvtdq2ps`, `vpermps` by the rank table,
//!   a mask, one FMA;
//! * portable: a scalar walk of the set bits.

use super::{SimdLevel, GROUP};
use half::f16;
use rayon::prelude::*;
use sieve_formats::matrix::is_zero;
use sieve_formats::value_grid::detect_row;
use sieve_formats::DenseMatrix;

/// Bytes after the last group, so that the AVX2 kernel's 8-byte loads never leave the array.
const TAIL: usize = 16;

/// The 8-bit records of a matrix (module notes).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Int8Records {
    /// Bytes per record: the mask and N indices (and padding, when built with an alignment).
    pub(super) record: usize,
    /// N, the indices per record.
    pub(super) slots: usize,
    /// `groups · K · record` bytes, then [`TAIL`] zeros.
    pub(super) data: Vec<u8>,
    /// Per row the grid scale, 0 for rows without values and for the rows past M of the last
    /// group (`groups · 16` entries).
    pub(super) scales: Vec<f32>,
}

impl Int8Records {
    /// The records of `w` (the decoded matrix, at most `slots` nonzeros per group and column)
    /// when every row lies on an int8 grid, else `None`.
    /// Records are `N + 2` bytes rounded up to a multiple of `align` (1: unpadded).
    pub(super) fn build(w: &DenseMatrix, slots: usize, align: usize) -> Option<Self> {
        let (m, k) = (w.rows(), w.cols());
        let src = w.data();
        let groups = m.div_ceil(GROUP);
        // Per row its scale; the first row off its grid stops the search (f16 packs are
        // refused quickly at load). Buffers reused per worker.
        let mut scales: Vec<f32> = (0..m)
            .into_par_iter()
            .map_init(
                || (Vec::with_capacity(k), Vec::with_capacity(k)),
                |(stored, q): &mut (Vec<f16>, Vec<i8>), r| {
                    stored.clear();
                    stored.extend(src[r * k..(r + 1) * k].iter().filter(|v| !is_zero(**v)));
                    q.resize(stored.len(), 0);
                    detect_row(stored, q)
                },
            )
            .collect::<Option<_>>()?;
        scales.resize(groups * GROUP, 0.0);
        let record = (slots + 2).next_multiple_of(align.max(1));
        let group_len = k * record;
        let mut data = vec![0u8; groups * group_len + TAIL];
        data[..groups * group_len]
            .par_chunks_mut(group_len.max(1))
            .enumerate()
            .for_each(|(g, out)| {
                let rows = g * GROUP..((g + 1) * GROUP).min(m);
                for c in 0..k {
                    let mut mask = 0u16;
                    let at = c * record;
                    let mut pos = at + 2;
                    for (i, r) in rows.clone().enumerate() {
                        // Exactly the entries the f16 records hold (module notes of the parent).
                        if !is_zero(src[r * k + c]) {
                            mask |= 1 << i;
                            // v = q · s exactly (detected), so the f32 quotient is q exactly.
                            let q = (src[r * k + c].to_f32() / scales[r]).round() as i8;
                            out[pos] = q as u8;
                            pos += 1;
                        }
                    }
                    debug_assert!(mask.count_ones() as usize <= slots);
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

    /// Bytes one matrix-vector product streams.
    pub(super) fn layout_bytes(&self) -> usize {
        self.data.len() - TAIL
    }

    pub(super) fn group_len(&self, cols: usize) -> usize {
        cols * self.record
    }

    /// The mask and first index position of column `c` of the group starting at `base`.
    fn record_at(&self, base: usize, c: usize) -> (u16, usize) {
        let at = base + c * self.record;
        (
            u16::from_le_bytes([self.data[at], self.data[at + 1]]),
            at + 2,
        )
    }

    /// Unscaled sums `Σ q · x` of group `g` (the caller applies [`Self::scale`]).
    pub(super) fn group_portable(
        &self,
        cols: usize,
        g: usize,
        p: &super::Prepared,
        sums: &mut [f32; GROUP],
    ) {
        let base = g * self.group_len(cols);
        for (&c, &xv) in p.cols.iter().zip(&p.xs) {
            let (mut bits, mut pos) = self.record_at(base, c as usize);
            while bits != 0 {
                let i = bits.trailing_zeros() as usize;
                sums[i] += self.data[pos] as i8 as f32 * xv;
                pos += 1;
                bits &= bits - 1;
            }
        }
    }

    /// Multiplies the unscaled sums of group `g` by the row scales.
    pub(super) fn scale(&self, g: usize, sums: &mut [f32; GROUP]) {
        for (s, k) in sums
            .iter_mut()
            .zip(&self.scales[g * GROUP..(g + 1) * GROUP])
        {
            *s *= k;
        }
    }

    /// Writes group `g`'s rows (`rows.len() / cols` of them) as dense f16 (zeros already in
    /// place): `q · s` is the stored value exactly. The AVX-512 levels convert a record's 16
    /// rows at once (`half`'s scalar conversion per value made prefill ~25% slower than with
    /// f16 records, which are copied).
    pub(super) fn decode_group(&self, level: SimdLevel, cols: usize, g: usize, rows: &mut [f16]) {
        debug_assert!(rows.len() <= GROUP * cols);
        #[cfg(target_arch = "x86_64")]
        if level >= SimdLevel::Avx512 {
            // SAFETY: the level is supported (the caller capped it by `or_portable`); the
            // records were built for `cols` columns, `g < groups`, and `rows` holds the
            // group's rows, `cols` entries each.
            unsafe { x86::decode_group_avx512(self, cols, g, rows) };
            return;
        }
        let _ = level;
        let base = g * self.group_len(cols);
        for c in 0..cols {
            let (mut bits, mut pos) = self.record_at(base, c);
            while bits != 0 {
                let i = bits.trailing_zeros() as usize;
                let v = self.data[pos] as i8 as f32 * self.scales[g * GROUP + i];
                rows[i * cols + c] = f16::from_f32(v);
                pos += 1;
                bits &= bits - 1;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::super::{Prepared, GROUP};
    use super::Int8Records;
    use crate::tiled_cbc::columns::RANKS;
    use std::arch::x86_64::*;

    /// The mask and a pointer to the first index of column `c` of the group at `base`.
    #[inline(always)]
    unsafe fn record(r: &Int8Records, base: *const u8, c: u32) -> (u16, *const u8) {
        let at = base.add(c as usize * r.record);
        ((at as *const u16).read_unaligned(), at.add(2))
    }

    /// Per active column: a masked load of the N indices, `vpexpandb` by the row mask,
    /// `vpmovsxbd`, `vcvtdq2ps`, one FMA; two sums for alternate columns. Unscaled sums.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL/VBMI2; `r` built by `Int8Records::build` for a matrix
    /// of `cols` columns and N = `slots`, `g < groups`, `p` prepared for that matrix.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2")]
    pub unsafe fn group_vbmi2(
        r: &Int8Records,
        cols: usize,
        slots: usize,
        g: usize,
        p: &Prepared,
        out: &mut [f32; GROUP],
    ) {
        let base = r.data.as_ptr().add(g * r.group_len(cols));
        let load = ((1u32 << slots) - 1) as u16;
        #[inline(always)]
        unsafe fn one(
            r: &Int8Records,
            base: *const u8,
            load: u16,
            c: u32,
            xv: f32,
            acc: &mut __m512,
        ) {
            let (m, v) = record(r, base, c);
            let raw = _mm_maskz_loadu_epi8(load, v as *const i8);
            let e = _mm_maskz_expand_epi8(m, raw);
            let f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(e));
            *acc = _mm512_fmadd_ps(f, _mm512_set1_ps(xv), *acc);
        }
        let mut a = _mm512_setzero_ps();
        let mut b = _mm512_setzero_ps();
        let pairs = p.cols.len() / 2;
        for j in 0..pairs {
            let (c0, c1) = (
                *p.cols.get_unchecked(2 * j),
                *p.cols.get_unchecked(2 * j + 1),
            );
            let (x0, x1) = (*p.xs.get_unchecked(2 * j), *p.xs.get_unchecked(2 * j + 1));
            one(r, base, load, c0, x0, &mut a);
            one(r, base, load, c1, x1, &mut b);
        }
        if p.cols.len() % 2 == 1 {
            one(r, base, load, p.cols[2 * pairs], p.xs[2 * pairs], &mut a);
        }
        _mm512_storeu_ps(out.as_mut_ptr(), _mm512_add_ps(a, b));
    }

    /// [`group_vbmi2`] without VBMI2: a masked byte load, `vpmovsxbd`, `vcvtdq2ps`, then
    /// `vexpandps` by the mask.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL; otherwise as for [`group_vbmi2`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn group_avx512(
        r: &Int8Records,
        cols: usize,
        slots: usize,
        g: usize,
        p: &Prepared,
        out: &mut [f32; GROUP],
    ) {
        let base = r.data.as_ptr().add(g * r.group_len(cols));
        let load = ((1u32 << slots) - 1) as u16;
        let mut acc = [_mm512_setzero_ps(); 2];
        for (j, (&c, &xv)) in p.cols.iter().zip(&p.xs).enumerate() {
            let (m, v) = record(r, base, c);
            let raw = _mm_maskz_loadu_epi8(load, v as *const i8);
            let f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
            let e = _mm512_maskz_expand_ps(m, f);
            let a = acc.get_unchecked_mut(j & 1);
            *a = _mm512_fmadd_ps(e, _mm512_set1_ps(xv), *a);
        }
        _mm512_storeu_ps(out.as_mut_ptr(), _mm512_add_ps(acc[0], acc[1]));
    }

    /// [`Int8Records::decode_group`] with AVX-512: per record a masked byte load, `vpmovsxbd`,
    /// `vcvtdq2ps`, `vexpandps` by the row mask, one multiply by the 16 row scales, one
    /// `vcvtps2ph`; the set rows' values are then stored one by one (the rows are `cols` apart).
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL and F16C; `r` built for a matrix of `cols` columns,
    /// `g < groups`, `rows.len() <= 16 · cols` (the rows of group `g`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    pub unsafe fn decode_group_avx512(
        r: &Int8Records,
        cols: usize,
        g: usize,
        rows: &mut [half::f16],
    ) {
        let base = r.data.as_ptr().add(g * r.group_len(cols));
        let load = ((1u32 << r.slots) - 1) as u16;
        let scales = _mm512_loadu_ps(r.scales.as_ptr().add(g * GROUP));
        let present = rows.len() / cols.max(1);
        let mut tmp = [0u16; GROUP];
        for c in 0..cols {
            let (m, v) = record(r, base, c as u32);
            if m == 0 {
                continue;
            }
            let raw = _mm_maskz_loadu_epi8(load, v as *const i8);
            let f = _mm512_maskz_expand_ps(m, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)));
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

    /// Per active column and 8 rows: an 8-byte load, `vpmovsxbd`, `vcvtdq2ps`, `vpermps` by the
    /// rank of each set bit, a mask of the set bits, one FMA.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and POPCNT; otherwise as for [`group_vbmi2`]. Loads of 8
    /// bytes may run past a record (into the next one or the TAIL bytes), never past `data`.
    #[target_feature(enable = "avx2,fma,popcnt")]
    pub unsafe fn group_avx2(
        r: &Int8Records,
        cols: usize,
        g: usize,
        p: &Prepared,
        out: &mut [f32; GROUP],
    ) {
        let base = r.data.as_ptr().add(g * r.group_len(cols));
        let lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        let mut acc = [_mm256_setzero_ps(); 2];
        for (&c, &xv) in p.cols.iter().zip(&p.xs) {
            let (m, mut v) = record(r, base, c);
            let vx = _mm256_set1_ps(xv);
            for (h, a) in acc.iter_mut().enumerate() {
                let mb = ((m >> (8 * h)) & 0xff) as usize;
                if mb == 0 {
                    continue;
                }
                let raw = _mm_loadl_epi64(v as *const __m128i);
                let f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
                let idx = _mm256_loadu_si256(RANKS.as_ptr().add(mb) as *const __m256i);
                let placed = _mm256_permutevar8x32_ps(f, idx);
                let sel = _mm256_set1_epi32(mb as i32);
                let keep = _mm256_cmpeq_epi32(_mm256_and_si256(sel, lane_bits), lane_bits);
                let placed = _mm256_and_ps(placed, _mm256_castsi256_ps(keep));
                *a = _mm256_fmadd_ps(placed, vx, *a);
                v = v.add(mb.count_ones() as usize);
            }
        }
        _mm256_storeu_ps(out.as_mut_ptr(), acc[0]);
        _mm256_storeu_ps(out.as_mut_ptr().add(8), acc[1]);
    }
}
