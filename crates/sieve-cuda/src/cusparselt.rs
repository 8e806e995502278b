//! cuSPARSELt, NVIDIA's 2:4 sparse tensor-core GEMM library, loaded at run time (issue 29,
//! SlideSparse's library path beside the hand-written `mma.sp` of `slide.rs`). Builds without
//! CUDA need nothing: the library is opened with `dlopen` on first use, from
//! `$SIEVE_CUSPARSELT`, else the Python packages' `nvidia/cusparselt` (or `nvidia/cu13`)
//! folders, else the loader's search path; a machine without it gets
//! [`CudaError::NoCusparseLt`] naming every place tried.
//!
//! One product, in the library's column-major terms ("TN", the only layout it takes for INT8
//! and FP8): `D (M x N, ld M) = op(A) · B` with A the weights W stored K x M (W row-major, K
//! contiguous, 2:4 along K), opA = T, and B the activations X stored K x N (X row-major `[N][K]`),
//! opB = N. D is Y row-major `[N][M]`. Descriptors, plan and workspace are made once per
//! (M, K, N, precision) by [`LtProduct::new`]; the weights are compressed once
//! ([`LtProduct::compress`]); [`LtProduct::run`] is then one `cusparseLtMatmul`.
//!
//! The opaque structs are 512 bytes in 0.10 and were 1024 before; 1024 serves both.

use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::product::DevPtr;
use cudarc::driver::CudaSlice;
use std::ffi::{c_char, c_void, CStr};
use std::path::PathBuf;
use std::sync::Arc;

#[repr(C, align(16))]
struct Opaque([u8; 1024]);

impl Opaque {
    fn boxed() -> Box<Self> {
        Box::new(Opaque([0; 1024]))
    }
}

type Status = i32;
type Stream = cudarc::driver::sys::CUstream;
type O = *const Opaque;
type OM = *mut Opaque;

// cudaDataType (library_types.h), cusparseOrder_t and cusparseOperation_t (cusparse.h),
// cusparseComputeType (cusparseLt.h).
const CUDA_R_32F: i32 = 0;
const CUDA_R_16F: i32 = 2;
const CUDA_R_8I: i32 = 3;
const CUDA_R_32I: i32 = 10;
const CUDA_R_8F_E4M3: i32 = 28;
const ORDER_COL: i32 = 1;
const OP_N: i32 = 0;
const OP_T: i32 = 1;
const COMPUTE_32I: i32 = 0;
const COMPUTE_32F: i32 = 2;
const SPARSITY_50: i32 = 0;
const ALG_DEFAULT: i32 = 0;

/// cusparseLtMatmul and cusparseLtMatmulSearch (the plan is const in the first, written by the
/// second; one type serves both).
type MatmulFn = unsafe extern "C" fn(
    O,
    OM,
    *const c_void,
    *const c_void,
    *const c_void,
    *const c_void,
    *const c_void,
    *mut c_void,
    *mut c_void,
    *mut Stream,
    i32,
) -> Status;

/// The entry points sieve calls, looked up once.
struct Api {
    init: unsafe extern "C" fn(OM) -> Status,
    destroy: unsafe extern "C" fn(O) -> Status,
    version: unsafe extern "C" fn(O, *mut i32) -> Status,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
    dense_init: unsafe extern "C" fn(O, OM, i64, i64, i64, u32, i32, i32) -> Status,
    structured_init: unsafe extern "C" fn(O, OM, i64, i64, i64, u32, i32, i32, i32) -> Status,
    mat_destroy: unsafe extern "C" fn(O) -> Status,
    matmul_init: unsafe extern "C" fn(O, OM, i32, i32, O, O, O, O, i32) -> Status,
    alg_init: unsafe extern "C" fn(O, OM, O, i32) -> Status,
    alg_destroy: unsafe extern "C" fn(O) -> Status,
    plan_init: unsafe extern "C" fn(O, OM, O, O) -> Status,
    plan_destroy: unsafe extern "C" fn(O) -> Status,
    workspace: unsafe extern "C" fn(O, O, *mut usize) -> Status,
    compressed_size: unsafe extern "C" fn(O, O, *mut usize, *mut usize) -> Status,
    compress: unsafe extern "C" fn(O, O, *const c_void, *mut c_void, *mut c_void, Stream) -> Status,
    matmul: MatmulFn,
    search: MatmulFn,
}

/// The loaded library and one handle.
pub struct CusparseLt {
    api: Api,
    handle: Box<Opaque>,
    initialized: bool,
    /// `major * 1000 + minor * 100 + patch` as the library reports it.
    pub version: i32,
    pub path: PathBuf,
    // Last: dropped after the handle is destroyed.
    _lib: libloading::Library,
}

// SAFETY: the handle is only read after `cusparseLtInit` (the library documents its functions
// as thread-safe for distinct plans), and every call goes through `&self`.
unsafe impl Send for CusparseLt {}
unsafe impl Sync for CusparseLt {}

impl std::fmt::Debug for CusparseLt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CusparseLt")
            .field("version", &self.version)
            .field("path", &self.path)
            .finish()
    }
}

/// Where the library is looked for, in order.
pub fn candidate_paths() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os("SIEVE_CUSPARSELT") {
        out.push(PathBuf::from(p));
    }
    // Python packages: nvidia-cusparselt-cu12 puts it in nvidia/cusparselt/lib,
    // nvidia-cusparselt-cu13 in nvidia/cu13/lib.
    let mut roots: Vec<PathBuf> = ["/usr/local/lib", "/usr/lib", "/opt/conda/lib"]
        .iter()
        .map(PathBuf::from)
        .collect();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = std::env::var_os(var) {
            roots.push(PathBuf::from(v).join("lib"));
        }
    }
    if let Some(h) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(h).join(".local/lib"));
    }
    for root in roots {
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("python3"))
            })
            .collect();
        pythons.sort();
        for py in pythons {
            for packages in ["site-packages", "dist-packages"] {
                for sub in [
                    "nvidia/cusparselt/lib",
                    "nvidia/cu13/lib",
                    "nvidia/cu12/lib",
                ] {
                    let p = py.join(packages).join(sub).join("libcusparseLt.so.0");
                    if p.exists() {
                        out.push(p);
                    }
                }
            }
        }
    }
    out.push(PathBuf::from("libcusparseLt.so.0"));
    out
}

impl CusparseLt {
    /// Opens the library (the first of [`candidate_paths`] that loads) and a handle on `gpu`'s
    /// context.
    pub fn load(gpu: &Gpu) -> Result<Arc<Self>> {
        let mut tried = Vec::new();
        for path in candidate_paths() {
            // SAFETY: loading a shared library runs its initializers; cuSPARSELt's only set up
            // its own state.
            match unsafe { libloading::Library::new(&path) } {
                Ok(lib) => return Self::from_library(gpu, lib, path),
                Err(e) => tried.push(format!("{}: {e}", path.display())),
            }
        }
        Err(CudaError::NoCusparseLt(tried.join("; ")))
    }

    fn from_library(gpu: &Gpu, lib: libloading::Library, path: PathBuf) -> Result<Arc<Self>> {
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the signatures above are cusparseLt.h's (0.6 to 0.10).
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| {
                    CudaError::NoCusparseLt(format!("{}: no {}: {e}", path.display(), $name))
                })?
            };
        }
        let api = Api {
            init: sym!("cusparseLtInit"),
            destroy: sym!("cusparseLtDestroy"),
            version: sym!("cusparseLtGetVersion"),
            error_string: sym!("cusparseLtGetErrorString"),
            dense_init: sym!("cusparseLtDenseDescriptorInit"),
            structured_init: sym!("cusparseLtStructuredDescriptorInit"),
            mat_destroy: sym!("cusparseLtMatDescriptorDestroy"),
            matmul_init: sym!("cusparseLtMatmulDescriptorInit"),
            alg_init: sym!("cusparseLtMatmulAlgSelectionInit"),
            alg_destroy: sym!("cusparseLtMatmulAlgSelectionDestroy"),
            plan_init: sym!("cusparseLtMatmulPlanInit"),
            plan_destroy: sym!("cusparseLtMatmulPlanDestroy"),
            workspace: sym!("cusparseLtMatmulGetWorkspace"),
            compressed_size: sym!("cusparseLtSpMMACompressedSize"),
            compress: sym!("cusparseLtSpMMACompress"),
            matmul: sym!("cusparseLtMatmul"),
            search: sym!("cusparseLtMatmulSearch"),
        };
        // The library works on the calling thread's current context: make it sieve's.
        gpu.context()
            .bind_to_thread()
            .map_err(|source| CudaError::Driver {
                what: "binding the context for cuSPARSELt",
                source,
            })?;
        let mut lt = Self {
            api,
            handle: Opaque::boxed(),
            initialized: false,
            version: 0,
            path,
            _lib: lib,
        };
        let status = unsafe { (lt.api.init)(&mut *lt.handle) };
        lt.check("cusparseLtInit", status)?;
        lt.initialized = true;
        let mut v = 0i32;
        lt.check("cusparseLtGetVersion", unsafe {
            (lt.api.version)(lt.h(), &mut v)
        })?;
        lt.version = v;
        Ok(Arc::new(lt))
    }

    fn h(&self) -> O {
        &*self.handle
    }

    fn check(&self, call: &'static str, status: Status) -> Result<()> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: the library returns a static C string for any status.
        let text = unsafe {
            let p = (self.api.error_string)(status);
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        Err(CudaError::CusparseLt { call, status, text })
    }
}

impl Drop for CusparseLt {
    fn drop(&mut self) {
        if self.initialized {
            // SAFETY: cusparseLtInit succeeded on this handle.
            unsafe { (self.api.destroy)(self.h()) };
        }
    }
}

/// The operand types of one product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LtPrecision {
    /// f16 inputs, f32 accumulation, f32 output (f16 where the library refuses it).
    F16,
    /// INT8 inputs, i32 accumulation.
    Int8,
    /// FP8 e4m3 inputs, f32 accumulation.
    E4m3,
}

impl LtPrecision {
    /// Bytes of one input element.
    pub fn input_bytes(self) -> usize {
        match self {
            LtPrecision::F16 => 2,
            LtPrecision::Int8 | LtPrecision::E4m3 => 1,
        }
    }
    fn input_type(self) -> i32 {
        match self {
            LtPrecision::F16 => CUDA_R_16F,
            LtPrecision::Int8 => CUDA_R_8I,
            LtPrecision::E4m3 => CUDA_R_8F_E4M3,
        }
    }
    fn compute(self) -> i32 {
        match self {
            LtPrecision::Int8 => COMPUTE_32I,
            LtPrecision::F16 | LtPrecision::E4m3 => COMPUTE_32F,
        }
    }
    /// Output types to try, best first: exact i32 sums for INT8, f32 for f16 and FP8, and f16
    /// (scaled by [`F16_OUT_ALPHA`] for the 8-bit types) where the library refuses those.
    fn outputs(self) -> &'static [LtOut] {
        match self {
            LtPrecision::F16 => &[LtOut::F32, LtOut::F16],
            LtPrecision::Int8 => &[LtOut::I32, LtOut::F16],
            LtPrecision::E4m3 => &[LtOut::F32, LtOut::F16],
        }
    }
    /// Padding of N (columns of B and D) the library accepts: 16 for f16, 32 for 8-bit types
    /// (window L1: it refuses 8-bit operands with 8 columns).
    pub fn n_multiple(self) -> usize {
        match self {
            LtPrecision::F16 => 16,
            LtPrecision::Int8 | LtPrecision::E4m3 => 32,
        }
    }
}

/// The accumulator type D is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LtOut {
    F16,
    I32,
    F32,
}

impl LtOut {
    pub fn bytes(self) -> usize {
        match self {
            LtOut::F16 => 2,
            LtOut::I32 | LtOut::F32 => 4,
        }
    }
    fn data_type(self) -> i32 {
        match self {
            LtOut::F16 => CUDA_R_16F,
            LtOut::I32 => CUDA_R_32I,
            LtOut::F32 => CUDA_R_32F,
        }
    }
}

/// alpha of an 8-bit product written as f16: 2^-16 keeps `Σ q_w q_x` of 16,512 terms of at most
/// 448² (e4m3) or 127² (INT8) below f16's 65,504; the scale kernel multiplies by 2^16 again.
pub const F16_OUT_ALPHA: f32 = 1.0 / 65536.0;

/// One planned product `D = op(A) · B` (see the module documentation): M rows, K columns of
/// the weights, N tokens, each a multiple of what the library asks ([`Self::padded`]).
pub struct LtProduct {
    lt: Arc<CusparseLt>,
    a: Box<Opaque>,
    b: Box<Opaque>,
    c: Box<Opaque>,
    matmul: Box<Opaque>,
    alg: Box<Opaque>,
    plan: Box<Opaque>,
    workspace: CudaSlice<u8>,
    compressed_bytes: usize,
    buffer_bytes: usize,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub precision: LtPrecision,
    pub out: LtOut,
    /// The alpha every call passes (1, or [`F16_OUT_ALPHA`] for an 8-bit product in f16).
    pub alpha: f32,
}

// SAFETY: the descriptors are plain memory the library reads; the plan is only changed by
// `search` (through `&mut self`).
unsafe impl Send for LtProduct {}
unsafe impl Sync for LtProduct {}

/// Zeroed bytes past the compressed size the library reports. Under compute-sanitizer's
/// memcheck on an H100 (window O1, cuSPARSELt 0.8), a kernel that `cusparseLtMatmulSearch`
/// tried on a 256 x 320 INT8 product (`sm90_xmma_sparse_gemm_i8i32_..._tilesize128x192x128`)
/// read 1,024 bytes from 512 bytes before the end of the 51,200 it asked for: its results were
/// right (the tail of the tile is discarded), but the read left the allocation. The slack keeps
/// such reads inside sieve's buffer, for the cost of a page per weight matrix.
pub const COMPRESSED_SLACK: usize = 64 * 1024;

impl LtProduct {
    /// (M, K, N) rounded up to what the library takes: M and K to 64 (2:4 groups, 8-bit
    /// alignment), N to [`LtPrecision::n_multiple`].
    pub fn padded(m: usize, k: usize, n: usize, precision: LtPrecision) -> (usize, usize, usize) {
        (
            m.next_multiple_of(64),
            k.next_multiple_of(64),
            n.max(1).next_multiple_of(precision.n_multiple()),
        )
    }

    /// Describes and plans the product; `m`, `k`, `n` must already be padded.
    pub fn new(
        gpu: &Gpu,
        lt: &Arc<CusparseLt>,
        m: usize,
        k: usize,
        n: usize,
        precision: LtPrecision,
    ) -> Result<Self> {
        if (m, k, n) != Self::padded(m, k, n, precision) || m == 0 || k == 0 {
            return Err(CudaError::Option(format!(
                "cuSPARSELt product {m} x {k} x {n}: pad it with LtProduct::padded first"
            )));
        }
        let mut last = None;
        for &out in precision.outputs() {
            match Self::plan(gpu, lt, m, k, n, precision, out) {
                Ok(p) => return Ok(p),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| CudaError::Option("no output type".into())))
    }

    fn plan(
        gpu: &Gpu,
        lt: &Arc<CusparseLt>,
        m: usize,
        k: usize,
        n: usize,
        precision: LtPrecision,
        out: LtOut,
    ) -> Result<Self> {
        let (mi, ki, ni) = (m as i64, k as i64, n as i64);
        let tin = precision.input_type();
        let h = lt.h();
        let mut a = Opaque::boxed();
        let mut b = Opaque::boxed();
        let mut c = Opaque::boxed();
        let mut matmul = Opaque::boxed();
        let mut alg = Opaque::boxed();
        let mut plan = Opaque::boxed();
        let api = &lt.api;
        // SAFETY: every pointer is a live 1024-byte, 16-aligned descriptor or the handle.
        unsafe {
            lt.check(
                "cusparseLtStructuredDescriptorInit",
                (api.structured_init)(h, &mut *a, ki, mi, ki, 16, tin, ORDER_COL, SPARSITY_50),
            )?;
            lt.check(
                "cusparseLtDenseDescriptorInit (B)",
                (api.dense_init)(h, &mut *b, ki, ni, ki, 16, tin, ORDER_COL),
            )?;
            lt.check(
                "cusparseLtDenseDescriptorInit (D)",
                (api.dense_init)(h, &mut *c, mi, ni, mi, 16, out.data_type(), ORDER_COL),
            )?;
            lt.check(
                "cusparseLtMatmulDescriptorInit",
                (api.matmul_init)(
                    h,
                    &mut *matmul,
                    OP_T,
                    OP_N,
                    &*a,
                    &*b,
                    &*c,
                    &*c,
                    precision.compute(),
                ),
            )?;
            lt.check(
                "cusparseLtMatmulAlgSelectionInit",
                (api.alg_init)(h, &mut *alg, &*matmul, ALG_DEFAULT),
            )?;
            lt.check(
                "cusparseLtMatmulPlanInit",
                (api.plan_init)(h, &mut *plan, &*matmul, &*alg),
            )?;
        }
        let (mut ws, mut compressed, mut buffer) = (0usize, 0usize, 0usize);
        unsafe {
            lt.check(
                "cusparseLtMatmulGetWorkspace",
                (api.workspace)(h, &*plan, &mut ws),
            )?;
            lt.check(
                "cusparseLtSpMMACompressedSize",
                (api.compressed_size)(h, &*plan, &mut compressed, &mut buffer),
            )?;
        }
        let workspace = gpu.alloc_bytes(ws.max(256))?;
        let alpha = if out == LtOut::F16 && precision != LtPrecision::F16 {
            F16_OUT_ALPHA
        } else {
            1.0
        };
        Ok(Self {
            lt: lt.clone(),
            a,
            b,
            c,
            matmul,
            alg,
            plan,
            workspace,
            compressed_bytes: compressed,
            buffer_bytes: buffer,
            m,
            k,
            n,
            precision,
            out,
            alpha,
        })
    }

    /// Bytes of the compressed weights.
    pub fn compressed_bytes(&self) -> usize {
        self.compressed_bytes
    }

    /// Compresses `dense` (M x K row-major, elements of the input type, 2:4 along K: at most
    /// two nonzeros in every aligned four) into a new device buffer.
    pub fn compress(&self, gpu: &Gpu, dense: DevPtr) -> Result<CudaSlice<u8>> {
        let out = gpu.alloc_bytes(self.compressed_bytes + COMPRESSED_SLACK)?;
        let buffer = gpu.alloc_bytes(self.buffer_bytes.max(256))?;
        let (o, bf) = (
            crate::product::dev_ptr(gpu, &out),
            crate::product::dev_ptr(gpu, &buffer),
        );
        // SAFETY: dense holds M·K elements (the caller's contract), out and buffer the sizes
        // the plan asked for.
        unsafe {
            self.lt.check(
                "cusparseLtSpMMACompress",
                (self.lt.api.compress)(
                    self.lt.h(),
                    &*self.plan,
                    dense as *const c_void,
                    o as *mut c_void,
                    bf as *mut c_void,
                    gpu.stream().cu_stream(),
                ),
            )?;
        }
        gpu.synchronize()?;
        drop(buffer);
        Ok(out)
    }

    /// Lets the library time its kernels on these operands and keep the fastest in the plan.
    pub fn search(&mut self, gpu: &Gpu, compressed: DevPtr, x: DevPtr, d: DevPtr) -> Result<()> {
        let plan: OM = &mut *self.plan;
        self.call(
            gpu,
            "cusparseLtMatmulSearch",
            self.lt.api.search,
            plan,
            compressed,
            x,
            d,
        )?;
        gpu.synchronize()
    }

    /// `D = op(A) · B` on sieve's stream: `compressed` from [`Self::compress`], `x` N x K row-major
    /// of the input type, `d` N x M row-major of [`Self::out`].
    pub fn run(&self, gpu: &Gpu, compressed: DevPtr, x: DevPtr, d: DevPtr) -> Result<()> {
        // cusparseLtMatmul reads the plan only (its parameter is const).
        let plan = &*self.plan as *const Opaque as OM;
        self.call(
            gpu,
            "cusparseLtMatmul",
            self.lt.api.matmul,
            plan,
            compressed,
            x,
            d,
        )
    }

    /// One call of cusparseLtMatmul or cusparseLtMatmulSearch (the same parameters).
    #[allow(clippy::too_many_arguments)]
    fn call(
        &self,
        gpu: &Gpu,
        name: &'static str,
        f: MatmulFn,
        plan: OM,
        compressed: DevPtr,
        x: DevPtr,
        d: DevPtr,
    ) -> Result<()> {
        let mut stream = gpu.stream().cu_stream();
        let (alpha, beta) = (self.alpha, 0f32);
        let w = crate::product::dev_ptr(gpu, &self.workspace);
        // SAFETY: operands sized by the plan (the callers' contract); alpha and beta are f32
        // for every compute type.
        let status = unsafe {
            f(
                self.lt.h(),
                plan,
                &alpha as *const f32 as *const c_void,
                compressed as *const c_void,
                x as *const c_void,
                &beta as *const f32 as *const c_void,
                d as *const c_void,
                d as *mut c_void,
                w as *mut c_void,
                &mut stream,
                1,
            )
        };
        self.lt.check(name, status)
    }
}

impl Drop for LtProduct {
    fn drop(&mut self) {
        let api = &self.lt.api;
        // SAFETY: each was initialized in `plan` (a failed plan never builds a Self).
        unsafe {
            (api.plan_destroy)(&*self.plan);
            (api.alg_destroy)(&*self.alg);
            (api.mat_destroy)(&*self.a);
            (api.mat_destroy)(&*self.b);
            (api.mat_destroy)(&*self.c);
        }
        let _ = &self.matmul;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_meets_the_library_s_multiples() {
        assert_eq!(
            LtProduct::padded(4096, 6144, 1, LtPrecision::F16),
            (4096, 6144, 16)
        );
        assert_eq!(
            LtProduct::padded(11008, 16512, 33, LtPrecision::Int8),
            (11008, 16512, 64)
        );
        assert_eq!(
            LtProduct::padded(100, 70, 0, LtPrecision::E4m3),
            (128, 128, 32)
        );
    }

    #[test]
    fn the_explicit_path_is_tried_first_and_the_loader_s_last() {
        let paths = candidate_paths();
        assert_eq!(
            paths.last().map(|p| p.as_os_str().to_owned()),
            Some("libcusparseLt.so.0".into())
        );
    }
}
