//! Driving a session through a token stream, and comparing two streams with the tie tolerance.
//!
//! Comparisons are *teacher-forced*: the session under test is fed the expected stream's tokens,
//! not its own, and each step's prediction is compared with the expected one. A free-running
//! comparison stops meaning anything after the first (possibly tolerated) divergence; a forced one
//! keeps checking every step, and where the two agree it is exactly the free-running comparison.

use crate::report::Figures;
use crate::tolerance::{LogitError, Tolerances};
use crate::verdict::{Checked, OrFail, Verdict};
use session_api::Session;

/// What a session produced: one token per step (step 0 is the token returned by the last prefill),
/// and the logits of each step when the session returns them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trace {
    /// The token each step returned.
    pub tokens: Vec<u32>,
    /// Each step's logits; empty when the session does not return logits.
    pub logits: Vec<Vec<f32>>,
}

impl Trace {
    fn record(&mut self, output: session_api::StepOutput) {
        self.tokens.push(output.token);
        if let Some(logits) = output.logits {
            self.logits.push(logits);
        }
    }

    /// Logits per step, when every step returned them.
    pub fn logits(&self) -> Option<&[Vec<f32>]> {
        (!self.logits.is_empty() && self.logits.len() == self.tokens.len()).then_some(&self.logits[..])
    }
}

/// Drives one session: prefill, then decode steps that feed either the session's own last token
/// (free-running greedy) or the next token of a forced stream.
pub struct Driver {
    /// The session driven.
    pub session: Box<dyn Session>,
    forced: Option<Vec<u32>>,
    /// What it produced so far.
    pub trace: Trace,
    /// Names the session in failure messages ("session 2", "the fork").
    label: String,
}

impl Driver {
    /// A driver that feeds back the session's own tokens.
    pub fn free(session: Box<dyn Session>, label: impl Into<String>) -> Driver {
        Driver { session, forced: None, trace: Trace::default(), label: label.into() }
    }

    /// A driver that feeds `forced[i]` after step `i`.
    pub fn forced(session: Box<dyn Session>, forced: &[u32], label: impl Into<String>) -> Driver {
        Driver { session, forced: Some(forced.to_vec()), trace: Trace::default(), label: label.into() }
    }

    /// Prefills `tokens`; `record` keeps the returned token as the next step of the trace (pass
    /// false for all but the last chunk of a chunked prefill).
    pub fn prefill(&mut self, tokens: &[u32], record: bool) -> Checked<()> {
        let output = self.session.prefill(tokens).or_fail(|| {
            format!("{}: prefill of {} tokens at position {}", self.label, tokens.len(), self.session.position())
        })?;
        if record {
            self.trace.record(output);
        }
        Ok(())
    }

    /// Prefills `count` positions given as embedding rows (`values`: `count * hidden_size`);
    /// `record` as for [`Driver::prefill`].
    pub fn prefill_embeddings(&mut self, values: &[f32], count: usize, record: bool) -> Checked<()> {
        let output = self.session.prefill_embeddings(values, count).or_fail(|| {
            format!("{}: prefill of {count} embeddings at position {}", self.label, self.session.position())
        })?;
        if record {
            self.trace.record(output);
        }
        Ok(())
    }

    /// Decodes one more step.
    pub fn step(&mut self) -> Checked<()> {
        let done = self.trace.tokens.len();
        let Some(&last) = self.trace.tokens.last() else {
            return Err(Verdict::fail(format!("{}: suite bug: decode before any prefill was recorded", self.label)));
        };
        let token = match &self.forced {
            Some(forced) => *forced.get(done - 1).ok_or_else(|| {
                Verdict::fail(format!("{}: suite bug: forced stream of {} tokens exhausted", self.label, forced.len()))
            })?,
            None => last,
        };
        let output = self.session.decode(token).or_fail(|| format!("{}: decode at step {done}", self.label))?;
        self.trace.record(output);
        Ok(())
    }

    /// Prefills `prompt` and decodes until the trace holds `steps` tokens.
    pub fn run(&mut self, prompt: &[u32], steps: usize) -> Checked<()> {
        self.prefill(prompt, true)?;
        while self.trace.tokens.len() < steps {
            self.step()?;
        }
        Ok(())
    }
}

/// The stream a trace is held against.
#[derive(Debug, Clone, Copy)]
pub struct Expected<'a> {
    /// The expected token of each step.
    pub tokens: &'a [u32],
    /// The reference's top-2 logit margin at each step (decides which divergences are tolerated).
    pub margins: &'a [f32],
    /// The expected logits of each step, when known.
    pub logits: Option<&'a [Vec<f32>]>,
}

/// One step where the tokens differed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Divergence {
    /// The step (0 = the prefill's token).
    pub step: usize,
    /// The token the backend returned.
    pub actual: u32,
    /// The expected token.
    pub expected: u32,
    /// The reference's margin at that step.
    pub margin: f32,
}

/// The outcome of comparing a trace with an expected stream.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Comparison {
    /// Steps compared.
    pub steps: usize,
    /// The first step whose token differed (tolerated or not).
    pub first_divergence: Option<Divergence>,
    /// The first step whose token differed where the margin was not below epsilon.
    pub first_intolerable: Option<Divergence>,
    /// Number of tolerated divergences.
    pub tolerated: usize,
    /// Worst logit error over the steps, when both sides had logits.
    pub logit_error: Option<LogitError>,
    /// The first step whose logits were out of tolerance.
    pub first_logit_excess: Option<usize>,
    /// The step with the largest logit nmse (where the worst error is).
    pub worst_logit_step: Option<usize>,
    /// The first step whose returned token is not the argmax of the backend's own logits, by
    /// more than the margin epsilon: a sampler or selection bug rather than an arithmetic one.
    pub first_not_argmax: Option<NotArgmax>,
}

/// A step whose returned token is not the top of the logits the same step returned.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NotArgmax {
    /// The step.
    pub step: usize,
    /// The token the step returned.
    pub returned: u32,
    /// The token its own logits rank highest.
    pub argmax: u32,
}

/// The highest-ranked token of `logits` and its lead over the runner-up (0 for a tie).
fn top_with_margin(logits: &[f32]) -> Option<(u32, f32)> {
    let mut best: Option<(usize, f32)> = None;
    let mut second = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        match best {
            Some((_, b)) if v <= b => second = second.max(v),
            Some((_, b)) => {
                second = b;
                best = Some((i, v));
            }
            None => best = Some((i, v)),
        }
    }
    best.map(|(i, b)| (i as u32, b - second))
}

/// Compares `actual` with `expected`, step by step.
pub fn compare(actual: &Trace, expected: Expected<'_>, tolerances: &Tolerances) -> Comparison {
    let steps = actual.tokens.len().min(expected.tokens.len());
    let mut comparison = Comparison { steps, ..Comparison::default() };
    for step in 0..steps {
        let (a, e) = (actual.tokens[step], expected.tokens[step]);
        if a == e {
            continue;
        }
        let margin = expected.margins.get(step).copied().unwrap_or(f32::INFINITY);
        let divergence = Divergence { step, actual: a, expected: e, margin };
        comparison.first_divergence.get_or_insert(divergence);
        if margin < tolerances.margin_epsilon {
            comparison.tolerated += 1;
        } else if comparison.first_intolerable.is_none() {
            comparison.first_intolerable = Some(divergence);
        }
    }
    if let (Some(actual_logits), Some(expected_logits)) = (actual.logits(), expected.logits) {
        for (step, (a, e)) in actual_logits.iter().zip(expected_logits).take(steps).enumerate() {
            let error = LogitError::between(a, e);
            if !error.within(tolerances) && comparison.first_logit_excess.is_none() {
                comparison.first_logit_excess = Some(step);
            }
            if comparison.logit_error.is_none_or(|worst| error.nmse > worst.nmse) {
                comparison.worst_logit_step = Some(step);
            }
            comparison.logit_error = Some(comparison.logit_error.map_or(error, |worst| worst.worst(error)));
        }
    }
    if let Some(actual_logits) = actual.logits() {
        for (step, logits) in actual_logits.iter().enumerate().take(steps) {
            let returned = actual.tokens[step];
            if let Some((argmax, margin)) = top_with_margin(logits) {
                // A near-tie may go either way in the backend's own arithmetic.
                let own = logits.get(returned as usize).copied().unwrap_or(f32::NEG_INFINITY);
                if argmax != returned && logits[argmax as usize] - own >= tolerances.margin_epsilon && margin > 0.0 {
                    comparison.first_not_argmax = Some(NotArgmax { step, returned, argmax });
                    break;
                }
            }
        }
    }
    if actual.tokens.len() != expected.tokens.len() && comparison.first_intolerable.is_none() {
        // A stream of the wrong length is a suite or backend bug; never let it pass quietly.
        comparison.first_intolerable =
            Some(Divergence { step: steps, actual: u32::MAX, expected: u32::MAX, margin: f32::INFINITY });
    }
    comparison
}

impl Comparison {
    /// Figures for the report.
    pub fn figures(&self) -> Figures {
        let shown = self.first_intolerable.or(self.first_divergence);
        Figures {
            steps_compared: Some(self.steps),
            first_divergent_step: shown.map(|d| d.step).or(self.first_logit_excess),
            margin_at_divergence: shown.map(|d| d.margin).filter(|m| m.is_finite()),
            tolerated_divergences: Some(self.tolerated),
            logit_nmse: self.logit_error.map(|e| e.nmse),
            logit_max_abs: self.logit_error.map(|e| e.max_abs),
            ..Figures::default()
        }
    }

    /// `Err(failing verdict)` when a token differed beyond tolerance or the logits are out of
    /// tolerance; `what` says what was compared ("prompt of 17 tokens").
    pub fn check(&self, what: &str, tolerances: &Tolerances) -> Checked<()> {
        if let Some(n) = self.first_not_argmax {
            return Err(Verdict::fail(format!(
                "{what}: step {} returned token {} but its own logits rank {} highest (a token-selection bug, not \
                 arithmetic){}",
                n.step,
                n.returned,
                n.argmax,
                self.logit_summary(tolerances)
            ))
            .with_figures(self.figures()));
        }
        if let Some(d) = self.first_intolerable {
            let detail = if d.actual == u32::MAX {
                format!("{what}: the stream ended after {} of the expected steps", d.step)
            } else {
                format!(
                    "{what}: step {} gave token {} where {} was expected (reference margin {:.3e} ≥ epsilon {:.1e}){}",
                    d.step,
                    d.actual,
                    d.expected,
                    d.margin,
                    tolerances.margin_epsilon,
                    self.logit_summary(tolerances)
                )
            };
            return Err(Verdict::fail(detail).with_figures(self.figures()));
        }
        if let Some(e) = self.logit_error {
            if !e.within(tolerances) {
                return Err(Verdict::fail(format!(
                    "{what}: logits out of tolerance from step {}: worst nmse {:.2e} at step {} (max {:.0e}), max|Δ| {:.2e} (max {:.0e})",
                    self.first_logit_excess.unwrap_or(0),
                    e.nmse,
                    self.worst_logit_step.unwrap_or(0),
                    tolerances.max_nmse,
                    e.max_abs,
                    tolerances.max_abs
                ))
                .with_figures(self.figures()));
            }
        }
        Ok(())
    }

    /// `; logits out of tolerance from step N (worst nmse X at step M)`, or `; logits within
    /// tolerance`, or nothing without logits: where the arithmetic left the reference, which is
    /// usually well before the first token that differs.
    fn logit_summary(&self, tolerances: &Tolerances) -> String {
        match (self.logit_error, self.first_logit_excess) {
            (Some(e), Some(first)) => format!(
                "; logits out of tolerance from step {first} (worst nmse {:.2e} at step {}, max|Δ| {:.2e}; max nmse {:.0e})",
                e.nmse,
                self.worst_logit_step.unwrap_or(first),
                e.max_abs,
                tolerances.max_nmse
            ),
            (Some(e), None) => format!("; logits within tolerance (worst nmse {:.2e})", e.nmse),
            _ => String::new(),
        }
    }

    /// Folds another comparison into a running total (worst figures, earliest divergence kept).
    pub fn merge(&mut self, other: &Comparison) {
        self.steps += other.steps;
        self.tolerated += other.tolerated;
        if self.first_divergence.is_none() {
            self.first_divergence = other.first_divergence;
        }
        if self.first_intolerable.is_none() {
            self.first_intolerable = other.first_intolerable;
        }
        if self.first_logit_excess.is_none() {
            self.first_logit_excess = other.first_logit_excess;
        }
        if self.first_not_argmax.is_none() {
            self.first_not_argmax = other.first_not_argmax;
        }
        if other.logit_error.is_some_and(|o| self.logit_error.is_none_or(|s| o.nmse > s.nmse)) {
            self.worst_logit_step = other.worst_logit_step;
        }
        self.logit_error = match (self.logit_error, other.logit_error) {
            (Some(a), Some(b)) => Some(a.worst(b)),
            (a, b) => a.or(b),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tolerance::ComputePrecision;

    fn trace(tokens: &[u32]) -> Trace {
        Trace { tokens: tokens.to_vec(), logits: vec![] }
    }

    #[test]
    fn divergence_is_tolerated_only_near_a_tie() {
        let tol = ComputePrecision::F32.tolerances();
        let margins = [1.0, 1e-4, 1.0, 1.0];
        let expected = Expected { tokens: &[1, 2, 3, 4], margins: &margins, logits: None };
        let near_tie = compare(&trace(&[1, 9, 3, 4]), expected, &tol);
        assert_eq!(near_tie.tolerated, 1);
        assert_eq!(near_tie.first_divergence.unwrap().step, 1);
        assert!(near_tie.check("x", &tol).is_ok());

        let real = compare(&trace(&[1, 2, 9, 4]), expected, &tol);
        let verdict = real.check("prompt", &tol).unwrap_err();
        assert_eq!(verdict.figures.first_divergent_step, Some(2));
        assert!(verdict.detail.contains("step 2"), "{}", verdict.detail);
    }

    #[test]
    fn short_streams_and_bad_logits_fail() {
        let tol = ComputePrecision::F32.tolerances();
        let expected = Expected { tokens: &[1, 2, 3], margins: &[1.0; 3], logits: None };
        assert!(compare(&trace(&[1, 2]), expected, &tol).check("x", &tol).is_err());

        let reference = vec![vec![1.0, 2.0], vec![3.0, 1.0]];
        let actual = Trace { tokens: vec![1, 0], logits: vec![vec![1.0, 2.0], vec![3.0, 2.9]] };
        let expected = Expected { tokens: &[1, 0], margins: &[1.0, 2.0], logits: Some(&reference) };
        let c = compare(&actual, expected, &tol);
        assert!(c.logit_error.unwrap().max_abs > 1.0);
        assert_eq!(c.first_logit_excess, Some(1));
        assert!(c.check("x", &tol).is_err());
    }
}
