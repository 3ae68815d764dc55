//! `seam conformance`: the suite of `crates/conformance`, from the command line.

use crate::cli_error::CliError;
use clap::{Args, ValueEnum};
use conformance::{run_suite, ComputePrecision, RealModelParity, SuiteOptions};
use session_api::WeightFormat;
use std::path::PathBuf;

#[derive(Clone, Copy, ValueEnum)]
enum RealModel {
    /// No greedy parity on the real default model.
    Skip,
    /// Two prompts on the real default model.
    Quick,
    /// Every parity prompt on the real default model.
    Full,
}

#[derive(Args)]
pub struct ConformanceArgs {
    /// Backend to test (repeatable); all registered backends when absent.
    #[arg(long = "backend")]
    backends: Vec<String>,
    /// A PJRT plugin file for `--backend pjrt` (any plugin: the suite runs the pure-StableHLO
    /// graphs on it).
    #[arg(long)]
    plugin: Option<PathBuf>,
    /// Weight format to test (repeatable); both when absent.
    #[arg(long = "weights")]
    formats: Vec<WeightFormat>,
    /// Compute precision of the backend, which selects the tolerances: f32, f16, bf16 or int8
    /// (activations rounded to int8 before quantized products, `SEAM_PJRT_ACTIVATIONS=int8`).
    #[arg(long, default_value = "f32")]
    precision: ComputePrecision,
    /// How much greedy parity to run on the real default model (SmolLM2-135M-Instruct).
    #[arg(long, value_enum, default_value = "full")]
    real_model: RealModel,
    /// Run only cases whose name contains this text.
    #[arg(long)]
    cases: Option<String>,
    /// Also write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn run(args: ConformanceArgs) -> Result<(), CliError> {
    let named = !args.backends.is_empty();
    if let Some(filter) = &args.cases {
        let all = conformance::list_cases();
        if !all.iter().any(|(name, _)| name.contains(filter.as_str())) {
            let names: Vec<&str> = all.iter().map(|(name, _)| *name).collect();
            return Err(CliError::Usage(format!("--cases {filter} names no case (cases: {})", names.join(", "))));
        }
    }
    let mut options = SuiteOptions {
        backends: args.backends,
        backend_settings: crate::run_command::backend_settings(args.plugin.as_deref()),
        precision: args.precision,
        real_model: match args.real_model {
            RealModel::Skip => RealModelParity::Skip,
            RealModel::Quick => RealModelParity::Quick,
            RealModel::Full => RealModelParity::Full,
        },
        case_filter: args.cases,
        progress: true,
        ..SuiteOptions::default()
    };
    if !args.formats.is_empty() {
        options.formats = args.formats;
    }
    let report = run_suite(&options).map_err(|e| CliError::CheckFailed(format!("the suite could not run: {e}")))?;
    report.print_matrix();
    if let Some(path) = &args.json {
        std::fs::write(path, report.to_json()).map_err(CliError::Output)?;
        say!("report written to {}", path.display());
    }
    if report.has_failures() {
        return Err(CliError::CheckFailed("conformance failed: see the matrix above".into()));
    }
    // A backend asked for by name that could not run has not passed.
    if let Some(b) = report.backends.iter().find(|b| named && !b.availability.is_available()) {
        let reason = match &b.availability {
            session_api::Availability::Unavailable { reason } => reason.clone(),
            session_api::Availability::Available { .. } => String::new(),
        };
        return Err(CliError::CheckFailed(format!("{} is unavailable: {reason}", b.backend)));
    }
    Ok(())
}
