//! `TensorSource`: named tensors from any model file, in Hugging Face naming.
//!
//! Readers (GGUF, safetensors) translate their own names to the Hugging Face ones below, so the
//! forward pass is written once:
//! `model.embed_tokens.weight`, `model.norm.weight`, `lm_head.weight` (absent when tied),
//! `model.layers.{i}.input_layernorm.weight`, `model.layers.{i}.post_attention_layernorm.weight`,
//! `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight` (+ `.bias` for q/k/v when present),
//! `model.layers.{i}.mlp.{gate,up,down}_proj.weight`.
//!
//! GGUF stores Q and K rows permuted for its RoPE layout; the GGUF reader undoes that permutation
//! so every source yields the Hugging Face row order and the forward pass uses the HF RoPE
//! convention (rotate-half) for all sources.

use crate::config::ModelConfig;
use crate::error::Result;

/// A dense f32 tensor, row-major. A 2-D weight has `shape == [out_features, in_features]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl Tensor {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Anything that can hand out a model's config and its tensors by (Hugging Face) name.
pub trait TensorSource: Send + Sync {
    fn config(&self) -> &ModelConfig;
    /// Names of all tensors, in Hugging Face naming.
    fn tensor_names(&self) -> Vec<String>;
    fn contains(&self, name: &str) -> bool;
    /// Dequantizes (if needed) and returns the tensor as f32.
    fn tensor(&self, name: &str) -> Result<Tensor>;
}
