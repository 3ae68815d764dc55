//! The whole seam conformance suite on `pjrt-cpu` (XLA's CPU plugin), real default model
//! included, fp16 and int4.
//!
//! `harness = false`: this `main` is the test; it prints the suite's matrix and exits non-zero on
//! any failure. `SEAM_CONFORMANCE_CASES=kv.` runs a subset, `SEAM_CONFORMANCE_REAL_MODEL=0` skips
//! the real model, `SEAM_CONFORMANCE_FORMATS=int4` one format.
//!
//! `pjrt-cuda` runs in the same matrix: where no CUDA plugin loads or no GPU is found it is listed
//! as unavailable with the reason (not a failure); where it is available it must pass too.
//!
//! On the CPU the suite runs the default graphs, which call seam's kernels as custom calls
//! (`kernels=seam`); a second, shorter pass runs the greedy-parity cases on the tiny models with
//! `SEAM_PJRT_KERNELS=none`, so the pure-StableHLO graphs XLA's CPU plugin falls back to stay
//! proven too, and then the forms pjrt takes on a GPU (`vector_products=reduce`,
//! `dot_precision=highest`, ADR 0028, with greedy steps launched ahead as on a device, ADR 0041;
//! and `reduce-words`, `reduce-nibbles`), and the graphs of `cuda-kernels` and `cuda-kernels-each`
//! with the CUDA kernels' calls computed on the host. A last pass runs the whole suite on
//! int4 with `SEAM_PJRT_ACTIVATIONS=int8` (the kernels' products over activations rounded to int8,
//! ADR 0024) under the int8 preset.
//!
//! Tolerances are the f16 ones: the KV cache is f16 and int4 scales are f16 on every device, and
//! on a GPU the matrices are f16 too. Compiled executables are cached in `.seam/cache/pjrt`.

use conformance::{check_target, ComputePrecision, SuiteOptions, Target};
use session_api::WeightFormat;

/// `pjrt-cpu` held to `precision`'s tolerances (a pass after the first, with its own settings).
fn pjrt_cpu(precision: ComputePrecision) -> Target {
    Target::registered("pjrt-cpu").expect("pjrt-cpu is registered").with_precision(precision)
}

fn main() {
    backend_pjrt::link();
    let targets = ["pjrt-cpu", "pjrt-cuda"].map(|name| {
        let target = Target::registered(name).unwrap_or_else(|e| panic!("{name} is registered: {e}"));
        target.with_precision(ComputePrecision::F16)
    });
    let report = match conformance::run_targets(&targets, &SuiteOptions::from_env()) {
        Ok(report) => report,
        Err(e) => {
            eprintln!("conformance: {e}");
            std::process::exit(1);
        }
    };
    report.print_matrix();
    let cpu_unavailable = report.backends.iter().any(|b| b.backend == "pjrt-cpu" && !b.availability.is_available());
    if report.has_failures() || cpu_unavailable {
        eprintln!("conformance: {}", if cpu_unavailable { "pjrt-cpu is unavailable" } else { "FAILED" });
        std::process::exit(1);
    }

    // The graphs without seam's kernels. Set before any load of this pass reads it; the suite
    // above has finished, and nothing else in this process reads the environment concurrently.
    std::env::set_var("SEAM_PJRT_KERNELS", "none");
    let options = SuiteOptions {
        case_filter: Some("parity.".into()),
        real_model: conformance::RealModelParity::Skip,
        ..SuiteOptions::from_env()
    };
    let target = pjrt_cpu(ComputePrecision::F16);
    check_target("pjrt-cpu with kernels=none (pure-StableHLO graphs)", target, &options);

    // The forms pjrt takes on a GPU (ADR 0028), proven here on the CPU plugin: decode's products
    // as reductions, f32 dots; the whole suite on the tiny models (its self-consistency cases are
    // what TF32 dots failed on a GPU), then the 32-bit-word reductions' parity.
    // The device forms, and a device's way of decoding: each greedy step launches the next ahead.
    std::env::set_var("SEAM_PJRT_VECTOR_PRODUCTS", "reduce");
    std::env::set_var("SEAM_PJRT_DOT_PRECISION", "highest");
    std::env::set_var(backend_pjrt::runtime::LAUNCH_AHEAD_ENV, "1");
    let device_forms = SuiteOptions { real_model: conformance::RealModelParity::Skip, ..SuiteOptions::from_env() };
    let target = pjrt_cpu(ComputePrecision::F16);
    check_target(
        "pjrt-cpu with the device forms (vector_products=reduce, steps launched ahead)",
        target,
        &device_forms,
    );
    std::env::remove_var(backend_pjrt::runtime::LAUNCH_AHEAD_ENV);
    for form in ["reduce-words", "reduce-nibbles"] {
        std::env::set_var("SEAM_PJRT_VECTOR_PRODUCTS", form);
        let target = pjrt_cpu(ComputePrecision::F16);
        check_target(&format!("pjrt-cpu with vector_products={form}"), target, &options);
    }
    // The graphs that call seam's CUDA kernels (ADR 0042, 0044), run by the CPU plugin with the
    // kernels' arithmetic on the host: their calls' operands, grouped results and folded norms
    // checked against the reference without a GPU.
    std::env::set_var(backend_pjrt::gpu_products::ON_CPU_ENV, "1");
    for form in ["cuda-kernels", "cuda-kernels-each"] {
        std::env::set_var("SEAM_PJRT_VECTOR_PRODUCTS", form);
        let target = pjrt_cpu(ComputePrecision::F16);
        check_target(&format!("pjrt-cpu with vector_products={form} (on the host)"), target, &options);
    }
    std::env::remove_var(backend_pjrt::gpu_products::ON_CPU_ENV);
    for key in ["SEAM_PJRT_KERNELS", "SEAM_PJRT_VECTOR_PRODUCTS", "SEAM_PJRT_DOT_PRECISION"] {
        std::env::remove_var(key);
    }

    // The kernels again, int4 products over activations rounded to int8 (`activations=int8`, ADR
    // 0024), held to that precision's preset: the whole suite, the real model included.
    std::env::set_var("SEAM_PJRT_ACTIVATIONS", "int8");
    let from_env = SuiteOptions::from_env();
    let formats: Vec<WeightFormat> = from_env.formats.iter().copied().filter(|&f| f == WeightFormat::Int4).collect();
    if !formats.is_empty() {
        let options = SuiteOptions { formats, ..from_env };
        let target = pjrt_cpu(ComputePrecision::Int8);
        check_target("pjrt-cpu with activations=int8", target, &options);
    }
    println!("conformance: pjrt passed");
}
