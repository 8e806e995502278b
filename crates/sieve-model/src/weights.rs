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
use crate::linear::quantized::QuantMatrix;

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
    /// The 2-D tensor in the quantized blocks the file stores it in, when those are blocks
    /// [`QuantMatrix`] multiplies directly (GGUF Q4_0, Q4_1, Q8_0); `None` for any other
    /// tensor, which [`Self::tensor`] then provides.
    fn quantized_matrix(&self, _name: &str) -> Result<Option<QuantMatrix>> {
        Ok(None)
    }
    /// Where this model's tokenizer is described, when the source knows.
    fn tokenizer_source(&self) -> Result<Option<TokenizerSource>> {
        Ok(None)
    }
}

/// Where a model's tokenizer lives: inside a GGUF file's metadata, or in Hugging Face files.
#[derive(Clone, Debug, PartialEq)]
pub enum TokenizerSource {
    Gguf(Box<crate::tokenizer::GgufTokenizerSpec>),
    TokenizerJson {
        tokenizer_json: std::path::PathBuf,
        /// `tokenizer_config.json` (chat template, add-BOS flag), when present.
        tokenizer_config: Option<std::path::PathBuf>,
    },
}

/// Opens a model in any supported layout:
/// - a GGUF file (recognised by its `GGUF` magic, whatever its extension);
/// - a Hugging Face model directory (`config.json` + `model.safetensors` or sharded
///   `model.safetensors.index.json`);
/// - a single `.safetensors` file with `config.json` next to it.
pub fn open_model(path: impl AsRef<std::path::Path>) -> Result<Box<dyn TensorSource>> {
    use crate::error::ModelError;
    let path = path.as_ref();
    let io_err = |source| ModelError::Io {
        path: path.display().to_string(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(io_err)?;
    if meta.is_dir() {
        return Ok(Box::new(crate::safetensors_dir::SafetensorsModel::open(
            path,
        )?));
    }
    let mut magic = [0u8; 4];
    let read = {
        use std::io::Read;
        let mut f = std::fs::File::open(path).map_err(io_err)?;
        let mut n = 0;
        while n < magic.len() {
            match f.read(&mut magic[n..]).map_err(io_err)? {
                0 => break,
                k => n += k,
            }
        }
        n
    };
    // A `.gguf` that lacks the magic still goes to the GGUF reader, which says what is wrong.
    if (read == magic.len() && &magic == b"GGUF") || path.extension().is_some_and(|e| e == "gguf") {
        return Ok(Box::new(crate::gguf::GgufModel::open(path)?));
    }
    if path.extension().is_some_and(|e| e == "safetensors") {
        return Ok(Box::new(crate::safetensors_dir::SafetensorsModel::open(
            path,
        )?));
    }
    Err(ModelError::Unsupported(format!(
        "{}: neither a GGUF file, a .safetensors file nor a Hugging Face model directory",
        path.display()
    )))
}
