//! Prefill from embeddings (the multimodal path: an encoder's output fed to the language model):
//! the embedding rows of a prompt's own tokens must continue exactly like the tokens.

use super::{pass_with, Case, CaseContext};
use crate::verdict::{Checked, Verdict};
use session_api::Capabilities;

/// The embedding cases, in order.
pub const CASES: [Case; 2] = [
    Case {
        name: "input.embeddings_equal_tokens",
        about: "a prompt prefilled as the embedding rows of its tokens continues like the token prefill",
        missing: needs_embeddings,
        run: embeddings_equal_tokens,
    },
    Case {
        name: "input.embeddings_interleaved",
        about: "token, embedding and token segments in one sequence continue like the whole prompt as tokens",
        missing: needs_embeddings,
        run: embeddings_interleaved,
    },
];

const STEPS: usize = 8;

fn needs_embeddings(c: &Capabilities) -> Option<&'static str> {
    (!c.inputs.embeddings).then_some("prefill from embeddings")
}

/// The rows of the model's embedding table for `tokens`, as the weight format defines them (f16
/// widened, int4 dequantized), row after row.
fn embedding_rows(ctx: &CaseContext<'_>, tokens: &[u32]) -> Checked<Vec<f32>> {
    let weights = llama_model::weights::load_weights(&ctx.model.dir, ctx.format, None)
        .map_err(|e| Verdict::fail(format!("reading the test model's embedding table: {e}")))?;
    let hidden = weights.embed.cols();
    let mut rows = vec![0.0f32; tokens.len() * hidden];
    for (row, &token) in rows.chunks_exact_mut(hidden).zip(tokens) {
        weights.embed.row_f32(token as usize, row);
    }
    Ok(rows)
}

fn embeddings_equal_tokens(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let prompt = ctx.prompt(12, 160);
    let baseline = ctx.baseline(&prompt, STEPS)?;
    let rows = embedding_rows(ctx, &prompt)?;
    let mut driver = ctx.forced_driver(&baseline.trace.tokens, "session prefilled from embeddings")?;
    driver.prefill_embeddings(&rows, prompt.len(), true)?;
    while driver.trace.tokens.len() < STEPS {
        driver.step()?;
    }
    let comparison = ctx.check_against(&baseline, &driver.trace, "the embeddings of a prompt vs its tokens")?;
    pass_with(format!("{} embedding rows continued like their tokens for {STEPS} steps", prompt.len()), &comparison)
}

fn embeddings_interleaved(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let prompt = ctx.prompt(24, 161);
    let baseline = ctx.baseline(&prompt, STEPS)?;
    let (text, media, tail) = (&prompt[..5], &prompt[5..17], &prompt[17..]);
    let rows = embedding_rows(ctx, media)?;
    let mut driver = ctx.forced_driver(&baseline.trace.tokens, "session of interleaved tokens and embeddings")?;
    driver.prefill(text, false)?;
    driver.prefill_embeddings(&rows, media.len(), false)?;
    driver.prefill(tail, true)?;
    while driver.trace.tokens.len() < STEPS {
        driver.step()?;
    }
    let comparison = ctx.check_against(&baseline, &driver.trace, "tokens, embeddings, tokens vs all tokens")?;
    pass_with("5 tokens, 12 embedding rows, 7 tokens continued like the 24 tokens", &comparison)
}
