//! int4 and int8 products over activations rounded to 8 bits ([`Activations::Int8`], ADR 0024).
//!
//! The exact products carry each activation to f32's precision in two i16 parts (row-major) or
//! three int8 parts (panels, ADR 0029), so every 32 weights cost several integer dot products per
//! token; that bounds a batched product. Rounding each group of 32 activations to int8 steps of
//! its largest magnitude / 127 (what llama.cpp does for its Q4 and Q8 weights) lets one
//! `vpdpbusd` multiply 64 codes with their activations and add them in fours: a quarter of the
//! instructions per weight.
//!
//! The product is defined as the exact one over the rounded activations ([`round_int8`]), so
//! every path computes the same numbers up to the order of f32 operations: the VNNI rows here
//! (up to 24 tokens per call), and on any other CPU or for longer calls (where the blocked
//! product is faster) the exact kernels over a rounded copy. A prefill and a decode of one
//! backend therefore agree as closely as with exact activations; only the distance to the
//! reference grows (docs/adr/0024).
//!
//! [`Activations::Int8`]: crate::Activations::Int8

use crate::GROUP_SIZE;

/// The largest magnitude of a group as an int8 code.
const I8_RANGE: f32 = 127.0;

/// `x` with each group of [`GROUP_SIZE`] values rounded to the nearest multiple (ties to even)
/// of the group's step, its largest magnitude / 127: `step * round(x * (1 / step))`, a group of
/// zeros left as it is. `x.len()` is a multiple of the group size.
pub fn round_int8(x: &[f32], out: &mut [f32]) {
    debug_assert!(x.len().is_multiple_of(GROUP_SIZE) && out.len() == x.len());
    for (src, dst) in x.chunks_exact(GROUP_SIZE).zip(out.chunks_exact_mut(GROUP_SIZE)) {
        let (step, inv) = step_of(src);
        for (d, &v) in dst.iter_mut().zip(src) {
            *d = step * round_even(v * inv);
        }
    }
}

/// [`round_int8`] on the fastest path `isa` has (the same numbers: one multiply, a rounding to
/// nearest even and one multiply per value, the step computed as there).
pub(crate) fn round_int8_on(isa: crate::Isa, x: &[f32], out: &mut [f32]) {
    if isa.has_avx2() && isa.is_supported() {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        unsafe { x86::round_int8(x, out) }
    } else {
        round_int8(x, out)
    }
}

/// `y.round_ties_even()` for `|y| <= 2^22` (here at most 127): adding and subtracting 1.5 * 2^23
/// leaves no fraction bits, and the default rounding mode rounds the sum to nearest, ties to even.
/// Unlike `round_ties_even`, which is a library call without SSE4.1, the compiler vectorizes it.
#[inline(always)]
pub(crate) fn round_even(y: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0;
    (y + SHIFT) - SHIFT
}

/// A group's step and its inverse (zero for a group of zeros).
pub(crate) fn step_of(group: &[f32]) -> (f32, f32) {
    // Eight running maxima side by side (one vector), not one chain through all 32.
    let mut lanes = [0.0f32; 8];
    for chunk in group.chunks_exact(8) {
        for (m, v) in lanes.iter_mut().zip(chunk) {
            *m = m.max(v.abs());
        }
    }
    let max = lanes.iter().fold(0.0f32, |m, &v| m.max(v));
    let step = max / I8_RANGE;
    (step, if step > 0.0 { 1.0 / step } else { 0.0 })
}

/// Codes per 64-byte register of weights: two per byte for int4, one for int8.
const INT4_BLOCK: usize = 128;
const INT8_BLOCK: usize = 64;

/// One token's activations as the VNNI rows read them, for weights of one format.
///
/// Per block of weights (64 bytes: 128 int4 codes, or 64 int8 codes), padded with zeros past the
/// row: the int8 codes of the activations in the order the weights' bytes meet them (for int4
/// the activations of the low nibbles, then of the high ones); each i32 lane's step (16 per
/// block: lane `l` sums the products of one group); for int8 weights the accumulator's start per
/// lane (their bytes are read offset by 128, whose products the start takes back). For int4
/// weights, per group: `step * Σ codes`, the rounded activations' sum (the bias term's factor).
#[derive(Default)]
pub(crate) struct Prepared {
    codes: Vec<i8>,
    lane_steps: Vec<f32>,
    starts: Vec<i32>,
    sums: Vec<f32>,
}

crate::scratch::footprint!(Prepared: codes, lane_steps, starts, sums);

/// The lengths of one token's share of [`Prepared`] for `k` inputs, by weight format.
#[derive(Clone, Copy)]
struct Lengths {
    codes: usize,
    lanes: usize,
    groups: usize,
}

impl Lengths {
    fn of(k: usize, block: usize) -> Lengths {
        let blocks = k.div_ceil(block);
        Lengths { codes: blocks * block, lanes: blocks * 16, groups: k / GROUP_SIZE }
    }
}

/// One token's slices of a [`Prepared`].
#[derive(Clone, Copy)]
pub(crate) struct Token<'a> {
    codes: &'a [i8],
    lane_steps: &'a [f32],
    starts: &'a [i32],
    sums: &'a [f32],
}

impl Prepared {
    /// Lays out `tokens` rows of `x` (`k` each) for weights whose 64-byte blocks hold `block`
    /// codes ([`INT4_BLOCK`] or [`INT8_BLOCK`]). Only on the VNNI path.
    fn fill(&mut self, x: &[f32], tokens: usize, k: usize, block: usize) {
        let len = Lengths::of(k, block);
        let Prepared { codes, lane_steps, starts, sums } = self;
        // Not cleared: every element is written below (the groups' own, then a partial last
        // block's padding), so zero-filling the whole buffer first would be repeated work (each
        // of iree-cpu's workgroups lays out the whole call).
        codes.resize(tokens * len.codes, 0);
        lane_steps.resize(tokens * len.lanes, 0.0);
        starts.resize(if block == INT8_BLOCK { tokens * len.lanes } else { 0 }, 0);
        sums.resize(if block == INT4_BLOCK { tokens * len.groups } else { 0 }, 0.0);
        // A partial last block: its elements from `used` on, and the lanes holding them.
        let (last, used) = (k / block, k % block);
        let lanes_per_group = 16 * GROUP_SIZE / block;
        for t in 0..tokens {
            let codes = &mut codes[t * len.codes..(t + 1) * len.codes];
            let lane_steps = &mut lane_steps[t * len.lanes..(t + 1) * len.lanes];
            for (g, src) in x[t * k..(t + 1) * k].chunks_exact(GROUP_SIZE).enumerate() {
                let (b, within) = (g * GROUP_SIZE / block, g * GROUP_SIZE % block);
                let dst = &mut codes[b * block..(b + 1) * block];
                // SAFETY: only called on the VNNI path, which the CPU supports.
                let step = unsafe {
                    if block == INT4_BLOCK {
                        let (step, total) = x86::round_group_int4(src, dst, within);
                        sums[t * len.groups + g] = step * total as f32;
                        step
                    } else {
                        let at = t * len.lanes + b * 16 + within / 4;
                        x86::round_group_int8(src, &mut dst[within..within + GROUP_SIZE], &mut starts[at..at + 8])
                    }
                };
                let first = b * 16 + within / GROUP_SIZE * lanes_per_group;
                lane_steps[first..first + lanes_per_group].fill(step);
            }
            if used > 0 {
                let dst = &mut codes[last * block..(last + 1) * block];
                if block == INT4_BLOCK {
                    // Elements `used..128` are the upper halves of both nibbles' runs.
                    dst[used / 2..64].fill(0);
                    dst[64 + used / 2..].fill(0);
                } else {
                    dst[used..].fill(0);
                    starts[t * len.lanes + last * 16 + used / 4..t * len.lanes + (last + 1) * 16].fill(0);
                }
                lane_steps[last * 16 + used / GROUP_SIZE * lanes_per_group..(last + 1) * 16].fill(0.0);
            }
        }
    }

    fn token(&self, t: usize, k: usize, block: usize) -> Token<'_> {
        let len = Lengths::of(k, block);
        let starts = if self.starts.is_empty() { &[][..] } else { &self.starts[t * len.lanes..(t + 1) * len.lanes] };
        Token {
            codes: &self.codes[t * len.codes..(t + 1) * len.codes],
            lane_steps: &self.lane_steps[t * len.lanes..(t + 1) * len.lanes],
            starts,
            sums: if self.sums.is_empty() { &[][..] } else { &self.sums[t * len.groups..(t + 1) * len.groups] },
        }
    }
}

/// Tokens per block of the VNNI rows: two f32 accumulators per token, beside the weights' codes,
/// in the 32 registers.
pub(crate) const TOKEN_BLOCK: usize = 8;

/// Which weights a product reads.
#[derive(Clone, Copy)]
pub(crate) enum Weights<'a> {
    Int4(&'a crate::Int4Matrix<'a>),
    Int8(&'a crate::Int8Matrix<'a>),
}

static PREPARED: crate::scratch::Scratch<Prepared> = crate::scratch::Scratch::new();

/// `out = round_int8(x) W^T` (`out` `[tokens, rows]`) on the VNNI path: the activations laid out
/// once per call, then runs of output rows split over the pool, each run taking the tokens in
/// blocks of [`TOKEN_BLOCK`] (the run's weights stay in the core's caches between blocks).
pub(crate) fn vnni_product(pool: &crate::pool::Pool, x: &[f32], tokens: usize, w: Weights<'_>, out: &mut [f32]) {
    let (n, k, block) = match w {
        Weights::Int4(w) => (w.rows, w.cols, INT4_BLOCK),
        Weights::Int8(w) => (w.rows, w.cols, INT8_BLOCK),
    };
    PREPARED.with(|prepared| {
        prepared.fill(x, tokens, k, block);
        let prepared = &*prepared;
        crate::matmul::for_each_row_run(pool, n, 1, crate::matmul::MIN_ROWS_PER_TASK, out, &|run, out| {
            for first in (0..tokens).step_by(TOKEN_BLOCK) {
                let count = TOKEN_BLOCK.min(tokens - first);
                let ts: [Token<'_>; TOKEN_BLOCK] =
                    std::array::from_fn(|j| prepared.token(first + j.min(count - 1), k, block));
                // SAFETY: only called on the VNNI path, which the CPU supports; the tokens were
                // laid out for these weights; `out` is `[tokens, n]` and these rows' columns of it
                // are the task's.
                unsafe { x86::rows(&ts[..count], w, run.clone(), out.0.add(first * n), n) };
            }
        });
    });
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::{Token, Weights, GROUP_SIZE, TOKEN_BLOCK};
    use crate::vnni::x86::{add_bias_term, block_scales, load_block};
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// Rows `rows` of `w` times each of `tokens` (1..=8), written to `out[t * stride + row]`.
    ///
    /// # Safety
    /// AVX-512F, BW, VL and VNNI; the tokens laid out for `w`'s format and length; `out` valid for
    /// these elements, which nobody else writes meanwhile.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn rows(tokens: &[Token<'_>], w: Weights<'_>, rows: Range<usize>, out: *mut f32, stride: usize) {
        macro_rules! by_count {
            ($($r:literal),+) => {
                match tokens.len() {
                    $($r => {
                        let ts: &[Token<'_>; $r] = tokens.try_into().expect("a block of $r tokens");
                        match w {
                            Weights::Int4(w) => int4_rows(ts, w, rows, out, stride),
                            Weights::Int8(w) => int8_rows(ts, w, rows, out, stride),
                        }
                    })+
                    other => unreachable!("a token block of {other} tokens"),
                }
            };
        }
        debug_assert!(tokens.len() <= TOKEN_BLOCK);
        by_count!(1, 2, 3, 4, 5, 6, 7, 8)
    }

    /// [`super::round_int8`] in 256-bit registers.
    ///
    /// # Safety
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn round_int8(x: &[f32], out: &mut [f32]) {
        debug_assert!(x.len().is_multiple_of(GROUP_SIZE) && out.len() == x.len());
        let abs_mask = _mm256_set1_ps(f32::from_bits(0x7fff_ffff));
        for (src, dst) in x.chunks_exact(GROUP_SIZE).zip(out.chunks_exact_mut(GROUP_SIZE)) {
            let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(src.as_ptr().add(8 * i)));
            let m = _mm256_max_ps(
                _mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)),
            );
            let max = crate::simd::max8(m);
            let step = max / super::I8_RANGE;
            let inv = _mm256_set1_ps(if step > 0.0 { 1.0 / step } else { 0.0 });
            let step = _mm256_set1_ps(step);
            for (i, v) in v.into_iter().enumerate() {
                let q = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(v, inv));
                _mm256_storeu_ps(dst.as_mut_ptr().add(8 * i), _mm256_mul_ps(step, q));
            }
        }
    }

    /// The int8 step of a group of 32 values (`lo`, `hi`): its largest magnitude / 127, and the
    /// step's inverse in every lane (zero for a group of zeros).
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn int8_step(lo: __m512, hi: __m512) -> (f32, __m512) {
        let abs_mask = _mm512_set1_ps(f32::from_bits(0x7fff_ffff));
        let max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, abs_mask), _mm512_and_ps(hi, abs_mask)));
        let step = max / super::I8_RANGE;
        (step, _mm512_set1_ps(if step > 0.0 { 1.0 / step } else { 0.0 }))
    }

    /// One group's step (largest magnitude / 127) and its activations rounded to that step, as
    /// int8 codes (in i32 lanes).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn round_group(src: &[f32]) -> (f32, __m512i, __m512i) {
        debug_assert_eq!(src.len(), GROUP_SIZE);
        let lo = _mm512_loadu_ps(src.as_ptr());
        let hi = _mm512_loadu_ps(src.as_ptr().add(16));
        let (step, inv) = int8_step(lo, hi);
        // Rounded to nearest, ties to even (the default rounding mode), as `round_int8`.
        let (qlo, qhi) = (_mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv)));
        (step, qlo, qhi)
    }

    /// Rounds one group (`src`, 32 values) into an int4 block's codes (`block`, 128 bytes), whose
    /// elements `within..within + 32` it is: even elements to the first 64 bytes (they meet the
    /// low nibbles), odd ones to the last 64. Returns the step and the codes' sum.
    ///
    /// # Safety
    /// AVX-512F, BW and VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn round_group_int4(src: &[f32], block: &mut [i8], within: usize) -> (f32, i32) {
        debug_assert!(block.len() == 128 && within.is_multiple_of(GROUP_SIZE) && within < 128);
        let (step, lo, hi) = round_group(src);
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        let p = block.as_mut_ptr().add(within / 2);
        _mm_storeu_si128(p as *mut __m128i, _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(lo, even, hi)));
        _mm_storeu_si128(p.add(64) as *mut __m128i, _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(lo, odd, hi)));
        (step, _mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi)))
    }

    /// Rounds one group (`src`, 32 values) into an int8 block's codes (`codes`, its 32 bytes) and
    /// the starts of its 8 lanes (-128 times each lane's four codes' sum). Returns the step.
    ///
    /// # Safety
    /// AVX-512F, BW, VL and VNNI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn round_group_int8(src: &[f32], codes: &mut [i8], starts: &mut [i32]) -> f32 {
        debug_assert!(codes.len() == GROUP_SIZE && starts.len() == 8);
        let (step, lo, hi) = round_group(src);
        _mm_storeu_si128(codes.as_mut_ptr() as *mut __m128i, _mm512_cvtepi32_epi8(lo));
        _mm_storeu_si128(codes.as_mut_ptr().add(16) as *mut __m128i, _mm512_cvtepi32_epi8(hi));
        // Each lane's four codes summed: a dot product with ones.
        let codes = _mm256_loadu_si256(codes.as_ptr() as *const __m256i);
        let sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), codes);
        _mm256_storeu_si256(starts.as_mut_ptr() as *mut __m256i, _mm256_mullo_epi32(sums, _mm256_set1_epi32(-128)));
        step
    }

    /// The row's scales of the `E` groups of the block starting at group `g0` (fewer past the
    /// row's end), widened and spread over the 16 lanes by `spread`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn lane_scales<const E: usize>(scales: &[u16], g0: usize, spread: __m512i) -> __m512 {
        _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(block_scales::<E>(scales, g0)))
    }

    /// `acc + (sums · lane scale · lane step)` in f32.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn scale_into(sums: __m512i, scales: __m512, steps: *const f32, acc: __m512) -> __m512 {
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(scales, _mm512_loadu_ps(steps)), acc)
    }

    /// Each token's two accumulators added and reduced to one sum.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    #[inline]
    unsafe fn write<const R: usize>(
        acc: [[__m512; 2]; R],
        out: *mut f32,
        stride: usize,
        row: usize,
        extra: impl Fn(usize, __m512) -> __m512,
    ) {
        for (t, [a, b]) in acc.into_iter().enumerate() {
            *out.add(t * stride + row) = _mm512_reduce_add_ps(extra(t, _mm512_add_ps(a, b)));
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn int4_rows<const R: usize>(
        tokens: &[Token<'_>; R],
        w: &crate::Int4Matrix<'_>,
        rows: Range<usize>,
        out: *mut f32,
        stride: usize,
    ) {
        let (groups, half) = (w.cols / GROUP_SIZE, w.cols / 2);
        let blocks = half.div_ceil(64);
        let nibble = _mm512_set1_epi8(0x0f);
        // Lane l holds the products of elements 8l..8l + 8 of the block: group l / 4.
        let spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        for row in rows {
            let bytes = &w.packed[row * half..(row + 1) * half];
            let scales = &w.scales[row * groups..(row + 1) * groups];
            let mut acc = [[_mm512_setzero_ps(); 2]; R];
            for b in 0..blocks {
                let v = load_block(bytes, b);
                let lo = _mm512_and_si512(v, nibble);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble);
                let s = lane_scales::<4>(scales, 4 * b, spread);
                for (t, acc) in tokens.iter().zip(acc.iter_mut()) {
                    let x = t.codes.as_ptr().add(b * 128) as *const __m512i;
                    let sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x));
                    let sums = _mm512_dpbusd_epi32(sums, hi, _mm512_loadu_si512(x.add(1)));
                    acc[b % 2] = scale_into(sums, s, t.lane_steps.as_ptr().add(16 * b), acc[b % 2]);
                }
            }
            let biases = &w.biases[row * groups..(row + 1) * groups];
            write(acc, out, stride, row, |t, acc| add_bias_term(biases, tokens[t].sums, acc));
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn int8_rows<const R: usize>(
        tokens: &[Token<'_>; R],
        w: &crate::Int8Matrix<'_>,
        rows: Range<usize>,
        out: *mut f32,
        stride: usize,
    ) {
        let (groups, k) = (w.cols / GROUP_SIZE, w.cols);
        let blocks = k.div_ceil(64);
        let offset = _mm512_set1_epi8(-128);
        // Lane l holds the products of elements 4l..4l + 4 of the block: group l / 8.
        let spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        for row in rows {
            let bytes = std::slice::from_raw_parts(w.codes.as_ptr().add(row * k) as *const u8, k);
            let scales = &w.scales[row * groups..(row + 1) * groups];
            let mut acc = [[_mm512_setzero_ps(); 2]; R];
            for b in 0..blocks {
                // The codes as unsigned bytes, code + 128; each lane starts at -128 times its
                // activations' sum, so that it ends at the signed product.
                let v = _mm512_xor_si512(load_block(bytes, b), offset);
                let s = lane_scales::<2>(scales, 2 * b, spread);
                for (t, acc) in tokens.iter().zip(acc.iter_mut()) {
                    let x = _mm512_loadu_si512(t.codes.as_ptr().add(b * 64) as *const __m512i);
                    let start = _mm512_loadu_si512(t.starts.as_ptr().add(16 * b) as *const __m512i);
                    let sums = _mm512_dpbusd_epi32(start, v, x);
                    acc[b % 2] = scale_into(sums, s, t.lane_steps.as_ptr().add(16 * b), acc[b % 2]);
                }
            }
            write(acc, out, stride, row, |_, acc| acc);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) mod x86 {
    use super::{Token, Weights};
    use std::ops::Range;

    pub unsafe fn rows(_: &[Token<'_>], _: Weights<'_>, _: Range<usize>, _: *mut f32, _: usize) {
        unreachable!("the VNNI path is never chosen off x86-64")
    }
    pub unsafe fn round_group_int4(_: &[f32], _: &mut [i8], _: usize) -> (f32, i32) {
        unreachable!("the VNNI path is never chosen off x86-64")
    }
    pub unsafe fn round_group_int8(_: &[f32], _: &mut [i8], _: &mut [i32]) -> f32 {
        unreachable!("the VNNI path is never chosen off x86-64")
    }
    pub unsafe fn round_int8(_: &[f32], _: &mut [f32]) {
        unreachable!("the AVX2 path is never chosen off x86-64")
    }
}
