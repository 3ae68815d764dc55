//! The machine's memory read bandwidth, measured the way decode reads weights: every core
//! streaming through its share of a buffer far larger than the last-level cache.

use crate::pool::Pool;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// The buffer the probe reads, by default: larger than the last-level caches of the machines
/// seam runs on (some server parts carry hundreds of MiB of L3), so that what is timed is memory.
pub const DEFAULT_PROBE_BYTES: usize = 1 << 30;

/// Bytes per second read by `pool`'s threads summing a buffer of `bytes` (the best of five
/// passes after one that faults the pages in). A STREAM-like read probe: the sums are 64-bit
/// integer lanes, so the adds never hold the loads back.
pub fn measure_read_bandwidth(pool: &Pool, bytes: usize) -> f64 {
    const LANES: usize = 8;
    let words = (bytes / 8).max(LANES);
    // Distinct values, so no pass can be folded away; written once, which also faults the pages in.
    let data: Vec<u64> = (0..words as u64).collect();
    let tasks = pool.threads() * 8;
    let chunk = words.div_ceil(tasks).next_multiple_of(LANES);
    let sums: Vec<AtomicU64> = (0..tasks).map(|_| AtomicU64::new(0)).collect();
    let pass = || {
        pool.run(tasks, &|t| {
            let part = &data[(t * chunk).min(words)..((t + 1) * chunk).min(words)];
            let mut acc = [0u64; LANES];
            for c in part.chunks_exact(LANES) {
                // Ask for the memory ahead as the kernels do (`matmul::PREFETCH_AHEAD`): without
                // it the probe read less than the kernels' own decode products.
                #[cfg(target_arch = "x86_64")]
                // SAFETY: a prefetch never faults, whatever the address.
                unsafe {
                    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                    _mm_prefetch::<_MM_HINT_T0>((c.as_ptr() as *const i8).wrapping_add(crate::matmul::PREFETCH_AHEAD));
                }
                for i in 0..LANES {
                    acc[i] = acc[i].wrapping_add(c[i]);
                }
            }
            let total = acc.iter().fold(0u64, |a, &b| a.wrapping_add(b));
            sums[t].fetch_add(total, Ordering::Relaxed);
        });
    };
    let best = best_seconds(5, pass);
    black_box(&sums);
    (words * 8) as f64 / best
}

/// Seconds of the fastest of `repeats` timed runs of `pass`, after one untimed run that warms
/// the caches and faults the pages in: how the probe and the kernels' rate examples time work.
pub fn best_seconds(repeats: usize, mut pass: impl FnMut()) -> f64 {
    pass();
    let mut best = f64::INFINITY;
    for _ in 0..repeats {
        let started = Instant::now();
        pass();
        best = best.min(started.elapsed().as_secs_f64());
    }
    best
}

/// The probe as a backend running these kernels reports it: the process's kernel pool
/// ([`Pool::global`], the threads decode runs on) reading [`DEFAULT_PROBE_BYTES`].
pub fn measure_host_read_bandwidth() -> f64 {
    measure_read_bandwidth(Pool::global(), DEFAULT_PROBE_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_probe_reads_at_a_plausible_rate() {
        // Cache-resident here, so only a sanity bound: more than 100 MB/s, less than 10 TB/s.
        let rate = measure_read_bandwidth(&Pool::new(2), 4 << 20);
        assert!(rate > 1e8 && rate < 1e13, "{rate} bytes/s");
    }
}
