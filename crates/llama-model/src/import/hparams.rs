//! `config.json` / `generation_config.json` from a GGUF Llama's `llama.*` and `tokenizer.ggml.*`
//! metadata.

use super::gguf_error;
use crate::config::{GenerationConfig, LlamaConfig, RopeScaling, DEFAULT_ROPE_THETA};
use crate::error::ModelError;
use crate::gguf_layout::{rope_freq_divisors, ROPE_FREQS_TENSOR};
use gguf::{GgmlType, GgufFile};
use std::path::Path;

/// Reads the model's hyperparameters. `vocab_size` is the embedding table's row count (a
/// checkpoint may pad its embeddings beyond the tokenizer's vocabulary).
pub(crate) fn read_config(f: &GgufFile, path: &Path) -> Result<(LlamaConfig, GenerationConfig), ModelError> {
    let arch = match f.get("general.architecture") {
        None => return Err(ModelError::UnsupportedArchitecture { found: "(general.architecture missing)".into() }),
        Some(v) => v.as_str().unwrap_or("(not a string)"),
    };
    if arch != "llama" {
        return Err(ModelError::UnsupportedArchitecture { found: arch.to_string() });
    }
    let err = |e| gguf_error(path, e);
    let config_error = |message: String| ModelError::Config { path: Some(path.to_path_buf()), message };
    let usize_key = |key: &str| -> Result<usize, ModelError> {
        let v = f.get_u64(key).map_err(err)?;
        usize::try_from(v).map_err(|_| config_error(format!("{key} = {v} is out of range")))
    };
    let opt_usize = |key: &str| -> Result<Option<usize>, ModelError> {
        if f.get(key).is_some() {
            usize_key(key).map(Some)
        } else {
            Ok(None)
        }
    };
    let opt_f64 = |key: &str| -> Result<Option<f64>, ModelError> {
        if f.get(key).is_some() {
            f.get_f64(key).map(Some).map_err(err)
        } else {
            Ok(None)
        }
    };

    if opt_usize("llama.expert_count")?.unwrap_or(0) > 0 {
        return Err(ModelError::Unsupported {
            what: "mixture-of-experts Llama models (llama.expert_count > 0)".into(),
        });
    }
    let hidden_size = usize_key("llama.embedding_length")?;
    let num_attention_heads = usize_key("llama.attention.head_count")?;
    let num_key_value_heads = opt_usize("llama.attention.head_count_kv")?.unwrap_or(num_attention_heads);
    if num_attention_heads == 0 {
        return Err(config_error("llama.attention.head_count is 0".into()));
    }
    let head_dim = match (opt_usize("llama.attention.key_length")?, opt_usize("llama.attention.value_length")?) {
        (Some(k), Some(v)) if k != v => {
            return Err(ModelError::Unsupported { what: format!("key length {k} different from value length {v}") })
        }
        (Some(k), _) | (None, Some(k)) => k,
        (None, None) => hidden_size / num_attention_heads,
    };
    if let Some(rot) = opt_usize("llama.rope.dimension_count")? {
        if rot != head_dim {
            return Err(ModelError::Unsupported {
                what: format!(
                    "partial rotary embeddings (llama.rope.dimension_count {rot}, head dimension {head_dim})"
                ),
            });
        }
    }
    let embd = f.tensor("token_embd.weight").map_err(err)?;
    if embd.dims.len() != 2 {
        return Err(ModelError::Shape {
            name: "token_embd.weight".into(),
            expected: vec![0, hidden_size],
            found: embd.shape(),
        });
    }
    let vocab_size = embd.dims[1] as usize;

    let mut config = LlamaConfig {
        vocab_size,
        hidden_size,
        intermediate_size: usize_key("llama.feed_forward_length")?,
        num_hidden_layers: usize_key("llama.block_count")?,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        max_position_embeddings: usize_key("llama.context_length")?,
        rms_norm_eps: f.get_f64("llama.attention.layer_norm_rms_epsilon").map_err(err)? as f32,
        rope_theta: opt_f64("llama.rope.freq_base")?.map_or(DEFAULT_ROPE_THETA, |v| v as f32),
        rope_scaling: None,
        tie_word_embeddings: !f.has_tensor("output.weight"),
        bos_token_ids: opt_usize("tokenizer.ggml.bos_token_id")?.map(|v| v as u32).into_iter().collect(),
        eos_token_ids: opt_usize("tokenizer.ggml.eos_token_id")?.map(|v| v as u32).into_iter().collect(),
    };
    config.validate().map_err(config_error)?;
    config.rope_scaling = rope_scaling(f, path, &config)?;
    config.validate().map_err(config_error)?;

    // Generation stops at EOS and at the end-of-turn / end-of-message tokens when the GGUF names them.
    let mut eos = config.eos_token_ids.clone();
    for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        if let Some(id) = opt_usize(key)? {
            if !eos.contains(&(id as u32)) {
                eos.push(id as u32);
            }
        }
    }
    let generation = GenerationConfig {
        bos_token_ids: config.bos_token_ids.clone(),
        eos_token_ids: eos,
        pad_token_id: opt_usize("tokenizer.ggml.padding_token_id")?.map(|v| v as u32),
        ..GenerationConfig::default()
    };
    Ok((config, generation))
}

/// The rope scaling the GGUF describes. llama.cpp's converter stores llama3 scaling not as
/// parameters but as a `rope_freqs` tensor of per-frequency divisors; those are matched against
/// the llama3 formula (Llama 3.1 / 3.2's low 1, high 4, original context 8192 unless
/// `rope.scaling.original_context_length` says otherwise, factor = the largest divisor). Any
/// scaling that cannot be mapped is an error rather than silently dropped.
fn rope_scaling(f: &GgufFile, path: &Path, config: &LlamaConfig) -> Result<Option<RopeScaling>, ModelError> {
    let err = |e| gguf_error(path, e);
    let scaling_type = match f.get("llama.rope.scaling.type") {
        Some(v) => Some(v.as_str().ok_or_else(|| ModelError::Config {
            path: Some(path.to_path_buf()),
            message: "llama.rope.scaling.type is not a string".into(),
        })?),
        None => None,
    };
    let factor = match f.get("llama.rope.scaling.factor") {
        Some(_) => Some(f.get_f64("llama.rope.scaling.factor").map_err(err)?),
        None => None,
    };
    match scaling_type {
        None | Some("none") => {}
        Some("linear") if factor.is_none_or(|x| x == 1.0) => {}
        Some(other) => {
            return Err(ModelError::Unsupported {
                what: format!("rope scaling type '{other}' (factor {factor:?}); seam implements llama3 scaling only"),
            })
        }
    }

    if !f.has_tensor(ROPE_FREQS_TENSOR) {
        return Ok(None);
    }
    let info = f.tensor(ROPE_FREQS_TENSOR).map_err(err)?;
    let half = config.head_dim / 2;
    if info.ggml_type != GgmlType::F32 || info.dims != [half as u64] {
        return Err(ModelError::Unsupported {
            what: format!(
                "{ROPE_FREQS_TENSOR} of type {} and dims {:?} (expected F32 [{half}])",
                info.ggml_type, info.dims
            ),
        });
    }
    let divisors = f.dequantize(ROPE_FREQS_TENSOR).map_err(err)?;
    if divisors.iter().all(|&d| d == 1.0) {
        return Ok(None);
    }
    let original = match f.get("llama.rope.scaling.original_context_length") {
        Some(_) => f.get_u64("llama.rope.scaling.original_context_length").map_err(err)? as usize,
        None => 8192,
    };
    let max = divisors.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let candidate = RopeScaling::Llama3 {
        factor: max,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: original,
    };
    let implied = rope_freq_divisors(&LlamaConfig { rope_scaling: Some(candidate.clone()), ..config.clone() })
        .expect("the candidate has rope scaling");
    let matches = implied.iter().zip(&divisors).all(|(implied, d)| (implied - d).abs() <= 1e-3 * d.abs().max(1.0));
    if !matches {
        return Err(ModelError::Unsupported {
            what: format!(
                "{ROPE_FREQS_TENSOR} does not match llama3 rope scaling with factor {max}, low 1, high 4, original context {original}"
            ),
        });
    }
    Ok(Some(candidate))
}
