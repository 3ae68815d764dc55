//! `config.json` and `generation_config.json` of a Hugging Face Llama checkpoint.
//!
//! Parsing is strict where a wrong guess would silently change the model's output (architecture,
//! rope scaling type, biases, activation) and follows Hugging Face transformers' defaults where a key
//! is merely omitted. The rope frequencies are computed here, once, the way transformers computes
//! them in float32, so that every backend rotates by the same angles.

use crate::error::ModelError;
use serde_json::{json, Map, Value};
use std::path::Path;

/// llama3-style rope scaling (Llama 3.1 / 3.2): low frequencies are divided by `factor`,
/// high frequencies are kept, and the band between is interpolated smoothly.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    Llama3 { factor: f32, low_freq_factor: f32, high_freq_factor: f32, original_max_position_embeddings: usize },
}

/// A parsed and validated Llama `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// `hidden_size / num_attention_heads` unless `head_dim` is given.
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub tie_word_embeddings: bool,
    /// BOS ids (`bos_token_id` may be an int or a list in config.json).
    pub bos_token_ids: Vec<u32>,
    /// EOS ids (int or list).
    pub eos_token_ids: Vec<u32>,
}

/// `generation_config.json`: the ids and defaults a model was published with.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GenerationConfig {
    pub bos_token_ids: Vec<u32>,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub do_sample: Option<bool>,
    pub max_length: Option<usize>,
}

/// Hugging Face transformers' default `rope_theta` for Llama.
pub const DEFAULT_ROPE_THETA: f32 = 10_000.0;
/// Hugging Face transformers' default `rms_norm_eps` for Llama.
pub const DEFAULT_RMS_NORM_EPS: f32 = 1e-6;
/// Hugging Face transformers' default `max_position_embeddings` for Llama.
pub const DEFAULT_MAX_POSITION_EMBEDDINGS: usize = 2048;

/// transformers' `MistralConfig` defaults where its keys are absent: `num_key_value_heads`,
/// `max_position_embeddings` and `sliding_window`.
const MISTRAL_DEFAULT_KV_HEADS: usize = 8;
const MISTRAL_DEFAULT_MAX_POSITION_EMBEDDINGS: usize = 4096 * 32;
const MISTRAL_DEFAULT_SLIDING_WINDOW: usize = 4096;

/// The checkpoint families read as a Llama model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    /// `model_type` "llama", `LlamaForCausalLM`.
    Llama,
    /// `model_type` "mistral", `MistralForCausalLM`: a Llama whose attention sees at most
    /// `sliding_window` positions back (none: every position, as Llama).
    Mistral,
}

impl Family {
    /// Each family's `model_type` and architecture name, the one place the names are listed.
    const NAMES: [(Family, &'static str, &'static str); 2] =
        [(Family::Llama, "llama", "LlamaForCausalLM"), (Family::Mistral, "mistral", "MistralForCausalLM")];

    fn of_model_type(name: &str) -> Result<Family, ModelError> {
        Self::find(|&(_, model_type, _)| model_type == name, name)
    }

    fn of_architecture(name: &str) -> Result<Family, ModelError> {
        Self::find(|&(_, _, architecture)| architecture == name, name)
    }

    fn find(matches: impl Fn(&(Family, &'static str, &'static str)) -> bool, name: &str) -> Result<Family, ModelError> {
        Self::NAMES
            .iter()
            .find(|entry| matches(entry))
            .map(|&(family, ..)| family)
            .ok_or_else(|| ModelError::UnsupportedArchitecture { found: name.to_string() })
    }

    fn model_type(self) -> &'static str {
        Self::NAMES.iter().find(|(family, ..)| *family == self).map_or("", |&(_, model_type, _)| model_type)
    }

    /// The positions the model runs: `max_position_embeddings`, and for Mistral no more than its
    /// sliding window. seam attends over the whole context, which is what the window computes
    /// until the context outgrows it; past that the two would differ, so the context ends there.
    fn context(self, r: &JsonReader<'_>) -> Result<usize, ModelError> {
        let positions = r.usize_opt("max_position_embeddings")?;
        match self {
            Family::Llama => Ok(positions.unwrap_or(DEFAULT_MAX_POSITION_EMBEDDINGS)),
            Family::Mistral => {
                let positions = positions.unwrap_or(MISTRAL_DEFAULT_MAX_POSITION_EMBEDDINGS);
                // Absent takes transformers' default; null is no window (`get` reads null as absent).
                let window = match r.obj.get("sliding_window") {
                    None => Some(MISTRAL_DEFAULT_SLIDING_WINDOW),
                    Some(Value::Null) => None,
                    Some(_) => match r.usize_opt("sliding_window")? {
                        Some(0) => return Err(r.error("\"sliding_window\" must be positive or null")),
                        w => w,
                    },
                };
                Ok(window.map_or(positions, |w| positions.min(w)))
            }
        }
    }
}

/// Reading one `config.json`: every lookup reports errors against the file it came from.
struct JsonReader<'a> {
    obj: &'a Map<String, Value>,
    path: Option<&'a Path>,
}

impl<'a> JsonReader<'a> {
    fn error(&self, message: impl Into<String>) -> ModelError {
        ModelError::Config { path: self.path.map(Path::to_path_buf), message: message.into() }
    }

    /// A present, non-null value.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn usize_opt(&self, key: &str) -> Result<Option<usize>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| self.error(format!("\"{key}\" must be a non-negative integer, found {v}"))),
        }
    }

    fn usize_req(&self, key: &str) -> Result<usize, ModelError> {
        self.usize_opt(key)?.ok_or_else(|| self.error(format!("missing \"{key}\"")))
    }

    fn f32_opt(&self, key: &str) -> Result<Option<f32>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| self.error(format!("\"{key}\" must be a number, found {v}"))),
        }
    }

    fn bool_opt(&self, key: &str) -> Result<Option<bool>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                v.as_bool().map(Some).ok_or_else(|| self.error(format!("\"{key}\" must be true or false, found {v}")))
            }
        }
    }

    fn str_opt(&self, key: &str) -> Result<Option<&'a str>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.error(format!("\"{key}\" must be a string, found {v}"))),
        }
    }

    /// A token id field: an integer, a list of integers, or null. `None` when the key is absent
    /// (so the caller can apply its default), `Some(vec![])` when it is null.
    fn token_ids(&self, key: &str) -> Result<Option<Vec<u32>>, ModelError> {
        let bad =
            |v: &Value| self.error(format!("\"{key}\" must be a token id, a list of token ids or null, found {v}"));
        let id = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| bad(v));
        match self.obj.get(key) {
            None => Ok(None),
            Some(Value::Null) => Ok(Some(Vec::new())),
            Some(Value::Array(items)) => items.iter().map(id).collect::<Result<Vec<_>, _>>().map(Some),
            Some(v) => Ok(Some(vec![id(v)?])),
        }
    }
}

fn parse_object<'a>(
    text: &str,
    path: Option<&Path>,
    value: &'a mut Value,
) -> Result<&'a Map<String, Value>, ModelError> {
    *value = serde_json::from_str(text)
        .map_err(|e| ModelError::Json { path: path.map(Path::to_path_buf), message: e.to_string() })?;
    value.as_object().ok_or_else(|| ModelError::Json {
        path: path.map(Path::to_path_buf),
        message: "the top level is not a JSON object".to_string(),
    })
}

fn read_text(path: &Path) -> Result<String, ModelError> {
    std::fs::read_to_string(path).map_err(|e| ModelError::from_io(path, e))
}

impl RopeScaling {
    /// Parses a `rope_scaling` (or transformers v5 `rope_parameters`) object. `Ok(None)` for no
    /// scaling (`rope_type` "default").
    fn parse(reader: &JsonReader<'_>, obj: &Map<String, Value>) -> Result<Option<RopeScaling>, ModelError> {
        let inner = JsonReader { obj, path: reader.path };
        let kind = match inner.str_opt("rope_type")? {
            Some(kind) => Some(kind),
            None => inner.str_opt("type")?,
        };
        match kind {
            Some("default") => Ok(None),
            Some("llama3") => {
                let need = |key: &str| -> Result<f32, ModelError> {
                    inner.f32_opt(key)?.ok_or_else(|| reader.error(format!("llama3 rope scaling needs \"{key}\"")))
                };
                let scaling = RopeScaling::Llama3 {
                    factor: need("factor")?,
                    low_freq_factor: need("low_freq_factor")?,
                    high_freq_factor: need("high_freq_factor")?,
                    original_max_position_embeddings: inner.usize_opt("original_max_position_embeddings")?.ok_or_else(
                        || reader.error("llama3 rope scaling needs \"original_max_position_embeddings\""),
                    )?,
                };
                Ok(Some(scaling))
            }
            Some(other) => Err(ModelError::Unsupported {
                what: format!("rope scaling type \"{other}\" (seam implements \"llama3\")"),
            }),
            None => Err(reader.error("rope scaling without a \"rope_type\"")),
        }
    }

    fn validate(&self) -> Result<(), String> {
        match *self {
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                if !(factor.is_finite() && factor > 0.0) {
                    return Err(format!("rope scaling factor must be positive, found {factor}"));
                }
                if !(low_freq_factor.is_finite() && low_freq_factor > 0.0) {
                    return Err(format!("low_freq_factor must be positive, found {low_freq_factor}"));
                }
                // The smooth band divides by (high - low); equal factors would divide by zero.
                if !(high_freq_factor.is_finite() && high_freq_factor > low_freq_factor) {
                    return Err(format!(
                        "high_freq_factor ({high_freq_factor}) must be greater than low_freq_factor ({low_freq_factor})"
                    ));
                }
                if original_max_position_embeddings == 0 {
                    return Err("original_max_position_embeddings must be positive".to_string());
                }
                Ok(())
            }
        }
    }

    fn to_json(&self) -> Value {
        match *self {
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                json!({
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low_freq_factor,
                    "high_freq_factor": high_freq_factor,
                    "original_max_position_embeddings": original_max_position_embeddings,
                })
            }
        }
    }
}

/// Token ids as config.json writes them: one id as an integer, several as a list, none as null.
fn token_ids_json(ids: &[u32]) -> Value {
    match ids {
        [] => Value::Null,
        [one] => json!(one),
        many => json!(many),
    }
}

impl LlamaConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<LlamaConfig, ModelError> {
        LlamaConfig::parse(&read_text(path)?, Some(path))
    }

    /// Parses and validates the text of a `config.json`.
    pub fn from_json_str(text: &str) -> Result<LlamaConfig, ModelError> {
        LlamaConfig::parse(text, None)
    }

    fn parse(text: &str, path: Option<&Path>) -> Result<LlamaConfig, ModelError> {
        let mut value = Value::Null;
        let obj = parse_object(text, path, &mut value)?;
        let r = JsonReader { obj, path };

        // Architecture: strict, because a look-alike (Qwen's biases, Gemma's norms, ...) would
        // load and then compute something subtly different. Mistral is Llama with a sliding
        // window of attention: within the window the two compute the same, so a Mistral model is
        // read as a Llama model whose context ends at the window (below).
        let model_type = r.str_opt("model_type")?;
        let architectures: Vec<&str> = match r.get("architectures") {
            None => Vec::new(),
            Some(Value::Array(items)) => items.iter().filter_map(Value::as_str).collect(),
            Some(v) => return Err(r.error(format!("\"architectures\" must be a list of strings, found {v}"))),
        };
        let family = match model_type {
            Some(name) => Family::of_model_type(name)?,
            None => match architectures.first() {
                Some(name) => Family::of_architecture(name)?,
                None => {
                    return Err(ModelError::UnsupportedArchitecture {
                        found: "unknown (no model_type or architectures)".into(),
                    })
                }
            },
        };
        for name in &architectures {
            if Family::of_architecture(name)? != family {
                return Err(r.error(format!(
                    "architectures lists {name}, which is not the model_type's ({})",
                    family.model_type()
                )));
            }
        }

        for key in ["attention_bias", "mlp_bias"] {
            if r.bool_opt(key)? == Some(true) {
                return Err(ModelError::Unsupported { what: format!("\"{key}\": true (seam's Llama has no biases)") });
            }
        }
        if let Some(act) = r.str_opt("hidden_act")? {
            if act != "silu" {
                return Err(ModelError::Unsupported { what: format!("hidden_act \"{act}\" (seam implements silu)") });
            }
        }

        let hidden_size = r.usize_req("hidden_size")?;
        let num_attention_heads = r.usize_req("num_attention_heads")?;
        let num_key_value_heads = r.usize_opt("num_key_value_heads")?.unwrap_or(match family {
            Family::Llama => num_attention_heads,
            Family::Mistral => MISTRAL_DEFAULT_KV_HEADS,
        });
        let head_dim = match r.usize_opt("head_dim")? {
            Some(d) => d,
            None => {
                if num_attention_heads == 0 || hidden_size % num_attention_heads != 0 {
                    return Err(r.error(format!(
                        "hidden_size {hidden_size} is not a multiple of num_attention_heads {num_attention_heads} (and no head_dim is given)"
                    )));
                }
                hidden_size / num_attention_heads
            }
        };

        // transformers v5 moves theta and scaling into "rope_parameters"; older files have
        // "rope_theta" and "rope_scaling" at the top level.
        let rope_params = r.get("rope_parameters");
        let (rope_theta, rope_scaling) = match rope_params {
            Some(Value::Object(params)) => {
                let inner = JsonReader { obj: params, path };
                let theta = inner.f32_opt("rope_theta")?.or(r.f32_opt("rope_theta")?).unwrap_or(DEFAULT_ROPE_THETA);
                (theta, RopeScaling::parse(&r, params)?)
            }
            Some(v) => return Err(r.error(format!("\"rope_parameters\" must be an object, found {v}"))),
            None => {
                let scaling = match r.get("rope_scaling") {
                    None => None,
                    Some(Value::Object(obj)) => RopeScaling::parse(&r, obj)?,
                    Some(v) => return Err(r.error(format!("\"rope_scaling\" must be an object or null, found {v}"))),
                };
                (r.f32_opt("rope_theta")?.unwrap_or(DEFAULT_ROPE_THETA), scaling)
            }
        };

        let config = LlamaConfig {
            vocab_size: r.usize_req("vocab_size")?,
            hidden_size,
            intermediate_size: r.usize_req("intermediate_size")?,
            num_hidden_layers: r.usize_req("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            max_position_embeddings: family.context(&r)?,
            rms_norm_eps: r.f32_opt("rms_norm_eps")?.unwrap_or(DEFAULT_RMS_NORM_EPS),
            rope_theta,
            rope_scaling,
            tie_word_embeddings: r.bool_opt("tie_word_embeddings")?.unwrap_or(false),
            // transformers' LlamaConfig defaults: bos 1, eos 2 when the keys are absent.
            bos_token_ids: r.token_ids("bos_token_id")?.unwrap_or_else(|| vec![1]),
            eos_token_ids: r.token_ids("eos_token_id")?.unwrap_or_else(|| vec![2]),
        };
        config.validate().map_err(|message| r.error(message))?;
        Ok(config)
    }

    /// Checks the invariants every backend relies on; the message says which one failed.
    pub fn validate(&self) -> Result<(), String> {
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, value) in sizes {
            if value == 0 {
                return Err(format!("{name} must be positive"));
            }
            // Sizes come from untrusted files and every buffer is sized from them: bounded here,
            // their products (matrices, caches, tensor lists) fit in memory arithmetic, and an
            // absurd file fails in microseconds instead of allocating in proportion to it.
            let limit = Self::size_limit(name);
            if value > limit {
                return Err(format!("{name} {value} is above seam's limit of {limit}"));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!("head_dim {} must be even (rope rotates pairs)", self.head_dim));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(format!("rms_norm_eps must be positive, found {}", self.rms_norm_eps));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(format!("rope_theta must be greater than 1, found {}", self.rope_theta));
        }
        if let Some(scaling) = &self.rope_scaling {
            scaling.validate()?;
        }
        // Each parameter can be finite and in range while their combination is not (a scaling
        // factor of 1e-45 divides a frequency into infinity): the frequencies themselves decide.
        if let Some(bad) = self.rope_inv_freq().into_iter().find(|f| !(f.is_finite() && *f > 0.0)) {
            return Err(format!("the rope settings give a frequency of {bad}; check rope_theta and rope_scaling"));
        }
        // A special token outside the vocabulary can never be produced (an EOS that never stops)
        // or fed (a BOS that fails every prompt): the file is wrong, say so at load.
        let ids = self.bos_token_ids.iter().map(|id| ("bos_token_id", id));
        if let Some((key, id)) = ids
            .chain(self.eos_token_ids.iter().map(|id| ("eos_token_id", id)))
            .find(|(_, id)| **id as usize >= self.vocab_size)
        {
            return Err(format!("{key} {id} is outside the vocabulary (size {})", self.vocab_size));
        }
        Ok(())
    }

    /// The largest value [`LlamaConfig::validate`] accepts for a size field: several times the
    /// largest published Llama-family model's (405B: 126 layers, hidden 16384, 128 heads, vocab
    /// 128256, context 131072), far below where products of sizes could overflow.
    pub fn size_limit(field: &str) -> usize {
        match field {
            "num_hidden_layers" => 1 << 10,
            "num_attention_heads" | "num_key_value_heads" | "head_dim" => 1 << 12,
            "hidden_size" => 1 << 17,
            "intermediate_size" => 1 << 20,
            _ => 1 << 24, // vocab_size, max_position_embeddings
        }
    }

    /// Width of the query projection output (`num_attention_heads * head_dim`).
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Width of the key and value projection outputs (`num_key_value_heads * head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// An HF-compatible `config.json` (loads with transformers' `LlamaConfig`).
    pub fn to_json(&self) -> String {
        let value = json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.as_ref().map(RopeScaling::to_json),
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": token_ids_json(&self.bos_token_ids),
            "eos_token_id": token_ids_json(&self.eos_token_ids),
            "hidden_act": "silu",
            "attention_bias": false,
            "attention_dropout": 0.0,
            "mlp_bias": false,
            "initializer_range": 0.02,
            "pretraining_tp": 1,
            "use_cache": true,
            "torch_dtype": "float16",
        });
        serde_json::to_string_pretty(&value).expect("a JSON value serializes")
    }

    /// The rope inverse frequencies, `head_dim / 2` of them, computed in f32 exactly as Hugging Face
    /// transformers does: `1 / theta^(2i / d)`, then llama3 scaling when configured.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        // transformers: 1.0 / (base ** (arange(0, d, 2).float() / d)), every step in float32.
        let inv_freq: Vec<f32> = (0..d / 2).map(|i| 1.0f32 / self.rope_theta.powf((2 * i) as f32 / d as f32)).collect();
        match self.rope_scaling {
            None => inv_freq,
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                // transformers' _compute_llama3_parameters. The Python scalars (wavelength bounds,
                // 2*pi, the factor difference) are doubles that torch rounds to float32 when it
                // combines them with the float32 tensor, so they are rounded the same way here.
                let old_context = original_max_position_embeddings as f64;
                let low_freq_wavelen = (old_context / low_freq_factor as f64) as f32;
                let high_freq_wavelen = (old_context / high_freq_factor as f64) as f32;
                let two_pi = (2.0 * std::f64::consts::PI) as f32;
                let band = (high_freq_factor as f64 - low_freq_factor as f64) as f32;
                inv_freq
                    .into_iter()
                    .map(|f| {
                        let wavelen = two_pi / f;
                        if wavelen > low_freq_wavelen {
                            // Long wavelengths: the frequency is divided by the factor.
                            f / factor
                        } else if wavelen < high_freq_wavelen {
                            // Short wavelengths: unchanged.
                            f
                        } else {
                            let smooth = (old_context as f32 / wavelen - low_freq_factor) / band;
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }

    /// The rope cosines and sines at `position`, `head_dim / 2` each (the full head uses them for
    /// both halves, Hugging Face's rotate_half layout). Computed as transformers does: the angle is
    /// `position as f32 * inv_freq[i]` in f32, then `cos` / `sin` in f32.
    pub fn rope_cos_sin(&self, position: usize) -> (Vec<f32>, Vec<f32>) {
        rope_cos_sin_from(&self.rope_inv_freq(), position)
    }
}

/// [`LlamaConfig::rope_cos_sin`] from precomputed inverse frequencies (backends compute
/// [`LlamaConfig::rope_inv_freq`] once and call this per position).
pub fn rope_cos_sin_from(inv_freq: &[f32], position: usize) -> (Vec<f32>, Vec<f32>) {
    let p = position as f32;
    inv_freq
        .iter()
        .map(|&f| {
            let angle = p * f;
            (angle.cos(), angle.sin())
        })
        .unzip()
}

impl GenerationConfig {
    /// Reads `generation_config.json`.
    pub fn from_file(path: &Path) -> Result<GenerationConfig, ModelError> {
        GenerationConfig::parse(&read_text(path)?, Some(path))
    }

    /// Parses the text of a `generation_config.json`.
    pub fn from_json_str(text: &str) -> Result<GenerationConfig, ModelError> {
        GenerationConfig::parse(text, None)
    }

    /// Reads `dir/generation_config.json`, or returns the default (nothing set) when the file does
    /// not exist. A file that exists but is malformed is still an error.
    pub fn from_dir_or_default(dir: &Path) -> Result<GenerationConfig, ModelError> {
        let path = dir.join(crate::model_dir::GENERATION_CONFIG_FILE);
        match std::fs::read_to_string(&path) {
            Ok(text) => GenerationConfig::parse(&text, Some(&path)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(GenerationConfig::default()),
            Err(e) => Err(ModelError::io(path, e)),
        }
    }

    fn parse(text: &str, path: Option<&Path>) -> Result<GenerationConfig, ModelError> {
        let mut value = Value::Null;
        let obj = parse_object(text, path, &mut value)?;
        let r = JsonReader { obj, path };
        Ok(GenerationConfig {
            bos_token_ids: r.token_ids("bos_token_id")?.unwrap_or_default(),
            eos_token_ids: r.token_ids("eos_token_id")?.unwrap_or_default(),
            // Some files give a list here too; the first id is the pad token.
            pad_token_id: r.token_ids("pad_token_id")?.and_then(|ids| ids.first().copied()),
            temperature: r.f32_opt("temperature")?,
            top_k: r.usize_opt("top_k")?,
            top_p: r.f32_opt("top_p")?,
            do_sample: r.bool_opt("do_sample")?,
            max_length: r.usize_opt("max_length")?,
        })
    }

    /// A `generation_config.json` with the fields that are set.
    pub fn to_json(&self) -> String {
        let mut obj = Map::new();
        if !self.bos_token_ids.is_empty() {
            obj.insert("bos_token_id".into(), token_ids_json(&self.bos_token_ids));
        }
        if !self.eos_token_ids.is_empty() {
            obj.insert("eos_token_id".into(), token_ids_json(&self.eos_token_ids));
        }
        if let Some(v) = self.pad_token_id {
            obj.insert("pad_token_id".into(), json!(v));
        }
        if let Some(v) = self.temperature {
            obj.insert("temperature".into(), json!(v));
        }
        if let Some(v) = self.top_k {
            obj.insert("top_k".into(), json!(v));
        }
        if let Some(v) = self.top_p {
            obj.insert("top_p".into(), json!(v));
        }
        if let Some(v) = self.do_sample {
            obj.insert("do_sample".into(), json!(v));
        }
        if let Some(v) = self.max_length {
            obj.insert("max_length".into(), json!(v));
        }
        serde_json::to_string_pretty(&Value::Object(obj)).expect("a JSON value serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
      "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3"
      },
      "rope_theta": 500000.0,
      "tie_word_embeddings": true,
      "torch_dtype": "bfloat16",
      "transformers_version": "4.45.0.dev0",
      "use_cache": true,
      "vocab_size": 128256
    }"#;

    const SMOLLM2_135M: &str = r#"{
      "architectures": ["LlamaForCausalLM"],
      "attention_bias": false,
      "bos_token_id": 1,
      "eos_token_id": 2,
      "hidden_act": "silu",
      "hidden_size": 576,
      "initializer_range": 0.041666666666666664,
      "intermediate_size": 1536,
      "is_llama_config": true,
      "max_position_embeddings": 8192,
      "model_type": "llama",
      "num_attention_heads": 9,
      "num_hidden_layers": 30,
      "num_key_value_heads": 3,
      "pad_token_id": 2,
      "pretraining_tp": 1,
      "rms_norm_eps": 1e-05,
      "rope_interleaved": false,
      "rope_scaling": null,
      "rope_theta": 100000,
      "tie_word_embeddings": true,
      "torch_dtype": "bfloat16",
      "use_cache": true,
      "vocab_size": 49152
    }"#;

    fn with(base: &str, key: &str, value: Value) -> String {
        let mut v: Value = serde_json::from_str(base).unwrap();
        v.as_object_mut().unwrap().insert(key.to_string(), value);
        v.to_string()
    }

    fn without(base: &str, key: &str) -> String {
        let mut v: Value = serde_json::from_str(base).unwrap();
        v.as_object_mut().unwrap().remove(key);
        v.to_string()
    }

    #[test]
    fn parses_llama32_1b_from_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        std::fs::write(&path, LLAMA32_1B).unwrap();
        let c = LlamaConfig::from_file(&path).unwrap();
        assert_eq!(
            c,
            LlamaConfig {
                vocab_size: 128256,
                hidden_size: 2048,
                intermediate_size: 8192,
                num_hidden_layers: 16,
                num_attention_heads: 32,
                num_key_value_heads: 8,
                head_dim: 64,
                max_position_embeddings: 131072,
                rms_norm_eps: 1e-5,
                rope_theta: 500000.0,
                rope_scaling: Some(RopeScaling::Llama3 {
                    factor: 32.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 8192
                }),
                tie_word_embeddings: true,
                bos_token_ids: vec![128000],
                eos_token_ids: vec![128001, 128008, 128009],
            }
        );
        assert_eq!((c.q_dim(), c.kv_dim()), (2048, 512));
    }

    #[test]
    fn absurd_sizes_are_refused_before_anything_is_sized_from_them() {
        let base = crate::random::tiny_config();
        for (field, value) in [
            ("num_hidden_layers", 1_000_000_000),
            ("num_attention_heads", usize::MAX / 2),
            ("head_dim", 1 << 40),
            ("vocab_size", 1 << 40),
            ("eos_token_id", 1 << 20),
            ("bos_token_id", 256),
        ] {
            let mut json: serde_json::Value = serde_json::from_str(&base.to_json()).unwrap();
            json[field] = serde_json::json!(value);
            let err = LlamaConfig::from_json_str(&json.to_string()).unwrap_err().to_string();
            assert!(
                err.contains("limit") || err.contains("multiple") || err.contains("outside the vocabulary"),
                "{field}={value}: {err}"
            );
        }
    }

    #[test]
    fn parses_smollm2() {
        let c = LlamaConfig::from_json_str(SMOLLM2_135M).unwrap();
        assert_eq!(c.head_dim, 64);
        assert_eq!(c.num_key_value_heads, 3);
        assert_eq!(c.rope_theta, 100000.0);
        assert_eq!(c.rope_scaling, None);
        assert!(c.tie_word_embeddings);
        assert_eq!((c.bos_token_ids.clone(), c.eos_token_ids.clone()), (vec![1], vec![2]));
    }

    #[test]
    fn defaults_follow_transformers() {
        let text = r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
                       "num_hidden_layers": 2, "num_attention_heads": 4}"#;
        let c = LlamaConfig::from_json_str(text).unwrap();
        assert_eq!(c.num_key_value_heads, 4);
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.rope_theta, 10000.0);
        assert_eq!(c.rms_norm_eps, 1e-6);
        assert_eq!(c.max_position_embeddings, 2048);
        assert!(!c.tie_word_embeddings);
        assert_eq!((c.bos_token_ids, c.eos_token_ids), (vec![1], vec![2]));
        // Explicit nulls mean "no such token".
        let c =
            LlamaConfig::from_json_str(&with(&with(text, "bos_token_id", Value::Null), "eos_token_id", Value::Null))
                .unwrap();
        assert!(c.bos_token_ids.is_empty() && c.eos_token_ids.is_empty());
    }

    #[test]
    fn to_json_round_trips() {
        for text in [LLAMA32_1B, SMOLLM2_135M] {
            let c = LlamaConfig::from_json_str(text).unwrap();
            let written = c.to_json();
            assert_eq!(LlamaConfig::from_json_str(&written).unwrap(), c);
            let v: Value = serde_json::from_str(&written).unwrap();
            assert_eq!(v["model_type"], "llama");
            assert_eq!(v["architectures"][0], "LlamaForCausalLM");
            assert_eq!(v["torch_dtype"], "float16");
        }
        let v: Value = serde_json::from_str(&LlamaConfig::from_json_str(LLAMA32_1B).unwrap().to_json()).unwrap();
        assert_eq!(v["rope_scaling"]["rope_type"], "llama3");
        assert_eq!(v["eos_token_id"], json!([128001, 128008, 128009]));
        assert_eq!(v["bos_token_id"], json!(128000));
    }

    #[test]
    fn rope_parameters_of_transformers_v5() {
        let mut v: Value = serde_json::from_str(LLAMA32_1B).unwrap();
        let obj = v.as_object_mut().unwrap();
        let mut params = obj.remove("rope_scaling").unwrap();
        params["rope_theta"] = obj.remove("rope_theta").unwrap();
        obj.insert("rope_parameters".into(), params);
        assert_eq!(
            LlamaConfig::from_json_str(&v.to_string()).unwrap(),
            LlamaConfig::from_json_str(LLAMA32_1B).unwrap()
        );
        // Old "type" key and the "default" type.
        let c = LlamaConfig::from_json_str(&with(SMOLLM2_135M, "rope_scaling", json!({"type": "default"}))).unwrap();
        assert_eq!(c.rope_scaling, None);
    }

    #[test]
    fn malformed_json_is_a_json_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        std::fs::write(&path, "{\"model_type\": \"llama\",").unwrap();
        match LlamaConfig::from_file(&path) {
            Err(ModelError::Json { path: Some(p), .. }) => assert_eq!(p, path),
            other => panic!("{other:?}"),
        }
        assert!(matches!(LlamaConfig::from_json_str("[1, 2]"), Err(ModelError::Json { .. })));
        assert!(matches!(LlamaConfig::from_file(&dir.path().join("nope.json")), Err(ModelError::MissingFile { .. })));
    }

    #[test]
    fn other_architectures_are_rejected() {
        for (key, value) in [
            ("model_type", json!("qwen2")),
            ("model_type", json!("gemma")),
            ("architectures", json!(["Qwen2ForCausalLM"])),
        ] {
            let err = LlamaConfig::from_json_str(&with(SMOLLM2_135M, key, value)).unwrap_err();
            assert!(matches!(err, ModelError::UnsupportedArchitecture { .. }), "{err:?}");
        }
        // A model_type and architectures of two families contradict each other.
        let mixed = with(SMOLLM2_135M, "architectures", json!(["MistralForCausalLM"]));
        assert!(matches!(LlamaConfig::from_json_str(&mixed), Err(ModelError::Config { .. })));
        let bare = without(&without(SMOLLM2_135M, "model_type"), "architectures");
        assert!(matches!(LlamaConfig::from_json_str(&bare), Err(ModelError::UnsupportedArchitecture { .. })));
        // architectures alone is enough.
        assert!(LlamaConfig::from_json_str(&without(SMOLLM2_135M, "model_type")).is_ok());
    }

    /// Mistral is read as Llama with the context ending at its sliding window, transformers'
    /// defaults where its keys are absent.
    #[test]
    fn mistral_is_llama_within_its_window() {
        let mistral = |edits: &[(&str, Option<Value>)]| {
            let mut text = with(
                &with(SMOLLM2_135M, "model_type", json!("mistral")),
                "architectures",
                json!(["MistralForCausalLM"]),
            );
            for (key, value) in edits {
                text = match value {
                    Some(v) => with(&text, key, v.clone()),
                    None => without(&text, key),
                };
            }
            LlamaConfig::from_json_str(&text)
        };
        let llama = LlamaConfig::from_json_str(SMOLLM2_135M).unwrap();
        // No window: the same model, field for field.
        assert_eq!(mistral(&[("sliding_window", Some(Value::Null))]).unwrap(), llama);
        // A window shorter than the positions ends the context; a longer one changes nothing.
        let windowed =
            mistral(&[("sliding_window", Some(json!(1024))), ("max_position_embeddings", Some(json!(32768)))]);
        assert_eq!(windowed.unwrap().max_position_embeddings, 1024);
        let wide = mistral(&[("sliding_window", Some(json!(1 << 20)))]).unwrap();
        assert_eq!(wide.max_position_embeddings, llama.max_position_embeddings);
        // transformers' MistralConfig defaults: a window of 4096, 131072 positions, 8 KV heads.
        let defaults = mistral(&[("sliding_window", None), ("max_position_embeddings", None)]).unwrap();
        assert_eq!(defaults.max_position_embeddings, 4096);
        let no_window = mistral(&[("sliding_window", Some(Value::Null)), ("max_position_embeddings", None)]).unwrap();
        assert_eq!(no_window.max_position_embeddings, 131_072);
        let heads = mistral(&[
            ("num_key_value_heads", None),
            ("num_attention_heads", Some(json!(16))),
            ("hidden_size", Some(json!(1024))),
        ]);
        assert_eq!(heads.unwrap().num_key_value_heads, 8);
        // Architectures alone says Mistral too.
        let bare = without(&with(SMOLLM2_135M, "architectures", json!(["MistralForCausalLM"])), "model_type");
        assert_eq!(LlamaConfig::from_json_str(&bare).unwrap().max_position_embeddings, 4096);
        for bad in [json!(0), json!(-1), json!("4096")] {
            assert!(matches!(mistral(&[("sliding_window", Some(bad))]), Err(ModelError::Config { .. })));
        }
    }

    #[test]
    fn unsupported_features_are_rejected() {
        for (key, value) in [
            ("attention_bias", json!(true)),
            ("mlp_bias", json!(true)),
            ("hidden_act", json!("gelu")),
            ("rope_scaling", json!({"rope_type": "yarn", "factor": 4.0})),
            ("rope_scaling", json!({"type": "linear", "factor": 2.0})),
        ] {
            let err = LlamaConfig::from_json_str(&with(SMOLLM2_135M, key, value.clone())).unwrap_err();
            assert!(matches!(err, ModelError::Unsupported { .. }), "{key}={value}: {err:?}");
        }
    }

    #[test]
    fn invalid_values_are_config_errors() {
        let cases = [
            with(SMOLLM2_135M, "num_key_value_heads", json!(4)),
            with(SMOLLM2_135M, "num_attention_heads", json!(7)),
            with(SMOLLM2_135M, "hidden_size", json!(0)),
            with(&with(SMOLLM2_135M, "head_dim", json!(63)), "num_attention_heads", json!(9)),
            with(SMOLLM2_135M, "vocab_size", json!(-3)),
            with(SMOLLM2_135M, "vocab_size", json!("many")),
            with(SMOLLM2_135M, "eos_token_id", json!("two")),
            with(SMOLLM2_135M, "rms_norm_eps", json!(0.0)),
            without(SMOLLM2_135M, "intermediate_size"),
            with(LLAMA32_1B, "rope_scaling", json!({"rope_type": "llama3", "factor": 8.0})),
            with(
                LLAMA32_1B,
                "rope_scaling",
                json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}),
            ),
        ];
        for text in cases {
            let err = LlamaConfig::from_json_str(&text).unwrap_err();
            assert!(matches!(err, ModelError::Config { .. }), "{err:?}");
        }
        // An explicit head_dim need not divide hidden_size.
        let c = LlamaConfig::from_json_str(&with(
            &with(SMOLLM2_135M, "head_dim", json!(32)),
            "num_attention_heads",
            json!(6),
        ))
        .unwrap();
        assert_eq!((c.head_dim, c.q_dim()), (32, 192));
    }

    #[test]
    fn rope_frequencies_without_scaling() {
        let c = LlamaConfig::from_json_str(SMOLLM2_135M).unwrap();
        let f = c.rope_inv_freq();
        assert_eq!(f.len(), 32);
        assert_eq!(f[0], 1.0);
        for (i, &x) in f.iter().enumerate() {
            let exact = 1.0 / 100000f64.powf(2.0 * i as f64 / 64.0);
            assert!(((x as f64 - exact) / exact).abs() < 1e-6, "{i}: {x} vs {exact}");
        }
        let (cos, sin) = c.rope_cos_sin(0);
        assert!(cos.iter().all(|&x| x == 1.0) && sin.iter().all(|&x| x == 0.0));
        let (cos, sin) = c.rope_cos_sin(3);
        assert_eq!(cos[0], 3f32.cos());
        assert_eq!(sin[5], (3.0f32 * f[5]).sin());
    }

    #[test]
    fn llama3_scaling_bands() {
        let c = LlamaConfig::from_json_str(LLAMA32_1B).unwrap();
        let scaled = c.rope_inv_freq();
        let plain = LlamaConfig { rope_scaling: None, ..c.clone() }.rope_inv_freq();
        assert_eq!(scaled.len(), 32);
        // Bands, by hand: wavelength 2*pi*500000^(2i/64); high band below 8192/4 = 2048, low band
        // above 8192/1 = 8192. 500000^(i/32) crosses 2048/(2*pi) = 326 at i = 14.1 and
        // 8192/(2*pi) = 1304 at i = 17.6.
        for i in 0..=14 {
            assert_eq!(scaled[i], plain[i], "high frequency {i} must be unchanged");
        }
        for i in 18..32 {
            assert_eq!(scaled[i], plain[i] / 32.0, "low frequency {i} must be divided by 32");
        }
        // One in the band, by hand in f64: i = 16, inv_freq = 500000^(-0.5) = 1/707.107,
        // wavelength 4442.88, smooth = (8192 / 4442.88 - 1) / 3 = 0.28128,
        // result = (1 - smooth) * f / 32 + smooth * f = 0.30353 * f.
        let f = 500000f64.powf(-0.5);
        let wavelen = 2.0 * std::f64::consts::PI / f;
        let smooth = (8192.0 / wavelen - 1.0) / 3.0;
        assert!((smooth - 0.28128).abs() < 1e-4, "{smooth}");
        let expected = (1.0 - smooth) * f / 32.0 + smooth * f;
        assert!(((scaled[16] as f64 - expected) / expected).abs() < 1e-5, "{} vs {expected}", scaled[16]);
        for i in 15..=17 {
            assert!(scaled[i] < plain[i] && scaled[i] > plain[i] / 32.0, "{i} is in the smooth band");
        }
    }

    /// Bit patterns of `inv_freq` for the Llama-3.2-1B config as computed by Hugging Face
    /// transformers 4.46.3 (`ROPE_INIT_FUNCTIONS["llama3"]`, torch 2.5.1, CPU, float32).
    const TRANSFORMERS_LLAMA32_INV_FREQ_BITS: [u32; 32] = [
        1065353216, 1059709382, 1054963644, 1049992931, 1044812720, 1040434848, 1034871981, 1030233703, 1025116360,
        1020030793, 1015523779, 1010044269, 1005516623, 1000248322, 995260192, 984164251, 971060768, 952867063,
        933446029, 928558209, 923781368, 918476020, 914179523, 908595819, 903811268, 898893515, 893679120, 889347892,
        883754919, 879076685, 874013863, 868893104,
    ];

    #[test]
    fn llama3_inv_freq_matches_transformers() {
        let c = LlamaConfig::from_json_str(LLAMA32_1B).unwrap();
        let ours: Vec<u32> = c.rope_inv_freq().iter().map(|f| f.to_bits()).collect();
        let mismatches: Vec<(usize, u32, u32)> = ours
            .iter()
            .zip(TRANSFORMERS_LLAMA32_INV_FREQ_BITS)
            .enumerate()
            .filter(|(_, (a, b))| **a != *b)
            .map(|(i, (a, b))| (i, *a, b))
            .collect();
        assert!(mismatches.is_empty(), "(index, ours, transformers): {mismatches:?}");
    }

    #[test]
    fn generation_config_round_trip_and_default() {
        let text = r#"{"bos_token_id": 128000, "eos_token_id": [128001, 128009], "do_sample": true,
                       "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.45.0"}"#;
        let g = GenerationConfig::from_json_str(text).unwrap();
        assert_eq!(g.eos_token_ids, vec![128001, 128009]);
        assert_eq!(g.temperature, Some(0.6));
        assert_eq!(g.top_k, None);
        assert_eq!(GenerationConfig::from_json_str(&g.to_json()).unwrap(), g);

        let dir = tempfile::tempdir().unwrap();
        assert_eq!(GenerationConfig::from_dir_or_default(dir.path()).unwrap(), GenerationConfig::default());
        std::fs::write(dir.path().join("generation_config.json"), "{oops").unwrap();
        assert!(matches!(GenerationConfig::from_dir_or_default(dir.path()), Err(ModelError::Json { .. })));
        std::fs::write(dir.path().join("generation_config.json"), text).unwrap();
        assert_eq!(GenerationConfig::from_dir_or_default(dir.path()).unwrap(), g);
    }
}
