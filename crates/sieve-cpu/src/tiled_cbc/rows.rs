//! Tiled-CBC multiplied on the CPU through a **row-blocked bitmap layout** built at load.
//!
//! The Tiled-CBC blob (256 x 1 column tiles, the GPU's layout) stays what a pack stores and what
//! this layer writes back; only the in-memory copy differs. Why rows: decoding one token streams
//! every weight from DRAM, and on the 2-core machine what moves bytes fast is a few long
//! sequential streams that the hardware prefetchers can run ahead of. The column layout
//! ([`super::columns::ColumnTiledCbc`]) reads fewer bytes under a TEAL threshold (it skips inactive
//! inputs' columns) but every skip breaks the stream: measured 2-3 GB/s against 11-13 GB/s for
//! dense rows, so it barely beat the dense pack. This layout reads *every* stored weight
//! (activation sparsity saves no bytes here, only compute) block after block, each block one
//! forward pass over contiguous memory.
//!
//! Layout: rows are cut into blocks of [`BLOCK`] (32); inside a block the columns follow each
//! other in order, so a block is one contiguous run of memory:
//!
//! * `masks[b · K + c]`: a `u32` bitmap of the stored weights of column `c` in block `b` (bit
//!   `i` = row `32 b + i`; rows past `M` have no bits);
//! * `values`: the stored f16 values in the order (block, column, row);
//! * `offsets[b · K + c]`: where column `c`'s values start, as a `u16` relative to the start of
//!   its segment of [`SEGMENT`] columns (`segment_starts[b · S + s]`), so that a product can
//!   jump to any column without counting the bits before it. 32 x 2048 values fit a `u16`.
//!
//! At sp 0.5 that is 1 B of values + 1/8 B of bitmap + 1/16 B of offsets per weight, against
//! 2 B for dense f16 rows, all of it read in one forward pass per block. Why blocks of columns
//! rather than rows of chunks: a row-major kernel (per row and 32 columns: expand, two
//! conversions, two FMAs) does the same work for every chunk whatever the activations, and on
//! Zen 4 that work (512-bit operations take a pipe for two cycles) was slower than dense rows
//! (`examples/sparse_bench.rs`, docs/BENCHMARKS.md). Within a block, an inactive input (TEAL) is
//! simply not visited: compute scales with the active inputs, while the bytes are still read as
//! one sequential stream (the skipped pieces, ~36 bytes, lie between visited ones).
//!
//! The product `y = W · mask_t(x)`: the active inputs are listed once per call; per block and
//! active column the kernels:
//! * AVX-512 + VBMI2: a masked load of the `popcount` values, `vpexpandw` by the bitmap (the
//!   values to their rows, zeros elsewhere), two `vcvtph2ps`, two FMAs with the broadcast
//!   activation into 32 row sums held in registers (two sets, alternating columns, for ILP).
//!   Not `vpexpandw` from memory: microcoded on Zen 4, 2-3x slower (measured);
//! * AVX-512 without VBMI2: per 16 rows a masked load, `vcvtph2ps`, `vexpandps`, one FMA;
//! * AVX2: per 8 rows a load, `vcvtph2ps`, `vpermps` by a rank table, a mask, one FMA;
//! * portable: a scalar walk of the set bits.
//!
//! Blocks are split over the thread pool. Every path sums the same products in another order
//! only. Activations that are not finite take the portable path: the SIMD paths multiply
//! unstored weights as zeros, and `0 · inf` would put a NaN in rows that do not use that input
//! (the reference kernels skip unstored weights).
//!
//! Batched products (prefill) decode the matrix into a per-thread f16 row-major buffer and run
//! the blocked GEMM on it, the same call and the same numbers as the dense pack's `FastDense`.

use crate::gemm;
use crate::simd::SimdLevel;
use crate::tiled_cbc::columns::active_inputs;
use half::f16;
use rayon::prelude::*;
use sieve_formats::blob::ByteWriter;
use sieve_formats::format::check_product_args;
use sieve_formats::matrix::is_zero;
use sieve_formats::tiled_cbc::TiledCbc;
use sieve_formats::{DenseMatrix, FormatError, FormatKind, Storage, Threshold, WeightFormat};

/// Rows per block: one `u32` bitmap per (block, column), one `vpexpandw`.
pub const BLOCK: usize = 32;
/// Columns per offset segment: a block's values in one segment number at most 32 x 2048, so
/// offsets inside it fit a `u16`.
pub const SEGMENT: usize = 2048;

/// Tiled-CBC with SIMD products over a row-blocked bitmap layout (module notes); kind, storage
/// and blob are those of the [`TiledCbc`] it was built from.
#[derive(Clone, Debug, PartialEq)]
pub struct RowTiledCbc {
    rows: usize,
    cols: usize,
    /// `ceil(K / SEGMENT)`.
    segments: usize,
    masks: Vec<u32>,
    offsets: Vec<u16>,
    /// Index in `values` of each (block, segment)'s first value.
    segment_starts: Vec<usize>,
    values: Vec<u16>,
    /// The Tiled-CBC storage (what the blob holds).
    storage: Storage,
}

/// One token's active inputs, ready for the kernels.
struct Prepared {
    cols: Vec<u32>,
    xs: Vec<f32>,
    /// Whether every active input is finite (else the portable kernel runs, module notes).
    finite: bool,
}

impl RowTiledCbc {
    /// Builds the CPU layout from a Tiled-CBC matrix.
    pub fn new(tiled: &TiledCbc) -> Self {
        Self::from_matrix(&tiled.decode(), tiled.storage())
    }

    fn from_matrix(w: &DenseMatrix, storage: Storage) -> Self {
        let (m, k) = (w.rows(), w.cols());
        let blocks = m.div_ceil(BLOCK);
        let segments = k.div_ceil(SEGMENT);
        let mut masks = Vec::with_capacity(blocks * k);
        let mut offsets = Vec::with_capacity(blocks * k);
        let mut segment_starts = Vec::with_capacity(blocks * segments);
        let mut values = Vec::with_capacity(w.nnz());
        let data = w.data();
        for b in 0..blocks {
            let rows = b * BLOCK..((b + 1) * BLOCK).min(m);
            for c in 0..k {
                if c % SEGMENT == 0 {
                    segment_starts.push(values.len());
                }
                let base = segment_starts[segment_starts.len() - 1];
                // At most 32 x 2047 values precede a column in its segment (constant notes).
                offsets.push((values.len() - base) as u16);
                let mut mask = 0u32;
                for (i, r) in rows.clone().enumerate() {
                    let v = data[r * k + c];
                    // Exactly the entries Tiled-CBC stores (a negative zero is stored).
                    if !is_zero(v) {
                        mask |= 1 << i;
                        values.push(v.to_bits());
                    }
                }
                masks.push(mask);
            }
        }
        Self {
            rows: m,
            cols: k,
            segments,
            masks,
            offsets,
            segment_starts,
            values,
            storage,
        }
    }

    /// Bytes one matrix-vector product may stream (bitmaps + offsets + values): what decode
    /// reads per token.
    pub fn cpu_layout_bytes(&self) -> usize {
        4 * self.masks.len() + 2 * self.offsets.len() + 2 * self.values.len()
    }

    fn blocks(&self) -> usize {
        self.rows.div_ceil(BLOCK)
    }

    /// Index in `values` of the first value of column `c` in block `b`.
    #[inline(always)]
    fn start(&self, b: usize, c: usize) -> usize {
        self.segment_starts[b * self.segments + c / SEGMENT]
            + self.offsets[b * self.cols + c] as usize
    }

    fn prepare(&self, x: &[f32], threshold: Threshold) -> Prepared {
        let (cols, xs) = active_inputs(x, threshold);
        let finite = xs.iter().all(|v| v.is_finite());
        Prepared { cols, xs, finite }
    }

    /// `out[i] = W[32 b + i] · x` for the rows of block `b` (`out.len()` of them).
    fn block_with(&self, level: SimdLevel, b: usize, p: &Prepared, out: &mut [f32]) {
        debug_assert!(out.len() <= BLOCK && b < self.blocks());
        let mut sums = [0f32; BLOCK];
        match level {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the level is supported (callers cap it by `usable`); the layout was built
            // by `from_matrix` (each column's values start at `start(b, c)` and number its
            // bitmap's popcount) and `p.cols` are columns of this matrix.
            SimdLevel::Avx512Vbmi2 if p.finite => unsafe {
                x86::block_vbmi2(self, b, p, &mut sums)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            SimdLevel::Avx512 if p.finite => unsafe { x86::block_avx512(self, b, p, &mut sums) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            SimdLevel::Avx2 if p.finite => unsafe { x86::block_avx2(self, b, p, &mut sums) },
            _ => self.block_portable(b, p, &mut sums),
        }
        out.copy_from_slice(&sums[..out.len()]);
    }

    fn block_portable(&self, b: usize, p: &Prepared, sums: &mut [f32; BLOCK]) {
        for (&c, &xv) in p.cols.iter().zip(&p.xs) {
            let c = c as usize;
            let mut pos = self.start(b, c);
            let mut bits = self.masks[b * self.cols + c];
            while bits != 0 {
                let i = bits.trailing_zeros() as usize;
                sums[i] += f16::from_bits(self.values[pos]).to_f32() * xv;
                pos += 1;
                bits &= bits - 1;
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
        let level = level.or_portable();
        let p = self.prepare(x, threshold);
        let per = BLOCK * blocks_per_task(self.blocks());
        y.par_chunks_mut(per).enumerate().for_each(|(t, out)| {
            for (i, o) in out.chunks_mut(BLOCK).enumerate() {
                self.block_with(level, t * per / BLOCK + i, &p, o);
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
        gemm::decoded_matmul(
            m,
            k,
            x,
            n,
            threshold,
            y,
            |xr, yr| self.matvec_with(level, xr, threshold, yr),
            |w| self.decode_into(w),
        )
    }

    /// Writes the dense row-major matrix into `out` (`M · K` entries), blocks in parallel.
    fn decode_into(&self, out: &mut [f16]) {
        let k = self.cols;
        if k == 0 {
            return;
        }
        out.par_chunks_mut(BLOCK * k)
            .enumerate()
            .for_each(|(b, rows)| {
                rows.fill(f16::ZERO);
                for c in 0..k {
                    let mut pos = self.start(b, c);
                    let mut bits = self.masks[b * k + c];
                    while bits != 0 {
                        let i = bits.trailing_zeros() as usize;
                        rows[i * k + c] = f16::from_bits(self.values[pos]);
                        pos += 1;
                        bits &= bits - 1;
                    }
                }
            });
    }
}

/// Blocks per parallel task: about three tasks per thread (576 rows = 18 blocks: 3 per task
/// on 2 threads), at least one block.
fn blocks_per_task(blocks: usize) -> usize {
    let tasks = 3 * rayon::current_num_threads().max(1);
    blocks.div_ceil(tasks).max(1)
}

impl WeightFormat for RowTiledCbc {
    fn cpu_bytes(&self) -> usize {
        self.cpu_layout_bytes()
    }
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
    fn write_payload(&self, w: &mut ByteWriter) {
        crate::tiled_cbc::columns::write_tiled_cbc_payload(&self.decode(), w)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Prepared, RowTiledCbc, BLOCK};
    use crate::tiled_cbc::columns::{load8_f16, RANKS};
    use std::arch::x86_64::*;

    /// The bitmap and the first value of column `c` in block `b`.
    #[inline(always)]
    unsafe fn column(w: &RowTiledCbc, b: usize, c: u32) -> (u32, *const u16) {
        let c = c as usize;
        let seg = *w
            .segment_starts
            .get_unchecked(b * w.segments + c / super::SEGMENT);
        let off = *w.offsets.get_unchecked(b * w.cols + c) as usize;
        (
            *w.masks.get_unchecked(b * w.cols + c),
            w.values.as_ptr().add(seg + off),
        )
    }

    /// Bytes ahead of the current value that are prefetched at each active column, and of the
    /// current bitmap (half of it for the `u16` offsets). Within a block the visited columns
    /// skip the pieces of inactive ones (~36 bytes at sp 0.5), which the hardware prefetchers
    /// follow less well than a plain stream; 2048 / 512 were the best of the few distances
    /// tried (`sparse_bench` and `sieve bench cpu` on a loaded machine: a weak preference,
    /// docs/BENCHMARKS.md).
    const AHEAD_VALUES: usize = 2048;
    const AHEAD_MASKS: usize = 512;

    #[inline(always)]
    unsafe fn prefetch_ahead(w: &RowTiledCbc, b: usize, c: u32, v: *const u16) {
        // `wrapping_add`: the addresses may lie past the arrays; prefetches do not fault.
        let i = b * w.cols + c as usize;
        _mm_prefetch::<_MM_HINT_T0>((v as *const i8).wrapping_add(AHEAD_VALUES));
        _mm_prefetch::<_MM_HINT_T0>(
            (w.masks.as_ptr().add(i) as *const i8).wrapping_add(AHEAD_MASKS),
        );
        _mm_prefetch::<_MM_HINT_T0>(
            (w.offsets.as_ptr().add(i) as *const i8).wrapping_add(AHEAD_MASKS / 2),
        );
    }

    /// Per active column: a masked load of its values, `vpexpandw`, two `vcvtph2ps`, two FMAs
    /// with the broadcast activation; two sets of sums for alternate columns.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL/VBMI2 and BMI2; `w` built by `RowTiledCbc::from_matrix`,
    /// `b < blocks`, `p` prepared for `w`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,bmi2,popcnt")]
    pub unsafe fn block_vbmi2(w: &RowTiledCbc, b: usize, p: &Prepared, out: &mut [f32; BLOCK]) {
        #[inline(always)]
        unsafe fn one(w: &RowTiledCbc, b: usize, c: u32, xv: f32, acc: &mut [__m512; 2]) {
            let (m, v) = column(w, b, c);
            prefetch_ahead(w, b, c, v);
            let raw =
                _mm512_maskz_loadu_epi16(_bzhi_u32(u32::MAX, m.count_ones()), v as *const i16);
            let e = _mm512_maskz_expand_epi16(m, raw);
            let vx = _mm512_set1_ps(xv);
            let lo = _mm512_cvtph_ps(_mm512_castsi512_si256(e));
            let hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(e));
            acc[0] = _mm512_fmadd_ps(lo, vx, acc[0]);
            acc[1] = _mm512_fmadd_ps(hi, vx, acc[1]);
        }
        let mut a = [_mm512_setzero_ps(); 2];
        let mut b2 = [_mm512_setzero_ps(); 2];
        let pairs = p.cols.len() / 2;
        for j in 0..pairs {
            one(
                w,
                b,
                *p.cols.get_unchecked(2 * j),
                *p.xs.get_unchecked(2 * j),
                &mut a,
            );
            one(
                w,
                b,
                *p.cols.get_unchecked(2 * j + 1),
                *p.xs.get_unchecked(2 * j + 1),
                &mut b2,
            );
        }
        if p.cols.len() % 2 == 1 {
            one(w, b, p.cols[2 * pairs], p.xs[2 * pairs], &mut a);
        }
        let o = out.as_mut_ptr();
        _mm512_storeu_ps(o, _mm512_add_ps(a[0], b2[0]));
        _mm512_storeu_ps(o.add(16), _mm512_add_ps(a[1], b2[1]));
    }

    /// [`block_vbmi2`] without VBMI2: per 16 rows a masked load, `vcvtph2ps`, `vexpandps`.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL and BMI2; otherwise as for [`block_vbmi2`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,bmi2,popcnt")]
    pub unsafe fn block_avx512(w: &RowTiledCbc, b: usize, p: &Prepared, out: &mut [f32; BLOCK]) {
        let mut acc = [_mm512_setzero_ps(); 2];
        for (&c, &xv) in p.cols.iter().zip(&p.xs) {
            let (m, mut v) = column(w, b, c);
            prefetch_ahead(w, b, c, v);
            let vx = _mm512_set1_ps(xv);
            for (h, a) in acc.iter_mut().enumerate() {
                let mh = (m >> (16 * h)) as u16;
                let n = mh.count_ones();
                let raw = _mm256_maskz_loadu_epi16(_bzhi_u32(0xffff, n) as u16, v as *const i16);
                let e = _mm512_maskz_expand_ps(mh, _mm512_cvtph_ps(raw));
                *a = _mm512_fmadd_ps(e, vx, *a);
                v = v.add(n as usize);
            }
        }
        _mm512_storeu_ps(out.as_mut_ptr(), acc[0]);
        _mm512_storeu_ps(out.as_mut_ptr().add(16), acc[1]);
    }

    /// Per active column and 8 rows: a load, `vcvtph2ps`, `vpermps` by the rank of each set
    /// bit, a mask of the set bits, one FMA.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA, F16C and POPCNT; otherwise as for [`block_vbmi2`].
    #[target_feature(enable = "avx2,fma,f16c,popcnt")]
    pub unsafe fn block_avx2(w: &RowTiledCbc, b: usize, p: &Prepared, out: &mut [f32; BLOCK]) {
        let end = w.values.as_ptr().add(w.values.len());
        let lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        let mut acc = [_mm256_setzero_ps(); 4];
        for (&c, &xv) in p.cols.iter().zip(&p.xs) {
            let (m, mut v) = column(w, b, c);
            prefetch_ahead(w, b, c, v);
            let vx = _mm256_set1_ps(xv);
            for (q, a) in acc.iter_mut().enumerate() {
                let mb = ((m >> (8 * q)) & 0xff) as usize;
                if mb == 0 {
                    continue;
                }
                let raw = load8_f16(v, end);
                let idx = _mm256_loadu_si256(RANKS.as_ptr().add(mb) as *const __m256i);
                let placed = _mm256_permutevar8x32_ps(raw, idx);
                let sel = _mm256_set1_epi32(mb as i32);
                let keep = _mm256_cmpeq_epi32(_mm256_and_si256(sel, lane_bits), lane_bits);
                let placed = _mm256_and_ps(placed, _mm256_castsi256_ps(keep));
                *a = _mm256_fmadd_ps(placed, vx, *a);
                v = v.add(mb.count_ones() as usize);
            }
        }
        for (q, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(8 * q), *a);
        }
    }
}

#[cfg(test)]
mod tests;
