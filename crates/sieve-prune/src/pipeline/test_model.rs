//! A tiny random Llama model (2 layers, d 32) with its calibration windows and pipeline options,
//! shared by the tests in `pipeline`'s files that run the whole pass on it.

use super::{PipelineOptions, TealAllocation, ValueGrid};
use crate::methods::Method;
use crate::sparsegpt::SparseGptOptions;
use sieve_formats::random::SplitMix64;
use sieve_model::config::ModelConfig;
use sieve_model::weights::{Tensor, TensorSource};
use std::collections::HashMap;

pub(super) struct RandomSource {
    config: ModelConfig,
    tensors: HashMap<String, Tensor>,
}

impl TensorSource for RandomSource {
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn tensor_names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }
    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
    fn tensor(&self, name: &str) -> sieve_model::Result<Tensor> {
        self.tensors
            .get(name)
            .cloned()
            .ok_or_else(|| sieve_model::ModelError::MissingTensor(name.into()))
    }
}

fn config() -> ModelConfig {
    ModelConfig {
        architecture: "llama".into(),
        vocab_size: 50,
        hidden_size: 32,
        intermediate_size: 64,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        max_position_embeddings: 128,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        attention_bias: false,
        tie_word_embeddings: true,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
    }
}

pub(super) fn source() -> RandomSource {
    let c = config();
    let mut rng = SplitMix64::new(7);
    let mut tensors = HashMap::new();
    let mut put = |name: String, shape: Vec<usize>, norm: bool| {
        let n: usize = shape.iter().product();
        let data = (0..n)
            .map(|_| {
                let v = rng.normal() as f32;
                if norm {
                    1.0 + 0.1 * v
                } else {
                    0.2 * v
                }
            })
            .collect();
        tensors.insert(name, Tensor { shape, data });
    };
    let (d, i, q, kv) = (c.hidden_size, c.intermediate_size, 32, 16);
    put(
        "model.embed_tokens.weight".into(),
        vec![c.vocab_size, d],
        false,
    );
    put("model.norm.weight".into(), vec![d], true);
    for l in 0..c.num_layers {
        let p = format!("model.layers.{l}");
        put(format!("{p}.input_layernorm.weight"), vec![d], true);
        put(
            format!("{p}.post_attention_layernorm.weight"),
            vec![d],
            true,
        );
        put(format!("{p}.self_attn.q_proj.weight"), vec![q, d], false);
        put(format!("{p}.self_attn.k_proj.weight"), vec![kv, d], false);
        put(format!("{p}.self_attn.v_proj.weight"), vec![kv, d], false);
        put(format!("{p}.self_attn.o_proj.weight"), vec![d, q], false);
        put(format!("{p}.mlp.gate_proj.weight"), vec![i, d], false);
        put(format!("{p}.mlp.up_proj.weight"), vec![i, d], false);
        put(format!("{p}.mlp.down_proj.weight"), vec![d, i], false);
    }
    RandomSource { config: c, tensors }
}

pub(super) fn windows() -> Vec<Vec<u32>> {
    let mut rng = SplitMix64::new(3);
    (0..3)
        .map(|_| (0..40).map(|_| rng.below(50) as u32).collect())
        .collect()
}

pub(super) fn options(
    method: Method,
    pattern: &str,
    sp: f64,
    dp: f64,
    format: &str,
) -> PipelineOptions {
    PipelineOptions {
        method,
        pattern: pattern.parse().unwrap(),
        sp,
        dp,
        format: format.parse().unwrap(),
        sparsegpt: SparseGptOptions::default(),
        report_tokens: 64,
        teal_allocation: TealAllocation::Uniform,
        values: ValueGrid::F16,
    }
}

pub(super) fn zero_fraction_per_row(lin: &sieve_model::linear::Linear) -> Vec<f64> {
    let m = lin.format().decode();
    (0..m.rows())
        .map(|r| {
            m.row(r)
                .iter()
                .filter(|v| sieve_formats::matrix::is_zero(**v))
                .count() as f64
                / m.cols() as f64
        })
        .collect()
}
