//! The one error type of the command line: every failure becomes one human sentence.

use session_api::SeamError;

/// A failure of a `seam` command, shown as `error: <sentence>`.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// A failure reported by the session contract, a backend, or the model pipeline.
    #[error("{0}")]
    Seam(#[from] SeamError),
    /// A mistake in how the command was called that clap cannot see (a missing prompt, ...).
    #[error("{0}")]
    Usage(String),
    /// The command ran, and what it checks did not hold (a conformance failure).
    #[error("{0}")]
    CheckFailed(String),
    /// A perplexity evaluation cannot go on (its text, window plan or logits file).
    #[error("{0}")]
    Perplexity(#[from] perplexity::PerplexityError),
    /// Writing the output failed (a closed pipe, a full disk).
    #[error("could not write output: {0}")]
    Output(#[from] std::io::Error),
    /// `seam serve` could not listen (an address in use or not this machine's), or its
    /// connection loop failed.
    #[error("{0}")]
    Server(String),
}

impl From<llama_model::ModelError> for CliError {
    fn from(error: llama_model::ModelError) -> Self {
        CliError::Seam(error.into())
    }
}

impl From<chat_tokenizer::TokenizerError> for CliError {
    fn from(error: chat_tokenizer::TokenizerError) -> Self {
        CliError::Seam(error.into())
    }
}
