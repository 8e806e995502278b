//! `GgufModel`: a GGUF file seen as a [`TensorSource`] in Hugging Face naming and layout.
//!
//! Three translations happen here:
//!
//! 1. **Names**: `token_embd` -> `model.embed_tokens`, `output_norm` -> `model.norm`, `output` ->
//!    `lm_head`, `blk.{i}.attn_{q,k,v}` -> `model.layers.{i}.self_attn.{q,k,v}_proj`,
//!    `attn_output` -> `o_proj`, `attn_norm` -> `input_layernorm`, `ffn_norm` ->
//!    `post_attention_layernorm`, `ffn_{gate,up,down}` -> `mlp.{gate,up,down}_proj` (`.weight` and
//!    `.bias` alike). Tensors with no Hugging Face counterpart (e.g. `rope_freqs.weight`) keep
//!    their GGUF name.
//! 2. **Shapes**: GGUF lists dims innermost-first, so `ne = [K, M]` is the row-major `[M, K]`
//!    matrix; the data needs no transposition, only the shape is reversed.
//! 3. **Q/K row order** (`llama` and `mistral` architectures only): llama.cpp's
//!    `convert_hf_to_gguf.py` permutes the rows of `q_proj` and `k_proj` (weights and biases) so
//!    that its RoPE kernel can rotate adjacent pairs: viewing the rows of one projection as
//!    `[n_head, 2, head_dim / 2]`, it swaps the last two axes, i.e. GGUF row
//!    `h * head_dim + 2 * i + j` holds HF row `h * head_dim + j * head_dim / 2 + i`
//!    (`n_head` is the KV-head count for `k_proj`). We apply the inverse, so every source yields
//!    Hugging Face row order and the forward pass uses HF rotate-half RoPE everywhere. `qwen2`
//!    files are converted without the permutation and are passed through unchanged.
//!
//! Llama 3.1-style RoPE scaling is stored by llama.cpp as per-frequency divisors in
//! `rope_freqs.weight`; [`llama3_scaling_from_factors`] recovers `RopeScaling` parameters that
//! reproduce them (and refuses files whose divisors follow no such rule).

use super::GgufFile;
use crate::config::{ModelConfig, RopeScaling};
use crate::error::{ModelError, Result};
use crate::tokenizer::GgufTokenizerSpec;
use crate::weights::{Tensor, TensorSource, TokenizerSource};
use sieve_cpu::gguf_blocks::{BlockType, QuantMatrix};
use std::collections::BTreeMap;
use std::path::Path;

/// Architectures whose GGUF tensors this module knows how to present.
pub const SUPPORTED_ARCHITECTURES: [&str; 3] = ["llama", "qwen2", "mistral"];

/// A GGUF model file: config from metadata, tensors dequantized on request.
pub struct GgufModel {
    file: GgufFile,
    config: ModelConfig,
    /// Hugging Face name -> GGUF name.
    hf_to_gguf: BTreeMap<String, String>,
    unpermute_qk: bool,
}

impl std::fmt::Debug for GgufModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufModel")
            .field("file", &self.file)
            .field("config", &self.config)
            .finish()
    }
}

impl GgufModel {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_file(GgufFile::open(path)?)
    }

    pub fn from_file(file: GgufFile) -> Result<Self> {
        let config = config_from_metadata(&file)?;
        let hf_to_gguf = file
            .tensors()
            .iter()
            .map(|t| (hf_name(&t.name), t.name.clone()))
            .collect::<BTreeMap<_, _>>();
        if hf_to_gguf.len() != file.tensors().len() {
            return Err(ModelError::Malformed {
                path: file.path().to_string(),
                reason: "two GGUF tensors map to the same Hugging Face name".into(),
            });
        }
        let arch = config.architecture.clone();
        config.check_layers_present(hf_to_gguf.keys().map(String::as_str), &|f| {
            gguf_key(&arch, f)
        })?;
        let unpermute_qk = matches!(config.architecture.as_str(), "llama" | "mistral");
        Ok(GgufModel {
            file,
            config,
            hf_to_gguf,
            unpermute_qk,
        })
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    pub fn tokenizer_spec(&self) -> Result<GgufTokenizerSpec> {
        self.file.tokenizer_spec()
    }

    /// The GGUF name and table entry of the Hugging Face-named tensor `hf_name`.
    fn entry(&self, hf_name: &str) -> Result<(&str, &super::GgufTensorInfo)> {
        let gguf_name = self
            .gguf_name(hf_name)
            .ok_or_else(|| ModelError::MissingTensor(hf_name.to_string()))?;
        let info = self
            .file
            .tensor_info(gguf_name)
            .ok_or_else(|| ModelError::MissingTensor(gguf_name.to_string()))?;
        Ok((gguf_name, info))
    }

    /// The GGUF name behind a Hugging Face tensor name.
    pub fn gguf_name(&self, hf_name: &str) -> Option<&str> {
        self.hf_to_gguf.get(hf_name).map(String::as_str)
    }

    /// Heads whose rows llama.cpp permuted, if `hf_name` is such a tensor in this file.
    fn permuted_heads(&self, hf_name: &str) -> Option<usize> {
        if !self.unpermute_qk {
            return None;
        }
        let is = |proj: &str| {
            hf_name.ends_with(&format!(".self_attn.{proj}.weight"))
                || hf_name.ends_with(&format!(".self_attn.{proj}.bias"))
        };
        if is("q_proj") {
            Some(self.config.num_heads)
        } else if is("k_proj") {
            Some(self.config.num_kv_heads)
        } else {
            None
        }
    }
}

impl TensorSource for GgufModel {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn tensor_names(&self) -> Vec<String> {
        self.hf_to_gguf.keys().cloned().collect()
    }

    fn contains(&self, name: &str) -> bool {
        self.hf_to_gguf.contains_key(name)
    }

    fn tensor(&self, name: &str) -> Result<Tensor> {
        let (gguf_name, info) = self.entry(name)?;
        let shape = info.shape();
        let mut data = self.file.tensor_f32(gguf_name)?;
        if let Some(n_head) = self.permuted_heads(name) {
            data =
                unpermute_rows(&data, &shape, n_head).map_err(|reason| ModelError::Malformed {
                    path: self.file.path().to_string(),
                    reason: format!("tensor '{gguf_name}': {reason}"),
                })?;
        }
        Ok(Tensor { shape, data })
    }

    fn quantized_matrix(&self, name: &str) -> Result<Option<QuantMatrix>> {
        let (gguf_name, info) = self.entry(name)?;
        let shape = info.shape();
        let (Some(ty), &[rows, cols]) = (BlockType::from_ggml(info.ggml_type), shape.as_slice())
        else {
            return Ok(None);
        };
        let malformed = |reason: String| ModelError::Malformed {
            path: self.file.path().to_string(),
            reason: format!("tensor '{gguf_name}': {reason}"),
        };
        let mut data = self.file.tensor_bytes(gguf_name)?.to_vec();
        if let Some(n_head) = self.permuted_heads(name) {
            // Rows are whole runs of blocks, so the permutation moves bytes as it moves floats.
            data = unpermute_rows(&data, &[rows], n_head).map_err(malformed)?;
        }
        QuantMatrix::new(ty, rows, cols, data)
            .map(Some)
            .map_err(|e| malformed(e.to_string()))
    }

    fn tokenizer_source(&self) -> Result<Option<TokenizerSource>> {
        if self.file.get("tokenizer.ggml.model").is_none() {
            return Ok(None);
        }
        Ok(Some(TokenizerSource::Gguf(Box::new(
            self.tokenizer_spec()?,
        ))))
    }
}

/// Inverse of llama.cpp's Q/K permutation over the rows (outermost dim) of a 1-D or 2-D tensor
/// (of floats, or of the bytes of quantized rows).
/// Returns why it cannot be applied when the row count does not split into `n_head` even heads.
pub fn unpermute_rows<T: Copy + Default>(
    data: &[T],
    shape: &[usize],
    n_head: usize,
) -> Result<Vec<T>, String> {
    let rows = shape.first().copied().unwrap_or(0);
    if n_head == 0 || !rows.is_multiple_of(2 * n_head) {
        return Err(format!(
            "{rows} rows do not split into {n_head} heads of even size"
        ));
    }
    let row_len = data.len().checked_div(rows).unwrap_or(0);
    if row_len * rows != data.len() {
        return Err(format!("{} values are not {rows} whole rows", data.len()));
    }
    let head_dim = rows / n_head;
    let half = head_dim / 2;
    let mut out = vec![T::default(); data.len()];
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                let gguf_row = h * head_dim + 2 * i + j;
                let hf_row = h * head_dim + j * half + i;
                out[hf_row * row_len..(hf_row + 1) * row_len]
                    .copy_from_slice(&data[gguf_row * row_len..(gguf_row + 1) * row_len]);
            }
        }
    }
    Ok(out)
}

/// The Hugging Face name of a GGUF tensor; names with no counterpart are returned unchanged.
pub fn hf_name(gguf_name: &str) -> String {
    let top = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(name) = top {
        return name.to_string();
    }
    let Some(rest) = gguf_name.strip_prefix("blk.") else {
        return gguf_name.to_string();
    };
    let Some((layer, rest)) = rest.split_once('.') else {
        return gguf_name.to_string();
    };
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
        return gguf_name.to_string();
    }
    let Some((part, suffix)) = rest.split_once('.') else {
        return gguf_name.to_string();
    };
    let hf_part = match part {
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return gguf_name.to_string(),
    };
    format!("model.layers.{layer}.{hf_part}.{suffix}")
}

fn meta_err(key: &str, reason: impl Into<String>) -> ModelError {
    ModelError::Metadata {
        key: key.to_string(),
        reason: reason.into(),
    }
}

fn required_usize(file: &GgufFile, key: &str) -> Result<usize> {
    file.get_usize(key)?.ok_or_else(|| meta_err(key, "absent"))
}

fn config_from_metadata(file: &GgufFile) -> Result<ModelConfig> {
    let architecture = file.architecture()?.to_string();
    if !SUPPORTED_ARCHITECTURES.contains(&architecture.as_str()) {
        return Err(ModelError::Unsupported(format!(
            "GGUF architecture '{architecture}'; supported: {}",
            SUPPORTED_ARCHITECTURES.join(", ")
        )));
    }
    let key = |k: &str| format!("{architecture}.{k}");
    let num_layers = required_usize(file, &key("block_count"))?;
    let hidden_size = required_usize(file, &key("embedding_length"))?;
    let intermediate_size = required_usize(file, &key("feed_forward_length"))?;
    let num_heads = required_usize(file, &key("attention.head_count"))?;
    let num_kv_heads = file
        .get_usize(&key("attention.head_count_kv"))?
        .unwrap_or(num_heads);
    // Zero counts are refused here, naming their key, before anything derives from them (a
    // zero embedding length used to surface as "partial rotary embeddings (64 of 0 ...)").
    for (name, value) in [
        ("block_count", num_layers),
        ("embedding_length", hidden_size),
        ("feed_forward_length", intermediate_size),
    ] {
        if value == 0 {
            return Err(meta_err(&key(name), "must be positive, got 0"));
        }
    }
    if num_heads == 0 {
        return Err(meta_err(
            &key("attention.head_count"),
            "must be positive, got 0",
        ));
    }
    if num_kv_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
        return Err(meta_err(
            &key("attention.head_count_kv"),
            format!("{num_kv_heads} KV heads do not divide {num_heads} attention heads"),
        ));
    }
    let head_dim = match file.get_usize(&key("attention.key_length"))? {
        Some(0) => {
            return Err(meta_err(
                &key("attention.key_length"),
                "must be positive, got 0",
            ))
        }
        Some(d) => d,
        None if hidden_size.is_multiple_of(num_heads) => hidden_size / num_heads,
        None => {
            return Err(meta_err(
                &key("attention.head_count"),
                format!("{num_heads} heads do not divide the hidden size {hidden_size}"),
            ))
        }
    };
    if let Some(v) = file.get_usize(&key("attention.value_length"))? {
        if v != head_dim {
            return Err(ModelError::Unsupported(format!(
                "value head size {v} different from key head size {head_dim}"
            )));
        }
    }
    if let Some(rot) = file.get_usize(&key("rope.dimension_count"))? {
        if rot != head_dim {
            return Err(ModelError::Unsupported(format!(
                "partial rotary embeddings ({rot} of {head_dim} head dimensions)"
            )));
        }
    }
    let max_position_embeddings = required_usize(file, &key("context_length"))?;
    let eps_key = key("attention.layer_norm_rms_epsilon");
    let rms_norm_eps = file
        .get_f32(&eps_key)?
        .ok_or_else(|| meta_err(&eps_key, "absent"))?;
    let rope_theta = file.get_f32(&key("rope.freq_base"))?.unwrap_or(10000.0);
    let rope_scaling = rope_scaling(file, &architecture, head_dim, rope_theta)?;

    let vocab_size = match file.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()) {
        Some(tokens) => tokens.len(),
        None => match file.get_usize(&key("vocab_size"))? {
            Some(v) => v,
            None => file
                .tensor_info("token_embd.weight")
                .and_then(|t| t.dims.get(1))
                .map(|&v| v as usize)
                .ok_or_else(|| {
                    meta_err(
                        "tokenizer.ggml.tokens",
                        "absent, and no vocab size or token embedding to infer it from",
                    )
                })?,
        },
    };
    if let Some(embd) = file.tensor_info("token_embd.weight") {
        if embd.dims != [hidden_size as u64, vocab_size as u64] {
            return Err(ModelError::TensorShape {
                name: "token_embd.weight".into(),
                expected: vec![vocab_size, hidden_size],
                actual: embd.shape(),
            });
        }
    }
    let mut eos_token_ids = Vec::new();
    // llama.cpp ends generation on any of these "end of generation" tokens.
    for k in [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ] {
        if let Some(id) = file.get_u32(k)? {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
    }
    let config = ModelConfig {
        vocab_size,
        hidden_size,
        intermediate_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        max_position_embeddings,
        rms_norm_eps,
        rope_theta,
        rope_scaling,
        attention_bias: file.tensor_info("blk.0.attn_q.bias").is_some(),
        tie_word_embeddings: file.tensor_info("output.weight").is_none(),
        bos_token_id: file.get_u32("tokenizer.ggml.bos_token_id")?,
        eos_token_ids,
        architecture,
    };
    config.check(&|f| gguf_key(&config.architecture, f))?;
    Ok(config)
}

/// The GGUF metadata key (or tensor) a [`ModelConfig`] field is read from, for error messages.
fn gguf_key(arch: &str, field: &str) -> String {
    let key = match field {
        "num_layers" => "block_count",
        "hidden_size" => "embedding_length",
        "intermediate_size" => "feed_forward_length",
        "num_heads" => "attention.head_count",
        "num_kv_heads" => "attention.head_count_kv",
        "head_dim" => "attention.key_length",
        "max_position_embeddings" => "context_length",
        "rms_norm_eps" => "attention.layer_norm_rms_epsilon",
        "rope_theta" => "rope.freq_base",
        "vocab_size" => return "tokenizer.ggml.tokens".into(),
        "bos_token_id" => return "tokenizer.ggml.bos_token_id".into(),
        "eos_token_id" => return "tokenizer.ggml.eos_token_id".into(),
        "rope_scaling" => return "rope_freqs.weight".into(),
        other => return other.into(),
    };
    format!("{arch}.{key}")
}

/// Llama 3 scaling when the file carries it; rejects every RoPE scaling scheme the config cannot
/// express rather than silently running the model with plain RoPE.
fn rope_scaling(
    file: &GgufFile,
    arch: &str,
    head_dim: usize,
    rope_theta: f32,
) -> Result<Option<RopeScaling>> {
    let type_key = format!("{arch}.rope.scaling.type");
    let factor_key = format!("{arch}.rope.scaling.factor");
    let kind = file.get_str(&type_key)?;
    let factor = file.get_f32(&factor_key)?;
    match kind {
        None | Some("none") => {
            if let Some(f) = factor.filter(|&f| f != 1.0 && f != 0.0) {
                if kind.is_none() {
                    return Err(ModelError::Unsupported(format!(
                        "RoPE scaling factor {f} without a scaling type"
                    )));
                }
            }
        }
        Some(other) => {
            return Err(ModelError::Unsupported(format!(
                "RoPE scaling type '{other}' (only unscaled RoPE is read from GGUF)"
            )))
        }
    }
    if let Some(f) = file.get_f32(&format!("{arch}.rope.scale_linear"))? {
        if f != 1.0 {
            return Err(ModelError::Unsupported(format!(
                "linear RoPE scaling by {f}"
            )));
        }
    }
    if file.tensor_info("rope_freqs.weight").is_none() {
        return Ok(None);
    }
    let factors = file.tensor_f32("rope_freqs.weight")?;
    if factors.iter().all(|&f| f == 1.0) {
        return Ok(None);
    }
    let original = file
        .get_usize(&format!("{arch}.rope.scaling.original_context_length"))?
        .unwrap_or(LLAMA3_ORIGINAL_CONTEXT);
    llama3_scaling_from_factors(&factors, head_dim, rope_theta, original)
        .map(Some)
        .ok_or_else(|| {
            ModelError::Unsupported(
                "rope_freqs.weight holds per-frequency RoPE factors that do not follow the Llama 3 \
                 scaling rule"
                    .into(),
            )
        })
}

/// Llama 3.1/3.2 were trained at 8192 positions before RoPE scaling.
const LLAMA3_ORIGINAL_CONTEXT: usize = 8192;

/// The Llama 3 rule maps each rotary frequency to a divisor: 1 for wavelengths below
/// `original / high_freq_factor`, `factor` above `original / low_freq_factor`, and a smooth blend
/// in between.
pub fn llama3_factor(wavelen: f64, s: &RopeScaling) -> f64 {
    let original = s.original_max_position_embeddings as f64;
    let (low, high, factor) = (
        s.low_freq_factor as f64,
        s.high_freq_factor as f64,
        s.factor as f64,
    );
    if wavelen < original / high {
        1.0
    } else if wavelen > original / low {
        factor
    } else {
        let smooth = (original / wavelen - low) / (high - low);
        1.0 / ((1.0 - smooth) / factor + smooth)
    }
}

/// llama.cpp stores Llama 3 RoPE scaling not as parameters but as the per-frequency divisors
/// (`rope_freqs.weight`). Recovers parameters that reproduce them: `factor` is the largest divisor,
/// and each blended divisor gives one linear equation `low (1 - s) + high s = original / wavelen`
/// in the two band edges. Only the band edges divided by `original` are identifiable, so
/// `original` comes from metadata or the Llama 3 default. Returns `None` when no parameters
/// reproduce every divisor within 0.1%.
pub fn llama3_scaling_from_factors(
    factors: &[f32],
    head_dim: usize,
    rope_theta: f32,
    original: usize,
) -> Option<RopeScaling> {
    if factors.len() * 2 != head_dim || factors.iter().any(|f| !f.is_finite() || *f < 1.0 - 1e-6) {
        return None;
    }
    let wavelens: Vec<f64> = (0..factors.len())
        .map(|i| {
            let inv_freq = (rope_theta as f64).powf(-(2.0 * i as f64) / head_dim as f64);
            2.0 * std::f64::consts::PI / inv_freq
        })
        .collect();
    let factor = factors.iter().fold(1.0f32, |a, &b| a.max(b)) as f64;
    let blended: Vec<(f64, f64)> = factors
        .iter()
        .zip(&wavelens)
        .filter(|(&f, _)| (f as f64) > 1.0 + 1e-4 && (f as f64) < factor - 1e-4)
        .map(|(&f, &w)| {
            let smooth = (1.0 / f as f64 - 1.0 / factor) / (1.0 - 1.0 / factor);
            (smooth, original as f64 / w)
        })
        .collect();
    let (low, high) = match (blended.first(), blended.last()) {
        (Some(&(s1, r1)), Some(&(s2, r2))) if (s2 - s1).abs() > 1e-6 => {
            // low (1 - s) + high s = r at both points.
            let det = (1.0 - s1) * s2 - s1 * (1.0 - s2);
            let low = (r1 * s2 - r2 * s1) / det;
            let high = ((1.0 - s1) * r2 - (1.0 - s2) * r1) / det;
            (low, high)
        }
        // Too few blended frequencies to pin the band: try Llama 3's published edges.
        _ => (1.0, 4.0),
    };
    if !(low > 0.0 && high > low) {
        return None;
    }
    let scaling = RopeScaling {
        factor: factor as f32,
        low_freq_factor: low as f32,
        high_freq_factor: high as f32,
        original_max_position_embeddings: original,
    };
    let reproduces = factors.iter().zip(&wavelens).all(|(&f, &w)| {
        let expected = llama3_factor(w, &scaling);
        ((f as f64) - expected).abs() <= 1e-3 * expected
    });
    reproduces.then_some(scaling)
}
