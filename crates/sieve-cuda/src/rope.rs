//! RoPE with the f16 KV-cache write (`kernels/rope.cu`): [`rope_kv`] for the decode step's
//! token, [`rope_rows`] for a batched pass (a prompt chunk, or a decode step of many sequences), one device function under both; with the CPU
//! reference of the rotation.

use crate::error::{DriverContext, Result};
use crate::gpu::{grid_cfg, Gpu, KernelFamily};
use crate::prefill::Rows;
use crate::product::DevPtr;
use cudarc::driver::PushKernelArg;

pub const FAMILY: KernelFamily = KernelFamily {
    name: "rope",
    source: include_str!("../kernels/rope.cu"),
};

/// RoPE over the q and k heads of `qkv` at position `state[0]` (biases added first when
/// `bias` is non-zero), rotated k and v written to the layer's caches.
pub fn rope_kv(
    gpu: &Gpu,
    qkv: DevPtr,
    bias: DevPtr,
    cos: DevPtr,
    sin: DevPtr,
    state: DevPtr,
    k_cache: DevPtr,
    v_cache: DevPtr,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<()> {
    let f = gpu.function(&FAMILY, "rope_kv")?;
    let (h, hkv, hd) = (heads as i32, kv_heads as i32, head_dim as i32);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&qkv)
        .arg(&bias)
        .arg(&cos)
        .arg(&sin)
        .arg(&state)
        .arg(&k_cache)
        .arg(&v_cache)
        .arg(&h)
        .arg(&hkv)
        .arg(&hd);
    unsafe { b.launch(grid_cfg(((heads + kv_heads) as u32, 1), 128, 0)) }
        .during("launching rope_kv")?;
    Ok(())
}

/// [`rope_kv`] for `n` rows of q|k|v: consecutive positions of one sequence, or one token of
/// each of `n` sequences at their own slots and positions (see [`Rows`]).
#[allow(clippy::too_many_arguments)]
pub fn rope_rows(
    gpu: &Gpu,
    qkv: DevPtr,
    bias: DevPtr,
    cos: DevPtr,
    sin: DevPtr,
    rows: &Rows,
    n: usize,
    k_cache: DevPtr,
    v_cache: DevPtr,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<()> {
    let f = gpu.function(&FAMILY, "rope_rows")?;
    let (p0, seqs, slot_stride) = rows.kernel_args()?;
    let (h, hkv, hd) = (heads as i32, kv_heads as i32, head_dim as i32);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&qkv)
        .arg(&bias)
        .arg(&cos)
        .arg(&sin)
        .arg(&p0)
        .arg(&seqs)
        .arg(&slot_stride)
        .arg(&k_cache)
        .arg(&v_cache)
        .arg(&h)
        .arg(&hkv)
        .arg(&hd);
    unsafe { b.launch(grid_cfg(((heads + kv_heads) as u32, n as u32), 128, 0)) }
        .during("launching rope_rows")?;
    Ok(())
}

/// CPU references in the layouts the kernels use (f32, the KV cache as f32 values already
/// rounded through f16 as the kernels store them).
pub mod reference {
    use half::f16;

    /// Rotates `row` (one head) in place with the half-split convention.
    pub fn rope(row: &mut [f32], cos: &[f32], sin: &[f32]) {
        let half = row.len() / 2;
        for i in 0..half {
            let (a, b) = (row[i], row[i + half]);
            row[i] = a * cos[i] - b * sin[i];
            row[i + half] = b * cos[i] + a * sin[i];
        }
    }

    /// `v` as the cache stores it (rounded through f16).
    pub fn round_f16(v: f32) -> f32 {
        f16::from_f32(v).to_f32()
    }
}
