//! `cargo test -p conformance`: the whole suite on every registered backend that is available
//! here (the reference and the example backend in this workspace), the matrix printed, the
//! unavailable ones listed with their reason. Fails on any failure.
//!
//! `harness = false`: this `main` is the test. Environment: `SEAM_CONFORMANCE_CASES=<substring>`,
//! `SEAM_CONFORMANCE_REAL_MODEL=0`, `SEAM_CONFORMANCE_FORMATS=f16` narrow the run.

use conformance::{SuiteOptions, Target};

fn main() {
    // Reference both backend crates so that the linker keeps their registrations.
    backend_reference::link();
    backend_example::link();
    let options = SuiteOptions::from_env();
    let names: Vec<&str> = session_api::registered_backends().iter().map(|b| b.name).collect();
    println!("registered backends: {}", names.join(", "));
    assert!(names.contains(&"reference") && names.contains(&"example"), "both in-tree backends must be registered");

    let targets: Vec<Target> =
        names.iter().map(|&name| Target::registered(name).expect("a registered name resolves")).collect();
    let report = match conformance::run_targets(&targets, &options) {
        Ok(report) => report,
        Err(e) => {
            eprintln!("conformance could not run: {e}");
            std::process::exit(1);
        }
    };
    report.print_matrix();
    if let Some(dir) = std::env::var_os("SEAM_CONFORMANCE_JSON") {
        std::fs::write(&dir, report.to_json()).expect("writing the JSON report");
    }
    for backend in &report.backends {
        if matches!(backend.backend.as_str(), "reference" | "example") && !backend.availability.is_available() {
            eprintln!("{} must be available on every machine", backend.backend);
            std::process::exit(1);
        }
    }
    if report.has_failures() {
        eprintln!("conformance: FAILED");
        std::process::exit(1);
    }
    println!("conformance: every available backend passed");
}
