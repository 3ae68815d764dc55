//! seam's int4 weight format (the struct is the contract other crates code against).
//!
//! Affine 4-bit: along each row (the input dimension) groups of [`GROUP_SIZE`] = 32 values share one
//! f16 `scale` and one f16 `bias`; `value = scale * q + bias` with `q` in `0..=15`, computed in f32
//! (`f32::from(scale) * q as f32 + f32::from(bias)`). Two values per byte: element `2i` of a row in
//! the low nibble, element `2i + 1` in the high nibble.

use crate::error::ModelError;
use crate::tensor_store::{Dtype, OwnedTensor, TensorStore};
use half::f16;
use rayon::prelude::*;
use std::collections::BTreeMap;

/// Values per quantization group.
pub const GROUP_SIZE: usize = 32;

/// A `[rows, cols]` matrix in seam's int4 format; `cols` is a multiple of [`GROUP_SIZE`].
#[derive(Debug, Clone, PartialEq)]
pub struct Int4Matrix {
    pub rows: usize,
    pub cols: usize,
    /// `rows * cols / 2` bytes, row-major.
    pub packed: Vec<u8>,
    /// `rows * cols / GROUP_SIZE` scales, row-major (`[rows, cols / 32]`).
    pub scales: Vec<f16>,
    /// `rows * cols / GROUP_SIZE` biases, row-major (`[rows, cols / 32]`).
    pub biases: Vec<f16>,
}

/// Rows handed to one rayon task when quantizing; large enough that task overhead is negligible.
const ROWS_PER_TASK: usize = 16;

/// Suffix of the packed-nibble tensor of a matrix in a safetensors file (`U8 [rows, cols / 2]`).
pub const QWEIGHT_SUFFIX: &str = ".qweight";
/// Suffix of the scale tensor (`F16 [rows, cols / 32]`).
pub const SCALES_SUFFIX: &str = ".scales";
/// Suffix of the bias tensor (`F16 [rows, cols / 32]`).
pub const BIASES_SUFFIX: &str = ".biases";

/// `__metadata__` value of `format` in a seam int4 safetensors file.
pub const FORMAT_NAME: &str = "seam-int4";
/// `__metadata__` value of `version` this build writes: 2 may hold int8 matrices
/// ([`crate::int8`]) beside the int4 ones; 1 (every matrix int4) is still read.
pub const FORMAT_VERSION: &str = "2";
/// The versions this build reads.
const READ_VERSIONS: [&str; 2] = ["1", "2"];

/// The `__metadata__` every seam int4 safetensors file carries:
/// `{"format": "seam-int4", "version": "2", "group_size": "32"}`.
pub fn int4_metadata() -> BTreeMap<String, String> {
    BTreeMap::from([
        ("format".to_string(), FORMAT_NAME.to_string()),
        ("version".to_string(), FORMAT_VERSION.to_string()),
        ("group_size".to_string(), GROUP_SIZE.to_string()),
    ])
}

/// Checks that a file's metadata says it is seam int4 in the version and group size this code reads.
pub fn check_int4_metadata(store: &TensorStore) -> Result<(), ModelError> {
    let meta = store.metadata();
    let path = store.paths().first().map(|p| p.to_path_buf()).unwrap_or_default();
    let get = |k: &str| meta.get(k).map(String::as_str);
    if get("format") != Some(FORMAT_NAME) {
        return Err(ModelError::Corrupt {
            path,
            message: format!("metadata format is {:?}, expected \"{FORMAT_NAME}\"", get("format")),
        });
    }
    if !get("version").is_some_and(|v| READ_VERSIONS.contains(&v)) {
        return Err(ModelError::Unsupported {
            what: format!(
                "seam-int4 version {:?} in {} (this build reads versions {})",
                get("version"),
                path.display(),
                READ_VERSIONS.join(" and ")
            ),
        });
    }
    if get("group_size") != Some(&*GROUP_SIZE.to_string()) {
        return Err(ModelError::Unsupported {
            what: format!(
                "seam-int4 group size {:?} in {} (only {GROUP_SIZE} is supported)",
                get("group_size"),
                path.display()
            ),
        });
    }
    Ok(())
}

/// Quantizes a row-major `[rows, cols]` f32 matrix to int4.
///
/// Per group of 32: `bias = min`, `scale = (max - min) / 15`, both rounded to f16; then
/// `q = round((x - bias) / scale)` clamped to `0..=15`, computed with the *rounded* scale and bias
/// so that the error is measured against what dequantization will produce. A constant group has
/// scale 0 and every `q` 0.
pub fn quantize(values: &[f32], rows: usize, cols: usize) -> Result<Int4Matrix, ModelError> {
    check_shape(rows, cols)?;
    if rows.checked_mul(cols) != Some(values.len()) {
        return Err(ModelError::Quantization {
            message: format!("{} values for a [{rows}, {cols}] matrix", values.len()),
        });
    }
    let groups_per_row = cols / GROUP_SIZE;
    let mut packed = vec![0u8; rows * cols / 2];
    let mut scales = vec![f16::ZERO; rows * groups_per_row];
    let mut biases = vec![f16::ZERO; rows * groups_per_row];
    if rows > 0 {
        values
            .par_chunks(cols * ROWS_PER_TASK)
            .zip(packed.par_chunks_mut(cols / 2 * ROWS_PER_TASK))
            .zip(scales.par_chunks_mut(groups_per_row * ROWS_PER_TASK))
            .zip(biases.par_chunks_mut(groups_per_row * ROWS_PER_TASK))
            .enumerate()
            .try_for_each(|(task, (((v, p), s), b))| {
                let first_row = task * ROWS_PER_TASK;
                v.chunks(GROUP_SIZE)
                    .zip(p.chunks_mut(GROUP_SIZE / 2))
                    .zip(s.iter_mut().zip(b.iter_mut()))
                    .enumerate()
                    .try_for_each(|(g, ((group, out), (scale, bias)))| {
                        quantize_group(group, out, scale, bias).map_err(|message| ModelError::Quantization {
                            message: format!(
                                "row {}, columns {}..{}: {message}",
                                first_row + g / groups_per_row,
                                (g % groups_per_row) * GROUP_SIZE,
                                (g % groups_per_row + 1) * GROUP_SIZE
                            ),
                        })
                    })
            })?;
    }
    Ok(Int4Matrix { rows, cols, packed, scales, biases })
}

/// Columns a positive multiple of the group size (shared by the int8 format, same groups).
pub(crate) fn check_shape(rows: usize, cols: usize) -> Result<(), ModelError> {
    if cols == 0 || !cols.is_multiple_of(GROUP_SIZE) {
        return Err(ModelError::Quantization {
            message: format!("a [{rows}, {cols}] matrix: columns must be a positive multiple of {GROUP_SIZE}"),
        });
    }
    Ok(())
}

/// Quantizes one group of [`GROUP_SIZE`] values into 16 bytes.
fn quantize_group(group: &[f32], out: &mut [u8], scale: &mut f16, bias: &mut f16) -> Result<(), String> {
    let mut min = f32::INFINITY;
    let mut max = f32::NEG_INFINITY;
    for &x in group {
        if !x.is_finite() {
            return Err(format!("non-finite value {x}"));
        }
        min = min.min(x);
        max = max.max(x);
    }
    let b = f16::from_f32(min);
    let s = f16::from_f32((max - min) / 15.0);
    if !b.is_finite() || !s.is_finite() {
        return Err(format!("values in [{min}, {max}] exceed the f16 range of scale and bias"));
    }
    let (bf, sf) = (b.to_f32(), s.to_f32());
    for (pair, byte) in group.chunks_exact(2).zip(out.iter_mut()) {
        let q = |x: f32| -> u8 {
            if sf == 0.0 {
                0
            } else {
                // round() half away from zero, clamped to 0..=15: adding 0.5 and truncating is the
                // same for the non-negative values that matter (anything below 0 clamps to 0), and
                // avoids a libm call per element on CPUs without SSE4.1 rounding.
                ((x - bf) / sf + 0.5).clamp(0.0, 15.0) as u8
            }
        };
        *byte = q(pair[0]) | (q(pair[1]) << 4);
    }
    *scale = s;
    *bias = b;
    Ok(())
}

impl Int4Matrix {
    /// Builds a matrix from its parts, checking that their lengths agree with `[rows, cols]`.
    pub fn from_parts(
        rows: usize,
        cols: usize,
        packed: Vec<u8>,
        scales: Vec<f16>,
        biases: Vec<f16>,
    ) -> Result<Int4Matrix, ModelError> {
        check_shape(rows, cols)?;
        let groups = rows * cols / GROUP_SIZE;
        if packed.len() != rows * cols / 2 || scales.len() != groups || biases.len() != groups {
            return Err(ModelError::Quantization {
                message: format!(
                    "a [{rows}, {cols}] int4 matrix needs {} packed bytes and {groups} scales and biases, got {}, {} and {}",
                    rows * cols / 2,
                    packed.len(),
                    scales.len(),
                    biases.len()
                ),
            });
        }
        Ok(Int4Matrix { rows, cols, packed, scales, biases })
    }

    /// Groups per row (`cols / 32`).
    pub fn groups_per_row(&self) -> usize {
        self.cols / GROUP_SIZE
    }

    /// The 4-bit code of element `(row, col)`.
    pub fn code(&self, row: usize, col: usize) -> u8 {
        let byte = self.packed[(row * self.cols + col) / 2];
        if col.is_multiple_of(2) {
            byte & 0x0f
        } else {
            byte >> 4
        }
    }

    /// Dequantizes row `row` into `out` (`cols` values), exactly
    /// `f32::from(scale) * q as f32 + f32::from(bias)` per element.
    ///
    /// # Panics
    /// If `row >= rows` or `out.len() != cols` (a caller bug, not a model error).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(row < self.rows, "row {row} of a matrix with {} rows", self.rows);
        assert_eq!(out.len(), self.cols, "output length must equal the column count");
        let groups = self.groups_per_row();
        let packed = &self.packed[row * self.cols / 2..(row + 1) * self.cols / 2];
        for (g, (out, bytes)) in out.chunks_exact_mut(GROUP_SIZE).zip(packed.chunks_exact(GROUP_SIZE / 2)).enumerate() {
            let scale = f32::from(self.scales[row * groups + g]);
            let bias = f32::from(self.biases[row * groups + g]);
            for (pair, &byte) in out.chunks_exact_mut(2).zip(bytes) {
                pair[0] = scale * (byte & 0x0f) as f32 + bias;
                pair[1] = scale * (byte >> 4) as f32 + bias;
            }
        }
    }

    /// The whole matrix as row-major f32.
    pub fn dequantize(&self) -> Vec<f32> {
        dequantize_rows(self.rows, self.cols, |r, row| self.dequantize_row(r, row))
    }

    /// Bytes held: packed codes plus scales and biases.
    pub fn byte_size(&self) -> usize {
        self.packed.len() + 2 * (self.scales.len() + self.biases.len())
    }

    /// The three tensors that store this matrix under the name `name` in a safetensors file:
    /// `name.qweight` (U8 `[rows, cols/2]`), `name.scales` and `name.biases` (F16 `[rows, cols/32]`).
    pub fn to_tensors(&self, name: &str) -> [(String, OwnedTensor); 3] {
        let groups = self.groups_per_row();
        [
            (
                format!("{name}{QWEIGHT_SUFFIX}"),
                OwnedTensor::U8 { shape: vec![self.rows, self.cols / 2], data: self.packed.clone() },
            ),
            (
                format!("{name}{SCALES_SUFFIX}"),
                OwnedTensor::F16 { shape: vec![self.rows, groups], data: self.scales.clone() },
            ),
            (
                format!("{name}{BIASES_SUFFIX}"),
                OwnedTensor::F16 { shape: vec![self.rows, groups], data: self.biases.clone() },
            ),
        ]
    }

    /// Loads the matrix stored under `name` (see [`Int4Matrix::to_tensors`]), checking dtypes and
    /// that the three tensors' shapes agree.
    pub fn from_store(store: &TensorStore, name: &str) -> Result<Int4Matrix, ModelError> {
        let qname = format!("{name}{QWEIGHT_SUFFIX}");
        let sname = format!("{name}{SCALES_SUFFIX}");
        let bname = format!("{name}{BIASES_SUFFIX}");
        let qshape = store.shape(&qname)?.to_vec();
        if qshape.len() != 2 || qshape[1] == 0 {
            return Err(ModelError::Shape { name: qname, expected: vec![0, 0], found: qshape });
        }
        let (rows, cols) = (qshape[0], qshape[1] * 2);
        if cols % GROUP_SIZE != 0 {
            return Err(ModelError::Shape {
                name: qname,
                expected: vec![rows, cols.next_multiple_of(GROUP_SIZE) / 2],
                found: qshape,
            });
        }
        let expected = vec![rows, cols / GROUP_SIZE];
        for tensor in [&sname, &bname] {
            let found = store.shape(tensor)?.to_vec();
            if found != expected {
                return Err(ModelError::Shape { name: tensor.clone(), expected: expected.clone(), found });
            }
            let dtype = store.dtype(tensor)?;
            if dtype != Dtype::F16 {
                return Err(ModelError::DType {
                    name: tensor.clone(),
                    found: format!("{dtype:?}"),
                    expected: "F16".into(),
                });
            }
        }
        let packed = store.read_u8(&qname)?;
        let scales = store.read_f16(&sname)?;
        let biases = store.read_f16(&bname)?;
        Int4Matrix::from_parts(rows, cols, packed, scales, biases)
    }
}

/// A `rows x cols` row-major f32 matrix whose rows `dequantize_row` fills, rows in parallel: the
/// whole-matrix dequantization of every quantized format here.
pub(crate) fn dequantize_rows(rows: usize, cols: usize, dequantize_row: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    let mut out = vec![0.0f32; rows * cols];
    if rows > 0 {
        out.par_chunks_mut(cols).enumerate().for_each(|(r, row)| dequantize_row(r, row));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor_store::write_safetensors;

    /// Test values uniform in `[-2, 2)`.
    fn noise(seed: u64, n: usize) -> Vec<f32> {
        crate::random::Rng::new(seed).uniform_vec(n, 2.0)
    }

    #[test]
    fn round_trip_error_is_within_half_a_step() {
        let (rows, cols) = (37, 96);
        let values = noise(7, rows * cols);
        let m = quantize(&values, rows, cols).unwrap();
        let back = m.dequantize();
        let groups = cols / GROUP_SIZE;
        for r in 0..rows {
            for g in 0..groups {
                let range = r * cols + g * GROUP_SIZE..r * cols + (g + 1) * GROUP_SIZE;
                let group = &values[range.clone()];
                let min = group.iter().cloned().fold(f32::INFINITY, f32::min);
                let max = group.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let scale = f32::from(m.scales[r * groups + g]);
                let bias = f32::from(m.biases[r * groups + g]);
                // Half a quantization step, plus what rounding scale and bias to f16 can move the
                // end points of the grid (bias error, and 15 times the scale error at the top).
                let bound = scale / 2.0 + (bias - min).abs() + 15.0 * (scale - (max - min) / 15.0).abs() + 1e-6;
                for i in range {
                    let err = (back[i] - values[i]).abs();
                    assert!(err <= bound, "row {r} group {g}: error {err} > {bound}");
                }
                assert!(scale > 0.0);
            }
        }
        // The reconstruction is far better than the data's spread: the quantizer is doing work.
        let rms = (values.iter().zip(&back).map(|(a, b)| (a - b) * (a - b)).sum::<f32>() / values.len() as f32).sqrt();
        assert!(rms < 0.1, "rms error {rms}");
    }

    #[test]
    fn dequantize_row_uses_the_documented_formula() {
        let values = noise(3, 2 * 64);
        let m = quantize(&values, 2, 64).unwrap();
        let mut row = vec![0.0; 64];
        m.dequantize_row(1, &mut row);
        for (c, &got) in row.iter().enumerate() {
            let g = 2 + c / GROUP_SIZE;
            let want = f32::from(m.scales[g]) * m.code(1, c) as f32 + f32::from(m.biases[g]);
            assert_eq!(got.to_bits(), want.to_bits());
        }
    }

    #[test]
    fn constant_groups_have_zero_scale_and_are_exact() {
        let mut values = vec![0.75f32; 64];
        values[32..].fill(-2.0);
        let m = quantize(&values, 1, 64).unwrap();
        assert_eq!(m.scales, vec![f16::ZERO, f16::ZERO]);
        assert_eq!(m.biases, vec![f16::from_f32(0.75), f16::from_f32(-2.0)]);
        assert!(m.packed.iter().all(|&b| b == 0));
        assert_eq!(m.dequantize(), values);
    }

    #[test]
    fn packing_puts_even_elements_in_the_low_nibble() {
        // A group spanning 0..15 exactly: scale 1, bias 0, q = value.
        let mut values: Vec<f32> = (0..32).map(|i| (i % 16) as f32).collect();
        values[0] = 3.0;
        values[1] = 12.0;
        values[30] = 0.0;
        values[31] = 15.0;
        let m = quantize(&values, 1, 32).unwrap();
        assert_eq!(f32::from(m.scales[0]), 1.0);
        assert_eq!(f32::from(m.biases[0]), 0.0);
        assert_eq!(m.packed[0], 3 | (12 << 4));
        assert_eq!(m.packed[1], 2 | (3 << 4));
        assert_eq!(m.packed[15], 15 << 4);
        assert_eq!(m.dequantize(), values);
    }

    #[test]
    fn bad_shapes_and_values_are_errors() {
        assert!(matches!(quantize(&[0.0; 48], 1, 48), Err(ModelError::Quantization { .. })));
        assert!(matches!(quantize(&[0.0; 64], 1, 32), Err(ModelError::Quantization { .. })));
        assert!(matches!(quantize(&[], 0, 0), Err(ModelError::Quantization { .. })));
        let mut v = vec![0.0; 32];
        v[5] = f32::NAN;
        assert!(matches!(quantize(&v, 1, 32), Err(ModelError::Quantization { .. })));
        v[5] = 1e6;
        assert!(matches!(quantize(&v, 1, 32), Err(ModelError::Quantization { .. })));
        assert!(Int4Matrix::from_parts(1, 32, vec![0; 15], vec![f16::ZERO], vec![f16::ZERO]).is_err());
    }

    #[test]
    fn tensors_round_trip_through_a_file() {
        let m = quantize(&noise(11, 40 * 64), 40, 64).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let name = "model.layers.0.self_attn.q_proj.weight";
        write_safetensors(&path, &m.to_tensors(name), &int4_metadata()).unwrap();
        let store = TensorStore::open_file(&path).unwrap();
        check_int4_metadata(&store).unwrap();
        assert_eq!(store.shape(&format!("{name}.qweight")).unwrap(), &[40, 32]);
        assert_eq!(store.shape(&format!("{name}.scales")).unwrap(), &[40, 2]);
        assert_eq!(Int4Matrix::from_store(&store, name).unwrap(), m);
        assert!(matches!(Int4Matrix::from_store(&store, "other"), Err(ModelError::MissingTensor { .. })));

        // Scales of the wrong shape.
        let mut tensors = m.to_tensors(name);
        tensors[1].1 = OwnedTensor::F16 { shape: vec![40, 1], data: vec![f16::ONE; 40] };
        write_safetensors(&path, &tensors, &BTreeMap::new()).unwrap();
        let store = TensorStore::open_file(&path).unwrap();
        assert!(matches!(Int4Matrix::from_store(&store, name), Err(ModelError::Shape { .. })));
        assert!(check_int4_metadata(&store).is_err());
    }
}
