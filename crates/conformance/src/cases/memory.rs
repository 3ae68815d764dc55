//! Many sessions created and dropped leave the process's memory where it was.
//!
//! Measured as the process's resident set (`VmRSS` of `/proc/self/status`) before and after
//! [`SESSIONS`] sessions that each prefill [`PREFILL`] tokens and decode one, created and dropped
//! a few at a time. A warm-up round first lets allocator arenas and per-thread pools reach their
//! steady size, so that only growth that scales with the number of sessions remains. Each side
//! is the least of five readings over 100 ms, each after
//! `session_api::stats::release_freed_memory`: memory freed but kept by the allocator, and work
//! still finishing when the last session was dropped (pjrt-cpu launching greedy steps ahead moved
//! one reading by 8-9 MiB either way in about one run in eight, 2026-11-30), are not counted as
//! held, while memory still allocated is, at every reading.
//!
//! Tolerance: `max(4 MiB, 10% of SESSIONS × one session's KV cache)`, the cache estimated as
//! `2 (K and V) × layers × kv_heads × head_dim × positions × 2 bytes` (f16; an f32 cache is twice
//! that). A backend that leaks every session's cache grows by ten times the tolerance or more; one
//! that leaks nothing stays within allocator noise.

use super::{Case, CaseContext};
use crate::report::Figures;
use crate::verdict::{Checked, OrFail, Verdict};

/// The memory case.
pub const CASE: Case = Case {
    name: "kv.many_sessions_memory",
    about: "200 sessions created, prefilled and dropped leave resident memory where it was",
    missing: super::needs_nothing,
    run,
};

/// Sessions measured.
pub const SESSIONS: usize = 200;
/// Environment variable that sets another number of sessions for a longer soak
/// (`scripts/soak.sh` uses 1,000); the tolerance scales with it.
pub const SESSIONS_ENV: &str = "SEAM_MEMORY_CASE_SESSIONS";

/// [`SESSIONS`], or the number [`SESSIONS_ENV`] sets.
fn sessions() -> usize {
    std::env::var(SESSIONS_ENV).ok().and_then(|v| v.parse().ok()).filter(|&n| n > 0).unwrap_or(SESSIONS)
}
/// Tokens each prefills.
pub const PREFILL: usize = 384;
/// Sessions alive at once (so that a backend pooling a few caches is not penalized).
const ALIVE: usize = 8;
/// Floor of the tolerance, for allocator noise.
const MIN_TOLERANCE: i64 = 4 << 20;
/// Readings of the resident set per side, and the time they span.
const READINGS: usize = 5;
const SETTLE: std::time::Duration = std::time::Duration::from_millis(100);

fn run(ctx: &CaseContext<'_>) -> Checked<Verdict> {
    let Some(config) = &ctx.model.config else {
        return Ok(Verdict::unavailable("the memory case needs a model whose shape the suite knows"));
    };
    if resident_bytes().is_none() {
        return Ok(Verdict::unavailable("resident memory is not measurable here (no /proc/self/status)"));
    }
    let prompt = ctx.prompt(PREFILL, 140);
    let cycle = |count: usize| -> Checked<()> {
        let mut alive = Vec::with_capacity(ALIVE);
        for i in 0..count {
            let mut session = ctx.greedy_session()?;
            let out = session.prefill(&prompt).or_fail(|| format!("session {i}: prefill of {PREFILL} tokens"))?;
            session.decode(out.token).or_fail(|| format!("session {i}: decode"))?;
            alive.push(session);
            if alive.len() == ALIVE {
                alive.clear();
            }
        }
        Ok(())
    };
    let held = || {
        let mut least = i64::MAX;
        for reading in 0..READINGS {
            if reading > 0 {
                std::thread::sleep(SETTLE / (READINGS as u32 - 1));
            }
            session_api::stats::release_freed_memory();
            least = least.min(resident_bytes().unwrap_or(0));
        }
        least
    };
    cycle(4 * ALIVE)?;
    let before = held();
    let sessions = sessions();
    cycle(sessions)?;
    let after = held();

    let per_session = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * (PREFILL + 1) * 2;
    let tolerance = MIN_TOLERANCE.max((sessions * per_session / 10) as i64);
    let growth = after - before;
    let figures =
        Figures { rss_growth_bytes: Some(growth), rss_tolerance_bytes: Some(tolerance), ..Figures::default() };
    let detail = format!(
        "{sessions} sessions of {} positions (≥ {} KiB of KV cache each at f16)",
        PREFILL + 1,
        per_session / 1024
    );
    if growth > tolerance {
        return Ok(Verdict::fail(format!("{detail}: resident memory grew beyond tolerance")).with_figures(figures));
    }
    Ok(Verdict::pass(detail).with_figures(figures))
}

/// The process's resident set in bytes ([`session_api::stats::ProcessMemory`]).
pub fn resident_bytes() -> Option<i64> {
    session_api::stats::ProcessMemory::now().map(|m| m.resident_bytes as i64)
}

#[cfg(test)]
mod tests {
    #[test]
    fn resident_memory_is_readable_and_sees_a_touched_allocation() {
        let Some(before) = super::resident_bytes() else { return };
        // black_box: an optimized build would otherwise remove the unused block, and RSS with it.
        let block = std::hint::black_box(vec![1u8; 64 << 20]);
        let after = super::resident_bytes().unwrap();
        assert!(
            after.saturating_sub(before) > 32 << 20,
            "64 MiB touched, RSS grew by {}",
            after.saturating_sub(before)
        );
        drop(std::hint::black_box(block));
    }
}
