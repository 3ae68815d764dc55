//! Capabilities: what a backend (and an engine loaded by it) can do, as data.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The weight format a model is loaded in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightFormat {
    /// 16-bit floating point weights.
    F16,
    /// seam's affine int4 format: groups of 32 along the input dimension, f16 scale and bias.
    Int4,
}

impl WeightFormat {
    /// Every format, in a stable order.
    pub const ALL: [WeightFormat; 2] = [WeightFormat::F16, WeightFormat::Int4];

    /// The name used on the command line and in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            WeightFormat::F16 => "f16",
            WeightFormat::Int4 => "int4",
        }
    }
}

impl fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for WeightFormat {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f16" | "fp16" => Ok(WeightFormat::F16),
            "int4" | "q4" => Ok(WeightFormat::Int4),
            other => Err(format!("unknown weight format '{other}' (expected f16 or int4)")),
        }
    }
}

/// Which sampling modes a session can run on the backend side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SamplingModes {
    /// Argmax. Every backend must support it.
    pub greedy: bool,
    /// Temperature sampling from the softmax.
    pub temperature: bool,
    /// Restricting to the k most likely tokens.
    pub top_k: bool,
    /// Nucleus (top-p) restriction.
    pub top_p: bool,
    /// A seed makes sampling reproducible.
    pub seeded: bool,
}

impl SamplingModes {
    /// Greedy only.
    pub const GREEDY_ONLY: SamplingModes =
        SamplingModes { greedy: true, temperature: false, top_k: false, top_p: false, seeded: false };
    /// Every mode.
    pub const ALL: SamplingModes =
        SamplingModes { greedy: true, temperature: true, top_k: true, top_p: true, seeded: true };
}

/// Operations on a session's sequence state beyond append and reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct KvOps {
    /// [`crate::Session::truncate`]: rewind to an earlier position.
    pub truncate: bool,
    /// [`crate::Session::fork`]: copy a session, state included.
    pub fork: bool,
}

/// What a session accepts as input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct InputKinds {
    /// Token ids. Every backend must accept them.
    pub tokens: bool,
    /// Hidden-size embedding vectors ([`crate::Session::prefill_embeddings`]), for multimodal inputs.
    pub embeddings: bool,
}

/// The kind of per-sequence state a session carries. Attention models keep a KV cache that grows
/// with the sequence; state-space / recurrent layers keep a fixed-size state, and hybrids keep both.
/// Only `KvCache` is implemented today; the others are named so the contract need not change later.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateKind {
    #[default]
    KvCache,
    Recurrent,
    Hybrid,
}

/// What a backend, or an engine it loaded, can do.
///
/// A backend's [`crate::Backend::capabilities`] describes what it offers for any model; an engine's
/// [`crate::Engine::capabilities`] is the same with the limits of the loaded model filled in
/// (for example `max_context`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Capabilities {
    /// Most positions one session can hold (prompt plus generated tokens).
    pub max_context: usize,
    /// Weight formats the backend loads.
    pub weight_formats: Vec<WeightFormat>,
    /// Sampling the backend performs itself.
    pub sampling: SamplingModes,
    /// Whether a session can return the logits of each step ([`crate::SessionOptions::return_logits`]).
    pub logits: bool,
    /// Rewind and fork.
    pub kv_ops: KvOps,
    /// Accepted inputs.
    pub inputs: InputKinds,
    /// Most sessions alive at once on one engine; `None` means limited only by memory.
    pub max_concurrent_sessions: Option<usize>,
    /// Whether sessions may run on different threads at the same time.
    pub parallel_sessions: bool,
    /// The kind of sequence state.
    pub state: StateKind,
    /// Whether a session can return the hidden state after each decoder layer
    /// ([`crate::SessionOptions::return_hidden_states`]): a diagnostic for comparing a backend
    /// with the reference layer by layer, not needed to run models.
    pub hidden_states: bool,
    /// Whether the engine decodes many sessions in one device call
    /// ([`crate::Engine::decode_batch_steps`] overridden: weights read once per step for the whole
    /// batch). Every engine accepts batches (`decode_batch`); without this they are stepped one
    /// by one.
    pub batched_decode: bool,
    /// Whether a prefill can return the logits of every position it appends, in one step
    /// ([`crate::Session::prefill_scored`]; [`crate::SessionSteps::append_scoring`] implemented).
    /// Without it `prefill_scored` still works, one decode step per position.
    #[serde(default)]
    pub logits_per_position: bool,
}

impl Capabilities {
    /// Everything the contract names today for a sequence of at most `max_context` positions:
    /// both weight formats, every sampling mode, logits, truncate and fork, tokens and embeddings,
    /// parallel sessions; no batched decode, no hidden states and no per-position logits (each
    /// claimed by a backend on its own).
    pub fn all(max_context: usize) -> Capabilities {
        Capabilities {
            max_context,
            weight_formats: WeightFormat::ALL.to_vec(),
            sampling: SamplingModes::ALL,
            logits: true,
            kv_ops: KvOps { truncate: true, fork: true },
            inputs: InputKinds { tokens: true, embeddings: true },
            max_concurrent_sessions: None,
            parallel_sessions: true,
            state: StateKind::KvCache,
            hidden_states: false,
            batched_decode: false,
            logits_per_position: false,
        }
    }

    /// Whether `format` is one of [`Capabilities::weight_formats`].
    pub fn supports_format(&self, format: WeightFormat) -> bool {
        self.weight_formats.contains(&format)
    }

    /// What `needed` asks for that these capabilities lack, one name per missing feature, in a
    /// stable order (empty when everything is there). Limits (`max_context`, session counts)
    /// are not compared: they are checked where a request meets them.
    pub fn missing(&self, needed: &Capabilities) -> Vec<&'static str> {
        let (n, o) = (needed, self);
        let features = [
            (n.sampling.greedy && !o.sampling.greedy, "greedy sampling"),
            (n.sampling.temperature && !o.sampling.temperature, "temperature sampling"),
            (n.sampling.top_k && !o.sampling.top_k, "top-k sampling"),
            (n.sampling.top_p && !o.sampling.top_p, "top-p sampling"),
            (n.sampling.seeded && !o.sampling.seeded, "seeded sampling"),
            (n.logits && !o.logits, "returning logits"),
            (n.kv_ops.truncate && !o.kv_ops.truncate, "truncate"),
            (n.kv_ops.fork && !o.kv_ops.fork, "fork"),
            (n.inputs.tokens && !o.inputs.tokens, "token input"),
            (n.inputs.embeddings && !o.inputs.embeddings, "prefill from embeddings"),
            (n.parallel_sessions && !o.parallel_sessions, "parallel sessions"),
            (n.hidden_states && !o.hidden_states, "returning hidden states"),
            (n.batched_decode && !o.batched_decode, "batched decode"),
            (n.logits_per_position && !o.logits_per_position, "logits of every position"),
        ];
        let formats = WeightFormat::ALL.into_iter().filter(|f| n.supports_format(*f) && !o.supports_format(*f)).map(
            |f| match f {
                WeightFormat::F16 => "f16 weights",
                WeightFormat::Int4 => "int4 weights",
            },
        );
        features.into_iter().filter(|(lacking, _)| *lacking).map(|(_, name)| name).chain(formats).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_names_what_is_needed_and_lacking() {
        let offered = Capabilities {
            sampling: SamplingModes::GREEDY_ONLY,
            weight_formats: vec![WeightFormat::F16],
            kv_ops: KvOps { truncate: true, fork: false },
            ..Capabilities::default()
        };
        assert!(offered.missing(&Capabilities::default()).is_empty());
        let needed = Capabilities {
            sampling: SamplingModes { top_p: true, ..SamplingModes::GREEDY_ONLY },
            weight_formats: vec![WeightFormat::Int4, WeightFormat::F16],
            kv_ops: KvOps { truncate: true, fork: true },
            logits: true,
            ..Capabilities::default()
        };
        assert_eq!(offered.missing(&needed), vec!["top-p sampling", "returning logits", "fork", "int4 weights"]);
    }
}
