//! Decode attention per step: one query position against each of 30 layers' caches (distinct
//! buffers, as in a model), at a few context lengths, for SmolLM2's and Llama-3.2-1B's heads.
//!
//! `cargo run --release -p cpu-kernels --example attention_rate`
use cpu_kernels::pool::Pool;
use cpu_kernels::{attention_decode, AttentionShape, Isa};
use std::time::Instant;

fn main() {
    let pool = Pool::global();
    for (name, heads, kv_heads, d, layers) in [("smollm2", 9, 3, 64, 30), ("llama-1b", 32, 8, 64, 16)] {
        let c = 2048;
        let shape = AttentionShape { heads, kv_heads, head_dim: d, capacity: c };
        let caches: Vec<(Vec<f32>, Vec<f32>)> = (0..layers)
            .map(|l| {
                let k = (0..kv_heads * d * c).map(|i| ((i * 7 + l) % 13) as f32 * 0.01).collect();
                let v = (0..kv_heads * c * d).map(|i| ((i * 5 + l) % 11) as f32 * 0.01).collect();
                (k, v)
            })
            .collect();
        let q: Vec<f32> = (0..heads * d).map(|i| (i % 17) as f32 * 0.01).collect();
        let mut out = vec![0.0f32; heads * d];
        for len in [64usize, 256, 1024, 2048] {
            let mut step = || {
                for (k, v) in &caches {
                    attention_decode(Isa::best(), pool, shape, &q, k, v, len, &mut out).unwrap();
                }
            };
            for _ in 0..3 {
                step();
            }
            let mut best = f64::MAX;
            for _ in 0..5 {
                let t = Instant::now();
                for _ in 0..10 {
                    step();
                }
                best = best.min(t.elapsed().as_secs_f64() / 10.0);
            }
            println!(
                "{name:<9} {heads}/{kv_heads} heads x {d}, {layers} layers, {len:>4} positions: {:>8.1} us per step",
                best * 1e6
            );
        }
    }
}
