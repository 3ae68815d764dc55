//! How llama.cpp lays a Llama out in a GGUF file, written once for both directions: the importer
//! ([`crate::import`], GGUF → model directory) and the exporter ([`crate::export`], model
//! directory → GGUF) use the same tables, so they cannot drift apart.
//!
//! - Tensor names: [`gguf_name`] / [`hf_name`], from one table.
//! - The q/k row order of llama.cpp's rope: [`rope_order`] (both directions), and which tensors
//!   it applies to ([`rope_permuted_heads`]).
//! - llama3 rope scaling, stored as per-frequency divisors in [`ROPE_FREQS_TENSOR`]:
//!   [`rope_freq_divisors`].
//! - Tokenizer conventions: [`token_type`] values and the pre-tokenizers llama.cpp names
//!   (`tokenizer.ggml.pre`), in [`pre_tokenizer`].

pub mod pre_tokenizer;
pub mod rope_order;

use crate::config::LlamaConfig;
use crate::weights::names;

/// The tensors of a decoder layer: the Hugging Face name after `model.layers.N.`, and llama.cpp's
/// name between `blk.N.` and `.weight`.
const LAYER_TENSORS: [(&str, &str); 9] = [
    (names::INPUT_LAYERNORM, "attn_norm"),
    (names::Q_PROJ, "attn_q"),
    (names::K_PROJ, "attn_k"),
    (names::V_PROJ, "attn_v"),
    (names::O_PROJ, "attn_output"),
    (names::POST_ATTENTION_LAYERNORM, "ffn_norm"),
    (names::GATE_PROJ, "ffn_gate"),
    (names::UP_PROJ, "ffn_up"),
    (names::DOWN_PROJ, "ffn_down"),
];

/// The tensors outside the layers: Hugging Face name, GGUF name.
const MODEL_TENSORS: [(&str, &str); 3] = [
    (names::EMBED_TOKENS, "token_embd.weight"),
    (names::FINAL_NORM, "output_norm.weight"),
    (names::LM_HEAD, "output.weight"),
];

/// The GGUF tensor llama.cpp's converter writes for llama3 rope scaling: one divisor per rope
/// frequency (what llama.cpp divides its plain frequency by). It has no Hugging Face counterpart.
pub const ROPE_FREQS_TENSOR: &str = "rope_freqs.weight";

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
pub mod token_type {
    /// An ordinary vocabulary entry.
    pub const NORMAL: i32 = 1;
    /// A special token (BOS, EOS, chat markers): matched on the raw text, hidden when decoding
    /// with special tokens skipped.
    pub const CONTROL: i32 = 3;
    /// An added token that is not special.
    pub const USER_DEFINED: i32 = 4;
    /// A padding row without a token.
    pub const UNUSED: i32 = 5;
}

/// The GGUF name of the Hugging Face tensor `hf` (`model.layers.3.self_attn.q_proj.weight` →
/// `blk.3.attn_q.weight`), or `None` for a tensor a Llama does not have.
pub fn gguf_name(hf: &str) -> Option<String> {
    if let Some((_, gguf)) = MODEL_TENSORS.iter().find(|(h, _)| *h == hf) {
        return Some(gguf.to_string());
    }
    let (layer, suffix) = hf.strip_prefix("model.layers.")?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (_, short) = LAYER_TENSORS.iter().find(|(h, _)| *h == suffix)?;
    Some(format!("blk.{layer}.{short}.weight"))
}

/// The Hugging Face name of the GGUF tensor `gguf` (the inverse of [`gguf_name`]), or `None` for a
/// tensor without one (biases, [`ROPE_FREQS_TENSOR`], other architectures' tensors).
pub fn hf_name(gguf: &str) -> Option<String> {
    if let Some((hf, _)) = MODEL_TENSORS.iter().find(|(_, g)| *g == gguf) {
        return Some(hf.to_string());
    }
    let (layer, rest) = gguf.strip_prefix("blk.")?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let short = rest.strip_suffix(".weight")?;
    let (suffix, _) = LAYER_TENSORS.iter().find(|(_, g)| *g == short)?;
    Some(names::layer(layer, suffix))
}

/// For the q and k projections, the head count llama.cpp's converter permutes their rows with (see
/// [`rope_order`]); `None` for every other tensor.
pub fn rope_permuted_heads(hf: &str, config: &LlamaConfig) -> Option<usize> {
    if hf.ends_with(names::Q_PROJ) {
        Some(config.num_attention_heads)
    } else if hf.ends_with(names::K_PROJ) {
        Some(config.num_key_value_heads)
    } else {
        None
    }
}

/// llama3 rope scaling as llama.cpp stores it: per rope frequency, the plain frequency divided by
/// the scaled one (1 where scaling leaves it alone). `None` without rope scaling.
pub fn rope_freq_divisors(config: &LlamaConfig) -> Option<Vec<f32>> {
    config.rope_scaling.as_ref()?;
    let plain = LlamaConfig { rope_scaling: None, ..config.clone() }.rope_inv_freq();
    Some(plain.iter().zip(config.rope_inv_freq()).map(|(p, s)| p / s).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::expected_tensors;

    #[test]
    fn names_map_both_ways() {
        assert_eq!(gguf_name("model.layers.12.self_attn.o_proj.weight").unwrap(), "blk.12.attn_output.weight");
        assert_eq!(gguf_name("model.layers.0.post_attention_layernorm.weight").unwrap(), "blk.0.ffn_norm.weight");
        assert_eq!(gguf_name("model.embed_tokens.weight").unwrap(), "token_embd.weight");
        assert_eq!(gguf_name("model.layers.x.mlp.up_proj.weight"), None);
        assert_eq!(gguf_name("model.layers.1.mlp.fc.weight"), None);
        assert_eq!(hf_name("blk.3.ffn_down.weight").unwrap(), "model.layers.3.mlp.down_proj.weight");
        assert_eq!(hf_name("output.weight").unwrap(), "lm_head.weight");
        assert_eq!(hf_name("blk.0.attn_q.bias"), None);
        assert_eq!(hf_name(ROPE_FREQS_TENSOR), None);
        // Every tensor of a Llama has a GGUF name, and it maps back.
        let config = crate::random::tiny_config();
        for spec in expected_tensors(&config) {
            let g = gguf_name(&spec.name).unwrap_or_else(|| panic!("{} has no GGUF name", spec.name));
            assert_eq!(hf_name(&g).as_deref(), Some(spec.name.as_str()));
        }
    }

    #[test]
    fn only_q_and_k_are_permuted() {
        let config = crate::random::tiny_config();
        assert_eq!(rope_permuted_heads("model.layers.1.self_attn.q_proj.weight", &config), Some(4));
        assert_eq!(rope_permuted_heads("model.layers.1.self_attn.k_proj.weight", &config), Some(2));
        assert_eq!(rope_permuted_heads("model.layers.1.self_attn.v_proj.weight", &config), None);
    }

    #[test]
    fn rope_divisors_exist_only_with_scaling() {
        assert_eq!(rope_freq_divisors(&crate::random::tiny_config()), None);
        let d = rope_freq_divisors(&crate::random::tiny_llama32_config()).unwrap();
        assert_eq!(d.len(), 8);
        assert_eq!(d[0], 1.0);
        assert!(d[2..].iter().all(|&x| x == 8.0), "{d:?}");
    }
}
