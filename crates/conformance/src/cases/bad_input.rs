//! Bad input gets the documented typed error, and a rejected argument leaves the session usable.

use super::{pass_with, Case, CaseContext};
use crate::stream::Driver;
use crate::verdict::{expect_error, Checked, OrFail, Verdict};
use session_api::{ErrorKind, SeamError, Session};

/// The bad-input cases, in order.
pub const CASES: [Case; 4] = [
    Case {
        name: "input.empty_prompt",
        about: "prefill of no tokens is InvalidInput and changes nothing",
        missing: super::needs_nothing,
        run: empty_prompt,
    },
    Case {
        name: "input.token_out_of_vocabulary",
        about: "a token id ≥ vocab_size in prefill or decode is InvalidInput and changes nothing",
        missing: super::needs_nothing,
        run: token_out_of_vocabulary,
    },
    Case {
        name: "input.decode_before_prefill",
        about: "decode on an empty session is InvalidState (NotPrefilled) and changes nothing",
        missing: super::needs_nothing,
        run: decode_before_prefill,
    },
    Case {
        name: "input.poisoned_session",
        about: "after a failure inside the backend the session refuses every step (Poisoned) until reset",
        missing: super::needs_nothing,
        run: poisoned_session,
    },
];

const STEPS: usize = 8;

fn unchanged(session: &dyn Session, position: usize, what: &str) -> Checked<()> {
    if session.position() != position {
        return Err(Verdict::fail(format!(
            "{what} was refused but moved position() from {position} to {}",
            session.position()
        )));
    }
    Ok(())
}

fn empty_prompt(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let prompt = ctx.prompt(12, 150);
    let baseline = ctx.baseline(&prompt, STEPS)?;
    let mut driver = ctx.forced_driver(&baseline.trace.tokens, "session given an empty prompt")?;
    expect_error(driver.session.prefill(&[]), ErrorKind::InvalidInput, "prefill(&[]) on a new session")?;
    unchanged(&*driver.session, 0, "an empty prefill")?;
    driver.prefill(&prompt, true)?;
    expect_error(driver.session.prefill(&[]), ErrorKind::InvalidInput, "prefill(&[]) after a prompt")?;
    unchanged(&*driver.session, prompt.len(), "an empty prefill")?;
    while driver.trace.tokens.len() < STEPS {
        driver.step()?;
    }
    let comparison = ctx.check_against(&baseline, &driver.trace, "a session after refused empty prefills")?;
    pass_with("empty prefill refused with InvalidInput, twice; the session continued unharmed", &comparison)
}

fn token_out_of_vocabulary(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let vocab = ctx.vocab_size() as u32;
    let prompt = ctx.prompt(12, 151);
    let baseline = ctx.baseline(&prompt, STEPS)?;
    let mut driver = ctx.forced_driver(&baseline.trace.tokens, "session given bad token ids")?;
    let mut bad_prompt = prompt.clone();
    bad_prompt[5] = vocab;
    let error = expect_error(
        driver.session.prefill(&bad_prompt),
        ErrorKind::InvalidInput,
        &format!("prefill with token id {vocab}"),
    )?;
    if !matches!(error, SeamError::TokenOutOfVocabulary { token, .. } if token == vocab) {
        return Err(Verdict::fail(format!(
            "prefill with token id {vocab}: expected TokenOutOfVocabulary, got {error:?}"
        )));
    }
    unchanged(&*driver.session, 0, "a prefill with a bad token id")?;
    driver.prefill(&prompt, true)?;
    for bad in [vocab, u32::MAX] {
        expect_error(driver.session.decode(bad), ErrorKind::InvalidInput, &format!("decode({bad})"))?;
        unchanged(&*driver.session, prompt.len(), &format!("decode({bad})"))?;
    }
    while driver.trace.tokens.len() < STEPS {
        driver.step()?;
    }
    let comparison = ctx.check_against(&baseline, &driver.trace, "a session after refused bad token ids")?;
    pass_with(
        format!("token ids {vocab} and {} refused with TokenOutOfVocabulary; the session continued unharmed", u32::MAX),
        &comparison,
    )
}

fn decode_before_prefill(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let prompt = ctx.prompt(12, 152);
    let baseline = ctx.baseline(&prompt, STEPS)?;
    let mut driver = ctx.forced_driver(&baseline.trace.tokens, "session decoded before prefill")?;
    let error = expect_error(driver.session.decode(prompt[0]), ErrorKind::InvalidState, "decode on a new session")?;
    if !matches!(error, SeamError::NotPrefilled) {
        return Err(Verdict::fail(format!("decode on a new session: expected NotPrefilled, got {error:?}")));
    }
    unchanged(&*driver.session, 0, "decode before prefill")?;
    driver.run(&prompt, STEPS)?;
    driver.session.reset();
    expect_error(driver.session.decode(prompt[0]), ErrorKind::InvalidState, "decode right after reset")?;
    let comparison = ctx.check_against(&baseline, &driver.trace, "a session after a refused decode")?;
    pass_with(
        "decode before prefill (and after reset) refused with NotPrefilled; the session worked afterwards",
        &comparison,
    )
}

fn poisoned_session(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let prompt = ctx.prompt(12, 153);
    let baseline = ctx.baseline(&prompt, STEPS)?;
    // The decorator runs the backend's first step for real, then reports a failure: the backend's
    // state has moved on, and reset must bring it back all the same.
    let session =
        ctx.engine.new_session_failing_once(ctx.greedy_options()).or_fail(|| "new_session_failing_once".to_string())?;
    let mut driver = Driver::forced(session, &baseline.trace.tokens, "session with an injected fault");
    let failure = match driver.session.prefill(&prompt) {
        Ok(_) => return Err(Verdict::fail("the session with an injected fault did not fail its first step")),
        Err(e) => e,
    };
    if !failure.poisons_session() {
        return Err(Verdict::fail(format!(
            "the injected fault surfaced as {:?} ({failure}), a kind that does not poison; a failure inside the backend must",
            failure.kind()
        )));
    }
    for (what, result) in [
        ("prefill after the failure", driver.session.prefill(&prompt).map(|_| ())),
        ("decode after the failure", driver.session.decode(prompt[0]).map(|_| ())),
    ] {
        match result {
            Err(SeamError::Poisoned { .. }) => {}
            other => {
                return Err(Verdict::fail(format!(
                    "{what}: expected Poisoned, got {:?}",
                    other.map_err(|e| e.to_string())
                )))
            }
        }
    }
    driver.session.reset();
    driver.run(&prompt, STEPS)?;
    let comparison = ctx.check_against(&baseline, &driver.trace, "a poisoned session after reset")?;
    pass_with(
        format!(
            "injected {:?} failure poisoned the session; prefill and decode then Poisoned; reset recovered",
            failure.kind()
        ),
        &comparison,
    )
}
