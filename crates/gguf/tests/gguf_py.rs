//! Cross-checks against gguf-py 0.19 (the GGUF reference implementation, from PyPI): a file it
//! writes is read correctly here, and a file written here reads back the same in gguf-py.
//!
//! The test installs gguf-py (and numpy) into the project-local `.seam/py` on first use.

use gguf::{hf_dims, Array, GgmlType, GgufFile, GgufWriter, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const GGUF_PY: &str = "gguf==0.19.0";

fn seam_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.seam")
}

/// `.seam/py` with gguf-py installed (installing it once if needed).
fn gguf_py() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = seam_dir().join("py");
        if !dir.join("gguf-0.19.0.dist-info").exists() {
            let status = Command::new("python3")
                .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target"])
                .arg(&dir)
                .arg(GGUF_PY)
                .status()
                .expect("python3 must be installed to run the gguf-py cross-check");
            assert!(status.success(), "pip install {GGUF_PY} into {} failed", dir.display());
        }
        dir
    })
}

fn run_python(script: &str, args: &[&Path]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py").join(script);
    let out = Command::new("python3").arg(&script).args(args).env("PYTHONPATH", gguf_py()).output().unwrap();
    assert!(
        out.status.success(),
        "{} failed:\n{}\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn read_f32s(path: &Path) -> Vec<f32> {
    std::fs::read(path).unwrap().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn same_bits(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "{what}[{i}]: {x} vs {y}");
    }
}

#[test]
fn reads_a_file_written_by_gguf_py() {
    let dir = tempfile::tempdir().unwrap();
    run_python("make_fixture.py", &[dir.path()]);
    let f = GgufFile::open(&dir.path().join("fixture.gguf")).unwrap();

    assert_eq!(f.architecture().unwrap(), "llama");
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.get("test.u32"), Some(&Value::U32(123456)));
    assert_eq!(f.get("test.i32"), Some(&Value::I32(-42)));
    assert_eq!(f.get("test.f32"), Some(&Value::F32(0.125)));
    assert_eq!(f.get("test.f64"), Some(&Value::F64(2.5)));
    assert_eq!(f.get("test.bool"), Some(&Value::Bool(true)));
    assert_eq!(f.get("test.u64"), Some(&Value::U64(1 << 40)));
    assert_eq!(f.get_str("test.str").unwrap(), "héllo");
    assert_eq!(f.get_strings("test.strings").unwrap(), ["<s>", "Ġthe", "é"]);
    assert_eq!(f.get_array("test.ints").unwrap().to_i64s().unwrap(), vec![3, -1, 7]);
    assert_eq!(f.get_array("test.floats").unwrap().to_f64s().unwrap(), vec![0.5, -2.0]);

    let expect = [
        ("norm", GgmlType::F32, vec![96u64]),
        ("plain", GgmlType::F32, vec![64, 3]),
        ("half", GgmlType::F16, vec![64, 5]),
        ("q8", GgmlType::Q8_0, vec![96, 6]),
        ("q41", GgmlType::Q4_1, vec![128, 7]),
        ("q40", GgmlType::Q4_0, vec![64, 4]),
    ];
    assert_eq!(f.tensors().len(), expect.len());
    for (name, ty, dims) in expect {
        let info = f.tensor(name).unwrap();
        assert_eq!((info.ggml_type, &info.dims), (ty, &dims), "{name}");
        assert_eq!(info.offset % 64, 0);
        // Dequantization: bit for bit what gguf-py computes.
        same_bits(&f.dequantize(name).unwrap(), &read_f32s(&dir.path().join(format!("{name}.deq"))), name);
        // Quantization: the same bytes as gguf-py's quantizer (which matches ggml's reference code).
        let input = read_f32s(&dir.path().join(format!("{name}.input")));
        assert_eq!(gguf::quantize(ty, &input).unwrap(), f.tensor_data(name).unwrap(), "{name}: quantized bytes");
    }
    // The Q4_1 block view agrees with the dequantization.
    let deq = f.dequantize("q41").unwrap();
    let blocks: Vec<_> = gguf::q4_1_blocks(f.tensor_data("q41").unwrap()).unwrap().collect();
    assert_eq!(blocks.len(), 7 * 4);
    for (b, block) in blocks.iter().enumerate() {
        for i in 0..32 {
            assert_eq!(block.value(i).to_bits(), deq[b * 32 + i].to_bits());
        }
    }
}

#[test]
fn gguf_py_reads_a_file_written_here() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    w.add_metadata("t.u8", Value::U8(7)).unwrap();
    w.add_metadata("t.i16", Value::I16(-5)).unwrap();
    w.add_metadata("t.u32", Value::U32(99)).unwrap();
    w.add_metadata("t.i64", Value::I64(-(1 << 40))).unwrap();
    w.add_metadata("t.f32", Value::F32(1e-5)).unwrap();
    w.add_metadata("t.f64", Value::F64(0.1)).unwrap();
    w.add_metadata("t.bool", Value::Bool(false)).unwrap();
    w.add_metadata("t.str", "gpt2").unwrap();
    w.add_metadata("t.strings", Array::String(vec!["Ġa".into(), "b c".into()])).unwrap();
    w.add_metadata("t.i32s", Array::I32(vec![1, 3, 4])).unwrap();
    w.add_metadata("t.f32s", Array::F32(vec![1.5, -0.25])).unwrap();

    let mut s = 0x1234_5678u32;
    let mut values = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            })
            .collect()
    };
    let tensors = [
        ("norm", vec![64usize], GgmlType::F32),
        ("half", vec![3, 64], GgmlType::F16),
        ("brain", vec![2, 32], GgmlType::BF16),
        ("q8", vec![4, 96], GgmlType::Q8_0),
        ("q41", vec![5, 64], GgmlType::Q4_1),
        ("q40", vec![2, 64], GgmlType::Q4_0),
    ];
    for (name, shape, ty) in &tensors {
        let n = shape.iter().product();
        w.add_tensor_f32(*name, &hf_dims(shape), &values(n), *ty).unwrap();
    }
    let path = dir.path().join("ours.gguf");
    w.write_file(&path).unwrap();
    run_python("read_back.py", &[&path, dir.path()]);

    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["alignment"], 32);
    let meta = &summary["metadata"];
    assert_eq!(meta["general.architecture"]["value"], "llama");
    assert_eq!(meta["t.u8"]["value"], 7);
    assert_eq!(meta["t.u8"]["types"], serde_json::json!([0]));
    assert_eq!(meta["t.i16"]["value"], -5);
    assert_eq!(meta["t.u32"]["types"], serde_json::json!([4]));
    assert_eq!(meta["t.i64"]["value"], -(1i64 << 40));
    assert_eq!(meta["t.f32"]["value"].as_f64().unwrap() as f32, 1e-5);
    assert_eq!(meta["t.f64"]["value"], 0.1);
    assert_eq!(meta["t.bool"]["value"], false);
    assert_eq!(meta["t.str"]["value"], "gpt2");
    assert_eq!(meta["t.strings"]["value"], serde_json::json!(["Ġa", "b c"]));
    assert_eq!(meta["t.strings"]["types"], serde_json::json!([9, 8]));
    assert_eq!(meta["t.i32s"]["value"], serde_json::json!([1, 3, 4]));
    assert_eq!(meta["t.f32s"]["value"], serde_json::json!([1.5, -0.25]));

    let ours = GgufFile::open(&path).unwrap();
    for (name, shape, ty) in &tensors {
        let t = &summary["tensors"][*name];
        assert_eq!(t["type"], ty.to_string(), "{name}");
        assert_eq!(t["dims"], serde_json::json!(hf_dims(shape)), "{name}");
        same_bits(&read_f32s(&dir.path().join(format!("{name}.deq"))), &ours.dequantize(name).unwrap(), name);
    }
}

#[test]
fn block_geometry_matches_gguf_py() {
    let out = Command::new("python3")
        .args([
            "-c",
            "import json, gguf; print(json.dumps({t.name: [int(t), *gguf.GGML_QUANT_SIZES[t]] for t in gguf.GGMLQuantizationType}))",
        ])
        .env("PYTHONPATH", gguf_py())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(table.len(), GgmlType::all().count(), "types known here vs gguf-py: {table:?}");
    for ty in GgmlType::all() {
        let want = &table[&ty.to_string()];
        assert_eq!(want, &serde_json::json!([ty.id(), ty.block_size(), ty.block_bytes()]), "{ty}");
    }
}
