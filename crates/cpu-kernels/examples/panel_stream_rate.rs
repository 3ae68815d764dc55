//! Multiply-add rate of the panel products with the weights streamed from memory, as a decode
//! step reads them: a model's worth of distinct matrices (more than the last-level cache), each
//! multiplied once per pass. Beside `panel_rate` (one matrix in L2), it says what a batched step's
//! products cost at a batch size, and how that compares with one token's.
//!
//! `cargo run --release -p cpu-kernels --example panel_stream_rate [-- THREADS TOKENS [int8]
//! [MATRICES]]`: by default two threads, eight tokens, and 120 int4 matrices of 1536 x 576
//! (SmolLM2-135M's layers hold 106 M weights: 120 such matrices) over activations rounded to
//! int8; with `int8`, 32 int8 matrices (about SmolLM2's 28 M-weight head); with `f16`, 120 f16
//! matrices multiplied exactly (SmolLM2's layers in fp16, as a prefill chunk reads them).
use cpu_kernels::pool::Pool;
use cpu_kernels::{
    matmul_f16, matmul_int4_panels_q8, matmul_int8_panels_q8, F16Matrix, Int4Matrix, Int8Matrix, Isa, GROUP_SIZE,
};
use std::time::Instant;

/// The shape of every matrix: SmolLM2's MLP products.
const ROWS: usize = 1536;
const COLS: usize = 576;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let numbers: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let threads = numbers.first().copied().unwrap_or(2);
    let tokens = numbers.get(1).copied().unwrap_or(8);
    let int8 = args.iter().any(|a| a == "int8");
    let f16 = args.iter().any(|a| a == "f16");
    let count = numbers.get(2).copied().unwrap_or(if int8 { 32 } else { 120 });
    let pool = Pool::new(threads);
    let groups = COLS / GROUP_SIZE;
    // Distinct contents per matrix, so no two share cache lines.
    let codes: Vec<Vec<u8>> = (0..count)
        .map(|m| {
            let len = if f16 {
                2 * ROWS * COLS
            } else if int8 {
                ROWS * COLS
            } else {
                ROWS * COLS / 2
            };
            (0..len).map(|i| ((i + 7 * m) * 37 % 251) as u8).collect()
        })
        .collect();
    // The same bytes as f16 values, their exponent's top bit cleared: finite, below 2 in magnitude.
    let halves: Vec<Vec<u16>> = match f16 {
        true => {
            codes.iter().map(|c| c.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1] & 0xbf])).collect()).collect()
        }
        false => Vec::new(),
    };
    let scales = vec![0x2c00u16; ROWS * groups];
    let biases = vec![0xb000u16; ROWS * groups];
    let x: Vec<f32> = (0..COLS * tokens).map(|i| ((i * 13 % 97) as f32 - 48.0) * 0.01).collect();
    let mut out = vec![0.0f32; ROWS * tokens];
    let mut pass = || {
        for (m, c) in codes.iter().enumerate() {
            if f16 {
                let w = F16Matrix { rows: ROWS, cols: COLS, data: &halves[m] };
                matmul_f16(Isa::best(), &pool, &x, tokens, w, &mut out).unwrap();
            } else if int8 {
                // SAFETY: i8 and u8 have the same size and alignment.
                let c = unsafe { std::slice::from_raw_parts(c.as_ptr() as *const i8, c.len()) };
                let w = Int8Matrix { rows: ROWS, cols: COLS, codes: c, scales: &scales };
                matmul_int8_panels_q8(Isa::best(), &pool, &x, tokens, w, &mut out).unwrap();
            } else {
                let w = Int4Matrix { rows: ROWS, cols: COLS, packed: c, scales: &scales, biases: &biases };
                matmul_int4_panels_q8(Isa::best(), &pool, &x, tokens, w, &mut out).unwrap();
            }
        }
    };
    pass();
    let mut times: Vec<f64> = (0..10)
        .map(|_| {
            let t = Instant::now();
            pass();
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    let (best, median) = (times[0], times[times.len() / 2]);
    let macs = (ROWS * COLS * tokens * count) as f64;
    let bytes = codes.iter().map(Vec::len).sum::<usize>() as f64;
    println!(
        "{count} {} matrices {ROWS}x{COLS}, {threads} threads, {tokens} tokens: pass min {:.2} ms, median {:.2} ms; {:.1} GMAC/s, {:.1} GB/s of weights (min)",
        if f16 { "f16" } else if int8 { "int8" } else { "int4" },
        best * 1e3,
        median * 1e3,
        macs / best / 1e9,
        bytes / best / 1e9
    );
}
