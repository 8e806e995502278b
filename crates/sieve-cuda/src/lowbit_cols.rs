//! Column-major 4-bit weights whose inactive input columns are never read: the decode layout of
//! a symmetric 4-bit matrix (sieve's W4A16 g128, GGUF Q4_0) when its input has a TEAL threshold.
//! The tensor-core layout of [`crate::lowbit`] reads every weight whatever the input; this one
//! reads `1 - dp` of them. Kernels: `kernels/lowbit_colmajor.cu` (read its header for the layout,
//! the compaction in registers with per-slot power-of-two input scaling, and the thread
//! mapping): one launch per product.
//!
//! CPU side: [`ColumnLayout`] (the device arrays, read back by [`ColumnLayout::q_at`] /
//! [`ColumnLayout::scale_at`] in tests) and [`emulate`], the kernel's arithmetic for each
//! [`ColsVariant`] (f16 inputs, f16 partial sums of a round's products, f32 beyond) on the CPU, so that its error against the f64
//! [`LowBitMatrix::reference`] is tested without a GPU, huge inputs included.

use crate::dense::check_len;
use crate::error::{CudaError, DriverContext, Result};
use crate::gpu::{Gpu, KernelFamily};
use crate::lowbit::{LowBitKind, LowBitMatrix};
use crate::product::{check_io, threshold_arg, DevPtr, GpuAccumulate, GpuMatVec};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use half::f16;
use rayon::prelude::*;
use sieve_formats::format::is_active;
use sieve_formats::Threshold;

pub const FAMILY: KernelFamily = KernelFamily {
    name: "lowbit_colmajor",
    source: include_str!("../kernels/lowbit_colmajor.cu"),
};

/// Rows per row tile (one block, 8 per lane).
pub const ROW_TILE: usize = 256;
/// Columns per slot (one warp's share of K, one compaction warp).
pub const SLOT: usize = 32;
/// Slots per block (`LBC_WARPS`).
const SLOTS_PER_BLOCK: usize = 8;
/// Threads per block.
const BLOCK_THREADS: u32 = 256;
/// Rows from which two row tiles per warp pay ([`ColsVariant::for_rows`]).
const TWO_TILE_MIN_ROWS: usize = 8192;

/// The kernel's variants (`LBC_W4_KERNEL` in the kernel file): row tiles per warp and active
/// columns per round (loads in flight per row tile; also the products per f16 partial sum).
/// Three more were measured and removed: two row tiles with rounds of 16 (2026-12-05: lost to
/// both), two slots per warp and f32 sums (2026-12-06, docs/BENCHMARKS.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ColsVariant {
    /// One row tile per warp, rounds of 16 columns.
    T1R16,
    /// Two row tiles per warp, rounds of 8: the per-column and per-slot work serve twice the
    /// weights, 16 loads in flight per warp.
    T2R8,
}

impl ColsVariant {
    pub const ALL: [ColsVariant; 2] = [ColsVariant::T1R16, ColsVariant::T2R8];
    pub fn name(self) -> &'static str {
        match self {
            ColsVariant::T1R16 => "t1r16",
            ColsVariant::T2R8 => "t2r8",
        }
    }
    /// Row tiles per warp.
    pub fn tiles(self) -> usize {
        match self {
            ColsVariant::T1R16 => 1,
            ColsVariant::T2R8 => 2,
        }
    }
    /// Active columns per round: the products in one f16 partial sum.
    pub fn round(self) -> usize {
        match self {
            ColsVariant::T1R16 => 16,
            ColsVariant::T2R8 => 8,
        }
    }
    fn suffix(self) -> &'static str {
        match self {
            ColsVariant::T1R16 => "",
            ColsVariant::T2R8 => "_t2r8",
        }
    }
    /// The variant for a matrix of `padded_rows` rows: `SIEVE_LOWBIT_COLS_VARIANT=t1r16|t2r8`
    /// in the environment (read once; a switch for measuring the variants against each other),
    /// else by the rows. Measured on an H100 (2026-12-05, `bench gemm`, graph replays, sp 0.5):
    /// at 11008 x 4096 t2r8 took 8.43 / 6.99 µs at dp 0.5 / 0.7 against t1r16's 10.39 / 7.49;
    /// at 4096 x 4096 t1r16 won (5.55 / 4.45 against 5.79 / 4.74: two row tiles per warp halve
    /// a grid that is then under one wave). Re-measured 2026-12-06 (H100, t1r16 / t2r8): 10.42 /
    /// 8.31 µs at 11008 x 4096 dp 0.5, 5.57 / 5.79 µs at 4096 x 4096.
    pub fn for_rows(padded_rows: usize) -> ColsVariant {
        static V: std::sync::OnceLock<Option<ColsVariant>> = std::sync::OnceLock::new();
        let forced = *V.get_or_init(|| {
            let want = std::env::var("SIEVE_LOWBIT_COLS_VARIANT").unwrap_or_default();
            ColsVariant::ALL.into_iter().find(|v| v.name() == want)
        });
        forced.unwrap_or(if padded_rows >= TWO_TILE_MIN_ROWS {
            ColsVariant::T2R8
        } else {
            ColsVariant::T1R16
        })
    }
}

/// Whether [`ColumnLayout`] takes matrices of `kind`: the symmetric 4-bit kinds with f16 group
/// scales whose groups are whole slots.
pub fn supports(kind: LowBitKind) -> bool {
    matches!(kind, LowBitKind::W4G128 | LowBitKind::W4G32)
}

/// The device arrays of a column-major 4-bit matrix (kernel header).
#[derive(Clone, Debug, PartialEq)]
pub struct ColumnLayout {
    pub kind: LowBitKind,
    pub rows: usize,
    pub cols: usize,
    /// Rows padded to [`ROW_TILE`].
    pub padded_rows: usize,
    /// Columns padded to [`SLOT`].
    pub padded_cols: usize,
    /// `padded_cols · padded_rows / 8` words, column-major.
    pub words: Vec<u32>,
    /// `groups · padded_rows` f16 scales, group-major.
    pub scales: Vec<f16>,
}

impl ColumnLayout {
    pub fn new(m: &LowBitMatrix) -> Result<Self> {
        let kind = m.kind();
        if !supports(kind) {
            return Err(CudaError::Option(format!(
                "the column-major 4-bit layout takes w4a16-g128 and q4_0 matrices, not {}",
                kind.name()
            )));
        }
        let (rows, cols) = (m.rows(), m.cols());
        if rows == 0 || cols == 0 {
            return Err(CudaError::Option(format!(
                "a column-major 4-bit matrix needs rows and columns, got {rows} x {cols}"
            )));
        }
        let group = kind.group();
        let padded_rows = rows.div_ceil(ROW_TILE) * ROW_TILE;
        let padded_cols = cols.div_ceil(SLOT) * SLOT;
        let groups = padded_cols.div_ceil(group);
        let per_col = padded_rows / 8;
        // Padding: u = 8 (value 0) in every nibble.
        let mut words = vec![0x8888_8888u32; padded_cols * per_col];
        let q = m.q();
        // A 7B model has 6.5e9 weights to transpose at upload: blocks of SLOT columns in
        // parallel, each reading its rows' SLOT contiguous values and writing SLOT columns.
        words
            .par_chunks_mut(SLOT * per_col)
            .enumerate()
            .for_each(|(b, block)| {
                let k0 = b * SLOT;
                let width = SLOT.min(cols.saturating_sub(k0));
                for r in 0..rows {
                    let (word_row, slot) = (r / 8, r % 8);
                    // Row 2i of a word is the low half's nibble i, row 2i + 1 the high half's.
                    let shift = 4 * (slot / 2) + 16 * (slot % 2);
                    let row = &q[r * cols + k0..r * cols + k0 + width];
                    for (kk, &v) in row.iter().enumerate() {
                        let u = (v as i32 + 8) as u32;
                        let w = &mut block[kk * per_col + word_row];
                        *w = (*w & !(0xf << shift)) | (u << shift);
                    }
                }
            });
        let mut scales = vec![f16::ZERO; groups * padded_rows];
        scales
            .par_chunks_mut(padded_rows)
            .enumerate()
            .for_each(|(g, out)| {
                let k = g * group;
                if k < cols {
                    for (r, s) in out.iter_mut().enumerate().take(rows) {
                        *s = f16::from_f32(m.scale(r, k));
                    }
                }
            });
        Ok(Self {
            kind,
            rows,
            cols,
            padded_rows,
            padded_cols,
            words,
            scales,
        })
    }

    /// Slots of [`SLOT`] columns.
    pub fn slots(&self) -> usize {
        self.padded_cols / SLOT
    }

    /// Bytes on the device: words and scales.
    pub fn bytes(&self) -> usize {
        self.words.len() * 4 + self.scales.len() * 2
    }

    /// The integer `u - 8` stored for weight (r, k), read the way the kernel reads it.
    pub fn q_at(&self, r: usize, k: usize) -> i32 {
        let w = self.words[k * (self.padded_rows / 8) + r / 8];
        let slot = r % 8;
        let shift = 4 * (slot / 2) + 16 * (slot % 2);
        ((w >> shift) & 0xf) as i32 - 8
    }

    /// The scale the kernel applies to weight (r, k).
    pub fn scale_at(&self, r: usize, k: usize) -> f32 {
        self.scales[(k / self.kind.group()) * self.padded_rows + r].to_f32()
    }
}

/// The power-of-two exponent `s` the kernel scales a slot's inputs by (`x · 2^s`), from the
/// slot's largest active `|x|`: every scaled input is below 256 (kernel header).
pub fn slot_exponent(max_abs: f32) -> i32 {
    let e = ((max_abs.to_bits() >> 23) & 0xff) as i32 - 126;
    (8 - e).clamp(-100, 100)
}

/// The kernel's arithmetic on the CPU for `variant`: `W · mask_t(x)` with each warp's slot of
/// inputs scaled and rounded to f16, f16 partial sums of [`ColsVariant::round`] products (one
/// rounding per fused multiply-add), f32 sums beyond, scaled by the row's scale and the
/// warp's `2^-s`, warps added in order. The GPU differs only in the order of its f32 additions.
pub fn emulate(
    l: &ColumnLayout,
    x: &[f32],
    t: Threshold,
    variant: ColsVariant,
) -> Result<Vec<f32>> {
    let (round, width) = (variant.round(), SLOT);
    check_len("activation length (K)", l.cols, x.len())?;
    let mut y = vec![0f32; l.rows];
    for slot in 0..l.padded_cols.div_ceil(width) {
        let cols: Vec<usize> = (slot * width..((slot + 1) * width).min(l.cols))
            .filter(|&k| is_active(x[k], t))
            .collect();
        if cols.is_empty() {
            continue;
        }
        let max_abs = cols.iter().map(|&k| x[k].abs()).fold(0f32, f32::max);
        let s = slot_exponent(max_abs);
        let (up, down) = (2f32.powi(s), 2f32.powi(-s));
        let scaled: Vec<f16> = cols.iter().map(|&k| f16::from_f32(x[k] * up)).collect();
        for (r, out) in y.iter_mut().enumerate() {
            let acc = cols.chunks(round).zip(scaled.chunks(round)).fold(
                0f32,
                |acc, (chunk_cols, chunk_x)| {
                    let mut h = f16::ZERO;
                    for (&k, &xv) in chunk_cols.iter().zip(chunk_x) {
                        // One rounding: the product of two f16 values and the sum are exact in
                        // f64.
                        h = f16::from_f64(l.q_at(r, k) as f64 * xv.to_f64() + h.to_f64());
                    }
                    acc + h.to_f32()
                },
            );
            *out += acc * (l.scale_at(r, slot * width) * down);
        }
    }
    Ok(y)
}

/// What the kernel computes, exactly: the f64 [`LowBitMatrix::reference`] of `x` masked by `t`
/// (on the f32 inputs, as the kernel does) and then rounded to f16.
pub fn reference(m: &LowBitMatrix, x: &[f32], t: Threshold) -> Vec<f64> {
    let xm: Vec<f16> = x
        .iter()
        .map(|&v| {
            if is_active(v, t) {
                f16::from_f32(v)
            } else {
                f16::ZERO
            }
        })
        .collect();
    m.reference(&xm, 1)
}

/// A column-major 4-bit matrix on the device.
pub struct GpuLowBitCols {
    kind: LowBitKind,
    rows: usize,
    cols: usize,
    padded_rows: usize,
    padded_cols: usize,
    words: CudaSlice<u32>,
    scales: CudaSlice<f16>,
    bytes: usize,
    variant: ColsVariant,
}

impl GpuLowBitCols {
    /// The array the decode step asks L2 for ahead of this product (its largest: the
    /// weights), see [`crate::product::L2Span`].
    pub fn weight_span(&self, gpu: &Gpu) -> crate::product::L2Span {
        crate::product::L2Span::of(gpu, &self.words)
    }

    pub fn upload(gpu: &Gpu, m: &LowBitMatrix) -> Result<Self> {
        let l = ColumnLayout::new(m)?;
        Self::upload_layout(gpu, &l)
    }

    pub fn upload_layout(gpu: &Gpu, l: &ColumnLayout) -> Result<Self> {
        // Look the kernels up now: never first inside a graph capture.
        let variant = ColsVariant::for_rows(l.padded_rows);
        gpu.function(&FAMILY, &Self::kernel_name(l.kind, variant))?;
        gpu.function(&FAMILY, "lbc_w4_to_f16_t")?;
        Ok(Self {
            kind: l.kind,
            rows: l.rows,
            cols: l.cols,
            padded_rows: l.padded_rows,
            padded_cols: l.padded_cols,
            words: gpu.upload(&l.words)?,
            scales: gpu.upload(&l.scales)?,
            bytes: l.bytes(),
            variant,
        })
    }

    fn kernel_name(kind: LowBitKind, v: ColsVariant) -> String {
        let g = if kind.group() == 128 { 128 } else { 32 };
        format!("lbc_w4_g{g}{}", v.suffix())
    }

    pub fn kind(&self) -> LowBitKind {
        self.kind
    }
    /// The kernel variant this matrix launches.
    pub fn variant(&self) -> ColsVariant {
        self.variant
    }
    /// Rows padded to [`ROW_TILE`]: the leading dimension of [`Self::decode_transposed`]'s output.
    pub fn padded_rows(&self) -> usize {
        self.padded_rows
    }
    /// Columns padded to [`SLOT`]: [`Self::decode_transposed`] writes this many columns.
    pub fn padded_cols(&self) -> usize {
        self.padded_cols
    }
    /// Words and scales on the device.
    pub fn device_bytes(&self) -> usize {
        self.bytes
    }

    /// Writes the matrix as f16 at `out`: column k's `padded_rows` values at `out + k ·
    /// padded_rows` (W transposed, row-major, for a GEMM), `padded_cols` columns.
    pub fn decode_transposed(&self, gpu: &Gpu, out: DevPtr) -> Result<()> {
        let f = gpu.function(&FAMILY, "lbc_w4_to_f16_t")?;
        let words = self.padded_cols * self.padded_rows / 8;
        let cfg = LaunchConfig {
            grid_dim: ((words as u32).div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (mp, kp, g) = (
            self.padded_rows as i32,
            self.padded_cols as i32,
            self.kind.group() as i32,
        );
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.words)
            .arg(&self.scales)
            .arg(&mp)
            .arg(&kp)
            .arg(&g)
            .arg(&out);
        unsafe { b.launch(cfg) }.during("launching lbc_w4_to_f16_t")?;
        Ok(())
    }
}

impl GpuAccumulate for GpuLowBitCols {
    /// `y += W · mask_t(x)`: one launch, the compaction done by each warp for its slot.
    fn launch_add(&self, gpu: &Gpu, x: DevPtr, threshold: Threshold, y: DevPtr) -> Result<()> {
        let v = self.variant;
        let slots = self.padded_cols / SLOT;
        let f = gpu.function(&FAMILY, &Self::kernel_name(self.kind, v))?;
        let cfg = LaunchConfig {
            grid_dim: (
                (self.padded_rows / ROW_TILE).div_ceil(v.tiles()) as u32,
                slots.div_ceil(SLOTS_PER_BLOCK) as u32,
                1,
            ),
            block_dim: (BLOCK_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (t, m, k) = (threshold_arg(threshold), self.rows as i32, self.cols as i32);
        let (mp, ns) = (self.padded_rows as i32, slots as i32);
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.words)
            .arg(&self.scales)
            .arg(&x)
            .arg(&t)
            .arg(&y)
            .arg(&m)
            .arg(&k)
            .arg(&mp)
            .arg(&ns);
        unsafe { b.launch(cfg) }.during("launching the column-major 4-bit product")?;
        Ok(())
    }
}

impl GpuMatVec for GpuLowBitCols {
    fn label(&self) -> String {
        format!("lowbit-cols/{}/{}", self.kind.name(), self.variant.name())
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    /// The words of the active columns, the scales of every group with an active column (once
    /// per row tile and group: the warps of a group share them through L2), the input, the
    /// output read and written.
    fn bytes_for(&self, active: &[bool]) -> usize {
        let on = active.iter().filter(|a| **a).count();
        let group = self.kind.group();
        let groups_on = active
            .chunks(group)
            .filter(|c| c.iter().any(|a| *a))
            .count();
        on * self.padded_rows / 2 + groups_on * self.padded_rows * 2 + self.cols * 4 + self.rows * 8
    }
    fn launch(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        threshold: Threshold,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        check_io(self, x, y)?;
        let (xp, yp) = (crate::dev_ptr(gpu, x), crate::dev_ptr(gpu, y));
        // SAFETY: y holds `rows` f32 (checked above).
        unsafe { gpu.zero_bytes(yp, self.rows * 4) }?;
        self.launch_add(gpu, xp, threshold, yp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use sieve_formats::random::{activations, sparse_matrix, threshold_for_sparsity, Pattern};

    fn matrix(kind: LowBitKind, rows: usize, cols: usize, seed: u64) -> LowBitMatrix {
        let w = sparse_matrix(rows, cols, 0.3, Pattern::Unstructured, seed).unwrap();
        LowBitMatrix::quantize(&w, kind)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// The layout read back the way the kernel reads it is the matrix's integers and
        /// scales, for any shape (partial row tiles and slots) and both kinds.
        #[test]
        fn layout_reads_back_the_matrix(rows in 1usize..300, cols in 1usize..200, g128 in any::<bool>(), seed in 0u64..1000) {
            let kind = if g128 { LowBitKind::W4G128 } else { LowBitKind::W4G32 };
            let m = matrix(kind, rows, cols, seed);
            let l = ColumnLayout::new(&m).unwrap();
            prop_assert_eq!(l.padded_rows % ROW_TILE, 0);
            prop_assert_eq!(l.padded_cols % SLOT, 0);
            for r in 0..rows {
                for k in 0..cols {
                    prop_assert_eq!(l.q_at(r, k), m.q()[r * cols + k] as i32, "q at ({}, {})", r, k);
                    prop_assert_eq!(l.scale_at(r, k), m.scale(r, k), "scale at ({}, {})", r, k);
                }
            }
            // Padding rows and columns are value 0.
            for k in 0..l.padded_cols {
                for r in rows..l.padded_rows {
                    prop_assert_eq!(l.q_at(r, k), 0);
                }
            }
            for k in cols..l.padded_cols {
                for r in 0..rows {
                    prop_assert_eq!(l.q_at(r, k), 0);
                }
            }
        }
    }

    #[test]
    fn variants_follow_the_measured_rule_and_name_their_kernels() {
        // The environment switch is unset in tests: the rule of `for_rows` applies.
        if std::env::var("SIEVE_LOWBIT_COLS_VARIANT").is_err() {
            assert_eq!(ColsVariant::for_rows(4096), ColsVariant::T1R16);
            assert_eq!(ColsVariant::for_rows(8192), ColsVariant::T2R8);
            assert_eq!(ColsVariant::for_rows(22016), ColsVariant::T2R8);
        }
        let src = FAMILY.source;
        for v in ColsVariant::ALL {
            for kind in [LowBitKind::W4G128, LowBitKind::W4G32] {
                // The kernel instance has the variant's tiles and round (the emulation's).
                let name = GpuLowBitCols::kernel_name(kind, v);
                let line = format!(
                    "LBC_W4_KERNEL({name}, {}, {}, {},",
                    kind.group(),
                    v.tiles(),
                    v.round(),
                );
                assert!(src.contains(&line), "{line}");
            }
        }
    }

    #[test]
    fn other_kinds_are_refused_by_name() {
        let w = sparse_matrix(16, 64, 0.0, Pattern::Unstructured, 1).unwrap();
        for kind in [LowBitKind::W8Row, LowBitKind::W4G32Affine, LowBitKind::W4K] {
            let e = ColumnLayout::new(&LowBitMatrix::quantize(&w, kind)).unwrap_err();
            assert!(e.to_string().contains(kind.name()), "{e}");
        }
    }

    #[test]
    fn slot_exponent_keeps_scaled_inputs_below_256() {
        for v in [
            1e-20f32, 1e-3, 0.4, 0.5, 1.0, 255.0, 256.0, 3000.0, 65504.0, 1e9,
        ] {
            let s = slot_exponent(v);
            let scaled = v * 2f32.powi(s);
            assert!((128.0..256.0).contains(&scaled), "{v}: 2^{s} -> {scaled}");
        }
        // Below 2^-92 the exponent is clamped: still below 256, just not normalized.
        assert!(1e-30f32 * 2f32.powi(slot_exponent(1e-30)) < 256.0);
        // Zero (no active input) and subnormal maxima stay finite.
        assert_eq!(slot_exponent(0.0), 100);
        assert!(2f32.powi(-slot_exponent(0.0)) > 0.0);
    }

    /// Max |got - want| over max |want|.
    fn rel_error(got: &[f32], want: &[f64]) -> f64 {
        let scale = want.iter().fold(0f64, |a, v| a.max(v.abs())).max(1e-30);
        got.iter()
            .zip(want)
            .map(|(g, w)| (*g as f64 - w).abs())
            .fold(0f64, f64::max)
            / scale
    }

    #[test]
    fn emulated_kernel_is_within_f16_partial_sum_error_of_the_reference() {
        for kind in [LowBitKind::W4G128, LowBitKind::W4G32] {
            for (rows, cols) in [(1, 1), (37, 33), (300, 4096), (40, 100)] {
                let m = matrix(kind, rows, cols, 7);
                let l = ColumnLayout::new(&m).unwrap();
                let x = activations(cols, 11);
                for dp in [0.0, 0.5, 0.9] {
                    let t = threshold_for_sparsity(&x, dp).unwrap();
                    for v in ColsVariant::ALL {
                        let e = rel_error(&emulate(&l, &x, t, v).unwrap(), &reference(&m, &x, t));
                        assert!(e < 2e-3, "{kind:?} {rows}x{cols} dp {dp} {v:?}: {e}");
                    }
                }
            }
        }
    }

    #[test]
    fn huge_inputs_do_not_overflow_the_f16_partial_sums() {
        // Inputs of 30,000 and -20,000 beside inputs of 1e-3 in the same slots: unscaled f16
        // partial sums of 16 products of up to 8 · 30,000 would overflow to infinity; the
        // per-slot power-of-two scale keeps them finite and the result within the same bound
        // (relative to the largest output).
        let (rows, cols) = (16, 64);
        let data: Vec<f32> = (0..rows * cols)
            .map(|i| 0.01 * ((i % 7) as f32) - 0.03)
            .collect();
        let w = sieve_formats::DenseMatrix::from_f32(rows, cols, &data).unwrap();
        let m = LowBitMatrix::quantize(&w, LowBitKind::W4G32);
        let l = ColumnLayout::new(&m).unwrap();
        let mut x = vec![1e-3f32; cols];
        x[5] = 30_000.0;
        x[40] = -20_000.0;
        let got = emulate(&l, &x, None, ColsVariant::T1R16).unwrap();
        assert!(got.iter().all(|v| v.is_finite()), "{got:?}");
        let e = rel_error(&got, &reference(&m, &x, None));
        assert!(e < 2e-3, "rel error {e}");
    }
}
