//! How the target dynamic sparsity `dp` is spread over a layer's four input sites
//! ([`TealAllocation`]): every site at `dp`, or TEAL's greedy block-wise allocation, which the
//! layer pass runs per layer with [`greedy_site_targets`] (layer runs with trial thresholds,
//! after the layer's weights are pruned). The `|x|` histograms, their thresholds and the greedy
//! search itself are in [`crate::teal`]; this file ties them to a model's layer.

use crate::error::{PruneError, Result};
use crate::teal::ActivationHistogram;
use sieve_model::llama::{Model, Site};
use std::collections::HashMap;

/// How the target dynamic sparsity `dp` is spread over a layer's four input sites.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum TealAllocation {
    /// Every site at `dp`.
    Uniform,
    /// TEAL's block-wise greedy allocation ([`crate::teal::greedy_allocation`]), layer by
    /// layer: the sites' sparsities are raised one at a time, each time the one that moves the
    /// layer's output least, in block-level steps of `step`, until the sparsity weighted by the
    /// weights each site feeds is `dp`. The layer output error is measured on the first
    /// `tokens` tokens of the first calibration window, with the pruned weights.
    Greedy { step: f64, tokens: usize },
}

impl TealAllocation {
    /// `Greedy` in steps of 0.02 (25 steps to 50%, 100 layer runs of 256 tokens per layer).
    /// Steps of 0.05 move o_proj's input (a tenth of a layer's weights) by 0.53 at a time and
    /// gained nothing over uniform at dp 0.5 (wikitext-2 ppl 32.8 vs 32.9); 0.02 gave 30.6.
    pub const GREEDY_DEFAULT: Self = Self::Greedy {
        step: 0.02,
        tokens: 256,
    };
}

/// Per site (in [`Site::ALL`] order), the dynamic sparsity TEAL's greedy allocation gives
/// layer `l` for the layer-level target `dp` ([`TealAllocation::Greedy`]); `input` is the
/// layer's input for a prefix of one window. Leaves the layer's thresholds unset.
pub(super) fn greedy_site_targets(
    model: &mut Model,
    l: usize,
    input: &[f32],
    histograms: &HashMap<Site, ActivationHistogram>,
    dp: f64,
    step: f64,
) -> Result<[f64; 4]> {
    let d = model.config().hidden_size;
    let n = input.len() / d;
    let site_index = |short: &str| {
        Site::of_linear(short)
            .and_then(|site| Site::ALL.iter().position(|s| *s == site))
            .ok_or_else(|| PruneError::Option(format!("unknown projection {short}")))
    };
    let mut sizes = [0usize; 4];
    for (short, lin) in model.layers()[l].linears() {
        sizes[site_index(short)?] += lin.rows() * lin.cols();
    }
    let mut reference = input.to_vec();
    model.forward_layer(l, &mut reference, n, &mut |_, _, _| {})?;
    let mut output_error = |s: &[f64]| -> Result<f64> {
        let mut thresholds = [None; 4];
        for ((t, site), &target) in thresholds.iter_mut().zip(Site::ALL).zip(s) {
            let hist = histograms.get(&site).ok_or(PruneError::NoCalibration(
                "no activations reached a thresholded site",
            ))?;
            *t = hist.threshold_for(target)?.threshold;
        }
        for (short, lin) in model.layers_mut()[l].linears_mut() {
            lin.set_threshold(thresholds[site_index(short)?])?;
        }
        let mut y = input.to_vec();
        model.forward_layer(l, &mut y, n, &mut |_, _, _| {})?;
        Ok(y.iter()
            .zip(&reference)
            .map(|(a, b)| f64::from(a - b).powi(2))
            .sum::<f64>()
            .sqrt())
    };
    let steps = crate::teal::greedy_allocation(&sizes, dp, step, &mut output_error)?;
    for (_, lin) in model.layers_mut()[l].linears_mut() {
        lin.set_threshold(None)?;
    }
    let mut targets = [0.0; 4];
    if let Some(last) = steps.last() {
        targets.copy_from_slice(&last.sparsities);
    }
    Ok(targets)
}

#[cfg(test)]
mod tests {
    use super::super::test_model::{options, source, windows};
    use super::super::{prune_model, PipelineOptions};
    use super::*;
    use crate::methods::Method;

    /// Greedy TEAL allocation: per layer the sites get different sparsities whose weighted
    /// mean (by the weights each site feeds) is `dp`, each threshold giving its own target on
    /// the calibration data.
    #[test]
    fn greedy_allocation_spreads_dp_over_sites() {
        let src = source();
        let mut model = Model::from_source(&src).unwrap();
        let opts = PipelineOptions {
            teal_allocation: TealAllocation::Greedy {
                step: 0.05,
                tokens: 24,
            },
            ..options(Method::Wanda, "unstructured", 0.5, 0.4, "dense")
        };
        let report = prune_model(&mut model, &windows(), &opts, &mut |_| {}).unwrap();
        for layer in report.linears.chunks(7) {
            let weights: Vec<f64> = layer.iter().map(|r| (r.rows * r.cols) as f64).collect();
            let mean = layer
                .iter()
                .zip(&weights)
                .map(|(r, w)| r.calib_dp * w)
                .sum::<f64>()
                / weights.iter().sum::<f64>();
            assert!((mean - 0.4).abs() < 0.02, "{}: {mean}", layer[0].name);
            let spread = layer.iter().map(|r| r.calib_dp).fold(0.0, f64::max)
                - layer.iter().map(|r| r.calib_dp).fold(1.0, f64::min);
            assert!(spread > 0.05, "{}: uniform allocation", layer[0].name);
            for r in layer {
                assert_eq!(r.threshold.is_some(), r.calib_dp > 0.0, "{}", r.name);
            }
        }
        for (step, tokens) in [(0.0, 8), (1.5, 8), (0.1, 0)] {
            let bad = PipelineOptions {
                teal_allocation: TealAllocation::Greedy { step, tokens },
                ..opts.clone()
            };
            assert!(prune_model(&mut model, &windows(), &bad, &mut |_| {}).is_err());
        }
    }
}
