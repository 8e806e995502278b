//! Sparse weight formats for sieve.
//!
//! Every format encodes a dense row-major f16 matrix `W` (M outputs x K inputs), decodes back to
//! it, accounts for its storage, serializes to a checksummed blob, and multiplies activations on
//! the CPU (`y = W · x`, optionally skipping inputs with `|x| <= t`). These CPU products are the
//! ground truth for the GPU kernels in `sieve-cuda`.
//!
//! | module | paper | idea |
//! |---|---|---|
//! | [`dense`] | - | f16 baseline |
//! | [`rlc_csc`] | Celty | CSC with n-bit run-length row indices, lane-interleaved for warps |
//! | [`tiled_cbc`] | SPDP | 256x1 column tiles with bitmaps, ColInfo and TileOffset per GTile |
//! | [`ie_bme`] | UnionSparse | union bitmaps over 16x64 tiles, INT4/INT8/f16 payload streams |
//! | [`slide`] | SlideSparse | (2N-2):2N decomposed into overlapping 2:4 windows |
//! | [`kv_cache`] | - | the KV cache's rows: f16, or i8 with one scale per position and KV head |
//! | [`eight_bit`] | SlideSparse (INT8 / FP8 paths) | a token's activations as INT8 or FP8 e4m3 codes with one scale |
//! | [`balanced_cbc`] | sieve (Balanced Sparsity, Yao et al. 2019, on Celty's column tiles) | N of every 16 output rows per input column, 512-row tiles, fixed-size blocks, no metadata |

pub mod balanced_cbc;
pub mod blob;
pub mod dense;
pub mod eight_bit;
pub mod error;
pub mod format;
pub mod ie_bme;
pub mod kv_cache;
pub mod matrix;
pub mod random;
pub mod reference;
pub mod registry;
pub mod rlc_csc;
pub mod size;
pub mod slide;
pub mod tiled_cbc;
pub mod value_grid;

pub use error::{FormatError, Result};
pub use format::{FormatKind, Storage, Threshold, WeightFormat};
pub use matrix::DenseMatrix;
