//! Static x dynamic ("dual") sparsity of one layer on calibration activations, the analysis of
//! SPDP §3.2 (Figure 3).
//!
//! # Definitions
//!
//! For a weight matrix `W` (M x K) with keep mask `S` and `n` calibration tokens `x_t` (rows of
//! K) under a TEAL threshold `τ`, consider every weight-activation product
//! `W_ij · x_tj` — there are `n · M · K` of them. A product is
//!
//! * **statically zero** when weight `(i, j)` is pruned, and
//! * **dynamically zero** when its input is inactive, `|x_tj| <= τ` (no threshold: never).
//!
//! Then, as fractions of all products:
//!
//! * `static_ratio` (sp) = fraction statically zero = fraction of pruned weights;
//! * `dynamic_ratio` (dp) = fraction dynamically zero = fraction of inactive activation elements;
//! * `overlap` = fraction zero for **both** reasons (SPDP's "overlapping sparsity");
//! * `expected_overlap` = `sp · dp`, the overlap if the two masks were independent;
//! * `overlap_deviation` = `(overlap - sp·dp) / (sp·dp)`, the relative deviation Figure 3 plots
//!   (0 when `sp · dp = 0`; negative means the masks overlap less than chance, which is good);
//! * `total` = fraction zero for **either** reason = `sp + dp - overlap`, the realised combined
//!   sparsity, compared with `independent_total = 1 - (1 - sp)(1 - dp)`;
//! * `overlap_of_either` = `overlap / total`, the share of skipped products that both mechanisms
//!   would have skipped (0 when `total = 0`).

use crate::error::{check_finite, PruneError, Result};
use crate::mask::Mask;
use serde::Serialize;
use sieve_formats::format::check_threshold;

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct DualSparsityReport {
    pub tokens: usize,
    pub static_ratio: f64,
    pub dynamic_ratio: f64,
    pub overlap: f64,
    pub expected_overlap: f64,
    pub overlap_deviation: f64,
    pub total: f64,
    pub independent_total: f64,
    pub overlap_of_either: f64,
}

/// Measures the dual sparsity of `mask` over `n` activation rows (`activations.len() == n * K`)
/// under `threshold` (see the module docs for the exact definitions).
pub fn dual_sparsity(
    mask: &Mask,
    activations: &[f32],
    n: usize,
    threshold: Option<f32>,
) -> Result<DualSparsityReport> {
    check_threshold(threshold)?;
    let (m, k) = (mask.rows(), mask.cols());
    if n == 0 {
        return Err(PruneError::NoCalibration(
            "dual sparsity needs at least one activation row",
        ));
    }
    if activations.len() != n.saturating_mul(k) {
        return Err(PruneError::Shape {
            what: "activation length (n * K)",
            expected: n.saturating_mul(k),
            actual: activations.len(),
        });
    }
    check_finite("activations", activations)?;
    let pruned_per_col = mask.pruned_per_column();
    let mut inactive = 0u64;
    // Σ over inactive (t, j) of the pruned weights in column j = |S ∩ D|.
    let mut both = 0u64;
    if let Some(t) = threshold {
        for row in activations.chunks_exact(k) {
            for (x, &p) in row.iter().zip(&pruned_per_col) {
                if x.abs() <= t {
                    inactive += 1;
                    both += p as u64;
                }
            }
        }
    }
    let products = n as f64 * m as f64 * k as f64;
    let sp = mask.sparsity();
    let dp = inactive as f64 / (n as f64 * k as f64);
    let overlap = both as f64 / products;
    let expected = sp * dp;
    let total = sp + dp - overlap;
    Ok(DualSparsityReport {
        tokens: n,
        static_ratio: sp,
        dynamic_ratio: dp,
        overlap,
        expected_overlap: expected,
        overlap_deviation: if expected > 0.0 {
            (overlap - expected) / expected
        } else {
            0.0
        },
        total,
        independent_total: 1.0 - (1.0 - sp) * (1.0 - dp),
        overlap_of_either: if total > 0.0 { overlap / total } else { 0.0 },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mask::select_mask;
    use crate::pattern::Pattern;
    use sieve_formats::random::SplitMix64;

    /// Counts every product one by one.
    fn brute(mask: &Mask, x: &[f32], n: usize, t: f32) -> (f64, f64, f64) {
        let (m, k) = (mask.rows(), mask.cols());
        let (mut s, mut d, mut b) = (0u64, 0u64, 0u64);
        for tok in 0..n {
            for i in 0..m {
                for j in 0..k {
                    let st = !mask.is_kept(i, j);
                    let dy = x[tok * k + j].abs() <= t;
                    s += st as u64;
                    d += dy as u64;
                    b += (st && dy) as u64;
                }
            }
        }
        let p = (n * m * k) as f64;
        (s as f64 / p, d as f64 / p, b as f64 / p)
    }

    #[test]
    fn matches_brute_force_and_independence() {
        let mut rng = SplitMix64::new(3);
        let (m, k, n) = (24, 40, 50);
        let scores: Vec<f32> = (0..m * k).map(|_| rng.normal() as f32).collect();
        let mask = select_mask(&scores, m, k, Pattern::Unstructured, 0.6).unwrap();
        let x: Vec<f32> = (0..n * k).map(|_| rng.normal() as f32).collect();
        let t = 0.84; // about 60% of |N(0,1)|
        let r = dual_sparsity(&mask, &x, n, Some(t)).unwrap();
        let (s, d, b) = brute(&mask, &x, n, t);
        assert!((r.static_ratio - s).abs() < 1e-12);
        assert!((r.dynamic_ratio - d).abs() < 1e-12);
        assert!((r.overlap - b).abs() < 1e-12);
        assert!((r.total - (s + d - b)).abs() < 1e-12);
        // independent random masks overlap close to sp * dp
        assert!(r.overlap_deviation.abs() < 0.1, "{r:?}");
        assert!((r.total - r.independent_total).abs() < 0.03);
    }

    #[test]
    fn full_subsumption_and_no_threshold() {
        // column 0 pruned everywhere and always inactive: overlap = dp = sp
        let mask = Mask::new(2, 2, vec![false, true, false, true]).unwrap();
        let x = [0.0f32, 5.0, 0.01, 5.0];
        let r = dual_sparsity(&mask, &x, 2, Some(0.1)).unwrap();
        assert_eq!(
            (r.static_ratio, r.dynamic_ratio, r.overlap),
            (0.5, 0.5, 0.5)
        );
        assert_eq!(r.total, 0.5);
        assert_eq!(r.overlap_deviation, 1.0);
        assert_eq!(r.overlap_of_either, 1.0);
        let r = dual_sparsity(&mask, &x, 2, None).unwrap();
        assert_eq!((r.dynamic_ratio, r.overlap, r.total), (0.0, 0.0, 0.5));
    }

    #[test]
    fn typed_errors() {
        let mask = Mask::dense(2, 2).unwrap();
        assert!(matches!(
            dual_sparsity(&mask, &[1.0; 3], 2, None),
            Err(PruneError::Shape { .. })
        ));
        assert!(matches!(
            dual_sparsity(&mask, &[], 0, None),
            Err(PruneError::NoCalibration(_))
        ));
        assert!(matches!(
            dual_sparsity(&mask, &[1.0, f32::NAN], 1, None),
            Err(PruneError::NonFinite { .. })
        ));
        assert!(matches!(
            dual_sparsity(&mask, &[1.0; 2], 1, Some(-1.0)),
            Err(PruneError::Format(_))
        ));
    }
}
