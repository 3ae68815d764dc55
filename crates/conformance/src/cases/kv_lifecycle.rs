//! The KV cache's lifecycle: every way of reaching a sequence state must give the same next tokens
//! as the plainest way (one prefill, then decode).

use super::{pass_with, Case, CaseContext};
use crate::oracle::OracleRun;
use crate::report::Figures;
use crate::stream::{compare, Comparison, Driver, Expected, Trace};
use crate::verdict::{expect_error, Checked, OrFail, Verdict};
use session_api::{Capabilities, ErrorKind, LoadRequest, Session};
use std::sync::Arc;

/// The lifecycle cases, in order.
pub const CASES: [Case; 8] = [
    Case {
        name: "kv.decode_equals_prefill",
        about: "prefill then decode predicts what prefilling the whole sequence at once predicts (teacher forcing)",
        missing: super::needs_nothing,
        run: decode_equals_prefill,
    },
    Case {
        name: "kv.chunked_prefill",
        about: "a prompt prefilled in chunks of 1, 15, 16 and 8 tokens continues like a one-shot prefill",
        missing: super::needs_nothing,
        run: chunked_prefill,
    },
    Case {
        name: "kv.reset",
        about: "reset empties the session: the same prompt afterwards reproduces the same tokens",
        missing: super::needs_nothing,
        run: reset,
    },
    Case {
        name: "kv.interleaved_sessions",
        about: "two sessions stepped alternately each equal their run alone",
        missing: super::needs_nothing,
        run: interleaved_sessions,
    },
    Case {
        name: "kv.parallel_threads",
        about: "four sessions on four threads at once equal their sequential runs",
        missing: needs_parallel_sessions,
        run: parallel_threads,
    },
    Case {
        name: "kv.truncate",
        about: "truncate to an earlier position, then new tokens, equals a fresh session given the same sequence",
        missing: needs_truncate,
        run: truncate,
    },
    Case {
        name: "kv.fork",
        about: "a fork diverges from its parent, each equal to a fresh session given its sequence",
        missing: needs_fork,
        run: fork,
    },
    Case {
        name: "kv.context_capacity",
        about: "a session fills exactly to capacity; one more token is a typed context overflow; reset recovers",
        missing: super::needs_nothing,
        run: context_capacity,
    },
];

fn needs_parallel_sessions(c: &Capabilities) -> Option<&'static str> {
    (!c.parallel_sessions).then_some("parallel_sessions")
}

fn needs_truncate(c: &Capabilities) -> Option<&'static str> {
    (!c.kv_ops.truncate).then_some("kv_ops.truncate")
}

fn needs_fork(c: &Capabilities) -> Option<&'static str> {
    (!c.kv_ops.fork).then_some("kv_ops.fork")
}

/// Steps decoded in the lifecycle comparisons.
const STEPS: usize = 16;

fn decode_equals_prefill(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let prompt = ctx.prompt(20, 101);
    let baseline = ctx.baseline(&prompt, STEPS)?;
    let mut decoded = ctx.forced_driver(&baseline.trace.tokens, "prefill+decode session")?;
    decoded.run(&prompt, STEPS)?;
    let mut total = ctx.check_against(&baseline, &decoded.trace, "prefill then decode")?;
    // Step k of the decode run was predicted from prompt + baseline[..k]; prefilling that whole
    // sequence in one call must predict the same.
    for k in [1usize, 2, 7, STEPS - 1] {
        let sequence: Vec<u32> = prompt.iter().chain(&baseline.trace.tokens[..k]).copied().collect();
        let mut driver =
            Driver::free(ctx.greedy_session()?, format!("whole-sequence prefill of {} tokens", sequence.len()));
        driver.prefill(&sequence, true)?;
        let expected = Expected {
            tokens: &baseline.trace.tokens[k..=k],
            margins: &baseline.margins[k..=k],
            logits: baseline.trace.logits().map(|l| &l[k..=k]),
        };
        let mut comparison = compare(&driver.trace, expected, &ctx.tolerances);
        // Report steps of the decode run, not of this one-step comparison.
        for d in [&mut comparison.first_divergence, &mut comparison.first_intolerable].into_iter().flatten() {
            d.step = k;
        }
        comparison.first_logit_excess = comparison.first_logit_excess.map(|_| k);
        comparison.check(&format!("prefilling prompt + {k} generated tokens at once"), &ctx.tolerances)?;
        total.merge(&comparison);
    }
    pass_with("prefill+decode and whole-sequence prefills (at steps 1, 2, 7, 15) agree with the reference", &total)
}

fn chunked_prefill(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let prompt = ctx.prompt(40, 102);
    let baseline = ctx.baseline(&prompt, STEPS)?;
    let mut driver = ctx.forced_driver(&baseline.trace.tokens, "chunked session")?;
    let mut start = 0;
    let chunks = [1usize, 15, 16, 8];
    for (i, &len) in chunks.iter().enumerate() {
        driver.prefill(&prompt[start..start + len], i == chunks.len() - 1)?;
        start += len;
    }
    if driver.session.position() != prompt.len() {
        return Err(Verdict::fail(format!(
            "after chunked prefill of {} tokens position() is {}",
            prompt.len(),
            driver.session.position()
        )));
    }
    while driver.trace.tokens.len() < STEPS {
        driver.step()?;
    }
    let comparison = ctx.check_against(&baseline, &driver.trace, "chunked prefill (1+15+16+8) vs one-shot")?;
    pass_with("chunked prefill continues exactly like a one-shot prefill", &comparison)
}

fn reset(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let prompt = ctx.prompt(24, 103);
    let baseline = ctx.baseline(&prompt, STEPS)?;
    let mut driver = ctx.forced_driver(&baseline.trace.tokens, "session before reset")?;
    driver.run(&prompt, STEPS)?;
    let mut total = ctx.check_against(&baseline, &driver.trace, "the first run")?;
    driver.session.reset();
    if driver.session.position() != 0 {
        return Err(Verdict::fail(format!("position() is {} after reset", driver.session.position())));
    }
    let mut again = Driver::forced(driver.session, &baseline.trace.tokens, "session after reset");
    again.run(&prompt, STEPS)?;
    total.merge(&ctx.check_against(&baseline, &again.trace, "the same prompt after reset")?);
    pass_with("a reset session reproduces its first run", &total)
}

fn interleaved_sessions(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let prompts = [ctx.prompt(17, 104), ctx.prompt(33, 105)];
    let baselines = [ctx.baseline(&prompts[0], STEPS)?, ctx.baseline(&prompts[1], STEPS)?];
    let mut drivers = [
        ctx.forced_driver(&baselines[0].trace.tokens, "interleaved session 1")?,
        ctx.forced_driver(&baselines[1].trace.tokens, "interleaved session 2")?,
    ];
    drivers[0].prefill(&prompts[0], true)?;
    drivers[1].prefill(&prompts[1], true)?;
    for _ in 1..STEPS {
        drivers[0].step()?;
        drivers[1].step()?;
    }
    let mut total = Comparison::default();
    for (i, driver) in drivers.iter().enumerate() {
        let what = format!("session {} stepped alternately with another", i + 1);
        total.merge(&ctx.check_against(&baselines[i], &driver.trace, &what)?);
    }
    pass_with("two interleaved sessions each equal their run alone", &total)
}

fn parallel_threads(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    const THREADS: usize = 4;
    let prompts: Vec<Vec<u32>> = (0..THREADS).map(|i| ctx.prompt(9 + 11 * i, 106 + i as u64)).collect();
    let baselines: Vec<Arc<OracleRun>> = prompts.iter().map(|p| ctx.baseline(p, STEPS)).collect::<Checked<_>>()?;
    let options = ctx.greedy_options();
    let results: Vec<Checked<Trace>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|i| {
                let (engine, prompt, forced) = (ctx.engine.clone(), &prompts[i], &baselines[i].trace.tokens);
                let options = options.clone();
                scope.spawn(move || -> Checked<Trace> {
                    let session = engine.new_session(options).or_fail(|| format!("thread {i}: new_session"))?;
                    let mut driver = Driver::forced(session, forced, format!("thread {i}"));
                    driver.run(prompt, STEPS)?;
                    Ok(driver.trace)
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(i, h)| {
                h.join().unwrap_or_else(|payload| {
                    Err(Verdict::fail(format!("thread {i} panicked: {}", crate::runner::panic_message(&*payload))))
                })
            })
            .collect()
    });
    let mut total = Comparison::default();
    for (i, result) in results.into_iter().enumerate() {
        let trace = result?;
        total.merge(&ctx.check_against(&baselines[i], &trace, &format!("thread {i} vs its sequential run"))?);
    }
    pass_with("four concurrent sessions on four threads equal their sequential runs", &total)
}

fn truncate(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let (first, second) = (ctx.prompt(24, 110), ctx.prompt(10, 111));
    const KEEP: usize = 12;
    let mut driver = Driver::free(ctx.greedy_session()?, "truncated session");
    // The tokens decoded before truncating are dropped, so the session may pick them itself.
    driver.run(&first, 9)?;
    let position = driver.session.position();
    if position != first.len() + 8 {
        return Err(Verdict::fail(format!("position() is {position} after prefill of {} and 8 decodes", first.len())));
    }
    // Rewinding forward is not rewinding; the contract only allows positions up to the current one.
    expect_error(driver.session.truncate(position + 1), ErrorKind::InvalidInput, "truncate past the current position")?;
    driver.session.truncate(KEEP).or_fail(|| format!("truncate({KEEP}) at position {position}"))?;
    if driver.session.position() != KEEP {
        return Err(Verdict::fail(format!("position() is {} after truncate({KEEP})", driver.session.position())));
    }
    let fresh_prompt: Vec<u32> = first[..KEEP].iter().chain(&second).copied().collect();
    let baseline = ctx.baseline(&fresh_prompt, STEPS)?;
    let mut after = Driver::forced(driver.session, &baseline.trace.tokens, "truncated session");
    after.run(&second, STEPS)?;
    let comparison = ctx.check_against(
        &baseline,
        &after.trace,
        &format!("truncate({KEEP}) from position {position} then new tokens vs a fresh session"),
    )?;
    pass_with(format!("truncate({KEEP}) from {position} then 10 new tokens equals a fresh session"), &comparison)
}

fn fork(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let prompt = ctx.prompt(20, 120);
    const SHARED: usize = 5;
    let full = ctx.baseline(&prompt, SHARED + STEPS)?;

    let mut parent = ctx.forced_driver(&full.trace.tokens, "parent")?;
    parent.run(&prompt, SHARED)?;
    let child_session = parent.session.fork().or_fail(|| format!("fork at position {}", parent.session.position()))?;
    if child_session.position() != parent.session.position() {
        return Err(Verdict::fail(format!(
            "the fork's position() is {}, its parent's {}",
            child_session.position(),
            parent.session.position()
        )));
    }

    // The child takes another token than the parent's next one, so the two sequences differ.
    let parent_next = full.trace.tokens[SHARED - 1];
    let other = if parent_next as usize + 1 < ctx.vocab_size() { parent_next + 1 } else { parent_next - 1 };
    let consumed: Vec<u32> = prompt.iter().chain(&full.trace.tokens[..SHARED - 1]).copied().collect();
    let child_sequence: Vec<u32> = consumed.iter().copied().chain([other]).collect();
    let child_expected = ctx.baseline(&child_sequence, STEPS)?;
    let mut child = Driver::forced(child_session, &child_expected.trace.tokens, "fork");

    // Step both alternately: a fork that shares cache memory with its parent shows here.
    let out = child.session.decode(other).or_fail(|| "the fork's first decode".to_string())?;
    child.trace.tokens.push(out.token);
    child.trace.logits.extend(out.logits);
    while child.trace.tokens.len() < STEPS {
        parent.step()?;
        child.step()?;
    }
    while parent.trace.tokens.len() < SHARED + STEPS {
        parent.step()?;
    }
    drop(child.session);

    let mut total = ctx.check_against(&full, &parent.trace, "the parent after forking vs an unforked session")?;
    total.merge(&ctx.check_against(&child_expected, &child.trace, "the fork vs a fresh session given its sequence")?);
    pass_with("fork and parent evolve independently, each equal to a fresh session", &total)
}

/// Context cap requested for the capacity case: small, so filling it is quick, and off any
/// power-of-two bucket.
/// The context of the capacity case's second load (a cap below the default).
pub const CAPACITY_CAP: usize = 96;

fn context_capacity(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let request = LoadRequest { max_context: Some(CAPACITY_CAP), ..ctx.request.clone() };
    let engine = ctx.backend.load(&request).or_fail(|| format!("load with max_context {CAPACITY_CAP}"))?;
    let new_session = || engine.new_session(ctx.greedy_options()).or_fail(|| "new_session".to_string());
    let mut session = new_session()?;
    let capacity = session.capacity();
    if capacity == 0 || capacity > CAPACITY_CAP {
        return Err(Verdict::fail(format!(
            "capacity() is {capacity} for an engine loaded with max_context {CAPACITY_CAP} (a cap: it must be 1..={CAPACITY_CAP})"
        )));
    }
    if capacity > engine.capabilities().max_context {
        return Err(Verdict::fail(format!(
            "capacity() {capacity} exceeds the engine's capabilities().max_context {}",
            engine.capabilities().max_context
        )));
    }

    // Too long at once: refused up front, and the session stays usable.
    let too_long = ctx.prompt(capacity + 1, 130);
    expect_error(
        session.prefill(&too_long),
        ErrorKind::ContextOverflow,
        &format!("prefill of {} tokens", capacity + 1),
    )?;
    check_position(&*session, 0, "a refused over-long prefill")?;

    // Exactly to capacity: prefill capacity-1, decode one.
    let fill = &too_long[..capacity - 1];
    let last = if capacity > 1 {
        session.prefill(fill).or_fail(|| format!("prefill of {} tokens (capacity {capacity})", fill.len()))?.token
    } else {
        session.prefill(&too_long[..1]).or_fail(|| "prefill of 1 token (capacity 1)".to_string())?.token
    };
    if capacity > 1 {
        session.decode(last).or_fail(|| format!("decode of the token that fills position {capacity} of {capacity}"))?;
    }
    check_position(&*session, capacity, "filling to capacity")?;

    // One more: a typed overflow that changes nothing.
    expect_error(session.decode(last), ErrorKind::ContextOverflow, "decode on a full session")?;
    expect_error(session.prefill(&too_long[..1]), ErrorKind::ContextOverflow, "prefill on a full session")?;
    check_position(&*session, capacity, "a refused decode on a full session")?;

    // Reset recovers: the session then behaves like a fresh one.
    session.reset();
    check_position(&*session, 0, "reset")?;
    let prompt = ctx.prompt(10, 131);
    let baseline = ctx.baseline(&prompt, 8)?;
    let mut recovered = Driver::forced(session, &baseline.trace.tokens, "session reset after overflow");
    recovered.run(&prompt, 8)?;
    let comparison = ctx.check_against(&baseline, &recovered.trace, "a session reset after overflow")?;
    Ok(Verdict::pass(format!("filled {capacity} of {capacity} positions; overflow typed; reset recovered"))
        .with_figures(Figures { ..comparison.figures() }))
}

fn check_position(session: &dyn Session, expected: usize, after: &str) -> Checked<()> {
    match session.position() {
        p if p == expected => Ok(()),
        p => Err(Verdict::fail(format!("position() is {p} after {after}; expected {expected}"))),
    }
}
