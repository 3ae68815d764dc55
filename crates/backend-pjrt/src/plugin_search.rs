//! Where a PJRT plugin is looked for, and what was found.
//!
//! In order, for each device kind:
//! 1. an explicit path: `SEAM_PJRT_CPU_PLUGIN` / `SEAM_PJRT_CUDA_PLUGIN` (only that path is tried);
//! 2. the project's own install, `.seam/pjrt` (where `scripts/build-prereqs.sh` puts the pinned
//!    `xla-cpu-pjrt==0.0.1` wheel; `SEAM_HOME` moves `.seam`);
//!    For CUDA also the plugin seam installs itself ([`crate::cuda_plugin`], `.seam/pjrt-cuda`);
//! 3. the places pip installs the known plugin wheels: the active virtual environment, the user's
//!    site-packages, the system's, and those of the `python3` on the `PATH` (a virtual environment
//!    that is not activated, such as the one a GPU machine's image ships JAX in).
//!
//! Every candidate that exists is tried; when none loads, the error lists each place and why it
//! failed (no file, not a plugin, API version mismatch, no device).

use pjrt_runtime::{Client, PjrtError, Plugin};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The kinds of device the backend drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PjrtDevice {
    Cpu,
    Cuda,
}

impl PjrtDevice {
    /// The environment variable naming an explicit plugin file.
    pub fn plugin_env(self) -> &'static str {
        match self {
            PjrtDevice::Cpu => "SEAM_PJRT_CPU_PLUGIN",
            PjrtDevice::Cuda => "SEAM_PJRT_CUDA_PLUGIN",
        }
    }

    /// Paths of the known plugin wheels' libraries, relative to a site-packages folder.
    fn wheel_files(self) -> &'static [&'static str] {
        match self {
            // xla-cpu-pjrt (OpenXLA), lammps-jax-pjrt-cpu.
            PjrtDevice::Cpu => {
                &["xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so", "lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so"]
            }
            // xla-cuda12-pjrt (OpenXLA), jax-cuda12-pjrt / jax-cuda13-pjrt (JAX's plugins).
            PjrtDevice::Cuda => &[
                "xla_plugins/xla_cuda12_pjrt/xla_cuda12_pjrt.so",
                "jax_plugins/xla_cuda12/xla_cuda_plugin.so",
                "jax_plugins/xla_cuda13/xla_cuda_plugin.so",
            ],
        }
    }

    /// The platform the plugin's client must report.
    fn platform(self) -> &'static str {
        match self {
            PjrtDevice::Cpu => "cpu",
            PjrtDevice::Cuda => "cuda",
        }
    }
}

/// site-packages folders pip may have installed a plugin wheel into, found without starting
/// Python.
fn site_packages() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        roots.push(PathBuf::from(venv).join("lib"));
    }
    if let Some(home) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(home).join(".local/lib"));
    }
    roots.extend(["/usr/local/lib", "/usr/lib"].map(PathBuf::from));
    let mut out = Vec::new();
    for root in roots {
        let Ok(entries) = std::fs::read_dir(&root) else { continue };
        let mut pythons: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("python3")))
            .collect();
        pythons.sort();
        for python in pythons {
            out.push(python.join("site-packages"));
            out.push(python.join("dist-packages"));
        }
    }
    out
}

/// The site-packages folders of the `python3` on the `PATH`, if there is one. Asked once per
/// process: every availability check searches, and starting Python each time would cost more
/// than the rest of the search.
fn python_site_packages() -> Vec<PathBuf> {
    static FOLDERS: std::sync::OnceLock<Vec<PathBuf>> = std::sync::OnceLock::new();
    FOLDERS.get_or_init(ask_python_site_packages).clone()
}

fn ask_python_site_packages() -> Vec<PathBuf> {
    let script = "import site; print('\\n'.join(site.getsitepackages() + [site.getusersitepackages()]))";
    let output = std::process::Command::new("python3").args(["-c", script]).env_remove("PYTHONPATH").output();
    match output {
        Ok(out) if out.status.success() => {
            String::from_utf8_lossy(&out.stdout).lines().filter(|l| !l.is_empty()).map(PathBuf::from).collect()
        }
        _ => Vec::new(),
    }
}

/// The folders searched for plugin wheels, in order: first those known without starting Python
/// (the project's installs, then site-packages folders), then, with `ask_python`, those of the
/// `python3` on the `PATH` that are not among them.
fn search_folders(ask_python: bool) -> Vec<PathBuf> {
    let mut folders =
        vec![llama_model::home::pjrt_plugin_dir(), crate::cuda_plugin::install_dir(&crate::cuda_plugin::CUDA13)];
    folders.extend(site_packages().into_iter().filter(|p| p.is_dir()));
    if ask_python {
        for folder in python_site_packages() {
            if folder.is_dir() && !folders.contains(&folder) {
                folders.push(folder);
            }
        }
    }
    folders
}

/// The plugin files of `device` in `folders`, in order, without repeats.
fn candidates_in(device: PjrtDevice, folders: &[PathBuf]) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for folder in folders {
        for file in device.wheel_files() {
            let path = folder.join(file);
            if !out.contains(&path) {
                out.push(path);
            }
        }
    }
    out
}

/// A plugin that loaded, with a client on its device.
pub struct FoundPlugin {
    pub plugin: Arc<Plugin>,
    pub client: Arc<Client>,
}

/// Why no plugin could be used: every place looked at, and what happened there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchFailure {
    pub device: PjrtDevice,
    /// `(place, outcome)` for every candidate tried; places without a file are summarized.
    pub tried: Vec<(PathBuf, String)>,
    /// Candidate files that did not exist.
    pub missing: Vec<PathBuf>,
    /// The folders searched (the project's install, then site-packages), when not explicit.
    pub folders: Vec<PathBuf>,
    pub explicit: bool,
}

impl std::fmt::Display for SearchFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let env = self.device.plugin_env();
        if self.tried.is_empty() {
            if self.explicit {
                let path = self.missing.first().map(|p| p.display().to_string()).unwrap_or_default();
                return write!(f, "no PJRT plugin at {path} (from {env})");
            }
            let wheel = match self.device {
                PjrtDevice::Cpu => "xla-cpu-pjrt==0.0.1 (scripts/build-prereqs.sh installs it into .seam/pjrt)",
                PjrtDevice::Cuda => {
                    "a CUDA PJRT plugin wheel (`seam install pjrt-cuda`; or jax-cuda12-pjrt, jax-cuda13-pjrt)"
                }
            };
            let folders: Vec<String> = self.folders.iter().map(|p| p.display().to_string()).collect();
            return write!(
                f,
                "no {} PJRT plugin found (looked for {} in {}); install {wheel} or set {env}",
                self.device.platform(),
                self.device.wheel_files().join(", "),
                folders.join(", ")
            );
        }
        let outcomes: Vec<String> = self.tried.iter().map(|(path, why)| format!("{}: {why}", path.display())).collect();
        write!(f, "no usable {} PJRT plugin: {}", self.device.platform(), outcomes.join("; "))
    }
}

impl SearchFailure {
    /// Whether no candidate file existed (as opposed to files that failed to load).
    pub fn found_nothing(&self) -> bool {
        self.tried.is_empty() && !self.explicit
    }
}

/// Loads the first candidate plugin for `device` whose client starts and reports the right
/// platform with at least one device.
///
/// Python is started to ask for its site-packages only when no plugin in the folders known
/// without it loads: starting it (through a version manager's shims, often) costs a new process
/// more than the rest of its start-up, and the project's own install usually answers first.
pub fn find_plugin(device: PjrtDevice) -> Result<FoundPlugin, SearchFailure> {
    let explicit_path = std::env::var_os(device.plugin_env()).filter(|p| !p.is_empty());
    let explicit = explicit_path.is_some();
    let mut failure = SearchFailure { device, tried: Vec::new(), missing: Vec::new(), folders: Vec::new(), explicit };
    let try_paths = |paths: Vec<PathBuf>, failure: &mut SearchFailure| {
        for path in paths {
            if failure.missing.contains(&path) || failure.tried.iter().any(|(tried, _)| *tried == path) {
                continue;
            }
            if !path.is_file() {
                failure.missing.push(path);
                continue;
            }
            match open_client(&path, Some(device)) {
                Ok(found) => return Some(found),
                Err(why) => failure.tried.push((path, why)),
            }
        }
        None
    };
    if let Some(path) = explicit_path {
        return try_paths(vec![PathBuf::from(path)], &mut failure).ok_or(failure);
    }
    for ask_python in [false, true] {
        failure.folders = search_folders(ask_python);
        if let Some(found) = try_paths(candidates_in(device, &failure.folders), &mut failure) {
            return Ok(found);
        }
    }
    Err(failure)
}

/// Loads the plugin at `path` and starts a client; with `device`, the client must report its
/// platform.
fn open_client(path: &Path, device: Option<PjrtDevice>) -> Result<FoundPlugin, String> {
    let plugin = Plugin::load(path).map_err(|e| match e {
        PjrtError::ApiVersion { plugin, header, .. } => {
            format!("API version mismatch (plugin {plugin}, seam {header})")
        }
        other => other.to_string(),
    })?;
    let client = Client::new(Arc::clone(&plugin)).map_err(|e| match e {
        PjrtError::NoDevice => "no device".to_string(),
        other => format!("no client: {other}"),
    })?;
    let info = client.device_info().map_err(|e| e.to_string())?;
    if let Some(device) = device.filter(|d| info.platform != d.platform()) {
        return Err(format!("a {} plugin, not {}", info.platform, device.platform()));
    }
    Ok(FoundPlugin { plugin, client })
}

/// Where a process-wide client came from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum ClientKey {
    Searched(PjrtDevice),
    Path(PathBuf),
}

/// The process-wide client of `key`, created by `open` on first use. One per plugin: a GPU
/// plugin's client reserves device memory, so engines share it instead of each making one.
fn cached_client<E>(key: ClientKey, open: impl FnOnce() -> Result<FoundPlugin, E>) -> Result<Arc<FoundPlugin>, E> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static CLIENTS: OnceLock<Mutex<HashMap<ClientKey, Arc<FoundPlugin>>>> = OnceLock::new();
    let mut clients = CLIENTS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    if let Some(found) = clients.get(&key) {
        return Ok(Arc::clone(found));
    }
    // Before a client starts its threads; harmless for a plugin whose buffers are not on the host.
    cap_malloc_arenas();
    let found = Arc::new(open()?);
    clients.insert(key, Arc::clone(&found));
    Ok(found)
}

/// The process-wide client of the plugin the search finds for `device`.
pub fn shared_client(device: PjrtDevice) -> Result<Arc<FoundPlugin>, SearchFailure> {
    cached_client(ClientKey::Searched(device), || find_plugin(device))
}

/// The process-wide client of the plugin at `path`, whatever its platform (a vendor's plugin), or
/// why it cannot be used: no file, not a plugin, an API version seam cannot call, no device.
pub fn client_at(path: &Path) -> Result<Arc<FoundPlugin>, String> {
    cached_client(ClientKey::Path(path.to_path_buf()), || {
        if !path.is_file() {
            return Err(format!("no PJRT plugin at {} (from --plugin)", path.display()));
        }
        open_client(path, None).map_err(|why| format!("{}: {why}", path.display()))
    })
}

/// Hands memory that the allocator holds free back to the OS (glibc's `malloc_trim`, which also
/// releases whole free pages inside every arena). Called when a session's KV cache is freed: XLA's
/// CPU client allocates buffers from its worker threads' arenas, where a freed cache otherwise
/// stays resident as stranded free chunks (see [`cap_malloc_arenas`]).
pub(crate) fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages to the OS; it does not touch live allocations.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Caps glibc's malloc arenas at 2 before the XLA CPU client starts its worker threads, unless
/// the user set `MALLOC_ARENA_MAX`.
///
/// Why: XLA allocates each execution's buffers from whichever of its threads runs it, and glibc
/// gives every thread its own arena. With sessions created and dropped a few at a time, the
/// resident set kept climbing (12-24 MiB per 100 tiny sessions after a flat start) although
/// nothing leaked: freed chunks stayed stranded in per-thread arenas. With 2 arenas it stays
/// flat (measured: 0-8 KiB per 100 sessions). Decision recorded in docs/adr/0007-pjrt-binding.md.
///
/// Also fixes glibc's mmap threshold at 64 KiB (unless `MALLOC_MMAP_THRESHOLD_` is set): by
/// default the threshold rises to the size of the largest mmapped block freed, after which KV
/// caches of small models (around 128 KiB) move onto the heap arenas, where the resident set of a
/// fresh-clone CI run still grew 10-22 MiB over 200 sessions although `malloc_trim` ran on every
/// drop. A fixed threshold keeps every cache in its own mapping, unmapped when it is freed.
fn cap_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; they apply to later allocations.
    unsafe {
        if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
            libc::mallopt(libc::M_ARENA_MAX, 2);
        }
        if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 64 * 1024);
        }
    }
}
