//! The binding against the real XLA CPU plugin (the pinned `xla-cpu-pjrt==0.0.1` wheel that the
//! build already needs for its header, installed by `scripts/build-prereqs.sh` into
//! `llama_model::home::pjrt_plugin_dir()`, by default `.seam/pjrt`).

use pjrt_runtime::{Buffer, Client, CompileOptions, ElementType, ExecuteArg, PjrtError, Plugin, HEADER_VERSION};
use std::path::PathBuf;
use std::sync::Arc;

fn plugin_path() -> PathBuf {
    llama_model::home::pjrt_plugin_dir().join("xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so")
}

fn client() -> Arc<Client> {
    let plugin = Plugin::load(&plugin_path()).expect("the XLA CPU plugin loads");
    Client::new(plugin).expect("a CPU client")
}

fn f16_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| half_bits(*v).to_le_bytes()).collect()
}

/// f32 -> IEEE half bits for the small exact values used here (integers and halves).
fn half_bits(v: f32) -> u16 {
    if v == 0.0 {
        return 0;
    }
    let bits = v.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32 - 127 + 15;
    let mantissa = ((bits >> 13) & 0x3ff) as u16;
    sign | ((exp as u16) << 10) | mantissa
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn f32_values(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// `state` (f16, aliased to result 0 and donated) gets `x` added; result 1 is `w . x` in f32.
const PROGRAM: &str = r#"
module @binding_test {
  func.func @main(%state: tensor<4xf16> {tf.aliasing_output = 0 : i32}, %w: tensor<2x4xf32>, %x: tensor<4xf32>)
      -> (tensor<4xf16>, tensor<2xf32>) {
    %xh = "stablehlo.convert"(%x) : (tensor<4xf32>) -> tensor<4xf16>
    %next = "stablehlo.add"(%state, %xh) : (tensor<4xf16>, tensor<4xf16>) -> tensor<4xf16>
    %y = "stablehlo.dot_general"(%w, %x) {dot_dimension_numbers = #stablehlo.dot<lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [0]>} : (tensor<2x4xf32>, tensor<4xf32>) -> tensor<2xf32>
    "func.return"(%next, %y) : (tensor<4xf16>, tensor<2xf32>) -> ()
  }
}
"#;

#[test]
fn plugin_reports_its_version_and_device() {
    let plugin = Plugin::load(&plugin_path()).unwrap();
    assert_eq!(plugin.version().major, HEADER_VERSION.major);
    // Loaded once per process: a second load is the same object.
    assert!(Arc::ptr_eq(&plugin, &Plugin::load(&plugin_path()).unwrap()));
    let info = client().device_info().unwrap();
    assert_eq!(info.platform, "cpu");
    assert!(info.count >= 1);
}

#[test]
fn compiles_executes_donates_and_round_trips_through_serialization() {
    let client = client();
    let executable = client.compile(PROGRAM, &CompileOptions::default()).unwrap();
    assert_eq!(executable.num_outputs(), 2);
    let w = client
        .buffer_from_host(
            &[1f32, 2., 3., 4., 0., 1., 0., 1.].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>(),
            ElementType::F32,
            &[2, 4],
        )
        .unwrap();
    let x = client.buffer_from_host(&f32_bytes(&[1., 1., 1., 0.5]), ElementType::F32, &[4]).unwrap();
    let mut state: Buffer = client.buffer_from_host(&f16_bytes(&[1., 2., 3., 4.]), ElementType::F16, &[4]).unwrap();
    for step in 1..=3 {
        let mut out = executable
            .execute(vec![ExecuteArg::Donate(state), ExecuteArg::Keep(&w), ExecuteArg::Keep(&x)])
            .unwrap()
            .into_iter();
        state = out.next().unwrap();
        let y = f32_values(&out.next().unwrap().to_host().unwrap());
        assert_eq!(y, vec![8.0, 1.5], "step {step}");
        let expected: Vec<f32> =
            [1., 2., 3., 4.].iter().zip([1., 1., 1., 0.5]).map(|(a, b)| a + b * step as f32).collect();
        assert_eq!(state.to_host().unwrap(), f16_bytes(&expected), "step {step}: the state carried over");
    }
    assert_eq!(state.dims().unwrap(), vec![4]);

    // The kept weights are still intact after three executions.
    assert_eq!(f32_values(&w.to_host().unwrap())[..4], [1., 2., 3., 4.]);

    let bytes = executable.serialize().unwrap();
    let reloaded = client.deserialize(&bytes).unwrap();
    let mut out = reloaded
        .execute(vec![ExecuteArg::Donate(state), ExecuteArg::Keep(&w), ExecuteArg::Keep(&x)])
        .unwrap()
        .into_iter();
    let _ = out.next();
    assert_eq!(f32_values(&out.next().unwrap().to_host().unwrap()), vec![8.0, 1.5]);
}

/// Host bytes aligned to a cache line, as a prepared-weights file's mapped arguments are.
struct Aligned {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

// SAFETY: the allocation is owned and only read after construction.
unsafe impl Send for Aligned {}
unsafe impl Sync for Aligned {}

impl Aligned {
    fn new(bytes: &[u8]) -> Aligned {
        let layout = std::alloc::Layout::from_size_align(bytes.len().max(1), 64).unwrap();
        // SAFETY: a non-zero size; the copy stays inside the new allocation.
        let ptr = unsafe { std::alloc::alloc(layout) };
        assert!(!ptr.is_null());
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, bytes.len()) };
        Aligned { ptr, layout }
    }
}

impl AsRef<[u8]> for Aligned {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the allocation holds `layout.size()` initialized bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.layout.size()) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `new`.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

#[test]
fn aligned_host_memory_is_aliased_not_copied_and_outlives_its_owner() {
    let client = client();
    let executable = client.compile(PROGRAM, &CompileOptions::default()).unwrap();
    let values = [1f32, 2., 3., 4., 0., 1., 0., 1.];
    let host: pjrt_runtime::HostMemory = Arc::new(Aligned::new(&f32_bytes(&values)));
    let address = (*host).as_ref().as_ptr() as usize;
    let w = client.buffer_aliasing_host(Arc::clone(&host), 0..32, ElementType::F32, &[2, 4]).unwrap();
    assert_eq!(w.device_address().unwrap(), address, "XLA's CPU plugin aliases 64-byte aligned host memory");
    // The caller's handle goes; the buffer keeps the bytes alive.
    drop(host);
    let x = client.buffer_from_host(&f32_bytes(&[1., 1., 1., 0.5]), ElementType::F32, &[4]).unwrap();
    let state = client.buffer_from_host(&f16_bytes(&[0.; 4]), ElementType::F16, &[4]).unwrap();
    let out = executable.execute(vec![ExecuteArg::Donate(state), ExecuteArg::Keep(&w), ExecuteArg::Keep(&x)]).unwrap();
    assert_eq!(f32_values(&out[1].to_host().unwrap()), vec![8.0, 1.5]);
    assert_eq!(f32_values(&w.to_host().unwrap()), values);
    // A range past the memory, or of the wrong size, is refused before the plugin sees it.
    let small: pjrt_runtime::HostMemory = Arc::new(Aligned::new(&[0u8; 16]));
    assert!(matches!(
        client.buffer_aliasing_host(Arc::clone(&small), 0..32, ElementType::F32, &[8]),
        Err(PjrtError::InvalidArgument(_))
    ));
    assert!(matches!(
        client.buffer_aliasing_host(small, 0..16, ElementType::F32, &[8]),
        Err(PjrtError::InvalidArgument(_))
    ));
}

#[test]
fn mistakes_are_typed_errors() {
    let missing = PathBuf::from("/nonexistent/plugin.so");
    assert!(matches!(Plugin::load(&missing), Err(PjrtError::NotFound { .. })));
    let not_a_plugin = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    assert!(matches!(Plugin::load(&not_a_plugin), Err(PjrtError::Load { .. })));

    let client = client();
    let error = client.compile("this is not MLIR", &CompileOptions::default()).err().expect("bad program refused");
    assert!(matches!(error, PjrtError::Call { function: "PJRT_Client_Compile", .. }), "{error}");
    // The plugin's own parser message reaches the caller (the XLA CPU plugin files it as UNKNOWN).
    assert!(error.code().is_some() && error.to_string().contains("error:"), "{error}");

    let wrong_size = client.buffer_from_host(&[0u8; 6], ElementType::F32, &[2]);
    assert!(matches!(wrong_size, Err(PjrtError::InvalidArgument(_))));
    assert!(client.deserialize(b"not an executable").is_err());
}

/// What the handler's stream queries answered.
static STREAM_QUERY: std::sync::Mutex<Vec<Result<usize, String>>> = std::sync::Mutex::new(Vec::new());

/// A typed-FFI handler: result = 2 * argument (f32, any shape); an argument of another type is
/// the handler's error, which XLA must report as the execution's.
unsafe extern "C" fn double(frame: *mut pjrt_runtime::ffi::CallFrame) -> *mut pjrt_runtime::ffi::XlaError {
    let frame = unsafe { &mut *frame };
    if frame.answer_metadata() || !frame.is_execute() {
        return std::ptr::null_mut();
    }
    let (Ok(x), Ok(y)) = (frame.arg(0), frame.ret(0)) else {
        return frame.error("double: expected one argument and one result");
    };
    // The CPU has no stream to give: the query (through the declared API table) answers so.
    STREAM_QUERY.lock().unwrap().push(frame.stream().map(|s| s as usize));
    if x.dtype != pjrt_runtime::ffi::dtype::F32 {
        return frame.error("double: f32 only");
    }
    let n = x.len();
    let (x, y) = unsafe {
        (std::slice::from_raw_parts(x.data as *const f32, n), std::slice::from_raw_parts_mut(y.data as *mut f32, n))
    };
    for (y, x) in y.iter_mut().zip(x) {
        *y = 2.0 * x;
    }
    std::ptr::null_mut()
}

#[test]
fn ffi_handlers_run_as_custom_calls_and_report_errors() {
    let client = client();
    client.plugin().register_ffi_handler("binding_test_double", "cpu", double, 0).expect("registration");
    let program = |elem: &str| {
        format!(
            r#"
module @ffi_test {{
  func.func @main(%x: tensor<3x{elem}>) -> tensor<3x{elem}> {{
    %y = "stablehlo.custom_call"(%x) {{api_version = 4 : i32, backend_config = {{}}, call_target_name = "binding_test_double"}} : (tensor<3x{elem}>) -> tensor<3x{elem}>
    "func.return"(%y) : (tensor<3x{elem}>) -> ()
  }}
}}
"#
        )
    };
    let executable = client.compile(&program("f32"), &CompileOptions::default()).unwrap();
    let x = client
        .buffer_from_host(
            &[1f32, -2., 0.25].iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>(),
            ElementType::F32,
            &[3],
        )
        .unwrap();
    let out = executable.execute(vec![ExecuteArg::Keep(&x)]).unwrap();
    assert_eq!(f32_values(&out[0].to_host().unwrap()), vec![2., -4., 0.5]);
    let queries = STREAM_QUERY.lock().unwrap().clone();
    assert!(!queries.is_empty() && queries.iter().all(|q| q.is_err()), "{queries:?}");
    // The handler's error is the execution's error, not a crash.
    let executable = client.compile(&program("i32"), &CompileOptions::default()).unwrap();
    let x = client.buffer_from_host(&[0u8; 12], ElementType::S32, &[3]).unwrap();
    let error = executable.execute(vec![ExecuteArg::Keep(&x)]).unwrap_err();
    assert!(error.to_string().contains("f32 only"), "{error}");
}

#[test]
fn host_memory_is_zeroed_in_place() {
    let client = client();
    let values: Vec<f32> = (0..32).map(|i| i as f32 - 7.5).collect();
    let buffer = client.buffer_from_host(&f32_bytes(&values), ElementType::F32, &[4, 8]).unwrap();
    let address = buffer.device_address().unwrap();
    // SAFETY: the CPU plugin's buffers are host memory, and nothing else uses this one.
    unsafe { buffer.zero_host_memory() }.unwrap();
    assert_eq!(buffer.device_address().unwrap(), address, "zeroed in place, not replaced");
    assert_eq!(f32_values(&buffer.to_host().unwrap()), vec![0.0; 32]);
}

#[test]
fn host_zeros_are_zeros_at_any_size_and_take_a_computation() {
    let client = client();
    // A small buffer is written; a large one gets the system's zero pages (host_pages::zero).
    for elements in [32usize, 3 << 20] {
        // SAFETY: the CPU plugin's buffers are host memory.
        let buffer = unsafe { client.host_zeros(ElementType::F32, &[elements]) }.unwrap();
        assert_eq!(buffer.dims().unwrap(), vec![elements]);
        assert!(buffer.to_host().unwrap().iter().all(|&b| b == 0), "{elements} elements: a byte is not zero");
    }
    // Donated to a computation that updates it in place, as a KV cache is.
    let executable = client.compile(PROGRAM, &CompileOptions::default()).unwrap();
    // SAFETY: as above.
    let state = unsafe { client.host_zeros(ElementType::F16, &[4]) }.unwrap();
    let w = client.buffer_from_host(&f32_bytes(&[0.; 8]), ElementType::F32, &[2, 4]).unwrap();
    let x = client.buffer_from_host(&f32_bytes(&[1., 2., 3., 0.5]), ElementType::F32, &[4]).unwrap();
    let out = executable.execute(vec![ExecuteArg::Donate(state), ExecuteArg::Keep(&w), ExecuteArg::Keep(&x)]).unwrap();
    assert_eq!(out[0].to_host().unwrap(), f16_bytes(&[1., 2., 3., 0.5]));
}
