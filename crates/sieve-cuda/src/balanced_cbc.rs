//! Balanced-CBC on the GPU: the fixed-size column blocks of
//! [`sieve_formats::balanced_cbc::BalancedCbc`] uploaded as they are, multiplied by
//! `kernels/balanced_cbc_spmspv.cu` (one kernel per slot count N).

use crate::dense::check_len;
use crate::error::{CudaError, DriverContext, Result};
use crate::gpu::{Gpu, KernelFamily};
use crate::product::{check_io, threshold_arg, DevPtr, GpuAccumulate, GpuMatVec, LaunchEpoch};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use sieve_formats::balanced_cbc::BalancedCbc;
use sieve_formats::{Threshold, WeightFormat};

pub const FAMILY: KernelFamily = KernelFamily {
    name: "balanced_cbc_spmspv",
    source: include_str!("../kernels/balanced_cbc_spmspv.cu"),
};

/// Warps per block (`BCBC_WARPS` in the kernel); each takes one slice of columns.
const WARPS: u32 = 8;
/// The kernel reads a warp's activations two per lane: at most 64 columns per warp.
pub const MAX_COLS_PER_WARP: usize = 64;

/// How a lane finds the rows of its slots (see the kernel's header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BcbcKernel {
    /// `bcbc_spmspv_n<N>`: an ALU chain over the set bits of the 16-bit mask, on the blob's
    /// blocks as they are.
    Chain,
    /// `bcbc_idx_n<N>`: the upload stores each slot's row as a 4-bit index instead of the
    /// lane's mask ([`index_blocks`]): two ALU operations per slot instead of five, 64 more
    /// bytes per full block (128 above N = 8).
    Idx,
}

impl BcbcKernel {
    /// The faster kernel for N slots, as measured on the H200 (docs/BENCHMARKS.md, run 11):
    /// the index layout up to N = 8 (5-15% faster on the LLaMA shapes), the mask chain above
    /// (two index words per lane: no faster, more bytes).
    pub fn for_slots(slots: usize) -> Self {
        if slots <= 8 {
            BcbcKernel::Idx
        } else {
            BcbcKernel::Chain
        }
    }

    /// The kernel [`Self::for_slots`] does not pick (benchmarks time it with `--tune`).
    pub fn other(self) -> Self {
        match self {
            BcbcKernel::Chain => BcbcKernel::Idx,
            BcbcKernel::Idx => BcbcKernel::Chain,
        }
    }
}

pub struct GpuBalancedCbc {
    blocks: CudaSlice<u8>,
    rows: usize,
    cols: usize,
    slots: usize,
    /// Bytes per column of the whole matrix: full tiles' blocks plus the last tile's.
    column_bytes: usize,
    row_tiles: usize,
    /// Lanes stored in the last row tile (only those holding rows < M).
    last_lanes: usize,
    /// One per 512-row tile: fused zeroing (see the kernel's header).
    flags: CudaSlice<u32>,
    epoch: LaunchEpoch,
    /// Columns per warp slice, 1..=64; 0 picks one from the shape so that the grid has about
    /// 24 warps per multiprocessor (the prototype's best on the LLaMA shapes, docs/BENCHMARKS.md).
    pub cols_per_warp: usize,
    kernel: BcbcKernel,
}

impl GpuBalancedCbc {
    /// The array the decode step asks L2 for ahead of this product (its largest: the
    /// weights), see [`crate::product::L2Span`].
    pub fn weight_span(&self, gpu: &Gpu) -> crate::product::L2Span {
        crate::product::L2Span::of(gpu, &self.blocks)
    }

    /// Uploads `w` for the faster kernel of its slot count ([`BcbcKernel::for_slots`]).
    pub fn upload(gpu: &Gpu, w: &BalancedCbc) -> Result<Self> {
        Self::upload_for(gpu, w, BcbcKernel::for_slots(w.slots()))
    }

    /// Uploads `w` in the device layout `kernel` reads.
    pub fn upload_for(gpu: &Gpu, w: &BalancedCbc, kernel: BcbcKernel) -> Result<Self> {
        let (rows, cols) = (w.rows(), w.cols());
        if rows > i32::MAX as usize || cols > i32::MAX as usize {
            return Err(CudaError::Option(format!(
                "matrix {rows} x {cols} exceeds the kernels' 32-bit dimensions"
            )));
        }
        let (row_tiles, slots) = (w.row_tiles(), w.slots());
        // The layout's sizes, recomputed here from its definition (the kernel relies on them):
        // full tiles of 32 lanes, the last tile with only the lanes that hold rows < M.
        let last_lanes = (rows - 512 * row_tiles.saturating_sub(1)).div_ceil(16);
        let full = 64 * slots + 64;
        let last = (last_lanes * (2 * slots + 2)).div_ceil(16) * 16;
        let column_bytes = full * row_tiles.saturating_sub(1) + last;
        check_len(
            "balanced-cbc block bytes",
            column_bytes * cols,
            w.blocks().len(),
        )?;
        let (blocks, column_bytes) = match kernel {
            BcbcKernel::Chain => (gpu.upload(w.blocks())?, column_bytes),
            BcbcKernel::Idx => {
                let b = index_blocks(w);
                let per_column = b.len() / cols.max(1);
                (gpu.upload(&b)?, per_column)
            }
        };
        Ok(Self {
            blocks,
            rows,
            cols,
            slots,
            column_bytes,
            row_tiles,
            last_lanes,
            flags: gpu.upload(&vec![0u32; row_tiles.max(1)])?,
            epoch: LaunchEpoch::default(),
            cols_per_warp: 0,
            kernel,
        })
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    pub fn kernel(&self) -> BcbcKernel {
        self.kernel
    }

    /// The device blocks as the persistent step reads them (its task width left to it): either
    /// layout, the index one flagged.
    pub fn persistent_arrays(&self, gpu: &Gpu) -> Result<crate::persistent::PersistentBcbc> {
        use crate::gpu::i32_arg;
        Ok(crate::persistent::PersistentBcbc {
            blocks: crate::product::dev_ptr(gpu, &self.blocks),
            rows: i32_arg("rows", self.rows)?,
            cols: i32_arg("columns", self.cols)?,
            slots: i32_arg("slots", self.slots)?,
            index: (self.kernel == BcbcKernel::Idx) as i32,
            last_lanes: i32_arg("lanes of the last tile", self.last_lanes)?,
            cols_per_task: 0,
        })
    }

    /// Rows of [`Self::decode_transposed`]'s columns: the stored lanes' rows, M rounded up to
    /// 16 (512 per full tile).
    pub fn padded_rows(&self) -> usize {
        512 * self.row_tiles.saturating_sub(1) + 16 * self.last_lanes
    }

    /// `out` (device, `cols` x [`Self::padded_rows`] f16, column k's rows contiguous) = the
    /// matrix, for the batched prefill's cuBLAS GEMM (`bcbc_to_f16_t`). Rows past M are zero.
    pub fn decode_transposed(&self, gpu: &Gpu, out: DevPtr) -> Result<()> {
        if self.rows == 0 || self.cols == 0 {
            return Ok(());
        }
        let f = gpu.function(&FAMILY, "bcbc_to_f16_t")?;
        let cfg = crate::product::warp_per_item(self.row_tiles * self.cols, || {
            format!("a {} x {} Balanced-CBC matrix", self.rows, self.cols)
        })?;
        let (k, n, idx) = (
            self.cols as i32,
            self.slots as i32,
            (self.kernel == BcbcKernel::Idx) as i32,
        );
        let (tiles, last_lanes, mp) = (
            self.row_tiles as i32,
            self.last_lanes as i32,
            self.padded_rows() as i32,
        );
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.blocks)
            .arg(&out)
            .arg(&k)
            .arg(&n)
            .arg(&idx)
            .arg(&tiles)
            .arg(&last_lanes)
            .arg(&mp);
        unsafe { b.launch(cfg) }.during("launching bcbc_to_f16_t")?;
        Ok(())
    }

    fn kernel_name(&self) -> String {
        match self.kernel {
            BcbcKernel::Chain => format!("bcbc_spmspv_n{}", self.slots),
            BcbcKernel::Idx => format!("bcbc_idx_n{}", self.slots),
        }
    }

    fn effective_cols_per_warp(&self, gpu: &Gpu) -> Result<usize> {
        if self.cols_per_warp > MAX_COLS_PER_WARP {
            return Err(CudaError::Option(format!(
                "cols_per_warp must be at most {MAX_COLS_PER_WARP} (0 = auto), got {}",
                self.cols_per_warp
            )));
        }
        if self.cols_per_warp > 0 {
            return Ok(self.cols_per_warp);
        }
        let target_warps = gpu.info().multiprocessors as usize * 24;
        let per_warp = (self.cols * self.row_tiles).div_ceil(target_warps.max(1));
        Ok(per_warp
            .div_ceil(8)
            .saturating_mul(8)
            .clamp(16, MAX_COLS_PER_WARP))
    }

    fn config(&self, cols_per_warp: usize) -> LaunchConfig {
        let slices = self.cols.div_ceil(cols_per_warp.max(1));
        LaunchConfig {
            grid_dim: (
                self.row_tiles.max(1) as u32,
                (slices as u32).div_ceil(WARPS).max(1),
                1,
            ),
            block_dim: (32 * WARPS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Enqueues the kernel; `flags` = 0 (null) adds the product to `y` instead of zeroing it.
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
        let f = gpu.function(&FAMILY, &self.kernel_name())?;
        let cpw = self.effective_cols_per_warp(gpu)?;
        let cfg = self.config(cpw);
        let (m, k) = (self.rows as i32, self.cols as i32);
        let (t, cpw) = (threshold_arg(threshold), cpw as i32);
        let last_lanes = self.last_lanes as i32;
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.blocks)
            .arg(&x)
            .arg(&y)
            .arg(&m)
            .arg(&k)
            .arg(&t)
            .arg(&cpw)
            .arg(&last_lanes)
            .arg(&flags)
            .arg(&epoch);
        unsafe { b.launch(cfg) }.during("launching bcbc_spmspv")?;
        Ok(())
    }
}

/// Tokens one union launch takes (`bcbc_union_n*`, `bcbc_idx_union_n*`): every token's
/// accumulators live in shared memory, 16 KB a token per block.
const UNION_LAUNCH_TOKENS: usize = 4;
/// Most tokens [`GpuBalancedCbc::union_rows`] takes, in launches of 4. Measured (H100,
/// 2026-12-06, 7B shape sp 0.5 / dp 0.5, `sieve bench decode --batch`): a step of 2 / 4 / 6 / 8
/// sequences took 4.24 / 6.37 / 11.87 / 11.99 ms through the union against 5.53 / 11.06 /
/// 16.60 / 22.12 ms of single steps, and the pass through the f16 copy 16.73 ms at 9 and 12
/// sequences: three launches (12 tokens) would cost about that.
pub const UNION_MAX_TOKENS: usize = 8;

impl GpuBalancedCbc {
    /// `Y[i] += W · mask_t(X[i])` for `n` <= [`UNION_MAX_TOKENS`] tokens, reading every column
    /// active in at least one of 4 tokens once (the union of their active columns; one launch
    /// per 4 tokens): `X` f32 rows `ldx` apart, each masked by `threshold` on its own; `Y` f32
    /// rows `ldy` apart, always added to. The many-sequence decode step's product for a few
    /// sequences.
    #[allow(clippy::too_many_arguments)]
    pub fn union_rows(
        &self,
        gpu: &Gpu,
        x: DevPtr,
        ldx: usize,
        n: usize,
        threshold: Threshold,
        y: DevPtr,
        ldy: usize,
    ) -> Result<()> {
        if n == 0 || self.rows == 0 || self.cols == 0 {
            return Ok(());
        }
        crate::product::check_union_args(
            "Balanced-CBC",
            n,
            UNION_MAX_TOKENS,
            threshold,
            ldx,
            ldy,
            self.cols,
            self.rows,
        )?;
        let name = match self.kernel {
            BcbcKernel::Chain => format!("bcbc_union_n{}", self.slots),
            BcbcKernel::Idx => format!("bcbc_idx_union_n{}", self.slots),
        };
        let f = gpu.function(&FAMILY, &name)?;
        let shared = WARPS as usize * UNION_LAUNCH_TOKENS * 16 * 32 * 4;
        gpu.allow_dynamic_shared(&f, shared)?;
        let cpw = self.effective_cols_per_warp(gpu)?;
        let cfg = LaunchConfig {
            shared_mem_bytes: shared as u32,
            ..self.config(cpw)
        };
        let (ldx_i, ldy_i) = (
            crate::gpu::i32_arg("activation row stride", ldx)?,
            crate::gpu::i32_arg("output row stride", ldy)?,
        );
        let (m, k) = (self.rows as i32, self.cols as i32);
        let (t, cpw) = (threshold_arg(threshold), cpw as i32);
        let last_lanes = self.last_lanes as i32;
        for t0 in (0..n).step_by(UNION_LAUNCH_TOKENS) {
            let n_i = (n - t0).min(UNION_LAUNCH_TOKENS) as i32;
            let (xt, yt) = (x + (t0 * ldx * 4) as u64, y + (t0 * ldy * 4) as u64);
            let mut b = gpu.stream().launch_builder(&f);
            b.arg(&self.blocks)
                .arg(&xt)
                .arg(&ldx_i)
                .arg(&n_i)
                .arg(&yt)
                .arg(&ldy_i)
                .arg(&m)
                .arg(&k)
                .arg(&t)
                .arg(&cpw)
                .arg(&last_lanes);
            unsafe { b.launch(cfg) }.during("launching bcbc_union")?;
        }
        Ok(())
    }
}

/// Bytes of one block of `lanes` lanes in the [`BcbcKernel::Idx`] layout: the values as
/// Balanced-CBC stores them (`2 N L` bytes), then from the next 4-byte boundary `ceil(N / 8)`
/// index words per lane (word w of lane j at `4 (w L + j)`: slot i's row in nibble i % 8 of
/// word i / 8), rounded up to 16.
fn index_block_bytes(slots: usize, lanes: usize) -> (usize, usize) {
    let idx_at = (2 * slots * lanes).div_ceil(4) * 4;
    let words = slots.div_ceil(8);
    (idx_at, (idx_at + 4 * words * lanes).div_ceil(16) * 16)
}

/// The [`BcbcKernel::Idx`] device layout of `w`: every block's values copied, its lane masks
/// replaced by the rows of the lane's slots as 4-bit indices (slot i = the i-th set bit).
pub fn index_blocks(w: &BalancedCbc) -> Vec<u8> {
    let (n, cols, tiles) = (w.slots(), w.cols(), w.row_tiles());
    let src = w.blocks();
    let mut out = Vec::new();
    let mut at = 0usize;
    for rt in 0..tiles {
        let lanes = w.lanes_in_tile(rt);
        let src_bytes = w.tile_block_bytes(rt);
        let (idx_at, bytes) = index_block_bytes(n, lanes);
        for _ in 0..cols {
            let block = &src[at..at + src_bytes];
            let mut dst = vec![0u8; bytes];
            dst[..2 * n * lanes].copy_from_slice(&block[..2 * n * lanes]);
            for j in 0..lanes {
                let m = 2 * lanes * n + 2 * j;
                let mut mask = u16::from_le_bytes([block[m], block[m + 1]]);
                let mut words = [0u32; 2];
                for slot in 0..n {
                    let row = mask.trailing_zeros();
                    mask &= mask.wrapping_sub(1);
                    words[slot / 8] |= row << (4 * (slot % 8));
                }
                for (wi, word) in words.iter().take(n.div_ceil(8)).enumerate() {
                    let o = idx_at + 4 * (wi * lanes + j);
                    dst[o..o + 4].copy_from_slice(&word.to_le_bytes());
                }
            }
            out.extend_from_slice(&dst);
            at += src_bytes;
        }
    }
    out
}

impl GpuMatVec for GpuBalancedCbc {
    fn label(&self) -> String {
        let kernel = match self.kernel {
            BcbcKernel::Chain => "/chain",
            BcbcKernel::Idx => "/idx",
        };
        if self.cols_per_warp == 0 {
            format!("balanced-cbc/n{}{kernel}", self.slots)
        } else {
            format!(
                "balanced-cbc/n{}{kernel}/c{}",
                self.slots, self.cols_per_warp
            )
        }
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn bytes_for(&self, active: &[bool]) -> usize {
        let on = active.iter().filter(|a| **a).count();
        on * self.column_bytes + self.cols * 4 + self.rows * 4
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
            // No column to add: the product is zero (the kernel would not run at all).
            return gpu.zero_f32(y);
        }
        let epoch = self.epoch.next();
        let (xp, yp) = (crate::dev_ptr(gpu, x), crate::dev_ptr(gpu, y));
        let flags = crate::dev_ptr(gpu, &self.flags);
        self.enqueue(gpu, xp, threshold, yp, flags, epoch)
    }
}

impl GpuAccumulate for GpuBalancedCbc {
    fn launch_add(&self, gpu: &Gpu, x: DevPtr, threshold: Threshold, y: DevPtr) -> Result<()> {
        self.enqueue(gpu, x, threshold, y, 0, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sieve_formats::random::balanced_matrix;

    /// `bcbc_to_f16_t` on the CPU, warp by warp and lane by lane with the kernel's own offsets
    /// (block sizes, slot and index addresses, the mask chain), over the bytes the upload sends
    /// for `kernel`: column-major f16, `padded_rows` per column.
    fn emulate_decode_transposed(f: &BalancedCbc, kernel: BcbcKernel) -> (Vec<half::f16>, usize) {
        let (k_cols, n, tiles) = (f.cols(), f.slots(), f.row_tiles());
        let idx = kernel == BcbcKernel::Idx;
        let bytes = if idx {
            index_blocks(f)
        } else {
            f.blocks().to_vec()
        };
        let last_lanes = (f.rows() - 512 * tiles.saturating_sub(1)).div_ceil(16);
        let mp = 512 * tiles.saturating_sub(1) + 16 * last_lanes;
        let ld16 = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]);
        let ld32 = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        let iw = n.div_ceil(8);
        let full = if idx { 64 * n + 128 * iw } else { 64 * n + 64 };
        let mut out = vec![half::f16::from_bits(0x7e00); k_cols * mp];
        for wid in 0..tiles * k_cols {
            let (rt, k) = (wid / k_cols, wid % k_cols);
            let lanes = if rt == tiles - 1 { last_lanes } else { 32 };
            let idx_at = (lanes * 2 * n + 3) & !3;
            let block_bytes = if lanes == 32 {
                full
            } else if idx {
                (idx_at + 4 * iw * lanes + 15) & !15
            } else {
                (lanes * (2 * n + 2) + 15) & !15
            };
            let b = rt * k_cols * full + k * block_bytes;
            for lane in 0..lanes {
                let mut rows = [0f32; 16];
                let mut mask = if idx {
                    0
                } else {
                    ld16(b + 2 * lanes * n + 2 * lane) as u32
                };
                for i in 0..n {
                    let at = if n % 2 == 1 && i == n - 1 {
                        4 * (n / 2) * lanes + 2 * lane
                    } else {
                        4 * ((i / 2) * lanes + lane) + 2 * (i & 1)
                    };
                    let v = half::f16::from_bits(ld16(b + at)).to_f32();
                    let r = if idx {
                        ((ld32(b + idx_at + 4 * ((i / 8) * lanes + lane)) >> (4 * (i % 8))) & 15)
                            as i32
                    } else {
                        let r = mask.trailing_zeros() as i32;
                        mask &= mask.wrapping_sub(1);
                        if r == 32 {
                            -1
                        } else {
                            r
                        }
                    };
                    if r >= 0 {
                        let r = r as usize;
                        rows[r] =
                            half::f16::from_f32(half::f16::from_f32(rows[r]).to_f32() + v).to_f32();
                    }
                }
                for (s, v) in rows.iter().enumerate() {
                    out[k * mp + 512 * rt + 16 * lane + s] = half::f16::from_f32(*v);
                }
            }
        }
        (out, mp)
    }

    /// The prefill's f16 copy, emulated, is the matrix (column-major, zeros below M) in both
    /// layouts, every slot count, partial tiles and lanes, and unstructured matrices (padding
    /// slots); nothing of the padded copy is left unwritten.
    #[test]
    fn decode_transposed_mapping_reproduces_the_matrix() {
        use sieve_formats::random::{sparse_matrix, Pattern};
        for &(rows, cols) in &[(1usize, 1usize), (33, 7), (576, 5), (1100, 3), (520, 9)] {
            for slots in [1usize, 2, 5, 8, 9, 15, 16] {
                let w = balanced_matrix(rows, cols, slots, 11 + slots as u64).expect("matrix");
                let f = BalancedCbc::encode_with_slots(&w, slots).expect("encode");
                for kernel in [BcbcKernel::Chain, BcbcKernel::Idx] {
                    check_emulated_decode(&f, &w, kernel, &format!("{rows}x{cols} n={slots}"));
                }
            }
            let w = sparse_matrix(rows, cols, 0.6, Pattern::Unstructured, 5).expect("matrix");
            let f = BalancedCbc::encode(&w).expect("encode");
            for kernel in [BcbcKernel::Chain, BcbcKernel::Idx] {
                check_emulated_decode(&f, &w, kernel, &format!("{rows}x{cols} unstructured"));
            }
        }
    }

    fn check_emulated_decode(
        f: &BalancedCbc,
        w: &sieve_formats::DenseMatrix,
        kernel: BcbcKernel,
        what: &str,
    ) {
        let (out, mp) = emulate_decode_transposed(f, kernel);
        for c in 0..w.cols() {
            for r in 0..mp {
                let got = out[c * mp + r];
                let want = if r < w.rows() {
                    w.get(r, c)
                } else {
                    half::f16::ZERO
                };
                assert_eq!(got.to_f32(), want.to_f32(), "{what} {kernel:?}: ({r}, {c})");
            }
        }
    }

    /// Decodes the [`BcbcKernel::Idx`] layout on its own (values + nibble rows, the kernel's
    /// reading of it) and compares with the matrix: every slot lands on its row.
    #[test]
    fn index_blocks_place_every_value_on_its_row() {
        for &(rows, cols) in &[(1usize, 1usize), (33, 7), (576, 5), (1100, 3)] {
            for slots in [1usize, 5, 8, 9, 16] {
                let w = balanced_matrix(rows, cols, slots, 7 + slots as u64).expect("matrix");
                let f = BalancedCbc::encode_with_slots(&w, slots).expect("encode");
                let b = index_blocks(&f);
                let mut got = vec![0f32; rows * cols];
                let mut at = 0;
                for rt in 0..f.row_tiles() {
                    let lanes = f.lanes_in_tile(rt);
                    let (idx_at, bytes) = index_block_bytes(slots, lanes);
                    for c in 0..cols {
                        let block = &b[at..at + bytes];
                        for j in 0..lanes {
                            for i in 0..slots {
                                let v = if i % 2 == 0 || i == slots - 1 && slots % 2 == 1 {
                                    // Low half of word i / 2, or the odd-N tail.
                                    let o = if i == slots - 1 && slots % 2 == 1 {
                                        (slots / 2) * 4 * lanes + 2 * j
                                    } else {
                                        4 * ((i / 2) * lanes + j)
                                    };
                                    u16::from_le_bytes([block[o], block[o + 1]])
                                } else {
                                    let o = 4 * ((i / 2) * lanes + j) + 2;
                                    u16::from_le_bytes([block[o], block[o + 1]])
                                };
                                let o = idx_at + 4 * ((i / 8) * lanes + j);
                                let word = u32::from_le_bytes([
                                    block[o],
                                    block[o + 1],
                                    block[o + 2],
                                    block[o + 3],
                                ]);
                                let row =
                                    512 * rt + 16 * j + ((word >> (4 * (i % 8))) & 15) as usize;
                                let v = half::f16::from_bits(v).to_f32();
                                if row < rows {
                                    got[row * cols + c] += v;
                                } else {
                                    assert_eq!(v, 0.0, "a slot past the last row holds a value");
                                }
                            }
                        }
                        at += bytes;
                    }
                }
                assert_eq!(
                    at,
                    b.len(),
                    "{rows}x{cols} n={slots}: blocks exactly covered"
                );
                let want: Vec<f32> = w.data().iter().map(|v| v.to_f32()).collect();
                assert_eq!(got, want, "{rows}x{cols} n={slots}");
            }
        }
    }
}
