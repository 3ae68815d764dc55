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
}

impl ComputePrecision {
    /// The name used on the command line and in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            ComputePrecision::F32 => "f32",
            ComputePrecision::F16 => "f16",
            ComputePrecision::Bf16 => "bf16",
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
        }
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
            other => Err(format!("unknown compute precision '{other}' (expected f32, f16 or bf16)")),
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
}
