//! `iree-cpu` against the reference backend on tiny random checkpoints: a prompt and 16 greedy
//! decode steps must give the same tokens, in f16 and int4; a second load must come from the
//! module cache; chunked prefill (several buckets, and the token-by-token tail at the end of the
//! context) must match a whole prefill.
//!
//! The compiler library is installed into `.seam/py-iree` on first use (pip). If that is not
//! possible here (no network), the tests print why and return.

use backend_iree::compiler::{ensure_compiler_library, module_cache};
use backend_iree::IreeBackend;
use backend_reference::ReferenceBackend;
use llama_model::random::{tiny_config, tiny_llama32_config, write_random_checkpoint};
use session_api::{Backend, LoadRequest, Session, SessionOptions, WeightFormat};
use std::path::Path;
use std::time::Instant;

fn compiler_ready(test: &str) -> bool {
    match ensure_compiler_library() {
        Ok(_) => true,
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            false
        }
    }
}

/// Greedy tokens of `prompt` then `steps` decode steps.
fn greedy(session: &mut dyn Session, prompt: &[u32], steps: usize) -> Vec<u32> {
    let mut tokens = vec![session.prefill(prompt).unwrap().token];
    for _ in 0..steps {
        let next = session.decode(*tokens.last().unwrap()).unwrap().token;
        tokens.push(next);
    }
    tokens
}

fn vmfb_count() -> usize {
    std::fs::read_dir(module_cache().dir()).map(|d| d.filter_map(|e| e.ok()).filter(|e| e.path().extension().is_some_and(|x| x == "vmfb")).count()).unwrap_or(0)
}

fn check_parity(dir: &Path, format: WeightFormat) {
    let prompt: Vec<u32> = vec![1, 17, 42, 99, 200, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 7, 77, 177, 250, 6];
    let mut request = LoadRequest::new(dir, format);
    request.max_context = Some(128);

    let reference = ReferenceBackend.load(&request).unwrap();
    let expected = greedy(reference.new_session(SessionOptions::default()).unwrap().as_mut(), &prompt, 16);

    let started = Instant::now();
    let engine = IreeBackend.load(&request).unwrap();
    let first_load = started.elapsed();
    let mut session = engine.new_session(SessionOptions::default()).unwrap();
    let got = greedy(session.as_mut(), &prompt, 16);
    eprintln!("{format}: first load {:.2} s; tokens {got:?}", first_load.as_secs_f64());
    assert_eq!(got, expected, "{format}: iree-cpu greedy tokens differ from the reference");
    assert_eq!(session.position(), prompt.len() + 16);
    assert_eq!(engine.info().weights, format);

    // A second load of the same model compiles nothing: the cache holds the module.
    let before = vmfb_count();
    let started = Instant::now();
    let again = IreeBackend.load(&request).unwrap();
    let second_load = started.elapsed();
    eprintln!("{format}: second load (cache hit) {:.3} s", second_load.as_secs_f64());
    assert_eq!(vmfb_count(), before, "the second load wrote a new module");
    let mut session = again.new_session(SessionOptions::default()).unwrap();
    assert_eq!(greedy(session.as_mut(), &prompt, 16), expected);

    // Chunked prefill (prompt in pieces through the 16 and 64 buckets and single tokens) gives
    // what the whole prefill gave.
    let mut chunked = engine.new_session(SessionOptions::default()).unwrap();
    chunked.prefill(&prompt[..3]).unwrap();
    chunked.prefill(&prompt[3..4]).unwrap();
    let first = chunked.prefill(&prompt[4..]).unwrap().token;
    assert_eq!(first, expected[0], "{format}: chunked prefill");
}

#[test]
fn greedy_tokens_match_the_reference_in_f16_and_int4() {
    if !compiler_ready("greedy_tokens_match_the_reference_in_f16_and_int4") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), &tiny_config(), 7).unwrap();
    check_parity(dir.path(), WeightFormat::F16);
    check_parity(dir.path(), WeightFormat::Int4);
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), &tiny_llama32_config(), 8).unwrap();
    check_parity(dir.path(), WeightFormat::F16);
}

#[test]
fn logits_truncate_fork_and_the_end_of_the_context() {
    if !compiler_ready("logits_truncate_fork_and_the_end_of_the_context") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), &tiny_config(), 9).unwrap();
    let mut request = LoadRequest::new(dir.path(), WeightFormat::F16);
    request.max_context = Some(40);
    let reference = ReferenceBackend.load(&request).unwrap();
    let engine = IreeBackend.load(&request).unwrap();
    assert_eq!(engine.capabilities().max_context, 40);
    let with_logits = SessionOptions { return_logits: true, ..Default::default() };

    let prompt: Vec<u32> = (0..30).map(|i| (i * 37 + 11) % 256).collect();
    let mut ours = engine.new_session(with_logits).unwrap();
    let mut theirs = reference.new_session(with_logits).unwrap();
    let a = ours.prefill(&prompt).unwrap();
    let b = theirs.prefill(&prompt).unwrap();
    let (la, lb) = (a.logits.unwrap(), b.logits.unwrap());
    let diff = la.iter().zip(&lb).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    eprintln!("prefill logits: max |diff| {diff:.2e}");
    assert_eq!(la.len(), 256);
    assert!(diff < 2e-2, "logits differ by {diff}");
    assert_eq!(a.token, b.token);

    // Fill the context to its end (the last 10 positions: buckets no longer fit, token by token).
    let mut fork = ours.fork().unwrap();
    let mut next = a.token;
    for _ in 0..10 {
        let x = ours.decode(next).unwrap();
        let y = theirs.decode(next).unwrap();
        assert_eq!(x.token, y.token);
        next = x.token;
    }
    assert_eq!(ours.position(), 40);
    assert_eq!(ours.decode(next).unwrap_err().kind(), session_api::ErrorKind::ContextOverflow);

    // Truncate back and go again: the same tokens as the first time.
    ours.truncate(30).unwrap();
    theirs.truncate(30).unwrap();
    assert_eq!(ours.decode(a.token).unwrap().token, theirs.decode(a.token).unwrap().token);
    // The fork taken at 30 continues on its own cache.
    assert_eq!(fork.position(), 30);
    assert_eq!(fork.decode(a.token).unwrap().token, fork_expected(&reference, &prompt, a.token));
}

/// The reference's token after `prompt` and `token`, from a fresh session.
fn fork_expected(reference: &std::sync::Arc<dyn session_api::Engine>, prompt: &[u32], token: u32) -> u32 {
    let mut s = reference.new_session(SessionOptions::default()).unwrap();
    s.prefill(prompt).unwrap();
    s.decode(token).unwrap().token
}
