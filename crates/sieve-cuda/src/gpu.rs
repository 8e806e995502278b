//! The GPU handle: one CUDA context and stream, device properties, and the kernel modules,
//! compiled by NVRTC to a CUBIN for the exact GPU at first use and cached on disk.
//!
//! Cache: `$SIEVE_HOME/kernels` or else `~/.cache/sieve/kernels`, one file per
//! (kernel family, source, options, GPU name, compute capability, NVRTC version), named
//! `<family>-<fnv64 hash>.cubin`. A cache that cannot be written is not an error: the kernel is
//! compiled again next time.

use crate::error::{CudaError, DriverContext, Result};
use cudarc::driver::sys::CUdevice_attribute as Attr;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, LaunchConfig,
};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// Helpers shared by every kernel family (f16 conversion, cp.async, warp scans). Prepended to
/// each family's source before compilation.
const COMMON_SOURCE: &str = include_str!("../kernels/common.cuh");

/// One `.cu` file: a family of kernels compiled together.
#[derive(Clone, Copy, Debug)]
pub struct KernelFamily {
    pub name: &'static str,
    pub source: &'static str,
}

/// What the kernels and the benchmark need to know about the device.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DeviceInfo {
    pub name: String,
    pub compute_capability: (i32, i32),
    pub multiprocessors: u32,
    pub l2_bytes: usize,
    pub total_memory_bytes: usize,
    pub max_shared_per_block_optin: usize,
}

pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    info: DeviceInfo,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// Looked-up kernels, so that a launch costs no driver lookup on the host.
    functions: Mutex<HashMap<(&'static str, String), CudaFunction>>,
    cublas: Mutex<Option<Arc<cudarc::cublas::CudaBlas>>>,
    /// Blocks of a kernel resident at once on the whole GPU, per (family, kernel, block size).
    resident: Mutex<HashMap<(&'static str, String, u32), u32>>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu").field("info", &self.info).finish()
    }
}

impl Gpu {
    /// Opens GPU `ordinal`. Fails with [`CudaError::NoDriver`] / [`CudaError::NoDevice`] where
    /// there is no usable GPU, so callers can fall back or skip.
    pub fn new(ordinal: usize) -> Result<Self> {
        // With dynamic loading, cudarc panics on the first call into a missing library; probe
        // for it first so that a machine without CUDA gets a typed error.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::NoDriver);
        }
        let count = CudaContext::device_count().map_err(|e| CudaError::NoDevice(e.to_string()))?;
        if count <= 0 || ordinal >= count as usize {
            return Err(CudaError::NoDevice(format!(
                "{count} device(s), asked for ordinal {ordinal}"
            )));
        }
        let ctx = CudaContext::new(ordinal).during("creating the context")?;
        // One stream, used in order: cudarc's per-buffer event tracking would add two event
        // records to every launch and distort microsecond timings.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().during("creating the stream")?;
        let attr = |a: Attr| ctx.attribute(a).during("reading a device attribute");
        let info = DeviceInfo {
            name: ctx.name().during("reading the device name")?,
            compute_capability: ctx
                .compute_capability()
                .during("reading the compute capability")?,
            multiprocessors: attr(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
            l2_bytes: attr(Attr::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as usize,
            total_memory_bytes: ctx.total_mem().during("reading the memory size")?,
            max_shared_per_block_optin: attr(
                Attr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )? as usize,
        };
        Ok(Self {
            ctx,
            stream,
            info,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            cublas: Mutex::new(None),
            resident: Mutex::new(HashMap::new()),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().during("synchronizing the stream")
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        if host.is_empty() {
            // A zero-length allocation is refused by the driver; one element keeps the pointer
            // valid for kernels that never read it.
            return unsafe { self.stream.alloc::<T>(1) }.during("allocating a buffer");
        }
        self.stream.clone_htod(host).during("copying to the device")
    }

    /// A zeroed device buffer of `len` bytes (at least one).
    pub fn alloc_bytes(&self, len: usize) -> Result<CudaSlice<u8>> {
        self.stream
            .alloc_zeros::<u8>(len.max(1))
            .during("allocating a buffer")
    }

    pub fn download<T: DeviceRepr + Default + Clone>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>> {
        self.stream.clone_dtoh(dev).during("copying to the host")
    }

    /// A device buffer of `len` f32 set to NaN, so that an element a kernel forgets to write
    /// shows up in the comparison.
    pub fn poisoned_f32(&self, len: usize) -> Result<CudaSlice<f32>> {
        self.upload(&vec![f32::NAN; len.max(1)])
    }

    /// What `write` leaves in a fresh device buffer of `len` f16 that starts as NaN: for
    /// checking that a decoder writes every element of its output (downloaded after a
    /// synchronize).
    pub fn f16_written_by(
        &self,
        len: usize,
        write: impl FnOnce(crate::product::DevPtr) -> Result<()>,
    ) -> Result<Vec<half::f16>> {
        let out = self.upload(&vec![half::f16::from_bits(0x7e00); len.max(1)])?;
        write(crate::product::dev_ptr(self, &out))?;
        self.synchronize()?;
        let mut v = self.download(&out)?;
        v.truncate(len);
        Ok(v)
    }

    /// Zeroes `bytes` bytes at `ptr` on the stream (a memset node when captured).
    ///
    /// # Safety
    /// `ptr .. ptr + bytes` must lie inside one live allocation of this context.
    pub unsafe fn zero_bytes(&self, ptr: crate::product::DevPtr, bytes: usize) -> Result<()> {
        // A raw driver call: the context must be this thread's (a model may have been moved
        // to another thread since its last cudarc call).
        self.ctx.bind_to_thread().during("binding the context")?;
        unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, bytes, self.stream.cu_stream()) }
            .during("zeroing device memory")
    }

    pub fn zero_f32(&self, buf: &mut CudaSlice<f32>) -> Result<()> {
        self.stream.memset_zeros(buf).during("zeroing a buffer")
    }

    /// The compiled module of `family`, compiling (or loading from the disk cache) on first use.
    pub fn module(&self, family: &KernelFamily) -> Result<Arc<CudaModule>> {
        let mut modules = self
            .modules
            .lock()
            .map_err(|_| CudaError::Option("module cache lock poisoned".into()))?;
        if let Some(m) = modules.get(family.name) {
            return Ok(m.clone());
        }
        let cubin = self.cubin(family)?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .during("loading a CUBIN module")?;
        modules.insert(family.name, module.clone());
        Ok(module)
    }

    pub fn function(&self, family: &KernelFamily, name: &str) -> Result<CudaFunction> {
        let key = (family.name, name.to_string());
        if let Ok(f) = self.functions.lock() {
            if let Some(f) = f.get(&key) {
                return Ok(f.clone());
            }
        }
        let f = self
            .module(family)?
            .load_function(name)
            .during("looking up a kernel in its module")?;
        if let Ok(mut fs) = self.functions.lock() {
            fs.insert(key, f.clone());
        }
        Ok(f)
    }

    /// Blocks of `name` (launched with `block_threads` threads and no dynamic shared memory)
    /// resident at once on the whole GPU, asked of the driver once and cached. Ask it where a
    /// matrix is uploaded, not first in a launch: the query loads the kernel, which must not
    /// happen while a CUDA graph is being captured (it invalidates the capture).
    pub fn resident_blocks(
        &self,
        family: &KernelFamily,
        name: &str,
        block_threads: u32,
    ) -> Result<u32> {
        let key = (family.name, name.to_string(), block_threads);
        if let Ok(r) = self.resident.lock() {
            if let Some(&r) = r.get(&key) {
                return Ok(r);
            }
        }
        let per_sm = self
            .function(family, name)?
            .occupancy_max_active_blocks_per_multiprocessor(block_threads, 0, None)
            .during("asking a kernel's occupancy")?;
        let blocks = (per_sm * self.info.multiprocessors).max(1);
        if let Ok(mut r) = self.resident.lock() {
            r.insert(key, blocks);
        }
        Ok(blocks)
    }

    /// Lets `f` launch with `bytes` of dynamic shared memory (above 48 KB a kernel must opt in),
    /// or says how much the GPU allows.
    pub fn allow_dynamic_shared(&self, f: &CudaFunction, bytes: usize) -> Result<()> {
        if bytes > self.info.max_shared_per_block_optin {
            return Err(CudaError::Option(format!(
                "a launch needs {bytes} bytes of shared memory, the GPU allows {}",
                self.info.max_shared_per_block_optin
            )));
        }
        if bytes > 48 * 1024 {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .during("raising the shared-memory limit")?;
        }
        Ok(())
    }

    pub fn cublas(&self) -> Result<Arc<cudarc::cublas::CudaBlas>> {
        let mut slot = self
            .cublas
            .lock()
            .map_err(|_| CudaError::Option("cuBLAS handle lock poisoned".into()))?;
        if let Some(b) = slot.as_ref() {
            return Ok(b.clone());
        }
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(CudaError::NoCublas);
        }
        let b = Arc::new(cudarc::cublas::CudaBlas::new(self.stream.clone())?);
        *slot = Some(b.clone());
        Ok(b)
    }

    /// NVRTC target: `sm_90a` on Hopper (the arch-specific target, so that nothing falls back
    /// to PTX JIT), otherwise the device's own real architecture.
    pub fn arch_option(&self) -> String {
        let (maj, min) = self.info.compute_capability;
        if (maj, min) == (9, 0) {
            "--gpu-architecture=sm_90a".to_string()
        } else {
            format!("--gpu-architecture=sm_{maj}{min}")
        }
    }

    fn cubin(&self, family: &KernelFamily) -> Result<Vec<u8>> {
        cached_cubin(&self.info, &self.arch_option(), family)
    }

    /// Compiles (or reads from the disk cache) the CUBINs of those of `families` not loaded
    /// yet, on up to `threads` CPU threads at once, and loads them: NVRTC takes seconds per
    /// family, so a model's first run on a fresh machine otherwise spends a minute or more
    /// compiling its families one after another as each is first launched. A family that does
    /// not compile (one needing an architecture this GPU lacks) is left out and returned with
    /// its error: it fails again, by name, if it is ever launched.
    pub fn precompile(
        &self,
        families: &[KernelFamily],
        threads: usize,
    ) -> Result<Vec<(&'static str, CudaError)>> {
        let missing: Vec<&KernelFamily> = {
            let modules = self
                .modules
                .lock()
                .map_err(|_| CudaError::Option("module cache lock poisoned".into()))?;
            families
                .iter()
                .filter(|f| !modules.contains_key(f.name))
                .collect()
        };
        let arch = self.arch_option();
        let cubins = compile_parallel(&missing, threads, |f| cached_cubin(&self.info, &arch, f));
        let mut modules = self
            .modules
            .lock()
            .map_err(|_| CudaError::Option("module cache lock poisoned".into()))?;
        let mut failed = Vec::new();
        for (family, cubin) in missing.iter().zip(cubins) {
            let cubin = match cubin {
                Ok(c) => c,
                Err(e) => {
                    failed.push((family.name, e));
                    continue;
                }
            };
            if modules.contains_key(family.name) {
                continue;
            }
            let module = self
                .ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
                .during("loading a CUBIN module")?;
            modules.insert(family.name, module);
        }
        Ok(failed)
    }
}

/// `compile(f)` for every family, up to `threads` at once (at least one), results in the
/// families' order.
fn compile_parallel<F>(
    families: &[&KernelFamily],
    threads: usize,
    compile: F,
) -> Vec<Result<Vec<u8>>>
where
    F: Fn(&KernelFamily) -> Result<Vec<u8>> + Sync,
{
    use std::sync::atomic::{AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let results: Vec<Mutex<Option<Result<Vec<u8>>>>> =
        families.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|scope| {
        for _ in 0..threads.clamp(1, families.len().max(1)) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(family) = families.get(i) else {
                    break;
                };
                let r = compile(family);
                if let Ok(mut slot) = results[i].lock() {
                    *slot = Some(r);
                }
            });
        }
    });
    results
        .into_iter()
        .zip(families)
        .map(|(slot, f)| {
            slot.into_inner().ok().flatten().unwrap_or_else(|| {
                Err(CudaError::Option(format!(
                    "compiling {} did not finish",
                    f.name
                )))
            })
        })
        .collect()
}

/// The CUBIN of `family` for the device `info` describes (`arch` its NVRTC target option): from
/// the disk cache ([`cache_dir`]) when a build of the same source, options, device and NVRTC
/// version is there, else compiled and written there (best effort).
fn cached_cubin(info: &DeviceInfo, arch: &str, family: &KernelFamily) -> Result<Vec<u8>> {
    let source = format!("{COMMON_SOURCE}\n{}", family.source);
    let options = vec![
        arch.to_string(),
        "--std=c++17".to_string(),
        "--use_fast_math".to_string(),
        "-lineinfo".to_string(),
    ];
    let nvrtc_version = nvrtc_version()?;
    let mut key = Fnv64::new();
    key.write(source.as_bytes());
    for o in &options {
        key.write(o.as_bytes());
    }
    key.write(info.name.as_bytes());
    key.write(&info.compute_capability.0.to_le_bytes());
    key.write(&info.compute_capability.1.to_le_bytes());
    key.write(&nvrtc_version.0.to_le_bytes());
    key.write(&nvrtc_version.1.to_le_bytes());
    let file = format!("{}-{:016x}.cubin", family.name, key.finish());
    let dir = cache_dir();
    if let Some(dir) = &dir {
        if let Ok(bytes) = std::fs::read(dir.join(&file)) {
            if !bytes.is_empty() {
                return Ok(bytes);
            }
        }
    }
    let cubin = compile_cubin(family.name, &source, &options)?;
    if let Some(dir) = &dir {
        // Best effort: write to a temporary name and rename, so that a concurrent reader
        // never sees half a file.
        let _ = std::fs::create_dir_all(dir);
        let tmp = dir.join(format!("{file}.{}.tmp", std::process::id()));
        if std::fs::write(&tmp, &cubin).is_ok() {
            let _ = std::fs::rename(&tmp, dir.join(&file));
        }
    }
    Ok(cubin)
}

/// Compiles `family` for `arch` (e.g. `sm_90a`) without a GPU and returns the CUBIN size and
/// NVRTC's log; needs only libnvrtc. Lets machines without a GPU catch kernel compile errors.
pub fn compile_check(family: &KernelFamily, arch: &str) -> Result<(usize, String)> {
    nvrtc_version()?;
    let source = format!("{COMMON_SOURCE}\n{}", family.source);
    let options = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--use_fast_math".to_string(),
        "-Xptxas=-v".to_string(),
    ];
    let cubin = compile_cubin(family.name, &source, &options)?;
    let log = compile_log(&source, &options).unwrap_or_default();
    Ok((cubin.len(), log))
}

fn compile_log(source: &str, options: &[String]) -> Option<String> {
    use cudarc::nvrtc::result;
    let src = std::ffi::CString::new(source).ok()?;
    let prog = result::create_program(&src, None).ok()?;
    let _ = unsafe { result::compile_program(prog, options) };
    let log = unsafe { result::get_program_log(prog) }.ok().map(|l| {
        let bytes: Vec<u8> = l.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    });
    let _ = unsafe { result::destroy_program(prog) };
    log
}

/// The kernel families the decode runner loads up front: the products', then the model
/// step's (every family but the persistent step, which is built at its first use).
pub fn families() -> [KernelFamily; 16] {
    [
        crate::balanced_cbc::FAMILY,
        crate::balanced_lowbit::FAMILY,
        crate::dense::FAMILY,
        crate::ie_bme::FAMILY,
        crate::lowbit::FAMILY,
        crate::lowbit_cols::FAMILY,
        crate::rlc_csc::FAMILY,
        crate::tiled_cbc::FAMILY,
        crate::tiled_cbc::SPMM_FAMILY,
        crate::slide::FAMILY,
        crate::step::FAMILY,
        crate::rope::FAMILY,
        crate::attention::FAMILY,
        crate::prompt_attention::FAMILY,
        crate::sampling::FAMILY,
        crate::prefill::FAMILY,
    ]
}

/// Every kernel family of the crate: [`families`] and the two compiled apart from them (the
/// persistent step and W4A8), for whoever compiles them all ahead of use.
pub fn all_families() -> Vec<KernelFamily> {
    families()
        .into_iter()
        .chain([
            crate::persistent::FAMILY,
            crate::w4a8::FAMILY,
            crate::slide_lt::FAMILY,
        ])
        .collect()
}

/// A launch of `grid` blocks (x, y; each at least 1) of `block` threads with `shared` bytes of
/// dynamic shared memory (the model kernels' launches).
pub(crate) fn grid_cfg(grid: (u32, u32), block: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0.max(1), grid.1.max(1), 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// The grid of a grid-stride loop of 256-thread blocks over `total` elements.
pub(crate) fn grid_stride(total: usize) -> (u32, u32) {
    ((total.div_ceil(256) as u32).clamp(1, 65535), 1)
}

/// `v` as a kernel's `int` argument, or an error naming `what`.
pub(crate) fn i32_arg(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CudaError::Unsupported(format!("{what} {v} exceeds 32 bits")))
}

/// Where compiled kernels are cached, or `None` when no home is known.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(h) = std::env::var_os("SIEVE_HOME") {
        return Some(PathBuf::from(h).join("kernels"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/sieve/kernels"))
}

fn nvrtc_version() -> Result<(i32, i32)> {
    use cudarc::nvrtc::sys;
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    let (mut maj, mut min) = (0i32, 0i32);
    let r = unsafe { sys::nvrtcVersion(&mut maj, &mut min) };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::NoNvrtc);
    }
    Ok((maj, min))
}

/// Compiles `source` to a CUBIN. On failure the error carries NVRTC's log.
fn compile_cubin(family: &'static str, source: &str, options: &[String]) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys};
    let compile_err = |log: String| CudaError::Compile {
        family,
        options: options.to_vec(),
        log,
    };
    let src = std::ffi::CString::new(source)
        .map_err(|_| compile_err("kernel source contains a NUL byte".into()))?;
    let name = std::ffi::CString::new(format!("{family}.cu"))
        .map_err(|_| compile_err("kernel name contains a NUL byte".into()))?;
    let prog = result::create_program(&src, Some(&name))
        .map_err(|e| compile_err(format!("nvrtcCreateProgram: {e:?}")))?;
    let compiled = unsafe { result::compile_program(prog, options) };
    let log = unsafe { result::get_program_log(prog) }
        .map(|l| {
            let bytes: Vec<u8> = l.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .unwrap_or_default();
    let out = match compiled {
        Err(e) => Err(compile_err(format!("{e:?}\n{log}"))),
        Ok(()) => {
            let mut size = 0usize;
            let r = unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) };
            if r != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
                Err(compile_err(format!(
                    "nvrtcGetCUBINSize: {r:?} (size {size}); was a real sm_ target given?\n{log}"
                )))
            } else {
                let mut buf = vec![0u8; size];
                let r = unsafe { sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()) };
                if r != sys::nvrtcResult::NVRTC_SUCCESS {
                    Err(compile_err(format!("nvrtcGetCUBIN: {r:?}\n{log}")))
                } else {
                    Ok(buf)
                }
            }
        }
    };
    let _ = unsafe { result::destroy_program(prog) };
    out
}

/// FNV-1a, 64 bit: a stable content hash for cache keys without a hashing dependency.
struct Fnv64(u64);
impl Fnv64 {
    fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // A separator so that ("ab","c") and ("a","bc") hash differently.
        self.0 ^= 0xff;
        self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// GPUs the driver sees ([`CudaError::NoDriver`] without a driver).
pub fn device_count() -> Result<usize> {
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::NoDriver);
    }
    let count = CudaContext::device_count().map_err(|e| CudaError::NoDevice(e.to_string()))?;
    Ok(count.max(0) as usize)
}

/// For tests: the GPU, or `None` with the skip reason printed. With `SIEVE_REQUIRE_GPU=1` a
/// missing GPU is a failure instead (the GPU machine runs the tests that way).
pub fn gpu_or_skip(test: &str) -> Option<Gpu> {
    match Gpu::new(0) {
        Ok(g) => Some(g),
        Err(e) => {
            if std::env::var("SIEVE_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("{test}: SIEVE_REQUIRE_GPU=1 but no GPU: {e}");
            }
            eprintln!("{test}: skipped, no GPU: {e}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_separates_fields() {
        let mut a = Fnv64::new();
        a.write(b"ab");
        a.write(b"c");
        let mut b = Fnv64::new();
        b.write(b"a");
        b.write(b"bc");
        assert_ne!(a.finish(), b.finish());
    }

    #[test]
    fn cache_dir_prefers_sieve_home() {
        // Only reads the environment; SIEVE_HOME is not set by the test harness.
        if std::env::var_os("SIEVE_HOME").is_none() {
            if let Some(d) = cache_dir() {
                assert!(d.ends_with(".cache/sieve/kernels"));
            }
        }
    }

    /// Compiles every kernel family with NVRTC where the library is present (no GPU needed),
    /// printing ptxas's register/spill report.
    #[test]
    fn kernels_compile_for_sm90a() {
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("kernels_compile_for_sm90a: skipped, no libnvrtc");
            return;
        }
        // Every family of the crate: a kernel file left out here would be compiled first on
        // a GPU machine (the column-major 4-bit one was, until 2026-12-06).
        for fam in all_families() {
            match compile_check(&fam, "sm_90a") {
                Ok((size, log)) => {
                    assert!(size > 0);
                    eprintln!("{}: {size} bytes\n{log}", fam.name);
                }
                Err(e) => panic!("{e}"),
            }
        }
    }

    /// The parallel compile keeps the families' order, runs every one once whatever the thread
    /// count, and returns an error of any of them.
    #[test]
    fn compile_parallel_keeps_order_and_errors() {
        let fams = families();
        let refs: Vec<&KernelFamily> = fams.iter().collect();
        for threads in [0, 1, 3, 64] {
            let calls = std::sync::atomic::AtomicUsize::new(0);
            let got: Vec<Vec<u8>> = compile_parallel(&refs, threads, |f| {
                calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Ok(f.name.as_bytes().to_vec())
            })
            .into_iter()
            .collect::<Result<_>>()
            .unwrap();
            assert_eq!(calls.into_inner(), fams.len(), "threads {threads}");
            let names: Vec<&[u8]> = got.iter().map(|v| v.as_slice()).collect();
            let want: Vec<&[u8]> = fams.iter().map(|f| f.name.as_bytes()).collect();
            assert_eq!(names, want, "threads {threads}");
        }
        // One family's error stays that family's; the others compile.
        let results = compile_parallel(&refs, 4, |f| {
            if f.name == crate::rope::FAMILY.name {
                Err(CudaError::Option("rope failed".into()))
            } else {
                Ok(vec![1])
            }
        });
        for (f, r) in fams.iter().zip(&results) {
            match r {
                Err(CudaError::Option(m)) => {
                    assert_eq!(f.name, crate::rope::FAMILY.name);
                    assert_eq!(m, "rope failed");
                }
                Ok(v) => assert_eq!(v, &vec![1u8], "{}", f.name),
                Err(e) => panic!("{}: {e}", f.name),
            }
        }
        assert_eq!(results.iter().filter(|r| r.is_err()).count(), 1);
        assert!(compile_parallel(&[], 4, |_| Ok(vec![])).is_empty());
    }

    /// With libnvrtc present: two families compiled on two threads at once give the same CUBINs
    /// as one after the other (NVRTC programs compile independently).
    #[test]
    fn nvrtc_compiles_families_concurrently() {
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            eprintln!("nvrtc_compiles_families_concurrently: skipped, no libnvrtc");
            return;
        }
        let fams = [crate::rope::FAMILY, crate::sampling::FAMILY];
        let refs: Vec<&KernelFamily> = fams.iter().collect();
        let options = vec![
            "--gpu-architecture=sm_90a".to_string(),
            "--std=c++17".to_string(),
        ];
        let build = |f: &KernelFamily| {
            compile_cubin(f.name, &format!("{COMMON_SOURCE}\n{}", f.source), &options)
        };
        let parallel: Vec<Vec<u8>> = compile_parallel(&refs, 2, build)
            .into_iter()
            .collect::<Result<_>>()
            .unwrap();
        for (f, p) in fams.iter().zip(&parallel) {
            assert_eq!(&build(f).unwrap(), p, "{}", f.name);
        }
    }

    #[test]
    fn no_gpu_is_a_typed_error_or_a_gpu() {
        match Gpu::new(0) {
            Ok(g) => assert!(g.info().multiprocessors > 0),
            Err(e) => assert!(matches!(
                e,
                CudaError::NoDriver | CudaError::NoDevice(_) | CudaError::Driver { .. }
            )),
        }
    }
}
