//! Device buffers and their element types.

use crate::client::Client;
use crate::error::PjrtError;
use crate::{args, call, sys, Result};
use std::sync::Arc;

/// Element types of the buffers seam's graphs use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElementType {
    F32,
    F16,
    BF16,
    S32,
    S8,
    U8,
}

impl ElementType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            ElementType::F32 | ElementType::S32 => 4,
            ElementType::F16 | ElementType::BF16 => 2,
            ElementType::S8 | ElementType::U8 => 1,
        }
    }

    pub(crate) fn to_sys(self) -> sys::PJRT_Buffer_Type {
        use sys::PJRT_Buffer_Type as T;
        match self {
            ElementType::F32 => T::PJRT_Buffer_Type_F32,
            ElementType::F16 => T::PJRT_Buffer_Type_F16,
            ElementType::BF16 => T::PJRT_Buffer_Type_BF16,
            ElementType::S32 => T::PJRT_Buffer_Type_S32,
            ElementType::S8 => T::PJRT_Buffer_Type_S8,
            ElementType::U8 => T::PJRT_Buffer_Type_U8,
        }
    }
}

/// Host memory that a buffer may alias instead of copying ([`Client::buffer_aliasing_host`]):
/// the bytes must stay valid and unchanged as long as anything holds the `Arc`.
pub type HostMemory = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// Host memory lent to the plugin, and the event that says when the plugin is done with it.
pub(crate) struct Lent {
    pub(crate) memory: HostMemory,
    pub(crate) done: *mut sys::PJRT_Event,
}

/// Memory on a device, resident until dropped.
pub struct Buffer {
    pub(crate) client: Arc<Client>,
    pub(crate) raw: *mut sys::PJRT_Buffer,
    /// Host memory the buffer may alias, released only once the plugin says it is done with it.
    pub(crate) lent: Option<Lent>,
}

// SAFETY: PJRT buffers may be used from any thread; the wrapper hands out no interior pointers.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer").field("raw", &self.raw).finish()
    }
}

impl Buffer {
    /// The buffer's dimensions.
    pub fn dims(&self) -> Result<Vec<usize>> {
        let mut a = args!(PJRT_Buffer_Dimensions_Args { buffer: self.raw });
        call!(self.client.plugin(), PJRT_Buffer_Dimensions, &mut a)?;
        if a.dims.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: the plugin returned `num_dims` values living as long as the buffer.
        let dims = unsafe { std::slice::from_raw_parts(a.dims, a.num_dims) };
        Ok(dims.iter().map(|&d| d as usize).collect())
    }

    /// Bytes the buffer occupies on its device.
    pub fn on_device_size(&self) -> Result<usize> {
        let mut a = args!(PJRT_Buffer_OnDeviceSizeInBytes_Args { buffer: self.raw });
        call!(self.client.plugin(), PJRT_Buffer_OnDeviceSizeInBytes, &mut a)?;
        Ok(a.on_device_size_in_bytes)
    }

    /// Bytes a host copy takes (dense, row-major).
    pub fn host_size(&self) -> Result<usize> {
        let mut a = args!(PJRT_Buffer_ToHostBuffer_Args { src: self.raw });
        call!(self.client.plugin(), PJRT_Buffer_ToHostBuffer, &mut a)?;
        Ok(a.dst_size)
    }

    /// Copies the buffer into `out`, which must be exactly [`Buffer::host_size`] bytes; waits for
    /// the copy (and for the computation producing the buffer, whose error it reports).
    pub fn copy_to_host(&self, out: &mut [u8]) -> Result<()> {
        let need = self.host_size()?;
        if out.len() != need {
            return Err(PjrtError::InvalidArgument(format!("a {need}-byte buffer copied into {} bytes", out.len())));
        }
        let mut a =
            args!(PJRT_Buffer_ToHostBuffer_Args { src: self.raw, dst: out.as_mut_ptr().cast(), dst_size: out.len() });
        call!(self.client.plugin(), PJRT_Buffer_ToHostBuffer, &mut a)?;
        self.client.plugin().await_event(a.event)
    }

    /// The buffer's bytes on the host.
    pub fn to_host(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.host_size()?];
        self.copy_to_host(&mut out)?;
        Ok(out)
    }

    /// Waits until the buffer's contents are ready (the computation producing them has run);
    /// that computation's error if it failed.
    pub fn wait_ready(&self) -> Result<()> {
        let mut a = args!(PJRT_Buffer_ReadyEvent_Args { buffer: self.raw });
        call!(self.client.plugin(), PJRT_Buffer_ReadyEvent, &mut a)?;
        self.client.plugin().await_event(a.event)
    }

    /// Sets every byte of the buffer to zero in place, once its contents are ready: no copy and
    /// no new memory.
    ///
    /// # Safety
    /// The plugin's buffers must be host memory (a CPU plugin's, whose [`Buffer::device_address`]
    /// is a host address), and no computation may be reading or writing this buffer.
    pub unsafe fn zero_host_memory(&self) -> Result<()> {
        let (address, len) = self.ready_memory()?;
        // SAFETY: by the caller's promise the buffer's `len` bytes at `address` are host memory
        // that nothing else touches now.
        unsafe { std::ptr::write_bytes(address, 0, len) };
        Ok(())
    }

    /// Once the buffer's contents are ready, the address and size of its memory on the device
    /// (host memory on a CPU plugin); an error for a buffer without an address.
    pub(crate) fn ready_memory(&self) -> Result<(*mut u8, usize)> {
        self.wait_ready()?;
        let (address, len) = (self.device_address()?, self.on_device_size()?);
        if address == 0 {
            return Err(PjrtError::InvalidArgument("a buffer without an address".into()));
        }
        Ok((address as *mut u8, len))
    }

    /// The address of the buffer's memory on its device (a host address on a CPU plugin): what
    /// shows whether a buffer made by [`Client::buffer_aliasing_host`] aliases the host bytes.
    pub fn device_address(&self) -> Result<usize> {
        let mut a = args!(PJRT_Buffer_UnsafePointer_Args { buffer: self.raw });
        call!(self.client.plugin(), PJRT_Buffer_UnsafePointer, &mut a)?;
        Ok(a.buffer_pointer as usize)
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let mut a = args!(PJRT_Buffer_Destroy_Args { buffer: self.raw });
        // A failure to free cannot be reported from drop; the plugin logs its own errors.
        let _ = call!(self.client.plugin(), PJRT_Buffer_Destroy, &mut a);
        if let Some(lent) = self.lent.take() {
            // The plugin may still read the host memory until this event (an execution in flight
            // holds the buffer past its destruction); only then may the memory go.
            let _ = self.client.plugin().await_event(lent.done);
            drop(lent.memory);
        }
    }
}
