//! # backend-reference: seam's pure-Rust f32 Llama, the oracle
//!
//! Every other backend is held against this one, and this one is held against Hugging Face
//! transformers' `LlamaForCausalLM` in float32 (token for token on greedy decoding). It is written
//! to be read: weights are converted to f32 once at load ([`dense_matrix`]), the arithmetic of a
//! decoder step is a handful of small functions ([`kernels`]), and the forward pass
//! ([`transformer`]) is one loop over layers. Matrix products run on rayon over output rows.

pub mod backend;
pub mod dense_matrix;
pub mod engine;
pub mod kernels;
pub mod session;
pub mod transformer;

pub use backend::{cpu_device, ReferenceBackend};
pub use engine::{EngineOptions, ReferenceEngine};
pub use session::ReferenceSteps;

/// The registry name of this backend.
pub const BACKEND_NAME: &str = "reference";

session_api::register_backend!(BACKEND_NAME, || Box::new(ReferenceBackend));

/// Does nothing, on purpose: binaries call it so the linker keeps this crate, and with it the
/// backend's registration (see `session_api::registry` for why an unreferenced crate's
/// `inventory` entries can be dropped).
pub fn link() {}
