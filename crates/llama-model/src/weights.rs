//! The backend-neutral host copy of a Llama model's weights.
//!
//! Every backend (the reference interpreter, the compiler backends) starts from a [`LlamaWeights`]:
//! it validates shapes once, here, so that a backend never sees a malformed model.

use crate::config::LlamaConfig;
use crate::error::ModelError;
use crate::int4::{self, Int4Matrix};
use crate::int8::{self, Int8Matrix};
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
    /// seam's int8 format, see [`crate::int8`] (an int4 model's embedding and output head).
    Int8(Int8Matrix),
}

/// How one matrix is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MatrixFormat {
    F16,
    Int4,
    Int8,
}

impl std::fmt::Display for MatrixFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MatrixFormat::F16 => "f16",
            MatrixFormat::Int4 => "int4",
            MatrixFormat::Int8 => "int8",
        })
    }
}

/// The formats of an int4 model's matrices: which are int4 and which int8 (ADR 0013).
///
/// Every decoder layer has the same layout (the graphs that loop over layers stack them), so the
/// layout is three formats: the token embedding, the output head (the embedding itself when tied)
/// and the decoder layers' matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Int4Layout {
    pub embed: MatrixFormat,
    /// Ignored when the embeddings are tied (the head is the embedding).
    pub head: MatrixFormat,
    pub layers: MatrixFormat,
}

impl Int4Layout {
    /// What quantizing a float model produces: the embedding and output head at 8 bits, the layers
    /// at 4 (llama.cpp keeps these two above 4 bits too: they hold the most error-sensitive rows).
    pub const DEFAULT: Int4Layout =
        Int4Layout { embed: MatrixFormat::Int8, head: MatrixFormat::Int8, layers: MatrixFormat::Int4 };
    /// Every matrix int4 (files of seam-int4 version 1, and `seam convert --embed-head-bits 4`).
    pub const ALL_INT4: Int4Layout =
        Int4Layout { embed: MatrixFormat::Int4, head: MatrixFormat::Int4, layers: MatrixFormat::Int4 };

    /// The format of the matrix named `name` (a Hugging Face tensor name).
    pub fn of(&self, name: &str) -> MatrixFormat {
        match name {
            names::EMBED_TOKENS => self.embed,
            names::LM_HEAD => self.head,
            _ => self.layers,
        }
    }

    /// `self` with the head's format equal to the embedding's when `tied` (one matrix).
    pub fn normalized(self, tied: bool) -> Int4Layout {
        if tied {
            Int4Layout { head: self.embed, ..self }
        } else {
            self
        }
    }
}

impl std::fmt::Display for Int4Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "embedding {}, head {}, layers {}", self.embed, self.head, self.layers)
    }
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

/// Fails when `store` holds layers beyond `config.num_hidden_layers`: a config that says fewer
/// layers than the weights hold would otherwise load and compute a different model (one that
/// says more is caught as a missing tensor).
fn check_layer_count(store: &TensorStore, config: &LlamaConfig, dir: &Path) -> Result<(), ModelError> {
    let deepest = store
        .names()
        .iter()
        .filter_map(|name| name.strip_prefix("model.layers.")?.split('.').next()?.parse::<usize>().ok())
        .max();
    match deepest {
        Some(last) if last >= config.num_hidden_layers => Err(ModelError::Config {
            path: Some(dir.join(CONFIG_FILE)),
            message: format!(
                "num_hidden_layers is {}, but the weights hold {} layers (model.layers.{last} is present)",
                config.num_hidden_layers,
                last + 1
            ),
        }),
        _ => Ok(()),
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
            Matrix::Int8(m) => m.rows,
        }
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        match self {
            Matrix::F16 { cols, .. } => *cols,
            Matrix::Int4(m) => m.cols,
            Matrix::Int8(m) => m.cols,
        }
    }

    /// The storage format of this matrix.
    pub fn format(&self) -> MatrixFormat {
        match self {
            Matrix::F16 { .. } => MatrixFormat::F16,
            Matrix::Int4(_) => MatrixFormat::Int4,
            Matrix::Int8(_) => MatrixFormat::Int8,
        }
    }

    /// Bytes held by the matrix's data.
    pub fn byte_size(&self) -> usize {
        match self {
            Matrix::F16 { data, .. } => data.len() * 2,
            Matrix::Int4(m) => m.byte_size(),
            Matrix::Int8(m) => m.byte_size(),
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
            Matrix::Int8(m) => m.dequantize_row(row, out),
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
            Matrix::Int8(m) => m.dequantize(),
        }
    }

    /// The matrix in int4 (quantized when it is not int4 yet; cloned when it is).
    pub fn to_int4(&self) -> Result<Int4Matrix, ModelError> {
        match self {
            Matrix::Int4(m) => Ok(m.clone()),
            _ => int4::quantize(&self.to_f32(), self.rows(), self.cols()),
        }
    }

    /// The matrix in int8 (quantized when it is not int8 yet; cloned when it is).
    pub fn to_int8(&self) -> Result<Int8Matrix, ModelError> {
        match self {
            Matrix::Int8(m) => Ok(m.clone()),
            _ => int8::quantize(&self.to_f32(), self.rows(), self.cols()),
        }
    }

    /// The matrix in `format`: itself when it already is, else converted (quantized, or for f16
    /// dequantized and rounded).
    pub fn to_format(&self, format: MatrixFormat) -> Result<Matrix, ModelError> {
        Ok(match (self, format) {
            (m, f) if m.format() == f => m.clone(),
            (m, MatrixFormat::Int4) => Matrix::Int4(m.to_int4()?),
            (m, MatrixFormat::Int8) => Matrix::Int8(m.to_int8()?),
            (m, MatrixFormat::F16) => {
                let values = m.to_f32();
                let mut data = vec![f16::ZERO; values.len()];
                data.convert_from_f32_slice(&values);
                Matrix::F16 { rows: m.rows(), cols: m.cols(), data }
            }
        })
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

    /// The int4 layout of these weights: which matrices are int4 and which int8. Fails when a
    /// matrix is f16, or the layers' matrices are not all of one format.
    pub fn int4_layout(&self) -> Result<Int4Layout, ModelError> {
        let quantized = |name: &str, m: &Matrix| match m.format() {
            MatrixFormat::F16 => Err(ModelError::InvalidTensor {
                name: name.to_string(),
                message: "an f16 matrix in int4 weights".into(),
            }),
            f => Ok(f),
        };
        let embed = quantized(names::EMBED_TOKENS, &self.embed)?;
        let head = match &self.lm_head {
            Some(head) => quantized(names::LM_HEAD, head)?,
            None => embed,
        };
        let mut layers = None;
        for (name, tensor) in self.tensors() {
            if let TensorRef::Matrix(m) = tensor {
                if name == names::EMBED_TOKENS || name == names::LM_HEAD {
                    continue;
                }
                let f = quantized(&name, m)?;
                if *layers.get_or_insert(f) != f {
                    return Err(ModelError::Unsupported {
                        what: format!("{name} is {f} while other decoder-layer matrices are not: one format for every layer matrix is supported"),
                    });
                }
            }
        }
        Ok(Int4Layout { embed, head, layers: layers.unwrap_or(MatrixFormat::Int4) })
    }

    /// These weights with every matrix in the format `layout` gives it (norms as they are).
    pub fn quantized(&self, layout: Int4Layout) -> Result<LlamaWeights, ModelError> {
        let convert = |name: &str, m: &Matrix| {
            m.to_format(layout.of(name)).map_err(|e| match e {
                ModelError::Quantization { message } => {
                    ModelError::Quantization { message: format!("{name}: {message}") }
                }
                other => other,
            })
        };
        let layers = self
            .layers
            .par_iter()
            .enumerate()
            .map(|(i, l)| {
                let c = |suffix: &str, m: &Matrix| convert(&names::layer(i, suffix), m);
                Ok(LayerWeights {
                    attn_norm: l.attn_norm.clone(),
                    wq: c(names::Q_PROJ, &l.wq)?,
                    wk: c(names::K_PROJ, &l.wk)?,
                    wv: c(names::V_PROJ, &l.wv)?,
                    wo: c(names::O_PROJ, &l.wo)?,
                    mlp_norm: l.mlp_norm.clone(),
                    w_gate: c(names::GATE_PROJ, &l.w_gate)?,
                    w_up: c(names::UP_PROJ, &l.w_up)?,
                    w_down: c(names::DOWN_PROJ, &l.w_down)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(LlamaWeights {
            config: self.config.clone(),
            embed: convert(names::EMBED_TOKENS, &self.embed)?,
            layers,
            final_norm: self.final_norm.clone(),
            lm_head: self.lm_head.as_ref().map(|h| convert(names::LM_HEAD, h)).transpose()?,
        })
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
                TensorRef::Matrix(Matrix::Int8(q)) => bad_f16(&q.scales),
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
                        Matrix::Int8(q) => {
                            q.cols % int8::GROUP_SIZE == 0
                                && q.codes.len() == q.rows * q.cols
                                && q.scales.len() == q.rows * q.cols / int8::GROUP_SIZE
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
    // An interrupted int4 cache write left its temporary here; the load may write nothing.
    atomic_write::sweep_dead_temporaries(dir);
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
            check_layer_count(&store, &config, dir)?;
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
                check_layer_count(&store, &config, dir)?;
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
                                let m = read_quantized_matrix(&store, &spec.name)?;
                                if [m.rows(), m.cols()] != [spec.shape[0], spec.shape[1]] {
                                    return Err(ModelError::Shape {
                                        name: spec.name.clone(),
                                        expected: spec.shape.clone(),
                                        found: vec![m.rows(), m.cols()],
                                    });
                                }
                                Loaded::Matrix(m)
                            }
                        };
                        progress.tick();
                        Ok(tensor)
                    })
                    .collect::<Result<Vec<_>, ModelError>>()?;
                Ok(assemble(&config, loaded))
            } else {
                let store = TensorStore::open(dir)?;
                check_layer_count(&store, &config, dir)?;
                progress.start();
                let layout = Int4Layout::DEFAULT;
                let loaded = load_float(&store, &specs, &progress, |spec, _| {
                    let values = store.read_f32(&spec.name)?;
                    let (rows, cols) = (spec.shape[0], spec.shape[1]);
                    let m = match layout.of(&spec.name) {
                        MatrixFormat::Int8 => int8::quantize(&values, rows, cols).map(Matrix::Int8),
                        _ => int4::quantize(&values, rows, cols).map(Matrix::Int4),
                    };
                    m.map_err(|e| match e {
                        ModelError::Quantization { message } => {
                            ModelError::Quantization { message: format!("{}: {message}", spec.name) }
                        }
                        other => other,
                    })
                })?;
                let weights = assemble(&config, loaded);
                // The cache is an optimization: failing to write it must not fail the load.
                let _ = write_int4_weights(&int4_path, &weights);
                Ok(weights)
            }
        }
    }
}

/// Reads the int4 or int8 matrix stored under `name` in a seam-int4 file: the dtype of its
/// `.qweight` tells which (U8 packed nibbles, or I8 codes).
pub fn read_quantized_matrix(store: &TensorStore, name: &str) -> Result<Matrix, ModelError> {
    match store.dtype(&format!("{name}{}", int4::QWEIGHT_SUFFIX))? {
        Dtype::I8 => Ok(Matrix::Int8(Int8Matrix::from_store(store, name)?)),
        _ => Ok(Matrix::Int4(Int4Matrix::from_store(store, name)?)),
    }
}

/// The [`Int4Layout`] of the seam-int4 file `path`, from its header alone.
pub fn int4_file_layout(path: &Path, config: &LlamaConfig) -> Result<Int4Layout, ModelError> {
    let store = TensorStore::open_file(path)?;
    int4::check_int4_metadata(&store)?;
    let format = |name: &str| -> Result<MatrixFormat, ModelError> {
        Ok(match store.dtype(&format!("{name}{}", int4::QWEIGHT_SUFFIX))? {
            Dtype::I8 => MatrixFormat::Int8,
            _ => MatrixFormat::Int4,
        })
    };
    let embed = format(names::EMBED_TOKENS)?;
    let head = if config.tie_word_embeddings { embed } else { format(names::LM_HEAD)? };
    let layers =
        if config.num_hidden_layers == 0 { MatrixFormat::Int4 } else { format(&names::layer(0, names::Q_PROJ))? };
    Ok(Int4Layout { embed, head, layers })
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

/// Writes `weights` as seam's int4 file (atomically): every int4 matrix under
/// `{name}.qweight/.scales/.biases`, every int8 one under `{name}.qweight/.scales`, f16 matrices
/// quantized first as [`Int4Layout::DEFAULT`] says, norms as F32 under their own names, with the
/// seam-int4 metadata.
pub fn write_int4_weights(path: &Path, weights: &LlamaWeights) -> Result<(), ModelError> {
    weights.validate()?;
    let tensors = weights.tensors();
    // Quantize what is f16, in parallel; borrow what already is quantized.
    let converted: Vec<Option<Matrix>> = tensors
        .par_iter()
        .map(|(name, t)| match t {
            TensorRef::Matrix(m @ Matrix::F16 { .. }) => m.to_format(Int4Layout::DEFAULT.of(name)).map(Some),
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
                let q: &Int4Matrix = match own.as_ref().unwrap_or(m) {
                    Matrix::Int4(q) => q,
                    Matrix::Int8(q) => {
                        entries.push(Entry {
                            name: format!("{name}{}", int4::QWEIGHT_SUFFIX),
                            dtype: Dtype::I8,
                            shape: vec![q.rows, q.cols],
                            bytes: bytemuck::cast_slice(&q.codes),
                        });
                        entries.push(Entry {
                            name: format!("{name}{}", int4::SCALES_SUFFIX),
                            dtype: Dtype::F16,
                            shape: vec![q.rows, q.cols / int8::GROUP_SIZE],
                            bytes: bytemuck::cast_slice(&q.scales),
                        });
                        continue;
                    }
                    Matrix::F16 { .. } => unreachable!("every f16 matrix was quantized above"),
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
            TensorRef::Matrix(m @ (Matrix::Int4(_) | Matrix::Int8(_))) => {
                let values = m.to_f32();
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

    #[test]
    fn a_config_with_fewer_or_more_layers_than_the_weights_is_an_error() {
        let config = crate::random::tiny_config();
        assert!(config.num_hidden_layers >= 2);
        let dir = tempfile::tempdir().unwrap();
        crate::random::write_random_checkpoint(dir.path(), &config, 5).unwrap();
        for format in [WeightFormat::F16, WeightFormat::Int4] {
            load_weights(dir.path(), format, None).unwrap();
        }
        let with_layers = |n: usize| {
            let mut c = config.clone();
            c.num_hidden_layers = n;
            std::fs::write(dir.path().join(CONFIG_FILE), c.to_json()).unwrap();
        };
        // Fewer: the f16 file, the int4 file written by the first int4 load, and quantizing at
        // load (int4 file removed) all refuse.
        with_layers(config.num_hidden_layers - 1);
        for format in [WeightFormat::F16, WeightFormat::Int4] {
            let err = load_weights(dir.path(), format, None).unwrap_err().to_string();
            assert!(err.contains("num_hidden_layers") && err.contains("weights hold"), "{format:?}: {err}");
        }
        std::fs::remove_file(dir.path().join(INT4_WEIGHTS_FILE)).unwrap();
        let err = load_weights(dir.path(), WeightFormat::Int4, None).unwrap_err().to_string();
        assert!(err.contains("weights hold"), "{err}");
        // More: a missing tensor.
        with_layers(config.num_hidden_layers + 1);
        let err = load_weights(dir.path(), WeightFormat::F16, None).unwrap_err();
        assert!(matches!(err, ModelError::MissingTensor { .. }), "{err}");
    }
}
