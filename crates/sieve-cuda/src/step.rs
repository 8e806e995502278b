//! The decode step's kernels besides the products, RoPE ([`crate::rope`]) and attention
//! ([`crate::attention`]): embedding gather, RMSNorm that zeroes the next product's output,
//! SwiGLU and the teacher-forced advance (`kernels/step.cu`), with their CPU references.
//!
//! Like every launcher of the model kernels (`step`, `rope`, `attention`, `sampling`,
//! `prefill`), these take raw device addresses ([`DevPtr`]) so that the runner can point into
//! parts of its buffers (one layer's slice of the KV cache, the q rows of q|k|v) and capture the
//! launch in a graph; position and token come from the step state in device memory.

use crate::error::{DriverContext, Result};
use crate::gpu::{grid_cfg, i32_arg, Gpu, KernelFamily};
use crate::product::{DevPtr, L2Span};
use cudarc::driver::PushKernelArg;

pub const FAMILY: KernelFamily = KernelFamily {
    name: "step",
    source: include_str!("../kernels/step.cu"),
};

/// `x = embedding[state[1]]` (f16 rows of width `d`).
pub fn embed_token(
    gpu: &Gpu,
    emb: DevPtr,
    state: DevPtr,
    x: DevPtr,
    d: usize,
    vocab: usize,
) -> Result<()> {
    let f = gpu.function(&FAMILY, "embed_token")?;
    let (d, v) = (i32_arg("hidden size", d)?, i32_arg("vocabulary", vocab)?);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&emb).arg(&state).arg(&x).arg(&d).arg(&v);
    unsafe { b.launch(grid_cfg(((d as u32).div_ceil(256), 1), 256, 0)) }
        .during("launching embed_token")?;
    Ok(())
}

/// Blocks of [`rmsnorm_zero`]: enough to spread the zeroing, few enough that the repeated
/// sum of squares stays cheap.
fn norm_blocks(d: usize, zero_len: usize) -> u32 {
    (d.max(zero_len).div_ceil(2048) as u32).clamp(1, 64)
}

/// `out = x / rms(x) * w` and `zero[..zero_len] = 0` in one launch (`zero` may be 0); L2 is
/// asked for `prefetch` first (the next product's weights, or [`L2Span::NONE`]).
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_zero(
    gpu: &Gpu,
    x: DevPtr,
    w: DevPtr,
    out: DevPtr,
    d: usize,
    eps: f32,
    zero: DevPtr,
    zero_len: usize,
    prefetch: L2Span,
) -> Result<()> {
    let f = gpu.function(&FAMILY, "rmsnorm_zero")?;
    // More blocks only repeat the sum of squares (each writes a shorter slice).
    let blocks = norm_blocks(d, zero_len).max(prefetch.min_blocks(gpu));
    let (di, zl) = (
        i32_arg("hidden size", d)?,
        i32_arg("zeroed length", zero_len)?,
    );
    let (pf, pf_bytes) = prefetch.args();
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&x)
        .arg(&w)
        .arg(&out)
        .arg(&di)
        .arg(&eps)
        .arg(&zero)
        .arg(&zl)
        .arg(&pf)
        .arg(&pf_bytes);
    unsafe { b.launch(grid_cfg((blocks, 1), 256, 0)) }.during("launching rmsnorm_zero")?;
    Ok(())
}

/// `h = silu(gu[..I]) * gu[I..]`, L2 asked for `prefetch` first.
pub fn silu_mul(gpu: &Gpu, gu: DevPtr, h: DevPtr, inter: usize, prefetch: L2Span) -> Result<()> {
    let f = gpu.function(&FAMILY, "silu_mul")?;
    let i = i32_arg("intermediate size", inter)?;
    let (pf, pf_bytes) = prefetch.args();
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&gu).arg(&h).arg(&i).arg(&pf).arg(&pf_bytes);
    let blocks = (inter as u32).div_ceil(256).max(prefetch.min_blocks(gpu));
    unsafe { b.launch(grid_cfg((blocks, 1), 256, 0)) }.during("launching silu_mul")?;
    Ok(())
}

/// `state = (p + 1, history[p + 1])`: the step after a prompt token.
pub fn advance_forced(gpu: &Gpu, state: DevPtr, history: DevPtr, capacity: usize) -> Result<()> {
    let f = gpu.function(&FAMILY, "advance_forced")?;
    let c = i32_arg("context", capacity)?;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&state).arg(&history).arg(&c);
    unsafe { b.launch(grid_cfg((1, 1), 32, 0)) }.during("launching advance_forced")?;
    Ok(())
}

/// CPU references of the kernels above (f32).
pub mod reference {
    pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
        let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
        let scale = 1.0 / (ms + eps).sqrt();
        x.iter().zip(w).map(|(v, w)| v * scale * w).collect()
    }

    pub fn silu_mul(gu: &[f32]) -> Vec<f32> {
        let i = gu.len() / 2;
        (0..i)
            .map(|j| gu[j] / (1.0 + (-gu[j]).exp()) * gu[i + j])
            .collect()
    }
}
