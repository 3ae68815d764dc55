//! The few NVIDIA driver API calls that load the kernels' module and launch them, resolved from
//! `libcuda.so.1` at run time.

use crate::{Kernel, Launch, Tiling, PRODUCTS_PTX};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::{Mutex, OnceLock};

/// A driver call that failed, or a driver that is missing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CudaError(pub String);

/// A `CUstream` (also a `cudaStream_t`) that someone else owns, such as the one XLA hands a custom
/// call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream(pub *mut c_void);

/// A driver call's `CUresult` (0 is `CUDA_SUCCESS`).
pub(crate) type CuResult = c_int;
type Context = *mut c_void;
type Module = *mut c_void;
type Function = *mut c_void;

/// The NVIDIA driver library (`libcuda.so.1`), opened on first use and kept loaded for the life
/// of the process (unloading a driver that `cuInit` has started is not safe; a PJRT plugin loads
/// it again anyway).
pub fn driver_library() -> Result<&'static libloading::Library, CudaError> {
    static LIBRARY: OnceLock<Result<libloading::Library, CudaError>> = OnceLock::new();
    LIBRARY
        .get_or_init(|| {
            // SAFETY: loading the driver library runs its initializers, which have no
            // preconditions.
            unsafe { libloading::Library::new("libcuda.so.1") }
                .map_err(|e| CudaError(format!("no NVIDIA driver (libcuda.so.1 does not load: {e})")))
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// The driver API function `name` of [`driver_library`].
///
/// # Safety
/// `F` is that function's C signature (an `unsafe extern "C" fn`).
pub unsafe fn driver_symbol<F: Copy>(name: &str) -> Result<F, CudaError> {
    let library = driver_library()?;
    // SAFETY: the caller's promise on `F`; the library stays loaded, so the pointer stays valid.
    let symbol = unsafe { library.get::<F>(name.as_bytes()) }
        .map_err(|e| CudaError(format!("libcuda.so.1 is not an NVIDIA driver library: it has no {name} ({e})")))?;
    Ok(*symbol)
}

/// A loaded module's functions (`CUfunction` addresses), by kernel and tiling.
type Functions = HashMap<(Kernel, Tiling), usize>;

/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
const CAPTURE_MODE_RELAXED: c_int = 2;

/// The driver's entry points seam uses.
pub struct Driver {
    stream_get_ctx: unsafe extern "C" fn(*mut c_void, *mut Context) -> CuResult,
    ctx_push: unsafe extern "C" fn(Context) -> CuResult,
    ctx_pop: unsafe extern "C" fn(*mut Context) -> CuResult,
    module_load_data: unsafe extern "C" fn(*mut Module, *const c_void) -> CuResult,
    module_get_function: unsafe extern "C" fn(*mut Function, Module, *const c_char) -> CuResult,
    #[allow(clippy::type_complexity)]
    launch_kernel: unsafe extern "C" fn(
        Function,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        *mut c_void,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CuResult,
    exchange_capture_mode: unsafe extern "C" fn(*mut c_int) -> CuResult,
    error_string: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    /// The kernels' functions per CUDA context (a module belongs to the context it was loaded in),
    /// by context address.
    modules: Mutex<HashMap<usize, Functions>>,
}

// SAFETY: the driver API is thread-safe; the function pointers and the context-keyed table (under
// its mutex) are shared as plain values.
unsafe impl Send for Driver {}
unsafe impl Sync for Driver {}

impl Driver {
    /// The process's driver, opened on first use.
    pub fn get() -> Result<&'static Driver, CudaError> {
        static DRIVER: OnceLock<Result<Driver, CudaError>> = OnceLock::new();
        DRIVER.get_or_init(Driver::open).as_ref().map_err(Clone::clone)
    }

    fn open() -> Result<Driver, CudaError> {
        // SAFETY: each field's type is the C signature of the driver function it is named after.
        unsafe {
            Ok(Driver {
                stream_get_ctx: driver_symbol("cuStreamGetCtx")?,
                ctx_push: driver_symbol("cuCtxPushCurrent_v2")?,
                ctx_pop: driver_symbol("cuCtxPopCurrent_v2")?,
                module_load_data: driver_symbol("cuModuleLoadData")?,
                module_get_function: driver_symbol("cuModuleGetFunction")?,
                launch_kernel: driver_symbol("cuLaunchKernel")?,
                exchange_capture_mode: driver_symbol("cuThreadExchangeStreamCaptureMode")?,
                error_string: driver_symbol("cuGetErrorString")?,
                modules: Mutex::new(HashMap::new()),
            })
        }
    }

    /// `Ok` for a driver call's `CUDA_SUCCESS`, else an error naming `call` and the driver's
    /// description of `result`.
    pub(crate) fn check(&self, result: CuResult, call: &str) -> Result<(), CudaError> {
        if result == 0 {
            return Ok(());
        }
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: the driver writes a pointer to a static string, or leaves it null.
        unsafe { (self.error_string)(result, &mut text) };
        let text = if text.is_null() {
            format!("CUDA error {result}")
        } else {
            // SAFETY: a NUL-terminated static string of the driver's.
            unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
        };
        Err(CudaError(format!("{call}: {text}")))
    }

    /// Launches `launch` tiled as `tiling` on `stream`. The module is loaded into the stream's
    /// context on its first launch there (with stream capture relaxed for the load, so that a
    /// launch being captured into a CUDA graph may be the first).
    ///
    /// # Safety
    /// `stream` is a live stream, and the launch's addresses are device arrays of that context of
    /// the sizes [`Launch`] gives, valid until the launched work has run.
    pub unsafe fn launch(&self, stream: Stream, launch: &Launch, tiling: Tiling) -> Result<(), CudaError> {
        let (mut products, blocks) = launch.products(tiling).map_err(CudaError)?;
        let (mut x, mut k) = (launch.x, launch.k as c_int);
        let (mut norm, mut eps) = match launch.norm {
            Some(norm) => (norm.weight, norm.eps),
            None => (std::ptr::null_mut(), std::ptr::null_mut()),
        };
        let mut context: Context = std::ptr::null_mut();
        // SAFETY: `stream` is live (the caller's promise); the driver writes its context.
        self.check(unsafe { (self.stream_get_ctx)(stream.0, &mut context) }, "cuStreamGetCtx")?;
        // SAFETY: a context the driver just named; popped below on every path.
        self.check(unsafe { (self.ctx_push)(context) }, "cuCtxPushCurrent")?;
        let launched = self.function(context, launch.kernel, tiling).and_then(|function| {
            // The entry point's parameters: x, norm, eps, the products, k.
            let mut params: [*mut c_void; 5] = [
                &mut x as *mut *mut c_void as *mut c_void,
                &mut norm as *mut *mut c_void as *mut c_void,
                &mut eps as *mut *mut c_void as *mut c_void,
                &mut products as *mut _ as *mut c_void,
                &mut k as *mut c_int as *mut c_void,
            ];
            // SAFETY: the parameters match the entry point's, and the driver copies them during
            // the call.
            let result = unsafe {
                (self.launch_kernel)(
                    function as Function,
                    blocks,
                    1,
                    1,
                    tiling.threads,
                    1,
                    1,
                    0,
                    stream.0,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            self.check(result, "cuLaunchKernel")
        });
        let mut popped: Context = std::ptr::null_mut();
        // SAFETY: pops the context pushed above.
        let pop = self.check(unsafe { (self.ctx_pop)(&mut popped) }, "cuCtxPopCurrent");
        launched.and(pop)
    }

    /// `kernel`'s function for `tiling` in `context` (current), loading the module there first if
    /// needed.
    fn function(&self, context: Context, kernel: Kernel, tiling: Tiling) -> Result<usize, CudaError> {
        let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(functions) = modules.get(&(context as usize)) {
            return Ok(functions[&(kernel, tiling)]);
        }
        let mut mode = CAPTURE_MODE_RELAXED;
        // SAFETY: swaps this thread's capture mode; restored below.
        self.check(unsafe { (self.exchange_capture_mode)(&mut mode) }, "cuThreadExchangeStreamCaptureMode")?;
        let loaded = self.load();
        // SAFETY: restores the mode swapped out above.
        let restored =
            self.check(unsafe { (self.exchange_capture_mode)(&mut mode) }, "cuThreadExchangeStreamCaptureMode");
        let functions = loaded?;
        restored?;
        let function = functions[&(kernel, tiling)];
        modules.insert(context as usize, functions);
        Ok(function)
    }

    /// Loads the module into the current context (the driver compiles the PTX for its GPU here)
    /// and looks up every entry point.
    fn load(&self) -> Result<Functions, CudaError> {
        let mut module: Module = std::ptr::null_mut();
        // SAFETY: NUL-terminated PTX text; the module is loaded into the current context and
        // kept for the life of the process.
        self.check(
            unsafe { (self.module_load_data)(&mut module, PRODUCTS_PTX.as_ptr() as *const c_void) },
            "cuModuleLoadData (the driver compiling seam's PTX)",
        )?;
        let mut functions = HashMap::new();
        for kernel in Kernel::ALL {
            for tiling in Tiling::ALL {
                let entry = kernel.entry(tiling);
                let name = std::ffi::CString::new(entry.as_str()).expect("entry names have no NUL");
                let mut function: Function = std::ptr::null_mut();
                // SAFETY: a module just loaded, and a NUL-terminated name.
                self.check(
                    unsafe { (self.module_get_function)(&mut function, module, name.as_ptr()) },
                    &format!("cuModuleGetFunction({entry})"),
                )?;
                functions.insert((kernel, tiling), function as usize);
            }
        }
        Ok(functions)
    }
}
