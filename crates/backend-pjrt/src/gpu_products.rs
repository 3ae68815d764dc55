//! seam's CUDA kernels (the `cuda-kernels` crate) as XLA custom-call targets of a CUDA plugin:
//! decode's one-row products when the graphs are emitted with
//! [`VectorProducts::CudaKernels`](stablehlo_llama::VectorProducts::CudaKernels) (a layer's
//! q, k, v and its gate, up grouped, their norms folded in; o and down added to the residual
//! stream as they are written) or `CudaKernelsEach`.
//!
//! Each handler checks its arrays' element types and shapes against what the graph emitter
//! promises, asks XLA for the call's CUDA stream and launches the kernel on it; it never touches
//! the arrays' contents (device memory). They are registered as safe to capture into XLA's command
//! buffers (CUDA graphs): a call launches the same kernel for the same shapes every time, so XLA
//! keeps a decode step one graph launch instead of splitting it around every product.
//!
//! Before a model's graphs run, the kernels' tilings are tuned for the launches its decode step
//! makes, on its GPU ([`tune`]).
//!
//! The same targets can be registered for a CPU plugin with handlers that compute the calls on
//! the host ([`register_on_host`], [`ON_CPU_ENV`]): the graphs' calls checked without a GPU.

use crate::host_kernels::{handle_with_traits, once_per_plugin, register_all, rows_cols, Registrations};
use cuda_kernels::device::Device;
use cuda_kernels::tune::LaunchShape;
use cuda_kernels::{Driver, Kernel, Launch, Matrix, Norm, Stream, Tilings, GROUP, MAX_MATRICES};
use graph_engine::artifact_cache::ArtifactCache;
use llama_model::LlamaConfig;
use pjrt_runtime::ffi::{dtype, Buffer, CallFrame, Handler, XlaError, TRAIT_COMMAND_BUFFER_COMPATIBLE};
use pjrt_runtime::Plugin;
use session_api::SeamError;
use stablehlo_llama::{GraphKind, GraphOptions, GraphSpec};
use std::ffi::c_void;
use std::sync::OnceLock;

/// The platform name XLA's CUDA plugin registers handlers under.
const PLATFORM: &str = "CUDA";

/// The environment variable that lets a CPU plugin run graphs with seam's CUDA kernels' calls
/// ([`register_on_host`]): `1` to check those graphs without a GPU.
pub const ON_CPU_ENV: &str = "SEAM_PJRT_CUDA_KERNELS_ON_CPU";

/// What a target's call takes besides its input row and matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Extra {
    /// Nothing.
    None,
    /// An RMSNorm's weight and epsilon, after the input.
    Norm,
    /// A residual its one product is added to, after the input.
    Residual,
}

/// The kernels' targets, each with its format and what its calls take; a handler's `TARGET`
/// indexes this.
const TARGETS: [(&str, Kernel, Extra); 9] = [
    (stablehlo_llama::CUDA_ROWS_F16_TARGET, Kernel::F16, Extra::None),
    (stablehlo_llama::CUDA_ROWS_INT8_TARGET, Kernel::Int8, Extra::None),
    (stablehlo_llama::CUDA_ROWS_INT4_TARGET, Kernel::Int4, Extra::None),
    (stablehlo_llama::CUDA_NORMED_ROWS_F16_TARGET, Kernel::F16, Extra::Norm),
    (stablehlo_llama::CUDA_NORMED_ROWS_INT8_TARGET, Kernel::Int8, Extra::Norm),
    (stablehlo_llama::CUDA_NORMED_ROWS_INT4_TARGET, Kernel::Int4, Extra::Norm),
    (stablehlo_llama::CUDA_RESIDUAL_ROWS_F16_TARGET, Kernel::F16, Extra::Residual),
    (stablehlo_llama::CUDA_RESIDUAL_ROWS_INT8_TARGET, Kernel::Int8, Extra::Residual),
    (stablehlo_llama::CUDA_RESIDUAL_ROWS_INT4_TARGET, Kernel::Int4, Extra::Residual),
];

/// The targets, each with its handler for a platform.
fn handlers(on_host: bool) -> [(&'static str, Handler); 9] {
    let handlers: [Handler; 9] = if on_host {
        [
            host_rows::<0>,
            host_rows::<1>,
            host_rows::<2>,
            host_rows::<3>,
            host_rows::<4>,
            host_rows::<5>,
            host_rows::<6>,
            host_rows::<7>,
            host_rows::<8>,
        ]
    } else {
        [rows::<0>, rows::<1>, rows::<2>, rows::<3>, rows::<4>, rows::<5>, rows::<6>, rows::<7>, rows::<8>]
    };
    std::array::from_fn(|i| (TARGETS[i].0, handlers[i]))
}

/// Registers, for `plugin`'s CPU platform, handlers of the kernels' targets that compute what the
/// kernels compute on the host ([`cuda_kernels::host`]): a CPU plugin then runs the graphs of
/// `vector_products=cuda-kernels` as they are, and the conformance suite checks their calls
/// (operands, grouped results, folded norms) against the reference without a GPU.
pub fn register_on_host(plugin: &Plugin) -> Result<(), String> {
    static DONE: Registrations = OnceLock::new();
    once_per_plugin(&DONE, plugin, || register_all(plugin, crate::host_kernels::PLATFORM, &handlers(true), 0))
}

/// Registers the kernels' handlers with `plugin`'s XLA, once per plugin for the life of the
/// process; the reason when the plugin refuses them, no NVIDIA driver is there to launch them or
/// the process's tiling setting (`SEAM_CUDA_TILINGS`, [`Tilings`]) is malformed.
pub fn register(plugin: &Plugin) -> Result<(), String> {
    static DONE: Registrations = OnceLock::new();
    once_per_plugin(&DONE, plugin, || {
        Tilings::setting()?;
        Driver::get().map_err(|e| e.to_string())?;
        register_all(plugin, PLATFORM, &handlers(false), TRAIT_COMMAND_BUFFER_COMPATIBLE)
    })
}

/// The handler of the target [`TARGETS`]`[TARGET]`.
unsafe extern "C" fn rows<const TARGET: usize>(frame: *mut CallFrame) -> *mut XlaError {
    let (_, kernel, extra) = TARGETS[TARGET];
    // SAFETY: called by XLA with its call frame.
    unsafe { handle_with_traits(frame, TRAIT_COMMAND_BUFFER_COMPATIBLE, |frame| launch(frame, kernel, extra)) }
}

/// [`rows`] on the host: the CPU plugin's arrays in host memory, computed by
/// [`cuda_kernels::host::compute`].
unsafe extern "C" fn host_rows<const TARGET: usize>(frame: *mut CallFrame) -> *mut XlaError {
    let (_, kernel, extra) = TARGETS[TARGET];
    // SAFETY: called by XLA with its call frame.
    unsafe { handle_with_traits(frame, 0, |frame| compute_on_host(frame, kernel, extra)) }
}

fn compute_on_host(frame: &CallFrame, kernel: Kernel, extra: Extra) -> Result<(), String> {
    let Operands { x, norm, matrices, k } = operands(frame, kernel, extra)?;
    let launch = Launch { kernel, x, norm, matrices: &matrices, k };
    // SAFETY: a CPU plugin's arrays are host memory, of the shapes `operands` checked; XLA gives
    // each result its own buffer.
    unsafe { cuda_kernels::host::compute(&launch) }
}

/// The device address of `buffer`, which the kernels read in 16-byte loads.
fn aligned(buffer: &Buffer, what: &str) -> Result<*mut c_void, String> {
    aligned_to(buffer, what, 16)
}

/// The device address of `buffer`, if a multiple of `alignment`.
fn aligned_to(buffer: &Buffer, what: &str, alignment: usize) -> Result<*mut c_void, String> {
    if !(buffer.data as usize).is_multiple_of(alignment) {
        return Err(format!("{what} at {:?} is not {alignment}-byte aligned", buffer.data));
    }
    Ok(buffer.data)
}

/// The call's input, norm and matrices, after checking every array against the targets'
/// signature (`stablehlo_llama::CUDA_ROWS_*_TARGET`, `CUDA_NORMED_ROWS_*_TARGET`,
/// `CUDA_RESIDUAL_ROWS_*_TARGET`): `x`, then with a norm its weight and epsilon or with a residual
/// the residual, then each matrix's arrays; one result per matrix.
fn operands(frame: &CallFrame, kernel: Kernel, extra: Extra) -> Result<Operands, String> {
    // The call's name only on an error: a handler's every call is on a decode step's path.
    checked_operands(frame, kernel, extra).map_err(|e| {
        let what = match extra {
            Extra::None => "",
            Extra::Norm => " of a normed input",
            Extra::Residual => " added to a residual",
        };
        format!("{} product{what}: {e}", kernel.format())
    })
}

fn checked_operands(frame: &CallFrame, kernel: Kernel, extra: Extra) -> Result<Operands, String> {
    let normed = extra == Extra::Norm;
    let x = frame.arg(0)?;
    let (one, k) = rows_cols(x, "x")?;
    if one != 1 || x.dtype != dtype::F32 {
        return Err(format!("x f32[1, k] expected, got type {} {:?}", x.dtype, x.dims()));
    }
    let x_data = aligned(x, "x")?;
    let lead = match extra {
        Extra::None => 1,
        Extra::Norm => 3,
        Extra::Residual => 2,
    };
    let norm = if normed {
        let (weight, eps) = (frame.arg(1)?, frame.arg(2)?);
        if weight.dtype != dtype::F32 || weight.dims() != [k] || eps.dtype != dtype::F32 || !eps.dims().is_empty() {
            return Err(format!(
                "the norm is type {} {:?} and epsilon type {} {:?} where f32[{k}] and f32[] were expected",
                weight.dtype,
                weight.dims(),
                eps.dtype,
                eps.dims()
            ));
        }
        // Epsilon is one float read on its own (a constant, which XLA may place anywhere a float
        // may be).
        Some(Norm { weight: aligned(weight, "the norm's weight")?, eps: aligned_to(eps, "epsilon", 4)? })
    } else {
        None
    };
    let per_matrix = kernel.weight_arrays();
    let count = frame.ret_count();
    let most = if extra == Extra::Residual { 1 } else { MAX_MATRICES };
    if count == 0 || count > most || frame.arg_count() != lead + count * per_matrix {
        return Err(format!(
            "{} arguments and {count} results, where {lead} + {per_matrix} per matrix and a result per matrix \
             (1 to {most}) were expected",
            frame.arg_count()
        ));
    }
    let (matrix_types, matrix_cols): (&[i32], usize) = match kernel {
        Kernel::F16 => (&[dtype::F16], k),
        Kernel::Int8 => (&[dtype::S8], k),
        Kernel::Int4 => (&[dtype::S8, dtype::U8], k / 2),
    };
    let mut matrices = Vec::with_capacity(count);
    for j in 0..count {
        let first = lead + j * per_matrix;
        let matrix = frame.arg(first)?;
        let (m, cols) = rows_cols(matrix, "the matrix")?;
        if !matrix_types.contains(&matrix.dtype) || cols != matrix_cols {
            return Err(format!("matrix {j} is type {} [{m}, {cols}] for {k} inputs", matrix.dtype));
        }
        let mut arrays = vec![aligned(matrix, "a matrix")?];
        for index in first + 1..first + per_matrix {
            let group_values = frame.arg(index)?;
            if group_values.dtype != dtype::F16 || group_values.dims() != [m, k / GROUP] {
                return Err(format!(
                    "argument {index} is type {} {:?} where f16[{m}, {}] was expected",
                    group_values.dtype,
                    group_values.dims(),
                    k / GROUP
                ));
            }
            arrays.push(aligned(group_values, "a matrix's group values")?);
        }
        let y = frame.ret(j)?;
        if y.dtype != dtype::F32 || y.dims() != [1, m] {
            return Err(format!("result {j} f32[1, {m}] expected, got type {} {:?}", y.dtype, y.dims()));
        }
        let residual = if extra == Extra::Residual {
            let residual = frame.arg(1)?;
            if residual.dtype != dtype::F32 || residual.dims() != [1, m] {
                return Err(format!(
                    "the residual f32[1, {m}] expected, got type {} {:?}",
                    residual.dtype,
                    residual.dims()
                ));
            }
            // Read a float at a time, like epsilon.
            Some(aligned_to(residual, "the residual", 4)?)
        } else {
            None
        };
        matrices.push(Matrix { arrays, y: aligned(y, "a result")?, residual, rows: m });
    }
    Ok(Operands { x: x_data, norm, matrices, k })
}

/// What a call hands the kernel: a [`Launch`]'s parts.
struct Operands {
    x: *mut c_void,
    norm: Option<Norm>,
    matrices: Vec<Matrix>,
    k: usize,
}

fn launch(frame: &CallFrame, kernel: Kernel, extra: Extra) -> Result<(), String> {
    let Operands { x, norm, matrices, k } = operands(frame, kernel, extra)?;
    let stream = frame.stream()?;
    let rows = matrices.iter().map(|m| m.rows).sum();
    let tiling = Tilings::of_process_launch(kernel, rows, k)?;
    let driver = Driver::get().map_err(|e| e.to_string())?;
    let launch = Launch { kernel, x, norm, matrices: &matrices, k };
    // SAFETY: the addresses are XLA's device arrays of this call, of the shapes checked above, on
    // the call's stream, which XLA keeps alive until the launched work has run.
    unsafe { driver.launch(Stream(stream), &launch, tiling) }.map_err(|e| e.to_string())
}

/// The launches of seam's kernels in the decode step of a model of `config` emitted with
/// `options`, each with how many the step makes, in a stable order.
pub fn decode_launches(config: &LlamaConfig, options: &GraphOptions) -> session_api::Result<Vec<(LaunchShape, usize)>> {
    let decode = GraphSpec { kind: GraphKind::Decode, logits: false };
    let module = stablehlo_llama::emit_entry_module(config, options, decode)
        .map_err(|e| SeamError::ModelFormat { path: None, message: e.to_string() })?;
    let mut launches: Vec<(LaunchShape, usize)> = Vec::new();
    for call in stablehlo_llama::cuda_calls(&module) {
        let Some((_, kernel, extra)) = TARGETS.iter().find(|(target, _, _)| *target == call.target) else {
            return Err(SeamError::Backend(format!("the decode graph calls {}, which no handler serves", call.target)));
        };
        let shape = LaunchShape {
            kernel: *kernel,
            matrices: call.rows,
            k: call.k,
            normed: *extra == Extra::Norm,
            residual: *extra == Extra::Residual,
        };
        match launches.iter_mut().find(|(known, _)| *known == shape) {
            Some((_, count)) => *count += 1,
            None => launches.push((shape, 1)),
        }
    }
    launches.sort();
    Ok(launches)
}

/// The cache of tuned tilings: `home::pjrt_cache_dir()/<key>.tilings`, a [`Tilings`] setting.
fn tilings_cache() -> ArtifactCache {
    ArtifactCache::new(llama_model::home::pjrt_cache_dir(), "tilings")
}

/// Tunes the kernels' tilings for the launches of the decode step of a model of `config` emitted
/// with `options` ([`decode_launches`]) on the GPU `device_id` (`cuda:N`) and installs them for
/// this process ([`Tilings::install`]), unless the process's setting (`SEAM_CUDA_TILINGS`) chose
/// them (then the graph is not even read). Tuned tilings are cached on disk per GPU, driver,
/// kernels and launches: a later load on the machine takes the same tilings (a product's rounding
/// depends on its tiling, so tokens stay the same from load to load) without timing again. A
/// tuning that fails is a warning, not an error: launches keep the default tiling. The error is
/// the decode graph's, which cannot be emitted.
pub fn tune(device_id: &str, config: &LlamaConfig, options: &GraphOptions) -> session_api::Result<()> {
    if matches!(Tilings::setting(), Ok(Some(_))) {
        return Ok(());
    }
    let launches = decode_launches(config, options)?;
    if launches.is_empty() {
        return Ok(());
    }
    if let Err(e) = tune_on_device(device_id, &launches) {
        eprintln!("warning: pjrt: seam's CUDA kernels were not tuned ({e}); they launch in the default tiling");
    }
    Ok(())
}

fn tune_on_device(device_id: &str, launches: &[(LaunchShape, usize)]) -> session_api::Result<()> {
    let cuda = |e: cuda_kernels::CudaError| SeamError::Backend(e.to_string());
    let ordinal = device_id.strip_prefix("cuda:").and_then(|n| n.parse().ok()).unwrap_or(0);
    let device = Device::open_ordinal(ordinal).map_err(cuda)?;
    let shapes = format!("{launches:?}");
    let key = graph_engine::artifact_cache::cache_key(&[
        b"seam cuda-kernels tilings 1",
        device.name().as_bytes(),
        &device.driver_version().to_le_bytes(),
        cuda_kernels::PRODUCTS_PTX.as_bytes(),
        shapes.as_bytes(),
    ]);
    let load = |bytes: Vec<u8>| {
        let text = String::from_utf8(bytes).map_err(|e| SeamError::Backend(e.to_string()))?;
        Tilings::parse(&text).map_err(SeamError::Backend)
    };
    let build = || {
        let started = std::time::Instant::now();
        let tuned = cuda_kernels::tune::tune(&device, launches).map_err(cuda)?;
        eprintln!(
            "pjrt: seam's CUDA kernels tuned for {} launch shapes on {} in {:.1} s: {}={tuned}",
            launches.len(),
            device.name(),
            started.elapsed().as_secs_f64(),
            Tilings::VARIABLE
        );
        let text = tuned.to_string();
        Ok((tuned, text.into_bytes()))
    };
    let (tuned, _) = tilings_cache().load_or_build(&key, load, build)?;
    Tilings::install(&tuned);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use graph_engine::GraphSettings;
    use llama_model::Int4Layout;
    use session_api::WeightFormat;
    use stablehlo_llama::VectorProducts;

    #[test]
    fn a_decode_step_is_tuned_for_the_launches_it_makes() {
        let config = llama_model::random::tiny_llama32_config();
        let (h, i, layers) = (config.hidden_size, config.intermediate_size, config.num_hidden_layers);
        let q = config.num_attention_heads * config.head_dim;
        let kv = config.num_key_value_heads * config.head_dim;
        let settings = GraphSettings { vector_products: VectorProducts::CudaKernels, ..crate::DEVICE_SETTINGS };
        for format in WeightFormat::ALL {
            let options = settings.options(&config, Some(64), format, Int4Layout::DEFAULT);
            let launches = decode_launches(&config, &options).unwrap();
            let count = |matrices: &[usize], k: usize, normed: bool| {
                launches
                    .iter()
                    .filter(|(s, _)| s.matrices == matrices && s.k == k && s.normed == normed)
                    .map(|(_, n)| *n)
                    .sum::<usize>()
            };
            // Per layer: q, k, v in one launch and gate, up in another, both normed; o and down,
            // each added to the residual stream.
            assert_eq!(count(&[q, kv, kv], h, true), layers, "{format:?}: {launches:?}");
            assert_eq!(count(&[i, i], h, true), layers, "{format:?}");
            assert_eq!(count(&[h], q, false), layers, "{format:?}: o");
            assert_eq!(count(&[h], i, false), layers, "{format:?}: down");
            assert_eq!(
                launches.iter().filter(|(s, _)| s.residual).map(|(_, n)| n).sum::<usize>(),
                2 * layers,
                "{format:?}: {launches:?}"
            );
            // The LM head, with the final norm.
            assert_eq!(count(&[config.vocab_size], h, true), 1, "{format:?}");
            assert_eq!(launches.iter().map(|(_, n)| n).sum::<usize>(), 4 * layers + 1);
            let kernels: Vec<Kernel> = launches.iter().map(|(s, _)| s.kernel).collect();
            match format {
                WeightFormat::F16 => assert!(kernels.iter().all(|k| *k == Kernel::F16), "{launches:?}"),
                WeightFormat::Int4 => assert!(kernels.contains(&Kernel::Int4), "{launches:?}"),
            }
        }
        // The each form: a launch per product, none normed.
        let each = GraphSettings { vector_products: VectorProducts::CudaKernelsEach, ..crate::DEVICE_SETTINGS };
        let launches =
            decode_launches(&config, &each.options(&config, Some(64), WeightFormat::F16, Int4Layout::DEFAULT)).unwrap();
        assert!(launches.iter().all(|(s, _)| s.matrices.len() == 1 && !s.normed && !s.residual), "{launches:?}");
        assert_eq!(launches.iter().map(|(_, n)| n).sum::<usize>(), 7 * layers + 1);
        // Graphs without the kernels' calls: nothing to tune.
        let options = crate::DEVICE_SETTINGS.options(&config, Some(64), WeightFormat::F16, Int4Layout::DEFAULT);
        assert!(decode_launches(&config, &options).unwrap().is_empty());
    }
}
