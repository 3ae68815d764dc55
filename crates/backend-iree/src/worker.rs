//! The runtime owner thread.
//!
//! An IREE VM context is not safe for concurrent invocations, while the session contract wants a
//! `Send + Sync` engine and `Send` sessions. So one dedicated thread creates and owns everything
//! IREE: the device, the loaded modules, the weight buffers (imported or uploaded once, shared by
//! every session) and each session's KV cache buffers. Engines and sessions hold a
//! [`WorkerHandle`] and send it jobs (closures over the thread's state) over a channel; each job
//! carries its own reply channel. The thread ends when the last handle is dropped, releasing the
//! device memory.
//!
//! The KV cache stays on the device: a step passes the session's cache buffers to the function,
//! which (through the graphs' `tf.aliasing_output` attributes) imports them as consumed and writes
//! the new keys and values into them in place; the returned views, which alias the same storage,
//! replace the session's handles. Only the token id (4 bytes) and, when asked for, the logits come
//! back to the host.

use crate::device::IreeDevice;
use crate::error::IreeError;
use crate::task_flags::{self, TaskSettings};
use graph_engine::{BatchCall, GraphCall, GraphInput, GraphOutput, PreparedWeights};
use iree_runtime::{BufferView, Device, ElementType, Program};
use stablehlo_llama::ArgDtype;
use stablehlo_llama::GraphSpec;
use std::collections::HashMap;
use std::sync::mpsc::{channel, Sender};

/// A session's KV cache on the worker.
pub type CacheId = u64;

/// A session's cache tensors, as the graphs declare them (`stablehlo_llama::cache_arg_shapes`:
/// stacked keys and values, or a pair per layer), all of one element type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheShape {
    pub element: ElementType,
    pub shapes: Vec<Vec<usize>>,
}

/// The VM module name of the emitted graphs (`module @seam_llama`): functions are resolved as
/// `seam_llama.<function>` inside the module that holds them.
const VM_MODULE: &str = "seam_llama";

/// Takes the calling thread (the runtime thread) out of wakeup preemption: Linux's
/// `SCHED_BATCH` policy (sched(7)), which keeps its nice value and so its share of the CPU.
///
/// Why (ADR 0036): the runtime thread sleeps in IREE's fence wait while the workers run a call,
/// and the worker that finishes the call wakes it. Under the normal policy the woken thread
/// preempts that worker on its own CPU and then spins in the wait's cleanup
/// (`iree_async_semaphore_multi_wait` waits with `pause` for the waking callback to return) until
/// the preempted worker runs again; with no idle CPU (as many workers as CPUs) that is up to a
/// scheduler slice per call. Without wakeup preemption the worker returns first and the thread
/// runs as soon as a CPU is free. Failing to set it only loses that, so a failure is ignored.
fn disfavor_wakeup_preemption() {
    #[cfg(target_os = "linux")]
    {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: `param` outlives the call; pid 0 is the calling thread. SCHED_BATCH needs no
        // privilege.
        let _ = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
    }
}

/// Work for the runtime thread: a closure over the state only that thread may touch.
type Job = Box<dyn FnOnce(&mut WorkerState) + Send>;

/// A handle on the runtime thread; cheap to clone, `Send + Sync`.
#[derive(Clone)]
pub struct WorkerHandle {
    sender: Sender<Job>,
}

impl WorkerHandle {
    /// Starts a runtime thread on `device` and waits until its runtime device exists. On the CPU
    /// the task system is set up as `task` says, and with `kernels` the device's executables can
    /// call seam's kernels ([`crate::kernel_plugin`]).
    pub fn spawn(device: IreeDevice, task: &TaskSettings, kernels: bool) -> Result<WorkerHandle, IreeError> {
        let driver = device.driver()?;
        let plugin = if kernels { Some(crate::kernel_plugin::install()?) } else { None };
        let task = TaskSettings { plugin, ..task.clone() };
        let (sender, receiver) = channel::<Job>();
        let (ready_tx, ready_rx) = channel::<Result<(), IreeError>>();
        std::thread::Builder::new()
            .name("seam-iree-runtime".into())
            .spawn(move || {
                disfavor_wakeup_preemption();
                let created = match device {
                    IreeDevice::Cpu => task_flags::create_cpu_device(&task),
                    IreeDevice::Cuda => Device::create(driver).map_err(IreeError::from),
                };
                let device = match created {
                    Ok(runtime) => runtime,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                let mut state = WorkerState {
                    device,
                    modules: HashMap::new(),
                    weights: Vec::new(),
                    caches: HashMap::new(),
                    next_cache: 0,
                };
                // Ends when every handle (engine and sessions) is gone.
                while let Ok(job) = receiver.recv() {
                    job(&mut state);
                }
            })
            .map_err(|e| IreeError::Runtime(format!("starting the runtime thread: {e}")))?;
        ready_rx.recv().map_err(|_| IreeError::WorkerGone)??;
        Ok(WorkerHandle { sender })
    }

    /// Runs `work` on the runtime thread and waits for its result.
    fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce(&mut WorkerState) -> Result<T, IreeError> + Send + 'static,
    ) -> Result<T, IreeError> {
        let (reply, answer) = channel();
        let job: Job = Box::new(move |state| {
            let _ = reply.send(work(state));
        });
        self.sender.send(job).map_err(|_| IreeError::WorkerGone)?;
        answer.recv().map_err(|_| IreeError::WorkerGone)?
    }

    /// Loads a compiled module under `name`.
    pub fn load_module(&self, name: &str, vmfb: Vec<u8>) -> Result<(), IreeError> {
        let name = name.to_string();
        self.run(move |state| {
            let program = Program::load(&state.device, vmfb)?;
            state.modules.insert(name, program);
            Ok(())
        })
    }

    /// Hands the weights, in the graphs' argument order, to the device once for every later
    /// step: on the CPU the buffers are the prepared weights' mapping itself (nothing copied,
    /// pages read on first use); a GPU gets one copy.
    pub fn upload_weights(&self, weights: PreparedWeights) -> Result<(), IreeError> {
        self.run(move |state| state.upload(&weights))
    }

    /// Allocates a zeroed KV cache of `shape`.
    pub fn new_cache(&self, shape: CacheShape) -> Result<CacheId, IreeError> {
        self.run(move |state| state.new_cache(shape, None))
    }

    /// A new cache holding a copy of `from`'s contents (through the host: IREE's high-level API
    /// has no device-to-device copy, and a fork is rare next to the steps).
    pub fn copy_cache(&self, from: CacheId) -> Result<CacheId, IreeError> {
        self.run(move |state| match state.caches.get(&from) {
            Some(Cache { shape, buffers: Some(buffers) }) => {
                let contents = buffers.iter().map(BufferView::read_bytes).collect::<Result<Vec<_>, _>>()?;
                let shape = shape.clone();
                state.new_cache(shape, Some(contents))
            }
            _ => Err(IreeError::Runtime(format!("no live KV cache {from} to copy"))),
        })
    }

    /// Zeroes the buffers of cache `id` in place; an error where it has none (a failed step
    /// consumed them) or they cannot be mapped.
    pub fn zero_cache(&self, id: CacheId) -> Result<(), IreeError> {
        self.run(move |state| match state.caches.get(&id) {
            Some(Cache { buffers: Some(buffers), .. }) => {
                buffers.iter().try_for_each(BufferView::zero).map_err(IreeError::from)
            }
            _ => Err(IreeError::Runtime(format!("no live KV cache {id} to zero"))),
        })
    }

    /// Frees a cache (no reply: called from `Drop`).
    pub fn drop_cache(&self, id: CacheId) {
        let _ = self.sender.send(Box::new(move |state: &mut WorkerState| {
            state.caches.remove(&id);
        }));
    }

    /// Runs `call` of the graphs loaded as `module` on `cache`.
    pub fn step(&self, cache: CacheId, module: String, call: GraphCall) -> Result<GraphOutput, IreeError> {
        self.run(move |state| state.step(cache, &module, call))
    }

    /// One batched decode call over the caches of its sequences, in order.
    pub fn step_batch(
        &self,
        caches: Vec<CacheId>,
        module: String,
        call: BatchCall,
    ) -> Result<Vec<GraphOutput>, IreeError> {
        self.run(move |state| state.step_batch(&caches, &module, call))
    }
}

/// A cache's buffers, in argument order; `None` after a failed step consumed them (the session
/// is then poisoned and its reset allocates fresh ones through [`WorkerHandle::new_cache`]).
struct Cache {
    shape: CacheShape,
    buffers: Option<Vec<BufferView>>,
}

struct WorkerState {
    device: Device,
    modules: HashMap<String, Program>,
    weights: Vec<BufferView>,
    caches: HashMap<CacheId, Cache>,
    next_cache: CacheId,
}

impl WorkerState {
    fn upload(&mut self, weights: &PreparedWeights) -> Result<(), IreeError> {
        let memory = weights.memory();
        self.weights = weights
            .args()
            .iter()
            .map(|arg| {
                let element = element_type(arg.spec.dtype);
                Ok(self.device.import_host(memory.clone(), arg.range.clone(), element, &arg.spec.shape)?)
            })
            .collect::<Result<_, IreeError>>()?;
        Ok(())
    }

    /// A new cache: zeros (made in place on the CPU, so that its pages cost only where the
    /// session touches them: [`Device::zeros`]), or the bytes of an earlier one.
    fn new_cache(&mut self, shape: CacheShape, contents: Option<Vec<Vec<u8>>>) -> Result<CacheId, IreeError> {
        let mut buffers = Vec::with_capacity(shape.shapes.len());
        for (i, dims) in shape.shapes.iter().enumerate() {
            buffers.push(match &contents {
                Some(contents) => self.device.upload(&contents[i], shape.element, dims)?,
                None => self.device.zeros(shape.element, dims)?,
            });
        }
        let id = self.next_cache;
        self.next_cache += 1;
        self.caches.insert(id, Cache { shape, buffers: Some(buffers) });
        Ok(id)
    }

    /// A small host value (token ids, positions) as a buffer.
    fn small<T: bytemuck::Pod>(
        &self,
        element: ElementType,
        shape: &[usize],
        values: &[T],
    ) -> Result<BufferView, IreeError> {
        Ok(self.device.upload(bytemuck::cast_slice(values), element, shape)?)
    }

    fn step(&mut self, cache_id: CacheId, module: &str, call: GraphCall) -> Result<GraphOutput, IreeError> {
        let mut leading: Vec<BufferView> = Vec::with_capacity(3);
        leading.push(match &call.input {
            GraphInput::Tokens(ids) => self.small(ElementType::I32, &[ids.len()], ids)?,
            GraphInput::Embeddings(values) => {
                let rows = call.graph.kind.input_rows();
                self.small(ElementType::F32, &[rows, values.len() / rows], values)?
            }
        });
        leading.push(self.small(ElementType::I32, &[], &[call.position as i32])?);
        if call.graph.kind.takes_count() {
            leading.push(self.small(ElementType::I32, &[], &[call.count as i32])?);
        }
        let mut outputs = self.invoke(&[cache_id], module, call.graph, leading, call.read_logits)?;
        Ok(outputs.remove(0))
    }

    fn step_batch(&mut self, caches: &[CacheId], module: &str, call: BatchCall) -> Result<Vec<GraphOutput>, IreeError> {
        let tokens = self.small(ElementType::I32, &[call.tokens.len()], &call.tokens)?;
        let positions = self.small(ElementType::I32, &[call.positions.len()], &call.positions)?;
        self.invoke(caches, module, call.graph, vec![tokens, positions], call.read_logits)
    }

    /// Calls `graph` with its `leading` arguments (input, position(s), count) and the caches of
    /// its sequences, which it consumes and replaces with the updated ones; returns each
    /// sequence's greedy token and, when `read_logits`, its row of the logits.
    fn invoke(
        &mut self,
        cache_ids: &[CacheId],
        module: &str,
        graph: GraphSpec,
        leading: Vec<BufferView>,
        read_logits: bool,
    ) -> Result<Vec<GraphOutput>, IreeError> {
        let program =
            self.modules.get(module).ok_or_else(|| IreeError::Runtime(format!("module {module} is not loaded")))?;
        let name = format!("{VM_MODULE}.{}", graph.name());
        let function = program.function(&name)?;
        // Every cache is checked before any is taken: a lost one fails the call with the others intact.
        for id in cache_ids {
            match self.caches.get(id) {
                None => return Err(IreeError::Runtime(format!("no KV cache {id}"))),
                Some(cache) if cache.buffers.is_none() => {
                    return Err(IreeError::Runtime("the KV cache was lost by an earlier failure".into()))
                }
                Some(_) => {}
            }
        }
        let mut taken: Vec<BufferView> = leading;
        // Each cache's tensor count, in order: the results come back the same way.
        let mut counts = Vec::with_capacity(cache_ids.len());
        for id in cache_ids {
            // Taken out: the function consumes these buffers and returns the updated ones.
            let cache = self.caches.get_mut(id).unwrap_or_else(|| unreachable!("checked above"));
            let buffers = cache.buffers.take().unwrap_or_else(|| unreachable!("checked above"));
            counts.push(buffers.len());
            taken.extend(buffers);
        }
        let inputs: Vec<&BufferView> = taken.iter().chain(&self.weights).collect();
        let outputs = function.invoke(&inputs);
        drop(inputs);
        drop(taken);
        let mut outputs = outputs?.into_iter();
        // (tokens, the cache tensors of each sequence, logits): every function of the module
        // returns the logits; they stay in device memory unless the call asks for them.
        let expected = 2 + counts.iter().sum::<usize>();
        if outputs.len() != expected {
            return Err(IreeError::Runtime(format!("{name} returned {} results, expected {expected}", outputs.len())));
        }
        let tokens = outputs.next().unwrap_or_else(|| unreachable!("counted above"));
        for (id, &count) in cache_ids.iter().zip(&counts) {
            let buffers: Vec<BufferView> = outputs.by_ref().take(count).collect();
            if let Some(cache) = self.caches.get_mut(id) {
                cache.buffers = Some(buffers);
            }
        }
        let tokens = tokens.read::<i32>()?;
        let logits = match outputs.next() {
            Some(view) if read_logits => Some(view.read::<f32>()?),
            _ => None,
        };
        let sequences = cache_ids.len();
        if tokens.len() != sequences || logits.as_ref().is_some_and(|l| l.len() % sequences != 0) {
            return Err(IreeError::Runtime(format!(
                "{name} returned {} tokens for {sequences} sequences",
                tokens.len()
            )));
        }
        let vocab = logits.as_ref().map_or(0, |l| l.len() / sequences);
        tokens
            .iter()
            .enumerate()
            .map(|(i, &token)| {
                let token = u32::try_from(token)
                    .map_err(|_| IreeError::Runtime(format!("the graph returned token id {token}")))?;
                let logits = logits.as_ref().map(|all| all[i * vocab..(i + 1) * vocab].to_vec());
                Ok(GraphOutput { token, logits })
            })
            .collect()
    }
}

/// The runtime's element type of a graph argument's.
pub(crate) fn element_type(dtype: ArgDtype) -> ElementType {
    match dtype {
        ArgDtype::F32 => ElementType::F32,
        ArgDtype::F16 => ElementType::F16,
        ArgDtype::I32 => ElementType::I32,
        ArgDtype::I8 => ElementType::I8,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runtime thread runs without wakeup preemption (ADR 0036).
    #[cfg(target_os = "linux")]
    #[test]
    fn runtime_thread_is_batch_scheduled() {
        let worker = WorkerHandle::spawn(IreeDevice::Cpu, &TaskSettings { workers: Some(1), plugin: None }, false)
            .expect("a CPU runtime thread");
        // SAFETY: queries the calling thread's policy.
        let policy = worker.run(|_| Ok(unsafe { libc::sched_getscheduler(0) })).expect("the runtime thread runs jobs");
        assert_eq!(policy, libc::SCHED_BATCH);
        // SAFETY: as above, on the test's own thread, which keeps the normal policy.
        assert_eq!(unsafe { libc::sched_getscheduler(0) }, libc::SCHED_OTHER);
    }
}
