//! Checks against llama.cpp's own reader (the `gguf` Python package): dequantized values dumped
//! by scripts/make-gguf-fixture.py into tests/fixtures/gguf_golden.json, and the real default
//! model when it has been fetched (scripts/fetch-model.sh; CI fetches it).

use serde_json::Value;
use sieve_cpu::gguf_blocks::dequant::{dequantize, GgmlType};
use sieve_model::gguf::{GgufFile, GgufModel};
use sieve_model::weights::{open_model, TensorSource, TokenizerSource};
use std::path::PathBuf;

fn fixture() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/gguf_golden.json"
    );
    let text = std::fs::read_to_string(path).expect("fixture is committed");
    serde_json::from_str(&text).expect("fixture is valid JSON")
}

fn default_model() -> Option<PathBuf> {
    let home = std::env::var_os("SIEVE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/sieve")))?;
    let path = home.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.is_file() {
        Some(path)
    } else {
        eprintln!(
            "skipping: {} is absent (run scripts/fetch-model.sh)",
            path.display()
        );
        None
    }
}

fn ggml_type(name: &str) -> GgmlType {
    (0..64)
        .filter_map(GgmlType::from_id)
        .find(|t| t.name() == name)
        .unwrap_or_else(|| panic!("fixture names unknown type {name}"))
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn assert_close(actual: &[f32], expected: &[f32], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: length");
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        let tol = 1e-6 * e.abs().max(1.0);
        assert!(
            (a - e).abs() <= tol,
            "{what}[{i}]: sieve {a} vs gguf-py {e}"
        );
    }
}

#[test]
fn block_dequantization_matches_gguf_py() {
    let fixture = fixture();
    let blocks = fixture["blocks"].as_array().unwrap();
    assert!(blocks.len() >= 10);
    for case in blocks {
        let name = case["ggml_type"].as_str().unwrap();
        let bytes = hex(case["bytes_hex"].as_str().unwrap());
        let expected = floats(&case["values"]);
        let actual = dequantize(ggml_type(name), &bytes, expected.len()).unwrap();
        assert_close(&actual, &expected, name);
    }
}

#[test]
fn real_model_tensors_match_gguf_py_including_qk_unpermutation() {
    let Some(path) = default_model() else { return };
    let model = GgufModel::open(&path).unwrap();
    let fixture = fixture();
    for t in fixture["model"].as_array().unwrap() {
        let hf_name = t["hf_name"].as_str().unwrap();
        let gguf_name = t["gguf_name"].as_str().unwrap();
        assert_eq!(model.gguf_name(hf_name), Some(gguf_name));
        let info = model.file().tensor_info(gguf_name).unwrap();
        assert_eq!(info.ggml_type.name(), t["ggml_type"].as_str().unwrap());
        let tensor = model.tensor(hf_name).unwrap();
        let shape: Vec<usize> = t["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(tensor.shape, shape, "{hf_name}");
        let cols = *shape.last().unwrap();
        for spot in t["spots"].as_array().unwrap() {
            let row = spot["row"].as_u64().unwrap() as usize;
            let col = spot["col"].as_u64().unwrap() as usize;
            let expected = floats(&spot["values"]);
            let start = if shape.len() == 1 {
                col
            } else {
                row * cols + col
            };
            assert_close(
                &tensor.data[start..start + expected.len()],
                &expected,
                &format!("{hf_name} row {row} col {col}"),
            );
        }
    }
}

#[test]
fn real_model_config_and_tensor_table() {
    let Some(path) = default_model() else { return };
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.version(), 3);
    assert_eq!(file.tensors().len(), 272);
    let model = open_model(&path).unwrap();
    let c = model.config();
    assert_eq!(c.architecture, "llama");
    assert_eq!(c.num_layers, 30);
    assert_eq!(c.hidden_size, 576);
    assert_eq!(c.num_heads, 9);
    assert_eq!(c.num_kv_heads, 3);
    assert_eq!(c.head_dim, 64);
    assert_eq!(c.intermediate_size, 1536);
    assert_eq!(c.vocab_size, 49152);
    assert_eq!(c.rope_theta, 100000.0);
    assert_eq!(c.max_position_embeddings, 8192);
    assert!((c.rms_norm_eps - 1e-5).abs() < 1e-9);
    assert!(c.tie_word_embeddings);
    assert!(!c.attention_bias);
    assert_eq!(c.rope_scaling, None);
    assert_eq!(c.bos_token_id, Some(1));
    assert_eq!(c.eos_token_ids, [2]);

    // 30 layers x 9 tensors + embedding + final norm, no lm_head (tied).
    let names = model.tensor_names();
    assert_eq!(names.len(), 272);
    assert!(!model.contains("lm_head.weight"));
    for name in &names {
        assert!(
            name.starts_with("model.embed_tokens.")
                || name.starts_with("model.norm.")
                || name.starts_with("model.layers."),
            "untranslated name {name}"
        );
    }
    let shape = |n: &str| file.tensor_info(n).unwrap().shape();
    assert_eq!(shape("blk.0.attn_k.weight"), [192, 576]);
    assert_eq!(shape("blk.7.ffn_down.weight"), [576, 1536]);
    assert_eq!(shape("blk.7.ffn_gate.weight"), [1536, 576]);
    assert_eq!(shape("output_norm.weight"), [576]);

    let embed = model.tensor("model.embed_tokens.weight").unwrap();
    assert_eq!(embed.shape, [49152, 576]);
    for row in [0usize, 1, 2, 1000, 49151] {
        let r = &embed.data[row * 576..(row + 1) * 576];
        assert!(r.iter().all(|x| x.is_finite()), "row {row} not finite");
        let mean = r.iter().sum::<f32>() / 576.0;
        let std = (r.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / 576.0).sqrt();
        assert!(mean.abs() < 0.1, "row {row} mean {mean}");
        assert!((0.005..1.0).contains(&std), "row {row} std {std}");
    }
    let norm = model
        .tensor("model.layers.0.input_layernorm.weight")
        .unwrap();
    assert_eq!(norm.shape, [576]);

    match model.tokenizer_source().unwrap() {
        Some(TokenizerSource::Gguf(spec)) => {
            assert_eq!(spec.model, "gpt2");
            assert_eq!(spec.pre, "smollm");
            assert_eq!(spec.tokens.len(), 49152);
            assert_eq!(spec.token_types.len(), 49152);
            assert_eq!(spec.merges.len(), 48900);
            assert_eq!(spec.tokens[2], "<|im_end|>");
            assert_eq!(spec.bos_token_id, Some(1));
            assert_eq!(spec.eos_token_id, Some(2));
            assert_eq!(spec.unknown_token_id, Some(0));
            assert_eq!(spec.padding_token_id, Some(2));
            assert_eq!(spec.add_bos_token, Some(false));
            assert!(spec.chat_template.unwrap().contains("<|im_start|>"));
        }
        other => panic!("expected a GGUF tokenizer, got {other:?}"),
    }
}

/// Relative mean |norm(row i) - norm(row i + head_dim/2)| within each head. Under HF rotate-half
/// RoPE, rows i and i + head_dim/2 form one rotation pair at one frequency, and trained weights
/// give the two rows of a pair similar norms; a wrong row order breaks the pairing.
fn pair_norm_gap(data: &[f32], rows: usize, n_head: usize) -> f64 {
    let cols = data.len() / rows;
    let norms: Vec<f64> = data
        .chunks_exact(cols)
        .map(|r| r.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt())
        .collect();
    let head_dim = rows / n_head;
    let half = head_dim / 2;
    let mut gap = 0.0;
    for h in 0..n_head {
        for i in 0..half {
            gap += (norms[h * head_dim + i] - norms[h * head_dim + half + i]).abs();
        }
    }
    let mean_norm = norms.iter().sum::<f64>() / rows as f64;
    gap / (rows / 2) as f64 / mean_norm
}

/// The converter's own direction (HF row h*hd + j*half + i -> GGUF row h*hd + 2i + j), applied
/// once more: what a reader that permuted the wrong way would produce.
fn permute_again(data: &[f32], rows: usize, n_head: usize) -> Vec<f32> {
    let cols = data.len() / rows;
    let head_dim = rows / n_head;
    let half = head_dim / 2;
    let mut out = vec![0f32; data.len()];
    for h in 0..n_head {
        for j in 0..2 {
            for i in 0..half {
                let src = h * head_dim + j * half + i;
                let dst = h * head_dim + 2 * i + j;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// An independent, semantic check of the Q/K un-permutation (the golden fixture checks it
/// against the same math in numpy): the HF row order must pair RoPE rows far better than the
/// file's order or the opposite permutation.
#[test]
fn real_model_qk_rows_pair_up_under_rotate_half() {
    let Some(path) = default_model() else { return };
    let model = GgufModel::open(&path).unwrap();
    let c = model.config().clone();
    for (proj, gguf_part, n_head) in [
        ("q_proj", "attn_q", c.num_heads),
        ("k_proj", "attn_k", c.num_kv_heads),
    ] {
        let (mut hf, mut raw, mut wrong) = (0.0, 0.0, 0.0);
        for layer in 0..c.num_layers {
            let t = model
                .tensor(&format!("model.layers.{layer}.self_attn.{proj}.weight"))
                .unwrap();
            let rows = t.shape[0];
            let file_order = model
                .file()
                .tensor_f32(&format!("blk.{layer}.{gguf_part}.weight"))
                .unwrap();
            hf += pair_norm_gap(&t.data, rows, n_head);
            raw += pair_norm_gap(&file_order, rows, n_head);
            wrong += pair_norm_gap(&permute_again(&file_order, rows, n_head), rows, n_head);
        }
        let n = c.num_layers as f64;
        let (hf, raw, wrong) = (hf / n, raw / n, wrong / n);
        eprintln!(
            "{proj}: pair norm gap HF order {hf:.3}, file order {raw:.3}, wrong way {wrong:.3}"
        );
        assert!(
            hf < 0.75 * wrong && hf < 0.5 * raw,
            "{proj}: {hf} vs {raw} / {wrong}"
        );
    }
}
