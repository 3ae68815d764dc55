//! Batched decode: one token appended to each of many sessions of one engine in one call, the step
//! a server's continuous batching makes every time.
//!
//! Callers use `decode_batch` on `dyn Engine` with the engine's own [`CheckedSession`]s (made by
//! `new_checked_session`). Every entry is checked exactly as `Session::decode` checks it; the
//! entries that pass go to [`Engine::decode_batch_steps`] together, and each
//! result is taken as a lone decode's would be (sampling, poisoning, the position). So the
//! contract's rules hold for a batch the same way on every backend, and a sequence decoded in a
//! batch gets the token it would have got alone.

use crate::backend::Engine;
use crate::error::{Result, SeamError};
use crate::session::{CheckedSession, SessionSteps, StepInput, StepOutput};

/// One sequence of a raw batched decode, as an engine receives it.
pub struct BatchedStep<'a> {
    /// The sequence's raw steps, opened by this engine.
    pub steps: &'a mut dyn SessionSteps,
    /// Positions filled so far: the token goes there.
    pub position: usize,
    /// The token to append, inside the vocabulary.
    pub token: u32,
}

/// One sequence of a batched decode, as a caller gives it.
pub struct BatchEntry<'a> {
    /// A session of the engine the batch runs on.
    pub session: &'a mut CheckedSession,
    /// The token to append (usually the one its last step returned).
    pub token: u32,
}

impl<'a> dyn Engine + 'a {
    /// Appends `entry.token` to each entry's session, in one engine call where the engine claims
    /// [`crate::Capabilities::batched_decode`], and returns each session's step in order.
    ///
    /// An entry that fails the checks of `Session::decode` (poisoned, not prefilled, a token
    /// outside the vocabulary, a full context), or whose session another engine opened, gets
    /// that error and leaves its session as it was; it does not hold the others back. An entry
    /// the engine fails poisons its own session only.
    pub fn decode_batch(&self, entries: &mut [BatchEntry<'_>]) -> Vec<Result<StepOutput>> {
        let address = self.address();
        let mut results: Vec<Option<Result<StepOutput>>> = entries
            .iter()
            .map(|entry| {
                let checked = match entry.session.engine() {
                    Some(engine) if engine == address => entry.session.check_decode(entry.token),
                    _ => Err(SeamError::InvalidInput(format!(
                        "a batched decode on {} was given a session another engine opened",
                        self.info().backend
                    ))),
                };
                checked.err().map(Err)
            })
            .collect();
        let ready: Vec<usize> = (0..entries.len()).filter(|&i| results[i].is_none()).collect();
        if ready.is_empty() {
            return results.into_iter().map(|r| r.expect("every entry was refused")).collect();
        }
        let want_logits = ready.iter().any(|&i| entries[i].session.wants_logits());
        let mut raw = {
            let mut batch: Vec<BatchedStep<'_>> = entries
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| results[*i].is_none())
                .map(|(_, entry)| {
                    let (steps, position) = entry.session.steps_at();
                    BatchedStep { steps, position, token: entry.token }
                })
                .collect();
            self.decode_batch_steps(&mut batch, want_logits)
        };
        if raw.len() != ready.len() {
            let message =
                format!("{} returned {} results for a batch of {}", self.info().backend, raw.len(), ready.len());
            raw = ready.iter().map(|_| Err(SeamError::Backend(message.clone()))).collect();
        }
        for (&i, step) in ready.iter().zip(raw) {
            let token = std::slice::from_ref(&entries[i].token);
            results[i] = Some(entries[i].session.complete(step, StepInput::Tokens(token), want_logits));
        }
        results.into_iter().map(|r| r.expect("every entry has a result")).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{Engine, EngineInfo};
    use crate::capabilities::{Capabilities, WeightFormat};
    use crate::error::ErrorKind;
    use crate::session::{RawStep, SessionOptions, StepInput};
    use crate::Session;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    /// An engine whose next token is `(last token + position) % 50`, and which records the size
    /// of each batched call; sessions opened with `return_logits` fail at position 3.
    struct Counting {
        batched_calls: Mutex<Vec<usize>>,
    }

    struct Steps {
        fail_at: Option<usize>,
    }

    impl SessionSteps for Steps {
        fn append(&mut self, position: usize, input: StepInput<'_>, _: bool) -> Result<RawStep> {
            let StepInput::Tokens(tokens) = input else { unreachable!() };
            let last = position + tokens.len() - 1;
            if self.fail_at == Some(last) {
                return Err(SeamError::Backend("device lost".into()));
            }
            let token = (tokens[tokens.len() - 1] as usize + last) as u32 % 50;
            let logits = (0..50).map(|t| if t == token { 1.0 } else { 0.0 }).collect();
            Ok(RawStep { greedy_token: Some(token), logits: Some(logits), hidden_states: None })
        }
        fn reset(&mut self, _: bool) -> Result<()> {
            Ok(())
        }
    }

    impl Engine for Counting {
        fn info(&self) -> EngineInfo {
            EngineInfo {
                backend: "counting".into(),
                device: "cpu".into(),
                model: "none".into(),
                weights: WeightFormat::F16,
                resident_precision: "f32".into(),
                vocab_size: 50,
                hidden_size: 1,
                load_time: Duration::ZERO,
                weight_bytes: 0,
                decode_bytes_per_token: None,
            }
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities { batched_decode: true, ..Capabilities::all(8) }
        }
        fn open_steps(&self, options: &SessionOptions) -> Result<Box<dyn SessionSteps>> {
            let fail_at = options.return_logits.then_some(3);
            Ok(Box::new(Steps { fail_at }))
        }
        fn decode_batch_steps(&self, batch: &mut [BatchedStep<'_>], want_logits: bool) -> Vec<Result<RawStep>> {
            self.batched_calls.lock().unwrap().push(batch.len());
            batch.iter_mut().map(|e| e.steps.append(e.position, StepInput::Tokens(&[e.token]), want_logits)).collect()
        }
    }

    fn engine() -> Arc<dyn Engine> {
        Arc::new(Counting { batched_calls: Mutex::new(Vec::new()) })
    }

    #[test]
    fn a_batch_gives_each_session_its_solo_tokens_in_one_call() {
        let counting = Arc::new(Counting { batched_calls: Mutex::new(Vec::new()) });
        let engine: Arc<dyn Engine> = counting.clone();
        let mut solo = engine.new_checked_session(SessionOptions::default()).unwrap();
        let mut expected = vec![solo.prefill(&[7]).unwrap().token];
        for _ in 0..4 {
            expected.push(solo.decode(*expected.last().unwrap()).unwrap().token);
        }
        let mut a = engine.new_checked_session(SessionOptions::default()).unwrap();
        let mut b = engine.new_checked_session(SessionOptions::default()).unwrap();
        let mut got_a = vec![a.prefill(&[7]).unwrap().token];
        let mut got_b = vec![b.prefill(&[7]).unwrap().token];
        for _ in 0..4 {
            let mut entries = [
                BatchEntry { token: *got_a.last().unwrap(), session: &mut a },
                BatchEntry { token: *got_b.last().unwrap(), session: &mut b },
            ];
            let results = engine.decode_batch(&mut entries);
            got_a.push(results[0].as_ref().unwrap().token);
            got_b.push(results[1].as_ref().unwrap().token);
        }
        assert_eq!(got_a, expected);
        assert_eq!(got_b, expected);
        assert_eq!(a.position(), 5);
        assert_eq!(*counting.batched_calls.lock().unwrap(), vec![2; 4], "one engine call per batched step");
    }

    #[test]
    fn refused_and_failed_entries_stand_alone() {
        let engine = engine();
        let other = self::engine();
        let mut fresh = engine.new_checked_session(SessionOptions::default()).unwrap();
        let mut foreign = other.new_checked_session(SessionOptions::default()).unwrap();
        foreign.prefill(&[1]).unwrap();
        let failing_options = SessionOptions { return_logits: true, ..SessionOptions::default() };
        let mut failing = engine.new_checked_session(failing_options).unwrap();
        failing.prefill(&[1, 2, 3]).unwrap();
        let mut good = engine.new_checked_session(SessionOptions::default()).unwrap();
        good.prefill(&[1]).unwrap();
        let mut entries = [
            BatchEntry { token: 1, session: &mut fresh },
            BatchEntry { token: 1, session: &mut foreign },
            BatchEntry { token: 1, session: &mut failing },
            BatchEntry { token: 99, session: &mut good },
        ];
        let results = engine.decode_batch(&mut entries);
        assert!(matches!(results[0], Err(SeamError::NotPrefilled)));
        assert_eq!(results[1].as_ref().unwrap_err().kind(), ErrorKind::InvalidInput);
        assert_eq!(results[2].as_ref().unwrap_err().kind(), ErrorKind::Backend);
        assert!(matches!(results[3], Err(SeamError::TokenOutOfVocabulary { token: 99, .. })));
        assert!(matches!(failing.decode(1), Err(SeamError::Poisoned { .. })), "the failed entry is poisoned");
        assert_eq!(good.position(), 1, "a refused entry keeps its position");
        assert!(good.decode(1).is_ok(), "a refused entry is not poisoned");
    }

    #[test]
    fn restart_changes_the_sampling_and_empties_the_sequence() {
        let engine = engine();
        let mut session = engine.new_checked_session(SessionOptions::default()).unwrap();
        session.prefill(&[4, 5]).unwrap();
        session.restart(SessionOptions::default()).unwrap();
        assert_eq!(session.position(), 0);
        assert!(matches!(session.decode(1), Err(SeamError::NotPrefilled)));
    }
}
