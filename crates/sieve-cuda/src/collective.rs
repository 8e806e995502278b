//! Collectives between GPUs for tensor-parallel decode (issue 31): NCCL through cudarc's
//! bindings, loaded at run time like the rest of CUDA.
//!
//! ```text
//!   one process, one Gpu (context + stream) per device, one communicator per Gpu
//!
//!   rank r:  kernels ... o_proj (partial sums into x) | all-reduce(x) | RMSNorm ...
//!            ^ all on Gpu r's stream, so the collective is ordered with the rank's kernels
//!              and is captured in the rank's CUDA graph like one more node
//! ```
//!
//! [`open_ranks`] makes the communicators of `world` devices at once (`ncclCommInitAll`): the
//! ranks of one machine in one process, which is what sieve runs. When one thread drives several
//! ranks, their calls of one collective go between [`group_start`] and [`group_end`] (NCCL would
//! otherwise wait inside the first rank's call for the others); with one thread per rank each
//! calls on its own.
//!
//! In a graph captured with programmatic dependent launch ([`crate::graph`]), an edge into a
//! collective must stay a full edge: NCCL's kernels do not wait on `griddepcontrol`, so a
//! programmatic edge would let them read the partial sums before the product has written them.
//!
//! NVLink multicast (NVLS) stays off: [`open_ranks`] sets `NCCL_NVLS_ENABLE=0` (and
//! `NCCL_RUNTIME_CONNECT=0`: connections made at init, not inside a graph capture) unless the
//! environment already chose (the device machines' KINDS.md asks for it; the decode step's
//! all-reduces are a few KB, where multicast gains nothing).
//!
//! cudarc finds the library by its unversioned names (`libnccl.so`, ...). A wheel of NCCL (the
//! `nvidia-nccl` one PyTorch installs) ships only `libnccl.so.2`: a symbolic link named
//! `libnccl.so` in a directory of `LD_LIBRARY_PATH` makes it loadable.

use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::product::DevPtr;
use cudarc::nccl::{result as nccl, sys};

/// Whether NCCL can be loaded on this machine (without the panic cudarc's loader gives).
pub fn nccl_available() -> bool {
    // SAFETY: only tries to open the library by name.
    unsafe { sys::is_culib_present() }
}

/// The loaded NCCL's version code (e.g. 22703 for 2.27.3).
pub fn nccl_version() -> Result<i32> {
    require_nccl()?;
    nccl::get_nccl_version().map_err(|e| failed("ncclGetVersion", e))
}

fn require_nccl() -> Result<()> {
    if nccl_available() {
        Ok(())
    } else {
        Err(CudaError::NoNccl(
            "none of cudarc's candidate names opened".into(),
        ))
    }
}

fn failed(call: &'static str, e: nccl::NcclError) -> CudaError {
    CudaError::Nccl {
        call,
        status: format!("{:?}", e.0),
    }
}

/// One rank's communicator, aborted on drop by the thread that owns it (a destroy would wait
/// for peers that may be gone; on the normal path the rank has synchronized, so nothing is in
/// flight then).
pub struct Communicator {
    comm: sys::ncclComm_t,
    rank: usize,
    world: usize,
}

// SAFETY: a communicator may be used from any thread as long as one thread at a time calls it
// (NCCL's rule); each rank is driven by one thread.
unsafe impl Send for Communicator {}

/// One rank: its GPU and its communicator.
pub struct Rank {
    pub gpu: Gpu,
    pub comm: Communicator,
}

/// Opens GPUs `0..world` and one communicator for each ([module notes](self)).
pub fn open_ranks(world: usize) -> Result<Vec<Rank>> {
    if world == 0 {
        return Err(CudaError::Option(
            "a tensor-parallel world of 0 ranks".into(),
        ));
    }
    let count = crate::gpu::device_count()?;
    if world > count {
        return Err(CudaError::Option(format!(
            "tensor parallelism over {world} GPUs, but this machine has {count}"
        )));
    }
    if world == 1 {
        // Nothing to communicate: no library needed, and every collective is a copy.
        let comm = Communicator {
            comm: std::ptr::null_mut(),
            rank: 0,
            world: 1,
        };
        return Ok(vec![Rank {
            gpu: Gpu::new(0)?,
            comm,
        }]);
    }
    open_nccl_ranks(world)
}

/// [`open_ranks`] with NCCL communicators at every world size, 1 included (the tests check
/// the library on a machine of one GPU this way).
pub fn open_nccl_ranks(world: usize) -> Result<Vec<Rank>> {
    let count = crate::gpu::device_count()?;
    if world == 0 || world > count {
        return Err(CudaError::Option(format!(
            "NCCL communicators for {world} GPUs on a machine of {count}"
        )));
    }
    require_nccl()?;
    let gpus = (0..world).map(Gpu::new).collect::<Result<Vec<Gpu>>>()?;
    // Set before the first communicator (NCCL reads them then). NCCL_RUNTIME_CONNECT=0 makes
    // the connections at init instead of at the first collective, which may be inside a CUDA
    // graph capture (the first step a rank captures).
    for (name, value) in [("NCCL_NVLS_ENABLE", "0"), ("NCCL_RUNTIME_CONNECT", "0")] {
        if std::env::var_os(name).is_none() {
            std::env::set_var(name, value);
        }
    }
    let ordinals: Vec<i32> = (0..world as i32).collect();
    let mut comms = vec![std::ptr::null_mut(); world];
    // SAFETY: `comms` holds `world` handles to fill, `ordinals` `world` device numbers.
    unsafe { nccl::comm_init_all(comms.as_mut_ptr(), world as i32, ordinals.as_ptr()) }
        .map_err(|e| failed("ncclCommInitAll", e))?;
    Ok(gpus
        .into_iter()
        .zip(comms)
        .enumerate()
        .map(|(rank, (gpu, comm))| Rank {
            gpu,
            comm: Communicator { comm, rank, world },
        })
        .collect())
}

/// Starts a group of collectives (one thread driving several ranks).
pub fn group_start() -> Result<()> {
    nccl::group_start()
        .map(|_| ())
        .map_err(|e| failed("ncclGroupStart", e))
}

/// Ends the group: the collectives are enqueued on their ranks' streams.
pub fn group_end() -> Result<()> {
    nccl::group_end()
        .map(|_| ())
        .map_err(|e| failed("ncclGroupEnd", e))
}

impl Communicator {
    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world(&self) -> usize {
        self.world
    }

    /// `recv[..len] = Σ over ranks of send[..len]` (f32; `recv == send` sums in place) on
    /// `gpu`'s stream, `gpu` being this rank's.
    ///
    /// # Safety
    /// `send` and `recv` hold `len` f32 on this rank's GPU, and every rank makes the same call
    /// (same `len`) in the same order.
    pub unsafe fn all_reduce_sum_f32(
        &self,
        gpu: &Gpu,
        send: DevPtr,
        recv: DevPtr,
        len: usize,
    ) -> Result<()> {
        if self.comm.is_null() {
            return copy_f32(gpu, send, recv, len);
        }
        nccl::all_reduce(
            send as *const _,
            recv as *mut _,
            len,
            sys::ncclDataType_t::ncclFloat32,
            sys::ncclRedOp_t::ncclSum,
            self.comm,
            gpu.stream().cu_stream() as _,
        )
        .map(|_| ())
        .map_err(|e| failed("ncclAllReduce", e))
    }

    /// `recv[r * len .. (r + 1) * len] = send of rank r` (f32) on this rank's stream.
    ///
    /// # Safety
    /// `send` holds `len` f32 and `recv` `world * len` on this rank's GPU, and every rank makes
    /// the same call in the same order.
    pub unsafe fn all_gather_f32(
        &self,
        gpu: &Gpu,
        send: DevPtr,
        recv: DevPtr,
        len: usize,
    ) -> Result<()> {
        if self.comm.is_null() {
            return copy_f32(gpu, send, recv, len);
        }
        nccl::all_gather(
            send as *const _,
            recv as *mut _,
            len,
            sys::ncclDataType_t::ncclFloat32,
            self.comm,
            gpu.stream().cu_stream() as _,
        )
        .map(|_| ())
        .map_err(|e| failed("ncclAllGather", e))
    }
}

/// A collective of one rank without a communicator: `recv = send`.
///
/// # Safety
/// As the collectives': both hold `len` f32 on `gpu`.
unsafe fn copy_f32(gpu: &Gpu, send: DevPtr, recv: DevPtr, len: usize) -> Result<()> {
    use crate::error::DriverContext;
    if send == recv || len == 0 {
        return Ok(());
    }
    gpu.context()
        .bind_to_thread()
        .during("binding the context")?;
    cudarc::driver::result::memcpy_dtod_async(recv, send, len * 4, gpu.stream().cu_stream())
        .during("copying a one-rank collective")
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: made by `open_nccl_ranks`, ended once, on the thread that used it (NCCL
            // forbids ending a communicator another thread may be calling).
            let _ = unsafe { nccl::comm_abort(self.comm) };
        }
    }
}
