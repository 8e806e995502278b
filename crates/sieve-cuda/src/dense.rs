//! Dense baselines: our f16 GEMV over the row-major matrix, the column-major variant that skips
//! inactive activations (TEAL alone), and cuBLAS GemmEx. Kernels: `kernels/dense_gemv.cu`.

use crate::error::{CudaError, DriverContext, Result};
use crate::gpu::{Gpu, KernelFamily};
use crate::product::{check_io, threshold_arg, DevPtr, GpuAccumulate, GpuMatVec, LaunchEpoch};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use half::f16;
use sieve_formats::{DenseMatrix, Threshold};

pub const FAMILY: KernelFamily = KernelFamily {
    name: "dense_gemv",
    source: include_str!("../kernels/dense_gemv.cu"),
};

/// Row-major f16 weights on the device, multiplied by our own GEMV kernel.
pub struct GpuDense {
    w: CudaSlice<f16>,
    rows: usize,
    cols: usize,
}

impl GpuDense {
    /// The array the decode step asks L2 for ahead of this product (its largest: the
    /// weights), see [`crate::product::L2Span`].
    pub fn weight_span(&self, gpu: &Gpu) -> crate::product::L2Span {
        crate::product::L2Span::of(gpu, &self.w)
    }

    pub fn upload(gpu: &Gpu, m: &DenseMatrix) -> Result<Self> {
        check_dims(m.rows(), m.cols())?;
        Ok(Self {
            w: gpu.upload(m.data())?,
            rows: m.rows(),
            cols: m.cols(),
        })
    }
    pub fn weights(&self) -> &CudaSlice<f16> {
        &self.w
    }
}

impl GpuMatVec for GpuDense {
    fn label(&self) -> String {
        "dense-gemv".into()
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn bytes_for(&self, _active: &[bool]) -> usize {
        // A row-major GEMV cannot skip columns: every weight is read.
        self.rows * self.cols * 2 + self.cols * 4 + self.rows * 4
    }
    fn launch(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        threshold: Threshold,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        check_io(self, x, y)?;
        let f = gpu.function(&FAMILY, self.rowmajor_kernel())?;
        let (m, k, t) = (self.rows as i32, self.cols as i32, threshold_arg(threshold));
        let cfg = LaunchConfig {
            grid_dim: ((self.rows as u32).div_ceil(8), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = gpu.stream().launch_builder(&f);
        let accumulate = 0i32;
        b.arg(&self.w)
            .arg(x)
            .arg(y)
            .arg(&m)
            .arg(&k)
            .arg(&t)
            .arg(&accumulate);
        unsafe { b.launch(cfg) }.during("launching dense_gemv_rowmajor")?;
        Ok(())
    }
}

impl GpuDense {
    fn rowmajor_kernel(&self) -> &'static str {
        if self.cols.is_multiple_of(8) {
            "dense_gemv_rowmajor"
        } else {
            "dense_gemv_rowmajor_scalar"
        }
    }
}

impl GpuAccumulate for GpuDense {
    fn launch_add(&self, gpu: &Gpu, x: DevPtr, threshold: Threshold, y: DevPtr) -> Result<()> {
        let f = gpu.function(&FAMILY, self.rowmajor_kernel())?;
        let (m, k, t) = (self.rows as i32, self.cols as i32, threshold_arg(threshold));
        let cfg = LaunchConfig {
            grid_dim: ((self.rows as u32).div_ceil(8), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let accumulate = 1i32;
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.w)
            .arg(&x)
            .arg(&y)
            .arg(&m)
            .arg(&k)
            .arg(&t)
            .arg(&accumulate);
        unsafe { b.launch(cfg) }.during("launching dense_gemv_rowmajor (accumulate)")?;
        Ok(())
    }
}

impl GpuAccumulate for GpuDenseColMajor {
    fn launch_add(&self, gpu: &Gpu, x: DevPtr, threshold: Threshold, y: DevPtr) -> Result<()> {
        let f = gpu.function(&FAMILY, "dense_colmajor")?;
        let cpw = self.effective_cols_per_warp(gpu);
        let cfg = self.config(self.cols, cpw);
        let (m, k, ldm) = (self.rows as i32, self.cols as i32, self.ldm as i32);
        let (t, cpw) = (threshold_arg(threshold), cpw as i32);
        // A null flag array turns the fused zeroing off: the product is added to y.
        let (no_flags, epoch) = (0u64, 0u32);
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.w)
            .arg(&x)
            .arg(&y)
            .arg(&m)
            .arg(&k)
            .arg(&ldm)
            .arg(&t)
            .arg(&cpw)
            .arg(&no_flags)
            .arg(&epoch);
        unsafe { b.launch(cfg) }.during("launching dense_colmajor (accumulate)")?;
        Ok(())
    }
}

/// Column-major f16 weights (K x ldm, ldm = M rounded up to 8): dense weights whose columns
/// are skipped when their activation is inactive.
/// Warps per block of the column-major kernel (`WARPS_PER_BLOCK_CM` in the kernel).
const COLMAJOR_WARPS: u32 = 8;

pub struct GpuDenseColMajor {
    w: CudaSlice<f16>,
    rows: usize,
    cols: usize,
    ldm: usize,
    /// One per 256-row tile: the epoch of the launch whose zeroing of that tile of y is done
    /// (fused zeroing, see the kernel's header).
    flags: CudaSlice<u32>,
    epoch: LaunchEpoch,
    /// Inner-loop size: columns one warp walks before its partial sums are merged (a multiple
    /// of 32); 0 picks one from the shape so that the grid has ~24 warps per multiprocessor.
    pub cols_per_warp: usize,
}

impl GpuDenseColMajor {
    /// The array the decode step asks L2 for ahead of this product (its largest: the
    /// weights), see [`crate::product::L2Span`].
    pub fn weight_span(&self, gpu: &Gpu) -> crate::product::L2Span {
        crate::product::L2Span::of(gpu, &self.w)
    }

    pub fn upload(gpu: &Gpu, m: &DenseMatrix) -> Result<Self> {
        check_dims(m.rows(), m.cols())?;
        let (rows, cols) = (m.rows(), m.cols());
        let ldm = rows.div_ceil(8) * 8;
        let mut t = vec![f16::ZERO; cols * ldm];
        for r in 0..rows {
            for (c, v) in m.row(r).iter().enumerate() {
                t[c * ldm + r] = *v;
            }
        }
        Ok(Self {
            w: gpu.upload(&t)?,
            rows,
            cols,
            ldm,
            flags: gpu.upload(&vec![0u32; ldm.div_ceil(256).max(1)])?,
            epoch: LaunchEpoch::default(),
            cols_per_warp: 0,
        })
    }

    /// The K x ldm column-major weights (W transposed, rows padded to ldm), e.g. as a GEMM
    /// operand.
    pub fn weights(&self) -> &CudaSlice<f16> {
        &self.w
    }
    pub fn ldm(&self) -> usize {
        self.ldm
    }

    fn effective_cols_per_warp(&self, gpu: &Gpu) -> usize {
        if self.cols_per_warp > 0 {
            return self.cols_per_warp;
        }
        let target_warps = gpu.info().multiprocessors as usize * 24;
        let row_tiles = self.ldm.div_ceil(256);
        (self.cols * row_tiles)
            .div_ceil(target_warps)
            .div_ceil(32)
            .max(1)
            * 32
    }

    /// The product over an already compacted device list of active columns (`ncols` holds the
    /// count on the device, as written by [`compact_active`]).
    pub fn launch_list(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        cols: &CudaSlice<i32>,
        ncols: &CudaSlice<i32>,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        check_len("y", self.rows, y.len())?;
        gpu.zero_f32(y)?;
        let f = gpu.function(&FAMILY, "dense_colmajor_list")?;
        let cpw = self.effective_cols_per_warp(gpu);
        let cfg = self.config(self.cols, cpw);
        let (m, ldm, cpw) = (self.rows as i32, self.ldm as i32, cpw as i32);
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.w)
            .arg(x)
            .arg(cols)
            .arg(ncols)
            .arg(y)
            .arg(&m)
            .arg(&ldm)
            .arg(&cpw);
        unsafe { b.launch(cfg) }.during("launching dense_colmajor_list")?;
        Ok(())
    }

    fn config(&self, ncols: usize, cols_per_warp: usize) -> LaunchConfig {
        let slices = ncols.div_ceil(cols_per_warp.max(1));
        LaunchConfig {
            grid_dim: (
                (self.ldm as u32).div_ceil(256),
                (slices as u32).div_ceil(COLMAJOR_WARPS).max(1),
                1,
            ),
            block_dim: (32 * COLMAJOR_WARPS, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

impl GpuMatVec for GpuDenseColMajor {
    fn label(&self) -> String {
        if self.cols_per_warp == 0 {
            "dense-colmajor".into()
        } else {
            format!("dense-colmajor/c{}", self.cols_per_warp)
        }
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn bytes_for(&self, active: &[bool]) -> usize {
        let on = active.iter().filter(|a| **a).count();
        on * self.ldm * 2 + self.cols * 4 + self.rows * 4
    }
    fn launch(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        threshold: Threshold,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if !self.cols_per_warp.is_multiple_of(32) {
            return Err(CudaError::Option(format!(
                "cols_per_warp must be a multiple of 32 (0 = auto), got {}",
                self.cols_per_warp
            )));
        }
        check_io(self, x, y)?;
        let f = gpu.function(&FAMILY, "dense_colmajor")?;
        let cpw = self.effective_cols_per_warp(gpu);
        let cfg = self.config(self.cols, cpw);
        let (m, k, ldm) = (self.rows as i32, self.cols as i32, self.ldm as i32);
        let (t, cpw) = (threshold_arg(threshold), cpw as i32);
        let epoch = self.epoch.next();
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.w)
            .arg(x)
            .arg(y)
            .arg(&m)
            .arg(&k)
            .arg(&ldm)
            .arg(&t)
            .arg(&cpw)
            .arg(&self.flags)
            .arg(&epoch);
        unsafe { b.launch(cfg) }.during("launching dense_colmajor")?;
        Ok(())
    }
}

/// Writes the indices of the active entries of `x` (|x| > t) into `cols` and their number into
/// `ncols[0]`. `cols` must hold `x.len()` entries.
pub fn compact_active(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    threshold: Threshold,
    cols: &mut CudaSlice<i32>,
    ncols: &mut CudaSlice<i32>,
) -> Result<()> {
    check_len("active column list", x.len(), cols.len())?;
    gpu.stream()
        .memset_zeros(ncols)
        .during("zeroing the active count")?;
    let f = gpu.function(&FAMILY, "compact_active")?;
    let (k, t) = (x.len() as i32, threshold_arg(threshold));
    let cfg = LaunchConfig {
        grid_dim: ((x.len() as u32).div_ceil(256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(x).arg(&k).arg(&t).arg(cols).arg(ncols);
    unsafe { b.launch(cfg) }.during("launching compact_active")?;
    Ok(())
}

/// The vendor baseline: cuBLAS GemmEx with f16 inputs, f32 accumulation and f32 output,
/// `Y (n x M) = X (n x K) · Wᵀ`, W row-major M x K as uploaded by [`GpuDense`].
pub struct Cublas {
    rows: usize,
    cols: usize,
}

impl Cublas {
    pub fn new(gpu: &Gpu, w: &GpuDense) -> Result<Self> {
        gpu.cublas()?;
        Ok(Self {
            rows: w.rows,
            cols: w.cols,
        })
    }

    /// `x16` is n x K f16 row-major, `y` n x M f32 row-major.
    pub fn gemm(
        &self,
        gpu: &Gpu,
        w: &GpuDense,
        x16: &CudaSlice<f16>,
        n: usize,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        use cudarc::cublas::sys;
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        check_len("cuBLAS x", n * self.cols, x16.len())?;
        check_len("cuBLAS y", n * self.rows, y.len())?;
        let blas = gpu.cublas()?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let stream = gpu.stream();
        let (wp, _g1) = w.w.device_ptr(stream);
        let (xp, _g2) = x16.device_ptr(stream);
        let (yp, _g3) = y.device_ptr_mut(stream);
        // Column-major view: W is K x M (lda = K), so op(W) = Wᵀ is M x K; Xᵀ is K x n.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                self.rows as i32,
                n as i32,
                self.cols as i32,
                (&alpha as *const f32).cast(),
                wp as *const _,
                sys::cudaDataType::CUDA_R_16F,
                self.cols as i32,
                xp as *const _,
                sys::cudaDataType::CUDA_R_16F,
                self.cols as i32,
                (&beta as *const f32).cast(),
                yp as *mut _,
                sys::cudaDataType::CUDA_R_32F,
                self.rows as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )?;
        }
        Ok(())
    }
}

/// `Y = beta Y + X · Wᵀ` for `n` rows of f16 activations `X` (`ldx` = K per row) against an
/// M x K f16 weight matrix, f32 output `Y` (`ldy` per row), one cuBLAS GemmEx in the
/// column-major view `Yᵀ = op(W) · Xᵀ`: `w_transposed` false when `w` is M x K row-major
/// (`op = T`, `ldw` per row), true when it is K x M row-major (`op = N`, `ldw` per row).
#[allow(clippy::too_many_arguments)]
pub fn gemm_f16_rows(
    gpu: &Gpu,
    w: DevPtr,
    ldw: usize,
    w_transposed: bool,
    m: usize,
    k: usize,
    x: DevPtr,
    n: usize,
    y: DevPtr,
    ldy: usize,
    beta: f32,
) -> Result<()> {
    use cudarc::cublas::sys;
    let blas = gpu.cublas()?;
    let alpha = 1.0f32;
    let op = if w_transposed {
        sys::cublasOperation_t::CUBLAS_OP_N
    } else {
        sys::cublasOperation_t::CUBLAS_OP_T
    };
    let dim = |what: &str, v: usize| {
        i32::try_from(v).map_err(|_| CudaError::Unsupported(format!("a GEMM {what} of {v}")))
    };
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            op,
            sys::cublasOperation_t::CUBLAS_OP_N,
            dim("M", m)?,
            dim("N", n)?,
            dim("K", k)?,
            (&alpha as *const f32).cast(),
            w as *const _,
            sys::cudaDataType::CUDA_R_16F,
            dim("weight stride", ldw)?,
            x as *const _,
            sys::cudaDataType::CUDA_R_16F,
            dim("K", k)?,
            (&beta as *const f32).cast(),
            y as *mut _,
            sys::cudaDataType::CUDA_R_32F,
            dim("output stride", ldy)?,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )?;
    }
    Ok(())
}

/// A zeroed device buffer of `len` f16 (activations for [`Cublas::gemm`]).
pub fn zeroed_f16(gpu: &Gpu, len: usize) -> Result<CudaSlice<f16>> {
    gpu.upload(&vec![f16::ZERO; len.max(1)])
}

/// Converts f32 activations to f16 on the device (the cuBLAS baseline's input type).
pub fn to_f16(gpu: &Gpu, x: &CudaSlice<f32>, out: &mut CudaSlice<f16>) -> Result<()> {
    check_len("f16 activations", x.len(), out.len())?;
    let f = gpu.function(&FAMILY, "f32_to_f16")?;
    let n = x.len() as i32;
    let cfg = LaunchConfig {
        grid_dim: ((x.len() as u32).div_ceil(256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(x).arg(out).arg(&n);
    unsafe { b.launch(cfg) }.during("launching f32_to_f16")?;
    Ok(())
}

/// A device-to-device copy of `src` into `dst` with 16-byte accesses (the bandwidth ceiling).
pub fn copy(gpu: &Gpu, src: &CudaSlice<u8>, dst: &mut CudaSlice<u8>) -> Result<()> {
    if src.len() != dst.len() || !src.len().is_multiple_of(16) {
        return Err(CudaError::Option(
            "copy: buffers must have equal lengths, a multiple of 16".into(),
        ));
    }
    let f = gpu.function(&FAMILY, "copy16")?;
    let n = src.len() / 16;
    let cfg = LaunchConfig {
        grid_dim: (gpu.info().multiprocessors * 8, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(src).arg(dst).arg(&n);
    unsafe { b.launch(cfg) }.during("launching copy16")?;
    Ok(())
}

fn check_dims(rows: usize, cols: usize) -> Result<()> {
    if rows > i32::MAX as usize || cols > i32::MAX as usize {
        return Err(CudaError::Option(format!(
            "matrix {rows} x {cols} exceeds the kernels' 32-bit dimensions"
        )));
    }
    Ok(())
}

pub(crate) fn check_len(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected != actual {
        return Err(CudaError::Shape {
            what,
            expected,
            actual,
        });
    }
    Ok(())
}
