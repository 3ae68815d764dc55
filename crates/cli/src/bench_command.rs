//! `seam bench`: how fast a backend loads, prefills and decodes a model, measured the same way for
//! every backend and weight format, repeated, with min and median.
//!
//! For each backend and weight format:
//! - load, cold (the backend's compiled-graph cache pointed at an empty folder through
//!   `SEAM_CACHE_DIR`, so whatever a first load compiles is compiled) and warm (the same load
//!   again, now cached); the bytes of the weights the engine holds (`EngineInfo::weight_bytes`)
//!   and the process's resident memory after the warm load (RSS, which also holds whatever earlier
//!   loads of this run left behind: bench one backend and format per run for a clean figure);
//! - prefill throughput at each prompt length (a new session, one `prefill` of the whole prompt;
//!   time to first token is the same call plus creating the session), after one untimed prefill
//!   of the same length: a backend that loads a prefill graph on its first use (pjrt-cpu) pays
//!   that once per process, which the new process below measures, not every call;
//! - decode throughput over `--decode-tokens` greedy steps after a prompt of `--decode-depth`
//!   tokens (16 by default), with per-step p50 / p90;
//! - a new process: `seam run --max-tokens 1` on the same backend, format and model, with every
//!   cache warm, timed from spawn to exit, with the load, time to first token and resident
//!   memory (after the load, and its peak) it reports: what a user waits for and pays on every
//!   start (`--no-process` skips it).
//!
//! Prompts are deterministic token ids spread over the vocabulary, so every backend sees the same
//! work; greedy decoding then follows the model. Results print as a table and, with `--json`, as
//! one object with the machine, versions and settings.

use crate::cli_error::CliError;
use crate::run_command::resolve_model_dir;
use clap::Args;
use serde::Serialize;
use session_api::stats::StepTimeSummary;
use session_api::{find_backend, Availability, BatchEntry, Engine, LoadRequest, Session, SessionOptions, WeightFormat};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// The largest `--batches` size.
const MAX_BENCH_BATCH: usize = 64;

#[derive(Args)]
pub struct BenchArgs {
    /// Backend to measure (repeatable); every available backend when absent.
    #[arg(long = "backend")]
    backends: Vec<String>,
    /// Weight format (repeatable); f16 and int4 when absent.
    #[arg(long = "weights")]
    formats: Vec<WeightFormat>,
    /// Model directory; the default model when absent.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt lengths for prefill throughput, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "16,128,512")]
    prompt_lengths: Vec<usize>,
    /// Greedy decode steps to time (after a prompt of `--decode-depth` tokens).
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
    /// Tokens of context before the timed decode: the prompt prefilled first. A step attends
    /// over every earlier position, so a deep context is what a long conversation's decode costs
    /// (llama-bench's `-d`).
    #[arg(long, default_value_t = 16)]
    decode_depth: usize,
    /// Repetitions of each measurement (min and median are reported).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Context to load with (must hold the longest prompt, and the decode depth plus the decode
    /// tokens).
    #[arg(long)]
    max_context: Option<usize>,
    /// Skip the cold load (which compiles every graph again).
    #[arg(long)]
    no_cold: bool,
    /// Skip the new-process runs (`seam run --max-tokens 1`, timed end to end).
    #[arg(long)]
    no_process: bool,
    /// Also time batched decode at these batch sizes (comma-separated, e.g. 4,8,16): that many
    /// sequences decoding together, one batched call per step as `seam serve` makes it, each
    /// after its own prompt of `--decode-depth` tokens; aggregate tokens/s per size.
    #[arg(long, value_delimiter = ',')]
    batches: Vec<usize>,
    /// A backend setting of every load, KEY=VALUE (repeatable; e.g. `activations=int8`; see the
    /// backend's documentation), the new-process runs included.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    settings: Vec<String>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Min and median of repeated measurements.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Spread {
    pub min: f64,
    pub median: f64,
}

impl Spread {
    fn of(values: &[f64]) -> Spread {
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = if n % 2 == 1 { sorted[n / 2] } else { (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0 };
        Spread { min: sorted[0], median }
    }
}

#[derive(Debug, Serialize)]
struct PrefillResult {
    prompt_tokens: usize,
    tokens_per_s: Spread,
    time_to_first_token_ms: Spread,
}

#[derive(Debug, Serialize)]
struct DecodeResult {
    steps: usize,
    tokens_per_s: Spread,
    /// Per-step times of the run with the median throughput.
    step_ms: StepTimeSummary,
    /// The memory traffic of decode, where the engine says how many bytes a step reads.
    memory: Option<DecodeMemory>,
}

/// How close decode comes to the device's memory bandwidth.
#[derive(Debug, Serialize)]
struct DecodeMemory {
    /// Bytes a decode step reads (`EngineInfo::decode_bytes_per_token`).
    bytes_per_token: u64,
    /// `bytes_per_token` times the median decode rate.
    achieved_bytes_per_s: f64,
    /// The device's bandwidth from a probe on it (`Engine::measure_memory_bandwidth`).
    device_bytes_per_s: Option<f64>,
    /// The backend whose engine ran the probe (another backend's, on the same device id in this
    /// run, where this one has no probe).
    probe_by: Option<String>,
    /// `achieved_bytes_per_s / device_bytes_per_s`.
    fraction: Option<f64>,
}

/// `seam run --max-tokens 1` in a new process, every cache warm.
#[derive(Debug, Serialize)]
struct ProcessResult {
    /// The command line after the program name.
    args: Vec<String>,
    /// Spawn to exit.
    wall_ms: Spread,
    /// The load as the process reports it.
    load_ms: Spread,
    /// Session, prompt and first token, as the process reports it.
    time_to_first_token_ms: Spread,
    /// Resident memory right after the load, as the process reports it (median).
    rss_after_load_bytes: Option<Spread>,
    /// The largest peak resident memory of the runs, as each reports it.
    peak_rss_bytes: Option<u64>,
}

#[derive(Debug, Serialize)]
struct BenchResult {
    backend: String,
    weights: WeightFormat,
    resident_precision: String,
    weight_bytes: u64,
    load_cold_ms: Option<f64>,
    load_warm_ms: f64,
    rss_after_load_bytes: Option<u64>,
    prefill: Vec<PrefillResult>,
    decode: DecodeResult,
    /// Batched decode, one entry per `--batches` size.
    batched: Vec<BatchedResult>,
    process: Option<ProcessResult>,
}

/// `sequences` sequences decoding together, one batched call per step.
#[derive(Debug, Serialize)]
struct BatchedResult {
    sequences: usize,
    /// Tokens of all sequences per second.
    tokens_per_s: Spread,
    /// Per-step times (every sequence's token) of the run with the median throughput.
    step_ms: StepTimeSummary,
}

#[derive(Debug, Serialize)]
struct Machine {
    cpu: String,
    cores: usize,
    os: String,
}

#[derive(Debug, Serialize)]
struct BenchReport {
    seam_version: &'static str,
    machine: Machine,
    model: String,
    settings: serde_json::Value,
    results: Vec<BenchResult>,
}

/// Resident set size of this process.
fn rss_bytes() -> Option<u64> {
    session_api::stats::ProcessMemory::now().map(|m| m.resident_bytes)
}

fn prompt_ids(n: usize, vocab: usize) -> Vec<u32> {
    let span = vocab.saturating_sub(100).max(1) as u64;
    (0..n as u64).map(|i| (100 + (i * 7919 + 13) % span) as u32).collect()
}

fn ms_since(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1000.0
}

fn measure_prefill(engine: &Arc<dyn Engine>, tokens: &[u32], repeats: usize) -> Result<PrefillResult, CliError> {
    // Untimed, as llama-bench's warm-up run: the graphs this length needs are loaded now.
    engine.new_session(SessionOptions::default())?.prefill(tokens)?;
    let (mut rates, mut ttft) = (Vec::new(), Vec::new());
    for _ in 0..repeats {
        let started = Instant::now();
        let mut session = engine.new_session(SessionOptions::default())?;
        let prefill_started = Instant::now();
        session.prefill(tokens)?;
        let prefill_ms = ms_since(prefill_started);
        ttft.push(ms_since(started));
        rates.push(tokens.len() as f64 / (prefill_ms / 1000.0));
    }
    Ok(PrefillResult {
        prompt_tokens: tokens.len(),
        tokens_per_s: Spread::of(&rates),
        time_to_first_token_ms: Spread::of(&ttft),
    })
}

fn measure_decode(
    engine: &Arc<dyn Engine>,
    prompt: &[u32],
    steps: usize,
    repeats: usize,
) -> Result<DecodeResult, CliError> {
    let mut runs: Vec<(f64, Vec<f64>)> = Vec::new();
    for _ in 0..repeats {
        let mut session = engine.new_session(SessionOptions::default())?;
        let mut next = session.prefill(prompt)?.token;
        let mut step_ms = Vec::with_capacity(steps);
        for _ in 0..steps {
            let started = Instant::now();
            next = session.decode(next)?.token;
            step_ms.push(ms_since(started));
        }
        let total: f64 = step_ms.iter().sum();
        runs.push((steps as f64 / (total / 1000.0), step_ms));
    }
    let rates: Vec<f64> = runs.iter().map(|r| r.0).collect();
    let spread = Spread::of(&rates);
    runs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let median_run = &runs[runs.len() / 2].1;
    Ok(DecodeResult { steps, tokens_per_s: spread, step_ms: StepTimeSummary::from_steps(median_run), memory: None })
}

/// `sequences` sessions, each prefilled with its own prompt of `prompt_len` tokens, then `steps`
/// batched decode calls over all of them (`decode_batch` on `dyn Engine`, the call `seam serve`
/// makes), `repeats` times.
fn measure_batched(
    engine: &Arc<dyn Engine>,
    vocab: usize,
    prompt_len: usize,
    sequences: usize,
    steps: usize,
    repeats: usize,
) -> Result<BatchedResult, CliError> {
    let mut runs: Vec<(f64, Vec<f64>)> = Vec::new();
    for _ in 0..repeats {
        let mut sessions = Vec::with_capacity(sequences);
        let mut next = Vec::with_capacity(sequences);
        for s in 0..sequences {
            let mut session = engine.new_checked_session(SessionOptions::default())?;
            // Each sequence its own prompt, so no two run the same rows.
            let prompt: Vec<u32> = prompt_ids(prompt_len + s, vocab)[s..].to_vec();
            next.push(session.prefill(&prompt)?.token);
            sessions.push(session);
        }
        let mut step_ms = Vec::with_capacity(steps);
        for _ in 0..steps {
            let mut entries: Vec<BatchEntry<'_>> =
                sessions.iter_mut().zip(&next).map(|(session, &token)| BatchEntry { session, token }).collect();
            let started = Instant::now();
            let outputs = engine.decode_batch(&mut entries);
            step_ms.push(ms_since(started));
            for (token, output) in next.iter_mut().zip(outputs) {
                *token = output?.token;
            }
        }
        let total: f64 = step_ms.iter().sum();
        runs.push(((steps * sequences) as f64 / (total / 1000.0), step_ms));
    }
    let rates: Vec<f64> = runs.iter().map(|r| r.0).collect();
    let tokens_per_s = Spread::of(&rates);
    runs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let step_ms = StepTimeSummary::from_steps(&runs[runs.len() / 2].1);
    Ok(BatchedResult { sequences, tokens_per_s, step_ms })
}

/// The warm engine of [`load_cold_and_warm`] and what its loads measured.
struct Loaded {
    engine: Arc<dyn Engine>,
    cold_ms: Option<f64>,
    warm_ms: f64,
    /// The process RSS after the warm load.
    rss: Option<u64>,
}

/// Loads with the compiled-graph cache in an empty folder (so the load compiles), then with the
/// project's cache twice (the first fills it if needed, the second is the warm load).
fn load_cold_and_warm(
    backend: &dyn session_api::Backend,
    request: &LoadRequest,
    cold: bool,
) -> Result<Loaded, CliError> {
    let cold_ms = if cold {
        let cache = tempfile::tempdir().map_err(CliError::Output)?;
        // Every backend caches below `llama_model::home::cache_dir()`, which this variable moves.
        let cache_env = llama_model::home::CACHE_ENV;
        let previous = std::env::var_os(cache_env);
        // Single-threaded here (no engine exists yet), so changing the environment is safe.
        std::env::set_var(cache_env, cache.path());
        let started = Instant::now();
        let loaded = backend.load(request);
        let cold_ms = ms_since(started);
        match previous {
            Some(value) => std::env::set_var(cache_env, value),
            None => std::env::remove_var(cache_env),
        }
        drop(loaded?);
        Some(cold_ms)
    } else {
        None
    };
    // Warm: the project's cache, filled now if it was empty, then timed on a second load.
    drop(backend.load(request)?);
    let started = Instant::now();
    let engine = backend.load(request)?;
    let warm_ms = ms_since(started);
    Ok(Loaded { engine, cold_ms, warm_ms, rss: rss_bytes() })
}

/// Runs `seam run` in new processes, `repeats` times, and reads what each reports.
fn measure_process(
    backend: &str,
    format: WeightFormat,
    model_dir: &std::path::Path,
    settings: &[String],
    repeats: usize,
) -> Result<ProcessResult, CliError> {
    let program = std::env::current_exe().map_err(CliError::Output)?;
    let mut args: Vec<String> = [
        "run",
        "--backend",
        backend,
        "--model",
        &model_dir.to_string_lossy(),
        "--weights",
        format.as_str(),
        "--prompt",
        "Hello",
        "--max-tokens",
        "1",
        "--json",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    for setting in settings {
        args.extend(["--set".to_string(), setting.clone()]);
    }
    let (mut wall, mut load, mut first, mut after_load) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut peak_rss = None;
    for _ in 0..repeats {
        let started = Instant::now();
        let output = std::process::Command::new(&program)
            .args(&args)
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(CliError::Output)?;
        wall.push(ms_since(started));
        if !output.status.success() {
            return Err(CliError::Usage(format!(
                "seam {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&output.stderr).trim()
            )));
        }
        let report: serde_json::Value = serde_json::from_slice(&output.stdout)
            .map_err(|e| CliError::Usage(format!("seam run --json printed no report: {e}")))?;
        let stat = |name: &str| report["stats"][name].as_f64();
        load.push(stat("load_ms").unwrap_or(f64::NAN));
        first.push(stat("time_to_first_token_ms").unwrap_or(f64::NAN));
        let memory = &report["memory"];
        if let Some(rss) = memory["rss_after_load_bytes"].as_f64() {
            after_load.push(rss);
        }
        peak_rss = peak_rss.max(memory["peak_rss_bytes"].as_u64());
    }
    Ok(ProcessResult {
        args,
        wall_ms: Spread::of(&wall),
        load_ms: Spread::of(&load),
        time_to_first_token_ms: Spread::of(&first),
        rss_after_load_bytes: (!after_load.is_empty()).then(|| Spread::of(&after_load)),
        peak_rss_bytes: peak_rss,
    })
}

pub fn run(args: BenchArgs) -> Result<(), CliError> {
    if args.repeats == 0
        || args.decode_tokens == 0
        || args.decode_depth == 0
        || args.prompt_lengths.contains(&0)
        || args.batches.contains(&0)
    {
        return Err(CliError::Usage(
            "--repeats, --decode-tokens, --decode-depth, every prompt length and every batch size must be at least 1"
                .into(),
        ));
    }
    if let Some(&largest) = args.batches.iter().max() {
        // Each sequence holds a cache of the whole context: far more than a machine's memory
        // holds is refused before anything is allocated.
        if largest > MAX_BENCH_BATCH {
            return Err(CliError::Usage(format!("--batches {largest}: at most {MAX_BENCH_BATCH} sequences")));
        }
    }
    let longest = args
        .prompt_lengths
        .iter()
        .copied()
        .max()
        .unwrap_or(16)
        .max(args.decode_depth.saturating_add(args.decode_tokens));
    if let Some(max) = args.max_context {
        if max < longest {
            return Err(CliError::Usage(format!("--max-context {max} cannot hold {longest} tokens")));
        }
    }
    let model_dir = resolve_model_dir(args.model.clone())?;
    let model = llama_model::model_dir::ModelDir::open(&model_dir)?;
    let vocab = model.config().vocab_size;
    // Before anything is sized from the arguments: a prompt or a decode run longer than the
    // model's context cannot run, and would only allocate in proportion to the number given.
    let model_context = model.config().max_position_embeddings;
    if longest > model_context {
        return Err(CliError::Usage(format!(
            "a prompt length or --decode-depth + --decode-tokens of {longest} is beyond the model's context of {model_context}"
        )));
    }
    let has_tokenizer = model.tokenizer_path().is_file();
    if !has_tokenizer && !args.no_process {
        say!("note: {} has no tokenizer.json: no new-process runs (seam run needs it)", model_dir.display());
    }
    let backends: Vec<String> = if args.backends.is_empty() {
        session_api::registered_backends()
            .into_iter()
            .filter(|b| b.is_compatible() && b.alias_of().is_none())
            .map(|b| b.name.to_string())
            .filter(|name| find_backend(name).is_ok_and(|b| matches!(b.availability(), Availability::Available { .. })))
            .collect()
    } else {
        args.backends.clone()
    };
    let formats = if args.formats.is_empty() { WeightFormat::ALL.to_vec() } else { args.formats.clone() };

    let mut results = Vec::new();
    // Device id -> (bandwidth from a probe on the device, the backend that measured it).
    let mut probes: std::collections::HashMap<String, (f64, String)> = Default::default();
    // Checked before any backend loads: a malformed setting fails at once.
    let settings = crate::run_command::parse_settings(&args.settings)?;
    for name in &backends {
        let backend = find_backend(name)?;
        if let Availability::Unavailable { reason } = backend.availability() {
            return Err(session_api::SeamError::Unavailable { backend: name.clone(), reason }.into());
        }
        for &format in &formats {
            say!("bench: {name} {format} ...");
            let mut request = LoadRequest::new(&model_dir, format);
            request.max_context = Some(args.max_context.unwrap_or(longest.max(2048)));
            request.settings = settings.clone();
            let Loaded { engine, cold_ms: load_cold_ms, warm_ms: load_warm_ms, rss: resident } =
                load_cold_and_warm(backend.as_ref(), &request, !args.no_cold)?;
            let info = engine.info();
            let mut prefill = Vec::new();
            for &n in &args.prompt_lengths {
                prefill.push(measure_prefill(&engine, &prompt_ids(n, vocab), args.repeats)?);
            }
            let mut decode =
                measure_decode(&engine, &prompt_ids(args.decode_depth, vocab), args.decode_tokens, args.repeats)?;
            if let Some(bytes_per_token) = info.decode_bytes_per_token {
                if !probes.contains_key(&info.device) {
                    // The probe only adds a figure: its failure must not lose the measurements.
                    match engine.measure_memory_bandwidth() {
                        Ok(Some(bandwidth)) => {
                            probes.insert(info.device.clone(), (bandwidth, name.clone()));
                        }
                        Ok(None) => {}
                        Err(e) => say!("warning: {name}'s memory bandwidth probe failed: {e}"),
                    }
                }
                let achieved = bytes_per_token as f64 * decode.tokens_per_s.median;
                let probe = probes.get(&info.device);
                decode.memory = Some(DecodeMemory {
                    bytes_per_token,
                    achieved_bytes_per_s: achieved,
                    device_bytes_per_s: probe.map(|p| p.0),
                    probe_by: probe.map(|p| p.1.clone()),
                    fraction: probe.map(|p| achieved / p.0),
                });
            }
            let mut batched = Vec::new();
            if let Some(&largest) = args.batches.iter().max() {
                // What serving would compile on first use is ready before anything is timed.
                engine.prepare_for_serving(largest)?;
                for &sequences in &args.batches {
                    batched.push(measure_batched(
                        &engine,
                        vocab,
                        args.decode_depth,
                        sequences,
                        args.decode_tokens,
                        args.repeats,
                    )?);
                }
            }
            // The engine goes first: the new processes should not share the machine with it.
            drop(engine);
            // `seam run` needs the model's tokenizer, which benchmarks of token ids do not.
            let process = if args.no_process || !has_tokenizer {
                None
            } else {
                Some(measure_process(name, format, &model_dir, &args.settings, args.repeats)?)
            };
            results.push(BenchResult {
                backend: name.clone(),
                weights: format,
                resident_precision: info.resident_precision,
                weight_bytes: info.weight_bytes,
                load_cold_ms,
                load_warm_ms,
                rss_after_load_bytes: resident,
                prefill,
                decode,
                batched,
                process,
            });
        }
    }

    print_table(&results, args.decode_depth);
    print_batched(&results);
    let mut probed: Vec<_> = probes.iter().collect();
    probed.sort_by_key(|(device, _)| device.as_str());
    for (device, (bandwidth, by)) in probed {
        println!("device {device}: memory bandwidth {:.0} GB/s (probe run by {by})", bandwidth / 1e9);
    }
    if let Some(path) = &args.json {
        let cpu = backend_reference::cpu_device();
        let report = BenchReport {
            seam_version: env!("CARGO_PKG_VERSION"),
            machine: Machine {
                cpu: cpu.name,
                cores: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
                os: std::env::consts::OS.to_string(),
            },
            model: model.name(),
            settings: serde_json::json!({
                "prompt_lengths": args.prompt_lengths,
                "decode_tokens": args.decode_tokens,
                "decode_prompt_tokens": args.decode_depth,
                "batches": args.batches,
                "repeats": args.repeats,
                "backend_settings": args.settings,
                "max_context": request_context(&args, longest),
                "profile": if cfg!(debug_assertions) { "debug (dependencies at opt-level 3)" } else { "release" },
            }),
            results,
        };
        let text = serde_json::to_string_pretty(&report).expect("the report serializes");
        std::fs::write(path, text).map_err(CliError::Output)?;
    }
    Ok(())
}

/// The batched decode rows, each against the same backend's one-sequence decode.
fn print_batched(results: &[BenchResult]) {
    if results.iter().all(|r| r.batched.is_empty()) {
        return;
    }
    println!(
        "{:<12} {:<5} {:>9} {:>12} {:>10} {:>10} {:>12}",
        "backend", "wts", "sequences", "tokens/s", "step p50", "step p90", "x 1 sequence"
    );
    for r in results {
        for b in &r.batched {
            println!(
                "{:<12} {:<5} {:>9} {:>12.1} {:>7.1} ms {:>7.1} ms {:>11.2}x",
                r.backend,
                r.weights.to_string(),
                b.sequences,
                b.tokens_per_s.median,
                b.step_ms.p50_ms,
                b.step_ms.p90_ms,
                b.tokens_per_s.median / r.decode.tokens_per_s.median
            );
        }
    }
    println!("(batched decode: aggregate tokens/s of all sequences, one batched call per step as seam serve makes it)");
}

fn request_context(args: &BenchArgs, longest: usize) -> usize {
    args.max_context.unwrap_or(longest.max(2048))
}

fn print_table(results: &[BenchResult], decode_depth: usize) {
    let lengths: Vec<usize> =
        results.first().map(|r| r.prefill.iter().map(|p| p.prompt_tokens).collect()).unwrap_or_default();
    let mut header = format!(
        "{:<12} {:<5} {:>10} {:>9} {:>10} {:>8}",
        "backend", "wts", "load cold", "warm", "weights MB", "rss MB"
    );
    for n in &lengths {
        header.push_str(&format!(" {:>12}", format!("prefill@{n}")));
    }
    header.push_str(&format!(" {:>10} {:>9} {:>9} {:>9} {:>6}", "decode t/s", "p50 ms", "p90 ms", "MB/token", "%bw"));
    header.push_str(&format!(" {:>8} {:>8} {:>8}", "rss/wts", "run s", "run rss"));
    println!("{header}");
    println!("{}", "-".repeat(header.len()));
    for r in results {
        let cold = r.load_cold_ms.map(|ms| format!("{:.2} s", ms / 1000.0)).unwrap_or_else(|| "-".into());
        let rss = r.rss_after_load_bytes.map(|b| format!("{:.0}", b as f64 / 1e6)).unwrap_or_else(|| "-".into());
        let warm = format!("{:.2} s", r.load_warm_ms / 1000.0);
        let weights = format!("{:.0}", r.weight_bytes as f64 / 1e6);
        let mut line =
            format!("{:<12} {:<5} {:>10} {:>9} {:>10} {:>8}", r.backend, r.weights.as_str(), cold, warm, weights, rss);
        for p in &r.prefill {
            line.push_str(&format!(" {:>12}", format!("{:.1}", p.tokens_per_s.median)));
        }
        line.push_str(&format!(
            " {:>10.1} {:>9.1} {:>9.1}",
            r.decode.tokens_per_s.median, r.decode.step_ms.p50_ms, r.decode.step_ms.p90_ms
        ));
        let memory = r.decode.memory.as_ref();
        let per_token = memory.map(|m| format!("{:.0}", m.bytes_per_token as f64 / 1e6)).unwrap_or_else(|| "-".into());
        let fraction =
            memory.and_then(|m| m.fraction).map(|f| format!("{:.0}%", f * 100.0)).unwrap_or_else(|| "-".into());
        line.push_str(&format!(" {per_token:>9} {fraction:>6}"));
        let ratio = r
            .rss_after_load_bytes
            .filter(|_| r.weight_bytes > 0)
            .map(|b| format!("{:.2}", b as f64 / r.weight_bytes as f64))
            .unwrap_or_else(|| "-".into());
        let run = r.process.as_ref().map(|p| format!("{:.2}", p.wall_ms.median / 1000.0)).unwrap_or_else(|| "-".into());
        // The new process's RSS after its load over the weights: nothing of earlier loads in it.
        let run_rss = r
            .process
            .as_ref()
            .and_then(|p| p.rss_after_load_bytes)
            .filter(|_| r.weight_bytes > 0)
            .map(|b| format!("{:.2}", b.median / r.weight_bytes as f64))
            .unwrap_or_else(|| "-".into());
        line.push_str(&format!(" {ratio:>8} {run:>8} {run_rss:>8}"));
        println!("{line}");
    }
    println!(
        "(medians of the repeats; prefill in tokens/s; decode after {decode_depth} tokens of context; MB/token: bytes a"
    );
    println!(" decode step reads; %bw: MB/token x decode t/s");
    println!(" over the device's bandwidth from a probe on it; rss/wts: RSS after the warm load over weights MB;");
    println!(" run s: a new `seam run --max-tokens 1` process, spawn to exit; run rss: its RSS after its load over");
    println!(" weights MB; min, peak RSS and every figure in --json)");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_and_prompts() {
        let s = Spread::of(&[3.0, 1.0, 2.0]);
        assert_eq!((s.min, s.median), (1.0, 2.0));
        assert_eq!(Spread::of(&[4.0, 1.0]).median, 2.5);
        let ids = prompt_ids(512, 256);
        assert_eq!(ids.len(), 512);
        assert!(ids.iter().all(|&t| (100..256).contains(&t)));
        assert_eq!(ids, prompt_ids(512, 256), "deterministic");
    }
}
