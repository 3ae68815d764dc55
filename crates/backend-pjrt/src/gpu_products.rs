//! seam's CUDA kernels (the `cuda-kernels` crate) as XLA custom-call targets of a CUDA plugin:
//! decode's one-row products when the graphs are emitted with
//! [`VectorProducts::CudaKernels`](stablehlo_llama::VectorProducts::CudaKernels).
//!
//! Each handler checks its arrays' element types and shapes against what the graph emitter
//! promises, asks XLA for the call's CUDA stream and launches the kernel on it; it never touches
//! the arrays' contents (device memory). They are registered as safe to capture into XLA's command
//! buffers (CUDA graphs): a call launches the same kernel for the same shapes every time, so XLA
//! keeps a decode step one graph launch instead of splitting it around every product.

use crate::host_kernels::{handle_with_traits, once_per_plugin, register_all, rows_cols, Registrations};
use cuda_kernels::{Driver, Kernel, Stream, Tilings, GROUP};
use pjrt_runtime::ffi::{dtype, CallFrame, Handler, XlaError, TRAIT_COMMAND_BUFFER_COMPATIBLE};
use pjrt_runtime::Plugin;
use std::ffi::c_void;
use std::sync::OnceLock;

/// The platform name XLA's CUDA plugin registers handlers under.
const PLATFORM: &str = "CUDA";

/// Registers the kernels' handlers with `plugin`'s XLA, once per plugin for the life of the
/// process; the reason when the plugin refuses them, no NVIDIA driver is there to launch them or
/// the process's tiling setting (`SEAM_CUDA_TILINGS`, [`Tilings`]) is malformed.
pub fn register(plugin: &Plugin) -> Result<(), String> {
    static DONE: Registrations = OnceLock::new();
    once_per_plugin(&DONE, plugin, || {
        Tilings::of_process()?;
        Driver::get().map_err(|e| e.to_string())?;
        let handlers: [(&str, Handler); 3] = [
            (stablehlo_llama::CUDA_ROWS_F16_TARGET, rows_f16),
            (stablehlo_llama::CUDA_ROWS_INT8_TARGET, rows_int8),
            (stablehlo_llama::CUDA_ROWS_INT4_TARGET, rows_int4),
        ];
        register_all(plugin, PLATFORM, &handlers, TRAIT_COMMAND_BUFFER_COMPATIBLE)
    })
}

unsafe extern "C" fn rows_f16(frame: *mut CallFrame) -> *mut XlaError {
    // SAFETY: called by XLA with its call frame.
    unsafe { handle_with_traits(frame, TRAIT_COMMAND_BUFFER_COMPATIBLE, |frame| launch(frame, Kernel::F16)) }
}

unsafe extern "C" fn rows_int8(frame: *mut CallFrame) -> *mut XlaError {
    // SAFETY: called by XLA with its call frame.
    unsafe { handle_with_traits(frame, TRAIT_COMMAND_BUFFER_COMPATIBLE, |frame| launch(frame, Kernel::Int8)) }
}

unsafe extern "C" fn rows_int4(frame: *mut CallFrame) -> *mut XlaError {
    // SAFETY: called by XLA with its call frame.
    unsafe { handle_with_traits(frame, TRAIT_COMMAND_BUFFER_COMPATIBLE, |frame| launch(frame, Kernel::Int4)) }
}

/// The device pointers of `kernel`'s call (`x`, the weight arrays, `y`) with the product's rows
/// and inputs, after checking every array against the target's signature
/// (`stablehlo_llama::CUDA_ROWS_*_TARGET`).
fn operands(frame: &CallFrame, kernel: Kernel) -> Result<(Vec<*mut c_void>, usize, usize), String> {
    let weights = kernel.pointers() - 2;
    if frame.arg_count() != 1 + weights {
        return Err(format!("{kernel:?} product: {} arguments where {} were expected", frame.arg_count(), 1 + weights));
    }
    let x = frame.arg(0)?;
    let (one, k) = rows_cols(x, "x")?;
    if one != 1 || x.dtype != dtype::F32 {
        return Err(format!("x: f32[1, k] expected, got type {} {:?}", x.dtype, x.dims()));
    }
    let matrix = frame.arg(1)?;
    let (m, cols) = rows_cols(matrix, "the matrix")?;
    let (matrix_types, matrix_cols): (&[i32], usize) = match kernel {
        Kernel::F16 => (&[dtype::F16], k),
        Kernel::Int8 => (&[dtype::S8], k),
        Kernel::Int4 => (&[dtype::S8, dtype::U8], k / 2),
    };
    if !matrix_types.contains(&matrix.dtype) || cols != matrix_cols {
        return Err(format!("{kernel:?} product: the matrix is type {} [{m}, {cols}] for {k} inputs", matrix.dtype));
    }
    let mut pointers = vec![x.data, matrix.data];
    for index in 2..1 + weights {
        let group_values = frame.arg(index)?;
        if group_values.dtype != dtype::F16 || group_values.dims() != [m, k / GROUP] {
            return Err(format!(
                "{kernel:?} product: argument {index} is type {} {:?} where f16[{m}, {}] was expected",
                group_values.dtype,
                group_values.dims(),
                k / GROUP
            ));
        }
        pointers.push(group_values.data);
    }
    let y = frame.ret(0)?;
    if y.dtype != dtype::F32 || y.dims() != [1, m] {
        return Err(format!("y: f32[1, {m}] expected, got type {} {:?}", y.dtype, y.dims()));
    }
    pointers.push(y.data);
    if let Some(p) = pointers.iter().find(|p| !(**p as usize).is_multiple_of(16)) {
        return Err(format!("{kernel:?} product: an array at {p:?} is not 16-byte aligned"));
    }
    Ok((pointers, m, k))
}

fn launch(frame: &CallFrame, kernel: Kernel) -> Result<(), String> {
    let (pointers, rows, k) = operands(frame, kernel)?;
    let stream = frame.stream()?;
    let tiling = Tilings::of_process()?.of(kernel);
    let driver = Driver::get().map_err(|e| e.to_string())?;
    // SAFETY: the pointers are XLA's device arrays of this call, of the shapes checked above, on
    // the call's stream, which XLA keeps alive until the launched work has run.
    unsafe { driver.launch(Stream(stream), kernel, tiling, &pointers, rows, k) }.map_err(|e| e.to_string())
}
