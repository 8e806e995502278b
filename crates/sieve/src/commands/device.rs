//! `--device auto|cuda|cpu`: where a model runs.

use anyhow::{Context, Result};
use sieve_cuda::Gpu;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    /// The GPU when one is usable, else the CPU.
    Auto,
    Cuda,
    Cpu,
}

/// The GPU to run on, or `None` for the CPU. `--device cuda` without a usable GPU is an error;
/// `auto` says on stderr why it fell back.
pub fn open(device: Device) -> Result<Option<Gpu>> {
    match device {
        Device::Cpu => Ok(None),
        Device::Cuda => Gpu::new(0)
            .map(Some)
            .context("--device cuda: no usable GPU (--device cpu runs on the CPU)"),
        Device::Auto => match Gpu::new(0) {
            Ok(g) => Ok(Some(g)),
            Err(e) => {
                eprintln!("device: cpu ({e})");
                Ok(None)
            }
        },
    }
}

/// Prints the upload report of a GPU model on stderr.
pub fn print_report(model: &sieve_gpu::GpuModel) {
    let r = model.report();
    eprintln!(
        "device: {} ({:.2} GB of weights, {:.2} GB KV cache, {} launches per step in one CUDA graph)",
        model.gpu().info().name,
        r.weight_bytes as f64 / 1e9,
        r.kv_cache_bytes as f64 / 1e9,
        r.launches_per_step
    );
    for note in &r.notes {
        eprintln!("note: {note}");
    }
}
