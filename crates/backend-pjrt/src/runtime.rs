//! A PJRT plugin as a [`GraphRuntime`]: one executable per graph, buffers on the plugin's device.
//!
//! XLA compiles one program per module, entered at `@main`, so each graph is its own executable,
//! compiled on as many threads as there are cores (each from the disk cache when it holds it).
//! The weights are passed to every execution as kept (never donated) arguments. A session's cache
//! buffers (a key and a value buffer per layer by default, [`stablehlo_llama::cache_arg_shapes`])
//! are *donated* to every call, and the graphs alias them to the outputs after the token
//! (`tf.aliasing_output`), so XLA writes the step's keys and values into the same memory; the
//! returned buffers replace the session's. A failed call may have consumed them: the cache is then
//! empty until the engine replaces it.
//!
//! On a device (not the CPU plugin), a greedy decode step launches the next one before it returns
//! (ADR 0041, `Ahead`): the next step takes this step's token and caches as they are on the
//! device, so the device has it queued while the host reads this token back and the caller asks
//! for the next; the host's launch of each step then overlaps the device's work on the one before.

use graph_engine::{
    ArtifactCache, BatchCall, CacheOutcome, CompileReport, GraphCall, GraphInput, GraphOutput, GraphRuntime,
    LoadedModel, PreparedWeights,
};
use llama_model::LlamaConfig;
use pjrt_runtime::{
    Buffer, Client, CompileOptions, Completion, ElementType, ExecuteArg, Launched, LoadedExecutable, PjrtError, Plugin,
};
use session_api::{Result, SeamError};
use stablehlo_llama::{cache_arg_shapes, emit_entry_module, ArgDtype, GraphKind, GraphOptions, GraphSpec};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

/// `error` from the plugin, as the contract's error.
fn pjrt_error(error: PjrtError) -> SeamError {
    SeamError::Backend(format!("PJRT: {error}"))
}

fn element(dtype: ArgDtype) -> ElementType {
    match dtype {
        ArgDtype::F32 => ElementType::F32,
        ArgDtype::F16 => ElementType::F16,
        ArgDtype::I32 => ElementType::S32,
        ArgDtype::I8 => ElementType::S8,
    }
}

/// One model's graphs on a PJRT client.
pub struct PjrtRuntime {
    client: Arc<Client>,
    /// The buffers are host memory (the CPU plugin): a freed cache's pages go back to the OS
    /// (see [`PjrtCache`]), and a closed session's cache is zeroed in place for the next one.
    host_memory: bool,
    config: LlamaConfig,
    options: GraphOptions,
    executables: RwLock<HashMap<String, Arc<LoadedExecutable>>>,
    weights: OnceLock<Vec<Buffer>>,
    /// The shapes of a session's cache buffers, in argument order.
    cache_shapes: Vec<Vec<usize>>,
    cache_element: ElementType,
    /// Where each graph's calls spend their time, when `SEAM_PJRT_STEP_PROFILE` is set.
    profile: Option<Mutex<StepProfile>>,
    /// Whether greedy decode steps launch the next step ahead ([`Ahead`]).
    launch_ahead: bool,
}

/// Turns launching decode steps ahead on (`1`) or off (`0`); by default it is on for a device
/// and off on the CPU plugin, whose steps run on the cores the host would wait on.
pub const LAUNCH_AHEAD_ENV: &str = "SEAM_PJRT_LAUNCH_AHEAD";

/// Per graph: calls, then the total time of uploading the leading arguments, of launching the
/// execution, and of waiting for it and reading the token (and logits) back. Printed to
/// stderr when the runtime is dropped: it shows whether a step waits on the host (uploads,
/// launches, the read-back) or on the device's kernels.
#[derive(Default)]
struct StepProfile {
    graphs: HashMap<String, (u64, [std::time::Duration; 3])>,
}

impl Drop for PjrtRuntime {
    fn drop(&mut self) {
        let Some(profile) = self.profile.take() else { return };
        let profile = profile.into_inner().unwrap_or_else(|p| p.into_inner());
        let mut names: Vec<_> = profile.graphs.keys().cloned().collect();
        names.sort();
        for name in names {
            let (calls, [upload, launch, wait]) = profile.graphs[&name];
            let mean = |d: std::time::Duration| d.as_secs_f64() * 1e6 / calls as f64;
            eprintln!(
                "pjrt step profile: {name}: {calls} calls, mean upload {:.1} us, launch {:.1} us, wait and read-back {:.1} us",
                mean(upload),
                mean(launch),
                mean(wait)
            );
        }
    }
}

impl PjrtRuntime {
    /// A runtime for `model` on `client`; `host_memory` when its buffers live in host memory.
    pub fn new(client: Arc<Client>, host_memory: bool, model: LoadedModel<'_>) -> PjrtRuntime {
        PjrtRuntime {
            client,
            host_memory,
            config: model.config.clone(),
            options: model.options.clone(),
            executables: RwLock::new(HashMap::new()),
            weights: OnceLock::new(),
            cache_shapes: cache_arg_shapes(model.config, model.options),
            cache_element: element(model.options.cache.arg_dtype()),
            profile: std::env::var_os("SEAM_PJRT_STEP_PROFILE").map(|_| Mutex::new(StepProfile::default())),
            launch_ahead: match std::env::var(LAUNCH_AHEAD_ENV).as_deref() {
                Ok("1") => true,
                Ok("0") => false,
                _ => !host_memory,
            },
        }
    }

    /// Whether `call` is a greedy decode step that launches the next step ahead: one token, no
    /// logits read (the caller takes the device's token, so it is likely the next input), and
    /// room in the cache for the next position (a step past the end would write into the last
    /// position, clamped).
    fn launches_ahead(&self, call: &GraphCall) -> bool {
        self.launch_ahead
            && call.graph.kind == GraphKind::Decode
            && !call.read_logits
            && matches!(&call.input, GraphInput::Tokens(ids) if ids.len() == 1)
            && call.position + 1 < self.options.max_context
    }

    /// Adds one call's times to the step profile of `name`, when it is kept.
    fn record(&self, name: &str, times: [std::time::Duration; 3]) {
        if let Some(profile) = &self.profile {
            let mut profile = profile.lock().unwrap_or_else(|p| p.into_inner());
            let entry = profile.graphs.entry(name.to_string()).or_default();
            entry.0 += 1;
            for (total, time) in entry.1.iter_mut().zip(times) {
                *total += time;
            }
        }
    }

    /// The executable of `graph`, from the disk cache or compiled now.
    fn compile(&self, graph: GraphSpec) -> Result<(LoadedExecutable, CacheOutcome)> {
        let module = emit_entry_module(&self.config, &self.options, graph)
            .map_err(|e| SeamError::ModelFormat { path: None, message: e.to_string() })?;
        let options = CompileOptions::default();
        let key = cache_key(self.client.plugin(), &module, &options);
        let load = |bytes: Vec<u8>| self.client.deserialize(&bytes).map_err(pjrt_error);
        let build = || {
            let compile_error =
                |e| SeamError::Backend(format!("the PJRT plugin failed to compile {}: {e}", graph.name()));
            let executable = self.client.compile(&module, &options).map_err(compile_error)?;
            let bytes = executable.serialize().map_err(compile_error)?;
            Ok((executable, bytes))
        };
        executable_cache().load_or_build(&key, load, build)
    }

    fn i32_buffer(&self, values: &[i32], dims: &[usize]) -> Result<Buffer> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.client.buffer_from_host(&bytes, ElementType::S32, dims).map_err(pjrt_error)
    }
}

/// The cache of compiled executables: `home::pjrt_cache_dir()/<key>.pjrtexe`.
pub fn executable_cache() -> ArtifactCache {
    ArtifactCache::new(llama_model::home::pjrt_cache_dir(), "pjrtexe")
}

/// The key of `module` compiled with `options` by `plugin`: its identity (a plugin build can only
/// deserialize its own executables), `XLA_FLAGS` (XLA reads its optimization switches from it at
/// compile time), the options and the module text.
fn cache_key(plugin: &Plugin, module: &str, options: &CompileOptions) -> String {
    let meta = std::fs::metadata(plugin.path()).ok();
    let size = meta.as_ref().map(|m| m.len()).unwrap_or(0);
    let mtime = meta
        .and_then(|m| m.modified().ok())
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_secs());
    let identity = format!(
        "{} api {} xla {} size {size} mtime {mtime:?}",
        plugin.path().display(),
        plugin.version(),
        plugin.attribute("xla_version").unwrap_or("?")
    );
    let flags = std::env::var("XLA_FLAGS").unwrap_or_default();
    graph_engine::artifact_cache::cache_key(&[
        identity.as_bytes(),
        flags.as_bytes(),
        &options.to_proto_bytes(),
        module.as_bytes(),
    ])
}

/// The error of a call on a cache that an earlier failed call consumed.
fn cache_lost() -> SeamError {
    SeamError::Backend("the KV cache was lost by a failed call".into())
}

/// A session's cache buffers; `None` after a failed call consumed them, or while a step launched
/// ahead holds them (`PjrtCache::settle`).
pub struct PjrtCache {
    buffers: Option<Vec<Buffer>>,
    /// The decode step launched ahead on these caches, if one was.
    ahead: Option<Ahead>,
    /// Give freed pages back to the OS on drop (the CPU plugin).
    release_memory: bool,
}

/// A decode step launched before the caller asked for it: at the position after the step that
/// launched it, on that step's token and updated caches, still on the device. The next call uses
/// it if it asks for that token at that position; any other call first waits for it and takes its
/// caches, dropping its token. Its write to the cache at its position is then overwritten by
/// whatever step comes to that position (every step writes the entries it appends, and attention
/// reads no entry past the step's own position), so a step launched in vain changes nothing.
struct Ahead {
    /// Declared first, so dropped first: the step is waited for before its buffers are freed.
    completion: Completion,
    /// Its outputs: the token, the caches, the logits.
    outputs: Vec<Buffer>,
    position: usize,
    token: u32,
    /// Its token and position arguments, held until it is done.
    inputs: [Buffer; 2],
}

impl PjrtCache {
    /// Waits for a step launched ahead, if there is one, and takes its caches; when it failed,
    /// the caches are lost (as after any failed call).
    fn settle(&mut self) {
        if let Some(ahead) = self.ahead.take() {
            let Ahead { completion, mut outputs, .. } = ahead;
            self.buffers = match completion.wait() {
                Ok(()) if outputs.len() >= 2 => {
                    outputs.pop();
                    outputs.remove(0);
                    Some(outputs)
                }
                _ => None,
            };
        }
    }

    /// The cache buffers, of the step launched ahead when there is one (each ready when it is).
    fn current(&self, count: usize) -> Option<&[Buffer]> {
        match &self.ahead {
            Some(ahead) => ahead.outputs.get(1..1 + count),
            None => self.buffers.as_deref(),
        }
    }
}

impl Drop for PjrtCache {
    fn drop(&mut self) {
        self.settle();
        // Free the buffers first, then give the pages back: on the CPU plugin a freed cache
        // otherwise stays in the resident set (conformance's many-sessions memory case).
        self.buffers = None;
        if self.release_memory {
            crate::plugin_search::release_free_memory();
        }
    }
}

impl GraphRuntime for PjrtRuntime {
    type Cache = PjrtCache;

    /// Each graph is an executable of its own: loading one costs only that one.
    fn loads_graphs_separately(&self) -> bool {
        true
    }

    fn load_graphs(&self, graphs: &[GraphSpec]) -> Result<CompileReport> {
        // Every core compiles (or deserializes) a graph of its own; each takes the next one left.
        let next = AtomicUsize::new(0);
        let results: Mutex<Vec<Result<CompileReport>>> = Mutex::new(Vec::new());
        let workers = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).clamp(1, graphs.len().max(1));
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| {
                    while let Some(&graph) = graphs.get(next.fetch_add(1, Ordering::Relaxed)) {
                        let result = self.compile(graph).map(|(executable, outcome)| {
                            self.executables
                                .write()
                                .unwrap_or_else(|p| p.into_inner())
                                .insert(graph.name(), Arc::new(executable));
                            match outcome {
                                CacheOutcome::Hit => CompileReport { compiled: 0, from_cache: 1 },
                                CacheOutcome::Built => CompileReport { compiled: 1, from_cache: 0 },
                            }
                        });
                        results.lock().unwrap_or_else(|p| p.into_inner()).push(result);
                    }
                });
            }
        });
        let mut report = CompileReport::default();
        for result in results.into_inner().unwrap_or_else(|p| p.into_inner()) {
            report += result?;
        }
        Ok(report)
    }

    fn upload_weights(&self, weights: &PreparedWeights) -> Result<()> {
        let buffers = weights
            .args()
            .iter()
            .map(|arg| {
                let (dtype, shape) = (element(arg.spec.dtype), &arg.spec.shape);
                if self.host_memory {
                    // The buffers are views of the mapped weights: paged in as the graphs read
                    // them, held once, nothing copied at load.
                    self.client.buffer_aliasing_host(weights.memory(), arg.range.clone(), dtype, shape)
                } else {
                    self.client.buffer_from_host(weights.bytes(arg), dtype, shape)
                }
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(pjrt_error)?;
        self.weights.set(buffers).map_err(|_| SeamError::Backend("the weights were uploaded twice".into()))
    }

    /// In host memory, the kernels' read probe (every core summing a buffer larger than the
    /// last-level cache, as decode streams the weights through the same kernels); XLA's CPU
    /// reduce reads well below what the memory delivers, which overstated the fraction decode
    /// reaches. On a device, the better of two probes over a large f32 array, each a warm-up run
    /// then the best of five: `y = x + 1` (a copy: every element read once and written once) and
    /// the sum of `x` (reads only, like decode).
    fn measure_memory_bandwidth(&self) -> Result<Option<f64>> {
        if self.host_memory {
            return Ok(Some(cpu_kernels::bandwidth::measure_host_read_bandwidth()));
        }
        // Large enough that launch overhead is noise: 1 GiB in.
        let n: usize = 256 << 20;
        let copy = format!(
            "module @bandwidth_copy {{\n  func.func public @main(%x: tensor<{n}xf32>) -> tensor<{n}xf32> {{\n    \
             %one = stablehlo.constant dense<1.0> : tensor<{n}xf32>\n    \
             %y = stablehlo.add %x, %one : tensor<{n}xf32>\n    return %y : tensor<{n}xf32>\n  }}\n}}\n"
        );
        let read = format!(
            "module @bandwidth_read {{\n  func.func public @main(%x: tensor<{n}xf32>) -> tensor<f32> {{\n    \
             %zero = stablehlo.constant dense<0.0> : tensor<f32>\n    \
             %s = stablehlo.reduce(%x init: %zero) applies stablehlo.add across dimensions = [0] \
             : (tensor<{n}xf32>, tensor<f32>) -> tensor<f32>\n    return %s : tensor<f32>\n  }}\n}}\n"
        );
        let x = self.client.zeros(ElementType::F32, &[n]).map_err(pjrt_error)?;
        let mut best = 0f64;
        for (module, bytes) in [(copy, 2 * n * 4), (read, n * 4)] {
            let probe = self.client.compile(&module, &CompileOptions::default()).map_err(pjrt_error)?;
            let mut fastest = f64::INFINITY;
            for run in 0..6 {
                let started = std::time::Instant::now();
                drop(probe.execute(vec![ExecuteArg::Keep(&x)]).map_err(pjrt_error)?);
                if run > 0 {
                    fastest = fastest.min(started.elapsed().as_secs_f64());
                }
            }
            best = best.max(bytes as f64 / fastest);
        }
        Ok(Some(best))
    }

    /// On the CPU plugin, zeros made in place ([`pjrt_runtime::Client::host_zeros`]): pages come
    /// as zeros where a step first touches them, so a new cache costs what its session uses
    /// rather than a copy of zeros over the whole context. On a device, a copy of zeros.
    fn new_cache(&self) -> Result<PjrtCache> {
        let buffers = self
            .cache_shapes
            .iter()
            .map(|shape| {
                if !self.host_memory {
                    return self.client.zeros(self.cache_element, shape);
                }
                // SAFETY: the CPU plugin's buffers are host memory.
                unsafe { self.client.host_zeros(self.cache_element, shape) }
            })
            .collect::<std::result::Result<_, _>>();
        Ok(PjrtCache { buffers: Some(buffers.map_err(pjrt_error)?), ahead: None, release_memory: self.host_memory })
    }

    /// On the CPU plugin, whose buffers are host memory: zeroed in place, once a step launched
    /// ahead on them is done.
    fn zero_cache(&self, cache: &mut PjrtCache) -> Result<bool> {
        if !self.host_memory {
            return Ok(false);
        }
        cache.settle();
        let buffers = cache.buffers.as_deref().ok_or_else(cache_lost)?;
        for buffer in buffers {
            // SAFETY: the CPU plugin's buffers are host memory; no step runs on this cache now
            // (the one launched ahead is settled, and its session is closed).
            unsafe { buffer.zero_host_memory() }.map_err(pjrt_error)?;
        }
        Ok(true)
    }

    fn copy_cache(&self, cache: &PjrtCache) -> Result<PjrtCache> {
        let buffers = cache.current(self.cache_shapes.len()).ok_or_else(cache_lost)?;
        // Through the host: the C API has no device-to-device copy of a buffer on one device,
        // and a fork is rare next to the steps.
        let copies = buffers
            .iter()
            .zip(&self.cache_shapes)
            .map(|(buffer, shape)| {
                buffer.to_host().and_then(|bytes| self.client.buffer_from_host(&bytes, self.cache_element, shape))
            })
            .collect::<std::result::Result<_, _>>()
            .map_err(pjrt_error)?;
        Ok(PjrtCache { buffers: Some(copies), ahead: None, release_memory: cache.release_memory })
    }

    fn execute(&self, cache: &mut PjrtCache, call: &GraphCall) -> Result<GraphOutput> {
        if self.launches_ahead(call) {
            return self.decode_ahead(cache, call);
        }
        cache.settle();
        let started = std::time::Instant::now();
        let input = match &call.input {
            GraphInput::Tokens(ids) => self.i32_buffer(ids, &[ids.len()])?,
            GraphInput::Embeddings(rows) => {
                let hidden = self.config.hidden_size;
                let bytes: Vec<u8> = rows.iter().flat_map(|v| v.to_le_bytes()).collect();
                self.client
                    .buffer_from_host(&bytes, ElementType::F32, &[rows.len() / hidden, hidden])
                    .map_err(pjrt_error)?
            }
        };
        let position = self.i32_buffer(&[call.position as i32], &[])?;
        let count = match call.graph.kind {
            GraphKind::Decode => None,
            _ => Some(self.i32_buffer(&[call.count as i32], &[])?),
        };
        let mut leading = vec![&input, &position];
        leading.extend(count.as_ref());
        let uploaded = started.elapsed();
        let mut outputs = self.run(call.graph, &leading, &mut [cache], call.read_logits, uploaded)?;
        Ok(outputs.remove(0))
    }

    fn decodes_batches(&self) -> bool {
        true
    }

    fn execute_batch(&self, caches: &mut [&mut PjrtCache], call: &BatchCall) -> Result<Vec<GraphOutput>> {
        caches.iter_mut().for_each(|cache| cache.settle());
        let started = std::time::Instant::now();
        let tokens = self.i32_buffer(&call.tokens, &[call.tokens.len()])?;
        let positions = self.i32_buffer(&call.positions, &[call.positions.len()])?;
        self.run(call.graph, &[&tokens, &positions], caches, call.read_logits, started.elapsed())
    }
}

impl PjrtRuntime {
    /// Launches `graph` with its `leading` arguments (kept), `caches` (donated) and the weights.
    fn launch(&self, graph: GraphSpec, leading: &[&Buffer], caches: Vec<Buffer>) -> Result<Launched> {
        let name = graph.name();
        let executable = self.executables.read().unwrap_or_else(|p| p.into_inner()).get(&name).cloned();
        let executable = executable.ok_or_else(|| SeamError::Backend(format!("no executable for {name}")))?;
        let weights = self.weights.get().ok_or_else(|| SeamError::Backend("the weights are not uploaded".into()))?;
        let mut args: Vec<ExecuteArg<'_>> = leading.iter().map(|&buffer| ExecuteArg::Keep(buffer)).collect();
        args.extend(caches.into_iter().map(ExecuteArg::Donate));
        args.extend(weights.iter().map(ExecuteArg::Keep));
        executable.launch(args).map_err(pjrt_error)
    }

    /// A greedy decode step ([`PjrtRuntime::launches_ahead`]): the step launched ahead when it is
    /// this one, else one launched now; then, before this step's token is read back, the next
    /// step, on this step's token and caches as they are on the device ([`Ahead`]).
    fn decode_ahead(&self, cache: &mut PjrtCache, call: &GraphCall) -> Result<GraphOutput> {
        let started = std::time::Instant::now();
        let GraphInput::Tokens(ids) = &call.input else { unreachable!("launches_ahead checked the input") };
        let token = ids[0];
        let mut kind = "launched ahead";
        let (mut outputs, completion, inputs) = match cache.ahead.take() {
            Some(ahead) if ahead.position == call.position && i64::from(ahead.token) == i64::from(token) => {
                (ahead.outputs, ahead.completion, ahead.inputs)
            }
            other => {
                cache.ahead = other;
                cache.settle();
                let input = self.i32_buffer(&[token], &[1])?;
                let position = self.i32_buffer(&[call.position as i32], &[])?;
                let caches = cache.buffers.take().ok_or_else(cache_lost)?;
                let (outputs, completion) = self.launch(call.graph, &[&input, &position], caches)?.into_parts();
                kind = "launched now";
                (outputs, completion, [input, position])
            }
        };
        let n_caches = self.cache_shapes.len();
        if outputs.len() != n_caches + 2 {
            drop(completion);
            return Err(SeamError::Backend(format!(
                "{} returned {} results, expected {}",
                call.graph.name(),
                outputs.len(),
                n_caches + 2
            )));
        }
        let next_position = self.i32_buffer(&[call.position as i32 + 1], &[])?;
        let uploaded = started.elapsed();
        let logits = outputs.pop();
        let token_buffer = outputs.remove(0);
        let next = self.launch(call.graph, &[&token_buffer, &next_position], outputs);
        let launch_time = started.elapsed() - uploaded;
        let mut bytes = [0u8; 4];
        let read = token_buffer.copy_to_host(&mut bytes).map_err(pjrt_error);
        let done = completion.wait().map_err(pjrt_error);
        drop((inputs, logits));
        let value = i32::from_le_bytes(bytes);
        let (outputs, completion) = next?.into_parts();
        done?;
        read?;
        let value = u32::try_from(value)
            .map_err(|_| SeamError::Backend(format!("{} returned token id {value}", call.graph.name())))?;
        cache.ahead = Some(Ahead {
            completion,
            outputs,
            position: call.position + 1,
            token: value,
            inputs: [token_buffer, next_position],
        });
        // Steps the one before launched ahead apart from those launched in the call (the first of
        // each generation, and any after a step launched in vain).
        if self.profile.is_some() {
            let waited = started.elapsed() - uploaded - launch_time;
            self.record(&format!("{} ({kind}, the next ahead)", call.graph.name()), [uploaded, launch_time, waited]);
        }
        Ok(GraphOutput { token: value, logits: None })
    }

    /// Runs `graph` with its `leading` arguments (input, position(s), count) and the caches of its
    /// sequences, which it consumes and replaces with the updated ones; returns each sequence's
    /// greedy token and, when `read_logits`, its row of the logits. `uploaded` is the time the
    /// leading arguments took, for the step profile.
    fn run(
        &self,
        graph: GraphSpec,
        leading: &[&Buffer],
        caches: &mut [&mut PjrtCache],
        read_logits: bool,
        uploaded: std::time::Duration,
    ) -> Result<Vec<GraphOutput>> {
        let name = graph.name();
        // Every cache is checked before any is taken: a lost one fails the call with the others intact.
        if caches.iter().any(|cache| cache.buffers.is_none()) {
            return Err(cache_lost());
        }
        let taken: Vec<Vec<Buffer>> = caches.iter_mut().map(|cache| cache.buffers.take().unwrap_or_default()).collect();
        let per_cache = taken.first().map_or(0, Vec::len);
        let n_caches = per_cache * taken.len();
        let started = std::time::Instant::now();
        let launched = self.launch(graph, leading, taken.into_iter().flatten().collect())?;
        let launch_time = started.elapsed();
        let outputs = launched.outputs();
        if outputs.len() != n_caches + 2 {
            return Err(SeamError::Backend(format!(
                "{name} returned {} results, expected {}",
                outputs.len(),
                n_caches + 2
            )));
        }
        // The token (and logits) are copied back as soon as the device has them, before the
        // execution is waited for: one wait on the host instead of two.
        let sequences = caches.len();
        // Logits per sequence: one row each, or every row of a scored prefill.
        let per_sequence = self.config.vocab_size * graph.kind.logit_rows() / sequences;
        let mut token_bytes = vec![0u8; 4 * sequences];
        let token_read = outputs[0].copy_to_host(&mut token_bytes).map_err(pjrt_error);
        // Straight into f32s: a batch's logits are megabytes, each pass over them a cost of the
        // step (the copy refuses a result of any other size).
        let logits_read = match (&token_read, read_logits) {
            (Ok(()), true) => {
                let mut all = vec![0.0f32; sequences * per_sequence];
                let read = outputs[outputs.len() - 1].copy_to_host(bytemuck::cast_slice_mut(&mut all));
                Some(read.map(|()| all).map_err(pjrt_error))
            }
            _ => None,
        };
        let mut outputs = launched.finish().map_err(pjrt_error)?;
        token_read?;
        let logits = logits_read.transpose()?;
        outputs.pop();
        outputs.remove(0);
        let mut updated = outputs.into_iter();
        for cache in caches.iter_mut() {
            cache.buffers = Some(updated.by_ref().take(per_cache).collect());
        }
        self.record(&name, [uploaded, launch_time, started.elapsed() - launch_time]);
        token_bytes
            .chunks_exact(4)
            .enumerate()
            .map(|(i, bytes)| {
                let token = i32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
                let token = u32::try_from(token)
                    .map_err(|_| SeamError::Backend(format!("{name} returned token id {token}")))?;
                let logits = logits.as_ref().map(|all| all[i * per_sequence..(i + 1) * per_sequence].to_vec());
                Ok(GraphOutput { token, logits })
            })
            .collect()
    }
}
