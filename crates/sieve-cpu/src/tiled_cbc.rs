//! Tiled-CBC on the CPU, in two layouts built at load from the blob (which stays Tiled-CBC, the
//! GPU's layout):
//!
//! | module | layout | when |
//! |---|---|---|
//! | [`rows`] | [`RowTiledCbc`]: blocks of 32 rows, column-major inside, every block one stream | **the default** |
//! | [`columns`] | [`ColumnTiledCbc`]: whole columns, inactive inputs' columns skipped over the whole matrix | `SIEVE_TCBC_CPU=columns` ([`crate::options`]) |
//!
//! [`columns`] also holds the column kernels that the column-major dense layout
//! ([`crate::dense::DenseColumns`]) and IE-BME's dequantized fallback
//! ([`crate::ie_bme::F16IeBme`]) run, and the helpers the other formats share
//! (`active_inputs`, the AVX2 rank table).

pub mod columns;
pub mod rows;

pub use columns::ColumnTiledCbc;
pub use rows::RowTiledCbc;
