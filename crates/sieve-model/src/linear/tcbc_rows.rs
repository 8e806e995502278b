//! Tiled-CBC multiplied on the CPU through a **row-major bitmap layout** built at load.
//!
//! The Tiled-CBC blob (256 x 1 column tiles, the GPU's layout) stays what a pack stores and what
//! this layer writes back; only the in-memory copy differs. Why rows: decoding one token streams
//! every weight from DRAM, and on the 2-core machine what moves bytes fast is a few long
//! sequential streams that the hardware prefetchers can run ahead of. The column layout
//! ([`super::sparse::FastTiledCbc`]) reads fewer bytes under a TEAL threshold (it skips inactive
//! inputs' columns) but every skip breaks the stream: measured 2-3 GB/s against 11-13 GB/s for
//! dense rows, so it barely beat the dense pack. This layout reads *every* stored weight
//! (activation sparsity saves no bytes here, only the compute of all-zero chunks) in one
//! sequential pass: at sp 0.5, 2 x 0.5 B of values + 1/8 B of bitmap per weight, against 2 B
//! for dense f16 rows.
//!
//! Layout, with rows taken in groups of [`GROUP`] (several independent rows in flight hide the
//! latency of each row's expand-convert-FMA chain) and columns in chunks of [`CHUNK`]:
//!
//! * `masks[(g · chunks + c) · GROUP + i]`: a `u32` bitmap of the stored weights of row
//!   `GROUP · g + i` in columns `32 c .. 32 c + 32` (bit `b` = column `32 c + b`); rows past `M`
//!   have empty bitmaps;
//! * `values`: the stored f16 values in the order (group, chunk, row of the group, column), so a
//!   group is one contiguous run starting at `group_starts[g]` and the values of one chunk of
//!   one row follow those of the previous row; followed by [`PAD`] zeros so that a full-width
//!   load at any value is in bounds.
//!
//! The product `y = W · mask_t(x)`: `x` is masked once per call (inactive inputs become 0) and
//! padded to whole chunks; a chunk whose 32 activations are all zero is skipped without reading
//! its values (its rows' pointers advance by the bitmaps' popcounts). Per (row, chunk) the kernels:
//! * AVX-512 + VBMI2: one unaligned 64-byte load at the row's pointer, `vpexpandw` by the bitmap
//!   (the `popcount` packed values to their columns, zeros elsewhere), two `vcvtph2ps`, two FMAs
//!   with the chunk of `x`; the pointer advances by the popcount;
//! * AVX-512 without VBMI2: per 16 columns a load, `vcvtph2ps`, `vexpandps`, one FMA;
//! * AVX2: per 8 columns a load, `vcvtph2ps`, `vpermps` by a rank table, a mask, one FMA;
//! * portable: a scalar walk of the set bits.
//!
//! Rows are split over the thread pool in runs of whole groups. Every path sums the same
//! products in another order only. Activations that are not finite take the portable path: the
//! SIMD paths multiply unstored weights as zeros, and `0 · inf` would put a NaN in rows that do
//! not use that input (the reference kernels skip unstored weights).
//!
//! Batched products (prefill) decode the matrix into a per-thread f16 row-major buffer and run
//! the blocked GEMM on it, the same call and the same numbers as the dense pack's `FastDense`.

use super::gemm;
use super::simd::SimdLevel;
use half::f16;
use rayon::prelude::*;
use sieve_formats::blob::ByteWriter;
use sieve_formats::format::{check_product_args, is_active};
use sieve_formats::matrix::is_zero;
use sieve_formats::tiled_cbc::TiledCbc;
use sieve_formats::{DenseMatrix, FormatError, FormatKind, Storage, Threshold, WeightFormat};

/// Columns per bitmap word.
pub const CHUNK: usize = 32;
/// Rows interleaved in memory and multiplied together.
pub const GROUP: usize = 4;
/// Zero values after the last stored one: a 64-byte load at any value stays in bounds.
const PAD: usize = 32;
/// Batches of fewer tokens run the matrix-vector kernel once per token: below this, decoding
/// the matrix for the GEMM costs more than the GEMM saves.
const GEMM_MIN_TOKENS: usize = 4;

/// Tiled-CBC with SIMD products over a row-major bitmap layout (module notes); kind, storage
/// and blob are those of the [`TiledCbc`] it was built from.
#[derive(Clone, Debug, PartialEq)]
pub struct RowTiledCbc {
    rows: usize,
    cols: usize,
    /// `ceil(K / 32)`.
    chunks: usize,
    masks: Vec<u32>,
    /// Index in `values` of each group's first value, `groups + 1` entries.
    group_starts: Vec<usize>,
    values: Vec<u16>,
    /// The Tiled-CBC storage (what the blob holds).
    storage: Storage,
}

/// One token's activations, ready for the kernels.
struct Prepared {
    /// `mask_t(x)` padded with zeros to whole chunks.
    x: Vec<f32>,
    /// Per chunk: whether any of its activations is nonzero.
    live: Vec<bool>,
    /// Whether every activation is finite (else the portable kernel runs, module notes).
    finite: bool,
}

impl RowTiledCbc {
    /// Builds the CPU layout from a Tiled-CBC matrix.
    pub fn new(tiled: &TiledCbc) -> Self {
        Self::from_matrix(&tiled.decode(), tiled.storage())
    }

    fn from_matrix(w: &DenseMatrix, storage: Storage) -> Self {
        let (m, k) = (w.rows(), w.cols());
        let chunks = k.div_ceil(CHUNK);
        let groups = m.div_ceil(GROUP);
        let mut masks = vec![0u32; groups * chunks * GROUP];
        let mut group_starts = Vec::with_capacity(groups + 1);
        let mut values = Vec::with_capacity(w.nnz() + PAD);
        for g in 0..groups {
            group_starts.push(values.len());
            for c in 0..chunks {
                let (lo, hi) = (c * CHUNK, ((c + 1) * CHUNK).min(k));
                for i in 0..GROUP.min(m - g * GROUP) {
                    let mut mask = 0u32;
                    for (b, &v) in w.row(g * GROUP + i)[lo..hi].iter().enumerate() {
                        // Exactly the entries Tiled-CBC stores (a negative zero is stored).
                        if !is_zero(v) {
                            mask |= 1 << b;
                            values.push(v.to_bits());
                        }
                    }
                    masks[(g * chunks + c) * GROUP + i] = mask;
                }
            }
        }
        group_starts.push(values.len());
        values.extend_from_slice(&[0u16; PAD]);
        Self {
            rows: m,
            cols: k,
            chunks,
            masks,
            group_starts,
            values,
            storage,
        }
    }

    /// Bytes one matrix-vector product streams (bitmaps + values): what decode reads per token.
    pub fn cpu_layout_bytes(&self) -> usize {
        4 * self.masks.len() + 2 * (self.values.len() - PAD)
    }

    fn groups(&self) -> usize {
        self.group_starts.len() - 1
    }

    fn prepare(&self, x: &[f32], threshold: Threshold) -> Prepared {
        let mut xm = vec![0f32; self.chunks * CHUNK];
        let mut finite = true;
        for (d, &v) in xm.iter_mut().zip(x) {
            if is_active(v, threshold) {
                *d = v;
                finite &= v.is_finite();
            }
        }
        let live = xm
            .chunks_exact(CHUNK)
            .map(|c| c.iter().any(|&v| v != 0.0))
            .collect();
        Prepared {
            x: xm,
            live,
            finite,
        }
    }

    /// `out[i] = W[GROUP · g + i] · x` for the rows of group `g` (`out.len()` of them, at most
    /// [`GROUP`]).
    fn group_with(&self, level: SimdLevel, g: usize, p: &Prepared, out: &mut [f32]) {
        debug_assert!(out.len() <= GROUP && g < self.groups());
        let mut sums = [0f32; GROUP];
        match level {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the level is supported (callers cap it by `usable`); the layout was built
            // by `from_matrix` (each group's bitmaps have as many bits as it has values, PAD
            // zeros follow the last value) and `p` was prepared for this matrix.
            SimdLevel::Avx512Vbmi2 if p.finite => unsafe { x86::group_vbmi2(self, g, p, &mut sums) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            SimdLevel::Avx512 if p.finite => unsafe { x86::group_avx512(self, g, p, &mut sums) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            SimdLevel::Avx2 if p.finite => unsafe { x86::group_avx2(self, g, p, &mut sums) },
            _ => self.group_portable(g, p, &mut sums),
        }
        out.copy_from_slice(&sums[..out.len()]);
    }

    fn group_portable(&self, g: usize, p: &Prepared, sums: &mut [f32; GROUP]) {
        let mut pos = self.group_starts[g];
        for c in 0..self.chunks {
            let masks = &self.masks[(g * self.chunks + c) * GROUP..][..GROUP];
            let xc = &p.x[c * CHUNK..(c + 1) * CHUNK];
            for (s, &mask) in sums.iter_mut().zip(masks) {
                let mut bits = mask;
                while bits != 0 {
                    let b = bits.trailing_zeros() as usize;
                    *s += f16::from_bits(self.values[pos]).to_f32() * xc[b];
                    pos += 1;
                    bits &= bits - 1;
                }
            }
        }
    }

    /// `y = W · mask_t(x)` through the kernels of `level` (tests compare every level).
    pub fn matvec_with(
        &self,
        level: SimdLevel,
        x: &[f32],
        threshold: Threshold,
        y: &mut [f32],
    ) -> Result<(), FormatError> {
        check_product_args(self.rows, self.cols, x, 1, threshold, y)?;
        let level = usable(level);
        let p = self.prepare(x, threshold);
        let per = GROUP * groups_per_task(self.groups());
        y.par_chunks_mut(per).enumerate().for_each(|(t, out)| {
            for (i, o) in out.chunks_mut(GROUP).enumerate() {
                self.group_with(level, t * per / GROUP + i, &p, o);
            }
        });
        Ok(())
    }

    /// `Y = mask_t(X) · Wᵀ` for `n` tokens through the kernels of `level`.
    pub fn matmul_with(
        &self,
        level: SimdLevel,
        x: &[f32],
        n: usize,
        threshold: Threshold,
        y: &mut [f32],
    ) -> Result<(), FormatError> {
        let (m, k) = (self.rows, self.cols);
        check_product_args(m, k, x, n, threshold, y)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            y.fill(0.0);
            return Ok(());
        }
        if n < GEMM_MIN_TOKENS {
            for (xr, yr) in x.chunks_exact(k).zip(y.chunks_exact_mut(m)) {
                self.matvec_with(level, xr, threshold, yr)?;
            }
            return Ok(());
        }
        let xm;
        let x = if threshold.is_some() {
            xm = x
                .iter()
                .map(|&v| if is_active(v, threshold) { v } else { 0.0 })
                .collect::<Vec<_>>();
            &xm[..]
        } else {
            x
        };
        let mut run = |w: &mut Vec<f16>| {
            w.resize(m * k, f16::ZERO);
            self.decode_into(&mut w[..m * k]);
            // Y (n x M) = X (n x K) · Wᵀ, the call `FastDense` makes on its rows.
            gemm::gemm(
                n,
                m,
                k,
                gemm::View::row_major(x, k),
                gemm::View::transposed(&w[..m * k], k),
                y,
                m,
                false,
                true,
            )
            .map_err(|e| FormatError::Option(e.to_string()))
        };
        PANEL.with(|cell| match cell.try_borrow_mut() {
            Ok(mut w) => run(&mut w),
            // A pool thread that picked up this product while waiting inside another one.
            Err(_) => run(&mut Vec::new()),
        })
    }

    /// Writes the dense row-major matrix into `out` (`M · K` entries), groups in parallel.
    fn decode_into(&self, out: &mut [f16]) {
        let k = self.cols;
        if k == 0 {
            return;
        }
        out.par_chunks_mut(GROUP * k)
            .enumerate()
            .for_each(|(g, rows)| {
                rows.fill(f16::ZERO);
                let mut pos = self.group_starts[g];
                for c in 0..self.chunks {
                    let masks = &self.masks[(g * self.chunks + c) * GROUP..][..GROUP];
                    for (i, &mask) in masks.iter().enumerate() {
                        let mut bits = mask;
                        while bits != 0 {
                            let col = c * CHUNK + bits.trailing_zeros() as usize;
                            rows[i * k + col] = f16::from_bits(self.values[pos]);
                            pos += 1;
                            bits &= bits - 1;
                        }
                    }
                }
            });
    }
}

thread_local! {
    /// The decoded matrix of a batched product, reused across calls (fresh multi-MB buffers per
    /// product cost page faults).
    static PANEL: std::cell::RefCell<Vec<f16>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `level` if this CPU can run it, else the portable kernel.
fn usable(level: SimdLevel) -> SimdLevel {
    if level.supported() {
        level
    } else {
        SimdLevel::Portable
    }
}

/// Groups per parallel task: about four tasks per thread, never fewer than 4 groups (16 rows).
fn groups_per_task(groups: usize) -> usize {
    let tasks = 4 * rayon::current_num_threads().max(1);
    groups.div_ceil(tasks).max(4)
}

impl WeightFormat for RowTiledCbc {
    fn kind(&self) -> FormatKind {
        FormatKind::TiledCbc
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn storage(&self) -> Storage {
        self.storage
    }
    fn decode(&self) -> DenseMatrix {
        let mut data = vec![f16::ZERO; self.rows * self.cols];
        self.decode_into(&mut data);
        DenseMatrix::new(self.rows, self.cols, data).expect("built from a validated matrix")
    }
    fn matvec(&self, x: &[f32], threshold: Threshold, y: &mut [f32]) -> Result<(), FormatError> {
        self.matvec_with(SimdLevel::detect(), x, threshold, y)
    }
    fn matmul(
        &self,
        x: &[f32],
        n: usize,
        threshold: Threshold,
        y: &mut [f32],
    ) -> Result<(), FormatError> {
        self.matmul_with(SimdLevel::detect(), x, n, threshold, y)
    }
    /// The Tiled-CBC payload (re-encoded from the same matrix: the encoding is deterministic,
    /// so the bytes equal those read).
    fn write_payload(&self, w: &mut ByteWriter) {
        match TiledCbc::encode(&self.decode()) {
            Ok(t) => t.write_payload(w),
            // Cannot happen: the matrix came from a valid Tiled-CBC encoding.
            Err(e) => panic!("tiled-cbc re-encoding failed: {e}"),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Prepared, RowTiledCbc, CHUNK, GROUP};
    use crate::linear::sparse::RANKS;
    use std::arch::x86_64::*;

    /// The values of group `g` and the bitmaps of its chunks.
    #[inline(always)]
    unsafe fn group_start(w: &RowTiledCbc, g: usize) -> (*const u16, *const u32) {
        (
            w.values.as_ptr().add(*w.group_starts.get_unchecked(g)),
            w.masks.as_ptr().add(g * w.chunks * GROUP),
        )
    }

    /// The values of a skipped chunk's rows.
    #[inline(always)]
    unsafe fn skip(masks: *const u32) -> usize {
        (0..GROUP)
            .map(|i| (*masks.add(i)).count_ones() as usize)
            .sum()
    }

    /// Per (row, chunk): a 64-byte load, `vpexpandw` by the bitmap, two `vcvtph2ps`, two FMAs.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL/VBMI2; `w` built by `RowTiledCbc::from_matrix`,
    /// `g < groups`, `p` prepared for `w`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,bmi2,popcnt")]
    pub unsafe fn group_vbmi2(w: &RowTiledCbc, g: usize, p: &Prepared, out: &mut [f32; GROUP]) {
        let (mut v, masks) = group_start(w, g);
        let mut acc = [_mm512_setzero_ps(); 2 * GROUP];
        for c in 0..w.chunks {
            let ms = masks.add(c * GROUP);
            if !*p.live.get_unchecked(c) {
                v = v.add(skip(ms));
                continue;
            }
            let xp = p.x.as_ptr().add(c * CHUNK);
            let (xlo, xhi) = (_mm512_loadu_ps(xp), _mm512_loadu_ps(xp.add(16)));
            for i in 0..GROUP {
                let m = *ms.add(i);
                let n = m.count_ones();
                // A masked load the compiler cannot fold into the expand: `vpexpandw` from
                // memory is microcoded on AMD Zen 4 (3.4x slower in `sparse_bench`, in cache).
                let raw = _mm512_maskz_loadu_epi16(_bzhi_u32(u32::MAX, n), v as *const i16);
                let e = _mm512_maskz_expand_epi16(m, raw);
                let lo = _mm512_cvtph_ps(_mm512_castsi512_si256(e));
                let hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(e));
                acc[2 * i] = _mm512_fmadd_ps(lo, xlo, acc[2 * i]);
                acc[2 * i + 1] = _mm512_fmadd_ps(hi, xhi, acc[2 * i + 1]);
                v = v.add(n as usize);
            }
        }
        for (i, o) in out.iter_mut().enumerate() {
            *o = _mm512_reduce_add_ps(_mm512_add_ps(acc[2 * i], acc[2 * i + 1]));
        }
    }

    /// [`group_vbmi2`] without VBMI2: per 16 columns a 32-byte load, `vcvtph2ps`, `vexpandps`.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL; otherwise as for [`group_vbmi2`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,popcnt")]
    pub unsafe fn group_avx512(w: &RowTiledCbc, g: usize, p: &Prepared, out: &mut [f32; GROUP]) {
        let (mut v, masks) = group_start(w, g);
        let mut acc = [_mm512_setzero_ps(); 2 * GROUP];
        for c in 0..w.chunks {
            let ms = masks.add(c * GROUP);
            if !*p.live.get_unchecked(c) {
                v = v.add(skip(ms));
                continue;
            }
            let xp = p.x.as_ptr().add(c * CHUNK);
            let xs = [_mm512_loadu_ps(xp), _mm512_loadu_ps(xp.add(16))];
            for i in 0..GROUP {
                let m = *ms.add(i);
                for (h, &xh) in xs.iter().enumerate() {
                    let mh = (m >> (16 * h)) as u16;
                    let raw = _mm256_loadu_si256(v as *const __m256i);
                    let e = _mm512_maskz_expand_ps(mh, _mm512_cvtph_ps(raw));
                    acc[2 * i + h] = _mm512_fmadd_ps(e, xh, acc[2 * i + h]);
                    v = v.add(mh.count_ones() as usize);
                }
            }
        }
        for (i, o) in out.iter_mut().enumerate() {
            *o = _mm512_reduce_add_ps(_mm512_add_ps(acc[2 * i], acc[2 * i + 1]));
        }
    }

    /// Per (row, 8 columns): a 16-byte load, `vcvtph2ps`, `vpermps` by the rank of each set bit,
    /// a mask of the set bits, one FMA.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA, F16C and POPCNT; otherwise as for [`group_vbmi2`].
    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    pub unsafe fn group_avx2(w: &RowTiledCbc, g: usize, p: &Prepared, out: &mut [f32; GROUP]) {
        let (mut v, masks) = group_start(w, g);
        let lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        let mut acc = [_mm256_setzero_ps(); GROUP];
        for c in 0..w.chunks {
            let ms = masks.add(c * GROUP);
            if !*p.live.get_unchecked(c) {
                v = v.add(skip(ms));
                continue;
            }
            let xp = p.x.as_ptr().add(c * CHUNK);
            for (i, a) in acc.iter_mut().enumerate() {
                let m = *ms.add(i);
                for q in 0..4 {
                    let mb = ((m >> (8 * q)) & 0xff) as usize;
                    if mb == 0 {
                        continue;
                    }
                    let raw = _mm256_cvtph_ps(_mm_loadu_si128(v as *const __m128i));
                    let idx = _mm256_loadu_si256(RANKS.as_ptr().add(mb) as *const __m256i);
                    let placed = _mm256_permutevar8x32_ps(raw, idx);
                    let sel = _mm256_set1_epi32(mb as i32);
                    let keep = _mm256_cmpeq_epi32(_mm256_and_si256(sel, lane_bits), lane_bits);
                    let placed = _mm256_and_ps(placed, _mm256_castsi256_ps(keep));
                    *a = _mm256_fmadd_ps(placed, _mm256_loadu_ps(xp.add(8 * q)), *a);
                    v = v.add(mb.count_ones() as usize);
                }
            }
        }
        for (o, a) in out.iter_mut().zip(acc) {
            let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
            *o = _mm_cvtss_f32(s);
        }
    }
}

#[cfg(test)]
mod tests;
