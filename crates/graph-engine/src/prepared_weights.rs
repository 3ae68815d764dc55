//! Weights prepared once, like compiled graphs: laid out as the graphs take them, stored in one
//! file next to the compiled-graph caches, memory-mapped by every later load.
//!
//! Laying the weights out for the graphs (reading the model's files, transposing, stacking,
//! widening, packing) costs seconds for a 1B model and needs the weights in memory twice. A
//! prepared file holds the result: a later load maps it, verifies it, and hands the runtime views
//! of the mapping, which a CPU runtime can use in place (paged in on demand, held once) and a
//! device runtime copies from in one pass.
//!
//! A file is named by a key that hashes the model directory, the weight format and the graphs'
//! argument list (names, shapes, element types, layouts), so every layout a backend asks for has
//! its own file. Its header records the model files it was made from (path, size, modification
//! time), the arguments with their offsets and an XXH3 hash of each one's bytes. A file whose
//! sources changed (stale), whose size is not the header's (truncated), or whose bytes do not
//! hash as recorded (corrupt) is never handed to a runtime: the load prepares it again and
//! replaces it. The bytes are hashed when the file is written and again whenever the file
//! changed on disk since its last verification (`<key>.verified` records its inode, size and
//! change time); a file untouched since is not hashed again. Files are written under a temporary name and renamed into place, so a reader never
//! sees half a file; a temporary left by an interrupted process is removed by the next write.
//!
//! Layout: `SEAMWTS1`, the header's length (u64, little-endian), the header (JSON), zero padding
//! to a page boundary where the data starts, then each argument's bytes at an offset from there
//! aligned to [`ALIGN`] bytes.

use crate::artifact_cache::cache_key;
use llama_model::model_dir::ModelDir;
use memmap2::{Mmap, MmapMut, MmapOptions};
use serde::{Deserialize, Serialize};
use session_api::{Result, SeamError, WeightFormat};
use stablehlo_llama::{ArgDtype, WeightArg};
use std::io::Read;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

const MAGIC: &[u8; 8] = b"SEAMWTS1";
/// Bumped whenever the bytes for the same argument list could differ (a layout function changed).
const FORMAT_VERSION: u32 = 1;
/// Alignment of every argument in the file, and so in the mapping: enough for a runtime to alias
/// the bytes (XLA's CPU client requires its minimum alignment) and for vector loads.
pub const ALIGN: usize = 64;
/// Where the data starts at the earliest: a page, so the header's pages are never touched again.
const PAGE: usize = 4096;
/// How long after its last change a file is trusted to stay as its stamp says (see
/// [`WeightsCache::open`]).
const RACY: std::time::Duration = std::time::Duration::from_secs(2);
/// A header longer than this is not one of ours.
const MAX_HEADER: u64 = 64 << 20;

/// Where a load's prepared weights came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightsOrigin {
    /// A verified file of an earlier load, mapped.
    Reused,
    /// Prepared by this load, written, and mapped.
    Prepared,
    /// Prepared by this load and held in memory: the file could not be written (see the warning).
    InMemory,
}

/// One argument's bytes in the mapping.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedArg {
    pub spec: WeightArg,
    /// Byte range in [`PreparedWeights::memory`], aligned to [`ALIGN`].
    pub range: Range<usize>,
}

/// The mapped bytes: a file or, when none could be written, anonymous memory.
struct Memory(Mmap);

impl AsRef<[u8]> for Memory {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// The weights of one load in the graphs' argument order, as views of one read-only mapping.
/// Cloning shares the mapping, which lives as long as any clone or any [`PreparedWeights::memory`]
/// handle (a runtime that aliases the bytes keeps one).
#[derive(Clone)]
pub struct PreparedWeights {
    memory: Arc<Memory>,
    args: Arc<[PreparedArg]>,
    origin: WeightsOrigin,
    path: Option<PathBuf>,
}

impl std::fmt::Debug for PreparedWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedWeights")
            .field("args", &self.args.len())
            .field("bytes", &self.total_bytes())
            .field("origin", &self.origin)
            .field("path", &self.path)
            .finish()
    }
}

impl PreparedWeights {
    /// The arguments, in the graphs' order.
    pub fn args(&self) -> &[PreparedArg] {
        &self.args
    }

    /// The bytes of `arg` (one of [`PreparedWeights::args`]).
    pub fn bytes(&self, arg: &PreparedArg) -> &[u8] {
        &self.memory.0[arg.range.clone()]
    }

    /// The whole mapping, for a runtime that keeps views of it alive past this value (each
    /// argument is at its [`PreparedArg::range`]).
    pub fn memory(&self) -> Arc<dyn AsRef<[u8]> + Send + Sync> {
        self.memory.clone()
    }

    /// Bytes of all arguments together (padding left out).
    pub fn total_bytes(&self) -> u64 {
        self.args.iter().map(|a| a.range.len() as u64).sum()
    }

    /// Whether the weights came from an earlier load's file, were prepared now, or are in memory.
    pub fn origin(&self) -> WeightsOrigin {
        self.origin
    }

    /// The file mapped, unless the weights are held in memory.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }
}

/// A model file a prepared file was made from, as the header records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SourceFile {
    path: String,
    len: u64,
    modified_ns: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct ArgEntry {
    name: String,
    shape: Vec<usize>,
    dtype: String,
    offset: u64,
    len: u64,
    xxh3: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Header {
    version: u32,
    key: String,
    sources: Vec<SourceFile>,
    args: Vec<ArgEntry>,
    /// Where the data starts in the file (offsets of `args` count from there): a page boundary
    /// after the header.
    data_start: u64,
    /// Bytes of data.
    data_len: u64,
}

/// The first page boundary after a header of `header_len` bytes of JSON.
fn data_start(header_len: usize) -> usize {
    align_up(MAGIC.len() + 8 + header_len, PAGE)
}

fn dtype_name(dtype: ArgDtype) -> String {
    format!("{dtype:?}")
}

fn align_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

/// The folder of prepared-weights files, and the rules for reading and writing them.
#[derive(Debug, Clone)]
pub struct WeightsCache {
    dir: PathBuf,
}

/// Why a prepared file was not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unusable {
    /// There is no file for the key.
    Missing,
    /// The file exists but must be prepared again: stale, truncated, corrupt, or unreadable.
    Rejected(String),
}

impl WeightsCache {
    /// The cache in `dir` (created on the first write).
    pub fn new(dir: impl Into<PathBuf>) -> WeightsCache {
        WeightsCache { dir: dir.into() }
    }

    /// The project's cache, `llama_model::home::prepared_weights_dir()`.
    pub fn project() -> WeightsCache {
        WeightsCache::new(llama_model::home::prepared_weights_dir())
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of `key`.
    pub fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.weights"))
    }

    /// The key of `model`'s weights in `format` laid out as `args`.
    pub fn key(model: &ModelDir, format: WeightFormat, args: &[WeightArg]) -> String {
        let dir = std::fs::canonicalize(model.path()).unwrap_or_else(|_| model.path().to_path_buf());
        let layout = format!("{args:?}");
        cache_key(&[
            &FORMAT_VERSION.to_le_bytes(),
            dir.to_string_lossy().as_bytes(),
            format!("{format:?}").as_bytes(),
            layout.as_bytes(),
        ])
    }

    /// The prepared weights of `key`, if its file exists, was made from `sources` as they are
    /// now, and holds exactly `expected` with every argument's bytes hashing as recorded.
    pub fn open(
        &self,
        key: &str,
        sources: &[PathBuf],
        expected: &[WeightArg],
    ) -> std::result::Result<PreparedWeights, Unusable> {
        let path = self.path(key);
        // Debris of interrupted writers goes even when this load writes nothing.
        atomic_write::sweep_dead_temporaries(&self.dir);
        let mut file = match std::fs::File::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Unusable::Missing),
            Err(e) => return Err(Unusable::Rejected(format!("cannot open it: {e}"))),
        };
        let rejected = |why: String| Unusable::Rejected(why);
        let (header, header_len) = read_header(&mut file).map_err(rejected)?;
        let start = header.data_start as usize;
        if !start.is_multiple_of(PAGE) || start < data_start(header_len) {
            return Err(rejected(format!("its data starts at {start}, inside its header")));
        }
        if header.version != FORMAT_VERSION || header.key != key {
            return Err(rejected(format!(
                "written for another layout (format {}, key {})",
                header.version, header.key
            )));
        }
        let now = fingerprint(sources).map_err(rejected)?;
        if header.sources != now {
            return Err(rejected("the model's files changed since it was prepared".into()));
        }
        let meta = file.metadata().map_err(|e| rejected(e.to_string()))?;
        let len = meta.len();
        let want = start as u64 + header.data_len;
        if len != want {
            return Err(rejected(format!("{len} bytes where its header says {want} (truncated or extended)")));
        }
        let args = check_entries(&header, expected, start).map_err(rejected)?;
        // SAFETY: the file is only ever replaced by renaming a new file over it, never written in
        // place, so the mapped pages do not change under the mapping.
        let map =
            unsafe { MmapOptions::new().populate().map(&file) }.map_err(|e| rejected(format!("cannot map it: {e}")))?;
        // Hashing every byte is the one part of a warm load that grows with the model: done when
        // the file is new to this cache or was written since it was last verified (its stamp).
        let stamp = Stamp::of(key, &meta);
        if self.read_stamp(key).as_ref() != Some(&stamp) {
            let hashes: Vec<u64> = header.args.iter().map(|a| a.xxh3).collect();
            if let Some(i) = first_mismatch(&map, &args, &hashes) {
                return Err(rejected(format!("the bytes of {} do not hash as recorded (corrupt)", args[i].spec.name)));
            }
            self.write_stamp(key, &stamp);
        }
        Ok(PreparedWeights {
            memory: Arc::new(Memory(map)),
            args: args.into(),
            origin: WeightsOrigin::Reused,
            path: Some(path),
        })
    }

    /// Prepares the weights of `key`, laid out as `specs`, with `fill` (which writes every byte
    /// of every argument through the [`WeightsWriter`] it is given), straight into a new file of
    /// the cache, and returns them mapped from it. `sources` are the model files they were made
    /// from. When no file can be written (a read-only or full disk) the weights are held in
    /// anonymous memory instead, with a warning: the load goes on, and the next one prepares them
    /// again. An error from `fill`, or an argument it left incomplete, leaves no file behind.
    pub fn store(
        &self,
        key: &str,
        sources: &[PathBuf],
        specs: &[WeightArg],
        fill: impl FnOnce(&mut WeightsWriter<'_>) -> Result<()>,
    ) -> Result<PreparedWeights> {
        let layout = layout(specs);
        let sources = fingerprint(sources).map_err(SeamError::Backend)?;
        let mut header = Header {
            version: FORMAT_VERSION,
            key: key.to_string(),
            sources,
            args: layout
                .args
                .iter()
                .map(|placed| ArgEntry {
                    name: placed.spec.name.clone(),
                    shape: placed.spec.shape.clone(),
                    dtype: dtype_name(placed.spec.dtype),
                    offset: placed.range.start as u64,
                    len: placed.range.len() as u64,
                    // The longest a hash can print: the header written at the end is no longer.
                    xxh3: u64::MAX,
                })
                .collect(),
            data_start: 0,
            data_len: layout.data_len as u64,
        };
        let bound = serde_json::to_vec(&header).map_err(|e| SeamError::Backend(e.to_string()))?.len();
        let start = data_start(bound);
        header.data_start = start as u64;

        let path = self.path(key);
        let temp = atomic_write::temporary_path(&self.dir.join(format!("{key}.weights")));
        let total = start + layout.data_len;
        let target = match self.create(&temp) {
            Ok(file) => Target::File(file),
            Err(e) => Target::Memory(self.in_memory(total, &e)?),
        };
        let args = layout.placed(start);
        let mut writer = WeightsWriter {
            target,
            temp: temp.clone(),
            total,
            cache: self,
            args: &args,
            hashers: args.iter().map(|_| xxhash_rust::xxh3::Xxh3Default::new()).collect(),
            written: vec![0; args.len()],
        };
        let filled = fill(&mut writer).and_then(|()| writer.finish());
        if let Err(e) = filled {
            if let Target::File(_) = writer.target {
                let _ = std::fs::remove_file(&temp);
            }
            return Err(e);
        }
        for (entry, hasher) in header.args.iter_mut().zip(&writer.hashers) {
            entry.xxh3 = hasher.digest();
        }
        let json = serde_json::to_vec(&header).map_err(|e| SeamError::Backend(e.to_string()))?;
        let mut head = Vec::with_capacity(MAGIC.len() + 8 + json.len());
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&(json.len() as u64).to_le_bytes());
        head.extend_from_slice(&json);

        let memory = match writer.target {
            Target::File(file) => {
                // Written, extended to its full length (trailing padding), renamed, then mapped.
                let stored = (|| {
                    file.write_all_at(&head, 0)?;
                    file.set_len(total as u64)?;
                    drop(file);
                    std::fs::rename(&temp, &path)?;
                    let file = std::fs::File::open(&path)?;
                    // SAFETY: as in `open`: the file is replaced by rename only, never in place.
                    unsafe { MmapOptions::new().populate().map(&file) }
                })();
                match stored {
                    Ok(map) => return Ok(self.prepared(map, args, WeightsOrigin::Prepared, Some(path))),
                    Err(e) => {
                        let _ = std::fs::remove_file(&temp);
                        return Err(SeamError::Io { path, source: e });
                    }
                }
            }
            Target::Memory(mut memory) => {
                memory[..head.len()].copy_from_slice(&head);
                memory
            }
        };
        let map = memory
            .make_read_only()
            .map_err(|e| SeamError::Backend(format!("could not protect the weights' memory: {e}")))?;
        Ok(self.prepared(map, args, WeightsOrigin::InMemory, None))
    }

    fn prepared(
        &self,
        map: Mmap,
        args: Vec<PreparedArg>,
        origin: WeightsOrigin,
        path: Option<PathBuf>,
    ) -> PreparedWeights {
        PreparedWeights { memory: Arc::new(Memory(map)), args: args.into(), origin, path }
    }

    /// Anonymous memory of `len` bytes for weights that could not be stored (`why`).
    fn in_memory(&self, len: usize, why: &std::io::Error) -> Result<MmapMut> {
        eprintln!(
            "warning: could not store prepared weights in {} ({why}); holding them in memory, the next load prepares them again",
            self.dir.display()
        );
        MmapMut::map_anon(len)
            .map_err(|e| SeamError::Backend(format!("could not allocate memory for the weights: {e}")))
    }

    /// The file recording which version of `key`'s file was last verified.
    fn stamp_path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.verified"))
    }

    fn read_stamp(&self, key: &str) -> Option<Stamp> {
        serde_json::from_slice(&std::fs::read(self.stamp_path(key)).ok()?).ok()
    }

    /// Records `stamp` (temporary file, then rename); a failure only costs the next load a hash.
    /// A file changed less than [`RACY`] ago is not stamped: file times tick coarsely, and a
    /// write in the same tick as the verification would leave the stamp unchanged.
    fn write_stamp(&self, key: &str, stamp: &Stamp) {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let changed =
            std::time::Duration::new(stamp.changed_s.max(0) as u64, stamp.changed_ns.clamp(0, 999_999_999) as u32);
        if now.saturating_sub(changed) < RACY {
            return;
        }
        let temp = atomic_write::temporary_path(&self.stamp_path(key));
        let Ok(json) = serde_json::to_vec(stamp) else { return };
        if std::fs::write(&temp, json).and_then(|()| std::fs::rename(&temp, self.stamp_path(key))).is_err() {
            let _ = std::fs::remove_file(&temp);
        }
    }

    /// A new temporary file in the cache's folder, after removing those of dead processes.
    fn create(&self, temp: &Path) -> std::io::Result<std::fs::File> {
        std::fs::create_dir_all(&self.dir)?;
        atomic_write::sweep_dead_temporaries(&self.dir);
        self.remove_orphans();
        std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(temp)
    }

    /// Removes the prepared files (and their stamps) of models that are gone: a file one of whose
    /// recorded sources no longer exists can never be used again (a deleted model, a temporary
    /// one). Files of models still present stay, whatever their layout.
    fn remove_orphans(&self) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "weights") {
                continue;
            }
            let Ok(mut file) = std::fs::File::open(&path) else { continue };
            let Ok((header, _)) = read_header(&mut file) else { continue };
            if header.sources.iter().any(|s| !Path::new(&s.path).exists()) {
                let _ = std::fs::remove_file(&path);
                let _ = std::fs::remove_file(self.stamp_path(&header.key));
            }
        }
    }
}

/// One version of a prepared file as the file system knows it: a replacement changes the inode,
/// any write through the file system the change time (which no user call can set back), so a
/// file whose stamp is unchanged since its bytes were hashed holds the same bytes. Damage that
/// bypasses the file system (a failing disk) is the storage's to detect.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Stamp {
    key: String,
    device: u64,
    inode: u64,
    len: u64,
    changed_s: i64,
    changed_ns: i64,
}

impl Stamp {
    fn of(key: &str, meta: &std::fs::Metadata) -> Stamp {
        use std::os::unix::fs::MetadataExt;
        Stamp {
            key: key.to_string(),
            device: meta.dev(),
            inode: meta.ino(),
            len: meta.size(),
            changed_s: meta.ctime(),
            changed_ns: meta.ctime_nsec(),
        }
    }
}

/// Where prepared weights are written: a file of the cache, or memory when none can be made.
enum Target {
    File(std::fs::File),
    Memory(MmapMut),
}

/// Where [`WeightsCache::store`]'s `fill` writes the prepared arguments.
pub struct WeightsWriter<'a> {
    target: Target,
    /// The file being written, and its full length.
    temp: PathBuf,
    total: usize,
    cache: &'a WeightsCache,
    args: &'a [PreparedArg],
    hashers: Vec<xxhash_rust::xxh3::Xxh3Default>,
    written: Vec<usize>,
}

impl WeightsWriter<'_> {
    /// Writes `bytes` at `offset` of argument `index` (in the order of the specs given to
    /// [`WeightsCache::store`]). The pieces of one argument come in order, each starting where
    /// the last ended (they are hashed as they come).
    pub fn write(&mut self, index: usize, offset: usize, bytes: &[u8]) -> Result<()> {
        let arg = self.args.get(index).ok_or_else(|| SeamError::Backend(format!("no weight argument {index}")))?;
        if offset != self.written[index] || offset + bytes.len() > arg.range.len() {
            return Err(SeamError::Backend(format!(
                "{} bytes at {offset} of {} ({} bytes, {} written)",
                bytes.len(),
                arg.spec.name,
                arg.range.len(),
                self.written[index]
            )));
        }
        let at = arg.range.start + offset;
        if let Target::File(file) = &self.target {
            if let Err(e) = file.write_all_at(bytes, at as u64) {
                self.move_to_memory(&e)?;
            }
        }
        if let Target::Memory(memory) = &mut self.target {
            memory[at..at + bytes.len()].copy_from_slice(bytes);
        }
        self.hashers[index].update(bytes);
        self.written[index] += bytes.len();
        Ok(())
    }

    /// After a failed write to the file (`why`: a full disk, say), carries on in memory: what
    /// was written so far is read back and the file removed.
    fn move_to_memory(&mut self, why: &std::io::Error) -> Result<()> {
        let mut memory = self.cache.in_memory(self.total, why)?;
        if let Target::File(file) = &self.target {
            for (arg, &written) in self.args.iter().zip(&self.written) {
                let range = arg.range.start..arg.range.start + written;
                file.read_exact_at(&mut memory[range], arg.range.start as u64)
                    .map_err(|e| SeamError::Io { path: self.temp.clone(), source: e })?;
            }
        }
        let _ = std::fs::remove_file(&self.temp);
        self.target = Target::Memory(memory);
        Ok(())
    }

    /// Checks that every argument got as many bytes as it holds.
    fn finish(&self) -> Result<()> {
        for (arg, &written) in self.args.iter().zip(&self.written) {
            if written != arg.range.len() {
                return Err(SeamError::Backend(format!(
                    "{} of the {} bytes of {} were prepared",
                    written,
                    arg.range.len(),
                    arg.spec.name
                )));
            }
        }
        Ok(())
    }
}

/// Where each argument goes, counted from the start of the data, and the data's length.
struct Layout {
    args: Vec<PreparedArg>,
    data_len: usize,
}

impl Layout {
    /// The arguments placed in a file whose data starts at `start`.
    fn placed(self, start: usize) -> Vec<PreparedArg> {
        self.args
            .into_iter()
            .map(|a| PreparedArg { range: start + a.range.start..start + a.range.end, spec: a.spec })
            .collect()
    }
}

fn layout(specs: &[WeightArg]) -> Layout {
    let mut at = 0;
    let mut placed = Vec::with_capacity(specs.len());
    for spec in specs {
        let start = align_up(at, ALIGN);
        let len = spec.shape.iter().product::<usize>() * spec.dtype.size();
        placed.push(PreparedArg { spec: spec.clone(), range: start..start + len });
        at = start + len;
    }
    Layout { args: placed, data_len: at }
}

fn read_header(file: &mut std::fs::File) -> std::result::Result<(Header, usize), String> {
    let mut start = [0u8; 16];
    file.read_exact(&mut start).map_err(|e| format!("cannot read its header: {e}"))?;
    if &start[..8] != MAGIC {
        return Err("not a prepared-weights file".into());
    }
    let len = u64::from_le_bytes(start[8..].try_into().unwrap_or_default());
    if len > MAX_HEADER {
        return Err(format!("a header of {len} bytes"));
    }
    let mut json = vec![0u8; len as usize];
    file.read_exact(&mut json).map_err(|e| format!("cannot read its header: {e}"))?;
    let header = serde_json::from_slice(&json).map_err(|e| format!("malformed header: {e}"))?;
    Ok((header, json.len()))
}

/// The header's arguments as views, if they are exactly `expected`, aligned and inside the file.
fn check_entries(
    header: &Header,
    expected: &[WeightArg],
    start: usize,
) -> std::result::Result<Vec<PreparedArg>, String> {
    if header.args.len() != expected.len() {
        return Err(format!("{} arguments where the graphs take {}", header.args.len(), expected.len()));
    }
    let mut out = Vec::with_capacity(expected.len());
    for (entry, spec) in header.args.iter().zip(expected) {
        let want = spec.shape.iter().product::<usize>() * spec.dtype.size();
        let same = entry.name == spec.name && entry.shape == spec.shape && entry.dtype == dtype_name(spec.dtype);
        let end = entry.offset.checked_add(entry.len);
        if !same
            || entry.len != want as u64
            || end.is_none_or(|end| end > header.data_len)
            || !(entry.offset as usize).is_multiple_of(ALIGN)
        {
            return Err(format!("argument {} does not match the graphs' {}", entry.name, spec.name));
        }
        let offset = start + entry.offset as usize;
        out.push(PreparedArg { spec: spec.clone(), range: offset..offset + entry.len as usize });
    }
    Ok(out)
}

/// Path, size and modification time of each of `sources`.
fn fingerprint(sources: &[PathBuf]) -> std::result::Result<Vec<SourceFile>, String> {
    sources
        .iter()
        .map(|path| {
            let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let modified_ns = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos() as u64);
            // Absolute, so that the same model named from another directory is the same source.
            let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.clone());
            Ok(SourceFile { path: path.to_string_lossy().into_owned(), len: meta.len(), modified_ns })
        })
        .collect()
}

/// XXH3 of each of `parts`, hashed on every core (largest first, so the cores finish together).
fn hash_all(parts: Vec<&[u8]>) -> Vec<u64> {
    let mut order: Vec<usize> = (0..parts.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(parts[i].len()));
    let hashes: Vec<std::sync::atomic::AtomicU64> = parts.iter().map(|_| Default::default()).collect();
    let next = AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(parts.len().max(1));
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                while let Some(&i) = order.get(next.fetch_add(1, Ordering::Relaxed)) {
                    hashes[i].store(xxhash_rust::xxh3::xxh3_64(parts[i]), Ordering::Relaxed);
                }
            });
        }
    });
    hashes.into_iter().map(|h| h.into_inner()).collect()
}

/// The first argument whose bytes in `map` do not hash to `hashes`.
fn first_mismatch(map: &[u8], args: &[PreparedArg], hashes: &[u64]) -> Option<usize> {
    let actual = hash_all(args.iter().map(|a| &map[a.range.clone()]).collect());
    actual.iter().zip(hashes).position(|(a, b)| a != b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use stablehlo_llama::{HostArg, WeightPart};

    fn arg(name: &str, values: &[f32]) -> HostArg {
        HostArg {
            spec: WeightArg {
                name: name.into(),
                shape: vec![values.len()],
                dtype: ArgDtype::F32,
                part: WeightPart::Norm,
            },
            bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    struct Fixture {
        _dir: tempfile::TempDir,
        cache: WeightsCache,
        sources: Vec<PathBuf>,
        args: Vec<HostArg>,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("model.safetensors");
        std::fs::write(&source, b"the model").unwrap();
        let args = vec![arg("a", &[1.0, 2.0, 3.0]), arg("b", &[4.0; 100]), arg("c", &[])];
        Fixture { cache: WeightsCache::new(dir.path().join("weights")), sources: vec![source], args, _dir: dir }
    }

    fn specs(args: &[HostArg]) -> Vec<WeightArg> {
        args.iter().map(|a| a.spec.clone()).collect()
    }

    /// `args` stored whole, one write each.
    fn store(cache: &WeightsCache, key: &str, sources: &[PathBuf], args: &[HostArg]) -> Result<PreparedWeights> {
        cache.store(key, sources, &specs(args), |writer| {
            for (i, arg) in args.iter().enumerate() {
                writer.write(i, 0, &arg.bytes)?;
            }
            Ok(())
        })
    }

    fn assert_holds(prepared: &PreparedWeights, args: &[HostArg]) {
        assert_eq!(prepared.args().len(), args.len());
        for (placed, arg) in prepared.args().iter().zip(args) {
            assert_eq!(placed.spec, arg.spec);
            assert_eq!(prepared.bytes(placed), arg.bytes.as_slice());
            let address = prepared.memory().as_ref().as_ref()[placed.range.clone()].as_ptr() as usize;
            assert_eq!(address % ALIGN, 0, "{} is aligned", placed.spec.name);
        }
    }

    #[test]
    fn stored_weights_are_reused_by_the_next_open() {
        let f = fixture();
        assert_eq!(f.cache.open("k", &f.sources, &specs(&f.args)).unwrap_err(), Unusable::Missing);
        let stored = store(&f.cache, "k", &f.sources, &f.args).unwrap();
        assert_eq!(stored.origin(), WeightsOrigin::Prepared);
        assert_holds(&stored, &f.args);
        assert_eq!(stored.total_bytes(), 412);
        let reused = f.cache.open("k", &f.sources, &specs(&f.args)).unwrap();
        assert_eq!(reused.origin(), WeightsOrigin::Reused);
        assert_holds(&reused, &f.args);
        let names: Vec<_> = std::fs::read_dir(f.cache.dir()).unwrap().map(|e| e.unwrap().file_name()).collect();
        // Changed too recently to be stamped: the next open hashes it again.
        assert_eq!(names, vec![std::ffi::OsString::from("k.weights")], "the file alone, no temporaries");
    }

    #[test]
    fn a_file_verified_once_is_trusted_until_it_changes() {
        let f = fixture();
        let expected = specs(&f.args);
        store(&f.cache, "k", &f.sources, &f.args).unwrap();
        std::thread::sleep(RACY + std::time::Duration::from_millis(100));
        f.cache.open("k", &f.sources, &expected).unwrap();
        let stamp = f.cache.dir().join("k.verified");
        assert!(stamp.is_file(), "verified and old enough: stamped");
        // A byte flipped in place changes the file's change time: hashed again, and rejected.
        let mut bytes = std::fs::read(f.cache.path("k")).unwrap();
        let at = f.cache.open("k", &f.sources, &expected).unwrap().args()[1].range.start;
        bytes[at] ^= 1;
        std::fs::write(f.cache.path("k"), &bytes).unwrap();
        assert!(
            matches!(f.cache.open("k", &f.sources, &expected), Err(Unusable::Rejected(why)) if why.contains("corrupt"))
        );
    }

    #[test]
    fn stale_truncated_corrupt_or_foreign_files_are_rejected() {
        let f = fixture();
        let expected = specs(&f.args);
        store(&f.cache, "k", &f.sources, &f.args).unwrap();
        let path = f.cache.path("k");
        let rejected = |cache: &WeightsCache, key: &str, sources: &[PathBuf], expected: &[WeightArg]| match cache
            .open(key, sources, expected)
        {
            Err(Unusable::Rejected(why)) => why,
            other => panic!("expected a rejection, got {other:?}"),
        };

        // Another key (another layout) in this key's file.
        std::fs::copy(&path, f.cache.path("other")).unwrap();
        assert!(rejected(&f.cache, "other", &f.sources, &expected).contains("another layout"));

        // Other arguments than the graphs take.
        let mut fewer = expected.clone();
        fewer.pop();
        assert!(rejected(&f.cache, "k", &f.sources, &fewer).contains("arguments"));
        let mut renamed = expected.clone();
        renamed[1].name = "z".into();
        assert!(rejected(&f.cache, "k", &f.sources, &renamed).contains("does not match"));

        // A flipped byte in an argument.
        let good = std::fs::read(&path).unwrap();
        let mut bad = good.clone();
        let b = f.cache.open("k", &f.sources, &expected).unwrap().args()[1].range.start;
        bad[b + 5] ^= 1;
        std::fs::write(&path, &bad).unwrap();
        assert!(rejected(&f.cache, "k", &f.sources, &expected).contains("corrupt"));

        // Cut short, or not ours at all.
        std::fs::write(&path, &good[..good.len() - 1]).unwrap();
        assert!(rejected(&f.cache, "k", &f.sources, &expected).contains("truncated"));
        std::fs::write(&path, &good[..10]).unwrap();
        assert!(rejected(&f.cache, "k", &f.sources, &expected).contains("cannot read its header"));
        std::fs::write(&path, b"GGUF and then some more bytes").unwrap();
        assert!(rejected(&f.cache, "k", &f.sources, &expected).contains("not a prepared-weights file"));

        // The model file changed after the weights were prepared.
        std::fs::write(&path, &good).unwrap();
        assert!(f.cache.open("k", &f.sources, &expected).is_ok());
        std::fs::write(&f.sources[0], b"the model, retrained").unwrap();
        assert!(rejected(&f.cache, "k", &f.sources, &expected).contains("changed"));
        // A source that is gone.
        std::fs::remove_file(&f.sources[0]).unwrap();
        assert!(rejected(&f.cache, "k", &f.sources, &expected).contains("model.safetensors"));
    }

    #[test]
    fn an_incomplete_or_failed_preparation_leaves_nothing() {
        let f = fixture();
        let expected = specs(&f.args);
        let half = f.cache.store("k", &f.sources, &expected, |writer| {
            writer.write(0, 0, &f.args[0].bytes)?;
            writer.write(1, 0, &f.args[1].bytes[..200])
        });
        assert!(half.unwrap_err().to_string().contains("200 of the 400 bytes of b"));
        let past = f.cache.store("k", &f.sources, &expected, |writer| writer.write(0, 8, &f.args[0].bytes));
        assert!(past.unwrap_err().to_string().contains("12 bytes at 8 of a (12 bytes, 0 written)"));
        let twice = f.cache.store("k", &f.sources, &expected, |writer| {
            writer.write(0, 0, &f.args[0].bytes)?;
            writer.write(0, 0, &f.args[0].bytes)
        });
        assert!(twice.unwrap_err().to_string().contains("12 written)"));
        let failed = f.cache.store("k", &f.sources, &expected, |_| Err(SeamError::Backend("the model is bad".into())));
        assert!(failed.unwrap_err().to_string().contains("the model is bad"));
        let left: Vec<_> = std::fs::read_dir(f.cache.dir()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(left.is_empty(), "nothing left behind: {left:?}");
        assert_eq!(f.cache.open("k", &f.sources, &expected).unwrap_err(), Unusable::Missing);
    }

    #[test]
    fn files_of_models_that_are_gone_are_removed_by_the_next_write() {
        let f = fixture();
        let gone = f._dir.path().join("gone.safetensors");
        std::fs::write(&gone, b"a model deleted later").unwrap();
        store(&f.cache, "old", std::slice::from_ref(&gone), &f.args).unwrap();
        store(&f.cache, "kept", &f.sources, &f.args).unwrap();
        std::fs::remove_file(&gone).unwrap();
        store(&f.cache, "new", &f.sources, &f.args).unwrap();
        assert!(!f.cache.path("old").exists(), "its model is gone");
        assert!(f.cache.path("kept").exists() && f.cache.path("new").exists());
    }

    #[test]
    fn an_unwritable_folder_holds_the_weights_in_memory() {
        let f = fixture();
        // A file where the folder should be: nothing can be created below it.
        std::fs::write(f.cache.dir(), b"in the way").unwrap();
        let prepared = store(&f.cache, "k", &f.sources, &f.args).unwrap();
        assert_eq!(prepared.origin(), WeightsOrigin::InMemory);
        assert_eq!(prepared.path(), None);
        assert_holds(&prepared, &f.args);
    }

    #[test]
    fn a_temporary_of_a_dead_process_is_removed_by_the_next_write() {
        let f = fixture();
        std::fs::create_dir_all(f.cache.dir()).unwrap();
        // No process has this id (above the kernel's maximum pid).
        let leftover = f.cache.dir().join(".k.weights.4194305.tmp");
        std::fs::write(&leftover, b"half a file").unwrap();
        let mine = f.cache.dir().join(format!(".x.weights.{}.tmp", std::process::id()));
        std::fs::write(&mine, b"being written").unwrap();
        store(&f.cache, "k", &f.sources, &f.args).unwrap();
        assert!(!leftover.exists(), "a dead process's temporary is removed");
        assert!(mine.exists(), "a live process's temporary is left alone");
    }
}
