//! The engine and the raw steps of its sessions, for any [`GraphRuntime`].
//!
//! ## Calls
//! An append of `n` rows at `p` runs in the calls of [`stablehlo_llama::plan_prefill`]: the
//! smallest bucket holding the rest of the rows, else the largest bucket full of real rows, padded
//! with zeros (the graphs mask padding rows and the positions after the real ones, which later
//! calls overwrite). A call never runs past the cache's end (the graphs' `dynamic_update_slice`
//! would clamp its offset), so near the end of the context single rows go through the one-row
//! graph. Only the last call of an append reads its logits back, and only when they are wanted.
//!
//! ## Sequence state
//! Attention reads only cache positions below the call's own, so a rewind is the position alone:
//! stale entries after it are masked and overwritten by the next call. A fork copies the cache;
//! a reset after a failure replaces it (the failed call may have consumed it). A closed session's
//! cache is zeroed in place and kept for the next new session ([`IDLE_CACHES`], ADR 0046):
//! zeroed rather than handed on stale, so that no entry of one session, however it came out,
//! ever meets another's arithmetic.

use crate::runtime::{BatchCall, GraphCall, GraphInput, GraphRuntime};
use session_api::{
    BatchedStep, Capabilities, Engine, EngineInfo, RawStep, Result, SeamError, SessionOptions, SessionSteps, StepInput,
};
use stablehlo_llama::{plan_prefill, plan_prefill_embeddings, GraphKind, GraphSpec, PaddingCost};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The context a session holds when the load request names none (capped by the model's
/// `max_position_embeddings`). Decode cost grows with it: every step attends over the whole
/// cache with a mask, so it is kept moderate.
pub const DEFAULT_MAX_CONTEXT: usize = 2048;

/// The capabilities of a graph engine with a context of `max_context` on a runtime that does (or
/// does not) run batched decode graphs ([`GraphRuntime::decodes_batches`]): everything the
/// contract names. Greedy runs on the device (4 bytes back per step); the other modes read the
/// step's logits back and session-api's sampler picks the token on the host. Sessions may be
/// driven from many threads at once; every call already uses all the runtime's threads, so they
/// take turns in effect.
pub fn capabilities_with(max_context: usize, batched_decode: bool) -> Capabilities {
    Capabilities { batched_decode, logits_per_position: true, ..Capabilities::all(max_context) }
}

/// The batch sizes of the batched decode graphs, largest first. A batch of another size runs as
/// a few of these ([`split_batch`]): a handful of graphs to compile and cache instead of one per
/// size, with no padding sequences (a padding sequence would need a whole cache of its own).
pub const DECODE_BATCHES: [usize; 4] = [16, 8, 4, 2];

/// How a batch of `n` sequences is cut into calls: the largest [`DECODE_BATCHES`] size that fits
/// first, then the next, a lone sequence last (the one-token decode graph). 7 is `[4, 2, 1]`, 40
/// is `[16, 16, 8]`.
pub fn split_batch(n: usize) -> Vec<usize> {
    let mut calls = Vec::new();
    let mut left = n;
    while left > 0 {
        let size = DECODE_BATCHES.iter().copied().find(|&size| size <= left).unwrap_or(1);
        calls.push(size);
        left -= size;
    }
    calls
}

/// The batched decode graph of `batch` sequences, which an engine loads (as a group of its own)
/// the first time it decodes a batch that size.
pub fn batch_graph(batch: usize) -> GraphSpec {
    graph_of(GraphKind::DecodeBatch { batch })
}

/// How many closed sessions' caches (zeroed) an engine keeps for its next new sessions: enough
/// for sessions that follow one another (a server's requests, a benchmark's repeats) without
/// holding a burst's worth of caches for ever.
pub const IDLE_CACHES: usize = 2;

/// What an engine and its sessions share.
pub(crate) struct Shared<R: GraphRuntime> {
    /// Caches of closed sessions, zeroed ([`GraphRuntime::zero_cache`]), for new sessions to
    /// take before asking the runtime for a new one; at most [`IDLE_CACHES`]. Declared before
    /// the runtime, so dropped before it, as a session's cache is.
    pub idle_caches: Mutex<Vec<R::Cache>>,
    pub runtime: R,
    /// Prefill buckets of the token graphs (decode is the one-token graph).
    pub buckets: Vec<usize>,
    /// What a padding row of the smallest bucket's calls costs, which decides whether a few
    /// tokens go through decode steps or one padded call ([`plan_prefill`]).
    pub padding: PaddingCost,
    pub max_context: usize,
    pub hidden_size: usize,
    /// Buckets of the embedding graphs loaded so far (they are compiled on first use).
    pub embedding_graphs: Mutex<Vec<usize>>,
    /// Token graphs loaded so far: all of them at load, or only decode where the runtime loads
    /// graphs one by one ([`GraphRuntime::loads_graphs_separately`]), the prefill buckets then
    /// on first use.
    pub token_graphs: Mutex<Vec<GraphSpec>>,
}

impl<R: GraphRuntime> Shared<R> {
    /// Loads the token graph `graph` the first time it is needed.
    fn ensure_token_graph(&self, graph: GraphSpec) -> Result<()> {
        let mut loaded = self.token_graphs.lock().unwrap_or_else(|p| p.into_inner());
        if !loaded.contains(&graph) {
            self.runtime.load_graphs(&[graph])?;
            loaded.push(graph);
        }
        Ok(())
    }

    /// Loads the embedding graph of `bucket` the first time it is needed.
    fn ensure_embedding_graph(&self, bucket: usize) -> Result<()> {
        let mut loaded = self.embedding_graphs.lock().unwrap_or_else(|p| p.into_inner());
        if !loaded.contains(&bucket) {
            self.runtime.load_graphs(&[embedding_graph(bucket)])?;
            loaded.push(bucket);
        }
        Ok(())
    }

    /// One batched decode call over `steps` (two or more, a [`DECODE_BATCHES`] size).
    fn decode_batch(&self, steps: &mut [BatchSequence<'_, R>], want_logits: bool) -> Result<Vec<RawStep>> {
        let graph = batch_graph(steps.len());
        self.ensure_token_graph(graph)?;
        let call = BatchCall {
            graph,
            tokens: steps.iter().map(|s| s.token as i32).collect(),
            positions: steps.iter().map(|s| s.position as i32).collect(),
            read_logits: want_logits,
        };
        let mut caches: Vec<&mut R::Cache> = steps.iter_mut().map(|s| s.steps.cache_mut()).collect();
        let outputs = self.runtime.execute_batch(&mut caches, &call)?;
        if outputs.len() != steps.len() {
            return Err(SeamError::Backend(format!(
                "{} returned {} outputs for {} sequences",
                graph.name(),
                outputs.len(),
                steps.len()
            )));
        }
        Ok(outputs
            .into_iter()
            .map(|output| RawStep { greedy_token: Some(output.token), logits: output.logits, hidden_states: None })
            .collect())
    }
}

/// One of the engine's own sequences in a batched decode: its steps, position and token.
struct BatchSequence<'a, R: GraphRuntime> {
    /// Where the sequence stands in the caller's batch.
    index: usize,
    steps: &'a mut GraphSteps<R>,
    position: usize,
    token: u32,
}

/// The graph of a planned call: every graph also returns the logits (read back only when asked).
fn graph_of(kind: GraphKind) -> GraphSpec {
    GraphSpec { kind, logits: true }
}

/// The token graphs: decode and one prefill per bucket above one. An engine loads them all up
/// front, or decode alone where its runtime loads graphs one by one (the rest on first use).
pub fn token_graphs(buckets: &[usize]) -> Vec<GraphSpec> {
    let mut graphs = vec![graph_of(GraphKind::Decode)];
    graphs.extend(buckets.iter().filter(|&&b| b > 1).map(|&bucket| graph_of(GraphKind::Prefill { bucket })));
    graphs
}

/// The embedding-input graph of `bucket` rows, which an engine loads (as a group of its own) the
/// first time a session appends embeddings through it.
pub fn embedding_graph(bucket: usize) -> GraphSpec {
    graph_of(GraphKind::PrefillEmbeddings { bucket })
}

/// The scoring graph of `bucket` (above one): a prefill that returns every row's logits, which an
/// engine loads (as a group of its own) the first time a session scores a text through it.
pub fn scoring_graph(bucket: usize) -> GraphSpec {
    graph_of(GraphKind::PrefillScored { bucket })
}

/// Every group of graphs an engine with prefill `buckets` may hand its runtime's
/// [`GraphRuntime::load_graphs`]: the token graphs at load, then each embedding graph alone, each
/// scoring graph alone, and each batched decode graph alone (loaded only where the runtime
/// [`decodes_batches`](GraphRuntime::decodes_batches)). A runtime that compiles ahead of time
/// (for a device it cannot reach now) compiles these groups, so that the engine later finds each
/// one in its cache.
pub fn graph_groups(buckets: &[usize]) -> Vec<Vec<GraphSpec>> {
    let mut groups = vec![token_graphs(buckets)];
    groups.extend(buckets.iter().map(|&bucket| vec![embedding_graph(bucket)]));
    groups.extend(buckets.iter().filter(|&&b| b > 1).map(|&bucket| vec![scoring_graph(bucket)]));
    groups.extend(DECODE_BATCHES.iter().rev().map(|&batch| vec![batch_graph(batch)]));
    groups
}

/// A model loaded on a [`GraphRuntime`].
pub struct GraphEngine<R: GraphRuntime> {
    pub(crate) shared: Arc<Shared<R>>,
    pub(crate) info: EngineInfo,
    pub(crate) compile_report: crate::CompileReport,
}

impl<R: GraphRuntime> GraphEngine<R> {
    /// How many graphs the load compiled and how many it read from the disk cache.
    pub fn compile_report(&self) -> crate::CompileReport {
        self.compile_report
    }

    /// The runtime the engine drives.
    pub fn runtime(&self) -> &R {
        &self.shared.runtime
    }

    pub(crate) fn set_load_time(&mut self, load_time: Duration) {
        self.info.load_time = load_time;
    }
}

impl<R: GraphRuntime> Engine for GraphEngine<R> {
    fn info(&self) -> EngineInfo {
        self.info.clone()
    }

    fn capabilities(&self) -> Capabilities {
        capabilities_with(self.shared.max_context, self.shared.runtime.decodes_batches())
    }

    fn prepare_for_serving(&self, sequences: usize) -> Result<()> {
        let shared = &self.shared;
        for graph in token_graphs(&shared.buckets) {
            shared.ensure_token_graph(graph)?;
        }
        if shared.runtime.decodes_batches() {
            for &batch in DECODE_BATCHES.iter().rev().filter(|&&batch| batch <= sequences) {
                shared.ensure_token_graph(batch_graph(batch))?;
            }
        }
        Ok(())
    }

    fn measure_memory_bandwidth(&self) -> Result<Option<f64>> {
        self.shared.runtime.measure_memory_bandwidth()
    }

    fn open_steps(&self, _options: &SessionOptions) -> Result<Box<dyn SessionSteps>> {
        let idle = self.shared.idle_caches.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let cache = match idle {
            Some(cache) => cache,
            None => self.shared.runtime.new_cache()?,
        };
        Ok(Box::new(GraphSteps { shared: Arc::clone(&self.shared), cache: Some(cache) }))
    }

    /// The batch in calls of [`split_batch`]'s sizes, each reading the weights once for all its
    /// sequences; steps that are not this engine's own (a test's fault-injecting wrapper) and a
    /// runtime without batched graphs step one by one. A failed call fails each of its sequences.
    fn decode_batch_steps(&self, batch: &mut [BatchedStep<'_>], want_logits: bool) -> Vec<Result<RawStep>> {
        let shared = &self.shared;
        let batches = shared.runtime.decodes_batches();
        let mut results: Vec<Option<Result<RawStep>>> = (0..batch.len()).map(|_| None).collect();
        let mut ours: Vec<BatchSequence<'_, R>> = Vec::with_capacity(batch.len());
        for (index, entry) in batch.iter_mut().enumerate() {
            let (position, token) = (entry.position, entry.token);
            let own = batches && entry.steps.as_any_mut().is_some_and(|steps| steps.is::<GraphSteps<R>>());
            if !own {
                results[index] = Some(entry.steps.append(position, StepInput::Tokens(&[token]), want_logits));
                continue;
            }
            let steps = entry.steps.as_any_mut().and_then(|steps| steps.downcast_mut::<GraphSteps<R>>());
            let steps = steps.unwrap_or_else(|| unreachable!("checked above"));
            ours.push(BatchSequence { index, steps, position, token });
        }
        let mut rest = ours.as_mut_slice();
        for size in split_batch(rest.len()) {
            let (call, after) = std::mem::take(&mut rest).split_at_mut(size);
            rest = after;
            if let [one] = call {
                let step = one.steps.append(one.position, StepInput::Tokens(&[one.token]), want_logits);
                results[one.index] = Some(step);
                continue;
            }
            match shared.decode_batch(call, want_logits) {
                Ok(steps) => {
                    for (sequence, step) in call.iter().zip(steps) {
                        results[sequence.index] = Some(Ok(step));
                    }
                }
                Err(error) => {
                    let message = error.to_string();
                    for sequence in call.iter() {
                        results[sequence.index] = Some(Err(SeamError::Backend(format!("batched decode: {message}"))));
                    }
                }
            }
        }
        results.into_iter().map(|r| r.unwrap_or_else(|| unreachable!("every entry is stepped"))).collect()
    }
}

/// One sequence: a cache on the device.
struct GraphSteps<R: GraphRuntime> {
    shared: Arc<Shared<R>>,
    /// `None` only while being dropped.
    cache: Option<R::Cache>,
}

impl<R: GraphRuntime> Drop for GraphSteps<R> {
    /// The cache goes to the engine's idle ones, zeroed, if there is room and the runtime can
    /// zero it in place; else it is freed.
    fn drop(&mut self) {
        let Some(mut cache) = self.cache.take() else { return };
        let shared = &self.shared;
        let room = || shared.idle_caches.lock().unwrap_or_else(|p| p.into_inner()).len() < IDLE_CACHES;
        // Zeroed before the lock is taken: a new session need not wait for it.
        if room() && matches!(shared.runtime.zero_cache(&mut cache), Ok(true)) {
            let mut idle = shared.idle_caches.lock().unwrap_or_else(|p| p.into_inner());
            if idle.len() < IDLE_CACHES {
                idle.push(cache);
            }
        }
    }
}

impl<R: GraphRuntime> GraphSteps<R> {
    fn cache_mut(&mut self) -> &mut R::Cache {
        self.cache.as_mut().unwrap_or_else(|| unreachable!("taken only by drop"))
    }

    /// The calls that append `input` at `position`, each padded to its graph's rows.
    fn plan(&self, position: usize, input: &StepInput<'_>) -> Result<Vec<GraphCall>> {
        let (buckets, max_context, hidden) = (&self.shared.buckets, self.shared.max_context, self.shared.hidden_size);
        let planned = match input {
            StepInput::Tokens(tokens) => {
                plan_prefill(position, tokens.len(), buckets, max_context, self.shared.padding)
            }
            StepInput::Embeddings { count, .. } => {
                plan_prefill_embeddings(position, *count, buckets, max_context, self.shared.padding)
            }
        }
        .map_err(|e| SeamError::Backend(format!("planning the calls: {e}")))?;
        let mut at = 0;
        let mut calls = Vec::with_capacity(planned.len());
        for call in planned {
            let (rows, real) = (call.graph.input_rows(), at..at + call.count);
            let input = match input {
                StepInput::Tokens(tokens) => {
                    let mut ids: Vec<i32> = tokens[real].iter().map(|&t| t as i32).collect();
                    ids.resize(rows, 0);
                    GraphInput::Tokens(ids)
                }
                StepInput::Embeddings { values, .. } => {
                    // Zero rows as padding: masked rows must still be finite (0 x inf is NaN).
                    let mut padded = values[real.start * hidden..real.end * hidden].to_vec();
                    padded.resize(rows * hidden, 0.0);
                    GraphInput::Embeddings(padded)
                }
            };
            let graph = graph_of(call.graph);
            calls.push(GraphCall { graph, input, position: position + at, count: call.count, read_logits: false });
            at += call.count;
        }
        Ok(calls)
    }
}

impl<R: GraphRuntime> SessionSteps for GraphSteps<R> {
    fn append(&mut self, position: usize, input: StepInput<'_>, want_logits: bool) -> Result<RawStep> {
        let mut calls = self.plan(position, &input)?;
        if let Some(last) = calls.last_mut() {
            last.read_logits = want_logits;
        }
        let mut output = None;
        for call in &calls {
            match call.graph.kind {
                GraphKind::PrefillEmbeddings { bucket } => self.shared.ensure_embedding_graph(bucket)?,
                _ => self.shared.ensure_token_graph(call.graph)?,
            }
            let cache = self.cache.as_mut().unwrap_or_else(|| unreachable!("taken only by drop"));
            output = Some(self.shared.runtime.execute(cache, call)?);
        }
        let output = output.ok_or(SeamError::EmptyInput)?;
        Ok(RawStep { greedy_token: Some(output.token), logits: output.logits, hidden_states: None })
    }

    /// The calls of a prefill, each prefill bucket's through its scoring graph (a lone decode step
    /// returns its one row as it is), every row of logits read back and the padding rows dropped.
    fn append_scoring(&mut self, position: usize, tokens: &[u32]) -> Result<RawStep> {
        let calls = self.plan(position, &StepInput::Tokens(tokens))?;
        let mut logits = Vec::new();
        let mut token = None;
        for mut call in calls {
            if let GraphKind::Prefill { bucket } = call.graph.kind {
                call.graph = scoring_graph(bucket);
            }
            call.read_logits = true;
            self.shared.ensure_token_graph(call.graph)?;
            let cache = self.cache.as_mut().unwrap_or_else(|| unreachable!("taken only by drop"));
            let output = self.shared.runtime.execute(cache, &call)?;
            let rows = call.graph.kind.logit_rows();
            let all = output.logits.unwrap_or_default();
            if all.is_empty() || all.len() % rows != 0 {
                return Err(SeamError::Backend(format!(
                    "{} returned {} logits for {rows} rows",
                    call.graph.name(),
                    all.len()
                )));
            }
            logits.extend_from_slice(&all[..call.count * (all.len() / rows)]);
            token = Some(output.token);
        }
        Ok(RawStep { greedy_token: token, logits: Some(logits), hidden_states: None })
    }

    fn truncate(&mut self, _position: usize) -> Result<()> {
        // Positions at and after `position` are masked for every later call and overwritten by
        // the next append: nothing to do on the device.
        Ok(())
    }

    fn fork(&self, _position: usize) -> Result<Box<dyn SessionSteps>> {
        let own = self.cache.as_ref().unwrap_or_else(|| unreachable!("taken only by drop"));
        let cache = self.shared.runtime.copy_cache(own)?;
        Ok(Box::new(GraphSteps { shared: Arc::clone(&self.shared), cache: Some(cache) }))
    }

    fn reset(&mut self, after_failure: bool) -> Result<()> {
        // A healthy cache keeps its stale entries (masked); one a failed call may have consumed
        // or half-written is replaced.
        if after_failure {
            self.cache = Some(self.shared.runtime.new_cache()?);
        }
        Ok(())
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_split_into_graph_sizes_largest_first() {
        assert_eq!(split_batch(0), Vec::<usize>::new());
        assert_eq!(split_batch(1), vec![1]);
        assert_eq!(split_batch(2), vec![2]);
        assert_eq!(split_batch(7), vec![4, 2, 1]);
        assert_eq!(split_batch(16), vec![16]);
        assert_eq!(split_batch(40), vec![16, 16, 8]);
        for n in 0..100 {
            let calls = split_batch(n);
            assert_eq!(calls.iter().sum::<usize>(), n);
            assert!(calls.iter().all(|&size| size == 1 || DECODE_BATCHES.contains(&size)));
        }
    }
}
