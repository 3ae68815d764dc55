//! The runtime arguments of the graphs: the order, shapes and element types of the weights, and
//! the host bytes to upload for them from a [`LlamaWeights`].
//!
//! Layouts (chosen for IREE's llvm-cpu code generation, see `docs/backends/stablehlo-graphs.md`):
//! - f16 linear weights are uploaded **transposed**, `[in_features, out_features]` (`[K, M]`):
//!   measured 2.5-5x faster than `[M, K]` for the decode gemv on IREE 3.13 (FACTS.md).
//! - The f16 embedding table stays `[vocab, hidden]` (rows are gathered); a tied LM head reads
//!   it in that layout, an untied LM head is uploaded transposed like every other linear weight.
//! - int4 matrices keep seam's layout: packed bytes `[rows, cols / 2]` (as i8, bit-identical to
//!   the u8 on disk), f16 scales and biases `[rows, cols / 32]`.
//! - RMSNorm weights are f32 `[hidden]`.

use crate::error::GraphError;
use half::f16;
use llama_model::int4::GROUP_SIZE;
use llama_model::weights::{expected_tensors, TensorRole};
use llama_model::{LlamaConfig, LlamaWeights, Matrix};
use session_api::WeightFormat;

/// Element type of an argument as uploaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArgDtype {
    F32,
    F16,
    I32,
    /// int4 packed bytes (two 4-bit values per byte).
    I8,
}

impl ArgDtype {
    pub(crate) fn elem(self) -> crate::mlir::Elem {
        match self {
            ArgDtype::F32 => crate::mlir::Elem::F32,
            ArgDtype::F16 => crate::mlir::Elem::F16,
            ArgDtype::I32 => crate::mlir::Elem::I32,
            ArgDtype::I8 => crate::mlir::Elem::I8,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            ArgDtype::F32 | ArgDtype::I32 => 4,
            ArgDtype::F16 => 2,
            ArgDtype::I8 => 1,
        }
    }
}

/// What a weight argument holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightPart {
    /// An RMSNorm weight, f32 `[hidden]`.
    Norm,
    /// An f16 matrix in its Hugging Face layout `[rows, cols]` (the embedding table, and a tied LM head).
    F16RowMajor,
    /// An f16 matrix transposed to `[cols, rows]`.
    F16Transposed,
    /// int4 packed nibbles `[rows, cols / 2]`.
    Int4Packed,
    /// int4 scales `[rows, cols / 32]`.
    Int4Scales,
    /// int4 biases `[rows, cols / 32]`.
    Int4Biases,
}

/// One weight argument of the graphs, in argument order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightArg {
    /// The Hugging Face tensor name, with `.qweight` / `.scales` / `.biases` for int4 parts.
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: ArgDtype,
    pub part: WeightPart,
}

/// The weight arguments of every graph for `config` in `format`, in order: the tensors of
/// `llama_model::weights::expected_tensors` (embeddings; per layer attention norm, q, k, v, o, MLP
/// norm, gate, up, down; final norm; LM head when untied), an int4 matrix as three arguments.
pub fn weight_args(config: &LlamaConfig, format: WeightFormat) -> Vec<WeightArg> {
    let mut out = Vec::new();
    for spec in expected_tensors(config) {
        match spec.role {
            TensorRole::Norm => {
                out.push(WeightArg { name: spec.name, shape: spec.shape, dtype: ArgDtype::F32, part: WeightPart::Norm })
            }
            TensorRole::Matrix => {
                let (rows, cols) = (spec.shape[0], spec.shape[1]);
                match format {
                    WeightFormat::F16 => {
                        // The embedding table is gathered by rows; everything else is a linear weight.
                        if spec.name == llama_model::weights::names::EMBED_TOKENS {
                            out.push(WeightArg { name: spec.name, shape: vec![rows, cols], dtype: ArgDtype::F16, part: WeightPart::F16RowMajor });
                        } else {
                            out.push(WeightArg { name: spec.name, shape: vec![cols, rows], dtype: ArgDtype::F16, part: WeightPart::F16Transposed });
                        }
                    }
                    WeightFormat::Int4 => {
                        let groups = cols / GROUP_SIZE;
                        out.push(WeightArg { name: format!("{}.qweight", spec.name), shape: vec![rows, cols / 2], dtype: ArgDtype::I8, part: WeightPart::Int4Packed });
                        out.push(WeightArg { name: format!("{}.scales", spec.name), shape: vec![rows, groups], dtype: ArgDtype::F16, part: WeightPart::Int4Scales });
                        out.push(WeightArg { name: format!("{}.biases", spec.name), shape: vec![rows, groups], dtype: ArgDtype::F16, part: WeightPart::Int4Biases });
                    }
                }
            }
        }
    }
    out
}

/// The host bytes of one weight argument, little-endian, row-major in the argument's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct HostArg {
    pub spec: WeightArg,
    pub bytes: Vec<u8>,
}

fn f16_bytes(values: impl Iterator<Item = f16>) -> Vec<u8> {
    values.flat_map(|v| v.to_le_bytes()).collect()
}

/// The bytes to upload for every argument of [`weight_args`], from weights in one format.
/// Fails if a matrix is in another format than `format` or a shape disagrees with the config.
pub fn host_args(weights: &LlamaWeights, format: WeightFormat) -> Result<Vec<HostArg>, GraphError> {
    let specs = weight_args(&weights.config, format);
    let mut specs = specs.into_iter();
    let mut out = Vec::new();
    let mut next = |name: &str| {
        specs.next().ok_or_else(|| GraphError::Weight { name: name.to_string(), message: "more tensors than the config implies".into() })
    };
    for (name, tensor) in weights.tensors() {
        match tensor {
            llama_model::weights::TensorRef::Norm(v) => {
                let spec = next(&name)?;
                if spec.shape != [v.len()] {
                    return Err(GraphError::Weight { name, message: format!("{} values, expected {:?}", v.len(), spec.shape) });
                }
                out.push(HostArg { spec, bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect() });
            }
            llama_model::weights::TensorRef::Matrix(m) => match (m, format) {
                (Matrix::F16 { rows, cols, data }, WeightFormat::F16) => {
                    let spec = next(&name)?;
                    if data.len() != rows * cols {
                        return Err(GraphError::Weight { name, message: "data length does not match its shape".into() });
                    }
                    let bytes = match spec.part {
                        WeightPart::F16RowMajor if spec.shape == [*rows, *cols] => f16_bytes(data.iter().copied()),
                        WeightPart::F16Transposed if spec.shape == [*cols, *rows] => {
                            f16_bytes((0..*cols).flat_map(|c| (0..*rows).map(move |r| data[r * cols + c])))
                        }
                        _ => {
                            return Err(GraphError::Weight { name, message: format!("[{rows}, {cols}] does not fit argument {:?}", spec.shape) })
                        }
                    };
                    out.push(HostArg { spec, bytes });
                }
                (Matrix::Int4(q), WeightFormat::Int4) => {
                    let packed = next(&name)?;
                    if packed.shape != [q.rows, q.cols / 2] || q.packed.len() != q.rows * q.cols / 2 {
                        return Err(GraphError::Weight { name, message: format!("int4 [{}, {}] does not fit argument {:?}", q.rows, q.cols, packed.shape) });
                    }
                    out.push(HostArg { spec: packed, bytes: q.packed.clone() });
                    let scales = next(&name)?;
                    let groups = q.rows * q.cols / GROUP_SIZE;
                    if q.scales.len() != groups || q.biases.len() != groups {
                        return Err(GraphError::Weight { name, message: "scale or bias count does not match the shape".into() });
                    }
                    out.push(HostArg { spec: scales, bytes: f16_bytes(q.scales.iter().copied()) });
                    let biases = next(&name)?;
                    out.push(HostArg { spec: biases, bytes: f16_bytes(q.biases.iter().copied()) });
                }
                (m, _) => {
                    return Err(GraphError::Weight { name, message: format!("stored as {}, the graphs were asked for {format}", m.format()) })
                }
            },
        }
    }
    if specs.next().is_some() {
        return Err(GraphError::Weight { name: "(end)".into(), message: "fewer tensors than the config implies".into() });
    }
    Ok(out)
}
