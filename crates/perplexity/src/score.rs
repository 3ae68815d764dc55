//! Scoring one position, and perplexity over many.
//!
//! Everything is computed in f64 from the backend's f32 logits: a log-softmax over a vocabulary of
//! tens of thousands of values loses digits in f32, and the sums of negative log-likelihoods run
//! over hundreds of thousands of tokens.

use crate::error::{PerplexityError, Result};

/// `log_softmax(logits)` in f64: `logits[i] - max - ln(sum(exp(logits - max)))`.
///
/// Refused with [`PerplexityError::NonFiniteLogits`] (naming `position`): a NaN or +inf anywhere,
/// or no finite value at all. A `-inf` logit is a token the model rules out; its log-probability
/// is `-inf`.
pub fn log_softmax(logits: &[f32], position: usize) -> Result<Vec<f64>> {
    let not_a_distribution = || PerplexityError::NonFiniteLogits { position };
    if logits.iter().any(|&x| x.is_nan() || x == f32::INFINITY) || !logits.iter().any(|x| x.is_finite()) {
        return Err(not_a_distribution());
    }
    let log_normalizer = session_api::logprobs::log_normalizer(logits);
    Ok(logits.iter().map(|&x| f64::from(x) - log_normalizer).collect())
}

/// The index of the largest value, the first one on ties (as llama.cpp picks the top token).
/// `values` must not be empty.
pub fn argmax(values: &[f64]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate().skip(1) {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

/// One scored position: the model's distribution there and how it did on the token that follows.
#[derive(Debug, Clone, PartialEq)]
pub struct PositionScore {
    /// `log p(token)` for every token of the vocabulary.
    pub log_probs: Vec<f64>,
    /// The token that follows in the text.
    pub target: u32,
    /// Its negative log-likelihood, `-log_probs[target]`.
    pub nll: f64,
    /// The most likely token (the first on ties).
    pub argmax: u32,
}

impl PositionScore {
    /// Scores the logits row of scored position number `position` (0-based over the evaluation,
    /// for error messages) against `target`, the token that follows it.
    pub fn new(logits: &[f32], target: u32, position: usize) -> Result<PositionScore> {
        if target as usize >= logits.len() {
            return Err(PerplexityError::TokenOutOfRange { token: target, vocab_size: logits.len() });
        }
        let log_probs = log_softmax(logits, position)?;
        let nll = -log_probs[target as usize];
        let argmax = argmax(&log_probs);
        Ok(PositionScore { log_probs, target, nll, argmax })
    }
}

/// Perplexity as plain figures.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Perplexity {
    /// `exp(mean NLL)`.
    pub ppl: f64,
    /// Its standard error, as `llama-perplexity` prints it after `+/-`: `ppl * sqrt(var / (n - 1))`
    /// with `var = mean(NLL²) - mean(NLL)²`. 0 when there is no spread to measure (fewer than two
    /// tokens, or every NLL equal up to rounding, where llama.cpp prints an error instead).
    pub uncertainty: f64,
    /// Mean negative log-likelihood in nats per token (`ln ppl`).
    pub mean_nll: f64,
    /// Tokens scored.
    pub tokens: usize,
}

/// Running sums of negative log-likelihoods, from which perplexity and its uncertainty come (the
/// `nll` and `nll2` sums of `llama-perplexity`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PerplexityAccumulator {
    sum: f64,
    sum_squares: f64,
    count: usize,
}

impl PerplexityAccumulator {
    /// No tokens yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one token's negative log-likelihood.
    pub fn add(&mut self, nll: f64) {
        self.sum += nll;
        self.sum_squares += nll * nll;
        self.count += 1;
    }

    /// Tokens added so far.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The estimate so far (`None` before the first token).
    pub fn estimate(&self) -> Option<Perplexity> {
        if self.count == 0 {
            return None;
        }
        let n = self.count as f64;
        let mean_nll = self.sum / n;
        let ppl = mean_nll.exp();
        let variance = self.sum_squares / n - mean_nll * mean_nll;
        let uncertainty = if variance > 0.0 && self.count > 1 { ppl * (variance / (n - 1.0)).sqrt() } else { 0.0 };
        Some(Perplexity { ppl, uncertainty, mean_nll, tokens: self.count })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tolerance: f64) -> bool {
        (a - b).abs() <= tolerance * b.abs().max(1.0)
    }

    #[test]
    fn uniform_logits_give_the_vocabulary_size() {
        for vocab in [2usize, 7, 256, 49152] {
            let logits = vec![0.25f32; vocab];
            let mut acc = PerplexityAccumulator::new();
            for position in 0..5 {
                let score = PositionScore::new(&logits, (position * 3 % vocab) as u32, position).unwrap();
                assert!(close(score.nll, (vocab as f64).ln(), 1e-14));
                assert_eq!(score.argmax, 0, "ties go to the first token");
                acc.add(score.nll);
            }
            let estimate = acc.estimate().unwrap();
            assert!(close(estimate.ppl, vocab as f64, 1e-12), "{} vs {vocab}", estimate.ppl);
            assert_eq!(estimate.uncertainty, 0.0, "no spread");
            assert_eq!(estimate.tokens, 5);
        }
    }

    #[test]
    fn a_hand_made_three_token_case() {
        // logits ln(1), ln(2), ln(5): probabilities 1/8, 2/8, 5/8.
        let logits = [0.0f32, 2f32.ln(), 5f32.ln()];
        let lp = log_softmax(&logits, 0).unwrap();
        for (got, p) in lp.iter().zip([0.125f64, 0.25, 0.625]) {
            assert!(close(got.exp(), p, 1e-7), "{} vs {p}", got.exp());
        }
        // Targets 2 then 0: NLLs -ln(5/8) and -ln(1/8); ppl = exp(mean) = sqrt(8/5 * 8) = 3.5777...
        let mut acc = PerplexityAccumulator::new();
        for (position, target) in [(0, 2u32), (1, 0)] {
            let score = PositionScore::new(&logits, target, position).unwrap();
            assert_eq!(score.argmax, 2);
            acc.add(score.nll);
        }
        let estimate = acc.estimate().unwrap();
        let (a, b) = (-(0.625f64).ln(), -(0.125f64).ln());
        assert!(close(estimate.ppl, (64.0f64 / 5.0).sqrt(), 1e-7), "{}", estimate.ppl);
        // llama.cpp's uncertainty: ppl * sqrt((mean(x²) - mean(x)²) / (n - 1)), here
        // ppl * |a - b| / 2.
        let expected = estimate.ppl * ((a - b).abs() / 2.0);
        assert!(close(estimate.uncertainty, expected, 1e-7), "{} vs {expected}", estimate.uncertainty);
        assert!(close(estimate.mean_nll, (a + b) / 2.0, 1e-7));
    }

    #[test]
    fn extreme_logits_stay_finite() {
        let logits = [1e30f32, -1e30, 0.0, f32::NEG_INFINITY];
        let lp = log_softmax(&logits, 0).unwrap();
        assert_eq!(lp[0], 0.0);
        assert_eq!(lp[3], f64::NEG_INFINITY);
        assert!(lp[1].is_finite() && lp[2].is_finite());
    }

    #[test]
    fn broken_rows_are_typed_errors() {
        for row in [vec![0.0f32, f32::NAN], vec![f32::INFINITY, 0.0], vec![f32::NEG_INFINITY; 3]] {
            assert!(matches!(PositionScore::new(&row, 0, 7), Err(PerplexityError::NonFiniteLogits { position: 7 })));
        }
        assert!(matches!(
            PositionScore::new(&[0.0, 1.0], 2, 0),
            Err(PerplexityError::TokenOutOfRange { token: 2, vocab_size: 2 })
        ));
        assert!(PerplexityAccumulator::new().estimate().is_none());
    }
}
