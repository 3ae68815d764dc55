//! # pjrt-runtime: a thin safe layer over an OpenXLA PJRT plugin
//!
//! A PJRT plugin is a shared library exporting `GetPjrtApi`, a table of C functions that compile
//! and run XLA programs on one kind of device (the XLA CPU plugin, a CUDA plugin, ...). This crate
//! loads a plugin at run time and wraps the part of its C API that seam's compiler backend uses:
//!
//! - [`Plugin::load`]: `dlopen`, the API version check, one-time initialization.
//! - [`Client`]: devices, compiling StableHLO text ([`Client::compile`]), deserializing a
//!   compiled executable ([`Client::deserialize`]), host-to-device copies
//!   ([`Client::buffer_from_host`]) in every element type the graphs use, f16 included.
//! - [`Buffer`]: device memory that stays resident until dropped; device-to-host copies.
//! - [`LoadedExecutable`]: execution with explicit donation ([`ExecuteArg`]), serialization.
//! - [`ffi`]: host functions registered as XLA custom-call targets through the plugin's FFI
//!   extension ([`Plugin::register_ffi_handler`]), and the call frames they receive.
//! - Every failure is a [`PjrtError`] carrying the plugin's message and status code.
//!
//! The raw bindings ([`sys`]) are generated at build time by bindgen from the `pjrt_c_api.h` the
//! plugin wheel ships; `docs/adr/0007-pjrt-binding.md` records why seam does not use the `pjrt`
//! crate from crates.io.
//!
//! Thread safety: PJRT clients, buffers and executables are thread-safe objects in the C API's
//! contract, so the wrappers are `Send + Sync`; a buffer donated to an execution is consumed by
//! value, so it cannot be used afterwards.

mod buffer;
mod client;
mod compile_options;
mod error;
mod executable;
pub mod ffi;
mod plugin;

/// The C API as bindgen generates it from the plugin's header.
#[allow(non_upper_case_globals, non_camel_case_types, non_snake_case, dead_code, clippy::all)]
pub mod sys {
    include!(concat!(env!("OUT_DIR"), "/pjrt_c_api.rs"));
}

pub use buffer::{Buffer, ElementType, HostMemory};
pub use client::{Client, DeviceInfo};
pub use compile_options::CompileOptions;
pub use error::{ErrorCode, PjrtError};
pub use executable::{Completion, ExecuteArg, Launched, LoadedExecutable};
pub use plugin::{ApiVersion, Plugin, HEADER_VERSION};

/// Results of this crate.
pub type Result<T> = std::result::Result<T, PjrtError>;

/// A fresh argument struct of the C API with its `struct_size` set (the C API's versioning: the
/// plugin reads only the fields a caller of that size knows about).
macro_rules! args {
    ($ty:ident) => {
        $crate::sys::$ty { struct_size: std::mem::size_of::<$crate::sys::$ty>(), ..Default::default() }
    };
    ($ty:ident { $($field:ident : $value:expr),* $(,)? }) => {
        $crate::sys::$ty { struct_size: std::mem::size_of::<$crate::sys::$ty>(), $($field: $value,)* ..Default::default() }
    };
}

/// Calls `$function` of `$plugin`'s API table with `$args`, turning a returned `PJRT_Error` into
/// a [`PjrtError`]. A function the plugin's (older) table does not have is
/// [`PjrtError::MissingFunction`].
macro_rules! call {
    ($plugin:expr, $function:ident, $args:expr) => {{
        let plugin: &$crate::Plugin = &$plugin;
        match plugin.function(
            std::mem::offset_of!($crate::sys::PJRT_Api, $function),
            |api| api.$function,
            stringify!($function),
        ) {
            Ok(f) => {
                // SAFETY: the table entry comes from the plugin's API of a checked major version,
                // and the argument struct is the one the header declares for this function.
                let error = unsafe { f($args) };
                plugin.check(error, stringify!($function))
            }
            Err(e) => Err(e),
        }
    }};
}

pub(crate) use {args, call};
