//! `out = x W^T` for f16 `W` and two to a few dozen tokens: register tiles of a few weight rows
//! by a few tokens, straight over the row-major f16 weights.
//!
//! [`crate::gemm`] converts every weight of a call to f32 panels first and then multiplies them
//! as outer products. With many tokens that conversion is paid once for all of them; with a
//! dozen it costs about as much as the multiply-adds, because turning f16 rows into panels is a
//! transpose in registers. Here each weight is widened in registers where it is used instead:
//! a tile of a few rows by a few tokens keeps one accumulator per row and token and, per step
//! of one register of columns, widens each row's weights once and loads each token's
//! activations once for rows x tokens multiply-adds. The sums are taken across the register at
//! the end of the row. A tile's rows stay in the first-level cache while the call's token tiles
//! pass over them, so the weights are read from memory once per call.
//!
//! The activations of every token are read once per tile of rows: they must stay in the core's
//! second-level cache, which bounds the tokens this serves ([`crate::matmul`] decides).

use crate::matmul::{for_each_row_run, F16Matrix, SendPtr, MIN_ROWS_PER_TASK};
use crate::pool::Pool;
use crate::Isa;

/// `out[t * n + r] = x[t, :] · W[r, :]` for the rows of `run`, every token of `x` (`[tokens, k]`).
///
/// # Safety
/// `isa` has AVX2, FMA and F16C and the CPU runs it; `out` holds `tokens` rows of `w.rows`
/// elements, of which the task owns the columns of `run`.
unsafe fn rows_run(isa: Isa, x: &[f32], tokens: usize, w: F16Matrix<'_>, run: std::ops::Range<usize>, out: *mut f32) {
    let (n, k) = (w.rows, w.cols);
    let wide = isa.has_avx512();
    let (rows_per_tile, tokens_per_tile) = shape(isa, tokens);
    for r0 in run.clone().step_by(rows_per_tile) {
        let rows = rows_per_tile.min(run.end - r0);
        let weights = w.data.as_ptr().add(r0 * k);
        // While the tokens pass over this tile's rows (from the first-level cache), the next
        // tile's rows are asked for from memory: without it a call of a dozen tokens read its
        // weights and multiplied them in turns instead of at once.
        let next = weights.add(rows * k);
        let next_rows = rows_per_tile.min(run.end.saturating_sub(r0 + rows_per_tile));
        for (t0, count) in crate::gemm::balanced_tiles(tokens, tokens_per_tile) {
            let tile = Tile {
                weights,
                rows,
                shape_rows: rows_per_tile,
                x: x.as_ptr().add(t0 * k),
                tokens: count,
                k,
                out: out.add(t0 * n + r0),
                n,
                next,
                next_rows,
            };
            if wide {
                avx512::tile(&tile);
            } else {
                avx2::tile(&tile);
            }
        }
    }
}

/// The tile shape (rows, tokens) for a call of `tokens` tokens on `isa`. On AVX-512, a pass of
/// a four-token tile over a block of rows costs about three quarters of a six-token one's
/// (`examples/f16_rate.rs`), so the shape that covers the tokens for less is taken: six rows by
/// four tokens for calls of 2-4, 7-8 and 19-20 tokens, four by six otherwise.
fn shape(isa: Isa, tokens: usize) -> (usize, usize) {
    if !isa.has_avx512() {
        return avx2::SHAPE;
    }
    let [six, four] = avx512::SHAPES;
    if 3 * tokens.div_ceil(four.1) < 4 * tokens.div_ceil(six.1) {
        four
    } else {
        six
    }
}

/// One register tile: `rows` weight rows from `weights` (`k` apart) times `tokens` tokens'
/// activations from `x` (`k` apart), the sums written to `out[t * n + r]`.
struct Tile {
    weights: *const u16,
    rows: usize,
    /// The rows of a whole tile of this shape (the last tile of a run may have fewer).
    shape_rows: usize,
    x: *const f32,
    tokens: usize,
    k: usize,
    out: *mut f32,
    n: usize,
    next: *const u16,
    next_rows: usize,
}

/// `out[t, r] = x[t, :] · W[r, :]` for `tokens` tokens, rows split over the pool.
///
/// # Safety
/// `isa` has AVX2, FMA and F16C and the CPU runs it; the shapes were checked (`x` `[tokens,
/// w.cols]`, `out` `[tokens, w.rows]`, `w.data` `[w.rows, w.cols]`).
pub(crate) unsafe fn matmul(isa: Isa, pool: &Pool, x: &[f32], tokens: usize, w: F16Matrix<'_>, out: &mut [f32]) {
    debug_assert!(isa.has_avx2() && x.len() == tokens * w.cols && out.len() == tokens * w.rows);
    let align = shape(isa, tokens).0;
    for_each_row_run(pool, w.rows, align, MIN_ROWS_PER_TASK, out, &|run, out: &SendPtr| {
        // SAFETY: as the caller promised; the run's columns of `out` are this task's.
        unsafe { rows_run(isa, x, tokens, w, run, out.0) }
    });
}

/// The scalar tail of a row's dot product (columns past the last whole register): the sum
/// `crate::scalar::dot_f16` takes, written out here because calling that instead made the
/// tiles 10-14% slower on SmolLM2's shapes (`panel_stream_rate`, 2026-11-30: LLVM's code for
/// the tiles' loops is sensitive to what their last steps call; time any change there).
///
/// # Safety
/// `w` and `x` valid for `k` values.
unsafe fn tail(w: *const u16, x: *const f32, from: usize, k: usize) -> f32 {
    (from..k).map(|c| half::f16::from_bits(*w.add(c)).to_f32() * *x.add(c)).sum()
}

/// Calls `$f::<R, T>($tile)` with `R` and `T` the const forms of the tile's `rows` and `tokens`
/// (each one of the literals listed), so that the tile's loops over rows and tokens are
/// unrolled with their accumulators in registers.
macro_rules! for_tile {
    ($tile:expr, [$($r:literal),+], $ts:tt, $f:ident) => {
        match $tile.rows {
            $($r => for_tile!(@tokens $tile, $r, $ts, $f),)+
            other => unreachable!("a tile of {other} rows"),
        }
    };
    (@tokens $tile:expr, $r:literal, [$($t:literal),+], $f:ident) => {
        match $tile.tokens {
            $($t => $f::<$r, $t>($tile),)+
            other => unreachable!("a tile of {other} tokens"),
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{tail, Tile};
    use std::arch::x86_64::*;

    /// The tiles' shapes, rows by tokens: each keeps 24 accumulators beside its widened weight
    /// registers and a token's activations in the 32 registers. Four rows by six tokens load the
    /// fewest registers per multiply-add; six by four take a call of four or eight tokens in
    /// fewer passes ([`super::shape`]).
    pub(super) const SHAPES: [(usize, usize); 2] = [(4, 6), (6, 4)];

    /// # Safety
    /// AVX-512F, AVX2, FMA and F16C; the tile's pointers valid for its rows, tokens and `k`;
    /// its shape within one of [`SHAPES`].
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn tile(tile: &Tile) {
        if tile.shape_rows == 4 {
            for_tile!(tile, [1, 2, 3, 4], [1, 2, 3, 4, 5, 6], rows_tokens)
        } else {
            for_tile!(tile, [1, 2, 3, 4, 5, 6], [1, 2, 3, 4], rows_tokens)
        }
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn rows_tokens<const R: usize, const T: usize>(tile: &Tile) {
        let Tile { weights, x, k, out, n, next, next_rows, .. } = *tile;
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let mut c = 0;
        while c + 16 <= k {
            if c % 32 == 0 {
                for r in 0..next_rows {
                    _mm_prefetch::<_MM_HINT_T0>(next.add(r * k + c) as *const i8);
                }
            }
            let w: [__m512; R] =
                std::array::from_fn(|r| _mm512_cvtph_ps(_mm256_loadu_si256(weights.add(r * k + c) as *const __m256i)));
            for t in 0..T {
                let xv = _mm512_loadu_ps(x.add(t * k + c));
                for (row, w) in acc.iter_mut().zip(&w) {
                    row[t] = _mm512_fmadd_ps(*w, xv, row[t]);
                }
            }
            c += 16;
        }
        for (r, acc) in acc.iter().enumerate() {
            for (t, &a) in acc.iter().enumerate() {
                let sum = _mm512_reduce_add_ps(a) + tail(weights.add(r * k), x.add(t * k), c, k);
                *out.add(t * n + r) = sum;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{tail, Tile};
    use std::arch::x86_64::*;

    /// The tile's shape, rows by tokens: twelve accumulators and three widened weight registers
    /// in AVX2's sixteen (the activations are operands of the multiply-adds).
    pub(super) const SHAPE: (usize, usize) = (3, 4);

    /// # Safety
    /// AVX2, FMA and F16C; the tile's pointers valid for its rows, tokens and `k`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile(tile: &Tile) {
        for_tile!(tile, [1, 2, 3], [1, 2, 3, 4], rows_tokens)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows_tokens<const R: usize, const T: usize>(tile: &Tile) {
        let Tile { weights, x, k, out, n, next, next_rows, .. } = *tile;
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let mut c = 0;
        while c + 8 <= k {
            if c % 32 == 0 {
                for r in 0..next_rows {
                    _mm_prefetch::<_MM_HINT_T0>(next.add(r * k + c) as *const i8);
                }
            }
            let w: [__m256; R] =
                std::array::from_fn(|r| _mm256_cvtph_ps(_mm_loadu_si128(weights.add(r * k + c) as *const __m128i)));
            for t in 0..T {
                let xv = _mm256_loadu_ps(x.add(t * k + c));
                for (row, w) in acc.iter_mut().zip(&w) {
                    row[t] = _mm256_fmadd_ps(*w, xv, row[t]);
                }
            }
            c += 8;
        }
        for (r, acc) in acc.iter().enumerate() {
            for (t, &a) in acc.iter().enumerate() {
                let sum = crate::simd::sum8(a) + tail(weights.add(r * k), x.add(t * k), c, k);
                *out.add(t * n + r) = sum;
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod avx512 {
    pub(super) const SHAPES: [(usize, usize); 2] = [(4, 6), (6, 4)];
    pub(super) unsafe fn tile(_: &super::Tile) {
        unreachable!("the AVX paths are never chosen off x86-64")
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod avx2 {
    pub(super) const SHAPE: (usize, usize) = (3, 4);
    pub(super) unsafe fn tile(_: &super::Tile) {
        unreachable!("the AVX paths are never chosen off x86-64")
    }
}
