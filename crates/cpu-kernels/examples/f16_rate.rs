//! Time of one Llama-3.2-1B layer's f16 products (query, key, value, output, gate, up, down:
//! 116 MB of weights, more than the caches hold) for calls of a few tokens, on a pool of both
//! threads: where a short prefill or a batch of f16 decodes spends its products.
//!
//! `cargo run --release -p cpu-kernels --example f16_rate -- [TOKENS ...]` (default 1 2 4 8 12
//! 16 24 32); `SEAM_CPU_ISA=avx2` times the AVX2 paths.
use cpu_kernels::bandwidth::best_seconds;
use cpu_kernels::pool::Pool;
use cpu_kernels::{matmul_f16, F16Matrix, Isa};

fn main() {
    let mut counts: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    if counts.is_empty() {
        counts = vec![1, 2, 4, 8, 12, 16, 24, 32];
    }
    let pool = Pool::new(2);
    let shapes =
        [(2048usize, 2048usize), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192)];
    let matrices: Vec<Vec<u16>> = shapes
        .iter()
        .map(|&(n, k)| {
            (0..n * k).map(|i| half::f16::from_f32(((i * 37 % 251) as f32 - 125.0) * 1e-3).to_bits()).collect()
        })
        .collect();
    let macs_per_token: usize = shapes.iter().map(|(n, k)| n * k).sum();
    println!("{} path", Isa::best().name());
    for tokens in counts {
        let x: Vec<f32> = (0..8192 * tokens).map(|i| ((i * 13 % 97) as f32 - 48.0) * 0.01).collect();
        let mut out = vec![0.0f32; 8192 * tokens];
        let layer = || {
            for (&(n, k), data) in shapes.iter().zip(&matrices) {
                let w = F16Matrix { rows: n, cols: k, data };
                matmul_f16(Isa::best(), &pool, &x[..k * tokens], tokens, w, &mut out[..n * tokens]).unwrap();
            }
        };
        let best = best_seconds(7, layer);
        println!(
            "tokens {tokens:>3}  {:>7.2} ms per layer  {:>6.1} GMAC/s",
            best * 1e3,
            (macs_per_token * tokens) as f64 / best / 1e9
        );
    }
}
