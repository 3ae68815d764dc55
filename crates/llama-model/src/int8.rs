//! seam's int8 weight format, for the matrices an int4 model keeps at 8 bits (by default its token
//! embedding and output head, see ADR 0013).
//!
//! Symmetric 8-bit: along each row (the input dimension) groups of [`GROUP_SIZE`] = 32 values share
//! one f16 `scale`; `value = scale * q` with `q` an `i8`, computed in f32
//! (`f32::from(scale) * q as f32`). This is GGUF's Q8_0 block (an f16 `d` and 32 `i8` codes) laid
//! out as two arrays, so a Q8_0 tensor is carried over without changing a value.
//!
//! In a safetensors file a matrix `name` is `name.qweight` (I8 `[rows, cols]`) and `name.scales`
//! (F16 `[rows, cols / 32]`); an int4 matrix's `.qweight` is U8 `[rows, cols / 2]`, so the dtype of
//! `.qweight` tells the two apart.

use crate::error::ModelError;
use crate::int4::{check_shape, dequantize_rows, QWEIGHT_SUFFIX, SCALES_SUFFIX};
use crate::tensor_store::{Dtype, OwnedTensor, TensorStore};
use half::f16;
use rayon::prelude::*;

/// Values per quantization group: int4's (so the two share `check_shape`), which is also Q8_0's.
pub const GROUP_SIZE: usize = crate::int4::GROUP_SIZE;

/// A `[rows, cols]` matrix in seam's int8 format; `cols` is a multiple of [`GROUP_SIZE`].
#[derive(Debug, Clone, PartialEq)]
pub struct Int8Matrix {
    pub rows: usize,
    pub cols: usize,
    /// `rows * cols` codes, row-major.
    pub codes: Vec<i8>,
    /// `rows * cols / GROUP_SIZE` scales, row-major (`[rows, cols / 32]`).
    pub scales: Vec<f16>,
}

/// Quantizes a row-major `[rows, cols]` f32 matrix to int8 as llama.cpp's Q8_0 does: per group of
/// 32, `scale = max|x| / 127` rounded to f16, `q = round(x / scale)` with the unrounded scale's
/// inverse (so a value quantized here equals Q8_0's of the same input).
pub fn quantize(values: &[f32], rows: usize, cols: usize) -> Result<Int8Matrix, ModelError> {
    check_shape(rows, cols)?;
    if rows.checked_mul(cols) != Some(values.len()) {
        return Err(ModelError::Quantization {
            message: format!("{} values for a [{rows}, {cols}] matrix", values.len()),
        });
    }
    let mut codes = vec![0i8; rows * cols];
    let mut scales = vec![f16::ZERO; rows * cols / GROUP_SIZE];
    values
        .par_chunks(GROUP_SIZE)
        .zip(codes.par_chunks_mut(GROUP_SIZE))
        .zip(scales.par_iter_mut())
        .enumerate()
        .try_for_each(|(g, ((group, out), scale))| {
            let mut amax = 0.0f32;
            for &x in group {
                if !x.is_finite() {
                    return Err((g, format!("non-finite value {x}")));
                }
                amax = amax.max(x.abs());
            }
            let d = amax / 127.0;
            let s = f16::from_f32(d);
            if !s.is_finite() {
                return Err((g, format!("largest magnitude {amax} exceeds the f16 range of a scale")));
            }
            let inverse = if d == 0.0 { 0.0 } else { 1.0 / d };
            for (o, &x) in out.iter_mut().zip(group) {
                *o = (x * inverse).round().clamp(-127.0, 127.0) as i8;
            }
            *scale = s;
            Ok(())
        })
        .map_err(|(g, message)| {
            let (row, column) = (g * GROUP_SIZE / cols, g * GROUP_SIZE % cols);
            ModelError::Quantization {
                message: format!("row {row}, columns {column}..{}: {message}", column + GROUP_SIZE),
            }
        })?;
    Ok(Int8Matrix { rows, cols, codes, scales })
}

impl Int8Matrix {
    /// Builds a matrix from its parts, checking that their lengths agree with `[rows, cols]`.
    pub fn from_parts(rows: usize, cols: usize, codes: Vec<i8>, scales: Vec<f16>) -> Result<Int8Matrix, ModelError> {
        check_shape(rows, cols)?;
        let groups = rows * cols / GROUP_SIZE;
        if codes.len() != rows * cols || scales.len() != groups {
            return Err(ModelError::Quantization {
                message: format!(
                    "a [{rows}, {cols}] int8 matrix needs {} codes and {groups} scales, got {} and {}",
                    rows * cols,
                    codes.len(),
                    scales.len()
                ),
            });
        }
        Ok(Int8Matrix { rows, cols, codes, scales })
    }

    /// Groups per row (`cols / 32`).
    pub fn groups_per_row(&self) -> usize {
        self.cols / GROUP_SIZE
    }

    /// Dequantizes row `row` into `out` (`cols` values), exactly `f32::from(scale) * q as f32`.
    ///
    /// # Panics
    /// If `row >= rows` or `out.len() != cols` (a caller bug, not a model error).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(row < self.rows, "row {row} of a matrix with {} rows", self.rows);
        assert_eq!(out.len(), self.cols, "output length must equal the column count");
        let groups = self.groups_per_row();
        let codes = &self.codes[row * self.cols..(row + 1) * self.cols];
        for (g, (out, codes)) in out.chunks_exact_mut(GROUP_SIZE).zip(codes.chunks_exact(GROUP_SIZE)).enumerate() {
            let scale = f32::from(self.scales[row * groups + g]);
            for (o, &q) in out.iter_mut().zip(codes) {
                *o = scale * q as f32;
            }
        }
    }

    /// The whole matrix as row-major f32.
    pub fn dequantize(&self) -> Vec<f32> {
        dequantize_rows(self.rows, self.cols, |r, row| self.dequantize_row(r, row))
    }

    /// Bytes held: codes plus scales.
    pub fn byte_size(&self) -> usize {
        self.codes.len() + 2 * self.scales.len()
    }

    /// The two tensors that store this matrix under the name `name` in a safetensors file:
    /// `name.qweight` (I8 `[rows, cols]`) and `name.scales` (F16 `[rows, cols/32]`).
    pub fn to_tensors(&self, name: &str) -> [(String, OwnedTensor); 2] {
        [
            (
                format!("{name}{QWEIGHT_SUFFIX}"),
                OwnedTensor::I8 { shape: vec![self.rows, self.cols], data: self.codes.clone() },
            ),
            (
                format!("{name}{SCALES_SUFFIX}"),
                OwnedTensor::F16 { shape: vec![self.rows, self.groups_per_row()], data: self.scales.clone() },
            ),
        ]
    }

    /// Loads the matrix stored under `name` (see [`Int8Matrix::to_tensors`]), checking dtypes and
    /// that the two tensors' shapes agree.
    pub fn from_store(store: &TensorStore, name: &str) -> Result<Int8Matrix, ModelError> {
        let qname = format!("{name}{QWEIGHT_SUFFIX}");
        let sname = format!("{name}{SCALES_SUFFIX}");
        let qshape = store.shape(&qname)?.to_vec();
        if qshape.len() != 2 || qshape[1] == 0 || !qshape[1].is_multiple_of(GROUP_SIZE) {
            let expected = vec![
                qshape.first().copied().unwrap_or(0),
                qshape.get(1).copied().unwrap_or(0).max(1).next_multiple_of(GROUP_SIZE),
            ];
            return Err(ModelError::Shape { name: qname, expected, found: qshape });
        }
        let (rows, cols) = (qshape[0], qshape[1]);
        let expected = vec![rows, cols / GROUP_SIZE];
        let found = store.shape(&sname)?.to_vec();
        if found != expected {
            return Err(ModelError::Shape { name: sname, expected, found });
        }
        let dtype = store.dtype(&sname)?;
        if dtype != Dtype::F16 {
            return Err(ModelError::DType { name: sname, found: format!("{dtype:?}"), expected: "F16".into() });
        }
        Int8Matrix::from_parts(rows, cols, store.read_i8(&qname)?, store.read_f16(&sname)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor_store::write_safetensors;
    use std::collections::BTreeMap;

    #[test]
    fn round_trip_error_is_within_half_a_step_and_matches_q8_0() {
        let (rows, cols) = (9, 96);
        let values = crate::random::Rng::new(5).uniform_vec(rows * cols, 2.0);
        let m = quantize(&values, rows, cols).unwrap();
        let back = m.dequantize();
        for (g, group) in values.chunks(GROUP_SIZE).enumerate() {
            let scale = f32::from(m.scales[g]);
            for (i, &x) in group.iter().enumerate() {
                let err = (back[g * GROUP_SIZE + i] - x).abs();
                // Half a step, plus what rounding the scale to f16 moves the largest code.
                assert!(err <= scale / 2.0 + 127.0 * scale * 1e-3, "group {g}: error {err}");
            }
        }
        // The same codes and scales as GGUF's own Q8_0 quantizer.
        let q8 = gguf::quantize(gguf::GgmlType::Q8_0, &values).unwrap();
        for (g, block) in q8.chunks_exact(34).enumerate() {
            assert_eq!(f16::from_le_bytes([block[0], block[1]]), m.scales[g], "scale of group {g}");
            let codes: Vec<i8> = block[2..].iter().map(|&b| b as i8).collect();
            assert_eq!(codes, &m.codes[g * GROUP_SIZE..(g + 1) * GROUP_SIZE], "codes of group {g}");
        }
    }

    #[test]
    fn zero_groups_and_bad_input() {
        let m = quantize(&[0.0; 32], 1, 32).unwrap();
        assert_eq!(m.scales, vec![f16::ZERO]);
        assert_eq!(m.dequantize(), vec![0.0; 32]);
        assert!(quantize(&[0.0; 48], 1, 48).is_err());
        let mut v = vec![0.0; 32];
        v[3] = f32::INFINITY;
        assert!(quantize(&v, 1, 32).is_err());
        assert!(Int8Matrix::from_parts(1, 32, vec![0; 31], vec![f16::ONE]).is_err());
    }

    #[test]
    fn tensors_round_trip_through_a_file() {
        let values = crate::random::Rng::new(2).uniform_vec(4 * 64, 1.0);
        let m = quantize(&values, 4, 64).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        write_safetensors(&path, &m.to_tensors("e"), &BTreeMap::new()).unwrap();
        let store = TensorStore::open_file(&path).unwrap();
        assert_eq!(store.dtype("e.qweight").unwrap(), Dtype::I8);
        assert_eq!(Int8Matrix::from_store(&store, "e").unwrap(), m);
    }
}
