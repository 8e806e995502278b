//! The Llama-family forward pass (Llama 2/3, Mistral, Qwen2, SmolLM2) with a KV cache.
//!
//! Notation: `d` = hidden_size, `H` = num_heads, `Hkv` = num_kv_heads, `hd` = head_dim,
//! `I` = intermediate_size, `V` = vocab_size, `n` = tokens in this call, `p0` = tokens already in
//! the cache, `C` = cache capacity (the context). Every buffer is f32 but the cache (f16),
//! row-major:
//!
//! | buffer | shape | notes |
//! |---|---|---|
//! | `x` (residual stream) | `[n][d]` | one row per token of this call |
//! | `xn` (normed input) | `[n][d]` | RMSNorm(x) · weight |
//! | `q` | `[n][H][hd]` | after RoPE |
//! | `k`, `v` | `[n][Hkv][hd]` | copied into the cache after RoPE (k) |
//! | cache `k`, `v` | `[layer][pos][Hkv][hd]` | f16 or i8; `pos < C`; positions `< p0 + n` are valid |
//! | cache scales (8-bit) | `[layer][pos][Hkv]` | f32, one per row of `hd` ([`kv_cache`]) |
//! | `att` (attention output) | `[n][H][hd]` | input of `o_proj` |
//! | `gate`, `up` | `[n][I]` | `silu(gate) * up` is written into `gate` |
//! | `cos`, `sin` | `[n][hd/2]` | RoPE angles of the call's positions |
//! | logits | `[V]` (last token) or `[n][V]` (every token) | |
//!
//! RoPE follows the Hugging Face "rotate-half" convention: dimension `i < hd/2` pairs with
//! `i + hd/2`, with frequency `theta^(-2i/hd)` (Llama-3 `rope_scaling` rescales the low
//! frequencies). Every [`TensorSource`] yields Q/K rows in the Hugging Face order.
//!
//! Query head `h` reads KV head `h / (H / Hkv)` (grouped-query attention). A call with `n > 1`
//! (prefill) runs every projection as one `matmul` and causal attention over the cache; `n == 1`
//! (decode) runs `matvec`s. Rayon parallelises over weight rows (inside `Linear`) and over heads.
//!
//! Keys and values enter the cache rounded to f16 (half the bytes a decode step reads after a
//! long prompt), and every attention reads them from there, so a token's logits do not depend on
//! whether it was decoded alone or inside a prompt. Decode reads each cached row once for all
//! the query heads of its KV head ([`sieve_cpu::attention`]). With
//! [`Model::set_kv_precision`]`(Int8)` the cache stores each (position, KV head) row as i8 with
//! one f32 scale instead (`--kv-cache int8`, 0.53x the bytes at hd 64), by the same rule the GPU
//! cache uses.

use crate::config::{ModelConfig, RopeScaling};
use crate::error::{ModelError, Result};
use crate::linear::Linear;
use crate::plan::{self, Group, LayerOp, Norm};
use crate::weights::{Tensor, TensorSource};
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use sieve_cpu::attention::CachedLayer;
use sieve_cpu::{gemm, kernels};
pub use sieve_formats::kv_cache::{self, KvPrecision};

pub mod phases;
pub mod tensor_parallel;
use phases::{Clock, Phase};
mod walk;
pub use walk::LayerWalk;

/// Query rows per task of the GEMM attention path: a 64 x 1024 score block is 256 KiB.
const ATTENTION_BLOCK: usize = 64;
/// From this many queries per call, attention runs as blocked GEMMs (packing pays for itself);
/// fewer (decode, short prompts) take the per-query loop.
const ATTENTION_GEMM_MIN: usize = 16;

/// The projections of one decoder layer, by their Hugging Face names.
pub(crate) const LAYER_LINEARS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

#[derive(Debug)]
pub struct Layer {
    pub input_norm: Vec<f32>,
    pub post_attention_norm: Vec<f32>,
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

impl Layer {
    /// The weight of one of the layer's two RMSNorms.
    pub fn norm(&self, which: Norm) -> &[f32] {
        match which {
            Norm::Attention => &self.input_norm,
            Norm::Mlp => &self.post_attention_norm,
        }
    }

    /// The projections of a plan group, in [`Group::members`] order.
    pub fn group(&self, group: Group) -> Vec<&Linear> {
        match group {
            Group::Qkv => vec![&self.q_proj, &self.k_proj, &self.v_proj],
            Group::O => vec![&self.o_proj],
            Group::GateUp => vec![&self.gate_proj, &self.up_proj],
            Group::Down => vec![&self.down_proj],
        }
    }

    /// The layer's linears with their short names, read-only.
    pub fn linears(&self) -> [(&'static str, &Linear); 7] {
        [
            (LAYER_LINEARS[0], &self.q_proj),
            (LAYER_LINEARS[1], &self.k_proj),
            (LAYER_LINEARS[2], &self.v_proj),
            (LAYER_LINEARS[3], &self.o_proj),
            (LAYER_LINEARS[4], &self.gate_proj),
            (LAYER_LINEARS[5], &self.up_proj),
            (LAYER_LINEARS[6], &self.down_proj),
        ]
    }

    /// The layer's linears with their short names (`self_attn.q_proj`, ..., `mlp.down_proj`).
    pub fn linears_mut(&mut self) -> [(&'static str, &mut Linear); 7] {
        [
            (LAYER_LINEARS[0], &mut self.q_proj),
            (LAYER_LINEARS[1], &mut self.k_proj),
            (LAYER_LINEARS[2], &mut self.v_proj),
            (LAYER_LINEARS[3], &mut self.o_proj),
            (LAYER_LINEARS[4], &mut self.gate_proj),
            (LAYER_LINEARS[5], &mut self.up_proj),
            (LAYER_LINEARS[6], &mut self.down_proj),
        ]
    }
}

/// Where a projection reads its input, for calibration observers ([`Model::forward_layer`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Site {
    /// Normed input of q/k/v (`[n][d]`).
    AttnIn,
    /// Attention output, input of o_proj (`[n][H*hd]`).
    OProjIn,
    /// Normed input of gate/up (`[n][d]`).
    MlpIn,
    /// `silu(gate) * up`, input of down_proj (`[n][I]`).
    DownProjIn,
}

impl Site {
    pub const ALL: [Site; 4] = [Site::AttnIn, Site::OProjIn, Site::MlpIn, Site::DownProjIn];
    /// The site a layer linear (`self_attn.q_proj`, ...) reads.
    pub fn of_linear(short: &str) -> Option<Site> {
        match short {
            "self_attn.q_proj" | "self_attn.k_proj" | "self_attn.v_proj" => Some(Site::AttnIn),
            "self_attn.o_proj" => Some(Site::OProjIn),
            "mlp.gate_proj" | "mlp.up_proj" => Some(Site::MlpIn),
            "mlp.down_proj" => Some(Site::DownProjIn),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Site::AttnIn => "attn_in",
            Site::OProjIn => "o_proj_in",
            Site::MlpIn => "mlp_in",
            Site::DownProjIn => "down_proj_in",
        }
    }
}

/// A Llama-family decoder: embeddings, layers, final norm and LM head.
#[derive(Debug)]
pub struct Model {
    config: ModelConfig,
    /// `[V][d]`, f16 like the dense weights (a lookup reads one row per token).
    embed_tokens: Vec<f16>,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    lm_head: Linear,
    /// Per-pair inverse frequencies, `hd/2` of them, after any `rope_scaling`.
    inv_freq: Vec<f64>,
    /// What caches made by [`Self::try_new_cache`] store (f16 unless set).
    kv_precision: KvPrecision,
}

/// The keys and values of every position seen so far (see the module header for the layout),
/// in f16 or 8 bits ([`KvPrecision`]).
#[derive(Clone, Debug)]
pub struct KvCache {
    store: KvStore,
    capacity: usize,
    len: usize,
    /// `Hkv * hd`, values per position per layer.
    row: usize,
    head_dim: usize,
}

/// The cache's arrays: `[layer][pos][Hkv][hd]` values, and for 8 bits `[layer][pos][Hkv]`
/// scales ([`sieve_formats::kv_cache`]).
#[derive(Clone, Debug)]
enum KvStore {
    F16 {
        k: Vec<f16>,
        v: Vec<f16>,
    },
    Int8 {
        k: Vec<i8>,
        v: Vec<i8>,
        k_scales: Vec<f32>,
        v_scales: Vec<f32>,
    },
}

impl KvCache {
    /// Positions already processed.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn precision(&self) -> KvPrecision {
        match self.store {
            KvStore::F16 { .. } => KvPrecision::F16,
            KvStore::Int8 { .. } => KvPrecision::Int8,
        }
    }
    /// Forgets the positions from `len` on (the next token runs at position `len`); a
    /// length past the current one is refused.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.len {
            return Err(ModelError::InvalidArgument(format!(
                "the cache holds {} positions; it cannot be cut to {len}",
                self.len
            )));
        }
        self.len = len;
        Ok(())
    }
    /// Bytes the cache holds (keys and values of every position it can take, and their scales).
    pub fn bytes(&self) -> usize {
        match &self.store {
            KvStore::F16 { k, v } => (k.len() + v.len()) * std::mem::size_of::<f16>(),
            KvStore::Int8 {
                k,
                v,
                k_scales,
                v_scales,
            } => k.len() + v.len() + (k_scales.len() + v_scales.len()) * std::mem::size_of::<f32>(),
        }
    }
    /// Forgets every position (the memory is reused).
    pub fn clear(&mut self) {
        self.len = 0;
    }
    fn layer_offset(&self, layer: usize) -> usize {
        layer * self.capacity * self.row
    }
    /// An empty cache of `layers` x `capacity` positions x `kv_heads` x `head_dim`, storing
    /// `precision` (sizes checked, allocation fallible).
    fn zeroed(
        layers: usize,
        capacity: usize,
        kv_heads: usize,
        head_dim: usize,
        precision: KvPrecision,
    ) -> Result<KvCache> {
        let row = kv_heads * head_dim;
        let size = sieve_formats::size::product(
            "KV cache (layers x positions x KV heads x head_dim)",
            &[layers, capacity, row],
        )?;
        let what = format!("{precision} KV cache for {capacity} positions");
        let store = match precision {
            KvPrecision::F16 => KvStore::F16 {
                k: zeroed(&what, size)?,
                v: zeroed(&what, size)?,
            },
            KvPrecision::Int8 => KvStore::Int8 {
                k: zeroed(&what, size)?,
                v: zeroed(&what, size)?,
                k_scales: zeroed(&what, size / head_dim.max(1))?,
                v_scales: zeroed(&what, size / head_dim.max(1))?,
            },
        };
        Ok(KvCache {
            store,
            capacity,
            len: 0,
            row,
            head_dim,
        })
    }
    /// Refuses a cache made for a model of another shape.
    fn check_for(&self, c: &ModelConfig) -> Result<()> {
        self.check_shape(c.num_layers, c.num_kv_heads, c.head_dim)
    }
    /// Refuses a cache that is not `layers` x capacity x `kv_heads` x `head_dim`.
    fn check_shape(&self, layers: usize, kv_heads: usize, head_dim: usize) -> Result<()> {
        let values = match &self.store {
            KvStore::F16 { k, .. } => k.len(),
            KvStore::Int8 { k, .. } => k.len(),
        };
        if self.row != kv_heads * head_dim
            || self.head_dim != head_dim
            || values != layers * self.capacity * self.row
        {
            return Err(ModelError::InvalidArgument(
                "KV cache was made for another model".into(),
            ));
        }
        Ok(())
    }
    /// Stores the keys and values (`[n][Hkv][hd]` each) of positions `pos..pos + n` of `layer`:
    /// rounded to f16, or quantized per (position, KV head) row.
    fn store(&mut self, layer: usize, pos: usize, keys: &[f32], values: &[f32]) {
        let at = self.layer_offset(layer) + pos * self.row;
        let span = at..at + keys.len();
        let hd = self.head_dim;
        match &mut self.store {
            KvStore::F16 { k, v } => {
                k[span.clone()].convert_from_f32_slice(keys);
                v[span].convert_from_f32_slice(values);
            }
            KvStore::Int8 {
                k,
                v,
                k_scales,
                v_scales,
            } => {
                let scales = at / hd..(at + keys.len()) / hd;
                let quantize = |x: &[f32], q: &mut [i8], s: &mut [f32]| {
                    for ((xr, qr), sr) in x.chunks_exact(hd).zip(q.chunks_exact_mut(hd)).zip(s) {
                        *sr = kv_cache::quantize_row(xr, qr);
                    }
                };
                quantize(keys, &mut k[span.clone()], &mut k_scales[scales.clone()]);
                quantize(values, &mut v[span], &mut v_scales[scales]);
            }
        }
    }
    /// The first `visible` positions of `layer`, as attention reads them.
    fn layer(&self, layer: usize, visible: usize) -> CachedLayer<'_> {
        let at = self.layer_offset(layer);
        let span = at..at + visible * self.row;
        match &self.store {
            KvStore::F16 { k, v } => CachedLayer::F16 {
                keys: &k[span.clone()],
                values: &v[span],
            },
            KvStore::Int8 {
                k,
                v,
                k_scales,
                v_scales,
            } => {
                let scales = at / self.head_dim..(at + visible * self.row) / self.head_dim;
                CachedLayer::Int8 {
                    keys: &k[span.clone()],
                    values: &v[span],
                    key_scales: &k_scales[scales.clone()],
                    value_scales: &v_scales[scales],
                }
            }
        }
    }
}

/// Arrays whose all-zero bit pattern is the value zero.
trait ZeroBits: Copy {}
impl ZeroBits for f16 {}
impl ZeroBits for i8 {}
impl ZeroBits for f32 {}

/// `len` zero values, allocated fallibly: a cache the machine cannot hold is an error naming
/// its size. The memory comes zeroed from the allocator, so pages never written stay unmapped.
fn zeroed<T: ZeroBits>(what: &str, len: usize) -> Result<Vec<T>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let too_big = || {
        ModelError::from(sieve_formats::FormatError::Size(format!(
            "{what}: {len} values of {} bytes cannot be allocated",
            std::mem::size_of::<T>()
        )))
    };
    let layout = std::alloc::Layout::array::<T>(len).map_err(|_| too_big())?;
    // SAFETY: `layout` has a non-zero size (len > 0 and every ZeroBits type has a size); the
    // pointer is checked for null; all-zero bits are the value 0 of every ZeroBits type (f16
    // +0.0, i8 0, f32 +0.0), so every element is initialized; the Vec takes ownership with the
    // length, capacity and layout the global allocator was asked for.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout) as *mut T;
        if ptr.is_null() {
            return Err(too_big());
        }
        Ok(Vec::from_raw_parts(ptr, len, len))
    }
}

/// Which logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// `[V]`, for the last token of the call (generation).
    Last,
    /// `[n][V]`, for every token of the call (perplexity).
    All,
}

fn shape_error(name: &str, expected: &[usize], actual: &[usize]) -> ModelError {
    ModelError::TensorShape {
        name: name.to_string(),
        expected: expected.to_vec(),
        actual: actual.to_vec(),
    }
}

fn load(source: &dyn TensorSource, name: &str, expected: &[usize]) -> Result<Tensor> {
    let t = source.tensor(name)?;
    if t.shape != expected || t.data.len() != t.numel() {
        return Err(shape_error(name, expected, &t.shape));
    }
    if let Some(i) = t.data.iter().position(|v| !v.is_finite()) {
        return Err(ModelError::BadTensor {
            name: name.to_string(),
            reason: format!("non-finite value {} at element {i}", t.data[i]),
        });
    }
    Ok(t)
}

/// The config's own checks ([`ModelConfig::check`]); the readers ran them already with the
/// names their files use, this guards models assembled from any other source.
fn check_config(c: &ModelConfig) -> Result<()> {
    c.check(&|field| field.to_string())
}

/// Rows of q_proj (`H * hd`) and of k_proj / v_proj (`Hkv * hd`), checked.
fn projection_rows(c: &ModelConfig) -> Result<(usize, usize)> {
    Ok((
        sieve_formats::size::product(
            "q_proj rows (num_heads x head_dim)",
            &[c.num_heads, c.head_dim],
        )?,
        sieve_formats::size::product(
            "k_proj rows (num_kv_heads x head_dim)",
            &[c.num_kv_heads, c.head_dim],
        )?,
    ))
}

/// Inverse RoPE frequencies per pair, with Llama-3 scaling applied when configured.
pub fn rope_inv_freq(head_dim: usize, theta: f32, scaling: Option<&RopeScaling>) -> Vec<f64> {
    let half = head_dim / 2;
    (0..half)
        .map(|i| {
            let f = (theta as f64).powf(-((2 * i) as f64) / head_dim as f64);
            match scaling {
                None => f,
                Some(s) => {
                    let old = s.original_max_position_embeddings as f64;
                    let low_wavelen = old / s.low_freq_factor as f64;
                    let high_wavelen = old / s.high_freq_factor as f64;
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / s.factor as f64
                    } else {
                        let smooth = (old / wavelen - s.low_freq_factor as f64)
                            / (s.high_freq_factor - s.low_freq_factor) as f64;
                        (1.0 - smooth) * f / s.factor as f64 + smooth * f
                    }
                }
            }
        })
        .collect()
}

/// Refuses a buffer that is not `n >= 1` rows of `width` floats.
fn check_rows(what: &str, buf: &[f32], n: usize, width: usize) -> Result<()> {
    if n == 0 || buf.len() != n.saturating_mul(width) {
        return Err(ModelError::InvalidArgument(format!(
            "{what}: {} floats is not {n} rows of {width}",
            buf.len()
        )));
    }
    Ok(())
}

fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (row, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let scale = 1.0 / (ms + eps).sqrt();
        for ((o, v), w) in o.iter_mut().zip(row).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// Rotates every head of every row in place (rotate-half convention).
fn apply_rope(buf: &mut [f32], heads: usize, head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for (t, row) in buf.chunks_exact_mut(heads * head_dim).enumerate() {
        let (c, s) = (
            &cos[t * half..(t + 1) * half],
            &sin[t * half..(t + 1) * half],
        );
        for head in row.chunks_exact_mut(head_dim) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (x0, x1) = (a[i], b[i]);
                a[i] = x0 * c[i] - x1 * s[i];
                b[i] = x1 * c[i] + x0 * s[i];
            }
        }
    }
}

/// `x += y`, the residual addition after o_proj and down_proj.
fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

impl Model {
    /// Loads a model for inference: linears the source stores in GGUF Q4_0/Q4_1/Q5_0/Q5_1/
    /// Q8_0/Q4_K/Q5_K/Q6_K blocks
    /// keep them ([`sieve_cpu::gguf_blocks::QuantMatrix`], multiplied with 8-bit activation
    /// blocks: a third of the f16 bytes per decoded token), every other linear is dense f16.
    pub fn from_source(source: &dyn TensorSource) -> Result<Self> {
        Self::assemble(source, &mut |name, stored_as, shape, loaded| {
            if let Some(q) = source.quantized_matrix(stored_as)? {
                return Ok(Linear::from_quantized(q));
            }
            match loaded {
                Some(t) => Linear::from_tensor(name, t),
                None => Linear::from_tensor(name, &load(source, stored_as, &shape)?),
            }
        })
    }

    /// Loads a model with every linear dequantized to dense f16 and products on f32
    /// activations: the model that pruning calibrates and prunes (`sieve pack`).
    pub fn from_source_f16(source: &dyn TensorSource) -> Result<Self> {
        Self::from_source_with(source, Linear::from_tensor)
    }

    /// Loads a model, building every linear (`name` is the full Hugging Face weight name, e.g.
    /// `model.layers.3.mlp.up_proj.weight` or `lm_head.weight`) from its f32 tensor with
    /// `make_linear`. Biases are attached afterwards, so `make_linear` only provides the weight
    /// matrix. With tied embeddings the LM head is built from `model.embed_tokens.weight` under
    /// the name `lm_head.weight`.
    pub fn from_source_with<F>(source: &dyn TensorSource, mut make_linear: F) -> Result<Self>
    where
        F: FnMut(&str, &Tensor) -> Result<Linear>,
    {
        Self::assemble(source, &mut |name, stored_as, shape, loaded| match loaded {
            Some(t) => make_linear(name, t),
            None => make_linear(name, &load(source, stored_as, &shape)?),
        })
    }

    /// The loader behind the `from_source*` constructors: `make(name, stored_as, shape,
    /// loaded)` builds linear `name` from the source's tensor `stored_as` (the embeddings for a
    /// tied head, then already `loaded` as f32).
    #[allow(clippy::type_complexity)]
    fn assemble(
        source: &dyn TensorSource,
        make: &mut dyn FnMut(&str, &str, [usize; 2], Option<&Tensor>) -> Result<Linear>,
    ) -> Result<Self> {
        let c = source.config().clone();
        check_config(&c)?;
        let names = source.tensor_names();
        c.check_layers_present(names.iter().map(String::as_str), &|f| f.to_string())?;
        let (d, hd, inter) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (q_out, kv_out) = projection_rows(&c)?;

        let mut build = |name: &str,
                         stored_as: &str,
                         shape: [usize; 2],
                         loaded: Option<&Tensor>|
         -> Result<Linear> {
            let lin = make(name, stored_as, shape, loaded)?;
            if lin.rows() != shape[0] || lin.cols() != shape[1] {
                return Err(shape_error(name, &shape, &[lin.rows(), lin.cols()]));
            }
            Ok(lin)
        };

        let embed = load(source, "model.embed_tokens.weight", &[c.vocab_size, d])?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let p = format!("model.layers.{l}");
            let shapes = [
                [q_out, d],
                [kv_out, d],
                [kv_out, d],
                [d, q_out],
                [inter, d],
                [inter, d],
                [d, inter],
            ];
            let mut lin = Vec::with_capacity(7);
            for (short, shape) in LAYER_LINEARS.iter().zip(shapes) {
                let name = format!("{p}.{short}.weight");
                let mut linear = build(&name, &name, shape, None)?;
                let bias_name = format!("{p}.{short}.bias");
                let wants_bias = c.attention_bias
                    && short.starts_with("self_attn.")
                    && !short.ends_with("o_proj");
                if wants_bias || source.contains(&bias_name) {
                    let b = load(source, &bias_name, &[shape[0]])?;
                    linear = linear.with_bias(b.data)?;
                }
                lin.push(linear);
            }
            let mut it = lin.into_iter();
            let mut next = || {
                it.next()
                    .ok_or_else(|| ModelError::InvalidArgument("layer linears".into()))
            };
            layers.push(Layer {
                input_norm: load(source, &format!("{p}.input_layernorm.weight"), &[d])?.data,
                post_attention_norm: load(
                    source,
                    &format!("{p}.post_attention_layernorm.weight"),
                    &[d],
                )?
                .data,
                q_proj: next()?,
                k_proj: next()?,
                v_proj: next()?,
                o_proj: next()?,
                gate_proj: next()?,
                up_proj: next()?,
                down_proj: next()?,
            });
        }
        let final_norm = load(source, "model.norm.weight", &[d])?.data;
        // A tied head reuses the embedding matrix; a file without `lm_head.weight` is tied too.
        let head_shape = [c.vocab_size, d];
        let lm_head = if !c.tie_word_embeddings && source.contains("lm_head.weight") {
            build("lm_head.weight", "lm_head.weight", head_shape, None)?
        } else {
            build(
                "lm_head.weight",
                "model.embed_tokens.weight",
                head_shape,
                Some(&embed),
            )?
        };
        let inv_freq = rope_inv_freq(hd, c.rope_theta, c.rope_scaling.as_ref());
        Ok(Self {
            embed_tokens: embed.data.iter().map(|&v| f16::from_f32(v)).collect(),
            layers,
            final_norm,
            lm_head,
            inv_freq,
            kv_precision: KvPrecision::F16,
            config: c,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }
    pub fn layers_mut(&mut self) -> &mut [Layer] {
        &mut self.layers
    }
    pub fn lm_head(&self) -> &Linear {
        &self.lm_head
    }
    pub fn lm_head_mut(&mut self) -> &mut Linear {
        &mut self.lm_head
    }

    /// Every linear with its Hugging Face weight name, e.g. to set TEAL thresholds.
    pub fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        let mut out = Vec::new();
        for (l, layer) in self.layers.iter_mut().enumerate() {
            for (short, lin) in layer.linears_mut() {
                out.push((format!("model.layers.{l}.{short}.weight"), lin));
            }
        }
        out.push(("lm_head.weight".to_string(), &mut self.lm_head));
        out
    }

    /// Rounds the inputs of every layer's linears to INT8 per token before their products
    /// ([`Linear::set_int8_inputs`]; not the LM head, which the GPU keeps in f16): the CPU's
    /// measure of `--activations int8`.
    pub fn set_int8_inputs(&mut self, on: bool) {
        for layer in &mut self.layers {
            for (_, lin) in layer.linears_mut() {
                lin.set_int8_inputs(on);
            }
        }
    }

    /// Makes every cache made from now on ([`Self::try_new_cache`]) store `precision`
    /// (`--kv-cache`); caches made before keep theirs.
    pub fn set_kv_precision(&mut self, precision: KvPrecision) {
        self.kv_precision = precision;
    }
    pub fn kv_precision(&self) -> KvPrecision {
        self.kv_precision
    }

    /// An empty cache for `capacity` positions, capped at the model's `max_position_embeddings`.
    /// Panics only when the cache cannot be allocated; [`Self::try_new_cache`] returns that as an
    /// error instead (every command-line path uses it).
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        match self.try_new_cache(capacity) {
            Ok(cache) => cache,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`Self::new_cache`], with the size checked ([`sieve_formats::size`]) and the allocation
    /// fallible: a cache the machine cannot hold is [`ModelError::Format`] naming its size.
    pub fn try_new_cache(&self, capacity: usize) -> Result<KvCache> {
        self.try_new_cache_as(capacity, self.kv_precision)
    }

    /// [`Self::try_new_cache`] storing `precision` whatever the model is set to (benchmarks
    /// measure both on one loaded model).
    pub fn try_new_cache_as(&self, capacity: usize, precision: KvPrecision) -> Result<KvCache> {
        let c = &self.config;
        let capacity = capacity.min(c.max_position_embeddings);
        KvCache::zeroed(
            c.num_layers,
            capacity,
            c.num_kv_heads,
            c.head_dim,
            precision,
        )
    }

    /// Runs `tokens` at positions `cache.len()..`, appends their keys and values to the cache
    /// and returns logits (see [`Logits`]).
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache, which: Logits) -> Result<Vec<f32>> {
        let c = &self.config;
        let n = tokens.len();
        if n == 0 {
            return Err(ModelError::InvalidArgument("no tokens to run".into()));
        }
        cache.check_for(c)?;
        let p0 = cache.len;
        if p0 + n > cache.capacity {
            return Err(ModelError::ContextOverflow {
                tokens: p0 + n,
                context: cache.capacity,
            });
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(ModelError::InvalidArgument(format!(
                "token id {bad} is outside the vocabulary of {}",
                c.vocab_size
            )));
        }
        let (d, hd) = (c.hidden_size, c.head_dim);
        let (nh, nkv, inter) = (c.num_heads, c.num_kv_heads, c.intermediate_size);

        let mut clock = Clock::start();
        let mut x = vec![0f32; n * d];
        for (t, &tok) in tokens.iter().enumerate() {
            let row = &self.embed_tokens[tok as usize * d..(tok as usize + 1) * d];
            kernels::f16_to_f32(row, &mut x[t * d..(t + 1) * d]);
        }
        let (cos, sin) = self.rope_tables(p0, n);

        let mut xn = vec![0f32; n * d];
        let mut q = vec![0f32; n * nh * hd];
        let mut k = vec![0f32; n * nkv * hd];
        let mut v = vec![0f32; n * nkv * hd];
        let mut att = vec![0f32; n * nh * hd];
        let mut proj = vec![0f32; n * d];
        let mut gate = vec![0f32; n * inter];
        let mut up = vec![0f32; n * inter];
        clock.lap(Phase::Embed);
        // The layer as the plan writes it; each arm is this executor's kernel for the op.
        for (l, layer) in self.layers.iter().enumerate() {
            for op in plan::LAYER {
                match op {
                    LayerOp::Norm(which) => {
                        rms_norm(&x, layer.norm(which), c.rms_norm_eps, &mut xn)
                    }
                    LayerOp::Product(Group::Qkv) => Linear::forward_group(
                        &layer.group(Group::Qkv),
                        &xn,
                        n,
                        &mut [&mut q, &mut k, &mut v],
                    )?,
                    LayerOp::RopeKv => {
                        apply_rope(&mut q, nh, hd, &cos, &sin);
                        apply_rope(&mut k, nkv, hd, &cos, &sin);
                        cache.store(l, p0, &k, &v);
                    }
                    LayerOp::Attention => {
                        self.attention_cached(&q, cache.layer(l, p0 + n), p0, n, &mut att);
                    }
                    LayerOp::Product(Group::O) => {
                        layer.o_proj.forward(&att, n, &mut proj)?;
                        add_into(&mut x, &proj);
                    }
                    LayerOp::Product(Group::GateUp) => Linear::forward_group(
                        &layer.group(Group::GateUp),
                        &xn,
                        n,
                        &mut [&mut gate, &mut up],
                    )?,
                    LayerOp::SwiGlu => {
                        for (g, u) in gate.iter_mut().zip(&up) {
                            *g = silu(*g) * u;
                        }
                    }
                    LayerOp::Product(Group::Down) => {
                        layer.down_proj.forward(&gate, n, &mut proj)?;
                        add_into(&mut x, &proj);
                    }
                }
                clock.lap(Phase::of(op));
            }
        }
        cache.len = p0 + n;

        let (normed, m) = self.final_normed(&x, n, which);
        let mut logits = vec![0f32; m * c.vocab_size];
        self.lm_head.forward(&normed, m, &mut logits)?;
        clock.lap(Phase::Head);
        Ok(logits)
    }

    /// The input embeddings of `tokens`, `[n][d]` f32.
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let d = self.config.hidden_size;
        if let Some(&bad) = tokens
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            return Err(ModelError::InvalidArgument(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.config.vocab_size
            )));
        }
        let mut x = vec![0f32; tokens.len() * d];
        for (t, &tok) in tokens.iter().enumerate() {
            let row = &self.embed_tokens[tok as usize * d..(tok as usize + 1) * d];
            kernels::f16_to_f32(row, &mut x[t * d..(t + 1) * d]);
        }
        Ok(x)
    }

    /// Runs decoder layer `layer` in place over the residual stream `x` (`[n][d]`) of one window
    /// of `n` tokens at positions `0..n` (causal attention inside the window, no cache), calling
    /// `observer` with the input of every projection site (`[n][K]` rows) before it is used.
    /// Calibration feeds stored hidden states through one layer at a time with this. It is a
    /// [`LayerWalk`] through the plan's layer, observed at each pause.
    pub fn forward_layer(
        &self,
        layer: usize,
        x: &mut [f32],
        n: usize,
        observer: &mut dyn FnMut(Site, &[f32], usize),
    ) -> Result<()> {
        let mut walk = self.walk_layer(layer, x, n)?;
        for group in Group::ALL {
            observer(group.site(), walk.input(self, group)?, n);
        }
        walk.finish(self)
    }

    /// Like [`Self::forward_layer`] but stops once `observer` has seen the down_proj input: for
    /// statistics passes, which need every site's input but not the layer's output (down_proj
    /// is a quarter of a Llama layer's products). `x` is left holding the residual stream after
    /// attention, not the layer output.
    pub fn observe_layer(
        &self,
        layer: usize,
        x: &mut [f32],
        n: usize,
        observer: &mut dyn FnMut(Site, &[f32], usize),
    ) -> Result<()> {
        let mut walk = self.walk_layer(layer, x, n)?;
        for group in Group::ALL {
            observer(group.site(), walk.input(self, group)?, n);
        }
        Ok(())
    }

    /// Layer `layer`, after checking that `x` holds `n >= 1` rows of `width` floats.
    fn checked_layer(&self, layer: usize, x: &[f32], n: usize) -> Result<&Layer> {
        let Some(lay) = self.layers.get(layer) else {
            return Err(ModelError::InvalidArgument(format!(
                "layer {layer} does not exist (the model has {})",
                self.layers.len()
            )));
        };
        check_rows("residual stream", x, n, self.config.hidden_size)?;
        Ok(lay)
    }

    /// Final norm and LM head over `n` rows of residual stream: `[n][V]` logits.
    pub fn logits_from_hidden(&self, x: &[f32], n: usize) -> Result<Vec<f32>> {
        let c = &self.config;
        if x.len() != n * c.hidden_size {
            return Err(ModelError::InvalidArgument(format!(
                "logits_from_hidden: {} floats is not {n} rows of {}",
                x.len(),
                c.hidden_size
            )));
        }
        let mut normed = vec![0f32; x.len()];
        rms_norm(x, &self.final_norm, c.rms_norm_eps, &mut normed);
        let mut logits = vec![0f32; n * c.vocab_size];
        self.lm_head.forward(&normed, n, &mut logits)?;
        Ok(logits)
    }

    /// The token embeddings, `[V][d]` f16 (for writing a `.sieve` file).
    pub fn embed_tokens(&self) -> &[f16] {
        &self.embed_tokens
    }
    pub fn final_norm(&self) -> &[f32] {
        &self.final_norm
    }

    /// Assembles a model from already-built parts (a `.sieve` file), checking every shape.
    pub fn from_parts(
        config: ModelConfig,
        embed_tokens: Vec<f16>,
        layers: Vec<Layer>,
        final_norm: Vec<f32>,
        lm_head: Linear,
    ) -> Result<Self> {
        check_config(&config)?;
        let c = &config;
        let (d, hd, inter) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (q_out, kv_out) = projection_rows(c)?;
        if embed_tokens.len() != sieve_formats::size::product("embeddings", &[c.vocab_size, d])? {
            return Err(shape_error(
                "model.embed_tokens.weight",
                &[c.vocab_size, d],
                &[embed_tokens.len()],
            ));
        }
        if final_norm.len() != d {
            return Err(shape_error("model.norm.weight", &[d], &[final_norm.len()]));
        }
        if layers.len() != c.num_layers {
            return Err(ModelError::Metadata {
                key: "num_layers".into(),
                reason: format!(
                    "config says {}, found {} layers",
                    c.num_layers,
                    layers.len()
                ),
            });
        }
        let check = |name: String, lin: &Linear, shape: [usize; 2]| -> Result<()> {
            if lin.rows() != shape[0] || lin.cols() != shape[1] {
                return Err(shape_error(&name, &shape, &[lin.rows(), lin.cols()]));
            }
            Ok(())
        };
        check("lm_head.weight".into(), &lm_head, [c.vocab_size, d])?;
        let shapes = [
            [q_out, d],
            [kv_out, d],
            [kv_out, d],
            [d, q_out],
            [inter, d],
            [inter, d],
            [d, inter],
        ];
        let mut layers = layers;
        for (l, layer) in layers.iter_mut().enumerate() {
            for norm in [&layer.input_norm, &layer.post_attention_norm] {
                if norm.len() != d {
                    return Err(shape_error(
                        &format!("model.layers.{l} norm"),
                        &[d],
                        &[norm.len()],
                    ));
                }
            }
            for ((short, lin), shape) in layer.linears_mut().into_iter().zip(shapes) {
                check(format!("model.layers.{l}.{short}.weight"), lin, shape)?;
            }
        }
        let inv_freq = rope_inv_freq(hd, c.rope_theta, c.rope_scaling.as_ref());
        Ok(Self {
            config,
            embed_tokens,
            layers,
            final_norm,
            lm_head,
            inv_freq,
            kv_precision: KvPrecision::F16,
        })
    }

    /// The final RMSNorm of the rows [`Logits`] asks for of the residual stream `x` (`n` rows):
    /// `(normed rows, how many)`.
    fn final_normed(&self, x: &[f32], n: usize, which: Logits) -> (Vec<f32>, usize) {
        let d = self.config.hidden_size;
        let rows = match which {
            Logits::Last => &x[(n - 1) * d..],
            Logits::All => x,
        };
        let m = rows.len() / d;
        let mut normed = vec![0f32; m * d];
        rms_norm(
            rows,
            &self.final_norm,
            self.config.rms_norm_eps,
            &mut normed,
        );
        (normed, m)
    }

    /// RoPE cos/sin tables for positions `p0..p0 + n`, `head_dim / 2` frequencies per position.
    fn rope_tables(&self, p0: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
        let half = self.inv_freq.len();
        let mut cos = vec![0f32; n * half];
        let mut sin = vec![0f32; n * half];
        for t in 0..n {
            let pos = (p0 + t) as f64;
            for (i, f) in self.inv_freq.iter().enumerate() {
                let (s, co) = (pos * f).sin_cos();
                cos[t * half + i] = co as f32;
                sin[t * half + i] = s as f32;
            }
        }
        (cos, sin)
    }

    /// [`Self::attention`] over one layer's cache (`[0, p0 + n)` positions, f16 or 8-bit):
    /// few queries (decode) read it in place, grouped by KV head
    /// ([`sieve_cpu::attention::attend_one`]); many (prefill) widen it to f32 for the blocked
    /// GEMMs, a small cost beside theirs.
    fn attention_cached(
        &self,
        q: &[f32],
        cache: CachedLayer,
        p0: usize,
        n: usize,
        att: &mut [f32],
    ) {
        if n >= ATTENTION_GEMM_MIN {
            let hd = self.config.head_dim;
            let (keys, values) = match cache {
                CachedLayer::F16 { keys, values } => {
                    let widen = |x: &[f16]| {
                        let mut out = vec![0f32; x.len()];
                        kernels::f16_to_f32(x, &mut out);
                        out
                    };
                    (widen(keys), widen(values))
                }
                CachedLayer::Int8 {
                    keys,
                    values,
                    key_scales,
                    value_scales,
                } => {
                    let widen = |x: &[i8], scales: &[f32]| {
                        let mut out = vec![0f32; x.len()];
                        for ((q, o), &s) in
                            x.chunks_exact(hd).zip(out.chunks_exact_mut(hd)).zip(scales)
                        {
                            kv_cache::dequantize_row(q, s, o);
                        }
                        out
                    };
                    (widen(keys, key_scales), widen(values, value_scales))
                }
            };
            return self.attention_blocked(q, &keys, &values, p0, n, att);
        }
        let c = &self.config;
        let heads = sieve_cpu::attention::Heads {
            q_heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
        };
        let width = c.num_heads * c.head_dim;
        for (t, (qt, out)) in q
            .chunks_exact(width)
            .zip(att.chunks_exact_mut(width))
            .enumerate()
        {
            sieve_cpu::attention::attend_one(heads, qt, cache, p0 + t + 1, out);
        }
    }

    /// Causal grouped-query attention of this call's `n` queries (positions `p0..p0+n`) over
    /// keys/values `[0, p0+n)` of one layer. Parallel over query heads.
    fn attention(
        &self,
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        p0: usize,
        n: usize,
        att: &mut [f32],
    ) {
        if n >= ATTENTION_GEMM_MIN {
            return self.attention_blocked(q, keys, values, p0, n, att);
        }
        let c = &self.config;
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let group = nh / nkv;
        let row = nkv * hd;
        let scale = 1.0 / (hd as f32).sqrt();
        let per_head: Vec<Vec<f32>> = (0..nh)
            .into_par_iter()
            .map(|h| {
                let kvh = h / group;
                let mut out = vec![0f32; n * hd];
                let mut scores = vec![0f32; p0 + n];
                for t in 0..n {
                    let visible = p0 + t + 1;
                    let qv = &q[(t * nh + h) * hd..(t * nh + h + 1) * hd];
                    let mut max = f32::NEG_INFINITY;
                    for (p, s) in scores[..visible].iter_mut().enumerate() {
                        let kv = &keys[p * row + kvh * hd..p * row + (kvh + 1) * hd];
                        *s = kernels::dot_f32(qv, kv) * scale;
                        max = max.max(*s);
                    }
                    let mut sum = 0f32;
                    for s in scores[..visible].iter_mut() {
                        *s = (*s - max).exp();
                        sum += *s;
                    }
                    let o = &mut out[t * hd..(t + 1) * hd];
                    for (p, s) in scores[..visible].iter().enumerate() {
                        let vv = &values[p * row + kvh * hd..p * row + (kvh + 1) * hd];
                        kernels::axpy(s / sum, vv, o);
                    }
                }
                out
            })
            .collect();
        for (h, out) in per_head.iter().enumerate() {
            for t in 0..n {
                att[(t * nh + h) * hd..(t * nh + h + 1) * hd]
                    .copy_from_slice(&out[t * hd..(t + 1) * hd]);
            }
        }
    }

    /// [`Self::attention`] for many queries: per (query head, block of [`ATTENTION_BLOCK`]
    /// queries) one GEMM for the scores against every key the block's last query sees, a
    /// causal softmax per row (keys past a query's position get weight 0), and one GEMM for
    /// the weighted values. Parallel over the (head, block) tasks.
    fn attention_blocked(
        &self,
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        p0: usize,
        n: usize,
        att: &mut [f32],
    ) {
        let c = &self.config;
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let group = nh / nkv;
        let row = nkv * hd;
        let scale = 1.0 / (hd as f32).sqrt();
        let blocks = n.div_ceil(ATTENTION_BLOCK);
        let outputs: Vec<(usize, usize, Vec<f32>)> = (0..nh * blocks)
            .into_par_iter()
            .map(|task| {
                // Larger (later) blocks first would balance better, but rayon's work stealing
                // already evens out the causal triangle across 2 to a few dozen threads.
                let (h, b) = (task / blocks, task % blocks);
                let kvh = h / group;
                let t0 = b * ATTENTION_BLOCK;
                let rows = (n - t0).min(ATTENTION_BLOCK);
                let visible = p0 + t0 + rows;
                let q_block = gemm::View {
                    data: q,
                    offset: t0 * nh * hd + h * hd,
                    row_stride: nh * hd,
                    col_stride: 1,
                };
                // Kᵀ: element (dim, key) = keys[key · row + kvh · hd + dim].
                let k_t = gemm::View {
                    data: keys,
                    offset: kvh * hd,
                    row_stride: 1,
                    col_stride: row,
                };
                let v = gemm::View {
                    data: values,
                    offset: kvh * hd,
                    row_stride: row,
                    col_stride: 1,
                };
                let mut scores = vec![0f32; rows * visible];
                let mut out = vec![0f32; rows * hd];
                // The views are in bounds by construction (q is [n][H][hd], keys/values are
                // [p0 + n][Hkv][hd]); a failure would be a bug, and leaves zeros.
                let ok = gemm::gemm(
                    rows,
                    visible,
                    hd,
                    q_block,
                    k_t,
                    &mut scores,
                    visible,
                    false,
                    false,
                )
                .is_ok();
                debug_assert!(ok);
                for (i, s) in scores.chunks_exact_mut(visible).enumerate() {
                    let seen = p0 + t0 + i + 1;
                    kernels::softmax_scaled(&mut s[..seen], scale);
                    s[seen..].fill(0.0);
                }
                let ok = gemm::gemm(
                    rows,
                    hd,
                    visible,
                    gemm::View::row_major(&scores, visible),
                    v,
                    &mut out,
                    hd,
                    false,
                    false,
                )
                .is_ok();
                debug_assert!(ok);
                (h, t0, out)
            })
            .collect();
        for (h, t0, out) in outputs {
            for (i, o) in out.chunks_exact(hd).enumerate() {
                let t = t0 + i;
                att[(t * nh + h) * hd..(t * nh + h + 1) * hd].copy_from_slice(o);
            }
        }
    }
}

/// Batched decode: one new token for each of several sequences, each with its own cache.
impl Model {
    /// Runs `tokens[i]` at position `caches[i].len()` of sequence `i`, appends its key and
    /// value to `caches[i]`, and returns `[n][V]` logits. Every projection runs once over the
    /// `n` rows ([`Linear::forward_rows_group`]), attention per sequence over its own cache;
    /// row `i` equals `forward(&[tokens[i]], caches[i], Logits::Last)` bit for bit, so a
    /// batched server answers exactly what single-sequence generation does. Nothing is
    /// changed when an argument is refused.
    pub fn decode_batch(&self, tokens: &[u32], caches: &mut [&mut KvCache]) -> Result<Vec<f32>> {
        let c = &self.config;
        let n = tokens.len();
        if n == 0 {
            return Err(ModelError::InvalidArgument("no tokens to run".into()));
        }
        if caches.len() != n {
            return Err(ModelError::InvalidArgument(format!(
                "{n} tokens but {} caches",
                caches.len()
            )));
        }
        for cache in caches.iter() {
            cache.check_for(c)?;
            if cache.len + 1 > cache.capacity {
                return Err(ModelError::ContextOverflow {
                    tokens: cache.len + 1,
                    context: cache.capacity,
                });
            }
        }
        let x_rows = self.embed(tokens)?;
        let (d, hd) = (c.hidden_size, c.head_dim);
        let (nh, nkv, inter) = (c.num_heads, c.num_kv_heads, c.intermediate_size);
        let positions: Vec<usize> = caches.iter().map(|c| c.len).collect();
        let tables: Vec<(Vec<f32>, Vec<f32>)> =
            positions.iter().map(|&p| self.rope_tables(p, 1)).collect();

        let mut x = x_rows;
        let mut xn = vec![0f32; n * d];
        let mut q = vec![0f32; n * nh * hd];
        let mut k = vec![0f32; n * nkv * hd];
        let mut v = vec![0f32; n * nkv * hd];
        let mut att = vec![0f32; n * nh * hd];
        let mut proj = vec![0f32; n * d];
        let mut gate = vec![0f32; n * inter];
        let mut up = vec![0f32; n * inter];
        let (qw, kw) = (nh * hd, nkv * hd);
        // The plan's layer again, with every product over the batch's rows and attention per
        // sequence over its own cache.
        for (l, layer) in self.layers.iter().enumerate() {
            for op in plan::LAYER {
                match op {
                    LayerOp::Norm(which) => {
                        rms_norm(&x, layer.norm(which), c.rms_norm_eps, &mut xn)
                    }
                    LayerOp::Product(Group::Qkv) => Linear::forward_rows_group(
                        &layer.group(Group::Qkv),
                        &xn,
                        n,
                        &mut [&mut q, &mut k, &mut v],
                    )?,
                    LayerOp::RopeKv => {
                        for (i, (cos, sin)) in tables.iter().enumerate() {
                            apply_rope(&mut q[i * qw..(i + 1) * qw], nh, hd, cos, sin);
                            apply_rope(&mut k[i * kw..(i + 1) * kw], nkv, hd, cos, sin);
                        }
                        for (i, cache) in caches.iter_mut().enumerate() {
                            let p0 = cache.len;
                            let rows = i * kw..(i + 1) * kw;
                            cache.store(l, p0, &k[rows.clone()], &v[rows]);
                        }
                    }
                    LayerOp::Attention => caches
                        .par_iter()
                        .zip(att.par_chunks_mut(qw))
                        .enumerate()
                        .for_each(|(i, (cache, out))| {
                            let p0 = cache.len;
                            let layer = cache.layer(l, p0 + 1);
                            self.attention_cached(&q[i * qw..(i + 1) * qw], layer, p0, 1, out);
                        }),
                    LayerOp::Product(Group::O) => {
                        layer.o_proj.forward_rows(&att, n, &mut proj)?;
                        add_into(&mut x, &proj);
                    }
                    LayerOp::Product(Group::GateUp) => Linear::forward_rows_group(
                        &layer.group(Group::GateUp),
                        &xn,
                        n,
                        &mut [&mut gate, &mut up],
                    )?,
                    LayerOp::SwiGlu => {
                        for (g, u) in gate.iter_mut().zip(&up) {
                            *g = silu(*g) * u;
                        }
                    }
                    LayerOp::Product(Group::Down) => {
                        layer.down_proj.forward_rows(&gate, n, &mut proj)?;
                        add_into(&mut x, &proj);
                    }
                }
            }
        }
        for cache in caches.iter_mut() {
            cache.len += 1;
        }
        let mut normed = vec![0f32; n * d];
        rms_norm(&x, &self.final_norm, c.rms_norm_eps, &mut normed);
        let mut logits = vec![0f32; n * c.vocab_size];
        self.lm_head.forward_rows(&normed, n, &mut logits)?;
        Ok(logits)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::collections::HashMap;

    /// An in-memory tensor source for tests.
    pub struct MemorySource {
        pub config: ModelConfig,
        pub tensors: HashMap<String, Tensor>,
    }

    impl TensorSource for MemorySource {
        fn config(&self) -> &ModelConfig {
            &self.config
        }
        fn tensor_names(&self) -> Vec<String> {
            self.tensors.keys().cloned().collect()
        }
        fn contains(&self, name: &str) -> bool {
            self.tensors.contains_key(name)
        }
        fn tensor(&self, name: &str) -> Result<Tensor> {
            self.tensors
                .get(name)
                .cloned()
                .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
        }
    }

    pub fn tiny_config() -> ModelConfig {
        ModelConfig {
            architecture: "llama".into(),
            vocab_size: 37,
            hidden_size: 24,
            intermediate_size: 40,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 6,
            max_position_embeddings: 64,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            attention_bias: false,
            tie_word_embeddings: true,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
        }
    }

    /// Random weights, already f16-representable so the f16 storage is exact and the reference
    /// below can be compared tightly.
    pub fn random_source(config: ModelConfig, seed: u64) -> MemorySource {
        let mut s = seed;
        let mut rand = |len: usize, scale: f32| -> Vec<f32> {
            (0..len)
                .map(|_| {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let u = ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5;
                    f16::from_f32(u * scale).to_f32()
                })
                .collect()
        };
        let c = &config;
        let (d, hd, i) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let mut t = HashMap::new();
        let mut put = |name: String, shape: Vec<usize>, scale: f32| {
            let n = shape.iter().product();
            t.insert(
                name,
                Tensor {
                    shape,
                    data: rand(n, scale),
                },
            );
        };
        put(
            "model.embed_tokens.weight".into(),
            vec![c.vocab_size, d],
            2.0,
        );
        put("model.norm.weight".into(), vec![d], 2.0);
        if !c.tie_word_embeddings {
            put("lm_head.weight".into(), vec![c.vocab_size, d], 1.0);
        }
        for l in 0..c.num_layers {
            let p = format!("model.layers.{l}");
            put(format!("{p}.input_layernorm.weight"), vec![d], 2.0);
            put(format!("{p}.post_attention_layernorm.weight"), vec![d], 2.0);
            put(
                format!("{p}.self_attn.q_proj.weight"),
                vec![c.num_heads * hd, d],
                1.0,
            );
            put(
                format!("{p}.self_attn.k_proj.weight"),
                vec![c.num_kv_heads * hd, d],
                1.0,
            );
            put(
                format!("{p}.self_attn.v_proj.weight"),
                vec![c.num_kv_heads * hd, d],
                1.0,
            );
            put(
                format!("{p}.self_attn.o_proj.weight"),
                vec![d, c.num_heads * hd],
                0.5,
            );
            put(format!("{p}.mlp.gate_proj.weight"), vec![i, d], 1.0);
            put(format!("{p}.mlp.up_proj.weight"), vec![i, d], 1.0);
            put(format!("{p}.mlp.down_proj.weight"), vec![d, i], 0.5);
            if c.attention_bias {
                put(
                    format!("{p}.self_attn.q_proj.bias"),
                    vec![c.num_heads * hd],
                    0.5,
                );
                put(
                    format!("{p}.self_attn.k_proj.bias"),
                    vec![c.num_kv_heads * hd],
                    0.5,
                );
                put(
                    format!("{p}.self_attn.v_proj.bias"),
                    vec![c.num_kv_heads * hd],
                    0.5,
                );
            }
        }
        MemorySource { config, tensors: t }
    }

    /// A straightforward f64 re-statement of the architecture: whole sequence at once, no cache,
    /// RoPE by explicit pair rotation, attention by explicit softmax. Returns `[n][V]` logits.
    fn reference_logits(src: &MemorySource, tokens: &[u32]) -> Vec<f64> {
        let c = &src.config;
        let get = |name: &str| {
            src.tensors[name]
                .data
                .iter()
                .map(|&v| v as f64)
                .collect::<Vec<f64>>()
        };
        let (d, hd, nh, nkv) = (c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads);
        let n = tokens.len();
        let matmul = |x: &[f64], w: &[f64], out_f: usize, in_f: usize| -> Vec<f64> {
            let mut y = vec![0.0; n * out_f];
            for t in 0..n {
                for o in 0..out_f {
                    y[t * out_f + o] = (0..in_f).map(|i| w[o * in_f + i] * x[t * in_f + i]).sum();
                }
            }
            y
        };
        let norm = |x: &[f64], w: &[f64]| -> Vec<f64> {
            let mut y = x.to_vec();
            for t in 0..n {
                let r = &x[t * d..(t + 1) * d];
                let ms = r.iter().map(|v| v * v).sum::<f64>() / d as f64;
                for j in 0..d {
                    y[t * d + j] = r[j] / (ms + c.rms_norm_eps as f64).sqrt() * w[j];
                }
            }
            y
        };
        let rope = |x: &mut [f64], heads: usize| {
            for t in 0..n {
                for h in 0..heads {
                    for i in 0..hd / 2 {
                        let f = (c.rope_theta as f64).powf(-2.0 * i as f64 / hd as f64);
                        let a = t as f64 * f;
                        let base = (t * heads + h) * hd;
                        let (x0, x1) = (x[base + i], x[base + i + hd / 2]);
                        x[base + i] = x0 * a.cos() - x1 * a.sin();
                        x[base + i + hd / 2] = x0 * a.sin() + x1 * a.cos();
                    }
                }
            }
        };
        let emb = get("model.embed_tokens.weight");
        let mut x: Vec<f64> = tokens
            .iter()
            .flat_map(|&t| emb[t as usize * d..(t as usize + 1) * d].to_vec())
            .collect();
        for l in 0..c.num_layers {
            let p = format!("model.layers.{l}");
            let bias = |y: &mut Vec<f64>, name: &str, width: usize| {
                if let Some(b) = src.tensors.get(name) {
                    for t in 0..n {
                        for j in 0..width {
                            y[t * width + j] += b.data[j] as f64;
                        }
                    }
                }
            };
            let xn = norm(&x, &get(&format!("{p}.input_layernorm.weight")));
            let mut q = matmul(
                &xn,
                &get(&format!("{p}.self_attn.q_proj.weight")),
                nh * hd,
                d,
            );
            let mut k = matmul(
                &xn,
                &get(&format!("{p}.self_attn.k_proj.weight")),
                nkv * hd,
                d,
            );
            let mut v = matmul(
                &xn,
                &get(&format!("{p}.self_attn.v_proj.weight")),
                nkv * hd,
                d,
            );
            bias(&mut q, &format!("{p}.self_attn.q_proj.bias"), nh * hd);
            bias(&mut k, &format!("{p}.self_attn.k_proj.bias"), nkv * hd);
            bias(&mut v, &format!("{p}.self_attn.v_proj.bias"), nkv * hd);
            rope(&mut q, nh);
            rope(&mut k, nkv);
            // The cache stores keys and values as f16.
            for x in k.iter_mut().chain(v.iter_mut()) {
                *x = f16::from_f64(*x).to_f64();
            }
            let mut att = vec![0.0; n * nh * hd];
            for h in 0..nh {
                let g = h / (nh / nkv);
                for t in 0..n {
                    let s: Vec<f64> = (0..=t)
                        .map(|u| {
                            (0..hd)
                                .map(|j| q[(t * nh + h) * hd + j] * k[(u * nkv + g) * hd + j])
                                .sum::<f64>()
                                / (hd as f64).sqrt()
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = s.iter().map(|v| (v - m).exp()).sum();
                    for u in 0..=t {
                        let pr = (s[u] - m).exp() / z;
                        for j in 0..hd {
                            att[(t * nh + h) * hd + j] += pr * v[(u * nkv + g) * hd + j];
                        }
                    }
                }
            }
            let o = matmul(
                &att,
                &get(&format!("{p}.self_attn.o_proj.weight")),
                d,
                nh * hd,
            );
            for j in 0..x.len() {
                x[j] += o[j];
            }
            let xn = norm(&x, &get(&format!("{p}.post_attention_layernorm.weight")));
            let i = c.intermediate_size;
            let g = matmul(&xn, &get(&format!("{p}.mlp.gate_proj.weight")), i, d);
            let u = matmul(&xn, &get(&format!("{p}.mlp.up_proj.weight")), i, d);
            let h: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let dn = matmul(&h, &get(&format!("{p}.mlp.down_proj.weight")), d, i);
            for j in 0..x.len() {
                x[j] += dn[j];
            }
        }
        let xn = norm(&x, &get("model.norm.weight"));
        let head = if c.tie_word_embeddings {
            emb
        } else {
            get("lm_head.weight")
        };
        matmul(&xn, &head, c.vocab_size, d)
    }

    fn assert_close(ours: &[f32], reference: &[f64]) {
        assert_eq!(ours.len(), reference.len());
        let scale = reference.iter().map(|v| v.abs()).fold(0.0, f64::max);
        for (i, (a, b)) in ours.iter().zip(reference).enumerate() {
            // f32 arithmetic against f64 over a few hundred accumulations: 1e-4 of the logit scale.
            assert!(
                ((*a as f64) - b).abs() <= 1e-4 * scale.max(1.0),
                "logit {i}: {a} vs {b} (scale {scale})"
            );
        }
    }

    const PROMPT: [u32; 9] = [1, 5, 9, 33, 7, 7, 20, 0, 36];

    fn check_against_reference(config: ModelConfig) {
        let src = random_source(config, 42);
        let model = Model::from_source(&src).unwrap();
        let reference = reference_logits(&src, &PROMPT);
        let v = src.config.vocab_size;

        // Prefill, every position.
        let mut cache = model.new_cache(32);
        let all = model.forward(&PROMPT, &mut cache, Logits::All).unwrap();
        assert_close(&all, &reference);
        assert_eq!(cache.len(), PROMPT.len());

        // Prefill part, then decode the rest token by token through the cache.
        let mut cache = model.new_cache(32);
        let first = model
            .forward(&PROMPT[..4], &mut cache, Logits::Last)
            .unwrap();
        assert_close(&first, &reference[3 * v..4 * v]);
        for t in 4..PROMPT.len() {
            let step = model
                .forward(&PROMPT[t..t + 1], &mut cache, Logits::Last)
                .unwrap();
            assert_close(&step, &reference[t * v..(t + 1) * v]);
        }
    }

    /// Long calls take the blocked GEMM attention (several query blocks, with and without
    /// cached positions before them); it must match the reference like the per-query loop.
    #[test]
    fn blocked_attention_matches_reference() {
        let config = ModelConfig {
            max_position_embeddings: 160,
            ..tiny_config()
        };
        let src = random_source(config, 5);
        let model = Model::from_source(&src).unwrap();
        let prompt: Vec<u32> = (0..150u32).map(|i| (i * 7 + 3) % 37).collect();
        let reference = reference_logits(&src, &prompt);
        let v = src.config.vocab_size;
        let mut cache = model.new_cache(160);
        let all = model.forward(&prompt, &mut cache, Logits::All).unwrap();
        assert_close(&all, &reference);
        let mut cache = model.new_cache(160);
        model
            .forward(&prompt[..10], &mut cache, Logits::Last)
            .unwrap();
        let rest = model
            .forward(&prompt[10..], &mut cache, Logits::All)
            .unwrap();
        assert_close(&rest, &reference[10 * v..]);
    }

    #[test]
    fn per_layer_forward_matches_forward() {
        let src = random_source(tiny_config(), 11);
        let model = Model::from_source(&src).unwrap();
        let n = PROMPT.len();
        let mut x = model.embed(&PROMPT).unwrap();
        let mut seen = Vec::new();
        for l in 0..model.layers().len() {
            model
                .forward_layer(l, &mut x, n, &mut |site, a, rows| {
                    assert_eq!(a.len() % rows, 0);
                    seen.push((site, a.len() / rows));
                })
                .unwrap();
        }
        let ours = model.logits_from_hidden(&x, n).unwrap();
        let full = model
            .forward(&PROMPT, &mut model.new_cache(16), Logits::All)
            .unwrap();
        for (a, b) in ours.iter().zip(&full) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
        }
        let c = tiny_config();
        assert_eq!(
            &seen[..4],
            &[
                (Site::AttnIn, c.hidden_size),
                (Site::OProjIn, c.num_heads * c.head_dim),
                (Site::MlpIn, c.hidden_size),
                (Site::DownProjIn, c.intermediate_size)
            ]
        );
        assert!(model
            .forward_layer(5, &mut x, n, &mut |_, _, _| {})
            .is_err());
        assert!(model
            .forward_layer(0, &mut x, n + 1, &mut |_, _, _| {})
            .is_err());
    }

    /// A walk paused at every product gives the inputs `forward_layer` observes and its output;
    /// weights changed during a pause are the ones the rest of the walk multiplies; a group
    /// already multiplied and bad shapes are refused.
    #[test]
    fn layer_walk_pauses_at_each_product_input() {
        let c = tiny_config();
        let src = random_source(c.clone(), 12);
        let mut model = Model::from_source(&src).unwrap();
        let n = PROMPT.len();
        let mut expected = model.embed(&PROMPT).unwrap();
        let mut x = expected.clone();
        for l in 0..model.layers().len() {
            let mut seen = Vec::new();
            model
                .forward_layer(l, &mut expected, n, &mut |site, a, _| {
                    seen.push((site, a.to_vec()))
                })
                .unwrap();
            let mut walk = model.walk_layer(l, &mut x, n).unwrap();
            assert_eq!(walk.rows(), n);
            for (group, (site, input)) in Group::ALL.into_iter().zip(&seen) {
                assert_eq!(group.site(), *site);
                assert_eq!(walk.input(&model, group).unwrap(), &input[..], "layer {l}");
                assert_eq!(walk.input(&model, group).unwrap(), &input[..], "again");
            }
            assert!(walk.input(&model, Group::GateUp).is_err());
            walk.finish(&model).unwrap();
            assert_eq!(x, expected, "layer {l}");
        }

        // A threshold above every activation set on o_proj while the walk waits before it:
        // o adds nothing, so the MLP's input is the norm of the layer's input alone.
        let x0 = model.embed(&PROMPT).unwrap();
        let mut x = x0.clone();
        let mut walk = model.walk_layer(0, &mut x, n).unwrap();
        walk.input(&model, Group::O).unwrap();
        model.layers_mut()[0]
            .o_proj
            .set_threshold(Some(1e30))
            .unwrap();
        let mlp_in = walk.input(&model, Group::GateUp).unwrap().to_vec();
        let mut xn = vec![0f32; n * c.hidden_size];
        rms_norm(
            &x0,
            &model.layers()[0].post_attention_norm,
            c.rms_norm_eps,
            &mut xn,
        );
        assert_eq!(mlp_in, xn);
        drop(walk);
        assert_eq!(x, x0);

        assert!(model.walk_layer(9, &mut x, n).is_err());
        assert!(model.walk_layer(0, &mut x[1..], n).is_err());
        assert!(model.walk_layer(0, &mut [], 0).is_err());
    }

    #[test]
    fn forward_matches_reference_tied_gqa() {
        check_against_reference(tiny_config());
    }

    #[test]
    fn forward_matches_reference_with_qkv_bias_and_separate_head() {
        let mut c = tiny_config();
        c.architecture = "qwen2".into();
        c.attention_bias = true;
        c.tie_word_embeddings = false;
        c.num_kv_heads = 1;
        check_against_reference(c);
    }

    #[test]
    fn forward_matches_reference_multi_head_attention() {
        let mut c = tiny_config();
        c.num_kv_heads = c.num_heads;
        check_against_reference(c);
    }

    #[test]
    fn batched_decode_equals_single_sequence_decode_bit_for_bit() {
        batched_decode_equals_single_sequence_decode(KvPrecision::F16);
    }

    #[test]
    fn batched_decode_equals_single_sequence_decode_with_an_int8_cache() {
        batched_decode_equals_single_sequence_decode(KvPrecision::Int8);
    }

    fn batched_decode_equals_single_sequence_decode(precision: KvPrecision) {
        let src = random_source(tiny_config(), 31);
        let mut model = Model::from_source(&src).unwrap();
        model.set_kv_precision(precision);
        let prompts: [&[u32]; 3] = [&[1, 5, 9], &[2], &[7, 3, 3, 8, 1]];
        let mut batched: Vec<KvCache> = Vec::new();
        let mut single: Vec<KvCache> = Vec::new();
        let mut next: Vec<u32> = Vec::new();
        for p in prompts {
            let mut a = model.new_cache(16);
            let mut b = model.new_cache(16);
            model.forward(p, &mut a, Logits::Last).unwrap();
            model.forward(p, &mut b, Logits::Last).unwrap();
            batched.push(a);
            single.push(b);
            next.push(p[0] + 10);
        }
        let vocab = model.config().vocab_size;
        for step in 0..4 {
            let mut refs: Vec<&mut KvCache> = batched.iter_mut().collect();
            let got = model.decode_batch(&next, &mut refs).unwrap();
            for (i, cache) in single.iter_mut().enumerate() {
                let want = model.forward(&[next[i]], cache, Logits::Last).unwrap();
                assert_eq!(
                    &got[i * vocab..(i + 1) * vocab],
                    &want[..],
                    "step {step} seq {i}"
                );
                assert_eq!(batched[i].len(), cache.len());
            }
            next = next.iter().map(|t| (t * 7 + 3) % vocab as u32).collect();
        }
        // A missing cache, a bad token and a full cache are refused, the caches untouched.
        let (first, rest) = batched.split_at_mut(1);
        let before = first[0].len();
        assert!(model.decode_batch(&[1], &mut []).is_err());
        assert!(model
            .decode_batch(&[1, 99_999], &mut [&mut first[0], &mut rest[0]])
            .is_err());
        assert_eq!(first[0].len(), before);
        let mut full = model.new_cache(1);
        model.forward(&[1], &mut full, Logits::Last).unwrap();
        assert!(matches!(
            model.decode_batch(&[1], &mut [&mut full]),
            Err(ModelError::ContextOverflow { .. })
        ));
    }

    /// The 8-bit cache against the f16 one on the same model: the same shape of work, logits
    /// close (each stored value within half a grid step, `max|row| / 254`), prefill through
    /// the GEMM path and token-by-token decode agreeing, `(hd + 4) / 2hd` of the bytes, and a
    /// cache refused by a model of another shape.
    #[test]
    fn int8_cache_tracks_the_f16_cache() {
        let config = tiny_config();
        let src = random_source(config.clone(), 5);
        let mut model = Model::from_source(&src).unwrap();
        let vocab = config.vocab_size;
        // Long enough for the blocked (GEMM) prefill path.
        let prompt: Vec<u32> = (0..40).map(|i| (i * 13 + 5) % vocab as u32).collect();
        let mut f16_cache = model.new_cache(64);
        let want = model.forward(&prompt, &mut f16_cache, Logits::All).unwrap();
        model.set_kv_precision(KvPrecision::Int8);
        let mut int8_cache = model.new_cache(64);
        assert_eq!(int8_cache.precision(), KvPrecision::Int8);
        assert_eq!(f16_cache.precision(), KvPrecision::F16);
        let rows = config.num_layers * 64 * config.num_kv_heads;
        assert_eq!(f16_cache.bytes(), 2 * rows * config.head_dim * 2);
        assert_eq!(int8_cache.bytes(), 2 * rows * (config.head_dim + 4));
        let got = model
            .forward(&prompt, &mut int8_cache, Logits::All)
            .unwrap();
        let spread = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst > 0.0, "the int8 cache changed nothing: is it used?");
        assert!(
            worst <= 0.05 * spread,
            "int8 logits moved {worst} (spread {spread})"
        );
        // Prefill (GEMM over the dequantized cache) and decode (8-bit loops) read the same
        // stored rows: the last prompt token decoded alone gives the prompt's last logits.
        let mut stepped = model.new_cache(64);
        model
            .forward(&prompt[..prompt.len() - 1], &mut stepped, Logits::Last)
            .unwrap();
        let last = model
            .forward(&prompt[prompt.len() - 1..], &mut stepped, Logits::Last)
            .unwrap();
        let tail = &got[(prompt.len() - 1) * vocab..];
        for (a, b) in last.iter().zip(tail) {
            assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
        }
        // The f16 cache on a model set to int8, and the int8 cache on a model of another
        // shape: the first works (caches keep their own precision), the second is refused.
        assert!(model.forward(&[1], &mut f16_cache, Logits::Last).is_ok());
        let mut other = tiny_config();
        other.num_kv_heads = 1;
        other.num_heads = 4;
        let other = Model::from_source(&random_source(other, 5)).unwrap();
        assert!(other.forward(&[1], &mut int8_cache, Logits::Last).is_err());
    }

    #[test]
    fn context_overflow_is_refused() {
        let model = Model::from_source(&random_source(tiny_config(), 1)).unwrap();
        let mut cache = model.new_cache(8);
        let err = model
            .forward(&PROMPT, &mut cache, Logits::Last)
            .unwrap_err();
        assert!(
            matches!(
                err,
                ModelError::ContextOverflow {
                    tokens: 9,
                    context: 8
                }
            ),
            "{err}"
        );
        model
            .forward(&PROMPT[..8], &mut cache, Logits::Last)
            .unwrap();
        let err = model.forward(&[3], &mut cache, Logits::Last).unwrap_err();
        assert!(
            matches!(
                err,
                ModelError::ContextOverflow {
                    tokens: 9,
                    context: 8
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn bad_tokens_and_bad_tensors_are_refused() {
        let model = Model::from_source(&random_source(tiny_config(), 1)).unwrap();
        let mut cache = model.new_cache(8);
        assert!(model.forward(&[37], &mut cache, Logits::Last).is_err());
        assert!(model.forward(&[], &mut cache, Logits::Last).is_err());

        let mut src = random_source(tiny_config(), 1);
        src.tensors
            .get_mut("model.layers.1.mlp.up_proj.weight")
            .unwrap()
            .shape = vec![24, 40];
        assert!(matches!(
            Model::from_source(&src).unwrap_err(),
            ModelError::TensorShape { .. }
        ));
        let mut src = random_source(tiny_config(), 1);
        src.tensors.remove("model.layers.0.input_layernorm.weight");
        assert!(matches!(
            Model::from_source(&src).unwrap_err(),
            ModelError::MissingTensor(_)
        ));
        let mut src = random_source(tiny_config(), 1);
        src.tensors.get_mut("model.norm.weight").unwrap().data[3] = f32::NAN;
        assert!(Model::from_source(&src).is_err());
        let mut src = random_source(tiny_config(), 1);
        src.config.num_kv_heads = 3;
        assert!(Model::from_source(&src).is_err());
    }

    #[test]
    fn custom_linears_are_used() {
        // Zeroing every layer's down projection through the builder must change the logits.
        let src = random_source(tiny_config(), 3);
        let dense = Model::from_source(&src).unwrap();
        let zeroed = Model::from_source_with(&src, |name, t| {
            if name.ends_with("mlp.down_proj.weight") {
                Linear::from_dense_f32(t.shape[0], t.shape[1], &vec![0.0; t.data.len()])
            } else {
                Linear::from_tensor(name, t)
            }
        })
        .unwrap();
        let a = dense
            .forward(&PROMPT, &mut dense.new_cache(16), Logits::Last)
            .unwrap();
        let b = zeroed
            .forward(&PROMPT, &mut zeroed.new_cache(16), Logits::Last)
            .unwrap();
        assert!(a.iter().zip(&b).any(|(x, y)| (x - y).abs() > 1e-3));
        let bad = Model::from_source_with(&src, |_, _| Linear::from_dense_f32(2, 2, &[0.0; 4]));
        assert!(matches!(bad.unwrap_err(), ModelError::TensorShape { .. }));
    }

    #[test]
    fn llama3_rope_scaling_keeps_high_and_scales_low_frequencies() {
        let s = RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let plain = rope_inv_freq(128, 500000.0, None);
        let scaled = rope_inv_freq(128, 500000.0, Some(&s));
        assert_eq!(plain[0], scaled[0]);
        assert!((scaled[63] - plain[63] / 8.0).abs() < 1e-15);
        for (a, b) in plain.iter().zip(&scaled) {
            assert!(b <= a && *b >= a / 8.0 - 1e-18);
        }
    }
}
