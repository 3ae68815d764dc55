//! # graph-engine: one engine for every runtime that executes seam's StableHLO graphs
//!
//! IREE and PJRT (and the next compiler runtime) run the same graphs from [`stablehlo_llama`]
//! the same way: weights uploaded once, a KV cache per session kept on the device and updated in
//! place by every call, prompts cut into calls of a few compiled bucket sizes, the greedy token
//! picked on the device. This crate is that engine, written once over a small trait,
//! [`GraphRuntime`], which a runtime implements with what is specific to it: compiling and loading
//! graphs, device buffers, executing one planned call, copying a cache.
//!
//! - [`load_engine`] reads a model directory, compiles (or takes from the disk cache) the token
//!   graphs while the weights are laid out and uploaded, and returns a [`GraphEngine`];
//! - [`GraphEngine`] implements `session_api::Engine`: its sessions' raw steps plan each append
//!   over the buckets ([`stablehlo_llama::plan_prefill`]), feed embeddings through graphs that are
//!   compiled the first time they are needed, rewind by position alone, and fork by copying the
//!   cache; session-api's checked session adds the contract's rules and sampling on top;
//! - [`ArtifactCache`] is the on-disk cache of compiled graphs both runtimes use, keyed by
//!   everything that decides the compiled code and verified by hash on every read;
//! - [`WeightsCache`] holds the weights as the graphs take them, prepared by a model's first load
//!   and memory-mapped by later ones ([`PreparedWeights`]).

pub mod artifact_cache;
mod engine;
pub mod linear_kernels;
mod load;
pub mod prepared_weights;
pub mod runtime;

pub use artifact_cache::{ArtifactCache, CacheOutcome};
pub use engine::{
    batch_graph, capabilities_with, embedding_graph, graph_groups, scoring_graph, split_batch, token_graphs,
    GraphEngine, DECODE_BATCHES, DEFAULT_MAX_CONTEXT, IDLE_CACHES,
};
pub use load::{load_engine, plan_graphs, refuse_thread_count, GraphPlan, GraphSettings, LoadedModel};
pub use prepared_weights::{PreparedArg, PreparedWeights, WeightsCache, WeightsOrigin};
pub use runtime::{BatchCall, CompileReport, GraphCall, GraphInput, GraphOutput, GraphRuntime};
