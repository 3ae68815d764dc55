//! One-token int4 and int8 products as integer dot products in 512-bit registers ([`Isa::Avx512Vnni`]).
//!
//! The AVX2 path widens each group's nibbles to i16 with a cross-lane instruction and multiplies
//! them in pairs (`vpmaddwd`), then adds; on a one-token product that is what bounds it, not the
//! bytes read. Here the weights are never widened: 64 bytes of packed codes are loaded as 32
//! 16-bit words, and each word's codes are isolated in place by a shift and a mask (four nibbles
//! of int4, two bytes of int8), so that code `p` of every word sits in one register. The
//! activations are laid out once per call to match: code `p` of word `w` is element `E * w + p`
//! of the block (`E` codes per word), so the block's inputs are stored de-interleaved by `E`, as
//! the same two i16 parts (coarse, then the remainder 2^15 finer) the AVX2 path uses. One
//! `vpdpwssd` then multiplies 32 codes with their inputs and adds pairs into 16 i32 lanes, and
//! every lane holds products of one group only, so each group's exact integer sums are scaled by
//! that group's scale and step in f32, as on the AVX2 path.
//!
//! [`Isa::Avx512Vnni`]: crate::Isa::Avx512Vnni

use crate::matmul::{Int4Matrix, Int8Matrix, GROUP_SIZE};

/// 16-bit words per 512-bit register: the weights a block covers are `WORDS * E`.
const WORDS: usize = 32;

/// Codes per 16-bit word: two nibbles per byte for int4, one byte for int8.
pub(crate) const INT4_CODES_PER_WORD: usize = 4;
pub(crate) const INT8_CODES_PER_WORD: usize = 2;

/// Activations of one token laid out for [`int4_dot`] or [`int8_dot`] (`E` codes per word).
///
/// Per block of `WORDS * E` inputs (`E` groups of 32): the coarse i16 parts, code position by
/// code position (`[E][WORDS]`), then the fine parts in the same order. Per group: the coarse
/// step (largest magnitude / 32767) and the exact sum of its inputs. A last partial block is
/// padded with zero inputs and zero steps.
#[derive(Clone, Copy)]
pub(crate) struct Prepared<'a> {
    pub quantized: &'a [i16],
    pub steps: &'a [f32],
    pub sums: &'a [f32],
}

/// Lengths of a prepared token of `k` inputs: (quantized i16s, groups padded to whole blocks).
pub(crate) fn prepared_len(k: usize, codes_per_word: usize) -> (usize, usize) {
    let block = WORDS * codes_per_word;
    let blocks = k.div_ceil(block);
    (blocks * block * 2, blocks * codes_per_word)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::{Int4Matrix, Int8Matrix, Prepared, GROUP_SIZE, WORDS};
    use std::arch::x86_64::*;
    use std::ops::Range;

    use crate::matmul::{FINE, I16_RANGE};

    /// The coarse step of a group of 32 activations (`lo`, `hi`): its largest magnitude / 32767.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn group_step(lo: __m512, hi: __m512) -> f32 {
        let abs_mask = _mm512_set1_ps(f32::from_bits(0x7fff_ffff));
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, abs_mask), _mm512_and_ps(hi, abs_mask))) / I16_RANGE
    }

    /// Activations in coarse steps (`scaled`: value / step) as their two i16 parts, in i32 lanes:
    /// the rounded coarse part, and what that rounding left over in steps [`FINE`] times finer.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn split_parts(scaled: __m512) -> (__m512i, __m512i) {
        let coarse = _mm512_cvtps_epi32(scaled);
        let rest = _mm512_mul_ps(_mm512_sub_ps(scaled, _mm512_cvtepi32_ps(coarse)), _mm512_set1_ps(FINE));
        (coarse, _mm512_cvtps_epi32(rest))
    }

    /// Writes one token's activations `x` (`k` values, a multiple of 32) in the layout of
    /// [`Prepared`] for `E` codes per word; the slices have the lengths of
    /// [`super::prepared_len`].
    ///
    /// # Safety
    /// AVX-512F and AVX-512BW.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub unsafe fn prepare<const E: usize>(x: &[f32], quantized: &mut [i16], steps: &mut [f32], sums: &mut [f32]) {
        let k = x.len();
        let block = WORDS * E;
        let groups = k / GROUP_SIZE;
        debug_assert!(k.is_multiple_of(GROUP_SIZE));
        debug_assert!((quantized.len(), steps.len()) == super::prepared_len(k, E));
        debug_assert!(sums.len() == steps.len());
        let mut inv = [0f32; 16];
        for g in 0..steps.len() {
            if g < groups {
                let lo = _mm512_loadu_ps(x.as_ptr().add(g * GROUP_SIZE));
                let hi = _mm512_loadu_ps(x.as_ptr().add(g * GROUP_SIZE + 16));
                let step = group_step(lo, hi);
                steps[g] = step;
                sums[g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
                inv[g % E] = if step > 0.0 { 1.0 / step } else { 0.0 };
            } else {
                // Padding of a last partial block.
                steps[g] = 0.0;
                sums[g] = 0.0;
                inv[g % E] = 0.0;
            }
            if g % E != E - 1 {
                continue;
            }
            // The block's groups are known: lay out its inputs. A last partial block reads from a
            // zero-padded copy, so that no input past `k` is read.
            let b = g / E;
            let start = b * block;
            let mut padded = [0f32; WORDS * 4];
            let src = if start + block <= k {
                x.as_ptr().add(start)
            } else {
                padded[..k - start].copy_from_slice(&x[start..]);
                padded.as_ptr()
            };
            let dst = quantized.as_mut_ptr().add(b * block * 2);
            let iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            let inv_v = _mm512_loadu_ps(inv.as_ptr());
            for p in 0..E {
                for half in 0..2 {
                    // Lane i is word w = 16 * half + i, whose code p meets input E * w + p.
                    let w = _mm512_add_epi32(iota, _mm512_set1_epi32(16 * half as i32));
                    let index = _mm512_add_epi32(
                        _mm512_mullo_epi32(w, _mm512_set1_epi32(E as i32)),
                        _mm512_set1_epi32(p as i32),
                    );
                    let v = _mm512_i32gather_ps::<4>(index, src);
                    let scaled = _mm512_mul_ps(v, _mm512_permutexvar_ps(_mm512_srli_epi32::<5>(index), inv_v));
                    let (coarse, fine) = split_parts(scaled);
                    let at = p * WORDS + 16 * half;
                    _mm256_storeu_si256(dst.add(at) as *mut __m256i, _mm512_cvtepi32_epi16(coarse));
                    _mm256_storeu_si256(dst.add(E * WORDS + at) as *mut __m256i, _mm512_cvtepi32_epi16(fine));
                }
            }
        }
    }

    /// The scales of the `E` groups of the block starting at group `g0`, widened to f32 (a last
    /// partial block reads only the row's scales, the rest as zeros).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn block_scales<const E: usize>(scales: &[u16], g0: usize) -> __m128 {
        let present = scales.len().saturating_sub(g0).min(E);
        _mm_cvtph_ps(_mm_maskz_loadu_epi16(((1u32 << present) - 1) as __mmask8, scales.as_ptr().add(g0) as *const i16))
    }

    /// Each group's scale times one token's step, for the `E` groups of the block starting at
    /// group `g0`, spread over the 16 i32 lanes of the block's sums (lane `l` holds products of
    /// group `l * E / 16`). `steps` is padded to whole blocks.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn factors<const E: usize>(scales: __m128, steps: &[f32], g0: usize, spread: __m512i) -> __m512 {
        let tp = steps.as_ptr().add(g0);
        let t = if E == 4 { _mm_loadu_ps(tp) } else { _mm_castpd_ps(_mm_load_sd(tp as *const f64)) };
        _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(scales, t)))
    }

    /// Adds one block's integer sums, `d = coarse + fine / 2^15`, times its factors into `acc`.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn scale_into(coarse: __m512i, fine: __m512i, factors: __m512, acc: __m512) -> __m512 {
        let d = _mm512_fmadd_ps(_mm512_cvtepi32_ps(fine), _mm512_set1_ps(1.0 / FINE), _mm512_cvtepi32_ps(coarse));
        _mm512_fmadd_ps(d, factors, acc)
    }

    /// A row's scaled group sums in 16 lanes, for each of `R` tokens: for each block of 64 bytes,
    /// `unpack` isolates code `p` of every word in register `p` (once for all the tokens), each
    /// is multiplied with each token's inputs (coarse and fine parts), and the block's integer
    /// sums are scaled by its groups' factors. Blocks alternate between two accumulators per
    /// token (two independent chains of multiply-adds even for one token).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn row_sums<const E: usize, const R: usize>(
        prepared: &[Prepared<'_>; R],
        bytes: &[u8],
        scales: &[u16],
        spread: __m512i,
        unpack: impl Fn(__m512i) -> [__m512i; E],
    ) -> [__m512; R] {
        let block = |b: usize, acc: &mut [__m512; R]| {
            let codes = unpack(load_block(bytes, b));
            let s = block_scales::<E>(scales, b * E);
            for (token, acc) in prepared.iter().zip(acc) {
                let x = token.quantized.as_ptr().add(b * WORDS * E * 2);
                let mut coarse = _mm512_setzero_si512();
                let mut fine = _mm512_setzero_si512();
                for (p, &c) in codes.iter().enumerate() {
                    coarse = _mm512_dpwssd_epi32(coarse, c, _mm512_loadu_si512(x.add(p * WORDS) as *const _));
                    fine = _mm512_dpwssd_epi32(fine, c, _mm512_loadu_si512(x.add((E + p) * WORDS) as *const _));
                }
                *acc = scale_into(coarse, fine, factors::<E>(s, token.steps, b * E, spread), *acc);
            }
        };
        let blocks = scales.len().div_ceil(E);
        let (mut even, mut odd) = ([_mm512_setzero_ps(); R], [_mm512_setzero_ps(); R]);
        let mut b = 0;
        while b + 2 <= blocks {
            block(b, &mut even);
            block(b + 1, &mut odd);
            b += 2;
        }
        if b < blocks {
            block(b, &mut even);
        }
        std::array::from_fn(|t| _mm512_add_ps(even[t], odd[t]))
    }

    /// The 64 bytes of block `b` of a row of `len` bytes (a partial last block zero-filled).
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn load_block(row: &[u8], b: usize) -> __m512i {
        let start = b * 64;
        let p = row.as_ptr().add(start) as *const i8;
        // Ask for the bytes a little ahead: each thread streams one run of rows, and the hardware
        // prefetchers alone left the loads waiting on memory. A prefetch past the row (into the
        // next row of the run, or past the matrix) never faults.
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(crate::matmul::PREFETCH_AHEAD));
        if start + 64 <= row.len() {
            _mm512_loadu_si512(p as *const _)
        } else {
            _mm512_maskz_loadu_epi8((1u64 << (row.len() - start)) - 1, p)
        }
    }

    /// Rows `rows` of `w` times each of `R` tokens, written to `out[t * w.rows + row]`.
    ///
    /// # Safety
    /// As [`int4_dot`]; `out` valid for `[R, w.rows]` and these rows' columns of it not written
    /// by anyone else meanwhile.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn int4_rows<const R: usize>(
        prepared: &[Prepared<'_>; R],
        w: &Int4Matrix<'_>,
        rows: Range<usize>,
        out: *mut f32,
    ) {
        let (groups, half) = (w.cols / GROUP_SIZE, w.cols / 2);
        for row in rows {
            let sums = int4_dot(
                prepared,
                &w.packed[row * half..(row + 1) * half],
                &w.scales[row * groups..(row + 1) * groups],
                &w.biases[row * groups..(row + 1) * groups],
            );
            for (t, value) in sums.into_iter().enumerate() {
                *out.add(t * w.rows + row) = value;
            }
        }
    }

    /// Rows `rows` of `w` times each of `R` tokens, written to `out[t * w.rows + row]`.
    ///
    /// # Safety
    /// As [`int8_dot`]; `out` valid for `[R, w.rows]` and these rows' columns of it not written
    /// by anyone else meanwhile.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn int8_rows<const R: usize>(
        prepared: &[Prepared<'_>; R],
        w: &Int8Matrix<'_>,
        rows: Range<usize>,
        out: *mut f32,
    ) {
        let (groups, k) = (w.cols / GROUP_SIZE, w.cols);
        for row in rows {
            let sums =
                int8_dot(prepared, &w.codes[row * k..(row + 1) * k], &w.scales[row * groups..(row + 1) * groups]);
            for (t, value) in sums.into_iter().enumerate() {
                *out.add(t * w.rows + row) = value;
            }
        }
    }

    /// One int4 row (`packed`, `scales`, `biases` of seam's format) times each of `R` tokens
    /// prepared with `E = 4`: `Σ_g scale_g · step_g · (x_g · q_g) + Σ_g bias_g · Σ x_g`.
    ///
    /// # Safety
    /// AVX-512F, AVX-512BW, AVX-512VL and AVX-512 VNNI; `prepared` made by [`prepare`] for this
    /// row's length.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn int4_dot<const R: usize>(
        prepared: &[Prepared<'_>; R],
        packed: &[u8],
        scales: &[u16],
        biases: &[u16],
    ) -> [f32; R] {
        const E: usize = super::INT4_CODES_PER_WORD;
        let groups = scales.len();
        debug_assert!(packed.len() == groups * GROUP_SIZE / 2 && biases.len() == groups);
        debug_assert!(prepared.iter().all(|p| p.quantized.len() == groups.div_ceil(E) * WORDS * E * 2));
        let nibble = _mm512_set1_epi16(0x0f);
        // Lane l sums words 2l and 2l + 1, both of group l / 4 of the block.
        let spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        let acc = row_sums::<E, R>(prepared, packed, scales, spread, |w| {
            [
                _mm512_and_si512(w, nibble),
                _mm512_and_si512(_mm512_srli_epi16::<4>(w), nibble),
                _mm512_and_si512(_mm512_srli_epi16::<8>(w), nibble),
                _mm512_srli_epi16::<12>(w),
            ]
        });
        std::array::from_fn(|t| _mm512_reduce_add_ps(add_bias_term(biases, prepared[t].sums, acc[t])))
    }

    /// One int8 row (`codes`, `scales` of seam's format) times each of `R` tokens prepared with
    /// `E = 2`: `Σ_g scale_g · step_g · (x_g · q_g)`.
    ///
    /// # Safety
    /// AVX-512F, AVX-512BW, AVX-512VL and AVX-512 VNNI; `prepared` made by [`prepare`] for this
    /// row's length.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[inline]
    unsafe fn int8_dot<const R: usize>(prepared: &[Prepared<'_>; R], codes: &[i8], scales: &[u16]) -> [f32; R] {
        const E: usize = super::INT8_CODES_PER_WORD;
        let groups = scales.len();
        debug_assert!(codes.len() == groups * GROUP_SIZE);
        debug_assert!(prepared.iter().all(|p| p.quantized.len() == groups.div_ceil(E) * WORDS * E * 2));
        let bytes = std::slice::from_raw_parts(codes.as_ptr() as *const u8, codes.len());
        // Lane l sums words 2l and 2l + 1, both of group l / 8 of the block.
        let spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        // The low byte of each word sign-extended, then the high byte.
        let acc = row_sums::<E, R>(prepared, bytes, scales, spread, |w| {
            [_mm512_srai_epi16::<8>(_mm512_slli_epi16::<8>(w)), _mm512_srai_epi16::<8>(w)]
        });
        std::array::from_fn(|t| _mm512_reduce_add_ps(acc[t]))
    }

    /// `acc + bias_g · Σ x_g` for each of a row's groups, in 16 lanes.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    pub(crate) unsafe fn add_bias_term(biases: &[u16], sums: &[f32], mut acc: __m512) -> __m512 {
        for g in (0..biases.len()).step_by(16) {
            let mask = if g + 16 <= biases.len() { !0 } else { ((1u32 << (biases.len() - g)) - 1) as __mmask16 };
            let b = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, biases.as_ptr().add(g) as *const i16));
            acc = _mm512_fmadd_ps(b, _mm512_maskz_loadu_ps(mask, sums.as_ptr().add(g)), acc);
        }
        acc
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) mod x86 {
    use super::{Int4Matrix, Int8Matrix, Prepared};
    use std::ops::Range;

    pub unsafe fn prepare<const E: usize>(_: &[f32], _: &mut [i16], _: &mut [f32], _: &mut [f32]) {
        unreachable!("the VNNI path is never chosen off x86-64")
    }
    pub unsafe fn int4_rows<const R: usize>(_: &[Prepared<'_>; R], _: &Int4Matrix<'_>, _: Range<usize>, _: *mut f32) {
        unreachable!("the VNNI path is never chosen off x86-64")
    }
    pub unsafe fn int8_rows<const R: usize>(_: &[Prepared<'_>; R], _: &Int8Matrix<'_>, _: Range<usize>, _: *mut f32) {
        unreachable!("the VNNI path is never chosen off x86-64")
    }
}
