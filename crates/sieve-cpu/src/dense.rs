//! Dense f16 weights ([`FastDense`]) with explicit AVX2/F16C kernels ([`crate::kernels`]).
//!
//! [`FastDense`] holds the same f16 row-major matrix and the same blob payload as
//! `sieve_formats::dense::Dense` (so a blob written by one reads back as the other).
//! Decoding one token is bound by memory bandwidth, and f16
//! halves the bytes per token against an f32 copy; converting with `vcvtph2ps` in the kernel
//! costs nothing measurable, while `half`'s per-element `to_f32` (a runtime CPU check per value)
//! blocks vectorisation and was several times slower. The column-major dense layout
//! ([`DenseColumns`]) shares the column kernels of [`crate::tiled_cbc::columns`].

use crate::{gemm, kernels};
use rayon::prelude::*;
use sieve_formats::blob::ByteWriter;
use sieve_formats::format::{check_product_args, is_active};
use sieve_formats::{DenseMatrix, FormatKind, Storage, Threshold, WeightFormat};

pub use crate::tiled_cbc::columns::DenseColumns;

/// Dense f16 weights with SIMD kernels; kind, storage and blob payload are those of
/// `sieve_formats::dense::Dense`.
#[derive(Clone, Debug, PartialEq)]
pub struct FastDense {
    matrix: DenseMatrix,
}

/// Weight rows per parallel task in the products: enough work per task to amortise rayon's
/// scheduling, few enough tasks to balance two to a few dozen threads.
const ROWS_PER_TASK: usize = 32;

impl FastDense {
    pub fn new(matrix: DenseMatrix) -> Self {
        Self { matrix }
    }
    pub fn matrix(&self) -> &DenseMatrix {
        &self.matrix
    }
}

fn masked(x: &[f32], threshold: Threshold) -> Vec<f32> {
    x.iter()
        .map(|&v| if is_active(v, threshold) { v } else { 0.0 })
        .collect()
}

impl WeightFormat for FastDense {
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

    fn matvec(
        &self,
        x: &[f32],
        threshold: Threshold,
        y: &mut [f32],
    ) -> Result<(), sieve_formats::FormatError> {
        let (m, k) = (self.rows(), self.cols());
        check_product_args(m, k, x, 1, threshold, y)?;
        let xm;
        let x = if threshold.is_some() {
            xm = masked(x, threshold);
            &xm[..]
        } else {
            x
        };
        let w = self.matrix.data();
        y.par_chunks_mut(ROWS_PER_TASK)
            .enumerate()
            .for_each(|(chunk, out)| {
                let r0 = chunk * ROWS_PER_TASK;
                for (i, o) in out.iter_mut().enumerate() {
                    let r = r0 + i;
                    *o = kernels::dot_f16_f32(&w[r * k..(r + 1) * k], x);
                }
            });
        Ok(())
    }

    fn matmul(
        &self,
        x: &[f32],
        n: usize,
        threshold: Threshold,
        y: &mut [f32],
    ) -> Result<(), sieve_formats::FormatError> {
        let (m, k) = (self.rows(), self.cols());
        check_product_args(m, k, x, n, threshold, y)?;
        let xm;
        let x = if threshold.is_some() {
            xm = masked(x, threshold);
            &xm[..]
        } else {
            x
        };
        // Y (n x M) = X (n x K) · Wᵀ: the GEMM reads W (M x K row-major) as its transpose and
        // converts it to f32 once while packing.
        let w = self.matrix.data();
        gemm::gemm(
            n,
            m,
            k,
            gemm::View::row_major(x, k),
            gemm::View::transposed(w, k),
            y,
            m,
            false,
            true,
        )
        .map_err(|e| sieve_formats::FormatError::Option(e.to_string()))?;
        Ok(())
    }

    fn write_payload(&self, w: &mut ByteWriter) {
        w.u64(self.rows() as u64);
        w.u64(self.cols() as u64);
        w.f16s(self.matrix.data());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sieve_formats::dense::Dense;
    use sieve_formats::registry;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    }

    fn random(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..len).map(|_| lcg(&mut s)).collect()
    }

    /// f64 reference of `Y = X · Wᵀ` with the f16-rounded weights.
    fn reference(w: &DenseMatrix, x: &[f32], n: usize, t: Threshold) -> Vec<f32> {
        let (m, k) = (w.rows(), w.cols());
        let mut y = vec![0f32; n * m];
        for tok in 0..n {
            for r in 0..m {
                let mut s = 0f64;
                for c in 0..k {
                    let xv = x[tok * k + c];
                    if is_active(xv, t) {
                        s += w.get(r, c).to_f32() as f64 * xv as f64;
                    }
                }
                y[tok * m + r] = s as f32;
            }
        }
        y
    }

    fn close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= tol * (1.0 + y.abs()),
                "element {i}: {x} vs {y}"
            );
        }
    }

    #[test]
    fn fast_dense_matches_reference_on_odd_shapes() {
        // Shapes with remainders in every blocking dimension (rows % 4, tokens % 2, K % 8, K % 32).
        for &(m, k, n) in &[(1, 1, 1), (7, 13, 3), (37, 70, 5), (64, 96, 2), (33, 41, 1)] {
            let w = DenseMatrix::from_f32(m, k, &random(m * k, m as u64 * 31 + k as u64)).unwrap();
            let x = random(n * k, 99 + n as u64);
            let fast = FastDense::new(w.clone());
            for t in [None, Some(0.2f32)] {
                let mut y = vec![f32::NAN; n * m];
                fast.matmul(&x, n, t, &mut y).unwrap();
                close(&y, &reference(&w, &x, n, t), 1e-5);
                let mut yv = vec![f32::NAN; m];
                fast.matvec(&x[..k], t, &mut yv).unwrap();
                close(&yv, &reference(&w, &x[..k], 1, t), 1e-5);
            }
        }
    }

    #[test]
    fn fast_dense_agrees_with_the_formats_dense_and_shares_its_blob() {
        let (m, k) = (19, 45);
        let w = DenseMatrix::from_f32(m, k, &random(m * k, 5)).unwrap();
        let fast = FastDense::new(w.clone());
        let plain = Dense::encode(&w).unwrap();
        let x = random(3 * k, 6);
        let (mut a, mut b) = (vec![0f32; 3 * m], vec![0f32; 3 * m]);
        fast.matmul(&x, 3, None, &mut a).unwrap();
        plain.matmul(&x, 3, None, &mut b).unwrap();
        close(&a, &b, 1e-5);
        let back = registry::from_bytes(&fast.to_bytes()).unwrap();
        assert_eq!(back.decode(), w);
        assert_eq!(fast.storage(), plain.storage());
    }
}
