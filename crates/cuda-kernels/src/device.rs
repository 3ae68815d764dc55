//! A GPU to run the kernels on outside XLA: device memory, copies and timing through the driver
//! API, for the probe (`cuda-kernels-probe`) that checks and times the kernels on their own and
//! for the tuner ([`crate::tune`]) that picks their tilings before XLA runs them.

use crate::driver::{driver_symbol, CuResult, CudaError, Driver, Stream};
use std::ffi::{c_char, c_int, c_uint, c_void};

/// The driver calls of a [`Device`], resolved together before any is made.
struct Calls {
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    driver_get_version: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CuResult,
    device_name: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> CuResult,
    primary_retain: unsafe extern "C" fn(*mut *mut c_void, c_int) -> CuResult,
    primary_release: unsafe extern "C" fn(c_int) -> CuResult,
    ctx_push: unsafe extern "C" fn(*mut c_void) -> CuResult,
    ctx_pop: unsafe extern "C" fn(*mut *mut c_void) -> CuResult,
    stream_create: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CuResult,
    stream_destroy: unsafe extern "C" fn(*mut c_void) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(u64) -> CuResult,
    memset: unsafe extern "C" fn(u64, u8, usize, *mut c_void) -> CuResult,
    copy_to: unsafe extern "C" fn(u64, *const c_void, usize) -> CuResult,
    copy_on_device: unsafe extern "C" fn(u64, u64, usize, *mut c_void) -> CuResult,
    copy_from: unsafe extern "C" fn(*mut c_void, u64, usize) -> CuResult,
    event_create: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CuResult,
    event_record: unsafe extern "C" fn(*mut c_void, *mut c_void) -> CuResult,
    event_synchronize: unsafe extern "C" fn(*mut c_void) -> CuResult,
    event_elapsed: unsafe extern "C" fn(*mut f32, *mut c_void, *mut c_void) -> CuResult,
    event_destroy: unsafe extern "C" fn(*mut c_void) -> CuResult,
    stream_synchronize: unsafe extern "C" fn(*mut c_void) -> CuResult,
    begin_capture: unsafe extern "C" fn(*mut c_void, c_int) -> CuResult,
    end_capture: unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> CuResult,
    graph_instantiate: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, u64) -> CuResult,
    graph_launch: unsafe extern "C" fn(*mut c_void, *mut c_void) -> CuResult,
    graph_exec_destroy: unsafe extern "C" fn(*mut c_void) -> CuResult,
    graph_destroy: unsafe extern "C" fn(*mut c_void) -> CuResult,
}

impl Calls {
    fn resolve() -> Result<Calls, CudaError> {
        // SAFETY: each field's type is the C signature of the driver function it is named after.
        unsafe {
            Ok(Calls {
                init: driver_symbol("cuInit")?,
                driver_get_version: driver_symbol("cuDriverGetVersion")?,
                device_get: driver_symbol("cuDeviceGet")?,
                device_name: driver_symbol("cuDeviceGetName")?,
                primary_retain: driver_symbol("cuDevicePrimaryCtxRetain")?,
                primary_release: driver_symbol("cuDevicePrimaryCtxRelease_v2")?,
                ctx_push: driver_symbol("cuCtxPushCurrent_v2")?,
                ctx_pop: driver_symbol("cuCtxPopCurrent_v2")?,
                stream_create: driver_symbol("cuStreamCreate")?,
                stream_destroy: driver_symbol("cuStreamDestroy_v2")?,
                mem_alloc: driver_symbol("cuMemAlloc_v2")?,
                mem_free: driver_symbol("cuMemFree_v2")?,
                memset: driver_symbol("cuMemsetD8Async")?,
                copy_to: driver_symbol("cuMemcpyHtoD_v2")?,
                copy_on_device: driver_symbol("cuMemcpyDtoDAsync_v2")?,
                copy_from: driver_symbol("cuMemcpyDtoH_v2")?,
                event_create: driver_symbol("cuEventCreate")?,
                event_record: driver_symbol("cuEventRecord")?,
                event_synchronize: driver_symbol("cuEventSynchronize")?,
                event_elapsed: driver_symbol("cuEventElapsedTime")?,
                event_destroy: driver_symbol("cuEventDestroy_v2")?,
                stream_synchronize: driver_symbol("cuStreamSynchronize")?,
                begin_capture: driver_symbol("cuStreamBeginCapture_v2")?,
                end_capture: driver_symbol("cuStreamEndCapture")?,
                graph_instantiate: driver_symbol("cuGraphInstantiateWithFlags")?,
                graph_launch: driver_symbol("cuGraphLaunch")?,
                graph_exec_destroy: driver_symbol("cuGraphExecDestroy")?,
                graph_destroy: driver_symbol("cuGraphDestroy")?,
            })
        }
    }
}

/// A GPU's primary context (the one XLA's CUDA plugin works in too) made current on this thread,
/// with a stream of its own. On drop the stream is destroyed, and the context is made no longer
/// current here and released.
pub struct Device {
    driver: &'static Driver,
    calls: Calls,
    name: String,
    driver_version: i32,
    device: c_int,
    stream: *mut c_void,
}

/// `CU_STREAM_CAPTURE_MODE_GLOBAL`: the strictest mode (no thread may make a call that is unsafe
/// during a capture, such as loading a module), which the kernels' launch must survive.
const CAPTURE_MODE_GLOBAL: c_int = 0;

/// Work captured from the device's stream into a CUDA graph and instantiated, as XLA's command
/// buffers capture custom calls; destroyed on drop.
pub struct Graph<'a> {
    device: &'a Device,
    graph: *mut c_void,
    exec: *mut c_void,
}

impl Graph<'_> {
    /// Launches the graph on the device's stream.
    pub fn launch(&self) -> Result<(), CudaError> {
        let device = self.device;
        // SAFETY: an instantiated graph of this device's context.
        device.driver.check(unsafe { (device.calls.graph_launch)(self.exec, device.stream) }, "cuGraphLaunch")
    }
}

impl Drop for Graph<'_> {
    fn drop(&mut self) {
        let calls = &self.device.calls;
        // SAFETY: the graph and its instance, created by `Device::capture`, destroyed once.
        unsafe {
            if !self.exec.is_null() {
                (calls.graph_exec_destroy)(self.exec);
            }
            if !self.graph.is_null() {
                (calls.graph_destroy)(self.graph);
            }
        }
    }
}

/// A device allocation, freed on drop.
pub struct DeviceBuffer<'a> {
    device: &'a Device,
    /// The device address.
    pub ptr: u64,
    /// Its size in bytes.
    pub len: usize,
}

impl Drop for DeviceBuffer<'_> {
    fn drop(&mut self) {
        // SAFETY: an allocation of this device's, freed once.
        unsafe { (self.device.calls.mem_free)(self.ptr) };
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        let calls = &self.calls;
        let mut popped = std::ptr::null_mut();
        // SAFETY: the stream, context push and retain of `open_ordinal`, each undone once (after
        // the stream's work, which destroying a stream waits for).
        unsafe {
            (calls.stream_destroy)(self.stream);
            (calls.ctx_pop)(&mut popped);
            (calls.primary_release)(self.device);
        }
    }
}

impl Device {
    /// Opens the driver, GPU 0 and its primary context.
    pub fn open() -> Result<Device, CudaError> {
        Device::open_ordinal(0)
    }

    /// Opens the driver, the GPU of ordinal `ordinal` (the `N` of `cuda:N`) and its primary
    /// context.
    pub fn open_ordinal(ordinal: usize) -> Result<Device, CudaError> {
        let driver = Driver::get()?;
        let calls = Calls::resolve()?;
        let check = |result, call| driver.check(result, call);
        let ordinal = c_int::try_from(ordinal).map_err(|_| CudaError(format!("no GPU of ordinal {ordinal}")))?;
        let (mut driver_version, mut device) = (0, 0);
        let mut name = [0 as c_char; 256];
        let mut context = std::ptr::null_mut();
        // SAFETY: driver calls with out parameters this function owns.
        unsafe {
            check((calls.init)(0), "cuInit")?;
            check((calls.driver_get_version)(&mut driver_version), "cuDriverGetVersion")?;
            check((calls.device_get)(&mut device, ordinal), "cuDeviceGet")?;
            check((calls.device_name)(name.as_mut_ptr(), name.len() as c_int, device), "cuDeviceGetName")?;
            check((calls.primary_retain)(&mut context, device), "cuDevicePrimaryCtxRetain")?;
        }
        // SAFETY: the context retained above, released below if it cannot be made current.
        if let Err(e) = check(unsafe { (calls.ctx_push)(context) }, "cuCtxPushCurrent") {
            // SAFETY: the retain above, undone once.
            unsafe { (calls.primary_release)(device) };
            return Err(e);
        }
        let mut stream = std::ptr::null_mut();
        // SAFETY: the driver writes a new stream of the current context.
        if let Err(e) = check(unsafe { (calls.stream_create)(&mut stream, 0) }, "cuStreamCreate") {
            let mut popped = std::ptr::null_mut();
            // SAFETY: the push and the retain above, undone once.
            unsafe {
                (calls.ctx_pop)(&mut popped);
                (calls.primary_release)(device);
            }
            return Err(e);
        }
        // SAFETY: the driver wrote a NUL-terminated name.
        let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
        Ok(Device { driver, calls, name, driver_version, device, stream })
    }

    /// The GPU's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The driver's CUDA version (`cuDriverGetVersion`: 1000 major + 10 minor).
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    /// The driver, which launches the kernels.
    pub fn driver(&self) -> &'static Driver {
        self.driver
    }

    /// The device's own stream.
    pub fn stream(&self) -> Stream {
        Stream(self.stream)
    }

    /// A device copy of `bytes`.
    pub fn upload(&self, bytes: &[u8]) -> Result<DeviceBuffer<'_>, CudaError> {
        let buffer = self.alloc(bytes.len())?;
        // SAFETY: a fresh allocation of that size; the copy is synchronous.
        self.driver.check(
            unsafe { (self.calls.copy_to)(buffer.ptr, bytes.as_ptr() as *const c_void, bytes.len()) },
            "cuMemcpyHtoD",
        )?;
        Ok(buffer)
    }

    /// Queues a copy of `from` into `to` (the smaller's length) on the stream.
    pub fn copy(&self, to: &DeviceBuffer, from: &DeviceBuffer) -> Result<(), CudaError> {
        // SAFETY: two allocations of this device, each at least that long.
        self.driver.check(
            unsafe { (self.calls.copy_on_device)(to.ptr, from.ptr, to.len.min(from.len), self.stream) },
            "cuMemcpyDtoDAsync",
        )
    }

    /// `len` bytes of device memory, zeroed (on the stream: before any work queued after).
    pub fn zeroed(&self, len: usize) -> Result<DeviceBuffer<'_>, CudaError> {
        let buffer = self.alloc(len)?;
        // SAFETY: an allocation of this device of that size, on its stream.
        self.driver.check(unsafe { (self.calls.memset)(buffer.ptr, 0, len, self.stream) }, "cuMemsetD8Async")?;
        Ok(buffer)
    }

    /// `len` bytes of uninitialized device memory.
    pub fn alloc(&self, len: usize) -> Result<DeviceBuffer<'_>, CudaError> {
        let mut ptr = 0u64;
        // SAFETY: the driver writes the address of a new allocation.
        self.driver.check(unsafe { (self.calls.mem_alloc)(&mut ptr, len.max(1)) }, "cuMemAlloc")?;
        Ok(DeviceBuffer { device: self, ptr, len })
    }

    /// The contents of `buffer`, after the stream's work is done.
    pub fn download(&self, buffer: &DeviceBuffer) -> Result<Vec<u8>, CudaError> {
        self.synchronize()?;
        let mut bytes = vec![0u8; buffer.len];
        // SAFETY: a host buffer of the allocation's size; the copy is synchronous.
        self.driver.check(
            unsafe { (self.calls.copy_from)(bytes.as_mut_ptr() as *mut c_void, buffer.ptr, buffer.len) },
            "cuMemcpyDtoH",
        )?;
        Ok(bytes)
    }

    /// Waits for the stream's work.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: this device's stream.
        self.driver.check(unsafe { (self.calls.stream_synchronize)(self.stream) }, "cuStreamSynchronize")
    }

    /// The device time `work` takes on the stream, in milliseconds, between two events.
    pub fn time(&self, work: impl FnOnce() -> Result<(), CudaError>) -> Result<f32, CudaError> {
        let (mut start, mut end) = (std::ptr::null_mut(), std::ptr::null_mut());
        let mut ms = 0f32;
        // SAFETY: events of this context, recorded on its stream around the work, destroyed
        // below whatever happened.
        let timed = unsafe {
            self.driver
                .check((self.calls.event_create)(&mut start, 0), "cuEventCreate")
                .and_then(|()| self.driver.check((self.calls.event_create)(&mut end, 0), "cuEventCreate"))
                .and_then(|()| self.driver.check((self.calls.event_record)(start, self.stream), "cuEventRecord"))
                .and_then(|()| work())
                .and_then(|()| self.driver.check((self.calls.event_record)(end, self.stream), "cuEventRecord"))
                .and_then(|()| self.driver.check((self.calls.event_synchronize)(end), "cuEventSynchronize"))
                .and_then(|()| self.driver.check((self.calls.event_elapsed)(&mut ms, start, end), "cuEventElapsedTime"))
        };
        for event in [start, end] {
            if !event.is_null() {
                // SAFETY: an event created above, destroyed once.
                unsafe { (self.calls.event_destroy)(event) };
            }
        }
        timed.map(|()| ms)
    }

    /// `work`'s launches on the stream captured into a graph (global capture mode), instantiated.
    /// The capture is ended whatever `work` returns, so that the stream is usable after an error.
    pub fn capture(&self, work: impl FnOnce() -> Result<(), CudaError>) -> Result<Graph<'_>, CudaError> {
        let check = |result, call| self.driver.check(result, call);
        // SAFETY: this device's stream; the capture is ended below on every path.
        check(unsafe { (self.calls.begin_capture)(self.stream, CAPTURE_MODE_GLOBAL) }, "cuStreamBeginCapture")?;
        let worked = work();
        let mut graph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above; the driver writes the graph (null if it failed).
        let ended = check(unsafe { (self.calls.end_capture)(self.stream, &mut graph) }, "cuStreamEndCapture");
        let mut captured = Graph { device: self, graph, exec: std::ptr::null_mut() };
        if graph.is_null() {
            worked?;
            ended?;
            return Err(CudaError("cuStreamEndCapture returned no graph".to_string()));
        }
        worked?;
        ended?;
        // SAFETY: a graph just captured; the driver writes its instance.
        check(unsafe { (self.calls.graph_instantiate)(&mut captured.exec, graph, 0) }, "cuGraphInstantiate")?;
        Ok(captured)
    }
}
