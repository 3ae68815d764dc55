//! Vector math the kernels share: what the compiler does not vectorize by itself.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// ln 2 in two parts, so that `n ln 2` is subtracted without rounding away `r`.
const LN2_HIGH: f32 = 0.693_359_4;
const LN2_LOW: f32 = -2.121_944_4e-4;
/// The polynomial of `(e^r - 1 - r) / r^2`, highest degree first (Cephes' `expf`).
const EXP_POLYNOMIAL: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];

/// `e^x` of eight values to about one unit in the last place of f32: `x = n ln 2 + r` with
/// `|r| <= ln 2 / 2`, `e^r` by its degree-6 minimax polynomial (Cephes' `expf`
/// coefficients), `2^n` put into the exponent bits. Inputs are clamped to where f32's
/// result is finite and normal.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn exp(x: __m256) -> __m256 {
    let x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0)), _mm256_set1_ps(-87.0));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HIGH), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LOW), r);
    let mut p = _mm256_set1_ps(EXP_POLYNOMIAL[0]);
    for coefficient in &EXP_POLYNOMIAL[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*coefficient));
    }
    let r2 = _mm256_mul_ps(r, r);
    let e_r = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
    let two_n = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
    _mm256_mul_ps(e_r, _mm256_castsi256_ps(two_n))
}

/// The first `n` of eight lanes (all of them from 8 on) as a mask of whole lanes, for masked
/// loads and stores.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn first_lanes(n: usize) -> __m256i {
    _mm256_cmpgt_epi32(_mm256_set1_epi32(n.min(8) as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
}

/// The sum of eight values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn sum8(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// The largest of eight values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn max8(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
}

/// [`exp`] of sixteen values: the same reduction, polynomial and clamping in 512-bit registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline]
pub(crate) unsafe fn exp512(x: __m512) -> __m512 {
    let x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0)), _mm512_set1_ps(-87.0));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HIGH), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LOW), r);
    let mut p = _mm512_set1_ps(EXP_POLYNOMIAL[0]);
    for coefficient in &EXP_POLYNOMIAL[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*coefficient));
    }
    let r2 = _mm512_mul_ps(r, r);
    let e_r = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0));
    let two_n = _mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)));
    _mm512_mul_ps(e_r, _mm512_castsi512_ps(two_n))
}

/// `out = silu(gate) * up` element-wise, `silu(g) = g / (1 + e^-g)` as the reference writes it.
pub(crate) fn swiglu(isa: crate::Isa, gate: &[f32], up: &[f32], out: &mut [f32]) {
    match isa {
        // SAFETY: the CPU supports the path (the caller's `Isa` is a supported one).
        #[cfg(target_arch = "x86_64")]
        crate::Isa::Avx2 | crate::Isa::Avx512 | crate::Isa::Avx512Vnni if isa.is_supported() => unsafe {
            swiglu_avx2(gate, up, out)
        },
        _ => swiglu_scalar(gate, up, out),
    }
}

fn swiglu_scalar(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((d, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *d = g / (1.0 + (-g).exp()) * u;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn swiglu_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len().min(gate.len()).min(up.len());
    let whole = n - n % 8;
    let one = _mm256_set1_ps(1.0);
    for i in (0..whole).step_by(8) {
        let g = _mm256_loadu_ps(gate.as_ptr().add(i));
        let u = _mm256_loadu_ps(up.as_ptr().add(i));
        let e = exp(_mm256_sub_ps(_mm256_setzero_ps(), g));
        let silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(silu, u));
    }
    swiglu_scalar(&gate[whole..n], &up[whole..n], &mut out[whole..n]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Isa;

    #[test]
    fn swiglu_and_exp_match_the_scalar_definition_on_every_path() {
        // Gates over the whole range where silu changes shape, beyond exp's clamps both ways.
        let gate: Vec<f32> = (0..4003).map(|i| (i as f32 - 2001.0) * 0.05).collect();
        let up: Vec<f32> = (0..gate.len()).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let mut want = vec![0.0; gate.len()];
        swiglu_scalar(&gate, &up, &mut want);
        for isa in Isa::supported() {
            let mut got = vec![f32::NAN; gate.len()];
            swiglu(isa, &gate, &up, &mut got);
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() <= 4e-7 * w.abs().max(1e-3), "{isa:?} gate {}: {g} vs {w}", gate[i]);
            }
        }
    }
}
