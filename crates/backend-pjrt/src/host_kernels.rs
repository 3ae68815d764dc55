//! seam's CPU kernels (`cpu-kernels`) as XLA custom-call targets of the CPU plugin.
//!
//! [`register`] hands the three handlers below to the plugin's FFI extension under the names the
//! graphs call ([`stablehlo_llama::MATMUL_F16_TARGET`] and the others). XLA then calls them from
//! its executor threads with the argument arrays in host memory; each handler checks the shapes
//! and element types against what the graph emitter promises, runs the kernel on the kernels'
//! own worker pool, and returns an XLA error (never a panic across the C boundary) when something
//! disagrees.

use cpu_kernels::pool::Pool;
use cpu_kernels::{AttentionShape, F16Matrix, Int4Matrix, Isa};
use pjrt_runtime::ffi::{dtype, Buffer, CallFrame, Handler, XlaError};
use pjrt_runtime::Plugin;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

/// The platform name XLA's CPU plugin registers handlers under.
const PLATFORM: &str = "cpu";

/// Registers the kernels with `plugin`'s XLA, once per plugin for the life of the process (the
/// registry is the plugin's). A plugin without the FFI extension, or one that refuses a handler,
/// gives the reason; the caller then runs the pure-StableHLO graphs.
pub fn register(plugin: &Plugin) -> Result<(), String> {
    static DONE: OnceLock<Mutex<HashMap<PathBuf, Result<(), String>>>> = OnceLock::new();
    let mut done = DONE.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    done.entry(plugin.path().to_path_buf())
        .or_insert_with(|| {
            let handlers: [(&str, Handler); 3] = [
                (stablehlo_llama::MATMUL_F16_TARGET, matmul_f16),
                (stablehlo_llama::MATMUL_INT4_TARGET, matmul_int4),
                (stablehlo_llama::ATTENTION_DECODE_TARGET, attention_decode),
            ];
            for (target, handler) in handlers {
                plugin
                    .register_ffi_handler(target, PLATFORM, handler)
                    .map_err(|e| format!("registering {target} with the PJRT plugin's FFI: {e}"))?;
            }
            Ok(())
        })
        .clone()
}

/// Runs `body` for an executing call; answers the registration's metadata query; turns a failure
/// or a panic into an XLA error.
///
/// # Safety
/// `frame` is the call frame XLA passed to the handler.
unsafe fn handle(frame: *mut CallFrame, body: impl FnOnce(&CallFrame) -> Result<(), String>) -> *mut XlaError {
    if frame.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: XLA passes a live, exclusive call frame.
    let frame = unsafe { &mut *frame };
    if frame.answer_metadata() || !frame.is_execute() {
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

fn rows_cols(buffer: &Buffer, what: &str) -> Result<(usize, usize), String> {
    match buffer.dims()[..] {
        [a, b] => Ok((a, b)),
        ref other => Err(format!("{what}: rank {} where a matrix was expected", other.len())),
    }
}

/// `(x f32[T, K], w f16[N, K]) -> f32[T, N]`.
unsafe extern "C" fn matmul_f16(frame: *mut CallFrame) -> *mut XlaError {
    // SAFETY: called by XLA with its call frame; the arrays are host memory of the CPU plugin.
    unsafe {
        handle(frame, |frame| {
            let (x, w, out) = (frame.arg(0)?, frame.arg(1)?, frame.ret(0)?);
            let (tokens, k) = rows_cols(x, "x")?;
            let (n, _) = rows_cols(w, "weights")?;
            let x = elements::<f32>(x, dtype::F32, &[tokens, k], "x")?;
            let data = elements::<u16>(w, dtype::F16, &[n, k], "weights")?;
            let out = result_elements::<f32>(out, dtype::F32, &[tokens, n], "result")?;
            let w = F16Matrix { rows: n, cols: k, data };
            cpu_kernels::matmul_f16(Isa::best(), Pool::global(), x, tokens, w, out).map_err(|e| e.to_string())
        })
    }
}

/// `(x f32[T, K], packed i8[N, K/2], scales f16[N, K/32], biases f16[N, K/32]) -> f32[T, N]`.
unsafe extern "C" fn matmul_int4(frame: *mut CallFrame) -> *mut XlaError {
    // SAFETY: as for `matmul_f16`.
    unsafe {
        handle(frame, |frame| {
            let (x, packed, scales, biases, out) =
                (frame.arg(0)?, frame.arg(1)?, frame.arg(2)?, frame.arg(3)?, frame.ret(0)?);
            let (tokens, k) = rows_cols(x, "x")?;
            let (n, _) = rows_cols(packed, "packed weights")?;
            let groups = k / cpu_kernels::GROUP_SIZE;
            let x = elements::<f32>(x, dtype::F32, &[tokens, k], "x")?;
            let packed_ty = if packed.dtype == dtype::U8 { dtype::U8 } else { dtype::S8 };
            let packed = elements::<u8>(packed, packed_ty, &[n, k / 2], "packed weights")?;
            let scales = elements::<u16>(scales, dtype::F16, &[n, groups], "scales")?;
            let biases = elements::<u16>(biases, dtype::F16, &[n, groups], "biases")?;
            let out = result_elements::<f32>(out, dtype::F32, &[tokens, n], "result")?;
            let w = Int4Matrix { rows: n, cols: k, packed, scales, biases };
            cpu_kernels::matmul_int4(Isa::best(), Pool::global(), x, tokens, w, out).map_err(|e| e.to_string())
        })
    }
}

/// `(q f32[H, D], keys f32[KVH, D, C], values f32[KVH, C, D], position i32[]) -> f32[H, D]`.
unsafe extern "C" fn attention_decode(frame: *mut CallFrame) -> *mut XlaError {
    // SAFETY: as for `matmul_f16`.
    unsafe {
        handle(frame, |frame| {
            let (q, keys, values, position, out) =
                (frame.arg(0)?, frame.arg(1)?, frame.arg(2)?, frame.arg(3)?, frame.ret(0)?);
            let (heads, d) = rows_cols(q, "query")?;
            let [kv_heads, _, capacity] = keys.dims()[..] else {
                return Err(format!("keys: rank {} where 3 was expected", keys.rank));
            };
            let q = elements::<f32>(q, dtype::F32, &[heads, d], "query")?;
            let keys = elements::<f32>(keys, dtype::F32, &[kv_heads, d, capacity], "keys")?;
            let values = elements::<f32>(values, dtype::F32, &[kv_heads, capacity, d], "values")?;
            let position = elements::<i32>(position, dtype::S32, &[], "position")?;
            let out = result_elements::<f32>(out, dtype::F32, &[heads, d], "result")?;
            let position = *position.first().ok_or("position: no element")?;
            let len = usize::try_from(position).map_err(|_| format!("position {position} is negative"))? + 1;
            let shape = AttentionShape { heads, kv_heads, head_dim: d, capacity };
            cpu_kernels::attention_decode(Isa::best(), Pool::global(), shape, q, keys, values, len, out)
                .map_err(|e| e.to_string())
        })
    }
}
