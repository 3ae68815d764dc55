//! The registered backend loading model directories written by `llama_model::random`.

mod support;

use llama_model::random::{random_weights, tiny_config, tiny_llama32_config, write_random_checkpoint};
use session_api::{find_backend, Engine, ErrorKind, LoadRequest, SessionOptions, WeightFormat};
use std::sync::{Arc, Mutex};
use support::{max_diff, naive_last_logits};

fn logits(engine: &dyn Engine, tokens: &[u32]) -> Vec<f32> {
    let options = SessionOptions { return_logits: true, ..Default::default() };
    engine.new_session(options).unwrap().prefill(tokens).unwrap().logits.unwrap()
}

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 37 + 11) % 256).collect()
}

#[test]
fn loads_a_checkpoint_with_progress_and_matches_the_naive_pass() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny-untied");
    write_random_checkpoint(&model, &tiny_config(), 21).unwrap();
    let stages = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&stages);
    let mut request = LoadRequest::new(&model, WeightFormat::F16);
    request.progress = Some(Arc::new(move |p| seen.lock().unwrap().push((p.stage, p.done, p.total))));
    request.threads = Some(2);
    let engine = find_backend("reference").unwrap().load(&request).unwrap();

    let info = engine.info();
    assert_eq!(
        (info.model.as_str(), info.backend.as_str(), info.weights),
        ("tiny-untied", "reference", WeightFormat::F16)
    );
    assert_eq!(engine.capabilities().max_context, 512);
    let stages = stages.lock().unwrap();
    for stage in ["reading weights", "converting to f32"] {
        let last = stages.iter().rev().find(|s| s.0 == stage).unwrap_or_else(|| panic!("no {stage} progress"));
        assert_eq!(Some(last.1), last.2, "{stage} should end complete");
    }

    let weights = random_weights(&tiny_config(), 21).unwrap();
    let tokens = prompt(20);
    assert!(max_diff(&logits(engine.as_ref(), &tokens), &naive_last_logits(&weights, &tokens)) < 1e-4);
}

#[test]
fn llama32_shape_tied_with_rope_scaling_keeps_its_cache_consistent_past_the_original_context() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny-llama32");
    write_random_checkpoint(&model, &tiny_llama32_config(), 22).unwrap();
    let mut request = LoadRequest::new(&model, WeightFormat::F16);
    request.max_context = Some(100);
    let engine = find_backend("reference").unwrap().load(&request).unwrap();
    assert_eq!(engine.capabilities().max_context, 100);

    // 80 positions: beyond the scaled rope's original context of 64.
    let tokens = prompt(80);
    let whole = logits(engine.as_ref(), &tokens);
    let mut s = engine.new_session(SessionOptions { return_logits: true, ..Default::default() }).unwrap();
    s.prefill(&tokens[..50]).unwrap();
    let mut last = Vec::new();
    for &t in &tokens[50..] {
        last = s.decode(t).unwrap().logits.unwrap();
    }
    assert!(max_diff(&whole, &last) < 1e-4);

    // The scaling is really applied: the same weights with plain rope give other logits.
    let mut plain = random_weights(&tiny_llama32_config(), 22).unwrap();
    plain.config.rope_scaling = None;
    assert!(max_diff(&whole, &naive_last_logits(&plain, &tokens)) > 1e-3);
}

#[test]
fn int4_loads_run_and_stay_close_to_f16() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    write_random_checkpoint(&model, &tiny_config(), 23).unwrap();
    let backend = find_backend("reference").unwrap();
    let f16 = backend.load(&LoadRequest::new(&model, WeightFormat::F16)).unwrap();
    let int4 = backend.load(&LoadRequest::new(&model, WeightFormat::Int4)).unwrap();
    assert_eq!((int4.info().weights, int4.info().resident_precision.as_str()), (WeightFormat::Int4, "f32"));
    let tokens = prompt(12);
    let (a, b) = (logits(f16.as_ref(), &tokens), logits(int4.as_ref(), &tokens));
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    let error: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x - y).collect();
    // Coarse: 4-bit weights through every layer of a random network move logits a fair way.
    assert!(norm(&error) < 0.5 * norm(&a), "relative error {}", norm(&error) / norm(&a));
    assert!(norm(&error) > 0.0);
    // Exact: int4 computes what the naive pass computes from the same dequantized weights.
    let int4_weights = llama_model::weights::load_weights(&model, WeightFormat::Int4, None).unwrap();
    // The layers at 4 bits, the embedding and the head at 8 (the default int4 layout).
    assert!(matches!(int4_weights.layers[0].wq, llama_model::Matrix::Int4(_)));
    assert!(matches!(int4_weights.embed, llama_model::Matrix::Int8(_)));
    assert!(max_diff(&b, &naive_last_logits(&int4_weights, &tokens)) < 1e-4);
}

#[test]
fn bad_model_directories_are_typed_errors() {
    let backend = find_backend("reference").unwrap();
    let dir = tempfile::tempdir().unwrap();
    // No config.json at all.
    let err = backend.load(&LoadRequest::new(dir.path(), WeightFormat::F16)).err().unwrap();
    assert!(matches!(err.kind(), ErrorKind::ModelFormat | ErrorKind::Io), "{err}");
    // A config.json that is not JSON.
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    let err = backend.load(&LoadRequest::new(dir.path(), WeightFormat::F16)).err().unwrap();
    assert_eq!(err.kind(), ErrorKind::ModelFormat, "{err}");
}

/// A Mistral checkpoint is the Llama model it holds, its context ending at the sliding window:
/// the same weights under a Mistral `config.json` give the same logits, bit for bit.
#[test]
fn a_mistral_checkpoint_runs_as_llama_within_its_window() {
    let dir = tempfile::tempdir().unwrap();
    let llama = dir.path().join("tiny-llama");
    write_random_checkpoint(&llama, &tiny_config(), 23).unwrap();
    let mistral = dir.path().join("tiny-mistral");
    std::fs::create_dir(&mistral).unwrap();
    for entry in std::fs::read_dir(&llama).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), mistral.join(entry.file_name())).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(llama.join("config.json")).unwrap()).unwrap();
    config["model_type"] = "mistral".into();
    config["architectures"] = serde_json::json!(["MistralForCausalLM"]);
    config["sliding_window"] = 256.into();
    std::fs::write(mistral.join("config.json"), config.to_string()).unwrap();

    let backend = find_backend("reference").unwrap();
    let as_llama = backend.load(&LoadRequest::new(&llama, WeightFormat::F16)).unwrap();
    let as_mistral = backend.load(&LoadRequest::new(&mistral, WeightFormat::F16)).unwrap();
    assert_eq!(as_llama.capabilities().max_context, 512);
    assert_eq!(as_mistral.capabilities().max_context, 256, "the context ends at the window");
    let tokens = prompt(40);
    assert_eq!(logits(as_mistral.as_ref(), &tokens), logits(as_llama.as_ref(), &tokens));
}
