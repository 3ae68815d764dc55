//! # conformance: one suite every seam backend must pass
//!
//! The suite holds a backend against `backend-reference` (the oracle) and against the session
//! contract: greedy parity token for token (and logits, when the backend returns them) on tiny
//! random-weight checkpoints and on the real default model, in every weight format the backend
//! claims; the KV cache's lifecycle (decode vs whole prefill, chunked prefill, reset, interleaved
//! and concurrent sessions, truncate, fork, filling the context, memory after many sessions); bad
//! input and poisoning; sampling. The `self.*` cases hold the backend against its own results
//! along other paths, at tolerances far tighter than the reference's (see [`tolerance`]).
//!
//! Each case declares the capabilities it needs: a backend without them gets `unsupported`, not a
//! pass. Each case runs inside `catch_unwind`: a panic fails that case, not the suite. The result is
//! a [`Report`] with a printable matrix ([`Report::print_matrix`]) and JSON ([`Report::to_json`]).
//!
//! ## Running it
//! - In this workspace: `cargo test -p conformance` runs it on every registered backend.
//! - From the cli: `seam conformance --backend NAME [--json PATH]` calls [`run_suite`].
//! - From a backend crate of one's own, in a `harness = false` test:
//!
//! ```no_run
//! # struct MyBackend;
//! # impl session_api::Backend for MyBackend {
//! #     fn name(&self) -> &str { "mine" }
//! #     fn description(&self) -> &str { "" }
//! #     fn availability(&self) -> session_api::Availability { unimplemented!() }
//! #     fn capabilities(&self) -> session_api::Capabilities { unimplemented!() }
//! #     fn load(&self, _: &session_api::LoadRequest) -> session_api::Result<std::sync::Arc<dyn session_api::Engine>> { unimplemented!() }
//! # }
//! fn main() {
//!     conformance::test_main(conformance::Target::new(Box::new(MyBackend)));
//! }
//! ```
//!
//! See `docs/adding-a-backend.md` for the whole story, and [`tolerance`] for the thresholds.

// `Checked<T>` carries a whole `Verdict` (figures included) as its error: that is the case's result,
// produced once per case, so its size costs nothing worth boxing for.
#![allow(clippy::result_large_err)]

pub mod cases;
pub mod models;
pub mod oracle;
pub mod prompts;
pub mod report;
mod runner;
pub mod stream;
pub mod tolerance;
pub mod verdict;

pub use report::{BackendReport, CaseResult, Figures, Outcome, Report};
pub use runner::LIFECYCLE_MODEL;
pub use tolerance::{ComputePrecision, ToleranceKind, ToleranceProfile, Tolerances};

/// Every `max_context` the suite loads a model with (`None`: the backend's default), so that a
/// backend's graphs can be compiled ahead for a machine that cannot compile (`seam compile
/// --conformance-models`).
pub const LOAD_CONTEXTS: [Option<usize>; 2] = [None, Some(cases::kv_lifecycle::CAPACITY_CAP)];

use session_api::{Backend, LoadRequest, SeamError, WeightFormat};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

/// Why the suite could not run at all (as opposed to a backend failing a case).
#[derive(Debug, thiserror::Error)]
pub enum SuiteError {
    /// A backend name given in [`SuiteOptions::backends`] is not registered.
    #[error(transparent)]
    UnknownBackend(SeamError),
    /// The reference backend, the oracle, is missing from this binary.
    #[error("the reference backend (the oracle) is not available: {0}")]
    NoReference(String),
    /// The tiny test checkpoints could not be generated.
    #[error("the suite's test models could not be prepared: {0}")]
    Models(String),
}

/// What to run and how.
#[derive(Debug, Clone)]
pub struct SuiteOptions {
    /// Registered backends to run; empty means every registered backend but the device aliases.
    /// (Used by [`run_suite`]; [`run_targets`] runs the targets it is given.)
    pub backends: Vec<String>,
    /// Settings that configure the named backends before they run (`plugin=PATH` for `pjrt`;
    /// `session_api::Backend::configure`).
    pub backend_settings: BTreeMap<String, String>,
    /// Weight formats to test (each only where the backend claims it).
    pub formats: Vec<WeightFormat>,
    /// Compute precision of the backends selected by name, which picks the tolerance presets.
    pub precision: ComputePrecision,
    /// Thresholds of the backends selected by name that replace the presets of `precision` (see
    /// [`Target::with_tolerances`]); `None` keeps the presets.
    pub tolerances: Option<ToleranceProfile>,
    /// Greedy parity on the real default model (installed on first use): skipped, quick, or full.
    pub real_model: RealModelParity,
    /// Where generated checkpoints are cached.
    pub cache_dir: PathBuf,
    /// Run only cases whose name contains this.
    pub case_filter: Option<String>,
    /// Print each result to stderr as it completes.
    pub progress: bool,
}

impl Default for SuiteOptions {
    fn default() -> Self {
        SuiteOptions {
            backends: Vec::new(),
            backend_settings: BTreeMap::new(),
            formats: WeightFormat::ALL.to_vec(),
            precision: ComputePrecision::F32,
            tolerances: None,
            real_model: RealModelParity::Full,
            cache_dir: models::default_cache_dir(),
            case_filter: None,
            progress: false,
        }
    }
}

impl SuiteOptions {
    /// The options of a test run: defaults with quick real-model parity and progress on, adjusted
    /// by the environment: `SEAM_CONFORMANCE_CASES` (a case-name filter),
    /// `SEAM_CONFORMANCE_REAL_MODEL` (`0` skips the real model, `full` runs every prompt on it),
    /// `SEAM_CONFORMANCE_FORMATS` (`f16`, `int4` or `f16,int4`).
    pub fn from_env() -> SuiteOptions {
        let mut options =
            SuiteOptions { progress: true, real_model: RealModelParity::Quick, ..SuiteOptions::default() };
        if let Ok(filter) = std::env::var("SEAM_CONFORMANCE_CASES") {
            options.case_filter = Some(filter).filter(|f| !f.is_empty());
        }
        match std::env::var("SEAM_CONFORMANCE_REAL_MODEL").as_deref() {
            Ok("0") => options.real_model = RealModelParity::Skip,
            Ok("full") => options.real_model = RealModelParity::Full,
            _ => {}
        }
        if let Ok(formats) = std::env::var("SEAM_CONFORMANCE_FORMATS") {
            let parsed: Vec<WeightFormat> = formats.split(',').filter_map(|f| f.trim().parse().ok()).collect();
            if !parsed.is_empty() {
                options.formats = parsed;
            }
        }
        options
    }
}

/// How much greedy parity to run on the real default model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RealModelParity {
    /// None (the parity rows of the real model are then absent from the report).
    Skip,
    /// Two prompts ([`prompts::QUICK_REAL_PARITY_LENGTHS`]): the default of `cargo test`.
    Quick,
    /// Every real-model prompt ([`prompts::REAL_PARITY_LENGTHS`]): the default of the library and
    /// of `seam conformance`.
    Full,
}

/// A backend to test, with what the suite needs to know about it.
pub struct Target {
    backend: Box<dyn Backend>,
    precision: ComputePrecision,
    tolerances: ToleranceProfile,
}

impl Target {
    /// A backend, held to f32 tolerances.
    pub fn new(backend: Box<dyn Backend>) -> Target {
        Target { backend, precision: ComputePrecision::F32, tolerances: ComputePrecision::F32.profile() }
    }

    /// The backend registered under `name`. One that cannot be instantiated or configured is still
    /// returned, wrapped so that it reports itself unavailable with the reason.
    pub fn registered(name: &str) -> Result<Target, SuiteError> {
        Target::registered_with(name, &BTreeMap::new())
    }

    /// [`Target::registered`], configured by `settings` (see `session_api::Backend::configure`).
    pub fn registered_with(name: &str, settings: &BTreeMap<String, String>) -> Result<Target, SuiteError> {
        backend_reference::link();
        let entry = session_api::registered_backends().into_iter().find(|b| b.name == name);
        match entry {
            Some(entry) => {
                match entry.instantiate().and_then(|b| if settings.is_empty() { Ok(b) } else { b.configure(settings) })
                {
                    Ok(backend) => Ok(Target::new(backend)),
                    Err(e) => Ok(Target::new(Box::new(UnusableBackend { name: entry.name, reason: e.to_string() }))),
                }
            }
            None => Err(SuiteError::UnknownBackend(
                session_api::find_backend(name)
                    .err()
                    .unwrap_or(SeamError::UnknownBackend { name: name.to_string(), known: String::new() }),
            )),
        }
    }

    /// Applies the tolerance presets of `precision` (see [`tolerance`]), replacing any custom
    /// profile given before.
    pub fn with_precision(mut self, precision: ComputePrecision) -> Target {
        self.precision = precision;
        self.tolerances = precision.profile();
        self
    }

    /// Holds the backend to its own thresholds instead of a preset (for arithmetic no preset fits,
    /// such as fp8 or int8 activations): see [`ToleranceProfile::custom`]. The report names the
    /// profile and shows which of its two sets each row used.
    pub fn with_tolerances(mut self, profile: ToleranceProfile) -> Target {
        self.tolerances = profile;
        self
    }

    /// The tolerances the suite will apply.
    pub fn tolerances(&self) -> &ToleranceProfile {
        &self.tolerances
    }

    /// The backend's registry name.
    pub fn name(&self) -> &str {
        self.backend.name()
    }
}

/// Stands in for a registered backend that could not be instantiated or configured (a setting it
/// refused, such as a PJRT plugin that is not there).
struct UnusableBackend {
    name: &'static str,
    reason: String,
}

impl Backend for UnusableBackend {
    fn name(&self) -> &str {
        self.name
    }
    fn description(&self) -> &str {
        "could not be instantiated or configured"
    }
    fn availability(&self) -> session_api::Availability {
        session_api::Availability::Unavailable { reason: self.reason.clone() }
    }
    fn capabilities(&self) -> session_api::Capabilities {
        unreachable!("the suite never asks an unavailable backend for capabilities")
    }
    fn load(&self, _: &LoadRequest) -> session_api::Result<std::sync::Arc<dyn session_api::Engine>> {
        Err(SeamError::Unavailable { backend: self.name.to_string(), reason: self.reason.clone() })
    }
}

/// Runs the suite on the registered backends named in `options.backends` (all registered
/// backends when empty), at `options.precision`. Unavailable backends are in the report, with
/// their reason.
pub fn run_suite(options: &SuiteOptions) -> Result<Report, SuiteError> {
    backend_reference::link();
    let names: Vec<String> = if options.backends.is_empty() {
        session_api::registered_backends()
            .iter()
            .filter(|b| b.alias_of().is_none())
            .map(|b| b.name.to_string())
            .collect()
    } else {
        options.backends.clone()
    };
    let targets = names
        .iter()
        .map(|name| {
            Target::registered_with(name, &options.backend_settings).map(|t| {
                let target = t.with_precision(options.precision);
                match &options.tolerances {
                    Some(profile) => target.with_tolerances(profile.clone()),
                    None => target,
                }
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    run_targets(&targets, options)
}

/// Runs the suite on `targets`, in order, sharing the oracle's runs between them.
pub fn run_targets(targets: &[Target], options: &SuiteOptions) -> Result<Report, SuiteError> {
    let oracle = oracle::Oracle::new().map_err(SuiteError::NoReference)?;
    let tiny = models::tiny_models(&options.cache_dir).map_err(SuiteError::Models)?;
    let suite = runner::Suite::new(options, oracle, tiny);
    let mut report = Report::default();
    for target in targets {
        let started = Instant::now();
        if options.progress {
            eprintln!("conformance: {} ...", target.name());
        }
        report.backends.push(suite.run_target(target));
        if options.progress {
            eprintln!("conformance: {} done in {:.1} s", target.name(), started.elapsed().as_secs_f64());
        }
    }
    Ok(report)
}

/// The `main` of a `harness = false` test: runs the whole suite on `target` with
/// [`SuiteOptions::from_env`], prints the matrix, and exits with status 1 on any failure (or
/// when the suite cannot run, or the backend is unavailable: a test of a backend that did not run
/// must not pass).
pub fn test_main(target: Target) {
    let name = target.name().to_string();
    check_target(&name, target, &SuiteOptions::from_env());
    println!("conformance: {name} passed");
}

/// Runs the suite on `target` with `options`, prints its matrix under `what`, and exits the
/// process non-zero on any failure or when the target is unavailable: one pass of a
/// `harness = false` conformance test (see [`test_main`]).
pub fn check_target(what: &str, target: Target, options: &SuiteOptions) {
    match run_targets(&[target], options) {
        Ok(report) => {
            println!("{what}:");
            report.print_matrix();
            let unavailable = report.backends.iter().any(|b| !b.availability.is_available());
            if report.has_failures() || unavailable {
                eprintln!("conformance: {what} {}", if unavailable { "is unavailable" } else { "FAILED" });
                std::process::exit(1);
            }
        }
        Err(e) => {
            eprintln!("conformance: {what}: {e}");
            std::process::exit(1);
        }
    }
}

/// Every case: its name and what it checks (for `--list` and the docs).
pub fn list_cases() -> Vec<(&'static str, &'static str)> {
    let mut all: Vec<_> = cases::lifecycle_cases().iter().map(|c| (c.name, c.about)).collect();
    all.push((cases::parity::CASE.name, cases::parity::CASE.about));
    all
}
