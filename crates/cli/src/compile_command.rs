//! `seam compile`: compiles a model's graphs into the backend's on-disk cache ahead of time, for a
//! machine that can run them but cannot compile them (a GPU machine without the IREE compiler or
//! a package registry). There, `SEAM_IREE_COMPILER=none` makes the backend use the cache alone.
//!
//! Only the `iree` backend compiles ahead: its compiler runs without the target device. A PJRT
//! plugin compiles on its own device.

use crate::cli_error::CliError;
#[cfg(feature = "iree")]
use crate::run_command::resolve_model_dir;
#[cfg(feature = "iree")]
use backend_iree::GraphSelection;
use clap::Args;
#[cfg(feature = "iree")]
use session_api::LoadRequest;
use session_api::{registered_backends, SeamError, WeightFormat};
use std::path::PathBuf;

#[derive(Args)]
pub struct CompileArgs {
    /// Backend, or a backend alias naming its device (`iree-cuda`).
    #[arg(long, default_value = "iree")]
    backend: String,
    /// Device of the backend (`cpu`, `cuda:0`); the alias's, else `cpu`, when absent. A CUDA
    /// target is read from nvidia-smi, or from SEAM_IREE_CUDA_TARGET on a machine without a GPU.
    #[arg(long)]
    device: Option<String>,
    /// Model directory (repeatable); the default model when neither this nor
    /// --conformance-models is given. Only its config is read.
    #[arg(long = "model")]
    models: Vec<PathBuf>,
    /// Also compile the conformance suite's tiny models, at every context the suite loads them with.
    #[arg(long)]
    conformance_models: bool,
    /// Weight format (repeatable); f16 and int4 when absent.
    #[arg(long = "weights")]
    formats: Vec<WeightFormat>,
    /// Context to compile for (repeatable); the backend's default when absent.
    #[arg(long = "max-context")]
    contexts: Vec<usize>,
    /// Only the token graphs of --model (what `seam run` and `seam bench` use), not the
    /// embedding-input or batched decode graphs (the conformance models get what the suite uses).
    #[arg(long)]
    token_graphs_only: bool,
    /// A load setting, KEY=VALUE (repeatable), as for `seam run --set`.
    #[arg(long = "set")]
    settings: Vec<String>,
}

pub fn run(args: CompileArgs) -> Result<(), CliError> {
    let (backend, alias_device) = match registered_backends().iter().find(|b| b.name == args.backend) {
        Some(entry) => match entry.alias_of() {
            Some((backend, device)) => (backend.to_string(), Some(device.to_string())),
            None => (entry.name.to_string(), None),
        },
        None => (args.backend.clone(), None),
    };
    #[cfg(not(feature = "iree"))]
    {
        let _ = (backend, alias_device);
        Err(SeamError::Unsupported {
            backend: args.backend.clone(),
            feature: "compiling ahead of time (this binary was built without the iree backend, feature `iree`)".into(),
        }
        .into())
    }
    #[cfg(feature = "iree")]
    compile_with_iree(args, backend, alias_device)
}

#[cfg(feature = "iree")]
fn compile_with_iree(args: CompileArgs, backend: String, alias_device: Option<String>) -> Result<(), CliError> {
    if backend != backend_iree::BACKEND_NAME {
        return Err(SeamError::Unsupported {
            backend: args.backend.clone(),
            feature:
                "compiling ahead of time (only iree compiles without its device; a PJRT plugin compiles on its own)"
                    .into(),
        }
        .into());
    }
    let device = args.device.clone().or(alias_device);
    let settings = crate::run_command::parse_settings(&args.settings)?;
    let formats = if args.formats.is_empty() { WeightFormat::ALL.to_vec() } else { args.formats.clone() };

    // (model, a context to compile it for, which of its graphs)
    let mut jobs: Vec<(PathBuf, Option<usize>, GraphSelection)> = Vec::new();
    let contexts: Vec<Option<usize>> =
        if args.contexts.is_empty() { vec![None] } else { args.contexts.iter().copied().map(Some).collect() };
    if args.conformance_models {
        let tiny = conformance::models::tiny_models(&conformance::models::default_cache_dir())
            .map_err(|e| CliError::Usage(format!("the conformance models: {e}")))?;
        for model in tiny {
            for context in conformance::LOAD_CONTEXTS {
                // Only the suite's batched case decodes batches, and only its scoring case scores,
                // at the default context and never more sequences at once than it plans: the
                // other graphs would only take room in a GPU bundle.
                let default = context.is_none();
                let max_batch = if default { conformance::cases::batched::MAX_SEQUENCES } else { 0 };
                let selection = GraphSelection { embeddings: true, max_batch, scoring: default };
                jobs.push((model.dir.clone(), context, selection));
            }
        }
    }
    if !args.models.is_empty() || !args.conformance_models {
        let models = if args.models.is_empty() { vec![resolve_model_dir(None)?] } else { args.models.clone() };
        let selection = if args.token_graphs_only { GraphSelection::TOKENS_ONLY } else { GraphSelection::ALL };
        for model in models {
            let dir = resolve_model_dir(Some(model))?;
            jobs.extend(contexts.iter().map(|&context| (dir.clone(), context, selection)));
        }
    }

    for (model, max_context, selection) in &jobs {
        for &format in &formats {
            let mut request = LoadRequest::new(model, format);
            request.device = device.clone();
            request.max_context = *max_context;
            request.settings = settings.clone();
            let report = backend_iree::compile_ahead(&request, *selection)?;
            say!(
                "{} {format} context {}: {} graphs compiled, {} already cached",
                model.display(),
                max_context.map_or("default".to_string(), |c| c.to_string()),
                report.compiled,
                report.from_cache
            );
        }
    }
    say!("modules are in {}", llama_model::home::iree_cache_dir().display());
    Ok(())
}
