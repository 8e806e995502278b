//! The batched prefill's kernels besides the GEMMs, RoPE ([`crate::rope::rope_rows`]) and
//! attention ([`crate::attention::attention_batch`]): `n` prompt tokens at once, row-wise
//! (`kernels/prefill.cu`).

use crate::error::{DriverContext, Result};
use crate::gpu::{grid_cfg, grid_stride, i32_arg, Gpu, KernelFamily};
use crate::product::{threshold_arg, DevPtr};
use cudarc::driver::PushKernelArg;

pub const FAMILY: KernelFamily = KernelFamily {
    name: "prefill",
    source: include_str!("../kernels/prefill.cu"),
};

/// `x[i] = embedding[tokens[i]]` for `n` tokens (`tokens` i32 on the device, checked by the caller).
pub fn embed_rows(
    gpu: &Gpu,
    emb: DevPtr,
    tokens: DevPtr,
    x: DevPtr,
    n: usize,
    d: usize,
) -> Result<()> {
    let f = gpu.function(&FAMILY, "embed_rows")?;
    let (ni, di) = (i32_arg("tokens", n)?, i32_arg("hidden size", d)?);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&emb).arg(&tokens).arg(&x).arg(&ni).arg(&di);
    unsafe { b.launch(grid_cfg(grid_stride(n * d), 256, 0)) }.during("launching embed_rows")?;
    Ok(())
}

/// Row-wise RMSNorm of `n` rows of `d` (f32 out).
pub fn rmsnorm_rows(
    gpu: &Gpu,
    x: DevPtr,
    w: DevPtr,
    out: DevPtr,
    n: usize,
    d: usize,
    eps: f32,
) -> Result<()> {
    let f = gpu.function(&FAMILY, "rmsnorm_rows")?;
    let di = i32_arg("hidden size", d)?;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&x).arg(&w).arg(&out).arg(&di).arg(&eps);
    unsafe { b.launch(grid_cfg((n as u32, 1), 256, 0)) }.during("launching rmsnorm_rows")?;
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
    let f = gpu.function(&FAMILY, "rows_to_f16")?;
    let (l, ni, ki) = (
        i32_arg("row stride", ldx)?,
        i32_arg("tokens", n)?,
        i32_arg("width", k)?,
    );
    let tv = threshold_arg(t);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&x).arg(&l).arg(&out).arg(&ni).arg(&ki).arg(&tv);
    unsafe { b.launch(grid_cfg(grid_stride(n * k), 256, 0)) }.during("launching rows_to_f16")?;
    Ok(())
}

/// `gate = silu(gate) * up` in place for `n` rows of `gu = [gate | up]`.
pub fn silu_rows(gpu: &Gpu, gu: DevPtr, n: usize, inter: usize) -> Result<()> {
    let f = gpu.function(&FAMILY, "silu_rows")?;
    let (ni, ii) = (i32_arg("tokens", n)?, i32_arg("intermediate size", inter)?);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&gu).arg(&ni).arg(&ii);
    unsafe { b.launch(grid_cfg(grid_stride(n * inter), 256, 0)) }.during("launching silu_rows")?;
    Ok(())
}
