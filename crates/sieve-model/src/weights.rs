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
use sieve_cpu::gguf_blocks::QuantMatrix;

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
    /// [`QuantMatrix`] multiplies directly (GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
    /// Q6_K); `None` for any other
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
    if check_model_path(path)? {
        return Ok(Box::new(crate::safetensors_dir::SafetensorsModel::open(
            path,
        )?));
    }
    let mut magic = [0u8; 8];
    let read = {
        use std::io::Read;
        let mut f = open_regular(path)?;
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
    if (read >= 4 && &magic[..4] == b"GGUF") || path.extension().is_some_and(|e| e == "gguf") {
        return Ok(Box::new(crate::gguf::GgufModel::open(path)?));
    }
    if read == magic.len() && &magic == crate::packfile::MAGIC {
        return Err(ModelError::NotAModel {
            path: path.display().to_string(),
            reason: "it is a packed .sieve file, which holds already-encoded weights: `sieve \
                     generate` and `sieve eval` read it, but it cannot be opened as a source \
                     model (packs cannot be re-packed; pack the original GGUF or safetensors)"
                .into(),
        });
    }
    if path.extension().is_some_and(|e| e == "safetensors") {
        return Ok(Box::new(crate::safetensors_dir::SafetensorsModel::open(
            path,
        )?));
    }
    Err(ModelError::NotAModel {
        path: path.display().to_string(),
        reason: "neither a GGUF file, a .sieve pack, a .safetensors file nor a Hugging Face \
                 model directory"
            .into(),
    })
}

/// Checks, without opening it, that `path` is something a model can be read from: a directory
/// (`Ok(true)`) or a regular file (`Ok(false)`). FIFOs, sockets and devices are refused, since
/// opening a FIFO with no writer blocks forever and a device never ends.
pub fn check_model_path(path: &std::path::Path) -> Result<bool> {
    let meta = std::fs::metadata(path).map_err(|source| crate::ModelError::Io {
        path: path.display().to_string(),
        source,
    })?;
    if meta.is_dir() {
        return Ok(true);
    }
    check_regular(path, &meta)?;
    Ok(false)
}

fn check_regular(path: &std::path::Path, meta: &std::fs::Metadata) -> Result<()> {
    if meta.is_file() {
        return Ok(());
    }
    let kind = file_kind(meta);
    Err(crate::ModelError::NotAModel {
        path: path.display().to_string(),
        reason: format!("it is {kind}, not a regular file"),
    })
}

/// What a non-regular file is, in words.
pub fn file_kind(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_file() {
        "a regular file"
    } else {
        "not a regular file"
    }
}

/// Opens `path` for reading after checking (with `stat`, which never blocks) that it is a
/// regular file, so a FIFO or a device named as a model file is an error instead of a hang.
pub fn open_regular(path: &std::path::Path) -> Result<std::fs::File> {
    let io_err = |source| crate::ModelError::Io {
        path: path.display().to_string(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(io_err)?;
    check_regular(path, &meta)?;
    std::fs::File::open(path).map_err(io_err)
}

/// Reads a small regular file (a JSON config) whole, refusing one above `limit` bytes.
pub fn read_small_file(path: &std::path::Path, limit: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let file = open_regular(path)?;
    let mut bytes = Vec::new();
    // Reading one byte past the limit tells a file at the limit from a larger one, whatever
    // the metadata said (the file may grow while it is read).
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|source| crate::ModelError::Io {
            path: path.display().to_string(),
            source,
        })?;
    if bytes.len() as u64 > limit {
        return Err(crate::ModelError::Malformed {
            path: path.display().to_string(),
            reason: format!("larger than the {limit}-byte limit for this kind of file"),
        });
    }
    Ok(bytes)
}

/// Most bytes read from a JSON side file (`config.json`, a safetensors index,
/// `tokenizer_config.json`): 64 MiB, far above any real one.
pub const MAX_JSON_BYTES: u64 = 64 << 20;

/// Opens a text file (evaluation or calibration data) for streaming reads. Regular files and
/// pipes (`--data <(zcat text.gz)`) are accepted; directories and devices are refused, since a
/// device such as `/dev/zero` never ends.
pub fn open_text(path: &std::path::Path) -> Result<std::fs::File> {
    use std::os::unix::fs::FileTypeExt;
    let io_err = |source| crate::ModelError::Io {
        path: path.display().to_string(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(io_err)?;
    if !(meta.is_file() || meta.file_type().is_fifo()) {
        return Err(crate::ModelError::InvalidArgument(format!(
            "{} is {}, not a text file",
            path.display(),
            file_kind(&meta)
        )));
    }
    std::fs::File::open(path).map_err(io_err)
}
