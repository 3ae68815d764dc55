//! Microbenchmark: the kernels' read rate against the machine's read bandwidth.
//!
//! `cargo bench -p cpu-kernels [-- --quick]`. For each matrix shape it cycles through enough
//! copies of the matrix to exceed the last-level cache (so the weights come from memory, as in a
//! decode step), times one-token products, and prints bytes read per second and the fraction of a
//! read probe (`cpu_kernels::bandwidth::measure_read_bandwidth`, on the same pool). Rows named
//! `int4q8` and `int8q8` take the activations rounded to int8 (`matmul_int4_q8`, ADR 0024), and
//! `int4p` the same over int4 weights in panels of 16 rows (`matmul_int4_panels_q8`, ADR 0025; a
//! step's int8 head in panels too, `matmul_int8_panels_q8`);
//! `int4pe` and `int8pe` the exact products over panels (`matmul_int4_panels`,
//! `matmul_int8_panels`; a step's int8 head in panels too).
//!
//! `-- --batched-attention` times only a batched decode step's attention over caches in memory.

use cpu_kernels::pool::Pool;
use cpu_kernels::{
    attention_causal, attention_decode, attention_decode_batch, matmul_f16, matmul_int4, matmul_int4_panels,
    matmul_int4_panels_q8, matmul_int4_q8, matmul_int8, matmul_int8_panels, matmul_int8_panels_q8, matmul_int8_q8,
    AttentionShape, CacheElement, CausalQueries, F16Matrix, Int4Matrix, Int8Matrix, Isa, StepEntries, GROUP_SIZE,
};
use std::time::Instant;

/// What the matrix copies a timing cycles through add up to: as much as the probe reads.
const WORKING_SET: usize = cpu_kernels::bandwidth::DEFAULT_PROBE_BYTES;

fn probe(pool: &Pool) -> f64 {
    cpu_kernels::bandwidth::measure_read_bandwidth(pool, cpu_kernels::bandwidth::DEFAULT_PROBE_BYTES)
}

fn time<F: FnMut(usize)>(copies: usize, mut f: F) -> f64 {
    for i in 0..copies {
        f(i);
    }
    let mut best = f64::MAX;
    for _ in 0..3 {
        let start = Instant::now();
        for i in 0..copies {
            f(i);
        }
        best = best.min(start.elapsed().as_secs_f64() / copies as f64);
    }
    best
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let pool = Pool::global();
    if std::env::args().any(|a| a == "--batched-attention") {
        batched_attention(pool);
        return;
    }
    let bandwidth = probe(pool);
    println!("threads {}, paths {:?}", pool.threads(), Isa::supported().iter().map(|i| i.name()).collect::<Vec<_>>());
    println!("read probe: {:.1} GB/s", bandwidth / 1e9);
    let shapes: &[(&str, usize, usize)] = if quick {
        &[("smollm2 mlp up", 1536, 576)]
    } else {
        &[
            ("smollm2 mlp up", 1536, 576),
            ("smollm2 mlp down", 576, 1536),
            ("smollm2 lm head", 49152, 576),
            ("1b mlp up", 8192, 2048),
            ("1b mlp down", 2048, 8192),
            ("1b lm head", 128256, 2048),
        ]
    };
    println!("{:<18} {:>12} {:>10} {:>10} {:>8}", "shape [N x K]", "kernel", "us/call", "GB/s", "of probe");
    for &(name, n, k) in shapes {
        let x: Vec<f32> = (0..k).map(|i| (i % 7) as f32 * 0.1).collect();
        let mut out = vec![0.0f32; n];
        let f16_bytes = n * k * 2;
        let copies = (WORKING_SET / f16_bytes).max(2);
        let f16s: Vec<Vec<u16>> = (0..copies).map(|c| vec![0x3c00u16 + c as u16; n * k]).collect();
        for isa in Isa::supported() {
            let secs = time(copies, |i| {
                let w = F16Matrix { rows: n, cols: k, data: &f16s[i] };
                matmul_f16(isa, pool, &x, 1, w, &mut out).unwrap();
            });
            report(name, n, k, &format!("f16 {}", short(isa)), secs, f16_bytes, bandwidth);
        }
        drop(f16s);
        let groups = k / GROUP_SIZE;
        let int4_bytes = n * k / 2 + 4 * n * groups;
        let copies = (WORKING_SET / int4_bytes).max(2);
        let mats: Vec<(Vec<u8>, Vec<u16>, Vec<u16>)> = (0..copies)
            .map(|c| (vec![c as u8; n * k / 2], vec![0x2c00; n * groups], vec![0xb000; n * groups]))
            .collect();
        for isa in Isa::supported() {
            let secs = time(copies, |i| {
                let (p, s, b) = &mats[i];
                let w = Int4Matrix { rows: n, cols: k, packed: p, scales: s, biases: b };
                matmul_int4(isa, pool, &x, 1, w, &mut out).unwrap();
            });
            report(name, n, k, &format!("int4 {}", short(isa)), secs, int4_bytes, bandwidth);
        }
        let secs = time(copies, |i| {
            let (p, s, b) = &mats[i];
            let w = Int4Matrix { rows: n, cols: k, packed: p, scales: s, biases: b };
            matmul_int4_q8(Isa::best(), pool, &x, 1, w, &mut out).unwrap();
        });
        report(name, n, k, &format!("int4q8 {}", short(Isa::best())), secs, int4_bytes, bandwidth);
        // The same weights in panels of 16 rows (ADR 0025); the values do not matter here.
        let secs = time(copies, |i| {
            let (p, s, b) = &mats[i];
            let w = Int4Matrix { rows: n, cols: k, packed: p, scales: s, biases: b };
            matmul_int4_panels_q8(Isa::best(), pool, &x, 1, w, &mut out).unwrap();
        });
        report(name, n, k, &format!("int4p {}", short(Isa::best())), secs, int4_bytes, bandwidth);
        let secs = time(copies, |i| {
            let (p, s, b) = &mats[i];
            let w = Int4Matrix { rows: n, cols: k, packed: p, scales: s, biases: b };
            matmul_int4_panels(Isa::best(), pool, &x, 1, w, &mut out).unwrap();
        });
        report(name, n, k, &format!("int4pe {}", short(Isa::best())), secs, int4_bytes, bandwidth);
        drop(mats);
        let int8_bytes = n * k + 2 * n * groups;
        let copies = (WORKING_SET / int8_bytes).max(2);
        let mats: Vec<(Vec<i8>, Vec<u16>)> =
            (0..copies).map(|c| (vec![c as i8 - 3; n * k], vec![0x2c00; n * groups])).collect();
        for isa in Isa::supported() {
            let secs = time(copies, |i| {
                let (codes, scales) = &mats[i];
                matmul_int8(isa, pool, &x, 1, Int8Matrix { rows: n, cols: k, codes, scales }, &mut out).unwrap();
            });
            report(name, n, k, &format!("int8 {}", short(isa)), secs, int8_bytes, bandwidth);
        }
        let secs = time(copies, |i| {
            let (codes, scales) = &mats[i];
            matmul_int8_q8(Isa::best(), pool, &x, 1, Int8Matrix { rows: n, cols: k, codes, scales }, &mut out).unwrap();
        });
        report(name, n, k, &format!("int8q8 {}", short(Isa::best())), secs, int8_bytes, bandwidth);
        // The exact product over panels (an int4 model's int8 head on the CPU backends' default).
        let secs = time(copies, |i| {
            let (codes, scales) = &mats[i];
            let w = Int8Matrix { rows: n, cols: k, codes, scales };
            matmul_int8_panels(Isa::best(), pool, &x, 1, w, &mut out).unwrap();
        });
        report(name, n, k, &format!("int8pe {}", short(Isa::best())), secs, int8_bytes, bandwidth);
    }
    // A whole SmolLM2 decode step's products, each layer with its own weights (as in a model):
    // what the kernels alone cost per token.
    let layer_shapes =
        [(576usize, 576usize), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)];
    let mut int4_layers = Vec::new();
    let mut f16_layers = Vec::new();
    for _ in 0..30 {
        for &(n, k) in &layer_shapes {
            let g = k / GROUP_SIZE;
            int4_layers.push((n, k, vec![7u8; n * k / 2], vec![0x2c00u16; n * g], vec![0xb000u16; n * g]));
            f16_layers.push((n, k, vec![0x3c00u16; n * k]));
        }
    }
    // The head: int8 in an int4 model (ADR 0013), f16 in an fp16 one.
    let head = (49152usize, 576usize);
    let int8_head = (vec![-7i8; head.0 * head.1], vec![0x2c00u16; head.0 * head.1 / GROUP_SIZE]);
    f16_layers.push((head.0, head.1, vec![0x3c00u16; head.0 * head.1]));
    let int4_bytes: usize = int4_layers.iter().map(|(n, k, ..)| n * k / 2 + 4 * n * k / GROUP_SIZE).sum::<usize>()
        + head.0 * head.1
        + 2 * head.0 * head.1 / GROUP_SIZE;
    let f16_bytes: usize = f16_layers.iter().map(|(n, k, _)| n * k * 2).sum();
    // One token (decode), then a batch of decodes (continuous batching): the per-call time, and
    // per token in the last column.
    let batches: &[usize] = if quick { &[1, 4, 8] } else { &[1, 2, 4, 8, 16] };
    for &tokens in batches {
        let x = vec![0.1f32; 1536 * tokens];
        let mut out = vec![0.0f32; 49152 * tokens];
        let secs = time(1, |_| {
            for (n, k, p, s, b) in &int4_layers {
                let w = Int4Matrix { rows: *n, cols: *k, packed: p, scales: s, biases: b };
                matmul_int4(Isa::best(), pool, &x[..*k * tokens], tokens, w, &mut out[..*n * tokens]).unwrap();
            }
            let w = Int8Matrix { rows: head.0, cols: head.1, codes: &int8_head.0, scales: &int8_head.1 };
            matmul_int8(Isa::best(), pool, &x[..head.1 * tokens], tokens, w, &mut out[..head.0 * tokens]).unwrap();
        });
        let name = format!("smollm2 step x{tokens}");
        report(&name, int4_layers.len() + 1, 0, &format!("int4 {}", short(Isa::best())), secs, int4_bytes, bandwidth);
        println!("{:<18} {:>12} {:>10.1} us per token", "", "", secs * 1e6 / tokens as f64);
        // The same products over activations rounded to int8 (`activations=int8`, ADR 0024).
        let secs = time(1, |_| {
            for (n, k, p, s, b) in &int4_layers {
                let w = Int4Matrix { rows: *n, cols: *k, packed: p, scales: s, biases: b };
                matmul_int4_q8(Isa::best(), pool, &x[..*k * tokens], tokens, w, &mut out[..*n * tokens]).unwrap();
            }
            let w = Int8Matrix { rows: head.0, cols: head.1, codes: &int8_head.0, scales: &int8_head.1 };
            matmul_int8_q8(Isa::best(), pool, &x[..head.1 * tokens], tokens, w, &mut out[..head.0 * tokens]).unwrap();
        });
        report(&name, int4_layers.len() + 1, 0, &format!("int4q8 {}", short(Isa::best())), secs, int4_bytes, bandwidth);
        println!("{:<18} {:>12} {:>10.1} us per token", "", "", secs * 1e6 / tokens as f64);
        // The layers and the head in panels of 16 rows (ADR 0025), as the backends hold them.
        let secs = time(1, |_| {
            for (n, k, p, s, b) in &int4_layers {
                let w = Int4Matrix { rows: *n, cols: *k, packed: p, scales: s, biases: b };
                matmul_int4_panels_q8(Isa::best(), pool, &x[..*k * tokens], tokens, w, &mut out[..*n * tokens])
                    .unwrap();
            }
            let w = Int8Matrix { rows: head.0, cols: head.1, codes: &int8_head.0, scales: &int8_head.1 };
            matmul_int8_panels_q8(Isa::best(), pool, &x[..head.1 * tokens], tokens, w, &mut out[..head.0 * tokens])
                .unwrap();
        });
        report(&name, int4_layers.len() + 1, 0, &format!("int4p {}", short(Isa::best())), secs, int4_bytes, bandwidth);
        println!("{:<18} {:>12} {:>10.1} us per token", "", "", secs * 1e6 / tokens as f64);
        // Exact activations over the layers and the head in panels.
        let secs = time(1, |_| {
            for (n, k, p, s, b) in &int4_layers {
                let w = Int4Matrix { rows: *n, cols: *k, packed: p, scales: s, biases: b };
                matmul_int4_panels(Isa::best(), pool, &x[..*k * tokens], tokens, w, &mut out[..*n * tokens]).unwrap();
            }
            let w = Int8Matrix { rows: head.0, cols: head.1, codes: &int8_head.0, scales: &int8_head.1 };
            matmul_int8_panels(Isa::best(), pool, &x[..head.1 * tokens], tokens, w, &mut out[..head.0 * tokens])
                .unwrap();
        });
        report(&name, int4_layers.len() + 1, 0, &format!("int4pe {}", short(Isa::best())), secs, int4_bytes, bandwidth);
        println!("{:<18} {:>12} {:>10.1} us per token", "", "", secs * 1e6 / tokens as f64);
        let secs = time(1, |_| {
            for (n, k, d) in &f16_layers {
                let w = F16Matrix { rows: *n, cols: *k, data: d };
                matmul_f16(Isa::best(), pool, &x[..*k * tokens], tokens, w, &mut out[..*n * tokens]).unwrap();
            }
        });
        report(&name, f16_layers.len(), 0, &format!("f16 {}", short(Isa::best())), secs, f16_bytes, bandwidth);
        println!("{:<18} {:>12} {:>10.1} us per token", "", "", secs * 1e6 / tokens as f64);
    }

    // A prefill chunk: every layer's products over many tokens (no head: a prefill asks for the
    // last token's logits only). Bound by multiply-adds, so reported in GFLOP/s.
    let layer_flops: usize = 2 * layer_shapes.iter().map(|(n, k)| n * k).sum::<usize>() * 30;
    let layers = int4_layers.len();
    for &tokens in if quick { &[64usize][..] } else { &[16usize, 64, 512][..] } {
        let x = vec![0.1f32; 1536 * tokens];
        let mut out = vec![0.0f32; 1536 * tokens];
        let secs = time(1, |_| {
            for (n, k, p, s, b) in &int4_layers[..layers] {
                let w = Int4Matrix { rows: *n, cols: *k, packed: p, scales: s, biases: b };
                matmul_int4(Isa::best(), pool, &x[..*k * tokens], tokens, w, &mut out[..*n * tokens]).unwrap();
            }
        });
        report_flops(&format!("smollm2 layers x{tokens}"), "int4", secs, tokens, layer_flops);
        let secs = time(1, |_| {
            for (n, k, p, s, b) in &int4_layers[..layers] {
                let w = Int4Matrix { rows: *n, cols: *k, packed: p, scales: s, biases: b };
                matmul_int4_q8(Isa::best(), pool, &x[..*k * tokens], tokens, w, &mut out[..*n * tokens]).unwrap();
            }
        });
        report_flops(&format!("smollm2 layers x{tokens}"), "int4q8", secs, tokens, layer_flops);
        let secs = time(1, |_| {
            for (n, k, p, s, b) in &int4_layers[..layers] {
                let w = Int4Matrix { rows: *n, cols: *k, packed: p, scales: s, biases: b };
                matmul_int4_panels_q8(Isa::best(), pool, &x[..*k * tokens], tokens, w, &mut out[..*n * tokens])
                    .unwrap();
            }
        });
        report_flops(&format!("smollm2 layers x{tokens}"), "int4p", secs, tokens, layer_flops);
        let secs = time(1, |_| {
            for (n, k, p, s, b) in &int4_layers[..layers] {
                let w = Int4Matrix { rows: *n, cols: *k, packed: p, scales: s, biases: b };
                matmul_int4_panels(Isa::best(), pool, &x[..*k * tokens], tokens, w, &mut out[..*n * tokens]).unwrap();
            }
        });
        report_flops(&format!("smollm2 layers x{tokens}"), "int4pe", secs, tokens, layer_flops);
        let secs = time(1, |_| {
            for (n, k, d) in &f16_layers[..layers] {
                let w = F16Matrix { rows: *n, cols: *k, data: d };
                matmul_f16(Isa::best(), pool, &x[..*k * tokens], tokens, w, &mut out[..*n * tokens]).unwrap();
            }
        });
        report_flops(&format!("smollm2 layers x{tokens}"), "f16", secs, tokens, layer_flops);
    }

    // Attention of one step at a few fill levels of a 2048-position f32 cache (SmolLM2's heads).
    let shape = AttentionShape { heads: 9, kv_heads: 3, head_dim: 64, capacity: 2048 };
    let q = vec![0.1f32; 9 * 64];
    let keys = vec![0.01f32; 3 * 64 * 2048];
    let values = vec![0.02f32; 3 * 2048 * 64];
    let mut out = vec![0.0f32; 9 * 64];
    for len in [16usize, 256, 2048] {
        let secs = time(200, |_| {
            attention_decode(Isa::best(), pool, shape, &q, &keys, &values, len, &mut out).unwrap();
        });
        println!("attention 9/3 heads x 64, {len:>4} of 2048 positions: {:>8.1} us", secs * 1e6);
    }
    batched_attention(pool);
    // A prefill chunk's causal attention, all 30 layers (the keys and values already cached).
    for (tokens, position) in [(256usize, 0usize), (256, 256)] {
        let q = vec![0.1f32; tokens * 9 * 64];
        let mut out = vec![0.0f32; tokens * 9 * 64];
        let queries = CausalQueries { tokens, position, rows: tokens };
        let secs = time(1, |_| {
            for _ in 0..30 {
                attention_causal(Isa::best(), pool, shape, &q, queries, &keys, &values, &mut out).unwrap();
            }
        });
        println!("causal attention x30 layers, {tokens} rows at {position:>4}: {:>8.2} ms", secs * 1e3);
    }
}

fn short(isa: Isa) -> &'static str {
    match isa {
        Isa::Scalar => "scalar",
        Isa::Avx2 => "avx2",
        Isa::Avx512 => "avx512",
        Isa::Avx512Vnni => "vnni",
    }
}

fn report_flops(name: &str, kernel: &str, secs: f64, tokens: usize, flops_per_token: usize) {
    println!(
        "{:<22} {:>6} {:>10.2} ms {:>10.0} tokens/s {:>8.1} GFLOP/s",
        name,
        kernel,
        secs * 1e3,
        tokens as f64 / secs,
        (flops_per_token * tokens) as f64 / secs / 1e9
    );
}

fn report(name: &str, n: usize, k: usize, kernel: &str, secs: f64, bytes: usize, bandwidth: f64) {
    let rate = bytes as f64 / secs;
    println!(
        "{:<18} {:>12} {:>10.1} {:>10.1} {:>7.0}%   [{n} x {k}]",
        name,
        kernel,
        secs * 1e6,
        rate / 1e9,
        100.0 * rate / bandwidth
    );
}

/// A batched decode step's attention, all 30 layers, each sequence with its own caches of 512
/// positions (as `seam serve --max-context 512` holds them): the caches far exceed the last
/// level cache, so this is what serving at a batch of eight reads from memory per step.
fn batched_attention(pool: &Pool) {
    batched_attention_over::<f32>(pool, "f32");
    batched_attention_over::<half::f16>(pool, "f16");
}

fn batched_attention_over<E: CacheElement>(pool: &Pool, name: &str) {
    let c = 512;
    let shape = AttentionShape { heads: 9, kv_heads: 3, head_dim: 64, capacity: c };
    let sequences = 8;
    let mut keys = vec![E::default(); 3 * 64 * c];
    E::round_into(&vec![0.01f32; 3 * 64 * c], &mut keys);
    let mut values = keys.clone();
    E::round_into(&vec![0.02f32; 3 * 64 * c], &mut values);
    let mut caches: Vec<(Vec<E>, Vec<E>)> = (0..30 * sequences).map(|_| (keys.clone(), values.clone())).collect();
    let q = vec![0.1f32; sequences * 9 * 64];
    let new = vec![0.03f32; sequences * 3 * 64];
    let mut out = vec![0.0f32; sequences * 9 * 64];
    for len in [64usize, 128, 256] {
        let positions = vec![len - 1; sequences];
        let secs = time(1, |_| {
            for layer in caches.chunks_mut(sequences) {
                let mut views: Vec<(&mut [E], &mut [E])> =
                    layer.iter_mut().map(|(k, v)| (&mut k[..], &mut v[..])).collect();
                let entries = StepEntries { keys: &new, values: &new, positions: &positions };
                attention_decode_batch(Isa::best(), pool, shape, &q, entries, &mut views, &mut out).unwrap();
            }
        });
        let bytes = 30 * sequences * 2 * 3 * 64 * len * std::mem::size_of::<E>();
        println!(
            "batched attention x30 layers, {sequences} sequences at {len:>3} of {c}, {name} caches: {:>8.2} ms, {:>6.1} GB/s",
            secs * 1e3,
            bytes as f64 / secs / 1e9
        );
    }
}
