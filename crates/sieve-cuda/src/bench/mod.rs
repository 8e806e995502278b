//! The GPU kernel benchmark (`sieve bench kernels`, and the `bench_kernels` example): every
//! kernel of this crate against cuBLAS on LLaMA layer shapes.
//!
//! For every shape and weight sparsity `sp` a random unstructured matrix is encoded once per
//! format; its device copies rotate so that the weights read per launch are never L2-resident
//! (copies together exceed 4x the L2). For every activation sparsity `dp` a fresh random
//! activation vector gets the threshold that masks a fraction `dp` of it. Each timing is the
//! median of `reps` CUDA-event-timed launches after warm-up; output zeroing is inside the
//! timed region. Bytes per row are what the format must read at that sp/dp (weights of active
//! columns with their metadata, plus x and y); GB/s is over those bytes, and `%copy` compares
//! with a device-to-device copy measured in the same run. Every kernel's output is checked
//! against the f64 CPU reference once per point, outside the timed loop.
//!
//! With `graph` every measurement is also taken in graph mode ([`graph`]): the same rotating
//! launches captured into a CUDA graph and replayed, time per launch = replay time / launches,
//! outputs checked against the reference after the replays. With `fused` the q|k|v and
//! gate|up projections of each named model are timed as one packed matrix against separate
//! launches ([`fused`]).
//!
//! The caller fills [`KernelBenchOptions`], calls [`run`] and prints or saves the [`Report`]
//! ([`Report::markdown`], [`Report::write_outputs`], [`Report::check_correct`]).

pub mod fused;
pub mod gemm;
pub mod graph;
pub mod report;
pub mod shapes;
mod svg;

pub use fused::{FusedGroup, FusedRow};
pub use shapes::{shapes_of, Shape};

use crate::balanced_cbc::{BcbcKernel, GpuBalancedCbc};
use crate::choice::upload_chosen;
use crate::dense::{to_f16, zeroed_f16, Cublas, GpuDense, GpuDenseColMajor};
use crate::error::{CudaError, Result};
use crate::gpu::{DeviceInfo, Gpu};
use crate::product::{active_mask, GpuMatVec};
use crate::rlc_csc::{GpuRlcCsc, Stages};
use crate::tiled_cbc::{GpuTiledCbc, Lane8Shape, TcbcKernel};
use crate::timing::{copy_bandwidth_gbs, time_launches, Timing};
use cudarc::driver::CudaSlice;
use serde::Serialize;
use sieve_formats::balanced_cbc::{slots_for_sparsity, BalancedCbc};
use sieve_formats::random::{
    activations, balanced_matrix, sparse_matrix, threshold_for_sparsity, Pattern,
};
use sieve_formats::reference::{matvec_f64, max_rel_error};
use sieve_formats::rlc_csc::{RlcCsc, RlcCscOptions};
use sieve_formats::tiled_cbc::TiledCbc;
use sieve_formats::{DenseMatrix, Threshold, WeightFormat};

/// Largest relative error against the f64 reference that counts as correct.
pub const MAX_REL_ERROR: f64 = 1e-3;

/// A kernel family the benchmark can time (`--formats`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelFormat {
    /// Our row-major GEMV.
    Dense,
    /// The column-major kernel that skips inactive columns (TEAL alone).
    DenseColMajor,
    /// Celty's RLC-CSC spMspV.
    RlcCsc,
    /// Sieve's lane-per-8-rows Tiled-CBC kernel.
    TiledCbc,
    /// SPDP's thread-per-row Tiled-CBC kernel.
    TiledCbcSpdp,
    /// Lane8's pipeline with the round-robin decode (`TcbcKernel::RoundRobin`).
    TiledCbcRr,
    /// The per-layer choice of [`crate::choice`] between dense-colmajor and tiled-cbc.
    Auto,
    /// Balanced-CBC (lane per 16 rows, fixed-size blocks), measured on matrices with balanced
    /// sparsity along the outputs: N = round(16 (1 - sp)) nonzeros in every 16 rows of a column,
    /// not on the unstructured matrix the other sparse formats are measured on.
    BalancedCbc,
}

impl KernelFormat {
    pub const ALL: [KernelFormat; 8] = [
        KernelFormat::Dense,
        KernelFormat::DenseColMajor,
        KernelFormat::RlcCsc,
        KernelFormat::TiledCbc,
        KernelFormat::TiledCbcSpdp,
        KernelFormat::TiledCbcRr,
        KernelFormat::Auto,
        KernelFormat::BalancedCbc,
    ];

    pub fn name(self) -> &'static str {
        match self {
            KernelFormat::Dense => "dense",
            KernelFormat::DenseColMajor => "dense-colmajor",
            KernelFormat::RlcCsc => "rlc-csc",
            KernelFormat::TiledCbc => "tiled-cbc",
            KernelFormat::TiledCbcSpdp => "tiled-cbc-spdp",
            KernelFormat::TiledCbcRr => "tiled-cbc-rr",
            KernelFormat::Auto => "auto",
            KernelFormat::BalancedCbc => "balanced-cbc",
        }
    }

    /// The formats timed when none are named.
    pub fn defaults() -> Vec<KernelFormat> {
        let mut f = KernelFormat::ALL[..5].to_vec();
        f.push(KernelFormat::BalancedCbc);
        f
    }

    /// Kernels that store the matrix dense (zeros kept): their time does not depend on the
    /// weight sparsity, so they are measured on the unpruned matrix only.
    pub fn is_dense_storage(self) -> bool {
        matches!(self, KernelFormat::Dense | KernelFormat::DenseColMajor)
    }

    /// The Tiled-CBC kernel behind a Tiled-CBC format.
    fn tcbc_kernel(self) -> Option<TcbcKernel> {
        match self {
            KernelFormat::TiledCbc => Some(TcbcKernel::Lane8),
            KernelFormat::TiledCbcSpdp => Some(TcbcKernel::Spdp),
            KernelFormat::TiledCbcRr => Some(TcbcKernel::RoundRobin),
            _ => None,
        }
    }
}

impl std::str::FromStr for KernelFormat {
    type Err = CudaError;
    fn from_str(s: &str) -> Result<Self> {
        KernelFormat::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| {
                let known: Vec<&str> = KernelFormat::ALL.iter().map(|f| f.name()).collect();
                CudaError::Option(format!(
                    "unknown kernel format '{s}' (known: {})",
                    known.join(", ")
                ))
            })
    }
}

impl std::fmt::Display for KernelFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What to measure. [`Default`] is the CLI's defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelBenchOptions {
    /// Shape sets (`llama2-7b`, `llama2-13b`, `llama3-8b`, `llama2-70b`) or `MxK` shapes.
    pub shapes: Vec<String>,
    /// Weight sparsities, each in [0, 1).
    pub sp: Vec<f64>,
    /// Activation sparsities, each in [0, 1).
    pub dp: Vec<f64>,
    pub formats: Vec<KernelFormat>,
    /// Timed launches per measurement (the median is reported).
    pub reps: usize,
    /// Also time RLC-CSC with one stage left out (Celty Fig. 5).
    pub stages: bool,
    /// Also time a small sweep of tuning knobs, labelled per variant.
    pub tune: bool,
    /// RLC-CSC row-block height (a multiple of 256) of the default variant.
    pub rlc_block_rows: usize,
    /// RLC-CSC inner-loop size (columns per block) of the default variant.
    pub rlc_cols: usize,
    /// Seed of the random matrices and activations.
    pub seed: u64,
    /// Also time every measurement in graph mode (see [`graph`]).
    pub graph: bool,
    /// Launches captured per graph (raised to a multiple of the rotated copies, at least two
    /// per copy: [`graph::graph_launches`]).
    pub graph_launches: usize,
    /// Timed replays per graph measurement (the median is reported).
    pub graph_replays: usize,
    /// Multi-matrix groups to compare packed against separate launches (see [`fused`]).
    pub fused: Vec<FusedGroup>,
    /// Only the multi-matrix comparison, not the per-shape table.
    pub fused_only: bool,
}

impl Default for KernelBenchOptions {
    fn default() -> Self {
        Self {
            shapes: vec!["llama2-7b".into()],
            sp: vec![0.0, 0.3, 0.5, 0.7],
            dp: vec![0.0, 0.3, 0.5, 0.7],
            formats: KernelFormat::defaults(),
            reps: 100,
            stages: false,
            tune: false,
            rlc_block_rows: 1024,
            rlc_cols: 64,
            seed: 1,
            graph: false,
            graph_launches: 64,
            graph_replays: 20,
            fused: Vec::new(),
            fused_only: false,
        }
    }
}

impl KernelBenchOptions {
    /// Checks every option before any GPU work and returns the shapes to measure.
    pub fn validate(&self) -> Result<Vec<Shape>> {
        let bad = |m: String| Err(CudaError::Option(m));
        if self.shapes.is_empty() {
            return bad("no shapes given".into());
        }
        if self.sp.is_empty() || self.dp.is_empty() {
            return bad("no sparsities given (--sp and --dp need at least one value)".into());
        }
        for v in self.sp.iter().chain(&self.dp) {
            if !(0.0..1.0).contains(v) {
                return bad(format!("sparsity {v} outside [0, 1)"));
            }
        }
        if self.formats.is_empty() {
            return bad("no kernel formats given".into());
        }
        if self.reps == 0 {
            return bad("--reps must be positive".into());
        }
        if self.has(KernelFormat::RlcCsc) {
            let opts = RlcCscOptions {
                index_bits: 4,
                block_rows: self.rlc_block_rows,
            };
            opts.validate()?;
            if self.rlc_cols == 0 {
                return bad("--rlc-cols must be positive".into());
            }
        }
        if self.graph && (self.graph_launches == 0 || self.graph_replays == 0) {
            return bad("--graph-launches and --graph-replays must be positive".into());
        }
        if self.fused_only && self.fused.is_empty() {
            return bad("--fused-only needs --fused (qkv, gateup)".into());
        }
        let mut shapes = Vec::new();
        for s in &self.shapes {
            let set = shapes_of(s)?;
            if !self.fused.is_empty() && shapes::model(s).is_none() {
                return bad(format!(
                    "--fused needs named models (llama2-7b, llama2-13b, llama3-8b, llama2-70b) \
                     to take q, k, v, gate and up from; '{s}' is a single shape"
                ));
            }
            shapes.extend(set);
        }
        if !self.fused.is_empty() && fused::formats(self).is_empty() {
            return bad(format!(
                "--fused times {} (and cuBLAS); none of them is in --formats",
                fused::FORMATS.map(|f| f.name()).join(", ")
            ));
        }
        Ok(shapes)
    }

    /// The named models of `shapes`, each once, in order.
    pub fn models(&self) -> Vec<shapes::ModelDims> {
        let mut out: Vec<shapes::ModelDims> = Vec::new();
        for m in self.shapes.iter().filter_map(|s| shapes::model(s)) {
            if !out.contains(&m) {
                out.push(m);
            }
        }
        out
    }

    pub fn has(&self, f: KernelFormat) -> bool {
        self.formats.contains(&f)
    }
}

/// One measured kernel at one point.
#[derive(Serialize, Clone, Debug)]
pub struct Row {
    pub format: String,
    pub model: String,
    pub m: usize,
    pub k: usize,
    pub sp: f64,
    pub dp: f64,
    pub total_sparsity: f64,
    pub us: f64,
    pub us_min: f64,
    pub speedup_vs_cublas: f64,
    pub bytes: usize,
    pub gbs: f64,
    pub pct_copy_bw: f64,
    /// Relative error of this kernel's output against the f64 reference (checked once per
    /// point, outside the timed loop); absent for stage-skipping variants.
    pub rel_error: Option<f64>,
    /// Graph-mode figures (with `graph`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graph: Option<GraphFigures>,
}

/// One row's graph-mode figures.
#[derive(Serialize, Clone, Debug)]
pub struct GraphFigures {
    /// Median over replays of replay time / launches per replay.
    pub us: f64,
    pub us_min: f64,
    /// cuBLAS's graph-mode time over this one.
    pub speedup_vs_cublas: f64,
    pub gbs: f64,
    pub pct_copy_bw: f64,
    /// Relative error of the output after the timed replays (poisoned with NaN before them)
    /// against the f64 reference; absent for stage-skipping variants.
    pub rel_error: Option<f64>,
    pub launches: usize,
    pub replays: usize,
}

/// How graph mode ran.
#[derive(Serialize, Clone, Debug)]
pub struct GraphRun {
    /// Launches asked per graph (each graph holds at least this many, see
    /// [`graph::graph_launches`]).
    pub launches: usize,
    pub replays: usize,
    /// Per-launch time of an empty kernel in graph mode: the floor graph figures include.
    pub empty_launch_us: f64,
}

/// Everything one run measured.
#[derive(Serialize, Clone, Debug)]
pub struct Report {
    pub device: DeviceInfo,
    pub copy_gbs: f64,
    /// Median time of an empty kernel under the same event bracketing: the floor every row's
    /// µs includes.
    pub empty_launch_us: f64,
    pub reps: usize,
    /// cuBLAS per shape: (model, M, K, median µs).
    pub cublas: Vec<(String, usize, usize, f64)>,
    pub rows: Vec<Row>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graph: Option<GraphRun>,
    /// The multi-matrix comparison (with `fused`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub fused: Vec<FusedRow>,
}

/// Copies of a buffer of `bytes` needed so that one pass over them exceeds 4x the L2.
pub fn copies_for(bytes: usize, l2: usize) -> usize {
    (4 * l2).div_ceil(bytes.max(1)).clamp(1, 64)
}

/// Launches before the timed ones (event mode).
const WARMUP: usize = 10;
/// Replays before the timed ones (graph mode).
const GRAPH_WARMUP: usize = 2;

/// One kernel variant: the copy it is checked on, and the further copies timed launches rotate
/// over.
type Rotation = (Box<dyn GpuMatVec>, Vec<Box<dyn GpuMatVec>>);

/// The run's state: the GPU, what the rows are compared with, and the rows so far.
pub(crate) struct Bench<'a> {
    pub(crate) gpu: &'a Gpu,
    pub(crate) opts: &'a KernelBenchOptions,
    l2: usize,
    copy_gbs: f64,
    rows: Vec<Row>,
    pub(crate) progress: &'a mut dyn FnMut(&str),
}

/// One measurement: event timing and, in graph mode, the graph figures.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Measured {
    pub(crate) event: Timing,
    pub(crate) graph: Option<GraphMeasured>,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct GraphMeasured {
    pub(crate) timing: Timing,
    pub(crate) launches: usize,
    /// Against the reference after the replays; `None` when there was none to check with.
    pub(crate) rel_error: Option<f64>,
}

/// The cuBLAS time of the shape being measured, which every row is compared with.
struct Baseline<'s> {
    shape: &'s Shape,
    cublas: Measured,
}

impl Bench<'_> {
    /// Times `launch(i, outputs)`, which enqueues repetition `i` (rotating over `copies` device
    /// copies) writing `outputs`: CUDA events around each launch and, with `graph`, graph
    /// replays, after which each output is checked against its reference in `want` (one per
    /// output).
    pub(crate) fn measure<F>(
        &self,
        outputs: &mut [CudaSlice<f32>],
        want: Option<&[Vec<f64>]>,
        copies: usize,
        mut launch: F,
    ) -> Result<Measured>
    where
        F: FnMut(usize, &mut [CudaSlice<f32>]) -> Result<()>,
    {
        let gpu = self.gpu;
        let event = time_launches(gpu, WARMUP, self.opts.reps, |i| launch(i, outputs))?;
        if !self.opts.graph {
            return Ok(Measured { event, graph: None });
        }
        let launches = graph::graph_launches(self.opts.graph_launches, copies);
        let g = graph::capture(gpu, launches, |i| launch(i, outputs))?;
        for _ in 0..GRAPH_WARMUP {
            g.launch()?;
        }
        for out in outputs.iter_mut() {
            graph::poison(gpu, out)?;
        }
        let timing = graph::time_replays(gpu, &g, launches, self.opts.graph_replays)?;
        let rel_error = match want {
            None => None,
            Some(want) => {
                let mut errors = Vec::with_capacity(want.len());
                for (out, w) in outputs.iter().zip(want) {
                    errors.push(max_rel_error(&gpu.download(out)?, w));
                }
                Some(worst_error(errors))
            }
        };
        Ok(Measured {
            event,
            graph: Some(GraphMeasured {
                timing,
                launches,
                rel_error,
            }),
        })
    }

    pub(crate) fn copies_for(&self, bytes: usize) -> usize {
        copies_for(bytes, self.l2)
    }

    #[allow(clippy::too_many_arguments)]
    fn record(
        &mut self,
        base: &Baseline,
        format: String,
        sp: f64,
        dp: f64,
        t: Measured,
        bytes: usize,
        rel_error: Option<f64>,
    ) {
        let gbs_of = |us: f64| bytes as f64 / (us * 1e-6) / 1e9;
        let gbs = gbs_of(t.event.median_us);
        let graph = match (t.graph, base.cublas.graph) {
            (Some(g), Some(bg)) => {
                let gbs = gbs_of(g.timing.median_us);
                Some(GraphFigures {
                    us: g.timing.median_us,
                    us_min: g.timing.min_us,
                    speedup_vs_cublas: bg.timing.median_us / g.timing.median_us,
                    gbs,
                    pct_copy_bw: 100.0 * gbs / self.copy_gbs,
                    rel_error: g.rel_error,
                    launches: g.launches,
                    replays: g.timing.reps,
                })
            }
            _ => None,
        };
        let row = Row {
            format,
            model: base.shape.model.clone(),
            m: base.shape.m,
            k: base.shape.k,
            sp,
            dp,
            total_sparsity: 1.0 - (1.0 - sp) * (1.0 - dp),
            us: t.event.median_us,
            us_min: t.event.min_us,
            speedup_vs_cublas: base.cublas.event.median_us / t.event.median_us,
            bytes,
            gbs,
            pct_copy_bw: 100.0 * gbs / self.copy_gbs,
            rel_error,
            graph,
        };
        (self.progress)(&report::progress_line(&row));
        self.rows.push(row);
    }
}

/// Relative error of `w`'s product (fresh NaN-poisoned output) against `want`.
pub(crate) fn check(
    gpu: &Gpu,
    w: &dyn GpuMatVec,
    x: &[f32],
    t: Threshold,
    want: &[f64],
) -> Result<f64> {
    let got = crate::matvec_host(gpu, w, x, t)?;
    Ok(max_rel_error(&got, want))
}

/// The largest of `errors`, NaN when any is NaN (an output a kernel left unwritten), which
/// `f64::max` alone would drop.
pub fn worst_error(errors: impl IntoIterator<Item = f64>) -> f64 {
    errors.into_iter().fold(0.0f64, |a, e| {
        if a.is_nan() || e.is_nan() {
            f64::NAN
        } else {
            a.max(e)
        }
    })
}

/// `x` rounded to f16, as cuBLAS sees it, so that its check measures the product only.
pub(crate) fn f16_rounded(x: &[f32]) -> Vec<f32> {
    x.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect()
}

/// Runs the benchmark. `progress` receives one line per device fact and per measured row
/// while the run goes (the CLI prints them to stderr).
pub fn run(opts: &KernelBenchOptions, progress: &mut dyn FnMut(&str)) -> Result<Report> {
    let shapes = opts.validate()?;
    let gpu = Gpu::new(0)?;
    let info = gpu.info().clone();
    let l2 = info.l2_bytes.max(1 << 20);
    progress(&format!(
        "device: {} (sm_{}{}), {} SMs, L2 {} MB",
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.multiprocessors,
        l2 >> 20
    ));
    let copy_gbs = copy_bandwidth_gbs(&gpu, 1 << 30, 20)?;
    progress(&format!(
        "copy bandwidth (read + write): {copy_gbs:.0} GB/s"
    ));
    let empty_launch_us = time_launches(&gpu, 10, 200, |_| crate::timing::spin(&gpu, 0))?.median_us;
    progress(&format!(
        "empty kernel launch (event-bracketed median): {empty_launch_us:.2} µs"
    ));
    // cuBLAS must not allocate its workspace while a stream is captured.
    let _workspace = if opts.graph {
        Some(graph::CublasWorkspace::bind(
            &gpu,
            graph::CublasWorkspace::BYTES,
        )?)
    } else {
        None
    };
    let graph_run = if opts.graph {
        let launches = graph::graph_launches(opts.graph_launches, 1);
        let g = graph::capture(&gpu, launches, |_| crate::timing::spin(&gpu, 0))?;
        g.launch()?;
        let t = graph::time_replays(&gpu, &g, launches, opts.graph_replays)?;
        progress(&format!(
            "empty kernel launch (graph mode, per launch): {:.2} µs",
            t.median_us
        ));
        Some(GraphRun {
            launches: opts.graph_launches,
            replays: opts.graph_replays,
            empty_launch_us: t.median_us,
        })
    } else {
        None
    };

    let mut bench = Bench {
        gpu: &gpu,
        opts,
        l2,
        copy_gbs,
        rows: Vec::new(),
        progress,
    };
    let mut cublas_times = Vec::new();
    if !opts.fused_only {
        for (si, shape) in shapes.iter().enumerate() {
            let seed = opts.seed.wrapping_add(si as u64 * 1000);
            let t_blas = bench_shape(&mut bench, shape, seed)?;
            cublas_times.push((shape.model.clone(), shape.m, shape.k, t_blas.median_us));
        }
    }
    let mut fused_rows = Vec::new();
    for (mi, model) in opts.models().iter().enumerate() {
        for &group in &opts.fused {
            let seed = opts.seed.wrapping_add(0x5000 + mi as u64 * 100);
            fused_rows.extend(fused::bench_group(&mut bench, model, group, seed)?);
        }
    }
    Ok(Report {
        device: info,
        copy_gbs,
        empty_launch_us,
        reps: opts.reps,
        cublas: cublas_times,
        rows: bench.rows,
        graph: graph_run,
        fused: fused_rows,
    })
}

/// Every kernel at every point of one shape; returns the cuBLAS event timing.
fn bench_shape(bench: &mut Bench, shape: &Shape, seed: u64) -> Result<Timing> {
    let gpu = bench.gpu;
    let opts = bench.opts;
    let has = |f| opts.has(f);
    let (m, k) = (shape.m, shape.k);
    // cuBLAS and our dense GEMV on the unpruned matrix: what a dense model runs.
    let w0 = sparse_matrix(m, k, 0.0, Pattern::Unstructured, seed)?;
    let dense_copies: Vec<GpuDense> = (0..bench.copies_for(m * k * 2))
        .map(|_| GpuDense::upload(gpu, &w0))
        .collect::<Result<_>>()?;
    let blas = Cublas::new(gpu, &dense_copies[0])?;
    let x0 = activations(k, seed ^ 7);
    let xd = gpu.upload(&x0)?;
    let mut x16 = zeroed_f16(gpu, k)?;
    to_f16(gpu, &xd, &mut x16)?;
    let mut out = vec![gpu.poisoned_f32(m)?];
    let want_blas = vec![matvec_f64(&w0, &f16_rounded(&x0), None)];
    blas.gemm(gpu, &dense_copies[0], &x16, 1, &mut out[0])?;
    let blas_err = max_rel_error(&gpu.download(&out[0])?, &want_blas[0]);
    let nd = dense_copies.len();
    let t_blas = bench.measure(&mut out, Some(&want_blas), nd, |i, y| {
        blas.gemm(gpu, &dense_copies[i % nd], &x16, 1, &mut y[0])
    })?;
    let base = Baseline {
        shape,
        cublas: t_blas,
    };
    let dense_bytes = m * k * 2 + k * 2 + m * 4;
    bench.record(
        &base,
        "cublas".into(),
        0.0,
        0.0,
        t_blas,
        dense_bytes,
        Some(blas_err),
    );

    let mut cms = Vec::new();
    if has(KernelFormat::DenseColMajor) {
        let cm = GpuDenseColMajor::upload(gpu, &w0)?;
        let bytes = cm.bytes_for(&vec![true; k]);
        cms.push(cm);
        for _ in 1..bench.copies_for(bytes) {
            cms.push(GpuDenseColMajor::upload(gpu, &w0)?);
        }
    }
    for (di, &dp) in opts.dp.iter().enumerate() {
        let x = activations(k, seed ^ (0x100 + di as u64));
        let t = threshold_for_sparsity(&x, dp)?;
        let xd = gpu.upload(&x)?;
        let mask = active_mask(&x, t);
        let want = vec![matvec_f64(&w0, &x, t)];
        if has(KernelFormat::Dense) && di == 0 {
            let err = check(gpu, &dense_copies[0], &x, t, &want[0])?;
            let tm = bench.measure(&mut out, Some(&want), nd, |i, y| {
                dense_copies[i % nd].launch(gpu, &xd, t, &mut y[0])
            })?;
            let bytes = dense_copies[0].bytes_for(&mask);
            bench.record(&base, "dense-gemv".into(), 0.0, dp, tm, bytes, Some(err));
        }
        if !cms.is_empty() {
            let n = cms.len();
            let cpws: &[usize] = if opts.tune { &[0, 64, 128] } else { &[0] };
            for &cpw in cpws {
                for c in cms.iter_mut() {
                    c.cols_per_warp = cpw;
                }
                let err = check(gpu, &cms[0], &x, t, &want[0])?;
                let tm = bench.measure(&mut out, Some(&want), n, |i, y| {
                    cms[i % n].launch(gpu, &xd, t, &mut y[0])
                })?;
                let (label, bytes) = (cms[0].label(), cms[0].bytes_for(&mask));
                bench.record(&base, label, 0.0, dp, tm, bytes, Some(err));
            }
        }
    }

    if !opts.formats.iter().any(|f| !f.is_dense_storage()) {
        return Ok(t_blas.event);
    }
    for (pi, &sp) in opts.sp.iter().enumerate() {
        let w = sparse_matrix(m, k, sp, Pattern::Unstructured, seed ^ (0x10 + pi as u64))?;
        let variants = sparse_variants(bench, &w)?;
        // --tune also times the kernel that is not the default for this N.
        let mut balanced = Vec::new();
        if has(KernelFormat::BalancedCbc) {
            let chosen = BcbcKernel::for_slots(slots_for_sparsity(sp)?);
            let kernels = if opts.tune {
                vec![chosen, chosen.other()]
            } else {
                vec![chosen]
            };
            for kernel in kernels {
                let bseed = seed ^ (0x30 + pi as u64);
                balanced.push(balanced_rotation(bench, m, k, sp, bseed, kernel)?);
            }
        }
        for (di, &dp) in opts.dp.iter().enumerate() {
            let x = activations(k, seed ^ (0x100 + di as u64));
            let t = threshold_for_sparsity(&x, dp)?;
            let xd = gpu.upload(&x)?;
            let mask = active_mask(&x, t);
            for (wb, first, rest) in &balanced {
                let want = vec![matvec_f64(wb, &x, t)];
                let err = check(gpu, first.as_ref(), &x, t, &want[0])?;
                let n = rest.len() + 1;
                let tm = bench.measure(&mut out, Some(&want), n, |i, y| {
                    let r = i % n;
                    let f: &dyn GpuMatVec = if r == 0 { first.as_ref() } else { &rest[r - 1] };
                    f.launch(gpu, &xd, t, &mut y[0])
                })?;
                let bytes = first.bytes_for(&mask);
                bench.record(&base, first.label(), sp, dp, tm, bytes, Some(err));
            }
            let want = vec![matvec_f64(&w, &x, t)];
            for (first, rest) in &variants {
                let label = first.label();
                let full = !label.contains("/no-") && !label.contains("/loads-only");
                let err = if full {
                    Some(check(gpu, first.as_ref(), &x, t, &want[0])?)
                } else {
                    None
                };
                let n = rest.len() + 1;
                let tm = bench.measure(&mut out, full.then_some(&want[..]), n, |i, y| {
                    let r = i % n;
                    let f: &dyn GpuMatVec = if r == 0 {
                        first.as_ref()
                    } else {
                        rest[r - 1].as_ref()
                    };
                    f.launch(gpu, &xd, t, &mut y[0])
                })?;
                let bytes = first.bytes_for(&mask);
                bench.record(&base, label, sp, dp, tm, bytes, err);
            }
            if has(KernelFormat::Auto) {
                // The per-layer choice (crate::choice) for this sp and dp, rotated over enough
                // copies like every other kernel.
                let first = upload_chosen(gpu, &w, dp)?;
                let bytes = first.bytes_for(&vec![true; k]);
                let mut copies = vec![first];
                for _ in 1..bench.copies_for(bytes) {
                    copies.push(upload_chosen(gpu, &w, dp)?);
                }
                let err = check(gpu, copies[0].as_ref(), &x, t, &want[0])?;
                let n = copies.len();
                let tm = bench.measure(&mut out, Some(&want), n, |i, y| {
                    copies[i % n].launch(gpu, &xd, t, &mut y[0])
                })?;
                let label = format!("auto:{}", copies[0].label());
                let bytes = copies[0].bytes_for(&mask);
                bench.record(&base, label, sp, dp, tm, bytes, Some(err));
            }
        }
    }
    Ok(t_blas.event)
}

/// Uploads `w` for `format` with the default knobs of `opts` (no tuning variants); `None`
/// for `auto`, whose kernel depends on the activation sparsity.
pub(crate) fn upload_format(
    gpu: &Gpu,
    opts: &KernelBenchOptions,
    format: KernelFormat,
    w: &DenseMatrix,
) -> Result<Option<Box<dyn GpuMatVec>>> {
    Ok(Some(match format {
        KernelFormat::Dense => Box::new(GpuDense::upload(gpu, w)?),
        KernelFormat::DenseColMajor => Box::new(GpuDenseColMajor::upload(gpu, w)?),
        KernelFormat::RlcCsc => {
            let o = RlcCscOptions {
                index_bits: 4,
                block_rows: opts.rlc_block_rows,
            };
            let mut g = GpuRlcCsc::upload(gpu, &RlcCsc::encode(w, &o)?)?;
            g.cols_per_warp = opts.rlc_cols;
            Box::new(g)
        }
        KernelFormat::TiledCbc | KernelFormat::TiledCbcSpdp | KernelFormat::TiledCbcRr => {
            let mut g = GpuTiledCbc::upload(gpu, &TiledCbc::encode(w)?)?;
            if let Some(kernel) = format.tcbc_kernel() {
                g.kernel = kernel;
            }
            Box::new(g)
        }
        KernelFormat::BalancedCbc => {
            Box::new(GpuBalancedCbc::upload(gpu, &BalancedCbc::encode(w)?)?)
        }
        KernelFormat::Auto => return Ok(None),
    }))
}

/// A random matrix with balanced sparsity for `sp` (N = round(16 (1 - sp)) of every 16 rows
/// of a column), encoded as Balanced-CBC and uploaded with its rotation copies.
fn balanced_rotation(
    bench: &Bench,
    m: usize,
    k: usize,
    sp: f64,
    seed: u64,
    kernel: BcbcKernel,
) -> Result<(DenseMatrix, Box<GpuBalancedCbc>, Vec<GpuBalancedCbc>)> {
    let slots = slots_for_sparsity(sp)?;
    let w = balanced_matrix(m, k, slots, seed)?;
    let f = BalancedCbc::encode_with_slots(&w, slots)?;
    let first = Box::new(GpuBalancedCbc::upload_for(bench.gpu, &f, kernel)?);
    let rest = (1..bench.copies_for(f.blocks().len()))
        .map(|_| GpuBalancedCbc::upload_for(bench.gpu, &f, kernel))
        .collect::<Result<_>>()?;
    Ok((w, first, rest))
}

/// The RLC-CSC and Tiled-CBC variants the options ask for, uploaded for `w` with their
/// rotation copies.
fn sparse_variants(bench: &Bench, w: &DenseMatrix) -> Result<Vec<Rotation>> {
    let (gpu, opts) = (bench.gpu, bench.opts);
    let mut variants: Vec<Rotation> = Vec::new();
    if opts.has(KernelFormat::RlcCsc) {
        let mut configs = vec![(opts.rlc_block_rows, opts.rlc_cols)];
        if opts.tune {
            for br in [1024usize, 4096] {
                for c in [32usize, 64, 128] {
                    if !configs.contains(&(br, c)) {
                        configs.push((br, c));
                    }
                }
            }
        }
        let mut encoded: Vec<(usize, RlcCsc)> = Vec::new();
        for &(br, c) in &configs {
            if !encoded.iter().any(|(b, _)| *b == br) {
                let o = RlcCscOptions {
                    index_bits: 4,
                    block_rows: br,
                };
                encoded.push((br, RlcCsc::encode(w, &o)?));
            }
            let Some((_, f)) = encoded.iter().find(|(b, _)| *b == br) else {
                continue;
            };
            let bytes = f.storage().total_bytes();
            let mut copies: Vec<Box<dyn GpuMatVec>> = Vec::new();
            let mut stage_variants = Vec::new();
            for ci in 0..bench.copies_for(bytes) {
                let mut g = GpuRlcCsc::upload(gpu, f)?;
                g.cols_per_warp = c;
                if opts.stages && ci == 0 && (br, c) == configs[0] {
                    for st in [
                        Stages::NoReconstruction,
                        Stages::NoAccumulation,
                        Stages::LoadsOnly,
                    ] {
                        let mut v = GpuRlcCsc::upload(gpu, f)?;
                        v.cols_per_warp = c;
                        v.stages = st;
                        stage_variants.push(v);
                    }
                }
                copies.push(Box::new(g));
            }
            let first = copies.remove(0);
            variants.push((first, copies));
            // Stage variants are timed on one copy each (their outputs are not products, so
            // they are not checked either).
            for v in stage_variants {
                variants.push((Box::new(v), Vec::new()));
            }
        }
    }
    let tcbc: Vec<KernelFormat> = opts
        .formats
        .iter()
        .copied()
        .filter(|f| f.tcbc_kernel().is_some())
        .collect();
    if !tcbc.is_empty() {
        let f = TiledCbc::encode(w)?;
        let bytes = f.storage().total_bytes();
        // (kernel, gtiles per block (0 = auto), lane8 waves, lane8 pipeline shape)
        let lane8 = Lane8Shape::DEFAULT;
        let mut configs = Vec::new();
        for format in tcbc {
            let Some(kernel) = format.tcbc_kernel() else {
                continue;
            };
            configs.push((kernel, 0usize, 1usize, lane8));
            if !opts.tune {
                continue;
            }
            match kernel {
                TcbcKernel::Spdp => configs.push((kernel, 16, 1, lane8)),
                _ => {
                    configs.push((kernel, 0, 2, lane8));
                    for shape in &Lane8Shape::ALL[1..] {
                        configs.push((kernel, 0, 1, *shape));
                    }
                }
            }
        }
        for (kernel, gpb, waves, shape) in configs {
            let mut copies: Vec<Box<dyn GpuMatVec>> = Vec::new();
            for _ in 0..bench.copies_for(bytes) {
                let mut g = GpuTiledCbc::upload(gpu, &f)?;
                g.kernel = kernel;
                g.gtiles_per_block = gpb;
                g.lane8_waves = waves;
                g.lane8_shape = shape;
                copies.push(Box::new(g));
            }
            let first = copies.remove(0);
            variants.push((first, copies));
        }
    }
    Ok(variants)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_exceeds_l2() {
        let l2 = 60 << 20;
        assert!(copies_for(32 << 20, l2) * (32 << 20) >= 4 * l2);
        assert_eq!(copies_for(1 << 30, l2), 1);
        assert_eq!(copies_for(1, l2), 64);
    }

    #[test]
    fn formats_parse_by_name() {
        for f in KernelFormat::ALL {
            assert_eq!(f.name().parse::<KernelFormat>().unwrap(), f);
        }
        let e = "tiled".parse::<KernelFormat>().unwrap_err().to_string();
        assert!(e.contains("tiled-cbc-spdp"), "{e}");
        assert!(!KernelFormat::defaults().contains(&KernelFormat::Auto));
    }

    #[test]
    fn options_are_checked_before_work() {
        let ok = KernelBenchOptions::default();
        assert_eq!(ok.validate().unwrap().len(), 3);
        let with = |f: &dyn Fn(&mut KernelBenchOptions)| {
            let mut o = KernelBenchOptions::default();
            f(&mut o);
            o.validate().unwrap_err().to_string()
        };
        assert!(with(&|o| o.sp = vec![1.0]).contains("sparsity 1"));
        assert!(with(&|o| o.dp = vec![-0.1]).contains("sparsity -0.1"));
        assert!(with(&|o| o.dp.clear()).contains("sparsities"));
        assert!(with(&|o| o.reps = 0).contains("--reps"));
        assert!(with(&|o| o.shapes = vec!["llama9".into()]).contains("llama9"));
        assert!(with(&|o| o.shapes.clear()).contains("shapes"));
        assert!(with(&|o| o.formats.clear()).contains("formats"));
        assert!(with(&|o| o.rlc_block_rows = 1000).contains("block rows"));
        assert!(with(&|o| o.rlc_cols = 0).contains("--rlc-cols"));
        // RLC-CSC knobs only matter when RLC-CSC runs.
        let mut o = KernelBenchOptions {
            formats: vec![KernelFormat::TiledCbc],
            rlc_cols: 0,
            ..Default::default()
        };
        assert!(o.validate().is_ok());
        o.shapes = vec!["llama2-7b".into(), "300x70".into()];
        assert_eq!(o.validate().unwrap().len(), 4);
    }

    #[test]
    fn graph_and_fused_options_are_checked() {
        let with = |f: &dyn Fn(&mut KernelBenchOptions)| {
            let mut o = KernelBenchOptions::default();
            f(&mut o);
            o.validate().map(|s| s.len()).map_err(|e| e.to_string())
        };
        assert!(with(&|o| {
            o.graph = true;
            o.graph_launches = 0
        })
        .unwrap_err()
        .contains("--graph-launches"));
        assert!(with(&|o| {
            o.graph = true;
            o.graph_replays = 0
        })
        .is_err());
        // Without --graph the graph knobs are not used.
        assert!(with(&|o| o.graph_replays = 0).is_ok());
        assert!(with(&|o| o.fused_only = true)
            .unwrap_err()
            .contains("--fused"));
        let custom = with(&|o| {
            o.fused = vec![FusedGroup::Qkv];
            o.shapes = vec!["llama2-7b".into(), "4096x4096".into()]
        });
        assert!(custom.unwrap_err().contains("4096x4096"));
        let only_auto = with(&|o| {
            o.fused = vec![FusedGroup::GateUp];
            o.formats = vec![KernelFormat::Auto]
        });
        assert!(only_auto.unwrap_err().contains("tiled-cbc"));
        let o = KernelBenchOptions {
            shapes: vec!["llama3-8b".into(), "llama2-7b".into(), "llama3-8b".into()],
            fused: vec![FusedGroup::Qkv],
            ..Default::default()
        };
        assert_eq!(o.validate().unwrap().len(), 9);
        let names: Vec<&str> = o.models().iter().map(|m| m.name).collect();
        assert_eq!(names, vec!["llama3-8b", "llama2-7b"]);
    }

    #[test]
    fn worst_error_keeps_nan() {
        assert_eq!(worst_error([1e-5, 3e-4, 2e-6]), 3e-4);
        assert!(worst_error([1e-5, f64::NAN, 2e-6]).is_nan());
        assert_eq!(worst_error([]), 0.0);
        let x = [1.0f32, 0.1, 2.71];
        assert!(f16_rounded(&x)
            .iter()
            .zip(&x)
            .all(|(r, v)| (r - v).abs() <= v.abs() * 1e-3));
    }

    /// The whole run on a GPU, small: every format in event and graph mode (cuBLAS captured
    /// too), every output checked after the replays, and the multi-matrix comparison.
    #[test]
    fn gpu_small_run_in_both_modes() {
        if crate::gpu_or_skip("gpu_small_run_in_both_modes").is_none() {
            return;
        }
        let o = KernelBenchOptions {
            shapes: vec!["300x200".into()],
            sp: vec![0.0, 0.6],
            dp: vec![0.0, 0.5],
            formats: KernelFormat::ALL.to_vec(),
            reps: 3,
            stages: true,
            graph: true,
            graph_launches: 4,
            graph_replays: 2,
            ..Default::default()
        };
        let mut lines = Vec::new();
        let r = run(&o, &mut |l| lines.push(l.to_string())).expect("run");
        r.check_correct()
            .expect("every kernel agrees with the reference");
        assert!(r.graph.as_ref().is_some_and(|g| g.empty_launch_us > 0.0));
        assert!(r.rows.iter().all(|row| row.graph.is_some()));
        let checked = r
            .rows
            .iter()
            .filter(|row| row.graph.as_ref().is_some_and(|g| g.rel_error.is_some()))
            .count();
        // Everything but the three stage-skipping variants at each of the 4 points.
        assert_eq!(checked, r.rows.len() - 3 * 4);
        assert!(r.markdown().contains("(graph mode;"));
        assert!(lines.len() > r.rows.len());

        let f = KernelBenchOptions {
            shapes: vec!["llama3-8b".into()],
            sp: vec![0.5],
            dp: vec![0.5],
            formats: vec![KernelFormat::DenseColMajor, KernelFormat::TiledCbc],
            reps: 3,
            graph: true,
            graph_launches: 2,
            graph_replays: 2,
            fused: vec![FusedGroup::Qkv],
            fused_only: true,
            ..Default::default()
        };
        let r = run(&f, &mut |_| {}).expect("fused run");
        r.check_correct()
            .expect("fused outputs agree with the reference");
        assert!(r.rows.is_empty());
        // cublas, dense-colmajor (sp 0), tiled-cbc (sp 0.5).
        let formats: Vec<&str> = r.fused.iter().map(|x| x.format.as_str()).collect();
        assert_eq!(formats, vec!["cublas", "dense-colmajor", "tiled-cbc/lane8"]);
        assert!(r
            .fused
            .iter()
            .all(|x| x.parts == vec![4096, 1024, 1024] && x.graph_separate_over_packed.is_some()));
    }

    /// Without a GPU the run fails with the typed "no GPU" error after validating, never a
    /// panic; on a GPU machine this test only checks that bad options fail before the GPU is
    /// opened.
    #[test]
    fn bad_options_fail_before_the_gpu() {
        let o = KernelBenchOptions {
            reps: 0,
            ..Default::default()
        };
        let mut lines = Vec::new();
        let e = run(&o, &mut |l| lines.push(l.to_string())).unwrap_err();
        assert!(matches!(e, CudaError::Option(_)), "{e}");
        assert!(lines.is_empty());
    }
}
