//! `export_gguf` (model directory → llama.cpp GGUF): exports of random checkpoints read back by
//! the importer to the same weights and config, the metadata llama.cpp reads, and typed errors for
//! tokenizers that cannot be exported.

use gguf::{GgmlType, GgufFile};
use llama_model::export::{export_gguf, ExportError, GgufMatrixType, TokenizerSource};
use llama_model::import::{import_gguf, ImportOptions, ImportReport};
use llama_model::random::{tiny_config, tiny_llama32_config, write_random_checkpoint};
use llama_model::weights::{load_weights, LlamaWeights, TensorRef};
use llama_model::LlamaConfig;
use serde_json::Value as Json;
use session_api::WeightFormat;
use std::path::{Path, PathBuf};

/// A byte-level BPE tokenizer.json with one token per id, a merge, a special added token and
/// the given pre-tokenizer.
fn write_tokenizer(dir: &Path, vocab: usize, pre_tokenizer: Json) {
    let token = |i: usize| match i {
        0 => "a".to_string(),
        1 => "b".to_string(),
        2 => "ab".to_string(),
        i => format!("t{i}"),
    };
    // The last id is left out of the vocabulary: the export pads it.
    let entries: serde_json::Map<String, Json> = (0..vocab - 2).map(|i| (token(i), Json::from(i))).collect();
    let tok = serde_json::json!({
        "model": {"type": "BPE", "vocab": entries, "merges": [["a", "b"]]},
        "added_tokens": [
            {"id": vocab - 2, "content": "<|end|>", "special": true},
            {"id": vocab, "content": "<|image|>", "special": true},
        ],
        "pre_tokenizer": pre_tokenizer,
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"add_bos_token": true, "chat_template": "{{ x }}"}"#)
        .unwrap();
}

fn smollm_pre() -> Json {
    serde_json::json!({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": true},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}]})
}

fn model(dir: &Path, config: &LlamaConfig, seed: u64) -> PathBuf {
    let path = dir.join("model");
    write_random_checkpoint(&path, config, seed).unwrap();
    write_tokenizer(&path, config.vocab_size, smollm_pre());
    path
}

fn tensors(w: &LlamaWeights) -> Vec<(String, Vec<f32>)> {
    w.tensors()
        .into_iter()
        .map(|(n, t)| match t {
            TensorRef::Norm(v) => (n, v.to_vec()),
            TensorRef::Matrix(m) => (n, m.to_f32()),
        })
        .collect()
}

fn import(gguf: &Path, out: &Path) -> ImportReport {
    import_gguf(gguf, out, &ImportOptions::default()).unwrap()
}

#[test]
fn f16_export_reads_back_to_the_same_weights_and_config() {
    for config in [tiny_config(), tiny_llama32_config()] {
        let dir = tempfile::tempdir().unwrap();
        let src = model(dir.path(), &config, 11);
        let gguf = dir.path().join("m.F16.gguf");
        let report = export_gguf(&src, &gguf, GgufMatrixType::F16, &TokenizerSource::ModelDir { pre: None }).unwrap();
        assert_eq!(report.tokenizer_pre, "smollm");
        assert_eq!(report.dropped_tokens, ["<|image|>"]);
        assert_eq!(report.matrices, 1 + 7 * config.num_hidden_layers + usize::from(!config.tie_word_embeddings));

        let back = dir.path().join("back");
        let imported = import(&gguf, &back);
        // The importer undoes the q/k row order and rebuilds llama3 rope scaling from rope_freqs.
        let want = LlamaConfig { eos_token_ids: config.eos_token_ids[..1].to_vec(), ..config.clone() };
        assert_eq!(imported.config, want);
        let a = load_weights(&src, WeightFormat::F16, None).unwrap();
        let b = load_weights(&back, WeightFormat::F16, None).unwrap();
        assert!(tensors(&a) == tensors(&b), "F16 GGUF round trip changed a tensor");
    }
}

#[test]
fn q4_1_export_carries_seams_int4_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_llama32_config();
    let src = model(dir.path(), &config, 5);
    let gguf = dir.path().join("m.Q4_1.gguf");
    export_gguf(&src, &gguf, GgufMatrixType::Q4_1, &TokenizerSource::ModelDir { pre: None }).unwrap();
    let f = GgufFile::open(&gguf).unwrap();
    // seam's int4 keeps the (tied) embedding at 8 bits: Q8_0, as llama.cpp's own Q4_1 files do.
    for t in f.tensors().iter().filter(|t| t.dims.len() == 2) {
        let want = if t.name == "token_embd.weight" { GgmlType::Q8_0 } else { GgmlType::Q4_1 };
        assert_eq!(t.ggml_type, want, "{}", t.name);
    }
    assert!(f.tensors().iter().filter(|t| t.dims.len() == 1).all(|t| t.ggml_type == GgmlType::F32));

    let back = dir.path().join("back");
    let report = import(&gguf, &back);
    assert_eq!((report.int4_exact, report.int8_exact), (7 * config.num_hidden_layers, 1));
    assert_eq!((report.int4_requantized, report.int8_requantized), (0, 0));
    // seam's int4 of the source (what seam runs) and of the import are the same values ...
    let ours = load_weights(&src, WeightFormat::Int4, None).unwrap();
    let theirs = load_weights(&back, WeightFormat::Int4, None).unwrap();
    assert!(tensors(&ours) == tensors(&theirs), "Q4_1 GGUF round trip changed an int4 matrix");
    // ... and within Q4_1's error of the f16 weights: half a step, max-min over 15, per group.
    let f16 = load_weights(&src, WeightFormat::F16, None).unwrap();
    for ((name, exact), (_, quantized)) in tensors(&f16).iter().zip(tensors(&theirs)) {
        for (group, back) in exact.chunks(32).zip(quantized.chunks(32)) {
            let (lo, hi) = group.iter().fold((f32::MAX, f32::MIN), |(l, h), &x| (l.min(x), h.max(x)));
            let step = (hi - lo) / 15.0;
            for (x, y) in group.iter().zip(back) {
                // (plus the f16 rounding of the scale and bias)
                assert!((x - y).abs() <= 0.51 * step + 1e-3 * lo.abs().max(hi.abs()), "{name}: {x} vs {y}");
            }
        }
    }
}

#[test]
fn metadata_is_what_llama_cpp_reads() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_llama32_config();
    let src = model(dir.path(), &config, 1);
    let gguf = dir.path().join("m.gguf");
    export_gguf(&src, &gguf, GgufMatrixType::F16, &TokenizerSource::ModelDir { pre: Some("llama-bpe".into()) })
        .unwrap();
    let f = GgufFile::open(&gguf).unwrap();
    assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(f.get_u64("general.file_type").unwrap(), 1);
    for (key, want) in [
        ("llama.block_count", config.num_hidden_layers),
        ("llama.embedding_length", config.hidden_size),
        ("llama.feed_forward_length", config.intermediate_size),
        ("llama.attention.head_count", config.num_attention_heads),
        ("llama.attention.head_count_kv", config.num_key_value_heads),
        ("llama.rope.dimension_count", config.head_dim),
        ("llama.context_length", config.max_position_embeddings),
        ("llama.vocab_size", config.vocab_size),
    ] {
        assert_eq!(f.get_u64(key).unwrap(), want as u64, "{key}");
    }
    assert_eq!(f.get_f64("llama.rope.freq_base").unwrap(), 500_000.0);
    assert_eq!(f.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(f.get_str("tokenizer.ggml.pre").unwrap(), "llama-bpe");
    let tokens = f.get_strings("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), config.vocab_size);
    assert_eq!(tokens[config.vocab_size - 2], "<|end|>");
    assert_eq!(tokens[config.vocab_size - 1], format!("[PAD{}]", config.vocab_size - 1));
    let types = f.get_array("tokenizer.ggml.token_type").unwrap().to_i64s().unwrap();
    assert_eq!(&types[config.vocab_size - 3..], &[1, 3, 5]);
    assert_eq!(f.get_strings("tokenizer.ggml.merges").unwrap(), &["a b".to_string()]);
    assert_eq!(f.get_u64("tokenizer.ggml.bos_token_id").unwrap(), 1);
    assert!(f.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    assert_eq!(f.get_str("tokenizer.chat_template").unwrap(), "{{ x }}");
    // Tied embeddings: no output.weight; llama3 rope: rope_freqs.
    let mut names: Vec<&str> = f.tensors().iter().map(|t| t.name.as_str()).collect();
    names.sort();
    assert_eq!(names.len(), 1 + 9 * config.num_hidden_layers + 1 + 1);
    for name in
        ["token_embd.weight", "output_norm.weight", "rope_freqs.weight", "blk.1.attn_q.weight", "blk.0.ffn_down.weight"]
    {
        assert!(names.contains(&name), "{name} missing");
    }
    assert!(!names.contains(&"output.weight"));
    let q = f.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!(q.dims, [config.hidden_size as u64, config.q_dim() as u64]);
}

#[test]
fn tokenizer_mistakes_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config();
    let src = model(dir.path(), &config, 2);
    let out = dir.path().join("x.gguf");
    let export = || export_gguf(&src, &out, GgufMatrixType::F16, &TokenizerSource::ModelDir { pre: None });

    write_tokenizer(&src, config.vocab_size, serde_json::json!({"type": "Whitespace"}));
    assert!(matches!(export(), Err(ExportError::Tokenizer { message, .. }) if message.contains("--tokenizer-pre")));
    std::fs::write(src.join("tokenizer.json"), r#"{"model": {"type": "Unigram"}}"#).unwrap();
    assert!(matches!(export(), Err(ExportError::Tokenizer { message, .. }) if message.contains("Unigram")));
    write_tokenizer(&src, config.vocab_size + 5, smollm_pre());
    assert!(matches!(export(), Err(ExportError::Tokenizer { message, .. }) if message.contains("outside")));
    std::fs::remove_file(src.join("tokenizer.json")).unwrap();
    assert!(matches!(export(), Err(ExportError::Model(_))));
    // A tokenizer GGUF whose vocabulary does not match the model's.
    write_tokenizer(&src, config.vocab_size, smollm_pre());
    let other = model(&dir.path().join("other"), &LlamaConfig { vocab_size: 128, ..config.clone() }, 2);
    let small = dir.path().join("small.gguf");
    export_gguf(&other, &small, GgufMatrixType::F16, &TokenizerSource::ModelDir { pre: None }).unwrap();
    let from_small = export_gguf(&src, &out, GgufMatrixType::F16, &TokenizerSource::Gguf(small.clone()));
    assert!(matches!(from_small, Err(ExportError::Tokenizer { message, .. }) if message.contains("128 tokens")));
    assert!(!out.exists());
}
