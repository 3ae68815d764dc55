//! `seam run`: load a model on a backend and stream a generation.

use crate::cli_error::CliError;
use crate::progress::StageBar;
use chat_tokenizer::{ChatMessage, ChatTemplate, Tokenizer};
use clap::Args;
use llama_model::model_dir::ModelDir;
use session_api::generate::{generate, CancelToken, GenerationRequest};
use session_api::{
    find_backend, find_backend_with, Availability, LoadRequest, Penalties, SamplingConfig, SeamError, SessionOptions,
    WeightFormat,
};
use std::collections::BTreeMap;
use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The backend `seam run` uses when `--backend` is not given: IREE on the CPU, which passes the
/// conformance suite and runs the compiled graphs.
pub const DEFAULT_BACKEND: &str = "iree-cpu";
/// Where an unavailable default backend falls back to (an explicitly named one never does).
pub const FALLBACK_BACKEND: &str = "reference";

/// What a command runs on: backend, device, plugin, model and weight format, the same flags for
/// every command that loads a model and generates (`seam run`, `seam perplexity`).
#[derive(Args)]
pub struct TargetArgs {
    /// Backend to run on (see `seam backends`). Default: iree-cpu, or the reference backend
    /// (with a note) where iree-cpu is unavailable.
    #[arg(long)]
    pub backend: Option<String>,
    /// Device of the backend, by the id `seam backends` lists (`cpu`, `cuda:0`); its first
    /// device when absent.
    #[arg(long)]
    pub device: Option<String>,
    /// A PJRT plugin file to run on (`--backend pjrt`): any plugin, a vendor's hardware included.
    #[arg(long)]
    pub plugin: Option<PathBuf>,
    /// Model directory; the default model (SmolLM2-135M-Instruct) when absent, installed on first use.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Weight format: f16 or int4.
    #[arg(long, default_value = "f16")]
    pub weights: WeightFormat,
}

impl TargetArgs {
    /// The backend named (or the default, falling back where it is unavailable).
    pub fn backend(&self) -> Result<Box<dyn session_api::Backend>, CliError> {
        choose_backend(self.backend.as_deref(), self.plugin.as_deref())
    }

    /// The model directory, the default model installed when none is named.
    pub fn model_dir(&self) -> Result<PathBuf, CliError> {
        resolve_model_dir(self.model.clone())
    }

    /// A load request of `model_dir` in the weight format, on the device, for the caller to
    /// complete.
    pub fn request(&self, model_dir: &Path) -> LoadRequest {
        let mut request = LoadRequest::new(model_dir, self.weights);
        request.device = self.device.clone();
        request
    }

    /// Loads `request` on `backend`; the default backend that turns out unavailable only when
    /// loading (its compiler is installed on first use, which needs the network) falls back.
    pub fn load(
        &self,
        backend: &dyn session_api::Backend,
        request: &LoadRequest,
    ) -> Result<Arc<dyn session_api::Engine>, CliError> {
        match backend.load(request) {
            Err(e) if self.backend.is_none() && e.kind() == session_api::ErrorKind::Unavailable => {
                Ok(fall_back(&e.to_string())?.load(request)?)
            }
            loaded => Ok(loaded?),
        }
    }
}

/// How to load the engine: the flags `seam run` and `seam serve` share beside [`TargetArgs`].
#[derive(Args)]
pub struct LoadArgs {
    /// A backend setting of this load, KEY=VALUE (repeatable; e.g. `layers=unrolled`; see the
    /// backend's documentation).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    settings: Vec<String>,
    /// Cap on the context length.
    #[arg(long)]
    max_context: Option<usize>,
    /// Host threads for the backend (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

impl LoadArgs {
    /// The load request of `target` for `model_dir` with these flags, reporting progress to `bar`.
    pub fn request(&self, target: &TargetArgs, model_dir: &Path, bar: &Arc<StageBar>) -> Result<LoadRequest, CliError> {
        let mut request = target.request(model_dir);
        request.max_context = self.max_context;
        request.threads = self.threads;
        request.settings = parse_settings(&self.settings)?;
        request.progress = Some(bar.callback());
        Ok(request)
    }
}

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    target: TargetArgs,
    #[command(flatten)]
    load: LoadArgs,
    /// The prompt; read from standard input when absent and input is piped.
    #[arg(long)]
    prompt: Option<String>,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// A system message for `--chat`.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// With `--chat`, read special-token spellings in the messages (`<|im_end|>`) as those
    /// tokens, as transformers does. By default they stay text, so a message cannot close its
    /// own turn. (A prompt without `--chat` is the model's raw input: its spellings are always
    /// read as tokens.)
    #[arg(long, requires = "chat")]
    parse_special: bool,
    /// Most tokens to generate (at least 1).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    max_tokens: u32,
    /// Keep generating through end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Stop when this text appears (may be repeated).
    #[arg(long = "stop")]
    stop_strings: Vec<String>,
    /// Sampling temperature; 0 (the default) is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Sample only among the k most likely tokens (0 = all).
    #[arg(long)]
    top_k: Option<usize>,
    /// Sample only within the top-p probability mass.
    #[arg(long)]
    top_p: Option<f32>,
    /// Seed for sampling.
    #[arg(long)]
    seed: Option<u64>,
    /// Divide the positive logits (multiply the negative ones) of tokens already in the prompt
    /// or the output by this; 1 (the default) is off, above 1 discourages repeats.
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Subtract this from the logit of every token generated so far (0 is off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    /// Subtract this from a token's logit once for each time it was generated (0 is off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
    /// Print one JSON object (text, token ids, stats) instead of streaming text.
    #[arg(long)]
    json: bool,
}

/// Resolves `--model`, installing the default model when it is absent.
pub fn resolve_model_dir(model: Option<PathBuf>) -> Result<PathBuf, CliError> {
    match model {
        Some(dir) => Ok(dir),
        None => {
            let dir = llama_model::default_model::default_model_dir();
            if !llama_model::default_model::is_installed(&dir) {
                say!("installing the default model (SmolLM2-135M-Instruct) into {} ...", dir.display());
                let bar = StageBar::new();
                let report = |done, total| bar.count("converting", done, total);
                let installed = llama_model::default_model::ensure_default_model(Some(&report))?;
                bar.finish();
                return Ok(installed);
            }
            Ok(dir)
        }
    }
}

fn read_prompt(args: &RunArgs) -> Result<String, CliError> {
    if let Some(prompt) = &args.prompt {
        return Ok(prompt.clone());
    }
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        return Err(CliError::Usage("no prompt: pass --prompt \"...\" or pipe the prompt on standard input".into()));
    }
    let mut prompt = String::new();
    stdin.lock().read_to_string(&mut prompt)?;
    Ok(prompt)
}

/// The backend named on the command line, or the default one. A named backend that is
/// unavailable is an error; an unavailable default falls back to [`FALLBACK_BACKEND`] with a note,
/// so `seam run` works wherever the reference does.
pub(crate) fn choose_backend(
    named: Option<&str>,
    plugin: Option<&Path>,
) -> Result<Box<dyn session_api::Backend>, CliError> {
    let name = named.unwrap_or(DEFAULT_BACKEND);
    let backend = find_backend_with(name, &backend_settings(plugin))?;
    match backend.availability() {
        Availability::Available { .. } => Ok(backend),
        Availability::Unavailable { reason } if named.is_none() => fall_back(&reason),
        Availability::Unavailable { reason } => {
            Err(SeamError::Unavailable { backend: name.to_string(), reason }.into())
        }
    }
}

pub(crate) fn fall_back(reason: &str) -> Result<Box<dyn session_api::Backend>, CliError> {
    say!("note: the default backend {DEFAULT_BACKEND} is unavailable ({reason}); running on {FALLBACK_BACKEND}");
    Ok(find_backend(FALLBACK_BACKEND)?)
}

/// The backend settings of `--plugin` (the only one the command line names today).
pub fn backend_settings(plugin: Option<&Path>) -> BTreeMap<String, String> {
    plugin.map(|p| ("plugin".to_string(), p.display().to_string())).into_iter().collect()
}

/// `--set KEY=VALUE` arguments as load settings.
pub fn parse_settings(pairs: &[String]) -> Result<BTreeMap<String, String>, CliError> {
    pairs
        .iter()
        .map(|pair| match pair.split_once('=') {
            Some((key, value)) if !key.trim().is_empty() => Ok((key.trim().to_string(), value.trim().to_string())),
            _ => Err(CliError::Usage(format!("--set {pair}: expected KEY=VALUE"))),
        })
        .collect()
}

/// `seam run`: loads the model, generates, prints. On success the process ends here, once the
/// output is flushed ([`crate::end_process_now`]); an error returns to the caller.
pub fn run(args: RunArgs) -> Result<(), CliError> {
    let prompt_text = read_prompt(&args)?;
    if prompt_text.trim().is_empty() {
        return Err(CliError::Seam(SeamError::EmptyInput));
    }
    let sampling = SamplingConfig::from_settings(Some(args.temperature), args.top_k, args.top_p, args.seed)
        .map_err(CliError::Usage)?;
    let penalties = Penalties {
        repetition: args.repeat_penalty,
        presence: args.presence_penalty,
        frequency: args.frequency_penalty,
    };
    penalties.validate().map_err(CliError::Usage)?;
    if let Some(empty) = args.stop_strings.iter().position(String::is_empty) {
        return Err(CliError::Usage(format!("--stop number {} is empty: a stop string needs text", empty + 1)));
    }

    let backend = args.target.backend()?;
    let model_dir = args.target.model_dir()?;
    let model = ModelDir::open(&model_dir)?;
    // The tokenizer (a large one takes a noticeable part of a second to parse) is read and the
    // prompt encoded on a thread of their own while the engine loads.
    let encode = || -> Result<(Tokenizer, Vec<u32>), CliError> {
        let tokenizer = Tokenizer::from_model_dir(&model_dir)?;
        let prompt_ids = if args.chat {
            let template = ChatTemplate::from_model_dir(&model_dir)?;
            let mut messages = Vec::new();
            if let Some(system) = &args.system {
                messages.push(ChatMessage::new("system", system));
            }
            messages.push(ChatMessage::new("user", &prompt_text));
            // The template already spells out BOS and role markers; adding special tokens again
            // would double them (Hugging Face's apply_chat_template encodes the same way).
            if args.parse_special {
                tokenizer.encode(&template.apply(&messages, true)?, false)?
            } else {
                tokenizer.encode_chat(&template.render(&messages, true, &tokenizer.special_tokens())?)?
            }
        } else {
            tokenizer.encode(&prompt_text, true)?
        };
        Ok((tokenizer, prompt_ids))
    };

    let bar = Arc::new(StageBar::new());
    let request = args.load.request(&args.target, &model_dir, &bar)?;
    let (encoded, loaded) = std::thread::scope(|scope| {
        let encoding = scope.spawn(encode);
        let loaded = args.target.load(backend.as_ref(), &request);
        let encoded = encoding.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        (encoded, loaded)
    });
    // A bad tokenizer or prompt is reported before a failed load, as when they came first.
    let (tokenizer, prompt_ids) = encoded?;
    let engine = loaded?;
    bar.finish();
    let info = engine.info();
    // What the tokenizer's parse and the load freed goes back to the system before generating.
    session_api::stats::release_freed_memory();
    let after_load = session_api::stats::ProcessMemory::now();

    let mut session = engine.new_session(SessionOptions { sampling, penalties, ..SessionOptions::default() })?;
    let generation = GenerationRequest {
        max_tokens: args.max_tokens as usize,
        eos_ids: model.eos_token_ids(),
        ignore_eos: args.ignore_eos,
        stop_strings: args.stop_strings.clone(),
    };

    let stdout = std::io::stdout();
    let mut write_error = None;
    let mut on_token = |event: session_api::generate::TokenEvent| {
        if args.json || write_error.is_some() {
            return;
        }
        let mut out = stdout.lock();
        if let Err(e) = out.write_all(event.text.as_bytes()).and_then(|_| out.flush()) {
            write_error = Some(e);
        }
    };
    let mut output =
        generate(session.as_mut(), &prompt_ids, &generation, Some(&tokenizer), &CancelToken::new(), &mut on_token)?;
    if let Some(e) = write_error {
        return Err(e.into());
    }
    output.stats.load_ms = Some(info.load_time.as_secs_f64() * 1000.0);

    if args.json {
        let report = serde_json::json!({
            "backend": info.backend,
            "device": info.device,
            "model": info.model,
            "weights": info.weights,
            "resident_precision": info.resident_precision,
            "prompt_token_ids": prompt_ids,
            "token_ids": output.tokens,
            "text": output.text,
            "finish_reason": output.finish_reason,
            "stats": output.stats,
            "memory": {
                "weight_bytes": info.weight_bytes,
                "rss_after_load_bytes": after_load.map(|m| m.resident_bytes),
                "peak_rss_bytes": session_api::stats::ProcessMemory::now().map(|m| m.peak_bytes),
            },
        });
        writeln!(stdout.lock(), "{}", serde_json::to_string_pretty(&report).expect("the report serializes"))?;
    } else {
        writeln!(stdout.lock())?;
        say!(
            "\n[{} on {} ({}), {} weights resident as {}]",
            info.model,
            info.backend,
            info.device,
            info.weights,
            info.resident_precision
        );
        say!("{}", output.stats.summary());
    }
    // The command ends here, and so does the process: the system reclaims the engine's memory,
    // the tokenizer's tables and the plugins' objects at once, where dropping them would first
    // destroy every buffer, unmap every weight and run the C++ plugins' exit-time destructors.
    std::mem::forget(session);
    std::mem::forget(engine);
    crate::end_process_now()
}
