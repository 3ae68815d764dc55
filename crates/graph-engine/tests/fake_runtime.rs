//! A backend from a runtime alone: a small fake [`GraphRuntime`] that "executes" each graph call
//! on the reference transformer (in place of a compiler and a device) gets the whole engine, its
//! sessions and the contract's rules from `graph_engine`, and must pass seam's conformance suite,
//! embeddings and poisoning cases included.
//!
//! The fake keeps the graphs' semantics, not the reference's convenience: a call writes its rows
//! at `position` over whatever the cache held there (stale entries after a rewind), reads back
//! logits only when asked, refuses graphs that were not loaded and weights that were never
//! uploaded, and checks that the uploaded arguments are the ones the graphs declare.
//!
//! `harness = false`: this `main` is the test; the tiny models only (the real model is the
//! compiler backends' business).

use backend_reference::{EngineOptions, ReferenceEngine};
use conformance::{Outcome, RealModelParity, SuiteOptions, Target};
use graph_engine::{
    capabilities_with, graph_groups, BatchCall, CompileReport, GraphCall, GraphInput, GraphOutput, GraphRuntime,
    GraphSettings, LoadedModel, PreparedWeights, DEFAULT_MAX_CONTEXT,
};
use session_api::{
    Availability, Backend, BatchEntry, Capabilities, Engine, LoadRequest, Result, SeamError, Session, SessionOptions,
    SessionSteps, StepInput, WeightFormat,
};
use stablehlo_llama::{
    buckets_for_context, emit_entry_module, graph_weight_args, GraphKind, GraphOptions, GraphSpec, LayerMode,
    StorageDtype, VectorProducts,
};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

const NAME: &str = "fake-graph";

struct FakeRuntime {
    reference: Arc<dyn Engine>,
    config: llama_model::LlamaConfig,
    options: GraphOptions,
    loaded: Mutex<Vec<String>>,
    uploaded: AtomicBool,
    /// Set once the engine was prepared for serving: from then on a load is refused.
    sealed: AtomicBool,
}

impl FakeRuntime {
    fn new(model_dir: &Path, model: LoadedModel<'_>) -> Result<FakeRuntime> {
        let weights = llama_model::weights::load_weights(model_dir, model.options.format, None)?;
        let options = EngineOptions { max_context: Some(model.options.max_context), ..EngineOptions::default() };
        let reference: Arc<dyn Engine> = Arc::new(ReferenceEngine::from_weights(&weights, options)?);
        Ok(FakeRuntime {
            reference,
            config: model.config.clone(),
            options: model.options.clone(),
            loaded: Mutex::new(Vec::new()),
            uploaded: AtomicBool::new(false),
            sealed: AtomicBool::new(false),
        })
    }
}

/// A cache: the reference's steps and how many positions they hold.
struct FakeCache {
    steps: Box<dyn SessionSteps>,
    filled: usize,
}

impl GraphRuntime for FakeRuntime {
    type Cache = FakeCache;

    fn load_graphs(&self, graphs: &[GraphSpec]) -> Result<CompileReport> {
        if self.sealed.load(Ordering::SeqCst) {
            return Err(SeamError::Backend(format!("{graphs:?} loaded after the engine was prepared for serving")));
        }
        // A group the plan does not list is one that compiling ahead (`seam compile`) would miss.
        let planned = graph_groups(&buckets_for_context(self.options.max_context));
        if !planned.iter().any(|group| group == graphs) {
            return Err(SeamError::Backend(format!("{graphs:?} is not a group of graph_groups: {planned:?}")));
        }
        for graph in graphs {
            // Every graph the engine asks for must be one the emitter can write.
            emit_entry_module(&self.config, &self.options, *graph)
                .map_err(|e| SeamError::Backend(format!("{}: {e}", graph.name())))?;
            self.loaded.lock().unwrap().push(graph.name());
        }
        Ok(CompileReport { compiled: graphs.len(), from_cache: 0 })
    }

    fn upload_weights(&self, weights: &PreparedWeights) -> Result<()> {
        let declared = graph_weight_args(&self.config, &self.options);
        let given: Vec<_> = weights.args().iter().map(|w| w.spec.clone()).collect();
        if given != declared {
            return Err(SeamError::Backend("the uploaded weights are not the graphs' arguments".into()));
        }
        self.uploaded.store(true, Ordering::SeqCst);
        Ok(())
    }

    fn new_cache(&self) -> Result<FakeCache> {
        Ok(FakeCache { steps: self.reference.open_steps(&SessionOptions::default())?, filled: 0 })
    }

    fn copy_cache(&self, cache: &FakeCache) -> Result<FakeCache> {
        Ok(FakeCache { steps: cache.steps.fork(cache.filled)?, filled: cache.filled })
    }

    fn execute(&self, cache: &mut FakeCache, call: &GraphCall) -> Result<GraphOutput> {
        let name = call.graph.name();
        if !self.loaded.lock().unwrap().contains(&name) {
            return Err(SeamError::Backend(format!("{name} was never loaded")));
        }
        if !self.uploaded.load(Ordering::SeqCst) {
            return Err(SeamError::Backend("no weights uploaded".into()));
        }
        if call.position > cache.filled || call.position + call.count > self.options.max_context {
            return Err(SeamError::Backend(format!(
                "a call at {} of {} rows on a cache of {}",
                call.position, call.count, cache.filled
            )));
        }
        // Positions from `position` on are stale (a rewind): the call overwrites them.
        cache.steps.truncate(call.position)?;
        let ids: Vec<u32>;
        let hidden = self.config.hidden_size;
        let input = match &call.input {
            GraphInput::Tokens(padded) => {
                ids = padded[..call.count].iter().map(|&t| t as u32).collect();
                StepInput::Tokens(&ids)
            }
            GraphInput::Embeddings(padded) => {
                StepInput::Embeddings { values: &padded[..call.count * hidden], count: call.count }
            }
        };
        let logits = cache
            .steps
            .append(call.position, input, true)?
            .logits
            .ok_or_else(|| SeamError::Backend("no logits".into()))?;
        cache.filled = call.position + call.count;
        let token = session_api::sampling::argmax(&logits);
        Ok(GraphOutput { token, logits: call.read_logits.then_some(logits) })
    }

    fn decodes_batches(&self) -> bool {
        true
    }

    fn execute_batch(&self, caches: &mut [&mut FakeCache], call: &BatchCall) -> Result<Vec<GraphOutput>> {
        let GraphKind::DecodeBatch { batch } = call.graph.kind else {
            return Err(SeamError::Backend(format!("{} is not a batched decode graph", call.graph.name())));
        };
        if caches.len() != batch || call.tokens.len() != batch || call.positions.len() != batch {
            return Err(SeamError::Backend(format!("{} given {} caches", call.graph.name(), caches.len())));
        }
        // Each sequence is the one-row call it stands for, at its own position.
        let name = call.graph.name();
        if !self.loaded.lock().unwrap().contains(&name) {
            return Err(SeamError::Backend(format!("{name} was never loaded")));
        }
        let decode = GraphSpec { kind: GraphKind::Decode, logits: true };
        caches
            .iter_mut()
            .zip(call.tokens.iter().zip(&call.positions))
            .map(|(cache, (&token, &position))| {
                let one = GraphCall {
                    graph: decode,
                    input: GraphInput::Tokens(vec![token]),
                    position: position as usize,
                    count: 1,
                    read_logits: call.read_logits,
                };
                self.execute(cache, &one)
            })
            .collect()
    }
}

/// The backend, from [`FakeRuntime`] and `graph_engine` alone.
struct FakeBackend;

impl Backend for FakeBackend {
    fn name(&self) -> &str {
        NAME
    }
    fn description(&self) -> &str {
        "test-only: graph_engine over a fake runtime that runs each call on the reference transformer"
    }
    fn availability(&self) -> Availability {
        Availability::Available { devices: vec![backend_reference::cpu_device()] }
    }
    fn capabilities(&self) -> Capabilities {
        capabilities_with(DEFAULT_MAX_CONTEXT, true)
    }
    fn load(&self, request: &LoadRequest) -> Result<Arc<dyn Engine>> {
        Ok(Arc::new(load_fake(request)?))
    }
}

fn load_fake(request: &LoadRequest) -> Result<graph_engine::GraphEngine<FakeRuntime>> {
    {
        let settings = GraphSettings {
            layers: LayerMode::UnrolledCachePerLayer,
            dense: StorageDtype::F32,
            cache: StorageDtype::F32,
            int4_dequantize_from: 1,
            host_kernels: None,
            vector_products: VectorProducts::Dot,
            highest_precision: false,
        };
        let settings = settings.with_request(NAME, request, "SEAM_FAKE_GRAPH")?;
        let engine = graph_engine::load_engine(NAME, "cpu", request, settings, |model| {
            FakeRuntime::new(&request.model_dir, model)
        })?;
        let info = engine.info();
        if info.decode_bytes_per_token.is_none_or(|bytes| bytes <= info.weight_bytes) {
            return Err(SeamError::Backend(format!(
                "decode reads the weights and the cache, yet {:?} bytes per token for {} bytes of weights",
                info.decode_bytes_per_token, info.weight_bytes
            )));
        }
        Ok(engine)
    }
}

/// After `prepare_for_serving(5)` the engine decodes batches of up to five sequences (a call of
/// four and a lone one) without loading any graph: a server never compiles while serving.
fn prepared_engine_loads_nothing_while_serving() -> std::result::Result<(), String> {
    let models = conformance::models::tiny_models(&conformance::models::default_cache_dir())?;
    let request = LoadRequest::new(&models[0].dir, WeightFormat::F16);
    let engine = load_fake(&request).map_err(|e| e.to_string())?;
    engine.prepare_for_serving(5).map_err(|e| e.to_string())?;
    engine.runtime().sealed.store(true, Ordering::SeqCst);
    let engine: Arc<dyn Engine> = Arc::new(engine);
    let mut sessions = Vec::new();
    for i in 0..5u32 {
        let mut session = engine.new_checked_session(SessionOptions::default()).map_err(|e| e.to_string())?;
        session.prefill(&[1 + i, 2, 3]).map_err(|e| e.to_string())?;
        sessions.push(session);
    }
    let mut entries: Vec<BatchEntry<'_>> =
        sessions.iter_mut().map(|session| BatchEntry { session, token: 4 }).collect();
    for result in engine.decode_batch(&mut entries) {
        result.map_err(|e| format!("a batched decode after prepare_for_serving: {e}"))?;
    }
    Ok(())
}

fn main() {
    let options = SuiteOptions { progress: true, real_model: RealModelParity::Skip, ..SuiteOptions::from_env() };
    let report = match conformance::run_targets(&[Target::new(Box::new(FakeBackend))], &options) {
        Ok(report) => report,
        Err(e) => {
            eprintln!("conformance could not run: {e}");
            std::process::exit(1);
        }
    };
    report.print_matrix();
    let embeddings_ran = report
        .backends
        .iter()
        .flat_map(|b| &b.results)
        .any(|c| c.case.contains("embeddings") && c.outcome == Outcome::Pass);
    if report.has_failures() || !embeddings_ran {
        eprintln!(
            "conformance: {NAME} FAILED{}",
            if embeddings_ran { "" } else { " (the embedding cases did not pass)" }
        );
        std::process::exit(1);
    }
    if let Err(e) = prepared_engine_loads_nothing_while_serving() {
        eprintln!("{NAME}: {e}");
        std::process::exit(1);
    }
    println!("conformance: {NAME} passed; a prepared engine served batches without loading a graph");
}
