//! `config.json` and `generation_config.json` of a Hugging Face Llama checkpoint.
//!
//! (Skeleton: field names are the contract other crates code against; parsing is filled in.)

/// llama3-style rope scaling (Llama 3.1 / 3.2): low frequencies are divided by `factor`,
/// high frequencies are kept, and the band between is interpolated smoothly.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: usize,
    },
}

/// A parsed and validated Llama `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// `hidden_size / num_attention_heads` unless `head_dim` is given.
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub tie_word_embeddings: bool,
    /// BOS ids (`bos_token_id` may be an int or a list in config.json).
    pub bos_token_ids: Vec<u32>,
    /// EOS ids (int or list).
    pub eos_token_ids: Vec<u32>,
}

/// `generation_config.json`: the ids and defaults a model was published with.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GenerationConfig {
    pub bos_token_ids: Vec<u32>,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub do_sample: Option<bool>,
    pub max_length: Option<usize>,
}
