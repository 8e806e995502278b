//! Dense f16, the baseline every sparse format is measured against.
//!
//! Layout: the row-major f16 matrix as is. Payload = M*K*2 bytes, no metadata.

use crate::blob::{ByteReader, ByteWriter};
use crate::error::{FormatError, Result};
use crate::format::{check_product_args, is_active, FormatKind, Storage, Threshold, WeightFormat};
use crate::matrix::DenseMatrix;
use rayon::prelude::*;

#[derive(Clone, Debug, PartialEq)]
pub struct Dense {
    matrix: DenseMatrix,
}

impl Dense {
    pub fn encode(w: &DenseMatrix) -> Result<Self> {
        Ok(Self { matrix: w.clone() })
    }

    pub fn matrix(&self) -> &DenseMatrix {
        &self.matrix
    }

    pub fn read_payload(r: &mut ByteReader) -> Result<Self> {
        let rows = r.usize()?;
        let cols = r.usize()?;
        let data = r.f16s()?;
        let matrix = DenseMatrix::new(rows, cols, data)
            .map_err(|e| FormatError::Corrupt(format!("dense payload: {e}")))?;
        Ok(Self { matrix })
    }
}

impl WeightFormat for Dense {
    fn kind(&self) -> FormatKind {
        FormatKind::Dense
    }
    fn rows(&self) -> usize {
        self.matrix.rows()
    }
    fn cols(&self) -> usize {
        self.matrix.cols()
    }
    fn storage(&self) -> Storage {
        Storage {
            payload_bytes: self.matrix.dense_bytes(),
            metadata_bytes: 0,
        }
    }
    fn decode(&self) -> DenseMatrix {
        self.matrix.clone()
    }

    fn matvec(&self, x: &[f32], threshold: Threshold, y: &mut [f32]) -> Result<()> {
        let (m, k) = (self.rows(), self.cols());
        check_product_args(m, k, x, 1, threshold, y)?;
        // Masking x once keeps the inner loop branch-free and vectorisable.
        let xm: Vec<f32> = x
            .iter()
            .map(|&v| if is_active(v, threshold) { v } else { 0.0 })
            .collect();
        y.par_iter_mut().enumerate().for_each(|(r, yr)| {
            *yr = dot_f16_f32(self.matrix.row(r), &xm);
        });
        Ok(())
    }

    fn matmul(&self, x: &[f32], n: usize, threshold: Threshold, y: &mut [f32]) -> Result<()> {
        let (m, k) = (self.rows(), self.cols());
        check_product_args(m, k, x, n, threshold, y)?;
        if n == 0 {
            return Ok(());
        }
        let xm: Vec<f32> = x
            .iter()
            .map(|&v| if is_active(v, threshold) { v } else { 0.0 })
            .collect();
        // Parallel over weight rows so each row is converted from f16 once for all n tokens.
        let mut yt = vec![0f32; m * n];
        yt.par_chunks_mut(n).enumerate().for_each(|(r, out)| {
            let wr: Vec<f32> = self.matrix.row(r).iter().map(|v| v.to_f32()).collect();
            for (t, o) in out.iter_mut().enumerate() {
                *o = dot_f32(&wr, &xm[t * k..(t + 1) * k]);
            }
        });
        for r in 0..m {
            for t in 0..n {
                y[t * m + r] = yt[r * n + t];
            }
        }
        Ok(())
    }

    fn write_payload(&self, w: &mut ByteWriter) {
        w.u64(self.rows() as u64);
        w.u64(self.cols() as u64);
        w.f16s(self.matrix.data());
    }
}

/// Dot product of an f16 row with f32 activations, 8 independent accumulators so the compiler
/// can vectorise.
pub fn dot_f16_f32(w: &[half::f16], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = w.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += w[c * 8 + l].to_f32() * x[c * 8 + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..w.len() {
        s += w[i].to_f32() * x[i];
    }
    s
}

/// Dot product of two f32 slices with 8 accumulators.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}
