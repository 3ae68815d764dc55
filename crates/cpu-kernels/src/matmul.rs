//! `y = x W^T` for weights stored as f16 or as seam's int4, f32 activations and results.

use crate::pool::Pool;
use crate::{check_len, scalar, Isa, ShapeError};
use std::cell::RefCell;

/// Weights per int4 group (ADR 0002).
pub const GROUP_SIZE: usize = 32;

/// Rows of `W` per task: small enough that two threads share a 576-row matrix evenly, large
/// enough that a task's bookkeeping is noise against its bytes.
const ROWS_PER_TASK: usize = 16;

/// An f16 matrix `[rows, cols]`, row-major, as raw f16 bits.
#[derive(Debug, Clone, Copy)]
pub struct F16Matrix<'a> {
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u16],
}

/// An int4 matrix `[rows, cols]` in seam's format: `packed` `[rows, cols / 2]` (element `2i` of a
/// row in the low nibble of byte `i`), `scales` and `biases` `[rows, cols / 32]` as f16 bits.
#[derive(Debug, Clone, Copy)]
pub struct Int4Matrix<'a> {
    pub rows: usize,
    pub cols: usize,
    pub packed: &'a [u8],
    pub scales: &'a [u16],
    pub biases: &'a [u16],
}

/// Splits the output rows over the pool and runs `row(n, out_row_of_each_token)`.
///
/// `out` is `[tokens, rows]`: each task writes the columns `n` of its rows in every token's row of
/// the output, which no other task touches.
fn for_each_row(
    pool: &Pool,
    rows: usize,
    tokens: usize,
    out: &mut [f32],
    row: &(dyn Fn(usize, &mut dyn FnMut(usize, f32)) + Sync),
) {
    let tasks = rows.div_ceil(ROWS_PER_TASK);
    let out_ptr = SendPtr(out.as_mut_ptr());
    pool.run(tasks, &|task| {
        let out_ptr = &out_ptr;
        let start = task * ROWS_PER_TASK;
        let end = (start + ROWS_PER_TASK).min(rows);
        for n in start..end {
            row(n, &mut |t, value| {
                debug_assert!(t < tokens);
                // SAFETY: element (t, n) of `out` ([tokens, rows]) belongs to this task's rows only.
                unsafe { *out_ptr.0.add(t * rows + n) = value };
            });
        }
    });
}

struct SendPtr(*mut f32);
// SAFETY: tasks write disjoint elements through it (see `for_each_row`).
unsafe impl Sync for SendPtr {}

/// `out[t, n] = x[t, :] · W[n, :]` for f16 `W`: `x` is `[tokens, cols]`, `out` `[tokens, rows]`.
pub fn matmul_f16(
    isa: Isa,
    pool: &Pool,
    x: &[f32],
    tokens: usize,
    w: F16Matrix<'_>,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let (n, k) = (w.rows, w.cols);
    check_len("x", x.len(), tokens * k)?;
    check_len("f16 weights", w.data.len(), n * k)?;
    check_len("output", out.len(), tokens * n)?;
    let isa = if isa.is_supported() { isa } else { Isa::Scalar };
    for_each_row(pool, n, tokens, out, &|row, put| {
        let wr = &w.data[row * k..(row + 1) * k];
        for t in 0..tokens {
            let xr = &x[t * k..(t + 1) * k];
            let value = match isa {
                Isa::Scalar => scalar::dot_f16(xr, wr),
                // SAFETY: the CPU supports the path (checked above).
                Isa::Avx2 => unsafe { avx2::dot_f16(xr, wr) },
            };
            put(t, value);
        }
    });
    Ok(())
}

thread_local! {
    /// Activations rearranged for the int4 kernel, reused across calls on this thread.
    static INT4_SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `out[t, n] = x[t, :] · W[n, :]` for int4 `W`: `x` is `[tokens, cols]`, `out` `[tokens, rows]`.
///
/// Computed per group as `scale · (x_g · q_g) + bias · Σ x_g`: the nibbles are widened to f32 in
/// registers and the dequantized matrix never exists.
pub fn matmul_int4(
    isa: Isa,
    pool: &Pool,
    x: &[f32],
    tokens: usize,
    w: Int4Matrix<'_>,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let (n, k) = (w.rows, w.cols);
    if k % GROUP_SIZE != 0 {
        return Err(ShapeError(format!("int4 columns {k} are not a multiple of {GROUP_SIZE}")));
    }
    let groups = k / GROUP_SIZE;
    check_len("x", x.len(), tokens * k)?;
    check_len("int4 packed weights", w.packed.len(), n * k / 2)?;
    check_len("int4 scales", w.scales.len(), n * groups)?;
    check_len("int4 biases", w.biases.len(), n * groups)?;
    check_len("output", out.len(), tokens * n)?;
    let isa = if isa.is_supported() { isa } else { Isa::Scalar };
    if isa == Isa::Scalar {
        for_each_row(pool, n, tokens, out, &|row, put| {
            let (p, s, b) = row_of(&w, row, groups);
            for t in 0..tokens {
                put(t, scalar::dot_int4(&x[t * k..(t + 1) * k], p, s, b, GROUP_SIZE));
            }
        });
        return Ok(());
    }
    // Each token's activations as the fast path reads them: per group, the 16 inputs that meet
    // low nibbles, then the 16 that meet high nibbles; after all tokens, each token's group sums.
    INT4_SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        scratch.clear();
        scratch.resize(tokens * (k + groups), 0.0);
        let (split, sums) = scratch.split_at_mut(tokens * k);
        for t in 0..tokens {
            let xr = &x[t * k..(t + 1) * k];
            for g in 0..groups {
                let src = &xr[g * GROUP_SIZE..(g + 1) * GROUP_SIZE];
                let dst = &mut split[t * k + g * GROUP_SIZE..t * k + (g + 1) * GROUP_SIZE];
                for i in 0..GROUP_SIZE / 2 {
                    dst[i] = src[2 * i];
                    dst[GROUP_SIZE / 2 + i] = src[2 * i + 1];
                }
                sums[t * groups + g] = src.iter().sum();
            }
        }
        let (split, sums) = (&*split, &*sums);
        for_each_row(pool, n, tokens, out, &|row, put| {
            let (p, s, b) = row_of(&w, row, groups);
            for t in 0..tokens {
                let xs = &split[t * k..(t + 1) * k];
                let gs = &sums[t * groups..(t + 1) * groups];
                // SAFETY: the CPU supports the path (checked above).
                put(t, unsafe { avx2::dot_int4(xs, gs, p, s, b) });
            }
        });
    });
    Ok(())
}

fn row_of<'a>(w: &Int4Matrix<'a>, row: usize, groups: usize) -> (&'a [u8], &'a [u16], &'a [u16]) {
    let half = w.cols / 2;
    (
        &w.packed[row * half..(row + 1) * half],
        &w.scales[row * groups..(row + 1) * groups],
        &w.biases[row * groups..(row + 1) * groups],
    )
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::GROUP_SIZE;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// `x · w` for f16 `w`, 32 weights per iteration in four accumulators.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f16(x: &[f32], w: &[u16]) -> f32 {
        let k = x.len().min(w.len());
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= k {
            for (j, a) in acc.iter_mut().enumerate() {
                let wv = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(i + 8 * j) as *const __m128i));
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(i + 8 * j)), wv, *a);
            }
            i += 32;
        }
        while i + 8 <= k {
            let wv = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(i) as *const __m128i));
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(i)), wv, acc[0]);
            i += 8;
        }
        let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut total = hsum(sum);
        total += crate::scalar::dot_f16(&x[i..k], &w[i..k]);
        total
    }

    /// One int4 row times activations rearranged by `matmul_int4` (`xs`: per group the inputs of
    /// the low nibbles, then of the high ones; `sums`: each group's sum of inputs).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_int4(xs: &[f32], sums: &[f32], packed: &[u8], scales: &[u16], biases: &[u16]) -> f32 {
        let groups = sums.len();
        debug_assert!(xs.len() == groups * GROUP_SIZE && packed.len() == groups * GROUP_SIZE / 2);
        let (xp, pp) = (xs.as_ptr(), packed.as_ptr());
        let low4 = _mm_set1_epi8(0x0f);
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut g = 0;
        // Scales widened 8 at a time; each group's scale is then broadcast from its lane.
        while g < groups {
            let block = (groups - g).min(8);
            let mut s8 = [0u16; 8];
            s8[..block].copy_from_slice(&scales[g..g + block]);
            let sv = _mm256_cvtph_ps(_mm_loadu_si128(s8.as_ptr() as *const __m128i));
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), sv);
            for (j, &scale) in lanes.iter().enumerate().take(block) {
                let gi = g + j;
                let bytes = _mm_loadu_si128(pp.add(gi * 16) as *const __m128i);
                let lo = _mm_and_si128(bytes, low4);
                let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
                let x = xp.add(gi * GROUP_SIZE);
                let l0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                let l1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
                let h0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                let h1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
                let d = _mm256_mul_ps(l0, _mm256_loadu_ps(x));
                let d = _mm256_fmadd_ps(l1, _mm256_loadu_ps(x.add(8)), d);
                let e = _mm256_mul_ps(h0, _mm256_loadu_ps(x.add(16)));
                let e = _mm256_fmadd_ps(h1, _mm256_loadu_ps(x.add(24)), e);
                let s = _mm256_set1_ps(scale);
                acc0 = _mm256_fmadd_ps(d, s, acc0);
                acc1 = _mm256_fmadd_ps(e, s, acc1);
            }
            g += block;
        }
        let mut total = hsum(_mm256_add_ps(acc0, acc1));
        // The bias term: Σ_g bias_g · Σ x_g.
        let mut b = 0;
        let mut bacc = _mm256_setzero_ps();
        while b + 8 <= groups {
            let bv = _mm256_cvtph_ps(_mm_loadu_si128(biases.as_ptr().add(b) as *const __m128i));
            bacc = _mm256_fmadd_ps(bv, _mm256_loadu_ps(sums.as_ptr().add(b)), bacc);
            b += 8;
        }
        total += hsum(bacc);
        for i in b..groups {
            total += half::f16::from_bits(biases[i]).to_f32() * sums[i];
        }
        total
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod avx2 {
    pub unsafe fn dot_f16(_: &[f32], _: &[u16]) -> f32 {
        unreachable!("the AVX2 path is never chosen off x86-64")
    }
    pub unsafe fn dot_int4(_: &[f32], _: &[f32], _: &[u8], _: &[u16], _: &[u16]) -> f32 {
        unreachable!("the AVX2 path is never chosen off x86-64")
    }
}
