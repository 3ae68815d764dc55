//! The registered factory: [`ReferenceBackend`] loads a model directory into a [`ReferenceEngine`].

use crate::engine::{capabilities_with, EngineOptions, ReferenceEngine};
use llama_model::model_dir::ModelDir;
use llama_model::weights::load_weights;
use session_api::{Availability, Backend, Capabilities, DeviceInfo, DeviceKind, Engine, LoadRequest, Result};
use std::sync::Arc;
use std::time::Instant;

/// seam's pure-Rust f32 backend. It runs wherever Rust runs, so it is always available.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReferenceBackend;

/// The CPU this process runs on, as a [`DeviceInfo`] (id `cpu`).
pub fn cpu_device() -> DeviceInfo {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| cpu_model_name(&info))
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let memory_bytes = std::fs::read_to_string("/proc/meminfo").ok().and_then(|info| mem_total_bytes(&info));
    DeviceInfo { id: "cpu".into(), kind: DeviceKind::Cpu, name: format!("{model} ({cores} threads)"), memory_bytes }
}

/// The `model name` line of `/proc/cpuinfo` (x86); ARM kernels may lack it.
fn cpu_model_name(cpuinfo: &str) -> Option<String> {
    cpuinfo
        .lines()
        .find(|line| line.starts_with("model name"))
        .and_then(|line| line.split_once(':'))
        .map(|(_, name)| name.trim().to_string())
        .filter(|name| !name.is_empty())
}

/// `MemTotal` of `/proc/meminfo`, which the kernel gives in KiB.
fn mem_total_bytes(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|line| line.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

impl Backend for ReferenceBackend {
    fn name(&self) -> &str {
        crate::BACKEND_NAME
    }

    fn description(&self) -> &str {
        "pure-Rust f32 interpreter on the CPU; the oracle other backends are checked against"
    }

    fn availability(&self) -> Availability {
        Availability::Available { devices: vec![cpu_device()] }
    }

    /// Everything the contract names; `max_context` is `usize::MAX` here because only a loaded
    /// model sets the limit (its `max_position_embeddings`).
    fn capabilities(&self) -> Capabilities {
        capabilities_with(usize::MAX)
    }

    fn load(&self, request: &LoadRequest) -> Result<Arc<dyn Engine>> {
        DeviceInfo::select(crate::BACKEND_NAME, &[cpu_device()], request.device.as_deref())?;
        request.check_settings(crate::BACKEND_NAME, &[])?;
        let started = Instant::now();
        let dir = ModelDir::open(&request.model_dir)?;
        let report_read = |done: u64, total: u64| request.report("reading weights", done, Some(total));
        let weights = load_weights(&request.model_dir, request.weights, Some(&report_read))?;
        let progress_request = request.clone();
        let options = EngineOptions {
            model_name: dir.name(),
            max_context: request.max_context,
            threads: request.threads,
            progress: Some(Arc::new(move |done, total| {
                progress_request.report("converting to f32", done, Some(total))
            })),
        };
        let mut engine = ReferenceEngine::from_weights(&weights, options)?;
        engine.set_load_time(started.elapsed());
        Ok(Arc::new(engine))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_cpu_name_and_memory_from_proc_files() {
        let cpuinfo = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\nflags\t: fpu\n";
        assert_eq!(cpu_model_name(cpuinfo).as_deref(), Some("AMD EPYC 7B13"));
        assert_eq!(cpu_model_name("processor : 0\n"), None);
        assert_eq!(mem_total_bytes("MemTotal:       24576000 kB\nMemFree: 1 kB\n"), Some(24576000 * 1024));
    }

    #[test]
    fn is_always_available_on_one_cpu_device() {
        let Availability::Available { devices } = ReferenceBackend.availability() else { panic!("unavailable") };
        assert_eq!(devices.len(), 1);
        assert_eq!(devices[0].id, "cpu");
        assert!(devices[0].name.contains("threads"), "{}", devices[0].name);
    }

    #[test]
    fn registered_under_its_name() {
        let backend = session_api::find_backend("reference").unwrap();
        assert_eq!(backend.name(), "reference");
        assert!(backend.capabilities().supports_format(session_api::WeightFormat::Int4));
    }

    #[test]
    fn a_missing_model_directory_is_an_error_not_a_panic() {
        let request = LoadRequest::new("/nonexistent/seam-model", session_api::WeightFormat::F16);
        assert!(ReferenceBackend.load(&request).is_err());
        let mut other_device = request.clone();
        other_device.device = Some("cuda:0".into());
        assert_eq!(ReferenceBackend.load(&other_device).err().unwrap().kind(), session_api::ErrorKind::InvalidInput);
    }
}
