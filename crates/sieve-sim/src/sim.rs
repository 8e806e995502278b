//! One simulated kernel launch on the whole GPU.
//!
//! The grid is `ceil(K / cols_per_block) x ceil(M / block_rows)` blocks, dealt round-robin to the
//! SMs (block `i` to SM `i mod 132`); every block's work is statistically the same (one random
//! matrix, one random mask), so the kernel time is the time of the SM with the most blocks. Only
//! that SM is simulated: its blocks `0, 132, 264, ...` are generated, encoded and run, a
//! `1/132` sample of the grid (all of it for grids of at most 132 blocks). The DRAM bandwidth is
//! shared by `min(132, blocks)` active SMs.

use crate::cost::CostModel;
use crate::error::{Result, SimError};
use crate::gpu::GpuSpec;
use crate::kernel::{build_block, AccumStats, Features, KernelConfig, Mapping};
use crate::sm::{run_sm, InstrCounts, SmResult};
use crate::trace::{activation_mask, encode_tile};
use rayon::prelude::*;
use serde::Serialize;

/// One layer product to simulate.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Point {
    pub m: usize,
    pub k: usize,
    /// Weight sparsity (fraction of zero weights).
    pub sp: f64,
    /// Activation sparsity (fraction of inactive inputs).
    pub dp: f64,
}

impl Point {
    pub fn validate(&self) -> Result<()> {
        if self.m == 0 || self.k == 0 {
            return Err(SimError::Option(format!(
                "shape {}x{} has a zero dimension",
                self.m, self.k
            )));
        }
        // 2^32 weights is ~16x the largest LLaMA-2-70B layer: ~500 blocks on the simulated SM,
        // seconds of work. Beyond that a run would take minutes to hours.
        if (self.m as u128) * (self.k as u128) > 1 << 32 {
            return Err(SimError::Option(format!(
                "shape {}x{} has more than 2^32 weights, beyond what the simulator runs in                  reasonable time",
                self.m, self.k
            )));
        }
        for (name, v) in [("sp", self.sp), ("dp", self.dp)] {
            if !(0.0..1.0).contains(&v) {
                return Err(SimError::Option(format!("{name} {v} outside [0, 1)")));
            }
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct SimResult {
    pub point: Point,
    pub config: KernelConfig,
    pub features: Features,
    /// Predicted kernel time, µs (fixed launch cost + the busiest SM's cycles).
    pub us: f64,
    pub sm_cycles: u64,
    pub grid_blocks: usize,
    /// Blocks simulated (those of the busiest SM).
    pub simulated_blocks: usize,
    pub max_resident_blocks: usize,
    pub warps_simulated: usize,
    /// Instructions of the simulated SM, and per warp.
    pub instr: InstrCounts,
    pub instr_per_warp: f64,
    pub accum: AccumStats,
    /// Fraction of shared-memory atomic passes that bank conflicts added.
    pub conflict_share: f64,
    /// Bytes the whole grid reads from DRAM (sample scaled by blocks), and the roofline time
    /// of those bytes at the measured copy bandwidth plus the fixed launch cost.
    pub dram_bytes: f64,
    pub roofline_us: f64,
    /// Busy fractions of the simulated SM: issue (any sub-partition), MIO pipe.
    pub issue_busy: f64,
    pub mio_busy: f64,
}

/// Grid of a configuration for an `m x k` product: (blocks along K, blocks along M).
pub fn grid(cfg: &KernelConfig, m: usize, k: usize) -> (usize, usize) {
    (k.div_ceil(cfg.cols_per_block), m.div_ceil(cfg.block_rows))
}

/// Most thread blocks a simulated grid may have: the grid of a 65536 x 65536 product under the
/// measured configuration (64 columns x 1024 rows per block), of which the busiest SM's 1/132
/// (at most 497 blocks) is built and run. The weight count alone does not bound the work: a
/// 1 x 10^9 shape has 10^9 weights but 15.6 million one-row blocks (it grew to 7.6 GB).
pub const MAX_GRID_BLOCKS: usize = 1 << 16;

/// Checks the grid of an `m x k` product before anything is allocated for it.
pub fn check_grid(cfg: &KernelConfig, m: usize, k: usize) -> Result<()> {
    cfg.validate()?;
    if m == 0 || k == 0 {
        return Err(SimError::Option(format!(
            "shape {m}x{k} has a zero dimension"
        )));
    }
    let (gx, gy) = grid(cfg, m, k);
    let blocks = gx.saturating_mul(gy);
    if blocks > MAX_GRID_BLOCKS {
        return Err(SimError::Option(format!(
            "shape {m}x{k} needs a grid of {gx} x {gy} = {blocks} thread blocks ({} columns x \
             {} rows each); the simulator runs at most {MAX_GRID_BLOCKS} (e.g. 65536x65536, \
             4096x1048576)",
            cfg.cols_per_block, cfg.block_rows
        )));
    }
    Ok(())
}

fn mix(seed: u64, a: u64) -> u64 {
    let mut z = seed ^ a.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 31)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z ^ (z >> 29)
}

pub fn simulate(
    point: Point,
    cfg: &KernelConfig,
    feat: &Features,
    cost: &CostModel,
    gpu: &GpuSpec,
    seed: u64,
) -> Result<SimResult> {
    point.validate()?;
    cfg.validate()?;
    feat.validate()?;
    check_grid(cfg, point.m, point.k)?;
    let (gx, gy) = grid(cfg, point.m, point.k);
    let nblocks = gx * gy;
    let sm_blocks: Vec<usize> = (0..nblocks).step_by(gpu.sms).collect();
    let mask = activation_mask(point.k, point.dp, mix(seed, 7))?;
    let built: Vec<(crate::sm::Block, AccumStats)> = sm_blocks
        .par_iter()
        .map(|&id| {
            let (bx, by) = (id % gx, id / gx);
            let row0 = by * cfg.block_rows;
            let col0 = bx * cfg.cols_per_block;
            let h = cfg.block_rows.min(point.m - row0);
            let c = cfg.cols_per_block.min(point.k - col0);
            let tile = encode_tile(
                h,
                c,
                point.sp,
                cfg.segment_rows(),
                cfg.index_bits,
                mix(seed, id as u64 + 1),
            )?;
            build_block(&tile, &mask[col0..col0 + c], cfg, feat, cost, gpu.banks)
        })
        .collect::<Result<_>>()?;
    let mut accum = AccumStats::default();
    let mut blocks = Vec::with_capacity(built.len());
    let mut warps_simulated = 0;
    for (b, s) in built {
        accum.add(&s);
        warps_simulated += b.warps.len();
        blocks.push(b);
    }
    let active_sms = nblocks.min(gpu.sms);
    let sm: SmResult = run_sm(blocks, gpu, cost, active_sms);
    let us = cost.fixed_us + gpu.cycles_to_us(sm.cycles as f64);
    let scale = nblocks as f64 / sm_blocks.len() as f64;
    let dram_bytes = sm.dram_bytes as f64 * scale + 4.0 * (point.m + point.k) as f64;
    let roofline_us = cost.fixed_us + dram_bytes / (gpu.copy_gbs * 1e3);
    let cyc = sm.cycles.max(1) as f64;
    let _ = Mapping::Kernel;
    Ok(SimResult {
        point,
        config: *cfg,
        features: *feat,
        us,
        sm_cycles: sm.cycles,
        grid_blocks: nblocks,
        simulated_blocks: sm_blocks.len(),
        max_resident_blocks: sm.max_resident_blocks,
        warps_simulated,
        instr: sm.instr,
        instr_per_warp: sm.instr.total() as f64 / warps_simulated.max(1) as f64,
        accum,
        conflict_share: if accum.atomic_passes > 0 {
            1.0 - accum.atomic_instr as f64 / accum.atomic_passes as f64
        } else {
            0.0
        },
        dram_bytes,
        roofline_us,
        issue_busy: sm.issue_cycles as f64 / cyc,
        mio_busy: sm.mio_busy as f64 / cyc,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_points_are_rejected_before_work() {
        let p = |m, k, sp, dp| Point { m, k, sp, dp };
        assert!(p(0, 5, 0.5, 0.5).validate().is_err());
        assert!(p(5, 5, 1.0, 0.5).validate().is_err());
        assert!(p(5, 5, 0.5, -0.1).validate().is_err());
        assert!(p(5, 5, f64::NAN, 0.5).validate().is_err());
        assert!(p(1 << 20, 1 << 20, 0.5, 0.5).validate().is_err());
        assert!(p(28672, 8192, 0.5, 0.5).validate().is_ok());
    }

    #[test]
    fn grids_too_large_to_simulate_are_refused_before_any_allocation() {
        let cfg = KernelConfig::measured();
        let point = |m, k| Point {
            m,
            k,
            sp: 0.5,
            dp: 0.5,
        };
        // Issue 30: 1x1000000000 has fewer than 2^32 weights but grew to 7.6 GB.
        for (m, k) in [(1, 1_000_000_000), (1_000_000_000, 1), (1, 1 << 23)] {
            let started = std::time::Instant::now();
            let err = simulate(
                point(m, k),
                &cfg,
                &Features::baseline(),
                &CostModel::h200(),
                &GpuSpec::h200(),
                1,
            )
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
            assert!(err.contains("thread blocks"), "{m}x{k}: {err}");
            assert!(started.elapsed().as_secs_f64() < 1.0);
        }
        for (m, k) in [(65536, 65536), (4096, 1 << 20), (1, 1 << 22), (28672, 8192)] {
            assert!(check_grid(&cfg, m, k).is_ok(), "{m}x{k}");
        }
        assert!(check_grid(&cfg, 0, 5).is_err());
    }

    #[test]
    fn small_point_runs_and_samples_the_busiest_sm() {
        let gpu = GpuSpec::h200();
        let r = simulate(
            Point {
                m: 2048,
                k: 64 * 200,
                sp: 0.5,
                dp: 0.5,
            },
            &KernelConfig::measured(),
            &Features::baseline(),
            &CostModel::h200(),
            &gpu,
            1,
        )
        .unwrap();
        // 200 x 2 = 400 blocks: SM 0 gets blocks 0, 132, 264, 396.
        assert_eq!(r.grid_blocks, 400);
        assert_eq!(r.simulated_blocks, 4);
        assert_eq!(r.warps_simulated, 16);
        assert!(r.us > r.roofline_us);
    }
}
