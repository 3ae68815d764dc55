//! The backend-neutral host copy of a Llama model's weights.
//!
//! Every backend (the reference interpreter, the compiler backends) starts from a [`LlamaWeights`]:
//! it validates shapes once, here, so that a backend never sees a malformed model.

use crate::config::LlamaConfig;
use crate::int4::Int4Matrix;
use half::f16;

/// A linear weight of shape `[rows, cols]` = `[out_features, in_features]` (Hugging Face layout:
/// `y = W x`, row `r` holds the weights of output `r`). The embedding table uses the same type with
/// `rows = vocab_size`, `cols = hidden_size`, so a token's embedding is one row.
#[derive(Debug, Clone)]
pub enum Matrix {
    /// Row-major f16 values, `rows * cols` of them.
    F16 { rows: usize, cols: usize, data: Vec<f16> },
    /// seam's int4 format, see [`crate::int4`].
    Int4(Int4Matrix),
}

/// The weights of one decoder layer.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// RMSNorm weight before attention, `[hidden]`.
    pub attn_norm: Vec<f32>,
    /// `[n_heads * head_dim, hidden]`.
    pub wq: Matrix,
    /// `[n_kv_heads * head_dim, hidden]`.
    pub wk: Matrix,
    /// `[n_kv_heads * head_dim, hidden]`.
    pub wv: Matrix,
    /// `[hidden, n_heads * head_dim]`.
    pub wo: Matrix,
    /// RMSNorm weight before the MLP, `[hidden]`.
    pub mlp_norm: Vec<f32>,
    /// `[intermediate, hidden]`.
    pub w_gate: Matrix,
    /// `[intermediate, hidden]`.
    pub w_up: Matrix,
    /// `[hidden, intermediate]`.
    pub w_down: Matrix,
}

/// All weights of a Llama model, in one weight format, validated against its config.
#[derive(Debug, Clone)]
pub struct LlamaWeights {
    pub config: LlamaConfig,
    /// `[vocab, hidden]`.
    pub embed: Matrix,
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm weight, `[hidden]`.
    pub final_norm: Vec<f32>,
    /// `[vocab, hidden]`; `None` when the embeddings are tied (the LM head is `embed`).
    pub lm_head: Option<Matrix>,
}
