//! What the kernels' tests share: errors measured against the size of the terms a product
//! sums. f32 rounding scales with the terms, and an output can cancel to almost nothing (one
//! row, few nonzeros), so an error relative to the largest result fails correct kernels.

use sieve_formats::reference::matmul_f64;
use sieve_formats::{DenseMatrix, Threshold};

/// The fast kernels' tolerance: the reference kernels' own is 1e-3; f32 sums in another order
/// stay far inside it.
pub const TOL: f64 = 1e-5;

/// `|W| · |mask_t(x)|` per output of `tokens` rows of `x`, in `matmul_f64`'s order: the size
/// of the terms each output sums.
pub fn term_sizes(w: &DenseMatrix, x: &[f32], tokens: usize, t: Threshold) -> Vec<f64> {
    let abs: Vec<f32> = w.data().iter().map(|v| v.to_f32().abs()).collect();
    let wa = DenseMatrix::from_f32(w.rows(), w.cols(), &abs).unwrap();
    // |x| > t is the same mask as for x, applied by the reference.
    let xa: Vec<f32> = x.iter().map(|v| v.abs()).collect();
    matmul_f64(&wa, &xa, tokens, t)
}

/// Asserts every output is finite and within [`TOL`] of `want`, relative to the largest
/// output's terms (`terms`, from [`term_sizes`]).
pub fn check_error_of_terms(got: &[f32], want: &[f64], terms: &[f64], what: &str) {
    assert!(got.iter().all(|v| v.is_finite()), "{what}: {got:?}");
    let scale = terms.iter().fold(1e-6f64, |a, v| a.max(*v));
    let e = got
        .iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).abs())
        .fold(0.0, f64::max)
        / scale;
    assert!(e <= TOL, "{what}: error {e} of the terms");
}
