//! 4-bit records of [`super::FastBalancedCbc`] over **quads of columns**, multiplied with 8-bit
//! activations by AVX-512 VNNI (`vpdpbusd`): the layout the loader builds for 4-bit grids when
//! `SIEVE_BCBC_CPU=int4-quads` asks and the CPU has AVX-512 VBMI2 and VNNI. Not the default:
//! measured slower end to end than the per-column records on the 2-core Zen 4 (see
//! `FastBalancedCbc::int4_from`).
//!
//! Why: the per-column 4-bit records ([`super::int4`]) spend one expand, one conversion and one
//! 512-bit FMA on each active (column, group of 16 rows), 16 lanes for N = 8 weights; measured
//! on the 2-core Zen 4, that kernel ran at the 8-bit records' speed, bound by instructions, not
//! bytes. `vpdpbusd` multiplies 64 byte pairs at once, 16 rows x 4 columns, so a quad of
//! columns stores its 16 x 4 tile directly:
//!
//! ```text
//! record of (group of 16 rows g, quad of columns 4 u .. 4 u + 3), 8 + 2 N bytes, unaligned:
//!   u64 tile mask: bit 4 i + j = row 16 g + i stores column 4 u + j
//!   4 N nibbles: the stored values in the order of their mask bits (row-major in the tile),
//!   each q + 8 (offset binary, 1..=15), low nibble of a byte first; 0 fill
//! groups one after the other, each the ceil(K / 4) quads in order; then TAIL zero bytes.
//! scales: f16, [(g · column_groups + j) · 16 + i], as in the per-column 4-bit records.
//! ```
//!
//! Balanced N:16 bounds a quad's values by 4 N, so the records need no offsets. At N = 8 a
//! quad is 24 bytes, the same 6 bytes per column as the per-column records.
//!
//! Activations: the active inputs (TEAL) are quantized per block of 32 columns to `i8`
//! (`x ≈ d_b · x_q`, `d_b = max |x| / 127`, inactive inputs 0), as the GGUF block products
//! quantize theirs (8-bit activations, like llama.cpp), and packed 4 per `u32` per quad.
//!
//! Kernel, per group of 16 rows and quad whose activations are not all 0: one load of the
//! mask, one of the nibbles; the nibbles spread to the high halves of bytes (`16 (q + 8)`,
//! 16..=240) by shifts, masks and a ternary-logic merge; `vpexpandb` by the tile mask into a
//! register of 128s (the zero point: an unstored weight is `16 · 8`); one `vpdpbusd` with the
//! quad's four activations broadcast. Per block of 32 columns the 16 `i32` sums
//! `Σ 16 (q + 8) x_q = 16 Σ q x_q + 128 Σ x_q` lose the block's `128 Σ x_q` and are scaled by
//! `d_b / 16` times the 16 rows' grid scales into f32 sums.
//!
//! The portable kernel walks the tiles' bits with f32 activations (the reference, and the path
//! for activations that are not finite).

use super::int4::{GroupScales, BOUND_STEP};
use super::{Prepared, SimdLevel, GROUP};
use half::f16;
use rayon::prelude::*;
use sieve_formats::matrix::is_zero;
use sieve_formats::DenseMatrix;

/// Columns per quad.
const QUAD: usize = 4;
/// Bytes after the last group: a kernel reads 32 bytes of nibbles after any record's mask.
const TAIL: usize = 40;

/// Whether this CPU runs the quad kernel (AVX-512 VBMI2 and VNNI), whatever `SIEVE_CPU_SIMD`
/// says: the records are built for the CPU; the kernel runs only at the VBMI2 level
/// ([`Int4Quads::group`]).
pub(super) fn supported() -> bool {
    SimdLevel::Avx512Vbmi2.vnni()
}

/// The 4-bit quad records of a matrix (module notes).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Int4Quads {
    /// Bytes per quad: the mask and `2 N` bytes of nibbles.
    record: usize,
    /// N, the values per (group, column).
    slots: usize,
    /// `ceil(K / 4)`.
    quads: usize,
    /// `groups · quads · record` bytes, then [`TAIL`] zeros.
    data: Vec<u8>,
    /// The scales (module notes).
    scales: GroupScales,
}

/// One token's activations quantized for the quad kernel (module notes).
#[derive(Clone, Debug, Default)]
pub(super) struct QuadActivations {
    /// Per quad, its four `i8` activations (inactive ones 0), column 4 u + j in byte j.
    packed: Vec<u32>,
    /// Per block of 32 columns, `d_b / 16`.
    factor: Vec<f32>,
    /// Per block of 32 columns, `128 Σ x_q`.
    offset: Vec<i32>,
}

impl QuadActivations {
    /// Quantizes `x` masked to its active inputs `cols` (ascending) with values `xs`; all
    /// values finite.
    pub(super) fn new(k: usize, cols: &[u32], xs: &[f32]) -> Self {
        let blocks = k.div_ceil(BOUND_STEP);
        let mut amax = vec![0f32; blocks];
        for (&c, &v) in cols.iter().zip(xs) {
            let b = c as usize / BOUND_STEP;
            amax[b] = amax[b].max(v.abs());
        }
        let d: Vec<f32> = amax.iter().map(|a| a / 127.0).collect();
        let mut bytes = vec![0i8; k.div_ceil(QUAD) * QUAD];
        let mut offset = vec![0i32; blocks];
        let inv: Vec<f32> = d
            .iter()
            .map(|&d| if d > 0.0 { 1.0 / d } else { 0.0 })
            .collect();
        for (&c, &v) in cols.iter().zip(xs) {
            let b = c as usize / BOUND_STEP;
            // Round half away from zero by truncation (`f32::round` is a libm call without
            // SSE4.1 in the baseline target); |v · inv| <= 127 up to rounding, clamped.
            let q = (v * inv[b] + 0.5f32.copysign(v)).clamp(-127.0, 127.0) as i8;
            bytes[c as usize] = q;
            offset[b] += 128 * q as i32;
        }
        let packed = bytes
            .chunks_exact(QUAD)
            .map(|b| u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8]))
            .collect();
        Self {
            packed,
            factor: d.iter().map(|d| d / 16.0).collect(),
            offset,
        }
    }
}

impl Int4Quads {
    /// The quad records of `w` when every row lies on 4-bit grids of one of the
    /// [`super::int4::COLUMN_GROUPS`] sizes, else `None`.
    pub(super) fn build(w: &DenseMatrix, slots: usize) -> Option<Self> {
        if slots > GROUP {
            return None;
        }
        let (m, k) = (w.rows(), w.cols());
        let (scales, row_scales) = GroupScales::detect(w)?;
        let (columns, column_groups) = (scales.columns, scales.column_groups);
        let groups = m.div_ceil(GROUP);
        let quads = k.div_ceil(QUAD);
        let record = 8 + 2 * slots;
        let group_len = quads * record;
        let mut data = vec![0u8; groups * group_len + TAIL];
        let src = w.data();
        data[..groups * group_len]
            .par_chunks_mut(group_len.max(1))
            .enumerate()
            .for_each(|(g, out)| {
                let rows = g * GROUP..((g + 1) * GROUP).min(m);
                for u in 0..quads {
                    let at = u * record;
                    let mut mask = 0u64;
                    let mut t = 0;
                    for (i, r) in rows.clone().enumerate() {
                        for c in (u * QUAD..(u + 1) * QUAD).filter(|&c| c < k) {
                            let v = src[r * k + c];
                            if !is_zero(v) {
                                mask |= 1 << (QUAD * i + c % QUAD);
                                // v = q · s exactly (detected), so the quotient is q exactly.
                                let s = row_scales[r * column_groups + c / columns];
                                let q = (v.to_f32() / s).round() as i32;
                                out[at + 8 + t / 2] |= ((q + 8) as u8) << (4 * (t % 2));
                                t += 1;
                            }
                        }
                    }
                    debug_assert!(t <= QUAD * slots);
                    out[at..at + 8].copy_from_slice(&mask.to_le_bytes());
                }
            });
        Some(Self {
            record,
            slots,
            quads,
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

    fn group_len(&self) -> usize {
        self.quads * self.record
    }

    /// Calls `f(i, c, q)` for every stored weight of group `g` (row `16 g + i`, column `c`,
    /// grid index `q`), quad by quad.
    fn for_each_stored(&self, g: usize, mut f: impl FnMut(usize, usize, i32)) {
        let base = g * self.group_len();
        for u in 0..self.quads {
            let at = base + u * self.record;
            let mut bits = u64::from_le_bytes(self.data[at..at + 8].try_into().expect("8 bytes"));
            let mut t = 0;
            while bits != 0 {
                let p = bits.trailing_zeros() as usize;
                let nibble = self.data[at + 8 + t / 2] >> (4 * (t % 2)) & 0x0f;
                f(p / QUAD, u * QUAD + p % QUAD, nibble as i32 - 8);
                t += 1;
                bits &= bits - 1;
            }
        }
    }

    /// `sums[i] = W[16 g + i] · x` through the kernels of `level`; `p` the prepared active
    /// inputs, `qa` their quantization (`None` when some are not finite: the portable walk
    /// then runs).
    pub(super) fn group(
        &self,
        level: SimdLevel,
        g: usize,
        p: &Prepared,
        qa: Option<&QuadActivations>,
        sums: &mut [f32; GROUP],
    ) {
        match (level, qa) {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: VBMI2 is supported (callers cap the level by `or_portable`) and the
            // records are only built where VNNI is too (`supported`, or a test that checked
            // it); the records were built by `build` (TAIL bytes after the last group), `g <
            // groups`, `qa` quantizes this matrix's K inputs.
            (SimdLevel::Avx512Vbmi2, Some(qa)) => unsafe {
                if self.slots > 8 {
                    x86::group_vnni::<true>(self, g, qa, sums)
                } else {
                    x86::group_vnni::<false>(self, g, qa, sums)
                }
            },
            _ => self.group_portable(g, p, sums),
        }
    }

    /// The walk of the tiles' bits with f32 activations, scaled per column group.
    fn group_portable(&self, g: usize, p: &Prepared, sums: &mut [f32; GROUP]) {
        let mut x = vec![0f32; self.quads * QUAD];
        for (&c, &v) in p.cols.iter().zip(&p.xs) {
            x[c as usize] = v;
        }
        let mut part = vec![[0f32; GROUP]; self.scales.column_groups];
        self.for_each_stored(g, |i, c, q| {
            if x[c] != 0.0 {
                part[c / self.scales.columns][i] += q as f32 * x[c];
            }
        });
        *sums = [0.0; GROUP];
        for (j, p) in part.iter().enumerate() {
            for ((s, p), k) in sums.iter_mut().zip(p).zip(self.scales.of(g, j)) {
                *s += p * k.to_f32();
            }
        }
    }

    /// Writes group `g`'s rows (`rows.len() / cols` of them) as dense f16 (zeros already in
    /// place): `q · s` is the stored value exactly.
    pub(super) fn decode_group(&self, cols: usize, g: usize, rows: &mut [f16]) {
        debug_assert!(rows.len() <= GROUP * cols);
        self.for_each_stored(g, |i, c, q| {
            let s = self.scales.of(g, c / self.scales.columns)[i].to_f32();
            rows[i * cols + c] = f16::from_f32(q as f32 * s);
        });
    }

    /// The product the quad kernel computes, in f64 from the quantized activations: what the
    /// VNNI kernel must match up to f32 rounding (tests).
    #[cfg(test)]
    pub(super) fn quantized_reference(&self, g: usize, qa: &QuadActivations) -> [f64; GROUP] {
        let mut sums = [0f64; GROUP];
        self.for_each_stored(g, |i, c, q| {
            let xq = (qa.packed[c / QUAD] >> (8 * (c % QUAD))) as u8 as i8;
            let b = c / BOUND_STEP;
            let s = self.scales.of(g, c / self.scales.columns)[i].to_f64();
            sums[i] += q as f64 * xq as f64 * qa.factor[b] as f64 * 16.0 * s;
        });
        sums
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::GROUP;
    use super::{Int4Quads, QuadActivations, BOUND_STEP, QUAD};
    use std::arch::x86_64::*;

    /// Bytes ahead of a block's records that are prefetched when it starts (as for the
    /// per-column 4-bit records, [`super::super::int4`]).
    const PREFETCH_AHEAD: usize = 2048;

    /// The nibbles at `p` (16 bytes, or 32 when `WIDE`) spread to bytes `16 (q + 8)`, low
    /// nibble first: per 16-bit word `0x00HL` -> `0xH0L0` (256-bit operations for N <= 8:
    /// 512-bit ones take a pipe for two cycles on Zen 4).
    #[inline(always)]
    unsafe fn spread<const WIDE: bool>(p: *const u8) -> __m512i {
        // (lo & 0x00f0) | hi: ternary-logic table 0xec = A & C | B over (A, B, C).
        if WIDE {
            let w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(p as *const __m256i));
            let lo = _mm512_slli_epi16::<4>(w);
            let hi = _mm512_slli_epi16::<8>(_mm512_and_si512(w, _mm512_set1_epi16(0xf0)));
            _mm512_ternarylogic_epi32::<0xec>(lo, hi, _mm512_set1_epi16(0x00f0))
        } else {
            let w = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
            let lo = _mm256_slli_epi16::<4>(w);
            let hi = _mm256_slli_epi16::<8>(_mm256_and_si256(w, _mm256_set1_epi16(0xf0)));
            let bytes = _mm256_ternarylogic_epi32::<0xec>(lo, hi, _mm256_set1_epi16(0x00f0));
            _mm512_castsi256_si512(bytes)
        }
    }

    /// One quad: the tile (`vpexpandb` of its spread nibbles by its mask into 128s) times its
    /// activations `xq`, added to `acc` by `vpdpbusd`.
    #[inline(always)]
    unsafe fn quad<const WIDE: bool>(at: *const u8, xq: u32, acc: &mut __m512i) {
        let mask = (at as *const u64).read_unaligned();
        let tile = _mm512_mask_expand_epi8(_mm512_set1_epi8(-128), mask, spread::<WIDE>(at.add(8)));
        *acc = _mm512_dpbusd_epi32(*acc, tile, _mm512_set1_epi32(xq as i32));
    }

    /// Per block of 32 columns: per quad with an active input, the tile (`vpexpandb` of the
    /// spread nibbles by the tile mask into 128s) times the quad's activations by
    /// `vpdpbusd`, two sums alternating; then the block's offset removed and its factor and
    /// the rows' scales applied in f32. `WIDE`: N > 8.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL/VBMI2/VNNI and F16C; `r` built by
    /// `Int4Quads::build`, `g < groups`, `qa` quantizes the matrix's K inputs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx512vnni,f16c")]
    pub unsafe fn group_vnni<const WIDE: bool>(
        r: &Int4Quads,
        g: usize,
        qa: &QuadActivations,
        out: &mut [f32; GROUP],
    ) {
        let base = r.data.as_ptr().add(g * r.group_len());
        let per_block = BOUND_STEP / QUAD;
        let span = per_block * r.record;
        let mut total = _mm512_setzero_ps();
        for (b, (&factor, &offset)) in qa.factor.iter().zip(&qa.offset).enumerate() {
            let from = base.wrapping_add(b * span + PREFETCH_AHEAD);
            let mut off = 0;
            while off < span {
                _mm_prefetch::<_MM_HINT_T0>(from.wrapping_add(off) as *const i8);
                off += 64;
            }
            if factor == 0.0 {
                continue;
            }
            let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            let (u0, u1) = (b * per_block, ((b + 1) * per_block).min(r.quads));
            let xs = qa.packed.as_ptr().add(u0);
            let mut at = base.add(u0 * r.record);
            // Two quads per step into two sums; a quad whose four activations are 0 adds 0
            // and is skipped (at dp 0.5 one in 16, at dp 0.9 two in three).
            let mut i = 0;
            while i + 2 <= u1 - u0 {
                let (x0, x1) = (*xs.add(i), *xs.add(i + 1));
                if x0 != 0 {
                    quad::<WIDE>(at, x0, &mut s0);
                }
                if x1 != 0 {
                    quad::<WIDE>(at.add(r.record), x1, &mut s1);
                }
                at = at.add(2 * r.record);
                i += 2;
            }
            if i < u1 - u0 && *xs.add(i) != 0 {
                quad::<WIDE>(at, *xs.add(i), &mut s0);
            }
            let sums = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(offset));
            let j = b * BOUND_STEP / r.scales.columns;
            let sc = r.scales.of(g, j).as_ptr();
            let sc = _mm512_cvtph_ps(_mm256_loadu_si256(sc as *const __m256i));
            let k = _mm512_mul_ps(sc, _mm512_set1_ps(factor));
            total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), k, total);
        }
        _mm512_storeu_ps(out.as_mut_ptr(), total);
    }
}
