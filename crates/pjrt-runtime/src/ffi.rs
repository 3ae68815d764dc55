//! XLA's FFI through a PJRT plugin: registering a host function as a custom-call target, and the
//! C types of the call it receives.
//!
//! Neither header ships with the plugin wheel (`pjrt_c_api_ffi_extension.h`, XLA's
//! `xla/ffi/api/c_api.h`), so the few types seam uses are declared here by hand from the public
//! headers. Both APIs version their structs by size, and the prefixes declared here have been
//! stable since the FFI extension gained `register_handler` (extension version 2).
//!
//! A handler is a plain `extern "C" fn(*mut CallFrame) -> *mut XlaError`. Before XLA calls it for
//! real, registration calls it once with a metadata extension in the frame, which it must answer
//! with the FFI API version it was written for ([`CallFrame::answer_metadata`]).

use crate::error::PjrtError;
use crate::sys;
use crate::{Plugin, Result};
use std::ffi::c_void;

/// The XLA FFI API version these declarations follow.
pub const XLA_FFI_API_VERSION: (i32, i32) = (0, 1);

/// `XLA_FFI_Extension_Base`.
#[repr(C)]
pub struct ExtensionBase {
    pub struct_size: usize,
    pub kind: i32,
    pub next: *mut ExtensionBase,
}

/// `XLA_FFI_Extension_Metadata`: the extension type of a registration's metadata query.
const EXTENSION_METADATA: i32 = 1;

/// `XLA_FFI_Api_Version`.
#[repr(C)]
pub struct ApiVersion {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub major_version: i32,
    pub minor_version: i32,
}

/// `XLA_FFI_Metadata` (its first fields).
#[repr(C)]
struct Metadata {
    struct_size: usize,
    api_version: ApiVersion,
    traits: u32,
}

/// `XLA_FFI_Metadata_Extension`.
#[repr(C)]
struct MetadataExtension {
    base: ExtensionBase,
    metadata: *mut Metadata,
}

/// `XLA_FFI_DataType` values of the element types seam passes.
pub mod dtype {
    pub const S8: i32 = 2;
    pub const S32: i32 = 4;
    pub const U8: i32 = 6;
    pub const F16: i32 = 10;
    pub const F32: i32 = 11;
}

/// `XLA_FFI_Buffer`: an argument or result array.
#[repr(C)]
pub struct Buffer {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub dtype: i32,
    pub data: *mut c_void,
    pub rank: i64,
    pub dims: *mut i64,
}

impl Buffer {
    /// The dimensions.
    pub fn dims(&self) -> Vec<usize> {
        if self.rank <= 0 || self.dims.is_null() {
            return Vec::new();
        }
        // SAFETY: XLA passes `rank` dimensions at `dims`.
        unsafe { std::slice::from_raw_parts(self.dims, self.rank as usize) }
            .iter()
            .map(|&d| d.max(0) as usize)
            .collect()
    }

    /// The element count.
    pub fn len(&self) -> usize {
        self.dims().iter().product()
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `XLA_FFI_Args` / `XLA_FFI_Rets`: the same shape.
#[repr(C)]
pub struct List {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub size: i64,
    pub types: *mut i32,
    pub items: *mut *mut c_void,
}

/// `XLA_FFI_Attrs`.
#[repr(C)]
pub struct Attrs {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    pub size: i64,
    pub types: *mut i32,
    pub names: *mut *mut c_void,
    pub attrs: *mut *mut c_void,
}

/// `XLA_FFI_Api` (its prefix: up to the stream query).
#[repr(C)]
struct FfiApi {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    api_version: ApiVersion,
    internal_api: *mut c_void,
    error_create: Option<unsafe extern "C" fn(*mut ErrorCreateArgs) -> *mut XlaError>,
    error_get_message: *mut c_void,
    error_destroy: Option<unsafe extern "C" fn(*mut ErrorDestroyArgs)>,
    handler_register: *mut c_void,
    stream_get: Option<unsafe extern "C" fn(*mut StreamGetArgs) -> *mut XlaError>,
}

/// `XLA_FFI_Error_Destroy_Args`.
#[repr(C)]
struct ErrorDestroyArgs {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    error: *mut XlaError,
}

/// `XLA_FFI_Stream_Get_Args`.
#[repr(C)]
struct StreamGetArgs {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    ctx: *mut c_void,
    stream: *mut c_void,
}

#[repr(C)]
struct ErrorCreateArgs {
    struct_size: usize,
    extension_start: *mut ExtensionBase,
    message: *const std::ffi::c_char,
    errc: i32,
}

/// `XLA_FFI_Error`: opaque, owned by XLA once a handler returns it.
#[repr(C)]
pub struct XlaError {
    _private: [u8; 0],
}

/// `XLA_FFI_ExecutionStage_EXECUTE`.
const STAGE_EXECUTE: i32 = 3;
/// `XLA_FFI_ArgType_BUFFER` (and `XLA_FFI_RetType_BUFFER`).
const KIND_BUFFER: i32 = 1;
/// `XLA_FFI_Error_Code_INVALID_ARGUMENT`.
const INVALID_ARGUMENT: i32 = 3;

/// `XLA_FFI_CallFrame`: what one call of a handler receives.
#[repr(C)]
pub struct CallFrame {
    pub struct_size: usize,
    pub extension_start: *mut ExtensionBase,
    api: *const FfiApi,
    ctx: *mut c_void,
    stage: i32,
    args: List,
    rets: List,
    attrs: Attrs,
}

/// An FFI handler as XLA calls it.
pub type Handler = unsafe extern "C" fn(*mut CallFrame) -> *mut XlaError;

impl CallFrame {
    /// If this call is registration's metadata query, answers it (the API version of these
    /// declarations, no traits) and returns true: the handler must then return null at once.
    pub fn answer_metadata(&mut self) -> bool {
        self.answer_metadata_with(0)
    }

    /// [`CallFrame::answer_metadata`] for a handler registered with `traits` (`TRAIT_*`).
    pub fn answer_metadata_with(&mut self, traits: u32) -> bool {
        let mut ext = self.extension_start;
        while !ext.is_null() {
            // SAFETY: XLA's extension chain is a list of live `XLA_FFI_Extension_Base` nodes.
            let base = unsafe { &*ext };
            if base.kind == EXTENSION_METADATA {
                // SAFETY: a node of the metadata type is an `XLA_FFI_Metadata_Extension`.
                let metadata = unsafe { (*(ext as *mut MetadataExtension)).metadata };
                if !metadata.is_null() {
                    // SAFETY: XLA owns and passes writable metadata for the query.
                    let metadata = unsafe { &mut *metadata };
                    metadata.api_version.struct_size = std::mem::size_of::<ApiVersion>();
                    metadata.api_version.extension_start = std::ptr::null_mut();
                    metadata.api_version.major_version = XLA_FFI_API_VERSION.0;
                    metadata.api_version.minor_version = XLA_FFI_API_VERSION.1;
                    metadata.traits = traits;
                }
                return true;
            }
            ext = base.next;
        }
        false
    }

    /// Whether XLA is executing the call (rather than instantiating or preparing it).
    pub fn is_execute(&self) -> bool {
        self.stage == STAGE_EXECUTE
    }

    fn buffer<'a>(list: &'a List, index: usize, what: &str) -> std::result::Result<&'a Buffer, String> {
        if index >= list.size.max(0) as usize {
            return Err(format!("{what} {index} missing ({} passed)", list.size));
        }
        // SAFETY: XLA passes `size` kinds and items.
        let (kind, item) = unsafe { (*list.types.add(index), *list.items.add(index)) };
        if kind != KIND_BUFFER || item.is_null() {
            return Err(format!("{what} {index} is not an array"));
        }
        // SAFETY: an item of the buffer kind is an `XLA_FFI_Buffer`.
        Ok(unsafe { &*(item as *const Buffer) })
    }

    /// Argument `index`, which must be an array.
    pub fn arg(&self, index: usize) -> std::result::Result<&Buffer, String> {
        Self::buffer(&self.args, index, "argument")
    }

    /// Result `index`, which must be an array.
    pub fn ret(&self, index: usize) -> std::result::Result<&Buffer, String> {
        Self::buffer(&self.rets, index, "result")
    }

    /// Number of arguments.
    pub fn arg_count(&self) -> usize {
        self.args.size.max(0) as usize
    }

    /// Number of results.
    pub fn ret_count(&self) -> usize {
        self.rets.size.max(0) as usize
    }

    /// The platform stream the call runs on (a `CUstream` on XLA's CUDA backend), from XLA's
    /// `XLA_FFI_Stream_Get`; an error on a platform without streams (the CPU) or an API without
    /// the call.
    pub fn stream(&self) -> std::result::Result<*mut c_void, String> {
        if self.api.is_null() {
            return Err("the call frame has no FFI API".to_string());
        }
        // SAFETY: XLA's API table outlives the call; its size says which fields exist.
        let api = unsafe { &*self.api };
        let has_stream_get = api.struct_size >= std::mem::size_of::<FfiApi>();
        let stream_get = api.stream_get.filter(|_| has_stream_get).ok_or("XLA's FFI API has no stream query")?;
        let mut args = StreamGetArgs {
            struct_size: std::mem::size_of::<StreamGetArgs>(),
            extension_start: std::ptr::null_mut(),
            ctx: self.ctx,
            stream: std::ptr::null_mut(),
        };
        // SAFETY: the arguments are the call's own context and an out field.
        let error = unsafe { stream_get(&mut args) };
        if !error.is_null() {
            if let Some(destroy) = api.error_destroy {
                let mut args = ErrorDestroyArgs {
                    struct_size: std::mem::size_of::<ErrorDestroyArgs>(),
                    extension_start: std::ptr::null_mut(),
                    error,
                };
                // SAFETY: the error XLA just returned, owned by the caller.
                unsafe { destroy(&mut args) };
            }
            return Err("XLA_FFI_Stream_Get failed (a platform without streams)".to_string());
        }
        if args.stream.is_null() {
            return Err("XLA_FFI_Stream_Get gave no stream".to_string());
        }
        Ok(args.stream)
    }

    /// An `INVALID_ARGUMENT` error carrying `message`, for the handler to return (XLA owns it).
    pub fn error(&self, message: &str) -> *mut XlaError {
        let text = std::ffi::CString::new(message.replace('\0', " ")).unwrap_or_default();
        if self.api.is_null() {
            return std::ptr::null_mut();
        }
        // SAFETY: XLA's API table outlives the call; `error_create` copies the message.
        unsafe {
            let api = &*self.api;
            match api.error_create {
                Some(create) => {
                    let mut args = ErrorCreateArgs {
                        struct_size: std::mem::size_of::<ErrorCreateArgs>(),
                        extension_start: std::ptr::null_mut(),
                        message: text.as_ptr(),
                        errc: INVALID_ARGUMENT,
                    };
                    create(&mut args)
                }
                None => std::ptr::null_mut(),
            }
        }
    }
}

/// The newest C API version whose `PJRT_FFI_Register_Handler_Args` seam knows to have the layout
/// below: the pinned `xla-cpu-pjrt` plugin's (0.81) and JAX's `jax-cuda13-pjrt` 0.11.2 (0.115),
/// both read from their machine code (the `PJRT_FFI_Register_Handler` of each reads the platform
/// name's length at offset 40). Later headers insert an `api_version` field before `handler`,
/// without a new extension version; handing a plugin the other layout makes it throw a C++
/// exception, which aborts the process, so a newer plugin is refused rather than guessed at.
pub const NEWEST_KNOWN_FFI_LAYOUT: crate::ApiVersion = crate::ApiVersion { major: 0, minor: 115 };

/// `PJRT_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE`: a handler that always launches the same
/// device work for the same attributes, which a GPU plugin may then capture into a command buffer
/// (a CUDA graph) instead of splitting the buffer around the call.
pub const TRAIT_COMMAND_BUFFER_COMPATIBLE: u32 = 1;

/// `PJRT_FFI_Register_Handler_Args` as plugins up to [`NEWEST_KNOWN_FFI_LAYOUT`] declare it
/// (typed handlers only).
#[repr(C)]
struct RegisterHandlerArgs {
    struct_size: usize,
    target_name: *const std::ffi::c_char,
    target_name_size: usize,
    handler: *mut c_void,
    platform_name: *const std::ffi::c_char,
    platform_name_size: usize,
    traits: u32,
}

/// `PJRT_FFI_Extension`.
#[repr(C)]
struct FfiExtension {
    base: sys::PJRT_Extension_Base,
    type_id_register: *mut c_void,
    user_data_add: *mut c_void,
    register_handler: Option<unsafe extern "C" fn(*mut RegisterHandlerArgs) -> *mut sys::PJRT_Error>,
}

impl Plugin {
    /// Registers `handler` as the typed-FFI custom-call target `target` for `platform` (`cpu`,
    /// `CUDA`, ...) in this plugin's XLA, with `traits` (`TRAIT_*`). The registry is the
    /// plugin's, process-wide: a target is registered once per plugin, and a second registration
    /// of the same name is the plugin's to accept or refuse.
    ///
    /// Plugins newer than [`NEWEST_KNOWN_FFI_LAYOUT`] are refused (see there).
    pub fn register_ffi_handler(&self, target: &str, platform: &str, handler: Handler, traits: u32) -> Result<()> {
        let missing = |what: &str| PjrtError::InvalidArgument(format!("the PJRT plugin has no {what}"));
        if self.version() > NEWEST_KNOWN_FFI_LAYOUT {
            return Err(PjrtError::InvalidArgument(format!(
                "the plugin's C API {} is newer than {NEWEST_KNOWN_FFI_LAYOUT}, the newest whose FFI registration layout seam knows",
                self.version()
            )));
        }
        let mut ext = self.api().extension_start;
        let extension = loop {
            if ext.is_null() {
                return Err(missing("FFI extension"));
            }
            // SAFETY: the plugin's extension chain is a list of live `PJRT_Extension_Base` nodes.
            let base = unsafe { &*ext };
            if base.type_ == sys::PJRT_Extension_Type_PJRT_Extension_Type_FFI {
                break ext as *const FfiExtension;
            }
            ext = base.next;
        };
        // SAFETY: a node of the FFI type is a `PJRT_FFI_Extension`; its size says which fields exist.
        let extension = unsafe { &*extension };
        let has_register = extension.base.struct_size >= std::mem::size_of::<FfiExtension>();
        let register = extension
            .register_handler
            .filter(|_| has_register)
            .ok_or_else(|| missing("FFI handler registration (extension version 2)"))?;
        let mut args = RegisterHandlerArgs {
            struct_size: std::mem::size_of::<RegisterHandlerArgs>(),
            target_name: target.as_ptr() as *const std::ffi::c_char,
            target_name_size: target.len(),
            handler: handler as *mut c_void,
            platform_name: platform.as_ptr() as *const std::ffi::c_char,
            platform_name_size: platform.len(),
            traits,
        };
        // SAFETY: the argument struct is the extension's; the names are read during the call only.
        let error = unsafe { register(&mut args) };
        self.check(error, "PJRT_FFI_Register_Handler")
    }
}
