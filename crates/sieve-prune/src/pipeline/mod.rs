//! Whole-model pruning, layer by layer, on calibration windows (what `sieve pack` runs).
//!
//! One pass per decoder layer `l`, with the residual stream of every calibration window at the
//! input of `l` in memory (one layer boundary, `windows x len x d` floats). The layer's four
//! input sites ([`Site`]) are calibrated in the order the layer computes them, each on inputs
//! produced by the projections before it **already pruned** (the sublayer order GPTQ calls
//! "true sequential"), so every product of the layer is computed once per window:
//!
//! 1. normed residual stream of every window -> statistics of q/k/v's input -> prune q/k/v;
//! 2. attention with the pruned q/k/v -> statistics of o_proj's input (kept for every window)
//!    -> prune o_proj;
//! 3. residual stream += pruned o_proj -> statistics of gate/up's input -> prune gate/up;
//! 4. SwiGLU with the pruned gate/up -> statistics of down_proj's input (kept for every window)
//!    -> prune down_proj;
//! 5. residual stream += pruned down_proj: the inputs of layer `l + 1`, so later layers are
//!    calibrated on the outputs of the already-pruned ones (as SparseGPT and Wanda do).
//!
//! Each window runs the layer as one [`Model::walk_layer`] (the executor of
//! `sieve_model::plan::LAYER` without a cache), paused before each group's product while the
//! group is pruned.
//!
//! The statistics are Wanda's column norms or SparseGPT's `XᵀX` (one site at a time; SparseGPT
//! factorises each site's Hessian once for the matrices that share it); magnitude reads none.
//! Each pruned linear is re-encoded in the chosen format ([`FormatChoice`]). The same steps
//! fill one `|x|` histogram per site and keep the first `report_tokens` activation rows per
//! site. Memory: the residual streams plus one site's inputs of every window (the largest is
//! down_proj's, `windows x len x I` floats) — one layer's activations, never all layers'.
//! Magnitude pruning without thresholds reads no activations and skips the steps.
//!
//! Wanda's reference implementation instead takes every site's statistics from the layer
//! before any of its projections is pruned, and then runs the pruned layer again for its
//! output: two passes, and o_proj/gate/up/down statistics that the pruned model never sees.
//!
//! **TEAL**: per site, the threshold whose calibration fraction of `|x| <= t` is closest to
//! `dp` is set on the linears reading that site; the dual-sparsity report of every linear
//! (SPDP's static x dynamic overlap) is measured on the kept activation rows.
//!
//! The thresholds of layer `l` are calibrated on activations without any threshold applied
//! and the stream passed on to layer `l + 1` is computed without them, as TEAL calibrates
//! every threshold on the activations of the (weight-pruned) model.
//!
//! # Files
//!
//! | file | holds |
//! |---|---|
//! | `mod.rs` | the layer-by-layer pass and its entry point [`prune_model`] |
//! | `options.rs` | [`PipelineOptions`] and the pattern each `--format` can store |
//! | `value_grid.rs` | `--values` ([`ValueGrid`]): snapping the kept weights onto int8 / int4 grids |
//! | `format_choice.rs` | [`FormatChoice`]: encoding each linear, and `--format auto`'s timed choice |
//! | `teal_allocation.rs` | [`TealAllocation`]: how `dp` is spread over a layer's input sites |
//! | `report.rs` | [`PipelineReport`], its summary text and the bytes-per-token model |
//! | `calibration.rs` | calibration windows from text, and the check that the model can run them |
//! | `test_model.rs` | (tests) a tiny random Llama model, its calibration windows and options |

mod calibration;
mod format_choice;
mod options;
mod report;
mod teal_allocation;
#[cfg(test)]
mod test_model;
mod value_grid;

pub use calibration::{
    calibration_windows_from_file, calibration_windows_from_text, check_calibration,
    CALIB_TOKENS_PER_NEEDED,
};
pub use format_choice::{encode_choice, time_cpu_product, Encoded, FormatChoice, PRODUCT_REPS};
pub use options::{
    check_pattern_for_format, pattern_for_format, PipelineOptions, BALANCED_FORMAT_NAME,
};
pub use report::{bytes_per_token, LinearReport, PipelineReport, StageSeconds};
pub use teal_allocation::TealAllocation;
pub use value_grid::{check_values_for_format, ValueGrid, DEFAULT_INT4_GROUP, INT4_GROUPS};

use crate::dual::{dual_sparsity, DualSparsityReport};
use crate::error::{check_ratio, PruneError, Result};
use crate::mask::Mask;
use crate::methods::{prune_magnitude, prune_wanda, ColumnNorms, Method};
use crate::pattern::Pattern;
use crate::sparsegpt::{HessianAccumulator, PreparedHessian, RowGrid, SweepGrid};
use crate::teal::ActivationHistogram;
use half::f16;
use report::aggregate;
use sieve_cpu::dense::FastDense;
use sieve_formats::value_grid::{INT4, INT8};
use sieve_formats::{DenseMatrix, WeightFormat};
use sieve_model::llama::{Model, Site};
use sieve_model::plan::Group;
use std::collections::HashMap;
use teal_allocation::greedy_site_targets;
use value_grid::{int8_scales, snap_runs};

impl From<sieve_model::ModelError> for PruneError {
    fn from(e: sieve_model::ModelError) -> Self {
        PruneError::Model(e.with_causes())
    }
}

/// Passes over the windows per layer (module docs, steps 1-5).
const PASS_STEPS: u64 = 5;

/// Progress of [`prune_model`], in units: per layer, one per window of each of the
/// [`PASS_STEPS`] steps and one per pruned linear.
#[derive(Clone, Copy, Debug)]
pub struct Progress<'a> {
    pub done: u64,
    pub total: u64,
    pub layer: usize,
    pub stage: &'a str,
}

/// Calibration statistics of one input site, over every window.
enum SiteStats {
    None,
    Norms(ColumnNorms),
    Hessian(HessianAccumulator),
}

/// A pruned linear waiting for the end of its layer's pass.
struct PrunedLinear {
    name: String,
    site: Site,
    /// What is stored (f16 underflows count as pruned).
    mask: Mask,
    format: Box<dyn WeightFormat>,
    product_seconds: Option<f64>,
}

/// The per-layer state of [`prune_model`]: statistics of the site being calibrated, the
/// histograms and kept rows of every site, and the pruned linears waiting for their formats.
struct LayerPass<'a> {
    options: &'a PipelineOptions,
    pattern: Pattern,
    layer: usize,
    stats: SiteStats,
    histograms: HashMap<Site, ActivationHistogram>,
    kept: HashMap<Site, (Vec<f32>, usize)>,
    /// Per linear of the layer, in [`sieve_model::llama::Layer::linears_mut`] order.
    pruned: Vec<Option<PrunedLinear>>,
    statistics_seconds: f64,
}

impl<'a> LayerPass<'a> {
    fn new(options: &'a PipelineOptions, pattern: Pattern, layer: usize) -> Self {
        Self {
            options,
            pattern,
            layer,
            stats: SiteStats::None,
            histograms: HashMap::new(),
            kept: HashMap::new(),
            pruned: (0..7).map(|_| None).collect(),
            statistics_seconds: 0.0,
        }
    }

    /// Feeds `n` input rows of `site` (of one window) to the method's statistics, the TEAL
    /// histogram and the kept report rows.
    fn observe(&mut self, site: Site, a: &[f32], n: usize) -> Result<()> {
        let clock = std::time::Instant::now();
        let k = a.len() / n.max(1);
        match self.options.method {
            Method::Magnitude => {}
            Method::Wanda => {
                if !matches!(self.stats, SiteStats::Norms(_)) {
                    self.stats = SiteStats::Norms(ColumnNorms::new(k)?);
                }
                if let SiteStats::Norms(c) = &mut self.stats {
                    c.add_rows(a, n)?;
                }
            }
            Method::SparseGpt => {
                if !matches!(self.stats, SiteStats::Hessian(_)) {
                    self.stats = SiteStats::Hessian(HessianAccumulator::new(k)?);
                }
                if let SiteStats::Hessian(h) = &mut self.stats {
                    h.add_rows(a, n)?;
                }
            }
        }
        if self.options.dp > 0.0 {
            self.histograms.entry(site).or_default().add(a)?;
        }
        let entry = self.kept.entry(site).or_insert_with(|| (Vec::new(), 0));
        let room = self.options.report_tokens.saturating_sub(entry.1).min(n);
        entry.0.extend_from_slice(&a[..room * k]);
        entry.1 += room;
        self.statistics_seconds += clock.elapsed().as_secs_f64();
        Ok(())
    }

    /// Prunes the linears of layer `self.layer` that read `site` with the statistics observed
    /// since the last call, encodes them, and leaves their decoded values in a [`FastDense`]
    /// for the rest of the layer's pass. Returns how many linears were pruned.
    fn prune_site(&mut self, model: &mut Model, site: Site) -> Result<u64> {
        let options = self.options;
        let stats = std::mem::replace(&mut self.stats, SiteStats::None);
        let prepared = match &stats {
            SiteStats::Hessian(h) => Some(PreparedHessian::new(h, &options.sparsegpt)?),
            _ => None,
        };
        let mut count = 0;
        let l = self.layer;
        for (slot, (short, lin)) in model.layers_mut()[l].linears_mut().into_iter().enumerate() {
            let lin_site = Site::of_linear(short)
                .ok_or_else(|| PruneError::Option(format!("unknown projection {short}")))?;
            if lin_site != site {
                continue;
            }
            let (rows, cols) = (lin.rows(), lin.cols());
            let weights: Vec<f32> = lin
                .format()
                .decode()
                .data()
                .iter()
                .map(|v| v.to_f32())
                .collect();
            let mut pruned_weights = match (options.method, &stats, &prepared) {
                (Method::Magnitude, _, _) => {
                    prune_magnitude(&weights, rows, cols, self.pattern, options.sp)?.weights
                }
                (Method::Wanda, SiteStats::Norms(norms), _) => {
                    prune_wanda(&weights, rows, cols, norms, self.pattern, options.sp)?.weights
                }
                (Method::SparseGpt, _, Some(h)) => {
                    // With --values int8|int4 the kept weights are rounded inside the sweep,
                    // each rounding error compensated over the later columns (sparsegpt.rs,
                    // step 6). int8: on the row grids snap_row would choose for the unpruned
                    // rows (4-bit scales: every q · s is an f16 exactly). int4: each group's
                    // scale from its weights as updated when the sweep reaches it.
                    let scales = match options.values {
                        ValueGrid::Int8 => Some(int8_scales(&weights, cols)?),
                        ValueGrid::F16 | ValueGrid::Int4 { .. } => None,
                    };
                    let grid = match options.values {
                        ValueGrid::F16 => None,
                        ValueGrid::Int8 => scales.as_deref().map(|scales| {
                            SweepGrid::Rows(RowGrid {
                                scales,
                                qmax: INT8.qmax,
                            })
                        }),
                        ValueGrid::Int4 { group } => Some(SweepGrid::Groups { grid: INT4, group }),
                    };
                    let w = h
                        .prune_on_grid(
                            &weights,
                            rows,
                            cols,
                            self.pattern,
                            options.sp,
                            &options.sparsegpt,
                            grid,
                        )?
                        .weights;
                    // A grid point past f16's range (an int8 row whose largest weight is within
                    // 13% of 65504) would be stored as infinity; int4 snapping steps such
                    // points back, checked all the same.
                    let past_f16 =
                        grid.and_then(|_| w.iter().position(|v| !f16::from_f32(*v).is_finite()));
                    if let Some(i) = past_f16 {
                        return Err(PruneError::NonFinite {
                            what: "grid points of SparseGPT's weights (past the f16 range)",
                            index: i,
                            value: w[i],
                        });
                    }
                    w
                }
                _ => {
                    return Err(PruneError::NoCalibration(
                        "no activations reached a calibrated site",
                    ))
                }
            };
            let snap_after = (options.method != Method::SparseGpt)
                .then(|| options.values.runs(cols))
                .flatten();
            if let Some((grid, run)) = snap_after {
                // Here, before the layer's pass goes on: the later sites of this layer and the
                // later layers calibrate on the weights as stored (GPTQ's sequential order).
                // Weights whose index rounds to 0 become +0, unstored: a balanced group then
                // holds fewer than N, which the pattern allows.
                snap_runs(&mut pruned_weights, cols, grid, run)?;
            }
            let matrix = DenseMatrix::from_f32(rows, cols, &pruned_weights)?;
            // The mask of what is stored: an f16 underflow after SparseGPT's update also
            // counts as a zero the kernels skip.
            let keep: Vec<bool> = matrix
                .data()
                .iter()
                .map(|v| !sieve_formats::matrix::is_zero(*v))
                .collect();
            let Encoded {
                format,
                product_seconds,
            } = encode_choice(&matrix, options.format, options.dp)?;
            // The rest of the pass runs the values the format stores (decode is exact, and for
            // quantized payloads it is what the kernels multiply by) through the fast dense
            // GEMM: the formats' own batched products are reference loops, far too slow for
            // thousands of calibration tokens. The format goes in when the layer is done.
            lin.replace_format(Box::new(FastDense::new(format.decode())))?;
            self.pruned[slot] = Some(PrunedLinear {
                name: format!("model.layers.{l}.{short}.weight"),
                site,
                mask: Mask::new(rows, cols, keep)?,
                format,
                product_seconds,
            });
            count += 1;
        }
        Ok(count)
    }
}

/// Prunes every decoder layer of `model` in place (module docs) and sets TEAL thresholds.
/// `windows` are calibration token windows; magnitude pruning with `dp == 0` needs none.
pub fn prune_model(
    model: &mut Model,
    windows: &[Vec<u32>],
    options: &PipelineOptions,
    on_progress: &mut dyn FnMut(Progress<'_>),
) -> Result<PipelineReport> {
    let start = std::time::Instant::now();
    check_ratio(options.sp)?;
    check_ratio(options.dp)?;
    let pattern = options.pattern.validate()?;
    if let FormatChoice::Fixed(kind) = options.format {
        check_pattern_for_format(pattern, kind.name())?;
    }
    check_values_for_format(options.values, options.format)?;
    if let TealAllocation::Greedy { step, tokens } = options.teal_allocation {
        if !(step > 0.0 && step <= 1.0) || tokens == 0 {
            return Err(PruneError::Option(format!(
                "greedy TEAL allocation needs a step in (0, 1] and at least one token (got {step}, {tokens})"
            )));
        }
    }
    if windows.is_empty() || windows.iter().any(|w| w.is_empty()) {
        return Err(PruneError::NoCalibration(
            "the pipeline needs at least one non-empty calibration window",
        ));
    }
    let longest = windows.iter().map(Vec::len).max().unwrap_or(0);
    check_calibration(model.config(), windows.len(), longest)?;
    let layers = model.layers().len();
    let d = model.config().hidden_size;
    let per_layer_units = PASS_STEPS * windows.len() as u64 + 7;
    let total_units = layers as u64 * per_layer_units;
    let mut done = 0u64;
    let mut hidden: Vec<Vec<f32>> = windows
        .iter()
        .map(|w| model.embed(w))
        .collect::<std::result::Result<_, _>>()?;
    let calibration_tokens: usize = windows.iter().map(Vec::len).sum();
    let mut stages = StageSeconds {
        embed: start.elapsed().as_secs_f64(),
        ..StageSeconds::default()
    };
    let mut reports = Vec::with_capacity(layers * 7);
    // Magnitude pruning without thresholds reads no activations: the pass would only feed the
    // dual-sparsity report, which without a threshold depends on the mask alone.
    let needs_activations = options.method.needs_calibration() || options.dp > 0.0;

    for l in 0..layers {
        // The greedy allocation replays the start of the first window through this layer.
        let greedy = match options.teal_allocation {
            TealAllocation::Greedy { step, tokens } if options.dp > 0.0 => {
                let g = tokens.min(windows[0].len());
                Some((step, hidden[0][..g * d].to_vec()))
            }
            _ => None,
        };
        let mut pass = LayerPass::new(options, pattern, l);
        let mut clock = std::time::Instant::now();
        let mut forward_seconds = 0.0;
        let mut prune_seconds = 0.0;
        let mut lap = |acc: &mut f64| {
            *acc += clock.elapsed().as_secs_f64();
            clock = std::time::Instant::now();
        };
        let mut step_done = |done: &mut u64, stage: &'static str, units: u64| {
            *done += units;
            on_progress(Progress {
                done: *done,
                total: total_units,
                layer: l,
                stage,
            });
        };

        if !needs_activations {
            for site in Site::ALL {
                let pruned = pass.prune_site(model, site)?;
                step_done(&mut done, "prune", pruned);
            }
            step_done(&mut done, "prune", PASS_STEPS * windows.len() as u64);
            lap(&mut prune_seconds);
        } else {
            // Steps 1-4: every window walks the layer's plan (`Model::walk_layer`) up to a
            // group's product; its input's statistics over every window prune the group, then
            // the walks go on with the pruned weights.
            let mut walks = windows
                .iter()
                .zip(hidden.iter_mut())
                .map(|(w, x)| model.walk_layer(l, x, w.len()))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let step_names = ["attention input", "attention", "o_proj", "mlp"];
            for (group, stage) in Group::ALL.into_iter().zip(step_names) {
                for walk in &mut walks {
                    let n = walk.rows();
                    pass.observe(group.site(), walk.input(model, group)?, n)?;
                    step_done(&mut done, stage, 1);
                }
                lap(&mut forward_seconds);
                let pruned = pass.prune_site(model, group.site())?;
                step_done(&mut done, "prune", pruned);
                lap(&mut prune_seconds);
            }
            // 5. The layer's output with the pruned down_proj: the next layer's input.
            for walk in walks {
                walk.finish(model)?;
                step_done(&mut done, "down_proj", 1);
            }
            lap(&mut forward_seconds);
        }
        stages.statistics += pass.statistics_seconds;
        stages.forward += forward_seconds - pass.statistics_seconds;
        stages.prune += prune_seconds;

        let targets = match greedy {
            Some((step, input)) => {
                greedy_site_targets(model, l, &input, &pass.histograms, options.dp, step)?
            }
            None => [options.dp; 4],
        };
        lap(&mut stages.allocation);

        // Thresholds and the dual-sparsity report.
        let mut thresholds: HashMap<Site, (Option<f32>, f64, f64)> = HashMap::new();
        for (site, target) in Site::ALL.into_iter().zip(targets) {
            let t = match pass.histograms.get(&site) {
                Some(hist) if target > 0.0 => {
                    let t = hist.threshold_for(target)?;
                    (t.threshold, t.achieved, target)
                }
                _ => (None, 0.0, 0.0),
            };
            thresholds.insert(site, t);
        }
        let layer = &mut model.layers_mut()[l];
        for ((short, lin), slot) in layer.linears_mut().into_iter().zip(&mut pass.pruned) {
            let PrunedLinear {
                name,
                site,
                mask,
                format,
                product_seconds,
            } = slot
                .take()
                .ok_or_else(|| PruneError::Option(format!("layer {l} {short} was not pruned")))?;
            debug_assert_eq!(Site::of_linear(short), Some(site));
            lin.replace_format(format)?;
            let (threshold, calib_dp, target) =
                thresholds.get(&site).copied().unwrap_or((None, 0.0, 0.0));
            lin.set_threshold(threshold)?;
            let (acts, n) = pass
                .kept
                .get(&site)
                .map(|(a, n)| (a.as_slice(), *n))
                .unwrap_or((&[], 0));
            let dual = if n == 0 && threshold.is_none() {
                DualSparsityReport {
                    tokens: 0,
                    ..dual_sparsity(&mask, &vec![0.0; mask.cols()], 1, None)?
                }
            } else {
                dual_sparsity(&mask, acts, n, threshold)?
            };
            let storage = lin.format().storage();
            reports.push(LinearReport {
                name,
                rows: lin.rows(),
                cols: lin.cols(),
                format: lin.format().kind(),
                weight_sparsity: mask.sparsity(),
                threshold,
                calib_dp,
                stored_bytes: storage.total_bytes(),
                bytes_per_token: bytes_per_token(lin.format().kind(), storage, target),
                product_seconds,
                dual,
            });
        }
        lap(&mut stages.report);
    }

    let (static_ratio, dynamic_ratio, overlap, total, independent_total) =
        aggregate(reports.iter());
    Ok(PipelineReport {
        static_ratio,
        dynamic_ratio,
        overlap,
        total,
        independent_total,
        stored_bytes: reports.iter().map(|r| r.stored_bytes).sum(),
        dense_bytes: reports.iter().map(|r| r.rows * r.cols * 2).sum(),
        bytes_per_token: reports.iter().map(|r| r.bytes_per_token).sum(),
        product_seconds: reports.iter().map(|r| r.product_seconds).sum(),
        threads: rayon::current_num_threads(),
        calibration_tokens,
        seconds: start.elapsed().as_secs_f64(),
        stage_seconds: stages,
        linears: reports,
    })
}

#[cfg(test)]
mod tests {
    use super::test_model::{options, source, windows, zero_fraction_per_row};
    use super::*;
    use sieve_formats::FormatKind;
    use sieve_model::llama::Logits;
    use sieve_model::packfile::{PackFile, PackWriter};

    #[test]
    fn every_method_prunes_rows_exactly_and_thresholds_hit_dp() {
        let src = source();
        for method in Method::ALL {
            let mut model = Model::from_source(&src).unwrap();
            let opts = options(method, "unstructured", 0.5, 0.4, "dense");
            let report = prune_model(&mut model, &windows(), &opts, &mut |_| {}).unwrap();
            assert_eq!(report.linears.len(), 14);
            for layer in model.layers() {
                for (_, lin) in layer.linears() {
                    for z in zero_fraction_per_row(lin) {
                        // Magnitude/Wanda zero exactly half of each row (K is even here);
                        // SparseGPT's updated weights may add f16 underflows.
                        if method == Method::SparseGpt {
                            assert!(z >= 0.5, "{method}: {z}");
                        } else {
                            assert_eq!(z, 0.5, "{method}");
                        }
                    }
                }
            }
            for r in &report.linears {
                assert!(
                    (r.calib_dp - 0.4).abs() < 0.01,
                    "{}: {}",
                    r.name,
                    r.calib_dp
                );
                assert!(r.threshold.is_some());
            }
            assert!((report.static_ratio - 0.5).abs() < 0.01);
        }
    }

    /// Re-runs the pruned model without thresholds over the calibration windows and checks
    /// that each threshold makes `dp` of its site's inputs inactive (within 1%).
    #[test]
    fn thresholds_give_target_sparsity_on_calibration_data() {
        let src = source();
        let mut model = Model::from_source(&src).unwrap();
        let opts = options(Method::Wanda, "2:4", 0.5, 0.3, "auto");
        prune_model(&mut model, &windows(), &opts, &mut |_| {}).unwrap();
        let mut thresholds = Vec::new();
        for layer in model.layers_mut() {
            let mut per = HashMap::new();
            for (short, lin) in layer.linears_mut() {
                per.insert(Site::of_linear(short).unwrap(), lin.threshold());
                lin.set_threshold(None).unwrap();
            }
            thresholds.push(per);
        }
        let mut inactive: HashMap<(usize, Site), (usize, usize)> = HashMap::new();
        for w in windows() {
            let mut x = model.embed(&w).unwrap();
            for (l, per) in thresholds.iter().enumerate() {
                model
                    .forward_layer(l, &mut x, w.len(), &mut |site, a, _| {
                        let t = per[&site].unwrap();
                        let e = inactive.entry((l, site)).or_default();
                        e.0 += a.iter().filter(|v| v.abs() <= t).count();
                        e.1 += a.len();
                    })
                    .unwrap();
            }
        }
        for ((l, site), (off, all)) in inactive {
            let frac = off as f64 / all as f64;
            assert!((frac - 0.3).abs() <= 0.01, "layer {l} {site:?}: {frac}");
        }
    }

    #[test]
    fn nm_and_slide_patterns_are_valid() {
        let src = source();
        for (pattern, format) in [("2:4", "tiled-cbc"), ("6:8", "slide"), ("6:8", "auto")] {
            let mut model = Model::from_source(&src).unwrap();
            let opts = options(Method::SparseGpt, pattern, 0.25, 0.0, format);
            let report = prune_model(&mut model, &windows(), &opts, &mut |_| {}).unwrap();
            let p: Pattern = pattern.parse().unwrap();
            for layer in model.layers() {
                for (_, lin) in layer.linears() {
                    let m = lin.format().decode();
                    let keep: Vec<bool> = m
                        .data()
                        .iter()
                        .map(|v| !sieve_formats::matrix::is_zero(*v))
                        .collect();
                    let mask = Mask::new(m.rows(), m.cols(), keep).unwrap();
                    // The pattern's bound holds (f16 underflows only add zeros).
                    for r in 0..m.rows() {
                        let Pattern::NM { n, m: group } = p else {
                            unreachable!()
                        };
                        for g in mask.row(r).chunks(group) {
                            assert!(g.iter().filter(|k| **k).count() <= n, "{group}");
                        }
                    }
                    assert!(lin.threshold().is_none());
                }
            }
            if format == "slide" {
                assert!(report.linears.iter().all(|r| r.format == FormatKind::Slide));
            }
        }
    }

    /// Balanced N:16 through the whole pipeline (format dense, which stores any mask): every
    /// stored matrix obeys the pattern, and the realised sparsity is the pattern's (the test
    /// model's row counts are multiples of 16; f16 underflows could only add zeros).
    #[test]
    fn balanced_pattern_is_valid() {
        let src = source();
        for (method, sp) in [
            (Method::Magnitude, 0.5),
            (Method::Wanda, 0.7),
            (Method::SparseGpt, 0.5),
            (Method::SparseGpt, 0.7),
        ] {
            let mut model = Model::from_source(&src).unwrap();
            let pattern = pattern_for_format(Some("balanced"), sp, "dense").unwrap();
            let opts = PipelineOptions {
                pattern,
                ..options(method, "unstructured", sp, 0.0, "dense")
            };
            let report = prune_model(&mut model, &windows(), &opts, &mut |_| {}).unwrap();
            let want = pattern.matrix_sparsity(0.0, 16, 1).unwrap();
            for layer in model.layers() {
                for (name, lin) in layer.linears() {
                    let m = lin.format().decode();
                    let keep: Vec<bool> = m
                        .data()
                        .iter()
                        .map(|v| !sieve_formats::matrix::is_zero(*v))
                        .collect();
                    let mask = Mask::new(m.rows(), m.cols(), keep).unwrap();
                    mask.check(pattern, 0.0).unwrap();
                    assert!(
                        (mask.sparsity() - want).abs() < 0.01,
                        "{method} {sp} {name}: {}",
                        mask.sparsity()
                    );
                }
            }
            assert!(
                (report.static_ratio - want).abs() < 0.01,
                "{}",
                report.static_ratio
            );
        }
    }

    #[test]
    fn pack_load_forward_round_trip() {
        let src = source();
        let mut model = Model::from_source(&src).unwrap();
        let opts = options(Method::Magnitude, "unstructured", 0.6, 0.2, "rlc-csc");
        prune_model(&mut model, &windows(), &opts, &mut |_| {}).unwrap();
        let mut w = PackWriter::new();
        sieve_model::packed::add_model_sections(&mut w, &model).unwrap();
        w.add_json("manifest", &serde_json::json!({"method": "magnitude"}))
            .unwrap();
        let bytes = w.to_bytes();
        let loaded = Model::from_pack(&PackFile::from_bytes(bytes.clone()).unwrap()).unwrap();
        let tokens = [1u32, 7, 3, 44, 9, 12];
        let a = model
            .forward(&tokens, &mut model.new_cache(16), Logits::All)
            .unwrap();
        let b = loaded
            .forward(&tokens, &mut loaded.new_cache(16), Logits::All)
            .unwrap();
        assert_eq!(a, b);
        assert!(a.iter().all(|v| v.is_finite()));
        let truncated = PackFile::from_bytes(bytes[..bytes.len() - 3].to_vec());
        assert!(truncated.is_err());
    }

    /// The one-pass pipeline against a plain site-by-site reference built on `forward_layer`:
    /// for each site in layer order, run the whole (partly pruned) layer over every window to
    /// collect that site's statistics, prune the site's linears, and finally run the pruned
    /// layer for the next layer's input. Same arithmetic in the same order, so the stored
    /// weights must be identical.
    #[test]
    fn one_pass_matches_site_by_site_reference() {
        let src = source();
        let windows = windows();
        for (method, pattern) in [(Method::Wanda, "unstructured"), (Method::SparseGpt, "2:4")] {
            let opts = options(method, pattern, 0.5, 0.0, "dense");
            let mut ours = Model::from_source(&src).unwrap();
            prune_model(&mut ours, &windows, &opts, &mut |_| {}).unwrap();

            let mut reference = Model::from_source(&src).unwrap();
            let mut hidden: Vec<Vec<f32>> = windows
                .iter()
                .map(|w| reference.embed(w).unwrap())
                .collect();
            for l in 0..reference.layers().len() {
                for site in Site::ALL {
                    let mut norms: Option<ColumnNorms> = None;
                    let mut gram: Option<HessianAccumulator> = None;
                    for (w, h) in windows.iter().zip(&hidden) {
                        let mut x = h.clone();
                        reference
                            .forward_layer(l, &mut x, w.len(), &mut |s, a, n| {
                                if s != site {
                                    return;
                                }
                                let k = a.len() / n;
                                norms
                                    .get_or_insert_with(|| ColumnNorms::new(k).unwrap())
                                    .add_rows(a, n)
                                    .unwrap();
                                gram.get_or_insert_with(|| HessianAccumulator::new(k).unwrap())
                                    .add_rows(a, n)
                                    .unwrap();
                            })
                            .unwrap();
                    }
                    let (norms, gram) = (norms.unwrap(), gram.unwrap());
                    let prepared = PreparedHessian::new(&gram, &opts.sparsegpt).unwrap();
                    for (short, lin) in reference.layers_mut()[l].linears_mut() {
                        if Site::of_linear(short) != Some(site) {
                            continue;
                        }
                        let (rows, cols) = (lin.rows(), lin.cols());
                        let w: Vec<f32> = lin
                            .format()
                            .decode()
                            .data()
                            .iter()
                            .map(|v| v.to_f32())
                            .collect();
                        let pruned = match method {
                            Method::Wanda => {
                                prune_wanda(&w, rows, cols, &norms, opts.pattern, 0.5)
                                    .unwrap()
                                    .weights
                            }
                            _ => {
                                prepared
                                    .prune(&w, rows, cols, opts.pattern, 0.5, &opts.sparsegpt)
                                    .unwrap()
                                    .weights
                            }
                        };
                        let m = DenseMatrix::from_f32(rows, cols, &pruned).unwrap();
                        lin.replace_format(Box::new(FastDense::new(m))).unwrap();
                    }
                }
                for (w, h) in windows.iter().zip(hidden.iter_mut()) {
                    reference
                        .forward_layer(l, h, w.len(), &mut |_, _, _| {})
                        .unwrap();
                }
            }
            for (a, b) in ours.layers().iter().zip(reference.layers()) {
                for ((name, la), (_, lb)) in a.linears().iter().zip(b.linears()) {
                    assert_eq!(
                        la.format().decode(),
                        lb.format().decode(),
                        "{method} {name}"
                    );
                }
            }
        }
    }

    /// Magnitude without thresholds skips the pass over the windows; its report still gives the
    /// static ratio and no dynamic sparsity, and its weights equal those of a run with the pass.
    #[test]
    fn magnitude_without_thresholds_needs_no_activations() {
        let src = source();
        let mut model = Model::from_source(&src).unwrap();
        let opts = options(Method::Magnitude, "unstructured", 0.5, 0.0, "dense");
        let report = prune_model(&mut model, &windows(), &opts, &mut |_| {}).unwrap();
        assert!((report.static_ratio - 0.5).abs() < 1e-9);
        assert_eq!(report.dynamic_ratio, 0.0);
        assert!(report.linears.iter().all(|r| r.dual.tokens == 0));
        let mut with_pass = Model::from_source(&src).unwrap();
        let opts = options(Method::Magnitude, "unstructured", 0.5, 0.3, "dense");
        prune_model(&mut with_pass, &windows(), &opts, &mut |_| {}).unwrap();
        for (a, b) in model.layers().iter().zip(with_pass.layers()) {
            for ((_, la), (_, lb)) in a.linears().iter().zip(b.linears()) {
                assert_eq!(la.format().decode(), lb.format().decode());
            }
        }
    }

    #[test]
    fn bad_options_are_refused() {
        let src = source();
        let mut model = Model::from_source(&src).unwrap();
        for (sp, dp) in [(1.0, 0.0), (-0.1, 0.0), (0.5, 1.0), (f64::NAN, 0.0)] {
            let opts = options(Method::Magnitude, "unstructured", 0.5, 0.0, "dense");
            let opts = PipelineOptions { sp, dp, ..opts };
            assert!(prune_model(&mut model, &windows(), &opts, &mut |_| {}).is_err());
        }
        let opts = options(Method::Magnitude, "unstructured", 0.5, 0.0, "dense");
        assert!(prune_model(&mut model, &[], &opts, &mut |_| {}).is_err());
        assert!(prune_model(&mut model, &[vec![99]], &opts, &mut |_| {}).is_err());
        let err = "bogus".parse::<FormatChoice>().unwrap_err().to_string();
        assert!(
            err.contains("auto, dense, "),
            "the list names auto too: {err}"
        );
        // Windows past the model's context are refused, not run silently.
        let long = vec![vec![1u32; model.config().max_position_embeddings + 1]];
        let err = prune_model(&mut model, &long, &opts, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(err.contains("longer than the model's context"), "{err}");
        assert!(check_calibration(model.config(), 1, 10000).is_err());
        assert!(check_calibration(model.config(), 0, 4).is_err());
    }
}
