//! Tensor parallelism over `world` ranks (issue 31), described once and executed here on the CPU
//! as the reference the GPU ranks must match.
//!
//! The split is Megatron's: each layer needs two all-reduces and nothing else crosses ranks.
//!
//! ```text
//!   rank r of w holds                              per layer, per token
//!   q_proj, k_proj, v_proj  rows of its heads      xn (replicated) -> q_r|k_r|v_r  (its H/w query
//!                                                  heads, its Hkv/w KV heads: the group stays on
//!                                                  one rank), RoPE, its KV cache, attention
//!   o_proj                  columns of its heads   att_r -> partial o_r      all-reduce: Σ_r o_r
//!   gate_proj, up_proj      rows of its I slice    xn -> gate_r|up_r, h_r = silu(gate_r) · up_r
//!   down_proj               columns of its I slice h_r -> partial d_r       all-reduce: Σ_r d_r
//!   lm_head                 rows of its V slice    logits_r                  all-gather (once)
//!   embeddings, norms       replicated
//! ```
//!
//! Heads are split evenly (`H` and `Hkv` must be multiples of `w`); the MLP's `I` columns and the
//! vocabulary may split unevenly (the first ranks take one more). A rank's slices keep their
//! format: GGUF blocks are cut in whole blocks (the splits of SmolLM2 and the Llama shapes fall
//! on the 32-wide blocks; the K types' 256-wide ones may not, and such a slice becomes f16),
//! every other matrix is decoded, cut and encoded again in its own kind. TEAL thresholds stay per matrix, so each
//! rank skips the inactive inputs of its own slice. Biases of the row-split matrices are cut
//! with their rows; a bias of o_proj or down_proj is added once, by rank 0.
//!
//! The all-reduce here sums the ranks' partial outputs in rank order (so the result depends
//! only on the shard, not on timing) and differs from the single model's product by f32
//! summation order: logits agree to ~1e-5 relative, greedy tokens are the same.
//! [`CommVolume`] gives the bytes each rank sends per decode step.

use super::{add_into, apply_rope, rms_norm, silu, KvCache, KvPrecision, Layer, Logits, Model};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::generate::{generate_with, Executor, GenerateOptions, Generation, Next};
use crate::linear::Linear;
use crate::plan::{self, Group, LayerOp};
use crate::sequence::Sequence;
use crate::tokenizer::Tokenizer;
use rayon::prelude::*;
use sieve_cpu::attention::{attend_one, Heads};
use sieve_cpu::gguf_blocks::QuantMatrix;
use sieve_formats::{DenseMatrix, FormatKind, WeightFormat};
use std::ops::Range;

/// How a model of `config` splits over `world` ranks ([`ShardLayout::new`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardLayout {
    pub world: usize,
    /// Query heads and KV heads per rank.
    pub heads: usize,
    pub kv_heads: usize,
    /// Each rank's columns of the MLP's intermediate dimension, and rows of the vocabulary.
    pub intermediate: Vec<Range<usize>>,
    pub vocab: Vec<Range<usize>>,
}

/// `n` split into `parts` consecutive ranges, the first `n % parts` one longer.
fn split(n: usize, parts: usize) -> Vec<Range<usize>> {
    let (base, extra) = (n / parts, n % parts);
    let mut start = 0;
    (0..parts)
        .map(|r| {
            let len = base + usize::from(r < extra);
            let range = start..start + len;
            start += len;
            range
        })
        .collect()
}

impl ShardLayout {
    /// The split, or an error naming the dimension that does not divide.
    pub fn new(config: &ModelConfig, world: usize) -> Result<Self> {
        let c = config;
        let refuse = |what: String| {
            Err(ModelError::InvalidArgument(format!(
                "--tensor-parallel {world}: {what}"
            )))
        };
        if world == 0 {
            return refuse("at least one rank is needed".into());
        }
        if !c.num_heads.is_multiple_of(world) || !c.num_kv_heads.is_multiple_of(world) {
            return refuse(format!(
                "the model's {} query heads and {} KV heads must both be multiples of the rank \
                 count (heads are not split across ranks)",
                c.num_heads, c.num_kv_heads
            ));
        }
        if c.intermediate_size < world || c.vocab_size < world {
            return refuse(format!(
                "the MLP width {} and vocabulary {} must give every rank a slice",
                c.intermediate_size, c.vocab_size
            ));
        }
        Ok(Self {
            world,
            heads: c.num_heads / world,
            kv_heads: c.num_kv_heads / world,
            intermediate: split(c.intermediate_size, world),
            vocab: split(c.vocab_size, world),
        })
    }

    /// Rows of q_proj (and columns of o_proj) rank `r` holds.
    fn q_rows(&self, r: usize, head_dim: usize) -> Range<usize> {
        let w = self.heads * head_dim;
        r * w..(r + 1) * w
    }

    /// Rows of k_proj and v_proj rank `r` holds.
    fn kv_rows(&self, r: usize, head_dim: usize) -> Range<usize> {
        let w = self.kv_heads * head_dim;
        r * w..(r + 1) * w
    }
}

/// What crosses ranks in one decode step of one token (`bytes_per_value` 4 for f32 partial
/// sums, 2 for f16).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommVolume {
    /// Two per layer (after o_proj and after down_proj).
    pub all_reduces: usize,
    /// Values of one all-reduce: the hidden size.
    pub values_per_all_reduce: usize,
    /// Bytes each rank sends per step with a ring all-reduce (`2 (w - 1) / w` of the vector
    /// per all-reduce) plus its share of the logits all-gather (`(w - 1) / w` of `V`).
    pub bytes_sent_per_rank: usize,
}

impl CommVolume {
    pub fn per_token(config: &ModelConfig, world: usize, bytes_per_value: usize) -> Self {
        let all_reduces = 2 * config.num_layers;
        let d = config.hidden_size;
        let ring = |values: usize, factor: usize| {
            (factor * (world - 1) * values * bytes_per_value).div_ceil(world.max(1))
        };
        Self {
            all_reduces,
            values_per_all_reduce: d,
            bytes_sent_per_rank: all_reduces * ring(d, 2) + ring(config.vocab_size, 1),
        }
    }
}

/// One rank's share of the model.
#[derive(Debug)]
struct Rank {
    layers: Vec<Layer>,
    lm_head: Linear,
}

/// A model split over ranks (module notes), run on the CPU one rank after another.
#[derive(Debug)]
pub struct TensorParallelModel<'m> {
    /// The whole model: configuration, embeddings, final norm and RoPE frequencies.
    model: &'m Model,
    layout: ShardLayout,
    ranks: Vec<Rank>,
}

/// Rows `rows` and columns `cols` of `lin`, in its own format (module notes); its bias cut to
/// `rows` when `bias` is true, dropped otherwise; its threshold kept.
fn slice(lin: &Linear, rows: Range<usize>, cols: Range<usize>, bias: bool) -> Result<Linear> {
    let blocks = match lin.quant_blocks() {
        Some(q) => slice_blocks(q, rows.clone(), cols.clone())?,
        None => None,
    };
    let mut out = match blocks {
        Some(part) => part,
        None => slice_decoded(lin, rows.clone(), cols)?,
    };
    if let (true, Some(b)) = (bias, lin.bias()) {
        out = out.with_bias(b[rows].to_vec())?;
    }
    out.set_threshold(lin.threshold())?;
    Ok(out)
}

/// GGUF blocks cut in whole blocks (each row's blocks are consecutive), so a rank multiplies the
/// same blocks with the same 8-bit activations as the whole model; `None` when `cols` does not
/// fall on block boundaries (the K types' 256-wide blocks against an uneven MLP split).
fn slice_blocks(q: &QuantMatrix, rows: Range<usize>, cols: Range<usize>) -> Result<Option<Linear>> {
    let ty = q.block_type();
    let (elems, bytes) = (ty.block_elems(), ty.block_bytes());
    if !cols.start.is_multiple_of(elems) || !cols.end.is_multiple_of(elems) {
        return Ok(None);
    }
    let row_bytes = q.blocks().len() / WeightFormat::rows(q).max(1);
    let span = cols.start / elems * bytes..cols.end / elems * bytes;
    let mut blocks = Vec::with_capacity(rows.len() * span.len());
    for r in rows.clone() {
        blocks.extend_from_slice(&q.blocks()[r * row_bytes..][span.clone()]);
    }
    let part = QuantMatrix::new(ty, rows.len(), cols.len(), blocks)?;
    Ok(Some(Linear::from_quantized(part)))
}

/// Any other format: decoded, cut, and encoded again in its own kind (dense f16 for blocks that
/// do not cut on their boundaries).
fn slice_decoded(lin: &Linear, rows: Range<usize>, cols: Range<usize>) -> Result<Linear> {
    let dense = lin.format().decode();
    let k = dense.cols();
    let mut data = Vec::with_capacity(rows.len() * cols.len());
    for r in rows.clone() {
        data.extend_from_slice(&dense.data()[r * k + cols.start..r * k + cols.end]);
    }
    let part = DenseMatrix::new(rows.len(), cols.len(), data)?;
    let kind = if lin.is_quantized_blocks() {
        FormatKind::Dense
    } else {
        lin.format().kind()
    };
    Ok(match kind {
        FormatKind::Dense => Linear::from_format(Box::new(sieve_cpu::dense::FastDense::new(part))),
        kind => Linear::from_format(sieve_formats::registry::encode_default(kind, &part)?),
    })
}

impl<'m> TensorParallelModel<'m> {
    /// Splits `model` over `world` ranks ([`ShardLayout::new`] says what must divide).
    pub fn shard(model: &'m Model, world: usize) -> Result<Self> {
        let c = model.config();
        let layout = ShardLayout::new(c, world)?;
        let (d, hd) = (c.hidden_size, c.head_dim);
        let ranks = (0..world)
            .map(|r| {
                let (q, kv, inter) = (
                    layout.q_rows(r, hd),
                    layout.kv_rows(r, hd),
                    layout.intermediate[r].clone(),
                );
                let layers = model
                    .layers()
                    .iter()
                    .map(|l| {
                        Ok(Layer {
                            input_norm: l.input_norm.clone(),
                            post_attention_norm: l.post_attention_norm.clone(),
                            q_proj: slice(&l.q_proj, q.clone(), 0..d, true)?,
                            k_proj: slice(&l.k_proj, kv.clone(), 0..d, true)?,
                            v_proj: slice(&l.v_proj, kv.clone(), 0..d, true)?,
                            o_proj: slice(&l.o_proj, 0..d, q.clone(), r == 0)?,
                            gate_proj: slice(&l.gate_proj, inter.clone(), 0..d, true)?,
                            up_proj: slice(&l.up_proj, inter.clone(), 0..d, true)?,
                            down_proj: slice(&l.down_proj, 0..d, inter.clone(), r == 0)?,
                        })
                    })
                    .collect::<Result<Vec<Layer>>>()?;
                let lm_head = slice(model.lm_head(), layout.vocab[r].clone(), 0..d, true)?;
                Ok(Rank { layers, lm_head })
            })
            .collect::<Result<Vec<Rank>>>()?;
        Ok(Self {
            model,
            layout,
            ranks,
        })
    }

    pub fn layout(&self) -> &ShardLayout {
        &self.layout
    }

    /// One KV cache per rank (its KV heads only), `capacity` positions each, storing
    /// `precision`.
    pub fn new_caches(&self, capacity: usize, precision: KvPrecision) -> Result<Vec<KvCache>> {
        let c = self.model.config();
        let capacity = capacity.min(c.max_position_embeddings);
        (0..self.layout.world)
            .map(|_| {
                KvCache::zeroed(
                    c.num_layers,
                    capacity,
                    self.layout.kv_heads,
                    c.head_dim,
                    precision,
                )
            })
            .collect()
    }

    /// Runs `tokens` at positions `caches[r].len()..` (every rank's cache at the same length)
    /// and returns logits as [`Model::forward`] does.
    pub fn forward(
        &self,
        tokens: &[u32],
        caches: &mut [KvCache],
        which: Logits,
    ) -> Result<Vec<f32>> {
        let c = self.model.config();
        let world = self.layout.world;
        let n = tokens.len();
        if caches.len() != world {
            return Err(ModelError::InvalidArgument(format!(
                "{} KV caches for {world} ranks",
                caches.len()
            )));
        }
        let p0 = caches[0].len();
        let (hd, nh, nkv) = (c.head_dim, self.layout.heads, self.layout.kv_heads);
        for cache in caches.iter() {
            cache.check_shape(c.num_layers, nkv, hd)?;
            if cache.len() != p0 || cache.capacity() != caches[0].capacity() {
                return Err(ModelError::InvalidArgument(
                    "the ranks' KV caches hold different lengths".into(),
                ));
            }
        }
        if p0 + n > caches[0].capacity() {
            return Err(ModelError::ContextOverflow {
                tokens: p0 + n,
                context: caches[0].capacity(),
            });
        }
        let d = c.hidden_size;
        // Embedding (checks the tokens), replicated on every rank.
        let mut x = self.model.embed(tokens)?;
        let (cos, sin) = self.model.rope_tables(p0, n);
        let heads = Heads {
            q_heads: nh,
            kv_heads: nkv,
            head_dim: hd,
        };
        let mut xn = vec![0f32; n * d];
        for l in 0..c.num_layers {
            // Per rank: q|k|v (q becomes the attention output), gate|up (gate becomes h).
            let mut qkv: Vec<[Vec<f32>; 3]> = Vec::with_capacity(world);
            let mut gate_up: Vec<[Vec<f32>; 2]> = Vec::with_capacity(world);
            for op in plan::LAYER {
                match op {
                    LayerOp::Norm(which) => rms_norm(
                        &x,
                        self.model.layers()[l].norm(which),
                        c.rms_norm_eps,
                        &mut xn,
                    ),
                    LayerOp::Product(Group::Qkv) => {
                        for rank in &self.ranks {
                            let mut out = [
                                vec![0f32; n * nh * hd],
                                vec![0f32; n * nkv * hd],
                                vec![0f32; n * nkv * hd],
                            ];
                            let [q, k, v] = &mut out;
                            Linear::forward_group(
                                &rank.layers[l].group(Group::Qkv),
                                &xn,
                                n,
                                &mut [q, k, v],
                            )?;
                            qkv.push(out);
                        }
                    }
                    LayerOp::RopeKv => {
                        for ([q, k, v], cache) in qkv.iter_mut().zip(caches.iter_mut()) {
                            apply_rope(q, nh, hd, &cos, &sin);
                            apply_rope(k, nkv, hd, &cos, &sin);
                            cache.store(l, p0, k, v);
                        }
                    }
                    LayerOp::Attention => {
                        for ([q, _, _], cache) in qkv.iter_mut().zip(caches.iter()) {
                            let layer_cache = cache.layer(l, p0 + n);
                            let mut out = vec![0f32; n * nh * hd];
                            out.par_chunks_mut(nh * hd)
                                .zip(q.par_chunks(nh * hd))
                                .enumerate()
                                .for_each(|(t, (o, qt))| {
                                    attend_one(heads, qt, layer_cache, p0 + t + 1, o)
                                });
                            *q = out;
                        }
                    }
                    LayerOp::Product(Group::GateUp) => {
                        for (r, rank) in self.ranks.iter().enumerate() {
                            let width = self.layout.intermediate[r].len();
                            let mut out = [vec![0f32; n * width], vec![0f32; n * width]];
                            let [gate, up] = &mut out;
                            Linear::forward_group(
                                &rank.layers[l].group(Group::GateUp),
                                &xn,
                                n,
                                &mut [gate, up],
                            )?;
                            gate_up.push(out);
                        }
                    }
                    LayerOp::SwiGlu => {
                        for [gate, up] in gate_up.iter_mut() {
                            for (g, u) in gate.iter_mut().zip(up.iter()) {
                                *g = silu(*g) * u;
                            }
                        }
                    }
                    LayerOp::Product(group) => {
                        // o or down, then the all-reduce: every rank's partial product,
                        // summed in rank order, added into the (replicated) residual stream.
                        let mut sum = vec![0f32; n * d];
                        let mut part = vec![0f32; n * d];
                        for (r, rank) in self.ranks.iter().enumerate() {
                            let (lin, input) = match group {
                                Group::O => (&rank.layers[l].o_proj, &qkv[r][0]),
                                _ => (&rank.layers[l].down_proj, &gate_up[r][0]),
                            };
                            lin.forward(input, n, &mut part)?;
                            add_into(&mut sum, &part);
                        }
                        add_into(&mut x, &sum);
                    }
                }
            }
        }
        for cache in caches.iter_mut() {
            cache.len = p0 + n;
        }
        let (normed, m) = self.model.final_normed(&x, n, which);
        // The all-gather: each rank's vocabulary slice into its place of every row.
        let vocab = c.vocab_size;
        let mut logits = vec![0f32; m * vocab];
        for (r, rank) in self.ranks.iter().enumerate() {
            let range = self.layout.vocab[r].clone();
            let mut part = vec![0f32; m * range.len()];
            rank.lm_head.forward(&normed, m, &mut part)?;
            for (row, slice) in logits
                .chunks_exact_mut(vocab)
                .zip(part.chunks_exact(range.len()))
            {
                row[range.clone()].copy_from_slice(slice);
            }
        }
        Ok(logits)
    }
}

/// [`crate::generate::generate`] through a sharded model: the same sampling, stop rules and
/// streaming, the forward passes of [`TensorParallelModel::forward`] over one cache per rank.
pub fn generate(
    tp: &TensorParallelModel,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    options: &GenerateOptions,
    on_text: impl FnMut(&str) -> Result<()>,
) -> Result<Generation> {
    let context = tp.model.config().max_position_embeddings;
    if prompt.is_empty() {
        return Err(ModelError::InvalidArgument(
            "the prompt has no tokens".into(),
        ));
    }
    if prompt.len() > context {
        return Err(ModelError::ContextOverflow {
            tokens: prompt.len(),
            context,
        });
    }
    let sequence = Sequence::new(tokenizer, prompt, options)?;
    let caches = tp.new_caches(
        prompt.len().saturating_add(options.max_tokens),
        tp.model.kv_precision(),
    )?;
    crate::generate::with_hot_workers(|| {
        generate_with(&mut RankExecutor { tp, caches }, sequence, prompt, on_text)
    })
}

/// [`generate`]'s side of [`generate_with`]: forward passes over the ranks' caches, logits to
/// the host's sampler.
struct RankExecutor<'t, 'm> {
    tp: &'t TensorParallelModel<'m>,
    caches: Vec<KvCache>,
}

impl Executor for RankExecutor<'_, '_> {
    type Error = ModelError;
    fn prefill(&mut self, prompt: &[u32]) -> Result<Next> {
        let logits = self.tp.forward(prompt, &mut self.caches, Logits::Last)?;
        Ok(Next::Logits(logits))
    }
    fn step(&mut self, token: u32) -> Result<Next> {
        let logits = self.tp.forward(&[token], &mut self.caches, Logits::Last)?;
        Ok(Next::Logits(logits))
    }
    fn has_room(&self) -> bool {
        self.caches.first().is_some_and(|c| c.len() < c.capacity())
    }
}

impl TensorParallelModel<'_> {
    /// The whole model the ranks split.
    pub fn model(&self) -> &Model {
        self.model
    }

    /// Rank `r`'s configuration as one model of its own: its query and KV heads and its MLP
    /// slice (hidden size, vocabulary and everything else as the whole model's), which is what
    /// a GPU rank is built from beside [`Self::rank_layers`].
    pub fn rank_config(&self, r: usize) -> Result<ModelConfig> {
        let l = &self.layout;
        let inter = l.intermediate.get(r).ok_or_else(|| {
            ModelError::InvalidArgument(format!("rank {r} of a {}-rank split", l.world))
        })?;
        Ok(ModelConfig {
            num_heads: l.heads,
            num_kv_heads: l.kv_heads,
            intermediate_size: inter.len(),
            ..self.model.config().clone()
        })
    }

    /// Rank `r`'s layers (module notes: its rows of q|k|v and gate|up, its columns of o and
    /// down, o's and down's biases on rank 0 only).
    pub fn rank_layers(&self, r: usize) -> Result<&[Layer]> {
        self.ranks
            .get(r)
            .map(|rank| rank.layers.as_slice())
            .ok_or_else(|| {
                ModelError::InvalidArgument(format!(
                    "rank {r} of a {}-rank split",
                    self.layout.world
                ))
            })
    }

    /// Bytes each rank holds: its slices of the layers and of the LM head as the CPU holds them
    /// (`cpu_bytes`), the replicated embeddings and norms.
    pub fn rank_weight_bytes(&self) -> Vec<usize> {
        let c = self.model.config();
        let replicated =
            self.model.embed_tokens().len() * 2 + (2 * c.num_layers + 1) * c.hidden_size * 4;
        self.ranks
            .iter()
            .map(|rank| {
                replicated
                    + rank.lm_head.format().cpu_bytes()
                    + rank
                        .layers
                        .iter()
                        .flat_map(|l| l.linears().map(|(_, lin)| lin.format().cpu_bytes()))
                        .sum::<usize>()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llama::tests::{random_source, tiny_config};
    use sieve_formats::registry::encode_default;

    fn argmax(v: &[f32]) -> u32 {
        (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b }) as u32
    }

    /// Greedy decode of `steps` tokens after `prompt`: single model and the sharded one side by
    /// side; returns the largest logit difference relative to the logits' spread.
    fn compare(model: &Model, world: usize, kv: KvPrecision, steps: usize) -> f32 {
        let tp = TensorParallelModel::shard(model, world).unwrap();
        let prompt = [1u32, 7, 3, 12, 5];
        let mut single = model.try_new_cache_as(16, kv).unwrap();
        let mut ranks = tp.new_caches(16, kv).unwrap();
        let mut want = model.forward(&prompt, &mut single, Logits::Last).unwrap();
        let mut got = tp.forward(&prompt, &mut ranks, Logits::Last).unwrap();
        let mut worst = 0f32;
        for step in 0..=steps {
            let spread = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in got.iter().zip(&want) {
                worst = worst.max((a - b).abs() / spread);
            }
            let next = argmax(&want);
            assert_eq!(
                argmax(&got),
                next,
                "world {world} step {step}: greedy token"
            );
            if step < steps {
                want = model.forward(&[next], &mut single, Logits::Last).unwrap();
                got = tp.forward(&[next], &mut ranks, Logits::Last).unwrap();
            }
        }
        assert!(ranks.iter().all(|c| c.len() == single.len()));
        worst
    }

    #[test]
    fn one_rank_is_the_model_bit_for_bit() {
        let model = Model::from_source(&random_source(tiny_config(), 21)).unwrap();
        assert_eq!(compare(&model, 1, KvPrecision::F16, 6), 0.0);
    }

    #[test]
    fn two_ranks_decode_the_same_tokens_with_logits_within_rounding() {
        // Vocabulary 37 and the MLP's 40 columns: the vocabulary splits unevenly (19 + 18).
        let model = Model::from_source(&random_source(tiny_config(), 22)).unwrap();
        for kv in [KvPrecision::F16, KvPrecision::Int8] {
            let worst = compare(&model, 2, kv, 8);
            assert!(worst < 1e-4, "{kv}: logits moved {worst} of their spread");
        }
        let mut mha = tiny_config();
        mha.num_kv_heads = 4;
        let model = Model::from_source(&random_source(mha, 23)).unwrap();
        let worst = compare(&model, 4, KvPrecision::F16, 8);
        assert!(worst < 1e-4, "4 ranks: logits moved {worst}");
    }

    /// Sparse formats and TEAL thresholds survive the cut: each rank holds its slices in the
    /// matrix's own format and skips the inactive inputs of its slice.
    #[test]
    fn sparse_thresholded_layers_shard_in_their_own_format() {
        let mut model = Model::from_source(&random_source(tiny_config(), 24)).unwrap();
        for layer in model.layers_mut() {
            for (name, lin) in layer.linears_mut() {
                let dense = lin.format().decode();
                let kind = if name.contains("mlp") {
                    FormatKind::TiledCbc
                } else {
                    FormatKind::RlcCsc
                };
                lin.replace_format(encode_default(kind, &dense).unwrap())
                    .unwrap();
                lin.set_threshold(Some(0.05)).unwrap();
            }
        }
        let tp = TensorParallelModel::shard(&model, 2).unwrap();
        for rank in &tp.ranks {
            let l = &rank.layers[1];
            assert_eq!(l.gate_proj.format().kind(), FormatKind::TiledCbc);
            assert_eq!(l.o_proj.format().kind(), FormatKind::RlcCsc);
            assert_eq!(l.down_proj.threshold(), Some(0.05));
            assert_eq!(l.o_proj.cols(), 2 * 6);
        }
        let worst = compare(&model, 2, KvPrecision::F16, 6);
        assert!(worst < 1e-3, "logits moved {worst}");
    }

    #[test]
    fn rank_bytes_split_the_layers_and_replicate_the_rest() {
        let model = Model::from_source(&random_source(tiny_config(), 2)).unwrap();
        let whole = TensorParallelModel::shard(&model, 1)
            .unwrap()
            .rank_weight_bytes()[0];
        let halves = TensorParallelModel::shard(&model, 2)
            .unwrap()
            .rank_weight_bytes();
        let c = model.config();
        let replicated =
            c.vocab_size * c.hidden_size * 2 + (2 * c.num_layers + 1) * c.hidden_size * 4;
        assert_eq!(halves.len(), 2);
        // Dense f16: the sliced bytes add up to the whole's (the vocabulary's odd row goes to
        // rank 0).
        assert_eq!(halves[0] + halves[1] - replicated, whole);
        assert!(halves[0] > halves[1]);
    }

    /// GGUF blocks are cut in whole blocks: each rank multiplies blocks (with the same 8-bit
    /// activations of its slice), and the logits agree with the whole model's.
    #[test]
    fn gguf_blocks_shard_in_whole_blocks() {
        use sieve_cpu::gguf_blocks::{BlockType, QuantMatrix};
        let mut c = tiny_config();
        (c.hidden_size, c.intermediate_size, c.head_dim) = (64, 128, 16);
        let mut model = Model::from_source(&random_source(c, 25)).unwrap();
        let to_blocks = |lin: &mut Linear, q4: bool| {
            let w = lin.format().decode();
            let (rows, cols) = (w.rows(), w.cols());
            let q = if q4 {
                QuantMatrix::quantize_q4_1(rows, cols, w.data())
            } else {
                QuantMatrix::quantize_q8_0(rows, cols, w.data())
            };
            *lin = Linear::from_quantized(q.unwrap());
        };
        for layer in model.layers_mut() {
            for (name, lin) in layer.linears_mut() {
                to_blocks(lin, name.contains("mlp"));
            }
        }
        to_blocks(model.lm_head_mut(), false);
        let tp = TensorParallelModel::shard(&model, 2).unwrap();
        for rank in &tp.ranks {
            assert_eq!(rank.layers[0].o_proj.block_type(), Some(BlockType::Q8_0));
            assert_eq!(rank.layers[0].down_proj.block_type(), Some(BlockType::Q4_1));
            assert_eq!(rank.layers[0].down_proj.cols(), 64);
            assert_eq!(rank.lm_head.block_type(), Some(BlockType::Q8_0));
        }
        let worst = compare(&model, 2, KvPrecision::F16, 6);
        assert!(worst < 1e-4, "logits moved {worst}");
    }

    #[test]
    fn layouts_that_split_a_head_group_are_refused() {
        let c = tiny_config(); // 4 query heads, 2 KV heads
        for world in [0, 3, 4] {
            let err = ShardLayout::new(&c, world).unwrap_err().to_string();
            assert!(err.contains(&format!("--tensor-parallel {world}")), "{err}");
        }
        let l = ShardLayout::new(&c, 2).unwrap();
        assert_eq!((l.heads, l.kv_heads), (2, 1));
        assert_eq!(l.vocab, vec![0..19, 19..37]);
        assert_eq!(l.intermediate, vec![0..20, 20..40]);
        let model = Model::from_source(&random_source(c, 1)).unwrap();
        let tp = TensorParallelModel::shard(&model, 2).unwrap();
        // Caches of the whole model, or of different lengths, are refused.
        let mut whole = vec![model.new_cache(8), model.new_cache(8)];
        assert!(tp.forward(&[1], &mut whole, Logits::Last).is_err());
        let mut caches = tp.new_caches(8, KvPrecision::F16).unwrap();
        tp.forward(&[1], &mut caches[..1].to_vec(), Logits::Last)
            .unwrap_err();
        caches[0].len = 1;
        assert!(tp.forward(&[1], &mut caches, Logits::Last).is_err());
    }

    /// Llama-2-70B on 4 ranks, f16 partial sums: 160 all-reduces of 8192 values, each rank
    /// sending 2 · 3/4 of each vector and 3/4 of the 32000 logits.
    #[test]
    fn communication_volume_of_a_70b_step() {
        let mut c = tiny_config();
        c.num_layers = 80;
        c.hidden_size = 8192;
        c.vocab_size = 32000;
        let v = CommVolume::per_token(&c, 4, 2);
        assert_eq!(v.all_reduces, 160);
        assert_eq!(v.values_per_all_reduce, 8192);
        assert_eq!(
            v.bytes_sent_per_rank,
            160 * (2 * 3 * 8192 * 2 / 4) + 3 * 32000 * 2 / 4
        );
        assert_eq!(CommVolume::per_token(&c, 1, 2).bytes_sent_per_rank, 0);
    }
}
