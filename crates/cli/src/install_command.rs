//! `seam install`: installs ahead of time what a backend would otherwise install on its first
//! load, on a machine that need not have the hardware (a container image built without a GPU).

use crate::cli_error::CliError;
use clap::{Args, ValueEnum};

#[derive(Args)]
pub struct InstallArgs {
    /// What to install: `pjrt-cuda`, the CUDA PJRT plugin with NVIDIA's CUDA 13 libraries (pinned
    /// wheels, about 3 GB, into seam's folder; the first pjrt-cuda load on a machine with a GPU
    /// installs it too).
    what: Installable,
}

#[derive(Clone, Copy, ValueEnum)]
enum Installable {
    PjrtCuda,
}

pub fn run(args: InstallArgs) -> Result<(), CliError> {
    match args.what {
        Installable::PjrtCuda => install_pjrt_cuda(),
    }
}

#[cfg(feature = "pjrt")]
fn install_pjrt_cuda() -> Result<(), CliError> {
    use backend_pjrt::cuda_plugin;
    let set = &cuda_plugin::CUDA13;
    let already = cuda_plugin::installed_plugin(set).is_some();
    let plugin = cuda_plugin::ensure_installed(set, &|message| eprintln!("{message}"))
        .map_err(|reason| session_api::SeamError::Unavailable { backend: "pjrt-cuda".into(), reason })?;
    let state = if already { "already installed" } else { "installed" };
    println!("{state}: {}", plugin.display());
    Ok(())
}

#[cfg(not(feature = "pjrt"))]
fn install_pjrt_cuda() -> Result<(), CliError> {
    Err(CliError::Usage("this seam binary was built without the pjrt backend (feature `pjrt`)".into()))
}
