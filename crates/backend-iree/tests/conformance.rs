//! The whole seam conformance suite on `iree-cpu`, with f16 tolerances (f16 weights and KV
//! cache, f32 accumulation), real default model included (quick: two prompts per format).
//!
//! `harness = false`: this `main` is the test; it prints the suite's matrix and exits non-zero on
//! any failure. `SEAM_CONFORMANCE_CASES=kv.` runs a subset, `SEAM_CONFORMANCE_REAL_MODEL=0` skips
//! the real model, `SEAM_CONFORMANCE_FORMATS=int4` one format. The compiler library is installed
//! into `.seam/py-iree` first; where that is impossible (no network) the test says why and passes.
//!
//! Cost on 2 cores: the suite compiles one module per model, context and format it loads (and
//! one more for the logits variants), cached in `.seam/cache/iree`; cold, that is most of this
//! test's time (see docs/backends/iree.md), warm it takes about a minute.

use backend_iree::compiler::ensure_compiler_library;
use conformance::{ComputePrecision, Target};

fn main() {
    if let Err(e) = ensure_compiler_library() {
        eprintln!("SKIPPED conformance on iree-cpu: {e}");
        return;
    }
    conformance::test_main({
        backend_iree::link();
        Target::registered("iree-cpu").expect("iree-cpu is registered").with_precision(ComputePrecision::F16)
    });
}
