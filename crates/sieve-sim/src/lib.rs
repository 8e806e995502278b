//! sieve-sim: a trace-driven model of Celty's sparse SIMT core (seed paper 000, section 4).
//!
//! Celty proposes two hardware changes to a GPU SM sub-partition for batch-1 spMspV: a
//! pipelined 8-wide RLC decoder that replaces the intra-warp prefix-sum reconstruction of
//! run-length row indices, and output accumulation in the register file with a shared-memory
//! fallback. No GPU has them; this crate runs the Celty kernel's warp programs, built from the
//! real RLC-CSC streams of `sieve-formats` and real activation masks, on a cycle model of one SM,
//! calibrated on the measured H200 times of sieve's own RLC-CSC kernel, and answers what the
//! hardware would buy.
//!
//! | module | job |
//! |---|---|
//! | [`gpu`] | the H200's fixed numbers (SMs, clock, measured copy bandwidth) |
//! | [`cost`] | latencies and throughputs (the calibrated constants) |
//! | [`trace`] | RLC-CSC tiles and masks: the slabs, rows and bank passes a warp sees |
//! | [`kernel`] | warp programs of the kernel (sieve's mapping or Celty's tile, hardware on/off) |
//! | [`sm`] | the cycle model of one SM (4 schedulers, MIO pipe, DRAM queue, decoders) |
//! | [`sim`] | one launch on the whole GPU (the busiest SM's blocks) |
//! | [`measured`] | the H200 measurements and the calibration error |
//! | [`paper`] | Celty's published numbers and the predictions beside them |
//! | [`area`] | Table 1: the decoder's area overhead per GPU generation |
//! | [`svg`] | the plot against the paper's figures |
//! | [`sweep`] | the `sieve sim celty` sweep: points, calibration, comparison, area |

pub mod area;
pub mod cost;
pub mod error;
pub mod gpu;
pub mod kernel;
pub mod measured;
pub mod paper;
pub mod shapes;
pub mod sim;
pub mod sm;
pub mod svg;
pub mod sweep;
pub mod trace;

pub use cost::CostModel;
pub use error::{Result, SimError};
pub use gpu::GpuSpec;
pub use kernel::{Features, KernelConfig, Mapping, Stage};
pub use sim::{simulate, Point, SimResult};
pub use sweep::{run_sweep, Sweep, SweepOptions, SweepPoint};
