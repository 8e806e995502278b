use thiserror::Error;

#[derive(Debug, Error)]
pub enum SimError {
    #[error("invalid simulator option: {0}")]
    Option(String),
    #[error(transparent)]
    Format(#[from] sieve_formats::FormatError),
    #[error("measured data: {0}")]
    Data(String),
}

pub type Result<T> = std::result::Result<T, SimError>;
