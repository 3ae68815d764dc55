//! Numerical tolerances: how far a backend's numbers may stray from the reference's, per compute
//! precision, and the measures used to say how far they did.
//!
//! Two kinds of comparison are made:
//! - **Tokens.** A greedy backend must pick the reference's token at every step. A different pick is
//!   tolerated only where the reference itself hesitated: where the margin between its two best
//!   logits is below [`Tolerances::margin_epsilon`]. Near such a tie, any rounding difference may
//!   legitimately flip the argmax.
//! - **Logits** (when the backend returns them): the normalized squared error
//!   `nmse = Σ(a-b)² / Σb²` (as llama.cpp's test-backend-ops reports it, `b` the reference) and the
//!   largest absolute difference `max|a-b|`, of the last position's logits, worst over all steps.
//!
//! A backend is held to two sets of thresholds, a [`ToleranceProfile`]:
//! - **reference** ([`ComputePrecision::tolerances`]): its numbers against the reference's, loose
//!   enough for a backend that computes in a lower precision than the reference's f32;
//! - **self-consistency** ([`ComputePrecision::self_consistency_tolerances`]): its numbers along one
//!   path (prefill then decode) against its own along another (one token at a time, a whole-sequence
//!   prefill, a truncated and replayed cache, a fork). Both sides round the same way, so what may
//!   legitimately differ is summation order and where an activation is rounded to the storage
//!   precision (a prefill may attend to keys it has not yet rounded into the cache; a decode reads
//!   them rounded). That is far less than a lower precision's distance from f32, so these
//!   thresholds are orders of magnitude tighter, and a corrupted cache row that the bf16 reference
//!   preset lets through fails here.
//!
//! A backend whose arithmetic fits no preset (fp8 or int8 activations) states its own profile with
//! [`ToleranceProfile::custom`]; the report names the profile and which set each row used.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The precision a backend computes in (not the precision its weights are stored in: int4 weights
/// dequantized into f32 arithmetic are "f32").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ComputePrecision {
    /// f32 activations and accumulation, like the reference.
    #[default]
    F32,
    /// f16 activations (accumulation may be f32).
    F16,
    /// bf16 activations.
    Bf16,
    /// f32 arithmetic over activations rounded to int8 per group of 32 where they meet quantized
    /// weights (seam's kernels with `activations=int8`, ADR 0024; llama.cpp's quantized products
    /// do the same).
    Int8,
}

impl ComputePrecision {
    /// The name used on the command line and in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            ComputePrecision::F32 => "f32",
            ComputePrecision::F16 => "f16",
            ComputePrecision::Bf16 => "bf16",
            ComputePrecision::Int8 => "int8",
        }
    }

    /// The documented tolerance preset for this precision.
    pub fn tolerances(self) -> Tolerances {
        match self {
            // f32 against f32: only summation order differs. Over 30 layers that moves logits by
            // ~1e-5 relative; the thresholds leave two orders of magnitude of headroom.
            ComputePrecision::F32 => Tolerances { margin_epsilon: 1e-2, max_nmse: 1e-6, max_abs: 5e-2 },
            // f16 keeps ~11 bits: per-layer relative error ~5e-4 compounds to ~1e-3..1e-2 on logits
            // of magnitude ~10-30, so ties closer than a quarter of a logit may flip.
            ComputePrecision::F16 => Tolerances { margin_epsilon: 0.25, max_nmse: 1e-3, max_abs: 1.0 },
            // bf16 keeps 8 bits: an order of magnitude looser than f16.
            ComputePrecision::Bf16 => Tolerances { margin_epsilon: 1.0, max_nmse: 1e-2, max_abs: 3.0 },
            // Each product's inputs carry a rounding error of about 1/440 of their group's
            // largest magnitude (a uniform error of half a step of max/127): a relative nmse of
            // about 2e-5 per product on normally distributed groups, more on groups with an
            // outlier, adding up over the seven products of each layer to about 1e-2 on the logits
            // of a 30-layer model, more over a long prompt (SmolLM2 measured 9e-3 on the suite's
            // short prompts, 3.8e-2 with max|Δ| 2.6 on its 300-token one through ADR 0024's
            // row-major products; through ADR 0025's panels 1.6e-2 to 1.8e-2 with max|Δ| 1.6 to
            // 2.1 over all of them, the greedy streams parting at other near-ties). The threshold
            // leaves little room above the worst figure seen; ties as wide as the largest logit
            // differences seen.
            ComputePrecision::Int8 => Tolerances { margin_epsilon: 2.0, max_nmse: 5e-2, max_abs: 4.0 },
        }
    }
}

impl ComputePrecision {
    /// The self-consistency preset for this precision: the backend's own paths against each other.
    pub fn self_consistency_tolerances(self) -> Tolerances {
        match self {
            // f32 on both sides: summation order only (a prefill graph tiles its reductions
            // differently from a decode graph), about 1e-6 relative on a logit.
            ComputePrecision::F32 => Tolerances { margin_epsilon: 1e-3, max_nmse: 1e-9, max_abs: 5e-3 },
            // An f16 cache rounds each key and value to 11 bits where a prefill may attend to the
            // unrounded ones: a relative 5e-4 on some attention inputs, not on every activation as
            // against the reference.
            ComputePrecision::F16 => Tolerances { margin_epsilon: 0.05, max_nmse: 1e-6, max_abs: 0.1 },
            // The same with 8 bits: eight times the rounding, about sixty-four times the nmse.
            ComputePrecision::Bf16 => Tolerances { margin_epsilon: 0.2, max_nmse: 1e-4, max_abs: 0.5 },
            // Every path rounds its activations the same way (the rounding is part of what the
            // product is defined as), but two paths' activations differ in their last bits
            // (summation order), and where one sits on a rounding boundary it lands a whole step
            // (1/127 of its group's largest) away on the other path: each such flip moves the
            // logits by about 1e-5 in nmse (iree-cpu's prefill against its decode: 4.9e-5, max|Δ|
            // 0.019 on the tiny model), so allow a few per step, and far less than a corrupted
            // cache row moves them (well above 1e-2).
            ComputePrecision::Int8 => Tolerances { margin_epsilon: 0.2, max_nmse: 1e-3, max_abs: 0.5 },
        }
    }

    /// Both presets of this precision, as a profile named after it.
    pub fn profile(self) -> ToleranceProfile {
        ToleranceProfile {
            name: self.as_str().to_string(),
            custom: false,
            reference: self.tolerances(),
            self_consistency: self.self_consistency_tolerances(),
        }
    }
}

/// Which of a profile's two sets a comparison uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToleranceKind {
    /// The backend against the reference backend.
    Reference,
    /// The backend against its own results along another path.
    SelfConsistency,
}

impl ToleranceKind {
    /// Short name for the matrix: `ref` or `self`.
    pub fn as_str(self) -> &'static str {
        match self {
            ToleranceKind::Reference => "ref",
            ToleranceKind::SelfConsistency => "self",
        }
    }
}

/// The thresholds a backend is held to: a preset of its compute precision
/// ([`ComputePrecision::profile`]) or the backend's own ([`ToleranceProfile::custom`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToleranceProfile {
    /// The precision's name for a preset (`f32`, `f16`, `bf16`); the backend's own label for a
    /// custom profile (`fp8 activations`).
    pub name: String,
    /// Whether the backend declared these itself instead of taking its precision's preset.
    pub custom: bool,
    /// Against the reference: parity, the lifecycle cases, bad input, embeddings, sampling, layers.
    pub reference: Tolerances,
    /// Against the backend's own results: the `self.*` cases.
    pub self_consistency: Tolerances,
}

impl ToleranceProfile {
    /// A backend's own thresholds, for arithmetic no preset fits (fp8 or int8 activations). Choose
    /// `self_consistency` from what the backend's prefill and decode paths may legitimately differ
    /// by, not from its distance to the reference: that is the check a loose `reference` set
    /// cannot make.
    pub fn custom(name: impl Into<String>, reference: Tolerances, self_consistency: Tolerances) -> ToleranceProfile {
        ToleranceProfile { name: name.into(), custom: true, reference, self_consistency }
    }

    /// The set of `kind`.
    pub fn get(&self, kind: ToleranceKind) -> Tolerances {
        match kind {
            ToleranceKind::Reference => self.reference,
            ToleranceKind::SelfConsistency => self.self_consistency,
        }
    }

    /// `f32 preset` or `custom "fp8 activations"`.
    pub fn label(&self) -> String {
        if self.custom {
            format!("custom \"{}\"", self.name)
        } else {
            format!("{} preset", self.name)
        }
    }
}

impl fmt::Display for Tolerances {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Shortest exact forms: a rounded exponent would print the f16 preset's 0.25 as 2e-1.
        write!(f, "margin ε {}, nmse ≤ {:e}, max|Δ| ≤ {}", self.margin_epsilon, self.max_nmse, self.max_abs)
    }
}

impl fmt::Display for ComputePrecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ComputePrecision {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" => Ok(ComputePrecision::F32),
            "f16" | "fp16" => Ok(ComputePrecision::F16),
            "bf16" => Ok(ComputePrecision::Bf16),
            "int8" => Ok(ComputePrecision::Int8),
            other => Err(format!("unknown compute precision '{other}' (expected f32, f16, bf16 or int8)")),
        }
    }
}

/// Thresholds for one compute precision. See the module documentation for the formulas.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Tolerances {
    /// A token differing from the reference's is tolerated only where the reference's top-2 logit
    /// margin is below this.
    pub margin_epsilon: f32,
    /// Largest accepted `Σ(a-b)² / Σb²` of one step's logits.
    pub max_nmse: f64,
    /// Largest accepted `max|a-b|` of one step's logits.
    pub max_abs: f64,
}

/// The margin between the two largest logits (how sure a greedy pick was). NaN logits never count
/// as largest; fewer than two finite logits give an infinite margin.
pub fn top2_margin(logits: &[f32]) -> f32 {
    let (mut best, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in logits {
        if v > best {
            second = best;
            best = v;
        } else if v > second {
            second = v;
        }
    }
    if second == f32::NEG_INFINITY {
        f32::INFINITY
    } else {
        best - second
    }
}

/// How far one vector of logits is from the reference's.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct LogitError {
    /// `Σ(a-b)² / Σb²`.
    pub nmse: f64,
    /// `max|a-b|`.
    pub max_abs: f64,
}

impl LogitError {
    /// Compares `actual` with `reference`. A length mismatch or a non-finite value is an infinite
    /// error, so that it can never pass a threshold.
    pub fn between(actual: &[f32], reference: &[f32]) -> LogitError {
        if actual.len() != reference.len() {
            return LogitError { nmse: f64::INFINITY, max_abs: f64::INFINITY };
        }
        let (mut diff2, mut ref2, mut max_abs) = (0.0f64, 0.0f64, 0.0f64);
        for (&a, &b) in actual.iter().zip(reference) {
            let d = a as f64 - b as f64;
            if !d.is_finite() {
                return LogitError { nmse: f64::INFINITY, max_abs: f64::INFINITY };
            }
            diff2 += d * d;
            ref2 += (b as f64) * (b as f64);
            max_abs = max_abs.max(d.abs());
        }
        let nmse = if ref2 > 0.0 {
            diff2 / ref2
        } else if diff2 == 0.0 {
            0.0
        } else {
            f64::INFINITY
        };
        LogitError { nmse, max_abs }
    }

    /// The worse of two errors, measure by measure.
    pub fn worst(self, other: LogitError) -> LogitError {
        LogitError { nmse: self.nmse.max(other.nmse), max_abs: self.max_abs.max(other.max_abs) }
    }

    /// Whether both measures are within `tolerances`.
    pub fn within(&self, tolerances: &Tolerances) -> bool {
        self.nmse <= tolerances.max_nmse && self.max_abs <= tolerances.max_abs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn margin_is_best_minus_second() {
        assert_eq!(top2_margin(&[1.0, 3.0, 2.5, f32::NAN]), 0.5);
        assert_eq!(top2_margin(&[2.0, 2.0]), 0.0);
        assert_eq!(top2_margin(&[1.0]), f32::INFINITY);
    }

    #[test]
    fn logit_error_measures() {
        let e = LogitError::between(&[1.0, 2.0, 4.0], &[1.0, 2.0, 3.0]);
        assert!((e.nmse - 1.0 / 14.0).abs() < 1e-12);
        assert_eq!(e.max_abs, 1.0);
        assert_eq!(LogitError::between(&[1.0, 2.0], &[1.0, 2.0]), LogitError { nmse: 0.0, max_abs: 0.0 });
        assert!(LogitError::between(&[1.0], &[1.0, 2.0]).nmse.is_infinite());
        assert!(!LogitError::between(&[f32::NAN], &[1.0]).within(&ComputePrecision::Bf16.tolerances()));
    }

    #[test]
    fn presets_loosen_with_precision() {
        let (a, b, c) = (
            ComputePrecision::F32.tolerances(),
            ComputePrecision::F16.tolerances(),
            ComputePrecision::Bf16.tolerances(),
        );
        assert!(a.max_nmse < b.max_nmse && b.max_nmse < c.max_nmse);
        assert!(a.margin_epsilon < b.margin_epsilon && b.margin_epsilon < c.margin_epsilon);
        assert_eq!("fp16".parse::<ComputePrecision>(), Ok(ComputePrecision::F16));
    }

    #[test]
    fn self_consistency_is_much_tighter_than_reference_parity() {
        for precision in [ComputePrecision::F32, ComputePrecision::F16, ComputePrecision::Bf16] {
            let profile = precision.profile();
            let (reference, own) = (profile.reference, profile.self_consistency);
            assert!(own.max_nmse * 100.0 <= reference.max_nmse, "{precision}");
            assert!(own.max_abs < reference.max_abs && own.margin_epsilon < reference.margin_epsilon, "{precision}");
            assert_eq!(profile.get(ToleranceKind::SelfConsistency), own);
            assert!(!profile.custom && profile.label() == format!("{precision} preset"));
        }
        let custom = ToleranceProfile::custom(
            "fp8",
            Tolerances { margin_epsilon: 2.0, max_nmse: 5e-2, max_abs: 6.0 },
            Tolerances { margin_epsilon: 0.5, max_nmse: 1e-3, max_abs: 1.0 },
        );
        assert_eq!(custom.label(), "custom \"fp8\"");
        assert_eq!(custom.get(ToleranceKind::Reference).max_nmse, 5e-2);
    }
}
