use super::test_support::{s, strings};
use super::writer::GgufWriter;
use super::*;
use crate::weights::TensorSource;
use proptest::prelude::*;

/// A tiny two-layer llama: hidden 8, 2 heads of 4, 1 KV head, FFN 16, vocab 4.
fn tiny_llama() -> GgufWriter {
    let ramp = |n: usize, scale: f32| (0..n).map(|i| i as f32 * scale).collect::<Vec<_>>();
    let mut b = GgufWriter::new()
        .meta("general.architecture", s("llama"))
        .meta("general.alignment", MetaValue::U32(64))
        .meta("llama.block_count", MetaValue::U32(2))
        .meta("llama.context_length", MetaValue::U32(128))
        .meta("llama.embedding_length", MetaValue::U32(8))
        .meta("llama.feed_forward_length", MetaValue::U64(16))
        .meta("llama.attention.head_count", MetaValue::U32(2))
        .meta("llama.attention.head_count_kv", MetaValue::U32(1))
        .meta("llama.rope.freq_base", MetaValue::F32(500000.0))
        .meta(
            "llama.attention.layer_norm_rms_epsilon",
            MetaValue::F32(1e-5),
        )
        .meta("tokenizer.ggml.model", s("gpt2"))
        .meta("tokenizer.ggml.pre", s("smollm"))
        .meta("tokenizer.ggml.tokens", strings(&["<s>", "</s>", "a", "b"]))
        .meta("tokenizer.ggml.merges", strings(&["a b"]))
        .meta(
            "tokenizer.ggml.token_type",
            MetaValue::Array(vec![
                MetaValue::I32(3),
                MetaValue::I32(3),
                MetaValue::I32(1),
                MetaValue::I32(1),
            ]),
        )
        .meta("tokenizer.ggml.bos_token_id", MetaValue::U32(0))
        .meta("tokenizer.ggml.eos_token_id", MetaValue::U32(1))
        .meta("tokenizer.ggml.eot_token_id", MetaValue::U32(1))
        .meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(false))
        .meta("tokenizer.chat_template", s("{{ x }}"))
        .meta(
            "test.nested",
            MetaValue::Array(vec![
                MetaValue::Array(vec![MetaValue::I64(-5), MetaValue::I64(7)]),
                MetaValue::Array(vec![MetaValue::I64(1)]),
            ]),
        )
        .meta("test.f64", MetaValue::F64(2.5))
        .meta("test.i8", MetaValue::I8(-3))
        .meta("test.u16", MetaValue::U16(65535))
        .f32_tensor("token_embd.weight", &[8, 4], &ramp(32, 0.5))
        .f32_tensor("output_norm.weight", &[8], &ramp(8, 1.0));
    b.alignment = 64;
    for layer in 0..2 {
        let t = |n: &str| format!("blk.{layer}.{n}.weight");
        b = b
            .f32_tensor(&t("attn_norm"), &[8], &ramp(8, 1.0))
            .f32_tensor(&t("ffn_norm"), &[8], &ramp(8, 1.0))
            .f32_tensor(&t("attn_q"), &[8, 8], &ramp(64, 1.0))
            .f32_tensor(&t("attn_k"), &[8, 4], &ramp(32, 1.0))
            .f32_tensor(&t("attn_v"), &[8, 4], &ramp(32, 1.0))
            .f32_tensor(&t("attn_output"), &[8, 8], &ramp(64, 1.0))
            .f32_tensor(&t("ffn_gate"), &[8, 16], &ramp(128, 1.0))
            .f32_tensor(&t("ffn_up"), &[8, 16], &ramp(128, 1.0))
            .f32_tensor(&t("ffn_down"), &[16, 8], &ramp(128, 1.0));
    }
    b
}

#[test]
fn reads_every_metadata_type_and_the_tensor_table() {
    let file = GgufFile::from_bytes(tiny_llama().build(), "tiny").unwrap();
    assert_eq!(file.version(), 3);
    assert_eq!(file.alignment(), 64);
    assert_eq!(file.data_offset() % 64, 0);
    assert_eq!(file.architecture().unwrap(), "llama");
    assert_eq!(file.get_u64("llama.feed_forward_length").unwrap(), Some(16));
    assert_eq!(file.get_f32("test.f64").unwrap(), Some(2.5));
    assert_eq!(file.get("test.i8"), Some(&MetaValue::I8(-3)));
    assert!(file
        .get_u64("test.i8")
        .unwrap_err()
        .to_string()
        .contains("test.i8"));
    assert_eq!(file.get_u64("test.u16").unwrap(), Some(65535));
    let nested = file
        .get("test.nested")
        .and_then(MetaValue::as_array)
        .unwrap();
    assert_eq!(nested[0].as_array().unwrap()[0].as_i64(), Some(-5));
    assert!(
        file.get_str("llama.block_count").is_err(),
        "a u32 is not a string"
    );
    assert_eq!(file.get_u64("absent.key").unwrap(), None);
    assert_eq!(file.tensors().len(), 20);
    let q = file.tensor_info("blk.1.attn_q.weight").unwrap();
    assert_eq!(q.dims, [8, 8]);
    assert_eq!(q.ggml_type, GgmlType::F32);
    assert_eq!(q.offset % 64, 0);
    let k = file.tensor_info("blk.0.attn_k.weight").unwrap();
    assert_eq!(k.shape(), [4, 8]);
    assert_eq!(file.tensor_bytes("blk.0.attn_k.weight").unwrap().len(), 128);
    let embd = file.tensor_f32("token_embd.weight").unwrap();
    assert_eq!(embd[31], 15.5);
    assert!(matches!(
        file.tensor_bytes("nope"),
        Err(ModelError::MissingTensor(_))
    ));
}

#[test]
fn tokenizer_spec_is_filled_from_metadata() {
    let file = GgufFile::from_bytes(tiny_llama().build(), "tiny").unwrap();
    let spec = file.tokenizer_spec().unwrap();
    assert_eq!(spec.model, "gpt2");
    assert_eq!(spec.pre, "smollm");
    assert_eq!(spec.tokens, ["<s>", "</s>", "a", "b"]);
    assert_eq!(spec.merges, ["a b"]);
    assert_eq!(spec.token_types, [3, 3, 1, 1]);
    assert!(spec.scores.is_empty());
    assert_eq!(spec.bos_token_id, Some(0));
    assert_eq!(spec.eos_token_id, Some(1));
    assert_eq!(spec.unknown_token_id, None);
    assert_eq!(spec.add_bos_token, Some(false));
    assert_eq!(spec.add_eos_token, None);
    assert_eq!(spec.chat_template.as_deref(), Some("{{ x }}"));
}

#[test]
fn tokenizer_spec_rejects_out_of_range_ids_and_length_mismatches() {
    let bytes = tiny_llama()
        .meta("tokenizer.ggml.padding_token_id", MetaValue::U32(4))
        .build();
    let err = GgufFile::from_bytes(bytes, "t")
        .unwrap()
        .tokenizer_spec()
        .unwrap_err();
    assert!(err.to_string().contains("padding_token_id"), "{err}");
    let bytes = tiny_llama()
        .meta(
            "tokenizer.ggml.scores",
            MetaValue::Array(vec![MetaValue::F32(0.0)]),
        )
        .build();
    let err = GgufFile::from_bytes(bytes, "t")
        .unwrap()
        .tokenizer_spec()
        .unwrap_err();
    assert!(err.to_string().contains("scores"), "{err}");
}

#[test]
fn model_config_names_and_shapes() {
    let model =
        GgufModel::from_file(GgufFile::from_bytes(tiny_llama().build(), "t").unwrap()).unwrap();
    let c = model.config();
    assert_eq!(
        (
            c.num_layers,
            c.hidden_size,
            c.intermediate_size,
            c.num_heads,
            c.num_kv_heads
        ),
        (2, 8, 16, 2, 1)
    );
    assert_eq!(
        (c.head_dim, c.vocab_size, c.max_position_embeddings),
        (4, 4, 128)
    );
    assert_eq!(c.rope_theta, 500000.0);
    assert_eq!(c.rms_norm_eps, 1e-5);
    assert!(c.tie_word_embeddings, "no output.weight");
    assert!(!c.attention_bias);
    assert_eq!(c.bos_token_id, Some(0));
    assert_eq!(c.eos_token_ids, [1], "eos and eot are the same token");
    assert!(model.contains("model.layers.1.mlp.down_proj.weight"));
    assert!(model.contains("model.layers.0.post_attention_layernorm.weight"));
    assert!(!model.contains("lm_head.weight"));
    assert_eq!(model.tensor_names().len(), 20);
    let down = model.tensor("model.layers.0.mlp.down_proj.weight").unwrap();
    assert_eq!(down.shape, [8, 16]);
    // ne = [16, 8]: 8 rows of 16 contiguous values, unchanged order.
    assert_eq!(down.data[16], 16.0);
    let embed = model.tensor("model.embed_tokens.weight").unwrap();
    assert_eq!(embed.shape, [4, 8]);
}

#[test]
fn q_and_k_rows_are_unpermuted_for_llama() {
    let model =
        GgufModel::from_file(GgufFile::from_bytes(tiny_llama().build(), "t").unwrap()).unwrap();
    // q: 2 heads of head_dim 4, rows of 8 values; GGUF row r holds values r*8..r*8+8.
    // Within a head, GGUF rows (0,1,2,3) = HF rows (0,2,1,3): pairs (i, j) -> j*2 + i.
    let q = model
        .tensor("model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    assert_eq!(q.shape, [8, 8]);
    let first_of_row = |t: &crate::weights::Tensor, r: usize| t.data[r * 8] / 8.0;
    let order: Vec<f32> = (0..8).map(|r| first_of_row(&q, r)).collect();
    assert_eq!(order, [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
    let k = model
        .tensor("model.layers.0.self_attn.k_proj.weight")
        .unwrap();
    let order: Vec<f32> = (0..4).map(|r| first_of_row(&k, r)).collect();
    assert_eq!(order, [0.0, 2.0, 1.0, 3.0]);
    // v is never permuted.
    let v = model
        .tensor("model.layers.0.self_attn.v_proj.weight")
        .unwrap();
    let order: Vec<f32> = (0..4).map(|r| first_of_row(&v, r)).collect();
    assert_eq!(order, [0.0, 1.0, 2.0, 3.0]);
}

#[test]
fn unpermute_inverts_the_converter_permutation() {
    // The converter's permutation: HF row h*hd + j*half + i goes to GGUF row h*hd + 2i + j.
    let (n_head, head_dim, row_len) = (3usize, 8usize, 2usize);
    let rows = n_head * head_dim;
    let hf: Vec<f32> = (0..rows * row_len).map(|x| x as f32).collect();
    let mut gguf = vec![0f32; hf.len()];
    let half = head_dim / 2;
    for h in 0..n_head {
        for j in 0..2 {
            for i in 0..half {
                let src = h * head_dim + j * half + i;
                let dst = h * head_dim + 2 * i + j;
                gguf[dst * row_len..(dst + 1) * row_len]
                    .copy_from_slice(&hf[src * row_len..(src + 1) * row_len]);
            }
        }
    }
    assert_eq!(
        model::unpermute_rows(&gguf, &[rows, row_len], n_head).unwrap(),
        hf
    );
    assert!(model::unpermute_rows(&gguf, &[rows, row_len], 5).is_err());
}

#[test]
fn qwen2_is_not_unpermuted_and_unknown_architectures_are_named() {
    let mut b = tiny_llama();
    for (k, v) in b.metadata.iter_mut() {
        if let Some(rest) = k.strip_prefix("llama.") {
            *k = format!("qwen2.{rest}");
        }
        if k == "general.architecture" {
            *v = s("qwen2");
        }
    }
    let model = GgufModel::from_file(GgufFile::from_bytes(b.build(), "t").unwrap()).unwrap();
    let q = model
        .tensor("model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    assert_eq!(q.data[8], 8.0, "row 1 stays row 1");

    let mut b = tiny_llama();
    b.metadata[0].1 = s("gptneox");
    let err = GgufModel::from_file(GgufFile::from_bytes(b.build(), "t").unwrap()).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("gptneox") && msg.contains("llama, qwen2, mistral"),
        "{msg}"
    );
}

#[test]
fn rope_scaling_that_cannot_be_expressed_is_refused() {
    let b = tiny_llama().meta("llama.rope.scaling.type", s("yarn"));
    let err = GgufModel::from_file(GgufFile::from_bytes(b.build(), "t").unwrap()).unwrap_err();
    assert!(matches!(err, ModelError::Unsupported(ref m) if m.contains("yarn")));
    let b = tiny_llama().meta("llama.rope.scaling.type", s("none"));
    assert!(GgufModel::from_file(GgufFile::from_bytes(b.build(), "t").unwrap()).is_ok());
}

#[test]
fn vocab_must_match_the_embedding() {
    let mut b = tiny_llama();
    for (k, v) in b.metadata.iter_mut() {
        if k == "tokenizer.ggml.tokens" {
            *v = strings(&["a", "b", "c"]);
        }
    }
    // token_type still has 4 entries, but config fails first on the embedding shape.
    let err = GgufModel::from_file(GgufFile::from_bytes(b.build(), "t").unwrap()).unwrap_err();
    assert!(matches!(err, ModelError::TensorShape { .. }), "{err}");
}

#[test]
fn structural_corruption_is_reported_by_name() {
    let good = tiny_llama().build();
    let open = |bytes: Vec<u8>| GgufFile::from_bytes(bytes, "x").unwrap_err().to_string();

    assert!(open(good[..3].to_vec()).contains("magic"));
    let mut bad = good.clone();
    bad[0] = b'X';
    assert!(open(bad).contains("not a GGUF"));
    let mut v1 = good.clone();
    v1[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(open(v1).contains("version 1"));
    // Tensor count 2^40: refused before any allocation.
    let mut huge = good.clone();
    huge[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(open(huge).contains("tensor info count"));
    let mut huge = good.clone();
    huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(open(huge).contains("metadata entry count"));
    // Cut inside the data section: the last tensor no longer fits.
    let cut = open(good[..good.len() - 4].to_vec());
    assert!(cut.contains("extends past the end"), "{cut}");
    // Cut inside the metadata: too short for the declared entry count, then mid-value.
    let cut = open(good[..200].to_vec());
    assert!(cut.contains("metadata entry count 24 cannot fit"), "{cut}");
    let cut = open(good[..700].to_vec());
    assert!(cut.contains("truncated") || cut.contains("claims"), "{cut}");

    let b = GgufWriter::new().meta("general.alignment", MetaValue::U32(24));
    assert!(open(b.build()).contains("power of two"));
    let b = GgufWriter::new()
        .meta("a", MetaValue::U8(1))
        .meta("a", MetaValue::U8(2));
    assert!(open(b.build()).contains("duplicate metadata key"));
    let b = GgufWriter::new().tensor("q", &[31], GgmlType::Q8_0, vec![0; 34]);
    assert!(open(b.build()).contains("block size"));
    let b = GgufWriter::new().f32_tensor("a", &[1, 1, 1, 1, 1], &[0.0]);
    assert!(open(b.build()).contains("dimensions"));
    let b = GgufWriter::new().f32_tensor("a", &[u64::MAX, 2], &[0.0]);
    assert!(open(b.build()).contains("overflow"));
    let mut deep = MetaValue::U8(0);
    for _ in 0..10 {
        deep = MetaValue::Array(vec![deep]);
    }
    assert!(open(GgufWriter::new().meta("deep", deep).build()).contains("nests"));
    let mut bad_bool = GgufWriter::new().meta("b", MetaValue::Bool(true)).build();
    // header (24) + key "b" (8 + 1) + value type (4), then the bool byte.
    bad_bool[37] = 2;
    assert!(open(bad_bool).contains("not 0 or 1"));
}

#[test]
fn unknown_tensor_type_is_unsupported_and_unknown_quant_cannot_dequantize() {
    let mut b = GgufWriter::new().tensor("t", &[256], GgmlType::IQ2_XXS, vec![0; 66]);
    let file = GgufFile::from_bytes(b.build(), "x").unwrap();
    let err = file.tensor_f32("t").unwrap_err();
    assert!(
        matches!(err, ModelError::Unsupported(ref m) if m.contains("IQ2_XXS") && m.contains("'t'"))
    );
    b.tensors[0].2 = GgmlType::F32;
    let mut bytes = b.build();
    let pos = type_id_position(&bytes);
    bytes[pos..pos + 4].copy_from_slice(&77u32.to_le_bytes());
    let err = GgufFile::from_bytes(bytes, "x").unwrap_err();
    assert!(matches!(err, ModelError::Unsupported(ref m) if m.contains("type id 77")));
}

/// Position of the ggml type field of the first tensor info in a builder file with no metadata
/// and one 1-D tensor named "t": header (24) + name (8 + 1) + n_dims (4) + one dim (8).
fn type_id_position(bytes: &[u8]) -> usize {
    let pos = 24 + 9 + 4 + 8;
    assert_eq!(&bytes[24 + 8..24 + 9], b"t");
    pos
}

fn small_valid_file() -> Vec<u8> {
    let q8_block: Vec<u8> = {
        let mut b = half::f16::from_f32(0.5).to_bits().to_le_bytes().to_vec();
        b.extend((0..32).map(|i| i as u8));
        b
    };
    GgufWriter::new()
        .meta("general.architecture", s("llama"))
        .meta(
            "k.arr",
            MetaValue::Array(vec![MetaValue::U32(1), MetaValue::U32(2)]),
        )
        .meta("k.str", strings(&["x", "yz"]))
        .meta("k.f", MetaValue::F32(1.0))
        .f32_tensor("a", &[4, 2], &[1.0; 8])
        .tensor("b", &[32], GgmlType::Q8_0, q8_block)
        .build()
}

/// Opening must never panic: exercise every accessor on whatever parses.
fn open_and_touch(bytes: Vec<u8>) {
    if let Ok(file) = GgufFile::from_bytes(bytes, "fuzz") {
        for t in file.tensors().to_vec() {
            let _ = file.tensor_f32(&t.name);
        }
        let _ = file.tokenizer_spec();
        let _ = GgufModel::from_file(file);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        open_and_touch(bytes);
    }

    #[test]
    fn gguf_prefix_with_random_tail_never_panics(tail in proptest::collection::vec(any::<u8>(), 0..256)) {
        let mut bytes = b"GGUF".to_vec();
        bytes.extend_from_slice(&3u32.to_le_bytes());
        bytes.extend(tail);
        open_and_touch(bytes);
    }

    #[test]
    fn truncation_never_panics(cut in 0usize..1000) {
        let good = small_valid_file();
        let cut = cut.min(good.len());
        let truncated = good[..cut].to_vec();
        let complete = cut == good.len();
        let result = GgufFile::from_bytes(truncated.clone(), "t");
        prop_assert_eq!(result.is_ok(), complete, "cut at {} of {}", cut, good.len());
        open_and_touch(truncated);
    }

    #[test]
    fn bit_flips_never_panic(flips in proptest::collection::vec((any::<prop::sample::Index>(), 0u8..8), 1..6)) {
        let mut bytes = small_valid_file();
        for (index, bit) in flips {
            let i = index.index(bytes.len());
            bytes[i] ^= 1 << bit;
        }
        open_and_touch(bytes);
    }

    #[test]
    fn random_overwrites_never_panic(edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u64>()), 1..4)) {
        let mut bytes = small_valid_file();
        for (index, value) in edits {
            let i = index.index(bytes.len().saturating_sub(8));
            bytes[i..i + 8].copy_from_slice(&value.to_le_bytes());
        }
        open_and_touch(bytes);
    }
}

#[test]
fn the_small_valid_file_is_valid() {
    let file = GgufFile::from_bytes(small_valid_file(), "t").unwrap();
    assert_eq!(file.tensor_f32("b").unwrap()[3], 1.5);
    assert_eq!(file.tensor_f32("a").unwrap(), [1.0; 8]);
}

#[test]
fn llama3_rope_scaling_is_recovered_from_rope_freqs() {
    use crate::config::RopeScaling;
    let truth = RopeScaling {
        factor: 32.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let (head_dim, theta) = (64usize, 500000.0f32);
    let factors: Vec<f32> = (0..head_dim / 2)
        .map(|i| {
            let inv_freq = (theta as f64).powf(-(2.0 * i as f64) / head_dim as f64);
            model::llama3_factor(2.0 * std::f64::consts::PI / inv_freq, &truth) as f32
        })
        .collect();
    assert!(
        factors.iter().any(|&f| f > 1.0 && f < 32.0),
        "some blended frequencies"
    );
    let got = model::llama3_scaling_from_factors(&factors, head_dim, theta, 8192).unwrap();
    assert_eq!(got.factor, 32.0);
    assert!((got.low_freq_factor - 1.0).abs() < 1e-3, "{got:?}");
    assert!((got.high_freq_factor - 4.0).abs() < 1e-3, "{got:?}");

    // Through a file: the config carries the recovered scaling. With base 1e7 and head_dim 4 the
    // second frequency's wavelength (2 pi sqrt(1e7) ~ 19869) is past the 8192 low-frequency edge.
    let with_freqs = |factors: &[f32]| {
        let mut b = tiny_llama().f32_tensor("rope_freqs.weight", &[2], factors);
        for (k, v) in b.metadata.iter_mut() {
            if k == "llama.rope.freq_base" {
                *v = MetaValue::F32(1e7);
            }
        }
        b
    };
    let b = with_freqs(&[1.0, 8.0]);
    let c = GgufModel::from_file(GgufFile::from_bytes(b.build(), "t").unwrap())
        .unwrap()
        .config()
        .clone();
    assert_eq!(c.rope_scaling.map(|s| s.factor), Some(8.0));

    // Divisors that shrink with wavelength follow no Llama 3 rule.
    let mut bad = factors.clone();
    bad.reverse();
    assert!(model::llama3_scaling_from_factors(&bad, head_dim, theta, 8192).is_none());
    let b = with_freqs(&[8.0, 1.0]);
    let err = GgufModel::from_file(GgufFile::from_bytes(b.build(), "t").unwrap()).unwrap_err();
    assert!(matches!(err, ModelError::Unsupported(ref m) if m.contains("rope_freqs")));
}

/// `tiny_llama` with one metadata value replaced.
fn tiny_llama_with(key: &str, value: MetaValue) -> Vec<u8> {
    let mut b = tiny_llama();
    for (k, v) in b.metadata.iter_mut() {
        if k == key {
            *v = value.clone();
        }
    }
    b.build()
}

#[test]
fn a_zero_embedding_length_names_its_key() {
    // Issue 30: with a rope dimension count present this said "partial rotary embeddings (64
    // of 0 head dimensions)".
    for (key, value) in [
        ("llama.embedding_length", MetaValue::U32(0)),
        ("llama.feed_forward_length", MetaValue::U64(0)),
        ("llama.block_count", MetaValue::U32(0)),
    ] {
        let mut b = tiny_llama().meta("llama.rope.dimension_count", MetaValue::U32(4));
        for (k, v) in b.metadata.iter_mut() {
            if k == key {
                *v = value.clone();
            }
        }
        let file = GgufFile::from_bytes(b.build(), "tiny").unwrap();
        let err = GgufModel::from_file(file).unwrap_err().to_string();
        assert!(
            err.contains(key) && err.contains("must be positive"),
            "{key}: {err}"
        );
    }
    let b = tiny_llama().meta("llama.attention.key_length", MetaValue::U32(0));
    let file = GgufFile::from_bytes(b.build(), "tiny").unwrap();
    let err = GgufModel::from_file(file).unwrap_err().to_string();
    assert!(err.contains("llama.attention.key_length"), "{err}");
}

#[test]
fn layer_and_context_counts_are_checked_before_they_size_anything() {
    for (key, value, want) in [
        (
            "llama.block_count",
            MetaValue::U32(4294967295),
            "llama.block_count",
        ),
        (
            "llama.block_count",
            MetaValue::U64(1 << 60),
            "llama.block_count",
        ),
        ("llama.block_count", MetaValue::U32(3), "holds 2 layers"),
        (
            "llama.context_length",
            MetaValue::U32(0),
            "must be positive",
        ),
        ("llama.context_length", MetaValue::U64(1 << 40), "limit"),
        (
            "llama.attention.head_count",
            MetaValue::U32(0),
            "llama.attention.head_count'",
        ),
    ] {
        let file = GgufFile::from_bytes(tiny_llama_with(key, value), "tiny").unwrap();
        let err = GgufModel::from_file(file).unwrap_err().to_string();
        assert!(err.contains(want), "{key}: {err}");
    }
}

#[test]
fn non_finite_tensor_values_name_the_tensor_not_a_path() {
    let mut b = tiny_llama();
    for (name, _, _, data) in b.tensors.iter_mut() {
        if name == "output_norm.weight" {
            data[..4].copy_from_slice(&f32::NAN.to_le_bytes());
        }
    }
    let model = GgufModel::from_file(GgufFile::from_bytes(b.build(), "tiny").unwrap()).unwrap();
    let err = crate::llama::Model::from_source(&model).expect_err("a NaN norm was accepted");
    assert!(
        matches!(&err, ModelError::BadTensor { name, .. } if name == "model.norm.weight"),
        "{err}"
    );
    assert!(!err.to_string().contains("malformed model file"), "{err}");
}

#[test]
fn a_fifo_is_refused_without_blocking() {
    let dir = std::env::temp_dir().join(format!("sieve-fifo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fifo = dir.join("model.gguf");
    let _ = std::fs::remove_file(&fifo);
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if !made.is_ok_and(|s| s.success()) {
        eprintln!("skipped: mkfifo is unavailable");
        return;
    }
    // Opening a FIFO with no writer would block forever; the readers must not open it.
    let (tx, rx) = std::sync::mpsc::channel();
    let path = fifo.clone();
    std::thread::spawn(move || {
        let results = [
            crate::weights::open_model(&path)
                .err()
                .map(|e| e.to_string()),
            GgufFile::open(&path).err().map(|e| e.to_string()),
            crate::packed::load_model_and_tokenizer(&path)
                .err()
                .map(|e| e.to_string()),
        ];
        let _ = tx.send(results);
    });
    let results = rx
        .recv_timeout(std::time::Duration::from_secs(20))
        .expect("opening a FIFO as a model blocked");
    for r in results {
        let err = r.expect("a FIFO was accepted as a model");
        assert!(err.contains("FIFO"), "{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
