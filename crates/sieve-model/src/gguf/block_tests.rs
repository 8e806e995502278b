//! GGUF files whose linears are quantized blocks, loaded as blocks (`sieve_cpu::gguf_blocks`)
//! and run through the model against their f16 twins.

use sieve_cpu::gguf_blocks::dequant::GgmlType;
use sieve_cpu::gguf_blocks::test_blocks::{random_blocks, random_x};
use sieve_cpu::gguf_blocks::BlockType;
use sieve_formats::WeightFormat;
/// A two-layer llama GGUF (hidden 32, 2 heads of 16, 1 KV head, FFN 64, vocab 4) whose linears
/// are Q4_1 and Q8_0 blocks, with v_proj left in f32 and the tied embedding in Q8_0.
fn quantized_gguf() -> crate::gguf::GgufModel {
    use crate::gguf::test_support::{s, strings};
    use crate::gguf::writer::GgufWriter;
    use crate::gguf::{GgufFile, MetaValue};
    let norm: Vec<f32> = vec![1.0; 32];
    let mut b = GgufWriter::new()
        .meta("general.architecture", s("llama"))
        .meta("llama.block_count", MetaValue::U32(2))
        .meta("llama.context_length", MetaValue::U32(64))
        .meta("llama.embedding_length", MetaValue::U32(32))
        .meta("llama.feed_forward_length", MetaValue::U32(64))
        .meta("llama.attention.head_count", MetaValue::U32(2))
        .meta("llama.attention.head_count_kv", MetaValue::U32(1))
        .meta(
            "llama.attention.layer_norm_rms_epsilon",
            MetaValue::F32(1e-5),
        )
        .meta("tokenizer.ggml.tokens", strings(&["a", "b", "c", "d"]))
        .tensor(
            "token_embd.weight",
            &[32, 4],
            GgmlType::Q8_0,
            random_blocks(BlockType::Q8_0, 4, 32, 1),
        )
        .f32_tensor("output_norm.weight", &[32], &norm);
    for layer in 0..2u64 {
        let t = |n: &str| format!("blk.{layer}.{n}.weight");
        let q = |ty: BlockType, rows: usize, cols: usize, seed: u64| {
            random_blocks(ty, rows, cols, seed + 10 * layer)
        };
        let v: Vec<f32> = random_x(16 * 32, 3 + layer)
            .iter()
            .map(|x| 0.05 * x)
            .collect();
        b = b
            .f32_tensor(&t("attn_norm"), &[32], &norm)
            .f32_tensor(&t("ffn_norm"), &[32], &norm)
            .tensor(
                &t("attn_q"),
                &[32, 32],
                GgmlType::Q4_1,
                q(BlockType::Q4_1, 32, 32, 2),
            )
            .tensor(
                &t("attn_k"),
                &[32, 16],
                GgmlType::Q8_0,
                q(BlockType::Q8_0, 16, 32, 3),
            )
            .f32_tensor(&t("attn_v"), &[32, 16], &v)
            .tensor(
                &t("attn_output"),
                &[32, 32],
                GgmlType::Q4_1,
                q(BlockType::Q4_1, 32, 32, 4),
            )
            .tensor(
                &t("ffn_gate"),
                &[32, 64],
                GgmlType::Q4_1,
                q(BlockType::Q4_1, 64, 32, 5),
            )
            .tensor(
                &t("ffn_up"),
                &[32, 64],
                GgmlType::Q4_0,
                q(BlockType::Q4_0, 64, 32, 6),
            )
            .tensor(
                &t("ffn_down"),
                &[64, 32],
                GgmlType::Q4_1,
                q(BlockType::Q4_1, 32, 64, 7),
            );
    }
    crate::gguf::GgufModel::from_file(GgufFile::from_bytes(b.build(), "quantized").unwrap())
        .unwrap()
}

#[test]
fn gguf_blocks_come_back_in_hugging_face_row_order() {
    use crate::weights::TensorSource;
    let model = quantized_gguf();
    for name in [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ] {
        // The f32 reader unpermutes Q/K rows after dequantizing; the block reader moves the
        // blocks themselves: both must give the same matrix.
        let blocks = model.quantized_matrix(name).unwrap().unwrap();
        let f32_tensor = model.tensor(name).unwrap();
        assert_eq!(f32_tensor.shape, [blocks.rows(), blocks.cols()], "{name}");
        let mut row = vec![0f32; blocks.cols()];
        for r in 0..blocks.rows() {
            blocks.dequantize_row(r, &mut row);
            assert_eq!(
                row,
                f32_tensor.data[r * row.len()..(r + 1) * row.len()],
                "{name} row {r}"
            );
        }
    }
    // f32 tensors and norms are not blocks.
    assert!(model
        .quantized_matrix("model.layers.0.self_attn.v_proj.weight")
        .unwrap()
        .is_none());
    assert!(model
        .quantized_matrix("model.norm.weight")
        .unwrap()
        .is_none());
    assert!(model.quantized_matrix("no.such.weight").is_err());
}

#[test]
fn a_model_on_gguf_blocks_agrees_with_its_f16_twin() {
    use crate::llama::{Logits, Model};
    let source = quantized_gguf();
    let blocks = Model::from_source(&source).unwrap();
    let dense = Model::from_source_f16(&source).unwrap();
    // Block linears report their block bytes (Q4_1 q_proj: 32 rows x 1 block x 20 B); the f32
    // v_proj is dense f16 in both.
    let l0 = &blocks.layers()[0];
    assert_eq!(l0.q_proj.format().storage().total_bytes(), 32 * 20);
    assert_eq!(l0.v_proj.format().storage().total_bytes(), 16 * 32 * 2);
    assert_eq!(
        dense.layers()[0].q_proj.format().storage().total_bytes(),
        32 * 32 * 2
    );
    assert_eq!(blocks.lm_head().format().storage().total_bytes(), 4 * 34);
    let tokens = [0u32, 2, 1, 3, 3, 2, 0, 1, 2, 2, 3];
    let run = |m: &Model| {
        let mut cache = m.new_cache(tokens.len());
        m.forward(&tokens, &mut cache, Logits::All).unwrap()
    };
    let (a, b) = (run(&blocks), run(&dense));
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (x, y) in a.iter().zip(&b) {
        // 8-bit activations move these random-weight logits by well under 5% of their range.
        assert!((x - y).abs() <= 0.05 * scale, "{x} vs {y} (scale {scale})");
    }
}

/// A one-layer llama GGUF of the K-quant era (hidden 256, 2 heads of 128, 1 KV head, FFN 512,
/// vocab 4) with a different offset block type in every linear and a Q6_K tied embedding.
fn offset_gguf() -> crate::gguf::GgufModel {
    use crate::gguf::test_support::{s, strings};
    use crate::gguf::writer::GgufWriter;
    use crate::gguf::{GgufFile, MetaValue};
    let norm: Vec<f32> = vec![1.0; 256];
    let t = |n: &str| format!("blk.0.{n}.weight");
    let q = |ty: BlockType, rows: usize, cols: usize, seed: u64| {
        (ty.ggml(), random_blocks(ty, rows, cols, seed))
    };
    let linears = [
        ("attn_q", [256, 256], q(BlockType::Q5_0, 256, 256, 2)),
        ("attn_k", [256, 128], q(BlockType::Q5_1, 128, 256, 3)),
        ("attn_v", [256, 128], q(BlockType::Q6_K, 128, 256, 4)),
        ("attn_output", [256, 256], q(BlockType::Q4_K, 256, 256, 5)),
        ("ffn_gate", [256, 512], q(BlockType::Q5_K, 512, 256, 6)),
        ("ffn_up", [256, 512], q(BlockType::Q4_K, 512, 256, 7)),
        ("ffn_down", [512, 256], q(BlockType::Q6_K, 256, 512, 8)),
    ];
    let mut b = GgufWriter::new()
        .meta("general.architecture", s("llama"))
        .meta("llama.block_count", MetaValue::U32(1))
        .meta("llama.context_length", MetaValue::U32(64))
        .meta("llama.embedding_length", MetaValue::U32(256))
        .meta("llama.feed_forward_length", MetaValue::U32(512))
        .meta("llama.attention.head_count", MetaValue::U32(2))
        .meta("llama.attention.head_count_kv", MetaValue::U32(1))
        .meta(
            "llama.attention.layer_norm_rms_epsilon",
            MetaValue::F32(1e-5),
        )
        .meta("tokenizer.ggml.tokens", strings(&["a", "b", "c", "d"]))
        .tensor(
            "token_embd.weight",
            &[256, 4],
            GgmlType::Q6_K,
            random_blocks(BlockType::Q6_K, 4, 256, 1),
        )
        .f32_tensor("output_norm.weight", &[256], &norm)
        .f32_tensor(&t("attn_norm"), &[256], &norm)
        .f32_tensor(&t("ffn_norm"), &[256], &norm);
    for (name, shape, (ty, bytes)) in linears {
        b = b.tensor(&t(name), &[shape[0] as u64, shape[1] as u64], ty, bytes);
    }
    crate::gguf::GgufModel::from_file(GgufFile::from_bytes(b.build(), "offset").unwrap()).unwrap()
}

#[test]
fn gguf_offset_types_load_as_blocks_and_agree_with_the_f16_twin() {
    use crate::llama::{Logits, Model};
    let source = offset_gguf();
    let blocks = Model::from_source(&source).unwrap();
    let dense = Model::from_source_f16(&source).unwrap();
    let l = &blocks.layers()[0];
    let expect = [
        (&l.q_proj, BlockType::Q5_0),
        (&l.k_proj, BlockType::Q5_1),
        (&l.v_proj, BlockType::Q6_K),
        (&l.o_proj, BlockType::Q4_K),
        (&l.gate_proj, BlockType::Q5_K),
        (&l.up_proj, BlockType::Q4_K),
        (&l.down_proj, BlockType::Q6_K),
        (blocks.lm_head(), BlockType::Q6_K),
    ];
    for (lin, ty) in expect {
        assert!(lin.is_quantized_blocks(), "{ty:?}");
        let elems = lin.rows() * lin.cols();
        assert_eq!(
            lin.format().storage().total_bytes(),
            elems / ty.block_elems() * ty.block_bytes(),
            "{ty:?}"
        );
    }
    // The Q/K rows were unpermuted as blocks: they dequantize to the f32 reader's rows.
    use crate::weights::TensorSource;
    for name in [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
    ] {
        let m = source.quantized_matrix(name).unwrap().unwrap();
        let f = source.tensor(name).unwrap();
        let mut row = vec![0f32; m.cols()];
        for r in 0..m.rows() {
            m.dequantize_row(r, &mut row);
            assert_eq!(
                row,
                f.data[r * row.len()..(r + 1) * row.len()],
                "{name} row {r}"
            );
        }
    }
    let tokens = [0u32, 2, 1, 3, 3, 2, 0, 1, 2, 2, 3];
    let run = |m: &Model| {
        let mut cache = m.new_cache(tokens.len());
        m.forward(&tokens, &mut cache, Logits::All).unwrap()
    };
    let (a, b) = (run(&blocks), run(&dense));
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(scale > 0.0);
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 0.05 * scale, "{x} vs {y} (scale {scale})");
    }
}
