//! Latencies and throughputs of the modelled SM. The values marked *calibrated* were fitted once
//! (`sieve sim celty --calibrate`, see docs/SIMULATOR.md) against the measured H200 RLC-CSC
//! kernel times with the decoder off and no register accumulation; the others are fixed from the
//! hardware description and are not tuned.

use serde::Serialize;

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CostModel {
    /// Global load latency from DRAM (cycles). *Calibrated.*
    pub dram_latency: u32,
    /// Global load latency of an L2 hit (the activation vector is shared by every row block).
    pub l2_latency: u32,
    /// Latency of a warp shuffle (cycles). *Calibrated.*
    pub shfl_latency: u32,
    /// Latency of a shared-memory load (cycles).
    pub lds_latency: u32,
    /// One conflict-free shared-memory float `atomicAdd` of a warp, issue to retire (cycles):
    /// the kernel waits for it (a load / add / compare-and-swap loop). *Calibrated.*
    pub atom_latency: u32,
    /// Extra cycles per extra shared-memory wavefront of a conflicted atomic. *Calibrated.*
    pub atom_conflict_cycles: u32,
    /// Dependent-latency of the per-column bookkeeping (ballot, broadcast, the two modulo
    /// computations of the slab dealing), cycles. *Calibrated.*
    pub column_chain: u32,
    /// Per-launch fixed time outside the SM (launch, output zeroing), µs. Starts from the
    /// measured empty-launch time. *Calibrated.*
    pub fixed_us: f64,
    /// Registers per thread of the kernel, which sets how many blocks fit on an SM (no ptxas
    /// report exists on the CPU machine). *Calibrated.*
    pub regs_per_thread: u32,
    /// Whether a warp waits for each slab's loads before issuing the next slab's (the kernel's
    /// `pend = cur` register copy is a use of the loaded registers). *Calibrated (0/1).*
    pub serialize_slab_loads: bool,
    /// Cycles from a block finishing to the next block's warps issuing.
    pub block_launch_cycles: u32,
    /// Fraction of the copy bandwidth a streaming read reaches.
    pub dram_efficiency: f64,
    /// SM cycles of L2 atomic-unit time per global `atomicAdd` warp instruction (32 rows).
    pub red_cycles: u32,
    /// Celty RLC decoder: pipeline depth (3 stages) and indices ingested per cycle (8).
    pub decoder_stages: u32,
    pub decoder_width: u32,
    /// Register-file accumulate (decoder address -> RF read -> FMA -> RF write), cycles.
    pub rf_acc_latency: u32,
}

impl CostModel {
    /// The H200 model: the calibrated values (see docs/SIMULATOR.md for the fit).
    pub fn h200() -> Self {
        Self {
            dram_latency: 1482,
            l2_latency: 331,
            shfl_latency: 101,
            lds_latency: 30,
            atom_latency: 208,
            atom_conflict_cycles: 95,
            column_chain: 416,
            fixed_us: 12.66,
            regs_per_thread: 64,
            serialize_slab_loads: true,
            block_launch_cycles: 300,
            dram_efficiency: 1.0,
            red_cycles: 4,
            decoder_stages: 3,
            decoder_width: 8,
            rf_acc_latency: 6,
        }
    }
}
