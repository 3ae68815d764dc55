//! # openai-server: `seam serve`, an OpenAI-compatible HTTP server with continuous batching
//!
//! One loaded engine serves `POST /v1/chat/completions` and `POST /v1/completions` (streamed as
//! server-sent events or not), `GET /v1/models`, `GET /health` and `GET /metrics`, on axum.
//! Requests go to one engine thread ([`scheduler`]) that decodes every running request in one
//! batched call per step, on any backend: an engine that claims batched decode runs the batch as
//! one device call, any other steps its sessions in turn behind the same interface.
//!
//! What a request asks is checked before it is queued (malformed JSON or parameters, an unknown
//! model, a prompt that does not fit the context) and refused with OpenAI's error body and the
//! matching status; a full queue is refused at once with 429 and `Retry-After`. A client that goes
//! away cancels its request before the next step. [`Server::run`] stops on the given signal
//! after the running requests finish.

pub mod metrics;
pub mod openai;
pub mod scheduler;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use chat_tokenizer::{ChatMessage, ChatTemplate, Tokenizer};
use futures::stream::{self, Stream, StreamExt};
use metrics::Metrics;
use openai::*;
use scheduler::{End, Job, JobEvent, LogprobsRequest, Scheduler, SchedulerConfig, SubmitError};
use session_api::generate::GenerationRequest;
use session_api::logprobs::TokenLogprobs;
use session_api::stats::FinishReason;
use session_api::{Engine, ErrorKind, Penalties, SamplingConfig, SeamError, SessionOptions};
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// A model ready to serve: the engine and what turns text into its tokens and back.
pub struct ServedModel {
    /// The loaded engine.
    pub engine: Arc<dyn Engine>,
    /// The model's tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// The model's chat template; chat requests are refused without one.
    pub chat_template: Option<ChatTemplate>,
    /// Ids that end a generation.
    pub eos_ids: Vec<u32>,
    /// The id clients name in `model`.
    pub id: String,
}

/// How the server runs.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// The engine thread's scheduling.
    pub scheduler: SchedulerConfig,
    /// `max_tokens` when a request gives none; `None` lets a generation fill the context.
    pub default_max_tokens: Option<usize>,
    /// How long a client may take to send a request's headers, and then its body; a connection
    /// idle for as long between requests is closed too. Without it a client that sends a few
    /// bytes and stops holds its connection forever.
    pub read_timeout: Duration,
}

/// The largest request body read (axum's default limit): prompts far longer than any context.
const MAX_BODY_BYTES: usize = 2 * 1024 * 1024;

/// What every handler shares.
struct AppState {
    model: ServedModel,
    special_tokens: Vec<String>,
    scheduler: Scheduler,
    metrics: Arc<Metrics>,
    options: ServerOptions,
    /// The engine's vocabulary size and context length, read once at start.
    vocab_size: usize,
    max_context: usize,
    started: u64,
    next_id: AtomicU64,
}

/// A bound server, not yet answering.
pub struct Server {
    listener: TcpListener,
    state: Arc<AppState>,
    engine_thread: std::thread::JoinHandle<()>,
}

impl Server {
    /// Binds `address` and starts the engine thread.
    pub async fn bind(model: ServedModel, options: ServerOptions, address: SocketAddr) -> std::io::Result<Server> {
        let listener = TcpListener::bind(address).await?;
        let metrics = Arc::new(Metrics::new());
        let detokenizer: Arc<dyn session_api::generate::Detokenizer> = model.tokenizer.clone();
        let (scheduler, engine_thread) =
            Scheduler::start(Arc::clone(&model.engine), detokenizer, options.scheduler.clone(), Arc::clone(&metrics))?;
        let special_tokens = model.tokenizer.special_tokens();
        let vocab_size = model.engine.info().vocab_size;
        let max_context = model.engine.capabilities().max_context;
        let state = Arc::new(AppState {
            model,
            special_tokens,
            scheduler,
            metrics,
            options,
            vocab_size,
            max_context,
            started: unix_now(),
            next_id: AtomicU64::new(1),
        });
        Ok(Server { listener, state, engine_thread })
    }

    /// The address it listens on (the port chosen when 0 was asked).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Answers requests until `shutdown` completes; then refuses new requests (503) and
    /// connections, lets the running and queued ones finish (an idle keep-alive connection is
    /// closed), and stops the engine thread.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
        let Server { listener, state, engine_thread } = self;
        let closing = state.scheduler.clone();
        let shutdown = async move {
            shutdown.await;
            closing.close();
        };
        serve_connections(listener, router(Arc::clone(&state)), state.options.read_timeout, shutdown).await;
        drop(state);
        // The engine thread ends once the last scheduler handle is gone and its work is done.
        tokio::task::spawn_blocking(move || engine_thread.join())
            .await
            .map_err(std::io::Error::other)?
            .map_err(|_| std::io::Error::other("the engine thread panicked"))
    }
}

/// Answers each accepted connection with `router` (HTTP/1) until `shutdown` completes; then
/// accepts no more and waits for the open connections to finish their running requests.
///
/// axum's own `serve` does this too, but sets no deadline for a request's headers: this loop
/// gives hyper a timer and `read_timeout` as that deadline.
async fn serve_connections(
    listener: TcpListener,
    router: Router,
    read_timeout: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(read_timeout);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of file descriptors, or a connection reset before it was taken: the
                // listener itself is fine; a short pause lets descriptors free up.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            // A connection's errors (a client gone, a header deadline missed) are its own.
            let _ = connection.await;
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// Completes on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let interrupt = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = interrupt => {},
        _ = terminate => {},
    }
}

fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize_text))
        .route("/detokenize", post(detokenize_tokens))
        .route("/tokenizer_info", get(tokenizer_info))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// An error answered with OpenAI's body.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    detail: ErrorDetail,
    retry_after: Option<u32>,
}

impl ApiError {
    fn invalid(message: impl Into<String>, param: Option<&'static str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            detail: ErrorDetail { message: message.into(), kind: "invalid_request_error", param, code: None },
            retry_after: None,
        }
    }

    fn with_code(mut self, code: &'static str) -> ApiError {
        self.detail.code = Some(code);
        self
    }

    fn with_status(mut self, status: StatusCode) -> ApiError {
        self.status = status;
        self
    }

    fn from_seam(error: SeamError) -> ApiError {
        let status = match error.kind() {
            ErrorKind::InvalidInput | ErrorKind::ContextOverflow | ErrorKind::Unsupported => StatusCode::BAD_REQUEST,
            ErrorKind::ResourceExhausted => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let kind = if status == StatusCode::BAD_REQUEST { "invalid_request_error" } else { "server_error" };
        ApiError {
            status,
            detail: ErrorDetail { message: error.to_string(), kind, param: None, code: None },
            retry_after: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(ErrorBody { error: self.detail })).into_response();
        if let Some(seconds) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

/// A request's body, read within the server's read timeout and [`MAX_BODY_BYTES`]; what goes
/// wrong is answered in OpenAI's error shape like any other mistake.
struct RequestBody(Bytes);

impl FromRequest<Arc<AppState>> for RequestBody {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &Arc<AppState>) -> Result<Self, ApiError> {
        let too_large = |what: String| {
            ApiError::invalid(format!("{what}; the limit is {MAX_BODY_BYTES} bytes"), None)
                .with_status(StatusCode::PAYLOAD_TOO_LARGE)
                .with_code("request_too_large")
        };
        // A declared length over the limit is refused before any of the body is waited for.
        let declared = request.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if let Some(length) = declared.filter(|&n| n > MAX_BODY_BYTES as u64) {
            return Err(too_large(format!("the request body has {length} bytes")));
        }
        let timeout = state.options.read_timeout;
        match tokio::time::timeout(timeout, Bytes::from_request(request, state)).await {
            Ok(Ok(bytes)) => Ok(RequestBody(bytes)),
            Ok(Err(rejection)) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Err(too_large("the request body is too large".into()))
            }
            Ok(Err(rejection)) => {
                Err(ApiError::invalid(format!("the request body could not be read: {}", rejection.body_text()), None)
                    .with_status(rejection.status()))
            }
            Err(_) => Err(ApiError::invalid(
                format!("the request body did not arrive within {} s", timeout.as_secs_f64()),
                None,
            )
            .with_status(StatusCode::REQUEST_TIMEOUT)
            .with_code("request_timeout")),
        }
    }
}

/// A queued request: each sequence's events (prompt by prompt, `n` each: the choices' order),
/// and how to answer them.
struct Submitted {
    events: Vec<mpsc::UnboundedReceiver<JobEvent>>,
    stream: bool,
    include_usage: bool,
    /// Log-probabilities were asked for.
    logprobs: bool,
    /// The prompts' tokens, each prompt counted once however many choices it has.
    prompt_tokens: usize,
}

/// One sequence a request asks the engine thread for, checked.
struct Sequence {
    prompt: Vec<u32>,
    options: SessionOptions,
    logprobs: Option<LogprobsRequest>,
    prompt_only: bool,
    generation: GenerationRequest,
}

/// What a request asks, checked: its sequences, and how to answer.
struct Prepared {
    sequences: Vec<Sequence>,
    stream: bool,
    include_usage: bool,
    prompt_tokens: usize,
}

/// The most alternatives reported per token (vLLM's default limit; OpenAI's is 20 for chat and
/// 5 for completions).
const MAX_TOP_LOGPROBS: u64 = 20;

fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("the request body is not valid: {e}"), None))
}

impl AppState {
    fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(name) if name != self.model.id => Err(ApiError {
                status: StatusCode::NOT_FOUND,
                detail: ErrorDetail {
                    message: format!("the model '{name}' does not exist; this server serves '{}'", self.model.id),
                    kind: "invalid_request_error",
                    param: Some("model"),
                    code: Some("model_not_found"),
                },
                retry_after: None,
            }),
            _ => Ok(()),
        }
    }

    /// Checks the parameters, and each prompt's length against the context; a sequence per
    /// prompt and choice (`n` per prompt), the choices of one prompt sampling from seeds that
    /// follow the request's. `prompt_param` names the request's prompt field in errors (`prompt`
    /// or `messages`); `logprobs` is what the endpoint read from its own form of the parameter;
    /// `echo` (a completion echoing its prompt) allows `max_tokens` 0.
    fn prepare(
        &self,
        prompts: Vec<Vec<u32>>,
        prompt_param: &'static str,
        params: &Params,
        max_tokens: Option<u64>,
        logprobs: Option<LogprobsRequest>,
        echo: bool,
    ) -> Result<Prepared, ApiError> {
        let n = params.n.unwrap_or(1);
        let most = self.scheduler.max_queue();
        if n == 0 {
            return Err(ApiError::invalid("n must be at least 1", Some("n")));
        }
        let sequences = (prompts.len() as u64).saturating_mul(n);
        if sequences > most as u64 {
            let (param, what) = if prompts.len() > 1 { (prompt_param, "prompts times n") } else { ("n", "n") };
            return Err(ApiError::invalid(
                format!("{what} is {sequences}: at most {most} sequences fit this server's queue"),
                Some(param),
            ));
        }
        for (value, name) in
            [(params.presence_penalty, "presence_penalty"), (params.frequency_penalty, "frequency_penalty")]
        {
            if let Some(v) = value.filter(|v| !(-2.0..=2.0).contains(v)) {
                return Err(ApiError::invalid(format!("{name} must be between -2 and 2, got {v}"), Some(name)));
            }
        }
        let logit_bias = self.logit_bias(params)?;
        let penalties = Penalties {
            repetition: params.repetition_penalty.unwrap_or(1.0),
            presence: params.presence_penalty.unwrap_or(0.0),
            frequency: params.frequency_penalty.unwrap_or(0.0),
        };
        penalties.validate().map_err(|e| ApiError::invalid(e, Some("repetition_penalty")))?;
        refuse_unserved(params)?;
        if let Some(t) = params.temperature.filter(|t| !(0.0..=2.0).contains(t)) {
            return Err(ApiError::invalid(
                format!("temperature must be between 0 and 2, got {t}"),
                Some("temperature"),
            ));
        }
        let seed = params.seed.map(|s| s as u64).unwrap_or_else(random_seed);
        let top_k = params.top_k.map(|k| k as usize).filter(|&k| k > 0);
        let sampling =
            SamplingConfig::from_settings(Some(params.temperature.unwrap_or(1.0)), top_k, params.top_p, Some(seed))
                .map_err(|e| ApiError::invalid(e, None))?;
        let stop_strings = match &params.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop_strings.len() > 4 {
            return Err(ApiError::invalid("at most 4 stop strings are allowed", Some("stop")));
        }
        if stop_strings.iter().any(String::is_empty) {
            return Err(ApiError::invalid("a stop string needs text", Some("stop")));
        }
        let mut sequences = Vec::with_capacity(prompts.len() * n as usize);
        let mut prompt_tokens = 0;
        for prompt in prompts {
            let max_tokens = self.check_prompt(&prompt, prompt_param, max_tokens, echo)?;
            prompt_tokens += prompt.len();
            for _ in 0..n {
                let sampling = match sampling {
                    SamplingConfig::Sample { temperature, top_k, top_p, seed } => {
                        let seed = seed.wrapping_add(sequences.len() as u64);
                        SamplingConfig::Sample { temperature, top_k, top_p, seed }
                    }
                    SamplingConfig::Greedy => SamplingConfig::Greedy,
                };
                sequences.push(Sequence {
                    prompt: prompt.clone(),
                    options: SessionOptions {
                        sampling,
                        penalties,
                        logit_bias: logit_bias.clone(),
                        return_logits: logprobs.is_some(),
                        ..SessionOptions::default()
                    },
                    logprobs,
                    prompt_only: max_tokens == 0,
                    generation: GenerationRequest {
                        max_tokens,
                        eos_ids: self.model.eos_ids.clone(),
                        ignore_eos: params.ignore_eos,
                        stop_strings: stop_strings.clone(),
                    },
                });
            }
        }
        Ok(Prepared {
            sequences,
            stream: params.stream,
            include_usage: params.stream_options.as_ref().is_some_and(|o| o.include_usage),
            prompt_tokens,
        })
    }

    /// `logit_bias` as (token id, bias) pairs in id order: each key a token id of the
    /// vocabulary, each bias in -100..=100.
    fn logit_bias(&self, params: &Params) -> Result<Vec<(u32, f32)>, ApiError> {
        let wrong = |message: String| ApiError::invalid(message, Some("logit_bias"));
        let mut bias = Vec::new();
        for (key, &value) in params.logit_bias.iter().flatten() {
            let token: u32 = key.parse().map_err(|_| wrong(format!("logit_bias key '{key}' is not a token id")))?;
            if token as usize >= self.vocab_size {
                return Err(wrong(format!(
                    "logit_bias token id {token} is outside the vocabulary (size {})",
                    self.vocab_size
                )));
            }
            if !(-100.0..=100.0).contains(&value) {
                return Err(wrong(format!(
                    "the logit_bias of token {token} must be between -100 and 100, got {value}"
                )));
            }
            bias.push((token, value));
        }
        bias.sort_by_key(|&(token, _)| token);
        Ok(bias)
    }

    /// Checks one prompt against the vocabulary and the context; returns the `max_tokens` it
    /// runs with.
    fn check_prompt(
        &self,
        prompt: &[u32],
        prompt_param: &'static str,
        max_tokens: Option<u64>,
        echo: bool,
    ) -> Result<usize, ApiError> {
        if prompt.is_empty() {
            return Err(ApiError::invalid("the prompt is empty", Some(prompt_param)));
        }
        let vocab_size = self.vocab_size;
        if let Some(&token) = prompt.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(ApiError::invalid(
                format!("token id {token} is outside the vocabulary (size {vocab_size})"),
                Some(prompt_param),
            ));
        }
        let capacity = self.max_context;
        if prompt.len() >= capacity {
            return Err(ApiError::invalid(
                format!(
                    "this model's maximum context length is {capacity} tokens; the prompt has {} tokens, \
                     leaving no room for a completion",
                    prompt.len()
                ),
                Some(prompt_param),
            )
            .with_code("context_length_exceeded"));
        }
        let room = capacity - prompt.len();
        let max_tokens = match max_tokens {
            Some(0) if echo => 0,
            Some(0) => return Err(ApiError::invalid("max_tokens must be at least 1", Some("max_tokens"))),
            Some(n) if n as usize > room => {
                return Err(ApiError::invalid(
                    format!(
                        "this model's maximum context length is {capacity} tokens; you requested {} tokens \
                         ({} in the prompt, {n} for the completion)",
                        prompt.len() as u64 + n,
                        prompt.len()
                    ),
                    Some("max_tokens"),
                )
                .with_code("context_length_exceeded"))
            }
            Some(n) => n as usize,
            None => self.options.default_max_tokens.map_or(room, |d| d.min(room)),
        };
        Ok(max_tokens)
    }

    fn new_id(&self, prefix: &str) -> String {
        format!("{prefix}-{:x}{:06x}", self.started, self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Queues a prepared request, all its sequences or none; a full queue is answered at once.
    fn submit(&self, prepared: Prepared) -> Result<Submitted, ApiError> {
        let Prepared { sequences, stream, include_usage, prompt_tokens } = prepared;
        let logprobs = sequences.iter().any(|s| s.logprobs.is_some());
        let (jobs, receivers): (Vec<Job>, Vec<_>) = sequences
            .into_iter()
            .map(|Sequence { prompt, options, logprobs, prompt_only, generation }| {
                let (events, receiver) = mpsc::unbounded_channel();
                (Job { prompt, options, logprobs, prompt_only, generation, events }, receiver)
            })
            .unzip();
        match self.scheduler.submit(jobs) {
            Ok(()) => Ok(Submitted { events: receivers, stream, include_usage, logprobs, prompt_tokens }),
            Err(SubmitError::QueueFull) => Err(ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                detail: ErrorDetail {
                    message: format!(
                        "the server is busy: {} requests are already waiting; retry shortly",
                        self.scheduler.queued()
                    ),
                    kind: "rate_limit_error",
                    param: None,
                    code: Some("queue_full"),
                },
                retry_after: Some(1),
            }),
            Err(SubmitError::ShuttingDown) => Err(shutting_down()),
        }
    }
}

/// Refuses what a request asks that would change its answer and that this server does not do,
/// instead of answering as if it had not been asked.
fn refuse_unserved(params: &Params) -> Result<(), ApiError> {
    let no_tools = "this server calls no tools";
    if params.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::invalid(format!("tools are not supported: {no_tools}"), Some("tools")));
    }
    if params.functions.as_ref().is_some_and(|f| !f.is_empty()) {
        return Err(ApiError::invalid(format!("functions are not supported: {no_tools}"), Some("functions")));
    }
    for (choice, name) in [(&params.tool_choice, "tool_choice"), (&params.function_call, "function_call")] {
        match choice {
            None => {}
            Some(ToolChoice::Mode(mode)) if mode == "none" || mode == "auto" => {}
            Some(_) => {
                return Err(ApiError::invalid(format!("{name} can only be none or auto: {no_tools}"), Some(name)))
            }
        }
    }
    if let Some(format) = params.response_format.as_ref().filter(|f| f.kind != "text") {
        return Err(ApiError::invalid(
            format!("response_format '{}' is not supported (only text)", format.kind),
            Some("response_format"),
        ));
    }
    Ok(())
}

fn shutting_down() -> ApiError {
    ApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        detail: ErrorDetail {
            message: "the server is shutting down".into(),
            kind: "server_error",
            param: None,
            code: Some("shutting_down"),
        },
        retry_after: Some(1),
    }
}

/// A seed for a request that names none, so unseeded requests differ.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    hasher.finish()
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn finish_reason(end: End) -> &'static str {
    match end {
        End::Finished(FinishReason::Eos | FinishReason::StopString) => "stop",
        End::Finished(FinishReason::MaxTokens | FinishReason::ContextFull | FinishReason::Cancelled) => "length",
        End::TimeLimit => "length",
    }
}

/// Runs tokenization off the reactor (a long prompt takes a while to encode).
async fn tokenize(work: impl FnOnce() -> Result<Vec<u32>, ApiError> + Send + 'static) -> Result<Vec<u32>, ApiError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::from_seam(SeamError::Backend(format!("tokenizing failed: {e}"))))?
}

/// The outcome of one sequence read to its end.
struct Collected {
    text: String,
    /// The generated tokens' log-probabilities, when asked for (an ending EOS id has none: its
    /// text is not part of the answer).
    generated: Vec<TokenLogprobs>,
    /// The prompt's, from its second token, when the prompt was scored.
    prompt: Option<Vec<TokenLogprobs>>,
    end: End,
    completion_tokens: usize,
}

async fn collect(mut events: mpsc::UnboundedReceiver<JobEvent>) -> Result<Collected, ApiError> {
    let mut text = String::new();
    let mut generated = Vec::new();
    let mut prompt = None;
    while let Some(event) = events.recv().await {
        match event {
            JobEvent::PromptLogprobs(scored) => prompt = Some(scored),
            JobEvent::Token(token, logprobs) => {
                text.push_str(&token.text);
                generated.extend(logprobs);
            }
            JobEvent::Done { end, completion_tokens, .. } => {
                return Ok(Collected { text, generated, prompt, end, completion_tokens });
            }
            JobEvent::Failed(error) => return Err(ApiError::from_seam(error)),
        }
    }
    Err(ApiError::from_seam(SeamError::Backend("the engine thread ended the request without an answer".into())))
}

/// Every sequence of a request read to its end, in choice order, and the request's usage; the
/// first failure answers the request (the other sequences are then dropped, which cancels them).
async fn collect_all(submitted: Submitted) -> Result<(Vec<Collected>, Usage), ApiError> {
    let collected = futures::future::try_join_all(submitted.events.into_iter().map(collect)).await?;
    let completion_tokens = collected.iter().map(|c| c.completion_tokens).sum();
    let prompt_tokens = submitted.prompt_tokens;
    Ok((collected, Usage { prompt_tokens, completion_tokens, total_tokens: prompt_tokens + completion_tokens }))
}

/// A chunk maker: the choice's index, new text, the log-probabilities of the tokens whose text it
/// carries, and the finish reason of the choice's last chunk.
type ChunkMaker = Box<dyn Fn(usize, String, Vec<TokenLogprobs>, Option<&'static str>) -> Event + Send + Sync>;

/// A maker of a choice's scored, echoed prompt chunk: the choice's index and the scores.
type PromptChunkMaker = Box<dyn Fn(usize, Vec<TokenLogprobs>) -> Event + Send + Sync>;

/// A maker of the usage chunk.
type UsageMaker = Box<dyn Fn(Usage) -> Event + Send + Sync>;

/// How a request's stream makes its events.
struct StreamMakers {
    /// The chunk of a choice's scored, echoed prompt (a completion's `echo` with `logprobs`).
    prompt: Option<PromptChunkMaker>,
    /// Every other chunk with a choice.
    chunk: ChunkMaker,
    /// The last chunk, with the usage counts, when asked for.
    usage: Option<UsageMaker>,
}

/// Where a request's stream stands.
struct StreamProgress {
    /// Every sequence's events, tagged with its choice's index, as they come.
    events: stream::SelectAll<stream::BoxStream<'static, (usize, JobEvent)>>,
    /// Per choice, the log-probabilities of tokens whose text is held back.
    pending: Vec<Vec<TokenLogprobs>>,
    /// Choices not yet done.
    running: usize,
    prompt_tokens: usize,
    completion_tokens: usize,
}

/// Turns a request's events into server-sent events, after `first`: each choice's chunks as its
/// tokens come (interleaved when there are several), then the usage chunk when asked for, then
/// `[DONE]`, which ends every stream. A token whose text is held back (part of a character, or
/// of a possible stop string) sends nothing; its log-probabilities go with the chunk that carries
/// its text. A failed sequence ends the stream with an `error` event.
fn event_stream(
    submitted: Submitted,
    first: Vec<Event>,
    makers: StreamMakers,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let head = stream::iter(first.into_iter().map(Ok));
    let makers = Arc::new(makers);
    let running = submitted.events.len();
    let events = stream::select_all(submitted.events.into_iter().enumerate().map(|(index, receiver)| {
        stream::unfold(receiver, |mut receiver| async move { receiver.recv().await.map(|event| (event, receiver)) })
            .map(move |event| (index, event))
            .boxed()
    }));
    let progress = StreamProgress {
        events,
        pending: vec![Vec::new(); running],
        running,
        prompt_tokens: submitted.prompt_tokens,
        completion_tokens: 0,
    };
    let body = stream::unfold(Some(progress), move |state| {
        let makers = Arc::clone(&makers);
        async move {
            let mut progress = state?;
            let out: Vec<Event> = match progress.events.next().await {
                Some((i, JobEvent::PromptLogprobs(scored))) => {
                    makers.prompt.as_ref().map(|make| make(i, scored)).into_iter().collect()
                }
                Some((i, JobEvent::Token(token, logprobs))) => {
                    progress.pending[i].extend(logprobs);
                    match token.text.is_empty() {
                        true => Vec::new(),
                        false => vec![(makers.chunk)(i, token.text, std::mem::take(&mut progress.pending[i]), None)],
                    }
                }
                Some((i, JobEvent::Done { end, completion_tokens, .. })) => {
                    let pending = std::mem::take(&mut progress.pending[i]);
                    let mut out = vec![(makers.chunk)(i, String::new(), pending, Some(finish_reason(end)))];
                    progress.completion_tokens += completion_tokens;
                    progress.running -= 1;
                    if progress.running > 0 {
                        return Some((out, Some(progress)));
                    }
                    if let Some(usage_chunk) = &makers.usage {
                        let (prompt_tokens, completion_tokens) = (progress.prompt_tokens, progress.completion_tokens);
                        let total_tokens = prompt_tokens + completion_tokens;
                        out.push(usage_chunk(Usage { prompt_tokens, completion_tokens, total_tokens }));
                    }
                    out.push(Event::default().data("[DONE]"));
                    return Some((out, None));
                }
                Some((_, JobEvent::Failed(error))) => {
                    let out = vec![
                        json_event(&ErrorBody { error: ApiError::from_seam(error).detail }),
                        Event::default().data("[DONE]"),
                    ];
                    return Some((out, None));
                }
                None => return Some((Vec::new(), None)),
            };
            Some((out, Some(progress)))
        }
    });
    head.chain(body.flat_map(|events| stream::iter(events.into_iter().map(Ok))))
}

fn json_event<T: serde::Serialize>(value: &T) -> Event {
    Event::default().data(serde_json::to_string(value).unwrap_or_default())
}

impl AppState {
    /// A token's text and bytes, as log-probabilities report them.
    fn token_text(&self, id: u32) -> (String, Vec<u8>) {
        let bytes = self.model.tokenizer.token_bytes(id).unwrap_or_default();
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    }

    /// Chat's log-probabilities of `scored` tokens.
    fn chat_logprobs(&self, scored: &[TokenLogprobs]) -> ChatLogprobs {
        let score = |id: u32, logprob: f64| {
            let (token, bytes) = self.token_text(id);
            ChatTokenScore { token, logprob, bytes }
        };
        let content = scored
            .iter()
            .map(|entry| ChatTokenLogprob {
                scored: score(entry.token, entry.logprob),
                top_logprobs: entry.top.iter().map(|&(id, logprob)| score(id, logprob)).collect(),
            })
            .collect();
        ChatLogprobs { content }
    }

    /// Completions' log-probabilities of `tokens` (each with its scores, or none for an echoed
    /// prompt's first token), their text offsets counted on from `*offset`, which is advanced.
    fn completion_logprobs<'a>(
        &self,
        tokens: impl IntoIterator<Item = (u32, Option<&'a TokenLogprobs>)>,
        offset: &mut usize,
    ) -> CompletionLogprobs {
        let mut out = CompletionLogprobs::default();
        for (id, scores) in tokens {
            let (text, _) = self.token_text(id);
            out.text_offset.push(*offset);
            *offset += text.chars().count();
            out.tokens.push(text);
            out.token_logprobs.push(scores.map(|s| s.logprob));
            out.top_logprobs.push(scores.map(|s| {
                let mut top: Vec<(String, f64)> = Vec::with_capacity(s.top.len());
                for &(alternative, logprob) in &s.top {
                    let (text, _) = self.token_text(alternative);
                    if !top.iter().any(|(seen, _)| *seen == text) {
                        top.push((text, logprob));
                    }
                }
                TopLogprobs(top)
            }));
        }
        out
    }
}

/// The prompt's tokens with their scores: none for the first, then `scored` in order.
fn prompt_scores<'a>(
    prompt: &'a [u32],
    scored: &'a [TokenLogprobs],
) -> impl Iterator<Item = (u32, Option<&'a TokenLogprobs>)> {
    prompt.iter().enumerate().map(move |(i, &id)| (id, i.checked_sub(1).and_then(|j| scored.get(j))))
}

/// Generated tokens with their scores.
fn generated_scores(scored: &[TokenLogprobs]) -> impl Iterator<Item = (u32, Option<&TokenLogprobs>)> {
    scored.iter().map(|s| (s.token, Some(s)))
}

/// Answers a POST endpoint: its body as read (or why it could not be), then `handle`'s response
/// or error, counted in the metrics under `endpoint`.
async fn answer<F: Future<Output = Result<Response, ApiError>>>(
    state: &AppState,
    endpoint: &str,
    body: Result<RequestBody, ApiError>,
    handle: impl FnOnce(Bytes) -> F,
) -> Response {
    let response = match body {
        Ok(RequestBody(body)) => handle(body).await.unwrap_or_else(IntoResponse::into_response),
        Err(error) => error.into_response(),
    };
    state.metrics.answered(endpoint, response.status().as_u16());
    response
}

async fn chat_completions(State(state): State<Arc<AppState>>, body: Result<RequestBody, ApiError>) -> Response {
    answer(&state, "chat_completions", body, |body| chat_response(&state, body)).await
}

async fn chat_response(state: &Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let request: ChatRequest = parse(&body)?;
    state.check_model(request.model.as_deref())?;
    let prompt = chat_tokens(state, &request.messages, true).await?;
    let max_tokens = request.max_completion_tokens.or(request.params.max_tokens);
    let logprobs = chat_logprobs_request(&request.params)?;
    let prepared = state.prepare(vec![prompt], "messages", &request.params, max_tokens, logprobs, false)?;
    let submitted = state.submit(prepared)?;
    let (stream, include_usage, logprobs) = (submitted.stream, submitted.include_usage, submitted.logprobs);
    let choices = submitted.events.len();
    let id = state.new_id("chatcmpl");
    let created = unix_now();
    let model = state.model.id.clone();
    if !stream {
        let (collected, usage) = collect_all(submitted).await?;
        let choices = collected
            .into_iter()
            .enumerate()
            .map(|(index, collected)| ChatChoice {
                index,
                message: ChatMessageOut { role: "assistant", content: collected.text },
                finish_reason: finish_reason(collected.end),
                logprobs: logprobs.then(|| state.chat_logprobs(&collected.generated)),
            })
            .collect();
        return Ok(Json(ChatResponse { id, object: "chat.completion", created, model, choices, usage }).into_response());
    }
    let chunk_for = {
        let (id, model) = (id.clone(), model.clone());
        move |choice: Option<ChatChunkChoice>, usage: Option<Usage>| {
            json_event(&ChatChunk {
                id: id.clone(),
                object: "chat.completion.chunk",
                created,
                model: model.clone(),
                choices: choice.into_iter().collect(),
                usage,
            })
        }
    };
    let first = (0..choices)
        .map(|index| {
            let delta = Delta { role: Some("assistant"), content: Some(String::new()) };
            chunk_for(Some(ChatChunkChoice { index, delta, finish_reason: None, logprobs: None }), None)
        })
        .collect();
    let chunk: ChunkMaker = {
        let (chunk_for, state) = (chunk_for.clone(), Arc::clone(state));
        Box::new(move |index, text: String, scored: Vec<TokenLogprobs>, finish_reason| {
            let delta = Delta { role: None, content: (!text.is_empty()).then_some(text) };
            let logprobs = (logprobs && !scored.is_empty()).then(|| state.chat_logprobs(&scored));
            chunk_for(Some(ChatChunkChoice { index, delta, finish_reason, logprobs }), None)
        })
    };
    let usage: Option<UsageMaker> =
        include_usage.then(|| Box::new(move |usage| chunk_for(None, Some(usage))) as UsageMaker);
    let makers = StreamMakers { prompt: None, chunk, usage };
    Ok(Sse::new(event_stream(submitted, first, makers)).into_response())
}

/// A chat's messages, checked and rendered by the model's chat template (with the assistant's
/// turn opened when `add_generation_prompt`), as token ids.
async fn chat_tokens(
    state: &Arc<AppState>,
    messages_in: &[ChatMessageIn],
    add_generation_prompt: bool,
) -> Result<Vec<u32>, ApiError> {
    if messages_in.is_empty() {
        return Err(ApiError::invalid("messages must not be empty", Some("messages")));
    }
    let mut messages = Vec::with_capacity(messages_in.len());
    for message in messages_in {
        let role = match message.role.as_str() {
            role @ ("system" | "user" | "assistant") => role,
            // OpenAI's newer name for system instructions; chat templates know `system`.
            "developer" => "system",
            "tool" | "function" => {
                return Err(ApiError::invalid(
                    format!("'{}' messages are not supported: this server calls no tools", message.role),
                    Some("messages"),
                ))
            }
            other => {
                return Err(ApiError::invalid(
                    format!("unknown message role '{other}' (system, developer, user or assistant)"),
                    Some("messages"),
                ))
            }
        };
        if message.tool_calls.as_ref().is_some_and(|calls| !calls.is_empty()) {
            return Err(ApiError::invalid(
                "tool calls are not supported: this server calls no tools",
                Some("messages"),
            ));
        }
        let content = match &message.content {
            // Only an assistant's turn may come without text (OpenAI's rule).
            None if role == "assistant" => String::new(),
            None => return Err(ApiError::invalid(format!("a '{role}' message needs content"), Some("messages"))),
            Some(Content::Text(text)) => text.clone(),
            Some(Content::Parts(parts)) => {
                if let Some(part) = parts.iter().find(|p| p.kind != "text") {
                    return Err(ApiError::invalid(
                        format!("content parts of type '{}' are not supported (only text)", part.kind),
                        Some("messages"),
                    ));
                }
                parts.iter().filter_map(|p| p.text.as_deref()).collect::<Vec<_>>().join("")
            }
        };
        messages.push(ChatMessage::new(role, content));
    }
    if state.model.chat_template.is_none() {
        return Err(ApiError::invalid("this model has no chat template; use /v1/completions", None));
    }
    let shared = Arc::clone(state);
    tokenize(move || {
        let template = shared.model.chat_template.as_ref().expect("checked above");
        let rendered = template.render(&messages, add_generation_prompt, &shared.special_tokens).map_err(|e| {
            ApiError::invalid(format!("the chat template failed on these messages: {e}"), Some("messages"))
        })?;
        shared.model.tokenizer.encode_chat(&rendered).map_err(|e| ApiError::from_seam(e.into()))
    })
    .await
}

/// Chat's `logprobs` (a flag) and `top_logprobs`.
fn chat_logprobs_request(params: &Params) -> Result<Option<LogprobsRequest>, ApiError> {
    let top = params.top_logprobs;
    match params.logprobs {
        Some(LogprobsParam::Count(_)) => Err(ApiError::invalid(
            "chat takes logprobs as true or false (top_logprobs gives the alternatives)",
            Some("logprobs"),
        )),
        Some(LogprobsParam::Flag(true)) => match top {
            Some(n) if n > MAX_TOP_LOGPROBS => Err(ApiError::invalid(
                format!("top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
                Some("top_logprobs"),
            )),
            _ => Ok(Some(LogprobsRequest { top: top.unwrap_or(0) as usize, prompt: false })),
        },
        None | Some(LogprobsParam::Flag(false)) if top.is_some() => {
            Err(ApiError::invalid("top_logprobs needs logprobs set to true", Some("top_logprobs")))
        }
        None | Some(LogprobsParam::Flag(false)) => Ok(None),
    }
}

async fn completions(State(state): State<Arc<AppState>>, body: Result<RequestBody, ApiError>) -> Response {
    answer(&state, "completions", body, |body| completion_response(&state, body)).await
}

async fn completion_response(state: &Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let request: CompletionRequest = parse(&body)?;
    state.check_model(request.model.as_deref())?;
    if request.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix (insertion) is not supported", Some("suffix")));
    }
    if request.best_of.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("only best_of = 1 is supported", Some("best_of")));
    }
    let logprobs = match request.params.logprobs {
        None | Some(LogprobsParam::Flag(false)) => None,
        Some(LogprobsParam::Count(n)) if n <= MAX_TOP_LOGPROBS => {
            Some(LogprobsRequest { top: n as usize, prompt: request.echo })
        }
        Some(_) => {
            return Err(ApiError::invalid(
                format!("completions take logprobs as a number of alternatives, 0 to {MAX_TOP_LOGPROBS}"),
                Some("logprobs"),
            ))
        }
    };
    if request.params.top_logprobs.is_some() {
        return Err(ApiError::invalid(
            "top_logprobs is chat's parameter; completions take logprobs as a number",
            Some("top_logprobs"),
        ));
    }
    let (prompts, texts): (Vec<Vec<u32>>, Vec<Option<String>>) = match request.prompt {
        Prompt::Tokens(tokens) => (vec![tokens], vec![None]),
        Prompt::TokenLists(lists) => {
            let count = lists.len();
            (lists, vec![None; count])
        }
        Prompt::Text(text) => (vec![encode(state, text.clone(), true).await?], vec![Some(text)]),
        Prompt::Texts(texts) => {
            let mut prompts = Vec::with_capacity(texts.len());
            for text in &texts {
                prompts.push(encode(state, text.clone(), true).await?);
            }
            (prompts, texts.into_iter().map(Some).collect())
        }
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("the prompt list is empty", Some("prompt")));
    }
    // What an echo repeats, per prompt: the prompt as sent, or the text of its token ids.
    let echoes: Option<Vec<(Vec<u32>, String)>> = match request.echo {
        false => None,
        true => Some(
            prompts
                .iter()
                .zip(texts)
                .map(|(prompt, text)| {
                    let text = match text {
                        Some(text) => text,
                        None => {
                            state.model.tokenizer.decode(prompt, true).map_err(|e| ApiError::from_seam(e.into()))?
                        }
                    };
                    Ok((prompt.clone(), text))
                })
                .collect::<Result<_, ApiError>>()?,
        ),
    };
    let n = request.params.n.unwrap_or(1) as usize;
    let prepared =
        state.prepare(prompts, "prompt", &request.params, request.params.max_tokens, logprobs, echoes.is_some())?;
    let submitted = state.submit(prepared)?;
    let (stream, include_usage, logprobs) = (submitted.stream, submitted.include_usage, submitted.logprobs);
    let choices = submitted.events.len();
    // The echo of choice `index` (its prompt's: a prompt's `n` choices follow each other).
    let echoes = echoes.map(Arc::new);
    let echo_of = {
        let echoes = echoes.clone();
        move |index: usize| echoes.as_ref().map(|echoes| echoes[index / n].clone())
    };
    let id = state.new_id("cmpl");
    let created = unix_now();
    let model = state.model.id.clone();
    let response = move |choices: Vec<CompletionChoice>, usage: Option<Usage>| CompletionResponse {
        id: id.clone(),
        object: "text_completion",
        created,
        model: model.clone(),
        choices,
        usage,
    };
    if !stream {
        let (collected, usage) = collect_all(submitted).await?;
        let choices = collected
            .into_iter()
            .enumerate()
            .map(|(index, collected)| {
                let mut offset = 0;
                let (text, scores) = match echo_of(index) {
                    Some((prompt, prompt_text)) => {
                        let scored = collected.prompt.as_deref().unwrap_or_default();
                        let scores = logprobs.then(|| {
                            let tokens = prompt_scores(&prompt, scored).chain(generated_scores(&collected.generated));
                            state.completion_logprobs(tokens, &mut offset)
                        });
                        (format!("{prompt_text}{}", collected.text), scores)
                    }
                    None => {
                        let tokens = generated_scores(&collected.generated);
                        let scores = logprobs.then(|| state.completion_logprobs(tokens, &mut offset));
                        (collected.text, scores)
                    }
                };
                let finish_reason = Some(finish_reason(collected.end));
                CompletionChoice { index, text, finish_reason, logprobs: scores }
            })
            .collect();
        return Ok(Json(response(choices, Some(usage))).into_response());
    }
    // Each choice's text offsets run on over its chunks.
    let offsets = Arc::new(std::sync::Mutex::new(vec![0usize; choices]));
    let scores_of = {
        let state = Arc::clone(state);
        move |index: usize, tokens: Vec<(u32, Option<&TokenLogprobs>)>| {
            let mut offsets = offsets.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            state.completion_logprobs(tokens, &mut offsets[index])
        }
    };
    let scores_of = Arc::new(scores_of);
    let choice = |index, text, finish_reason, logprobs| vec![CompletionChoice { index, text, finish_reason, logprobs }];
    let chunk: ChunkMaker = {
        let (response, scores_of) = (response.clone(), Arc::clone(&scores_of));
        Box::new(move |index, text: String, scored: Vec<TokenLogprobs>, finish| {
            let scores =
                (logprobs && !scored.is_empty()).then(|| scores_of(index, generated_scores(&scored).collect()));
            json_event(&response(choice(index, text, finish, scores), None))
        })
    };
    let (mut first, mut prompt_chunk) = (Vec::new(), None);
    if echoes.is_some() {
        if logprobs {
            let (response, scores_of) = (response.clone(), Arc::clone(&scores_of));
            let echo_of = echo_of.clone();
            prompt_chunk = Some(Box::new(move |index: usize, scored: Vec<TokenLogprobs>| {
                let (prompt, text) = echo_of(index).expect("an echoed request");
                let scores = scores_of(index, prompt_scores(&prompt, &scored).collect());
                json_event(&response(choice(index, text, None, Some(scores)), None))
            }) as PromptChunkMaker);
        } else {
            first = (0..choices)
                .filter_map(|index| {
                    echo_of(index).map(|(_, text)| json_event(&response(choice(index, text, None, None), None)))
                })
                .collect();
        }
    }
    let usage: Option<UsageMaker> =
        include_usage.then(|| Box::new(move |usage| json_event(&response(Vec::new(), Some(usage)))) as UsageMaker);
    let makers = StreamMakers { prompt: prompt_chunk, chunk, usage };
    Ok(Sse::new(event_stream(submitted, first, makers)).into_response())
}

/// Encodes a prompt's text (with what the tokenizer puts around a sequence when
/// `add_special_tokens`), off the reactor.
async fn encode(state: &Arc<AppState>, text: String, add_special_tokens: bool) -> Result<Vec<u32>, ApiError> {
    let shared = Arc::clone(state);
    let work =
        move || shared.model.tokenizer.encode(&text, add_special_tokens).map_err(|e| ApiError::from_seam(e.into()));
    tokenize(work).await
}

async fn tokenize_text(State(state): State<Arc<AppState>>, body: Result<RequestBody, ApiError>) -> Response {
    answer(&state, "tokenize", body, |body| tokenize_response(&state, body)).await
}

async fn tokenize_response(state: &Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let request: TokenizeRequest = parse(&body)?;
    state.check_model(request.model.as_deref())?;
    let tokens = match (request.prompt, request.messages) {
        (Some(text), None) => encode(state, text, request.add_special_tokens).await?,
        (None, Some(messages)) => chat_tokens(state, &messages, request.add_generation_prompt).await?,
        _ => return Err(ApiError::invalid("give either prompt or messages", Some("prompt"))),
    };
    let count = tokens.len();
    Ok(Json(TokenizeResponse { tokens, count, max_model_len: state.max_context }).into_response())
}

async fn detokenize_tokens(State(state): State<Arc<AppState>>, body: Result<RequestBody, ApiError>) -> Response {
    answer(&state, "detokenize", body, |body| detokenize_response(&state, body)).await
}

async fn detokenize_response(state: &AppState, body: Bytes) -> Result<Response, ApiError> {
    let request: DetokenizeRequest = parse(&body)?;
    state.check_model(request.model.as_deref())?;
    let prompt = state
        .model
        .tokenizer
        .decode(&request.tokens, false)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("tokens")))?;
    Ok(Json(DetokenizeResponse { prompt }).into_response())
}

async fn tokenizer_info(State(state): State<Arc<AppState>>) -> Json<TokenizerInfo> {
    let template = state.model.chat_template.as_ref();
    let tokenizer = &state.model.tokenizer;
    let first_eos = state.model.eos_ids.first().and_then(|&id| tokenizer.id_to_token(id));
    Json(TokenizerInfo {
        eos_token: template.and_then(|t| t.eos_token().map(str::to_string)).or(first_eos),
        bos_token: template.and_then(|t| t.bos_token().map(str::to_string)),
        chat_template: template.map(|t| t.source().to_string()),
        model_max_length: state.max_context,
        vocab_size: state.vocab_size,
    })
}

async fn models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: state.model.id.clone(),
            object: "model",
            created: state.started,
            owned_by: "seam",
            max_model_len: state.max_context,
        }],
    })
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    match state.scheduler.is_open() {
        true => (StatusCode::OK, Json(serde_json::json!({"status": "ok"}))).into_response(),
        false => shutting_down().into_response(),
    }
}

async fn metrics_text(State(state): State<Arc<AppState>>) -> Response {
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], state.metrics.render())
        .into_response()
}

async fn method_not_allowed() -> ApiError {
    ApiError::invalid(
        "this endpoint does not take that method (completions, tokenize and detokenize take POST; models, \
         tokenizer_info, health and metrics GET)",
        None,
    )
    .with_status(StatusCode::METHOD_NOT_ALLOWED)
}

async fn not_found() -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        detail: ErrorDetail {
            message: "no such endpoint (see /v1/chat/completions, /v1/completions, /v1/models, /tokenize, \
                      /detokenize, /tokenizer_info, /health, /metrics)"
                .into(),
            kind: "not_found_error",
            param: None,
            code: None,
        },
        retry_after: None,
    }
}
