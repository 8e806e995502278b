//! Fast CPU products of the packed column formats `sieve pack` writes, beside the reference
//! kernels of `sieve_formats` they are tested against.
//!
//! Decoding one token is bound by the bytes of weights streamed, so both products here read only
//! the weight columns of active inputs (TEAL: `|x| > t` and `x != 0`), and nothing else:
//!
//! * [`FastTiledCbc`] keeps the Tiled-CBC blob layout (the GPU's, unchanged: 256-row column tiles
//!   of a 256-bit bitmap and the tile's nonzero f16 values in row order). For one row tile the
//!   AVX-512 kernel holds the 256 row sums in 16 `zmm` registers and, for every active column,
//!   turns each 16-bit slice of the bitmap and the next `popcount` values into 16 dense lanes with
//!   a masked load, `vcvtph2ps` and `vexpandps`, then one FMA. The AVX2 kernel does the same per
//!   8 rows with a `vpermps` by a 256-entry rank table and a mask, in four passes of 64 rows (8
//!   `ymm` accumulators). Row tiles and chunks of the active columns are the parallel tasks (with
//!   3 row tiles and 2 threads the columns must be split too); chunk sums are added at the end.
//! * [`DenseColumns`] is dense f16 stored column-major (`Wᵀ`, K x M, the same blob payload as
//!   `Dense`): with a threshold, a row-major matrix must still read every column, column-major
//!   reads only the active ones. Used for dense layers that have a threshold.
//!
//! Batched products (prefill) run the blocked GEMM on masked activations: Tiled-CBC decodes its
//! tiles into a per-thread `Wᵀ` panel first (with the same expand kernel); for a handful of
//! tokens the matrix-vector product runs once per token instead.
//!
//! The portable kernels are scalar walks of the same layouts, used where AVX2 is missing.

use super::gemm;
use super::simd::SimdLevel;
use half::f16;
use rayon::prelude::*;
use sieve_formats::blob::ByteWriter;
use sieve_formats::format::{check_product_args, is_active};
use sieve_formats::tiled_cbc::{TiledCbc, TILE_K, TILE_M, WORDS_PER_COLUMN};
use sieve_formats::{DenseMatrix, FormatError, FormatKind, Storage, Threshold, WeightFormat};

/// Batches of fewer tokens than this run the matrix-vector kernel once per token: below it
/// decoding the matrix for the GEMM costs more than the GEMM saves.
const GEMM_MIN_TOKENS: usize = 4;

/// The inputs that contribute to a product: indices (as `u32`) and values of `x` active under
/// `threshold` and not zero.
pub fn active_inputs(x: &[f32], threshold: Threshold) -> (Vec<u32>, Vec<f32>) {
    let mut cols = Vec::with_capacity(x.len());
    let mut xs = Vec::with_capacity(x.len());
    for (c, &v) in x.iter().enumerate() {
        if v != 0.0 && is_active(v, threshold) {
            cols.push(c as u32);
            xs.push(v);
        }
    }
    (cols, xs)
}

fn masked(x: &[f32], threshold: Threshold) -> Vec<f32> {
    x.iter()
        .map(|&v| if is_active(v, threshold) { v } else { 0.0 })
        .collect()
}

thread_local! {
    /// `Wᵀ` decoded for a batched product, reused across calls (fresh multi-MB buffers per
    /// product cost page faults).
    static PANEL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

// ------------------------------------------------------------------------------------------
// Tiled-CBC
// ------------------------------------------------------------------------------------------

/// Tiled-CBC with SIMD products; kind, storage and blob are those of [`TiledCbc`].
#[derive(Clone, Debug, PartialEq)]
pub struct FastTiledCbc {
    inner: TiledCbc,
}

impl FastTiledCbc {
    pub fn new(inner: TiledCbc) -> Self {
        Self { inner }
    }
    pub fn inner(&self) -> &TiledCbc {
        &self.inner
    }

    /// Sums of row tile `rt` over the columns `cols` weighted by `xs` into `acc` (256 rows;
    /// padding rows get 0). `cols` must be below K.
    fn tile_product(&self, level: SimdLevel, rt: usize, cols: &[u32], xs: &[f32], acc: &mut [f32; TILE_M]) {
        debug_assert!(cols.iter().all(|&c| (c as usize) < self.inner.cols()));
        let live_words = (self.inner.rows() - rt * TILE_M).min(TILE_M).div_ceil(64);
        match level {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the level is supported (callers only pass supported levels); every value
            // read lies in the column's validated range `[start, start + nnz)`.
            SimdLevel::Avx512Vbmi2 => unsafe {
                match live_words {
                    1 => x86::tile_avx512_vbmi2::<1>(&self.inner, rt, cols, xs, acc),
                    2 => x86::tile_avx512_vbmi2::<2>(&self.inner, rt, cols, xs, acc),
                    3 => x86::tile_avx512_vbmi2::<3>(&self.inner, rt, cols, xs, acc),
                    _ => x86::tile_avx512_vbmi2::<4>(&self.inner, rt, cols, xs, acc),
                }
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            SimdLevel::Avx512 => unsafe { x86::tile_avx512(&self.inner, rt, cols, xs, live_words, acc) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            SimdLevel::Avx2 => unsafe { x86::tile_avx2(&self.inner, rt, cols, xs, live_words, acc) },
            _ => tile_portable(&self.inner, rt, cols, xs, acc),
        }
    }

    /// `y = W · mask(x)` through the kernels of `level`.
    pub fn matvec_with(&self, level: SimdLevel, x: &[f32], threshold: Threshold, y: &mut [f32]) -> Result<(), FormatError> {
        let (m, k) = (self.inner.rows(), self.inner.cols());
        check_product_args(m, k, x, 1, threshold, y)?;
        let level = level.min(best_supported());
        let (cols, xs) = active_inputs(x, threshold);
        let rts = self.inner.row_tiles();
        let workers = rayon::current_num_threads().max(1);
        // About four tasks per thread, no column chunk below 32 columns.
        let chunks = (4 * workers).div_ceil(rts).min(cols.len().div_ceil(32)).max(1);
        let per = cols.len().div_ceil(chunks).max(1);
        let partials: Vec<[f32; TILE_M]> = (0..rts * chunks)
            .into_par_iter()
            .map(|task| {
                let (rt, ch) = (task / chunks, task % chunks);
                let lo = (ch * per).min(cols.len());
                let hi = ((ch + 1) * per).min(cols.len());
                let mut acc = [0f32; TILE_M];
                self.tile_product(level, rt, &cols[lo..hi], &xs[lo..hi], &mut acc);
                acc
            })
            .collect();
        for rt in 0..rts {
            let r0 = rt * TILE_M;
            let out = &mut y[r0..(r0 + TILE_M).min(m)];
            out.copy_from_slice(&partials[rt * chunks][..out.len()]);
            for p in &partials[rt * chunks + 1..(rt + 1) * chunks] {
                out.iter_mut().zip(p.iter()).for_each(|(o, v)| *o += v);
            }
        }
        Ok(())
    }

    /// `Y = mask(X) · Wᵀ` for `n` tokens through the kernels of `level`.
    pub fn matmul_with(&self, level: SimdLevel, x: &[f32], n: usize, threshold: Threshold, y: &mut [f32]) -> Result<(), FormatError> {
        let (m, k) = (self.inner.rows(), self.inner.cols());
        check_product_args(m, k, x, n, threshold, y)?;
        if n < GEMM_MIN_TOKENS {
            for (xr, yr) in x.chunks_exact(k).zip(y.chunks_exact_mut(m)) {
                self.matvec_with(level, xr, threshold, yr)?;
            }
            return Ok(());
        }
        let level = level.min(best_supported());
        let xm;
        let x = if threshold.is_some() {
            xm = masked(x, threshold);
            &xm[..]
        } else {
            x
        };
        PANEL.with(|panel| {
            let mut panel = panel.borrow_mut();
            if panel.len() < k * m {
                panel.resize(k * m, 0.0);
            }
            let wt = &mut panel[..k * m];
            self.decode_transposed(level, wt);
            gemm::gemm(n, m, k, gemm::View::row_major(x, k), gemm::View::row_major(&*wt, m), y, m, false, true)
                .map_err(|e| FormatError::Option(e.to_string()))
        })
    }

    /// Writes `Wᵀ` (K x M row-major, f32) into `wt`, one column tile at a time.
    fn decode_transposed(&self, level: SimdLevel, wt: &mut [f32]) {
        let (m, k) = (self.inner.rows(), self.inner.cols());
        let rts = self.inner.row_tiles();
        wt.par_chunks_mut(m).enumerate().for_each(|(c, row)| {
            let mut acc = [0f32; TILE_M];
            for rt in 0..rts {
                self.tile_product(level, rt, &[c as u32], &[1.0], &mut acc);
                let r0 = rt * TILE_M;
                let len = TILE_M.min(m - r0);
                row[r0..r0 + len].copy_from_slice(&acc[..len]);
            }
        });
        debug_assert_eq!(wt.len(), k * m);
    }
}

fn best_supported() -> SimdLevel {
    SimdLevel::available().into_iter().max().unwrap_or(SimdLevel::Portable)
}

/// Scalar walk of one row tile: the bits of each column tile in row order, values in step.
fn tile_portable(w: &TiledCbc, rt: usize, cols: &[u32], xs: &[f32], acc: &mut [f32; TILE_M]) {
    acc.fill(0.0);
    let kt = w.col_tiles();
    let (offsets, info, bitmaps, values) = (w.tile_offset(), w.col_info(), w.bitmaps(), w.values());
    for (&c, &xv) in cols.iter().zip(xs) {
        let c = c as usize;
        let g = rt * kt + c / TILE_K;
        let ct = g * TILE_K + c % TILE_K;
        let mut pos = offsets[g] as usize + (info[ct] >> 16) as usize;
        for (wi, &word) in bitmaps[ct * WORDS_PER_COLUMN..(ct + 1) * WORDS_PER_COLUMN].iter().enumerate() {
            let mut bits = word;
            while bits != 0 {
                let b = bits.trailing_zeros() as usize;
                acc[wi * 64 + b] += values[pos].to_f32() * xv;
                pos += 1;
                bits &= bits - 1;
            }
        }
    }
}

impl WeightFormat for FastTiledCbc {
    fn kind(&self) -> FormatKind {
        FormatKind::TiledCbc
    }
    fn rows(&self) -> usize {
        self.inner.rows()
    }
    fn cols(&self) -> usize {
        self.inner.cols()
    }
    fn storage(&self) -> Storage {
        self.inner.storage()
    }
    fn decode(&self) -> DenseMatrix {
        self.inner.decode()
    }
    fn matvec(&self, x: &[f32], threshold: Threshold, y: &mut [f32]) -> Result<(), FormatError> {
        self.matvec_with(SimdLevel::detect(), x, threshold, y)
    }
    fn matmul(&self, x: &[f32], n: usize, threshold: Threshold, y: &mut [f32]) -> Result<(), FormatError> {
        self.matmul_with(SimdLevel::detect(), x, n, threshold, y)
    }
    fn write_payload(&self, w: &mut ByteWriter) {
        self.inner.write_payload(w)
    }
}

// ------------------------------------------------------------------------------------------
// Dense, column-major
// ------------------------------------------------------------------------------------------

/// Dense f16 weights stored by blocks of [`DENSE_BLOCK`] rows, each block column-major
/// (`blocks[(b · K + c) · 64 + r] = W[64 b + r][c]`, rows zero-padded to a multiple of 64), so
/// that a product under a threshold reads only the 128-byte pieces of active columns, and one
/// block's pieces are contiguous (a plain column-major `Wᵀ` read 64-row pieces a whole column
/// apart, which the hardware prefetchers did not follow: 3-4 GB/s against 12-22 GB/s for rows).
/// Kind and blob are those of `sieve_formats::dense::Dense` (the blob is written row-major).
#[derive(Clone, Debug, PartialEq)]
pub struct DenseColumns {
    rows: usize,
    cols: usize,
    blocks: Vec<f16>,
}

/// Rows per block of [`DenseColumns`]: 4 `zmm` / 8 `ymm` accumulators of f32.
pub const DENSE_BLOCK: usize = 64;

impl DenseColumns {
    pub fn new(w: &DenseMatrix) -> Self {
        let (m, k) = (w.rows(), w.cols());
        let nb = m.div_ceil(DENSE_BLOCK);
        let mut blocks = vec![f16::ZERO; nb * k * DENSE_BLOCK];
        for r in 0..m {
            let (b, rr) = (r / DENSE_BLOCK, r % DENSE_BLOCK);
            for (c, &v) in w.row(r).iter().enumerate() {
                blocks[(b * k + c) * DENSE_BLOCK + rr] = v;
            }
        }
        Self { rows: m, cols: k, blocks }
    }

    /// `y = W · mask(x)` through the kernels of `level`.
    pub fn matvec_with(&self, level: SimdLevel, x: &[f32], threshold: Threshold, y: &mut [f32]) -> Result<(), FormatError> {
        let (m, k) = (self.rows, self.cols);
        check_product_args(m, k, x, 1, threshold, y)?;
        let level = level.min(best_supported());
        let (cols, xs) = active_inputs(x, threshold);
        y.par_chunks_mut(DENSE_BLOCK).enumerate().for_each(|(b, out)| {
            let block = &self.blocks[b * k * DENSE_BLOCK..(b + 1) * k * DENSE_BLOCK];
            let mut acc = [0f32; DENSE_BLOCK];
            match level {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: supported level; every column `c < K` of the block holds 64 values.
                SimdLevel::Avx512 | SimdLevel::Avx512Vbmi2 => unsafe { x86::dense_block_avx512(block, &cols, &xs, &mut acc) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                SimdLevel::Avx2 => unsafe { x86::dense_block_avx2(block, &cols, &xs, &mut acc) },
                _ => {
                    for (&c, &xv) in cols.iter().zip(&xs) {
                        let col = &block[c as usize * DENSE_BLOCK..][..DENSE_BLOCK];
                        acc.iter_mut().zip(col).for_each(|(o, w)| *o += w.to_f32() * xv);
                    }
                }
            }
            out.copy_from_slice(&acc[..out.len()]);
        });
        Ok(())
    }

    fn get(&self, r: usize, c: usize) -> f16 {
        self.blocks[((r / DENSE_BLOCK) * self.cols + c) * DENSE_BLOCK + r % DENSE_BLOCK]
    }
}

impl WeightFormat for DenseColumns {
    fn kind(&self) -> FormatKind {
        FormatKind::Dense
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn storage(&self) -> Storage {
        Storage {
            payload_bytes: self.rows * self.cols * 2,
            metadata_bytes: 0,
        }
    }
    fn decode(&self) -> DenseMatrix {
        let (m, k) = (self.rows, self.cols);
        let mut data = vec![f16::ZERO; m * k];
        for r in 0..m {
            for c in 0..k {
                data[r * k + c] = self.get(r, c);
            }
        }
        DenseMatrix::new(m, k, data).expect("built from a valid DenseMatrix")
    }
    fn matvec(&self, x: &[f32], threshold: Threshold, y: &mut [f32]) -> Result<(), FormatError> {
        self.matvec_with(SimdLevel::detect(), x, threshold, y)
    }
    fn matmul(&self, x: &[f32], n: usize, threshold: Threshold, y: &mut [f32]) -> Result<(), FormatError> {
        let (m, k) = (self.rows, self.cols);
        check_product_args(m, k, x, n, threshold, y)?;
        if n < GEMM_MIN_TOKENS {
            for (xr, yr) in x.chunks_exact(k).zip(y.chunks_exact_mut(m)) {
                self.matvec(xr, threshold, yr)?;
            }
            return Ok(());
        }
        let xm;
        let x = if threshold.is_some() {
            xm = masked(x, threshold);
            &xm[..]
        } else {
            x
        };
        PANEL.with(|panel| {
            let mut panel = panel.borrow_mut();
            if panel.len() < k * m {
                panel.resize(k * m, 0.0);
            }
            // Wᵀ (K x M) in f32, one block column piece at a time.
            let wt = &mut panel[..k * m];
            wt.par_chunks_mut(m).enumerate().for_each(|(c, row)| {
                for (b, piece) in row.chunks_mut(DENSE_BLOCK).enumerate() {
                    let src = &self.blocks[(b * k + c) * DENSE_BLOCK..][..piece.len()];
                    super::kernels::f16_to_f32(src, piece);
                }
            });
            gemm::gemm(n, m, k, gemm::View::row_major(x, k), gemm::View::row_major(&*wt, m), y, m, false, true)
                .map_err(|e| FormatError::Option(e.to_string()))
        })
    }
    fn write_payload(&self, w: &mut ByteWriter) {
        w.u64(self.rows as u64);
        w.u64(self.cols as u64);
        w.f16s(self.decode().data());
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::f16;
    use sieve_formats::tiled_cbc::{TiledCbc, TILE_K, TILE_M, WORDS_PER_COLUMN};
    use std::arch::x86_64::*;

    /// Active columns prefetched ahead of the one being multiplied. Skipped columns break the
    /// hardware prefetcher's streams, and a column tile (~256 bytes at 50%) takes only ~20 ns
    /// to multiply against ~100 ns to fetch, so several must be in flight.
    static PF: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();
    fn pf() -> (usize, usize) {
        *PF.get_or_init(|| {
            let d = std::env::var("PF_DIST").ok().and_then(|v| v.parse().ok()).unwrap_or(8);
            let h = std::env::var("PF_HINT").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
            (d, h)
        })
    }

    /// Prefetches the bitmap and values of column `c` of row tile `rt`.
    #[inline(always)]
    unsafe fn prefetch_column(w: &TiledCbc, kt: usize, rt: usize, c: usize) {
        let g = rt * kt + c / TILE_K;
        let ct = g * TILE_K + c % TILE_K;
        let info = *w.col_info().get_unchecked(ct);
        let start = w.value_bits().as_ptr().add(*w.tile_offset().get_unchecked(g) as usize + (info >> 16) as usize) as *const i8;
        let bytes = 2 * (info & 0xffff) as usize;
        let hint = pf().1;
        _mm_prefetch::<_MM_HINT_T0>(w.bitmaps().as_ptr().add(ct * WORDS_PER_COLUMN) as *const i8);
        let mut off = 0;
        while off < bytes {
            match hint {
                0 => _mm_prefetch::<_MM_HINT_T0>(start.add(off)),
                1 => _mm_prefetch::<_MM_HINT_T1>(start.add(off)),
                2 => _mm_prefetch::<_MM_HINT_T2>(start.add(off)),
                _ => {}
            }
            off += 64;
        }
    }

    /// Row tile `rt` of Tiled-CBC: 16 `zmm` accumulators of 16 rows, one masked load +
    /// `vcvtph2ps` + `vexpandps` + FMA per 16 rows of an active column. Words at and beyond
    /// `live_words` are padding rows (all clear) and skipped.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,bmi2,popcnt")]
    pub unsafe fn tile_avx512(w: &TiledCbc, rt: usize, cols: &[u32], xs: &[f32], live_words: usize, acc_out: &mut [f32; TILE_M]) {
        let kt = w.col_tiles();
        let (offsets, info, bitmaps) = (w.tile_offset(), w.col_info(), w.bitmaps());
        let values = w.value_bits().as_ptr();
        let mut acc = [_mm512_setzero_ps(); 16];
        for &c in cols.iter().take(pf().0) {
            prefetch_column(w, kt, rt, c as usize);
        }
        for (i, (&c, &xv)) in cols.iter().zip(xs).enumerate() {
            if let Some(&ahead) = cols.get(i + pf().0) {
                prefetch_column(w, kt, rt, ahead as usize);
            }
            let c = c as usize;
            let g = rt * kt + c / TILE_K;
            let ct = g * TILE_K + c % TILE_K;
            let mut p = values.add(*offsets.get_unchecked(g) as usize + (*info.get_unchecked(ct) >> 16) as usize);
            let vx = _mm512_set1_ps(xv);
            let bm = bitmaps.as_ptr().add(ct * WORDS_PER_COLUMN);
            for wi in 0..WORDS_PER_COLUMN {
                if wi >= live_words {
                    break;
                }
                let word = *bm.add(wi);
                for h in 0..4 {
                    let m = (word >> (16 * h)) as u32 & 0xffff;
                    let cnt = m.count_ones();
                    let raw = _mm256_maskz_loadu_epi16(_bzhi_u32(0xffff, cnt) as __mmask16, p as *const i16);
                    let v = _mm512_maskz_expand_ps(m as __mmask16, _mm512_cvtph_ps(raw));
                    acc[wi * 4 + h] = _mm512_fmadd_ps(v, vx, acc[wi * 4 + h]);
                    p = p.add(cnt as usize);
                }
            }
        }
        for (j, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(acc_out.as_mut_ptr().add(16 * j), *a);
        }
    }

    /// [`tile_avx512`] with `vpexpandw`: per 32 rows one masked load of the next `popcount`
    /// values, one expand, two conversions and two FMAs. `WORDS` live 64-row words (a const so
    /// the accumulators stay in registers without per-word branches).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,bmi2,popcnt")]
    pub unsafe fn tile_avx512_vbmi2<const WORDS: usize>(w: &TiledCbc, rt: usize, cols: &[u32], xs: &[f32], acc_out: &mut [f32; TILE_M]) {
        let kt = w.col_tiles();
        let (offsets, info, bitmaps) = (w.tile_offset(), w.col_info(), w.bitmaps());
        let values = w.value_bits().as_ptr();
        let mut acc = [_mm512_setzero_ps(); 16];
        for &c in cols.iter().take(pf().0) {
            prefetch_column(w, kt, rt, c as usize);
        }
        for (i, (&c, &xv)) in cols.iter().zip(xs).enumerate() {
            if let Some(&ahead) = cols.get(i + pf().0) {
                prefetch_column(w, kt, rt, ahead as usize);
            }
            let c = c as usize;
            let g = rt * kt + c / TILE_K;
            let ct = g * TILE_K + c % TILE_K;
            let mut p = values.add(*offsets.get_unchecked(g) as usize + (*info.get_unchecked(ct) >> 16) as usize);
            let vx = _mm512_set1_ps(xv);
            let bm = bitmaps.as_ptr().add(ct * WORDS_PER_COLUMN);
            for wi in 0..WORDS {
                let word = *bm.add(wi);
                for h in 0..2 {
                    let m = (word >> (32 * h)) as u32;
                    let cnt = m.count_ones();
                    let raw = _mm512_maskz_loadu_epi16(_bzhi_u32(u32::MAX, cnt), p as *const i16);
                    let v = _mm512_maskz_expand_epi16(m, raw);
                    let lo = _mm512_cvtph_ps(_mm512_castsi512_si256(v));
                    let hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(v));
                    let j = wi * 4 + 2 * h;
                    acc[j] = _mm512_fmadd_ps(lo, vx, acc[j]);
                    acc[j + 1] = _mm512_fmadd_ps(hi, vx, acc[j + 1]);
                    p = p.add(cnt as usize);
                }
            }
        }
        for (j, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(acc_out.as_mut_ptr().add(16 * j), *a);
        }
    }

    /// For each byte value `m`, lane `j` holds the rank of bit `j` among the set bits of `m`
    /// (0 for clear bits, which are masked afterwards): `vpermps` by it places the packed values.
    static RANKS: [[u32; 8]; 256] = {
        let mut t = [[0u32; 8]; 256];
        let mut m = 0;
        while m < 256 {
            let mut j = 0;
            let mut rank = 0;
            while j < 8 {
                if m & (1 << j) != 0 {
                    t[m][j] = rank;
                    rank += 1;
                }
                j += 1;
            }
            m += 1;
        }
        t
    };

    /// Loads 8 f16 at `p` as f32; reads past `end` (the end of the values) are replaced by 0.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8_f16(p: *const u16, end: *const u16) -> __m256 {
        if p.add(8) <= end {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        } else {
            let mut tmp = [0u16; 8];
            let n = end.offset_from(p).max(0) as usize;
            std::ptr::copy_nonoverlapping(p, tmp.as_mut_ptr(), n.min(8));
            _mm256_cvtph_ps(_mm_loadu_si128(tmp.as_ptr() as *const __m128i))
        }
    }

    /// Row tile `rt` of Tiled-CBC on AVX2: four passes of 64 rows with 8 `ymm` accumulators;
    /// per byte of bitmap, 8 values are loaded, converted, placed by `vpermps` and masked.
    #[target_feature(enable = "avx2,fma,f16c,bmi2,popcnt")]
    pub unsafe fn tile_avx2(w: &TiledCbc, rt: usize, cols: &[u32], xs: &[f32], live_words: usize, acc_out: &mut [f32; TILE_M]) {
        let kt = w.col_tiles();
        let (offsets, info, bitmaps) = (w.tile_offset(), w.col_info(), w.bitmaps());
        let bits = w.value_bits();
        let (values, end) = (bits.as_ptr(), bits.as_ptr().add(bits.len()));
        let lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        acc_out.fill(0.0);
        for wi in 0..live_words.min(WORDS_PER_COLUMN) {
            let mut acc = [_mm256_setzero_ps(); 8];
            if wi == 0 {
                for &c in cols.iter().take(pf().0) {
                    prefetch_column(w, kt, rt, c as usize);
                }
            }
            for (i, (&c, &xv)) in cols.iter().zip(xs).enumerate() {
                if wi == 0 {
                    if let Some(&ahead) = cols.get(i + pf().0) {
                        prefetch_column(w, kt, rt, ahead as usize);
                    }
                }
                let c = c as usize;
                let g = rt * kt + c / TILE_K;
                let ct = g * TILE_K + c % TILE_K;
                let bm = bitmaps.as_ptr().add(ct * WORDS_PER_COLUMN);
                let mut skip = 0u32;
                for prev in 0..wi {
                    skip += (*bm.add(prev)).count_ones();
                }
                let mut p = values.add(
                    *offsets.get_unchecked(g) as usize + (*info.get_unchecked(ct) >> 16) as usize + skip as usize,
                );
                let vx = _mm256_set1_ps(xv);
                let word = *bm.add(wi);
                for (b, a) in acc.iter_mut().enumerate() {
                    let m = ((word >> (8 * b)) & 0xff) as usize;
                    if m == 0 {
                        continue;
                    }
                    let v = load8_f16(p, end);
                    let idx = _mm256_loadu_si256(RANKS.as_ptr().add(m) as *const __m256i);
                    let placed = _mm256_permutevar8x32_ps(v, idx);
                    let sel = _mm256_set1_epi32(m as i32);
                    let keep = _mm256_cmpeq_epi32(_mm256_and_si256(sel, lane_bits), lane_bits);
                    let placed = _mm256_and_ps(placed, _mm256_castsi256_ps(keep));
                    *a = _mm256_fmadd_ps(placed, vx, *a);
                    p = p.add(m.count_ones() as usize);
                }
            }
            for (j, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(acc_out.as_mut_ptr().add(wi * 64 + 8 * j), *a);
            }
        }
    }

    /// Active columns prefetched ahead in the dense block products (2 lines each).
    const DENSE_PREFETCH: usize = 16;

    /// `acc[r] = Σ_j xs[j] · block[cols[j] · 64 + r]` for one 64-row block: two sets of 4 `zmm`
    /// accumulators (even and odd columns) keep 8 FMA chains in flight.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
    pub unsafe fn dense_block_avx512(block: &[f16], cols: &[u32], xs: &[f32], acc_out: &mut [f32; 64]) {
        let base = block.as_ptr() as *const u16;
        let mut acc = [[_mm512_setzero_ps(); 4]; 2];
        for &c in cols.iter().take(DENSE_PREFETCH) {
            _mm_prefetch::<_MM_HINT_T0>(base.add(c as usize * 64) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(base.add(c as usize * 64 + 32) as *const i8);
        }
        for (i, (&c, &xv)) in cols.iter().zip(xs).enumerate() {
            if let Some(&ahead) = cols.get(i + DENSE_PREFETCH) {
                _mm_prefetch::<_MM_HINT_T0>(base.add(ahead as usize * 64) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(base.add(ahead as usize * 64 + 32) as *const i8);
            }
            let p = base.add(c as usize * 64);
            let vx = _mm512_set1_ps(xv);
            let set = &mut acc[i & 1];
            for (j, a) in set.iter_mut().enumerate() {
                let wv = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(16 * j) as *const __m256i));
                *a = _mm512_fmadd_ps(wv, vx, *a);
            }
        }
        for j in 0..4 {
            _mm512_storeu_ps(acc_out.as_mut_ptr().add(16 * j), _mm512_add_ps(acc[0][j], acc[1][j]));
        }
    }

    /// [`dense_block_avx512`] with 8 `ymm` accumulators.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dense_block_avx2(block: &[f16], cols: &[u32], xs: &[f32], acc_out: &mut [f32; 64]) {
        let base = block.as_ptr() as *const u16;
        let mut acc = [_mm256_setzero_ps(); 8];
        for &c in cols.iter().take(DENSE_PREFETCH) {
            _mm_prefetch::<_MM_HINT_T0>(base.add(c as usize * 64) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(base.add(c as usize * 64 + 32) as *const i8);
        }
        for (i, (&c, &xv)) in cols.iter().zip(xs).enumerate() {
            if let Some(&ahead) = cols.get(i + DENSE_PREFETCH) {
                _mm_prefetch::<_MM_HINT_T0>(base.add(ahead as usize * 64) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(base.add(ahead as usize * 64 + 32) as *const i8);
            }
            let p = base.add(c as usize * 64);
            let vx = _mm256_set1_ps(xv);
            for (j, a) in acc.iter_mut().enumerate() {
                let wv = _mm256_cvtph_ps(_mm_loadu_si128(p.add(8 * j) as *const __m128i));
                *a = _mm256_fmadd_ps(wv, vx, *a);
            }
        }
        for (j, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(acc_out.as_mut_ptr().add(8 * j), *a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sieve_formats::random::{activations, sparse_matrix, threshold_for_sparsity, Pattern};
    use sieve_formats::reference::{matmul_f64, matvec_f64, max_rel_error};

    /// The reference kernels' own tolerance (sieve-formats tests) is 1e-3; f32 sums in another
    /// order stay far inside it, so the fast paths are held to 1e-5.
    const TOL: f64 = 1e-5;

    fn check_all_levels(rows: usize, cols: usize, sp: f64, dp: f64, tokens: usize, seed: u64) {
        let w = sparse_matrix(rows, cols, sp, Pattern::Unstructured, seed).unwrap();
        let x = activations(cols * tokens, seed ^ 7);
        let t = threshold_for_sparsity(&x, dp).unwrap();
        let want_v = matvec_f64(&w, &x[..cols], t);
        let want_m = matmul_f64(&w, &x, tokens, t);
        let tc = FastTiledCbc::new(TiledCbc::encode(&w).unwrap());
        let dc = DenseColumns::new(&w);
        for level in SimdLevel::available() {
            let mut y = vec![f32::NAN; rows];
            tc.matvec_with(level, &x[..cols], t, &mut y).unwrap();
            let e = max_rel_error(&y, &want_v);
            assert!(e <= TOL, "tiled-cbc {level:?} {rows}x{cols} sp {sp} dp {dp}: matvec error {e}");
            let mut y = vec![f32::NAN; rows];
            dc.matvec_with(level, &x[..cols], t, &mut y).unwrap();
            let e = max_rel_error(&y, &want_v);
            assert!(e <= TOL, "dense-columns {level:?} {rows}x{cols}: matvec error {e}");
            let mut ym = vec![f32::NAN; rows * tokens];
            tc.matmul_with(level, &x, tokens, t, &mut ym).unwrap();
            let e = max_rel_error(&ym, &want_m);
            assert!(e <= TOL, "tiled-cbc {level:?} {rows}x{cols} x{tokens}: matmul error {e}");
        }
        let mut ym = vec![f32::NAN; rows * tokens];
        dc.matmul(&x, tokens, t, &mut ym).unwrap();
        assert!(max_rel_error(&ym, &want_m) <= TOL);
    }

    #[test]
    fn fast_products_match_the_f64_reference() {
        // Partial row tiles (M % 256, M < 64), partial column groups (K % 16), one column,
        // empty and full matrices, every threshold regime, batches below and above the GEMM cut.
        for &(m, k) in &[(1, 1), (7, 13), (192, 576), (300, 40), (513, 17), (64, 129), (257, 16)] {
            for (i, &sp) in [0.0, 0.5, 0.7, 0.97].iter().enumerate() {
                for (j, &dp) in [0.0, 0.5, 0.9].iter().enumerate() {
                    let tokens = [1, 3, 6][(i + j) % 3];
                    check_all_levels(m, k, sp, dp, tokens, (m * 1000 + k) as u64 + i as u64 * 7 + j as u64);
                }
            }
        }
    }

    #[test]
    fn fast_products_agree_with_the_reference_kernels_and_keep_the_blob() {
        let w = sparse_matrix(600, 96, 0.6, Pattern::Unstructured, 3).unwrap();
        let x = activations(96, 4);
        let t = threshold_for_sparsity(&x, 0.5).unwrap();
        let reference = TiledCbc::encode(&w).unwrap();
        let fast = FastTiledCbc::new(reference.clone());
        let (mut a, mut b) = (vec![0f32; 600], vec![0f32; 600]);
        reference.matvec(&x, t, &mut a).unwrap();
        fast.matvec(&x, t, &mut b).unwrap();
        let want: Vec<f64> = a.iter().map(|v| *v as f64).collect();
        assert!(max_rel_error(&b, &want) <= TOL);
        assert_eq!(fast.to_bytes(), reference.to_bytes());
        let dc = DenseColumns::new(&w);
        let back = sieve_formats::registry::from_bytes(&dc.to_bytes()).unwrap();
        assert_eq!(back.kind(), FormatKind::Dense);
        assert_eq!(back.decode(), w);
        assert_eq!(dc.decode(), w);
    }

    #[test]
    fn bad_shapes_are_errors() {
        let w = sparse_matrix(40, 20, 0.5, Pattern::Unstructured, 1).unwrap();
        let fast = FastTiledCbc::new(TiledCbc::encode(&w).unwrap());
        let dc = DenseColumns::new(&w);
        let mut y = vec![0f32; 40];
        assert!(fast.matvec(&[0.0; 19], None, &mut y).is_err());
        assert!(dc.matvec(&[0.0; 21], None, &mut y).is_err());
        assert!(fast.matvec(&[0.0; 20], Some(f32::NAN), &mut y).is_err());
        assert!(fast.matmul(&[0.0; 40], 2, None, &mut y).is_err());
    }
}
