//! The `seam` command line as a library, so that a binary with more backends linked in is a few
//! lines: link the backends, then call [`main`]. seam's own `seam` binary is exactly that
//! (`src/bin/seam.rs`); a vendor's looks the same with its backend crate's `link()` added:
//!
//! ```no_run
//! fn main() -> std::process::ExitCode {
//!     // my_backend::link();             // the vendor's backend crate, registered through inventory
//!     seam_cli::link_builtin_backends(); // reference, plus iree and pjrt with their features
//!     seam_cli::main()
//! }
//! ```
//!
//! Every subcommand (run, backends, conformance, bench, perplexity, ...) then sees every linked
//! backend: backends are found through `session_api`'s registry, never named here, except that
//! `seam compile` needs the iree backend (feature `iree`) and `seam bench` uses the reference
//! backend's CPU device for its bandwidth probe.
//!
//! Features `iree` and `pjrt` (both default) link those backends; a vendor binary that needs
//! neither turns default features off and builds without IREE's runtime or the PJRT binding.

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
mod install_command;
mod linked_backends;
pub use linked_backends::link_builtin_backends;
mod perplexity_command;
mod progress;
mod run_command;
mod serve_command;
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
    /// Serve the model over an OpenAI-compatible HTTP API, batching concurrent requests.
    Serve(serve_command::ServeArgs),
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
    /// Install ahead of time what a backend installs on its first load (the CUDA PJRT plugin).
    Install(install_command::InstallArgs),
    /// Import a GGUF Llama file into a seam model directory (fp16 and int4 weights, tokenizer).
    Convert(convert_command::ConvertArgs),
    /// Write a model directory with deterministic random weights in a known shape (benchmarks).
    SynthModel(synth_model_command::SynthModelArgs),
    /// Write a seam model directory as a llama.cpp GGUF (F16, or Q4_1 holding seam's int4 weights).
    ExportGguf(export_gguf_command::ExportGgufArgs),
}

/// Ends the process with success at once, its output flushed: no destructor runs, neither Rust's
/// nor the `atexit` handlers and static destructors of the C++ runtimes a backend loaded. For a
/// command whose work is done and whose files are written and closed (`seam run`), so that the
/// exit does not wait for memory the system frees anyway.
pub(crate) fn end_process_now() -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    #[cfg(unix)]
    {
        extern "C" {
            // POSIX, <unistd.h>: ends the process without `atexit` handlers or stdio flushing.
            fn _exit(status: std::ffi::c_int) -> !;
        }
        // SAFETY: `_exit` takes no pointers; Rust's buffered output was flushed above, and
        // nothing the process wrote is left in a user-space buffer.
        unsafe { _exit(0) }
    }
    #[cfg(not(unix))]
    std::process::exit(0)
}

/// Parses the process's arguments and runs the subcommand on the backends linked into the binary
/// (call [`link_builtin_backends`] and each other backend crate's `link()` first). Errors are
/// printed as one `error: ...` line on stderr and give [`ExitCode::FAILURE`].
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let result: Result<(), CliError> = match cli.command {
        Command::Run(args) => run_command::run(args),
        Command::Serve(args) => serve_command::run(args),
        Command::Backends(args) => backends_command::run(args),
        Command::Convert(args) => convert_command::run(args),
        Command::Compile(args) => compile_command::run(args),
        Command::Install(args) => install_command::run(args),
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
