//! A reference session: one sequence's KV cache, its position, and its sampler.

use crate::engine::EngineShared;
use crate::transformer::KvCache;
use session_api::session::SessionGuard;
use session_api::{Result, Sampler, SeamError, Session, SessionOptions, StepOutput};
use std::sync::Arc;

/// A session of the reference backend. Created by [`crate::ReferenceEngine`].
#[derive(Debug)]
pub struct ReferenceSession {
    shared: Arc<EngineShared>,
    cache: KvCache,
    capacity: usize,
    sampler: Sampler,
    return_logits: bool,
    guard: SessionGuard,
}

impl ReferenceSession {
    pub(crate) fn new(shared: Arc<EngineShared>, options: SessionOptions, capacity: usize) -> Self {
        let cache = shared.model.new_cache();
        ReferenceSession {
            shared,
            cache,
            capacity,
            sampler: Sampler::new(options.sampling),
            return_logits: options.return_logits,
            guard: SessionGuard::default(),
        }
    }

    /// Runs `hidden` through the model at the current position and picks the next token.
    /// Arguments must have been checked already.
    fn step(shared: &EngineShared, cache: &mut KvCache, sampler: &mut Sampler, return_logits: bool, hidden: Vec<f32>) -> Result<StepOutput> {
        let logits = shared.run(|| shared.model.forward(hidden, cache))?;
        let token = sampler.sample(&logits);
        Ok(StepOutput { token, logits: return_logits.then_some(logits) })
    }
}

impl Session for ReferenceSession {
    fn prefill(&mut self, tokens: &[u32]) -> Result<StepOutput> {
        let (shared, cache, sampler, return_logits, capacity) =
            (&self.shared, &mut self.cache, &mut self.sampler, self.return_logits, self.capacity);
        self.guard.step(|| {
            SessionGuard::check_tokens(tokens, shared.model.config().vocab_size, cache.len(), capacity)?;
            let hidden = shared.model.embed_tokens(tokens);
            Self::step(shared, cache, sampler, return_logits, hidden)
        })
    }

    fn decode(&mut self, token: u32) -> Result<StepOutput> {
        let (shared, cache, sampler, return_logits, capacity) =
            (&self.shared, &mut self.cache, &mut self.sampler, self.return_logits, self.capacity);
        self.guard.step(|| {
            if cache.is_empty() {
                return Err(SeamError::NotPrefilled);
            }
            SessionGuard::check_tokens(&[token], shared.model.config().vocab_size, cache.len(), capacity)?;
            let hidden = shared.model.embed_tokens(&[token]);
            Self::step(shared, cache, sampler, return_logits, hidden)
        })
    }

    fn position(&self) -> usize {
        self.cache.len()
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn reset(&mut self) {
        self.cache.clear();
        self.sampler.restart();
        self.guard.clear();
    }

    fn truncate(&mut self, position: usize) -> Result<()> {
        if position > self.cache.len() {
            return Err(SeamError::InvalidInput(format!(
                "cannot truncate to position {position}: the session holds only {}",
                self.cache.len()
            )));
        }
        self.cache.truncate(position);
        Ok(())
    }

    fn fork(&self) -> Result<Box<dyn Session>> {
        // A deep copy: the cache's vectors are cloned, only the weights stay shared.
        Ok(Box::new(ReferenceSession {
            shared: Arc::clone(&self.shared),
            cache: self.cache.clone(),
            capacity: self.capacity,
            sampler: self.sampler.clone(),
            return_logits: self.return_logits,
            guard: self.guard.clone(),
        }))
    }

    fn prefill_embeddings(&mut self, embeddings: &[f32], count: usize) -> Result<StepOutput> {
        let (shared, cache, sampler, return_logits, capacity) =
            (&self.shared, &mut self.cache, &mut self.sampler, self.return_logits, self.capacity);
        self.guard.step(|| {
            let hidden = shared.model.config().hidden_size;
            if count == 0 {
                return Err(SeamError::EmptyInput);
            }
            if embeddings.len() != count * hidden {
                return Err(SeamError::InvalidInput(format!(
                    "{count} embeddings of hidden size {hidden} need {} values, got {}",
                    count * hidden,
                    embeddings.len()
                )));
            }
            if cache.len() + count > capacity {
                return Err(SeamError::ContextOverflow { requested: cache.len() + count, capacity });
            }
            Self::step(shared, cache, sampler, return_logits, embeddings.to_vec())
        })
    }

    fn backend_name(&self) -> &str {
        crate::BACKEND_NAME
    }
}
