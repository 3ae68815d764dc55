//! # iree-runtime: a thin safe layer over IREE's runtime C API
//!
//! seam's IREE backend compiles its graphs with IREE's compiler library and runs them with IREE's
//! runtime, built from source by the `eerie-sys` crate (IREE 3.13). This crate wraps the part of
//! the runtime's C API the backend uses, over `eerie-sys`'s generated bindings:
//!
//! - [`Device`]: a HAL device of one driver (`local-task` for the CPU, `cuda`), created with
//!   its own device group, as IREE's HAL module wants it.
//! - [`BufferView`]: a typed, shaped buffer on a device, either copied from host bytes
//!   ([`Device::upload`]) or, on a device whose memory is the host's, *imported* from host memory
//!   the caller keeps alive ([`Device::import_host`]): the device reads those pages in place, so a
//!   memory-mapped weights file is paged in on demand and counted once in the process.
//! - [`Program`] and [`Function`]: a compiled module (`.vmfb`) loaded with the HAL module into a
//!   VM context, and one of its exported functions invoked with buffer views.
//! - Every failure is an [`Error`] carrying IREE's status message.
//!
//! Why not the `eerie` crate's runtime wrapper (which seam used before, and whose compiler wrapper
//! it still uses): it can only create buffers by copying host data, so a 2.5 GB model was held
//! twice and copied at every start (`docs/adr/0020-own-iree-runtime-layer.md`).
//!
//! Thread safety: IREE's HAL objects (devices, buffers, buffer views) are reference counted with
//! atomic counts and safe to use from any thread, so [`Device`] and [`BufferView`] are
//! `Send + Sync`. A VM context is not safe for concurrent invocations, so [`Program`] and
//! [`Function`] are `Send` only.

mod buffer;
mod device;
mod error;
mod program;

pub use buffer::{BufferView, ElementType, HostMemory, IMPORT_ALIGNMENT};
pub use device::Device;
pub use error::{Error, Result};
pub use program::{Function, Program};

use eerie_sys::runtime as sys;
use std::sync::OnceLock;

// IREE's libc allocator, declared here because IREE's headers only expose it through a `static
// inline` helper (`iree_allocator_system`) that bindgen does not emit.
extern "C" {
    fn iree_allocator_libc_ctl(
        self_: *mut std::ffi::c_void,
        command: sys::iree_allocator_command_t,
        params: *const std::ffi::c_void,
        inout_ptr: *mut *mut std::ffi::c_void,
    ) -> sys::iree_status_t;
}

/// The host allocator every object of this crate is created with: IREE's system allocator.
pub(crate) fn host_allocator() -> sys::iree_allocator_t {
    sys::iree_allocator_t { self_: std::ptr::null_mut(), ctl: Some(iree_allocator_libc_ctl) }
}

/// A string view of `s` (which must outlive the call it is passed to).
pub(crate) fn string_view(s: &str) -> sys::iree_string_view_t {
    sys::iree_string_view_t { data: s.as_ptr().cast(), size: s.len() }
}

/// The process's one VM instance, with the HAL's types registered.
///
/// IREE keeps the registration of a ref type (buffer views, devices...) in process-global
/// variables that an instance's destruction clears, so the instance is created once and never
/// released: a second instance, or a released first one, would unregister the types under every
/// live context.
pub(crate) fn instance() -> Result<*mut sys::iree_vm_instance_t> {
    static INSTANCE: OnceLock<std::result::Result<usize, Error>> = OnceLock::new();
    let created = INSTANCE.get_or_init(|| {
        let mut instance = std::ptr::null_mut();
        // SAFETY: plain constructor; `instance` receives an owned reference.
        error::check(
            unsafe {
                sys::iree_vm_instance_create(
                    sys::IREE_VM_TYPE_CAPACITY_DEFAULT as usize,
                    host_allocator(),
                    &mut instance,
                )
            },
            "creating the VM instance",
        )?;
        // SAFETY: `instance` is live (never released, see above).
        error::check(unsafe { sys::iree_hal_module_register_all_types(instance) }, "registering the HAL types")?;
        Ok(instance as usize)
    });
    created.clone().map(|ptr| ptr as *mut sys::iree_vm_instance_t)
}
