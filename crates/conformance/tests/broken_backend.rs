//! The suite must catch a broken backend: one that corrupts its KV cache after a few decode steps
//! fails with the case and the step named; one that panics inside decode fails those cases
//! (caught), and the suite goes on to the others; one that leaks every dropped session fails the
//! memory case; one whose greedy token is not its logits' argmax is told apart from an arithmetic
//! bug; one that rewrites a single cache row slightly wrong, declared bf16, passes greedy parity
//! at the bf16 preset and fails the self-consistency case.

mod support;

use conformance::{ComputePrecision, Outcome, RealModelParity, Report, SuiteOptions, Target, ToleranceKind};
use support::broken_backends::{Breakage, BrokenBackend};

/// Decode steps a broken session gets right before it breaks.
const GOOD_DECODES: usize = 8;

fn result<'r>(report: &'r Report, case: &str, model: &str) -> &'r conformance::CaseResult {
    report.backends[0]
        .results
        .iter()
        .find(|r| r.case == case && r.model.as_deref() == Some(model))
        .unwrap_or_else(|| panic!("no result for {case} [{model}]"))
}

fn main() {
    // Tiny models in f16 are enough to show the breakage; the real model would only add minutes.
    let options = SuiteOptions {
        real_model: RealModelParity::Skip,
        formats: vec![session_api::WeightFormat::F16],
        ..SuiteOptions::from_env()
    };
    let targets = [
        Target::new(Box::new(BrokenBackend::new(Breakage::CorruptKv, GOOD_DECODES))),
        Target::new(Box::new(BrokenBackend::new(Breakage::PanicInDecode, GOOD_DECODES))),
        Target::new(Box::new(BrokenBackend::new(Breakage::LeakSessions, GOOD_DECODES))),
        Target::new(Box::new(BrokenBackend::new(Breakage::WrongGreedyToken, GOOD_DECODES))),
        // The same cache corruption, declared a bf16 backend: the reference preset is then loose
        // enough to let it through, and only the self-consistency cases can catch it.
        Target::new(Box::new(BrokenBackend::new(Breakage::NudgeKvRow, GOOD_DECODES)))
            .with_precision(ComputePrecision::Bf16),
    ];
    let report = conformance::run_targets(&targets, &options).expect("the suite runs");
    report.print_matrix();

    let corrupt = Report { backends: vec![report.backends[0].clone()] };
    let panicking = Report { backends: vec![report.backends[1].clone()] };
    let leaking = Report { backends: vec![report.backends[2].clone()] };
    assert!(corrupt.has_failures() && panicking.has_failures());

    // The corrupted cache shows in greedy parity, at a step after the corruption, and the report
    // says which prompt and which step.
    let parity = result(&corrupt, "parity.greedy", conformance::LIFECYCLE_MODEL);
    assert_eq!(parity.outcome, Outcome::Fail, "{parity:?}");
    let step = parity.figures.first_divergent_step.expect("the failing step is reported");
    assert!(
        step > GOOD_DECODES,
        "the divergence (step {step}) cannot precede the corruption (after step {GOOD_DECODES})"
    );
    assert!(parity.figures.divergent_prompt_len.is_some(), "{parity:?}");
    assert!(parity.detail.contains(&format!("step {step}")), "{}", parity.detail);
    // Every prompt is reported, and so is where the logits left tolerance, which is no later
    // than the first wrong token.
    assert!(parity.detail.contains("prompts failed"), "{}", parity.detail);
    let logits_left = parity.detail.split("logits out of tolerance from step ").nth(1).expect("named");
    let logits_step: usize = logits_left.split(' ').next().unwrap().parse().unwrap();
    assert!(logits_step <= step && logits_step >= GOOD_DECODES, "{}", parity.detail);
    println!("broken-kv caught: parity.greedy fails at step {step}: {}", parity.detail);

    // Layer by layer: the first bad step is the corruption's, and the first bad layer is named.
    let layers = result(&corrupt, "parity.layers", conformance::LIFECYCLE_MODEL);
    assert_eq!(layers.outcome, Outcome::Fail, "{layers:?}");
    let at = layers.detail.split("first left tolerance at step ").nth(1).expect("a step is named");
    let layer_step: usize = at.split(',').next().unwrap().parse().unwrap();
    assert!(layer_step > GOOD_DECODES && at.contains(", layer "), "{}", layers.detail);
    println!("broken-kv caught layer by layer: {}", layers.detail);

    // A backend whose arithmetic is right but whose greedy token is not its own logits' argmax
    // is told apart from an arithmetic bug.
    let greedy = Report { backends: vec![report.backends[3].clone()] };
    let parity = result(&greedy, "parity.greedy", conformance::LIFECYCLE_MODEL);
    assert_eq!(parity.outcome, Outcome::Fail, "{parity:?}");
    assert!(parity.detail.contains("token-selection bug"), "{}", parity.detail);
    println!("broken-greedy caught: {}", parity.detail);

    // Lifecycle cases that decode past the corruption fail too; those that decode less do not.
    for case in ["kv.chunked_prefill", "kv.interleaved_sessions", "kv.decode_equals_prefill"] {
        assert_eq!(result(&corrupt, case, conformance::LIFECYCLE_MODEL).outcome, Outcome::Fail, "{case}");
    }
    for case in ["input.empty_prompt", "input.token_out_of_vocabulary", "contract.capabilities"] {
        assert_eq!(result(&corrupt, case, conformance::LIFECYCLE_MODEL).outcome, Outcome::Pass, "{case}");
    }

    // A panic inside decode fails the case that hit it, with the panic's message, and every case
    // still ran.
    let panicked = result(&panicking, "parity.greedy", conformance::LIFECYCLE_MODEL);
    assert_eq!(panicked.outcome, Outcome::Fail);
    assert!(panicked.detail.contains("panicked") && panicked.detail.contains("blew up"), "{}", panicked.detail);
    assert_eq!(panicking.backends[0].results.len(), corrupt.backends[0].results.len());
    assert_eq!(result(&panicking, "input.empty_prompt", conformance::LIFECYCLE_MODEL).outcome, Outcome::Pass);
    println!("broken-panic caught: {}", panicked.detail);

    // Leaked sessions show as resident memory growth; everything else about that backend is fine.
    let memory = result(&leaking, "kv.many_sessions_memory", conformance::LIFECYCLE_MODEL);
    if memory.outcome != Outcome::Unavailable {
        assert_eq!(memory.outcome, Outcome::Fail, "{memory:?}");
        let (growth, tolerance) =
            (memory.figures.rss_growth_bytes.unwrap(), memory.figures.rss_tolerance_bytes.unwrap());
        assert!(growth > tolerance, "{memory:?}");
        println!("broken-leak caught: {} ({})", memory.detail, memory.figures.describe());
    }
    let expected_failures = usize::from(memory.outcome == Outcome::Fail);
    assert_eq!(
        leaking.backends[0].count(Outcome::Fail),
        expected_failures,
        "only the memory case may fail on broken-leak"
    );
    // One cache row rewritten from a slightly wrong input, on a backend declared bf16: the
    // reference preset lets it through (the premise: if the parity row below fails, the bf16
    // preset was tightened or the nudge grown, and this demonstration needs recalibrating), and
    // the self-consistency case, at the bf16 self tolerance, catches it at the step it happened.
    let bf16 = Report { backends: vec![report.backends[4].clone()] };
    let rows = |kind: ToleranceKind| bf16.backends[0].results.iter().filter(move |r| r.tolerance == Some(kind));
    let reference_rows = rows(ToleranceKind::Reference).count();
    let reference_passes = rows(ToleranceKind::Reference).filter(|r| r.outcome == Outcome::Pass).count();
    println!("broken-kv-row under bf16: {reference_passes} of {reference_rows} rows held against the reference pass");
    let parity = result(&bf16, "parity.greedy", conformance::LIFECYCLE_MODEL);
    assert_eq!(parity.outcome, Outcome::Pass, "{parity:?}");
    let own = result(&bf16, "self.decode_equals_prefill", conformance::LIFECYCLE_MODEL);
    assert_eq!(own.outcome, Outcome::Fail, "{own:?}");
    assert_eq!(own.tolerance, Some(ToleranceKind::SelfConsistency));
    let step = own.figures.first_divergent_step.expect("the failing step is reported");
    assert_eq!(step, GOOD_DECODES + 1, "the row is rewritten by decode {}: {}", GOOD_DECODES + 1, own.detail);
    assert!(own.detail.contains(&format!("first {step} generated tokens at once")), "{}", own.detail);
    println!("broken-kv-row caught under bf16 by self-consistency: {}", own.detail);

    println!("the suite reported every broken backend as failing, with case and step");
}
