//! The on-disk layout of a seam model directory (a Hugging Face checkpoint directory plus seam's
//! own int4 weight file).

/// The model's `config.json`.
pub const CONFIG_FILE: &str = "config.json";
/// Generation defaults (`generation_config.json`); optional.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
/// The Hugging Face `tokenizers` file.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// Tokenizer settings and chat template.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// Single-file weights (f16, bf16 or f32).
pub const SAFETENSORS_FILE: &str = "model.safetensors";
/// Index of a sharded checkpoint: `{"weight_map": {tensor: shard}}`.
pub const SAFETENSORS_INDEX_FILE: &str = "model.safetensors.index.json";
/// seam's int4 weights (see [`crate::int4`]).
pub const INT4_WEIGHTS_FILE: &str = "model.int4.safetensors";
