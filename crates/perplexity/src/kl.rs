//! KL divergence of a run against a saved base run, position by position.
//!
//! At each scored position the base's distribution is known only through its top k tokens and the
//! total mass of the rest ([`TopKDistribution`]), so both distributions are compared on those
//! `k + 1` buckets:
//!
//! `KL(base ‖ run) = Σ_{i in top k} p_base(i) · (ln p_base(i) − ln p_run(i)) + P_base(rest) · (ln P_base(rest) − ln P_run(rest))`
//!
//! where `P_run(rest)` is the run's probability of every token outside the base's top k
//! (`1 − Σ_{i in top k} p_run(i)`, summed over the other tokens; see
//! [`crate::logits_file::log_rest_mass`]). Grouping tokens can only lower a KL divergence, so this
//! is a lower bound of the full-vocabulary KL that llama.cpp reports, tight when the top k hold
//! nearly all the mass. A run compared with its own saved logits gives exactly 0.

use crate::error::{PerplexityError, Result};
use crate::logits_file::{log_rest_mass, TopKDistribution};
use crate::score::{PerplexityAccumulator, PositionScore};

/// `ln` of the smallest positive normal f64: what a run's log-probability of `-inf` (a token or
/// remainder it rules out, or whose probability underflows) counts as where the base's is not 0,
/// so that one position's KL is large rather than infinite.
const LN_MIN_POSITIVE: f64 = -708.3964185322641;

fn floored(log_prob: f64) -> f64 {
    if log_prob == f64::NEG_INFINITY {
        LN_MIN_POSITIVE
    } else {
        log_prob
    }
}

/// `KL(base ‖ run)` in nats over the base's top k and the remainder bucket; `run_log_probs` is the
/// run's log-softmax over the whole vocabulary.
pub fn kl_divergence(base: &TopKDistribution, run_log_probs: &[f64]) -> f64 {
    let mut kl = 0.0;
    for (&id, &lp_base) in base.ids.iter().zip(&base.log_probs) {
        let p_base = lp_base.exp();
        if p_base > 0.0 {
            kl += p_base * (lp_base - floored(run_log_probs[id as usize]));
        }
    }
    let p_rest = base.log_rest.exp();
    if p_rest > 0.0 {
        let run_rest = floored(log_rest_mass(run_log_probs, &base.ids));
        kl += p_rest * (base.log_rest - run_rest);
    }
    kl
}

/// The comparison of a run with its base, as plain figures.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct KlSummary {
    /// Positions compared.
    pub positions: usize,
    /// Mean KL(base ‖ run), nats.
    pub mean_kl: f64,
    /// 99th percentile of the per-position KL (linear interpolation between the two nearest
    /// ranks, as `llama-perplexity` computes its percentiles).
    pub p99_kl: f64,
    /// The largest per-position KL.
    pub max_kl: f64,
    /// Fraction of positions where the run's most likely token is the base's.
    pub top1_agreement: f64,
    /// The base's perplexity over the same positions (from its saved target log-probabilities).
    pub ppl_base: f64,
    /// This run's perplexity.
    pub ppl_run: f64,
    /// `ppl_run / ppl_base` (`exp(mean NLL_run − mean NLL_base)`).
    pub ppl_ratio: f64,
}

/// Accumulates the comparison position by position.
#[derive(Debug, Clone, Default)]
pub struct KlAccumulator {
    kl_values: Vec<f64>,
    same_top: usize,
    run: PerplexityAccumulator,
    base: PerplexityAccumulator,
}

impl KlAccumulator {
    /// Nothing compared yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Compares one scored position of the run with the base's saved distribution there (the
    /// caller pairs them: same evaluation, checked by [`crate::BaseLogits::check_compatible`]). A
    /// base token outside the run's vocabulary is refused. Returns the position's KL.
    pub fn add(&mut self, base: &TopKDistribution, run: &PositionScore) -> Result<f64> {
        if let Some(&token) = base.ids.iter().find(|&&id| id as usize >= run.log_probs.len()) {
            return Err(PerplexityError::TokenOutOfRange { token, vocab_size: run.log_probs.len() });
        }
        let kl = kl_divergence(base, &run.log_probs);
        self.kl_values.push(kl);
        if base.top1() == run.argmax {
            self.same_top += 1;
        }
        self.run.add(run.nll);
        self.base.add(-base.target_log_prob);
        Ok(kl)
    }

    /// Positions compared so far.
    pub fn count(&self) -> usize {
        self.kl_values.len()
    }

    /// The figures so far (`None` before the first position).
    pub fn summary(&self) -> Option<KlSummary> {
        let (run, base) = (self.run.estimate()?, self.base.estimate()?);
        let n = self.kl_values.len();
        let mut sorted = self.kl_values.clone();
        sorted.sort_by(f64::total_cmp);
        Some(KlSummary {
            positions: n,
            mean_kl: self.kl_values.iter().sum::<f64>() / n as f64,
            p99_kl: percentile(&sorted, 0.99),
            max_kl: sorted[n - 1],
            top1_agreement: self.same_top as f64 / n as f64,
            ppl_base: base.ppl,
            ppl_run: run.ppl,
            ppl_ratio: (run.mean_nll - base.mean_nll).exp(),
        })
    }
}

/// The `fraction` percentile of ascending `sorted` values, interpolated linearly between the
/// values at ranks `floor(f · (n−1))` and the next (llama-perplexity's `percentile`).
pub fn percentile(sorted: &[f64], fraction: f64) -> f64 {
    let n = sorted.len();
    if fraction <= 0.0 {
        return sorted[0];
    }
    if fraction >= 1.0 {
        return sorted[n - 1];
    }
    let rank = fraction * (n - 1) as f64;
    let below = rank.floor() as usize;
    let weight = rank - below as f64;
    (1.0 - weight) * sorted[below] + weight * sorted[(below + 1).min(n - 1)]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn score(logits: &[f32], target: u32) -> PositionScore {
        PositionScore::new(logits, target, 0).unwrap()
    }

    #[test]
    fn a_distribution_against_itself_is_zero() {
        let rows: [&[f32]; 3] =
            [&[0.1, 2.0, -3.0, 2.0, 0.7, 5.5, -0.2], &[0.0; 7], &[40.0, -40.0, 0.0, 1.0, 2.0, 3.0, 4.0]];
        for k in [1, 2, 3, 7, 32] {
            let mut acc = KlAccumulator::new();
            for (i, row) in rows.iter().enumerate() {
                let s = score(row, i as u32);
                let base = TopKDistribution::from_score(&s, k);
                assert_eq!(acc.add(&base, &s).unwrap(), 0.0, "k {k}, row {i}");
            }
            let summary = acc.summary().unwrap();
            assert_eq!((summary.mean_kl, summary.p99_kl, summary.max_kl), (0.0, 0.0, 0.0));
            assert_eq!(summary.top1_agreement, 1.0);
            assert_eq!(summary.ppl_ratio, 1.0);
            assert_eq!(summary.ppl_base, summary.ppl_run);
        }
    }

    #[test]
    fn a_known_pair_against_a_hand_computed_value() {
        // Base probabilities (0.5, 0.25, 0.125, 0.125), run (0.25, 0.25, 0.25, 0.25).
        // Logits ln 4, ln 2, ln 1, ln 1 and all equal.
        let base = score(&[4f32.ln(), 2f32.ln(), 0.0, 0.0], 0);
        let run = score(&[0.0; 4], 0);
        // Full vocabulary (k = 4): Σ p ln(p/q) = 0.5 ln 2 + 0 + 2 · 0.125 ln 0.5 = 0.25 ln 2.
        let full = TopKDistribution::from_score(&base, 4);
        assert!((kl_divergence(&full, &run.log_probs) - 0.25 * 2f64.ln()).abs() < 1e-7);
        // k = 1: buckets {0} and rest: base (0.5, 0.5), run (0.25, 0.75):
        // 0.5 ln 2 + 0.5 ln(0.5 / 0.75).
        let top1 = TopKDistribution::from_score(&base, 1);
        let expected = 0.5 * 2f64.ln() + 0.5 * (0.5f64 / 0.75).ln();
        assert!((kl_divergence(&top1, &run.log_probs) - expected).abs() < 1e-7);
        // Grouping lowers KL.
        assert!(expected < 0.25 * 2f64.ln());

        let mut acc = KlAccumulator::new();
        acc.add(&full, &run).unwrap();
        let summary = acc.summary().unwrap();
        // The run's argmax (ties: token 0) is the base's top token.
        assert_eq!(summary.top1_agreement, 1.0);
        // Target 0: base NLL ln 2, run NLL ln 4: ratio 2.
        assert!((summary.ppl_ratio - 2.0).abs() < 1e-6);
        assert!((summary.ppl_base - 2.0).abs() < 1e-6 && (summary.ppl_run - 4.0).abs() < 1e-6);
    }

    #[test]
    fn disagreement_and_percentiles() {
        let base = score(&[5.0, 0.0, 0.0], 0);
        let run = score(&[0.0, 5.0, 0.0], 0);
        let mut acc = KlAccumulator::new();
        let d = TopKDistribution::from_score(&base, 2);
        let same = acc.add(&d, &base).unwrap();
        let different = acc.add(&d, &run).unwrap();
        assert_eq!(same, 0.0);
        assert!(different > 1.0);
        let summary = acc.summary().unwrap();
        assert_eq!(summary.top1_agreement, 0.5);
        assert_eq!(summary.max_kl, different);
        // Two values: p99 = 0.01 · 0 + 0.99 · different.
        assert!((summary.p99_kl - 0.99 * different).abs() < 1e-12);
        assert!((summary.mean_kl - different / 2.0).abs() < 1e-12);

        let values: Vec<f64> = (0..=100).map(f64::from).collect();
        assert_eq!(percentile(&values, 0.99), 99.0);
        assert_eq!(percentile(&values, 0.5), 50.0);
        assert_eq!(percentile(&[1.0, 2.0], 0.25), 1.25);
        assert_eq!(percentile(&[3.0], 0.99), 3.0);
        assert!(KlAccumulator::new().summary().is_none());
    }

    #[test]
    fn a_run_that_rules_out_the_base_stays_finite() {
        let base = score(&[0.0, 0.0, 0.0, 0.0], 0);
        let run = score(&[0.0, f32::NEG_INFINITY, f32::NEG_INFINITY, f32::NEG_INFINITY], 0);
        let kl = kl_divergence(&TopKDistribution::from_score(&base, 2), &run.log_probs);
        assert!(kl.is_finite() && kl > 100.0, "{kl}");
    }
}
