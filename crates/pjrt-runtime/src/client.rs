//! A PJRT client: the plugin's devices, compilation, and host-to-device copies.

use crate::buffer::{Buffer, ElementType, HostMemory, Lent};
use crate::compile_options::CompileOptions;
use crate::error::PjrtError;
use crate::executable::LoadedExecutable;
use crate::plugin::Plugin;
use crate::{args, call, sys, Result};
use std::sync::Arc;

/// A client of one plugin, on its first addressable device.
pub struct Client {
    plugin: Arc<Plugin>,
    raw: *mut sys::PJRT_Client,
    device: *mut sys::PJRT_Device,
    device_count: usize,
}

// SAFETY: a PJRT client is thread-safe by the C API's contract.
unsafe impl Send for Client {}
unsafe impl Sync for Client {}

/// What the plugin says about its platform and device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The platform (`cpu`, `cuda`, ...).
    pub platform: String,
    /// The platform's version string.
    pub platform_version: String,
    /// The device kind (`cpu`, `NVIDIA H100 80GB HBM3`, ...).
    pub kind: String,
    /// Addressable devices of the client.
    pub count: usize,
}

fn text(ptr: *const std::os::raw::c_char, len: usize) -> String {
    if ptr.is_null() {
        return String::new();
    }
    // SAFETY: callers pass a pointer and length the plugin returned.
    String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }).into_owned()
}

/// Uploads up to this size are copied by the plugin during the call ([`Client::buffer_from_host`]).
const SMALL_UPLOAD_BYTES: usize = 64 << 10;

impl Client {
    /// Creates a client with default options. Fails with [`PjrtError::NoDevice`] when the plugin
    /// loads but finds no device (a CUDA plugin on a machine without a GPU usually fails earlier,
    /// in `PJRT_Client_Create`, with the driver's message).
    pub fn new(plugin: Arc<Plugin>) -> Result<Arc<Client>> {
        let mut a = args!(PJRT_Client_Create_Args);
        call!(plugin, PJRT_Client_Create, &mut a)?;
        let mut client = Client { plugin, raw: a.client, device: std::ptr::null_mut(), device_count: 0 };
        let mut d = args!(PJRT_Client_AddressableDevices_Args { client: client.raw });
        call!(client.plugin, PJRT_Client_AddressableDevices, &mut d)?;
        if d.num_addressable_devices == 0 || d.addressable_devices.is_null() {
            return Err(PjrtError::NoDevice);
        }
        // SAFETY: the plugin returned `num_addressable_devices` (> 0) device pointers.
        client.device = unsafe { *d.addressable_devices };
        client.device_count = d.num_addressable_devices;
        Ok(Arc::new(client))
    }

    /// The plugin this client runs on.
    pub fn plugin(&self) -> &Plugin {
        &self.plugin
    }

    /// Platform, version and device kind.
    pub fn device_info(&self) -> Result<DeviceInfo> {
        let mut name = args!(PJRT_Client_PlatformName_Args { client: self.raw });
        call!(self.plugin, PJRT_Client_PlatformName, &mut name)?;
        let mut version = args!(PJRT_Client_PlatformVersion_Args { client: self.raw });
        call!(self.plugin, PJRT_Client_PlatformVersion, &mut version)?;
        let mut description = args!(PJRT_Device_GetDescription_Args { device: self.device });
        call!(self.plugin, PJRT_Device_GetDescription, &mut description)?;
        let mut kind = args!(PJRT_DeviceDescription_Kind_Args { device_description: description.device_description });
        call!(self.plugin, PJRT_DeviceDescription_Kind, &mut kind)?;
        Ok(DeviceInfo {
            platform: text(name.platform_name, name.platform_name_size),
            platform_version: text(version.platform_version, version.platform_version_size),
            kind: text(kind.device_kind, kind.device_kind_size),
            count: self.device_count,
        })
    }

    /// Compiles an MLIR module (StableHLO, text or bytecode) whose entry function is `@main`.
    pub fn compile(self: &Arc<Self>, mlir: &str, options: &CompileOptions) -> Result<LoadedExecutable> {
        let format = "mlir";
        let program = args!(PJRT_Program {
            code: mlir.as_ptr() as *mut std::os::raw::c_char,
            code_size: mlir.len(),
            format: format.as_ptr().cast(),
            format_size: format.len(),
        });
        let proto = options.to_proto_bytes();
        let mut a = args!(PJRT_Client_Compile_Args {
            client: self.raw,
            program: &program,
            compile_options: proto.as_ptr().cast(),
            compile_options_size: proto.len(),
        });
        call!(self.plugin, PJRT_Client_Compile, &mut a)?;
        LoadedExecutable::new(Arc::clone(self), a.executable)
    }

    /// Loads an executable that [`LoadedExecutable::serialize`] wrote (same plugin build only;
    /// the plugin rejects others with an error).
    pub fn deserialize(self: &Arc<Self>, bytes: &[u8]) -> Result<LoadedExecutable> {
        let mut a = args!(PJRT_Executable_DeserializeAndLoad_Args {
            client: self.raw,
            serialized_executable: bytes.as_ptr().cast(),
            serialized_executable_size: bytes.len(),
        });
        call!(self.plugin, PJRT_Executable_DeserializeAndLoad, &mut a)?;
        LoadedExecutable::new(Arc::clone(self), a.loaded_executable)
    }

    /// Copies `bytes` (row-major `dims` of `element`, little-endian) to a new buffer on the
    /// device. Returns once the plugin no longer reads `bytes`.
    pub fn buffer_from_host(self: &Arc<Self>, bytes: &[u8], element: ElementType, dims: &[usize]) -> Result<Buffer> {
        // A small buffer (a step's token and position) is copied by the plugin during the call
        // (`kImmutableOnlyDuringCall`), so the wait below returns at once; a large one is
        // transferred from `bytes` in place, without that extra copy, and waited for. On a GPU the
        // wait for a transfer is a round trip per argument, per step.
        let semantics = if bytes.len() <= SMALL_UPLOAD_BYTES {
            sys::PJRT_HostBufferSemantics::PJRT_HostBufferSemantics_kImmutableOnlyDuringCall
        } else {
            sys::PJRT_HostBufferSemantics::PJRT_HostBufferSemantics_kImmutableUntilTransferCompletes
        };
        let (raw, done) = self.upload(bytes, element, dims, semantics)?;
        let buffer = Buffer { client: Arc::clone(self), raw, lent: None };
        // `bytes` is borrowed only for this call: wait until the plugin is done with it.
        self.plugin.await_event(done)?;
        Ok(buffer)
    }

    /// A buffer of `memory[range]` (row-major `dims` of `element`) that the plugin may use in
    /// place instead of copying (`kImmutableZeroCopy`): XLA's CPU plugin aliases host memory that
    /// is suitably aligned, so weights mapped from a file are paged in on demand and held once.
    /// A plugin that cannot alias copies, as [`Client::buffer_from_host`] does. Either way the
    /// buffer keeps `memory` alive until the plugin is done with it.
    pub fn buffer_aliasing_host(
        self: &Arc<Self>,
        memory: HostMemory,
        range: std::ops::Range<usize>,
        element: ElementType,
        dims: &[usize],
    ) -> Result<Buffer> {
        let bytes = (*memory).as_ref().get(range.clone()).ok_or_else(|| {
            PjrtError::InvalidArgument(format!("bytes {range:?} of a {}-byte host memory", (*memory).as_ref().len()))
        })?;
        let semantics = sys::PJRT_HostBufferSemantics::PJRT_HostBufferSemantics_kImmutableZeroCopy;
        let (raw, done) = self.upload(bytes, element, dims, semantics)?;
        Ok(Buffer { client: Arc::clone(self), raw, lent: Some(Lent { memory, done }) })
    }

    /// `PJRT_Client_BufferFromHostBuffer` of `bytes` with `semantics`, after checking their size:
    /// the new buffer and the event of the plugin being done with `bytes`.
    fn upload(
        &self,
        bytes: &[u8],
        element: ElementType,
        dims: &[usize],
        semantics: sys::PJRT_HostBufferSemantics,
    ) -> Result<(*mut sys::PJRT_Buffer, *mut sys::PJRT_Event)> {
        let count: usize = dims.iter().product();
        if bytes.len() != count * element.size() {
            return Err(PjrtError::InvalidArgument(format!(
                "{} bytes for a {element:?} buffer of shape {dims:?} ({} expected)",
                bytes.len(),
                count * element.size()
            )));
        }
        let dims: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        let mut a = args!(PJRT_Client_BufferFromHostBuffer_Args {
            client: self.raw,
            data: bytes.as_ptr().cast(),
            type_: element.to_sys(),
            dims: dims.as_ptr(),
            num_dims: dims.len(),
            host_buffer_semantics: semantics,
            device: self.device,
        });
        call!(self.plugin, PJRT_Client_BufferFromHostBuffer, &mut a)?;
        Ok((a.buffer, a.done_with_host_buffer))
    }

    /// A zero-filled buffer made in place, for a plugin whose buffers are host memory: allocated
    /// uninitialized, then its whole pages given back to the system ([`host_pages::zero`]), so
    /// they read as zeros and cost a page fault only where a computation first touches them.
    /// Nothing is copied; a large cache costs what its use touches, not its size.
    ///
    /// # Safety
    /// The plugin's buffers must be host memory (a CPU plugin's, whose [`Buffer::device_address`]
    /// is a host address).
    pub unsafe fn host_zeros(self: &Arc<Self>, element: ElementType, dims: &[usize]) -> Result<Buffer> {
        let shape: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        let mut a = args!(PJRT_Client_CreateUninitializedBuffer_Args {
            client: self.raw,
            shape_dims: shape.as_ptr(),
            shape_num_dims: shape.len(),
            shape_element_type: element.to_sys(),
            device: self.device,
        });
        call!(self.plugin, PJRT_Client_CreateUninitializedBuffer, &mut a)?;
        let buffer = Buffer { client: Arc::clone(self), raw: a.buffer, lent: None };
        let (address, len) = buffer.ready_memory()?;
        let expected = dims.iter().product::<usize>() * element.size();
        if len < expected {
            return Err(PjrtError::InvalidArgument(format!(
                "a new {element:?} buffer of shape {dims:?} of {len} bytes ({expected} expected)"
            )));
        }
        // SAFETY: by the caller's promise the address is host memory; the buffer is new, so
        // nothing else reads or writes its `len` bytes.
        unsafe { host_pages::zero(address, len) };
        Ok(buffer)
    }

    /// A zero-filled buffer (through a host copy: the C API's uninitialized buffers are not
    /// guaranteed to be zero).
    pub fn zeros(self: &Arc<Self>, element: ElementType, dims: &[usize]) -> Result<Buffer> {
        let bytes = vec![0u8; dims.iter().product::<usize>() * element.size()];
        self.buffer_from_host(&bytes, element, dims)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let mut a = args!(PJRT_Client_Destroy_Args { client: self.raw });
        let _ = call!(self.plugin, PJRT_Client_Destroy, &mut a);
    }
}
