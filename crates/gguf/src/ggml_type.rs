//! The ggml tensor types a GGUF file can hold, with the block geometry needed to size their data.

use std::fmt;

/// A ggml tensor type (`ggml_type` in ggml.h). Every type of the GGUF specification is listed so
/// that the byte size of any tensor can be checked, even of types this crate cannot dequantize.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
}

/// `(type, id, elements per block, bytes per block)`, from ggml's type traits.
const TABLE: &[(GgmlType, u32, u64, u64)] = {
    use GgmlType::*;
    const K: u64 = 256;
    &[
        (F32, 0, 1, 4),
        (F16, 1, 1, 2),
        (Q4_0, 2, 32, 18),
        (Q4_1, 3, 32, 20),
        (Q5_0, 6, 32, 22),
        (Q5_1, 7, 32, 24),
        (Q8_0, 8, 32, 34),
        (Q8_1, 9, 32, 40),
        (Q2_K, 10, K, 4 + K / 16 + K / 4),
        (Q3_K, 11, K, 2 + K / 4 + K / 8 + 12),
        (Q4_K, 12, K, 4 + K / 2 + 12),
        (Q5_K, 13, K, 4 + K / 2 + K / 8 + 12),
        (Q6_K, 14, K, 2 + K / 2 + K / 4 + K / 16),
        (Q8_K, 15, K, 4 + K + K / 8),
        (IQ2_XXS, 16, K, 2 + K / 4),
        (IQ2_XS, 17, K, 2 + K / 4 + K / 32),
        (IQ3_XXS, 18, K, 2 + K / 4 + K / 8),
        (IQ1_S, 19, K, 2 + K / 8 + K / 16),
        (IQ4_NL, 20, 32, 18),
        (IQ3_S, 21, K, 2 + K / 4 + K / 8 + K / 32 + 4),
        (IQ2_S, 22, K, 2 + K / 4 + K / 16),
        (IQ4_XS, 23, K, 4 + K / 2 + K / 64),
        (I8, 24, 1, 1),
        (I16, 25, 1, 2),
        (I32, 26, 1, 4),
        (I64, 27, 1, 8),
        (F64, 28, 1, 8),
        (IQ1_M, 29, K, K / 8 + K / 16 + K / 32),
        (BF16, 30, 1, 2),
        (TQ1_0, 34, K, 2 + 4 * 13),
        (TQ2_0, 35, K, 2 + 64),
        (MXFP4, 39, 32, 17),
        (NVFP4, 40, 64, 36),
        (Q1_0, 41, 128, 18),
    ]
};

impl GgmlType {
    /// Every type this crate knows.
    pub fn all() -> impl Iterator<Item = GgmlType> {
        TABLE.iter().map(|e| e.0)
    }

    fn entry(self) -> &'static (GgmlType, u32, u64, u64) {
        TABLE.iter().find(|e| e.0 == self).expect("every variant is in the table")
    }

    /// The type with ggml id `id`, if known.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TABLE.iter().find(|e| e.1 == id).map(|e| e.0)
    }

    /// The ggml id written in a GGUF tensor info.
    pub fn id(self) -> u32 {
        self.entry().1
    }

    /// Elements per block (1 for plain types).
    pub fn block_size(self) -> u64 {
        self.entry().2
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> u64 {
        self.entry().3
    }

    /// The bytes of a row of `n` elements, `None` if `n` is not a whole number of blocks or the
    /// size overflows.
    pub fn row_bytes(self, n: u64) -> Option<u64> {
        if !n.is_multiple_of(self.block_size()) {
            return None;
        }
        (n / self.block_size()).checked_mul(self.block_bytes())
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}
