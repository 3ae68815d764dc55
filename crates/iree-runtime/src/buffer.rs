//! Typed buffer views: copied from host bytes, imported from host memory, read back.

use crate::device::Device;
use crate::error::{check, Error, Result};
use crate::sys;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

/// Host memory a device may read in place: an imported buffer keeps a clone until IREE releases
/// the buffer, so the memory (a mapped file, say) outlives every use of it.
pub type HostMemory = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// The alignment IREE's heap buffers require of imported host memory
/// (`IREE_HAL_HEAP_BUFFER_ALIGNMENT`); memory less aligned is copied instead.
pub const IMPORT_ALIGNMENT: usize = 64;

/// The element types of seam's graphs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElementType {
    F32,
    F16,
    I32,
    I8,
}

impl ElementType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            ElementType::F32 | ElementType::I32 => 4,
            ElementType::F16 => 2,
            ElementType::I8 => 1,
        }
    }

    fn raw(self) -> sys::iree_hal_element_type_t {
        (match self {
            ElementType::F32 => sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_FLOAT_32,
            ElementType::F16 => sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_FLOAT_16,
            ElementType::I32 => sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_INT_32,
            ElementType::I8 => sys::iree_hal_element_types_t_IREE_HAL_ELEMENT_TYPE_INT_8,
        }) as sys::iree_hal_element_type_t
    }

    fn from_raw(raw: sys::iree_hal_element_type_t) -> Option<ElementType> {
        [ElementType::F32, ElementType::F16, ElementType::I32, ElementType::I8].into_iter().find(|e| e.raw() == raw)
    }
}

/// A typed, shaped view of a buffer on a [`Device`]. Cloning shares the buffer.
pub struct BufferView {
    pub(crate) raw: NonNull<sys::iree_hal_buffer_view_t>,
    device: Device,
    imported: bool,
}

// SAFETY: buffer views are immutable, reference-counted HAL objects; reads go through the
// device's thread-safe transfer queue.
unsafe impl Send for BufferView {}
// SAFETY: as above.
unsafe impl Sync for BufferView {}

/// Bytes of a dense `shape` tensor of `element`; `None` past `usize`.
fn tensor_bytes(shape: &[usize], element: ElementType) -> Option<usize> {
    shape.iter().try_fold(element.size(), |n, &d| n.checked_mul(d))
}

/// Bytes of `shape` elements of `element`, or an error naming the mismatch with `len`.
fn check_len(shape: &[usize], element: ElementType, len: usize) -> Result<()> {
    match tensor_bytes(shape, element) {
        Some(expected) if expected == len => Ok(()),
        _ => Err(Error::new(format!("{len} bytes do not hold a {shape:?} tensor of {element:?}"))),
    }
}

/// Parameters of a buffer the device's dispatches read and write.
fn device_params(access: u32) -> sys::iree_hal_buffer_params_t {
    sys::iree_hal_buffer_params_t {
        usage: sys::iree_hal_buffer_usage_bits_t_IREE_HAL_BUFFER_USAGE_DEFAULT as _,
        access: access as _,
        type_: sys::iree_hal_memory_type_bits_t_IREE_HAL_MEMORY_TYPE_DEVICE_LOCAL as _,
        queue_affinity: 0,
        min_alignment: 0,
    }
}

impl Device {
    /// A new buffer holding a copy of `bytes`, a dense row-major `shape` tensor of `element`
    /// (little-endian, as every host seam builds for).
    pub fn upload(&self, bytes: &[u8], element: ElementType, shape: &[usize]) -> Result<BufferView> {
        check_len(shape, element, bytes.len())?;
        let mut view = std::ptr::null_mut();
        // SAFETY: the device and its allocator are live; `shape` and `bytes` outlive the call,
        // which copies `bytes` before returning.
        check(
            unsafe {
                sys::iree_hal_buffer_view_allocate_buffer_copy(
                    self.raw.as_ptr(),
                    self.allocator(),
                    shape.len(),
                    shape.as_ptr().cast(),
                    element.raw(),
                    sys::iree_hal_encoding_types_t_IREE_HAL_ENCODING_TYPE_DENSE_ROW_MAJOR as _,
                    device_params(sys::iree_hal_memory_access_bits_t_IREE_HAL_MEMORY_ACCESS_ALL),
                    sys::iree_const_byte_span_t { data: bytes.as_ptr(), data_length: bytes.len() },
                    &mut view,
                )
            },
            "allocating a buffer",
        )?;
        let raw = NonNull::new(view).ok_or_else(|| Error::new("IREE made no buffer view"))?;
        Ok(BufferView { raw, device: self.clone(), imported: false })
    }

    /// A zero-filled dense row-major `shape` tensor of `element`. On a device whose memory is the
    /// host's ([`Device::host_memory`]) it is made in place: allocated, then its whole pages given
    /// back to the system ([`host_pages::zero`]), so they read as zeros and cost a page fault
    /// only where a dispatch first touches them. Elsewhere (a GPU) it is a copy of zeros.
    pub fn zeros(&self, element: ElementType, shape: &[usize]) -> Result<BufferView> {
        let len = tensor_bytes(shape, element)
            .ok_or_else(|| Error::new(format!("a {shape:?} tensor of {element:?} is too large")))?;
        if !self.host_memory() || len == 0 {
            return self.upload(&vec![0u8; len], element, shape);
        }
        let mut buffer = std::ptr::null_mut();
        // SAFETY: the allocator is live; the new buffer's one reference is this function's.
        check(
            unsafe {
                sys::iree_hal_allocator_allocate_buffer(
                    self.allocator(),
                    device_params(sys::iree_hal_memory_access_bits_t_IREE_HAL_MEMORY_ACCESS_ALL),
                    len as _,
                    &mut buffer,
                )
            },
            "allocating a buffer",
        )?;
        let view = self.view_of_owned(buffer, element, shape)?;
        let mut mapping = sys::iree_hal_buffer_mapping_t::default();
        // SAFETY: the buffer is live and new: no dispatch uses it; the mapping covers all of it.
        check(
            unsafe {
                sys::iree_hal_buffer_map_range(
                    sys::iree_hal_buffer_view_buffer(view.raw.as_ptr()),
                    sys::iree_hal_mapping_mode_bits_t_IREE_HAL_MAPPING_MODE_SCOPED as _,
                    sys::iree_hal_memory_access_bits_t_IREE_HAL_MEMORY_ACCESS_DISCARD_WRITE as _,
                    0,
                    len as _,
                    &mut mapping,
                )
            },
            "mapping a new buffer",
        )?;
        // SAFETY: the mapping's `data_length` bytes are the new buffer's host memory, which
        // nothing else uses.
        unsafe { host_pages::zero(mapping.contents.data, mapping.contents.data_length) };
        // SAFETY: the mapping was made above and is unmapped once.
        check(unsafe { sys::iree_hal_buffer_unmap_range(&mut mapping) }, "unmapping a new buffer")?;
        Ok(view)
    }

    /// A view of `buffer` (whose one reference this function takes over and releases) as a dense
    /// row-major `shape` tensor of `element`.
    fn view_of_owned(
        &self,
        buffer: *mut sys::iree_hal_buffer_t,
        element: ElementType,
        shape: &[usize],
    ) -> Result<BufferView> {
        let mut view = std::ptr::null_mut();
        // SAFETY: `buffer` is live (one reference is this function's, released below; the view
        // retains its own).
        let status = unsafe {
            let status = sys::iree_hal_buffer_view_create(
                buffer,
                shape.len(),
                shape.as_ptr().cast(),
                element.raw(),
                sys::iree_hal_encoding_types_t_IREE_HAL_ENCODING_TYPE_DENSE_ROW_MAJOR as _,
                crate::host_allocator(),
                &mut view,
            );
            sys::iree_hal_buffer_release(buffer);
            status
        };
        check(status, "viewing a buffer")?;
        let raw = NonNull::new(view).ok_or_else(|| Error::new("IREE made no buffer view"))?;
        Ok(BufferView { raw, device: self.clone(), imported: false })
    }

    /// A read-only buffer over `memory[range]` (a dense row-major `shape` tensor of `element`).
    ///
    /// On a device whose memory is the host's ([`Device::host_memory`]) and with the range
    /// aligned to [`IMPORT_ALIGNMENT`], the buffer *is* that memory: nothing is copied, pages
    /// are read when a dispatch first touches them, and `memory` is kept alive until IREE
    /// releases the buffer. Anywhere else (a GPU, unaligned bytes) it is a copy, as
    /// [`Device::upload`] makes. [`BufferView::is_imported`] says which happened.
    pub fn import_host(
        &self,
        memory: HostMemory,
        range: Range<usize>,
        element: ElementType,
        shape: &[usize],
    ) -> Result<BufferView> {
        let whole = (*memory).as_ref();
        let bytes = whole
            .get(range.clone())
            .ok_or_else(|| Error::new(format!("bytes {range:?} lie outside the {} bytes given", whole.len())))?;
        check_len(shape, element, bytes.len())?;
        if !self.host_memory() || !(bytes.as_ptr() as usize).is_multiple_of(IMPORT_ALIGNMENT) || bytes.is_empty() {
            return self.upload(bytes, element, shape);
        }
        let data = bytes.as_ptr() as *mut std::ffi::c_void;
        let len = bytes.len();
        // Owned by IREE's buffer from a successful import on; released by its callback.
        let keep: *mut HostMemory = Box::into_raw(Box::new(memory));
        let mut external = sys::iree_hal_external_buffer_t {
            type_: sys::iree_hal_external_buffer_type_e_IREE_HAL_EXTERNAL_BUFFER_TYPE_HOST_ALLOCATION as _,
            flags: 0,
            size: len as _,
            ..Default::default()
        };
        external.handle.host_allocation.ptr = data;
        let release =
            sys::iree_hal_buffer_release_callback_t { fn_: Some(release_host_memory), user_data: keep.cast() };
        let mut buffer = std::ptr::null_mut();
        // SAFETY: the allocator is live; `data` stays valid until `release` runs, because `keep`
        // holds the memory; the device only reads it (READ access; the mapping may be read-only).
        let imported = check(
            unsafe {
                sys::iree_hal_allocator_import_buffer(
                    self.allocator(),
                    device_params(sys::iree_hal_memory_access_bits_t_IREE_HAL_MEMORY_ACCESS_READ),
                    &mut external,
                    release,
                    &mut buffer,
                )
            },
            "importing host memory",
        );
        if let Err(e) = imported {
            // A failed import never calls the release callback.
            // SAFETY: `keep` came from `Box::into_raw` above and nobody else owns it.
            drop(unsafe { Box::from_raw(keep) });
            return Err(e);
        }
        let mut view = self.view_of_owned(buffer, element, shape)?;
        view.imported = true;
        Ok(view)
    }
}

/// IREE's release callback of an imported buffer: drops the memory's keep-alive.
unsafe extern "C" fn release_host_memory(user_data: *mut std::ffi::c_void, _buffer: *mut sys::iree_hal_buffer_t) {
    // SAFETY: `user_data` is the `Box<HostMemory>` leaked by `import_host`, released once here.
    drop(Box::from_raw(user_data as *mut HostMemory));
}

impl BufferView {
    /// Wraps a view this value now owns one reference of.
    pub(crate) fn from_owned(raw: NonNull<sys::iree_hal_buffer_view_t>, device: Device) -> BufferView {
        BufferView { raw, device, imported: false }
    }

    /// The element type, if it is one of seam's.
    pub fn element_type(&self) -> Option<ElementType> {
        // SAFETY: the view is live.
        ElementType::from_raw(unsafe { sys::iree_hal_buffer_view_element_type(self.raw.as_ptr()) })
    }

    /// The dimensions (empty for a scalar).
    pub fn shape(&self) -> Vec<usize> {
        // SAFETY: the view is live and its dims array holds `rank` values.
        unsafe {
            let rank = sys::iree_hal_buffer_view_shape_rank(self.raw.as_ptr());
            let dims = sys::iree_hal_buffer_view_shape_dims(self.raw.as_ptr());
            if rank == 0 || dims.is_null() {
                return Vec::new();
            }
            std::slice::from_raw_parts(dims, rank).to_vec()
        }
    }

    /// Bytes of the contents.
    pub fn byte_length(&self) -> usize {
        // SAFETY: the view is live.
        unsafe { sys::iree_hal_buffer_view_byte_length(self.raw.as_ptr()) as usize }
    }

    /// Whether the buffer is host memory imported by [`Device::import_host`] rather than a copy.
    pub fn is_imported(&self) -> bool {
        self.imported
    }

    /// Copies the contents to the host (waiting for the device's work on it to finish).
    pub fn read_bytes(&self) -> Result<Vec<u8>> {
        let len = self.byte_length();
        let mut out = vec![0u8; len];
        // SAFETY: the device and buffer are live; `out` has room for `len` bytes.
        check(
            unsafe {
                sys::iree_hal_device_transfer_d2h(
                    self.device.raw.as_ptr(),
                    sys::iree_hal_buffer_view_buffer(self.raw.as_ptr()),
                    0,
                    out.as_mut_ptr().cast(),
                    len as _,
                    sys::iree_hal_transfer_buffer_flag_bits_t_IREE_HAL_TRANSFER_BUFFER_FLAG_DEFAULT as _,
                    sys::iree_timeout_t { type_: sys::iree_timeout_type_e_IREE_TIMEOUT_ABSOLUTE as _, nanos: i64::MAX },
                )
            },
            "reading a buffer back",
        )?;
        Ok(out)
    }

    /// Sets every byte to zero through a host mapping of the buffer (no copy, no new memory);
    /// an error where the buffer cannot be mapped (device memory of a GPU).
    pub fn zero(&self) -> Result<()> {
        // SAFETY: the buffer is live; the whole of it is written.
        check(
            unsafe {
                sys::iree_hal_buffer_map_zero(
                    sys::iree_hal_buffer_view_buffer(self.raw.as_ptr()),
                    0,
                    self.byte_length() as _,
                )
            },
            "zeroing a buffer",
        )
    }

    /// The contents as values of `T` (whose size must be the element type's).
    pub fn read<T: bytemuck::Pod>(&self) -> Result<Vec<T>> {
        let element = self.element_type().ok_or_else(|| Error::new("a buffer of an element type seam does not use"))?;
        if element.size() != std::mem::size_of::<T>() {
            return Err(Error::new(format!("a buffer of {element:?} read as {}", std::any::type_name::<T>())));
        }
        Ok(bytemuck::pod_collect_to_vec(&self.read_bytes()?))
    }
}

impl Clone for BufferView {
    fn clone(&self) -> Self {
        // SAFETY: the view is live; the clone owns a new reference.
        unsafe { sys::iree_hal_buffer_view_retain(self.raw.as_ptr()) };
        BufferView { raw: self.raw, device: self.device.clone(), imported: self.imported }
    }
}

impl Drop for BufferView {
    fn drop(&mut self) {
        // SAFETY: this value owns one reference.
        unsafe { sys::iree_hal_buffer_view_release(self.raw.as_ptr()) };
    }
}

impl std::fmt::Debug for BufferView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferView").field("element", &self.element_type()).field("shape", &self.shape()).finish()
    }
}
