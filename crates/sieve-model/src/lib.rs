//! Model files, tokenizer, Llama-family forward pass and sampling. The CPU kernels of the weight
//! formats live in `sieve-cpu`; this crate plugs them in through [`linear::Linear`].
//!
//! | module | job |
//! |---|---|
//! | [`config`] | `ModelConfig`: the architecture hyper-parameters the forward pass needs |
//! | [`cpu_bench`] | `sieve bench cpu`: prefill and decode tok/s of several models in one run |
//! | [`weights`] | `TensorSource`: named f32 tensors from any model file |
//! | [`gguf`] | GGUF v2/v3 reader (memory-mapped) and its metadata -> `ModelConfig` |
//! | [`safetensors_dir`] | Hugging Face model directories (`config.json` + safetensors shards) |
//! | [`tokenizer`] | BPE tokenizer from `tokenizer.json` or GGUF metadata, special tokens |
//! | [`chat`] | chat templates (ChatML) |
//! | [`linear`] | `Linear`: the seam where any weight format plugs into the model |
//! | [`plan`] | the model described once: the ops of a step, its products, backend capability checks |
//! | [`llama`] | the Llama-family forward pass with a KV cache (the CPU executor of the plan) |
//! | [`packed`] | a whole model (weights, tokenizer, thresholds) in a `.sieve` file |
//! | [`packfile`] | the `.sieve` container: named, checksummed sections |
//! | [`output`] | output files checked against the inputs, written via a temporary file |
//! | [`sampling`] | greedy, temperature, top-k, top-p, repetition penalty |
//! | [`sequence`] | one sequence's generation state between forward passes (sampling, stops, text) |

pub mod chat;
pub mod config;
pub mod cpu_bench;
pub mod error;
pub mod generate;
pub mod gguf;
pub mod linear;
pub mod llama;
pub mod output;
pub mod packed;
pub mod packfile;
pub mod plan;
pub mod safetensors_dir;
pub mod sampling;
pub mod sequence;
pub mod tokenizer;
pub mod weights;

pub use error::{ModelError, Result};
