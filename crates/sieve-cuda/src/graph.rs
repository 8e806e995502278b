//! CUDA graphs of captured launches, optionally with programmatic dependent launch (PDL).
//!
//! A decode step (or a benchmark's run of launches) is captured from the stream into a graph
//! and replayed. In a plain graph every kernel node waits for its predecessor to finish and its
//! writes to be flushed before the next grid is even launched: a gap of launch latency between
//! every pair of kernels. With PDL the capture's kernel-to-kernel edges are rewritten as
//! *programmatic* edges (`CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC` out of the predecessor's
//! programmatic port): the next grid is launched as soon as every block of the previous one has
//! executed `griddepcontrol.launch_dependents`, and its blocks sit in `griddepcontrol.wait`
//! until the previous grid has completed and its memory is visible.
//!
//! ```text
//!     plain:  [kernel A ........]  launch gap  [kernel B ........]
//!     PDL:    [kernel A ........]
//!                       [B launched, resident, waiting][B runs ....]
//! ```
//!
//! The contract on the kernels (common.cuh `pdl_wait_then_release`): every kernel that may run
//! in such a graph calls `griddepcontrol.wait` before it touches memory another kernel wrote
//! (or will read), so it overlaps only its launch with the predecessor. Without a programmatic
//! edge both instructions are no-ops, so the same kernels run unchanged outside graphs.

use crate::error::{CudaError, DriverContext, Result};
use cudarc::driver::sys;
use cudarc::driver::{CudaGraph, CudaStream};
use std::sync::Arc;

/// A captured graph ready to replay, with or without programmatic edges.
pub struct StepGraph {
    /// Owns the graph template (and the exec instantiated at capture, used without PDL).
    graph: CudaGraph,
    /// The exec instantiated after the edges were rewritten (PDL only).
    pdl_exec: Option<sys::CUgraphExec>,
    stream: Arc<CudaStream>,
    programmatic_edges: usize,
}

// SAFETY: CUDA graph and graph-exec handles are not tied to the thread that created them: the
// driver accepts them from any thread on which their context is current, and `launch` (like
// the destructor) binds the stream's context first. A `StepGraph` is moved, never shared: it
// is not `Sync`, so two threads cannot launch or destroy it at once. This lets a model with
// captured steps be handed to the serving scheduler's thread.
unsafe impl Send for StepGraph {}

impl StepGraph {
    /// Starts capturing `stream`: launches enqueued from here on go into the graph that
    /// [`StepGraph::end_capture`] returns (call it even when enqueueing failed, to leave
    /// capture mode).
    pub fn begin_capture(stream: &Arc<CudaStream>) -> Result<()> {
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .during("beginning a graph capture")
    }

    /// Ends the capture begun by [`StepGraph::begin_capture`] and instantiates the graph.
    /// With `pdl`, every edge between two kernel nodes becomes a programmatic edge first (see
    /// the module header).
    pub fn end_capture(stream: &Arc<CudaStream>, pdl: bool) -> Result<Self> {
        let graph = stream
            .end_capture(
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            )
            .during("ending a graph capture")?
            .ok_or_else(|| CudaError::Option("the capture produced no graph".into()))?;
        let mut out = StepGraph {
            graph,
            pdl_exec: None,
            stream: stream.clone(),
            programmatic_edges: 0,
        };
        if pdl {
            out.programmatic_edges =
                unsafe { make_kernel_edges_programmatic(out.graph.cu_graph()) }?;
            let mut exec: sys::CUgraphExec = std::ptr::null_mut();
            unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, out.graph.cu_graph(), 0) }
                .result()
                .during("instantiating a graph with programmatic edges")?;
            out.pdl_exec = Some(exec);
        }
        out.upload()?;
        Ok(out)
    }

    fn exec(&self) -> sys::CUgraphExec {
        self.pdl_exec.unwrap_or_else(|| self.graph.cu_graph_exec())
    }

    fn upload(&self) -> Result<()> {
        self.stream
            .context()
            .bind_to_thread()
            .during("binding the context")?;
        unsafe { sys::cuGraphUpload(self.exec(), self.stream.cu_stream()) }
            .result()
            .during("uploading a graph")
    }

    /// Enqueues one replay on the capture stream.
    pub fn launch(&self) -> Result<()> {
        self.stream
            .context()
            .bind_to_thread()
            .during("binding the context")?;
        unsafe { sys::cuGraphLaunch(self.exec(), self.stream.cu_stream()) }
            .result()
            .during("replaying a graph")
    }

    /// Kernel-to-kernel edges made programmatic (0 without PDL).
    pub fn programmatic_edges(&self) -> usize {
        self.programmatic_edges
    }
}

impl Drop for StepGraph {
    fn drop(&mut self) {
        // Bound also for the template's destructor (cudarc's `CudaGraph` drop, which runs
        // after this one, does not bind): the graph may be dropped on another thread than
        // the one that captured it. Nothing useful can be done with a failure while dropping.
        let _ = self.stream.context().bind_to_thread();
        if let Some(exec) = self.pdl_exec.take() {
            unsafe {
                let _ = sys::cuGraphExecDestroy(exec);
            }
        }
    }
}

/// Rewrites every default edge between two kernel nodes of `graph` as a programmatic edge.
/// Returns how many were rewritten.
///
/// # Safety
/// `graph` must be a valid graph not being instantiated or launched concurrently.
unsafe fn make_kernel_edges_programmatic(graph: sys::CUgraph) -> Result<usize> {
    let mut n = 0usize;
    sys::cuGraphGetEdges_v2(
        graph,
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        &mut n,
    )
    .result()
    .during("counting graph edges")?;
    if n == 0 {
        return Ok(0);
    }
    let mut from = vec![std::ptr::null_mut(); n];
    let mut to = vec![std::ptr::null_mut(); n];
    let mut data = vec![
        sys::CUgraphEdgeData {
            from_port: 0,
            to_port: 0,
            type_: 0,
            reserved: [0; 5],
        };
        n
    ];
    sys::cuGraphGetEdges_v2(
        graph,
        from.as_mut_ptr(),
        to.as_mut_ptr(),
        data.as_mut_ptr(),
        &mut n,
    )
    .result()
    .during("reading graph edges")?;
    let is_kernel = |node: sys::CUgraphNode| -> Result<bool> {
        let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        sys::cuGraphNodeGetType(node, &mut t)
            .result()
            .during("reading a graph node's type")?;
        Ok(t == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL)
    };
    let default_type = sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_DEFAULT as u8;
    let mut rewritten = 0;
    for i in 0..n {
        if data[i].type_ != default_type || !is_kernel(from[i])? || !is_kernel(to[i])? {
            continue;
        }
        sys::cuGraphRemoveDependencies_v2(graph, &from[i], &to[i], &data[i], 1)
            .result()
            .during("removing a graph edge")?;
        let programmatic = sys::CUgraphEdgeData {
            from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
            to_port: 0,
            type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
            reserved: [0; 5],
        };
        sys::cuGraphAddDependencies_v2(graph, &from[i], &to[i], &programmatic, 1)
            .result()
            .during("adding a programmatic graph edge")?;
        rewritten += 1;
    }
    Ok(rewritten)
}
