//! GGUF tensors → Hugging Face tensors: the conversion of each tensor to f16 (the float file) and
//! to seam's quantized formats (Q4_1 and Q4_0 carried exactly into int4, Q8_0 into int8), in
//! Hugging Face's row order (names and the q/k row order are [`crate::gguf_layout`]'s).

use super::gguf_error;
use crate::config::LlamaConfig;
use crate::error::ModelError;
use crate::gguf_layout::{self, rope_order};
use crate::int4::{self, Int4Matrix, GROUP_SIZE};
use crate::int8::{self, Int8Matrix};
use crate::weights::{Matrix, MatrixFormat, TensorRole, TensorSpec};
use gguf::{GgmlType, GgufFile, TensorInfo};
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use std::path::Path;

/// How the quantized form of a matrix was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QuantSource {
    /// The GGUF's blocks carried over value for value (Q4_1, Q4_0 → int4; Q8_0 → int8).
    Exact,
    /// Dequantized from another type and quantized with seam's quantizer.
    Requantized,
}

/// One converted tensor.
pub(crate) enum Converted {
    Norm(Vec<f32>),
    /// `quantized` is [`Matrix::Int4`] or [`Matrix::Int8`].
    Matrix {
        f16: Vec<f16>,
        quantized: Matrix,
        source: QuantSource,
    },
}

/// The format a GGUF tensor of type `ty` is carried into without changing a value, if any.
pub(crate) fn exact_format(ty: GgmlType) -> Option<MatrixFormat> {
    match ty {
        GgmlType::Q4_1 | GgmlType::Q4_0 => Some(MatrixFormat::Int4),
        GgmlType::Q8_0 => Some(MatrixFormat::Int8),
        _ => None,
    }
}

/// Converts the GGUF tensor behind `spec` (checking its shape against the config).
/// `format` is the quantized format the matrix must end in (the importer decides it from the
/// GGUF's types and the options).
pub(crate) fn convert(
    f: &GgufFile,
    path: &Path,
    spec: &TensorSpec,
    config: &LlamaConfig,
    format: MatrixFormat,
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
            convert_matrix(path, info, data, spec, gguf_layout::rope_permuted_heads(&spec.name, config), format)
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
    format: MatrixFormat,
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

    let (quantized, source) = match (info.ggml_type, format) {
        (GgmlType::Q4_1 | GgmlType::Q4_0, MatrixFormat::Int4) => {
            match q4_to_int4(info.ggml_type, rows, cols, source_bytes)? {
                Some(m) => (Matrix::Int4(m), QuantSource::Exact),
                // A Q4_0 scale too large for the bias -8d in f16: quantized from the values.
                None => (Matrix::Int4(int4::quantize(&values, rows, cols)?), QuantSource::Requantized),
            }
        }
        (GgmlType::Q8_0, MatrixFormat::Int8) => {
            (Matrix::Int8(q8_0_to_int8(rows, cols, source_bytes)?), QuantSource::Exact)
        }
        (_, MatrixFormat::Int8) => (Matrix::Int8(int8::quantize(&values, rows, cols)?), QuantSource::Requantized),
        _ => (Matrix::Int4(int4::quantize(&values, rows, cols)?), QuantSource::Requantized),
    };
    Ok(Converted::Matrix { f16: f16_values, quantized, source })
}

/// Carries Q8_0 blocks over to seam int8: `d` → scale, the 32 codes as they are.
fn q8_0_to_int8<'a>(
    rows: usize,
    cols: usize,
    source_bytes: impl Fn(usize) -> &'a [u8] + Sync,
) -> Result<Int8Matrix, ModelError> {
    let groups = cols / GROUP_SIZE;
    let mut codes = vec![0i8; rows * cols];
    let mut scales = vec![f16::ZERO; rows * groups];
    codes.par_chunks_mut(cols).zip(scales.par_chunks_mut(groups)).enumerate().for_each(|(r, (codes, scales))| {
        // Q8_0 block: f16 d, then 32 i8 codes (34 bytes).
        for (g, block) in source_bytes(r).chunks_exact(2 + GROUP_SIZE).enumerate() {
            scales[g] = f16::from_le_bytes([block[0], block[1]]);
            for (c, &b) in codes[g * GROUP_SIZE..(g + 1) * GROUP_SIZE].iter_mut().zip(&block[2..]) {
                *c = b as i8;
            }
        }
    });
    Int8Matrix::from_parts(rows, cols, codes, scales)
}

/// Q4_0 or Q4_1 blocks as seam int4, every value kept: Q4_1 via [`q4_1_to_int4`]; Q4_0's
/// `d * (q - 8)` is int4 with scale `d` and bias `-8 d` (exact in f16 unless `8 d` overflows, then
/// `None`).
fn q4_to_int4<'a>(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    source_bytes: impl Fn(usize) -> &'a [u8] + Sync,
) -> Result<Option<Int4Matrix>, ModelError> {
    if ty == GgmlType::Q4_1 {
        return q4_1_to_int4(rows, cols, source_bytes).map(Some);
    }
    let groups = cols / GROUP_SIZE;
    let mut packed = vec![0u8; rows * cols / 2];
    let mut scales = vec![f16::ZERO; rows * groups];
    let mut biases = vec![f16::ZERO; rows * groups];
    let exact = packed
        .par_chunks_mut(cols / 2)
        .zip(scales.par_chunks_mut(groups))
        .zip(biases.par_chunks_mut(groups))
        .enumerate()
        .all(|(r, ((packed, scales), biases))| {
            // Q4_0 block: f16 d, then 16 bytes, byte j holding element j (low) and j + 16 (high).
            for (g, block) in source_bytes(r).chunks_exact(2 + GROUP_SIZE / 2).enumerate() {
                let d = f16::from_le_bytes([block[0], block[1]]);
                let bias = f16::from_f32(-8.0 * d.to_f32());
                if bias.to_f32() != -8.0 * d.to_f32() {
                    return false;
                }
                scales[g] = d;
                biases[g] = bias;
                let q = |k: usize| (block[2 + k % 16] >> (4 * (k / 16))) & 0x0f;
                for (i, byte) in packed[g * GROUP_SIZE / 2..(g + 1) * GROUP_SIZE / 2].iter_mut().enumerate() {
                    *byte = q(2 * i) | (q(2 * i + 1) << 4);
                }
            }
            true
        });
    if !exact {
        return Ok(None);
    }
    Int4Matrix::from_parts(rows, cols, packed, scales, biases).map(Some)
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
