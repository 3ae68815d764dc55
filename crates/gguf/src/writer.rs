//! Writing GGUF v3 files: metadata of every type and tensors in any ggml type (quantizing from f32
//! for the types [`crate::quantize`] supports).

use crate::error::GgufError;
use crate::ggml_type::GgmlType;
use crate::metadata::{Array, Value};
use crate::reader::MAX_DIMS;
use crate::{blocks, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC};
use std::collections::HashSet;
use std::io::{self, Write};
use std::path::Path;

struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    data: Vec<u8>,
}

/// Builds a GGUF v3 file in memory and writes it out.
///
/// Tensor dimensions are given in ggml order: `dims[0]` is the innermost (contiguous) dimension,
/// so a Hugging Face weight of shape `[out, in]` is added with `dims = [in, out]` (see
/// [`hf_dims`]) and its quantization blocks run along `in`.
#[derive(Default)]
pub struct GgufWriter {
    alignment: Option<u64>,
    metadata: Vec<(String, Value)>,
    keys: HashSet<String>,
    tensors: Vec<PendingTensor>,
    names: HashSet<String>,
}

/// ggml dimensions of a row-major (outermost first) shape: the shape reversed.
pub fn hf_dims(shape: &[usize]) -> Vec<u64> {
    shape.iter().rev().map(|&d| d as u64).collect()
}

impl GgufWriter {
    /// An empty file (alignment 32).
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    /// Sets the data alignment and records it as `general.alignment` (u32), as readers expect.
    pub fn set_alignment(&mut self, alignment: u32) -> Result<(), GgufError> {
        if !alignment.is_power_of_two() {
            return Err(GgufError::corrupt(format!("alignment {alignment} is not a power of two")));
        }
        self.add_metadata(ALIGNMENT_KEY, Value::U32(alignment))?;
        self.alignment = Some(alignment.into());
        Ok(())
    }

    /// Adds one metadata key (each key at most once).
    pub fn add_metadata(&mut self, key: impl Into<String>, value: impl Into<Value>) -> Result<(), GgufError> {
        let key = key.into();
        if !self.keys.insert(key.clone()) {
            return Err(GgufError::corrupt(format!("metadata key '{key}' added twice")));
        }
        self.metadata.push((key, value.into()));
        Ok(())
    }

    /// Adds a tensor from its raw bytes in type `ty` (checked against `dims`).
    pub fn add_tensor_bytes(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> Result<(), GgufError> {
        let name = name.into();
        let invalid = |message: String| GgufError::InvalidTensor { name: name.clone(), message };
        if dims.len() > MAX_DIMS as usize {
            return Err(invalid(format!("{} dimensions (at most {MAX_DIMS})", dims.len())));
        }
        // The reader refuses dimensions whose non-zero product overflows; never write one.
        if crate::reader::element_count(dims).is_none() {
            return Err(invalid(format!("dimensions {dims:?} overflow")));
        }
        let inner = dims.first().copied().unwrap_or(1);
        let rows = dims.iter().skip(1).try_fold(1u64, |a, &d| a.checked_mul(d));
        let expected = ty.row_bytes(inner).zip(rows).and_then(|(r, n)| r.checked_mul(n));
        if expected != Some(data.len() as u64) {
            return Err(invalid(format!("{} bytes of {ty} for dims {dims:?} (expected {expected:?})", data.len())));
        }
        if !self.names.insert(name.clone()) {
            return Err(invalid("added twice".into()));
        }
        self.tensors.push(PendingTensor { name, dims: dims.to_vec(), ty, data });
        Ok(())
    }

    /// Adds a tensor from f32 values (row-major, `dims[0]` fastest), converted or quantized to `ty`
    /// by [`crate::quantize`].
    pub fn add_tensor_f32(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        values: &[f32],
        ty: GgmlType,
    ) -> Result<(), GgufError> {
        let name = name.into();
        let n = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        if n != Some(values.len() as u64) {
            return Err(GgufError::InvalidTensor {
                name,
                message: format!("{} values for dims {dims:?}", values.len()),
            });
        }
        let inner = dims.first().copied().unwrap_or(1);
        if inner % ty.block_size() != 0 {
            return Err(GgufError::InvalidTensor {
                name,
                message: format!("innermost dimension {inner} is not a multiple of the {ty} block size"),
            });
        }
        let data = blocks::quantize(ty, values).map_err(|e| match e {
            GgufError::InvalidTensor { message, .. } => GgufError::InvalidTensor { name: name.clone(), message },
            other => other,
        })?;
        self.add_tensor_bytes(name, dims, ty, data)
    }

    /// Writes the file to `w`: header, metadata, tensor infos, then the data of each tensor, each
    /// padded to the alignment.
    pub fn write_to<W: Write>(&self, w: &mut W) -> io::Result<()> {
        let alignment = self.alignment.unwrap_or(DEFAULT_ALIGNMENT);
        let mut header = Vec::new();
        header.extend_from_slice(&MAGIC.to_le_bytes());
        header.extend_from_slice(&3u32.to_le_bytes());
        header.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut header, key);
            header.extend_from_slice(&value.value_type().id().to_le_bytes());
            put_value(&mut header, value);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_string(&mut header, &t.name);
            header.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                header.extend_from_slice(&d.to_le_bytes());
            }
            header.extend_from_slice(&t.ty.id().to_le_bytes());
            header.extend_from_slice(&offset.to_le_bytes());
            offset = (offset + t.data.len() as u64).next_multiple_of(alignment);
        }
        let padded = (header.len() as u64).next_multiple_of(alignment) as usize;
        header.resize(padded, 0);
        w.write_all(&header)?;
        let zeros = vec![0u8; alignment as usize];
        for t in &self.tensors {
            w.write_all(&t.data)?;
            let pad = (t.data.len() as u64).next_multiple_of(alignment) - t.data.len() as u64;
            w.write_all(&zeros[..pad as usize])?;
        }
        Ok(())
    }

    /// The whole file as bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.write_to(&mut v).expect("writing to a Vec cannot fail");
        v
    }

    /// Writes the file to `path`, through a temporary file in the same directory renamed into
    /// place ([`atomic_write::TempFile`]), so that an interrupted write never leaves a partial
    /// file under `path`. A `path` that exists and is not a regular file (a link, a device) is
    /// refused.
    pub fn write_file(&self, path: &Path) -> Result<(), GgufError> {
        let io = |source| GgufError::Io { path: path.to_path_buf(), source };
        let mut temp = atomic_write::TempFile::create(path).map_err(io)?;
        {
            let mut f = io::BufWriter::with_capacity(1 << 20, temp.file());
            self.write_to(&mut f).map_err(io)?;
            f.flush().map_err(io)?;
        }
        temp.commit().map_err(io)
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => out.push(*v),
        Value::I8(v) => out.push(*v as u8),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(*v as u8),
        Value::String(s) => put_string(out, s),
        Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Array(a) => put_array(out, a),
    }
}

fn put_array(out: &mut Vec<u8>, a: &Array) {
    out.extend_from_slice(&a.element_type().id().to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    fn each<T>(out: &mut Vec<u8>, v: &[T], f: impl Fn(&mut Vec<u8>, &T)) {
        v.iter().for_each(|x| f(out, x));
    }
    match a {
        Array::U8(v) => out.extend_from_slice(v),
        Array::I8(v) => each(out, v, |o, x| o.push(*x as u8)),
        Array::U16(v) => each(out, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        Array::I16(v) => each(out, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        Array::U32(v) => each(out, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        Array::I32(v) => each(out, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        Array::F32(v) => each(out, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        Array::Bool(v) => each(out, v, |o, x| o.push(*x as u8)),
        Array::String(v) => each(out, v, |o, x| put_string(o, x)),
        Array::U64(v) => each(out, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        Array::I64(v) => each(out, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        Array::F64(v) => each(out, v, |o, x| o.extend_from_slice(&x.to_le_bytes())),
        Array::Array(v) => each(out, v, put_array),
    }
}
