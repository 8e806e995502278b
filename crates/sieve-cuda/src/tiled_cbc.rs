//! spMspV over Tiled-CBC (`kernels/tiled_cbc_spmspv.cu`): SPDP's kernel and sieve's lane-per-8-rows
//! kernel. The device arrays are the format's own arrays (layout: `sieve_formats::tiled_cbc`),
//! plus, for the lane-per-8-rows kernel, a rank table built here (8 bytes per column tile) and
//! one flag per row tile for the fused zeroing of the output.

use crate::error::{CudaError, DriverContext, Result};
use crate::gpu::{i32_arg, Gpu, KernelFamily};
use crate::product::{
    active_column_bytes, check_io, threshold_arg, DevPtr, GpuAccumulate, GpuMatVec, LaunchEpoch,
};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use sieve_formats::tiled_cbc::{TiledCbc, TILE_K};
use sieve_formats::{Threshold, WeightFormat};

pub const FAMILY: KernelFamily = KernelFamily {
    name: "tiled_cbc_spmspv",
    source: include_str!("../kernels/tiled_cbc_spmspv.cu"),
};

/// The tensor-core SpMM over the same arrays (`kernels/tiled_cbc_spmm.cu`): several tokens at
/// once, the weights decoded into mma fragments, never into an f16 copy.
pub const SPMM_FAMILY: KernelFamily = KernelFamily {
    name: "tiled_cbc_spmm",
    source: include_str!("../kernels/tiled_cbc_spmm.cu"),
};

/// Token tiles of 8 per SpMM block, one kernel each (`tcbc_spmm_nt{1,2,4,8}`): 8 to 64 tokens.
const SPMM_TOKEN_TILES: [usize; 4] = [1, 2, 4, 8];
/// A split walks at least this many GTiles, so the three-stage pipeline fills.
const SPMM_MIN_GTILES_PER_SPLIT: usize = 8;

/// Which kernel runs the product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcbcKernel {
    /// SPDP Algorithm 1: thread per row, one 16-column GTile per pipeline stage.
    Spdp,
    /// Sieve's mapping: compacted active columns, batches of 32 through a 3-stage cp.async
    /// pipeline, a lane per 8 rows, fused output zeroing.
    Lane8,
    /// Lane8's pipeline with the round-robin decode (lane j owns rows 32 w + j): one
    /// conflict-free shared load per bitmap word instead of one per row slot.
    RoundRobin,
}

impl TcbcKernel {
    /// The kernels that share lane8's launch (compaction, batches, fused zeroing).
    fn is_lane8_family(self) -> bool {
        matches!(self, TcbcKernel::Lane8 | TcbcKernel::RoundRobin)
    }
}

/// The lane8 kernel's pipeline shape: columns per batch and stage buffers. Each shape is its
/// own kernel instantiation (see the end of the `.cu` file).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lane8Shape {
    pub batch: usize,
    pub stages: usize,
}

impl Lane8Shape {
    pub const DEFAULT: Lane8Shape = Lane8Shape::new(32, 2);
    /// Every compiled shape (`tcbc_spmspv_lane8_b{batch}s{stages}`), default first.
    pub const ALL: [Lane8Shape; 4] = [
        Lane8Shape::DEFAULT,
        Lane8Shape::new(16, 3),
        Lane8Shape::new(16, 4),
        Lane8Shape::new(32, 3),
    ];

    pub const fn new(batch: usize, stages: usize) -> Self {
        Lane8Shape { batch, stages }
    }

    fn kernel(self, kernel: TcbcKernel) -> Result<String> {
        if !Lane8Shape::ALL.contains(&self) {
            return Err(CudaError::Option(format!(
                "no lane8 kernel for batch {} x {} stages (compiled: {:?})",
                self.batch,
                self.stages,
                Lane8Shape::ALL
            )));
        }
        let family = if kernel == TcbcKernel::RoundRobin {
            "rr"
        } else {
            "lane8"
        };
        Ok(format!(
            "tcbc_spmspv_{family}_b{}s{}",
            self.batch, self.stages
        ))
    }

    /// Shared memory of the stages: vals[batch][256] f16, bits[batch][8] u32, rank[batch][8] u8.
    fn stage_bytes(self) -> usize {
        self.batch * (256 * 2 + 32 + 8) * self.stages
    }

    /// Resident blocks per multiprocessor: 228 KB of shared memory (1 KB reserved per block),
    /// and registers for at most six 256-thread blocks.
    fn blocks_per_sm(self, cols_per_block: usize) -> usize {
        let per_block = self.stage_bytes() + 16 * cols_per_block + 1024 + 64;
        (228 * 1024 / per_block).clamp(1, 6)
    }
}

const LANE8_MAX_COLS_PER_BLOCK: usize = 512;

pub struct GpuTiledCbc {
    tile_offset: CudaSlice<u32>,
    col_info: CudaSlice<u32>,
    bitmaps: CudaSlice<u64>,
    values: CudaSlice<u16>,
    /// rank[8 (16 g + c) + q] = set bits of column tile (g, c) in rows < 32 q.
    rank: CudaSlice<u8>,
    /// One per row tile: the epoch of the launch whose zeroing of that tile is done.
    flags: CudaSlice<u32>,
    epoch: LaunchEpoch,
    rows: usize,
    cols: usize,
    row_tiles: usize,
    col_tiles: usize,
    /// Bytes of each column over all row tiles (values + bitmaps + ColInfo).
    col_bytes: Vec<usize>,
    /// GTiles one block walks along K (the split-K granularity); 0 picks one from the shape.
    pub gtiles_per_block: usize,
    pub kernel: TcbcKernel,
    /// Lane8: waves of resident blocks the grid should fill (split-K heuristic), used when
    /// `gtiles_per_block` is 0.
    pub lane8_waves: usize,
    pub lane8_shape: Lane8Shape,
    /// Resident blocks per multiprocessor of each SpMM kernel (`SPMM_TOKEN_TILES` order).
    spmm_resident: [usize; SPMM_TOKEN_TILES.len()],
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
        // Look the SpMM kernels up now, with their occupancy: loading a module or asking the
        // occupancy inside a graph capture invalidates it.
        let mut spmm_resident = [1usize; SPMM_TOKEN_TILES.len()];
        for (r, nt) in spmm_resident.iter_mut().zip(SPMM_TOKEN_TILES) {
            let name = format!("tcbc_spmm_nt{nt}");
            gpu.function(&SPMM_FAMILY, &name)?;
            *r = (gpu.resident_blocks(&SPMM_FAMILY, &name, 256)? as usize).max(1);
        }
        crate::prefill::zero_rows_ready(gpu)?;
        Ok(Self {
            tile_offset: gpu.upload(f.tile_offset())?,
            col_info: gpu.upload(f.col_info())?,
            bitmaps: gpu.upload(f.bitmaps())?,
            values: gpu.upload(f.value_bits())?,
            rank: gpu.upload(&rank_table(f.bitmaps()))?,
            flags: gpu.upload(&vec![0u32; rt.max(1)])?,
            epoch: LaunchEpoch::default(),
            rows,
            cols,
            row_tiles: rt,
            col_tiles: kt,
            col_bytes,
            gtiles_per_block: 0,
            kernel: TcbcKernel::Lane8,
            lane8_waves: 1,
            lane8_shape: Lane8Shape::DEFAULT,
            spmm_resident,
        })
    }

    /// Lane8 split-K: columns per block (a multiple of 16, at most 512), from
    /// `gtiles_per_block` or else so that the grid fills at most `lane8_waves` waves of
    /// resident blocks (a block's fixed latency is paid once per wave).
    fn lane8_cols_per_block(&self, gpu: &Gpu) -> usize {
        let gtiles = if self.gtiles_per_block > 0 {
            self.gtiles_per_block
        } else {
            let per_sm = self.lane8_shape.blocks_per_sm(LANE8_MAX_COLS_PER_BLOCK);
            let target = gpu.info().multiprocessors as usize * per_sm * self.lane8_waves.max(1);
            let splits = (target / self.row_tiles.max(1)).max(1);
            self.col_tiles.div_ceil(splits)
        };
        (gtiles * TILE_K).clamp(TILE_K, LANE8_MAX_COLS_PER_BLOCK)
    }

    /// The lane8 launch; `zero_y` selects the fused zeroing (flags and a fresh epoch) or none
    /// (the product is added to y, see [`GpuAccumulate`]).
    fn lane8_raw(
        &self,
        gpu: &Gpu,
        x: DevPtr,
        threshold: Threshold,
        y: DevPtr,
        zero_y: bool,
    ) -> Result<()> {
        let cpb = self.lane8_cols_per_block(gpu);
        let shared = self.lane8_shape.stage_bytes() + 16 * cpb;
        let f = gpu.function(&FAMILY, &self.lane8_shape.kernel(self.kernel)?)?;
        gpu.allow_dynamic_shared(&f, shared)?;
        let cfg = LaunchConfig {
            grid_dim: (self.cols.div_ceil(cpb) as u32, self.row_tiles as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        let (flags, epoch) = if zero_y {
            (crate::product::dev_ptr(gpu, &self.flags), self.epoch.next())
        } else {
            (0u64, 0u32)
        };
        let (m, k, kt) = (self.rows as i32, self.cols as i32, self.col_tiles as i32);
        let (t, c) = (threshold_arg(threshold), cpb as i32);
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.tile_offset)
            .arg(&self.col_info)
            .arg(&self.bitmaps)
            .arg(&self.rank)
            .arg(&self.values)
            .arg(&x)
            .arg(&y)
            .arg(&flags)
            .arg(&epoch)
            .arg(&m)
            .arg(&k)
            .arg(&kt)
            .arg(&t)
            .arg(&c);
        unsafe { b.launch(cfg) }.during("launching tcbc_spmspv_lane8")?;
        Ok(())
    }

    fn launch_lane8(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        threshold: Threshold,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (xp, yp) = (
            crate::product::dev_ptr(gpu, x),
            crate::product::dev_ptr(gpu, y),
        );
        self.lane8_raw(gpu, xp, threshold, yp, true)
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
        let kernel = match self.kernel {
            TcbcKernel::Spdp => "tiled-cbc/spdp".to_string(),
            TcbcKernel::Lane8 | TcbcKernel::RoundRobin => {
                let mut l = if self.kernel == TcbcKernel::RoundRobin {
                    "tiled-cbc/rr".to_string()
                } else {
                    "tiled-cbc/lane8".to_string()
                };
                if self.lane8_shape != Lane8Shape::DEFAULT {
                    l += &format!("/b{}s{}", self.lane8_shape.batch, self.lane8_shape.stages);
                }
                if self.lane8_waves != 1 && self.gtiles_per_block == 0 {
                    l += &format!("/waves{}", self.lane8_waves);
                }
                l
            }
        };
        if self.gtiles_per_block == 0 {
            kernel
        } else {
            format!("{kernel}/g{}", self.gtiles_per_block)
        }
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn bytes_for(&self, active: &[bool]) -> usize {
        let w = active_column_bytes(&self.col_bytes, active);
        match self.kernel {
            // ColInfo of every column and TileOffsets are read whatever the activations.
            TcbcKernel::Spdp => {
                w + self.row_tiles * self.col_tiles * (TILE_K * 4 + 4)
                    + self.cols * 4
                    + self.rows * 4
            }
            // ColInfo and TileOffset of every column (read together with x), plus the rank
            // tables of active columns.
            TcbcKernel::Lane8 | TcbcKernel::RoundRobin => {
                let active_cols = active.iter().filter(|a| **a).count();
                w - active_cols * self.row_tiles * 4
                    + active_cols * self.row_tiles * 8
                    + self.row_tiles * self.col_tiles * (TILE_K * 4 + 4)
                    + self.cols * 4
                    + self.rows * 4
            }
        }
    }
    fn launch(
        &self,
        gpu: &Gpu,
        x: &CudaSlice<f32>,
        threshold: Threshold,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        check_io(self, x, y)?;
        if self.kernel.is_lane8_family() {
            return self.launch_lane8(gpu, x, threshold, y);
        }
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

impl GpuTiledCbc {
    /// The device arrays as the persistent step reads them (its task width left to it).
    pub fn persistent_arrays(&self, gpu: &Gpu) -> Result<crate::persistent::PersistentTcbc> {
        let p = |s: &CudaSlice<u32>| crate::product::dev_ptr(gpu, s);
        Ok(crate::persistent::PersistentTcbc {
            tile_offset: p(&self.tile_offset),
            col_info: p(&self.col_info),
            bitmaps: crate::product::dev_ptr(gpu, &self.bitmaps),
            rank: crate::product::dev_ptr(gpu, &self.rank),
            values: crate::product::dev_ptr(gpu, &self.values),
            rows: i32_arg("rows", self.rows)?,
            cols: i32_arg("columns", self.cols)?,
            col_tiles: i32_arg("column tiles", self.col_tiles)?,
            cols_per_task: 0,
        })
    }
}

impl GpuTiledCbc {
    /// Writes the whole matrix, transposed (K x M row-major f16), to `out` (K * M entries):
    /// the operand of a GEMM when several tokens share the weights (prefill).
    pub fn decode_transposed(&self, gpu: &Gpu, out: DevPtr) -> Result<()> {
        let f = gpu.function(&FAMILY, "tcbc_decode_t")?;
        let (m, k, kt) = (self.rows as i32, self.cols as i32, self.col_tiles as i32);
        let cfg = LaunchConfig {
            grid_dim: (self.col_tiles as u32, self.row_tiles as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.tile_offset)
            .arg(&self.col_info)
            .arg(&self.bitmaps)
            .arg(&self.values)
            .arg(&out)
            .arg(&m)
            .arg(&k)
            .arg(&kt);
        unsafe { b.launch(cfg) }.during("launching tcbc_decode_t")?;
        Ok(())
    }
}

impl GpuTiledCbc {
    /// True when [`Self::spmm_rows`] can read activations `lda` elements apart: its 16-byte
    /// copies need `lda` and K to be multiples of 8 (otherwise decode, then GEMM).
    pub fn spmm_supports(&self, lda: usize) -> bool {
        self.cols.is_multiple_of(8) && lda.is_multiple_of(8) && lda >= self.cols
    }

    /// `(splits, GTiles per split)` for `token_tiles` blocks along the tokens: one wave of the
    /// kernel's resident blocks (`resident` per multiprocessor), each split at least
    /// [`SPMM_MIN_GTILES_PER_SPLIT`] GTiles long.
    fn spmm_splits(&self, gpu: &Gpu, token_tiles: usize, resident: usize) -> (usize, usize) {
        let target = gpu.info().multiprocessors as usize * resident;
        let wanted = target
            .div_ceil((self.row_tiles * token_tiles).max(1))
            .max(1);
        let most = (self.col_tiles / SPMM_MIN_GTILES_PER_SPLIT).max(1);
        let per_split = self.col_tiles.div_ceil(wanted.min(most)).max(1);
        (self.col_tiles.div_ceil(per_split), per_split)
    }

    /// `Y[i][r] (+)= (W · A[i])[r]` for `n` tokens: `A` f16 rows `lda` elements apart (masked by
    /// the caller), `Y` f32 rows `ldy` floats apart, added to when `accumulate`, else written.
    #[allow(clippy::too_many_arguments)]
    pub fn spmm_rows(
        &self,
        gpu: &Gpu,
        a: DevPtr,
        lda: usize,
        n: usize,
        y: DevPtr,
        ldy: usize,
        accumulate: bool,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if !self.spmm_supports(lda) {
            return Err(CudaError::Option(format!(
                "the Tiled-CBC SpMM needs K ({}) and the activation stride ({lda}) to be multiples \
                 of 8, the stride at least K",
                self.cols
            )));
        }
        if !a.is_multiple_of(16) {
            return Err(CudaError::Option(
                "the Tiled-CBC SpMM reads its activations in 16-byte copies: A is not 16-byte aligned"
                    .into(),
            ));
        }
        if ldy < self.rows {
            return Err(CudaError::Option(format!(
                "the Tiled-CBC SpMM's output stride {ldy} is shorter than M = {}",
                self.rows
            )));
        }
        let variant = SPMM_TOKEN_TILES
            .iter()
            .position(|&nt| 8 * nt >= n)
            .unwrap_or(SPMM_TOKEN_TILES.len() - 1);
        let nt = SPMM_TOKEN_TILES[variant];
        let token_tiles = n.div_ceil(8 * nt);
        if token_tiles > i32::MAX as usize || self.row_tiles > 65535 {
            return Err(CudaError::Unsupported(format!(
                "{n} tokens of {} rows exceed one Tiled-CBC SpMM launch's grid",
                self.rows
            )));
        }
        let (splits, per_split) = self.spmm_splits(gpu, token_tiles, self.spmm_resident[variant]);
        let (ni, m, ldy_i) = (
            i32_arg("tokens", n)?,
            i32_arg("rows", self.rows)?,
            i32_arg("y row stride", ldy)?,
        );
        if splits > 1 && !accumulate {
            crate::prefill::zero_rows(gpu, y, ldy, n, self.rows)?;
        }
        let mode: i32 = match (splits > 1, accumulate) {
            (true, _) => 2,
            (false, true) => 1,
            (false, false) => 0,
        };
        let f = gpu.function(&SPMM_FAMILY, &format!("tcbc_spmm_nt{nt}"))?;
        let cfg = LaunchConfig {
            grid_dim: (token_tiles as u32, splits as u32, self.row_tiles as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (k, kt) = (self.cols as i32, self.col_tiles as i32);
        let lda_i = i32_arg("activation row stride", lda)?;
        let per_split = i32_arg("GTiles per split", per_split)?;
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.tile_offset)
            .arg(&self.col_info)
            .arg(&self.bitmaps)
            .arg(&self.rank)
            .arg(&self.values)
            .arg(&a)
            .arg(&lda_i)
            .arg(&y)
            .arg(&ldy_i)
            .arg(&m)
            .arg(&k)
            .arg(&kt)
            .arg(&ni)
            .arg(&per_split)
            .arg(&mode);
        unsafe { b.launch(cfg) }.during("launching tcbc_spmm")?;
        Ok(())
    }
}

/// Most tokens one union launch takes (`tcbc_spmspv_union_n{2,4}`). Each lane multiplies
/// every decoded row slot (zeros included) into a sum per token, so the kernel's arithmetic is
/// the dense product's and grows with the kernel's token count: measured (H100, 2026-12-06,
/// 7B shape, `sieve bench decode --batch`, dp 0.5) a step of 2 / 4 / 8 sequences took 4.95 /
/// 6.54 / 8.40 ms through the n2 / n4 / n8 kernels against 6.25 (two single steps) / 6.54 /
/// 6.72 ms (the tensor-core SpMM from 3), and at dp 0.7 3.61 / 5.26 / 7.49 against 3.98 /
/// 6.04 / 6.25: the union pays up to 4 tokens, the SpMM above.
pub const UNION_MAX_TOKENS: usize = 4;
/// Token counts of the compiled union kernels, smallest first.
const UNION_KERNELS: [usize; 2] = [2, 4];
const _: () = assert!(UNION_KERNELS[UNION_KERNELS.len() - 1] == UNION_MAX_TOKENS);
/// Resident union blocks a multiprocessor is assumed to hold (its launch bounds).
const UNION_BLOCKS_PER_SM: usize = 2;

impl GpuTiledCbc {
    /// `Y[i] += W · mask_t(X[i])` for `n` <= [`UNION_MAX_TOKENS`] tokens, reading every column
    /// that is active in at least one token once (the union of the batch's active columns):
    /// `X` f32 rows `ldx` apart, each masked by `threshold` on its own, `Y` f32 rows `ldy`
    /// apart, always added to (zero them first for a written product). The many-sequence
    /// decode step's product for a few sequences (`kernels/tiled_cbc_spmspv.cu`,
    /// `tcbc_spmspv_union_n*`).
    #[allow(clippy::too_many_arguments)]
    pub fn union_rows(
        &self,
        gpu: &Gpu,
        x: DevPtr,
        ldx: usize,
        n: usize,
        threshold: Threshold,
        y: DevPtr,
        ldy: usize,
    ) -> Result<()> {
        if n == 0 || self.rows == 0 || self.cols == 0 {
            return Ok(());
        }
        crate::product::check_union_args(
            "Tiled-CBC",
            n,
            UNION_MAX_TOKENS,
            threshold,
            ldx,
            ldy,
            self.cols,
            self.rows,
        )?;
        // The smallest compiled kernel that holds n tokens (n <= UNION_MAX_TOKENS, the largest).
        let nb = UNION_KERNELS
            .into_iter()
            .find(|&nb| nb >= n)
            .unwrap_or(UNION_MAX_TOKENS);
        let cpb = {
            let target = gpu.info().multiprocessors as usize * UNION_BLOCKS_PER_SM;
            let splits = (target / self.row_tiles.max(1)).max(1);
            (self.col_tiles.div_ceil(splits) * TILE_K).clamp(TILE_K, LANE8_MAX_COLS_PER_BLOCK)
        };
        // Stages (vals, bitmaps, rank tables of 32 columns, two buffers), the list (16 bytes a
        // column) and the listed columns' inputs (4 nb bytes a column).
        let shared = 2 * 32 * (256 * 2 + 32 + 8) + cpb * (16 + 4 * nb);
        let f = gpu.function(&FAMILY, &format!("tcbc_spmspv_union_n{nb}"))?;
        gpu.allow_dynamic_shared(&f, shared)?;
        let cfg = LaunchConfig {
            grid_dim: (self.cols.div_ceil(cpb) as u32, self.row_tiles as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        let (ldx_i, n_i, ldy_i) = (
            i32_arg("activation row stride", ldx)?,
            i32_arg("tokens", n)?,
            i32_arg("output row stride", ldy)?,
        );
        let (m, k, kt) = (self.rows as i32, self.cols as i32, self.col_tiles as i32);
        let (t, c) = (threshold_arg(threshold), cpb as i32);
        let mut b = gpu.stream().launch_builder(&f);
        b.arg(&self.tile_offset)
            .arg(&self.col_info)
            .arg(&self.bitmaps)
            .arg(&self.rank)
            .arg(&self.values)
            .arg(&x)
            .arg(&ldx_i)
            .arg(&n_i)
            .arg(&y)
            .arg(&ldy_i)
            .arg(&m)
            .arg(&k)
            .arg(&kt)
            .arg(&t)
            .arg(&c);
        unsafe { b.launch(cfg) }.during("launching tcbc_spmspv_union")?;
        Ok(())
    }
}

impl GpuAccumulate for GpuTiledCbc {
    fn launch_add(&self, gpu: &Gpu, x: DevPtr, threshold: Threshold, y: DevPtr) -> Result<()> {
        if !self.kernel.is_lane8_family() {
            return Err(CudaError::Option(
                "the accumulating Tiled-CBC launch exists for the lane8 and rr kernels only".into(),
            ));
        }
        self.lane8_raw(gpu, x, threshold, y, false)
    }
}

/// The lane8 kernel's rank table: for every column tile, the set bits of its bitmap in rows
/// below 32 q, q = 0..8 (so a lane finds its first value with one popcount).
pub fn rank_table(bitmaps: &[u64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bitmaps.len() * 2);
    for tile in bitmaps.chunks_exact(4) {
        let mut below = 0u32;
        for &word in tile {
            for half in [word as u32, (word >> 32) as u32] {
                // At most 224 bits lie below the last 32-row word, so the count fits a byte.
                out.push(below as u8);
                below += half.count_ones();
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{rank_table, Lane8Shape, TcbcKernel, FAMILY};

    /// Every shape the launcher can pick has its kernel in the source (a missing or misnamed
    /// instantiation would otherwise only show on a GPU), and the launcher's shared-memory size
    /// matches the kernel's stage layout.
    #[test]
    fn every_lane8_shape_has_a_kernel() {
        for (kernel, rr) in [(TcbcKernel::Lane8, false), (TcbcKernel::RoundRobin, true)] {
            for shape in Lane8Shape::ALL {
                let name = shape.kernel(kernel).expect("compiled shape");
                let wrapper = format!("{name}(LANE8_ARGS)");
                let inst = format!("lane8_kernel<{}, {}, {rr}>", shape.batch, shape.stages);
                let at = FAMILY
                    .source
                    .find(&wrapper)
                    .unwrap_or_else(|| panic!("{name} missing"));
                assert!(FAMILY.source[at..]
                    .trim_start_matches(&wrapper)
                    .contains(&inst));
            }
        }
        for shape in Lane8Shape::ALL {
            assert_eq!(
                shape.stage_bytes(),
                shape.stages * (shape.batch * 512 + shape.batch * 40)
            );
        }
        assert!(Lane8Shape::new(8, 1).kernel(TcbcKernel::Lane8).is_err());
    }

    #[test]
    fn rank_table_counts_bits_below_each_32_row_word() {
        let tile = [u64::MAX, 0x0000_0001_0000_0003, 0, 1u64 << 63];
        assert_eq!(rank_table(&tile), vec![0, 32, 64, 66, 67, 67, 67, 67]);
        let two = [0u64, 0, 0, 0, 1, 1, 1, 1];
        assert_eq!(
            rank_table(&two),
            vec![0; 8]
                .into_iter()
                .chain([0, 1, 1, 2, 2, 3, 3, 4])
                .collect::<Vec<u8>>()
        );
    }
}
