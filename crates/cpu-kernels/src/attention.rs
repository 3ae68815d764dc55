//! Attention over the filled positions of a KV cache: one query position (decode) or a run of
//! consecutive ones (a prefill chunk), each reading only the positions it may see.

use crate::gemm;
use crate::pool::Pool;
use crate::{check_len, scalar, Isa, ShapeError};
use std::cell::RefCell;

/// The shape of one decode attention: `heads` query heads sharing `kv_heads` key/value heads
/// (`heads / kv_heads` queries per KV head, query head `h` reading KV head `h / group`),
/// `head_dim` per head, a cache of `capacity` positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub capacity: usize,
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
}

/// The element type of the KV caches the attention kernels read and write: `f32`, or
/// `half::f16` (half the memory, and half the bytes a decode step reads from its caches). An f16
/// entry is rounded to the nearest f16 when written and widened to f32 when read, so every sum
/// and every softmax stays in f32: f16 caches give what f32 caches holding the same rounded
/// entries give.
pub trait CacheElement: Copy + Default + Send + Sync + 'static + sealed::Sealed {
    /// Whether the elements are f16 (the vector loads widen them).
    const HALF: bool;
    /// `value` rounded to this type (to nearest, ties to even).
    fn from_f32(value: f32) -> Self;
    /// Rounds `src` into `dst` (of the same length).
    fn round_into(src: &[f32], dst: &mut [Self]);
    /// Widens `src` into `dst` (of the same length).
    fn widen_into(src: &[Self], dst: &mut [f32]);
}

impl CacheElement for f32 {
    const HALF: bool = false;
    fn from_f32(value: f32) -> f32 {
        value
    }
    fn round_into(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn widen_into(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl CacheElement for half::f16 {
    const HALF: bool = true;
    fn from_f32(value: f32) -> half::f16 {
        half::f16::from_f32(value)
    }
    fn round_into(src: &[f32], dst: &mut [half::f16]) {
        use half::slice::HalfFloatSliceExt;
        dst.convert_from_f32_slice(src);
    }
    fn widen_into(src: &[half::f16], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
}

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// f16 caches widened for the paths that read f32 ([`attention_causal`]'s rows and the
    /// scalar path): keys and values of the visible positions.
    static WIDENED: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Attention of one query position: `q` `[heads, head_dim]` against positions `0..len` of
/// `keys` `[kv_heads, head_dim, capacity]` and `values` `[kv_heads, capacity, head_dim]`, scores
/// scaled by `1 / sqrt(head_dim)`; the result `[heads, head_dim]` goes to `out`. Positions from
/// `len` on are never read, so a step's cost grows with the conversation, not the capacity.
#[allow(clippy::too_many_arguments)] // the three arrays of one attention, each with its own layout
pub fn attention_decode<E: CacheElement>(
    isa: Isa,
    pool: &Pool,
    shape: AttentionShape,
    q: &[f32],
    keys: &[E],
    values: &[E],
    len: usize,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    if len == 0 || len > shape.capacity {
        return Err(ShapeError(format!("attention over {len} positions of a {}-position cache", shape.capacity)));
    }
    let queries = CausalQueries { tokens: 1, position: len - 1, rows: 1 };
    attention_causal(isa, pool, shape, q, queries, keys, values, out)
}

/// A batched decode step's new cache entries: sequence `s`'s key and value (`[sequences,
/// kv_heads, head_dim]` each, rope applied) go to position `positions[s]` of its caches, which it
/// then attends up to and including.
#[derive(Debug, Clone, Copy)]
pub struct StepEntries<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub positions: &'a [usize],
}

/// Decode attention of a batch of sequences, one query position each against its own cache,
/// after writing the step's entries into the caches: `q` `[sequences, heads, head_dim]`,
/// `caches[s]` sequence `s`'s keys and values (layouts as [`attention_decode`]), `entries` what
/// goes into them and where; the results `[sequences, heads, head_dim]` go to `out`. Each sequence
/// gets bit for bit what [`attention_decode`] gives it alone over the written cache; the batch is
/// one call of the pool, not one per sequence. A KV head's entry is written by the task that then
/// reads it where one task takes that head (ADR 0031): the lines it stores to are the ones the
/// task loads next, and the writes run on every worker instead of before the call on one.
#[allow(clippy::too_many_arguments)] // the arrays of the batch's attentions, each with its own layout
pub fn attention_decode_batch<E: CacheElement>(
    isa: Isa,
    pool: &Pool,
    shape: AttentionShape,
    q: &[f32],
    entries: StepEntries<'_>,
    caches: &mut [(&mut [E], &mut [E])],
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let AttentionShape { heads, kv_heads, head_dim: d, capacity: c } = shape;
    let sequences = caches.len();
    if entries.positions.len() != sequences {
        return Err(ShapeError(format!("{} positions for {sequences} caches", entries.positions.len())));
    }
    check_groups(shape)?;
    check_len("query", q.len(), sequences * heads * d)?;
    check_len("new keys", entries.keys.len(), sequences * kv_heads * d)?;
    check_len("new values", entries.values.len(), sequences * kv_heads * d)?;
    check_len("output", out.len(), sequences * heads * d)?;
    for (s, ((keys, values), &position)) in caches.iter().zip(entries.positions).enumerate() {
        if position >= c {
            return Err(ShapeError(format!("sequence {s}: position {position} outside a {c}-position cache")));
        }
        check_len("keys", keys.len(), kv_heads * d * c)?;
        check_len("values", values.len(), kv_heads * c * d)?;
    }
    let isa = if isa.is_supported() { isa } else { Isa::Scalar };
    let per = heads * d;
    let entry = |s: usize| {
        let at = s * kv_heads * d..(s + 1) * kv_heads * d;
        (&entries.keys[at.clone()], &entries.values[at])
    };
    let Some(path) = Grouped::of(isa, d) else {
        for (s, ((keys, values), &position)) in caches.iter_mut().zip(entries.positions).enumerate() {
            write_cache_entries(shape, keys, values, entry(s), position, 1)?;
            let (q, out) = (&q[s * per..(s + 1) * per], &mut out[s * per..(s + 1) * per]);
            attention_decode(isa, pool, shape, q, keys, values, position + 1, out)?;
        }
        return Ok(());
    };
    let base = out.as_mut_ptr();
    let queries: Vec<DecodeQuery<'_, E>> = caches
        .iter_mut()
        .zip(entries.positions)
        .enumerate()
        // SAFETY: sequence s's rows of `out` start at `s * per`, inside `out` (checked above).
        .map(|(s, ((keys, values), &position))| DecodeQuery {
            q: &q[s * per..(s + 1) * per],
            keys: CachePtr(keys.as_mut_ptr()),
            values: CachePtr(values.as_mut_ptr()),
            len: position + 1,
            entry: Some(entry(s)),
            out: OutPtr(unsafe { base.add(s * per) }),
            caches: std::marker::PhantomData,
        })
        .collect();
    grouped_decode(path, pool, shape, &queries, 1.0 / (d as f32).sqrt());
    Ok(())
}

/// Writes `rows` consecutive entries into caches in [`attention_decode`]'s layouts (keys
/// `[kv_heads, head_dim, capacity]`, values `[kv_heads, capacity, head_dim]`): row `t` of `k` and
/// `v` (`[rows, kv_heads, head_dim]` each; longer arrays' further rows are ignored) at position
/// `position + t`. What a prefill chunk's attention reads after its rows are written.
pub fn write_cache_entries<E: CacheElement>(
    shape: AttentionShape,
    keys: &mut [E],
    values: &mut [E],
    (k, v): (&[f32], &[f32]),
    position: usize,
    rows: usize,
) -> Result<(), ShapeError> {
    let AttentionShape { kv_heads, head_dim: d, capacity: c, .. } = shape;
    if position + rows > c {
        return Err(ShapeError(format!("{rows} entries at position {position} do not fit a {c}-position cache")));
    }
    check_len("keys", keys.len(), kv_heads * d * c)?;
    check_len("values", values.len(), kv_heads * c * d)?;
    let per = kv_heads * d;
    if k.len() < rows * per || v.len() < rows * per {
        return Err(ShapeError(format!("{rows} entries of {per} values from {} keys and {} values", k.len(), v.len())));
    }
    for t in 0..rows {
        let row = t * per..(t + 1) * per;
        for kvh in 0..kv_heads {
            // SAFETY: the caches hold `kv_heads` heads of `c` positions and `position + t < c`
            // (both checked above); they are borrowed mutably here.
            unsafe {
                write_cache_entry(
                    keys.as_mut_ptr(),
                    values.as_mut_ptr(),
                    &k[row.clone()],
                    &v[row.clone()],
                    shape,
                    kvh,
                    position + t,
                )
            };
        }
    }
    Ok(())
}

/// Writes KV head `kvh`'s part of a new entry (`k`, `v` `[kv_heads, head_dim]`) at `position`
/// of caches in [`attention_decode`]'s layouts, through the bare pointers alone (no slice of the
/// caches is made), so that other threads may meanwhile read other positions of the same head
/// through shared slices.
///
/// # Safety
/// `keys` and `values` point to caches of `shape`, `position` is inside them, and nothing else
/// reads or writes that head's entry meanwhile.
pub unsafe fn write_cache_entry<E: CacheElement>(
    keys: *mut E,
    values: *mut E,
    k: &[f32],
    v: &[f32],
    shape: AttentionShape,
    kvh: usize,
    position: usize,
) {
    let AttentionShape { head_dim: d, capacity: c, .. } = shape;
    let (k, v) = (&k[kvh * d..(kvh + 1) * d], &v[kvh * d..(kvh + 1) * d]);
    // SAFETY: the caller's promise; every index is below `kv_heads * d * c`.
    unsafe {
        for (j, (&kj, &vj)) in k.iter().zip(v).enumerate() {
            keys.add((kvh * d + j) * c + position).write(E::from_f32(kj));
            values.add((kvh * c + position) * d + j).write(E::from_f32(vj));
        }
    }
}

/// Whether the query heads of `shape` share its KV heads evenly.
fn check_groups(shape: AttentionShape) -> Result<(), ShapeError> {
    let AttentionShape { heads, kv_heads, .. } = shape;
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(ShapeError(format!("{heads} query heads do not group over {kv_heads} KV heads")));
    }
    Ok(())
}

/// The query rows of a causal attention call: `tokens` rows at cache positions `position..`, of
/// which the first `rows` are real (the rest pad a fixed-size call).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CausalQueries {
    pub tokens: usize,
    pub position: usize,
    pub rows: usize,
}

/// Causal attention of consecutive query positions (a prefill chunk whose keys and values are
/// already in the cache): `q` `[tokens, heads, head_dim]`, row `t` at cache position
/// `position + t` attending to positions `0..=position + t` of `keys` and `values` (layouts as
/// [`attention_decode`]); the result `[tokens, heads, head_dim]` goes to `out`, zeros for the
/// padding rows. Positions past the last real row are never read, so a chunk early in a long
/// context costs what its own span does.
#[allow(clippy::too_many_arguments)] // the three arrays of one attention, each with its own layout
pub fn attention_causal<E: CacheElement>(
    isa: Isa,
    pool: &Pool,
    shape: AttentionShape,
    q: &[f32],
    queries: CausalQueries,
    keys: &[E],
    values: &[E],
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let AttentionShape { heads, kv_heads, head_dim: d, capacity: c } = shape;
    let CausalQueries { tokens, position, rows } = queries;
    check_groups(shape)?;
    if rows > tokens || position + rows > c {
        return Err(ShapeError(format!(
            "{rows} real rows of {tokens} at position {position} do not fit a {c}-position cache"
        )));
    }
    check_len("query", q.len(), tokens * heads * d)?;
    check_len("keys", keys.len(), kv_heads * d * c)?;
    check_len("values", values.len(), kv_heads * c * d)?;
    check_len("output", out.len(), tokens * heads * d)?;
    out[rows * heads * d..].fill(0.0);
    let group = heads / kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let out_ptr = OutPtr(out.as_mut_ptr());
    let isa = if isa.is_supported() { isa } else { Isa::Scalar };
    if rows == 0 {
        return Ok(());
    }
    if let (1, Some(path)) = (tokens, Grouped::of(isa, d)) {
        // Read only: no entry is written through the pointers.
        let query = DecodeQuery {
            q,
            keys: CachePtr(keys.as_ptr().cast_mut()),
            values: CachePtr(values.as_ptr().cast_mut()),
            len: position + 1,
            entry: None,
            out: out_ptr,
            caches: std::marker::PhantomData,
        };
        grouped_decode(path, pool, shape, &[query], scale);
        return Ok(());
    }
    if E::HALF {
        // The paths below read f32: the visible positions widened into caches of just that many
        // positions first. A prefill chunk's products read each of them many times (once per
        // row block and query head), so widening them once costs little beside it.
        let span = position + rows;
        return WIDENED.with(|widened| {
            let (wide_keys, wide_values) = &mut *widened.borrow_mut();
            widen_visible(shape, span, (keys, values), (wide_keys, wide_values));
            let narrow = AttentionShape { capacity: span, ..shape };
            attention_causal(isa, pool, narrow, q, queries, &wide_keys[..], &wide_values[..], out)
        });
    }
    // The paths below read f32 (checked just above).
    let (keys, values) = (as_f32(keys), as_f32(values));
    if isa.has_avx2() && tokens > 1 && d % gemm::PANEL_WIDTH == 0 {
        tiled::causal(isa, pool, shape, q, queries, keys, values, out_ptr);
        return Ok(());
    }
    // A task is one head over a run of rows; its rows' spans share the head's keys and values
    // in cache.
    let blocks = rows.div_ceil(ROWS_PER_TASK);
    let attend = |task: usize| {
        let (h, block) = (task % heads, task / heads);
        let kvh = h / group;
        let kh = &keys[kvh * d * c..(kvh + 1) * d * c];
        let vh = &values[kvh * c * d..(kvh + 1) * c * d];
        SCORES.with(|scores| {
            let mut scores = scores.borrow_mut();
            let longest = position + rows.min((block + 1) * ROWS_PER_TASK);
            if scores.len() < longest {
                scores.resize(longest, 0.0);
            }
            for t in block * ROWS_PER_TASK..rows.min((block + 1) * ROWS_PER_TASK) {
                let at = (t * heads + h) * d;
                let qh = &q[at..at + d];
                // SAFETY: row t of head h is written by this task only.
                let oh = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(at), d) };
                let len = position + t + 1;
                match isa {
                    // SAFETY: the CPU supports the path (checked above).
                    Isa::Avx2 | Isa::Avx512 | Isa::Avx512Vnni => unsafe {
                        attend_avx2(qh, kh, vh, c, len, scale, &mut scores, oh)
                    },
                    Isa::Scalar => scalar::attend_one(qh, kh, vh, c, len, scale, &mut scores, oh),
                }
            }
        });
    };
    // Splitting pays only once the work is well above the cost of waking a worker.
    let work: usize = (0..rows).map(|t| position + t + 1).sum::<usize>() * d * group;
    if work >= 4096 {
        pool.run(heads * blocks, &attend);
    } else {
        (0..heads * blocks).for_each(attend);
    }
    Ok(())
}

/// `x` as f32, which it is (`E::HALF` is false).
fn as_f32<E: CacheElement>(x: &[E]) -> &[f32] {
    assert!(!E::HALF && std::mem::size_of::<E>() == 4);
    // SAFETY: the only non-half cache element is f32 (the trait is sealed).
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<f32>(), x.len()) }
}

/// Positions `0..span` of `keys` and `values` (layouts as [`attention_decode`] in `shape`)
/// widened to f32, into caches of `span` positions in the same layouts.
fn widen_visible<E: CacheElement>(
    shape: AttentionShape,
    span: usize,
    (keys, values): (&[E], &[E]),
    (wide_keys, wide_values): (&mut Vec<f32>, &mut Vec<f32>),
) {
    let AttentionShape { kv_heads, head_dim: d, capacity: c, .. } = shape;
    wide_keys.resize(kv_heads * d * span, 0.0);
    wide_values.resize(kv_heads * span * d, 0.0);
    for (j, row) in wide_keys.chunks_exact_mut(span).enumerate() {
        E::widen_into(&keys[j * c..j * c + span], row);
    }
    for (kvh, head) in wide_values.chunks_exact_mut(span * d).enumerate() {
        E::widen_into(&values[kvh * c * d..kvh * c * d + span * d], head);
    }
}

/// Query rows per task of [`attention_causal`].
const ROWS_PER_TASK: usize = 16;

/// Positions a task of [`grouped_decode`] takes at least when a long context is split.
const MIN_SPAN: usize = 512;

thread_local! {
    /// Per call of [`grouped_decode`]: each task's maximum, sum of exponentials and unnormalized
    /// output per head (`[spans, heads, 2 + head_dim]`).
    static PARTIALS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// One decode query of a batch: its queries `[heads, head_dim]`, its KV cache, the positions it
/// attends to, and where its result goes.
struct DecodeQuery<'a, E: CacheElement> {
    q: &'a [f32],
    keys: CachePtr<E>,
    values: CachePtr<E>,
    len: usize,
    /// The step's entry for position `len - 1` (keys and values `[kv_heads, head_dim]`), written
    /// before the caches are read; `None` where the caches already hold it.
    entry: Option<(&'a [f32], &'a [f32])>,
    out: OutPtr,
    /// The caches are borrowed for the call (mutably where there is an entry to write).
    caches: std::marker::PhantomData<&'a mut [E]>,
}

/// A cache's first element, shared by the tasks of a call: each writes only its own KV heads'
/// entries, before any task reads them (see [`grouped_decode`]).
struct CachePtr<E>(*mut E);
impl<E> Clone for CachePtr<E> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<E> Copy for CachePtr<E> {}
// SAFETY: as above; the tasks never write what another task reads.
unsafe impl<E> Sync for CachePtr<E> {}
unsafe impl<E> Send for CachePtr<E> {}

/// How [`grouped_decode`] splits one query's positions: `spans` spans of `span` positions (the
/// last one shorter).
#[derive(Clone, Copy)]
struct Spans {
    spans: usize,
    span: usize,
}

impl Spans {
    /// A context too long for the `units` tasks of its KV heads to keep every thread busy is
    /// split into spans of at least [`MIN_SPAN`] positions (whole passes of 64 but the last).
    /// Only the shape, the length and the pool decide it, never the batch, so that a sequence
    /// gets the same numbers alone as in a batch.
    fn of(units: usize, len: usize, threads: usize) -> Spans {
        let wanted = if units >= 2 * threads { 1 } else { (2 * threads).div_ceil(units) };
        let spans = wanted.min(len / MIN_SPAN).max(1);
        let span = len.div_ceil(spans).next_multiple_of(64);
        Spans { spans: len.div_ceil(span), span }
    }
}

/// The registers decode attention by KV head runs in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Grouped {
    /// 512-bit (AVX-512F, BW and VL): [`wide`].
    Wide,
    /// 256-bit (AVX2 and FMA): [`narrow`].
    Narrow,
}

impl Grouped {
    /// The path for heads of `d` values on `isa` (one this CPU runs), if one takes them: both
    /// take f32 and f16 caches.
    fn of(isa: Isa, d: usize) -> Option<Grouped> {
        // The 512-bit path loads f16 with 16-bit masks (BW and VL), which every AVX-512 CPU
        // but the Xeon Phis has; the others take the 256-bit path.
        if isa.has_avx512_bw_vl() && wide::fits(d) {
            Some(Grouped::Wide)
        } else if isa.has_avx2() && narrow::fits(d) {
            Some(Grouped::Narrow)
        } else {
            None
        }
    }

    /// Query heads one pass takes at most.
    fn heads_per_pass(self, d: usize) -> usize {
        match self {
            Grouped::Wide => wide::heads_per_pass(d),
            Grouped::Narrow => narrow::heads_per_pass(d),
        }
    }

    /// The path's `attend_heads`, its scores in this thread's scratch ([`SCORES`], grown to
    /// the heads of `q` over the span rounded up to 16).
    ///
    /// # Safety
    /// The path's ISA, and the arguments its `attend_heads` requires but the scores.
    #[allow(clippy::too_many_arguments)]
    unsafe fn attend_heads<E: CacheElement>(
        self,
        q: &[f32],
        keys: &[E],
        values: &[E],
        c: usize,
        span: std::ops::Range<usize>,
        scale: f32,
        part: &mut [f32],
    ) {
        SCORES.with(|scores| {
            let mut scores = scores.borrow_mut();
            // `keys` is one KV head's `[d, c]`.
            let need = q.len() / (keys.len() / c) * span.len().next_multiple_of(16);
            if scores.len() < need {
                scores.resize(need, 0.0);
            }
            // SAFETY: as this function's; the scores are sized above.
            unsafe {
                match self {
                    Grouped::Wide => wide::attend_heads(q, keys, values, c, span, scale, &mut scores, part),
                    Grouped::Narrow => narrow::attend_heads(q, keys, values, c, span, scale, &mut scores, part),
                }
            }
        });
    }
}

/// Decode attention for a batch of queries (each with its own cache), by KV head, in the
/// registers of `path`: a task takes the query heads sharing a KV head (up to the path's
/// `heads_per_pass` at a time) over a span of positions of one query, so each key and value is loaded once for all of
/// them rather than once per query head; long contexts are split into spans ([`Spans::of`]),
/// whose softmax parts are merged here (each span's maximum, sum of exponentials and
/// unnormalized output, rescaled to the largest maximum). One call of the pool for the batch.
fn grouped_decode<E: CacheElement>(
    path: Grouped,
    pool: &Pool,
    shape: AttentionShape,
    queries: &[DecodeQuery<'_, E>],
    scale: f32,
) {
    let AttentionShape { heads, kv_heads, head_dim: d, capacity: c } = shape;
    let group = heads / kv_heads;
    let per_pass = path.heads_per_pass(d);
    let passes = group.div_ceil(per_pass);
    let units = kv_heads * passes;
    let plans: Vec<Spans> = queries.iter().map(|query| Spans::of(units, query.len, pool.threads())).collect();
    // A query whose KV heads are one task each has each head's entry written by that task; one
    // split into passes or spans has its entries written here first, as several tasks read them.
    let in_task = |plan: &Spans| passes == 1 && plan.spans == 1;
    for (query, plan) in queries.iter().zip(&plans) {
        if let (Some((k, v)), false) = (query.entry, in_task(plan)) {
            for kvh in 0..kv_heads {
                // SAFETY: the caller hands over the caches of a query with an entry for writing;
                // no task runs yet.
                unsafe { write_cache_entry(query.keys.0, query.values.0, k, v, shape, kvh, query.len - 1) };
            }
        }
    }
    // Each query's first task and first row of partial results (`spans * heads` rows each).
    let mut firsts = Vec::with_capacity(queries.len() + 1);
    let (mut tasks, mut rows) = (0, 0);
    for plan in &plans {
        firsts.push((tasks, rows));
        tasks += units * plan.spans;
        rows += plan.spans * heads;
    }
    let stride = 2 + d;
    PARTIALS.with(|partials| {
        let mut partials = partials.borrow_mut();
        if partials.len() < rows * stride {
            partials.resize(rows * stride, 0.0);
        }
        let parts = OutPtr(partials.as_mut_ptr());
        let task = |i: usize| {
            let which = firsts.partition_point(|&(first, _)| first <= i) - 1;
            let (query, plan, (first_task, first_row)) = (&queries[which], plans[which], firsts[which]);
            let (unit, at) = ((i - first_task) % units, (i - first_task) / units);
            let (kvh, pass) = (unit / passes, unit % passes);
            let first = kvh * group + pass * per_pass;
            let n = per_pass.min(group - pass * per_pass);
            let (lo, hi) = (at * plan.span, query.len.min((at + 1) * plan.span));
            if let (Some((k, v)), true) = (query.entry, in_task(&plan)) {
                // SAFETY: this task is the only one of KV head `kvh` of this query.
                unsafe { write_cache_entry(query.keys.0, query.values.0, k, v, shape, kvh, query.len - 1) };
            }
            // SAFETY: the caches hold `kv_heads` heads (checked by the callers); this head's
            // entry is written, and no task writes what this one reads.
            let (keys, values) = unsafe {
                (
                    std::slice::from_raw_parts(query.keys.0.add(kvh * d * c), d * c),
                    std::slice::from_raw_parts(query.values.0.add(kvh * c * d), c * d),
                )
            };
            // SAFETY: the caller chose the path on a CPU that runs it; heads `first..first + n`
            // of this query's span `at` are this task's alone in `parts`.
            unsafe {
                let part = parts.get().add((first_row + at * heads + first) * stride);
                let part = std::slice::from_raw_parts_mut(part, n * stride);
                path.attend_heads(&query.q[first * d..(first + n) * d], keys, values, c, lo..hi, scale, part);
            }
        };
        // Splitting pays only once the work is well above the cost of waking a worker.
        let work: usize = queries.iter().map(|query| query.len * d * group).sum();
        if work >= 4096 {
            pool.run(tasks, &task);
        } else {
            (0..tasks).for_each(task);
        }
        for ((query, plan), &(_, first_row)) in queries.iter().zip(&plans).zip(&firsts) {
            for h in 0..heads {
                let part = |at: usize| {
                    let row = first_row + at * heads + h;
                    &partials[row * stride..(row + 1) * stride]
                };
                // SAFETY: this query's head h row of the output is written here only.
                let oh = unsafe { std::slice::from_raw_parts_mut(query.out.get().add(h * d), d) };
                merge(plan.spans, part, oh);
            }
        }
    });
}

/// One head's output from its spans' parts (`part(at)`: maximum, sum of exponentials, weighted
/// values): a lone span's weighted values over its sum, else every span's rescaled to the
/// largest maximum first.
fn merge<'a>(spans: usize, part: impl Fn(usize) -> &'a [f32], out: &mut [f32]) {
    if spans == 1 {
        let inv = 1.0 / part(0)[1];
        for (o, &v) in out.iter_mut().zip(&part(0)[2..]) {
            *o = v * inv;
        }
        return;
    }
    let max = (0..spans).map(|at| part(at)[0]).fold(f32::NEG_INFINITY, f32::max);
    out.fill(0.0);
    let mut total = 0.0;
    for at in 0..spans {
        let weight = (part(at)[0] - max).exp();
        total += part(at)[1] * weight;
        for (o, &v) in out.iter_mut().zip(&part(at)[2..]) {
            *o += v * weight;
        }
    }
    let inv = 1.0 / total;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

/// The most spans [`attention_decode_part`] splits one decode attention into: the parts a caller
/// lays out per query (`[DECODE_PARTS, heads, 2 + head_dim]`, the unused ones marked empty).
pub const DECODE_PARTS: usize = 2;

/// Part `part` of one query position's attention for the query heads of one KV head: `shape`
/// is that KV head's (`kv_heads` 1, `heads` its group), `q` `[heads, head_dim]`, `keys` and
/// `values` its caches (layouts as [`attention_decode`]), `len` the positions attended to. The
/// positions split into at most [`DECODE_PARTS`] spans by the rule a one-thread
/// [`attention_decode`] splits them by; `out` (`[heads, 2 + head_dim]`) gets, per head, the
/// span's largest scaled score, the sum of the exponentials relative to it, and the values
/// weighted by them, or an empty part (sum 0) when the context has fewer spans. Merged by
/// [`merge_decode_parts`], the parts give the numbers of a one-thread [`attention_decode`] over
/// the same one-KV-head `shape`:
/// so a runtime can attend for a KV head's spans on different threads and merge later, where a
/// call per KV head would leave threads idle (three KV heads on two threads).
#[allow(clippy::too_many_arguments)] // the arrays of one attention, each with its own layout
pub fn attention_decode_part<E: CacheElement>(
    isa: Isa,
    shape: AttentionShape,
    q: &[f32],
    keys: &[E],
    values: &[E],
    len: usize,
    part: usize,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let AttentionShape { heads, kv_heads, head_dim: d, capacity: c } = shape;
    if kv_heads != 1 {
        return Err(ShapeError(format!("a decode part is one KV head's, not {kv_heads}'s")));
    }
    if len == 0 || len > c || part >= DECODE_PARTS {
        return Err(ShapeError(format!("part {part} of attention over {len} positions of a {c}-position cache")));
    }
    check_len("query", q.len(), heads * d)?;
    check_len("keys", keys.len(), d * c)?;
    check_len("values", values.len(), c * d)?;
    check_len("part", out.len(), heads * (2 + d))?;
    let isa = if isa.is_supported() { isa } else { Isa::Scalar };
    let path = Grouped::of(isa, d);
    let plan = decode_plan(path, shape, len);
    if part >= plan.spans {
        for head in out.chunks_exact_mut(2 + d) {
            head[0] = f32::NEG_INFINITY;
            head[1..].fill(0.0);
        }
        return Ok(());
    }
    let span = part * plan.span..len.min((part + 1) * plan.span);
    let scale = 1.0 / (d as f32).sqrt();
    match path {
        Some(path) => {
            let per_pass = path.heads_per_pass(d);
            for first in (0..heads).step_by(per_pass) {
                let n = per_pass.min(heads - first);
                // SAFETY: `Grouped::of` chose the path for this CPU and head size; the caches
                // are one KV head's (checked above), the span non-empty and inside them.
                unsafe {
                    let (q, out) = (&q[first * d..(first + n) * d], &mut out[first * (2 + d)..(first + n) * (2 + d)]);
                    path.attend_heads(q, keys, values, c, span.clone(), scale, out);
                }
            }
        }
        None => SCORES.with(|scores| {
            WIDENED.with(|widened| {
                let mut scores = scores.borrow_mut();
                let (wide_keys, wide_values) = &mut *widened.borrow_mut();
                let one = AttentionShape { heads: 1, ..shape };
                widen_visible(one, len, (keys, values), (wide_keys, wide_values));
                if scores.len() < len {
                    scores.resize(len, 0.0);
                }
                for (h, head) in out.chunks_exact_mut(2 + d).enumerate() {
                    let (qh, (stats, weighted)) = (&q[h * d..(h + 1) * d], head.split_at_mut(2));
                    let (max, sum) = scalar::attend_part(
                        qh,
                        wide_keys,
                        wide_values,
                        len,
                        span.clone(),
                        scale,
                        &mut scores,
                        weighted,
                    );
                    (stats[0], stats[1]) = (max, sum);
                }
            })
        }),
    }
    Ok(())
}

/// How many of the [`DECODE_PARTS`] parts [`attention_decode_part`] fills for one KV head of
/// `shape` attending over `len` positions: the last of them holds position `len - 1`.
pub fn decode_spans(isa: Isa, shape: AttentionShape, len: usize) -> usize {
    let isa = if isa.is_supported() { isa } else { Isa::Scalar };
    decode_plan(Grouped::of(isa, shape.head_dim), shape, len).spans
}

/// The spans of a one-thread decode attention over `len` positions for the query heads of one KV
/// head, in `path`'s registers: the scalar path never splits (as `attention_decode`'s, which
/// it matches).
fn decode_plan(path: Option<Grouped>, shape: AttentionShape, len: usize) -> Spans {
    match path {
        Some(path) => Spans::of(shape.heads.div_ceil(path.heads_per_pass(shape.head_dim)), len, 1),
        None => Spans { spans: 1, span: len.max(1) },
    }
}

/// The attention output of each of `heads` query heads (`[heads, d]` into `out`) from their
/// [`DECODE_PARTS`] parts (`parts` `[DECODE_PARTS, heads, 2 + d]`, as [`attention_decode_part`]
/// writes them): the numbers [`attention_decode`] gives on one thread for each KV head alone.
pub fn merge_decode_parts(parts: &[f32], heads: usize, d: usize, out: &mut [f32]) -> Result<(), ShapeError> {
    let stride = 2 + d;
    check_len("parts", parts.len(), DECODE_PARTS * heads * stride)?;
    check_len("output", out.len(), heads * d)?;
    for (h, out) in out.chunks_exact_mut(d).enumerate() {
        let part = |at: usize| &parts[(at * heads + h) * stride..(at * heads + h + 1) * stride];
        // The spans a context has come first; an empty part (sum 0) ends them.
        let spans = (0..DECODE_PARTS).take_while(|&at| part(at)[1] > 0.0).count();
        if spans == 0 {
            return Err(ShapeError(format!("head {h} has no part with any position")));
        }
        merge(spans, part, out);
    }
    Ok(())
}

pub(crate) struct OutPtr(*mut f32);
impl OutPtr {
    fn get(&self) -> *mut f32 {
        self.0
    }
}
// SAFETY: tasks write disjoint rows through it.
unsafe impl Sync for OutPtr {}

/// [`scalar::attend_one`] compiled for AVX2 and FMA, which the compiler vectorizes (off x86-64 the
/// path is never chosen, and this is the plain function).
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx2,fma"))]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_avx2(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    c: usize,
    len: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    scalar::attend_one(q, keys, values, c, len, scale, scores, out)
}

/// One query position's attention in 512-bit registers for the query heads of one KV head, for
/// head sizes of four or eight registers: the scores of 64 positions at a time held in four
/// registers per head over the whole head dimension (the keys read once for all the heads, no
/// partial sums through memory), the softmax's exponentials sixteen at a time, and the weighted
/// sums of the values in registers over every position.
#[cfg(target_arch = "x86_64")]
mod wide {
    use super::CacheElement;
    use crate::simd::exp512;
    use std::arch::x86_64::*;

    /// Sixteen elements from `p` (the lanes of `m`; zero elsewhere), widened to f32 if the caches
    /// are f16.
    ///
    /// # Safety
    /// AVX-512F, BW and VL; the lanes of `m` lie inside the cache.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    #[inline]
    unsafe fn load<E: CacheElement>(p: *const E, m: __mmask16) -> __m512 {
        if E::HALF {
            _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p.cast::<i16>()))
        } else {
            _mm512_maskz_loadu_ps(m, p.cast::<f32>())
        }
    }

    /// Whether a head of `d` values takes this path.
    pub(super) fn fits(d: usize) -> bool {
        d == 64 || d == 128
    }

    /// Query heads one call of [`attend_heads`] takes at most for a head of `d` values: as many
    /// as keep their accumulators and a row of keys or values in the 32 registers.
    pub(super) fn heads_per_pass(d: usize) -> usize {
        if d == 64 {
            4
        } else {
            2
        }
    }

    /// The `n = q.len() / d` query heads of `q` (up to [`heads_per_pass`]) against positions
    /// `span` of one KV head, the softmax left unnormalized: per head, `part` gets the span's
    /// largest scaled score, the sum of the exponentials relative to it, and the values weighted
    /// by them (`[n, 2 + d]`). Per head the operations and their order are those of a single
    /// head's pass, so the heads of a group get the numbers they get alone. `scores` holds at
    /// least `n` times the span's length rounded up to 16.
    ///
    /// # Safety
    /// AVX-512F, BW and VL; `keys` `[d, c]` and `values` `[c, d]` of one KV head, `span` within `0..c` and not empty, `d` of [`fits`] size.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,avx2,fma")]
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
        debug_assert!(n >= 1 && n <= heads_per_pass(q.len() / n) && part.len() == q.len() + 2 * n);
        match (q.len() / n, n) {
            (64, 1) => attend_hs::<E, 4, 1>(q, keys, values, c, span, scale, scores, part),
            (64, 2) => attend_hs::<E, 4, 2>(q, keys, values, c, span, scale, scores, part),
            (64, 3) => attend_hs::<E, 4, 3>(q, keys, values, c, span, scale, scores, part),
            (64, 4) => attend_hs::<E, 4, 4>(q, keys, values, c, span, scale, scores, part),
            (128, 1) => attend_hs::<E, 8, 1>(q, keys, values, c, span, scale, scores, part),
            (128, 2) => attend_hs::<E, 8, 2>(q, keys, values, c, span, scale, scores, part),
            (d, n) => unreachable!("{n} heads of {d} values in one pass"),
        }
    }

    /// How many rows of keys ahead of the one being multiplied are prefetched. The rows of a
    /// head's keys lie a whole cache's positions apart, and a batch's caches are far beyond the
    /// last-level cache: the hardware's prefetchers left the loads of each new row waiting on
    /// memory (kernels bench `--batched-attention`: faster at 4, 8 and 16 rows ahead alike).
    const KEY_ROWS_AHEAD: usize = 8;

    /// The lanes of register `v` (16 positions from `p0 + 16 v`) that lie before `end`.
    #[inline(always)]
    fn mask(p0: usize, v: usize, end: usize) -> __mmask16 {
        let first = p0 + 16 * v;
        match end.saturating_sub(first) {
            0 => 0,
            n if n >= 16 => !0,
            n => (1u16 << n) - 1,
        }
    }

    /// [`attend_heads`] for `S` heads of `16 V` values: the scores of 64 positions at a time in
    /// four registers per head over the whole head dimension (each row of keys loaded once for
    /// the `S` heads), the exponentials sixteen at a time, and the weighted sum of the values in
    /// registers over every position (each row of values loaded once).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn attend_hs<E: CacheElement, const V: usize, const S: usize>(
        q: &[f32],
        keys: &[E],
        values: &[E],
        c: usize,
        span: std::ops::Range<usize>,
        scale: f32,
        scores: &mut [f32],
        part: &mut [f32],
    ) {
        let d = 16 * V;
        let (lo, hi) = (span.start, span.end);
        let stride = (hi - lo).next_multiple_of(16);
        debug_assert!(q.len() == S * d && part.len() == S * (2 + d) && lo < hi && hi <= c);
        debug_assert!(keys.len() >= d * c && values.len() >= c * d && scores.len() >= S * stride);
        let sp = scores.as_mut_ptr();
        let qp = q.as_ptr();
        let mut max = [_mm512_set1_ps(f32::NEG_INFINITY); S];
        // Scores, 64 positions per pass; lanes past the span are neither read nor kept.
        for p0 in (lo..hi).step_by(64) {
            let m: [__mmask16; 4] = std::array::from_fn(|v| mask(p0, v, hi));
            let mut acc = [[_mm512_setzero_ps(); 4]; S];
            for j in 0..d {
                let row = keys.as_ptr().add(j * c + p0);
                if j + KEY_ROWS_AHEAD < d {
                    let ahead = row.add(KEY_ROWS_AHEAD * c) as *const i8;
                    for (v, &lanes) in m.iter().enumerate() {
                        // One prefetch per line: a register's 16 positions are a line of f32, half of one of f16.
                        let at = 16 * v * std::mem::size_of::<E>();
                        if lanes != 0 && at.is_multiple_of(64) {
                            _mm_prefetch::<_MM_HINT_T0>(ahead.add(at));
                        }
                    }
                }
                let k: [__m512; 4] = std::array::from_fn(|v| load(row.add(16 * v), m[v]));
                for (s, acc) in acc.iter_mut().enumerate() {
                    let qj = _mm512_set1_ps(*qp.add(s * d + j));
                    for v in 0..4 {
                        acc[v] = _mm512_fmadd_ps(qj, k[v], acc[v]);
                    }
                }
            }
            for (s, acc) in acc.iter().enumerate() {
                for v in 0..4 {
                    if m[v] != 0 {
                        let x = _mm512_mul_ps(acc[v], _mm512_set1_ps(scale));
                        max[s] = _mm512_mask_max_ps(max[s], m[v], max[s], x);
                        _mm512_storeu_ps(sp.add(s * stride + p0 - lo + 16 * v), x);
                    }
                }
            }
        }
        // Exponentials and their sum, sixteen at a time.
        let mut top = [0.0f32; S];
        let mut total = [0.0f32; S];
        for s in 0..S {
            top[s] = _mm512_reduce_max_ps(max[s]);
            let big = _mm512_set1_ps(top[s]);
            let mut sum = _mm512_setzero_ps();
            for p0 in (0..hi - lo).step_by(16) {
                let at = sp.add(s * stride + p0);
                let e = exp512(_mm512_sub_ps(_mm512_loadu_ps(at), big));
                sum = _mm512_mask_add_ps(sum, mask(p0, 0, hi - lo), sum, e);
                _mm512_storeu_ps(at, e);
            }
            total[s] = _mm512_reduce_add_ps(sum);
        }
        // The values weighted by the exponentials, the heads' sums in registers.
        let mut acc = [[_mm512_setzero_ps(); V]; S];
        for pos in lo..hi {
            let row = values.as_ptr().add(pos * d);
            let vals: [__m512; V] = std::array::from_fn(|v| load(row.add(16 * v), !0));
            for (s, acc) in acc.iter_mut().enumerate() {
                let p = _mm512_set1_ps(*sp.add(s * stride + pos - lo));
                for v in 0..V {
                    acc[v] = _mm512_fmadd_ps(p, vals[v], acc[v]);
                }
            }
        }
        for s in 0..S {
            let out = part.as_mut_ptr().add(s * (2 + d));
            *out = top[s];
            *out.add(1) = total[s];
            for (v, acc) in acc[s].iter().enumerate() {
                _mm512_storeu_ps(out.add(2 + 16 * v), *acc);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod narrow;

#[cfg(not(target_arch = "x86_64"))]
mod narrow {
    pub(super) use super::wide::{attend_heads, fits, heads_per_pass};
}

#[cfg(not(target_arch = "x86_64"))]
mod wide {
    pub(super) fn fits(_: usize) -> bool {
        false
    }
    pub(super) fn heads_per_pass(_: usize) -> usize {
        1
    }
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn attend_heads<E>(
        _: &[f32],
        _: &[E],
        _: &[E],
        _: usize,
        _: std::ops::Range<usize>,
        _: f32,
        _: &mut [f32],
        _: &mut [f32],
    ) {
        unreachable!("the AVX-512 path is never chosen off x86-64")
    }
}

/// Causal attention of many rows as two register-tiled products per head and block of rows (the
/// [`gemm`] tile): scores `q K` over the span the block's last row sees, a softmax per row over
/// its own span (later positions zeroed), then `P V`. A row's keys and values are read once per
/// block instead of once per row, and the exponentials are computed eight at a time.
#[cfg(target_arch = "x86_64")]
mod tiled {
    use super::{AttentionShape, CausalQueries, OutPtr};
    use crate::gemm::{avx512, run_tile, Tile, PANEL_WIDTH, TILE_TOKENS};
    use crate::pool::Pool;
    use crate::scratch::Scratch;
    use crate::simd::exp;
    use crate::Isa;
    use std::arch::x86_64::*;

    /// Per task: the block's scores (rows of the span rounded up to a panel), and keys of the
    /// span's last partial panel, zero-padded.
    #[derive(Default)]
    struct Buffers {
        scores: Vec<f32>,
        tail: Vec<f32>,
    }

    crate::scratch::footprint!(Buffers: scores, tail);

    static BUFFERS: Scratch<Buffers> = Scratch::new();

    /// [`super::attention_causal`] for `head_dim` a multiple of [`PANEL_WIDTH`], `isa` with AVX2
    /// and FMA (checked by the caller), shapes checked; the padding rows of `out` already zero.
    /// On [`Isa::Avx512`] the products run the 512-bit tile, one panel by twelve rows.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn causal(
        isa: Isa,
        pool: &Pool,
        shape: AttentionShape,
        q: &[f32],
        queries: CausalQueries,
        keys: &[f32],
        values: &[f32],
        out: OutPtr,
    ) {
        let AttentionShape { heads, kv_heads, head_dim: d, capacity: c } = shape;
        let CausalQueries { position, rows, .. } = queries;
        let group = heads / kv_heads;
        let scale = 1.0 / (d as f32).sqrt();
        let wide = isa.has_avx512();
        let block_rows = if wide { avx512::TILE_TOKENS } else { TILE_TOKENS };
        let blocks = rows.div_ceil(block_rows);
        pool.run(heads * blocks, &|task| {
            let (h, block) = (task % heads, task / heads);
            let t0 = block * block_rows;
            let tc = block_rows.min(rows - t0);
            let span = position + t0 + tc;
            let stride = span.next_multiple_of(PANEL_WIDTH);
            let kh = &keys[(h / group) * d * c..(h / group + 1) * d * c];
            let vh = &values[(h / group) * c * d..(h / group + 1) * c * d];
            BUFFERS.with(|Buffers { scores, tail }| {
                scores.resize(tc * stride, 0.0);
                tail.resize(d * PANEL_WIDTH, 0.0);
                // The wide tile takes two full panels of keys at a time while the span has them.
                let mut j0 = 0;
                while j0 < span {
                    let pair = wide && span - j0 >= 2 * PANEL_WIDTH;
                    let valid = if pair { 2 * PANEL_WIDTH } else { PANEL_WIDTH.min(span - j0) };
                    // The last partial panel's keys are copied, so no position past the span is read.
                    let (panel, panel_stride) = if valid >= PANEL_WIDTH {
                        (kh[j0..].as_ptr(), c)
                    } else {
                        for (j, dst) in tail.chunks_exact_mut(PANEL_WIDTH).enumerate() {
                            dst[..valid].copy_from_slice(&kh[j * c + j0..j * c + j0 + valid]);
                            dst[valid..].fill(0.0);
                        }
                        (tail.as_ptr(), PANEL_WIDTH)
                    };
                    // SAFETY: the caller checked the ISA (AVX2 and FMA; AVX-512F when wide); the
                    // panels hold `d` steps of 16 (key rows of `c >= span` positions, or the
                    // padded copy), the queries `tc` rows of `d`, the scores `tc` rows of
                    // `stride >= j0 + valid`.
                    unsafe {
                        let second = pair.then(|| panel.add(PANEL_WIDTH));
                        run_tile(
                            wide,
                            &Tile {
                                panel,
                                panel_stride,
                                x: q.as_ptr().add((t0 * heads + h) * d),
                                x_stride: heads * d,
                                depth: d,
                                tokens: tc,
                                out: scores.as_mut_ptr().add(j0),
                                out_stride: stride,
                                valid,
                                accumulate: false,
                            },
                            second,
                        )
                    };
                    j0 += if pair { 2 * PANEL_WIDTH } else { PANEL_WIDTH };
                }
                for (t, row) in scores.chunks_exact_mut(stride).enumerate() {
                    let len = position + t0 + t + 1;
                    // SAFETY: AVX2 and FMA (the caller's check).
                    unsafe { softmax(&mut row[..len], scale) };
                    row[len..span].fill(0.0);
                }
                let mut d0 = 0;
                while d0 < d {
                    let pair = wide && d - d0 >= 2 * PANEL_WIDTH;
                    // SAFETY: as above; the values' rows `0..span` are filled positions, each of
                    // `d >= d0 + 16` (`d0 + 32` for a pair); the output rows are this task's
                    // (head h, rows t0..t0 + tc).
                    unsafe {
                        let panel = vh.as_ptr().add(d0);
                        run_tile(
                            wide,
                            &Tile {
                                panel,
                                panel_stride: d,
                                x: scores.as_ptr(),
                                x_stride: stride,
                                depth: span,
                                tokens: tc,
                                out: out.get().add((t0 * heads + h) * d + d0),
                                out_stride: heads * d,
                                valid: if pair { 2 * PANEL_WIDTH } else { PANEL_WIDTH },
                                accumulate: false,
                            },
                            pair.then(|| panel.add(PANEL_WIDTH)),
                        )
                    };
                    d0 += if pair { 2 * PANEL_WIDTH } else { PANEL_WIDTH };
                }
            });
        });
    }

    /// `row = softmax(row * scale)`, the exponentials eight at a time.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn softmax(row: &mut [f32], scale: f32) {
        let mut max = f32::NEG_INFINITY;
        for v in row.iter_mut() {
            *v *= scale;
            max = max.max(*v);
        }
        let mut total = 0.0f32;
        let mut chunks = row.chunks_exact_mut(8);
        let mut sum = _mm256_setzero_ps();
        let shift = _mm256_set1_ps(max);
        for chunk in &mut chunks {
            let e = exp(_mm256_sub_ps(_mm256_loadu_ps(chunk.as_ptr()), shift));
            _mm256_storeu_ps(chunk.as_mut_ptr(), e);
            sum = _mm256_add_ps(sum, e);
        }
        for v in chunks.into_remainder() {
            *v = (*v - max).exp();
            total += *v;
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
        total += lanes.iter().sum::<f32>();
        let inv = 1.0 / total;
        for v in row.iter_mut() {
            *v *= inv;
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod tiled {
    use super::{AttentionShape, CausalQueries, OutPtr};
    use crate::pool::Pool;

    #[allow(clippy::too_many_arguments)]
    pub(super) fn causal(
        _: crate::Isa,
        _: &Pool,
        _: AttentionShape,
        _: &[f32],
        _: CausalQueries,
        _: &[f32],
        _: &[f32],
        _: OutPtr,
    ) {
        unreachable!("the AVX2 path is never chosen off x86-64")
    }
}
