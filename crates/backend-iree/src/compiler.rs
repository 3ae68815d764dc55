//! The IREE compiler: finding `libIREECompiler.so`, compiling StableHLO text for llvm-cpu, and an
//! on-disk cache of compiled modules so that a second load of the same model compiles nothing.
//!
//! The compiler is the `iree-base-compiler==3.13.0` wheel's shared library, loaded at run time by
//! `eerie` (no link-time dependency: the crate builds without it). It is looked for, in order:
//! 1. `$SEAM_IREE_COMPILER`: the library file, or a directory holding it;
//! 2. `home::py_iree_dir()/iree/compiler/_mlir_libs/`: the project-local install, which
//!    [`ensure_compiler_library`] creates with `pip install --target` on first use;
//! 3. the `iree.compiler` package of `python3`'s own site-packages.

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

/// Flags of every llvm-cpu compilation. `O3` made the f16 decode gemv 1.5x faster on IREE 3.13
/// (FACTS.md); `target-cpu=host` uses the machine's vector extensions, which is why the host CPU
/// is part of the cache key.
pub const LLVM_CPU_FLAGS: [&str; 3] =
    ["--iree-hal-target-backends=llvm-cpu", "--iree-llvmcpu-target-cpu=host", "--iree-opt-level=O3"];

fn library_in(dir: &Path) -> PathBuf {
    dir.join("iree/compiler/_mlir_libs").join(LIBRARY_NAME)
}

/// The compiler library named by [`COMPILER_ENV`], if set (it may not exist).
pub fn explicit_compiler_path() -> Option<PathBuf> {
    std::env::var_os(COMPILER_ENV).filter(|v| !v.is_empty()).map(PathBuf::from)
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

/// The host CPU's identity for the cache key: modules are compiled with `target-cpu=host`.
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

/// The cache key of `mlir` compiled with `flags` by compiler `version`.
pub fn cache_key(mlir: &str, flags: &[&str], version: &str) -> String {
    let flags = flags.join("\n");
    graph_engine::artifact_cache::cache_key(&[
        version.as_bytes(),
        host_cpu().as_bytes(),
        flags.as_bytes(),
        mlir.as_bytes(),
    ])
}

/// Compiles `mlir` (or takes its module from the cache, when it holds one for this text, these
/// flags and this compiler) and hands the module to `load`. A cached module that `load` refuses
/// is compiled again. `what` names the graphs in errors.
pub fn compile_cached(
    compiler_library: &Path,
    what: &str,
    mlir: &str,
    flags: &[&str],
    load: impl Fn(Vec<u8>) -> session_api::Result<()>,
) -> session_api::Result<CacheOutcome> {
    let (compiler, version) = load_compiler(compiler_library)?;
    let build = || {
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
    Ok(outcome)
}
