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

/// Outputs that exist: a model directory is replaced only with `--force`, and only once the new
/// one is complete; an export never writes through a link or onto a device; an interrupted
/// convert leaves nothing behind.
#[test]
fn existing_outputs_links_devices_and_interrupts() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let model = path("tiny");
    ok(&["synth-model", "--shape", "tiny", "--seed", "5", "--out", &model]);
    write_tokenizer(Path::new(&model), llama_model::random::tiny_config().vocab_size);
    let gguf = path("t.gguf");
    ok(&["export-gguf", "--model", &model, "--type", "q4_1", "--out", &gguf]);

    // An occupied output directory: refused without --force, untouched; replaced with it.
    let out = path("converted");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(Path::new(&out).join("notes.txt"), "mine").unwrap();
    let refused = seam(&["convert", &gguf, "--out", &out]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("--force"), "{stderr}");
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 1, "untouched");
    ok(&["convert", &gguf, "--out", &out, "--force"]);
    assert!(Path::new(&out).join("config.json").is_file() && !Path::new(&out).join("notes.txt").exists());
    // A file where the directory should go is refused, whatever the flags.
    let file = path("a-file");
    std::fs::write(&file, "x").unwrap();
    assert!(!seam(&["convert", &gguf, "--out", &file, "--force"]).status.success());
    assert_eq!(std::fs::read(&file).unwrap(), b"x");

    // export-gguf onto a symbolic link or a device: refused, the link's target untouched.
    let target = path("target.gguf");
    std::fs::write(&target, "keep").unwrap();
    let link = path("link.gguf");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    for dest in [link.as_str(), "/dev/null"] {
        let out = seam(&["export-gguf", "--model", &model, "--type", "f16", "--out", dest]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains("not a regular file"), "{dest}: {stderr}");
    }
    assert_eq!(std::fs::read(&target).unwrap(), b"keep");

    // Interrupted at several moments: the output is either absent or complete, and the next
    // convert into the same folder leaves no temporary behind.
    let interrupted = path("interrupted");
    for delay_ms in [5, 20, 60, 150] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_seam"))
            .args(["convert", &gguf, "--out", &interrupted, "--force"])
            .stderr(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
        child.wait().unwrap();
        let config = Path::new(&interrupted).join("config.json");
        assert!(!Path::new(&interrupted).exists() || config.is_file(), "{delay_ms} ms: half a model");
    }
    ok(&["convert", &gguf, "--out", &path("after"), "--force"]);
    let debris: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(debris.is_empty(), "{debris:?}");
}
