//! Multiply-add rate of the panel products with the weights in L2 (one thread): what bounds a
//! batched decode's products once the weights stop being the limit.
//!
//! `cargo run --release -p cpu-kernels --example panel_rate [-- ROWS COLS [THREADS]] [int8]`: int4
//! panels (the layers), or with `int8` int8 panels (the head); one thread unless THREADS.
use cpu_kernels::pool::Pool;
use cpu_kernels::{
    matmul_int4_panels, matmul_int4_panels_q8, matmul_int8_panels, matmul_int8_panels_q8, Int4Matrix, Int8Matrix, Isa,
    GROUP_SIZE,
};
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (n, k) = (args.first().copied().unwrap_or(1536), args.get(1).copied().unwrap_or(576));
    let pool = Pool::new(args.get(2).copied().unwrap_or(1));
    let g = k / GROUP_SIZE;
    let packed: Vec<u8> = (0..n * k / 2).map(|i| (i * 37 % 251) as u8).collect();
    let scales = vec![0x2c00u16; n * g];
    let biases = vec![0xb000u16; n * g];
    let w = Int4Matrix { rows: n, cols: k, packed: &packed, scales: &scales, biases: &biases };
    let codes: Vec<i8> = (0..n * k).map(|i| (i * 37 % 251) as i8).collect();
    let w8 = Int8Matrix { rows: n, cols: k, codes: &codes, scales: &scales };
    let int8 = std::env::args().any(|a| a == "int8");
    for tokens in [1usize, 2, 4, 8, 16] {
        let x: Vec<f32> = (0..k * tokens).map(|i| ((i * 13 % 97) as f32 - 48.0) * 0.01).collect();
        let mut out = vec![0.0f32; n * tokens];
        for (name, exact) in [("q8", false), ("exact", true)] {
            let mut run = || match (int8, exact) {
                (false, true) => matmul_int4_panels(Isa::best(), &pool, &x, tokens, w, &mut out).unwrap(),
                (false, false) => matmul_int4_panels_q8(Isa::best(), &pool, &x, tokens, w, &mut out).unwrap(),
                (true, true) => matmul_int8_panels(Isa::best(), &pool, &x, tokens, w8, &mut out).unwrap(),
                (true, false) => matmul_int8_panels_q8(Isa::best(), &pool, &x, tokens, w8, &mut out).unwrap(),
            };
            // About as much work per repeat at every shape.
            let calls = (4000 * 1536 * 576 / (n * k * tokens)).max(8);
            for _ in 0..calls / 4 {
                run();
            }
            let mut best = f64::MAX;
            for _ in 0..5 {
                let t = Instant::now();
                for _ in 0..calls {
                    run();
                }
                best = best.min(t.elapsed().as_secs_f64() / calls as f64);
            }
            let macs = (n * k * tokens) as f64;
            println!(
                "{n}x{k} tokens {tokens:>2} {name:<5} {:>8.1} us/call {:>6.1} GMAC/s {:>6.2} us/token",
                best * 1e6,
                macs / best / 1e9,
                best * 1e6 / tokens as f64
            );
        }
    }
}
