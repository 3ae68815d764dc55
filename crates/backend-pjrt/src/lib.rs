//! # backend-pjrt: seam on an OpenXLA PJRT plugin
//!
//! `pjrt-cpu` runs the StableHLO graphs of [`stablehlo_llama`] through XLA's CPU plugin
//! (`xla-cpu-pjrt==0.0.1`); `pjrt-cuda` runs them through a CUDA plugin where one loads and finds
//! a GPU. Both go through [`pjrt_runtime`], seam's own binding of the PJRT C API.
//!
//! - Plugins are found as [`plugin_search`] describes; `seam backends` shows where it looked and
//!   what failed when none loads.
//! - Each graph is compiled once and cached on disk ([`executable_cache`]): a second load
//!   compiles nothing.
//! - Weights are uploaded once per engine and shared by its sessions; each session's KV cache is
//!   donated to every step and aliased to its output, so a step updates it in place; greedy
//!   argmax runs on the device ([`engine`]).
//! - Resident precision is chosen per device: XLA's CPU backend runs f16 matrices 6-9x slower
//!   than f32 (FACTS.md), so `pjrt-cpu` keeps fp16 models' matrices in f32 (the same values,
//!   widened); a GPU keeps f16. int4 stays packed int4 with f16 scales everywhere.
//!
//! Register with the binary by calling [`link`].

pub mod engine;
pub mod executable_cache;
pub mod plugin_search;

pub use engine::{CompileReport, PjrtEngine, PjrtSession, DEFAULT_MAX_CONTEXT};
pub use plugin_search::PjrtDevice;

use engine::{capabilities_with, EngineParts};
use llama_model::model_dir::ModelDir;
use llama_model::weights::load_weights;
use session_api::{Availability, Backend, Capabilities, DeviceInfo, Engine, EngineInfo, LoadRequest, Result, SeamError, WeightFormat};
use stablehlo_llama::{graph_host_args, StorageDtype, GraphOptions, LayerMode};
use std::sync::Arc;
use std::time::Instant;

/// The registry name of the CPU backend.
pub const CPU_BACKEND_NAME: &str = "pjrt-cpu";
/// The registry name of the CUDA backend.
pub const CUDA_BACKEND_NAME: &str = "pjrt-cuda";

session_api::register_backend!(CPU_BACKEND_NAME, || Box::new(PjrtBackend::CPU));
session_api::register_backend!(CUDA_BACKEND_NAME, || Box::new(PjrtBackend::CUDA));

/// Referenced by binaries so the linker keeps this crate's registration.
pub fn link() {}

/// Environment variable choosing the layer layout of the graphs: `per-layer-cache` (default:
/// unrolled layers, each with its own cache arguments), `unrolled` (one stacked cache pair) or
/// `loop`.
///
/// Unrolled is the default on XLA, unlike on IREE: XLA compiles SmolLM2's four unrolled graphs in
/// about 5 s, and inside the loop it copies each layer's slice of the stacked weights every
/// iteration (decode 265 ms vs 172 ms per token, docs/backends/pjrt.md). Per-layer caches because
/// XLA copies stacked caches twice per step (read by every layer, updated after the last).
pub const LAYERS_ENV: &str = "SEAM_PJRT_LAYERS";

/// Environment variable overriding the resident precision of fp16 models' matrices: `f16` or
/// `f32` (default: f32 on the CPU, f16 on a GPU). For measuring the choice.
pub const DENSE_ENV: &str = "SEAM_PJRT_DENSE";

/// Environment variable overriding the element type of the KV cache: `f16` or `f32` (default:
/// f32 on the CPU, f16 on a GPU). For measuring the choice: with per-layer caches an f32 cache
/// is read by attention where it is updated, while an f16 one is converted in a fusion that XLA
/// feeds from a copy of the whole cache (SmolLM2 decode at a 2048 context: 78-82 ms f32, 145-160
/// ms f16; docs/backends/pjrt.md).
pub const KV_CACHE_ENV: &str = "SEAM_PJRT_KV_CACHE";

/// Environment variable overriding from how many tokens per call int4 matrices are dequantized
/// to f32 in the graph (default: 1 on the CPU, so always; the IREE threshold on a GPU). For
/// measuring the choice ([`stablehlo_llama::GraphOptions::int4_dequantize_from`]).
pub const INT4_DEQUANTIZE_ENV: &str = "SEAM_PJRT_INT4_DEQUANTIZE_FROM";

/// What can fail inside the backend, before it becomes a [`SeamError`].
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Pjrt(#[from] pjrt_runtime::PjrtError),
    #[error(transparent)]
    Cache(#[from] executable_cache::CacheError),
    #[error(transparent)]
    Graph(#[from] stablehlo_llama::GraphError),
    #[error("{0}")]
    Internal(String),
}

/// `error` as the session contract's error, attributed to `backend`.
pub(crate) fn to_seam_error(error: BackendError, backend: &str) -> SeamError {
    match error {
        BackendError::Graph(stablehlo_llama::GraphError::Options(message)) => SeamError::InvalidInput(message),
        BackendError::Graph(g) => SeamError::ModelFormat { path: None, message: g.to_string() },
        BackendError::Cache(executable_cache::CacheError::Io { path, source }) => SeamError::Io { path, source },
        other => SeamError::Backend(format!("{backend}: {other}")),
    }
}

/// A PJRT backend on one kind of device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PjrtBackend {
    device: PjrtDevice,
}

impl PjrtBackend {
    /// XLA's CPU plugin.
    pub const CPU: PjrtBackend = PjrtBackend { device: PjrtDevice::Cpu };
    /// A CUDA plugin.
    pub const CUDA: PjrtBackend = PjrtBackend { device: PjrtDevice::Cuda };

    /// [`Backend::load`], returning the concrete engine and how many graphs were compiled.
    pub fn load_engine(&self, request: &LoadRequest) -> Result<(PjrtEngine, CompileReport)> {
        load_engine(self.device, request)
    }
}

/// The layer layout [`LAYERS_ENV`] asks for.
fn layer_mode() -> Result<LayerMode> {
    match std::env::var(LAYERS_ENV).ok().as_deref() {
        None | Some("") | Some("per-layer-cache") => Ok(LayerMode::UnrolledCachePerLayer),
        Some("unrolled") => Ok(LayerMode::Unrolled),
        Some("loop") => Ok(LayerMode::Loop),
        Some(other) => {
            Err(SeamError::InvalidInput(format!("{LAYERS_ENV}={other}: expected `per-layer-cache`, `unrolled` or `loop`")))
        }
    }
}

/// The storage `env` asks for, else `default`.
fn storage_dtype(env: &str, default: StorageDtype) -> Result<StorageDtype> {
    match std::env::var(env).ok().as_deref() {
        None | Some("") => Ok(default),
        Some("f32") => Ok(StorageDtype::F32),
        Some("f16") => Ok(StorageDtype::F16),
        Some(other) => Err(SeamError::InvalidInput(format!("{env}={other}: expected `f16` or `f32`"))),
    }
}

fn resident_precision(format: WeightFormat, dense: StorageDtype) -> String {
    match (format, dense) {
        (WeightFormat::Int4, _) => "int4".into(),
        (WeightFormat::F16, StorageDtype::F16) => "f16".into(),
        (WeightFormat::F16, StorageDtype::F32) => "f32".into(),
    }
}

impl Backend for PjrtBackend {
    fn name(&self) -> &str {
        self.device.backend_name()
    }

    fn description(&self) -> &str {
        match self.device {
            PjrtDevice::Cpu => {
                "OpenXLA PJRT CPU plugin: StableHLO graphs compiled by XLA, weights resident f32 (fp16 models) or int4, greedy on device"
            }
            PjrtDevice::Cuda => "OpenXLA PJRT CUDA plugin: StableHLO graphs compiled by XLA for the GPU, weights resident f16 or int4",
        }
    }

    fn availability(&self) -> Availability {
        match plugin_search::shared_client(self.device) {
            Err(failure) => Availability::Unavailable { reason: failure.to_string() },
            Ok(found) => {
                let info = found.client.device_info();
                let plugin = &found.plugin;
                let version = plugin.attribute("xla_version").map(|v| format!(", xla_version {v}")).unwrap_or_default();
                let name = match (self.device, info) {
                    (PjrtDevice::Cpu, _) => backend_reference::cpu_device().name,
                    (PjrtDevice::Cuda, Ok(info)) => info.kind,
                    (PjrtDevice::Cuda, Err(_)) => "CUDA device 0".into(),
                };
                let name = format!("{name} (plugin {}, C API {}{version})", plugin.path().display(), plugin.version());
                Availability::Available { devices: vec![DeviceInfo { index: 0, name, memory_bytes: None }] }
            }
        }
    }

    fn capabilities(&self) -> Capabilities {
        capabilities_with(DEFAULT_MAX_CONTEXT)
    }

    fn load(&self, request: &LoadRequest) -> Result<Arc<dyn Engine>> {
        Ok(Arc::new(self.load_engine(request)?.0))
    }
}

fn load_engine(device: PjrtDevice, request: &LoadRequest) -> Result<(PjrtEngine, CompileReport)> {
    let name = device.backend_name();
    if let Some(index) = request.device.filter(|&d| d != 0) {
        return Err(SeamError::InvalidInput(format!("{name} drives one device (index 0), not {index}")));
    }
    if request.max_context == Some(0) {
        return Err(SeamError::InvalidInput("max_context must be at least 1".into()));
    }
    // XLA's CPU client sizes its thread pool from the machine; the plugin takes no option for it,
    // so a different count would be silently ignored.
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    if let Some(threads) = request.threads.filter(|&t| t != cores && device == PjrtDevice::Cpu) {
        return Err(SeamError::Unsupported {
            backend: name.to_string(),
            feature: format!("a thread count ({threads}) other than every core ({cores}): the XLA CPU client uses all of them"),
        });
    }
    let layers = layer_mode()?;
    // Matrices of fp16 models: f32 on XLA's CPU plugin, which runs f16 matrices 6-9x slower
    // (FACTS.md); f16 on a GPU.
    let dense_default = if device == PjrtDevice::Cpu { StorageDtype::F32 } else { StorageDtype::F16 };
    let dense = storage_dtype(DENSE_ENV, dense_default)?;
    let cache = storage_dtype(KV_CACHE_ENV, dense_default)?;
    // int4 matrices: XLA's CPU backend runs the per-group form that suits IREE (two small batched
    // dots per matrix) about 2x slower than dequantizing to f32 and one dot, even for one token
    // (SmolLM2 decode 437 vs 231 ms). Not measured on a GPU: the IREE threshold there.
    let int4_dequantize_from = match std::env::var(INT4_DEQUANTIZE_ENV).ok().as_deref() {
        None | Some("") => {
            if device == PjrtDevice::Cpu {
                1
            } else {
                stablehlo_llama::PREFILL_DEQUANTIZE_MIN_TOKENS
            }
        }
        Some(n) => n.parse::<usize>().ok().filter(|&n| n >= 1).ok_or_else(|| {
            SeamError::InvalidInput(format!("{INT4_DEQUANTIZE_ENV}={n}: expected a token count of at least 1"))
        })?,
    };
    let started = Instant::now();
    let found = plugin_search::shared_client(device)
        .map_err(|failure| SeamError::Unavailable { backend: name.to_string(), reason: failure.to_string() })?;
    let dir = ModelDir::open(&request.model_dir)?;
    let report_read = |done: u64, total: u64| request.report("reading weights", done, Some(total));
    let weights = load_weights(&request.model_dir, request.weights, Some(&report_read))?;
    let config = weights.config.clone();
    let max_context = request.max_context.unwrap_or(DEFAULT_MAX_CONTEXT).min(config.max_position_embeddings);
    let options = GraphOptions { max_context, format: request.weights, layers, dense, cache, int4_dequantize_from };
    let info = EngineInfo {
        backend: name.to_string(),
        model: dir.name(),
        weights: request.weights,
        resident_precision: resident_precision(request.weights, dense),
        vocab_size: config.vocab_size,
        hidden_size: config.hidden_size,
        load_time: Default::default(),
        weight_bytes: 0,
    };
    let parts = EngineParts { client: Arc::clone(&found.client), device, config, options: options.clone(), info };
    let prepare_weights = move || {
        let args = graph_host_args(&weights, &options)?;
        // The host copy in the model's own format is not needed once the upload bytes exist.
        drop(weights);
        Ok(args)
    };
    let report = |stage: &str, done: u64, total: Option<u64>| request.report(stage, done, total);
    let (mut engine, compiled) = PjrtEngine::build(parts, prepare_weights, &report).map_err(|e| to_seam_error(e, name))?;
    engine.set_load_time(started.elapsed());
    Ok((engine, compiled))
}
