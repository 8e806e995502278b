//! Products of the GGUF block types whose weights carry an offset or several scales per block:
//! Q5_0 and Q5_1 (blocks of 32), Q4_K, Q5_K and Q6_K (super-blocks of 256, ggml's K-quants; the
//! layouts are listed in [`crate::gguf_blocks::dequant`]).
//!
//! Every one of them is, over each 32-element sub-block `j` of a row, unsigned integers `u`
//! (4, 5 or 6 bits) times a scale, plus an offset:
//!
//! | type | `u` | weight |
//! |---|---|---|
//! | Q5_0 | 5 bits | `d · (u - 16)` |
//! | Q5_1 | 5 bits | `d · u + m` |
//! | Q4_K | 4 bits | `d · sc_j · u - dmin · m_j` (6-bit `sc_j`, `m_j`) |
//! | Q5_K | 5 bits | as Q4_K |
//! | Q6_K | 6 bits | `d · sc_g · (u - 32)`, an i8 `sc_g` per 16 elements |
//!
//! Against the 8-bit activation blocks of [`Q8Activations`] (`x ≈ dx_b · qx`, one f32 `dx_b`
//! per 32, the blocks the Q4_0/Q4_1/Q8_0 products use), the dot product of a sub-block is
//! therefore `A_j · Σ u·qx + B_j · (dx_b Σ qx)`: one unsigned-by-signed integer dot product
//! (`vpmaddubsw` + `vpmaddwd` on AVX2, `vpdpbusd` with AVX-512 VNNI: no sign juggling, since
//! `u` is unsigned) and two f32 multiply-adds, with `A_j = d·sc_j·dx_b` and `B_j` the offset
//! coefficient times the block sum the activations carry (`sums`, and `sums16` per 16 for
//! Q6_K). Keeping the activations in blocks of 32 (llama.cpp uses one scale per 256 for the
//! K-quants) costs an f32 multiply-add per 32 products and keeps every matrix of a model on one
//! activation format, so fused q/k/v and gate/up groups mix block types freely and batched
//! products stay equal to single-token ones.
//!
//! The integer sums are exact (at most 32 · 63 · 127 in magnitude), so the three paths differ
//! only in the order of their f32 additions.

use super::{read_f16, BlockType, Q8Activations, BLOCK};
use crate::gguf_blocks::dequant::k_scales_and_mins;
use crate::simd::SimdLevel;

/// Which kernel multiplies the offset block types, chosen once per process from
/// [`SimdLevel::detect`] (so `SIEVE_CPU_SIMD` caps it too).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DotPath {
    Portable,
    /// AVX2 + FMA + F16C: `vpmaddubsw` / `vpmaddwd`.
    Avx2,
    /// AVX-512 (F, BW, VL) with VNNI: `vpdpbusd` on 256-bit registers.
    Avx512Vnni,
}

impl DotPath {
    pub fn name(self) -> &'static str {
        match self {
            DotPath::Portable => "portable",
            DotPath::Avx2 => "avx2",
            DotPath::Avx512Vnni => "avx512-vnni",
        }
    }

    pub fn supported(self) -> bool {
        match self {
            DotPath::Portable => true,
            DotPath::Avx2 => SimdLevel::Avx2.supported(),
            DotPath::Avx512Vnni => SimdLevel::Avx512.vnni(),
        }
    }

    /// Every path this CPU runs (for tests that check each against the reference).
    pub fn available() -> Vec<DotPath> {
        [DotPath::Portable, DotPath::Avx2, DotPath::Avx512Vnni]
            .into_iter()
            .filter(|p| p.supported())
            .collect()
    }

    /// The path the products use: the best one allowed by [`SimdLevel::detect`].
    pub fn detect() -> DotPath {
        let level = SimdLevel::detect();
        if level.vnni() {
            DotPath::Avx512Vnni
        } else if level >= SimdLevel::Avx2 && DotPath::Avx2.supported() {
            DotPath::Avx2
        } else {
            DotPath::Portable
        }
    }
}

/// Whether `ty` is one of the types this module multiplies.
pub fn handles(ty: BlockType) -> bool {
    matches!(
        ty,
        BlockType::Q5_0 | BlockType::Q5_1 | BlockType::Q4_K | BlockType::Q5_K | BlockType::Q6_K
    )
}

/// An upper bound on `|w|` over the weights of one block, for the f16-range check of
/// [`super::QuantMatrix::new`] (NaN or infinite when a scale is).
pub fn weight_bound(ty: BlockType, b: &[u8]) -> f32 {
    let finite_or_nan = |scales: &[f32], bound: f32| {
        if scales.iter().all(|s| s.is_finite()) {
            bound
        } else {
            f32::NAN
        }
    };
    match ty {
        BlockType::Q5_0 => 16.0 * read_f16(b, 0).abs(),
        BlockType::Q5_1 => 31.0 * read_f16(b, 0).abs() + read_f16(b, 2).abs(),
        BlockType::Q4_K | BlockType::Q5_K => {
            let top = if ty == BlockType::Q4_K { 15.0 } else { 31.0 };
            let (d, dmin) = (read_f16(b, 0).abs(), read_f16(b, 2).abs());
            let bound = k_scales_and_mins(&b[4..16])
                .iter()
                .map(|&(sc, m)| d * sc as f32 * top + dmin * m as f32)
                .fold(0f32, f32::max);
            finite_or_nan(&[d, dmin], bound)
        }
        BlockType::Q6_K => {
            let d = read_f16(b, 208).abs();
            let sc = b[192..208]
                .iter()
                .map(|&s| (s as i8 as f32).abs())
                .fold(0f32, f32::max);
            finite_or_nan(&[d], 32.0 * d * sc)
        }
        _ => unreachable!("only called for the types `handles` lists"),
    }
}

/// The unsigned values `u` of one block of `ty` in element order (`out.len()` = the block's
/// elements).
fn unpack_values(ty: BlockType, b: &[u8], out: &mut [u8]) {
    let fifth_bits = |qh: u32, qs: &[u8], out: &mut [u8]| {
        for j in 0..16 {
            out[j] = (qs[j] & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
            out[j + 16] = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
        }
    };
    match ty {
        BlockType::Q5_0 => fifth_bits(u32::from_le_bytes([b[2], b[3], b[4], b[5]]), &b[6..], out),
        BlockType::Q5_1 => fifth_bits(u32::from_le_bytes([b[4], b[5], b[6], b[7]]), &b[8..], out),
        BlockType::Q4_K | BlockType::Q5_K => {
            let (qh, qs) = if ty == BlockType::Q5_K {
                (Some(&b[16..48]), &b[48..176])
            } else {
                (None, &b[16..144])
            };
            for chunk in 0..4 {
                for l in 0..32 {
                    let q = qs[32 * chunk + l];
                    let (lo, hi) = (2 * chunk, 2 * chunk + 1);
                    let (mut a, mut c) = (q & 0x0F, q >> 4);
                    if let Some(qh) = qh {
                        a |= ((qh[l] >> lo) & 1) << 4;
                        c |= ((qh[l] >> hi) & 1) << 4;
                    }
                    out[64 * chunk + l] = a;
                    out[64 * chunk + 32 + l] = c;
                }
            }
        }
        BlockType::Q6_K => {
            for half in 0..2 {
                let ql = &b[64 * half..64 * half + 64];
                let qh = &b[128 + 32 * half..128 + 32 * half + 32];
                let o = &mut out[128 * half..128 * half + 128];
                for l in 0..32 {
                    o[l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
                    o[l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
                    o[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    o[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                }
            }
        }
        _ => unreachable!("only called for the types `handles` lists"),
    }
}

fn isum(u: &[u8], x: &[i8]) -> i32 {
    u.iter().zip(x).map(|(&a, &b)| a as i32 * b as i32).sum()
}

/// The portable dot product of one row of blocks with `xq`: exact integer sums per sub-block,
/// then `A · Σ u qx + B · sum` in f32.
pub fn dot_row_portable(ty: BlockType, row: &[u8], xq: &Q8Activations) -> f32 {
    let (elems, bb) = (ty.block_elems(), ty.block_bytes());
    let nb = (row.len() / bb).min(xq.whole_blocks() * BLOCK / elems);
    let mut u = [0u8; 256];
    let mut acc = 0f32;
    for (s, blk) in row.chunks_exact(bb).take(nb).enumerate() {
        let u = &mut u[..elems];
        unpack_values(ty, blk, u);
        let b0 = s * elems / BLOCK;
        let xs = &xq.quants[b0 * BLOCK..(b0 + elems / BLOCK) * BLOCK];
        match ty {
            BlockType::Q5_0 | BlockType::Q5_1 => {
                let d = read_f16(blk, 0);
                let offset = if ty == BlockType::Q5_0 {
                    -16.0 * d
                } else {
                    read_f16(blk, 2)
                };
                acc += d * xq.scales[b0] * isum(u, xs) as f32 + offset * xq.sums[b0];
            }
            BlockType::Q4_K | BlockType::Q5_K => {
                let (d, dmin) = (read_f16(blk, 0), read_f16(blk, 2));
                for (j, (sc, m)) in k_scales_and_mins(&blk[4..16]).into_iter().enumerate() {
                    let r = j * BLOCK..(j + 1) * BLOCK;
                    let a = d * sc as f32 * xq.scales[b0 + j];
                    acc +=
                        a * isum(&u[r.clone()], &xs[r]) as f32 - dmin * m as f32 * xq.sums[b0 + j];
                }
            }
            BlockType::Q6_K => {
                let d = read_f16(blk, 208);
                for g in 0..16 {
                    let sc = blk[192 + g] as i8 as f32;
                    let r = g * 16..(g + 1) * 16;
                    let a = d * sc * xq.scales[b0 + g / 2];
                    acc += a * isum(&u[r.clone()], &xs[r]) as f32
                        - 32.0 * d * sc * xq.sums16[2 * b0 + g];
                }
            }
            _ => unreachable!("only called for the types `handles` lists"),
        }
    }
    acc
}

/// `out[i] = row i · x` for the `out.len()` consecutive rows of `row_bytes` in `blocks`.
pub fn rows_into(
    path: DotPath,
    ty: BlockType,
    blocks: &[u8],
    row_bytes: usize,
    xq: &Q8Activations,
    out: &mut [f32],
) {
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `path` is only ever a supported one (`DotPath::detect` or a test iterating
        // `DotPath::available`); the kernels read only whole rows of `blocks` and whole blocks
        // of `xq`.
        DotPath::Avx2 if path.supported() => unsafe {
            x86::rows_into_avx2(ty, blocks, row_bytes, xq, out)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        DotPath::Avx512Vnni if path.supported() => unsafe {
            x86::rows_into_vnni(ty, blocks, row_bytes, xq, out)
        },
        _ => {
            for (o, row) in out.iter_mut().zip(blocks.chunks_exact(row_bytes.max(1))) {
                *o = dot_row_portable(ty, row, xq);
            }
        }
    }
}

/// One row of blocks against `xq` on `path`.
pub fn dot_row(path: DotPath, ty: BlockType, row: &[u8], xq: &Q8Activations) -> f32 {
    let mut out = [0f32];
    rows_into(path, ty, row, row.len(), xq, &mut out);
    out[0]
}

/// Row dequantization with ggml's arithmetic: the AVX2 kernels (prefill unpacks every weight
/// row for the GEMM) give exactly the values of [`crate::gguf_blocks::dequant`]'s block kernels.
pub fn dequantize_row(ty: BlockType, row: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if DotPath::detect() >= DotPath::Avx2 {
        // SAFETY: the detected path's features include AVX2, FMA and F16C; the kernel writes
        // only the blocks that both `row` and `out` hold in full.
        return unsafe { x86::dequantize_row(ty, row, out) };
    }
    dequantize_row_portable(ty, row, out)
}

/// [`dequantize_row`] with [`crate::gguf_blocks::dequant`]'s block kernels.
pub fn dequantize_row_portable(ty: BlockType, row: &[u8], out: &mut [f32]) {
    let kernel = crate::gguf_blocks::dequant::block_kernel(ty.ggml())
        .expect("every BlockType has a dequantization kernel");
    for (b, o) in row
        .chunks_exact(ty.block_bytes())
        .zip(out.chunks_exact_mut(ty.block_elems()))
    {
        kernel(b, o);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::{BlockType, Q8Activations, BLOCK};
    use std::arch::x86_64::*;

    const Q5_0: u8 = BlockType::Q5_0 as u8;
    const Q5_1: u8 = BlockType::Q5_1 as u8;
    const Q4_K: u8 = BlockType::Q4_K as u8;
    const Q5_K: u8 = BlockType::Q5_K as u8;
    const Q6_K: u8 = BlockType::Q6_K as u8;

    /// How far ahead each row stream is prefetched (as for the Q4_1 kernel, whose measurement
    /// chose 1024 bytes).
    const PREFETCH_BYTES: usize = 1024;

    use crate::kernels::x86::hsum;

    /// Σ u · x over each 4 consecutive bytes (u unsigned, at most 63; x signed) as 8 i32 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn dot32_avx2(u: __m256i, x: __m256i) -> __m256i {
        // |u·x| + |u'·x'| <= 2 · 63 · 127: the i16 pairs never saturate.
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1))
    }

    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
    unsafe fn dot32_vnni(u: __m256i, x: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x)
    }

    #[inline(always)]
    unsafe fn dot32<const VNNI: bool>(u: __m256i, x: __m256i) -> __m256i {
        if VNNI {
            dot32_vnni(u, x)
        } else {
            dot32_avx2(u, x)
        }
    }

    /// The 32 5-bit values of a Q5_0/Q5_1 block: nibbles of `qs` (low nibbles are elements
    /// 0..16, high 16..32) with bit j of `qh` as element j's fifth bit.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn q5_values(qs: *const u8, qh: u32) -> __m256i {
        let raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs as *const __m128i));
        let nib = _mm256_and_si256(
            _mm256_srlv_epi64(raw, _mm256_setr_epi64x(0, 0, 4, 4)),
            _mm256_set1_epi8(0x0F),
        );
        // Byte k takes byte k / 8 of qh, then keeps bit k % 8.
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(qh as i32),
            _mm256_setr_epi8(
                0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
                3, 3, 3, 3,
            ),
        );
        let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits);
        _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
    }

    /// [`q5_values`] with AVX-512 BW: `qh` is the byte mask itself, so the fifth bits are one
    /// masked add instead of a shuffle, a compare and two logic operations per block.
    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
    unsafe fn q5_values_bw(qs: *const u8, qh: u32) -> __m256i {
        let raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs as *const __m128i));
        let nib = _mm256_and_si256(
            _mm256_srlv_epi64(raw, _mm256_setr_epi64x(0, 0, 4, 4)),
            _mm256_set1_epi8(0x0F),
        );
        _mm256_mask_add_epi8(nib, qh, nib, _mm256_set1_epi8(0x10))
    }

    /// Bit `s` of each byte of `qh` moved to bit 4 (the fifth bit of Q5_K sub-block `s`).
    /// 16-bit shifts are safe: only bit 4 of each byte is kept, and for `s` in 0..8 it comes
    /// from the same byte.
    #[inline(always)]
    unsafe fn q5k_fifth_bit(qh: __m256i, s: usize) -> __m256i {
        let moved = match s {
            0 => _mm256_slli_epi16::<4>(qh),
            1 => _mm256_slli_epi16::<3>(qh),
            2 => _mm256_slli_epi16::<2>(qh),
            3 => _mm256_slli_epi16::<1>(qh),
            4 => qh,
            5 => _mm256_srli_epi16::<1>(qh),
            6 => _mm256_srli_epi16::<2>(qh),
            _ => _mm256_srli_epi16::<3>(qh),
        };
        _mm256_and_si256(moved, _mm256_set1_epi8(0x10))
    }

    /// Activation block `b` (32 quants).
    #[inline(always)]
    unsafe fn xload(xp: *const i8, b: usize) -> __m256i {
        _mm256_loadu_si256(xp.add(b * BLOCK) as *const __m256i)
    }

    /// The first 8 bytes of `v` as f32.
    #[inline(always)]
    unsafe fn widen(v: &[u8; 16]) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadu_si128(
            v.as_ptr() as *const __m128i
        )))
    }

    /// Row-by-`xq` dot products of `R` rows of `TY` blocks; `nb` blocks per row.
    #[inline(always)]
    unsafe fn dot_rows<const TY: u8, const R: usize, const VNNI: bool>(
        rows: [*const u8; R],
        nb: usize,
        xq: &Q8Activations,
    ) -> [f32; R] {
        let ty = BlockType::from_code(TY);
        let bb = ty.block_bytes();
        let elems = ty.block_elems();
        let (xp, sp, pp, s16) = (
            xq.quants.as_ptr(),
            xq.scales.as_ptr(),
            xq.pairs.as_ptr(),
            xq.sums16.as_ptr(),
        );
        let low4 = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); R];
        // The offset terms: 8 lanes for the K types, lane 1 for Q5_0/Q5_1.
        let mut offs = [_mm256_setzero_ps(); R];
        let mut offs1 = [_mm_setzero_ps(); R];
        for s in 0..nb {
            for row in rows {
                let mut at = 0;
                while at < bb {
                    // `wrapping_add`: past the end of the buffer a prefetch is a no-op.
                    _mm_prefetch::<_MM_HINT_T0>(
                        row.wrapping_add(s * bb + PREFETCH_BYTES + at) as *const i8
                    );
                    at += 64;
                }
            }
            let b0 = s * elems / BLOCK;
            match ty {
                BlockType::Q5_0 | BlockType::Q5_1 => {
                    let x = xload(xp, b0);
                    // [dx, dx Σ qx]
                    let pair = _mm_castpd_ps(_mm_load_sd(pp.add(2 * b0) as *const f64));
                    for r in 0..R {
                        let blk = rows[r].add(s * bb);
                        let (hdr, dm) = if ty == BlockType::Q5_0 {
                            let d = _mm_cvtph_ps(_mm_cvtsi32_si128(
                                (blk as *const u16).read_unaligned() as i32,
                            ));
                            // [d, -16 d]
                            (
                                2,
                                _mm_mul_ps(
                                    _mm_broadcastss_ps(d),
                                    _mm_setr_ps(1.0, -16.0, 0.0, 0.0),
                                ),
                            )
                        } else {
                            (
                                4,
                                _mm_cvtph_ps(_mm_cvtsi32_si128(
                                    (blk as *const i32).read_unaligned(),
                                )),
                            )
                        };
                        let qh = (blk.add(hdr) as *const u32).read_unaligned();
                        let u = if VNNI {
                            q5_values_bw(blk.add(hdr + 4), qh)
                        } else {
                            q5_values(blk.add(hdr + 4), qh)
                        };
                        let prod = _mm_mul_ps(dm, pair);
                        acc[r] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(dot32::<VNNI>(u, x)),
                            _mm256_broadcastss_ps(prod),
                            acc[r],
                        );
                        offs1[r] = _mm_add_ps(offs1[r], prod);
                    }
                }
                BlockType::Q4_K | BlockType::Q5_K => {
                    let dx = _mm256_loadu_ps(sp.add(b0));
                    let sums = _mm256_loadu_ps(xq.sums.as_ptr().add(b0));
                    for r in 0..R {
                        let blk = rows[r].add(s * bb);
                        let pairs = crate::gguf_blocks::dequant::k_scales_and_mins(
                            std::slice::from_raw_parts(blk.add(4), 12),
                        );
                        let (mut sc, mut mn) = ([0u8; 16], [0u8; 16]);
                        for j in 0..8 {
                            sc[j] = pairs[j].0;
                            mn[j] = pairs[j].1;
                        }
                        let dd =
                            _mm_cvtph_ps(_mm_cvtsi32_si128((blk as *const i32).read_unaligned()));
                        let d = _mm256_broadcastss_ps(dd);
                        let dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(dd));
                        let a = _mm256_mul_ps(_mm256_mul_ps(widen(&sc), d), dx);
                        offs[r] = _mm256_fnmadd_ps(_mm256_mul_ps(widen(&mn), dmin), sums, offs[r]);
                        let (qh, qs) = if ty == BlockType::Q5_K {
                            (
                                _mm256_loadu_si256(blk.add(16) as *const __m256i),
                                blk.add(48),
                            )
                        } else {
                            (_mm256_setzero_si256(), blk.add(16))
                        };
                        for chunk in 0..4 {
                            let v = _mm256_loadu_si256(qs.add(32 * chunk) as *const __m256i);
                            let mut lo = _mm256_and_si256(v, low4);
                            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4);
                            if ty == BlockType::Q5_K {
                                lo = _mm256_or_si256(lo, q5k_fifth_bit(qh, 2 * chunk));
                                hi = _mm256_or_si256(hi, q5k_fifth_bit(qh, 2 * chunk + 1));
                            }
                            for (k, u) in [lo, hi].into_iter().enumerate() {
                                let j = 2 * chunk + k;
                                let aj = _mm256_permutevar8x32_ps(a, _mm256_set1_epi32(j as i32));
                                acc[r] = _mm256_fmadd_ps(
                                    _mm256_cvtepi32_ps(dot32::<VNNI>(u, xload(xp, b0 + j))),
                                    aj,
                                    acc[r],
                                );
                            }
                        }
                    }
                }
                BlockType::Q6_K => {
                    for half in 0..2 {
                        // dx of each group of 16: [dx0, dx0, dx1, dx1, ..., dx3, dx3].
                        let dx4 = _mm256_castps128_ps256(_mm_loadu_ps(sp.add(b0 + 4 * half)));
                        let dxg = _mm256_permutevar8x32_ps(
                            dx4,
                            _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3),
                        );
                        let sums16 = _mm256_loadu_ps(s16.add(2 * b0 + 8 * half));
                        for r in 0..R {
                            let blk = rows[r].add(s * bb);
                            let d = _mm256_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                                (blk.add(208) as *const u16).read_unaligned() as i32,
                            ))));
                            let sc = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                blk.add(192 + 8 * half) as *const __m128i,
                            )));
                            let dsc = _mm256_mul_ps(sc, d);
                            let a = _mm256_mul_ps(dsc, dxg);
                            offs[r] = _mm256_fnmadd_ps(
                                _mm256_mul_ps(dsc, _mm256_set1_ps(32.0)),
                                sums16,
                                offs[r],
                            );
                            let ql0 = _mm256_loadu_si256(blk.add(64 * half) as *const __m256i);
                            let ql1 = _mm256_loadu_si256(blk.add(64 * half + 32) as *const __m256i);
                            let qh = _mm256_loadu_si256(blk.add(128 + 32 * half) as *const __m256i);
                            let two = _mm256_set1_epi8(0x30);
                            let us = [
                                _mm256_or_si256(
                                    _mm256_and_si256(ql0, low4),
                                    _mm256_and_si256(_mm256_slli_epi16::<4>(qh), two),
                                ),
                                _mm256_or_si256(
                                    _mm256_and_si256(ql1, low4),
                                    _mm256_and_si256(_mm256_slli_epi16::<2>(qh), two),
                                ),
                                _mm256_or_si256(
                                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), low4),
                                    _mm256_and_si256(qh, two),
                                ),
                                _mm256_or_si256(
                                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), low4),
                                    _mm256_and_si256(_mm256_srli_epi16::<2>(qh), two),
                                ),
                            ];
                            for (k, u) in us.into_iter().enumerate() {
                                // Lanes 0..4 hold elements 0..16 (group 2k), 4..8 group 2k + 1.
                                let g = 2 * k as i32;
                                let idx = _mm256_setr_epi32(g, g, g, g, g + 1, g + 1, g + 1, g + 1);
                                acc[r] = _mm256_fmadd_ps(
                                    _mm256_cvtepi32_ps(dot32::<VNNI>(
                                        u,
                                        xload(xp, b0 + 4 * half + k),
                                    )),
                                    _mm256_permutevar8x32_ps(a, idx),
                                    acc[r],
                                );
                            }
                        }
                    }
                }
                _ => unreachable!("only called for the types `handles` lists"),
            }
        }
        let mut out = [0f32; R];
        for r in 0..R {
            let o = offs1[r];
            out[r] = hsum(_mm256_add_ps(acc[r], offs[r])) + _mm_cvtss_f32(_mm_shuffle_ps(o, o, 1));
        }
        out
    }

    /// Block dequantization with the scalar kernels' arithmetic (one multiply, then an add or
    /// subtract; no fused rounding), so both give the same f32 values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dequantize_row(ty: BlockType, row: &[u8], out: &mut [f32]) {
        let (bb, elems) = (ty.block_bytes(), ty.block_elems());
        let nb = (row.len() / bb).min(out.len() / elems);
        let low4 = _mm256_set1_epi8(0x0F);
        // Writes 32 values `(u - shift) · a - b` from u8 lanes (inlined into this function, so
        // compiled with its features).
        #[inline(always)]
        unsafe fn store32(u: __m256i, a: __m256, b: __m256, shift: i32, o: *mut f32) {
            let (lo, hi) = (_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
            let parts = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
            for (i, part) in parts.into_iter().enumerate() {
                let q = _mm256_sub_epi32(_mm256_cvtepu8_epi32(part), _mm256_set1_epi32(shift));
                let v = _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), a), b);
                _mm256_storeu_ps(o.add(8 * i), v);
            }
        }
        let zero = _mm256_setzero_ps();
        for s in 0..nb {
            let blk = row.as_ptr().add(s * bb);
            let o = out.as_mut_ptr().add(s * elems);
            match ty {
                BlockType::Q5_0 | BlockType::Q5_1 => {
                    let dm = _mm_cvtph_ps(_mm_cvtsi32_si128((blk as *const i32).read_unaligned()));
                    let d = _mm256_broadcastss_ps(dm);
                    let hdr = if ty == BlockType::Q5_0 { 2 } else { 4 };
                    let qh = (blk.add(hdr) as *const u32).read_unaligned();
                    let u = q5_values(blk.add(hdr + 4), qh);
                    if ty == BlockType::Q5_0 {
                        // (q - 16) · d
                        store32(u, d, zero, 16, o);
                    } else {
                        // q · d + m, as q · d - (-m)
                        let m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
                        store32(u, d, _mm256_sub_ps(zero, m), 0, o);
                    }
                }
                BlockType::Q4_K | BlockType::Q5_K => {
                    let dd = _mm_cvtph_ps(_mm_cvtsi32_si128((blk as *const i32).read_unaligned()));
                    let (d, dmin) = (_mm_cvtss_f32(dd), _mm_cvtss_f32(_mm_movehdup_ps(dd)));
                    let pairs = crate::gguf_blocks::dequant::k_scales_and_mins(
                        std::slice::from_raw_parts(blk.add(4), 12),
                    );
                    let (qh, qs) = if ty == BlockType::Q5_K {
                        (
                            _mm256_loadu_si256(blk.add(16) as *const __m256i),
                            blk.add(48),
                        )
                    } else {
                        (_mm256_setzero_si256(), blk.add(16))
                    };
                    for chunk in 0..4 {
                        let v = _mm256_loadu_si256(qs.add(32 * chunk) as *const __m256i);
                        let mut lo = _mm256_and_si256(v, low4);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4);
                        if ty == BlockType::Q5_K {
                            lo = _mm256_or_si256(lo, q5k_fifth_bit(qh, 2 * chunk));
                            hi = _mm256_or_si256(hi, q5k_fifth_bit(qh, 2 * chunk + 1));
                        }
                        for (k, u) in [lo, hi].into_iter().enumerate() {
                            let (sc, m) = pairs[2 * chunk + k];
                            let a = _mm256_set1_ps(d * sc as f32);
                            let b = _mm256_set1_ps(dmin * m as f32);
                            store32(u, a, b, 0, o.add(64 * chunk + 32 * k));
                        }
                    }
                }
                BlockType::Q6_K => {
                    let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                        (blk.add(208) as *const u16).read_unaligned() as i32,
                    )));
                    let two = _mm256_set1_epi8(0x30);
                    for half in 0..2 {
                        let ql0 = _mm256_loadu_si256(blk.add(64 * half) as *const __m256i);
                        let ql1 = _mm256_loadu_si256(blk.add(64 * half + 32) as *const __m256i);
                        let qh = _mm256_loadu_si256(blk.add(128 + 32 * half) as *const __m256i);
                        let us = [
                            _mm256_or_si256(
                                _mm256_and_si256(ql0, low4),
                                _mm256_and_si256(_mm256_slli_epi16::<4>(qh), two),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(ql1, low4),
                                _mm256_and_si256(_mm256_slli_epi16::<2>(qh), two),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), low4),
                                _mm256_and_si256(qh, two),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), low4),
                                _mm256_and_si256(_mm256_srli_epi16::<2>(qh), two),
                            ),
                        ];
                        for (k, u) in us.into_iter().enumerate() {
                            // Two groups of 16 with their own scale: the halves of 32 values.
                            let base = 128 * half + 32 * k;
                            let sc = |g: usize| d * (*blk.add(192 + g) as i8) as f32;
                            let (a0, a1) = (sc(base / 16), sc(base / 16 + 1));
                            let a = _mm256_setr_m128(_mm_set1_ps(a0), _mm_set1_ps(a0));
                            let a_hi = _mm256_setr_m128(_mm_set1_ps(a1), _mm_set1_ps(a1));
                            let (lo, hi) =
                                (_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
                            let parts = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
                            for (i, part) in parts.into_iter().enumerate() {
                                let q = _mm256_sub_epi32(
                                    _mm256_cvtepu8_epi32(part),
                                    _mm256_set1_epi32(32),
                                );
                                let scale = if i < 2 { a } else { a_hi };
                                let v = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(q));
                                _mm256_storeu_ps(o.add(base + 8 * i), v);
                            }
                        }
                    }
                }
                _ => unreachable!("only called for the types `handles` lists"),
            }
        }
    }

    #[inline(always)]
    unsafe fn rows_of<const TY: u8, const VNNI: bool>(
        blocks: &[u8],
        row_bytes: usize,
        xq: &Q8Activations,
        out: &mut [f32],
    ) {
        let ty = BlockType::from_code(TY);
        let rows = out.len().min(blocks.len() / row_bytes.max(1));
        let nb = (row_bytes / ty.block_bytes()).min(xq.whole_blocks() * BLOCK / ty.block_elems());
        let p = blocks.as_ptr();
        let mut r = 0;
        while r + 2 <= rows {
            let pair =
                dot_rows::<TY, 2, VNNI>([p.add(r * row_bytes), p.add((r + 1) * row_bytes)], nb, xq);
            out[r] = pair[0];
            out[r + 1] = pair[1];
            r += 2;
        }
        if r < rows {
            out[r] = dot_rows::<TY, 1, VNNI>([p.add(r * row_bytes)], nb, xq)[0];
        }
    }

    #[inline(always)]
    unsafe fn rows_any<const VNNI: bool>(
        ty: BlockType,
        blocks: &[u8],
        row_bytes: usize,
        xq: &Q8Activations,
        out: &mut [f32],
    ) {
        match ty {
            BlockType::Q5_0 => rows_of::<Q5_0, VNNI>(blocks, row_bytes, xq, out),
            BlockType::Q5_1 => rows_of::<Q5_1, VNNI>(blocks, row_bytes, xq, out),
            BlockType::Q4_K => rows_of::<Q4_K, VNNI>(blocks, row_bytes, xq, out),
            BlockType::Q5_K => rows_of::<Q5_K, VNNI>(blocks, row_bytes, xq, out),
            BlockType::Q6_K => rows_of::<Q6_K, VNNI>(blocks, row_bytes, xq, out),
            _ => unreachable!("only called for the types `handles` lists"),
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn rows_into_avx2(
        ty: BlockType,
        blocks: &[u8],
        row_bytes: usize,
        xq: &Q8Activations,
        out: &mut [f32],
    ) {
        rows_any::<false>(ty, blocks, row_bytes, xq, out)
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn rows_into_vnni(
        ty: BlockType,
        blocks: &[u8],
        row_bytes: usize,
        xq: &Q8Activations,
        out: &mut [f32],
    ) {
        rows_any::<true>(ty, blocks, row_bytes, xq, out)
    }
}
