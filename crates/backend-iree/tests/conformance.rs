//! The whole seam conformance suite on `iree-cpu`, with f16 tolerances (f16 weights and KV
//! cache, f32 accumulation), real default model included (quick: two prompts per format).
//!
//! `harness = false`: this `main` is the test; it prints the suite's matrix and exits non-zero on
//! any failure. `SEAM_CONFORMANCE_CASES=kv.` runs a subset, `SEAM_CONFORMANCE_REAL_MODEL=0` skips
//! the real model, `SEAM_CONFORMANCE_FORMATS=int4` one format. The compiler library is installed
//! into `.seam/py-iree` first; where that is impossible (no network) the test says why and passes.
//!
//! The suite runs the default graphs, whose products are dispatches of seam's kernels
//! (`kernels=seam`, ADR 0021); a second, shorter pass runs the greedy-parity cases on the tiny
//! models with `SEAM_IREE_KERNELS=none`, so the pure-StableHLO graphs (every product compiled by
//! IREE, as on a GPU) stay proven on the CPU too. A third pass runs the whole suite on int4 with
//! `SEAM_IREE_ACTIVATIONS=int8` (the kernels' products over activations rounded to int8, ADR
//! 0024) under the int8 preset.
//!
//! Cost on 2 cores: the suite compiles one module per model, context and format it loads (and
//! one more for the logits variants), cached in `.seam/cache/iree`; cold, that is most of this
//! test's time (see docs/backends/iree.md), warm it takes about a minute.

use backend_iree::compiler::ensure_compiler_library;
use conformance::{check_target, ComputePrecision, SuiteOptions, Target};
use session_api::WeightFormat;

fn main() {
    if let Err(e) = ensure_compiler_library() {
        eprintln!("SKIPPED conformance on iree-cpu: {e}");
        return;
    }
    backend_iree::link();
    let target =
        || Target::registered("iree-cpu").expect("iree-cpu is registered").with_precision(ComputePrecision::F16);
    check_target("iree-cpu", target(), &SuiteOptions::from_env());

    // The graphs without seam's kernels. Set before any load of this pass reads it; the suite
    // above has finished, and nothing else in this process reads the environment concurrently.
    std::env::set_var("SEAM_IREE_KERNELS", "none");
    let options = SuiteOptions {
        case_filter: Some("parity.".into()),
        real_model: conformance::RealModelParity::Skip,
        ..SuiteOptions::from_env()
    };
    check_target("iree-cpu with kernels=none (pure-StableHLO graphs)", target(), &options);

    // The kernels again, int4 products over activations rounded to int8 (`activations=int8`, ADR
    // 0024), held to that precision's preset: the whole suite, the real model included.
    std::env::remove_var("SEAM_IREE_KERNELS");
    std::env::set_var("SEAM_IREE_ACTIVATIONS", "int8");
    let from_env = SuiteOptions::from_env();
    let formats: Vec<WeightFormat> = from_env.formats.iter().copied().filter(|&f| f == WeightFormat::Int4).collect();
    if !formats.is_empty() {
        let options = SuiteOptions { formats, ..from_env };
        let target =
            Target::registered("iree-cpu").expect("iree-cpu is registered").with_precision(ComputePrecision::Int8);
        check_target("iree-cpu with activations=int8", target, &options);
    }
    println!("conformance: iree-cpu passed");
}
