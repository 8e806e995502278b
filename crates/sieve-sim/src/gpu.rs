//! The machine being modelled: NVIDIA H200 (GH100, sm_90) as measured in docs/BENCHMARKS.md.

use serde::Serialize;

/// Fixed properties of the GPU. Numbers are the H200's (Hopper whitepaper and the device query in
/// `docs/bench/gpu-run3-*.json`); the copy bandwidth and the empty-launch time are *measured*
/// (runs 3 and 6 of docs/BENCHMARKS.md).
#[derive(Clone, Debug, Serialize)]
pub struct GpuSpec {
    pub name: &'static str,
    /// Streaming multiprocessors (device query: 132).
    pub sms: usize,
    /// SM sub-partitions ("SIMT cores" in Celty): one warp scheduler, one register file each.
    pub sub_partitions: usize,
    /// SM clock during the runs (run 1: 1980 MHz).
    pub clock_mhz: f64,
    pub max_warps_per_sm: usize,
    pub max_blocks_per_sm: usize,
    pub shared_bytes_per_sm: usize,
    pub registers_per_sm: usize,
    /// Shared-memory banks (4 bytes wide); one bank group serves the whole SM.
    pub banks: usize,
    /// Device-to-device copy bandwidth measured in the benchmark runs, GB/s (read + write).
    pub copy_gbs: f64,
    /// Median time of an empty kernel under the benchmark's event bracketing, µs (run 6).
    pub empty_launch_us: f64,
}

impl GpuSpec {
    pub fn h200() -> Self {
        Self {
            name: "NVIDIA H200 (model)",
            sms: 132,
            sub_partitions: 4,
            clock_mhz: 1980.0,
            max_warps_per_sm: 64,
            max_blocks_per_sm: 32,
            shared_bytes_per_sm: 228 * 1024,
            registers_per_sm: 65536,
            banks: 32,
            copy_gbs: 3880.5,
            empty_launch_us: 3.552,
        }
    }

    /// DRAM bytes per SM clock available to one SM when `active_sms` SMs stream at once.
    pub fn dram_bytes_per_cycle(&self, active_sms: usize, efficiency: f64) -> f64 {
        self.copy_gbs * 1e9 * efficiency / (self.clock_mhz * 1e6) / active_sms.max(1) as f64
    }

    pub fn cycles_to_us(&self, cycles: f64) -> f64 {
        cycles / self.clock_mhz
    }
}
