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
//! # Format choice (`--format auto`)
//!
//! Each linear is encoded in every format that accepts it, and the one whose CPU product (the
//! kernel a loaded pack runs: `sieve_cpu::format_from_blob`) is fastest on this
//! machine is kept: a short calibration times one matrix-vector product of each candidate,
//! best of [`PRODUCT_REPS`], with the matrix pushed out of the caches first (decode streams
//! weights from memory), on the pack's threads, against a synthetic input whose fraction `dp`
//! of entries falls under the threshold. The sum of the chosen products is the pack's
//! predicted decode time in its projections ([`PipelineReport::product_seconds`]).
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

use crate::dual::{dual_sparsity, DualSparsityReport};
use crate::error::{check_ratio, PruneError, Result};
use crate::mask::Mask;
use crate::methods::{prune_magnitude, prune_wanda, ColumnNorms, Method};
use crate::pattern::Pattern;
use crate::sparsegpt::{HessianAccumulator, PreparedHessian, RowGrid, SparseGptOptions, SweepGrid};
use crate::teal::ActivationHistogram;
use half::f16;
use rayon::prelude::*;
use serde::Serialize;
use sieve_cpu::dense::FastDense;
use sieve_formats::value_grid::{Grid, INT4, INT8};
use sieve_formats::{DenseMatrix, FormatKind, Storage, WeightFormat};
use sieve_model::llama::{Model, Site};
use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

impl From<sieve_model::ModelError> for PruneError {
    fn from(e: sieve_model::ModelError) -> Self {
        PruneError::Model(e.with_causes())
    }
}

/// The format every pruned linear is stored in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FormatChoice {
    Fixed(FormatKind),
    /// Per linear, the format with the fastest measured CPU product (module docs).
    Auto,
}

impl FromStr for FormatChoice {
    type Err = PruneError;
    fn from_str(s: &str) -> Result<Self> {
        if s.trim().eq_ignore_ascii_case("auto") {
            return Ok(Self::Auto);
        }
        let names: Vec<&str> = FormatKind::ALL.iter().map(|k| k.name()).collect();
        FormatKind::from_name(s.trim())
            .map(Self::Fixed)
            .map_err(|_| {
                PruneError::Option(format!(
                    "unknown format '{}' (known: auto, {})",
                    s.trim(),
                    names.join(", ")
                ))
            })
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

/// What each kept weight is snapped to before it is stored (`sieve pack --values`).
/// Serialized (in reports) as its `Display` string: `f16`, `int8`, `int4:G`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ValueGrid {
    /// The f16 the pruning method produced.
    #[default]
    F16,
    /// Each output row on a symmetric int8 grid (`sieve_formats::value_grid::INT8`; SparseGPT
    /// rounds in its sweep and compensates each rounding error, magnitude and Wanda snap the
    /// pruned rows), still stored as f16: the CPU product of Balanced-CBC then keeps 8-bit
    /// records (`sieve_cpu::balanced_cbc`). Only with `--format balanced-cbc`.
    Int8,
    /// Each row's groups of `group` consecutive input columns (`0..G`, `G..2G`, ...; GPTQ's
    /// groups) on a symmetric 4-bit grid with an f16 scale (`sieve_formats::value_grid::INT4`;
    /// SparseGPT picks each group's scale when its sweep reaches the group and compensates
    /// each rounding error, magnitude and Wanda snap the pruned groups), still stored as f16
    /// for a CPU product with 4-bit records. `group` is one of [`INT4_GROUPS`]. Only with
    /// `--format balanced-cbc`.
    Int4 { group: usize },
}

/// The int4 group widths `--values int4:G` takes: they divide SparseGPT's default block of 128
/// columns (a group must not straddle two blocks of its sweep).
pub const INT4_GROUPS: [usize; 3] = [32, 64, 128];

/// The int4 group width of a plain `--values int4`.
pub const DEFAULT_INT4_GROUP: usize = 64;

const KNOWN_VALUES: &str = "f16, int8, int4, int4:32, int4:64, int4:128";

impl ValueGrid {
    /// The grid and the width of the runs that share one scale (a whole row of `cols` for
    /// int8, a group for int4); `None` for f16.
    fn runs(self, cols: usize) -> Option<(Grid, usize)> {
        match self {
            Self::F16 => None,
            Self::Int8 => Some((INT8, cols.max(1))),
            Self::Int4 { group } => Some((INT4, group.max(1))),
        }
    }
}

impl FromStr for ValueGrid {
    type Err = PruneError;
    fn from_str(s: &str) -> Result<Self> {
        let name = s.trim().to_ascii_lowercase();
        match name.as_str() {
            "f16" => return Ok(Self::F16),
            "int8" => return Ok(Self::Int8),
            "int4" => {
                return Ok(Self::Int4 {
                    group: DEFAULT_INT4_GROUP,
                })
            }
            _ => {}
        }
        let group = name
            .strip_prefix("int4:")
            .and_then(|g| g.parse::<usize>().ok())
            .filter(|g| INT4_GROUPS.contains(g));
        match group {
            Some(group) => Ok(Self::Int4 { group }),
            None => Err(PruneError::Option(format!(
                "unknown --values '{name}' (known: {KNOWN_VALUES})"
            ))),
        }
    }
}

impl fmt::Display for ValueGrid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::F16 => f.write_str("f16"),
            Self::Int8 => f.write_str("int8"),
            // The group always shows, also for the default: reports say which one was used.
            Self::Int4 { group } => write!(f, "int4:{group}"),
        }
    }
}

impl Serialize for ValueGrid {
    fn serialize<S: serde::Serializer>(
        &self,
        serializer: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// Refuses a value grid the format cannot use: int8 and int4 grids pay only with the 8-bit and
/// 4-bit records of Balanced-CBC on the CPU, so `--values int8|int4` needs `--format
/// balanced-cbc` (not `auto`, whose candidates would carry the rounding error without the
/// narrow product). An int4 group outside [`INT4_GROUPS`] (set in code, not parsed) is refused
/// too.
pub fn check_values_for_format(values: ValueGrid, format: FormatChoice) -> Result<()> {
    if let ValueGrid::Int4 { group } = values {
        if !INT4_GROUPS.contains(&group) {
            return Err(PruneError::Option(format!(
                "--values int4:{group}: unknown group width (known: {KNOWN_VALUES})"
            )));
        }
    }
    match (values, format) {
        (ValueGrid::F16, _) | (_, FormatChoice::Fixed(FormatKind::BalancedCbc)) => Ok(()),
        (ValueGrid::Int8 | ValueGrid::Int4 { .. }, other) => {
            let (name, bits) = match values {
                ValueGrid::Int4 { .. } => ("int4", 4),
                _ => ("int8", 8),
            };
            Err(PruneError::Option(format!(
                "--values {name} needs --format {BALANCED_FORMAT_NAME} (got --format {other}): \
                 only its CPU product keeps {bits}-bit values"
            )))
        }
    }
}

/// Snaps the `rows x cols` row-major `weights` onto `grid`, one scale per run of `run`
/// consecutive columns of a row (the last run of a row may be shorter; `run >= cols` puts
/// each whole row on one scale); a weight that is not finite is refused (it is on no grid),
/// with its index in `weights`.
fn snap_runs(weights: &mut [f32], cols: usize, grid: Grid, run: usize) -> Result<()> {
    for (r, row) in weights.chunks_mut(cols.max(1)).enumerate() {
        for (g, chunk) in row.chunks_mut(run.max(1)).enumerate() {
            if grid.snap_row(chunk).is_none() {
                let (c, value) = chunk
                    .iter()
                    .copied()
                    .enumerate()
                    .find(|(_, v)| !v.is_finite())
                    .unwrap_or((0, f32::NAN));
                return Err(PruneError::NonFinite {
                    what: "pruned weights snapped to value grids",
                    index: r * cols + g * run + c,
                    value,
                });
            }
        }
    }
    Ok(())
}

/// The int8 grid scale of every row of `weights` (`sieve_formats::value_grid::snap_scale` of
/// its largest magnitude); a weight that is not finite is refused, with its index.
fn int8_scales(weights: &[f32], cols: usize) -> Result<Vec<f32>> {
    weights
        .chunks(cols.max(1))
        .enumerate()
        .map(|(r, row)| {
            let max = row.iter().fold(0f32, |a, v| a.max(v.abs()));
            match row.iter().position(|v| !v.is_finite()) {
                Some(c) => Err(PruneError::NonFinite {
                    what: "weights to put on int8 grids",
                    index: r * cols + c,
                    value: row[c],
                }),
                None => sieve_formats::value_grid::snap_scale(max).ok_or(PruneError::NonFinite {
                    what: "weights to put on int8 grids",
                    index: r * cols,
                    value: max,
                }),
            }
        })
        .collect()
}

/// Name of the GPU format that stores balanced N:16 masks (`balanced-cbc`). It is matched by
/// name so that [`pattern_for_format`] and [`check_pattern_for_format`] already apply to it
/// wherever the format is known by that name.
pub const BALANCED_FORMAT_NAME: &str = "balanced-cbc";

fn is_balanced_format(format: &str) -> bool {
    format.trim().eq_ignore_ascii_case(BALANCED_FORMAT_NAME)
}

/// The pattern `sieve pack` prunes with, from `--pattern` (`None` when not given), `--sp` and
/// the `--format` name:
/// * `--format balanced-cbc`: balanced N:16 with `N` from `sp` by default (and for bare
///   `balanced`); an explicit pattern must be `balanced:N:16` ([`check_pattern_for_format`]);
/// * any other format: unstructured by default, else the pattern as parsed by
///   [`Pattern::parse_with_sp`] (bare `balanced` is N:16 with `N` from `sp`).
pub fn pattern_for_format(pattern: Option<&str>, sp: f64, format: &str) -> Result<Pattern> {
    let chosen = match pattern {
        Some(p) => Pattern::parse_with_sp(p, sp)?,
        None if is_balanced_format(format) => Pattern::balanced_for_sp(sp)?,
        None => Pattern::Unstructured,
    };
    check_pattern_for_format(chosen, format)?;
    Ok(chosen)
}

/// Refuses a pattern the named format cannot store, before any pruning: `balanced-cbc` needs
/// `balanced:N:16` (groups of [`crate::pattern::BALANCED_GROUP`] outputs); `slide` needs a mask
/// with at most 6 nonzeros in every aligned 8 inputs of a row (6:8, or an N:M whose groups tile
/// 8 inputs within that, e.g. 2:4); every other format stores any mask.
pub fn check_pattern_for_format(pattern: Pattern, format: &str) -> Result<()> {
    if format.trim().eq_ignore_ascii_case("slide") {
        let block = 2 * sieve_formats::slide::SlideOptions::default().n;
        let kept = block - 2;
        return match pattern.validate()? {
            Pattern::NM { n, m } if block % m == 0 && n * (block / m) <= kept => Ok(()),
            other => Err(PruneError::Option(format!(
                "--format slide stores {kept}:{block} masks (at most {kept} nonzeros in every \
                 {block} consecutive inputs of a row), which {other} does not guarantee: use \
                 --pattern {kept}:{block} (or 2:4)"
            ))),
        };
    }
    if !is_balanced_format(format) {
        return Ok(());
    }
    let group = crate::pattern::BALANCED_GROUP;
    match pattern.validate()? {
        Pattern::Balanced { m, .. } if m == group => Ok(()),
        other => Err(PruneError::Option(format!(
            "--format {BALANCED_FORMAT_NAME} stores balanced N:{group} masks (at most N nonzeros in \
             every {group} consecutive outputs of an input column), not {other}: use --pattern \
             balanced (N from --sp) or balanced:N:{group}, or leave --pattern out"
        ))),
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
    /// How `dp` is spread over each layer's input sites.
    pub teal_allocation: TealAllocation,
    /// What the kept weights are snapped to (int8 and int4 grids only with Balanced-CBC).
    pub values: ValueGrid,
}

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

/// Bytes a decode step moves for this weight at activation sparsity `dp` (module docs).
pub fn bytes_per_token(kind: FormatKind, storage: Storage, dp: f64) -> f64 {
    let total = storage.total_bytes() as f64;
    match kind {
        FormatKind::RlcCsc | FormatKind::TiledCbc | FormatKind::BalancedCbc => total * (1.0 - dp),
        FormatKind::Dense | FormatKind::IeBme | FormatKind::Slide => total,
    }
}

/// Timed products per candidate under `--format auto` (the best one counts).
pub const PRODUCT_REPS: usize = 3;

/// Bytes read between timed products to push the matrix out of every cache level (twice the
/// 32 MiB L3 of the machine this was tuned on).
const EVICT_BYTES: usize = 64 << 20;

/// A linear in its chosen format, with the measured time of its CPU product when the choice
/// was measured (`--format auto`).
pub struct Encoded {
    pub format: Box<dyn WeightFormat>,
    pub product_seconds: Option<f64>,
}

/// Reads a buffer larger than the caches, so that the next product finds its matrix in memory.
fn evict_caches() {
    static BUFFER: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let buf = BUFFER.get_or_init(|| vec![1u8; EVICT_BYTES]);
    let mut sum = 0u8;
    for line in buf.chunks(64) {
        sum = sum.wrapping_add(line[0]);
    }
    std::hint::black_box(sum);
}

/// A deterministic input of `cols` values spread like a normed hidden state (a sum of three
/// uniforms), and the threshold under which a fraction `dp` of them falls (none for `dp` 0).
fn timing_input(cols: usize, dp: f64) -> (Vec<f32>, Option<f32>) {
    let mut s = 0x5eed_u64;
    let mut unit = || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let x: Vec<f32> = (0..cols).map(|_| unit() + unit() + unit()).collect();
    if dp <= 0.0 {
        return (x, None);
    }
    let mut mags: Vec<f32> = x.iter().map(|v| v.abs()).collect();
    mags.sort_by(f32::total_cmp);
    let k = ((dp * cols as f64).round() as usize).clamp(1, cols);
    (x, Some(mags[k - 1]))
}

/// The cold-cache time of one matrix-vector product of `format`'s CPU kernel (best of
/// [`PRODUCT_REPS`], after one untimed run).
pub fn time_cpu_product(format: &dyn WeightFormat, dp: f64) -> Result<f64> {
    let fast = sieve_cpu::format_from_blob(&format.to_bytes())?;
    let (x, threshold) = timing_input(fast.cols(), dp);
    let mut y = vec![0f32; fast.rows()];
    fast.matvec(&x, threshold, &mut y)?;
    let mut best = f64::MAX;
    for _ in 0..PRODUCT_REPS {
        evict_caches();
        let start = std::time::Instant::now();
        fast.matvec(&x, threshold, &mut y)?;
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Encodes `w` in the chosen format (for `Auto`, the one of those that accept it whose CPU
/// product measures fastest; `dp` is the target fraction of inactive inputs).
pub fn encode_choice(w: &DenseMatrix, choice: FormatChoice, dp: f64) -> Result<Encoded> {
    match choice {
        FormatChoice::Fixed(kind) => Ok(Encoded {
            format: sieve_formats::registry::encode_default(kind, w)?,
            product_seconds: None,
        }),
        FormatChoice::Auto => {
            let candidates: Vec<Box<dyn WeightFormat>> = FormatKind::ALL
                .par_iter()
                .filter_map(|&k| match k {
                    // Balanced-CBC stores N slots of every 16 rows, N = the fullest group: on a
                    // matrix not pruned to the balanced pattern N is 16, more bytes than dense
                    // f16, and timing it would only cost pack time.
                    FormatKind::BalancedCbc => {
                        let b = sieve_formats::balanced_cbc::BalancedCbc::encode(w).ok()?;
                        (b.slots() < sieve_formats::balanced_cbc::MAX_SLOTS)
                            .then(|| Box::new(b) as Box<dyn WeightFormat>)
                    }
                    _ => sieve_formats::registry::encode_default(k, w).ok(),
                })
                .collect();
            // One at a time: the products must not share the machine with each other.
            let mut best: Option<Encoded> = None;
            for format in candidates {
                let t = time_cpu_product(format.as_ref(), dp)?;
                if best.as_ref().is_none_or(|b| b.product_seconds > Some(t)) {
                    best = Some(Encoded {
                        format,
                        product_seconds: Some(t),
                    });
                }
            }
            best.ok_or_else(|| PruneError::Option("no format accepts this matrix".into()))
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

/// Wall-clock seconds per pipeline stage (module docs), summed over layers.
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
    let c = model.config();
    let (d, att_width, inter) = (c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size);
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
            // 1. q/k/v: their input is the normed residual stream.
            let mut xn = Vec::new();
            for (w, x) in windows.iter().zip(&hidden) {
                let n = w.len();
                xn.resize(n * d, 0.0);
                model.attention_input(l, x, n, &mut xn)?;
                pass.observe(Site::AttnIn, &xn, n)?;
                step_done(&mut done, "attention input", 1);
            }
            lap(&mut forward_seconds);
            let pruned = pass.prune_site(model, Site::AttnIn)?;
            step_done(&mut done, "prune", pruned);
            lap(&mut prune_seconds);

            // 2. o_proj: attention with the pruned q/k/v; kept for every window.
            let mut mixed: Vec<Vec<f32>> = Vec::with_capacity(windows.len());
            for (w, x) in windows.iter().zip(&hidden) {
                let n = w.len();
                xn.resize(n * d, 0.0);
                model.attention_input(l, x, n, &mut xn)?;
                let mut att = vec![0f32; n * att_width];
                model.attention_mix(l, &xn, n, &mut att)?;
                pass.observe(Site::OProjIn, &att, n)?;
                mixed.push(att);
                step_done(&mut done, "attention", 1);
            }
            lap(&mut forward_seconds);
            let pruned = pass.prune_site(model, Site::OProjIn)?;
            step_done(&mut done, "prune", pruned);
            lap(&mut prune_seconds);

            // 3. gate/up: the residual stream after the pruned o_proj.
            let mut proj = Vec::new();
            for ((w, x), att) in windows.iter().zip(hidden.iter_mut()).zip(&mut mixed) {
                let n = w.len();
                proj.resize(n * d, 0.0);
                model.layers()[l].o_proj.forward(att, n, &mut proj)?;
                *att = Vec::new();
                x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);
                xn.resize(n * d, 0.0);
                model.mlp_input(l, x, n, &mut xn)?;
                pass.observe(Site::MlpIn, &xn, n)?;
                step_done(&mut done, "o_proj", 1);
            }
            lap(&mut forward_seconds);
            let pruned = pass.prune_site(model, Site::MlpIn)?;
            step_done(&mut done, "prune", pruned);
            lap(&mut prune_seconds);

            // 4. down_proj: SwiGLU of the pruned gate/up; kept for every window.
            mixed.clear();
            for (w, x) in windows.iter().zip(&hidden) {
                let n = w.len();
                xn.resize(n * d, 0.0);
                model.mlp_input(l, x, n, &mut xn)?;
                let mut h = vec![0f32; n * inter];
                model.mlp_mix(l, &xn, n, &mut h)?;
                pass.observe(Site::DownProjIn, &h, n)?;
                mixed.push(h);
                step_done(&mut done, "mlp", 1);
            }
            lap(&mut forward_seconds);
            let pruned = pass.prune_site(model, Site::DownProjIn)?;
            step_done(&mut done, "prune", pruned);
            lap(&mut prune_seconds);

            // 5. The layer's output with the pruned down_proj: the next layer's input.
            for ((w, x), h) in windows.iter().zip(hidden.iter_mut()).zip(&mut mixed) {
                let n = w.len();
                proj.resize(n * d, 0.0);
                model.layers()[l].down_proj.forward(h, n, &mut proj)?;
                *h = Vec::new();
                x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);
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

/// Per site (in [`Site::ALL`] order), the dynamic sparsity TEAL's greedy allocation gives
/// layer `l` for the layer-level target `dp` ([`TealAllocation::Greedy`]); `input` is the
/// layer's input for a prefix of one window. Leaves the layer's thresholds unset.
fn greedy_site_targets(
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

/// Refuses calibration windows the model cannot run as trained: `len` tokens past its context
/// (positions it never saw), or no window at all. Checked before the text is read.
pub fn check_calibration(
    config: &sieve_model::config::ModelConfig,
    count: usize,
    len: usize,
) -> Result<()> {
    if count == 0 || len == 0 {
        return Err(PruneError::Option(format!(
            "calibration needs at least one window of at least one token (got {count} windows of {len})"
        )));
    }
    let context = config.max_position_embeddings;
    if len > context {
        return Err(PruneError::Option(format!(
            "calibration windows of {len} tokens are longer than the model's context of {context} \
             positions; use --calib-len {context} or less"
        )));
    }
    Ok(())
}

/// Calibration text tokenized per needed token at most: [`calibration_windows_from_file`]
/// spreads the windows over the first `16 x count x len` tokens of the file (all of it for the
/// WikiText-2 validation split at the default 32 x 1024), so a huge file costs no more.
pub const CALIB_TOKENS_PER_NEEDED: usize = 16;

/// [`calibration_windows_from_text`] on a file read in bounded chunks
/// ([`sieve_model::tokenizer::Tokenizer::encode_file`]), tokenizing at most
/// [`CALIB_TOKENS_PER_NEEDED`] x `count` x `len` tokens. Returns the windows and the number of
/// tokens they were spread over.
pub fn calibration_windows_from_file(
    tokenizer: &sieve_model::tokenizer::Tokenizer,
    path: &std::path::Path,
    count: usize,
    len: usize,
) -> Result<(Vec<Vec<u32>>, usize)> {
    let needed = count.saturating_mul(len);
    let tokens = tokenizer
        .encode_file(
            path,
            false,
            Some(needed.saturating_mul(CALIB_TOKENS_PER_NEEDED)),
        )
        .map_err(|e| {
            PruneError::Option(format!(
                "tokenizing the calibration text: {}",
                e.with_causes()
            ))
        })?;
    let windows =
        crate::calib::calibration_windows(&tokens, count, len, crate::calib::Placement::Spread)?
            .into_iter()
            .map(<[u32]>::to_vec)
            .collect();
    Ok((windows, tokens.len()))
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
            teal_allocation: TealAllocation::Uniform,
            values: ValueGrid::F16,
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

    /// `--values int8`: every stored row of every packed linear lies on an int8 grid, so the CPU
    /// product of the loaded pack keeps 8-bit records; the weights move by at most half a grid
    /// step from the f16 pack's (magnitude pruning: the same kept weights).
    #[test]
    fn int8_values_put_every_row_on_its_grid() {
        use sieve_cpu::balanced_cbc::{FastBalancedCbc, Values};
        use sieve_formats::balanced_cbc::BalancedCbc;
        let src = source();
        for method in [Method::Magnitude, Method::SparseGpt] {
            let base = options(method, "balanced:8:16", 0.5, 0.0, "balanced-cbc");
            let mut f16_model = Model::from_source(&src).unwrap();
            prune_model(&mut f16_model, &windows(), &base, &mut |_| {}).unwrap();
            let mut model = Model::from_source(&src).unwrap();
            let opts = PipelineOptions {
                values: ValueGrid::Int8,
                ..base
            };
            prune_model(&mut model, &windows(), &opts, &mut |_| {}).unwrap();
            let mut moved = 0;
            for (layer, f16_layer) in model.layers().iter().zip(f16_model.layers()) {
                for ((name, lin), (_, f16_lin)) in
                    layer.linears().into_iter().zip(f16_layer.linears())
                {
                    assert_eq!(lin.format().kind(), FormatKind::BalancedCbc, "{name}");
                    let m = lin.format().decode();
                    let balanced = BalancedCbc::encode_with_slots(&m, 8).unwrap();
                    let fast = FastBalancedCbc::with_int8(&balanced)
                        .unwrap_or_else(|| panic!("{method} {name}: a row off its int8 grid"));
                    assert_eq!(fast.values(), Values::Int8);
                    if method != Method::Magnitude {
                        continue;
                    }
                    let f = f16_lin.format().decode();
                    for r in 0..m.rows() {
                        let max = f.row(r).iter().fold(0f32, |a, v| a.max(v.to_f32().abs()));
                        for (a, b) in m.row(r).iter().zip(f.row(r)) {
                            let d = (a.to_f32() - b.to_f32()).abs();
                            // Half a step of at most max / 113, and f16 rounding.
                            assert!(d <= max / 220.0, "{name} row {r}: {a} vs {b}");
                            moved += usize::from(d > 0.0);
                        }
                    }
                }
            }
            if method == Method::Magnitude {
                assert!(moved > 0, "int8 snapping changed no weight");
            }
        }
    }

    #[test]
    fn int8_values_are_refused_for_other_formats() {
        let src = source();
        let mut model = Model::from_source(&src).unwrap();
        for format in ["dense", "tiled-cbc", "auto"] {
            let opts = PipelineOptions {
                values: ValueGrid::Int8,
                ..options(Method::Magnitude, "unstructured", 0.5, 0.0, format)
            };
            let err = prune_model(&mut model, &windows(), &opts, &mut |_| {})
                .err()
                .unwrap_or_else(|| panic!("--values int8 with --format {format} was accepted"))
                .to_string();
            assert!(err.contains("balanced-cbc"), "{format}: {err}");
        }
        assert_eq!("INT8".parse::<ValueGrid>().unwrap(), ValueGrid::Int8);
        assert_eq!("f16".parse::<ValueGrid>().unwrap(), ValueGrid::F16);
    }

    /// `--values int4[:G]`: the stored values of every (row, group of 64 columns) of every
    /// packed Balanced-CBC linear lie on one INT4 grid (detected from the f16 values alone, as
    /// the CPU loader does, and rebuilt exactly as `q · s`), for the three methods. The
    /// magnitude pack keeps the f16 pack's weights up to half a step of their group's grid;
    /// the f16 pack itself is off INT4 grids (the check has teeth). The linears have 32 or 64
    /// input columns: one group per row, partial for 32.
    #[test]
    fn int4_values_put_every_group_on_its_grid() {
        use sieve_formats::value_grid::INT4;
        const G: usize = 64;
        // The stored (nonzero) f16 values of row r, columns c0..c1, and whether they lie on one
        // INT4 grid; panics when an index does not rebuild its value.
        fn on_grid(m: &DenseMatrix, r: usize, c0: usize, c1: usize) -> bool {
            let stored: Vec<f16> = m.row(r)[c0..c1]
                .iter()
                .copied()
                .filter(|v| !sieve_formats::matrix::is_zero(*v))
                .collect();
            let mut q = vec![0i8; stored.len()];
            let Some(s) = INT4.detect(&stored, &mut q) else {
                return false;
            };
            for (v, &i) in stored.iter().zip(&q) {
                assert!(i.unsigned_abs() <= 7);
                assert_eq!(i as f64 * s as f64, v.to_f64());
            }
            true
        }
        let src = source();
        for method in [Method::Magnitude, Method::Wanda, Method::SparseGpt] {
            let base = options(method, "balanced:8:16", 0.5, 0.0, "balanced-cbc");
            let mut f16_model = Model::from_source(&src).unwrap();
            prune_model(&mut f16_model, &windows(), &base, &mut |_| {}).unwrap();
            let mut model = Model::from_source(&src).unwrap();
            let opts = PipelineOptions {
                values: ValueGrid::Int4 { group: G },
                ..base
            };
            prune_model(&mut model, &windows(), &opts, &mut |_| {}).unwrap();
            let (mut moved, mut f16_off_grid, mut groups) = (0, 0, 0);
            for (layer, f16_layer) in model.layers().iter().zip(f16_model.layers()) {
                for ((name, lin), (_, f16_lin)) in
                    layer.linears().into_iter().zip(f16_layer.linears())
                {
                    assert_eq!(lin.format().kind(), FormatKind::BalancedCbc, "{name}");
                    let m = lin.format().decode();
                    let f = f16_lin.format().decode();
                    for r in 0..m.rows() {
                        for c0 in (0..m.cols()).step_by(G) {
                            let c1 = (c0 + G).min(m.cols());
                            groups += 1;
                            assert!(
                                on_grid(&m, r, c0, c1),
                                "{method} {name} row {r} columns {c0}..{c1}: off INT4 grids"
                            );
                            f16_off_grid += usize::from(!on_grid(&f, r, c0, c1));
                            if method != Method::Magnitude {
                                continue;
                            }
                            // Same mask: each weight within half a step of its group's grid.
                            let run = &f.row(r)[c0..c1];
                            let max = run.iter().fold(0f32, |a, v| a.max(v.to_f32().abs()));
                            let half_step = INT4.snap_scale(max).unwrap() as f64 / 2.0;
                            for (a, b) in m.row(r)[c0..c1].iter().zip(run) {
                                let d = (a.to_f64() - b.to_f64()).abs();
                                assert!(
                                    d <= half_step * (1.0 + 1e-6),
                                    "{name} row {r}: {a} vs {b}"
                                );
                                moved += usize::from(d > 0.0);
                            }
                        }
                    }
                }
            }
            assert!(groups > 0);
            assert!(
                f16_off_grid > groups / 2,
                "{method}: f16 pack on INT4 grids"
            );
            if method == Method::Magnitude {
                assert!(moved > 0, "int4 snapping changed no weight");
            }
        }
    }

    /// `--values` names: parsing, display (what the pack report and its JSON show) and
    /// refusals of unknown names, unknown groups and formats other than Balanced-CBC.
    #[test]
    fn int4_values_parse_display_and_refusals() {
        for (text, want, shown) in [
            ("int4", ValueGrid::Int4 { group: 64 }, "int4:64"),
            ("INT4:32", ValueGrid::Int4 { group: 32 }, "int4:32"),
            (" int4:64", ValueGrid::Int4 { group: 64 }, "int4:64"),
            ("int4:128", ValueGrid::Int4 { group: 128 }, "int4:128"),
            ("int8", ValueGrid::Int8, "int8"),
            ("f16", ValueGrid::F16, "f16"),
        ] {
            let v: ValueGrid = text.parse().unwrap();
            assert_eq!(v, want, "{text}");
            assert_eq!(v.to_string(), shown);
            assert_eq!(shown.parse::<ValueGrid>().unwrap(), v);
            assert_eq!(serde_json::to_string(&v).unwrap(), format!("\"{shown}\""));
        }
        for bad in [
            "int4:48",
            "int4:",
            "int4:x",
            "int4:256",
            "int2",
            "int4:64:1",
        ] {
            let err = bad.parse::<ValueGrid>().unwrap_err().to_string();
            assert!(err.contains("int4:32, int4:64, int4:128"), "{bad}: {err}");
        }
        let balanced = FormatChoice::Fixed(FormatKind::BalancedCbc);
        check_values_for_format(ValueGrid::Int4 { group: 32 }, balanced).unwrap();
        for format in ["dense", "tiled-cbc", "auto"] {
            let err =
                check_values_for_format(ValueGrid::Int4 { group: 64 }, format.parse().unwrap())
                    .unwrap_err()
                    .to_string();
            assert!(
                err.contains("int4") && err.contains("balanced-cbc"),
                "{format}: {err}"
            );
        }
        // A group set in code rather than parsed is checked too.
        let err = check_values_for_format(ValueGrid::Int4 { group: 48 }, balanced)
            .unwrap_err()
            .to_string();
        assert!(err.contains("int4:48"), "{err}");
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
    fn pattern_follows_the_format() {
        let b = |n| Pattern::Balanced { n, m: 16 };
        assert_eq!(
            pattern_for_format(None, 0.5, "dense").unwrap(),
            Pattern::Unstructured
        );
        assert_eq!(
            pattern_for_format(None, 0.5, "auto").unwrap(),
            Pattern::Unstructured
        );
        assert_eq!(
            pattern_for_format(Some("balanced"), 0.7, "dense").unwrap(),
            b(5)
        );
        assert_eq!(
            pattern_for_format(Some("2:4"), 0.7, "tiled-cbc").unwrap(),
            Pattern::NM { n: 2, m: 4 }
        );
        // balanced-cbc: the balanced pattern by default, N from --sp
        assert_eq!(
            pattern_for_format(None, 0.5, BALANCED_FORMAT_NAME).unwrap(),
            b(8)
        );
        assert_eq!(
            pattern_for_format(None, 0.3, "Balanced-CBC").unwrap(),
            b(11)
        );
        assert_eq!(
            pattern_for_format(Some("balanced"), 0.7, BALANCED_FORMAT_NAME).unwrap(),
            b(5)
        );
        assert_eq!(
            pattern_for_format(Some("balanced:12:16"), 0.5, BALANCED_FORMAT_NAME).unwrap(),
            b(12)
        );
        for bad in ["unstructured", "2:4", "8:16", "balanced:4:8"] {
            let err = pattern_for_format(Some(bad), 0.5, BALANCED_FORMAT_NAME)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("--format balanced-cbc") && err.contains("--pattern balanced"),
                "{bad}: {err}"
            );
        }
        assert!(check_pattern_for_format(Pattern::Unstructured, "dense").is_ok());
        // Slide: checked before pruning (issue 30: refused only after it).
        for good in ["6:8", "2:4", "3:4", "1:2", "4:8"] {
            let p = Pattern::parse_with_sp(good, 0.5).unwrap();
            assert!(check_pattern_for_format(p, "slide").is_ok(), "{good}");
        }
        for bad in [
            "unstructured",
            "7:8",
            "12:16",
            "14:16",
            "2:3",
            "balanced:8:16",
        ] {
            let err = pattern_for_format(Some(bad), 0.5, "slide")
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("--format slide") && err.contains("6:8"),
                "{bad}: {err}"
            );
        }
        let err = pattern_for_format(None, 0.5, "Slide")
            .unwrap_err()
            .to_string();
        assert!(err.contains("--pattern 6:8"), "{err}");
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

    #[test]
    fn timing_input_puts_dp_of_its_entries_under_the_threshold() {
        for (cols, dp) in [(576, 0.5), (1536, 0.3), (64, 0.9)] {
            let (x, t) = timing_input(cols, dp);
            let t = t.unwrap();
            let off = x.iter().filter(|v| v.abs() <= t).count() as f64 / cols as f64;
            assert!(
                (off - dp).abs() <= 1.0 / cols as f64 + 1e-9,
                "{cols} {dp}: {off}"
            );
        }
        assert!(timing_input(32, 0.0).1.is_none());
    }

    /// `--format auto` times every candidate's CPU product and keeps the fastest: every linear
    /// reports a positive time, the pack's prediction is their sum, the kept format is lossless
    /// or IE-BME (the one lossy candidate), and the per-layer listing names every projection.
    #[test]
    fn auto_keeps_a_measured_format_per_linear() {
        let src = source();
        let mut model = Model::from_source(&src).unwrap();
        let opts = options(Method::Magnitude, "unstructured", 0.5, 0.5, "auto");
        let report = prune_model(&mut model, &windows(), &opts, &mut |_| {}).unwrap();
        let mut sum = 0.0;
        for l in &report.linears {
            let t = l.product_seconds.expect("auto measures every linear");
            assert!(t > 0.0 && t < 1.0, "{}: {t}", l.name);
            sum += t;
        }
        assert!((report.product_seconds.unwrap() - sum).abs() <= 1e-12);
        let listing = report.measured_choices();
        assert_eq!(listing.lines().count(), model.layers().len(), "{listing}");
        assert!(
            listing.contains("q_proj ") && listing.contains("down_proj "),
            "{listing}"
        );
        // A fixed format measures nothing.
        let mut model = Model::from_source(&src).unwrap();
        let opts = options(Method::Magnitude, "unstructured", 0.5, 0.0, "dense");
        let report = prune_model(&mut model, &windows(), &opts, &mut |_| {}).unwrap();
        assert!(report.product_seconds.is_none());
        assert!(report.measured_choices().is_empty());
        // The timing runs the kernel a loaded pack would, for any candidate.
        let w = model.layers()[0].q_proj.format().decode();
        for kind in FormatKind::ALL {
            if let Ok(f) = sieve_formats::registry::encode_default(kind, &w) {
                let t = time_cpu_product(f.as_ref(), 0.5).unwrap();
                assert!(t > 0.0, "{kind:?}");
            }
        }
    }
}
