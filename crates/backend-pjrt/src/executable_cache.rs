//! Compiled executables cached on disk, so that a second load of the same model compiles nothing.
//!
//! The key is a SHA-256 of everything that decides the compiled code: the module text, the
//! compile options, `XLA_FLAGS`, and the plugin's identity (its C API version, the XLA version it reports,
//! and the library file's size and modification time: a plugin build can only deserialize its
//! own executables). Files live in `<cache>/pjrt/<key>.pjrtexe` (`SEAM_CACHE_DIR`, default
//! `.seam/cache`), written atomically. An entry the plugin refuses to load is compiled again and
//! overwritten.

use pjrt_runtime::{Client, CompileOptions, LoadedExecutable, PjrtError, Plugin};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Whether an executable came from the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheOutcome {
    Hit,
    Compiled,
}

/// The cache folder.
pub fn cache_dir() -> PathBuf {
    llama_model::default_model::cache_home().join("pjrt")
}

fn plugin_identity(plugin: &Plugin) -> String {
    let meta = std::fs::metadata(plugin.path()).ok();
    let size = meta.as_ref().map(|m| m.len()).unwrap_or(0);
    let mtime = meta.and_then(|m| m.modified().ok()).and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map(|d| d.as_secs());
    format!(
        "{} api {} xla {} size {size} mtime {mtime:?}",
        plugin.path().display(),
        plugin.version(),
        plugin.attribute("xla_version").unwrap_or("?")
    )
}

/// The cache key of `module` compiled with `options` by `plugin`.
pub fn cache_key(plugin: &Plugin, module: &str, options: &CompileOptions) -> String {
    let mut hash = Sha256::new();
    hash.update(plugin_identity(plugin).as_bytes());
    hash.update([0]);
    // XLA reads its debug options (optimization switches included) from XLA_FLAGS at compile time.
    hash.update(std::env::var("XLA_FLAGS").unwrap_or_default().as_bytes());
    hash.update([0]);
    hash.update(options.to_proto_bytes());
    hash.update([0]);
    hash.update(module.as_bytes());
    hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Loads `module` from the cache, or compiles it and stores it.
pub fn compile_cached(client: &Arc<Client>, module: &str) -> Result<(LoadedExecutable, CacheOutcome), CacheError> {
    let options = CompileOptions::default();
    let path = cache_dir().join(format!("{}.pjrtexe", cache_key(client.plugin(), module, &options)));
    if let Ok(bytes) = std::fs::read(&path) {
        if let Ok(executable) = client.deserialize(&bytes) {
            return Ok((executable, CacheOutcome::Hit));
        }
    }
    let executable = client.compile(module, &options).map_err(CacheError::Compile)?;
    let bytes = executable.serialize().map_err(CacheError::Compile)?;
    write_atomically(&path, &bytes)?;
    Ok((executable, CacheOutcome::Compiled))
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), CacheError> {
    let io = |source| CacheError::Io { path: path.to_path_buf(), source };
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io)?;
    let tmp = dir.join(format!(".{}.{}.tmp", path.file_name().unwrap_or_default().to_string_lossy(), std::process::id()));
    std::fs::write(&tmp, bytes).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

/// A compile or cache failure.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("the PJRT plugin failed to compile the graph: {0}")]
    Compile(PjrtError),
    #[error("compiled-executable cache {}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
}
