//! Loading a model onto a [`GraphRuntime`]: the part every compiler backend shares.

use crate::engine::{graph_groups, token_graphs, GraphEngine, Shared, DEFAULT_MAX_CONTEXT};
use crate::prepared_weights::{PreparedWeights, Unusable, WeightsCache};
use crate::runtime::GraphRuntime;
use llama_model::model_dir::ModelDir;
use llama_model::weights::load_weights;
use llama_model::weights::names::EMBED_TOKENS;
use llama_model::LlamaWeights;
use llama_model::{Int4Layout, LlamaConfig};
use session_api::{EngineInfo, LoadRequest, Result, SeamError, WeightFormat};
use stablehlo_llama::{
    buckets_for_context, for_each_graph_host_arg, graph_weight_args, GraphError, GraphOptions, GraphSpec, HostKernels,
    KernelActivations, LayerMode, StorageDtype, VectorProducts, WeightArg,
};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// How a backend wants its graphs built: everything of [`GraphOptions`] that is not the model's
/// or the request's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphSettings {
    /// Unrolled layers or a loop over them.
    pub layers: LayerMode,
    /// Element type of fp16 models' matrices on the device.
    pub dense: StorageDtype,
    /// Element type of the KV cache.
    pub cache: StorageDtype,
    /// From how many rows per call int4 matrices are dequantized in the graph.
    pub int4_dequantize_from: usize,
    /// seam's CPU kernels as custom calls, for a runtime that registered them
    /// ([`stablehlo_llama::HostKernels`]).
    pub host_kernels: Option<HostKernels>,
    /// How one-row calls' products are written where no kernel takes them.
    pub vector_products: VectorProducts,
    /// Whether the graphs' dots ask for f32 products ([`GraphOptions::highest_precision`]).
    pub highest_precision: bool,
}

impl GraphSettings {
    /// The keys of [`LoadRequest::settings`] a graph backend takes: `layers` (`loop`,
    /// `unrolled`, `per-layer-cache`), `dense` and `kv_cache` (`f16`, `f32`),
    /// `int4_dequantize_from` (a row count, at least 1), `kernels` (`seam` or `none`: whether
    /// the graphs call seam's CPU kernels; only a backend that registered them accepts `seam`,
    /// see [`GraphSettings::kernels_requested`]), `activations` (`exact` or `int8`: how the
    /// kernels' int4 and int8 products take their activations, ADR 0024; `int8` only with the
    /// kernels), `vector_products` (`dot`, `reduce`, `reduce-words`, `reduce-nibbles`,
    /// `cuda-kernels` or `cuda-kernels-each`: how decode's products are written where no kernel
    /// takes them, [`VectorProducts`]; a backend refuses the CUDA kernels where it cannot run
    /// them), `dot_precision` (`default` or
    /// `highest`: [`GraphOptions::highest_precision`]).
    pub const KEYS: [&'static str; 8] = [
        "layers",
        "dense",
        "kv_cache",
        "int4_dequantize_from",
        "kernels",
        "activations",
        "vector_products",
        "dot_precision",
    ];

    /// What `request` (or `{env_prefix}_KERNELS`) says of seam's CPU kernels: `Some(true)` for
    /// `seam`, `Some(false)` for `none`, `None` when it says nothing. A backend reads this first
    /// to pick its defaults (the kernels change the layout and precision the weights are held
    /// in), then applies [`GraphSettings::with_request`].
    pub fn kernels_requested(request: &LoadRequest, env_prefix: &str) -> Result<Option<bool>> {
        let env = format!("{env_prefix}_KERNELS");
        match request.setting("kernels", &env).as_deref() {
            None => Ok(None),
            Some("seam") => Ok(Some(true)),
            Some("none") => Ok(Some(false)),
            Some(other) => {
                Err(SeamError::InvalidInput(format!("kernels={other} (setting or {env}): expected seam or none")))
            }
        }
    }

    /// These settings (a backend's defaults) with what `request` sets, or else the environment
    /// variables `{env_prefix}_LAYERS`, `_DENSE`, `_KV_CACHE`, `_INT4_DEQUANTIZE_FROM`,
    /// `_VECTOR_PRODUCTS` (and the others of [`GraphSettings::KEYS`]), overriding
    /// them. Unknown keys and bad values are `InvalidInput`.
    pub fn with_request(self, backend: &str, request: &LoadRequest, env_prefix: &str) -> Result<GraphSettings> {
        request.check_settings(backend, &Self::KEYS)?;
        let get = |key: &str| {
            let env = format!("{env_prefix}_{}", key.to_ascii_uppercase());
            request.setting(key, &env).map(|value| (format!("{key}={value} (setting or {env})"), value))
        };
        let mut settings = self;
        if let Some((what, value)) = get("layers") {
            settings.layers = match value.as_str() {
                "loop" => LayerMode::Loop,
                "unrolled" => LayerMode::Unrolled,
                "per-layer-cache" => LayerMode::UnrolledCachePerLayer,
                _ => {
                    return Err(SeamError::InvalidInput(format!("{what}: expected loop, unrolled or per-layer-cache")))
                }
            };
        }
        let dtype = |what: String, value: String| match value.as_str() {
            "f16" => Ok(StorageDtype::F16),
            "f32" => Ok(StorageDtype::F32),
            _ => Err(SeamError::InvalidInput(format!("{what}: expected f16 or f32"))),
        };
        if let Some((what, value)) = get("dense") {
            settings.dense = dtype(what, value)?;
        }
        if let Some((what, value)) = get("kv_cache") {
            settings.cache = dtype(what, value)?;
        }
        match Self::kernels_requested(request, env_prefix)? {
            Some(true) if settings.host_kernels.is_none() => {
                return Err(SeamError::InvalidInput(format!(
                    "kernels=seam: {backend} has not registered seam's CPU kernels for this device"
                )))
            }
            Some(false) => settings.host_kernels = None,
            _ => {}
        }
        if let Some((what, value)) = get("activations") {
            let activations = match value.as_str() {
                "exact" => KernelActivations::Exact,
                "int8" => KernelActivations::Int8,
                _ => return Err(SeamError::InvalidInput(format!("{what}: expected exact or int8"))),
            };
            match &mut settings.host_kernels {
                Some(kernels) => kernels.activations = activations,
                None if activations == KernelActivations::Exact => {}
                None => {
                    return Err(SeamError::InvalidInput(format!(
                        "{what}: only seam's CPU kernels round activations, and this load runs without them"
                    )))
                }
            }
        }
        if let Some((what, value)) = get("vector_products") {
            settings.vector_products =
                VectorProducts::ALL.into_iter().find(|form| form.setting() == value).ok_or_else(|| {
                    let names: Vec<&str> = VectorProducts::ALL.iter().map(|form| form.setting()).collect();
                    let (last, rest) = names.split_last().expect("forms");
                    SeamError::InvalidInput(format!("{what}: expected {} or {last}", rest.join(", ")))
                })?;
        }
        if let Some((what, value)) = get("dot_precision") {
            settings.highest_precision = match value.as_str() {
                "default" => false,
                "highest" => true,
                _ => return Err(SeamError::InvalidInput(format!("{what}: expected default or highest"))),
            };
        }
        if let Some((what, value)) = get("int4_dequantize_from") {
            settings.int4_dequantize_from = value
                .parse::<usize>()
                .ok()
                .filter(|&n| n >= 1)
                .ok_or_else(|| SeamError::InvalidInput(format!("{what}: expected a row count of at least 1")))?;
        }
        Ok(settings)
    }

    /// The graph options for a model of `config`, a context request and a weight format (an
    /// int4 model's matrices as `int4_layout`).
    pub fn options(
        &self,
        config: &LlamaConfig,
        max_context: Option<usize>,
        format: WeightFormat,
        int4_layout: Int4Layout,
    ) -> GraphOptions {
        GraphOptions {
            int4_layout,
            layers: self.layers,
            dense: self.dense,
            cache: self.cache,
            int4_dequantize_from: self.int4_dequantize_from,
            host_kernels: self.host_kernels,
            vector_products: self.vector_products,
            highest_precision: self.highest_precision,
            ..GraphOptions::new(max_context.unwrap_or(DEFAULT_MAX_CONTEXT).min(config.max_position_embeddings), format)
        }
    }

    /// The precision the weights are resident in, for [`EngineInfo::resident_precision`].
    pub fn resident_precision(&self, format: WeightFormat, int4_layout: Int4Layout) -> String {
        match (format, self.dense) {
            (WeightFormat::Int4, _) if int4_layout == Int4Layout::ALL_INT4 => "int4".into(),
            (WeightFormat::Int4, _) => format!("int4 ({int4_layout})"),
            (WeightFormat::F16, StorageDtype::F16) => "f16".into(),
            (WeightFormat::F16, StorageDtype::F32) => "f32".into(),
        }
    }
}

/// Refuses a thread count the runtime cannot honour: runtimes whose CPU thread pool is sized from
/// the machine (IREE's local-task driver, XLA's CPU client) would silently ignore any other count.
pub fn refuse_thread_count(backend: &str, request: &LoadRequest, pool: &str) -> Result<()> {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    match request.threads.filter(|&t| t != cores) {
        Some(threads) => Err(SeamError::Unsupported {
            backend: backend.to_string(),
            feature: format!("a thread count ({threads}) other than every core ({cores}): {pool} uses all of them"),
        }),
        None => Ok(()),
    }
}

/// What a backend's `make_runtime` is given: the model and the options of its graphs.
#[derive(Debug, Clone, Copy)]
pub struct LoadedModel<'a> {
    pub config: &'a LlamaConfig,
    pub options: &'a GraphOptions,
}

/// The graphs a load of `request` with `settings` compiles: known from the model's config (and an int4 file's header),
/// so that a machine with the compiler but not the device can compile them ahead of time.
#[derive(Debug, Clone)]
pub struct GraphPlan {
    pub config: LlamaConfig,
    pub options: GraphOptions,
    /// Prefill buckets of the token graphs (decode is the one-row graph).
    pub buckets: Vec<usize>,
}

impl GraphPlan {
    /// The plan of the model in `dir` loaded by `request` with `settings` (the model's config,
    /// and for int4 the int4 file's header, are read).
    fn new(dir: &ModelDir, request: &LoadRequest, settings: GraphSettings) -> Result<GraphPlan> {
        let config = dir.config().clone();
        let int4_layout = match request.weights {
            WeightFormat::Int4 => dir.int4_layout()?,
            WeightFormat::F16 => Int4Layout::DEFAULT,
        };
        let options = settings.options(&config, request.max_context, request.weights, int4_layout);
        let buckets = buckets_for_context(options.max_context);
        Ok(GraphPlan { config, options, buckets })
    }

    /// [`graph_groups`] of the plan's buckets: the token graphs first, then each embedding graph,
    /// then each batched decode graph (loaded by runtimes that decode batches).
    pub fn groups(&self) -> Vec<Vec<GraphSpec>> {
        graph_groups(&self.buckets)
    }
}

/// The model's weights in the requested format, read and checked.
fn read_weights(dir: &ModelDir, request: &LoadRequest) -> Result<LlamaWeights> {
    let report_read = |done: u64, total: u64| request.report("reading weights", done, Some(total));
    Ok(load_weights(dir.path(), request.weights, Some(&report_read))?)
}

/// The weights of `key` as the graphs take them: the verified prepared file, or else `source`
/// (the model's weights, read now when not given) laid out and stored as that file.
fn prepared_weights(
    cache: &WeightsCache,
    key: &str,
    dir: &ModelDir,
    request: &LoadRequest,
    options: &GraphOptions,
    expected: &[WeightArg],
    source: Option<LlamaWeights>,
) -> Result<PreparedWeights> {
    if source.is_none() {
        request.report("verifying prepared weights", 0, Some(1));
        match cache.open(key, &dir.weight_source_files(request.weights)?, expected) {
            Ok(prepared) => {
                request.report("verifying prepared weights", 1, Some(1));
                return Ok(prepared);
            }
            Err(Unusable::Missing) => {}
            Err(Unusable::Rejected(why)) => {
                eprintln!("warning: {} is not used ({why}); preparing the weights again", cache.path(key).display())
            }
        }
    }
    let weights = match source {
        Some(weights) => weights,
        None => read_weights(dir, request)?,
    };
    // After the read: a first int4 load writes the int4 file it then reads, and the sources are
    // the files as they are once the weights exist.
    let sources = dir.weight_source_files(request.weights)?;
    request.report("preparing weights (once per model and layout)", 0, Some(1));
    // Each argument is laid out and written to the file in turn, never all held at once.
    let prepared = cache.store(key, &sources, expected, |writer| {
        let mut failed = None;
        let laid_out = for_each_graph_host_arg(&weights, options, &mut |index, offset, piece| {
            writer.write(index, offset, &piece.bytes).map_err(|e| {
                let message = e.to_string();
                failed = Some(e);
                GraphError::Weight { name: piece.spec.name.clone(), message }
            })
        });
        match (laid_out, failed) {
            (_, Some(e)) => Err(e),
            (Err(e), None) => Err(graph_error(e)),
            (Ok(()), None) => Ok(()),
        }
    })?;
    request.report("preparing weights (once per model and layout)", 1, Some(1));
    Ok(prepared)
}

/// A context of zero is the caller's mistake, refused before any file is read.
fn check_context(request: &LoadRequest) -> Result<()> {
    match request.max_context {
        Some(0) => Err(SeamError::InvalidInput("max_context must be at least 1".into())),
        _ => Ok(()),
    }
}

/// The [`GraphPlan`] of `request` with `settings` (the model's config and, for int4, its int4 file's header are read).
pub fn plan_graphs(request: &LoadRequest, settings: GraphSettings) -> Result<GraphPlan> {
    check_context(request)?;
    let dir = ModelDir::open(&request.model_dir)?;
    GraphPlan::new(&dir, request, settings)
}

/// A graph error as the contract's error: bad options are the caller's, the rest the model's.
pub(crate) fn graph_error(error: GraphError) -> SeamError {
    match error {
        GraphError::Options(message) => SeamError::InvalidInput(message),
        other => SeamError::ModelFormat { path: None, message: other.to_string() },
    }
}

/// Loads `request` for the backend `backend` on its device `device`, on the runtime
/// `make_runtime` builds.
///
/// The weights come from the prepared-weights cache ([`WeightsCache`]) when an earlier load left
/// a file that is still valid for this model and layout; otherwise the model's files are read
/// first (a bad model fails before any compile starts), laid out as the graphs take them, and
/// stored for the next load. The token graphs (decode alone where the runtime loads graphs one
/// by one, the prefill buckets then on first use) are compiled, or read from the disk cache, on a
/// thread of their own while the weights are verified or prepared and uploaded. The device, the
/// settings and the thread count are the backend's to check before calling this
/// ([`GraphSettings::with_request`]).
pub fn load_engine<R: GraphRuntime>(
    backend: &str,
    device: &str,
    request: &LoadRequest,
    settings: GraphSettings,
    make_runtime: impl FnOnce(LoadedModel<'_>) -> Result<R>,
) -> Result<GraphEngine<R>> {
    check_context(request)?;
    let started = Instant::now();
    let dir = ModelDir::open(&request.model_dir)?;
    let GraphPlan { config, options, buckets } = GraphPlan::new(&dir, request, settings)?;
    let expected = graph_weight_args(&config, &options);
    let cache = WeightsCache::project();
    let key = WeightsCache::key(&dir, request.weights, &expected);
    // Without a prepared file the model's own files are read now, before anything compiles.
    let source = if cache.path(&key).is_file() { None } else { Some(read_weights(&dir, request)?) };
    let runtime = make_runtime(LoadedModel { config: &config, options: &options })?;
    let graphs = match runtime.loads_graphs_separately() {
        // Decode alone now; each prefill bucket on first use (a short conversation may use none).
        true => token_graphs(&[]),
        false => token_graphs(&buckets),
    };

    let compiling = "compiling graphs (cached after the first load)";
    let (uploaded, compiled) = std::thread::scope(|scope| {
        let compile = scope.spawn(|| runtime.load_graphs(&graphs));
        request.report(compiling, 0, Some(graphs.len() as u64));
        let uploaded =
            prepared_weights(&cache, &key, &dir, request, &options, &expected, source).and_then(|prepared| {
                // An untied embedding table is only gathered from, a row per token: a decode step
                // does not read it.
                let gathered: u64 = prepared
                    .args()
                    .iter()
                    .filter(|a| !config.tie_word_embeddings && a.spec.name.starts_with(EMBED_TOKENS))
                    .map(|a| a.range.len() as u64)
                    .sum();
                request.report("uploading weights", 0, Some(1));
                runtime.upload_weights(&prepared)?;
                request.report("uploading weights", 1, Some(1));
                Ok((prepared.total_bytes(), gathered))
            });
        let compiled = compile.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (uploaded, compiled)
    });
    let (weight_bytes, gathered_bytes) = uploaded?;
    // A decode step of the pure graphs attends over the whole cache (masked), keys and values of
    // every layer; through the attention kernel it reads only the filled positions, which depend
    // on the conversation, so the figure leaves the cache out (a lower bound).
    let c = &config;
    let cache_bytes = if options.attention_kernel() {
        0
    } else {
        (c.num_hidden_layers * c.num_key_value_heads * c.head_dim * options.max_context * 2) as u64
            * options.cache.arg_dtype().size() as u64
    };
    let compile_report = compiled?;
    request.report(compiling, graphs.len() as u64, Some(graphs.len() as u64));

    let info = EngineInfo {
        backend: backend.to_string(),
        device: device.to_string(),
        model: dir.name(),
        weights: request.weights,
        resident_precision: settings.resident_precision(request.weights, options.int4_layout),
        vocab_size: config.vocab_size,
        hidden_size: config.hidden_size,
        load_time: Default::default(),
        weight_bytes,
        decode_bytes_per_token: Some(weight_bytes - gathered_bytes + cache_bytes),
    };
    let padding = options.padding_cost(buckets.iter().copied().min().unwrap_or(1));
    let shared = Shared {
        runtime,
        idle_caches: Mutex::new(Vec::new()),
        buckets,
        padding,
        max_context: options.max_context,
        hidden_size: config.hidden_size,
        embedding_graphs: Mutex::new(Vec::new()),
        token_graphs: Mutex::new(graphs),
    };
    let mut engine = GraphEngine { shared: Arc::new(shared), info, compile_report };
    engine.set_load_time(started.elapsed());
    Ok(engine)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: GraphSettings = GraphSettings {
        layers: LayerMode::Unrolled,
        dense: StorageDtype::F16,
        cache: StorageDtype::F16,
        int4_dequantize_from: 8,
        host_kernels: None,
        vector_products: VectorProducts::Dot,
        highest_precision: false,
    };

    fn with(settings: &[(&str, &str)]) -> Result<GraphSettings> {
        let mut request = LoadRequest::new("unused", WeightFormat::F16);
        for (key, value) in settings {
            request.settings.insert(key.to_string(), value.to_string());
        }
        // An environment prefix no variable has: only the request's settings count.
        BASE.with_request("test", &request, "SEAM_TEST_SETTINGS_NONE")
    }

    #[test]
    fn products_and_precision_settings() {
        let set = with(&[("vector_products", "reduce"), ("dot_precision", "highest")]).unwrap();
        assert_eq!((set.vector_products, set.highest_precision), (VectorProducts::Reduce, true));
        let set = with(&[("vector_products", "dot"), ("dot_precision", "default")]).unwrap();
        assert_eq!((set.vector_products, set.highest_precision), (VectorProducts::Dot, false));
        assert_eq!(with(&[]).unwrap(), BASE);
        for bad in [("vector_products", "gemv"), ("dot_precision", "tf32")] {
            match with(&[bad]) {
                Err(SeamError::InvalidInput(message)) => assert!(message.contains(bad.0), "{message}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }
}
