//! One error type for the model crate; variants say what was being read or computed.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ModelError {
    /// The cause is the error's `source()`, not part of this message, so a chain printer
    /// (`anyhow`'s "Caused by") shows it once; [`ModelError::with_causes`] flattens both.
    #[error("I/O error on {path}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("malformed model file {path}: {reason}")]
    Malformed { path: String, reason: String },
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("tensor '{0}' not found in the model file")]
    MissingTensor(String),
    /// A tensor whose values the model cannot use (named by the tensor, not by a file path).
    #[error("tensor '{name}': {reason}")]
    BadTensor { name: String, reason: String },
    /// The path exists but is not a model in any layout this build reads.
    #[error("{path} is not a model: {reason}")]
    NotAModel { path: String, reason: String },
    #[error("tensor '{name}' has shape {actual:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("missing or invalid metadata '{key}': {reason}")]
    Metadata { key: String, reason: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("prompt has {tokens} tokens but the context holds {context}")]
    ContextOverflow { tokens: usize, context: usize },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A failure of the device running the model (a GPU engine), with its causes.
    #[error("device: {0}")]
    Device(String),
    #[error(transparent)]
    Format(#[from] sieve_formats::FormatError),
}

/// The CPU kernels' errors keep their variant here (a GGUF block type without a kernel stays
/// `Unsupported`, a bad argument `InvalidArgument`), so messages and matches are unchanged.
impl From<sieve_cpu::CpuError> for ModelError {
    fn from(e: sieve_cpu::CpuError) -> Self {
        match e {
            sieve_cpu::CpuError::Unsupported(m) => ModelError::Unsupported(m),
            sieve_cpu::CpuError::InvalidArgument(m) => ModelError::InvalidArgument(m),
            sieve_cpu::CpuError::Format(f) => ModelError::Format(f),
        }
    }
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

impl ModelError {
    /// This error's message followed by each cause's, `: `-separated, for callers that keep
    /// only text (and would otherwise drop the cause of an I/O error).
    pub fn with_causes(&self) -> String {
        let mut out = self.to_string();
        let mut cause = std::error::Error::source(self);
        while let Some(c) = cause {
            out.push_str(": ");
            out.push_str(&c.to_string());
            cause = c.source();
        }
        out
    }
}
