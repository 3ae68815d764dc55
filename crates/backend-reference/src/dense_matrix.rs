//! Weight matrices held as f32, and the products the forward pass needs.
//!
//! Every [`Matrix`] is converted to f32 once, when the engine is built, rather than converted (f16)
//! or dequantized (int4) row by row inside each product. Why: the reference backend is the oracle,
//! and converting once keeps the products a plain f32 dot product that is obviously right, while
//! the values are *exactly* those of on-the-fly conversion (f16 → f32 is exact, and the int4 rows
//! come from `Int4Matrix::dequantize_row`, the format's single definition). The price is memory:
//! four bytes per weight (about 540 MB for SmolLM2-135M, 5 GB for Llama-3.2-1B), acceptable for a
//! reference, and decode reads f32 weights instead of half or an eighth as many bytes.

use crate::kernels::dot;
use llama_model::Matrix;
use rayon::prelude::*;
use session_api::SeamError;

/// A `[rows, cols]` row-major f32 matrix: row `r` holds the weights of output `r` (`y = W x`).
#[derive(Debug, Clone, PartialEq)]
pub struct DenseMatrix {
    rows: usize,
    cols: usize,
    data: Vec<f32>,
}

/// Output rows per rayon task: enough work per task that scheduling costs nothing measurable.
const ROWS_PER_TASK: usize = 16;

impl DenseMatrix {
    /// A matrix from row-major values; fails if `data` does not hold `rows * cols` of them.
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Result<Self, SeamError> {
        if data.len() != rows * cols {
            return Err(SeamError::ModelFormat {
                path: None,
                message: format!("a [{rows}, {cols}] matrix needs {} values, got {}", rows * cols, data.len()),
            });
        }
        Ok(DenseMatrix { rows, cols, data })
    }

    /// Converts a model weight to f32: f16 exactly, int4 and int8 through their `dequantize_row`.
    pub fn from_weight(weight: &Matrix) -> Result<Self, SeamError> {
        match weight {
            Matrix::F16 { rows, cols, data } => Self::new(*rows, *cols, data.iter().map(|&v| f32::from(v)).collect()),
            Matrix::Int4(m) => {
                let packed_ok = m.cols % llama_model::int4::GROUP_SIZE == 0
                    && m.packed.len() == m.rows * m.cols / 2
                    && m.scales.len() == m.rows * m.cols / llama_model::int4::GROUP_SIZE
                    && m.biases.len() == m.scales.len();
                if !packed_ok {
                    return Err(SeamError::ModelFormat {
                        path: None,
                        message: format!("int4 matrix [{}, {}] has inconsistent storage sizes", m.rows, m.cols),
                    });
                }
                let mut data = vec![0.0f32; m.rows * m.cols];
                if m.cols > 0 {
                    data.par_chunks_mut(m.cols).enumerate().for_each(|(row, out)| m.dequantize_row(row, out));
                }
                Self::new(m.rows, m.cols, data)
            }
            Matrix::Int8(m) => {
                let consistent = m.cols % llama_model::int8::GROUP_SIZE == 0
                    && m.codes.len() == m.rows * m.cols
                    && m.scales.len() == m.rows * m.cols / llama_model::int8::GROUP_SIZE;
                if !consistent {
                    return Err(SeamError::ModelFormat {
                        path: None,
                        message: format!("int8 matrix [{}, {}] has inconsistent storage sizes", m.rows, m.cols),
                    });
                }
                Self::new(m.rows, m.cols, m.dequantize())
            }
        }
    }

    /// Number of rows (outputs).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns (inputs).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Row `r`: the weights of output `r`, or for an embedding table, token `r`'s vector.
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Bytes the values occupy.
    pub fn bytes(&self) -> u64 {
        (self.data.len() * std::mem::size_of::<f32>()) as u64
    }

    /// `y = W x` for one input vector of `cols` values; returns `rows` values.
    pub fn matvec(&self, x: &[f32]) -> Vec<f32> {
        self.matmul(x, 1)
    }

    /// `Y = X Wᵀ` for `n` input rows: `x` is `[n, cols]`, the result `[n, rows]`.
    ///
    /// Work is split over output rows (rayon), and each weight row meets all `n` inputs while it is
    /// in cache, so a prefill of `n` tokens streams the weights once instead of `n` times.
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        assert_eq!(x.len(), n * self.cols, "matmul input has the wrong length");
        if n == 0 || self.rows == 0 {
            return Vec::new();
        }
        // Computed output-major ([rows, n]) so each task writes one contiguous block...
        let mut by_row = vec![0.0f32; self.rows * n];
        by_row.par_chunks_mut(n).with_min_len(ROWS_PER_TASK).enumerate().for_each(|(r, out)| {
            let w = self.row(r);
            for (t, o) in out.iter_mut().enumerate() {
                *o = dot(w, &x[t * self.cols..(t + 1) * self.cols]);
            }
        });
        if n == 1 {
            return by_row;
        }
        // ...then transposed to the token-major layout the rest of the forward pass uses.
        let mut by_token = vec![0.0f32; self.rows * n];
        for r in 0..self.rows {
            for t in 0..n {
                by_token[t * self.rows + r] = by_row[r * n + t];
            }
        }
        by_token
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;
    use llama_model::Int4Matrix;

    #[test]
    fn matmul_by_hand() {
        // W = [[1, 2], [3, 4], [5, 6]]; X = [[1, 0], [1, -1]].
        let w = DenseMatrix::new(3, 2, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        assert_eq!(w.matvec(&[1.0, 0.0]), vec![1.0, 3.0, 5.0]);
        assert_eq!(w.matmul(&[1.0, 0.0, 1.0, -1.0], 2), vec![1.0, 3.0, 5.0, -1.0, -1.0, -1.0]);
    }

    #[test]
    fn matmul_agrees_with_matvec_row_by_row_on_many_rows() {
        let (rows, cols, n) = (100, 37, 5);
        let w =
            DenseMatrix::new(rows, cols, (0..rows * cols).map(|i| ((i * 7919) % 13) as f32 - 6.0).collect()).unwrap();
        let x: Vec<f32> = (0..n * cols).map(|i| ((i * 31) % 11) as f32 * 0.5).collect();
        let batched = w.matmul(&x, n);
        for t in 0..n {
            assert_eq!(&batched[t * rows..(t + 1) * rows], w.matvec(&x[t * cols..(t + 1) * cols]).as_slice());
        }
    }

    #[test]
    fn f16_converts_exactly() {
        let m =
            Matrix::F16 { rows: 1, cols: 3, data: vec![f16::from_f32(0.5), f16::from_f32(-2.0), f16::from_f32(1e-3)] };
        let d = DenseMatrix::from_weight(&m).unwrap();
        assert_eq!(d.row(0), &[0.5, -2.0, f16::from_f32(1e-3).to_f32()]);
    }

    #[test]
    fn int4_dequantizes_with_the_format_arithmetic() {
        // One row of 32: q = i % 16, scale 0.5, bias -1, so value = 0.5 * q - 1.
        let packed: Vec<u8> = (0..16)
            .map(|i| {
                let (lo, hi) = ((2 * i) % 16, (2 * i + 1) % 16);
                (lo | (hi << 4)) as u8
            })
            .collect();
        let m = Int4Matrix {
            rows: 1,
            cols: 32,
            packed,
            scales: vec![f16::from_f32(0.5)],
            biases: vec![f16::from_f32(-1.0)],
        };
        let d = DenseMatrix::from_weight(&Matrix::Int4(m)).unwrap();
        let expected: Vec<f32> = (0..32).map(|i| 0.5 * (i % 16) as f32 - 1.0).collect();
        assert_eq!(d.row(0), expected.as_slice());
    }

    #[test]
    fn inconsistent_sizes_are_a_model_error_not_a_panic() {
        let m = Matrix::F16 { rows: 2, cols: 2, data: vec![f16::ZERO; 3] };
        assert_eq!(DenseMatrix::from_weight(&m).unwrap_err().kind(), session_api::ErrorKind::ModelFormat);
    }
}
