//! Greedy decode steps launched ahead (ADR 0041) change no token and no logit: the same session
//! operations on pjrt-cpu, with launching ahead forced on and then off, give the same results,
//! through every operation that can meet a step launched ahead: the step as launched, a token
//! other than the greedy one at that position, truncate, fork, a session with logits, a prefill
//! after decodes, and decoding up to the cache's last position (where none is launched: a step
//! past the end would overwrite the last entry).
//!
//! One test in its own binary: the switch is an environment variable read at load.

use backend_pjrt::runtime::LAUNCH_AHEAD_ENV;
use backend_pjrt::PjrtBackend;
use session_api::{Backend, Engine, LoadRequest, Session, SessionOptions, WeightFormat};

const CONTEXT: usize = 48;

/// What a script of session operations returned: every token, and the logits where asked.
fn run_script(engine: &dyn Engine) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut tokens = Vec::new();
    let mut logits = Vec::new();
    let greedy = |session: &mut dyn Session, from: u32, steps: usize, tokens: &mut Vec<u32>| {
        let mut token = from;
        for _ in 0..steps {
            token = session.decode(token).expect("decode").token;
            tokens.push(token);
        }
        token
    };
    let mut session = engine.new_session(SessionOptions::default()).expect("session");
    let first = session.prefill(&[1, 7, 3, 12, 5]).expect("prefill").token;
    let last = greedy(session.as_mut(), first, 6, &mut tokens);
    // Not the greedy token: the step launched ahead for `last` is not this one.
    let other = (last + 1) % 64;
    let last = greedy(session.as_mut(), other, 3, &mut tokens);
    // A fork while a step is launched ahead; both go on.
    let mut fork = session.fork().expect("fork");
    greedy(fork.as_mut(), last, 4, &mut tokens);
    let last = greedy(session.as_mut(), last, 2, &mut tokens);
    // Back to an earlier position, then a different continuation.
    session.truncate(8).expect("truncate");
    let after = greedy(session.as_mut(), last, 3, &mut tokens);
    // A prefill after greedy decodes.
    tokens.push(session.prefill(&[4, 9, 2]).expect("prefill").token);
    greedy(session.as_mut(), after, 2, &mut tokens);
    // Up to the last position of the cache.
    let left = session.capacity() - session.position();
    greedy(session.as_mut(), after, left, &mut tokens);
    assert_eq!(session.position(), session.capacity());
    // A session with logits (nothing launched ahead) beside one without.
    let options = SessionOptions { return_logits: true, ..SessionOptions::default() };
    let mut with_logits = engine.new_session(options).expect("session");
    let mut plain = engine.new_session(SessionOptions::default()).expect("session");
    let (mut a, mut b) = (with_logits.prefill(&[2, 2, 8]).unwrap().token, plain.prefill(&[2, 2, 8]).unwrap().token);
    for _ in 0..4 {
        let step = with_logits.decode(a).unwrap();
        logits.push(step.logits.unwrap());
        a = step.token;
        b = plain.decode(b).unwrap().token;
        tokens.extend([a, b]);
    }
    (tokens, logits)
}

fn load(model: &std::path::Path, format: WeightFormat, ahead: bool) -> std::sync::Arc<dyn Engine> {
    std::env::set_var(LAUNCH_AHEAD_ENV, if ahead { "1" } else { "0" });
    let request = LoadRequest { max_context: Some(CONTEXT), ..LoadRequest::new(model, format) };
    let engine = PjrtBackend::default().load(&request).expect("pjrt-cpu loads the tiny model");
    std::env::remove_var(LAUNCH_AHEAD_ENV);
    engine
}

#[test]
fn steps_launched_ahead_change_no_result() {
    let models = conformance::models::tiny_models(&conformance::models::default_cache_dir()).expect("tiny models");
    for model in models.iter().take(2) {
        for format in [WeightFormat::F16, WeightFormat::Int4] {
            let ahead = run_script(load(&model.dir, format, true).as_ref());
            let now = run_script(load(&model.dir, format, false).as_ref());
            assert_eq!(ahead.0, now.0, "{} {format}: tokens, launched ahead vs not", model.name);
            assert!(ahead.1 == now.1, "{} {format}: the logits differ, launched ahead vs not", model.name);
        }
    }
}
