//! seam's CUDA kernels (the `cuda-kernels` crate) as XLA custom-call targets of a CUDA plugin:
//! decode's one-row products when the graphs are emitted with
//! [`VectorProducts::CudaKernels`](stablehlo_llama::VectorProducts::CudaKernels) (a layer's
//! q, k, v and its gate, up grouped, their norms folded in) or `CudaKernelsEach`.
//!
//! Each handler checks its arrays' element types and shapes against what the graph emitter
//! promises, asks XLA for the call's CUDA stream and launches the kernel on it; it never touches
//! the arrays' contents (device memory). They are registered as safe to capture into XLA's command
//! buffers (CUDA graphs): a call launches the same kernel for the same shapes every time, so XLA
//! keeps a decode step one graph launch instead of splitting it around every product.
//!
//! The same targets can be registered for a CPU plugin with handlers that compute the calls on
//! the host ([`register_on_host`], [`ON_CPU_ENV`]): the graphs' calls checked without a GPU.

use crate::host_kernels::{handle_with_traits, once_per_plugin, register_all, rows_cols, Registrations};
use cuda_kernels::{Driver, Kernel, Launch, Matrix, Norm, Stream, Tilings, GROUP, MAX_MATRICES};
use pjrt_runtime::ffi::{dtype, Buffer, CallFrame, Handler, XlaError, TRAIT_COMMAND_BUFFER_COMPATIBLE};
use pjrt_runtime::Plugin;
use std::ffi::c_void;
use std::sync::OnceLock;

/// The platform name XLA's CUDA plugin registers handlers under.
const PLATFORM: &str = "CUDA";

/// The environment variable that lets a CPU plugin run graphs with seam's CUDA kernels' calls
/// ([`register_on_host`]): `1` to check those graphs without a GPU.
pub const ON_CPU_ENV: &str = "SEAM_PJRT_CUDA_KERNELS_ON_CPU";

/// The targets, each with its handler for a platform: `FORMAT` indexes [`Kernel::ALL`], `NORMED`
/// picks the normed targets.
fn handlers(on_host: bool) -> [(&'static str, Handler); 6] {
    let pick = |gpu: Handler, host: Handler| if on_host { host } else { gpu };
    [
        (stablehlo_llama::CUDA_ROWS_F16_TARGET, pick(rows::<0, false>, host_rows::<0, false>)),
        (stablehlo_llama::CUDA_ROWS_INT8_TARGET, pick(rows::<1, false>, host_rows::<1, false>)),
        (stablehlo_llama::CUDA_ROWS_INT4_TARGET, pick(rows::<2, false>, host_rows::<2, false>)),
        (stablehlo_llama::CUDA_NORMED_ROWS_F16_TARGET, pick(rows::<0, true>, host_rows::<0, true>)),
        (stablehlo_llama::CUDA_NORMED_ROWS_INT8_TARGET, pick(rows::<1, true>, host_rows::<1, true>)),
        (stablehlo_llama::CUDA_NORMED_ROWS_INT4_TARGET, pick(rows::<2, true>, host_rows::<2, true>)),
    ]
}

/// Registers, for `plugin`'s CPU platform, handlers of the kernels' targets that compute what the
/// kernels compute on the host ([`cuda_kernels::host`]): a CPU plugin then runs the graphs of
/// `vector_products=cuda-kernels` as they are, and the conformance suite checks their calls
/// (operands, grouped results, folded norms) against the reference without a GPU.
pub fn register_on_host(plugin: &Plugin) -> Result<(), String> {
    static DONE: Registrations = OnceLock::new();
    once_per_plugin(&DONE, plugin, || register_all(plugin, crate::host_kernels::PLATFORM, &handlers(true), 0))
}

/// Registers the kernels' handlers with `plugin`'s XLA, once per plugin for the life of the
/// process; the reason when the plugin refuses them, no NVIDIA driver is there to launch them or
/// the process's tiling setting (`SEAM_CUDA_TILINGS`, [`Tilings`]) is malformed.
pub fn register(plugin: &Plugin) -> Result<(), String> {
    static DONE: Registrations = OnceLock::new();
    once_per_plugin(&DONE, plugin, || {
        Tilings::of_process()?;
        Driver::get().map_err(|e| e.to_string())?;
        register_all(plugin, PLATFORM, &handlers(false), TRAIT_COMMAND_BUFFER_COMPATIBLE)
    })
}

/// The handler of one target: `FORMAT` indexes [`Kernel::ALL`], `NORMED` says whether the input
/// comes with an RMSNorm to apply.
unsafe extern "C" fn rows<const FORMAT: usize, const NORMED: bool>(frame: *mut CallFrame) -> *mut XlaError {
    // SAFETY: called by XLA with its call frame.
    unsafe {
        handle_with_traits(frame, TRAIT_COMMAND_BUFFER_COMPATIBLE, |frame| launch(frame, Kernel::ALL[FORMAT], NORMED))
    }
}

/// [`rows`] on the host: the CPU plugin's arrays in host memory, computed by
/// [`cuda_kernels::host::compute`].
unsafe extern "C" fn host_rows<const FORMAT: usize, const NORMED: bool>(frame: *mut CallFrame) -> *mut XlaError {
    // SAFETY: called by XLA with its call frame.
    unsafe { handle_with_traits(frame, 0, |frame| compute_on_host(frame, Kernel::ALL[FORMAT], NORMED)) }
}

fn compute_on_host(frame: &CallFrame, kernel: Kernel, normed: bool) -> Result<(), String> {
    let Operands { x, norm, matrices, k } = operands(frame, kernel, normed)?;
    let launch = Launch { kernel, x, norm, matrices: &matrices, k };
    // SAFETY: a CPU plugin's arrays are host memory, of the shapes `operands` checked; XLA gives
    // each result its own buffer.
    unsafe { cuda_kernels::host::compute(&launch) }
}

/// The device address of `buffer`, which the kernels read in 16-byte loads.
fn aligned(buffer: &Buffer, what: &str) -> Result<*mut c_void, String> {
    aligned_to(buffer, what, 16)
}

/// The device address of `buffer`, if a multiple of `alignment`.
fn aligned_to(buffer: &Buffer, what: &str, alignment: usize) -> Result<*mut c_void, String> {
    if !(buffer.data as usize).is_multiple_of(alignment) {
        return Err(format!("{what} at {:?} is not {alignment}-byte aligned", buffer.data));
    }
    Ok(buffer.data)
}

/// The call's input, norm and matrices, after checking every array against the targets'
/// signature (`stablehlo_llama::CUDA_ROWS_*_TARGET`, `CUDA_NORMED_ROWS_*_TARGET`): `x`, then with
/// a norm its weight and epsilon, then each matrix's arrays; one result per matrix.
fn operands(frame: &CallFrame, kernel: Kernel, normed: bool) -> Result<Operands, String> {
    // The call's name only on an error: a handler's every call is on a decode step's path.
    checked_operands(frame, kernel, normed)
        .map_err(|e| format!("{} product{}: {e}", kernel.format(), if normed { " of a normed input" } else { "" }))
}

fn checked_operands(frame: &CallFrame, kernel: Kernel, normed: bool) -> Result<Operands, String> {
    let x = frame.arg(0)?;
    let (one, k) = rows_cols(x, "x")?;
    if one != 1 || x.dtype != dtype::F32 {
        return Err(format!("x f32[1, k] expected, got type {} {:?}", x.dtype, x.dims()));
    }
    let x_data = aligned(x, "x")?;
    let lead = if normed { 3 } else { 1 };
    let norm = if normed {
        let (weight, eps) = (frame.arg(1)?, frame.arg(2)?);
        if weight.dtype != dtype::F32 || weight.dims() != [k] || eps.dtype != dtype::F32 || !eps.dims().is_empty() {
            return Err(format!(
                "the norm is type {} {:?} and epsilon type {} {:?} where f32[{k}] and f32[] were expected",
                weight.dtype,
                weight.dims(),
                eps.dtype,
                eps.dims()
            ));
        }
        // Epsilon is one float read on its own (a constant, which XLA may place anywhere a float
        // may be).
        Some(Norm { weight: aligned(weight, "the norm's weight")?, eps: aligned_to(eps, "epsilon", 4)? })
    } else {
        None
    };
    let per_matrix = kernel.weight_arrays();
    let count = frame.ret_count();
    if count == 0 || count > MAX_MATRICES || frame.arg_count() != lead + count * per_matrix {
        return Err(format!(
            "{} arguments and {count} results, where {lead} + {per_matrix} per matrix and a result per matrix \
             (1 to {MAX_MATRICES}) were expected",
            frame.arg_count()
        ));
    }
    let (matrix_types, matrix_cols): (&[i32], usize) = match kernel {
        Kernel::F16 => (&[dtype::F16], k),
        Kernel::Int8 => (&[dtype::S8], k),
        Kernel::Int4 => (&[dtype::S8, dtype::U8], k / 2),
    };
    let mut matrices = Vec::with_capacity(count);
    for j in 0..count {
        let first = lead + j * per_matrix;
        let matrix = frame.arg(first)?;
        let (m, cols) = rows_cols(matrix, "the matrix")?;
        if !matrix_types.contains(&matrix.dtype) || cols != matrix_cols {
            return Err(format!("matrix {j} is type {} [{m}, {cols}] for {k} inputs", matrix.dtype));
        }
        let mut arrays = vec![aligned(matrix, "a matrix")?];
        for index in first + 1..first + per_matrix {
            let group_values = frame.arg(index)?;
            if group_values.dtype != dtype::F16 || group_values.dims() != [m, k / GROUP] {
                return Err(format!(
                    "argument {index} is type {} {:?} where f16[{m}, {}] was expected",
                    group_values.dtype,
                    group_values.dims(),
                    k / GROUP
                ));
            }
            arrays.push(aligned(group_values, "a matrix's group values")?);
        }
        let y = frame.ret(j)?;
        if y.dtype != dtype::F32 || y.dims() != [1, m] {
            return Err(format!("result {j} f32[1, {m}] expected, got type {} {:?}", y.dtype, y.dims()));
        }
        matrices.push(Matrix { arrays, y: aligned(y, "a result")?, rows: m });
    }
    Ok(Operands { x: x_data, norm, matrices, k })
}

/// What a call hands the kernel: a [`Launch`]'s parts.
struct Operands {
    x: *mut c_void,
    norm: Option<Norm>,
    matrices: Vec<Matrix>,
    k: usize,
}

fn launch(frame: &CallFrame, kernel: Kernel, normed: bool) -> Result<(), String> {
    let Operands { x, norm, matrices, k } = operands(frame, kernel, normed)?;
    let stream = frame.stream()?;
    let rows = matrices.iter().map(|m| m.rows).sum();
    let tiling = Tilings::of_process()?.of_launch(kernel, rows, k);
    let driver = Driver::get().map_err(|e| e.to_string())?;
    let launch = Launch { kernel, x, norm, matrices: &matrices, k };
    // SAFETY: the addresses are XLA's device arrays of this call, of the shapes checked above, on
    // the call's stream, which XLA keeps alive until the launched work has run.
    unsafe { driver.launch(Stream(stream), &launch, tiling) }.map_err(|e| e.to_string())
}
