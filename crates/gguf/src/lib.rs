//! `gguf`: reading and writing GGUF files (versions 2 and 3), and the ggml block formats seam
//! imports.
//!
//! - [`GgufFile`]: a memory-mapped reader. Every count, length and offset in the file is checked,
//!   so a truncated or corrupt file is a [`GgufError`], never a panic or a huge allocation.
//! - [`Value`] / [`Array`]: typed metadata.
//! - [`dequantize`] (F32, F16, BF16, Q8_0, Q4_0, Q4_1 → f32, bit-identical to ggml) and
//!   [`BlockQ4_1`] / [`q4_1_blocks`] for carrying Q4_1 blocks over without requantizing.
//! - [`GgufWriter`] and [`quantize`]: writing GGUF files with llama.cpp's reference quantizers, for
//!   test fixtures and for handing models to llama.cpp.
//!
//! Dimension order follows ggml: `dims[0]` (`ne[0]`) is the innermost, contiguous dimension, so a
//! Hugging Face `[out, in]` weight has `dims = [in, out]` and quantization blocks run along `in`.

mod blocks;
mod error;
mod ggml_type;
mod metadata;
mod reader;
mod writer;

pub use blocks::{dequantize, q4_1_blocks, quantize, BlockQ4_1, QK};
pub use error::GgufError;
pub use ggml_type::GgmlType;
pub use metadata::{Array, Value, ValueType};
pub use reader::{GgufFile, TensorInfo, MAX_DIMS};
pub use writer::{hf_dims, GgufWriter};

/// `"GGUF"` read as a little-endian u32.
pub const MAGIC: u32 = 0x4655_4747;
/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that overrides the alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";
