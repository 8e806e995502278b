//! Latencies and throughputs of the modelled SM. The values marked *calibrated* were fitted once by
//! coordinate descent (`cargo run --release -p sieve-sim --example calib -- 7b stages fit`) against
//! the measured H200 RLC-CSC kernel times (full kernel and Fig. 5 stage variants, decoder off, no
//! register accumulation) and checked on all 192 measured points (`sieve sim celty --calibrate`,
//! docs/SIMULATOR.md); the others are fixed from the hardware description and are not tuned.
//! The calibrated latencies are effective values (they carry dependency chains the model does not
//! spell out), not microbenchmark latencies.

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
            dram_latency: 907,
            l2_latency: 264,
            shfl_latency: 98,
            lds_latency: 30,
            atom_latency: 200,
            atom_conflict_cycles: 141,
            column_chain: 255,
            fixed_us: 10.75,
            regs_per_thread: 64,
            block_launch_cycles: 300,
            dram_efficiency: 1.0,
            red_cycles: 4,
            decoder_stages: 3,
            decoder_width: 8,
            rf_acc_latency: 6,
        }
    }
}
