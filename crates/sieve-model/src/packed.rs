//! A whole model in a `.sieve` container: which sections `sieve pack` writes and how a
//! [`Model`] and its [`Tokenizer`] are rebuilt from them.
//!
//! | section | kind | content |
//! |---|---|---|
//! | `config` | Json | [`ModelConfig`] |
//! | `tokenizer.gguf` | Json | the GGUF tokenizer description ([`GgufTokenizerSpec`] fields) |
//! | `tokenizer.json`, `tokenizer_config.json` | Bytes | or: the Hugging Face tokenizer files |
//! | `model.embed_tokens.weight` | Weight | dense f16 blob `[V][d]` |
//! | `model.norm.weight`, `model.layers.{l}.{input,post_attention}_layernorm.weight` | F32 | |
//! | `model.layers.{l}.{proj}.weight` | Weight | a `sieve_formats` blob in any format |
//! | `model.layers.{l}.{proj}.bias` | F32 | when the layer has one |
//! | `lm_head.weight` | Weight | only when the head is not tied to the embeddings |
//! | `thresholds` | Json | `{linear weight name: threshold or null}` (TEAL) |
//! | `manifest` | Json | how the file was made (`sieve_prune::pack::Manifest`; not read at load) |
//!
//! The container checks every section's checksum on open, so a truncated or tampered file is
//! refused before any of it reaches the model.

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::linear::Linear;
use crate::llama::{Layer, Model};
use crate::packfile::{PackFile, PackWriter, SectionKind};
use crate::tokenizer::{GgufTokenizerSpec, Tokenizer};
use crate::weights::{TensorSource, TokenizerSource};
use serde::{Deserialize, Serialize};
use sieve_cpu::dense::FastDense;
use sieve_cpu::gguf_blocks::QuantMatrix;
use sieve_formats::{FormatKind, Threshold, WeightFormat};
use std::collections::BTreeMap;
use std::path::Path;

/// Serializable mirror of [`GgufTokenizerSpec`] (which the tokenizer module keeps serde-free).
#[derive(Serialize, Deserialize)]
struct SpecJson {
    model: String,
    pre: String,
    tokens: Vec<String>,
    merges: Vec<String>,
    token_types: Vec<i32>,
    scores: Vec<f32>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<u32>,
    unknown_token_id: Option<u32>,
    padding_token_id: Option<u32>,
    add_bos_token: Option<bool>,
    add_eos_token: Option<bool>,
    chat_template: Option<String>,
}

impl From<&GgufTokenizerSpec> for SpecJson {
    fn from(s: &GgufTokenizerSpec) -> Self {
        Self {
            model: s.model.clone(),
            pre: s.pre.clone(),
            tokens: s.tokens.clone(),
            merges: s.merges.clone(),
            token_types: s.token_types.clone(),
            scores: s.scores.clone(),
            bos_token_id: s.bos_token_id,
            eos_token_id: s.eos_token_id,
            unknown_token_id: s.unknown_token_id,
            padding_token_id: s.padding_token_id,
            add_bos_token: s.add_bos_token,
            add_eos_token: s.add_eos_token,
            chat_template: s.chat_template.clone(),
        }
    }
}

impl From<SpecJson> for GgufTokenizerSpec {
    fn from(s: SpecJson) -> Self {
        Self {
            model: s.model,
            pre: s.pre,
            tokens: s.tokens,
            merges: s.merges,
            token_types: s.token_types,
            scores: s.scores,
            bos_token_id: s.bos_token_id,
            eos_token_id: s.eos_token_id,
            unknown_token_id: s.unknown_token_id,
            padding_token_id: s.padding_token_id,
            add_bos_token: s.add_bos_token,
            add_eos_token: s.add_eos_token,
            chat_template: s.chat_template,
        }
    }
}

/// Adds the tokenizer sections for whatever tokenizer `source` describes.
pub fn add_tokenizer_sections(w: &mut PackWriter, source: &dyn TensorSource) -> Result<()> {
    match source.tokenizer_source()? {
        Some(TokenizerSource::Gguf(spec)) => w.add_json("tokenizer.gguf", &SpecJson::from(&*spec)),
        Some(TokenizerSource::TokenizerJson {
            tokenizer_json,
            tokenizer_config,
        }) => {
            let read = |p: &Path| {
                std::fs::read(p).map_err(|source| ModelError::Io {
                    path: p.display().to_string(),
                    source,
                })
            };
            w.add("tokenizer.json", SectionKind::Bytes, read(&tokenizer_json)?)?;
            if let Some(cfg) = tokenizer_config {
                w.add("tokenizer_config.json", SectionKind::Bytes, read(&cfg)?)?;
            }
            Ok(())
        }
        None => Err(ModelError::Tokenizer(
            "the source model does not say where its tokenizer is".into(),
        )),
    }
}

/// Adds the sections of `model` (config, embeddings, norms, every linear as a blob of its
/// current format, biases, the LM head when untied, thresholds).
pub fn add_model_sections(w: &mut PackWriter, model: &Model) -> Result<()> {
    let c = model.config();
    w.add_json("config", c)?;
    let embed = sieve_formats::DenseMatrix::new(
        c.vocab_size,
        c.hidden_size,
        model.embed_tokens().to_vec(),
    )?;
    w.add(
        "model.embed_tokens.weight",
        SectionKind::Weight,
        FastDense::new(embed).to_bytes(),
    )?;
    w.add_f32("model.norm.weight", model.final_norm())?;
    let mut thresholds = BTreeMap::new();
    for (l, layer) in model.layers().iter().enumerate() {
        let p = format!("model.layers.{l}");
        w.add_f32(&format!("{p}.input_layernorm.weight"), &layer.input_norm)?;
        w.add_f32(
            &format!("{p}.post_attention_layernorm.weight"),
            &layer.post_attention_norm,
        )?;
        for (short, lin) in layer.linears() {
            let name = format!("{p}.{short}.weight");
            w.add(&name, SectionKind::Weight, lin.format().to_bytes())?;
            if let Some(b) = lin.bias() {
                w.add_f32(&format!("{p}.{short}.bias"), b)?;
            }
            thresholds.insert(name, lin.threshold());
        }
    }
    if !c.tie_word_embeddings {
        w.add(
            "lm_head.weight",
            SectionKind::Weight,
            model.lm_head().format().to_bytes(),
        )?;
    }
    thresholds.insert("lm_head.weight".into(), model.lm_head().threshold());
    w.add_json("thresholds", &thresholds)
}

/// Reads a weight blob into the format with the fastest CPU product for it: dense layers get
/// [`FastDense`], Tiled-CBC gets `RowTiledCbc`, Balanced-CBC gets `FastBalancedCbc` (row groups of
/// 16, fixed-size records), IE-BME INT4 gets `Int4IeBme` (integer products against 8-bit
/// activations): [`sieve_cpu::format_from_blob`] picks them; other formats keep their
/// reference kernels.
/// The threshold is the one the pack stores for this layer. Dense layers stay row-major even
/// under a threshold: the column-major `DenseColumns` reads only active columns but was slower
/// at dp 0.5 on the 2-core machine (random column skips cost a memory latency each; see
/// docs/BENCHMARKS.md), faster only from dp ~0.9.
fn read_linear(pack: &PackFile, name: &str, threshold: Threshold) -> Result<Linear> {
    let bytes = pack.section(name, SectionKind::Weight)?;
    let format = sieve_cpu::format_from_blob(bytes).map_err(|e| ModelError::Malformed {
        path: pack.path().display().to_string(),
        reason: format!("section '{name}': {e}"),
    })?;
    let mut linear = Linear::from_format(format);
    linear
        .set_threshold(threshold)
        .map_err(|e| ModelError::Malformed {
            path: pack.path().display().to_string(),
            reason: format!("threshold of '{name}': {e}"),
        })?;
    Ok(linear)
}

impl Model {
    /// Rebuilds a model written by [`add_model_sections`].
    pub fn from_pack(pack: &PackFile) -> Result<Self> {
        let config: ModelConfig = pack.json("config")?;
        // Counts are checked against the limits and the sections present before they size
        // anything (`num_layers` sizes the layer list below).
        let key = |f: &str| format!("{} section 'config': {f}", pack.path().display());
        config.check(&key)?;
        config.check_layers_present(pack.names().iter().map(String::as_str), &key)?;
        let malformed = |reason: String| ModelError::Malformed {
            path: pack.path().display().to_string(),
            reason,
        };
        let thresholds: BTreeMap<String, Option<f32>> = pack.json("thresholds")?;
        let embed_lin = read_linear(pack, "model.embed_tokens.weight", None)?;
        let embed = embed_lin.format().decode();
        if embed.rows() != config.vocab_size || embed.cols() != config.hidden_size {
            return Err(malformed(format!(
                "embeddings are {}x{}, the config says {}x{}",
                embed.rows(),
                embed.cols(),
                config.vocab_size,
                config.hidden_size
            )));
        }
        let threshold_of = |name: &str| thresholds.get(name).copied().flatten();
        let mut layers = Vec::with_capacity(config.num_layers);
        for l in 0..config.num_layers {
            let p = format!("model.layers.{l}");
            let mut lin = Vec::with_capacity(7);
            for short in crate::llama::LAYER_LINEARS {
                let name = format!("{p}.{short}.weight");
                let mut linear = read_linear(pack, &name, threshold_of(&name))?;
                let bias_name = format!("{p}.{short}.bias");
                if pack.contains(&bias_name) {
                    linear = linear.with_bias(pack.f32s(&bias_name)?)?;
                }
                lin.push(linear);
            }
            let mut it = lin.into_iter();
            let mut next = || {
                it.next()
                    .ok_or_else(|| ModelError::InvalidArgument("layer linears".into()))
            };
            layers.push(Layer {
                input_norm: pack.f32s(&format!("{p}.input_layernorm.weight"))?,
                post_attention_norm: pack.f32s(&format!("{p}.post_attention_layernorm.weight"))?,
                q_proj: next()?,
                k_proj: next()?,
                v_proj: next()?,
                o_proj: next()?,
                gate_proj: next()?,
                up_proj: next()?,
                down_proj: next()?,
            });
        }
        let head_threshold = threshold_of("lm_head.weight");
        let lm_head = if pack.contains("lm_head.weight") {
            read_linear(pack, "lm_head.weight", head_threshold)?
        } else {
            let mut lin = Linear::from_format(Box::new(FastDense::new(embed.clone())));
            lin.set_threshold(head_threshold)
                .map_err(|e| malformed(format!("threshold of 'lm_head.weight': {e}")))?;
            lin
        };
        let final_norm = pack.f32s("model.norm.weight")?;
        Model::from_parts(config, embed.into_data(), layers, final_norm, lm_head)
    }
}

/// The tokenizer stored in a `.sieve` file.
pub fn tokenizer_from_pack(pack: &PackFile) -> Result<Tokenizer> {
    if pack.contains("tokenizer.gguf") {
        let spec: SpecJson = pack.json("tokenizer.gguf")?;
        return Tokenizer::from_gguf_spec(&spec.into());
    }
    if pack.contains("tokenizer.json") {
        // `Tokenizer::from_file` also reads `tokenizer_config.json` beside the file, so both are
        // written to a private temporary folder.
        let dir = std::env::temp_dir().join(format!(
            "sieve-tokenizer-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        let io = |path: &Path| {
            let shown = path.display().to_string();
            move |source| ModelError::Io {
                path: shown,
                source,
            }
        };
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        let result = (|| {
            let file = dir.join("tokenizer.json");
            std::fs::write(&file, pack.section("tokenizer.json", SectionKind::Bytes)?)
                .map_err(io(&file))?;
            if pack.contains("tokenizer_config.json") {
                let cfg = dir.join("tokenizer_config.json");
                std::fs::write(
                    &cfg,
                    pack.section("tokenizer_config.json", SectionKind::Bytes)?,
                )
                .map_err(io(&cfg))?;
            }
            Tokenizer::from_file(&file)
        })();
        let _ = std::fs::remove_dir_all(&dir);
        return result;
    }
    Err(ModelError::Malformed {
        path: pack.path().display().to_string(),
        reason: "no tokenizer section".into(),
    })
}

/// The blocks a pack's dense LM head is multiplied in on the CPU (`sieve pack --head`), kept
/// in the pack's `lm_head.blocks` section (absent: Q8_0, what packs before it used).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum HeadBlocks {
    /// 8.5 bits per weight; recovers a GGUF's own Q8_0 head exactly.
    #[default]
    #[serde(rename = "q8_0")]
    Q8_0,
    /// 5 bits per weight: 40% fewer bytes per token for a head that is a fifth to a quarter of
    /// every decode step, at some quality (docs/BENCHMARKS.md).
    #[serde(rename = "q4_1")]
    Q4_1,
}

/// Section name of [`HeadBlocks`] in a pack.
pub const HEAD_BLOCKS_SECTION: &str = "lm_head.blocks";

impl std::str::FromStr for HeadBlocks {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "q8_0" => Ok(Self::Q8_0),
            "q4_1" => Ok(Self::Q4_1),
            other => Err(ModelError::InvalidArgument(format!(
                "unknown LM head blocks '{other}' (known: q8_0, q4_1)"
            ))),
        }
    }
}

impl std::fmt::Display for HeadBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Q8_0 => "q8_0",
            Self::Q4_1 => "q4_1",
        })
    }
}

/// Records in the pack which blocks its dense LM head is multiplied in (nothing for Q8_0, so
/// that such packs stay readable by earlier versions).
pub fn add_head_blocks(w: &mut PackWriter, blocks: HeadBlocks) -> Result<()> {
    match blocks {
        HeadBlocks::Q8_0 => Ok(()),
        other => w.add_json(HEAD_BLOCKS_SECTION, &other),
    }
}

/// The blocks a pack asks its dense LM head to be multiplied in.
pub fn head_blocks_of(pack: &PackFile) -> Result<HeadBlocks> {
    if pack.contains(HEAD_BLOCKS_SECTION) {
        pack.json(HEAD_BLOCKS_SECTION)
    } else {
        Ok(HeadBlocks::Q8_0)
    }
}

/// Replaces a dense f16 LM head by Q8_0 blocks (8-bit activations, as the GGUF path does).
/// The head of SmolLM2-135M is 49152 x 576, a fifth of the model's weights and read in full by
/// every decode step: 56.6 MB in f16 against 30.1 MB in Q8_0. Packs made from a GGUF whose head
/// was Q8_0 get the file's own quants back (see [`QuantMatrix::quantize_q8_0`]). Heads in
/// other formats, or with a column count that is not a multiple of 32, stay as they are.
pub fn quantize_dense_head(model: &mut Model) -> Result<()> {
    quantize_dense_head_to(model, HeadBlocks::Q8_0)
}

/// [`quantize_dense_head`] into the given blocks.
pub fn quantize_dense_head_to(model: &mut Model, blocks: HeadBlocks) -> Result<()> {
    let head = model.lm_head();
    if head.format().kind() != FormatKind::Dense
        || !head.cols().is_multiple_of(32)
        || head.bias().is_some()
    {
        return Ok(());
    }
    let threshold = head.threshold();
    let dense = head.format().decode();
    let q = match blocks {
        HeadBlocks::Q8_0 => QuantMatrix::quantize_q8_0(dense.rows(), dense.cols(), dense.data())?,
        HeadBlocks::Q4_1 => QuantMatrix::quantize_q4_1(dense.rows(), dense.cols(), dense.data())?,
    };
    let mut lin = Linear::from_quantized(q);
    lin.set_threshold(threshold)?;
    *model.lm_head_mut() = lin;
    Ok(())
}

/// Whether `path` is a `.sieve` file (by its magic, whatever its name).
/// Anything that is not a regular file (a directory, a FIFO) is not a pack, and is never opened.
pub fn is_pack_file(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 8];
    crate::weights::open_regular(path)
        .ok()
        .is_some_and(|mut f| f.read_exact(&mut magic).is_ok())
        && &magic == crate::packfile::MAGIC
}

/// Opens any supported model (a `.sieve` file, GGUF, safetensors) with its tokenizer; GGUF
/// Q4_0/Q4_1/Q8_0 weights stay in their blocks ([`Model::from_source`]).
pub fn load_model_and_tokenizer(path: &Path) -> Result<(Model, Tokenizer)> {
    load_model_and_tokenizer_with(path, false)
}

/// [`load_model_and_tokenizer`], with `f16_weights` dequantizing GGUF blocks to dense f16
/// ([`Model::from_source_f16`], the model `sieve pack` prunes). `.sieve` files load as stored,
/// except that a dense f16 LM head is multiplied as Q8_0 (or the pack's [`HeadBlocks`]) blocks
/// ([`quantize_dense_head_to`]) unless `f16_weights` is set.
pub fn load_model_and_tokenizer_with(path: &Path, f16_weights: bool) -> Result<(Model, Tokenizer)> {
    crate::weights::check_model_path(path)?;
    if is_pack_file(path) {
        let pack = PackFile::open(path)?;
        let tokenizer = tokenizer_from_pack(&pack)?;
        let mut model = Model::from_pack(&pack)?;
        if !f16_weights {
            quantize_dense_head_to(&mut model, head_blocks_of(&pack)?)?;
        }
        return Ok((model, tokenizer));
    }
    let source = crate::weights::open_model(path)?;
    let tokenizer = crate::generate::load_tokenizer(source.as_ref())?;
    let model = if f16_weights {
        Model::from_source_f16(source.as_ref())?
    } else {
        Model::from_source(source.as_ref())?
    };
    Ok((model, tokenizer))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llama::tests::{random_source, tiny_config};
    use crate::llama::Logits;

    fn packed_bytes() -> (Model, Vec<u8>) {
        let src = random_source(tiny_config(), 5);
        let mut model = Model::from_source(&src).unwrap();
        // A sparse layer in another format and a threshold must survive the round trip.
        let lin = &mut model.layers_mut()[1].down_proj;
        let mut m = lin.format().decode().into_data();
        for (i, v) in m.iter_mut().enumerate() {
            if i % 3 != 0 {
                *v = half::f16::ZERO;
            }
        }
        let dm = sieve_formats::DenseMatrix::new(lin.rows(), lin.cols(), m).unwrap();
        lin.replace_format(
            sieve_formats::registry::encode_default(FormatKind::RlcCsc, &dm).unwrap(),
        )
        .unwrap();
        lin.set_threshold(Some(0.05)).unwrap();
        let mut w = PackWriter::new();
        add_model_sections(&mut w, &model).unwrap();
        w.add_json(
            "tokenizer.gguf",
            &SpecJson::from(&GgufTokenizerSpec::default()),
        )
        .unwrap();
        (model, w.to_bytes())
    }

    #[test]
    fn model_round_trips_through_a_pack() {
        let (model, bytes) = packed_bytes();
        let pack = PackFile::from_bytes(bytes).unwrap();
        let loaded = Model::from_pack(&pack).unwrap();
        let tokens = [1u32, 4, 9, 30, 2];
        let a = model
            .forward(&tokens, &mut model.new_cache(8), Logits::All)
            .unwrap();
        let b = loaded
            .forward(&tokens, &mut loaded.new_cache(8), Logits::All)
            .unwrap();
        assert_eq!(a, b);
        assert_eq!(loaded.layers()[1].down_proj.threshold(), Some(0.05));
        assert_eq!(
            loaded.layers()[1].down_proj.format().kind(),
            FormatKind::RlcCsc
        );
    }

    #[test]
    fn head_blocks_round_trip_and_default_to_q8_0() {
        let (_, bytes) = packed_bytes();
        let pack = PackFile::from_bytes(bytes).unwrap();
        assert_eq!(head_blocks_of(&pack).unwrap(), HeadBlocks::Q8_0);
        for blocks in [HeadBlocks::Q8_0, HeadBlocks::Q4_1] {
            let mut w = PackWriter::new();
            add_head_blocks(&mut w, blocks).unwrap();
            let pack = PackFile::from_bytes(w.to_bytes()).unwrap();
            assert_eq!(head_blocks_of(&pack).unwrap(), blocks);
            // Q8_0 writes nothing: such packs read as before.
            assert_eq!(
                pack.contains(HEAD_BLOCKS_SECTION),
                blocks != HeadBlocks::Q8_0
            );
            assert_eq!(blocks.to_string().parse::<HeadBlocks>().unwrap(), blocks);
        }
        assert!("q4_0".parse::<HeadBlocks>().is_err());
        let mut w = PackWriter::new();
        w.add_json(HEAD_BLOCKS_SECTION, &"q2_k").unwrap();
        let pack = PackFile::from_bytes(w.to_bytes()).unwrap();
        assert!(head_blocks_of(&pack).is_err());
    }

    #[test]
    fn truncated_or_tampered_pack_is_refused() {
        let (_, bytes) = packed_bytes();
        for cut in [bytes.len() - 1, bytes.len() / 2, 40, 7] {
            let err = PackFile::from_bytes(bytes[..cut].to_vec()).unwrap_err();
            assert!(matches!(err, ModelError::Malformed { .. }), "{err}");
        }
        // Flip one byte inside a weight section.
        let pack = PackFile::from_bytes(bytes.clone()).unwrap();
        let sec = pack
            .section("model.layers.0.mlp.up_proj.weight", SectionKind::Weight)
            .unwrap()
            .to_vec();
        let start = bytes.windows(sec.len()).position(|w| w == sec).unwrap();
        let mut bad = bytes.clone();
        bad[start + sec.len() / 2] ^= 0x5a;
        let err = PackFile::from_bytes(bad).unwrap_err();
        assert!(err.to_string().contains("checksum"), "{err}");
        // A pack without a required section is refused at the model level.
        let mut w = PackWriter::new();
        w.add_json("config", &tiny_config()).unwrap();
        let pack = PackFile::from_bytes(w.to_bytes()).unwrap();
        let err = Model::from_pack(&pack).unwrap_err();
        assert!(err.to_string().contains("layers"), "{err}");
    }

    #[test]
    fn pack_config_counts_are_checked_before_they_size_anything() {
        let (_, bytes) = packed_bytes();
        let pack = PackFile::from_bytes(bytes).unwrap();
        for (layers, want) in [
            (4294967295usize, "limit"),
            (1 << 60, "limit"),
            (5, "holds 2 layers"),
        ] {
            let mut w = PackWriter::new();
            for name in pack.names() {
                let kind = if name == "config" {
                    continue;
                } else if name.ends_with("layernorm.weight")
                    || name.ends_with(".bias")
                    || name == "model.norm.weight"
                {
                    SectionKind::F32
                } else if name == "thresholds" || name == "tokenizer.gguf" {
                    SectionKind::Json
                } else {
                    SectionKind::Weight
                };
                w.add(name, kind, pack.section(name, kind).unwrap().to_vec())
                    .unwrap();
            }
            let mut config = tiny_config();
            config.num_layers = layers;
            w.add_json("config", &config).unwrap();
            let bad = PackFile::from_bytes(w.to_bytes()).unwrap();
            let err = Model::from_pack(&bad).unwrap_err().to_string();
            assert!(err.contains("num_layers") && err.contains(want), "{err}");
        }
    }
}
