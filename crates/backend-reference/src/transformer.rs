//! The Llama decoder in f32: weights converted once, a per-session KV cache, and the forward pass.

use crate::dense_matrix::DenseMatrix;
use crate::kernels::{self, AttentionShape};
use llama_model::config::rope_cos_sin_from;
use llama_model::{LlamaConfig, LlamaWeights};
use rayon::prelude::*;
use session_api::SeamError;
use std::sync::Arc;

/// One decoder layer's weights in f32.
#[derive(Debug)]
struct Layer {
    attn_norm: Vec<f32>,
    wq: DenseMatrix,
    wk: DenseMatrix,
    wv: DenseMatrix,
    wo: DenseMatrix,
    mlp_norm: Vec<f32>,
    w_gate: DenseMatrix,
    w_up: DenseMatrix,
    w_down: DenseMatrix,
}

/// A whole Llama model in f32, shape-checked against its config so the forward pass cannot
/// index out of bounds.
#[derive(Debug)]
pub struct Transformer {
    config: LlamaConfig,
    shape: AttentionShape,
    /// Rope inverse frequencies (`head_dim / 2`, llama3 scaling applied), computed once.
    rope_inv_freq: Vec<f32>,
    /// `[vocab, hidden]`.
    embed: Arc<DenseMatrix>,
    layers: Vec<Layer>,
    final_norm: Vec<f32>,
    /// `[vocab, hidden]`; the same allocation as `embed` when the embeddings are tied.
    lm_head: Arc<DenseMatrix>,
}

fn shape_error(message: String) -> SeamError {
    SeamError::ModelFormat { path: None, message }
}

fn expect_matrix(name: &str, m: &DenseMatrix, rows: usize, cols: usize) -> Result<(), SeamError> {
    if (m.rows(), m.cols()) != (rows, cols) {
        return Err(shape_error(format!("{name} is [{}, {}], the config needs [{rows}, {cols}]", m.rows(), m.cols())));
    }
    Ok(())
}

fn expect_vector(name: &str, v: &[f32], len: usize) -> Result<(), SeamError> {
    if v.len() != len {
        return Err(shape_error(format!("{name} has {} values, the config needs {len}", v.len())));
    }
    Ok(())
}

impl Transformer {
    /// Converts `weights` to f32 and checks every shape against the config. `progress(done, total)`
    /// is called after each layer.
    pub fn from_weights(weights: &LlamaWeights, progress: &dyn Fn(u64, u64)) -> Result<Self, SeamError> {
        let c = &weights.config;
        // Positive sizes, heads divisible into KV groups, an even head_dim, a sane eps and theta.
        c.validate().map_err(shape_error)?;
        if weights.layers.len() != c.num_hidden_layers {
            return Err(shape_error(format!(
                "{} layers, the config says {}",
                weights.layers.len(),
                c.num_hidden_layers
            )));
        }
        let shape =
            AttentionShape { n_heads: c.num_attention_heads, n_kv_heads: c.num_key_value_heads, head_dim: c.head_dim };
        let (hidden, ffn, vocab) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        let total = weights.layers.len() as u64 + 1;

        let embed = Arc::new(DenseMatrix::from_weight(&weights.embed)?);
        expect_matrix("embed_tokens", &embed, vocab, hidden)?;
        let lm_head = match &weights.lm_head {
            Some(m) => Arc::new(DenseMatrix::from_weight(m)?),
            None => Arc::clone(&embed),
        };
        expect_matrix("lm_head", &lm_head, vocab, hidden)?;
        expect_vector("final norm", &weights.final_norm, hidden)?;
        progress(1, total);

        let mut layers = Vec::with_capacity(weights.layers.len());
        for (i, w) in weights.layers.iter().enumerate() {
            let layer = Layer {
                attn_norm: w.attn_norm.clone(),
                wq: DenseMatrix::from_weight(&w.wq)?,
                wk: DenseMatrix::from_weight(&w.wk)?,
                wv: DenseMatrix::from_weight(&w.wv)?,
                wo: DenseMatrix::from_weight(&w.wo)?,
                mlp_norm: w.mlp_norm.clone(),
                w_gate: DenseMatrix::from_weight(&w.w_gate)?,
                w_up: DenseMatrix::from_weight(&w.w_up)?,
                w_down: DenseMatrix::from_weight(&w.w_down)?,
            };
            let name = |part: &str| format!("layer {i} {part}");
            expect_vector(&name("input_layernorm"), &layer.attn_norm, hidden)?;
            expect_matrix(&name("q_proj"), &layer.wq, shape.q_width(), hidden)?;
            expect_matrix(&name("k_proj"), &layer.wk, shape.kv_width(), hidden)?;
            expect_matrix(&name("v_proj"), &layer.wv, shape.kv_width(), hidden)?;
            expect_matrix(&name("o_proj"), &layer.wo, hidden, shape.q_width())?;
            expect_vector(&name("post_attention_layernorm"), &layer.mlp_norm, hidden)?;
            expect_matrix(&name("gate_proj"), &layer.w_gate, ffn, hidden)?;
            expect_matrix(&name("up_proj"), &layer.w_up, ffn, hidden)?;
            expect_matrix(&name("down_proj"), &layer.w_down, hidden, ffn)?;
            layers.push(layer);
            progress(i as u64 + 2, total);
        }
        Ok(Transformer {
            config: c.clone(),
            shape,
            rope_inv_freq: c.rope_inv_freq(),
            embed,
            layers,
            final_norm: weights.final_norm.clone(),
            lm_head,
        })
    }

    /// The model's config.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// Bytes of resident weights (a tied LM head counted once).
    pub fn weight_bytes(&self) -> u64 {
        let vectors = |v: &Vec<f32>| (v.len() * 4) as u64;
        let layers: u64 = self
            .layers
            .iter()
            .map(|l| {
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down].iter().map(|m| m.bytes()).sum::<u64>()
                    + vectors(&l.attn_norm)
                    + vectors(&l.mlp_norm)
            })
            .sum();
        let head = if Arc::ptr_eq(&self.embed, &self.lm_head) { 0 } else { self.lm_head.bytes() };
        self.embed.bytes() + head + layers + vectors(&self.final_norm)
    }

    /// An empty KV cache for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache { layers: vec![LayerCache::default(); self.layers.len()], len: 0, kv_width: self.shape.kv_width() }
    }

    /// The hidden states of `tokens` (`[tokens.len(), hidden]`): rows of the embedding table.
    /// Token ids must be below `vocab_size` (the session checks them first).
    pub fn embed_tokens(&self, tokens: &[u32]) -> Vec<f32> {
        tokens.iter().flat_map(|&t| self.embed.row(t as usize).iter().copied()).collect()
    }

    /// Runs `hidden` (`[n, hidden_size]`, the inputs at positions `cache.len()..cache.len() + n`)
    /// through the decoder, appends their keys and values to `cache`, and returns the logits of the
    /// last position (`vocab_size` values).
    ///
    /// The caller ensures `n ≥ 1` and that `hidden` has `n * hidden_size` values; room in the cache
    /// is reserved up front, so a failure to allocate leaves the cache untouched.
    pub fn forward(&self, hidden: Vec<f32>, cache: &mut KvCache) -> Result<Vec<f32>, SeamError> {
        self.forward_observed(hidden, cache, None)
    }

    /// [`Transformer::forward`], also pushing onto `layers` (when given) the last position's
    /// hidden state after each decoder layer.
    pub fn forward_observed(
        &self,
        hidden: Vec<f32>,
        cache: &mut KvCache,
        layers: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<f32>, SeamError> {
        let width = self.config.hidden_size;
        let hidden = self.decoder(hidden, cache, layers)?;
        // Only the last position's logits are needed.
        let mut last = vec![0.0f32; width];
        kernels::rms_norm(&hidden[hidden.len() - width..], &self.final_norm, self.config.rms_norm_eps, &mut last);
        Ok(self.lm_head.matvec(&last))
    }

    /// [`Transformer::forward`], returning the logits of every position (`[n, vocab_size]`): each
    /// row is the one `forward` would return for a step ending there, bit for bit (the head's
    /// dot products are the same).
    pub fn forward_all_positions(&self, hidden: Vec<f32>, cache: &mut KvCache) -> Result<Vec<f32>, SeamError> {
        let width = self.config.hidden_size;
        let hidden = self.decoder(hidden, cache, None)?;
        let n = hidden.len() / width;
        let normed = kernels::rms_norm_rows(&hidden, &self.final_norm, self.config.rms_norm_eps);
        Ok(self.lm_head.matmul(&normed, n))
    }

    /// The decoder layers over `hidden` (`[n, hidden_size]`): appends the positions' keys and
    /// values to `cache` and returns the hidden states after the last layer (before the final
    /// norm), pushing the last position's after each layer onto `layers` when given.
    fn decoder(
        &self,
        mut hidden: Vec<f32>,
        cache: &mut KvCache,
        mut layers: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<f32>, SeamError> {
        let width = self.config.hidden_size;
        let n = hidden.len() / width;
        assert!(n >= 1 && hidden.len() == n * width, "forward needs whole hidden-size rows");
        let start = cache.len;
        cache.reserve(n)?;

        // cos/sin depend only on the position: compute them once for all layers.
        let rope: Vec<(Vec<f32>, Vec<f32>)> =
            (start..start + n).map(|p| rope_cos_sin_from(&self.rope_inv_freq, p)).collect();
        let (d, q_width, kv_width) = (self.shape.head_dim, self.shape.q_width(), self.shape.kv_width());
        let eps = self.config.rms_norm_eps;

        for (layer, layer_cache) in self.layers.iter().zip(cache.layers.iter_mut()) {
            // Attention block.
            let normed = kernels::rms_norm_rows(&hidden, &layer.attn_norm, eps);
            let mut q = layer.wq.matmul(&normed, n);
            let mut k = layer.wk.matmul(&normed, n);
            let v = layer.wv.matmul(&normed, n);
            for t in 0..n {
                let (cos, sin) = &rope[t];
                q[t * q_width..(t + 1) * q_width]
                    .chunks_exact_mut(d)
                    .for_each(|head| kernels::apply_rope(head, cos, sin));
                k[t * kv_width..(t + 1) * kv_width]
                    .chunks_exact_mut(d)
                    .for_each(|head| kernels::apply_rope(head, cos, sin));
            }
            layer_cache.keys.extend_from_slice(&k);
            layer_cache.values.extend_from_slice(&v);

            // Query t sits at position start + t and sees positions 0..=start + t (causal mask).
            let mut attention = vec![0.0f32; n * q_width];
            attention.par_chunks_mut(q_width).enumerate().for_each(|(t, out)| {
                let query = &q[t * q_width..(t + 1) * q_width];
                out.copy_from_slice(&kernels::attend(
                    query,
                    &layer_cache.keys,
                    &layer_cache.values,
                    start + t + 1,
                    self.shape,
                ));
            });
            let projected = layer.wo.matmul(&attention, n);
            hidden.iter_mut().zip(&projected).for_each(|(h, p)| *h += p);

            // MLP block.
            let normed = kernels::rms_norm_rows(&hidden, &layer.mlp_norm, eps);
            let gate = layer.w_gate.matmul(&normed, n);
            let up = layer.w_up.matmul(&normed, n);
            let down = layer.w_down.matmul(&kernels::swiglu(&gate, &up), n);
            hidden.iter_mut().zip(&down).for_each(|(h, x)| *h += x);
            if let Some(layers) = layers.as_deref_mut() {
                layers.push(hidden[(n - 1) * width..].to_vec());
            }
        }
        cache.len += n;
        Ok(hidden)
    }
}

/// The cached keys and values of one layer: `[positions, n_kv_heads * head_dim]` each, rope
/// already applied to the keys.
#[derive(Debug, Clone, Default)]
struct LayerCache {
    keys: Vec<f32>,
    values: Vec<f32>,
}

/// One sequence's KV cache. It grows with the sequence rather than being allocated at the
/// session's full capacity, so many short sessions cost little memory.
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<LayerCache>,
    len: usize,
    kv_width: usize,
}

impl KvCache {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Drops every position after the first `len`.
    pub fn truncate(&mut self, len: usize) {
        let values = len * self.kv_width;
        for layer in &mut self.layers {
            layer.keys.truncate(values);
            layer.values.truncate(values);
        }
        self.len = self.len.min(len);
    }

    /// Empties the cache and gives its memory back.
    pub fn clear(&mut self) {
        for layer in &mut self.layers {
            *layer = LayerCache::default();
        }
        self.len = 0;
    }

    /// Makes room for `n` more positions in every layer, failing without changing anything when
    /// memory runs out (so a failed step cannot leave half-appended layers behind).
    fn reserve(&mut self, n: usize) -> Result<(), SeamError> {
        let more = n * self.kv_width;
        for layer in &mut self.layers {
            for buffer in [&mut layer.keys, &mut layer.values] {
                buffer
                    .try_reserve(more)
                    .map_err(|e| SeamError::ResourceExhausted(format!("growing the KV cache by {n} positions: {e}")))?;
            }
        }
        Ok(())
    }
}
