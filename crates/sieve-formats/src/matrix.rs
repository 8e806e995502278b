//! The dense row-major f16 matrix every format encodes from and decodes to.

use crate::error::{FormatError, Result};
use half::f16;

/// A weight matrix `W` of `rows` (M, outputs) x `cols` (K, inputs), row-major:
/// element (m, k) lives at `data[m * cols + k]`. Products are `y = W · x`.
#[derive(Clone, Debug, PartialEq)]
pub struct DenseMatrix {
    rows: usize,
    cols: usize,
    data: Vec<f16>,
}

impl DenseMatrix {
    /// Validates the shape and that every value is finite (NaN and ±inf are refused).
    pub fn new(rows: usize, cols: usize, data: Vec<f16>) -> Result<Self> {
        if rows == 0 || cols == 0 {
            return Err(FormatError::EmptyMatrix { rows, cols });
        }
        let expected = rows.checked_mul(cols).ok_or(FormatError::Shape {
            what: "rows * cols overflows",
            expected: usize::MAX,
            actual: rows,
        })?;
        if data.len() != expected {
            return Err(FormatError::Shape {
                what: "data length (rows * cols)",
                expected,
                actual: data.len(),
            });
        }
        if let Some(i) = data.iter().position(|v| !v.is_finite()) {
            return Err(FormatError::NonFinite {
                row: i / cols,
                col: i % cols,
                value: data[i].to_f32(),
            });
        }
        Ok(Self { rows, cols, data })
    }

    /// An all-zero matrix.
    pub fn zeros(rows: usize, cols: usize) -> Result<Self> {
        Self::new(rows, cols, vec![f16::ZERO; rows.saturating_mul(cols)])
    }

    pub fn from_f32(rows: usize, cols: usize, data: &[f32]) -> Result<Self> {
        Self::new(rows, cols, data.iter().map(|&v| f16::from_f32(v)).collect())
    }

    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// The raw f16 bit patterns, row-major (for bit-exact comparisons: -0 != +0).
    pub fn bit_patterns(&self) -> Vec<u16> {
        self.data.iter().map(|v| v.to_bits()).collect()
    }
    pub fn data(&self) -> &[f16] {
        &self.data
    }
    pub fn into_data(self) -> Vec<f16> {
        self.data
    }
    pub fn get(&self, row: usize, col: usize) -> f16 {
        self.data[row * self.cols + col]
    }
    pub fn row(&self, row: usize) -> &[f16] {
        &self.data[row * self.cols..(row + 1) * self.cols]
    }
    /// Number of entries that are not +0 (see [`is_zero`]).
    pub fn nnz(&self) -> usize {
        self.data.iter().filter(|v| !is_zero(**v)).count()
    }
    /// Fraction of zero entries.
    pub fn sparsity(&self) -> f64 {
        1.0 - self.nnz() as f64 / self.data.len() as f64
    }
    /// Bytes of the plain f16 matrix.
    pub fn dense_bytes(&self) -> usize {
        self.data.len() * 2
    }
}

/// True only for +0 (bit pattern 0). Formats drop exactly these entries; a negative zero is
/// kept as an explicit stored entry so that decode(encode(W)) is bit-exact. Pruning writes +0.
pub fn is_zero(v: f16) -> bool {
    v.to_bits() == 0
}
