//! The seed corpus: small valid inputs for every target, built here (tiny models in each tensor
//! type and weight format) and, when the default model is present, a structure-preserving cut
//! of it (its real metadata and tensor types, shrunk to a 2-layer, 64-wide, 300-token model).
//! `sieve-fuzz seeds DIR` writes them; `crates/sieve-fuzz/corpus/` holds the committed copy.

use half::f16;
use sieve_cpu::gguf_blocks::dequant::GgmlType;
use sieve_formats::random::{sparse_matrix, Pattern, SplitMix64};
use sieve_formats::{registry, FormatKind, WeightFormat};
use sieve_model::gguf::writer::GgufWriter;
use sieve_model::gguf::{GgufFile, MetaValue};

/// Appends a tensor of `dims` (innermost-first) filled with valid random bytes of `ty`.
fn add_random_tensor(
    g: &mut GgufWriter,
    name: &str,
    dims: &[u64],
    ty: GgmlType,
    rng: &mut SplitMix64,
) {
    let elements: u64 = dims.iter().product();
    g.push_tensor(name, dims, ty, tensor_bytes(ty, elements as usize, rng));
}

/// Valid bytes for `n` elements of `ty` (finite block scales); unknown types fall back to F32.
fn tensor_bytes(ty: GgmlType, n: usize, rng: &mut SplitMix64) -> Vec<u8> {
    let scale = |rng: &mut SplitMix64| f16::from_f32(0.002 + rng.next_f64() as f32 * 0.01);
    let mut out = Vec::new();
    match ty {
        GgmlType::F16 => (0..n).for_each(|_| {
            out.extend_from_slice(&f16::from_f32(rng.normal() as f32 * 0.1).to_le_bytes())
        }),
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => {
            for _ in 0..n / 32 {
                out.extend_from_slice(&scale(rng).to_le_bytes());
                if ty == GgmlType::Q4_1 {
                    out.extend_from_slice(&f16::from_f32(-0.01).to_le_bytes());
                }
                let q = if ty == GgmlType::Q8_0 { 32 } else { 16 };
                (0..q).for_each(|_| out.push(rng.next_u64() as u8));
            }
        }
        _ => (0..n).for_each(|_| out.extend_from_slice(&(rng.normal() as f32 * 0.1).to_le_bytes())),
    }
    out
}

fn s(v: &str) -> MetaValue {
    MetaValue::String(v.into())
}

/// GPT-2 byte-level token strings of the 256 bytes, in byte order.
fn byte_tokens() -> Vec<String> {
    let printable = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let mut extra = 0x100;
    (0..256u32)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                extra += 1;
                extra - 1
            };
            char::from_u32(c).unwrap_or('?').to_string()
        })
        .collect()
}

/// A small byte-level vocabulary: 3 control tokens, 256 byte tokens, a few merges.
pub fn tiny_tokenizer(g: &mut GgufWriter) -> usize {
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .map(String::from)
        .to_vec();
    tokens.extend(byte_tokens());
    let mut merges = Vec::new();
    for (l, r) in [
        ("h", "e"),
        ("l", "l"),
        ("he", "ll"),
        ("Ġ", "t"),
        ("Ġt", "he"),
        ("1", "2"),
    ] {
        merges.push(format!("{l} {r}"));
        tokens.push(format!("{l}{r}"));
    }
    let mut types = vec![MetaValue::I32(3); 3];
    types.extend(std::iter::repeat_n(MetaValue::I32(1), tokens.len() - 3));
    let n = tokens.len();
    g.set_meta("tokenizer.ggml.model", s("gpt2"))
        .set_meta("tokenizer.ggml.pre", s("smollm"))
        .set_meta(
            "tokenizer.ggml.tokens",
            MetaValue::Array(tokens.into_iter().map(MetaValue::String).collect()),
        )
        .set_meta(
            "tokenizer.ggml.merges",
            MetaValue::Array(merges.into_iter().map(MetaValue::String).collect()),
        )
        .set_meta("tokenizer.ggml.token_type", MetaValue::Array(types))
        .set_meta("tokenizer.ggml.bos_token_id", MetaValue::U32(1))
        .set_meta("tokenizer.ggml.eos_token_id", MetaValue::U32(2))
        .set_meta(
            "tokenizer.chat_template",
            s("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"),
        );
    n
}

/// A tiny Llama-family GGUF: 32 wide, 2 layers, matrices in `matrix_type`.
pub fn tiny_gguf(arch: &str, matrix_type: GgmlType, seed: u64) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed);
    let mut g = GgufWriter::new();
    let vocab = tiny_tokenizer(&mut g) as u64;
    let (d, ff, heads, kv) = (32u64, 64u64, 2u64, 1u64);
    let hd = d / heads;
    let k = |x: &str| format!("{arch}.{x}");
    g.set_meta("general.architecture", s(arch))
        .set_meta(&k("block_count"), MetaValue::U32(2))
        .set_meta(&k("context_length"), MetaValue::U32(256))
        .set_meta(&k("embedding_length"), MetaValue::U32(d as u32))
        .set_meta(&k("feed_forward_length"), MetaValue::U32(ff as u32))
        .set_meta(&k("attention.head_count"), MetaValue::U32(heads as u32))
        .set_meta(&k("attention.head_count_kv"), MetaValue::U32(kv as u32))
        .set_meta(&k("rope.freq_base"), MetaValue::F32(10000.0))
        .set_meta(&k("attention.layer_norm_rms_epsilon"), MetaValue::F32(1e-5));
    add_random_tensor(
        &mut g,
        "token_embd.weight",
        &[d, vocab],
        matrix_type,
        &mut rng,
    );
    add_random_tensor(&mut g, "output_norm.weight", &[d], GgmlType::F32, &mut rng);
    for l in 0..2 {
        let t = |n: &str| format!("blk.{l}.{n}.weight");
        add_random_tensor(&mut g, &t("attn_norm"), &[d], GgmlType::F32, &mut rng);
        add_random_tensor(&mut g, &t("ffn_norm"), &[d], GgmlType::F32, &mut rng);
        add_random_tensor(
            &mut g,
            &t("attn_q"),
            &[d, heads * hd],
            matrix_type,
            &mut rng,
        );
        add_random_tensor(&mut g, &t("attn_k"), &[d, kv * hd], matrix_type, &mut rng);
        add_random_tensor(&mut g, &t("attn_v"), &[d, kv * hd], matrix_type, &mut rng);
        add_random_tensor(
            &mut g,
            &t("attn_output"),
            &[heads * hd, d],
            matrix_type,
            &mut rng,
        );
        add_random_tensor(&mut g, &t("ffn_gate"), &[d, ff], matrix_type, &mut rng);
        add_random_tensor(&mut g, &t("ffn_up"), &[d, ff], matrix_type, &mut rng);
        add_random_tensor(&mut g, &t("ffn_down"), &[ff, d], matrix_type, &mut rng);
        if arch == "qwen2" {
            for (n, rows) in [
                ("attn_q", heads * hd),
                ("attn_k", kv * hd),
                ("attn_v", kv * hd),
            ] {
                add_random_tensor(
                    &mut g,
                    &format!("blk.{l}.{n}.bias"),
                    &[rows],
                    GgmlType::F32,
                    &mut rng,
                );
            }
        }
    }
    g.build()
}

/// The default model cut down with its structure kept: every metadata key it has (scalars
/// rewritten to a 2-layer, 64-wide model), its tokenizer's first 300 tokens with the merges
/// among them, its chat template, and its tensor names and types (types without 64-wide blocks
/// become Q8_0).
pub fn cut_real_gguf(path: &std::path::Path) -> Option<Vec<u8>> {
    let file = GgufFile::open(path).ok()?;
    let arch = file.architecture().ok()?.to_string();
    const KEEP: usize = 300;
    let tokens: Vec<String> = file.get_string_array("tokenizer.ggml.tokens").ok()??;
    let kept: Vec<String> = tokens.into_iter().take(KEEP).collect();
    let set: std::collections::HashSet<&str> = kept.iter().map(String::as_str).collect();
    let merges: Vec<String> = file
        .get_string_array("tokenizer.ggml.merges")
        .ok()??
        .into_iter()
        .filter(|m| {
            m.split_once(' ').is_some_and(|(l, r)| {
                set.contains(l) && set.contains(r) && set.contains(format!("{l}{r}").as_str())
            })
        })
        .collect();
    let mut g = GgufWriter::new();
    for (k, v) in file.metadata() {
        let v = match (k, v) {
            ("tokenizer.ggml.tokens", _) => {
                MetaValue::Array(kept.iter().cloned().map(MetaValue::String).collect())
            }
            ("tokenizer.ggml.merges", _) => {
                MetaValue::Array(merges.iter().cloned().map(MetaValue::String).collect())
            }
            (_, MetaValue::Array(items)) if items.len() > KEEP => {
                MetaValue::Array(items[..KEEP].to_vec())
            }
            _ => v.clone(),
        };
        g.set_meta(k, v);
    }
    let k = |x: &str| format!("{arch}.{x}");
    let (d, ff, heads, kv) = (64u64, 128u64, 2u64, 1u64);
    g.set_meta(&k("block_count"), MetaValue::U32(2))
        .set_meta(&k("embedding_length"), MetaValue::U32(d as u32))
        .set_meta(&k("feed_forward_length"), MetaValue::U32(ff as u32))
        .set_meta(&k("attention.head_count"), MetaValue::U32(heads as u32))
        .set_meta(&k("attention.head_count_kv"), MetaValue::U32(kv as u32));
    if file.get(&k("rope.dimension_count")).is_some() {
        g.set_meta(
            &k("rope.dimension_count"),
            MetaValue::U32((d / heads) as u32),
        );
    }
    if file.get(&k("vocab_size")).is_some() {
        g.set_meta(&k("vocab_size"), MetaValue::U32(KEEP as u32));
    }
    let mut rng = SplitMix64::new(13);
    let hd = d / heads;
    for t in file.tensors() {
        let name = t.name.as_str();
        let layer = name
            .strip_prefix("blk.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(i, _)| i.parse::<usize>().ok());
        if layer.is_some_and(|l| l >= 2) {
            continue;
        }
        let part = name.rsplit('.').nth(1).unwrap_or("");
        let dims: Vec<u64> = match (part, t.dims.len()) {
            (_, 1) if name.ends_with(".bias") && part == "attn_q" => vec![heads * hd],
            (_, 1) if name.ends_with(".bias") => vec![kv * hd],
            (_, 1) => vec![d],
            ("token_embd" | "output", _) => vec![d, KEEP as u64],
            ("attn_q", _) => vec![d, heads * hd],
            ("attn_k" | "attn_v", _) => vec![d, kv * hd],
            ("attn_output", _) => vec![heads * hd, d],
            ("ffn_gate" | "ffn_up", _) => vec![d, ff],
            ("ffn_down", _) => vec![ff, d],
            _ => continue,
        };
        let ty = match t.ggml_type {
            ty @ (GgmlType::F32
            | GgmlType::F16
            | GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q8_0) => ty,
            _ => GgmlType::Q8_0,
        };
        let ty = if dims.len() == 1 { GgmlType::F32 } else { ty };
        add_random_tensor(&mut g, name, &dims, ty, &mut rng);
    }
    Some(g.build())
}

/// A tokenizer-only GGUF (what the tokenizer target parses).
pub fn tokenizer_gguf() -> Vec<u8> {
    let mut g = GgufWriter::new();
    tiny_tokenizer(&mut g);
    g.build()
}

fn st_file(tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        header.insert(
            (*name).into(),
            serde_json::json!({"dtype": dtype, "shape": shape,
                "data_offsets": [data.len(), data.len() + bytes.len()]}),
        );
        data.extend_from_slice(bytes);
    }
    let mut h = serde_json::Value::Object(header).to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&data);
    out
}

/// A one-layer Hugging Face directory (config.json + model.safetensors) as the safetensors
/// target's input, with tensors in F32, F16 and BF16.
pub fn safetensors_dir() -> Vec<u8> {
    let (v, d, ff, heads, kv) = (16usize, 8usize, 16usize, 2usize, 1usize);
    let hd = d / heads;
    let mut rng = SplitMix64::new(5);
    let mut vals = |n: usize, dtype: &str| -> Vec<u8> {
        (0..n)
            .flat_map(|_| {
                let x = rng.normal() as f32 * 0.1;
                match dtype {
                    "F16" => f16::from_f32(x).to_le_bytes().to_vec(),
                    "BF16" => half::bf16::from_f32(x).to_le_bytes().to_vec(),
                    _ => x.to_le_bytes().to_vec(),
                }
            })
            .collect()
    };
    let p = "model.layers.0";
    let names: Vec<(String, &str, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), "F32", vec![v, d]),
        ("model.norm.weight".into(), "F16", vec![d]),
        (format!("{p}.input_layernorm.weight"), "F32", vec![d]),
        (
            format!("{p}.post_attention_layernorm.weight"),
            "F32",
            vec![d],
        ),
        (
            format!("{p}.self_attn.q_proj.weight"),
            "BF16",
            vec![heads * hd, d],
        ),
        (
            format!("{p}.self_attn.k_proj.weight"),
            "F16",
            vec![kv * hd, d],
        ),
        (
            format!("{p}.self_attn.v_proj.weight"),
            "F32",
            vec![kv * hd, d],
        ),
        (
            format!("{p}.self_attn.o_proj.weight"),
            "F32",
            vec![d, heads * hd],
        ),
        (format!("{p}.mlp.gate_proj.weight"), "F16", vec![ff, d]),
        (format!("{p}.mlp.up_proj.weight"), "F32", vec![ff, d]),
        (format!("{p}.mlp.down_proj.weight"), "BF16", vec![d, ff]),
    ];
    let tensors: Vec<(&str, &str, Vec<usize>, Vec<u8>)> = names
        .iter()
        .map(|(n, dt, sh)| (n.as_str(), *dt, sh.clone(), vals(sh.iter().product(), dt)))
        .collect();
    let config = serde_json::json!({"model_type": "llama", "vocab_size": v, "hidden_size": d,
        "intermediate_size": ff, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": [2, 3]});
    crate::layout::join_st_input(config.to_string().as_bytes(), &st_file(&tensors))
}

/// Format blobs: a few small matrices in every format.
pub fn blobs() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for (i, (rows, cols, sp)) in [(16usize, 64usize, 0.5), (40, 96, 0.8), (8, 256, 0.0)]
        .into_iter()
        .enumerate()
    {
        let w = sparse_matrix(rows, cols, sp, Pattern::NM { n: 6, m: 8 }, i as u64)
            .or_else(|_| sparse_matrix(rows, cols, sp, Pattern::Unstructured, i as u64));
        let Ok(w) = w else { continue };
        // Balanced-CBC has its own seeds below (a full row tile plus a one-lane last tile).
        for kind in FormatKind::ALL
            .into_iter()
            .filter(|&k| k != FormatKind::BalancedCbc)
        {
            if let Ok(f) = registry::encode_default(kind, &w) {
                out.push((format!("{}-{rows}x{cols}", kind.name()), f.to_bytes()));
            }
        }
    }
    // Balanced-CBC: a 520-row matrix (a full 32-lane row tile, then a tile of one lane with 8
    // live rows, whose blocks carry zero fill) at N = 2 (words only) and N = 3 (words and the
    // odd tail), 888 and 1144 bytes.
    for (n, seed) in [(2usize, 7u64), (3, 8)] {
        let (rows, cols) = (520usize, 4usize);
        let mut rng = SplitMix64::new(seed);
        let mut data = vec![f16::ZERO; rows * cols];
        for g0 in (0..rows).step_by(16) {
            for col in 0..cols {
                for _ in 0..n {
                    let r = g0 + rng.below(16.min(rows - g0));
                    data[r * cols + col] = sieve_formats::random::weight_value(&mut rng);
                }
            }
        }
        let Ok(w) = sieve_formats::DenseMatrix::new(rows, cols, data) else {
            continue;
        };
        if let Ok(f) = sieve_formats::balanced_cbc::BalancedCbc::encode_with_slots(&w, n) {
            out.push((format!("balanced-cbc-{rows}x{cols}-n{n}"), f.to_bytes()));
        }
    }
    out
}

/// A packed tiny model: from the tiny GGUF, each linear of layer 0 re-encoded in another format,
/// TEAL thresholds on some, with its tokenizer.
pub fn pack() -> Option<Vec<u8>> {
    use sieve_model::gguf::GgufModel;
    use sieve_model::packed::{add_model_sections, add_tokenizer_sections};
    use sieve_model::packfile::PackWriter;
    let file = GgufFile::from_bytes(tiny_gguf("llama", GgmlType::F32, 3), "tiny").ok()?;
    let source = GgufModel::from_file(file).ok()?;
    let mut model = sieve_model::llama::Model::from_source_f16(&source).ok()?;
    let kinds = [
        FormatKind::RlcCsc,
        FormatKind::TiledCbc,
        FormatKind::IeBme,
        FormatKind::Slide,
        FormatKind::Dense,
        FormatKind::BalancedCbc,
    ];
    for (i, (_, lin)) in model.layers_mut()[0].linears_mut().into_iter().enumerate() {
        let dense = lin.format().decode();
        let kind = kinds[i % kinds.len()];
        let encoded: Box<dyn WeightFormat> = if kind == FormatKind::Slide {
            Box::new(
                sieve_formats::slide::encode_or_prune(&dense, Pattern::NM { n: 6, m: 8 })
                    .ok()?
                    .0,
            )
        } else {
            registry::encode_default(kind, &dense).ok()?
        };
        lin.replace_format(encoded).ok()?;
        if i % 2 == 0 {
            lin.set_threshold(Some(0.01)).ok()?;
        }
    }
    let mut w = PackWriter::new();
    add_model_sections(&mut w, &model).ok()?;
    add_tokenizer_sections(&mut w, &source).ok()?;
    w.add_json("manifest", &serde_json::json!({"seed": true}))
        .ok()?;
    Some(w.to_bytes())
}

/// Every seed, by target name.
pub fn all(real_model: Option<&std::path::Path>) -> Vec<(&'static str, String, Vec<u8>)> {
    let mut out = Vec::new();
    for (arch, ty, name) in [
        ("llama", GgmlType::F32, "llama-f32"),
        ("llama", GgmlType::Q4_0, "llama-q4_0"),
        ("mistral", GgmlType::Q4_1, "mistral-q4_1"),
        ("qwen2", GgmlType::Q8_0, "qwen2-q8_0"),
        ("llama", GgmlType::F16, "llama-f16"),
    ] {
        out.push(("gguf", name.to_string(), tiny_gguf(arch, ty, 1)));
    }
    if let Some(cut) = real_model.and_then(cut_real_gguf) {
        out.push(("gguf", "smollm2-cut".to_string(), cut.clone()));
        out.push(("tokenizer", "smollm2-cut".to_string(), cut));
    }
    out.push(("tokenizer", "tiny".to_string(), tokenizer_gguf()));
    out.push(("safetensors", "tiny-llama".to_string(), safetensors_dir()));
    if let Some(p) = pack() {
        out.push(("pack", "tiny-mixed-formats".to_string(), p));
    }
    for (name, b) in blobs() {
        out.push(("blob", name, b));
    }
    out
}
