//! The capabilities a backend claims are consistent, the mandatory ones are there, and every
//! optional one it does not claim is refused with a typed `Unsupported` (never silently ignored).

use super::{Case, CaseContext};
use crate::verdict::{Checked, OrFail, Verdict};
use session_api::{ErrorKind, LoadRequest, SamplingConfig, SessionOptions, WeightFormat};

/// The capability-claims case.
pub const CASE: Case = Case {
    name: "contract.capabilities",
    about:
        "mandatory capabilities present, engine info consistent, every unclaimed capability refused with Unsupported",
    missing: super::needs_nothing,
    run,
};

fn run(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let caps = ctx.capabilities;
    let backend_caps = ctx.backend.capabilities();
    let mut problems = Vec::new();
    if !caps.sampling.greedy {
        problems.push("greedy sampling is mandatory but not claimed".to_string());
    }
    if !caps.inputs.tokens {
        problems.push("token input is mandatory but not claimed".to_string());
    }
    if caps.max_context == 0 {
        problems.push("max_context is 0".to_string());
    }
    if !backend_caps.supports_format(ctx.format) {
        problems.push(format!("the backend loaded {} but its capabilities do not list it", ctx.format));
    }
    let info = ctx.engine.info();
    if info.weights != ctx.format {
        problems.push(format!("info().weights is {} for an engine loaded as {}", info.weights, ctx.format));
    }
    if let Some(config) = &ctx.model.config {
        if info.vocab_size != config.vocab_size || info.hidden_size != config.hidden_size {
            problems.push(format!(
                "info() reports vocab {} / hidden {}, the model has {} / {}",
                info.vocab_size, info.hidden_size, config.vocab_size, config.hidden_size
            ));
        }
    }
    let session = ctx.greedy_session()?;
    if session.position() != 0 {
        problems.push(format!("a new session's position() is {}", session.position()));
    }
    if session.capacity() > caps.max_context {
        problems.push(format!(
            "a session's capacity() {} exceeds max_context {}",
            session.capacity(),
            caps.max_context
        ));
    }
    drop(session);

    // Each unclaimed capability, requested anyway, must be refused as Unsupported.
    let mut refusals = 0;
    let mut expect_refusal = |what: &str, result: Result<(), session_api::SeamError>| match result {
        Err(e) if e.kind() == ErrorKind::Unsupported => refusals += 1,
        Err(e) => problems.push(format!("{what} (not claimed) failed with {:?} instead of Unsupported: {e}", e.kind())),
        Ok(()) => {
            problems.push(format!("{what} is not claimed, yet it was accepted instead of refused as Unsupported"))
        }
    };
    let session_with = |options: SessionOptions| ctx.engine.new_session(options).map(drop);
    if !caps.logits {
        expect_refusal(
            "return_logits",
            session_with(SessionOptions { return_logits: true, ..SessionOptions::default() }),
        );
    }
    let sample = |top_k, top_p| SessionOptions {
        sampling: SamplingConfig::Sample { temperature: 1.0, top_k, top_p, seed: 1 },
        ..SessionOptions::default()
    };
    if !(caps.sampling.temperature && caps.sampling.seeded) {
        expect_refusal("seeded temperature sampling", session_with(sample(0, 1.0)));
    }
    if !caps.sampling.top_k {
        expect_refusal("top-k sampling", session_with(sample(5, 1.0)));
    }
    if !caps.sampling.top_p {
        expect_refusal("top-p sampling", session_with(sample(0, 0.5)));
    }
    let prompt = ctx.prompt(4, 170);
    if !caps.kv_ops.truncate {
        let mut session = ctx.greedy_session()?;
        session.prefill(&prompt).or_fail(|| "prefill".into())?;
        expect_refusal("truncate", session.truncate(1));
    }
    if !caps.kv_ops.fork {
        let mut session = ctx.greedy_session()?;
        session.prefill(&prompt).or_fail(|| "prefill".into())?;
        expect_refusal("fork", session.fork().map(drop));
    }
    if !caps.inputs.embeddings {
        let mut session = ctx.greedy_session()?;
        expect_refusal("prefill_embeddings", session.prefill_embeddings(&vec![0.0; info.hidden_size], 1).map(drop));
    }
    for format in WeightFormat::ALL {
        if !backend_caps.supports_format(format) {
            let request = LoadRequest::new(&ctx.request.model_dir, format);
            expect_refusal(&format!("loading {format} weights"), ctx.backend.load(&request).map(drop));
        }
    }
    if !problems.is_empty() {
        return Err(Verdict::fail(problems.join("; ")));
    }
    Ok(Verdict::pass(match refusals {
        0 => "mandatory capabilities present; every optional capability is claimed, so no refusal to check".to_string(),
        n => format!("mandatory capabilities present; {n} unclaimed capabilities each refused with Unsupported"),
    }))
}
