//! Time of f16 products of one shape over calls of a few dozen tokens: `MATRICES` distinct
//! `N x K` matrices (more than the caches hold), each multiplied once per pass, on both threads.
//!
//! `cargo run --release -p cpu-kernels --example f16_shape_rate -- N K MATRICES TOKENS...`
use cpu_kernels::bandwidth::best_seconds;
use cpu_kernels::pool::Pool;
use cpu_kernels::{matmul_f16, F16Matrix, Isa};

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    if args.len() < 4 {
        eprintln!("usage: f16_shape_rate N K MATRICES TOKENS...");
        std::process::exit(2);
    }
    let (n, k, count) = (args[0], args[1], args[2]);
    let pool = Pool::new(2);
    let matrices: Vec<Vec<u16>> = (0..count)
        .map(|m| {
            (0..n * k).map(|i| half::f16::from_f32((((i + m) * 37 % 251) as f32 - 125.0) * 1e-3).to_bits()).collect()
        })
        .collect();
    for &tokens in &args[3..] {
        let x: Vec<f32> = (0..k * tokens).map(|i| ((i * 13 % 97) as f32 - 48.0) * 0.01).collect();
        let mut out = vec![0.0f32; n * tokens];
        let pass = || {
            for data in &matrices {
                matmul_f16(Isa::best(), &pool, &x, tokens, F16Matrix { rows: n, cols: k, data }, &mut out).unwrap();
            }
        };
        let best = best_seconds(7, pass);
        println!("{n}x{k} x{count} tokens {tokens:>3}: {:>7.2} ms per pass", best * 1e3);
    }
}
