//! Compiled graphs cached on disk, so that a second load of the same model compiles nothing.
//!
//! An artifact (an IREE module, a serialized PJRT executable) is stored under a key that hashes
//! everything deciding the compiled code: the graph text, the compile flags, the compiler's or
//! plugin's identity, the host CPU where code is compiled for it. The file holds a header with
//! the SHA-256 of the bytes after it, checked on every read: a truncated or corrupted entry is
//! compiled again and replaced instead of being handed to a runtime (which may crash on it).
//! Writes go to a temporary name in the same folder and are renamed into place, so a reader
//! never sees half a file and an interrupted write leaves no entry behind.

use session_api::{Result, SeamError};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// Whether an artifact came from the cache or was built now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheOutcome {
    Hit,
    Built,
}

const MAGIC: &[u8; 8] = b"SEAMART1";
const HEADER: usize = MAGIC.len() + 32;

/// A folder of cached artifacts of one kind (`<dir>/<key>.<extension>`).
#[derive(Debug, Clone)]
pub struct ArtifactCache {
    dir: PathBuf,
    extension: &'static str,
}

/// The SHA-256 of `parts`, each length-prefixed so that no two different lists of parts hash
/// the same bytes, as lowercase hex.
pub fn cache_key(parts: &[&[u8]]) -> String {
    let mut hash = Sha256::new();
    for part in parts {
        hash.update((part.len() as u64).to_le_bytes());
        hash.update(part);
    }
    hex(&hash.finalize())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl ArtifactCache {
    /// A cache in `dir` whose files end in `.extension`.
    pub fn new(dir: impl Into<PathBuf>, extension: &'static str) -> ArtifactCache {
        ArtifactCache { dir: dir.into(), extension }
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of `key`.
    pub fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.{}", self.extension))
    }

    /// The artifact of `key`: read from the cache and handed to `load`, or, when there is none,
    /// it is damaged, or `load` refuses it, made by `build` (which returns the loaded value and
    /// the bytes to store) and stored.
    pub fn load_or_build<T>(
        &self,
        key: &str,
        load: impl FnOnce(Vec<u8>) -> Result<T>,
        build: impl FnOnce() -> Result<(T, Vec<u8>)>,
    ) -> Result<(T, CacheOutcome)> {
        let path = self.path(key);
        // Debris of interrupted writers goes even when this load writes nothing.
        atomic_write::sweep_dead_temporaries(&self.dir);
        match read_verified(&path) {
            Some(bytes) => match load(bytes) {
                Ok(value) => return Ok((value, CacheOutcome::Hit)),
                Err(e) => eprintln!("warning: {} was refused ({e}); making it again", path.display()),
            },
            None if path.exists() => eprintln!("warning: {} is damaged; making it again", path.display()),
            None => {}
        }
        let (value, bytes) = build()?;
        // A cache that cannot be written (read-only, full) costs the next load a compile; it
        // must not fail this one.
        if let Err(e) = self.store(&path, &bytes) {
            eprintln!("warning: {} was not cached ({e}); the next load makes it again", path.display());
        }
        Ok((value, CacheOutcome::Built))
    }

    fn store(&self, path: &Path, bytes: &[u8]) -> Result<()> {
        let io = |source| SeamError::Io { path: path.to_path_buf(), source };
        std::fs::create_dir_all(&self.dir).map_err(io)?;
        atomic_write::sweep_dead_temporaries(&self.dir);
        let temp = atomic_write::temporary_path(path);
        let mut contents = Vec::with_capacity(HEADER + bytes.len());
        contents.extend_from_slice(MAGIC);
        contents.extend_from_slice(&Sha256::digest(bytes));
        contents.extend_from_slice(bytes);
        let written = std::fs::write(&temp, &contents).and_then(|()| std::fs::rename(&temp, path));
        if written.is_err() {
            let _ = std::fs::remove_file(&temp);
        }
        written.map_err(io)
    }
}

/// The payload of a cache file whose header matches its bytes.
fn read_verified(path: &Path) -> Option<Vec<u8>> {
    let mut contents = std::fs::read(path).ok()?;
    if contents.len() < HEADER || &contents[..MAGIC.len()] != MAGIC {
        return None;
    }
    let payload = contents.split_off(HEADER);
    (Sha256::digest(&payload).as_slice() == &contents[MAGIC.len()..HEADER]).then_some(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_separate_their_parts() {
        assert_ne!(cache_key(&[b"ab", b"c"]), cache_key(&[b"a", b"bc"]));
        assert_eq!(cache_key(&[b"x"]).len(), 64);
    }

    #[test]
    fn builds_once_then_hits_and_rebuilds_what_is_damaged() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ArtifactCache::new(dir.path(), "bin");
        let build = |n: u8| move || Ok((n, vec![n; 100]));
        let load = |bytes: Vec<u8>| Ok(bytes[0]);
        assert_eq!(cache.load_or_build("k", load, build(1)).unwrap(), (1, CacheOutcome::Built));
        assert_eq!(cache.load_or_build("k", load, build(2)).unwrap(), (1, CacheOutcome::Hit));

        // A flipped byte, a truncation, an empty file: each rebuilt, never loaded.
        let path = cache.path("k");
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[HEADER + 50] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(cache.load_or_build("k", load, build(3)).unwrap(), (3, CacheOutcome::Built));
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        assert_eq!(cache.load_or_build("k", load, build(4)).unwrap(), (4, CacheOutcome::Built));
        std::fs::write(&path, b"").unwrap();
        assert_eq!(cache.load_or_build("k", load, build(5)).unwrap(), (5, CacheOutcome::Built));

        // An entry the runtime refuses is rebuilt too.
        let refuse = |_: Vec<u8>| Err(SeamError::Backend("not mine".into()));
        assert_eq!(cache.load_or_build("k", refuse, build(6)).unwrap(), (6, CacheOutcome::Built));
        // A cache folder that cannot be written is a warning, not a failure.
        let blocked = ArtifactCache::new(dir.path().join("k.bin").join("sub"), "bin");
        assert_eq!(blocked.load_or_build("k", load, build(7)).unwrap(), (7, CacheOutcome::Built));
        let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(leftovers.len(), 1, "no temporary files left: {leftovers:?}");
    }
}
