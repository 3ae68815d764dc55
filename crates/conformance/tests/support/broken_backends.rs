//! Deliberately broken backends, for testing that the suite catches them. Test-only: they are
//! never registered, only handed to the suite directly.
//!
//! Each wraps the reference backend and breaks one thing after a number of decode steps:
//! - [`Breakage::CorruptKv`]: rewrites the last few cache positions with the keys and values of
//!   other tokens (by truncating and re-prefilling wrong tokens), while `position()` stays right;
//! - [`Breakage::PanicInDecode`]: panics inside `decode`;
//! - [`Breakage::LeakSessions`]: never frees a dropped session's state;
//! - [`Breakage::WrongGreedyToken`]: returns correct logits but, as its device-side greedy token,
//!   the runner-up (a selection bug with perfect arithmetic);
//! - [`Breakage::NudgeKvRow`]: rewrites one cache row from a slightly wrong input (its token's
//!   embedding mixed with another token's by [`NUDGE`]), the kind of small cache error a lower
//!   precision's reference tolerance hides.

use session_api::{
    Availability, Backend, Capabilities, Engine, EngineInfo, LoadRequest, RawStep, Result, SessionOptions,
    SessionSteps, StepInput,
};
use std::sync::Arc;

/// What goes wrong.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Breakage {
    CorruptKv,
    PanicInDecode,
    LeakSessions,
    WrongGreedyToken,
    NudgeKvRow,
}

impl Breakage {
    fn name(self) -> &'static str {
        match self {
            Breakage::CorruptKv => "broken-kv",
            Breakage::PanicInDecode => "broken-panic",
            Breakage::LeakSessions => "broken-leak",
            Breakage::WrongGreedyToken => "broken-greedy",
            Breakage::NudgeKvRow => "broken-kv-row",
        }
    }
}

/// Positions of the cache rewritten by [`Breakage::CorruptKv`].
pub const CORRUPTED_POSITIONS: usize = 4;

/// The weight of another token's embedding in the row [`Breakage::NudgeKvRow`] rewrites.
pub const NUDGE: f32 = 0.1;

/// A model's embedding table, row after row (for [`Breakage::NudgeKvRow`]).
struct EmbeddingTable {
    hidden: usize,
    rows: Vec<f32>,
}

impl EmbeddingTable {
    fn load(request: &LoadRequest) -> Result<EmbeddingTable> {
        let weights = llama_model::weights::load_weights(&request.model_dir, request.weights, None)
            .map_err(|e| session_api::SeamError::InvalidInput(format!("broken-kv-row: {e}")))?;
        let (vocab, hidden) = (weights.embed.rows(), weights.embed.cols());
        let mut rows = vec![0.0f32; vocab * hidden];
        for (token, row) in rows.chunks_exact_mut(hidden).enumerate() {
            weights.embed.row_f32(token, row);
        }
        Ok(EmbeddingTable { hidden, rows })
    }

    fn row(&self, token: u32) -> &[f32] {
        &self.rows[token as usize * self.hidden..][..self.hidden]
    }
}

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
        Capabilities { logits_per_position: false, ..self.inner.capabilities() }
    }
    fn load(&self, request: &LoadRequest) -> Result<Arc<dyn Engine>> {
        let inner = self.inner.load(request)?;
        let embeddings = match self.breakage {
            Breakage::NudgeKvRow => Some(Arc::new(EmbeddingTable::load(request)?)),
            _ => None,
        };
        Ok(Arc::new(BrokenEngine { inner, breakage: self.breakage, after_decodes: self.after_decodes, embeddings }))
    }
}

struct BrokenEngine {
    inner: Arc<dyn Engine>,
    breakage: Breakage,
    after_decodes: usize,
    embeddings: Option<Arc<EmbeddingTable>>,
}

impl Engine for BrokenEngine {
    fn info(&self) -> EngineInfo {
        self.inner.info()
    }
    fn capabilities(&self) -> Capabilities {
        // The broken steps wrap `append` only: scoring goes through it, one step per position.
        Capabilities { logits_per_position: false, ..self.inner.capabilities() }
    }
    fn open_steps(&self, options: &SessionOptions) -> Result<Box<dyn SessionSteps>> {
        Ok(Box::new(BrokenSteps {
            inner: Some(self.inner.open_steps(options)?),
            vocab_size: self.inner.info().vocab_size,
            history: Vec::new(),
            decodes: 0,
            breakage: self.breakage,
            after_decodes: self.after_decodes,
            embeddings: self.embeddings.clone(),
        }))
    }
}

struct BrokenSteps {
    /// Always `Some` until drop (where [`Breakage::LeakSessions`] forgets it instead of freeing it).
    inner: Option<Box<dyn SessionSteps>>,
    vocab_size: usize,
    /// Every token in the cache, to know what to corrupt.
    history: Vec<u32>,
    decodes: usize,
    breakage: Breakage,
    after_decodes: usize,
    embeddings: Option<Arc<EmbeddingTable>>,
}

impl Drop for BrokenSteps {
    fn drop(&mut self) {
        if self.breakage == Breakage::LeakSessions {
            std::mem::forget(self.inner.take());
        }
    }
}

impl BrokenSteps {
    fn inner(&mut self) -> &mut Box<dyn SessionSteps> {
        self.inner.as_mut().expect("present until drop")
    }

    /// Rewrites the last cache positions before `position` with other tokens' keys and values.
    fn corrupt_cache(&mut self, position: usize) -> Result<()> {
        let count = CORRUPTED_POSITIONS.min(position);
        let start = position - count;
        let wrong: Vec<u32> = self.history[start..position].iter().map(|&t| (t + 1) % self.vocab_size as u32).collect();
        self.inner().truncate(start)?;
        if !wrong.is_empty() {
            self.inner().append(start, StepInput::Tokens(&wrong), false)?;
        }
        Ok(())
    }

    /// Rewrites the last cache row before `position` from its token's embedding nudged toward the
    /// next token's.
    fn nudge_row(&mut self, position: usize) -> Result<()> {
        let (Some(table), Some(row)) = (self.embeddings.clone(), position.checked_sub(1)) else { return Ok(()) };
        let token = self.history[row];
        let other = (token + 1) % self.vocab_size as u32;
        let values: Vec<f32> =
            table.row(token).iter().zip(table.row(other)).map(|(&a, &b)| (1.0 - NUDGE) * a + NUDGE * b).collect();
        self.inner().truncate(row)?;
        self.inner().append(row, StepInput::Embeddings { values: &values, count: 1 }, false)?;
        Ok(())
    }
}

impl SessionSteps for BrokenSteps {
    fn append(&mut self, position: usize, input: StepInput<'_>, want_logits: bool) -> Result<RawStep> {
        let is_decode = position > 0 && matches!(input, StepInput::Tokens(t) if t.len() == 1);
        if is_decode && self.decodes == self.after_decodes {
            match self.breakage {
                Breakage::CorruptKv => self.corrupt_cache(position)?,
                Breakage::NudgeKvRow => self.nudge_row(position)?,
                Breakage::PanicInDecode => panic!("broken-panic: decode step {} blew up", self.decodes + 1),
                Breakage::LeakSessions | Breakage::WrongGreedyToken => {}
            }
        }
        let mut out = self.inner().append(position, input, want_logits)?;
        if self.breakage == Breakage::WrongGreedyToken && is_decode && self.decodes >= self.after_decodes {
            if let Some(logits) = &out.logits {
                let mut order: Vec<usize> = (0..logits.len()).collect();
                order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
                out.greedy_token = order.get(1).map(|&i| i as u32);
            }
        }
        self.history.truncate(position);
        match input {
            StepInput::Tokens(tokens) => self.history.extend_from_slice(tokens),
            // Embedding positions have no token id; the corruption then rewrites them with token 1's.
            StepInput::Embeddings { count, .. } => self.history.extend(std::iter::repeat_n(0, count)),
        }
        if is_decode {
            self.decodes += 1;
        }
        Ok(out)
    }
    fn truncate(&mut self, position: usize) -> Result<()> {
        self.inner().truncate(position)?;
        self.history.truncate(position);
        Ok(())
    }
    fn fork(&self, position: usize) -> Result<Box<dyn SessionSteps>> {
        let inner = self.inner.as_ref().expect("present until drop").fork(position)?;
        Ok(Box::new(BrokenSteps {
            inner: Some(inner),
            vocab_size: self.vocab_size,
            history: self.history[..position].to_vec(),
            decodes: self.decodes,
            breakage: self.breakage,
            after_decodes: self.after_decodes,
            embeddings: self.embeddings.clone(),
        }))
    }
    fn reset(&mut self, after_failure: bool) -> Result<()> {
        self.inner().reset(after_failure)?;
        self.history.clear();
        self.decodes = 0;
        Ok(())
    }
}
