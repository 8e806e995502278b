//! The error type of the CPU kernels: a bad argument to a constructor, a block type without a
//! kernel, or a format error from `sieve_formats`.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum CpuError {
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error(transparent)]
    Format(#[from] sieve_formats::FormatError),
}

pub type Result<T, E = CpuError> = std::result::Result<T, E>;
