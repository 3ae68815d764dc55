//! Engine- and session-level behaviour of the reference backend on tiny random models.

mod support;

use backend_reference::{EngineOptions, ReferenceEngine};
use session_api::sampling::argmax;
use session_api::{Engine, ErrorKind, SamplingConfig, SeamError, Session, SessionOptions, WeightFormat};
use support::{engine, max_diff, naive_last_logits, random_weights, tiny_config};

const PROMPT: [u32; 7] = [1, 17, 42, 5, 63, 8, 30];

fn with_logits() -> SessionOptions {
    SessionOptions { return_logits: true, ..Default::default() }
}

fn logits(engine: &ReferenceEngine, tokens: &[u32]) -> Vec<f32> {
    engine.session(with_logits()).unwrap().prefill(tokens).unwrap().logits.unwrap()
}

#[test]
fn forward_pass_matches_an_independent_naive_implementation() {
    for tied in [false, true] {
        let weights = random_weights(&tiny_config(tied), 11, false);
        let ours = logits(&engine(&weights, None), &PROMPT);
        let naive = naive_last_logits(&weights, &PROMPT);
        assert!(max_diff(&ours, &naive) < 1e-4, "tied={tied}: diff {}", max_diff(&ours, &naive));
        // The check must be able to fail: a different prompt gives clearly different logits.
        assert!(max_diff(&ours, &naive_last_logits(&weights, &PROMPT[1..])) > 1e-2);
    }
}

#[test]
fn forward_pass_matches_the_naive_one_with_multi_query_and_plain_multi_head_attention() {
    for kv_heads in [1, 4] {
        let mut config = tiny_config(false);
        config.num_key_value_heads = kv_heads;
        let weights = random_weights(&config, 5, false);
        let ours = logits(&engine(&weights, None), &PROMPT);
        assert!(max_diff(&ours, &naive_last_logits(&weights, &PROMPT)) < 1e-4, "kv_heads={kv_heads}");
    }
}

#[test]
fn prefill_then_decode_equals_prefill_of_the_whole_sequence() {
    let engine = engine(&random_weights(&tiny_config(false), 1, false), None);
    let whole = logits(&engine, &PROMPT);
    let mut s = engine.session(with_logits()).unwrap();
    s.prefill(&PROMPT[..3]).unwrap();
    let mut last = None;
    for &t in &PROMPT[3..] {
        last = s.decode(t).unwrap().logits;
    }
    assert_eq!(s.position(), PROMPT.len());
    assert!(max_diff(&whole, &last.unwrap()) < 1e-4);
}

#[test]
fn chunked_prefill_equals_one_shot() {
    let engine = engine(&random_weights(&tiny_config(true), 2, false), None);
    let whole = logits(&engine, &PROMPT);
    let mut s = engine.session(with_logits()).unwrap();
    s.prefill(&PROMPT[..2]).unwrap();
    s.prefill(&PROMPT[2..5]).unwrap();
    let chunked = s.prefill(&PROMPT[5..]).unwrap().logits.unwrap();
    assert!(max_diff(&whole, &chunked) < 1e-4);
}

#[test]
fn a_scored_prefill_returns_each_positions_logits_in_one_step() {
    let engine = engine(&random_weights(&tiny_config(false), 4, false), None);
    assert!(engine.capabilities().logits_per_position);
    let mut s = engine.session(SessionOptions::default()).unwrap();
    s.prefill(&PROMPT[..2]).unwrap();
    let scored = s.prefill_scored(&PROMPT[2..]).unwrap();
    let vocab = engine.info().vocab_size;
    assert_eq!(scored.logits.len(), (PROMPT.len() - 2) * vocab);
    assert_eq!(scored.output.logits, None, "the session was not opened with logits");
    assert_eq!(s.position(), PROMPT.len());
    for (row, end) in scored.logits.chunks(vocab).zip(3..=PROMPT.len()) {
        let alone = logits(&engine, &PROMPT[..end]);
        assert!(max_diff(row, &alone) < 1e-4, "position {}: {}", end - 1, max_diff(row, &alone));
    }
    assert_eq!(scored.output.token, argmax(&scored.logits[scored.logits.len() - vocab..]));
}

/// Greedy generation of `n` tokens after `prompt`.
fn generate(s: &mut dyn Session, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut out = vec![s.prefill(prompt).unwrap().token];
    while out.len() < n {
        out.push(s.decode(*out.last().unwrap()).unwrap().token);
    }
    out
}

#[test]
fn reset_reproduces_the_output_greedy_and_seeded() {
    let engine = engine(&random_weights(&tiny_config(false), 3, false), None);
    let sampled = SessionOptions {
        sampling: SamplingConfig::Sample { temperature: 1.5, top_k: 20, top_p: 0.95, seed: 9 },
        return_logits: false,
        ..SessionOptions::default()
    };
    for options in [SessionOptions::default(), sampled] {
        let mut s = engine.session(options).unwrap();
        let first = generate(s.as_mut(), &PROMPT, 12);
        s.reset();
        assert_eq!(s.position(), 0);
        assert_eq!(generate(s.as_mut(), &PROMPT, 12), first);
    }
}

#[test]
fn truncate_then_decode_equals_a_fresh_session() {
    let engine = engine(&random_weights(&tiny_config(false), 4, false), None);
    let mut s = engine.session(with_logits()).unwrap();
    s.prefill(&PROMPT).unwrap();
    s.truncate(4).unwrap();
    assert_eq!(s.position(), 4);
    let after_truncate = s.decode(9).unwrap().logits.unwrap();
    let fresh = logits(&engine, &[&PROMPT[..4], &[9]].concat());
    assert!(max_diff(&after_truncate, &fresh) < 1e-4);
    assert_eq!(s.truncate(99).unwrap_err().kind(), ErrorKind::InvalidInput);
}

#[test]
fn fork_diverges_without_touching_the_parent() {
    let engine = engine(&random_weights(&tiny_config(false), 6, false), None);
    let mut parent = engine.session(with_logits()).unwrap();
    parent.prefill(&PROMPT[..4]).unwrap();
    let mut child = parent.fork().unwrap();
    let child_logits = child.decode(50).unwrap().logits.unwrap();
    child.decode(51).unwrap();
    assert_eq!((parent.position(), child.position()), (4, 6));
    let parent_logits = parent.decode(PROMPT[4]).unwrap().logits.unwrap();
    assert!(max_diff(&parent_logits, &logits(&engine, &PROMPT[..5])) < 1e-4);
    assert!(max_diff(&child_logits, &logits(&engine, &[&PROMPT[..4], &[50]].concat())) < 1e-4);
}

#[test]
fn int4_weights_give_logits_close_to_f16() {
    let config = tiny_config(false);
    let f16 = logits(&engine(&random_weights(&config, 7, false), None), &PROMPT);
    let int4_engine = engine(&random_weights(&config, 7, true), None);
    assert_eq!(int4_engine.info().weights, WeightFormat::Int4);
    let int4 = logits(&int4_engine, &PROMPT);
    // 4-bit weights are coarse: ask only that the error be small next to the logits' spread.
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    let error: Vec<f32> = f16.iter().zip(&int4).map(|(a, b)| a - b).collect();
    assert!(norm(&error) < 0.3 * norm(&f16), "relative error {}", norm(&error) / norm(&f16));
    assert!(max_diff(&f16, &int4) > 0.0, "int4 must actually differ from f16");
    // And int4 is exactly what the naive pass computes from the same dequantized values.
    let int4_weights = random_weights(&config, 7, true);
    assert!(max_diff(&int4, &naive_last_logits(&int4_weights, &PROMPT)) < 1e-4);
}

#[test]
fn prefill_embeddings_equals_prefill_of_their_tokens() {
    let weights = random_weights(&tiny_config(true), 8, false);
    let engine = engine(&weights, None);
    let llama_model::Matrix::F16 { data, .. } = &weights.embed else { unreachable!() };
    let h = weights.config.hidden_size;
    let rows: Vec<f32> = PROMPT.iter().flat_map(|&t| data[t as usize * h..][..h].iter().map(|v| v.to_f32())).collect();
    let mut s = engine.session(with_logits()).unwrap();
    let from_embeddings = s.prefill_embeddings(&rows, PROMPT.len()).unwrap().logits.unwrap();
    assert!(max_diff(&from_embeddings, &logits(&engine, &PROMPT)) < 1e-5);
    assert_eq!(s.prefill_embeddings(&rows[..h - 1], 1).unwrap_err().kind(), ErrorKind::InvalidInput);
    assert!(matches!(s.prefill_embeddings(&[], 0), Err(SeamError::EmptyInput)));
    assert_eq!(s.position(), PROMPT.len());
}

#[test]
fn return_logits_gives_vocab_size_values_and_the_greedy_token_is_their_argmax() {
    let engine = engine(&random_weights(&tiny_config(false), 10, false), None);
    let mut s = engine.session(with_logits()).unwrap();
    let out = s.prefill(&PROMPT).unwrap();
    let logits = out.logits.unwrap();
    assert_eq!(logits.len(), engine.info().vocab_size);
    assert_eq!(out.token, argmax(&logits));
    assert!(engine.session(SessionOptions::default()).unwrap().prefill(&PROMPT).unwrap().logits.is_none());
}

#[test]
fn bad_tokens_are_refused_and_leave_the_session_usable() {
    let engine = engine(&random_weights(&tiny_config(false), 12, false), None);
    let mut s = engine.session(with_logits()).unwrap();
    assert!(matches!(s.decode(3), Err(SeamError::NotPrefilled)));
    assert!(matches!(s.prefill(&[]), Err(SeamError::EmptyInput)));
    assert!(matches!(s.prefill(&[1, 256]), Err(SeamError::TokenOutOfVocabulary { token: 256, vocab_size: 256 })));
    assert_eq!(s.position(), 0);
    s.prefill(&PROMPT[..3]).unwrap();
    assert!(matches!(s.decode(1000), Err(SeamError::TokenOutOfVocabulary { token: 1000, .. })));
    assert_eq!(s.position(), 3);
    // Nothing was poisoned: the session continues exactly like a fresh one.
    let continued = s.prefill(&PROMPT[3..]).unwrap().logits.unwrap();
    assert!(max_diff(&continued, &logits(&engine, &PROMPT)) < 1e-4);
}

#[test]
fn context_capacity_is_exact() {
    let engine = engine(&random_weights(&tiny_config(false), 13, false), Some(8));
    let mut s = engine.session(SessionOptions::default()).unwrap();
    assert_eq!(s.capacity(), 8);
    assert!(matches!(s.prefill(&[1; 9]), Err(SeamError::ContextOverflow { requested: 9, capacity: 8 })));
    let t = s.prefill(&PROMPT).unwrap().token;
    let t = s.decode(t).unwrap().token; // position 8 of 8: exactly full works
    assert_eq!(s.position(), 8);
    assert!(matches!(s.decode(t), Err(SeamError::ContextOverflow { requested: 9, capacity: 8 })));
    assert_eq!(s.position(), 8);
    s.truncate(7).unwrap();
    assert!(s.decode(t).is_ok(), "overflow must not poison the session");
}

#[test]
fn capabilities_and_info_describe_the_engine() {
    let weights = random_weights(&tiny_config(false), 14, false);
    let capped = engine(&weights, Some(16));
    assert_eq!(capped.capabilities().max_context, 16);
    let uncapped = engine(&weights, Some(1 << 20));
    assert_eq!(
        uncapped.capabilities().max_context,
        weights.config.max_position_embeddings,
        "capped by max_position_embeddings"
    );
    let caps = capped.capabilities();
    assert!(
        caps.logits && caps.kv_ops.truncate && caps.kv_ops.fork && caps.inputs.embeddings && caps.parallel_sessions
    );
    assert_eq!(caps.weight_formats, vec![WeightFormat::F16, WeightFormat::Int4]);
    let info = capped.info();
    assert_eq!(
        (info.backend.as_str(), info.resident_precision.as_str(), info.weights),
        ("reference", "f32", WeightFormat::F16)
    );
    assert_eq!((info.vocab_size, info.hidden_size), (weights.config.vocab_size, weights.config.hidden_size));
    assert!(info.weight_bytes > 0);
    // Every sampling mode is accepted; invalid settings are refused as input errors.
    let top = SessionOptions {
        sampling: SamplingConfig::Sample { temperature: 0.7, top_k: 5, top_p: 0.9, seed: 1 },
        return_logits: true,
        ..SessionOptions::default()
    };
    assert!(capped.session(top).is_ok());
    let bad = SessionOptions {
        sampling: SamplingConfig::Sample { temperature: -1.0, top_k: 0, top_p: 1.0, seed: 1 },
        return_logits: false,
        ..SessionOptions::default()
    };
    assert_eq!(capped.session(bad).err().unwrap().kind(), ErrorKind::InvalidInput);
}

#[test]
fn a_dedicated_thread_pool_computes_the_same_logits() {
    let weights = random_weights(&tiny_config(false), 15, false);
    let one_thread =
        ReferenceEngine::from_weights(&weights, EngineOptions { threads: Some(1), ..Default::default() }).unwrap();
    assert_eq!(logits(&one_thread, &PROMPT), logits(&engine(&weights, None), &PROMPT));
    let zero = ReferenceEngine::from_weights(&weights, EngineOptions { threads: Some(0), ..Default::default() });
    assert_eq!(zero.err().unwrap().kind(), ErrorKind::InvalidInput);
}

#[test]
fn sessions_run_in_parallel_on_one_engine() {
    let engine = std::sync::Arc::new(engine(&random_weights(&tiny_config(false), 16, false), None));
    let expected = generate(engine.session(SessionOptions::default()).unwrap().as_mut(), &PROMPT, 10);
    let handles: Vec<_> = (0..3)
        .map(|_| {
            let engine = std::sync::Arc::clone(&engine);
            std::thread::spawn(move || {
                generate(engine.session(SessionOptions::default()).unwrap().as_mut(), &PROMPT, 10)
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), expected);
    }
}

#[test]
fn malformed_weights_are_a_model_error() {
    let mut weights = random_weights(&tiny_config(false), 17, false);
    weights.layers[1].mlp_norm.pop();
    let err = ReferenceEngine::from_weights(&weights, EngineOptions::default()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ModelFormat);
    assert!(err.to_string().contains("layer 1"), "{err}");
}
