//! Which instruction set the kernels run on, chosen at run time.

use std::sync::OnceLock;

/// An instruction-set path of the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Plain Rust, any CPU: the definitions of [`crate::scalar`] compiled for the baseline target.
    Scalar,
    /// x86-64 with AVX2, FMA and F16C (Haswell and later, every AMD Zen): 8-wide f32 FMAs and
    /// hardware f16 widening.
    Avx2,
}

/// The environment variable that caps the path (`scalar` or `avx2`): for measuring one path
/// against another, never needed for correctness.
pub const ISA_ENV: &str = "SEAM_CPU_ISA";

impl Isa {
    /// The name used in reports and in [`ISA_ENV`].
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2+fma+f16c",
        }
    }

    /// Whether this machine can run the path.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => avx2_supported(),
        }
    }

    /// Every path this machine can run, the fastest last.
    pub fn supported() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2].into_iter().filter(|isa| isa.is_supported()).collect()
    }

    /// The fastest supported path, unless [`ISA_ENV`] asks for a slower one (an unknown or
    /// unsupported value there is ignored with a warning on stderr). Decided once per process.
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            let fastest = *Isa::supported().last().expect("the scalar path is always supported");
            match std::env::var(ISA_ENV).ok().as_deref() {
                None | Some("") => fastest,
                Some("scalar") => Isa::Scalar,
                Some("avx2") if Isa::Avx2.is_supported() => Isa::Avx2,
                Some(other) => {
                    eprintln!(
                        "warning: {ISA_ENV}={other} is not a path this CPU runs (scalar, avx2); using {}",
                        fastest.name()
                    );
                    fastest
                }
            }
        })
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_supported() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx2_supported() -> bool {
    false
}
