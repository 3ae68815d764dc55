//! One error type for the whole contract, with a stable [`ErrorKind`].

use serde::Serialize;
use std::path::PathBuf;

/// The stable classification of a [`SeamError`]; match on this, not on messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The backend lacks a capability the request needs.
    Unsupported,
    /// The caller passed something wrong: an empty prompt, a token id outside the vocabulary,
    /// an unknown backend name, a bad option.
    InvalidInput,
    /// The call is not valid in the session's current state: decode before prefill, or a session
    /// poisoned by an earlier failure.
    InvalidState,
    /// More positions than the session's context capacity.
    ContextOverflow,
    /// The backend cannot run here (plugin missing, no device).
    Unavailable,
    /// A model file is missing, malformed, or of an architecture seam does not run.
    ModelFormat,
    /// Memory or another resource ran out.
    ResourceExhausted,
    /// The caller cancelled the operation.
    Cancelled,
    /// An I/O failure outside a model's own files.
    Io,
    /// The backend failed internally (a compiler or runtime error, a bug).
    Backend,
}

/// Every error of the session contract.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SeamError {
    #[error("{backend} does not support {feature}")]
    Unsupported { backend: String, feature: String },

    #[error("{0}")]
    InvalidInput(String),

    #[error("the prompt is empty: prefill needs at least one token")]
    EmptyInput,

    #[error("token id {token} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfVocabulary { token: u32, vocab_size: usize },

    #[error("no backend named '{name}' is registered (known: {known})")]
    UnknownBackend { name: String, known: String },

    #[error("decode called before prefill: the session has no tokens yet")]
    NotPrefilled,

    #[error("the session is poisoned by an earlier failure ({cause}); call reset() before using it again")]
    Poisoned { cause: String },

    #[error("context overflow: {requested} positions needed, the session holds at most {capacity}")]
    ContextOverflow { requested: usize, capacity: usize },

    #[error("backend {backend} is unavailable: {reason}")]
    Unavailable { backend: String, reason: String },

    #[error("{}: {message}", path.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "model".into()))]
    ModelFormat { path: Option<PathBuf>, message: String },

    #[error("resource exhausted: {0}")]
    ResourceExhausted(String),

    #[error("cancelled")]
    Cancelled,

    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("backend failure: {0}")]
    Backend(String),
}

impl SeamError {
    /// The stable kind of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            SeamError::Unsupported { .. } => ErrorKind::Unsupported,
            SeamError::InvalidInput(_)
            | SeamError::EmptyInput
            | SeamError::TokenOutOfVocabulary { .. }
            | SeamError::UnknownBackend { .. } => ErrorKind::InvalidInput,
            SeamError::NotPrefilled | SeamError::Poisoned { .. } => ErrorKind::InvalidState,
            SeamError::ContextOverflow { .. } => ErrorKind::ContextOverflow,
            SeamError::Unavailable { .. } => ErrorKind::Unavailable,
            SeamError::ModelFormat { .. } => ErrorKind::ModelFormat,
            SeamError::ResourceExhausted(_) => ErrorKind::ResourceExhausted,
            SeamError::Cancelled => ErrorKind::Cancelled,
            SeamError::Io { .. } => ErrorKind::Io,
            SeamError::Backend(_) => ErrorKind::Backend,
        }
    }

    /// Shorthand for [`SeamError::Unsupported`].
    pub fn unsupported(backend: impl Into<String>, feature: impl Into<String>) -> Self {
        SeamError::Unsupported { backend: backend.into(), feature: feature.into() }
    }

    /// Shorthand for [`SeamError::ModelFormat`] about one file.
    pub fn model_format(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        SeamError::ModelFormat { path: Some(path.into()), message: message.into() }
    }

    /// Whether a failure of this kind poisons the session that returned it. Errors that reject an
    /// argument before any state changed (bad token, overflow checked up front, unsupported
    /// request) leave the session usable; everything else poisons it.
    pub fn poisons_session(&self) -> bool {
        !matches!(
            self.kind(),
            ErrorKind::InvalidInput | ErrorKind::InvalidState | ErrorKind::Unsupported | ErrorKind::ContextOverflow
        )
    }
}

/// `Result` with [`SeamError`].
pub type Result<T> = std::result::Result<T, SeamError>;
