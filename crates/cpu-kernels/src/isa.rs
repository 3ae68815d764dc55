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
    /// [`Isa::Avx2`] plus AVX-512F (Skylake-SP and later Xeons, AMD Zen 4): the same kernels,
    /// except that the blocked matrix-matrix product multiplies in 16-wide registers, 32 of them.
    /// Only that product uses it: the per-token paths are bound by reading and converting the
    /// weights, where 512-bit widening measured slower than AVX2's on Zen 4 (docs/performance.md).
    Avx512,
    /// [`Isa::Avx512`] plus AVX-512BW and VNNI (Ice Lake-SP and later Xeons, Zen 4): also the
    /// one-token int4 and int8 products, as integer dot products (`vpdpwssd`) of the stored codes,
    /// unpacked in place without cross-lane widening, with activations prepared once per call.
    Avx512Vnni,
}

/// The environment variable that caps the path (`scalar`, `avx2`, `avx512` or `avx512vnni`): for measuring one path
/// against another, never needed for correctness.
pub const ISA_ENV: &str = "SEAM_CPU_ISA";

impl Isa {
    /// The name used in reports and in `SEAM_CPU_ISA`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2+fma+f16c",
            Isa::Avx512 => "avx512f+avx2+fma+f16c",
            Isa::Avx512Vnni => "avx512vnni+bw+f+avx2+fma+f16c",
        }
    }

    /// Whether the path includes AVX2, FMA and F16C (every path but the scalar one).
    pub fn has_avx2(self) -> bool {
        matches!(self, Isa::Avx2 | Isa::Avx512 | Isa::Avx512Vnni)
    }

    /// Whether the path includes AVX-512F (the 512-bit tile of the blocked products).
    pub fn has_avx512(self) -> bool {
        matches!(self, Isa::Avx512 | Isa::Avx512Vnni)
    }

    /// Whether the path includes AVX-512F and this machine has AVX-512BW and VL too (16-bit
    /// masked loads: f16 caches in 512-bit registers). Every AVX-512 CPU but the Xeon Phis has
    /// them.
    pub(crate) fn has_avx512_bw_vl(self) -> bool {
        self.has_avx512() && avx512_bw_vl_supported()
    }

    /// Whether this machine can run the path.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => avx2_supported(),
            Isa::Avx512 => avx2_supported() && avx512_supported(),
            Isa::Avx512Vnni => avx2_supported() && avx512_supported() && avx512_vnni_supported(),
        }
    }

    /// Every path this machine can run, the fastest last.
    pub fn supported() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni].into_iter().filter(|isa| isa.is_supported()).collect()
    }

    /// The fastest supported path, unless `SEAM_CPU_ISA` asks for a slower one (an unknown or
    /// unsupported value there is ignored with a warning on stderr). Decided once per process.
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            let fastest = *Isa::supported().last().expect("the scalar path is always supported");
            match std::env::var(ISA_ENV).ok().as_deref() {
                None | Some("") => fastest,
                Some("scalar") => Isa::Scalar,
                Some("avx2") if Isa::Avx2.is_supported() => Isa::Avx2,
                Some("avx512") if Isa::Avx512.is_supported() => Isa::Avx512,
                Some("avx512vnni") if Isa::Avx512Vnni.is_supported() => Isa::Avx512Vnni,
                Some(other) => {
                    eprintln!(
                        "warning: {ISA_ENV}={other} is not a path this CPU runs (scalar, avx2, avx512, avx512vnni); using {}",
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

#[cfg(target_arch = "x86_64")]
fn avx512_supported() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_supported() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn avx512_bw_vl_supported() -> bool {
    std::arch::is_x86_feature_detected!("avx512bw") && std::arch::is_x86_feature_detected!("avx512vl")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_bw_vl_supported() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn avx512_vnni_supported() -> bool {
    std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512vnni")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_vnni_supported() -> bool {
    false
}
