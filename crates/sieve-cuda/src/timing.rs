//! CUDA-event timing: warm-up, then one event pair around every repetition, median reported.

use crate::error::{DriverContext, Result};
use crate::gpu::Gpu;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaEvent;
use serde::Serialize;

/// Two CUDA events around work enqueued on a [`Gpu`]'s stream: the one place that creates,
/// records and reads events (the kernel benchmarks, graph replays and the decode runner's
/// step timing and profile all use it).
pub struct EventPair {
    start: CudaEvent,
    end: CudaEvent,
}

impl EventPair {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        let ctx = gpu.context();
        let event = || {
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .during("creating an event")
        };
        Ok(Self {
            start: event()?,
            end: event()?,
        })
    }
    /// Records the start on the GPU's stream.
    pub fn start(&self, gpu: &Gpu) -> Result<()> {
        self.start.record(gpu.stream()).during("recording an event")
    }
    /// Records the end on the GPU's stream.
    pub fn end(&self, gpu: &Gpu) -> Result<()> {
        self.end.record(gpu.stream()).during("recording an event")
    }
    /// Microseconds between the two records (both must have completed: synchronize first).
    pub fn elapsed_us(&self) -> Result<f64> {
        Ok(self
            .start
            .elapsed_ms(&self.end)
            .during("reading an event")? as f64
            * 1000.0)
    }
}

/// Runs `each(i)` for `i` in `0..count`, an event pair around each, behind a spin kernel of
/// `spin_ns` that keeps the GPU busy while the host enqueues the batch (so that no repetition
/// waits for the host and each pair brackets GPU work only); the microseconds of each.
pub fn time_each<F>(gpu: &Gpu, count: usize, spin_ns: u64, mut each: F) -> Result<Vec<f64>>
where
    F: FnMut(usize) -> Result<()>,
{
    let events = (0..count)
        .map(|_| EventPair::new(gpu))
        .collect::<Result<Vec<_>>>()?;
    gpu.synchronize()?;
    spin(gpu, spin_ns)?;
    for (i, pair) in events.iter().enumerate() {
        pair.start(gpu)?;
        each(i)?;
        pair.end(gpu)?;
    }
    gpu.synchronize()?;
    events.iter().map(EventPair::elapsed_us).collect()
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct Timing {
    pub median_us: f64,
    pub min_us: f64,
    pub p90_us: f64,
    pub reps: usize,
}

/// Times `launch(i)` (which enqueues work for repetition `i`) with CUDA events. Everything the
/// closure enqueues (output zeroing included) is inside the timed region.
pub fn time_launches<F>(gpu: &Gpu, warmup: usize, reps: usize, mut launch: F) -> Result<Timing>
where
    F: FnMut(usize) -> Result<()>,
{
    for i in 0..warmup {
        launch(i)?;
    }
    let mut us = time_each(gpu, reps, 2_000_000 + 30_000 * reps as u64, |i| {
        launch(warmup + i)
    })?;
    Ok(summarize(&mut us))
}

/// Enqueues a kernel that keeps the GPU busy for `ns` nanoseconds.
pub fn spin(gpu: &Gpu, ns: u64) -> Result<()> {
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    let f = gpu.function(&crate::dense::FAMILY, "spin_ns")?;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(&ns);
    unsafe {
        b.launch(LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        })
    }
    .during("launching spin_ns")?;
    Ok(())
}

pub fn summarize(us: &mut [f64]) -> Timing {
    us.sort_by(f64::total_cmp);
    let n = us.len();
    if n == 0 {
        return Timing {
            median_us: f64::NAN,
            min_us: f64::NAN,
            p90_us: f64::NAN,
            reps: 0,
        };
    }
    let median = if n % 2 == 1 {
        us[n / 2]
    } else {
        0.5 * (us[n / 2 - 1] + us[n / 2])
    };
    Timing {
        median_us: median,
        min_us: us[0],
        p90_us: us[((n as f64 * 0.9) as usize).min(n - 1)],
        reps: n,
    }
}

/// Device-to-device copy bandwidth (bytes read + bytes written per second) over `bytes`-sized
/// buffers, in GB/s: the ceiling the kernels' bandwidth is reported against.
pub fn copy_bandwidth_gbs(gpu: &Gpu, bytes: usize, reps: usize) -> Result<f64> {
    let bytes = bytes / 16 * 16;
    let src = gpu.upload(&vec![0x3cu8; bytes])?;
    let mut dst = unsafe { gpu.stream().alloc::<u8>(bytes) }.during("allocating")?;
    let t = time_launches(gpu, 3, reps, |_| crate::dense::copy(gpu, &src, &mut dst))?;
    Ok(2.0 * bytes as f64 / (t.median_us * 1e-6) / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_even_and_odd() {
        let t = summarize(&mut [3.0, 1.0, 2.0]);
        assert_eq!(t.median_us, 2.0);
        assert_eq!(t.min_us, 1.0);
        let t = summarize(&mut [4.0, 1.0, 2.0, 3.0]);
        assert_eq!(t.median_us, 2.5);
        assert!(summarize(&mut []).median_us.is_nan());
    }
}
