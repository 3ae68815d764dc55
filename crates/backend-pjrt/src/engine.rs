//! The engine (compiled executables and resident weights on a PJRT client) and its sessions.
//!
//! ## Executables
//! XLA compiles one program per module, entered at `@main`, so each graph is its own executable:
//! `decode_logits` and `prefill_{B}_logits` for each bucket `B` that fits the context
//! ([`stablehlo_llama::buckets_for_context`]). Each returns `(token, caches..., logits)`:
//! the greedy token is the device's argmax, and the logits stay in device memory unless the
//! session returns them or samples on the host.
//!
//! ## Weights and the KV cache
//! The weights are uploaded once per engine and passed to every execution as kept (never
//! donated) arguments. A session owns its cache buffers (a key and a value buffer per layer by
//! default, [`stablehlo_llama::cache_arg_shapes`]); every step *donates* them, and the graphs
//! alias them to the outputs after the token (`tf.aliasing_output`), so XLA writes the step's keys
//! and values into the same memory instead of copying the cache. The returned buffers replace
//! the session's. A failed step may have consumed them: the session is then poisoned, and its reset
//! allocates a fresh cache.

use crate::executable_cache::{compile_cached, CacheOutcome};
use crate::plugin_search::PjrtDevice;
use crate::{to_seam_error, BackendError};
use llama_model::LlamaConfig;
use pjrt_runtime::{Buffer, Client, ElementType, ExecuteArg, LoadedExecutable};
use session_api::session::SessionGuard;
use session_api::{
    Capabilities, Engine, EngineInfo, InputKinds, KvOps, Result, Sampler, SamplingConfig, SamplingModes, SeamError, Session,
    SessionOptions, StateKind, StepOutput,
};
use stablehlo_llama::{buckets_for_context, cache_arg_shapes, emit_entry_module, plan_prefill, GraphKind, GraphOptions, GraphSpec, HostArg};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The context a session holds when the load request names none (capped by the model).
pub const DEFAULT_MAX_CONTEXT: usize = 2048;

/// The engine's capabilities for a context of `max_context`.
pub fn capabilities_with(max_context: usize) -> Capabilities {
    Capabilities {
        max_context,
        weight_formats: session_api::WeightFormat::ALL.to_vec(),
        // Greedy on the device (4 bytes back per step); other modes sample the step's logits on
        // the host with the shared `Sampler` (the reference's arithmetic and random stream).
        sampling: SamplingModes::ALL,
        logits: true,
        kv_ops: KvOps { truncate: true, fork: true },
        inputs: InputKinds { tokens: true, embeddings: false },
        max_concurrent_sessions: None,
        // PJRT executables may run concurrently; each step already uses the plugin's thread pool.
        parallel_sessions: true,
        state: StateKind::KvCache,
        batched_decode: false,
    }
}

/// The graphs of one engine: decode, and one prefill per bucket.
fn specs(buckets: &[usize]) -> Vec<(Option<usize>, GraphSpec)> {
    let mut out = vec![(None, GraphSpec { kind: GraphKind::Decode, logits: true })];
    out.extend(buckets.iter().filter(|&&b| b > 1).map(|&b| (Some(b), GraphSpec { kind: GraphKind::Prefill { bucket: b }, logits: true })));
    out
}

/// What the engine and its sessions share.
struct Shared {
    client: Arc<Client>,
    device: PjrtDevice,
    backend: &'static str,
    decode: LoadedExecutable,
    /// `(bucket, executable)`, ascending.
    prefill: Vec<(usize, LoadedExecutable)>,
    buckets: Vec<usize>,
    weights: Vec<Buffer>,
    /// The shapes of a session's cache buffers, in argument order.
    cache_shapes: Vec<Vec<usize>>,
    cache_element: ElementType,
    max_context: usize,
    vocab_size: usize,
}

/// A model loaded on a PJRT device.
pub struct PjrtEngine {
    shared: Arc<Shared>,
    info: EngineInfo,
}

/// How many executables came from the disk cache at load (for tests and `seam bench`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CompileReport {
    pub compiled: usize,
    pub from_cache: usize,
}

fn element(dtype: stablehlo_llama::ArgDtype) -> ElementType {
    match dtype {
        stablehlo_llama::ArgDtype::F32 => ElementType::F32,
        stablehlo_llama::ArgDtype::F16 => ElementType::F16,
        stablehlo_llama::ArgDtype::I32 => ElementType::S32,
        stablehlo_llama::ArgDtype::I8 => ElementType::S8,
    }
}

/// Everything a load produces, before it becomes an engine (the weights come from the
/// `prepare_weights` argument of [`PjrtEngine::build`]).
pub(crate) struct EngineParts {
    pub client: Arc<Client>,
    pub device: PjrtDevice,
    pub config: LlamaConfig,
    pub options: GraphOptions,
    /// The engine's description; `weight_bytes` is filled in from the prepared weights.
    pub info: EngineInfo,
}

/// A graph's executable, from the disk cache or just compiled.
type GraphResult = std::result::Result<(LoadedExecutable, CacheOutcome), BackendError>;

/// Emits and compiles (or reads from the disk cache) `graphs` on up to `workers` threads, each
/// taking the next graph not yet taken; none is started once `cancelled` is set. The result of
/// each graph is at its index.
fn load_graphs(
    client: &Arc<Client>,
    config: &LlamaConfig,
    options: &GraphOptions,
    graphs: &[(Option<usize>, GraphSpec)],
    workers: usize,
    cancelled: &AtomicBool,
) -> Vec<Option<GraphResult>> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<GraphResult>>> = Mutex::new((0..graphs.len()).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..workers.clamp(1, graphs.len().max(1)) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= graphs.len() || cancelled.load(Ordering::Relaxed) {
                    break;
                }
                let result = emit_entry_module(config, options, graphs[i].1)
                    .map_err(BackendError::from)
                    .and_then(|module| compile_cached(client, &module).map_err(BackendError::from));
                results.lock().unwrap_or_else(|poisoned| poisoned.into_inner())[i] = Some(result);
            });
        }
    });
    results.into_inner().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl PjrtEngine {
    /// Compiles (or reads from the cache) every graph while `prepare_weights` builds the weights'
    /// host bytes and they are uploaded, then puts the two together.
    ///
    /// The graphs load on their own threads, one per core: a warm load deserializes four
    /// executables (about 1.3 s for SmolLM2 on 2 cores) and an fp16 load on the CPU widens every
    /// matrix to f32 (about a second), and neither needs the other. A cold load compiles the
    /// graphs side by side too. `prepare_weights` runs on the calling thread; if it fails, no
    /// further graph is started and the error is returned once those under way finish.
    pub(crate) fn build(
        parts: EngineParts,
        prepare_weights: impl FnOnce() -> std::result::Result<Vec<HostArg>, BackendError>,
        report: &dyn Fn(&str, u64, Option<u64>),
    ) -> std::result::Result<(PjrtEngine, CompileReport), BackendError> {
        let EngineParts { client, device, config, options, mut info } = parts;
        let buckets = buckets_for_context(options.max_context);
        let graphs = specs(&buckets);
        let workers = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let cancelled = AtomicBool::new(false);

        let (uploaded, loaded) = std::thread::scope(|scope| {
            let loading = scope.spawn(|| load_graphs(&client, &config, &options, &graphs, workers, &cancelled));
            let uploaded = prepare_weights().and_then(|args| {
                info.weight_bytes = args.iter().map(|a| a.bytes.len() as u64).sum();
                let stage = "uploading weights";
                let total = args.len() as u64;
                let mut weights = Vec::with_capacity(args.len());
                for (i, arg) in args.into_iter().enumerate() {
                    report(stage, i as u64, Some(total));
                    weights.push(client.buffer_from_host(&arg.bytes, element(arg.spec.dtype), &arg.spec.shape)?);
                }
                report(stage, total, Some(total));
                Ok(weights)
            });
            if uploaded.is_err() {
                cancelled.store(true, Ordering::Relaxed);
            } else {
                report("compiling graphs (cached after the first load)", 0, Some(graphs.len() as u64));
            }
            let loaded = loading.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (uploaded, loaded)
        });
        let weights = uploaded?;
        report("compiling graphs (cached after the first load)", graphs.len() as u64, Some(graphs.len() as u64));

        let mut compile_report = CompileReport::default();
        let mut decode = None;
        let mut prefill = Vec::new();
        for ((bucket, _), result) in graphs.iter().zip(loaded) {
            let (executable, outcome) = result.ok_or_else(|| BackendError::Internal("a graph was not loaded".into()))??;
            match outcome {
                CacheOutcome::Hit => compile_report.from_cache += 1,
                CacheOutcome::Compiled => compile_report.compiled += 1,
            }
            match bucket {
                None => decode = Some(executable),
                Some(b) => prefill.push((*b, executable)),
            }
        }
        let decode = decode.ok_or_else(|| BackendError::Internal("no decode graph".into()))?;

        let c = &config;
        let max_context = options.max_context;
        let cache_shapes = cache_arg_shapes(c, &options);
        let shared = Shared {
            client,
            device,
            backend: device.backend_name(),
            decode,
            prefill,
            buckets,
            weights,
            cache_shapes,
            cache_element: element(options.cache.arg_dtype()),
            max_context,
            vocab_size: c.vocab_size,
        };
        Ok((PjrtEngine { shared: Arc::new(shared), info }, compile_report))
    }

    pub(crate) fn set_load_time(&mut self, load_time: Duration) {
        self.info.load_time = load_time;
    }

    /// A session whose next step fails inside the plugin (it passes a token buffer of the wrong
    /// shape), for the conformance suite's poisoning checks. Not for production use.
    #[doc(hidden)]
    pub fn session_with_injected_fault(&self, options: SessionOptions) -> Result<Box<dyn Session>> {
        self.open_session(options, true)
    }

    fn open_session(&self, options: SessionOptions, inject_fault: bool) -> Result<Box<dyn Session>> {
        options.check_against(self.shared.backend, &self.capabilities())?;
        let sampling_on_host = !matches!(options.sampling, SamplingConfig::Greedy);
        let cache = self.shared.new_cache(None).map_err(|e| to_seam_error(e.into(), self.shared.backend))?;
        Ok(Box::new(PjrtSession {
            shared: Arc::clone(&self.shared),
            cache: Some(cache),
            position: 0,
            read_logits: options.return_logits || sampling_on_host,
            return_logits: options.return_logits,
            sampler: sampling_on_host.then(|| Sampler::new(options.sampling)),
            guard: SessionGuard::default(),
            inject_fault,
        }))
    }
}

impl Engine for PjrtEngine {
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

/// A session's KV cache on the device: the buffers of [`Shared::cache_shapes`].
type Cache = Vec<Buffer>;

fn i32_bytes(values: &[i32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

impl Shared {
    /// A zeroed cache, or one holding `contents` (host bytes of each buffer).
    fn new_cache(&self, contents: Option<Vec<Vec<u8>>>) -> std::result::Result<Cache, pjrt_runtime::PjrtError> {
        match contents {
            None => self.cache_shapes.iter().map(|shape| self.client.zeros(self.cache_element, shape)).collect(),
            Some(contents) => {
                if contents.len() != self.cache_shapes.len() {
                    return Err(pjrt_runtime::PjrtError::InvalidArgument(format!(
                        "{} cache buffers given, expected {}",
                        contents.len(),
                        self.cache_shapes.len()
                    )));
                }
                contents.iter().zip(&self.cache_shapes).map(|(bytes, shape)| self.client.buffer_from_host(bytes, self.cache_element, shape)).collect()
            }
        }
    }

    /// One execution: `tokens` (at most the bucket's length) at `position`. Consumes the cache
    /// and returns the updated one with the greedy token and, if asked, the logits.
    fn step(
        &self,
        cache: Cache,
        bucket: Option<usize>,
        tokens: &[u32],
        position: usize,
        read_logits: bool,
        inject_fault: bool,
    ) -> std::result::Result<(u32, Option<Vec<f32>>, Cache), pjrt_runtime::PjrtError> {
        let (executable, padded) = match bucket {
            None => (&self.decode, 1),
            Some(b) => {
                let executable = self.prefill.iter().find(|(pb, _)| *pb == b).map(|(_, e)| e);
                (executable.ok_or_else(|| pjrt_runtime::PjrtError::InvalidArgument(format!("no prefill graph of {b} tokens")))?, b)
            }
        };
        let mut ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        // The fault hook pads one token too many: the plugin refuses the argument's shape.
        ids.resize(padded + usize::from(inject_fault), 0);
        let ids_buffer = self.client.buffer_from_host(&i32_bytes(&ids), ElementType::S32, &[ids.len()])?;
        let position_buffer = self.client.buffer_from_host(&i32_bytes(&[position as i32]), ElementType::S32, &[])?;
        let count_buffer = match bucket {
            Some(_) => Some(self.client.buffer_from_host(&i32_bytes(&[tokens.len() as i32]), ElementType::S32, &[])?),
            None => None,
        };
        let mut args = vec![ExecuteArg::Keep(&ids_buffer), ExecuteArg::Keep(&position_buffer)];
        if let Some(count) = &count_buffer {
            args.push(ExecuteArg::Keep(count));
        }
        let n_caches = cache.len();
        args.extend(cache.into_iter().map(ExecuteArg::Donate));
        args.extend(self.weights.iter().map(ExecuteArg::Keep));
        let mut outputs = executable.execute(args)?;
        if outputs.len() != n_caches + 2 {
            return Err(pjrt_runtime::PjrtError::InvalidArgument(format!(
                "the graph returned {} results, expected {}",
                outputs.len(),
                n_caches + 2
            )));
        }
        let logits = outputs.pop().unwrap_or_else(|| unreachable!("length checked"));
        let token = outputs.remove(0);
        let updated = outputs;
        let mut token_bytes = [0u8; 4];
        token.copy_to_host(&mut token_bytes)?;
        let token = i32::from_le_bytes(token_bytes);
        let token = u32::try_from(token)
            .ok()
            .filter(|&t| (t as usize) < self.vocab_size)
            .ok_or_else(|| pjrt_runtime::PjrtError::InvalidArgument(format!("the graph returned token id {token}")))?;
        let logits = if read_logits {
            let bytes = logits.to_host()?;
            Some(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
        } else {
            None
        };
        Ok((token, logits, updated))
    }
}

/// One sequence: a KV cache on the device and a position.
pub struct PjrtSession {
    shared: Arc<Shared>,
    /// `None` after a failed step consumed it (the session is poisoned until reset).
    cache: Option<Cache>,
    position: usize,
    read_logits: bool,
    return_logits: bool,
    sampler: Option<Sampler>,
    guard: SessionGuard,
    inject_fault: bool,
}

impl PjrtSession {
    fn append(&mut self, tokens: &[u32]) -> Result<StepOutput> {
        let backend = self.shared.backend;
        SessionGuard::check_tokens(tokens, self.shared.vocab_size, self.position, self.shared.max_context)?;
        let chunks = plan_prefill(self.position, tokens.len(), &self.shared.buckets, self.shared.max_context)
            .map_err(|e| to_seam_error(e.into(), backend))?;
        let shared = Arc::clone(&self.shared);
        let inject_fault = std::mem::take(&mut self.inject_fault);
        let (position, cache, sampler) = (&mut self.position, &mut self.cache, &mut self.sampler);
        let (read_logits, return_logits) = (self.read_logits, self.return_logits);
        self.guard.step(|| {
            let mut at = 0;
            let mut last = None;
            for (i, chunk) in chunks.iter().enumerate() {
                let bucket = match chunk.graph {
                    GraphKind::Decode => None,
                    GraphKind::Prefill { bucket } => Some(bucket),
                };
                let current = cache.take().ok_or_else(|| SeamError::Backend("the KV cache was lost by an earlier failure".into()))?;
                let is_last = i + 1 == chunks.len();
                let (token, logits, updated) = shared
                    .step(current, bucket, &tokens[at..at + chunk.count], *position, read_logits && is_last, inject_fault && i == 0)
                    .map_err(|e| to_seam_error(e.into(), backend))?;
                *cache = Some(updated);
                at += chunk.count;
                *position += chunk.count;
                last = Some((token, logits));
            }
            let (token, logits) = last.ok_or(SeamError::EmptyInput)?;
            let token = match (sampler.as_mut(), &logits) {
                (Some(sampler), Some(logits)) => sampler.sample(logits),
                (Some(_), None) => return Err(SeamError::Backend("a sampling step returned no logits".into())),
                (None, _) => token,
            };
            Ok(StepOutput { token, logits: if return_logits { logits } else { None } })
        })
    }
}

impl Session for PjrtSession {
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
        if self.guard.is_poisoned() || self.cache.is_none() {
            // Stale entries of a healthy cache are masked (attention reads positions below the
            // current one only); a cache a failed step consumed is replaced.
            self.cache = None;
            match self.shared.new_cache(None) {
                Ok(cache) => self.cache = Some(cache),
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
            return Err(SeamError::InvalidInput(format!("truncate to {position} is past the current position {}", self.position)));
        }
        if self.guard.is_poisoned() {
            return self.guard.step(|| Ok(()));
        }
        self.position = position;
        Ok(())
    }

    fn fork(&self) -> Result<Box<dyn Session>> {
        let backend = self.shared.backend;
        let Some(cache) = self.cache.as_ref().filter(|_| !self.guard.is_poisoned()) else {
            return Err(SeamError::Poisoned { cause: "fork of a poisoned session".into() });
        };
        // Through the host: the C API has no device-to-device copy of a buffer on one device,
        // and a fork is rare next to the steps.
        let contents = cache.iter().map(Buffer::to_host).collect::<std::result::Result<Vec<_>, _>>().map_err(|e| to_seam_error(e.into(), backend))?;
        let cache = self.shared.new_cache(Some(contents)).map_err(|e| to_seam_error(e.into(), backend))?;
        Ok(Box::new(PjrtSession {
            shared: Arc::clone(&self.shared),
            cache: Some(cache),
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

impl Drop for PjrtSession {
    fn drop(&mut self) {
        // Free the cache buffers first, then give the pages back: on the CPU plugin a freed
        // cache otherwise stays in the resident set (conformance's many-sessions memory case).
        self.cache = None;
        if self.shared.device == PjrtDevice::Cpu {
            crate::plugin_search::release_free_memory();
        }
    }
}
