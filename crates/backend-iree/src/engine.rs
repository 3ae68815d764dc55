//! The engine (a loaded model on the runtime thread) and its sessions.
//!
//! ## Graphs and buckets
//! One module holds the greedy functions: `decode` (one token) and `prefill_{B}` for each bucket
//! `B` of [`PREFILL_BUCKETS`] that fits the context. A prefill of `n` tokens at position `p` runs
//! in the calls of [`stablehlo_llama::plan_prefill`]: the smallest bucket holding the rest of the
//! tokens, else the largest bucket full of real tokens, padded with zeros (the graph masks padding
//! rows and the positions after the real tokens, which later steps overwrite). A call never runs
//! past the cache's end (the graph's `dynamic_update_slice` would clamp its offset), so near the
//! end of the context the tail goes through `decode`. The `_logits` variants sit in a second module, compiled (or read from the
//! cache) on the first session that asks for logits, so greedy-only use never pays for them.
//!
//! ## Sequence state
//! A session owns one KV cache pair on the device, `f16[layers, kv_heads, max_context, head_dim]`,
//! and its position on the host. Attention reads only keys at positions `<= position + t`, so a
//! rewind ([`Session::truncate`]) is the position alone: stale entries after it are masked and
//! overwritten by the next step. A fork copies the cache (through the host).

use crate::compiler::{compile_cached, CacheOutcome, LLVM_CPU_FLAGS};
use crate::error::IreeError;
use crate::worker::{CacheId, CacheShape, StepCall, WorkerHandle};
use llama_model::LlamaConfig;
use session_api::session::SessionGuard;
use session_api::{
    Capabilities, Engine, EngineInfo, InputKinds, KvOps, Result, SamplingModes, SeamError, Session, SessionOptions, StateKind,
    StepOutput,
};
use stablehlo_llama::{emit_module, plan_prefill, GraphKind, GraphOptions, GraphSpec};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Prefill bucket lengths: the emitter's defaults (those above the context are dropped; a context
/// below the smallest bucket gets one bucket of its own length).
pub const PREFILL_BUCKETS: [usize; 3] = stablehlo_llama::DEFAULT_BUCKETS;

/// The context a session holds when the load request names none (capped by the model's
/// `max_position_embeddings`). Decode cost grows with it: every step attends over the whole
/// cache with a mask, so it is kept moderate.
pub const DEFAULT_MAX_CONTEXT: usize = 2048;

const GREEDY_MODULE: &str = "greedy";
/// The VM module name of the emitted graphs (`module @seam_llama`): functions are resolved as
/// `seam_llama.<function>`.
const VM_MODULE: &str = "seam_llama";
const LOGITS_MODULE: &str = "logits";

/// The buckets for a context of `max_context` positions.
pub fn buckets_for(max_context: usize) -> Vec<usize> {
    let fitting: Vec<usize> = PREFILL_BUCKETS.iter().copied().filter(|&b| b <= max_context).collect();
    if fitting.is_empty() {
        vec![max_context]
    } else {
        fitting
    }
}

/// The function specs of one module.
pub fn module_specs(buckets: &[usize], logits: bool) -> Vec<GraphSpec> {
    let mut specs = vec![GraphSpec { kind: GraphKind::Decode, logits }];
    specs.extend(buckets.iter().filter(|&&b| b > 1).map(|&bucket| GraphSpec { kind: GraphKind::Prefill { bucket }, logits }));
    specs
}

/// What the engine and its sessions share.
pub(crate) struct Shared {
    pub worker: WorkerHandle,
    pub buckets: Vec<usize>,
    pub cache_shape: CacheShape,
    pub max_context: usize,
    pub vocab_size: usize,
}

/// How a model was loaded: what [`crate::IreeCpuBackend::load`] hands to the engine.
pub(crate) struct LoadedModel {
    pub worker: WorkerHandle,
    pub config: LlamaConfig,
    pub options: GraphOptions,
    pub compiler_library: PathBuf,
    pub info: EngineInfo,
}

/// A model loaded on IREE's local-task device.
pub struct IreeEngine {
    shared: Arc<Shared>,
    config: LlamaConfig,
    options: GraphOptions,
    compiler_library: PathBuf,
    info: EngineInfo,
    /// Whether the logits module is loaded; the mutex also serializes its first compilation.
    logits_loaded: Mutex<bool>,
}

/// The engine's capabilities for a context of `max_context`.
pub fn capabilities_with(max_context: usize) -> Capabilities {
    Capabilities {
        max_context,
        weight_formats: session_api::WeightFormat::ALL.to_vec(),
        sampling: SamplingModes::GREEDY_ONLY,
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
            buckets: buckets_for(max_context),
            cache_shape: CacheShape {
                k: [c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_context],
                v: [c.num_hidden_layers, c.num_key_value_heads, max_context, c.head_dim],
            },
            max_context,
            vocab_size: c.vocab_size,
        };
        IreeEngine {
            shared: Arc::new(shared),
            config: loaded.config,
            options: loaded.options,
            compiler_library: loaded.compiler_library,
            info: loaded.info,
            logits_loaded: Mutex::new(false),
        }
    }

    pub(crate) fn set_load_time(&mut self, load_time: Duration) {
        self.info.load_time = load_time;
    }

    /// Compiles (or reads from the cache) and loads the module of `_logits` functions, once.
    fn ensure_logits_module(&self) -> std::result::Result<(), IreeError> {
        let mut loaded = self.logits_loaded.lock().unwrap_or_else(|p| p.into_inner());
        if *loaded {
            return Ok(());
        }
        let text = emit_module(&self.config, &self.options, &module_specs(&self.shared.buckets, true))?;
        let module = compile_cached(&self.compiler_library, "logits", &text, &LLVM_CPU_FLAGS)?;
        self.shared.worker.load_module(LOGITS_MODULE, module.vmfb)?;
        *loaded = true;
        Ok(())
    }
}

/// Compiles (or reads from the cache) the greedy module and loads it on `worker`. Returns whether
/// it was a cache hit.
pub(crate) fn load_greedy_module(
    worker: &WorkerHandle,
    compiler_library: &std::path::Path,
    config: &LlamaConfig,
    options: &GraphOptions,
) -> std::result::Result<CacheOutcome, IreeError> {
    let text = emit_module(config, options, &module_specs(&buckets_for(options.max_context), false))?;
    let module = compile_cached(compiler_library, "greedy", &text, &LLVM_CPU_FLAGS)?;
    worker.load_module(GREEDY_MODULE, module.vmfb)?;
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

    /// Checks `options`, compiles the logits module if asked for, and allocates a device cache.
    fn open_session(&self, options: SessionOptions, inject_fault: bool) -> Result<Box<dyn Session>> {
        options.check_against(crate::BACKEND_NAME, &self.capabilities())?;
        if options.return_logits {
            self.ensure_logits_module()?;
        }
        let cache = self.shared.worker.new_cache(self.shared.cache_shape)?;
        Ok(Box::new(IreeSession {
            shared: Arc::clone(&self.shared),
            cache,
            position: 0,
            logits: options.return_logits,
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
    logits: bool,
    guard: SessionGuard,
    /// Test hook: the next step calls a missing function (see `session_with_injected_fault`).
    inject_fault: bool,
}

impl IreeSession {
    fn call(&self, bucket: Option<usize>, tokens: &[u32], position: usize) -> StepCall {
        let suffix = if self.logits { "_logits" } else { "" };
        let (function, padded) = match bucket {
            None => (format!("{VM_MODULE}.decode{suffix}"), 1),
            Some(b) => (format!("{VM_MODULE}.prefill_{b}{suffix}"), b),
        };
        let mut ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        ids.resize(padded, 0);
        StepCall {
            module: if self.logits { LOGITS_MODULE } else { GREEDY_MODULE }.to_string(),
            function,
            tokens: ids,
            position: position as i32,
            count: bucket.map(|_| tokens.len() as i32),
            logits: self.logits,
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
        let position = &mut self.position;
        self.guard.step(|| {
            let mut last = None;
            for (call, chunk) in calls.into_iter().zip(&chunks) {
                last = Some(shared.worker.step(cache, call)?);
                *position += chunk.count;
            }
            let last = last.ok_or(SeamError::EmptyInput)?;
            Ok(StepOutput { token: last.token, logits: last.logits })
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
            logits: self.logits,
            guard: SessionGuard::default(),
            inject_fault: false,
        }))
    }

    fn backend_name(&self) -> &str {
        crate::BACKEND_NAME
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
