//! Settings of IREE's CPU task system (the `local-task` driver's worker pool).
//!
//! The driver takes its worker count and wake-up behaviour from IREE's process-wide command-line
//! flags, read when a driver is created; eerie creates drivers but has no way to pass them. So
//! the runtime thread sets the flags through IREE's own parser (`iree_flags_parse`, which eerie's
//! bindings leave out and is declared here) just before it creates its runtime, under one lock so
//! two loads with different settings cannot interleave.

use crate::error::IreeError;
use std::ffi::{c_char, c_int, CString};
use std::sync::{Mutex, MutexGuard};

/// Extra IREE runtime flags, space-separated (`--task_worker_spin_us=50`, ...), applied after
/// seam's own: for measuring the runtime's settings without a rebuild.
pub const RUNTIME_FLAGS_ENV: &str = "SEAM_IREE_RUNTIME_FLAGS";

/// IREE's own worker stack size (`--task_worker_stack_size`), sized for its generated code.
const IREE_WORKER_STACK: usize = 128 << 10;

/// The worker stack size where seam's kernels run on IREE's workers: what a Rust thread gets.
const KERNEL_WORKER_STACK: usize = 2 << 20;

/// The flag naming an executable plugin; IREE's list of them only grows (see [`set`]).
const PLUGIN_FLAG: &str = "--executable_plugin=";

/// The task system's settings for one runtime.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskSettings {
    /// Worker threads; `None` leaves IREE's choice (one per physical core).
    pub workers: Option<usize>,
    /// An executable plugin resolving the executables' imports (seam's kernels:
    /// [`crate::kernel_plugin::install`]); the workers then get a Rust thread's stack.
    pub plugin: Option<std::path::PathBuf>,
}

impl TaskSettings {
    /// The flags these settings stand for, then those of [`RUNTIME_FLAGS_ENV`]. Every flag seam
    /// sets is always given, so a setting of an earlier runtime never carries over.
    pub fn flags(&self) -> Vec<String> {
        // Workers that spin before sleeping (`--task_worker_spin_us`) were measured and left at
        // IREE's default, no spinning: decode did not change (docs/performance.md).
        let stack = if self.plugin.is_some() { KERNEL_WORKER_STACK } else { IREE_WORKER_STACK };
        let mut flags = vec![
            format!("--task_topology_group_count={}", self.workers.unwrap_or(0)),
            format!("--task_worker_stack_size={stack}"),
        ];
        flags.extend(self.plugin.iter().map(|path| format!("{PLUGIN_FLAG}{}", path.display())));
        if let Ok(extra) = std::env::var(RUNTIME_FLAGS_ENV) {
            flags.extend(extra.split_whitespace().map(str::to_string));
        }
        flags
    }
}

/// Held while flags are set and the runtime that reads them is created; holds the plugin flags
/// given so far.
static FLAGS_LOCK: Mutex<Vec<String>> = Mutex::new(Vec::new());

extern "C" {
    // iree/base/tooling/flags.h; part of the runtime library eerie links (its drivers define
    // their flags with it).
    fn iree_flags_parse(mode: u32, argc: *mut c_int, argv: *mut *mut *mut c_char) -> eerie_sys::runtime::iree_status_t;
}

/// `IREE_FLAGS_PARSE_MODE_CONTINUE_AFTER_HELP`: a `--help` in the environment's flags must not
/// end the process.
const CONTINUE_AFTER_HELP: u32 = 1 << 1;

/// Sets IREE's flags to `flags`; the returned guard keeps other threads from changing them until
/// the runtime that should see them exists. IREE appends each `--executable_plugin` to a list
/// that no later parse clears, so a plugin already given is not given again (a plugin stays
/// registered for every later runtime of the process, where it resolves only the imports of
/// executables that have them).
pub(crate) fn set(flags: &[String]) -> Result<MutexGuard<'static, Vec<String>>, IreeError> {
    let mut guard = FLAGS_LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let new: Vec<String> =
        flags.iter().filter(|f| !(f.starts_with(PLUGIN_FLAG) && guard.contains(f))).cloned().collect();
    let owned: Vec<CString> = std::iter::once("seam".to_string())
        .chain(new.iter().cloned())
        .map(|f| CString::new(f).map_err(|_| IreeError::Runtime("an IREE flag holds a NUL byte".into())))
        .collect::<Result<_, _>>()?;
    // IREE keeps string flags (`--executable_plugin=PATH`) as views of argv's strings, as a
    // program's argv lives as long as the process: so do these (a few short strings per load).
    let owned: &'static [CString] = Vec::leak(owned);
    // The parser reorders and shortens argv in place; it only reads the strings.
    let mut argv: Vec<*mut c_char> = owned.iter().map(|s| s.as_ptr() as *mut c_char).collect();
    let mut argc = argv.len() as c_int;
    let mut argv_ptr = argv.as_mut_ptr();
    // SAFETY: argc/argv describe `argv`, whose strings live for the rest of the process.
    let status = unsafe { iree_flags_parse(CONTINUE_AFTER_HELP, &mut argc, &mut argv_ptr) };
    if !status.is_null() {
        // SAFETY: a non-OK status is owned by the caller and freed exactly once.
        unsafe { eerie_sys::runtime::iree_status_ignore(status) };
        return Err(IreeError::Runtime(format!(
            "IREE refused the runtime flags {} (check {RUNTIME_FLAGS_ENV})",
            flags.join(" ")
        )));
    }
    guard.extend(new.into_iter().filter(|f| f.starts_with(PLUGIN_FLAG)));
    Ok(guard)
}

/// The `local-task` device of a runtime, created under `task`'s flags.
pub fn create_cpu_device(task: &TaskSettings) -> Result<iree_runtime::Device, IreeError> {
    let _guard = set(&task.flags())?;
    Ok(iree_runtime::Device::create("local-task")?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_flag_is_given_and_an_unknown_one_is_refused() {
        let flags = TaskSettings { workers: Some(2), plugin: None }.flags();
        assert_eq!(flags[0], "--task_topology_group_count=2");
        assert_eq!(flags[1], "--task_worker_stack_size=131072");
        assert!(set(&flags).is_ok());
        let err = set(&["--no_such_iree_flag=1".to_string()]).unwrap_err();
        assert!(err.to_string().contains("--no_such_iree_flag=1"), "{err}");
        // Back to the defaults for any later runtime of this process.
        assert!(set(&TaskSettings::default().flags()).is_ok());
    }
}
