//! Batched decode: sequences decoded together in one `decode_batch` call per step, joining and
//! leaving between steps as a server's continuous batching makes them, each get exactly the
//! tokens they get alone.

use super::{Case, CaseContext};
use crate::verdict::{Checked, OrFail, Verdict};
use session_api::batch::BatchEntry;
use session_api::{CheckedSession, SamplingConfig, Session, SessionOptions};

/// The batched cases.
pub const CASES: [Case; 1] = [Case {
    name: "batch.joins_and_leaves",
    about: "five sequences decoded in batches, joining and leaving between steps (one reusing a finished \
            sequence's session), each give exactly their tokens decoded alone",
    missing: super::needs_nothing,
    run: joins_and_leaves,
}];

/// One sequence of the case: its prompt, the step it joins at, and how many tokens it generates.
struct Plan {
    prompt: Vec<u32>,
    joins_at: usize,
    tokens: usize,
}

/// Each sequence's (prompt length, join step, tokens). Prompt lengths cross the prefill buckets;
/// the join steps put prefills between decode steps of running sequences; the lengths make
/// sequences leave at different steps; the last plan joins after the second has left and takes
/// its session.
const PLANS: [(usize, usize, usize); 5] = [(5, 0, 12), (17, 0, 4), (33, 2, 14), (9, 3, 3), (24, 7, 8)];

/// The most sequences the case decodes in one batch (what a backend's batch graphs must cover
/// for it: `seam compile --conformance-models` compiles no larger ones).
pub const MAX_SEQUENCES: usize = PLANS.len();

fn plans(ctx: &CaseContext<'_>) -> Vec<Plan> {
    PLANS
        .into_iter()
        .enumerate()
        .map(|(i, (len, joins_at, tokens))| Plan { prompt: ctx.prompt(len, 300 + i as u64), joins_at, tokens })
        .collect()
}

fn options() -> SessionOptions {
    SessionOptions { sampling: SamplingConfig::Greedy, return_logits: false, return_hidden_states: false }
}

fn new_session(ctx: &CaseContext<'_>, label: &str) -> Checked<CheckedSession> {
    ctx.engine.new_checked_session(options()).or_fail(|| format!("{label}: new_checked_session"))
}

/// The tokens `plan` gives decoded alone: its prefill's token, then greedy decodes.
fn solo(ctx: &CaseContext<'_>, plan: &Plan, label: &str) -> Checked<Vec<u32>> {
    let mut session = new_session(ctx, label)?;
    let mut tokens = vec![session.prefill(&plan.prompt).or_fail(|| format!("{label}: prefill alone"))?.token];
    while tokens.len() < plan.tokens {
        let last = *tokens.last().expect("one token at least");
        tokens.push(session.decode(last).or_fail(|| format!("{label}: decode alone"))?.token);
    }
    Ok(tokens)
}

/// A sequence in the batched run.
struct Active {
    plan: usize,
    session: CheckedSession,
    tokens: Vec<u32>,
}

fn joins_and_leaves(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let plans = plans(ctx);
    let expected: Vec<Vec<u32>> =
        plans.iter().enumerate().map(|(i, plan)| solo(ctx, plan, &format!("sequence {i}"))).collect::<Checked<_>>()?;

    let mut done: Vec<Option<Vec<u32>>> = vec![None; plans.len()];
    let mut active: Vec<Active> = Vec::new();
    let mut free: Vec<CheckedSession> = Vec::new();
    let (mut step, mut batched_steps, mut largest_batch, mut reused) = (0, 0, 0, 0);
    while done.iter().any(Option::is_none) {
        // Joins: a prefill between decode steps, on a finished sequence's session when one is free.
        for (i, plan) in plans.iter().enumerate() {
            if plan.joins_at != step {
                continue;
            }
            let label = format!("sequence {i}");
            let mut session = match free.pop() {
                Some(mut session) => {
                    session.restart(SamplingConfig::Greedy).or_fail(|| format!("{label}: restart a reused session"))?;
                    reused += 1;
                    session
                }
                None => new_session(ctx, &label)?,
            };
            let first = session.prefill(&plan.prompt).or_fail(|| format!("{label}: prefill joining a batch"))?.token;
            active.push(Active { plan: i, session, tokens: vec![first] });
        }
        // Leaves: sequences with all their tokens give their session back.
        let mut i = 0;
        while i < active.len() {
            if active[i].tokens.len() >= plans[active[i].plan].tokens {
                let finished = active.swap_remove(i);
                done[finished.plan] = Some(finished.tokens);
                free.push(finished.session);
            } else {
                i += 1;
            }
        }
        if !active.is_empty() {
            let mut entries: Vec<BatchEntry<'_>> = active
                .iter_mut()
                .map(|a| BatchEntry { token: *a.tokens.last().expect("prefilled"), session: &mut a.session })
                .collect();
            largest_batch = largest_batch.max(entries.len());
            let results = ctx.engine.decode_batch(&mut entries);
            for (a, result) in active.iter_mut().zip(results) {
                let step_token =
                    result.or_fail(|| format!("sequence {}: decode_batch at its token {}", a.plan, a.tokens.len()))?;
                a.tokens.push(step_token.token);
            }
            batched_steps += 1;
        }
        step += 1;
        if step > 100 {
            return Err(Verdict::fail("suite bug: the batched run did not finish"));
        }
    }

    for (i, (got, want)) in done.iter().zip(&expected).enumerate() {
        let got = got.as_ref().expect("every sequence is done");
        if let Some(at) = got.iter().zip(want).position(|(g, w)| g != w) {
            return Err(Verdict::fail(format!(
                "sequence {i} (prompt of {} tokens, joining at step {}): token {at} is {} in the batch and {} alone",
                plans[i].prompt.len(),
                plans[i].joins_at,
                got[at],
                want[at]
            )));
        }
    }
    if reused == 0 {
        return Err(Verdict::fail("suite bug: no sequence reused a finished sequence's session"));
    }
    let tokens: usize = expected.iter().map(Vec::len).sum();
    let batched = if ctx.capabilities.batched_decode { "one engine call per step" } else { "stepped in turn" };
    Ok(Verdict::pass(format!(
        "{} sequences, {tokens} tokens, {batched_steps} batched steps of up to {largest_batch} ({batched}): \
         every token equals the sequence's own decoded alone",
        plans.len()
    )))
}
