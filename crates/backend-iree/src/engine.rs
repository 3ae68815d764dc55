//! The engine (a loaded model on the runtime thread) and its sessions.
//!
//! ## Graphs and buckets
//! One module per model, context and format holds `decode_logits` (one token) and
//! `prefill_{B}_logits` for each bucket `B` of [`PREFILL_BUCKETS`] that fits the context. Every
//! function returns the greedy token (argmax on the device) *and* the last position's logits; a
//! session reads the logits buffer back only when it needs them (it returns logits, or samples),
//! so a greedy step still copies 4 bytes to the host. One module instead of a greedy one and a
//! logits one halves compile time (the graphs compute the full logits for the argmax anyway).
//!
//! A prefill of `n` tokens at position `p` runs in the calls of [`stablehlo_llama::plan_prefill`]:
//! the smallest bucket holding the rest of the tokens, else the largest bucket full of real
//! tokens, padded with zeros (the graph masks padding rows and the positions after the real
//! tokens, which later steps overwrite). A call never runs past the cache's end (the graph's
//! `dynamic_update_slice` would clamp its offset), so near the end of the context the tail goes
//! through `decode`.
//!
//! ## Sequence state
//! A session owns one KV cache pair on the device (keys `f16[layers, kv_heads, head_dim,
//! max_context]`, values `f16[layers, kv_heads, max_context, head_dim]`) and its position on the
//! host. Attention reads only keys at positions `<= position + t`, so a
//! rewind ([`Session::truncate`]) is the position alone: stale entries after it are masked and
//! overwritten by the next step. A fork copies the cache (through the host).

use crate::compiler::{compile_cached, CacheOutcome};
use crate::device::IreeDevice;
use crate::error::IreeError;
use crate::worker::{CacheId, CacheShape, StepCall, WorkerHandle};
use llama_model::LlamaConfig;
use session_api::session::SessionGuard;
use session_api::{
    Capabilities, Engine, EngineInfo, InputKinds, KvOps, Result, Sampler, SamplingConfig, SamplingModes, SeamError, Session,
    SessionOptions, StateKind, StepOutput,
};
use stablehlo_llama::{emit_module, plan_prefill, GraphKind, GraphOptions, GraphSpec};
use std::sync::Arc;
use std::time::Duration;

/// Prefill bucket lengths: the emitter's defaults (those above the context are dropped; a context
/// below the smallest bucket gets one bucket of its own length).
pub const PREFILL_BUCKETS: [usize; 3] = stablehlo_llama::DEFAULT_BUCKETS;

/// The context a session holds when the load request names none (capped by the model's
/// `max_position_embeddings`). Decode cost grows with it: every step attends over the whole
/// cache with a mask, so it is kept moderate.
pub const DEFAULT_MAX_CONTEXT: usize = 2048;

/// The name the model's module is loaded under on the worker.
const MODEL_MODULE: &str = "model";
/// The VM module name of the emitted graphs (`module @seam_llama`): functions are resolved as
/// `seam_llama.<function>`.
const VM_MODULE: &str = "seam_llama";

/// The buckets for a context of `max_context` positions ([`stablehlo_llama::buckets_for_context`]).
pub fn buckets_for(max_context: usize) -> Vec<usize> {
    stablehlo_llama::buckets_for_context(max_context)
}

/// The functions of the model's module: decode and one prefill per bucket, each returning the
/// greedy token and the logits.
pub fn module_specs(buckets: &[usize]) -> Vec<GraphSpec> {
    let mut specs = vec![GraphSpec { kind: GraphKind::Decode, logits: true }];
    specs.extend(buckets.iter().filter(|&&b| b > 1).map(|&bucket| GraphSpec { kind: GraphKind::Prefill { bucket }, logits: true }));
    specs
}

/// What the engine and its sessions share.
pub(crate) struct Shared {
    pub worker: WorkerHandle,
    /// The registry name of the backend (`iree-cpu`, `iree-cuda`).
    pub backend: &'static str,
    pub buckets: Vec<usize>,
    pub cache_shape: CacheShape,
    pub max_context: usize,
    pub vocab_size: usize,
}

/// How a model was loaded: what [`crate::IreeBackend::load`] hands to the engine.
pub(crate) struct LoadedModel {
    pub worker: WorkerHandle,
    pub device: IreeDevice,
    pub config: LlamaConfig,
    pub options: GraphOptions,
    pub info: EngineInfo,
}

/// A model loaded on IREE's local-task device.
pub struct IreeEngine {
    shared: Arc<Shared>,
    info: EngineInfo,
}

/// The engine's capabilities for a context of `max_context`.
pub fn capabilities_with(max_context: usize) -> Capabilities {
    Capabilities {
        max_context,
        weight_formats: session_api::WeightFormat::ALL.to_vec(),
        // Greedy runs on the device (4 bytes back per step); the other modes read the step's
        // logits back and sample on the host with the shared `Sampler`, whose arithmetic is the
        // reference backend's.
        sampling: SamplingModes::ALL,
        logits: true,
        kv_ops: KvOps { truncate: true, fork: true },
        inputs: InputKinds { tokens: true, embeddings: false },
        max_concurrent_sessions: None,
        // Sessions may be driven from many threads at once; their steps take turns on the
        // runtime thread, each of which already uses every core.
        parallel_sessions: true,
        state: StateKind::KvCache,
        batched_decode: false,
    }
}

impl IreeEngine {
    pub(crate) fn new(loaded: LoadedModel) -> Self {
        let c = &loaded.config;
        let max_context = loaded.options.max_context;
        let shared = Shared {
            worker: loaded.worker,
            backend: loaded.device.backend_name(),
            buckets: buckets_for(max_context),
            cache_shape: CacheShape {
                k: [c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_context],
                v: [c.num_hidden_layers, c.num_key_value_heads, max_context, c.head_dim],
            },
            max_context,
            vocab_size: c.vocab_size,
        };
        IreeEngine { shared: Arc::new(shared), info: loaded.info }
    }

    pub(crate) fn set_load_time(&mut self, load_time: Duration) {
        self.info.load_time = load_time;
    }
}

/// Compiles (or reads from the cache) the model's module and loads it on `worker`. Returns
/// whether it was a cache hit.
pub(crate) fn load_model_module(
    worker: &WorkerHandle,
    compiler_library: &std::path::Path,
    flags: &[String],
    config: &LlamaConfig,
    options: &GraphOptions,
) -> std::result::Result<CacheOutcome, IreeError> {
    let text = emit_module(config, options, &module_specs(&buckets_for(options.max_context)))?;
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let module = compile_cached(compiler_library, "model", &text, &flags)?;
    worker.load_module(MODEL_MODULE, module.vmfb)?;
    Ok(module.outcome)
}

impl Engine for IreeEngine {
    fn info(&self) -> EngineInfo {
        self.info.clone()
    }

    fn capabilities(&self) -> Capabilities {
        capabilities_with(self.shared.max_context)
    }

    fn new_session(&self, options: SessionOptions) -> Result<Box<dyn Session>> {
        self.open_session(options, false)
    }
}

impl IreeEngine {
    /// A session whose next step fails inside the runtime (it calls a function the module lacks),
    /// for the conformance suite's poisoning checks. Not for production use.
    #[doc(hidden)]
    pub fn session_with_injected_fault(&self, options: SessionOptions) -> Result<Box<dyn Session>> {
        self.open_session(options, true)
    }

    /// Checks `options` and allocates a device cache.
    fn open_session(&self, options: SessionOptions, inject_fault: bool) -> Result<Box<dyn Session>> {
        options.check_against(self.shared.backend, &self.capabilities())?;
        let sampling_on_host = !matches!(options.sampling, SamplingConfig::Greedy);
        let cache = self.shared.worker.new_cache(self.shared.cache_shape)?;
        Ok(Box::new(IreeSession {
            shared: Arc::clone(&self.shared),
            cache,
            position: 0,
            read_logits: options.return_logits || sampling_on_host,
            return_logits: options.return_logits,
            sampler: sampling_on_host.then(|| Sampler::new(options.sampling)),
            guard: SessionGuard::default(),
            inject_fault,
        }))
    }
}

/// One sequence: a KV cache on the device and a position.
pub struct IreeSession {
    shared: Arc<Shared>,
    cache: CacheId,
    position: usize,
    /// Whether steps read the logits back (the caller wants them, or the session samples).
    read_logits: bool,
    /// Whether the caller gets the logits back.
    return_logits: bool,
    /// The host-side sampler of a non-greedy session; `None` takes the device's argmax.
    sampler: Option<Sampler>,
    guard: SessionGuard,
    /// Test hook: the next step calls a missing function (see `session_with_injected_fault`).
    inject_fault: bool,
}

impl IreeSession {
    fn call(&self, bucket: Option<usize>, tokens: &[u32], position: usize) -> StepCall {
        let (function, padded) = match bucket {
            None => (format!("{VM_MODULE}.decode_logits"), 1),
            Some(b) => (format!("{VM_MODULE}.prefill_{b}_logits"), b),
        };
        let mut ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        ids.resize(padded, 0);
        StepCall {
            module: MODEL_MODULE.to_string(),
            function,
            tokens: ids,
            position: position as i32,
            count: bucket.map(|_| tokens.len() as i32),
            logits: self.read_logits,
        }
    }

    fn append(&mut self, tokens: &[u32]) -> Result<StepOutput> {
        SessionGuard::check_tokens(tokens, self.shared.vocab_size, self.position, self.shared.max_context)?;
        let chunks = plan_prefill(self.position, tokens.len(), &self.shared.buckets, self.shared.max_context).map_err(IreeError::from)?;
        let start = self.position;
        let (shared, cache) = (Arc::clone(&self.shared), self.cache);
        let calls: Vec<StepCall> = {
            let mut at = 0;
            chunks
                .iter()
                .map(|chunk| {
                    let bucket = match chunk.graph {
                        GraphKind::Decode => None,
                        GraphKind::Prefill { bucket } => Some(bucket),
                    };
                    let call = self.call(bucket, &tokens[at..at + chunk.count], start + at);
                    at += chunk.count;
                    call
                })
                .collect()
        };
        let mut calls = calls;
        if std::mem::take(&mut self.inject_fault) {
            if let Some(first) = calls.first_mut() {
                first.function.push_str("_injected_fault");
            }
        }
        let (position, sampler, return_logits) = (&mut self.position, &mut self.sampler, self.return_logits);
        self.guard.step(|| {
            let mut last = None;
            for (call, chunk) in calls.into_iter().zip(&chunks) {
                last = Some(shared.worker.step(cache, call)?);
                *position += chunk.count;
            }
            let last = last.ok_or(SeamError::EmptyInput)?;
            let token = match (sampler.as_mut(), &last.logits) {
                (Some(sampler), Some(logits)) => sampler.sample(logits),
                (Some(_), None) => return Err(IreeError::Runtime("a sampling step returned no logits".into()).into()),
                (None, _) => last.token,
            };
            Ok(StepOutput { token, logits: if return_logits { last.logits } else { None } })
        })
    }
}

impl Session for IreeSession {
    fn prefill(&mut self, tokens: &[u32]) -> Result<StepOutput> {
        self.append(tokens)
    }

    fn decode(&mut self, token: u32) -> Result<StepOutput> {
        if self.position == 0 && !self.guard.is_poisoned() {
            return Err(SeamError::NotPrefilled);
        }
        self.append(&[token])
    }

    fn position(&self) -> usize {
        self.position
    }

    fn capacity(&self) -> usize {
        self.shared.max_context
    }

    fn reset(&mut self) {
        self.position = 0;
        if let Some(sampler) = &mut self.sampler {
            sampler.restart();
        }
        if self.guard.is_poisoned() {
            // A failed step may have consumed the cache buffers: start from a fresh cache.
            self.shared.worker.drop_cache(self.cache);
            match self.shared.worker.new_cache(self.shared.cache_shape) {
                Ok(cache) => self.cache = cache,
                Err(e) => {
                    self.guard.poison(format!("reset could not allocate a new KV cache: {e}"));
                    return;
                }
            }
        }
        self.guard.clear();
    }

    fn truncate(&mut self, position: usize) -> Result<()> {
        if position > self.position {
            return Err(SeamError::InvalidInput(format!(
                "truncate to {position} is past the current position {}",
                self.position
            )));
        }
        if self.guard.is_poisoned() {
            return self.guard.step(|| Ok(()));
        }
        self.position = position;
        Ok(())
    }

    fn fork(&self) -> Result<Box<dyn Session>> {
        if self.guard.is_poisoned() {
            return Err(SeamError::Poisoned { cause: "fork of a poisoned session".into() });
        }
        let cache = self.shared.worker.copy_cache(self.cache)?;
        Ok(Box::new(IreeSession {
            shared: Arc::clone(&self.shared),
            cache,
            position: self.position,
            read_logits: self.read_logits,
            return_logits: self.return_logits,
            sampler: self.sampler.clone(),
            guard: SessionGuard::default(),
            inject_fault: false,
        }))
    }

    fn backend_name(&self) -> &str {
        self.shared.backend
    }
}

impl Drop for IreeSession {
    fn drop(&mut self) {
        self.shared.worker.drop_cache(self.cache);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_fit_the_context() {
        assert_eq!(buckets_for(2048), vec![16, 64, 256]);
        assert_eq!(buckets_for(40), vec![16]);
        assert_eq!(buckets_for(8), vec![8]);
    }
}
