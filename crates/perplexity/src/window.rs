//! Which tokens are fed and which are scored: `llama-perplexity`'s window plan.
//!
//! llama.cpp (tools/perplexity/perplexity.cpp, `perplexity()`) tokenizes the whole text once with
//! special tokens added, refuses a text of fewer than `2 * n_ctx` tokens, cuts it into
//! `tokens / n_ctx` non-overlapping chunks (chunk `i` starts at `i * n_ctx`; `--chunks N` keeps the
//! first N), feeds each chunk from an empty KV cache with its first token replaced by BOS when the
//! vocabulary adds BOS, and scores positions `first = n_ctx / 2` up to `n_ctx - 2`: the logits of
//! position `j` against token `j + 1`, `n_ctx - 1 - first` tokens per chunk. The plan here is the
//! same, number for number.

use crate::error::{PerplexityError, Result};
use xxhash_rust::xxh3::Xxh3;

/// The smallest context accepted: 4 tokens give a window of 2 context tokens and 1 scored one
/// (llama.cpp accepts anything positive; below 4 a window scores nothing or only its second token).
pub const MIN_CTX: usize = 4;

/// How a tokenized text is cut into windows, and which positions of each are scored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct WindowPlan {
    /// Tokens per window (`--ctx`).
    pub ctx: usize,
    /// Windows evaluated: `token_count / ctx`, or fewer with `--chunks`.
    pub chunks: usize,
    /// Windows the text holds (`token_count / ctx`).
    pub available_chunks: usize,
    /// Tokens of the whole text.
    pub token_count: usize,
}

impl WindowPlan {
    /// Checks a context before any work is done: at least [`MIN_CTX`].
    pub fn check_ctx(ctx: usize) -> Result<()> {
        if ctx < MIN_CTX {
            return Err(PerplexityError::ContextTooSmall { ctx, min: MIN_CTX });
        }
        Ok(())
    }

    /// The plan for a text of `token_count` tokens and windows of `ctx`, keeping at most
    /// `max_chunks` windows. A text of fewer than `2 * ctx` tokens is refused, as
    /// `llama-perplexity` refuses it (it needs two windows even when `--chunks 1` asks for one).
    pub fn new(token_count: usize, ctx: usize, max_chunks: Option<usize>) -> Result<WindowPlan> {
        Self::check_ctx(ctx)?;
        if max_chunks == Some(0) {
            return Err(PerplexityError::NoChunks);
        }
        let needed = ctx.saturating_mul(2);
        if token_count < needed {
            return Err(PerplexityError::TextTooShort { tokens: token_count, ctx, needed });
        }
        let available_chunks = token_count / ctx;
        let chunks = max_chunks.map_or(available_chunks, |n| n.min(available_chunks));
        Ok(WindowPlan { ctx, chunks, available_chunks, token_count })
    }

    /// The first scored position of a window, `ctx / 2`: the model always has at least half a
    /// window of context behind a scored token.
    pub fn first_scored(&self) -> usize {
        self.ctx / 2
    }

    /// Scored positions per window: `ctx - 1 - ctx / 2` (the last position predicts a token outside
    /// the window, so it is not scored).
    pub fn scored_per_chunk(&self) -> usize {
        self.ctx - 1 - self.first_scored()
    }

    /// Scored positions over the whole evaluation.
    pub fn scored_positions(&self) -> usize {
        self.chunks * self.scored_per_chunk()
    }

    /// The tokens fed for window `chunk`: `tokens[chunk * ctx .. (chunk + 1) * ctx]` with the first
    /// replaced by `bos` when the tokenizer adds one. Position `j >= first_scored()` of the window,
    /// except the last, is scored against element `j + 1` of this slice (never the replaced one).
    ///
    /// Panics if `chunk >= self.chunks` or `tokens` is shorter than the plan says (callers hold the
    /// tokens the plan was made from).
    pub fn chunk_input(&self, tokens: &[u32], chunk: usize, bos: Option<u32>) -> Vec<u32> {
        assert!(chunk < self.chunks, "chunk {chunk} of a plan of {}", self.chunks);
        let start = chunk * self.ctx;
        let mut input = tokens[start..start + self.ctx].to_vec();
        if let Some(bos) = bos {
            input[0] = bos;
        }
        input
    }

    /// A fingerprint of everything that decides the scored distributions besides the model: the
    /// window size, the window count and every token fed (BOS replacements included), as xxh3-64.
    /// Two runs with the same fingerprint scored the same tokens after the same contexts, so their
    /// distributions can be compared position by position.
    pub fn fingerprint(&self, tokens: &[u32], bos: Option<u32>) -> u64 {
        let mut hasher = Xxh3::new();
        hasher.update(&(self.ctx as u64).to_le_bytes());
        hasher.update(&(self.chunks as u64).to_le_bytes());
        for chunk in 0..self.chunks {
            for token in self.chunk_input(tokens, chunk, bos) {
                hasher.update(&token.to_le_bytes());
            }
        }
        hasher.digest()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ten_tokens_in_windows_of_four() {
        let plan = WindowPlan::new(10, 4, None).unwrap();
        assert_eq!((plan.chunks, plan.available_chunks), (2, 2));
        // llama.cpp: first = 4/2 = 2, n_ctx - 1 - first = 1 token per chunk: position 2 of each
        // window predicts its token 3.
        assert_eq!((plan.first_scored(), plan.scored_per_chunk(), plan.scored_positions()), (2, 1, 2));
        let tokens: Vec<u32> = (10..20).collect();
        assert_eq!(plan.chunk_input(&tokens, 0, None), vec![10, 11, 12, 13]);
        assert_eq!(plan.chunk_input(&tokens, 1, None), vec![14, 15, 16, 17]);
        // The first token of every window becomes BOS (tokens 18, 19 are never used).
        assert_eq!(plan.chunk_input(&tokens, 1, Some(1)), vec![1, 15, 16, 17]);
    }

    #[test]
    fn odd_and_default_sized_windows() {
        // ctx 5: first = 2, scored positions 2 and 3 (predicting 3 and 4).
        let plan = WindowPlan::new(17, 5, None).unwrap();
        assert_eq!((plan.chunks, plan.first_scored(), plan.scored_per_chunk()), (3, 2, 2));
        // ctx 512: positions 256..=510 are scored, 255 per window.
        let plan = WindowPlan::new(512 * 7 + 100, 512, None).unwrap();
        assert_eq!((plan.chunks, plan.first_scored(), plan.scored_per_chunk()), (7, 256, 255));
        assert_eq!(plan.scored_positions(), 7 * 255);
    }

    #[test]
    fn chunks_limits_the_windows() {
        let plan = WindowPlan::new(100, 8, Some(3)).unwrap();
        assert_eq!((plan.chunks, plan.available_chunks), (3, 12));
        let plan = WindowPlan::new(100, 8, Some(50)).unwrap();
        assert_eq!(plan.chunks, 12);
        assert!(matches!(WindowPlan::new(100, 8, Some(0)), Err(PerplexityError::NoChunks)));
    }

    #[test]
    fn short_texts_and_small_contexts_are_refused() {
        // Two windows' worth is the least llama-perplexity accepts, even for --chunks 1.
        assert!(WindowPlan::new(8, 4, Some(1)).is_ok());
        for tokens in [0, 1, 4, 7] {
            let error = WindowPlan::new(tokens, 4, Some(1)).unwrap_err();
            assert!(
                matches!(error, PerplexityError::TextTooShort { tokens: t, ctx: 4, needed: 8 } if t == tokens),
                "{error:?}"
            );
            assert!(error.to_string().contains(&format!("tokenizes to {tokens} tokens")), "{error}");
        }
        for ctx in [0, 1, 2, 3] {
            assert!(matches!(WindowPlan::new(1000, ctx, None), Err(PerplexityError::ContextTooSmall { .. })));
        }
        // A context whose double overflows is "too short", not a panic.
        assert!(matches!(WindowPlan::new(100, usize::MAX, None), Err(PerplexityError::TextTooShort { .. })));
    }

    #[test]
    fn the_fingerprint_follows_the_fed_tokens() {
        let tokens: Vec<u32> = (0..40).collect();
        let plan = WindowPlan::new(40, 8, None).unwrap();
        let base = plan.fingerprint(&tokens, None);
        assert_eq!(base, plan.fingerprint(&tokens, None));
        assert_ne!(base, plan.fingerprint(&tokens, Some(1)), "BOS changes what is fed");
        assert_ne!(base, WindowPlan::new(40, 8, Some(4)).unwrap().fingerprint(&tokens, None));
        assert_ne!(base, WindowPlan::new(40, 10, None).unwrap().fingerprint(&tokens, None));
        let mut other = tokens.clone();
        other[17] = 99;
        assert_ne!(base, plan.fingerprint(&other, None));
    }
}
