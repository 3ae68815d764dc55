//! Self-consistency: the backend held against its own results, at the tight
//! [`crate::tolerance::ComputePrecision::self_consistency_tolerances`] (or its custom profile's
//! `self_consistency` set).
//!
//! Every other case compares with the reference, at thresholds loose enough for a backend that
//! computes in f16 or bf16. Those thresholds also let a real bug through: one corrupted KV cache
//! row moves a tiny model's logits by less than the bf16 preset allows, so most parity rows pass.
//! Here the expected values are the backend's own, from its plainest path (one prefill of the
//! prompt, then greedy decode of its own tokens), and every other way of reaching the same
//! sequence state must give the same logits up to what rounding the same arithmetic differently
//! can explain: prefill and decode graphs, cache rows written by one or the other, truncated and
//! rewritten rows, forked caches.

use super::{Case, CaseContext};
use crate::report::Figures;
use crate::stream::{compare, Comparison, Driver, Expected, Trace};
use crate::tolerance::top2_margin;
use crate::verdict::{Checked, OrFail, Verdict};
use session_api::Capabilities;

/// The name prefix of these cases (how the report tells their tolerance set apart).
pub const GROUP: &str = "self.";

/// The self-consistency cases, in order.
pub const CASES: [Case; 3] = [
    Case {
        name: "self.decode_equals_prefill",
        about: "the backend's own logits agree, at its tight self-consistency tolerance, between prefill+decode, one token at a time, chunked prefill and whole-sequence prefills",
        missing: needs_logits,
        run: decode_equals_prefill,
    },
    Case {
        name: "self.truncate_replay",
        about: "truncating into the generated tokens or into the prompt and feeding the same tokens again reproduces the backend's own logits",
        missing: needs_truncate,
        run: truncate_replay,
    },
    Case {
        name: "self.fork_replay",
        about: "a fork and its parent, stepped alternately on different tokens, each reproduce the backend's own logits for their sequence",
        missing: needs_fork,
        run: fork_replay,
    },
];

/// The comparison needs the backend's logits: its own top-2 margins say which token flips are
/// near-ties, and its logits are what is compared. Token-only, a correct f16 backend could fail
/// on a near-tie that prefill and decode round differently.
fn needs_logits(c: &Capabilities) -> Option<&'static str> {
    (!c.logits).then_some("logits")
}

fn needs_truncate(c: &Capabilities) -> Option<&'static str> {
    needs_logits(c).or((!c.kv_ops.truncate).then_some("kv_ops.truncate"))
}

fn needs_fork(c: &Capabilities) -> Option<&'static str> {
    needs_logits(c).or((!c.kv_ops.fork).then_some("kv_ops.fork"))
}

/// Prompt length: past the 16-token prefill bucket a compiler backend is likely to have.
const PROMPT: usize = 24;
/// Steps of every run (step 0 is the prefill's token). Long enough that a decode-side bug after
/// the first few steps shows.
const STEPS: usize = 16;

/// The backend's plainest run of a prompt: what every other path is held to.
struct OwnRun {
    trace: Trace,
    margins: Vec<f32>,
}

impl OwnRun {
    /// Steps `from..to` as the expected stream.
    fn expected(&self, from: usize, to: usize) -> Expected<'_> {
        Expected {
            tokens: &self.trace.tokens[from..to],
            margins: &self.margins[from..to],
            logits: self.trace.logits().map(|l| &l[from..to]),
        }
    }
}

/// One prefill of `prompt`, then free-running greedy decode of the backend's own tokens.
fn plain_run(ctx: &CaseContext<'_>, prompt: &[u32], label: &str) -> Checked<OwnRun> {
    let mut driver = Driver::free(ctx.greedy_session()?, label);
    driver.run(prompt, STEPS)?;
    let Some(logits) = driver.trace.logits() else {
        return Err(Verdict::fail(format!("{label}: no logits returned although the backend claims them")));
    };
    let margins = logits.iter().map(|l| top2_margin(l)).collect();
    Ok(OwnRun { trace: driver.trace, margins })
}

/// Compares steps `from..` of `actual` (whose step 0 is the plain run's step `from`) with the plain
/// run at the self-consistency tolerance, reporting steps of the plain run.
fn check_own(ctx: &CaseContext<'_>, plain: &OwnRun, actual: &Trace, from: usize, what: &str) -> Checked<Comparison> {
    let to = (from + actual.tokens.len()).min(plain.trace.tokens.len());
    let mut comparison = compare(actual, plain.expected(from, to), &ctx.self_tolerances);
    for d in [&mut comparison.first_divergence, &mut comparison.first_intolerable].into_iter().flatten() {
        d.step += from;
    }
    for step in [&mut comparison.first_logit_excess, &mut comparison.worst_logit_step].into_iter().flatten() {
        *step += from;
    }
    if let Some(n) = &mut comparison.first_not_argmax {
        n.step += from;
    }
    comparison.check(what, &ctx.self_tolerances).map_err(|mut verdict| {
        // The margin that decides a tolerated flip is the backend's own here.
        verdict.detail = verdict.detail.replace("reference margin", "own margin");
        verdict
    })?;
    Ok(comparison)
}

/// The figures of a passing comparison, and where its worst error was.
fn pass(detail: String, total: &Comparison) -> Checked<Verdict> {
    let worst = match (total.logit_error, total.worst_logit_step) {
        (Some(e), Some(step)) => format!("; worst nmse {:.2e} (step {step}), max|Δ| {:.2e}", e.nmse, e.max_abs),
        _ => String::new(),
    };
    Ok(Verdict::pass(format!("{detail}{worst}")).with_figures(Figures { ..total.figures() }))
}

fn decode_equals_prefill(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let prompt = ctx.prompt(PROMPT, 140);
    let plain = plain_run(ctx, &prompt, "prefill+decode session")?;
    let tokens = &plain.trace.tokens;

    // Whole-sequence prefills first: every row written by the prefill graph and no decode, so
    // the first k whose prediction differs is the first decode step whose cache went wrong.
    let mut total = Comparison::default();
    for k in 1..STEPS {
        let sequence: Vec<u32> = prompt.iter().chain(&tokens[..k]).copied().collect();
        let mut whole = Driver::free(ctx.greedy_session()?, format!("whole-sequence prefill of {}", sequence.len()));
        whole.prefill(&sequence, true)?;
        let what = format!("prefilling the prompt and the first {k} generated tokens at once vs decoding them");
        total.merge(&check_own(ctx, &plain, &whole.trace, k, &what)?);
    }

    // One token at a time: a prefill of one token, then the rest of the prompt through decode, so
    // every cache row is written by the decode graph.
    let mut stepped = Driver::forced(ctx.greedy_session()?, tokens, "token-by-token session");
    stepped.prefill(&prompt[..1], false)?;
    for (i, &token) in prompt.iter().enumerate().skip(1) {
        let out = stepped
            .session
            .decode(token)
            .or_fail(|| format!("token-by-token session: decode of prompt token {i} of {PROMPT}"))?;
        if i == PROMPT - 1 {
            stepped.trace.tokens.push(out.token);
            stepped.trace.logits.extend(out.logits);
        }
    }
    while stepped.trace.tokens.len() < STEPS {
        stepped.step()?;
    }
    total.merge(&check_own(ctx, &plain, &stepped.trace, 0, "the prompt decoded one token at a time vs prefilled")?);

    // Chunks that straddle a 16-token bucket, then decode.
    let mut chunked = Driver::forced(ctx.greedy_session()?, tokens, "chunked session");
    let chunks = [1usize, 7, 16];
    let mut start = 0;
    for (i, &len) in chunks.iter().enumerate() {
        chunked.prefill(&prompt[start..start + len], i == chunks.len() - 1)?;
        start += len;
    }
    while chunked.trace.tokens.len() < STEPS {
        chunked.step()?;
    }
    total.merge(&check_own(ctx, &plain, &chunked.trace, 0, "the prompt prefilled as 1 + 7 + 16 tokens vs at once")?);

    pass(
        format!(
            "whole-sequence prefills (steps 1 to {}), token-by-token and chunked prefills reproduce prefill+decode",
            STEPS - 1
        ),
        &total,
    )
}

fn truncate_replay(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let prompt = ctx.prompt(PROMPT, 141);
    let mut driver = Driver::free(ctx.greedy_session()?, "session");
    driver.run(&prompt, STEPS)?;
    let Some(logits) = driver.trace.logits() else {
        return Err(Verdict::fail("no logits returned although the backend claims them"));
    };
    let plain = OwnRun { margins: logits.iter().map(|l| top2_margin(l)).collect(), trace: driver.trace.clone() };
    let tokens = &plain.trace.tokens;
    let mut session = driver.session;
    let mut total = Comparison::default();

    // Into the generated tokens: keep the prompt and the first KEEP generated tokens, then feed the
    // same tokens again; the rewritten rows must give what the first writing gave.
    const KEEP: usize = 3;
    let position = session.position();
    session.truncate(PROMPT + KEEP).or_fail(|| format!("truncate({}) at position {position}", PROMPT + KEEP))?;
    let mut replay = Trace::default();
    for step in KEEP + 1..STEPS {
        let out = session.decode(tokens[step - 1]).or_fail(|| format!("decode at step {step} after truncate"))?;
        replay.tokens.push(out.token);
        replay.logits.extend(out.logits);
    }
    let what = format!("truncate({}) from position {position}, then the same tokens again", PROMPT + KEEP);
    total.merge(&check_own(ctx, &plain, &replay, KEEP + 1, &what)?);

    // Into the prompt: the prompt's last rows are then written by decode instead of prefill.
    const INTO_PROMPT: usize = PROMPT - 6;
    let position = session.position();
    session.truncate(INTO_PROMPT).or_fail(|| format!("truncate({INTO_PROMPT}) at position {position}"))?;
    let mut replay = Trace::default();
    let refed: Vec<u32> = prompt[INTO_PROMPT..].iter().chain(&tokens[..STEPS - 1]).copied().collect();
    for (i, &token) in refed.iter().enumerate() {
        let out = session
            .decode(token)
            .or_fail(|| format!("decode at position {} after truncate({INTO_PROMPT})", INTO_PROMPT + i))?;
        if INTO_PROMPT + i + 1 >= PROMPT {
            replay.tokens.push(out.token);
            replay.logits.extend(out.logits);
        }
    }
    let what = format!("truncate({INTO_PROMPT}) into the prompt, then its last tokens and the generated ones decoded");
    total.merge(&check_own(ctx, &plain, &replay, 0, &what)?);
    pass(format!("truncate({}) and truncate({INTO_PROMPT}) replays reproduce the first run", PROMPT + KEEP), &total)
}

fn fork_replay(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let prompt = ctx.prompt(PROMPT, 142);
    const SHARED: usize = 5;
    let plain = plain_run(ctx, &prompt, "unforked session")?;
    let tokens = &plain.trace.tokens;

    // The fork takes another token than the parent's next one, so the two write different rows
    // from there on: a fork sharing cache memory with its parent shows in both.
    let parent_next = tokens[SHARED - 1];
    let other = if parent_next as usize + 1 < ctx.vocab_size() { parent_next + 1 } else { parent_next - 1 };
    let child_prompt: Vec<u32> = prompt.iter().chain(&tokens[..SHARED - 1]).chain([&other]).copied().collect();
    let child_plain = plain_run(ctx, &child_prompt, "the fork's sequence in a fresh session")?;

    let mut parent = Driver::forced(ctx.greedy_session()?, tokens, "parent");
    parent.run(&prompt, SHARED)?;
    let child_session = parent.session.fork().or_fail(|| format!("fork at position {}", parent.session.position()))?;
    let mut child = Driver::forced(child_session, &child_plain.trace.tokens, "fork");
    let out = child.session.decode(other).or_fail(|| "the fork's first decode".to_string())?;
    child.trace.tokens.push(out.token);
    child.trace.logits.extend(out.logits);
    // Alternately while both have steps left.
    while child.trace.tokens.len() < STEPS || parent.trace.tokens.len() < STEPS {
        if parent.trace.tokens.len() < STEPS {
            parent.step()?;
        }
        if child.trace.tokens.len() < STEPS {
            child.step()?;
        }
    }
    drop(child.session);
    let mut total = check_own(ctx, &plain, &parent.trace, 0, "the parent after forking vs an unforked session")?;
    total.merge(&check_own(ctx, &child_plain, &child.trace, 0, "the fork vs a fresh session given its sequence")?);
    pass(format!("parent and fork (at step {SHARED}, on another token) reproduce their plain runs"), &total)
}
