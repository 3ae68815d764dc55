//! The Llama forward pass as StableHLO functions.
//!
//! One emitter, `forward`, builds every graph: the decode step is the prefill graph with a bucket
//! of one token and no `count` argument. Every function has the signature
//!
//! ```text
//! (tokens i32[T], position i32[], [count i32[]  (prefill only)],
//!  k_cache f16[L, KVH, D, C], v_cache f16[L, KVH, C, D], weights...)
//!   -> (next_token i32[], k_cache, v_cache [, logits f32[vocab]])
//! ```
//!
//! except that the prefill from embeddings ([`GraphKind::PrefillEmbeddings`], for inputs such as
//! an image encoder's output) takes `embeddings f32[T, hidden]` in place of `tokens`, always with
//! `count`, and is otherwise the same function: the rows are the hidden states the token graphs
//! gather from the embedding table. The weight arguments are the same list in every graph, the
//! embedding table included (an embeddings graph reads it only as the tied LM head), so one upload
//! serves all of a module's functions.
//!
//! A batched decode ([`GraphKind::DecodeBatch`]) takes one token and one position per sequence
//! (`tokens i32[B], positions i32[B]`) and each sequence's cache arguments in turn, and returns a
//! token per sequence, the caches in the same order and `logits f32[B, vocab]`: the products run
//! over the B rows at once, attention is each sequence's own (through the kernels as XLA custom
//! calls, one call for all the sequences of a layer: [`ATTENTION_DECODE_BATCH_TARGET`]).
//!
//! Layers are either unrolled (one set of weight arguments per layer, [`LayerMode::Unrolled`]) or
//! one `stablehlo.while` over weights stacked `[L, ...]` ([`LayerMode::Loop`]), which compiles one
//! layer body instead of L; `docs/backends/stablehlo-graphs.md` compares the two. A third form,
//! [`LayerMode::UnrolledCachePerLayer`], unrolls the layers and gives each its own pair of cache
//! arguments (`k_cache_l f16[KVH, D, C], v_cache_l f16[KVH, C, D]` for `l` in `0..L`, in place of
//! the two stacked ones, returned in the same order after the token).

use crate::arguments::{graph_weight_args, MatrixOrder, StorageDtype, WeightArg, WeightPart};
use crate::error::GraphError;
use crate::mlir::{arg, Cmp, Elem, FnArg, FnBuilder, Reduction, Ty, Val};
use llama_model::int4::GROUP_SIZE;
use llama_model::{Int4Layout, LlamaConfig, MatrixFormat};
use session_api::WeightFormat;

/// How the graphs lay out the decoder layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LayerMode {
    /// Every layer written out, with its own weight arguments.
    #[default]
    Unrolled,
    /// One `stablehlo.while` over the layers; per-layer weights are stacked `[layers, ...]`
    /// arguments (see [`crate::stack_weight_args`]) sliced by the loop index.
    Loop,
    /// Every layer written out, each with its own two cache arguments (see the module docs): a
    /// layer writes its new keys and values at `position` first and then attends over its whole
    /// updated cache. Each cache argument then has one in-place update whose result alone is
    /// read, which XLA's copy insertion keeps in place; with the stacked caches it copies both
    /// caches on every step (docs/backends/pjrt.md). Where the kernels attend as XLA custom calls
    /// the layers still write and then read their entries, but through the attention calls, over
    /// two caches stacked over the layers ([`GraphOptions::caches_in_kernels`]).
    UnrolledCachePerLayer,
}

impl LayerMode {
    /// Whether each layer has its own weight arguments (not stacked over the layers).
    pub fn is_unrolled(self) -> bool {
        !matches!(self, LayerMode::Loop)
    }
}

/// The shapes of a graph's cache arguments, in argument (and result) order: `[L, KVH, D, C]` and
/// `[L, KVH, C, D]`, or for [`LayerMode::UnrolledCachePerLayer`] `[KVH, D, C]` and `[KVH, C, D]`
/// for each layer in turn, unless the kernels write the caches
/// ([`GraphOptions::caches_in_kernels`]: stacked).
pub fn cache_arg_shapes(config: &LlamaConfig, options: &GraphOptions) -> Vec<Vec<usize>> {
    let (layers, n_kv, d, c) =
        (config.num_hidden_layers, config.num_key_value_heads, config.head_dim, options.max_context);
    match options.layers {
        LayerMode::UnrolledCachePerLayer if !options.caches_in_kernels() => {
            (0..layers).flat_map(|_| [vec![n_kv, d, c], vec![n_kv, c, d]]).collect()
        }
        _ => vec![vec![layers, n_kv, d, c], vec![layers, n_kv, c, d]],
    }
}

/// What every graph of one model shares. [`GraphOptions::new`] gives the common starting point;
/// a runtime changes the fields it decides with struct update syntax.
#[derive(Debug, Clone, PartialEq)]
pub struct GraphOptions {
    /// Positions of the KV cache (`C`): the longest sequence a session can hold.
    pub max_context: usize,
    /// The weight format the graphs read.
    pub format: WeightFormat,
    /// Which matrices of an int4 model are int4 and which int8 (the model file says; see
    /// `llama_model::weights::int4_file_layout`). Ignored for fp16.
    pub int4_layout: Int4Layout,
    /// Unrolled layers or a loop over them.
    pub layers: LayerMode,
    /// The element type of the fp16 format's matrices (f16, or f32 for runtimes slow at f16).
    pub dense: StorageDtype,
    /// The element type of the KV cache arguments and results.
    pub cache: StorageDtype,
    /// From this many tokens per call on, an int4 or int8 matrix is dequantized to f32 inside the
    /// graph and multiplied in one dot; below it, the per-group form that never forms the matrix.
    /// [`PREFILL_DEQUANTIZE_MIN_TOKENS`] suits IREE; XLA's CPU backend is faster dequantizing
    /// even for one token (docs/backends/pjrt.md).
    pub int4_dequantize_from: usize,
    /// seam's CPU kernels as custom calls for the products of short calls and for decode
    /// attention ([`HostKernels`]), or `None`: every product a StableHLO dot.
    pub host_kernels: Option<HostKernels>,
    /// How the products of one-row calls (decode) are written where no kernel takes them.
    pub vector_products: VectorProducts,
    /// Whether every `dot_general` asks for f32 products (`precision_config` `HIGHEST`): XLA on
    /// an NVIDIA GPU otherwise multiplies f32 operands in TF32, rounding the activations to 10-bit
    /// mantissas in the dots (prefill) and not in the reductions of
    /// [`VectorProducts::Reduce`] (decode), so that the two paths of one backend disagree by more
    /// than summation order.
    pub highest_precision: bool,
}

/// How a graph writes the products of a one-row call (`x [1, K]` times a matrix), where seam's
/// kernels do not take them. A one-row product reads every weight once and does two flops per
/// weight: it is bound by memory, and how fast it runs depends on the kernel the compiler makes of
/// it, which the form of the graph steers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VectorProducts {
    /// `stablehlo.dot_general` (int4 and int8 in the per-group form): the compiler's matrix
    /// product, what IREE's and XLA's CPU backends run best.
    #[default]
    Dot,
    /// An elementwise product with the row broadcast to the matrix, reduced along each weight row
    /// (int4 unpacked and scaled inside the same expression): one reduction over a row-major matrix,
    /// which a GPU compiler can fuse into a single kernel reading the stored weights (packed nibbles
    /// included) once. Dense matrices are then laid out row-major.
    Reduce,
    /// [`VectorProducts::Reduce`] with int4 and int8 matrices read as 32-bit words (eight nibbles,
    /// four bytes) and the codes shifted out of them, where `Reduce` reads them a byte at a time:
    /// a compiler's reduction reads its elements one by one, and byte-wide elements make that a
    /// byte-at-a-time loop.
    ReduceWords,
    /// [`VectorProducts::Reduce`] with int4 matrices read as the compiler's own packed 4-bit type
    /// (the stored bytes bitcast to `ui4`, two per byte), so that it, not the graph, unpacks them
    /// as wide as it can (XLA has packed int4 loads on GPUs); int8 as in `Reduce`.
    ReduceNibbles,
    /// XLA custom calls to seam's CUDA kernels ([`CUDA_ROWS_F16_TARGET`] and the others; the
    /// `cuda-kernels` crate), which read the stored weights (row-major f16, int8 codes, packed
    /// nibbles) once in 16-, 8- and 4-byte loads: for a runtime that registers them for XLA's
    /// CUDA platform. A layer's q, k and v are one call, and its gate and up another, each with the
    /// RMSNorm before them folded in ([`CUDA_NORMED_ROWS_F16_TARGET`] and the others), as is the
    /// LM head with the final norm; o and down are a call each, which adds the residual stream
    /// to its product as it writes it ([`CUDA_RESIDUAL_ROWS_F16_TARGET`] and the others). Dense
    /// matrices are then laid out row-major; matrices held in f32 (`dense=f32`) keep
    /// [`VectorProducts::Reduce`].
    CudaKernels,
    /// [`VectorProducts::CudaKernels`] with one call per product and the norms and residual adds
    /// in the graph: what grouping the products and folding the norms and adds in gain.
    CudaKernelsEach,
}

impl VectorProducts {
    /// Every form, in the order the `vector_products` setting lists them.
    pub const ALL: [VectorProducts; 6] = [
        VectorProducts::Dot,
        VectorProducts::Reduce,
        VectorProducts::ReduceWords,
        VectorProducts::ReduceNibbles,
        VectorProducts::CudaKernels,
        VectorProducts::CudaKernelsEach,
    ];

    /// The form's value in the `vector_products` setting.
    pub fn setting(self) -> &'static str {
        match self {
            VectorProducts::Dot => "dot",
            VectorProducts::Reduce => "reduce",
            VectorProducts::ReduceWords => "reduce-words",
            VectorProducts::ReduceNibbles => "reduce-nibbles",
            VectorProducts::CudaKernels => "cuda-kernels",
            VectorProducts::CudaKernelsEach => "cuda-kernels-each",
        }
    }

    /// Whether decode's products are calls of seam's CUDA kernels.
    pub fn is_cuda_kernels(self) -> bool {
        matches!(self, VectorProducts::CudaKernels | VectorProducts::CudaKernelsEach)
    }
}

/// The XLA custom-call target of one-row products over row-major f16 matrices on an NVIDIA GPU
/// ([`VectorProducts::CudaKernels`]): `(x f32[1, K], w_1 f16[M_1, K], ...) -> (f32[1, M_1], ...)`,
/// one to three matrices over the same row.
pub const CUDA_ROWS_F16_TARGET: &str = "seam_cuda_rows_f16";

/// [`CUDA_ROWS_F16_TARGET`] over int8 matrices, each `q s8[M, K], scales f16[M, K / 32]`: each
/// weight `s q`.
pub const CUDA_ROWS_INT8_TARGET: &str = "seam_cuda_rows_int8";

/// [`CUDA_ROWS_F16_TARGET`] over int4 matrices, each `packed s8[M, K / 2], scales f16[M, K / 32],
/// biases f16[M, K / 32]`: each weight `s q + b`, byte `i` of a group holding input `2i` in its
/// low nibble and `2i + 1` in its high one.
pub const CUDA_ROWS_INT4_TARGET: &str = "seam_cuda_rows_int4";

/// [`CUDA_ROWS_F16_TARGET`] of the row RMS-normalized first: `(x f32[1, K], norm f32[K], eps
/// f32[], matrices...)`, each product `sum_i w[i] x[i] norm[i] / sqrt(mean(x^2) + eps)`.
pub const CUDA_NORMED_ROWS_F16_TARGET: &str = "seam_cuda_normed_rows_f16";

/// [`CUDA_NORMED_ROWS_F16_TARGET`] over int8 matrices.
pub const CUDA_NORMED_ROWS_INT8_TARGET: &str = "seam_cuda_normed_rows_int8";

/// [`CUDA_NORMED_ROWS_F16_TARGET`] over int4 matrices.
pub const CUDA_NORMED_ROWS_INT4_TARGET: &str = "seam_cuda_normed_rows_int4";

/// [`CUDA_ROWS_F16_TARGET`] of one matrix added to a residual: `(x f32[1, K], residual f32[1, M],
/// w f16[M, K]) -> f32[1, M]`, `residual + x w^T` (a layer's o and down, with the residual stream).
pub const CUDA_RESIDUAL_ROWS_F16_TARGET: &str = "seam_cuda_residual_rows_f16";

/// [`CUDA_RESIDUAL_ROWS_F16_TARGET`] over an int8 matrix.
pub const CUDA_RESIDUAL_ROWS_INT8_TARGET: &str = "seam_cuda_residual_rows_int8";

/// [`CUDA_RESIDUAL_ROWS_F16_TARGET`] over an int4 matrix.
pub const CUDA_RESIDUAL_ROWS_INT4_TARGET: &str = "seam_cuda_residual_rows_int4";

/// One call of seam's CUDA kernels in a module this crate wrote: its target (one of
/// [`CUDA_ROWS_F16_TARGET`] and the others), its inputs per row `K` and each matrix's rows `M`
/// (its results' widths), in the order written.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CudaCall {
    /// The call's target.
    pub target: String,
    /// Inputs per row.
    pub k: usize,
    /// Each matrix's rows.
    pub rows: Vec<usize>,
}

/// The calls of seam's CUDA kernels in `module`, text that [`emit_module`] or
/// [`emit_entry_module`] wrote, in the order written: the launches a runtime tunes the kernels
/// for before it runs the module's graphs. Read back from the text, so that what is tuned is what
/// the graphs call.
pub fn cuda_calls(module: &str) -> Vec<CudaCall> {
    let mut calls = Vec::new();
    for line in module.lines() {
        let Some((_, after)) = line.split_once("call_target_name = \"") else { continue };
        let Some((target, signature)) = after.split_once('"') else { continue };
        if !target.starts_with("seam_cuda_") {
            continue;
        }
        // `} : (operand types) -> result type` or `-> (result types)`.
        let Some((operands, results)) = signature.split_once(" : (").and_then(|(_, types)| types.rsplit_once(" -> "))
        else {
            continue;
        };
        let width = |ty: &str| match tensor_dims(ty)[..] {
            [1, n] => Some(n),
            _ => None,
        };
        let k = operands.split(", ").next().and_then(width);
        let rows: Option<Vec<usize>> = results.split(", ").map(width).collect();
        if let (Some(k), Some(rows)) = (k, rows) {
            calls.push(CudaCall { target: target.to_string(), k, rows });
        }
    }
    calls
}

/// The dimensions of a ranked tensor type as this crate writes it (`tensor<1x64xf32>`, within
/// parentheses or not); none for anything else.
fn tensor_dims(ty: &str) -> Vec<usize> {
    let ty = ty.trim().trim_start_matches('(').trim_end_matches(')');
    let Some(inner) = ty.strip_prefix("tensor<").and_then(|t| t.strip_suffix('>')) else { return Vec::new() };
    let mut parts: Vec<&str> = inner.split('x').collect();
    parts.pop(); // the element type
    parts.iter().map(|d| d.parse().ok()).collect::<Option<Vec<usize>>>().unwrap_or_default()
}

/// What a linear kernel call reads before its product (the runtime's kernel computes it, as
/// `cpu_kernels::LinearInput` does): operands first, then the weight's, then the residual's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelInput {
    /// `x f32[T, K]` as it is.
    Rows,
    /// `x f32[T, K], norm f32[K], eps f32[]`: the RMSNorm of each row.
    RmsNorm,
    /// `gate f32[T, K], up f32[T, K]`: `silu(gate) * up`.
    SwiGlu,
    /// `parts f32[T, ATTENTION_DECODE_PARTS * H, 2 + K / H]`: a decode attention's output for
    /// `H` query heads from its parts ([`ATTENTION_DECODE_MANY_TARGET`]), merged.
    AttentionParts,
}

/// What the name of a linear target whose input is a decode attention's parts
/// ([`KernelInput::AttentionParts`]) holds, after its format ([`linear_target`]).
pub(crate) const ATTENTION_PARTS_INPUT: &str = "_attnparts";

/// The custom-call target of a linear layer through seam's kernels: `(input operands
/// ([`KernelInput`]), weight operands, [residual f32[T, M]], rows i32[]) -> f32[T, M]`, the
/// weight operands being `w f16[M, K]` (fp16), `packed i8[M, K/2], scales f16[M, K/32],
/// biases f16[M, K/32]` (int4, ADR 0002) or `codes i8[M, K], scales f16[M, K/32]` (int8, ADR
/// 0013), the residual, when present, added to the product, and
/// `rows` the real rows of a padded call: only those are computed, the rest of the result is
/// zero (a 2-token prompt in the 16-row bucket costs 2 rows of work, not 16).
pub fn linear_target(
    format: MatrixFormat,
    input: KernelInput,
    residual: bool,
    activations: KernelActivations,
    order: MatrixOrder,
) -> String {
    let input = match input {
        KernelInput::Rows => "",
        KernelInput::RmsNorm => "_rmsnorm",
        KernelInput::SwiGlu => "_swiglu",
        KernelInput::AttentionParts => ATTENTION_PARTS_INPUT,
    };
    let residual = if residual { "_residual" } else { "" };
    let activations = match (format, activations) {
        (MatrixFormat::Int4 | MatrixFormat::Int8, KernelActivations::Int8) => "_q8",
        _ => "",
    };
    let panels = match (format, order) {
        (MatrixFormat::Int4 | MatrixFormat::Int8, MatrixOrder::Panels) => "p",
        _ => "",
    };
    format!("seam_linear_{format}{panels}{activations}{input}{residual}")
}

/// Most products one grouped linear call ([`linear_group_target`]) computes: a layer's query,
/// key and value.
pub const MAX_GROUPED_PRODUCTS: usize = 3;

/// The custom-call target of `products` linear layers over one input, in one call (a layer's
/// query, key and value products, or its gate and up products): `(input operands
/// ([`KernelInput::Rows`] or [`KernelInput::RmsNorm`]), the first matrix's weight operands, the
/// second's, ..., [cos f32[T, D], sin f32[T, D]], rows i32[]) -> (f32[T, M_0], f32[T, M_1],
/// ...)`, each matrix as in [`linear_target`] (all of one format, no residual), each result zero
/// from `rows` on. One call instead of one per matrix: each call costs the runtime a fixed amount
/// (an IREE dispatch's record, argument marshalling and workers' barrier; an XLA thunk and its
/// buffers' holds), and the small key and value products split unevenly over the workers on
/// their own.
///
/// With `rope` (three products: a query, key and value), the call takes each row's rope
/// tables (`cos`, `sin`, halves repeated, as the graphs' rope reads them) and turns the first two
/// results' heads of `D` by them: the graphs' rope of the query and key, which would otherwise be
/// a few more operations per layer between the kernels' calls.
pub fn linear_group_target(
    format: MatrixFormat,
    input: KernelInput,
    activations: KernelActivations,
    order: MatrixOrder,
    products: usize,
    rope: bool,
) -> String {
    let rope = if rope { ROPE_SUFFIX } else { "" };
    format!("{}_x{products}{rope}", linear_target(format, input, false, activations, order))
}

/// What ends the name of a grouped linear target that ropes its query and key
/// ([`linear_group_target`]).
pub(crate) const ROPE_SUFFIX: &str = "_rope";

/// One linear target a runtime registers, with what it computes ([`linear_target`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinearTarget {
    /// The custom-call target or executable import name.
    pub name: String,
    /// The weights' format.
    pub format: MatrixFormat,
    /// What the kernel reads before its product.
    pub input: KernelInput,
    /// Whether a residual operand is added to the product.
    pub residual: bool,
    /// How an int4 or int8 product takes its activations (always exact for f16 weights).
    pub activations: KernelActivations,
    /// How an int4 or int8 matrix is ordered (panels where the kernels take every call,
    /// [`GraphOptions::matrix_order`]; row-major otherwise).
    pub order: MatrixOrder,
    /// How many matrices the call multiplies its input by, each with its own result: 1 for
    /// [`linear_target`]'s, 2 to [`MAX_GROUPED_PRODUCTS`] for [`linear_group_target`]'s (whose
    /// input is rows or their RMSNorm, with no residual).
    pub products: usize,
    /// Whether a grouped call turns its first two results (a query and key) by the rope tables
    /// it takes ([`linear_group_target`]).
    pub rope: bool,
}

/// Every linear target a runtime registers.
pub fn linear_targets() -> Vec<LinearTarget> {
    let mut out = Vec::new();
    for (format, activations, order) in [
        (MatrixFormat::F16, KernelActivations::Exact, MatrixOrder::RowMajor),
        (MatrixFormat::Int4, KernelActivations::Exact, MatrixOrder::RowMajor),
        (MatrixFormat::Int4, KernelActivations::Exact, MatrixOrder::Panels),
        (MatrixFormat::Int4, KernelActivations::Int8, MatrixOrder::RowMajor),
        (MatrixFormat::Int4, KernelActivations::Int8, MatrixOrder::Panels),
        (MatrixFormat::Int8, KernelActivations::Exact, MatrixOrder::RowMajor),
        (MatrixFormat::Int8, KernelActivations::Exact, MatrixOrder::Panels),
        (MatrixFormat::Int8, KernelActivations::Int8, MatrixOrder::RowMajor),
        (MatrixFormat::Int8, KernelActivations::Int8, MatrixOrder::Panels),
    ] {
        for input in [KernelInput::Rows, KernelInput::RmsNorm, KernelInput::SwiGlu, KernelInput::AttentionParts] {
            for residual in [false, true] {
                let name = linear_target(format, input, residual, activations, order);
                out.push(LinearTarget { name, format, input, residual, activations, order, products: 1, rope: false });
            }
        }
        for input in [KernelInput::Rows, KernelInput::RmsNorm] {
            for (products, rope) in [(2, false), (3, false), (3, true)] {
                let name = linear_group_target(format, input, activations, order, products, rope);
                out.push(LinearTarget { name, format, input, residual: false, activations, order, products, rope });
            }
        }
    }
    out
}

/// The custom-call target of a run of consecutive positions' causal attention (a prefill chunk
/// whose keys and values are already in the cache): `(q f32[T, H, D], keys f32[KVH, D, C], values
/// f32[KVH, C, D], position i32[], rows i32[]) -> f32[T, H, D]`, row `t` over cache positions
/// `0..=position + t`, rows from `rows` on (padding) zero.
pub const ATTENTION_CAUSAL_TARGET: &str = "seam_attention_causal";

/// The custom-call target of the greedy tokens: `(logits f32[R, V]) -> i32[R]`, the first index
/// of each row's largest value (NaN never the largest; 0 for a row with nothing above -inf).
pub const ARGMAX_TARGET: &str = "seam_argmax";

/// The custom-call target of a batched decode's attention, every sequence in one call that also
/// writes the step's entries: `(q f32[S, H, D], positions i32[S], k f32[S, KVH, D], v f32[S, KVH,
/// D], layer i32[], keys_0 f32[L, KVH, D, C], values_0 f32[L, KVH, C, D], ..., keys_{S-1},
/// values_{S-1}) -> (f32[S, H, D], keys_0, values_0, ...)`: sequence `s`'s new key and value
/// (`k[s]`, `v[s]`, rope applied) go to position `positions[s]` of layer `layer` of its caches
/// (stacked over the layers, [`GraphOptions::caches_in_kernels`]), each cache result the operand
/// updated in place (`output_operand_aliases`), and it attends over positions
/// `0..=positions[s]`. Emitted only where the kernels are XLA custom calls
/// ([`KernelCalls::XlaCustomCall`]); IREE's dispatches take [`ATTENTION_DECODE_MANY_TARGET`],
/// whose caches are per layer.
pub const ATTENTION_DECODE_BATCH_TARGET: &str = "seam_attention_decode_batch";

/// The IREE dispatch target of a decode's attention over per-layer caches, one sequence's or a
/// batch's, up to [`MAX_SEQUENCES_PER_ATTENTION_DISPATCH`] sequences in one dispatch per layer
/// that also writes the step's entries: `(q f32[S, H, D], positions i32[S], k f32[S, KVH, D], v
/// f32[S, KVH, D], keys_0 f32[KVH, D, C], values_0 f32[KVH, C, D], ..., keys_{S-1},
/// values_{S-1}) -> (parts f32[S, ATTENTION_DECODE_PARTS * H, 2 + D], keys_0, values_0, ...)`:
/// sequence `s`'s new key and value (`k[s]`, `v[s]`, rope applied) go to position
/// `positions[s]` of its caches, which are the dispatch's tied operands (updated in place,
/// [`crate::mlir::FnBuilder::dispatch_tied`]), and it attends over positions `0..=positions[s]`
/// in up to [`ATTENTION_DECODE_PARTS`] spans. Its workgroups are each one span of one KV head of
/// one sequence: the span holding the new position writes that head's entries and then reads
/// them. The result is each span's softmax parts (per query head: largest score, sum of
/// exponentials, weighted values; an unused span's sum is zero), which the next product merges
/// ([`KernelInput::AttentionParts`]): a workgroup per KV head left one of two cores idle for
/// a third of the attention with three KV heads, and a merge of its own would cost a dispatch
/// per layer. Emitted where the kernels are IREE dispatches ([`KernelCalls::IreeDispatch`]).
/// The target of a batch of `S` is this name with `_S` ([`attention_decode_many_target`]): its
/// operands' count depends on `S`.
pub const ATTENTION_DECODE_MANY_TARGET: &str = "seam_attention_decode_many";

/// The spans an [`ATTENTION_DECODE_MANY_TARGET`] dispatch splits each KV head's positions into,
/// at most (a short context takes one; `cpu_kernels::DECODE_PARTS`).
pub const ATTENTION_DECODE_PARTS: usize = 2;

/// The IREE dispatch target that writes a prefill chunk's entries into one sequence's per-layer
/// caches, its tied operands (updated in place): `(k f32[T, KVH, D], v f32[T, KVH, D], position
/// i32[], rows i32[], keys f32[KVH, D, C], values f32[KVH, C, D]) -> (keys, values)`, rows
/// `0..rows` (the real ones) at positions `position..`, one workgroup per KV head. The graph's own
/// writes at the chunk's position made the VM read the position back to place them, so IREE
/// recorded the chunk's command buffer on every call (ADR 0035).
pub const WRITE_ENTRIES_TARGET: &str = "seam_write_entries";

/// The [`ATTENTION_DECODE_MANY_TARGET`] of a batch of `sequences`.
pub fn attention_decode_many_target(sequences: usize) -> String {
    format!("{ATTENTION_DECODE_MANY_TARGET}_{sequences}")
}

/// The custom-call target that writes one position's entry into caches stacked over the layers
/// and attends for it ([`GraphOptions::caches_in_kernels`]): `(q f32[H, D], k f32[1, KVH, D],
/// v f32[1, KVH, D], position i32[], layer i32[], keys f32[L, KVH, D, C], values f32[L, KVH, C,
/// D]) -> (f32[H, D], keys, values)`: the new key and value (rope applied) go to `position` of
/// layer `layer`'s caches, each cache result the operand updated in place
/// (`output_operand_aliases`), then the query attends over positions `0..=position` of them.
pub const ATTENTION_DECODE_WRITE_TARGET: &str = "seam_attention_decode_write";

/// The custom-call target that writes a run of consecutive positions' entries into caches
/// stacked over the layers and attends causally for them ([`GraphOptions::caches_in_kernels`]):
/// `(q f32[T, H, D], k f32[T, KVH, D], v f32[T, KVH, D], position i32[], rows i32[], layer
/// i32[], keys f32[L, KVH, D, C], values f32[L, KVH, C, D]) -> (f32[T, H, D], keys, values)`:
/// the first `rows` rows' entries go to positions `position..position + rows` of layer `layer`'s
/// caches (updated in place as [`ATTENTION_DECODE_WRITE_TARGET`]'s), then row `t` attends over
/// positions `0..=position + t` (padding rows zero).
pub const ATTENTION_CAUSAL_WRITE_TARGET: &str = "seam_attention_causal_write";

/// Graphs that call seam's CPU kernels (the `cpu-kernels` crate): as custom calls, for a runtime
/// that registers them under [`linear_targets`] and the attention targets (XLA's CPU plugin
/// through the PJRT FFI extension, ADR 0011; [`GraphOptions::caches_in_kernels`]), or as IREE
/// dispatches of executable imports ([`KernelCalls`]).
///
/// With them, fp16 matrices are laid out row-major ([`crate::DenseLayout::RowMajor`]), the
/// layout the kernels read; calls of more than `max_tokens` rows keep the dots; with per-layer f32
/// caches every call attends through the kernels over the visible positions only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostKernels {
    /// The most rows (tokens) per call that still go through the matrix kernels.
    pub max_tokens: usize,
    /// How the graphs call them.
    pub calls: KernelCalls,
    /// How the int4 and int8 products take their activations.
    pub activations: KernelActivations,
}

/// How the kernels' int4 and int8 products take their activations (`cpu_kernels::Activations`):
/// as they are, or rounded per group of 32 to int8 steps (ADR 0024).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KernelActivations {
    /// f32 activations, the reference's numbers up to summation order.
    #[default]
    Exact,
    /// Activations rounded to int8 per group of 32: faster, further from the reference.
    Int8,
}

/// How a graph calls seam's kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelCalls {
    /// `stablehlo.custom_call` with XLA's typed-FFI convention (`api_version = 4`): the runtime
    /// registers a handler under each target name (XLA's CPU plugin, ADR 0011).
    XlaCustomCall,
    /// IREE: each call is a `flow.dispatch` of a `stream.executable` whose workgroups each call
    /// the target as an executable import for a share of the output rows
    /// ([`crate::mlir::KernelDispatches`]); the runtime provides the imports through an
    /// executable plugin.
    IreeDispatch,
}

impl GraphOptions {
    /// Graphs of `max_context` positions reading `format`: unrolled layers, f16 matrices and KV
    /// cache, int4 dequantized in the graph from [`PREFILL_DEQUANTIZE_MIN_TOKENS`] rows on.
    pub fn new(max_context: usize, format: WeightFormat) -> GraphOptions {
        GraphOptions {
            max_context,
            format,
            int4_layout: Int4Layout::DEFAULT,
            layers: LayerMode::Unrolled,
            dense: StorageDtype::F16,
            cache: StorageDtype::F16,
            int4_dequantize_from: PREFILL_DEQUANTIZE_MIN_TOKENS,
            host_kernels: None,
            vector_products: VectorProducts::Dot,
            highest_precision: false,
        }
    }

    /// The layout of the fp16 format's matrices: row-major for the host kernels and for the
    /// reductions of [`VectorProducts::Reduce`] and `ReduceWords` (each output's weights
    /// contiguous, the reduction's rows), else transposed.
    pub fn dense_layout(&self) -> crate::DenseLayout {
        match (self.host_kernels, self.vector_products) {
            (Some(_), _)
            | (
                None,
                VectorProducts::Reduce
                | VectorProducts::ReduceWords
                | VectorProducts::ReduceNibbles
                | VectorProducts::CudaKernels
                | VectorProducts::CudaKernelsEach,
            ) => crate::DenseLayout::RowMajor,
            (None, VectorProducts::Dot) => crate::DenseLayout::Transposed,
        }
    }

    /// Whether the graphs attend through the kernels (the decodes' and prefills' targets of
    /// [`Self::caches_in_kernels`] on XLA, [`ATTENTION_DECODE_MANY_TARGET`] and
    /// [`ATTENTION_CAUSAL_TARGET`] on IREE), each query reading only the cache positions it may
    /// see: host kernels and per-layer caches (f32 or f16, both of which the kernels read).
    pub fn attention_kernel(&self) -> bool {
        self.host_kernels.is_some() && self.layers == LayerMode::UnrolledCachePerLayer
    }

    /// Whether the caches are stacked over the layers and written only by the attention kernels'
    /// calls ([`ATTENTION_DECODE_WRITE_TARGET`], [`ATTENTION_CAUSAL_WRITE_TARGET`],
    /// [`ATTENTION_DECODE_BATCH_TARGET`]), each call returning the caches it updated in place:
    /// where the kernels attend as XLA custom calls. A sequence then has two cache buffers
    /// instead of two per layer, and PJRT's work per buffer and step (holds, usage events, the
    /// results' buffers) no longer grows with the layers (ADR 0033). IREE's graphs keep a pair of
    /// caches per layer, which a decode's attention dispatch and a prefill chunk's write dispatch
    /// update in place (their tied operands, ADR 0035).
    pub fn caches_in_kernels(&self) -> bool {
        self.attention_kernel() && kernels_are_custom_calls(self)
    }

    /// The layout of the graphs' weight arguments under these options.
    pub fn arg_layout(&self) -> crate::ArgLayout {
        crate::ArgLayout {
            int4: self.int4_layout,
            dense: self.dense,
            dense_layout: self.dense_layout(),
            matrix_order: self.matrix_order(),
        }
    }

    /// Which per-layer weights the graphs take stacked over the layers: all of them in a loop
    /// over the layers (sliced by the loop index); where the kernels are IREE dispatches, the
    /// matrices (each dispatch binds a stacked argument whole and its import reads the layer's
    /// part, ADR 0037), which leaves a call about a fifth of the arguments the VM checks on
    /// every call; else none.
    pub fn stacked_weights(&self) -> crate::Stacked {
        match self.layers {
            LayerMode::Loop => crate::Stacked::All,
            LayerMode::UnrolledCachePerLayer if kernels_are_dispatches(self) => crate::Stacked::Matrices,
            _ => crate::Stacked::None,
        }
    }

    /// How the quantized matrices are ordered (`crate::weight_args_with` says which): in panels
    /// of 16 rows when the kernels take every call (the only products that read that order), else
    /// row-major.
    pub fn matrix_order(&self) -> MatrixOrder {
        match self.host_kernels {
            Some(k) if k.max_tokens == usize::MAX => MatrixOrder::Panels,
            _ => MatrixOrder::RowMajor,
        }
    }

    /// What a padding row of a `bucket`-row prefill call costs: next to nothing where the host
    /// kernels take its products and attention (they compute the call's real rows alone), else
    /// what a real row does.
    pub fn padding_cost(&self, bucket: usize) -> crate::PaddingCost {
        if self.kernel_rows(bucket) {
            crate::PaddingCost::Skipped
        } else {
            crate::PaddingCost::Full
        }
    }

    /// Whether calls of `rows` rows multiply through the host kernels.
    fn kernel_rows(&self, rows: usize) -> bool {
        self.host_kernels.is_some_and(|k| rows <= k.max_tokens)
    }

    /// How calls of `rows` rows write their products where no kernel takes them: the one-row
    /// forms of [`GraphOptions::vector_products`], else dots.
    fn products_for(&self, rows: usize) -> VectorProducts {
        if rows == 1 && !self.kernel_rows(rows) {
            self.vector_products
        } else {
            VectorProducts::Dot
        }
    }
}

/// One function of the module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraphKind {
    /// One token at `position`: `@decode` (or `@decode_logits`).
    Decode,
    /// Up to `bucket` tokens at `position`, padded to `bucket`: `@prefill_{bucket}` (or `_logits`).
    Prefill { bucket: usize },
    /// A prefill that returns the logits of every row, `f32[bucket, vocab]` (padding rows
    /// included), for scoring a text: `@prefill_scored_{bucket}_logits`. Its token is the argmax
    /// of the last real row, as a prefill's.
    PrefillScored { bucket: usize },
    /// Up to `bucket` embedding rows (`f32[bucket, hidden]`, in place of token ids) at `position`,
    /// padded to `bucket` with finite rows (zeros): `@prefill_embeddings_{bucket}` (or `_logits`).
    /// Takes `count` for every bucket, 1 included: there is no embeddings decode graph, so a
    /// caller near the end of the context, where no larger bucket fits, feeds single rows
    /// through bucket 1.
    PrefillEmbeddings { bucket: usize },
    /// One token for each of `batch` sequences, each with its own position and its own caches
    /// (continuous batching): `@decode_batch_{batch}` (or `_logits`). Takes `positions i32[batch]`
    /// in place of `position`, no `count`, and `batch` sets of cache arguments in turn; returns
    /// `next_tokens i32[batch]`, the caches in the same order, and `logits f32[batch, vocab]`.
    /// The products read each weight once for the whole batch; attention is each sequence's own.
    DecodeBatch { batch: usize },
}

impl GraphKind {
    /// Positions one call feeds, padding included: the first dimension of its input argument.
    pub fn input_rows(self) -> usize {
        match self {
            GraphKind::Decode => 1,
            GraphKind::Prefill { bucket }
            | GraphKind::PrefillScored { bucket }
            | GraphKind::PrefillEmbeddings { bucket } => bucket,
            GraphKind::DecodeBatch { batch } => batch,
        }
    }

    /// Rows of the logits result: every row for [`GraphKind::PrefillScored`], else one per
    /// sequence (the last real position's).
    pub fn logit_rows(self) -> usize {
        match self {
            GraphKind::PrefillScored { bucket } => bucket,
            other => other.sequences(),
        }
    }

    /// Sequences one call advances, each with its own caches: the batch of a
    /// [`GraphKind::DecodeBatch`], else one.
    pub fn sequences(self) -> usize {
        match self {
            GraphKind::DecodeBatch { batch } => batch,
            _ => 1,
        }
    }

    /// Whether the first argument is `embeddings f32[input_rows, hidden]` rather than
    /// `tokens i32[input_rows]`.
    pub fn takes_embeddings(self) -> bool {
        matches!(self, GraphKind::PrefillEmbeddings { .. })
    }

    /// Whether the third argument is `count i32[]` (the real rows of a padded call): every kind
    /// but the decodes ([`GraphKind::Decode`], [`GraphKind::DecodeBatch`]).
    pub fn takes_count(self) -> bool {
        !matches!(self, GraphKind::Decode | GraphKind::DecodeBatch { .. })
    }
}

/// A function to emit: its kind, and whether it also returns the last position's logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphSpec {
    pub kind: GraphKind,
    pub logits: bool,
}

impl GraphSpec {
    /// The function's symbol name in the module.
    pub fn name(&self) -> String {
        let base = match self.kind {
            GraphKind::Decode => "decode".to_string(),
            GraphKind::Prefill { bucket } => format!("prefill_{bucket}"),
            GraphKind::PrefillScored { bucket } => format!("prefill_scored_{bucket}"),
            GraphKind::PrefillEmbeddings { bucket } => format!("prefill_embeddings_{bucket}"),
            GraphKind::DecodeBatch { batch } => format!("decode_batch_{batch}"),
        };
        if self.logits {
            format!("{base}_logits")
        } else {
            base
        }
    }

    /// Rows (positions) per call: [`GraphKind::input_rows`].
    fn tokens(&self) -> usize {
        self.kind.input_rows()
    }
}

/// The most sequences one [`GraphKind::DecodeBatch`] graph advances: beyond it the products are
/// matrix-matrix work, which a batch this size already amortizes the weight reads of.
pub const MAX_DECODE_BATCH: usize = 64;

/// Checks that `options` and `specs` fit `config`.
fn check(config: &LlamaConfig, options: &GraphOptions, specs: &[GraphSpec]) -> Result<(), GraphError> {
    config.validate().map_err(GraphError::Config)?;
    if options.max_context == 0 {
        return Err(GraphError::Options("max_context must be at least 1".into()));
    }
    if options.max_context > config.max_position_embeddings {
        return Err(GraphError::Options(format!(
            "max_context {} exceeds the model's max_position_embeddings {}",
            options.max_context, config.max_position_embeddings
        )));
    }
    // Positions reach the graph as i32 and, for rope, as f32: both exact below 2^24.
    if options.max_context > 1 << 24 {
        return Err(GraphError::Options(format!("max_context {} is above 2^24", options.max_context)));
    }
    if options.format == WeightFormat::Int4 {
        for (what, n) in [
            ("hidden_size", config.hidden_size),
            ("intermediate_size", config.intermediate_size),
            ("q_dim", config.q_dim()),
        ] {
            if n % GROUP_SIZE != 0 {
                return Err(GraphError::Options(format!("int4 needs {what} ({n}) to be a multiple of {GROUP_SIZE}")));
            }
        }
    }
    for spec in specs {
        if let GraphKind::Prefill { bucket }
        | GraphKind::PrefillScored { bucket }
        | GraphKind::PrefillEmbeddings { bucket } = spec.kind
        {
            if bucket == 0 || bucket > options.max_context {
                return Err(GraphError::Options(format!(
                    "prefill bucket {bucket} must be in 1..={}",
                    options.max_context
                )));
            }
        }
        if matches!(spec.kind, GraphKind::PrefillScored { .. }) && !spec.logits {
            return Err(GraphError::Options(format!("{} returns its logits: it needs logits set", spec.name())));
        }
        if let GraphKind::DecodeBatch { batch } = spec.kind {
            if !(2..=MAX_DECODE_BATCH).contains(&batch) {
                return Err(GraphError::Options(format!("decode batch {batch} must be in 2..={MAX_DECODE_BATCH}")));
            }
        }
    }
    let mut names: Vec<String> = specs.iter().map(GraphSpec::name).collect();
    names.sort();
    names.dedup();
    if names.len() != specs.len() {
        return Err(GraphError::Options("the same function was asked for twice".into()));
    }
    Ok(())
}

/// The whole module: one `func.func` per spec, in the order given.
pub fn emit_module(config: &LlamaConfig, options: &GraphOptions, specs: &[GraphSpec]) -> Result<String, GraphError> {
    check(config, options, specs)?;
    let mut out = String::new();
    out.push_str("// Generated by seam's stablehlo-llama. Argument order: docs/backends/stablehlo-graphs.md\n");
    out.push_str("module @seam_llama {\n");
    let mut dispatches = crate::mlir::KernelDispatches::default();
    for spec in specs {
        out.push_str(&forward(config, options, *spec, &spec.name(), &mut dispatches));
    }
    out.push_str(&dispatches.executable());
    out.push_str("}\n");
    Ok(out)
}

/// A module holding one function, `spec`, named `main`: the form XLA's PJRT plugins compile (one
/// executable per module, entered through `@main`).
pub fn emit_entry_module(config: &LlamaConfig, options: &GraphOptions, spec: GraphSpec) -> Result<String, GraphError> {
    check(config, options, &[spec])?;
    let mut out = String::new();
    out.push_str(&format!(
        "// Generated by seam's stablehlo-llama: `{}` as @main. Argument order: docs/backends/stablehlo-graphs.md\n",
        spec.name()
    ));
    out.push_str("module @seam_llama {\n");
    let mut dispatches = crate::mlir::KernelDispatches::default();
    out.push_str(&forward(config, options, spec, "main", &mut dispatches));
    out.push_str(&dispatches.executable());
    out.push_str("}\n");
    Ok(out)
}

/// A weight argument of the function being built, by position in [`weight_args`].
struct Weights {
    vals: Vec<Val>,
    specs: Vec<WeightArg>,
    next: usize,
    /// The layer whose part of the stacked matrix arguments (`model.layers.*.…`) among `vals`
    /// this layer's products read ([`crate::Stacked::Matrices`]).
    layer: Option<usize>,
    /// [`GraphOptions::int4_dequantize_from`].
    dequantize_from: usize,
    /// Whether this function's products go through the host kernels.
    kernels: bool,
    /// How the kernels' int4 and int8 products take their activations.
    activations: KernelActivations,
    /// How this function's products are written where no kernel takes them.
    products: VectorProducts,
}

/// A matrix as the graph sees it.
enum MatrixArg {
    Dense {
        w: Val,
        transposed: bool,
        kernel: bool,
        products: VectorProducts,
        /// The layer whose part of a stacked `w` (`[layers, ...]`) the kernel reads.
        layer: Option<usize>,
    },
    Int4 {
        packed: Val,
        scales: Val,
        biases: Val,
        dequantize_from: usize,
        kernel: bool,
        activations: KernelActivations,
        order: MatrixOrder,
        products: VectorProducts,
        /// The layer whose part of stacked operands (`[layers, ...]`) the kernel reads.
        layer: Option<usize>,
    },
    Int8 {
        codes: Val,
        scales: Val,
        dequantize_from: usize,
        kernel: bool,
        activations: KernelActivations,
        order: MatrixOrder,
        products: VectorProducts,
        /// The layer whose part of stacked operands (`[layers, ...]`) the kernel reads.
        layer: Option<usize>,
    },
}

impl Weights {
    /// Other arguments (one layer's) read with this function's settings.
    fn sharing_settings(&self, vals: Vec<Val>, specs: Vec<WeightArg>, layer: Option<usize>) -> Weights {
        Weights {
            vals,
            specs,
            next: 0,
            layer,
            dequantize_from: self.dequantize_from,
            kernels: self.kernels,
            activations: self.activations,
            products: self.products,
        }
    }

    fn norm(&mut self) -> Val {
        let v = self.vals[self.next].clone();
        debug_assert_eq!(self.specs[self.next].part, WeightPart::Norm);
        self.next += 1;
        v
    }

    fn matrix(&mut self) -> MatrixArg {
        let i = self.next;
        let layer = self.layer.filter(|_| self.specs[i].is_stacked());
        match self.specs[i].part {
            WeightPart::DenseRowMajor | WeightPart::DenseTransposed => {
                self.next += 1;
                MatrixArg::Dense {
                    w: self.vals[i].clone(),
                    transposed: self.specs[i].part == WeightPart::DenseTransposed,
                    // The kernel reads f16; matrices held in f32 (`dense=f32`) keep the dot.
                    kernel: self.kernels && self.specs[i].dtype == crate::ArgDtype::F16,
                    products: self.products,
                    layer,
                }
            }
            WeightPart::Int4Packed(order) => {
                self.next += 3;
                MatrixArg::Int4 {
                    packed: self.vals[i].clone(),
                    scales: self.vals[i + 1].clone(),
                    biases: self.vals[i + 2].clone(),
                    dequantize_from: self.dequantize_from,
                    kernel: self.kernels,
                    activations: self.activations,
                    order,
                    products: self.products,
                    layer,
                }
            }
            WeightPart::Int8Codes(order) => {
                self.next += 2;
                MatrixArg::Int8 {
                    codes: self.vals[i].clone(),
                    scales: self.vals[i + 1].clone(),
                    dequantize_from: self.dequantize_from,
                    kernel: self.kernels,
                    activations: self.activations,
                    order,
                    products: self.products,
                    layer,
                }
            }
            other => unreachable!("argument order of weight_args: {other:?} where a matrix starts"),
        }
    }
}

/// IREE's [`GraphOptions::int4_dequantize_from`]: from this many tokens on, an int4 matrix is
/// dequantized to f32 inside the graph and multiplied in one matmul (prefill); below it (decode),
/// the per-group form that never forms the matrix. Measured on SmolLM2 with IREE 3.13: see
/// docs/backends/iree.md.
pub const PREFILL_DEQUANTIZE_MIN_TOKENS: usize = 8;

/// `y = x W^T` for `x` f32 `[T, K]` and a weight of Hugging Face shape `[M, K]`: f32 `[T, M]`.
fn linear(b: &mut FnBuilder, x: &Val, w: &MatrixArg) -> Val {
    assert!(w.is_kernel() || w.layer().is_none(), "a stacked matrix is only read by the kernels");
    match w {
        MatrixArg::Dense { kernel: true, .. }
        | MatrixArg::Int4 { kernel: true, .. }
        | MatrixArg::Int8 { kernel: true, .. } => kernel_linear(b, None, &[x], KernelInput::Rows, w, None),
        _ if w.products().is_cuda_kernels() && cuda_kernel_takes(w) => cuda_products(b, x, None, &[w]).remove(0),
        MatrixArg::Dense { products, .. } | MatrixArg::Int4 { products, .. } | MatrixArg::Int8 { products, .. }
            if *products != VectorProducts::Dot =>
        {
            reduced_linear(b, x, w, *products)
        }
        MatrixArg::Int8 { codes, scales, dequantize_from, order, .. } if x.dims()[0] >= *dequantize_from => {
            row_major_only(*order);
            // Many tokens: the f32 matrix (scale * q, exactly the format's values) once, and one
            // dot over it, as for int4 below.
            let w = int8_values(b, codes, scales);
            b.dot_general(x, &w, (&[], &[]), (&[1], &[1]))
        }
        MatrixArg::Int8 { codes, scales, order, .. } => {
            row_major_only(*order);
            // Per group g of 32 inputs: y_m = sum_g s_mg (x_g . q_mg), the int4 form without the
            // bias. The dequantized matrix is never formed: in the form above IREE writes all of
            // it (the tied LM head: vocab x hidden f32) to fresh memory on every call.
            let (t, k) = (x.dims()[0], x.dims()[1]);
            let m = codes.dims()[0];
            let g = k / GROUP_SIZE;
            let q = b.reshape(codes, &[m, g, GROUP_SIZE]);
            let q = b.convert(&q, Elem::F32);
            let xg = b.reshape(x, &[t, g, GROUP_SIZE]);
            let dots = b.dot_general(&xg, &q, (&[1], &[1]), (&[2], &[2])); // [g, T, M]
            scaled_group_sum(b, &dots, scales)
        }
        MatrixArg::Dense { w, transposed, .. } => {
            let w = b.convert(w, Elem::F32);
            if *transposed {
                // [K, M]: contract x's columns with the weight's rows.
                b.dot_general(x, &w, (&[], &[]), (&[1], &[0]))
            } else {
                b.dot_general(x, &w, (&[], &[]), (&[1], &[1]))
            }
        }
        MatrixArg::Int4 { packed, scales, biases, dequantize_from, order, .. } if x.dims()[0] >= *dequantize_from => {
            row_major_only(*order);
            // Many tokens: form the f32 matrix once (scale * q + bias, exactly the format's values)
            // and run one matmul; the dequantization is amortized over the tokens, while the
            // per-group form below runs a batched dot of inner length 16 per group and token.
            let (t, k) = (x.dims()[0], x.dims()[1]);
            let m = packed.dims()[0];
            let g = k / GROUP_SIZE;
            let half = GROUP_SIZE / 2;
            let p = b.reshape(packed, &[m, g, half, 1]);
            let mask = b.const_int(15, Elem::I8, &[m, g, half, 1]);
            let four = b.const_int(4, Elem::I8, &[m, g, half, 1]);
            let lo = b.and(&p, &mask); // element 2i of the group
            let hi = b.shift_right_logical(&p, &four); // element 2i + 1
            let q = b.concatenate(&[&lo, &hi], 3); // [M, g, 16, 2]
            let q = b.reshape(&q, &[m, g, GROUP_SIZE]);
            let q = b.convert(&q, Elem::F32);
            let s = b.convert(scales, Elem::F32);
            let s = b.broadcast(&s, &[m, g, GROUP_SIZE], &[0, 1]);
            let bias = b.convert(biases, Elem::F32);
            let bias = b.broadcast(&bias, &[m, g, GROUP_SIZE], &[0, 1]);
            let w = b.mul(&s, &q);
            let w = b.add(&w, &bias);
            let w = b.reshape(&w, &[m, k]);
            debug_assert_eq!(t, x.dims()[0]);
            b.dot_general(x, &w, (&[], &[]), (&[1], &[1]))
        }
        MatrixArg::Int4 { packed, scales, biases, order, .. } => {
            row_major_only(*order);
            // Per group g of 32 inputs: y_m = sum_g s_mg (x_g . q_mg) + b_mg sum(x_g). The
            // dequantized matrix is never formed (FACTS.md: 10x faster on IREE than dequantize-then-dot
            // for one token).
            let (t, k) = (x.dims()[0], x.dims()[1]);
            let m = packed.dims()[0];
            let g = k / GROUP_SIZE;
            let p = b.reshape(packed, &[m, g, GROUP_SIZE / 2]);
            let mask = b.const_int(15, Elem::I8, &[m, g, GROUP_SIZE / 2]);
            let four = b.const_int(4, Elem::I8, &[m, g, GROUP_SIZE / 2]);
            let lo = b.and(&p, &mask); // inputs 2i of each group
            let hi = b.shift_right_logical(&p, &four); // inputs 2i + 1
            let lo = b.convert(&lo, Elem::F32);
            let hi = b.convert(&hi, Elem::F32);
            // x split the same way: [T, g, 16, 2] -> even and odd inputs, [T, g, 16] each. Two
            // dots instead of one over concatenated nibbles: measured 1.8x faster on IREE 3.13
            // (no [M, g, 32] temporary), see docs/backends/stablehlo-graphs.md.
            let xg = b.reshape(x, &[t, g, GROUP_SIZE / 2, 2]);
            let x_even = b.slice(&xg, &[0, 0, 0, 0], &[t, g, GROUP_SIZE / 2, 1]);
            let x_even = b.reshape(&x_even, &[t, g, GROUP_SIZE / 2]);
            let x_odd = b.slice(&xg, &[0, 0, 0, 1], &[t, g, GROUP_SIZE / 2, 2]);
            let x_odd = b.reshape(&x_odd, &[t, g, GROUP_SIZE / 2]);
            let d_even = b.dot_general(&x_even, &lo, (&[1], &[1]), (&[2], &[2])); // [g, T, M]
            let d_odd = b.dot_general(&x_odd, &hi, (&[1], &[1]), (&[2], &[2]));
            let dots = b.add(&d_even, &d_odd);
            let y = scaled_group_sum(b, &dots, scales);
            let x32 = b.reshape(x, &[t, g, GROUP_SIZE]);
            let xsum = b.reduce(&x32, &[2], Reduction::Sum); // [T, g]
            let bias = b.convert(biases, Elem::F32); // [M, g]
            let offset = b.dot_general(&xsum, &bias, (&[], &[]), (&[1], &[1])); // [T, M]
            b.add(&y, &offset)
        }
    }
}

/// [`linear`] of one row as [`VectorProducts::Reduce`] writes it: `y_m = sum_k w_mk x_k` as an
/// elementwise product over the matrix's own shape, reduced over its inputs. int4 is unpacked in
/// the expression (`s (x_even lo + x_odd hi) + b (x_even + x_odd)` per packed byte) and int8 scaled
/// in it, so the one fused reduction reads the stored bytes; with [`VectorProducts::ReduceWords`]
/// they are read as 32-bit words and the codes shifted out, with [`VectorProducts::ReduceNibbles`]
/// int4 is bitcast to the compiler's packed 4-bit type.
fn reduced_linear(b: &mut FnBuilder, x: &Val, w: &MatrixArg, form: VectorProducts) -> Val {
    let words = form == VectorProducts::ReduceWords;
    let k = x.dims()[1];
    debug_assert_eq!(x.dims()[0], 1, "reductions are for one-row calls");
    let g = k / GROUP_SIZE;
    let sum = match w {
        MatrixArg::Dense { w, transposed: false, .. } => {
            let w = b.convert(w, Elem::F32);
            let row = b.reshape(x, &[k]);
            let xb = b.broadcast(&row, w.dims(), &[1]);
            let products = b.mul(&w, &xb);
            b.reduce(&products, &[1], Reduction::Sum)
        }
        MatrixArg::Dense { transposed: true, .. } => {
            unreachable!("GraphOptions::dense_layout lays dense matrices out row-major for reductions")
        }
        MatrixArg::Int4 { packed, scales, biases, order, .. } if words || form == VectorProducts::ReduceNibbles => {
            row_major_only(*order);
            let m = packed.dims()[0];
            let (q, shape) = if words {
                // Word i of a group holds its inputs 8i..8i+8, nibble j (bits 4j..4j+4) input 8i + j.
                let shape = [m, g, GROUP_SIZE / 8, 8];
                let bytes = b.reshape(packed, &[m, g, GROUP_SIZE / 8, 4]);
                let (w, nibble) = word_lanes(b, &bytes, &shape);
                let four = b.const_int(4, Elem::I32, &shape);
                let shift = b.mul(&nibble, &four);
                let mask = b.const_int(15, Elem::I32, &shape);
                let q = b.shift_right_logical(&w, &shift);
                (b.and(&q, &mask), shape)
            } else {
                // Byte i of a group holds inputs 2i (low nibble) and 2i + 1: the bitcast's order.
                let shape = [m, g, GROUP_SIZE / 2, 2];
                let bytes = b.reshape(packed, &shape[..3]);
                (b.bytes_as_nibbles(&bytes), shape)
            };
            let q = b.convert(&q, Elem::F32);
            let (xb, s) = group_operands(b, x, scales, &shape);
            let bias = per_group(b, biases, &shape);
            // s q x + b x: the bias term summed over the group is b sum(x_g), as in `linear`.
            let qx = b.mul(&q, &xb);
            let scaled = b.mul(&s, &qx);
            let offset = b.mul(&bias, &xb);
            let terms = b.add(&scaled, &offset);
            b.reduce(&terms, &[1, 2, 3], Reduction::Sum)
        }
        MatrixArg::Int8 { codes, scales, order, .. } if words => {
            row_major_only(*order);
            // Word i of a group holds its inputs 4i..4i+4, byte j input 4i + j, sign-extended by
            // shifting it to the top and back.
            let m = codes.dims()[0];
            let shape = [m, g, GROUP_SIZE / 4, 4];
            let bytes = b.reshape(codes, &shape);
            let (w, byte) = word_lanes(b, &bytes, &shape);
            let eight = b.const_int(8, Elem::I32, &shape);
            let low = b.mul(&byte, &eight);
            let top = b.const_int(24, Elem::I32, &shape);
            let up = b.sub(&top, &low);
            let q = b.shift_left(&w, &up);
            let q = b.shift_right_arithmetic(&q, &top);
            let q = b.convert(&q, Elem::F32);
            let (xb, s) = group_operands(b, x, scales, &shape);
            let qx = b.mul(&q, &xb);
            let scaled = b.mul(&s, &qx);
            b.reduce(&scaled, &[1, 2, 3], Reduction::Sum)
        }
        MatrixArg::Int4 { packed, scales, biases, order, .. } => {
            row_major_only(*order);
            let m = packed.dims()[0];
            let half = GROUP_SIZE / 2;
            let shape = [m, g, half];
            let p = b.reshape(packed, &shape);
            let mask = b.const_int(15, Elem::I8, &shape);
            let four = b.const_int(4, Elem::I8, &shape);
            let lo = b.and(&p, &mask); // input 2i of the group
            let hi = b.shift_right_logical(&p, &four); // input 2i + 1
            let lo = b.convert(&lo, Elem::F32);
            let hi = b.convert(&hi, Elem::F32);
            let xg = b.reshape(x, &[g, half, 2]);
            let even = b.slice(&xg, &[0, 0, 0], &[g, half, 1]);
            let even = b.reshape(&even, &[g, half]);
            let odd = b.slice(&xg, &[0, 0, 1], &[g, half, 2]);
            let odd = b.reshape(&odd, &[g, half]);
            let even = b.broadcast(&even, &shape, &[1, 2]);
            let odd = b.broadcast(&odd, &shape, &[1, 2]);
            let s = per_group(b, scales, &shape);
            let bias = per_group(b, biases, &shape);
            let lo_x = b.mul(&lo, &even);
            let hi_x = b.mul(&hi, &odd);
            let codes = b.add(&lo_x, &hi_x);
            let scaled = b.mul(&s, &codes);
            let pair = b.add(&even, &odd);
            let offset = b.mul(&bias, &pair);
            let terms = b.add(&scaled, &offset);
            b.reduce(&terms, &[1, 2], Reduction::Sum)
        }
        MatrixArg::Int8 { codes, scales, order, .. } => {
            row_major_only(*order);
            let m = codes.dims()[0];
            let shape = [m, g, GROUP_SIZE];
            let q = b.reshape(codes, &shape);
            let q = b.convert(&q, Elem::F32);
            let (xb, s) = group_operands(b, x, scales, &shape);
            let products = b.mul(&q, &xb);
            let scaled = b.mul(&s, &products);
            b.reduce(&scaled, &[1, 2], Reduction::Sum)
        }
    };
    let m = sum.dims()[0];
    b.reshape(&sum, &[1, m])
}

/// Whether seam's CUDA kernels take `w`'s one-row products: every format as stored, except a
/// dense matrix held in f32.
fn cuda_kernel_takes(w: &MatrixArg) -> bool {
    match w {
        MatrixArg::Dense { w, transposed, .. } => w.elem() == Elem::F16 && !transposed,
        MatrixArg::Int4 { order, .. } | MatrixArg::Int8 { order, .. } => *order == MatrixOrder::RowMajor,
    }
}

/// Whether the products of `ws` over one row go to seam's CUDA kernels as one call with the norm
/// before them folded in ([`VectorProducts::CudaKernels`]): each matrix taken by the kernels, all
/// of one format.
fn cuda_group(ws: &[&MatrixArg]) -> bool {
    ws.iter().all(|w| w.products() == VectorProducts::CudaKernels && cuda_kernel_takes(w) && w.layer().is_none())
        && ws.windows(2).all(|pair| std::mem::discriminant(pair[0]) == std::mem::discriminant(pair[1]))
}

/// `residual + a w^T`: one call of seam's CUDA kernels that adds the residual as it writes, where
/// `w`'s products take them grouped ([`cuda_group`]); else the product, then the add.
fn residual_linear(b: &mut FnBuilder, residual: &Val, a: &Val, w: &MatrixArg) -> Val {
    if cuda_group(&[w]) {
        return cuda_residual_product(b, a, residual, w);
    }
    let product = linear(b, a, w);
    b.add(residual, &product)
}

/// The products of one row `x` (`[1, K]`) with each of `ws` (one format, at most three) as one
/// call of seam's CUDA kernels, the row first RMS-normalized by `norm` (the weight and epsilon)
/// if given: `f32[1, M]` per matrix.
fn cuda_products(b: &mut FnBuilder, x: &Val, norm: Option<(&Val, f32)>, ws: &[&MatrixArg]) -> Vec<Val> {
    cuda_call(b, x, norm, None, ws)
}

/// `residual + x w^T` for one row `x` (`[1, K]`) and the residual stream's row (`[1, M]`), as one
/// call of seam's CUDA kernels that adds the residual as it writes the product.
fn cuda_residual_product(b: &mut FnBuilder, x: &Val, residual: &Val, w: &MatrixArg) -> Val {
    cuda_call(b, x, None, Some(residual), &[w]).remove(0)
}

/// A call of seam's CUDA kernels: [`cuda_products`], or with a residual (one matrix, no norm)
/// [`cuda_residual_product`].
fn cuda_call(
    b: &mut FnBuilder,
    x: &Val,
    norm: Option<(&Val, f32)>,
    residual: Option<&Val>,
    ws: &[&MatrixArg],
) -> Vec<Val> {
    debug_assert_eq!(x.dims()[0], 1, "the CUDA kernels are for one-row calls");
    debug_assert!((1..=3).contains(&ws.len()), "a launch of the CUDA kernels takes one to three matrices");
    debug_assert!(residual.is_none() || (norm.is_none() && ws.len() == 1), "a residual is added to one product");
    let eps = norm.map(|(_, eps)| b.const_f32(eps, &[]));
    let mut operands: Vec<&Val> = vec![x];
    if let (Some((weight, _)), Some(eps)) = (norm, &eps) {
        operands.extend([weight, eps]);
    }
    operands.extend(residual);
    let mut tys = Vec::with_capacity(ws.len());
    for w in ws {
        let arrays: Vec<&Val> = match w {
            MatrixArg::Dense { w, .. } => vec![w],
            MatrixArg::Int8 { codes, scales, .. } => vec![codes, scales],
            MatrixArg::Int4 { packed, scales, biases, .. } => vec![packed, scales, biases],
        };
        tys.push(Ty::new(&[1, arrays[0].dims()[0]], Elem::F32));
        operands.extend(arrays);
    }
    let target = match (ws[0], norm.is_some(), residual.is_some()) {
        (MatrixArg::Dense { .. }, _, true) => CUDA_RESIDUAL_ROWS_F16_TARGET,
        (MatrixArg::Int8 { .. }, _, true) => CUDA_RESIDUAL_ROWS_INT8_TARGET,
        (MatrixArg::Int4 { .. }, _, true) => CUDA_RESIDUAL_ROWS_INT4_TARGET,
        (MatrixArg::Dense { .. }, false, false) => CUDA_ROWS_F16_TARGET,
        (MatrixArg::Int8 { .. }, false, false) => CUDA_ROWS_INT8_TARGET,
        (MatrixArg::Int4 { .. }, false, false) => CUDA_ROWS_INT4_TARGET,
        (MatrixArg::Dense { .. }, true, false) => CUDA_NORMED_ROWS_F16_TARGET,
        (MatrixArg::Int8 { .. }, true, false) => CUDA_NORMED_ROWS_INT8_TARGET,
        (MatrixArg::Int4 { .. }, true, false) => CUDA_NORMED_ROWS_INT4_TARGET,
    };
    match &tys[..] {
        [one] => vec![b.custom_call(target, &operands, one.clone())],
        _ => b.custom_call_aliased(target, &operands, &tys, &[]),
    }
}

/// `bytes` (`[M, g, n, 4]` i8) as one 32-bit word per four bytes, broadcast over the codes of a
/// word (`shape`, `[M, g, n, codes]`), and each code's index in its word.
fn word_lanes(b: &mut FnBuilder, bytes: &Val, shape: &[usize]) -> (Val, Val) {
    let words = b.bytes_as_words(bytes);
    let words = b.broadcast(&words, shape, &[0, 1, 2]);
    (words, b.iota(shape, 3))
}

/// The one row `x` (`[1, K]`) and a group-wise `scales` (`[M, g]`) broadcast to a reduction's
/// `shape` (`[M, g, ...]`, the trailing dimensions splitting a group in input order).
fn group_operands(b: &mut FnBuilder, x: &Val, scales: &Val, shape: &[usize]) -> (Val, Val) {
    let inputs = b.reshape(x, &shape[1..]);
    let inputs = b.broadcast(&inputs, shape, &(1..shape.len()).collect::<Vec<_>>());
    (inputs, per_group(b, scales, shape))
}

/// A group-wise f16 parameter (`[M, g]`: scales, biases) in f32, broadcast over a reduction's
/// `shape` (`[M, g, ...]`).
fn per_group(b: &mut FnBuilder, values: &Val, shape: &[usize]) -> Val {
    let values = b.convert(values, Elem::F32);
    b.broadcast(&values, shape, &[0, 1])
}

/// `sum_g s_mg dots[g, t, m]`: per-group dot products (`[g, T, M]`) scaled by each group's f16
/// scale (`scales` `[M, g]`) and summed over the groups, `[T, M]`: the end of the int4 and int8
/// per-group products.
fn scaled_group_sum(b: &mut FnBuilder, dots: &Val, scales: &Val) -> Val {
    let s = b.convert(scales, Elem::F32);
    let s = b.broadcast(&s, dots.dims(), &[2, 0]);
    let scaled = b.mul(dots, &s);
    b.reduce(&scaled, &[0], Reduction::Sum)
}

/// A linear layer through the runtime's kernel ([`linear_target`]): `inputs` are the operands
/// of `input` (`[x]`, `[x, norm, eps]` or `[gate, up]`), `residual` is added to the product,
/// `rows` are the real rows among the inputs' (all of them when `None`).
fn kernel_linear(
    b: &mut FnBuilder,
    rows: Option<&Val>,
    inputs: &[&Val],
    input: KernelInput,
    w: &MatrixArg,
    residual: Option<&Val>,
) -> Val {
    let t = inputs[0].dims()[0];
    let KernelWeights { format, activations, order, mut operands, offsets: weight_offsets, rows: m } =
        KernelWeights::of(w);
    let all_rows = rows.is_none().then(|| b.const_int(t as i64, Elem::I32, &[]));
    let mut offsets = vec![0; inputs.len()];
    offsets.extend(weight_offsets);
    let layer = w.layer();
    let mut all: Vec<&Val> = inputs.to_vec();
    all.append(&mut operands);
    all.extend(residual);
    all.extend(rows.or(all_rows.as_ref()));
    let target = linear_target(format, input, residual.is_some(), activations, order);
    let ty = Ty::new(&[t, m], Elem::F32);
    match layer {
        Some(_) => b.custom_call_at(&target, &all, &offsets, ty),
        None => b.custom_call(&target, &all, ty),
    }
}

/// A matrix's operands as the linear kernels take them.
struct KernelWeights<'a> {
    format: MatrixFormat,
    activations: KernelActivations,
    order: MatrixOrder,
    operands: Vec<&'a Val>,
    /// Where the import reads each operand from, in elements: a stacked matrix's operands are
    /// `[layers, rows, ...]`, of which the import reads this layer's part.
    offsets: Vec<usize>,
    /// The matrix's rows (the product's columns).
    rows: usize,
}

impl<'a> KernelWeights<'a> {
    fn of(w: &'a MatrixArg) -> KernelWeights<'a> {
        let (format, activations, order, operands) = match w {
            MatrixArg::Dense { w, transposed: false, .. } => {
                (MatrixFormat::F16, KernelActivations::Exact, MatrixOrder::RowMajor, vec![w])
            }
            MatrixArg::Int4 { packed, scales, biases, activations, order, .. } => {
                (MatrixFormat::Int4, *activations, *order, vec![packed, scales, biases])
            }
            MatrixArg::Int8 { codes, scales, activations, order, .. } => {
                (MatrixFormat::Int8, *activations, *order, vec![codes, scales])
            }
            MatrixArg::Dense { transposed: true, .. } => unreachable!("the kernels read row-major matrices"),
        };
        let layer = w.layer();
        let rows = operands[0].dims()[usize::from(layer.is_some())];
        let offsets =
            operands.iter().map(|o| layer.map_or(0, |l| l * o.dims()[1..].iter().product::<usize>())).collect();
        KernelWeights { format, activations, order, operands, offsets, rows }
    }
}

/// Whether the products of one input ([`KernelInput::Rows`] or [`KernelInput::RmsNorm`]) with
/// each of `ws` can be one call of [`linear_group_target`]: two or three matrices, all through
/// the kernels, of one format, activations, order and stacking, each of whole panels' rows (a
/// workgroup's share of the results may then start in any of them).
fn kernel_group(input: KernelInput, ws: &[&MatrixArg]) -> bool {
    let key = |w: &MatrixArg| {
        let k = KernelWeights::of(w);
        (k.format, k.activations, k.order, w.layer().is_some())
    };
    (2..=MAX_GROUPED_PRODUCTS).contains(&ws.len())
        && matches!(input, KernelInput::Rows | KernelInput::RmsNorm)
        && ws.iter().all(|w| w.is_kernel() && KernelWeights::of(w).rows.is_multiple_of(crate::mlir::SHARE_ROWS))
        && ws.windows(2).all(|pair| key(pair[0]) == key(pair[1]))
}

/// The products of `inputs` (as [`kernel_linear`] takes them) with each of `ws`: one call of
/// [`linear_group_target`] where [`kernel_group`] allows, else one call each. With `rope` (the
/// rope tables `cos`, `sin`, `[T, D]`) and three matrices, the call ropes the first two products
/// (a query and key); the second value says whether it did (else the caller ropes them).
fn kernel_linears(
    b: &mut FnBuilder,
    rows: Option<&Val>,
    inputs: &[&Val],
    input: KernelInput,
    ws: &[&MatrixArg],
    rope: Option<(&Val, &Val)>,
) -> (Vec<Val>, bool) {
    if !kernel_group(input, ws) {
        return (ws.iter().map(|w| kernel_linear(b, rows, inputs, input, w, None)).collect(), false);
    }
    let rope = rope.filter(|_| ws.len() == 3);
    let t = inputs[0].dims()[0];
    let all_rows = rows.is_none().then(|| b.const_int(t as i64, Elem::I32, &[]));
    let mut operands: Vec<&Val> = inputs.to_vec();
    let mut offsets = vec![0; inputs.len()];
    let mut tys = Vec::with_capacity(ws.len());
    for w in ws {
        let weights = KernelWeights::of(w);
        tys.push(Ty::new(&[t, weights.rows], Elem::F32));
        operands.extend(weights.operands);
        offsets.extend(weights.offsets);
    }
    if let Some((cos, sin)) = rope {
        operands.extend([cos, sin]);
        offsets.extend([0, 0]);
    }
    operands.extend(rows.or(all_rows.as_ref()));
    let KernelWeights { format, activations, order, .. } = KernelWeights::of(ws[0]);
    let target = linear_group_target(format, input, activations, order, ws.len(), rope.is_some());
    (b.custom_call_results(&target, &operands, &offsets, &tys), rope.is_some())
}

impl MatrixArg {
    /// The layer whose part of stacked operands the kernel reads, if the matrix is stacked.
    fn layer(&self) -> Option<usize> {
        match self {
            MatrixArg::Dense { layer, .. } | MatrixArg::Int4 { layer, .. } | MatrixArg::Int8 { layer, .. } => *layer,
        }
    }

    /// How one-row products with this matrix are written where no kernel takes them.
    fn products(&self) -> VectorProducts {
        match self {
            MatrixArg::Dense { products, .. } | MatrixArg::Int4 { products, .. } | MatrixArg::Int8 { products, .. } => {
                *products
            }
        }
    }

    /// Whether products with this matrix go through the runtime's kernel.
    fn is_kernel(&self) -> bool {
        matches!(
            self,
            MatrixArg::Dense { kernel: true, .. }
                | MatrixArg::Int4 { kernel: true, .. }
                | MatrixArg::Int8 { kernel: true, .. }
        )
    }
}

/// Where the graph's own ops read a quantized matrix: panels are only ever multiplied by the
/// kernels (and an int8 embedding gathered from them, [`embed_rows`]), which
/// [`GraphOptions::matrix_order`] guarantees.
fn row_major_only(order: MatrixOrder) {
    assert_eq!(order, MatrixOrder::RowMajor, "the graphs' own int4 and int8 ops read row-major matrices only");
}

/// An int8 matrix's values as f32 `[M, K]`: `scale * q` per group, as the format defines them.
fn int8_values(b: &mut FnBuilder, codes: &Val, scales: &Val) -> Val {
    let (m, k) = (codes.dims()[0], codes.dims()[1]);
    let g = k / GROUP_SIZE;
    let q = b.reshape(codes, &[m, g, GROUP_SIZE]);
    let q = b.convert(&q, Elem::F32);
    let s = b.convert(scales, Elem::F32);
    let s = b.broadcast(&s, &[m, g, GROUP_SIZE], &[0, 1]);
    let w = b.mul(&s, &q);
    b.reshape(&w, &[m, k])
}

/// Rows `ids` of the embedding table as f32 `[T, hidden]`.
fn embed_rows(b: &mut FnBuilder, table: &MatrixArg, ids: &Val) -> Val {
    match table {
        MatrixArg::Int8 { codes, scales, order: MatrixOrder::Panels, .. } => {
            let rows = b.gather_panel_rows(codes, ids, cpu_kernels::PANEL_CHUNK);
            let row_scales = b.gather_panel_rows(scales, ids, 1);
            int8_values(b, &rows, &row_scales)
        }
        MatrixArg::Int8 { codes, scales, .. } => {
            let rows = b.gather_rows(codes, ids);
            let row_scales = b.gather_rows(scales, ids);
            int8_values(b, &rows, &row_scales)
        }
        MatrixArg::Dense { w, transposed: false, .. } => {
            let rows = b.gather_rows(w, ids);
            b.convert(&rows, Elem::F32)
        }
        MatrixArg::Dense { w, transposed: true, .. } => {
            // A tied table uploaded [hidden, vocab] for the LM head: gather its columns.
            let rows = b.gather_columns(w, ids);
            b.convert(&rows, Elem::F32)
        }
        MatrixArg::Int4 { packed, scales, biases, order, .. } => {
            row_major_only(*order);
            // Dequantized exactly as the format defines it: scale * q + bias in f32.
            let t = ids.dims()[0];
            let half = packed.dims()[1];
            let h = half * 2;
            let g = h / GROUP_SIZE;
            let p = b.gather_rows(packed, ids); // [T, h/2]
            let p = b.reshape(&p, &[t, half, 1]);
            let mask = b.const_int(15, Elem::I8, &[t, half, 1]);
            let four = b.const_int(4, Elem::I8, &[t, half, 1]);
            let lo = b.and(&p, &mask);
            let hi = b.shift_right_logical(&p, &four);
            let q = b.concatenate(&[&lo, &hi], 2); // [T, h/2, 2]: element 2i low, 2i+1 high
            let q = b.reshape(&q, &[t, g, GROUP_SIZE]);
            let q = b.convert(&q, Elem::F32);
            let s = b.gather_rows(scales, ids);
            let s = b.convert(&s, Elem::F32);
            let s = b.broadcast(&s, &[t, g, GROUP_SIZE], &[0, 1]);
            let bias = b.gather_rows(biases, ids);
            let bias = b.convert(&bias, Elem::F32);
            let bias = b.broadcast(&bias, &[t, g, GROUP_SIZE], &[0, 1]);
            let v = b.mul(&s, &q);
            let v = b.add(&v, &bias);
            b.reshape(&v, &[t, h])
        }
    }
}

/// `silu(gate) * up`, element-wise, with `silu(g) = g / (1 + exp(-g))` as the reference writes it.
fn swiglu(b: &mut FnBuilder, gate: &Val, up: &Val) -> Val {
    let ng = b.neg(gate);
    let e = b.exp(&ng);
    let one = b.const_f32(1.0, gate.dims());
    let denom = b.add(&one, &e);
    let silu = b.div(gate, &denom);
    b.mul(&silu, up)
}

/// RMSNorm of each row of `x` (`[T, H]`), as the reference: `w * (x * (1 / sqrt(mean(x²) + eps)))`.
fn rms_norm(b: &mut FnBuilder, x: &Val, w: &Val, eps: f32) -> Val {
    let (t, h) = (x.dims()[0], x.dims()[1]);
    let sq = b.mul(x, x);
    let sum = b.reduce(&sq, &[1], Reduction::Sum);
    let n = b.const_f32(h as f32, &[t]);
    let mean = b.div(&sum, &n);
    let eps = b.const_f32(eps, &[t]);
    let var = b.add(&mean, &eps);
    let root = b.sqrt(&var);
    let one = b.const_f32(1.0, &[t]);
    let inv = b.div(&one, &root);
    let inv = b.broadcast(&inv, &[t, h], &[0]);
    let w = b.broadcast(w, &[t, h], &[1]);
    let normed = b.mul(x, &inv);
    b.mul(&w, &normed)
}

/// Rotate-half rope on `x` (`[T, N, D]`) with `cos`/`sin` of shape `[T, D]` (halves repeated).
fn rope(b: &mut FnBuilder, x: &Val, cos: &Val, sin: &Val) -> Val {
    let (t, n, d) = (x.dims()[0], x.dims()[1], x.dims()[2]);
    let x1 = b.slice(x, &[0, 0, 0], &[t, n, d / 2]);
    let x2 = b.slice(x, &[0, 0, d / 2], &[t, n, d]);
    let neg = b.neg(&x2);
    let rotated = b.concatenate(&[&neg, &x1], 2);
    let cos = b.broadcast(cos, &[t, n, d], &[0, 2]);
    let sin = b.broadcast(sin, &[t, n, d], &[0, 2]);
    let a = b.mul(x, &cos);
    let c = b.mul(&rotated, &sin);
    b.add(&a, &c)
}

/// Softmax over the last dimension of a rank-4 f32 tensor, max subtracted first.
fn softmax_last(b: &mut FnBuilder, x: &Val) -> Val {
    let dims = x.dims().to_vec();
    let max = b.reduce(x, &[3], Reduction::Max);
    let max = b.broadcast(&max, &dims, &[0, 1, 2]);
    let shifted = b.sub(x, &max);
    let e = b.exp(&shifted);
    let sum = b.reduce(&e, &[3], Reduction::Sum);
    let sum = b.broadcast(&sum, &dims, &[0, 1, 2]);
    b.div(&e, &sum)
}

/// What every layer reads besides its weights and its caches: rope tables, each sequence's
/// position and attention masks, and constants.
struct LayerInputs {
    cos: Val,
    sin: Val,
    /// The call's sequences: one, or a batch's, whose rows follow each other in `x`.
    sequences: Vec<SequenceInputs>,
    zero: Val,
    cache_elem: Elem,
    /// Rows of the call, all sequences together.
    t: usize,
    eps: f32,
    /// The real rows of a padded call (`count`), which the kernels compute alone; `None` when
    /// every row is real (the decodes).
    rows: Option<Val>,
    /// Whether the products' RMSNorm and SwiGLU run as the graph's own ops instead of inside the
    /// kernels' calls ([`prepares_in_graph`]).
    prepare_in_graph: bool,
    /// How a batched decode's sequences attend where one kernel call takes them all; `None`
    /// where each sequence attends on its own.
    batch_attention: Option<BatchAttention>,
}

/// One kernel call for a batched decode's attention in a layer, with the sequences' positions
/// (`i32[S]`).
enum BatchAttention {
    /// The call writes the entries into caches stacked over the layers and returns them
    /// ([`ATTENTION_DECODE_BATCH_TARGET`], [`GraphOptions::caches_in_kernels`]).
    WritesCaches(Val),
    /// One IREE dispatch writes the entries into each sequence's per-layer caches, its tied
    /// operands, and attends ([`ATTENTION_DECODE_MANY_TARGET`]).
    WritesTiedCaches(Val),
}

/// The most sequences one [`ATTENTION_DECODE_MANY_TARGET`] dispatch attends for: each brings two
/// cache bindings, and an IREE dispatch takes at most 32 bindings (a batch of 16 in one dispatch
/// failed when the module was loaded: 35 bindings), so a larger batch takes a few dispatches.
pub const MAX_SEQUENCES_PER_ATTENTION_DISPATCH: usize = 8;

/// From this many rows per call on (a prefill chunk), iree-cpu's graphs normalize and gate the
/// products' inputs with their own ops: each of a kernel dispatch's workgroups prepares the whole
/// input for its share of the output rows, so a fused preparation could run once per workgroup,
/// which at a prefill chunk's hundreds of rows costs as much as a sizeable part of the products
/// (docs/performance.md). A decode's one row keeps the fused call (its preparation is a few
/// hundred values), and so does a batched decode's row, which must round as that decode does;
/// each worker prepares a call's input once since ADR 0030.
const PREPARE_IN_GRAPH_FROM_ROWS: usize = 4;

/// Whether a call of `t` rows prepares the kernels' inputs in the graph (see
/// [`PREPARE_IN_GRAPH_FROM_ROWS`]): only where each call is split over IREE workgroups.
fn prepares_in_graph(options: &GraphOptions, t: usize) -> bool {
    kernels_are_dispatches(options) && t >= PREPARE_IN_GRAPH_FROM_ROWS
}

/// Whether the graphs call the kernels as XLA custom calls (rather than IREE dispatches).
fn kernels_are_custom_calls(options: &GraphOptions) -> bool {
    matches!(options.host_kernels, Some(HostKernels { calls: KernelCalls::XlaCustomCall, .. }))
}

/// Whether the graphs call the kernels as IREE dispatches.
fn kernels_are_dispatches(options: &GraphOptions) -> bool {
    matches!(options.host_kernels, Some(HostKernels { calls: KernelCalls::IreeDispatch, .. }))
}

/// Unrolled layer `layer`'s weights where the matrices are stacked over the layers
/// ([`crate::Stacked::Matrices`]): the stacked arguments stand in layer 0's places, among layer
/// 0's own arguments (its norms). Layer 0 takes all of its places' arguments from `w` and keeps
/// them in `places` (`Some` for a stacked one); a later layer takes its own arguments from `w`
/// and the stacked ones from `places`. The products then read their layer's part of the stacked
/// arguments ([`MatrixArg::layer`]).
fn stacked_layer_weights(w: &mut Weights, places: &mut Vec<Option<(Val, WeightArg)>>, layer: usize) -> Weights {
    let (mut vals, mut specs) = (Vec::new(), Vec::new());
    if layer == 0 {
        let own = |spec: &WeightArg| spec.is_stacked() || spec.name.starts_with("model.layers.0.");
        let count = w.specs[w.next..].iter().take_while(|spec| own(spec)).count();
        places.clear();
        for i in w.next..w.next + count {
            let (val, spec) = (w.vals[i].clone(), w.specs[i].clone());
            places.push(spec.is_stacked().then(|| (val.clone(), spec.clone())));
            vals.push(val);
            specs.push(spec);
        }
        w.next += count;
    } else {
        for place in places.iter() {
            let (val, spec) = match place {
                Some((val, spec)) => (val.clone(), spec.clone()),
                None => {
                    w.next += 1;
                    (w.vals[w.next - 1].clone(), w.specs[w.next - 1].clone())
                }
            };
            vals.push(val);
            specs.push(spec);
        }
    }
    w.sharing_settings(vals, specs, Some(layer))
}

/// What one sequence of a call attends with.
struct SequenceInputs {
    /// Position of the sequence's first row in this call (an i32 scalar).
    position: Val,
    masks: Masks,
}

/// The attention masks of one layout of the caches.
enum Masks {
    /// Stacked caches, read as they were before this call.
    Stacked {
        /// The caches as passed in (`[L, KVH, D, C]` and `[L, KVH, C, D]`); read only by the layers.
        k_cache: Val,
        v_cache: Val,
        /// `[KVH, G, T, C]`: cache position `j` is visible iff `j < position` (earlier calls' tokens).
        visible_cached: Val,
        /// `[KVH, G, T, T]`: new token `u` is visible to query `t` iff `u <= t` (causal).
        visible_new: Val,
    },
    /// Per-layer caches, read after this call's entries are written.
    PerLayer {
        /// `[KVH, G, T, C]`: cache position `j` is visible to query `t` iff `j <= position + t`;
        /// `None` where the kernels attend (they take the position instead).
        visible: Option<Val>,
    },
}

/// The keys and values one call adds, for all layers (`[L, KVH, D, T]` and `[L, KVH, T, D]`,
/// f16): filled layer by layer, written into the stacked caches once after the last layer.
struct NewKv {
    k: Val,
    v: Val,
}

/// Where a layer's keys and values go, for one sequence.
enum LayerKv {
    /// Stacked caches: this call's entries are recorded for the write after the last layer.
    Stacked(NewKv),
    /// The layer's own caches (`[KVH, D, C]`, `[KVH, C, D]`): written first, then read whole.
    Own { k: Val, v: Val },
    /// Caches stacked over the layers, written and read by the layer's attention call, which
    /// returns them for the next layer ([`GraphOptions::caches_in_kernels`]).
    InKernels { k: Val, v: Val },
}

/// One decoder layer at index `layer` (an i32 scalar): attention over the cached positions plus
/// this call's own tokens, then the MLP. `kv` holds each sequence's caches (one entry per
/// [`LayerInputs::sequences`]). Returns the new hidden state and the layer's keys and values
/// added to `kv`.
///
/// Why stacked caches are not written here: inside a `stablehlo.while` a cache updated per layer
/// is a loop-carried value, and IREE 3.13 then copies the whole cache (measured on its stream IR).
/// Reading the cache as it was and writing all layers' new entries once afterwards keeps the
/// update in place in both layer modes. Per-layer caches are independent values, so each is
/// written here and then read.
fn decoder_layer(
    b: &mut FnBuilder,
    config: &LlamaConfig,
    w: &mut Weights,
    inputs: &LayerInputs,
    layer: &Val,
    x: Val,
    kv: Vec<LayerKv>,
) -> (Val, Vec<LayerKv>) {
    let LayerInputs { cos, sin, sequences, t, eps, rows, prepare_in_graph, .. } = inputs;
    let rows = rows.as_ref();
    let (t, eps) = (*t, *eps);
    let d = config.head_dim;
    let (n_heads, n_kv) = (config.num_attention_heads, config.num_key_value_heads);
    let mut x = x;
    let attn_norm = w.norm();
    let (wq, wk, wv, wo) = (w.matrix(), w.matrix(), w.matrix(), w.matrix());
    let mlp_norm = w.norm();
    let (w_gate, w_up, w_down) = (w.matrix(), w.matrix(), w.matrix());

    // Through the kernels, each product takes the un-normalized rows and normalizes them itself
    // (one call instead of the four small operations of the norm and the product).
    let fused = wq.is_kernel();
    let eps_val = fused.then(|| b.const_f32(eps, &[]));
    // Whether the products' call roped the query and key already.
    let mut roped = false;
    let (q, k, v) = match &eps_val {
        Some(_) if *prepare_in_graph => {
            let normed = rms_norm(b, &x, &attn_norm, eps);
            let qkv;
            (qkv, roped) = kernel_linears(b, rows, &[&normed], KernelInput::Rows, &[&wq, &wk, &wv], Some((cos, sin)));
            let [q, k, v] = three(qkv);
            (q, k, v)
        }
        Some(e) => {
            let inputs = [&x, &attn_norm, e];
            let qkv;
            (qkv, roped) = kernel_linears(b, rows, &inputs, KernelInput::RmsNorm, &[&wq, &wk, &wv], Some((cos, sin)));
            let [q, k, v] = three(qkv);
            (q, k, v)
        }
        None if cuda_group(&[&wq, &wk, &wv]) => {
            let mut qkv = cuda_products(b, &x, Some((&attn_norm, eps)), &[&wq, &wk, &wv]).into_iter();
            let mut next = || qkv.next().expect("three products");
            (next(), next(), next())
        }
        None => {
            let normed = rms_norm(b, &x, &attn_norm, eps);
            (linear(b, &normed, &wq), linear(b, &normed, &wk), linear(b, &normed, &wv))
        }
    };
    let q = b.reshape(&q, &[t, n_heads, d]);
    let k = b.reshape(&k, &[t, n_kv, d]);
    let v = b.reshape(&v, &[t, n_kv, d]);
    let (q, k) = if roped { (q, k) } else { (rope(b, &q, cos, sin), rope(b, &k, cos, sin)) };

    // Each sequence attends over its own caches with its own rows; a lone sequence's rows are
    // the whole call.
    let r = t / sequences.len();
    let mut outputs = Vec::with_capacity(sequences.len());
    let mut updated = Vec::with_capacity(sequences.len());
    // The rows of `x` (`per` for each sequence) of sequences `first..first + count`; all of
    // them when those are every sequence.
    let rows_of = |b: &mut FnBuilder, x: &Val, first: usize, count: usize, per: usize| {
        if count == sequences.len() {
            return x.clone();
        }
        let mut start = vec![0; x.rank()];
        let mut limit = x.dims().to_vec();
        (start[0], limit[0]) = (first * per, (first + count) * per);
        b.slice(x, &start, &limit)
    };
    // What the output projection reads: the attention's rows, or its parts to merge.
    let mut attn_input = KernelInput::Rows;
    if let Some(BatchAttention::WritesTiedCaches(positions)) = &inputs.batch_attention {
        assert!(wo.is_kernel(), "a decode attention's parts are merged by the output projection's kernel");
        attn_input = KernelInput::AttentionParts;
        // One dispatch writes each sequence's entries into its own caches (tied operands,
        // updated in place) and attends for all of them: a dispatch per sequence cost the
        // dispatch's fixed work each time, and the graph's own writes two more dispatches per
        // sequence and layer. A batch larger than a dispatch's bindings allow takes a few.
        let mut kv = kv.into_iter();
        for first in (0..sequences.len()).step_by(MAX_SEQUENCES_PER_ATTENTION_DISPATCH) {
            let group = MAX_SEQUENCES_PER_ATTENTION_DISPATCH.min(sequences.len() - first);
            let part = |b: &mut FnBuilder, x: &Val, per: usize| rows_of(b, x, first, group, per);
            let mut operands = vec![part(b, &q, r), part(b, positions, 1), part(b, &k, r), part(b, &v, r)];
            for kv in kv.by_ref().take(group) {
                let LayerKv::Own { k: k_cache, v: v_cache } = kv else {
                    unreachable!("a batch's attention over per-layer caches is emitted for per-layer caches only")
                };
                operands.extend([k_cache, v_cache]);
            }
            let tied: Vec<usize> = (4..operands.len()).collect();
            let ty = Ty::new(&[group * r, ATTENTION_DECODE_PARTS * n_heads, 2 + d], Elem::F32);
            let target = attention_decode_many_target(group);
            let results = b.dispatch_tied(&target, &operands.iter().collect::<Vec<_>>(), Some(ty), &tied);
            outputs.push(results[0].clone());
            updated.extend(results[1..].chunks(2).map(|kv| LayerKv::Own { k: kv[0].clone(), v: kv[1].clone() }));
        }
    } else if let Some(BatchAttention::WritesCaches(positions)) = &inputs.batch_attention {
        // One call writes each sequence's new entries into its caches (updated in place: each
        // cache result aliases its operand) and attends for all of them, where writing them in
        // the graph took two small operations per sequence and layer, each a step of XLA's
        // executor between the kernels' calls.
        let mut operands = vec![q.clone(), positions.clone(), k.clone(), v.clone(), layer.clone()];
        let mut tys = vec![Ty::new(&[t, n_heads, d], Elem::F32)];
        for kv in kv {
            let LayerKv::InKernels { k: k_cache, v: v_cache } = kv else {
                unreachable!("a batched attention call is emitted for caches in the kernels only")
            };
            tys.extend([k_cache.ty.clone(), v_cache.ty.clone()]);
            operands.extend([k_cache, v_cache]);
        }
        let aliases: Vec<(usize, usize)> = (1..tys.len()).map(|result| (result, result + 4)).collect();
        let results =
            b.custom_call_aliased(ATTENTION_DECODE_BATCH_TARGET, &operands.iter().collect::<Vec<_>>(), &tys, &aliases);
        outputs.push(b.reshape(&results[0], &[t, n_heads * d]));
        updated.extend(results[1..].chunks(2).map(|kv| LayerKv::InKernels { k: kv[0].clone(), v: kv[1].clone() }));
    } else {
        for (s, (sequence, kv)) in sequences.iter().zip(kv).enumerate() {
            let (q, k, v) = (rows_of(b, &q, s, 1, r), rows_of(b, &k, s, 1, r), rows_of(b, &v, s, 1, r));
            let (attn, kv) = attend(b, config, inputs, sequence, layer, [&q, &k, &v], kv);
            outputs.push(attn);
            updated.push(kv);
        }
    }
    let attn = match outputs.as_slice() {
        [one] => one.clone(),
        many => b.concatenate(&many.iter().collect::<Vec<_>>(), 0),
    };
    if eps_val.is_some() && *prepare_in_graph {
        // The residual adds inside the kernels' calls, the norm and the SwiGLU in the graph.
        x = kernel_linear(b, rows, &[&attn], attn_input, &wo, Some(&x));
        let normed = rms_norm(b, &x, &mlp_norm, eps);
        let [gate, up] = two(kernel_linears(b, rows, &[&normed], KernelInput::Rows, &[&w_gate, &w_up], None).0);
        let act = swiglu(b, &gate, &up);
        x = kernel_linear(b, rows, &[&act], KernelInput::Rows, &w_down, Some(&x));
        return (x, updated);
    }
    if let Some(e) = &eps_val {
        // The residual adds, the MLP's norm and its SwiGLU all inside the kernels' calls.
        x = kernel_linear(b, rows, &[&attn], attn_input, &wo, Some(&x));
        let gate_up = kernel_linears(b, rows, &[&x, &mlp_norm, e], KernelInput::RmsNorm, &[&w_gate, &w_up], None);
        let [gate, up] = two(gate_up.0);
        x = kernel_linear(b, rows, &[&gate, &up], KernelInput::SwiGlu, &w_down, Some(&x));
        return (x, updated);
    }
    x = residual_linear(b, &x, &attn, &wo);

    let (gate, up) = if cuda_group(&[&w_gate, &w_up]) {
        let mut gate_up = cuda_products(b, &x, Some((&mlp_norm, eps)), &[&w_gate, &w_up]);
        let up = gate_up.pop().expect("two products");
        (gate_up.pop().expect("two products"), up)
    } else {
        let normed = rms_norm(b, &x, &mlp_norm, eps);
        (linear(b, &normed, &w_gate), linear(b, &normed, &w_up))
    };
    let act = swiglu(b, &gate, &up);
    x = residual_linear(b, &x, &act, &w_down);
    (x, updated)
}

/// The three products of [`kernel_linears`] over three matrices.
fn three(products: Vec<Val>) -> [Val; 3] {
    products.try_into().unwrap_or_else(|p: Vec<Val>| panic!("{} products of three matrices", p.len()))
}

/// The two products of [`kernel_linears`] over two matrices.
fn two(products: Vec<Val>) -> [Val; 2] {
    products.try_into().unwrap_or_else(|p: Vec<Val>| panic!("{} products of two matrices", p.len()))
}

/// One sequence's new keys and values (`f32[R, KVH, D]`, rope applied) written into its
/// per-layer caches (`[KVH, D, C]`, `[KVH, C, D]`) from `position`, in the caches' element type.
fn write_entries(
    b: &mut FnBuilder,
    inputs: &LayerInputs,
    position: &Val,
    [k, v]: [&Val; 2],
    [k_cache, v_cache]: [Val; 2],
) -> (Val, Val) {
    let (zero, cache_elem) = (&inputs.zero, inputs.cache_elem);
    let new_k = cache_keys(b, k, cache_elem);
    let k_cache = b.dynamic_update_slice(&k_cache, &new_k, &[zero, zero, position]);
    let new_v = cache_values(b, v, cache_elem);
    let v_cache = b.dynamic_update_slice(&v_cache, &new_v, &[zero, position, zero]);
    (k_cache, v_cache)
}

/// New keys `f32[R, KVH, D]` in the caches' layout and element type, `[KVH, D, R]`: attention
/// reads them rounded exactly as if they had been stored and read back.
fn cache_keys(b: &mut FnBuilder, k: &Val, cache_elem: Elem) -> Val {
    let new_k = b.transpose(k, &[1, 2, 0]);
    b.convert(&new_k, cache_elem)
}

/// New values `f32[R, KVH, D]` in the caches' layout and element type, `[KVH, R, D]`.
fn cache_values(b: &mut FnBuilder, v: &Val, cache_elem: Elem) -> Val {
    let new_v = b.transpose(v, &[1, 0, 2]);
    b.convert(&new_v, cache_elem)
}

/// One sequence's attention in a layer: its rows' queries `q f32[R, H, D]` over its cached
/// positions and its own new keys and values (`k`, `v` `f32[R, KVH, D]`, rope applied), which go
/// into its caches. Returns the attention output `f32[R, H * D]` and the updated caches.
fn attend(
    b: &mut FnBuilder,
    config: &LlamaConfig,
    inputs: &LayerInputs,
    sequence: &SequenceInputs,
    layer: &Val,
    [q, k, v]: [&Val; 3],
    kv: LayerKv,
) -> (Val, LayerKv) {
    let (zero, cache_elem) = (&inputs.zero, inputs.cache_elem);
    let SequenceInputs { position, masks } = sequence;
    let t = q.dims()[0];
    let d = config.head_dim;
    let (n_heads, n_kv) = (config.num_attention_heads, config.num_key_value_heads);
    let group = n_heads / n_kv;
    // GQA without repeating KV heads: queries grouped as [kv_heads, group * T, D].
    let grouped_queries = |b: &mut FnBuilder| {
        let q = b.reshape(q, &[t, n_kv, group, d]);
        let q = b.transpose(&q, &[1, 2, 0, 3]);
        b.reshape(&q, &[n_kv, group * t, d])
    };
    // The attention rows [KVH, G*T, D] back in token order, [T, H * D].
    let heads_last = |b: &mut FnBuilder, attn: &Val| {
        let attn = b.reshape(attn, &[n_kv, group, t, d]);
        let attn = b.transpose(&attn, &[2, 0, 1, 3]);
        b.reshape(&attn, &[t, n_heads * d])
    };
    let masked_scores = |b: &mut FnBuilder, q: &Val, keys: &Val, visible: &Val| {
        let n = keys.dims()[2];
        let scores = b.dot_general(q, keys, (&[0], &[0]), (&[2], &[1])); // [KVH, G*T, n]
        let scale = b.const_f32(1.0 / (d as f32).sqrt(), &[n_kv, group * t, n]);
        let scores = b.mul(&scores, &scale);
        let scores = b.reshape(&scores, &[n_kv, group, t, n]);
        let neg_inf = b.const_f32(f32::NEG_INFINITY, &[n_kv, group, t, n]);
        b.select(visible, &scores, &neg_inf)
    };
    let (attn, kv) = match (kv, masks) {
        (LayerKv::Stacked(new), Masks::Stacked { k_cache, v_cache, visible_cached, visible_new }) => {
            let c = k_cache.dims()[3];
            let new_k = cache_keys(b, k, cache_elem);
            let layer_k = b.reshape(&new_k, &[1, n_kv, d, t]);
            let k_all = b.dynamic_update_slice(&new.k, &layer_k, &[layer, zero, zero, zero]);
            let new_v = cache_values(b, v, cache_elem);
            let layer_v = b.reshape(&new_v, &[1, n_kv, t, d]);
            let v_all = b.dynamic_update_slice(&new.v, &layer_v, &[layer, zero, zero, zero]);
            let new_k = b.convert(&new_k, Elem::F32);
            let new_v = b.convert(&new_v, Elem::F32);
            let read = |b: &mut FnBuilder, cache: &Val| {
                let dims = cache.dims().to_vec();
                let s = b.dynamic_slice(cache, &[layer, zero, zero, zero], &[1, dims[1], dims[2], dims[3]]);
                let s = b.reshape(&s, &dims[1..]);
                b.convert(&s, Elem::F32)
            };
            let keys = read(b, k_cache); // [KVH, D, C]
            let values = read(b, v_cache); // [KVH, C, D]
            let q = grouped_queries(b);
            // Scores against the cached positions and against the new tokens share one softmax.
            let cached_scores = masked_scores(b, &q, &keys, visible_cached);
            let new_scores = masked_scores(b, &q, &new_k, visible_new);
            let scores = b.concatenate(&[&cached_scores, &new_scores], 3);
            let probs = softmax_last(b, &scores); // [KVH, G, T, C + T]
            let cached_probs = b.slice(&probs, &[0, 0, 0, 0], &[n_kv, group, t, c]);
            let cached_probs = b.reshape(&cached_probs, &[n_kv, group * t, c]);
            let new_probs = b.slice(&probs, &[0, 0, 0, c], &[n_kv, group, t, c + t]);
            let new_probs = b.reshape(&new_probs, &[n_kv, group * t, t]);
            let attn_cached = b.dot_general(&cached_probs, &values, (&[0], &[0]), (&[2], &[1])); // [KVH, G*T, D]
            let attn_new = b.dot_general(&new_probs, &new_v, (&[0], &[0]), (&[2], &[1]));
            let attn = b.add(&attn_cached, &attn_new);
            (heads_last(b, &attn), LayerKv::Stacked(NewKv { k: k_all, v: v_all }))
        }
        (LayerKv::Own { k: k_cache, v: v_cache }, Masks::PerLayer { visible }) => {
            let c = k_cache.dims()[2];
            let (attn, k_cache, v_cache) = match visible {
                None => {
                    // The kernels attend, as IREE's dispatches (XLA's calls take the stacked
                    // caches): one dispatch writes the real rows' entries into the caches, its
                    // tied operands, then row t reads cache positions 0..=position + t only;
                    // padding rows are zero.
                    let all_rows = inputs.rows.is_none().then(|| b.const_int(t as i64, Elem::I32, &[]));
                    let rows = inputs.rows.as_ref().or(all_rows.as_ref()).expect("one of the two is set");
                    let operands = [k, v, position, rows, &k_cache, &v_cache];
                    let caches = b.dispatch_tied(WRITE_ENTRIES_TARGET, &operands, None, &[4, 5]);
                    let (k_cache, v_cache) = (caches[0].clone(), caches[1].clone());
                    let ty = Ty::new(&[t, n_heads, d], Elem::F32);
                    let attn = b.custom_call(ATTENTION_CAUSAL_TARGET, &[q, &k_cache, &v_cache, position, rows], ty);
                    (b.reshape(&attn, &[t, n_heads * d]), k_cache, v_cache)
                }
                Some(visible) => {
                    let (k_cache, v_cache) = write_entries(b, inputs, position, [k, v], [k_cache, v_cache]);
                    let keys = b.convert(&k_cache, Elem::F32); // [KVH, D, C]
                    let values = b.convert(&v_cache, Elem::F32); // [KVH, C, D]
                    let q = grouped_queries(b);
                    let scores = masked_scores(b, &q, &keys, visible);
                    let probs = softmax_last(b, &scores); // [KVH, G, T, C]
                    let probs = b.reshape(&probs, &[n_kv, group * t, c]);
                    let attn = b.dot_general(&probs, &values, (&[0], &[0]), (&[2], &[1])); // [KVH, G*T, D]
                    (heads_last(b, &attn), k_cache, v_cache)
                }
            };
            (attn, LayerKv::Own { k: k_cache, v: v_cache })
        }
        (LayerKv::InKernels { k: k_cache, v: v_cache }, Masks::PerLayer { visible: None }) => {
            // The call writes this call's entries into layer `layer` of the stacked caches and
            // attends over them, returning the caches (each aliasing its operand) for the next
            // layer; the graph neither writes nor copies a cache.
            let cache_tys = [k_cache.ty.clone(), v_cache.ty.clone()];
            let results = if t == 1 {
                let q = b.reshape(q, &[n_heads, d]);
                let tys = [Ty::new(&[n_heads, d], Elem::F32), cache_tys[0].clone(), cache_tys[1].clone()];
                let operands = [&q, k, v, position, layer, &k_cache, &v_cache];
                b.custom_call_aliased(ATTENTION_DECODE_WRITE_TARGET, &operands, &tys, &[(1, 5), (2, 6)])
            } else {
                let all_rows = inputs.rows.is_none().then(|| b.const_int(t as i64, Elem::I32, &[]));
                let rows = inputs.rows.as_ref().or(all_rows.as_ref()).expect("one of the two is set");
                let tys = [Ty::new(&[t, n_heads, d], Elem::F32), cache_tys[0].clone(), cache_tys[1].clone()];
                let operands = [q, k, v, position, rows, layer, &k_cache, &v_cache];
                b.custom_call_aliased(ATTENTION_CAUSAL_WRITE_TARGET, &operands, &tys, &[(1, 6), (2, 7)])
            };
            let attn = b.reshape(&results[0], &[t, n_heads * d]);
            (attn, LayerKv::InKernels { k: results[1].clone(), v: results[2].clone() })
        }
        _ => unreachable!("the masks are built for the layout of the caches"),
    };
    (attn, kv)
}

/// Every decoder layer written out in turn, each sequence's caches (`kv`) carried from one layer
/// to the next.
fn unrolled_layers(
    b: &mut FnBuilder,
    config: &LlamaConfig,
    w: &mut Weights,
    inputs: &LayerInputs,
    mut x: Val,
    mut kv: Vec<LayerKv>,
) -> (Val, Vec<LayerKv>) {
    for layer in 0..config.num_hidden_layers {
        b.comment(&format!("layer {layer}"));
        let index = b.const_int(layer as i64, Elem::I32, &[]);
        (x, kv) = decoder_layer(b, config, w, inputs, &index, x, kv);
    }
    (x, kv)
}

/// One function of the module (see the module docs for its signature).
fn forward(
    config: &LlamaConfig,
    options: &GraphOptions,
    spec: GraphSpec,
    name: &str,
    dispatches: &mut crate::mlir::KernelDispatches,
) -> String {
    let t = spec.tokens();
    let sequences = spec.kind.sequences();
    let batched = matches!(spec.kind, GraphKind::DecodeBatch { .. });
    let r = t / sequences;
    let c = options.max_context;
    let (h, d) = (config.hidden_size, config.head_dim);
    let (n_heads, n_kv) = (config.num_attention_heads, config.num_key_value_heads);
    let group = n_heads / n_kv;
    let layers = config.num_hidden_layers;
    let vocab = config.vocab_size;
    let eps = config.rms_norm_eps;

    let mut args: Vec<FnArg> = Vec::new();
    let mut push_with = |ty: Ty, attrs: &str, doc: String| {
        let val = arg(args.len(), ty);
        args.push(FnArg { val: val.clone(), attrs: attrs.to_string(), doc });
        val
    };
    // The only difference between the token graphs and the embeddings graphs: the first argument,
    // and so the first hidden state (below). Everything after it is one emitter.
    let embeddings = spec.kind.takes_embeddings();
    let (input, first_doc, real) = if embeddings {
        let doc = format!("embedding rows [{t}, hidden], padded to {t} with finite rows (zeros)");
        (
            push_with(Ty::new(&[t, h], Elem::F32), "", doc),
            "position of the first row (positions already in the cache)",
            "rows",
        )
    } else if batched {
        (push_with(Ty::new(&[t], Elem::I32), "", "one token id per sequence".into()), "", "tokens")
    } else {
        let doc = format!("token ids, padded to {t}");
        (
            push_with(Ty::new(&[t], Elem::I32), "", doc),
            "position of the first token (tokens already in the cache)",
            "tokens",
        )
    };
    // A batch's sequences each have their own position (tokens already in that sequence's cache).
    let position = if batched {
        push_with(Ty::new(&[t], Elem::I32), "", "each sequence's position (tokens already in its cache)".into())
    } else {
        push_with(Ty::new(&[], Elem::I32), "", first_doc.into())
    };
    let count =
        spec.kind.takes_count().then(|| push_with(Ty::new(&[], Elem::I32), "", format!("real {real}, 1..={t}")));
    // Keys are stored transposed, [D, C] per head, so that the score product reads them in the
    // [K, M] layout IREE's CPU code generation prefers (measured: see the docs); values are [C, D],
    // already [K, M] for the probability-weighted sum.
    //
    // The caches alias the results after the token (`tf.aliasing_output`, which IREE turns into
    // `iree.abi.output` and XLA into an input/output alias): the step writes into the caller's
    // buffers instead of copying the whole cache into fresh ones. The input buffers are consumed.
    let cache_elem = options.cache.arg_dtype().elem();
    let per_layer = options.layers == LayerMode::UnrolledCachePerLayer;
    let shapes = cache_arg_shapes(config, options);
    let mut caches: Vec<Vec<Val>> = Vec::with_capacity(sequences);
    for sequence in 0..sequences {
        let whose = if batched { format!(" of sequence {sequence}") } else { String::new() };
        let own = shapes
            .iter()
            .enumerate()
            .map(|(i, shape)| {
                let (which, layout) =
                    if i % 2 == 0 { ("k", "head_dim, max_context") } else { ("v", "max_context, head_dim") };
                // A layer's own cache is `[KVH, ...]`; stacked ones `[L, KVH, ...]`.
                let doc = if shape.len() == 3 {
                    format!("{which} cache of layer {} [kv_heads, {layout}]{whose}, updated in place", i / 2)
                } else {
                    format!("{which} cache [layers, kv_heads, {layout}]{whose}, updated in place")
                };
                let result = 1 + sequence * shapes.len() + i;
                push_with(Ty::new(shape, cache_elem), &format!("tf.aliasing_output = {result} : i32"), doc)
            })
            .collect();
        caches.push(own);
    }
    let specs = graph_weight_args(config, options);
    let vals: Vec<Val> =
        specs.iter().map(|s| push_with(Ty::new(&s.shape, s.dtype.elem()), "", s.name.clone())).collect();
    let kernels = options.kernel_rows(t);
    let activations = options.host_kernels.map(|h| h.activations).unwrap_or_default();
    let products = options.products_for(t);
    let mut w = Weights {
        vals,
        specs,
        next: 0,
        layer: None,
        dequantize_from: options.int4_dequantize_from,
        kernels,
        activations,
        products,
    };

    let mut b = FnBuilder::new();
    if options.highest_precision {
        b.highest_precision_dots();
    }
    if let Some(HostKernels { calls: KernelCalls::IreeDispatch, .. }) = options.host_kernels {
        b.dispatch_kernels_into(std::mem::take(dispatches));
    }
    // The embedding table is taken in every graph (one weight list for the whole module), even
    // where only a tied LM head reads it.
    let embed = w.matrix();
    let x = if embeddings {
        // Padding rows need no masking of their own: like padding tokens they are queries nobody
        // reads and keys no real query sees. They must be finite, though: a masked probability
        // is an exact 0, and 0 * inf in the attention product would be NaN.
        input
    } else {
        b.comment("embeddings");
        embed_rows(&mut b, &embed, &input)
    };

    b.comment("rope tables and the attention mask, shared by all layers");
    let positions = if batched {
        position.clone()
    } else {
        let offsets = b.iota(&[t], 0);
        let start = b.broadcast(&position, &[t], &[]);
        b.add(&start, &offsets) // i32 [T]
    };
    let pos_f = b.convert(&positions, Elem::F32);
    let inv_freq = b.const_f32_vec(&config.rope_inv_freq());
    let pos_f = b.broadcast(&pos_f, &[t, d / 2], &[0]);
    let inv_freq = b.broadcast(&inv_freq, &[t, d / 2], &[1]);
    let angles = b.mul(&pos_f, &inv_freq);
    let cos = b.cos(&angles);
    let sin = b.sin(&angles);
    let cos = b.concatenate(&[&cos, &cos], 1);
    let sin = b.concatenate(&[&sin, &sin], 1);
    // Attention sees the positions before this call and this call's tokens causally. Padding
    // queries (t >= count) compute rows nobody reads; their keys and values land in the cache
    // after the real tokens, where no later query looks before a later call overwrites them.
    let cached_dims = [n_kv, group, r, c];
    let key_pos = b.iota(&cached_dims, 3);
    let mut sequence_inputs = Vec::with_capacity(sequences);
    for (sequence, own_caches) in caches.iter().enumerate() {
        // A batch's sequence `s` is row `s`, at its own position; a lone sequence is all rows.
        let (first, own_positions) = if batched {
            let p = b.slice(&position, &[sequence], &[sequence + 1]);
            (b.reshape(&p, &[]), p)
        } else {
            (position.clone(), positions.clone())
        };
        let masks = if per_layer {
            // Cache position j is visible to query t iff j <= position + t; the kernels attend
            // from the position alone.
            let visible = (!options.attention_kernel()).then(|| {
                let query_pos = b.broadcast(&own_positions, &cached_dims, &[2]);
                b.compare(&key_pos, &query_pos, Cmp::Le)
            });
            Masks::PerLayer { visible }
        } else {
            // Cache position j visible iff j < position; new token u visible to query t iff u <= t.
            let start = b.broadcast(&first, &cached_dims, &[]);
            let visible_cached = b.compare(&key_pos, &start, Cmp::Lt);
            let new_dims = [n_kv, group, r, r];
            let key_index = b.iota(&new_dims, 3);
            let query_index = b.iota(&new_dims, 2);
            let visible_new = b.compare(&key_index, &query_index, Cmp::Le);
            Masks::Stacked {
                k_cache: own_caches[0].clone(),
                v_cache: own_caches[1].clone(),
                visible_cached,
                visible_new,
            }
        };
        sequence_inputs.push(SequenceInputs { position: first, masks });
    }
    let zero = b.const_int(0, Elem::I32, &[]);
    // Stacked caches: this call's keys and values of every layer, collected for one write.
    let new_kv = |b: &mut FnBuilder| {
        let mut zeros = |dims: &[usize]| {
            let z = b.const_f32(0.0, dims);
            b.convert(&z, cache_elem)
        };
        NewKv { k: zeros(&[layers, n_kv, d, r]), v: zeros(&[layers, n_kv, r, d]) }
    };
    let new_kvs: Vec<NewKv> = if per_layer { Vec::new() } else { (0..sequences).map(|_| new_kv(&mut b)).collect() };

    let shared = LayerInputs {
        cos,
        sin,
        sequences: sequence_inputs,
        zero: zero.clone(),
        cache_elem,
        t,
        eps,
        rows: count.clone(),
        // A batch's rows are prepared as a lone decode's row is, in the kernels: the graph's own
        // norm and SwiGLU round differently, and a sequence must get the same tokens in a batch
        // as alone (the contract's batched decode).
        prepare_in_graph: !batched && prepares_in_graph(options, t),
        batch_attention: match (batched, options.caches_in_kernels(), options.attention_kernel()) {
            (true, true, _) => Some(BatchAttention::WritesCaches(position.clone())),
            (true, false, true) => Some(BatchAttention::WritesTiedCaches(position.clone())),
            // A decode through IREE's dispatches takes the batch's dispatch for its one sequence:
            // it writes the entry in place, where the graph's own write kept IREE from recording
            // the step's command buffer once (ADR 0035).
            (false, false, true) if t == 1 => Some(BatchAttention::WritesTiedCaches(b.reshape(&position, &[1]))),
            _ => None,
        },
    };
    let write_all = |b: &mut FnBuilder, new_kvs: Vec<NewKv>| -> Vec<Val> {
        new_kvs
            .into_iter()
            .zip(&caches)
            .zip(&shared.sequences)
            .flat_map(|((new_kv, own), sequence)| write_stacked(b, own, new_kv, &zero, &sequence.position))
            .collect()
    };
    let (x, updated_caches) = match options.layers {
        LayerMode::Unrolled => {
            let kv = new_kvs.into_iter().map(LayerKv::Stacked).collect();
            let (x, kv) = unrolled_layers(&mut b, config, &mut w, &shared, x, kv);
            let new_kvs = kv.into_iter().map(|kv| match kv {
                LayerKv::Stacked(new_kv) => new_kv,
                LayerKv::Own { .. } | LayerKv::InKernels { .. } => unreachable!("stacked in, stacked out"),
            });
            (x, write_all(&mut b, new_kvs.collect()))
        }
        LayerMode::UnrolledCachePerLayer if options.caches_in_kernels() => {
            // Each layer's attention call takes every sequence's stacked caches and returns them
            // updated for the next layer.
            let kv = caches.iter().map(|own| LayerKv::InKernels { k: own[0].clone(), v: own[1].clone() }).collect();
            let (x, kv) = unrolled_layers(&mut b, config, &mut w, &shared, x, kv);
            let updated = kv.into_iter().flat_map(|kv| match kv {
                LayerKv::InKernels { k, v } => [k, v],
                _ => unreachable!("caches in the kernels in, caches in the kernels out"),
            });
            (x, updated.collect())
        }
        LayerMode::UnrolledCachePerLayer => {
            let mut x = x;
            let mut updated: Vec<Vec<Val>> = vec![Vec::with_capacity(2 * layers); sequences];
            let stacked = options.stacked_weights() == crate::Stacked::Matrices;
            let mut places = Vec::new();
            for layer in 0..layers {
                b.comment(&format!("layer {layer}"));
                let index = b.const_int(layer as i64, Elem::I32, &[]);
                let own = caches
                    .iter()
                    .map(|own| LayerKv::Own { k: own[2 * layer].clone(), v: own[2 * layer + 1].clone() })
                    .collect();
                let kv;
                (x, kv) = if stacked {
                    let mut layer_weights = stacked_layer_weights(&mut w, &mut places, layer);
                    decoder_layer(&mut b, config, &mut layer_weights, &shared, &index, x, own)
                } else {
                    decoder_layer(&mut b, config, &mut w, &shared, &index, x, own)
                };
                for (sequence, kv) in kv.into_iter().enumerate() {
                    let LayerKv::Own { k, v } = kv else { unreachable!("own caches in, own caches out") };
                    updated[sequence].extend([k, v]);
                }
            }
            (x, updated.into_iter().flatten().collect())
        }
        LayerMode::Loop => {
            // The stacked per-layer weights are the arguments up to the final norm; the loop body
            // slices layer `i` out of each.
            let first = w.next;
            let per_layer = w.specs[first..].iter().take_while(|s| s.is_stacked()).count();
            w.next += per_layer;
            let stacked: Vec<(Val, WeightArg)> =
                (first..first + per_layer).map(|i| (w.vals[i].clone(), w.specs[i].clone())).collect();
            let start = b.const_int(0, Elem::I32, &[]);
            // Carried: the layer index, the hidden state, then each sequence's new keys and values.
            let mut init = vec![&start, &x];
            init.extend(new_kvs.iter().flat_map(|kv| [&kv.k, &kv.v]));
            b.comment("the decoder layers: one loop body");
            let out = b.while_loop(
                &init,
                |b, carried| {
                    let count = b.const_int(layers as i64, Elem::I32, &[]);
                    b.compare(&carried[0], &count, Cmp::Lt)
                },
                |b, carried| {
                    let index = &carried[0];
                    let mut vals = Vec::with_capacity(stacked.len());
                    let mut specs = Vec::with_capacity(stacked.len());
                    for (val, spec) in &stacked {
                        let dims = val.dims().to_vec();
                        let mut starts = vec![index];
                        starts.extend(std::iter::repeat_n(&shared.zero, dims.len() - 1));
                        let mut sizes = dims.clone();
                        sizes[0] = 1;
                        let one = b.dynamic_slice(val, &starts, &sizes);
                        vals.push(b.reshape(&one, &dims[1..]));
                        specs.push(WeightArg { shape: dims[1..].to_vec(), ..spec.clone() });
                    }
                    let mut layer_weights = w.sharing_settings(vals, specs, None);
                    let kv = carried[2..]
                        .chunks(2)
                        .map(|kv| LayerKv::Stacked(NewKv { k: kv[0].clone(), v: kv[1].clone() }))
                        .collect();
                    let (x, kv) = decoder_layer(b, config, &mut layer_weights, &shared, index, carried[1].clone(), kv);
                    let one = b.const_int(1, Elem::I32, &[]);
                    let mut next = vec![b.add(index, &one), x];
                    for kv in kv {
                        let LayerKv::Stacked(new_kv) = kv else { unreachable!("stacked in, stacked out") };
                        next.extend([new_kv.k, new_kv.v]);
                    }
                    next
                },
            );
            let x = out[1].clone();
            let new_kvs = out[2..].chunks(2).map(|kv| NewKv { k: kv[0].clone(), v: kv[1].clone() }).collect();
            (x, write_all(&mut b, new_kvs))
        }
    };

    let scored = matches!(spec.kind, GraphKind::PrefillScored { .. });
    b.comment(if scored {
        "every position: final norm, LM head; argmax of the last real one"
    } else {
        "last real position: final norm, LM head, argmax"
    });
    let final_norm = w.norm();
    let last = match &count {
        // Every row's logits are returned: the head runs on all of them.
        Some(_) if scored => x.clone(),
        Some(count) if kernels_are_dispatches(options) => {
            // The row as a masked sum (exact: the other rows add zeros), computed on the device:
            // IREE made a slice at a computed row a copy whose offset the VM read back in the
            // middle of the call, so it recorded the rest of the call's command buffer every time
            // (ADR 0035).
            let one = b.const_int(1, Elem::I32, &[]);
            let row = b.sub(count, &one);
            let row = b.broadcast(&row, &[t, h], &[]);
            let rows = b.iota(&[t, h], 0);
            let is_last = b.compare(&rows, &row, Cmp::Eq);
            let zeros = b.const_f32(0.0, &[t, h]);
            let masked = b.select(&is_last, &x, &zeros);
            let sum = b.reduce(&masked, &[0], Reduction::Sum);
            b.reshape(&sum, &[1, h])
        }
        Some(count) => {
            let one = b.const_int(1, Elem::I32, &[]);
            let row = b.sub(count, &one);
            b.dynamic_slice(&x, &[&row, &zero], &[1, h])
        }
        // A decode's rows are all last positions: one, or one per sequence of a batch.
        None => x.clone(),
    };
    let head = if config.tie_word_embeddings { embed } else { w.matrix() };
    let logits = if head.is_kernel() {
        let e = b.const_f32(eps, &[]);
        kernel_linear(&mut b, None, &[&last, &final_norm, &e], KernelInput::RmsNorm, &head, None)
    } else if cuda_group(&[&head]) {
        cuda_products(&mut b, &last, Some((&final_norm, eps)), &[&head]).remove(0)
    } else {
        let last = rms_norm(&mut b, &last, &final_norm, eps);
        linear(&mut b, &last, &head)
    };
    // First index of the maximum, like session_api's argmax, per row: through the kernels where
    // the graphs call them (XLA's and IREE's reductions over (value, index) pairs are each a
    // scalar loop, IREE's one workgroup for all of a batch's rows), else the graph's own
    // reduction. A token per row, `[1]` for one sequence: the shape of a decode's token argument,
    // so that a runtime can pass one step's token buffer to the next step as it is.
    let token = if options.host_kernels.is_some() {
        b.custom_call(ARGMAX_TARGET, &[&logits], Ty::new(&logits.dims()[..1], Elem::I32))
    } else {
        b.argmax(&logits)
    };
    // A scored prefill has a token per row: the last real row's is the call's, taken as a masked
    // sum (no slice at a computed row, as above).
    let token = match &count {
        Some(count) if scored => {
            let one = b.const_int(1, Elem::I32, &[]);
            let row = b.sub(count, &one);
            let row = b.broadcast(&row, &[t], &[]);
            let rows = b.iota(&[t], 0);
            let is_last = b.compare(&rows, &row, Cmp::Eq);
            let zeros = b.const_int(0, Elem::I32, &[t]);
            let masked = b.select(&is_last, &token, &zeros);
            let sum = b.reduce(&masked, &[0], Reduction::Sum);
            b.reshape(&sum, &[1])
        }
        _ => token,
    };
    debug_assert_eq!(w.next, w.vals.len(), "every weight argument is used");
    // The logits, when returned: `[vocab]` for one sequence, a row per sequence for a batch.
    let logits = match (spec.logits, batched || scored) {
        (false, _) => None,
        (true, true) => Some(logits),
        (true, false) => Some(b.reshape(&logits, &[vocab])),
    };

    let mut results = vec![&token];
    results.extend(updated_caches.iter());
    results.extend(logits.as_ref());
    if let Some(taken) = b.take_dispatches() {
        *dispatches = taken;
    }
    b.finish(name, &args, &results)
}

/// Writes every layer's new keys and values into the stacked caches, in place.
fn write_stacked(b: &mut FnBuilder, caches: &[Val], new_kv: NewKv, zero: &Val, position: &Val) -> Vec<Val> {
    b.comment("the new keys and values of every layer, written into the caches in place");
    let k_cache = b.dynamic_update_slice(&caches[0], &new_kv.k, &[zero, zero, zero, position]);
    let v_cache = b.dynamic_update_slice(&caches[1], &new_kv.v, &[zero, zero, position, zero]);
    vec![k_cache, v_cache]
}

#[cfg(test)]
mod tests {
    use super::*;
    use llama_model::random::{tiny_config, tiny_llama32_config};

    const DECODE: GraphSpec = GraphSpec { kind: GraphKind::Decode, logits: false };

    fn options(format: WeightFormat) -> GraphOptions {
        GraphOptions::new(16, format)
    }

    #[test]
    fn function_names() {
        assert_eq!(DECODE.name(), "decode");
        assert_eq!(GraphSpec { kind: GraphKind::Decode, logits: true }.name(), "decode_logits");
        assert_eq!(GraphSpec { kind: GraphKind::Prefill { bucket: 64 }, logits: false }.name(), "prefill_64");
        assert_eq!(GraphSpec { kind: GraphKind::Prefill { bucket: 8 }, logits: true }.name(), "prefill_8_logits");
        assert_eq!(
            GraphSpec { kind: GraphKind::PrefillEmbeddings { bucket: 64 }, logits: false }.name(),
            "prefill_embeddings_64"
        );
        assert_eq!(
            GraphSpec { kind: GraphKind::PrefillEmbeddings { bucket: 1 }, logits: true }.name(),
            "prefill_embeddings_1_logits"
        );
    }

    #[test]
    fn kinds_describe_their_input() {
        let kinds = [
            GraphKind::Decode,
            GraphKind::Prefill { bucket: 8 },
            GraphKind::PrefillEmbeddings { bucket: 8 },
            GraphKind::PrefillEmbeddings { bucket: 1 },
        ];
        let described: Vec<(usize, bool, bool)> =
            kinds.iter().map(|k| (k.input_rows(), k.takes_embeddings(), k.takes_count())).collect();
        assert_eq!(described, vec![(1, false, false), (8, false, true), (8, true, true), (1, true, true)]);
    }

    #[test]
    fn bad_options_are_typed_errors() {
        let c = tiny_config();
        let prefill = |bucket| GraphSpec { kind: GraphKind::Prefill { bucket }, logits: false };
        let embeddings = |bucket| GraphSpec { kind: GraphKind::PrefillEmbeddings { bucket }, logits: false };
        let cases: Vec<(GraphOptions, Vec<GraphSpec>)> = vec![
            (GraphOptions::new(0, WeightFormat::F16), vec![DECODE]),
            (GraphOptions::new(c.max_position_embeddings + 1, WeightFormat::F16), vec![DECODE]),
            (options(WeightFormat::F16), vec![prefill(0)]),
            (options(WeightFormat::F16), vec![prefill(17)]),
            (options(WeightFormat::F16), vec![embeddings(0)]),
            (options(WeightFormat::F16), vec![embeddings(17)]),
            (options(WeightFormat::F16), vec![DECODE, DECODE]),
            (options(WeightFormat::F16), vec![embeddings(4), prefill(4), embeddings(4)]),
            (options(WeightFormat::F16), vec![GraphSpec { kind: GraphKind::DecodeBatch { batch: 1 }, logits: true }]),
            (options(WeightFormat::F16), vec![GraphSpec { kind: GraphKind::DecodeBatch { batch: 65 }, logits: true }]),
        ];
        for (o, specs) in cases {
            assert!(matches!(emit_module(&c, &o, &specs), Err(GraphError::Options(_))), "{o:?} {specs:?}");
        }
        // int4 groups of 32 must tile the input dimensions.
        let narrow = LlamaConfig { hidden_size: 48, num_attention_heads: 3, num_key_value_heads: 1, ..c.clone() };
        assert!(matches!(emit_module(&narrow, &options(WeightFormat::Int4), &[DECODE]), Err(GraphError::Options(_))));
        assert!(emit_module(&narrow, &options(WeightFormat::F16), &[DECODE]).is_ok());
        let broken = LlamaConfig { num_key_value_heads: 3, ..c };
        assert!(matches!(emit_module(&broken, &options(WeightFormat::F16), &[DECODE]), Err(GraphError::Config(_))));
    }

    /// Weights are runtime arguments: the only non-splat constant is the rope frequency table.
    #[test]
    fn weights_are_arguments_not_constants() {
        for (c, format) in [(tiny_config(), WeightFormat::F16), (tiny_llama32_config(), WeightFormat::Int4)] {
            let text = emit_module(
                &c,
                &options(format),
                &[DECODE, GraphSpec { kind: GraphKind::Prefill { bucket: 4 }, logits: true }],
            )
            .unwrap();
            let vectors: Vec<&str> = text.lines().filter(|l| l.contains("value = dense<[")).collect();
            assert_eq!(vectors.len(), 2, "one rope table per function");
            assert!(vectors.iter().all(|l| l.contains(&format!("tensor<{}xf32>", c.head_dim / 2))));
            // Decode: tokens, position, k, v, then exactly the weights.
            let decode = emit_module(&c, &options(format), &[DECODE]).unwrap();
            let n_args = 4 + crate::weight_args(&c, format).len();
            assert!(decode.contains(&format!("%arg{}: ", n_args - 1)) && !decode.contains(&format!("%arg{n_args}: ")));
        }
    }

    /// The rope table is written bit-exactly from `LlamaConfig::rope_inv_freq`.
    #[test]
    fn rope_table_is_bit_exact() {
        let c = tiny_llama32_config();
        let text = emit_module(&c, &options(WeightFormat::F16), &[DECODE]).unwrap();
        let line = text.lines().find(|l| l.contains("value = dense<[")).unwrap();
        let inner = line.split("dense<[").nth(1).unwrap().split(']').next().unwrap();
        let bits: Vec<u32> =
            inner.split(", ").map(|s| u32::from_str_radix(s.trim_start_matches("0x"), 16).unwrap()).collect();
        let want: Vec<u32> = c.rope_inv_freq().iter().map(|f| f.to_bits()).collect();
        assert_eq!(bits, want);
    }

    #[test]
    fn signature_of_prefill() {
        let c = tiny_config();
        let spec = GraphSpec { kind: GraphKind::Prefill { bucket: 4 }, logits: true };
        let text = emit_module(&c, &options(WeightFormat::F16), &[spec]).unwrap();
        assert!(text.contains("func.func @prefill_4_logits("));
        assert!(text.contains("%arg0: tensor<4xi32>"));
        assert!(text.contains("%arg1: tensor<i32>"));
        assert!(text.contains("%arg2: tensor<i32>"));
        assert!(text.contains("%arg3: tensor<2x2x16x16xf16> {tf.aliasing_output = 1 : i32}"));
        assert!(text.contains(") -> (tensor<1xi32>, tensor<2x2x16x16xf16>, tensor<2x2x16x16xf16>, tensor<256xf32>) {"));
        // Per layer, its new keys and values recorded; then one write into each cache.
        assert_eq!(text.matches("stablehlo.dynamic_update_slice").count(), 2 * c.num_hidden_layers + 2);
    }

    /// Every combination of layer layout, weight format (on a tied and an untied config) and
    /// storage of the dense matrices and the cache.
    fn all_options() -> Vec<(LlamaConfig, GraphOptions)> {
        let mut out = Vec::new();
        for c in [tiny_config(), tiny_llama32_config()] {
            for layers in [LayerMode::Unrolled, LayerMode::Loop, LayerMode::UnrolledCachePerLayer] {
                for format in [WeightFormat::F16, WeightFormat::Int4] {
                    for dense in [StorageDtype::F16, StorageDtype::F32] {
                        for cache in [StorageDtype::F16, StorageDtype::F32] {
                            out.push((c.clone(), GraphOptions { layers, dense, cache, ..options(format) }));
                        }
                    }
                }
            }
        }
        out
    }

    /// The function body (after the signature) with SSA values renamed `%v0, %v1, ...` in order of
    /// appearance, so that two bodies that differ only in numbering compare equal. A loop's
    /// region arguments (`%bN_j`, `%cN_j`) carry the loop's number `N` and are renamed with it.
    fn canonical_body(function: &str) -> Vec<String> {
        let body: Vec<char> = function[function.find(") -> (").expect("a signature")..].chars().collect();
        let mut names = std::collections::HashMap::new();
        let mut out = String::new();
        let mut i = 0;
        while i < body.len() {
            out.push(body[i]);
            i += 1;
            if body[i - 1] != '%' {
                continue;
            }
            if i + 1 < body.len() && matches!(body[i], 'b' | 'c') && body[i + 1].is_ascii_digit() {
                out.push(body[i]);
                i += 1;
            }
            let start = i;
            while i < body.len() && body[i].is_ascii_digit() {
                i += 1;
            }
            if i > start {
                let n = names.len();
                let digits: String = body[start..i].iter().collect();
                out.push_str(&format!("v{}", names.entry(digits).or_insert(n)));
            }
        }
        out.lines().map(str::to_string).collect()
    }

    /// Equal line lists, or a panic naming the first line that differs (the bodies are long).
    fn assert_same_lines(a: &[String], b: &[String], what: &str) {
        if let Some(i) = (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i)) {
            panic!("{what}: line {i} differs:\n{:?}\n{:?}", a.get(i), b.get(i));
        }
    }

    /// `prefill_embeddings_T`: an f32 `[T, hidden]` first argument, then position, count, the
    /// caches and the weights exactly as `prefill_T`; no gather for the input; and past the first
    /// hidden state the very body of the token graph (the shared emitter, not a copy).
    #[test]
    fn signature_and_body_of_prefill_embeddings() {
        for (c, o) in all_options() {
            let h = c.hidden_size;
            for (bucket, logits) in [(4, true), (1, false), (8, true)] {
                let tied = c.tie_word_embeddings;
                let what = format!(
                    "{:?} {:?} dense {:?} cache {:?} tied {tied} bucket {bucket}",
                    o.layers, o.format, o.dense, o.cache
                );
                let from_tokens = GraphSpec { kind: GraphKind::Prefill { bucket }, logits };
                let from_rows = GraphSpec { kind: GraphKind::PrefillEmbeddings { bucket }, logits };
                let tokens = emit_module(&c, &o, &[from_tokens]).unwrap();
                let rows = emit_module(&c, &o, &[from_rows]).unwrap();
                let name = if logits {
                    format!("prefill_embeddings_{bucket}_logits")
                } else {
                    format!("prefill_embeddings_{bucket}")
                };
                assert!(rows.contains(&format!("func.func @{name}(")), "{what}");
                assert!(rows.contains(&format!("%arg0: tensor<{bucket}x{h}xf32>, // embedding rows")), "{what}");
                assert!(
                    rows.contains("%arg1: tensor<i32>, // position")
                        && rows.contains("%arg2: tensor<i32>, // real rows"),
                    "{what}"
                );
                // The rest of the signature (caches, weights, results) is the token graph's.
                let signature_tail = |text: &str| -> Vec<String> {
                    text.lines()
                        .skip_while(|l| !l.contains("%arg3: "))
                        .take_while(|l| !l.contains(") -> ("))
                        .map(|l| l.to_string())
                        .collect()
                };
                assert!(!signature_tail(&rows).is_empty());
                assert_eq!(signature_tail(&rows), signature_tail(&tokens), "{what}");
                let results = |text: &str| text.lines().find(|l| l.contains(") -> (")).unwrap().to_string();
                assert_eq!(results(&rows), results(&tokens), "{what}");
                // The token graph gathers its input rows from the table; the embeddings graph
                // gathers nothing.
                assert!(tokens.contains("\"stablehlo.gather\""), "{what}");
                assert!(!rows.contains("\"stablehlo.gather\""), "{what}");
                // The token body without its embedding lookup, reading %arg0 where it read the
                // looked-up rows, is the embeddings body.
                let lookup_start = tokens.find("    // embeddings\n").unwrap();
                let lookup_end = tokens.find("    // rope tables").unwrap();
                let lookup = &tokens[lookup_start..lookup_end];
                let looked_up = lookup.lines().last().unwrap().trim_start().split(' ').next().unwrap().to_string();
                let without_lookup = format!("{}{}", &tokens[..lookup_start], &tokens[lookup_end..]);
                let without_lookup = without_lookup
                    .replace(&format!("{looked_up},"), "%arg0,")
                    .replace(&format!("{looked_up})"), "%arg0)");
                assert_same_lines(&canonical_body(&without_lookup), &canonical_body(&rows), &what);
                // And the entry-module form of the same function.
                let entry = emit_entry_module(&c, &o, from_rows).unwrap();
                assert!(entry.contains("func.func @main(") && entry.contains(&format!("`{name}` as @main")), "{what}");
                assert_same_lines(&canonical_body(&entry), &canonical_body(&rows), &what);
            }
        }
    }

    /// Asking for embeddings graphs leaves the token graphs of a module byte for byte as they were.
    #[test]
    fn embeddings_graphs_leave_token_graphs_unchanged() {
        for (c, o) in all_options() {
            let token_specs = [DECODE, GraphSpec { kind: GraphKind::Prefill { bucket: 4 }, logits: true }];
            let alone = emit_module(&c, &o, &token_specs).unwrap();
            let embeddings = GraphSpec { kind: GraphKind::PrefillEmbeddings { bucket: 4 }, logits: true };
            let with = emit_module(&c, &o, &[token_specs[0], token_specs[1], embeddings]).unwrap();
            assert!(with.starts_with(alone.strip_suffix("}\n").unwrap()));
            assert!(with.contains("func.func @prefill_embeddings_4_logits("));
        }
    }

    /// Per-layer caches: two aliased arguments per layer, each written once, never sliced.
    #[test]
    fn signature_with_per_layer_caches() {
        let c = tiny_llama32_config();
        let o = GraphOptions { layers: LayerMode::UnrolledCachePerLayer, ..options(WeightFormat::Int4) };
        let shapes = cache_arg_shapes(&c, &o);
        let (kv, d) = (c.num_key_value_heads, c.head_dim);
        assert_eq!(shapes.len(), 2 * c.num_hidden_layers);
        assert!(shapes.chunks(2).all(|pair| pair[0] == vec![kv, d, 16] && pair[1] == vec![kv, 16, d]));
        let text = emit_module(&c, &o, &[DECODE]).unwrap();
        for (i, shape) in shapes.iter().enumerate() {
            let ty = format!("tensor<{}xf16>", shape.iter().map(usize::to_string).collect::<Vec<_>>().join("x"));
            assert!(
                text.contains(&format!("%arg{}: {ty} {{tf.aliasing_output = {} : i32}}", i + 2, i + 1)),
                "cache argument {i}"
            );
        }
        assert!(!text.contains(&format!("tf.aliasing_output = {} : i32", shapes.len() + 1)));
        // One in-place write per cache, and attention reads the written caches whole.
        assert_eq!(text.matches("stablehlo.dynamic_update_slice").count(), shapes.len());
        assert_eq!(text.matches("stablehlo.dynamic_slice").count(), 0);
        let results = text.lines().find(|l| l.contains(") -> (tensor<1xi32>")).unwrap();
        assert_eq!(results.split(") -> (").nth(1).unwrap().matches("tensor<").count(), 1 + shapes.len());
        // The weights are the unrolled ones.
        let n_args = 2 + shapes.len() + crate::weight_args(&c, WeightFormat::Int4).len();
        assert!(text.contains(&format!("%arg{}: ", n_args - 1)) && !text.contains(&format!("%arg{n_args}: ")));
    }

    /// A batched decode: positions per sequence, each sequence's caches in turn (aliased to the
    /// results after the tokens), one write per cache, tokens and logits per sequence.
    #[test]
    fn batched_decode_signature() {
        let c = tiny_llama32_config();
        let batch = 3;
        let spec = GraphSpec { kind: GraphKind::DecodeBatch { batch }, logits: true };
        assert_eq!(spec.name(), "decode_batch_3_logits");
        for layers in [LayerMode::Unrolled, LayerMode::UnrolledCachePerLayer, LayerMode::Loop] {
            let o = GraphOptions { layers, ..options(WeightFormat::F16) };
            let shapes = cache_arg_shapes(&c, &o);
            let text = emit_module(&c, &o, &[spec]).unwrap();
            assert!(text.contains(&format!("%arg0: tensor<{batch}xi32>")), "{layers:?}: tokens");
            assert!(text.contains(&format!("%arg1: tensor<{batch}xi32>")), "{layers:?}: positions");
            let caches = batch * shapes.len();
            for i in 0..caches {
                let shape = &shapes[i % shapes.len()];
                let ty = format!("tensor<{}xf16>", shape.iter().map(usize::to_string).collect::<Vec<_>>().join("x"));
                let declared = format!("%arg{}: {ty} {{tf.aliasing_output = {} : i32}}", i + 2, i + 1);
                assert!(text.contains(&declared), "{layers:?}: cache argument {i}");
            }
            assert!(!text.contains(&format!("tf.aliasing_output = {} : i32", caches + 1)), "{layers:?}");
            if layers == LayerMode::UnrolledCachePerLayer {
                assert_eq!(text.matches("stablehlo.dynamic_update_slice").count(), caches, "one write per cache");
            }
            let results = text.lines().find(|l| l.contains(&format!(") -> (tensor<{batch}xi32>"))).unwrap();
            let results = results.split(") -> (").nth(1).unwrap();
            assert_eq!(results.matches("tensor<").count(), 2 + caches, "{layers:?}");
            assert!(results.contains(&format!("tensor<{batch}x{}xf32>)", c.vocab_size)), "{layers:?}: logits");
        }
    }

    /// int4 matrices in the per-group form below the threshold, dequantized from it on.
    #[test]
    fn host_kernels_replace_one_token_products_and_attention() {
        let c = tiny_llama32_config();
        let layers = c.num_hidden_layers;
        let prefill = GraphSpec { kind: GraphKind::Prefill { bucket: 4 }, logits: false };
        for format in [WeightFormat::F16, WeightFormat::Int4] {
            let base =
                GraphOptions { layers: LayerMode::UnrolledCachePerLayer, cache: StorageDtype::F32, ..options(format) };
            let with = GraphOptions {
                host_kernels: Some(HostKernels {
                    max_tokens: 1,
                    calls: KernelCalls::XlaCustomCall,
                    activations: KernelActivations::Exact,
                }),
                ..base.clone()
            };
            let matrices = match format {
                WeightFormat::F16 => MatrixFormat::F16,
                WeightFormat::Int4 => MatrixFormat::Int4,
            };
            let target =
                linear_target(matrices, KernelInput::Rows, false, KernelActivations::Exact, MatrixOrder::RowMajor);
            let target = target.as_str();
            // Every linear target starts with the plain one's name.
            let calls = |o: &GraphOptions, spec: GraphSpec, target: &str| {
                emit_module(&c, o, &[spec]).unwrap().matches(&format!("call_target_name = \"{target}")).count()
            };
            // Seven products per layer in four calls (q, k and v one, gate and up another) plus
            // the LM head (int8 in an int4 model), one attention per layer.
            let head = match format {
                WeightFormat::F16 => 1,
                WeightFormat::Int4 => {
                    let int8 = linear_target(
                        MatrixFormat::Int8,
                        KernelInput::Rows,
                        false,
                        KernelActivations::Exact,
                        MatrixOrder::RowMajor,
                    );
                    assert_eq!(calls(&with, DECODE, &int8), 1, "the int8 head goes through its kernel");
                    0
                }
            };
            assert_eq!(calls(&with, DECODE, target), 4 * layers + head, "{format}");
            let grouped = |products: usize, rope: bool| {
                let name = linear_group_target(
                    matrices,
                    KernelInput::RmsNorm,
                    KernelActivations::Exact,
                    MatrixOrder::RowMajor,
                    products,
                    rope,
                );
                calls(&with, DECODE, &format!("{name}\""))
            };
            // The query, key and value's call ropes the query and key: no rope left in the graph
            // (its rotated halves were a concatenation per layer and product).
            assert_eq!((grouped(3, true), grouped(3, false), grouped(2, false)), (layers, 0, layers), "{format}");
            let text = emit_module(&c, &with, &[DECODE]).unwrap();
            // The tables' halves are the two concatenations left.
            assert_eq!(text.matches("stablehlo.concatenate").count(), 2, "{format}: no rope in the graph");
            // A grouped call returns its products as a tuple, one result per matrix.
            let qkv = text.lines().find(|l| l.contains("_rmsnorm_x3_rope\"")).unwrap();
            let results = qkv.rsplit_once(") -> (").unwrap().1;
            let q_k_v = [c.q_dim(), c.kv_dim(), c.kv_dim()].map(|m| format!("tensor<1x{m}xf32>"));
            assert_eq!(results.trim_end_matches(')'), q_k_v.join(", "), "{format}");
            assert_eq!(calls(&with, DECODE, ATTENTION_DECODE_WRITE_TARGET), layers, "{format}");
            // Longer calls keep the dots, and without kernels nothing is a custom call.
            assert_eq!(calls(&with, prefill, target), 0, "{format}");
            assert_eq!(calls(&with, prefill, ATTENTION_DECODE_WRITE_TARGET), 0, "{format}");
            // A batched decode attends for all its sequences in one call per layer.
            let batch = GraphSpec { kind: GraphKind::DecodeBatch { batch: 4 }, logits: true };
            let exact = |o: &GraphOptions, spec: GraphSpec, target: &str| {
                emit_module(&c, o, &[spec]).unwrap().matches(&format!("call_target_name = \"{target}\"")).count()
            };
            assert_eq!(exact(&with, batch, ATTENTION_DECODE_BATCH_TARGET), layers, "{format}");
            assert_eq!(exact(&with, batch, ATTENTION_DECODE_WRITE_TARGET), 0, "{format}");
            // ... which writes the sequences' new entries into the caches it returns in place of
            // its cache operands: the graph updates no cache itself.
            let text = emit_module(&c, &with, &[batch]).unwrap();
            assert_eq!(text.matches("#stablehlo.output_operand_alias<").count(), layers * 4 * 2, "{format}");
            assert!(!text.contains("dynamic_update_slice"), "{format}");
            assert!(!emit_module(&c, &base, &[DECODE]).unwrap().contains("custom_call"), "{format}");
            // The kernels read fp16 matrices row-major, [out, in] as stored.
            let args = graph_weight_args(&c, &with);
            let q = args.iter().find(|a| a.name.starts_with("model.layers.0.self_attn.q_proj")).unwrap();
            assert_eq!(q.shape[0], c.q_dim(), "{format}");
        }
        // Int8 activations: every int4 and int8 product calls its `_q8` target, an fp16 one its
        // exact target (the kernels round only what multiplies quantized weights).
        for format in [WeightFormat::F16, WeightFormat::Int4] {
            let q8 = GraphOptions {
                layers: LayerMode::UnrolledCachePerLayer,
                cache: StorageDtype::F32,
                host_kernels: Some(HostKernels {
                    max_tokens: 1,
                    calls: KernelCalls::XlaCustomCall,
                    activations: KernelActivations::Int8,
                }),
                ..options(format)
            };
            let text = emit_module(&c, &q8, &[DECODE]).unwrap();
            let count = |prefix: &str| text.matches(&format!("call_target_name = \"{prefix}")).count();
            match format {
                WeightFormat::F16 => {
                    assert_eq!(count("seam_linear_f16"), 4 * layers + 1);
                    assert_eq!(count("seam_linear_f16_q8"), 0);
                }
                WeightFormat::Int4 => {
                    assert_eq!(count("seam_linear_int4_q8"), 4 * layers);
                    assert_eq!(count("seam_linear_int4"), 4 * layers);
                    assert_eq!(count("seam_linear_int8_q8"), 1);
                }
            }
            // Kernels that take every call read the layers' int4 matrices in panels (ADR 0025),
            // and the int8 embedding and head.
            let every_call = GraphOptions {
                host_kernels: Some(HostKernels { max_tokens: usize::MAX, ..q8.host_kernels.unwrap() }),
                ..q8.clone()
            };
            let args = graph_weight_args(&c, &every_call);
            let panels = args.iter().filter(|a| matches!(a.part, WeightPart::Int4Packed(MatrixOrder::Panels))).count();
            let text = emit_module(
                &c,
                &every_call,
                &[DECODE, GraphSpec { kind: GraphKind::Prefill { bucket: 16 }, logits: false }],
            )
            .unwrap();
            let count = |prefix: &str| text.matches(&format!("call_target_name = \"{prefix}")).count();
            match format {
                WeightFormat::F16 => assert_eq!((every_call.matrix_order(), panels), (MatrixOrder::Panels, 0)),
                WeightFormat::Int4 => {
                    assert_eq!(panels, 7 * layers);
                    assert_eq!(count("seam_linear_int4p_q8"), 2 * 4 * layers);
                    assert_eq!(count("seam_linear_int4_q8"), 0);
                    // The int8 head (vocab a multiple of 16) in panels too; the embedding's rows
                    // are gathered from them.
                    assert!(count("seam_linear_int8p_q8") >= 1);
                    assert_eq!(count("seam_linear_int8_q8"), 0);
                    let int8_panels =
                        args.iter().filter(|a| matches!(a.part, WeightPart::Int8Codes(MatrixOrder::Panels))).count();
                    assert_eq!(int8_panels, if c.tie_word_embeddings { 1 } else { 2 });
                }
            }
            assert_eq!(q8.matrix_order(), MatrixOrder::RowMajor, "calls above max_tokens keep the graph's dots");
            // Padding rows cost nothing only where the kernels take the bucket's calls.
            assert_eq!(every_call.padding_cost(16), crate::PaddingCost::Skipped);
            assert_eq!(q8.padding_cost(16), crate::PaddingCost::Full);
            assert_eq!(options(format).padding_cost(16), crate::PaddingCost::Full);
        }
        // Exact activations read the same panels, through their own targets.
        let exact_every_call = GraphOptions {
            layers: LayerMode::UnrolledCachePerLayer,
            cache: StorageDtype::F32,
            host_kernels: Some(HostKernels {
                max_tokens: usize::MAX,
                calls: KernelCalls::XlaCustomCall,
                activations: KernelActivations::Exact,
            }),
            ..options(WeightFormat::Int4)
        };
        assert_eq!(exact_every_call.matrix_order(), MatrixOrder::Panels);
        let text = emit_module(&c, &exact_every_call, &[DECODE]).unwrap();
        let count = |prefix: &str| text.matches(&format!("call_target_name = \"{prefix}")).count();
        assert_eq!(count("seam_linear_int4p"), 4 * layers);
        assert_eq!(count("seam_linear_int4p_q8"), 0);
        assert_eq!((count("seam_linear_int4_"), count("seam_linear_int4\"")), (0, 0), "no row-major int4 product left");
        assert_eq!(count("seam_linear_int8p"), 1);
        let names: std::collections::HashSet<String> = linear_targets().into_iter().map(|t| t.name).collect();
        assert_eq!(names.len(), 126, "every target its own name");
        assert!(names.contains("seam_linear_int4p_q8_rmsnorm_x3") && names.contains("seam_linear_f16_x2"));
        assert!(names.contains("seam_linear_int4p_q8_rmsnorm_x3_rope") && names.contains("seam_linear_int8_x3_rope"));
        assert!(names.contains("seam_linear_int4p_q8_swiglu_residual"));
        assert!(names.contains("seam_linear_int4_q8_rmsnorm_residual"));

        // An f16 cache is the kernels' too (ADR 0038): the attention calls take and return it.
        let f16_cache = GraphOptions {
            layers: LayerMode::UnrolledCachePerLayer,
            host_kernels: Some(HostKernels {
                max_tokens: 1,
                calls: KernelCalls::XlaCustomCall,
                activations: KernelActivations::Exact,
            }),
            ..options(WeightFormat::F16)
        };
        let text = emit_module(&c, &f16_cache, &[DECODE]).unwrap();
        assert!(text.contains("seam_attention") && text.contains("xf16>"), "the kernels attend over f16 caches");

        // A padded call tells every product and every causal attention how many of its rows
        // are real: its `count` argument (the third) is the last operand of each of the layers'
        // products and the fifth of each attention call; the LM head, one row, gets a constant,
        // and the greedy token is the argmax kernel's. Attention writes and reads the stacked
        // caches through the causal kernel, with no mask and no cache update left in the graph.
        let kernels = GraphOptions {
            layers: LayerMode::UnrolledCachePerLayer,
            cache: StorageDtype::F32,
            host_kernels: Some(HostKernels {
                max_tokens: 4,
                calls: KernelCalls::XlaCustomCall,
                activations: KernelActivations::Exact,
            }),
            ..options(WeightFormat::Int4)
        };
        let text = emit_module(&c, &kernels, &[prefill]).unwrap();
        let calls: Vec<&str> = text.lines().filter(|l| l.contains("stablehlo.custom_call")).collect();
        assert_eq!(calls.len(), 5 * layers + 2);
        let attention: Vec<&&str> =
            calls.iter().filter(|l| l.contains(&format!("\"{ATTENTION_CAUSAL_WRITE_TARGET}\""))).collect();
        assert_eq!(attention.len(), layers);
        assert_eq!(calls.iter().filter(|l| l.contains(&format!("\"{ARGMAX_TARGET}\""))).count(), 1);
        let operands = |line: &str| {
            let inside = line.split("custom_call\"(").nth(1).unwrap().split(')').next().unwrap();
            inside.split(", ").map(str::to_string).collect::<Vec<_>>()
        };
        let counted = calls.iter().filter(|l| operands(l).last().unwrap() == "%arg2").count();
        assert_eq!(counted, 4 * layers, "{}", calls[0]);
        assert!(attention.iter().all(|l| operands(l)[4] == "%arg2"), "{}", attention[0]);
        assert!(!text.contains("stablehlo.dot_general"), "no product or attention left in the graph");
        assert!(!text.contains("dynamic_update_slice"), "no cache update left in the graph");
        assert_eq!(text.matches("#stablehlo.output_operand_alias<").count(), 2 * layers);
        assert_eq!(cache_arg_shapes(&c, &kernels).len(), 2, "caches stacked over the layers");
    }

    #[test]
    fn iree_dispatch_form_calls_the_kernels_as_executable_imports() {
        let c = tiny_llama32_config();
        let layers = c.num_hidden_layers;
        let options = GraphOptions {
            host_kernels: Some(HostKernels {
                max_tokens: usize::MAX,
                calls: KernelCalls::IreeDispatch,
                activations: KernelActivations::Exact,
            }),
            ..options(WeightFormat::Int4)
        };
        let prefill = GraphSpec { kind: GraphKind::Prefill { bucket: 4 }, logits: false };
        let text = emit_module(&c, &options, &[DECODE, prefill]).unwrap();
        assert!(!text.contains("custom_call"), "no XLA custom call in IREE's form");
        // Seven products per layer in four calls, the LM head and the greedy token, in both functions;
        // attention stays in the graph (the kernels' attention reads per-layer caches, which
        // these options lack).
        assert_eq!(text.matches("flow.dispatch @seam_kernels::@").count(), 2 * (4 * layers + 2));
        assert_eq!(text.matches(&format!("flow.dispatch @seam_kernels::@{ARGMAX_TARGET}_")).count(), 2);
        assert_eq!(text.matches("stream.executable private @seam_kernels").count(), 1);
        // One export per target and shape: the layers' same-shaped products share theirs.
        let exports = text.matches("stream.executable.export public @").count();
        assert!(exports < 2 * (4 * layers + 1), "{exports} exports");
        // Each target an import is declared once, with a bare-pointer calling convention.
        for line in text.lines().filter(|l| l.contains("func.func private @seam_linear_")) {
            assert!(line.contains("llvm.bareptr = true"), "{line}");
            let name = line.split('@').nth(1).unwrap().split('(').next().unwrap();
            assert_eq!(text.matches(&format!("func.func private @{name}(")).count(), 1, "{name}");
        }
        assert!(text.contains("stablehlo.dot_general"), "attention is the graph's own");

        // With per-layer caches each layer's attention is a dispatch too: a prefill's one
        // query head per workgroup (the workload is the heads) after a dispatch that writes the
        // chunk's entries, a decode's through the batch's dispatch of one sequence, which also
        // writes its entries; both update the caches as tied operands, and the graph writes no
        // cache itself. f16 caches take the same dispatches (their words say the element size).
        let f16 = GraphOptions { layers: LayerMode::UnrolledCachePerLayer, cache: StorageDtype::F16, ..options };
        assert!(f16.attention_kernel());
        let options = GraphOptions { layers: LayerMode::UnrolledCachePerLayer, cache: StorageDtype::F32, ..options };
        assert!(options.attention_kernel());
        let text = emit_module(&c, &options, &[DECODE, prefill]).unwrap();
        let one = attention_decode_many_target(1);
        assert_eq!(text.matches("flow.dispatch @seam_kernels::@").count(), 2 * (5 * layers + 2) + layers);
        assert_eq!(text.matches(&format!("flow.dispatch @seam_kernels::@{one}_")).count(), layers);
        assert_eq!(text.matches(&format!("flow.dispatch @seam_kernels::@{ATTENTION_CAUSAL_TARGET}_")).count(), layers);
        let writes: Vec<&str> = text
            .lines()
            .filter(|l| l.contains(&format!("flow.dispatch @seam_kernels::@{WRITE_ENTRIES_TARGET}_")))
            .collect();
        assert_eq!(writes.len(), layers);
        for line in &writes {
            // No new array: the results are the two caches, the layer's own arguments.
            let ties: Vec<&str> = line.rsplit_once("-> (").unwrap().1.trim_end_matches(')').split(", ").collect();
            assert!(ties.len() == 2 && ties.iter().all(|t| t.starts_with("%arg")), "{line}");
        }
        assert!(!text.contains("stablehlo.dot_general"), "every product and attention is a kernel");
        assert!(!text.contains("dynamic_update_slice"), "the caches are the dispatches' to write");
        assert!(!text.contains("stablehlo.dynamic_slice"), "the head's row is no slice at a computed offset");
        // The matrices are stacked over the layers (seven int4 matrices of three arguments),
        // the norms not: a dispatch binds a stacked argument whole and its export hands the
        // import the layer's part, from an element offset (no slice in the graph, which IREE
        // would copy on every call, ADR 0037).
        let args = graph_weight_args(&c, &options);
        assert_eq!(args.iter().filter(|a| a.name.starts_with("model.layers.*.")).count(), 7 * 3);
        assert_eq!(args.iter().filter(|a| a.part == WeightPart::Norm).count(), 2 * layers + 1);
        let weight_slices = text
            .lines()
            .filter(|l| l.contains("stablehlo.slice") && (l.contains("xi8>) ->") || l.contains("xf16>) ->")))
            .count();
        assert_eq!(weight_slices, 0, "no layer sliced out of a stacked argument");
        // An export function offsets none of its operands (layer 0, and the other kernels) or
        // the three of each int4 matrix it multiplies by (a later layer's: q, k and v's nine,
        // gate and up's six).
        let offset_counts: Vec<usize> =
            text.split("      func.func @").skip(1).map(|f| f.matches("= arith.addi %o").count()).collect();
        assert!(offset_counts.iter().all(|&n| [0, 3, 6, 9].contains(&n)), "{offset_counts:?}");
        assert!(offset_counts.contains(&9), "a later layer's products read from an offset");
        let heads = c.num_attention_heads;
        assert!(text.contains(&format!("= arith.constant {heads} : index\n    %")), "workload of the heads");
        for target in [one.as_str(), ATTENTION_CAUSAL_TARGET] {
            let line = text.lines().find(|l| l.contains(&format!("func.func private @{target}("))).unwrap();
            // Pointer and offset each of q, positions, the new keys and values, the caches and
            // the result (a decode), or of q, keys, values, position, rows and the result;
            // six shape words (the last the caches' element size), first and count.
            assert_eq!(line.matches("index").count(), 6 + 8 + usize::from(target == one), "{line}");
        }

        // A decode normalizes and gates inside the kernels' calls; a call of four rows and more
        // in the graph, every product then taking plain rows (once per workgroup would
        // repeat the preparation for each share of the output rows).
        let dispatches = |spec: GraphSpec, input: &str| {
            let text = emit_module(&c, &options, &[spec]).unwrap();
            text.lines()
                .filter(|l| l.contains("flow.dispatch @seam_kernels::@seam_linear_") && l.contains(input))
                .count()
        };
        let chunk = GraphSpec { kind: GraphKind::Prefill { bucket: PREPARE_IN_GRAPH_FROM_ROWS }, logits: false };
        assert_eq!(dispatches(DECODE, "_rmsnorm"), 2 * layers + 1);
        assert_eq!(dispatches(DECODE, "_swiglu"), layers);
        // The head reads the chunk's last row alone: its norm stays fused.
        assert_eq!(dispatches(chunk, "_rmsnorm"), 1);
        assert_eq!(dispatches(chunk, "_swiglu"), 0);
        assert_eq!(dispatches(chunk, ""), 4 * layers + 1);
        let text = emit_module(&c, &options, &[chunk]).unwrap();
        assert!(text.contains("stablehlo.sqrt") && text.contains("stablehlo.exponential"), "the norm and SwiGLU");
        // A batched decode's rows are prepared as a lone decode's, in the kernels: the same bits.
        let batch = GraphSpec { kind: GraphKind::DecodeBatch { batch: 8 }, logits: true };
        assert_eq!(dispatches(batch, "_rmsnorm"), 2 * layers + 1);
        assert_eq!(dispatches(batch, "_swiglu"), layers);

        // A batched decode attends in one dispatch per layer for all its sequences, which also
        // writes their entries into their caches, its tied operands: workgroups of one span of
        // one KV head of one sequence.
        for batch in [2, 5] {
            let spec = GraphSpec { kind: GraphKind::DecodeBatch { batch }, logits: true };
            let text = emit_module(&c, &options, &[spec]).unwrap();
            let target = attention_decode_many_target(batch);
            assert_eq!(text.matches(&format!("flow.dispatch @seam_kernels::@{target}_")).count(), layers, "{batch}");
            let one = attention_decode_many_target(1);
            assert!(!text.contains(&format!("func.func private @{one}(")), "no per-sequence call");
            assert_eq!(text.matches("stablehlo.dynamic_update_slice").count(), 0, "{batch}");
            let dispatch = text.lines().find(|l| l.contains(&format!("@seam_kernels::@{target}_"))).unwrap();
            let ties: Vec<&str> = dispatch.rsplit_once("-> (").unwrap().1.trim_end_matches(')').split(", ").collect();
            assert_eq!(ties.len(), 1 + 2 * batch, "{dispatch}");
            assert!(ties[0].starts_with("tensor<") && ties[1..].iter().all(|t| t.starts_with("%arg")), "{dispatch}");
            let line = text.lines().find(|l| l.contains(&format!("func.func private @{target}("))).unwrap();
            // q, positions, the new keys and values, two caches per sequence, result: pointer
            // and offset each; six shape words, first and count.
            assert_eq!(line.matches("index").count(), 2 * batch + 5 + 8, "{line}");
            // A workgroup per span of each KV head of each sequence; the result is their parts,
            // which the output projection merges.
            let (heads, kv_heads, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
            let units = batch * kv_heads * ATTENTION_DECODE_PARTS;
            assert!(text.contains(&format!("= arith.constant {units} : index\n    %")), "the batch's spans");
            let parts = format!("tensor<{batch}x{}x{}xf32>", ATTENTION_DECODE_PARTS * heads, 2 + d);
            assert!(ties[0] == parts, "{dispatch}");
            let merged = "seam_linear_int4p_attnparts_residual_";
            assert_eq!(text.matches(&format!("flow.dispatch @seam_kernels::@{merged}")).count(), layers, "{batch}");
        }
        // A batch over a dispatch's bindings takes a few dispatches: 16 as two of 8, 11 as 8 and 3.
        for (batch, groups) in [(16, vec![8, 8]), (11, vec![8, 3])] {
            let spec = GraphSpec { kind: GraphKind::DecodeBatch { batch }, logits: true };
            let text = emit_module(&c, &options, &[spec]).unwrap();
            let count = |size: usize| {
                let target = attention_decode_many_target(size);
                text.matches(&format!("flow.dispatch @seam_kernels::@{target}_")).count()
            };
            assert_eq!(count(batch), 0, "{batch}");
            for size in [8, 3] {
                assert_eq!(count(size), layers * groups.iter().filter(|&&g| g == size).count(), "{batch}: {size}");
            }
            assert!(groups.iter().all(|&g| g <= MAX_SEQUENCES_PER_ATTENTION_DISPATCH));
        }
    }

    #[test]
    fn highest_precision_marks_every_dot() {
        let c = tiny_llama32_config();
        let prefill = GraphSpec { kind: GraphKind::Prefill { bucket: 4 }, logits: false };
        let plain = emit_module(&c, &options(WeightFormat::F16), &[prefill]).unwrap();
        assert!(!plain.contains("precision_config"));
        let o = GraphOptions { highest_precision: true, ..options(WeightFormat::F16) };
        let text = emit_module(&c, &o, &[prefill]).unwrap();
        let highest = "precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]";
        assert!(text.matches("stablehlo.dot_general").count() > 0);
        assert_eq!(text.matches(highest).count(), text.matches("stablehlo.dot_general").count());
    }

    #[test]
    fn vector_products_reduce_one_row_calls_only() {
        let c = tiny_llama32_config();
        let prefill = GraphSpec { kind: GraphKind::Prefill { bucket: 4 }, logits: false };
        let mut attention_dots = Vec::new();
        for format in [WeightFormat::F16, WeightFormat::Int4] {
            let with = |products: VectorProducts, spec: GraphSpec| {
                let o = GraphOptions { vector_products: products, ..options(format) };
                emit_module(&c, &o, &[spec]).unwrap()
            };
            let count = |text: &str, what: &str| text.matches(what).count();
            let (dot, reduce) = (with(VectorProducts::Dot, DECODE), with(VectorProducts::Reduce, DECODE));
            // Decode: only attention's dots are left (those of fp16, where each of the seven
            // matrices of a layer and the head is one dot); every product is a reduction.
            attention_dots.push(count(&reduce, "stablehlo.dot_general"));
            if format == WeightFormat::F16 {
                assert_eq!(count(&dot, "stablehlo.dot_general") - attention_dots[0], 7 * c.num_hidden_layers + 1);
            }
            // One reduction per matrix: over the inputs of a row (fp16), over groups and pairs (int4, int8).
            let over_inputs = match format {
                WeightFormat::F16 => "dimensions = array<i64: 1>}",
                WeightFormat::Int4 => "dimensions = array<i64: 1, 2>}",
            };
            let matrices = 7 * c.num_hidden_layers + 1;
            assert!(count(&reduce, over_inputs) >= matrices, "{format:?}");
            assert!(count(&reduce, over_inputs) >= count(&dot, over_inputs) + matrices, "{format:?}");
            // Calls of several rows keep their dots, over the same (row-major) arguments.
            let prefill_reduce = with(VectorProducts::Reduce, prefill);
            assert_eq!(
                count(&prefill_reduce, "stablehlo.dot_general"),
                count(&with(VectorProducts::Dot, prefill), "stablehlo.dot_general"),
                "{format:?}"
            );
        }
        assert_eq!(attention_dots[0], attention_dots[1], "int4 decode keeps no product dot either");
        // Read as words: the same reductions, over codes shifted out of 32-bit words.
        let words = |format| {
            let o = GraphOptions { vector_products: VectorProducts::ReduceWords, ..options(format) };
            emit_module(&c, &o, &[DECODE]).unwrap()
        };
        let int4 = words(WeightFormat::Int4);
        assert_eq!(int4.matches("stablehlo.dot_general").count(), attention_dots[1]);
        assert!(int4.matches("stablehlo.bitcast_convert").count() >= 7 * c.num_hidden_layers);
        assert!(int4.contains("stablehlo.shift_right_arithmetic"), "the int8 head's bytes, sign-extended");
        assert!(!words(WeightFormat::F16).contains("bitcast_convert"), "fp16 reads its f16 values");
        // Read as the compiler's packed 4-bit type: a bitcast to ui4 per int4 matrix, no shifts.
        let nibbles = GraphOptions { vector_products: VectorProducts::ReduceNibbles, ..options(WeightFormat::Int4) };
        let int4 = emit_module(&c, &nibbles, &[DECODE]).unwrap();
        assert_eq!(int4.matches("stablehlo.dot_general").count(), attention_dots[1]);
        assert!(int4.matches("xui4>").count() >= 7 * c.num_hidden_layers);
        assert!(!int4.contains("shift_right_logical"), "no nibble is shifted out by the graph");
        assert_eq!(nibbles.dense_layout(), crate::DenseLayout::RowMajor);
        let dense = GraphOptions { vector_products: VectorProducts::Reduce, ..options(WeightFormat::F16) };
        assert_eq!(dense.dense_layout(), crate::DenseLayout::RowMajor);
    }

    #[test]
    fn cuda_kernels_take_every_product_of_decode_only() {
        let c = tiny_llama32_config();
        let layers = c.num_hidden_layers;
        let prefill = GraphSpec { kind: GraphKind::Prefill { bucket: 4 }, logits: false };
        let decode_spec = GraphSpec { kind: GraphKind::Decode, logits: true };
        let calls = |text: &str, targets: [&str; 3]| {
            targets.map(|t| text.matches(&format!("call_target_name = \"{t}\"")).count())
        };
        let plain = [CUDA_ROWS_F16_TARGET, CUDA_ROWS_INT8_TARGET, CUDA_ROWS_INT4_TARGET];
        let normed = [CUDA_NORMED_ROWS_F16_TARGET, CUDA_NORMED_ROWS_INT8_TARGET, CUDA_NORMED_ROWS_INT4_TARGET];
        let residual = [CUDA_RESIDUAL_ROWS_F16_TARGET, CUDA_RESIDUAL_ROWS_INT8_TARGET, CUDA_RESIDUAL_ROWS_INT4_TARGET];
        let reductions = |text: &str| text.matches("stablehlo.reduce\"").count();
        for format in [WeightFormat::F16, WeightFormat::Int4] {
            // The norms' and the softmax's reductions only, as where fp16's products are dots.
            let dots = GraphOptions { vector_products: VectorProducts::Dot, ..options(WeightFormat::F16) };
            let dots = emit_module(&c, &dots, &[decode_spec]).unwrap();

            // One call per product, the norms in the graph.
            let o = GraphOptions { vector_products: VectorProducts::CudaKernelsEach, ..options(format) };
            assert_eq!(o.dense_layout(), crate::DenseLayout::RowMajor);
            let decode = emit_module(&c, &o, &[decode_spec]).unwrap();
            let [f16, int8, int4] = calls(&decode, plain);
            assert_eq!(f16 + int8 + int4, 7 * layers + 1, "{format:?}: seven per layer, and the LM head");
            assert_eq!(calls(&decode, normed), [0; 3], "{format:?}");
            assert_eq!(calls(&decode, residual), [0; 3], "{format:?}");
            match format {
                WeightFormat::F16 => assert_eq!(f16, 7 * layers + 1),
                _ => assert!(int4 >= 7 * layers && f16 == 0, "{format:?}: {int8} int8, {int4} int4"),
            }
            assert_eq!(reductions(&decode), reductions(&dots), "{format:?}: no product left as a reduction");
            assert!(!emit_module(&c, &o, &[prefill]).unwrap().contains("seam_cuda"), "{format:?}: prefill keeps dots");

            // Grouped: q, k, v one call and gate, up another, each with its norm folded in; o and
            // down a call each, with the residual add folded in; the LM head with the final norm.
            let o = GraphOptions { vector_products: VectorProducts::CudaKernels, ..options(format) };
            assert_eq!(o.dense_layout(), crate::DenseLayout::RowMajor);
            let decode = emit_module(&c, &o, &[decode_spec]).unwrap();
            assert_eq!(calls(&decode, plain), [0; 3], "{format:?}");
            let [residual_f16, residual_int8, residual_int4] = calls(&decode, residual);
            let [normed_f16, normed_int8, normed_int4] = calls(&decode, normed);
            assert_eq!(residual_f16 + residual_int8 + residual_int4, 2 * layers, "{format:?}: o and down");
            assert_eq!(normed_f16 + normed_int8 + normed_int4, 2 * layers + 1, "{format:?}: qkv, gate-up, the head");
            if format == WeightFormat::F16 {
                assert_eq!((residual_int8, residual_int4, normed_int8, normed_int4), (0, 0, 0, 0));
            }
            // A call of three products has three results, one of two two; their types in order.
            let q_rows = c.num_attention_heads * c.head_dim;
            let kv_rows = c.num_key_value_heads * c.head_dim;
            let qkv = format!("-> (tensor<1x{q_rows}xf32>, tensor<1x{kv_rows}xf32>, tensor<1x{kv_rows}xf32>)");
            let i = c.intermediate_size;
            let gate_up = format!("-> (tensor<1x{i}xf32>, tensor<1x{i}xf32>)");
            assert_eq!(decode.matches(&qkv).count(), layers, "{format:?}: {qkv}");
            assert_eq!(decode.matches(&gate_up).count(), layers, "{format:?}: {gate_up}");
            // What a runtime tunes the kernels for: the same calls, read back from the text.
            let h = c.hidden_size;
            let calls = cuda_calls(&decode);
            assert_eq!(calls.len(), 4 * layers + 1, "{format:?}");
            let shaped =
                |rows: &[usize], k: usize| calls.iter().filter(|call| call.rows == rows && call.k == k).count();
            assert_eq!(shaped(&[q_rows, kv_rows, kv_rows], h), layers, "{format:?}: {calls:?}");
            assert_eq!(shaped(&[i, i], h), layers, "{format:?}");
            assert_eq!(shaped(&[h], i), layers, "{format:?}: down");
            assert_eq!(shaped(&[c.vocab_size], h), 1, "{format:?}: the LM head");
            assert!(calls.iter().all(|call| call.target.starts_with("seam_cuda_")));
            // The norms are the kernels' now: one reduction fewer per norm (two per layer and the
            // final one).
            assert_eq!(reductions(&decode), reductions(&dots) - (2 * layers + 1), "{format:?}");
            assert!(!emit_module(&c, &o, &[prefill]).unwrap().contains("seam_cuda"), "{format:?}: prefill keeps dots");
        }
        // Matrices held in f32 are not the kernels' format: they keep the reductions.
        for products in [VectorProducts::CudaKernels, VectorProducts::CudaKernelsEach] {
            let f32_dense =
                GraphOptions { vector_products: products, dense: StorageDtype::F32, ..options(WeightFormat::F16) };
            let decode = emit_module(&c, &f32_dense, &[DECODE]).unwrap();
            assert!(!decode.contains("seam_cuda"));
            let reduce = GraphOptions { vector_products: VectorProducts::Reduce, ..f32_dense };
            assert_eq!(decode, emit_module(&c, &reduce, &[DECODE]).unwrap());
        }
    }

    #[test]
    fn int4_dequantize_threshold() {
        let c = tiny_llama32_config();
        let dots = |from: usize, spec: GraphSpec| {
            let o = GraphOptions { int4_dequantize_from: from, ..options(WeightFormat::Int4) };
            emit_module(&c, &o, &[spec]).unwrap().matches("stablehlo.dot_general").count()
        };
        let prefill = GraphSpec { kind: GraphKind::Prefill { bucket: 4 }, logits: false };
        // The per-group form takes three dots per matrix, the dequantized form one.
        assert!(dots(1, DECODE) < dots(PREFILL_DEQUANTIZE_MIN_TOKENS, DECODE));
        assert_eq!(dots(1, DECODE), dots(1, prefill));
        assert_eq!(dots(5, prefill), dots(5, DECODE));
        assert!(dots(4, prefill) < dots(5, prefill));
    }
}
