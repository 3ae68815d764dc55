//! The session: one sequence's state, token ids in, token ids out.
//!
//! Two traits, two audiences (as wgpu-core validates over wgpu-hal):
//! - [`Session`] is what callers use. Its only implementation is [`CheckedSession`], which
//!   enforces every rule of the contract (argument checks before any state changes, poisoning,
//!   `NotPrefilled`, capability refusal, position bookkeeping, sampling) once, for every backend.
//! - [`SessionSteps`] is what a backend implements: the raw steps, called only with arguments
//!   that were already checked. A backend cannot get a rule wrong because it never sees a call the
//!   rules would refuse.

use crate::capabilities::Capabilities;
use crate::error::{Result, SeamError};
use crate::sampling::{Penalties, Sampler, SamplingConfig};

/// How a session is created.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SessionOptions {
    /// How the next token is picked.
    pub sampling: SamplingConfig,
    /// Penalties on tokens already in the sequence, applied before the pick (greedy or
    /// sampled). Any penalty makes every step return its logits to the host.
    pub penalties: Penalties,
    /// Added to the logits of these tokens before the pick, after the penalties (OpenAI's
    /// `logit_bias`: -100 bans a token in effect, 100 all but forces it). Token ids must be in
    /// the vocabulary and biases finite. Any bias makes every step return its logits to the host.
    pub logit_bias: Vec<(u32, f32)>,
    /// Return the logits of the last position of each step in [`StepOutput::logits`].
    /// Needs [`Capabilities::logits`].
    pub return_logits: bool,
    /// Return the last position's hidden state after each decoder layer in
    /// [`StepOutput::hidden_states`]. Needs [`Capabilities::hidden_states`].
    pub return_hidden_states: bool,
}

impl SessionOptions {
    /// What these options need of a backend, as capabilities (everything else off).
    pub fn required_capabilities(&self) -> Capabilities {
        Capabilities {
            sampling: self.sampling.required_modes(),
            logits: self.return_logits || self.adjusts_logits(),
            hidden_states: self.return_hidden_states,
            ..Capabilities::default()
        }
    }

    /// Whether the logits are changed before the pick (penalties or biases), which needs them on
    /// the host at every step.
    pub fn adjusts_logits(&self) -> bool {
        adjusts_logits(&self.penalties, &self.logit_bias)
    }

    /// Refuses a logit bias for a token outside a vocabulary of `vocab_size`.
    pub fn check_vocabulary(&self, vocab_size: usize) -> Result<()> {
        match self.logit_bias.iter().find(|(token, _)| *token as usize >= vocab_size) {
            Some(&(token, _)) => Err(SeamError::TokenOutOfVocabulary { token, vocab_size }),
            None => Ok(()),
        }
    }

    /// Refuses options that `capabilities` cannot honour, with a typed [`SeamError::Unsupported`]
    /// naming the first missing feature, and settings out of range with
    /// [`SeamError::InvalidInput`]. [`crate::Engine`]'s `new_session` calls it for every backend
    /// (and [`SessionOptions::check_vocabulary`] with the model's vocabulary), so refusal is
    /// uniform.
    pub fn check_against(&self, backend: &str, capabilities: &Capabilities) -> Result<()> {
        self.sampling.validate().map_err(SeamError::InvalidInput)?;
        self.penalties.validate().map_err(SeamError::InvalidInput)?;
        if let Some((token, bias)) = self.logit_bias.iter().find(|(_, bias)| !bias.is_finite()) {
            return Err(SeamError::InvalidInput(format!(
                "the logit bias of token {token} is {bias}: it must be finite"
            )));
        }
        match capabilities.missing(&self.required_capabilities()).first() {
            Some(feature) => Err(SeamError::unsupported(backend, *feature)),
            None => Ok(()),
        }
    }
}

/// Whether `penalties` or `logit_bias` change a step's logits before the pick: the one rule both
/// the options (what a session needs of a backend) and a session (what each step asks for) read.
fn adjusts_logits(penalties: &Penalties, logit_bias: &[(u32, f32)]) -> bool {
    !penalties.is_off() || !logit_bias.is_empty()
}

/// The result of one prefill or decode step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    /// The next token, chosen by the session's sampler from the last position's logits.
    pub token: u32,
    /// The last position's logits (`vocab_size` values), when the session was created with
    /// [`SessionOptions::return_logits`].
    pub logits: Option<Vec<f32>>,
    /// The last position's hidden state after each decoder layer (`num_hidden_layers` vectors of
    /// `hidden_size`, before the final norm), when the session was created with
    /// [`SessionOptions::return_hidden_states`].
    pub hidden_states: Option<Vec<Vec<f32>>>,
}

/// One sequence's state on a backend, as callers see it.
///
/// `prefill` appends tokens at [`Session::position`] (so calling it again extends the sequence,
/// which is chunked prefill), `decode` appends one token; both return the next token. A session is
/// `Send`: it may move between threads, but it is used by one caller at a time (`&mut self`).
///
/// Errors: an argument rejected before any state changed (empty input, a token id outside the
/// vocabulary, a sequence that would exceed [`Session::capacity`]) leaves the session as it was.
/// Any other failure of `prefill` or `decode` poisons the session: further calls return
/// [`SeamError::Poisoned`] until [`Session::reset`].
pub trait Session: Send {
    /// Appends `tokens` at the current position and returns the next token.
    fn prefill(&mut self, tokens: &[u32]) -> Result<StepOutput>;

    /// Appends one token (usually the one the last step returned) and returns the next token.
    fn decode(&mut self, token: u32) -> Result<StepOutput>;

    /// Number of positions filled so far.
    fn position(&self) -> usize;

    /// Most positions this session can hold.
    fn capacity(&self) -> usize;

    /// Empties the sequence, clears poisoning, and restarts the sampler's random stream.
    fn reset(&mut self);

    /// Rewinds to `position` (≤ the current position), dropping later state.
    /// Needs [`crate::KvOps::truncate`].
    fn truncate(&mut self, position: usize) -> Result<()>;

    /// A new session with a copy of this one's state; the two then evolve independently.
    /// Needs [`crate::KvOps::fork`].
    fn fork(&self) -> Result<Box<dyn Session>>;

    /// Appends `count` positions given as hidden-size embedding vectors (row-major,
    /// `count * hidden_size` values) instead of token ids, and returns the next token.
    /// Needs [`crate::InputKinds::embeddings`].
    fn prefill_embeddings(&mut self, embeddings: &[f32], count: usize) -> Result<StepOutput>;

    /// Appends `tokens` as [`Session::prefill`] does and also returns the logits of every one of
    /// their positions: what scoring a text needs (row `i` is the distribution of the token after
    /// `tokens[i]`). One step where the engine claims
    /// [`crate::Capabilities::logits_per_position`]; elsewhere one step per token. Needs
    /// [`crate::Capabilities::logits`].
    fn prefill_scored(&mut self, tokens: &[u32]) -> Result<ScoredStep>;

    /// Name of the backend that made this session (for error messages).
    fn backend_name(&self) -> &str;
}

/// What [`Session::prefill_scored`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredStep {
    /// The step's output, as `prefill` returns it (the token picked after the last position).
    pub output: StepOutput,
    /// The logits of every appended position, row after row (`tokens.len() * vocab_size`
    /// values).
    pub logits: Vec<f32>,
}

/// What one raw step appends.
#[derive(Debug, Clone, Copy)]
pub enum StepInput<'a> {
    /// Token ids, each `< vocab_size`, at least one.
    Tokens(&'a [u32]),
    /// `count >= 1` rows of `hidden_size` finite values.
    Embeddings { values: &'a [f32], count: usize },
}

impl StepInput<'_> {
    /// Positions this input fills.
    pub fn len(&self) -> usize {
        match self {
            StepInput::Tokens(tokens) => tokens.len(),
            StepInput::Embeddings { count, .. } => *count,
        }
    }

    /// Whether it fills no position (never true for an input a backend is given).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What a raw step returns: the device's greedy pick and/or the last position's logits.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RawStep {
    /// The argmax of the last position's logits, when the backend computed it (on a device,
    /// reading back 4 bytes instead of the logits).
    pub greedy_token: Option<u32>,
    /// The last position's logits; present whenever the step was asked for them.
    pub logits: Option<Vec<f32>>,
    /// The last position's hidden state after each decoder layer; present whenever the session
    /// was opened with [`SessionOptions::return_hidden_states`] (backends read that option in
    /// `open_steps`).
    pub hidden_states: Option<Vec<Vec<f32>>>,
}

/// The raw steps of one sequence: what a backend implements. [`CheckedSession`] calls them only
/// with arguments that passed the contract's checks, in a state the contract allows, and keeps
/// the position, the poisoning and the sampler itself.
pub trait SessionSteps: Send {
    /// Appends `input` at `position` (the number of positions filled so far). When `want_logits`
    /// is set the result must carry the logits; otherwise the greedy token is enough (logits may
    /// be returned anyway). On an error the caller poisons the session until [`SessionSteps::reset`].
    fn append(&mut self, position: usize, input: StepInput<'_>, want_logits: bool) -> Result<RawStep>;

    /// Appends `tokens` at `position` and returns the logits of every one of their positions, row
    /// after row (`tokens.len() * vocab_size` values), in [`RawStep::logits`], and the last row's
    /// greedy token when the backend computed it. Called only when the engine claims
    /// [`crate::Capabilities::logits_per_position`], never for a session opened with hidden states.
    fn append_scoring(&mut self, position: usize, tokens: &[u32]) -> Result<RawStep> {
        let _ = (position, tokens);
        Err(SeamError::Backend("logits of every position are claimed but not implemented".into()))
    }

    /// Forgets everything after `position` (< the filled positions). Called only when the engine
    /// claims [`crate::KvOps::truncate`].
    fn truncate(&mut self, position: usize) -> Result<()> {
        let _ = position;
        Err(SeamError::Backend("truncate is claimed but not implemented".into()))
    }

    /// A copy of the first `position` positions of this sequence, independent from then on.
    /// Called only when the engine claims [`crate::KvOps::fork`].
    fn fork(&self, position: usize) -> Result<Box<dyn SessionSteps>> {
        let _ = position;
        Err(SeamError::Backend("fork is claimed but not implemented".into()))
    }

    /// Empties the sequence. `after_failure` says an earlier step failed, so the state may be
    /// lost or half-written and must be rebuilt rather than reused.
    fn reset(&mut self, after_failure: bool) -> Result<()>;

    /// These steps as `Any`, so that an engine's batched decode
    /// ([`crate::Engine::decode_batch_steps`]) can find its own concrete steps among a batch's.
    /// The default, `None`, has such an engine step this sequence alone.
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }
}

/// The fixed facts a [`CheckedSession`] checks against, taken from its engine.
#[derive(Debug, Clone)]
pub struct SessionLimits {
    /// The backend's registry name, for errors.
    pub backend: String,
    /// Valid token ids are `0..vocab_size`.
    pub vocab_size: usize,
    /// Width of an embedding row.
    pub hidden_size: usize,
    /// The engine's capabilities (`max_context` is the session's capacity).
    pub capabilities: Capabilities,
}

/// The one implementation of [`Session`]: the contract's rules around a backend's
/// [`SessionSteps`]. Engines' sessions are made by [`crate::Engine`]'s `new_session`, which
/// builds one of these.
pub struct CheckedSession {
    steps: Box<dyn SessionSteps>,
    limits: SessionLimits,
    position: usize,
    sampler: Sampler,
    penalties: Penalties,
    logit_bias: Vec<(u32, f32)>,
    /// The token at each filled position (`u32::MAX` for an embedding row), for the penalties.
    tokens: Vec<u32>,
    /// Whether each filled position holds a generated token (see [`Penalties`]).
    generated: Vec<bool>,
    /// The token the last step returned, for the position it would fill; `None` after a
    /// failure, a reset or a truncate.
    last_returned: Option<u32>,
    return_logits: bool,
    return_hidden_states: bool,
    poisoned: Option<String>,
    /// The address of the engine that opened the steps, when one did: a batched decode hands
    /// the steps back to that engine only.
    engine: Option<usize>,
}

impl CheckedSession {
    /// Wraps a backend's raw steps of an empty sequence. `options` must have passed
    /// [`SessionOptions::check_against`] the same capabilities.
    pub fn new(steps: Box<dyn SessionSteps>, limits: SessionLimits, options: SessionOptions) -> CheckedSession {
        CheckedSession {
            steps,
            limits,
            position: 0,
            sampler: Sampler::new(options.sampling),
            penalties: options.penalties,
            logit_bias: options.logit_bias,
            tokens: Vec::new(),
            generated: Vec::new(),
            last_returned: None,
            return_logits: options.return_logits,
            return_hidden_states: options.return_hidden_states,
            poisoned: None,
            engine: None,
        }
    }

    /// Marks the steps as opened by the engine at address `engine` (see [`crate::batch`]).
    pub(crate) fn opened_by(mut self, engine: usize) -> CheckedSession {
        self.engine = Some(engine);
        self
    }

    /// The address of the engine that opened this session's steps.
    pub(crate) fn engine(&self) -> Option<usize> {
        self.engine
    }

    /// Empties the sequence (as [`Session::reset`]) and runs by `options` from now on (sampling,
    /// penalties, returned logits), so a server can reuse one session, and its device cache, for
    /// requests that ask differently. Refuses options the backend cannot run with the same
    /// errors as `new_session`, and hidden states other than the session was opened with (a
    /// backend prepares those when it opens the session), leaving the session as it was.
    pub fn restart(&mut self, options: SessionOptions) -> Result<()> {
        self.restart_keeping(0, options).map(|_| ())
    }

    /// As [`restart`](Self::restart), but keeps the first `keep` positions (a server reusing the
    /// prefix a new request shares with what this session holds): the sequence is truncated to
    /// `keep` instead of emptied. Where it cannot be kept (`keep` is 0 or past the filled
    /// positions, the session is poisoned, the backend cannot truncate, or the truncate fails)
    /// the sequence is emptied as by `restart`. Returns the positions kept. The kept positions
    /// count as prompt for the presence and frequency penalties.
    pub fn restart_keeping(&mut self, keep: usize, options: SessionOptions) -> Result<usize> {
        options.check_against(&self.limits.backend, &self.limits.capabilities)?;
        options.check_vocabulary(self.limits.vocab_size)?;
        if options.return_hidden_states != self.return_hidden_states {
            return Err(SeamError::InvalidInput(
                "hidden states are chosen when a session is opened; a restart cannot change them".into(),
            ));
        }
        self.sampler = Sampler::new(options.sampling);
        self.penalties = options.penalties;
        self.logit_bias = options.logit_bias;
        self.return_logits = options.return_logits;
        let keepable = keep > 0 && keep <= self.position && self.limits.capabilities.kv_ops.truncate;
        if keepable && self.truncate(keep).is_ok() {
            self.generated.iter_mut().for_each(|g| *g = false);
            return Ok(keep);
        }
        self.reset();
        Ok(0)
    }

    /// [`Session::fork`] as the concrete type, so that the copy can join the engine's batched
    /// decodes as its parent does (a server sharing a running request's prefix with a new one).
    pub fn fork_checked(&self) -> Result<CheckedSession> {
        if !self.limits.capabilities.kv_ops.fork {
            return Err(SeamError::unsupported(&self.limits.backend, "fork"));
        }
        self.refuse_if_poisoned()?;
        let steps = self.steps.fork(self.position)?;
        Ok(CheckedSession {
            steps,
            limits: self.limits.clone(),
            position: self.position,
            sampler: self.sampler.clone(),
            penalties: self.penalties,
            logit_bias: self.logit_bias.clone(),
            tokens: self.tokens.clone(),
            generated: self.generated.clone(),
            last_returned: self.last_returned,
            return_logits: self.return_logits,
            return_hidden_states: self.return_hidden_states,
            poisoned: None,
            engine: self.engine,
        })
    }

    /// Checks a decode of `token` as [`Session::decode`] does, changing nothing.
    pub(crate) fn check_decode(&self, token: u32) -> Result<()> {
        self.refuse_if_poisoned()?;
        if self.position == 0 {
            return Err(SeamError::NotPrefilled);
        }
        self.check_tokens(&[token])
    }

    /// Whether the logits are changed before the pick (penalties or biases).
    fn adjusts_logits(&self) -> bool {
        adjusts_logits(&self.penalties, &self.logit_bias)
    }

    /// Whether the next step must return logits (asked for, or needed to sample).
    pub(crate) fn wants_logits(&self) -> bool {
        self.return_logits || !matches!(self.sampler.config(), SamplingConfig::Greedy) || self.adjusts_logits()
    }

    /// The raw steps and the position they append at, for a batched decode.
    pub(crate) fn steps_at(&mut self) -> (&mut dyn SessionSteps, usize) {
        (self.steps.as_mut(), self.position)
    }

    fn refuse_if_poisoned(&self) -> Result<()> {
        match &self.poisoned {
            Some(cause) => Err(SeamError::Poisoned { cause: cause.clone() }),
            None => Ok(()),
        }
    }

    fn check_room(&self, count: usize) -> Result<()> {
        let requested = self.position.saturating_add(count);
        if requested > self.limits.capabilities.max_context {
            return Err(SeamError::ContextOverflow { requested, capacity: self.limits.capabilities.max_context });
        }
        Ok(())
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Err(SeamError::EmptyInput);
        }
        let vocab_size = self.limits.vocab_size;
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(SeamError::TokenOutOfVocabulary { token, vocab_size });
        }
        self.check_room(tokens.len())
    }

    /// Runs a checked step: poisons on a failure, advances the position and samples on success.
    fn run(&mut self, input: StepInput<'_>) -> Result<StepOutput> {
        let want_logits = self.wants_logits();
        let raw = self.steps.append(self.position, input, want_logits);
        self.complete(raw, input, want_logits)
    }

    /// Takes what a checked step appending `input` returned: poisons on a failure, advances the
    /// position and samples on success.
    pub(crate) fn complete(
        &mut self,
        raw: Result<RawStep>,
        input: StepInput<'_>,
        want_logits: bool,
    ) -> Result<StepOutput> {
        self.record(input);
        match raw.and_then(|raw| self.finish(raw, want_logits)) {
            Ok(output) => {
                self.position += input.len();
                self.last_returned = Some(output.token);
                Ok(output)
            }
            Err(error) => {
                self.forget_after(self.position);
                // Whatever the backend said, its state may have changed: nothing a backend
                // returns from a checked call is an argument rejected up front.
                self.poisoned = Some(error.to_string());
                Err(error)
            }
        }
    }

    /// Notes what `input` appends, before its step's token is picked (the penalties see it).
    fn record(&mut self, input: StepInput<'_>) {
        match input {
            StepInput::Tokens(tokens) => {
                for (i, &token) in tokens.iter().enumerate() {
                    self.generated.push(i == 0 && self.last_returned == Some(token));
                    self.tokens.push(token);
                }
            }
            StepInput::Embeddings { count, .. } => {
                self.tokens.resize(self.tokens.len() + count, u32::MAX);
                self.generated.resize(self.tokens.len(), false);
            }
        }
    }

    /// Forgets the tokens noted past `position`.
    fn forget_after(&mut self, position: usize) {
        self.tokens.truncate(position);
        self.generated.truncate(position);
        self.last_returned = None;
    }

    /// Checks what the backend returned and picks the token.
    fn finish(&mut self, raw: RawStep, want_logits: bool) -> Result<StepOutput> {
        let backend = &self.limits.backend;
        if let Some(logits) = &raw.logits {
            if logits.len() != self.limits.vocab_size {
                return Err(SeamError::Backend(format!(
                    "{backend} returned {} logits for a vocabulary of {}",
                    logits.len(),
                    self.limits.vocab_size
                )));
            }
            if let Some(at) = logits.iter().position(|v| !v.is_finite()) {
                // NaN or inf logits mean broken weights or a broken step: a token picked from them
                // would be confident garbage, different on every backend.
                return Err(SeamError::Backend(format!(
                    "{backend} returned a non-finite logit ({}) for token {at}",
                    logits[at]
                )));
            }
        } else if want_logits {
            return Err(SeamError::Backend(format!("{backend} returned no logits for a step that needs them")));
        }
        let token = match (self.sampler.config(), raw.greedy_token, &raw.logits) {
            (SamplingConfig::Greedy, Some(token), _) if !self.adjusts_logits() => token,
            (_, _, Some(logits)) if self.adjusts_logits() => {
                let mut adjusted = logits.clone();
                self.penalties.apply(&mut adjusted, &self.tokens, &self.generated);
                for &(token, bias) in &self.logit_bias {
                    adjusted[token as usize] += bias;
                }
                self.sampler.sample(&adjusted)
            }
            (_, _, Some(logits)) => self.sampler.sample(logits),
            _ => return Err(SeamError::Backend(format!("{backend} returned no logits to sample from"))),
        };
        if token as usize >= self.limits.vocab_size {
            return Err(SeamError::Backend(format!("{backend} returned token id {token}, outside the vocabulary")));
        }
        let hidden_states = if self.return_hidden_states {
            match raw.hidden_states {
                Some(states) => Some(states),
                None => {
                    return Err(SeamError::Backend(format!(
                        "{backend} returned no hidden states for a session that asked for them"
                    )))
                }
            }
        } else {
            None
        };
        Ok(StepOutput { token, logits: if self.return_logits { raw.logits } else { None }, hidden_states })
    }
}

impl Session for CheckedSession {
    fn prefill(&mut self, tokens: &[u32]) -> Result<StepOutput> {
        self.refuse_if_poisoned()?;
        self.check_tokens(tokens)?;
        self.run(StepInput::Tokens(tokens))
    }

    fn decode(&mut self, token: u32) -> Result<StepOutput> {
        self.check_decode(token)?;
        self.run(StepInput::Tokens(&[token]))
    }

    fn position(&self) -> usize {
        self.position
    }

    fn capacity(&self) -> usize {
        self.limits.capabilities.max_context
    }

    fn reset(&mut self) {
        self.position = 0;
        self.forget_after(0);
        self.sampler.restart();
        let after_failure = self.poisoned.is_some();
        self.poisoned = match self.steps.reset(after_failure) {
            Ok(()) => None,
            Err(e) => Some(format!("reset failed: {e}")),
        };
    }

    fn truncate(&mut self, position: usize) -> Result<()> {
        if !self.limits.capabilities.kv_ops.truncate {
            return Err(SeamError::unsupported(&self.limits.backend, "truncate"));
        }
        self.refuse_if_poisoned()?;
        if position > self.position {
            return Err(SeamError::InvalidInput(format!(
                "truncate to {position} is past the current position {}",
                self.position
            )));
        }
        if position < self.position {
            if let Err(error) = self.steps.truncate(position) {
                self.poisoned = Some(error.to_string());
                return Err(error);
            }
        }
        self.position = position;
        self.forget_after(position);
        Ok(())
    }

    fn fork(&self) -> Result<Box<dyn Session>> {
        Ok(Box::new(self.fork_checked()?))
    }

    fn prefill_embeddings(&mut self, embeddings: &[f32], count: usize) -> Result<StepOutput> {
        if !self.limits.capabilities.inputs.embeddings {
            return Err(SeamError::unsupported(&self.limits.backend, "prefill from embeddings"));
        }
        self.refuse_if_poisoned()?;
        if count == 0 {
            return Err(SeamError::EmptyInput);
        }
        let hidden = self.limits.hidden_size;
        if count.checked_mul(hidden) != Some(embeddings.len()) {
            return Err(SeamError::InvalidInput(format!(
                "{count} embeddings of hidden size {hidden} need {} values, got {}",
                count.saturating_mul(hidden),
                embeddings.len()
            )));
        }
        if let Some(at) = embeddings.iter().position(|v| !v.is_finite()) {
            return Err(SeamError::InvalidInput(format!(
                "embedding value {at} (row {}) is {}: embeddings must be finite",
                at / hidden.max(1),
                embeddings[at]
            )));
        }
        self.check_room(count)?;
        self.run(StepInput::Embeddings { values: embeddings, count })
    }

    fn prefill_scored(&mut self, tokens: &[u32]) -> Result<ScoredStep> {
        let backend = self.limits.backend.clone();
        if !self.limits.capabilities.logits {
            return Err(SeamError::unsupported(&backend, "returning logits"));
        }
        self.refuse_if_poisoned()?;
        self.check_tokens(tokens)?;
        let vocab = self.limits.vocab_size;
        if self.limits.capabilities.logits_per_position && !self.return_hidden_states {
            let raw = self.steps.append_scoring(self.position, tokens).and_then(|mut raw| {
                let all = raw.logits.take().unwrap_or_default();
                if all.len() != tokens.len() * vocab {
                    return Err(SeamError::Backend(format!(
                        "{backend} returned {} logits for {} positions of a vocabulary of {vocab}",
                        all.len(),
                        tokens.len()
                    )));
                }
                // The last row is checked as every step's logits are; the others here.
                if let Some(at) = all[..all.len() - vocab].iter().position(|v| !v.is_finite()) {
                    return Err(SeamError::Backend(format!(
                        "{backend} returned a non-finite logit ({}) at position {} for token {}",
                        all[at],
                        self.position + at / vocab,
                        at % vocab
                    )));
                }
                raw.logits = Some(all[all.len() - vocab..].to_vec());
                Ok((raw, all))
            });
            let (raw, logits) = match raw {
                Ok((raw, all)) => (Ok(raw), all),
                Err(error) => (Err(error), Vec::new()),
            };
            let output = self.complete(raw, StepInput::Tokens(tokens), true)?;
            return Ok(ScoredStep { output, logits });
        }
        // One step per token, each keeping its logits whatever the session returns otherwise.
        let returns_logits = std::mem::replace(&mut self.return_logits, true);
        let mut logits = Vec::with_capacity(tokens.len() * vocab);
        let mut scored = Ok(None);
        for token in tokens {
            match self.run(StepInput::Tokens(std::slice::from_ref(token))) {
                Ok(mut output) => {
                    logits.extend(output.logits.as_deref().unwrap_or_default());
                    if !returns_logits {
                        output.logits = None;
                    }
                    scored = Ok(Some(output));
                }
                Err(error) => {
                    scored = Err(error);
                    break;
                }
            }
        }
        self.return_logits = returns_logits;
        let output = scored?.expect("tokens is not empty");
        Ok(ScoredStep { output, logits })
    }

    fn backend_name(&self) -> &str {
        &self.limits.backend
    }
}

#[cfg(feature = "fault-injection")]
pub use fault::FailingSteps;

#[cfg(feature = "fault-injection")]
mod fault {
    use super::*;

    /// A decorator for tests (feature `fault-injection`): the next `append` runs on the backend,
    /// so its state changes, and then reports a failure, once, as a device error would. The
    /// contract says the session is then poisoned and that `reset` restores it, whatever the
    /// backend had done.
    pub struct FailingSteps {
        inner: Box<dyn SessionSteps>,
        armed: bool,
    }

    impl FailingSteps {
        /// Wraps `inner`, armed to fail its next step.
        pub fn new(inner: Box<dyn SessionSteps>) -> FailingSteps {
            FailingSteps { inner, armed: true }
        }
    }

    impl FailingSteps {
        /// What the wrapped step returned, or the injected failure when armed.
        fn fail_once(&mut self, result: Result<RawStep>) -> Result<RawStep> {
            if std::mem::take(&mut self.armed) {
                let ran = if result.is_ok() { "after the step ran" } else { "the step also failed" };
                return Err(SeamError::Backend(format!("injected fault ({ran})")));
            }
            result
        }
    }

    impl SessionSteps for FailingSteps {
        fn append(&mut self, position: usize, input: StepInput<'_>, want_logits: bool) -> Result<RawStep> {
            let result = self.inner.append(position, input, want_logits);
            self.fail_once(result)
        }
        fn append_scoring(&mut self, position: usize, tokens: &[u32]) -> Result<RawStep> {
            let result = self.inner.append_scoring(position, tokens);
            self.fail_once(result)
        }
        fn truncate(&mut self, position: usize) -> Result<()> {
            self.inner.truncate(position)
        }
        fn fork(&self, position: usize) -> Result<Box<dyn SessionSteps>> {
            self.inner.fork(position)
        }
        fn reset(&mut self, after_failure: bool) -> Result<()> {
            self.inner.reset(after_failure)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capabilities::{InputKinds, KvOps, SamplingModes};
    use crate::error::ErrorKind;

    /// Steps that remember what they were given and fail when told to.
    #[derive(Default)]
    struct Recorder {
        appended: Vec<(usize, usize)>,
        fail_next: bool,
        resets: Vec<bool>,
    }

    struct Shared(std::sync::Arc<std::sync::Mutex<Recorder>>);

    impl SessionSteps for Shared {
        fn append(&mut self, position: usize, input: StepInput<'_>, _: bool) -> Result<RawStep> {
            let mut r = self.0.lock().unwrap();
            if std::mem::take(&mut r.fail_next) {
                return Err(SeamError::InvalidInput("a backend's own complaint".into()));
            }
            r.appended.push((position, input.len()));
            Ok(RawStep { greedy_token: Some(3), logits: Some(vec![0.0; 10]), hidden_states: None })
        }
        fn truncate(&mut self, _: usize) -> Result<()> {
            Ok(())
        }
        fn reset(&mut self, after_failure: bool) -> Result<()> {
            self.0.lock().unwrap().resets.push(after_failure);
            Ok(())
        }
    }

    fn session(caps: Capabilities) -> (CheckedSession, std::sync::Arc<std::sync::Mutex<Recorder>>) {
        let record = std::sync::Arc::new(std::sync::Mutex::new(Recorder::default()));
        let limits = SessionLimits { backend: "test".into(), vocab_size: 10, hidden_size: 2, capabilities: caps };
        (CheckedSession::new(Box::new(Shared(record.clone())), limits, SessionOptions::default()), record)
    }

    fn caps(max_context: usize) -> Capabilities {
        Capabilities {
            max_context,
            sampling: SamplingModes::GREEDY_ONLY,
            kv_ops: KvOps { truncate: true, fork: false },
            inputs: InputKinds { tokens: true, embeddings: false },
            ..Capabilities::default()
        }
    }

    #[test]
    fn arguments_are_refused_before_the_backend_sees_them() {
        let (mut s, record) = session(caps(8));
        assert_eq!(s.prefill(&[]).unwrap_err().kind(), ErrorKind::InvalidInput);
        assert!(matches!(s.decode(1), Err(SeamError::NotPrefilled)));
        assert!(matches!(s.prefill(&[3, 10]), Err(SeamError::TokenOutOfVocabulary { token: 10, vocab_size: 10 })));
        assert!(matches!(s.prefill(&[1; 9]), Err(SeamError::ContextOverflow { requested: 9, capacity: 8 })));
        assert_eq!(s.prefill_embeddings(&[0.0; 2], 1).unwrap_err().kind(), ErrorKind::Unsupported);
        assert_eq!(s.fork().err().unwrap().kind(), ErrorKind::Unsupported);
        assert!(record.lock().unwrap().appended.is_empty());
        assert_eq!(s.prefill(&[1, 2]).unwrap().token, 3);
        assert!(matches!(s.prefill(&[1; 7]), Err(SeamError::ContextOverflow { requested: 9, capacity: 8 })));
        assert_eq!(s.decode(4).unwrap().token, 3);
        assert_eq!(record.lock().unwrap().appended, vec![(0, 2), (2, 1)]);
        assert_eq!(s.position(), 3);
    }

    #[test]
    fn any_backend_failure_poisons_until_reset_and_truncate_honours_it() {
        let (mut s, record) = session(caps(8));
        s.prefill(&[1, 2, 3]).unwrap();
        record.lock().unwrap().fail_next = true;
        // Even an error kind that would not poison when raised by the checks does here: the
        // backend may have changed its state before it complained.
        assert!(s.decode(1).is_err());
        assert!(matches!(s.decode(1), Err(SeamError::Poisoned { .. })));
        assert!(matches!(s.truncate(1), Err(SeamError::Poisoned { .. })));
        assert_eq!(s.position(), 3);
        s.reset();
        assert_eq!(record.lock().unwrap().resets, vec![true]);
        assert_eq!(s.position(), 0);
        s.prefill(&[1]).unwrap();
        assert_eq!(s.truncate(2).unwrap_err().kind(), ErrorKind::InvalidInput);
        s.truncate(0).unwrap();
        assert_eq!(s.position(), 0);
        s.reset();
        assert_eq!(record.lock().unwrap().resets, vec![true, false]);
    }

    #[test]
    fn non_finite_logits_poison() {
        struct Nan;
        impl SessionSteps for Nan {
            fn append(&mut self, _: usize, _: StepInput<'_>, _: bool) -> Result<RawStep> {
                Ok(RawStep { greedy_token: Some(0), logits: Some(vec![0.0, f32::NAN]), hidden_states: None })
            }
            fn reset(&mut self, _: bool) -> Result<()> {
                Ok(())
            }
        }
        let limits = SessionLimits { backend: "nan".into(), vocab_size: 2, hidden_size: 1, capabilities: caps(8) };
        let mut s = CheckedSession::new(Box::new(Nan), limits, SessionOptions::default());
        assert_eq!(s.prefill(&[1]).unwrap_err().kind(), ErrorKind::Backend);
        assert!(matches!(s.prefill(&[1]), Err(SeamError::Poisoned { .. })));
    }

    #[test]
    fn embeddings_must_be_whole_rows_of_finite_values() {
        let mut c = caps(8);
        c.inputs.embeddings = true;
        let (mut s, _) = session(c);
        assert_eq!(s.prefill_embeddings(&[0.0; 3], 2).unwrap_err().kind(), ErrorKind::InvalidInput);
        assert_eq!(s.prefill_embeddings(&[0.0, f32::NAN], 1).unwrap_err().kind(), ErrorKind::InvalidInput);
        assert!(matches!(s.prefill_embeddings(&[], 0), Err(SeamError::EmptyInput)));
        s.prefill_embeddings(&[0.5; 4], 2).unwrap();
        assert_eq!(s.position(), 2);
    }

    #[test]
    fn penalties_count_what_the_session_generated_and_forget_what_is_truncated() {
        struct Fixed;
        impl SessionSteps for Fixed {
            fn append(&mut self, _: usize, _: StepInput<'_>, _: bool) -> Result<RawStep> {
                let mut logits = vec![0.0; 10];
                logits[5..8].copy_from_slice(&[3.0, 2.5, 2.0]);
                // The device's greedy pick, which penalties must override.
                Ok(RawStep { greedy_token: Some(5), logits: Some(logits), hidden_states: None })
            }
            fn truncate(&mut self, _: usize) -> Result<()> {
                Ok(())
            }
            fn reset(&mut self, _: bool) -> Result<()> {
                Ok(())
            }
        }
        let limits = |logits| SessionLimits {
            backend: "fixed".into(),
            vocab_size: 10,
            hidden_size: 1,
            capabilities: Capabilities { logits, hidden_states: true, ..caps(16) },
        };
        let presence =
            SessionOptions { penalties: Penalties { presence: 1.0, ..Penalties::NONE }, ..SessionOptions::default() };
        let mut without_logits = CheckedSession::new(Box::new(Fixed), limits(false), SessionOptions::default());
        assert_eq!(without_logits.restart(presence.clone()).unwrap_err().kind(), ErrorKind::Unsupported);

        let mut s = CheckedSession::new(Box::new(Fixed), limits(true), SessionOptions::default());
        s.restart(presence.clone()).unwrap();
        assert!(s.wants_logits());
        // Nothing generated yet: 5; once 5 is fed back it loses 1 and 6 leads; then 5 and 7
        // tie at 2.0 and the lower id wins.
        assert_eq!(s.prefill(&[1]).unwrap().token, 5);
        assert_eq!(s.decode(5).unwrap().token, 6);
        assert_eq!(s.decode(6).unwrap().token, 5);
        // A token other than the one returned (a prompt token fed by decode) is not generated.
        assert_eq!(s.decode(7).unwrap().token, 5);
        // Truncated back to [1, 5]: only 5 counts, and the token after it was not returned for it.
        s.truncate(2).unwrap();
        assert_eq!(s.decode(6).unwrap().token, 6);
        // A restart keeping the prefix makes it prompt: no presence penalty...
        s.restart_keeping(3, presence).unwrap();
        assert_eq!(s.decode(1).unwrap().token, 5);
        // ...but the repetition penalty sees the prompt: 5 (3.0 / 2) and 6 (2.5 / 2) fall below 7.
        let repetition =
            SessionOptions { penalties: Penalties { repetition: 2.0, ..Penalties::NONE }, ..SessionOptions::default() };
        s.restart_keeping(3, repetition).unwrap();
        assert_eq!(s.decode(1).unwrap().token, 7);
        // A bias lifts a token past the others (after the penalties); one outside the
        // vocabulary, or not finite, is refused and leaves the session as it was.
        let biased = |bias: Vec<(u32, f32)>| SessionOptions { logit_bias: bias, ..SessionOptions::default() };
        s.restart(biased(vec![(9, 3.5), (5, -100.0)])).unwrap();
        assert!(s.wants_logits());
        assert_eq!(s.prefill(&[1]).unwrap().token, 9);
        assert!(matches!(s.restart(biased(vec![(10, 1.0)])), Err(SeamError::TokenOutOfVocabulary { token: 10, .. })));
        assert_eq!(s.restart(biased(vec![(3, f32::NAN)])).unwrap_err().kind(), ErrorKind::InvalidInput);
        assert_eq!(s.decode(1).unwrap().token, 9, "the refused restarts changed nothing");
        // Off again: the device's pick.
        s.restart(SessionOptions::default()).unwrap();
        assert!(!s.wants_logits());
        assert_eq!(s.prefill(&[5, 5, 5]).unwrap().token, 5);
        let hidden = SessionOptions { return_hidden_states: true, ..SessionOptions::default() };
        assert_eq!(s.restart(hidden).unwrap_err().kind(), ErrorKind::InvalidInput);
    }

    #[test]
    fn a_scored_prefill_steps_one_token_at_a_time_where_the_backend_scores_only_the_last() {
        /// Logits that name the position: the largest is `position % 10`.
        struct ByPosition;
        impl SessionSteps for ByPosition {
            fn append(&mut self, position: usize, input: StepInput<'_>, _: bool) -> Result<RawStep> {
                let last = position + input.len() - 1;
                let logits = (0..10).map(|t| if t == last % 10 { 1.0 } else { 0.0 }).collect();
                Ok(RawStep { greedy_token: None, logits: Some(logits), hidden_states: None })
            }
            fn reset(&mut self, _: bool) -> Result<()> {
                Ok(())
            }
        }
        let capabilities = Capabilities { logits: true, ..caps(16) };
        let limits = SessionLimits { backend: "steps".into(), vocab_size: 10, hidden_size: 1, capabilities };
        let mut s = CheckedSession::new(Box::new(ByPosition), limits.clone(), SessionOptions::default());
        s.prefill(&[1, 2]).unwrap();
        let scored = s.prefill_scored(&[3, 4, 5]).unwrap();
        let picks: Vec<u32> = scored.logits.chunks(10).map(crate::sampling::argmax).collect();
        assert_eq!(picks, [2, 3, 4]);
        assert_eq!((scored.output.token, scored.output.logits, s.position()), (4, None, 5));
        assert!(matches!(s.prefill_scored(&[1; 12]), Err(SeamError::ContextOverflow { .. })));
        let no_logits = SessionLimits { capabilities: caps(16), ..limits };
        let mut s = CheckedSession::new(Box::new(ByPosition), no_logits, SessionOptions::default());
        assert_eq!(s.prefill_scored(&[1]).unwrap_err().kind(), ErrorKind::Unsupported);
    }
}
