//! Errors of the graph emitter.

use thiserror::Error;

/// Why a graph or its arguments could not be produced.
#[derive(Debug, Error, PartialEq)]
pub enum GraphError {
    /// The model config is inconsistent (as `LlamaConfig::validate` reports it).
    #[error("invalid model config: {0}")]
    Config(String),
    /// The graph options do not fit the model (context, bucket, format).
    #[error("invalid graph options: {0}")]
    Options(String),
    /// A weight does not have the shape or format the graph expects.
    #[error("weight {name}: {message}")]
    Weight { name: String, message: String },
}
