use thiserror::Error;

#[derive(Debug, Error)]
pub enum SimError {
    #[error("invalid simulator option: {0}")]
    Option(String),
    #[error(transparent)]
    Format(#[from] sieve_formats::FormatError),
    #[error("measured data: {0}")]
    Data(String),
    /// A failure of one point of a sweep, with the point it happened at.
    #[error("simulating {point}: {source}")]
    AtPoint {
        point: String,
        source: Box<SimError>,
    },
}

pub type Result<T> = std::result::Result<T, SimError>;
