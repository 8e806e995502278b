//! The architecture hyper-parameters of a Llama-family model, however they were stored.

use serde::{Deserialize, Serialize};

/// Everything the forward pass needs to know about the architecture.
/// Filled from GGUF metadata (`llama.*`, `qwen2.*`) or a Hugging Face `config.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// `llama`, `qwen2`, `mistral`, ... (GGUF `general.architecture` or HF `model_type`).
    pub architecture: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    /// Per-head dimension; usually hidden_size / num_heads.
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    /// Llama-3 style RoPE frequency scaling, when the model uses it.
    pub rope_scaling: Option<RopeScaling>,
    /// Whether q/k/v projections carry a bias (Qwen2 does).
    pub attention_bias: bool,
    /// Whether the LM head shares the token-embedding matrix.
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// Llama 3.1 "llama3" RoPE scaling parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

/// Upper bounds on the hyper-parameters a model file may state. Each is far above any released
/// Llama-family model (Llama 3.1 405B: 126 layers, hidden 16384, FFN 53248, 128 heads, 128k
/// context, 128k vocabulary) and low enough that a corrupted count fails here, with a message,
/// instead of sizing a buffer the machine cannot hold.
pub mod limits {
    pub const MAX_LAYERS: usize = 1024;
    pub const MAX_HIDDEN_SIZE: usize = 1 << 17;
    pub const MAX_INTERMEDIATE_SIZE: usize = 1 << 20;
    pub const MAX_HEADS: usize = 1 << 12;
    pub const MAX_HEAD_DIM: usize = 1 << 12;
    pub const MAX_VOCAB_SIZE: usize = 1 << 24;
    /// Positions (`max_position_embeddings`, GGUF `context_length`): 16M.
    pub const MAX_CONTEXT: usize = 1 << 24;
}

impl ModelConfig {
    /// Checks every hyper-parameter against the [`limits`] and the relations the forward pass
    /// relies on. `key` maps a field name (`num_layers`, `num_heads`, ...) to the name the file
    /// used for it (`llama.block_count`, `config.json:num_hidden_layers`), so the error names
    /// the value the user can find in their file.
    pub fn check(&self, key: &dyn Fn(&str) -> String) -> crate::Result<()> {
        use crate::ModelError;
        let err = |field: &str, reason: String| ModelError::Metadata {
            key: key(field),
            reason,
        };
        let bounded = [
            ("vocab_size", self.vocab_size, limits::MAX_VOCAB_SIZE),
            ("hidden_size", self.hidden_size, limits::MAX_HIDDEN_SIZE),
            (
                "intermediate_size",
                self.intermediate_size,
                limits::MAX_INTERMEDIATE_SIZE,
            ),
            ("num_layers", self.num_layers, limits::MAX_LAYERS),
            ("num_heads", self.num_heads, limits::MAX_HEADS),
            ("num_kv_heads", self.num_kv_heads, limits::MAX_HEADS),
            ("head_dim", self.head_dim, limits::MAX_HEAD_DIM),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                limits::MAX_CONTEXT,
            ),
        ];
        for (field, value, limit) in bounded {
            if value == 0 {
                return Err(err(field, "must be positive, got 0".into()));
            }
            if value > limit {
                return Err(err(
                    field,
                    format!("{value} is above the limit of {limit} this build accepts"),
                ));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(err(
                "num_kv_heads",
                format!(
                    "{} KV heads do not divide the {} attention heads",
                    self.num_kv_heads, self.num_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(err(
                "head_dim",
                format!("{} is odd; RoPE rotates pairs", self.head_dim),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(err(
                "rms_norm_eps",
                format!("{} is not a positive number", self.rms_norm_eps),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(err(
                "rope_theta",
                format!("{} is not a number above 1", self.rope_theta),
            ));
        }
        if let Some(s) = &self.rope_scaling {
            let ok = s.factor.is_finite()
                && s.factor >= 1.0
                && s.low_freq_factor.is_finite()
                && s.high_freq_factor.is_finite()
                && s.high_freq_factor > s.low_freq_factor
                && s.low_freq_factor > 0.0
                && s.original_max_position_embeddings > 0
                && s.original_max_position_embeddings <= limits::MAX_CONTEXT;
            if !ok {
                return Err(err(
                    "rope_scaling",
                    format!("{s:?} is not a valid llama3 scaling"),
                ));
            }
        }
        for id in self.bos_token_id.iter().chain(&self.eos_token_ids) {
            if *id as usize >= self.vocab_size {
                return Err(err(
                    if Some(*id) == self.bos_token_id {
                        "bos_token_id"
                    } else {
                        "eos_token_id"
                    },
                    format!(
                        "token id {id} is outside the vocabulary of {}",
                        self.vocab_size
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Checks `num_layers` against the layers a file holds: `names` are its tensor (or section)
    /// names in Hugging Face naming; the layers present are the distinct `model.layers.{i}.`
    /// prefixes, which must be exactly `0..num_layers`.
    pub fn check_layers_present<'a>(
        &self,
        names: impl IntoIterator<Item = &'a str>,
        key: &dyn Fn(&str) -> String,
    ) -> crate::Result<()> {
        let mut present = std::collections::BTreeSet::new();
        for name in names {
            if let Some(i) = name
                .strip_prefix("model.layers.")
                .and_then(|rest| rest.split_once('.'))
                .and_then(|(i, _)| i.parse::<usize>().ok())
            {
                present.insert(i);
            }
        }
        let contiguous = present.len() == self.num_layers
            && present
                .last()
                .is_none_or(|&last| last + 1 == self.num_layers);
        if !contiguous {
            let shown = match (present.first(), present.last()) {
                (Some(a), Some(b)) => format!("{} layers (indices {a}..={b})", present.len()),
                _ => "no layer tensors".to_string(),
            };
            return Err(crate::ModelError::Metadata {
                key: key("num_layers"),
                reason: format!("says {} layers but the file holds {shown}", self.num_layers),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(field: &str) -> String {
        field.to_string()
    }

    #[test]
    fn counts_are_held_to_the_stated_limits() {
        let good = crate::llama::tests::tiny_config();
        good.check(&plain).unwrap();
        type Edit = fn(&mut ModelConfig);
        let cases: [(&str, Edit); 5] = [
            ("num_layers", |c| c.num_layers = 4294967295),
            ("num_layers", |c| c.num_layers = 1 << 60),
            ("max_position_embeddings", |c| c.max_position_embeddings = 0),
            ("num_heads", |c| c.num_heads = 0),
            ("vocab_size", |c| c.vocab_size = usize::MAX),
        ];
        for (field, bad) in cases {
            let mut c = good.clone();
            bad(&mut c);
            let err = c.check(&|f| format!("file:{f}")).unwrap_err().to_string();
            assert!(err.contains(&format!("file:{field}")), "{field}: {err}");
        }
    }

    #[test]
    fn layer_count_must_match_the_tensors_present() {
        let c = crate::llama::tests::tiny_config();
        let names: Vec<String> = (0..c.num_layers)
            .map(|l| format!("model.layers.{l}.mlp.up_proj.weight"))
            .chain(["model.norm.weight".to_string()])
            .collect();
        c.check_layers_present(names.iter().map(String::as_str), &plain)
            .unwrap();
        let mut more = c.clone();
        more.num_layers = 4294967295;
        let err = more
            .check_layers_present(names.iter().map(String::as_str), &plain)
            .unwrap_err()
            .to_string();
        assert!(err.contains("4294967295") && err.contains("holds"), "{err}");
        let gap = ["model.layers.0.x", "model.layers.2.x"];
        let mut two = c.clone();
        two.num_layers = 2;
        assert!(two.check_layers_present(gap, &plain).is_err());
    }
}
