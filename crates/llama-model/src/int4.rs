//! seam's int4 weight format (skeleton: the struct is the contract; functions are filled in).
//!
//! Affine 4-bit: along each row (the input dimension) groups of [`GROUP_SIZE`] = 32 values share one
//! f16 `scale` and one f16 `bias`; `value = scale * q + bias` with `q` in `0..=15`, computed in f32
//! (`f32::from(scale) * q as f32 + f32::from(bias)`). Two values per byte: element `2i` of a row in
//! the low nibble, element `2i + 1` in the high nibble.

use half::f16;

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
