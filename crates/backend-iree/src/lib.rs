//! # backend-iree: seam on IREE
//!
//! `iree-cpu` runs the StableHLO graphs of [`stablehlo_llama`] through IREE 3.13: the compiler
//! is the `iree-base-compiler==3.13.0` wheel's library (see [`compiler`]), the runtime is built
//! from source by the `eerie` crate and driven on IREE's `local-task` driver (every core).
//! `iree-cuda` runs the same graphs compiled for the `cuda` target on IREE's CUDA driver; it is
//! registered in every build but available only in builds with the `cuda` feature, on a machine
//! with an NVIDIA GPU ([`device`]).
//!
//! - Compiled modules are cached on disk ([`compiler::compile_cached`]): a second load of the same
//!   model, context and format compiles nothing.
//! - The runtime is not `Send`, so one thread owns it ([`worker`]); engines and sessions talk to it
//!   over channels.
//! - Weights are uploaded once per engine and shared by its sessions; each session has its own KV
//!   cache on the device, updated in place; greedy argmax runs on the device, so a decode step
//!   copies back 4 bytes ([`engine`]).
//!
//! Register with the binary by calling [`link`] (see `session_api::registry` on why).

pub mod compiler;
pub mod device;
pub mod engine;
pub mod error;
pub mod worker;

pub use engine::{IreeEngine, IreeSession, DEFAULT_MAX_CONTEXT, PREFILL_BUCKETS};
pub use device::IreeDevice;
pub use error::IreeError;

use engine::{capabilities_with, load_model_module, LoadedModel};
use llama_model::model_dir::ModelDir;
use llama_model::weights::load_weights;
use session_api::{Availability, Backend, Capabilities, Engine, EngineInfo, LoadRequest, Result, SeamError};
use stablehlo_llama::{graph_host_args, StorageDtype, GraphOptions, LayerMode};
use std::sync::Arc;
use std::time::Instant;
use worker::WorkerHandle;

/// The registry name of the CPU backend.
pub const BACKEND_NAME: &str = "iree-cpu";
/// The registry name of the CUDA backend.
pub const CUDA_BACKEND_NAME: &str = "iree-cuda";

session_api::register_backend!(BACKEND_NAME, || Box::new(IreeBackend::CPU));
session_api::register_backend!(CUDA_BACKEND_NAME, || Box::new(IreeBackend::CUDA));

/// Referenced by binaries so the linker keeps this crate's registration.
pub fn link() {}

/// Environment variable choosing how the graphs lay out the decoder layers: `loop` (the default)
/// or `unrolled`. The loop compiles 3-5x faster at the same step time (docs/backends/iree.md); the
/// knob is there to measure the difference.
pub const LAYERS_ENV: &str = "SEAM_IREE_LAYERS";

/// The layer layout [`LAYERS_ENV`] asks for.
pub fn layer_mode() -> Result<LayerMode> {
    match std::env::var(LAYERS_ENV).ok().as_deref() {
        None | Some("") | Some("loop") => Ok(LayerMode::Loop),
        Some("unrolled") => Ok(LayerMode::Unrolled),
        Some(other) => Err(SeamError::InvalidInput(format!("{LAYERS_ENV}={other}: expected `loop` or `unrolled`"))),
    }
}

/// An IREE backend on one kind of device: [`IreeBackend::CPU`] (`iree-cpu`) or
/// [`IreeBackend::CUDA`] (`iree-cuda`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IreeBackend {
    device: IreeDevice,
}

impl IreeBackend {
    /// IREE on the CPU: llvm-cpu code, local-task driver.
    pub const CPU: IreeBackend = IreeBackend { device: IreeDevice::Cpu };
    /// IREE on an NVIDIA GPU: the compiler's cuda target, IREE's CUDA driver (`cuda` feature).
    pub const CUDA: IreeBackend = IreeBackend { device: IreeDevice::Cuda };

    /// [`Backend::load`], returning the concrete engine.
    pub fn load_engine(&self, request: &LoadRequest) -> Result<IreeEngine> {
        load_engine(self.device, request)
    }
}

impl Backend for IreeBackend {
    fn name(&self) -> &str {
        self.device.backend_name()
    }

    fn description(&self) -> &str {
        match self.device {
            IreeDevice::Cpu => "IREE 3.13 on the CPU: StableHLO graphs compiled for llvm-cpu, local-task driver, greedy on device",
            IreeDevice::Cuda => {
                "IREE 3.13 on an NVIDIA GPU: StableHLO graphs compiled for the cuda target, CUDA driver, greedy on device"
            }
        }
    }

    fn availability(&self) -> Availability {
        availability(self.device)
    }

    /// What any engine offers; `max_context` is the default cap (a load request may ask for
    /// more, up to the model's `max_position_embeddings`).
    fn capabilities(&self) -> Capabilities {
        capabilities_with(DEFAULT_MAX_CONTEXT)
    }

    fn load(&self, request: &LoadRequest) -> Result<Arc<dyn Engine>> {
        Ok(Arc::new(self.load_engine(request)?))
    }
}

/// Whether `device` can run here.
///
/// The compiler library counts as available when it loads, or when it is not installed yet:
/// `load` installs the pinned wheel first (as `scripts/setup.sh` does) and reports the backend
/// unavailable if that fails. An explicit `SEAM_IREE_COMPILER` that holds no library, or a library
/// that does not load, makes it unavailable now. A GPU device must also be present: its runtime
/// device is created once to find out.
fn availability(device: IreeDevice) -> Availability {
    let unavailable = |reason: String| Availability::Unavailable { reason };
    match compiler::find_compiler_library() {
        Ok(library) => {
            if let Err(e) = compiler::load_compiler(&library) {
                return unavailable(e.to_string());
            }
        }
        Err(e) if compiler::explicit_compiler_path().is_some() => return unavailable(e.to_string()),
        Err(_) => {}
    }
    if device != IreeDevice::Cpu {
        // In this order: a build without the driver says so before anything asks for a GPU.
        let usable = device.device_spec().and_then(|_| device.compile_flags()).and_then(|_| WorkerHandle::spawn(device).map(drop));
        if let Err(e) = usable {
            return unavailable(e.to_string());
        }
    }
    Availability::Available { devices: vec![device.device_info()] }
}

/// Loads a model for `device`: weights read and uploaded once, the module compiled or read from
/// the cache.
fn load_engine(device: IreeDevice, request: &LoadRequest) -> Result<IreeEngine> {
    load_engine_inner(device, request).map_err(|e| error::for_backend(e, device.backend_name()))
}

fn load_engine_inner(device: IreeDevice, request: &LoadRequest) -> Result<IreeEngine> {
    let name = device.backend_name();
    if let Some(index) = request.device.filter(|&d| d != 0) {
        return Err(SeamError::InvalidInput(format!("{name} drives one device (index 0), not {index}")));
    }
    if request.max_context == Some(0) {
        return Err(SeamError::InvalidInput("max_context must be at least 1".into()));
    }
    // IREE's local-task driver sizes its worker pool from the machine, and eerie exposes no way to
    // change that: a thread count other than "every core" would be silently ignored, so refuse it.
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    if let Some(threads) = request.threads.filter(|&t| t != cores && device == IreeDevice::Cpu) {
        return Err(SeamError::Unsupported {
            backend: name.to_string(),
            feature: format!("a thread count ({threads}) other than every core ({cores}): the local-task driver uses all of them"),
        });
    }
    let started = Instant::now();
    let flags = device.compile_flags()?;
    let compiler_library = compiler::ensure_compiler_library()?;
    compiler::load_compiler(&compiler_library)?;
    let dir = ModelDir::open(&request.model_dir)?;
    let report_read = |done: u64, total: u64| request.report("reading weights", done, Some(total));
    let weights = load_weights(&request.model_dir, request.weights, Some(&report_read))?;
    let config = weights.config.clone();
    let max_context = request.max_context.unwrap_or(DEFAULT_MAX_CONTEXT).min(config.max_position_embeddings);
    let options = GraphOptions { max_context, format: request.weights, layers: layer_mode()?, dense: StorageDtype::F16, cache: StorageDtype::F16, int4_dequantize_from: stablehlo_llama::PREFILL_DEQUANTIZE_MIN_TOKENS };
    let args = graph_host_args(&weights, &options).map_err(IreeError::from)?;
    drop(weights);
    let weight_bytes: u64 = args.iter().map(|a| a.bytes.len() as u64).sum();

    let worker = WorkerHandle::spawn(device)?;
    request.report("compiling graphs (cached after the first load)", 0, Some(1));
    load_model_module(&worker, &compiler_library, &flags, &config, &options)?;
    request.report("compiling graphs (cached after the first load)", 1, Some(1));
    request.report("uploading weights", 0, Some(1));
    worker.upload_weights(args)?;
    request.report("uploading weights", 1, Some(1));

    let info = EngineInfo {
        backend: name.to_string(),
        model: dir.name(),
        weights: request.weights,
        resident_precision: request.weights.as_str().to_string(),
        vocab_size: config.vocab_size,
        hidden_size: config.hidden_size,
        load_time: Default::default(),
        weight_bytes,
    };
    let mut engine = IreeEngine::new(LoadedModel { worker, device, config, options, info });
    engine.set_load_time(started.elapsed());
    Ok(engine)
}
