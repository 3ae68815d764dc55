//! Generation statistics, the same for every backend, serializable as JSON.

use serde::Serialize;
use std::time::Duration;

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model produced one of the EOS ids.
    Eos,
    /// `max_tokens` were generated.
    MaxTokens,
    /// A stop string appeared in the text.
    StopString,
    /// The caller cancelled.
    Cancelled,
    /// The session's context is full.
    ContextFull,
}

/// Distribution of per-step times in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct StepTimeSummary {
    pub min_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
}

impl StepTimeSummary {
    /// Summarizes per-step times (nearest-rank percentiles); all zero when there are none.
    pub fn from_steps(steps_ms: &[f64]) -> Self {
        if steps_ms.is_empty() {
            return StepTimeSummary::default();
        }
        let mut sorted = steps_ms.to_vec();
        sorted.sort_by(f64::total_cmp);
        let rank = |p: f64| sorted[(((p / 100.0) * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1];
        StepTimeSummary {
            min_ms: sorted[0],
            p50_ms: rank(50.0),
            p90_ms: rank(90.0),
            max_ms: sorted[sorted.len() - 1],
            mean_ms: sorted.iter().sum::<f64>() / sorted.len() as f64,
        }
    }
}

/// What one generation cost, measured above the seam so every backend is measured the same way.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct GenerationStats {
    /// Engine load time, when the caller knows it (see [`crate::EngineInfo::load_time`]).
    pub load_ms: Option<f64>,
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated (the first one comes from prefill).
    pub generated_tokens: usize,
    /// Time to first token: the prefill call, which returns the first generated token.
    pub time_to_first_token_ms: f64,
    /// Prompt tokens per second of the prefill call.
    pub prefill_tokens_per_s: f64,
    /// Decode calls made.
    pub decode_steps: usize,
    /// Total time in decode calls.
    pub decode_ms: f64,
    /// Decode calls per second.
    pub decode_tokens_per_s: f64,
    /// Distribution of the decode step times.
    pub decode_step: StepTimeSummary,
    /// Every decode step time, in order, for plots and percentiles of one's own.
    pub decode_step_times_ms: Vec<f64>,
    /// Wall time of the whole generation, prefill included.
    pub total_ms: f64,
    /// Why it stopped.
    pub finish_reason: Option<FinishReason>,
}

impl GenerationStats {
    /// Fills the derived figures from the raw timings.
    pub(crate) fn finish(&mut self, prefill: Duration, steps_ms: Vec<f64>, total: Duration, reason: FinishReason) {
        self.time_to_first_token_ms = prefill.as_secs_f64() * 1000.0;
        self.prefill_tokens_per_s = per_second(self.prompt_tokens, prefill.as_secs_f64());
        self.decode_steps = steps_ms.len();
        self.decode_ms = steps_ms.iter().sum();
        self.decode_tokens_per_s = per_second(self.decode_steps, self.decode_ms / 1000.0);
        self.decode_step = StepTimeSummary::from_steps(&steps_ms);
        self.decode_step_times_ms = steps_ms;
        self.total_ms = total.as_secs_f64() * 1000.0;
        self.finish_reason = Some(reason);
    }

    /// A few human lines for the end of `seam run`.
    pub fn summary(&self) -> String {
        let mut lines = Vec::new();
        if let Some(load) = self.load_ms {
            lines.push(format!("load          {load:>9.1} ms"));
        }
        lines.push(format!(
            "prefill       {:>9.1} ms  {:>8.1} tok/s  ({} tokens; time to first token)",
            self.time_to_first_token_ms, self.prefill_tokens_per_s, self.prompt_tokens
        ));
        lines.push(format!(
            "decode        {:>9.1} ms  {:>8.1} tok/s  ({} steps; p50 {:.2} ms, p90 {:.2} ms)",
            self.decode_ms,
            self.decode_tokens_per_s,
            self.decode_steps,
            self.decode_step.p50_ms,
            self.decode_step.p90_ms
        ));
        if let Some(reason) = self.finish_reason {
            lines.push(format!("finished      {reason:?} after {} tokens", self.generated_tokens));
        }
        lines.join("\n")
    }
}

fn per_second(count: usize, seconds: f64) -> f64 {
    if seconds > 0.0 {
        count as f64 / seconds
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let steps: Vec<f64> = (1..=10).map(f64::from).collect();
        let s = StepTimeSummary::from_steps(&steps);
        assert_eq!((s.min_ms, s.p50_ms, s.p90_ms, s.max_ms), (1.0, 5.0, 9.0, 10.0));
        assert_eq!(s.mean_ms, 5.5);
        assert_eq!(StepTimeSummary::from_steps(&[]), StepTimeSummary::default());
    }
}

/// The memory of this process, from `/proc/self/status` (Linux): what benchmarks and the
/// conformance suite compare against the bytes a model holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ProcessMemory {
    /// Resident now (`VmRSS`): anonymous memory and the mapped file pages touched.
    pub resident_bytes: u64,
    /// The most ever resident (`VmHWM`), since the process started its program.
    pub peak_bytes: u64,
}

/// Hands memory the allocator holds freed back to the operating system, where the allocator
/// keeps it otherwise (glibc's malloc keeps freed heap pages of its arenas resident). Worth
/// calling once after a load: parsing a tokenizer and the runtime's loading free far more than
/// they keep, and a long-running process (a server) would otherwise hold that memory for good.
pub fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            // glibc, <malloc.h>: returns 1 if memory was released.
            fn malloc_trim(pad: usize) -> std::ffi::c_int;
        }
        // SAFETY: malloc_trim takes no pointers and may be called at any time.
        unsafe { malloc_trim(0) };
    }
}

impl ProcessMemory {
    /// This process's memory now; `None` where `/proc/self/status` is not there to read.
    pub fn now() -> Option<ProcessMemory> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let kib = |key: &str| -> Option<u64> {
            let line = status.lines().find(|l| l.starts_with(key))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|k| k * 1024)
        };
        Some(ProcessMemory { resident_bytes: kib("VmRSS:")?, peak_bytes: kib("VmHWM:")? })
    }
}
