//! Grouped-query attention of one decode token (or of a prefill batch's tokens, causally, or of
//! one token of each of a batch's sequences) over
//! the KV cache (f16, or i8 rows with one scale per (position, KV head): [`KvCache`]),
//! flash-decoding: split along the sequence, then combined (`kernels/attention.cu`); with the
//! f64 CPU reference. Prompt chunks of 16 rows or more go to the tensor-core kernel of
//! [`crate::prompt_attention`].

use crate::error::{CudaError, DriverContext, Result};
use crate::gpu::{grid_cfg, i32_arg, Gpu, KernelFamily};
use crate::kv_cache::KvCache;
use crate::prefill::Rows;
use crate::product::{DevPtr, L2Span};
use crate::prompt_attention;
use cudarc::driver::PushKernelArg;

pub const FAMILY: KernelFamily = KernelFamily {
    name: "attention",
    source: include_str!("../kernels/attention.cu"),
};

/// The warp split kernel ([`SplitKernel::Warp`]): `attention_warp.cu` after `attention.cu`,
/// compiled on first use only, apart from the kernels every model runs (not in
/// [`crate::gpu::families`]).
pub const WARP_FAMILY: KernelFamily = KernelFamily {
    name: "attention_warp",
    source: concat!(
        include_str!("../kernels/attention.cu"),
        include_str!("../kernels/attention_warp.cu")
    ),
};

/// Attention kernel limits (see `attention.cu`).
pub const MAX_HEAD_DIM: usize = 256;
pub const MAX_GROUP: usize = 8;
const ATT_THREADS: usize = 128;
const ATT_WARPS: usize = 4;
const ATT_LOADS: usize = 8;

/// Which flash-decoding split kernel runs (`kernels/attention.cu`): both write the same
/// partials for the same grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitKernel {
    /// `attention_split_g<G>`: the block's warps share each tile's scores and softmax in
    /// shared memory (three barriers a tile).
    Block,
    /// `attention_split_warp_g<G>`: each warp keeps its own running softmax in registers,
    /// one barrier to merge the four. The default where each KV head serves one query head
    /// (window O1, H100, Llama-2-7B shape: 1.2% faster step at 4,096 positions, equal at 128);
    /// groups of 2 and 4 pass the same tests but were not timed, so they keep the block kernel.
    Warp,
}

impl SplitKernel {
    /// `SIEVE_ATTENTION_KERNEL=warp|block` (read once; a switch for measuring the two), else
    /// None: [`SplitKernel::default_for`] picks.
    pub fn from_env() -> Result<Option<Self>> {
        static SETTING: std::sync::OnceLock<std::result::Result<Option<SplitKernel>, String>> =
            std::sync::OnceLock::new();
        SETTING
            .get_or_init(|| Self::parse(std::env::var("SIEVE_ATTENTION_KERNEL").ok().as_deref()))
            .clone()
            .map_err(CudaError::Option)
    }

    /// The measured default for `group` query heads per KV head (see [`SplitKernel::Warp`]).
    pub fn default_for(group: usize) -> Self {
        if group == 1 {
            SplitKernel::Warp
        } else {
            SplitKernel::Block
        }
    }

    fn parse(v: Option<&str>) -> std::result::Result<Option<Self>, String> {
        match v {
            None => Ok(None),
            Some("block") => Ok(Some(SplitKernel::Block)),
            Some("warp") => Ok(Some(SplitKernel::Warp)),
            Some(other) => Err(format!(
                "SIEVE_ATTENTION_KERNEL={other}: expected block or warp"
            )),
        }
    }
}

/// The attention shape of a model, checked against the kernel's limits.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Sequence splits of the flash-decoding grid (fixed when a step is captured).
    pub splits: usize,
    /// The split kernel ([`SplitKernel::from_env`], else [`SplitKernel::default_for`] the group;
    /// tests set it).
    pub kernel: SplitKernel,
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
            return Err(CudaError::Unsupported(format!(
                "attention with {heads} query heads over {kv_heads} KV heads: the GPU kernel needs a whole group of at most {MAX_GROUP} query heads per KV head"
            )));
        }
        if head_dim == 0 || head_dim > MAX_HEAD_DIM || !head_dim.is_multiple_of(8) {
            return Err(CudaError::Unsupported(format!(
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
            kernel: SplitKernel::from_env()?
                .unwrap_or_else(|| SplitKernel::default_for(heads / kv_heads)),
        })
    }
    /// f32 entries of the split partials buffer.
    pub fn partials_len(&self) -> usize {
        self.heads * self.splits * (self.head_dim + 2)
    }
    /// The split kernel that runs: [`Self::kernel`], but the block kernel for groups of 8 (the
    /// warp kernel would need ~265 registers there: `attention.cu`).
    pub fn effective_kernel(&self) -> SplitKernel {
        if self.kernel_group() > 4 {
            SplitKernel::Block
        } else {
            self.kernel
        }
    }
    /// The compiled group size (1, 2, 4 or 8) that covers this shape's group.
    fn kernel_group(&self) -> usize {
        (self.heads / self.kv_heads).next_power_of_two()
    }
    /// Dynamic shared memory of the split kernel in bytes: for `attention_split_g<G>` the
    /// tile's scores `[G][TILE]`, reused after the loop for the reduction `[RB][G][hd]`; for
    /// the warp kernel the four warps' partials (see `attention.cu`).
    fn split_shared_bytes(&self) -> usize {
        if self.effective_kernel() == SplitKernel::Warp {
            // Each warp's m, l and acc per head: [ATT_WARPS][G][hd + 2].
            return 4 * ATT_WARPS * self.kernel_group() * (self.head_dim + 2);
        }
        let lanes_per_row = (self.head_dim / 8).next_power_of_two();
        let rows_per_step = ATT_WARPS * (32 / lanes_per_row);
        let tile = ATT_LOADS * rows_per_step;
        let g = self.kernel_group();
        4 * (g * tile).max(rows_per_step * g * self.head_dim)
    }
}

/// Floats of `part` that a batch of up to `max_rows` queries may need through
/// [`attention_rows`]: the most, over every row count, of rows x the splits either kernel
/// takes for it (their position clamps only lower the splits, so they are left out). Large
/// batches take fewer splits, so this is far below `max_rows` x [`AttentionShape::partials_len`].
pub fn rows_partials_len(gpu: &Gpu, shape: &AttentionShape, max_rows: usize) -> usize {
    let sms = gpu.info().multiprocessors as usize;
    let prompt_kernel = prompt_attention::supports(shape.heads, shape.kv_heads, shape.head_dim);
    let most = (1..=max_rows)
        .map(|n| {
            let split = (4 * sms)
                .div_ceil(shape.kv_heads.max(1) * n)
                .clamp(1, shape.splits.max(1));
            let prompt = if prompt_kernel && n >= prompt_attention::MIN_ROWS {
                prompt_attention::splits_for(sms, shape.heads, usize::MAX / 4, n, shape.splits)
            } else {
                1
            };
            n * split.max(prompt)
        })
        .max()
        .unwrap_or(0);
    most * shape.heads * (shape.head_dim + 2)
}

/// Attention of the token at `state[0]` over cache positions `0..=state[0]`: q from `qkv`,
/// output `att` (`[H][hd]` f32), `part` scratch of [`AttentionShape::partials_len`]; L2 is
/// asked for `prefetch` first (in the decode step, the start of the gate|up weights).
#[allow(clippy::too_many_arguments)]
pub fn attention(
    gpu: &Gpu,
    shape: &AttentionShape,
    qkv: DevPtr,
    cache: KvCache,
    state: DevPtr,
    part: DevPtr,
    att: DevPtr,
    prefetch: L2Span,
) -> Result<()> {
    let queries = Queries {
        count: 1,
        len0: 0,
        seqs: 0,
        slot_stride: 0,
        splits: shape.splits,
        prefetch,
    };
    launch(gpu, shape, qkv, cache, state, part, att, queries)
}

/// Attention of `n` query rows of `qkv` (`(H + 2 Hkv) hd` apart), outputs `[n][H][hd]`,
/// `part` holds `n` partial sets. [`Rows::Consecutive`] `{ first }`: a prompt chunk, query `z`
/// at position `first + z` sees keys `0 ..= first + z` (causal); [`Rows::Sequences`]: query
/// `z` is the next token of its own sequence, at its own slot and position (device memory,
/// checked by the caller, so a captured graph replays for any).
///
/// A prompt chunk of at least [`prompt_attention::MIN_ROWS`] rows of a shape the
/// tensor-core kernel supports runs [`prompt_attention::prompt_attention_split`] (partials
/// and the combine only where a few rows see a long context, [`prompt_attention::splits_for`]);
/// everything else runs [`attention_rows_split`].
#[allow(clippy::too_many_arguments)]
pub fn attention_rows(
    gpu: &Gpu,
    shape: &AttentionShape,
    qkv: DevPtr,
    cache: KvCache,
    part: DevPtr,
    att: DevPtr,
    rows: &Rows,
    n: usize,
) -> Result<()> {
    if let Rows::Consecutive { first } = *rows {
        if n >= prompt_attention::MIN_ROWS
            && prompt_attention::supports(shape.heads, shape.kv_heads, shape.head_dim)
        {
            let splits = prompt_attention::splits_for(
                gpu.info().multiprocessors as usize,
                shape.heads,
                first,
                n,
                shape.splits,
            );
            return prompt_attention::prompt_attention_split(
                gpu,
                shape.heads,
                shape.kv_heads,
                shape.head_dim,
                qkv,
                cache,
                part,
                att,
                first,
                n,
                splits,
            );
        }
    }
    attention_rows_split(gpu, shape, qkv, cache, part, att, rows, n)
}

/// [`attention_rows`] through the flash-decoding split kernel and combine, for every kind of
/// rows (the prompt kernel's fallback, and its baseline).
#[allow(clippy::too_many_arguments)]
pub fn attention_rows_split(
    gpu: &Gpu,
    shape: &AttentionShape,
    qkv: DevPtr,
    cache: KvCache,
    part: DevPtr,
    att: DevPtr,
    rows: &Rows,
    n: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let (first, seqs, slot_stride) = rows.kernel_args()?;
    // The kernel's len0 is the first query's key count (0 means "decode, from the state").
    let len0 = match rows {
        Rows::Consecutive { .. } => first
            .checked_add(1)
            .ok_or_else(|| CudaError::Unsupported(format!("prompt position {first}")))?,
        Rows::Sequences { .. } => 0,
    };
    // Splits along the sequence: as many as give the launch about the blocks a single decode
    // query gets (4 per SM), never more than the shape's. Decode's split count is sized for the
    // longest context; a batch of queries already has n times the blocks, and a prompt chunk
    // sees at most first + n keys. (With the shape's splits, 127 prompt queries ran 5.7 ms of
    // nearly empty blocks per 7B prefill at a 4096-position capacity, 16.9 ms at 8192: H200,
    // 2026-12-05.)
    let blocks_per_split = shape.kv_heads * n;
    let mut splits = (4 * gpu.info().multiprocessors as usize)
        .div_ceil(blocks_per_split)
        .clamp(1, shape.splits);
    if let Rows::Consecutive { first } = rows {
        splits = splits.min((first + n).div_ceil(64).max(1));
    }
    let queries = Queries {
        count: n,
        len0,
        seqs,
        slot_stride,
        splits,
        prefetch: L2Span::NONE,
    };
    launch(gpu, shape, qkv, cache, 0, part, att, queries)
}

/// Which queries one launch runs (see `attention.cu`): the decode token at `state[0]`
/// (`len0 == 0`, `seqs == 0`), a prompt's consecutive tokens (`len0 > 0`), or one token of
/// each of `count` sequences (`seqs != 0`).
struct Queries {
    count: usize,
    len0: i32,
    seqs: DevPtr,
    slot_stride: i64,
    /// Splits along the sequence (the grid's y; at most the shape's, for which `part` is sized).
    splits: usize,
    /// Static data the split kernel asks L2 for before it waits ([`L2Span`]).
    prefetch: L2Span,
}

#[allow(clippy::too_many_arguments)]
fn launch(
    gpu: &Gpu,
    shape: &AttentionShape,
    qkv: DevPtr,
    cache: KvCache,
    state: DevPtr,
    part: DevPtr,
    att: DevPtr,
    queries: Queries,
) -> Result<()> {
    let shared = shape.split_shared_bytes() as u32;
    let (k_cache, v_cache, scales) = match cache {
        KvCache::F16 { k, v } => (k, v, None),
        KvCache::Int8 {
            k,
            v,
            k_scales,
            v_scales,
        } => (k, v, Some((k_scales, v_scales))),
    };
    let cache_kind = if scales.is_some() { "_i8" } else { "" };
    let (family, variant) = match shape.effective_kernel() {
        SplitKernel::Block => (&FAMILY, ""),
        SplitKernel::Warp => (&WARP_FAMILY, "_warp"),
    };
    let name = format!(
        "attention_split{variant}{cache_kind}_g{}",
        shape.kernel_group()
    );
    let f = gpu.function(family, &name)?;
    gpu.allow_dynamic_shared(&f, shared as usize)?;
    let (h, hkv, hd) = (
        shape.heads as i32,
        shape.kv_heads as i32,
        shape.head_dim as i32,
    );
    let scale = 1.0f32 / (shape.head_dim as f32).sqrt();
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
        .arg(&queries.len0)
        .arg(&q_stride)
        .arg(&queries.seqs)
        .arg(&queries.slot_stride);
    if let Some((k_scales, v_scales)) = &scales {
        b.arg(k_scales).arg(v_scales);
    }
    let (pf, pf_bytes) = queries.prefetch.args();
    b.arg(&pf).arg(&pf_bytes);
    let mut c = grid_cfg(
        (shape.kv_heads as u32, queries.splits as u32),
        ATT_THREADS as u32,
        shared,
    );
    c.grid_dim.2 = queries.count.max(1) as u32;
    unsafe { b.launch(c) }.during("launching attention_split")?;
    combine(
        gpu,
        part,
        att,
        shape.heads,
        queries.count.max(1),
        queries.splits,
        shape.head_dim,
    )
}

/// `attention_combine`: `att[z][h]` (f32 `[count][heads][hd]`) from the `splits` partials per
/// (query, head) in `part` (`{ m, l, acc[hd] }`, see `attention.cu`).
pub(crate) fn combine(
    gpu: &Gpu,
    part: DevPtr,
    att: DevPtr,
    heads: usize,
    count: usize,
    splits: usize,
    head_dim: usize,
) -> Result<()> {
    let f = gpu.function(&FAMILY, "attention_combine")?;
    let (s, hd) = (
        i32_arg("splits", splits)?,
        i32_arg("head dimension", head_dim)?,
    );
    let grid = (
        u32::try_from(heads).map_err(|_| CudaError::Unsupported(format!("{heads} heads")))?,
        u32::try_from(count).map_err(|_| CudaError::Unsupported(format!("{count} queries")))?,
    );
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&part).arg(&att).arg(&s).arg(&hd);
    unsafe { b.launch(grid_cfg(grid, 128, 0)) }.during("launching attention_combine")?;
    Ok(())
}

/// The f64 CPU reference, and the 8-bit cache as the kernels store it.
pub mod reference {
    use sieve_formats::kv_cache::{dequantize_row, quantize_row};

    /// The 8-bit cache of `values` (`[pos][Hkv][hd]` f32): its i8 rows (same layout) and one
    /// scale per row (`[pos][Hkv]`), by the rule the GPU's cache write applies.
    pub fn quantize_cache(values: &[f32], hd: usize) -> (Vec<i8>, Vec<f32>) {
        let mut q = vec![0i8; values.len()];
        let scales = values
            .chunks(hd)
            .zip(q.chunks_mut(hd))
            .map(|(row, qrow)| quantize_row(row, qrow))
            .collect();
        (q, scales)
    }

    /// What the 8-bit cache reads back (`q * scale` per row), in [`attention`]'s layout.
    pub fn dequantize_cache(q: &[i8], scales: &[f32], hd: usize) -> Vec<f32> {
        let mut out = vec![0f32; q.len()];
        for ((qrow, orow), &s) in q.chunks(hd).zip(out.chunks_mut(hd)).zip(scales) {
            dequantize_row(qrow, s, orow);
        }
        out
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_split_kernel_setting_parses_and_names_a_bad_value() {
        assert_eq!(SplitKernel::parse(None), Ok(None));
        assert_eq!(
            SplitKernel::parse(Some("block")),
            Ok(Some(SplitKernel::Block))
        );
        assert_eq!(
            SplitKernel::parse(Some("warp")),
            Ok(Some(SplitKernel::Warp))
        );
        assert_eq!(SplitKernel::default_for(1), SplitKernel::Warp);
        assert_eq!(SplitKernel::default_for(4), SplitKernel::Block);
        let e = SplitKernel::parse(Some("warps")).unwrap_err();
        assert!(e.contains("SIEVE_ATTENTION_KERNEL=warps"), "{e}");
    }
}
