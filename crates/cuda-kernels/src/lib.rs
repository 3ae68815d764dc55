//! seam's CUDA kernels, for runtimes that hand seam a CUDA stream (XLA's custom calls on
//! pjrt-cuda): decode's one-row products `y = W x` in the three weight formats, reading the
//! stored weights once ([`Kernel`]).
//!
//! The kernels are CUDA C (`kernels/products.cu`), compiled ahead to PTX by
//! `scripts/cuda-kernels.sh` and embedded here: neither the build machine nor a GPU machine needs
//! a CUDA compiler, and the NVIDIA driver compiles the PTX for the GPU it finds when a module is
//! first loaded. The driver library (`libcuda.so.1`) is opened at run time ([`Driver`]), so
//! nothing links against CUDA.

pub mod device;
mod driver;

pub use driver::{driver_library, driver_symbol, CudaError, Driver, Stream};

/// The PTX of `kernels/products.cu` (compute capability 8.0 and up), NUL-terminated as the
/// driver's module loader wants it.
pub const PRODUCTS_PTX: &str = concat!(include_str!("../kernels/products.ptx"), "\0");

/// Output rows per block, and threads per block (`SEAM_ROWS`, `SEAM_THREADS` in the source).
pub const ROWS_PER_BLOCK: usize = 4;
const THREADS_PER_BLOCK: u32 = 256;

/// Inputs per quantization group of the int8 and int4 formats.
pub const GROUP: usize = 32;

/// One of the products' kernels. Each computes `y[r] = sum_i w[r][i] x[i]` for `x` f32 `[k]` and
/// `y` f32 `[rows]`, with `k` a multiple of [`GROUP`] and every array 16-byte aligned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// `(x, w f16 [rows, k], y)`.
    F16,
    /// `(x, q s8 [rows, k], scales f16 [rows, k / 32], y)`: `w = s q`.
    Int8,
    /// `(x, packed u8 [rows, k / 2], scales f16 [rows, k / 32], biases f16 [rows, k / 32], y)`:
    /// `w = s q + b`, byte `i` of a group holding input `2i` in its low nibble.
    Int4,
}

impl Kernel {
    /// Every kernel.
    pub const ALL: [Kernel; 3] = [Kernel::F16, Kernel::Int8, Kernel::Int4];

    /// The kernel's entry point in the PTX.
    pub fn entry(self) -> &'static str {
        match self {
            Kernel::F16 => "seam_rows_f16",
            Kernel::Int8 => "seam_rows_int8",
            Kernel::Int4 => "seam_rows_int4",
        }
    }

    /// How many device pointers the kernel takes before `rows` and `k` (`x`, the weight arrays,
    /// `y`).
    pub fn pointers(self) -> usize {
        match self {
            Kernel::F16 => 3,
            Kernel::Int8 => 4,
            Kernel::Int4 => 5,
        }
    }
}

/// Why a product's shape cannot go to the kernels (checked before every launch: a wrong launch
/// reads out of bounds on the device instead of failing).
pub fn check_shape(rows: usize, k: usize) -> Result<(), String> {
    if rows == 0 || k == 0 || !k.is_multiple_of(GROUP) {
        return Err(format!(
            "a product of {rows} rows of {k} inputs: the kernels take k a non-zero multiple of {GROUP}"
        ));
    }
    if rows > i32::MAX as usize || k > i32::MAX as usize {
        return Err(format!("a product of {rows} rows of {k} inputs is too large for the kernels' 32-bit indices"));
    }
    Ok(())
}

/// The launch geometry of a product of `rows` rows: blocks, threads per block.
pub fn grid(rows: usize) -> (u32, u32) {
    (rows.div_ceil(ROWS_PER_BLOCK) as u32, THREADS_PER_BLOCK)
}
