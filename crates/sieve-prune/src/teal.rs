//! TEAL activation thresholds (Liu et al. 2025, as used by SPDP): at run time an input element
//! with `|x| <= t` is skipped. For a target dynamic sparsity `dp`, `t` is the `dp` quantile of the
//! empirical distribution (ECDF) of `|x|` at that site on calibration data.
//!
//! # Bounded memory and accuracy
//!
//! [`ActivationHistogram`] counts `|x|` in bins defined by the f32 bit pattern: the sign is
//! dropped, and the 8 exponent bits plus the top [`MANTISSA_BITS`] = 7 mantissa bits name the
//! bin. Because the bit patterns of non-negative floats order like their values, bins are
//! contiguous value intervals, log-spaced with a relative width of 2⁻⁷ ≈ 0.78% over the whole
//! f32 range (32 640 bins, 255 KiB per site, independent of how many activations stream in).
//!
//! [`ActivationHistogram::threshold_for`] returns the **upper edge** of a bin, so the fraction of
//! calibration elements with `|x| <= t` is known exactly (it is a cumulative bin count, reported
//! as [`TealThreshold::achieved`]). Of the two bin edges around the requested quantile it picks
//! the one whose exact fraction is closer to the target, so `|achieved - target|` is at most the
//! probability mass of a single bin: for smooth activation distributions (Gaussian, Laplace)
//! that is well under 1% (≈0.3% at the median of |N(0,1)|); only distributions with a
//! point mass (many identical values, e.g. exact zeros) can miss by more, and no threshold could
//! do better on them.

use crate::error::{check_finite, check_ratio, PruneError, Result};
use serde::Serialize;

/// Mantissa bits kept in a bin index.
pub const MANTISSA_BITS: u32 = 7;
const SHIFT: u32 = 23 - MANTISSA_BITS;
/// Bins covering every finite non-negative f32 (bit patterns below `+inf`).
const BINS: usize = (0x7f80_0000u32 >> SHIFT) as usize;

/// Streaming histogram of `|x|` for one activation site (one layer input).
#[derive(Clone, Debug, PartialEq)]
pub struct ActivationHistogram {
    counts: Vec<u64>,
    total: u64,
    max_abs: f32,
}

/// A threshold and the fraction of calibration elements it makes inactive.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct TealThreshold {
    /// `None` for a target of 0 (dense activations).
    pub threshold: Option<f32>,
    /// Exact fraction of calibration elements with `|x| <= threshold`.
    pub achieved: f64,
}

impl Default for ActivationHistogram {
    fn default() -> Self {
        Self::new()
    }
}

impl ActivationHistogram {
    pub fn new() -> Self {
        Self {
            counts: vec![0; BINS],
            total: 0,
            max_abs: 0.0,
        }
    }

    #[inline]
    fn bin(v: f32) -> usize {
        (v.abs().to_bits() >> SHIFT) as usize
    }

    /// Largest value in bin `b` (its inclusive upper edge).
    #[inline]
    fn upper_edge(b: usize) -> f32 {
        f32::from_bits((((b as u32) + 1) << SHIFT) - 1)
    }

    /// Adds activation elements (any layout; only magnitudes matter). Non-finite values are
    /// refused and nothing is added.
    pub fn add(&mut self, x: &[f32]) -> Result<()> {
        check_finite("activations", x)?;
        for &v in x {
            self.counts[Self::bin(v)] += 1;
            self.max_abs = self.max_abs.max(v.abs());
        }
        self.total += x.len() as u64;
        Ok(())
    }

    pub fn merge(&mut self, other: &ActivationHistogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
        self.max_abs = self.max_abs.max(other.max_abs);
    }

    /// Elements seen.
    pub fn total(&self) -> u64 {
        self.total
    }
    pub fn max_abs(&self) -> f32 {
        self.max_abs
    }

    /// The threshold whose calibration fraction `|x| <= t` is closest to `target` (see the
    /// module docs for the accuracy guarantee).
    pub fn threshold_for(&self, target: f64) -> Result<TealThreshold> {
        check_ratio(target)?;
        if self.total == 0 {
            return Err(PruneError::NoCalibration(
                "the activation histogram is empty",
            ));
        }
        if target == 0.0 {
            return Ok(TealThreshold {
                threshold: None,
                achieved: 0.0,
            });
        }
        let total = self.total as f64;
        let need = target * total;
        let mut below = 0u64;
        for (b, &c) in self.counts.iter().enumerate() {
            let through = below + c;
            if through as f64 >= need {
                let over = through as f64 - need;
                let under = need - below as f64;
                let (edge_bin, count) = if under < over && b > 0 {
                    (b - 1, below)
                } else {
                    (b, through)
                };
                return Ok(TealThreshold {
                    threshold: Some(Self::upper_edge(edge_bin)),
                    achieved: count as f64 / total,
                });
            }
            below = through;
        }
        // Unreachable for target < 1 (the last bin brings the count to `total`), but a
        // threshold at the largest finite value is the correct answer anyway.
        Ok(TealThreshold {
            threshold: Some(f32::MAX),
            achieved: 1.0,
        })
    }

    /// Exact fraction of elements with `|x| <= t` when `t` is a bin edge returned by
    /// [`threshold_for`](Self::threshold_for); for other `t` the bin containing `t` is counted
    /// as fully below (an upper bound, off by at most one bin's mass).
    pub fn fraction_at_or_below(&self, t: f32) -> Result<f64> {
        if !(t.is_finite() && t >= 0.0) {
            return Err(PruneError::Format(sieve_formats::FormatError::Threshold(t)));
        }
        if self.total == 0 {
            return Err(PruneError::NoCalibration(
                "the activation histogram is empty",
            ));
        }
        let through: u64 = self.counts[..=Self::bin(t)].iter().sum();
        Ok(through as f64 / self.total as f64)
    }
}

/// Convenience: the exact fraction of `x` with `|x| <= t` (`None`: nothing is skipped).
pub fn inactive_fraction(x: &[f32], threshold: Option<f32>) -> f64 {
    match threshold {
        None => 0.0,
        Some(_) if x.is_empty() => 0.0,
        Some(t) => x.iter().filter(|v| v.abs() <= t).count() as f64 / x.len() as f64,
    }
}

/// Largest sparsity [`greedy_allocation`] gives one group: its thresholds come from an ECDF
/// quantile, which must stay below 1.
pub const GREEDY_MAX_GROUP_SPARSITY: f64 = 0.99;

/// One step of [`greedy_allocation`]: every group's sparsity after it, the block-level
/// (size-weighted) sparsity, and the block output error that made the step win.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GreedyStep {
    pub sparsities: Vec<f64>,
    pub block_sparsity: f64,
    pub error: f64,
}

/// TEAL's block-wise greedy sparsity allocation (Liu et al., "Training-Free Activation Sparsity
/// in Large Language Models", Algorithm 1), over `sizes.len()` groups of weights that each read
/// one thresholded input (`sizes[i]` = weights of group `i`, `F` = their sum).
///
/// Starting from no sparsity, every step tries raising each group `i` alone by
/// `δ_i = α · F / sizes[i]`, so that any choice raises the block-level sparsity
/// `Σ s_i · sizes[i] / F` by the same `α`, asks `block_error` for the block's output error
/// with that allocation, and keeps the raise with the smallest error. It stops at the block
/// level `target` (the last step is shortened to land on it). Big groups move in small steps,
/// small groups in large ones; a raise that would take a group past
/// [`GREEDY_MAX_GROUP_SPARSITY`] is not tried, and when no group can take a step, the step
/// is halved.
///
/// Returns every step (TEAL records the whole path; the last step is the allocation for
/// `target`). `block_error` must return a finite, non-negative error.
pub fn greedy_allocation(
    sizes: &[usize],
    target: f64,
    step: f64,
    block_error: &mut dyn FnMut(&[f64]) -> Result<f64>,
) -> Result<Vec<GreedyStep>> {
    check_ratio(target)?;
    if !(step > 0.0 && step <= 1.0) {
        return Err(PruneError::Option(format!(
            "greedy step {step} is outside (0, 1]"
        )));
    }
    if sizes.is_empty() || sizes.contains(&0) {
        return Err(PruneError::Option(
            "greedy allocation needs at least one group, each with weights".into(),
        ));
    }
    let total: f64 = sizes.iter().map(|&f| f as f64).sum();
    let block =
        |s: &[f64]| -> f64 { s.iter().zip(sizes).map(|(s, &f)| s * f as f64).sum::<f64>() / total };
    let max_block = block(&vec![GREEDY_MAX_GROUP_SPARSITY; sizes.len()]);
    if target > max_block {
        return Err(PruneError::Option(format!(
            "greedy allocation cannot reach {target}: each group stops at {GREEDY_MAX_GROUP_SPARSITY}"
        )));
    }
    // Steps shorter than this would only chase rounding.
    const MIN_STEP: f64 = 1e-9;
    let mut sparsities = vec![0.0; sizes.len()];
    let mut steps = Vec::new();
    let mut reached = 0.0;
    while target - reached > MIN_STEP {
        let mut raise = step.min(target - reached);
        let mut best: Option<(usize, f64, f64)> = None;
        while best.is_none() {
            for (i, &f) in sizes.iter().enumerate() {
                let s = sparsities[i] + raise * total / f as f64;
                if s > GREEDY_MAX_GROUP_SPARSITY {
                    continue;
                }
                let mut trial = sparsities.clone();
                trial[i] = s;
                let e = block_error(&trial)?;
                if !(e.is_finite() && e >= 0.0) {
                    return Err(PruneError::Option(format!(
                        "block error {e} for allocation {trial:?}"
                    )));
                }
                if best.is_none_or(|(_, _, b)| e < b) {
                    best = Some((i, s, e));
                }
            }
            if best.is_none() {
                raise /= 2.0;
                if raise < MIN_STEP {
                    return Err(PruneError::Option(format!(
                        "greedy allocation stuck at {reached} below {target}"
                    )));
                }
            }
        }
        let Some((i, s, error)) = best else {
            unreachable!("the loop above only ends with a choice");
        };
        sparsities[i] = s;
        reached = block(&sparsities);
        steps.push(GreedyStep {
            sparsities: sparsities.clone(),
            block_sparsity: reached,
            error,
        });
    }
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use sieve_formats::random::SplitMix64;

    fn laplace(rng: &mut SplitMix64, scale: f64) -> f32 {
        let u = rng.next_f64() - 0.5;
        (-scale * u.signum() * (1.0 - 2.0 * u.abs()).max(1e-300).ln()) as f32
    }

    #[test]
    fn gaussian_and_laplace_targets_within_one_percent() {
        let mut rng = SplitMix64::new(7);
        let gauss: Vec<f32> = (0..200_000).map(|_| (rng.normal() * 0.3) as f32).collect();
        let lap: Vec<f32> = (0..200_000).map(|_| laplace(&mut rng, 0.05)).collect();
        for data in [&gauss, &lap] {
            let mut hist = ActivationHistogram::new();
            // stream in uneven pieces
            for piece in data.chunks(7_919) {
                hist.add(piece).unwrap();
            }
            for target in [0.05, 0.25, 0.4, 0.5, 0.7, 0.9, 0.99] {
                let got = hist.threshold_for(target).unwrap();
                let t = got.threshold.unwrap();
                let measured = inactive_fraction(data, Some(t));
                assert!(
                    (measured - target).abs() < 0.01,
                    "target {target}: measured {measured}"
                );
                // the reported fraction is exact
                assert_eq!(measured, got.achieved);
                assert_eq!(hist.fraction_at_or_below(t).unwrap(), got.achieved);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        #[test]
        fn threshold_is_near_exact_quantile(seed in any::<u64>(), target in 0.01f64..0.99, scale in 0.001f64..100.0) {
            let mut rng = SplitMix64::new(seed);
            let data: Vec<f32> = (0..20_000).map(|_| (rng.normal() * scale) as f32).collect();
            let mut hist = ActivationHistogram::new();
            hist.add(&data).unwrap();
            let got = hist.threshold_for(target).unwrap();
            let measured = inactive_fraction(&data, got.threshold);
            prop_assert_eq!(measured, got.achieved);
            prop_assert!((measured - target).abs() < 0.01);
            // t is the upper edge of the bin of sample ceil(target·len) or the bin below: within a
            // bin (2^-MANTISSA_BITS) of the samples around the quantile, even across empty bins.
            let exact = sieve_formats::random::threshold_for_sparsity(&data, target).unwrap().unwrap();
            let t = got.threshold.unwrap();
            let mut mags: Vec<f32> = data.iter().map(|v| v.abs()).collect();
            mags.sort_by(f32::total_cmp);
            let k = ((target * mags.len() as f64).round() as usize).clamp(1, mags.len() - 1);
            let bin = (-(MANTISSA_BITS as i32) as f32).exp2();
            prop_assert!(
                t >= exact * (1.0 - bin) && t <= mags[k].max(exact) * (1.0 + bin),
                "t {} exact {} next {}", t, exact, mags[k]
            );
        }
    }

    #[test]
    fn point_masses_and_edges() {
        let mut hist = ActivationHistogram::new();
        hist.add(&[0.0, -0.0, 0.0, 0.0, 1.0, -2.0, 3.0, 4.0])
            .unwrap();
        let got = hist.threshold_for(0.5).unwrap();
        assert_eq!(got.achieved, 0.5);
        assert!(got.threshold.unwrap() < 1.0);
        assert_eq!(hist.threshold_for(0.0).unwrap().threshold, None);
        assert_eq!(hist.max_abs(), 4.0);
        let mut other = ActivationHistogram::new();
        other.add(&[5.0; 8]).unwrap();
        hist.merge(&other);
        assert_eq!(hist.total(), 16);
        assert_eq!(hist.threshold_for(0.5).unwrap().achieved, 0.5);
    }

    /// On a separable error with known per-group costs the greedy path is the optimal one:
    /// raising the cheap group first, the block level lands exactly on the target, and each
    /// step raises it by the step size.
    #[test]
    fn greedy_allocation_prefers_cheap_groups_and_hits_the_target() {
        let sizes = [200usize, 300, 500];
        // Error of group i at sparsity s: cost_i * s^2; group 2 is cheap, group 0 costly.
        let cost = [50.0, 4.0, 1.0];
        let mut calls = 0;
        let steps = greedy_allocation(&sizes, 0.45, 0.1, &mut |s| {
            calls += 1;
            Ok(s.iter().zip(&cost).map(|(s, c)| c * s * s).sum())
        })
        .unwrap();
        let last = steps.last().unwrap();
        assert!((last.block_sparsity - 0.45).abs() < 1e-12);
        for pair in steps.windows(2) {
            let rise = pair[1].block_sparsity - pair[0].block_sparsity;
            assert!(rise <= 0.1 + 1e-12 && rise > 0.0);
            assert!(pair[1].error >= pair[0].error);
        }
        assert_eq!(steps.len(), 5);
        assert_eq!(calls, 5 * 3);
        // The costly small group is never raised; the cheap big one carries most.
        assert_eq!(last.sparsities[0], 0.0);
        assert!(last.sparsities[2] > last.sparsities[1]);
        assert!(last
            .sparsities
            .iter()
            .all(|&s| s <= GREEDY_MAX_GROUP_SPARSITY));
    }

    /// A group that would overshoot the cap is skipped, and steps shrink when none fits.
    #[test]
    fn greedy_allocation_respects_the_cap_and_refuses_bad_input() {
        // One group: every raise is in it; 0.95 is reached in steps of 0.3 then a short one.
        let steps = greedy_allocation(&[10], 0.95, 0.3, &mut |s| Ok(s[0])).unwrap();
        let got: Vec<f64> = steps.iter().map(|s| s.sparsities[0]).collect();
        assert_eq!(got.len(), 4);
        assert!((got[3] - 0.95).abs() < 1e-12);
        // Two groups, the small one would jump past the cap: only the big one moves.
        let steps = greedy_allocation(&[1, 99], 0.5, 0.05, &mut |s| Ok(10.0 * s[1])).unwrap();
        assert!(steps.iter().all(|st| st.sparsities[0] == 0.0));
        let no = &mut |_: &[f64]| Ok(0.0);
        assert!(greedy_allocation(&[1, 1], 1.0, 0.1, no).is_err());
        assert!(greedy_allocation(&[1, 1], 0.995, 0.1, no).is_err());
        assert!(greedy_allocation(&[1, 1], 0.5, 0.0, no).is_err());
        assert!(greedy_allocation(&[1, 1], 0.5, f64::NAN, no).is_err());
        assert!(greedy_allocation(&[], 0.5, 0.1, no).is_err());
        assert!(greedy_allocation(&[1, 0], 0.5, 0.1, no).is_err());
        assert!(greedy_allocation(&[1, 1], 0.5, 0.1, &mut |_| Ok(f64::NAN)).is_err());
        assert!(greedy_allocation(&[1, 1], 0.5, 0.1, &mut |_| {
            Err(PruneError::Option("model failed".into()))
        })
        .is_err());
        assert!(greedy_allocation(&[1, 1], 0.0, 0.1, no).unwrap().is_empty());
    }

    #[test]
    fn typed_errors() {
        let mut hist = ActivationHistogram::new();
        assert!(matches!(
            hist.threshold_for(0.5),
            Err(PruneError::NoCalibration(_))
        ));
        assert!(matches!(
            hist.add(&[1.0, f32::NAN]),
            Err(PruneError::NonFinite { index: 1, .. })
        ));
        assert_eq!(hist.total(), 0);
        hist.add(&[1.0]).unwrap();
        assert!(matches!(hist.threshold_for(1.0), Err(PruneError::Ratio(_))));
        assert!(matches!(
            hist.threshold_for(-0.5),
            Err(PruneError::Ratio(_))
        ));
        assert!(hist.fraction_at_or_below(f32::NAN).is_err());
    }
}
