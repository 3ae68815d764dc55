//! Decode attention over the filled positions of a KV cache.

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
    let AttentionShape { heads, kv_heads, head_dim: d, capacity: c } = shape;
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(ShapeError(format!("{heads} query heads do not group over {kv_heads} KV heads")));
    }
    if len == 0 || len > c {
        return Err(ShapeError(format!("attention over {len} positions of a {c}-position cache")));
    }
    check_len("query", q.len(), heads * d)?;
    check_len("keys", keys.len(), kv_heads * d * c)?;
    check_len("values", values.len(), kv_heads * c * d)?;
    check_len("output", out.len(), heads * d)?;
    let group = heads / kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let out_ptr = OutPtr(out.as_mut_ptr());
    // The scalar definition compiled for the path's instruction set is fast enough: the work is
    // short rows of contiguous f32 that the compiler vectorizes; what matters is reading only
    // `len` positions.
    let attend = |h: usize| {
        let kvh = h / group;
        let qh = &q[h * d..(h + 1) * d];
        let kh = &keys[kvh * d * c..(kvh + 1) * d * c];
        let vh = &values[kvh * c * d..(kvh + 1) * c * d];
        // SAFETY: head h's output row is written by this task only.
        let oh = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(h * d), d) };
        SCORES.with(|scores| {
            let mut scores = scores.borrow_mut();
            if scores.len() < len {
                scores.resize(len, 0.0);
            }
            match isa {
                // SAFETY: the CPU supports the path (checked by the caller's choice below).
                Isa::Avx2 if isa.is_supported() => unsafe { attend_avx2(qh, kh, vh, c, len, scale, &mut scores, oh) },
                _ => scalar::attend_one(qh, kh, vh, c, len, scale, &mut scores, oh),
            }
        });
    };
    // Splitting pays only once a head's work is well above the cost of waking a worker.
    if len * d * group >= 4096 {
        pool.run(heads, &attend);
    } else {
        (0..heads).for_each(attend);
    }
    Ok(())
}

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
