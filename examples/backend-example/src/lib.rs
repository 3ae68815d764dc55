//! # backend-example: a seam backend written as a third party would write one
//!
//! It depends on nothing of seam but the contract (`session-api`). To stay small it forwards the
//! arithmetic to the reference backend, which stands in for a vendor's device runtime; everything
//! a real backend must do itself is here: a registered [`Backend`] that says whether it can run,
//! an [`Engine`] that holds the loaded model and opens the raw steps of each sequence
//! ([`SessionSteps`]), and honest capabilities (this one deliberately does *not* offer fork,
//! embeddings input or top-p, to show how unclaimed capabilities are refused). The contract's
//! rules (argument checks, poisoning, sampling) are seam's, around the steps.
//!
//! Its `tests/conformance.rs` runs seam's whole conformance suite on it with one call.

use session_api::{
    Availability, Backend, Capabilities, Engine, EngineInfo, InputKinds, KvOps, LoadRequest, Result, SamplingModes,
    SeamError, SessionOptions, SessionSteps,
};
use std::sync::Arc;

/// The registry name.
pub const NAME: &str = "example";

session_api::register_backend!(NAME, || Box::new(ExampleBackend::new()));

/// Call this from a binary that links the crate: the registration above lives in this crate's
/// object code, and a crate nothing references may be dropped by the linker with it.
pub fn link() {}

/// The example backend: a factory for [`ExampleEngine`]s.
pub struct ExampleBackend {
    /// The runtime the example forwards to, or why there is none.
    runtime: std::result::Result<Box<dyn Backend>, String>,
}

impl ExampleBackend {
    /// Finds the runtime (here: the reference backend, through the registry). Cheap; no model work.
    pub fn new() -> ExampleBackend {
        backend_reference::link();
        let runtime = session_api::find_backend("reference").map_err(|e| format!("its runtime is missing: {e}"));
        ExampleBackend { runtime }
    }

    fn runtime(&self) -> Result<&dyn Backend> {
        self.runtime
            .as_deref()
            .map_err(|reason| SeamError::Unavailable { backend: NAME.to_string(), reason: reason.clone() })
    }

    /// Loads a model as the concrete engine type.
    pub fn load_example(&self, request: &LoadRequest) -> Result<ExampleEngine> {
        let offered = self.capabilities();
        if !offered.supports_format(request.weights) {
            return Err(SeamError::unsupported(NAME, format!("{} weights", request.weights)));
        }
        let inner = self.runtime()?.load(request)?;
        Ok(ExampleEngine { inner })
    }
}

impl Default for ExampleBackend {
    fn default() -> Self {
        ExampleBackend::new()
    }
}

/// What this backend offers: the runtime's capabilities minus fork, embeddings input and top-p.
fn restrict(mut capabilities: Capabilities) -> Capabilities {
    capabilities.kv_ops = KvOps { truncate: capabilities.kv_ops.truncate, fork: false };
    capabilities.inputs = InputKinds { tokens: true, embeddings: false };
    capabilities.sampling = SamplingModes { top_p: false, ..capabilities.sampling };
    capabilities
}

impl Backend for ExampleBackend {
    fn name(&self) -> &str {
        NAME
    }

    fn description(&self) -> &str {
        "example third-party backend (forwards to the reference backend)"
    }

    fn availability(&self) -> Availability {
        match self.runtime() {
            Ok(runtime) => runtime.availability(),
            Err(e) => Availability::Unavailable { reason: e.to_string() },
        }
    }

    fn capabilities(&self) -> Capabilities {
        match self.runtime() {
            Ok(runtime) => restrict(runtime.capabilities()),
            // Unavailable: nothing is offered (callers check availability first).
            Err(_) => restrict(Capabilities { sampling: SamplingModes::GREEDY_ONLY, ..Capabilities::default() }),
        }
    }

    fn load(&self, request: &LoadRequest) -> Result<Arc<dyn Engine>> {
        Ok(Arc::new(self.load_example(request)?))
    }
}

/// A model loaded by the example backend.
pub struct ExampleEngine {
    inner: Arc<dyn Engine>,
}

impl Engine for ExampleEngine {
    fn info(&self) -> EngineInfo {
        EngineInfo { backend: NAME.to_string(), ..self.inner.info() }
    }

    fn capabilities(&self) -> Capabilities {
        restrict(self.inner.capabilities())
    }

    /// The runtime's raw steps. seam's checked session around them enforces the contract against
    /// [`ExampleEngine::capabilities`], so fork, embeddings input and top-p are refused with
    /// `Unsupported` even though the runtime underneath has them.
    fn open_steps(&self, options: &SessionOptions) -> Result<Box<dyn SessionSteps>> {
        self.inner.open_steps(options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unclaimed_capabilities_are_not_offered() {
        let caps = ExampleBackend::new().capabilities();
        assert!(!caps.kv_ops.fork && !caps.inputs.embeddings && !caps.sampling.top_p);
        assert!(caps.sampling.greedy && caps.inputs.tokens);
    }

    #[test]
    fn registers_itself() {
        link();
        assert!(session_api::registered_backends().iter().any(|b| b.name == NAME));
    }
}
