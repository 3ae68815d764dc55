//! Attention over the filled positions of a KV cache: one query position (decode) or a run of
//! consecutive ones (a prefill chunk), each reading only the positions it may see.

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

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Attention of one query position: `q` `[heads, head_dim]` against positions `0..len` of
/// `keys` `[kv_heads, head_dim, capacity]` and `values` `[kv_heads, capacity, head_dim]`, scores
/// scaled by `1 / sqrt(head_dim)`; the result `[heads, head_dim]` goes to `out`. Positions from
/// `len` on are never read, so a step's cost grows with the conversation, not the capacity.
#[allow(clippy::too_many_arguments)] // the three arrays of one attention, each with its own layout
pub fn attention_decode(
    isa: Isa,
    pool: &Pool,
    shape: AttentionShape,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    len: usize,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    if len == 0 || len > shape.capacity {
        return Err(ShapeError(format!("attention over {len} positions of a {}-position cache", shape.capacity)));
    }
    let queries = CausalQueries { tokens: 1, position: len - 1, rows: 1 };
    attention_causal(isa, pool, shape, q, queries, keys, values, out)
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
pub fn attention_causal(
    isa: Isa,
    pool: &Pool,
    shape: AttentionShape,
    q: &[f32],
    queries: CausalQueries,
    keys: &[f32],
    values: &[f32],
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let AttentionShape { heads, kv_heads, head_dim: d, capacity: c } = shape;
    let CausalQueries { tokens, position, rows } = queries;
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(ShapeError(format!("{heads} query heads do not group over {kv_heads} KV heads")));
    }
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
                    Isa::Avx2 => unsafe { attend_avx2(qh, kh, vh, c, len, scale, &mut scores, oh) },
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

/// Query rows per task of [`attention_causal`].
const ROWS_PER_TASK: usize = 16;

struct OutPtr(*mut f32);
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
