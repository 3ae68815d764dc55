//! Tiny deterministic random models for the reference backend's tests, built in memory, and an
//! independent, deliberately naive f64 forward pass to check the backend against.

#![allow(dead_code)] // each test file uses a different part

use backend_reference::{EngineOptions, ReferenceEngine};
use half::f16;
use llama_model::int4::GROUP_SIZE;
use llama_model::random::Rng;
use llama_model::{LayerWeights, LlamaConfig, LlamaWeights, Matrix};

/// The workspace's tiny Llama ([`llama_model::random::tiny_config`]: 2 layers, 4 query heads over
/// 2 KV heads (GQA), head dim 16, vocab 256, plain rope) with tied or untied embeddings.
pub fn tiny_config(tied: bool) -> LlamaConfig {
    LlamaConfig { tie_word_embeddings: tied, ..llama_model::random::tiny_config() }
}

/// A `[rows, cols]` weight uniform in `[-scale, scale)` (scaled so activations stay of order one),
/// in f16 or seam's int4.
fn matrix(rng: &mut Rng, rows: usize, cols: usize, scale: f32, int4: bool) -> Matrix {
    let v = rng.uniform_vec(rows * cols, scale);
    if int4 {
        Matrix::Int4(llama_model::int4::quantize(&v, rows, cols).expect("finite values, whole groups"))
    } else {
        Matrix::F16 { rows, cols, data: v.into_iter().map(f16::from_f32).collect() }
    }
}

/// Random weights for `config`; the same seed gives the same underlying values in both formats.
pub fn random_weights(config: &LlamaConfig, seed: u64, int4: bool) -> LlamaWeights {
    let mut rng = Rng::new(seed);
    let c = config;
    let (h, f, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let (qw, kvw) = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim);
    let s = |n: usize| 1.5 / (n as f32).sqrt();
    let norm = |rng: &mut Rng| (0..h).map(|_| 1.0 + 0.2 * rng.uniform()).collect::<Vec<f32>>();
    let embed = matrix(&mut rng, v, h, 1.0, int4);
    let layers = (0..c.num_hidden_layers)
        .map(|_| LayerWeights {
            attn_norm: norm(&mut rng),
            wq: matrix(&mut rng, qw, h, s(h), int4),
            wk: matrix(&mut rng, kvw, h, s(h), int4),
            wv: matrix(&mut rng, kvw, h, s(h), int4),
            wo: matrix(&mut rng, h, qw, s(qw), int4),
            mlp_norm: norm(&mut rng),
            w_gate: matrix(&mut rng, f, h, s(h), int4),
            w_up: matrix(&mut rng, f, h, s(h), int4),
            w_down: matrix(&mut rng, h, f, s(f), int4),
        })
        .collect();
    let final_norm = norm(&mut rng);
    let lm_head = (!c.tie_word_embeddings).then(|| matrix(&mut rng, v, h, s(h), int4));
    LlamaWeights { config: c.clone(), embed, layers, final_norm, lm_head }
}

/// An engine over `weights` with an optional context cap.
pub fn engine(weights: &LlamaWeights, max_context: Option<usize>) -> ReferenceEngine {
    ReferenceEngine::from_weights(
        weights,
        EngineOptions { model_name: "tiny".into(), max_context, ..Default::default() },
    )
    .expect("tiny weights are valid")
}

/// Largest absolute difference of two equally long vectors.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn dense(m: &Matrix) -> Vec<f64> {
    match m {
        Matrix::F16 { data, .. } => data.iter().map(|v| f64::from(v.to_f32())).collect(),
        Matrix::Int4(m) => {
            let mut out = Vec::with_capacity(m.rows * m.cols);
            for i in 0..m.rows * m.cols {
                let q = (m.packed[i / 2] >> (4 * (i % 2))) & 15;
                let g = i / GROUP_SIZE;
                out.push(f64::from(f32::from(m.scales[g]) * q as f32 + f32::from(m.biases[g])));
            }
            out
        }
        // The format's definition, written out independently of `Int8Matrix::dequantize_row`.
        Matrix::Int8(m) => {
            (0..m.rows * m.cols).map(|i| f64::from(f32::from(m.scales[i / GROUP_SIZE]) * m.codes[i] as f32)).collect()
        }
    }
}

/// `W x` for a row-major `[out, in]` matrix.
fn linear(w: &[f64], x: &[f64]) -> Vec<f64> {
    w.chunks(x.len()).map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
}

fn rms_norm(x: &[f64], w: &[f32], eps: f32) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + f64::from(eps)).sqrt();
    x.iter().zip(w).map(|(v, &w)| f64::from(w) * v * r).collect()
}

fn rope(x: &mut [f64], position: usize, theta: f32) {
    let d = x.len();
    for i in 0..d / 2 {
        let freq = 1.0 / f64::from(theta).powf((2 * i) as f64 / d as f64);
        let (s, c) = (position as f64 * freq).sin_cos();
        let (a, b) = (x[i], x[i + d / 2]);
        x[i] = a * c - b * s;
        x[i + d / 2] = b * c + a * s;
    }
}

/// The logits of the last of `tokens`, computed without a cache, position by position over the
/// whole sequence, in f64, straight from the definitions (no rope scaling).
pub fn naive_last_logits(w: &LlamaWeights, tokens: &[u32]) -> Vec<f32> {
    let c = &w.config;
    assert!(c.rope_scaling.is_none(), "the naive forward pass has no rope scaling");
    let (h, d) = (c.hidden_size, c.head_dim);
    let group = c.num_attention_heads / c.num_key_value_heads;
    let embed = dense(&w.embed);
    let mut xs: Vec<Vec<f64>> = tokens.iter().map(|&t| embed[t as usize * h..(t as usize + 1) * h].to_vec()).collect();
    for layer in &w.layers {
        let (wq, wk, wv, wo) = (dense(&layer.wq), dense(&layer.wk), dense(&layer.wv), dense(&layer.wo));
        let (qs, ks, vs): (Vec<_>, Vec<_>, Vec<_>) = xs
            .iter()
            .enumerate()
            .map(|(p, x)| {
                let n = rms_norm(x, &layer.attn_norm, c.rms_norm_eps);
                let mut q = linear(&wq, &n);
                let mut k = linear(&wk, &n);
                q.chunks_mut(d).for_each(|head| rope(head, p, c.rope_theta));
                k.chunks_mut(d).for_each(|head| rope(head, p, c.rope_theta));
                (q, k, linear(&wv, &n))
            })
            .fold((vec![], vec![], vec![]), |(mut a, mut b, mut e), (q, k, v)| {
                a.push(q);
                b.push(k);
                e.push(v);
                (a, b, e)
            });
        for p in 0..xs.len() {
            let mut attn = vec![0.0f64; c.num_attention_heads * d];
            for head in 0..c.num_attention_heads {
                let kvh = head / group;
                let q = &qs[p][head * d..(head + 1) * d];
                let scores: Vec<f64> = (0..=p)
                    .map(|j| {
                        q.iter().zip(&ks[j][kvh * d..(kvh + 1) * d]).map(|(a, b)| a * b).sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = e.iter().sum();
                for j in 0..=p {
                    for i in 0..d {
                        attn[head * d + i] += e[j] / total * vs[j][kvh * d + i];
                    }
                }
            }
            let o = linear(&wo, &attn);
            xs[p].iter_mut().zip(&o).for_each(|(x, o)| *x += o);
        }
        let (wg, wu, wd) = (dense(&layer.w_gate), dense(&layer.w_up), dense(&layer.w_down));
        for x in xs.iter_mut() {
            let n = rms_norm(x, &layer.mlp_norm, c.rms_norm_eps);
            let act: Vec<f64> =
                linear(&wg, &n).iter().zip(linear(&wu, &n)).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            let down = linear(&wd, &act);
            x.iter_mut().zip(&down).for_each(|(x, d)| *x += d);
        }
    }
    let last = rms_norm(xs.last().unwrap(), &w.final_norm, c.rms_norm_eps);
    let head = dense(w.lm_head.as_ref().unwrap_or(&w.embed));
    linear(&head, &last).into_iter().map(|v| v as f32).collect()
}
