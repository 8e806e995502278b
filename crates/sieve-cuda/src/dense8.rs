//! Dense INT8 and FP8 (e4m3) GEMMs through cuBLASLt: the same-precision baseline that issue 29
//! measures the 8-bit sparse products against (`sieve bench gemm --precision
//! cublaslt-int8,cublaslt-fp8`). The operands are laid out as cuSPARSELt's
//! ([`crate::cusparselt`]): W row-major `[M][K]` (a K x M column-major matrix, op T), X row-major
//! `[N][K]` (K x N, op N), D row-major `[N][M]` (M x N column-major), the "TN" layout both
//! libraries require for 8-bit inputs. The accumulators (i32 for INT8, f32 or f16 for FP8) are
//! scaled to f32 outputs by `slide_lt.cu`'s `lt_scale_*`, as the sparse products' are.
//!
//! [`Dense8`] is the same product for a model's prompt passes (`--prompt-precision int8|fp8`,
//! W8A8): the weights quantized once per row on upload, each pass's activations masked and
//! quantized per token by the identity [`Lifter`], the sums scaled into the f32 rows.

use crate::cusparselt::{LtOut, LtPrecision, LtProduct, F16_OUT_ALPHA};
use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::product::{dev_ptr, DevPtr};
use crate::slide_lt::{quantize_rows, scale_outputs_from, Lifter, FAMILY};
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::CudaSlice;
use half::f16;
use sieve_formats::Threshold;
use std::ffi::c_void;

/// Workspace the heuristic may use (cuBLASLt's own recommendation for Hopper is 32 MiB).
const WORKSPACE_BYTES: usize = 32 << 20;

/// One planned dense 8-bit product (M, K, N fixed).
pub struct DenseLt8 {
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
    workspace: CudaSlice<u8>,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub precision: LtPrecision,
    pub out: LtOut,
    /// The alpha of every call: 1, or [`F16_OUT_ALPHA`] when FP8 sums are written as f16.
    pub alpha: f32,
}

// SAFETY: the handle and descriptors are created in `plan` and only read after (cuBLASLt
// documents its handle as usable from several host threads); `run` takes `&self`. Two runs of
// one plan at once on different streams would share its workspace: callers that share plans
// key them by stream (sieve-gpu's `Prompt8::plan`).
unsafe impl Send for DenseLt8 {}
unsafe impl Sync for DenseLt8 {}

fn blas(what: &'static str) -> impl Fn(lt::CublasError) -> CudaError {
    move |e| CudaError::CublasLt(format!("{what}: {e:?}"))
}

impl DenseLt8 {
    /// Plans the product; `precision` must be INT8 or e4m3. Tries the output types the sparse
    /// product of the same precision tries, in the same order.
    pub fn new(gpu: &Gpu, m: usize, k: usize, n: usize, precision: LtPrecision) -> Result<Self> {
        if precision == LtPrecision::F16 {
            return Err(CudaError::Option(
                "the f16 dense baseline is cuBLAS's GEMM, not DenseLt8".into(),
            ));
        }
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::CublasLt(
                "libcublasLt could not be loaded".into(),
            ));
        }
        if !m.is_multiple_of(16) || !k.is_multiple_of(16) || !n.is_multiple_of(16) || m * k * n == 0
        {
            return Err(CudaError::Option(format!(
                "8-bit cuBLASLt product {m} x {k} x {n}: every size must be a positive multiple of 16"
            )));
        }
        gpu.context()
            .bind_to_thread()
            .map_err(|source| CudaError::Driver {
                what: "binding the context for cuBLASLt",
                source,
            })?;
        let outs: &[LtOut] = match precision {
            LtPrecision::Int8 => &[LtOut::I32],
            _ => &[LtOut::F32, LtOut::F16],
        };
        let mut last = None;
        for &out in outs {
            match Self::plan(gpu, m, k, n, precision, out) {
                Ok(p) => return Ok(p),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| CudaError::Option("no output type".into())))
    }

    fn plan(
        gpu: &Gpu,
        m: usize,
        k: usize,
        n: usize,
        precision: LtPrecision,
        out: LtOut,
    ) -> Result<Self> {
        use sys::cudaDataType_t as T;
        let (tin, compute, scale) = match precision {
            LtPrecision::Int8 => (
                T::CUDA_R_8I,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32I,
                T::CUDA_R_32I,
            ),
            _ => (
                T::CUDA_R_8F_E4M3,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                T::CUDA_R_32F,
            ),
        };
        let tout = match out {
            LtOut::I32 => T::CUDA_R_32I,
            LtOut::F32 => T::CUDA_R_32F,
            LtOut::F16 => T::CUDA_R_16F,
        };
        let handle = lt::create_handle().map_err(blas("cublasLtCreate"))?;
        let desc =
            lt::create_matmul_desc(compute, scale).map_err(blas("cublasLtMatmulDescCreate"))?;
        let op_t: i32 = 1; // CUBLAS_OP_T
                           // SAFETY: desc is live; the attribute is a 4-byte cublasOperation_t.
        unsafe {
            lt::set_matmul_desc_attribute(
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &op_t as *const i32 as *const c_void,
                4,
            )
        }
        .map_err(blas("CUBLASLT_MATMUL_DESC_TRANSA"))?;
        let (mu, ku, nu) = (m as u64, k as u64, n as u64);
        let a = lt::create_matrix_layout(tin, ku, mu, k as i64).map_err(blas("layout A"))?;
        let b = lt::create_matrix_layout(tin, ku, nu, k as i64).map_err(blas("layout B"))?;
        let d = lt::create_matrix_layout(tout, mu, nu, m as i64).map_err(blas("layout D"))?;
        let pref = lt::create_matmul_pref().map_err(blas("cublasLtMatmulPreferenceCreate"))?;
        let ws = WORKSPACE_BYTES;
        // SAFETY: pref is live; the attribute is a size_t.
        unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const usize as *const c_void,
                std::mem::size_of::<usize>(),
            )
        }
        .map_err(blas("CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES"))?;
        // SAFETY: every descriptor is live.
        let heuristic = unsafe { lt::get_matmul_algo_heuristic(handle, desc, a, b, d, d, pref) };
        unsafe { lt::destroy_matmul_pref(pref) }.map_err(blas("destroying the preference"))?;
        let heuristic = match heuristic {
            Ok(h) => h,
            Err(e) => {
                // SAFETY: created above, not used again.
                unsafe {
                    let _ = lt::destroy_matrix_layout(a);
                    let _ = lt::destroy_matrix_layout(b);
                    let _ = lt::destroy_matrix_layout(d);
                    let _ = lt::destroy_matmul_desc(desc);
                    let _ = lt::destroy_handle(handle);
                }
                return Err(CudaError::CublasLt(format!(
                    "no cuBLASLt algorithm for {precision:?} -> {out:?} at {m} x {k} x {n}: {e:?}"
                )));
            }
        };
        let workspace = gpu.alloc_bytes(ws)?;
        let alpha = if out == LtOut::F16 {
            F16_OUT_ALPHA
        } else {
            1.0
        };
        Ok(Self {
            handle,
            desc,
            a,
            b,
            d,
            algo: heuristic.algo,
            workspace,
            m,
            k,
            n,
            precision,
            out,
            alpha,
        })
    }

    /// `D = W · Xᵀ` on sieve's stream (`w` M x K, `x` N x K, `d` N x M, all row-major).
    pub fn run(&self, gpu: &Gpu, w: DevPtr, x: DevPtr, d: DevPtr) -> Result<()> {
        let ws = crate::product::dev_ptr(gpu, &self.workspace);
        let stream = gpu.stream().cu_stream() as sys::cudaStream_t;
        // Scale type i32 for INT8 (alpha 1, beta 0), f32 otherwise.
        let (ai, bi, af, bf) = (1i32, 0i32, self.alpha, 0f32);
        let (alpha, beta) = if self.precision == LtPrecision::Int8 {
            (
                &ai as *const i32 as *const c_void,
                &bi as *const i32 as *const c_void,
            )
        } else {
            (
                &af as *const f32 as *const c_void,
                &bf as *const f32 as *const c_void,
            )
        };
        // SAFETY: the operands hold the planned sizes (the caller's contract).
        unsafe {
            lt::matmul(
                self.handle,
                self.desc,
                alpha,
                beta,
                w as *const c_void,
                self.a,
                x as *const c_void,
                self.b,
                d as *const c_void,
                self.d,
                d as *mut c_void,
                self.d,
                &self.algo,
                ws as *mut c_void,
                WORKSPACE_BYTES,
                stream,
            )
        }
        .map_err(blas("cublasLtMatmul"))
    }
}

impl Drop for DenseLt8 {
    fn drop(&mut self) {
        // SAFETY: created in `plan`, destroyed once.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.d);
            let _ = lt::destroy_matmul_desc(self.desc);
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

/// A dense matrix kept as 8-bit codes for W8A8 products of many tokens: rows quantized with one
/// scale each (INT8 `max / 127`, e4m3 `max / 448`, as [`quantize_rows`] does), padded to the
/// library shapes (rows and K to multiples of 64, the padding zero), and the identity lifter
/// that quantizes each token's masked input with one scale per token. The product equals
/// [`crate::slide::eight_bit_reference`] of the same values.
pub struct Dense8 {
    rows: usize,
    mp: usize,
    kp: usize,
    precision: LtPrecision,
    lifter: Lifter,
    weights: CudaSlice<u8>,
    w_scales: CudaSlice<f32>,
}

impl Dense8 {
    /// Quantizes `values` (`rows` x `cols`, row-major f16) for `precision` (INT8 or e4m3) and
    /// uploads it.
    pub fn upload(
        gpu: &Gpu,
        values: &[f16],
        rows: usize,
        cols: usize,
        precision: LtPrecision,
    ) -> Result<Self> {
        if precision == LtPrecision::F16 {
            return Err(CudaError::Option(
                "an 8-bit dense copy needs INT8 or e4m3, not f16".into(),
            ));
        }
        if rows == 0 || cols == 0 || values.len() != rows * cols {
            return Err(CudaError::Shape {
                what: "8-bit dense matrix values",
                expected: rows * cols,
                actual: values.len(),
            });
        }
        let (mp, kp, _) = LtProduct::padded(rows, cols, 1, precision);
        let lifter = Lifter::identity(gpu, cols, kp, precision)?;
        let (bytes, scales) = quantize_rows(values, rows, cols, kp, mp, precision);
        for name in ["lt_scale_i32", "lt_scale_f32", "lt_scale_f16"] {
            gpu.function(&FAMILY, name)?;
        }
        Ok(Self {
            rows,
            mp,
            kp,
            precision,
            lifter,
            weights: gpu.upload(&bytes)?,
            w_scales: gpu.upload(&scales)?,
        })
    }

    pub fn precision(&self) -> LtPrecision {
        self.precision
    }
    /// (Rows, K) of the library's product, both padded: a plan of this matrix is
    /// `DenseLt8::new(gpu, mp, kp, np, precision)`.
    pub fn plan_shape(&self) -> (usize, usize) {
        (self.mp, self.kp)
    }
    /// Bytes of the codes and the row scales.
    pub fn device_bytes(&self) -> usize {
        self.weights.len() + self.w_scales.len() * 4
    }

    /// A plan for `np` tokens (a multiple of the precision's token step, see
    /// [`LtProduct::padded`]).
    pub fn plan(&self, gpu: &Gpu, np: usize) -> Result<DenseLt8> {
        DenseLt8::new(gpu, self.mp, self.kp, np, self.precision)
    }

    /// `Y[t] (+)= W · q(mask_t(X[t]))` for `n` tokens (f32 rows `ldx` and `ldy` apart) through
    /// caller-owned scratch: `codes` holds `p.n` rows of `kp` codes, `acc` `p.n` x `mp`
    /// accumulators of 4 bytes, `scales` `p.n` f32. Three launches: the quantization, the
    /// cuBLASLt product, the scaling.
    #[allow(clippy::too_many_arguments)]
    pub fn launch_rows_to(
        &self,
        gpu: &Gpu,
        p: &DenseLt8,
        codes: DevPtr,
        acc: DevPtr,
        scales: DevPtr,
        x: DevPtr,
        ldx: usize,
        n: usize,
        threshold: Threshold,
        y: DevPtr,
        ldy: usize,
        accumulate: bool,
    ) -> Result<()> {
        if p.m != self.mp || p.k != self.kp || p.precision != self.precision {
            return Err(CudaError::Option(format!(
                "a cuBLASLt plan of {} x {} x {} ({:?}) for a {} x {} {:?} matrix",
                p.m, p.k, p.n, p.precision, self.mp, self.kp, self.precision
            )));
        }
        self.lifter
            .run_to(gpu, x, ldx, n, p.n, threshold, codes, scales)?;
        p.run(gpu, dev_ptr(gpu, &self.weights), codes, acc)?;
        let both = Some((dev_ptr(gpu, &self.w_scales), scales));
        scale_outputs_from(
            gpu, p.out, p.alpha, acc, self.mp, self.rows, n, both, y, ldy, accumulate,
        )
    }
}
