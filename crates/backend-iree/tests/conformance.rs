//! The whole seam conformance suite on `iree-cpu`, with f16 tolerances (f16 weights and KV
//! cache, f32 accumulation).
//!
//! `harness = false`: this `main` is the test; it prints the suite's matrix and exits non-zero on
//! any failure. `SEAM_CONFORMANCE_CASES=kv.` runs a subset, `SEAM_CONFORMANCE_REAL_MODEL=0` skips
//! the real model, `SEAM_CONFORMANCE_FORMATS=int4` one format. The compiler library is installed
//! into `.seam/py-iree` first; where that is impossible (no network) the test says why and passes.
//!
//! Opt-in for now (`SEAM_IREE_CONFORMANCE=1`): on 2 cores the suite compiles a module per model,
//! context and format it loads and took 15 minutes with the real model skipped, and one case still
//! fails (see the crate's notes); a plain `cargo test` must stay quick and green.

use backend_iree::{compiler::ensure_compiler_library, IreeCpuBackend, IreeEngine};
use conformance::{ComputePrecision, FaultInjection, Target};
use session_api::{LoadRequest, Session, SessionOptions};

/// Sessions whose next step fails inside the IREE runtime, for the poisoning cases.
struct InjectedFaults;

impl FaultInjection for InjectedFaults {
    fn failing_session(&self, request: &LoadRequest, options: SessionOptions) -> session_api::Result<Box<dyn Session>> {
        let engine: IreeEngine = IreeCpuBackend.load_engine(request)?;
        engine.session_with_injected_fault(options)
    }
}

fn main() {
    if std::env::var("SEAM_IREE_CONFORMANCE").as_deref() != Ok("1") {
        eprintln!("SKIPPED conformance on iree-cpu: set SEAM_IREE_CONFORMANCE=1 to run it (about 15 minutes on 2 cores)");
        return;
    }
    if let Err(e) = ensure_compiler_library() {
        eprintln!("SKIPPED conformance on iree-cpu: {e}");
        return;
    }
    conformance::test_main(
        Target::new(Box::new(IreeCpuBackend)).with_precision(ComputePrecision::F16).with_fault_injection(InjectedFaults),
    );
}
