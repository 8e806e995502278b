//! The batched prefill's kernels besides the GEMMs, RoPE ([`crate::rope::rope_rows`]) and
//! attention ([`crate::attention::attention_rows`]): `n` prompt tokens at once, row-wise
//! (`kernels/prefill.cu`); and [`Rows`], what the rows of such a pass are.

use crate::error::CudaError;
use crate::error::{DriverContext, Result};
use crate::gpu::{grid_cfg, i32_arg, Gpu, KernelFamily};
use crate::product::{threshold_arg, DevPtr, L2Span};
use cudarc::driver::PushKernelArg;

pub const FAMILY: KernelFamily = KernelFamily {
    name: "prefill",
    source: include_str!("../kernels/prefill.cu"),
};

/// What the `n` rows of a batched pass are, for RoPE's cache writes and attention.
#[derive(Clone, Copy, Debug)]
pub enum Rows {
    /// Consecutive tokens of one sequence, the first at position `first` (a prompt chunk);
    /// the caches passed are that sequence's.
    Consecutive { first: usize },
    /// One token of each of `n` sequences (a decode step of a batch): `seqs` (device i32)
    /// holds `[position, slot]` per row, the caches passed are slot 0's and slot `s` starts
    /// `slot_stride` cache values further (an 8-bit cache's scales `slot_stride / head_dim`
    /// entries further). A negative slot `-(s + 1)` marks a padding row:
    /// it attends over slot `s` and writes no cache.
    Sequences { seqs: DevPtr, slot_stride: usize },
}

impl Rows {
    /// The kernels' `(first position, seqs, slot stride)` arguments.
    pub(crate) fn kernel_args(&self) -> Result<(i32, DevPtr, i64)> {
        Ok(match *self {
            Rows::Consecutive { first } => (i32_arg("position", first)?, 0, 0),
            Rows::Sequences { seqs, slot_stride } => {
                let stride = i64::try_from(slot_stride).map_err(|_| {
                    crate::error::CudaError::Unsupported(format!(
                        "a cache slot stride of {slot_stride} elements"
                    ))
                })?;
                (0, seqs, stride)
            }
        })
    }
}

/// The grid of the element-wise row kernels: blocks of 256 threads x 4 columns along a row,
/// up to 65,535 grid rows (the kernels loop over the rest). The launchers return before it for
/// 0 rows (a grid is at least 1 x 1).
fn row_grid(rows: usize, cols: usize) -> Result<(u32, u32)> {
    if cols > i32::MAX as usize - 8 {
        return Err(CudaError::Unsupported(format!("rows of {cols} values")));
    }
    Ok((cols.div_ceil(1024) as u32, rows.min(65_535) as u32))
}

/// `x[i] = embedding[tokens[i]]` for `n` tokens (`tokens` i32 on the device, checked by the caller).
pub fn embed_rows(
    gpu: &Gpu,
    emb: DevPtr,
    tokens: DevPtr,
    x: DevPtr,
    n: usize,
    d: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function(&FAMILY, "embed_rows")?;
    let (ni, di) = (i32_arg("tokens", n)?, i32_arg("hidden size", d)?);
    let grid = row_grid(n, d)?;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&emb).arg(&tokens).arg(&x).arg(&ni).arg(&di);
    unsafe { b.launch(grid_cfg(grid, 256, 0)) }.during("launching embed_rows")?;
    Ok(())
}

/// Row-wise RMSNorm of `n` rows of `d` (f32 out), L2 asked for `prefetch` first (the next
/// product's weights in a batched decode pass, see [`L2Span`]).
pub fn rmsnorm_rows(
    gpu: &Gpu,
    x: DevPtr,
    w: DevPtr,
    out: DevPtr,
    n: usize,
    d: usize,
    eps: f32,
    prefetch: L2Span,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function(&FAMILY, "rmsnorm_rows")?;
    let (pf, pf_bytes) = prefetch.args();
    let di = i32_arg("hidden size", d)?;
    let rows = u32::try_from(n)
        .ok()
        .filter(|&r| r <= i32::MAX as u32)
        .ok_or_else(|| CudaError::Unsupported(format!("{n} rows in one launch")))?;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&x)
        .arg(&w)
        .arg(&out)
        .arg(&di)
        .arg(&eps)
        .arg(&pf)
        .arg(&pf_bytes);
    unsafe { b.launch(grid_cfg((rows, 1), 256, 0)) }.during("launching rmsnorm_rows")?;
    Ok(())
}

/// `out[i][j] = f16(mask_t(x[i * ldx + j]))` for `n` rows of `k`.
pub fn rows_to_f16(
    gpu: &Gpu,
    x: DevPtr,
    ldx: usize,
    out: DevPtr,
    n: usize,
    k: usize,
    t: sieve_formats::Threshold,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function(&FAMILY, "rows_to_f16")?;
    let (l, ni, ki) = (
        i32_arg("row stride", ldx)?,
        i32_arg("tokens", n)?,
        i32_arg("width", k)?,
    );
    let grid = row_grid(n, k)?;
    let tv = threshold_arg(t);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&x).arg(&l).arg(&out).arg(&ni).arg(&ki).arg(&tv);
    unsafe { b.launch(grid_cfg(grid, 256, 0)) }.during("launching rows_to_f16")?;
    Ok(())
}

/// `gate = silu(gate) * up` in place for `n` rows of `gu = [gate | up]`.
pub fn silu_rows(gpu: &Gpu, gu: DevPtr, n: usize, inter: usize, prefetch: L2Span) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function(&FAMILY, "silu_rows")?;
    let (ni, ii) = (i32_arg("tokens", n)?, i32_arg("intermediate size", inter)?);
    let grid = row_grid(n, inter)?;
    let (pf, pf_bytes) = prefetch.args();
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&gu).arg(&ni).arg(&ii).arg(&pf).arg(&pf_bytes);
    unsafe { b.launch(grid_cfg(grid, 256, 0)) }.during("launching silu_rows")?;
    Ok(())
}

/// Zeroes `n` rows of `m` floats, `ldy` apart, at `y` (before a split-K product that adds its
/// parts atomically). Look it up first with [`zero_rows_ready`] where a graph may capture it.
pub fn zero_rows(gpu: &Gpu, y: DevPtr, ldy: usize, n: usize, m: usize) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function(&FAMILY, "zero_rows")?;
    let (ldy_i, ni, mi) = (
        i32_arg("row stride", ldy)?,
        i32_arg("rows", n)?,
        i32_arg("columns", m)?,
    );
    let grid = row_grid(n, m)?;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&y).arg(&ldy_i).arg(&ni).arg(&mi);
    unsafe { b.launch(grid_cfg(grid, 256, 0)) }.during("launching zero_rows")?;
    Ok(())
}

/// Loads [`zero_rows`]'s kernel now (loading a module inside a graph capture invalidates it).
pub fn zero_rows_ready(gpu: &Gpu) -> Result<()> {
    gpu.function(&FAMILY, "zero_rows").map(|_| ())
}
