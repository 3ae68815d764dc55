//! One query position's attention in 256-bit registers (AVX2) for the query heads of one KV
//! head, as the 512-bit `wide` path does it in half-width registers: the scores of 24 positions
//! at a time held in three registers per head over the whole head dimension (each row of keys
//! read once for every head of the pass, no partial sums through memory), the softmax's
//! exponentials eight at a time, and the values weighted 16 of a head's values at a time, each
//! row's slice loaded once for the heads of the pass. Sixteen registers bound a pass to three
//! heads.

use super::CacheElement;
use crate::simd::{exp, first_lanes, max8, sum8};
use std::arch::x86_64::*;

/// Eight elements from `p`, widened to f32 if the caches are f16.
///
/// # Safety
/// AVX2 and F16C; eight elements from `p` lie inside the cache.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load<E: CacheElement>(p: *const E) -> __m256 {
    if E::HALF {
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<__m128i>()))
    } else {
        _mm256_loadu_ps(p.cast::<f32>())
    }
}

/// The first `n` (under eight) elements from `p` as [`load`] widens them, zero in the other
/// lanes (`lanes` is the mask of the first `n`): AVX2 has no 16-bit masked load, so f16 goes
/// through a zeroed copy.
///
/// # Safety
/// As [`load`], for `n` elements.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load_first<E: CacheElement>(p: *const E, n: usize, lanes: __m256i) -> __m256 {
    if E::HALF {
        let mut copy = [0u16; 8];
        std::ptr::copy_nonoverlapping(p.cast::<u16>(), copy.as_mut_ptr(), n.min(8));
        _mm256_cvtph_ps(_mm_loadu_si128(copy.as_ptr().cast::<__m128i>()))
    } else {
        _mm256_maskload_ps(p.cast::<f32>(), lanes)
    }
}

/// Whether a head of `d` values takes this path: whole slices of 16 values.
pub(super) fn fits(d: usize) -> bool {
    d > 0 && d.is_multiple_of(VALUES)
}

/// Query heads one call of [`attend_heads`] takes at most: three keep their score accumulators
/// (nine registers), a row of keys (three) and a query value in the sixteen registers.
pub(super) fn heads_per_pass(_: usize) -> usize {
    3
}

/// Registers of positions per pass of the scores.
const POSITION_REGISTERS: usize = 3;

/// Positions per pass of the scores.
const POSITIONS: usize = 8 * POSITION_REGISTERS;

/// How far ahead of a pass a row of keys is fetched, in positions (four passes).
const KEYS_AHEAD: usize = 4 * POSITIONS;

/// Lines of a span's values asked for while the first pass of scores runs: all of a short
/// span's (a few tens of positions), a start on a long one's, within the first level's cache.
const VALUE_LINES_AHEAD: usize = 256;

/// A head's values per pass of the weighted sum (two registers).
const VALUES: usize = 16;

/// The `n = q.len() / d` query heads of `q` (up to [`heads_per_pass`]) against positions `span`
/// of one KV head, the softmax left unnormalized: per head, `part` gets the span's largest
/// scaled score, the sum of the exponentials relative to it, and the values weighted by them
/// (`[n, 2 + d]`). Per head the operations and their order are those of a single head's pass, so
/// the heads of a group get the numbers they get alone. `scores` holds at least `n` times the
/// span's length rounded up to 8.
///
/// # Safety
/// AVX2 and FMA; `keys` `[d, c]` and `values` `[c, d]` of one KV head, `span` within `0..c` and
/// not empty, `d` of [`fits`] size.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn attend_heads<E: CacheElement>(
    q: &[f32],
    keys: &[E],
    values: &[E],
    c: usize,
    span: std::ops::Range<usize>,
    scale: f32,
    scores: &mut [f32],
    part: &mut [f32],
) {
    let n = (part.len() - q.len()) / 2;
    debug_assert!(n >= 1 && part.len() == q.len() + 2 * n);
    match n {
        1 => attend_hs::<E, 1>(q, keys, values, c, span, scale, scores, part),
        2 => attend_hs::<E, 2>(q, keys, values, c, span, scale, scores, part),
        3 => attend_hs::<E, 3>(q, keys, values, c, span, scale, scores, part),
        n => unreachable!("{n} heads in one pass"),
    }
}

/// The lanes of the register of 8 positions from `first` that lie before `end`, as a mask of
/// whole lanes.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn lanes(first: usize, end: usize) -> __m256i {
    first_lanes(end.saturating_sub(first))
}

/// [`attend_heads`] for `S` heads.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_hs<E: CacheElement, const S: usize>(
    q: &[f32],
    keys: &[E],
    values: &[E],
    c: usize,
    span: std::ops::Range<usize>,
    scale: f32,
    scores: &mut [f32],
    part: &mut [f32],
) {
    let d = q.len() / S;
    let (lo, hi) = (span.start, span.end);
    let stride = (hi - lo).next_multiple_of(8);
    debug_assert!(part.len() == S * (2 + d) && lo < hi && hi <= c && fits(d));
    debug_assert!(keys.len() >= d * c && values.len() >= c * d && scores.len() >= S * stride);
    let sp = scores.as_mut_ptr();
    let qp = q.as_ptr();
    let below = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut max = [below; S];
    // A batch's caches come from memory in short runs that the hardware's prefetchers barely
    // start on: the values are asked for during the first pass of scores, a few lines per row
    // of keys, and each pass asks for the next pass's keys (never past the span, where a
    // prefetch fetches keys no pass reads).
    let first_values = values.as_ptr().add(lo * d) as *const i8;
    let value_lines = ((hi - lo) * d * std::mem::size_of::<E>()).div_ceil(64).min(VALUE_LINES_AHEAD);
    let value_lines_per_row = value_lines.div_ceil(d);
    // Scores, 24 positions per pass; lanes past the span are neither read nor kept.
    for p0 in (lo..hi).step_by(POSITIONS) {
        let m: [__m256i; POSITION_REGISTERS] = std::array::from_fn(|v| lanes(p0 + 8 * v, hi));
        let whole = p0 + POSITIONS <= hi;
        let ahead = [KEYS_AHEAD, POSITIONS].into_iter().find(|&a| p0 + a < hi);
        let mut acc = [[_mm256_setzero_ps(); POSITION_REGISTERS]; S];
        for j in 0..d {
            if p0 == lo {
                for l in j * value_lines_per_row..value_lines.min((j + 1) * value_lines_per_row) {
                    _mm_prefetch::<_MM_HINT_T0>(first_values.wrapping_add(64 * l));
                }
            }
            let row = keys.as_ptr().add(j * c + p0);
            // The head's rows are read side by side, too many streams for the hardware to
            // follow: ask for each row's next lines (a pass reads 96 bytes of it) a few passes
            // ahead, or the next pass's near the span's end.
            if let Some(ahead) = ahead {
                _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(ahead) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(ahead + 16) as *const i8);
            }
            let k: [__m256; POSITION_REGISTERS] = std::array::from_fn(|v| {
                if whole {
                    load(row.add(8 * v))
                } else {
                    load_first(row.add(8 * v), hi.saturating_sub(p0 + 8 * v), m[v])
                }
            });
            for (s, acc) in acc.iter_mut().enumerate() {
                let qj = _mm256_set1_ps(*qp.add(s * d + j));
                for v in 0..POSITION_REGISTERS {
                    acc[v] = _mm256_fmadd_ps(qj, k[v], acc[v]);
                }
            }
        }
        for (s, acc) in acc.iter().enumerate() {
            for v in 0..POSITION_REGISTERS {
                if p0 + 8 * v < hi {
                    let x = _mm256_mul_ps(acc[v], _mm256_set1_ps(scale));
                    max[s] = _mm256_max_ps(max[s], _mm256_blendv_ps(below, x, _mm256_castsi256_ps(m[v])));
                    _mm256_storeu_ps(sp.add(s * stride + p0 - lo + 8 * v), x);
                }
            }
        }
    }
    // Exponentials and their sum, eight at a time.
    let mut top = [0.0f32; S];
    let mut total = [0.0f32; S];
    for s in 0..S {
        top[s] = max8(max[s]);
        let big = _mm256_set1_ps(top[s]);
        let mut sum = _mm256_setzero_ps();
        for p0 in (0..hi - lo).step_by(8) {
            let at = sp.add(s * stride + p0);
            let e = exp(_mm256_sub_ps(_mm256_loadu_ps(at), big));
            sum = _mm256_add_ps(sum, _mm256_and_ps(e, _mm256_castsi256_ps(lanes(p0, hi - lo))));
            _mm256_storeu_ps(at, e);
        }
        total[s] = sum8(sum);
    }
    // The values weighted by the exponentials, 16 of each head's values at a time in registers.
    let out = part.as_mut_ptr();
    for d0 in (0..d).step_by(VALUES) {
        let mut acc = [[_mm256_setzero_ps(); 2]; S];
        for pos in lo..hi {
            let row = values.as_ptr().add(pos * d + d0);
            let vals = [load(row), load(row.add(8))];
            for (s, acc) in acc.iter_mut().enumerate() {
                let p = _mm256_set1_ps(*sp.add(s * stride + pos - lo));
                acc[0] = _mm256_fmadd_ps(p, vals[0], acc[0]);
                acc[1] = _mm256_fmadd_ps(p, vals[1], acc[1]);
            }
        }
        for (s, acc) in acc.iter().enumerate() {
            let at = out.add(s * (2 + d) + 2 + d0);
            _mm256_storeu_ps(at, acc[0]);
            _mm256_storeu_ps(at.add(8), acc[1]);
        }
    }
    for s in 0..S {
        *out.add(s * (2 + d)) = top[s];
        *out.add(s * (2 + d) + 1) = total[s];
    }
}
