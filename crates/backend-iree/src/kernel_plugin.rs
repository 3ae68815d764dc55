//! seam's CPU kernels called from inside IREE's dispatches, through an executable plugin.
//!
//! IREE's llvm-cpu executables can call functions they declare but do not define ("imports");
//! the local devices resolve them through executable plugins, shared libraries named by the
//! runtime flag `--executable_plugin`. seam's plugin (`plugin/kernels_plugin.c`, built by
//! `build.rs` and embedded here) holds no kernels: [`install`] writes it to the cache folder,
//! loads it into this process and hands it a table of the import functions below, which run
//! the kernels of `cpu-kernels` (the ones pjrt-cpu calls as XLA custom calls). When IREE later
//! loads the same path it gets the same loaded copy, table included.
//!
//! An import receives one pointer to a packed struct of its arguments, in the order the
//! executable's `func.call` passes them (memrefs as bare pointers, `llvm.bareptr`, each followed
//! by its element offset; `index` values as `usize`). Each call is one IREE workgroup's share of
//! the output rows, run on the calling IREE worker thread (the kernels' own pool is not used:
//! IREE's workgroups are the split over the cores).

use crate::error::IreeError;
use cpu_kernels::pool::Pool;
use cpu_kernels::{matmul_f16, F16Matrix, Isa};
use llama_model::home;
use sha2::{Digest, Sha256};
use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

/// The plugin library, as `build.rs` compiled it.
static PLUGIN_LIBRARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libseam_iree_kernels.so"));

/// An import function's C signature (`iree_hal_executable_import_v0_t`): the packed arguments,
/// the context the plugin gave at resolution (none here), reserved; 0 for success.
type ImportFn = unsafe extern "C" fn(params: *mut c_void, context: *mut c_void, reserved: *mut c_void) -> c_int;

/// One entry of the plugin's table (`seam_kernel_entry_t` in the C source).
#[repr(C)]
struct Entry {
    name: *const c_char,
    function: ImportFn,
}

/// The imports seam provides, by the names the executables declare.
struct Table([Entry; 1]);
// SAFETY: the table is immutable and its pointers are to static strings and functions.
unsafe impl Sync for Table {}

static TABLE: Table = Table([Entry { name: c"seam_f16_rows".as_ptr(), function: seam_f16_rows }]);

/// The import names, for the graphs that declare them.
pub const F16_ROWS: &str = "seam_f16_rows";

/// Writes the plugin into the cache folder (once per process; the file is named by its hash, so
/// a seam of another version never loads this one's), loads it and hands it the import table.
/// Returns the path to pass to IREE as `--executable_plugin`.
pub fn install() -> Result<PathBuf, IreeError> {
    static INSTALLED: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    INSTALLED.get_or_init(|| install_once().map_err(|e| e.to_string())).clone().map_err(IreeError::Runtime)
}

fn install_once() -> Result<PathBuf, IreeError> {
    let digest = Sha256::digest(PLUGIN_LIBRARY);
    let hash: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    let dir = home::iree_cache_dir();
    let path = dir.join(format!("kernels-plugin-{hash}.so"));
    let current = std::fs::read(&path).is_ok_and(|bytes| bytes == PLUGIN_LIBRARY);
    if !current {
        std::fs::create_dir_all(&dir).map_err(|e| IreeError::io(&dir, e))?;
        atomic_write::write(&path, PLUGIN_LIBRARY).map_err(|e| IreeError::io(&path, e))?;
    }
    // SAFETY: the library is seam's own plugin (checked byte for byte above); loading it runs no
    // initializers beyond the C runtime's.
    let library = unsafe { libloading::Library::new(&path) }
        .map_err(|e| IreeError::Runtime(format!("loading the kernels plugin {}: {e}", path.display())))?;
    {
        // SAFETY: the symbol has this signature in plugin/kernels_plugin.c.
        let set_table: libloading::Symbol<'_, unsafe extern "C" fn(*const Entry, usize)> =
            unsafe { library.get(b"seam_kernels_plugin_set_table\0") }
                .map_err(|e| IreeError::Runtime(format!("the kernels plugin {} is not seam's: {e}", path.display())))?;
        // SAFETY: the table is static, as the plugin requires.
        unsafe { set_table(TABLE.0.as_ptr(), TABLE.0.len()) };
    }
    // Never unloaded: IREE's executables hold pointers into it for the life of the process.
    std::mem::forget(library);
    Ok(path)
}

/// The kernels' instruction set, chosen once.
fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(Isa::best)
}

thread_local! {
    /// A one-thread pool per IREE worker: each call runs on its caller alone.
    static ONE_THREAD: Pool = Pool::new(1);
}

/// Arguments of `seam_f16_rows(x, x_off, w, w_off, out, out_off, k, row0, rows)`: rows
/// `row0..row0 + rows` of `out = W x` for one token, `W` `[n, k]` row-major f16.
#[repr(C)]
struct F16Rows {
    x: *const f32,
    x_offset: usize,
    w: *const u16,
    w_offset: usize,
    out: *mut f32,
    out_offset: usize,
    k: usize,
    row0: usize,
    rows: usize,
}

/// Runs `body`, turning a panic into a failed call (it must not unwind into IREE's C frames).
fn guarded(body: impl FnOnce() -> bool) -> c_int {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(true) => 0,
        _ => 1,
    }
}

unsafe extern "C" fn seam_f16_rows(params: *mut c_void, _context: *mut c_void, _reserved: *mut c_void) -> c_int {
    // SAFETY: IREE passes the packed arguments the executable declared for this import.
    let p = unsafe { &*(params as *const F16Rows) };
    guarded(|| {
        // SAFETY: the executable's bindings hold `k` inputs, `[n, k]` weights and `n` outputs,
        // of which this workgroup's rows are `row0..row0 + rows` (written by it alone).
        let (x, w, out) = unsafe {
            (
                std::slice::from_raw_parts(p.x.add(p.x_offset), p.k),
                std::slice::from_raw_parts(p.w.add(p.w_offset + p.row0 * p.k), p.rows * p.k),
                std::slice::from_raw_parts_mut(p.out.add(p.out_offset + p.row0), p.rows),
            )
        };
        let w = F16Matrix { data: w, rows: p.rows, cols: p.k };
        ONE_THREAD.with(|pool| matmul_f16(isa(), pool, x, 1, w, out).is_ok())
    })
}

/// A `local-task` device whose executables can call seam's kernels: the plugin is installed and
/// named in IREE's flags (once per process: IREE's plugin list only grows) before the device is
/// created, with the task system set as `task` says.
pub fn cpu_device_with_kernels(task: &crate::task_flags::TaskSettings) -> Result<iree_runtime::Device, IreeError> {
    static FLAGGED: std::sync::Mutex<bool> = std::sync::Mutex::new(false);
    let path = install()?;
    let mut flagged = FLAGGED.lock().unwrap_or_else(|p| p.into_inner());
    let mut flags = task.flags();
    if !*flagged {
        flags.push(format!("--executable_plugin={}", path.display()));
    }
    let _guard = crate::task_flags::set(&flags)?;
    *flagged = true;
    Ok(iree_runtime::Device::create("local-task")?)
}
