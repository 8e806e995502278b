//! Errors of the GPU runner: the CUDA backend's, the model's, and the runner's own refusals.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum GpuError {
    #[error(transparent)]
    Cuda(#[from] sieve_cuda::CudaError),
    #[error(transparent)]
    Model(#[from] sieve_model::ModelError),
    #[error(transparent)]
    Format(#[from] sieve_formats::FormatError),
    /// A model or option the GPU runner cannot run, with the reason.
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("the model needs {needed} bytes of GPU memory, the GPU has {free} free of {total}")]
    OutOfMemory {
        needed: usize,
        free: usize,
        total: usize,
    },
}

pub type Result<T> = std::result::Result<T, GpuError>;

impl From<cudarc::driver::DriverError> for GpuError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        GpuError::Cuda(sieve_cuda::CudaError::Driver {
            what: "a GPU runner call",
            source: e,
        })
    }
}
