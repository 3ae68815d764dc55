//! The reference engine: f32 weights held once, shared by every session.

use crate::session::ReferenceSteps;
use crate::transformer::Transformer;
use llama_model::LlamaWeights;
use session_api::{
    Capabilities, Engine, EngineInfo, Result, SeamError, Session, SessionOptions, SessionSteps, WeightFormat,
};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How to build a [`ReferenceEngine`] from weights already in memory.
#[derive(Clone, Default)]
pub struct EngineOptions {
    /// The model's name for [`EngineInfo::model`].
    pub model_name: String,
    /// Cap on a session's context; `None` (or a larger value) takes the model's
    /// `max_position_embeddings`.
    pub max_context: Option<usize>,
    /// Threads for the matrix products: `None` uses rayon's global pool (all cores), `Some(n)` a
    /// pool of its own with `n` threads.
    pub threads: Option<usize>,
    /// Progress of the f32 conversion: `(layers done, layers in all)`.
    pub progress: Option<Arc<dyn Fn(u64, u64) + Send + Sync>>,
}

impl fmt::Debug for EngineOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineOptions")
            .field("model_name", &self.model_name)
            .field("max_context", &self.max_context)
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

/// What sessions share: the model and the thread pool its products run on.
pub(crate) struct EngineShared {
    pub(crate) model: Transformer,
    pool: Option<rayon::ThreadPool>,
}

impl EngineShared {
    /// Runs `work` on the engine's own pool if it has one, else on the global pool.
    pub(crate) fn run<T: Send>(&self, work: impl FnOnce() -> T + Send) -> T {
        match &self.pool {
            Some(pool) => pool.install(work),
            None => work(),
        }
    }
}

impl fmt::Debug for EngineShared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EngineShared")
            .field("config", self.model.config())
            .field("threads", &self.pool.as_ref().map(|p| p.current_num_threads()))
            .finish_non_exhaustive()
    }
}

/// A model loaded by the reference backend.
#[derive(Debug)]
pub struct ReferenceEngine {
    shared: Arc<EngineShared>,
    format: WeightFormat,
    model_name: String,
    max_context: usize,
    load_time: Duration,
}

impl ReferenceEngine {
    /// Builds an engine from weights in memory (the backend's `load` reads them from a model
    /// directory first; tests and other backends' checks can call this directly).
    pub fn from_weights(weights: &LlamaWeights, options: EngineOptions) -> Result<Self> {
        let started = Instant::now();
        // An int4 model's embedding and head may be int8: its layers say which format it is.
        let format = match weights.layers.first().map_or(&weights.embed, |l| &l.wq).format() {
            llama_model::MatrixFormat::F16 => WeightFormat::F16,
            llama_model::MatrixFormat::Int4 | llama_model::MatrixFormat::Int8 => WeightFormat::Int4,
        };
        let progress = options.progress.clone();
        let report = move |done: u64, total: u64| {
            if let Some(progress) = &progress {
                progress(done, total);
            }
        };
        let pool = match options.threads {
            None => None,
            Some(0) => return Err(SeamError::InvalidInput("the thread count must be at least 1".into())),
            Some(n) => Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .thread_name(|i| format!("seam-reference-{i}"))
                    .build()
                    .map_err(|e| SeamError::ResourceExhausted(format!("starting {n} threads: {e}")))?,
            ),
        };
        let model = match &pool {
            Some(pool) => pool.install(|| Transformer::from_weights(weights, &report))?,
            None => Transformer::from_weights(weights, &report)?,
        };
        let model_limit = model.config().max_position_embeddings;
        let max_context = options.max_context.map_or(model_limit, |requested| requested.min(model_limit));
        if max_context == 0 {
            return Err(SeamError::InvalidInput("the maximum context must be at least 1 position".into()));
        }
        Ok(ReferenceEngine {
            shared: Arc::new(EngineShared { model, pool }),
            format,
            model_name: options.model_name,
            max_context,
            load_time: started.elapsed(),
        })
    }

    /// Replaces the reported load time (the backend counts reading the files too).
    pub(crate) fn set_load_time(&mut self, load_time: Duration) {
        self.load_time = load_time;
    }

    /// A session of this engine, for callers that hold the concrete type (the same as
    /// `new_session` on `dyn Engine`).
    pub fn session(&self, options: SessionOptions) -> Result<Box<dyn Session>> {
        (self as &dyn Engine).new_session(options)
    }
}

/// What the reference backend offers, with `max_context` as given: everything the contract names,
/// and per-layer hidden states (the oracle of the suite's layer-by-layer comparison).
pub(crate) fn capabilities_with(max_context: usize) -> Capabilities {
    Capabilities { hidden_states: true, logits_per_position: true, ..Capabilities::all(max_context) }
}

impl Engine for ReferenceEngine {
    fn info(&self) -> EngineInfo {
        let config = self.shared.model.config();
        EngineInfo {
            backend: crate::BACKEND_NAME.to_string(),
            device: "cpu".to_string(),
            model: self.model_name.clone(),
            weights: self.format,
            resident_precision: "f32".to_string(),
            vocab_size: config.vocab_size,
            hidden_size: config.hidden_size,
            load_time: self.load_time,
            weight_bytes: self.shared.model.weight_bytes(),
            // Its attention reads only the filled positions: the bytes grow along the sequence.
            decode_bytes_per_token: None,
        }
    }

    fn capabilities(&self) -> Capabilities {
        capabilities_with(self.max_context)
    }

    fn open_steps(&self, options: &SessionOptions) -> Result<Box<dyn SessionSteps>> {
        Ok(Box::new(ReferenceSteps::new(Arc::clone(&self.shared), options.return_hidden_states)))
    }
}
