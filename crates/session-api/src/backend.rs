//! The backend (a registered factory) and the engine (a loaded model).

use crate::capabilities::{Capabilities, WeightFormat};
use crate::error::Result;
use crate::session::{Session, SessionOptions};
use serde::Serialize;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// A device a backend can run on.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceInfo {
    /// Index to pass as [`LoadRequest::device`].
    pub index: usize,
    /// Human-readable name, e.g. "AMD EPYC 7B13 (2 threads)" or "NVIDIA H100 80GB".
    pub name: String,
    /// Memory available to the backend on this device, when known.
    pub memory_bytes: Option<u64>,
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
    /// Which of [`Availability::Available`]'s devices; `None` takes the first.
    pub device: Option<usize>,
    /// Host threads the backend may use; `None` takes all cores.
    pub threads: Option<usize>,
    /// Called as loading proceeds.
    pub progress: Option<ProgressFn>,
}

impl LoadRequest {
    /// A request with defaults for everything but the model and format.
    pub fn new(model_dir: impl Into<PathBuf>, weights: WeightFormat) -> Self {
        LoadRequest { model_dir: model_dir.into(), weights, max_context: None, device: None, threads: None, progress: None }
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
}

/// What an engine reports about itself (for `seam run`, stats and `seam backends`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EngineInfo {
    /// The backend's registry name.
    pub backend: String,
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
}

/// A loaded model: its weights, held once, shared by all of its sessions.
pub trait Engine: Send + Sync {
    /// Facts about the loaded model.
    fn info(&self) -> EngineInfo;

    /// Capabilities with the loaded model's limits filled in.
    fn capabilities(&self) -> Capabilities;

    /// A new, empty session. Refuses options the engine cannot honour with `Unsupported`
    /// (see [`SessionOptions::check_against`]).
    fn new_session(&self, options: SessionOptions) -> Result<Box<dyn Session>>;
}

pub(crate) mod duration_ms {
    use serde::Serializer;
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64() * 1000.0)
    }
}
