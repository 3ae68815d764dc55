//! The arithmetic of one Llama decoder step, as plain functions on f32 slices.
//!
//! Each function mirrors one operation of Hugging Face transformers' `LlamaForCausalLM` in float32,
//! in the same order of operations where the order changes the result beyond rounding (for example
//! RMSNorm normalizes first and multiplies by the weight last). They are deliberately simple: this
//! crate is the oracle other backends are held against, so being obviously right matters more than
//! being fast. The only concession to speed is [`dot`], which sums in eight interleaved f32
//! accumulators so the compiler can vectorize it (summation order differs from a BLAS anyway).

/// Dot product of two equally long slices, accumulated in f32.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    const LANES: usize = 8;
    let mut lanes = [0.0f32; LANES];
    let a_chunks = a.chunks_exact(LANES);
    let b_chunks = b.chunks_exact(LANES);
    let (a_tail, b_tail) = (a_chunks.remainder(), b_chunks.remainder());
    for (ca, cb) in a_chunks.zip(b_chunks) {
        for i in 0..LANES {
            lanes[i] += ca[i] * cb[i];
        }
    }
    let mut sum: f32 = lanes.iter().sum();
    for (x, y) in a_tail.iter().zip(b_tail) {
        sum += x * y;
    }
    sum
}

/// RMSNorm as transformers computes it: `weight * (x * rsqrt(mean(x²) + eps))`, all in f32.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert!(x.len() == weight.len() && x.len() == out.len());
    let mean_square = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv_rms = 1.0 / (mean_square + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = w * (v * inv_rms);
    }
}

/// [`rms_norm`] applied to each `width`-wide row of `x` (`[rows, width]`), into a new buffer.
pub fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let width = weight.len();
    let mut out = vec![0.0; x.len()];
    for (row, out_row) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        rms_norm(row, weight, eps, out_row);
    }
    out
}

/// Rotary position embedding in transformers' "rotate half" convention, in place on one head's
/// vector of `head_dim = 2 * cos.len()` values: element `i` pairs with element `i + head_dim/2`.
///
/// `out[i] = x[i]*cos[i] - x[i+d/2]*sin[i]` and `out[i+d/2] = x[i+d/2]*cos[i] + x[i]*sin[i]`,
/// with `cos`/`sin` from `LlamaConfig::rope_cos_sin` for the token's position.
pub fn apply_rope(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    debug_assert_eq!(x.len(), 2 * half);
    debug_assert_eq!(sin.len(), half);
    let (first, second) = x.split_at_mut(half);
    for i in 0..half {
        let (a, b) = (first[i], second[i]);
        first[i] = a * cos[i] - b * sin[i];
        second[i] = b * cos[i] + a * sin[i];
    }
}

/// Softmax in place, in f32, subtracting the maximum first so large scores cannot overflow `exp`.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut total = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        total += *v;
    }
    for v in x.iter_mut() {
        *v /= total;
    }
}

/// SiLU (swish): `x * sigmoid(x)`, written as transformers' `x / (1 + exp(-x))`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// The SwiGLU activation of the MLP, element-wise: `silu(gate) * up`.
pub fn swiglu(gate: &[f32], up: &[f32]) -> Vec<f32> {
    gate.iter().zip(up).map(|(&g, &u)| silu(g) * u).collect()
}

/// The shape of multi-head attention with grouped KV heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl AttentionShape {
    /// Width of all query heads of one position (`n_heads * head_dim`).
    pub fn q_width(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Width of all key (or value) heads of one position (`n_kv_heads * head_dim`).
    pub fn kv_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// The KV head query head `head` reads: heads are grouped in consecutive runs of
    /// `n_heads / n_kv_heads`, as transformers' `repeat_kv` lays them out (without copying here).
    pub fn kv_head_of(&self, head: usize) -> usize {
        head / (self.n_heads / self.n_kv_heads)
    }
}

/// Causal attention of one query position over the cached positions `0..visible`.
///
/// `query` is `[n_heads * head_dim]` (rope already applied); `keys` and `values` are
/// `[positions, n_kv_heads * head_dim]` row-major with at least `visible` rows. Returns
/// `[n_heads * head_dim]`: for each head, `softmax(q·k / sqrt(head_dim)) · v`.
pub fn attend(query: &[f32], keys: &[f32], values: &[f32], visible: usize, shape: AttentionShape) -> Vec<f32> {
    let (d, kv_width) = (shape.head_dim, shape.kv_width());
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = vec![0.0f32; shape.q_width()];
    let mut scores = vec![0.0f32; visible];
    for head in 0..shape.n_heads {
        let q = &query[head * d..(head + 1) * d];
        let kv_offset = shape.kv_head_of(head) * d;
        for (pos, score) in scores.iter_mut().enumerate() {
            let k = &keys[pos * kv_width + kv_offset..][..d];
            *score = dot(q, k) * scale;
        }
        softmax(&mut scores);
        let out_head = &mut out[head * d..(head + 1) * d];
        for (pos, &p) in scores.iter().enumerate() {
            let v = &values[pos * kv_width + kv_offset..][..d];
            for (o, &x) in out_head.iter_mut().zip(v) {
                *o += p * x;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f32], b: &[f32], tol: f32) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tol)
    }

    #[test]
    fn dot_matches_the_schoolbook_sum_with_a_tail() {
        let a: Vec<f32> = (0..19).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..19).map(|i| (i % 3) as f32 - 1.0).collect();
        let expected: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert_eq!(dot(&a, &b), expected); // small integers: exact in any order
    }

    #[test]
    fn rms_norm_by_hand() {
        // mean(x²) = (9 + 16) / 2 = 12.5; with eps 0 the rms is sqrt(12.5) = 3.5355339.
        let mut out = [0.0; 2];
        rms_norm(&[3.0, -4.0], &[1.0, 2.0], 0.0, &mut out);
        let r = 12.5f32.sqrt();
        assert!(close(&out, &[3.0 / r, 2.0 * -4.0 / r], 1e-6), "{out:?}");
        // eps is added to the mean square before the root.
        rms_norm(&[1.0, 1.0], &[1.0, 1.0], 3.0, &mut out);
        assert!(close(&out, &[0.5, 0.5], 1e-7), "{out:?}");
    }

    #[test]
    fn rope_rotates_pairs_half_a_vector_apart() {
        // head_dim 4: pairs (0, 2) and (1, 3). Pair 0 turns by 90°, pair 1 is left alone.
        let mut x = [1.0, 2.0, 3.0, 4.0];
        apply_rope(&mut x, &[0.0, 1.0], &[1.0, 0.0]);
        assert_eq!(x, [-3.0, 2.0, 1.0, 4.0]);
        // A general angle: (a, b) -> (a cos - b sin, b cos + a sin).
        let (c, s) = (0.6f32, 0.8f32);
        let mut y = [2.0, 1.0];
        apply_rope(&mut y, &[c], &[s]);
        assert!(close(&y, &[2.0 * c - s, c + 2.0 * s], 1e-7), "{y:?}");
    }

    #[test]
    fn softmax_by_hand_and_without_overflow() {
        let mut x = [0.0, 2f32.ln()];
        softmax(&mut x);
        assert!(close(&x, &[1.0 / 3.0, 2.0 / 3.0], 1e-7), "{x:?}");
        let mut big = [1000.0, 1000.0];
        softmax(&mut big);
        assert_eq!(big, [0.5, 0.5]);
    }

    #[test]
    fn silu_by_hand() {
        assert_eq!(silu(0.0), 0.0);
        assert!((silu(1.0) - 1.0 / (1.0 + (-1.0f32).exp())).abs() < 1e-7);
        assert_eq!(swiglu(&[0.0, 2.0], &[5.0, 3.0])[0], 0.0);
    }

    #[test]
    fn attention_over_two_positions_by_hand() {
        // One head of dim 2. Query (ln 2 · sqrt 2, 0) scores k0 = (0, 1) at 0 and k1 = (1, 0) at
        // ln 2, so the weights are 1/3 and 2/3.
        let shape = AttentionShape { n_heads: 1, n_kv_heads: 1, head_dim: 2 };
        let q = [2f32.ln() * 2f32.sqrt(), 0.0];
        let keys = [0.0, 1.0, 1.0, 0.0];
        let values = [3.0, 0.0, 0.0, 6.0];
        let out = attend(&q, &keys, &values, 2, shape);
        assert!(close(&out, &[1.0, 4.0], 1e-5), "{out:?}");
        // Causality: seeing only the first position returns its value exactly.
        assert_eq!(attend(&q, &keys, &values, 1, shape), vec![3.0, 0.0]);
    }

    #[test]
    fn grouped_query_heads_share_their_kv_head() {
        // 4 query heads over 2 KV heads: heads 0,1 read KV head 0; heads 2,3 read KV head 1.
        let shape = AttentionShape { n_heads: 4, n_kv_heads: 2, head_dim: 1 };
        assert_eq!((0..4).map(|h| shape.kv_head_of(h)).collect::<Vec<_>>(), vec![0, 0, 1, 1]);
        // One visible position: every head returns its KV head's value whatever the query.
        let out = attend(&[1.0, -1.0, 2.0, 0.5], &[0.3, 0.7], &[10.0, 20.0], 1, shape);
        assert_eq!(out, vec![10.0, 10.0, 20.0, 20.0]);
    }
}
