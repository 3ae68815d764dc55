//! The backend-neutral host copy of a Llama model's weights.
//!
//! Every backend (the reference interpreter, the compiler backends) starts from a [`LlamaWeights`]:
//! it validates shapes once, here, so that a backend never sees a malformed model.

use crate::config::LlamaConfig;
use crate::error::ModelError;
use crate::int4::{self, Int4Matrix};
use crate::model_dir::{CONFIG_FILE, INT4_WEIGHTS_FILE};
use crate::tensor_store::{write_safetensors_raw, Dtype, RawTensor, TensorStore};
use half::{f16, slice::HalfFloatSliceExt};
use rayon::prelude::*;
use session_api::WeightFormat;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// A linear weight of shape `[rows, cols]` = `[out_features, in_features]` (Hugging Face layout:
/// `y = W x`, row `r` holds the weights of output `r`). The embedding table uses the same type with
/// `rows = vocab_size`, `cols = hidden_size`, so a token's embedding is one row.
#[derive(Debug, Clone)]
pub enum Matrix {
    /// Row-major f16 values, `rows * cols` of them.
    F16 { rows: usize, cols: usize, data: Vec<f16> },
    /// seam's int4 format, see [`crate::int4`].
    Int4(Int4Matrix),
}

/// The weights of one decoder layer.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// RMSNorm weight before attention, `[hidden]`.
    pub attn_norm: Vec<f32>,
    /// `[n_heads * head_dim, hidden]`.
    pub wq: Matrix,
    /// `[n_kv_heads * head_dim, hidden]`.
    pub wk: Matrix,
    /// `[n_kv_heads * head_dim, hidden]`.
    pub wv: Matrix,
    /// `[hidden, n_heads * head_dim]`.
    pub wo: Matrix,
    /// RMSNorm weight before the MLP, `[hidden]`.
    pub mlp_norm: Vec<f32>,
    /// `[intermediate, hidden]`.
    pub w_gate: Matrix,
    /// `[intermediate, hidden]`.
    pub w_up: Matrix,
    /// `[hidden, intermediate]`.
    pub w_down: Matrix,
}

/// All weights of a Llama model, in one weight format, validated against its config.
#[derive(Debug, Clone)]
pub struct LlamaWeights {
    pub config: LlamaConfig,
    /// `[vocab, hidden]`.
    pub embed: Matrix,
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm weight, `[hidden]`.
    pub final_norm: Vec<f32>,
    /// `[vocab, hidden]`; `None` when the embeddings are tied (the LM head is `embed`).
    pub lm_head: Option<Matrix>,
}

/// Hugging Face tensor names of a Llama checkpoint.
pub mod names {
    /// Token embeddings, `[vocab, hidden]`.
    pub const EMBED_TOKENS: &str = "model.embed_tokens.weight";
    /// Final RMSNorm, `[hidden]`.
    pub const FINAL_NORM: &str = "model.norm.weight";
    /// Output projection, `[vocab, hidden]` (absent when embeddings are tied).
    pub const LM_HEAD: &str = "lm_head.weight";
    /// Per-layer suffixes, in the order [`super::expected_tensors`] lists them.
    pub const INPUT_LAYERNORM: &str = "input_layernorm.weight";
    pub const Q_PROJ: &str = "self_attn.q_proj.weight";
    pub const K_PROJ: &str = "self_attn.k_proj.weight";
    pub const V_PROJ: &str = "self_attn.v_proj.weight";
    pub const O_PROJ: &str = "self_attn.o_proj.weight";
    pub const POST_ATTENTION_LAYERNORM: &str = "post_attention_layernorm.weight";
    pub const GATE_PROJ: &str = "mlp.gate_proj.weight";
    pub const UP_PROJ: &str = "mlp.up_proj.weight";
    pub const DOWN_PROJ: &str = "mlp.down_proj.weight";

    /// `model.layers.{layer}.{suffix}`.
    pub fn layer(layer: usize, suffix: &str) -> String {
        format!("model.layers.{layer}.{suffix}")
    }
}

/// Whether a tensor is an RMSNorm weight (a vector, kept in f32) or a matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorRole {
    Norm,
    Matrix,
}

/// One tensor a Llama checkpoint must contain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Hugging Face name.
    pub name: String,
    /// `[n]` for norms, `[rows, cols]` for matrices.
    pub shape: Vec<usize>,
    pub role: TensorRole,
}

/// Every tensor the config implies, in a fixed order: embeddings; per layer the attention norm, q,
/// k, v, o, the MLP norm, gate, up, down; the final norm; the LM head unless embeddings are tied.
pub fn expected_tensors(config: &LlamaConfig) -> Vec<TensorSpec> {
    let (h, q, kv, ffn, vocab) =
        (config.hidden_size, config.q_dim(), config.kv_dim(), config.intermediate_size, config.vocab_size);
    let norm = |name: String| TensorSpec { name, shape: vec![h], role: TensorRole::Norm };
    let matrix = |name: String, rows, cols| TensorSpec { name, shape: vec![rows, cols], role: TensorRole::Matrix };
    let mut specs = vec![matrix(names::EMBED_TOKENS.to_string(), vocab, h)];
    for i in 0..config.num_hidden_layers {
        let n = |suffix| names::layer(i, suffix);
        specs.push(norm(n(names::INPUT_LAYERNORM)));
        specs.push(matrix(n(names::Q_PROJ), q, h));
        specs.push(matrix(n(names::K_PROJ), kv, h));
        specs.push(matrix(n(names::V_PROJ), kv, h));
        specs.push(matrix(n(names::O_PROJ), h, q));
        specs.push(norm(n(names::POST_ATTENTION_LAYERNORM)));
        specs.push(matrix(n(names::GATE_PROJ), ffn, h));
        specs.push(matrix(n(names::UP_PROJ), ffn, h));
        specs.push(matrix(n(names::DOWN_PROJ), h, ffn));
    }
    specs.push(norm(names::FINAL_NORM.to_string()));
    if !config.tie_word_embeddings {
        specs.push(matrix(names::LM_HEAD.to_string(), vocab, h));
    }
    specs
}

/// A borrowed tensor of a [`LlamaWeights`], in [`expected_tensors`] order.
#[derive(Debug, Clone, Copy)]
pub enum TensorRef<'a> {
    Norm(&'a [f32]),
    Matrix(&'a Matrix),
}

impl Matrix {
    /// Output features.
    pub fn rows(&self) -> usize {
        match self {
            Matrix::F16 { rows, .. } => *rows,
            Matrix::Int4(m) => m.rows,
        }
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        match self {
            Matrix::F16 { cols, .. } => *cols,
            Matrix::Int4(m) => m.cols,
        }
    }

    /// The weight format of this matrix.
    pub fn format(&self) -> WeightFormat {
        match self {
            Matrix::F16 { .. } => WeightFormat::F16,
            Matrix::Int4(_) => WeightFormat::Int4,
        }
    }

    /// Bytes held by the matrix's data.
    pub fn byte_size(&self) -> usize {
        match self {
            Matrix::F16 { data, .. } => data.len() * 2,
            Matrix::Int4(m) => m.byte_size(),
        }
    }

    /// Row `row` as f32 (f16 widened, int4 dequantized) into `out` (`cols` values).
    ///
    /// # Panics
    /// If `row >= rows` or `out.len() != cols` (a caller bug).
    pub fn row_f32(&self, row: usize, out: &mut [f32]) {
        match self {
            Matrix::F16 { rows, cols, data } => {
                assert!(row < *rows, "row {row} of a matrix with {rows} rows");
                assert_eq!(out.len(), *cols, "output length must equal the column count");
                for (o, v) in out.iter_mut().zip(&data[row * cols..(row + 1) * cols]) {
                    *o = v.to_f32();
                }
            }
            Matrix::Int4(m) => m.dequantize_row(row, out),
        }
    }

    /// The whole matrix as row-major f32.
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            Matrix::F16 { data, .. } => {
                let mut out = vec![0.0f32; data.len()];
                data.convert_to_f32_slice(&mut out);
                out
            }
            Matrix::Int4(m) => m.dequantize(),
        }
    }

    /// The matrix in int4 (quantized when it is f16; cloned when it already is int4).
    pub fn to_int4(&self) -> Result<Int4Matrix, ModelError> {
        match self {
            Matrix::F16 { rows, cols, .. } => int4::quantize(&self.to_f32(), *rows, *cols),
            Matrix::Int4(m) => Ok(m.clone()),
        }
    }
}

impl LlamaWeights {
    /// Bytes held by all weights (matrices as stored, norms as f32). A tied LM head is counted once.
    pub fn byte_size(&self) -> usize {
        self.tensors()
            .iter()
            .map(|(_, t)| match t {
                TensorRef::Norm(v) => v.len() * 4,
                TensorRef::Matrix(m) => m.byte_size(),
            })
            .sum()
    }

    /// Every tensor with its Hugging Face name, in [`expected_tensors`] order.
    pub fn tensors(&self) -> Vec<(String, TensorRef<'_>)> {
        let mut out = vec![(names::EMBED_TOKENS.to_string(), TensorRef::Matrix(&self.embed))];
        for (i, l) in self.layers.iter().enumerate() {
            let n = |suffix| names::layer(i, suffix);
            out.push((n(names::INPUT_LAYERNORM), TensorRef::Norm(&l.attn_norm)));
            out.push((n(names::Q_PROJ), TensorRef::Matrix(&l.wq)));
            out.push((n(names::K_PROJ), TensorRef::Matrix(&l.wk)));
            out.push((n(names::V_PROJ), TensorRef::Matrix(&l.wv)));
            out.push((n(names::O_PROJ), TensorRef::Matrix(&l.wo)));
            out.push((n(names::POST_ATTENTION_LAYERNORM), TensorRef::Norm(&l.mlp_norm)));
            out.push((n(names::GATE_PROJ), TensorRef::Matrix(&l.w_gate)));
            out.push((n(names::UP_PROJ), TensorRef::Matrix(&l.w_up)));
            out.push((n(names::DOWN_PROJ), TensorRef::Matrix(&l.w_down)));
        }
        out.push((names::FINAL_NORM.to_string(), TensorRef::Norm(&self.final_norm)));
        if let Some(head) = &self.lm_head {
            out.push((names::LM_HEAD.to_string(), TensorRef::Matrix(head)));
        }
        out
    }

    /// Checks that every norm, f16 value and int4 scale and bias is finite: a NaN or an infinity
    /// in a weight makes every backend emit confident garbage (and a different garbage on each),
    /// so it is a typed error naming the tensor, at import and at load.
    pub fn check_finite(&self) -> Result<(), ModelError> {
        // An f16 is not finite when its exponent bits are all ones.
        let bad_f16 = |values: &[f16]| values.iter().position(|v| v.to_bits() & 0x7C00 == 0x7C00);
        self.tensors().par_iter().try_for_each(|(name, tensor)| {
            let bad = match tensor {
                TensorRef::Norm(values) => values.iter().position(|v| !v.is_finite()),
                TensorRef::Matrix(Matrix::F16 { data, .. }) => bad_f16(data),
                TensorRef::Matrix(Matrix::Int4(q)) => bad_f16(&q.scales).or_else(|| bad_f16(&q.biases)),
            };
            match bad {
                Some(at) => Err(ModelError::InvalidTensor {
                    name: name.clone(),
                    message: format!("value {at} (or its group's scale or bias) is not finite (NaN or infinity)"),
                }),
                None => Ok(()),
            }
        })
    }

    /// Checks every shape against the config (for weights built elsewhere, e.g. by an importer),
    /// and that every value is finite ([`LlamaWeights::check_finite`]).
    pub fn validate(&self) -> Result<(), ModelError> {
        self.config.validate().map_err(|message| ModelError::Config { path: None, message })?;
        let specs = expected_tensors(&self.config);
        let tensors = self.tensors();
        if self.layers.len() != self.config.num_hidden_layers {
            return Err(ModelError::Config {
                path: None,
                message: format!(
                    "{} layers of weights for a config with {}",
                    self.layers.len(),
                    self.config.num_hidden_layers
                ),
            });
        }
        if self.config.tie_word_embeddings != self.lm_head.is_none() {
            return Err(ModelError::Config {
                path: None,
                message: "an LM head must be present exactly when the embeddings are not tied".to_string(),
            });
        }
        for (spec, (name, tensor)) in specs.iter().zip(&tensors) {
            let found = match tensor {
                TensorRef::Norm(v) => vec![v.len()],
                TensorRef::Matrix(m) => {
                    let consistent = match m {
                        Matrix::F16 { rows, cols, data } => data.len() == rows * cols,
                        Matrix::Int4(q) => {
                            q.cols % int4::GROUP_SIZE == 0
                                && q.packed.len() == q.rows * q.cols / 2
                                && q.scales.len() == q.rows * q.cols / int4::GROUP_SIZE
                                && q.biases.len() == q.scales.len()
                        }
                    };
                    if !consistent {
                        return Err(ModelError::InvalidTensor {
                            name: name.clone(),
                            message: "data length does not match rows and columns".to_string(),
                        });
                    }
                    vec![m.rows(), m.cols()]
                }
            };
            if found != spec.shape {
                return Err(ModelError::Shape { name: name.clone(), expected: spec.shape.clone(), found });
            }
        }
        self.check_finite()
    }
}

/// A loaded tensor before it is put in its place in [`LlamaWeights`].
pub(crate) enum Loaded {
    Norm(Vec<f32>),
    Matrix(Matrix),
}

/// Puts tensors loaded in [`expected_tensors`] order into a [`LlamaWeights`].
pub(crate) fn assemble(config: &LlamaConfig, loaded: Vec<Loaded>) -> LlamaWeights {
    // The order is fixed by `expected_tensors`, so a mismatch here is a bug in this file.
    fn norm(it: &mut std::vec::IntoIter<Loaded>) -> Vec<f32> {
        match it.next() {
            Some(Loaded::Norm(v)) => v,
            _ => unreachable!("tensor order of expected_tensors"),
        }
    }
    fn matrix(it: &mut std::vec::IntoIter<Loaded>) -> Matrix {
        match it.next() {
            Some(Loaded::Matrix(m)) => m,
            _ => unreachable!("tensor order of expected_tensors"),
        }
    }
    let mut it = loaded.into_iter();
    let embed = matrix(&mut it);
    let layers = (0..config.num_hidden_layers)
        .map(|_| LayerWeights {
            attn_norm: norm(&mut it),
            wq: matrix(&mut it),
            wk: matrix(&mut it),
            wv: matrix(&mut it),
            wo: matrix(&mut it),
            mlp_norm: norm(&mut it),
            w_gate: matrix(&mut it),
            w_up: matrix(&mut it),
            w_down: matrix(&mut it),
        })
        .collect();
    let final_norm = norm(&mut it);
    let lm_head = if config.tie_word_embeddings { None } else { Some(matrix(&mut it)) };
    LlamaWeights { config: config.clone(), embed, layers, final_norm, lm_head }
}

/// Counts finished tensors and reports them.
struct Progress<'a> {
    callback: Option<&'a (dyn Fn(u64, u64) + Sync)>,
    done: AtomicU64,
    total: u64,
}

impl Progress<'_> {
    fn start(&self) {
        if let Some(f) = self.callback {
            f(0, self.total);
        }
    }

    fn tick(&self) {
        let done = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(f) = self.callback {
            f(done, self.total);
        }
    }
}

fn check_shape(store: &TensorStore, spec: &TensorSpec, name: &str) -> Result<(), ModelError> {
    let found = store.shape(name)?;
    if found != spec.shape.as_slice() {
        return Err(ModelError::Shape { name: name.to_string(), expected: spec.shape.clone(), found: found.to_vec() });
    }
    Ok(())
}

/// Loads the weights of the model directory `dir` in `format`.
///
/// - F16: from `model.safetensors` or a sharded checkpoint (f32, f16 or bf16 on disk); matrices
///   become [`Matrix::F16`], norms f32.
/// - Int4: from `model.int4.safetensors` when it exists (every matrix, the embeddings included, is
///   [`Matrix::Int4`]); otherwise the float checkpoint is quantized (in parallel) and the result is
///   written to `model.int4.safetensors` so the next load skips the work. If that file cannot be
///   written (a read-only directory, a full disk) the weights are returned anyway.
///
/// Every shape is checked against `config.json` and every value for being finite;
/// `progress(done, total)` counts tensors.
pub fn load_weights(
    dir: &Path,
    format: WeightFormat,
    progress: Option<&(dyn Fn(u64, u64) + Sync)>,
) -> Result<LlamaWeights, ModelError> {
    let weights = load_weights_unchecked(dir, format, progress)?;
    weights.check_finite()?;
    Ok(weights)
}

/// [`load_weights`] without the finiteness check.
fn load_weights_unchecked(
    dir: &Path,
    format: WeightFormat,
    progress: Option<&(dyn Fn(u64, u64) + Sync)>,
) -> Result<LlamaWeights, ModelError> {
    let config = LlamaConfig::from_file(&dir.join(CONFIG_FILE))?;
    let specs = expected_tensors(&config);
    let progress = Progress { callback: progress, done: AtomicU64::new(0), total: specs.len() as u64 };
    match format {
        WeightFormat::F16 => {
            let store = TensorStore::open(dir)?;
            progress.start();
            let loaded = load_float(&store, &specs, &progress, |spec, _| {
                let data = store.read_f16(&spec.name)?;
                Ok(Matrix::F16 { rows: spec.shape[0], cols: spec.shape[1], data })
            })?;
            Ok(assemble(&config, loaded))
        }
        WeightFormat::Int4 => {
            let int4_path = dir.join(INT4_WEIGHTS_FILE);
            if int4_path.is_file() {
                let store = TensorStore::open_file(&int4_path)?;
                int4::check_int4_metadata(&store)?;
                progress.start();
                let loaded = specs
                    .par_iter()
                    .map(|spec| {
                        let tensor = match spec.role {
                            TensorRole::Norm => {
                                check_shape(&store, spec, &spec.name)?;
                                Loaded::Norm(store.read_f32(&spec.name)?)
                            }
                            TensorRole::Matrix => {
                                let m = Int4Matrix::from_store(&store, &spec.name)?;
                                if [m.rows, m.cols] != [spec.shape[0], spec.shape[1]] {
                                    return Err(ModelError::Shape {
                                        name: format!("{}{}", spec.name, int4::QWEIGHT_SUFFIX),
                                        expected: vec![spec.shape[0], spec.shape[1] / 2],
                                        found: vec![m.rows, m.cols / 2],
                                    });
                                }
                                Loaded::Matrix(Matrix::Int4(m))
                            }
                        };
                        progress.tick();
                        Ok(tensor)
                    })
                    .collect::<Result<Vec<_>, ModelError>>()?;
                Ok(assemble(&config, loaded))
            } else {
                let store = TensorStore::open(dir)?;
                progress.start();
                let loaded = load_float(&store, &specs, &progress, |spec, _| {
                    let values = store.read_f32(&spec.name)?;
                    let m = int4::quantize(&values, spec.shape[0], spec.shape[1]).map_err(|e| match e {
                        ModelError::Quantization { message } => {
                            ModelError::Quantization { message: format!("{}: {message}", spec.name) }
                        }
                        other => other,
                    })?;
                    Ok(Matrix::Int4(m))
                })?;
                let weights = assemble(&config, loaded);
                // The cache is an optimization: failing to write it must not fail the load.
                let _ = write_int4_weights(&int4_path, &weights);
                Ok(weights)
            }
        }
    }
}

/// Loads float tensors in parallel: norms as f32, matrices through `matrix`, each shape checked.
fn load_float(
    store: &TensorStore,
    specs: &[TensorSpec],
    progress: &Progress<'_>,
    matrix: impl Fn(&TensorSpec, &TensorStore) -> Result<Matrix, ModelError> + Sync,
) -> Result<Vec<Loaded>, ModelError> {
    // Fail on a missing tensor or a wrong shape before spending time converting anything.
    for spec in specs {
        check_shape(store, spec, &spec.name)?;
    }
    specs
        .par_iter()
        .map(|spec| {
            let tensor = match spec.role {
                TensorRole::Norm => Loaded::Norm(store.read_f32(&spec.name)?),
                TensorRole::Matrix => Loaded::Matrix(matrix(spec, store)?),
            };
            progress.tick();
            Ok(tensor)
        })
        .collect()
}

/// Writes `weights` as seam's int4 file (atomically): every matrix int4 under
/// `{name}.qweight/.scales/.biases` (f16 matrices are quantized first), norms as F32 under their
/// own names, with the seam-int4 metadata.
pub fn write_int4_weights(path: &Path, weights: &LlamaWeights) -> Result<(), ModelError> {
    weights.validate()?;
    let tensors = weights.tensors();
    // Quantize what is not int4 yet, in parallel; borrow what already is.
    let converted: Vec<Option<Int4Matrix>> = tensors
        .par_iter()
        .map(|(_, t)| match t {
            TensorRef::Matrix(m @ Matrix::F16 { .. }) => m.to_int4().map(Some),
            _ => Ok(None),
        })
        .collect::<Result<_, ModelError>>()?;
    struct Entry<'a> {
        name: String,
        dtype: Dtype,
        shape: Vec<usize>,
        bytes: &'a [u8],
    }
    let mut entries: Vec<Entry<'_>> = Vec::new();
    for ((name, tensor), own) in tensors.iter().zip(&converted) {
        match tensor {
            TensorRef::Norm(v) => entries.push(Entry {
                name: name.clone(),
                dtype: Dtype::F32,
                shape: vec![v.len()],
                bytes: bytemuck::cast_slice(v),
            }),
            TensorRef::Matrix(m) => {
                let q: &Int4Matrix = match (m, own) {
                    (Matrix::Int4(q), _) => q,
                    (_, Some(q)) => q,
                    _ => unreachable!("every f16 matrix was quantized above"),
                };
                let groups = q.cols / int4::GROUP_SIZE;
                entries.push(Entry {
                    name: format!("{name}{}", int4::QWEIGHT_SUFFIX),
                    dtype: Dtype::U8,
                    shape: vec![q.rows, q.cols / 2],
                    bytes: &q.packed,
                });
                entries.push(Entry {
                    name: format!("{name}{}", int4::SCALES_SUFFIX),
                    dtype: Dtype::F16,
                    shape: vec![q.rows, groups],
                    bytes: bytemuck::cast_slice(&q.scales),
                });
                entries.push(Entry {
                    name: format!("{name}{}", int4::BIASES_SUFFIX),
                    dtype: Dtype::F16,
                    shape: vec![q.rows, groups],
                    bytes: bytemuck::cast_slice(&q.biases),
                });
            }
        }
    }
    let raw: Vec<RawTensor<'_>> =
        entries.iter().map(|e| RawTensor { name: &e.name, dtype: e.dtype, shape: &e.shape, bytes: e.bytes }).collect();
    write_safetensors_raw(path, &raw, &int4::int4_metadata())
}

/// Writes `weights` as a Hugging Face `model.safetensors` (atomically): matrices F16 (int4 ones
/// dequantized, then rounded to f16), norms F32, HF tensor names, `{"format": "pt"}` metadata.
pub fn write_f16_weights(path: &Path, weights: &LlamaWeights) -> Result<(), ModelError> {
    weights.validate()?;
    let tensors = weights.tensors();
    let converted: Vec<Option<Vec<f16>>> = tensors
        .par_iter()
        .map(|(_, t)| match t {
            TensorRef::Matrix(Matrix::Int4(q)) => {
                let values = q.dequantize();
                let mut data = vec![f16::ZERO; values.len()];
                data.convert_from_f32_slice(&values);
                Some(data)
            }
            _ => None,
        })
        .collect();
    let mut shapes: Vec<Vec<usize>> = Vec::new();
    for (_, t) in &tensors {
        shapes.push(match t {
            TensorRef::Norm(v) => vec![v.len()],
            TensorRef::Matrix(m) => vec![m.rows(), m.cols()],
        });
    }
    let raw: Vec<RawTensor<'_>> = tensors
        .iter()
        .zip(&converted)
        .zip(&shapes)
        .map(|(((name, t), own), shape)| {
            let (dtype, bytes): (Dtype, &[u8]) = match (t, own) {
                (TensorRef::Norm(v), _) => (Dtype::F32, bytemuck::cast_slice(v)),
                (TensorRef::Matrix(Matrix::F16 { data, .. }), _) => (Dtype::F16, bytemuck::cast_slice(data)),
                (TensorRef::Matrix(_), Some(data)) => (Dtype::F16, bytemuck::cast_slice(data)),
                (TensorRef::Matrix(_), None) => unreachable!("every int4 matrix was dequantized above"),
            };
            RawTensor { name, dtype, shape, bytes }
        })
        .collect();
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    write_safetensors_raw(path, &raw, &metadata)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nan_or_infinity_in_a_weight_is_an_error_naming_the_tensor() {
        let config = crate::random::tiny_config();
        let clean = crate::random::random_weights(&config, 3).unwrap();
        assert!(clean.validate().is_ok());
        let mut norm = clean.clone();
        norm.layers[1].attn_norm[5] = f32::NAN;
        let mut matrix = clean.clone();
        if let Matrix::F16 { data, .. } = &mut matrix.layers[0].wq {
            data[7] = f16::INFINITY;
        }
        let mut scale = clean.clone();
        let mut quantized = scale.layers[0].wk.to_int4().unwrap();
        quantized.scales[2] = f16::NAN;
        scale.layers[0].wk = Matrix::Int4(quantized);
        let cases = [
            (norm, "layers.1.input_layernorm"),
            (matrix, "layers.0.self_attn.q_proj"),
            (scale, "layers.0.self_attn.k_proj"),
        ];
        for (weights, tensor) in cases {
            let err = weights.check_finite().unwrap_err().to_string();
            assert!(err.contains(tensor) && err.contains("not finite"), "{err}");
        }
    }
}
