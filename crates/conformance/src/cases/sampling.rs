//! Sampling on the backend: seeded runs reproduce, and the degenerate settings equal greedy.

use super::{pass_with, Case, CaseContext};
use crate::stream::{Comparison, Driver, Trace};
use crate::verdict::{Checked, Verdict};
use session_api::{Capabilities, SamplingConfig, SessionOptions};

/// The sampling cases, in order.
pub const CASES: [Case; 3] = [
    Case {
        name: "sampling.seeded_reproducible",
        about:
            "two sessions (and a reset one) with the same seed sample the same tokens; sampling is not silently greedy",
        missing: needs_seeded_temperature,
        run: seeded_reproducible,
    },
    Case {
        name: "sampling.temperature_zero_is_greedy",
        about: "temperature 0 (whatever top-k, top-p and seed say) decodes exactly like greedy",
        missing: super::needs_nothing,
        run: temperature_zero_is_greedy,
    },
    Case {
        name: "sampling.top_k_one_is_greedy",
        about: "sampling restricted to the single most likely token equals greedy",
        missing: needs_top_k,
        run: top_k_one_is_greedy,
    },
];

fn needs_seeded_temperature(c: &Capabilities) -> Option<&'static str> {
    if !c.sampling.temperature {
        Some("sampling.temperature")
    } else if !c.sampling.seeded {
        Some("sampling.seeded")
    } else {
        None
    }
}

fn needs_top_k(c: &Capabilities) -> Option<&'static str> {
    needs_seeded_temperature(c).or((!c.sampling.top_k).then_some("sampling.top_k"))
}

const STEPS: usize = 32;

fn sampled_run(ctx: &CaseContext<'_>, sampling: SamplingConfig, prompt: &[u32], label: &str) -> Checked<Driver> {
    let mut driver = Driver::free(ctx.session(SessionOptions { sampling, ..SessionOptions::default() })?, label);
    driver.run(prompt, STEPS)?;
    Ok(driver)
}

fn seeded_reproducible(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let prompt = ctx.prompt(16, 160);
    // A high temperature flattens the distribution, so a sampler that ignores its settings and
    // decodes greedily cannot pass by chance.
    let config = |seed| SamplingConfig::Sample { temperature: 5.0, top_k: 0, top_p: 1.0, seed };
    let mut first = sampled_run(ctx, config(1234), &prompt, "seeded session 1")?;
    let second = sampled_run(ctx, config(1234), &prompt, "seeded session 2")?;
    if let Some(step) = first_difference(&first.trace, &second.trace) {
        return Err(Verdict::fail(format!("two sessions with seed 1234 sampled different tokens from step {step}")));
    }
    first.session.reset();
    let mut again = Driver::free(first.session, "seeded session after reset");
    again.run(&prompt, STEPS)?;
    if let Some(step) = first_difference(&first.trace, &again.trace) {
        return Err(Verdict::fail(format!(
            "after reset the seeded session sampled differently from step {step} (reset must restart the random stream)"
        )));
    }
    let greedy = ctx.baseline(&prompt, STEPS)?;
    let other_seeds =
        [sampled_run(ctx, config(1), &prompt, "seed 1")?, sampled_run(ctx, config(2), &prompt, "seed 2")?];
    let all_greedy = first_difference(&first.trace, &greedy.trace).is_none()
        && other_seeds.iter().all(|d| first_difference(&d.trace, &greedy.trace).is_none());
    if all_greedy {
        return Err(Verdict::fail(
            "three seeds at temperature 5 all produced the greedy stream: the sampling settings seem ignored",
        ));
    }
    Ok(Verdict::pass(format!("seed 1234 reproduced {STEPS} tokens across sessions and after reset")))
}

fn first_difference(a: &Trace, b: &Trace) -> Option<usize> {
    (0..a.tokens.len().max(b.tokens.len())).find(|&i| a.tokens.get(i) != b.tokens.get(i))
}

fn temperature_zero_is_greedy(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let sampling = SamplingConfig::from_settings(Some(0.0), Some(40), Some(0.9), Some(7)).map_err(Verdict::fail)?;
    if sampling != SamplingConfig::Greedy {
        return Err(Verdict::fail(format!("session-api maps temperature 0 to {sampling:?}, not Greedy")));
    }
    equals_greedy(ctx, sampling, "temperature 0")
}

fn top_k_one_is_greedy(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    equals_greedy(ctx, SamplingConfig::Sample { temperature: 1.0, top_k: 1, top_p: 1.0, seed: 9 }, "top-k 1")
}

fn equals_greedy(ctx: &CaseContext<'_>, sampling: SamplingConfig, what: &str) -> Checked<Verdict> {
    let prompt = ctx.prompt(16, 161);
    let greedy = ctx.baseline(&prompt, STEPS)?;
    let mut driver = Driver::forced(
        ctx.session(SessionOptions { sampling, ..SessionOptions::default() })?,
        &greedy.trace.tokens,
        format!("{what} session"),
    );
    driver.run(&prompt, STEPS)?;
    // Logits are not requested here (sampling is the point), so only tokens are compared.
    let comparison: Comparison = ctx.check_against(&greedy, &driver.trace, &format!("{what} vs greedy"))?;
    pass_with(format!("{what} decoded {STEPS} tokens exactly like greedy"), &comparison)
}
