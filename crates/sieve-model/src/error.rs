//! One error type for the model crate; variants say what was being read or computed.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ModelError {
    #[error("I/O error on {path}: {source}")]
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
    #[error(transparent)]
    Format(#[from] sieve_formats::FormatError),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
