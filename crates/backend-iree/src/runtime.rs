//! IREE as a [`GraphRuntime`]: graphs compiled into VM modules, run on the runtime thread.
//!
//! The token graphs of a model are one module (`decode_logits` and `prefill_{B}_logits`): one
//! compile instead of several, and IREE's compile time grows slower than the function count.
//! Graphs first needed later (embedding input) are modules of their own, loaded beside it. Every
//! function returns the greedy token (argmax on the device) and the logits, which stay in device
//! memory unless a call reads them.

use crate::compiler::{compile_cached, CompilerChoice};
use crate::device::IreeDevice;
use crate::task_flags::TaskSettings;
use crate::worker::{CacheId, CacheShape, WorkerHandle};
use graph_engine::{
    BatchCall, CacheOutcome, CompileReport, GraphCall, GraphOutput, GraphRuntime, LoadedModel, PreparedWeights,
};
use llama_model::LlamaConfig;
use session_api::Result;
use stablehlo_llama::{emit_module, GraphOptions, GraphSpec};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// One model's graphs on IREE.
pub struct IreeRuntime {
    device: IreeDevice,
    worker: WorkerHandle,
    compiler: CompilerChoice,
    flags: Vec<String>,
    config: LlamaConfig,
    options: GraphOptions,
    cache_shape: CacheShape,
    /// The loaded module of each graph, by function name.
    modules: Mutex<HashMap<String, String>>,
    /// Numbers the modules loaded on the runtime thread.
    next_module: AtomicUsize,
}

impl IreeRuntime {
    /// A runtime thread on `device` (its task system set by `task` on the CPU) for `model`,
    /// compiling with `compiler` and `flags`.
    pub fn new(
        device: IreeDevice,
        task: &TaskSettings,
        compiler: CompilerChoice,
        flags: Vec<String>,
        model: LoadedModel<'_>,
    ) -> Result<Self> {
        let c = model.config;
        let cache_shape = CacheShape {
            element: crate::worker::element_type(model.options.cache.arg_dtype()),
            shapes: stablehlo_llama::cache_arg_shapes(c, model.options),
        };
        Ok(IreeRuntime {
            device,
            worker: WorkerHandle::spawn(device, task, model.options.host_kernels.is_some())?,
            compiler,
            flags,
            config: c.clone(),
            options: model.options.clone(),
            cache_shape,
            modules: Mutex::new(HashMap::new()),
            next_module: AtomicUsize::new(0),
        })
    }
}

/// Emits `graphs` as one module and compiles it (or takes it from the cache), handing the module
/// to `load`. The one way modules are made, at load and ahead of time, so that both key the cache
/// alike.
pub fn compile_graphs(
    compiler: &CompilerChoice,
    flags: &[String],
    config: &LlamaConfig,
    options: &GraphOptions,
    graphs: &[GraphSpec],
    load: impl Fn(Vec<u8>) -> Result<()>,
) -> Result<CompileReport> {
    let text = emit_module(config, options, graphs).map_err(crate::error::IreeError::from)?;
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let what = graphs.iter().map(GraphSpec::name).collect::<Vec<_>>().join(", ");
    Ok(match compile_cached(compiler, &what, &text, &flags, load)? {
        CacheOutcome::Hit => CompileReport { compiled: 0, from_cache: graphs.len() },
        CacheOutcome::Built => CompileReport { compiled: graphs.len(), from_cache: 0 },
    })
}

/// A session's cache on the runtime thread; dropping it frees the buffers there.
pub struct IreeCache {
    id: CacheId,
    worker: WorkerHandle,
}

impl Drop for IreeCache {
    fn drop(&mut self) {
        self.worker.drop_cache(self.id);
    }
}

impl GraphRuntime for IreeRuntime {
    type Cache = IreeCache;

    fn load_graphs(&self, graphs: &[GraphSpec]) -> Result<CompileReport> {
        // Compiled outside the lock: a graph first needed by one session (embedding input) must not
        // hold up the steps of the others while it compiles.
        let module = format!("graphs{}", self.next_module.fetch_add(1, Ordering::Relaxed));
        let load = |vmfb: Vec<u8>| Ok(self.worker.load_module(&module, vmfb)?);
        let report = compile_graphs(&self.compiler, &self.flags, &self.config, &self.options, graphs, load)?;
        let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        for graph in graphs {
            modules.insert(graph.name(), module.clone());
        }
        Ok(report)
    }

    fn upload_weights(&self, weights: &PreparedWeights) -> Result<()> {
        Ok(self.worker.upload_weights(weights.clone())?)
    }

    fn new_cache(&self) -> Result<IreeCache> {
        Ok(IreeCache { id: self.worker.new_cache(self.cache_shape.clone())?, worker: self.worker.clone() })
    }

    fn copy_cache(&self, cache: &IreeCache) -> Result<IreeCache> {
        Ok(IreeCache { id: self.worker.copy_cache(cache.id)?, worker: self.worker.clone() })
    }

    /// On the CPU, where the buffers are host memory: zeroed through a mapping.
    fn zero_cache(&self, cache: &mut IreeCache) -> Result<bool> {
        if self.device != IreeDevice::Cpu {
            return Ok(false);
        }
        self.worker.zero_cache(cache.id)?;
        Ok(true)
    }

    fn execute(&self, cache: &mut IreeCache, call: &GraphCall) -> Result<GraphOutput> {
        Ok(self.worker.step(cache.id, self.module_of(call.graph)?, call.clone())?)
    }

    /// On the CPU, the kernels' read probe (every core summing a buffer larger than the
    /// last-level cache, as decode streams the weights through the same kernels); no probe on a
    /// GPU yet.
    fn measure_memory_bandwidth(&self) -> Result<Option<f64>> {
        Ok((self.device == IreeDevice::Cpu).then(cpu_kernels::bandwidth::measure_host_read_bandwidth))
    }

    fn decodes_batches(&self) -> bool {
        true
    }

    fn execute_batch(&self, caches: &mut [&mut IreeCache], call: &BatchCall) -> Result<Vec<GraphOutput>> {
        let ids = caches.iter().map(|cache| cache.id).collect();
        Ok(self.worker.step_batch(ids, self.module_of(call.graph)?, call.clone())?)
    }
}

impl IreeRuntime {
    /// The loaded module that holds `graph`.
    fn module_of(&self, graph: GraphSpec) -> Result<String> {
        let function = graph.name();
        let module = self.modules.lock().unwrap_or_else(|p| p.into_inner()).get(&function).cloned();
        Ok(module.ok_or_else(|| crate::error::IreeError::Runtime(format!("no loaded module holds {function}")))?)
    }
}
