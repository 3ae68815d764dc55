//! Log-probabilities of a position's tokens, from its logits: what a server reports as
//! `logprobs` and what scoring a text needs.
//!
//! Computed in f64: a log-softmax over tens of thousands of f32 logits loses digits in f32.

/// One position's log-probabilities: a token's, and the most likely tokens'.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The token asked about (the one picked, or the one that follows in a text).
    pub token: u32,
    /// `log p(token)`.
    pub logprob: f64,
    /// The most likely tokens with their log-probabilities, most likely first (equal ones in id
    /// order); as many as asked for, or the vocabulary if smaller.
    pub top: Vec<(u32, f64)>,
}

/// `ln(sum(exp(logits)))`, computed stably: the value a logit is reduced by to become a
/// log-probability. No logit may be NaN or +inf and one must be finite; a `-inf` logit is a token
/// ruled out (a session refuses a step that returns anything but finite logits).
pub fn log_normalizer(logits: &[f32]) -> f64 {
    let max = logits.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
    let sum: f64 = logits.iter().map(|&x| (f64::from(x) - max).exp()).sum();
    max + sum.ln()
}

/// The log-probabilities of `token` and of the `top_n` most likely tokens under `logits`.
pub fn token_logprobs(logits: &[f32], token: u32, top_n: usize) -> TokenLogprobs {
    let normalizer = log_normalizer(logits);
    let logprob = |id: u32| f64::from(logits[id as usize]) - normalizer;
    TokenLogprobs {
        token,
        logprob: logits.get(token as usize).map_or(f64::NEG_INFINITY, |_| logprob(token)),
        top: top_ids(logits, top_n).into_iter().map(|id| (id, logprob(id))).collect(),
    }
}

/// The ids of the `n` largest logits, largest first, equal ones in id order: one pass that keeps
/// a sorted list of `n` (a server asks for at most 20 of a vocabulary of tens of thousands).
fn top_ids(logits: &[f32], n: usize) -> Vec<u32> {
    let mut top: Vec<u32> = Vec::with_capacity(n + 1);
    if n == 0 {
        return top;
    }
    for (id, &value) in logits.iter().enumerate() {
        if top.len() == n && value <= logits[top[n - 1] as usize] {
            continue;
        }
        // After the equal ones already kept: they have lower ids.
        let at = top.partition_point(|&kept| logits[kept as usize] >= value);
        top.insert(at, id as u32);
        top.truncate(n);
    }
    top
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_probabilities_sum_to_one_and_rank_the_tokens() {
        let logits = [1.0f32, 3.0, 3.0, -2.0, 0.5];
        let all = token_logprobs(&logits, 3, 10);
        let mass: f64 = all.top.iter().map(|(_, lp)| lp.exp()).sum();
        assert!((mass - 1.0).abs() < 1e-12, "{mass}");
        assert_eq!(all.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2, 0, 4, 3], "ties in id order");
        assert_eq!(all.logprob, all.top[4].1);
        let expected = -2.0 - (1f64.exp() + 2.0 * 3f64.exp() + (-2f64).exp() + 0.5f64.exp()).ln();
        assert!((all.logprob - expected).abs() < 1e-12);
        assert_eq!(token_logprobs(&logits, 0, 2).top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2]);
        assert!(token_logprobs(&logits, 0, 0).top.is_empty());
        // Large logits do not overflow.
        let big = token_logprobs(&[1000.0, 1000.0], 0, 1);
        assert!((big.logprob - 0.5f64.ln()).abs() < 1e-12);
    }
}
