//! The vendor's `seam` binary (src/bin/seam-example.rs) lists and runs the vendor's backend
//! beside seam's own.

use std::process::Command;

fn seam_example(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_seam-example")).args(args).output().expect("seam-example runs")
}

#[test]
fn lists_and_runs_the_linked_backend() {
    let out = seam_example(&["backends", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = listed.as_array().unwrap().iter().filter_map(|b| b["name"].as_str()).collect();
    assert!(names.contains(&backend_example::NAME) && names.contains(&"reference"), "{names:?}");

    // Greedy tokens on the default model: the example forwards to the reference arithmetic.
    let model = llama_model::default_model::ensure_default_model(None).unwrap();
    let model = model.to_str().unwrap();
    let tokens = |backend: &str| -> serde_json::Value {
        let args = ["run", "--backend", backend, "--model", model, "--prompt", "The capital of France is"];
        let out = seam_example(&[&args[..], &["--max-tokens", "4", "--ignore-eos", "--json"]].concat());
        assert!(out.status.success(), "{backend}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["token_ids"].clone()
    };
    assert_eq!(tokens(backend_example::NAME), tokens("reference"));
}
