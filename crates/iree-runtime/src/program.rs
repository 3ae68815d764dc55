//! Compiled modules in a VM context, and invoking their functions.

use crate::buffer::BufferView;
use crate::device::Device;
use crate::error::{check, Error, Result};
use crate::{host_allocator, instance, string_view, sys};
use std::ptr::NonNull;

/// A compiled module (`.vmfb`) loaded beside IREE's HAL module (bound to one [`Device`]) in a
/// VM context of its own.
pub struct Program {
    context: NonNull<sys::iree_vm_context_t>,
    device: Device,
    /// IREE's bytecode module reads the archive in place for as long as the context lives.
    _archive: Box<[u8]>,
}

// SAFETY: a VM context may move between threads; it is not used from two at once (`!Sync`).
unsafe impl Send for Program {}

impl Program {
    /// Loads `vmfb` for `device`.
    pub fn load(device: &Device, vmfb: Vec<u8>) -> Result<Program> {
        let instance = instance()?;
        let archive = vmfb.into_boxed_slice();
        let mut hal = std::ptr::null_mut();
        // SAFETY: the instance and the device group are live; the module retains the group.
        check(
            unsafe {
                sys::iree_hal_module_create(
                    instance,
                    sys::iree_hal_module_device_policy_default(),
                    device.group.as_ptr(),
                    sys::iree_hal_module_flag_bits_t_IREE_HAL_MODULE_FLAG_SYNCHRONOUS as _,
                    sys::iree_hal_module_debug_sink_null(),
                    host_allocator(),
                    &mut hal,
                )
            },
            "creating the HAL module",
        )?;
        let mut bytecode = std::ptr::null_mut();
        // SAFETY: the archive is kept in the returned Program, which outlives the context that
        // holds the module; a null archive allocator tells IREE not to free it.
        let status = unsafe {
            sys::iree_vm_bytecode_module_create(
                instance,
                sys::iree_vm_bytecode_module_flags_e_IREE_VM_BYTECODE_MODULE_FLAG_NONE as _,
                sys::iree_const_byte_span_t { data: archive.as_ptr(), data_length: archive.len() },
                sys::iree_allocator_t { self_: std::ptr::null_mut(), ctl: None },
                host_allocator(),
                &mut bytecode,
            )
        };
        if let Err(e) = check(status, "loading the compiled module") {
            // SAFETY: the HAL module reference is owned here.
            unsafe { sys::iree_vm_module_release(hal) };
            return Err(e);
        }
        let mut modules = [hal, bytecode];
        let mut context = std::ptr::null_mut();
        // SAFETY: both modules are live; the context retains them, so this function's references
        // are released whatever the outcome.
        let status = unsafe {
            let status = sys::iree_vm_context_create_with_modules(
                instance,
                sys::iree_vm_context_flag_bits_t_IREE_VM_CONTEXT_FLAG_NONE as _,
                modules.len(),
                modules.as_mut_ptr(),
                host_allocator(),
                &mut context,
            );
            sys::iree_vm_module_release(hal);
            sys::iree_vm_module_release(bytecode);
            status
        };
        check(status, "creating the VM context")?;
        let context = NonNull::new(context).ok_or_else(|| Error::new("IREE made no VM context"))?;
        Ok(Program { context, device: device.clone(), _archive: archive })
    }

    /// The exported function `name` (`module.function`).
    pub fn function(&self, name: &str) -> Result<Function<'_>> {
        let mut function = sys::iree_vm_function_t::default();
        // SAFETY: the context is live; `name` outlives the call.
        check(
            unsafe { sys::iree_vm_context_resolve_function(self.context.as_ptr(), string_view(name), &mut function) },
            &format!("finding function {name}"),
        )?;
        Ok(Function { program: self, raw: function, name: name.to_string() })
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: this value owns one reference; the archive is dropped after the context.
        unsafe { sys::iree_vm_context_release(self.context.as_ptr()) };
    }
}

/// An exported function of a [`Program`].
pub struct Function<'p> {
    program: &'p Program,
    raw: sys::iree_vm_function_t,
    name: String,
}

/// A VM list of buffer views, released on drop.
struct List(NonNull<sys::iree_vm_list_t>);

impl List {
    fn new(capacity: usize) -> Result<List> {
        let mut list = std::ptr::null_mut();
        // SAFETY: an untyped list (any ref) of `capacity`.
        check(
            unsafe {
                sys::iree_vm_list_create(sys::iree_vm_type_def_t::default(), capacity, host_allocator(), &mut list)
            },
            "creating a VM list",
        )?;
        NonNull::new(list).map(List).ok_or_else(|| Error::new("IREE made no VM list"))
    }

    fn push(&mut self, view: &BufferView) -> Result<()> {
        // SAFETY: the view is live; the list takes the new reference on success, and a failed
        // push leaves it here to release.
        unsafe {
            let mut value = sys::iree_hal_buffer_view_retain_ref(view.raw.as_ptr());
            let status = sys::iree_vm_list_push_ref_move(self.0.as_ptr(), &mut value);
            sys::iree_vm_ref_release(&mut value);
            check(status, "passing an argument")
        }
    }

    fn len(&self) -> usize {
        // SAFETY: the list is live.
        unsafe { sys::iree_vm_list_size(self.0.as_ptr()) }
    }

    /// Element `index` as a buffer view, owned by the caller.
    fn view(&self, index: usize, device: &Device) -> Result<BufferView> {
        let mut value = sys::iree_vm_ref_t::default();
        // SAFETY: the list is live; `value` receives a retained ref, released below after the
        // view took a reference of its own.
        unsafe {
            check(sys::iree_vm_list_get_ref_retain(self.0.as_ptr(), index, &mut value), "reading a result")?;
            let mut view = std::ptr::null_mut();
            let status = sys::iree_hal_buffer_view_check_deref(value, &mut view);
            if status.is_null() && !view.is_null() {
                sys::iree_hal_buffer_view_retain(view);
            }
            sys::iree_vm_ref_release(&mut value);
            check(status, &format!("result {index} is not a buffer view"))?;
            let view = NonNull::new(view).ok_or_else(|| Error::new(format!("result {index} is empty")))?;
            Ok(BufferView::from_owned(view, device.clone()))
        }
    }
}

impl Drop for List {
    fn drop(&mut self) {
        // SAFETY: this value owns the list.
        unsafe { sys::iree_vm_list_release(self.0.as_ptr()) };
    }
}

impl Function<'_> {
    /// Calls the function with `inputs` (each retained for the call) and returns its results,
    /// all of which must be buffer views. A function that aliases an input to an output writes
    /// into the input's storage; the caller should drop its handle on that input afterwards.
    pub fn invoke(&self, inputs: &[&BufferView]) -> Result<Vec<BufferView>> {
        let mut arguments = List::new(inputs.len())?;
        for input in inputs {
            arguments.push(input)?;
        }
        let results = List::new(4)?;
        // SAFETY: the context, the function (resolved from it) and both lists are live.
        check(
            unsafe {
                sys::iree_vm_invoke(
                    self.program.context.as_ptr(),
                    self.raw,
                    sys::iree_vm_invocation_flag_bits_t_IREE_VM_INVOCATION_FLAG_NONE as _,
                    std::ptr::null(),
                    arguments.0.as_ptr(),
                    results.0.as_ptr(),
                    host_allocator(),
                )
            },
            &format!("calling {}", self.name),
        )?;
        (0..results.len()).map(|i| results.view(i, &self.program.device)).collect()
    }
}
