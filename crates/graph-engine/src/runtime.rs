//! The trait a runtime implements to run seam's graphs, and what passes through it.

use crate::prepared_weights::PreparedWeights;
use session_api::Result;
use stablehlo_llama::GraphSpec;

/// How many graphs a load compiled and how many came from the disk cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CompileReport {
    /// Compiled during this call.
    pub compiled: usize,
    /// Read from the disk cache.
    pub from_cache: usize,
}

impl std::ops::AddAssign for CompileReport {
    fn add_assign(&mut self, other: CompileReport) {
        self.compiled += other.compiled;
        self.from_cache += other.from_cache;
    }
}

/// The input rows of one call, padded to the graph's bucket.
#[derive(Debug, Clone, PartialEq)]
pub enum GraphInput {
    /// Token ids, `bucket` of them (zeros after the real ones).
    Tokens(Vec<i32>),
    /// Embedding rows, `bucket * hidden_size` values (zero rows after the real ones).
    Embeddings(Vec<f32>),
}

/// One execution of a compiled graph.
#[derive(Debug, Clone, PartialEq)]
pub struct GraphCall {
    /// Which graph (loaded earlier by [`GraphRuntime::load_graphs`]).
    pub graph: GraphSpec,
    /// Its input, padded to the graph's rows.
    pub input: GraphInput,
    /// Where the rows go in the sequence.
    pub position: usize,
    /// Real rows among the input; passed to every graph but decode.
    pub count: usize,
    /// Whether to copy the last position's logits back to the host.
    pub read_logits: bool,
}

/// One execution of a [`stablehlo_llama::GraphKind::DecodeBatch`] graph: a token for each of its
/// sequences, each at its own position in its own cache.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchCall {
    /// Which graph (loaded earlier by [`GraphRuntime::load_graphs`]).
    pub graph: GraphSpec,
    /// One token per sequence, in the order of the caches.
    pub tokens: Vec<i32>,
    /// Each sequence's position: where its token goes.
    pub positions: Vec<i32>,
    /// Whether to copy the logits (every sequence's row) back to the host.
    pub read_logits: bool,
}

/// What one execution returns to the host.
#[derive(Debug, Clone, PartialEq)]
pub struct GraphOutput {
    /// The device's argmax of the last real position's logits.
    pub token: u32,
    /// Those logits, when the call asked for them.
    pub logits: Option<Vec<f32>>,
}

/// A runtime that executes seam's StableHLO graphs of one model: what IREE, PJRT or a vendor's
/// compiler provides. It is built for one model and one set of graph options (the backend's
/// `make_runtime` in [`crate::load_engine`]), so it can emit and compile the graphs itself.
///
/// Every graph takes the session's cache buffers, updates them in place (the graphs alias them
/// to their results) and returns the greedy token and the logits. A call that fails may have
/// consumed the cache: the engine then asks for a fresh one before the session is used again.
pub trait GraphRuntime: Send + Sync + 'static {
    /// One session's KV cache on the device. Dropping it frees the device memory.
    type Cache: Send + 'static;

    /// Compiles (or reads from the disk cache) and loads `graphs`. Called once at load for the
    /// token graphs, and later for a graph first needed by a step (embedding input).
    fn load_graphs(&self, graphs: &[GraphSpec]) -> Result<CompileReport>;

    /// Whether graphs are loaded one by one at no extra cost (an executable per graph, as PJRT
    /// has): the engine then loads the decode graph at load and each prefill graph the first
    /// time a call needs it, so that a start pays only for the graphs it uses. A runtime that
    /// builds one module of all the graphs it is given (IREE) keeps the default, `false`: every
    /// token graph is loaded at once, at load.
    fn loads_graphs_separately(&self) -> bool {
        false
    }

    /// Uploads the weights, in the graphs' argument order, for every later call. They are views
    /// of a read-only mapping ([`PreparedWeights`]): a runtime whose buffers live in host memory
    /// may keep [`PreparedWeights::memory`] and use the bytes in place; any other copies them.
    fn upload_weights(&self, weights: &PreparedWeights) -> Result<()>;

    /// A zeroed cache.
    fn new_cache(&self) -> Result<Self::Cache>;

    /// Zeroes `cache` in place, leaving it as [`GraphRuntime::new_cache`] makes one, so that the
    /// engine can give a closed session's cache to the next new one: a new cache is new memory,
    /// whose pages the system must map and clear on first touch, and on a CPU that costs a new
    /// session about as long as prefilling a short prompt. `Ok(false)` where the runtime cannot
    /// (the default: the engine then keeps no closed session's cache); an error where the cache
    /// is not whole (a failed call consumed it): the engine drops it.
    fn zero_cache(&self, cache: &mut Self::Cache) -> Result<bool> {
        let _ = cache;
        Ok(false)
    }

    /// A new cache holding a copy of `cache`.
    fn copy_cache(&self, cache: &Self::Cache) -> Result<Self::Cache>;

    /// Runs `call` on `cache`, updating it.
    fn execute(&self, cache: &mut Self::Cache, call: &GraphCall) -> Result<GraphOutput>;

    /// Whether the runtime runs [`BatchCall`]s ([`GraphRuntime::execute_batch`]): the engine then
    /// claims batched decode and advances many sessions in one call. The default, `false`, has
    /// the engine step a batch's sessions one by one.
    fn decodes_batches(&self) -> bool {
        false
    }

    /// Runs `call` on the caches of its sequences (`caches[i]` is sequence `i`'s), updating
    /// each, and returns each sequence's output in order. Called only where
    /// [`GraphRuntime::decodes_batches`]. A call that fails may have consumed every one of the
    /// caches, as [`GraphRuntime::execute`] may its one.
    fn execute_batch(&self, caches: &mut [&mut Self::Cache], call: &BatchCall) -> Result<Vec<GraphOutput>> {
        let _ = (caches, call);
        Err(session_api::SeamError::Unsupported {
            backend: "this graph runtime".into(),
            feature: format!("batched decode graphs ({})", call.graph.name()),
        })
    }

    /// The device's memory bandwidth from a probe on it ([`session_api::Engine::measure_memory_bandwidth`]);
    /// `None` where the runtime has no probe.
    fn measure_memory_bandwidth(&self) -> Result<Option<f64>> {
        Ok(None)
    }
}
