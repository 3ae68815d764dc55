//! GGUF tensors → Hugging Face tensors: names, llama.cpp's q/k row permutation, and the
//! conversion of each tensor to f16 (the float file) and to seam int4 (Q4_1 carried exactly).

use super::gguf_error;
use crate::config::LlamaConfig;
use crate::error::ModelError;
use crate::int4::{self, Int4Matrix, GROUP_SIZE};
use crate::weights::{names, TensorRole, TensorSpec};
use gguf::{GgmlType, GgufFile, TensorInfo};
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;
use std::path::Path;

/// The GGUF name of the Hugging Face tensor `hf` (inverse of llama.cpp's converter naming).
pub(crate) fn gguf_name(hf: &str) -> Option<String> {
    match hf {
        names::EMBED_TOKENS => return Some("token_embd.weight".into()),
        names::FINAL_NORM => return Some("output_norm.weight".into()),
        names::LM_HEAD => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let short = match suffix {
        names::INPUT_LAYERNORM => "attn_norm",
        names::Q_PROJ => "attn_q",
        names::K_PROJ => "attn_k",
        names::V_PROJ => "attn_v",
        names::O_PROJ => "attn_output",
        names::POST_ATTENTION_LAYERNORM => "ffn_norm",
        names::GATE_PROJ => "ffn_gate",
        names::UP_PROJ => "ffn_up",
        names::DOWN_PROJ => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{short}.weight"))
}

/// For q_proj / k_proj, the number of heads llama.cpp permuted the rows with.
pub(crate) fn permute_heads(hf: &str, config: &LlamaConfig) -> Option<usize> {
    if hf.ends_with(names::Q_PROJ) {
        Some(config.num_attention_heads)
    } else if hf.ends_with(names::K_PROJ) {
        Some(config.num_key_value_heads)
    } else {
        None
    }
}

/// The GGUF row holding Hugging Face row `hf_row` of a q/k matrix of `rows` rows permuted with
/// `n_head` heads.
///
/// llama.cpp's converter computes `w.reshape(n_head, 2, rows / n_head / 2, cols).swapaxes(1, 2)
/// .reshape(rows, cols)`: HF row `(h, j, i)` (head, half, index in half) becomes GGUF row
/// `(h, i, j)`. Undoing it moves whole rows, so quantization blocks (which lie within a row) are
/// untouched.
pub(crate) fn unpermuted_source_row(hf_row: usize, rows: usize, n_head: usize) -> usize {
    let head_rows = rows / n_head;
    let half = head_rows / 2;
    let (h, within) = (hf_row / head_rows, hf_row % head_rows);
    let (j, i) = (within / half, within % half);
    h * head_rows + i * 2 + j
}

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
pub(crate) fn convert(f: &GgufFile, path: &Path, spec: &TensorSpec, config: &LlamaConfig) -> Result<Converted, ModelError> {
    let gname = gguf_name(&spec.name).expect("every expected tensor has a GGUF name");
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
        TensorRole::Matrix => convert_matrix(path, info, data, spec, permute_heads(&spec.name, config)),
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
            what: format!("tensor '{}' has {cols} columns, not a multiple of the int4 group size {GROUP_SIZE}", info.name),
        });
    }
    if let Some(n) = n_head {
        if n == 0 || rows % (2 * n) != 0 {
            return Err(ModelError::Shape { name: info.name.clone(), expected: vec![rows.next_multiple_of(2 * n.max(1)), cols], found: vec![rows, cols] });
        }
    }
    let src_row = |r: usize| n_head.map_or(r, |n| unpermuted_source_row(r, rows, n));
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
fn q4_1_to_int4<'a>(rows: usize, cols: usize, source_bytes: impl Fn(usize) -> &'a [u8] + Sync) -> Result<Int4Matrix, ModelError> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways_for_a_layer() {
        assert_eq!(gguf_name("model.layers.12.self_attn.o_proj.weight").unwrap(), "blk.12.attn_output.weight");
        assert_eq!(gguf_name("model.layers.0.post_attention_layernorm.weight").unwrap(), "blk.0.ffn_norm.weight");
        assert_eq!(gguf_name("model.embed_tokens.weight").unwrap(), "token_embd.weight");
        assert_eq!(gguf_name("model.layers.x.mlp.up_proj.weight"), None);
        assert_eq!(gguf_name("model.layers.1.mlp.fc.weight"), None);
    }

    #[test]
    fn unpermutation_inverts_the_converters_reshape() {
        // The converter's permutation written as numpy's reshape / swapaxes index arithmetic:
        // output row o = (h, i, j) in shape (n_head, half, 2) takes input row (h, j, i) in shape
        // (n_head, 2, half).
        let (rows, n_head) = (24, 3);
        let half = rows / n_head / 2;
        let permute = |o: usize| {
            let (h, rest) = (o / (2 * half), o % (2 * half));
            let (i, j) = (rest / 2, rest % 2);
            h * 2 * half + j * half + i
        };
        for hf_row in 0..rows {
            // GGUF row g holds HF row permute(g); the importer must find g for each HF row.
            let g = unpermuted_source_row(hf_row, rows, n_head);
            assert_eq!(permute(g), hf_row);
        }
    }
}
