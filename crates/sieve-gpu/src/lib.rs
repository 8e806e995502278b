//! The GPU model runner: a Llama-family decoder resident on an NVIDIA GPU over packed sparse
//! weights (dense f16, Tiled-CBC, RLC-CSC), one CUDA graph per decode step. Every kernel it
//! launches, and its launcher, is `sieve-cuda`'s: the products, and the step's others
//! ([`sieve_cuda::step`], [`sieve_cuda::rope`], [`sieve_cuda::attention`],
//! [`sieve_cuda::sampling`], [`sieve_cuda::prefill`]).
//!
//! | module | job |
//! |---|---|
//! | [`matrix`] | weight matrices on the device and fused groups (q\|k\|v, gate\|up) over sieve-cuda's kernels |
//! | [`prefill`] | the prompt in one batch: cuBLAS GEMMs over the device weights (Tiled-CBC decoded to f16), causal attention |
//! | [`runner`] | [`GpuModel`]: upload, the step as launches or a captured graph, prefill, decode, profiling |
//! | `kv_cache` | the KV cache pool on the device (f16, or i8 with per-row scales: [`sieve_cuda::KvPrecision`]) and each slot's and layer's view of it |
//! | [`generate`] | generation on the GPU; perplexity through the CPU's loop (`perplexity_over`) |
//! | [`synthetic`] | random models of the Llama-2/3 shapes, pruned, packed and calibrated on the GPU |
//! | [`bench`] | `sieve bench decode`: TPOT, TTFT, bytes per token and the step breakdown |
//!
//! Everything builds without CUDA; [`sieve_cuda::Gpu::new`] reports a missing GPU as an error.

pub mod bench;
pub mod error;
pub mod generate;
mod kv_cache;
pub mod matrix;
pub mod prefill;
pub mod runner;
pub mod synthetic;
pub mod tensor_parallel;

pub use error::{GpuError, Result};
pub use runner::GpuModel;
