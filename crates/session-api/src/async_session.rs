//! An async face for sessions, on tokio.
//!
//! Backends implement the synchronous [`Session`] trait: their work is compute-bound and many
//! runtimes (IREE, PJRT) want to own the calling thread. Async callers (a server) use
//! [`AsyncSession`], which runs each call on tokio's blocking pool so the reactor never stalls, and
//! [`AsyncSession::generate_stream`], which streams [`TokenEvent`]s through a channel.

use crate::error::{Result, SeamError};
use crate::generate::{generate, CancelToken, Detokenizer, GenerationOutput, GenerationRequest, TokenEvent};
use crate::session::{Session, StepOutput};
use async_trait::async_trait;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// The async session operations.
#[async_trait]
pub trait AsyncSessionOps: Send + Sync {
    /// [`Session::prefill`], off the async thread.
    async fn prefill(&self, tokens: Vec<u32>) -> Result<StepOutput>;
    /// [`Session::decode`], off the async thread.
    async fn decode(&self, token: u32) -> Result<StepOutput>;
    /// [`Session::reset`].
    async fn reset(&self) -> Result<()>;
    /// [`Session::position`].
    async fn position(&self) -> Result<usize>;
}

/// A [`Session`] shared with tokio's blocking pool. Calls are serialized: one sequence cannot step
/// twice at once.
#[derive(Clone)]
pub struct AsyncSession {
    inner: Arc<Mutex<Box<dyn Session>>>,
}

impl AsyncSession {
    /// Wraps a session.
    pub fn new(session: Box<dyn Session>) -> Self {
        AsyncSession { inner: Arc::new(Mutex::new(session)) }
    }

    async fn with_session<T: Send + 'static>(
        &self,
        work: impl FnOnce(&mut dyn Session) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || {
            // A panic inside a backend poisons the std mutex; report it as a backend failure.
            let mut session = inner.lock().map_err(|_| SeamError::Backend("a previous call panicked".into()))?;
            work(session.as_mut())
        })
        .await
        .map_err(|e| SeamError::Backend(format!("session task failed: {e}")))?
    }

    /// Starts a generation on the blocking pool. Events arrive on the returned channel as tokens
    /// are produced; the handle yields the final output. Dropping the receiver cancels the
    /// generation after the current step.
    pub fn generate_stream(
        &self,
        prompt: Vec<u32>,
        request: GenerationRequest,
        detokenizer: Option<Arc<dyn Detokenizer>>,
        cancel: CancelToken,
    ) -> (mpsc::UnboundedReceiver<TokenEvent>, JoinHandle<Result<GenerationOutput>>) {
        let (sender, receiver) = mpsc::unbounded_channel();
        let inner = Arc::clone(&self.inner);
        let handle = tokio::task::spawn_blocking(move || {
            let mut session = inner.lock().map_err(|_| SeamError::Backend("a previous call panicked".into()))?;
            let mut forward = |event: TokenEvent| {
                if sender.send(event).is_err() {
                    cancel.cancel();
                }
            };
            generate(session.as_mut(), &prompt, &request, detokenizer.as_deref(), &cancel, &mut forward)
        });
        (receiver, handle)
    }
}

#[async_trait]
impl AsyncSessionOps for AsyncSession {
    async fn prefill(&self, tokens: Vec<u32>) -> Result<StepOutput> {
        self.with_session(move |s| s.prefill(&tokens)).await
    }
    async fn decode(&self, token: u32) -> Result<StepOutput> {
        self.with_session(move |s| s.decode(token)).await
    }
    async fn reset(&self) -> Result<()> {
        self.with_session(|s| {
            s.reset();
            Ok(())
        })
        .await
    }
    async fn position(&self) -> Result<usize> {
        self.with_session(|s| Ok(s.position())).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::tests::{scripted_session, Letters};
    use crate::stats::FinishReason;

    fn scripted() -> AsyncSession {
        AsyncSession::new(Box::new(scripted_session((0..20).collect(), 100)))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn streams_tokens_and_returns_the_output() {
        let session = scripted();
        let request = GenerationRequest { max_tokens: 5, ..Default::default() };
        let (mut events, handle) =
            session.generate_stream(vec![1, 2], request, Some(Arc::new(Letters)), CancelToken::new());
        let mut text = String::new();
        while let Some(event) = events.recv().await {
            text.push_str(&event.text);
        }
        let output = handle.await.unwrap().unwrap();
        assert_eq!(text, "abcde");
        assert_eq!(output.text, text);
        assert_eq!(session.position().await.unwrap(), 6);
        session.reset().await.unwrap();
        assert_eq!(session.position().await.unwrap(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropping_the_receiver_cancels() {
        let session = scripted();
        let request = GenerationRequest { max_tokens: 10_000, ..Default::default() };
        // Hold the session so the generation task cannot start before the receiver is gone.
        let busy = session.inner.lock().unwrap();
        let (events, handle) = session.generate_stream(vec![1], request, None, CancelToken::new());
        drop(events);
        drop(busy);
        let output = handle.await.unwrap().unwrap();
        // The task may stream a few tokens before it sees the closed channel; it must stop long
        // before its token limit.
        assert_eq!(output.finish_reason, FinishReason::Cancelled);
        assert!(output.tokens.len() < 100, "generated {} tokens after the receiver was dropped", output.tokens.len());
    }

    #[tokio::test]
    async fn step_calls_run_off_the_reactor() {
        let session = scripted();
        assert_eq!(session.prefill(vec![4, 5]).await.unwrap().token, 0);
        assert_eq!(session.decode(0).await.unwrap().token, 1);
        assert!(matches!(session.prefill(vec![]).await, Err(SeamError::EmptyInput)));
    }
}
