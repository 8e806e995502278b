//! `sieve bench gemm`: the low-bit products (dense W4A16 / W8A16, GGUF Q4_0 / Q8_0 blocks,
//! Balanced-CBC with int8 / int4 values, IE-BME) and Tiled-CBC's two ways with N tokens
//! against cuBLAS f16 at N = 1..32 tokens, with the
//! rules of `sieve bench kernels` ([`super`]): weights rotate over device copies that together
//! exceed 4x the L2, event-timed medians after warm-up (and with `graph` CUDA-graph replays),
//! cuBLAS f16 on the same shape and N in the same run, and every kernel's output checked
//! against its f64 CPU reference (with the same quantization) before it is timed.
//!
//! Activations are N x K f16 (one random matrix per shape; N tokens = its first N rows), outputs
//! N x M f32. Balanced-CBC rows are matrix-vector products (N = 1) over f32 activations with a
//! TEAL threshold that masks a fraction `dp`, on a balanced matrix of sparsity `sp`.

use super::shapes::{shapes_of, Shape};
use super::svg;
use crate::balanced_cbc::GpuBalancedCbc;
use crate::balanced_lowbit::{snap_balanced, GpuBalancedLowBit, LowBitValues};
use crate::cusparselt::LtPrecision;
use crate::dense::{Cublas, GpuDense};
use crate::error::{CudaError, Result};
use crate::gpu::{DeviceInfo, Gpu};
use crate::ie_bme::{GpuIeBme, IeBmeDevice};
use crate::lowbit::{
    pad_activations, quantize_q4_0, quantize_q8_0, GpuLowBit, LowBitKind, LowBitMatrix, MAX_TOKENS,
};
use crate::timing::{copy_bandwidth_gbs, time_launches, Timing};
use crate::GpuMatVec;
use cudarc::driver::CudaSlice;
use half::f16;
use serde::Serialize;
use sieve_formats::balanced_cbc::{slots_for_sparsity, BalancedCbc};
use sieve_formats::ie_bme::{IeBme, IeBmeOptions, Payload, Reorder};
use sieve_formats::random::{activations, sparse_matrix, threshold_for_sparsity, Pattern};
use sieve_formats::reference::max_rel_error;
use sieve_formats::slide::{Slide, SlideOptions};
use sieve_formats::WeightFormat;
use std::fmt::Write as _;

/// Largest relative error (max |got - want| / max |want|) that counts as correct.
pub const MAX_REL_ERROR: f64 = 1e-3;

/// Largest relative error a row of `precision` may have against its reference: 1e-3, except
/// cuSPARSELt's sparse FP8 product, whose tensor-core sums keep fewer bits than f32 (window L3,
/// H100, cuSPARSELt 0.8: 2.5e-3 to 3.0e-3 of the largest output at K' = 5,462-16,512, where
/// cuBLASLt's dense FP8 on the same codes is within 1.3e-4).
pub fn max_rel_error_of(precision: &str) -> f64 {
    if precision == Precision::SlideLtFp8.name() {
        1e-2
    } else {
        MAX_REL_ERROR
    }
}
const WARMUP: usize = 10;
const GRAPH_WARMUP: usize = 2;

/// A weight precision (`--precision`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Precision {
    /// cuBLAS GemmEx, f16 weights (always timed: the baseline).
    F16,
    W8A16,
    W4A16,
    GgufQ4_0,
    GgufQ8_0,
    /// The kernel of GGUF Q4_K: 4-bit affine per 32, two-level scales and mins (sieve's
    /// quantizer of the same weights).
    W4K,
    /// The kernel of GGUF Q5_K: 5-bit affine per 32, two-level scales and mins.
    W5K,
    /// The kernel of GGUF Q6_K: 6-bit per 16, two-level scales.
    W6K,
    /// The kernel of GGUF Q4_1: 4-bit affine, f16 scale and min per 32.
    W4G32Affine,
    /// Balanced-CBC, int8 values with per-row scales (N = 1, sp / dp).
    BcbcInt8,
    /// Balanced-CBC, int4 values with f16 scales per row and 128 columns (N = 1, sp / dp).
    BcbcInt4,
    /// Balanced-CBC, f16 values (the existing kernel, for comparison; N = 1, sp / dp).
    BcbcF16,
    /// IE-BME 2 x 2 areas, int4 values with f16 scales per row and 128 columns, greedy row
    /// reordering (unstructured sparsity sp, every N; dp at N = 1).
    IeBmeInt4,
    /// IE-BME 2 x 2 areas, int8 values, scales per row and 128 columns.
    IeBmeInt8,
    /// Tiled-CBC (f16 values, unstructured sparsity sp) for N tokens as N products of one
    /// token each (the lane8 kernel): what N sequences cost stepped one by one.
    TcbcPerToken,
    /// Tiled-CBC for N tokens as the batched decode pass runs it: the matrix decoded to f16
    /// (`tcbc_decode_t`), then one cuBLAS GEMM. With `tcbc-per-token`, the crossover that
    /// `sieve_gpu::runner::DECODED_MIN_BATCH` is set from (per product; the whole step's is larger).
    TcbcDecodeGemm,
    /// Tiled-CBC for N tokens on the tensor cores, the weights read compressed and decoded into
    /// mma fragments (`tcbc_spmm`, SPDP's SpMM): what the batched pass runs where it can.
    TcbcSpmm,
    /// Tiled-CBC's union product (`tcbc_spmspv_union_n*`): N <= 4 tokens, each masked by the
    /// threshold of `--dp` on its own, every column active in some token read once (unstructured
    /// sparsity sp); what a decode step of a few sequences runs. y zeroed and timed with it.
    TcbcUnion,
    /// Balanced-CBC's union product, f16 values (`bcbc_union_n*`): N <= 8 tokens, 4 a launch.
    BcbcUnion,
    /// SlideSparse: a (2N-2):2N matrix (`--pattern`) lifted to 2:4 and multiplied on the sparse
    /// tensor cores (`mma.sp`), f16 values; the activation lifting (f32 -> f16) is timed with it.
    SlideF16,
    /// The same matrix as the prompt path runs it from `slide::DECODE_MIN_TOKENS` tokens: the
    /// original W written as f16 rows from the device layout (`slide_to_f16_rows`, the zeroing
    /// included), then cuBLAS; both timed, the f16 activations uploaded once.
    SlideF16Copy,
    /// W4A16 g128 column-major under a TEAL threshold (`lowbit_cols`): N = 1, the weights
    /// pruned to sp (stored as zeros), only the active columns read. Timed with the zeroing of
    /// y (cuBLAS writes y; in the decode step the RMSNorm before zeroes it).
    W4A16Cols,
    /// GGUF Q4_0 (4-bit, f16 scale per 32) column-major under a TEAL threshold, as `w4a16-cols`.
    Q4_0Cols,
    /// W4A16 g128 decoded to f16 (`decode_rows_f16`) then cuBLAS: what the batched prefill runs
    /// for a low-bit matrix above 64 tokens; both launches timed, the decode's write included.
    W4A16DecodeGemm,
    /// The same for Q4_K blocks (two-level scales).
    Q4KDecodeGemm,
    /// W4A16 g128's weights times 8-bit activations on the integer tensor cores (`w4a8_gemv`):
    /// each token's f32 row quantized to INT8 on the device, then the product; both timed.
    /// N <= 32.
    W4A8,
    /// GGUF Q4_0's blocks (4-bit, f16 scale per 32) times 8-bit activations, as `w4a8`.
    Q4_0A8,
    /// SlideSparse on cuSPARSELt (`--pattern`), f16 values: the lifting, the library's 2:4
    /// product and the output conversion, all timed; the product alone on a line of its own.
    SlideLtF16,
    /// The same with INT8 values (per-row weight scales, per-token activation scales).
    SlideLtInt8,
    /// The same with FP8 e4m3 values.
    SlideLtFp8,
    /// Dense INT8 on cuBLASLt over the original M x K matrix (per-token quantization, the
    /// product, the scaling; all timed): the same-precision baseline of `slide-lt-int8`.
    CublasLtInt8,
    /// Dense FP8 e4m3 on cuBLASLt, as `cublaslt-int8`.
    CublasLtFp8,
}

impl Precision {
    pub const ALL: [Precision; 32] = [
        Precision::F16,
        Precision::W8A16,
        Precision::W4A16,
        Precision::GgufQ4_0,
        Precision::GgufQ8_0,
        Precision::W4K,
        Precision::W5K,
        Precision::W6K,
        Precision::W4G32Affine,
        Precision::BcbcInt8,
        Precision::BcbcInt4,
        Precision::BcbcF16,
        Precision::IeBmeInt4,
        Precision::IeBmeInt8,
        Precision::TcbcPerToken,
        Precision::TcbcDecodeGemm,
        Precision::TcbcSpmm,
        Precision::TcbcUnion,
        Precision::BcbcUnion,
        Precision::SlideF16,
        Precision::SlideF16Copy,
        Precision::W4A16Cols,
        Precision::Q4_0Cols,
        Precision::W4A16DecodeGemm,
        Precision::Q4KDecodeGemm,
        Precision::W4A8,
        Precision::Q4_0A8,
        Precision::SlideLtF16,
        Precision::SlideLtInt8,
        Precision::SlideLtFp8,
        Precision::CublasLtInt8,
        Precision::CublasLtFp8,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Precision::F16 => "f16",
            Precision::W8A16 => "w8a16",
            Precision::W4A16 => "w4a16",
            Precision::GgufQ4_0 => "gguf-q4_0",
            Precision::GgufQ8_0 => "gguf-q8_0",
            Precision::W4K => "q4_k-kernel",
            Precision::W5K => "q5_k-kernel",
            Precision::W6K => "q6_k-kernel",
            Precision::W4G32Affine => "q4_1-kernel",
            Precision::BcbcInt8 => "bcbc-int8",
            Precision::BcbcInt4 => "bcbc-int4",
            Precision::BcbcF16 => "bcbc-f16",
            Precision::IeBmeInt4 => "ie-bme-int4",
            Precision::IeBmeInt8 => "ie-bme-int8",
            Precision::TcbcPerToken => "tcbc-per-token",
            Precision::TcbcDecodeGemm => "tcbc-decode-gemm",
            Precision::TcbcSpmm => "tcbc-spmm",
            Precision::TcbcUnion => "tcbc-union",
            Precision::BcbcUnion => "bcbc-union",
            Precision::SlideF16 => "slide-f16",
            Precision::SlideF16Copy => "slide-f16-copy",
            Precision::W4A16Cols => "w4a16-cols",
            Precision::Q4_0Cols => "q4_0-cols",
            Precision::W4A16DecodeGemm => "w4a16-decode-gemm",
            Precision::Q4KDecodeGemm => "q4_k-decode-gemm",
            Precision::W4A8 => "w4a8",
            Precision::Q4_0A8 => "q4_0-a8",
            Precision::SlideLtF16 => "slide-lt-f16",
            Precision::SlideLtInt8 => "slide-lt-int8",
            Precision::SlideLtFp8 => "slide-lt-fp8",
            Precision::CublasLtInt8 => "cublaslt-int8",
            Precision::CublasLtFp8 => "cublaslt-fp8",
        }
    }
    /// The weight format a precision's rows multiply (`--formats` selects by it): dense
    /// (cuBLAS and the dense low-bit kernels, GGUF blocks included), balanced-cbc, ie-bme,
    /// tiled-cbc, slide, or lowbit-cols (column-major 4-bit under TEAL).
    pub fn format(self) -> &'static str {
        match self {
            Precision::F16
            | Precision::W8A16
            | Precision::W4A16
            | Precision::GgufQ4_0
            | Precision::GgufQ8_0
            | Precision::W4K
            | Precision::W5K
            | Precision::W6K
            | Precision::W4G32Affine
            | Precision::W4A16DecodeGemm
            | Precision::Q4KDecodeGemm
            | Precision::W4A8
            | Precision::Q4_0A8
            | Precision::CublasLtInt8
            | Precision::CublasLtFp8 => "dense",
            Precision::BcbcInt8
            | Precision::BcbcInt4
            | Precision::BcbcF16
            | Precision::BcbcUnion => "balanced-cbc",
            Precision::IeBmeInt4 | Precision::IeBmeInt8 => "ie-bme",
            Precision::TcbcPerToken
            | Precision::TcbcDecodeGemm
            | Precision::TcbcSpmm
            | Precision::TcbcUnion => "tiled-cbc",
            Precision::SlideF16
            | Precision::SlideF16Copy
            | Precision::SlideLtF16
            | Precision::SlideLtInt8
            | Precision::SlideLtFp8 => "slide",
            Precision::W4A16Cols | Precision::Q4_0Cols => "lowbit-cols",
        }
    }

    /// Every precision of the named formats (`--formats tiled-cbc,slide`), in [`Self::ALL`]'s
    /// order; an unknown name is an error listing the known ones.
    pub fn of_formats(formats: &[String]) -> Result<Vec<Precision>> {
        let known: Vec<&str> = Precision::ALL.iter().fold(Vec::new(), |mut v, p| {
            if !v.contains(&p.format()) {
                v.push(p.format());
            }
            v
        });
        if let Some(bad) = formats.iter().find(|f| !known.contains(&f.as_str())) {
            return Err(CudaError::Option(format!(
                "unknown format '{bad}' (known: {})",
                known.join(", ")
            )));
        }
        Ok(Precision::ALL
            .into_iter()
            .filter(|p| formats.iter().any(|f| f == p.format()))
            .collect())
    }

    /// The cuSPARSELt / cuBLASLt rows and their value type.
    fn library_precision(self) -> Option<LtPrecision> {
        match self {
            Precision::SlideLtF16 => Some(LtPrecision::F16),
            Precision::SlideLtInt8 | Precision::CublasLtInt8 => Some(LtPrecision::Int8),
            Precision::SlideLtFp8 | Precision::CublasLtFp8 => Some(LtPrecision::E4m3),
            _ => None,
        }
    }

    fn is_balanced(self) -> bool {
        matches!(
            self,
            Precision::BcbcInt8 | Precision::BcbcInt4 | Precision::BcbcF16
        )
    }
}

impl std::str::FromStr for Precision {
    type Err = CudaError;
    fn from_str(s: &str) -> Result<Self> {
        Precision::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let known: Vec<&str> = Precision::ALL.iter().map(|p| p.name()).collect();
                CudaError::Option(format!(
                    "unknown precision '{s}' (known: {})",
                    known.join(", ")
                ))
            })
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What to measure.
#[derive(Clone, Debug, PartialEq)]
pub struct GemmBenchOptions {
    pub shapes: Vec<String>,
    /// Tokens per product, each 1..=[`MAX_BENCH_TOKENS`] (the IE-BME rows stop at 32, the other
    /// kernels' rows at [`MAX_KERNEL_TOKENS`]).
    pub n: Vec<usize>,
    /// Weight sparsities of the Balanced-CBC rows.
    pub sp: Vec<f64>,
    /// Activation sparsities of the Balanced-CBC rows.
    pub dp: Vec<f64>,
    /// (2N-2):2N patterns of the `slide-f16` rows (e.g. 6:8).
    pub patterns: Vec<Pattern>,
    pub precisions: Vec<Precision>,
    pub reps: usize,
    pub graph: bool,
    pub graph_launches: usize,
    pub graph_replays: usize,
    pub seed: u64,
}

impl Default for GemmBenchOptions {
    fn default() -> Self {
        Self {
            shapes: vec!["llama2-7b".into()],
            n: vec![1, 2, 4, 8, 16, 32],
            sp: vec![0.5],
            dp: vec![0.0, 0.5],
            patterns: vec![Pattern::NM { n: 6, m: 8 }],
            precisions: vec![
                Precision::F16,
                Precision::W8A16,
                Precision::W4A16,
                Precision::GgufQ4_0,
                Precision::GgufQ8_0,
            ],
            reps: 100,
            graph: false,
            graph_launches: 64,
            graph_replays: 20,
            seed: 1,
        }
    }
}

/// Most tokens per product of the rows that multiply through a GEMM on the tensor cores (f16,
/// slide-f16 and the decode-gemm rows: [`Precision::takes_long_prompts`]), so that prompts of
/// thousands of tokens are measured (issue 29 asks up to 8192).
pub const MAX_BENCH_TOKENS: usize = 16384;

/// Most tokens per product of the other rows: the batched pass's chunk. The low-bit kernels
/// take 32 a launch and run larger N in launches of 32, as the batched pass does; the IE-BME
/// kernel's rows skip N above its 32.
pub const MAX_KERNEL_TOKENS: usize = 256;

impl Precision {
    /// Rows measured at every N up to [`MAX_BENCH_TOKENS`] (the others stop at
    /// [`MAX_KERNEL_TOKENS`]).
    pub fn takes_long_prompts(self) -> bool {
        matches!(
            self,
            Precision::F16
                | Precision::SlideF16
                | Precision::SlideF16Copy
                | Precision::SlideLtF16
                | Precision::SlideLtInt8
                | Precision::SlideLtFp8
                | Precision::CublasLtInt8
                | Precision::CublasLtFp8
                | Precision::TcbcDecodeGemm
                | Precision::W4A16DecodeGemm
                | Precision::Q4KDecodeGemm
        )
    }
}

impl GemmBenchOptions {
    pub fn validate(&self) -> Result<Vec<Shape>> {
        let bad = |m: String| Err(CudaError::Option(m));
        if self.n.is_empty() || self.n.iter().any(|&n| n == 0 || n > MAX_BENCH_TOKENS) {
            return bad(format!("--n takes 1..={MAX_BENCH_TOKENS} tokens"));
        }
        if self.precisions.is_empty() {
            return bad("no precision given".into());
        }
        for v in self.sp.iter().chain(&self.dp) {
            if !(0.0..1.0).contains(v) {
                return bad(format!("sparsity {v} outside [0, 1)"));
            }
        }
        if self.precisions.iter().any(|p| p.format() == "slide")
            || self
                .precisions
                .iter()
                .any(|p| p.library_precision().is_some())
        {
            if self.patterns.is_empty() {
                return bad("the slide and cuBLASLt rows need at least one --pattern".into());
            }
            for &p in &self.patterns {
                SlideOptions::from_pattern(p)?;
            }
        }
        if self.reps == 0 || (self.graph && (self.graph_launches == 0 || self.graph_replays == 0)) {
            return bad("--reps, --graph-launches and --graph-replays must be positive".into());
        }
        let mut shapes = Vec::new();
        for s in &self.shapes {
            shapes.extend(shapes_of(s)?);
        }
        if shapes.is_empty() {
            return bad("no shapes given".into());
        }
        Ok(shapes)
    }
}

/// One measured product.
#[derive(Serialize, Clone, Debug)]
pub struct GemmRow {
    pub precision: String,
    pub model: String,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub sp: f64,
    pub dp: f64,
    pub us: f64,
    pub us_min: f64,
    /// cuBLAS f16's event time on the same shape and N over this one.
    pub speedup_vs_cublas: f64,
    /// Bytes one product reads and writes (weights, scales, metadata of the columns it reads,
    /// activations, output).
    pub bytes: usize,
    pub gbs: f64,
    pub pct_copy_bw: f64,
    pub rel_error: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graph_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graph_speedup_vs_cublas: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graph_rel_error: Option<f64>,
}

#[derive(Serialize, Clone, Debug)]
pub struct GemmReport {
    pub device: DeviceInfo,
    pub copy_gbs: f64,
    pub empty_launch_us: f64,
    pub reps: usize,
    pub rows: Vec<GemmRow>,
}

struct Timed {
    event: Timing,
    graph: Option<(Timing, f64)>,
}

struct Ctx<'a> {
    gpu: &'a Gpu,
    opts: &'a GemmBenchOptions,
    l2: usize,
    copy_gbs: f64,
    rows: Vec<GemmRow>,
    progress: &'a mut dyn FnMut(&str),
}

impl Ctx<'_> {
    fn copies(&self, bytes: usize) -> usize {
        super::copies_for(bytes, self.l2)
    }

    /// Event timing, then (with `graph`) graph replays after which `y` is checked against
    /// `want`.
    fn time<F>(
        &self,
        copies: usize,
        y: &mut CudaSlice<f32>,
        want: &Expected,
        mut launch: F,
    ) -> Result<Timed>
    where
        F: FnMut(usize, &mut CudaSlice<f32>) -> Result<()>,
    {
        let gpu = self.gpu;
        let event = time_launches(gpu, WARMUP, self.opts.reps, |i| launch(i, y))?;
        if !self.opts.graph {
            return Ok(Timed { event, graph: None });
        }
        let launches = super::graph::graph_launches(self.opts.graph_launches, copies);
        let g = super::graph::capture(gpu, launches, |i| launch(i, y))?;
        for _ in 0..GRAPH_WARMUP {
            g.launch()?;
        }
        super::graph::poison(gpu, y)?;
        let t = super::graph::time_replays(gpu, &g, launches, self.opts.graph_replays)?;
        let got = gpu.download(y)?;
        let err = want.error(&got);
        Ok(Timed {
            event,
            graph: Some((t, err)),
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn record(
        &mut self,
        p: Precision,
        shape: &Shape,
        n: usize,
        sp: f64,
        dp: f64,
        t: &Timed,
        base: &Timed,
        bytes: usize,
        rel_error: f64,
    ) {
        let gbs = bytes as f64 / (t.event.median_us * 1e-6) / 1e9;
        let row = GemmRow {
            precision: p.name().into(),
            model: shape.model.clone(),
            m: shape.m,
            k: shape.k,
            n,
            sp,
            dp,
            us: t.event.median_us,
            us_min: t.event.min_us,
            speedup_vs_cublas: base.event.median_us / t.event.median_us,
            bytes,
            gbs,
            pct_copy_bw: 100.0 * gbs / self.copy_gbs,
            rel_error,
            graph_us: t.graph.map(|g| g.0.median_us),
            graph_speedup_vs_cublas: match (t.graph, base.graph) {
                (Some(g), Some(b)) => Some(b.0.median_us / g.0.median_us),
                _ => None,
            },
            graph_rel_error: t.graph.map(|g| g.1),
        };
        (self.progress)(&format!(
            "{:<10} {:>5}x{:<5} n={:<2} sp={:.2} dp={:.2} {:>8.2} µs {:>5.2}x cuBLAS {:>6.0} GB/s ({:>3.0}% copy){} err {:.1e}",
            row.precision,
            row.m,
            row.k,
            n,
            sp,
            dp,
            row.us,
            row.speedup_vs_cublas,
            row.gbs,
            row.pct_copy_bw,
            match (row.graph_us, row.graph_speedup_vs_cublas) {
                (Some(g), Some(s)) => format!(", graph {g:.2} µs {s:.2}x"),
                _ => String::new(),
            },
            rel_error
        ));
        self.rows.push(row);
    }
}

/// f64 products of the dequantized weights `w` (M x K row-major) with the first `n` rows of
/// `x` (N x K), on all cores: `y` n x M.
fn reference_product(w: &[f64], m: usize, k: usize, x: &[f64], n: usize) -> Vec<f64> {
    let mut y = vec![0f64; n * m];
    let threads = std::thread::available_parallelism()
        .map(|t| t.get())
        .unwrap_or(1)
        .min(32);
    let per = m.div_ceil(threads).max(1);
    let parts: Vec<Vec<f64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..m.div_ceil(per))
            .map(|ti| {
                s.spawn(move || {
                    let rows = ti * per..((ti + 1) * per).min(m);
                    let mut out = vec![0f64; rows.len() * n];
                    for (ri, r) in rows.enumerate() {
                        let wr = &w[r * k..(r + 1) * k];
                        for t in 0..n {
                            let xr = &x[t * k..(t + 1) * k];
                            out[ri * n + t] = wr.iter().zip(xr).map(|(a, b)| a * b).sum();
                        }
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (ti, part) in parts.iter().enumerate() {
        for (ri, chunk) in part.chunks(n).enumerate() {
            let r = ti * per + ri;
            for t in 0..n {
                y[t * m + r] = chunk[t];
            }
        }
    }
    y
}

/// `x` under the TEAL threshold (inactive inputs 0), as f64 for the reference.
fn masked(x: &[f32], thr: sieve_formats::Threshold) -> Vec<f64> {
    x.iter()
        .map(|&v| {
            if sieve_formats::format::is_active(v, thr) {
                v as f64
            } else {
                0.0
            }
        })
        .collect()
}

/// What a product's output (N x M) is checked against: the f64 reference rows of `tokens`.
/// Every token up to [`MAX_KERNEL_TOKENS`]; a spread of them beyond ([`checked_tokens`]), where
/// a full f64 reference would take minutes per shape.
struct Expected {
    m: usize,
    tokens: Vec<usize>,
    /// `tokens.len()` x M.
    y: Vec<f64>,
}

impl Expected {
    /// Every row of a reference of `y.len() / m` tokens.
    fn all(m: usize, y: Vec<f64>) -> Self {
        Self {
            m,
            tokens: (0..y.len() / m.max(1)).collect(),
            y,
        }
    }

    /// Max relative error of `got`'s checked rows.
    fn error(&self, got: &[f32]) -> f64 {
        let rows: Vec<f32> = gather_rows(got, self.m, &self.tokens);
        max_rel_error(&rows, &self.y)
    }
}

/// The tokens checked of an `n`-token product: all up to [`MAX_KERNEL_TOKENS`], else the
/// first, last and quarter points (each token's row is its own dot products: a wrong row
/// offset, tile or split anywhere shows in these).
fn checked_tokens(n: usize) -> Vec<usize> {
    if n <= MAX_KERNEL_TOKENS {
        return (0..n).collect();
    }
    let mut t = vec![0, 1, n / 4, n / 2, 3 * n / 4, n - 2, n - 1];
    t.sort_unstable();
    t.dedup();
    t
}

/// Rows `tokens` of the row-major `x` of rows of `width`.
fn gather_rows<T: Copy>(x: &[T], width: usize, tokens: &[usize]) -> Vec<T> {
    tokens
        .iter()
        .flat_map(|&t| x[t * width..(t + 1) * width].iter().copied())
        .collect()
}

/// The reference of an `n`-token product of `w` (M x K) with `x` (at least n x K): the first
/// `n` rows of `prefix` (the reference of the first min(max N, [`MAX_KERNEL_TOKENS`]) tokens)
/// up to [`MAX_KERNEL_TOKENS`], the rows of [`checked_tokens`] computed here beyond.
fn expected(w: &[f64], m: usize, k: usize, x: &[f64], n: usize, prefix: &[f64]) -> Expected {
    let tokens = checked_tokens(n);
    if n <= MAX_KERNEL_TOKENS {
        return Expected {
            m,
            tokens,
            y: prefix[..n * m].to_vec(),
        };
    }
    let xs = gather_rows(x, k, &tokens);
    let y = reference_product(w, m, k, &xs, tokens.len());
    Expected { m, tokens, y }
}

/// Tokens of the shared reference prefix: the largest N up to [`MAX_KERNEL_TOKENS`].
fn prefix_tokens(opts: &GemmBenchOptions) -> usize {
    opts.n
        .iter()
        .copied()
        .filter(|&n| n <= MAX_KERNEL_TOKENS)
        .max()
        .unwrap_or(1)
}

pub fn run(opts: &GemmBenchOptions, progress: &mut dyn FnMut(&str)) -> Result<GemmReport> {
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
    let _workspace = if opts.graph {
        Some(super::graph::CublasWorkspace::bind(
            &gpu,
            super::graph::CublasWorkspace::BYTES,
        )?)
    } else {
        None
    };
    let mut ctx = Ctx {
        gpu: &gpu,
        opts,
        l2,
        copy_gbs,
        rows: Vec::new(),
        progress,
    };
    for (si, shape) in shapes.iter().enumerate() {
        bench_shape(&mut ctx, shape, opts.seed.wrapping_add(1000 * si as u64))?;
    }
    Ok(GemmReport {
        device: info,
        copy_gbs,
        empty_launch_us,
        reps: opts.reps,
        rows: ctx.rows,
    })
}

fn bench_shape(ctx: &mut Ctx, shape: &Shape, seed: u64) -> Result<()> {
    let gpu = ctx.gpu;
    let opts = ctx.opts;
    let (m, k) = (shape.m, shape.k);
    let nmax = *opts.n.iter().max().unwrap_or(&1);
    let w0 = sparse_matrix(m, k, 0.0, Pattern::Unstructured, seed)?;
    let x16: Vec<f16> = activations(nmax * k, seed ^ 7)
        .into_iter()
        .map(f16::from_f32)
        .collect();
    let xf: Vec<f64> = x16.iter().map(|v| v.to_f64()).collect();

    // cuBLAS f16: the baseline of every row of this shape.
    let dense: Vec<GpuDense> = (0..ctx.copies(m * k * 2))
        .map(|_| GpuDense::upload(gpu, &w0))
        .collect::<Result<_>>()?;
    let blas = Cublas::new(gpu, &dense[0])?;
    let w0f: Vec<f64> = w0.data().iter().map(|v| v.to_f64()).collect();
    let want0 = reference_product(&w0f, m, k, &xf, prefix_tokens(opts));
    let mut bases = Vec::new();
    for &n in &opts.n {
        let xd = gpu.upload(&x16[..n * k])?;
        let mut y = gpu.poisoned_f32(n * m)?;
        let want = expected(&w0f, m, k, &xf, n, &want0);
        blas.gemm(gpu, &dense[0], &xd, n, &mut y)?;
        let err = want.error(&gpu.download(&y)?);
        let nd = dense.len();
        let t = ctx.time(nd, &mut y, &want, |i, y| {
            blas.gemm(gpu, &dense[i % nd], &xd, n, y)
        })?;
        let bytes = m * k * 2 + n * k * 2 + n * m * 4;
        if opts.precisions.contains(&Precision::F16) {
            ctx.record(Precision::F16, shape, n, 0.0, 0.0, &t, &t, bytes, err);
        }
        bases.push(t);
    }
    drop(dense);

    for &p in &opts.precisions {
        let lb = match p {
            Precision::W8A16 => LowBitMatrix::quantize(&w0, LowBitKind::W8Row),
            Precision::W4A16 => LowBitMatrix::quantize(&w0, LowBitKind::W4G128),
            Precision::GgufQ4_0 => LowBitMatrix::from_q4_0(m, k, &quantize_q4_0(&w0)?)?,
            Precision::GgufQ8_0 => LowBitMatrix::from_q8_0(m, k, &quantize_q8_0(&w0)?)?,
            Precision::W4K => LowBitMatrix::quantize(&w0, LowBitKind::W4K),
            Precision::W5K => LowBitMatrix::quantize(&w0, LowBitKind::W5K),
            Precision::W6K => LowBitMatrix::quantize(&w0, LowBitKind::W6K),
            Precision::W4G32Affine => LowBitMatrix::quantize(&w0, LowBitKind::W4G32Affine),
            Precision::W4A16DecodeGemm => LowBitMatrix::quantize(&w0, LowBitKind::W4G128),
            Precision::Q4KDecodeGemm => LowBitMatrix::quantize(&w0, LowBitKind::W4K),
            _ => continue,
        };
        let decode_gemm = matches!(p, Precision::W4A16DecodeGemm | Precision::Q4KDecodeGemm);
        let wq: Vec<f64> = lb.dequantize().into_iter().map(|v| v as f64).collect();
        let want_all = reference_product(&wq, m, k, &xf, prefix_tokens(opts));
        let bytes_w = lb.device_bytes();
        let copies: Vec<GpuLowBit> = (0..ctx.copies(bytes_w))
            .map(|_| GpuLowBit::upload(gpu, &lb))
            .collect::<Result<_>>()?;
        let (kp, mp) = (copies[0].padded_cols(), copies[0].padded_rows());
        // The f16 copy (Mp x Kp), rewritten by every product as in the batched pass.
        let decoded = if decode_gemm {
            Some(crate::dense::zeroed_f16(gpu, mp * kp)?)
        } else {
            None
        };
        for (ni, &n) in opts.n.iter().enumerate() {
            if n > MAX_KERNEL_TOKENS && !p.takes_long_prompts() {
                continue;
            }
            let xd = gpu.upload(&pad_activations(&x16[..n * k], n, k, kp))?;
            let x16d = gpu.upload(&x16[..n * k])?;
            let mut y = gpu.poisoned_f32(n * m)?;
            let want = expected(&wq, m, k, &xf, n, &want_all);
            let launch = |i: usize, y: &mut CudaSlice<f32>| -> Result<()> {
                let w = &copies[i % copies.len()];
                use crate::product::dev_ptr;
                match &decoded {
                    // Past 32 tokens in launches of 32, as the batched pass runs it.
                    None => (0..n).step_by(MAX_TOKENS).try_for_each(|t0| {
                        w.launch_ptr(
                            gpu,
                            dev_ptr(gpu, &xd) + (t0 * kp * 2) as u64,
                            (n - t0).min(MAX_TOKENS),
                            dev_ptr(gpu, y) + (t0 * m * 4) as u64,
                            m,
                            false,
                        )
                    }),
                    Some(d) => {
                        w.decode_rows_f16(gpu, dev_ptr(gpu, d))?;
                        gemm_on_copy(gpu, dev_ptr(gpu, d), kp, m, k, dev_ptr(gpu, &x16d), n, y)
                    }
                }
            };
            launch(0, &mut y)?;
            let err = want.error(&gpu.download(&y)?);
            let t = ctx.time(copies.len(), &mut y, &want, launch)?;
            let bytes = if decode_gemm {
                // Read the blocks, write and read back the f16 copy, the GEMM's x and y.
                bytes_w + 2 * mp * kp * 2 + n * k * 2 + n * m * 4
            } else {
                bytes_w + n * kp * 2 + n * m * 4
            };
            ctx.record(p, shape, n, 0.0, 0.0, &t, &bases[ni], bytes, err);
        }
    }

    bench_w4a8(ctx, shape, seed, &x16, &bases)?;
    bench_lowbit_cols(ctx, shape, seed, &bases)?;
    bench_ie_bme(ctx, shape, seed, &x16, &bases)?;
    bench_tiled_cbc(ctx, shape, seed, &x16, &bases)?;
    bench_unions(ctx, shape, seed, &bases)?;
    bench_slide(ctx, shape, seed, &x16, &bases)?;
    bench_slide_lt(ctx, shape, seed, &x16, &bases)?;

    // Balanced-CBC rows: matrix-vector products with TEAL thresholds.
    let balanced: Vec<Precision> = opts
        .precisions
        .iter()
        .copied()
        .filter(|p| p.is_balanced())
        .collect();
    if balanced.is_empty() {
        return Ok(());
    }
    let Some(ni) = opts.n.iter().position(|&n| n == 1) else {
        return Err(CudaError::Option(
            "Balanced-CBC precisions are matrix-vector products: --n must include 1".into(),
        ));
    };
    for (pi, &sp) in opts.sp.iter().enumerate() {
        let slots = slots_for_sparsity(sp)?;
        let wb = sieve_formats::random::balanced_matrix(m, k, slots, seed ^ (0x20 + pi as u64))?;
        for &p in &balanced {
            // The f16 kernel runs on the int8-snapped matrix (same nonzeros, f16 values).
            let values = match p {
                Precision::BcbcInt4 => LowBitValues::Int4 { group: 128 },
                _ => LowBitValues::Int8,
            };
            let (enc, wq) = snap_balanced(&wb, slots, values)?;
            let wqf: Vec<f64> = wq.data().iter().map(|v| v.to_f64()).collect();
            let f16_blocks = if p == Precision::BcbcF16 {
                Some(BalancedCbc::encode_with_slots(&wq, slots)?)
            } else {
                None
            };
            let upload = || -> Result<Box<dyn GpuMatVec>> {
                Ok(match &f16_blocks {
                    Some(b) => Box::new(GpuBalancedCbc::upload(gpu, b)?),
                    None => Box::new(GpuBalancedLowBit::upload(gpu, &enc)?),
                })
            };
            let first = upload()?;
            let bytes_all = first.bytes_for(&vec![true; k]);
            let mut copies = vec![first];
            for _ in 1..ctx.copies(bytes_all) {
                copies.push(upload()?);
            }
            for (di, &dp) in opts.dp.iter().enumerate() {
                let x = activations(k, seed ^ (0x100 + di as u64));
                let thr = threshold_for_sparsity(&x, dp)?;
                let xm = masked(&x, thr);
                let want = Expected::all(m, reference_product(&wqf, m, k, &xm, 1));
                let xd = gpu.upload(&x)?;
                let mut y = gpu.poisoned_f32(m)?;
                copies[0].launch(gpu, &xd, thr, &mut y)?;
                gpu.synchronize()?;
                let err = want.error(&gpu.download(&y)?);
                let nc = copies.len();
                let t = ctx.time(nc, &mut y, &want, |i, y| {
                    copies[i % nc].launch(gpu, &xd, thr, y)
                })?;
                let bytes = copies[0].bytes_for(&crate::product::active_mask(&x, thr));
                ctx.record(p, shape, 1, sp, dp, &t, &bases[ni], bytes, err);
            }
        }
    }
    Ok(())
}

/// W4A8 rows (4-bit weights, 8-bit activations) at every N up to 32: the product of activations
/// already quantized, as the W4A16 rows take activations already in f16 (each path's
/// preparation of its inputs is one small launch in the step); the device quantization is timed
/// alone on a line of its own. Checked against the f64 product of the same quantized weights
/// and activations.
fn bench_w4a8(ctx: &mut Ctx, shape: &Shape, seed: u64, x16: &[f16], bases: &[Timed]) -> Result<()> {
    use crate::w4a8::{quantize_reference, GpuW4A8, Int8Activations};
    let gpu = ctx.gpu;
    let opts = ctx.opts;
    let (m, k) = (shape.m, shape.k);
    let nmax = opts
        .n
        .iter()
        .copied()
        .filter(|&n| n <= MAX_TOKENS)
        .max()
        .unwrap_or(0);
    let w0 = sparse_matrix(m, k, 0.0, Pattern::Unstructured, seed)?;
    let xf32: Vec<f32> = x16.iter().map(|v| v.to_f32()).collect();
    for &p in &opts.precisions {
        let lb = match p {
            Precision::W4A8 => LowBitMatrix::quantize(&w0, LowBitKind::W4G128),
            Precision::Q4_0A8 => LowBitMatrix::from_q4_0(m, k, &quantize_q4_0(&w0)?)?,
            _ => continue,
        };
        if nmax == 0 {
            continue;
        }
        let wq: Vec<f64> = lb.dequantize().into_iter().map(|v| v as f64).collect();
        // The activations as the kernel multiplies them: each token's codes times its scale.
        let xq: Vec<f64> = quantize_reference(&xf32[..nmax * k], nmax, k, None)
            .iter()
            .flat_map(|r| r.dequantize())
            .map(|v| v as f64)
            .collect();
        let want_all = reference_product(&wq, m, k, &xq, nmax);
        let bytes_w = lb.device_bytes();
        let copies: Vec<GpuW4A8> = (0..ctx.copies(bytes_w))
            .map(|_| GpuW4A8::upload(gpu, &lb))
            .collect::<Result<_>>()?;
        let nc = copies.len();
        let kp = copies[0].matrix().padded_cols();
        for (ni, &n) in opts.n.iter().enumerate() {
            if n > MAX_TOKENS {
                continue;
            }
            let xd = gpu.upload(&xf32[..n * k])?;
            let acts = Int8Activations::new(gpu, n, kp)?;
            let mut y = gpu.poisoned_f32(n * m)?;
            let want = Expected::all(m, want_all[..n * m].to_vec());
            let xp = crate::product::dev_ptr(gpu, &xd);
            acts.quantize(gpu, xp, k, k, n, None)?;
            let launch = |i: usize, y: &mut CudaSlice<f32>| -> Result<()> {
                copies[i % nc].launch(gpu, &acts, n, y, false)
            };
            launch(0, &mut y)?;
            let err = want.error(&gpu.download(&y)?);
            let t = ctx.time(nc, &mut y, &want, launch)?;
            // Weights and scales, the codes and their scales read, y.
            let bytes = bytes_w + n * kp + n * kp / 32 + n * m * 4;
            ctx.record(p, shape, n, 0.0, 0.0, &t, &bases[ni], bytes, err);
            let q = crate::timing::time_launches(gpu, 10, opts.reps, |_| {
                acts.quantize(gpu, xp, k, k, n, None)
            })?;
            (ctx.progress)(&format!(
                "{:<10} {:>5}x{:<5} n={:<2} the activations' quantization alone: {:.2} µs",
                p.name(),
                m,
                k,
                n,
                q.median_us
            ));
        }
    }
    Ok(())
}

/// Column-major 4-bit rows: N = 1, every sp (weights pruned, then quantized) and dp (TEAL
/// thresholds from the activations' quantiles).
fn bench_lowbit_cols(ctx: &mut Ctx, shape: &Shape, seed: u64, bases: &[Timed]) -> Result<()> {
    use crate::lowbit_cols::{ColumnLayout, GpuLowBitCols};
    let gpu = ctx.gpu;
    let opts = ctx.opts;
    let (m, k) = (shape.m, shape.k);
    for &p in &opts.precisions {
        let kind = match p {
            Precision::W4A16Cols => LowBitKind::W4G128,
            Precision::Q4_0Cols => LowBitKind::W4G32,
            _ => continue,
        };
        let Some(ni) = opts.n.iter().position(|&n| n == 1) else {
            return Err(CudaError::Option(format!(
                "{p} is a matrix-vector product: --n must include 1"
            )));
        };
        for (pi, &sp) in opts.sp.iter().enumerate() {
            let w = sparse_matrix(m, k, sp, Pattern::Unstructured, seed ^ (0x60 + pi as u64))?;
            let lb = match kind {
                LowBitKind::W4G32 => LowBitMatrix::from_q4_0(m, k, &quantize_q4_0(&w)?)?,
                _ => LowBitMatrix::quantize(&w, kind),
            };
            let wq: Vec<f64> = lb.dequantize().into_iter().map(|v| v as f64).collect();
            let layout = ColumnLayout::new(&lb)?;
            let copies: Vec<GpuLowBitCols> = (0..ctx.copies(layout.bytes()))
                .map(|_| GpuLowBitCols::upload_layout(gpu, &layout))
                .collect::<Result<_>>()?;
            let nc = copies.len();
            for (di, &dp) in opts.dp.iter().enumerate() {
                let x = activations(k, seed ^ (0x180 + di as u64));
                let thr = threshold_for_sparsity(&x, dp)?;
                // The kernel masks the f32 inputs, then rounds them to f16: so does the
                // reference (rounding first moves inputs at the threshold across it).
                let xm: Vec<f64> = masked(&x, thr)
                    .into_iter()
                    .map(|v| f16::from_f64(v).to_f64())
                    .collect();
                let want = Expected::all(m, reference_product(&wq, m, k, &xm, 1));
                let xd = gpu.upload(&x)?;
                let mut y = gpu.poisoned_f32(m)?;
                copies[0].launch(gpu, &xd, thr, &mut y)?;
                gpu.synchronize()?;
                let err = want.error(&gpu.download(&y)?);
                let t = ctx.time(nc, &mut y, &want, |i, y| {
                    copies[i % nc].launch(gpu, &xd, thr, y)
                })?;
                let bytes = copies[0].bytes_for(&crate::product::active_mask(&x, thr));
                ctx.record(p, shape, 1, sp, dp, &t, &bases[ni], bytes, err);
            }
        }
    }
    Ok(())
}

/// IE-BME rows: every N at dp 0, and at N = 1 every dp (TEAL thresholds inside the kernel), for
/// every weight sparsity.
fn bench_ie_bme(
    ctx: &mut Ctx,
    shape: &Shape,
    seed: u64,
    x16: &[f16],
    bases: &[Timed],
) -> Result<()> {
    let gpu = ctx.gpu;
    let opts = ctx.opts;
    let (m, k) = (shape.m, shape.k);
    let nmax = *opts.n.iter().max().unwrap_or(&1);
    let xf32: Vec<f32> = x16.iter().map(|v| v.to_f32()).collect();
    for &p in &opts.precisions {
        let payload = match p {
            Precision::IeBmeInt4 => Payload::Int4 { group_size: 128 },
            Precision::IeBmeInt8 => Payload::Int8 { group_size: 128 },
            _ => continue,
        };
        for (pi, &sp) in opts.sp.iter().enumerate() {
            let w = sparse_matrix(m, k, sp, Pattern::Unstructured, seed ^ (0x40 + pi as u64))?;
            let enc = IeBme::encode(
                &w,
                &IeBmeOptions {
                    payload,
                    reorder: Reorder::Greedy,
                    ..IeBmeOptions::default()
                },
            )?;
            let layout = IeBmeDevice::new(&enc)?;
            let wq: Vec<f64> = enc.decode().data().iter().map(|v| v.to_f64()).collect();
            let xf: Vec<f64> = x16.iter().map(|v| v.to_f64()).collect();
            let want_all = reference_product(&wq, m, k, &xf, nmax.min(crate::ie_bme::MAX_TOKENS));
            let bytes_w = layout.device_bytes();
            let copies: Vec<GpuIeBme> = (0..ctx.copies(bytes_w))
                .map(|_| GpuIeBme::upload(gpu, &layout))
                .collect::<Result<_>>()?;
            let nc = copies.len();
            for (ni, &n) in opts.n.iter().enumerate() {
                if n > crate::ie_bme::MAX_TOKENS {
                    continue;
                }
                let xd = gpu.upload(&xf32[..n * k])?;
                let mut y = gpu.poisoned_f32(n * m)?;
                let want = expected(&wq, m, k, &xf, n, &want_all);
                copies[0].launch_tokens(gpu, &xd, n, None, &mut y)?;
                let err = want.error(&gpu.download(&y)?);
                let t = ctx.time(nc, &mut y, &want, |i, y| {
                    copies[i % nc].launch_tokens(gpu, &xd, n, None, y)
                })?;
                let bytes = bytes_w + n * k * 4 + n * m * 4;
                ctx.record(p, shape, n, sp, 0.0, &t, &bases[ni], bytes, err);
                if n != 1 {
                    continue;
                }
                for &dp in opts.dp.iter().filter(|&&dp| dp > 0.0) {
                    let x = &xf32[..k];
                    let thr = threshold_for_sparsity(x, dp)?;
                    let xm = masked(x, thr);
                    let want = Expected::all(m, reference_product(&wq, m, k, &xm, 1));
                    copies[0].launch_tokens(gpu, &xd, 1, thr, &mut y)?;
                    let err = want.error(&gpu.download(&y)?);
                    let t = ctx.time(nc, &mut y, &want, |i, y| {
                        copies[i % nc].launch_tokens(gpu, &xd, 1, thr, y)
                    })?;
                    ctx.record(p, shape, 1, sp, dp, &t, &bases[ni], bytes, err);
                }
            }
        }
    }
    Ok(())
}

/// Tiled-CBC rows at every sp and N (dp 0): N single-token products, decode to f16 and one
/// cuBLAS GEMM (see [`Precision::TcbcDecodeGemm`]), or the tensor-core SpMM.
fn bench_tiled_cbc(
    ctx: &mut Ctx,
    shape: &Shape,
    seed: u64,
    x16: &[f16],
    bases: &[Timed],
) -> Result<()> {
    use crate::product::{dev_ptr, GpuAccumulate};
    use crate::tiled_cbc::GpuTiledCbc;
    let gpu = ctx.gpu;
    let opts = ctx.opts;
    let wanted: Vec<Precision> = opts
        .precisions
        .iter()
        .copied()
        .filter(|p| {
            matches!(
                p,
                Precision::TcbcPerToken | Precision::TcbcDecodeGemm | Precision::TcbcSpmm
            )
        })
        .collect();
    if wanted.is_empty() {
        return Ok(());
    }
    let (m, k) = (shape.m, shape.k);
    let xf32: Vec<f32> = x16.iter().map(|v| v.to_f32()).collect();
    let xf: Vec<f64> = x16.iter().map(|v| v.to_f64()).collect();
    for (pi, &sp) in opts.sp.iter().enumerate() {
        let w = sparse_matrix(m, k, sp, Pattern::Unstructured, seed ^ (0x60 + pi as u64))?;
        let enc = sieve_formats::tiled_cbc::TiledCbc::encode(&w)?;
        let wq: Vec<f64> = enc.decode().data().iter().map(|v| v.to_f64()).collect();
        let want_all = reference_product(&wq, m, k, &xf, prefix_tokens(opts));
        let first = GpuTiledCbc::upload(gpu, &enc)?;
        let bytes_w = first.bytes_for(&vec![true; k]);
        let mut copies = vec![first];
        for _ in 1..ctx.copies(bytes_w) {
            copies.push(GpuTiledCbc::upload(gpu, &enc)?);
        }
        let nc = copies.len();
        // The decoded K x M f16 operand, rewritten by every product (one buffer: its write is
        // part of the cost, as in the batched pass).
        let decoded = crate::dense::zeroed_f16(gpu, m * k)?;
        for (ni, &n) in opts.n.iter().enumerate() {
            let want = expected(&wq, m, k, &xf, n, &want_all);
            let xd = gpu.upload(&xf32[..n * k])?;
            let x16d = gpu.upload(&x16[..n * k])?;
            for &p in &wanted {
                if n > MAX_KERNEL_TOKENS && !p.takes_long_prompts() {
                    continue;
                }
                // Poisoned per precision, so that each one's check sees only its own output.
                let mut y = gpu.poisoned_f32(n * m)?;
                let launch = |i: usize, y: &mut CudaSlice<f32>| -> Result<()> {
                    let w = &copies[i % nc];
                    let yp = dev_ptr(gpu, y);
                    match p {
                        Precision::TcbcPerToken => {
                            // SAFETY: y holds n rows of m floats.
                            unsafe { gpu.zero_bytes(yp, n * m * 4) }?;
                            for t in 0..n {
                                let xt = dev_ptr(gpu, &xd) + (t * k * 4) as u64;
                                w.launch_add(gpu, xt, None, yp + (t * m * 4) as u64)?;
                            }
                            Ok(())
                        }
                        Precision::TcbcSpmm => {
                            w.spmm_rows(gpu, dev_ptr(gpu, &x16d), k, n, yp, m, false)
                        }
                        _ => {
                            let dp = dev_ptr(gpu, &decoded);
                            w.decode_transposed(gpu, dp)?;
                            // D is K x M row-major (the decoded, transposed matrix).
                            crate::dense::gemm_f16_rows(
                                gpu,
                                dp,
                                m,
                                true,
                                m,
                                k,
                                dev_ptr(gpu, &x16d),
                                n,
                                yp,
                                m,
                                0.0,
                            )?;
                            Ok(())
                        }
                    }
                };
                launch(0, &mut y)?;
                let err = want.error(&gpu.download(&y)?);
                let t = ctx.time(nc, &mut y, &want, launch)?;
                // `bytes_w` already holds one product's f32 x and y.
                let bytes = match p {
                    Precision::TcbcPerToken => n * bytes_w,
                    // The encoding once, the f16 x, the f32 y.
                    Precision::TcbcSpmm => bytes_w - k * 4 - m * 4 + n * k * 2 + n * m * 4,
                    // Read the encoding (not x or y), write and read back the f16 matrix, the
                    // GEMM's f16 x and f32 y.
                    _ => bytes_w - k * 4 - m * 4 + 2 * m * k * 2 + n * k * 2 + n * m * 4,
                };
                ctx.record(p, shape, n, sp, 0.0, &t, &bases[ni], bytes, err);
            }
        }
    }
    Ok(())
}

/// The union products' rows (`tcbc-union`, `bcbc-union`) at every sp, dp and N up to each
/// format's limit: N tokens of fresh activations under one threshold (the dp-quantile of all
/// of them, as a layer's stored threshold), each masked on its own; bytes are the columns of
/// the union once, with every token's x and y.
fn bench_unions(ctx: &mut Ctx, shape: &Shape, seed: u64, bases: &[Timed]) -> Result<()> {
    use crate::product::{active_mask, dev_ptr};
    use crate::tiled_cbc::GpuTiledCbc;
    let gpu = ctx.gpu;
    let opts = ctx.opts;
    let (m, k) = (shape.m, shape.k);
    for &p in &opts.precisions {
        let most = match p {
            Precision::TcbcUnion => crate::tiled_cbc::UNION_MAX_TOKENS,
            Precision::BcbcUnion => crate::balanced_cbc::UNION_MAX_TOKENS,
            _ => continue,
        };
        for (pi, &sp) in opts.sp.iter().enumerate() {
            // The matrix, its f64 values for the reference, and copies to rotate through.
            let (copies, wq): (Vec<Box<dyn UnionProduct>>, Vec<f64>) = if p == Precision::TcbcUnion
            {
                let w = sparse_matrix(m, k, sp, Pattern::Unstructured, seed ^ (0x70 + pi as u64))?;
                let enc = sieve_formats::tiled_cbc::TiledCbc::encode(&w)?;
                let wq = enc.decode().data().iter().map(|v| v.to_f64()).collect();
                let first = GpuTiledCbc::upload(gpu, &enc)?;
                let n_copies = ctx.copies(first.bytes_for(&vec![true; k]));
                let mut c: Vec<Box<dyn UnionProduct>> = vec![Box::new(first)];
                for _ in 1..n_copies {
                    c.push(Box::new(GpuTiledCbc::upload(gpu, &enc)?));
                }
                (c, wq)
            } else {
                let slots = slots_for_sparsity(sp)?;
                let w =
                    sieve_formats::random::balanced_matrix(m, k, slots, seed ^ (0x78 + pi as u64))?;
                let enc = BalancedCbc::encode_with_slots(&w, slots)?;
                let wq = w.data().iter().map(|v| v.to_f64()).collect();
                let first = GpuBalancedCbc::upload(gpu, &enc)?;
                let n_copies = ctx.copies(first.bytes_for(&vec![true; k]));
                let mut c: Vec<Box<dyn UnionProduct>> = vec![Box::new(first)];
                for _ in 1..n_copies {
                    c.push(Box::new(GpuBalancedCbc::upload(gpu, &enc)?));
                }
                (c, wq)
            };
            let nc = copies.len();
            for (di, &dp) in opts.dp.iter().enumerate() {
                for (ni, &n) in opts.n.iter().enumerate() {
                    if n > most {
                        continue;
                    }
                    let x = activations(n * k, seed ^ (0x300 + 16 * di as u64 + n as u64));
                    let thr = threshold_for_sparsity(&x, dp)?;
                    let want = Expected::all(m, reference_product(&wq, m, k, &masked(&x, thr), n));
                    let xd = gpu.upload(&x)?;
                    let mut y = gpu.poisoned_f32(n * m)?;
                    let launch = |i: usize, y: &mut CudaSlice<f32>| -> Result<()> {
                        let yp = dev_ptr(gpu, y);
                        // SAFETY: y holds n rows of m floats.
                        unsafe { gpu.zero_bytes(yp, n * m * 4) }?;
                        copies[i % nc].union_rows(gpu, dev_ptr(gpu, &xd), k, n, thr, yp, m)
                    };
                    launch(0, &mut y)?;
                    let err = want.error(&gpu.download(&y)?);
                    let t = ctx.time(nc, &mut y, &want, launch)?;
                    let mask = active_mask(&x, thr);
                    let union: Vec<bool> = (0..k)
                        .map(|c| (0..n).any(|tok| mask[tok * k + c]))
                        .collect();
                    // bytes_for counts one token's x and y.
                    let bytes = copies[0].bytes_for(&union) + (n - 1) * (k + m) * 4;
                    ctx.record(p, shape, n, sp, dp, &t, &bases[ni], bytes, err);
                }
            }
        }
    }
    Ok(())
}

/// What [`bench_unions`] times: a format's union product (its byte count is the format's).
trait UnionProduct: GpuMatVec {
    #[allow(clippy::too_many_arguments)]
    fn union_rows(
        &self,
        gpu: &Gpu,
        x: crate::product::DevPtr,
        ldx: usize,
        n: usize,
        threshold: sieve_formats::Threshold,
        y: crate::product::DevPtr,
        ldy: usize,
    ) -> Result<()>;
}

macro_rules! union_product {
    ($t:ty) => {
        impl UnionProduct for $t {
            fn union_rows(
                &self,
                gpu: &Gpu,
                x: crate::product::DevPtr,
                ldx: usize,
                n: usize,
                threshold: sieve_formats::Threshold,
                y: crate::product::DevPtr,
                ldy: usize,
            ) -> Result<()> {
                <$t>::union_rows(self, gpu, x, ldx, n, threshold, y, ldy)
            }
        }
    };
}
union_product!(crate::tiled_cbc::GpuTiledCbc);
union_product!(GpuBalancedCbc);

/// `y = x · Wᵀ` (cuBLAS, y written, M floats a row) with W the f16 copy at `w`, rows `ld`
/// apart: the GEMM of the rows that decode a matrix to f16 first.
#[allow(clippy::too_many_arguments)]
fn gemm_on_copy(
    gpu: &Gpu,
    w: crate::product::DevPtr,
    ld: usize,
    m: usize,
    k: usize,
    x16: crate::product::DevPtr,
    n: usize,
    y: &mut CudaSlice<f32>,
) -> Result<()> {
    let yp = crate::product::dev_ptr(gpu, y);
    crate::dense::gemm_f16_rows(gpu, w, ld, false, m, k, x16, n, yp, m, 0.0)
}

/// SlideSparse rows at every (2N-2):2N pattern and N (dp 0): f32 activations lifted to f16
/// (`slide_lift_rows`), then the `mma.sp` product; both launches timed. `sp` is the pattern's
/// 2 / 2N.
fn bench_slide(
    ctx: &mut Ctx,
    shape: &Shape,
    seed: u64,
    x16: &[f16],
    bases: &[Timed],
) -> Result<()> {
    use crate::product::dev_ptr;
    use crate::slide::{reference, GpuSlide};
    let (by_mma, by_copy) = (
        ctx.opts.precisions.contains(&Precision::SlideF16),
        ctx.opts.precisions.contains(&Precision::SlideF16Copy),
    );
    if !by_mma && !by_copy {
        return Ok(());
    }
    let gpu = ctx.gpu;
    let opts = ctx.opts;
    let (m, k) = (shape.m, shape.k);
    let nmax = *opts.n.iter().max().unwrap_or(&1);
    // Already f16-exact, so the lifting's rounding changes nothing and the reference sees the
    // kernel's operand.
    let xf32: Vec<f32> = x16.iter().map(|v| v.to_f32()).collect();
    for (pi, &pattern) in opts.patterns.iter().enumerate() {
        let slide_opts = SlideOptions::from_pattern(pattern)?;
        let w = sparse_matrix(m, k, 0.0, pattern, seed ^ (0x80 + pi as u64))?;
        let enc = Slide::encode(&w, &slide_opts)?;
        let prefix = prefix_tokens(opts);
        let (want_all, _) = reference(&enc, &xf32, k, prefix, None);
        let layout = crate::slide::SlideDevice::new(&enc)?;
        let bytes_w = layout.device_bytes();
        let copies: Vec<GpuSlide> = (0..ctx.copies(bytes_w))
            .map(|_| GpuSlide::upload_device(gpu, &layout))
            .collect::<Result<_>>()?;
        let nc = copies.len();
        let lifted = crate::dense::zeroed_f16(gpu, copies[0].lifted_len(nmax))?;
        // The prompt path's f16 copy of W (rows `ld` apart), written again by every launch.
        let ld = copies[0].decoded_ld();
        let w16 = crate::dense::zeroed_f16(gpu, if by_copy { m * ld } else { 1 })?;
        let sp = 1.0 / slide_opts.n as f64;
        for (ni, &n) in opts.n.iter().enumerate() {
            let want = if n <= MAX_KERNEL_TOKENS {
                Expected::all(m, want_all[..n * m].to_vec())
            } else {
                let tokens = checked_tokens(n);
                let xs = gather_rows(&xf32, k, &tokens);
                let (y, _) = reference(&enc, &xs, k, tokens.len(), None);
                Expected { m, tokens, y }
            };
            if by_copy {
                let x16d = gpu.upload(&x16[..n * k])?;
                let mut y = gpu.poisoned_f32(n * m)?;
                let launch = |i: usize, y: &mut CudaSlice<f32>| -> Result<()> {
                    copies[i % nc].decode_rows_f16(gpu, dev_ptr(gpu, &w16), ld)?;
                    gemm_on_copy(gpu, dev_ptr(gpu, &w16), ld, m, k, dev_ptr(gpu, &x16d), n, y)
                };
                launch(0, &mut y)?;
                let err = want.error(&gpu.download(&y)?);
                let t = ctx.time(nc, &mut y, &want, launch)?;
                // Weights and metadata read, the copy zeroed, written and read, f16 x, y.
                let bytes = bytes_w + 3 * m * ld * 2 + n * k * 2 + n * m * 4;
                ctx.record(
                    Precision::SlideF16Copy,
                    shape,
                    n,
                    sp,
                    0.0,
                    &t,
                    &bases[ni],
                    bytes,
                    err,
                );
            }
            if !by_mma {
                continue;
            }
            let xd = gpu.upload(&xf32[..n * k])?;
            let mut y = gpu.poisoned_f32(n * m)?;
            let launch = |i: usize, y: &mut CudaSlice<f32>| -> Result<()> {
                copies[i % nc].launch_rows(
                    gpu,
                    dev_ptr(gpu, &xd),
                    k,
                    n,
                    None,
                    dev_ptr(gpu, &lifted),
                    dev_ptr(gpu, y),
                    m,
                    false,
                )
            };
            launch(0, &mut y)?;
            let err = want.error(&gpu.download(&y)?);
            let t = ctx.time(nc, &mut y, &want, launch)?;
            // Weights and metadata, f32 x read, the lifted f16 rows written and read, y.
            let bytes = bytes_w + n * k * 4 + 2 * copies[0].lifted_len(n) * 2 + n * m * 4;
            ctx.record(
                Precision::SlideF16,
                shape,
                n,
                sp,
                0.0,
                &t,
                &bases[ni],
                bytes,
                err,
            );
        }
    }
    Ok(())
}

/// SlideSparse on cuSPARSELt (`slide-lt-*`) and the dense 8-bit baselines on cuBLASLt
/// (`cublaslt-*`, the original M x K matrix) at every pattern and N (dp 0). Each row times the
/// whole product as a layer runs it (the activations lifted or quantized, the library's
/// product, the scaling into f32 outputs) and is checked first against the f64 product of the
/// same quantization; the libraries' products alone, and their ratio at the same precision,
/// go on lines of their own.
fn bench_slide_lt(
    ctx: &mut Ctx,
    shape: &Shape,
    seed: u64,
    x16: &[f16],
    bases: &[Timed],
) -> Result<()> {
    use crate::cusparselt::{CusparseLt, LtProduct};
    use crate::dense8::DenseLt8;
    use crate::product::dev_ptr;
    use crate::slide::{eight_bit_reference, reference, Eight};
    use crate::slide_lt::{quantize_rows, scale_outputs, Lifter, LtScratch, SlideLt};
    let opts = ctx.opts;
    let wanted: Vec<Precision> = opts
        .precisions
        .iter()
        .copied()
        .filter(|p| p.library_precision().is_some())
        .collect();
    if wanted.is_empty() {
        return Ok(());
    }
    let gpu = ctx.gpu;
    // A machine without the library still measures the other rows; the skip is printed.
    let lt = match CusparseLt::load(gpu) {
        Ok(lt) => lt,
        Err(e) => {
            (ctx.progress)(&format!(
                "the cuSPARSELt and cuBLASLt rows are skipped: {e}"
            ));
            return Ok(());
        }
    };
    (ctx.progress)(&format!(
        "cuSPARSELt {} from {}",
        lt.version,
        lt.path.display()
    ));
    let (m, k) = (shape.m, shape.k);
    let xf32: Vec<f32> = x16.iter().map(|v| v.to_f32()).collect();
    let prefix = prefix_tokens(opts);
    for (pi, &pattern) in opts.patterns.iter().enumerate() {
        let slide_opts = SlideOptions::from_pattern(pattern)?;
        let w = sparse_matrix(m, k, 0.0, pattern, seed ^ (0x80 + pi as u64))?;
        let enc = Slide::encode(&w, &slide_opts)?;
        let sp = 1.0 / slide_opts.n as f64;
        // 8-bit first: a fault inside the library ends the context for what follows.
        for precision in [LtPrecision::Int8, LtPrecision::E4m3, LtPrecision::F16] {
            let rows_of =
                |p: Precision| wanted.contains(&p) && p.library_precision() == Some(precision);
            let sparse_row = [
                Precision::SlideLtF16,
                Precision::SlideLtInt8,
                Precision::SlideLtFp8,
            ]
            .into_iter()
            .find(|&p| rows_of(p));
            let dense_row = [Precision::CublasLtInt8, Precision::CublasLtFp8]
                .into_iter()
                .find(|&p| rows_of(p));
            if sparse_row.is_none() && dense_row.is_none() {
                continue;
            }
            // The reference of tokens 0..prefix, and of the checked tokens beyond.
            let reference_of = |x: &[f32], n: usize| -> Vec<f64> {
                match precision {
                    LtPrecision::F16 => reference(&enc, x, k, n, None).0,
                    LtPrecision::Int8 => eight_bit_reference(&enc, x, k, n, None, Eight::Int8),
                    LtPrecision::E4m3 => eight_bit_reference(&enc, x, k, n, None, Eight::E4m3),
                }
            };
            let want_prefix = reference_of(&xf32, prefix);
            let want_for = |n: usize| -> Expected {
                if n <= MAX_KERNEL_TOKENS {
                    Expected::all(m, want_prefix[..n * m].to_vec())
                } else {
                    let tokens = checked_tokens(n);
                    let xs = gather_rows(&xf32, k, &tokens);
                    let y = reference_of(&xs, tokens.len());
                    Expected { m, tokens, y }
                }
            };
            // The sparse copies (one compressed W' each) and the dense ones (W, M x K).
            let first = SlideLt::upload(gpu, &lt, &enc, precision)?;
            let mut sparse = vec![first];
            if sparse_row.is_some() {
                while sparse.len() < ctx.copies(sparse[0].device_bytes()) {
                    sparse.push(SlideLt::upload(gpu, &lt, &enc, precision)?);
                }
            }
            let ns = sparse.len();
            let (mp, kpd, _) = LtProduct::padded(m, k, 1, precision);
            let dense_w = if dense_row.is_some() {
                let (bytes, scales) = quantize_rows(w.data(), m, k, kpd, mp, precision);
                let copies = ctx.copies(bytes.len());
                let ws = (0..copies)
                    .map(|_| gpu.upload(&bytes))
                    .collect::<Result<Vec<_>>>()?;
                Some((
                    ws,
                    gpu.upload(&scales)?,
                    Lifter::identity(gpu, k, kpd, precision)?,
                ))
            } else {
                None
            };
            for (ni, &n) in opts.n.iter().enumerate() {
                let want = want_for(n);
                let xd = gpu.upload(&xf32[..n * k])?;
                let xp = dev_ptr(gpu, &xd);
                let mut sparse_alone = None;
                if let Some(row) = sparse_row {
                    let (p, sc) = sparse[0].plan(gpu, n)?;
                    let mut y = gpu.poisoned_f32(n * m)?;
                    let launch = |i: usize, y: &mut CudaSlice<f32>| -> Result<()> {
                        sparse[i % ns].launch_rows(
                            gpu,
                            &p,
                            &sc,
                            xp,
                            k,
                            n,
                            None,
                            dev_ptr(gpu, y),
                            m,
                            false,
                        )
                    };
                    launch(0, &mut y)?;
                    let err = want.error(&gpu.download(&y)?);
                    let t = ctx.time(ns, &mut y, &want, launch)?;
                    let lifted = p.n * p.k * precision.input_bytes();
                    let bytes = sparse[0].device_bytes()
                        + n * k * 4
                        + 2 * lifted
                        + 2 * p.n * p.m * p.out.bytes()
                        + n * m * 4;
                    ctx.record(row, shape, n, sp, 0.0, &t, &bases[ni], bytes, err);
                    let alone = time_launches(gpu, 10, opts.reps, |i| {
                        sparse[i % ns].multiply(gpu, &p, &sc)
                    })?;
                    let lift = time_launches(gpu, 10, opts.reps, |_| {
                        sparse[0].lift(gpu, xp, k, n, None, &sc)
                    })?;
                    (ctx.progress)(&format!(
                        "{:<13} {:>5}x{:<5} n={:<5} {}:{} the cuSPARSELt product alone {:.2} µs (out {:?}); the lifting alone {:.2} µs",
                        row.name(), m, k, n, 2 * slide_opts.n - 2, 2 * slide_opts.n,
                        alone.median_us, p.out, lift.median_us
                    ));
                    sparse_alone = Some(alone.median_us);
                }
                if let (Some(row), Some((ws, wscales, lifter))) = (dense_row, dense_w.as_ref()) {
                    let (_, _, np) = LtProduct::padded(m, k, n, precision);
                    let d = DenseLt8::new(gpu, mp, kpd, np, precision)?;
                    let sc = LtScratch::sized(gpu, np, kpd, mp, precision, d.out)?;
                    let nd = ws.len();
                    let mut y = gpu.poisoned_f32(n * m)?;
                    let launch = |i: usize, y: &mut CudaSlice<f32>| -> Result<()> {
                        lifter.run(gpu, xp, k, n, None, &sc)?;
                        d.run(
                            gpu,
                            dev_ptr(gpu, &ws[i % nd]),
                            dev_ptr(gpu, &sc.codes),
                            dev_ptr(gpu, &sc.acc),
                        )?;
                        scale_outputs(
                            gpu,
                            d.out,
                            d.alpha,
                            &sc,
                            mp,
                            m,
                            n,
                            Some(wscales),
                            dev_ptr(gpu, y),
                            m,
                            false,
                        )
                    };
                    launch(0, &mut y)?;
                    let err = want.error(&gpu.download(&y)?);
                    let t = ctx.time(nd, &mut y, &want, launch)?;
                    let bytes = m * k
                        + m * 4
                        + n * k * 4
                        + 2 * np * kpd
                        + 2 * np * mp * d.out.bytes()
                        + n * m * 4;
                    ctx.record(row, shape, n, 0.0, 0.0, &t, &bases[ni], bytes, err);
                    let alone = time_launches(gpu, 10, opts.reps, |i| {
                        d.run(
                            gpu,
                            dev_ptr(gpu, &ws[i % nd]),
                            dev_ptr(gpu, &sc.codes),
                            dev_ptr(gpu, &sc.acc),
                        )
                    })?;
                    (ctx.progress)(&format!(
                        "{:<13} {:>5}x{:<5} n={:<5} the cuBLASLt product alone {:.2} µs (out {:?}){}",
                        row.name(), m, k, n, alone.median_us, d.out,
                        sparse_alone.map_or(String::new(), |s| format!(
                            "; the {}:{} cuSPARSELt product is {:.2}x it",
                            2 * slide_opts.n - 2, 2 * slide_opts.n, alone.median_us / s
                        ))
                    ));
                }
            }
        }
    }
    Ok(())
}

impl GemmReport {
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{}; copy bandwidth {:.0} GB/s; empty launch {:.2} µs; {} reps (median)\n",
            self.device.name, self.copy_gbs, self.empty_launch_us, self.reps
        );
        let graph = self.rows.iter().any(|r| r.graph_us.is_some());
        s += "| precision | M x K | N | sp | dp | µs | x cuBLAS | GB/s | % copy |";
        if graph {
            s += " graph µs | graph x cuBLAS |";
        }
        s += " rel err |\n|---|---|---|---|---|---|---|---|---|";
        if graph {
            s += "---|---|";
        }
        s += "---|\n";
        for r in &self.rows {
            let _ = write!(
                s,
                "| {} | {}x{} | {} | {} | {} | {:.2} | {:.2} | {:.0} | {:.0} |",
                r.precision,
                r.m,
                r.k,
                r.n,
                r.sp,
                r.dp,
                r.us,
                r.speedup_vs_cublas,
                r.gbs,
                r.pct_copy_bw
            );
            if graph {
                let _ = write!(
                    s,
                    " {} | {} |",
                    r.graph_us.map_or("-".into(), |v| format!("{v:.2}")),
                    r.graph_speedup_vs_cublas
                        .map_or("-".into(), |v| format!("{v:.2}"))
                );
            }
            let _ = writeln!(s, " {:.1e} |", r.rel_error);
        }
        s
    }

    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self)
            .map_err(|e| CudaError::Option(format!("serializing the report: {e}")))
    }

    /// The SVG plot of [`svg_plot`] for this run.
    pub fn plot(&self) -> String {
        svg_plot(&self.rows, &self.device.name)
    }

    /// Fails when any product disagreed with its reference (or left an output unwritten).
    pub fn check_correct(&self) -> Result<()> {
        // Each row's error as a fraction of what its precision may have.
        let worst = super::worst_error(self.rows.iter().flat_map(|r| {
            let allowed = max_rel_error_of(&r.precision);
            std::iter::once(r.rel_error / allowed).chain(r.graph_rel_error.map(|e| e / allowed))
        }));
        if worst >= 1.0 || worst.is_nan() {
            return Err(CudaError::Option(format!(
                "a kernel disagreed with the reference: {worst:.2}x the relative error its \
                 precision may have (1e-3; 1e-2 for slide-lt-fp8)"
            )));
        }
        Ok(())
    }
}

/// One line of [`svg_plot`]: a precision at one weight and activation sparsity, with its
/// speedup over cuBLAS f16 per token count N (increasing N).
#[derive(Clone, Debug, PartialEq)]
pub struct PlotSeries {
    pub precision: String,
    pub sp: f64,
    pub dp: f64,
    /// (N, geometric mean over shapes of the event-mode speedup over cuBLAS f16).
    pub points: Vec<(usize, f64)>,
}

impl PlotSeries {
    /// The legend label: the precision, with the sparsities that are not 0.
    pub fn label(&self) -> String {
        let mut l = self.precision.clone();
        if self.sp != 0.0 {
            let _ = write!(l, " sp {:.2}", self.sp);
        }
        if self.dp != 0.0 {
            let _ = write!(l, " dp {:.2}", self.dp);
        }
        l
    }
}

/// The series of [`svg_plot`], in the order the rows first show them: the rows grouped by
/// (precision, sp, dp), each point the geometric mean over shapes at one N. The cuBLAS f16
/// rows (the baseline, 1x by definition) are left out, and so are rows whose speedup is not a
/// positive finite number or whose N is 0.
pub fn plot_series(rows: &[GemmRow]) -> Vec<PlotSeries> {
    use std::collections::BTreeMap;
    /// Per N: the sum of the speedups' logarithms and their count.
    type LogSums = BTreeMap<usize, (f64, usize)>;
    let mut series: Vec<(PlotSeries, LogSums)> = Vec::new();
    let baseline = Precision::F16.name();
    for r in rows {
        let v = r.speedup_vs_cublas;
        if r.precision == baseline || r.n == 0 || !v.is_finite() || v <= 0.0 {
            continue;
        }
        let same = |p: &PlotSeries| {
            p.precision == r.precision
                && p.sp.to_bits() == r.sp.to_bits()
                && p.dp.to_bits() == r.dp.to_bits()
        };
        let i = match series.iter().position(|(p, _)| same(p)) {
            Some(i) => i,
            None => {
                let p = PlotSeries {
                    precision: r.precision.clone(),
                    sp: r.sp,
                    dp: r.dp,
                    points: Vec::new(),
                };
                series.push((p, BTreeMap::new()));
                series.len() - 1
            }
        };
        let e = series[i].1.entry(r.n).or_insert((0.0, 0));
        e.0 += v.ln();
        e.1 += 1;
    }
    series
        .into_iter()
        .map(|(mut p, pts)| {
            p.points = pts
                .into_iter()
                .map(|(n, (ln_sum, count))| (n, (ln_sum / count as f64).exp()))
                .collect();
            p
        })
        .collect()
}

/// Speedup over cuBLAS f16 (event mode) against tokens per product N on a log2 axis, one line
/// per [`plot_series`] (precision, sp, dp), points the geometric means over shapes; the 1x
/// line is cuBLAS f16. Plain SVG written by hand, like `sieve bench kernels`' plot; with no
/// series to draw, a plot that says so.
pub fn svg_plot(rows: &[GemmRow], device: &str) -> String {
    let series = plot_series(rows);
    let (w, pad, legend_w) = (960.0, 60.0, 240.0);
    let h = f64::max(480.0, 2.0 * pad + 16.0 * series.len() as f64 + 16.0);
    let title = format!(
        "Speedup over cuBLAS f16 vs tokens per product N ({device}), geometric mean over shapes"
    );
    let mut s = String::new();
    svg::open(&mut s, w, h, &title);
    if series.is_empty() {
        let why = if rows.is_empty() {
            "no rows to plot"
        } else {
            "no rows to plot (only cuBLAS f16 baseline rows, or no finite speedups)"
        };
        svg::centred_text(&mut s, w / 2.0, h / 2.0, why);
        svg::close(&mut s);
        return s;
    }
    let log_ns = series
        .iter()
        .flat_map(|p| p.points.iter().map(|&(n, _)| (n as f64).log2()));
    let (lo, hi) = log_ns.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    let (lo, mut hi) = (lo.floor(), hi.ceil());
    if hi <= lo {
        hi = lo + 1.0;
    }
    let ymax = svg::speedup_max(series.iter().flat_map(|p| p.points.iter().map(|&(_, v)| v)));
    let (x0, x1) = (pad, w - legend_w);
    let px = |log_n: f64| x0 + (log_n - lo) / (hi - lo) * (x1 - x0);
    let py = |y: f64| h - pad - y / ymax * (h - 2.0 * pad);
    // Powers of two from 2^lo to 2^hi (lo >= 0: N >= 1).
    for e in (lo as i32)..=(hi as i32) {
        let label = 2f64.powi(e).to_string();
        svg::x_tick(
            &mut s,
            px(e as f64),
            py(0.0),
            py(ymax),
            h - pad + 16.0,
            &label,
        );
    }
    svg::speedup_grid(&mut s, ymax, x0, x1, py);
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{}" text-anchor="end" fill="#666">cuBLAS f16</text>"##,
        x1 - 4.0,
        py(1.0) - 4.0
    );
    svg::centred_text(
        &mut s,
        (x0 + x1) / 2.0,
        h - 14.0,
        "tokens per product N (log2 axis)",
    );
    let colors = svg::COLORS.len();
    for (i, p) in series.iter().enumerate() {
        let pts: Vec<(f64, f64)> = p
            .points
            .iter()
            .map(|&(n, v)| (px((n as f64).log2()), py(v)))
            .collect();
        // Past the palette, the colours come again dashed, then dotted.
        let extra = match (i / colors) % 3 {
            0 => "",
            1 => r#" stroke-dasharray="6 3""#,
            _ => r#" stroke-dasharray="2 3""#,
        };
        let legend = (x1 + 16.0, pad + 16.0 * i as f64);
        svg::series(
            &mut s,
            svg::COLORS[i % colors],
            extra,
            &pts,
            &p.label(),
            legend,
        );
    }
    svg::close(&mut s);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_checked() {
        let mut o = GemmBenchOptions::default();
        assert!(o.validate().is_ok());
        o.n = vec![MAX_BENCH_TOKENS + 1];
        assert!(o.validate().is_err());
        o.n = vec![0];
        assert!(o.validate().is_err());
        o.n = vec![33, 128, MAX_BENCH_TOKENS];
        assert!(o.validate().is_ok(), "the batched pass's token counts");
        o.n = vec![1];
        o.sp = vec![1.0];
        assert!(o.validate().is_err());
        o.sp = vec![0.5];
        o.precisions.push(Precision::SlideF16);
        assert!(o.validate().is_ok());
        o.patterns = vec![Pattern::NM { n: 4, m: 8 }];
        assert!(o.validate().is_err(), "4:8 is not (2N-2):2N");
        o.patterns.clear();
        assert!(o.validate().is_err());
        assert!("slide-f16".parse::<Precision>().is_ok());
        o.precisions = vec![Precision::SlideF16Copy];
        assert!(o.validate().is_err(), "the copy needs a pattern too");
        assert!("slide-f16-copy".parse::<Precision>().is_ok());
        assert!("w4a16".parse::<Precision>().is_ok());
        assert!("w3a16".parse::<Precision>().is_err());
    }

    #[test]
    fn reference_product_splits_rows_and_tokens() {
        let (m, k, n) = (37, 5, 3);
        let w: Vec<f64> = (0..m * k).map(|i| (i % 7) as f64 - 3.0).collect();
        let x: Vec<f64> = (0..n * k).map(|i| (i % 5) as f64 * 0.5).collect();
        let y = reference_product(&w, m, k, &x, n);
        for t in 0..n {
            for r in 0..m {
                let want: f64 = (0..k).map(|c| w[r * k + c] * x[t * k + c]).sum();
                assert_eq!(y[t * m + r], want);
            }
        }
    }

    #[test]
    fn long_products_are_checked_on_a_spread_of_their_rows() {
        assert_eq!(checked_tokens(5), vec![0, 1, 2, 3, 4]);
        assert_eq!(checked_tokens(MAX_KERNEL_TOKENS).len(), MAX_KERNEL_TOKENS);
        let t = checked_tokens(1000);
        assert_eq!(t, vec![0, 1, 250, 500, 750, 998, 999]);
        // The sampled reference rows are the full reference's rows at those tokens, and the
        // check sees a wrong row among them.
        let (m, k, n) = (9, 4, 300);
        let w: Vec<f64> = (0..m * k).map(|i| (i % 7) as f64 - 3.0).collect();
        let x: Vec<f64> = (0..n * k).map(|i| ((i * 13) % 11) as f64 * 0.25).collect();
        let full = reference_product(&w, m, k, &x, n);
        let prefix = reference_product(&w, m, k, &x, MAX_KERNEL_TOKENS);
        let want = expected(&w, m, k, &x, n, &prefix);
        assert_eq!(want.tokens, checked_tokens(n));
        assert_eq!(want.y, gather_rows(&full, m, &want.tokens));
        let mut got: Vec<f32> = full.iter().map(|&v| v as f32).collect();
        assert!(want.error(&got) < 1e-6);
        got[(n - 1) * m + 3] += 1.0;
        assert!(want.error(&got) > 1e-3);
        // Up to MAX_KERNEL_TOKENS every row is checked, from the prefix.
        let short = expected(&w, m, k, &x, 20, &prefix);
        assert_eq!(short.y, full[..20 * m].to_vec());
    }
}

#[cfg(test)]
mod plot_tests {
    use super::*;

    fn row(precision: &str, m: usize, n: usize, sp: f64, dp: f64, speedup: f64) -> GemmRow {
        GemmRow {
            precision: precision.into(),
            model: "llama2-7b".into(),
            m,
            k: 4096,
            n,
            sp,
            dp,
            us: 10.0 / speedup,
            us_min: 9.0 / speedup,
            speedup_vs_cublas: speedup,
            bytes: 1 << 20,
            gbs: 1000.0,
            pct_copy_bw: 30.0,
            rel_error: 1e-5,
            graph_us: None,
            graph_speedup_vs_cublas: None,
            graph_rel_error: None,
        }
    }

    fn report(rows: Vec<GemmRow>) -> GemmReport {
        GemmReport {
            device: crate::bench::report::tests::report(Vec::new()).device,
            copy_gbs: 3000.0,
            empty_launch_us: 3.5,
            reps: 100,
            rows,
        }
    }

    /// The points of every polyline, in order, as (x, y).
    fn polylines(svg: &str) -> Vec<Vec<(f64, f64)>> {
        svg.split("<polyline")
            .skip(1)
            .map(|p| {
                let pts = p.split("points=\"").nth(1).unwrap();
                let pts = &pts[..pts.find('"').unwrap()];
                pts.split_whitespace()
                    .map(|xy| {
                        let (x, y) = xy.split_once(',').unwrap();
                        (x.parse().unwrap(), y.parse().unwrap())
                    })
                    .collect()
            })
            .collect()
    }

    /// A run's rows: cuBLAS f16, W4A16 and Q4_0 at N = 1..8 on two shapes, Balanced-CBC int8 at
    /// N = 1 at two activation sparsities.
    fn rows() -> Vec<GemmRow> {
        let mut rows = Vec::new();
        for m in [4096, 11008] {
            for n in [1, 2, 4, 8] {
                rows.push(row("f16", m, n, 0.0, 0.0, 1.0));
                // 2x and 8x at N = 1 (geometric mean 4x), falling with N.
                let w4 = if m == 4096 { 2.0 } else { 8.0 } / n as f64;
                rows.push(row("w4a16", m, n, 0.0, 0.0, w4));
                rows.push(row("gguf-q4_0", m, n, 0.0, 0.0, 1.5));
            }
            rows.push(row("bcbc-int8", m, 1, 0.5, 0.0, 3.0));
            rows.push(row("bcbc-int8", m, 1, 0.5, 0.5, 5.0));
        }
        rows
    }

    #[test]
    fn plot_series_are_geometric_means_over_shapes_without_the_baseline() {
        let s = plot_series(&rows());
        let labels: Vec<String> = s.iter().map(PlotSeries::label).collect();
        assert_eq!(
            labels,
            [
                "w4a16",
                "gguf-q4_0",
                "bcbc-int8 sp 0.50",
                "bcbc-int8 sp 0.50 dp 0.50"
            ]
        );
        let w4 = &s[0].points;
        assert_eq!(w4.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 2, 4, 8]);
        for &(n, v) in w4 {
            assert!((v - 4.0 / n as f64).abs() < 1e-12, "N = {n}: {v}");
        }
        assert_eq!(s[2].points.len(), 1);
        assert!((s[2].points[0].1 - 3.0).abs() < 1e-12);
    }

    #[test]
    fn gemm_plot_draws_one_line_per_series_along_log_n() {
        let svg = report(rows()).plot();
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<svg").count(), 1);
        // The device's name, escaped, in the title.
        assert!(svg.contains("(Test &lt;GPU&gt;)"), "{svg}");
        let lines = polylines(&svg);
        let counts: Vec<usize> = lines.iter().map(Vec::len).collect();
        assert_eq!(counts, [4, 4, 1, 1]);
        assert_eq!(svg.matches("<circle").count(), 10);
        for label in [
            ">w4a16<",
            ">gguf-q4_0<",
            ">bcbc-int8 sp 0.50<",
            ">bcbc-int8 sp 0.50 dp 0.50<",
        ] {
            assert!(svg.contains(label), "{label}");
        }
        assert!(
            !svg.contains(">f16<"),
            "the baseline is the 1x line, not a series"
        );
        // x increases with N, evenly on the log axis; w4a16 falls with N (y grows down).
        let w4 = &lines[0];
        let dx: Vec<f64> = w4.windows(2).map(|p| p[1].0 - p[0].0).collect();
        assert!(
            dx.iter().all(|&d| d > 0.0 && (d - dx[0]).abs() < 0.2),
            "{dx:?}"
        );
        assert!(w4.windows(2).all(|p| p[1].1 > p[0].1), "{w4:?}");
        // N = 1 sits at the same x on every line; a constant 1.5x series is flat.
        assert_eq!(lines[2][0].0, w4[0].0);
        assert!(lines[1].iter().all(|p| p.1 == lines[1][0].1));
        // Tick labels at the powers of two.
        for n in ["1", "2", "4", "8"] {
            assert!(
                svg.contains(&format!("text-anchor=\"middle\">{n}</text>")),
                "{n}"
            );
        }
    }

    #[test]
    fn gemm_plot_without_rows_says_so() {
        for rows in [Vec::new(), vec![row("f16", 4096, 1, 0.0, 0.0, 1.0)]] {
            let svg = report(rows).plot();
            assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
            assert!(svg.contains("no rows to plot"), "{svg}");
            assert!(!svg.contains("<polyline") && !svg.contains("<circle"));
        }
    }

    #[test]
    fn gemm_plot_skips_speedups_that_are_not_finite() {
        let rows = vec![
            row("w4a16", 4096, 1, 0.0, 0.0, 2.0),
            row("w4a16", 11008, 1, 0.0, 0.0, f64::NAN),
            row("w4a16", 4096, 2, 0.0, 0.0, f64::INFINITY),
            row("w4a16", 4096, 4, 0.0, 0.0, 0.0),
            row("w4a16", 4096, 8, 0.0, 0.0, -1.0),
            row("w4a16", 4096, 0, 0.0, 0.0, 2.0),
            row("w8a16", 4096, 1, 0.0, 0.0, f64::NAN),
        ];
        let s = plot_series(&rows);
        assert_eq!(s.len(), 1, "a series with no finite point is left out");
        assert_eq!(s[0].points.len(), 1);
        assert_eq!(s[0].points[0].0, 1);
        assert!((s[0].points[0].1 - 2.0).abs() < 1e-12);
        let svg = svg_plot(&rows, "gpu");
        assert_eq!(
            polylines(&svg).iter().map(Vec::len).collect::<Vec<_>>(),
            [1]
        );
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
        let only_bad = svg_plot(&rows[1..], "gpu");
        assert!(only_bad.contains("no rows to plot"));
    }

    #[test]
    fn gemm_plot_tells_apart_series_past_the_palette() {
        let rows: Vec<GemmRow> = (0..10)
            .flat_map(|i| {
                let dp = i as f64 / 10.0;
                [1, 32, 16384].map(|n| row("bcbc-int4", 4096, n, 0.5, dp, 1.0 + i as f64))
            })
            .collect();
        let svg = svg_plot(&rows, "gpu");
        let lines = polylines(&svg);
        assert_eq!(lines.len(), 10);
        assert!(lines.iter().all(|l| l.len() == 3));
        // 7 solid lines, then dashed ones (the legend swatch dashed too).
        assert_eq!(svg.matches("stroke-dasharray").count(), 2 * 3);
        assert!(svg.contains(">16384</text>"));
        // Everything fits: the legend's last entry is inside the canvas.
        let h: f64 = svg
            .split("height=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(h >= 60.0 + 16.0 * 10.0);
    }
}

#[cfg(test)]
mod format_tests {
    use super::Precision;

    #[test]
    fn formats_select_their_precisions_and_unknown_names_are_refused() {
        let names = |p: Vec<Precision>| p.iter().map(|p| p.name()).collect::<Vec<_>>();
        let got = Precision::of_formats(&["slide".into(), "tiled-cbc".into()]).unwrap();
        assert_eq!(
            names(got),
            [
                "tcbc-per-token",
                "tcbc-decode-gemm",
                "tcbc-spmm",
                "tcbc-union",
                "slide-f16",
                "slide-f16-copy",
                "slide-lt-f16",
                "slide-lt-int8",
                "slide-lt-fp8"
            ]
        );
        // Every precision belongs to exactly one format, and the formats cover them all.
        let formats = [
            "dense",
            "balanced-cbc",
            "ie-bme",
            "tiled-cbc",
            "slide",
            "lowbit-cols",
        ];
        let all: Vec<String> = formats.iter().map(|f| f.to_string()).collect();
        assert_eq!(
            Precision::of_formats(&all).unwrap(),
            Precision::ALL.to_vec()
        );
        let e = Precision::of_formats(&["csr".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("'csr'") && e.contains("balanced-cbc"), "{e}");
        assert!(Precision::of_formats(&[]).unwrap().is_empty());
    }
}
