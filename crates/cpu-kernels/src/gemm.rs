//! `out = x W^T` for calls of many tokens (a prefill chunk, a large batch of decodes): a blocked
//! matrix-matrix product in register tiles.
//!
//! The per-token and token-block kernels of [`crate::matmul`] convert each stored weight in
//! registers for every (block of) token(s), which is right when the call is bound by reading the
//! weights. With many tokens the call is bound by multiply-adds instead, and what decides its
//! speed is how many of them each load feeds. So here each task converts its weight rows to f32
//! once per call (the format's own dequantization: f16 widened, int4 `scale * q + bias`, int8
//! `scale * q`) into panels laid out column by column, [`PANEL_WIDTH`] rows side by side, and
//! multiplies them as outer products: per column, two vectors of weights and one broadcast
//! activation per token feed `2 x TILE_TOKENS` accumulators, which hold a tile of the output and
//! are added into it once per chunk of columns. No horizontal sums, no activation re-packing.
//!
//! A block of panels is [`BLOCK_ROWS`] rows by [`K_CHUNK`] columns, small enough to stay in the
//! core's second-level cache while every token passes over it; a tile's activations (six tokens
//! of one chunk) stay in the first.
//!
//! A call of a dozen tokens takes about as long to read its weights from memory as to multiply
//! them, so the two must overlap: while a chunk is converted, the stored bytes of the chunk after
//! it are prefetched ([`AheadFn`]), and they arrive while this chunk's tiles run. A format whose
//! layout gives panels directly (f16 rows transposed in registers, the int4/int8 panels) packs
//! them without a row-major copy in between.

use crate::matmul::for_each_row_run;
use crate::pool::Pool;
use crate::scratch::Scratch;
use crate::Isa;

/// Weight rows side by side in a panel: two AVX2 vectors.
pub(crate) const PANEL_WIDTH: usize = 16;

/// Tokens per register tile: with two vectors of weights, twelve accumulators.
pub(crate) const TILE_TOKENS: usize = 6;

/// Columns per chunk: a multiple of the int4/int8 group size (32), so a chunk never splits a group.
const K_CHUNK: usize = 256;

/// Rows of a block of panels.
const BLOCK_ROWS: usize = 3 * PANEL_WIDTH;

/// One register tile's operands: `tokens` (1..=6) rows of activations (`x`, `x_stride` apart)
/// times a panel of 16 columns over `depth` steps (step `c`'s 16 weights at `panel + c *
/// panel_stride`), written (or, with `accumulate`, added) to the first `valid` of the 16 outputs
/// in each token's row of `out` (`out_stride` apart).
pub(crate) struct Tile {
    pub panel: *const f32,
    pub panel_stride: usize,
    pub x: *const f32,
    pub x_stride: usize,
    pub depth: usize,
    pub tokens: usize,
    pub out: *mut f32,
    pub out_stride: usize,
    pub valid: usize,
    pub accumulate: bool,
}

/// `pack(row, k0, dst)`: row `row`'s columns `k0..k0 + dst.len()` as f32, by the format's
/// definition.
pub(crate) type PackFn<'a> = dyn Fn(usize, usize, &mut [f32]) + Sync + 'a;

/// `ahead(row, k0, columns)`: asks the memory system, now, for the stored bytes that a later
/// `pack` of row `row` (of the panel starting at `row`, for [`Pack::Panels`]) over columns
/// `k0..k0 + columns` will read, so that they arrive while the current chunk's multiply-adds run.
pub(crate) type AheadFn<'a> = dyn Fn(usize, usize, usize) + Sync + 'a;

/// Asks for every cache line of `bytes` (a prefetch: never faults, never waits for the data).
#[inline]
pub(crate) fn prefetch<T>(bytes: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let (start, len) = (bytes.as_ptr() as *const i8, std::mem::size_of_val(bytes));
        // The line holding the first byte, then every line after it that holds one.
        let first = (start as usize) & 63;
        for line in (0..len + first).step_by(64) {
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(line).wrapping_sub(first)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// A task's buffers: rows as the format converts them, and the same as panels.
#[derive(Default)]
struct Buffers {
    rows: Vec<f32>,
    panels: Vec<f32>,
}

crate::scratch::footprint!(Buffers: rows, panels);

static BUFFERS: Scratch<Buffers> = Scratch::new();

/// `pack(row0, k0, dst)`: rows `row0..row0 + 16` (zeros past the matrix) of columns `k0..k0 +
/// dst.len() / 16` as f32, column by column (`dst[c * 16 + r]`): one of [`gemm`]'s panels, for
/// weights whose own layout gives a panel more cheaply than its rows one by one.
pub(crate) type PanelPackFn<'a> = dyn Fn(usize, usize, &mut [f32]) + Sync + 'a;

/// How a product's weights are converted: a row at a time, or a panel at a time.
#[derive(Clone, Copy)]
pub(crate) enum Pack<'a> {
    Rows(&'a PackFn<'a>),
    Panels(&'a PanelPackFn<'a>),
}

/// A product's weights as [`gemm`] reads them: how they are converted, and how what a
/// conversion will read is asked for ahead of it.
#[derive(Clone, Copy)]
pub(crate) struct Weights<'a> {
    pub pack: Pack<'a>,
    pub ahead: &'a AheadFn<'a>,
}

/// `out[t, r] = x[t, :] · W[r, :]` for `x` `[tokens, k]` and `out` `[tokens, n]`, `W` read
/// through `weights`. `isa` has AVX2 + FMA (the caller checked the CPU runs it); with
/// [`Isa::Avx512`] the tiles are 512 bits wide: two panels (32 rows) by twelve tokens.
pub(crate) fn gemm(isa: Isa, pool: &Pool, x: &[f32], k: usize, n: usize, out: &mut [f32], weights: Weights<'_>) {
    let Weights { pack, ahead } = weights;
    if k == 0 {
        // No columns: every product is an empty sum.
        out.fill(0.0);
        return;
    }
    let tokens = x.len() / k;
    debug_assert!(x.len() == tokens * k && out.len() == tokens * n);
    debug_assert!(isa.has_avx2());
    let wide = isa.has_avx512();
    // A wide tile takes panels in pairs, so its blocks hold an even number of them.
    let (tile_tokens, tile_panels, block_rows_max) =
        if wide { (avx512::TILE_TOKENS, 2, 4 * PANEL_WIDTH) } else { (TILE_TOKENS, 1, BLOCK_ROWS) };
    for_each_row_run(pool, n, PANEL_WIDTH, 2 * PANEL_WIDTH, out, &|run, out_ptr| {
        let (start, end) = (run.start, run.end);
        BUFFERS.with(|buffers| {
            let Buffers { rows: row_buf, panels } = buffers;
            for block in (start..end).step_by(block_rows_max) {
                let block_rows = block_rows_max.min(end - block);
                let panel_count = block_rows.div_ceil(PANEL_WIDTH);
                for k0 in (0..k).step_by(K_CHUNK) {
                    let kc = K_CHUNK.min(k - k0);
                    // As each row (panel) of this chunk is converted, the same row's next chunk
                    // (past the last, the row a block further on) is asked for: a call of few
                    // tokens spends about as long reading its weights from memory as multiplying
                    // them, and without this the two took turns instead of overlapping. Rows read
                    // a chunk at a time are short jumps that the hardware prefetchers do not follow.
                    let ask_next = |row: usize| {
                        if k0 + kc < k {
                            ahead(row, k0 + kc, K_CHUNK.min(k - k0 - kc));
                        } else if row + block_rows_max < end {
                            ahead(row + block_rows_max, 0, K_CHUNK.min(k));
                        }
                    };
                    panels.resize(panel_count * PANEL_WIDTH * kc, 0.0);
                    match pack {
                        Pack::Rows(pack) => {
                            row_buf.resize(panel_count * PANEL_WIDTH * kc, 0.0);
                            for (i, dst) in row_buf.chunks_exact_mut(kc).enumerate() {
                                if i < block_rows {
                                    pack(block + i, k0, dst);
                                    ask_next(block + i);
                                } else {
                                    dst.fill(0.0);
                                }
                            }
                            for (src, dst) in
                                row_buf.chunks_exact(PANEL_WIDTH * kc).zip(panels.chunks_exact_mut(PANEL_WIDTH * kc))
                            {
                                // SAFETY: the caller checked AVX2; both hold one panel of `kc` columns.
                                unsafe { avx2::to_panel(src, kc, dst) };
                            }
                        }
                        Pack::Panels(pack) => {
                            for (p, dst) in panels.chunks_exact_mut(PANEL_WIDTH * kc).enumerate() {
                                pack(block + p * PANEL_WIDTH, k0, dst);
                                ask_next(block + p * PANEL_WIDTH);
                            }
                        }
                    }
                    for (t0, tc) in balanced_tiles(tokens, tile_tokens) {
                        for p in (0..panel_count).step_by(tile_panels) {
                            let pair = tile_panels.min(panel_count - p) == 2;
                            let r0 = block + p * PANEL_WIDTH;
                            let valid = (tile_panels * PANEL_WIDTH).min(end - r0);
                            // SAFETY: the caller checked the ISA; `x` holds `tokens` rows of `k`;
                            // the panels of this block hold `kc` columns each; the tile writes rows
                            // `r0..r0 + valid` of tokens `t0..t0 + tc` of `out` ([tokens, n]): this
                            // task's rows, which no other task writes.
                            unsafe {
                                let tile = Tile {
                                    panel: panels.as_ptr().add(p * PANEL_WIDTH * kc),
                                    panel_stride: PANEL_WIDTH,
                                    x: x.as_ptr().add(t0 * k + k0),
                                    x_stride: k,
                                    depth: kc,
                                    tokens: tc,
                                    out: out_ptr.0.add(t0 * n + r0),
                                    out_stride: n,
                                    valid,
                                    accumulate: k0 > 0,
                                };
                                let second = pair.then(|| panels.as_ptr().add((p + 1) * PANEL_WIDTH * kc));
                                run_tile(wide, &tile, second);
                            }
                        }
                    }
                }
            }
        });
    });
}

/// The tokens in tiles of at most `most` that differ in size by one at most: each tile's first
/// token and size. A last tile of one or two tokens (eight tokens as six and two) would leave most
/// of the FMA units waiting on its few accumulators' latency; four and four keep them busy.
pub(crate) fn balanced_tiles(tokens: usize, most: usize) -> impl Iterator<Item = (usize, usize)> {
    let tiles = tokens.div_ceil(most);
    let (size, larger) = (tokens.checked_div(tiles).unwrap_or(0), tokens.checked_rem(tiles).unwrap_or(0));
    (0..tiles).map(move |i| (i * size + i.min(larger), size + usize::from(i < larger)))
}

/// One register tile: the 512-bit one when `wide` (two panels when `second` is given: its
/// column `c` at `second + c * panel_stride`), else AVX2's (`second` is then `None`).
///
/// # Safety
/// AVX2 and FMA, and AVX-512F when `wide`; the tile's pointers as [`avx2::tile`] needs them, for
/// both panels.
pub(crate) unsafe fn run_tile(wide: bool, tile: &Tile, second: Option<*const f32>) {
    debug_assert!(wide || second.is_none());
    if wide {
        avx512::tile(tile, second)
    } else {
        avx2::tile(tile)
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::{Tile, PANEL_WIDTH, TILE_TOKENS};
    use crate::GROUP_SIZE;
    use std::arch::x86_64::*;

    /// Rows `src` (`PANEL_WIDTH` rows of `kc`) as one panel `dst` (`kc` columns of `PANEL_WIDTH`).
    ///
    /// # Safety
    /// AVX2; both slices `PANEL_WIDTH * kc` long.
    #[target_feature(enable = "avx2")]
    pub unsafe fn to_panel(src: &[f32], kc: usize, dst: &mut [f32]) {
        debug_assert!(src.len() == PANEL_WIDTH * kc && dst.len() == PANEL_WIDTH * kc);
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        let mut c = 0;
        while c + 8 <= kc {
            for half in 0..PANEL_WIDTH / 8 {
                // An 8x8 block: rows `8 * half..`, columns `c..c + 8`, transposed in registers.
                let mut v = [_mm256_setzero_ps(); 8];
                for (i, r) in v.iter_mut().enumerate() {
                    *r = _mm256_loadu_ps(s.add((8 * half + i) * kc + c));
                }
                let t = transpose8(v);
                for (j, col) in t.into_iter().enumerate() {
                    _mm256_storeu_ps(d.add((c + j) * PANEL_WIDTH + 8 * half), col);
                }
            }
            c += 8;
        }
        for col in c..kc {
            for r in 0..PANEL_WIDTH {
                *d.add(col * PANEL_WIDTH + r) = *s.add(r * kc + col);
            }
        }
    }

    /// Rows `row0..row0 + PANEL_WIDTH` of the f16 matrix `data` (`k` columns; rows past
    /// `data`'s end as zeros), columns `k0..k0 + dst.len() / PANEL_WIDTH`, as one f32 panel
    /// `dst`: widened and transposed in registers, eight rows by eight columns at a time, with no
    /// row-major copy in between.
    ///
    /// # Safety
    /// AVX2 and F16C; `data.len()` a multiple of `k`, `row0` one of its rows and the columns within `k`.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn f16_panel(data: &[u16], k: usize, row0: usize, k0: usize, dst: &mut [f32]) {
        let kc = dst.len() / PANEL_WIDTH;
        let rows = (data.len() / k).saturating_sub(row0).min(PANEL_WIDTH);
        debug_assert!(dst.len() == PANEL_WIDTH * kc && k0 + kc <= k && rows > 0);
        let (s, d) = (data.as_ptr().add(row0 * k + k0), dst.as_mut_ptr());
        let mut c = 0;
        while c + 8 <= kc {
            for half in 0..PANEL_WIDTH / 8 {
                let mut v = [_mm256_setzero_ps(); 8];
                for (i, r) in v.iter_mut().enumerate().take(rows.saturating_sub(8 * half)) {
                    *r = _mm256_cvtph_ps(_mm_loadu_si128(s.add((8 * half + i) * k + c) as *const __m128i));
                }
                for (j, col) in transpose8(v).into_iter().enumerate() {
                    _mm256_storeu_ps(d.add((c + j) * PANEL_WIDTH + 8 * half), col);
                }
            }
            c += 8;
        }
        for col in c..kc {
            for r in 0..PANEL_WIDTH {
                let value = if r < rows { half::f16::from_bits(*s.add(r * k + col)).to_f32() } else { 0.0 };
                *d.add(col * PANEL_WIDTH + r) = value;
            }
        }
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn transpose8(v: [__m256; 8]) -> [__m256; 8] {
        let a0 = _mm256_unpacklo_ps(v[0], v[1]);
        let a1 = _mm256_unpackhi_ps(v[0], v[1]);
        let a2 = _mm256_unpacklo_ps(v[2], v[3]);
        let a3 = _mm256_unpackhi_ps(v[2], v[3]);
        let a4 = _mm256_unpacklo_ps(v[4], v[5]);
        let a5 = _mm256_unpackhi_ps(v[4], v[5]);
        let a6 = _mm256_unpacklo_ps(v[6], v[7]);
        let a7 = _mm256_unpackhi_ps(v[6], v[7]);
        let b0 = _mm256_shuffle_ps::<0x44>(a0, a2);
        let b1 = _mm256_shuffle_ps::<0xee>(a0, a2);
        let b2 = _mm256_shuffle_ps::<0x44>(a1, a3);
        let b3 = _mm256_shuffle_ps::<0xee>(a1, a3);
        let b4 = _mm256_shuffle_ps::<0x44>(a4, a6);
        let b5 = _mm256_shuffle_ps::<0xee>(a4, a6);
        let b6 = _mm256_shuffle_ps::<0x44>(a5, a7);
        let b7 = _mm256_shuffle_ps::<0xee>(a5, a7);
        [
            _mm256_permute2f128_ps::<0x20>(b0, b4),
            _mm256_permute2f128_ps::<0x20>(b1, b5),
            _mm256_permute2f128_ps::<0x20>(b2, b6),
            _mm256_permute2f128_ps::<0x20>(b3, b7),
            _mm256_permute2f128_ps::<0x31>(b0, b4),
            _mm256_permute2f128_ps::<0x31>(b1, b5),
            _mm256_permute2f128_ps::<0x31>(b2, b6),
            _mm256_permute2f128_ps::<0x31>(b3, b7),
        ]
    }

    /// Runs one register tile ([`Tile`]).
    ///
    /// # Safety
    /// AVX2 and FMA; the tile's pointers valid for its rows, steps and columns (all 16 of the
    /// panel's at every step).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile(tile: &Tile) {
        let Tile { panel, panel_stride, x, x_stride, depth, tokens, out, out_stride, valid, accumulate } = *tile;
        let acc = match tokens {
            1 => tile_of::<1>(panel, panel_stride, x, x_stride, depth),
            2 => tile_of::<2>(panel, panel_stride, x, x_stride, depth),
            3 => tile_of::<3>(panel, panel_stride, x, x_stride, depth),
            4 => tile_of::<4>(panel, panel_stride, x, x_stride, depth),
            5 => tile_of::<5>(panel, panel_stride, x, x_stride, depth),
            _ => tile_of::<TILE_TOKENS>(panel, panel_stride, x, x_stride, depth),
        };
        for (t, [lo, hi]) in acc.into_iter().enumerate().take(tokens) {
            let o = out.add(t * out_stride);
            if valid == PANEL_WIDTH {
                let (lo, hi) = if accumulate {
                    (_mm256_add_ps(lo, _mm256_loadu_ps(o)), _mm256_add_ps(hi, _mm256_loadu_ps(o.add(8))))
                } else {
                    (lo, hi)
                };
                _mm256_storeu_ps(o, lo);
                _mm256_storeu_ps(o.add(8), hi);
            } else {
                let mut row = [0f32; PANEL_WIDTH];
                _mm256_storeu_ps(row.as_mut_ptr(), lo);
                _mm256_storeu_ps(row.as_mut_ptr().add(8), hi);
                for (r, &value) in row.iter().enumerate().take(valid) {
                    *o.add(r) = if accumulate { *o.add(r) + value } else { value };
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn tile_of<const T: usize>(
        panel: *const f32,
        panel_stride: usize,
        x: *const f32,
        x_stride: usize,
        depth: usize,
    ) -> [[__m256; 2]; TILE_TOKENS] {
        let mut acc = [[_mm256_setzero_ps(); 2]; T];
        for c in 0..depth {
            let w0 = _mm256_loadu_ps(panel.add(c * panel_stride));
            let w1 = _mm256_loadu_ps(panel.add(c * panel_stride + 8));
            for (t, [a, b]) in acc.iter_mut().enumerate() {
                let xv = _mm256_broadcast_ss(&*x.add(t * x_stride + c));
                *a = _mm256_fmadd_ps(w0, xv, *a);
                *b = _mm256_fmadd_ps(w1, xv, *b);
            }
        }
        let mut all = [[_mm256_setzero_ps(); 2]; TILE_TOKENS];
        all[..T].copy_from_slice(&acc);
        all
    }

    /// Whole int4 groups to f32 by the format's definition (`scale * q + bias`, element `2i` the
    /// low nibble of byte `i`): `packed` holds `dst.len() / 2` bytes, one scale and bias per group.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `dst.len()` a multiple of the group size.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dequantize_int4(packed: &[u8], scales: &[u16], biases: &[u16], dst: &mut [f32]) {
        debug_assert!(dst.len().is_multiple_of(GROUP_SIZE) && packed.len() * 2 >= dst.len());
        for (g, out) in dst.chunks_exact_mut(GROUP_SIZE).enumerate() {
            let w = crate::matmul::avx2::int4_group(packed.as_ptr().add(g * GROUP_SIZE / 2), scales[g], biases[g]);
            for (j, v) in w.into_iter().enumerate() {
                _mm256_storeu_ps(out.as_mut_ptr().add(8 * j), v);
            }
        }
    }

    /// Whole int8 groups to f32 by the format's definition (`scale * q`).
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `dst.len()` a multiple of the group size, `codes` as long.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dequantize_int8(codes: &[i8], scales: &[u16], dst: &mut [f32]) {
        debug_assert!(dst.len().is_multiple_of(GROUP_SIZE) && codes.len() >= dst.len());
        for (g, out) in dst.chunks_exact_mut(GROUP_SIZE).enumerate() {
            let w = crate::matmul::avx2::int8_group(codes.as_ptr().add(g * GROUP_SIZE), scales[g]);
            for (j, v) in w.into_iter().enumerate() {
                _mm256_storeu_ps(out.as_mut_ptr().add(8 * j), v);
            }
        }
    }
}

/// The 512-bit tile of [`Isa::Avx512`]: the same panels and outer products as [`avx2::tile`],
/// with each panel's 16 rows in one register and, with two panels side by side, twelve tokens:
/// 24 accumulators, two weight loads and twelve broadcasts per column (AVX2's tile has 12, two
/// and six), which leaves the loads well under the multiply-adds.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use super::{Tile, PANEL_WIDTH};
    use std::arch::x86_64::*;

    /// Tokens per 512-bit tile.
    pub const TILE_TOKENS: usize = 12;

    /// Runs one tile over the panel of `tile` and, when `second` is given, the panel after it
    /// (its column `c` at `second + c * panel_stride`): `tile.valid` counts the rows of both (up to
    /// 32).
    ///
    /// # Safety
    /// AVX-512F; the tile's pointers valid for its rows, steps and columns (all 16 of each panel's
    /// at every step).
    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile(tile: &Tile, second: Option<*const f32>) {
        macro_rules! by_tokens {
            ($panels:literal, $second:expr) => {
                match tile.tokens {
                    1 => run::<$panels, 1>(tile, $second),
                    2 => run::<$panels, 2>(tile, $second),
                    3 => run::<$panels, 3>(tile, $second),
                    4 => run::<$panels, 4>(tile, $second),
                    5 => run::<$panels, 5>(tile, $second),
                    6 => run::<$panels, 6>(tile, $second),
                    7 => run::<$panels, 7>(tile, $second),
                    8 => run::<$panels, 8>(tile, $second),
                    9 => run::<$panels, 9>(tile, $second),
                    10 => run::<$panels, 10>(tile, $second),
                    11 => run::<$panels, 11>(tile, $second),
                    _ => run::<$panels, TILE_TOKENS>(tile, $second),
                }
            };
        }
        match second {
            Some(second) => by_tokens!(2, second),
            None => by_tokens!(1, tile.panel),
        }
    }

    /// `P` panels (the first at `tile.panel`, the second at `second`) by `T` tokens.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn run<const P: usize, const T: usize>(tile: &Tile, second: *const f32) {
        let Tile { panel, panel_stride, x, x_stride, depth, out, out_stride, valid, accumulate, .. } = *tile;
        let bases = [panel, second];
        let mut acc = [[_mm512_setzero_ps(); P]; T];
        for c in 0..depth {
            let mut w = [_mm512_setzero_ps(); P];
            for (p, w) in w.iter_mut().enumerate() {
                *w = _mm512_loadu_ps(bases[p].add(c * panel_stride));
            }
            for (t, row) in acc.iter_mut().enumerate() {
                let xv = _mm512_set1_ps(*x.add(t * x_stride + c));
                for (a, w) in row.iter_mut().zip(&w) {
                    *a = _mm512_fmadd_ps(*w, xv, *a);
                }
            }
        }
        for (t, row) in acc.iter().enumerate() {
            let o = out.add(t * out_stride);
            for (p, &sum) in row.iter().enumerate() {
                let rows = valid.saturating_sub(p * PANEL_WIDTH).min(PANEL_WIDTH);
                if rows == 0 {
                    continue;
                }
                // The first `rows` lanes: a partial panel at the end of the matrix writes only its rows.
                let mask: __mmask16 = if rows == PANEL_WIDTH { !0 } else { (1u16 << rows) - 1 };
                let dst = o.add(p * PANEL_WIDTH);
                let sum = if accumulate { _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, dst)) } else { sum };
                _mm512_mask_storeu_ps(dst, mask, sum);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) mod avx512 {
    pub const TILE_TOKENS: usize = 12;
    pub unsafe fn tile(_: &super::Tile, _: Option<*const f32>) {
        unreachable!("the AVX-512 path is never chosen off x86-64")
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) mod avx2 {
    pub unsafe fn to_panel(_: &[f32], _: usize, _: &mut [f32]) {
        unreachable!("the AVX2 path is never chosen off x86-64")
    }
    pub unsafe fn tile(_: &super::Tile) {
        unreachable!("the AVX2 path is never chosen off x86-64")
    }
    pub unsafe fn f16_panel(_: &[u16], _: usize, _: usize, _: usize, _: &mut [f32]) {
        unreachable!("the AVX2 path is never chosen off x86-64")
    }
    pub unsafe fn dequantize_int4(_: &[u8], _: &[u16], _: &[u16], _: &mut [f32]) {
        unreachable!("the AVX2 path is never chosen off x86-64")
    }
    pub unsafe fn dequantize_int8(_: &[i8], _: &[u16], _: &mut [f32]) {
        unreachable!("the AVX2 path is never chosen off x86-64")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn balanced_tiles_cover_every_token_once_in_near_equal_tiles() {
        for most in [6, 12] {
            for tokens in 0..100 {
                let tiles: Vec<(usize, usize)> = super::balanced_tiles(tokens, most).collect();
                assert_eq!(tiles.len(), tokens.div_ceil(most));
                let mut next = 0;
                for &(first, size) in &tiles {
                    assert_eq!(first, next, "{tokens} tokens: {tiles:?}");
                    assert!((1..=most).contains(&size), "{tokens} tokens: {tiles:?}");
                    next += size;
                }
                assert_eq!(next, tokens);
                let sizes = tiles.iter().map(|t| t.1);
                assert!(sizes.clone().max().unwrap_or(0) - sizes.min().unwrap_or(0) <= 1, "{tokens}: {tiles:?}");
            }
        }
        assert_eq!(super::balanced_tiles(8, 6).collect::<Vec<_>>(), [(0, 4), (4, 4)]);
    }
}
