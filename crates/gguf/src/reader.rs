//! Reading GGUF files: header, metadata, tensor infos and tensor data, every bound checked.

use crate::error::GgufError;
use crate::ggml_type::GgmlType;
use crate::metadata::{Array, Value, ValueType};
use crate::{blocks, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC};
use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

/// Dimensions a tensor may have (`GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;
/// How deeply arrays may nest before the file is treated as corrupt (the format allows nesting;
/// real files never nest more than once, and unbounded recursion would overflow the stack).
const MAX_ARRAY_DEPTH: u32 = 8;
/// Files smaller than this are read into memory rather than mapped.
const MAP_THRESHOLD: u64 = 1 << 16;

/// One tensor's entry in the file's tensor table.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// The tensor's name (`blk.0.attn_q.weight`, ...).
    pub name: String,
    /// ggml dimensions: `dims[0]` (`ne[0]`) is the innermost, contiguous one. A Hugging Face
    /// weight of shape `[out, in]` has `dims = [in, out]`.
    pub dims: Vec<u64>,
    /// The element type.
    pub ggml_type: GgmlType,
    /// Offset of the data from the start of the file's data section.
    pub offset: u64,
    /// Number of elements (product of `dims`).
    pub n_elements: u64,
    /// Bytes of data.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// The shape in row-major order (outermost first), as numpy / safetensors write it: `dims`
    /// reversed.
    pub fn shape(&self) -> Vec<usize> {
        // Sizes were checked against the file's length at open, so they fit in usize.
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

enum Storage {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// An open GGUF file: parsed metadata and tensor table, tensor data read on demand from a memory
/// map.
///
/// The file is mapped read-only; like every memory-mapped reader it assumes nobody truncates or
/// rewrites the file while it is open.
pub struct GgufFile {
    storage: Storage,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens and parses `path` (memory-mapped).
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io = |source| GgufError::Io { path: path.to_path_buf(), source };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let storage = if len < MAP_THRESHOLD {
            Storage::Owned(std::fs::read(path).map_err(io)?)
        } else {
            // SAFETY: the map is read-only; the documented assumption is that the file is not
            // modified while open (as for every mmap-based model loader).
            Storage::Mapped(unsafe { memmap2::Mmap::map(&file) }.map_err(io)?)
        };
        GgufFile::parse(storage)
    }

    /// Parses a GGUF file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        GgufFile::parse(Storage::Owned(bytes))
    }

    fn parse(storage: Storage) -> Result<GgufFile, GgufError> {
        let buf = storage.bytes();
        let mut cur = Cursor { buf, pos: 0 };
        let magic: [u8; 4] = cur.take(4, "magic")?.try_into().expect("4 bytes");
        if u32::from_le_bytes(magic) != MAGIC {
            return Err(GgufError::BadMagic { found: magic });
        }
        let version = cur.u32("version")?;
        if version != 2 && version != 3 {
            return Err(GgufError::UnsupportedVersion { version });
        }
        let n_tensors = cur.u64("tensor count")?;
        let n_kv = cur.u64("metadata count")?;

        let mut metadata = Vec::new();
        let mut metadata_index = HashMap::new();
        for i in 0..n_kv {
            let key = cur.string(&format!("metadata key {i}"))?;
            let type_id = cur.u32(&format!("type of metadata '{key}'"))?;
            let ty =
                ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType { key: key.clone(), type_id })?;
            let value = cur.value(ty, &key, 0)?;
            if metadata_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::corrupt(format!("metadata key '{key}' appears twice")));
            }
            metadata.push((key, value));
        }

        let alignment = match metadata_index.get(ALIGNMENT_KEY) {
            None => DEFAULT_ALIGNMENT,
            Some(&i) => {
                let a = metadata[i].1.as_u64().filter(|a| a.is_power_of_two()).ok_or_else(|| {
                    GgufError::corrupt(format!("{ALIGNMENT_KEY} is {:?}, expected a power of two", metadata[i].1))
                })?;
                a
            }
        };

        let mut tensors = Vec::new();
        let mut tensor_index = HashMap::new();
        for i in 0..n_tensors {
            let info = cur.tensor_info(i)?;
            if tensor_index.insert(info.name.clone(), tensors.len()).is_some() {
                return Err(GgufError::corrupt(format!("tensor '{}' appears twice", info.name)));
            }
            tensors.push(info);
        }

        let len = buf.len() as u64;
        let data_offset = (cur.pos as u64).next_multiple_of(alignment);
        for t in &tensors {
            if t.offset % alignment != 0 {
                return Err(GgufError::corrupt(format!(
                    "tensor '{}' at offset {} is not aligned to {alignment}",
                    t.name, t.offset
                )));
            }
            let end = data_offset.checked_add(t.offset).and_then(|s| s.checked_add(t.n_bytes));
            if end.is_none_or(|end| end > len) {
                return Err(GgufError::Truncated {
                    what: format!("tensor '{}'", t.name),
                    offset: data_offset.saturating_add(t.offset),
                    needed: t.n_bytes,
                    len,
                });
            }
        }
        let mut by_offset: Vec<&TensorInfo> = tensors.iter().collect();
        by_offset.sort_by_key(|t| t.offset);
        for pair in by_offset.windows(2) {
            if pair[0].offset + pair[0].n_bytes > pair[1].offset {
                return Err(GgufError::corrupt(format!("tensors '{}' and '{}' overlap", pair[0].name, pair[1].name)));
            }
        }

        Ok(GgufFile { storage, version, alignment, data_offset, metadata, metadata_index, tensors, tensor_index })
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of tensor data (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Offset of the data section from the start of the file.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// All metadata, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey { key: key.to_string() })
    }

    fn wrong(key: &str, expected: &str, found: &Value) -> GgufError {
        GgufError::WrongType { key: key.to_string(), expected: expected.to_string(), found: found.type_name() }
    }

    /// A string value; [`GgufError::MissingKey`] / [`GgufError::WrongType`] otherwise.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| Self::wrong(key, "string", v))
    }

    /// A non-negative integer of any width.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.require(key)?;
        v.as_u64().ok_or_else(|| Self::wrong(key, "non-negative integer", v))
    }

    /// A float or integer as f64.
    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        let v = self.require(key)?;
        v.as_f64().ok_or_else(|| Self::wrong(key, "number", v))
    }

    /// A boolean.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| Self::wrong(key, "bool", v))
    }

    /// An array.
    pub fn get_array(&self, key: &str) -> Result<&Array, GgufError> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| Self::wrong(key, "array", v))
    }

    /// An array of strings.
    pub fn get_strings(&self, key: &str) -> Result<&[String], GgufError> {
        let v = self.require(key)?;
        v.as_array().and_then(Array::as_strings).ok_or_else(|| Self::wrong(key, "array of string", v))
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get_str("general.architecture")
    }

    /// All tensor infos, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The info of tensor `name`.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensor_index
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| GgufError::TensorNotFound { name: name.to_string() })
    }

    /// Whether the file holds a tensor called `name`.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensor_index.contains_key(name)
    }

    /// The raw bytes of a tensor (checked to lie inside the file when it was opened).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        let start = (self.data_offset + info.offset) as usize;
        &self.storage.bytes()[start..start + info.n_bytes as usize]
    }

    /// The raw bytes of tensor `name`.
    pub fn tensor_data(&self, name: &str) -> Result<&[u8], GgufError> {
        Ok(self.tensor_bytes(self.tensor(name)?))
    }

    /// Tensor `name` converted to f32, in row-major order (`dims[0]` fastest).
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let info = self.tensor(name)?;
        let mut out = vec![0.0f32; info.n_elements as usize];
        blocks::dequantize(info.ggml_type, self.tensor_bytes(info), &mut out)?;
        Ok(out)
    }
}

/// A bounds-checked little-endian reader over the file's bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what.to_string(),
                offset: self.pos as u64,
                needed: n,
                len: self.buf.len() as u64,
            });
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        Ok(self.take(N as u64, what)?.try_into().expect("length checked"))
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::corrupt(format!("{what}: string is not valid UTF-8")))
    }

    /// How many elements of at least `min_size` bytes can still fit: caps pre-allocation so that a
    /// corrupt count cannot request more memory than the file could back.
    fn capacity_for(&self, count: u64, min_size: u64) -> usize {
        count.min(self.remaining() / min_size) as usize
    }

    fn value(&mut self, ty: ValueType, key: &str, depth: u32) -> Result<Value, GgufError> {
        let what = || format!("value of metadata '{key}'");
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(&what())?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(&what())?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(&what())?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(&what())?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(&what())?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(&what())?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(&what())?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(&what())?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(&what())?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(&what())?)),
            ValueType::Bool => Value::Bool(self.bool(key)?),
            ValueType::String => Value::String(self.string(&what())?),
            ValueType::Array => Value::Array(self.array_value(key, depth)?),
        })
    }

    fn bool(&mut self, key: &str) -> Result<bool, GgufError> {
        match self.array::<1>(&format!("value of metadata '{key}'"))?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(GgufError::corrupt(format!("metadata '{key}': bool byte {b}"))),
        }
    }

    fn array_value(&mut self, key: &str, depth: u32) -> Result<Array, GgufError> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(GgufError::corrupt(format!("metadata '{key}': arrays nested deeper than {MAX_ARRAY_DEPTH}")));
        }
        let what = format!("array of metadata '{key}'");
        let type_id = self.u32(&what)?;
        let ty =
            ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType { key: key.to_string(), type_id })?;
        let count = self.u64(&what)?;
        if let Some(size) = ty.fixed_size() {
            // Fixed-size elements: the whole array must be present before anything is allocated.
            let bytes = self.take(count.saturating_mul(size as u64), &what)?;
            return Ok(fixed_array(ty, bytes));
        }
        match ty {
            ValueType::String => {
                // Each string takes at least its 8-byte length.
                let mut v = Vec::with_capacity(self.capacity_for(count, 8));
                for i in 0..count {
                    v.push(self.string(&format!("element {i} of {what}"))?);
                }
                Ok(Array::String(v))
            }
            _ => {
                // Nested arrays: each takes at least its 4-byte type and 8-byte count.
                let mut v = Vec::with_capacity(self.capacity_for(count, 12));
                for _ in 0..count {
                    v.push(self.array_value(key, depth + 1)?);
                }
                Ok(Array::Array(v))
            }
        }
    }

    fn tensor_info(&mut self, i: u64) -> Result<TensorInfo, GgufError> {
        let name = self.string(&format!("name of tensor {i}"))?;
        let what = format!("info of tensor '{name}'");
        let n_dims = self.u32(&what)?;
        if n_dims > MAX_DIMS {
            return Err(GgufError::corrupt(format!("tensor '{name}' has {n_dims} dimensions (at most {MAX_DIMS})")));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(self.u64(&what)?);
        }
        let type_id = self.u32(&what)?;
        let offset = self.u64(&what)?;
        let ggml_type =
            GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType { name: name.clone(), type_id })?;
        let overflow = || GgufError::corrupt(format!("tensor '{name}': dimensions {dims:?} overflow"));
        let n_elements = element_count(&dims).ok_or_else(overflow)?;
        let inner = dims.first().copied().unwrap_or(1);
        let row_bytes = ggml_type.row_bytes(inner).ok_or_else(|| {
            GgufError::corrupt(format!(
                "tensor '{name}': innermost dimension {inner} is not a multiple of the {ggml_type} block size {}",
                ggml_type.block_size()
            ))
        })?;
        let n_bytes = row_bytes.checked_mul(n_elements.checked_div(inner).unwrap_or(0)).ok_or_else(overflow)?;
        // Elements must be addressable on this machine (the data is checked to be in the file later).
        if usize::try_from(n_elements).is_err() || usize::try_from(n_bytes).is_err() {
            return Err(overflow());
        }
        Ok(TensorInfo { name, dims, ggml_type, offset, n_elements, n_bytes })
    }
}

/// The number of elements of a tensor with dimensions `dims`; `None` when the product of its
/// non-zero dimensions overflows. A zero dimension makes the tensor empty, but does not excuse the
/// others: otherwise whether a shape is accepted would depend on the order of its dimensions
/// (`[0, 2^40, 2^40]` accepted, `[2^40, 2^40, 0]` rejected), and the writer, which multiplies the
/// outer dimensions on their own, could not write back a file the reader accepted.
pub(crate) fn element_count(dims: &[u64]) -> Option<u64> {
    let product = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d.max(1)))?;
    Some(if dims.contains(&0) { 0 } else { product })
}

fn fixed_array(ty: ValueType, bytes: &[u8]) -> Array {
    fn conv<T, const N: usize>(bytes: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
        bytes.chunks_exact(N).map(|c| f(c.try_into().expect("chunk size"))).collect()
    }
    match ty {
        ValueType::U8 => Array::U8(bytes.to_vec()),
        ValueType::I8 => Array::I8(bytes.iter().map(|&b| b as i8).collect()),
        // The specification has a bool be one byte 0 or 1; any non-zero byte is read as true here
        // rather than failing a whole file over a flag array.
        ValueType::Bool => Array::Bool(bytes.iter().map(|&b| b != 0).collect()),
        ValueType::U16 => Array::U16(conv(bytes, u16::from_le_bytes)),
        ValueType::I16 => Array::I16(conv(bytes, i16::from_le_bytes)),
        ValueType::U32 => Array::U32(conv(bytes, u32::from_le_bytes)),
        ValueType::I32 => Array::I32(conv(bytes, i32::from_le_bytes)),
        ValueType::F32 => Array::F32(conv(bytes, f32::from_le_bytes)),
        ValueType::U64 => Array::U64(conv(bytes, u64::from_le_bytes)),
        ValueType::I64 => Array::I64(conv(bytes, i64::from_le_bytes)),
        ValueType::F64 => Array::F64(conv(bytes, f64::from_le_bytes)),
        ValueType::String | ValueType::Array => unreachable!("not a fixed-size type"),
    }
}
