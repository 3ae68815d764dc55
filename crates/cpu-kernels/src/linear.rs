//! A linear layer with what surrounds it in a decoder layer: the input RMS-normalized or gated
//! (SwiGLU) on the way in, a residual added on the way out. One call instead of the five or six
//! small operations a graph would otherwise run around each product; in a decode step those
//! small operations, not their arithmetic, are what costs.

use crate::pool::Pool;
use crate::scratch::Scratch;
use crate::{
    check_len, matmul_f16, matmul_int4, matmul_int4_panels, matmul_int4_panels_q8, matmul_int4_q8, matmul_int8,
    matmul_int8_panels, matmul_int8_panels_q8, matmul_int8_q8, Activations, F16Matrix, Int4Matrix, Int8Matrix, Isa,
    ShapeError,
};
use std::ops::Range;

/// What the product reads, `[tokens, cols]` once prepared.
#[derive(Debug, Clone, Copy)]
pub enum LinearInput<'a> {
    /// The rows as they are.
    Rows(&'a [f32]),
    /// `weight * (x * (1 / sqrt(mean(x²) + eps)))` of each row, as the reference computes RMSNorm.
    RmsNorm { x: &'a [f32], weight: &'a [f32], eps: f32 },
    /// `silu(gate) * up`, element-wise, with `silu(g) = g / (1 + exp(-g))`.
    SwiGlu { gate: &'a [f32], up: &'a [f32] },
    /// Decode attention's output for `heads` query heads, from its parts
    /// (`[tokens, DECODE_PARTS, heads, 2 + cols / heads]`, as
    /// [`crate::attention_decode_part`] writes them), merged by [`crate::merge_decode_parts`].
    AttentionParts { parts: &'a [f32], heads: usize },
}

/// The weights of a linear layer; int4 and int8 weights with how the product takes its
/// activations.
#[derive(Debug, Clone, Copy)]
pub enum LinearWeights<'a> {
    F16(F16Matrix<'a>),
    Int4(Int4Matrix<'a>, Activations),
    Int8(Int8Matrix<'a>, Activations),
    /// int4 weights laid out in panels of 16 rows ([`crate::int4_to_panels`]).
    Int4Panels(Int4Matrix<'a>, Activations),
    /// int8 weights laid out in panels of 16 rows ([`crate::int8_to_panels`]).
    Int8Panels(Int8Matrix<'a>, Activations),
}

impl<'a> LinearWeights<'a> {
    /// The matrix's rows: the product's columns.
    pub fn rows(&self) -> usize {
        self.shape().0
    }

    /// Rows `rows` of the matrix, as a matrix of their own: `None` where they are not rows of it,
    /// or where a matrix in panels would be cut inside a panel (a range starts on a panel and
    /// ends on one or at the last row).
    pub fn row_range(&self, rows: std::ops::Range<usize>) -> Option<LinearWeights<'a>> {
        let (n, k) = self.shape();
        let panels = matches!(self, LinearWeights::Int4Panels(..) | LinearWeights::Int8Panels(..));
        let cut = |r: usize| r.is_multiple_of(crate::PANEL_ROWS) || r == n;
        if rows.start > rows.end || rows.end > n || (panels && !(cut(rows.start) && cut(rows.end))) {
            return None;
        }
        let (count, groups) = (rows.len(), k / crate::GROUP_SIZE);
        let per_group = rows.start * groups..rows.end * groups;
        // A matrix in panels holds each panel's rows together, so whole panels are the same
        // bytes as the row-major matrix's rows.
        let int4 = |w: &Int4Matrix<'a>| Int4Matrix {
            rows: count,
            cols: k,
            packed: &w.packed[rows.start * k / 2..rows.end * k / 2],
            scales: &w.scales[per_group.clone()],
            biases: &w.biases[per_group.clone()],
        };
        let int8 = |w: &Int8Matrix<'a>| Int8Matrix {
            rows: count,
            cols: k,
            codes: &w.codes[rows.start * k..rows.end * k],
            scales: &w.scales[per_group.clone()],
        };
        Some(match self {
            LinearWeights::F16(w) => {
                LinearWeights::F16(F16Matrix { rows: count, cols: k, data: &w.data[rows.start * k..rows.end * k] })
            }
            LinearWeights::Int4(w, a) => LinearWeights::Int4(int4(w), *a),
            LinearWeights::Int4Panels(w, a) => LinearWeights::Int4Panels(int4(w), *a),
            LinearWeights::Int8(w, a) => LinearWeights::Int8(int8(w), *a),
            LinearWeights::Int8Panels(w, a) => LinearWeights::Int8Panels(int8(w), *a),
        })
    }

    fn shape(&self) -> (usize, usize) {
        match self {
            LinearWeights::F16(w) => (w.rows, w.cols),
            LinearWeights::Int4(w, _) => (w.rows, w.cols),
            LinearWeights::Int8(w, _) => (w.rows, w.cols),
            LinearWeights::Int4Panels(w, _) => (w.rows, w.cols),
            LinearWeights::Int8Panels(w, _) => (w.rows, w.cols),
        }
    }
}

/// Inputs as prepared (normalized or gated) for the product, and what they were prepared from
/// (for calls that may reuse them, [`crate::reuse`]).
#[derive(Default)]
struct Prepared {
    values: Vec<f32>,
    source: crate::reuse::Source,
}

crate::scratch::footprint!(Prepared: values, source);

static PREPARED: Scratch<Prepared> = Scratch::new();

/// `out = residual + prepare(input) W^T` (`residual` optional), for `tokens` rows; `out` is
/// `[tokens, rows of W]`.
pub fn linear(
    isa: Isa,
    pool: &Pool,
    input: LinearInput<'_>,
    tokens: usize,
    w: LinearWeights<'_>,
    residual: Option<&[f32]>,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let (n, k) = w.shape();
    check_len("output", out.len(), tokens * n)?;
    if let Some(r) = residual {
        check_len("residual", r.len(), tokens * n)?;
    }
    let run = |x: &[f32], out: &mut [f32]| match w {
        LinearWeights::F16(w) => matmul_f16(isa, pool, x, tokens, w, out),
        LinearWeights::Int4(w, Activations::Exact) => matmul_int4(isa, pool, x, tokens, w, out),
        LinearWeights::Int4(w, Activations::Int8) => matmul_int4_q8(isa, pool, x, tokens, w, out),
        LinearWeights::Int8(w, Activations::Exact) => matmul_int8(isa, pool, x, tokens, w, out),
        LinearWeights::Int8(w, Activations::Int8) => matmul_int8_q8(isa, pool, x, tokens, w, out),
        LinearWeights::Int4Panels(w, Activations::Exact) => matmul_int4_panels(isa, pool, x, tokens, w, out),
        LinearWeights::Int4Panels(w, Activations::Int8) => matmul_int4_panels_q8(isa, pool, x, tokens, w, out),
        LinearWeights::Int8Panels(w, Activations::Exact) => matmul_int8_panels(isa, pool, x, tokens, w, out),
        LinearWeights::Int8Panels(w, Activations::Int8) => matmul_int8_panels_q8(isa, pool, x, tokens, w, out),
    };
    match input {
        LinearInput::Rows(x) => run(x, out)?,
        LinearInput::RmsNorm { x, weight, eps } => {
            check_len("x", x.len(), tokens * k)?;
            check_len("norm weight", weight.len(), k)?;
            PREPARED.with(|p| {
                let key = [1, tokens as u64, k as u64, u64::from(eps.to_bits())];
                if !p.source.matches(&key, &[x, weight]) {
                    p.values.resize(tokens * k, 0.0);
                    rms_norm_rows(x, weight, eps, &mut p.values);
                    p.source.remember(&key, &[x, weight]);
                }
                run(&p.values, out)
            })?
        }
        LinearInput::AttentionParts { parts, heads } => {
            if heads == 0 || k % heads != 0 {
                return Err(ShapeError(format!("{k} columns do not split into {heads} heads")));
            }
            let d = k / heads;
            let per_token = crate::DECODE_PARTS * heads * (2 + d);
            check_len("attention parts", parts.len(), tokens * per_token)?;
            PREPARED.with(|p| {
                let key = [3, tokens as u64, k as u64, heads as u64];
                if !p.source.matches(&key, &[parts]) {
                    p.values.resize(tokens * k, 0.0);
                    for (parts, out) in parts.chunks_exact(per_token).zip(p.values.chunks_exact_mut(k)) {
                        crate::merge_decode_parts(parts, heads, d, out)?;
                    }
                    p.source.remember(&key, &[parts]);
                }
                run(&p.values, out)
            })?
        }
        LinearInput::SwiGlu { gate, up } => {
            check_len("gate", gate.len(), tokens * k)?;
            check_len("up", up.len(), tokens * k)?;
            PREPARED.with(|p| {
                let key = [2, tokens as u64, k as u64];
                if !p.source.matches(&key, &[gate, up]) {
                    p.values.resize(tokens * k, 0.0);
                    crate::simd::swiglu(isa, gate, up, &mut p.values);
                    p.source.remember(&key, &[gate, up]);
                }
                run(&p.values, out)
            })?
        }
    }
    if let Some(r) = residual {
        for (o, &r) in out.iter_mut().zip(r) {
            *o += r;
        }
    }
    Ok(())
}

/// `outs[i] = prepare(input) ws[i]^T` for each matrix of `ws` (no residual), for `tokens` rows;
/// `outs[i]` is `[tokens, rows of ws[i]]`.
///
/// A call of up to [`GROUP_MAX_TOKENS`] tokens (a decode step, a small batch's) splits the rows of all
/// the matrices over the pool in one run, each task the one-thread product of its rows (the
/// input prepared once per thread, reused across its rows): a run per matrix would wake the
/// workers and wait for its slowest task once per matrix, and the small key and value products
/// split unevenly on their own. The numbers are those of [`linear`] for each matrix: a row's
/// product does not depend on which rows share its call. Longer calls (a prefill chunk's, whose
/// products split their own work better), and matrices that cannot be cut where the tasks would
/// cut them (panels not whole), run [`linear`] for one matrix after another.
pub fn linear_group(
    isa: Isa,
    pool: &Pool,
    input: LinearInput<'_>,
    tokens: usize,
    ws: &[LinearWeights<'_>],
    outs: &mut [&mut [f32]],
) -> Result<(), ShapeError> {
    check_len("results", outs.len(), ws.len())?;
    for (w, out) in ws.iter().zip(outs.iter()) {
        check_len("output", out.len(), tokens * w.rows())?;
    }
    let total: usize = ws.iter().map(LinearWeights::rows).sum();
    let align = crate::PANEL_ROWS;
    let whole_panels = ws.iter().all(|w| w.rows() % align == 0);
    if !(1..=GROUP_MAX_TOKENS).contains(&tokens) || pool.threads() == 1 || !whole_panels {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            linear(isa, pool, input, tokens, *w, None, out)?;
        }
        return Ok(());
    }
    let per_task = total
        .div_ceil(pool.threads() * crate::matmul::TASKS_PER_THREAD)
        .next_multiple_of(align)
        .max(crate::matmul::MIN_ROWS_PER_TASK);
    let outs: Vec<crate::matmul::SendPtr> = outs.iter_mut().map(|o| crate::matmul::SendPtr(o.as_mut_ptr())).collect();
    let rows: Vec<usize> = ws.iter().map(LinearWeights::rows).collect();
    let failure = std::sync::Mutex::new(None);
    pool.run(total.div_ceil(per_task), &|task| {
        let share = task * per_task..((task + 1) * per_task).min(total);
        // The threads' own calls reuse the input they prepared for their first rows.
        let reusing = crate::reuse::enabled();
        crate::set_input_reuse(true);
        for (i, part_rows) in share_parts(&rows, share) {
            let (w, out, n, columns) = (ws[i], &outs[i], rows[i], part_rows.clone());
            let result = match w.row_range(part_rows) {
                // Nested in the pool's run, the product runs on this thread alone, into this
                // task's columns of each token's row.
                Some(part) => GROUP_COLUMNS.with(|cols| {
                    cols.resize(tokens * columns.len(), 0.0);
                    linear(isa, pool, input, tokens, part, None, cols)?;
                    for (t, row) in cols.chunks_exact(columns.len()).enumerate() {
                        // SAFETY: `out` is this matrix's `[tokens, n]` result (checked above), of
                        // which these columns are this task's alone.
                        unsafe {
                            std::ptr::copy_nonoverlapping(row.as_ptr(), out.0.add(t * n + columns.start), row.len())
                        };
                    }
                    Ok(())
                }),
                None => Err(ShapeError("a task's rows cut a panel".into())),
            };
            if let Err(e) = result {
                *failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
            }
        }
        crate::set_input_reuse(reusing);
    });
    match failure.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The parts of `share`, a range of the rows of matrices of `rows` rows each taken in turn (the
/// first matrix's rows, then the next's): for each matrix the share reaches, its index and its
/// rows in that matrix. How a grouped product's work, cut in shares of the matrices' rows
/// together, is run matrix by matrix.
pub fn share_parts(rows: &[usize], share: Range<usize>) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
    let starts = rows.iter().scan(0, |start, &n| {
        *start += n;
        Some(*start - n)
    });
    starts.zip(rows).enumerate().filter_map(move |(i, (start, &n))| {
        let (lo, hi) = (share.start.max(start), share.end.min(start + n));
        (lo < hi).then(|| (i, lo - start..hi - start))
    })
}

/// The most tokens a call of [`linear_group`] splits over the pool in one run (a decode step's, a
/// batch's of up to this many sequences): below the blocked matrix-matrix product, which splits
/// its own work over the pool better than tasks of rows each running it alone (a 16-token
/// prefill of SmolLM2 fp16 on pjrt-cpu lost 0-8% that way). Since f16 calls of 12-16 tokens take
/// the row tiles instead, 16 was measured again: their prefill was still 1-7% slower split in
/// one run (docs/performance.md, run 43).
pub const GROUP_MAX_TOKENS: usize = crate::matmul::GEMM_FROM_TOKENS - 1;

/// A task's columns of [`linear_group`]'s result, token by token.
static GROUP_COLUMNS: Scratch<Vec<f32>> = Scratch::new();

/// Rotate-half rope on whole heads of one token's row, in place: `x` is `[heads, d]` and `cos`,
/// `sin` that token's `[d]` (each half repeated), and each head becomes `x * cos + rotated *
/// sin` with `rotated = [-x[d/2..], x[..d/2]]`. The first product is fused into the sum (one
/// rounding, `fma(x, cos, rotated * sin)`), which is how XLA's and IREE's compilers contract the
/// graphs' rope on the CPU: the rope in the kernels gives the graphs' numbers bit for bit.
pub fn rope_heads(isa: Isa, x: &mut [f32], cos: &[f32], sin: &[f32]) -> Result<(), ShapeError> {
    let d = cos.len();
    check_len("sin", sin.len(), d)?;
    if d == 0 || !d.is_multiple_of(2) || !x.len().is_multiple_of(d) {
        return Err(ShapeError(format!("{} values are not whole heads of {d}", x.len())));
    }
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() && isa.is_supported() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        unsafe { rope_fma(x, cos, sin) };
        return Ok(());
    }
    let _ = isa;
    rope_fused(x, cos, sin);
    Ok(())
}

/// [`rope_heads`] of each row of `x` (`[tokens, heads * head_dim]`) with its own tables (`cos`,
/// `sin`: `[tokens, head_dim]`).
pub fn rope_rows(isa: Isa, x: &mut [f32], cos: &[f32], sin: &[f32], head_dim: usize) -> Result<(), ShapeError> {
    check_len("sin", sin.len(), cos.len())?;
    if head_dim == 0 || !cos.len().is_multiple_of(head_dim) {
        return Err(ShapeError(format!("rope tables of {} values are not rows of {head_dim}", cos.len())));
    }
    let tokens = cos.len() / head_dim;
    if tokens == 0 || !x.len().is_multiple_of(tokens) {
        return Err(ShapeError(format!("{} values are not {tokens} rows", x.len())));
    }
    let width = x.len() / tokens;
    let tables = cos.chunks_exact(head_dim).zip(sin.chunks_exact(head_dim));
    x.chunks_exact_mut(width).zip(tables).try_for_each(|(row, (cos, sin))| rope_heads(isa, row, cos, sin))
}

/// [`rope_heads`]' arithmetic (shapes checked), `mul_add` being one fused multiply-add.
#[inline(always)]
fn rope_fused(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let h = cos.len() / 2;
    for head in x.chunks_exact_mut(2 * h) {
        let (first, second) = head.split_at_mut(h);
        for i in 0..h {
            let (a, b) = (first[i], second[i]);
            first[i] = a.mul_add(cos[i], -b * sin[i]);
            second[i] = b.mul_add(cos[h + i], a * sin[h + i]);
        }
    }
}

/// [`rope_fused`] where `mul_add` is the FMA instruction (elsewhere it is a call to the C
/// library's `fmaf`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rope_fma(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    rope_fused(x, cos, sin);
}

/// Rows normalized together by [`rms_norm_rows`].
const NORM_ROWS: usize = 8;

/// RMSNorm of each row of `x` (rows of `weight.len()` values), in the reference's order of
/// operations: each row's sum of squares is one sequential sum, as the reference's, but the sums
/// of up to [`NORM_ROWS`] rows advance together, so a batch's rows overlap their chains of
/// dependent additions instead of waiting out one row's after another's.
fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let k = weight.len();
    for (x, out) in x.chunks(NORM_ROWS * k).zip(out.chunks_mut(NORM_ROWS * k)) {
        let mut sums = [0.0f32; NORM_ROWS];
        if x.len() == NORM_ROWS * k {
            let rows: [&[f32]; NORM_ROWS] = std::array::from_fn(|r| &x[r * k..][..k]);
            for i in 0..k {
                for (sum, row) in sums.iter_mut().zip(rows) {
                    let v = row[i];
                    *sum += v * v;
                }
            }
        } else {
            for (sum, row) in sums.iter_mut().zip(x.chunks_exact(k)) {
                *sum = row.iter().map(|v| v * v).sum::<f32>();
            }
        }
        for ((x, out), sum) in x.chunks_exact(k).zip(out.chunks_exact_mut(k)).zip(sums) {
            let inv = 1.0 / (sum / k as f32 + eps).sqrt();
            for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
                *o = w * (v * inv);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RMSNorm of one row as the reference writes it.
    fn one_row(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
        let mean_square = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
        let inv = 1.0 / (mean_square + eps).sqrt();
        x.iter().zip(weight).map(|(&v, &w)| w * (v * inv)).collect()
    }

    #[test]
    fn attention_parts_are_merged_before_the_product() {
        use crate::{merge_decode_parts, DECODE_PARTS};
        let (heads, d, n, tokens) = (3, 32, 5, 2);
        let k = heads * d;
        let stride = 2 + d;
        // Per token: the first span filled, the second filled for token 0 and empty for token 1.
        let mut parts = vec![0.0f32; tokens * DECODE_PARTS * heads * stride];
        for (i, p) in parts.iter_mut().enumerate() {
            *p = ((i * 37 % 101) as f32 - 50.0) / 25.0;
        }
        for t in 0..tokens {
            for at in 0..DECODE_PARTS {
                for h in 0..heads {
                    let row = &mut parts[((t * DECODE_PARTS + at) * heads + h) * stride..][..stride];
                    row[1] = if t == 1 && at == 1 { 0.0 } else { 1.0 + h as f32 };
                    if row[1] == 0.0 {
                        row[0] = f32::NEG_INFINITY;
                        row[2..].fill(0.0);
                    }
                }
            }
        }
        let mut merged = vec![0.0; tokens * k];
        for (p, m) in parts.chunks_exact(DECODE_PARTS * heads * stride).zip(merged.chunks_exact_mut(k)) {
            merge_decode_parts(p, heads, d, m).unwrap();
        }
        let data: Vec<u16> = (0..n * k).map(|i| half::f16::from_f32((i % 13) as f32 / 13.0 - 0.5).to_bits()).collect();
        let w = LinearWeights::F16(crate::F16Matrix { rows: n, cols: k, data: &data });
        let pool = Pool::new(1);
        let (mut want, mut got) = (vec![0.0; tokens * n], vec![0.0; tokens * n]);
        linear(Isa::best(), &pool, LinearInput::Rows(&merged), tokens, w, None, &mut want).unwrap();
        let input = LinearInput::AttentionParts { parts: &parts, heads };
        linear(Isa::best(), &pool, input, tokens, w, None, &mut got).unwrap();
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
        let short = LinearInput::AttentionParts { parts: &parts[1..], heads };
        assert!(linear(Isa::best(), &pool, short, tokens, w, None, &mut got).is_err());
        let uneven = LinearInput::AttentionParts { parts: &parts, heads: 5 };
        assert!(linear(Isa::best(), &pool, uneven, tokens, w, None, &mut got).is_err());
    }

    #[test]
    fn rope_turns_pairs_half_a_head_apart_with_the_first_product_fused() {
        let d = 8;
        let x: Vec<f32> = (0..3 * d).map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0).collect();
        let angles: Vec<f32> = (0..d / 2).map(|i| 0.3 + i as f32 * 0.7).collect();
        let cos: Vec<f32> = angles.iter().chain(&angles).map(|a| a.cos()).collect();
        let sin: Vec<f32> = angles.iter().chain(&angles).map(|a| a.sin()).collect();
        // Each pair (a, b) = (x[i], x[i + d/2]) of each head becomes (a cos - b sin, b cos + a sin),
        // the second product rounded, the first fused into the sum; on every path.
        for isa in Isa::supported() {
            let mut got = x.clone();
            rope_heads(isa, &mut got, &cos, &sin).unwrap();
            for (head, (x, got)) in x.chunks_exact(d).zip(got.chunks_exact(d)).enumerate() {
                for i in 0..d / 2 {
                    let (a, b) = (x[i], x[i + d / 2]);
                    let want = (a.mul_add(cos[i], -(b * sin[i])), b.mul_add(cos[i + d / 2], a * sin[i + d / 2]));
                    let got = (got[i].to_bits(), got[i + d / 2].to_bits());
                    assert_eq!(got, (want.0.to_bits(), want.1.to_bits()), "{isa:?}, head {head}");
                }
            }
            // Not whole heads, an odd head, tables of different lengths.
            assert!(rope_heads(isa, &mut got[..d + 1], &cos, &sin).is_err());
            assert!(rope_heads(isa, &mut got[..3], &cos[..3], &sin[..3]).is_err());
            assert!(rope_heads(isa, &mut got, &cos, &sin[1..]).is_err());
            // Rows of their own tables: each as its own call.
            let tables = |f: fn(f32) -> f32| -> Vec<f32> { (0..2 * d).map(|i| f(0.1 + i as f32 * 0.37)).collect() };
            let (cos2, sin2) = (tables(f32::cos), tables(f32::sin));
            let mut rows = x[..2 * d].to_vec();
            rope_rows(isa, &mut rows, &cos2, &sin2, d).unwrap();
            for t in 0..2 {
                let mut one = x[t * d..(t + 1) * d].to_vec();
                rope_heads(isa, &mut one, &cos2[t * d..(t + 1) * d], &sin2[t * d..(t + 1) * d]).unwrap();
                assert_eq!(one, rows[t * d..(t + 1) * d], "{isa:?}, row {t}");
            }
            assert!(rope_rows(isa, &mut rows[..d + 2], &cos2, &sin2, d).is_err());
            assert!(rope_rows(isa, &mut rows, &cos2[1..], &sin2[1..], d).is_err());
        }
    }

    #[test]
    fn shares_of_matrices_taken_in_turn_split_at_their_boundaries() {
        let parts = |share| share_parts(&[96, 32, 32], share).collect::<Vec<_>>();
        assert_eq!(parts(0..64), [(0, 0..64)]);
        assert_eq!(parts(64..128), [(0, 64..96), (1, 0..32)]);
        assert_eq!(parts(80..160), [(0, 80..96), (1, 0..32), (2, 0..32)]);
        assert_eq!(parts(128..160), [(2, 0..32)]);
        assert!(parts(160..200).is_empty() && parts(10..10).is_empty());
    }

    #[test]
    fn rows_normalized_together_match_one_row_at_a_time_bit_for_bit() {
        let k = 37;
        let weight: Vec<f32> = (0..k).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect();
        for tokens in [1, 3, 8, 9, 19] {
            // Magnitudes spread over several orders, so that the order of the additions shows.
            let x: Vec<f32> =
                (0..tokens * k).map(|i| ((i * 7919 % 1009) as f32 - 504.0) * 10f32.powi((i % 5) as i32 - 2)).collect();
            let mut out = vec![f32::NAN; tokens * k];
            rms_norm_rows(&x, &weight, 1e-5, &mut out);
            for (t, (row, got)) in x.chunks_exact(k).zip(out.chunks_exact(k)).enumerate() {
                let want = one_row(row, &weight, 1e-5);
                assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{tokens} rows, row {t}");
            }
        }
    }
}
