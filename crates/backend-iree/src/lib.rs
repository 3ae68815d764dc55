//! # backend-iree: seam on IREE
//!
//! The `iree` backend runs the StableHLO graphs of [`stablehlo_llama`] through IREE 3.13: the
//! compiler is the `iree-base-compiler==3.13.0` wheel's library (see [`compiler`]), the runtime is
//! built from source by the `eerie` crate. Its devices: `cpu` (llvm-cpu code on IREE's
//! `local-task` driver, every core) and `cuda:0` (the `cuda` target on IREE's CUDA driver, in
//! builds with the `cuda` feature on a machine with an NVIDIA GPU; [`device`]). `iree-cpu` and
//! `iree-cuda` are registered as aliases of `iree` on those devices.
//!
//! - The engine and its sessions are `graph_engine`'s, shared with every StableHLO runtime; this
//!   crate is the runtime ([`runtime::IreeRuntime`]): modules, buffers, calls.
//! - Compiled modules are cached on disk ([`compiler::compile_cached`]): a second load of the same
//!   model, context and format compiles nothing.
//! - The runtime is not `Send`, so one thread owns it ([`worker`]); engines and sessions talk to it
//!   over channels. Each session's KV cache stays on the device and is updated in place; greedy
//!   argmax runs on the device, so a decode step copies back 4 bytes.
//!
//! Register with the binary by calling [`link`] (see `session_api::registry` on why).

pub mod compiler;
pub mod device;
pub mod error;
pub mod kernel_plugin;
pub mod runtime;
pub mod task_flags;
pub mod worker;

pub use device::IreeDevice;
pub use error::IreeError;
pub use runtime::IreeRuntime;

use compiler::CompilerChoice;
use graph_engine::{capabilities_with, CompileReport, GraphEngine, GraphSettings, DEFAULT_MAX_CONTEXT};
use session_api::{Availability, Backend, Capabilities, Engine, LoadRequest, Result};
use stablehlo_llama::{GraphKind, GraphSpec, LayerMode, StorageDtype, VectorProducts};
use std::sync::Arc;
use task_flags::TaskSettings;
use worker::WorkerHandle;

/// A model loaded on IREE.
pub type IreeEngine = GraphEngine<IreeRuntime>;

/// The registry name.
pub const BACKEND_NAME: &str = "iree";

session_api::register_backend!(BACKEND_NAME, || Box::new(IreeBackend));
session_api::register_backend_alias!("iree-cpu", BACKEND_NAME, "cpu");
session_api::register_backend_alias!("iree-cuda", BACKEND_NAME, "cuda:0");

/// Referenced by binaries so the linker keeps this crate's registration.
pub fn link() {}

/// The graph settings without seam's kernels (`kernels=none`; `LoadRequest::settings`,
/// environment `SEAM_IREE_*`): every product an IREE-compiled dot; layers in a loop, which
/// compiles 3-5x faster than unrolled at the same step time (docs/backends/iree.md); f16
/// matrices and cache; int4 dequantized in the graph from
/// [`stablehlo_llama::PREFILL_DEQUANTIZE_MIN_TOKENS`] rows on.
pub const STABLEHLO_SETTINGS: GraphSettings = GraphSettings {
    layers: LayerMode::Loop,
    dense: StorageDtype::F16,
    cache: StorageDtype::F16,
    int4_dequantize_from: stablehlo_llama::PREFILL_DEQUANTIZE_MIN_TOKENS,
    host_kernels: None,
    vector_products: VectorProducts::Dot,
    highest_precision: false,
};

/// The CPU defaults (`kernels=seam`): every product and every attention is a dispatch of seam's
/// kernels ([`kernel_plugin`], ADR 0021), the fp16 matrices row-major as the kernels read them;
/// layers unrolled (with the kernels inside a loop over stacked weights, decode was no faster
/// than without them: ADR 0021), each with its own f16 caches (ADR 0038; `kv_cache=f32` for
/// f32), which the attention kernel reads over the filled positions only (ADR 0022).
pub const KERNEL_SETTINGS: GraphSettings = GraphSettings {
    layers: LayerMode::UnrolledCachePerLayer,
    cache: StorageDtype::F16,
    host_kernels: Some(stablehlo_llama::HostKernels {
        max_tokens: usize::MAX,
        calls: stablehlo_llama::KernelCalls::IreeDispatch,
        activations: stablehlo_llama::KernelActivations::Exact,
    }),
    ..STABLEHLO_SETTINGS
};

/// The defaults on a GPU: layers unrolled, no device-side loop around the layers (as pjrt does on
/// a GPU). Measured on an H100, the loop was not where iree-cuda's time goes, but it gains nothing
/// there (docs/performance.md), and the longer compile of unrolled layers is paid once, ahead of
/// time (`seam compile`).
pub const CUDA_SETTINGS: GraphSettings = GraphSettings { layers: LayerMode::Unrolled, ..STABLEHLO_SETTINGS };

impl IreeDevice {
    /// The graph settings a load on this device starts from.
    pub fn default_settings(self) -> GraphSettings {
        match self {
            IreeDevice::Cpu => KERNEL_SETTINGS,
            IreeDevice::Cuda => CUDA_SETTINGS,
        }
    }
}

/// The IREE backend: every device IREE drives here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IreeBackend;

impl IreeBackend {
    /// [`Backend::load`], returning the concrete engine.
    pub fn load_engine(&self, request: &LoadRequest) -> Result<IreeEngine> {
        load_engine(request)
    }
}

impl Backend for IreeBackend {
    fn name(&self) -> &str {
        BACKEND_NAME
    }

    fn description(&self) -> &str {
        "IREE 3.13: StableHLO graphs compiled for the CPU (llvm-cpu, local-task) or an NVIDIA GPU (cuda), greedy on device"
    }

    fn availability(&self) -> Availability {
        if let Err(reason) = compiler_usable() {
            return Availability::Unavailable { reason };
        }
        let mut devices = vec![IreeDevice::Cpu.device_info()];
        // Only a build with the CUDA driver looks for a GPU: the probe creates a device.
        if IreeDevice::Cuda.driver_built() && device_usable(IreeDevice::Cuda).is_ok() {
            devices.push(IreeDevice::Cuda.device_info());
        }
        Availability::Available { devices }
    }

    fn device_availability(&self, id: &str) -> Availability {
        let usable = IreeDevice::from_id(id).map_err(|e| e.to_string()).and_then(|device| {
            compiler_usable()?;
            device_usable(device)?;
            Ok(device)
        });
        match usable {
            Ok(device) => Availability::Available { devices: vec![device.device_info()] },
            Err(reason) => Availability::Unavailable { reason },
        }
    }

    /// What any engine offers; `max_context` is the default cap (a load request may ask for
    /// more, up to the model's `max_position_embeddings`).
    fn capabilities(&self) -> Capabilities {
        capabilities_with(DEFAULT_MAX_CONTEXT, true)
    }

    fn load(&self, request: &LoadRequest) -> Result<Arc<dyn Engine>> {
        Ok(Arc::new(self.load_engine(request)?))
    }
}

/// Whether the compiler can be used here.
///
/// The compiler library counts as usable when it loads (or loaded before, unchanged:
/// [`compiler::compiler_version`]), or when it is not installed yet: `load` installs the pinned
/// wheel first (as `scripts/setup.sh` does) and reports the backend unavailable if that fails. An
/// explicit `SEAM_IREE_COMPILER` that holds no library, or a library that does not load, makes it
/// unusable now.
fn compiler_usable() -> std::result::Result<(), String> {
    if compiler::compiling_disabled() {
        return Ok(());
    }
    match compiler::find_compiler_library() {
        Ok(library) => compiler::compiler_version(&library).map(drop).map_err(|e| e.to_string()),
        Err(e) if compiler::explicit_compiler_path().is_some() => Err(e.to_string()),
        Err(_) => Ok(()),
    }
}

/// Whether `device` can run here: a GPU's runtime device is created once to find out.
fn device_usable(device: IreeDevice) -> std::result::Result<(), String> {
    if device == IreeDevice::Cpu {
        return Ok(());
    }
    // In this order: a build without the driver says so before anything asks for a GPU.
    device
        .driver()
        .and_then(|_| device.compile_flags())
        .and_then(|_| WorkerHandle::spawn(device, &TaskSettings::default(), false).map(drop))
        .map_err(|e| e.to_string())
}

/// Loads a model: the graph engine on an IREE runtime thread.
fn load_engine(request: &LoadRequest) -> Result<IreeEngine> {
    let device = IreeDevice::from_id(request.device.as_deref().unwrap_or("cpu"))?;
    // `--threads` sizes the local-task driver's worker pool (a GPU device has none to size).
    if request.threads == Some(0) {
        return Err(session_api::SeamError::InvalidInput("--threads must be at least 1".into()));
    }
    let task = TaskSettings { workers: request.threads, plugin: None };
    let (settings, flags) = settings_and_flags(device, request)?;
    let compiler = compiler::choose_compiler()?;
    graph_engine::load_engine(BACKEND_NAME, device.id(), request, settings, |model| {
        IreeRuntime::new(device, &task, compiler, flags, model)
    })
}

/// The graph settings of `request` on `device` and the compiler flags of its modules: the same for
/// a load and for compiling ahead, so that both key the module cache alike.
fn settings_and_flags(device: IreeDevice, request: &LoadRequest) -> Result<(GraphSettings, Vec<String>)> {
    // `kernels=none` starts from the settings that suit the pure-StableHLO graphs (layers in a
    // loop), not from the kernels' defaults with the kernels taken out.
    let none = GraphSettings::kernels_requested(request, "SEAM_IREE")? == Some(false);
    let base = if none { STABLEHLO_SETTINGS } else { device.default_settings() };
    let settings = base.with_request(BACKEND_NAME, request, "SEAM_IREE")?;
    Ok((settings, device.compile_flags()?))
}

/// Which of a model's graph groups [`compile_ahead`] compiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphSelection {
    /// The embedding-input graph of every prefill bucket (not needed for token prompts).
    pub embeddings: bool,
    /// Batched decode graphs for batches of at most this many sequences (0: none). A batch is
    /// cut into the graphs' sizes largest first, so a bound of 5 needs only the graphs of 4 and 2.
    pub max_batch: usize,
    /// The scoring graph of every prefill bucket (`Session::prefill_scored`: perplexity, a
    /// server's echoed prompt scores).
    pub scoring: bool,
}

impl GraphSelection {
    /// Every group a load may use.
    pub const ALL: GraphSelection = GraphSelection { embeddings: true, max_batch: usize::MAX, scoring: true };
    /// The token graphs alone: what `seam run` and `seam bench` use.
    pub const TOKENS_ONLY: GraphSelection = GraphSelection { embeddings: false, max_batch: 0, scoring: false };

    fn keeps(&self, group: &[GraphSpec]) -> bool {
        group.iter().all(|spec| match spec.kind {
            GraphKind::PrefillEmbeddings { .. } => self.embeddings,
            GraphKind::DecodeBatch { batch } => batch <= self.max_batch,
            GraphKind::PrefillScored { .. } => self.scoring,
            _ => true,
        })
    }
}

/// Compiles the modules a load of `request` may need (the token graphs, and as `selection` says
/// the embedding and scoring graphs of every prefill bucket and the batched decode graphs) into the module
/// cache, without the device: for a machine that can run the modules but has no compiler
/// (`SEAM_IREE_COMPILER=none` there), such as a GPU machine with no package registry. A CUDA
/// target is compiled for [`device::CUDA_TARGET_ENV`] when no GPU is here. The modules cannot be
/// loaded here, so they are checked only by the compiler.
pub fn compile_ahead(request: &LoadRequest, selection: GraphSelection) -> Result<CompileReport> {
    let device = IreeDevice::from_id(request.device.as_deref().unwrap_or("cpu"))?;
    let (settings, flags) = settings_and_flags(device, request)?;
    let compiler = compiler::choose_compiler()?;
    if compiler == CompilerChoice::CachedOnly {
        return Err(IreeError::CompilerMissing(format!(
            "{}={} turns compiling off",
            compiler::COMPILER_ENV,
            compiler::NO_COMPILER
        ))
        .into());
    }
    let plan = graph_engine::plan_graphs(request, settings)?;
    let groups: Vec<_> = plan.groups().into_iter().filter(|group| selection.keeps(group)).collect();
    let mut total = CompileReport::default();
    for (done, group) in groups.iter().enumerate() {
        request.report("compiling graphs", done as u64, Some(groups.len() as u64));
        total += runtime::compile_graphs(&compiler, &flags, &plan.config, &plan.options, group, |_| Ok(()))?;
    }
    request.report("compiling graphs", groups.len() as u64, Some(groups.len() as u64));
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The batch graphs a bound keeps are those `split_batch` can ask for: for five sequences the
    /// graphs of 4 and 2, never 8 or 16; the token group is always kept.
    #[test]
    fn a_selection_keeps_the_groups_it_names() {
        let groups = graph_engine::graph_groups(&[16, 64]);
        let kept = |selection: GraphSelection| -> Vec<String> {
            groups.iter().filter(|g| selection.keeps(g)).map(|g| g[0].name()).collect()
        };
        let five = kept(GraphSelection { embeddings: true, max_batch: 5, scoring: true });
        assert_eq!(five.len(), groups.len() - 2, "{five:?}");
        assert!(
            five.iter().any(|n| n.starts_with("decode_batch_4"))
                && five.iter().any(|n| n.starts_with("decode_batch_2"))
        );
        assert!(!five.iter().any(|n| n.starts_with("decode_batch_8") || n.starts_with("decode_batch_16")));
        assert_eq!(kept(GraphSelection::TOKENS_ONLY), vec![groups[0][0].name()]);
        assert_eq!(kept(GraphSelection::ALL).len(), groups.len());
        let needed: std::collections::BTreeSet<usize> =
            (1..=5).flat_map(graph_engine::split_batch).filter(|&b| b > 1).collect();
        assert_eq!(needed.into_iter().collect::<Vec<_>>(), vec![2, 4]);
    }
}
