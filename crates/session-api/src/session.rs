//! The session: one sequence's state, token ids in, token ids out.

use crate::capabilities::Capabilities;
use crate::error::{Result, SeamError};
use crate::sampling::SamplingConfig;

/// How a session is created.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SessionOptions {
    /// How the backend picks each next token.
    pub sampling: SamplingConfig,
    /// Return the logits of the last position of each step in [`StepOutput::logits`].
    /// Needs [`Capabilities::logits`].
    pub return_logits: bool,
}

impl SessionOptions {
    /// Refuses options that `capabilities` cannot honour, with a typed [`SeamError::Unsupported`].
    /// Every backend calls this from `Engine::new_session`, so refusal is uniform.
    pub fn check_against(&self, backend: &str, capabilities: &Capabilities) -> Result<()> {
        self.sampling.validate().map_err(SeamError::InvalidInput)?;
        let needed = self.sampling.required_modes();
        let offered = capabilities.sampling;
        let missing = [
            (needed.greedy && !offered.greedy, "greedy sampling"),
            (needed.temperature && !offered.temperature, "temperature sampling"),
            (needed.top_k && !offered.top_k, "top-k sampling"),
            (needed.top_p && !offered.top_p, "top-p sampling"),
            (needed.seeded && !offered.seeded, "seeded sampling"),
            (self.return_logits && !capabilities.logits, "returning logits"),
        ];
        match missing.iter().find(|(lacking, _)| *lacking) {
            Some((_, feature)) => Err(SeamError::unsupported(backend, *feature)),
            None => Ok(()),
        }
    }
}

/// The result of one prefill or decode step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    /// The next token, chosen by the session's sampler from the last position's logits.
    pub token: u32,
    /// The last position's logits (`vocab_size` values), when the session was created with
    /// [`SessionOptions::return_logits`].
    pub logits: Option<Vec<f32>>,
}

/// One sequence's state on a backend.
///
/// `prefill` appends tokens at [`Session::position`] (so calling it again extends the sequence,
/// which is chunked prefill), `decode` appends one token; both return the next token. A session is
/// `Send`: it may move between threads, but it is used by one caller at a time (`&mut self`).
///
/// Errors: an argument rejected before any state changed (empty input, a token id outside the
/// vocabulary, a sequence that would exceed [`Session::capacity`]) leaves the session as it was.
/// Any other failure of `prefill` or `decode` poisons the session: further calls return
/// [`SeamError::Poisoned`] until [`Session::reset`].
pub trait Session: Send {
    /// Appends `tokens` at the current position and returns the next token.
    fn prefill(&mut self, tokens: &[u32]) -> Result<StepOutput>;

    /// Appends one token (usually the one the last step returned) and returns the next token.
    fn decode(&mut self, token: u32) -> Result<StepOutput>;

    /// Number of positions filled so far.
    fn position(&self) -> usize;

    /// Most positions this session can hold.
    fn capacity(&self) -> usize;

    /// Empties the sequence, clears poisoning, and restarts the sampler's random stream.
    fn reset(&mut self);

    /// Rewinds to `position` (≤ the current position), dropping later state.
    /// Needs [`crate::KvOps::truncate`].
    fn truncate(&mut self, position: usize) -> Result<()> {
        let _ = position;
        Err(SeamError::unsupported(self.backend_name(), "truncate"))
    }

    /// A new session with a copy of this one's state; the two then evolve independently.
    /// Needs [`crate::KvOps::fork`].
    fn fork(&self) -> Result<Box<dyn Session>> {
        Err(SeamError::unsupported(self.backend_name(), "fork"))
    }

    /// Appends `count` positions given as hidden-size embedding vectors (row-major,
    /// `count * hidden_size` values) instead of token ids, and returns the next token.
    /// Needs [`crate::InputKinds::embeddings`].
    fn prefill_embeddings(&mut self, embeddings: &[f32], count: usize) -> Result<StepOutput> {
        let _ = (embeddings, count);
        Err(SeamError::unsupported(self.backend_name(), "prefill from embeddings"))
    }

    /// Name of the backend that made this session (for error messages).
    fn backend_name(&self) -> &str;
}

/// The bookkeeping every session needs to honour the error contract: argument checks that happen
/// before any state changes, and poisoning after a failure. Backends embed one and route each step
/// through [`SessionGuard::step`].
#[derive(Debug, Clone, Default)]
pub struct SessionGuard {
    poisoned: Option<String>,
}

impl SessionGuard {
    /// Checks a prefill/decode argument against the vocabulary and the remaining capacity.
    pub fn check_tokens(tokens: &[u32], vocab_size: usize, position: usize, capacity: usize) -> Result<()> {
        if tokens.is_empty() {
            return Err(SeamError::EmptyInput);
        }
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(SeamError::TokenOutOfVocabulary { token, vocab_size });
        }
        let requested = position + tokens.len();
        if requested > capacity {
            return Err(SeamError::ContextOverflow { requested, capacity });
        }
        Ok(())
    }

    /// Runs one step: refuses if poisoned, and poisons on a failure that may have changed state.
    pub fn step<T>(&mut self, run: impl FnOnce() -> Result<T>) -> Result<T> {
        if let Some(cause) = &self.poisoned {
            return Err(SeamError::Poisoned { cause: cause.clone() });
        }
        let result = run();
        if let Err(error) = &result {
            if error.poisons_session() {
                self.poisoned = Some(error.to_string());
            }
        }
        result
    }

    /// Whether an earlier failure poisoned the session.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.is_some()
    }

    /// Marks the session poisoned (for failures detected outside [`SessionGuard::step`]).
    pub fn poison(&mut self, cause: impl Into<String>) {
        self.poisoned = Some(cause.into());
    }

    /// Clears poisoning (on reset).
    pub fn clear(&mut self) {
        self.poisoned = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn checks_reject_before_state_changes() {
        assert_eq!(SessionGuard::check_tokens(&[], 10, 0, 8).unwrap_err().kind(), ErrorKind::InvalidInput);
        assert!(matches!(
            SessionGuard::check_tokens(&[3, 10], 10, 0, 8),
            Err(SeamError::TokenOutOfVocabulary { token: 10, vocab_size: 10 })
        ));
        assert!(matches!(
            SessionGuard::check_tokens(&[1, 2], 10, 7, 8),
            Err(SeamError::ContextOverflow { requested: 9, capacity: 8 })
        ));
        assert!(SessionGuard::check_tokens(&[1], 10, 7, 8).is_ok());
    }

    #[test]
    fn backend_failures_poison_until_cleared() {
        let mut guard = SessionGuard::default();
        let _ = guard.step(|| -> Result<()> { Err(SeamError::EmptyInput) });
        assert!(!guard.is_poisoned(), "a rejected argument must not poison");
        let _ = guard.step(|| -> Result<()> { Err(SeamError::Backend("device lost".into())) });
        let err = guard.step(|| Ok(())).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidState);
        guard.clear();
        assert!(guard.step(|| Ok(())).is_ok());
    }
}
