//! seam's CPU kernels (`cpu-kernels`) as XLA custom-call targets of the CPU plugin.
//!
//! [`register`] hands the handlers below to the plugin's FFI extension under the names the graphs
//! call ([`stablehlo_llama::linear_targets`], the attention targets, which also write the caches
//! stacked over the layers ([`stablehlo_llama::ATTENTION_DECODE_WRITE_TARGET`],
//! [`stablehlo_llama::ATTENTION_CAUSAL_WRITE_TARGET`],
//! [`stablehlo_llama::ATTENTION_DECODE_BATCH_TARGET`], ADR 0033), and the argmax). XLA then calls them from
//! its executor threads with the argument arrays in host memory; each handler checks the shapes
//! and element types against what the graph emitter promises, runs the kernel on the kernels'
//! own worker pool, and returns an XLA error (never a panic across the C boundary) when something
//! disagrees.

use cpu_kernels::pool::Pool;
use cpu_kernels::{
    Activations, AttentionShape, CacheElement, CausalQueries, F16Matrix, Int4Matrix, Int8Matrix, Isa, LinearInput,
    LinearWeights, StepEntries,
};
use graph_engine::linear_kernels::format::{INT4, INT4_PANELS, INT8, INT8_PANELS};
use graph_engine::linear_kernels::input::{ATTENTION_PARTS, RMS_NORM, ROWS, SWIGLU};
use graph_engine::linear_kernels::{linear_entry, LinearEntry};
use pjrt_runtime::ffi::{dtype, Buffer, CallFrame, Handler, XlaError};
use pjrt_runtime::Plugin;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

/// The platform name XLA's CPU plugin registers handlers under.
pub(crate) const PLATFORM: &str = "cpu";

/// Registers the kernels with `plugin`'s XLA, once per plugin for the life of the process (the
/// registry is the plugin's). A plugin without the FFI extension, or one that refuses a handler,
/// gives the reason; the caller then runs the pure-StableHLO graphs.
pub fn register(plugin: &Plugin) -> Result<(), String> {
    static DONE: Registrations = OnceLock::new();
    once_per_plugin(&DONE, plugin, || {
        let mut handlers: Vec<(String, Handler)> = stablehlo_llama::linear_targets()
            .into_iter()
            .map(|target| {
                let handler = linear_entry::<LinearHandlers>(&target);
                (target.name, handler)
            })
            .collect();
        handlers.push((stablehlo_llama::ATTENTION_DECODE_WRITE_TARGET.to_string(), attention_decode_write));
        handlers.push((stablehlo_llama::ATTENTION_CAUSAL_WRITE_TARGET.to_string(), attention_causal_write));
        handlers.push((stablehlo_llama::ATTENTION_DECODE_BATCH_TARGET.to_string(), attention_decode_batch));
        handlers.push((stablehlo_llama::ARGMAX_TARGET.to_string(), argmax));
        register_all(plugin, PLATFORM, &handlers, 0)
    })
}

/// What registering a set of handlers with each plugin gave, by plugin path.
pub(crate) type Registrations = OnceLock<Mutex<HashMap<PathBuf, Result<(), String>>>>;

/// `register()`'s outcome for `plugin`, running it only the first time for that plugin in this
/// process (the plugin's handler registry lives as long as the process).
pub(crate) fn once_per_plugin(
    done: &'static Registrations,
    plugin: &Plugin,
    register: impl FnOnce() -> Result<(), String>,
) -> Result<(), String> {
    let mut done = done.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    done.entry(plugin.path().to_path_buf()).or_insert_with(register).clone()
}

/// Registers each `(target, handler)` with `plugin` for `platform` with `traits`, stopping at the
/// first the plugin refuses.
pub(crate) fn register_all<T: AsRef<str>>(
    plugin: &Plugin,
    platform: &str,
    handlers: &[(T, Handler)],
    traits: u32,
) -> Result<(), String> {
    for (target, handler) in handlers {
        let target = target.as_ref();
        plugin
            .register_ffi_handler(target, platform, *handler, traits)
            .map_err(|e| format!("registering {target} with the PJRT plugin's FFI: {e}"))?;
    }
    Ok(())
}

/// Runs `body` for an executing call; answers the registration's metadata query; turns a failure
/// or a panic into an XLA error.
///
/// # Safety
/// `frame` is the call frame XLA passed to the handler.
unsafe fn handle(frame: *mut CallFrame, body: impl FnOnce(&CallFrame) -> Result<(), String>) -> *mut XlaError {
    // SAFETY: the caller's promise.
    unsafe { handle_with_traits(frame, 0, body) }
}

/// [`handle`] for a handler registered with `traits` (`pjrt_runtime::ffi::TRAIT_*`), which its
/// metadata answer repeats.
///
/// # Safety
/// As [`handle`].
pub(crate) unsafe fn handle_with_traits(
    frame: *mut CallFrame,
    traits: u32,
    body: impl FnOnce(&CallFrame) -> Result<(), String>,
) -> *mut XlaError {
    if frame.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: XLA passes a live, exclusive call frame.
    let frame = unsafe { &mut *frame };
    if frame.answer_metadata_with(traits) || !frame.is_execute() {
        return std::ptr::null_mut();
    }
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(frame))) {
        Ok(Ok(())) => std::ptr::null_mut(),
        Ok(Err(message)) => frame.error(&format!("seam kernel: {message}")),
        Err(_) => frame.error("seam kernel: panicked"),
    }
}

/// An argument's elements, after checking its element type and dimensions.
///
/// # Safety
/// `buffer` describes live host memory of its dimensions and type (XLA's CPU arrays do).
unsafe fn elements<'a, T>(buffer: &'a Buffer, ty: i32, dims: &[usize], what: &str) -> Result<&'a [T], String> {
    // SAFETY: the caller's promise.
    unsafe { result_elements(buffer, ty, dims, what) }.map(|e| &*e)
}

/// A result's elements, writable, after checking its element type and dimensions.
///
/// # Safety
/// As [`elements`]; and the memory is this call's result, which nothing else reads or writes
/// while the handler runs.
#[allow(clippy::mut_from_ref)] // the memory is XLA's result buffer, not the descriptor's
unsafe fn result_elements<'a, T>(
    buffer: &'a Buffer,
    ty: i32,
    dims: &[usize],
    what: &str,
) -> Result<&'a mut [T], String> {
    if buffer.dtype != ty {
        return Err(format!("{what}: element type {} where {ty} was expected", buffer.dtype));
    }
    if buffer.dims() != dims {
        return Err(format!("{what}: dimensions {:?} where {dims:?} were expected", buffer.dims()));
    }
    let len = dims.iter().product();
    if len == 0 {
        return Ok(&mut []);
    }
    // SAFETY: the caller's promise; the type and element count were checked above.
    Ok(unsafe { std::slice::from_raw_parts_mut(buffer.data as *mut T, len) })
}

pub(crate) fn rows_cols(buffer: &Buffer, what: &str) -> Result<(usize, usize), String> {
    match buffer.dims()[..] {
        [a, b] => Ok((a, b)),
        ref other => Err(format!("{what}: rank {} where a matrix was expected", other.len())),
    }
}

/// The input of a linear handler that reads rows (`INPUT` [`ROWS`], [`RMS_NORM`] or
/// [`SWIGLU`]): its first argument `x` (`[tokens, k]`) and the norm's or the up rows' after it.
/// Returns the input, `tokens`, `k` and the index of the first weight argument.
///
/// # Safety
/// As [`elements`], for the frame's arguments.
unsafe fn rows_input<const INPUT: u8>(frame: &CallFrame) -> Result<(LinearInput<'_>, usize, usize, usize), String> {
    let first = frame.arg(0)?;
    let (tokens, k) = rows_cols(first, "input")?;
    // SAFETY: the caller's promise.
    unsafe {
        let x = elements::<f32>(first, dtype::F32, &[tokens, k], "input")?;
        let (input, next) = match INPUT {
            ROWS => (LinearInput::Rows(x), 1),
            RMS_NORM => {
                let weight = elements::<f32>(frame.arg(1)?, dtype::F32, &[k], "norm weight")?;
                let eps = elements::<f32>(frame.arg(2)?, dtype::F32, &[], "eps")?;
                (LinearInput::RmsNorm { x, weight, eps: eps[0] }, 3)
            }
            SWIGLU => {
                let up = elements::<f32>(frame.arg(1)?, dtype::F32, &[tokens, k], "up")?;
                (LinearInput::SwiGlu { gate: x, up }, 2)
            }
            other => return Err(format!("linear input {other} is not seam's")),
        };
        Ok((input, tokens, k, next))
    }
}

/// The matrix of weight format `FORMAT` whose arrays start at argument `next`, with `k` columns:
/// its weights and the index of the argument after them.
///
/// # Safety
/// As [`elements`], for the frame's arguments.
unsafe fn matrix_at<const FORMAT: u8, const Q8: bool>(
    frame: &CallFrame,
    next: usize,
    k: usize,
) -> Result<(LinearWeights<'_>, usize), String> {
    let first_weight = frame.arg(next)?;
    let (n, _) = rows_cols(first_weight, "weights")?;
    let groups = k / cpu_kernels::GROUP_SIZE;
    // SAFETY: the caller's promise.
    unsafe {
        Ok(if FORMAT == INT8 || FORMAT == INT8_PANELS {
            let codes = elements::<i8>(first_weight, dtype::S8, &[n, k], "int8 codes")?;
            let scales = elements::<u16>(frame.arg(next + 1)?, dtype::F16, &[n, groups], "scales")?;
            let w = Int8Matrix { rows: n, cols: k, codes, scales };
            let w = match FORMAT {
                INT8_PANELS => LinearWeights::Int8Panels(w, Activations::int8_when(Q8)),
                _ => LinearWeights::Int8(w, Activations::int8_when(Q8)),
            };
            (w, next + 2)
        } else if FORMAT == INT4 || FORMAT == INT4_PANELS {
            let packed_ty = if first_weight.dtype == dtype::U8 { dtype::U8 } else { dtype::S8 };
            let packed = elements::<u8>(first_weight, packed_ty, &[n, k / 2], "packed weights")?;
            let scales = elements::<u16>(frame.arg(next + 1)?, dtype::F16, &[n, groups], "scales")?;
            let biases = elements::<u16>(frame.arg(next + 2)?, dtype::F16, &[n, groups], "biases")?;
            let w = Int4Matrix { rows: n, cols: k, packed, scales, biases };
            let w = match FORMAT {
                INT4_PANELS => LinearWeights::Int4Panels(w, Activations::int8_when(Q8)),
                _ => LinearWeights::Int4(w, Activations::int8_when(Q8)),
            };
            (w, next + 3)
        } else {
            let data = elements::<u16>(first_weight, dtype::F16, &[n, k], "weights")?;
            (LinearWeights::F16(F16Matrix { rows: n, cols: k, data }), next + 1)
        })
    }
}

/// The real rows of a padded call of `tokens` rows, from its `rows` argument.
///
/// # Safety
/// As [`elements`].
unsafe fn real_rows(rows: &Buffer, tokens: usize) -> Result<usize, String> {
    // SAFETY: the caller's promise.
    let rows = unsafe { elements::<i32>(rows, dtype::S32, &[], "rows") }?;
    let rows = *rows.first().ok_or("rows: no element")?;
    Ok(usize::try_from(rows).map_err(|_| format!("rows {rows} is negative"))?.min(tokens))
}

/// `input`'s first `real` of its `tokens` rows (of `k` columns once prepared).
fn first_rows(input: LinearInput<'_>, real: usize, tokens: usize, k: usize) -> LinearInput<'_> {
    match input {
        LinearInput::Rows(x) => LinearInput::Rows(&x[..real * k]),
        LinearInput::RmsNorm { x, weight, eps } => LinearInput::RmsNorm { x: &x[..real * k], weight, eps },
        LinearInput::SwiGlu { gate, up } => LinearInput::SwiGlu { gate: &gate[..real * k], up: &up[..real * k] },
        LinearInput::AttentionParts { parts, heads } => {
            LinearInput::AttentionParts { parts: &parts[..parts.len() / tokens.max(1) * real], heads }
        }
    }
}

/// Result `i`, `[tokens, n]`: its first `real` rows, for the product to write, after zeroing the
/// padding's (finite, and read by nothing but later padding).
///
/// # Safety
/// As [`result_elements`].
#[allow(clippy::mut_from_ref)] // the memory is XLA's result buffer, not the frame's
unsafe fn product_rows(
    frame: &CallFrame,
    i: usize,
    (tokens, real): (usize, usize),
    n: usize,
) -> Result<&mut [f32], String> {
    // SAFETY: the caller's promise.
    let out = unsafe { result_elements::<f32>(frame.ret(i)?, dtype::F32, &[tokens, n], "result") }?;
    let (out, padding) = out.split_at_mut(real * n);
    padding.fill(0.0);
    Ok(out)
}

/// The handler of one [`stablehlo_llama::linear_target`]: `FORMAT` picks the weight format and
/// `INPUT` what the kernel reads ([`graph_engine::linear_kernels`]'s constants), `RESIDUAL`
/// whether a residual operand follows the weights.
unsafe extern "C" fn linear<const FORMAT: u8, const INPUT: u8, const RESIDUAL: bool, const Q8: bool>(
    frame: *mut CallFrame,
) -> *mut XlaError {
    // SAFETY: called by XLA with its call frame; the arrays are host memory of the CPU plugin.
    unsafe {
        handle(frame, |frame| {
            // Products that read the same input (a layer's in separate calls) normalize and lay
            // it out once: the first call prepares it, the next ones take it.
            cpu_kernels::set_input_reuse(true);
            let first = frame.arg(0)?;
            let (input, tokens, k, next) = if INPUT == ATTENTION_PARTS {
                // [T, P * H, 2 + D]: merged, the product's input is [T, H * D].
                let (tokens, rows, stride) = match first.dims()[..] {
                    [t, rows, stride] if stride > 2 && rows % cpu_kernels::DECODE_PARTS == 0 => (t, rows, stride),
                    _ => return Err("attention parts: not [tokens, parts * heads, 2 + head_dim]".into()),
                };
                let parts = elements::<f32>(first, dtype::F32, &[tokens, rows, stride], "attention parts")?;
                let heads = rows / cpu_kernels::DECODE_PARTS;
                (LinearInput::AttentionParts { parts, heads }, tokens, heads * (stride - 2), 1)
            } else {
                rows_input::<INPUT>(frame)?
            };
            let (weights, mut next) = matrix_at::<FORMAT, Q8>(frame, next, k)?;
            let n = weights.rows();
            let residual = match RESIDUAL {
                true => {
                    next += 1;
                    Some(elements::<f32>(frame.arg(next - 1)?, dtype::F32, &[tokens, n], "residual")?)
                }
                false => None,
            };
            let real = real_rows(frame.arg(next)?, tokens)?;
            let out = product_rows(frame, 0, (tokens, real), n)?;
            let residual = residual.map(|r| &r[..real * n]);
            let input = first_rows(input, real, tokens, k);
            cpu_kernels::linear(Isa::best(), Pool::global(), input, real, weights, residual, out)
                .map_err(|e| e.to_string())
        })
    }
}

/// The handler of one [`stablehlo_llama::linear_group_target`]: `PRODUCTS` matrices of format
/// `FORMAT` over one input (`INPUT`), each product into its own result, in one XLA call where
/// separate calls each cost XLA's executor a thunk and holds on its buffers; with `ROPE`, the
/// first two results' heads turned by the call's rope tables.
unsafe extern "C" fn linear_group<
    const FORMAT: u8,
    const INPUT: u8,
    const Q8: bool,
    const PRODUCTS: usize,
    const ROPE: bool,
>(
    frame: *mut CallFrame,
) -> *mut XlaError {
    // SAFETY: called by XLA with its call frame; the arrays are host memory of the CPU plugin.
    unsafe {
        handle(frame, |frame| {
            // The matrices multiply the same input: the first product prepares it, the next
            // ones take it.
            cpu_kernels::set_input_reuse(true);
            let (input, tokens, k, mut next) = rows_input::<INPUT>(frame)?;
            let mut matrices = Vec::with_capacity(PRODUCTS);
            for _ in 0..PRODUCTS {
                let (weights, after) = matrix_at::<FORMAT, Q8>(frame, next, k)?;
                matrices.push(weights);
                next = after;
            }
            let tables = if ROPE {
                let (_, head_dim) = rows_cols(frame.arg(next)?, "cos")?;
                let cos = elements::<f32>(frame.arg(next)?, dtype::F32, &[tokens, head_dim], "cos")?;
                let sin = elements::<f32>(frame.arg(next + 1)?, dtype::F32, &[tokens, head_dim], "sin")?;
                next += 2;
                Some((cos, sin, head_dim))
            } else {
                None
            };
            let real = real_rows(frame.arg(next)?, tokens)?;
            let input = first_rows(input, real, tokens, k);
            let mut outs = Vec::with_capacity(PRODUCTS);
            for (i, weights) in matrices.iter().enumerate() {
                outs.push(product_rows(frame, i, (tokens, real), weights.rows())?);
            }
            cpu_kernels::linear_group(Isa::best(), Pool::global(), input, real, &matrices, &mut outs)
                .map_err(|e| e.to_string())?;
            // The query's and key's heads turn by their rows' tables.
            if let Some((cos, sin, d)) = tables.filter(|_| real > 0) {
                for out in outs.iter_mut().take(2) {
                    cpu_kernels::rope_rows(Isa::best(), out, &cos[..real * d], &sin[..real * d], d)
                        .map_err(|e| e.to_string())?;
                }
            }
            Ok(())
        })
    }
}

/// The handlers of the linear targets, as [`graph_engine::linear_kernels`] picks them.
struct LinearHandlers;

impl LinearEntry for LinearHandlers {
    type Entry = Handler;
    fn instance<const FORMAT: u8, const INPUT: u8, const RESIDUAL: bool, const Q8: bool>() -> Handler {
        linear::<FORMAT, INPUT, RESIDUAL, Q8>
    }
    fn group<const FORMAT: u8, const INPUT: u8, const Q8: bool, const PRODUCTS: usize, const ROPE: bool>() -> Handler {
        linear_group::<FORMAT, INPUT, Q8, PRODUCTS, ROPE>
    }
}

/// A non-negative i32 scalar argument.
///
/// # Safety
/// As [`elements`].
unsafe fn index(buffer: &Buffer, what: &str) -> Result<usize, String> {
    // SAFETY: the caller's promise.
    let value =
        *unsafe { elements::<i32>(buffer, dtype::S32, &[], what) }?.first().ok_or(format!("{what}: no element"))?;
    usize::try_from(value).map_err(|_| format!("{what} {value} is negative"))
}

/// Each sequence's keys and values of one layer, writable.
type LayerCaches<'a, E> = Vec<(&'a mut [E], &'a mut [E])>;

/// A cache element the attention handlers take, with its XLA element type.
trait HostCache: CacheElement {
    const DTYPE: i32;
}

impl HostCache for f32 {
    const DTYPE: i32 = dtype::F32;
}

impl HostCache for half::f16 {
    const DTYPE: i32 = dtype::F16;
}

/// Whether the caches (the call's second result, the first layer-stacked keys) are f16 rather
/// than f32: the graphs hold them in either (`kv_cache`).
fn half_caches(frame: &CallFrame) -> Result<bool, String> {
    match frame.ret(1)?.dtype {
        dtype::F32 => Ok(false),
        dtype::F16 => Ok(true),
        other => Err(format!("caches of XLA element type {other} where f32 or f16 was expected")),
    }
}

/// Layer `layer` of the caches of `sequences` sequences, stacked over the layers: the call's
/// results `1..=2 sequences` (keys `[L, KVH, D, C]` then values `[L, KVH, C, D]` of `E`, for each
/// sequence in turn), which alias the cache operands, so they are read and written there (a copy
/// XLA made first is as right as the operand). Returns the caches' capacity and each sequence's
/// layer.
///
/// # Safety
/// As [`result_elements`]; no two results share memory.
#[allow(clippy::mut_from_ref)] // the memory is XLA's result buffers, not the frame's
unsafe fn layer_caches<E: HostCache>(
    frame: &CallFrame,
    layer: usize,
    sequences: usize,
    kv_heads: usize,
    d: usize,
) -> Result<(usize, LayerCaches<'_, E>), String> {
    let [layers, _, _, capacity] = frame.ret(1)?.dims()[..] else {
        return Err(format!("keys: rank {} where 4 was expected", frame.ret(1)?.rank));
    };
    if layer >= layers {
        return Err(format!("layer {layer} of {layers}"));
    }
    let per = kv_heads * d * capacity;
    let at = layer * per..(layer + 1) * per;
    (0..sequences)
        .map(|s| {
            // SAFETY: the caller's promise; the shapes are checked here.
            let (keys, values) = unsafe {
                (
                    result_elements::<E>(frame.ret(1 + 2 * s)?, E::DTYPE, &[layers, kv_heads, d, capacity], "keys")?,
                    result_elements::<E>(frame.ret(2 + 2 * s)?, E::DTYPE, &[layers, kv_heads, capacity, d], "values")?,
                )
            };
            Ok((&mut keys[at.clone()], &mut values[at.clone()]))
        })
        .collect::<Result<_, String>>()
        .map(|caches| (capacity, caches))
}

/// Each sequence's entry written at its position of layer `layer` of its stacked caches (the
/// call's results after the first, [`layer_caches`]), then its decode attention into the first
/// result (of dimensions `out_dims`): what one position's and a batch's calls share.
///
/// # Safety
/// As [`layer_caches`].
unsafe fn decode_with_entries<E: HostCache>(
    frame: &CallFrame,
    q: &[f32],
    [heads, kv_heads, d]: [usize; 3],
    entries: StepEntries<'_>,
    layer: usize,
    out_dims: &[usize],
) -> Result<(), String> {
    // SAFETY: the caller's promise.
    let (capacity, mut caches) = unsafe { layer_caches::<E>(frame, layer, entries.positions.len(), kv_heads, d) }?;
    // SAFETY: as above; the first result is the attention's output, no cache's.
    let out = unsafe { result_elements::<f32>(frame.ret(0)?, dtype::F32, out_dims, "result") }?;
    let shape = AttentionShape { heads, kv_heads, head_dim: d, capacity };
    cpu_kernels::attention_decode_batch(Isa::best(), Pool::global(), shape, q, entries, &mut caches, out)
        .map_err(|e| e.to_string())
}

/// `(q f32[H, D], k f32[1, KVH, D], v f32[1, KVH, D], position i32[], layer i32[], keys [L, KVH,
/// D, C], values [L, KVH, C, D]) -> (f32[H, D], keys, values)`, the caches f32 or f16: the new key and value
/// written at `position` of layer `layer`'s caches (the cache results, aliasing the operands),
/// then the attention over positions `0..=position`.
unsafe extern "C" fn attention_decode_write(frame: *mut CallFrame) -> *mut XlaError {
    // SAFETY: as for `linear`.
    unsafe {
        handle(frame, |frame| {
            let q = frame.arg(0)?;
            let (heads, d) = rows_cols(q, "query")?;
            let [1, kv_heads, _] = frame.arg(1)?.dims()[..] else {
                return Err(format!("new key: dimensions {:?} where [1, KVH, D] was expected", frame.arg(1)?.dims()));
            };
            let q = elements::<f32>(q, dtype::F32, &[heads, d], "query")?;
            let k = elements::<f32>(frame.arg(1)?, dtype::F32, &[1, kv_heads, d], "new key")?;
            let v = elements::<f32>(frame.arg(2)?, dtype::F32, &[1, kv_heads, d], "new value")?;
            let (position, layer) = (index(frame.arg(3)?, "position")?, index(frame.arg(4)?, "layer")?);
            let entries = StepEntries { keys: k, values: v, positions: &[position] };
            let shape = [heads, kv_heads, d];
            match half_caches(frame)? {
                false => decode_with_entries::<f32>(frame, q, shape, entries, layer, &[heads, d]),
                true => decode_with_entries::<half::f16>(frame, q, shape, entries, layer, &[heads, d]),
            }
        })
    }
}

/// `(q f32[T, H, D], k f32[T, KVH, D], v f32[T, KVH, D], position i32[], rows i32[], layer i32[],
/// keys [L, KVH, D, C], values [L, KVH, C, D], f32 or f16) -> (f32[T, H, D], keys, values)`: the first
/// `rows` rows' keys and values written from `position` into layer `layer`'s caches (the cache
/// results, aliasing the operands), then row `t` over positions `0..=position + t`, rows from
/// `rows` on zero.
unsafe extern "C" fn attention_causal_write(frame: *mut CallFrame) -> *mut XlaError {
    // SAFETY: as for `linear`.
    unsafe {
        handle(frame, |frame| {
            let (q, out) = (frame.arg(0)?, frame.ret(0)?);
            let [tokens, heads, d] = q.dims()[..] else {
                return Err(format!("query: rank {} where 3 was expected", q.rank));
            };
            let [_, kv_heads, _] = frame.arg(1)?.dims()[..] else {
                return Err(format!("new keys: rank {} where 3 was expected", frame.arg(1)?.rank));
            };
            let q = elements::<f32>(q, dtype::F32, &[tokens, heads, d], "query")?;
            let k = elements::<f32>(frame.arg(1)?, dtype::F32, &[tokens, kv_heads, d], "new keys")?;
            let v = elements::<f32>(frame.arg(2)?, dtype::F32, &[tokens, kv_heads, d], "new values")?;
            let (position, rows) = (index(frame.arg(3)?, "position")?, index(frame.arg(4)?, "rows")?);
            let layer = index(frame.arg(5)?, "layer")?;
            if rows > tokens {
                return Err(format!("{rows} real rows of {tokens}"));
            }
            let out = result_elements::<f32>(out, dtype::F32, &[tokens, heads, d], "result")?;
            let queries = CausalQueries { tokens, position, rows };
            let new = (k, v);
            match half_caches(frame)? {
                false => causal_with_entries::<f32>(frame, q, [heads, kv_heads, d], new, queries, layer, out),
                true => causal_with_entries::<half::f16>(frame, q, [heads, kv_heads, d], new, queries, layer, out),
            }
        })
    }
}

/// The first `queries.rows` rows of `new` written from `queries.position` into layer `layer` of
/// the caches (the call's results after the first), then the causal attention of the rows.
///
/// # Safety
/// As [`layer_caches`].
unsafe fn causal_with_entries<E: HostCache>(
    frame: &CallFrame,
    q: &[f32],
    [heads, kv_heads, d]: [usize; 3],
    new: (&[f32], &[f32]),
    queries: CausalQueries,
    layer: usize,
    out: &mut [f32],
) -> Result<(), String> {
    // SAFETY: the caller's promise.
    let (capacity, mut caches) = unsafe { layer_caches::<E>(frame, layer, 1, kv_heads, d) }?;
    let (keys, values) = &mut caches[0];
    let shape = AttentionShape { heads, kv_heads, head_dim: d, capacity };
    cpu_kernels::write_cache_entries(shape, keys, values, new, queries.position, queries.rows)
        .map_err(|e| e.to_string())?;
    cpu_kernels::attention_causal(Isa::best(), Pool::global(), shape, q, queries, keys, values, out)
        .map_err(|e| e.to_string())
}

/// `(q f32[S, H, D], positions i32[S], k f32[S, KVH, D], v f32[S, KVH, D], layer i32[], keys_0
/// [L, KVH, D, C], values_0 [L, KVH, C, D], ..., the caches f32 or f16) -> (f32[S, H, D], keys_0, values_0, ...)`:
/// sequence `s`'s new key and value written at `positions[s]` of layer `layer` of its caches (the
/// cache results, aliasing the operands), then its attention over positions `0..=positions[s]`.
unsafe extern "C" fn attention_decode_batch(frame: *mut CallFrame) -> *mut XlaError {
    // SAFETY: as for `linear`.
    unsafe {
        handle(frame, |frame| {
            let (q, positions) = (frame.arg(0)?, frame.arg(1)?);
            let [sequences, heads, d] = q.dims()[..] else {
                return Err(format!("query: rank {} where 3 was expected", q.rank));
            };
            if frame.arg_count() != 5 + 2 * sequences {
                return Err(format!("{} arguments for {sequences} sequences", frame.arg_count()));
            }
            let [_, kv_heads, _] = frame.arg(2)?.dims()[..] else {
                return Err(format!("new keys: rank {} where 3 was expected", frame.arg(2)?.rank));
            };
            let q = elements::<f32>(q, dtype::F32, &[sequences, heads, d], "query")?;
            let positions = elements::<i32>(positions, dtype::S32, &[sequences], "positions")?;
            let k = elements::<f32>(frame.arg(2)?, dtype::F32, &[sequences, kv_heads, d], "new keys")?;
            let v = elements::<f32>(frame.arg(3)?, dtype::F32, &[sequences, kv_heads, d], "new values")?;
            let layer = index(frame.arg(4)?, "layer")?;
            let positions = positions
                .iter()
                .map(|&p| usize::try_from(p).map_err(|_| format!("position {p} is negative")))
                .collect::<Result<Vec<usize>, String>>()?;
            let entries = StepEntries { keys: k, values: v, positions: &positions };
            let (shape, dims) = ([heads, kv_heads, d], [sequences, heads, d]);
            match half_caches(frame)? {
                false => decode_with_entries::<f32>(frame, q, shape, entries, layer, &dims),
                true => decode_with_entries::<half::f16>(frame, q, shape, entries, layer, &dims),
            }
        })
    }
}

/// `(logits f32[R, V]) -> i32[R]`: each row's greedy token.
unsafe extern "C" fn argmax(frame: *mut CallFrame) -> *mut XlaError {
    // SAFETY: as for `linear`.
    unsafe {
        handle(frame, |frame| {
            let (logits, out) = (frame.arg(0)?, frame.ret(0)?);
            let (rows, cols) = rows_cols(logits, "logits")?;
            let logits = elements::<f32>(logits, dtype::F32, &[rows, cols], "logits")?;
            let out = result_elements::<i32>(out, dtype::S32, &[rows], "result")?;
            let mut ids = vec![0u32; rows];
            cpu_kernels::argmax_rows(Isa::best(), Pool::global(), logits, cols, &mut ids).map_err(|e| e.to_string())?;
            for (o, id) in out.iter_mut().zip(ids) {
                *o = i32::try_from(id).map_err(|_| format!("token {id} beyond i32"))?;
            }
            Ok(())
        })
    }
}
