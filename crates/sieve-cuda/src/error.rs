//! Typed errors of the CUDA backend. Every way the GPU path can be unavailable (no driver library,
//! no device, no NVRTC, a kernel that does not compile) has its own variant so that callers and
//! tests can tell "no GPU here" apart from "the GPU code is broken".

use thiserror::Error;

#[derive(Debug, Error)]
pub enum CudaError {
    #[error("no CUDA driver library (libcuda) could be loaded on this machine")]
    NoDriver,
    #[error("the CUDA driver found no GPU ({0})")]
    NoDevice(String),
    #[error("no NVRTC library (libnvrtc) could be loaded; it is needed to compile the kernels")]
    NoNvrtc,
    #[error("no cuBLAS library (libcublas) could be loaded")]
    NoCublas,
    #[error("CUDA driver call failed during {what}: {source}")]
    Driver {
        what: &'static str,
        #[source]
        source: cudarc::driver::DriverError,
    },
    #[error("NVRTC failed to compile kernel family '{family}' with options {options:?}:\n{log}")]
    Compile {
        family: &'static str,
        options: Vec<String>,
        log: String,
    },
    #[error(
        "cuSPARSELt could not be loaded (tried: {0}); set SIEVE_CUSPARSELT to libcusparseLt.so.0"
    )]
    NoCusparseLt(String),
    #[error("cuSPARSELt call {call} failed: {text} (status {status})")]
    CusparseLt {
        call: &'static str,
        status: i32,
        text: String,
    },
    #[error(
        "NCCL could not be loaded (cudarc looks for libnccl.so by its unversioned names): {0}"
    )]
    NoNccl(String),
    #[error("NCCL call {call} failed: {status}")]
    Nccl { call: &'static str, status: String },
    #[error("cuBLASLt: {0}")]
    CublasLt(String),
    #[error("cuBLAS call failed: {0}")]
    Cublas(#[from] cudarc::cublas::result::CublasError),
    #[error("format error: {0}")]
    Format(#[from] sieve_formats::FormatError),
    #[error("shape mismatch: {what}: expected {expected}, got {actual}")]
    Shape {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    #[error("invalid kernel option: {0}")]
    Option(String),
    /// A model shape or size the kernels cannot run (the attention limits, a count past 32
    /// bits), with the reason.
    #[error("{0}")]
    Unsupported(String),
    #[error("kernel cache I/O at {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, CudaError>;

/// Attaches a description of the failing step to a driver error.
pub trait DriverContext<T> {
    fn during(self, what: &'static str) -> Result<T>;
}

impl<T> DriverContext<T> for std::result::Result<T, cudarc::driver::DriverError> {
    fn during(self, what: &'static str) -> Result<T> {
        self.map_err(|source| CudaError::Driver { what, source })
    }
}
