//! The typed errors of this crate and their mapping onto the seam contract's [`SeamError`].

use session_api::SeamError;
use std::path::PathBuf;

/// Every failure of loading a tokenizer or chat template, encoding, decoding or rendering.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// A file the model directory must hold is not there.
    #[error("{}: file not found", path.display())]
    MissingFile { path: PathBuf },

    /// A model file exists but could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// `tokenizer.json` is not a tokenizer the `tokenizers` crate understands.
    #[error("{}: malformed tokenizer.json: {message}", path.display())]
    MalformedTokenizer { path: PathBuf, message: String },

    /// `tokenizer_config.json` (or `chat_template.json`) is not valid JSON or has fields of the
    /// wrong type.
    #[error("{}: malformed tokenizer config: {message}", path.display())]
    MalformedConfig { path: PathBuf, message: String },

    /// The model directory has no chat template: the model is not a chat model, or its
    /// template was not shipped.
    #[error("{}: the model has no chat template", dir.display())]
    NoChatTemplate { dir: PathBuf },

    /// The chat template is not valid Jinja (as far as minijinja understands it).
    #[error("the chat template does not compile: {message}")]
    TemplateSyntax { message: String },

    /// The template called `raise_exception(message)`: it rejects this conversation (for
    /// example roles that do not alternate).
    #[error("the chat template rejected the conversation: {message}")]
    TemplateException { message: String },

    /// Rendering failed for another reason (a filter on a value of the wrong type, ...).
    #[error("rendering the chat template failed: {message}")]
    TemplateRender { message: String },

    /// A token id that the tokenizer does not know was given to `decode`.
    #[error("token id {id} is not in the tokenizer's vocabulary (size {vocab_size})")]
    UnknownTokenId { id: u32, vocab_size: usize },

    /// The tokenizer failed to encode a text.
    #[error("encoding failed: {message}")]
    Encode { message: String },

    /// The tokenizer failed to decode ids.
    #[error("decoding failed: {message}")]
    Decode { message: String },
}

/// `Result` with [`TokenizerError`].
pub type Result<T> = std::result::Result<T, TokenizerError>;

impl From<TokenizerError> for SeamError {
    /// Problems with a model's files (missing, unreadable, malformed, no or broken template)
    /// are [`SeamError::ModelFormat`]; problems with what the caller passed are
    /// [`SeamError::InvalidInput`] (or [`SeamError::TokenOutOfVocabulary`]).
    fn from(err: TokenizerError) -> Self {
        match err {
            TokenizerError::MissingFile { path } => SeamError::model_format(path, "file not found"),
            TokenizerError::Io { path, source } => SeamError::model_format(path, source.to_string()),
            TokenizerError::MalformedTokenizer { path, message } => {
                SeamError::model_format(path, format!("malformed tokenizer.json: {message}"))
            }
            TokenizerError::MalformedConfig { path, message } => {
                SeamError::model_format(path, format!("malformed tokenizer config: {message}"))
            }
            TokenizerError::NoChatTemplate { dir } => SeamError::model_format(dir, "the model has no chat template"),
            e @ TokenizerError::TemplateSyntax { .. } => SeamError::ModelFormat { path: None, message: e.to_string() },
            TokenizerError::UnknownTokenId { id, vocab_size } => {
                SeamError::TokenOutOfVocabulary { token: id, vocab_size }
            }
            e @ (TokenizerError::TemplateException { .. }
            | TokenizerError::TemplateRender { .. }
            | TokenizerError::Encode { .. }
            | TokenizerError::Decode { .. }) => SeamError::InvalidInput(e.to_string()),
        }
    }
}

/// Reads a model file, telling a missing file apart from other I/O failures.
pub(crate) fn read_model_file(path: &std::path::Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            TokenizerError::MissingFile { path: path.to_path_buf() }
        } else {
            TokenizerError::Io { path: path.to_path_buf(), source }
        }
    })
}
