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
}

impl GpuBalancedCbc {
    pub fn upload(gpu: &Gpu, w: &BalancedCbc) -> Result<Self> {
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
        Ok(Self {
            blocks: gpu.upload(w.blocks())?,
            rows,
            cols,
            slots,
            column_bytes,
            row_tiles,
            last_lanes,
            flags: gpu.upload(&vec![0u32; row_tiles.max(1)])?,
            epoch: LaunchEpoch::default(),
            cols_per_warp: 0,
        })
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    fn kernel_name(&self) -> String {
        format!("bcbc_spmspv_n{}", self.slots)
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

impl GpuMatVec for GpuBalancedCbc {
    fn label(&self) -> String {
        if self.cols_per_warp == 0 {
            format!("balanced-cbc/n{}", self.slots)
        } else {
            format!("balanced-cbc/n{}/c{}", self.slots, self.cols_per_warp)
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
