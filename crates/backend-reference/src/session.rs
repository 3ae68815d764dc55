//! A reference session's raw steps: one sequence's KV cache on the host.

use crate::engine::EngineShared;
use crate::transformer::KvCache;
use session_api::{RawStep, Result, SessionSteps, StepInput};
use std::sync::Arc;

/// The steps of one reference sequence. Created by [`crate::ReferenceEngine`]; callers get it
/// wrapped in a [`session_api::CheckedSession`], which checks every argument first.
#[derive(Debug)]
pub struct ReferenceSteps {
    shared: Arc<EngineShared>,
    cache: KvCache,
    /// Whether each step also returns the hidden state after every layer.
    hidden_states: bool,
}

impl ReferenceSteps {
    pub(crate) fn new(shared: Arc<EngineShared>, hidden_states: bool) -> Self {
        let cache = shared.model.new_cache();
        ReferenceSteps { shared, cache, hidden_states }
    }
}

impl SessionSteps for ReferenceSteps {
    fn append(&mut self, position: usize, input: StepInput<'_>, _want_logits: bool) -> Result<RawStep> {
        debug_assert_eq!(position, self.cache.len(), "the checked session's position is the cache length");
        let hidden = match input {
            StepInput::Tokens(tokens) => self.shared.model.embed_tokens(tokens),
            StepInput::Embeddings { values, .. } => values.to_vec(),
        };
        let (shared, cache) = (&self.shared, &mut self.cache);
        let mut layers = self.hidden_states.then(Vec::new);
        let logits = shared.run(|| shared.model.forward_observed(hidden, cache, layers.as_mut()))?;
        // The logits are on the host already: the checked session picks the token from them.
        Ok(RawStep { greedy_token: None, logits: Some(logits), hidden_states: layers })
    }

    fn append_scoring(&mut self, position: usize, tokens: &[u32]) -> Result<RawStep> {
        debug_assert_eq!(position, self.cache.len(), "the checked session's position is the cache length");
        let hidden = self.shared.model.embed_tokens(tokens);
        let (shared, cache) = (&self.shared, &mut self.cache);
        let logits = shared.run(|| shared.model.forward_all_positions(hidden, cache))?;
        Ok(RawStep { greedy_token: None, logits: Some(logits), hidden_states: None })
    }

    fn truncate(&mut self, position: usize) -> Result<()> {
        self.cache.truncate(position);
        Ok(())
    }

    fn fork(&self, position: usize) -> Result<Box<dyn SessionSteps>> {
        // A deep copy: the cache's vectors are cloned, only the weights stay shared.
        let mut cache = self.cache.clone();
        cache.truncate(position);
        Ok(Box::new(ReferenceSteps { shared: Arc::clone(&self.shared), cache, hidden_states: self.hidden_states }))
    }

    fn reset(&mut self, _after_failure: bool) -> Result<()> {
        // A failed forward pass may have pushed part of a step: clearing drops it either way.
        self.cache.clear();
        Ok(())
    }
}
