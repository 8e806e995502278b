//! Fast CPU products of the packed column formats `sieve pack` writes, beside the reference
//! kernels of `sieve_formats` they are tested against.
//!
//! **The CPU layouts of the packed formats, and which one a loaded pack runs**
//! ([`crate::format_from_blob`]):
//!
//! | blob | CPU layout (built at load; the blob stays what it was) | where |
//! |---|---|---|
//! | Tiled-CBC | blocks of 32 rows, column-major inside: per (block, column) a `u32` bitmap, a `u16` offset, the values; active columns visited, every block streamed | [`super::rows::RowTiledCbc`], **the default** |
//! | Tiled-CBC | whole columns: per column an `M`-bit bitmap and its values; inactive columns skipped over the whole matrix | [`ColumnTiledCbc`], `--cpu-kernel tiled-cbc=columns` |
//! | IE-BME INT4 | rows of 64-column blocks: `u64` bitmap + nibbles, integer products | [`crate::ie_bme::Int4IeBme`], the default |
//! | IE-BME other payloads | the whole-column layout over the exact dequantized matrix | [`F16IeBme`] (`--cpu-kernel ie-bme=columns` for INT4 too) |
//! | dense | f16 rows (`FastDense`); [`DenseColumns`] column-major, not used by default | [`crate::dense::FastDense`] |
//!
//! Decoding one token is bound by the bytes of weights streamed *and how they are streamed*:
//! the hardware prefetchers follow sequential streams and fetch whole runs ahead, so skipping
//! 128-256-byte pieces here and there (the GPU's 256-row Tiled-CBC column tiles, or 64-row
//! blocks of a dense matrix) saves almost no memory traffic, and reading pieces a column apart
//! defeats the prefetchers altogether (both measured: `examples/sparse_bench.rs`,
//! docs/BENCHMARKS.md). The two products of this module read only the weight columns of
//! active inputs (TEAL: `|x| > t` and `x != 0`) in a **column-major layout with whole columns
//! contiguous**: a skipped input skips one contiguous run of `M` weights, and a task reads a
//! contiguous range of columns. That reads the fewest bytes, but each skip restarts a stream, so
//! from DRAM it moved 2-3 GB/s against 11-13 GB/s for dense rows; packs now run Tiled-CBC
//! through the row-blocked layout of [`super::rows`] instead, which streams every stored weight and
//! saves compute, not bytes, on inactive inputs. The column layout stays selectable to compare.
//!
//! * [`ColumnTiledCbc`] converts a Tiled-CBC blob at load into that layout (the blob, and what it
//!   writes back, stay Tiled-CBC: the GPU's layout): per column, an `M`-bit bitmap and the
//!   column's nonzero f16 values in row order. The AVX-512 kernel turns each 32 (VBMI2:
//!   `vpexpandw`) or 16 (`vexpandps`) bits of bitmap and the next `popcount` values into dense
//!   lanes with one masked load and one expand, converts them to f32 and adds them, scaled by
//!   `x`, into the task's column sums. The AVX2 kernel does the same per 8 rows with `vpermps`
//!   by a 256-entry rank table and a mask.
//! * [`DenseColumns`] is dense f16 stored column-major (`Wᵀ`, K x M, the same blob payload as
//!   `Dense`): with a threshold, a row-major matrix must still read every column, column-major
//!   reads only the active ones. Measured on the 2-core machine it is *slower* than the
//!   row-major `FastDense` at dp 0.5 (each skipped column restarts the prefetcher's stream, a
//!   memory latency per break) and faster only from dp ~0.9, so packs do not use it by default.
//!
//! Both split the active columns into about two chunks per thread (split-K); each chunk sums
//! into its own `M` floats (L1-resident), added together at the end.
//!
//! Batched products (prefill) run the blocked GEMM on masked activations over `Wᵀ` (Tiled-CBC
//! decodes its columns into a per-thread f32 panel first); for a handful of tokens the
//! matrix-vector product runs once per token instead.
//!
//! The portable kernels are scalar walks of the same layouts, used where AVX2 is missing.

use crate::gemm;
use crate::simd::SimdLevel;
use half::f16;
use rayon::prelude::*;
use sieve_formats::blob::ByteWriter;
use sieve_formats::format::{check_product_args, is_active};
use sieve_formats::tiled_cbc::TiledCbc;
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

/// Runs `chunk(cols, xs, sums)` over about two chunks of the active columns per thread, each
/// into its own `len` zeroed floats, and writes the sum of the chunks' first `y.len()` floats
/// into `y`.
fn split_k(
    cols: &[u32],
    xs: &[f32],
    len: usize,
    y: &mut [f32],
    chunk: impl Fn(&[u32], &[f32], &mut [f32]) + Sync,
) {
    let workers = rayon::current_num_threads().max(1);
    // Chunks of at least 16 columns: below that the reduction costs more than it spreads.
    let chunks = (2 * workers).min(cols.len().div_ceil(16)).max(1);
    let per = cols.len().div_ceil(chunks).max(1);
    let partials: Vec<Vec<f32>> = (0..chunks)
        .into_par_iter()
        .map(|ch| {
            let lo = (ch * per).min(cols.len());
            let hi = ((ch + 1) * per).min(cols.len());
            let mut sums = vec![0f32; len];
            chunk(&cols[lo..hi], &xs[lo..hi], &mut sums);
            sums
        })
        .collect();
    y.copy_from_slice(&partials[0][..y.len()]);
    for p in &partials[1..] {
        y.iter_mut().zip(p.iter()).for_each(|(o, v)| *o += v);
    }
}

// ------------------------------------------------------------------------------------------
// Tiled-CBC, read into whole-column bitmaps
// ------------------------------------------------------------------------------------------

/// Tiled-CBC with SIMD products over a whole-column CPU layout built at load; kind, storage
/// and blob are those of the [`TiledCbc`] it was built from.
#[derive(Clone, Debug, PartialEq)]
pub struct ColumnTiledCbc {
    rows: usize,
    cols: usize,
    /// `ceil(M / 64)` bitmap words per column.
    words: usize,
    /// `bitmaps[c * words + w]`, bit `b` set <=> `W[64 w + b][c]` is stored.
    bitmaps: Vec<u64>,
    /// Column `c`'s values are `values[starts[c]..starts[c + 1]]`, in row order.
    starts: Vec<u32>,
    values: Vec<u16>,
    /// The Tiled-CBC storage (what the blob holds).
    storage: Storage,
}

impl ColumnTiledCbc {
    pub fn new(tiled: TiledCbc) -> Self {
        use sieve_formats::tiled_cbc::{TILE_K, TILE_M, WORDS_PER_COLUMN};
        let (m, k) = (tiled.rows(), tiled.cols());
        let words = m.div_ceil(64);
        let kt = tiled.col_tiles();
        let mut bitmaps = vec![0u64; k * words];
        let mut starts = Vec::with_capacity(k + 1);
        let mut values = Vec::with_capacity(tiled.values().len());
        let (offsets, info, tbits, tvals) = (
            tiled.tile_offset(),
            tiled.col_info(),
            tiled.bitmaps(),
            tiled.value_bits(),
        );
        starts.push(0u32);
        for c in 0..k {
            for rt in 0..tiled.row_tiles() {
                let g = rt * kt + c / TILE_K;
                let ct = g * TILE_K + c % TILE_K;
                let first = offsets[g] as usize + (info[ct] >> 16) as usize;
                let nnz = (info[ct] & 0xffff) as usize;
                values.extend_from_slice(&tvals[first..first + nnz]);
                for w in 0..WORDS_PER_COLUMN {
                    let word = rt * (TILE_M / 64) + w;
                    if word < words {
                        bitmaps[c * words + word] = tbits[ct * WORDS_PER_COLUMN + w];
                    }
                }
            }
            // Stored values are fewer than 2^32 (Tiled-CBC's own u32 offsets bound them).
            starts.push(values.len() as u32);
        }
        Self {
            rows: m,
            cols: k,
            words,
            bitmaps,
            starts,
            values,
            storage: tiled.storage(),
        }
    }

    /// Column sums of `cols` weighted by `xs` into `sums` (`64 * words` floats, zeroed).
    fn columns(&self, level: SimdLevel, cols: &[u32], xs: &[f32], sums: &mut [f32]) {
        debug_assert!(cols.iter().all(|&c| (c as usize) < self.cols));
        debug_assert_eq!(sums.len(), 64 * self.words);
        match level {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the level is supported (callers cap it by `SimdLevel::best`); each column's
            // values are `starts[c]..starts[c + 1]` with as many entries as its bitmap has bits
            // (checked when the Tiled-CBC blob was read), and `sums` has 64 floats per word.
            SimdLevel::Avx512Vbmi2 => unsafe { x86::columns_vbmi2(self, cols, xs, sums) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            SimdLevel::Avx512 => unsafe { x86::columns_avx512(self, cols, xs, sums) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            SimdLevel::Avx2 => unsafe { x86::columns_avx2(self, cols, xs, sums) },
            _ => self.columns_portable(cols, xs, sums),
        }
    }

    fn columns_portable(&self, cols: &[u32], xs: &[f32], sums: &mut [f32]) {
        for (&c, &xv) in cols.iter().zip(xs) {
            let c = c as usize;
            let mut pos = self.starts[c] as usize;
            for (w, &word) in self.bitmaps[c * self.words..(c + 1) * self.words]
                .iter()
                .enumerate()
            {
                let mut bits = word;
                while bits != 0 {
                    let b = bits.trailing_zeros() as usize;
                    sums[w * 64 + b] += f16::from_bits(self.values[pos]).to_f32() * xv;
                    pos += 1;
                    bits &= bits - 1;
                }
            }
        }
    }

    /// `y = W · mask(x)` through the kernels of `level`.
    pub fn matvec_with(
        &self,
        level: SimdLevel,
        x: &[f32],
        threshold: Threshold,
        y: &mut [f32],
    ) -> Result<(), FormatError> {
        check_product_args(self.rows, self.cols, x, 1, threshold, y)?;
        let level = level.min(SimdLevel::best());
        let (cols, xs) = active_inputs(x, threshold);
        split_k(&cols, &xs, 64 * self.words, y, |c, v, sums| {
            self.columns(level, c, v, sums)
        });
        Ok(())
    }

    /// `Y = mask(X) · Wᵀ` for `n` tokens through the kernels of `level`.
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
        if n < GEMM_MIN_TOKENS {
            for (xr, yr) in x.chunks_exact(k).zip(y.chunks_exact_mut(m)) {
                self.matvec_with(level, xr, threshold, yr)?;
            }
            return Ok(());
        }
        let level = level.min(SimdLevel::best());
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
            wt.par_chunks_mut(m).enumerate().for_each(|(c, row)| {
                let mut col = vec![0f32; 64 * self.words];
                self.columns(level, &[c as u32], &[1.0], &mut col);
                row.copy_from_slice(&col[..m]);
            });
            gemm::gemm(
                n,
                m,
                k,
                gemm::View::row_major(x, k),
                gemm::View::row_major(&*wt, m),
                y,
                m,
                false,
                true,
            )
            .map_err(|e| FormatError::Option(e.to_string()))
        })
    }
}

impl WeightFormat for ColumnTiledCbc {
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
        let (m, k) = (self.rows, self.cols);
        let mut data = vec![f16::ZERO; m * k];
        for c in 0..k {
            let mut pos = self.starts[c] as usize;
            for (w, &word) in self.bitmaps[c * self.words..(c + 1) * self.words]
                .iter()
                .enumerate()
            {
                let mut bits = word;
                while bits != 0 {
                    let r = w * 64 + bits.trailing_zeros() as usize;
                    data[r * k + c] = f16::from_bits(self.values[pos]);
                    pos += 1;
                    bits &= bits - 1;
                }
            }
        }
        DenseMatrix::new(m, k, data).expect("built from a validated Tiled-CBC matrix")
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
        write_tiled_cbc_payload(&self.decode(), w)
    }
}

/// The Tiled-CBC payload of a CPU layout built from a Tiled-CBC matrix, re-encoded from its
/// decoded matrix: the encoding is deterministic, so the bytes equal those read.
pub(crate) fn write_tiled_cbc_payload(matrix: &DenseMatrix, w: &mut ByteWriter) {
    match TiledCbc::encode(matrix) {
        Ok(t) => t.write_payload(w),
        // Cannot happen: the matrix came from a valid Tiled-CBC encoding.
        Err(e) => panic!("tiled-cbc re-encoding failed: {e}"),
    }
}

// ------------------------------------------------------------------------------------------
// IE-BME through the column kernel
// ------------------------------------------------------------------------------------------

/// IE-BME multiplied by the [`ColumnTiledCbc`] kernel over its exact dequantized matrix (scales
/// are chosen so that every `q · scale` is an f16, so the matrix is the IE-BME one bit for
/// bit). The reference IE-BME kernel walks union bitmaps, four area streams and nibbles per
/// element; this reads 2 bytes per stored weight instead of 0.5, but runs the SIMD column
/// product. Not the INT4 integer kernel the format deserves: a stopgap that keeps IE-BME packs
/// usable. Kind, storage and blob are the IE-BME ones.
#[derive(Debug)]
pub struct F16IeBme {
    source: sieve_formats::ie_bme::IeBme,
    columns: ColumnTiledCbc,
}

impl F16IeBme {
    pub fn new(source: sieve_formats::ie_bme::IeBme) -> Result<Self, FormatError> {
        let columns = ColumnTiledCbc::new(TiledCbc::encode(&source.decode())?);
        Ok(Self { source, columns })
    }
    pub fn columns(&self) -> &ColumnTiledCbc {
        &self.columns
    }
    /// The IE-BME matrix this was built from.
    pub fn source(&self) -> &sieve_formats::ie_bme::IeBme {
        &self.source
    }
}

impl WeightFormat for F16IeBme {
    fn kind(&self) -> FormatKind {
        FormatKind::IeBme
    }
    fn rows(&self) -> usize {
        self.source.rows()
    }
    fn cols(&self) -> usize {
        self.source.cols()
    }
    fn storage(&self) -> Storage {
        self.source.storage()
    }
    fn decode(&self) -> DenseMatrix {
        self.columns.decode()
    }
    fn matvec(&self, x: &[f32], threshold: Threshold, y: &mut [f32]) -> Result<(), FormatError> {
        self.columns.matvec(x, threshold, y)
    }
    fn matmul(
        &self,
        x: &[f32],
        n: usize,
        threshold: Threshold,
        y: &mut [f32],
    ) -> Result<(), FormatError> {
        self.columns.matmul(x, n, threshold, y)
    }
    fn write_payload(&self, w: &mut ByteWriter) {
        self.source.write_payload(w)
    }
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }
}

// ------------------------------------------------------------------------------------------
// Dense, column-major
// ------------------------------------------------------------------------------------------

/// Dense f16 weights stored column-major (`wt[c * M + r] = W[r][c]`) so that a product under a
/// threshold reads only the columns of active inputs. Kind and blob are those of
/// `sieve_formats::dense::Dense` (the blob is written row-major).
#[derive(Clone, Debug, PartialEq)]
pub struct DenseColumns {
    rows: usize,
    cols: usize,
    wt: Vec<f16>,
}

impl DenseColumns {
    pub fn new(w: &DenseMatrix) -> Self {
        let (m, k) = (w.rows(), w.cols());
        let mut wt = vec![f16::ZERO; m * k];
        for r in 0..m {
            for (c, &v) in w.row(r).iter().enumerate() {
                wt[c * m + r] = v;
            }
        }
        Self {
            rows: m,
            cols: k,
            wt,
        }
    }

    /// `y = W · mask(x)` through the kernels of `level`.
    pub fn matvec_with(
        &self,
        level: SimdLevel,
        x: &[f32],
        threshold: Threshold,
        y: &mut [f32],
    ) -> Result<(), FormatError> {
        let (m, k) = (self.rows, self.cols);
        check_product_args(m, k, x, 1, threshold, y)?;
        let level = level.min(SimdLevel::best());
        let (cols, xs) = active_inputs(x, threshold);
        split_k(&cols, &xs, m, y, |cols, xs, sums| match level {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: supported level; every column `c < K` holds `M = sums.len()` values.
            SimdLevel::Avx512 | SimdLevel::Avx512Vbmi2 => unsafe {
                x86::dense_columns_avx512(&self.wt, m, cols, xs, sums)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            SimdLevel::Avx2 => unsafe { x86::dense_columns_avx2(&self.wt, m, cols, xs, sums) },
            _ => {
                for (&c, &xv) in cols.iter().zip(xs) {
                    let col = &self.wt[c as usize * m..(c as usize + 1) * m];
                    sums.iter_mut()
                        .zip(col)
                        .for_each(|(o, w)| *o += w.to_f32() * xv);
                }
            }
        });
        Ok(())
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
            payload_bytes: self.wt.len() * 2,
            metadata_bytes: 0,
        }
    }
    fn decode(&self) -> DenseMatrix {
        let (m, k) = (self.rows, self.cols);
        let mut data = vec![f16::ZERO; m * k];
        for c in 0..k {
            for r in 0..m {
                data[r * k + c] = self.wt[c * m + r];
            }
        }
        DenseMatrix::new(m, k, data).expect("built from a valid DenseMatrix")
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
        gemm::gemm(
            n,
            m,
            k,
            gemm::View::row_major(x, k),
            gemm::View::row_major(&self.wt, m),
            y,
            m,
            false,
            true,
        )
        .map_err(|e| FormatError::Option(e.to_string()))
    }
    fn write_payload(&self, w: &mut ByteWriter) {
        w.u64(self.rows as u64);
        w.u64(self.cols as u64);
        w.f16s(self.decode().data());
    }
}

/// The AVX2 rank table and f16 loader, shared with the row-major kernel of
/// [`super::rows`].
#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{load8_f16, RANKS};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::ColumnTiledCbc;
    use half::f16;
    use std::arch::x86_64::*;

    /// Active columns prefetched ahead: a skipped column breaks the prefetchers' stream.
    /// Active columns ahead whose bitmap and values are prefetched. A skipped column breaks
    /// the hardware prefetcher's stream, and restarting it costs a memory latency per break;
    /// 2 was the best of 0-8 (`sparse_bench`, sp 0.5 / dp 0.5: 31.6 -> 23-28 ms per token).
    const PREFETCH_COLUMNS: usize = 2;

    #[inline(always)]
    unsafe fn prefetch(p: *const u8, bytes: usize) {
        let mut off = 0;
        while off < bytes {
            _mm_prefetch::<_MM_HINT_T0>(p.add(off) as *const i8);
            off += 64;
        }
    }

    #[inline(always)]
    unsafe fn prefetch_sparse_column(w: &ColumnTiledCbc, c: usize) {
        let (s, e) = (
            *w.starts.get_unchecked(c) as usize,
            *w.starts.get_unchecked(c + 1) as usize,
        );
        prefetch(w.values.as_ptr().add(s) as *const u8, 2 * (e - s));
        prefetch(
            w.bitmaps.as_ptr().add(c * w.words) as *const u8,
            8 * w.words,
        );
    }

    /// Per active column and 32 rows: a masked load of the next `popcount` values, `vpexpandw`,
    /// two `vcvtph2ps` and two FMAs into `sums` (L1-resident).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,bmi2,popcnt")]
    pub unsafe fn columns_vbmi2(w: &ColumnTiledCbc, cols: &[u32], xs: &[f32], sums: &mut [f32]) {
        let s = sums.as_mut_ptr();
        for (i, (&c, &xv)) in cols.iter().zip(xs).enumerate() {
            if let Some(&ahead) = cols.get(i + PREFETCH_COLUMNS) {
                prefetch_sparse_column(w, ahead as usize);
            }
            let c = c as usize;
            let mut p = w.values.as_ptr().add(*w.starts.get_unchecked(c) as usize);
            let bm = w.bitmaps.as_ptr().add(c * w.words);
            let vx = _mm512_set1_ps(xv);
            for wi in 0..w.words {
                let word = *bm.add(wi);
                for h in 0..2 {
                    let m = (word >> (32 * h)) as u32;
                    let cnt = m.count_ones();
                    let raw = _mm512_maskz_loadu_epi16(_bzhi_u32(u32::MAX, cnt), p as *const i16);
                    let v = _mm512_maskz_expand_epi16(m, raw);
                    let o = s.add(wi * 64 + 32 * h);
                    let lo = _mm512_cvtph_ps(_mm512_castsi512_si256(v));
                    let hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(v));
                    _mm512_storeu_ps(o, _mm512_fmadd_ps(lo, vx, _mm512_loadu_ps(o)));
                    _mm512_storeu_ps(
                        o.add(16),
                        _mm512_fmadd_ps(hi, vx, _mm512_loadu_ps(o.add(16))),
                    );
                    p = p.add(cnt as usize);
                }
            }
        }
    }

    /// [`columns_vbmi2`] without VBMI2: per 16 rows a masked load, `vcvtph2ps`, `vexpandps`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,bmi2,popcnt")]
    pub unsafe fn columns_avx512(w: &ColumnTiledCbc, cols: &[u32], xs: &[f32], sums: &mut [f32]) {
        let s = sums.as_mut_ptr();
        for (i, (&c, &xv)) in cols.iter().zip(xs).enumerate() {
            if let Some(&ahead) = cols.get(i + PREFETCH_COLUMNS) {
                prefetch_sparse_column(w, ahead as usize);
            }
            let c = c as usize;
            let mut p = w.values.as_ptr().add(*w.starts.get_unchecked(c) as usize);
            let bm = w.bitmaps.as_ptr().add(c * w.words);
            let vx = _mm512_set1_ps(xv);
            for wi in 0..w.words {
                let word = *bm.add(wi);
                for q in 0..4 {
                    let m = (word >> (16 * q)) as u32 & 0xffff;
                    let cnt = m.count_ones();
                    let raw = _mm256_maskz_loadu_epi16(
                        _bzhi_u32(0xffff, cnt) as __mmask16,
                        p as *const i16,
                    );
                    let v = _mm512_maskz_expand_ps(m as __mmask16, _mm512_cvtph_ps(raw));
                    let o = s.add(wi * 64 + 16 * q);
                    _mm512_storeu_ps(o, _mm512_fmadd_ps(v, vx, _mm512_loadu_ps(o)));
                    p = p.add(cnt as usize);
                }
            }
        }
    }

    /// For each byte value `m`, lane `j` holds the rank of bit `j` among the set bits of `m`
    /// (0 for clear bits, which are masked afterwards): `vpermps` by it places the packed values.
    pub(crate) static RANKS: [[u32; 8]; 256] = {
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

    /// Loads 8 f16 at `p` as f32; reads at or past `end` (the end of the values) give 0.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(crate) unsafe fn load8_f16(p: *const u16, end: *const u16) -> __m256 {
        if p.add(8) <= end {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        } else {
            let mut tmp = [0u16; 8];
            let n = (end.offset_from(p).max(0) as usize).min(8);
            std::ptr::copy_nonoverlapping(p, tmp.as_mut_ptr(), n);
            _mm256_cvtph_ps(_mm_loadu_si128(tmp.as_ptr() as *const __m128i))
        }
    }

    /// The AVX2 column kernel: per byte of bitmap, 8 values loaded, converted, placed by
    /// `vpermps` and masked, then one FMA into `sums`.
    #[target_feature(enable = "avx2,fma,f16c,bmi2,popcnt")]
    pub unsafe fn columns_avx2(w: &ColumnTiledCbc, cols: &[u32], xs: &[f32], sums: &mut [f32]) {
        let s = sums.as_mut_ptr();
        let end = w.values.as_ptr().add(w.values.len());
        let lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        for (i, (&c, &xv)) in cols.iter().zip(xs).enumerate() {
            if let Some(&ahead) = cols.get(i + PREFETCH_COLUMNS) {
                prefetch_sparse_column(w, ahead as usize);
            }
            let c = c as usize;
            let mut p = w.values.as_ptr().add(*w.starts.get_unchecked(c) as usize);
            let bm = w.bitmaps.as_ptr().add(c * w.words);
            let vx = _mm256_set1_ps(xv);
            for wi in 0..w.words {
                let word = *bm.add(wi);
                for b in 0..8 {
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
                    let o = s.add(wi * 64 + 8 * b);
                    _mm256_storeu_ps(o, _mm256_fmadd_ps(placed, vx, _mm256_loadu_ps(o)));
                    p = p.add(m.count_ones() as usize);
                }
            }
        }
    }

    /// `sums[r] += Σ_j xs[j] · wt[cols[j] · m + r]`, one column at a time: one sequential
    /// stream per task (four columns per pass over `sums` were 1.5x slower from DRAM).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
    pub unsafe fn dense_columns_avx512(
        wt: &[f16],
        m: usize,
        cols: &[u32],
        xs: &[f32],
        sums: &mut [f32],
    ) {
        let base = wt.as_ptr() as *const u16;
        let o = sums.as_mut_ptr();
        let full = m / 16 * 16;
        let tail: __mmask16 = ((1u32 << (m - full)) - 1) as __mmask16;
        for (i, (&c, &xv)) in cols.iter().zip(xs).enumerate() {
            if let Some(&ahead) = cols.get(i + PREFETCH_COLUMNS) {
                prefetch(base.add(ahead as usize * m) as *const u8, 2 * m);
            }
            let p = base.add(c as usize * m);
            let vx = _mm512_set1_ps(xv);
            let mut r = 0;
            while r < full {
                let wv = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(r) as *const __m256i));
                _mm512_storeu_ps(o.add(r), _mm512_fmadd_ps(wv, vx, _mm512_loadu_ps(o.add(r))));
                r += 16;
            }
            if full < m {
                let wv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail, p.add(full) as *const i16));
                let a = _mm512_fmadd_ps(wv, vx, _mm512_maskz_loadu_ps(tail, o.add(full)));
                _mm512_mask_storeu_ps(o.add(full), tail, a);
            }
        }
    }

    /// [`dense_columns_avx512`] with 8-row `ymm` steps and a scalar tail.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dense_columns_avx2(
        wt: &[f16],
        m: usize,
        cols: &[u32],
        xs: &[f32],
        sums: &mut [f32],
    ) {
        let base = wt.as_ptr() as *const u16;
        let o = sums.as_mut_ptr();
        let full = m / 8 * 8;
        for (i, (&c, &xv)) in cols.iter().zip(xs).enumerate() {
            if let Some(&ahead) = cols.get(i + PREFETCH_COLUMNS) {
                prefetch(base.add(ahead as usize * m) as *const u8, 2 * m);
            }
            let p = base.add(c as usize * m);
            let vx = _mm256_set1_ps(xv);
            let mut r = 0;
            while r < full {
                let wv = _mm256_cvtph_ps(_mm_loadu_si128(p.add(r) as *const __m128i));
                _mm256_storeu_ps(o.add(r), _mm256_fmadd_ps(wv, vx, _mm256_loadu_ps(o.add(r))));
                r += 8;
            }
            for r in full..m {
                *o.add(r) += f16::from_bits(*p.add(r)).to_f32() * xv;
            }
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
        let tc = ColumnTiledCbc::new(TiledCbc::encode(&w).unwrap());
        let dc = DenseColumns::new(&w);
        for level in SimdLevel::available() {
            let mut y = vec![f32::NAN; rows];
            tc.matvec_with(level, &x[..cols], t, &mut y).unwrap();
            let e = max_rel_error(&y, &want_v);
            assert!(
                e <= TOL,
                "tiled-cbc {level:?} {rows}x{cols} sp {sp} dp {dp}: matvec error {e}"
            );
            let mut y = vec![f32::NAN; rows];
            dc.matvec_with(level, &x[..cols], t, &mut y).unwrap();
            let e = max_rel_error(&y, &want_v);
            assert!(
                e <= TOL,
                "dense-columns {level:?} {rows}x{cols}: matvec error {e}"
            );
            let mut ym = vec![f32::NAN; rows * tokens];
            tc.matmul_with(level, &x, tokens, t, &mut ym).unwrap();
            let e = max_rel_error(&ym, &want_m);
            assert!(
                e <= TOL,
                "tiled-cbc {level:?} {rows}x{cols} x{tokens}: matmul error {e}"
            );
        }
        let mut ym = vec![f32::NAN; rows * tokens];
        dc.matmul(&x, tokens, t, &mut ym).unwrap();
        assert!(max_rel_error(&ym, &want_m) <= TOL);
    }

    #[test]
    fn fast_products_match_the_f64_reference() {
        // Partial row tiles (M % 256, M < 64), partial column groups (K % 16), one column,
        // empty and full matrices, every threshold regime, batches below and above the GEMM cut.
        for &(m, k) in &[
            (1, 1),
            (7, 13),
            (192, 576),
            (300, 40),
            (513, 17),
            (64, 129),
            (257, 16),
        ] {
            for (i, &sp) in [0.0, 0.5, 0.7, 0.97].iter().enumerate() {
                for (j, &dp) in [0.0, 0.5, 0.9].iter().enumerate() {
                    let tokens = [1, 3, 6][(i + j) % 3];
                    check_all_levels(
                        m,
                        k,
                        sp,
                        dp,
                        tokens,
                        (m * 1000 + k) as u64 + i as u64 * 7 + j as u64,
                    );
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
        let fast = ColumnTiledCbc::new(reference.clone());
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
    fn ie_bme_through_the_column_kernel_matches_its_reference() {
        use sieve_formats::ie_bme::{IeBme, IeBmeOptions, Reorder};
        let w = sparse_matrix(100, 192, 0.5, Pattern::Unstructured, 9).unwrap();
        let opts = IeBmeOptions {
            reorder: Reorder::Greedy,
            ..IeBmeOptions::default()
        };
        let reference = IeBme::encode(&w, &opts).unwrap();
        let fast = F16IeBme::new(reference.clone()).unwrap();
        assert_eq!(fast.decode(), reference.decode());
        assert_eq!(fast.to_bytes(), reference.to_bytes());
        let x = activations(192 * 5, 10);
        let t = threshold_for_sparsity(&x, 0.5).unwrap();
        let q = reference.decode();
        let (mut a, mut b) = (vec![0f32; 100], vec![0f32; 500]);
        fast.matvec(&x[..192], t, &mut a).unwrap();
        assert!(max_rel_error(&a, &matvec_f64(&q, &x[..192], t)) <= TOL);
        fast.matmul(&x, 5, t, &mut b).unwrap();
        assert!(max_rel_error(&b, &matmul_f64(&q, &x, 5, t)) <= TOL);
        reference.matvec(&x[..192], t, &mut b[..100]).unwrap();
        let want: Vec<f64> = b[..100].iter().map(|v| *v as f64).collect();
        assert!(
            max_rel_error(&a, &want) <= 1e-3,
            "against the reference kernel"
        );
    }

    #[test]
    fn bad_shapes_are_errors() {
        let w = sparse_matrix(40, 20, 0.5, Pattern::Unstructured, 1).unwrap();
        let fast = ColumnTiledCbc::new(TiledCbc::encode(&w).unwrap());
        let dc = DenseColumns::new(&w);
        let mut y = vec![0f32; 40];
        assert!(fast.matvec(&[0.0; 19], None, &mut y).is_err());
        assert!(dc.matvec(&[0.0; 21], None, &mut y).is_err());
        assert!(fast.matvec(&[0.0; 20], Some(f32::NAN), &mut y).is_err());
        assert!(fast.matmul(&[0.0; 40], 2, None, &mut y).is_err());
    }
}
