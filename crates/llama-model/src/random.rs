//! Test data, in one place: the deterministic random number generator [`Rng`], the tiny model
//! configs ([`tiny_config`], [`tiny_llama32_config`]) and the shapes of real models, and random-weight
//! checkpoints built from them ([`random_weights`], [`write_random_checkpoint`]), for tests and
//! benchmarks across the workspace.
//!
//! Everything here is deterministic and stable across releases: the same seed gives the same
//! numbers on every machine, thread count and version of seam (tests below pin them). That is a
//! promise other crates rely on: the conformance suite caches generated checkpoints on disk keyed
//! by config and seed only, so a change to the generator would silently leave stale weights in
//! those caches. Changing any output here is a breaking change.
//!
//! Checkpoints: every tensor draws from its own stream (seeded by the seed and the tensor's name),
//! and large tensors are cut into fixed-size chunks with streams of their own, so chunks can be
//! generated in parallel and the bytes do not depend on the number of threads.

use crate::config::{GenerationConfig, LlamaConfig, RopeScaling};
use crate::error::ModelError;
use crate::model_dir::{CONFIG_FILE, GENERATION_CONFIG_FILE, SAFETENSORS_FILE};
use crate::weights::{
    assemble, expected_tensors, write_f16_weights, LlamaWeights, Loaded, Matrix, TensorRole, TensorSpec,
};
use half::{f16, slice::HalfFloatSliceExt};
use rayon::prelude::*;
use std::path::Path;

/// Elements per independently seeded chunk.
const CHUNK: usize = 1 << 16;

/// A small Llama: vocab 256, hidden 64, 2 layers, 4 heads of 16, 2 KV heads, FFN 128, untied
/// embeddings, plain rope (theta 10000), 512 positions.
pub fn tiny_config() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 256,
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 16,
        max_position_embeddings: 512,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        tie_word_embeddings: false,
        bos_token_ids: vec![1],
        eos_token_ids: vec![2],
    }
}

/// [`tiny_config`] shaped like Llama 3.2: tied embeddings, rope theta 500000 with llama3 scaling
/// (factor 8, low 1, high 4, original context 64, chosen so that the 8 frequencies of a 16-wide
/// head fall in all three bands: one unchanged, one smoothed, six divided), several EOS ids, and
/// `head_dim` written explicitly in config.json.
pub fn tiny_llama32_config() -> LlamaConfig {
    LlamaConfig {
        rope_theta: 500_000.0,
        rope_scaling: Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        }),
        tie_word_embeddings: true,
        eos_token_ids: vec![2, 3],
        ..tiny_config()
    }
}

/// The dimensions of Llama-3.2-1B (weights cannot be downloaded here; benchmarks use random ones).
pub fn llama32_1b_config() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 128_256,
        hidden_size: 2048,
        intermediate_size: 8192,
        num_hidden_layers: 16,
        num_attention_heads: 32,
        num_key_value_heads: 8,
        head_dim: 64,
        max_position_embeddings: 131_072,
        rms_norm_eps: 1e-5,
        rope_theta: 500_000.0,
        rope_scaling: Some(RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }),
        tie_word_embeddings: true,
        bos_token_ids: vec![128_000],
        eos_token_ids: vec![128_001, 128_008, 128_009],
    }
}

/// The dimensions of SmolLM2-135M (the default model's shape), for benchmarks on random weights.
pub fn smollm2_135m_config() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 49_152,
        hidden_size: 576,
        intermediate_size: 1536,
        num_hidden_layers: 30,
        num_attention_heads: 9,
        num_key_value_heads: 3,
        head_dim: 64,
        max_position_embeddings: 8192,
        rms_norm_eps: 1e-5,
        rope_theta: 100_000.0,
        rope_scaling: None,
        tie_word_embeddings: true,
        bos_token_ids: vec![1],
        eos_token_ids: vec![2],
    }
}

/// The SplitMix64 finalizer: turns any 64-bit value into a well-mixed one. Used to derive seeds
/// (of a stream, of a tensor, of a chunk) from simple inputs such as `1, 2, 3`; it is a hash, not a
/// generator (use [`Rng`] for a sequence).
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// FNV-1a of a tensor name, so each tensor gets its own stream.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

/// The workspace's deterministic random number generator for test data: xorshift64* (Vigna 2016)
/// seeded through [`mix64`], so nearby seeds give unrelated streams.
///
/// Not for product code (sampling has its own stream in `session_api::sampling`) and not
/// cryptographic. The sequence for a given seed is stable across releases (see the module docs):
/// its first values are pinned by a test.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A stream for `seed`; any value, zero included, is a good seed.
    pub fn new(seed: u64) -> Rng {
        // xorshift must not start at zero.
        Rng { state: mix64(seed) | 1 }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        self.state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `[-1, 1)`, with 24 random bits (every value is exact in f32).
    pub fn uniform(&mut self) -> f32 {
        // The high bits of xorshift64* are its best ones.
        let bits = self.next_u64() >> 40;
        bits as f32 * (2.0 / (1u64 << 24) as f32) - 1.0
    }

    /// `n` values uniform in `[-amplitude, amplitude)`.
    pub fn uniform_vec(&mut self, n: usize, amplitude: f32) -> Vec<f32> {
        (0..n).map(|_| amplitude * self.uniform()).collect()
    }

    /// Uniform in `0..n` (`n > 0`), e.g. a token id. The modulo bias is below `n / 2^64`, far
    /// beneath anything a test can notice.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "Rng::below(0)");
        self.next_u64() % n
    }
}

/// `n` values `center + amplitude * u`, `u` uniform in `[-1, 1)`, rounded to f16.
fn random_f16(seed: u64, name: &str, n: usize, center: f32, amplitude: f32) -> Vec<f16> {
    let tensor_seed = mix64(seed ^ name_hash(name));
    let mut out = vec![f16::ZERO; n];
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(chunk, values)| {
        let mut stream = Rng::new(tensor_seed.wrapping_add(chunk as u64));
        let scratch: Vec<f32> = (0..values.len()).map(|_| center + amplitude * stream.uniform()).collect();
        // The slice conversion is vectorized (F16C); per-element conversion is several times slower.
        values.convert_from_f32_slice(&scratch);
    });
    out
}

/// Random weights for `config`: matrices uniform with standard deviation `1 / sqrt(fan_in)` (so
/// every projection keeps activations near unit scale and logits spread out), norms in
/// `1 ± 0.1`. Norm values are f16-representable, so f16 and f32 storage hold the same numbers.
pub fn random_weights(config: &LlamaConfig, seed: u64) -> Result<LlamaWeights, ModelError> {
    config.validate().map_err(|message| ModelError::Config { path: None, message })?;
    let make = |spec: &TensorSpec| -> Loaded {
        match spec.role {
            TensorRole::Norm => {
                Loaded::Norm(random_f16(seed, &spec.name, spec.shape[0], 1.0, 0.1).into_iter().map(f32::from).collect())
            }
            TensorRole::Matrix => {
                let (rows, cols) = (spec.shape[0], spec.shape[1]);
                // Uniform on [-a, a] has standard deviation a / sqrt(3).
                let amplitude = (3.0 / cols as f32).sqrt();
                Loaded::Matrix(Matrix::F16 {
                    rows,
                    cols,
                    data: random_f16(seed, &spec.name, rows * cols, 0.0, amplitude),
                })
            }
        }
    };
    Ok(assemble(config, expected_tensors(config).iter().map(make).collect()))
}

/// Writes a complete random checkpoint into `dir` (created if needed): `config.json`,
/// `generation_config.json` (the config's BOS / EOS ids) and f16 `model.safetensors`.
/// No tokenizer is written.
pub fn write_random_checkpoint(dir: &Path, config: &LlamaConfig, seed: u64) -> Result<(), ModelError> {
    let weights = random_weights(config, seed)?;
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let config_path = dir.join(CONFIG_FILE);
    std::fs::write(&config_path, config.to_json()).map_err(|e| ModelError::io(config_path, e))?;
    let generation = GenerationConfig {
        bos_token_ids: config.bos_token_ids.clone(),
        eos_token_ids: config.eos_token_ids.clone(),
        ..GenerationConfig::default()
    };
    let generation_path = dir.join(GENERATION_CONFIG_FILE);
    std::fs::write(&generation_path, generation.to_json()).map_err(|e| ModelError::io(generation_path, e))?;
    write_f16_weights(&dir.join(SAFETENSORS_FILE), &weights)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_are_valid_and_round_trip() {
        for c in [tiny_config(), tiny_llama32_config(), llama32_1b_config(), smollm2_135m_config()] {
            c.validate().unwrap();
            assert_eq!(LlamaConfig::from_json_str(&c.to_json()).unwrap(), c);
        }
        let v: serde_json::Value = serde_json::from_str(&tiny_llama32_config().to_json()).unwrap();
        assert_eq!(v["head_dim"], 16);
    }

    #[test]
    fn tiny_llama32_exercises_every_rope_band() {
        let c = tiny_llama32_config();
        let scaled = c.rope_inv_freq();
        let plain = LlamaConfig { rope_scaling: None, ..c.clone() }.rope_inv_freq();
        assert_eq!(scaled[0], plain[0]);
        assert!(scaled[1] < plain[1] && scaled[1] > plain[1] / 8.0);
        for i in 2..8 {
            assert_eq!(scaled[i], plain[i] / 8.0);
        }
    }

    #[test]
    fn weights_are_deterministic_and_sane() {
        let c = tiny_config();
        let a = random_weights(&c, 5).unwrap();
        let b = random_weights(&c, 5).unwrap();
        let other = random_weights(&c, 6).unwrap();
        let values = |w: &LlamaWeights| w.layers[1].wq.to_f32();
        assert_eq!(values(&a), values(&b));
        assert_ne!(values(&a), values(&other));
        // Different tensors of the same shape differ.
        assert_ne!(a.layers[0].wq.to_f32(), a.layers[1].wq.to_f32());
        // Standard deviation close to 1/sqrt(fan_in), mean close to 0.
        let v = a.layers[0].w_down.to_f32();
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let std = (v.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / v.len() as f32).sqrt();
        let want = 1.0 / (c.intermediate_size as f32).sqrt();
        assert!(mean.abs() < 0.1 * want, "mean {mean}");
        assert!((std / want - 1.0).abs() < 0.1, "std {std} want {want}");
        assert!(a.final_norm.iter().all(|&x| (0.89..=1.11).contains(&x)));
        assert!(a.lm_head.is_some());
        assert!(random_weights(&tiny_llama32_config(), 1).unwrap().lm_head.is_none());
        a.validate().unwrap();
    }

    #[test]
    fn checkpoint_files_are_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model");
        write_random_checkpoint(&path, &tiny_llama32_config(), 3).unwrap();
        assert_eq!(LlamaConfig::from_file(&path.join(CONFIG_FILE)).unwrap(), tiny_llama32_config());
        let g = GenerationConfig::from_dir_or_default(&path).unwrap();
        assert_eq!(g.eos_token_ids, vec![2, 3]);
        let bytes = std::fs::read(path.join(SAFETENSORS_FILE)).unwrap();
        // Same bytes every time.
        write_random_checkpoint(&path, &tiny_llama32_config(), 3).unwrap();
        assert_eq!(std::fs::read(path.join(SAFETENSORS_FILE)).unwrap(), bytes);
        let mut bad = tiny_config();
        bad.num_key_value_heads = 3;
        assert!(matches!(write_random_checkpoint(&path, &bad, 3), Err(ModelError::Config { .. })));
    }

    /// The generator is a compatibility promise (see the module docs): these values must never
    /// change. Checkpoint bytes are pinned by an FNV-1a hash of `model.safetensors`; the conformance
    /// suite's checkpoints use seed 0x5EA4_C0F0.
    #[test]
    fn outputs_are_pinned() {
        let mut rng = Rng::new(42);
        let bits: Vec<u32> = (0..4).map(|_| rng.uniform().to_bits()).collect();
        assert_eq!(bits, [3_206_323_752, 1_040_205_080, 3_169_035_072, 3_203_031_888]);
        assert_eq!(Rng::new(7).next_u64(), Rng::new(7).next_u64());
        assert_ne!(Rng::new(7).next_u64(), Rng::new(8).next_u64());

        let fnv = |b: &[u8]| {
            b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ x as u64).wrapping_mul(0x0000_0100_0000_01b3))
        };
        for (config, seed, hash) in [
            (tiny_config(), 0, 0x0eb1_19b6_9a00_82cb),
            (tiny_config(), 3, 0xead4_9d20_0ea6_a6c1),
            (tiny_config(), 0x5EA4_C0F0, 0xd407_7716_68da_80cc),
            (tiny_llama32_config(), 0, 0xc9a3_78ea_7856_b356),
            (tiny_llama32_config(), 0x5EA4_C0F0, 0xffb0_34a6_719e_c3c3),
        ] {
            let dir = tempfile::tempdir().unwrap();
            write_random_checkpoint(dir.path(), &config, seed).unwrap();
            let bytes = std::fs::read(dir.path().join(SAFETENSORS_FILE)).unwrap();
            assert_eq!(fnv(&bytes), hash, "seed {seed:#x}, {config:?}");
        }
    }

    #[test]
    fn rng_helpers_stay_in_range() {
        let mut rng = Rng::new(0);
        let v = rng.uniform_vec(10_000, 0.5);
        assert!(v.iter().all(|x| (-0.5..0.5).contains(x)));
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        assert!(mean.abs() < 0.02, "{mean}");
        let ids: Vec<u64> = (0..1000).map(|_| rng.below(7)).collect();
        assert!(ids.iter().all(|&i| i < 7) && (0..7).all(|i| ids.contains(&i)));
    }
}
