//! Errors of the IREE backend, and how they map onto the session contract's [`SeamError`](session_api::SeamError).

use std::path::PathBuf;

/// What can go wrong between a model directory and a running IREE module.
#[derive(Debug, thiserror::Error)]
pub enum IreeError {
    /// No `libIREECompiler.so` was found, and installing one failed or was not possible.
    #[error("the IREE compiler library was not found: {0}")]
    CompilerMissing(String),
    /// The library was found but could not be loaded.
    #[error("the IREE compiler library {path} could not be loaded: {message}")]
    CompilerLoad { path: PathBuf, message: String },
    /// The compiler rejected a graph.
    #[error("IREE failed to compile the {graph} graphs: {message}")]
    Compile { graph: String, message: String },
    /// The runtime failed (device creation, module load, an invocation).
    #[error("IREE runtime: {0}")]
    Runtime(String),
    /// The graph emitter refused the model or the options.
    #[error(transparent)]
    Graph(#[from] stablehlo_llama::GraphError),
    /// Reading or writing the module cache.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The device cannot be used here (no driver in this build, no GPU, no architecture).
    #[error("{0}")]
    Unavailable(String),
    /// A device id the backend does not drive.
    #[error("{0}")]
    NoSuchDevice(String),
    /// The runtime thread is gone (it panicked, or the engine was torn down).
    #[error("the IREE runtime thread is gone")]
    WorkerGone,
}

impl IreeError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        IreeError::Io { path: path.into(), source }
    }
}

impl From<iree_runtime::Error> for IreeError {
    fn from(e: iree_runtime::Error) -> Self {
        IreeError::Runtime(e.to_string())
    }
}

impl From<IreeError> for session_api::SeamError {
    fn from(e: IreeError) -> Self {
        use session_api::SeamError;
        match e {
            IreeError::CompilerMissing(_) | IreeError::CompilerLoad { .. } | IreeError::Unavailable(_) => {
                SeamError::Unavailable { backend: crate::BACKEND_NAME.to_string(), reason: e.to_string() }
            }
            IreeError::Graph(stablehlo_llama::GraphError::Options(message)) | IreeError::NoSuchDevice(message) => {
                SeamError::InvalidInput(message)
            }
            IreeError::Graph(g) => SeamError::ModelFormat { path: None, message: g.to_string() },
            IreeError::Io { path, source } => SeamError::Io { path, source },
            other => SeamError::Backend(other.to_string()),
        }
    }
}
