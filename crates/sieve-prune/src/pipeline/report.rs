//! What a pack run reports: per linear a [`LinearReport`] (format, sparsities, thresholds, bytes,
//! the dual-sparsity overlap), for the whole model a [`PipelineReport`] with its summary tables
//! (what `sieve pack` prints and writes as JSON), and the bytes-per-token model below.
//!
//! The reports also give each linear's bytes per decoded token, the memory-bound model of the
//! papers, with bytes per token =
//! * `total_bytes · (1 - dp)` for column-major formats that skip the weight columns of
//!   inactive inputs (RLC-CSC, Tiled-CBC): an inactive input costs neither its values nor its
//!   column metadata;
//! * `total_bytes` for row/tile-major formats that read every stored byte whatever the input
//!   (dense, IE-BME, Slide).
//!
//! This ignores index arithmetic and caches; it is the memory-bound decode model of the papers.

use crate::dual::DualSparsityReport;
use serde::Serialize;
use sieve_formats::{FormatKind, Storage};

/// Bytes a decode step moves for this weight at activation sparsity `dp` (module docs).
pub fn bytes_per_token(kind: FormatKind, storage: Storage, dp: f64) -> f64 {
    let total = storage.total_bytes() as f64;
    match kind {
        FormatKind::RlcCsc | FormatKind::TiledCbc | FormatKind::BalancedCbc => total * (1.0 - dp),
        FormatKind::Dense | FormatKind::IeBme | FormatKind::Slide => total,
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
    /// The measured time of its CPU product (`--format auto`).
    pub product_seconds: Option<f64>,
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
    /// Under `--format auto`, the sum of the chosen formats' measured products: the predicted
    /// time of a decode step's projections (LM head and attention not included).
    pub product_seconds: Option<f64>,
    /// Threads the products (and every other step) ran on.
    pub threads: usize,
    pub calibration_tokens: usize,
    pub seconds: f64,
    /// Where the time went, summed over layers.
    pub stage_seconds: StageSeconds,
}

/// Wall-clock seconds per pipeline stage (the `pipeline` module docs), summed over layers.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct StageSeconds {
    /// Embedding the windows.
    pub embed: f64,
    /// The layer's own computation over every window (norms, projections, attention, SwiGLU).
    pub forward: f64,
    /// Accumulating what the method and TEAL read from each site's inputs: Wanda's column
    /// norms or SparseGPT's `XᵀX`, `|x|` histograms, kept report rows.
    pub statistics: f64,
    /// Factorising Hessians, pruning, encoding.
    pub prune: f64,
    /// TEAL's greedy allocation (layer runs with trial thresholds).
    pub allocation: f64,
    /// Thresholds and the dual-sparsity report.
    pub report: f64,
}

impl PipelineReport {
    /// A human-readable summary table (per decoder-layer totals would be too long for 30 layers,
    /// so one line per projection kind plus the whole model).
    /// One line per layer under `--format auto`: each projection's chosen format and the
    /// measured time of its product (empty when the formats were not measured).
    pub fn measured_choices(&self) -> String {
        let mut out = String::new();
        let mut layer: Option<&str> = None;
        for l in &self.linears {
            let Some(t) = l.product_seconds else { continue };
            let (prefix, short) = match l.name.strip_prefix("model.layers.") {
                Some(rest) => rest.split_once('.').unwrap_or((rest, "")),
                None => (l.name.as_str(), ""),
            };
            if layer != Some(prefix) {
                if layer.is_some() {
                    out.push('\n');
                }
                out.push_str(&format!("layer {prefix:>3}:"));
                layer = Some(prefix);
            }
            let short = short.trim_end_matches(".weight");
            let short = short.rsplit('.').next().unwrap_or(short);
            out.push_str(&format!(" {short} {} {:.0}us", l.format.name(), t * 1e6));
        }
        if layer.is_some() {
            out.push('\n');
        }
        out
    }

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
            "stages: embed {:.1} s, forward {:.1} s, statistics {:.1} s, prune {:.1} s, allocation {:.1} s, report {:.1} s\n",
            t.embed, t.forward, t.statistics, t.prune, t.allocation, t.report
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
pub(super) fn aggregate<'a>(
    rows: impl Iterator<Item = &'a LinearReport>,
) -> (f64, f64, f64, f64, f64) {
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
