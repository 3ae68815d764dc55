//! The kernels' definitions in plain Rust: what every fast path must compute (up to the order of
//! f32 additions). Also the path taken on CPUs without a faster one.

use half::f16;

/// `x · w` for f16 `w`, accumulated in f32.
pub fn dot_f16(x: &[f32], w: &[u16]) -> f32 {
    x.iter().zip(w).map(|(&a, &b)| a * f16::from_bits(b).to_f32()).sum()
}

/// One row of an int4 matrix times `x`, by the format's definition: each weight is
/// `scale * q + bias` of its group, computed in f32, then multiplied and summed.
pub fn dot_int4(x: &[f32], packed: &[u8], scales: &[u16], biases: &[u16], group_size: usize) -> f32 {
    let mut sum = 0.0f32;
    for (i, &xi) in x.iter().enumerate() {
        let byte = packed[i / 2];
        let q = if i % 2 == 0 { byte & 15 } else { byte >> 4 };
        let g = i / group_size;
        let w = f16::from_bits(scales[g]).to_f32() * q as f32 + f16::from_bits(biases[g]).to_f32();
        sum += xi * w;
    }
    sum
}

/// One row of an int8 matrix times `x`, by the format's definition: each weight is
/// `scale * q` of its group, computed in f32, then multiplied and summed.
pub fn dot_int8(x: &[f32], codes: &[i8], scales: &[u16], group_size: usize) -> f32 {
    let mut sum = 0.0f32;
    for (i, (&xi, &q)) in x.iter().zip(codes).enumerate() {
        sum += xi * (f16::from_bits(scales[i / group_size]).to_f32() * q as f32);
    }
    sum
}

/// Softmax attention of one query `q` `[D]` over keys `[D, C]` and values `[C, D]` (one KV head
/// of seam's cache layout, `c` the cache's capacity), positions `0..len`, scores scaled by
/// `scale`; the result goes to `out` `[D]`. `scores` is scratch of at least `len`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn attend_one(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    c: usize,
    len: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let (_, total) = attend_part(q, keys, values, c, 0..len, scale, scores, out);
    let inv = 1.0 / total;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

/// The softmax of [`attend_one`] over positions `span` only, left unnormalized: the values
/// weighted by `exp(score - max)` go to `out` `[D]`; returns the span's largest scaled score and
/// the sum of those exponentials. `scores` is scratch of at least the span's length.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub fn attend_part(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    c: usize,
    span: std::ops::Range<usize>,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) -> (f32, f32) {
    let d = q.len();
    let scores = &mut scores[..span.len()];
    scores.fill(0.0);
    for (j, &qj) in q.iter().enumerate() {
        let row = &keys[j * c + span.start..j * c + span.end];
        for (s, &k) in scores.iter_mut().zip(row) {
            *s += qj * k;
        }
    }
    let mut max = f32::NEG_INFINITY;
    for s in scores.iter_mut() {
        *s *= scale;
        max = max.max(*s);
    }
    let mut total = 0.0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        total += *s;
    }
    out.fill(0.0);
    for (pos, &p) in (span.start..).zip(scores.iter()) {
        let row = &values[pos * d..pos * d + d];
        for (o, &v) in out.iter_mut().zip(row) {
            *o += p * v;
        }
    }
    (max, total)
}

/// The first index of the largest value of `values`, NaN never the largest, 0 when no value is
/// above -inf: the greedy rule (`session_api::sampling::argmax` is this function), which
/// [`crate::argmax_rows`] is held to.
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_value = f32::NEG_INFINITY;
    for (i, &v) in values.iter().enumerate() {
        if v > best_value {
            best = i;
            best_value = v;
        }
    }
    best as u32
}
