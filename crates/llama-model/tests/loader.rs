//! `load_weights` end to end on tiny random checkpoints: both formats, sharding, the int4 cache,
//! and every kind of broken model directory (each must be a typed error, never a panic).

use llama_model::int4::{self, GROUP_SIZE};
use llama_model::model_dir::{CONFIG_FILE, INT4_WEIGHTS_FILE, SAFETENSORS_FILE, SAFETENSORS_INDEX_FILE};
use llama_model::random::{random_weights, tiny_config, tiny_llama32_config, write_random_checkpoint};
use llama_model::tensor_store::{write_safetensors, write_safetensors_raw, Dtype, OwnedTensor, RawTensor, TensorStore};
use llama_model::weights::{expected_tensors, load_weights, names, Matrix, MatrixFormat, TensorRef};
use llama_model::{LlamaConfig, LlamaWeights, ModelError};
use session_api::{ErrorKind, SeamError, WeightFormat};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

fn checkpoint(config: &LlamaConfig) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), config, 42).unwrap();
    dir
}

/// Every tensor of the checkpoint as (name, tensor), read back from its file.
fn owned_tensors(dir: &Path) -> Vec<(String, OwnedTensor)> {
    let store = TensorStore::open(dir).unwrap();
    store
        .names()
        .into_iter()
        .map(|name| {
            let shape = store.shape(name).unwrap().to_vec();
            let t = match store.dtype(name).unwrap() {
                Dtype::F32 => OwnedTensor::F32 { shape, data: store.read_f32(name).unwrap() },
                _ => OwnedTensor::F16 { shape, data: store.read_f16(name).unwrap() },
            };
            (name.to_string(), t)
        })
        .collect()
}

fn rewrite(dir: &Path, edit: impl FnOnce(&mut Vec<(String, OwnedTensor)>)) {
    let mut tensors = owned_tensors(dir);
    edit(&mut tensors);
    write_safetensors(&dir.join(SAFETENSORS_FILE), &tensors, &BTreeMap::new()).unwrap();
}

fn assert_same_values(a: &LlamaWeights, b: &LlamaWeights) {
    let (ta, tb) = (a.tensors(), b.tensors());
    assert_eq!(ta.len(), tb.len());
    for ((na, x), (nb, y)) in ta.iter().zip(&tb) {
        assert_eq!(na, nb);
        match (x, y) {
            (TensorRef::Norm(x), TensorRef::Norm(y)) => assert_eq!(x, y, "{na}"),
            (TensorRef::Matrix(x), TensorRef::Matrix(y)) => assert_eq!(x.to_f32(), y.to_f32(), "{na}"),
            _ => panic!("{na}: different roles"),
        }
    }
}

#[test]
fn f16_load_matches_the_generated_weights() {
    for config in [tiny_config(), tiny_llama32_config()] {
        let dir = checkpoint(&config);
        let calls = AtomicU64::new(0);
        let last = AtomicU64::new(0);
        let progress = |done: u64, total: u64| {
            calls.fetch_add(1, Ordering::Relaxed);
            last.fetch_max(done, Ordering::Relaxed);
            assert!(done <= total);
        };
        let loaded = load_weights(dir.path(), WeightFormat::F16, Some(&progress)).unwrap();
        let total = expected_tensors(&config).len() as u64;
        assert_eq!(last.load(Ordering::Relaxed), total);
        assert_eq!(calls.load(Ordering::Relaxed), total + 1);
        assert_eq!(loaded.config, config);
        assert!(matches!(loaded.embed, Matrix::F16 { rows: 256, cols: 64, .. }));
        assert_eq!(loaded.lm_head.is_none(), config.tie_word_embeddings);
        assert_same_values(&loaded, &random_weights(&config, 42).unwrap());
        loaded.validate().unwrap();
        // f16 matrices + f32 norms: 2 bytes per matrix element.
        let matrix_elements: usize = expected_tensors(&config)
            .iter()
            .map(|s| if s.shape.len() == 2 { 2 * s.shape[0] * s.shape[1] } else { 4 * s.shape[0] })
            .sum();
        assert_eq!(loaded.byte_size(), matrix_elements);
    }
}

#[test]
fn int4_is_quantized_once_then_read_from_the_cache() {
    let config = tiny_config();
    let dir = checkpoint(&config);
    let int4_path = dir.path().join(INT4_WEIGHTS_FILE);
    assert!(!int4_path.exists());
    let first = load_weights(dir.path(), WeightFormat::Int4, None).unwrap();
    assert!(int4_path.is_file(), "the quantized weights are saved");
    // The layers at 4 bits; the embedding and the output head at 8 (Int4Layout::DEFAULT).
    for (name, t) in first.tensors() {
        if let TensorRef::Matrix(m) = t {
            let edge = name == names::EMBED_TOKENS || name == names::LM_HEAD;
            let want = if edge { MatrixFormat::Int8 } else { MatrixFormat::Int4 };
            assert_eq!(m.format(), want, "{name}");
        }
    }
    assert_eq!(first.int4_layout().unwrap(), llama_model::Int4Layout::DEFAULT.normalized(config.tie_word_embeddings));
    // Quantization is close to the f16 weights: within one step of each group.
    let f16 = load_weights(dir.path(), WeightFormat::F16, None).unwrap();
    if let (Matrix::Int4(q), Matrix::F16 { data, .. }) = (&first.layers[0].wq, &f16.layers[0].wq) {
        let back = q.dequantize();
        for (i, (a, b)) in back.iter().zip(data).enumerate() {
            let scale = f32::from(q.scales[i / GROUP_SIZE]);
            assert!((a - b.to_f32()).abs() <= scale * 0.51 + 1e-3, "{i}");
        }
    } else {
        panic!("unexpected formats");
    }
    // Smaller than f16 by less than the layers' 3.6x: the 8-bit embedding and head are a large
    // share of a tiny model.
    assert!(first.byte_size() < f16.byte_size() / 2);

    // The second load reads the cache: prove it by removing the float weights.
    let modified = std::fs::metadata(&int4_path).unwrap().modified().unwrap();
    std::fs::remove_file(dir.path().join(SAFETENSORS_FILE)).unwrap();
    let second = load_weights(dir.path(), WeightFormat::Int4, None).unwrap();
    assert_eq!(std::fs::metadata(&int4_path).unwrap().modified().unwrap(), modified);
    assert_same_values(&first, &second);
    match (&first.embed, &second.embed) {
        (Matrix::Int8(a), Matrix::Int8(b)) => assert_eq!(a, b),
        _ => panic!("the embedding is int8 in both loads"),
    }
    // The cache has the documented layout.
    let store = TensorStore::open_file(&int4_path).unwrap();
    assert_eq!(store.metadata().get("format").map(String::as_str), Some("seam-int4"));
    assert_eq!(store.shape("model.layers.0.mlp.down_proj.weight.qweight").unwrap(), &[64, 64]);
    assert_eq!(store.shape("model.layers.0.mlp.down_proj.weight.scales").unwrap(), &[64, 4]);
    assert_eq!(store.dtype("model.norm.weight").unwrap(), Dtype::F32);
}

#[cfg(unix)]
#[test]
fn int4_load_from_a_read_only_directory_still_works() {
    use std::os::unix::fs::PermissionsExt;
    let dir = checkpoint(&tiny_llama32_config());
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o555)).unwrap();
    // Root ignores permissions; then there is nothing to test.
    let writable = std::fs::write(dir.path().join("probe"), b"x").is_ok();
    let result = load_weights(dir.path(), WeightFormat::Int4, None);
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let weights = result.unwrap();
    assert!(weights.lm_head.is_none());
    if !writable {
        assert!(!dir.path().join(INT4_WEIGHTS_FILE).exists());
    }
}

#[test]
fn tied_checkpoint_ignores_a_stray_lm_head() {
    let config = tiny_llama32_config();
    let dir = checkpoint(&config);
    rewrite(dir.path(), |t| {
        t.push((names::LM_HEAD.to_string(), OwnedTensor::F16 { shape: vec![1, 1], data: vec![half::f16::ONE] }))
    });
    let w = load_weights(dir.path(), WeightFormat::F16, None).unwrap();
    assert!(w.lm_head.is_none());
}

#[test]
fn sharded_checkpoint_loads_like_a_single_file() {
    let config = tiny_config();
    let dir = checkpoint(&config);
    let single = load_weights(dir.path(), WeightFormat::F16, None).unwrap();
    let tensors = owned_tensors(dir.path());
    let (first, second) = tensors.split_at(tensors.len() / 2);
    let shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];
    write_safetensors(&dir.path().join(shards[0]), first, &BTreeMap::new()).unwrap();
    write_safetensors(&dir.path().join(shards[1]), second, &BTreeMap::new()).unwrap();
    let mut map = serde_json::Map::new();
    for (name, _) in first {
        map.insert(name.clone(), shards[0].into());
    }
    for (name, _) in second {
        map.insert(name.clone(), shards[1].into());
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.path().join(SAFETENSORS_INDEX_FILE), index.to_string()).unwrap();
    std::fs::remove_file(dir.path().join(SAFETENSORS_FILE)).unwrap();
    let sharded = load_weights(dir.path(), WeightFormat::F16, None).unwrap();
    assert_same_values(&single, &sharded);
    // Int4 from shards too.
    load_weights(dir.path(), WeightFormat::Int4, None).unwrap();
}

#[test]
fn missing_tensor_is_named() {
    let dir = checkpoint(&tiny_config());
    let victim = names::layer(1, names::V_PROJ);
    rewrite(dir.path(), |t| t.retain(|(n, _)| *n != victim));
    for format in WeightFormat::ALL {
        match load_weights(dir.path(), format, None) {
            Err(ModelError::MissingTensor { name }) => assert_eq!(name, victim),
            other => panic!("{format}: {other:?}"),
        }
    }
    // An untied model without its LM head.
    let dir = checkpoint(&tiny_config());
    rewrite(dir.path(), |t| t.retain(|(n, _)| n != names::LM_HEAD));
    assert!(matches!(load_weights(dir.path(), WeightFormat::F16, None), Err(ModelError::MissingTensor { .. })));
}

#[test]
fn wrong_shape_is_named() {
    let dir = checkpoint(&tiny_config());
    let victim = names::layer(0, names::K_PROJ);
    rewrite(dir.path(), |t| {
        let entry = t.iter_mut().find(|(n, _)| *n == victim).unwrap();
        // The transposed matrix: same element count, wrong orientation.
        if let OwnedTensor::F16 { shape, .. } = &mut entry.1 {
            shape.reverse();
        }
    });
    match load_weights(dir.path(), WeightFormat::F16, None) {
        Err(ModelError::Shape { name, expected, found }) => {
            assert_eq!(name, victim);
            assert_eq!((expected, found), (vec![32, 64], vec![64, 32]));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn wrong_dtype_is_named() {
    let dir = checkpoint(&tiny_config());
    let victim = names::layer(1, names::POST_ATTENTION_LAYERNORM);
    let tensors = owned_tensors(dir.path());
    let ints = vec![1i32; 64];
    let mut raw: Vec<RawTensor<'_>> = tensors.iter().filter(|(n, _)| *n != victim).map(|(n, t)| t.as_raw(n)).collect();
    raw.push(RawTensor { name: &victim, dtype: Dtype::I32, shape: &[64], bytes: bytemuck::cast_slice(&ints) });
    write_safetensors_raw(&dir.path().join(SAFETENSORS_FILE), &raw, &BTreeMap::new()).unwrap();
    match load_weights(dir.path(), WeightFormat::F16, None) {
        Err(ModelError::DType { name, found, .. }) => {
            assert_eq!(name, victim);
            assert_eq!(found, "I32");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn truncated_weights_are_reported() {
    let dir = checkpoint(&tiny_config());
    let path = dir.path().join(SAFETENSORS_FILE);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_weights(dir.path(), WeightFormat::F16, None).unwrap_err();
    assert!(matches!(&err, ModelError::Truncated { path: p, .. } if *p == path), "{err:?}");
    let seam: SeamError = err.into();
    assert_eq!(seam.kind(), ErrorKind::ModelFormat);
    assert!(seam.to_string().contains(SAFETENSORS_FILE), "{seam}");
}

#[test]
fn corrupt_int4_cache_is_reported() {
    let dir = checkpoint(&tiny_config());
    load_weights(dir.path(), WeightFormat::Int4, None).unwrap();
    let path = dir.path().join(INT4_WEIGHTS_FILE);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
    assert!(matches!(load_weights(dir.path(), WeightFormat::Int4, None), Err(ModelError::Truncated { .. })));
    // A safetensors file without the seam-int4 metadata.
    write_safetensors(&path, &[], &BTreeMap::new()).unwrap();
    assert!(matches!(load_weights(dir.path(), WeightFormat::Int4, None), Err(ModelError::Corrupt { .. })));
    // The right metadata but a matrix of the wrong width.
    let mut tensors = Vec::new();
    for spec in expected_tensors(&tiny_config()) {
        if spec.shape.len() == 1 {
            tensors.push((
                spec.name.clone(),
                OwnedTensor::F32 { shape: spec.shape.clone(), data: vec![1.0; spec.shape[0]] },
            ));
        } else {
            let (rows, cols) =
                (spec.shape[0], if spec.name.contains("q_proj") { spec.shape[1] * 2 } else { spec.shape[1] });
            let q = int4::quantize(&vec![0.5; rows * cols], rows, cols).unwrap();
            tensors.extend(q.to_tensors(&spec.name));
        }
    }
    write_safetensors(&path, &tensors, &int4::int4_metadata()).unwrap();
    match load_weights(dir.path(), WeightFormat::Int4, None) {
        Err(ModelError::Shape { name, .. }) => assert!(name.contains("q_proj"), "{name}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn bad_config_is_reported_before_weights() {
    let dir = checkpoint(&tiny_config());
    let path = dir.path().join(CONFIG_FILE);
    std::fs::write(&path, "{\"model_type\": \"llama\", \"hidden_size\": ").unwrap();
    assert!(matches!(load_weights(dir.path(), WeightFormat::F16, None), Err(ModelError::Json { .. })));
    let mut v: serde_json::Value = serde_json::from_str(&tiny_config().to_json()).unwrap();
    v["model_type"] = "gpt2".into();
    v["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
    std::fs::write(&path, v.to_string()).unwrap();
    match load_weights(dir.path(), WeightFormat::Int4, None) {
        Err(ModelError::UnsupportedArchitecture { found }) => assert_eq!(found, "gpt2"),
        other => panic!("{other:?}"),
    }
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(load_weights(dir.path(), WeightFormat::F16, None), Err(ModelError::MissingFile { .. })));
}

#[test]
fn config_and_weights_that_disagree_are_shape_errors() {
    // A checkpoint written for one config, read with a wider FFN in config.json.
    let dir = checkpoint(&tiny_config());
    let wider = LlamaConfig { intermediate_size: 256, ..tiny_config() };
    std::fs::write(dir.path().join(CONFIG_FILE), wider.to_json()).unwrap();
    match load_weights(dir.path(), WeightFormat::Int4, None) {
        Err(ModelError::Shape { name, .. }) => assert!(name.contains("mlp"), "{name}"),
        other => panic!("{other:?}"),
    }
}
