//! Batched decode attention per step as `seam serve` runs it: SEQUENCES sequences, each against
//! its own caches in each of SmolLM2's 30 layers (512-position caches, LEN positions filled),
//! with the caches cold: between steps a read of 64 MiB stands for the weights a step streams
//! through the caches (read, not written, as weights leave nothing to write back).
//!
//! `cargo run --release -p cpu-kernels --example attention_batch_rate [-- SEQUENCES LEN] [hot]`:
//! `hot` leaves the caches where the last step left them.
use cpu_kernels::pool::Pool;
use cpu_kernels::{attention_decode_batch, AttentionShape, Isa, StepEntries};
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (sequences, len) = (args.first().copied().unwrap_or(8), args.get(1).copied().unwrap_or(70));
    let hot = std::env::args().any(|a| a == "hot");
    let (heads, kv_heads, d, layers, c) = (9, 3, 64, 30, 512);
    let pool = Pool::global();
    let shape = AttentionShape { heads, kv_heads, head_dim: d, capacity: c };
    let mut caches: Vec<Vec<(Vec<f32>, Vec<f32>)>> = (0..layers)
        .map(|l| {
            (0..sequences)
                .map(|s| {
                    let k = (0..kv_heads * d * c).map(|i| ((i * 7 + l + s) % 13) as f32 * 0.01).collect();
                    let v = (0..kv_heads * c * d).map(|i| ((i * 5 + l + s) % 11) as f32 * 0.01).collect();
                    (k, v)
                })
                .collect()
        })
        .collect();
    let q: Vec<f32> = (0..sequences * heads * d).map(|i| (i % 17) as f32 * 0.01).collect();
    let mut out = vec![0.0f32; sequences * heads * d];
    // Each step writes its entry at position LEN - 1 and attends over LEN positions.
    let positions = vec![len - 1; sequences];
    let new_kv: Vec<f32> = (0..sequences * kv_heads * d).map(|i| (i % 19) as f32 * 0.01).collect();
    let entries = StepEntries { keys: &new_kv, values: &new_kv, positions: &positions };
    let sweep: Vec<u8> = (0..64usize << 20).map(|i| i as u8).collect();
    let mut swept = 0usize;
    let (warm, steps) = (4, 40);
    let (mut best, mut total) = (Duration::MAX, Duration::ZERO);
    for step in 0..warm + steps {
        if !hot {
            swept += sweep.iter().step_by(64).map(|&b| b as usize).sum::<usize>();
        }
        let t = Instant::now();
        for layer in &mut caches {
            let mut views: Vec<(&mut [f32], &mut [f32])> =
                layer.iter_mut().map(|(k, v)| (k.as_mut_slice(), v.as_mut_slice())).collect();
            attention_decode_batch(Isa::best(), pool, shape, &q, entries, &mut views, &mut out).unwrap();
        }
        let took = t.elapsed();
        if step >= warm {
            best = best.min(took);
            total += took;
        }
    }
    println!(
        "{sequences} sequences x {len} positions, {layers} layers, {}: best {:.0} us, mean {:.0} us per step{}",
        if hot { "hot" } else { "cold" },
        best.as_secs_f64() * 1e6,
        total.as_secs_f64() * 1e6 / steps as f64,
        // Keeps the sweep's reads from being optimized away.
        if swept == usize::MAX { "." } else { "" }
    );
}
