//! Fuzzing the GGUF reader: mutated GGUF files must parse into a consistent [`GgufFile`] or fail
//! with a [`gguf::GgufError`], never panic or allocate beyond what the file's bytes can justify.
//!
//! Runs a bounded number of cases in `cargo test`; `SEAM_FUZZ_CASES` / `SEAM_FUZZ_SEED` run longer
//! (docs/dev/fuzzing.md). Failing inputs land in `tests/fuzz-regressions/gguf-reader/` and are
//! replayed first on every run.

use gguf::{Array, GgmlType, GgufFile, GgufWriter, Value};

#[global_allocator]
static ALLOC: fuzz_support::CountingAllocator = fuzz_support::CountingAllocator;

/// Small deterministic values for tensors (their content does not matter, their sizes do).
fn ramp(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7919) % 97) as f32 / 17.0 - 2.5).collect()
}

/// Every metadata type (nested arrays included) and tensors of the types the reader can convert,
/// one it can only size (Q6_K) and one with a zero dimension.
fn rich_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    w.add_metadata("general.name", "fuzz seed").unwrap();
    w.add_metadata("llama.block_count", Value::U32(2)).unwrap();
    w.add_metadata("llama.context_length", Value::U64(4096)).unwrap();
    w.add_metadata("llama.rope.freq_base", Value::F32(10000.0)).unwrap();
    w.add_metadata("u8", Value::U8(200)).unwrap();
    w.add_metadata("i8", Value::I8(-100)).unwrap();
    w.add_metadata("u16", Value::U16(60000)).unwrap();
    w.add_metadata("i16", Value::I16(-30000)).unwrap();
    w.add_metadata("i32", Value::I32(-7)).unwrap();
    w.add_metadata("i64", Value::I64(i64::MIN)).unwrap();
    w.add_metadata("f64", Value::F64(0.5)).unwrap();
    w.add_metadata("bool", Value::Bool(true)).unwrap();
    w.add_metadata("tokenizer.ggml.tokens", Array::String(vec!["<s>".into(), "Ġa".into(), "".into()])).unwrap();
    w.add_metadata("tokenizer.ggml.token_type", Array::I32(vec![3, 1, 1])).unwrap();
    w.add_metadata("tokenizer.ggml.scores", Array::F32(vec![0.0, -1.5, -2.0])).unwrap();
    w.add_metadata("u64s", Array::U64(vec![1, u64::MAX])).unwrap();
    w.add_metadata("nested", Array::Array(vec![Array::U8(vec![1, 2]), Array::Bool(vec![true, false])])).unwrap();
    w.add_tensor_f32("token_embd.weight", &[32, 3], &ramp(96), GgmlType::F16).unwrap();
    w.add_tensor_f32("output_norm.weight", &[8], &ramp(8), GgmlType::F32).unwrap();
    w.add_tensor_f32("blk.0.attn_q.weight", &[32, 2], &ramp(64), GgmlType::Q8_0).unwrap();
    w.add_tensor_f32("blk.0.attn_k.weight", &[64], &ramp(64), GgmlType::Q4_0).unwrap();
    w.add_tensor_f32("blk.0.attn_v.weight", &[32, 2], &ramp(64), GgmlType::Q4_1).unwrap();
    w.add_tensor_f32("blk.0.ffn_norm.weight", &[5], &ramp(5), GgmlType::BF16).unwrap();
    let q6k = GgmlType::Q6_K;
    w.add_tensor_bytes("blk.1.ffn_down.weight", &[256], q6k, vec![0x11; q6k.block_bytes() as usize]).unwrap();
    w.add_tensor_bytes("empty", &[0, 4], GgmlType::F32, Vec::new()).unwrap();
    w.to_bytes()
}

/// A non-default alignment (read back from `general.alignment`).
fn aligned_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.set_alignment(64).unwrap();
    w.add_metadata("general.architecture", "llama").unwrap();
    w.add_tensor_f32("a", &[4], &ramp(4), GgmlType::F32).unwrap();
    w.add_tensor_f32("b", &[32], &ramp(32), GgmlType::Q4_1).unwrap();
    w.to_bytes()
}

/// No metadata, no tensors: just the header.
fn empty_file() -> Vec<u8> {
    GgufWriter::new().to_bytes()
}

/// The same layout as version 2 (identical to 3 for little-endian files).
fn version2_file() -> Vec<u8> {
    let mut bytes = aligned_file();
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    bytes
}

/// Exercises every accessor of the value (they must not panic on any decoded value).
fn walk_value(value: &Value) {
    let _ = (value.type_name(), value.as_u64(), value.as_i64(), value.as_f64(), value.as_str(), value.as_bool());
    if let Some(array) = value.as_array() {
        walk_array(array);
    }
}

fn walk_array(array: &Array) {
    let _ = (array.len(), array.is_empty(), array.element_type(), array.as_strings());
    if let Some(ints) = array.to_i64s() {
        assert_eq!(ints.len(), array.len());
    }
    if let Some(floats) = array.to_f64s() {
        assert_eq!(floats.len(), array.len());
    }
    if let Array::Array(inner) = array {
        inner.iter().for_each(walk_array);
    }
}

/// Parses `input`; on success, checks the file's invariants, reads every tensor, and writes the
/// file again with [`GgufWriter`], which must read back the same.
fn check(input: &[u8]) -> bool {
    let file = match GgufFile::from_bytes(input.to_vec()) {
        Ok(file) => file,
        Err(e) => {
            // Typed, and printable without panicking.
            assert!(!e.to_string().is_empty());
            return false;
        }
    };
    assert!(matches!(file.version(), 2 | 3));
    assert!(file.alignment().is_power_of_two());
    assert_eq!(file.data_offset() % file.alignment(), 0);
    let _ = format!("{file:?}");

    for (key, value) in file.metadata() {
        // The same entry, not an equal one: NaN values are not equal to themselves.
        assert!(file.get(key).is_some_and(|v| std::ptr::eq(v, value)), "metadata key {key:?} is not found by its name");
        walk_value(value);
        let _ = (file.get_str(key), file.get_u64(key), file.get_f64(key), file.get_bool(key), file.get_array(key));
        let _ = file.get_strings(key);
    }
    let _ = file.architecture();

    for info in file.tensors() {
        assert_eq!(file.tensor(&info.name).ok(), Some(info));
        assert!(file.has_tensor(&info.name));
        let end = file.data_offset() + info.offset + info.n_bytes;
        assert!(
            end <= input.len() as u64,
            "tensor '{}' ends at {end}, past the file's {} bytes",
            info.name,
            input.len()
        );
        // In the file's order, as the reader multiplied them: a zero dimension after two huge ones
        // is a valid empty tensor whose other products overflow.
        assert_eq!(info.dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d)), Some(info.n_elements));
        assert!(info.shape().into_iter().eq(info.dims.iter().rev().map(|&d| d as usize)));
        let data = file.tensor_data(&info.name).expect("listed tensor");
        assert_eq!(data.len() as u64, info.n_bytes);
        match file.dequantize(&info.name) {
            Ok(values) => assert_eq!(values.len() as u64, info.n_elements),
            Err(e) => assert!(matches!(e, gguf::GgufError::UnsupportedType { .. }), "{e}"),
        }
        if info.ggml_type == GgmlType::Q4_1 {
            assert_eq!(gguf::q4_1_blocks(data).expect("whole blocks").len() as u64, info.n_elements / 32);
        }
    }
    assert!(file.tensor("no such tensor").is_err());

    rewrite_and_compare(&file);
    true
}

/// A file the reader accepts is one the writer can reproduce: same metadata, same tensors.
fn rewrite_and_compare(file: &GgufFile) {
    let mut w = GgufWriter::new();
    for (key, value) in file.metadata() {
        if key == gguf::ALIGNMENT_KEY {
            // The writer records the alignment as a u32 and pads with a zero buffer of that size:
            // rewrite only the alignments it can write exactly and cheaply.
            match value {
                Value::U32(a) if *a <= 1 << 16 => w.set_alignment(*a).expect("a power of two, checked by the reader"),
                _ => return,
            }
        } else {
            w.add_metadata(key.clone(), value.clone()).expect("keys are unique, checked by the reader");
        }
    }
    for info in file.tensors() {
        let data = file.tensor_bytes(info).to_vec();
        w.add_tensor_bytes(info.name.clone(), &info.dims, info.ggml_type, data).expect("the reader checked the size");
    }
    let again = GgufFile::from_bytes(w.to_bytes()).expect("a rewritten valid file reads back");
    // Debug text compares NaN floats as equal, which `PartialEq` would not.
    assert_eq!(format!("{:?}", again.metadata()), format!("{:?}", file.metadata()));
    assert_eq!(again.tensors().len(), file.tensors().len());
    for (a, b) in again.tensors().iter().zip(file.tensors()) {
        assert_eq!((&a.name, &a.dims, a.ggml_type, a.n_bytes), (&b.name, &b.dims, b.ggml_type, b.n_bytes));
        assert_eq!(again.tensor_bytes(a), file.tensor_bytes(b));
    }
}

#[test]
fn gguf_reader_survives_mutated_files() {
    // The reader caps every allocation by the bytes present, and the largest legitimate expansion
    // is dequantization (at most 128 f32 per 18-byte Q1_0 block, about 29 bytes per file byte),
    // done once per tensor plus a rewritten copy of the file: 64 bytes per input byte and 4 MiB for
    // hash maps and strings is generous for honest parsing and far below what a trusted length
    // field (2^32, 2^62, u64::MAX) would ask for.
    fuzz_support::Fuzz::new("gguf-reader", env!("CARGO_MANIFEST_DIR"))
        .extension("gguf")
        .cases(200_000)
        .memory_bound(4 << 20, 64)
        .run(vec![rich_file(), aligned_file(), empty_file(), version2_file()], check);
}
