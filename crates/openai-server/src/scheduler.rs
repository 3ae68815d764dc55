//! Continuous batching: one engine thread that admits requests between steps, interleaves their
//! prompts in chunks with the running decodes, and decodes every running sequence in one batched
//! call per step.
//!
//! The thread owns a pool of sessions (one per slot, reused across requests so a device cache is
//! allocated once) and everything about the running requests. The HTTP side talks to it through
//! [`Scheduler::submit`], which refuses work beyond the bounded queue at once (all of a request's
//! sequences or none), and through each job's event channel: a dropped receiver (a client that
//! went away) cancels the job before the next step and frees its slot.

use crate::metrics::Metrics;
use session_api::batch::BatchEntry;
use session_api::generate::{Detokenizer, Generation, GenerationRequest, TokenEvent};
use session_api::logprobs::{token_logprobs, TokenLogprobs};
use session_api::stats::FinishReason;
use session_api::{CheckedSession, Engine, SeamError, Session, SessionOptions, StepOutput};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};
use tokio::sync::mpsc as tokio_mpsc;

/// Prompt tokens a new request must share with a running one to start from a copy of its
/// session: a fork copies the whole cache, which costs about what prefilling a few dozen tokens
/// does on a CPU.
pub const SHARE_FROM_RUNNING: usize = 64;

/// How the engine thread schedules.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Sequences decoded together at most (the batch size, and the sessions kept).
    pub slots: usize,
    /// Requests waiting for a slot at most; more are refused with [`SubmitError::QueueFull`].
    pub max_queue: usize,
    /// Prompt tokens prefilled per step for one request, so a long prompt does not stall the
    /// running decodes for the whole of its prefill.
    pub prefill_chunk: usize,
    /// Longest a request may run, queued time included; it then ends with [`End::TimeLimit`].
    pub request_time_limit: Duration,
}

/// One request for the engine thread.
pub struct Job {
    /// The prompt's token ids (not empty, shorter than the context).
    pub prompt: Vec<u32>,
    /// How to pick tokens (sampling, penalties), and whether the steps return their logits
    /// (set when `logprobs` is).
    pub options: SessionOptions,
    /// Log-probabilities to report, when asked.
    pub logprobs: Option<LogprobsRequest>,
    /// Generate nothing: only the prompt is read (and scored); a completion's `echo` with
    /// `max_tokens` 0.
    pub prompt_only: bool,
    /// When to stop (the engine thread takes it when the request gets a slot).
    pub generation: GenerationRequest,
    /// Where the request's events go.
    pub events: tokio_mpsc::UnboundedSender<JobEvent>,
}

impl Job {
    /// Whether the prompt is scored (each of its positions' logits kept).
    fn scores_prompt(&self) -> bool {
        self.logprobs.is_some_and(|l| l.prompt)
    }
}

/// What log-probabilities a request reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogprobsRequest {
    /// The most likely alternatives reported beside each token.
    pub top: usize,
    /// Also score the prompt (every prompt token after the first, under what precedes it): the
    /// prompt is then read in scored prefills (`Session::prefill_scored`), or one token per
    /// decode step beside the running decodes where the engine does not claim
    /// `logits_per_position`.
    pub prompt: bool,
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The generation's own reason (EOS, stop string, token limit, full context).
    Finished(FinishReason),
    /// The request ran past [`SchedulerConfig::request_time_limit`].
    TimeLimit,
}

/// What the engine thread tells a request.
#[derive(Debug)]
pub enum JobEvent {
    /// The prompt's log-probabilities, from its second token on; sent once the prompt is read,
    /// before any token, when the request scores its prompt.
    PromptLogprobs(Vec<TokenLogprobs>),
    /// A token and the text that became final with it (the token's log-probabilities when
    /// asked for; none for an event that only releases held-back text).
    Token(TokenEvent, Option<TokenLogprobs>),
    /// The request ended; nothing follows.
    Done {
        /// Why.
        end: End,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Generated tokens (an ending EOS id included).
        completion_tokens: usize,
    },
    /// The backend failed; nothing follows.
    Failed(SeamError),
}

/// Why [`Scheduler::submit`] refused a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitError {
    /// The queue holds [`SchedulerConfig::max_queue`] requests already.
    QueueFull,
    /// The server is shutting down.
    ShuttingDown,
}

/// The handle the HTTP side holds.
#[derive(Clone)]
pub struct Scheduler {
    sender: mpsc::Sender<Job>,
    queued: Arc<AtomicUsize>,
    max_queue: usize,
    closing: Arc<AtomicBool>,
}

impl Scheduler {
    /// Starts the engine thread on `engine`. The thread ends when every handle is dropped and the
    /// running requests are done.
    pub fn start(
        engine: Arc<dyn Engine>,
        detokenizer: Arc<dyn Detokenizer>,
        config: SchedulerConfig,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<(Scheduler, std::thread::JoinHandle<()>)> {
        let (sender, receiver) = mpsc::channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let max_queue = config.max_queue;
        let capabilities = engine.capabilities();
        let thread = EngineThread {
            scores_in_prefill: capabilities.logits_per_position,
            forks: capabilities.kv_ops.fork,
            engine,
            detokenizer,
            config,
            metrics,
            receiver,
            queued: Arc::clone(&queued),
            waiting: VecDeque::new(),
            running: Vec::new(),
            free: Vec::new(),
        };
        let handle = std::thread::Builder::new().name("seam-engine".into()).spawn(move || thread.run())?;
        Ok((Scheduler { sender, queued, max_queue, closing: Arc::new(AtomicBool::new(false)) }, handle))
    }

    /// Queues every job of one request (one per sequence it asks for), or none of them: refused
    /// at once when the queue has no room for all, or the server is closing.
    pub fn submit(&self, jobs: Vec<Job>) -> Result<(), SubmitError> {
        if self.closing.load(Ordering::SeqCst) {
            return Err(SubmitError::ShuttingDown);
        }
        let count = jobs.len();
        let admitted = self
            .queued
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n + count <= self.max_queue).then_some(n + count))
            .is_ok();
        if !admitted {
            return Err(SubmitError::QueueFull);
        }
        for (sent, job) in jobs.into_iter().enumerate() {
            if self.sender.send(job).is_err() {
                // The engine thread is gone; the jobs sent before went with it.
                self.queued.fetch_sub(count - sent, Ordering::SeqCst);
                return Err(SubmitError::ShuttingDown);
            }
        }
        Ok(())
    }

    /// Requests waiting at most (sequences: a request for `n` choices, or several prompts,
    /// counts once per sequence).
    pub fn max_queue(&self) -> usize {
        self.max_queue
    }

    /// Refuses new jobs from now on; running and queued ones go on to their end.
    pub fn close(&self) {
        self.closing.store(true, Ordering::SeqCst);
    }

    /// Whether new jobs are taken (false once [`Scheduler::close`] was called).
    pub fn is_open(&self) -> bool {
        !self.closing.load(Ordering::SeqCst)
    }

    /// Requests waiting for a slot.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }
}

/// A queued job and when it arrived.
struct Waiting {
    job: Job,
    arrived: Instant,
}

/// A request holding a slot.
struct Running {
    job: Job,
    session: CheckedSession,
    generation: Generation,
    arrived: Instant,
    /// Prompt tokens in the session so far (prefilled, or kept from an earlier request).
    prefilled: usize,
    /// Prompt tokens kept from an earlier request.
    reused: usize,
    /// Every token in the session's cache, in order: what a later request may reuse.
    cached: Vec<u32>,
    /// The token to feed back next (set once the prompt is in).
    next: Option<u32>,
    /// The prompt's log-probabilities so far, when the request scores its prompt.
    prompt_logprobs: Vec<TokenLogprobs>,
    /// The prompt is scored one token per decode step (the engine's prefills return the last
    /// position's logits only).
    scores_stepwise: bool,
    /// When the last token was produced, for per-token latency.
    last_token_at: Option<Instant>,
}

impl Running {
    /// The token this request feeds to the next batched decode: the last token it got, or, when
    /// all of its prompt but the last token is in its session already (a reused prefix), that
    /// last prompt token: a one-token prefill is a decode step, so it joins the others' batch
    /// instead of taking a step of its own between theirs.
    fn batch_token(&self) -> Option<u32> {
        let prompt = &self.job.prompt;
        let feeds_prompt = self.prefilled + 1 == prompt.len() || self.scores_stepwise;
        match self.next {
            Some(token) => Some(token),
            None if self.prefilled > 0 && self.prefilled < prompt.len() && feeds_prompt => Some(prompt[self.prefilled]),
            None => None,
        }
    }

    /// The log-probabilities of `token` under a step's logits, when the request reports them.
    fn logprobs_of(&self, output: &StepOutput, token: u32) -> Option<TokenLogprobs> {
        let request = self.job.logprobs?;
        output.logits.as_deref().map(|logits| token_logprobs(logits, token, request.top))
    }
}

struct EngineThread {
    engine: Arc<dyn Engine>,
    /// The engine's prefills return every position's logits (`logits_per_position`), read once.
    scores_in_prefill: bool,
    /// The engine forks sessions (`kv_ops.fork`), read once.
    forks: bool,
    detokenizer: Arc<dyn Detokenizer>,
    config: SchedulerConfig,
    metrics: Arc<Metrics>,
    receiver: mpsc::Receiver<Job>,
    queued: Arc<AtomicUsize>,
    waiting: VecDeque<Waiting>,
    running: Vec<Running>,
    /// Sessions of finished requests, kept for the next ones, each with the tokens its cache
    /// holds.
    free: Vec<(CheckedSession, Vec<u32>)>,
}

impl EngineThread {
    fn run(mut self) {
        loop {
            if !self.take_jobs() {
                return;
            }
            self.drop_abandoned();
            self.admit();
            self.prefill_one_chunk();
            self.decode_step();
            self.metrics.running.set(self.running.len() as i64);
            self.metrics.queue_depth.set(self.waiting.len() as i64);
        }
    }

    /// Moves arrived jobs into the waiting queue, blocking while there is nothing to do. Returns
    /// false when every handle is gone and no work is left.
    fn take_jobs(&mut self) -> bool {
        if self.running.is_empty() && self.waiting.is_empty() {
            match self.receiver.recv() {
                Ok(job) => self.waiting.push_back(Waiting { job, arrived: Instant::now() }),
                Err(_) => return false,
            }
        }
        while let Ok(job) = self.receiver.try_recv() {
            self.waiting.push_back(Waiting { job, arrived: Instant::now() });
        }
        true
    }

    /// Forgets queued requests whose client went away and ends running ones that did or that ran
    /// out of time, freeing their slots before the next step.
    fn drop_abandoned(&mut self) {
        let before = self.waiting.len();
        let limit = self.config.request_time_limit;
        self.waiting.retain(|w| !w.job.events.is_closed() && w.arrived.elapsed() < limit);
        let dropped = before - self.waiting.len();
        if dropped > 0 {
            self.queued.fetch_sub(dropped, Ordering::SeqCst);
            self.metrics.cancelled.inc_by(dropped as u64);
        }
        let mut i = 0;
        while i < self.running.len() {
            let running = &self.running[i];
            if running.job.events.is_closed() {
                self.metrics.cancelled.inc();
                let running = self.running.swap_remove(i);
                self.release(running.session, running.cached);
            } else if running.arrived.elapsed() >= limit {
                self.end(i, End::TimeLimit);
            } else {
                i += 1;
            }
        }
    }

    /// Gives free slots to waiting requests, in arrival order. A request takes the kept session
    /// whose cache shares the longest prefix with its prompt and prefills only the rest (a chat
    /// resending its conversation, many requests with one system prompt), as llama-server's
    /// prompt cache does; its last prompt token is always prefilled, for the first token's logits.
    ///
    /// Where the engine forks sessions, a running request's cache is a source too: a request
    /// sharing at least [`SHARE_FROM_RUNNING`] prompt tokens with a running one starts from a copy
    /// of its session (the `n` choices of one prompt, requests with one long system prompt at
    /// once). One whose shared prefix the running request is still reading waits for it, while
    /// the requests behind it are admitted.
    fn admit(&mut self) {
        let (scores_in_prefill, forks) = (self.scores_in_prefill, self.forks);
        let mut k = 0;
        while self.running.len() < self.config.slots && k < self.waiting.len() {
            let job = &self.waiting[k].job;
            let scores_prompt = job.scores_prompt();
            // A scored prompt keeps nothing: each of its positions' logits are needed. Any other
            // prompt prefills at least its last token, for the first token's logits.
            let most = if scores_prompt { 0 } else { job.prompt.len().saturating_sub(1) };
            let shareable = |running: &Running| shared_prefix(&running.job.prompt, &job.prompt).min(most);
            let reading = self.running.iter().any(|r| {
                let shared = shareable(r);
                forks && shared >= SHARE_FROM_RUNNING && r.prefilled < shared
            });
            if reading {
                k += 1;
                continue;
            }
            let Waiting { mut job, arrived } = self.waiting.remove(k).expect("k is in the queue");
            self.queued.fetch_sub(1, Ordering::SeqCst);
            let scores_stepwise = scores_prompt && !scores_in_prefill;
            // (shared prefix, index) of the kept session sharing the most, and of the running one.
            let best =
                self.free.iter().enumerate().map(|(i, (_, cached))| (shared_prefix(cached, &job.prompt), i)).max();
            let from_running = self
                .running
                .iter()
                .enumerate()
                .map(|(i, r)| (shared_prefix(&r.cached, &job.prompt).min(most), i))
                .filter(|&(shared, _)| forks && shared >= SHARE_FROM_RUNNING)
                .max()
                .filter(|&(shared, _)| best.is_none_or(|(kept, _)| shared > kept.min(most)));
            let started = match (from_running, best) {
                (Some((shared, i)), _) => self.running[i].session.fork_checked().and_then(|mut session| {
                    session.restart_keeping(shared, job.options.clone()).map(|kept| (session, kept))
                }),
                (None, Some((shared, i))) => {
                    let (mut session, _) = self.free.swap_remove(i);
                    session.restart_keeping(shared.min(most), job.options.clone()).map(|kept| (session, kept))
                }
                (None, None) => self
                    .engine
                    .new_checked_session(SessionOptions::default())
                    .and_then(|mut session| session.restart(job.options.clone()).map(|()| (session, 0))),
            };
            match started {
                Ok((session, kept)) => self.running.push(Running {
                    generation: Generation::new(std::mem::take(&mut job.generation)),
                    cached: job.prompt[..kept].to_vec(),
                    job,
                    session,
                    arrived,
                    prefilled: kept,
                    reused: kept,
                    next: None,
                    prompt_logprobs: Vec::new(),
                    scores_stepwise,
                    last_token_at: None,
                }),
                Err(error) => {
                    self.metrics.failed.inc();
                    let _ = job.events.send(JobEvent::Failed(error));
                }
            }
        }
    }

    /// Prefills the next chunk of the earliest request still reading its prompt.
    fn prefill_one_chunk(&mut self) {
        let Some(i) = self.running.iter().position(|r| r.next.is_none() && r.batch_token().is_none()) else {
            return;
        };
        let running = &mut self.running[i];
        // A prompt scored stepwise: its first token alone; the decodes read the rest.
        let chunk = if running.scores_stepwise { 1 } else { self.config.prefill_chunk.max(1) };
        let (start, end) = (running.prefilled, (running.prefilled + chunk).min(running.job.prompt.len()));
        let tokens = &running.job.prompt[start..end];
        let step = match running.job.scores_prompt() && !running.scores_stepwise {
            // Every position's logits: each scores the prompt token after it.
            true => running.session.prefill_scored(tokens).map(|scored| {
                let request = running.job.logprobs.expect("a scored prompt asked for logprobs");
                let vocab = scored.logits.len() / tokens.len();
                let next = &running.job.prompt[start + 1..];
                let rows = scored.logits.chunks(vocab).zip(next);
                running.prompt_logprobs.extend(rows.map(|(row, &token)| token_logprobs(row, token, request.top)));
                scored.output
            }),
            false => running.session.prefill(tokens),
        };
        match step {
            Ok(output) => {
                running.cached.extend_from_slice(&running.job.prompt[start..end]);
                running.prefilled = end;
                self.prompt_step_done(i, output);
            }
            Err(error) => self.fail(i, error),
        }
    }

    /// Takes a step that read prompt tokens of request `i`: the next prompt token's
    /// log-probabilities while the prompt is scored; the first generated token once it is in.
    fn prompt_step_done(&mut self, i: usize, output: StepOutput) {
        let running = &mut self.running[i];
        let prompt = &running.job.prompt;
        if running.prefilled < prompt.len() {
            if running.scores_stepwise {
                if let Some(logprobs) = running.logprobs_of(&output, prompt[running.prefilled]) {
                    running.prompt_logprobs.push(logprobs);
                }
            }
            return;
        }
        self.prompt_done(i);
        let running = &mut self.running[i];
        if running.job.scores_prompt() {
            let scored = std::mem::take(&mut running.prompt_logprobs);
            let _ = running.job.events.send(JobEvent::PromptLogprobs(scored));
        }
        if running.job.prompt_only {
            return self.end(i, End::Finished(FinishReason::MaxTokens));
        }
        self.take_token(i, output);
    }

    /// Counts request `i`'s prompt as read in.
    fn prompt_done(&mut self, i: usize) {
        let running = &self.running[i];
        self.metrics.prompt_tokens.inc_by(running.job.prompt.len() as u64);
        self.metrics.prompt_tokens_reused.inc_by(running.reused as u64);
        self.metrics.time_to_first_token.observe(running.arrived.elapsed().as_secs_f64());
    }

    /// Decodes one token for every request past its prompt, and for every one whose prompt
    /// lacks only its last token ([`Running::batch_token`]), in one batched call.
    fn decode_step(&mut self) {
        let decoding: Vec<(usize, u32)> =
            (0..self.running.len()).filter_map(|i| self.running[i].batch_token().map(|token| (i, token))).collect();
        if decoding.is_empty() {
            return;
        }
        self.metrics.batch_size.observe(decoding.len() as f64);
        let results = {
            let mut entries: Vec<BatchEntry<'_>> = self
                .running
                .iter_mut()
                .filter_map(|r| r.batch_token().map(|token| BatchEntry { token, session: &mut r.session }))
                .collect();
            self.engine.decode_batch(&mut entries)
        };
        // Handled from the last so that removing a finished request keeps earlier indices valid.
        for (&(i, fed), result) in decoding.iter().zip(results).rev() {
            match result {
                Ok(output) => {
                    let running = &mut self.running[i];
                    running.cached.push(fed);
                    if running.next.is_none() {
                        // A prompt token (the last one, or the next of a scored prompt).
                        running.prefilled += 1;
                        self.prompt_step_done(i, output);
                    } else {
                        self.take_token(i, output)
                    }
                }
                Err(error) => self.fail(i, error),
            }
        }
    }

    /// Applies the stop rules to the token request `i`'s step returned, streams it, and either
    /// ends the request or arms it for the next decode.
    fn take_token(&mut self, i: usize, output: StepOutput) {
        let token = output.token;
        let logprobs = self.running[i].logprobs_of(&output, token);
        let running = &mut self.running[i];
        let now = Instant::now();
        if let Some(last) = running.last_token_at.replace(now) {
            self.metrics.inter_token_latency.observe(now.duration_since(last).as_secs_f64());
        }
        self.metrics.generation_tokens.inc();
        let accepted = match running.generation.accept(token, Some(self.detokenizer.as_ref())) {
            Ok(accepted) => accepted,
            Err(error) => return self.fail(i, error),
        };
        if let Some(event) = accepted.event {
            // A closed channel is noticed before the next step (`drop_abandoned`).
            let _ = running.job.events.send(JobEvent::Token(event, logprobs));
        }
        let blocked =
            || running.generation.next_step_blocked(false, running.session.position(), running.session.capacity());
        match accepted.finished.or_else(blocked) {
            Some(reason) => self.end(i, End::Finished(reason)),
            None => running.next = Some(token),
        }
    }

    /// Ends request `i`: the held-back text, then `Done`; its session goes back to the pool.
    fn end(&mut self, i: usize, end: End) {
        let running = self.running.swap_remove(i);
        let prompt_tokens = running.job.prompt.len();
        match running.generation.finish(Some(self.detokenizer.as_ref())) {
            Ok((tokens, _text, held_back)) => {
                if let Some(event) = held_back {
                    let _ = running.job.events.send(JobEvent::Token(event, None));
                }
                self.metrics.completed.inc();
                self.metrics.request_duration.observe(running.arrived.elapsed().as_secs_f64());
                let _ = running.job.events.send(JobEvent::Done { end, prompt_tokens, completion_tokens: tokens.len() });
            }
            Err(error) => {
                self.metrics.failed.inc();
                let _ = running.job.events.send(JobEvent::Failed(error));
            }
        }
        self.release(running.session, running.cached);
    }

    /// Ends request `i` with a backend failure.
    fn fail(&mut self, i: usize, error: SeamError) {
        let running = self.running.swap_remove(i);
        self.metrics.failed.inc();
        let _ = running.job.events.send(JobEvent::Failed(error));
        // A failed step poisoned the session: nothing in its cache is kept.
        self.release(running.session, Vec::new());
    }

    /// Keeps a finished request's session, with the tokens its cache holds, for the next one
    /// (restarted when it is taken, which also rebuilds a poisoned one's state).
    fn release(&mut self, session: CheckedSession, cached: Vec<u32>) {
        if self.free.len() < self.config.slots {
            self.free.push((session, cached));
        }
    }
}

/// How many leading tokens `a` and `b` share.
fn shared_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
