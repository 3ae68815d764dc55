//! int4 weights in panels of 16 rows, multiplied over activations rounded to int8 (ADR 0025).
//!
//! In seam's row-major int4 layout one 512-bit register of weights holds 128 codes of one row, so
//! every row ends in a horizontal sum per token, and every 64 bytes cost a conversion and a scale
//! per token. At SmolLM2's widths (576 columns: four and a half registers per row) that overhead
//! is as large as the dot products themselves. In a panel, lane `r` of a register is row `r`:
//! one `vpdpbusd` multiplies four codes of each of 16 rows with four activations broadcast to
//! every lane, the 16 rows' sums stay in their lanes to the end (no horizontal sum), and a group
//! of 32 columns is scaled once per token for all 16 rows.
//!
//! Layout ([`int4_to_panels`]): rows in panels of [`PANEL_ROWS`] (the last one narrower when the
//! row count is not a multiple: `w` rows). Panel `p` starts at byte `16 p * cols / 2`, as its
//! first row does in the row-major layout, so a run of whole panels is a contiguous slice of
//! either layout. Within it, group `g` (32 columns, 16 bytes per row) takes `16 w` bytes: four
//! chunks of `4 w` bytes, chunk `c` holding bytes `4c..4c + 4` of the group of each row in turn
//! (row-major bytes, so a byte still holds element `2i` in its low nibble). Scales and biases:
//! panel `p`'s group `g` holds the `w` rows' values in turn, from element `16 p * groups + g w`.
//!
//! The product is the one of [`crate::matmul_int4_q8`] (the exact product over
//! [`crate::round_int8`]'s activations), so a backend may hold the layers in panels and its other
//! matrices row-major and compute the same numbers. Off AVX-512 VNNI each run of panels is laid
//! back out row-major in scratch and multiplied by the exact kernels over the rounded activations.

use crate::matmul::{for_each_row_run, SendPtr, MIN_ROWS_PER_TASK};
use crate::pool::Pool;
use crate::scratch::Scratch;
use crate::{check_len, Int4Matrix, Isa, ShapeError, GROUP_SIZE};

/// Rows per panel: one i32 lane each in a 512-bit register.
pub const PANEL_ROWS: usize = 16;

/// Bytes of one row's group: 32 codes.
const GROUP_BYTES: usize = GROUP_SIZE / 2;

/// Bytes per chunk and row: what one `vpdpbusd` lane multiplies.
const CHUNK: usize = 4;

/// Where byte `byte` (of `cols / 2`) of row `row` lies in the panel layout of a matrix of `rows`
/// rows and `cols` columns.
fn packed_offset(rows: usize, cols: usize, row: usize, byte: usize) -> usize {
    let (p, r) = (row / PANEL_ROWS, row % PANEL_ROWS);
    let w = PANEL_ROWS.min(rows - p * PANEL_ROWS);
    let (g, j) = (byte / GROUP_BYTES, byte % GROUP_BYTES);
    p * PANEL_ROWS * cols / 2 + g * GROUP_BYTES * w + (j / CHUNK) * CHUNK * w + r * CHUNK + j % CHUNK
}

/// Where group `g` of row `row` lies in the panel layout of the scales and biases.
fn group_offset(rows: usize, groups: usize, row: usize, g: usize) -> usize {
    let (p, r) = (row / PANEL_ROWS, row % PANEL_ROWS);
    let w = PANEL_ROWS.min(rows - p * PANEL_ROWS);
    p * PANEL_ROWS * groups + g * w + r
}

/// Checks that `w`'s parts have the lengths of a `[rows, cols]` int4 matrix.
fn check(w: &Int4Matrix<'_>) -> Result<usize, ShapeError> {
    if !w.cols.is_multiple_of(GROUP_SIZE) {
        return Err(ShapeError(format!("int4 columns {} are not a multiple of {GROUP_SIZE}", w.cols)));
    }
    let groups = w.cols / GROUP_SIZE;
    check_len("int4 packed weights", w.packed.len(), w.rows * w.cols / 2)?;
    check_len("int4 scales", w.scales.len(), w.rows * groups)?;
    check_len("int4 biases", w.biases.len(), w.rows * groups)?;
    Ok(groups)
}

/// Lays out the row-major int4 matrix `w` in panels: `packed`, `scales` and `biases` take as many
/// elements as `w`'s.
pub fn int4_to_panels(
    w: Int4Matrix<'_>,
    packed: &mut [u8],
    scales: &mut [u16],
    biases: &mut [u16],
) -> Result<(), ShapeError> {
    let groups = check(&w)?;
    check(&Int4Matrix { packed, scales, biases, ..w })?;
    let half = w.cols / 2;
    for row in 0..w.rows {
        for j in (0..half).step_by(CHUNK) {
            let at = packed_offset(w.rows, w.cols, row, j);
            packed[at..at + CHUNK].copy_from_slice(&w.packed[row * half + j..row * half + j + CHUNK]);
        }
        for g in 0..groups {
            let at = group_offset(w.rows, groups, row, g);
            scales[at] = w.scales[row * groups + g];
            biases[at] = w.biases[row * groups + g];
        }
    }
    Ok(())
}

/// The inverse of [`int4_to_panels`]: `w` is in panels, the outputs row-major.
pub fn int4_from_panels(
    w: Int4Matrix<'_>,
    packed: &mut [u8],
    scales: &mut [u16],
    biases: &mut [u16],
) -> Result<(), ShapeError> {
    let groups = check(&w)?;
    check(&Int4Matrix { packed, scales, biases, ..w })?;
    let half = w.cols / 2;
    for row in 0..w.rows {
        for j in (0..half).step_by(CHUNK) {
            let at = packed_offset(w.rows, w.cols, row, j);
            packed[row * half + j..row * half + j + CHUNK].copy_from_slice(&w.packed[at..at + CHUNK]);
        }
        for g in 0..groups {
            let at = group_offset(w.rows, groups, row, g);
            scales[row * groups + g] = w.scales[at];
            biases[row * groups + g] = w.biases[at];
        }
    }
    Ok(())
}

/// `out = round_int8(x) W^T` for int4 `W` laid out in panels ([`int4_to_panels`]): `x` is
/// `[tokens, cols]`, `out` `[tokens, rows]`. The numbers of [`crate::matmul_int4_q8`] over the
/// row-major matrix, up to the order of f32 operations.
pub fn matmul_int4_panels_q8(
    isa: Isa,
    pool: &Pool,
    x: &[f32],
    tokens: usize,
    w: Int4Matrix<'_>,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let groups = check(&w)?;
    check_len("x", x.len(), tokens * w.cols)?;
    check_len("output", out.len(), tokens * w.rows)?;
    if tokens == 0 || w.rows == 0 {
        return Ok(());
    }
    let min_rows = MIN_ROWS_PER_TASK.next_multiple_of(PANEL_ROWS);
    if isa == Isa::Avx512Vnni && isa.is_supported() {
        PREPARED.with(|prepared| {
            prepared.fill(x, tokens, w.cols);
            let prepared = &*prepared;
            for_each_row_run(pool, w.rows, PANEL_ROWS, min_rows, out, &|run, out| {
                // SAFETY: the CPU has AVX-512 VNNI (checked above); the tokens were laid out for
                // these columns; `run` starts on a panel and these rows' columns of `out` are
                // this task's alone.
                unsafe { vnni_run(prepared, tokens, &w, groups, run, out) }
            });
        });
        return Ok(());
    }
    let rounded_pool = pool;
    crate::matmul::over_rounded(isa, x, |x| {
        for_each_row_run(rounded_pool, w.rows, PANEL_ROWS, min_rows, out, &|run, out| {
            row_major_run(isa, x, tokens, &w, groups, run, out)
        })
    });
    Ok(())
}

/// Row-major copies of a run of panels, and the run's products, per task.
#[derive(Default)]
struct RowMajor {
    packed: Vec<u8>,
    scales: Vec<u16>,
    biases: Vec<u16>,
    out: Vec<f32>,
}

static ROW_MAJOR: Scratch<RowMajor> = Scratch::new();

/// Rows `run` (whole panels) of the product over the rounded activations `x`, through the exact
/// kernels on a row-major copy of them.
fn row_major_run(
    isa: Isa,
    x: &[f32],
    tokens: usize,
    w: &Int4Matrix<'_>,
    groups: usize,
    run: std::ops::Range<usize>,
    out: &SendPtr,
) {
    static ONE_THREAD: std::sync::OnceLock<Pool> = std::sync::OnceLock::new();
    let one = ONE_THREAD.get_or_init(|| Pool::new(1));
    let (half, rows) = (w.cols / 2, run.len());
    // The run's panels are a matrix of their own in the panel layout: the whole panels before its
    // last one are full, as in `w`.
    let panels = Int4Matrix {
        rows,
        cols: w.cols,
        packed: &w.packed[run.start * half..run.end * half],
        scales: &w.scales[run.start * groups..run.end * groups],
        biases: &w.biases[run.start * groups..run.end * groups],
    };
    ROW_MAJOR.with(|s| {
        s.packed.resize(rows * half, 0);
        s.scales.resize(rows * groups, 0);
        s.biases.resize(rows * groups, 0);
        s.out.resize(tokens * rows, 0.0);
        int4_from_panels(panels, &mut s.packed, &mut s.scales, &mut s.biases).expect("a run's shapes agree");
        let m = Int4Matrix { rows, cols: w.cols, packed: &s.packed, scales: &s.scales, biases: &s.biases };
        crate::matmul_int4(isa, one, x, tokens, m, &mut s.out).expect("a run's shapes agree");
        for t in 0..tokens {
            // SAFETY: these rows' columns of `out` (`[tokens, w.rows]`) are this task's alone.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(t * w.rows + run.start), rows) };
            dst.copy_from_slice(&s.out[t * rows..(t + 1) * rows]);
        }
    });
}

/// Tokens laid out for the panels: per token and group of 32 activations, the int8 codes in the
/// order a chunk's bytes meet them (for each chunk of four bytes, the four activations of their
/// low nibbles, then the four of their high ones), the group's step, and the step times the
/// codes' sum (the factor of the group's bias).
#[derive(Default)]
struct Prepared {
    codes: Vec<i8>,
    steps: Vec<f32>,
    sums: Vec<f32>,
}

impl Prepared {
    fn fill(&mut self, x: &[f32], tokens: usize, k: usize) {
        let groups = k / GROUP_SIZE;
        self.codes.resize(tokens * k, 0);
        self.steps.resize(tokens * groups, 0.0);
        self.sums.resize(tokens * groups, 0.0);
        for (i, src) in x.chunks_exact(GROUP_SIZE).enumerate() {
            let dst = &mut self.codes[i * GROUP_SIZE..(i + 1) * GROUP_SIZE];
            // SAFETY: only called on the VNNI path, which the CPU supports.
            let (step, total) = unsafe { x86::round_group(src, dst) };
            self.steps[i] = step;
            self.sums[i] = step * total as f32;
        }
    }
}

static PREPARED: Scratch<Prepared> = Scratch::new();

/// Tokens per block: one f32 accumulator each, beside the panel's eight registers of codes.
const TOKEN_BLOCK: usize = 8;

/// Rows `run` of the product, on the VNNI path.
///
/// # Safety
/// AVX-512 VNNI; `prepared` laid out for `tokens` tokens of `w.cols` columns; `run` starts on a
/// panel; these rows' columns of `out` (`[tokens, w.rows]`) are the caller's alone.
unsafe fn vnni_run(
    prepared: &Prepared,
    tokens: usize,
    w: &Int4Matrix<'_>,
    groups: usize,
    run: std::ops::Range<usize>,
    out: &SendPtr,
) {
    for row0 in run.clone().step_by(PANEL_ROWS) {
        let width = PANEL_ROWS.min(w.rows - row0);
        for first in (0..tokens).step_by(TOKEN_BLOCK) {
            let count = TOKEN_BLOCK.min(tokens - first);
            let block = x86::Block {
                codes: prepared.codes[first * w.cols..].as_ptr(),
                steps: prepared.steps[first * groups..].as_ptr(),
                sums: prepared.sums[first * groups..].as_ptr(),
                cols: w.cols,
            };
            // SAFETY: as this function's; `block` holds `count` tokens from `first`.
            unsafe { x86::panel(count, &block, w, row0, width, out.0.add(first * w.rows), w.rows) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Int4Matrix, CHUNK, GROUP_BYTES, GROUP_SIZE, PANEL_ROWS};
    use std::arch::x86_64::*;

    /// A block of prepared tokens: token `t`'s codes from `codes + t * cols`, its steps and sums
    /// from `steps + t * groups` and `sums + t * groups`.
    pub struct Block {
        pub codes: *const i8,
        pub steps: *const f32,
        pub sums: *const f32,
        pub cols: usize,
    }

    /// Rounds one group (32 values) to int8 codes in the panels' order (see [`super::Prepared`]);
    /// returns its step and the codes' sum.
    ///
    /// # Safety
    /// AVX-512F, BW and VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn round_group(src: &[f32], dst: &mut [i8]) -> (f32, i32) {
        debug_assert!(src.len() == GROUP_SIZE && dst.len() == GROUP_SIZE);
        let (step, lo, hi) = crate::q8::x86::round_group(src);
        // Output byte 8c + 4h + j is element 8c + 2j + h: per chunk c, the even elements (low
        // nibbles) and then the odd ones (high nibbles). Indices from 16 select `hi`.
        let first = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
        let second = _mm512_add_epi32(first, _mm512_set1_epi32(16));
        let p = dst.as_mut_ptr() as *mut __m128i;
        _mm_storeu_si128(p, _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(lo, first, hi)));
        _mm_storeu_si128(p.add(1), _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(lo, second, hi)));
        (step, _mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi)))
    }

    /// The panel of `width` rows from `row0` times `count` (1..=8) tokens of `block`, written to
    /// `out[t * stride + row0 + r]`.
    ///
    /// # Safety
    /// AVX-512 VNNI; `row0` starts a panel of `w`; `block` holds `count` prepared tokens of
    /// `w.cols` columns; `out` valid for those elements.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn panel(
        count: usize,
        block: &Block,
        w: &Int4Matrix<'_>,
        row0: usize,
        width: usize,
        out: *mut f32,
        stride: usize,
    ) {
        macro_rules! by_count {
            ($($r:literal),+) => {
                match count {
                    $($r => panel_tokens::<$r>(block, w, row0, width, out, stride),)+
                    other => unreachable!("a token block of {other} tokens"),
                }
            };
        }
        by_count!(1, 2, 3, 4, 5, 6, 7, 8)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn panel_tokens<const R: usize>(
        block: &Block,
        w: &Int4Matrix<'_>,
        row0: usize,
        width: usize,
        out: *mut f32,
        stride: usize,
    ) {
        let groups = w.cols / GROUP_SIZE;
        let bytes = w.packed.as_ptr().add(row0 * w.cols / 2) as *const i8;
        let scales = w.scales.as_ptr().add(row0 * groups) as *const i16;
        let biases = w.biases.as_ptr().add(row0 * groups) as *const i16;
        let lanes: __mmask16 = if width == PANEL_ROWS { !0 } else { (1 << width) - 1 };
        let chunk_bytes: __mmask64 = if width == PANEL_ROWS { !0 } else { (1 << (CHUNK * width)) - 1 };
        let nibble = _mm512_set1_epi8(0x0f);
        let mut acc = [_mm512_setzero_ps(); R];
        for g in 0..groups {
            let group = bytes.add(g * GROUP_BYTES * width);
            _mm_prefetch::<_MM_HINT_T0>(group.wrapping_add(crate::matmul::PREFETCH_AHEAD));
            _mm_prefetch::<_MM_HINT_T0>(group.wrapping_add(crate::matmul::PREFETCH_AHEAD + 64));
            _mm_prefetch::<_MM_HINT_T0>(group.wrapping_add(crate::matmul::PREFETCH_AHEAD + 128));
            _mm_prefetch::<_MM_HINT_T0>(group.wrapping_add(crate::matmul::PREFETCH_AHEAD + 192));
            let v: [__m512i; 4] =
                std::array::from_fn(|c| _mm512_maskz_loadu_epi8(chunk_bytes, group.add(c * CHUNK * width)));
            let lo: [__m512i; 4] = std::array::from_fn(|c| _mm512_and_si512(v[c], nibble));
            let hi: [__m512i; 4] = std::array::from_fn(|c| _mm512_and_si512(_mm512_srli_epi16::<4>(v[c]), nibble));
            let s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, scales.add(g * width)));
            let b = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, biases.add(g * width)));
            for (t, acc) in acc.iter_mut().enumerate() {
                let a = block.codes.add(t * block.cols + g * GROUP_SIZE) as *const i32;
                // Two chains of four: the even elements' products and the odd ones'.
                let mut even =
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], _mm512_set1_epi32(a.read_unaligned()));
                let mut odd =
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[0], _mm512_set1_epi32(a.add(1).read_unaligned()));
                for c in 1..4 {
                    even = _mm512_dpbusd_epi32(even, lo[c], _mm512_set1_epi32(a.add(2 * c).read_unaligned()));
                    odd = _mm512_dpbusd_epi32(odd, hi[c], _mm512_set1_epi32(a.add(2 * c + 1).read_unaligned()));
                }
                let sums = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
                let at = t * groups + g;
                *acc = _mm512_fmadd_ps(sums, _mm512_mul_ps(s, _mm512_set1_ps(*block.steps.add(at))), *acc);
                *acc = _mm512_fmadd_ps(b, _mm512_set1_ps(*block.sums.add(at)), *acc);
            }
        }
        for (t, acc) in acc.into_iter().enumerate() {
            _mm512_mask_storeu_ps(out.add(t * stride + row0), lanes, acc);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    use super::Int4Matrix;

    pub struct Block {
        pub codes: *const i8,
        pub steps: *const f32,
        pub sums: *const f32,
        pub cols: usize,
    }
    pub unsafe fn round_group(_: &[f32], _: &mut [i8]) -> (f32, i32) {
        unreachable!("the VNNI path is never chosen off x86-64")
    }
    pub unsafe fn panel(_: usize, _: &Block, _: &Int4Matrix<'_>, _: usize, _: usize, _: *mut f32, _: usize) {
        unreachable!("the VNNI path is never chosen off x86-64")
    }
}
