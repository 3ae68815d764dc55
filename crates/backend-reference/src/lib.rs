//! # backend-reference: seam's pure-Rust f32 Llama, the oracle
//!
//! Every other backend is held against this one, and this one is held against Hugging Face
//! transformers' `LlamaForCausalLM` in float32 (token for token on greedy decoding). It is written
//! to be read: weights are converted to f32 once at load ([`dense_matrix`]), the arithmetic of a
//! decoder step is a handful of small functions ([`kernels`]), and the forward pass
//! ([`transformer`]) is one loop over layers. Matrix products run on rayon over output rows.

pub mod dense_matrix;
pub mod engine;
pub mod kernels;
pub mod session;
pub mod transformer;

pub use engine::{EngineOptions, ReferenceEngine};
pub use session::ReferenceSession;

/// The registry name of this backend.
pub const BACKEND_NAME: &str = "reference";
