//! The architecture hyper-parameters of a Llama-family model, however they were stored.

use serde::{Deserialize, Serialize};

/// Everything the forward pass needs to know about the architecture.
/// Filled from GGUF metadata (`llama.*`, `qwen2.*`) or a Hugging Face `config.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// `llama`, `qwen2`, `mistral`, ... (GGUF `general.architecture` or HF `model_type`).
    pub architecture: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    /// Per-head dimension; usually hidden_size / num_heads.
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    /// Llama-3 style RoPE frequency scaling, when the model uses it.
    pub rope_scaling: Option<RopeScaling>,
    /// Whether q/k/v projections carry a bias (Qwen2 does).
    pub attention_bias: bool,
    /// Whether the LM head shares the token-embedding matrix.
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// Llama 3.1 "llama3" RoPE scaling parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}
