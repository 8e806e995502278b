//! The interface every GPU weight format implements: `y = W · mask_t(x)` for one token.

use crate::dense::check_len;
use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use cudarc::driver::CudaSlice;
use sieve_formats::format::check_threshold;
use sieve_formats::Threshold;

/// A weight matrix resident on the GPU with its spMspV (or GEMV) kernel.
pub trait GpuMatVec {
    /// Format and kernel variant, for tables (e.g. `rlc-csc/c64`).
    fn label(&self) -> String;
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// Bytes the product must read from device memory when the columns marked in `active`
    /// (length K) are the active ones: the weight data of those columns with their metadata,
    /// the activations, and the output.
    fn bytes_for(&self, active: &[bool]) -> usize;
    /// Enqueues the product on the GPU's stream, zeroing `y` first where the kernel
    /// accumulates with atomics. `x` has K entries, `y` M.
    fn launch(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        threshold: Threshold,
        y: &mut CudaSlice<f32>,
    ) -> Result<()>;
}

/// A raw device address, for launches into parts of a buffer (q|k|v rows of one output, the
/// residual stream) that a [`CudaSlice`] cannot name.
pub type DevPtr = u64;

/// The device address of `s` (event tracking is off on sieve's context, so the guard cudarc
/// returns records nothing).
pub fn dev_ptr<T>(gpu: &Gpu, s: &CudaSlice<T>) -> DevPtr {
    use cudarc::driver::DevicePtr;
    let (p, _guard) = s.device_ptr(gpu.stream());
    p
}

/// A span of device memory that a small kernel of the decode step asks L2 to fetch for a later
/// kernel (`prefetch_span_l2` in `kernels/common.cuh`): the next product's weights, streamed
/// while RMSNorm, RoPE or SwiGLU run and the step would otherwise read nothing from DRAM.
/// `bytes == 0` asks for nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct L2Span {
    pub ptr: DevPtr,
    pub bytes: usize,
}

impl L2Span {
    pub const NONE: L2Span = L2Span { ptr: 0, bytes: 0 };

    /// All of `s`.
    pub fn of<T>(gpu: &Gpu, s: &CudaSlice<T>) -> Self {
        Self {
            ptr: dev_ptr(gpu, s),
            bytes: s.len() * std::mem::size_of::<T>(),
        }
    }

    /// The first `cap` bytes at most (a product reads its weights from the start first).
    pub fn capped(self, cap: usize) -> Self {
        if cap == 0 || self.ptr == 0 {
            return Self::NONE;
        }
        Self {
            ptr: self.ptr,
            bytes: self.bytes.min(cap),
        }
    }

    /// Blocks a launch that carries this span needs at least: one per SM (each SM issues its
    /// bulk prefetches one after another), or none asked when there is no span.
    pub fn min_blocks(self, gpu: &Gpu) -> u32 {
        if self.bytes == 0 {
            1
        } else {
            gpu.info().multiprocessors.max(1)
        }
    }

    /// The kernel arguments: the address (0 for none) and the length as u64.
    pub fn args(self) -> (DevPtr, u64) {
        if self.bytes == 0 {
            (0, 0)
        } else {
            (self.ptr, self.bytes as u64)
        }
    }
}

/// The decode runner's form of a product: `y += W · mask_t(x)` with no zeroing of `y` and no
/// host-side state that changes between launches, so that a launch can be captured once in a
/// CUDA graph and replayed for every token. `x` holds K f32, `y` M f32; the caller owns both
/// and guarantees their lengths.
pub trait GpuAccumulate {
    fn launch_add(&self, gpu: &Gpu, x: DevPtr, threshold: Threshold, y: DevPtr) -> Result<()>;
}

/// The arguments every union product (`union_rows` of the column formats) checks before it
/// launches: a valid threshold, at most `most` tokens, row strides of at least K and M. `what`
/// names the format in the errors.
#[allow(clippy::too_many_arguments)]
pub fn check_union_args(
    what: &str,
    n: usize,
    most: usize,
    threshold: Threshold,
    ldx: usize,
    ldy: usize,
    k: usize,
    m: usize,
) -> Result<()> {
    check_threshold(threshold)?;
    if n > most {
        return Err(CudaError::Option(format!(
            "the {what} union product takes at most {most} tokens, not {n}"
        )));
    }
    if ldx < k || ldy < m {
        return Err(CudaError::Option(format!(
            "the {what} union product's strides (x {ldx}, y {ldy}) are shorter than K = {k} or M = {m}"
        )));
    }
    Ok(())
}

/// The kernels' threshold argument: `None` is -1, which makes `|x| > t` true everywhere.
pub fn threshold_arg(t: Threshold) -> f32 {
    t.unwrap_or(-1.0)
}

/// Runs the product on host data: uploads `x`, poisons the output with NaN, launches,
/// synchronizes and downloads `y`. For tests and one-off products, not for timing.
pub fn matvec_host<F: GpuMatVec + ?Sized>(
    gpu: &Gpu,
    w: &F,
    x: &[f32],
    threshold: Threshold,
) -> Result<Vec<f32>> {
    check_threshold(threshold)?;
    check_len("activation length (K)", w.cols(), x.len())?;
    if x.iter().any(|v| !v.is_finite()) {
        return Err(CudaError::Option("activations must be finite".into()));
    }
    let xd = gpu.upload(x)?;
    let mut y = gpu.poisoned_f32(w.rows())?;
    w.launch(gpu, &xd, threshold, &mut y)?;
    gpu.synchronize()?;
    gpu.download(&y)
}

/// The active mask of `x` under `threshold`, for [`GpuMatVec::bytes_for`].
pub fn active_mask(x: &[f32], threshold: Threshold) -> Vec<bool> {
    x.iter()
        .map(|&v| sieve_formats::format::is_active(v, threshold))
        .collect()
}

/// The sum of `col_bytes[k]` over the active columns `k` (for [`GpuMatVec::bytes_for`]).
pub fn active_column_bytes(col_bytes: &[usize], active: &[bool]) -> usize {
    col_bytes
        .iter()
        .zip(active)
        .filter(|(_, a)| **a)
        .map(|(b, _)| *b)
        .sum()
}

/// Checks the device buffers of a launch against the matrix shape.
pub fn check_io<F: GpuMatVec + ?Sized>(
    w: &F,
    x: &CudaSlice<f32>,
    y: &CudaSlice<f32>,
) -> Result<()> {
    check_len("activation length (K)", w.cols(), x.len())?;
    check_len("output length (M)", w.rows(), y.len())
}

/// Launch counter for kernels that zero their output themselves (fused zeroing): the
/// first blocks of a row tile publish the launch's epoch in a per-tile flag once they have
/// zeroed it, and the other blocks wait for that value. Flags start at 0, which `next` never
/// returns, and a flag always holds the previous launch's epoch, which differs from the next.
#[derive(Debug, Default)]
pub struct LaunchEpoch(std::sync::atomic::AtomicU32);

impl LaunchEpoch {
    pub fn next(&self) -> u32 {
        use std::sync::atomic::Ordering::Relaxed;
        loop {
            let e = self.0.fetch_add(1, Relaxed).wrapping_add(1);
            if e != 0 {
                return e;
            }
        }
    }
}

/// One warp per work item, 8 warps (256 threads) a block, for `items` items: the launch shape
/// of the f16 decoders of the batched prefill (`bcbc_to_f16_t`, `blb_to_f16_t`,
/// `ie_bme_*_to_f16`, `rlc_to_f16_t`). `what` names the matrix when the grid would not fit.
pub(crate) fn warp_per_item(
    items: usize,
    what: impl FnOnce() -> String,
) -> Result<cudarc::driver::LaunchConfig> {
    let blocks = u32::try_from(items.div_ceil(8)).map_err(|_| {
        CudaError::Option(format!("{} is too large to decode in one launch", what()))
    })?;
    Ok(cudarc::driver::LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    })
}
