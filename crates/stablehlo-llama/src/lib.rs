//! # stablehlo-llama: Llama graphs as StableHLO text, for seam's compiler backends
//!
//! [`emit_module`] writes the decode-step and prefill graphs (from token ids, or from embedding
//! rows: [`GraphKind::PrefillEmbeddings`]) of a Llama model (from its
//! [`llama_model::LlamaConfig`]) as an MLIR module in StableHLO's generic form, which IREE's
//! `iree-compile` and XLA's PJRT plugins both accept. Weights are runtime arguments
//! ([`weight_args`] gives their order, shapes and types; [`host_args`] the bytes to upload from a
//! [`llama_model::LlamaWeights`]), never constants. The KV cache is an f16 argument returned
//! updated, written with `dynamic_update_slice`, so a runtime that donates the input buffer updates
//! it in place. The full contract is in `docs/backends/stablehlo-graphs.md`.

pub mod arguments;
pub mod buckets;
pub mod error;
pub mod graph;
pub mod mlir;

pub use arguments::{
    for_each_graph_host_arg, graph_host_args, graph_weight_args, host_args, host_args_with, stack_host_args,
    stack_weight_args, weight_args, weight_args_with, ArgDtype, ArgLayout, DenseLayout, HostArg, MatrixOrder, Stacked,
    StorageDtype, WeightArg, WeightPart,
};
pub use buckets::{
    buckets_for_context, plan_prefill, plan_prefill_embeddings, PaddingCost, PlannedCall, DEFAULT_BUCKETS,
};
pub use error::GraphError;
pub use graph::{
    attention_decode_many_target, cache_arg_shapes, cuda_calls, emit_entry_module, emit_module, linear_group_target,
    linear_target, linear_targets, CudaCall, GraphKind, GraphOptions, GraphSpec, HostKernels, KernelActivations,
    KernelCalls, KernelInput, LayerMode, LinearTarget, VectorProducts, ARGMAX_TARGET, ATTENTION_CAUSAL_TARGET,
    ATTENTION_CAUSAL_WRITE_TARGET, ATTENTION_DECODE_BATCH_TARGET, ATTENTION_DECODE_MANY_TARGET, ATTENTION_DECODE_PARTS,
    ATTENTION_DECODE_WRITE_TARGET, CUDA_NORMED_ROWS_F16_TARGET, CUDA_NORMED_ROWS_INT4_TARGET,
    CUDA_NORMED_ROWS_INT8_TARGET, CUDA_RESIDUAL_ROWS_F16_TARGET, CUDA_RESIDUAL_ROWS_INT4_TARGET,
    CUDA_RESIDUAL_ROWS_INT8_TARGET, CUDA_ROWS_F16_TARGET, CUDA_ROWS_INT4_TARGET, CUDA_ROWS_INT8_TARGET,
    MAX_DECODE_BATCH, MAX_GROUPED_PRODUCTS, PREFILL_DEQUANTIZE_MIN_TOKENS, WRITE_ENTRIES_TARGET,
};
