//! The runtime arguments of the graphs: the order, shapes and element types of the weights, and
//! the host bytes to upload for them from a [`LlamaWeights`].
//!
//! Layouts (chosen for IREE's llvm-cpu code generation, see `docs/backends/stablehlo-graphs.md`):
//! - f16 linear weights are uploaded **transposed**, `[in_features, out_features]` (`[K, M]`):
//!   measured 2.5-5x faster than `[M, K]` for the decode gemv on IREE 3.13 (FACTS.md).
//! - An untied f16 embedding table stays `[vocab, hidden]` (rows are gathered); a tied one is the LM
//!   head too and is uploaded transposed like every linear weight (embeddings gather its columns).
//! - int4 matrices keep seam's layout: packed bytes `[rows, cols / 2]` (as i8, bit-identical to
//!   the u8 on disk), f16 scales and biases `[rows, cols / 32]`.
//! - RMSNorm weights are f32 `[hidden]`.

use crate::error::GraphError;
use half::f16;
use half::slice::HalfFloatSliceExt;
use llama_model::int4::GROUP_SIZE;
use llama_model::weights::{expected_tensors, TensorRole};
use llama_model::{Int4Layout, LlamaConfig, LlamaWeights, Matrix, MatrixFormat};
use session_api::WeightFormat;

/// Element type of an argument as uploaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArgDtype {
    F32,
    F16,
    I32,
    /// int4 packed bytes (two 4-bit values per byte), or int8 codes.
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
    /// A dense (f16 or f32, see [`StorageDtype`]) matrix in its Hugging Face layout `[rows, cols]`
    /// (an untied embedding table).
    DenseRowMajor,
    /// A dense matrix transposed to `[cols, rows]` (linear weights, and a tied embedding table).
    DenseTransposed,
    /// int4 packed nibbles `[rows, cols / 2]`, in the given order.
    Int4Packed(MatrixOrder),
    /// int4 scales `[rows, cols / 32]`, in the given order.
    Int4Scales(MatrixOrder),
    /// int4 biases `[rows, cols / 32]`, in the given order.
    Int4Biases(MatrixOrder),
    /// int8 codes `[rows, cols]`, in the given order.
    Int8Codes(MatrixOrder),
    /// int8 scales `[rows, cols / 32]`, in the given order.
    Int8Scales(MatrixOrder),
}

/// How a quantized (int4 or int8) matrix's codes and per-group values are ordered (their shapes
/// are the same either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MatrixOrder {
    /// seam's formats as stored: row after row.
    #[default]
    RowMajor,
    /// Panels of 16 rows (`cpu_kernels::int4_to_panels`, `int8_to_panels`, ADR 0025 and 0026):
    /// what the kernels' products read fastest, over exact or int8 activations. Only seam's
    /// kernels multiply them; the graphs gather an int8 embedding's rows from them.
    Panels,
}

/// How the graphs' weight arguments are laid out: which matrices of an int4 model are int8, how
/// the fp16 format's matrices are stored and ordered, and how the quantized matrices are ordered
/// ([`weight_args_with`]). The default is the pure-StableHLO graphs' ([`weight_args`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArgLayout {
    pub int4: Int4Layout,
    pub dense: StorageDtype,
    pub dense_layout: DenseLayout,
    pub matrix_order: MatrixOrder,
}

impl Default for ArgLayout {
    fn default() -> ArgLayout {
        ArgLayout {
            int4: Int4Layout::DEFAULT,
            dense: StorageDtype::F16,
            dense_layout: DenseLayout::Transposed,
            matrix_order: MatrixOrder::RowMajor,
        }
    }
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

/// f16 or f32 storage, for the matrices of the fp16 format ([`crate::GraphOptions::dense`]) and
/// for the KV cache ([`crate::GraphOptions::cache`]).
///
/// f16 halves the bytes and suits IREE; XLA's CPU backend handles f16 arrays several times slower
/// than f32 (FACTS.md; a decode step on an f16 cache spent most of its time converting it), so
/// a backend may keep them in f32 (matrices: the f16 weights widened exactly). int4 matrices are
/// unaffected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StorageDtype {
    #[default]
    F16,
    F32,
}

impl StorageDtype {
    /// The argument element type of this storage.
    pub fn arg_dtype(self) -> ArgDtype {
        match self {
            StorageDtype::F16 => ArgDtype::F16,
            StorageDtype::F32 => ArgDtype::F32,
        }
    }
}

/// The weight arguments of every graph for `config` in `format`, in order: the tensors of
/// `llama_model::weights::expected_tensors` (embeddings; per layer attention norm, q, k, v, o, MLP
/// norm, gate, up, down; final norm; LM head when untied), an int4 matrix as three arguments, an
/// int8 one as two. Dense matrices are f16 and transposed, an int4 model's matrices as
/// [`Int4Layout::DEFAULT`]; [`weight_args_with`] chooses.
pub fn weight_args(config: &LlamaConfig, format: WeightFormat) -> Vec<WeightArg> {
    weight_args_with(config, format, ArgLayout::default())
}

/// How the fp16 format's linear weights are laid out on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DenseLayout {
    /// `[K, M]` (transposed from Hugging Face's `[M, K]`): the layout compilers' dots read best.
    /// An untied embedding table, only gathered by rows, stays `[vocab, hidden]`.
    #[default]
    Transposed,
    /// `[M, K]` as stored: one row per output, what seam's host kernels read (ADR 0011).
    RowMajor,
}

/// [`weight_args`] laid out as `layout`: an int4 model's matrices as `layout.int4`, the fp16
/// format's matrices uploaded as `layout.dense` in `layout.dense_layout`, and ordered as
/// `layout.matrix_order`: the decoder layers' int4 matrices, and every int8 matrix whose rows
/// fill whole panels (an int4 embedding or head stays row-major: the graphs gather an int4
/// embedding's rows only from that order).
pub fn weight_args_with(config: &LlamaConfig, format: WeightFormat, layout: ArgLayout) -> Vec<WeightArg> {
    let ArgLayout { int4, dense, dense_layout: layout, matrix_order: order } = layout;
    let int4 = int4.normalized(config.tie_word_embeddings);
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
                        // An untied embedding table is only gathered, by rows; everything else is read
                        // as a linear weight, transposed, including a tied table (the LM head: the
                        // biggest matrix of a small model; its [vocab, hidden] gemv took 10.8 ms of a
                        // 46 ms SmolLM2 decode step on IREE, about 4x its bandwidth cost).
                        let gathered_only =
                            spec.name == llama_model::weights::names::EMBED_TOKENS && !config.tie_word_embeddings;
                        if gathered_only || layout == DenseLayout::RowMajor {
                            out.push(WeightArg {
                                name: spec.name,
                                shape: vec![rows, cols],
                                dtype: dense.arg_dtype(),
                                part: WeightPart::DenseRowMajor,
                            });
                        } else {
                            out.push(WeightArg {
                                name: spec.name,
                                shape: vec![cols, rows],
                                dtype: dense.arg_dtype(),
                                part: WeightPart::DenseTransposed,
                            });
                        }
                    }
                    WeightFormat::Int4 if int4.of(&spec.name) == MatrixFormat::Int8 => {
                        // Panels only of whole panels: the graphs gather an embedding's rows
                        // from a `[rows / 16, cols / 4, 16, 4]` view of them.
                        let order = if rows % cpu_kernels::PANEL_ROWS == 0 { order } else { MatrixOrder::RowMajor };
                        out.push(WeightArg {
                            name: format!("{}.qweight", spec.name),
                            shape: vec![rows, cols],
                            dtype: ArgDtype::I8,
                            part: WeightPart::Int8Codes(order),
                        });
                        out.push(WeightArg {
                            name: format!("{}.scales", spec.name),
                            shape: vec![rows, cols / GROUP_SIZE],
                            dtype: ArgDtype::F16,
                            part: WeightPart::Int8Scales(order),
                        });
                    }
                    WeightFormat::Int4 => {
                        let groups = cols / GROUP_SIZE;
                        let order = if layer_of(&spec.name).is_some() { order } else { MatrixOrder::RowMajor };
                        out.push(WeightArg {
                            name: format!("{}.qweight", spec.name),
                            shape: vec![rows, cols / 2],
                            dtype: ArgDtype::I8,
                            part: WeightPart::Int4Packed(order),
                        });
                        out.push(WeightArg {
                            name: format!("{}.scales", spec.name),
                            shape: vec![rows, groups],
                            dtype: ArgDtype::F16,
                            part: WeightPart::Int4Scales(order),
                        });
                        out.push(WeightArg {
                            name: format!("{}.biases", spec.name),
                            shape: vec![rows, groups],
                            dtype: ArgDtype::F16,
                            part: WeightPart::Int4Biases(order),
                        });
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

/// Values per tile edge of [`transposed_dense_bytes`], and per widening pass of [`dense_bytes`].
const TILE: usize = 32;

/// `data` (`rows x cols`, row-major) transposed to `cols x rows`, as little-endian bytes of
/// `dense`.
///
/// In tiles, so that both the rows read and the rows written stay in cache (the plain
/// column-by-column walk over SmolLM2's 49152 x 576 embedding took seconds of every load), and
/// straight into the one output buffer: the load of an fp16 model on `pjrt-cpu` widens 538 MB,
/// and every intermediate buffer of that size costs its page faults again.
fn transposed_dense_bytes(data: &[f16], rows: usize, cols: usize, dense: StorageDtype) -> Vec<u8> {
    let size = dense.arg_dtype().size();
    let mut out = vec![0u8; rows * cols * size];
    match dense {
        StorageDtype::F16 => transpose_tiled(data, rows, cols, &mut out, |v, d| d.copy_from_slice(&v.to_le_bytes())),
        StorageDtype::F32 => {
            transpose_tiled(data, rows, cols, &mut out, |v, d| d.copy_from_slice(&v.to_f32().to_le_bytes()))
        }
    }
    out
}

/// Writes `data` (`rows x cols`) transposed into `out` as `cols x rows` elements of
/// `out.len() / (rows * cols)` bytes each, `put` writing one: a tile of [`TILE`] x [`TILE`] at a
/// time, so that the tile's source rows and destination rows both stay in cache and each
/// destination row is written in order. The destination rows are split over the cores (a 1B
/// model transposes 2.5 GB on its first load).
fn transpose_tiled(data: &[f16], rows: usize, cols: usize, out: &mut [u8], put: impl Fn(f16, &mut [u8]) + Sync) {
    if rows == 0 || cols == 0 {
        return;
    }
    let size = out.len() / (rows * cols);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Whole tiles of destination rows per thread.
    let per_thread = cols.div_ceil(threads).div_ceil(TILE) * TILE;
    std::thread::scope(|scope| {
        for (part, chunk) in out.chunks_mut(per_thread * rows * size).enumerate() {
            let put = &put;
            scope.spawn(move || {
                let first = part * per_thread;
                let last = first + chunk.len() / (rows * size);
                for r0 in (0..rows).step_by(TILE) {
                    let r1 = (r0 + TILE).min(rows);
                    for c0 in (first..last).step_by(TILE) {
                        for c in c0..(c0 + TILE).min(last) {
                            let at = ((c - first) * rows + r0) * size;
                            let dst = chunk[at..at + (r1 - r0) * size].chunks_exact_mut(size);
                            for (r, d) in (r0..r1).zip(dst) {
                                put(data[r * cols + c], d);
                            }
                        }
                    }
                }
            });
        }
    });
}

fn f16_bytes(values: impl ExactSizeIterator<Item = f16>) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 2);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// `values` as little-endian bytes: on a little-endian host, their memory copied in one pass (a
/// 1B model's 2.5 GB of f16 matrices went value by value in seconds).
fn f16_slice_bytes(values: &[f16]) -> Vec<u8> {
    if cfg!(target_endian = "little") {
        bytemuck::cast_slice::<f16, u8>(values).to_vec()
    } else {
        f16_bytes(values.iter().copied())
    }
}

/// f16 values as the bit patterns the kernels take (no copy).
fn f16_bits(values: &[f16]) -> &[u16] {
    bytemuck::cast_slice(values)
}

/// [`f16_bits`], writable.
fn f16_bits_mut(values: &mut [f16]) -> &mut [u16] {
    bytemuck::cast_slice_mut(values)
}

fn dense_bytes(values: &[f16], dense: StorageDtype) -> Vec<u8> {
    match dense {
        StorageDtype::F16 => f16_slice_bytes(values),
        StorageDtype::F32 => {
            let mut out = vec![0u8; values.len() * 4];
            let mut wide = [0f32; TILE];
            for (bytes, chunk) in out.chunks_mut(TILE * 4).zip(values.chunks(TILE)) {
                let wide = &mut wide[..chunk.len()];
                chunk.convert_to_f32_slice(wide);
                for (b, value) in bytes.chunks_exact_mut(4).zip(wide.iter()) {
                    b.copy_from_slice(&value.to_le_bytes());
                }
            }
            out
        }
    }
}

/// The bytes to upload for every argument of [`weight_args`], from weights in one format.
/// Fails if a matrix is in another format than `format` or a shape disagrees with the config.
pub fn host_args(weights: &LlamaWeights, format: WeightFormat) -> Result<Vec<HostArg>, GraphError> {
    host_args_with(weights, format, ArgLayout::default())
}

/// [`host_args`] for the arguments of [`weight_args_with`].
pub fn host_args_with(
    weights: &LlamaWeights,
    format: WeightFormat,
    layout: ArgLayout,
) -> Result<Vec<HostArg>, GraphError> {
    let mut out = Vec::new();
    visit_host_args(weights, format, layout, &mut |arg| {
        out.push(arg);
        Ok(())
    })?;
    Ok(out)
}

/// [`host_args_with`] one argument at a time, in order: each is handed to `each` and dropped
/// before the next is made, so a caller that copies them somewhere never holds them all.
fn visit_host_args(
    weights: &LlamaWeights,
    format: WeightFormat,
    layout: ArgLayout,
    each: &mut dyn FnMut(HostArg) -> Result<(), GraphError>,
) -> Result<(), GraphError> {
    let specs = weight_args_with(&weights.config, format, layout);
    let ArgLayout { int4, dense, .. } = layout;
    let int4 = int4.normalized(weights.config.tie_word_embeddings);
    let mut specs = specs.into_iter();
    let mut next = |name: &str| {
        specs.next().ok_or_else(|| GraphError::Weight {
            name: name.to_string(),
            message: "more tensors than the config implies".into(),
        })
    };
    for (name, tensor) in weights.tensors() {
        match tensor {
            llama_model::weights::TensorRef::Norm(v) => {
                let spec = next(&name)?;
                if spec.shape != [v.len()] {
                    return Err(GraphError::Weight {
                        name,
                        message: format!("{} values, expected {:?}", v.len(), spec.shape),
                    });
                }
                each(HostArg { spec, bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect() })?;
            }
            llama_model::weights::TensorRef::Matrix(m) => match (m, format) {
                (Matrix::F16 { rows, cols, data }, WeightFormat::F16) => {
                    let spec = next(&name)?;
                    if data.len() != rows * cols {
                        return Err(GraphError::Weight {
                            name,
                            message: "data length does not match its shape".into(),
                        });
                    }
                    let bytes = match spec.part {
                        WeightPart::DenseRowMajor if spec.shape == [*rows, *cols] => dense_bytes(data, dense),
                        WeightPart::DenseTransposed if spec.shape == [*cols, *rows] => {
                            transposed_dense_bytes(data, *rows, *cols, dense)
                        }
                        _ => {
                            return Err(GraphError::Weight {
                                name,
                                message: format!("[{rows}, {cols}] does not fit argument {:?}", spec.shape),
                            })
                        }
                    };
                    each(HostArg { spec, bytes })?;
                }
                (Matrix::Int8(q), WeightFormat::Int4) if int4.of(&name) == MatrixFormat::Int8 => {
                    let codes = next(&name)?;
                    let groups = q.rows * q.cols / GROUP_SIZE;
                    if codes.shape != [q.rows, q.cols] || q.codes.len() != q.rows * q.cols || q.scales.len() != groups {
                        return Err(GraphError::Weight {
                            name,
                            message: format!("int8 [{}, {}] does not fit argument {:?}", q.rows, q.cols, codes.shape),
                        });
                    }
                    let scales = next(&name)?;
                    if codes.part == WeightPart::Int8Codes(MatrixOrder::Panels) {
                        let (mut c, mut s) = (vec![0i8; q.codes.len()], vec![f16::ZERO; groups]);
                        let w = cpu_kernels::Int8Matrix {
                            rows: q.rows,
                            cols: q.cols,
                            codes: &q.codes,
                            scales: f16_bits(&q.scales),
                        };
                        cpu_kernels::int8_to_panels(w, &mut c, f16_bits_mut(&mut s))
                            .map_err(|e| GraphError::Weight { name: name.clone(), message: e.to_string() })?;
                        each(HostArg { spec: codes, bytes: bytemuck::cast_slice(&c).to_vec() })?;
                        each(HostArg { spec: scales, bytes: f16_slice_bytes(&s) })?;
                    } else {
                        each(HostArg { spec: codes, bytes: bytemuck::cast_slice(&q.codes).to_vec() })?;
                        each(HostArg { spec: scales, bytes: f16_slice_bytes(&q.scales) })?;
                    }
                }
                (Matrix::Int4(q), WeightFormat::Int4) if int4.of(&name) == MatrixFormat::Int4 => {
                    let packed = next(&name)?;
                    if packed.shape != [q.rows, q.cols / 2] || q.packed.len() != q.rows * q.cols / 2 {
                        return Err(GraphError::Weight {
                            name,
                            message: format!("int4 [{}, {}] does not fit argument {:?}", q.rows, q.cols, packed.shape),
                        });
                    }
                    let groups = q.rows * q.cols / GROUP_SIZE;
                    if q.scales.len() != groups || q.biases.len() != groups {
                        return Err(GraphError::Weight {
                            name,
                            message: "scale or bias count does not match the shape".into(),
                        });
                    }
                    let (scales, biases) = (next(&name)?, next(&name)?);
                    if packed.part == WeightPart::Int4Packed(MatrixOrder::Panels) {
                        let (mut p, mut s, mut b) =
                            (vec![0u8; q.packed.len()], vec![f16::ZERO; groups], vec![f16::ZERO; groups]);
                        let w = cpu_kernels::Int4Matrix {
                            rows: q.rows,
                            cols: q.cols,
                            packed: &q.packed,
                            scales: f16_bits(&q.scales),
                            biases: f16_bits(&q.biases),
                        };
                        cpu_kernels::int4_to_panels(w, &mut p, f16_bits_mut(&mut s), f16_bits_mut(&mut b))
                            .map_err(|e| GraphError::Weight { name: name.clone(), message: e.to_string() })?;
                        each(HostArg { spec: packed, bytes: p })?;
                        each(HostArg { spec: scales, bytes: f16_slice_bytes(&s) })?;
                        each(HostArg { spec: biases, bytes: f16_slice_bytes(&b) })?;
                    } else {
                        each(HostArg { spec: packed, bytes: q.packed.clone() })?;
                        each(HostArg { spec: scales, bytes: f16_slice_bytes(&q.scales) })?;
                        each(HostArg { spec: biases, bytes: f16_slice_bytes(&q.biases) })?;
                    }
                }
                (m, _) => {
                    let asked = int4.of(&name);
                    return Err(GraphError::Weight {
                        name,
                        message: match format {
                            WeightFormat::Int4 => {
                                format!("stored as {}, the graphs were asked for {} ({int4})", m.format(), asked)
                            }
                            WeightFormat::F16 => format!("stored as {}, the graphs were asked for f16", m.format()),
                        },
                    });
                }
            },
        }
    }
    if specs.next().is_some() {
        return Err(GraphError::Weight {
            name: "(end)".into(),
            message: "fewer tensors than the config implies".into(),
        });
    }
    Ok(())
}

/// How the name of a per-layer tensor's argument stacked over the layers starts
/// ([`stack_weight_args`]).
const STACKED_PREFIX: &str = "model.layers.*.";

/// The stacked argument's name of the per-layer tensors `model.layers.{i}.{rest}`.
fn stacked_name(rest: &str) -> String {
    format!("{STACKED_PREFIX}{rest}")
}

impl WeightArg {
    /// Whether this argument holds a per-layer tensor of every layer (`[layers, ...]`).
    pub(crate) fn is_stacked(&self) -> bool {
        self.name.starts_with(STACKED_PREFIX)
    }
}

/// The layer index and the rest of a per-layer tensor name (`model.layers.{i}.{rest}`).
fn layer_of(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (index, rest) = rest.split_once('.')?;
    Some((index.parse().ok()?, rest))
}

/// The arguments with each per-layer tensor stacked over the layers: `model.layers.{i}.X` of
/// shape `S` for every `i` becomes one `model.layers.*.X` of shape `[layers, S...]`, placed where
/// layer 0's tensor was. This is the argument list of graphs that loop over the layers
/// ([`crate::LayerMode::Loop`]).
pub fn stack_weight_args(args: Vec<WeightArg>) -> Vec<WeightArg> {
    stack_weight_args_where(args, Stacked::All)
}

/// Which per-layer weight arguments a graph takes stacked over the layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stacked {
    /// None: one argument per layer and tensor.
    None,
    /// Every per-layer tensor ([`crate::LayerMode::Loop`]).
    All,
    /// The matrices' arguments, each norm one argument per layer
    /// ([`crate::GraphOptions::stacked_weights`]).
    Matrices,
}

impl Stacked {
    /// Whether `arg` (a per-layer tensor's argument) is stacked.
    fn takes(self, arg: &WeightArg) -> bool {
        match self {
            Stacked::None => false,
            Stacked::All => true,
            Stacked::Matrices => arg.part != WeightPart::Norm,
        }
    }
}

/// [`stack_weight_args`] for the per-layer tensors `which` stacks; the others stay one argument
/// per layer, in their places.
pub fn stack_weight_args_where(args: Vec<WeightArg>, which: Stacked) -> Vec<WeightArg> {
    let layers = args.iter().filter_map(|a| layer_of(&a.name)).map(|(i, _)| i + 1).max().unwrap_or(0);
    let mut out = Vec::new();
    for arg in args {
        match layer_of(&arg.name) {
            Some((0, rest)) if which.takes(&arg) => {
                let mut shape = vec![layers];
                shape.extend_from_slice(&arg.shape);
                out.push(WeightArg { name: stacked_name(rest), shape, ..arg });
            }
            Some(_) if which.takes(&arg) => {}
            _ => out.push(arg),
        }
    }
    out
}

/// [`host_args`] stacked like [`stack_weight_args`]: each stacked argument's bytes are its layers'
/// bytes one after the other (row-major `[layers, ...]`).
pub fn stack_host_args(args: Vec<HostArg>) -> Result<Vec<HostArg>, GraphError> {
    stack_host_args_where(args, Stacked::All)
}

/// [`stack_host_args`] for the per-layer tensors `which` stacks.
pub fn stack_host_args_where(args: Vec<HostArg>, which: Stacked) -> Result<Vec<HostArg>, GraphError> {
    let specs = stack_weight_args_where(args.iter().map(|a| a.spec.clone()).collect(), which);
    let mut out: Vec<HostArg> = specs.into_iter().map(|spec| HostArg { bytes: Vec::new(), spec }).collect();
    for arg in args {
        let stacked_name = match layer_of(&arg.spec.name) {
            Some((_, rest)) if which.takes(&arg.spec) => stacked_name(rest),
            _ => arg.spec.name.clone(),
        };
        let target = out.iter_mut().find(|o| o.spec.name == stacked_name).ok_or_else(|| GraphError::Weight {
            name: arg.spec.name.clone(),
            message: "no layer 0 tensor of this kind".into(),
        })?;
        target.bytes.extend_from_slice(&arg.bytes);
    }
    for o in &out {
        let want = o.spec.shape.iter().product::<usize>() * o.spec.dtype.size();
        if o.bytes.len() != want {
            return Err(GraphError::Weight {
                name: o.spec.name.clone(),
                message: format!("{} bytes over the layers, expected {want}", o.bytes.len()),
            });
        }
    }
    Ok(out)
}

/// The weight arguments of graphs emitted with `options` (stacked when they loop over layers).
pub fn graph_weight_args(config: &LlamaConfig, options: &crate::GraphOptions) -> Vec<WeightArg> {
    stack_weight_args_where(weight_args_with(config, options.format, options.arg_layout()), options.stacked_weights())
}

/// The bytes to upload for [`graph_weight_args`].
pub fn graph_host_args(weights: &LlamaWeights, options: &crate::GraphOptions) -> Result<Vec<HostArg>, GraphError> {
    stack_host_args_where(host_args_with(weights, options.format, options.arg_layout())?, options.stacked_weights())
}

/// The bytes of [`graph_weight_args`] one piece at a time, for a caller that writes them
/// straight to where they go (a prepared-weights file) without holding them all: `each` gets the
/// index of the graph argument, the byte offset of the piece in it, and the piece (a whole
/// argument, or one layer's part of a stacked one). Every byte of every argument is covered
/// exactly once.
pub fn for_each_graph_host_arg(
    weights: &LlamaWeights,
    options: &crate::GraphOptions,
    each: &mut dyn FnMut(usize, usize, HostArg) -> Result<(), GraphError>,
) -> Result<(), GraphError> {
    let graph_args = graph_weight_args(&weights.config, options);
    let stacked = options.stacked_weights();
    // Argument names are unique: a piece goes to the argument of its own name, or, for one layer
    // of a stacked argument, to `model.layers.*.{rest}` at that layer's offset.
    let index_of: std::collections::HashMap<&str, usize> =
        graph_args.iter().enumerate().map(|(i, a)| (a.name.as_str(), i)).collect();
    visit_host_args(weights, options.format, options.arg_layout(), &mut |piece| {
        let (name, offset) = match layer_of(&piece.spec.name).filter(|_| stacked.takes(&piece.spec)) {
            Some((layer, rest)) => (stacked_name(rest), layer * piece.bytes.len()),
            None => (piece.spec.name.clone(), 0),
        };
        let index = *index_of.get(name.as_str()).ok_or_else(|| GraphError::Weight {
            name: piece.spec.name.clone(),
            message: "no graph argument takes this tensor".into(),
        })?;
        let arg = &graph_args[index];
        let size = arg.shape.iter().product::<usize>() * arg.dtype.size();
        if offset + piece.bytes.len() > size || arg.dtype != piece.spec.dtype {
            return Err(GraphError::Weight {
                name: piece.spec.name.clone(),
                message: format!("does not fit argument {} ({size} bytes of {:?})", arg.name, arg.dtype),
            });
        }
        each(index, offset, piece)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use llama_model::random::{random_weights, tiny_config, tiny_llama32_config};

    #[test]
    fn order_and_shapes() {
        let c = tiny_config();
        let f16 = weight_args(&c, WeightFormat::F16);
        assert_eq!(f16.len(), 1 + 9 * c.num_hidden_layers + 1 + 1);
        assert_eq!(f16[0].name, "model.embed_tokens.weight");
        assert_eq!((f16[0].shape.clone(), f16[0].part), (vec![256, 64], WeightPart::DenseRowMajor));
        assert_eq!(f16[1].name, "model.layers.0.input_layernorm.weight");
        assert_eq!((f16[1].shape.clone(), f16[1].dtype), (vec![64], ArgDtype::F32));
        // k_proj is [32, 64] in Hugging Face layout, uploaded as [64, 32].
        assert_eq!(
            (f16[3].name.as_str(), f16[3].shape.clone()),
            ("model.layers.0.self_attn.k_proj.weight", vec![64, 32])
        );
        assert_eq!(f16.last().unwrap().shape, vec![64, 256]);
        let int4 =
            weight_args_with(&c, WeightFormat::Int4, ArgLayout { int4: Int4Layout::ALL_INT4, ..ArgLayout::default() });
        assert_eq!(int4.len(), 3 * (1 + 7 * c.num_hidden_layers + 1) + 2 * c.num_hidden_layers + 1);
        assert_eq!(int4[0].name, "model.embed_tokens.weight.qweight");
        assert_eq!((int4[0].shape.clone(), int4[0].dtype), (vec![256, 32], ArgDtype::I8));
        assert_eq!((int4[1].shape.clone(), int4[1].dtype), (vec![256, 2], ArgDtype::F16));
        assert_eq!(int4[2].part, WeightPart::Int4Biases(MatrixOrder::RowMajor));
        // The default layout: the embedding and the head as int8 codes and scales.
        let default = weight_args(&c, WeightFormat::Int4);
        assert_eq!(default.len(), int4.len() - 2);
        assert_eq!(default[0].name, "model.embed_tokens.weight.qweight");
        assert_eq!(
            (default[0].shape.clone(), default[0].part),
            (vec![256, 64], WeightPart::Int8Codes(MatrixOrder::RowMajor))
        );
        assert_eq!(
            (default[1].shape.clone(), default[1].part),
            (vec![256, 2], WeightPart::Int8Scales(MatrixOrder::RowMajor))
        );
        assert_eq!(default.last().unwrap().name, "lm_head.weight.scales");
        // Tied embeddings: no LM head argument, and the table is transposed (it is the LM head).
        let tied = weight_args(&tiny_llama32_config(), WeightFormat::F16);
        assert_eq!(tied.len(), f16.len() - 1);
        assert_eq!((tied[0].shape.clone(), tied[0].part), (vec![64, 256], WeightPart::DenseTransposed));
        assert_eq!(tied.last().unwrap().name, "model.norm.weight");
    }

    #[test]
    fn host_bytes_transpose_f16_and_keep_int4() {
        let w = random_weights(&tiny_config(), 3).unwrap();
        let args = host_args(&w, WeightFormat::F16).unwrap();
        assert_eq!(args.len(), weight_args(&w.config, WeightFormat::F16).len());
        for a in &args {
            assert_eq!(a.bytes.len(), a.spec.shape.iter().product::<usize>() * a.spec.dtype.size(), "{}", a.spec.name);
        }
        // q_proj element (row 5, col 9) sits at [9, 5] of the uploaded [cols, rows] matrix.
        let Matrix::F16 { rows, cols, data } = &w.layers[0].wq else { panic!() };
        let q = &args[2];
        let at = (9 * rows + 5) * 2;
        assert_eq!(&q.bytes[at..at + 2], &data[5 * cols + 9].to_le_bytes());
        // The embedding table is not transposed.
        let Matrix::F16 { data: embed, .. } = &w.embed else { panic!() };
        assert_eq!(&args[0].bytes[..2], &embed[0].to_le_bytes());
        assert_eq!(&args[0].bytes[2..4], &embed[1].to_le_bytes());

        // Widened to f32 (what pjrt-cpu holds): the same positions, each value exact, for a matrix
        // whose sides are not multiples of the conversion's tile.
        let wide =
            host_args_with(&w, WeightFormat::F16, ArgLayout { dense: StorageDtype::F32, ..ArgLayout::default() })
                .unwrap();
        for (narrow, wide) in args.iter().zip(&wide) {
            let narrow_len = narrow.bytes.len();
            match narrow.spec.dtype {
                ArgDtype::F16 => {
                    assert_eq!(wide.bytes.len(), narrow_len * 2, "{}", narrow.spec.name);
                    for (n, w) in narrow.bytes.chunks_exact(2).zip(wide.bytes.chunks_exact(4)) {
                        let n = f16::from_le_bytes([n[0], n[1]]).to_f32();
                        assert_eq!(
                            n.to_bits(),
                            f32::from_le_bytes([w[0], w[1], w[2], w[3]]).to_bits(),
                            "{}",
                            narrow.spec.name
                        );
                    }
                }
                _ => assert_eq!(narrow.bytes, wide.bytes, "{}", narrow.spec.name),
            }
        }
        let odd = [
            f16::from_f32(1.5),
            f16::from_f32(-2.0),
            f16::from_f32(0.25),
            f16::from_f32(3.0),
            f16::from_f32(7.0),
            f16::from_f32(-0.5),
        ];
        let mut many = Vec::new();
        for i in 0..(37 * 45) {
            many.push(odd[i % odd.len()] * f16::from_f32((i % 11) as f32));
        }
        let t = transposed_dense_bytes(&many, 37, 45, StorageDtype::F32);
        for r in 0..37 {
            for c in 0..45 {
                let at = (c * 37 + r) * 4;
                assert_eq!(f32::from_le_bytes(t[at..at + 4].try_into().unwrap()), many[r * 45 + c].to_f32());
            }
        }

        // Asking for int4 from f16 weights is an error, not a silent conversion.
        assert!(matches!(host_args(&w, WeightFormat::Int4), Err(GraphError::Weight { .. })));

        let mut q4 = w.clone();
        q4.layers[0].wq = Matrix::Int4(w.layers[0].wq.to_int4().unwrap());
        assert!(matches!(host_args(&q4, WeightFormat::F16), Err(GraphError::Weight { .. })));
        // An int4 model whose layout differs from the graphs' (a 4-bit embedding where the graphs
        // take 8 bits) is an error naming both.
        let all_int4 = w.quantized(Int4Layout::ALL_INT4).unwrap();
        let err = host_args(&all_int4, WeightFormat::Int4).unwrap_err().to_string();
        assert!(err.contains("stored as int4") && err.contains("asked for int8"), "{err}");
        let int4 = w.quantized(Int4Layout::DEFAULT).unwrap();
        let args = host_args(&int4, WeightFormat::Int4).unwrap();
        let Matrix::Int8(embed) = &int4.embed else { panic!("the default layout's embedding is int8") };
        assert_eq!(args[0].bytes, bytemuck::cast_slice::<i8, u8>(&embed.codes));
        assert_eq!(args[1].bytes, f16_slice_bytes(&embed.scales));
    }

    #[test]
    fn stacking_over_layers() {
        let c = tiny_config();
        let flat = weight_args(&c, WeightFormat::Int4);
        let stacked = stack_weight_args(flat.clone());
        // int8 embed (2 parts), 2 norms + 7 int4 matrices x 3 parts per layer kind, final norm,
        // int8 LM head (2).
        assert_eq!(stacked.len(), 2 + 2 + 7 * 3 + 1 + 2);
        assert_eq!(
            (stacked[0].part, stacked[1].part),
            (WeightPart::Int8Codes(MatrixOrder::RowMajor), WeightPart::Int8Scales(MatrixOrder::RowMajor))
        );
        assert_eq!(stacked[0].shape, vec![c.vocab_size, c.hidden_size]);
        assert_eq!(stacked[2].name, "model.layers.*.input_layernorm.weight");
        assert_eq!(stacked[2].shape, vec![c.num_hidden_layers, c.hidden_size]);
        assert_eq!(stacked[3].name, "model.layers.*.self_attn.q_proj.weight.qweight");
        assert_eq!(stacked[3].shape[0], c.num_hidden_layers);
        let all_int4 =
            weight_args_with(&c, WeightFormat::Int4, ArgLayout { int4: Int4Layout::ALL_INT4, ..ArgLayout::default() });
        assert_eq!(stack_weight_args(all_int4).len(), 3 + 2 + 7 * 3 + 1 + 3);

        let w = random_weights(&c, 5).unwrap();
        let host = host_args(&w, WeightFormat::F16).unwrap();
        let stacked = stack_host_args(host.clone()).unwrap();
        let k1 = host.iter().find(|a| a.spec.name == "model.layers.1.self_attn.k_proj.weight").unwrap();
        let ks = stacked.iter().find(|a| a.spec.name == "model.layers.*.self_attn.k_proj.weight").unwrap();
        assert_eq!(&ks.bytes[k1.bytes.len()..], &k1.bytes[..], "layer 1 follows layer 0");
        let total: usize = host.iter().map(|a| a.bytes.len()).sum();
        assert_eq!(stacked.iter().map(|a| a.bytes.len()).sum::<usize>(), total);
    }

    #[test]
    fn stacking_the_matrices_keeps_each_norm_in_its_place() {
        let c = tiny_config();
        let args = weight_args(&c, WeightFormat::Int4);
        let stacked = stack_weight_args_where(args.clone(), Stacked::Matrices);
        let layers = c.num_hidden_layers;
        let norms_per_layer = 2;
        let per_layer = args.iter().filter(|a| a.name.starts_with("model.layers.0.")).count();
        assert_eq!(stacked.len(), args.len() - (layers - 1) * (per_layer - norms_per_layer));
        // Layer 0's places hold its norms and the stacked matrices; later layers their norms.
        let names: Vec<&str> =
            stacked.iter().map(|a| a.name.as_str()).skip_while(|n| !n.starts_with("model.layers.")).collect();
        let (layer0, after) = (&names[..per_layer], &names[per_layer..per_layer + 2]);
        assert_eq!(layer0[0], "model.layers.0.input_layernorm.weight");
        assert!(layer0[1].starts_with("model.layers.*.self_attn.q_proj."), "{layer0:?}");
        assert_eq!(after, ["model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"]);
        for arg in stacked.iter().filter(|a| a.name.starts_with("model.layers.*.")) {
            assert_ne!(arg.part, WeightPart::Norm, "{}", arg.name);
            assert_eq!(arg.shape[0], layers, "{}", arg.name);
        }
    }

    #[test]
    fn pieces_cover_the_graph_arguments_exactly() {
        let c = tiny_config();
        let f16 = random_weights(&c, 7).unwrap();
        let int4 = f16.quantized(Int4Layout::DEFAULT).unwrap();
        let all_int4 = f16.quantized(Int4Layout::ALL_INT4).unwrap();
        for (weights, format, int4_layout) in [
            (&f16, WeightFormat::F16, Int4Layout::DEFAULT),
            (&int4, WeightFormat::Int4, Int4Layout::DEFAULT),
            (&all_int4, WeightFormat::Int4, Int4Layout::ALL_INT4),
        ] {
            // The IREE kernel dispatches' unrolled layers, which stack the matrices only.
            let dispatches = Some(crate::HostKernels {
                max_tokens: usize::MAX,
                calls: crate::KernelCalls::IreeDispatch,
                activations: crate::KernelActivations::Exact,
            });
            for (layers, host_kernels) in [
                (crate::LayerMode::Unrolled, None),
                (crate::LayerMode::Loop, None),
                (crate::LayerMode::UnrolledCachePerLayer, dispatches),
            ] {
                let options =
                    crate::GraphOptions { layers, int4_layout, host_kernels, ..crate::GraphOptions::new(64, format) };
                let whole = graph_host_args(weights, &options).unwrap();
                let mut assembled: Vec<Vec<u8>> = whole.iter().map(|a| vec![0xAA; a.bytes.len()]).collect();
                let mut covered: Vec<usize> = vec![0; whole.len()];
                for_each_graph_host_arg(weights, &options, &mut |index, offset, piece| {
                    assembled[index][offset..offset + piece.bytes.len()].copy_from_slice(&piece.bytes);
                    covered[index] += piece.bytes.len();
                    Ok(())
                })
                .unwrap();
                for ((arg, bytes), covered) in whole.iter().zip(&assembled).zip(&covered) {
                    assert_eq!(*covered, arg.bytes.len(), "{format} {layers:?} {}", arg.spec.name);
                    assert!(bytes == &arg.bytes, "{format} {layers:?} {}", arg.spec.name);
                }
            }
        }
    }
}
