//! `seam`: run a model on a backend, list backends, convert GGUF files.

/// `eprintln!` that cannot panic: with a closed or full stderr the message is lost and the exit
/// status still tells (`eprintln!` panics there, after the work is done).
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod backends_command;
mod bench_command;
mod cli_error;
mod compile_command;
mod conformance_command;
mod convert_command;
mod export_gguf_command;
mod linked_backends;
mod perplexity_command;
mod progress;
mod run_command;
mod synth_model_command;

use clap::{Parser, Subcommand};
use cli_error::CliError;
use std::process::ExitCode;

/// seam runs Llama-family models on many kinds of hardware through one session contract.
#[derive(Parser)]
#[command(name = "seam", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt on a backend.
    Run(run_command::RunArgs),
    /// List the registered backends: available or why not, devices, capabilities.
    Backends(backends_command::BackendsArgs),
    /// Run the conformance suite against registered backends and print the matrix.
    Conformance(conformance_command::ConformanceArgs),
    /// Measure load, prefill and decode speed of backends (min / median over repeats).
    Bench(bench_command::BenchArgs),
    /// Measure a model's perplexity on a text (as llama-perplexity), or its KL divergence from a saved run.
    Perplexity(perplexity_command::PerplexityArgs),
    /// Compile a model's graphs into the on-disk cache ahead of time (for a machine that cannot compile).
    Compile(compile_command::CompileArgs),
    /// Import a GGUF Llama file into a seam model directory (fp16 and int4 weights, tokenizer).
    Convert(convert_command::ConvertArgs),
    /// Write a model directory with deterministic random weights in a known shape (benchmarks).
    SynthModel(synth_model_command::SynthModelArgs),
    /// Write a seam model directory as a llama.cpp GGUF (F16, or Q4_1 holding seam's int4 weights).
    ExportGguf(export_gguf_command::ExportGgufArgs),
}

fn main() -> ExitCode {
    linked_backends::link_all();
    let cli = Cli::parse();
    let result: Result<(), CliError> = match cli.command {
        Command::Run(args) => run_command::run(args),
        Command::Backends(args) => backends_command::run(args),
        Command::Convert(args) => convert_command::run(args),
        Command::Compile(args) => compile_command::run(args),
        Command::Conformance(args) => conformance_command::run(args),
        Command::Bench(args) => bench_command::run(args),
        Command::Perplexity(args) => perplexity_command::run(args),
        Command::SynthModel(args) => synth_model_command::run(args),
        Command::ExportGguf(args) => export_gguf_command::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            say!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
