//! `seam export-gguf` from the command line: a synth-model directory exported as F16 and Q4_1 GGUFs
//! that `seam convert` (seam's GGUF importer, which follows llama.cpp's layout) reads back to the
//! same weights, and the mistakes a user can make.

use std::path::Path;
use std::process::{Command, Output};

fn seam(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_seam")).args(args).output().expect("seam runs")
}

fn ok(args: &[&str]) -> String {
    let out = seam(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "seam {args:?}: {stderr}");
    stderr
}

/// A byte-level BPE tokenizer.json (GPT-2 pre-tokenizer) with one token per id.
fn write_tokenizer(dir: &Path, vocab: usize) {
    let entries: Vec<String> = (0..vocab).map(|i| format!("\"x{i}\": {i}")).collect();
    let json = format!(
        r#"{{"model": {{"type": "BPE", "vocab": {{{}}}, "merges": ["x1 x2"]}}, "added_tokens": [], "pre_tokenizer": {{"type": "ByteLevel"}}}}"#,
        entries.join(", ")
    );
    std::fs::write(dir.join("tokenizer.json"), json).unwrap();
}

fn weights(dir: &Path, format: session_api::WeightFormat) -> Vec<Vec<f32>> {
    use llama_model::weights::TensorRef;
    let w = llama_model::weights::load_weights(dir, format, None).unwrap();
    w.tensors()
        .into_iter()
        .map(|(_, t)| match t {
            TensorRef::Norm(v) => v.to_vec(),
            TensorRef::Matrix(m) => m.to_f32(),
        })
        .collect()
}

#[test]
fn exported_ggufs_convert_back_to_the_same_weights() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let model = path("tiny");
    ok(&["synth-model", "--shape", "tiny", "--seed", "4", "--out", &model]);
    write_tokenizer(Path::new(&model), llama_model::random::tiny_config().vocab_size);

    let report = ok(&["export-gguf", "--model", &model, "--type", "f16", "--out", &path("t.F16.gguf")]);
    assert!(report.contains("as F16, tokenizer pre 'gpt2'"), "{report}");
    ok(&["convert", &path("t.F16.gguf"), "--out", &path("from-f16")]);
    let f16 = session_api::WeightFormat::F16;
    assert!(weights(Path::new(&model), f16) == weights(Path::new(&path("from-f16")), f16));

    ok(&["export-gguf", "--model", &model, "--type", "q4_1", "--out", &path("t.Q4_1.gguf")]);
    let report = ok(&["convert", &path("t.Q4_1.gguf"), "--out", &path("from-q4_1")]);
    // The layers from Q4_1 into int4, the embedding and the head from Q8_0 into int8, all exactly.
    let exact =
        "14 int4 matrices carried exactly (Q4_1/Q4_0), 0 quantized to int4, 2 int8 carried exactly (Q8_0), 0 quantized";
    assert!(report.contains(exact), "{report}");
    let int4 = session_api::WeightFormat::Int4;
    assert!(weights(Path::new(&model), int4) == weights(Path::new(&path("from-q4_1")), int4));

    // The tokenizer copied from a GGUF instead of built from tokenizer.json.
    std::fs::remove_file(Path::new(&model).join("tokenizer.json")).unwrap();
    let report = ok(&[
        "export-gguf",
        "--model",
        &model,
        "--type",
        "f16",
        "--out",
        &path("t2.gguf"),
        "--tokenizer-from",
        &path("t.F16.gguf"),
    ]);
    assert!(report.contains("tokenizer pre 'gpt2'"), "{report}");
}

#[test]
fn mistakes_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.gguf");
    let missing =
        seam(&["export-gguf", "--model", "/nonexistent-model", "--type", "f16", "--out", out.to_str().unwrap()]);
    assert!(!missing.status.success());
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(stderr.starts_with("error: ") && stderr.contains("/nonexistent-model"), "{stderr}");
    assert!(!out.exists());

    let bad_type = seam(&["export-gguf", "--model", "/x", "--type", "q8_0", "--out", out.to_str().unwrap()]);
    assert_eq!(bad_type.status.code(), Some(2), "clap rejects an unknown --type");
    assert!(String::from_utf8_lossy(&bad_type.stderr).contains("q4_1"));
}
