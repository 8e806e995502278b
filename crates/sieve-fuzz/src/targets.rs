//! The fuzz targets: each takes untrusted bytes through one reader and on through everything
//! that consumes what it returns (config, tokenizer, model assembly, a forward step), exactly
//! as `sieve generate` would. An `Err` is a correct refusal; only a panic, an abort, a hang or
//! unbounded memory is a finding.

use crate::layout;
use crate::mutate::{Field, Mutator};
use sieve_model::gguf::{GgufFile, GgufModel};
use sieve_model::llama::{Logits, Model};
use sieve_model::tokenizer::Tokenizer;
use sieve_model::weights::TensorSource;

pub struct Target {
    pub name: &'static str,
    pub run: fn(&[u8]) -> Result<(), String>,
    /// Numeric fields to aim structure-aware mutations at.
    pub fields: fn(&[u8]) -> Vec<Field>,
    /// A format-specific mutation (JSON numbers, section contents); `None` when there is none.
    pub special: Option<fn(&mut Mutator, &mut Vec<u8>)>,
    /// Recomputes checksums after a mutation, so it reaches the parsers behind them.
    pub reseal: Option<fn(&mut [u8])>,
}

pub const TARGETS: [Target; 5] = [
    Target {
        name: "gguf",
        run: run_gguf,
        fields: layout::gguf_fields,
        special: None,
        reseal: None,
    },
    Target {
        name: "safetensors",
        run: run_safetensors,
        fields: st_fields,
        special: Some(st_special),
        reseal: None,
    },
    Target {
        name: "pack",
        run: run_pack,
        fields: layout::pack_fields,
        special: Some(pack_special),
        reseal: Some(layout::reseal_pack),
    },
    Target {
        name: "blob",
        run: run_blob,
        fields: layout::blob_fields,
        special: None,
        reseal: Some(layout::reseal_blob),
    },
    Target {
        name: "tokenizer",
        run: run_tokenizer,
        fields: layout::gguf_fields,
        special: None,
        reseal: None,
    },
];

/// The default model's header (everything before its tensor data: all metadata, the 49k-token
/// vocabulary and merges, the tensor table) with an 8-byte trailer holding the file's length:
/// [`run_gguf_real`] rebuilds a file of that length with zero tensor data, so header mutations
/// of the real 98 MB model run without copying its weights each time. Not in the committed
/// corpus (the header alone is megabytes); `sieve-fuzz run --targets gguf-real` builds it from
/// `$SIEVE_HOME/models/` (default `~/.cache/sieve/models/`) when present.
pub const GGUF_REAL: Target = Target {
    name: "gguf-real",
    run: run_gguf_real,
    fields: layout::gguf_fields,
    special: None,
    reseal: None,
};

pub fn by_name(name: &str) -> Option<&'static Target> {
    TARGETS
        .iter()
        .find(|t| t.name == name)
        .or((name == GGUF_REAL.name).then_some(&GGUF_REAL))
}

/// The header-plus-length input of [`GGUF_REAL`] for the GGUF file at `path`.
pub fn real_header_input(path: &std::path::Path) -> Option<Vec<u8>> {
    let file = GgufFile::open(path).ok()?;
    let bytes = std::fs::read(path).ok()?;
    let mut input = bytes.get(..file.data_offset() as usize)?.to_vec();
    input.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    Some(input)
}

/// Largest file [`run_gguf_real`] rebuilds (the default model is 98 MB).
const REAL_MAX_LEN: usize = 256 << 20;

fn run_gguf_real(input: &[u8]) -> Result<(), String> {
    let split = input.len().checked_sub(8).ok_or("input too short")?;
    let (header, trailer) = input.split_at(split);
    let len = u64::from_le_bytes(trailer.try_into().map_err(e)?) as usize;
    let len = len.clamp(header.len(), REAL_MAX_LEN.max(header.len()));
    // `vec![0u8; n]` takes zero pages from the allocator: the weights cost nothing until read.
    let mut bytes = vec![0u8; len];
    bytes[..header.len()].copy_from_slice(header);
    let file = GgufFile::from_bytes(bytes, "fuzz-real.gguf").map_err(e)?;
    let model = GgufModel::from_file(file).map_err(e)?;
    let spec = model.tokenizer_spec().map_err(e)?;
    let t = Tokenizer::from_gguf_spec(&spec).map_err(e)?;
    exercise_tokenizer(&t)?;
    for name in ["model.norm.weight", "model.layers.0.input_layernorm.weight"] {
        model.tensor(name).map_err(e)?;
    }
    Ok(())
}

fn e(err: impl std::fmt::Display) -> String {
    err.to_string()
}

/// Text with special tokens, digits, whitespace runs and multi-byte characters.
const SAMPLE: &str = "<|im_start|>user\nhello the  12345 wörld 日本語 \u{1F600}\t!<|im_end|>";

fn exercise_tokenizer(t: &Tokenizer) -> Result<(), String> {
    let ids = t.encode(SAMPLE, false).map_err(e)?;
    t.decode(&ids, true).map_err(e)?;
    let mut stream = t.stream(false);
    for &id in &ids {
        stream.push(id).map_err(e)?;
    }
    stream.finish();
    Ok(())
}

/// Loads a model from `source` and runs one forward step, the way `sieve generate` starts.
fn exercise_model(source: &dyn TensorSource) -> Result<(), String> {
    for name in source.tensor_names().into_iter().take(64) {
        source.tensor(&name).map_err(e)?;
    }
    let model = Model::from_source(source).map_err(e)?;
    forward(&model)
}

fn forward(model: &Model) -> Result<(), String> {
    let mut cache = model.try_new_cache(4).map_err(e)?;
    let tokens: Vec<u32> = (0..2)
        .map(|i| i % model.config().vocab_size as u32)
        .collect();
    model.forward(&tokens, &mut cache, Logits::All).map_err(e)?;
    Ok(())
}

fn run_gguf(bytes: &[u8]) -> Result<(), String> {
    let file = GgufFile::from_bytes(bytes.to_vec(), "fuzz.gguf").map_err(e)?;
    let model = GgufModel::from_file(file).map_err(e)?;
    if let Ok(spec) = model.tokenizer_spec() {
        if let Ok(t) = Tokenizer::from_gguf_spec(&spec) {
            exercise_tokenizer(&t)?;
        }
    }
    exercise_model(&model)
}

fn run_tokenizer(bytes: &[u8]) -> Result<(), String> {
    let file = GgufFile::from_bytes(bytes.to_vec(), "fuzz.gguf").map_err(e)?;
    let spec = file.tokenizer_spec().map_err(e)?;
    let t = Tokenizer::from_gguf_spec(&spec).map_err(e)?;
    exercise_tokenizer(&t)
}

fn scratch_dir() -> std::path::PathBuf {
    use std::sync::OnceLock;
    static DIR: OnceLock<std::path::PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("sieve-fuzz-st-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&d);
        d
    })
    .clone()
}

/// Removes the safetensors target's scratch directory (call once at the end of a run).
pub fn cleanup() {
    let _ = std::fs::remove_dir_all(scratch_dir());
}

fn run_safetensors(bytes: &[u8]) -> Result<(), String> {
    let (config, file) = layout::split_st_input(bytes).ok_or("input too short")?;
    let dir = scratch_dir();
    std::fs::write(dir.join("config.json"), config).map_err(e)?;
    std::fs::write(dir.join("model.safetensors"), file).map_err(e)?;
    let model = sieve_model::safetensors_dir::SafetensorsModel::open(&dir).map_err(e)?;
    exercise_model(&model)
}

fn run_pack(bytes: &[u8]) -> Result<(), String> {
    let pack = sieve_model::packfile::PackFile::from_bytes(bytes.to_vec()).map_err(e)?;
    if let Ok(t) = sieve_model::packed::tokenizer_from_pack(&pack) {
        exercise_tokenizer(&t)?;
    }
    let model = Model::from_pack(&pack).map_err(e)?;
    forward(&model)
}

/// Largest matrix a blob may describe for the target to decode and multiply it: the model only
/// does so after checking the shape against its (limited) config, and a sparse blob may
/// legitimately describe a far larger matrix than its bytes.
const BLOB_PRODUCT_LIMIT: usize = 1 << 22;

fn run_blob(bytes: &[u8]) -> Result<(), String> {
    let w = sieve_formats::registry::from_bytes(bytes).map_err(e)?;
    let _ = w.storage();
    let (rows, cols) = (w.rows(), w.cols());
    if rows
        .checked_mul(cols)
        .is_none_or(|n| n > BLOB_PRODUCT_LIMIT)
    {
        return Ok(());
    }
    let _ = w.decode();
    let x: Vec<f32> = (0..cols).map(|i| (i % 7) as f32 - 3.0).collect();
    let mut y = vec![0f32; rows];
    w.matvec(&x, None, &mut y).map_err(e)?;
    w.matvec(&x, Some(1.5), &mut y).map_err(e)?;
    let mut y2 = vec![0f32; rows * 2];
    let x2: Vec<f32> = x.iter().chain(&x).copied().collect();
    w.matmul(&x2, 2, Some(0.5), &mut y2).map_err(e)?;
    Ok(())
}

fn st_fields(bytes: &[u8]) -> Vec<Field> {
    let mut out = vec![Field {
        offset: 0,
        width: 4,
        kind: crate::mutate::FieldKind::Length,
    }];
    if let Some((config, _)) = layout::split_st_input(bytes) {
        out.push(Field {
            offset: 4 + config.len(),
            width: 8,
            kind: crate::mutate::FieldKind::Length,
        });
    }
    out
}

/// Hostile numbers in config.json or in the safetensors header (shapes, data offsets).
fn st_special(m: &mut Mutator, bytes: &mut Vec<u8>) {
    let Some((config, file)) = layout::split_st_input(bytes) else {
        return;
    };
    let (c_len, f_len) = (config.len(), file.len());
    let header_len = file
        .get(..8)
        .map(|h| u64::from_le_bytes(h.try_into().unwrap_or([0; 8])) as usize)
        .unwrap_or(0)
        .min(f_len.saturating_sub(8));
    let range = if m.below(2) == 0 {
        4..4 + c_len
    } else {
        4 + c_len + 8..4 + c_len + 8 + header_len
    };
    let before = bytes.len();
    if m.json_number(bytes, range.clone()) && range.start == 4 {
        // Keep the config length prefix in step with the edit.
        let new_len = (c_len + bytes.len() - before) as u32;
        bytes[..4].copy_from_slice(&new_len.to_le_bytes());
    }
}

/// Hostile numbers inside the `config` section, or fields inside a weight blob.
// The signature is the `Target::special` one, shared with mutations that resize the input.
#[allow(clippy::ptr_arg)]
fn pack_special(m: &mut Mutator, bytes: &mut Vec<u8>) {
    let sections = layout::pack_sections(bytes);
    if sections.is_empty() {
        return;
    }
    let (name, kind, off, len) = sections[m.below(sections.len())].clone();
    let Some(end) = off.checked_add(len).filter(|&e| e <= bytes.len()) else {
        return;
    };
    if kind == 2 {
        let fields = layout::blob_fields(&bytes[off..end]);
        m.rewrite_field(&mut bytes[off..end], &fields);
    } else if name == "config" || kind == 1 {
        // Same-length edit so the table offsets stay valid: overwrite digits in place.
        let mut section = bytes[off..end].to_vec();
        if m.json_number(&mut section, 0..len) {
            section.resize(len, b' ');
            bytes[off..end].copy_from_slice(&section[..len]);
        }
    } else if len > 0 {
        let i = off + m.below(len);
        bytes[i] ^= 1 << m.below(8);
    }
}
