//! `seam synth-model`: the same seed writes the same bytes, in the shape asked for; mistakes are
//! one clean sentence. (Its export to llama.cpp GGUFs is tested in `export_gguf.rs`.)

use std::process::{Command, Output};

fn seam(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_seam")).args(args).output().expect("seam runs")
}

#[test]
fn synth_model_shapes_and_mistakes() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m");
    let result = seam(&["synth-model", "--shape", "tiny", "--seed", "3", "--out", out.to_str().unwrap()]);
    assert!(result.status.success(), "{}", String::from_utf8_lossy(&result.stderr));
    let config =
        llama_model::LlamaConfig::from_json_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config, llama_model::random::tiny_config());
    // The same seed writes the same bytes.
    let again = dir.path().join("again");
    assert!(seam(&["synth-model", "--shape", "tiny", "--seed", "3", "--out", again.to_str().unwrap()])
        .status
        .success());
    assert!(
        std::fs::read(out.join("model.safetensors")).unwrap()
            == std::fs::read(again.join("model.safetensors")).unwrap()
    );

    let bad = seam(&["synth-model", "--shape", "llama-9000", "--out", dir.path().join("x").to_str().unwrap()]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).starts_with("error: unknown shape 'llama-9000'"));
    let no_tokenizer = seam(&[
        "synth-model",
        "--shape",
        "tiny",
        "--out",
        dir.path().join("y").to_str().unwrap(),
        "--tokenizer-from",
        "/nonexistent",
    ]);
    assert!(String::from_utf8_lossy(&no_tokenizer.stderr).contains("no tokenizer.json there"));
}
