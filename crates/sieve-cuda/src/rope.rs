//! RoPE with the KV-cache write (`kernels/rope.cu`): [`rope_kv`] for the decode step's
//! token, [`rope_rows`] for a batched pass (a prompt chunk, or a decode step of many sequences), one device function under both; with the CPU
//! reference of the rotation. The cache is f16, or i8 rows with one scale per (position, KV
//! head) quantized as they are written ([`KvCache`]).

use crate::error::{CudaError, DriverContext, Result};
use crate::gpu::{grid_cfg, Gpu, KernelFamily};
use crate::kv_cache::KvCache;
use crate::prefill::Rows;
use crate::product::{DevPtr, L2Span};
use cudarc::driver::{LaunchArgs, PushKernelArg};

pub const FAMILY: KernelFamily = KernelFamily {
    name: "rope",
    source: include_str!("../kernels/rope.cu"),
};

/// Threads of a rope block (`ROPE_THREADS` in `rope.cu`).
const ROPE_THREADS: usize = 128;
/// Threads of a block of the f16 `rope_rows` (`ROPE_ROW_THREADS`), one rotated pair each.
const ROPE_ROW_THREADS: usize = 256;

/// The kernel's name for `cache` (`base` or `base_i8`); refuses a head dimension the 8-bit
/// write cannot take (one rotated pair per thread of a block).
fn kernel_name(base: &str, cache: &KvCache, head_dim: usize) -> Result<String> {
    Ok(match cache {
        KvCache::F16 { .. } => base.to_string(),
        KvCache::Int8 { .. } => {
            if head_dim == 0 || !head_dim.is_multiple_of(2) || head_dim > 2 * ROPE_THREADS {
                return Err(CudaError::Unsupported(format!(
                    "head dimension {head_dim}: the 8-bit KV cache write needs an even one up to {}",
                    2 * ROPE_THREADS
                )));
            }
            format!("{base}_i8")
        }
    })
}

/// Pushes the cache's buffers in the kernels' order: `k, v` (and `k_scales, v_scales`).
fn push_cache<'a>(b: &mut LaunchArgs<'a>, cache: &'a KvCache) {
    match cache {
        KvCache::F16 { k, v } => {
            b.arg(k).arg(v);
        }
        KvCache::Int8 {
            k,
            v,
            k_scales,
            v_scales,
        } => {
            b.arg(k).arg(v).arg(k_scales).arg(v_scales);
        }
    }
}

/// RoPE over the q and k heads of `qkv` at position `state[0]` (biases added first when
/// `bias` is non-zero), rotated k and v written to the layer's caches; L2 is asked for
/// `prefetch` first (the o product's weights in the decode step, or [`L2Span::NONE`]).
#[allow(clippy::too_many_arguments)]
pub fn rope_kv(
    gpu: &Gpu,
    qkv: DevPtr,
    bias: DevPtr,
    cos: DevPtr,
    sin: DevPtr,
    state: DevPtr,
    cache: KvCache,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    prefetch: L2Span,
) -> Result<()> {
    let f = gpu.function(&FAMILY, &kernel_name("rope_kv", &cache, head_dim)?)?;
    let (h, hkv, hd) = (heads as i32, kv_heads as i32, head_dim as i32);
    let (pf, pf_bytes) = prefetch.args();
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&qkv).arg(&bias).arg(&cos).arg(&sin).arg(&state);
    push_cache(&mut b, &cache);
    b.arg(&h).arg(&hkv).arg(&hd).arg(&pf).arg(&pf_bytes);
    // Blocks past H + Hkv only prefetch.
    let blocks = ((heads + kv_heads) as u32).max(prefetch.min_blocks(gpu));
    unsafe { b.launch(grid_cfg((blocks, 1), ROPE_THREADS as u32, 0)) }
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
    cache: KvCache,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    prefetch: L2Span,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function(&FAMILY, &kernel_name("rope_rows", &cache, head_dim)?)?;
    let (pf, pf_bytes) = prefetch.args();
    let (p0, seqs, slot_stride) = rows.kernel_args()?;
    let (h, hkv, hd) = (heads as i32, kv_heads as i32, head_dim as i32);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&qkv)
        .arg(&bias)
        .arg(&cos)
        .arg(&sin)
        .arg(&p0)
        .arg(&seqs)
        .arg(&slot_stride);
    push_cache(&mut b, &cache);
    b.arg(&h).arg(&hkv).arg(&hd).arg(&pf).arg(&pf_bytes);
    // The f16 kernel: one rotate-half pair per thread across heads; the 8-bit one: a block per
    // head (its row's largest |x| is a block reduction).
    let (grid_x, threads) = match cache {
        KvCache::F16 { .. } => (
            ((heads + kv_heads) * (head_dim / 2)).div_ceil(ROPE_ROW_THREADS),
            ROPE_ROW_THREADS,
        ),
        KvCache::Int8 { .. } => (heads + kv_heads, ROPE_THREADS),
    };
    unsafe { b.launch(grid_cfg((grid_x as u32, n as u32), threads as u32, 0)) }
        .during("launching rope_rows")?;
    Ok(())
}

/// CPU references in the layouts the kernels use (f32, the KV cache as f32 values already
/// rounded through f16 as the kernels store them; the 8-bit cache's rows are
/// [`sieve_formats::kv_cache::quantize_row`]'s, see [`crate::attention::reference`]).
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
