//! One error type for everything pruning, calibration and quantization can refuse.

use sieve_formats::FormatError;
use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum PruneError {
    #[error("matrix must have at least one row and one column, got {rows} x {cols}")]
    EmptyMatrix { rows: usize, cols: usize },
    #[error("shape mismatch: {what}: expected {expected}, got {actual}")]
    Shape {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    #[error("non-finite value {value} in {what} at index {index}")]
    NonFinite {
        what: &'static str,
        index: usize,
        value: f32,
    },
    #[error("sparsity ratio {0} is outside [0, 1)")]
    Ratio(f64),
    #[error("invalid sparsity pattern: {0}")]
    Pattern(String),
    #[error("mask violates {pattern}: {detail}")]
    MaskViolation { pattern: String, detail: String },
    #[error("invalid option: {0}")]
    Option(String),
    #[error("no calibration data: {0}")]
    NoCalibration(&'static str),
    #[error(
        "Hessian is not positive definite even with damping {damping:e} x mean diagonal \
         (tried {attempts} damping levels); the calibration activations are degenerate"
    )]
    NotPositiveDefinite { damping: f64, attempts: usize },
    #[error("text of {tokens} tokens is too short for {count} calibration windows of {len} tokens ({needed} needed)")]
    TextTooShort {
        tokens: usize,
        count: usize,
        len: usize,
        needed: usize,
    },
    #[error(transparent)]
    Format(#[from] FormatError),
    /// The model refused a step of the pipeline (kept as text: `ModelError` is not `Clone`).
    #[error("model: {0}")]
    Model(String),
}

pub type Result<T, E = PruneError> = std::result::Result<T, E>;

/// Validates a matrix slice of `rows x cols` (non-empty, right length, all finite).
pub(crate) fn check_matrix(
    what: &'static str,
    data: &[f32],
    rows: usize,
    cols: usize,
) -> Result<()> {
    if rows == 0 || cols == 0 {
        return Err(PruneError::EmptyMatrix { rows, cols });
    }
    let expected = rows.checked_mul(cols).ok_or(PruneError::Shape {
        what: "rows * cols overflows",
        expected: usize::MAX,
        actual: rows,
    })?;
    if data.len() != expected {
        return Err(PruneError::Shape {
            what,
            expected,
            actual: data.len(),
        });
    }
    check_finite(what, data)
}

pub(crate) fn check_finite(what: &'static str, data: &[f32]) -> Result<()> {
    match data.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(PruneError::NonFinite {
            what,
            index,
            value: data[index],
        }),
        None => Ok(()),
    }
}

/// Validates a sparsity ratio: finite and in [0, 1).
pub fn check_ratio(ratio: f64) -> Result<()> {
    if ratio.is_finite() && (0.0..1.0).contains(&ratio) {
        Ok(())
    } else {
        Err(PruneError::Ratio(ratio))
    }
}
