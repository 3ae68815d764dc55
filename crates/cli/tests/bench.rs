//! `seam bench` on a tiny random checkpoint: the table and the JSON report carry every figure the
//! benchmark promises, for each backend and format asked for.

use std::process::Command;

#[test]
fn bench_reports_load_prefill_and_decode() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    llama_model::random::write_random_checkpoint(&model, &llama_model::random::tiny_config(), 3).unwrap();
    let json = dir.path().join("bench.json");
    let out = Command::new(env!("CARGO_BIN_EXE_seam"))
        .args(["bench", "--backend", "reference", "--model", model.to_str().unwrap(), "--prompt-lengths", "4,8"])
        .args(["--decode-tokens", "3", "--decode-depth", "5", "--repeats", "2", "--max-context", "64"])
        .args(["--json", json.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("prefill@4") && stdout.contains("decode t/s"), "{stdout}");
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert!(report["machine"]["cores"].as_u64().unwrap() >= 1);
    assert_eq!(report["settings"]["decode_prompt_tokens"], 5, "decode after --decode-depth tokens");
    assert!(stdout.contains("decode after 5 tokens of context"), "{stdout}");
    let results = report["results"].as_array().unwrap();
    assert_eq!(results.len(), 2, "f16 and int4");
    for r in results {
        assert_eq!(r["backend"], "reference");
        assert!(r["load_cold_ms"].as_f64().unwrap() > 0.0 && r["load_warm_ms"].as_f64().unwrap() > 0.0);
        assert!(r["weight_bytes"].as_u64().unwrap() > 0);
        let prefill = r["prefill"].as_array().unwrap();
        assert_eq!(prefill.iter().map(|p| p["prompt_tokens"].as_u64().unwrap()).collect::<Vec<_>>(), vec![4, 8]);
        for p in prefill {
            assert!(p["tokens_per_s"]["min"].as_f64().unwrap() <= p["tokens_per_s"]["median"].as_f64().unwrap());
        }
        assert_eq!(r["decode"]["steps"], 3);
        assert!(r["decode"]["tokens_per_s"]["median"].as_f64().unwrap() > 0.0);
        assert!(
            r["decode"]["step_ms"]["p90_ms"].as_f64().unwrap() >= r["decode"]["step_ms"]["p50_ms"].as_f64().unwrap()
        );
    }
}

#[test]
fn bench_refuses_a_context_too_small() {
    let out = Command::new(env!("CARGO_BIN_EXE_seam"))
        .args(["bench", "--backend", "reference", "--model", "/nonexistent", "--max-context", "8"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("error: --max-context 8 cannot hold 512 tokens") && !stderr.contains("panicked"),
        "{stderr}"
    );
}

#[test]
fn bench_context_check_counts_what_the_runs_hold() {
    // The longest run is the decode: 2 tokens of depth and 6 steps fit a context of 8 (a bound of
    // 16 + --decode-tokens once refused this); one more step does not.
    let args = |tokens: &str| {
        let mut args = vec!["bench", "--backend", "reference", "--model", "/nonexistent", "--max-context", "8"];
        args.extend(["--prompt-lengths", "4", "--decode-depth", "2", "--decode-tokens", tokens]);
        let out = Command::new(env!("CARGO_BIN_EXE_seam")).args(args).output().unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let fits = args("6");
    assert!(!fits.contains("cannot hold") && fits.contains("/nonexistent") && !fits.contains("panicked"), "{fits}");
    let over = args("7");
    assert!(over.starts_with("error: --max-context 8 cannot hold 9 tokens"), "{over}");
}
