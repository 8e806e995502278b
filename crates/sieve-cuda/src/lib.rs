//! CUDA backend for sieve: every GPU kernel and its launcher. The spMspV / GEMV kernels over the
//! sieve weight formats, cuBLAS baselines, their timing helpers, and the kernel benchmark of
//! `sieve bench kernels` ([`bench`]); the decode step's other kernels, which `sieve-gpu`'s
//! runner launches and captures.
//!
//! Kernels are CUDA C++ in `kernels/*.cu` (one file per family, each with a header comment on
//! its data layout and thread mapping), embedded with `include_str!`, compiled by NVRTC to an
//! `sm_90a` CUBIN (or the device's own `sm_XY`) at first use and cached on disk (see [`gpu`]).
//! CUDA libraries are loaded at run time: everything builds, and CPU tests run, on machines
//! without CUDA; GPU entry points then return [`CudaError::NoDriver`] or
//! [`CudaError::NoDevice`].
//!
//! | module | weights on the device | kernel |
//! |---|---|---|
//! | [`dense`] | row-major f16; column-major f16 | GEMV (warp per row); column-skipping TEAL kernel; cuBLAS GemmEx |
//! | [`rlc_csc`] | Celty RLC-CSC | warp-per-256-row-tile spMspV, prefix-sum row reconstruction |
//! | [`tiled_cbc`] | SPDP Tiled-CBC | SPDP's kernel; sieve's lane-per-8-rows kernel (default) |
//! | [`balanced_cbc`] | Balanced-CBC (N of every 16 rows per column) | lane per 16 rows, fixed-size coalesced blocks, shared-memory accumulators |
//! | [`balanced_lowbit`] | Balanced-CBC with int8 / int4 values (`sieve pack --values`) | the Balanced-CBC index kernel decoding bytes / nibbles, scales per row (group) at the reduction |
//! | [`ie_bme`] | UnionSparse IE-BME with int4 / int8 values: union bitmaps, Q area values per union position | N = 1..32 tokens, union positions decoded straight into mma.sync fragments, split-K |
//! | [`lowbit`] | W4A16 g128, W8A16, GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K repacked into mma fragment order | N = 1..32 tokens, in-register dequantization, mma.sync m16n8k16 |
//! | [`lowbit_cols`] | W4A16 g128 and GGUF Q4_0 column-major (8 rows per 32-bit word, scales per group) | N = 1 under a TEAL threshold: inactive columns never read; each warp compacts its 32 columns in registers (power-of-two input scaling), f16x2 partial sums |
//!
//! The model's kernels besides the products (launchers on raw device addresses, for graph
//! capture; CPU references beside them):
//!
//! | module | kernels |
//! |---|---|
//! | [`step`] | embedding gather, RMSNorm that zeroes the next product's output, SwiGLU, the teacher-forced advance |
//! | [`rope`] | RoPE with the KV-cache write (f16, or i8 rows quantized as written): one token (decode) or `n` rows (prefill), one device function |
//! | [`attention`] | flash-decoding grouped-query attention over the f16 or 8-bit cache ([`kv_cache`]), split + combine; causal for prefill batches |
//! | [`prompt_attention`] | flash-attention 2 over a prompt chunk (causal, f16 or 8-bit cache, mma.sync), which `attention::attention_rows` takes for prompt chunks of 16 rows or more |
//! | [`persistent`] | the whole decode step of a dense f16 model as one persistent kernel: stages from the plan, grid barriers, L2 prefetch of the next stage's weights, a watchdog, per-stage trace |
//! | [`sampling`] | repetition penalty, greedy / temperature / top-k / top-p, the next token into the step state |
//! | [`prefill`] | row-wise embedding, RMSNorm, f16 GEMM input under the TEAL threshold, SwiGLU |
//!
//! [`graph`] captures launches into CUDA graphs, optionally with programmatic dependent launch.
//!
//! [`choice`] picks, per layer, between the dense column-major and the Tiled-CBC kernel from
//! time models fitted to measured runs.

pub mod attention;
pub mod balanced_cbc;
pub mod balanced_lowbit;
pub mod bench;
pub mod choice;
pub mod collective;
pub mod cusparselt;
pub mod dense;
pub mod dense8;
pub mod error;
pub mod gpu;
pub mod graph;
pub mod ie_bme;
pub mod kv_cache;
pub mod lowbit;
pub mod lowbit_cols;
pub mod persistent;
pub mod prefill;
pub mod product;
pub mod prompt_attention;
pub mod rlc_csc;
pub mod rope;
pub mod sampling;
pub mod slide;
pub mod slide_lt;
pub mod step;
pub mod tiled_cbc;
pub mod timing;
pub mod w4a8;

pub use error::{CudaError, DriverContext, Result};
pub use gpu::{gpu_or_skip, DeviceInfo, Gpu};
pub use kv_cache::{KvCache, KvPrecision};
pub use product::{dev_ptr, matvec_host, DevPtr, GpuAccumulate, GpuMatVec, L2Span};
