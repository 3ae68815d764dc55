//! The IREE compiler: finding `libIREECompiler.so`, compiling StableHLO text for llvm-cpu, and an
//! on-disk cache of compiled modules so that a second load of the same model compiles nothing.
//!
//! The compiler is the `iree-base-compiler==3.13.0` wheel's shared library, loaded at run time by
//! `eerie` (no link-time dependency: the crate builds without it). It is looked for, in order:
//! 1. `$SEAM_IREE_COMPILER`: the library file, or a directory holding it;
//! 2. `home::py_iree_dir()/iree/compiler/_mlir_libs/`: the project-local install, which
//!    [`ensure_compiler_library`] creates with `pip install --target` on first use;
//! 3. the `iree.compiler` package of `python3`'s own site-packages.
//!
//! `SEAM_IREE_COMPILER=none` says this machine compiles nothing: every module must already be in
//! the cache, compiled ahead of time elsewhere ([`crate::compile_ahead`], for a GPU machine that
//! has no compiler and no package registry). The cache key then takes the compiler identity that
//! the cache folder recorded when its modules were compiled ([`REVISION_FILE`]).

use crate::error::IreeError;
use eerie::compiler::Compiler;
use graph_engine::{ArtifactCache, CacheOutcome};
use llama_model::home;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

/// The pinned compiler wheel (its runtime twin, IREE 3.13, is what `eerie-sys` builds).
pub const COMPILER_WHEEL: &str = "iree-base-compiler==3.13.0";
/// Environment variable naming the compiler library (or its directory) explicitly.
pub const COMPILER_ENV: &str = "SEAM_IREE_COMPILER";
const LIBRARY_NAME: &str = "libIREECompiler.so";
/// The value of [`COMPILER_ENV`] that turns compiling off (cached modules only).
pub const NO_COMPILER: &str = "none";
/// The file in the module cache recording the identity of the compiler that last compiled into it.
pub const REVISION_FILE: &str = "compiler-revision.txt";

/// Which compiler a runtime uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompilerChoice {
    /// The compiler library at this path (loaded once per process).
    Library(PathBuf),
    /// No compiler ([`COMPILER_ENV`]` = none`): modules come from the cache alone.
    CachedOnly,
}

/// Whether [`COMPILER_ENV`] turns compiling off.
pub fn compiling_disabled() -> bool {
    std::env::var(COMPILER_ENV).is_ok_and(|v| v == NO_COMPILER)
}

/// The compiler to use: none when [`COMPILER_ENV`] says so, else the library, installed first
/// when it is nowhere to be found ([`ensure_compiler_library`]) and loaded.
pub fn choose_compiler() -> Result<CompilerChoice, IreeError> {
    if compiling_disabled() {
        return Ok(CompilerChoice::CachedOnly);
    }
    let library = ensure_compiler_library()?;
    compiler_version(&library)?;
    Ok(CompilerChoice::Library(library))
}

/// Where the identity of the last compiler library loaded is recorded, in the module cache's
/// folder: the library's fingerprint ([`fingerprint`]) and its version string, one per line.
const IDENTITY_FILE: &str = "compiler-identity.txt";

/// A library file as it is now: its path, length and modification time. A replaced or
/// reinstalled library has another.
fn fingerprint(library: &Path) -> Option<String> {
    let meta = std::fs::metadata(library).ok()?;
    let modified = meta.modified().ok()?.duration_since(std::time::UNIX_EPOCH).ok()?.as_nanos();
    Some(format!("{} {} {modified}", library.canonicalize().ok()?.display(), meta.len()))
}

/// The version string of the compiler library at `library` (part of every module's cache key),
/// without loading the library when this same file was loaded before: loading it maps a large
/// shared library (tens of MB resident) into a process that, with every module in the cache,
/// never compiles. A library not seen before is loaded, which also checks that it loads.
pub fn compiler_version(library: &Path) -> Result<String, IreeError> {
    version_recorded_in(&home::iree_cache_dir(), library, |library| Ok(load_compiler(library)?.1))
}

/// [`compiler_version`] with the identity recorded in `dir` and the library loaded by `load`.
fn version_recorded_in(
    dir: &Path,
    library: &Path,
    load: impl FnOnce(&Path) -> Result<String, IreeError>,
) -> Result<String, IreeError> {
    let path = dir.join(IDENTITY_FILE);
    let current = fingerprint(library);
    if let (Some(current), Ok(recorded)) = (&current, std::fs::read_to_string(&path)) {
        if let Some((recorded_fingerprint, version)) = recorded.trim_end().split_once('\n') {
            if recorded_fingerprint == current && !version.is_empty() {
                return Ok(version.to_string());
            }
        }
    }
    let version = load(library)?;
    if let Some(current) = current {
        // Best effort, like the module cache: a process that cannot write it loads the library.
        let _ = std::fs::create_dir_all(dir)
            .and_then(|()| atomic_write::write(&path, format!("{current}\n{version}\n").as_bytes()));
    }
    Ok(version)
}

/// Flags of every llvm-cpu compilation. `O3` made the f16 decode gemv 1.5x faster on IREE 3.13
/// (FACTS.md); `target-cpu=host` uses the machine's vector extensions, which is why the host CPU
/// is part of the cache key.
pub const LLVM_CPU_FLAGS: [&str; 3] =
    ["--iree-hal-target-backends=llvm-cpu", "--iree-llvmcpu-target-cpu=host", "--iree-opt-level=O3"];

fn library_in(dir: &Path) -> PathBuf {
    dir.join("iree/compiler/_mlir_libs").join(LIBRARY_NAME)
}

/// The compiler library named by [`COMPILER_ENV`], if set (it may not exist; `none` is no path).
pub fn explicit_compiler_path() -> Option<PathBuf> {
    std::env::var_os(COMPILER_ENV).filter(|v| !v.is_empty() && v != NO_COMPILER).map(PathBuf::from)
}

/// Finds the compiler library without installing anything. The error says where it looked.
pub fn find_compiler_library() -> Result<PathBuf, IreeError> {
    if let Some(explicit) = explicit_compiler_path() {
        let file = if explicit.is_dir() { explicit.join(LIBRARY_NAME) } else { explicit.clone() };
        // An explicit choice that is wrong is an error, not a reason to silently take another one.
        return if file.is_file() {
            Ok(file)
        } else {
            Err(IreeError::CompilerMissing(format!("{COMPILER_ENV}={} holds no {LIBRARY_NAME}", explicit.display())))
        };
    }
    let local = library_in(&home::py_iree_dir());
    if local.is_file() {
        return Ok(local);
    }
    if let Some(site) = python_site_library() {
        return Ok(site);
    }
    Err(IreeError::CompilerMissing(format!(
        "not in {COMPILER_ENV}, {}, nor python3's site-packages; install it with \
         `python3 -m pip install --target {} {COMPILER_WHEEL}` (seam does this on the first load)",
        local.display(),
        home::py_iree_dir().display()
    )))
}

/// The library of an `iree.compiler` package importable by `python3`, if any.
fn python_site_library() -> Option<PathBuf> {
    let out = Command::new("python3")
        .args(["-c", "import os, iree.compiler as c; print(os.path.dirname(c.__file__))"])
        .env_remove("PYTHONPATH")
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let file = dir.join("_mlir_libs").join(LIBRARY_NAME);
    file.is_file().then_some(file)
}

/// Finds the compiler library, installing the pinned wheel into [`home::py_iree_dir`] first when
/// it is nowhere to be found. Concurrent callers (tests run in parallel) install once: the install
/// holds a file lock.
pub fn ensure_compiler_library() -> Result<PathBuf, IreeError> {
    if let Ok(found) = find_compiler_library() {
        return Ok(found);
    }
    if explicit_compiler_path().is_some() {
        return find_compiler_library();
    }
    let dir = home::py_iree_dir();
    std::fs::create_dir_all(&dir).map_err(|e| IreeError::io(&dir, e))?;
    let lock_path = dir.with_extension("lock");
    let lock = std::fs::File::create(&lock_path).map_err(|e| IreeError::io(&lock_path, e))?;
    lock.lock().map_err(|e| IreeError::io(&lock_path, e))?;
    if library_in(&dir).is_file() {
        return Ok(library_in(&dir));
    }
    // --no-deps: the shared library needs none of the wheel's Python dependencies.
    let status = Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", "--target"])
        .arg(&dir)
        .arg(COMPILER_WHEEL)
        .status()
        .map_err(|e| IreeError::CompilerMissing(format!("running python3 -m pip to install {COMPILER_WHEEL}: {e}")))?;
    if !status.success() || !library_in(&dir).is_file() {
        return Err(IreeError::CompilerMissing(format!(
            "`python3 -m pip install --target {} {COMPILER_WHEEL}` failed ({status})",
            dir.display()
        )));
    }
    Ok(library_in(&dir))
}

/// The loaded compiler, once per process (eerie loads one compiler library per process).
static LOADED: OnceLock<Result<(Compiler, String), String>> = OnceLock::new();
/// Serializes compilations: each one uses every core already, and MLIR contexts are large.
static COMPILE_LOCK: Mutex<()> = Mutex::new(());

/// Loads the compiler library at `path` (the first call wins for the whole process) and returns
/// it with its version string (the build revision and embedding API version).
pub fn load_compiler(path: &Path) -> Result<(Compiler, String), IreeError> {
    let loaded = LOADED.get_or_init(|| {
        let compiler = Compiler::with_library(path).map_err(|e| e.to_string())?;
        let revision = compiler.get_revision().map_err(|e| e.to_string())?;
        let (major, minor) = compiler.api_version();
        Ok((compiler.clone(), format!("{revision} (embedding API {major}.{minor})")))
    });
    loaded.clone().map_err(|message| IreeError::CompilerLoad { path: path.to_path_buf(), message })
}

/// The cache of compiled modules: `home::iree_cache_dir()/<key>.vmfb` (`.seam/cache/iree` unless
/// `SEAM_CACHE_DIR` says otherwise), verified by hash on every read.
pub fn module_cache() -> ArtifactCache {
    ArtifactCache::new(home::iree_cache_dir(), "vmfb")
}

/// The host CPU's identity, part of the cache key of modules compiled with `target-cpu=host`.
fn host_cpu() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default()
    };
    format!("{} | {} | {}", std::env::consts::ARCH, field("model name"), field("flags"))
}

/// The cache key of `mlir` compiled with `flags` by compiler `version`. Code compiled for the host
/// CPU is keyed by that CPU too; code for a GPU target is the same whichever machine compiled it,
/// which is what lets a module compiled here run on a GPU machine.
pub fn cache_key(mlir: &str, flags: &[&str], version: &str) -> String {
    let host = if flags.iter().any(|f| f.ends_with("target-cpu=host")) { host_cpu() } else { String::new() };
    let flags = flags.join("\n");
    graph_engine::artifact_cache::cache_key(&[version.as_bytes(), host.as_bytes(), flags.as_bytes(), mlir.as_bytes()])
}

/// The compiler identity recorded in the module cache, for a machine without a compiler.
fn recorded_revision() -> Result<String, IreeError> {
    let path = home::iree_cache_dir().join(REVISION_FILE);
    std::fs::read_to_string(&path).map(|s| s.trim().to_string()).map_err(|e| {
        IreeError::CompilerMissing(format!(
            "{COMPILER_ENV}={NO_COMPILER} and the module cache records no compiler ({}: {e}); \
             compile the model ahead with `seam compile` and carry {}",
            path.display(),
            home::iree_cache_dir().display()
        ))
    })
}

/// Records `version` as the identity of the compiler whose modules the cache holds.
fn record_revision(version: &str) {
    let dir = home::iree_cache_dir();
    let path = dir.join(REVISION_FILE);
    if std::fs::read_to_string(&path).is_ok_and(|s| s.trim() == version) {
        return;
    }
    let temp = dir.join(format!(".{REVISION_FILE}.{}.tmp", std::process::id()));
    // Best effort, like the cache itself: a machine that cannot write it loses only the ability to
    // use this cache without a compiler.
    let written = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(&temp, format!("{version}\n")))
        .and_then(|()| std::fs::rename(&temp, &path));
    if written.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
}

/// Compiles `mlir` (or takes its module from the cache, when it holds one for this text, these
/// flags and this compiler) and hands the module to `load`. A cached module that `load` refuses
/// is compiled again. `what` names the graphs in errors. Without a compiler
/// ([`CompilerChoice::CachedOnly`]) a module missing from the cache is an error naming it.
pub fn compile_cached(
    compiler: &CompilerChoice,
    what: &str,
    mlir: &str,
    flags: &[&str],
    load: impl Fn(Vec<u8>) -> session_api::Result<()>,
) -> session_api::Result<CacheOutcome> {
    let library = match compiler {
        CompilerChoice::Library(library) => library,
        CompilerChoice::CachedOnly => {
            let key = cache_key(mlir, flags, &recorded_revision()?);
            let build = || {
                Err(IreeError::CompilerMissing(format!(
                    "{COMPILER_ENV}={NO_COMPILER} and the {what} graphs ({}) are not in the module cache {}; \
                     compile them ahead with `seam compile` for the same model shape, context and settings",
                    flags.join(" "),
                    module_cache().dir().display()
                ))
                .into())
            };
            let ((), outcome) = module_cache().load_or_build(&key, &load, build)?;
            return Ok(outcome);
        }
    };
    // The library is loaded only when a module must be compiled.
    let version = compiler_version(library)?;
    let build = || {
        let (compiler, _) = load_compiler(library)?;
        let vmfb = {
            let _serial = COMPILE_LOCK.lock().unwrap_or_else(|p| p.into_inner());
            compiler
                .compile_str(mlir, flags)
                .map_err(|e| IreeError::Compile { graph: what.to_string(), message: e.to_string() })?
        };
        load(vmfb.clone())?;
        Ok(((), vmfb))
    };
    let ((), outcome) = module_cache().load_or_build(&cache_key(mlir, flags, &version), &load, build)?;
    record_revision(&version);
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_library_seen_before_is_not_loaded_again_and_a_changed_one_is() {
        let dir = tempfile::tempdir().unwrap();
        let library = dir.path().join("libIREECompiler.so");
        std::fs::write(&library, b"first").unwrap();
        let loads = std::cell::Cell::new(0);
        let load = |_: &Path| {
            loads.set(loads.get() + 1);
            Ok(format!("version {}", loads.get()))
        };
        assert_eq!(version_recorded_in(dir.path(), &library, load).unwrap(), "version 1");
        assert_eq!(version_recorded_in(dir.path(), &library, load).unwrap(), "version 1");
        assert_eq!(loads.get(), 1, "the recorded identity answered the second call");
        // A reinstalled library (another length) is loaded again.
        std::fs::write(&library, b"second build").unwrap();
        assert_eq!(version_recorded_in(dir.path(), &library, load).unwrap(), "version 2");
        // A library that fails to load is an error, and nothing is recorded for it.
        std::fs::write(&library, b"third, broken").unwrap();
        let failing = |_: &Path| Err(IreeError::Runtime("does not load".into()));
        assert!(version_recorded_in(dir.path(), &library, failing).is_err());
        assert_eq!(version_recorded_in(dir.path(), &library, load).unwrap(), "version 3");
    }
}
