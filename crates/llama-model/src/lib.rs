//! `llama-model`: what every Llama backend of seam needs, written once.
//!
//! - [`config`]: `config.json` / `generation_config.json` of a Hugging Face Llama checkpoint,
//!   including llama3 rope scaling and the rope frequencies every backend must use.
//! - [`tensor_store`]: memory-mapped (possibly sharded) safetensors in f32 / f16 / bf16.
//! - [`int4`]: seam's affine 4-bit weight format (groups of 32, f16 scale and bias) and its quantizer.
//! - [`weights`]: [`weights::LlamaWeights`], the backend-neutral host copy of a model's weights in
//!   one [`session_api::WeightFormat`].
//! - [`model_dir`]: the on-disk layout of a seam model directory.
//! - [`import`]: GGUF → model directory (`seam convert`); [`export`]: model directory → GGUF
//!   (`seam export-gguf`), both following [`gguf_layout`], llama.cpp's conventions written once.
//! - [`random`]: test data: the one deterministic random number generator of the tests, the tiny
//!   configs, random-weight checkpoints for tests and benchmarks.
//! - [`home`]: where seam keeps its files (`.seam/`, `SEAM_HOME`, `SEAM_CACHE_DIR`).
//! - [`default_model`]: locating and installing the default model (SmolLM2-135M-Instruct).

pub mod config;
pub mod default_model;
pub mod error;
pub mod export;
pub mod gguf_layout;
pub mod home;
pub mod import;
pub mod int4;
pub mod int8;
pub mod model_dir;
pub mod random;
pub mod tensor_store;
pub mod weights;

pub use config::{GenerationConfig, LlamaConfig, RopeScaling};
pub use error::ModelError;

pub use int4::Int4Matrix;
pub use int8::Int8Matrix;
pub use weights::{Int4Layout, LayerWeights, LlamaWeights, Matrix, MatrixFormat};
