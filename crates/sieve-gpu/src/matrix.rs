//! Weight matrices on the device: the formats with GPU kernels, and [`DeviceLinear`], one
//! launchable product over rows that may come from several host matrices (q|k|v, gate|up).
//!
//! | host format | threshold | device kernel (sieve-cuda) |
//! |---|---|---|
//! | dense (or GGUF blocks of types without a block kernel, dequantized to f16) | none | row-major GEMV |
//! | dense whose values lie on 4-bit grids per row and 128 columns (`sieve pack --values int4:128`) | any | as W4A16 g128 below (detected exactly: `LowBitMatrix::from_int4_grid`) |
//! | dense | TEAL | column-major GEMV that skips inactive columns |
//! | dense low-bit ([`HostMatrix::LowBit`]: GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks, W4A16 g128, W8A16) | none (or a kind below without a column layout) | f32 -> f16 input (masked by the threshold), then the low-bit tensor-core GEMV |
//! | W4A16 g128, GGUF Q4_0 | TEAL | column-major 4-bit: each warp compacts its 32 columns' inputs, then reads only the active columns' weights (`sieve_cuda::lowbit_cols`) |
//! | tiled-cbc | any | lane8 spMspV (or rr, `GpuModel::set_tcbc_kernel`) |
//! | rlc-csc | any | Celty spMspV |
//! | ie-bme with int4 / int8 values ([`HostMatrix::IeBme`], or int4 values re-encoded exactly) | any | union bitmaps decoded into tensor-core fragments |
//! | slide ((2N-2):2N, [`HostMatrix::Slide`] as the pack encodes it) | any | lift (TEAL mask and f16 rounding fused) into [`SlideProduct`]'s scratch, then the 2:4 `mma.sp` product with one token |
//! | ie-bme with f16 values | - | refused: no GPU decode kernel yet |
//! | balanced-cbc | any | lane-per-16-rows spMspV (N of every 16 rows per column) |
//! | balanced-cbc, values on an int8 / int4 grid (`sieve pack --values`) | any | the same from 8- / 4-bit values |
//!
//! Products add into their output ([`GpuAccumulate`]): the runner zeroes an output in the
//! RMSNorm launch before it, or lets o_proj and down_proj add straight into the residual.

use crate::error::{GpuError, Result};
use cudarc::driver::CudaSlice;
use half::f16;
use sieve_cuda::balanced_cbc::GpuBalancedCbc;
use sieve_cuda::balanced_lowbit::{BalancedLowBit, GpuBalancedLowBit};
use sieve_cuda::cusparselt::{CusparseLt, LtPrecision, LtProduct};
use sieve_cuda::dense::{GpuDense, GpuDenseColMajor};
use sieve_cuda::dense8::{Dense8, DenseLt8};
use sieve_cuda::ie_bme::{GpuIeBme, IeBmeDevice};
use sieve_cuda::lowbit::{GpuLowBit, LowBitMatrix};
use sieve_cuda::lowbit_cols::GpuLowBitCols;
use sieve_cuda::rlc_csc::GpuRlcCsc;
use sieve_cuda::slide::GpuSlide;
use sieve_cuda::slide_lt::SlideLt;
use sieve_cuda::tiled_cbc::{GpuTiledCbc, TcbcKernel};
use sieve_cuda::w4a8::{Int8Activations, W4A8};
use sieve_cuda::{DevPtr, DriverContext, Gpu, GpuAccumulate, L2Span};
use sieve_formats::balanced_cbc::BalancedCbc;
use sieve_formats::ie_bme::IeBme;
use sieve_formats::rlc_csc::{RlcCsc, RlcCscOptions};
use sieve_formats::slide::Slide;
use sieve_formats::tiled_cbc::TiledCbc;
use sieve_formats::{DenseMatrix, FormatKind, Threshold, WeightFormat};
use std::sync::{Arc, Mutex, OnceLock};

/// A weight matrix as the host hands it to the runner.
pub enum HostMatrix {
    /// f16 values, encoded on upload in the layer's format.
    Values(DenseMatrix),
    /// Dense integers and scales (GGUF blocks, W4A16, W8A16), multiplied as they
    /// are: never widened to f16 on the device.
    LowBit(LowBitMatrix),
    /// An IE-BME matrix as the pack holds it (its integers, scales and bitmaps).
    IeBme(IeBme),
    /// A SlideSparse matrix as the pack holds it (its N, kept values and metadata): the
    /// device layout is a re-layout of this encoding, never of the decoded values.
    Slide(Slide),
}

impl HostMatrix {
    pub fn rows(&self) -> usize {
        match self {
            HostMatrix::Values(m) => m.rows(),
            HostMatrix::LowBit(m) => m.rows(),
            HostMatrix::IeBme(m) => m.rows(),
            HostMatrix::Slide(m) => m.rows(),
        }
    }
    pub fn cols(&self) -> usize {
        match self {
            HostMatrix::Values(m) => m.cols(),
            HostMatrix::LowBit(m) => m.cols(),
            HostMatrix::IeBme(m) => m.cols(),
            HostMatrix::Slide(m) => m.cols(),
        }
    }
    /// Whether `self` and `other` can be joined by rows into one device matrix.
    fn joins_with(&self, other: &HostMatrix) -> bool {
        match (self, other) {
            (HostMatrix::Values(_), HostMatrix::Values(_)) => true,
            (HostMatrix::LowBit(a), HostMatrix::LowBit(b)) => a.kind() == b.kind(),
            (HostMatrix::Slide(a), HostMatrix::Slide(b)) => a.n() == b.n(),
            _ => false,
        }
    }
}

/// A dense low-bit matrix with the f16 copy of its input the kernel reads.
pub struct LowBitProduct {
    pub matrix: GpuLowBit,
    /// `padded_cols` f16: the masked input, written by the conversion launch.
    x16: CudaSlice<f16>,
    /// With [`Layouts::int8_activations`] and a 4-bit kind that has them: the W4A8 kernels and
    /// room for 32 tokens of INT8 activations, which then replace the f16 path.
    pub a8: Option<(W4A8, Int8Activations)>,
}

impl LowBitProduct {
    /// `y (n rows of ldy) += W · mask_t(x)` or `=` without `accumulate`, `x` n f32 rows of K
    /// at `ldx` floats apart, 32 tokens a launch: through the W4A8 kernels when the product
    /// has them (the activations quantized per launch), else through `x16` (one token) or
    /// `a16` (a caller's scratch of n x padded_cols f16, for more).
    #[allow(clippy::too_many_arguments)]
    pub fn launch_rows(
        &self,
        gpu: &Gpu,
        x: DevPtr,
        ldx: usize,
        n: usize,
        t: Threshold,
        a16: Option<DevPtr>,
        y: DevPtr,
        ldy: usize,
        accumulate: bool,
    ) -> sieve_cuda::Result<()> {
        use sieve_cuda::lowbit::{activations_to_f16, MAX_TOKENS};
        let (k, kp) = (self.matrix.cols(), self.matrix.padded_cols());
        if let Some((kernels, acts)) = &self.a8 {
            for t0 in (0..n).step_by(MAX_TOKENS) {
                let nt = (n - t0).min(MAX_TOKENS);
                acts.quantize(gpu, x + (t0 * ldx * 4) as u64, k, ldx, nt, t)?;
                let yp = y + (t0 * ldy * 4) as u64;
                kernels.launch_ptr(gpu, &self.matrix, acts, 0, nt, yp, ldy, accumulate)?;
            }
            return Ok(());
        }
        let a16 = match a16 {
            Some(a) => a,
            None if n == 1 => sieve_cuda::dev_ptr(gpu, &self.x16),
            None => {
                return Err(sieve_cuda::CudaError::Option(format!(
                    "a low-bit product of {n} tokens needs an f16 scratch"
                )))
            }
        };
        activations_to_f16(gpu, x, k, ldx, kp, n, t, a16)?;
        for t0 in (0..n).step_by(MAX_TOKENS) {
            let nt = (n - t0).min(MAX_TOKENS);
            self.matrix.launch_ptr(
                gpu,
                a16 + (t0 * kp * 2) as u64,
                nt,
                y + (t0 * ldy * 4) as u64,
                ldy,
                accumulate,
            )?;
        }
        Ok(())
    }
}

/// A SlideSparse matrix with the scratch its decode-step product lifts one token into.
pub struct SlideProduct {
    pub matrix: GpuSlide,
    /// N of (2N-2):2N.
    n: usize,
    /// [`GpuSlide::lifted_len`]`(1)` f16: the lifted, masked input of one token.
    lifted: CudaSlice<f16>,
    /// With [`Layouts::slide_library`] or [`Layouts::prompt8`]: the same matrix compressed by
    /// cuSPARSELt (f16 values, or 8-bit codes with per-row scales), for prompt passes of [`crate::prefill::SLIDE_LIBRARY_MIN_TOKENS`] or more, and its plans
    /// by padded token count (made and searched at a pass's first use of that count).
    pub library: Option<SlideLt>,
    plans: Mutex<Vec<Arc<LtProduct>>>,
}

/// cuSPARSELt, loaded once per process for the slide matrices that ask for it.
fn slide_library(gpu: &Gpu) -> Result<Arc<CusparseLt>> {
    static LIBRARY: OnceLock<Arc<CusparseLt>> = OnceLock::new();
    if let Some(lt) = LIBRARY.get() {
        return Ok(lt.clone());
    }
    let lt = CusparseLt::load(gpu)?;
    Ok(LIBRARY.get_or_init(|| lt).clone())
}

impl SlideProduct {
    /// Uploads `s` with its one-token scratch (every kernel looked up now, not in a capture),
    /// and its cuSPARSELt copy in `library`'s precision when asked.
    pub fn upload(gpu: &Gpu, s: &Slide, library: Option<LtPrecision>) -> Result<Self> {
        let matrix = GpuSlide::upload(gpu, s)?;
        let lifted = gpu.upload(&vec![f16::ZERO; matrix.lifted_len(1)])?;
        let library = match library {
            Some(precision) => Some(SlideLt::upload(gpu, &slide_library(gpu)?, s, precision)?),
            None => None,
        };
        Ok(Self {
            matrix,
            n: s.n(),
            lifted,
            library,
            plans: Mutex::new(Vec::new()),
        })
    }
    /// N of (2N-2):2N.
    pub fn n(&self) -> usize {
        self.n
    }

    /// The cuSPARSELt plan for `np` tokens (padded), made on first use with the pass's
    /// scratch (`codes`, `acc`: see [`SlideLt::plan_with`]).
    pub fn library_plan(
        &self,
        gpu: &Gpu,
        np: usize,
        codes: DevPtr,
        acc: DevPtr,
    ) -> Result<Option<Arc<LtProduct>>> {
        let Some(lib) = &self.library else {
            return Ok(None);
        };
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = plans.iter().find(|p| p.n == np) {
            return Ok(Some(p.clone()));
        }
        let p = Arc::new(lib.plan_with(gpu, np, codes, acc)?);
        plans.push(p.clone());
        Ok(Some(p))
    }
}

impl GpuAccumulate for SlideProduct {
    /// `y += W · f16(mask_t(x))` for one token: the lift into the matrix's own scratch, then
    /// the product with n = 1 (its split-K parts add into `y` with atomics). Nothing is
    /// allocated or looked up, so the step's graph captures it.
    fn launch_add(&self, gpu: &Gpu, x: DevPtr, t: Threshold, y: DevPtr) -> sieve_cuda::Result<()> {
        let lifted = sieve_cuda::dev_ptr(gpu, &self.lifted);
        let (k, m) = (self.matrix.cols(), self.matrix.rows());
        self.matrix.launch_rows(gpu, x, k, 1, t, lifted, y, m, true)
    }
}

/// What an upload keeps beside each matrix's decode-step layout. The default keeps nothing
/// more, except `slide_library` where `SIEVE_SLIDE_PROMPT=cusparselt` asks for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layouts {
    /// Also keep every column-major 4-bit matrix (a threshold on its input) in the
    /// tensor-core layout, for products of many sequences at once: the union of a batch's
    /// active columns is nearly every column, and without it each many-sequence step decodes
    /// the matrix to f16 (0.5 bytes a weight read, 2 written, 2 read again; measured 13.5 ms a
    /// 7B step at 31 sequences against 7.7 ms dense f16). Costs the 4-bit bytes again; a
    /// server with more than one slot asks for it.
    pub batch: bool,
    /// Multiply the 4-bit matrices that have W4A8 kernels (W4A16 g128, GGUF Q4_0) with their
    /// inputs quantized to INT8 per token (`sieve_cuda::w4a8`): `--activations int8`.
    pub int8_activations: bool,
    /// Also keep every SlideSparse matrix compressed by cuSPARSELt (its f16 values again) and
    /// multiply prompt passes of [`crate::prefill::SLIDE_LIBRARY_MIN_TOKENS`] or more with the
    /// library instead of an f16 copy and cuBLAS (`SIEVE_SLIDE_PROMPT=cusparselt`).
    pub slide_library: bool,
    /// W8A8 prompts (`--prompt-precision int8|fp8`): every dense f16 matrix of the layers also
    /// kept as 8-bit codes with one scale per row ([`Dense8`], cuBLASLt), every SlideSparse
    /// matrix compressed by cuSPARSELt in 8 bits, and prompt passes of
    /// [`crate::prefill::PROMPT8_MIN_TOKENS`] or more multiply those with each token's input
    /// quantized (one scale per token). Costs the 8-bit bytes again; the decode step keeps
    /// its f16 weights. Other formats keep their prompt path.
    pub prompt8: Option<LtPrecision>,
    /// Keep the f16 copy a prompt pass multiplies with cuBLAS (`--prompt-precision
    /// f16-resident`) for every layer matrix whose passes would otherwise decode one (Tiled-CBC,
    /// column-major 4-bit, Balanced-CBC, RLC-CSC, IE-BME, tensor-core low-bit, SlideSparse):
    /// decoded once at upload ([`Resident16`]) instead of once per pass. Costs 2 bytes a weight
    /// again; the one-sequence decode step keeps its own format, a many-sequence step of 16
    /// or more takes the copy where it would have taken Tiled-CBC's SpMM or decoded one.
    /// Dense f16 matrices need none.
    pub prompt16: bool,
}

impl Layouts {
    /// The precision a SlideSparse matrix's cuSPARSELt copy is kept in, if one is kept.
    pub fn slide_library_precision(&self) -> Option<LtPrecision> {
        self.prompt8
            .or(self.slide_library.then_some(LtPrecision::F16))
    }
}

impl Default for Layouts {
    fn default() -> Self {
        Self {
            batch: false,
            int8_activations: false,
            slide_library: crate::prefill::slide_library_requested(),
            prompt8: None,
            prompt16: false,
        }
    }
}

/// A layer matrix decoded to f16 once, kept for prompt passes ([`Layouts::prompt16`]): the
/// operand cuBLAS multiplies, `transposed` and with leading dimension `ld` as
/// [`crate::prefill::decode_f16`] lays it out.
pub struct Resident16 {
    pub values: CudaSlice<f16>,
    pub transposed: bool,
    pub ld: usize,
}

impl Resident16 {
    /// The copy of `matrix` (`rows x cols`), or `None` for a format multiplied as it is
    /// (dense f16).
    fn decode(gpu: &Gpu, matrix: &DeviceMatrix, rows: usize, cols: usize) -> Result<Option<Self>> {
        let Some(shape) = crate::prefill::f16_copy_shape(matrix, rows, cols) else {
            return Ok(None);
        };
        // Checked first: a model asked to keep copies it has no room for gets the memory error
        // (how much, how much is free), not a failed allocation.
        crate::runner::check_memory(gpu, shape.len * 2)?;
        let values = gpu
            .stream()
            .alloc_zeros::<f16>(shape.len.max(1))
            .during("allocating a resident f16 prompt copy")?;
        crate::prefill::decode_f16(gpu, matrix, sieve_cuda::dev_ptr(gpu, &values))?;
        Ok(Some(Self {
            values,
            transposed: shape.transposed,
            ld: shape.ld,
        }))
    }
    pub fn bytes(&self) -> usize {
        self.values.len() * 2
    }
}

/// The 8-bit copy of a dense matrix for W8A8 prompt passes ([`Layouts::prompt8`]); its
/// cuBLASLt plans are made at a pass's first use of a padded token count.
pub struct Prompt8 {
    pub matrix: Dense8,
}

impl Prompt8 {
    pub fn upload(gpu: &Gpu, m: &DenseMatrix, precision: LtPrecision) -> Result<Self> {
        Ok(Self {
            matrix: Dense8::upload(gpu, m.data(), m.rows(), m.cols(), precision)?,
        })
    }

    /// The plan for `np` tokens (padded). Plans are shared by every matrix of the same shape
    /// and precision on the same stream (a 7B has four shapes), because each holds cuBLASLt's
    /// 32 MiB workspace: one per matrix would cost gigabytes. The stream keys them so that no
    /// two runs of one plan (one workspace) overlap.
    pub fn plan(&self, gpu: &Gpu, np: usize) -> Result<Arc<DenseLt8>> {
        type Key = (usize, usize, usize, usize, LtPrecision);
        type Plans = Mutex<Vec<(Key, Arc<DenseLt8>)>>;
        static PLANS: OnceLock<Plans> = OnceLock::new();
        let (mp, kp) = self.matrix.plan_shape();
        let key = (
            gpu.stream().cu_stream() as usize,
            mp,
            kp,
            np,
            self.matrix.precision(),
        );
        let mut plans = PLANS
            .get_or_init(|| Mutex::new(Vec::new()))
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some((_, p)) = plans.iter().find(|(k, _)| *k == key) {
            return Ok(p.clone());
        }
        let p = Arc::new(self.matrix.plan(gpu, np)?);
        plans.push((key, p.clone()));
        Ok(p)
    }
}

/// One matrix in device memory with the kernel that multiplies it.
pub enum DeviceMatrix {
    DenseRows(GpuDense),
    DenseCols(GpuDenseColMajor),
    TiledCbc(GpuTiledCbc),
    RlcCsc(GpuRlcCsc),
    BalancedCbc(GpuBalancedCbc),
    BalancedLowBit(GpuBalancedLowBit),
    LowBit(LowBitProduct),
    /// A symmetric 4-bit matrix whose input has a TEAL threshold, column-major; with
    /// [`Layouts::batch`], the same matrix in the tensor-core layout for many-sequence products.
    LowBitCols(GpuLowBitCols, Option<LowBitProduct>),
    IeBme(GpuIeBme),
    Slide(SlideProduct),
}

impl DeviceMatrix {
    /// Encodes `m` in `kind` (the host format the model had) and uploads it. Returns the matrix
    /// and the bytes it stores on the device.
    pub fn upload(
        gpu: &Gpu,
        kind: FormatKind,
        m: &DenseMatrix,
        threshold: Threshold,
        layouts: Layouts,
    ) -> Result<(Self, usize)> {
        Ok(match kind {
            FormatKind::Dense => {
                // A 4-bit pack (`sieve pack --values int4:128`) stores values on symmetric 4-bit
                // grids exactly: multiplied from its integers, never as f16.
                if let Some(low) = LowBitMatrix::from_int4_grid(m) {
                    return Self::upload_low_bit(gpu, &low, threshold, layouts);
                }
                let bytes = m.rows() * m.cols() * 2;
                if threshold.is_some() {
                    (
                        DeviceMatrix::DenseCols(GpuDenseColMajor::upload(gpu, m)?),
                        bytes,
                    )
                } else {
                    (DeviceMatrix::DenseRows(GpuDense::upload(gpu, m)?), bytes)
                }
            }
            FormatKind::TiledCbc => {
                let f = TiledCbc::encode(m)?;
                let bytes = f.storage().total_bytes();
                (DeviceMatrix::TiledCbc(GpuTiledCbc::upload(gpu, &f)?), bytes)
            }
            FormatKind::RlcCsc => {
                let f = RlcCsc::encode(m, &RlcCscOptions::default())?;
                let bytes = f.storage().total_bytes();
                (DeviceMatrix::RlcCsc(GpuRlcCsc::upload(gpu, &f)?), bytes)
            }
            FormatKind::BalancedCbc => {
                // N = the fullest 16-row group of the (possibly joined) matrix. Values that
                // lie on an int8 or int4 grid (packs made with `--values`) go to the device
                // as those integers and their scales.
                let f = BalancedCbc::encode(m)?;
                match BalancedLowBit::detect(m, f.slots()) {
                    Some(low) => {
                        let bytes = low.device_bytes();
                        (
                            DeviceMatrix::BalancedLowBit(GpuBalancedLowBit::upload(gpu, &low)?),
                            bytes,
                        )
                    }
                    None => {
                        let bytes = f.storage().total_bytes();
                        (
                            DeviceMatrix::BalancedCbc(GpuBalancedCbc::upload(gpu, &f)?),
                            bytes,
                        )
                    }
                }
            }
            FormatKind::IeBme => {
                match sieve_cuda::ie_bme::encode_exact(m)? {
                    Some(e) => Self::upload_ie_bme(gpu, &e)?,
                    None => return Err(GpuError::Unsupported(
                        "ie-bme values that are not on an int4 grid reached the GPU as values: \
                         the GPU multiplies ie-bme from int4 / int8 values (sieve pack --format \
                         ie-bme --values int4|int8), not f16"
                            .into(),
                    )),
                }
            }
            FormatKind::Slide => {
                return Err(GpuError::Unsupported(
                    "slide matrices go to the GPU as the pack encodes them (their N with \
                     them), not as values"
                        .into(),
                ))
            }
        })
    }

    /// Uploads a dense low-bit matrix: column-major when its input has a threshold and the
    /// kind has a column layout ([`sieve_cuda::lowbit_cols::supports`]), so that inactive
    /// columns are never read; else in the tensor-core layout with its input buffer.
    pub fn upload_low_bit(
        gpu: &Gpu,
        m: &LowBitMatrix,
        threshold: Threshold,
        layouts: Layouts,
    ) -> Result<(Self, usize)> {
        let rows_layout = |gpu: &Gpu| -> Result<(LowBitProduct, usize)> {
            let matrix = GpuLowBit::upload(gpu, m)?;
            let bytes = matrix.device_bytes();
            let x16 = gpu.upload(&vec![f16::ZERO; matrix.padded_cols()])?;
            let a8 = if layouts.int8_activations && sieve_cuda::w4a8::supports(m.kind()) {
                let kernels = W4A8::prepare(gpu, m.kind())?;
                let acts = Int8Activations::new(
                    gpu,
                    sieve_cuda::lowbit::MAX_TOKENS,
                    matrix.padded_cols(),
                )?;
                Some((kernels, acts))
            } else {
                None
            };
            Ok((LowBitProduct { matrix, x16, a8 }, bytes))
        };
        // W4A8 multiplies every column (a TEAL mask only zeroes inputs before quantizing):
        // asked for, it takes the matrix rather than the column-major TEAL kernel.
        let int8 = layouts.int8_activations && sieve_cuda::w4a8::supports(m.kind());
        if threshold.is_some()
            && !int8
            && sieve_cuda::lowbit_cols::supports(m.kind())
            && low_bit_columns_enabled()
        {
            let c = GpuLowBitCols::upload(gpu, m)?;
            let mut bytes = c.device_bytes();
            let batch = if layouts.batch {
                let (rows, b) = rows_layout(gpu)?;
                bytes += b;
                Some(rows)
            } else {
                None
            };
            return Ok((DeviceMatrix::LowBitCols(c, batch), bytes));
        }
        let (product, bytes) = rows_layout(gpu)?;
        Ok((DeviceMatrix::LowBit(product), bytes))
    }

    /// Uploads an encoded IE-BME matrix (int4 / int8 values).
    pub fn upload_ie_bme(gpu: &Gpu, m: &IeBme) -> Result<(Self, usize)> {
        let layout = IeBmeDevice::new(m)?;
        let bytes = layout.device_bytes();
        Ok((DeviceMatrix::IeBme(GpuIeBme::upload(gpu, &layout)?), bytes))
    }

    /// Uploads an encoded SlideSparse matrix with its one-token scratch. The bytes are the
    /// device layout's (values and metadata, rows padded to 32 and K' to 128).
    pub fn upload_slide(gpu: &Gpu, s: &Slide, layouts: Layouts) -> Result<(Self, usize)> {
        let p = SlideProduct::upload(gpu, s, layouts.slide_library_precision())?;
        let bytes = p.matrix.device_bytes() + p.library.as_ref().map_or(0, |l| l.device_bytes());
        Ok((DeviceMatrix::Slide(p), bytes))
    }

    /// Uploads `m` as it comes: values in `kind`, low-bit matrices as they are.
    pub fn upload_host(
        gpu: &Gpu,
        kind: FormatKind,
        m: &HostMatrix,
        threshold: Threshold,
        layouts: Layouts,
    ) -> Result<(Self, usize)> {
        match m {
            HostMatrix::Values(v) => Self::upload(gpu, kind, v, threshold, layouts),
            HostMatrix::LowBit(q) => Self::upload_low_bit(gpu, q, threshold, layouts),
            HostMatrix::IeBme(e) => Self::upload_ie_bme(gpu, e),
            HostMatrix::Slide(s) => Self::upload_slide(gpu, s, layouts),
        }
    }

    /// Kernel launches per product.
    pub fn launches(&self) -> usize {
        match self {
            DeviceMatrix::LowBit(_) => 2,
            // Lift, then the product (split K accumulates: no zeroing launch).
            DeviceMatrix::Slide(_) => 2,
            _ => 1,
        }
    }

    pub fn label(&self) -> &'static str {
        match self {
            DeviceMatrix::DenseRows(_) => "dense-gemv",
            DeviceMatrix::DenseCols(_) => "dense-colmajor",
            DeviceMatrix::TiledCbc(m) if m.kernel == TcbcKernel::RoundRobin => "tiled-cbc/rr",
            DeviceMatrix::TiledCbc(_) => "tiled-cbc/lane8",
            DeviceMatrix::RlcCsc(_) => "rlc-csc",
            DeviceMatrix::BalancedCbc(_) => "balanced-cbc",
            DeviceMatrix::BalancedLowBit(m) => match m.values() {
                sieve_cuda::balanced_lowbit::LowBitValues::Int8 => "balanced-cbc/int8",
                sieve_cuda::balanced_lowbit::LowBitValues::Int4 { .. } => "balanced-cbc/int4",
            },
            DeviceMatrix::LowBitCols(m, _) => match m.kind() {
                sieve_cuda::lowbit::LowBitKind::W4G32 => "lowbit-cols/q4_0",
                _ => "lowbit-cols/w4a16-g128",
            },
            DeviceMatrix::IeBme(m) => {
                if m.bits() == 4 {
                    "ie-bme/int4"
                } else {
                    "ie-bme/int8"
                }
            }
            DeviceMatrix::Slide(p) => match p.n {
                2 => "slide/2:4",
                3 => "slide/4:6",
                4 => "slide/6:8",
                5 => "slide/8:10",
                6 => "slide/10:12",
                7 => "slide/12:14",
                _ => "slide/14:16",
            },
            DeviceMatrix::LowBit(m) if m.a8.is_some() => match m.matrix.kind() {
                sieve_cuda::lowbit::LowBitKind::W4G32 => "lowbit/q4_0-a8",
                _ => "lowbit/w4a8-g128",
            },
            DeviceMatrix::LowBit(m) => match m.matrix.kind() {
                sieve_cuda::lowbit::LowBitKind::W4G128 => "lowbit/w4a16-g128",
                sieve_cuda::lowbit::LowBitKind::W4G32 => "lowbit/q4_0",
                sieve_cuda::lowbit::LowBitKind::W8Row => "lowbit/w8a16",
                sieve_cuda::lowbit::LowBitKind::W8G32 => "lowbit/q8_0",
                sieve_cuda::lowbit::LowBitKind::W4G32Affine => "lowbit/q4_1",
                sieve_cuda::lowbit::LowBitKind::W5G32 => "lowbit/q5_0",
                sieve_cuda::lowbit::LowBitKind::W5G32Affine => "lowbit/q5_1",
                sieve_cuda::lowbit::LowBitKind::W4K => "lowbit/q4_k",
                sieve_cuda::lowbit::LowBitKind::W5K => "lowbit/q5_k",
                sieve_cuda::lowbit::LowBitKind::W6K => "lowbit/q6_k",
            },
        }
    }

    fn launch_add(&self, gpu: &Gpu, x: DevPtr, t: Threshold, y: DevPtr) -> Result<()> {
        match self {
            DeviceMatrix::DenseRows(m) => m.launch_add(gpu, x, t, y)?,
            DeviceMatrix::DenseCols(m) => m.launch_add(gpu, x, t, y)?,
            DeviceMatrix::TiledCbc(m) => m.launch_add(gpu, x, t, y)?,
            DeviceMatrix::RlcCsc(m) => m.launch_add(gpu, x, t, y)?,
            DeviceMatrix::BalancedCbc(m) => m.launch_add(gpu, x, t, y)?,
            DeviceMatrix::BalancedLowBit(m) => m.launch_add(gpu, x, t, y)?,
            DeviceMatrix::IeBme(m) => m.launch_add(gpu, x, t, y)?,
            DeviceMatrix::LowBitCols(m, _) => m.launch_add(gpu, x, t, y)?,
            DeviceMatrix::LowBit(p) => {
                let (k, m) = (p.matrix.cols(), p.matrix.rows());
                p.launch_rows(gpu, x, k, 1, t, None, y, m, true)?;
            }
            DeviceMatrix::Slide(p) => p.launch_add(gpu, x, t, y)?,
        }
        Ok(())
    }

    /// The weights the decode step asks L2 for ahead of this product (see [`L2Span`]); none
    /// for RLC-CSC and SlideSparse, whose steps have not been measured with it, and none for
    /// Tiled-CBC, whose step it made 0.3-0.7% slower (7B, sp/dp 0.5 and 0.7, H100, 2026-12-07,
    /// docs/BENCHMARKS.md "Window N2": a tile's columns are read only where the input is
    /// active, and the span's first bytes hold inactive ones too).
    pub fn weight_span(&self, gpu: &Gpu) -> L2Span {
        match self {
            DeviceMatrix::DenseRows(m) => m.weight_span(gpu),
            DeviceMatrix::DenseCols(m) => m.weight_span(gpu),
            DeviceMatrix::TiledCbc(_) => L2Span::NONE,
            DeviceMatrix::BalancedCbc(m) => m.weight_span(gpu),
            DeviceMatrix::BalancedLowBit(m) => m.weight_span(gpu),
            DeviceMatrix::IeBme(m) => m.weight_span(gpu),
            DeviceMatrix::LowBitCols(m, _) => m.weight_span(gpu),
            DeviceMatrix::LowBit(p) => p.matrix.weight_span(gpu),
            DeviceMatrix::RlcCsc(_) | DeviceMatrix::Slide(_) => L2Span::NONE,
        }
    }

    /// Device bytes the product reads when the inputs marked in `active` are the active ones.
    fn bytes_for(&self, active: &[bool]) -> usize {
        use sieve_cuda::GpuMatVec;
        match self {
            DeviceMatrix::DenseRows(m) => m.bytes_for(active),
            DeviceMatrix::DenseCols(m) => m.bytes_for(active),
            DeviceMatrix::TiledCbc(m) => m.bytes_for(active),
            DeviceMatrix::RlcCsc(m) => m.bytes_for(active),
            DeviceMatrix::BalancedCbc(m) => m.bytes_for(active),
            DeviceMatrix::BalancedLowBit(m) => m.bytes_for(active),
            DeviceMatrix::IeBme(m) => m.bytes_for(active),
            DeviceMatrix::LowBitCols(m, _) => m.bytes_for(active),
            // Every weight and scale, the f32 input read and its f16 copy written and read,
            // the f32 output read and written.
            // With W4A8: the INT8 codes instead, one byte a column.
            DeviceMatrix::LowBit(p) => {
                let (m, k) = (p.matrix.rows(), p.matrix.cols());
                let per_col = if p.a8.is_some() { 1 } else { 2 };
                p.matrix.device_bytes() + k * 4 + 2 * p.matrix.padded_cols() * per_col + m * 8
            }
            // Every value and metadata word (the tensor cores skip no inactive input), the
            // lift map and the f32 input read, the lifted row written and read, the f32
            // output read and written.
            DeviceMatrix::Slide(p) => {
                let (m, k, kp) = (p.matrix.rows(), p.matrix.cols(), p.matrix.lifted_row_len());
                p.matrix.device_bytes() + kp * 4 + k * 4 + 2 * kp * 2 + m * 8
            }
        }
    }
}

/// Rows `row_offset..row_offset + M` of a [`DeviceLinear`]'s output.
pub struct Part {
    pub matrix: DeviceMatrix,
    pub row_offset: usize,
    pub rows: usize,
    pub threshold: Threshold,
    pub stored_bytes: usize,
    /// The 8-bit copy of a dense f16 matrix with [`Layouts::prompt8`].
    pub prompt8: Option<Prompt8>,
    /// The f16 copy of a matrix of another format with [`Layouts::prompt16`].
    pub resident16: Option<Resident16>,
}

/// The 8-bit copy [`Layouts::prompt8`] asks for beside a dense f16 `matrix` of `values`, and
/// its bytes (none for other formats).
fn prompt8_copy(
    gpu: &Gpu,
    matrix: &DeviceMatrix,
    values: &DenseMatrix,
    layouts: Layouts,
) -> Result<(Option<Prompt8>, usize)> {
    match (layouts.prompt8, matrix) {
        (Some(p), DeviceMatrix::DenseRows(_) | DeviceMatrix::DenseCols(_)) => {
            let copy = Prompt8::upload(gpu, values, p)?;
            let bytes = copy.matrix.device_bytes();
            Ok((Some(copy), bytes))
        }
        _ => Ok((None, 0)),
    }
}

/// The product `y += W · mask(x)` of one or more host matrices that read the same input,
/// their rows concatenated in `y`. Matrices under one threshold are concatenated into a single
/// device matrix (one launch); a group whose thresholds differ keeps one launch per matrix.
pub struct DeviceLinear {
    pub parts: Vec<Part>,
    pub rows: usize,
    pub cols: usize,
}

impl DeviceLinear {
    /// Uploads `mats` (same K, outputs in this order): values in `kind`, low-bit matrices as
    /// they are.
    pub fn upload_group(
        gpu: &Gpu,
        kind: FormatKind,
        mats: &[(&HostMatrix, Threshold)],
        layouts: Layouts,
    ) -> Result<Self> {
        let Some(&(first, _)) = mats.first() else {
            return Err(GpuError::InvalidArgument(
                "a linear group with no matrices".into(),
            ));
        };
        let cols = first.cols();
        if let Some((m, _)) = mats.iter().find(|(m, _)| m.cols() != cols) {
            return Err(GpuError::InvalidArgument(format!(
                "matrices of one group must share their input: {} vs {cols} columns",
                m.cols()
            )));
        }
        let rows: usize = mats.iter().map(|(m, _)| m.rows()).sum();
        let joinable = mats
            .iter()
            .all(|(m, t)| *t == mats[0].1 && m.joins_with(first));
        let mut parts = Vec::new();
        if joinable && mats.len() > 1 {
            let mut prompt8 = None;
            let (matrix, stored_bytes) = match first {
                HostMatrix::Values(_) => {
                    let mut data = Vec::with_capacity(rows * cols);
                    for (m, _) in mats {
                        if let HostMatrix::Values(v) = m {
                            data.extend_from_slice(v.data());
                        }
                    }
                    let joined = DenseMatrix::new(rows, cols, data)?;
                    let (matrix, bytes) =
                        DeviceMatrix::upload(gpu, kind, &joined, mats[0].1, layouts)?;
                    let (copy, copy_bytes) = prompt8_copy(gpu, &matrix, &joined, layouts)?;
                    prompt8 = copy;
                    (matrix, bytes + copy_bytes)
                }
                HostMatrix::LowBit(_) => {
                    let low: Vec<&LowBitMatrix> = mats
                        .iter()
                        .filter_map(|(m, _)| match m {
                            HostMatrix::LowBit(q) => Some(q),
                            _ => None,
                        })
                        .collect();
                    DeviceMatrix::upload_low_bit(
                        gpu,
                        &LowBitMatrix::concat_rows(&low)?,
                        mats[0].1,
                        layouts,
                    )?
                }
                HostMatrix::Slide(_) => {
                    let slides: Vec<&Slide> = mats
                        .iter()
                        .filter_map(|(m, _)| match m {
                            HostMatrix::Slide(s) => Some(s),
                            _ => None,
                        })
                        .collect();
                    DeviceMatrix::upload_slide(gpu, &Slide::concat_rows(&slides)?, layouts)?
                }
                HostMatrix::IeBme(_) => {
                    return Err(GpuError::InvalidArgument(
                        "IE-BME matrices are uploaded one by one, not joined".into(),
                    ))
                }
            };
            parts.push(Part {
                matrix,
                row_offset: 0,
                rows,
                threshold: mats[0].1,
                stored_bytes,
                prompt8,
                resident16: None,
            });
        } else {
            let mut offset = 0;
            for (m, t) in mats {
                let (matrix, mut stored_bytes) =
                    DeviceMatrix::upload_host(gpu, kind, m, *t, layouts)?;
                let prompt8 = match m {
                    HostMatrix::Values(v) => {
                        let (copy, bytes) = prompt8_copy(gpu, &matrix, v, layouts)?;
                        stored_bytes += bytes;
                        copy
                    }
                    _ => None,
                };
                parts.push(Part {
                    matrix,
                    row_offset: offset,
                    rows: m.rows(),
                    threshold: *t,
                    stored_bytes,
                    prompt8,
                    resident16: None,
                });
                offset += m.rows();
            }
        }
        if layouts.prompt16 {
            for p in &mut parts {
                p.resident16 = Resident16::decode(gpu, &p.matrix, p.rows, cols)?;
                p.stored_bytes += p.resident16.as_ref().map_or(0, Resident16::bytes);
            }
        }
        Ok(Self { parts, rows, cols })
    }

    /// `y[0..rows] += W · mask(x)`; `x` holds `cols` f32.
    pub fn launch_add(&self, gpu: &Gpu, x: DevPtr, y: DevPtr) -> Result<()> {
        for p in &self.parts {
            p.matrix
                .launch_add(gpu, x, p.threshold, y + (p.row_offset * 4) as u64)?;
        }
        Ok(())
    }

    pub fn launches(&self) -> usize {
        self.parts.iter().map(|p| p.matrix.launches()).sum()
    }
    /// The weights of the first part, at most `cap` bytes: what the kernel before this product
    /// asks L2 for in the decode step (`cap` 0: nothing).
    pub fn weight_span(&self, gpu: &Gpu, cap: usize) -> L2Span {
        self.parts
            .first()
            .map_or(L2Span::NONE, |p| p.matrix.weight_span(gpu).capped(cap))
    }
    /// Runs the Tiled-CBC parts with `kernel` (lane8 or rr: same device arrays, same launch).
    pub fn set_tcbc_kernel(&mut self, kernel: TcbcKernel) -> Result<()> {
        if kernel == TcbcKernel::Spdp {
            return Err(GpuError::Unsupported(
                "the SPDP Tiled-CBC kernel has no accumulating launch for the decode step".into(),
            ));
        }
        for p in &mut self.parts {
            if let DeviceMatrix::TiledCbc(m) = &mut p.matrix {
                m.kernel = kernel;
            }
        }
        Ok(())
    }
    pub fn stored_bytes(&self) -> usize {
        self.parts.iter().map(|p| p.stored_bytes).sum()
    }
    /// Bytes the product reads for input `x` (host copy), each part under its threshold.
    pub fn bytes_for_input(&self, x: &[f32]) -> usize {
        self.parts
            .iter()
            .map(|p| {
                p.matrix
                    .bytes_for(&sieve_cuda::product::active_mask(x, p.threshold))
            })
            .sum()
    }
    /// Kernel labels, e.g. `tiled-cbc/lane8` or `dense-gemv+dense-colmajor`.
    pub fn label(&self) -> String {
        let mut labels: Vec<&str> = self.parts.iter().map(|p| p.matrix.label()).collect();
        labels.dedup();
        labels.join("+")
    }
}

/// `SIEVE_LOWBIT_COLS=off` in the environment keeps thresholded 4-bit matrices in the
/// tensor-core layout (the input masked, every weight read), read once: a switch for measuring
/// the column layout against it in a whole decode step, not a setting.
fn low_bit_columns_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SIEVE_LOWBIT_COLS").as_deref() != Ok("off"))
}
