//! Fuzzing what llama-model reads from untrusted model directories: safetensors files
//! ([`TensorStore`]) and `config.json` ([`LlamaConfig`], with [`GenerationConfig`] on the same
//! text). A mutated file must load into a value that keeps the crate's invariants or fail with a
//! [`ModelError`], never panic or allocate beyond what its bytes justify.
//!
//! Runs a bounded number of cases in `cargo test`; `SEAM_FUZZ_CASES` / `SEAM_FUZZ_SEED` run longer
//! (docs/dev/fuzzing.md). Failing inputs land in `tests/fuzz-regressions/<target>/` and are
//! replayed first on every run.

use fuzz_support::{Fuzz, InputKind};
use half::{bf16, f16};
use llama_model::tensor_store::{write_safetensors, write_safetensors_raw, Dtype, OwnedTensor, RawTensor};
use llama_model::{random, GenerationConfig, LlamaConfig, ModelError};
use std::collections::BTreeMap;
use std::path::Path;

#[global_allocator]
static ALLOC: fuzz_support::CountingAllocator = fuzz_support::CountingAllocator;

// ---------------------------------------------------------------------------------------------
// safetensors
// ---------------------------------------------------------------------------------------------

/// Seeds written by the crate's own writers: every dtype the reader converts, the integer types it
/// only hands out as bytes, a scalar, an empty tensor, with and without `__metadata__`.
fn safetensors_seeds(dir: &Path) -> Vec<Vec<u8>> {
    let path = dir.join("seed.safetensors");
    let read = |path: &Path| std::fs::read(path).unwrap();
    let mut seeds = Vec::new();

    let tensors = vec![
        (
            "model.norm.weight".to_string(),
            OwnedTensor::F32 { shape: vec![2, 3], data: vec![1.0, -2.0, 3.5, 0.0, 1e-3, 65504.0] },
        ),
        (
            "model.embed_tokens.weight".to_string(),
            OwnedTensor::F16 { shape: vec![4], data: [0.5, 1.0, -1.0, 2.0].map(f16::from_f32).to_vec() },
        ),
        ("q.int4".to_string(), OwnedTensor::U8 { shape: vec![1, 3], data: vec![0, 7, 255] }),
        ("q.int8".to_string(), OwnedTensor::I8 { shape: vec![2], data: vec![-128, 127] }),
    ];
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string()), ("seam".to_string(), "fuzz".to_string())]);
    write_safetensors(&path, &tensors, &metadata).unwrap();
    seeds.push(read(&path));

    let bf: Vec<u8> = [1.5f32, -3.0, 0.25].iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect();
    let ints: Vec<u8> = [1i32, -2, 3].iter().flat_map(|x| x.to_le_bytes()).collect();
    let raw = [
        RawTensor { name: "bf", dtype: Dtype::BF16, shape: &[3], bytes: &bf },
        RawTensor { name: "ints", dtype: Dtype::I32, shape: &[3, 1], bytes: &ints },
        RawTensor { name: "scalar", dtype: Dtype::F32, shape: &[], bytes: &2.5f32.to_le_bytes() },
        RawTensor { name: "empty", dtype: Dtype::F16, shape: &[0, 5], bytes: &[] },
    ];
    write_safetensors_raw(&path, &raw, &BTreeMap::new()).unwrap();
    seeds.push(read(&path));

    write_safetensors(&path, &[], &BTreeMap::new()).unwrap();
    seeds.push(read(&path));
    seeds
}

/// Mutates a safetensors file where its structure is: half of the time the JSON header (with the
/// 8-byte length in front rewritten to match, as a writer would, most of the time), otherwise
/// any byte. Generic byte mutations alone nearly always break the header's exact length and so
/// never get past the first check.
fn mutate_safetensors(rng: &mut fuzz_support::Rng, data: &mut Vec<u8>, seeds: &[Vec<u8>]) {
    let declared = data.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize);
    let Some(header_len) = declared.filter(|&n| rng.chance(1, 2) && n <= data.len() - 8) else {
        return fuzz_support::mutate_bytes(rng, data, seeds);
    };
    let mut header = data[8..8 + header_len].to_vec();
    fuzz_support::mutate_json(rng, &mut header, seeds);
    let length = if rng.chance(7, 8) { header.len() as u64 } else { header_len as u64 };
    let mut out = length.to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out.extend_from_slice(&data[8 + header_len..]);
    *data = out;
}

/// Opens `input` as a safetensors file and reads every tensor it lists in every way.
fn check_safetensors(path: &Path, input: &[u8]) -> bool {
    std::fs::write(path, input).unwrap();
    let store = match llama_model::tensor_store::TensorStore::open_file(path) {
        Ok(store) => store,
        Err(e) => {
            // The file exists and is readable: whatever is wrong is in its bytes.
            assert!(matches!(e, ModelError::Truncated { .. } | ModelError::Corrupt { .. }), "{e:?}");
            assert!(!e.to_string().is_empty());
            return false;
        }
    };
    let _ = store.metadata();
    assert_eq!(store.paths(), vec![path]);
    for name in store.names() {
        assert!(store.contains(name));
        let shape = store.shape(name).unwrap().to_vec();
        let dtype = store.dtype(name).unwrap();
        assert_eq!(store.path_of(name).unwrap(), path);
        let bytes = store.bytes(name).unwrap();
        // safetensors checked the byte range against the shape: the elements are all there.
        let elements = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).expect("validated shape");
        let bits = elements.checked_mul(dtype.bitsize()).expect("validated size");
        assert_eq!(bytes.len(), bits.div_ceil(8), "tensor '{name}' of {dtype:?} {shape:?}");

        let wrong_dtype = |e: ModelError| assert!(matches!(e, ModelError::DType { .. }), "{e:?}");
        match store.read_f32(name) {
            Ok(values) => assert_eq!(values.len(), elements),
            Err(e) => wrong_dtype(e),
        }
        match store.read_f16(name) {
            Ok(values) => assert_eq!(values.len(), elements),
            Err(e) => wrong_dtype(e),
        }
        match store.read_u8(name) {
            Ok(values) => assert_eq!(values.len(), elements),
            Err(e) => wrong_dtype(e),
        }
        match store.read_i8(name) {
            Ok(values) => assert_eq!(values.len(), elements),
            Err(e) => wrong_dtype(e),
        }
    }
    assert!(matches!(store.read_f32("no such tensor"), Err(ModelError::MissingTensor { .. })));
    true
}

#[test]
fn safetensors_reader_survives_mutated_files() {
    let dir = tempfile::tempdir().unwrap();
    let seeds = safetensors_seeds(dir.path());
    let path = dir.path().join("model.safetensors");
    // The data is mapped, not copied; reading converts at most 2 bytes of input into 4 of output
    // (f16 → f32) per tensor, and the header is parsed into maps a small multiple of its size.
    // 64 bytes per input byte plus 4 MiB is generous for that and far below what trusting a
    // declared header length or shape would allocate.
    Fuzz::new("safetensors", env!("CARGO_MANIFEST_DIR"))
        .extension("safetensors")
        .kind(InputKind::Custom(mutate_safetensors))
        .cases(10_000)
        .memory_bound(4 << 20, 64)
        .run(seeds, |input| check_safetensors(&path, input));
}

// ---------------------------------------------------------------------------------------------
// config.json
// ---------------------------------------------------------------------------------------------

/// Llama 3.2 1B's config.json as published (llama3 rope scaling, a list of EOS ids).
const LLAMA32_1B: &str = r#"{
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009],
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "use_cache": true,
  "vocab_size": 128256
}"#;

/// SmolLM2-135M's config.json as published (null rope scaling, integer rope theta).
const SMOLLM2_135M: &str = r#"{
  "architectures": ["LlamaForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 576,
  "intermediate_size": 1536,
  "max_position_embeddings": 8192,
  "model_type": "llama",
  "num_attention_heads": 9,
  "num_hidden_layers": 30,
  "num_key_value_heads": 3,
  "pad_token_id": 2,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 100000,
  "tie_word_embeddings": true,
  "vocab_size": 49152
}"#;

/// transformers v5's layout: theta and scaling under `rope_parameters`; generation fields mixed in
/// so that [`GenerationConfig`] sees some too.
const V5_ROPE_PARAMETERS: &str = r#"{
  "model_type": "llama",
  "hidden_size": 64,
  "intermediate_size": 128,
  "num_hidden_layers": 2,
  "num_attention_heads": 4,
  "vocab_size": 300,
  "bos_token_id": null,
  "eos_token_id": [2, 3],
  "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
  "temperature": 0.7,
  "top_k": 50,
  "top_p": 0.9,
  "do_sample": true,
  "max_length": 128,
  "pad_token_id": [0]
}"#;

fn config_seeds() -> Vec<Vec<u8>> {
    let mut seeds: Vec<Vec<u8>> =
        [LLAMA32_1B, SMOLLM2_135M, V5_ROPE_PARAMETERS].map(|s| s.as_bytes().to_vec()).to_vec();
    seeds.push(random::tiny_config().to_json().into_bytes());
    seeds.push(random::tiny_llama32_config().to_json().into_bytes());
    seeds
}

/// Parses `input` as config.json; a config that loads must validate, give consistent sizes and
/// finite rope tables, and survive a round trip through `to_json`.
fn check_config(input: &[u8]) -> bool {
    // The crate reads config.json as UTF-8 text; lossy conversion keeps invalid bytes fuzzing the
    // JSON parser instead of stopping at the text conversion.
    let text = String::from_utf8_lossy(input);
    let _ = GenerationConfig::from_json_str(&text)
        .map(|g| GenerationConfig::from_json_str(&g.to_json()).expect("round trip"));
    let config = match LlamaConfig::from_json_str(&text) {
        Ok(config) => config,
        Err(e) => {
            assert!(
                matches!(
                    e,
                    ModelError::Json { .. }
                        | ModelError::Config { .. }
                        | ModelError::UnsupportedArchitecture { .. }
                        | ModelError::Unsupported { .. }
                ),
                "{e:?}"
            );
            assert!(!e.to_string().is_empty());
            return false;
        }
    };
    config.validate().expect("a parsed config is valid");
    assert_eq!(config.q_dim(), config.num_attention_heads * config.head_dim);
    assert_eq!(config.kv_dim(), config.num_key_value_heads * config.head_dim);
    assert!(config.kv_dim() <= config.q_dim());
    let inv_freq = config.rope_inv_freq();
    assert_eq!(inv_freq.len(), config.head_dim / 2);
    assert!(inv_freq.iter().all(|f| f.is_finite() && *f >= 0.0), "rope frequencies {inv_freq:?} of {config:?}");
    let (cos, sin) = config.rope_cos_sin(config.max_position_embeddings - 1);
    assert!(cos.iter().chain(&sin).all(|x| x.is_finite()), "rope table of {config:?}");
    let again = LlamaConfig::from_json_str(&config.to_json()).expect("to_json of a valid config loads");
    assert_eq!(again, config);
    true
}

#[test]
fn config_parser_survives_mutated_files() {
    // A config is a few hundred bytes of JSON parsed into a tree and a struct of numbers; the rope
    // table is at most head_dim / 2 floats (head_dim is capped by validation). 4 MiB plus 64 bytes
    // per input byte bounds that with room to spare.
    Fuzz::new("config-json", env!("CARGO_MANIFEST_DIR"))
        .extension("json")
        .kind(InputKind::Json)
        .cases(100_000)
        .memory_bound(4 << 20, 64)
        .run(config_seeds(), check_config);
}
