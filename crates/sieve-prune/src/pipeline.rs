//! Whole-model pruning, layer by layer, on calibration windows (what `sieve pack` runs).
//!
//! For each decoder layer `l`, with the residual stream of every calibration window at the
//! input of `l` in memory (one layer boundary, `windows x len x d` floats):
//!
//! 1. **Statistics** (Wanda, SparseGPT only): run layer `l` as it is over every window and
//!    accumulate, per input site ([`Site`]: q/k/v input, o_proj input, gate/up input, down_proj
//!    input), Wanda's column norms or SparseGPT's Hessian `XᵀX`. The outputs are thrown away.
//! 2. **Prune** the layer's 7 linears to ratio `sp` in `pattern` with the chosen method
//!    (SparseGPT factorises each site's Hessian once for the matrices that share it), and
//!    re-encode each in the chosen format ([`FormatChoice`]).
//! 3. **Recompute** layer `l` with the pruned weights over every window, in place: these are
//!    the inputs of layer `l + 1`, so later layers are calibrated on the outputs of the
//!    already-pruned ones (as SparseGPT and Wanda do). Skipped for magnitude pruning without
//!    thresholds, which reads no activations. The same pass fills one `|x|` histogram
//!    per site and keeps the first `report_tokens` activation rows per site.
//! 4. **TEAL**: per site, the threshold whose calibration fraction of `|x| <= t` is closest to
//!    `dp` is set on the linears reading that site; the dual-sparsity report of every linear
//!    (SPDP's static x dynamic overlap) is measured on the kept activation rows.
//!
//! The thresholds of layer `l` are calibrated on activations without any threshold applied
//! and the stream passed on to layer `l + 1` is computed without them, as TEAL calibrates
//! every threshold on the activations of the (weight-pruned) model.
//!
//! # Format cost model (`--format auto`)
//!
//! Each linear is encoded in every format that accepts it and the one moving the fewest bytes
//! per decoded token is kept, with bytes per token =
//! * `total_bytes · (1 - dp)` for column-major formats that skip the weight columns of
//!   inactive inputs (RLC-CSC, Tiled-CBC): an inactive input costs neither its values nor its
//!   column metadata;
//! * `total_bytes` for row/tile-major formats that read every stored byte whatever the input
//!   (dense, IE-BME, Slide).
//!
//! This ignores index arithmetic and caches; it is the memory-bound decode model of the papers.

use crate::dual::{dual_sparsity, DualSparsityReport};
use crate::error::{check_ratio, PruneError, Result};
use crate::mask::Mask;
use crate::methods::{prune_magnitude, prune_wanda, ColumnNorms, Method};
use crate::pattern::Pattern;
use crate::sparsegpt::{HessianAccumulator, PreparedHessian, SparseGptOptions};
use crate::teal::ActivationHistogram;
use rayon::prelude::*;
use serde::Serialize;
use sieve_formats::{DenseMatrix, FormatKind, Storage, WeightFormat};
use sieve_model::linear::FastDense;
use sieve_model::llama::{Model, Site};
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

impl From<sieve_model::ModelError> for PruneError {
    fn from(e: sieve_model::ModelError) -> Self {
        PruneError::Model(e.to_string())
    }
}

/// The format every pruned linear is stored in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FormatChoice {
    Fixed(FormatKind),
    /// Per linear, the format with the fewest bytes per token (module docs).
    Auto,
}

impl FromStr for FormatChoice {
    type Err = PruneError;
    fn from_str(s: &str) -> Result<Self> {
        if s.trim().eq_ignore_ascii_case("auto") {
            return Ok(Self::Auto);
        }
        Ok(Self::Fixed(FormatKind::from_name(s.trim())?))
    }
}

impl fmt::Display for FormatChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Fixed(k) => f.write_str(k.name()),
        }
    }
}

#[derive(Clone, Debug)]
pub struct PipelineOptions {
    pub method: Method,
    pub pattern: Pattern,
    /// Static (weight) sparsity per linear.
    pub sp: f64,
    /// Target dynamic (activation) sparsity per site; 0 sets no threshold.
    pub dp: f64,
    pub format: FormatChoice,
    pub sparsegpt: SparseGptOptions,
    /// Activation rows per site kept for the dual-sparsity report.
    pub report_tokens: usize,
}

/// Bytes a decode step moves for this weight at activation sparsity `dp` (module docs).
pub fn bytes_per_token(kind: FormatKind, storage: Storage, dp: f64) -> f64 {
    let total = storage.total_bytes() as f64;
    match kind {
        FormatKind::RlcCsc | FormatKind::TiledCbc => total * (1.0 - dp),
        FormatKind::Dense | FormatKind::IeBme | FormatKind::Slide => total,
    }
}

/// Encodes `w` in the chosen format (for `Auto`, the cheapest of those that accept it).
pub fn encode_choice(
    w: &DenseMatrix,
    choice: FormatChoice,
    dp: f64,
) -> Result<Box<dyn WeightFormat>> {
    match choice {
        FormatChoice::Fixed(kind) => Ok(sieve_formats::registry::encode_default(kind, w)?),
        FormatChoice::Auto => {
            let candidates: Vec<Box<dyn WeightFormat>> = FormatKind::ALL
                .par_iter()
                .filter_map(|&k| sieve_formats::registry::encode_default(k, w).ok())
                .collect();
            candidates
                .into_iter()
                .min_by(|a, b| {
                    let ca = bytes_per_token(a.kind(), a.storage(), dp);
                    let cb = bytes_per_token(b.kind(), b.storage(), dp);
                    ca.total_cmp(&cb)
                })
                .ok_or_else(|| PruneError::Option("no format accepts this matrix".into()))
        }
    }
}

/// What happened to one linear.
#[derive(Clone, Debug, Serialize)]
pub struct LinearReport {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub format: FormatKind,
    /// Exact fraction of zero weights after pruning and f16 encoding.
    pub weight_sparsity: f64,
    pub threshold: Option<f32>,
    /// Fraction of calibration inputs with `|x| <= threshold` (the whole calibration set).
    pub calib_dp: f64,
    pub stored_bytes: usize,
    pub bytes_per_token: f64,
    /// Static x dynamic overlap on the kept activation rows.
    pub dual: DualSparsityReport,
}

#[derive(Clone, Debug, Serialize)]
pub struct PipelineReport {
    pub linears: Vec<LinearReport>,
    /// Weighted by each linear's M·K (its share of the products of one token).
    pub static_ratio: f64,
    pub dynamic_ratio: f64,
    pub overlap: f64,
    pub total: f64,
    pub independent_total: f64,
    pub stored_bytes: usize,
    pub dense_bytes: usize,
    pub bytes_per_token: f64,
    pub calibration_tokens: usize,
    pub seconds: f64,
    /// Where the time went, summed over layers.
    pub stage_seconds: StageSeconds,
}

/// Wall-clock seconds per pipeline stage (module docs), summed over layers.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct StageSeconds {
    /// Embedding the windows.
    pub embed: f64,
    /// 1. Statistics passes (Wanda norms / SparseGPT Hessians).
    pub statistics: f64,
    /// 2. Factorising Hessians, pruning, encoding.
    pub prune: f64,
    /// 3. Recompute passes (with histograms and kept rows).
    pub recompute: f64,
    /// 4. Thresholds and the dual-sparsity report.
    pub report: f64,
}

impl PipelineReport {
    /// A human-readable summary table (per decoder-layer totals would be too long for 30 layers,
    /// so one line per projection kind plus the whole model).
    pub fn summary(&self) -> String {
        let mut out = String::new();
        out.push_str(
            "projection          sp      dp   overlap  total  indep.  fmt(s)         MB/token\n",
        );
        let mut kinds: Vec<&str> = Vec::new();
        for l in &self.linears {
            let short = short_name(&l.name);
            if !kinds.contains(&short) {
                kinds.push(short);
            }
        }
        for kind in kinds {
            let rows: Vec<&LinearReport> = self
                .linears
                .iter()
                .filter(|l| short_name(&l.name) == kind)
                .collect();
            let agg = aggregate(rows.iter().copied());
            let mut fmts: Vec<&str> = rows.iter().map(|r| r.format.name()).collect();
            fmts.sort_unstable();
            fmts.dedup();
            out.push_str(&format!(
                "{kind:<18} {:6.3}  {:6.3}  {:6.3}  {:6.3}  {:6.3}  {:<14} {:8.3}\n",
                agg.0,
                agg.1,
                agg.2,
                agg.3,
                agg.4,
                fmts.join(","),
                rows.iter().map(|r| r.bytes_per_token).sum::<f64>() / 1e6
            ));
        }
        out.push_str(&format!(
            "{:<18} {:6.3}  {:6.3}  {:6.3}  {:6.3}  {:6.3}  {:<14} {:8.3}\n",
            "all",
            self.static_ratio,
            self.dynamic_ratio,
            self.overlap,
            self.total,
            self.independent_total,
            "",
            self.bytes_per_token / 1e6
        ));
        out.push_str(&format!(
            "stored {:.1} MB of layer weights (dense f16: {:.1} MB); {} calibration tokens; {:.1} s\n",
            self.stored_bytes as f64 / 1e6,
            self.dense_bytes as f64 / 1e6,
            self.calibration_tokens,
            self.seconds
        ));
        let t = &self.stage_seconds;
        out.push_str(&format!(
            "stages: embed {:.1} s, statistics {:.1} s, prune {:.1} s, recompute {:.1} s, report {:.1} s\n",
            t.embed, t.statistics, t.prune, t.recompute, t.report
        ));
        out
    }
}

fn short_name(name: &str) -> &str {
    // model.layers.{l}.{short}.weight
    let trimmed = name.strip_suffix(".weight").unwrap_or(name);
    let mut parts = trimmed.splitn(4, '.');
    parts.nth(3).unwrap_or(trimmed)
}

/// (sp, dp, overlap, total, independent total), each weighted by M·K.
fn aggregate<'a>(rows: impl Iterator<Item = &'a LinearReport>) -> (f64, f64, f64, f64, f64) {
    let (mut w, mut sp, mut dp, mut ov) = (0.0, 0.0, 0.0, 0.0);
    for r in rows {
        let mk = (r.rows * r.cols) as f64;
        w += mk;
        sp += mk * r.dual.static_ratio;
        dp += mk * r.dual.dynamic_ratio;
        ov += mk * r.dual.overlap;
    }
    if w == 0.0 {
        return (0.0, 0.0, 0.0, 0.0, 0.0);
    }
    let (sp, dp, ov) = (sp / w, dp / w, ov / w);
    (sp, dp, ov, sp + dp - ov, 1.0 - (1.0 - sp) * (1.0 - dp))
}

/// Progress of [`prune_model`], in units: per layer, one per window of each pass and one per
/// pruned linear.
#[derive(Clone, Copy, Debug)]
pub struct Progress<'a> {
    pub done: u64,
    pub total: u64,
    pub layer: usize,
    pub stage: &'a str,
}

/// Per-site calibration statistics of one layer.
#[derive(Default)]
struct SiteStats {
    norms: HashMap<Site, ColumnNorms>,
    hessians: HashMap<Site, HessianAccumulator>,
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
    if windows.is_empty() || windows.iter().any(|w| w.is_empty()) {
        return Err(PruneError::NoCalibration(
            "the pipeline needs at least one non-empty calibration window",
        ));
    }
    let layers = model.layers().len();
    let per_layer_units = 2 * windows.len() as u64 + 7;
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

    for l in 0..layers {
        // 1. Statistics of the unpruned layer.
        let mut clock = std::time::Instant::now();
        let mut lap = |acc: &mut f64| {
            *acc += clock.elapsed().as_secs_f64();
            clock = std::time::Instant::now();
        };
        let mut stats = SiteStats::default();
        if options.method.needs_calibration() {
            for (w, h) in windows.iter().zip(&hidden) {
                let mut x = h.clone();
                let mut failure = None;
                let method = options.method;
                model.observe_layer(l, &mut x, w.len(), &mut |site, a, n| {
                    if failure.is_some() {
                        return;
                    }
                    let k = a.len() / n.max(1);
                    let r = match method {
                        Method::SparseGpt => match stats.hessians.entry(site) {
                            Entry::Occupied(e) => e.into_mut().add_rows(a, n),
                            Entry::Vacant(e) => {
                                HessianAccumulator::new(k).and_then(|h| e.insert(h).add_rows(a, n))
                            }
                        },
                        _ => match stats.norms.entry(site) {
                            Entry::Occupied(e) => e.into_mut().add_rows(a, n),
                            Entry::Vacant(e) => {
                                ColumnNorms::new(k).and_then(|c| e.insert(c).add_rows(a, n))
                            }
                        },
                    };
                    if let Err(e) = r {
                        failure = Some(e);
                    }
                })?;
                if let Some(e) = failure {
                    return Err(e);
                }
                done += 1;
                on_progress(Progress {
                    done,
                    total: total_units,
                    layer: l,
                    stage: "calibrate",
                });
            }
        } else {
            done += windows.len() as u64;
        }

        lap(&mut stages.statistics);

        // 2. Prune and re-encode.
        let prepared: HashMap<Site, PreparedHessian> = stats
            .hessians
            .iter()
            .map(|(site, h)| Ok((*site, PreparedHessian::new(h, &options.sparsegpt)?)))
            .collect::<Result<_>>()?;
        let mut masks: Vec<(String, Site, Mask)> = Vec::with_capacity(7);
        let mut encoded: Vec<Box<dyn WeightFormat>> = Vec::with_capacity(7);
        for (short, lin) in model.layers_mut()[l].linears_mut() {
            let site = Site::of_linear(short)
                .ok_or_else(|| PruneError::Option(format!("unknown projection {short}")))?;
            let (rows, cols) = (lin.rows(), lin.cols());
            let weights: Vec<f32> = lin
                .format()
                .decode()
                .data()
                .iter()
                .map(|v| v.to_f32())
                .collect();
            let pruned_weights = match options.method {
                Method::Magnitude => {
                    prune_magnitude(&weights, rows, cols, pattern, options.sp)?.weights
                }
                Method::Wanda => {
                    let norms = stats.norms.get(&site).ok_or(PruneError::NoCalibration(
                        "no activations reached a Wanda site",
                    ))?;
                    prune_wanda(&weights, rows, cols, norms, pattern, options.sp)?.weights
                }
                Method::SparseGpt => {
                    let h = prepared.get(&site).ok_or(PruneError::NoCalibration(
                        "no activations reached a SparseGPT site",
                    ))?;
                    h.prune(
                        &weights,
                        rows,
                        cols,
                        pattern,
                        options.sp,
                        &options.sparsegpt,
                    )?
                    .weights
                }
            };
            let matrix = DenseMatrix::from_f32(rows, cols, &pruned_weights)?;
            // The mask of what is stored: an f16 underflow after SparseGPT's update also
            // counts as a zero the kernels skip.
            let keep: Vec<bool> = matrix
                .data()
                .iter()
                .map(|v| !sieve_formats::matrix::is_zero(*v))
                .collect();
            let format = encode_choice(&matrix, options.format, options.dp)?;
            // The recompute pass runs the values the format stores (decode is exact, and for
            // quantized payloads it is what the kernels multiply by) through the fast dense
            // GEMM: the formats' own batched products are reference loops, far too slow for
            // thousands of calibration tokens. The format goes in after the pass.
            lin.replace_format(Box::new(FastDense::new(format.decode())))?;
            encoded.push(format);
            masks.push((
                format!("model.layers.{l}.{short}.weight"),
                site,
                Mask::new(rows, cols, keep)?,
            ));
            done += 1;
            on_progress(Progress {
                done,
                total: total_units,
                layer: l,
                stage: "prune",
            });
        }
        drop(prepared);
        drop(stats);

        lap(&mut stages.prune);

        // 3. Recompute the layer's outputs with the pruned weights.
        let mut histograms: HashMap<Site, ActivationHistogram> = HashMap::new();
        let mut kept: HashMap<Site, (Vec<f32>, usize)> = HashMap::new();
        // Magnitude pruning without thresholds reads no activations: the pass would only feed
        // the dual-sparsity report, which without a threshold depends on the mask alone.
        let needs_activations = options.method.needs_calibration() || options.dp > 0.0;
        let recompute = if needs_activations { windows.len() } else { 0 };
        done += (windows.len() - recompute) as u64;
        for (w, h) in windows.iter().zip(hidden.iter_mut()).take(recompute) {
            let mut failure = None;
            let want_hist = options.dp > 0.0;
            let report_tokens = options.report_tokens;
            model.forward_layer(l, h, w.len(), &mut |site, a, n| {
                if want_hist {
                    if let Err(e) = histograms.entry(site).or_default().add(a) {
                        failure.get_or_insert(e);
                    }
                }
                let k = a.len() / n.max(1);
                let entry = kept.entry(site).or_insert_with(|| (Vec::new(), 0));
                let room = report_tokens.saturating_sub(entry.1).min(n);
                entry.0.extend_from_slice(&a[..room * k]);
                entry.1 += room;
            })?;
            if let Some(e) = failure {
                return Err(e);
            }
            done += 1;
            on_progress(Progress {
                done,
                total: total_units,
                layer: l,
                stage: "recompute",
            });
        }

        lap(&mut stages.recompute);

        // 4. Thresholds and the dual-sparsity report.
        let mut thresholds: HashMap<Site, (Option<f32>, f64)> = HashMap::new();
        for site in Site::ALL {
            let t = match histograms.get(&site) {
                Some(hist) if options.dp > 0.0 => {
                    let t = hist.threshold_for(options.dp)?;
                    (t.threshold, t.achieved)
                }
                _ => (None, 0.0),
            };
            thresholds.insert(site, t);
        }
        let layer = &mut model.layers_mut()[l];
        for (((short, lin), (name, site, mask)), format) in
            layer.linears_mut().into_iter().zip(masks).zip(encoded)
        {
            debug_assert_eq!(Site::of_linear(short), Some(site));
            lin.replace_format(format)?;
            let (threshold, calib_dp) = thresholds.get(&site).copied().unwrap_or((None, 0.0));
            lin.set_threshold(threshold)?;
            let (acts, n) = kept
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
                bytes_per_token: bytes_per_token(lin.format().kind(), storage, options.dp),
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
        calibration_tokens,
        seconds: start.elapsed().as_secs_f64(),
        stage_seconds: stages,
        linears: reports,
    })
}

/// Tokenizes `text` and cuts `count` non-overlapping windows of `len` tokens spread evenly over
/// it ([`crate::calib::Placement::Spread`]).
pub fn calibration_windows_from_text(
    tokenizer: &sieve_model::tokenizer::Tokenizer,
    text: &str,
    count: usize,
    len: usize,
) -> Result<Vec<Vec<u32>>> {
    let tokens = tokenizer
        .encode(text, false)
        .map_err(|e| PruneError::Option(format!("tokenizing the calibration text: {e}")))?;
    Ok(
        crate::calib::calibration_windows(&tokens, count, len, crate::calib::Placement::Spread)?
            .into_iter()
            .map(<[u32]>::to_vec)
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use sieve_formats::random::SplitMix64;
    use sieve_model::config::ModelConfig;
    use sieve_model::llama::Logits;
    use sieve_model::packfile::{PackFile, PackWriter};
    use sieve_model::weights::{Tensor, TensorSource};

    struct RandomSource {
        config: ModelConfig,
        tensors: HashMap<String, Tensor>,
    }

    impl TensorSource for RandomSource {
        fn config(&self) -> &ModelConfig {
            &self.config
        }
        fn tensor_names(&self) -> Vec<String> {
            self.tensors.keys().cloned().collect()
        }
        fn contains(&self, name: &str) -> bool {
            self.tensors.contains_key(name)
        }
        fn tensor(&self, name: &str) -> sieve_model::Result<Tensor> {
            self.tensors
                .get(name)
                .cloned()
                .ok_or_else(|| sieve_model::ModelError::MissingTensor(name.into()))
        }
    }

    fn config() -> ModelConfig {
        ModelConfig {
            architecture: "llama".into(),
            vocab_size: 50,
            hidden_size: 32,
            intermediate_size: 64,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            max_position_embeddings: 128,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            attention_bias: false,
            tie_word_embeddings: true,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
        }
    }

    fn source() -> RandomSource {
        let c = config();
        let mut rng = SplitMix64::new(7);
        let mut tensors = HashMap::new();
        let mut put = |name: String, shape: Vec<usize>, norm: bool| {
            let n: usize = shape.iter().product();
            let data = (0..n)
                .map(|_| {
                    let v = rng.normal() as f32;
                    if norm {
                        1.0 + 0.1 * v
                    } else {
                        0.2 * v
                    }
                })
                .collect();
            tensors.insert(name, Tensor { shape, data });
        };
        let (d, i, q, kv) = (c.hidden_size, c.intermediate_size, 32, 16);
        put(
            "model.embed_tokens.weight".into(),
            vec![c.vocab_size, d],
            false,
        );
        put("model.norm.weight".into(), vec![d], true);
        for l in 0..c.num_layers {
            let p = format!("model.layers.{l}");
            put(format!("{p}.input_layernorm.weight"), vec![d], true);
            put(
                format!("{p}.post_attention_layernorm.weight"),
                vec![d],
                true,
            );
            put(format!("{p}.self_attn.q_proj.weight"), vec![q, d], false);
            put(format!("{p}.self_attn.k_proj.weight"), vec![kv, d], false);
            put(format!("{p}.self_attn.v_proj.weight"), vec![kv, d], false);
            put(format!("{p}.self_attn.o_proj.weight"), vec![d, q], false);
            put(format!("{p}.mlp.gate_proj.weight"), vec![i, d], false);
            put(format!("{p}.mlp.up_proj.weight"), vec![i, d], false);
            put(format!("{p}.mlp.down_proj.weight"), vec![d, i], false);
        }
        RandomSource { config: c, tensors }
    }

    fn windows() -> Vec<Vec<u32>> {
        let mut rng = SplitMix64::new(3);
        (0..3)
            .map(|_| (0..40).map(|_| rng.below(50) as u32).collect())
            .collect()
    }

    fn options(method: Method, pattern: &str, sp: f64, dp: f64, format: &str) -> PipelineOptions {
        PipelineOptions {
            method,
            pattern: pattern.parse().unwrap(),
            sp,
            dp,
            format: format.parse().unwrap(),
            sparsegpt: SparseGptOptions::default(),
            report_tokens: 64,
        }
    }

    fn zero_fraction_per_row(lin: &sieve_model::linear::Linear) -> Vec<f64> {
        let m = lin.format().decode();
        (0..m.rows())
            .map(|r| {
                m.row(r)
                    .iter()
                    .filter(|v| sieve_formats::matrix::is_zero(**v))
                    .count() as f64
                    / m.cols() as f64
            })
            .collect()
    }

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

    /// Magnitude without thresholds skips the recompute pass; its report still gives the
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
        assert!("bogus".parse::<FormatChoice>().is_err());
    }
}
