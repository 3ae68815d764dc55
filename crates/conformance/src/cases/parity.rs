//! Greedy parity with the reference backend on the same weights.
//!
//! For each fixed prompt the reference generates [`PARITY_STEPS`] greedy tokens with logits; the
//! backend is then fed the same prompt and the reference's tokens (teacher forcing, see
//! [`crate::stream`]) and must predict the reference's token at every step, except where the
//! reference's own top-2 margin is below the precision's epsilon. When the backend returns logits,
//! they are held against the reference's at every step.

use super::{Case, CaseContext};
use crate::oracle::Continuation;
use crate::prompts::PARITY_STEPS;
use crate::report::Figures;
use crate::stream::{compare, Comparison, Expected};
use crate::verdict::{Checked, Verdict};

/// The greedy-parity case.
pub const CASE: Case = Case {
    name: "parity.greedy",
    about: "64 greedy tokens after each fixed prompt equal the reference's, token for token (near-ties excepted); logits within tolerance",
    missing: super::needs_nothing,
    run,
};

fn run(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let capacity = ctx.greedy_session()?.capacity();
    let (lengths, skipped): (Vec<usize>, Vec<usize>) =
        ctx.parity_lengths.iter().partition(|&&len| len + PARITY_STEPS <= capacity);
    if lengths.is_empty() {
        return Ok(Verdict::unsupported(format!(
            "a session holds {capacity} positions, too few for any parity prompt"
        )));
    }
    let mut total = Comparison::default();
    let mut first_divergence_len = None;
    // Every prompt runs, failing or not: which prompts fail ("only the long ones") is itself the
    // diagnosis an accelerator team needs.
    let mut failures: Vec<(usize, Verdict)> = Vec::new();
    for &len in &lengths {
        let prompt = ctx.prompt(len, len as u64);
        let reference = ctx
            .oracle
            .run(ctx.model, ctx.format, &prompt, Continuation::Greedy(PARITY_STEPS))
            .map_err(Verdict::fail)?;
        let mut driver = ctx.forced_driver(&reference.trace.tokens, &format!("prompt of {len} tokens"))?;
        if let Err(mut verdict) = driver.run(&prompt, PARITY_STEPS) {
            verdict.figures.divergent_prompt_len = Some(len);
            failures.push((len, verdict));
            continue;
        }
        let expected =
            Expected { tokens: &reference.trace.tokens, margins: &reference.margins, logits: reference.trace.logits() };
        let comparison = compare(&driver.trace, expected, &ctx.tolerances);
        if let Err(verdict) = comparison.check(&format!("prompt of {len} tokens"), &ctx.tolerances) {
            let figures = Figures { divergent_prompt_len: Some(len), ..comparison.figures() };
            failures.push((len, verdict.with_figures(figures)));
            continue;
        }
        if first_divergence_len.is_none() && comparison.first_divergence.is_some() {
            first_divergence_len = Some(len);
        }
        total.merge(&comparison);
    }
    if let Some((_, first)) = failures.first() {
        let passed: Vec<usize> = lengths.iter().copied().filter(|l| failures.iter().all(|(f, _)| f != l)).collect();
        // The first failure in full, the others by the step where they first went wrong.
        let mut detail = first.detail.clone();
        let others: Vec<String> = failures[1..]
            .iter()
            .map(|(len, v)| match v.figures.first_divergent_step {
                Some(step) => format!("{len} (step {step})"),
                None => len.to_string(),
            })
            .collect();
        if !others.is_empty() {
            detail.push_str(&format!(" | also failing: prompts of {}", others.join(", ")));
        }
        detail.push_str(&format!(
            " | {} of {} prompts failed{}",
            failures.len(),
            lengths.len(),
            if passed.is_empty() { String::new() } else { format!(" (lengths {} passed)", join(&passed)) }
        ));
        return Err(Verdict::fail(detail).with_figures(first.figures.clone()));
    }
    let figures = Figures { divergent_prompt_len: first_divergence_len, ..total.figures() };
    let mut detail = format!(
        "{} prompts (lengths {}), {} steps each{}",
        lengths.len(),
        join(&lengths),
        PARITY_STEPS,
        if ctx.capabilities.logits { ", logits compared" } else { ", tokens only (no logits)" }
    );
    if !skipped.is_empty() {
        detail.push_str(&format!("; lengths {} skipped: a session holds {capacity} positions", join(&skipped)));
    }
    Ok(Verdict::pass(detail).with_figures(figures))
}

fn join(lengths: &[usize]) -> String {
    lengths.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
}
