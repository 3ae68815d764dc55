//! Sampling configuration, and a host-side sampler that backends may use.
//!
//! Sampling belongs to the backend (a compiler backend samples on the device so that only a token
//! id crosses back to the host); [`Sampler`] is the reference implementation of the arithmetic, for
//! backends that sample on the host.

use crate::capabilities::SamplingModes;
use serde::{Deserialize, Serialize};

/// How a session picks the next token.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum SamplingConfig {
    /// Argmax; ties go to the lowest token id.
    #[default]
    Greedy,
    /// Sample from `softmax(logits / temperature)`, restricted to the `top_k` most likely tokens
    /// (0 = no limit) and to the smallest set whose probability reaches `top_p` (1.0 = no limit).
    Sample { temperature: f32, top_k: usize, top_p: f32, seed: u64 },
}

impl SamplingConfig {
    /// Builds a config from user-facing settings: temperature 0 (or absent) is greedy. A
    /// temperature that is not a finite number `>= 0`, or a `top_p` outside (0, 1], is refused
    /// with a sentence for the user, at temperature 0 too (a setting that would be ignored is a
    /// mistake the user should hear about, not a silent greedy run).
    pub fn from_settings(
        temperature: Option<f32>,
        top_k: Option<usize>,
        top_p: Option<f32>,
        seed: Option<u64>,
    ) -> Result<Self, String> {
        if let Some(t) = temperature.filter(|t| !(t.is_finite() && *t >= 0.0)) {
            return Err(format!("temperature must be a finite number >= 0 (0 is greedy), got {t}"));
        }
        if let Some(p) = top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return Err(format!("top-p must be in (0, 1], got {p}"));
        }
        Ok(match temperature {
            Some(t) if t > 0.0 => SamplingConfig::Sample {
                temperature: t,
                top_k: top_k.unwrap_or(0),
                top_p: top_p.unwrap_or(1.0),
                seed: seed.unwrap_or(0),
            },
            _ => SamplingConfig::Greedy,
        })
    }

    /// The sampling modes this config needs, to check against [`SamplingModes`].
    pub fn required_modes(&self) -> SamplingModes {
        match *self {
            SamplingConfig::Greedy => SamplingModes::GREEDY_ONLY,
            SamplingConfig::Sample { top_k, top_p, .. } => {
                SamplingModes { greedy: false, temperature: true, top_k: top_k > 0, top_p: top_p < 1.0, seeded: true }
            }
        }
    }

    /// Checks the numeric settings; returns a sentence for the user on failure.
    pub fn validate(&self) -> Result<(), String> {
        if let SamplingConfig::Sample { temperature, top_p, .. } = *self {
            if !(temperature.is_finite() && temperature > 0.0) {
                return Err(format!("temperature must be a positive number, got {temperature}"));
            }
            if !(top_p > 0.0 && top_p <= 1.0) {
                return Err(format!("top-p must be in (0, 1], got {top_p}"));
            }
        }
        Ok(())
    }
}

/// Penalties on tokens already in the sequence, applied to a copy of the logits before the next
/// token is picked (greedy or sampled). The logits a session returns stay the model's own.
///
/// The repetition penalty follows Hugging Face transformers and vLLM (every token of the
/// sequence, prompt included; llama.cpp's `--repeat-penalty` looks at the last 64 only); the
/// presence and frequency penalties follow OpenAI and vLLM (generated tokens only: a token counts
/// as generated when it was appended at the position the session's previous step returned it
/// for).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Penalties {
    /// Divides the positive logit, and multiplies the negative one, of every token present in
    /// the sequence; 1 is off, above 1 discourages repeats.
    pub repetition: f32,
    /// Subtracted once from the logit of every token generated so far; 0 is off.
    pub presence: f32,
    /// Subtracted from a token's logit once for each time it was generated; 0 is off.
    pub frequency: f32,
}

impl Default for Penalties {
    fn default() -> Self {
        Penalties::NONE
    }
}

impl Penalties {
    /// No penalty: the logits as the model gave them.
    pub const NONE: Penalties = Penalties { repetition: 1.0, presence: 0.0, frequency: 0.0 };

    /// Whether every penalty is off (the session then needs no logits for greedy picks).
    pub fn is_off(&self) -> bool {
        *self == Penalties::NONE
    }

    /// Checks the values; returns a sentence for the user on failure.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.repetition.is_finite() && self.repetition > 0.0) {
            return Err(format!(
                "the repetition penalty must be a finite number > 0 (1 is off), got {}",
                self.repetition
            ));
        }
        for (value, name) in [(self.presence, "presence"), (self.frequency, "frequency")] {
            if !value.is_finite() {
                return Err(format!("the {name} penalty must be a finite number (0 is off), got {value}"));
            }
        }
        Ok(())
    }

    /// Applies the penalties to `logits`, for a sequence holding `tokens` (one per position;
    /// ids outside the vocabulary, such as an embedding row's, are skipped) of which those whose
    /// `generated` flag is set were generated.
    pub fn apply(&self, logits: &mut [f32], tokens: &[u32], generated: &[bool]) {
        if self.is_off() {
            return;
        }
        // Per token present: how many times it was generated. A map, not a vocabulary-sized
        // array: a sequence holds far fewer distinct tokens than the vocabulary.
        let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
        for (&token, &was_generated) in tokens.iter().zip(generated) {
            if (token as usize) < logits.len() {
                *counts.entry(token).or_insert(0) += u32::from(was_generated);
            }
        }
        for (token, count) in counts {
            let logit = &mut logits[token as usize];
            if self.repetition != 1.0 {
                *logit = if *logit > 0.0 { *logit / self.repetition } else { *logit * self.repetition };
            }
            if count > 0 {
                *logit -= self.presence + self.frequency * count as f32;
            }
        }
    }
}

/// Index of the largest value; ties go to the lowest index. NaN never wins; 0 when nothing is
/// above -inf. Defined once, in `cpu_kernels::scalar::argmax`, so that the kernels' greedy
/// tokens (a batched decode's, ADR 0031) are held to the same rule.
pub fn argmax(logits: &[f32]) -> u32 {
    cpu_kernels::scalar::argmax(logits)
}

/// A host-side sampler with its own seeded random stream (SplitMix64: tiny, and stable across
/// releases, unlike a dependency's generator, so seeded runs stay reproducible).
#[derive(Debug, Clone)]
pub struct Sampler {
    config: SamplingConfig,
    state: u64,
}

impl Sampler {
    /// A sampler for `config`, its stream started from the config's seed.
    pub fn new(config: SamplingConfig) -> Self {
        let state = match config {
            SamplingConfig::Sample { seed, .. } => seed,
            SamplingConfig::Greedy => 0,
        };
        Sampler { config, state }
    }

    /// The config this sampler runs.
    pub fn config(&self) -> SamplingConfig {
        self.config
    }

    /// Restarts the random stream (on session reset), so a reset session reproduces its output.
    pub fn restart(&mut self) {
        *self = Sampler::new(self.config);
    }

    fn next_unit(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Picks the next token from one position's logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let (temperature, top_k, top_p) = match self.config {
            SamplingConfig::Greedy => return argmax(logits),
            SamplingConfig::Sample { temperature, top_k, top_p, .. } => (temperature, top_k, top_p),
        };
        let mut candidates: Vec<(u32, f32)> =
            logits.iter().enumerate().filter(|(_, v)| !v.is_nan()).map(|(i, &v)| (i as u32, v)).collect();
        // Highest logit first; equal logits keep id order so the result does not depend on sort internals.
        candidates.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if top_k > 0 && top_k < candidates.len() {
            candidates.truncate(top_k);
        }
        let max = candidates.first().map(|c| c.1).unwrap_or(0.0);
        let mut probs: Vec<f64> = candidates.iter().map(|c| (((c.1 - max) / temperature) as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if top_p < 1.0 {
            let mut cumulative = 0.0;
            let mut keep = probs.len();
            for (i, p) in probs.iter().enumerate() {
                cumulative += p;
                if cumulative >= top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            let kept: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= kept);
        }
        let draw = self.next_unit();
        let mut cumulative = 0.0;
        for (i, p) in probs.iter().enumerate() {
            cumulative += p;
            if draw < cumulative {
                return candidates[i].0;
            }
        }
        candidates[probs.len() - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
        assert_eq!(Sampler::new(SamplingConfig::Greedy).sample(&[f32::NAN, 1.0, 0.5]), 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_restartable() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 7) % 13) as f32 * 0.3).collect();
        let config = SamplingConfig::Sample { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 42 };
        let mut a = Sampler::new(config);
        let mut b = Sampler::new(config);
        let run_a: Vec<u32> = (0..20).map(|_| a.sample(&logits)).collect();
        let run_b: Vec<u32> = (0..20).map(|_| b.sample(&logits)).collect();
        assert_eq!(run_a, run_b);
        assert!(run_a.iter().any(|&t| t != run_a[0]), "sampling at temperature 1 should vary");
        a.restart();
        assert_eq!((0..20).map(|_| a.sample(&logits)).collect::<Vec<_>>(), run_a);
    }

    #[test]
    fn top_k_one_is_greedy() {
        let logits = [0.5, 2.0, 1.9, -3.0];
        let mut s = Sampler::new(SamplingConfig::Sample { temperature: 5.0, top_k: 1, top_p: 1.0, seed: 7 });
        for _ in 0..20 {
            assert_eq!(s.sample(&logits), 1);
        }
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // Token 0 holds almost all the mass; top-p 0.5 must keep only it.
        let logits = [10.0, 0.0, 0.0, 0.0];
        let mut s = Sampler::new(SamplingConfig::Sample { temperature: 1.0, top_k: 0, top_p: 0.5, seed: 3 });
        for _ in 0..50 {
            assert_eq!(s.sample(&logits), 0);
        }
    }

    #[test]
    fn temperature_zero_means_greedy() {
        assert_eq!(SamplingConfig::from_settings(Some(0.0), Some(5), None, Some(1)), Ok(SamplingConfig::Greedy));
        for (t, p) in [(f32::NAN, None), (-1.0, None), (f32::INFINITY, None), (0.0, Some(2.0)), (0.7, Some(0.0))] {
            assert!(SamplingConfig::from_settings(Some(t), None, p, None).is_err(), "temperature {t}, top-p {p:?}");
        }
        assert!(SamplingConfig::Sample { temperature: 1.0, top_k: 0, top_p: 1.5, seed: 0 }.validate().is_err());
    }

    #[test]
    fn penalties_follow_their_definitions() {
        // Tokens 1 and 2 were generated (token 2 twice), token 3 is only in the prompt.
        let tokens = [3, 1, 2, 2, u32::MAX];
        let generated = [false, true, true, true, false];
        let base = [1.0f32, 2.0, -1.0, 4.0, 0.5];
        let mut logits = base;
        Penalties::NONE.apply(&mut logits, &tokens, &generated);
        assert_eq!(logits, base);
        let mut logits = base;
        Penalties { repetition: 2.0, presence: 0.0, frequency: 0.0 }.apply(&mut logits, &tokens, &generated);
        assert_eq!(logits, [1.0, 1.0, -2.0, 2.0, 0.5], "positive logits halved, negative doubled, absent untouched");
        let mut logits = base;
        Penalties { repetition: 1.0, presence: 0.5, frequency: 0.25 }.apply(&mut logits, &tokens, &generated);
        assert_eq!(logits, [1.0, 1.25, -2.0, 4.0, 0.5], "prompt-only token 3 untouched");
        assert!(Penalties { repetition: 0.0, ..Penalties::NONE }.validate().is_err());
        assert!(Penalties { presence: f32::NAN, ..Penalties::NONE }.validate().is_err());
        assert!(Penalties { frequency: -2.0, ..Penalties::NONE }.validate().is_ok());
    }
}
