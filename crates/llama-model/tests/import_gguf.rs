//! `import_gguf` on small GGUF Llamas written with the `gguf` crate: config, tokenizer, the q/k
//! un-permutation, Q4_1 carried exactly, f16 = dequantized values, and typed errors.

use gguf::{hf_dims, Array, GgmlType, GgufWriter, Value};
use half::f16;
use llama_model::gguf_layout::rope_order;
use llama_model::import::{import_gguf, ImportOptions};
use llama_model::random::{tiny_config, Rng};
use llama_model::weights::load_weights;
use llama_model::{LlamaConfig, Matrix, ModelError, RopeScaling};
use session_api::WeightFormat;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// The model's shape: [`tiny_config`] with the made-up tokenizer's vocabulary, a shorter context
/// and SmolLM's rope theta.
fn shape() -> LlamaConfig {
    LlamaConfig { vocab_size: VOCAB, max_position_embeddings: 256, rope_theta: 100_000.0, ..tiny_config() }
}

/// Vocabulary size of the made-up tokenizer ([`vocab`]), and so of the model.
const VOCAB: usize = 64;

/// `n` test values in `[-0.1, 0.1)`.
fn noise(seed: u64, n: usize) -> Vec<f32> {
    Rng::new(seed).uniform_vec(n, 0.1)
}

/// A made-up byte-level BPE vocabulary: 3 control tokens, single characters (in GPT-2's byte
/// encoding: `Ġ` is a space, `Ċ` a newline), merged tokens, then user-defined fillers.
fn vocab() -> (Vec<String>, Vec<i32>, Vec<String>) {
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"].map(String::from).to_vec();
    let mut types = vec![3; 3];
    for c in ('a'..='z').chain('0'..='9').chain(['Ġ', ',', '!', 'Ċ']) {
        tokens.push(c.to_string());
        types.push(1);
    }
    let merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġ 1"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
        types.push(1);
    }
    while tokens.len() < VOCAB {
        tokens.push(format!("<extra_{}>", tokens.len()));
        types.push(4);
    }
    (tokens, types, merges.map(String::from).to_vec())
}

fn id(tokens: &[String], t: &str) -> u32 {
    tokens.iter().position(|x| x == t).unwrap() as u32
}

/// The HF-order values of every matrix, keyed by GGUF name, so tests can compare against them.
struct Tiny {
    writer: GgufWriter,
    hf: std::collections::HashMap<String, (Vec<f32>, usize, usize, GgmlType)>,
}

/// Matrix types per layer (one row per layer of [`shape`]): (q, k, v, o, gate, up, down).
const LAYER_TYPES: [[GgmlType; 7]; 2] = {
    use GgmlType::*;
    [[Q4_1, Q4_1, Q8_0, F16, Q4_1, F32, Q4_1], [F32, F16, Q4_1, Q4_1, Q8_0, Q4_1, F16]]
};

fn tiny(arch: &str, tied: bool) -> Tiny {
    let c = shape();
    assert_eq!(LAYER_TYPES.len(), c.num_hidden_layers);
    let (hidden, ffn, head_dim) = (c.hidden_size, c.intermediate_size, c.head_dim);
    let (heads, kv_heads) = (c.num_attention_heads, c.num_key_value_heads);
    let mut w = GgufWriter::new();
    let (tokens, types, merges) = vocab();
    let meta: Vec<(&str, Value)> = vec![
        ("general.architecture", arch.into()),
        ("general.name", "tiny".into()),
        ("llama.block_count", (c.num_hidden_layers as u32).into()),
        ("llama.context_length", (c.max_position_embeddings as u32).into()),
        ("llama.embedding_length", (hidden as u32).into()),
        ("llama.feed_forward_length", (ffn as u32).into()),
        ("llama.attention.head_count", (heads as u32).into()),
        ("llama.attention.head_count_kv", (kv_heads as u32).into()),
        ("llama.rope.freq_base", c.rope_theta.into()),
        ("llama.attention.layer_norm_rms_epsilon", c.rms_norm_eps.into()),
        ("llama.rope.dimension_count", (head_dim as u32).into()),
        ("tokenizer.ggml.model", "gpt2".into()),
        ("tokenizer.ggml.pre", "smollm".into()),
        ("tokenizer.ggml.tokens", Array::String(tokens).into()),
        ("tokenizer.ggml.token_type", Array::I32(types).into()),
        ("tokenizer.ggml.merges", Array::String(merges).into()),
        ("tokenizer.ggml.bos_token_id", c.bos_token_ids[0].into()),
        ("tokenizer.ggml.eos_token_id", c.eos_token_ids[0].into()),
        ("tokenizer.ggml.padding_token_id", 0u32.into()),
        ("tokenizer.ggml.add_bos_token", false.into()),
        ("tokenizer.chat_template", "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}".into()),
    ];
    for (k, v) in meta {
        w.add_metadata(k, v).unwrap();
    }
    let mut hf = std::collections::HashMap::new();
    let mut seed = 0;
    let mut matrix =
        |w: &mut GgufWriter, name: String, rows: usize, cols: usize, ty: GgmlType, n_head: Option<usize>| {
            seed += 1;
            let values = noise(seed, rows * cols);
            let stored = match n_head {
                Some(n) => rope_order::to_llama_cpp(&values, rows, n),
                None => values.clone(),
            };
            w.add_tensor_f32(name.clone(), &hf_dims(&[rows, cols]), &stored, ty).unwrap();
            hf.insert(name, (values, rows, cols, ty));
        };
    let norm = |w: &mut GgufWriter, name: String, seed: u64| {
        let v: Vec<f32> = noise(seed, hidden).iter().map(|x| 1.0 + x).collect();
        w.add_tensor_f32(name, &[hidden as u64], &v, GgmlType::F32).unwrap();
    };
    matrix(&mut w, "token_embd.weight".into(), VOCAB, hidden, GgmlType::Q8_0, None);
    for (l, t) in LAYER_TYPES.iter().enumerate() {
        let b = |s: &str| format!("blk.{l}.{s}.weight");
        norm(&mut w, b("attn_norm"), 100 + l as u64);
        matrix(&mut w, b("attn_q"), heads * head_dim, hidden, t[0], Some(heads));
        matrix(&mut w, b("attn_k"), kv_heads * head_dim, hidden, t[1], Some(kv_heads));
        matrix(&mut w, b("attn_v"), kv_heads * head_dim, hidden, t[2], None);
        matrix(&mut w, b("attn_output"), hidden, heads * head_dim, t[3], None);
        norm(&mut w, b("ffn_norm"), 200 + l as u64);
        matrix(&mut w, b("ffn_gate"), ffn, hidden, t[4], None);
        matrix(&mut w, b("ffn_up"), ffn, hidden, t[5], None);
        matrix(&mut w, b("ffn_down"), hidden, ffn, t[6], None);
    }
    norm(&mut w, "output_norm.weight".into(), 300);
    if !tied {
        matrix(&mut w, "output.weight".into(), VOCAB, hidden, GgmlType::Q4_1, None);
    }
    Tiny { writer: w, hf }
}

fn write(t: &GgufWriter, dir: &Path) -> std::path::PathBuf {
    let path = dir.join("tiny.gguf");
    t.write_file(&path).unwrap();
    path
}

/// What ggml computes for the HF-order matrix: each row quantized to `ty` and dequantized.
fn ggml_values(values: &[f32], ty: GgmlType) -> Vec<f32> {
    let bytes = gguf::quantize(ty, values).unwrap();
    let mut out = vec![0.0; values.len()];
    gguf::dequantize(ty, &bytes, &mut out).unwrap();
    out
}

fn same_bits(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "{what}[{i}]: {x} vs {y}");
    }
}

#[test]
fn imports_a_tiny_llama() {
    let t = tiny("llama", false);
    let dir = tempfile::tempdir().unwrap();
    let gguf_path = write(&t.writer, dir.path());
    let out = dir.path().join("model");
    let calls = AtomicU64::new(0);
    let progress = |done: u64, total: u64| {
        assert!(done <= total);
        calls.fetch_add(1, Ordering::Relaxed);
    };
    let report =
        import_gguf(&gguf_path, &out, &ImportOptions { progress: Some(&progress), ..Default::default() }).unwrap();
    let layers = shape().num_hidden_layers;
    let n_matrices = 1 + layers * 7 + 1;
    assert_eq!(calls.load(Ordering::Relaxed), (n_matrices + layers * 2 + 1) as u64);
    assert_eq!(report.norms, layers * 2 + 1);
    assert_eq!(report.f16_dequantized, n_matrices);
    let q41 = LAYER_TYPES.iter().flatten().filter(|&&t| t == GgmlType::Q4_1).count() + 1;
    assert_eq!(report.int4_exact, q41);
    // The Q8_0 embedding is carried into int8; the layers' Q8_0, F16 and F32 matrices are
    // requantized to int4 (one format for every layer matrix).
    assert_eq!((report.int8_exact, report.int8_requantized), (1, 0));
    assert_eq!(report.int4_requantized, n_matrices - q41 - 1);
    assert_eq!(report.gguf_types["Q4_1"], q41);

    let config = LlamaConfig::from_file(&out.join("config.json")).unwrap();
    assert_eq!(config, report.config);
    assert_eq!(config, shape());
    let generation: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("generation_config.json")).unwrap()).unwrap();
    assert_eq!(generation["pad_token_id"], 0);
    assert_eq!(generation["eos_token_id"], 2);

    // Both weight files load through the model loader.
    let int4 = load_weights(&out, WeightFormat::Int4, None).unwrap();
    let float = load_weights(&out, WeightFormat::F16, None).unwrap();
    let get = |w: &llama_model::LlamaWeights, gguf_name: &str| -> Matrix {
        if gguf_name == "token_embd.weight" {
            return w.embed.clone();
        }
        if gguf_name == "output.weight" {
            return w.lm_head.clone().unwrap();
        }
        let (l, short) = gguf_name.strip_prefix("blk.").unwrap().split_once('.').unwrap();
        let layer = &w.layers[l.parse::<usize>().unwrap()];
        match short.strip_suffix(".weight").unwrap() {
            "attn_q" => layer.wq.clone(),
            "attn_k" => layer.wk.clone(),
            "attn_v" => layer.wv.clone(),
            "attn_output" => layer.wo.clone(),
            "ffn_gate" => layer.w_gate.clone(),
            "ffn_up" => layer.w_up.clone(),
            "ffn_down" => layer.w_down.clone(),
            other => panic!("{other}"),
        }
    };
    for (name, (values, rows, cols, ty)) in &t.hf {
        // ggml's values for the HF-order matrix. For q and k this is computed on the *unpermuted*
        // matrix, so agreement also checks that the importer undid the permutation.
        let deq = ggml_values(values, *ty);
        let f = get(&float, name);
        let Matrix::F16 { rows: r, cols: c, data } = &f else { panic!("{name}: not f16") };
        assert_eq!((*r, *c), (*rows, *cols), "{name}");
        let want: Vec<f16> = deq.iter().map(|&v| f16::from_f32(v)).collect();
        assert!(data == &want, "{name}: f16 weights differ from the dequantized GGUF values");

        let q = match get(&int4, name) {
            Matrix::Int8(q) => {
                // The Q8_0 embedding: carried exactly, scales are Q8_0's d.
                assert_eq!((name.as_str(), *ty), ("token_embd.weight", GgmlType::Q8_0));
                same_bits(&q.dequantize(), &deq, name);
                continue;
            }
            Matrix::Int4(q) => q,
            Matrix::F16 { .. } => panic!("{name}: f16 in the int4 file"),
        };
        if *ty == GgmlType::Q4_1 {
            // Carried exactly: the same values bit for bit, the scales and biases are d and m.
            same_bits(&q.dequantize(), &deq, name);
            let bytes = gguf::quantize(GgmlType::Q4_1, values).unwrap();
            let blocks: Vec<_> = gguf::q4_1_blocks(&bytes).unwrap().collect();
            assert_eq!(q.scales, blocks.iter().map(|b| b.d).collect::<Vec<_>>(), "{name}");
            assert_eq!(q.biases, blocks.iter().map(|b| b.m).collect::<Vec<_>>(), "{name}");
        } else {
            assert_eq!(q, llama_model::int4::quantize(&deq, *rows, *cols).unwrap(), "{name}: requantized");
        }
    }
    // The permuted matrices really were permuted in the file (else the check above proves little).
    let (q0, rows, _, _) = &t.hf["blk.1.attn_q.weight"];
    assert_ne!(&rope_order::to_llama_cpp(q0, *rows, shape().num_attention_heads), q0);

    // Norms are f32, unchanged.
    let g = gguf::GgufFile::open(&gguf_path).unwrap();
    assert_eq!(int4.layers[1].mlp_norm, g.dequantize("blk.1.ffn_norm.weight").unwrap());
    assert_eq!(float.final_norm, g.dequantize("output_norm.weight").unwrap());
    assert_eq!(float.layers[0].attn_norm, g.dequantize("blk.0.attn_norm.weight").unwrap());
}

#[test]
fn tied_embeddings_and_the_tokenizer() {
    let t = tiny("llama", true);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("model");
    let report = import_gguf(&write(&t.writer, dir.path()), &out, &ImportOptions::default()).unwrap();
    assert!(report.config.tie_word_embeddings);
    assert!(load_weights(&out, WeightFormat::Int4, None).unwrap().lm_head.is_none());

    let (tokens, _, _) = vocab();
    let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    let ids = |text: &str| tok.encode(text, false).unwrap().get_ids().to_vec();
    let want = |ts: &[&str]| ts.iter().map(|t| id(&tokens, t)).collect::<Vec<_>>();
    assert_eq!(ids("hello, world!"), want(&["hello", ",", "Ġw", "or", "l", "d", "!"]));
    // Digits are split one by one (smollm pre-tokenizer) even though "Ġ1" is a merge... of a space
    // and a digit, which the digit split keeps apart.
    assert_eq!(ids("12"), want(&["1", "2"]));
    assert_eq!(ids("<|im_start|>hello\n<|im_end|>"), want(&["<|im_start|>", "hello", "Ċ", "<|im_end|>"]));
    assert_eq!(tok.decode(&ids("hello, world!"), false).unwrap(), "hello, world!");
    assert_eq!(tok.get_vocab_size(true), VOCAB);
    assert_eq!(tok.decode(&want(&["<|im_start|>", "hello"]), true).unwrap(), "hello");

    let tc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tokenizer_config.json")).unwrap()).unwrap();
    assert_eq!(tc["bos_token"], "<|im_start|>");
    assert_eq!(tc["eos_token"], "<|im_end|>");
    assert_eq!(tc["pad_token"], "<|endoftext|>");
    assert_eq!(tc["add_bos_token"], false);
    assert!(tc["chat_template"].as_str().unwrap().starts_with("{% for m in messages %}"));
    assert_eq!(tc["added_tokens_decoder"]["1"]["special"], true);
    assert_eq!(tc["added_tokens_decoder"][(VOCAB - 1).to_string()]["special"], false);
    let tj: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tokenizer.json")).unwrap()).unwrap();
    assert_eq!(tj["model"]["type"], "BPE");
    assert_eq!(tj["pre_tokenizer"]["pretokenizers"][0]["type"], "Digits");
    assert_eq!(tj["added_tokens"].as_array().unwrap().len(), 3 + (VOCAB - 3 - 40 - 7));
}

#[test]
fn llama3_tokenizer_and_bos() {
    // The tiny model with a llama-bpe (Llama 3) pre-tokenizer that adds BOS.
    let w =
        build_with(&[("tokenizer.ggml.pre", "llama-bpe".into()), ("tokenizer.ggml.add_bos_token", true.into())], &[]);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("model");
    import_gguf(&write(&w, dir.path()), &out, &ImportOptions::default()).unwrap();
    let (tokens, _, _) = vocab();
    let tok = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    let enc = tok.encode("hello 12", true).unwrap();
    // BOS first; Llama 3 groups up to three digits, and "Ġ" stays apart from the digits.
    let got: Vec<&str> = enc.get_ids().iter().map(|&i| tokens[i as usize].as_str()).collect();
    assert_eq!(got, ["<|im_start|>", "hello", "Ġ", "1", "2"]);
}

/// The tiny model with some metadata overridden or added, and extra F32 tensors.
fn build_with(overrides: &[(&str, Value)], extra: &[(&str, Vec<f32>)]) -> GgufWriter {
    // Re-read a tiny model and copy it key by key, replacing the overridden keys.
    let base = GgufWriter::to_bytes(&tiny("llama", true).writer);
    let f = gguf::GgufFile::from_bytes(base).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in f.metadata() {
        let v = overrides.iter().find(|(o, _)| o == k).map(|(_, v)| v.clone()).unwrap_or_else(|| v.clone());
        w.add_metadata(k.clone(), v).unwrap();
    }
    for (k, v) in overrides {
        if f.get(k).is_none() {
            w.add_metadata(*k, v.clone()).unwrap();
        }
    }
    for info in f.tensors() {
        w.add_tensor_bytes(info.name.clone(), &info.dims, info.ggml_type, f.tensor_bytes(info).to_vec()).unwrap();
    }
    for (name, v) in extra {
        w.add_tensor_f32(*name, &[v.len() as u64], v, GgmlType::F32).unwrap();
    }
    w
}

fn import_err(w: &GgufWriter) -> ModelError {
    let dir = tempfile::tempdir().unwrap();
    let err = import_gguf(&write(w, dir.path()), &dir.path().join("m"), &ImportOptions::default()).unwrap_err();
    assert!(!dir.path().join("m").join("config.json").exists());
    err
}

#[test]
fn llama3_rope_freqs_map_to_rope_scaling_or_fail() {
    // The divisors llama.cpp's converter writes for factor 32, low 1, high 4, original 8192.
    let base = LlamaConfig::from_json_str(
        r#"{"model_type": "llama", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 100000.0}"#,
    )
    .unwrap();
    let scaling = RopeScaling::Llama3 {
        factor: 32.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let scaled = LlamaConfig { rope_scaling: Some(scaling.clone()), ..base.clone() }.rope_inv_freq();
    let divisors: Vec<f32> = base.rope_inv_freq().iter().zip(&scaled).map(|(p, s)| p / s).collect();
    assert!(divisors.iter().any(|&d| d > 1.0) && divisors.contains(&1.0));
    let dir = tempfile::tempdir().unwrap();
    let w = build_with(&[], &[("rope_freqs.weight", divisors.clone())]);
    let report = import_gguf(&write(&w, dir.path()), &dir.path().join("m"), &ImportOptions::default()).unwrap();
    assert_eq!(report.config.rope_scaling, Some(scaling));
    assert_eq!(
        LlamaConfig::from_file(&dir.path().join("m/config.json")).unwrap().rope_scaling,
        report.config.rope_scaling
    );

    // Divisors of some other shape of scaling cannot be mapped: an error, not silence.
    let odd: Vec<f32> = (0..shape().head_dim / 2).map(|i| 1.0 + i as f32).collect();
    assert!(matches!(import_err(&build_with(&[], &[("rope_freqs.weight", odd)])), ModelError::Unsupported { .. }));
    let yarn =
        build_with(&[("llama.rope.scaling.type", "yarn".into()), ("llama.rope.scaling.factor", 4.0f32.into())], &[]);
    assert!(matches!(import_err(&yarn), ModelError::Unsupported { .. }));
}

#[test]
fn unsupported_and_broken_files_are_typed_errors() {
    let e = import_err(&tiny("gpt2", true).writer);
    assert!(matches!(&e, ModelError::UnsupportedArchitecture { found } if found == "gpt2"), "{e:?}");
    let e = import_err(&build_with(&[("tokenizer.ggml.model", "llama".into())], &[]));
    assert!(matches!(&e, ModelError::Unsupported { what } if what.contains("SentencePiece")), "{e:?}");
    let e = import_err(&build_with(&[("tokenizer.ggml.pre", "deepseek-coder".into())], &[]));
    assert!(matches!(&e, ModelError::Unsupported { what } if what.contains("deepseek-coder")), "{e:?}");
    let e = import_err(&build_with(&[], &[("blk.0.attn_q.bias", vec![0.0; shape().hidden_size])]));
    assert!(matches!(&e, ModelError::Unsupported { what } if what.contains("attn_q.bias")), "{e:?}");
    let e = import_err(&build_with(&[("llama.rope.dimension_count", 8u32.into())], &[]));
    assert!(matches!(&e, ModelError::Unsupported { .. }), "{e:?}");
    let e = import_err(&build_with(&[("llama.embedding_length", "wide".into())], &[]));
    assert!(matches!(&e, ModelError::Config { .. }), "{e:?}");
    let e = import_err(&build_with(&[("llama.feed_forward_length", 96u32.into())], &[]));
    assert!(matches!(&e, ModelError::Shape { .. }), "{e:?}");

    // Truncated at several points: inside the header, the metadata, and the tensor data.
    let bytes = tiny("llama", true).writer.to_bytes();
    let dir = tempfile::tempdir().unwrap();
    for len in [0, 10, 200, 3000, bytes.len() / 2, bytes.len() - 100] {
        let path = dir.path().join(format!("cut{len}.gguf"));
        std::fs::write(&path, &bytes[..len]).unwrap();
        let e = import_gguf(&path, &dir.path().join("m"), &ImportOptions::default()).unwrap_err();
        assert!(matches!(&e, ModelError::Truncated { path: p, .. } if p == &path), "{len}: {e:?}");
    }
    let e = import_gguf(&dir.path().join("absent.gguf"), &dir.path().join("m"), &ImportOptions::default()).unwrap_err();
    assert!(matches!(e, ModelError::MissingFile { .. }), "{e:?}");
}
