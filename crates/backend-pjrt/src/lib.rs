//! # backend-pjrt: seam on an OpenXLA PJRT plugin
//!
//! `pjrt-cpu` runs the StableHLO graphs of [`stablehlo_llama`] through XLA's CPU plugin
//! (`xla-cpu-pjrt==0.0.1`); `pjrt-cuda` runs them through a CUDA plugin where one loads and finds
//! a GPU. Both go through [`pjrt_runtime`], seam's own binding of the PJRT C API.
//!
//! - Plugins are found as [`plugin_search`] describes; `seam backends` shows where it looked and
//!   what failed when none loads.
//! - The engine and its sessions are `graph_engine`'s, shared with every StableHLO runtime; this
//!   crate is the runtime ([`runtime::PjrtRuntime`]): executables, buffers, calls.
//! - Each graph is compiled once and cached on disk ([`runtime::executable_cache`]): a second
//!   load compiles nothing.
//! - Weights are uploaded once per engine and shared by its sessions; each session's KV cache is
//!   donated to every step and aliased to its output, so a step updates it in place; greedy
//!   argmax runs on the device.
//! - On XLA's CPU plugin, seam's own kernels ([`host_kernels`], the `cpu-kernels` crate) run the
//!   decode step's matrix products and attention as custom calls registered through the plugin's
//!   FFI extension, reading f16 and int4 weights as stored ([`CPU_KERNEL_SETTINGS`]). Without
//!   them ([`CPU_SETTINGS`]) XLA runs f16 matrices 6-9x slower than f32 (FACTS.md), so fp16
//!   models' matrices are held in f32 (the same values, widened). A GPU keeps f16. int4 stays
//!   packed int4 with f16 scales everywhere.
//!
//! Register with the binary by calling [`link`].

pub mod cuda_plugin;
pub mod gpu_products;
pub mod host_kernels;
pub mod plugin_search;
pub mod runtime;

pub use plugin_search::PjrtDevice;
pub use runtime::PjrtRuntime;

use graph_engine::{capabilities_with, GraphEngine, GraphSettings, DEFAULT_MAX_CONTEXT};
use plugin_search::FoundPlugin;
use session_api::{
    Availability, Backend, Capabilities, DeviceInfo, DeviceKind, Engine, LoadRequest, Result, SeamError,
};
use stablehlo_llama::{HostKernels, KernelActivations, KernelCalls, LayerMode, StorageDtype, VectorProducts};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

/// A model loaded on a PJRT plugin.
pub type PjrtEngine = GraphEngine<PjrtRuntime>;

/// The registry name.
pub const BACKEND_NAME: &str = "pjrt";

session_api::register_backend!(BACKEND_NAME, || Box::new(PjrtBackend::default()));
session_api::register_backend_alias!("pjrt-cpu", BACKEND_NAME, "cpu");
session_api::register_backend_alias!("pjrt-cuda", BACKEND_NAME, "cuda:0");

/// Referenced by binaries so the linker keeps this crate's registration.
pub fn link() {}

/// The graph settings on a CPU when seam's kernels are registered with the plugin
/// ([`host_kernels`], ADR 0011); `LoadRequest::settings` and the environment `SEAM_PJRT_*`
/// override them (`kernels=none` falls back to [`CPU_SETTINGS`]).
///
/// - Every call runs seam's kernels as custom calls for its products, reading the weights as
///   stored (f16, int4): one-token and short calls as matrix-vector products, calls of many rows
///   (prefill buckets, large batches) as the kernels' blocked matrix-matrix product; one-token
///   calls attend through the kernel over the filled cache positions only.
/// - fp16 matrices held as f16, row-major (the kernels' layout), never widened in the graph.
/// - Layers unrolled as [`CPU_SETTINGS`], with f16 caches, which only the kernels read and write
///   (ADR 0038; `kv_cache=f32` for f32).
pub const CPU_KERNEL_SETTINGS: GraphSettings = GraphSettings {
    dense: StorageDtype::F16,
    cache: StorageDtype::F16,
    host_kernels: Some(HostKernels {
        max_tokens: usize::MAX,
        calls: KernelCalls::XlaCustomCall,
        activations: KernelActivations::Exact,
    }),
    ..CPU_SETTINGS
};

/// The graph settings on a CPU without seam's kernels (a plugin without the FFI extension, or
/// `kernels=none`): every product an XLA dot.
///
/// - Layers unrolled, each with its own cache arguments: XLA compiles SmolLM2's unrolled graphs
///   in about 5 s, and inside a loop it copies each layer's slice of the stacked weights every
///   iteration (decode 265 ms vs 172 ms per token), and it copies stacked caches twice per step
///   (docs/backends/pjrt.md).
/// - fp16 models' matrices in f32: XLA's CPU backend runs f16 matrices 6-9x slower (FACTS.md).
/// - An f32 cache: attention reads it where it is updated, while an f16 one is converted in a
///   fusion that XLA feeds from a copy of the whole cache (docs/backends/pjrt.md).
/// - int4 dequantized in the graph for every call: XLA runs the per-group form that suits IREE
///   about 2x slower, even for one token (SmolLM2 decode 437 vs 231 ms).
pub const CPU_SETTINGS: GraphSettings = GraphSettings {
    layers: LayerMode::UnrolledCachePerLayer,
    dense: StorageDtype::F32,
    cache: StorageDtype::F32,
    int4_dequantize_from: 1,
    host_kernels: None,
    vector_products: VectorProducts::Dot,
    highest_precision: false,
};

/// The graph settings on any other device (a GPU, a vendor's accelerator), measured on an NVIDIA
/// H200 with XLA's CUDA plugin (docs/performance.md, "GPU"):
///
/// - f16 matrices and cache, int4 dequantized in the graph from IREE's threshold on;
/// - decode's products as reductions ([`VectorProducts::Reduce`]): XLA can fuse each into one kernel
///   over the stored weights, which decoded faster than the kernels it made of one-row dots;
/// - dots at full f32 precision (`highest_precision`): XLA's default multiplies f32 in TF32 on a
///   GPU, so prefill's dots rounded activations that decode's reductions did not, and the
///   backend's two paths disagreed beyond the conformance suite's self-consistency bound.
pub const DEVICE_SETTINGS: GraphSettings = GraphSettings {
    layers: LayerMode::UnrolledCachePerLayer,
    dense: StorageDtype::F16,
    cache: StorageDtype::F16,
    int4_dequantize_from: stablehlo_llama::PREFILL_DEQUANTIZE_MIN_TOKENS,
    host_kernels: None,
    vector_products: VectorProducts::Reduce,
    highest_precision: true,
};

/// The PJRT backend: the plugins found on this machine (XLA's CPU plugin as `cpu`, a CUDA plugin
/// as `cuda:0`), or the one plugin it was configured with (`plugin=PATH`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PjrtBackend {
    plugin: Option<PathBuf>,
}

/// The client a load runs on, and what it is.
struct Target {
    found: Arc<FoundPlugin>,
    device: DeviceInfo,
}

impl PjrtBackend {
    /// The backend on the plugin at `path` only (any PJRT plugin: a vendor's hardware included).
    pub fn with_plugin(path: impl Into<PathBuf>) -> PjrtBackend {
        PjrtBackend { plugin: Some(path.into()) }
    }

    /// [`Backend::load`], returning the concrete engine (whose `compile_report` says how many
    /// graphs were compiled).
    pub fn load_engine(&self, request: &LoadRequest) -> Result<PjrtEngine> {
        let target = self.target(request.device.as_deref(), Install::IfMissing)?;
        load_engine(&target, request)
    }

    /// The client of device `id` (the first device when `None`); `install` says whether a
    /// missing CUDA plugin may be installed ([`cuda_plugin`]).
    fn target(&self, id: Option<&str>, install: Install) -> Result<Target> {
        let unavailable = |reason: String| SeamError::Unavailable { backend: BACKEND_NAME.to_string(), reason };
        match &self.plugin {
            Some(path) => {
                let found = plugin_search::client_at(path).map_err(unavailable)?;
                let device = describe(&found, None);
                DeviceInfo::select(BACKEND_NAME, std::slice::from_ref(&device), id)?;
                Ok(Target { found, device })
            }
            None => {
                let kind = match id {
                    None | Some("cpu") => PjrtDevice::Cpu,
                    Some("cuda:0") | Some("cuda") => PjrtDevice::Cuda,
                    Some(other) => {
                        return Err(SeamError::InvalidInput(format!(
                            "pjrt has no device {other} (devices: cpu, cuda:0; any other plugin with --plugin PATH)"
                        )))
                    }
                };
                let found = match plugin_search::shared_client(kind) {
                    Ok(found) => found,
                    Err(failure) if kind == PjrtDevice::Cuda && failure.found_nothing() => {
                        install_cuda_plugin(&failure.to_string(), install).map_err(unavailable)?;
                        plugin_search::shared_client(kind).map_err(|failure| unavailable(failure.to_string()))?
                    }
                    Err(failure) => return Err(unavailable(failure.to_string())),
                };
                let device = describe(&found, Some(kind));
                Ok(Target { found, device })
            }
        }
    }
}

/// Whether finding a CUDA plugin may install one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Install {
    /// A load: install the pinned plugin where none is found and the driver can run it.
    IfMissing,
    /// An availability check: say what a load would install, install nothing.
    Never,
}

/// Installs the pinned CUDA plugin after a search found none (`searched` says where it looked),
/// if this machine's NVIDIA driver sees a GPU and runs the plugin's CUDA; else, or when
/// `install` is [`Install::Never`], says why there is no plugin.
fn install_cuda_plugin(searched: &str, install: Install) -> std::result::Result<(), String> {
    let set = &cuda_plugin::CUDA13;
    let driver = cuda_plugin::probe_driver().map_err(|why| format!("{searched}; {why}"))?;
    if let Some(why) = cuda_plugin::unsuitable(set, &driver) {
        return Err(format!("{searched}; {why}"));
    }
    if install == Install::Never {
        return Err(format!(
            "{searched}; the first pjrt-cuda load installs {} ({}) into {} (or `seam install pjrt-cuda` now)",
            set.name,
            set.download,
            cuda_plugin::install_dir(set).display()
        ));
    }
    cuda_plugin::ensure_installed(set, &|message| eprintln!("seam: {message}")).map(drop)
}

/// The device of a plugin's client as data: `cpu`, `cuda:0`, or `<platform>:0` for another
/// plugin.
fn describe(found: &FoundPlugin, searched_as: Option<PjrtDevice>) -> DeviceInfo {
    let info = found.client.device_info().ok();
    let platform = info.as_ref().map(|i| i.platform.clone()).unwrap_or_else(|| "unknown".into());
    let (id, kind) = match (searched_as, platform.as_str()) {
        (Some(PjrtDevice::Cpu), _) | (None, "cpu") => ("cpu".to_string(), DeviceKind::Cpu),
        (Some(PjrtDevice::Cuda), _) | (None, "cuda") => ("cuda:0".to_string(), DeviceKind::Gpu),
        (None, "rocm") => ("rocm:0".to_string(), DeviceKind::Gpu),
        (None, other) => (format!("{other}:0"), DeviceKind::Accelerator),
    };
    let plugin = &found.plugin;
    let version = plugin.attribute("xla_version").map(|v| format!(", xla_version {v}")).unwrap_or_default();
    let hardware = match (kind, &info) {
        (DeviceKind::Cpu, _) => backend_reference::cpu_device().name,
        (_, Some(info)) => info.kind.clone(),
        (_, None) => format!("{platform} device 0"),
    };
    let name = format!("{hardware} (plugin {}, C API {}{version})", plugin.path().display(), plugin.version());
    DeviceInfo { id, kind, name, memory_bytes: None }
}

impl Backend for PjrtBackend {
    fn name(&self) -> &str {
        BACKEND_NAME
    }

    fn description(&self) -> &str {
        match self.plugin {
            None => "OpenXLA PJRT plugins (XLA's CPU plugin, a CUDA plugin): StableHLO graphs compiled by XLA, greedy on device",
            Some(_) => "OpenXLA PJRT: the plugin given by path, running seam's pure-StableHLO graphs",
        }
    }

    fn availability(&self) -> Availability {
        if self.plugin.is_some() {
            return match self.target(None, Install::Never) {
                Ok(target) => Availability::Available { devices: vec![target.device] },
                Err(e) => Availability::Unavailable { reason: e.to_string() },
            };
        }
        let mut devices = Vec::new();
        let mut reasons = Vec::new();
        for id in ["cpu", "cuda:0"] {
            match self.target(Some(id), Install::Never) {
                Ok(target) => devices.push(target.device),
                Err(e) => reasons.push(e.to_string()),
            }
        }
        if devices.is_empty() {
            Availability::Unavailable { reason: reasons.join("; ") }
        } else {
            Availability::Available { devices }
        }
    }

    fn device_availability(&self, id: &str) -> Availability {
        match self.target(Some(id), Install::Never) {
            Ok(target) => Availability::Available { devices: vec![target.device] },
            Err(SeamError::Unavailable { reason, .. }) => Availability::Unavailable { reason },
            Err(e) => Availability::Unavailable { reason: e.to_string() },
        }
    }

    fn capabilities(&self) -> Capabilities {
        capabilities_with(DEFAULT_MAX_CONTEXT, true)
    }

    fn load(&self, request: &LoadRequest) -> Result<Arc<dyn Engine>> {
        Ok(Arc::new(self.load_engine(request)?))
    }

    /// `plugin=PATH`: the backend on that plugin alone.
    fn configure(&self, settings: &BTreeMap<String, String>) -> Result<Box<dyn Backend>> {
        let mut configured = self.clone();
        for (key, value) in settings {
            match key.as_str() {
                "plugin" => configured.plugin = Some(PathBuf::from(value)),
                other => {
                    return Err(SeamError::InvalidInput(format!(
                        "pjrt has no backend setting '{other}' (its settings: plugin)"
                    )))
                }
            }
        }
        Ok(Box::new(configured))
    }
}

/// [`CPU_KERNEL_SETTINGS`] where seam's kernels register with the plugin, else [`CPU_SETTINGS`]
/// (with a warning, unless the request said `kernels=none`; an error if it said `kernels=seam`).
fn cpu_defaults(client: &pjrt_runtime::Client, request: &LoadRequest) -> Result<GraphSettings> {
    let wanted = GraphSettings::kernels_requested(request, "SEAM_PJRT")?;
    if wanted == Some(false) {
        return Ok(CPU_SETTINGS);
    }
    match host_kernels::register(client.plugin()) {
        Ok(()) => Ok(CPU_KERNEL_SETTINGS),
        Err(reason) if wanted == Some(true) => {
            Err(SeamError::Unavailable { backend: BACKEND_NAME.to_string(), reason: format!("kernels=seam: {reason}") })
        }
        Err(reason) => {
            eprintln!(
                "warning: pjrt: seam's CPU kernels are not available ({reason}); every product runs as an XLA dot"
            );
            Ok(CPU_SETTINGS)
        }
    }
}

fn load_engine(target: &Target, request: &LoadRequest) -> Result<PjrtEngine> {
    let on_cpu = target.device.kind == DeviceKind::Cpu;
    let on_gpu = target.device.id.starts_with("cuda");
    if on_cpu {
        // The CPU plugin takes no option for the size of its thread pool.
        graph_engine::refuse_thread_count(BACKEND_NAME, request, "the XLA CPU client")?;
    }
    let defaults = if on_cpu { cpu_defaults(&target.found.client, request)? } else { DEVICE_SETTINGS };
    let settings = defaults.with_request(BACKEND_NAME, request, "SEAM_PJRT")?;
    if settings.vector_products.is_cuda_kernels() {
        let setting = format!("vector_products={}", settings.vector_products.setting());
        let plugin = target.found.client.plugin();
        let registered = if on_gpu {
            gpu_products::register(plugin)
        } else if on_cpu && std::env::var(gpu_products::ON_CPU_ENV).as_deref() == Ok("1") {
            // The kernels' arithmetic on the host: the graphs' calls checked without a GPU.
            gpu_products::register_on_host(plugin)
        } else {
            return Err(SeamError::InvalidInput(format!(
                "{setting}: seam's CUDA kernels run on a CUDA plugin's GPU, not on {}",
                target.device.id
            )));
        };
        registered.map_err(|reason| SeamError::Unavailable {
            backend: BACKEND_NAME.to_string(),
            reason: format!("{setting}: {reason}"),
        })?;
    }
    let client = Arc::clone(&target.found.client);
    graph_engine::load_engine(BACKEND_NAME, &target.device.id, request, settings, |model| {
        if on_gpu && model.options.vector_products.is_cuda_kernels() {
            gpu_products::tune(&target.device.id, model.config, model.options)?;
        }
        Ok(PjrtRuntime::new(client, on_cpu, model))
    })
}
