//! The panels' integer products in 256-bit registers, for CPUs without AVX-512 VNNI (every AVX2
//! CPU: AMD Zen 1-3, Intel Haswell to Skylake, Skylake-SP without VNNI).
//!
//! A 256-bit register holds eight i32 lanes, so a panel of 16 rows is taken as two halves of
//! eight, lane `r` of a half being its row `r` as in the 512-bit kernels. Without `vpdpbusd`, four
//! codes of a row times four activations are `vpmaddubsw` (unsigned bytes times signed bytes into
//! pairs of i16 sums) followed by `vpmaddwd` against ones (the pairs into one i32):
//! - int4 codes (0..=15) times int8 parts (-127..=127) make pair sums of at most 3810 in
//!   magnitude, so all eight `vpmaddubsw` of a group (32 codes of each row) add up in i16 without
//!   saturating (30480 < 32767), and one `vpmaddwd` per group and part widens them;
//! - int8 codes are signed, so a row's codes are taken as their magnitudes (unsigned) and their
//!   signs moved onto the activations (`vpsignb`), as llama.cpp's AVX2 q8 products do: a pair
//!   sums to at most 2 * 128 * 127 = 32512, so each `vpmaddubsw` is widened on its own.
//!
//! The activations are prepared as for the 512-bit kernels ([`super::Prepared`]), so both paths
//! multiply the same integers and agree up to the order of f32 operations.

use super::{Block, Int4Matrix, Int8Matrix, Panels, GROUP_BYTES, GROUP_SIZE, PANEL_CHUNK, PART_RATIO};
use std::arch::x86_64::*;

/// `x86::split_group` in 256-bit registers: the same operations on each value (so the same codes,
/// starts and steps), four registers of eight values a group; an exact int4 group's sum in
/// another order.
///
/// # Safety
/// AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn split_group(src: &[f32], codes: &mut [i8], starts: &mut [i32], int4: bool) -> (f32, f32) {
    let parts = starts.len();
    debug_assert!(src.len() == GROUP_SIZE && codes.len() == parts * GROUP_SIZE && parts > 0);
    let (step, inv) = crate::q8::step_of(src);
    let x: [__m256; 4] = std::array::from_fn(|c| _mm256_loadu_ps(src.as_ptr().add(8 * c)));
    // For int4, output byte 8c + 4h + j is element 8c + 2j + h: per chunk of eight, the even
    // elements (low nibbles) and then the odd ones (high nibbles).
    let order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    let inv = _mm256_set1_ps(inv);
    let mut a: [__m256; 4] = std::array::from_fn(|c| {
        let v = if int4 { _mm256_permutevar8x32_ps(x[c], order) } else { x[c] };
        _mm256_mul_ps(v, inv)
    });
    // Two saturating packs leave each register's eight bytes in two runs of four, 128-bit lane
    // by lane; this puts them back in order.
    let runs = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let finer = _mm256_set1_ps(PART_RATIO);
    let mut codes_sum = 0;
    for (p, start) in starts.iter_mut().enumerate() {
        // Rounded to nearest, ties to even (the default rounding mode), as `round_int8`.
        let q: [__m256i; 4] = std::array::from_fn(|c| _mm256_cvtps_epi32(a[c]));
        let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        let part = codes.as_mut_ptr().add(p * GROUP_SIZE) as *mut __m256i;
        _mm256_storeu_si256(part, _mm256_permutevar8x32_epi32(bytes, runs));
        if !int4 || parts == 1 {
            let sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let mut lanes = [0i32; 8];
            _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, sum);
            let sum = lanes.iter().fold(0i32, |s, &l| s.wrapping_add(l));
            *start = sum.wrapping_mul(-128);
            codes_sum = sum;
        }
        if p + 1 < parts {
            a = std::array::from_fn(|c| _mm256_mul_ps(_mm256_sub_ps(a[c], _mm256_cvtepi32_ps(q[c])), finer));
        }
    }
    let bias_factor = match (int4, parts) {
        (false, _) => 0.0,
        (true, 1) => step * codes_sum as f32,
        (true, _) => crate::simd::sum8(_mm256_add_ps(_mm256_add_ps(x[0], x[1]), _mm256_add_ps(x[2], x[3]))),
    };
    (step, bias_factor)
}

/// Rows per half panel: one i32 lane each in a 256-bit register.
const HALF_ROWS: usize = 8;

/// Tokens per block of exact activations (three parts): one f32 accumulator each, beside a half
/// panel's eight registers of codes (sixteen registers in all).
pub(super) const TOKEN_BLOCK: usize = 4;

/// Tokens per block of activations in one part: a token's sums of a group take one register
/// (int4: one i16 sum; int8: one i32 sum), so eight tokens' sums fit beside a chunk's codes, and
/// each chunk is loaded and unpacked once for eight tokens instead of twice (their f32
/// accumulators, touched once per group, live in L1).
const ONE_PART_BLOCK: usize = 8;

/// Tokens per block of activations in `parts` parts.
pub(super) fn block_size(parts: usize) -> usize {
    if parts == 1 {
        ONE_PART_BLOCK
    } else {
        TOKEN_BLOCK
    }
}

/// The half `half` (0 or 1) of the panel of `width` rows from `row0` times `count` (up to
/// [`block_size`]) tokens of `block`, each carried as `parts` (1 or 3) int8 parts, written to
/// `out[t * stride + row0 + 8 half + r]`.
///
/// # Safety
/// AVX2, FMA and F16C; `row0` starts a panel of `w` and the half has rows (`8 half < width`);
/// `block` holds `count` tokens prepared for `w`'s columns and format in `parts` parts; `out`
/// valid for those elements.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)] // the half panel, the tokens, and where the sums go
pub(super) unsafe fn half_panel(
    count: usize,
    parts: usize,
    block: &Block,
    w: Panels<'_>,
    row0: usize,
    width: usize,
    half: usize,
    out: *mut f32,
    stride: usize,
) {
    let half = Half::new(row0, width, half);
    macro_rules! blocks {
        ($p:literal; int4 $($r4:literal),+; int8 $($r8:literal),+) => {
            match (count, w, half.full()) {
                $(($r4, Panels::Int4(w), true) => int4_half::<$r4, $p, true>(block, w, &half, out, stride),)+
                $(($r4, Panels::Int4(w), false) => int4_half::<$r4, $p, false>(block, w, &half, out, stride),)+
                $(($r8, Panels::Int8(w), true) => int8_half::<$r8, $p, true>(block, w, &half, out, stride),)+
                $(($r8, Panels::Int8(w), false) => int8_half::<$r8, $p, false>(block, w, &half, out, stride),)+
                (other, ..) => unreachable!("a token block of {other} tokens"),
            }
        };
    }
    // The literal lists below are the blocks' sizes and the parts: a change of any of these
    // constants fails here.
    const _: () = assert!(TOKEN_BLOCK == 4 && ONE_PART_BLOCK == 8 && super::EXACT_PARTS == 3);
    match parts {
        1 => blocks!(1; int4 1, 2, 3, 4, 5, 6, 7, 8; int8 1, 2, 3, 4, 5, 6, 7, 8),
        3 => blocks!(3; int4 1, 2, 3, 4; int8 1, 2, 3, 4),
        other => unreachable!("activations in {other} parts"),
    }
}

/// Where a half panel lies: its panel's first row and width, its own first row within the panel
/// and its row count (8, or fewer in a narrow last panel).
struct Half {
    row0: usize,
    width: usize,
    first: usize,
    rows: usize,
}

impl Half {
    fn new(row0: usize, width: usize, half: usize) -> Half {
        let first = HALF_ROWS * half;
        debug_assert!(first < width);
        Half { row0, width, first, rows: HALF_ROWS.min(width - first) }
    }

    fn full(&self) -> bool {
        self.rows == HALF_ROWS
    }

    /// The lanes of its rows, for masked loads and stores.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn lanes(&self) -> __m256i {
        crate::simd::first_lanes(self.rows)
    }

    /// The half's four bytes of each row in the chunk at `chunk` (`4 width` bytes, row after row).
    /// `FULL`: the caller knows the half is full (the kernels are compiled for full halves without
    /// the test, which the compiler does not hoist out of their loops).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load<const FULL: bool>(&self, chunk: *const i8, lanes: __m256i) -> __m256i {
        let at = chunk.add(PANEL_CHUNK * self.first);
        if FULL || self.full() {
            _mm256_loadu_si256(at as *const __m256i)
        } else {
            _mm256_maskload_epi32(at as *const i32, lanes)
        }
    }

    /// The half's rows' values of one group (`values` holds the panel's `width` values of it), as
    /// f32.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn group_values<const FULL: bool>(&self, values: *const u16) -> __m256 {
        let at = values.add(self.first);
        if FULL || self.full() {
            _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i))
        } else {
            let mut some = [0u16; HALF_ROWS];
            std::ptr::copy_nonoverlapping(at, some.as_mut_ptr(), self.rows);
            _mm256_cvtph_ps(_mm_loadu_si128(some.as_ptr() as *const __m128i))
        }
    }

    /// Writes the `R` tokens' sums of the half's rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn store<const R: usize, const FULL: bool>(
        &self,
        acc: [__m256; R],
        lanes: __m256i,
        out: *mut f32,
        stride: usize,
    ) {
        for (t, acc) in acc.into_iter().enumerate() {
            let at = out.add(t * stride + self.row0 + self.first);
            if FULL || self.full() {
                _mm256_storeu_ps(at, acc);
            } else {
                _mm256_maskstore_ps(at, lanes, acc);
            }
        }
    }
}

/// How far ahead of a group its codes are asked for, in bytes: three times the row-major
/// kernels' distance. A half panel's group of eight rows is done in a fraction of the time the
/// 512-bit kernels spend on a whole panel's, so their distance left a fetch too little time to
/// arrive (measured with `panel_rate` on the head's shape; docs/performance.md, run 28).
const PREFETCH_AHEAD: usize = 3 * crate::matmul::PREFETCH_AHEAD;

/// Asks for the `lines` cache lines of a group's codes ahead (every line of the panel: the
/// second half finds them in L1).
#[inline(always)]
unsafe fn prefetch(group: *const i8, lines: usize) {
    for l in 0..lines {
        _mm_prefetch::<_MM_HINT_T0>(group.wrapping_add(PREFETCH_AHEAD + 64 * l));
    }
}

/// Four activation codes, the same in every lane.
#[inline(always)]
unsafe fn broadcast(codes: *const i32, i: usize) -> __m256i {
    _mm256_set1_epi32(codes.add(i).read_unaligned())
}

/// `d` (the parts after `p`, finest first, already combined) with part `p`'s integer sums, as the
/// 512-bit kernels combine them.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn combine<const P: usize>(p: usize, sums: __m256i, d: __m256) -> __m256 {
    let sums = _mm256_cvtepi32_ps(sums);
    if p + 1 == P {
        sums
    } else {
        _mm256_fmadd_ps(d, _mm256_set1_ps(1.0 / super::PART_RATIO), sums)
    }
}

/// A half of an int4 panel times `R` tokens in `P` parts: per group, chunk by chunk, the
/// chunk's low and high nibbles as unsigned bytes (once for all the tokens), then for every token
/// and part two `vpmaddubsw` added into one i16 sum of the group; per group and part one
/// `vpmaddwd`, the parts combined and scaled once for the eight rows. Chunk-outer with one sum
/// per token and part keeps a four-token block within the sixteen registers (holding all four
/// chunks' nibbles for the tokens in turn spilled accumulators to the stack).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn int4_half<const R: usize, const P: usize, const FULL: bool>(
    block: &Block,
    w: &Int4Matrix<'_>,
    half: &Half,
    out: *mut f32,
    stride: usize,
) {
    let width = half.width;
    let groups = w.cols / GROUP_SIZE;
    let bytes = w.packed.as_ptr().add(half.row0 * w.cols / 2) as *const i8;
    let scales = w.scales.as_ptr().add(half.row0 * groups);
    let biases = w.biases.as_ptr().add(half.row0 * groups);
    let lanes = half.lanes();
    let nibble = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    for g in 0..groups {
        let group = bytes.add(g * GROUP_BYTES * width);
        prefetch(group, 4);
        let parts: [*const i32; R] = std::array::from_fn(|t| block.group_codes(t, g, P));
        let mut sums = [[_mm256_setzero_si256(); P]; R];
        for c in 0..GROUP_BYTES / PANEL_CHUNK {
            let v = half.load::<FULL>(group.add(c * PANEL_CHUNK * width), lanes);
            let lo = _mm256_and_si256(v, nibble);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), nibble);
            for (sums, a) in sums.iter_mut().zip(parts) {
                for (p, sum) in sums.iter_mut().enumerate() {
                    let a = a.add(p * GROUP_SIZE / 4);
                    // Element 8c + 2j is the low nibble of byte 4c + j (see `split_group`).
                    let pair = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, broadcast(a, 2 * c)),
                        _mm256_maddubs_epi16(hi, broadcast(a, 2 * c + 1)),
                    );
                    *sum = _mm256_add_epi16(*sum, pair);
                }
            }
        }
        let s = half.group_values::<FULL>(scales.add(g * width));
        let b = half.group_values::<FULL>(biases.add(g * width));
        for (t, (acc, sums)) in acc.iter_mut().zip(sums).enumerate() {
            let mut d = _mm256_setzero_ps();
            for p in (0..P).rev() {
                d = combine::<P>(p, _mm256_madd_epi16(sums[p], ones), d);
            }
            let at = t * groups + g;
            *acc = _mm256_fmadd_ps(d, _mm256_mul_ps(s, _mm256_set1_ps(*block.steps.add(at))), *acc);
            *acc = _mm256_fmadd_ps(b, _mm256_set1_ps(*block.sums.add(at)), *acc);
        }
    }
    half.store::<R, FULL>(acc, lanes, out, stride);
}

/// A half of an int8 panel times `R` tokens in `P` parts: each chunk's codes as magnitudes, their
/// signs moved onto each token's activations, one `vpmaddubsw` and `vpmaddwd` per chunk, token
/// and part. A chunk is loaded and its magnitudes taken once for all the block's tokens and parts,
/// with one i32 sum per token and part across the group's chunks (four tokens of three parts are
/// more sums than registers: the compiler keeps some in L1).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn int8_half<const R: usize, const P: usize, const FULL: bool>(
    block: &Block,
    w: &Int8Matrix<'_>,
    half: &Half,
    out: *mut f32,
    stride: usize,
) {
    let width = half.width;
    let groups = w.cols / GROUP_SIZE;
    let codes = w.codes.as_ptr().add(half.row0 * w.cols);
    let scales = w.scales.as_ptr().add(half.row0 * groups);
    let lanes = half.lanes();
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    for g in 0..groups {
        let group = codes.add(g * GROUP_SIZE * width);
        prefetch(group, 8);
        let s = half.group_values::<FULL>(scales.add(g * width));
        let parts: [*const i32; R] = std::array::from_fn(|t| block.group_codes(t, g, P));
        let mut sums = [[_mm256_setzero_si256(); P]; R];
        for c in 0..GROUP_SIZE / PANEL_CHUNK {
            let v = half.load::<FULL>(group.add(c * PANEL_CHUNK * width), lanes);
            let magnitudes = _mm256_abs_epi8(v);
            for (sums, a) in sums.iter_mut().zip(parts) {
                for (p, sum) in sums.iter_mut().enumerate() {
                    let a = broadcast(a.add(p * GROUP_SIZE / 4), c);
                    let product = _mm256_maddubs_epi16(magnitudes, _mm256_sign_epi8(a, v));
                    *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(product, ones));
                }
            }
        }
        let d = sums.map(|sums| {
            let mut d = _mm256_setzero_ps();
            for p in (0..P).rev() {
                d = combine::<P>(p, sums[p], d);
            }
            d
        });
        for (t, (acc, d)) in acc.iter_mut().zip(d).enumerate() {
            let at = t * groups + g;
            *acc = _mm256_fmadd_ps(d, _mm256_mul_ps(s, _mm256_set1_ps(*block.steps.add(at))), *acc);
        }
    }
    half.store::<R, FULL>(acc, lanes, out, stride);
}

/// Columns `k0..k0 + dst.len() / 16` (whole groups) of the panel starting at row `row0`, as f32
/// by the format's definition, column by column: `dst[c * 16 + r]` (zeros past the panel's rows),
/// as the 512-bit `panel_to_f32` writes them, a half panel (eight lanes) at a time.
///
/// # Safety
/// AVX2, FMA and F16C; `row0` starts a panel of `w`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn panel_to_f32(w: Panels<'_>, row0: usize, k0: usize, dst: &mut [f32]) {
    let (rows, cols) = w.shape();
    let groups = cols / GROUP_SIZE;
    let width = super::PANEL_ROWS.min(rows - row0);
    let columns = dst.len() / super::PANEL_ROWS;
    debug_assert!(k0.is_multiple_of(GROUP_SIZE) && columns.is_multiple_of(GROUP_SIZE) && k0 + columns <= cols);
    let out = dst.as_mut_ptr();
    for h in 0..2 {
        let column = |c: usize| out.add(c * super::PANEL_ROWS + HALF_ROWS * h);
        if HALF_ROWS * h >= width {
            for c in 0..columns {
                _mm256_storeu_ps(column(c), _mm256_setzero_ps());
            }
            continue;
        }
        let half = Half::new(row0, width, h);
        let lanes = half.lanes();
        for (i, g) in (k0 / GROUP_SIZE..(k0 + columns) / GROUP_SIZE).enumerate() {
            let column = |c: usize| column(i * GROUP_SIZE + c);
            let at = row0 * groups + g * width;
            match w {
                Panels::Int4(w) => {
                    // Past the half's rows the scales and biases are zeros, and so the values.
                    let s = half.group_values::<false>(w.scales.as_ptr().add(at));
                    let b = half.group_values::<false>(w.biases.as_ptr().add(at));
                    let group = w.packed.as_ptr().add(row0 * cols / 2 + g * GROUP_BYTES * width) as *const i8;
                    let nibble = _mm256_set1_epi32(0x0f);
                    for c in 0..GROUP_BYTES / PANEL_CHUNK {
                        let v = half.load::<false>(group.add(c * PANEL_CHUNK * width), lanes);
                        // Element 8c + q is nibble q of the lane's four bytes (element 2i low).
                        macro_rules! nibbles {
                            ($($q:literal),+) => {$(
                                let q = _mm256_and_si256(_mm256_srli_epi32::<{ 4 * $q }>(v), nibble);
                                _mm256_storeu_ps(column(8 * c + $q), _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s, b));
                            )+};
                        }
                        nibbles!(0, 1, 2, 3, 4, 5, 6, 7);
                    }
                }
                Panels::Int8(w) => {
                    let s = half.group_values::<false>(w.scales.as_ptr().add(at));
                    let group = w.codes.as_ptr().add(row0 * cols + g * GROUP_SIZE * width);
                    for c in 0..GROUP_SIZE / PANEL_CHUNK {
                        let v = half.load::<false>(group.add(c * PANEL_CHUNK * width), lanes);
                        // Element 4c + q is byte q of the lane, sign-extended.
                        macro_rules! bytes {
                            ($($q:literal),+) => {$(
                                let q = _mm256_srai_epi32::<24>(_mm256_slli_epi32::<{ 24 - 8 * $q }>(v));
                                _mm256_storeu_ps(column(4 * c + $q), _mm256_mul_ps(_mm256_cvtepi32_ps(q), s));
                            )+};
                        }
                        bytes!(0, 1, 2, 3);
                    }
                }
            }
        }
    }
}
