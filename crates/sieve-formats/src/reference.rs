//! The slow, obviously correct f64 product that every kernel (CPU or GPU) is tested against,
//! and the error metric the tests use.

use crate::format::{is_active, Threshold};
use crate::matrix::DenseMatrix;

/// `y = W · mask_t(x)` in f64.
pub fn matvec_f64(w: &DenseMatrix, x: &[f32], threshold: Threshold) -> Vec<f64> {
    assert_eq!(x.len(), w.cols(), "reference matvec: x length");
    (0..w.rows())
        .map(|m| {
            w.row(m)
                .iter()
                .zip(x)
                .filter(|(_, &xv)| is_active(xv, threshold))
                .map(|(wv, &xv)| wv.to_f64() * xv as f64)
                .sum()
        })
        .collect()
}

/// `Y = mask_t(X) · Wᵀ` in f64 for `n` rows of `x` (n x K), result n x M.
pub fn matmul_f64(w: &DenseMatrix, x: &[f32], n: usize, threshold: Threshold) -> Vec<f64> {
    assert_eq!(x.len(), n * w.cols(), "reference matmul: x length");
    x.chunks(w.cols())
        .flat_map(|xr| matvec_f64(w, xr, threshold))
        .collect()
}

/// Relative error of `got` against `want`: max |got - want| / max(max |want|, 1e-6).
/// Normalising by the largest reference magnitude (not per element) keeps outputs that cancel
/// to near zero from dominating, which is the right notion for fp32 sums of many products.
pub fn max_rel_error(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "max_rel_error: lengths");
    let scale = want.iter().fold(0.0f64, |a, v| a.max(v.abs())).max(1e-6);
    // `f64::max` drops a NaN: an output a kernel never wrote (NaN-poisoned) would compare as
    // equal. A non-finite value where the reference is finite is an infinite error.
    if got
        .iter()
        .zip(want)
        .any(|(g, w)| !g.is_finite() && w.is_finite())
    {
        return f64::INFINITY;
    }
    got.iter()
        .zip(want)
        .map(|(g, w)| (*g as f64 - w).abs())
        .fold(0.0f64, f64::max)
        / scale
}

#[cfg(test)]
mod max_rel_error_tests {
    use super::max_rel_error;

    #[test]
    fn an_unwritten_output_is_an_infinite_error() {
        assert_eq!(max_rel_error(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((max_rel_error(&[1.0, 2.5], &[1.0, 2.0]) - 0.25).abs() < 1e-12);
        assert_eq!(max_rel_error(&[1.0, f32::NAN], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(max_rel_error(&[f32::INFINITY], &[1.0]), f64::INFINITY);
        assert_eq!(max_rel_error(&[0.0, 0.0], &[0.0, 0.0]), 0.0);
    }
}
