//! `seam perplexity` on a tiny random model and the reference backend: the figures it promises,
//! its logits file compared against itself (KL 0, full agreement) and against another weight
//! format, and the mistakes a user can make, each one sentence and a failing exit status.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn seam(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_seam")).args(args).env("RUST_BACKTRACE", "1").output().expect("seam runs")
}

fn json_of(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("--json prints one JSON object")
}

fn assert_clean_failure(out: &Output, expected: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "should fail: {stderr}");
    assert!(!stderr.contains("panicked"), "no panic expected: {stderr}");
    assert!(stderr.starts_with("error: "), "one error sentence expected: {stderr}");
    assert!(stderr.contains(expected), "expected '{expected}' in: {stderr}");
}

/// GPT-2's map from bytes to the printable characters a byte-level BPE vocabulary spells them with.
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap()
            }
        })
        .collect()
}

/// A byte-level tokenizer.json for the tiny model's 256 ids (one token per byte, no merges) whose
/// post-processor puts BOS (id 1) in front of every text, as Llama tokenizers do.
fn write_tokenizer(dir: &Path) {
    let vocab: serde_json::Map<String, serde_json::Value> =
        byte_chars().into_iter().enumerate().map(|(id, c)| (c.to_string(), id.into())).collect();
    let bos = serde_json::json!({"SpecialToken": {"id": "<s>", "type_id": 0}});
    let tokenizer = serde_json::json!({
        "version": "1.0",
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
        "model": {"type": "BPE", "vocab": vocab, "merges": []}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
}

const TEXT: &str = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer \
the slings and arrows of outrageous fortune, or to take arms against a sea of troubles.\n";

struct Fixture {
    dir: tempfile::TempDir,
    model: String,
    text: String,
}

impl Fixture {
    fn new() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("tiny");
        llama_model::random::write_random_checkpoint(&model, &llama_model::random::tiny_config(), 5).unwrap();
        write_tokenizer(&model);
        let text = dir.path().join("text.txt");
        std::fs::write(&text, TEXT).unwrap();
        Fixture { model: model.to_str().unwrap().into(), text: text.to_str().unwrap().into(), dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `seam perplexity` on the reference backend with this fixture's model, and its text and
    /// ctx 16 unless `extra` names others.
    fn run(&self, extra: &[&str]) -> Output {
        let mut args = vec!["perplexity", "--backend", "reference", "--model", &self.model];
        if !extra.contains(&"--file") {
            args.extend(["--file", &self.text]);
        }
        if !extra.contains(&"--ctx") {
            args.extend(["--ctx", "16"]);
        }
        args.extend(extra);
        seam(&args)
    }
}

#[test]
fn a_tiny_model_has_a_finite_perplexity() {
    let fx = Fixture::new();
    let report = json_of(&fx.run(&["--json"]));
    // One token per byte (the trailing newline dropped, as llama-perplexity -f drops it) plus BOS.
    let tokens = TEXT.len() - 1 + 1;
    assert_eq!(report["text_tokens"], tokens);
    assert_eq!(report["bos"], 1);
    assert_eq!(report["available_chunks"], tokens / 16);
    assert_eq!(report["chunks"], tokens / 16);
    // Positions 8..=14 of each window of 16: 7 scored tokens.
    assert_eq!(report["scored_tokens"], (tokens / 16) * 7);
    let ppl = report["perplexity"].as_f64().unwrap();
    assert!(ppl.is_finite() && ppl > 1.0, "{ppl}");
    assert!((report["mean_nll"].as_f64().unwrap().exp() - ppl).abs() < 1e-9 * ppl);
    assert!(report["uncertainty"].as_f64().unwrap() > 0.0);
    assert_eq!((report["backend"].as_str(), report["weights"].as_str()), (Some("reference"), Some("f16")));
    assert!(report["kl_divergence"].is_null() && report["saved_logits"].is_null());

    // The human form ends as llama-perplexity's, with the same figure; --chunks limits the windows.
    let out = fx.run(&["--chunks", "2"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with("Final estimate: PPL = "), "{stdout}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("2 of 10 windows of 16, 14 tokens scored") && stderr.contains("[2/2] PPL = "), "{stderr}");
}

#[test]
fn saved_logits_compare_to_zero_against_the_same_run() {
    let fx = Fixture::new();
    let base = fx.path("base.logits");
    let base_arg = base.to_str().unwrap();
    let saved = json_of(&fx.run(&["--chunks", "3", "--save-logits", base_arg, "--json"]));
    assert_eq!(saved["saved_logits"], base_arg);
    // 44 header bytes, 3 windows of 7 positions of 16 + 12 * 32 bytes, 8 checksum bytes.
    assert_eq!(std::fs::metadata(&base).unwrap().len(), 44 + 21 * (16 + 12 * 32) + 8);

    let same = json_of(&fx.run(&["--chunks", "3", "--kl-divergence", base_arg, "--json"]));
    let kl = &same["kl_divergence"];
    assert_eq!(kl["positions"], 21);
    for figure in ["mean_kl", "p99_kl", "max_kl"] {
        assert!(kl[figure].as_f64().unwrap().abs() <= 1e-12, "{figure}: {kl}");
    }
    assert_eq!(kl["top1_agreement"], 1.0);
    assert!((kl["ppl_ratio"].as_f64().unwrap() - 1.0).abs() <= 1e-12);
    assert_eq!(kl["ppl_run"], saved["perplexity"]);
    assert_eq!(same["perplexity"], saved["perplexity"]);

    // Another weight format is another distribution: KL above 0, finite.
    let int4 = json_of(&fx.run(&["--chunks", "3", "--weights", "int4", "--kl-divergence", base_arg, "--json"]));
    let kl = &int4["kl_divergence"];
    let mean = kl["mean_kl"].as_f64().unwrap();
    assert!(mean > 0.0 && mean.is_finite(), "{kl}");
    assert!(kl["p99_kl"].as_f64().unwrap() >= mean && kl["max_kl"].as_f64().unwrap() >= kl["p99_kl"].as_f64().unwrap());
    let out = fx.run(&["--chunks", "3", "--weights", "int4", "--kl-divergence", base_arg]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("KL divergence vs") && stdout.contains("top-1 agreement"), "{stdout}");

    // A comparison against another evaluation is refused, naming what differs.
    assert_clean_failure(&fx.run(&["--chunks", "2", "--kl-divergence", base_arg]), "chunk count 3, this run has 2");
    assert_clean_failure(&fx.run(&["--ctx", "20", "--chunks", "3", "--kl-divergence", base_arg]), "--ctx 16");
    let other_text = fx.path("other.txt");
    std::fs::write(&other_text, TEXT.replace("question", "answer!!")).unwrap();
    let out = fx.run(&["--file", other_text.to_str().unwrap(), "--chunks", "3", "--kl-divergence", base_arg]);
    assert_clean_failure(&out, "another text or tokenizer");
}

#[test]
fn mistakes_are_clear_errors() {
    let fx = Fixture::new();
    let file = |name: &str, contents: &[u8]| {
        let path = fx.path(name);
        std::fs::write(&path, contents).unwrap();
        path.to_str().unwrap().to_string()
    };
    let empty = file("empty.txt", b"");
    assert_clean_failure(&fx.run(&["--file", &empty]), "the text is empty");
    let short = file("short.txt", b"Too short for two windows.\n");
    // 26 bytes + BOS.
    assert_clean_failure(
        &fx.run(&["--file", &short]),
        "the text tokenizes to 27 tokens; a context of 16 needs at least 32",
    );
    let latin1 = file("latin1.txt", b"caf\xe9");
    assert_clean_failure(&fx.run(&["--file", &latin1]), "not UTF-8 text");
    assert_clean_failure(&fx.run(&["--file", "/nonexistent/text.txt"]), "/nonexistent/text.txt");
    assert_clean_failure(&fx.run(&["--ctx", "3"]), "a context of 3 tokens is too small");
    assert_clean_failure(&fx.run(&["--ctx", "1024"]), "--ctx 1024 is larger than the model's context of 512");
    assert_clean_failure(&fx.run(&["--chunks", "0"]), "at least 1");

    let corrupt = file("corrupt.logits", b"SEAMLGTS\x01\x00\x00\x00 and then nothing useful");
    assert_clean_failure(&fx.run(&["--kl-divergence", &corrupt]), "not a usable seam logits file");
    let other = file("other.logits", b"GGUF, not logits");
    assert_clean_failure(&fx.run(&["--kl-divergence", &other]), "magic bytes");
    // A truncated copy of a good file.
    let good = fx.path("good.logits");
    assert!(fx.run(&["--chunks", "2", "--save-logits", good.to_str().unwrap()]).status.success());
    let bytes = std::fs::read(&good).unwrap();
    let truncated = file("truncated.logits", &bytes[..bytes.len() - 100]);
    assert_clean_failure(&fx.run(&["--chunks", "2", "--kl-divergence", &truncated]), "truncated or damaged");

    // An unwritable destination is refused before the evaluation, and nothing is left behind.
    let nowhere = fx.path("no-such-dir/base.logits");
    assert_clean_failure(&fx.run(&["--save-logits", nowhere.to_str().unwrap()]), "no-such-dir");
    assert!(!fx.path("no-such-dir").exists());
    let names: Vec<String> =
        std::fs::read_dir(fx.dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
    assert!(names.iter().all(|n| !n.ends_with(".partial")), "{names:?}");
}
