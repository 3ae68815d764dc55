//! Runs the cases on one backend: availability, engines per model and format, each case inside
//! `catch_unwind` so that a panicking backend fails that case and the suite goes on.

use crate::cases::{self, Case, CaseContext};
use crate::models::{self, MissingModel, ModelKind, TestModel};
use crate::oracle::Oracle;
use crate::prompts::{QUICK_REAL_PARITY_LENGTHS, REAL_PARITY_LENGTHS, TINY_PARITY_LENGTHS};
use crate::report::{BackendReport, CaseResult, Outcome};
use crate::verdict::{call_failed, Verdict};
use crate::{RealModelParity, SuiteOptions, Target};
use session_api::{Availability, Capabilities, Engine, LoadRequest, WeightFormat};
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// The tiny model the lifecycle, bad-input and sampling cases run on (the others get parity only).
pub const LIFECYCLE_MODEL: &str = "tiny-llama32";

/// Prompt lengths for the reference's own parity smoke on the real model: the reference compared
/// with itself proves nothing beyond the harness, so it is not worth a minute of real decoding.
const SELF_REAL_PARITY_LENGTHS: &[usize] = &[17];

/// Which cases a pass over the models runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The memory case alone, before everything else.
    MemoryFirst,
    /// Every other case; `self_comparison` for the reference held against itself.
    Rest { self_comparison: bool },
}

/// Shared state of one suite run: options, oracle, models.
pub(crate) struct Suite<'a> {
    pub options: &'a SuiteOptions,
    pub oracle: Oracle,
    pub tiny: Vec<TestModel>,
    real: OnceLock<Result<TestModel, MissingModel>>,
}

impl<'a> Suite<'a> {
    pub fn new(options: &'a SuiteOptions, oracle: Oracle, tiny: Vec<TestModel>) -> Suite<'a> {
        Suite { options, oracle, tiny, real: OnceLock::new() }
    }

    fn real_model(&self) -> &Result<TestModel, MissingModel> {
        self.real.get_or_init(models::default_model)
    }

    fn wants(&self, case: &str) -> bool {
        self.options.case_filter.as_deref().is_none_or(|f| case.contains(f))
    }

    /// Runs every case on `target`.
    pub fn run_target(&self, target: &Target) -> BackendReport {
        let started = Instant::now();
        let backend = &*target.backend;
        let name = backend.name().to_string();
        let tolerances = target.tolerances.clone();
        let mut report = BackendReport {
            backend: name.clone(),
            availability: Availability::Unavailable { reason: "not checked".into() },
            precision: target.precision,
            tolerances,
            capabilities: None,
            results: Vec::new(),
            duration_ms: 0.0,
        };
        let mut sink = ResultSink { report: &mut report, progress: self.options.progress };

        match guarded(|| backend.availability()) {
            Ok(availability) => sink.report.availability = availability,
            Err(panic) => {
                sink.report.availability =
                    Availability::Unavailable { reason: format!("availability() panicked: {panic}") };
                sink.push(CaseResult::new(
                    "backend.availability",
                    None,
                    None,
                    Verdict::fail(format!("availability() panicked: {panic}")),
                ));
            }
        }
        if let Availability::Unavailable { reason } = &sink.report.availability {
            let reason = reason.clone();
            if sink.report.results.is_empty() {
                sink.push(CaseResult::new("backend", None, None, Verdict::unavailable(reason)));
            }
            report.duration_ms = ms_since(started);
            return report;
        }
        let capabilities = match guarded(|| backend.capabilities()) {
            Ok(c) => c,
            Err(panic) => {
                sink.push(CaseResult::new(
                    "backend.capabilities",
                    None,
                    None,
                    Verdict::fail(format!("capabilities() panicked: {panic}")),
                ));
                report.duration_ms = ms_since(started);
                return report;
            }
        };
        sink.report.capabilities = Some(capabilities.clone());

        let self_comparison = name == "reference";
        let rest = Phase::Rest { self_comparison };
        // The memory case first, for every format, in a heap the other cases have not fragmented
        // yet: a runtime that allocates from its worker threads' arenas (XLA's CPU client) moved
        // the resident set by 5-22 MiB across 200 sessions after the rest of the suite, not in
        // proportion to the sessions, and by 0.3-0.5 MiB when first (docs/backends/pjrt.md).
        for &format in &self.options.formats {
            for model in self.tiny.iter().filter(|m| m.name == LIFECYCLE_MODEL) {
                self.run_model(target, &capabilities, model, format, &[], Phase::MemoryFirst, &mut sink);
            }
        }
        for &format in &self.options.formats {
            for model in &self.tiny {
                self.run_model(target, &capabilities, model, format, TINY_PARITY_LENGTHS, rest, &mut sink);
            }
            let real_cases = self.wants(cases::parity::CASE.name)
                || (!self_comparison && self.wants(cases::batched::SEVENTEEN_CASE.name));
            if self.options.real_model == RealModelParity::Skip || !real_cases {
                continue;
            }
            match self.real_model() {
                Ok(model) => {
                    let lengths = match self.options.real_model {
                        _ if self_comparison => SELF_REAL_PARITY_LENGTHS,
                        RealModelParity::Full => REAL_PARITY_LENGTHS,
                        _ => QUICK_REAL_PARITY_LENGTHS,
                    };
                    self.run_model(target, &capabilities, model, format, lengths, rest, &mut sink);
                }
                Err(missing) => sink.push(CaseResult::new(
                    cases::parity::CASE.name,
                    Some(&missing.name),
                    Some(format),
                    Verdict::unavailable(missing.reason.clone()),
                )),
            }
        }
        report.duration_ms = ms_since(started);
        report
    }

    /// The cases of `phase` for `model`: parity everywhere, the rest on the lifecycle model, the
    /// memory case in its own phase. On the real model also the batch of seventeen, whose narrow
    /// margins between tokens show a batch that rounds differently from a lone decode where the
    /// tiny models' wide ones did not: for engines that claim batched decode (any other steps
    /// its sessions in turn, as alone), in int4, the format served, to keep the suite's time.
    fn cases_for(&self, model: &TestModel, format: WeightFormat, claimed: &Capabilities, phase: Phase) -> Vec<Case> {
        let mut list = if model.kind == ModelKind::Tiny && model.name == LIFECYCLE_MODEL {
            cases::lifecycle_cases()
        } else {
            vec![]
        };
        if model.kind == ModelKind::Real
            && phase == (Phase::Rest { self_comparison: false })
            && claimed.batched_decode
            && format == WeightFormat::Int4
        {
            list.push(cases::batched::SEVENTEEN_CASE);
        }
        list.push(cases::parity::CASE);
        let memory = cases::memory::CASE.name;
        list.retain(|c| self.wants(c.name) && (c.name == memory) == (phase == Phase::MemoryFirst));
        list
    }

    #[allow(clippy::too_many_arguments)]
    fn run_model(
        &self,
        target: &Target,
        claimed: &Capabilities,
        model: &TestModel,
        format: WeightFormat,
        parity_lengths: &[usize],
        phase: Phase,
        sink: &mut ResultSink<'_>,
    ) {
        let cases = self.cases_for(model, format, claimed, phase);
        let self_comparison = matches!(phase, Phase::Rest { self_comparison: true });
        if cases.is_empty() {
            return;
        }
        let all = |sink: &mut ResultSink<'_>, verdict: Verdict| {
            for case in &cases {
                sink.push(CaseResult::new(case.name, Some(&model.name), Some(format), verdict.clone()));
            }
        };
        if !claimed.supports_format(format) {
            all(sink, Verdict::unsupported(format!("needs weight format {format}")));
            return;
        }
        let request = LoadRequest::new(&model.dir, format);
        let started = Instant::now();
        let engine: Arc<dyn Engine> = match guarded(|| target.backend.load(&request)) {
            Ok(Ok(engine)) => engine,
            Ok(Err(e)) => return all(sink, call_failed(&format!("loading {} as {format}", model.name), &e)),
            Err(panic) => return all(sink, Verdict::fail(format!("load panicked: {panic}"))),
        };
        if sink.progress {
            eprintln!(
                "  {} loaded {} ({format}) in {:.1} s",
                target.backend.name(),
                model.name,
                started.elapsed().as_secs_f64()
            );
        }
        let capabilities = match guarded(|| engine.capabilities()) {
            Ok(c) => c,
            Err(panic) => return all(sink, Verdict::fail(format!("engine capabilities() panicked: {panic}"))),
        };
        let ctx = CaseContext {
            backend: &*target.backend,
            engine: &engine,
            capabilities: &capabilities,
            request: &request,
            model,
            format,
            oracle: &self.oracle,
            tolerances: target.tolerances.reference,
            self_tolerances: target.tolerances.self_consistency,
            parity_lengths,
        };
        for case in &cases {
            let started = Instant::now();
            let verdict = match (case.missing)(&capabilities) {
                Some(capability) => Verdict::unsupported(format!("needs {capability}")),
                None => match guarded(|| (case.run)(&ctx)) {
                    Ok(Ok(verdict)) | Ok(Err(verdict)) => verdict,
                    Err(panic) => Verdict::fail(format!("the backend panicked: {panic}")),
                },
            };
            let mut result = CaseResult::new(case.name, Some(&model.name), Some(format), verdict);
            // Which set applied is worth showing only where the case ran.
            if matches!(result.outcome, Outcome::Pass | Outcome::Fail) {
                result.tolerance = cases::tolerance_kind(case.name);
            }
            result.self_comparison =
                self_comparison && case.name == cases::parity::CASE.name && result.outcome == Outcome::Pass;
            result.duration_ms = ms_since(started);
            sink.push(result);
        }
    }
}

/// Appends results, echoing each to stderr when progress is on.
struct ResultSink<'r> {
    report: &'r mut BackendReport,
    progress: bool,
}

impl ResultSink<'_> {
    fn push(&mut self, result: CaseResult) {
        if self.progress {
            let format = result.weights.map(|w| format!("/{w}")).unwrap_or_default();
            let model = result.model.as_ref().map(|m| format!(" [{m}]")).unwrap_or_default();
            eprintln!(
                "  {:11} {}{format} {}{model} ({:.0} ms){}",
                result.outcome.as_str(),
                self.report.backend,
                result.case,
                result.duration_ms,
                if result.outcome == Outcome::Pass { String::new() } else { format!(": {}", result.detail) }
            );
        }
        self.report.results.push(result);
    }
}

impl CaseResult {
    fn new(case: &str, model: Option<&str>, weights: Option<WeightFormat>, verdict: Verdict) -> CaseResult {
        CaseResult {
            case: case.to_string(),
            model: model.map(str::to_string),
            weights,
            outcome: verdict.outcome,
            detail: verdict.detail,
            figures: verdict.figures,
            self_comparison: false,
            tolerance: None,
            duration_ms: 0.0,
        }
    }
}

/// Runs `f`, turning a panic into its message.
fn guarded<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| panic_message(&*payload))
}

/// The message of a panic payload.
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-string payload".to_string()
    }
}

fn ms_since(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1000.0
}
