//! `seam serve`: the OpenAI-compatible server (crate `openai-server`) on a loaded model.

use crate::cli_error::CliError;
use crate::progress::StageBar;
use crate::run_command::{LoadArgs, TargetArgs};
use chat_tokenizer::{ChatTemplate, Tokenizer};
use clap::Args;
use llama_model::model_dir::ModelDir;
use openai_server::scheduler::SchedulerConfig;
use openai_server::{ServedModel, Server, ServerOptions};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

/// Arguments of `seam serve`.
#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    target: TargetArgs,
    #[command(flatten)]
    load: LoadArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on (0 picks a free one; the address is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests decoded together at most (each holds a session and its cache).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=256))]
    parallel: u16,
    /// Requests waiting for a slot at most; beyond it requests get 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Prompt tokens prefilled per step for one request, between decode steps of the others.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    prefill_chunk: u32,
    /// Longest a request may run in seconds, queueing included (it then ends with "length").
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
    request_timeout: u64,
    /// `max_tokens` for requests that give none (default: what the context leaves).
    #[arg(long)]
    default_max_tokens: Option<usize>,
    /// Seconds a client may take to send a request's headers, and then its body; connections
    /// idle for as long between requests are closed.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    read_timeout: u64,
    /// The model id clients name (default: the model directory's name).
    #[arg(long)]
    model_name: Option<String>,
}

/// Loads the model and serves until SIGTERM or Ctrl-C, then lets running requests finish.
pub fn run(args: ServeArgs) -> Result<(), CliError> {
    let backend = args.target.backend()?;
    let model_dir = args.target.model_dir()?;
    let model = ModelDir::open(&model_dir)?;
    let tokenizer = Tokenizer::from_model_dir(&model_dir)?;
    let chat_template = match ChatTemplate::from_model_dir(&model_dir) {
        Ok(template) => Some(template),
        Err(e) => {
            say!("note: no chat template ({e}); /v1/chat/completions will refuse requests");
            None
        }
    };
    let bar = Arc::new(StageBar::new());
    let request = args.load.request(&args.target, &model_dir, &bar)?;
    let engine = args.target.load(backend.as_ref(), &request)?;
    bar.finish();
    // Graphs a runtime would otherwise compile on first use (a batch size first reached under
    // load) would stall every running stream for as long as the compile takes.
    let started = std::time::Instant::now();
    engine.prepare_for_serving(args.parallel as usize)?;
    if started.elapsed() > Duration::from_secs(1) {
        say!(
            "prepared the graphs for up to {} parallel sequences in {:.1} s",
            args.parallel,
            started.elapsed().as_secs_f64()
        );
    }
    // A server keeps running: what the load freed goes back to the system now.
    session_api::stats::release_freed_memory();
    let info = engine.info();
    let served = ServedModel {
        engine,
        tokenizer: Arc::new(tokenizer),
        chat_template,
        eos_ids: model.eos_token_ids(),
        id: args.model_name.clone().unwrap_or_else(|| model.name()),
    };
    let options = ServerOptions {
        scheduler: SchedulerConfig {
            slots: args.parallel as usize,
            max_queue: args.max_queue,
            prefill_chunk: args.prefill_chunk as usize,
            request_time_limit: Duration::from_secs(args.request_timeout),
        },
        default_max_tokens: args.default_max_tokens,
        read_timeout: Duration::from_secs(args.read_timeout),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::Server(format!("could not start the server's runtime: {e}")))?;
    runtime.block_on(async move {
        let id = served.id.clone();
        let wanted = SocketAddr::new(args.host, args.port);
        let server = Server::bind(served, options, wanted)
            .await
            .map_err(|e| CliError::Server(format!("could not listen on {wanted}: {e}")))?;
        let address = server.local_addr()?;
        say!(
            "serving {id} on {} ({}, {}) at http://{address}/v1 ({} parallel); SIGTERM or Ctrl-C stops it",
            info.backend,
            info.device,
            info.weights,
            args.parallel
        );
        server
            .run(openai_server::shutdown_signal())
            .await
            .map_err(|e| CliError::Server(format!("the server failed: {e}")))?;
        say!("stopped: every running request finished");
        Ok(())
    })
}
