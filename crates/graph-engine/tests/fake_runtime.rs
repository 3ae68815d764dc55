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
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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
    /// Caches made by `new_cache`, and zeroed by `zero_cache` for the engine to reuse.
    made: AtomicUsize,
    zeroed: AtomicUsize,
    /// Fails the next call, consuming its cache.
    fail_next: AtomicBool,
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
            made: AtomicUsize::new(0),
            zeroed: AtomicUsize::new(0),
            fail_next: AtomicBool::new(false),
        })
    }
}

/// A cache: the reference's steps and how many positions they hold (`None` after a call failed
/// on it: consumed, as a device's cache may be).
struct FakeCache {
    steps: Box<dyn SessionSteps>,
    filled: Option<usize>,
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
        self.made.fetch_add(1, Ordering::SeqCst);
        Ok(FakeCache { steps: self.reference.open_steps(&SessionOptions::default())?, filled: Some(0) })
    }

    /// A consumed cache cannot be zeroed; any other is emptied as a zeroed one is.
    fn zero_cache(&self, cache: &mut FakeCache) -> Result<bool> {
        cache.filled.ok_or_else(|| SeamError::Backend("a consumed cache".into()))?;
        cache.steps = self.reference.open_steps(&SessionOptions::default())?;
        cache.filled = Some(0);
        self.zeroed.fetch_add(1, Ordering::SeqCst);
        Ok(true)
    }

    fn copy_cache(&self, cache: &FakeCache) -> Result<FakeCache> {
        let filled = cache.filled.ok_or_else(|| SeamError::Backend("a consumed cache".into()))?;
        Ok(FakeCache { steps: cache.steps.fork(filled)?, filled: Some(filled) })
    }

    fn execute(&self, cache: &mut FakeCache, call: &GraphCall) -> Result<GraphOutput> {
        let name = call.graph.name();
        if !self.loaded.lock().unwrap().contains(&name) {
            return Err(SeamError::Backend(format!("{name} was never loaded")));
        }
        if !self.uploaded.load(Ordering::SeqCst) {
            return Err(SeamError::Backend("no weights uploaded".into()));
        }
        let filled = cache.filled.take().ok_or_else(|| SeamError::Backend("a consumed cache".into()))?;
        if self.fail_next.swap(false, Ordering::SeqCst) {
            return Err(SeamError::Backend("an injected failure".into()));
        }
        if call.position > filled || call.position + call.count > self.options.max_context {
            return Err(SeamError::Backend(format!(
                "a call at {} of {} rows on a cache of {filled}",
                call.position, call.count
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
        if let (GraphKind::PrefillScored { bucket }, StepInput::Tokens(ids)) = (call.graph.kind, input) {
            // Every row's logits, the padding rows' as a compiled graph leaves them (here zeros).
            let mut logits = cache
                .steps
                .append_scoring(call.position, ids)?
                .logits
                .ok_or_else(|| SeamError::Backend("no logits".into()))?;
            cache.filled = Some(call.position + call.count);
            let vocab = self.config.vocab_size;
            let token = session_api::sampling::argmax(&logits[(call.count - 1) * vocab..]);
            logits.resize(bucket * vocab, 0.0);
            return Ok(GraphOutput { token, logits: call.read_logits.then_some(logits) });
        }
        let logits = cache
            .steps
            .append(call.position, input, true)?
            .logits
            .ok_or_else(|| SeamError::Backend("no logits".into()))?;
        cache.filled = Some(call.position + call.count);
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

/// A closed session's cache goes, zeroed, to the next new session (at most
/// [`graph_engine::IDLE_CACHES`] are kept), which computes what a fresh cache would; a cache a
/// failed call consumed is never handed on.
fn closed_sessions_caches_are_reused() -> std::result::Result<(), String> {
    let models = conformance::models::tiny_models(&conformance::models::default_cache_dir())?;
    let request = LoadRequest::new(&models[0].dir, WeightFormat::F16);
    let engine = Arc::new(load_fake(&request).map_err(|e| e.to_string())?);
    let counts = || (engine.runtime().made.load(Ordering::SeqCst), engine.runtime().zeroed.load(Ordering::SeqCst));
    let sessions: Arc<dyn Engine> = engine.clone();
    let generate = |engine: &Arc<dyn Engine>| {
        let mut session = engine.new_checked_session(SessionOptions::default()).map_err(|e| e.to_string())?;
        let mut token = session.prefill(&[3, 1, 4, 1, 5]).map_err(|e| e.to_string())?.token;
        let mut tokens = vec![token];
        for _ in 0..4 {
            token = session.decode(token).map_err(|e| e.to_string())?.token;
            tokens.push(token);
        }
        Ok::<_, String>((session, tokens))
    };
    let (first, want) = generate(&sessions)?;
    drop(first);
    if counts() != (1, 1) {
        return Err(format!("after one closed session: {:?} caches made and zeroed, not (1, 1)", counts()));
    }
    let (second, got) = generate(&sessions)?;
    if got != want || counts() != (1, 1) {
        return Err(format!("a reused cache: {got:?} (fresh: {want:?}), {:?} made and zeroed", counts()));
    }
    // Three open at once, then closed: only IDLE_CACHES of them are kept (zeroed).
    let (third, _) = generate(&sessions)?;
    let (fourth, _) = generate(&sessions)?;
    drop((second, third, fourth));
    let kept = 1 + graph_engine::IDLE_CACHES.min(3);
    if counts() != (3, kept) {
        return Err(format!("three closed sessions: {:?} made and zeroed, not (3, {kept})", counts()));
    }
    // A failed call consumes its cache: the next session still gets a whole one.
    let mut failing = sessions.new_checked_session(SessionOptions::default()).map_err(|e| e.to_string())?;
    engine.runtime().fail_next.store(true, Ordering::SeqCst);
    if failing.prefill(&[1, 2]).is_ok() {
        return Err("the injected failure did not fail the call".into());
    }
    drop(failing);
    for _ in 0..3 {
        let (_, got) = generate(&sessions)?;
        if got != want {
            return Err(format!("after a failed session: {got:?}, fresh: {want:?}"));
        }
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
    if let Err(e) = closed_sessions_caches_are_reused() {
        eprintln!("{NAME}: {e}");
        std::process::exit(1);
    }
    println!(
        "conformance: {NAME} passed; a prepared engine served batches without loading a graph; closed sessions' caches were reused"
    );
}
