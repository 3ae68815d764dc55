//! The whole seam conformance suite on this backend, with one call.
//!
//! `harness = false`: this `main` is the test. It prints the suite's matrix and exits non-zero on
//! any failure. `SEAM_CONFORMANCE_CASES=kv.` runs a subset, `SEAM_CONFORMANCE_REAL_MODEL=0` skips
//! the real model.

use backend_example::ExampleBackend;
use conformance::{FaultInjection, Target};
use session_api::{LoadRequest, Session, SessionOptions};

/// Lets the suite check poisoning: a session whose next step fails inside the backend.
struct InjectedFaults;

impl FaultInjection for InjectedFaults {
    fn failing_session(&self, request: &LoadRequest, options: SessionOptions) -> session_api::Result<Box<dyn Session>> {
        ExampleBackend::new().load_example(request)?.session_with_injected_fault(options)
    }
}

fn main() {
    conformance::test_main(Target::new(Box::new(ExampleBackend::new())).with_fault_injection(InjectedFaults));
}
