//! SPDP spMspV over Tiled-CBC (`kernels/tiled_cbc_spmspv.cu`). The device arrays are the
//! format's own arrays (layout: `sieve_formats::tiled_cbc`).

use crate::error::{CudaError, DriverContext, Result};
use crate::gpu::{Gpu, KernelFamily};
use crate::product::{check_io, threshold_arg, GpuMatVec};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use sieve_formats::tiled_cbc::{TiledCbc, TILE_K};
use sieve_formats::{Threshold, WeightFormat};

pub const FAMILY: KernelFamily = KernelFamily {
    name: "tiled_cbc_spmspv",
    source: include_str!("../kernels/tiled_cbc_spmspv.cu"),
};

pub struct GpuTiledCbc {
    tile_offset: CudaSlice<u32>,
    col_info: CudaSlice<u32>,
    bitmaps: CudaSlice<u64>,
    values: CudaSlice<u16>,
    rows: usize,
    cols: usize,
    row_tiles: usize,
    col_tiles: usize,
    /// Bytes of each column over all row tiles (values + bitmaps + ColInfo).
    col_bytes: Vec<usize>,
    /// GTiles one block walks along K (the split-K granularity); 0 picks one from the shape.
    pub gtiles_per_block: usize,
}

impl GpuTiledCbc {
    pub fn upload(gpu: &Gpu, f: &TiledCbc) -> Result<Self> {
        let (rows, cols) = (f.rows(), f.cols());
        if rows > i32::MAX as usize || cols > i32::MAX as usize {
            return Err(CudaError::Option("matrix exceeds 32-bit dimensions".into()));
        }
        let (rt, kt) = (f.row_tiles(), f.col_tiles());
        let mut col_bytes = vec![0usize; cols];
        let info = f.col_info();
        for g in 0..rt * kt {
            for c in 0..TILE_K {
                let k = (g % kt) * TILE_K + c;
                if k < cols {
                    let nnz = (info[g * TILE_K + c] & 0xffff) as usize;
                    col_bytes[k] += nnz.div_ceil(8) * 16 + 32 + 4;
                }
            }
        }
        Ok(Self {
            tile_offset: gpu.upload(f.tile_offset())?,
            col_info: gpu.upload(f.col_info())?,
            bitmaps: gpu.upload(f.bitmaps())?,
            values: gpu.upload(f.value_bits())?,
            rows,
            cols,
            row_tiles: rt,
            col_tiles: kt,
            col_bytes,
            gtiles_per_block: 0,
        })
    }

    /// Split-K so that the grid has about four blocks per multiprocessor.
    fn effective_gtiles_per_block(&self, gpu: &Gpu) -> usize {
        if self.gtiles_per_block > 0 {
            return self.gtiles_per_block;
        }
        let target_blocks = gpu.info().multiprocessors as usize * 4;
        let splits = target_blocks.div_ceil(self.row_tiles).max(1);
        self.col_tiles.div_ceil(splits).max(2)
    }
}

impl GpuMatVec for GpuTiledCbc {
    fn label(&self) -> String {
        if self.gtiles_per_block == 0 {
            "tiled-cbc".into()
        } else {
            format!("tiled-cbc/g{}", self.gtiles_per_block)
        }
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn bytes_for(&self, active: &[bool]) -> usize {
        let w: usize = self
            .col_bytes
            .iter()
            .zip(active)
            .filter(|(_, a)| **a)
            .map(|(b, _)| *b)
            .sum();
        // ColInfo of every column and TileOffsets are read whatever the activations.
        w + self.row_tiles * self.col_tiles * (TILE_K * 4 + 4) + self.cols * 4 + self.rows * 4
    }
    fn launch(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        threshold: Threshold,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        check_io(self, x, y)?;
        gpu.zero_f32(y)?;
        let gpb = self.effective_gtiles_per_block(gpu);
        let f = gpu.function(&FAMILY, "tcbc_spmspv")?;
        let cfg = LaunchConfig {
            grid_dim: (
                self.col_tiles.div_ceil(gpb) as u32,
                self.row_tiles as u32,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (m, k, kt) = (self.rows as i32, self.cols as i32, self.col_tiles as i32);
        let (t, g) = (threshold_arg(threshold), gpb as i32);
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.tile_offset)
            .arg(&self.col_info)
            .arg(&self.bitmaps)
            .arg(&self.values)
            .arg(x)
            .arg(y)
            .arg(&m)
            .arg(&k)
            .arg(&kt)
            .arg(&t)
            .arg(&g);
        unsafe { b.launch(cfg) }.during("launching tcbc_spmspv")?;
        Ok(())
    }
}
