//! GGUF tensors → Hugging Face tensors: the conversion of each tensor to f16 (the float file) and
//! to seam int4 (Q4_1 carried exactly), in Hugging Face's row order (names and the q/k row order
//! are [`crate::gguf_layout`]'s).

use super::gguf_error;
use crate::config::LlamaConfig;
use crate::error::ModelError;
use crate::gguf_layout::{self, rope_order};
use crate::int4::{self, Int4Matrix, GROUP_SIZE};
use crate::weights::{TensorRole, TensorSpec};
use gguf::{GgmlType, GgufFile, TensorInfo};
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use std::path::Path;

/// How the int4 form of a matrix was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Int4Source {
    /// Q4_1 blocks carried over bit for bit.
    Exact,
    /// Dequantized from another type and quantized with [`int4::quantize`].
    Requantized,
}

/// One converted tensor.
pub(crate) enum Converted {
    Norm(Vec<f32>),
    Matrix { f16: Vec<f16>, int4: Int4Matrix, source: Int4Source },
}

/// Converts the GGUF tensor behind `spec` (checking its shape against the config).
pub(crate) fn convert(
    f: &GgufFile,
    path: &Path,
    spec: &TensorSpec,
    config: &LlamaConfig,
) -> Result<Converted, ModelError> {
    let gname = gguf_layout::gguf_name(&spec.name).expect("every expected tensor has a GGUF name");
    let info = f.tensor(&gname).map_err(|_| ModelError::MissingTensor { name: gname.clone() })?;
    let found = info.shape();
    if found != spec.shape {
        return Err(ModelError::Shape { name: gname, expected: spec.shape.clone(), found });
    }
    let data = f.tensor_bytes(info);
    match spec.role {
        TensorRole::Norm => {
            let mut out = vec![0.0f32; spec.shape[0]];
            gguf::dequantize(info.ggml_type, data, &mut out).map_err(|e| tensor_error(path, info, e))?;
            Ok(Converted::Norm(out))
        }
        TensorRole::Matrix => {
            convert_matrix(path, info, data, spec, gguf_layout::rope_permuted_heads(&spec.name, config))
        }
    }
}

fn tensor_error(path: &Path, info: &TensorInfo, e: gguf::GgufError) -> ModelError {
    match e {
        gguf::GgufError::UnsupportedType { ty, .. } => ModelError::Unsupported {
            what: format!("GGUF tensor '{}' of type {ty} (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)", info.name),
        },
        other => gguf_error(path, other),
    }
}

fn convert_matrix(
    path: &Path,
    info: &TensorInfo,
    data: &[u8],
    spec: &TensorSpec,
    n_head: Option<usize>,
) -> Result<Converted, ModelError> {
    let (rows, cols) = (spec.shape[0], spec.shape[1]);
    if cols % GROUP_SIZE != 0 {
        return Err(ModelError::Unsupported {
            what: format!(
                "tensor '{}' has {cols} columns, not a multiple of the int4 group size {GROUP_SIZE}",
                info.name
            ),
        });
    }
    if let Some(n) = n_head {
        if !rope_order::fits(rows, n) {
            return Err(ModelError::Shape {
                name: info.name.clone(),
                expected: vec![rows.next_multiple_of(2 * n.max(1)), cols],
                found: vec![rows, cols],
            });
        }
    }
    // Rows are read from where llama.cpp's rope order put them (see `rope_order`).
    let src_row = |r: usize| n_head.map_or(r, |n| rope_order::gguf_row(r, rows, n));
    let row_bytes = info.ggml_type.row_bytes(cols as u64).expect("checked when the file was opened") as usize;
    let source_bytes = |r: usize| &data[src_row(r) * row_bytes..(src_row(r) + 1) * row_bytes];

    // f32 values in Hugging Face row order, dequantized row by row (in parallel).
    let mut values = vec![0.0f32; rows * cols];
    values
        .par_chunks_mut(cols)
        .enumerate()
        .try_for_each(|(r, out)| gguf::dequantize(info.ggml_type, source_bytes(r), out))
        .map_err(|e| tensor_error(path, info, e))?;
    // Bulk conversion per row: `half` uses the CPU's conversion instructions for slices when it can.
    let mut f16_values = vec![f16::ZERO; rows * cols];
    f16_values.par_chunks_mut(cols).zip(values.par_chunks(cols)).for_each(|(out, v)| out.convert_from_f32_slice(v));

    let (int4, source) = if info.ggml_type == GgmlType::Q4_1 {
        (q4_1_to_int4(rows, cols, source_bytes)?, Int4Source::Exact)
    } else {
        (int4::quantize(&values, rows, cols)?, Int4Source::Requantized)
    };
    Ok(Converted::Matrix { f16: f16_values, int4, source })
}

/// Carries Q4_1 blocks over to seam int4 without changing a value: `d` → scale, `m` → bias, and
/// the codes repacked from ggml's split halves (byte `j`: elements `j`, `j + 16`) to seam's pairs
/// (byte `i`: elements `2i`, `2i + 1`).
fn q4_1_to_int4<'a>(
    rows: usize,
    cols: usize,
    source_bytes: impl Fn(usize) -> &'a [u8] + Sync,
) -> Result<Int4Matrix, ModelError> {
    let groups = cols / GROUP_SIZE;
    let mut packed = vec![0u8; rows * cols / 2];
    let mut scales = vec![f16::ZERO; rows * groups];
    let mut biases = vec![f16::ZERO; rows * groups];
    packed
        .par_chunks_mut(cols / 2)
        .zip(scales.par_chunks_mut(groups))
        .zip(biases.par_chunks_mut(groups))
        .enumerate()
        .for_each(|(r, ((packed, scales), biases))| {
            let blocks = gguf::q4_1_blocks(source_bytes(r)).expect("a Q4_1 row is whole blocks");
            for (g, block) in blocks.enumerate() {
                scales[g] = block.d;
                biases[g] = block.m;
                for (i, byte) in packed[g * GROUP_SIZE / 2..(g + 1) * GROUP_SIZE / 2].iter_mut().enumerate() {
                    *byte = block.q[2 * i] | (block.q[2 * i + 1] << 4);
                }
            }
        });
    Int4Matrix::from_parts(rows, cols, packed, scales, biases)
}
