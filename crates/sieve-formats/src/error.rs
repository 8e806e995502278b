//! One error type for everything a format can refuse.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum FormatError {
    #[error("matrix must have at least one row and one column, got {rows} x {cols}")]
    EmptyMatrix { rows: usize, cols: usize },
    #[error("shape mismatch: {what}: expected {expected}, got {actual}")]
    Shape {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    #[error("non-finite weight {value} at row {row}, column {col}")]
    NonFinite { row: usize, col: usize, value: f32 },
    #[error("sparsity {0} is outside [0, 1)")]
    Sparsity(f64),
    #[error("activation threshold {0} must be finite and >= 0")]
    Threshold(f32),
    #[error("invalid option: {0}")]
    Option(String),
    #[error("invalid sparsity pattern: {0}")]
    Pattern(String),
    #[error("serialized blob is truncated: needed {needed} bytes at offset {offset}, {available} available")]
    Truncated {
        offset: usize,
        needed: usize,
        available: usize,
    },
    #[error("serialized blob is corrupt: {0}")]
    Corrupt(String),
    #[error("serialized blob has format version {found}, this build reads version {supported}")]
    Version { found: u32, supported: u32 },
    /// A size that overflows, exceeds a stated limit, or cannot be allocated ([`crate::size`]).
    #[error("size: {0}")]
    Size(String),
    #[error("checksum mismatch: stored {stored:#018x}, computed {computed:#018x}")]
    Checksum { stored: u64, computed: u64 },
}

pub type Result<T, E = FormatError> = std::result::Result<T, E>;
