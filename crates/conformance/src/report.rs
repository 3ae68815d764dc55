//! What a suite run found: one [`CaseResult`] per backend × weight format × case (× model), the
//! matrix printed from them, and the same data as JSON.

use crate::tolerance::{ComputePrecision, ToleranceKind, ToleranceProfile};
use serde::Serialize;
use session_api::{Availability, Capabilities, WeightFormat};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The verdict of one case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The backend did what the contract says, within tolerance.
    Pass,
    /// It did not: a wrong token, a wrong error, a panic, or a claimed capability it refused.
    Fail,
    /// The case needs a capability the backend does not claim, so it was not run.
    Unsupported,
    /// The case could not run here: the backend is unavailable, or a model or OS facility is missing.
    Unavailable,
}

impl Outcome {
    /// Short name for the matrix.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Pass => "pass",
            Outcome::Fail => "FAIL",
            Outcome::Unsupported => "unsupported",
            Outcome::Unavailable => "unavailable",
        }
    }
}

/// The measured figures behind a verdict. Every field is optional: each case fills what it measured.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct Figures {
    /// Tokens compared against the expected stream.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps_compared: Option<usize>,
    /// First step (0 = the token returned by prefill) where the backend's token differed, tolerated
    /// or not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_divergent_step: Option<usize>,
    /// Length of the prompt in which that divergence happened.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub divergent_prompt_len: Option<usize>,
    /// The reference's top-2 logit margin at that step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub margin_at_divergence: Option<f32>,
    /// Divergences tolerated because the reference's margin was below epsilon.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tolerated_divergences: Option<usize>,
    /// Worst `Σ(a-b)²/Σb²` of last-position logits over all compared steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logit_nmse: Option<f64>,
    /// Worst `max|a-b|` of last-position logits over all compared steps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logit_max_abs: Option<f64>,
    /// Resident memory growth across the measured sessions, in bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rss_growth_bytes: Option<i64>,
    /// The growth the case accepts, in bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rss_tolerance_bytes: Option<i64>,
}

impl Figures {
    /// One line for the details list; empty when nothing was measured.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(n) = self.steps_compared {
            parts.push(format!("{n} steps compared"));
        }
        match (self.first_divergent_step, self.divergent_prompt_len) {
            (Some(step), Some(len)) => parts.push(format!("first divergence at step {step} (prompt of {len})")),
            (Some(step), None) => parts.push(format!("first divergence at step {step}")),
            _ => {}
        }
        if let Some(m) = self.margin_at_divergence {
            parts.push(format!("expected stream's margin there {m:.2e}"));
        }
        if let Some(n) = self.tolerated_divergences {
            parts.push(format!("{n} tolerated near-tie divergences"));
        }
        if let Some(e) = self.logit_nmse {
            parts.push(format!("logit nmse {e:.2e}"));
        }
        if let Some(e) = self.logit_max_abs {
            parts.push(format!("max|Δlogit| {e:.2e}"));
        }
        if let Some(g) = self.rss_growth_bytes {
            let tolerance = self.rss_tolerance_bytes.map(|t| format!(" (tolerance {})", mib(t))).unwrap_or_default();
            parts.push(format!("RSS growth {}{tolerance}", mib(g)));
        }
        parts.join(", ")
    }
}

fn mib(bytes: i64) -> String {
    format!("{:.2} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// One case on one backend, weight format and model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CaseResult {
    /// Case name, e.g. `parity.greedy` or `kv.chunked_prefill`.
    pub case: String,
    /// The model it ran on (`tiny-llama32`, `smollm2-135m`, ...); `None` before any model was chosen.
    pub model: Option<String>,
    /// The weight format; `None` for cases that do not depend on one.
    pub weights: Option<WeightFormat>,
    /// The verdict.
    pub outcome: Outcome,
    /// Why, in a sentence: what differed, or which capability is missing.
    pub detail: String,
    /// What was measured.
    pub figures: Figures,
    /// True when the backend was compared with itself (the reference backend's parity cases): such a
    /// pass proves the harness and determinism across loads, not correctness.
    pub self_comparison: bool,
    /// Which set of the backend's [`BackendReport::tolerances`] the case held it to; `None` for a
    /// case that compares no numbers, or that did not run.
    pub tolerance: Option<ToleranceKind>,
    /// Wall time of the case.
    pub duration_ms: f64,
}

/// Everything the suite found about one backend.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BackendReport {
    /// Registry name.
    pub backend: String,
    /// Whether it could run here (and why not).
    pub availability: Availability,
    /// The compute precision declared for the backend (which picks the presets).
    pub precision: ComputePrecision,
    /// The thresholds applied: the presets of `precision`, or the backend's custom profile.
    pub tolerances: ToleranceProfile,
    /// The capabilities it claimed, when available.
    pub capabilities: Option<Capabilities>,
    /// One result per case run.
    pub results: Vec<CaseResult>,
    /// Wall time of this backend's run.
    pub duration_ms: f64,
}

impl BackendReport {
    /// Number of results with `outcome`.
    pub fn count(&self, outcome: Outcome) -> usize {
        self.results.iter().filter(|r| r.outcome == outcome).count()
    }

    /// The failed results.
    pub fn failures(&self) -> impl Iterator<Item = &CaseResult> {
        self.results.iter().filter(|r| r.outcome == Outcome::Fail)
    }
}

/// The whole run: one [`BackendReport`] per backend.
#[derive(Debug, Clone, PartialEq, Serialize, Default)]
pub struct Report {
    /// The backends, in the order they ran.
    pub backends: Vec<BackendReport>,
}

impl Report {
    /// Whether any case failed on any backend.
    pub fn has_failures(&self) -> bool {
        self.backends.iter().any(|b| b.count(Outcome::Fail) > 0)
    }

    /// The report as pretty-printed JSON (the schema is this module's types, serialized by serde).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("the report holds only serializable plain data")
    }

    /// Prints [`Report::render`] to stdout.
    pub fn print_matrix(&self) {
        println!("{}", self.render());
    }

    /// The matrix (case × backend/format), the unavailable backends with their reasons, each
    /// measured figure and each non-pass result explained, and a summary line per backend.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let columns = self.columns();
        let rows = self.rows();
        let row_label = |(case, model): &(String, Option<String>)| match model {
            Some(m) => format!("{case} [{m}]"),
            None => case.clone(),
        };
        let label_width = rows.iter().map(|r| row_label(r).len()).max().unwrap_or(4).max(4);
        let kinds = self.row_tolerance_kinds(&rows);
        let cells: BTreeMap<(usize, usize), String> = self.cells(&columns, &rows);
        let column_width: Vec<usize> = columns
            .iter()
            .enumerate()
            .map(|(c, name)| {
                let widest_cell =
                    (0..rows.len()).filter_map(|r| cells.get(&(r, c))).map(|s| s.len()).max().unwrap_or(0);
                name.len().max(widest_cell)
            })
            .collect();

        let _ = write!(out, "{:label_width$}  tol ", "case [model]");
        for (c, name) in columns.iter().enumerate() {
            let _ = write!(out, "  {:w$}", name, w = column_width[c]);
        }
        out.push('\n');
        let _ = writeln!(out, "{}", "-".repeat(label_width + 6 + column_width.iter().map(|w| w + 2).sum::<usize>()));
        for (r, row) in rows.iter().enumerate() {
            let _ = write!(out, "{:label_width$}  {:4}", row_label(row), kinds[r]);
            for (c, width) in column_width.iter().enumerate() {
                let cell = cells.get(&(r, c)).map(String::as_str).unwrap_or("-");
                let _ = write!(out, "  {cell:width$}");
            }
            out.push('\n');
        }

        let unavailable: Vec<&BackendReport> =
            self.backends.iter().filter(|b| !b.availability.is_available()).collect();
        if !unavailable.is_empty() {
            out.push_str("\nunavailable backends:\n");
            for b in unavailable {
                if let Availability::Unavailable { reason } = &b.availability {
                    let _ = writeln!(out, "  {}: {reason}", b.backend);
                }
            }
        }

        // What `ref` and `self` in the tol column mean for each backend that ran.
        out.push_str(
            "\ntolerances (tol column: ref = against the reference, self = against the backend's own results):\n",
        );
        for b in self.backends.iter().filter(|b| b.availability.is_available()) {
            let t = &b.tolerances;
            let _ = writeln!(out, "  {}: {}", b.backend, t.label());
            let _ = writeln!(out, "    ref:  {}", t.reference);
            let _ = writeln!(out, "    self: {}", t.self_consistency);
        }

        out.push_str("\ndetails (parity, self-consistency and memory figures; why each result that is not a pass):\n");
        for b in &self.backends {
            for r in &b.results {
                let figures = r.figures.describe();
                // Passes of the other cases carry figures too (in the JSON), but they are all zero
                // for a correct backend and would bury the lines that matter.
                // Self-consistency passes are headlines too: how close a backend's own paths came
                // to its tolerance is what tells how much headroom a tight set leaves.
                let headline = r.case == "parity.greedy"
                    || r.tolerance == Some(ToleranceKind::SelfConsistency)
                    || r.figures.rss_growth_bytes.is_some();
                if r.outcome == Outcome::Pass && !(headline || r.figures.tolerated_divergences.unwrap_or(0) > 0) {
                    continue;
                }
                let format = r.weights.map(|w| format!("/{w}")).unwrap_or_default();
                let model = r.model.as_ref().map(|m| format!(" [{m}]")).unwrap_or_default();
                let self_note = if r.self_comparison { " (self-comparison)" } else { "" };
                let tolerance = match r.tolerance {
                    Some(kind) => format!(" ({} tolerance, {})", kind.as_str(), b.tolerances.label()),
                    None => String::new(),
                };
                let _ = write!(
                    out,
                    "  {:11} {}{format} {}{model}{self_note}{tolerance}",
                    r.outcome.as_str(),
                    b.backend,
                    r.case
                );
                if !r.detail.is_empty() {
                    let _ = write!(out, ": {}", r.detail);
                }
                if !figures.is_empty() {
                    let _ = write!(out, " — {figures}");
                }
                out.push('\n');
            }
        }

        out.push_str("\nsummary:\n");
        for b in &self.backends {
            let _ = writeln!(
                out,
                "  {:12} {:4} pass, {:3} fail, {:3} unsupported, {:3} unavailable  ({} tolerances; {:.1} s)",
                b.backend,
                b.count(Outcome::Pass),
                b.count(Outcome::Fail),
                b.count(Outcome::Unsupported),
                b.count(Outcome::Unavailable),
                b.tolerances.label(),
                b.duration_ms / 1000.0
            );
        }
        if self.backends.iter().any(|b| b.results.iter().any(|r| r.self_comparison)) {
            out.push_str(
                "  pass(self): the reference backend compared with a second load of itself; this checks the\n  \
                 harness and determinism, not correctness (the reference is the oracle).\n",
            );
        }
        out
    }

    /// Column names: `backend/format` for each format a backend ran, `backend` for results without
    /// a format (and for unavailable backends).
    fn columns(&self) -> Vec<String> {
        let mut columns = Vec::new();
        for b in &self.backends {
            let mut formats: Vec<Option<WeightFormat>> = Vec::new();
            for r in &b.results {
                if !formats.contains(&r.weights) {
                    formats.push(r.weights);
                }
            }
            if formats.is_empty() {
                formats.push(None);
            }
            for f in formats {
                columns.push(column_name(&b.backend, f));
            }
        }
        columns
    }

    fn rows(&self) -> Vec<(String, Option<String>)> {
        let mut rows: Vec<(String, Option<String>)> = Vec::new();
        for b in &self.backends {
            for r in &b.results {
                let key = (r.case.clone(), r.model.clone());
                if !rows.contains(&key) {
                    rows.push(key);
                }
            }
        }
        rows
    }

    /// The `tol` column: the tolerance kind each row's results used (`ref`, `self`, `-` for none;
    /// the same for every backend, as it depends on the case only).
    fn row_tolerance_kinds(&self, rows: &[(String, Option<String>)]) -> Vec<&'static str> {
        rows.iter()
            .map(|(case, model)| {
                self.backends
                    .iter()
                    .flat_map(|b| &b.results)
                    .filter(|r| r.case == *case && r.model == *model)
                    .find_map(|r| r.tolerance)
                    .map_or("-", ToleranceKind::as_str)
            })
            .collect()
    }

    fn cells(&self, columns: &[String], rows: &[(String, Option<String>)]) -> BTreeMap<(usize, usize), String> {
        let mut cells = BTreeMap::new();
        for b in &self.backends {
            for r in &b.results {
                let Some(c) = columns.iter().position(|n| *n == column_name(&b.backend, r.weights)) else { continue };
                let Some(row) = rows.iter().position(|(case, model)| *case == r.case && *model == r.model) else {
                    continue;
                };
                cells.insert((row, c), cell_text(r));
            }
        }
        cells
    }
}

fn column_name(backend: &str, format: Option<WeightFormat>) -> String {
    match format {
        Some(f) => format!("{backend}/{f}"),
        None => backend.to_string(),
    }
}

fn cell_text(r: &CaseResult) -> String {
    match r.outcome {
        Outcome::Pass if r.self_comparison => "pass(self)".into(),
        Outcome::Fail => match r.figures.first_divergent_step {
            Some(step) => format!("FAIL@step{step}"),
            None => "FAIL".into(),
        },
        outcome => outcome.as_str().into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(case: &str, weights: Option<WeightFormat>, outcome: Outcome) -> CaseResult {
        CaseResult {
            case: case.into(),
            model: Some("tiny".into()),
            weights,
            outcome,
            detail: String::new(),
            figures: Figures::default(),
            self_comparison: false,
            tolerance: Some(ToleranceKind::Reference),
            duration_ms: 1.0,
        }
    }

    fn backend(name: &str, results: Vec<CaseResult>) -> BackendReport {
        BackendReport {
            backend: name.into(),
            availability: Availability::Available { devices: vec![] },
            precision: ComputePrecision::F32,
            tolerances: ComputePrecision::F32.profile(),
            capabilities: None,
            results,
            duration_ms: 10.0,
        }
    }

    #[test]
    fn matrix_has_a_cell_per_backend_format_and_case() {
        let mut failing = result("kv.reset", Some(WeightFormat::Int4), Outcome::Fail);
        failing.figures.first_divergent_step = Some(7);
        failing.detail = "token differs".into();
        let report = Report {
            backends: vec![
                backend("a", vec![result("kv.reset", Some(WeightFormat::F16), Outcome::Pass), failing]),
                BackendReport {
                    availability: Availability::Unavailable { reason: "no device".into() },
                    ..backend("b", vec![result("backend", None, Outcome::Unavailable)])
                },
            ],
        };
        let text = report.render();
        assert!(text.contains("a/f16"), "{text}");
        assert!(text.contains("a/int4"), "{text}");
        assert!(text.contains("FAIL@step7"), "{text}");
        assert!(text.contains("b: no device"), "{text}");
        assert!(report.has_failures());
        let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
        assert_eq!(json["backends"][0]["results"][1]["outcome"], "fail");
        assert_eq!(json["backends"][0]["results"][1]["figures"]["first_divergent_step"], 7);
        assert_eq!(json["backends"][0]["results"][1]["tolerance"], "reference");
        assert_eq!(json["backends"][0]["tolerances"]["name"], "f32");
    }

    #[test]
    fn each_row_names_its_tolerance_and_custom_profiles_are_shown() {
        use crate::tolerance::Tolerances;
        let mut own = result("self.decode_equals_prefill", Some(WeightFormat::F16), Outcome::Fail);
        own.tolerance = Some(ToleranceKind::SelfConsistency);
        own.detail = "logits out of tolerance".into();
        let mut claims = result("contract.capabilities", Some(WeightFormat::F16), Outcome::Pass);
        claims.tolerance = None;
        let profile = crate::tolerance::ToleranceProfile::custom(
            "fp8 activations",
            Tolerances { margin_epsilon: 2.0, max_nmse: 5e-2, max_abs: 6.0 },
            Tolerances { margin_epsilon: 0.5, max_nmse: 2e-3, max_abs: 1.0 },
        );
        let report = Report {
            backends: vec![BackendReport {
                tolerances: profile,
                ..backend("npu", vec![result("parity.greedy", Some(WeightFormat::F16), Outcome::Pass), own, claims])
            }],
        };
        let text = report.render();
        let row =
            |case: &str| text.lines().find(|l| l.starts_with(case)).unwrap_or_else(|| panic!("{text}")).to_string();
        assert!(row("self.decode_equals_prefill").contains(" self "), "{text}");
        assert!(row("parity.greedy").contains(" ref "), "{text}");
        assert!(row("contract.capabilities").contains(" - "), "{text}");
        assert!(text.contains("npu: custom \"fp8 activations\""), "{text}");
        assert!(text.contains("self: margin ε 0.5, nmse ≤ 2e-3, max|Δ| ≤ 1"), "{text}");
        assert!(text.contains("(self tolerance, custom \"fp8 activations\")"), "{text}");
        let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
        assert_eq!(json["backends"][0]["tolerances"]["custom"], true);
        assert_eq!(json["backends"][0]["tolerances"]["self_consistency"]["max_nmse"], 2e-3);
        assert_eq!(json["backends"][0]["results"][1]["tolerance"], "self_consistency");
        assert!(json["backends"][0]["results"][2]["tolerance"].is_null());
    }
}
