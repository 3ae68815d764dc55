//! The cases: each a name, the capabilities it needs, and a function of a [`CaseContext`].
//!
//! A case whose capability the backend does not claim is reported `unsupported` without running.
//! A case only calls what the backend claims, so a refusal with `Unsupported` inside a case is a
//! failure (see [`crate::verdict::call_failed`]).

pub mod bad_input;
pub mod batched;
pub mod capability_claims;
pub mod embeddings;
pub mod kv_lifecycle;
pub mod layers;
pub mod memory;
pub mod parity;
pub mod sampling;
pub mod scoring;
pub mod self_consistency;

use crate::models::TestModel;
use crate::oracle::{Continuation, Oracle, OracleRun};
use crate::stream::{compare, Comparison, Driver, Expected, Trace};
use crate::tolerance::{ToleranceKind, Tolerances};
use crate::verdict::{Checked, OrFail, Verdict};
use session_api::{Backend, Capabilities, Engine, LoadRequest, SamplingConfig, Session, SessionOptions, WeightFormat};
use std::sync::Arc;

/// Everything a case may use.
pub struct CaseContext<'a> {
    /// The backend under test.
    pub backend: &'a dyn Backend,
    /// Its engine for [`CaseContext::model`] in [`CaseContext::format`].
    pub engine: &'a Arc<dyn Engine>,
    /// The engine's capabilities.
    pub capabilities: &'a Capabilities,
    /// The request the engine was loaded with (cases that need another engine adapt it).
    pub request: &'a LoadRequest,
    /// The model.
    pub model: &'a TestModel,
    /// The weight format.
    pub format: WeightFormat,
    /// The reference.
    pub oracle: &'a Oracle,
    /// The thresholds against the reference (the target's profile's `reference` set).
    pub tolerances: Tolerances,
    /// The thresholds against the backend's own results (its profile's `self_consistency` set),
    /// for the `self.*` cases.
    pub self_tolerances: Tolerances,
    /// Prompt lengths for the parity case.
    pub parity_lengths: &'a [usize],
}

/// One case.
pub struct Case {
    /// Stable name, `group.case`.
    pub name: &'static str,
    /// What it checks, one line (for the docs and `--list`).
    pub about: &'static str,
    /// `Some(capability)` when `capabilities` lack what the case needs.
    pub missing: fn(&Capabilities) -> Option<&'static str>,
    /// Runs the case. `Ok` and `Err` both carry the verdict; `Err` is the early exit of `?`.
    pub run: fn(&CaseContext<'_>) -> Checked<Verdict>,
}

/// Needs nothing beyond the mandatory token input and greedy sampling.
pub fn needs_nothing(_: &Capabilities) -> Option<&'static str> {
    None
}

/// The cases run once per weight format on the lifecycle model, in order.
pub fn lifecycle_cases() -> Vec<Case> {
    let mut cases = vec![capability_claims::CASE];
    cases.extend(kv_lifecycle::CASES);
    cases.push(memory::CASE);
    cases.extend(bad_input::CASES);
    cases.extend(embeddings::CASES);
    cases.push(scoring::CASE);
    cases.extend(sampling::CASES);
    cases.push(layers::CASE);
    cases.extend(batched::CASES);
    cases.extend(self_consistency::CASES);
    cases
}

/// The cases that compare no numbers: claims, resident memory, a seeded sampler with itself, and
/// batched decoding, whose tokens must equal the same backend's alone exactly.
const UNTOLERANCED: [&str; 5] = [
    "contract.capabilities",
    "kv.many_sessions_memory",
    "sampling.seeded_reproducible",
    "batch.joins_and_leaves",
    "batch.seventeen",
];

/// Which of the target's tolerance sets the case `name` holds the backend to, for the report:
/// the `self.*` cases their own set; the cases that compare nothing numeric none; every other
/// case compares tokens or values with the reference's.
pub fn tolerance_kind(name: &str) -> Option<ToleranceKind> {
    if name.starts_with(self_consistency::GROUP) {
        Some(ToleranceKind::SelfConsistency)
    } else if UNTOLERANCED.contains(&name) {
        None
    } else {
        Some(ToleranceKind::Reference)
    }
}

impl CaseContext<'_> {
    /// Vocabulary size of the loaded model.
    pub fn vocab_size(&self) -> usize {
        self.engine.info().vocab_size
    }

    /// A fixed prompt of `len` tokens for this model.
    pub fn prompt(&self, len: usize, salt: u64) -> Vec<u32> {
        crate::prompts::prompt(len, self.vocab_size(), salt)
    }

    /// Session options for greedy decoding, asking for logits when the backend returns them (so
    /// that comparisons also check logits).
    pub fn greedy_options(&self) -> SessionOptions {
        SessionOptions {
            sampling: SamplingConfig::Greedy,
            return_logits: self.capabilities.logits,
            ..SessionOptions::default()
        }
    }

    /// A new session, or a failing verdict.
    pub fn session(&self, options: SessionOptions) -> Checked<Box<dyn Session>> {
        let what = format!("new_session({options:?})");
        self.engine.new_session(options).or_fail(|| what)
    }

    /// A new greedy session.
    pub fn greedy_session(&self) -> Checked<Box<dyn Session>> {
        self.session(self.greedy_options())
    }

    /// The reference's greedy run of `prompt`, `steps` tokens long, with logits and margins: the
    /// expected stream of every lifecycle case. Holding each path to a sequence state (chunked,
    /// interleaved, reset, truncated, forked) against the reference, rather than against the
    /// backend's own plain run, also catches a backend that is wrong the same way on both paths.
    pub fn baseline(&self, prompt: &[u32], steps: usize) -> Checked<Arc<OracleRun>> {
        self.oracle.run(self.model, self.format, prompt, Continuation::Greedy(steps)).map_err(Verdict::fail)
    }

    /// A greedy driver forced along `forced`.
    pub fn forced_driver(&self, forced: &[u32], label: &str) -> Checked<Driver> {
        Ok(Driver::forced(self.greedy_session()?, forced, label))
    }

    /// Compares `actual` (a run of the backend forced along `baseline`'s tokens) with `baseline`;
    /// `what` names the comparison in a failure.
    pub fn check_against(&self, baseline: &OracleRun, actual: &Trace, what: &str) -> Checked<Comparison> {
        let expected =
            Expected { tokens: &baseline.trace.tokens, margins: &baseline.margins, logits: baseline.trace.logits() };
        let comparison = compare(actual, expected, &self.tolerances);
        comparison.check(what, &self.tolerances)?;
        Ok(comparison)
    }
}

/// A pass carrying a comparison's figures.
pub fn pass_with(detail: impl Into<String>, comparison: &Comparison) -> Checked<Verdict> {
    Ok(Verdict::pass(detail).with_figures(comparison.figures()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_case_has_the_tolerance_kind_it_uses() {
        let names: Vec<&str> = crate::list_cases().into_iter().map(|(name, _)| name).collect();
        for name in UNTOLERANCED {
            assert!(names.contains(&name), "{name} is no longer a case");
            assert_eq!(tolerance_kind(name), None);
        }
        assert_eq!(tolerance_kind("parity.greedy"), Some(ToleranceKind::Reference));
        for case in self_consistency::CASES {
            assert_eq!(tolerance_kind(case.name), Some(ToleranceKind::SelfConsistency), "{}", case.name);
        }
    }
}
