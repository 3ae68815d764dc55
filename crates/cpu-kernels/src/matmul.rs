//! `y = x W^T` for weights stored as f16, seam's int4 or seam's int8, f32 activations and results.

use crate::gemm::{self, gemm, Pack, Weights};
use crate::pool::Pool;
use crate::q8;
use crate::scratch::Scratch;
use crate::vnni::{self, Prepared};
use crate::{check_len, scalar, Isa, ShapeError};

/// Weights per int4 group (ADR 0002).
pub const GROUP_SIZE: usize = 32;

/// Tasks per thread of the pool. Each task is one contiguous run of rows: the hardware
/// prefetchers follow a long stream but restart at every jump, so few long runs read memory
/// faster than many short ones, while more than one per thread keeps a thread that was
/// descheduled from holding up the whole call.
pub(crate) const TASKS_PER_THREAD: usize = 4;

/// The fewest rows of a task: below this, waking another thread costs more than it saves.
pub(crate) const MIN_ROWS_PER_TASK: usize = 16;

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

/// An int8 matrix `[rows, cols]` in seam's format (ADR 0013): `codes` `[rows, cols]`, `scales`
/// `[rows, cols / 32]` as f16 bits; weight = scale * code.
#[derive(Debug, Clone, Copy)]
pub struct Int8Matrix<'a> {
    pub rows: usize,
    pub cols: usize,
    pub codes: &'a [i8],
    pub scales: &'a [u16],
}

/// Computes output row `n` and hands each token's value to the writer.
type RowFn<'a> = dyn Fn(usize, &mut dyn FnMut(usize, f32)) + Sync + 'a;

/// Splits the output rows over the pool and runs `row(n, out_row_of_each_token)`.
///
/// `out` is `[tokens, rows]`: each task writes the columns `n` of its rows in every token's row of
/// the output, which no other task touches.
fn for_each_row(pool: &Pool, rows: usize, tokens: usize, out: &mut [f32], row: &RowFn<'_>) {
    for_each_row_run(pool, rows, 1, MIN_ROWS_PER_TASK, out, &|run, out_ptr| {
        for n in run {
            row(n, &mut |t, value| {
                debug_assert!(t < tokens);
                // SAFETY: element (t, n) of `out` ([tokens, rows]) belongs to this task's rows only.
                unsafe { *out_ptr.0.add(t * rows + n) = value };
            });
        }
    });
}

/// Cuts `rows` output rows into contiguous runs, a few per thread of the pool (each a multiple
/// of `align` rows, except the last, and at least `min_rows`), and runs `task(run, out)` for each
/// on the pool; a task writes only its own rows' columns of `out`.
pub(crate) fn for_each_row_run(
    pool: &Pool,
    rows: usize,
    align: usize,
    min_rows: usize,
    out: &mut [f32],
    task: &(dyn Fn(std::ops::Range<usize>, &SendPtr) + Sync),
) {
    let per_task = rows.div_ceil(pool.threads() * TASKS_PER_THREAD).next_multiple_of(align).max(min_rows);
    let tasks = rows.div_ceil(per_task);
    let out_ptr = SendPtr(out.as_mut_ptr());
    pool.run(tasks, &|i| {
        let start = i * per_task;
        task(start..(start + per_task).min(rows), &out_ptr);
    });
}

/// `out`'s pointer, shared by tasks that each write their own elements of it.
pub(crate) struct SendPtr(pub(crate) *mut f32);
// SAFETY: tasks write disjoint elements through it (see `for_each_row_run`).
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
    let tiles_to = f16_tiles_to_tokens(k);
    if isa.has_avx2() && (2..=tiles_to).contains(&tokens) {
        // SAFETY: the CPU runs the path (checked above); the shapes were checked above.
        unsafe { crate::f16_tiles::matmul(isa, pool, x, tokens, w, out) };
        return Ok(());
    }
    if isa.has_avx2() && tokens > tiles_to {
        // SAFETY: the AVX2 path, which the CPU supports (checked above); `row0` is a row of `w`
        // (the product splits rows at panels) and the chunk's columns are within `k`.
        let pack = |row0, k0, dst: &mut [f32]| unsafe { gemm::avx2::f16_panel(w.data, k, row0, k0, dst) };
        let ahead = |row0, k0, columns| {
            for row in row0..n.min(row0 + gemm::PANEL_WIDTH) {
                gemm::prefetch(&w.data[row * k + k0..row * k + k0 + columns]);
            }
        };
        gemm(isa, pool, x, k, n, out, Weights { pack: Pack::Panels(&pack), ahead: &ahead });
        return Ok(());
    }
    if isa.has_avx2() {
        debug_assert_eq!(tokens, 1);
        // One token: each task's run of rows in one call of the kernel (no call per row).
        for_each_row_run(pool, n, 1, MIN_ROWS_PER_TASK, out, &|run, out| {
            // SAFETY: the CPU supports the path (checked above); `out` is `[1, n]` and these rows
            // of it are the task's.
            unsafe { avx2::f16_rows(x, w, run, out.0) }
        });
        return Ok(());
    }
    for_each_row(pool, n, tokens, out, &|row, put| {
        for t in 0..tokens {
            put(t, scalar::dot_f16(&x[t * k..(t + 1) * k], &w.data[row * k..(row + 1) * k]));
        }
    });
    Ok(())
}

/// The largest magnitude of an activation rounded to i16: products with a nibble (at most 15),
/// summed in pairs, stay far inside i32.
pub(crate) const I16_RANGE: f32 = 32767.0;

/// How much finer the second i16 of an activation is than the first (2^15: the first's rounding
/// error, at most half a step, is then at most 16384 fine steps).
pub(crate) const FINE: f32 = 32768.0;

/// Activations prepared for the int4 fast path, reused across calls on one thread.
#[derive(Default)]
struct Int4Scratch {
    quantized: Vec<i16>,
    steps: Vec<f32>,
    sums: Vec<f32>,
}

crate::scratch::footprint!(Int4Scratch: quantized, steps, sums);

static INT4_SCRATCH: Scratch<Int4Scratch> = Scratch::new();

/// `out[t, n] = x[t, :] · W[n, :]` for int4 `W`: `x` is `[tokens, cols]`, `out` `[tokens, rows]`.
///
/// Computed per group as `scale · (x_g · q_g) + bias · Σ x_g`; the dequantized matrix never
/// exists. On the fast paths `x_g · q_g` is two integer dot products: each group of activations
/// is written as two i16 parts against its largest magnitude (to about 2^-30 of it: f32's
/// precision), the nibbles are widened to i16 in registers, and pairs are multiplied and added
/// in one instruction. The bias term uses the exact f32 sums.
pub fn matmul_int4(
    isa: Isa,
    pool: &Pool,
    x: &[f32],
    tokens: usize,
    w: Int4Matrix<'_>,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let (n, k, groups) = check_int4(&w, x.len(), tokens, out.len())?;
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
    if tokens >= GEMM_FROM_TOKENS {
        let pack = |row, k0, dst: &mut [f32]| {
            let (p, s, b) = row_of(&w, row, groups);
            let (g0, g1) = (k0 / GROUP_SIZE, (k0 + dst.len()) / GROUP_SIZE);
            // SAFETY: the AVX2 path, which the CPU supports (checked above).
            unsafe { gemm::avx2::dequantize_int4(&p[k0 / 2..], &s[g0..g1], &b[g0..g1], dst) }
        };
        let ahead = |row, k0, columns| {
            let (p, s, b) = row_of(&w, row, groups);
            let (g0, g1) = (k0 / GROUP_SIZE, (k0 + columns) / GROUP_SIZE);
            gemm::prefetch(&p[k0 / 2..(k0 + columns) / 2]);
            gemm::prefetch(&s[g0..g1]);
            gemm::prefetch(&b[g0..g1]);
        };
        gemm(isa, pool, x, k, n, out, Weights { pack: Pack::Rows(&pack), ahead: &ahead });
        return Ok(());
    }
    if isa == Isa::Avx512Vnni && tokens <= VNNI_MAX_TOKENS {
        vnni_rows::<{ vnni::INT4_CODES_PER_WORD }>(pool, x, tokens, k, n, out, &|prepared, rows, out| {
            // SAFETY: the CPU supports the path (checked above); `prepared` is for `k` inputs, `out`
            // is `[tokens, n]` and these rows' columns of it are the task's.
            by_tokens!(prepared, ps => unsafe { vnni::x86::int4_rows(ps, &w, rows, out) })
        });
        return Ok(());
    }
    if tokens >= BLOCK_FROM_TOKENS {
        // Each group dequantized in registers exactly as the format defines it (scale * q + bias
        // in f32), once for a block of tokens.
        let wide = isa.has_avx512();
        token_blocks(pool, x, tokens, k, n, out, token_block(isa), &|row, xs, count| {
            let (p, s, b) = row_of(&w, row, groups);
            // SAFETY: the CPU supports the path taken (checked above).
            unsafe {
                match wide {
                    true => avx512::dot_int4_block(p, s, b, xs, count),
                    false => widened(avx2::dot_int4_block(p, s, b, xs, count)),
                }
            }
        });
        return Ok(());
    }
    // Each token's activations as the fast path reads them, per group of 32: the inputs that meet
    // low nibbles, then those that meet high nibbles, as i16 multiples of the group's step (its
    // largest magnitude / 32767), then the same for what that rounding left over, in steps 2^15
    // times finer. The two integer dot products together carry the activations to about 2^-30
    // of the group's largest magnitude: f32's precision, where one i16 alone lost too much on
    // groups with an outlier. Per group also the step and the exact f32 sum of the inputs (for the
    // bias term).
    INT4_SCRATCH.with(|scratch| {
        let Int4Scratch { quantized, steps, sums } = scratch;
        quantized.clear();
        quantized.resize(tokens * k * 2, 0);
        steps.clear();
        steps.resize(tokens * groups, 0.0);
        sums.clear();
        sums.resize(tokens * groups, 0.0);
        for t in 0..tokens {
            let xr = &x[t * k..(t + 1) * k];
            for g in 0..groups {
                let src = &xr[g * GROUP_SIZE..(g + 1) * GROUP_SIZE];
                let at = (t * groups + g) * 2 * GROUP_SIZE;
                let dst = &mut quantized[at..at + 2 * GROUP_SIZE];
                let max = src.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let step = max / I16_RANGE;
                let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
                for i in 0..GROUP_SIZE {
                    // Input order within the group: the 16 low-nibble inputs, then the 16 high.
                    let v = if i < GROUP_SIZE / 2 { src[2 * i] } else { src[2 * (i - GROUP_SIZE / 2) + 1] };
                    let coarse = (v * inv).round();
                    let rest = ((v * inv - coarse) * FINE).round();
                    dst[i] = coarse as i16;
                    dst[GROUP_SIZE + i] = rest as i16;
                }
                steps[t * groups + g] = step;
                sums[t * groups + g] = src.iter().sum();
            }
        }
        let (quantized, steps, sums) = (&*quantized, &*steps, &*sums);
        for_each_row(pool, n, tokens, out, &|row, put| {
            let (p, s, b) = row_of(&w, row, groups);
            for t in 0..tokens {
                let xq = &quantized[t * 2 * k..(t + 1) * 2 * k];
                let st = &steps[t * groups..(t + 1) * groups];
                let gs = &sums[t * groups..(t + 1) * groups];
                // SAFETY: the CPU supports the path (checked above).
                put(t, unsafe { avx2::dot_int4(xq, st, gs, p, s, b) });
            }
        });
    });
    Ok(())
}

/// `out[t, n] = x[t, :] · W[n, :]` for int8 `W`: `x` is `[tokens, cols]`, `out` `[tokens, rows]`.
///
/// Computed per group as `scale · (x_g · q_g)` with the codes widened to f32 in registers: a
/// matrix-vector product is bound by the bytes it reads, and those are the stored codes.
pub fn matmul_int8(
    isa: Isa,
    pool: &Pool,
    x: &[f32],
    tokens: usize,
    w: Int8Matrix<'_>,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let (n, k, groups) = check_int8(&w, x.len(), tokens, out.len())?;
    let isa = if isa.is_supported() { isa } else { Isa::Scalar };
    let row_of = |row: usize| (&w.codes[row * k..(row + 1) * k], &w.scales[row * groups..(row + 1) * groups]);
    if isa.has_avx2() && tokens >= GEMM_FROM_TOKENS {
        let pack = |row, k0, dst: &mut [f32]| {
            let (codes, scales) = row_of(row);
            let g0 = k0 / GROUP_SIZE;
            // SAFETY: the AVX2 path, which the CPU supports (checked above).
            unsafe { gemm::avx2::dequantize_int8(&codes[k0..], &scales[g0..g0 + dst.len() / GROUP_SIZE], dst) }
        };
        let ahead = |row, k0, columns| {
            let (codes, scales) = row_of(row);
            gemm::prefetch(&codes[k0..k0 + columns]);
            gemm::prefetch(&scales[k0 / GROUP_SIZE..(k0 + columns) / GROUP_SIZE]);
        };
        gemm(isa, pool, x, k, n, out, Weights { pack: Pack::Rows(&pack), ahead: &ahead });
        return Ok(());
    }
    if isa == Isa::Avx512Vnni && tokens <= VNNI_MAX_TOKENS {
        vnni_rows::<{ vnni::INT8_CODES_PER_WORD }>(pool, x, tokens, k, n, out, &|prepared, rows, out| {
            // SAFETY: the CPU supports the path (checked above); `prepared` is for `k` inputs, `out`
            // is `[tokens, n]` and these rows' columns of it are the task's.
            by_tokens!(prepared, ps => unsafe { vnni::x86::int8_rows(ps, &w, rows, out) })
        });
        return Ok(());
    }
    if isa.has_avx2() && tokens >= BLOCK_FROM_TOKENS {
        // Each group dequantized in registers exactly as the format defines it (scale * q in
        // f32), once for a block of tokens.
        let wide = isa.has_avx512();
        token_blocks(pool, x, tokens, k, n, out, token_block(isa), &|row, xs, count| {
            let (codes, scales) = row_of(row);
            // SAFETY: the CPU supports the path taken (checked above).
            unsafe {
                match wide {
                    true => avx512::dot_int8_block(codes, scales, xs, count),
                    false => widened(avx2::dot_int8_block(codes, scales, xs, count)),
                }
            }
        });
        return Ok(());
    }
    for_each_row(pool, n, tokens, out, &|row, put| {
        let (codes, scales) = row_of(row);
        for t in 0..tokens {
            let xr = &x[t * k..(t + 1) * k];
            let value = match isa {
                Isa::Scalar => scalar::dot_int8(xr, codes, scales, GROUP_SIZE),
                // SAFETY: the CPU supports the path (checked above).
                Isa::Avx2 | Isa::Avx512 | Isa::Avx512Vnni => unsafe { avx2::dot_int8(xr, codes, scales) },
            };
            put(t, value);
        }
    });
    Ok(())
}

/// Groups per row of `cols` columns of `format` (`"int4"`, `"int8"`), which must fill whole groups.
fn groups_of(cols: usize, format: &str) -> Result<usize, ShapeError> {
    if !cols.is_multiple_of(GROUP_SIZE) {
        return Err(ShapeError(format!("{format} columns {cols} are not a multiple of {GROUP_SIZE}")));
    }
    Ok(cols / GROUP_SIZE)
}

/// The parts of int4 `w` checked against its shape (in either order, row-major or panels):
/// groups per row.
pub(crate) fn int4_weights(w: &Int4Matrix<'_>) -> Result<usize, ShapeError> {
    let groups = groups_of(w.cols, "int4")?;
    check_len("int4 packed weights", w.packed.len(), w.rows * w.cols / 2)?;
    check_len("int4 scales", w.scales.len(), w.rows * groups)?;
    check_len("int4 biases", w.biases.len(), w.rows * groups)?;
    Ok(groups)
}

/// The parts of int8 `w` checked against its shape, as [`int4_weights`].
pub(crate) fn int8_weights(w: &Int8Matrix<'_>) -> Result<usize, ShapeError> {
    let groups = groups_of(w.cols, "int8")?;
    check_len("int8 codes", w.codes.len(), w.rows * w.cols)?;
    check_len("int8 scales", w.scales.len(), w.rows * groups)?;
    Ok(groups)
}

/// The shape of an int4 product, checked: `(rows, cols, groups per row)`.
fn check_int4(w: &Int4Matrix<'_>, x: usize, tokens: usize, out: usize) -> Result<(usize, usize, usize), ShapeError> {
    let (n, k) = (w.rows, w.cols);
    groups_of(k, "int4")?;
    check_len("x", x, tokens * k)?;
    let groups = int4_weights(w)?;
    check_len("output", out, tokens * n)?;
    Ok((n, k, groups))
}

/// The shape of an int8 product, checked: `(rows, cols, groups per row)`.
fn check_int8(w: &Int8Matrix<'_>, x: usize, tokens: usize, out: usize) -> Result<(usize, usize, usize), ShapeError> {
    let (n, k) = (w.rows, w.cols);
    groups_of(k, "int8")?;
    check_len("x", x, tokens * k)?;
    let groups = int8_weights(w)?;
    check_len("output", out, tokens * n)?;
    Ok((n, k, groups))
}

/// `out = round_int8(x) W^T` for int4 `W` ([`Activations::Int8`]): the activations rounded per
/// group to int8 steps ([`crate::round_int8`]) before the product. On [`Isa::Avx512Vnni`] the
/// rounded codes meet the nibbles in integer dot products of four; elsewhere the exact product
/// runs over a rounded copy.
///
/// [`Activations::Int8`]: crate::Activations::Int8
pub fn matmul_int4_q8(
    isa: Isa,
    pool: &Pool,
    x: &[f32],
    tokens: usize,
    w: Int4Matrix<'_>,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    check_int4(&w, x.len(), tokens, out.len())?;
    q8_product(isa, pool, x, tokens, q8::Weights::Int4(&w), out, |x, out| matmul_int4(isa, pool, x, tokens, w, out))
}

/// `out = round_int8(x) W^T` for int8 `W`, as [`matmul_int4_q8`] for int4.
pub fn matmul_int8_q8(
    isa: Isa,
    pool: &Pool,
    x: &[f32],
    tokens: usize,
    w: Int8Matrix<'_>,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    check_int8(&w, x.len(), tokens, out.len())?;
    q8_product(isa, pool, x, tokens, q8::Weights::Int8(&w), out, |x, out| matmul_int8(isa, pool, x, tokens, w, out))
}

/// `out = round_int8(x) W^T` (shapes checked): the VNNI rows where the CPU has them and the call
/// is short enough, else `exact(round_int8(x), out)`.
fn q8_product(
    isa: Isa,
    pool: &Pool,
    x: &[f32],
    tokens: usize,
    w: q8::Weights<'_>,
    out: &mut [f32],
    exact: impl FnOnce(&[f32], &mut [f32]) -> Result<(), ShapeError>,
) -> Result<(), ShapeError> {
    if isa == Isa::Avx512Vnni && isa.is_supported() && tokens <= Q8_VNNI_MAX_TOKENS {
        q8::vnni_product(pool, x, tokens, w, out);
        return Ok(());
    }
    over_rounded(isa, x, |x| exact(x, out))
}

/// The most tokens per call that the int8-activation products take on the VNNI path; from there
/// on the blocked product over the rounded activations is faster.
const Q8_VNNI_MAX_TOKENS: usize = 24;

/// Rounded copies of activations, reused across calls.
static ROUNDED: Scratch<Vec<f32>> = Scratch::new();

/// `product(round_int8(x))`.
pub(crate) fn over_rounded<R>(isa: Isa, x: &[f32], product: impl FnOnce(&[f32]) -> R) -> R {
    ROUNDED.with(|buf| {
        buf.resize(x.len(), 0.0);
        q8::round_int8_on(isa, x, buf);
        product(buf)
    })
}

/// Calls of up to this many tokens take the VNNI path on [`Isa::Avx512Vnni`]; from three on the
/// token blocks are faster. The integer dot product of one register costs about what two f32
/// multiply-adds of 256 bits cost on this path's CPUs, so its advantage is converting the codes
/// once for few multiply-adds: a call of one token reads memory at the machine's bandwidth, one
/// of two gains, and beyond that the instructions per token decide, which the f32 blocks
/// issue as cheaply (kernels bench, docs/performance.md).
const VNNI_MAX_TOKENS: usize = 2;

/// Runs `$body` with `$ps` bound to the prepared tokens of `$prepared` (one or two) as an array,
/// so that the kernel's loops over them are unrolled.
macro_rules! by_tokens {
    ($prepared:expr, $ps:ident => $body:expr) => {{
        let prepared: &[Prepared<'_>] = $prepared;
        macro_rules! run {
            ($r:literal) => {{
                let $ps: &[Prepared<'_>; $r] = prepared.try_into().expect("a call of $r tokens");
                $body
            }};
        }
        match prepared.len() {
            1 => run!(1),
            _ => run!(2),
        }
    }};
}
use by_tokens;

/// `rows(tokens, run, out)`: a run of output rows times the prepared tokens, written into `out`
/// (`[tokens, rows]`).
type VnniRowsFn<'a> = dyn Fn(&[Prepared<'_>], std::ops::Range<usize>, *mut f32) + Sync + 'a;

/// `out = x W^T` on the VNNI path (`E` codes per 16-bit word of the weights) for up to
/// [`VNNI_MAX_TOKENS`] tokens: each token's activations laid out once per call
/// ([`vnni::x86::prepare`]), then `rows(tokens, run, out)` for runs of output rows split over the
/// pool (a run's loop inside the kernel: one call per run, not per row).
fn vnni_rows<const E: usize>(
    pool: &Pool,
    x: &[f32],
    tokens: usize,
    k: usize,
    n: usize,
    out: &mut [f32],
    rows: &VnniRowsFn<'_>,
) {
    debug_assert!((1..=VNNI_MAX_TOKENS).contains(&tokens));
    let (per_token, groups) = vnni::prepared_len(k, E);
    INT4_SCRATCH.with(|scratch| {
        let Int4Scratch { quantized, steps, sums } = scratch;
        quantized.resize(tokens * per_token, 0);
        steps.resize(tokens * groups, 0.0);
        sums.resize(tokens * groups, 0.0);
        for t in 0..tokens {
            // SAFETY: only called on the VNNI path, which the CPU supports; the slices have the
            // lengths `prepare` needs.
            unsafe {
                vnni::x86::prepare::<E>(
                    &x[t * k..(t + 1) * k],
                    &mut quantized[t * per_token..(t + 1) * per_token],
                    &mut steps[t * groups..(t + 1) * groups],
                    &mut sums[t * groups..(t + 1) * groups],
                )
            };
        }
        let token = |t: usize| Prepared {
            quantized: &quantized[t * per_token..(t + 1) * per_token],
            steps: &steps[t * groups..(t + 1) * groups],
            sums: &sums[t * groups..(t + 1) * groups],
        };
        let block = [token(0), token(tokens - 1)];
        let block = &block[..tokens];
        for_each_row_run(pool, n, 1, MIN_ROWS_PER_TASK, out, &|run, out| rows(block, run, out.0));
    });
}

/// How many bytes ahead of the weights being read the one-token products prefetch.
pub(crate) const PREFETCH_AHEAD: usize = 1024;

/// From this many tokens per call on (a batch of decodes, a short prefill), the fast paths take
/// the tokens in blocks of [`TOKEN_BLOCK`]: each weight is read and converted to f32 in registers
/// once per block and multiplied with every token of it. The per-token kernels would convert the
/// same weights once per token, so their cost grows with the tokens; a block's grows by little
/// more than the multiply-adds.
const BLOCK_FROM_TOKENS: usize = 2;

/// From this many tokens per call on, the row-major int4 and int8 fast paths run [`gemm`]: each
/// weight converted once per call, every multiply-add fed from registers. Below it the token
/// blocks convert each weight once per block of tokens and are faster for it. (f16 products
/// take [`crate::f16_tiles`] up to [`f16_tiles_to_tokens`] instead.)
pub(crate) const GEMM_FROM_TOKENS: usize = 12;

/// The most tokens per call for which f16 products of `k` columns run [`crate::f16_tiles`] (from
/// two tokens on): register tiles over the row-major f16 weights, widened where they are used.
/// Past it [`gemm`]'s conversion to f32 panels, paid once per call, costs less than widening
/// every weight once per tile of tokens. The tiles keep every token's activations in the
/// second-level cache and pass over them once per tile of rows, so longer rows give up sooner:
/// `cargo run --release -p cpu-kernels --example f16_shape_rate` had the tiles ahead to 32
/// tokens with 576 and 1536 columns, to 24 with 2048 and to 17 with 8192 (AMD Zen 5, AVX-512):
/// `tokens x k` up to 48K values (192 KB), and never fewer than 16 tokens.
pub(crate) fn f16_tiles_to_tokens(k: usize) -> usize {
    (F16_TILES_VALUES / k.max(1)).clamp(16, 32)
}

/// Activation values (tokens x columns) of the longest f16 call [`f16_tiles_to_tokens`] gives the
/// tiles.
const F16_TILES_VALUES: usize = 48 * 1024;

/// Tokens per block on AVX2: two f32 accumulators per token, beside the converted weights, in
/// AVX2's 16 registers.
const TOKEN_BLOCK: usize = 4;

/// Tokens per block on AVX-512: the same in its 32 registers, each twice as wide, so a converted
/// weight feeds twice the tokens (the conversion is what a block of four spends most of its
/// instructions on).
const WIDE_TOKEN_BLOCK: usize = 8;

/// `dot(row, xs, count)`: the dot products of weight row `row` with `count` (1..=the block)
/// tokens' activations, laid out one after another in `xs`; entries past `count` are unused.
type BlockFn<'a> = dyn Fn(usize, &[f32], usize) -> [f32; WIDE_TOKEN_BLOCK] + Sync + 'a;

/// The block of tokens `token_blocks` takes on `isa`.
fn token_block(isa: Isa) -> usize {
    if isa.has_avx512() {
        WIDE_TOKEN_BLOCK
    } else {
        TOKEN_BLOCK
    }
}

/// Four sums as the first four of a block's.
fn widened(sums: [f32; TOKEN_BLOCK]) -> [f32; WIDE_TOKEN_BLOCK] {
    std::array::from_fn(|i| if i < TOKEN_BLOCK { sums[i] } else { 0.0 })
}

/// `out = x W^T`, each row's dot products taken `block` tokens at a time by `dot`.
#[allow(clippy::too_many_arguments)] // the product's shape, and how its rows are taken
fn token_blocks(
    pool: &Pool,
    x: &[f32],
    tokens: usize,
    k: usize,
    n: usize,
    out: &mut [f32],
    block: usize,
    dot: &BlockFn<'_>,
) {
    for_each_row(pool, n, tokens, out, &|row, put| {
        for start in (0..tokens).step_by(block) {
            let count = block.min(tokens - start);
            let sums = dot(row, &x[start * k..(start + count) * k], count);
            for (j, &value) in sums.iter().enumerate().take(count) {
                put(start + j, value);
            }
        }
    });
}

fn row_of<'a>(w: &Int4Matrix<'a>, row: usize, groups: usize) -> (&'a [u8], &'a [u16], &'a [u16]) {
    let half = w.cols / 2;
    (
        &w.packed[row * half..(row + 1) * half],
        &w.scales[row * groups..(row + 1) * groups],
        &w.biases[row * groups..(row + 1) * groups],
    )
}

/// Runs `$body` with `$count` (a runtime value, one of the listed sizes) as the const `$n`, so
/// that a token block's loops over its tokens are unrolled with their accumulators in registers.
#[cfg(target_arch = "x86_64")]
macro_rules! for_count {
    ($count:expr, $n:ident in [$($k:literal),+] => $body:expr) => {
        match $count {
            $($k => {
                const $n: usize = $k;
                $body
            })+
            other => unreachable!("a token block of {other} tokens"),
        }
    };
}

/// The token blocks on AVX-512F: as [`avx2`]'s, with 16 weights per register and blocks of up
/// to [`WIDE_TOKEN_BLOCK`] tokens, so that each weight converted in registers feeds twice the
/// tokens with half the instructions.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use super::{GROUP_SIZE, WIDE_TOKEN_BLOCK};
    use std::arch::x86_64::*;

    /// The sums of a block's accumulators, two per token (alternating chains, as on AVX2).
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn sums<const R: usize>(acc: [[__m512; 2]; R]) -> [f32; WIDE_TOKEN_BLOCK] {
        let mut sums = [0f32; WIDE_TOKEN_BLOCK];
        for (sum, [a, b]) in sums.iter_mut().zip(acc) {
            *sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        }
        sums
    }

    /// Adds one group's 32 weights (`w`, two vectors of 16) times each token's 32 activations
    /// (token `j`'s at `x + j * k`) into the token's two accumulators.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    #[inline]
    unsafe fn group_into<const R: usize>(acc: &mut [[__m512; 2]; R], w: &[__m512; 2], x: *const f32, k: usize) {
        for (j, [a, b]) in acc.iter_mut().enumerate() {
            let x = x.add(j * k);
            *a = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(x), *a);
            *b = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(x.add(16)), *b);
        }
    }

    /// An f16 value broadcast to 16 f32 lanes.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    #[inline]
    unsafe fn broadcast_f16(value: u16) -> __m512 {
        _mm512_cvtph_ps(_mm256_set1_epi16(value as i16))
    }

    /// One int4 row times `count` (1..=8) tokens' activations (`xs`, `count * k` values): each
    /// group's 32 weights dequantized in registers (scale * q + bias, as the format defines them)
    /// and multiplied with every token.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn dot_int4_block(
        packed: &[u8],
        scales: &[u16],
        biases: &[u16],
        xs: &[f32],
        count: usize,
    ) -> [f32; WIDE_TOKEN_BLOCK] {
        for_count!(count, R in [1, 2, 3, 4, 5, 6, 7, 8] => dot_int4_rows::<R>(packed, scales, biases, xs))
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn dot_int4_rows<const R: usize>(
        packed: &[u8],
        scales: &[u16],
        biases: &[u16],
        xs: &[f32],
    ) -> [f32; WIDE_TOKEN_BLOCK] {
        let groups = scales.len();
        let k = groups * GROUP_SIZE;
        debug_assert!(packed.len() == k / 2 && biases.len() == groups && xs.len() >= R * k);
        let (pp, xp) = (packed.as_ptr(), xs.as_ptr());
        let low4 = _mm_set1_epi8(0x0f);
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        for g in 0..groups {
            if g % 4 == 0 {
                // The next cache line of nibbles, a little ahead (see `avx2::dot_f16`).
                _mm_prefetch::<_MM_HINT_T0>(pp.wrapping_add(g * 16 + super::PREFETCH_AHEAD) as *const i8);
            }
            let bytes = _mm_loadu_si128(pp.add(g * 16) as *const __m128i);
            let lo = _mm_and_si128(bytes, low4);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(bytes), low4);
            // Element 2i is byte i's low nibble, 2i + 1 its high one: interleaved, in order.
            let (scale, bias) = (broadcast_f16(scales[g]), broadcast_f16(biases[g]));
            let widen = |v: __m128i| _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)), scale, bias);
            let w = [widen(_mm_unpacklo_epi8(lo, hi)), widen(_mm_unpackhi_epi8(lo, hi))];
            group_into(&mut acc, &w, xp.add(g * GROUP_SIZE), k);
        }
        sums(acc)
    }

    /// One int8 row times `count` (1..=8) tokens' activations (`xs`, `count * k` values): each
    /// group's 32 codes dequantized in registers (scale * q) and multiplied with every token.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn dot_int8_block(codes: &[i8], scales: &[u16], xs: &[f32], count: usize) -> [f32; WIDE_TOKEN_BLOCK] {
        for_count!(count, R in [1, 2, 3, 4, 5, 6, 7, 8] => dot_int8_rows::<R>(codes, scales, xs))
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn dot_int8_rows<const R: usize>(codes: &[i8], scales: &[u16], xs: &[f32]) -> [f32; WIDE_TOKEN_BLOCK] {
        let k = scales.len() * GROUP_SIZE;
        debug_assert!(codes.len() == k && xs.len() >= R * k);
        let (cp, xp) = (codes.as_ptr(), xs.as_ptr());
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        for (g, &scale) in scales.iter().enumerate() {
            if g % 2 == 0 {
                // The next cache line of codes, a little ahead (see `avx2::dot_f16`).
                _mm_prefetch::<_MM_HINT_T0>(cp.wrapping_add(g * GROUP_SIZE + super::PREFETCH_AHEAD));
            }
            let scale = broadcast_f16(scale);
            let widen = |at: usize| {
                let raw = _mm_loadu_si128(cp.add(g * GROUP_SIZE + at) as *const __m128i);
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), scale)
            };
            let w = [widen(0), widen(16)];
            group_into(&mut acc, &w, xp.add(g * GROUP_SIZE), k);
        }
        sums(acc)
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::GROUP_SIZE;
    use std::arch::x86_64::*;

    /// The horizontal sums of a block's accumulators, two per token: a token's multiply-adds
    /// alternate between its two, so that eight independent chains (four tokens) keep both FMA
    /// units busy through the instruction's latency.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn sums<const R: usize>(acc: [[__m256; 2]; R]) -> [f32; 4] {
        let mut sums = [0f32; 4];
        for (sum, [a, b]) in sums.iter_mut().zip(acc) {
            *sum = crate::simd::sum8(_mm256_add_ps(a, b));
        }
        sums
    }

    /// Adds one group's 32 weights (`w`, four vectors of 8) times each token's 32 activations
    /// (token `j`'s at `x + j * k`) into the token's two accumulators.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group_into<const R: usize>(acc: &mut [[__m256; 2]; R], w: &[__m256; 4], x: *const f32, k: usize) {
        for (j, pair) in acc.iter_mut().enumerate() {
            let x = x.add(j * k);
            for (part, wv) in w.iter().enumerate() {
                let a = &mut pair[part % 2];
                *a = _mm256_fmadd_ps(*wv, _mm256_loadu_ps(x.add(8 * part)), *a);
            }
        }
    }

    /// One int4 row times `count` (1..=4) tokens' activations (`xs`, `count * k` values): each
    /// group's 32 weights dequantized in registers (scale * q + bias, as the format defines them)
    /// and multiplied with every token.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_int4_block(packed: &[u8], scales: &[u16], biases: &[u16], xs: &[f32], count: usize) -> [f32; 4] {
        for_count!(count, R in [1, 2, 3, 4] => dot_int4_rows::<R>(packed, scales, biases, xs))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_int4_rows<const R: usize>(packed: &[u8], scales: &[u16], biases: &[u16], xs: &[f32]) -> [f32; 4] {
        let groups = scales.len();
        let k = groups * GROUP_SIZE;
        debug_assert!(packed.len() == k / 2 && biases.len() == groups && xs.len() >= R * k);
        let (pp, xp) = (packed.as_ptr(), xs.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for g in 0..groups {
            if g % 4 == 0 {
                // The next cache line of nibbles, a little ahead (see `dot_f16`).
                _mm_prefetch::<_MM_HINT_T0>(pp.wrapping_add(g * 16 + super::PREFETCH_AHEAD) as *const i8);
            }
            let w = int4_group(pp.add(g * 16), scales[g], biases[g]);
            group_into(&mut acc, &w, xp.add(g * GROUP_SIZE), k);
        }
        sums(acc)
    }

    /// One int4 group's 32 weights as f32, exactly as the format defines them (`scale * q +
    /// bias`), in order: `packed` points at its 16 bytes, element `2i` the low nibble of byte `i`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn int4_group(packed: *const u8, scale: u16, bias: u16) -> [__m256; 4] {
        let low4 = _mm_set1_epi8(0x0f);
        let bytes = _mm_loadu_si128(packed as *const __m128i);
        let lo = _mm_and_si128(bytes, low4);
        let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
        // Element 2i is byte i's low nibble, 2i + 1 its high one: interleaved, in order.
        let first = _mm_unpacklo_epi8(lo, hi);
        let second = _mm_unpackhi_epi8(lo, hi);
        let scale = _mm256_cvtph_ps(_mm_set1_epi16(scale as i16));
        let bias = _mm256_cvtph_ps(_mm_set1_epi16(bias as i16));
        let widen = |v: __m128i| _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), scale, bias);
        [widen(first), widen(_mm_srli_si128(first, 8)), widen(second), widen(_mm_srli_si128(second, 8))]
    }

    /// One int8 group's 32 weights as f32 (`scale * q`): `codes` points at its 32 codes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn int8_group(codes: *const i8, scale: u16) -> [__m256; 4] {
        let scale = _mm256_cvtph_ps(_mm_set1_epi16(scale as i16));
        let mut w = [_mm256_setzero_ps(); 4];
        for (part, wv) in w.iter_mut().enumerate() {
            let raw = _mm_loadl_epi64(codes.add(8 * part) as *const __m128i);
            *wv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), scale);
        }
        w
    }

    /// One int8 row times `count` (1..=4) tokens' activations (`xs`, `count * k` values): each
    /// group's 32 codes dequantized in registers (scale * q) and multiplied with every token.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_int8_block(codes: &[i8], scales: &[u16], xs: &[f32], count: usize) -> [f32; 4] {
        for_count!(count, R in [1, 2, 3, 4] => dot_int8_rows::<R>(codes, scales, xs))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_int8_rows<const R: usize>(codes: &[i8], scales: &[u16], xs: &[f32]) -> [f32; 4] {
        let k = scales.len() * GROUP_SIZE;
        debug_assert!(codes.len() == k && xs.len() >= R * k);
        let (cp, xp) = (codes.as_ptr(), xs.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for (g, &scale) in scales.iter().enumerate() {
            if g % 2 == 0 {
                // The next cache line of codes, a little ahead (see `dot_f16`).
                _mm_prefetch::<_MM_HINT_T0>(cp.wrapping_add(g * GROUP_SIZE + super::PREFETCH_AHEAD));
            }
            let w = int8_group(cp.add(g * GROUP_SIZE), scale);
            group_into(&mut acc, &w, xp.add(g * GROUP_SIZE), k);
        }
        sums(acc)
    }

    /// Rows `rows` of `w` times one token's `x`, written to `out[row]`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `out` valid for `w.rows` values and these rows of it not written by
    /// anyone else meanwhile.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f16_rows(x: &[f32], w: super::F16Matrix<'_>, rows: std::ops::Range<usize>, out: *mut f32) {
        let k = w.cols;
        for row in rows {
            *out.add(row) = dot_f16(x, &w.data[row * k..(row + 1) * k]);
        }
    }

    /// `x · w` for f16 `w`, 32 weights per iteration in four accumulators.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn dot_f16(x: &[f32], w: &[u16]) -> f32 {
        let k = x.len().min(w.len());
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= k {
            // Ask for the bytes a little ahead (into the next row near the end of this one): the
            // hardware prefetchers alone leave the loads waiting on memory.
            _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(i + super::PREFETCH_AHEAD / 2) as *const i8);
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
        let mut total = crate::simd::sum8(sum);
        total += crate::scalar::dot_f16(&x[i..k], &w[i..k]);
        total
    }

    /// `x · w` for one int8 row: per group of 32, four widened blocks of 8 codes multiplied with
    /// `x` into one accumulator, then scaled by the group's scale into the row's sum.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_int8(x: &[f32], codes: &[i8], scales: &[u16]) -> f32 {
        let (xp, cp) = (x.as_ptr(), codes.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 2];
        for (g, &scale) in scales.iter().enumerate() {
            let base = g * GROUP_SIZE;
            if g % 2 == 0 {
                // The next cache line of codes, a little ahead (see `dot_f16`).
                _mm_prefetch::<_MM_HINT_T0>(cp.wrapping_add(base + super::PREFETCH_AHEAD));
            }
            let mut group = [_mm256_setzero_ps(); 2];
            for j in 0..4 {
                let raw = _mm_loadl_epi64(cp.add(base + 8 * j) as *const __m128i);
                let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
                group[j % 2] = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(base + 8 * j)), q, group[j % 2]);
            }
            let s = _mm256_set1_ps(half::f16::from_bits(scale).to_f32());
            acc[g % 2] = _mm256_fmadd_ps(_mm256_add_ps(group[0], group[1]), s, acc[g % 2]);
        }
        crate::simd::sum8(_mm256_add_ps(acc[0], acc[1]))
    }

    /// One int4 row times activations prepared by `matmul_int4` (`xq`: per group 32 coarse i16
    /// inputs, those of the low nibbles first, then the 32 fine ones; `steps`: each group's
    /// coarse step; `sums`: each group's exact sum of inputs).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_int4(
        xq: &[i16],
        steps: &[f32],
        sums: &[f32],
        packed: &[u8],
        scales: &[u16],
        biases: &[u16],
    ) -> f32 {
        let groups = sums.len();
        debug_assert!(xq.len() == groups * 2 * GROUP_SIZE && packed.len() == groups * GROUP_SIZE / 2);
        debug_assert!(steps.len() == groups && scales.len() == groups && biases.len() == groups);
        let (xp, pp) = (xq.as_ptr(), packed.as_ptr());
        let low4 = _mm_set1_epi8(0x0f);
        let fine_scale = _mm256_set1_ps(1.0 / super::FINE);
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut g = 0;
        // One group's integer dot product, scaled by `factor` (its scale times its step).
        let group = |gi: usize, factor: __m256, acc: __m256| -> __m256 {
            let bytes = _mm_loadu_si128(pp.add(gi * 16) as *const __m128i);
            let lo = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, low4));
            let hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
            let x = xp.add(gi * 2 * GROUP_SIZE);
            let coarse = _mm256_add_epi32(
                _mm256_madd_epi16(lo, _mm256_loadu_si256(x as *const __m256i)),
                _mm256_madd_epi16(hi, _mm256_loadu_si256(x.add(16) as *const __m256i)),
            );
            let fine = _mm256_add_epi32(
                _mm256_madd_epi16(lo, _mm256_loadu_si256(x.add(32) as *const __m256i)),
                _mm256_madd_epi16(hi, _mm256_loadu_si256(x.add(48) as *const __m256i)),
            );
            let d = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fine), fine_scale, _mm256_cvtepi32_ps(coarse));
            _mm256_fmadd_ps(d, factor, acc)
        };
        // Eight groups at a time: their scales widened at once and multiplied by the steps, each
        // group's factor then broadcast from its lane in registers.
        while g + 8 <= groups {
            // The next two cache lines of nibbles, a little ahead (see `dot_f16`).
            let ahead = pp.wrapping_add(g * 16 + super::PREFETCH_AHEAD) as *const i8;
            _mm_prefetch::<_MM_HINT_T0>(ahead);
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64));
            let sv = _mm256_cvtph_ps(_mm_loadu_si128(scales.as_ptr().add(g) as *const __m128i));
            let fv = _mm256_mul_ps(sv, _mm256_loadu_ps(steps.as_ptr().add(g)));
            for j in (0..8).step_by(2) {
                let f0 = _mm256_permutevar8x32_ps(fv, _mm256_set1_epi32(j as i32));
                let f1 = _mm256_permutevar8x32_ps(fv, _mm256_set1_epi32(j as i32 + 1));
                acc0 = group(g + j, f0, acc0);
                acc1 = group(g + j + 1, f1, acc1);
            }
            g += 8;
        }
        while g < groups {
            let factor = half::f16::from_bits(scales[g]).to_f32() * steps[g];
            acc0 = group(g, _mm256_set1_ps(factor), acc0);
            g += 1;
        }
        let mut total = crate::simd::sum8(_mm256_add_ps(acc0, acc1));
        // The bias term: Σ_g bias_g · Σ x_g.
        let mut b = 0;
        let mut bacc = _mm256_setzero_ps();
        while b + 8 <= groups {
            let bv = _mm256_cvtph_ps(_mm_loadu_si128(biases.as_ptr().add(b) as *const __m128i));
            bacc = _mm256_fmadd_ps(bv, _mm256_loadu_ps(sums.as_ptr().add(b)), bacc);
            b += 8;
        }
        total += crate::simd::sum8(bacc);
        for i in b..groups {
            total += half::f16::from_bits(biases[i]).to_f32() * sums[i];
        }
        total
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod avx2 {
    pub unsafe fn f16_rows(_: &[f32], _: super::F16Matrix<'_>, _: std::ops::Range<usize>, _: *mut f32) {
        unreachable!("the AVX2 path is never chosen off x86-64")
    }
    pub unsafe fn dot_f16(_: &[f32], _: &[u16]) -> f32 {
        unreachable!("the AVX2 path is never chosen off x86-64")
    }
    pub unsafe fn dot_int4_block(_: &[u8], _: &[u16], _: &[u16], _: &[f32], _: usize) -> [f32; 4] {
        unreachable!("the AVX2 path is never chosen off x86-64")
    }
    pub unsafe fn dot_int8_block(_: &[i8], _: &[u16], _: &[f32], _: usize) -> [f32; 4] {
        unreachable!("the AVX2 path is never chosen off x86-64")
    }
    pub unsafe fn dot_int4(_: &[i16], _: &[f32], _: &[f32], _: &[u8], _: &[u16], _: &[u16]) -> f32 {
        unreachable!("the AVX2 path is never chosen off x86-64")
    }
    pub unsafe fn dot_int8(_: &[f32], _: &[i8], _: &[u16]) -> f32 {
        unreachable!("the AVX2 path is never chosen off x86-64")
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod avx512 {
    use super::WIDE_TOKEN_BLOCK;
    pub unsafe fn dot_int4_block(_: &[u8], _: &[u16], _: &[u16], _: &[f32], _: usize) -> [f32; WIDE_TOKEN_BLOCK] {
        unreachable!("the AVX-512 path is never chosen off x86-64")
    }
    pub unsafe fn dot_int8_block(_: &[i8], _: &[u16], _: &[f32], _: usize) -> [f32; WIDE_TOKEN_BLOCK] {
        unreachable!("the AVX-512 path is never chosen off x86-64")
    }
}
