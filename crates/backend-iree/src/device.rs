//! The devices IREE runs the graphs on, and what each needs from the compiler and the runtime.
//!
//! - [`IreeDevice::Cpu`] (`iree-cpu`): llvm-cpu code for the host CPU, `local-task` driver (every
//!   core).
//! - [`IreeDevice::Cuda`] (`iree-cuda`): the compiler's `cuda` target (PTX for one GPU
//!   architecture), IREE's CUDA HAL driver. The driver exists only in builds with the `cuda`
//!   feature; it loads `libcuda.so` at run time, so such a build still starts on a machine
//!   without a GPU and reports the backend unavailable there.

use crate::compiler::LLVM_CPU_FLAGS;
use crate::error::IreeError;
use session_api::{DeviceInfo, DeviceKind};
use std::process::Command;

/// Environment variable naming the CUDA architecture to compile for (`sm_90`, ...); by default
/// it is read from `nvidia-smi`.
pub const CUDA_TARGET_ENV: &str = "SEAM_IREE_CUDA_TARGET";

/// Extra compiler flags for every module, space-separated (`--iree-opt-data-tiling`, ...): for
/// measuring the compiler's options without a rebuild. They are part of the module cache key.
pub const COMPILE_FLAGS_ENV: &str = "SEAM_IREE_COMPILE_FLAGS";

/// A device kind the IREE backends drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IreeDevice {
    Cpu,
    Cuda,
}

impl IreeDevice {
    /// The backend's registry name.
    pub fn id(self) -> &'static str {
        match self {
            IreeDevice::Cpu => "cpu",
            IreeDevice::Cuda => "cuda:0",
        }
    }

    /// The device of `id`, or an `InvalidInput` error naming the ones there are.
    pub fn from_id(id: &str) -> Result<IreeDevice, IreeError> {
        match id {
            "cpu" => Ok(IreeDevice::Cpu),
            "cuda:0" | "cuda" => Ok(IreeDevice::Cuda),
            other => Err(IreeError::NoSuchDevice(format!("iree has no device {other} (devices: cpu, cuda:0)"))),
        }
    }

    /// Whether this build has the runtime driver.
    pub fn driver_built(self) -> bool {
        match self {
            IreeDevice::Cpu => true,
            IreeDevice::Cuda => cfg!(feature = "cuda"),
        }
    }

    /// The runtime driver whose default device to create.
    pub(crate) fn driver(self) -> Result<&'static str, IreeError> {
        match self {
            IreeDevice::Cpu => Ok("local-task"),
            IreeDevice::Cuda if self.driver_built() => Ok("cuda"),
            IreeDevice::Cuda => Err(IreeError::Unavailable(
                "this seam was built without the `cuda` feature (build with `--features cuda` after `source scripts/cuda-prereqs.sh`)".into(),
            )),
        }
    }

    /// The compiler flags of every module for this device (part of the cache key), then those
    /// of [`COMPILE_FLAGS_ENV`].
    pub fn compile_flags(self) -> Result<Vec<String>, IreeError> {
        let mut flags: Vec<String> = match self {
            IreeDevice::Cpu => LLVM_CPU_FLAGS.iter().map(|f| f.to_string()).collect(),
            IreeDevice::Cuda => {
                let arch = cuda_target()?;
                vec![
                    "--iree-hal-target-backends=cuda".into(),
                    format!("--iree-cuda-target={arch}"),
                    "--iree-opt-level=O3".into(),
                ]
            }
        };
        if let Ok(extra) = std::env::var(COMPILE_FLAGS_ENV) {
            flags.extend(extra.split_whitespace().map(str::to_string));
        }
        Ok(flags)
    }

    /// The devices to list for this backend (once the runtime device was created).
    pub(crate) fn device_info(self) -> DeviceInfo {
        match self {
            IreeDevice::Cpu => backend_reference::cpu_device(),
            IreeDevice::Cuda => {
                let name = nvidia_smi(&["--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]);
                let (name, memory_bytes) =
                    match name.as_deref().and_then(|l| l.lines().next()).and_then(|l| l.split_once(',')) {
                        Some((name, mib)) => {
                            (name.trim().to_string(), mib.trim().parse::<u64>().ok().map(|m| m * 1024 * 1024))
                        }
                        None => ("CUDA device 0".to_string(), None),
                    };
                DeviceInfo { id: self.id().into(), kind: DeviceKind::Gpu, name, memory_bytes }
            }
        }
    }
}

fn nvidia_smi(args: &[&str]) -> Option<String> {
    let out = Command::new("nvidia-smi").args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The CUDA architectures IREE 3.13's compiler accepts for `--iree-cuda-target`, as compute
/// capabilities. Tried one by one on the tiny graphs: `sm_90`, `sm_90a` and `sm_100` fail with
/// "missing GPU target in #hal.executable.target", so a Hopper GPU gets `sm_89` PTX, which its
/// driver compiles for the device when loading it (PTX is forward compatible).
pub const IREE_CUDA_TARGETS: [(u32, u32); 8] = [(6, 0), (7, 0), (7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (12, 0)];

/// The CUDA architecture to compile for: [`CUDA_TARGET_ENV`], else the newest of
/// [`IREE_CUDA_TARGETS`] that GPU 0 (its compute capability from `nvidia-smi`) can run.
pub fn cuda_target() -> Result<String, IreeError> {
    if let Some(explicit) = std::env::var(CUDA_TARGET_ENV).ok().filter(|v| !v.is_empty()) {
        return Ok(explicit);
    }
    let capability = nvidia_smi(&["--query-gpu=compute_cap", "--format=csv,noheader"]).ok_or_else(|| {
        IreeError::Unavailable(format!(
            "no NVIDIA GPU found (nvidia-smi failed or is missing); set {CUDA_TARGET_ENV} to compile anyway"
        ))
    })?;
    let device = parse_capability(capability.lines().next().unwrap_or_default()).ok_or_else(|| {
        IreeError::Unavailable(format!("nvidia-smi reported an unreadable compute capability {capability:?}"))
    })?;
    target_for(device).ok_or_else(|| {
        IreeError::Unavailable(format!(
            "GPU compute capability {}.{} is older than any CUDA target IREE 3.13 compiles for",
            device.0, device.1
        ))
    })
}

/// `"9.0"` -> `(9, 0)`.
fn parse_capability(capability: &str) -> Option<(u32, u32)> {
    let (major, minor) = capability.trim().split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// The newest IREE target a device of compute capability `device` runs (same major version,
/// or an older one through PTX).
fn target_for(device: (u32, u32)) -> Option<String> {
    IREE_CUDA_TARGETS.iter().rev().find(|&&t| t <= device).map(|(major, minor)| format!("sm_{major}{minor}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compute_capability_to_target() {
        assert_eq!(parse_capability(" 8.6\n"), Some((8, 6)));
        assert_eq!(parse_capability("nine"), None);
        assert_eq!(target_for((8, 6)).as_deref(), Some("sm_86"));
        // Hopper: IREE 3.13 has no sm_90 target; sm_89 PTX runs there.
        assert_eq!(target_for((9, 0)).as_deref(), Some("sm_89"));
        assert_eq!(target_for((12, 0)).as_deref(), Some("sm_120"));
        assert_eq!(target_for((5, 2)), None);
    }

    #[test]
    fn cuda_driver_matches_the_feature() {
        assert_eq!(IreeDevice::Cuda.driver_built(), cfg!(feature = "cuda"));
        assert!(IreeDevice::Cpu.driver().is_ok());
        assert_eq!(IreeDevice::Cuda.driver().is_ok(), cfg!(feature = "cuda"));
    }
}
