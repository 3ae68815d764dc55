//! `GET /metrics`: the server's counters, gauges and histograms in Prometheus' text format.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Labels of the request counter: the endpoint and the HTTP status answered.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct RequestLabels {
    /// `chat_completions`, `completions`, ...
    pub endpoint: String,
    /// The status code.
    pub status: u16,
}

/// Everything `/metrics` reports. The engine thread and the handlers update it; the types are
/// atomic, so no lock is held across a step.
pub struct Metrics {
    registry: Registry,
    /// HTTP requests answered, by endpoint and status.
    pub requests: Family<RequestLabels, Counter>,
    /// Generations that ran to their end.
    pub completed: Counter,
    /// Generations whose client went away, or that never got a slot before it did.
    pub cancelled: Counter,
    /// Generations the backend failed.
    pub failed: Counter,
    /// Prompt tokens of the requests whose prompt was read in.
    pub prompt_tokens: Counter,
    /// Of those, the tokens a kept session already held (a shared prefix), not prefilled again.
    pub prompt_tokens_reused: Counter,
    /// Tokens generated.
    pub generation_tokens: Counter,
    /// Requests waiting for a slot.
    pub queue_depth: Gauge,
    /// Requests holding a slot.
    pub running: Gauge,
    /// Sequences per batched decode step.
    pub batch_size: Histogram,
    /// From a request's arrival to its first token, in seconds.
    pub time_to_first_token: Histogram,
    /// Between two tokens of one request, in seconds.
    pub inter_token_latency: Histogram,
    /// From a request's arrival to its end, in seconds.
    pub request_duration: Histogram,
}

impl Metrics {
    /// Fresh metrics, all zero.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("seam");
        let requests = Family::<RequestLabels, Counter>::default();
        let completed = Counter::default();
        let cancelled = Counter::default();
        let failed = Counter::default();
        let prompt_tokens = Counter::default();
        let prompt_tokens_reused = Counter::default();
        let generation_tokens = Counter::default();
        let queue_depth = Gauge::default();
        let running = Gauge::default();
        let batch_size = Histogram::new([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]);
        // 1 ms to about 65 s.
        let time_to_first_token = Histogram::new(exponential_buckets(0.001, 2.0, 17));
        let inter_token_latency = Histogram::new(exponential_buckets(0.001, 2.0, 14));
        let request_duration = Histogram::new(exponential_buckets(0.01, 2.0, 16));
        registry.register("http_requests", "HTTP requests answered, by endpoint and status", requests.clone());
        registry.register("requests_completed", "Generations that ran to their end", completed.clone());
        registry.register("requests_cancelled", "Generations whose client went away", cancelled.clone());
        registry.register("requests_failed", "Generations the backend failed", failed.clone());
        registry.register("prompt_tokens", "Prompt tokens of requests whose prompt was read in", prompt_tokens.clone());
        registry.register(
            "prompt_tokens_reused",
            "Prompt tokens a kept session already held (a shared prefix), not prefilled again",
            prompt_tokens_reused.clone(),
        );
        registry.register("generation_tokens", "Tokens generated", generation_tokens.clone());
        registry.register("queue_depth", "Requests waiting for a slot", queue_depth.clone());
        registry.register("running_requests", "Requests holding a slot", running.clone());
        registry.register("batch_size", "Sequences per batched decode step", batch_size.clone());
        registry.register(
            "time_to_first_token_seconds",
            "From a request's arrival to its first token",
            time_to_first_token.clone(),
        );
        registry.register(
            "inter_token_latency_seconds",
            "Between two tokens of one request",
            inter_token_latency.clone(),
        );
        registry.register("request_duration_seconds", "From a request's arrival to its end", request_duration.clone());
        Metrics {
            registry,
            requests,
            completed,
            cancelled,
            failed,
            prompt_tokens,
            prompt_tokens_reused,
            generation_tokens,
            queue_depth,
            running,
            batch_size,
            time_to_first_token,
            inter_token_latency,
            request_duration,
        }
    }

    /// Counts an answered HTTP request.
    pub fn answered(&self, endpoint: &str, status: u16) {
        self.requests.get_or_create(&RequestLabels { endpoint: endpoint.to_string(), status }).inc();
    }

    /// The text exposition (OpenMetrics text, which Prometheus reads).
    pub fn render(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        encode(&mut text, &self.registry).expect("encoding metrics into a string");
        text
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
