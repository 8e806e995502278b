//! Launchers of the runner's own kernels (`kernels/step.cu`, `attention.cu`, `sampling.cu`),
//! each next to the CPU reference its GPU test compares it with. Every launcher takes raw
//! device addresses ([`DevPtr`]) so that the runner can point into parts of its buffers
//! (one layer's slice of the KV cache, the q rows of q|k|v) and capture the launch in a graph.

use crate::error::{GpuError, Result};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use sieve_cuda::gpu::KernelFamily;
use sieve_cuda::{DevPtr, DriverContext, Gpu};

pub const STEP: KernelFamily = KernelFamily {
    name: "runner_step",
    source: include_str!("../kernels/step.cu"),
};
pub const ATTENTION: KernelFamily = KernelFamily {
    name: "runner_attention",
    source: include_str!("../kernels/attention.cu"),
};
pub const SAMPLING: KernelFamily = KernelFamily {
    name: "runner_sampling",
    source: include_str!("../kernels/sampling.cu"),
};

pub const PREFILL: KernelFamily = KernelFamily {
    name: "runner_prefill",
    source: include_str!("../kernels/prefill.cu"),
};

/// Every kernel family of the runner (for compile checks).
pub fn families() -> [KernelFamily; 4] {
    [STEP, ATTENTION, SAMPLING, PREFILL]
}

/// Attention kernel limits (see `attention.cu`).
pub const MAX_HEAD_DIM: usize = 256;
pub const MAX_GROUP: usize = 8;
const ATT_THREADS: usize = 128;
const ATT_WARPS: usize = 4;
const ATT_LOADS: usize = 8;

fn cfg(grid: (u32, u32), block: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0.max(1), grid.1.max(1), 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: shared,
    }
}

fn i32_arg(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| GpuError::Unsupported(format!("{what} {v} exceeds 32 bits")))
}

/// `x = embedding[state[1]]` (f16 rows of width `d`).
pub fn embed_token(
    gpu: &Gpu,
    emb: DevPtr,
    state: DevPtr,
    x: DevPtr,
    d: usize,
    vocab: usize,
) -> Result<()> {
    let f = gpu.function(&STEP, "embed_token")?;
    let (d, v) = (i32_arg("hidden size", d)?, i32_arg("vocabulary", vocab)?);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&emb).arg(&state).arg(&x).arg(&d).arg(&v);
    unsafe { b.launch(cfg(((d as u32).div_ceil(256), 1), 256, 0)) }
        .during("launching embed_token")?;
    Ok(())
}

/// Blocks of [`rmsnorm_zero`]: enough to spread the zeroing, few enough that the repeated
/// sum of squares stays cheap.
fn norm_blocks(d: usize, zero_len: usize) -> u32 {
    (d.max(zero_len).div_ceil(2048) as u32).clamp(1, 64)
}

/// `out = x / rms(x) * w` and `zero[..zero_len] = 0` in one launch (`zero` may be 0).
pub fn rmsnorm_zero(
    gpu: &Gpu,
    x: DevPtr,
    w: DevPtr,
    out: DevPtr,
    d: usize,
    eps: f32,
    zero: DevPtr,
    zero_len: usize,
) -> Result<()> {
    let f = gpu.function(&STEP, "rmsnorm_zero")?;
    let blocks = norm_blocks(d, zero_len);
    let (di, zl) = (
        i32_arg("hidden size", d)?,
        i32_arg("zeroed length", zero_len)?,
    );
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&x)
        .arg(&w)
        .arg(&out)
        .arg(&di)
        .arg(&eps)
        .arg(&zero)
        .arg(&zl);
    unsafe { b.launch(cfg((blocks, 1), 256, 0)) }.during("launching rmsnorm_zero")?;
    Ok(())
}

/// RoPE over the q and k heads of `qkv` at position `state[0]` (biases added first when
/// `bias` is non-zero), rotated k and v written to the layer's caches.
#[allow(clippy::too_many_arguments)]
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
    let f = gpu.function(&STEP, "rope_kv")?;
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
    unsafe { b.launch(cfg(((heads + kv_heads) as u32, 1), 128, 0)) }.during("launching rope_kv")?;
    Ok(())
}

/// `h = silu(gu[..I]) * gu[I..]`.
pub fn silu_mul(gpu: &Gpu, gu: DevPtr, h: DevPtr, inter: usize) -> Result<()> {
    let f = gpu.function(&STEP, "silu_mul")?;
    let i = i32_arg("intermediate size", inter)?;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&gu).arg(&h).arg(&i);
    unsafe { b.launch(cfg(((inter as u32).div_ceil(256), 1), 256, 0)) }
        .during("launching silu_mul")?;
    Ok(())
}

/// The attention shape of a model, checked against the kernel's limits.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Sequence splits of the flash-decoding grid (fixed when a step is captured).
    pub splits: usize,
}

impl AttentionShape {
    /// Splits so that `kv_heads x splits` blocks fill the GPU about four times over (a
    /// block keeps only 16 KB of cache reads in flight), but never more splits than
    /// 64-position pieces of the context.
    pub fn new(
        gpu: &Gpu,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        context: usize,
    ) -> Result<Self> {
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) || heads / kv_heads > MAX_GROUP {
            return Err(GpuError::Unsupported(format!(
                "attention with {heads} query heads over {kv_heads} KV heads: the GPU kernel needs a whole group of at most {MAX_GROUP} query heads per KV head"
            )));
        }
        if head_dim == 0 || head_dim > MAX_HEAD_DIM || !head_dim.is_multiple_of(8) {
            return Err(GpuError::Unsupported(format!(
                "head dimension {head_dim}: the GPU attention kernel needs a multiple of 8 up to {MAX_HEAD_DIM}"
            )));
        }
        let sms = gpu.info().multiprocessors as usize;
        let splits = (4 * sms)
            .div_ceil(kv_heads)
            .clamp(1, context.div_ceil(64).max(1));
        Ok(Self {
            heads,
            kv_heads,
            head_dim,
            splits,
        })
    }
    /// f32 entries of the split partials buffer.
    pub fn partials_len(&self) -> usize {
        self.heads * self.splits * (self.head_dim + 2)
    }
    /// The compiled group size (1, 2, 4 or 8) that covers this shape's group.
    fn kernel_group(&self) -> usize {
        (self.heads / self.kv_heads).next_power_of_two()
    }
    /// Dynamic shared memory of `attention_split_g<G>` in bytes: the tile's scores
    /// `[G][TILE]`, reused after the loop for the reduction `[RB][G][hd]` (see `attention.cu`).
    fn split_shared_bytes(&self) -> usize {
        let lanes_per_row = (self.head_dim / 8).next_power_of_two();
        let rows_per_step = ATT_WARPS * (32 / lanes_per_row);
        let tile = ATT_LOADS * rows_per_step;
        let g = self.kernel_group();
        4 * (g * tile).max(rows_per_step * g * self.head_dim)
    }
}

/// Attention of the token at `state[0]` over cache positions `0..=state[0]`: q from `qkv`,
/// output `att` (`[H][hd]` f32), `part` scratch of [`AttentionShape::partials_len`].
pub fn attention(
    gpu: &Gpu,
    shape: &AttentionShape,
    qkv: DevPtr,
    k_cache: DevPtr,
    v_cache: DevPtr,
    state: DevPtr,
    part: DevPtr,
    att: DevPtr,
) -> Result<()> {
    attention_batch(gpu, shape, qkv, k_cache, v_cache, state, part, att, 0, 1)
}

/// Causal attention of `queries` consecutive tokens, the first at position `first_len - 1`
/// (`first_len == 0`: one decode query at `state[0]`); q rows are `(H + 2 Hkv) hd` apart in
/// `qkv`, outputs `[queries][H][hd]`, `part` holds `queries` partial sets.
#[allow(clippy::too_many_arguments)]
pub fn attention_batch(
    gpu: &Gpu,
    shape: &AttentionShape,
    qkv: DevPtr,
    k_cache: DevPtr,
    v_cache: DevPtr,
    state: DevPtr,
    part: DevPtr,
    att: DevPtr,
    first_len: usize,
    queries: usize,
) -> Result<()> {
    let shared = shape.split_shared_bytes() as u32;
    let name = format!("attention_split_g{}", shape.kernel_group());
    let f = gpu.function(&ATTENTION, &name)?;
    gpu.allow_dynamic_shared(&f, shared as usize)?;
    let (h, hkv, hd) = (
        shape.heads as i32,
        shape.kv_heads as i32,
        shape.head_dim as i32,
    );
    let scale = 1.0f32 / (shape.head_dim as f32).sqrt();
    let len0 = i32_arg("prompt position", first_len)?;
    let q_stride = ((shape.heads + 2 * shape.kv_heads) * shape.head_dim) as i32;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&qkv)
        .arg(&k_cache)
        .arg(&v_cache)
        .arg(&state)
        .arg(&part)
        .arg(&h)
        .arg(&hkv)
        .arg(&hd)
        .arg(&scale)
        .arg(&len0)
        .arg(&q_stride);
    let mut c = cfg(
        (shape.kv_heads as u32, shape.splits as u32),
        ATT_THREADS as u32,
        shared,
    );
    c.grid_dim.2 = queries.max(1) as u32;
    unsafe { b.launch(c) }.during("launching attention_split")?;
    let f = gpu.function(&ATTENTION, "attention_combine")?;
    let s = shape.splits as i32;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&part).arg(&att).arg(&s).arg(&hd);
    unsafe { b.launch(cfg((shape.heads as u32, queries.max(1) as u32), 128, 0)) }
        .during("launching attention_combine")?;
    Ok(())
}

/// Sampling parameters as the kernel takes them (validated by `SamplingParams::validate`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleArgs {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub repetition_penalty: f32,
    pub window: usize,
    pub seed: u64,
}

impl SampleArgs {
    pub fn from_params(p: &sieve_model::sampling::SamplingParams) -> Self {
        Self {
            temperature: if p.is_greedy() { 0.0 } else { p.temperature },
            top_k: p.top_k,
            top_p: p.top_p,
            repetition_penalty: p.repetition_penalty,
            window: sieve_model::generate::REPETITION_WINDOW,
            seed: p.seed,
        }
    }
    pub fn greedy() -> Self {
        Self::from_params(&sieve_model::sampling::SamplingParams::greedy())
    }
}

/// Picks the next token from `logits` (V f32, modified in place by the penalty), writes it to
/// `history[state[0] + 1]` and `state[1]`, and advances `state[0]` (see `sampling.cu`).
#[allow(clippy::too_many_arguments)]
pub fn sample_token(
    gpu: &Gpu,
    logits: DevPtr,
    vocab: usize,
    args: &SampleArgs,
    state: DevPtr,
    history: DevPtr,
    capacity: usize,
) -> Result<()> {
    let f = gpu.function(&SAMPLING, "sample_token")?;
    let v = i32_arg("vocabulary", vocab)?;
    let (k, w, c) = (
        i32_arg("top-k", args.top_k)?,
        i32_arg("penalty window", args.window.min(1024))?,
        i32_arg("context", capacity)?,
    );
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&logits)
        .arg(&v)
        .arg(&args.temperature)
        .arg(&k)
        .arg(&args.top_p)
        .arg(&args.repetition_penalty)
        .arg(&w)
        .arg(&args.seed)
        .arg(&state)
        .arg(&history)
        .arg(&c);
    unsafe { b.launch(cfg((1, 1), 1024, 0)) }.during("launching sample_token")?;
    Ok(())
}

fn grid_stride(total: usize) -> (u32, u32) {
    ((total.div_ceil(256) as u32).clamp(1, 65535), 1)
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
    let f = gpu.function(&PREFILL, "embed_rows")?;
    let (ni, di) = (i32_arg("tokens", n)?, i32_arg("hidden size", d)?);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&emb).arg(&tokens).arg(&x).arg(&ni).arg(&di);
    unsafe { b.launch(cfg(grid_stride(n * d), 256, 0)) }.during("launching embed_rows")?;
    Ok(())
}

/// Row-wise RMSNorm of `n` rows of `d` (f32 out).
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_rows(
    gpu: &Gpu,
    x: DevPtr,
    w: DevPtr,
    out: DevPtr,
    n: usize,
    d: usize,
    eps: f32,
) -> Result<()> {
    let f = gpu.function(&PREFILL, "rmsnorm_rows")?;
    let di = i32_arg("hidden size", d)?;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&x).arg(&w).arg(&out).arg(&di).arg(&eps);
    unsafe { b.launch(cfg((n as u32, 1), 256, 0)) }.during("launching rmsnorm_rows")?;
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
    let f = gpu.function(&PREFILL, "rows_to_f16")?;
    let (l, ni, ki) = (
        i32_arg("row stride", ldx)?,
        i32_arg("tokens", n)?,
        i32_arg("width", k)?,
    );
    let tv = sieve_cuda::product::threshold_arg(t);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&x).arg(&l).arg(&out).arg(&ni).arg(&ki).arg(&tv);
    unsafe { b.launch(cfg(grid_stride(n * k), 256, 0)) }.during("launching rows_to_f16")?;
    Ok(())
}

/// `gate = silu(gate) * up` in place for `n` rows of `gu = [gate | up]`.
pub fn silu_rows(gpu: &Gpu, gu: DevPtr, n: usize, inter: usize) -> Result<()> {
    let f = gpu.function(&PREFILL, "silu_rows")?;
    let (ni, ii) = (i32_arg("tokens", n)?, i32_arg("intermediate size", inter)?);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&gu).arg(&ni).arg(&ii);
    unsafe { b.launch(cfg(grid_stride(n * inter), 256, 0)) }.during("launching silu_rows")?;
    Ok(())
}

/// [`rope_kv`] for `n` rows of q|k|v at positions `p0 ..`.
#[allow(clippy::too_many_arguments)]
pub fn rope_rows(
    gpu: &Gpu,
    qkv: DevPtr,
    bias: DevPtr,
    cos: DevPtr,
    sin: DevPtr,
    p0: usize,
    n: usize,
    k_cache: DevPtr,
    v_cache: DevPtr,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<()> {
    let f = gpu.function(&PREFILL, "rope_rows")?;
    let p = i32_arg("position", p0)?;
    let (h, hkv, hd) = (heads as i32, kv_heads as i32, head_dim as i32);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&qkv)
        .arg(&bias)
        .arg(&cos)
        .arg(&sin)
        .arg(&p)
        .arg(&k_cache)
        .arg(&v_cache)
        .arg(&h)
        .arg(&hkv)
        .arg(&hd);
    unsafe { b.launch(cfg(((heads + kv_heads) as u32, n as u32), 128, 0)) }
        .during("launching rope_rows")?;
    Ok(())
}

/// CPU references of the kernels above, in the layouts the kernels use (f32 everywhere, the
/// KV cache as f32 values already rounded through f16 as the kernels store them).
pub mod reference {
    use half::f16;

    pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
        let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
        let scale = 1.0 / (ms + eps).sqrt();
        x.iter().zip(w).map(|(v, w)| v * scale * w).collect()
    }

    /// Rotates `row` (one head) in place with the half-split convention.
    pub fn rope(row: &mut [f32], cos: &[f32], sin: &[f32]) {
        let half = row.len() / 2;
        for i in 0..half {
            let (a, b) = (row[i], row[i + half]);
            row[i] = a * cos[i] - b * sin[i];
            row[i + half] = b * cos[i] + a * sin[i];
        }
    }

    pub fn round_f16(v: f32) -> f32 {
        f16::from_f32(v).to_f32()
    }

    /// Attention of `q` (`[H][hd]`) over `len` cached positions (`k`, `v`: `[pos][Hkv][hd]`).
    pub fn attention(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        len: usize,
        heads: usize,
        kv_heads: usize,
        hd: usize,
    ) -> Vec<f32> {
        let g = heads / kv_heads;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut out = vec![0f32; heads * hd];
        for h in 0..heads {
            let kvh = h / g;
            let qh = &q[h * hd..(h + 1) * hd];
            let scores: Vec<f64> = (0..len)
                .map(|p| {
                    let kr = &k[(p * kv_heads + kvh) * hd..][..hd];
                    qh.iter()
                        .zip(kr)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hd {
                let mut a = 0.0;
                for p in 0..len {
                    a += e[p] * v[(p * kv_heads + kvh) * hd + d] as f64;
                }
                out[h * hd + d] = (a / z) as f32;
            }
        }
        out
    }

    pub fn silu_mul(gu: &[f32]) -> Vec<f32> {
        let i = gu.len() / 2;
        (0..i)
            .map(|j| gu[j] / (1.0 + (-gu[j]).exp()) * gu[i + j])
            .collect()
    }
}

/// `state = (p + 1, history[p + 1])`: the step after a prompt token.
pub fn advance_forced(gpu: &Gpu, state: DevPtr, history: DevPtr, capacity: usize) -> Result<()> {
    let f = gpu.function(&STEP, "advance_forced")?;
    let c = i32_arg("context", capacity)?;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&state).arg(&history).arg(&c);
    unsafe { b.launch(cfg((1, 1), 32, 0)) }.during("launching advance_forced")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    /// Compiles the runner's kernel families with NVRTC where the library is present (no GPU
    /// needed), printing ptxas's register/spill report.
    #[test]
    fn kernels_compile_for_sm90a() {
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("kernels_compile_for_sm90a: skipped, no libnvrtc");
            return;
        }
        for fam in super::families() {
            match sieve_cuda::gpu::compile_check(&fam, "sm_90a") {
                Ok((size, log)) => {
                    assert!(size > 0);
                    eprintln!("{}: {size} bytes\n{log}", fam.name);
                }
                Err(e) => panic!("{e}"),
            }
        }
    }
}
