//! # cpu-kernels: the decode hot loops, written once for every CPU runtime
//!
//! A decode step of a small language model is a chain of matrix-vector products whose cost is the
//! bytes of the weights, plus attention over the cached positions. Compilers that see these as
//! generic dots widen the stored weights first (XLA's CPU backend holds f16 as f32 and
//! materializes dequantized int4 matrices), so they read two to seven times the bytes the model
//! holds. These kernels read the weights as stored and widen them in registers:
//!
//! - [`matmul_f16`]: `y = x W^T` for f16 `W` `[N, K]` and f32 `x` `[T, K]`;
//! - [`matmul_int4`]: the same for seam's int4 format (ADR 0002: groups of 32 along `K`, an f16
//!   scale and bias per group, element `2i` in the low nibble);
//! - [`matmul_int8`]: the same for seam's int8 format (ADR 0013: groups of 32 along `K`, an f16
//!   scale per group; an int4 model's embedding and output head);
//!
//! - [`matmul_int4_q8`], [`matmul_int8_q8`]: the same over activations rounded to int8 per group
//!   ([`Activations::Int8`]), in integer dot products of four;
//! - [`matmul_int4_panels`], [`matmul_int8_panels`] and their `_q8` twins: the same products over
//!   weights laid out in panels of 16 rows ([`int4_to_panels`], [`int8_to_panels`]; ADR 0025),
//!   one row per register lane;
//!
//!   each of the exact three converts the weights in registers as it reads them, for a few tokens once
//!   per block of four, and from a dozen tokens on (a prefill chunk, a large batch) runs as a
//!   blocked matrix-matrix product over weights converted once per call;
//! - [`linear`]: any of these products with the RMSNorm or SwiGLU before it and the residual add after
//!   it, so a runtime makes one call where a graph would make six ([`set_input_reuse`]: calls
//!   that split one product's rows with the same input prepare it once, ADR 0030);
//! - [`attention_decode`]: one query position against the first `len` positions of a KV cache in
//!   seam's layout (keys `[KVH, D, C]`, values `[KVH, C, D]`), grouped-query heads included;
//!   [`attention_causal`]: the same for a run of consecutive positions (a prefill chunk), each
//!   row over the positions up to its own; [`attention_decode_batch`]: a batch's decodes in one
//!   call of the pool (ADR 0031);
//! - [`argmax_rows`]: each row's greedy token (a batched decode's sequences').
//!
//! Every kernel has a plain scalar definition ([`scalar`]) that the tests hold the fast paths to,
//! and picks its instruction set at run time ([`Isa`]). Work is split over a persistent pool of
//! workers ([`pool`]) with no allocation per call.
//!
//! The reference backend does not use these kernels: it stays the readable oracle they are tested
//! against (through the backends that call them).

mod argmax;
mod attention;
pub mod bandwidth;
mod f16_tiles;
mod gemm;
mod isa;
mod linear;
mod matmul;
mod panels;
pub mod pool;
mod q8;
mod reuse;
pub mod scalar;
mod scratch;
mod simd;
mod vnni;

pub use argmax::argmax_rows;
pub use attention::{
    attention_causal, attention_decode, attention_decode_batch, attention_decode_part, decode_spans,
    merge_decode_parts, write_cache_entries, write_cache_entry, AttentionShape, CacheElement, CausalQueries,
    StepEntries, DECODE_PARTS,
};
pub use isa::Isa;
pub use linear::{
    linear, linear_group, rope_heads, rope_rows, share_parts, LinearInput, LinearWeights, GROUP_MAX_TOKENS,
};
pub use matmul::{
    matmul_f16, matmul_int4, matmul_int4_q8, matmul_int8, matmul_int8_q8, F16Matrix, Int4Matrix, Int8Matrix, GROUP_SIZE,
};
pub use panels::{
    int4_from_panels, int4_to_panels, int8_from_panels, int8_to_panels, matmul_int4_panels, matmul_int4_panels_q8,
    matmul_int8_panels, matmul_int8_panels_q8, PANEL_CHUNK, PANEL_ROWS,
};
pub use q8::round_int8;
pub use reuse::set_input_reuse;

/// How an int4 or int8 product takes its activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Activations {
    /// As they are, to f32's precision: the product of the f32 activations and the weights as the
    /// format defines them.
    #[default]
    Exact,
    /// Rounded per group of 32 to int8 multiples of the group's largest magnitude / 127
    /// ([`round_int8`]) before the product, as llama.cpp's quantized products round theirs:
    /// a quarter of the instructions per weight on AVX-512 VNNI, at a rounding error of up to
    /// 1/254 of each group's largest activation (ADR 0024).
    Int8,
}

impl Activations {
    /// [`Activations::Int8`] when `int8`, else [`Activations::Exact`] (for a runtime's entry point
    /// that has the choice as a const parameter).
    pub const fn int8_when(int8: bool) -> Activations {
        if int8 {
            Activations::Int8
        } else {
            Activations::Exact
        }
    }
}

use std::fmt;

/// A kernel's arguments do not describe each other (lengths disagree with the shape).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeError(pub String);

impl fmt::Display for ShapeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "kernel arguments disagree: {}", self.0)
    }
}

impl std::error::Error for ShapeError {}

fn check_len(what: &str, actual: usize, expected: usize) -> Result<(), ShapeError> {
    if actual == expected {
        Ok(())
    } else {
        Err(ShapeError(format!("{what} has {actual} elements, the shape needs {expected}")))
    }
}
