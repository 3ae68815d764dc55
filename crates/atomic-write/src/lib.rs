//! Outputs that appear whole or not at all.
//!
//! Every file or directory seam writes (a converted model, a download, a cache entry, an export)
//! is built under a temporary name beside its destination and renamed into place when complete,
//! so a reader never sees half of one. A write that fails cleans up after itself; a process
//! killed mid-write (SIGINT, SIGKILL, a power cut) cannot, so temporaries carry the writer's
//! process id, and the next write into the same folder removes those whose process is gone
//! ([`sweep_dead_temporaries`]).
//!
//! Temporary names are `.<destination name>.<pid>-<n>.tmp` (files and directories alike).

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The suffix every temporary name ends with.
const SUFFIX: &str = ".tmp";

/// A temporary name beside `dest`, unique within this process and carrying its id.
pub fn temporary_path(dest: &Path) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let name = dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "output".into());
    parent_of(dest).join(format!(".{name}.{}-{n}{SUFFIX}", std::process::id()))
}

/// The folder `path` is in (`.` for a bare name).
pub fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// The id of the process that made the temporary called `name`, if it is one.
fn writer_pid(name: &str) -> Option<u32> {
    let (_, tail) = name.strip_prefix('.')?.strip_suffix(SUFFIX)?.rsplit_once('.')?;
    // `<pid>-<n>`; older builds wrote `<pid>` alone.
    tail.split('-').next()?.parse().ok()
}

/// Removes from `dir` the temporaries (files or directories) whose writing process no longer
/// runs. Where liveness cannot be told (no `/proc`), nothing is removed. Errors are ignored: a
/// sweep is housekeeping and must never fail the write that triggers it.
pub fn sweep_dead_temporaries(dir: &Path) {
    let proc = Path::new("/proc");
    if !proc.join("self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = writer_pid(&name) else { continue };
        if proc.join(pid.to_string()).exists() {
            continue;
        }
        let path = entry.path();
        let _ = match entry.file_type() {
            Ok(t) if t.is_dir() => std::fs::remove_dir_all(&path),
            _ => std::fs::remove_file(&path),
        };
    }
}

/// Fails with [`io::ErrorKind::InvalidInput`] when `dest` exists and is not a regular file (a
/// directory, a device, a FIFO, a symbolic link): renaming over it would replace a link or a
/// device node rather than write where the user meant, and writing through it could block or
/// clobber something else.
pub fn refuse_non_regular(dest: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(dest) {
        Ok(meta) if !meta.file_type().is_file() => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} exists and is not a regular file; refusing to replace it", dest.display()),
        )),
        _ => Ok(()),
    }
}

/// A file being written beside its destination; [`TempFile::commit`] renames it into place,
/// dropping it uncommitted removes it.
#[derive(Debug)]
pub struct TempFile {
    file: Option<File>,
    path: PathBuf,
    dest: PathBuf,
}

impl TempFile {
    /// Starts a file that will become `dest`, after sweeping the dead temporaries of its folder.
    pub fn create(dest: &Path) -> io::Result<TempFile> {
        refuse_non_regular(dest)?;
        sweep_dead_temporaries(parent_of(dest));
        let path = temporary_path(dest);
        let mut options = OpenOptions::new();
        options.read(true).write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o644);
        }
        let file = options.open(&path)?;
        Ok(TempFile { file: Some(file), path, dest: dest.to_path_buf() })
    }

    /// The open file.
    pub fn file(&mut self) -> &mut File {
        self.file.as_mut().expect("the file is open until commit")
    }

    /// The temporary's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Flushes the file to disk and renames it to its destination (replacing a regular file
    /// there).
    pub fn commit(mut self) -> io::Result<()> {
        let file = self.file.take().expect("the file is open until commit");
        file.sync_all()?;
        drop(file);
        refuse_non_regular(&self.dest)?;
        std::fs::rename(&self.path, &self.dest)?;
        self.path = PathBuf::new();
        Ok(())
    }
}

impl io::Write for TempFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.file().write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file().flush()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.path.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Writes `bytes` to `dest` through a [`TempFile`].
pub fn write(dest: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let mut temp = TempFile::create(dest)?;
    temp.file().write_all(bytes)?;
    temp.commit()
}

/// A directory being filled beside its destination; [`TempDir::commit`] renames it into place,
/// dropping it uncommitted removes it and everything in it.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
    dest: PathBuf,
}

/// What [`TempDir::commit`] does with a destination that already holds something.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Existing {
    /// Only an empty directory may be replaced; anything else is an
    /// [`io::ErrorKind::AlreadyExists`] error.
    Keep,
    /// A directory is replaced, whatever it holds (a file or link is still refused).
    Replace,
}

impl TempDir {
    /// Starts a directory that will become `dest`, after sweeping the dead temporaries of its
    /// folder (which is created if missing). A `dest` that exists and is not a directory is
    /// refused at once, before any work is done.
    pub fn create(dest: &Path) -> io::Result<TempDir> {
        if let Ok(meta) = std::fs::symlink_metadata(dest) {
            if !meta.is_dir() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{} exists and is not a directory; refusing to replace it", dest.display()),
                ));
            }
        }
        let parent = parent_of(dest);
        std::fs::create_dir_all(parent)?;
        sweep_dead_temporaries(parent);
        let path = temporary_path(dest);
        std::fs::create_dir(&path)?;
        Ok(TempDir { path, dest: dest.to_path_buf() })
    }

    /// The temporary directory to write into.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether `dest` holds something [`Existing::Keep`] would refuse to replace.
    pub fn occupied(dest: &Path) -> bool {
        match std::fs::symlink_metadata(dest) {
            Err(_) => false,
            Ok(meta) if meta.is_dir() => std::fs::read_dir(dest).map_or(true, |mut d| d.next().is_some()),
            Ok(_) => true,
        }
    }

    /// Moves the directory into place. A directory already at the destination is first renamed
    /// to a temporary name (so an interruption leaves it to the next sweep, never half-deleted
    /// in place) and removed after the new one is in place.
    pub fn commit(mut self, existing: Existing) -> io::Result<()> {
        let old = match std::fs::symlink_metadata(&self.dest) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(e),
            Ok(meta) if !meta.is_dir() => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{} exists and is not a directory; refusing to replace it", self.dest.display()),
                ))
            }
            Ok(_) if existing == Existing::Keep && Self::occupied(&self.dest) => {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{} exists and is not empty", self.dest.display()),
                ))
            }
            Ok(_) => {
                let aside = temporary_path(&self.dest);
                std::fs::rename(&self.dest, &aside)?;
                Some(aside)
            }
        };
        if let Err(e) = std::fs::rename(&self.path, &self.dest) {
            if let Some(aside) = &old {
                let _ = std::fs::rename(aside, &self.dest);
            }
            return Err(e);
        }
        self.path = PathBuf::new();
        if let Some(aside) = old {
            let _ = std::fs::remove_dir_all(aside);
        }
        Ok(())
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if !self.path.as_os_str().is_empty() {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        names
    }

    #[test]
    fn temporary_names_carry_the_pid_and_are_recognized() {
        let path = temporary_path(Path::new("/x/model.gguf"));
        let name = path.file_name().unwrap().to_str().unwrap();
        assert_eq!(writer_pid(name), Some(std::process::id()));
        assert_ne!(temporary_path(Path::new("a")), temporary_path(Path::new("a")));
        assert_eq!(writer_pid(".x.123.tmp"), Some(123), "the older form");
        assert_eq!(writer_pid("x.123.tmp"), None);
        assert_eq!(writer_pid(".x.abc.tmp"), None);
    }

    #[test]
    fn a_file_appears_only_when_committed() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("out.bin");
        {
            let mut temp = TempFile::create(&dest).unwrap();
            std::io::Write::write_all(temp.file(), b"half").unwrap();
        }
        assert!(names(dir.path()).is_empty(), "dropped uncommitted: nothing left");
        write(&dest, b"whole").unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"whole");
        write(&dest, b"again").unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"again");
        assert_eq!(names(dir.path()), ["out.bin"]);
    }

    #[test]
    fn temporaries_of_dead_processes_are_swept_and_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        // A pid far above any kernel's pid_max is never alive.
        std::fs::write(dir.path().join(".model.4999999-0.tmp"), b"debris").unwrap();
        std::fs::create_dir(dir.path().join(".model.4999998-3.tmp")).unwrap();
        std::fs::write(dir.path().join(".model.4999998-3.tmp/weights"), b"debris").unwrap();
        let live = dir.path().join(format!(".other.{}-0.tmp", std::process::id()));
        std::fs::write(&live, b"in use").unwrap();
        std::fs::write(dir.path().join("user-file.tmp"), b"not ours").unwrap();
        write(&dir.path().join("new"), b"x").unwrap();
        if Path::new("/proc/self").exists() {
            let expected = [live.file_name().unwrap().to_str().unwrap(), "new", "user-file.tmp"];
            assert_eq!(names(dir.path()), expected);
        }
    }

    #[cfg(unix)]
    #[test]
    fn links_devices_and_directories_are_not_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        std::fs::write(&target, b"keep").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        for dest in [link.as_path(), Path::new("/dev/null"), dir.path()] {
            let err = write(dest, b"x").unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{}", dest.display());
        }
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
    }

    #[test]
    fn a_directory_is_committed_whole_and_replaces_only_when_asked() {
        let root = tempfile::tempdir().unwrap();
        let dest = root.path().join("model");
        let fill = |content: &[u8]| {
            let temp = TempDir::create(&dest).unwrap();
            std::fs::write(temp.path().join("config.json"), content).unwrap();
            temp
        };
        {
            let _dropped = fill(b"half");
        }
        assert!(names(root.path()).is_empty(), "dropped uncommitted: nothing left");
        fill(b"one").commit(Existing::Keep).unwrap();
        assert_eq!(std::fs::read(dest.join("config.json")).unwrap(), b"one");
        let err = fill(b"two").commit(Existing::Keep).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(dest.join("config.json")).unwrap(), b"one");
        fill(b"three").commit(Existing::Replace).unwrap();
        assert_eq!(std::fs::read(dest.join("config.json")).unwrap(), b"three");
        assert_eq!(names(root.path()), ["model"]);
        // An empty directory is replaced even under Keep.
        std::fs::remove_dir_all(&dest).unwrap();
        std::fs::create_dir(&dest).unwrap();
        fill(b"four").commit(Existing::Keep).unwrap();
        // A file where the directory should go is refused before any work.
        let file = root.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert_eq!(TempDir::create(&file).unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }
}
