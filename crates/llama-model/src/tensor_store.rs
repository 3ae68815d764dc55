//! Memory-mapped safetensors files (one file or a sharded checkpoint), and an atomic writer.
//!
//! Reading: [`TensorStore::open`] maps `model.safetensors`, or every shard named by
//! `model.safetensors.index.json`, and parses the headers with the `safetensors` crate, which
//! checks that the offsets are consistent and cover the file exactly; a truncated or corrupt file is
//! a typed [`ModelError`], never a panic. Tensors are converted on read (f32 / f16 / bf16 → f32 or
//! f16), so a checkpoint published in any of these types loads the same way.
//!
//! Writing: [`write_safetensors`] writes a temporary file beside the target and renames it into
//! place, so a reader (or a crash) never sees half a file.

use crate::error::ModelError;
use crate::model_dir::{SAFETENSORS_FILE, SAFETENSORS_INDEX_FILE};
use half::{bf16, f16, slice::HalfFloatSliceExt};
use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::SafeTensorError;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

pub use safetensors::Dtype;

// Tensor bytes are little-endian on disk and are reinterpreted in place on write.
const _: () = assert!(cfg!(target_endian = "little"), "seam assumes a little-endian host");

/// Tensors at least this large are converted on several threads.
const PARALLEL_ELEMENTS: usize = 1 << 20;

/// Where one tensor lives: which mapped file, and which bytes of it.
#[derive(Debug, Clone)]
struct TensorEntry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range within the mapped file (header included in the offset).
    start: usize,
    end: usize,
}

/// One mapped safetensors file.
#[derive(Debug)]
struct MappedFile {
    path: PathBuf,
    map: Mmap,
}

/// The tensors of one safetensors file or one sharded checkpoint, memory-mapped.
#[derive(Debug)]
pub struct TensorStore {
    files: Vec<MappedFile>,
    tensors: HashMap<String, TensorEntry>,
    metadata: BTreeMap<String, String>,
}

impl TensorStore {
    /// Opens a model directory's weights: `model.safetensors`, or else the shards listed in
    /// `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<TensorStore, ModelError> {
        if !dir.exists() {
            return Err(ModelError::MissingFile { path: dir.to_path_buf() });
        }
        let single = dir.join(SAFETENSORS_FILE);
        if single.is_file() {
            return TensorStore::open_file(&single);
        }
        let index = dir.join(SAFETENSORS_INDEX_FILE);
        if index.is_file() {
            return TensorStore::open_index(&index);
        }
        Err(ModelError::MissingFile { path: single })
    }

    /// Opens one safetensors file.
    pub fn open_file(path: &Path) -> Result<TensorStore, ModelError> {
        let mut store = TensorStore { files: Vec::new(), tensors: HashMap::new(), metadata: BTreeMap::new() };
        store.add_file(path)?;
        Ok(store)
    }

    /// Opens a sharded checkpoint from its index (`{"weight_map": {tensor: shard file}}`). Every
    /// shard is opened; every tensor the index names must be in the shard it names.
    pub fn open_index(index_path: &Path) -> Result<TensorStore, ModelError> {
        let text = std::fs::read_to_string(index_path).map_err(|e| ModelError::from_io(index_path, e))?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::Json { path: Some(index_path.to_path_buf()), message: e.to_string() })?;
        let weight_map = value.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| ModelError::Config {
            path: Some(index_path.to_path_buf()),
            message: "no \"weight_map\" object".to_string(),
        })?;
        let dir = index_path.parent().unwrap_or_else(|| Path::new("."));
        let mut shard_names: Vec<&str> = Vec::new();
        let mut expected: Vec<(&str, &str)> = Vec::new();
        for (tensor, shard) in weight_map {
            let shard = shard.as_str().ok_or_else(|| ModelError::Config {
                path: Some(index_path.to_path_buf()),
                message: format!("weight_map entry for '{tensor}' is not a file name"),
            })?;
            // A shard name with a directory part could point outside the model directory.
            if shard.contains('/') || shard.contains('\\') || shard == ".." || shard.is_empty() {
                return Err(ModelError::Config {
                    path: Some(index_path.to_path_buf()),
                    message: format!("weight_map names shard '{shard}', which is not a plain file name"),
                });
            }
            if !shard_names.contains(&shard) {
                shard_names.push(shard);
            }
            expected.push((tensor, shard));
        }
        shard_names.sort_unstable();
        let mut store = TensorStore { files: Vec::new(), tensors: HashMap::new(), metadata: BTreeMap::new() };
        for shard in &shard_names {
            store.add_file(&dir.join(shard))?;
        }
        for (tensor, shard) in expected {
            let entry =
                store.tensors.get(tensor).ok_or_else(|| ModelError::MissingTensor { name: tensor.to_string() })?;
            let actual = &store.files[entry.file].path;
            if actual.file_name().and_then(|n| n.to_str()) != Some(shard) {
                return Err(ModelError::Corrupt {
                    path: index_path.to_path_buf(),
                    message: format!("the index puts '{tensor}' in {shard}, but it is in {}", actual.display()),
                });
            }
        }
        Ok(store)
    }

    fn add_file(&mut self, path: &Path) -> Result<(), ModelError> {
        let file = File::open(path).map_err(|e| ModelError::from_io(path, e))?;
        let len = file.metadata().map_err(|e| ModelError::io(path, e))?.len();
        if len < 8 {
            return Err(ModelError::Truncated {
                path: path.to_path_buf(),
                message: format!("{len} bytes, shorter than the 8-byte header length"),
            });
        }
        // SAFETY: the map is read-only. seam never writes model files in place (writers rename a new
        // file over the old one), so the mapped bytes do not change under us unless another program
        // truncates the file, which is the usual caveat of memory-mapped model loading.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        let (header_len, metadata) =
            safetensors::SafeTensors::read_metadata(&map).map_err(|e| safetensors_error(path, e))?;
        let data_start = 8 + header_len;
        let file_index = self.files.len();
        for (name, info) in metadata.tensors() {
            let (start, end) = info.data_offsets;
            let entry = TensorEntry {
                file: file_index,
                dtype: info.dtype,
                shape: info.shape.clone(),
                start: data_start + start,
                end: data_start + end,
            };
            if self.tensors.insert(name.clone(), entry).is_some() {
                return Err(ModelError::Corrupt {
                    path: path.to_path_buf(),
                    message: format!("tensor '{name}' appears in more than one shard"),
                });
            }
        }
        if let Some(meta) = metadata.metadata() {
            for (k, v) in meta {
                self.metadata.insert(k.clone(), v.clone());
            }
        }
        self.files.push(MappedFile { path: path.to_path_buf(), map });
        Ok(())
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.tensors.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// Whether a tensor is present.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The `__metadata__` string map of the file(s) (merged over shards).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// The files this store reads.
    pub fn paths(&self) -> Vec<&Path> {
        self.files.iter().map(|f| f.path.as_path()).collect()
    }

    fn entry(&self, name: &str) -> Result<&TensorEntry, ModelError> {
        self.tensors.get(name).ok_or_else(|| ModelError::MissingTensor { name: name.to_string() })
    }

    /// A tensor's shape.
    pub fn shape(&self, name: &str) -> Result<&[usize], ModelError> {
        Ok(&self.entry(name)?.shape)
    }

    /// A tensor's data type.
    pub fn dtype(&self, name: &str) -> Result<Dtype, ModelError> {
        Ok(self.entry(name)?.dtype)
    }

    /// A tensor's raw little-endian bytes, as stored.
    pub fn bytes(&self, name: &str) -> Result<&[u8], ModelError> {
        let entry = self.entry(name)?;
        Ok(&self.files[entry.file].map[entry.start..entry.end])
    }

    /// The file a tensor is stored in.
    pub fn path_of(&self, name: &str) -> Result<&Path, ModelError> {
        Ok(&self.files[self.entry(name)?.file].path)
    }

    /// A tensor as f32, converted from F32, F16 or BF16.
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let entry = self.entry(name)?;
        let bytes = &self.files[entry.file].map[entry.start..entry.end];
        match entry.dtype {
            Dtype::F32 => Ok(match bytemuck::try_cast_slice::<u8, f32>(bytes) {
                Ok(values) => values.to_vec(),
                Err(_) => convert::<_, 4>(bytes, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            }),
            Dtype::F16 => Ok(match bytemuck::try_cast_slice::<u8, f16>(bytes) {
                Ok(values) => convert_slices(values, |src, dst: &mut [f32]| src.convert_to_f32_slice(dst)),
                Err(_) => convert::<_, 2>(bytes, |b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
            }),
            Dtype::BF16 => Ok(match bytemuck::try_cast_slice::<u8, bf16>(bytes) {
                Ok(values) => convert_slices(values, |src, dst: &mut [f32]| src.convert_to_f32_slice(dst)),
                Err(_) => convert::<_, 2>(bytes, |b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            }),
            other => Err(dtype_error(name, other, "F32, F16 or BF16")),
        }
    }

    /// A tensor as f16, converted from F32, F16 or BF16 (round to nearest even).
    pub fn read_f16(&self, name: &str) -> Result<Vec<f16>, ModelError> {
        let entry = self.entry(name)?;
        let bytes = &self.files[entry.file].map[entry.start..entry.end];
        match entry.dtype {
            Dtype::F32 => Ok(match bytemuck::try_cast_slice::<u8, f32>(bytes) {
                Ok(values) => convert_slices(values, |src, dst: &mut [f16]| dst.convert_from_f32_slice(src)),
                Err(_) => convert::<_, 4>(bytes, |b| f16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
            }),
            Dtype::F16 => Ok(match bytemuck::try_cast_slice::<u8, f16>(bytes) {
                Ok(values) => values.to_vec(),
                Err(_) => convert::<_, 2>(bytes, |b| f16::from_le_bytes([b[0], b[1]])),
            }),
            Dtype::BF16 => Ok(convert::<_, 2>(bytes, |b| f16::from_f32(bf16::from_le_bytes([b[0], b[1]]).to_f32()))),
            other => Err(dtype_error(name, other, "F32, F16 or BF16")),
        }
    }

    /// A U8 tensor's bytes.
    pub fn read_u8(&self, name: &str) -> Result<Vec<u8>, ModelError> {
        let entry = self.entry(name)?;
        match entry.dtype {
            Dtype::U8 => Ok(self.files[entry.file].map[entry.start..entry.end].to_vec()),
            other => Err(dtype_error(name, other, "U8")),
        }
    }

    /// An I8 tensor's values.
    pub fn read_i8(&self, name: &str) -> Result<Vec<i8>, ModelError> {
        let entry = self.entry(name)?;
        match entry.dtype {
            Dtype::I8 => Ok(bytemuck::cast_slice(&self.files[entry.file].map[entry.start..entry.end]).to_vec()),
            other => Err(dtype_error(name, other, "I8")),
        }
    }
}

/// Converts an aligned slice with a vectorized slice conversion (half's F16C path where the CPU
/// has it), in parallel chunks for large tensors.
fn convert_slices<S: Sync, T: Copy + Default + Send>(src: &[S], f: impl Fn(&[S], &mut [T]) + Sync) -> Vec<T> {
    const CHUNK: usize = 1 << 16;
    let mut out = vec![T::default(); src.len()];
    if src.len() >= PARALLEL_ELEMENTS {
        out.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(dst, src)| f(src, dst));
    } else {
        f(src, &mut out);
    }
    out
}

/// Converts little-endian elements of `N` bytes byte-wise, in parallel for large tensors: the
/// fallback for tensors whose offset in the file is not aligned for their type.
fn convert<T: Send, const N: usize>(bytes: &[u8], f: impl Fn(&[u8]) -> T + Sync) -> Vec<T> {
    if bytes.len() / N >= PARALLEL_ELEMENTS {
        bytes.par_chunks_exact(N).map(&f).collect()
    } else {
        bytes.chunks_exact(N).map(&f).collect()
    }
}

fn dtype_error(name: &str, found: Dtype, expected: &str) -> ModelError {
    ModelError::DType { name: name.to_string(), found: format!("{found:?}"), expected: expected.to_string() }
}

/// Maps the safetensors crate's parse errors onto typed model errors.
fn safetensors_error(path: &Path, error: SafeTensorError) -> ModelError {
    let path = path.to_path_buf();
    match error {
        SafeTensorError::MetadataIncompleteBuffer
        | SafeTensorError::InvalidHeaderLength
        | SafeTensorError::HeaderTooSmall => ModelError::Truncated { path, message: error.to_string() },
        SafeTensorError::IoError(source) => ModelError::Io { path, source },
        other => ModelError::Corrupt { path, message: other.to_string() },
    }
}

/// A tensor held in memory, to be written with [`write_safetensors`].
#[derive(Debug, Clone, PartialEq)]
pub enum OwnedTensor {
    F32 { shape: Vec<usize>, data: Vec<f32> },
    F16 { shape: Vec<usize>, data: Vec<f16> },
    U8 { shape: Vec<usize>, data: Vec<u8> },
    I8 { shape: Vec<usize>, data: Vec<i8> },
}

impl OwnedTensor {
    /// The tensor's shape.
    pub fn shape(&self) -> &[usize] {
        match self {
            OwnedTensor::F32 { shape, .. }
            | OwnedTensor::F16 { shape, .. }
            | OwnedTensor::U8 { shape, .. }
            | OwnedTensor::I8 { shape, .. } => shape,
        }
    }

    /// The safetensors dtype it is written as.
    pub fn dtype(&self) -> Dtype {
        match self {
            OwnedTensor::F32 { .. } => Dtype::F32,
            OwnedTensor::F16 { .. } => Dtype::F16,
            OwnedTensor::U8 { .. } => Dtype::U8,
            OwnedTensor::I8 { .. } => Dtype::I8,
        }
    }

    /// The little-endian bytes written to the file.
    pub fn bytes(&self) -> &[u8] {
        match self {
            OwnedTensor::F32 { data, .. } => bytemuck::cast_slice(data),
            OwnedTensor::F16 { data, .. } => bytemuck::cast_slice(data),
            OwnedTensor::U8 { data, .. } => data,
            OwnedTensor::I8 { data, .. } => bytemuck::cast_slice(data),
        }
    }

    /// A view for [`write_safetensors_raw`].
    pub fn as_raw<'a>(&'a self, name: &'a str) -> RawTensor<'a> {
        RawTensor { name, dtype: self.dtype(), shape: self.shape(), bytes: self.bytes() }
    }
}

/// A tensor as bytes of any safetensors dtype, for [`write_safetensors_raw`].
#[derive(Debug, Clone, Copy)]
pub struct RawTensor<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    /// Little-endian element bytes, row-major.
    pub bytes: &'a [u8],
}

/// Writes `tensors` to a safetensors file at `path` with `metadata` as its `__metadata__`.
///
/// The file is written under a temporary name in the same directory and renamed into place, so an
/// interrupted write never leaves a partial `path`, and a reader that has the old file mapped keeps
/// seeing the old bytes.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, OwnedTensor)],
    metadata: &BTreeMap<String, String>,
) -> Result<(), ModelError> {
    let raw: Vec<RawTensor<'_>> = tensors.iter().map(|(name, t)| t.as_raw(name)).collect();
    write_safetensors_raw(path, &raw, metadata)
}

/// [`write_safetensors`] for tensors of any dtype given as bytes.
pub fn write_safetensors_raw(
    path: &Path,
    tensors: &[RawTensor<'_>],
    metadata: &BTreeMap<String, String>,
) -> Result<(), ModelError> {
    // Header: {"__metadata__": {...}, name: {"dtype", "shape", "data_offsets"}, ...}, data laid out
    // in the order given, each tensor's bytes directly after the previous one.
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".to_string(), serde_json::to_value(metadata).expect("string map serializes"));
    }
    let mut offset = 0usize;
    for t in tensors {
        if t.name == "__metadata__" {
            return Err(ModelError::InvalidTensor { name: t.name.to_string(), message: "reserved name".into() });
        }
        let elements = t.shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        let expected = elements.and_then(|n| n.checked_mul(t.dtype.bitsize())).map(|bits| bits.div_ceil(8));
        if expected != Some(t.bytes.len()) {
            return Err(ModelError::InvalidTensor {
                name: t.name.to_string(),
                message: format!(
                    "{} bytes of data for shape {:?} in {:?} (expected {:?})",
                    t.bytes.len(),
                    t.shape,
                    t.dtype,
                    expected
                ),
            });
        }
        let entry = serde_json::json!({
            "dtype": t.dtype,
            "shape": t.shape,
            "data_offsets": [offset, offset + t.bytes.len()],
        });
        if header.insert(t.name.to_string(), entry).is_some() {
            return Err(ModelError::InvalidTensor { name: t.name.to_string(), message: "written twice".into() });
        }
        offset += t.bytes.len();
    }
    let mut header_bytes = serde_json::to_vec(&serde_json::Value::Object(header)).expect("JSON map serializes");
    // The data section starts 8-byte aligned (the safetensors convention; readers may rely on it).
    header_bytes.resize(header_bytes.len().next_multiple_of(8), b' ');

    let io = |e| ModelError::io(path, e);
    let mut temp = atomic_write::TempFile::create(path).map_err(io)?;
    {
        let mut out = std::io::BufWriter::with_capacity(1 << 20, temp.file());
        out.write_all(&(header_bytes.len() as u64).to_le_bytes()).map_err(io)?;
        out.write_all(&header_bytes).map_err(io)?;
        for t in tensors {
            out.write_all(t.bytes).map_err(io)?;
        }
        out.flush().map_err(io)?;
    }
    temp.commit().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> BTreeMap<String, String> {
        BTreeMap::from([("format".to_string(), "test".to_string())])
    }

    fn sample() -> Vec<(String, OwnedTensor)> {
        vec![
            ("a".to_string(), OwnedTensor::F32 { shape: vec![2, 3], data: vec![1.0, -2.0, 3.5, 0.0, 1e-3, 65504.0] }),
            (
                "b".to_string(),
                OwnedTensor::F16 { shape: vec![3], data: vec![f16::from_f32(0.5), f16::ONE, f16::NEG_ONE] },
            ),
            ("c".to_string(), OwnedTensor::U8 { shape: vec![1, 3], data: vec![0, 7, 255] }),
        ]
    }

    #[test]
    fn write_then_read_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        write_safetensors(&path, &sample(), &meta()).unwrap();
        // The reference parser accepts what we wrote.
        let bytes = std::fs::read(&path).unwrap();
        let parsed = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(parsed.len(), 3);

        let store = TensorStore::open(dir.path()).unwrap();
        assert_eq!(store.names(), vec!["a", "b", "c"]);
        assert_eq!(store.shape("a").unwrap(), &[2, 3]);
        assert_eq!(store.dtype("b").unwrap(), Dtype::F16);
        assert_eq!(store.read_f32("a").unwrap(), vec![1.0, -2.0, 3.5, 0.0, 1e-3, 65504.0]);
        assert_eq!(store.read_f32("b").unwrap(), vec![0.5, 1.0, -1.0]);
        assert_eq!(store.read_f16("a").unwrap()[4], f16::from_f32(1e-3));
        assert_eq!(store.read_u8("c").unwrap(), vec![0, 7, 255]);
        assert_eq!(store.metadata().get("format").map(String::as_str), Some("test"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            // Readable like any file created here (not the owner-only mode of temporary files).
            let plain = dir.path().join("plain");
            std::fs::write(&plain, b"").unwrap();
            let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o644;
            assert_eq!(mode(&path), mode(&plain));
            std::fs::remove_file(&plain).unwrap();
        }
        // No temporary file is left behind.
        let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(leftovers.len(), 1);
    }

    #[test]
    fn bf16_is_converted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let values = [bf16::from_f32(1.5), bf16::from_f32(-3.0)];
        let bytes: &[u8] = bytemuck::cast_slice(&values);
        write_safetensors_raw(
            &path,
            &[RawTensor { name: "x", dtype: Dtype::BF16, shape: &[2], bytes }],
            &BTreeMap::new(),
        )
        .unwrap();
        let store = TensorStore::open_file(&path).unwrap();
        assert_eq!(store.read_f32("x").unwrap(), vec![1.5, -3.0]);
        assert_eq!(store.read_f16("x").unwrap(), vec![f16::from_f32(1.5), f16::from_f32(-3.0)]);
    }

    #[test]
    fn wrong_dtype_and_missing_tensor_are_typed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let ints = [1i32, 2, 3];
        write_safetensors_raw(
            &path,
            &[RawTensor { name: "i", dtype: Dtype::I32, shape: &[3], bytes: bytemuck::cast_slice(&ints) }],
            &BTreeMap::new(),
        )
        .unwrap();
        let store = TensorStore::open_file(&path).unwrap();
        assert!(matches!(store.read_f32("i"), Err(ModelError::DType { .. })));
        assert!(matches!(store.read_f16("i"), Err(ModelError::DType { .. })));
        assert!(matches!(store.read_u8("i"), Err(ModelError::DType { .. })));
        assert!(matches!(store.read_f32("nope"), Err(ModelError::MissingTensor { .. })));
    }

    #[test]
    fn truncated_and_garbage_files_are_typed_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        write_safetensors(&path, &sample(), &meta()).unwrap();
        let full = std::fs::read(&path).unwrap();
        // Cut in the data, in the header, and before the header length.
        for cut in [full.len() - 1, 20, 3] {
            std::fs::write(&path, &full[..cut]).unwrap();
            let err = TensorStore::open(dir.path()).unwrap_err();
            assert!(matches!(err, ModelError::Truncated { .. }), "cut at {cut}: {err:?}");
        }
        // A header that is not JSON.
        let mut garbage = 16u64.to_le_bytes().to_vec();
        garbage.extend_from_slice(b"this is not json");
        std::fs::write(&path, &garbage).unwrap();
        let err = TensorStore::open(dir.path()).unwrap_err();
        assert!(matches!(err, ModelError::Corrupt { .. }), "{err:?}");
        // A huge declared header length.
        std::fs::write(&path, u64::MAX.to_le_bytes()).unwrap();
        assert!(TensorStore::open(dir.path()).is_err());
    }

    #[test]
    fn missing_weights_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        match TensorStore::open(dir.path()) {
            Err(ModelError::MissingFile { path }) => assert!(path.ends_with(SAFETENSORS_FILE)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn sharded_checkpoint_opens_all_shards() {
        let dir = tempfile::tempdir().unwrap();
        let tensors = sample();
        write_safetensors(&dir.path().join("model-00001-of-00002.safetensors"), &tensors[..2], &meta()).unwrap();
        write_safetensors(&dir.path().join("model-00002-of-00002.safetensors"), &tensors[2..], &meta()).unwrap();
        let index = serde_json::json!({
            "metadata": {"total_size": 0},
            "weight_map": {
                "a": "model-00001-of-00002.safetensors",
                "b": "model-00001-of-00002.safetensors",
                "c": "model-00002-of-00002.safetensors",
            }
        });
        let index_path = dir.path().join(SAFETENSORS_INDEX_FILE);
        std::fs::write(&index_path, index.to_string()).unwrap();
        let store = TensorStore::open(dir.path()).unwrap();
        assert_eq!(store.names(), vec!["a", "b", "c"]);
        assert_eq!(store.read_u8("c").unwrap(), vec![0, 7, 255]);

        // An index that names a tensor the shards do not hold.
        let bad = serde_json::json!({"weight_map": {"zzz": "model-00001-of-00002.safetensors"}});
        std::fs::write(&index_path, bad.to_string()).unwrap();
        assert!(matches!(TensorStore::open(dir.path()), Err(ModelError::MissingTensor { .. })));
        // An index that escapes the directory.
        let bad = serde_json::json!({"weight_map": {"a": "../x.safetensors"}});
        std::fs::write(&index_path, bad.to_string()).unwrap();
        assert!(matches!(TensorStore::open(dir.path()), Err(ModelError::Config { .. })));
        // A malformed index.
        std::fs::write(&index_path, "{").unwrap();
        assert!(matches!(TensorStore::open(dir.path()), Err(ModelError::Json { .. })));
    }

    #[test]
    fn writer_rejects_inconsistent_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        let bad = vec![("a".to_string(), OwnedTensor::F32 { shape: vec![2, 2], data: vec![1.0; 3] })];
        assert!(matches!(write_safetensors(&path, &bad, &BTreeMap::new()), Err(ModelError::InvalidTensor { .. })));
        assert!(!path.exists());
        let dup = vec![
            ("a".to_string(), OwnedTensor::U8 { shape: vec![1], data: vec![1] }),
            ("a".to_string(), OwnedTensor::U8 { shape: vec![1], data: vec![2] }),
        ];
        assert!(matches!(write_safetensors(&path, &dup, &BTreeMap::new()), Err(ModelError::InvalidTensor { .. })));
    }
}
