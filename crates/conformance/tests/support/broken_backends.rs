//! Deliberately broken backends, for testing that the suite catches them. Test-only: they are
//! never registered, only handed to the suite directly.
//!
//! Each wraps the reference backend and breaks one thing after a number of decode steps:
//! - [`Breakage::CorruptKv`]: rewrites the last few cache positions with the keys and values of
//!   other tokens (by truncating and re-prefilling wrong tokens), while `position()` stays right;
//! - [`Breakage::PanicInDecode`]: panics inside `decode`;
//! - [`Breakage::LeakSessions`]: never frees a dropped session's state.

use session_api::{Availability, Backend, Capabilities, Engine, EngineInfo, LoadRequest, Result, Session, SessionOptions, StepOutput};
use std::sync::Arc;

/// What goes wrong.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Breakage {
    CorruptKv,
    PanicInDecode,
    LeakSessions,
}

impl Breakage {
    fn name(self) -> &'static str {
        match self {
            Breakage::CorruptKv => "broken-kv",
            Breakage::PanicInDecode => "broken-panic",
            Breakage::LeakSessions => "broken-leak",
        }
    }
}

/// Positions of the cache rewritten by [`Breakage::CorruptKv`].
pub const CORRUPTED_POSITIONS: usize = 4;

pub struct BrokenBackend {
    inner: Box<dyn Backend>,
    breakage: Breakage,
    /// Decode calls a session makes correctly before the breakage.
    after_decodes: usize,
}

impl BrokenBackend {
    pub fn new(breakage: Breakage, after_decodes: usize) -> BrokenBackend {
        backend_reference::link();
        let inner = session_api::find_backend("reference").expect("the reference backend is linked");
        BrokenBackend { inner, breakage, after_decodes }
    }
}

impl Backend for BrokenBackend {
    fn name(&self) -> &str {
        self.breakage.name()
    }
    fn description(&self) -> &str {
        "test-only: the reference, broken on purpose"
    }
    fn availability(&self) -> Availability {
        self.inner.availability()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn load(&self, request: &LoadRequest) -> Result<Arc<dyn Engine>> {
        let inner = self.inner.load(request)?;
        Ok(Arc::new(BrokenEngine { inner, breakage: self.breakage, after_decodes: self.after_decodes }))
    }
}

struct BrokenEngine {
    inner: Arc<dyn Engine>,
    breakage: Breakage,
    after_decodes: usize,
}

impl Engine for BrokenEngine {
    fn info(&self) -> EngineInfo {
        self.inner.info()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn new_session(&self, options: SessionOptions) -> Result<Box<dyn Session>> {
        Ok(Box::new(BrokenSession {
            inner: Some(self.inner.new_session(options)?),
            vocab_size: self.inner.info().vocab_size,
            history: Vec::new(),
            decodes: 0,
            breakage: self.breakage,
            after_decodes: self.after_decodes,
        }))
    }
}

struct BrokenSession {
    /// Always `Some` until drop (where [`Breakage::LeakSessions`] forgets it instead of freeing it).
    inner: Option<Box<dyn Session>>,
    vocab_size: usize,
    /// Every token in the cache, to know what to corrupt.
    history: Vec<u32>,
    decodes: usize,
    breakage: Breakage,
    after_decodes: usize,
}

impl Drop for BrokenSession {
    fn drop(&mut self) {
        if self.breakage == Breakage::LeakSessions {
            std::mem::forget(self.inner.take());
        }
    }
}

impl BrokenSession {
    fn inner(&mut self) -> &mut Box<dyn Session> {
        self.inner.as_mut().expect("present until drop")
    }

    fn inner_ref(&self) -> &dyn Session {
        self.inner.as_deref().expect("present until drop")
    }

    fn corrupt_cache(&mut self) -> Result<()> {
        let position = self.inner().position();
        let count = CORRUPTED_POSITIONS.min(position);
        let start = position - count;
        let wrong: Vec<u32> = self.history[start..].iter().map(|&t| (t + 1) % self.vocab_size as u32).collect();
        self.inner().truncate(start)?;
        if !wrong.is_empty() {
            self.inner().prefill(&wrong)?;
        }
        Ok(())
    }
}

impl Session for BrokenSession {
    fn prefill(&mut self, tokens: &[u32]) -> Result<StepOutput> {
        let out = self.inner().prefill(tokens)?;
        self.history.extend_from_slice(tokens);
        Ok(out)
    }
    fn decode(&mut self, token: u32) -> Result<StepOutput> {
        if self.decodes == self.after_decodes && self.inner().position() > 0 && (token as usize) < self.vocab_size {
            match self.breakage {
                Breakage::CorruptKv => self.corrupt_cache()?,
                Breakage::PanicInDecode => panic!("broken-panic: decode step {} blew up", self.decodes + 1),
                Breakage::LeakSessions => {}
            }
        }
        let out = self.inner().decode(token)?;
        self.decodes += 1;
        self.history.push(token);
        Ok(out)
    }
    fn position(&self) -> usize {
        self.inner_ref().position()
    }
    fn capacity(&self) -> usize {
        self.inner_ref().capacity()
    }
    fn reset(&mut self) {
        self.inner().reset();
        self.history.clear();
        self.decodes = 0;
    }
    fn truncate(&mut self, position: usize) -> Result<()> {
        self.inner().truncate(position)?;
        self.history.truncate(position);
        Ok(())
    }
    fn fork(&self) -> Result<Box<dyn Session>> {
        Ok(Box::new(BrokenSession {
            inner: Some(self.inner_ref().fork()?),
            vocab_size: self.vocab_size,
            history: self.history.clone(),
            decodes: self.decodes,
            breakage: self.breakage,
            after_decodes: self.after_decodes,
        }))
    }
    fn prefill_embeddings(&mut self, embeddings: &[f32], count: usize) -> Result<StepOutput> {
        // Embedding positions have no token id; the corruption then rewrites them with token 1's.
        let out = self.inner().prefill_embeddings(embeddings, count)?;
        self.history.extend(std::iter::repeat_n(0, count));
        Ok(out)
    }
    fn backend_name(&self) -> &str {
        self.breakage.name()
    }
}
