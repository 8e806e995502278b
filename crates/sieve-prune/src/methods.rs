//! Pruning methods that score weights and keep the highest scores: magnitude and Wanda
//! (Sun et al. 2023), plus the [`Method`] name used by the CLI and the [`prune`] entry point
//! that also dispatches to SparseGPT.

use crate::error::{check_finite, check_matrix, PruneError, Result};
use crate::mask::{select_mask, Mask};
use crate::pattern::Pattern;
use crate::sparsegpt::{prune_sparsegpt, HessianAccumulator, SparseGptOptions};
use serde::Serialize;
use std::fmt;
use std::str::FromStr;

/// A pruned weight matrix: the weights (pruned entries are exactly +0.0) and the mask chosen.
#[derive(Clone, Debug, PartialEq)]
pub struct Pruned {
    pub weights: Vec<f32>,
    pub mask: Mask,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    /// Score `|W_ij|`.
    Magnitude,
    /// Score `|W_ij| * ||X_j||_2` (Wanda): weight magnitude times the input feature norm.
    Wanda,
    /// Second-order reconstruction with error compensation (SparseGPT).
    SparseGpt,
}

impl Method {
    pub const ALL: [Method; 3] = [Method::Magnitude, Method::Wanda, Method::SparseGpt];
    pub fn name(self) -> &'static str {
        match self {
            Method::Magnitude => "magnitude",
            Method::Wanda => "wanda",
            Method::SparseGpt => "sparsegpt",
        }
    }
    /// Whether the method needs calibration activations at all.
    pub fn needs_calibration(self) -> bool {
        !matches!(self, Method::Magnitude)
    }
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Method {
    type Err = PruneError;
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.trim().to_ascii_lowercase();
        Method::ALL
            .into_iter()
            .find(|m| m.name() == lower || (lower == "sparse-gpt" && *m == Method::SparseGpt))
            .ok_or_else(|| {
                PruneError::Option(format!(
                    "unknown pruning method '{s}' (known: magnitude, wanda, sparsegpt)"
                ))
            })
    }
}

/// Streaming sum of squares of every input column over calibration rows: `||X_j||_2` for Wanda.
/// Accumulates in f64 so that millions of rows lose nothing.
#[derive(Clone, Debug, PartialEq)]
pub struct ColumnNorms {
    sum_squares: Vec<f64>,
    rows_seen: usize,
}

impl ColumnNorms {
    pub fn new(cols: usize) -> Result<Self> {
        if cols == 0 {
            return Err(PruneError::EmptyMatrix { rows: 0, cols });
        }
        Ok(Self {
            sum_squares: vec![0.0; cols],
            rows_seen: 0,
        })
    }

    /// Builds norms from known sums of squares (e.g. the diagonal of `XᵀX`).
    pub fn from_sum_squares(sum_squares: Vec<f64>, rows_seen: usize) -> Result<Self> {
        if sum_squares.is_empty() {
            return Err(PruneError::EmptyMatrix { rows: 0, cols: 0 });
        }
        if let Some(i) = sum_squares
            .iter()
            .position(|v| !(v.is_finite() && *v >= 0.0))
        {
            return Err(PruneError::NonFinite {
                what: "sum of squares",
                index: i,
                value: sum_squares[i] as f32,
            });
        }
        Ok(Self {
            sum_squares,
            rows_seen,
        })
    }

    pub fn cols(&self) -> usize {
        self.sum_squares.len()
    }
    pub fn rows_seen(&self) -> usize {
        self.rows_seen
    }

    /// Adds `n` activation rows of K (`x.len() == n * K`, row-major).
    pub fn add_rows(&mut self, x: &[f32], n: usize) -> Result<()> {
        let k = self.cols();
        if x.len() != n.saturating_mul(k) {
            return Err(PruneError::Shape {
                what: "activation length (n * K)",
                expected: n.saturating_mul(k),
                actual: x.len(),
            });
        }
        check_finite("activations", x)?;
        for row in x.chunks_exact(k) {
            for (s, &v) in self.sum_squares.iter_mut().zip(row) {
                *s += f64::from(v) * f64::from(v);
            }
        }
        self.rows_seen += n;
        Ok(())
    }

    /// Adds another accumulator over the same columns.
    pub fn merge(&mut self, other: &ColumnNorms) -> Result<()> {
        if other.cols() != self.cols() {
            return Err(PruneError::Shape {
                what: "column count of merged norms",
                expected: self.cols(),
                actual: other.cols(),
            });
        }
        for (a, b) in self.sum_squares.iter_mut().zip(&other.sum_squares) {
            *a += b;
        }
        self.rows_seen += other.rows_seen;
        Ok(())
    }

    /// `||X_j||_2` for every column j.
    pub fn norms(&self) -> Vec<f32> {
        self.sum_squares.iter().map(|s| s.sqrt() as f32).collect()
    }
}

/// `|W_ij|`.
pub fn magnitude_scores(weights: &[f32], rows: usize, cols: usize) -> Result<Vec<f32>> {
    check_matrix("weights", weights, rows, cols)?;
    Ok(weights.iter().map(|w| w.abs()).collect())
}

/// `|W_ij| * ||X_j||_2`.
pub fn wanda_scores(
    weights: &[f32],
    rows: usize,
    cols: usize,
    norms: &ColumnNorms,
) -> Result<Vec<f32>> {
    check_matrix("weights", weights, rows, cols)?;
    if norms.cols() != cols {
        return Err(PruneError::Shape {
            what: "column norms length (K)",
            expected: cols,
            actual: norms.cols(),
        });
    }
    if norms.rows_seen() == 0 {
        return Err(PruneError::NoCalibration(
            "Wanda column norms have seen no activation rows",
        ));
    }
    let col_norms = norms.norms();
    Ok(weights
        .chunks_exact(cols)
        .flat_map(|row| row.iter().zip(&col_norms).map(|(w, n)| w.abs() * n))
        .collect())
}

/// Prunes by the given scores: selects the mask and zeroes the pruned weights.
pub fn prune_by_scores(
    weights: &[f32],
    scores: &[f32],
    rows: usize,
    cols: usize,
    pattern: Pattern,
    ratio: f64,
) -> Result<Pruned> {
    check_matrix("weights", weights, rows, cols)?;
    let mask = select_mask(scores, rows, cols, pattern, ratio)?;
    let mut pruned = weights.to_vec();
    mask.apply(&mut pruned)?;
    Ok(Pruned {
        weights: pruned,
        mask,
    })
}

pub fn prune_magnitude(
    weights: &[f32],
    rows: usize,
    cols: usize,
    pattern: Pattern,
    ratio: f64,
) -> Result<Pruned> {
    let scores = magnitude_scores(weights, rows, cols)?;
    prune_by_scores(weights, &scores, rows, cols, pattern, ratio)
}

/// Wanda: prunes by `|W_ij| * ||X_j||_2`. For [`Pattern::Balanced`] every comparison group lies
/// in one input column and so shares one norm: the choice equals magnitude's (except where the
/// product rounds two magnitudes to one score, and in dead columns, where every score is 0 and
/// the lower rows are kept). That is expected; Wanda's per-input weighting only matters across
/// columns, which the balanced pattern never compares.
pub fn prune_wanda(
    weights: &[f32],
    rows: usize,
    cols: usize,
    norms: &ColumnNorms,
    pattern: Pattern,
    ratio: f64,
) -> Result<Pruned> {
    let scores = wanda_scores(weights, rows, cols, norms)?;
    prune_by_scores(weights, &scores, rows, cols, pattern, ratio)
}

/// The calibration statistics a method needs for one layer input.
#[derive(Clone, Copy, Debug)]
pub enum Calibration<'a> {
    None,
    Norms(&'a ColumnNorms),
    Hessian(&'a HessianAccumulator),
}

/// Prunes one M x K matrix with `method`. Wanda accepts either statistic (a Hessian carries the
/// column norms on its diagonal); SparseGPT needs the Hessian.
pub fn prune(
    method: Method,
    weights: &[f32],
    rows: usize,
    cols: usize,
    calibration: Calibration<'_>,
    pattern: Pattern,
    ratio: f64,
) -> Result<Pruned> {
    match (method, calibration) {
        (Method::Magnitude, _) => prune_magnitude(weights, rows, cols, pattern, ratio),
        (Method::Wanda, Calibration::Norms(norms)) => {
            prune_wanda(weights, rows, cols, norms, pattern, ratio)
        }
        (Method::Wanda, Calibration::Hessian(h)) => {
            prune_wanda(weights, rows, cols, &h.column_norms()?, pattern, ratio)
        }
        (Method::SparseGpt, Calibration::Hessian(h)) => {
            let out = prune_sparsegpt(
                weights,
                rows,
                cols,
                h,
                pattern,
                ratio,
                &SparseGptOptions::default(),
            )?;
            Ok(Pruned {
                weights: out.weights,
                mask: out.mask,
            })
        }
        (Method::Wanda, _) => Err(PruneError::NoCalibration(
            "Wanda needs column norms or a Hessian",
        )),
        (Method::SparseGpt, _) => Err(PruneError::NoCalibration("SparseGPT needs a Hessian")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use sieve_formats::random::SplitMix64;

    fn random(len: usize, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix64::new(seed);
        (0..len).map(|_| rng.normal() as f32).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        #[test]
        fn wanda_with_equal_norms_is_magnitude(rows in 1usize..6, cols in 1usize..40, ratio in 0.0f64..0.95,
                                               scale in prop::sample::select(vec![0.25f32, 1.0, 8.0]),
                                               seed in any::<u64>(), nm in any::<bool>()) {
            let w = random(rows * cols, seed);
            let mut norms = ColumnNorms::new(cols).unwrap();
            // every column gets the same norm, 2 * scale, a power of two so that scaling the
            // magnitudes is exact and cannot create ties
            let x = vec![scale; cols * 3];
            norms.add_rows(&x, 3).unwrap();
            norms.add_rows(&x[..cols], 1).unwrap();
            let pattern = if nm { Pattern::nm(2, 4).unwrap() } else { Pattern::Unstructured };
            let a = prune_wanda(&w, rows, cols, &norms, pattern, ratio).unwrap();
            let b = prune_magnitude(&w, rows, cols, pattern, ratio).unwrap();
            prop_assert_eq!(a, b);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        /// Balanced groups lie in one column: whatever the (exact, power-of-two) column norms,
        /// Wanda chooses magnitude's mask.
        #[test]
        fn wanda_balanced_is_magnitude_balanced(rows in 1usize..50, cols in 1usize..9,
                                               exps in proptest::collection::vec(-3i32..4, 9),
                                               seed in any::<u64>(), n in 1usize..16) {
            let w = random(rows * cols, seed);
            let mut norms = ColumnNorms::new(cols).unwrap();
            let x: Vec<f32> = (0..cols).map(|c| 2f32.powi(exps[c])).collect();
            norms.add_rows(&x, 1).unwrap();
            let pattern = Pattern::balanced(n, 16).unwrap();
            let a = prune_wanda(&w, rows, cols, &norms, pattern, 0.0).unwrap();
            let b = prune_magnitude(&w, rows, cols, pattern, 0.0).unwrap();
            a.mask.check(pattern, 0.0).unwrap();
            prop_assert_eq!(a, b);
        }
    }

    #[test]
    fn magnitude_prunes_smallest_and_writes_positive_zero() {
        let w = [0.5f32, -0.1, 0.3, -0.7, 0.05, -0.2, 0.9, -0.6];
        let out = prune_magnitude(&w, 2, 4, Pattern::Unstructured, 0.5).unwrap();
        assert_eq!(out.weights, vec![0.5, 0.0, 0.0, -0.7, 0.0, 0.0, 0.9, -0.6]);
        assert!(out
            .weights
            .iter()
            .filter(|v| **v == 0.0)
            .all(|v| v.to_bits() == 0));
    }

    #[test]
    fn wanda_uses_activation_norms() {
        // column 0 has small weights but huge activations: Wanda keeps it, magnitude does not
        let w = [0.1f32, 1.0, 0.1, 1.0];
        let mut norms = ColumnNorms::new(2).unwrap();
        norms.add_rows(&[100.0, 1.0, -100.0, 1.0], 2).unwrap();
        assert_eq!(norms.norms()[0], (2.0f32 * 100.0 * 100.0).sqrt());
        let wanda = prune_wanda(&w, 2, 2, &norms, Pattern::Unstructured, 0.5).unwrap();
        assert_eq!(wanda.weights, vec![0.1, 0.0, 0.1, 0.0]);
        let mag = prune_magnitude(&w, 2, 2, Pattern::Unstructured, 0.5).unwrap();
        assert_eq!(mag.weights, vec![0.0, 1.0, 0.0, 1.0]);
    }

    #[test]
    fn typed_errors() {
        let w = [1.0f32, 2.0, 3.0, 4.0];
        assert!(matches!(
            prune_magnitude(&w, 2, 2, Pattern::Unstructured, 1.0),
            Err(PruneError::Ratio(_))
        ));
        assert!(matches!(
            prune_magnitude(&[1.0, f32::NAN, 0.0, 1.0], 2, 2, Pattern::Unstructured, 0.5),
            Err(PruneError::NonFinite { index: 1, .. })
        ));
        assert!(matches!(
            prune_magnitude(&w, 3, 2, Pattern::Unstructured, 0.5),
            Err(PruneError::Shape { .. })
        ));
        let norms = ColumnNorms::new(3).unwrap();
        assert!(matches!(
            prune_wanda(&w, 2, 2, &norms, Pattern::Unstructured, 0.5),
            Err(PruneError::Shape { .. })
        ));
        let empty = ColumnNorms::new(2).unwrap();
        assert!(matches!(
            prune_wanda(&w, 2, 2, &empty, Pattern::Unstructured, 0.5),
            Err(PruneError::NoCalibration(_))
        ));
        let mut norms = ColumnNorms::new(2).unwrap();
        assert!(matches!(
            norms.add_rows(&[1.0, 2.0, 3.0], 2),
            Err(PruneError::Shape { .. })
        ));
        assert!(matches!(
            norms.add_rows(&[1.0, f32::INFINITY], 1),
            Err(PruneError::NonFinite { .. })
        ));
        assert!(matches!(
            prune(
                Method::SparseGpt,
                &w,
                2,
                2,
                Calibration::None,
                Pattern::Unstructured,
                0.5
            ),
            Err(PruneError::NoCalibration(_))
        ));
    }

    #[test]
    fn method_names() {
        for m in Method::ALL {
            assert_eq!(m.name().parse::<Method>().unwrap(), m);
        }
        assert_eq!("SparseGPT".parse::<Method>().unwrap(), Method::SparseGpt);
        assert!("obs".parse::<Method>().is_err());
    }
}
