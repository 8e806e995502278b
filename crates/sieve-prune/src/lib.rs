//! Pruning, activation thresholds, calibration and quantization for sieve: pure algorithms on
//! row-major f32 weight matrices (`[M][K]`, element (m, k) at `m * K + k`, products
//! `y = W · x`) and on calibration activations (rows of K).
//!
//! | module | job |
//! |---|---|
//! | [`pattern`] | unstructured, N:M, (2N-2):2N and balanced (N:M down the outputs) patterns, parsing and validation |
//! | [`mask`] | mask selection from scores (per row / per group), mask validity checks |
//! | [`methods`] | magnitude and Wanda scores, [`Method`], the [`prune`] entry point |
//! | [`sparsegpt`] | streaming Hessian and SparseGPT with error compensation |
//! | [`teal`] | streaming |x| histograms and TEAL thresholds from the ECDF |
//! | [`dual`] | static x dynamic sparsity report (SPDP's overlap analysis) |
//! | [`quant`] | INT4 per-group weight and INT8 per-token activation quantization |
//! | [`pipeline`] | whole-model pruning layer by layer on calibration windows (`sieve pack`) |
//! | [`pack`] | a `.sieve` file from a model file: the pipeline's run, the sections and the manifest (`sieve pack`) |
//! | [`calib`] | calibration windows from a token stream |

pub mod calib;
pub mod dual;
pub mod error;
pub mod mask;
pub mod methods;
pub mod pack;
pub mod pattern;
pub mod pipeline;
pub mod quant;
pub mod sparsegpt;
pub mod teal;

pub use error::{PruneError, Result};
pub use mask::{select_mask, Mask};
pub use methods::{prune, Calibration, ColumnNorms, Method, Pruned};
pub use pattern::{balanced_slots_for, Pattern, BALANCED_GROUP};
pub use sparsegpt::{
    prune_sparsegpt, HessianAccumulator, PreparedHessian, SparseGptOptions, SparseGptResult,
};
