//! Hugging Face model directories: `config.json` plus `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`. Shards are memory-mapped; f32, f16 and bf16 tensors are
//! converted to f32 on request. Tensor names are already the Hugging Face ones.
//!
//! Config fields read: `model_type` (`llama`, `qwen2`, `mistral`), `vocab_size`, `hidden_size`,
//! `intermediate_size`, `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`,
//! `head_dim`, `max_position_embeddings`, `rms_norm_eps`, `rope_theta`, `rope_scaling` (only
//! `llama3` or none), `attention_bias`, `tie_word_embeddings`, `bos_token_id`, `eos_token_id`.
//! Mistral's `sliding_window` is ignored (attention over the full context).

use crate::config::{ModelConfig, RopeScaling};
use crate::error::{ModelError, Result};
use crate::weights::{Tensor, TensorSource, TokenizerSource};
use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, TensorInfo};
use safetensors::SafeTensors;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

const SUPPORTED_MODEL_TYPES: [&str; 3] = ["llama", "qwen2", "mistral"];

struct Shard {
    path: String,
    map: Mmap,
    /// Absolute offset of the data section (8-byte length + JSON header).
    data_start: usize,
    infos: HashMap<String, TensorInfo>,
}

/// A Hugging Face model directory (or one `.safetensors` file with `config.json` beside it).
pub struct SafetensorsModel {
    dir: PathBuf,
    config: ModelConfig,
    shards: Vec<Shard>,
    /// Tensor name -> index into `shards`.
    index: BTreeMap<String, usize>,
}

impl std::fmt::Debug for SafetensorsModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsModel")
            .field("dir", &self.dir)
            .field("shards", &self.shards.len())
            .field("tensors", &self.index.len())
            .finish()
    }
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn malformed(path: &Path, reason: impl Into<String>) -> ModelError {
    ModelError::Malformed {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

impl SafetensorsModel {
    /// `path` is a model directory or a single `.safetensors` file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let (dir, shard_paths) = if path.is_dir() {
            (path.to_path_buf(), shard_files(path)?)
        } else {
            let dir = path
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_else(|| PathBuf::from("."));
            (dir, vec![path.to_path_buf()])
        };
        let mut shards = Vec::with_capacity(shard_paths.len());
        let mut index = BTreeMap::new();
        for shard_path in &shard_paths {
            let shard = open_shard(shard_path)?;
            for name in shard.infos.keys() {
                if index.insert(name.clone(), shards.len()).is_some() {
                    return Err(malformed(
                        shard_path,
                        format!("tensor '{name}' appears in more than one shard"),
                    ));
                }
            }
            shards.push(shard);
        }
        let config_path = dir.join("config.json");
        let text = crate::weights::read_small_file(&config_path, crate::weights::MAX_JSON_BYTES)?;
        let json: Value = serde_json::from_slice(&text)
            .map_err(|e| malformed(&config_path, format!("invalid JSON: {e}")))?;
        let has = |name: &str| index.contains_key(name);
        let config = config_from_json(&json, &config_path, &has)?;
        config.check_layers_present(index.keys().map(String::as_str), &|f| {
            format!("{}:{}", config_path.display(), hf_key(f))
        })?;
        Ok(SafetensorsModel {
            dir,
            config,
            shards,
            index,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `tokenizer.json` in the model directory, when present.
    pub fn tokenizer_json_path(&self) -> Option<PathBuf> {
        let p = self.dir.join("tokenizer.json");
        p.is_file().then_some(p)
    }

    /// `tokenizer_config.json` (chat template, special-token flags), when present.
    pub fn tokenizer_config_path(&self) -> Option<PathBuf> {
        let p = self.dir.join("tokenizer_config.json");
        p.is_file().then_some(p)
    }
}

/// The shard files of a directory: the index's files if there is an index, else the single file.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index_path = dir.join("model.safetensors.index.json");
    if index_path.is_file() {
        let text = crate::weights::read_small_file(&index_path, crate::weights::MAX_JSON_BYTES)?;
        let json: Value = serde_json::from_slice(&text)
            .map_err(|e| malformed(&index_path, format!("invalid JSON: {e}")))?;
        let map = json
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| malformed(&index_path, "no 'weight_map' object"))?;
        let mut files: Vec<&str> = Vec::new();
        for (name, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| malformed(&index_path, format!("'{name}' maps to a non-string")))?;
            // Shard names are plain file names; refusing paths keeps reads inside the directory.
            if file.contains('/') || file.contains('\\') || file == ".." {
                return Err(malformed(
                    &index_path,
                    format!("shard name '{file}' is a path"),
                ));
            }
            if !files.contains(&file) {
                files.push(file);
            }
        }
        files.sort_unstable();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    Err(ModelError::NotAModel {
        path: dir.display().to_string(),
        reason: "the directory has neither model.safetensors nor model.safetensors.index.json \
                 (a Hugging Face model directory needs one of them and config.json)"
            .into(),
    })
}

fn open_shard(path: &Path) -> Result<Shard> {
    let file = crate::weights::open_regular(path)?;
    // SAFETY: read-only map; as with any mmap loader, the file must not change while open.
    let map = unsafe { Mmap::map(&file) }.map_err(io_err(path))?;
    let (header_len, metadata) = SafeTensors::read_metadata(&map)
        .map_err(|e| malformed(path, format!("safetensors header: {e}")))?;
    let infos = metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| (name, info.clone()))
        .collect();
    Ok(Shard {
        path: path.display().to_string(),
        data_start: 8 + header_len,
        map,
        infos,
    })
}

impl TensorSource for SafetensorsModel {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn tensor_names(&self) -> Vec<String> {
        self.index.keys().cloned().collect()
    }

    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn tensor(&self, name: &str) -> Result<Tensor> {
        let shard = self
            .index
            .get(name)
            .map(|&i| &self.shards[i])
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        let info = shard
            .infos
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        let (start, end) = info.data_offsets;
        // read_metadata checked that the offsets tile the data section exactly.
        let bytes = &shard.map[shard.data_start + start..shard.data_start + end];
        let data: Vec<f32> = match info.dtype {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
                .collect(),
            other => {
                return Err(ModelError::Unsupported(format!(
                    "tensor '{name}' in {} has dtype {other:?}; only F32, F16 and BF16 are read",
                    shard.path
                )))
            }
        };
        Ok(Tensor {
            shape: info.shape.clone(),
            data,
        })
    }

    fn tokenizer_source(&self) -> Result<Option<TokenizerSource>> {
        Ok(self
            .tokenizer_json_path()
            .map(|tokenizer_json| TokenizerSource::TokenizerJson {
                tokenizer_json,
                tokenizer_config: self.tokenizer_config_path(),
            }))
    }
}

fn config_from_json(
    json: &Value,
    path: &Path,
    has_tensor: &dyn Fn(&str) -> bool,
) -> Result<ModelConfig> {
    let field_err = |key: &str, reason: &str| ModelError::Metadata {
        key: format!("{}:{key}", path.display()),
        reason: reason.to_string(),
    };
    let opt_usize = |key: &str| -> Result<Option<usize>> {
        match json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| field_err(key, "expected a non-negative integer")),
        }
    };
    let req_usize =
        |key: &str| -> Result<usize> { opt_usize(key)?.ok_or_else(|| field_err(key, "absent")) };
    let opt_f32 = |key: &str| -> Result<Option<f32>> {
        match json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| field_err(key, "expected a number")),
        }
    };
    let opt_bool = |key: &str| -> Result<Option<bool>> {
        match json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| field_err(key, "expected a bool")),
        }
    };
    let token_id = |v: &Value, key: &str| -> Result<u32> {
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| field_err(key, "expected a token id"))
    };

    let architecture = json
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| field_err("model_type", "absent or not a string"))?
        .to_string();
    if !SUPPORTED_MODEL_TYPES.contains(&architecture.as_str()) {
        return Err(ModelError::Unsupported(format!(
            "model_type '{architecture}'; supported: {}",
            SUPPORTED_MODEL_TYPES.join(", ")
        )));
    }
    let hidden_size = req_usize("hidden_size")?;
    let num_heads = req_usize("num_attention_heads")?;
    let num_kv_heads = opt_usize("num_key_value_heads")?.unwrap_or(num_heads);
    if num_heads == 0 {
        return Err(field_err("num_attention_heads", "must be positive, got 0"));
    }
    if num_kv_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
        return Err(field_err(
            "num_key_value_heads",
            &format!(
                "{num_kv_heads} must be positive and divide num_attention_heads ({num_heads})"
            ),
        ));
    }
    let head_dim = match opt_usize("head_dim")? {
        Some(d) => d,
        None if hidden_size.is_multiple_of(num_heads) => hidden_size / num_heads,
        None => {
            return Err(field_err(
                "num_attention_heads",
                "does not divide hidden_size",
            ))
        }
    };
    let rope_scaling = match json.get("rope_scaling") {
        None | Some(Value::Null) => None,
        Some(v) => {
            let kind = v
                .get("rope_type")
                .or_else(|| v.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("");
            match kind {
                "default" => None,
                "llama3" => {
                    let num = |k: &str| {
                        v.get(k)
                            .and_then(Value::as_f64)
                            .ok_or_else(|| field_err(&format!("rope_scaling.{k}"), "absent"))
                    };
                    Some(RopeScaling {
                        factor: num("factor")? as f32,
                        low_freq_factor: num("low_freq_factor")? as f32,
                        high_freq_factor: num("high_freq_factor")? as f32,
                        original_max_position_embeddings: num("original_max_position_embeddings")?
                            as usize,
                    })
                }
                other => {
                    return Err(ModelError::Unsupported(format!(
                        "rope_scaling type '{other}' (only 'llama3' is implemented)"
                    )))
                }
            }
        }
    };
    let bos_token_id = match json.get("bos_token_id") {
        None | Some(Value::Null) => None,
        Some(v) => Some(token_id(v, "bos_token_id")?),
    };
    let eos_token_ids = match json.get("eos_token_id") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| token_id(v, "eos_token_id"))
            .collect::<Result<_>>()?,
        Some(v) => vec![token_id(v, "eos_token_id")?],
    };
    let config = ModelConfig {
        vocab_size: req_usize("vocab_size")?,
        hidden_size,
        intermediate_size: req_usize("intermediate_size")?,
        num_layers: req_usize("num_hidden_layers")?,
        num_heads,
        num_kv_heads,
        head_dim,
        max_position_embeddings: req_usize("max_position_embeddings")?,
        rms_norm_eps: opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
        rope_theta: opt_f32("rope_theta")?.unwrap_or(10000.0),
        rope_scaling,
        attention_bias: opt_bool("attention_bias")?.unwrap_or(false)
            || has_tensor("model.layers.0.self_attn.q_proj.bias"),
        tie_word_embeddings: opt_bool("tie_word_embeddings")?.unwrap_or(false)
            || !has_tensor("lm_head.weight"),
        bos_token_id,
        eos_token_ids,
        architecture,
    };
    config.check(&|f| format!("{}:{}", path.display(), hf_key(f)))?;
    Ok(config)
}

/// The `config.json` key a [`ModelConfig`] field is read from, for error messages.
fn hf_key(field: &str) -> &str {
    match field {
        "num_layers" => "num_hidden_layers",
        "num_heads" => "num_attention_heads",
        "num_kv_heads" => "num_key_value_heads",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::open_model;
    use safetensors::tensor::TensorView;

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> Self {
            use std::sync::atomic::{AtomicUsize, Ordering};
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let dir =
                std::env::temp_dir().join(format!("sieve-st-{tag}-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn config_json(extra: &str) -> String {
        format!(
            r#"{{"model_type": "llama", "vocab_size": 4, "hidden_size": 8,
                "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                "num_key_value_heads": 1, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": [2, 3]{extra}}}"#
        )
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// Embedding (f32), final norm (f16), q_proj (bf16), one tensor per dtype.
    fn tiny_tensors() -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
        let embed: Vec<f32> = (0..32).map(|i| i as f32 * 0.25).collect();
        let norm: Vec<u8> = (0..8)
            .flat_map(|i| f16::from_f32(1.0 + i as f32).to_bits().to_le_bytes())
            .collect();
        let q: Vec<u8> = (0..64)
            .flat_map(|i| bf16::from_f32(i as f32 - 32.0).to_bits().to_le_bytes())
            .collect();
        vec![
            (
                "model.embed_tokens.weight".into(),
                Dtype::F32,
                vec![4, 8],
                f32_bytes(&embed),
            ),
            ("model.norm.weight".into(), Dtype::F16, vec![8], norm),
            (
                "model.layers.0.self_attn.q_proj.weight".into(),
                Dtype::BF16,
                vec![8, 8],
                q,
            ),
        ]
    }

    fn write_safetensors(path: &Path, tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) {
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        let bytes = safetensors::serialize(views, None).unwrap();
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn single_file_directory_round_trips_all_float_dtypes() {
        let dir = TempDir::new("single");
        std::fs::write(dir.0.join("config.json"), config_json("")).unwrap();
        std::fs::write(dir.0.join("tokenizer.json"), "{}").unwrap();
        write_safetensors(&dir.0.join("model.safetensors"), &tiny_tensors());

        let model = open_model(&dir.0).unwrap();
        let c = model.config();
        assert_eq!(
            (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim),
            (8, 2, 1, 4)
        );
        assert_eq!(
            (c.vocab_size, c.intermediate_size, c.num_layers),
            (4, 16, 1)
        );
        assert_eq!(c.bos_token_id, Some(1));
        assert_eq!(c.eos_token_ids, [2, 3]);
        assert!(c.tie_word_embeddings, "no lm_head.weight in the files");
        assert!(!c.attention_bias);
        assert_eq!(model.tensor_names().len(), 3);
        let embed = model.tensor("model.embed_tokens.weight").unwrap();
        assert_eq!(embed.shape, [4, 8]);
        assert_eq!(embed.data[31], 7.75);
        let norm = model.tensor("model.norm.weight").unwrap();
        assert_eq!(
            norm.data,
            (0..8).map(|i| 1.0 + i as f32).collect::<Vec<_>>()
        );
        let q = model
            .tensor("model.layers.0.self_attn.q_proj.weight")
            .unwrap();
        assert_eq!(q.shape, [8, 8]);
        assert_eq!(q.data[0], -32.0);
        assert_eq!(q.data[63], 31.0);
        assert!(matches!(
            model.tensor("lm_head.weight"),
            Err(ModelError::MissingTensor(_))
        ));
        match model.tokenizer_source().unwrap() {
            Some(TokenizerSource::TokenizerJson {
                tokenizer_json,
                tokenizer_config,
            }) => {
                assert_eq!(tokenizer_json, dir.0.join("tokenizer.json"));
                assert_eq!(tokenizer_config, None);
            }
            other => panic!("unexpected tokenizer source {other:?}"),
        }
        // The .safetensors file itself also opens, with config.json found beside it.
        let direct = open_model(dir.0.join("model.safetensors")).unwrap();
        assert_eq!(direct.config(), model.config());
    }

    #[test]
    fn sharded_directory_uses_the_index() {
        let dir = TempDir::new("sharded");
        let extra = r#", "tie_word_embeddings": false, "rope_scaling": {"rope_type": "llama3",
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}"#;
        std::fs::write(dir.0.join("config.json"), config_json(extra)).unwrap();
        let mut tensors = tiny_tensors();
        let lm_head = (
            "lm_head.weight".to_string(),
            Dtype::F32,
            vec![4, 8],
            f32_bytes(&[0.5; 32]),
        );
        tensors.push(lm_head);
        let (first, second) = tensors.split_at(2);
        write_safetensors(&dir.0.join("model-00001-of-00002.safetensors"), first);
        write_safetensors(&dir.0.join("model-00002-of-00002.safetensors"), second);
        let weight_map: serde_json::Map<String, Value> = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let shard = if i < 2 { 1 } else { 2 };
                (
                    t.0.clone(),
                    Value::from(format!("model-0000{shard}-of-00002.safetensors")),
                )
            })
            .collect();
        let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
        std::fs::write(
            dir.0.join("model.safetensors.index.json"),
            index.to_string(),
        )
        .unwrap();

        let model = SafetensorsModel::open(&dir.0).unwrap();
        assert!(!model.config().tie_word_embeddings);
        assert_eq!(
            model.config().rope_scaling,
            Some(RopeScaling {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192
            })
        );
        assert_eq!(model.tensor_names().len(), 4);
        assert_eq!(model.tensor("lm_head.weight").unwrap().data, [0.5; 32]);
        assert_eq!(model.tensor("model.norm.weight").unwrap().data[7], 8.0);
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        let dir = TempDir::new("bad");
        // No weights at all.
        std::fs::write(dir.0.join("config.json"), config_json("")).unwrap();
        assert!(SafetensorsModel::open(&dir.0).is_err());
        // A truncated safetensors file.
        write_safetensors(&dir.0.join("model.safetensors"), &tiny_tensors());
        let bytes = std::fs::read(dir.0.join("model.safetensors")).unwrap();
        std::fs::write(dir.0.join("model.safetensors"), &bytes[..bytes.len() - 3]).unwrap();
        let err = SafetensorsModel::open(&dir.0).unwrap_err();
        assert!(matches!(err, ModelError::Malformed { .. }), "{err}");
        std::fs::write(dir.0.join("model.safetensors"), &bytes).unwrap();
        // Unsupported architecture, named with the supported list.
        let cfg = config_json("").replace("\"llama\"", "\"gpt2\"");
        std::fs::write(dir.0.join("config.json"), cfg).unwrap();
        let err = SafetensorsModel::open(&dir.0).unwrap_err().to_string();
        assert!(
            err.contains("gpt2") && err.contains("llama, qwen2, mistral"),
            "{err}"
        );
        // A missing required field.
        let cfg = config_json("").replace("\"hidden_size\": 8,", "");
        std::fs::write(dir.0.join("config.json"), cfg).unwrap();
        let err = SafetensorsModel::open(&dir.0).unwrap_err().to_string();
        assert!(err.contains("hidden_size"), "{err}");
        // Unsupported RoPE scaling.
        let cfg = config_json(r#", "rope_scaling": {"type": "yarn", "factor": 4.0}"#);
        std::fs::write(dir.0.join("config.json"), cfg).unwrap();
        let err = SafetensorsModel::open(&dir.0).unwrap_err().to_string();
        assert!(err.contains("yarn"), "{err}");
        // Counts are checked against the limits and the tensors present, and blamed on the
        // field that is wrong.
        for (from, to, want) in [
            (
                "\"num_hidden_layers\": 1",
                "\"num_hidden_layers\": 4294967295",
                "num_hidden_layers",
            ),
            (
                "\"num_hidden_layers\": 1",
                "\"num_hidden_layers\": 1152921504606846976",
                "num_hidden_layers",
            ),
            (
                "\"num_hidden_layers\": 1",
                "\"num_hidden_layers\": 2",
                "holds 1 layers",
            ),
            (
                "\"num_attention_heads\": 2",
                "\"num_attention_heads\": 0",
                "num_attention_heads",
            ),
            (
                "\"max_position_embeddings\": 64",
                "\"max_position_embeddings\": 0",
                "max_position_embeddings",
            ),
        ] {
            let cfg = config_json("").replace(from, to);
            assert_ne!(cfg, config_json(""));
            std::fs::write(dir.0.join("config.json"), cfg).unwrap();
            let err = SafetensorsModel::open(&dir.0).unwrap_err().to_string();
            assert!(err.contains(want), "{to}: {err}");
            assert!(
                !err.contains("num_key_value_heads") || want.contains("key_value"),
                "{err}"
            );
        }
        // An empty directory is "not a model", not a missing tensor.
        let empty = TempDir::new("empty");
        let err = open_model(&empty.0)
            .err()
            .expect("an empty directory opened");
        assert!(matches!(err, ModelError::NotAModel { .. }), "{err}");
        assert!(!err.to_string().contains("not found"), "{err}");
        // A pack is named as such.
        let pack = dir.0.join("x.sieve");
        std::fs::write(&pack, crate::packfile::PackWriter::new().to_bytes()).unwrap();
        let err = open_model(&pack).err().expect("a pack opened").to_string();
        assert!(err.contains("packs cannot be re-packed"), "{err}");
        // Not a model at all.
        let junk = dir.0.join("junk.bin");
        std::fs::write(&junk, b"hello").unwrap();
        assert!(matches!(
            open_model(&junk),
            Err(ModelError::NotAModel { .. })
        ));
    }
}
