//! Scoring a text ([`session_api::Session::prefill_scored`]): one prefill that returns every
//! position's logits, as perplexity and a server's echoed prompt scores use it.

use super::{pass_with, Case, CaseContext};
use crate::stream::Trace;
use crate::verdict::{Checked, OrFail, Verdict};
use session_api::sampling::argmax;
use session_api::Capabilities;

/// The scoring case.
pub const CASE: Case = Case {
    name: "input.scored_prefill",
    about: "one prefill returning every position's logits gives, past the prompt, the reference's logits of each greedy step",
    missing: needs_logits,
    run,
};

/// Greedy steps of the reference the scored text holds (prompt and steps together span several
/// prefill calls on the graph backends' buckets).
const STEPS: usize = 24;

fn needs_logits(c: &Capabilities) -> Option<&'static str> {
    (!c.logits).then_some("returning logits")
}

fn run(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let prompt = ctx.prompt(10, 162);
    let baseline = ctx.baseline(&prompt, STEPS)?;
    // The prompt and the reference's continuation but its last token: position `prompt.len() - 1
    // + k` predicts the reference's step `k`.
    let mut text = prompt.clone();
    text.extend_from_slice(&baseline.trace.tokens[..STEPS - 1]);
    let mut session = ctx.greedy_session()?;
    let scored = session.prefill_scored(&text).or_fail(|| format!("prefill_scored of {} tokens", text.len()))?;
    let vocab = ctx.vocab_size();
    if scored.logits.len() != text.len() * vocab {
        return Err(Verdict::fail(format!(
            "prefill_scored of {} tokens returned {} logits, expected {}",
            text.len(),
            scored.logits.len(),
            text.len() * vocab
        )));
    }
    let rows: Vec<Vec<f32>> = scored.logits.chunks(vocab).skip(prompt.len() - 1).map(<[f32]>::to_vec).collect();
    let trace = Trace { tokens: rows.iter().map(|row| argmax(row)).collect(), logits: rows };
    let comparison = ctx.check_against(&baseline, &trace, "every position's logits of one scored prefill")?;
    check_token(scored.output.token, &trace.logits[STEPS - 1], text.len())?;
    // The token a scored prefill returns is its last row's (greedy continuations of the tiny
    // models repeat themselves, so rows next to each other often share their argmax; random
    // prompts' last rows do not).
    for (len, salt) in [(5, 163), (20, 164)] {
        let text = ctx.prompt(len, salt);
        let mut session = ctx.greedy_session()?;
        let scored = session.prefill_scored(&text).or_fail(|| format!("prefill_scored of {len} tokens"))?;
        check_token(scored.output.token, &scored.logits[(len - 1) * vocab..], len)?;
    }
    pass_with(
        format!("{} positions scored in one call; the last {STEPS} rows match the reference's steps", text.len()),
        &comparison,
    )
}

/// Fails unless `token`, what a scored prefill of `len` tokens returned, is its last row's argmax.
fn check_token(token: u32, last_row: &[f32], len: usize) -> Checked<()> {
    let best = argmax(last_row);
    if token != best {
        return Err(Verdict::fail(format!(
            "prefill_scored of {len} tokens returned token {token} but its last row's largest logit is token {best}"
        )));
    }
    Ok(())
}
