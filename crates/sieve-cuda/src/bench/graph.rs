//! Graph-mode timing (`--graph`): a run of launches captured once into a CUDA graph
//! ([`crate::graph::StepGraph`], plain edges) and replayed, each replay between two events.
//! Time per launch is a replay's time divided by the launches it holds: what a kernel costs
//! inside a decode step that runs as a graph, without the ~3.5 µs floor an event pair around a
//! single launch adds.
//!
//! Launchers that zero their output themselves draw a new epoch from host state per launch
//! (`product::LaunchEpoch`); in a graph those epochs are fixed at capture. A kernel's blocks
//! wait for their row tile's flag to hold the launch's epoch, so two consecutive launches of
//! one device copy must carry different epochs, across the boundary between two replays too.
//! [`graph_launches`] therefore captures every rotated copy at least twice (and as often as
//! every other copy); the outputs are poisoned with NaN before the timed replays and checked
//! against the f64 reference after them.

use crate::error::{DriverContext, Result};
use crate::gpu::Gpu;
use crate::graph::StepGraph;
use crate::timing::{summarize, time_each, Timing};
use cudarc::driver::CudaSlice;

/// Launches one graph holds when its launches rotate over `copies` device copies: at least
/// `requested`, a multiple of `copies`, and at least two per copy (see the module header).
pub fn graph_launches(requested: usize, copies: usize) -> usize {
    let copies = copies.max(1);
    requested.max(2 * copies).div_ceil(copies) * copies
}

/// Captures `launch(0..launches)` into a graph on the GPU's stream. Kernels must be compiled
/// and loaded already (module loads cannot be captured): the callers time them in event mode
/// first.
pub fn capture<F>(gpu: &Gpu, launches: usize, mut launch: F) -> Result<StepGraph>
where
    F: FnMut(usize) -> Result<()>,
{
    gpu.synchronize()?;
    let stream = gpu.stream();
    StepGraph::begin_capture(stream)?;
    let enqueued = (0..launches).try_for_each(&mut launch);
    // End the capture even when enqueueing failed, so that the stream leaves capture mode.
    let graph = StepGraph::end_capture(stream, false);
    enqueued?;
    graph
}

/// Replays `graph` (holding `launches` launches) `replays` times, an event pair around each
/// replay, and returns the time per launch (replay time / `launches`). A spin kernel ahead of
/// the replays keeps the GPU busy while the host enqueues them, so no replay waits for the
/// host.
pub fn time_replays(
    gpu: &Gpu,
    graph: &StepGraph,
    launches: usize,
    replays: usize,
) -> Result<Timing> {
    let mut us = time_each(gpu, replays, 2_000_000 + 50_000 * replays as u64, |_| {
        graph.launch()
    })?;
    for t in &mut us {
        *t /= launches as f64;
    }
    Ok(summarize(&mut us))
}

/// Fills `buf` with NaN, so that an element no replayed launch writes shows in the check.
pub fn poison(gpu: &Gpu, buf: &mut CudaSlice<f32>) -> Result<()> {
    let nan = vec![f32::NAN; buf.len()];
    gpu.stream()
        .memcpy_htod(&nan, buf)
        .during("poisoning an output")
}

/// A user-owned cuBLAS workspace bound to the GPU's cuBLAS handle for as long as this lives,
/// so that no cuBLAS call allocates workspace while a stream is being captured. Dropping it
/// rebinds the handle to its stream, which returns cuBLAS to its default workspace pool
/// (`cublasSetStream` resets the workspace) before the buffer is freed.
pub struct CublasWorkspace<'g> {
    gpu: &'g Gpu,
    _buf: CudaSlice<u8>,
}

impl<'g> CublasWorkspace<'g> {
    /// 32 MiB: cuBLAS's recommended workspace on Hopper.
    pub const BYTES: usize = 32 << 20;

    pub fn bind(gpu: &'g Gpu, bytes: usize) -> Result<Self> {
        let blas = gpu.cublas()?;
        let buf = unsafe { gpu.stream().alloc::<u8>(bytes.max(1)) }
            .during("allocating the cuBLAS workspace")?;
        let p = crate::product::dev_ptr(gpu, &buf);
        unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                *blas.handle(),
                p as *mut std::ffi::c_void,
                bytes,
            )
        }
        .result()?;
        Ok(Self { gpu, _buf: buf })
    }
}

impl Drop for CublasWorkspace<'_> {
    fn drop(&mut self) {
        if let Ok(blas) = self.gpu.cublas() {
            // Nothing useful can be done with a failure while dropping; the buffer is freed
            // after this either way.
            let _ = self.gpu.synchronize();
            let _ = unsafe {
                cudarc::cublas::result::set_stream(
                    *blas.handle(),
                    self.gpu.stream().cu_stream() as _,
                )
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_copy_is_captured_at_least_twice_and_equally_often() {
        for copies in [1usize, 2, 3, 7, 19, 64] {
            for requested in [1usize, 10, 50, 64, 100, 1000] {
                let r = graph_launches(requested, copies);
                assert!(r >= requested, "{requested} {copies}");
                assert!(r >= 2 * copies);
                assert_eq!(r % copies, 0);
                // No more than one extra round of copies beyond what was asked.
                assert!(r < requested.max(2 * copies) + copies);
            }
        }
        assert_eq!(graph_launches(64, 0), 64);
    }

    #[test]
    fn gpu_graph_replays_match_eager_launches() {
        use crate::dense::GpuDenseColMajor;
        use crate::GpuMatVec;
        use sieve_formats::random::{activations, sparse_matrix, threshold_for_sparsity, Pattern};
        use sieve_formats::reference::{matvec_f64, max_rel_error};
        let Some(gpu) = crate::gpu_or_skip("gpu_graph_replays_match_eager_launches") else {
            return;
        };
        // Fused zeroing (flags and epochs) under replay: three copies, each captured twice.
        let w = sparse_matrix(600, 700, 0.5, Pattern::Unstructured, 3).unwrap();
        let copies: Vec<GpuDenseColMajor> = (0..3)
            .map(|_| GpuDenseColMajor::upload(&gpu, &w).unwrap())
            .collect();
        let x = activations(700, 4);
        let t = threshold_for_sparsity(&x, 0.5).unwrap();
        let xd = gpu.upload(&x).unwrap();
        let mut y = gpu.poisoned_f32(600).unwrap();
        let r = graph_launches(1, copies.len());
        assert_eq!(r, 6);
        for c in &copies {
            c.launch(&gpu, &xd, t, &mut y).unwrap();
        }
        let g = capture(&gpu, r, |i| copies[i % 3].launch(&gpu, &xd, t, &mut y)).unwrap();
        let want = matvec_f64(&w, &x, t);
        for _ in 0..3 {
            poison(&gpu, &mut y).unwrap();
            let tm = time_replays(&gpu, &g, r, 2).unwrap();
            assert!(tm.median_us > 0.0);
            let got = gpu.download(&y).unwrap();
            assert!(max_rel_error(&got, &want) < 1e-3);
        }
    }
}
