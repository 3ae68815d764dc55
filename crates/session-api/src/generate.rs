//! The generation driver: the token loop above the seam, written once for every backend.
//!
//! It feeds a prompt to a [`Session`], then feeds back each token the session returns, and stops
//! on an EOS id, a token limit, a stop string, cancellation, or a full context. Text is produced
//! through a [`Detokenizer`] and streamed as deltas: a delta never ends inside a multi-byte
//! character (byte-level BPE can split one over several tokens) and never contains text that might
//! turn out to be the start of a stop string.

use crate::error::{Result, SeamError};
use crate::session::Session;
use crate::stats::{FinishReason, GenerationStats};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Turns token ids back into text (implemented by the tokenizer layer).
pub trait Detokenizer: Send + Sync {
    /// The text of `ids`, special tokens skipped. A trailing incomplete UTF-8 sequence may show
    /// as U+FFFD; the driver waits for the next token in that case.
    fn detokenize(&self, ids: &[u32]) -> Result<String>;
}

/// A flag to stop a generation from another thread or task.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    /// A new, un-cancelled token.
    pub fn new() -> Self {
        Self::default()
    }
    /// Asks the generation to stop after the current step.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
    /// Whether [`CancelToken::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// When to stop.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GenerationRequest {
    /// Most tokens to generate (the EOS token, when produced, counts).
    pub max_tokens: usize,
    /// Ids that end generation (from the model's generation config).
    pub eos_ids: Vec<u32>,
    /// Keep generating through EOS ids (benchmarks).
    pub ignore_eos: bool,
    /// Strings that end generation; the text is cut before the first one that appears.
    pub stop_strings: Vec<String>,
}

/// One streamed token.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenEvent {
    /// Index among generated tokens, from 0.
    pub index: usize,
    /// The token id.
    pub token: u32,
    /// New text that is now final (may be empty while a character or a possible stop string is
    /// still incomplete).
    pub text: String,
}

/// The result of a generation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GenerationOutput {
    /// Generated ids, in order, including a final EOS id if one ended generation.
    pub tokens: Vec<u32>,
    /// The generated text (without EOS, cut before a stop string).
    pub text: String,
    /// Why generation stopped.
    pub finish_reason: FinishReason,
    /// Timings.
    pub stats: GenerationStats,
}

/// Tracks the text generated so far and decides what may be streamed.
#[derive(Debug, Clone, Default)]
struct TextStream {
    text_tokens: Vec<u32>,
    /// Bytes of the current text already handed out.
    emitted: usize,
    final_text: Option<String>,
}

impl TextStream {
    /// Adds a token; returns the newly final text, and whether a stop string was hit.
    fn push(
        &mut self,
        token: u32,
        detokenizer: Option<&dyn Detokenizer>,
        stop_strings: &[String],
    ) -> Result<(String, bool)> {
        let Some(detokenizer) = detokenizer else { return Ok((String::new(), false)) };
        self.text_tokens.push(token);
        let text = detokenizer.detokenize(&self.text_tokens)?;
        // Search from a little before what was emitted: a stop string may straddle the boundary.
        let longest_stop = stop_strings.iter().map(String::len).max().unwrap_or(0);
        let search_from = floor_char_boundary(&text, self.emitted.saturating_sub(longest_stop));
        let hit = stop_strings
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| text[search_from..].find(s.as_str()).map(|i| search_from + i))
            .min();
        if let Some(cut) = hit {
            let cut = cut.max(self.emitted);
            let delta = text[self.emitted..cut].to_string();
            self.emitted = cut;
            self.final_text = Some(text[..cut].to_string());
            return Ok((delta, true));
        }
        let complete = text.strip_suffix('\u{FFFD}').unwrap_or(&text);
        // Hold back the longest suffix that could still grow into a stop string.
        let held = stop_strings
            .iter()
            .filter_map(|stop| {
                (1..stop.len()).rev().find(|&n| stop.is_char_boundary(n) && complete.ends_with(&stop[..n]))
            })
            .max()
            .unwrap_or(0);
        let safe = floor_char_boundary(&text, (complete.len() - held).max(self.emitted));
        let delta = text[self.emitted..safe].to_string();
        self.emitted = safe;
        Ok((delta, false))
    }

    /// The final text, and whatever was held back that is now final.
    fn finish(&mut self, detokenizer: Option<&dyn Detokenizer>) -> Result<(String, String)> {
        if let Some(text) = self.final_text.take() {
            return Ok((text, String::new()));
        }
        let Some(detokenizer) = detokenizer else { return Ok((String::new(), String::new())) };
        let text = detokenizer.detokenize(&self.text_tokens)?;
        let rest = text.get(self.emitted..).unwrap_or("").to_string();
        Ok((text, rest))
    }
}

/// The stop rules of one generation, applied to each token a step returns: the part of
/// [`generate`] that does not call the session, for drivers that step sessions themselves (a
/// server decoding many sequences in one batched call). Feeding it the same tokens gives the
/// same events, text and finish reason as [`generate`].
#[derive(Debug, Clone)]
pub struct Generation {
    request: GenerationRequest,
    tokens: Vec<u32>,
    stream: TextStream,
}

/// What [`Generation::accept`] made of a token.
#[derive(Debug, Clone, PartialEq)]
pub struct Accepted {
    /// The token's event, with the text that is now final (none for an EOS id, whose text is
    /// not part of the output).
    pub event: Option<TokenEvent>,
    /// Why generation ends with this token, if it does.
    pub finished: Option<FinishReason>,
}

impl Generation {
    /// A generation that has produced nothing yet.
    pub fn new(request: GenerationRequest) -> Generation {
        Generation { request, tokens: Vec::new(), stream: TextStream::default() }
    }

    /// The tokens accepted so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Takes the token a step returned: an EOS id, a stop string or the token limit end the
    /// generation here. If it goes on, the caller checks cancellation and room in the context
    /// (see [`Generation::next_step_blocked`]) and feeds the token back.
    pub fn accept(&mut self, token: u32, detokenizer: Option<&dyn Detokenizer>) -> Result<Accepted> {
        self.tokens.push(token);
        if !self.request.ignore_eos && self.request.eos_ids.contains(&token) {
            return Ok(Accepted { event: None, finished: Some(FinishReason::Eos) });
        }
        let (text, hit_stop) = self.stream.push(token, detokenizer, &self.request.stop_strings)?;
        let event = Some(TokenEvent { index: self.tokens.len() - 1, token, text });
        let finished = if hit_stop {
            Some(FinishReason::StopString)
        } else if self.tokens.len() >= self.request.max_tokens {
            Some(FinishReason::MaxTokens)
        } else {
            None
        };
        Ok(Accepted { event, finished })
    }

    /// Why the last accepted token cannot be fed back, when it cannot: the caller cancelled, or
    /// the session has no room for it.
    pub fn next_step_blocked(&self, cancelled: bool, position: usize, capacity: usize) -> Option<FinishReason> {
        if cancelled {
            Some(FinishReason::Cancelled)
        } else if position >= capacity {
            Some(FinishReason::ContextFull)
        } else {
            None
        }
    }

    /// Ends the generation: the generated tokens, the final text, and an event with text that was
    /// held back (a possible stop string that did not complete), if any.
    pub fn finish(mut self, detokenizer: Option<&dyn Detokenizer>) -> Result<(Vec<u32>, String, Option<TokenEvent>)> {
        let (text, held_back) = self.stream.finish(detokenizer)?;
        let event = (!held_back.is_empty()).then(|| TokenEvent {
            index: self.tokens.len().saturating_sub(1),
            token: *self.tokens.last().unwrap_or(&0),
            text: held_back,
        });
        Ok((self.tokens, text, event))
    }
}

fn floor_char_boundary(text: &str, mut index: usize) -> usize {
    index = index.min(text.len());
    while !text.is_char_boundary(index) {
        index -= 1;
    }
    index
}

/// Runs one generation on `session`, which should be freshly created or reset (the prompt is
/// appended at its current position). `on_token` sees each token as it is produced, with its final
/// text. Errors from the session end the generation and are returned as they are.
pub fn generate(
    session: &mut dyn Session,
    prompt: &[u32],
    request: &GenerationRequest,
    detokenizer: Option<&dyn Detokenizer>,
    cancel: &CancelToken,
    on_token: &mut dyn FnMut(TokenEvent),
) -> Result<GenerationOutput> {
    if prompt.is_empty() {
        return Err(SeamError::EmptyInput);
    }
    let started = Instant::now();
    let mut stats = GenerationStats { prompt_tokens: prompt.len(), ..GenerationStats::default() };
    let mut generation = Generation::new(request.clone());
    let mut step_times = Vec::new();

    if request.max_tokens == 0 || cancel.is_cancelled() {
        let reason = if cancel.is_cancelled() { FinishReason::Cancelled } else { FinishReason::MaxTokens };
        stats.finish(Default::default(), step_times, started.elapsed(), reason);
        return Ok(GenerationOutput { tokens: Vec::new(), text: String::new(), finish_reason: reason, stats });
    }

    let prefill_started = Instant::now();
    let mut next = session.prefill(prompt)?.token;
    let prefill_time = prefill_started.elapsed();

    let reason = loop {
        let accepted = generation.accept(next, detokenizer)?;
        if let Some(event) = accepted.event {
            on_token(event);
        }
        if let Some(reason) = accepted.finished {
            break reason;
        }
        if let Some(reason) =
            generation.next_step_blocked(cancel.is_cancelled(), session.position(), session.capacity())
        {
            break reason;
        }
        let step_started = Instant::now();
        next = session.decode(next)?.token;
        step_times.push(step_started.elapsed().as_secs_f64() * 1000.0);
    };

    let (tokens, text, held_back) = generation.finish(detokenizer)?;
    if let Some(event) = held_back {
        on_token(event);
    }
    stats.generated_tokens = tokens.len();
    stats.finish(prefill_time, step_times, started.elapsed(), reason);
    Ok(GenerationOutput { tokens, text, finish_reason: reason, stats })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::capabilities::{Capabilities, InputKinds, SamplingModes};
    use crate::session::{CheckedSession, RawStep, SessionLimits, SessionOptions, SessionSteps, StepInput};

    /// Steps that replay a fixed script of tokens: enough to test the driver's stop rules.
    pub(crate) struct ScriptedSteps {
        pub script: Vec<u32>,
        pub produced: usize,
    }

    impl SessionSteps for ScriptedSteps {
        fn append(&mut self, position: usize, _: StepInput<'_>, _: bool) -> Result<RawStep> {
            if position == 0 {
                self.produced = 0;
            }
            let token = self.script[self.produced % self.script.len()];
            self.produced += 1;
            Ok(RawStep { greedy_token: Some(token), logits: None, hidden_states: None })
        }
        fn reset(&mut self, _: bool) -> Result<()> {
            Ok(())
        }
    }

    /// A checked session over [`ScriptedSteps`], vocabulary 1000, `capacity` positions.
    pub(crate) fn scripted_session(script: Vec<u32>, capacity: usize) -> CheckedSession {
        let capabilities = Capabilities {
            max_context: capacity,
            sampling: SamplingModes::GREEDY_ONLY,
            inputs: InputKinds { tokens: true, embeddings: false },
            ..Capabilities::default()
        };
        let limits = SessionLimits { backend: "scripted".into(), vocab_size: 1000, hidden_size: 1, capabilities };
        CheckedSession::new(Box::new(ScriptedSteps { script, produced: 0 }), limits, SessionOptions::default())
    }

    /// Token `n` is the letter `'a' + n`; 50 and 51 are the two halves of "é" (a split UTF-8 char).
    pub(crate) struct Letters;

    impl Detokenizer for Letters {
        fn detokenize(&self, ids: &[u32]) -> Result<String> {
            let mut bytes = Vec::new();
            for &id in ids {
                match id {
                    50 => bytes.push(0xC3),
                    51 => bytes.push(0xA9),
                    n => bytes.push(b'a' + n as u8),
                }
            }
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        }
    }

    fn session(script: Vec<u32>) -> CheckedSession {
        scripted_session(script, 100)
    }

    fn run(s: &mut CheckedSession, request: GenerationRequest) -> (GenerationOutput, Vec<TokenEvent>) {
        let mut events = Vec::new();
        let out =
            generate(s, &[1, 2, 3], &request, Some(&Letters), &CancelToken::new(), &mut |e| events.push(e)).unwrap();
        (out, events)
    }

    #[test]
    fn stops_at_eos_and_keeps_the_id_but_not_its_text() {
        let (out, events) = run(
            &mut session(vec![0, 1, 2, 9, 3]),
            GenerationRequest { max_tokens: 10, eos_ids: vec![9], ..Default::default() },
        );
        assert_eq!(out.tokens, vec![0, 1, 2, 9]);
        assert_eq!(out.text, "abc");
        assert_eq!(out.finish_reason, FinishReason::Eos);
        assert_eq!(events.iter().map(|e| e.text.as_str()).collect::<String>(), "abc");
        assert_eq!(out.stats.decode_steps, 3);
    }

    #[test]
    fn ignore_eos_runs_to_max_tokens() {
        let (out, _) = run(
            &mut session(vec![9]),
            GenerationRequest { max_tokens: 5, eos_ids: vec![9], ignore_eos: true, ..Default::default() },
        );
        assert_eq!(out.tokens.len(), 5);
        assert_eq!(out.finish_reason, FinishReason::MaxTokens);
        assert_eq!(out.stats.decode_steps, 4, "the first token comes from prefill");
    }

    #[test]
    fn stop_string_cuts_text_and_never_streams_its_prefix() {
        // a b c d e ... ; stop at "cd": "ab" is streamed, "c" is held back, then the stop hits.
        let (out, events) = run(
            &mut session((0..10).collect()),
            GenerationRequest { max_tokens: 10, stop_strings: vec!["cd".into()], ..Default::default() },
        );
        assert_eq!(out.text, "ab");
        assert_eq!(out.finish_reason, FinishReason::StopString);
        let streamed: String = events.iter().map(|e| e.text.as_str()).collect();
        assert_eq!(streamed, "ab");
        assert_eq!(events[2].text, "", "'c' might start the stop string and must be held back");
    }

    #[test]
    fn split_characters_are_streamed_whole() {
        let (out, events) =
            run(&mut session(vec![0, 50, 51, 1]), GenerationRequest { max_tokens: 4, ..Default::default() });
        assert_eq!(out.text, "aéb");
        let texts: Vec<&str> = events.iter().map(|e| e.text.as_str()).collect();
        assert_eq!(texts, vec!["a", "", "é", "b"]);
    }

    #[test]
    fn stops_when_the_context_is_full() {
        let mut s = scripted_session(vec![0], 6);
        let (out, _) = run(&mut s, GenerationRequest { max_tokens: 50, ..Default::default() });
        assert_eq!(out.finish_reason, FinishReason::ContextFull);
        assert_eq!(s.position(), 6);
        assert_eq!(out.tokens.len(), 4, "3 prompt positions + 3 decoded positions, then the 4th token cannot be fed");
    }

    #[test]
    fn cancellation_stops_after_the_current_step() {
        let cancel = CancelToken::new();
        let mut count = 0;
        let out = generate(
            &mut session(vec![0]),
            &[1],
            &GenerationRequest { max_tokens: 100, ..Default::default() },
            None,
            &cancel,
            &mut |_| {
                count += 1;
                if count == 3 {
                    cancel.cancel();
                }
            },
        )
        .unwrap();
        assert_eq!(out.finish_reason, FinishReason::Cancelled);
        assert_eq!(out.tokens.len(), 3);
    }

    #[test]
    fn empty_prompt_is_refused() {
        let err =
            generate(&mut session(vec![0]), &[], &GenerationRequest::default(), None, &CancelToken::new(), &mut |_| {})
                .unwrap_err();
        assert!(matches!(err, SeamError::EmptyInput));
    }
}
