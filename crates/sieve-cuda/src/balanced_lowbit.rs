//! Balanced-CBC with 8-bit or 4-bit values on the GPU: the packs `sieve pack --values
//! int8|int4[:G]` make (every stored value `q · s` exactly, [`sieve_formats::value_grid`]) are
//! detected at upload, as the CPU's records detect them, and multiplied from their integers by
//! `kernels/balanced_cbc_lowbit.cu` (read its header for the block layout and thread mapping).
//!
//! [`BalancedLowBit`] is the CPU side: detection (or snapping, for benchmarks), the integers
//! and scales, and the device blocks. The reference a kernel must match is the f64 product of
//! the (snapped) f16 matrix: its values are the integers times the scales exactly.

use crate::error::{CudaError, DriverContext, Result};
use crate::gpu::{Gpu, KernelFamily};
use crate::product::{check_io, threshold_arg, DevPtr, GpuAccumulate, GpuMatVec, LaunchEpoch};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use half::f16;
use rayon::prelude::*;
use sieve_formats::matrix::is_zero;
use sieve_formats::value_grid::{INT4, INT8};
use sieve_formats::{DenseMatrix, Threshold};

pub const FAMILY: KernelFamily = KernelFamily {
    name: "balanced_cbc_lowbit",
    source: include_str!("../kernels/balanced_cbc_lowbit.cu"),
};

const TILE: usize = 512;
const LANE_ROWS: usize = 16;
const WARPS: u32 = 8;
/// Column-group sizes tried for int4, widest first (as the CPU records do).
pub const INT4_GROUPS: [usize; 3] = [128, 64, 32];

/// What a stored value is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LowBitValues {
    /// `s[r] · q`, |q| <= 127, one f32 scale per row.
    Int8,
    /// `s[r][k / group] · q`, |q| <= 7, one f16 scale per row and `group` columns.
    Int4 { group: usize },
}

impl LowBitValues {
    fn bits(self) -> usize {
        match self {
            LowBitValues::Int8 => 8,
            LowBitValues::Int4 { .. } => 4,
        }
    }
    fn value_words(self, slots: usize) -> usize {
        match self {
            LowBitValues::Int8 => slots.div_ceil(4),
            LowBitValues::Int4 { .. } => slots.div_ceil(8),
        }
    }
    pub fn name(self) -> String {
        match self {
            LowBitValues::Int8 => "int8".into(),
            LowBitValues::Int4 { group } => format!("int4:{group}"),
        }
    }
}

/// A Balanced-CBC matrix with low-bit values, in the device layout.
#[derive(Clone, Debug, PartialEq)]
pub struct BalancedLowBit {
    values: LowBitValues,
    rows: usize,
    cols: usize,
    slots: usize,
    row_tiles: usize,
    last_lanes: usize,
    /// Bytes per column over all row tiles.
    column_bytes: usize,
    blocks: Vec<u8>,
    /// int8: `row_tiles · 512` f32; int4: `groups · row_tiles · 512`, `[group · mp + row]`.
    scales: Vec<f32>,
}

/// The integers of `w` on the grids of `values` (row-major, 0 where nothing is stored) and
/// the scales (int8: per row; int4: `[row · groups + group]`), or `None` when a row (group) is
/// on no such grid.
pub(crate) fn detect_grids(w: &DenseMatrix, values: LowBitValues) -> Option<(Vec<i8>, Vec<f32>)> {
    let (m, k) = (w.rows(), w.cols());
    let mut q = vec![0i8; m * k];
    let (grid, span) = match values {
        LowBitValues::Int8 => (INT8, k.max(1)),
        LowBitValues::Int4 { group } => (INT4, group),
    };
    let groups = k.div_ceil(span).max(1);
    let mut scales = vec![0f32; m * groups];
    // Rows are independent: one task each (a 7B model has 6.5 billion weights to check).
    let all_on_grids = q
        .par_chunks_mut(k.max(1))
        .zip(scales.par_chunks_mut(groups))
        .enumerate()
        .all(|(r, (q_row, scale_row))| {
            let row = w.row(r);
            let mut stored = Vec::with_capacity(span);
            let mut qs = Vec::with_capacity(span);
            (0..groups).all(|g| {
                let cols = g * span..((g + 1) * span).min(k);
                stored.clear();
                stored.extend(row[cols.clone()].iter().copied().filter(|v| !is_zero(*v)));
                qs.resize(stored.len(), 0);
                let Some(scale) = grid.detect(&stored, &mut qs) else {
                    return false;
                };
                scale_row[g] = scale;
                let mut it = qs.iter();
                cols.into_iter()
                    .filter(|&c| !is_zero(row[c]))
                    .all(|c| it.next().map(|&v| q_row[c] = v).is_some())
            })
        });
    all_on_grids.then_some((q, scales))
}

/// The blocks of row tile `rt` (`lanes` lanes of 16 rows, `bytes` per column), column after
/// column. The matrix is read row by row (each lane's 16 rows gathered per column first), not
/// column by column: a column walk of a row-major matrix misses the cache on every weight.
fn encode_row_tile(
    w: &DenseMatrix,
    q: &[i8],
    rt: usize,
    lanes: usize,
    bytes: usize,
    slots: usize,
    values: LowBitValues,
) -> Result<Vec<u8>> {
    let (m, k) = (w.rows(), w.cols());
    let vw = values.value_words(slots);
    let zero_code: u32 = if values.bits() == 8 { 128 } else { 8 };
    let mut out = vec![0u8; bytes * k];
    // Per column: how many rows of the lane hold a value, their local rows and codes.
    let mut count = vec![0usize; k];
    let mut local_rows = vec![0u32; k * LANE_ROWS];
    let mut codes = vec![0u32; k * LANE_ROWS];
    for j in 0..lanes {
        count.fill(0);
        let r0 = rt * TILE + j * LANE_ROWS;
        for s in 0..LANE_ROWS.min(m.saturating_sub(r0)) {
            let r = r0 + s;
            let row = w.row(r);
            for (c, v) in row.iter().enumerate() {
                if !is_zero(*v) {
                    let n = count[c];
                    local_rows[c * LANE_ROWS + n] = s as u32;
                    codes[c * LANE_ROWS + n] = (q[r * k + c] as i32 + zero_code as i32) as u32;
                    count[c] = n + 1;
                }
            }
        }
        for c in 0..k {
            let n = count[c];
            if n > slots {
                return Err(CudaError::Option(format!(
                    "column {c}, rows {r0}..{}: {n} nonzeros, more than {slots} slots",
                    r0 + 15
                )));
            }
            let b = &mut out[c * bytes..(c + 1) * bytes];
            let mut put = |word: usize, v: u32| {
                let o = 4 * (word * lanes + j);
                let cur = u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
                b[o..o + 4].copy_from_slice(&(cur | v).to_le_bytes());
            };
            // Padding slots: zero codes on rows of their own (distinct accumulators), the
            // unused rows in increasing order.
            let used = local_rows[c * LANE_ROWS..c * LANE_ROWS + n]
                .iter()
                .fold(0u32, |acc, &r| acc | 1 << r);
            let mut free = (0..LANE_ROWS as u32).filter(|s| used & (1 << s) == 0);
            for i in 0..slots {
                let (row, code) = if i < n {
                    (local_rows[c * LANE_ROWS + i], codes[c * LANE_ROWS + i])
                } else {
                    // 16 - n >= slots - n rows are free, so this never runs out.
                    (free.next().unwrap_or(0), zero_code)
                };
                if values.bits() == 8 {
                    put(i / 4, code << (8 * (i % 4)));
                } else {
                    put(i / 8, code << (4 * (i % 8)));
                }
                put(vw + i / 8, row << (4 * (i % 8)));
            }
        }
    }
    Ok(out)
}

impl BalancedLowBit {
    /// The device layout of `w` (at most `slots` nonzeros in every 16 rows of a column), whose
    /// stored values lie on the grids of `values` exactly; an error otherwise.
    pub fn from_matrix(w: &DenseMatrix, slots: usize, values: LowBitValues) -> Result<Self> {
        if slots == 0 || slots > LANE_ROWS {
            return Err(CudaError::Option(format!(
                "slots must be 1..=16, got {slots}"
            )));
        }
        if let LowBitValues::Int4 { group } = values {
            if !INT4_GROUPS.contains(&group) {
                return Err(CudaError::Option(format!(
                    "int4 groups are 32, 64 or 128 columns, got {group}"
                )));
            }
        }
        let (q, scales) = detect_grids(w, values).ok_or_else(|| {
            CudaError::Option(format!(
                "the matrix's values are not on {} grids",
                values.name()
            ))
        })?;
        Self::build(w, slots, values, &q, &scales)
    }

    /// Detects the grids of `w`, to be stored with `slots` slots (the Balanced-CBC encoding's),
    /// as the CPU records do: int4 with the widest group (128, 64, 32), then int8; `None` for
    /// f16 values. Takes the dense matrix the encoding was made from: decoding a 7B model's
    /// Balanced-CBC matrices again costs minutes.
    pub fn detect(w: &DenseMatrix, slots: usize) -> Option<Self> {
        for group in INT4_GROUPS {
            if let Ok(m) = Self::from_matrix(w, slots, LowBitValues::Int4 { group }) {
                return Some(m);
            }
        }
        Self::from_matrix(w, slots, LowBitValues::Int8).ok()
    }

    fn build(
        w: &DenseMatrix,
        slots: usize,
        values: LowBitValues,
        q: &[i8],
        scales: &[f32],
    ) -> Result<Self> {
        let (m, k) = (w.rows(), w.cols());
        if m > i32::MAX as usize || k > i32::MAX as usize {
            return Err(CudaError::Option(format!(
                "matrix {m} x {k} exceeds the kernels' 32-bit dimensions"
            )));
        }
        let row_tiles = m.div_ceil(TILE);
        let mp = row_tiles * TILE;
        let last_lanes = if m == 0 {
            32
        } else {
            (m - TILE * (row_tiles - 1)).div_ceil(LANE_ROWS)
        };
        let vw = values.value_words(slots);
        let iw = slots.div_ceil(8);
        let block = |lanes: usize| (4 * (vw + iw) * lanes).div_ceil(16) * 16;
        let column_bytes = if row_tiles == 0 {
            0
        } else {
            block(32) * (row_tiles - 1) + block(last_lanes)
        };
        // Row tiles are independent and each is a contiguous run of the blocks: one task each.
        let tiles = (0..row_tiles)
            .into_par_iter()
            .map(|rt| {
                let lanes = if rt + 1 == row_tiles { last_lanes } else { 32 };
                encode_row_tile(w, q, rt, lanes, block(lanes), slots, values)
            })
            .collect::<Result<Vec<Vec<u8>>>>()?;
        let blocks = tiles.concat();
        let dev_scales = match values {
            LowBitValues::Int8 => (0..mp)
                .map(|r| if r < m { scales[r] } else { 0.0 })
                .collect(),
            LowBitValues::Int4 { group } => {
                let groups = k.div_ceil(group).max(1);
                let mut s = vec![0f32; groups * mp];
                for r in 0..m {
                    for g in 0..groups {
                        s[g * mp + r] = scales[r * groups + g];
                    }
                }
                s
            }
        };
        Ok(Self {
            values,
            rows: m,
            cols: k,
            slots,
            row_tiles,
            last_lanes,
            column_bytes,
            blocks,
            scales: dev_scales,
        })
    }

    pub fn values(&self) -> LowBitValues {
        self.values
    }
    pub fn slots(&self) -> usize {
        self.slots
    }
    /// Device bytes: blocks and scales.
    pub fn device_bytes(&self) -> usize {
        self.blocks.len() + 4 * self.scales.len()
    }
}

/// Snaps one matrix row onto the grids of `values` in place (int8: one scale for the row;
/// int4: one per group of columns): zeros stay zero, a value that rounds to 0 is dropped.
pub fn snap_row(values: LowBitValues, row: &mut [f32]) -> Result<()> {
    let (grid, span) = match values {
        LowBitValues::Int8 => (INT8, row.len().max(1)),
        LowBitValues::Int4 { group } => (INT4, group.max(1)),
    };
    for chunk in row.chunks_mut(span) {
        grid.snap_row(chunk)
            .ok_or_else(|| CudaError::Option("a weight is not finite".into()))?;
    }
    Ok(())
}

/// Snaps a balanced matrix onto the grids of `values` (as `sieve pack --values` does: int8 per
/// row, int4 per row and group; zeros stay zero, a value that rounds to 0 is dropped) and
/// returns its device layout and the snapped f16 matrix (what the reference multiplies).
pub fn snap_balanced(
    w: &DenseMatrix,
    slots: usize,
    values: LowBitValues,
) -> Result<(BalancedLowBit, DenseMatrix)> {
    let (m, k) = (w.rows(), w.cols());
    let rows = (0..m)
        .into_par_iter()
        .map(|r| {
            let mut row: Vec<f32> = w.row(r).iter().map(|v| v.to_f32()).collect();
            snap_row(values, &mut row)?;
            Ok(row.into_iter().map(f16::from_f32).collect::<Vec<f16>>())
        })
        .collect::<Result<Vec<Vec<f16>>>>()?;
    let out = rows.concat();
    let snapped = DenseMatrix::new(m, k, out)?;
    let enc = BalancedLowBit::from_matrix(&snapped, slots, values)?;
    Ok((enc, snapped))
}

/// A [`BalancedLowBit`] on the device with its kernel.
pub struct GpuBalancedLowBit {
    values: LowBitValues,
    rows: usize,
    cols: usize,
    slots: usize,
    row_tiles: usize,
    last_lanes: usize,
    column_bytes: usize,
    scale_bytes: usize,
    blocks: CudaSlice<u8>,
    scales: CudaSlice<f32>,
    flags: CudaSlice<u32>,
    epoch: LaunchEpoch,
    /// Columns per warp slice (0: chosen from the shape; int4: must divide the group).
    pub cols_per_warp: usize,
}

impl GpuBalancedLowBit {
    /// The array the decode step asks L2 for ahead of this product (its largest: the
    /// weights), see [`crate::product::L2Span`].
    pub fn weight_span(&self, gpu: &Gpu) -> crate::product::L2Span {
        crate::product::L2Span::of(gpu, &self.blocks)
    }

    pub fn values(&self) -> LowBitValues {
        self.values
    }

    pub fn upload(gpu: &Gpu, b: &BalancedLowBit) -> Result<Self> {
        Ok(Self {
            values: b.values,
            rows: b.rows,
            cols: b.cols,
            slots: b.slots,
            row_tiles: b.row_tiles,
            last_lanes: b.last_lanes,
            column_bytes: b.column_bytes,
            scale_bytes: 4 * b.scales.len(),
            blocks: gpu.upload(&b.blocks)?,
            scales: gpu.upload(&b.scales)?,
            flags: gpu.upload(&vec![0u32; b.row_tiles.max(1)])?,
            epoch: LaunchEpoch::default(),
            cols_per_warp: 0,
        })
    }

    /// Rows of [`Self::decode_transposed`]'s columns: the stored lanes' rows, M rounded up to
    /// 16 (512 per full tile).
    pub fn padded_rows(&self) -> usize {
        TILE * self.row_tiles.saturating_sub(1) + LANE_ROWS * self.last_lanes
    }

    /// `out` (device, `cols` x [`Self::padded_rows`] f16, column k's rows contiguous) = the
    /// matrix, each weight `s · q` rounded to f16 once: the batched prefill's copy for cuBLAS
    /// (`blb_to_f16_t`). Rows past M are zero.
    pub fn decode_transposed(&self, gpu: &Gpu, out: DevPtr) -> Result<()> {
        if self.rows == 0 || self.cols == 0 {
            return Ok(());
        }
        let f = gpu.function(&FAMILY, "blb_to_f16_t")?;
        let cfg = crate::product::warp_per_item(self.row_tiles * self.cols, || {
            format!(
                "a {} x {} low-bit Balanced-CBC matrix",
                self.rows, self.cols
            )
        })?;
        let (bits, group) = match self.values {
            LowBitValues::Int8 => (8i32, 0i32),
            LowBitValues::Int4 { group } => (4, group as i32),
        };
        let (k, n, tiles, last) = (
            self.cols as i32,
            self.slots as i32,
            self.row_tiles as i32,
            self.last_lanes as i32,
        );
        let (smp, mp) = ((self.row_tiles * TILE) as i32, self.padded_rows() as i32);
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.blocks)
            .arg(&self.scales)
            .arg(&out)
            .arg(&k)
            .arg(&n)
            .arg(&bits)
            .arg(&tiles)
            .arg(&last)
            .arg(&group)
            .arg(&smp)
            .arg(&mp);
        unsafe { b.launch(cfg) }.during("launching blb_to_f16_t")?;
        Ok(())
    }

    fn effective_cols_per_warp(&self, gpu: &Gpu) -> Result<usize> {
        let group = match self.values {
            LowBitValues::Int4 { group } => group,
            LowBitValues::Int8 => 64,
        };
        if self.cols_per_warp > 0 {
            if self.cols_per_warp > 64 || !group.is_multiple_of(self.cols_per_warp) {
                return Err(CudaError::Option(format!(
                    "cols_per_warp must divide {} and be at most 64, got {}",
                    group.min(64),
                    self.cols_per_warp
                )));
            }
            return Ok(self.cols_per_warp);
        }
        let target_warps = gpu.info().multiprocessors as usize * 24;
        let per_warp = (self.cols * self.row_tiles).div_ceil(target_warps.max(1));
        Ok(match self.values {
            LowBitValues::Int8 => per_warp.div_ceil(8).saturating_mul(8).clamp(16, 64),
            // A power of two dividing the group, nearest above the target.
            LowBitValues::Int4 { group } => per_warp.next_power_of_two().clamp(16, group.min(64)),
        })
    }

    fn enqueue(
        &self,
        gpu: &Gpu,
        x: DevPtr,
        threshold: Threshold,
        y: DevPtr,
        flags: DevPtr,
        epoch: u32,
    ) -> Result<()> {
        if self.rows == 0 || self.cols == 0 {
            return Ok(());
        }
        let name = match self.values {
            LowBitValues::Int8 => format!("bcbc_int8_n{}", self.slots),
            LowBitValues::Int4 { .. } => format!("bcbc_int4_n{}", self.slots),
        };
        let f = gpu.function(&FAMILY, &name)?;
        let cpw = self.effective_cols_per_warp(gpu)?;
        let slices = self.cols.div_ceil(cpw);
        let cfg = LaunchConfig {
            grid_dim: (
                self.row_tiles as u32,
                (slices as u32).div_ceil(WARPS).max(1),
                1,
            ),
            block_dim: (32 * WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (m, k, t) = (self.rows as i32, self.cols as i32, threshold_arg(threshold));
        let (cpw, last) = (cpw as i32, self.last_lanes as i32);
        let group = match self.values {
            LowBitValues::Int4 { group } => group as i32,
            LowBitValues::Int8 => 0,
        };
        let mp = (self.row_tiles * TILE) as i32;
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.blocks)
            .arg(&self.scales)
            .arg(&x)
            .arg(&y)
            .arg(&m)
            .arg(&k)
            .arg(&t)
            .arg(&cpw)
            .arg(&last)
            .arg(&group)
            .arg(&mp)
            .arg(&flags)
            .arg(&epoch);
        unsafe { b.launch(cfg) }.during("launching bcbc low-bit spMspV")?;
        Ok(())
    }
}

impl GpuMatVec for GpuBalancedLowBit {
    fn label(&self) -> String {
        format!("balanced-cbc/n{}/{}", self.slots, self.values.name())
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn bytes_for(&self, active: &[bool]) -> usize {
        let on = active.iter().filter(|a| **a).count();
        on * self.column_bytes + self.scale_bytes + self.cols * 4 + self.rows * 4
    }
    fn launch(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        threshold: Threshold,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        check_io(self, x, y)?;
        if self.cols == 0 {
            return gpu.zero_f32(y);
        }
        let epoch = self.epoch.next();
        let (xp, yp) = (crate::dev_ptr(gpu, x), crate::dev_ptr(gpu, y));
        let flags = crate::dev_ptr(gpu, &self.flags);
        self.enqueue(gpu, xp, threshold, yp, flags, epoch)
    }
}

impl GpuAccumulate for GpuBalancedLowBit {
    fn launch_add(&self, gpu: &Gpu, x: DevPtr, threshold: Threshold, y: DevPtr) -> Result<()> {
        self.enqueue(gpu, x, threshold, y, 0, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use sieve_formats::balanced_cbc::BalancedCbc;
    use sieve_formats::random::balanced_matrix;
    use sieve_formats::WeightFormat;

    /// Reads the blocks back the way the kernel does (codes, row nibbles, scales) into f32
    /// weights.
    fn read_back(b: &BalancedLowBit) -> Vec<f32> {
        let (m, k, n) = (b.rows, b.cols, b.slots);
        let vw = b.values.value_words(n);
        let iw = n.div_ceil(8);
        let mp = b.row_tiles * TILE;
        let mut out = vec![0f32; m * k];
        let mut at = 0;
        for rt in 0..b.row_tiles {
            let lanes = if rt + 1 == b.row_tiles {
                b.last_lanes
            } else {
                32
            };
            let bytes = (4 * (vw + iw) * lanes).div_ceil(16) * 16;
            for c in 0..k {
                let blk = &b.blocks[at..at + bytes];
                let word = |w: usize, j: usize| {
                    let o = 4 * (w * lanes + j);
                    u32::from_le_bytes(blk[o..o + 4].try_into().unwrap())
                };
                for j in 0..lanes {
                    let mut seen = 0u32;
                    for i in 0..n {
                        let row = (word(vw + i / 8, j) >> (4 * (i % 8))) & 15;
                        assert_eq!(seen & (1 << row), 0, "two slots on one row");
                        seen |= 1 << row;
                        let qv = match b.values {
                            LowBitValues::Int8 => {
                                ((word(i / 4, j) >> (8 * (i % 4))) & 255) as i32 - 128
                            }
                            LowBitValues::Int4 { .. } => {
                                ((word(i / 8, j) >> (4 * (i % 8))) & 15) as i32 - 8
                            }
                        };
                        let r = rt * TILE + 16 * j + row as usize;
                        let s = match b.values {
                            LowBitValues::Int8 => b.scales[r],
                            LowBitValues::Int4 { group } => b.scales[(c / group) * mp + r],
                        };
                        if r < m {
                            out[r * k + c] += qv as f32 * s;
                        } else {
                            assert_eq!(qv, 0);
                        }
                    }
                }
                at += bytes;
            }
        }
        assert_eq!(at, b.blocks.len());
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(16))]
        /// Snapped matrices are detected, and the blocks hold exactly the snapped values.
        #[test]
        fn blocks_hold_the_snapped_values(rows in 1usize..1100, cols in 1usize..70, slots in 1usize..=16, seed in 0u64..1000, kind in 0usize..4) {
            let values = [LowBitValues::Int8, LowBitValues::Int4 { group: 32 }, LowBitValues::Int4 { group: 64 }, LowBitValues::Int4 { group: 128 }][kind];
            let w = balanced_matrix(rows, cols, slots, seed).unwrap();
            let (enc, snapped) = snap_balanced(&w, slots, values).unwrap();
            let got = read_back(&enc);
            let want: Vec<f32> = snapped.data().iter().map(|v| v.to_f32()).collect();
            prop_assert_eq!(got, want);
            // Detection (as the upload does it: from the matrix, with the encoding's slots) finds
            // a grid the values lie on, and its blocks decode to what Balanced-CBC stores.
            let b = BalancedCbc::encode_with_slots(&snapped, slots).unwrap();
            let d = BalancedLowBit::detect(&snapped, b.slots()).expect("detected");
            let want2: Vec<f32> = b.decode().data().iter().map(|v| v.to_f32()).collect();
            prop_assert_eq!(read_back(&d), want2);
        }
    }

    /// `blb_to_f16_t` on the CPU, warp by warp and lane by lane with the kernel's offsets (block
    /// sizes, value and row words, scale addresses): column-major f16, `padded_rows` a column.
    fn emulate_decode_transposed(b: &BalancedLowBit) -> (Vec<f16>, usize) {
        let (k_cols, n, tiles) = (b.cols, b.slots, b.row_tiles);
        let bits = b.values.bits();
        let group = match b.values {
            LowBitValues::Int4 { group } => group,
            LowBitValues::Int8 => 0,
        };
        let (iw, vw) = (
            n.div_ceil(8),
            if bits == 8 {
                n.div_ceil(4)
            } else {
                n.div_ceil(8)
            },
        );
        let full = 128 * (vw + iw);
        let smp = tiles * TILE;
        let mp = TILE * tiles.saturating_sub(1) + LANE_ROWS * b.last_lanes;
        let ld32 = |at: usize| u32::from_le_bytes(b.blocks[at..at + 4].try_into().unwrap());
        let mut out = vec![f16::from_bits(0x7e00); k_cols * mp];
        for wid in 0..tiles * k_cols {
            let (rt, k) = (wid / k_cols, wid % k_cols);
            let lanes = if rt == tiles - 1 { b.last_lanes } else { 32 };
            let block_bytes = if lanes == 32 {
                full
            } else {
                (4 * (vw + iw) * lanes + 15) & !15
            };
            for lane in 0..lanes {
                let base = rt * k_cols * full + k * block_bytes + 4 * lane;
                let idx_at = 4 * vw * lanes;
                let srow = if bits == 8 { 0 } else { (k / group) * smp } + rt * TILE + 16 * lane;
                let mut rows = [f16::ZERO; 16];
                for i in 0..n {
                    let per = if bits == 8 { 4 } else { 8 };
                    let w = ld32(base + 4 * (i / per) * lanes);
                    let q = if bits == 8 {
                        ((w >> (8 * (i % 4))) & 0xff) as i32 - 128
                    } else {
                        ((w >> (4 * (i % 8))) & 15) as i32 - 8
                    };
                    let r = ((ld32(base + idx_at + 4 * (i / 8) * lanes) >> (4 * (i % 8))) & 15)
                        as usize;
                    let v = b.scales[srow + r] * q as f32;
                    rows[r] = f16::from_f32(rows[r].to_f32() + v);
                }
                out[k * mp + rt * TILE + 16 * lane..][..16].copy_from_slice(&rows);
            }
        }
        (out, mp)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(16))]
        /// The prefill's f16 copy, emulated, is the snapped matrix (column-major, zeros below M),
        /// with nothing of the padded copy left unwritten.
        #[test]
        fn decode_transposed_mapping_reproduces_the_matrix(rows in 1usize..1100, cols in 1usize..70, slots in 1usize..=16, seed in 0u64..1000, kind in 0usize..4) {
            let values = [LowBitValues::Int8, LowBitValues::Int4 { group: 32 }, LowBitValues::Int4 { group: 64 }, LowBitValues::Int4 { group: 128 }][kind];
            let w = balanced_matrix(rows, cols, slots, seed).unwrap();
            let (enc, snapped) = snap_balanced(&w, slots, values).unwrap();
            let (out, mp) = emulate_decode_transposed(&enc);
            for c in 0..cols {
                for r in 0..mp {
                    let want = if r < rows { snapped.get(r, c) } else { f16::ZERO };
                    prop_assert_eq!(out[c * mp + r].to_f32(), want.to_f32(), "({}, {})", r, c);
                }
            }
        }
    }

    #[test]
    fn f16_values_are_not_detected() {
        let w = balanced_matrix(40, 50, 8, 3).unwrap();
        let b = BalancedCbc::encode_with_slots(&w, 8).unwrap();
        assert!(BalancedLowBit::detect(&w, b.slots()).is_none());
    }
}
