//! Round trips through the writer and reader, and the reader's handling of malformed files.

use gguf::{hf_dims, Array, GgmlType, GgufError, GgufFile, GgufWriter, Value};

fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s as f32 / u32::MAX as f32 - 0.5) * 3.0
        })
        .collect()
}

fn sample_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    w.add_metadata("u8", Value::U8(200)).unwrap();
    w.add_metadata("i8", Value::I8(-100)).unwrap();
    w.add_metadata("u16", Value::U16(60000)).unwrap();
    w.add_metadata("i16", Value::I16(-30000)).unwrap();
    w.add_metadata("u32", Value::U32(4_000_000_000)).unwrap();
    w.add_metadata("i32", Value::I32(-2_000_000_000)).unwrap();
    w.add_metadata("f32", Value::F32(1.5e-5)).unwrap();
    w.add_metadata("bool", Value::Bool(true)).unwrap();
    w.add_metadata("u64", Value::U64(u64::MAX)).unwrap();
    w.add_metadata("i64", Value::I64(i64::MIN)).unwrap();
    w.add_metadata("f64", Value::F64(std::f64::consts::PI)).unwrap();
    w.add_metadata("strings", Array::String(vec!["a".into(), "Ġb".into(), "".into()])).unwrap();
    w.add_metadata("ints", Array::I32(vec![1, -2, 3])).unwrap();
    w.add_metadata("floats", Array::F32(vec![0.25, -1.0])).unwrap();
    w.add_metadata("nested", Array::Array(vec![Array::U8(vec![1, 2]), Array::Bool(vec![true, false])])).unwrap();
    w.add_tensor_f32("norm", &[64], &values(64, 1), GgmlType::F32).unwrap();
    w.add_tensor_f32("half", &hf_dims(&[3, 64]), &values(192, 2), GgmlType::F16).unwrap();
    w.add_tensor_f32("q8", &hf_dims(&[4, 64]), &values(256, 3), GgmlType::Q8_0).unwrap();
    w.add_tensor_f32("q41", &hf_dims(&[5, 96]), &values(480, 4), GgmlType::Q4_1).unwrap();
    w.add_tensor_f32("q40", &hf_dims(&[2, 32]), &values(64, 5), GgmlType::Q4_0).unwrap();
    w.add_tensor_f32("bf", &[7], &values(7, 6), GgmlType::BF16).unwrap();
    w
}

#[test]
fn metadata_and_tensors_round_trip() {
    let w = sample_writer();
    let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.data_offset() % 32, 0);
    assert_eq!(f.architecture().unwrap(), "llama");
    assert_eq!(f.get("u8"), Some(&Value::U8(200)));
    assert_eq!(f.get("i8"), Some(&Value::I8(-100)));
    assert_eq!(f.get("u16"), Some(&Value::U16(60000)));
    assert_eq!(f.get("i16"), Some(&Value::I16(-30000)));
    assert_eq!(f.get_u64("u32").unwrap(), 4_000_000_000);
    assert_eq!(f.get("i32"), Some(&Value::I32(-2_000_000_000)));
    assert_eq!(f.get_f64("f32").unwrap(), 1.5e-5f32 as f64);
    assert!(f.get_bool("bool").unwrap());
    assert_eq!(f.get_u64("u64").unwrap(), u64::MAX);
    assert_eq!(f.get("i64"), Some(&Value::I64(i64::MIN)));
    assert_eq!(f.get_f64("f64").unwrap(), std::f64::consts::PI);
    assert_eq!(f.get_strings("strings").unwrap(), ["a", "Ġb", ""]);
    assert_eq!(f.get_array("ints").unwrap().to_i64s().unwrap(), vec![1, -2, 3]);
    assert_eq!(f.get_array("floats").unwrap().to_f64s().unwrap(), vec![0.25, -1.0]);
    assert_eq!(
        f.get_array("nested").unwrap(),
        &Array::Array(vec![Array::U8(vec![1, 2]), Array::Bool(vec![true, false])])
    );
    // Typed accessors say what is wrong.
    assert!(matches!(f.get_u64("i32"), Err(GgufError::WrongType { .. })));
    assert!(matches!(f.get_str("u8"), Err(GgufError::WrongType { .. })));
    assert!(matches!(f.get_str("nope"), Err(GgufError::MissingKey { .. })));

    assert_eq!(f.tensors().len(), 6);
    let q41 = f.tensor("q41").unwrap();
    assert_eq!(q41.dims, vec![96, 5]);
    assert_eq!(q41.shape(), vec![5, 96]);
    assert_eq!(q41.ggml_type, GgmlType::Q4_1);
    assert_eq!(q41.n_bytes, 5 * 3 * 20);
    for t in f.tensors() {
        assert_eq!(t.offset % 32, 0);
    }
    // Exact data: what the writer quantized is what the reader returns.
    for (name, ty, seed, n) in [
        ("norm", GgmlType::F32, 1, 64),
        ("half", GgmlType::F16, 2, 192),
        ("q8", GgmlType::Q8_0, 3, 256),
        ("q41", GgmlType::Q4_1, 4, 480),
        ("q40", GgmlType::Q4_0, 5, 64),
        ("bf", GgmlType::BF16, 6, 7),
    ] {
        let bytes = gguf::quantize(ty, &values(n, seed)).unwrap();
        assert_eq!(f.tensor_data(name).unwrap(), &bytes[..], "{name}");
        let mut want = vec![0.0; n];
        gguf::dequantize(ty, &bytes, &mut want).unwrap();
        assert_eq!(f.dequantize(name).unwrap(), want, "{name}");
    }
    assert_eq!(f.dequantize("norm").unwrap(), values(64, 1));
    assert!(matches!(f.tensor("missing"), Err(GgufError::TensorNotFound { .. })));
}

#[test]
fn custom_alignment_and_files_on_disk() {
    let mut w = sample_writer();
    w.set_alignment(64).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    w.write_file(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_offset() % 64, 0);
    assert!(f.tensors().iter().all(|t| t.offset % 64 == 0));
    assert_eq!(f.dequantize("norm").unwrap(), values(64, 1));
    assert!(w.set_alignment(48).is_err());
    assert!(matches!(GgufFile::open(&dir.path().join("absent.gguf")), Err(GgufError::Io { .. })));
    // Only the renamed file is left behind.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn a_large_file_is_memory_mapped_and_read_back() {
    let mut w = GgufWriter::new();
    let v = values(64 * 1024, 9);
    w.add_tensor_f32("big", &[1024, 64], &v, GgmlType::F32).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.gguf");
    w.write_file(&path).unwrap();
    assert_eq!(GgufFile::open(&path).unwrap().dequantize("big").unwrap(), v);
}

#[test]
fn writer_rejects_inconsistent_tensors() {
    let mut w = GgufWriter::new();
    assert!(w.add_tensor_f32("a", &[48, 2], &[0.0; 96], GgmlType::Q8_0).is_err());
    assert!(w.add_tensor_f32("a", &[32, 2], &[0.0; 63], GgmlType::Q8_0).is_err());
    assert!(w.add_tensor_bytes("a", &[32], GgmlType::Q4_1, vec![0; 19]).is_err());
    assert!(w.add_tensor_bytes("a", &[1, 1, 1, 1, 1], GgmlType::F32, vec![0; 4]).is_err());
    w.add_tensor_bytes("a", &[32], GgmlType::Q4_1, vec![0; 20]).unwrap();
    assert!(w.add_tensor_bytes("a", &[32], GgmlType::Q4_1, vec![0; 20]).is_err());
    w.add_metadata("k", 1u32).unwrap();
    assert!(w.add_metadata("k", 2u32).is_err());
}

#[test]
fn every_truncation_is_a_typed_error() {
    let bytes = sample_writer().to_bytes();
    let full = GgufFile::from_bytes(bytes.clone()).unwrap();
    // The writer pads the last tensor to the alignment; only the bytes up to its end are needed.
    let needed = full.data_offset() + full.tensors().iter().map(|t| t.offset + t.n_bytes).max().unwrap();
    assert!(needed as usize > bytes.len() - 32);
    for len in 0..needed as usize {
        match GgufFile::from_bytes(bytes[..len].to_vec()) {
            Err(GgufError::Truncated { .. }) => {}
            other => panic!("prefix of {len} bytes: {other:?}"),
        }
    }
}

/// A hand-built file header, for structures the writer refuses to produce.
struct Raw(Vec<u8>);

impl Raw {
    fn new(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        let mut v = b"GGUF".to_vec();
        v.extend_from_slice(&version.to_le_bytes());
        v.extend_from_slice(&n_tensors.to_le_bytes());
        v.extend_from_slice(&n_kv.to_le_bytes());
        Raw(v)
    }
    fn u32(mut self, x: u32) -> Raw {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn u64(mut self, x: u64) -> Raw {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn str(self, s: &str) -> Raw {
        let mut r = self.u64(s.len() as u64);
        r.0.extend_from_slice(s.as_bytes());
        r
    }
    fn tensor(self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Raw {
        let mut r = self.str(name).u32(dims.len() as u32);
        for &d in dims {
            r = r.u64(d);
        }
        r.u32(ty).u64(offset)
    }
    fn pad(mut self, to: usize) -> Raw {
        self.0.resize(to, 0);
        self
    }
    fn open(self) -> Result<GgufFile, GgufError> {
        GgufFile::from_bytes(self.0)
    }
}

#[test]
fn malformed_headers_are_typed_errors() {
    assert!(matches!(GgufFile::from_bytes(b"GGML\x03\0\0\0".to_vec()), Err(GgufError::BadMagic { .. })));
    assert!(matches!(Raw::new(1, 0, 0).open(), Err(GgufError::UnsupportedVersion { version: 1 })));
    // A big-endian file's version reads byte-swapped.
    assert!(matches!(Raw::new(3u32.swap_bytes(), 0, 0).open(), Err(GgufError::UnsupportedVersion { .. })));
    Raw::new(2, 0, 0).open().unwrap();

    // Lengths and counts far beyond the file: errors, without allocating for them.
    assert!(matches!(Raw::new(3, 0, 1).u64(u64::MAX).open(), Err(GgufError::Truncated { .. })));
    assert!(matches!(
        Raw::new(3, 0, 1).str("k").u32(9).u32(4).u64(u64::MAX / 2).open(),
        Err(GgufError::Truncated { .. })
    ));
    assert!(matches!(Raw::new(3, 0, 1).str("k").u32(9).u32(8).u64(u64::MAX).open(), Err(GgufError::Truncated { .. })));
    assert!(matches!(Raw::new(3, 0, 1).str("k").u32(9).u32(9).u64(u64::MAX).open(), Err(GgufError::Truncated { .. })));
    assert!(matches!(Raw::new(3, 0, u64::MAX).open(), Err(GgufError::Truncated { .. })));
    assert!(matches!(Raw::new(3, u64::MAX, 0).open(), Err(GgufError::Truncated { .. })));

    // Arrays nested without end.
    let mut deep = Raw::new(3, 0, 1).str("k").u32(9);
    for _ in 0..20 {
        deep = deep.u32(9).u64(1);
    }
    assert!(matches!(deep.open(), Err(GgufError::Corrupt { .. })));

    assert!(matches!(Raw::new(3, 0, 1).str("k").u32(13).open(), Err(GgufError::UnknownValueType { type_id: 13, .. })));
    assert!(Raw::new(3, 0, 1).str("k").u32(7).pad(8 + 16 + 9 + 4 + 1).open().is_ok());
    let mut bad_bool = Raw::new(3, 0, 1).str("k").u32(7);
    bad_bool.0.push(2);
    assert!(matches!(bad_bool.open(), Err(GgufError::Corrupt { .. })));
    let mut bad_utf8 = Raw::new(3, 0, 1).u64(2);
    bad_utf8.0.extend_from_slice(&[0xff, 0xfe]);
    assert!(matches!(bad_utf8.u32(4).u32(0).open(), Err(GgufError::Corrupt { .. })));
    assert!(matches!(
        Raw::new(3, 0, 2).str("k").u32(4).u32(0).str("k").u32(4).u32(0).open(),
        Err(GgufError::Corrupt { .. })
    ));

    // Alignment must be a power of two.
    assert!(matches!(Raw::new(3, 0, 1).str("general.alignment").u32(4).u32(24).open(), Err(GgufError::Corrupt { .. })));
    assert!(matches!(Raw::new(3, 0, 1).str("general.alignment").u32(4).u32(0).open(), Err(GgufError::Corrupt { .. })));
}

#[test]
fn malformed_tensor_tables_are_typed_errors() {
    // Header of 24 bytes plus one tensor info; the data section starts at 96 (aligned to 32).
    let one = |dims: &[u64], ty: u32, offset: u64, file_len: usize| {
        Raw::new(3, 1, 0).tensor("t", dims, ty, offset).pad(file_len).open()
    };
    let info_end: usize = 24 + 8 + 1 + 4 + 8 * 2 + 4 + 8;
    let data = info_end.next_multiple_of(32);
    let f = one(&[32, 2], 0, 0, data + 256).unwrap();
    assert_eq!(f.data_offset(), data as u64);
    assert_eq!(f.tensor("t").unwrap().n_bytes, 256);
    assert!(matches!(one(&[32, 2], 0, 0, data + 255), Err(GgufError::Truncated { .. })));
    assert!(matches!(one(&[32, 2], 0, 32, data + 256), Err(GgufError::Truncated { .. })));
    assert!(matches!(one(&[32, 2], 0, u64::MAX - 31, data + 256), Err(GgufError::Truncated { .. })));
    assert!(matches!(one(&[32, 2], 0, 4, data + 512), Err(GgufError::Corrupt { .. })));
    assert!(matches!(one(&[32, 2], 99, 0, data + 256), Err(GgufError::UnknownTensorType { type_id: 99, .. })));
    assert!(matches!(one(&[48, 2], 8, 0, data + 256), Err(GgufError::Corrupt { .. })));
    assert!(matches!(one(&[u64::MAX, 2], 0, 0, data + 256), Err(GgufError::Corrupt { .. })));
    assert!(matches!(one(&[1 << 40, 1 << 40], 0, 0, data + 256), Err(GgufError::Corrupt { .. })));
    let five = Raw::new(3, 1, 0).tensor("t", &[1, 1, 1, 1, 1], 0, 0).pad(256).open();
    assert!(matches!(five, Err(GgufError::Corrupt { .. })));

    // Two tensors sharing bytes; and the same name twice.
    let two = |second_offset: u64, second_name: &str| {
        Raw::new(3, 2, 0).tensor("a", &[64], 0, 0).tensor(second_name, &[64], 0, second_offset).pad(1024).open()
    };
    two(256, "b").unwrap();
    assert!(matches!(two(224, "b"), Err(GgufError::Corrupt { .. })));
    assert!(matches!(two(256, "a"), Err(GgufError::Corrupt { .. })));
}
