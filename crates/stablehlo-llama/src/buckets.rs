//! How a runtime feeds `n` tokens at `position` to the compiled graphs.
//!
//! The prefill graphs exist for a few bucket lengths only (each is a compile). A call writes a
//! whole bucket of keys and values at `position`, padding included, so it needs
//! `position + bucket <= max_context`: `dynamic_update_slice` clamps an out-of-range start index
//! instead of failing, which would shift the write onto earlier positions. [`plan_prefill`] cuts
//! the tokens into calls that respect that rule:
//!
//! - one call of the smallest bucket that holds all remaining tokens and fits;
//! - otherwise a full call of the largest bucket that fits, and continue;
//! - when no bucket fits the room left (near the end of the context), or one token remains, or
//!   (where padding rows cost what real ones do, [`PaddingCost`]) a few tokens remain, a decode
//!   step per token (the decode graph is the one-token bucket and always fits).
//!
//! [`plan_prefill_embeddings`] is the same plan for embedding rows, over the
//! [`GraphKind::PrefillEmbeddings`] graphs; its one-row calls go through bucket 1.

use crate::error::GraphError;
use crate::graph::GraphKind;

/// One call of a plan: which graph, and how many real tokens it takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedCall {
    pub graph: GraphKind,
    /// Real tokens of this call (the rest of a prefill bucket is padding).
    pub count: usize,
}

/// What a padding row of a prefill call costs, which decides whether a few tokens go through
/// decode steps or through one padded call ([`plan_prefill`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PaddingCost {
    /// About what a real row costs: the compilers' own products and attention compute every row
    /// of the bucket.
    Full,
    /// Next to nothing: seam's kernels compute a call's real rows alone, and what the graph does
    /// itself to the padding rows (norms, elementwise steps) is small beside a decode step.
    Skipped,
}

/// The default prefill buckets: short prompts compile-cheap, long prompts in few calls.
pub const DEFAULT_BUCKETS: [usize; 3] = [16, 64, 256];

/// The [`DEFAULT_BUCKETS`] that fit a context of `max_context` positions; a context below the
/// smallest bucket gets one bucket of its own length.
pub fn buckets_for_context(max_context: usize) -> Vec<usize> {
    let fitting: Vec<usize> = DEFAULT_BUCKETS.iter().copied().filter(|&b| b <= max_context).collect();
    if fitting.is_empty() {
        vec![max_context]
    } else {
        fitting
    }
}

/// Cuts `tokens` new tokens at `position` into calls of the decode graph and the prefill
/// graphs of `buckets` (any order). Fails when the tokens do not fit in `max_context`.
///
/// Where padding costs what a real row does ([`PaddingCost::Full`]), a few tokens (a quarter of
/// the smallest bucket or fewer) go through decode steps rather than a bucket that would be three
/// quarters padding: on a compiler's CPU code two tokens in a 16-row call cost eight decode
/// steps. Where the kernels skip the padding ([`PaddingCost::Skipped`]), any two or more tokens
/// are one call: a 16-row call with four real rows costs about what one decode step does.
pub fn plan_prefill(
    position: usize,
    tokens: usize,
    buckets: &[usize],
    max_context: usize,
    padding: PaddingCost,
) -> Result<Vec<PlannedCall>, GraphError> {
    if position + tokens > max_context {
        return Err(GraphError::Options(format!(
            "{tokens} tokens at position {position} exceed the context of {max_context}"
        )));
    }
    if buckets.contains(&0) {
        return Err(GraphError::Options("a prefill bucket of 0 tokens".into()));
    }
    let mut sorted = buckets.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut calls = Vec::new();
    let (mut at, mut left) = (position, tokens);
    while left > 0 {
        let room = max_context - at;
        let fitting: Vec<usize> = sorted.iter().copied().filter(|&b| b <= room).collect();
        let few = padding == PaddingCost::Full && fitting.first().is_some_and(|&smallest| left * 4 <= smallest);
        let call = if left == 1 || fitting.is_empty() || few {
            PlannedCall { graph: GraphKind::Decode, count: 1 }
        } else if let Some(&b) = fitting.iter().find(|&&b| b >= left) {
            PlannedCall { graph: GraphKind::Prefill { bucket: b }, count: left }
        } else {
            let b = *fitting.last().expect("fitting is not empty");
            PlannedCall { graph: GraphKind::Prefill { bucket: b }, count: b }
        };
        at += call.count;
        left -= call.count;
        calls.push(call);
    }
    Ok(calls)
}

/// [`plan_prefill`] for `rows` embedding rows at `position`: the same calls, each of a
/// [`GraphKind::PrefillEmbeddings`] graph, with bucket 1 where the token plan has a decode step
/// (there is no embeddings decode graph). A runtime that feeds embeddings therefore compiles
/// `prefill_embeddings_1` besides the buckets it passes here.
pub fn plan_prefill_embeddings(
    position: usize,
    rows: usize,
    buckets: &[usize],
    max_context: usize,
    padding: PaddingCost,
) -> Result<Vec<PlannedCall>, GraphError> {
    let calls = plan_prefill(position, rows, buckets, max_context, padding)?;
    Ok(calls
        .into_iter()
        .map(|call| PlannedCall {
            graph: GraphKind::PrefillEmbeddings { bucket: call.graph.input_rows() },
            count: call.count,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefill(bucket: usize, count: usize) -> PlannedCall {
        PlannedCall { graph: GraphKind::Prefill { bucket }, count }
    }
    const DECODE: PlannedCall = PlannedCall { graph: GraphKind::Decode, count: 1 };
    const FULL: PaddingCost = PaddingCost::Full;

    #[test]
    fn plans() {
        let b = DEFAULT_BUCKETS;
        assert_eq!(plan_prefill(0, 5, &b, 1024, FULL).unwrap(), vec![prefill(16, 5)]);
        // A quarter of the smallest bucket or less: decode steps, not a call of 3/4 padding.
        assert_eq!(plan_prefill(0, 4, &b, 1024, FULL).unwrap(), vec![DECODE; 4]);
        assert_eq!(plan_prefill(0, 2, &b, 1024, FULL).unwrap(), vec![DECODE; 2]);
        assert_eq!(plan_prefill(0, 258, &b, 1024, FULL).unwrap(), vec![prefill(256, 256), DECODE, DECODE]);
        assert_eq!(plan_prefill(0, 16, &b, 1024, FULL).unwrap(), vec![prefill(16, 16)]);
        assert_eq!(plan_prefill(0, 17, &b, 1024, FULL).unwrap(), vec![prefill(64, 17)]);
        assert_eq!(
            plan_prefill(3, 600, &b, 1024, FULL).unwrap(),
            vec![prefill(256, 256), prefill(256, 256), prefill(256, 88)]
        );
        assert_eq!(plan_prefill(7, 1, &b, 1024, FULL).unwrap(), vec![DECODE]);
        assert_eq!(plan_prefill(7, 0, &b, 1024, FULL).unwrap(), vec![]);
        // Near the end: 20 positions left, 18 tokens: 16 fits (full), then 2 decode steps.
        assert_eq!(plan_prefill(1004, 18, &b, 1024, FULL).unwrap(), vec![prefill(16, 16), DECODE, DECODE]);
        // No bucket fits at all: decode steps.
        assert_eq!(plan_prefill(1020, 3, &b, 1024, FULL).unwrap(), vec![DECODE, DECODE, DECODE]);
        // No buckets configured.
        assert_eq!(plan_prefill(0, 2, &[], 8, FULL).unwrap(), vec![DECODE, DECODE]);
    }

    #[test]
    fn where_the_kernels_skip_padding_a_few_tokens_are_one_call() {
        let b = DEFAULT_BUCKETS;
        let skipped = PaddingCost::Skipped;
        assert_eq!(plan_prefill(0, 4, &b, 1024, skipped).unwrap(), vec![prefill(16, 4)]);
        assert_eq!(plan_prefill(0, 2, &b, 1024, skipped).unwrap(), vec![prefill(16, 2)]);
        assert_eq!(plan_prefill(0, 258, &b, 1024, skipped).unwrap(), vec![prefill(256, 256), prefill(16, 2)]);
        assert_eq!(plan_prefill(0, 5, &b, 1024, skipped).unwrap(), vec![prefill(16, 5)]);
        // One token, and no bucket fitting the room left, are still decode steps.
        assert_eq!(plan_prefill(7, 1, &b, 1024, skipped).unwrap(), vec![DECODE]);
        assert_eq!(plan_prefill(1004, 18, &b, 1024, skipped).unwrap(), vec![prefill(16, 16), DECODE, DECODE]);
        assert_eq!(plan_prefill(1020, 3, &b, 1024, skipped).unwrap(), vec![DECODE, DECODE, DECODE]);
        let embeddings = PlannedCall { graph: GraphKind::PrefillEmbeddings { bucket: 16 }, count: 3 };
        assert_eq!(plan_prefill_embeddings(0, 3, &b, 1024, skipped).unwrap(), vec![embeddings]);
    }

    #[test]
    fn every_call_fits_and_every_token_is_fed() {
        let buckets = [4, 16, 8];
        for (max_context, padding) in [1, 5, 16, 37].into_iter().flat_map(|m| [(m, FULL), (m, PaddingCost::Skipped)]) {
            for position in 0..=max_context {
                for tokens in 0..=(max_context - position) {
                    let plan = plan_prefill(position, tokens, &buckets, max_context, padding).unwrap();
                    let mut at = position;
                    for call in &plan {
                        let width = call.graph.input_rows();
                        assert!(call.count >= 1 && call.count <= width);
                        assert!(at + width <= max_context, "{position} {tokens} {max_context}: {plan:?}");
                        at += call.count;
                    }
                    assert_eq!(at, position + tokens);
                }
            }
        }
    }

    /// The embeddings plan is the token plan call for call, decode steps as bucket 1.
    #[test]
    fn embeddings_plans_follow_the_token_plans() {
        let embeddings = |bucket, count| PlannedCall { graph: GraphKind::PrefillEmbeddings { bucket }, count };
        let b = DEFAULT_BUCKETS;
        assert_eq!(plan_prefill_embeddings(0, 5, &b, 1024, FULL).unwrap(), vec![embeddings(16, 5)]);
        assert_eq!(plan_prefill_embeddings(7, 1, &b, 1024, FULL).unwrap(), vec![embeddings(1, 1)]);
        assert_eq!(
            plan_prefill_embeddings(1004, 18, &b, 1024, FULL).unwrap(),
            vec![embeddings(16, 16), embeddings(1, 1), embeddings(1, 1)]
        );
        for (position, rows) in [(0, 600), (3, 17), (1020, 3), (0, 0)] {
            let tokens = plan_prefill(position, rows, &b, 1024, FULL).unwrap();
            let from_embeddings = plan_prefill_embeddings(position, rows, &b, 1024, FULL).unwrap();
            assert_eq!(tokens.len(), from_embeddings.len());
            for (t, e) in tokens.iter().zip(&from_embeddings) {
                assert!(e.graph.takes_embeddings() && e.graph.takes_count());
                assert_eq!((t.graph.input_rows(), t.count), (e.graph.input_rows(), e.count));
            }
        }
        assert!(matches!(plan_prefill_embeddings(10, 7, &b, 16, FULL), Err(GraphError::Options(_))));
    }

    #[test]
    fn errors() {
        assert!(matches!(plan_prefill(10, 7, &DEFAULT_BUCKETS, 16, FULL), Err(GraphError::Options(_))));
        assert!(matches!(plan_prefill(0, 3, &[0, 4], 16, FULL), Err(GraphError::Options(_))));
    }
}
