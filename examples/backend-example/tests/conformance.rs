//! The whole seam conformance suite on this backend, with one call.
//!
//! `harness = false`: this `main` is the test. It prints the suite's matrix and exits non-zero on
//! any failure. `SEAM_CONFORMANCE_CASES=kv.` runs a subset, `SEAM_CONFORMANCE_REAL_MODEL=0` skips
//! the real model.

use backend_example::ExampleBackend;
use conformance::Target;

fn main() {
    conformance::test_main(Target::new(Box::new(ExampleBackend::new())));
}
