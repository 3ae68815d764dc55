//! The greedy token of each row of logits: the first index of the row's largest value.
//!
//! A batched decode picks one token per sequence from `[sequences, vocab]` logits. As a graph's
//! reduction over (value, index) pairs XLA's CPU backend compiles it to a scalar loop on one
//! thread, which for eight rows of SmolLM2's 49,152 logits took a noticeable share of the step;
//! here each row is two vector passes (its largest value, then where it first occurs) and the
//! rows are shared over the pool.

use crate::pool::Pool;
use crate::{check_len, scalar, Isa, ShapeError};

/// `out[r]` = the first index of the largest value of row `r` of `logits` (`[rows, cols]`,
/// `rows = out.len()`), NaN never the largest, 0 for a row with no value above -inf: the result
/// of [`scalar::argmax`] on each row.
pub fn argmax_rows(isa: Isa, pool: &Pool, logits: &[f32], cols: usize, out: &mut [u32]) -> Result<(), ShapeError> {
    let rows = out.len();
    check_len("logits", logits.len(), rows * cols)?;
    if rows == 0 || cols == 0 {
        out.fill(0);
        return Ok(());
    }
    let wide = isa.has_avx512() && isa.is_supported();
    let row = |r: usize| -> u32 {
        let values = &logits[r * cols..(r + 1) * cols];
        if wide {
            // SAFETY: the CPU has AVX-512 (checked above).
            unsafe { x86::argmax(values) }
        } else {
            scalar::argmax(values)
        }
    };
    let results: Vec<std::sync::atomic::AtomicU32> = (0..rows).map(|_| Default::default()).collect();
    pool.run(rows, &|r| results[r].store(row(r), std::sync::atomic::Ordering::Relaxed));
    for (o, r) in out.iter_mut().zip(results) {
        *o = r.into_inner();
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// [`crate::scalar::argmax`] of `values` in 512-bit registers.
    ///
    /// # Safety
    /// AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn argmax(values: &[f32]) -> u32 {
        let n = values.len();
        let p = values.as_ptr();
        let lanes = |i: usize| -> __mmask16 {
            if n - i >= 16 {
                !0
            } else {
                (1u16 << (n - i)) - 1
            }
        };
        // The largest value: `max(x, m)` keeps `m` where `x` is NaN, so NaN never wins.
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        for i in (0..n).step_by(16) {
            let x = _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), lanes(i), p.add(i));
            m = _mm512_max_ps(x, m);
        }
        let max = _mm512_reduce_max_ps(m);
        if max == f32::NEG_INFINITY {
            // Nothing above -inf: the scalar loop never moves from index 0.
            return 0;
        }
        let target = _mm512_set1_ps(max);
        for i in (0..n).step_by(16) {
            let hit = _mm512_mask_cmpeq_ps_mask(lanes(i), _mm512_maskz_loadu_ps(lanes(i), p.add(i)), target);
            if hit != 0 {
                return (i + hit.trailing_zeros() as usize) as u32;
            }
        }
        unreachable!("the largest value occurs in the row")
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    pub unsafe fn argmax(_: &[f32]) -> u32 {
        unreachable!("the AVX-512 path is never chosen off x86-64")
    }
}
