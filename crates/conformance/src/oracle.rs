//! The oracle: the reference backend, asked for logits, its runs cached for the whole suite run
//! (every backend under test is held against the same reference streams).

use crate::models::TestModel;
use crate::stream::{Driver, Trace};
use crate::tolerance::top2_margin;
use session_api::{Backend, Engine, LoadRequest, SessionOptions, WeightFormat};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// A reference run: its trace (with logits) and the top-2 margin of each step.
#[derive(Debug, Clone)]
pub struct OracleRun {
    /// Tokens and logits of each step.
    pub trace: Trace,
    /// `top1 - top2` of each step's logits.
    pub margins: Vec<f32>,
}

type RunKey = (PathBuf, WeightFormat, Vec<u32>, Continuation);

/// How a reference run continues after its prompt.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Continuation {
    /// Free-running greedy for this many steps.
    Greedy(usize),
    /// Teacher-forced: after step `i` decode `tokens[i]` (one step per token).
    Forced(Vec<u32>),
}

/// The reference backend as an oracle.
pub struct Oracle {
    backend: Box<dyn Backend>,
    engines: Mutex<HashMap<(PathBuf, WeightFormat), Arc<dyn Engine>>>,
    runs: Mutex<HashMap<RunKey, Arc<OracleRun>>>,
}

impl Oracle {
    /// The oracle, built on the registered `reference` backend.
    pub fn new() -> Result<Oracle, String> {
        backend_reference::link();
        let backend = session_api::find_backend("reference").map_err(|e| format!("the reference backend: {e}"))?;
        Ok(Oracle { backend, engines: Mutex::default(), runs: Mutex::default() })
    }

    /// The reference engine for `model` in `format`, loaded once.
    pub fn engine(&self, model: &TestModel, format: WeightFormat) -> Result<Arc<dyn Engine>, String> {
        let key = (model.dir.clone(), format);
        if let Some(engine) = self.engines.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
            return Ok(engine.clone());
        }
        let engine = self
            .backend
            .load(&LoadRequest::new(&model.dir, format))
            .map_err(|e| format!("the reference could not load {} ({format}): {e}", model.name))?;
        self.engines.lock().unwrap_or_else(|p| p.into_inner()).insert(key, engine.clone());
        Ok(engine)
    }

    /// The reference's run of `prompt` then `continuation` on `model` in `format`, with logits.
    pub fn run(
        &self,
        model: &TestModel,
        format: WeightFormat,
        prompt: &[u32],
        continuation: Continuation,
    ) -> Result<Arc<OracleRun>, String> {
        let key: RunKey = (model.dir.clone(), format, prompt.to_vec(), continuation.clone());
        if let Some(run) = self.runs.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
            return Ok(run.clone());
        }
        let engine = self.engine(model, format)?;
        let options = SessionOptions { return_logits: true, ..SessionOptions::default() };
        let session = engine.new_session(options).map_err(|e| format!("the reference refused a session: {e}"))?;
        let (mut driver, steps) = match &continuation {
            Continuation::Greedy(steps) => (Driver::free(session, "reference"), *steps),
            Continuation::Forced(tokens) => (Driver::forced(session, tokens, "reference"), tokens.len()),
        };
        driver.run(prompt, steps).map_err(|v| format!("the reference failed: {}", v.detail))?;
        let trace = driver.trace;
        if trace.logits().is_none() {
            return Err("the reference returned no logits although asked to".into());
        }
        let margins = trace.logits.iter().map(|l| top2_margin(l)).collect();
        let run = Arc::new(OracleRun { trace, margins });
        self.runs.lock().unwrap_or_else(|p| p.into_inner()).insert(key, run.clone());
        Ok(run)
    }

    /// Drops cached engines and runs of `model` (to release a real model's memory once done).
    pub fn forget(&self, model: &TestModel) {
        self.engines.lock().unwrap_or_else(|p| p.into_inner()).retain(|(dir, _), _| *dir != model.dir);
        self.runs.lock().unwrap_or_else(|p| p.into_inner()).retain(|(dir, ..), _| *dir != model.dir);
    }
}
