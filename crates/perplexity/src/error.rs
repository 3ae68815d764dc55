//! The crate's one error type.

use std::path::{Path, PathBuf};

/// A result of this crate.
pub type Result<T, E = PerplexityError> = std::result::Result<T, E>;

/// Why an evaluation cannot go on: a bad argument, a text that cannot be evaluated, a logits file
/// that is unreadable or belongs to another evaluation, a failed download. Each renders as one
/// sentence for the user.
#[derive(Debug, thiserror::Error)]
pub enum PerplexityError {
    /// The context is too small for a window with a scored second half.
    #[error(
        "a context of {ctx} tokens is too small: perplexity needs at least {min} (half of each window is context, the rest is scored)"
    )]
    ContextTooSmall {
        /// The context asked for.
        ctx: usize,
        /// The smallest context accepted ([`crate::MIN_CTX`]).
        min: usize,
    },
    /// `--chunks 0`.
    #[error("the number of chunks must be at least 1")]
    NoChunks,
    /// The text has fewer tokens than `llama-perplexity` needs (two windows' worth).
    #[error(
        "the text tokenizes to {tokens} tokens; a context of {ctx} needs at least {needed} (two windows, as llama-perplexity requires): use a longer text or a smaller --ctx"
    )]
    TextTooShort {
        /// Tokens of the whole text (BOS included when the tokenizer adds it).
        tokens: usize,
        /// The context asked for.
        ctx: usize,
        /// The fewest tokens accepted, `2 * ctx`.
        needed: usize,
    },
    /// The text file holds nothing (or a lone newline).
    #[error("{}: the text is empty", path.display())]
    EmptyText {
        /// The file.
        path: PathBuf,
    },
    /// The text file is not UTF-8.
    #[error("{}: not UTF-8 text (the first invalid byte is at offset {offset})", path.display())]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// Byte offset of the first invalid sequence.
        offset: usize,
    },
    /// A logits row of the wrong length (a backend or driver bug, reported rather than indexed).
    #[error("a logits row has {got} values for a vocabulary of {expected}")]
    LogitsLength {
        /// The vocabulary size.
        expected: usize,
        /// Values in the row.
        got: usize,
    },
    /// A logits row with a NaN or +inf, or with every value -inf: no distribution.
    #[error("the logits row of position {position} is not a distribution (NaN, +inf, or every value -inf)")]
    NonFiniteLogits {
        /// The scored position's index in the evaluation (0-based, over all chunks).
        position: usize,
    },
    /// A token id outside the vocabulary.
    #[error("token id {token} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfRange {
        /// The id.
        token: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// The logits file is not one, or is truncated or damaged.
    #[error("{}: not a usable seam logits file: {message}", path.display())]
    CorruptLogits {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The logits file was saved by an evaluation that this run cannot be compared with.
    #[error("{}: the base logits were saved with {what} {base}, this run has {run}; compare runs of the same text, tokenizer, --ctx and --chunks", path.display())]
    LogitsMismatch {
        /// The file.
        path: PathBuf,
        /// What differs ("vocabulary size", "context", ...).
        what: &'static str,
        /// The base's value.
        base: String,
        /// This run's value.
        run: String,
    },
    /// The writer was given more or fewer positions than its header announced (a driver bug).
    #[error("{}: {message}", path.display())]
    WriterMisuse {
        /// The file being written.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// Reading or writing a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Downloading the evaluation text failed.
    #[error("fetching the evaluation text into {}: {message}", path.display())]
    Fetch {
        /// Where it was to go.
        path: PathBuf,
        /// What failed.
        message: String,
    },
    /// A download is not the pinned file.
    #[error("{}: {what} is {actual}, the pinned file's is {expected}; the file was deleted", path.display())]
    ChecksumMismatch {
        /// The (deleted) file.
        path: PathBuf,
        /// What differs: `size` or `sha256`.
        what: &'static str,
        /// The pinned digest.
        expected: String,
        /// The digest found.
        actual: String,
    },
    /// The downloaded archive lacks a file or cannot be read.
    #[error("{}: {message}", path.display())]
    BadArchive {
        /// The archive.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
}

impl PerplexityError {
    /// An I/O failure on `path`.
    pub fn io(path: impl AsRef<Path>, source: std::io::Error) -> Self {
        PerplexityError::Io { path: path.as_ref().to_path_buf(), source }
    }

    pub(crate) fn corrupt(path: &Path, message: impl Into<String>) -> Self {
        PerplexityError::CorruptLogits { path: path.to_path_buf(), message: message.into() }
    }
}

impl From<pinned_download::FetchError> for PerplexityError {
    fn from(e: pinned_download::FetchError) -> Self {
        use pinned_download::FetchError;
        match e {
            FetchError::Pip { spec, message } => PerplexityError::Fetch { path: PathBuf::from(spec), message },
            FetchError::Mismatch { path, what, expected, actual } => {
                PerplexityError::ChecksumMismatch { path, what, expected, actual }
            }
            FetchError::Io { path, source } => PerplexityError::Io { path, source },
        }
    }
}
