//! Celty spMspV over RLC-CSC (`kernels/rlc_csc_spmspv.cu`). The device arrays are the format's
//! own arrays, uploaded as they are (layout: `sieve_formats::rlc_csc`).

use crate::dense::check_len;
use crate::error::{CudaError, DriverContext, Result};
use crate::gpu::{Gpu, KernelFamily};
use crate::product::{active_column_bytes, check_io, threshold_arg, DevPtr, GpuMatVec};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use sieve_formats::rlc_csc::RlcCsc;
use sieve_formats::{Threshold, WeightFormat};

pub const FAMILY: KernelFamily = KernelFamily {
    name: "rlc_csc_spmspv",
    source: include_str!("../kernels/rlc_csc_spmspv.cu"),
};

/// Which stages of the kernel run: the full product, or a variant with one stage left out, for
/// measuring where the time goes (Celty Fig. 5). Only `Full` computes the right result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stages {
    Full,
    NoReconstruction,
    NoAccumulation,
    LoadsOnly,
}

impl Stages {
    fn kernel(self) -> &'static str {
        match self {
            Stages::Full => "rlc_spmspv",
            Stages::NoReconstruction => "rlc_spmspv_norecon",
            Stages::NoAccumulation => "rlc_spmspv_noaccum",
            Stages::LoadsOnly => "rlc_spmspv_loadonly",
        }
    }
}

pub struct GpuRlcCsc {
    values: CudaSlice<u16>,
    indices: CudaSlice<u32>,
    seg_start: CudaSlice<u32>,
    seg_len: CudaSlice<u32>,
    slab_start: CudaSlice<u32>,
    slab_row: CudaSlice<u16>,
    rows: usize,
    cols: usize,
    block_rows: usize,
    index_bits: u32,
    /// Slabs of all segments (`slab_start`'s last entry).
    slabs: usize,
    /// Bytes of each column's segments (values + runs + per-segment metadata), for
    /// [`GpuMatVec::bytes_for`].
    col_bytes: Vec<usize>,
    /// Columns per block (Celty's inner-loop size).
    pub cols_per_warp: usize,
    /// Warps per block sharing one shared-memory accumulator.
    pub warps: usize,
    pub stages: Stages,
}

impl GpuRlcCsc {
    pub fn upload(gpu: &Gpu, f: &RlcCsc) -> Result<Self> {
        let (rows, cols) = (f.rows(), f.cols());
        if rows > i32::MAX as usize || cols > i32::MAX as usize {
            return Err(CudaError::Option("matrix exceeds 32-bit dimensions".into()));
        }
        let shared = f.block_rows() * 4;
        if shared > gpu.info().max_shared_per_block_optin {
            return Err(CudaError::Option(format!(
                "rlc-csc block_rows {} needs {shared} bytes of shared memory, the GPU allows {}",
                f.block_rows(),
                gpu.info().max_shared_per_block_optin
            )));
        }
        let n = f.index_bits() as usize;
        let mut col_bytes = vec![0usize; cols];
        let (ss, sl) = (f.seg_start(), f.slab_start());
        for seg in 0..f.segments() {
            let entries = (ss[seg + 1] - ss[seg]) as usize;
            let slabs = (sl[seg + 1] - sl[seg]) as usize;
            col_bytes[seg % cols] += entries * 2 + (entries * n).div_ceil(8) + 16 + slabs * 2;
        }
        // Slab cursors and segment lengths are read once per slab; the rest per column.
        let mut g = Self {
            values: gpu.upload(f.value_bits())?,
            indices: gpu.upload(f.packed_indices())?,
            seg_start: gpu.upload(f.seg_start())?,
            seg_len: gpu.upload(f.seg_len())?,
            slab_start: gpu.upload(f.slab_start())?,
            slab_row: gpu.upload(f.slab_row())?,
            rows,
            cols,
            block_rows: f.block_rows(),
            index_bits: f.index_bits(),
            slabs: *f.slab_start().last().unwrap_or(&0) as usize,
            col_bytes,
            cols_per_warp: 64,
            warps: 8,
            stages: Stages::Full,
        };
        g.warps = g.default_warps(f);
        Ok(g)
    }

    /// `out` (device, `cols` x `rows` f16, column k's rows contiguous) = the matrix, for the
    /// batched prefill's cuBLAS GEMM: zeroed, then every entry written by `rlc_to_f16_t`.
    pub fn decode_transposed(&self, gpu: &Gpu, out: DevPtr) -> Result<()> {
        if self.rows == 0 || self.cols == 0 {
            return Ok(());
        }
        // SAFETY: the caller's out holds rows x cols f16.
        unsafe { gpu.zero_bytes(out, self.rows * self.cols * 2) }?;
        let slabs = self.slabs;
        if slabs == 0 {
            return Ok(());
        }
        let f = gpu.function(&FAMILY, "rlc_to_f16_t")?;
        let cfg = crate::product::warp_per_item(slabs, || {
            format!("a {} x {} RLC-CSC matrix", self.rows, self.cols)
        })?;
        let (m, k, b) = (self.rows as i32, self.cols as i32, self.block_rows as i32);
        let (n, nseg, slabs) = (
            self.index_bits as i32,
            (self.seg_len.len()) as i32,
            slabs as i32,
        );
        let mut l = gpu.stream().launch_builder(&f);
        l.arg(&self.values)
            .arg(&self.indices)
            .arg(&self.seg_start)
            .arg(&self.seg_len)
            .arg(&self.slab_start)
            .arg(&self.slab_row)
            .arg(&out)
            .arg(&m)
            .arg(&k)
            .arg(&b)
            .arg(&n)
            .arg(&nseg)
            .arg(&slabs);
        unsafe { l.launch(cfg) }.during("launching rlc_to_f16_t")?;
        Ok(())
    }

    /// Enough warps to give every slab of an average segment its own warp, 4..16.
    fn default_warps(&self, f: &RlcCsc) -> usize {
        let segs = f.segments().max(1);
        let slabs = *f.slab_start().last().unwrap_or(&0) as usize;
        slabs.div_ceil(segs).clamp(4, 16)
    }

    fn check_tuning(&self) -> Result<()> {
        if self.cols_per_warp == 0 || !(1..=16).contains(&self.warps) {
            return Err(CudaError::Option(format!(
                "rlc-csc tuning: cols_per_warp {} (> 0), warps {} (1..=16)",
                self.cols_per_warp, self.warps
            )));
        }
        Ok(())
    }

    fn config(
        &self,
        ncols: usize,
        gpu: &Gpu,
        kernel: &cudarc::driver::CudaFunction,
    ) -> Result<LaunchConfig> {
        let shared = (self.block_rows.min(self.rows) * 4) as u32;
        gpu.allow_dynamic_shared(kernel, shared as usize)?;
        Ok(LaunchConfig {
            grid_dim: (
                (ncols.div_ceil(self.cols_per_warp) as u32).max(1),
                self.rows.div_ceil(self.block_rows) as u32,
                1,
            ),
            block_dim: (32 * self.warps as u32, 1, 1),
            shared_mem_bytes: shared,
        })
    }

    /// The product over an already compacted list of active columns (see
    /// [`crate::dense::compact_active`]); `x` is still the full activation vector.
    pub fn launch_list(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        list: &CudaSlice<i32>,
        ncols: &CudaSlice<i32>,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.check_tuning()?;
        check_io(self, x, y)?;
        check_len("active column list", self.cols, list.len())?;
        gpu.zero_f32(y)?;
        let f = gpu.function(&FAMILY, "rlc_spmspv_list")?;
        let cfg = self.config(self.cols, gpu, &f)?;
        let (m, k, br) = (self.rows as i32, self.cols as i32, self.block_rows as i32);
        let (nb, cpw) = (self.index_bits as i32, self.cols_per_warp as i32);
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.values)
            .arg(&self.indices)
            .arg(&self.seg_start)
            .arg(&self.seg_len)
            .arg(&self.slab_start)
            .arg(&self.slab_row)
            .arg(x)
            .arg(list)
            .arg(ncols)
            .arg(y)
            .arg(&m)
            .arg(&k)
            .arg(&br)
            .arg(&nb)
            .arg(&cpw);
        unsafe { b.launch(cfg) }.during("launching rlc_spmspv_list")?;
        Ok(())
    }
}

impl GpuMatVec for GpuRlcCsc {
    fn label(&self) -> String {
        let stage = match self.stages {
            Stages::Full => "",
            Stages::NoReconstruction => "/no-recon",
            Stages::NoAccumulation => "/no-accum",
            Stages::LoadsOnly => "/loads-only",
        };
        format!(
            "rlc-csc/b{}/c{}/w{}{stage}",
            self.block_rows, self.cols_per_warp, self.warps
        )
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn bytes_for(&self, active: &[bool]) -> usize {
        let w = active_column_bytes(&self.col_bytes, active);
        w + self.cols * 4 + self.rows * 4
    }
    fn launch(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        threshold: Threshold,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.check_tuning()?;
        check_io(self, x, y)?;
        gpu.zero_f32(y)?;
        let f = gpu.function(&FAMILY, self.stages.kernel())?;
        let cfg = self.config(self.cols, gpu, &f)?;
        let (m, k, br) = (self.rows as i32, self.cols as i32, self.block_rows as i32);
        let (nb, t, cpw) = (
            self.index_bits as i32,
            threshold_arg(threshold),
            self.cols_per_warp as i32,
        );
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.values)
            .arg(&self.indices)
            .arg(&self.seg_start)
            .arg(&self.seg_len)
            .arg(&self.slab_start)
            .arg(&self.slab_row)
            .arg(x)
            .arg(y)
            .arg(&m)
            .arg(&k)
            .arg(&br)
            .arg(&nb)
            .arg(&t)
            .arg(&cpw);
        unsafe { b.launch(cfg) }.during("launching rlc_spmspv")?;
        Ok(())
    }
}

impl crate::product::GpuAccumulate for GpuRlcCsc {
    fn launch_add(
        &self,
        gpu: &Gpu,
        x: crate::product::DevPtr,
        threshold: Threshold,
        y: crate::product::DevPtr,
    ) -> Result<()> {
        self.check_tuning()?;
        // The full kernel adds into y with atomics already; the launch just skips the zeroing.
        let f = gpu.function(&FAMILY, Stages::Full.kernel())?;
        let cfg = self.config(self.cols, gpu, &f)?;
        let (m, k, br) = (self.rows as i32, self.cols as i32, self.block_rows as i32);
        let (nb, t, cpw) = (
            self.index_bits as i32,
            threshold_arg(threshold),
            self.cols_per_warp as i32,
        );
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.values)
            .arg(&self.indices)
            .arg(&self.seg_start)
            .arg(&self.seg_len)
            .arg(&self.slab_start)
            .arg(&self.slab_row)
            .arg(&x)
            .arg(&y)
            .arg(&m)
            .arg(&k)
            .arg(&br)
            .arg(&nb)
            .arg(&t)
            .arg(&cpw);
        unsafe { b.launch(cfg) }.during("launching rlc_spmspv (accumulate)")?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;
    use proptest::prelude::*;
    use sieve_formats::random::{sparse_matrix, Pattern};
    use sieve_formats::rlc_csc::RlcCscOptions;

    /// `rlc_to_f16_t` on the CPU, warp by warp (one per slab) and lane by lane with the kernel's
    /// arithmetic: the segment by binary search of `slab_start`, stripes, run bits (straddling
    /// words), the per-stripe inclusive scan from the slab's cursor. Column-major f16 over a
    /// zeroed buffer.
    fn emulate_decode_transposed(f: &RlcCsc) -> Vec<f16> {
        let (m, k, b_rows, n) = (f.rows(), f.cols(), f.block_rows(), f.index_bits());
        let (ss, sl, lens, rows0) = (f.seg_start(), f.slab_start(), f.seg_len(), f.slab_row());
        let (values, indices) = (f.value_bits(), f.packed_indices());
        let nseg = lens.len();
        let slabs = *sl.last().unwrap() as usize;
        let mut out = vec![f16::ZERO; m * k];
        for slab in 0..slabs {
            let (mut lo, mut hi) = (0usize, nseg - 1);
            while lo < hi {
                let mid = (lo + hi).div_ceil(2);
                if sl[mid] as usize <= slab {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            let seg = lo;
            let j = slab - sl[seg] as usize;
            let base = ss[seg] as usize + 256 * j;
            let padded = (ss[seg + 1] - ss[seg]) as usize;
            let stripes = 8.min(padded / 32 - 8 * j);
            let (blk, col) = (seg / k, seg % k);
            let height = b_rows.min(m - blk * b_rows);
            let mut carry = rows0[slab] as usize;
            for s in 0..stripes {
                let mut incl = 0usize;
                for lane in 0..32 {
                    let p = base + lane * stripes + s;
                    let bit = n as usize * p;
                    let sh = bit % 32;
                    let mut run = indices[bit / 32] >> sh;
                    if sh + n as usize > 32 {
                        run |= indices[bit / 32 + 1] << (32 - sh);
                    }
                    incl += (run & ((1 << n) - 1)) as usize + 1;
                    let row = carry + incl - 1;
                    if 256 * j + 32 * s + lane < lens[seg] as usize && row < height {
                        out[col * m + blk * b_rows + row] = f16::from_bits(values[p]);
                    }
                }
                carry += incl;
            }
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// The prefill's f16 copy, emulated, is the matrix (column-major), gap padding, tails,
        /// short last blocks and empty segments included.
        #[test]
        fn decode_transposed_mapping_reproduces_the_matrix(m in 1usize..700, k in 1usize..40, sp in 0.0f64..0.99,
                                                           bits in 2u32..6, blocks in 0usize..2, seed in 0u64..1000) {
            let w = sparse_matrix(m, k, sp, Pattern::Unstructured, seed).unwrap();
            let opts = RlcCscOptions { index_bits: bits, block_rows: [256, 512][blocks] };
            let f = RlcCsc::encode(&w, &opts).unwrap();
            let out = emulate_decode_transposed(&f);
            for c in 0..k {
                for r in 0..m {
                    prop_assert_eq!(out[c * m + r].to_bits(), w.get(r, c).to_bits(), "({}, {})", r, c);
                }
            }
        }
    }
}
