//! `seam synth-model`: a model directory with deterministic random weights in a known shape, for
//! benchmarks at sizes whose real weights cannot be downloaded here (Llama-3.2-1B).

use crate::cli_error::CliError;
use clap::Args;
use llama_model::random::{llama32_1b_config, tiny_config, write_random_checkpoint};
use std::path::PathBuf;

/// Tokenizer files copied by `--tokenizer-from` (tokenizer.json is required).
const TOKENIZER_FILES: [(&str, bool); 2] = [("tokenizer.json", true), ("tokenizer_config.json", false)];

#[derive(Args)]
pub struct SynthModelArgs {
    /// The shape: `llama-3.2-1b` (16 layers, hidden 2048, 32 heads, 8 KV heads, head dim 64, FFN
    /// 8192, vocab 128256, tied embeddings, Llama 3 rope) or `tiny` (a few-KiB test model).
    #[arg(long, default_value = "llama-3.2-1b")]
    shape: String,
    /// Seed of the weights: the same seed writes the same bytes.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output directory (created).
    #[arg(long)]
    out: PathBuf,
    /// A directory whose `tokenizer.json` (and `tokenizer_config.json`, if present) to copy in, so
    /// that `seam run` and `seam bench` can use the model (its vocabulary must match the shape's).
    #[arg(long)]
    tokenizer_from: Option<PathBuf>,
}

pub fn run(args: SynthModelArgs) -> Result<(), CliError> {
    let config = match args.shape.as_str() {
        "llama-3.2-1b" => llama32_1b_config(),
        "tiny" => tiny_config(),
        other => return Err(CliError::Usage(format!("unknown shape '{other}' (known: llama-3.2-1b, tiny)"))),
    };
    let started = std::time::Instant::now();
    write_random_checkpoint(&args.out, &config, args.seed)?;
    if let Some(from) = &args.tokenizer_from {
        for (name, required) in TOKENIZER_FILES {
            let source = from.join(name);
            if !source.is_file() {
                if required {
                    return Err(CliError::Usage(format!("--tokenizer-from {}: no {name} there", from.display())));
                }
                continue;
            }
            std::fs::copy(&source, args.out.join(name))
                .map_err(|e| CliError::Seam(llama_model::ModelError::io(&source, e).into()))?;
        }
    }
    let params: usize =
        llama_model::weights::expected_tensors(&config).iter().map(|t| t.shape.iter().product::<usize>()).sum();
    say!(
        "wrote {} ({} shape, seed {}, {:.2} B parameters in f16) in {:.1} s",
        args.out.display(),
        args.shape,
        args.seed,
        params as f64 / 1e9,
        started.elapsed().as_secs_f64()
    );
    println!("{}", args.out.display());
    Ok(())
}
