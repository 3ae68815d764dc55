//! GGUF → seam model directory (`seam convert`).
//!
//! [`import_gguf`] reads a llama.cpp GGUF Llama and writes a model directory (see
//! [`crate::model_dir`]): `config.json`, `generation_config.json`, `tokenizer.json`,
//! `tokenizer_config.json`, `model.safetensors` (f16 matrices, f32 norms) and
//! `model.int4.safetensors` (seam int4 matrices, f32 norms).
//!
//! - The int4 file carries every GGUF tensor seam has a format for without changing a value: Q4_1
//!   and Q4_0 into int4 (`d` → scale, `m` or `-8 d` → bias, nibbles repacked), Q8_0 into int8.
//!   Other types (F16, F32, BF16) are quantized: the token embedding and the output head to int8
//!   (or int4 with [`ImportOptions::embed_head`]), the decoder layers to int4 (ADR 0013).
//! - llama.cpp's converter permutes the rows of `attn_q` / `attn_k` for its rope layout; the
//!   importer moves them back to the Hugging Face (rotate-half) order.
//!
//! Tensor names, the rope row order and the tokenizer conventions are [`crate::gguf_layout`]'s,
//! shared with the exporter ([`crate::export`]).
//! - Only byte-level BPE tokenizers (`tokenizer.ggml.model = "gpt2"`) are converted; SentencePiece
//!   GGUFs are a typed [`ModelError::Unsupported`].

mod hparams;
mod tensors;
mod tokenizer;

use crate::config::LlamaConfig;
use crate::error::ModelError;
use crate::gguf_layout;
use crate::int4::int4_metadata;
use crate::model_dir::{
    CONFIG_FILE, GENERATION_CONFIG_FILE, INT4_WEIGHTS_FILE, SAFETENSORS_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE,
};
use crate::tensor_store::{write_safetensors, OwnedTensor};
use crate::weights::{expected_tensors, TensorRole};
use crate::weights::{names, MatrixFormat};
use gguf::{GgufError, GgufFile};
use rayon::prelude::*;
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tensors::{Converted, QuantSource};

/// Options of [`import_gguf`].
#[derive(Clone, Copy)]
pub struct ImportOptions<'a> {
    /// Called after each tensor is converted with `(tensors done, tensors in total)`; may be called
    /// from several threads.
    pub progress: Option<&'a (dyn Fn(u64, u64) + Sync)>,
    /// The format of the token embedding and the output head in the int4 file: int8 (the
    /// default) or int4. A GGUF tensor already in the other format is converted (a Q8_0 embedding
    /// forced to int4 is requantized; a Q4_1 one asked for int8 stays int4, exactly).
    pub embed_head: MatrixFormat,
    /// Replace an output directory that already holds something (otherwise that is
    /// [`ModelError::OutputExists`], reported before any work; an empty directory is always
    /// replaced).
    pub replace: bool,
}

impl Default for ImportOptions<'_> {
    fn default() -> Self {
        ImportOptions { progress: None, embed_head: MatrixFormat::Int8, replace: false }
    }
}

impl std::fmt::Debug for ImportOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportOptions")
            .field("progress", &self.progress.is_some())
            .field("embed_head", &self.embed_head)
            .field("replace", &self.replace)
            .finish()
    }
}

/// What [`import_gguf`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportReport {
    /// The model's configuration, as written to `config.json`.
    pub config: LlamaConfig,
    /// The directory written.
    pub out_dir: PathBuf,
    /// Matrices whose int4 form is the GGUF's Q4_1 or Q4_0 data, carried over without a change.
    pub int4_exact: usize,
    /// Matrices of other GGUF types, dequantized and quantized to int4.
    pub int4_requantized: usize,
    /// Matrices whose int8 form is the GGUF's Q8_0 data, carried over without a change.
    pub int8_exact: usize,
    /// Matrices of other GGUF types, dequantized and quantized to int8.
    pub int8_requantized: usize,
    /// Matrices dequantized to f16 for `model.safetensors` (every matrix).
    pub f16_dequantized: usize,
    /// Norm vectors, written as f32 to both weight files.
    pub norms: usize,
    /// GGUF tensors per ggml type (`"Q4_1" → 210`, ...).
    pub gguf_types: BTreeMap<String, usize>,
    /// Time spent converting tensors (dequantizing, repacking, quantizing).
    pub convert_time: Duration,
    /// Time spent writing files.
    pub write_time: Duration,
}

/// Converts the GGUF Llama at `gguf` into a model directory `out_dir`. The directory is built
/// under a temporary name beside `out_dir` and renamed into place when complete, so `out_dir`
/// never holds half a model: an import that fails or is interrupted leaves it as it was (the
/// temporary of an interrupted one is removed by the next write into the same folder). An
/// `out_dir` that holds something is replaced only with [`ImportOptions::replace`].
pub fn import_gguf(gguf: &Path, out_dir: &Path, options: &ImportOptions<'_>) -> Result<ImportReport, ModelError> {
    let occupied = || ModelError::OutputExists { path: out_dir.to_path_buf() };
    if std::fs::symlink_metadata(out_dir).is_ok_and(|m| !m.is_dir()) {
        return Err(ModelError::NotADirectory { path: out_dir.to_path_buf() });
    }
    if !options.replace && atomic_write::TempDir::occupied(out_dir) {
        return Err(occupied());
    }
    let file = GgufFile::open(gguf).map_err(|e| gguf_error(gguf, e))?;
    let (config, generation) = hparams::read_config(&file, gguf)?;
    let specs = expected_tensors(&config);

    // Every GGUF tensor must be used: an unknown one (biases, a vision tower, ...) would otherwise be
    // dropped silently and the model would compute something else.
    let mut known: HashSet<String> = specs.iter().filter_map(|s| gguf_layout::gguf_name(&s.name)).collect();
    known.insert(gguf_layout::ROPE_FREQS_TENSOR.to_string());
    if let Some(extra) = file.tensors().iter().find(|t| !known.contains(&t.name)) {
        return Err(ModelError::Unsupported {
            what: format!("GGUF tensor '{}' has no counterpart in a Llama model seam runs", extra.name),
        });
    }
    let tokenizer = tokenizer::build(&file, gguf, config.max_position_embeddings)?;
    if let Ok(tokens) = file.get_strings("tokenizer.ggml.tokens") {
        if tokens.len() > config.vocab_size {
            return Err(ModelError::Corrupt {
                path: gguf.to_path_buf(),
                message: format!("{} tokens but only {} embedding rows", tokens.len(), config.vocab_size),
            });
        }
    }

    let mut gguf_types = BTreeMap::new();
    for t in file.tensors() {
        *gguf_types.entry(t.ggml_type.to_string()).or_insert(0) += 1;
    }

    let formats = quantized_formats(&file, &specs, options.embed_head);
    let started = Instant::now();
    let total = specs.len() as u64;
    let done = AtomicU64::new(0);
    let converted: Vec<Converted> = specs
        .par_iter()
        .zip(&formats)
        .map(|(spec, &format)| {
            let c = tensors::convert(&file, gguf, spec, &config, format)?;
            let n = done.fetch_add(1, Ordering::Relaxed) + 1;
            if let Some(progress) = options.progress {
                progress(n, total);
            }
            Ok(c)
        })
        .collect::<Result<_, ModelError>>()?;
    let convert_time = started.elapsed();

    let started = Instant::now();
    let mut float_tensors = Vec::with_capacity(specs.len());
    let mut int4_tensors = Vec::with_capacity(specs.len() * 3);
    let (mut int4_exact, mut int4_requantized, mut int8_exact, mut int8_requantized, mut norms) = (0, 0, 0, 0, 0);
    for (spec, c) in specs.iter().zip(converted) {
        match c {
            Converted::Norm(v) => {
                debug_assert_eq!(spec.role, TensorRole::Norm);
                norms += 1;
                let t = OwnedTensor::F32 { shape: spec.shape.clone(), data: v };
                int4_tensors.push((spec.name.clone(), t.clone()));
                float_tensors.push((spec.name.clone(), t));
            }
            Converted::Matrix { f16, quantized, source } => {
                let exact = source == QuantSource::Exact;
                float_tensors.push((spec.name.clone(), OwnedTensor::F16 { shape: spec.shape.clone(), data: f16 }));
                match quantized {
                    crate::Matrix::Int8(m) => {
                        *if exact { &mut int8_exact } else { &mut int8_requantized } += 1;
                        int4_tensors.extend(m.to_tensors(&spec.name));
                    }
                    crate::Matrix::Int4(m) => {
                        *if exact { &mut int4_exact } else { &mut int4_requantized } += 1;
                        int4_tensors.extend(m.to_tensors(&spec.name));
                    }
                    crate::Matrix::F16 { .. } => unreachable!("the int4 file holds quantized matrices"),
                }
            }
        }
    }
    let f16_dequantized = float_tensors.len() - norms;

    let staging = atomic_write::TempDir::create(out_dir).map_err(|e| ModelError::io(out_dir, e))?;
    let temp = staging.path();
    let source = BTreeMap::from([("source".to_string(), "gguf".to_string())]);
    let mut float_meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    float_meta.extend(source.clone());
    write_safetensors(&temp.join(SAFETENSORS_FILE), &float_tensors, &float_meta)?;
    drop(float_tensors);
    write_safetensors(&temp.join(INT4_WEIGHTS_FILE), &int4_tensors, &int4_metadata())?;
    drop(int4_tensors);
    write_text(&temp.join(TOKENIZER_FILE), &tokenizer.tokenizer_json)?;
    write_text(&temp.join(TOKENIZER_CONFIG_FILE), &tokenizer.tokenizer_config_json)?;
    write_text(&temp.join(GENERATION_CONFIG_FILE), &generation.to_json())?;
    write_text(&temp.join(CONFIG_FILE), &config.to_json())?;
    let existing = if options.replace { atomic_write::Existing::Replace } else { atomic_write::Existing::Keep };
    staging.commit(existing).map_err(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => occupied(),
        _ => ModelError::io(out_dir, e),
    })?;
    let write_time = started.elapsed();

    Ok(ImportReport {
        config,
        out_dir: out_dir.to_path_buf(),
        int4_exact,
        int4_requantized,
        int8_exact,
        int8_requantized,
        f16_dequantized,
        norms,
        gguf_types,
        convert_time,
        write_time,
    })
}

/// The quantized format of each matrix of `specs` in the int4 file (norms get int4, unused).
///
/// A tensor keeps the format its GGUF type maps to exactly; the embedding and the head otherwise
/// get `embed_head`, the layers int4. Every decoder-layer matrix must share one format (the graphs
/// stack the layers), so when the GGUF's layer types map to different formats (a Q8_0 tensor among
/// Q4_1 ones), they all become int4.
fn quantized_formats(
    file: &GgufFile,
    specs: &[crate::weights::TensorSpec],
    embed_head: MatrixFormat,
) -> Vec<MatrixFormat> {
    let ty = |name: &str| gguf_layout::gguf_name(name).and_then(|g| file.tensor(&g).ok()).map(|info| info.ggml_type);
    let is_edge = |name: &str| name == names::EMBED_TOKENS || name == names::LM_HEAD;
    let layer_formats: HashSet<Option<MatrixFormat>> = specs
        .iter()
        .filter(|s| s.role == TensorRole::Matrix && !is_edge(&s.name))
        .map(|s| ty(&s.name).and_then(tensors::exact_format))
        .collect();
    let layers = match layer_formats.into_iter().collect::<Vec<_>>().as_slice() {
        [Some(one)] => *one,
        _ => MatrixFormat::Int4,
    };
    specs
        .iter()
        .map(|s| {
            if !is_edge(&s.name) {
                return layers;
            }
            match (ty(&s.name).and_then(tensors::exact_format), embed_head) {
                // Already 4-bit: widening would store the same values in twice the bytes.
                (Some(MatrixFormat::Int4), _) => MatrixFormat::Int4,
                _ => embed_head,
            }
        })
        .collect()
}

/// A [`GgufError`] as the [`ModelError`] that says the same about the file at `path`.
pub(crate) fn gguf_error(path: &Path, e: GgufError) -> ModelError {
    let path = path.to_path_buf();
    match e {
        GgufError::Io { path, source } => ModelError::from_io(&path, source),
        GgufError::Truncated { .. } => ModelError::Truncated { path, message: e.to_string() },
        GgufError::MissingKey { .. } | GgufError::WrongType { .. } => {
            ModelError::Config { path: Some(path), message: e.to_string() }
        }
        GgufError::UnsupportedType { .. }
        | GgufError::UnsupportedVersion { .. }
        | GgufError::UnknownTensorType { .. } => ModelError::Unsupported { what: format!("{}: {e}", path.display()) },
        GgufError::TensorNotFound { name } => ModelError::MissingTensor { name },
        other => ModelError::Corrupt { path, message: other.to_string() },
    }
}

/// Writes `text` to `path` through a temporary file in the same directory renamed into place.
fn write_text(path: &Path, text: &str) -> Result<(), ModelError> {
    atomic_write::write(path, text.as_bytes()).map_err(|e| ModelError::io(path, e))
}
