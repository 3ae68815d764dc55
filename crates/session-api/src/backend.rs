//! The backend (a registered factory) and the engine (a loaded model).

use crate::batch::BatchedStep;
use crate::capabilities::{Capabilities, WeightFormat};
use crate::error::Result;
use crate::session::{CheckedSession, RawStep, Session, SessionLimits, SessionOptions, SessionSteps, StepInput};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// What kind of hardware a device is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    /// The host's processor.
    Cpu,
    /// A GPU.
    Gpu,
    /// Another accelerator (a vendor's card behind its own PJRT plugin or compiler).
    Accelerator,
}

/// A device a backend can run on: data, as ggml-backend's device properties are.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceInfo {
    /// The id to pass as [`LoadRequest::device`]: `cpu`, `cuda:0`, ...
    pub id: String,
    /// What kind of device it is.
    pub kind: DeviceKind,
    /// Human-readable name, e.g. "AMD EPYC 7B13 (2 threads)" or "NVIDIA H100 80GB".
    pub name: String,
    /// Memory available to the backend on this device, when known.
    pub memory_bytes: Option<u64>,
}

impl DeviceInfo {
    /// The device `requested` names among `devices` (the first when `None`), or an
    /// `InvalidInput` error listing the ids there are.
    pub fn select<'a>(backend: &str, devices: &'a [DeviceInfo], requested: Option<&str>) -> Result<&'a DeviceInfo> {
        let found = match requested {
            None => devices.first(),
            Some(id) => devices.iter().find(|d| d.id == id),
        };
        found.ok_or_else(|| {
            let ids: Vec<&str> = devices.iter().map(|d| d.id.as_str()).collect();
            crate::SeamError::InvalidInput(format!(
                "{backend} has no device {} here (devices: {})",
                requested.unwrap_or("at all"),
                if ids.is_empty() { "none".to_string() } else { ids.join(", ") }
            ))
        })
    }
}

/// Whether a backend can run on this machine.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Availability {
    /// Ready, with the devices it found.
    Available { devices: Vec<DeviceInfo> },
    /// Not usable here, and why (plugin missing, API version mismatch, no device).
    Unavailable { reason: String },
}

impl Availability {
    /// Whether the backend can be used.
    pub fn is_available(&self) -> bool {
        matches!(self, Availability::Available { .. })
    }
}

/// Progress of a long load, reported to [`LoadRequest::progress`].
#[derive(Debug, Clone, PartialEq)]
pub struct LoadProgress {
    /// What is happening ("reading weights", "quantizing", "compiling decode graph").
    pub stage: String,
    /// Units done so far.
    pub done: u64,
    /// Units in all, when known.
    pub total: Option<u64>,
}

/// A callback for [`LoadProgress`].
pub type ProgressFn = Arc<dyn Fn(LoadProgress) + Send + Sync>;

/// What to load and how.
#[derive(Clone)]
pub struct LoadRequest {
    /// A seam model directory (Hugging Face layout plus seam's int4 file).
    pub model_dir: PathBuf,
    /// The weight format to run.
    pub weights: WeightFormat,
    /// Cap on the context length; `None` takes the backend's default for the model.
    pub max_context: Option<usize>,
    /// The id of one of [`Availability::Available`]'s devices (`cpu`, `cuda:0`); `None` takes
    /// the first.
    pub device: Option<String>,
    /// Host threads the backend may use; `None` takes all cores.
    pub threads: Option<usize>,
    /// Backend-specific settings of this load (`layers=unrolled`, ...), each documented by its
    /// backend. A backend refuses keys it does not know with `InvalidInput`.
    pub settings: BTreeMap<String, String>,
    /// Called as loading proceeds.
    pub progress: Option<ProgressFn>,
}

impl LoadRequest {
    /// A request with defaults for everything but the model and format.
    pub fn new(model_dir: impl Into<PathBuf>, weights: WeightFormat) -> Self {
        LoadRequest {
            model_dir: model_dir.into(),
            weights,
            max_context: None,
            device: None,
            threads: None,
            settings: BTreeMap::new(),
            progress: None,
        }
    }

    /// Setting `key`: from [`LoadRequest::settings`], else from the environment variable `env`
    /// (an override kept for measuring without code), else `None`.
    pub fn setting(&self, key: &str, env: &str) -> Option<String> {
        self.settings.get(key).cloned().or_else(|| std::env::var(env).ok().filter(|v| !v.is_empty()))
    }

    /// Refuses settings whose keys are not among `known`.
    pub fn check_settings(&self, backend: &str, known: &[&str]) -> Result<()> {
        match self.settings.keys().find(|k| !known.contains(&k.as_str())) {
            Some(key) => Err(crate::SeamError::InvalidInput(format!(
                "{backend} has no setting '{key}' (its settings: {})",
                if known.is_empty() { "none".to_string() } else { known.join(", ") }
            ))),
            None => Ok(()),
        }
    }

    /// Reports progress if a callback was given.
    pub fn report(&self, stage: &str, done: u64, total: Option<u64>) {
        if let Some(progress) = &self.progress {
            progress(LoadProgress { stage: stage.to_string(), done, total });
        }
    }
}

impl fmt::Debug for LoadRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadRequest")
            .field("model_dir", &self.model_dir)
            .field("weights", &self.weights)
            .field("max_context", &self.max_context)
            .field("device", &self.device)
            .field("threads", &self.threads)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// A backend: a factory registered with [`crate::register_backend!`].
pub trait Backend: Send + Sync {
    /// The registry name (`reference`, `iree-cpu`, `pjrt-cuda`, ...).
    fn name(&self) -> &str;

    /// One line for `seam backends`.
    fn description(&self) -> &str;

    /// Whether this backend can run here; cheap enough to call for a listing.
    fn availability(&self) -> Availability;

    /// What the backend offers for any model (an engine refines `max_context`).
    fn capabilities(&self) -> Capabilities;

    /// Loads a model. Fails with `Unavailable` when [`Backend::availability`] says so, with
    /// `Unsupported` for a weight format it does not run, and with `ModelFormat` for a bad model.
    fn load(&self, request: &LoadRequest) -> Result<Arc<dyn Engine>>;

    /// Whether the device `id` can run here, and if not why (for `seam backends` and device
    /// aliases). By default: available when [`Backend::availability`] lists it.
    fn device_availability(&self, id: &str) -> Availability {
        match self.availability() {
            Availability::Available { devices } => match DeviceInfo::select(self.name(), &devices, Some(id)) {
                Ok(device) => Availability::Available { devices: vec![device.clone()] },
                Err(e) => Availability::Unavailable { reason: e.to_string() },
            },
            unavailable => unavailable,
        }
    }

    /// The same backend configured by `settings` that decide what it is before anything loads
    /// (a plugin file, for instance): its availability and devices then follow them. By default
    /// a backend takes no such settings.
    fn configure(&self, settings: &BTreeMap<String, String>) -> Result<Box<dyn Backend>> {
        let keys: Vec<&str> = settings.keys().map(String::as_str).collect();
        Err(crate::SeamError::InvalidInput(format!(
            "{} takes no backend settings (given: {})",
            self.name(),
            keys.join(", ")
        )))
    }
}

/// What an engine reports about itself (for `seam run`, stats and `seam backends`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EngineInfo {
    /// The backend's registry name.
    pub backend: String,
    /// The id of the device it runs on (`cpu`, `cuda:0`).
    pub device: String,
    /// The model's name (its directory name).
    pub model: String,
    /// The weight format requested.
    pub weights: WeightFormat,
    /// The precision the weights are resident in on the device ("f32", "f16", "int4").
    pub resident_precision: String,
    /// Vocabulary size: valid token ids are `0..vocab_size`.
    pub vocab_size: usize,
    /// Hidden size, the width of an embedding vector.
    pub hidden_size: usize,
    /// Time the load took.
    #[serde(with = "duration_ms")]
    pub load_time: Duration,
    /// Bytes of weights resident on the device.
    pub weight_bytes: u64,
    /// Bytes one decode step reads from device memory, where the backend knows it: the resident
    /// weights it multiplies by (an untied embedding table is only gathered from) and the KV cache
    /// it attends over where that does not depend on the conversation (a graph that masks the
    /// whole cache; a kernel that reads only the filled positions is left out, so the figure is
    /// then a lower bound). With tokens per second it gives the memory bandwidth decode reaches.
    pub decode_bytes_per_token: Option<u64>,
}

/// A loaded model: its weights, held once, shared by all of its sessions.
///
/// A backend implements [`Engine::open_steps`]; callers make sessions with
/// `engine.new_session(options)` (defined on `dyn Engine`), which refuses options the engine
/// cannot honour and wraps the steps in a [`CheckedSession`], so the contract's rules hold the
/// same way on every backend.
pub trait Engine: Send + Sync {
    /// Facts about the loaded model.
    fn info(&self) -> EngineInfo;

    /// Capabilities with the loaded model's limits filled in.
    fn capabilities(&self) -> Capabilities;

    /// The device's memory bandwidth in bytes per second, measured now by a probe on the device
    /// itself (bytes moved by a copy or a reduction over a large array), for benchmarks to say what fraction of it decode
    /// reaches. `None` where the backend has no such probe.
    fn measure_memory_bandwidth(&self) -> Result<Option<f64>> {
        Ok(None)
    }

    /// Makes ready now what serving up to `sequences` sequences at once would otherwise make on
    /// first use (a compiling backend's graphs for each prompt chunk and batch size), so that a
    /// server pays for it before it accepts requests instead of stalling every running stream
    /// in the middle of serving. The default has nothing to prepare.
    fn prepare_for_serving(&self, sequences: usize) -> Result<()> {
        let _ = sequences;
        Ok(())
    }

    /// The raw steps of a new, empty sequence. `options` have already been checked against
    /// [`Engine::capabilities`]; sampling happens above the backend, so most backends ignore them.
    fn open_steps(&self, options: &SessionOptions) -> Result<Box<dyn SessionSteps>>;

    /// Appends one token to each of several sequences of this engine (continuous batching), and
    /// returns each one's step, in order. Called by `decode_batch` on `dyn Engine` (see
    /// [`crate::batch`]) only with steps this engine opened, each already checked as a decode
    /// would be; `want_logits` is set when any entry needs logits.
    ///
    /// The default appends to each in turn, so every engine can serve a batch; an engine that
    /// claims [`Capabilities::batched_decode`] overrides it to run the whole batch as one call
    /// (weights read once for every sequence). Each entry's result stands alone: a failed entry
    /// poisons only its own session.
    fn decode_batch_steps(&self, batch: &mut [BatchedStep<'_>], want_logits: bool) -> Vec<Result<RawStep>> {
        batch
            .iter_mut()
            .map(|entry| entry.steps.append(entry.position, StepInput::Tokens(&[entry.token]), want_logits))
            .collect()
    }
}

impl<'a> dyn Engine + 'a {
    /// A new, empty session. Refuses options the engine cannot honour with `Unsupported`
    /// (see [`SessionOptions::check_against`]).
    pub fn new_session(&self, options: SessionOptions) -> Result<Box<dyn Session>> {
        Ok(Box::new(self.new_checked_session(options)?))
    }

    /// `new_session` as the concrete [`CheckedSession`], which batched
    /// decodes ([`crate::batch`]) and [`CheckedSession::restart`] work on.
    pub fn new_checked_session(&self, options: SessionOptions) -> Result<CheckedSession> {
        let (limits, steps) = self.checked_parts(&options)?;
        Ok(CheckedSession::new(steps, limits, options).opened_by(self.address()))
    }

    /// This engine's address, which identifies it to the sessions it opened.
    pub(crate) fn address(&self) -> usize {
        self as *const Self as *const () as usize
    }

    /// A session whose next step fails once after running (feature `fault-injection`, for test
    /// suites): see [`crate::session::FailingSteps`].
    #[cfg(feature = "fault-injection")]
    pub fn new_session_failing_once(&self, options: SessionOptions) -> Result<Box<dyn Session>> {
        let (limits, steps) = self.checked_parts(&options)?;
        Ok(Box::new(CheckedSession::new(Box::new(crate::session::FailingSteps::new(steps)), limits, options)))
    }

    fn checked_parts(&self, options: &SessionOptions) -> Result<(SessionLimits, Box<dyn SessionSteps>)> {
        let info = self.info();
        let capabilities = self.capabilities();
        options.check_against(&info.backend, &capabilities)?;
        options.check_vocabulary(info.vocab_size)?;
        let steps = self.open_steps(options)?;
        let limits = SessionLimits {
            backend: info.backend,
            vocab_size: info.vocab_size,
            hidden_size: info.hidden_size,
            capabilities,
        };
        Ok((limits, steps))
    }
}

pub(crate) mod duration_ms {
    use serde::Serializer;
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64() * 1000.0)
    }
}
