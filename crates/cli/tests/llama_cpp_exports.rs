//! The files the llama.cpp comparison (scripts/compare-llama-cpp.sh) feeds to llama-bench hold the
//! weights seam runs: `seam synth-model` writes a model, scripts/gguf_export.py writes it as
//! llama.cpp GGUFs, and seam's own GGUF importer reads them back to the same tensors (which also
//! checks the llama.cpp rope row order both ways). Needs python3; installs gguf-py 0.19 and numpy
//! into `.seam/py` on first use, like the gguf crate's cross-check.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn seam(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_seam")).args(args).output().expect("seam runs")
}

fn gguf_py() -> PathBuf {
    let dir = repo().join(".seam/py");
    if !dir.join("gguf-0.19.0.dist-info").exists() {
        let status = Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target"])
            .arg(&dir)
            .args(["gguf==0.19.0", "numpy"])
            .status()
            .expect("python3 is needed");
        assert!(status.success());
    }
    dir
}

fn export(args: &[&str]) {
    let out = Command::new("python3").arg(repo().join("scripts/gguf_export.py")).args(args).env("PYTHONPATH", gguf_py()).output().unwrap();
    assert!(out.status.success(), "gguf_export.py {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Every fp16 tensor of a model directory as `(name, f16 bits or f32 bits)`, for comparing two
/// directories by content (their safetensors headers may differ in metadata).
fn fp16_tensors(dir: &Path) -> Vec<(String, Vec<u32>)> {
    use llama_model::weights::TensorRef;
    let weights = llama_model::weights::load_weights(dir, session_api::WeightFormat::F16, None).unwrap();
    weights
        .tensors()
        .into_iter()
        .map(|(name, tensor)| {
            let bits = match tensor {
                TensorRef::Norm(v) => v.iter().map(|x| x.to_bits()).collect(),
                TensorRef::Matrix(llama_model::Matrix::F16 { data, .. }) => data.iter().map(|x| u32::from(x.to_bits())).collect(),
                TensorRef::Matrix(_) => panic!("{name}: not f16"),
            };
            (name, bits)
        })
        .collect()
}

fn convert(gguf: &Path, out: &Path) -> String {
    let result = seam(&["convert", gguf.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&result.stderr).into_owned();
    assert!(result.status.success(), "seam convert {}: {stderr}", gguf.display());
    stderr
}

/// A BPE tokenizer.json with one token per id and a single merge (`t` + `0` = `t0`): enough for
/// the GGUF tokenizer metadata that llama.cpp and seam's importer need.
fn write_tokenizer(dir: &Path, vocab: usize) {
    let token = |i: usize| match i {
        0 => "t".to_string(),
        1 => "0".to_string(),
        2 => "t0".to_string(),
        i => format!("x{i}"),
    };
    let entries: Vec<String> = (0..vocab).map(|i| format!("\"{}\": {i}", token(i))).collect();
    let json = format!(r#"{{"model": {{"type": "BPE", "vocab": {{{}}}, "merges": ["t 0"]}}, "added_tokens": []}}"#, entries.join(", "));
    std::fs::write(dir.join("tokenizer.json"), json).unwrap();
}

#[test]
fn synth_model_shapes_and_mistakes() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m");
    let result = seam(&["synth-model", "--shape", "tiny", "--seed", "3", "--out", out.to_str().unwrap()]);
    assert!(result.status.success(), "{}", String::from_utf8_lossy(&result.stderr));
    let config = llama_model::LlamaConfig::from_json_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config, llama_model::random::tiny_config());
    // The same seed writes the same bytes.
    let again = dir.path().join("again");
    assert!(seam(&["synth-model", "--shape", "tiny", "--seed", "3", "--out", again.to_str().unwrap()]).status.success());
    assert!(std::fs::read(out.join("model.safetensors")).unwrap() == std::fs::read(again.join("model.safetensors")).unwrap());

    let bad = seam(&["synth-model", "--shape", "llama-9000", "--out", dir.path().join("x").to_str().unwrap()]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).starts_with("error: unknown shape 'llama-9000'"));
    let no_tokenizer =
        seam(&["synth-model", "--shape", "tiny", "--out", dir.path().join("y").to_str().unwrap(), "--tokenizer-from", "/nonexistent"]);
    assert!(String::from_utf8_lossy(&no_tokenizer.stderr).contains("no tokenizer.json there"));
}

#[test]
fn gguf_exports_hold_seams_weights() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    assert!(seam(&["synth-model", "--shape", "tiny", "--seed", "7", "--out", model.to_str().unwrap()]).status.success());
    write_tokenizer(&model, llama_model::random::tiny_config().vocab_size);
    let weights = fp16_tensors(&model);

    // F16: llama.cpp's names and rope row order, read back by seam's importer to the same bytes.
    let f16 = dir.path().join("tiny.F16.gguf");
    export(&["from-hf", model.to_str().unwrap(), f16.to_str().unwrap(), "--type", "f16"]);
    let back = dir.path().join("from-f16");
    convert(&f16, &back);
    assert!(fp16_tensors(&back) == weights, "F16 GGUF round trip changed a tensor");

    // Q4_1: every matrix is Q4_1, which seam carries into its int4 format exactly.
    let q4_1 = dir.path().join("tiny.Q4_1.gguf");
    export(&["from-hf", model.to_str().unwrap(), q4_1.to_str().unwrap(), "--type", "q4_1"]);
    let from_q4 = dir.path().join("from-q4_1");
    let report = convert(&q4_1, &from_q4);
    let matrices = llama_model::weights::expected_tensors(&llama_model::random::tiny_config()).iter().filter(|t| t.shape.len() == 2).count();
    assert!(report.contains(&format!("{matrices} int4 matrices carried exactly from Q4_1")), "{report}");

    // to-f16 of the Q4_1 file: the fp16 weights seam derives from the Q4_1 file itself.
    let dequantized = dir.path().join("tiny.Q4_1-as-F16.gguf");
    export(&["to-f16", q4_1.to_str().unwrap(), dequantized.to_str().unwrap()]);
    let from_dequantized = dir.path().join("from-dequantized");
    convert(&dequantized, &from_dequantized);
    assert!(
        fp16_tensors(&from_dequantized) == fp16_tensors(&from_q4),
        "the F16 GGUF must hold exactly the fp16 weights seam reads from the Q4_1 GGUF"
    );
}
