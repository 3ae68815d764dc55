//! `seam export-gguf`: a seam model directory as a llama.cpp GGUF (F16 or Q4_1), so that
//! llama.cpp can be benchmarked on the weights seam runs (scripts/compare-llama-cpp.sh). The
//! export itself is `llama_model::export`; this is its command line.

use crate::cli_error::CliError;
use clap::{Args, ValueEnum};
use llama_model::export::{export_gguf, ExportError, GgufMatrixType, TokenizerSource};
use session_api::SeamError;
use std::path::PathBuf;

/// The matrix type written.
#[derive(Clone, Copy, ValueEnum)]
enum TypeArg {
    /// The model's f16 weights, unchanged.
    F16,
    /// The model's seam int4 weights as Q4_1 blocks (the same values).
    #[value(name = "q4_1")]
    Q4_1,
}

#[derive(Args)]
pub struct ExportGgufArgs {
    /// The seam model directory (default: the default model, once `seam convert --default-model`
    /// has installed it).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Matrix type: f16 (the model's f16 weights) or q4_1 (seam's int4 weights of the model,
    /// carried exactly). Norms are F32 in both.
    #[arg(long = "type", value_enum)]
    ty: TypeArg,
    /// The GGUF file to write (through a temporary file renamed into place).
    #[arg(long)]
    out: PathBuf,
    /// Copy the tokenizer metadata (`tokenizer.*`) from this GGUF, e.g. the one the model was
    /// converted from; otherwise it is built from the model's tokenizer.json.
    #[arg(long, value_name = "GGUF")]
    tokenizer_from: Option<PathBuf>,
    /// llama.cpp's pre-tokenizer name (`tokenizer.ggml.pre`), when it cannot be told from
    /// tokenizer.json (detected: llama-bpe for Llama 3, smollm for SmolLM, gpt2).
    #[arg(long, conflicts_with = "tokenizer_from")]
    tokenizer_pre: Option<String>,
}

pub fn run(args: ExportGgufArgs) -> Result<(), CliError> {
    let model = match args.model {
        Some(dir) => dir,
        None => {
            let dir = llama_model::default_model::default_model_dir();
            if !llama_model::default_model::is_installed(&dir) {
                return Err(CliError::Usage(format!(
                    "the default model is not installed in {} (run `seam convert --default-model`, or give --model)",
                    dir.display()
                )));
            }
            dir
        }
    };
    let ty = match args.ty {
        TypeArg::F16 => GgufMatrixType::F16,
        TypeArg::Q4_1 => GgufMatrixType::Q4_1,
    };
    let tokenizer = match args.tokenizer_from {
        Some(gguf) => TokenizerSource::Gguf(gguf),
        None => TokenizerSource::ModelDir { pre: args.tokenizer_pre },
    };
    let started = std::time::Instant::now();
    let report = export_gguf(&model, &args.out, ty, &tokenizer).map_err(|e| match e {
        ExportError::Model(e) => CliError::from(e),
        other => CliError::Seam(SeamError::InvalidInput(other.to_string())),
    })?;
    say!(
        "wrote {} ({} tensors, {} matrices as {}, tokenizer pre '{}', {:.1} MB) in {:.1} s",
        args.out.display(),
        report.tensors,
        report.matrices,
        ty.name(),
        report.tokenizer_pre,
        report.bytes as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );
    if !report.dropped_tokens.is_empty() {
        say!(
            "note: left out {} added token(s) of tokenizer.json whose ids have no embedding row: {}",
            report.dropped_tokens.len(),
            report.dropped_tokens.join(" ")
        );
    }
    println!("{}", args.out.display());
    Ok(())
}
