//! HAL devices.

use crate::error::{check, Error, Result};
use crate::{host_allocator, string_view, sys};
use std::ptr::NonNull;

/// A HAL device of one driver and the one-device group IREE's HAL module runs it in.
///
/// Cloning shares the device (IREE reference counts it).
pub struct Device {
    pub(crate) raw: NonNull<sys::iree_hal_device_t>,
    pub(crate) group: NonNull<sys::iree_hal_device_group_t>,
    host_memory: bool,
}

// SAFETY: HAL devices are thread-safe, reference-counted objects in IREE's API contract.
unsafe impl Send for Device {}
// SAFETY: as above; every method takes `&self` and IREE synchronizes internally.
unsafe impl Sync for Device {}

impl Device {
    /// Creates the default device of `driver` (`local-task`, `local-sync`, `cuda`: a driver
    /// linked into this build). The `local-*` drivers read IREE's process-wide flags (worker
    /// count, executable plugins) when they are created.
    pub fn create(driver: &str) -> Result<Device> {
        let mut registry = std::ptr::null_mut();
        // SAFETY: plain constructor; `registry` receives an owned registry freed below.
        check(unsafe { sys::iree_hal_driver_registry_allocate(host_allocator(), &mut registry) }, "driver registry")?;
        let created = (|| {
            // SAFETY: `registry` is live.
            check(unsafe { sys::iree_hal_register_all_available_drivers(registry) }, "registering the HAL drivers")?;
            let mut raw_driver = std::ptr::null_mut();
            // SAFETY: `registry` is live; `driver` outlives the call.
            check(
                unsafe {
                    sys::iree_hal_driver_registry_try_create(
                        registry,
                        string_view(driver),
                        host_allocator(),
                        &mut raw_driver,
                    )
                },
                &format!("creating IREE's {driver} driver"),
            )?;
            // SAFETY: the driver was just created; this reference is released after the device
            // (which retains what it needs) exists or failed.
            let device = unsafe { Self::default_device(raw_driver, driver) };
            unsafe { sys::iree_hal_driver_release(raw_driver) };
            device
        })();
        // SAFETY: drivers and devices made from the registry do not refer back to it.
        unsafe { sys::iree_hal_driver_registry_free(registry) };
        let (raw, group) = created?;
        Ok(Device { raw, group, host_memory: driver.starts_with("local-") })
    }

    /// The default device of `driver`, in a group of its own.
    ///
    /// # Safety
    /// `driver` is a live driver.
    unsafe fn default_device(
        driver: *mut sys::iree_hal_driver_t,
        name: &str,
    ) -> Result<(NonNull<sys::iree_hal_device_t>, NonNull<sys::iree_hal_device_group_t>)> {
        // A device takes its asynchronous I/O from a proactor pool (one proactor is plenty for
        // a device whose work is dispatches).
        let mut pool = std::ptr::null_mut();
        check(
            sys::iree_async_proactor_pool_create(
                1,
                std::ptr::null(),
                sys::iree_async_proactor_pool_options_default(),
                host_allocator(),
                &mut pool,
            ),
            "creating the proactor pool",
        )?;
        let params = sys::iree_hal_device_create_params_t { proactor_pool: pool, ..Default::default() };
        let mut device = std::ptr::null_mut();
        let status = sys::iree_hal_driver_create_default_device(driver, &params, host_allocator(), &mut device);
        // A created device retains the pool.
        sys::iree_async_proactor_pool_release(pool);
        check(status, &format!("creating the {name} device"))?;
        let device = NonNull::new(device).ok_or_else(|| Error::new(format!("the {name} driver made no device")))?;

        let mut tracker = std::ptr::null_mut();
        let mut group = std::ptr::null_mut();
        // The tracker's options are IREE's defaults (its helper is `static inline`, so not bound).
        let options =
            sys::iree_async_frontier_tracker_options_t { axis_table_capacity: 256, session_epoch: 1, machine_index: 0 };
        let mut status = sys::iree_async_frontier_tracker_create(options, host_allocator(), &mut tracker);
        if status.is_null() {
            status =
                sys::iree_hal_device_group_create_from_device(device.as_ptr(), tracker, host_allocator(), &mut group);
            // The group retains the tracker.
            sys::iree_async_frontier_tracker_release(tracker);
        }
        let grouped = check(status, "grouping the device")
            .and_then(|()| NonNull::new(group).ok_or_else(|| Error::new("IREE made no device group".to_string())));
        match grouped {
            Ok(group) => Ok((device, group)),
            Err(e) => {
                sys::iree_hal_device_release(device.as_ptr());
                Err(e)
            }
        }
    }

    /// Whether the device's memory is the host's (the `local-*` drivers): buffers can then be
    /// imported from host memory instead of copied ([`Device::import_host`]).
    pub fn host_memory(&self) -> bool {
        self.host_memory
    }

    pub(crate) fn allocator(&self) -> *mut sys::iree_hal_allocator_t {
        // SAFETY: the device is live; the allocator lives as long as the device.
        unsafe { sys::iree_hal_device_allocator(self.raw.as_ptr()) }
    }
}

impl Clone for Device {
    fn clone(&self) -> Self {
        // SAFETY: both objects are live; each clone owns one reference of each.
        unsafe {
            sys::iree_hal_device_retain(self.raw.as_ptr());
            sys::iree_hal_device_group_retain(self.group.as_ptr());
        }
        Device { raw: self.raw, group: self.group, host_memory: self.host_memory }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: this value owns one reference of each.
        unsafe {
            sys::iree_hal_device_group_release(self.group.as_ptr());
            sys::iree_hal_device_release(self.raw.as_ptr());
        }
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("host_memory", &self.host_memory).finish_non_exhaustive()
    }
}
