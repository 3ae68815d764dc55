//! Layer by layer: the hidden state after every decoder layer against the reference's.
//!
//! For a backend that claims [`session_api::Capabilities::hidden_states`], the reference and the
//! backend are fed the same prompt and then the same tokens (the reference's greedy picks), and
//! the last position's hidden state after each layer is compared at every step. A failure names
//! the first step and, within it, the first layer whose state left tolerance: where to look in a
//! backend's kernels, instead of only "the logits differ at step 21".

use super::{Case, CaseContext};
use crate::tolerance::LogitError;
use crate::verdict::{Checked, OrFail, Verdict};
use session_api::{SessionOptions, StepOutput};

/// The case.
pub const CASE: Case = Case {
    name: "parity.layers",
    about: "the hidden state after every decoder layer equals the reference's at every step; a failure names the first layer and step out of tolerance",
    missing: |caps| (!caps.hidden_states).then_some("per-layer hidden states"),
    run,
};

/// Prompt length.
const PROMPT: usize = 17;
/// Decode steps after the prefill (enough to pass the point where a cache bug usually shows).
const STEPS: usize = 16;

/// Where a hidden state is, and how far it is from the reference's.
#[derive(Debug, Clone, Copy)]
struct Point {
    step: usize,
    layer: usize,
    nmse: f64,
}

fn run(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let options = SessionOptions { return_hidden_states: true, ..SessionOptions::default() };
    let reference = ctx.oracle.engine(ctx.model, ctx.format).map_err(Verdict::fail)?;
    let mut expected = reference.new_session(options.clone()).or_fail(|| "the reference's session".to_string())?;
    let mut actual = ctx.session(options)?;
    let prompt = ctx.prompt(PROMPT, 17);

    let mut worst: Option<Point> = None;
    let mut first_bad: Option<Point> = None;
    let mut layers_seen = 0;
    let mut compare = |step: usize, a: &StepOutput, e: &StepOutput| -> Checked<()> {
        let (Some(a), Some(e)) = (&a.hidden_states, &e.hidden_states) else {
            return Err(Verdict::fail(format!("step {step}: no hidden states returned")));
        };
        if a.len() != e.len() {
            return Err(Verdict::fail(format!(
                "step {step}: {} layers' hidden states, the reference has {}",
                a.len(),
                e.len()
            )));
        }
        layers_seen = a.len();
        for (layer, (a, e)) in a.iter().zip(e).enumerate() {
            let nmse = LogitError::between(a, e).nmse;
            let point = Point { step, layer, nmse };
            if worst.is_none_or(|w| nmse > w.nmse) {
                worst = Some(point);
            }
            if nmse > ctx.tolerances.max_nmse && first_bad.is_none() {
                first_bad = Some(point);
            }
        }
        Ok(())
    };
    let e = expected.prefill(&prompt).or_fail(|| "the reference's prefill".to_string())?;
    let a = actual.prefill(&prompt).or_fail(|| format!("prefill of {PROMPT} tokens"))?;
    compare(0, &a, &e)?;
    let mut token = e.token;
    for step in 1..=STEPS {
        let e = expected.decode(token).or_fail(|| format!("the reference's decode step {step}"))?;
        let a = actual.decode(token).or_fail(|| format!("decode step {step}"))?;
        compare(step, &a, &e)?;
        token = e.token;
    }
    let worst = worst.expect("at least one step compared");
    let scope = format!("{layers_seen} layers x {} steps (prompt of {PROMPT} tokens)", STEPS + 1);
    match first_bad {
        Some(bad) => Ok(Verdict::fail(format!(
            "{scope}: the hidden state first left tolerance at step {}, layer {} (nmse {:.2e}, max {:.0e}); \
             worst nmse {:.2e} at step {}, layer {}",
            bad.step, bad.layer, bad.nmse, ctx.tolerances.max_nmse, worst.nmse, worst.step, worst.layer
        ))),
        None => Ok(Verdict::pass(format!(
            "{scope}: every layer within tolerance, worst nmse {:.2e} at step {}, layer {}",
            worst.nmse, worst.step, worst.layer
        ))),
    }
}
