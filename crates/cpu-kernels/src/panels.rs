//! int4 and int8 weights in panels of 16 rows: one output row per register lane (ADR 0025).
//!
//! In seam's row-major int4 layout one 512-bit register of weights holds 128 codes of one row, so
//! every row ends in a horizontal sum per token, and every 64 bytes cost a conversion and a scale
//! per token. At SmolLM2's widths (576 columns: four and a half registers per row) that overhead
//! is as large as the dot products themselves. In a panel, lane `r` of a register is row `r`:
//! one integer dot product multiplies a few codes of each of 16 rows with activations broadcast
//! to every lane, the 16 rows' sums stay in their lanes to the end (no horizontal sum), and a
//! group of 32 columns is scaled once per token for all 16 rows.
//!
//! Layout ([`int4_to_panels`]): rows in panels of [`PANEL_ROWS`] (the last one narrower when the
//! row count is not a multiple: `w` rows). Panel `p` starts at byte `16 p * cols / 2`, as its
//! first row does in the row-major layout, so a run of whole panels is a contiguous slice of
//! either layout. Within it, group `g` (32 columns, 16 bytes per row) takes `16 w` bytes: four
//! chunks of `4 w` bytes, chunk `c` holding bytes `4c..4c + 4` of the group of each row in turn
//! (row-major bytes, so a byte still holds element `2i` in its low nibble). Scales and biases:
//! panel `p`'s group `g` holds the `w` rows' values in turn, from element `16 p * groups + g w`.
//!
//! int8 matrices (an int4 model's head, ADR 0013) take the same panels ([`int8_to_panels`]):
//! per panel and group, eight chunks of `4 w` bytes, chunk `c` holding codes `4c..4c + 4` of the
//! group of each row in turn; their scales as the int4 ones. The graphs gather an embedding's rows
//! straight from this order (a `[rows / 16, cols / 4, 16, 4]` view), so a tied table is held once.
//!
//! Two products read the panels, both one `vpdpbusd` per four codes of each row (the codes as
//! unsigned bytes, the activations as int8 parts broadcast to every lane), with the numbers of
//! the row-major products up to f32's precision, so a backend may hold some matrices in panels
//! and others row-major:
//! - over activations rounded to int8 ([`matmul_int4_panels_q8`], [`matmul_int8_panels_q8`]: the
//!   numbers of [`crate::matmul_int4_q8`]): one part;
//! - over exact activations ([`matmul_int4_panels`], [`matmul_int8_panels`]: the numbers of
//!   [`crate::matmul_int4`]): three int8 parts per activation, the rounded one and what it left
//!   over in two steps 254 times finer each, about 2^-24 of the group's largest magnitude
//!   (ADR 0029; the row-major exact products carry two i16 parts, 2^-30).
//!
//! Both run on AVX-512 VNNI (`vpdpbusd`, below) and, a half panel of eight rows at a time, on
//! AVX2 (`vpmaddubsw` and `vpmaddwd`, [`avx2`], ADR 0032). Exact calls of many tokens (a prefill
//! chunk; on AVX2 from five tokens) run the exact kernels' blocked matrix-matrix product, which
//! converts each row's groups to f32 straight from the panels. Without AVX2 each run of panels is
//! laid back out row-major in scratch and multiplied by the scalar kernels, over the rounded
//! activations where the product rounds them.

use crate::matmul::{for_each_row_run, int4_weights, int8_weights, SendPtr, MIN_ROWS_PER_TASK};
use crate::pool::Pool;
use crate::scratch::Scratch;
use crate::{check_len, Activations, Int4Matrix, Int8Matrix, Isa, ShapeError, GROUP_SIZE};

/// Rows per panel: one i32 lane each in a 512-bit register.
pub const PANEL_ROWS: usize = 16;

/// Bytes of one row's group: 32 codes.
const GROUP_BYTES: usize = GROUP_SIZE / 2;

/// Bytes per chunk and row: what one `vpdpbusd` lane multiplies (an int8 embedding's rows are
/// gathered from panels in chunks of this many codes).
pub const PANEL_CHUNK: usize = 4;

/// Where byte `byte` of row `row` lies in the panel layout of a matrix of `rows` rows of
/// `row_bytes` bytes, `group_bytes` per group.
fn packed_offset(rows: usize, row_bytes: usize, group_bytes: usize, row: usize, byte: usize) -> usize {
    let (p, r) = (row / PANEL_ROWS, row % PANEL_ROWS);
    let w = PANEL_ROWS.min(rows - p * PANEL_ROWS);
    let (g, j) = (byte / group_bytes, byte % group_bytes);
    p * PANEL_ROWS * row_bytes
        + g * group_bytes * w
        + (j / PANEL_CHUNK) * PANEL_CHUNK * w
        + r * PANEL_CHUNK
        + j % PANEL_CHUNK
}

/// Moves the bytes of a matrix between the two orders: `to_panels` from row-major `from` into
/// panels `to`, else back.
fn reorder_bytes<T: Copy>(
    rows: usize,
    row_bytes: usize,
    group_bytes: usize,
    from: &[T],
    to: &mut [T],
    to_panels: bool,
) {
    for row in 0..rows {
        for j in (0..row_bytes).step_by(PANEL_CHUNK) {
            let at = packed_offset(rows, row_bytes, group_bytes, row, j);
            let plain = row * row_bytes + j;
            if to_panels {
                to[at..at + PANEL_CHUNK].copy_from_slice(&from[plain..plain + PANEL_CHUNK]);
            } else {
                to[plain..plain + PANEL_CHUNK].copy_from_slice(&from[at..at + PANEL_CHUNK]);
            }
        }
    }
}

/// Moves per-group values (scales, biases) between the two orders, as [`reorder_bytes`].
fn reorder_groups(rows: usize, groups: usize, from: &[u16], to: &mut [u16], to_panels: bool) {
    for row in 0..rows {
        for g in 0..groups {
            let at = group_offset(rows, groups, row, g);
            if to_panels {
                to[at] = from[row * groups + g];
            } else {
                to[row * groups + g] = from[at];
            }
        }
    }
}

/// Where group `g` of row `row` lies in the panel layout of the scales and biases.
fn group_offset(rows: usize, groups: usize, row: usize, g: usize) -> usize {
    let (p, r) = (row / PANEL_ROWS, row % PANEL_ROWS);
    let w = PANEL_ROWS.min(rows - p * PANEL_ROWS);
    p * PANEL_ROWS * groups + g * w + r
}

/// Lays out the row-major int4 matrix `w` in panels: `packed`, `scales` and `biases` take as many
/// elements as `w`'s.
pub fn int4_to_panels(
    w: Int4Matrix<'_>,
    packed: &mut [u8],
    scales: &mut [u16],
    biases: &mut [u16],
) -> Result<(), ShapeError> {
    reorder_int4(w, packed, scales, biases, true)
}

/// The inverse of [`int4_to_panels`]: `w` is in panels, the outputs row-major.
pub fn int4_from_panels(
    w: Int4Matrix<'_>,
    packed: &mut [u8],
    scales: &mut [u16],
    biases: &mut [u16],
) -> Result<(), ShapeError> {
    reorder_int4(w, packed, scales, biases, false)
}

fn reorder_int4(
    w: Int4Matrix<'_>,
    packed: &mut [u8],
    scales: &mut [u16],
    biases: &mut [u16],
    to_panels: bool,
) -> Result<(), ShapeError> {
    let groups = int4_weights(&w)?;
    int4_weights(&Int4Matrix { packed, scales, biases, ..w })?;
    reorder_bytes(w.rows, w.cols / 2, GROUP_BYTES, w.packed, packed, to_panels);
    reorder_groups(w.rows, groups, w.scales, scales, to_panels);
    reorder_groups(w.rows, groups, w.biases, biases, to_panels);
    Ok(())
}

/// Lays out the row-major int8 matrix `w` in panels: `codes` and `scales` take as many elements
/// as `w`'s.
pub fn int8_to_panels(w: Int8Matrix<'_>, codes: &mut [i8], scales: &mut [u16]) -> Result<(), ShapeError> {
    reorder_int8(w, codes, scales, true)
}

/// The inverse of [`int8_to_panels`]: `w` is in panels, the outputs row-major.
pub fn int8_from_panels(w: Int8Matrix<'_>, codes: &mut [i8], scales: &mut [u16]) -> Result<(), ShapeError> {
    reorder_int8(w, codes, scales, false)
}

fn reorder_int8(w: Int8Matrix<'_>, codes: &mut [i8], scales: &mut [u16], to_panels: bool) -> Result<(), ShapeError> {
    let groups = int8_weights(&w)?;
    int8_weights(&Int8Matrix { codes, scales, ..w })?;
    reorder_bytes(w.rows, w.cols, GROUP_SIZE, w.codes, codes, to_panels);
    reorder_groups(w.rows, groups, w.scales, scales, to_panels);
    Ok(())
}

/// `out = x W^T` for int4 `W` laid out in panels ([`int4_to_panels`]): `x` is `[tokens, cols]`,
/// `out` `[tokens, rows]`. The numbers of [`crate::matmul_int4`] over the row-major matrix, up to
/// f32's precision: the activations are carried in three int8 parts, to about 2^-24 of each
/// group's largest magnitude.
pub fn matmul_int4_panels(
    isa: Isa,
    pool: &Pool,
    x: &[f32],
    tokens: usize,
    w: Int4Matrix<'_>,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    int4_weights(&w)?;
    product(isa, pool, x, tokens, Panels::Int4(&w), Activations::Exact, out)
}

/// `out = x W^T` for int8 `W` laid out in panels ([`int8_to_panels`]), as
/// [`matmul_int4_panels`]: the numbers of [`crate::matmul_int8`].
pub fn matmul_int8_panels(
    isa: Isa,
    pool: &Pool,
    x: &[f32],
    tokens: usize,
    w: Int8Matrix<'_>,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    int8_weights(&w)?;
    product(isa, pool, x, tokens, Panels::Int8(&w), Activations::Exact, out)
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
    int4_weights(&w)?;
    product(isa, pool, x, tokens, Panels::Int4(&w), Activations::Int8, out)
}

/// `out = round_int8(x) W^T` for int8 `W` laid out in panels ([`int8_to_panels`]), as
/// [`matmul_int4_panels_q8`]: the numbers of [`crate::matmul_int8_q8`].
pub fn matmul_int8_panels_q8(
    isa: Isa,
    pool: &Pool,
    x: &[f32],
    tokens: usize,
    w: Int8Matrix<'_>,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    int8_weights(&w)?;
    product(isa, pool, x, tokens, Panels::Int8(&w), Activations::Int8, out)
}

/// A matrix in panels, of either format.
#[derive(Clone, Copy)]
enum Panels<'a> {
    Int4(&'a Int4Matrix<'a>),
    Int8(&'a Int8Matrix<'a>),
}

impl Panels<'_> {
    fn shape(&self) -> (usize, usize) {
        match self {
            Panels::Int4(w) => (w.rows, w.cols),
            Panels::Int8(w) => (w.rows, w.cols),
        }
    }
}

/// The product of either format over either activations, its shapes checked but `x` and `out`.
fn product(
    isa: Isa,
    pool: &Pool,
    x: &[f32],
    tokens: usize,
    w: Panels<'_>,
    activations: Activations,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let (rows, cols) = w.shape();
    check_len("x", x.len(), tokens * cols)?;
    check_len("output", out.len(), tokens * rows)?;
    if tokens == 0 || rows == 0 {
        return Ok(());
    }
    let min_rows = MIN_ROWS_PER_TASK.next_multiple_of(PANEL_ROWS);
    let integer_path = match activations {
        Activations::Int8 => true,
        Activations::Exact => tokens <= exact_integer_max_tokens(isa, matches!(w, Panels::Int4(_))),
    };
    let vnni = isa == Isa::Avx512Vnni && isa.is_supported();
    // Off VNNI, the same integer products in 256-bit registers (`avx2`).
    if integer_path && (vnni || (isa.has_avx2() && isa.is_supported())) {
        PREPARED.with(|prepared| {
            let int4 = matches!(w, Panels::Int4(_));
            let key = [
                tokens as u64,
                cols as u64,
                u64::from(int4),
                u64::from(activations == Activations::Exact),
                u64::from(vnni),
            ];
            if !prepared.source.matches(&key, &[x]) {
                prepared.fill(x, tokens, cols, int4, activations, vnni);
                prepared.source.remember(&key, &[x]);
            }
            let prepared = &*prepared;
            for_each_row_run(pool, rows, PANEL_ROWS, min_rows, out, &|run, out| {
                // SAFETY: the CPU has AVX-512 VNNI, or else AVX2, FMA and F16C (checked above);
                // the tokens were laid out for these columns, this format and these activations;
                // `run` starts on a panel and these rows' columns of `out` are this task's alone.
                unsafe {
                    if vnni {
                        vnni_run(prepared, tokens, w, run, out)
                    } else {
                        avx2_run(prepared, tokens, w, run, out)
                    }
                }
            });
        });
        return Ok(());
    }
    if activations == Activations::Exact && isa.has_avx2() && isa.is_supported() {
        gemm_from_panels(isa, pool, x, w, out);
        return Ok(());
    }
    let mut rows_of = |x: &[f32]| {
        for_each_row_run(pool, rows, PANEL_ROWS, min_rows, out, &|run, out| row_major_run(isa, x, tokens, w, run, out))
    };
    match activations {
        Activations::Exact => rows_of(x),
        Activations::Int8 => crate::matmul::over_rounded(isa, x, rows_of),
    }
    Ok(())
}

/// The exact product of many tokens: the exact kernels' blocked matrix-matrix product, which
/// takes its weights 16 rows side by side, as the panels hold them: each panel's groups are
/// converted to f32 in place, a register of 16 rows at a time.
fn gemm_from_panels(isa: Isa, pool: &Pool, x: &[f32], w: Panels<'_>, out: &mut [f32]) {
    let (rows, cols) = w.shape();
    let pack = |row0, k0, dst: &mut [f32]| {
        // SAFETY: the caller checked that the CPU has AVX2 (and AVX-512 where it is used); `row0`
        // starts a panel (the product splits its rows at multiples of 16) and `dst` holds whole
        // groups of it.
        unsafe {
            if isa.has_avx512() {
                x86::panel_to_f32(w, row0, k0, dst)
            } else {
                avx2::panel_to_f32(w, row0, k0, dst)
            }
        }
    };
    let ahead = |row0, k0, columns| {
        // The panel's groups `g0..g1`, laid out as `panel_to_f32` reads them: each group's rows
        // side by side, the panel's groups one after another.
        let (groups, width) = (cols / GROUP_SIZE, PANEL_ROWS.min(rows - row0));
        let (g0, g1) = (k0 / GROUP_SIZE, (k0 + columns) / GROUP_SIZE);
        let scales = row0 * groups + g0 * width..row0 * groups + g1 * width;
        match w {
            Panels::Int4(w) => {
                let at = row0 * cols / 2;
                crate::gemm::prefetch(&w.packed[at + g0 * GROUP_BYTES * width..at + g1 * GROUP_BYTES * width]);
                crate::gemm::prefetch(&w.scales[scales.clone()]);
                crate::gemm::prefetch(&w.biases[scales]);
            }
            Panels::Int8(w) => {
                let at = row0 * cols;
                crate::gemm::prefetch(&w.codes[at + g0 * GROUP_SIZE * width..at + g1 * GROUP_SIZE * width]);
                crate::gemm::prefetch(&w.scales[scales]);
            }
        }
    };
    let weights = crate::gemm::Weights { pack: crate::gemm::Pack::Panels(&pack), ahead: &ahead };
    crate::gemm::gemm(isa, pool, x, cols, rows, out, weights);
}

/// Row-major copies of a run of panels, and the run's products, per task.
#[derive(Default)]
struct RowMajor {
    packed: Vec<u8>,
    codes: Vec<i8>,
    scales: Vec<u16>,
    biases: Vec<u16>,
    out: Vec<f32>,
}

crate::scratch::footprint!(RowMajor: packed, codes, scales, biases, out);

static ROW_MAJOR: Scratch<RowMajor> = Scratch::new();

/// Rows `run` (whole panels) of the product over the activations `x` (rounded already where the
/// product rounds them), through the exact kernels on a row-major copy of them.
fn row_major_run(isa: Isa, x: &[f32], tokens: usize, w: Panels<'_>, run: std::ops::Range<usize>, out: &SendPtr) {
    static ONE_THREAD: std::sync::OnceLock<Pool> = std::sync::OnceLock::new();
    let one = ONE_THREAD.get_or_init(|| Pool::new(1));
    let (all_rows, cols) = w.shape();
    let (groups, rows) = (cols / GROUP_SIZE, run.len());
    let shapes = "a run's shapes agree";
    // The run's panels are a matrix of their own in the panel layout: the whole panels before its
    // last one are full, as in `w`.
    ROW_MAJOR.with(|s| {
        s.scales.resize(rows * groups, 0);
        s.out.resize(tokens * rows, 0.0);
        let sg = run.start * groups..run.end * groups;
        match w {
            Panels::Int4(w) => {
                let half = cols / 2;
                s.packed.resize(rows * half, 0);
                s.biases.resize(rows * groups, 0);
                let panels = Int4Matrix {
                    rows,
                    cols,
                    packed: &w.packed[run.start * half..run.end * half],
                    scales: &w.scales[sg.clone()],
                    biases: &w.biases[sg],
                };
                int4_from_panels(panels, &mut s.packed, &mut s.scales, &mut s.biases).expect(shapes);
                let m = Int4Matrix { rows, cols, packed: &s.packed, scales: &s.scales, biases: &s.biases };
                crate::matmul_int4(isa, one, x, tokens, m, &mut s.out).expect(shapes);
            }
            Panels::Int8(w) => {
                s.codes.resize(rows * cols, 0);
                let panels =
                    Int8Matrix { rows, cols, codes: &w.codes[run.start * cols..run.end * cols], scales: &w.scales[sg] };
                int8_from_panels(panels, &mut s.codes, &mut s.scales).expect(shapes);
                let m = Int8Matrix { rows, cols, codes: &s.codes, scales: &s.scales };
                crate::matmul_int8(isa, one, x, tokens, m, &mut s.out).expect(shapes);
            }
        }
        for t in 0..tokens {
            // SAFETY: these rows' columns of `out` (`[tokens, all_rows]`) are this task's alone.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(t * all_rows + run.start), rows) };
            dst.copy_from_slice(&s.out[t * rows..(t + 1) * rows]);
        }
    });
}

/// Tokens laid out for the panels, per token and group of 32 activations.
///
/// Each group is carried as int8 parts, 32 codes each, in the order a chunk's bytes meet them
/// (int4: for each chunk of four bytes, the four activations of their low nibbles, then the four
/// of their high ones; int8: as they are), part after part. Part 0 is the activations rounded in
/// steps of the group's largest magnitude / 127; each further part what the parts before left
/// over, in steps [`PART_RATIO`] times finer. Activations rounded to int8 ([`Activations::Int8`])
/// are part 0 alone; exact ones ([`Activations::Exact`]) take [`EXACT_PARTS`], which carry them
/// to `0.5 / 127 / 254^2` (about 2^-24) of the group's largest magnitude: f32's own precision.
///
/// Beside the codes: the group's step; the factor of an int4 group's bias (the step times the
/// codes' sum when rounded, the exact sum of the activations when exact); and for int8 weights,
/// per part, -128 times its codes' sum (they are multiplied as unsigned bytes, code + 128: the
/// sums start from this, so the offset is taken back in integers).
#[derive(Default)]
struct Prepared {
    /// What the rest was prepared from, for calls that may reuse it ([`crate::reuse`]).
    source: crate::reuse::Source,
    parts: usize,
    codes: Vec<i8>,
    steps: Vec<f32>,
    sums: Vec<f32>,
    starts: Vec<i32>,
}

crate::scratch::footprint!(Prepared: source, codes, steps, sums, starts);

impl Prepared {
    /// The block of tokens from `first` (of `cols` columns each).
    fn block(&self, first: usize, cols: usize) -> Block {
        let (groups, parts) = (cols / GROUP_SIZE, self.parts);
        Block {
            codes: self.codes[first * parts * cols..].as_ptr(),
            steps: self.steps[first * groups..].as_ptr(),
            sums: self.sums[first * groups..].as_ptr(),
            starts: self.starts[first * groups * parts..].as_ptr(),
            cols,
        }
    }

    /// Lays out `tokens` tokens of `k` columns (`x`); `vnni` when the CPU has AVX-512 VNNI (the
    /// same numbers either way but for the order of an exact group's sum).
    fn fill(&mut self, x: &[f32], tokens: usize, k: usize, int4: bool, activations: Activations, vnni: bool) {
        let groups = k / GROUP_SIZE;
        let parts = match activations {
            Activations::Int8 => 1,
            Activations::Exact => EXACT_PARTS,
        };
        self.parts = parts;
        self.codes.resize(tokens * k * parts, 0);
        self.steps.resize(tokens * groups, 0.0);
        self.sums.resize(tokens * groups, 0.0);
        self.starts.resize(tokens * groups * parts, 0);
        for (i, src) in x.chunks_exact(GROUP_SIZE).enumerate() {
            let codes = &mut self.codes[i * parts * GROUP_SIZE..(i + 1) * parts * GROUP_SIZE];
            let starts = &mut self.starts[i * parts..(i + 1) * parts];
            let (step, sum) = if vnni {
                // SAFETY: the caller checked that the CPU has AVX-512 VNNI.
                unsafe { x86::split_group(src, codes, starts, int4) }
            } else {
                // SAFETY: the caller checked that the CPU has AVX2 (this path runs only there).
                unsafe { avx2::split_group(src, codes, starts, int4) }
            };
            self.steps[i] = step;
            self.sums[i] = sum;
        }
    }
}

static PREPARED: Scratch<Prepared> = Scratch::new();

/// Parts per group of exact activations (see [`Prepared`]).
const EXACT_PARTS: usize = 3;

/// How much finer each part's step is than the one before: the largest that keeps a remainder
/// of at most half a step, times this, within int8's symmetric range.
const PART_RATIO: f32 = 254.0;

/// Tokens per block: one f32 accumulator each, beside the panel's eight registers of codes.
const TOKEN_BLOCK: usize = 8;

/// Calls of up to this many tokens over exact activations take the VNNI path; longer ones (a
/// prefill chunk) the exact kernels' blocked matrix-matrix product, converting the weights
/// straight from the panels: its register tile reuses what it loads across more multiply-adds
/// than the three parts' integer products (kernels bench: it is the faster from 64 tokens on).
const EXACT_VNNI_MAX_TOKENS: usize = 16;

/// Calls of up to this many tokens over exact activations take the AVX2 integer products for
/// int8 panels (the head); longer ones the blocked product. Without `vpdpbusd` the three parts
/// cost three times the `vpmaddubsw` and `vpmaddwd` of one, so the blocked product's f32 tiles
/// win from fewer tokens than on VNNI: on an AVX2 EPYC the two cost about the same at four
/// tokens and the blocked product wins beyond (kernels bench, docs/performance.md).
const EXACT_AVX2_INT8_MAX_TOKENS: usize = 4;

/// The same for int4 panels, whose AVX2 kernel adds a group's eight `vpmaddubsw` in i16 and
/// widens once per group and part: on the AVX2 EPYC its three parts beat the blocked product at
/// eight tokens and lose at sixteen (`panel_rate`, docs/performance.md).
const EXACT_AVX2_INT4_MAX_TOKENS: usize = 8;

/// The most tokens a call over exact activations multiplies through the integer products.
fn exact_integer_max_tokens(isa: Isa, int4: bool) -> usize {
    match (isa == Isa::Avx512Vnni, int4) {
        (true, _) => EXACT_VNNI_MAX_TOKENS,
        (false, true) => EXACT_AVX2_INT4_MAX_TOKENS,
        (false, false) => EXACT_AVX2_INT8_MAX_TOKENS,
    }
}

/// A block of prepared tokens: token `t`'s parts from `codes + t * parts * cols`, its steps and
/// sums from `steps + t * groups` and `sums + t * groups`, its starts from
/// `starts + t * groups * parts`.
struct Block {
    codes: *const i8,
    steps: *const f32,
    sums: *const f32,
    starts: *const i32,
    cols: usize,
}

impl Block {
    /// Token `t`'s `parts` parts of group `g`, 32 codes each, as words of four codes.
    ///
    /// # Safety
    /// The block holds token `t` in `parts` parts and `g` is one of its groups.
    #[inline(always)]
    unsafe fn group_codes(&self, t: usize, g: usize, parts: usize) -> *const i32 {
        self.codes.add((t * self.cols + g * GROUP_SIZE) * parts) as *const i32
    }
}

/// Rows `run` of the product, on the VNNI path.
///
/// # Safety
/// AVX-512 VNNI; `prepared` laid out for `tokens` tokens of `w`'s columns and format; `run`
/// starts on a panel; these rows' columns of `out` (`[tokens, rows]`) are the caller's alone.
unsafe fn vnni_run(prepared: &Prepared, tokens: usize, w: Panels<'_>, run: std::ops::Range<usize>, out: &SendPtr) {
    let (rows, cols) = w.shape();
    for row0 in run.clone().step_by(PANEL_ROWS) {
        let width = PANEL_ROWS.min(rows - row0);
        for first in (0..tokens).step_by(TOKEN_BLOCK) {
            let count = TOKEN_BLOCK.min(tokens - first);
            let block = prepared.block(first, cols);
            // SAFETY: as this function's; `block` holds `count` tokens from `first`.
            unsafe { x86::panel(count, prepared.parts, &block, w, row0, width, out.0.add(first * rows), rows) };
        }
    }
}

/// Rows `run` of the product on the AVX2 path: each panel as two halves of eight rows.
///
/// # Safety
/// AVX2, FMA and F16C; as [`vnni_run`]'s otherwise.
unsafe fn avx2_run(prepared: &Prepared, tokens: usize, w: Panels<'_>, run: std::ops::Range<usize>, out: &SendPtr) {
    let (rows, cols) = w.shape();
    let size = avx2::block_size(prepared.parts);
    for row0 in run.clone().step_by(PANEL_ROWS) {
        let width = PANEL_ROWS.min(rows - row0);
        for half in 0..width.div_ceil(PANEL_ROWS / 2) {
            for first in (0..tokens).step_by(size) {
                let count = size.min(tokens - first);
                let block = prepared.block(first, cols);
                // SAFETY: as this function's; `block` holds `count` tokens from `first`, and the
                // half has rows.
                unsafe {
                    avx2::half_panel(count, prepared.parts, &block, w, row0, width, half, out.0.add(first * rows), rows)
                };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(not(target_arch = "x86_64"))]
mod avx2 {
    use super::{Block, Panels};

    pub(super) const TOKEN_BLOCK: usize = 4;

    pub(super) fn block_size(_: usize) -> usize {
        TOKEN_BLOCK
    }

    pub(super) unsafe fn panel_to_f32(_: Panels<'_>, _: usize, _: usize, _: &mut [f32]) {
        unreachable!("the AVX2 path is never chosen off x86-64")
    }

    pub(super) unsafe fn split_group(_: &[f32], _: &mut [i8], _: &mut [i32], _: bool) -> (f32, f32) {
        unreachable!("the AVX2 path is never chosen off x86-64")
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn half_panel(
        _: usize,
        _: usize,
        _: &Block,
        _: Panels<'_>,
        _: usize,
        _: usize,
        _: usize,
        _: *mut f32,
        _: usize,
    ) {
        unreachable!("the AVX2 path is never chosen off x86-64")
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Block, Int4Matrix, Int8Matrix, Panels, GROUP_BYTES, GROUP_SIZE, PANEL_CHUNK, PANEL_ROWS, PART_RATIO};
    use std::arch::x86_64::*;

    /// Writes one group (`src`, 32 values) as `starts.len()` int8 parts (see
    /// [`super::Prepared`]: `codes` takes 32 per part) in the panels' order for int4 weights
    /// when `int4`, else as they are; for int8 weights each part's start too (int4 weights leave
    /// `starts` as it is). Returns the group's step and the factor of an int4 group's bias.
    ///
    /// # Safety
    /// AVX-512F, BW and VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn split_group(src: &[f32], codes: &mut [i8], starts: &mut [i32], int4: bool) -> (f32, f32) {
        let parts = starts.len();
        debug_assert!(src.len() == GROUP_SIZE && codes.len() == parts * GROUP_SIZE && parts > 0);
        let (lo, hi) = (_mm512_loadu_ps(src.as_ptr()), _mm512_loadu_ps(src.as_ptr().add(16)));
        let (step, inv) = crate::q8::x86::int8_step(lo, hi);
        // The values in the order of the output bytes first, so that each part is converted and
        // stored as it comes. For int4, output byte 8c + 4h + j is element 8c + 2j + h: per chunk
        // c, the even elements (low nibbles) and then the odd ones (high nibbles); indices from
        // 16 select `hi`.
        let (mut a, mut b) = if int4 {
            let first = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
            let second = _mm512_add_epi32(first, _mm512_set1_epi32(16));
            (_mm512_permutex2var_ps(lo, first, hi), _mm512_permutex2var_ps(lo, second, hi))
        } else {
            (lo, hi)
        };
        // Each half in steps of the current part; what rounding leaves goes on to the next.
        (a, b) = (_mm512_mul_ps(a, inv), _mm512_mul_ps(b, inv));
        let finer = _mm512_set1_ps(PART_RATIO);
        let mut codes_sum = 0;
        let out = codes.as_mut_ptr() as *mut __m128i;
        for (p, start) in starts.iter_mut().enumerate() {
            // Rounded to nearest, ties to even (the default rounding mode), as `round_int8`.
            let (qa, qb) = (_mm512_cvtps_epi32(a), _mm512_cvtps_epi32(b));
            _mm_storeu_si128(out.add(2 * p), _mm512_cvtsepi32_epi8(qa));
            _mm_storeu_si128(out.add(2 * p + 1), _mm512_cvtsepi32_epi8(qb));
            if !int4 || parts == 1 {
                let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
                *start = -128 * sum;
                codes_sum = sum;
            }
            if p + 1 < parts {
                a = _mm512_mul_ps(_mm512_sub_ps(a, _mm512_cvtepi32_ps(qa)), finer);
                b = _mm512_mul_ps(_mm512_sub_ps(b, _mm512_cvtepi32_ps(qb)), finer);
            }
        }
        let bias_factor = match (int4, parts) {
            (false, _) => 0.0,
            (true, 1) => step * codes_sum as f32,
            (true, _) => _mm512_reduce_add_ps(_mm512_add_ps(lo, hi)),
        };
        (step, bias_factor)
    }

    /// The panel of `width` rows from `row0` times `count` (1..=8) tokens of `block`, each
    /// carried as `parts` (1 or 3) int8 parts, written to `out[t * stride + row0 + r]`.
    ///
    /// # Safety
    /// AVX-512 VNNI; `row0` starts a panel of `w`; `block` holds `count` tokens prepared for `w`'s
    /// columns and format in `parts` parts; `out` valid for those elements.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)] // the panel, the tokens, and where the sums go
    pub unsafe fn panel(
        count: usize,
        parts: usize,
        block: &Block,
        w: Panels<'_>,
        row0: usize,
        width: usize,
        out: *mut f32,
        stride: usize,
    ) {
        macro_rules! blocks {
            ($p:literal; $($r:literal),+) => {
                match (count, w) {
                    $(($r, Panels::Int4(w)) => int4_panel::<$r, $p>(block, w, row0, width, out, stride),)+
                    $(($r, Panels::Int8(w)) => int8_panel::<$r, $p>(block, w, row0, width, out, stride),)+
                    (other, _) => unreachable!("a token block of {other} tokens"),
                }
            };
        }
        // The literal lists below are the block's size and the parts: a change of either
        // constant fails here.
        const _: () = assert!(super::TOKEN_BLOCK == 8 && super::EXACT_PARTS == 3);
        match parts {
            1 => blocks!(1; 1, 2, 3, 4, 5, 6, 7, 8),
            3 => blocks!(3; 1, 2, 3, 4, 5, 6, 7, 8),
            other => unreachable!("activations in {other} parts"),
        }
    }

    /// Columns `k0..k0 + dst.len() / 16` (whole groups) of the panel starting at row `row0`, as
    /// f32 by the format's definition, column by column: `dst[c * 16 + r]` (zeros past the
    /// panel's rows). Lane `r` of a chunk's register is row `r`, so each column is a shift and
    /// a mask (int4) or a sign extension (int8) of the register, converted and scaled per lane.
    ///
    /// # Safety
    /// AVX-512F and BW; `row0` starts a panel of `w`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn panel_to_f32(w: Panels<'_>, row0: usize, k0: usize, dst: &mut [f32]) {
        let (rows, cols) = w.shape();
        let groups = cols / GROUP_SIZE;
        let width = PANEL_ROWS.min(rows - row0);
        let (lanes, chunk_bytes) = masks(width);
        debug_assert!(row0.is_multiple_of(PANEL_ROWS) && k0.is_multiple_of(GROUP_SIZE));
        debug_assert!(dst.len().is_multiple_of(GROUP_SIZE * PANEL_ROWS) && k0 + dst.len() / PANEL_ROWS <= cols);
        let out = dst.as_mut_ptr();
        for (i, g) in (k0 / GROUP_SIZE..(k0 + dst.len() / PANEL_ROWS) / GROUP_SIZE).enumerate() {
            let column = |c: usize| out.add((i * GROUP_SIZE + c) * PANEL_ROWS);
            let at = row0 * groups + g * width;
            match w {
                Panels::Int4(w) => {
                    let s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, w.scales.as_ptr().add(at) as *const i16));
                    let b = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, w.biases.as_ptr().add(at) as *const i16));
                    let group = w.packed.as_ptr().add(row0 * cols / 2 + g * GROUP_BYTES * width) as *const i8;
                    let nibble = _mm512_set1_epi32(0x0f);
                    for c in 0..GROUP_BYTES / PANEL_CHUNK {
                        let v = _mm512_maskz_loadu_epi8(chunk_bytes, group.add(c * PANEL_CHUNK * width));
                        // Element 8c + q is nibble q of the lane's four bytes (element 2i low).
                        macro_rules! nibbles {
                            ($($q:literal),+) => {$(
                                let q = _mm512_and_si512(_mm512_srli_epi32::<{ 4 * $q }>(v), nibble);
                                _mm512_storeu_ps(column(8 * c + $q), _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s, b));
                            )+};
                        }
                        nibbles!(0, 1, 2, 3, 4, 5, 6, 7);
                    }
                }
                Panels::Int8(w) => {
                    let s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, w.scales.as_ptr().add(at) as *const i16));
                    let group = w.codes.as_ptr().add(row0 * cols + g * GROUP_SIZE * width);
                    for c in 0..GROUP_SIZE / PANEL_CHUNK {
                        let v = _mm512_maskz_loadu_epi8(chunk_bytes, group.add(c * PANEL_CHUNK * width));
                        // Element 4c + q is byte q of the lane, sign-extended.
                        macro_rules! bytes {
                            ($($q:literal),+) => {$(
                                let q = _mm512_srai_epi32::<24>(_mm512_slli_epi32::<{ 24 - 8 * $q }>(v));
                                _mm512_storeu_ps(column(4 * c + $q), _mm512_mul_ps(_mm512_cvtepi32_ps(q), s));
                            )+};
                        }
                        bytes!(0, 1, 2, 3);
                    }
                }
            }
        }
    }

    /// The lanes of a panel of `width` rows, and the bytes of one of its chunks.
    fn masks(width: usize) -> (__mmask16, __mmask64) {
        if width == PANEL_ROWS {
            (!0, !0)
        } else {
            ((1 << width) - 1, (1 << (PANEL_CHUNK * width)) - 1)
        }
    }

    /// How far ahead of the group being multiplied the panels are prefetched: sixteen int4
    /// groups of a full panel (eight int8 ones). A panel's group is read once for every token
    /// of the call, so a call of several tokens spends longer on each byte than a one-token
    /// call, and the one-token products' distance (a quarter of this) no longer hid the
    /// memory's latency: the kernels bench's steps of one and of eight tokens both ran faster
    /// at this distance (docs/performance.md, run 34).
    const PANEL_PREFETCH_AHEAD: usize = 4096;

    /// Asks for the `lines` cache lines of a group's codes [`PANEL_PREFETCH_AHEAD`] ahead.
    #[inline(always)]
    unsafe fn prefetch(group: *const i8, lines: usize) {
        for l in 0..lines {
            _mm_prefetch::<_MM_HINT_T0>(group.wrapping_add(PANEL_PREFETCH_AHEAD + 64 * l));
        }
    }

    /// `d` (the parts after `p`, finest first, already combined) with part `p`'s integer sums:
    /// `sums + d / PART_RATIO`, or the sums alone for the finest part.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[inline]
    unsafe fn combine<const P: usize>(p: usize, sums: __m512i, d: __m512) -> __m512 {
        let sums = _mm512_cvtepi32_ps(sums);
        if p + 1 == P {
            sums
        } else {
            _mm512_fmadd_ps(d, _mm512_set1_ps(1.0 / PART_RATIO), sums)
        }
    }

    /// An int4 panel times `R` tokens in `P` parts: per group, the chunks' low and high nibbles
    /// as unsigned bytes (once for all the tokens), one `vpdpbusd` per four codes of each row
    /// and part, the parts' integer sums combined and scaled once for the 16 rows.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn int4_panel<const R: usize, const P: usize>(
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
        let (lanes, chunk_bytes) = masks(width);
        let nibble = _mm512_set1_epi8(0x0f);
        let mut acc = [_mm512_setzero_ps(); R];
        for g in 0..groups {
            let group = bytes.add(g * GROUP_BYTES * width);
            prefetch(group, 4);
            let v: [__m512i; 4] =
                std::array::from_fn(|c| _mm512_maskz_loadu_epi8(chunk_bytes, group.add(c * PANEL_CHUNK * width)));
            let lo: [__m512i; 4] = std::array::from_fn(|c| _mm512_and_si512(v[c], nibble));
            let hi: [__m512i; 4] = std::array::from_fn(|c| _mm512_and_si512(_mm512_srli_epi16::<4>(v[c]), nibble));
            let s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, scales.add(g * width)));
            let b = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, biases.add(g * width)));
            for (t, acc) in acc.iter_mut().enumerate() {
                let codes = block.group_codes(t, g, P);
                let mut d = _mm512_setzero_ps();
                for p in (0..P).rev() {
                    let a = codes.add(p * GROUP_SIZE / 4);
                    // Two chains of four: the even elements' products and the odd ones'.
                    let mut even = _mm512_setzero_si512();
                    let mut odd = _mm512_setzero_si512();
                    for c in 0..4 {
                        even = _mm512_dpbusd_epi32(even, lo[c], _mm512_set1_epi32(a.add(2 * c).read_unaligned()));
                        odd = _mm512_dpbusd_epi32(odd, hi[c], _mm512_set1_epi32(a.add(2 * c + 1).read_unaligned()));
                    }
                    d = combine::<P>(p, _mm512_add_epi32(even, odd), d);
                }
                let at = t * groups + g;
                *acc = _mm512_fmadd_ps(d, _mm512_mul_ps(s, _mm512_set1_ps(*block.steps.add(at))), *acc);
                *acc = _mm512_fmadd_ps(b, _mm512_set1_ps(*block.sums.add(at)), *acc);
            }
        }
        for (t, acc) in acc.into_iter().enumerate() {
            _mm512_mask_storeu_ps(out.add(t * stride + row0), lanes, acc);
        }
    }

    /// An int8 panel times `R` tokens in `P` parts, as [`int4_panel`]: the codes multiplied as
    /// unsigned bytes, code + 128, each part's sums starting from its start (which takes the
    /// 128s' products back).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn int8_panel<const R: usize, const P: usize>(
        block: &Block,
        w: &Int8Matrix<'_>,
        row0: usize,
        width: usize,
        out: *mut f32,
        stride: usize,
    ) {
        let groups = w.cols / GROUP_SIZE;
        let codes = w.codes.as_ptr().add(row0 * w.cols);
        let scales = w.scales.as_ptr().add(row0 * groups) as *const i16;
        let (lanes, chunk_bytes) = masks(width);
        let offset = _mm512_set1_epi8(-128);
        let mut acc = [_mm512_setzero_ps(); R];
        for g in 0..groups {
            let group = codes.add(g * GROUP_SIZE * width);
            prefetch(group, 8);
            let v: [__m512i; 8] = std::array::from_fn(|c| {
                _mm512_xor_si512(_mm512_maskz_loadu_epi8(chunk_bytes, group.add(c * PANEL_CHUNK * width)), offset)
            });
            let s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, scales.add(g * width)));
            for (t, acc) in acc.iter_mut().enumerate() {
                let at = t * groups + g;
                let parts = block.group_codes(t, g, P);
                let mut d = _mm512_setzero_ps();
                for p in (0..P).rev() {
                    let a = parts.add(p * GROUP_SIZE / 4);
                    let mut first = _mm512_set1_epi32(*block.starts.add(at * P + p));
                    let mut second = _mm512_setzero_si512();
                    for c in 0..4 {
                        first = _mm512_dpbusd_epi32(first, v[c], _mm512_set1_epi32(a.add(c).read_unaligned()));
                        second =
                            _mm512_dpbusd_epi32(second, v[c + 4], _mm512_set1_epi32(a.add(c + 4).read_unaligned()));
                    }
                    d = combine::<P>(p, _mm512_add_epi32(first, second), d);
                }
                *acc = _mm512_fmadd_ps(d, _mm512_mul_ps(s, _mm512_set1_ps(*block.steps.add(at))), *acc);
            }
        }
        for (t, acc) in acc.into_iter().enumerate() {
            _mm512_mask_storeu_ps(out.add(t * stride + row0), lanes, acc);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    use super::{Block, Panels};

    pub unsafe fn split_group(_: &[f32], _: &mut [i8], _: &mut [i32], _: bool) -> (f32, f32) {
        unreachable!("the VNNI path is never chosen off x86-64")
    }
    pub unsafe fn panel_to_f32(_: Panels<'_>, _: usize, _: usize, _: &mut [f32]) {
        unreachable!("the AVX-512 path is never chosen off x86-64")
    }
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn panel(_: usize, _: usize, _: &Block, _: Panels<'_>, _: usize, _: usize, _: *mut f32, _: usize) {
        unreachable!("the VNNI path is never chosen off x86-64")
    }
}

#[cfg(test)]
mod tests {
    use super::{EXACT_PARTS, GROUP_SIZE, PART_RATIO};
    use crate::Isa;

    /// A group's parts by their definition (see [`super::Prepared`]), one value at a time.
    fn split_group_definition(src: &[f32], parts: usize, int4: bool) -> (Vec<i8>, Vec<i32>, f32) {
        let (step, inv) = crate::q8::step_of(src);
        let mut a: Vec<f32> = (0..GROUP_SIZE)
            .map(|i| {
                let e = if int4 { i / 8 * 8 + 2 * (i % 4) + i % 8 / 4 } else { i };
                src[e] * inv
            })
            .collect();
        let (mut codes, mut sums) = (Vec::new(), Vec::new());
        for _ in 0..parts {
            let q: Vec<f32> = a.iter().map(|&v| crate::q8::round_even(v)).collect();
            codes.extend(q.iter().map(|&q| q as i8));
            sums.push(q.iter().map(|&q| q as i32).sum());
            a = a.iter().zip(&q).map(|(v, q)| (v - q) * PART_RATIO).collect();
        }
        (codes, sums, step)
    }

    #[test]
    fn every_split_of_a_group_is_its_definition() {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        let isas = Isa::supported();
        for round in 0..400 {
            let scale = [1.0, 40.0, 1e-3, 3e4][round % 4];
            let mut src: Vec<f32> = (0..GROUP_SIZE).map(|_| next() * scale).collect();
            if round % 5 == 0 {
                // Halfway cases: the largest value, 127, makes the step 1.
                src = (0..GROUP_SIZE).map(|i| (i as f32 - 16.0) * 0.5).collect();
                src[3] = 127.0;
            }
            for (parts, int4) in [(1, true), (1, false), (EXACT_PARTS, true), (EXACT_PARTS, false)] {
                let (want, sums, want_step) = split_group_definition(&src, parts, int4);
                for isa in &isas {
                    let mut codes = vec![0i8; parts * GROUP_SIZE];
                    let mut starts = vec![0i32; parts];
                    // SAFETY: each runs only where the CPU has its instructions.
                    let (step, _) = unsafe {
                        match isa {
                            Isa::Avx512Vnni => super::x86::split_group(&src, &mut codes, &mut starts, int4),
                            Isa::Avx2 => super::avx2::split_group(&src, &mut codes, &mut starts, int4),
                            _ => continue,
                        }
                    };
                    assert_eq!(codes, want, "{isa:?} round {round} parts {parts} int4 {int4}");
                    assert_eq!(step, want_step);
                    if !int4 || parts == 1 {
                        let want: Vec<i32> = sums.iter().map(|s| -128 * s).collect();
                        assert_eq!(starts, want, "{isa:?} round {round} parts {parts}");
                    }
                }
            }
        }
    }
}
