//! Choosing a runtime's entry point for one of seam's linear kernel targets.
//!
//! Each runtime that calls seam's kernels (pjrt-cpu's XLA handlers, iree-cpu's executable
//! imports) has one entry point per linear target (`stablehlo_llama::linear_targets`), written
//! once as a function generic over the target's weight format, input and residual, so that each
//! instance is specialized. [`linear_entry`] maps a target's description to the instance; the
//! runtime says what an instance is through [`LinearEntry`].

use llama_model::MatrixFormat;
use stablehlo_llama::KernelInput;

/// `FORMAT` of an instance: the weight format.
pub mod format {
    pub const F16: u8 = 0;
    pub const INT4: u8 = 1;
    pub const INT8: u8 = 2;
}

/// `INPUT` of an instance: what the kernel reads before its product
/// ([`KernelInput`]).
pub mod input {
    pub const ROWS: u8 = 0;
    pub const RMS_NORM: u8 = 1;
    pub const SWIGLU: u8 = 2;
}

/// A runtime's generic entry point for linear targets.
pub trait LinearEntry {
    /// What the runtime registers for a target (a function pointer of its calling convention).
    type Entry;

    /// The instance for weight format `FORMAT` ([`format`]), input `INPUT` ([`input`]) and a
    /// residual operand when `RESIDUAL`.
    fn instance<const FORMAT: u8, const INPUT: u8, const RESIDUAL: bool>() -> Self::Entry;
}

/// The instance of `E` for the target that reads `format` weights, takes `input` and, when
/// `residual`, adds a residual.
pub fn linear_entry<E: LinearEntry>(format: MatrixFormat, input: KernelInput, residual: bool) -> E::Entry {
    fn of<E: LinearEntry, const FORMAT: u8>(input: KernelInput, residual: bool) -> E::Entry {
        use self::input::{RMS_NORM, ROWS, SWIGLU};
        match (input, residual) {
            (KernelInput::Rows, false) => E::instance::<FORMAT, ROWS, false>(),
            (KernelInput::Rows, true) => E::instance::<FORMAT, ROWS, true>(),
            (KernelInput::RmsNorm, false) => E::instance::<FORMAT, RMS_NORM, false>(),
            (KernelInput::RmsNorm, true) => E::instance::<FORMAT, RMS_NORM, true>(),
            (KernelInput::SwiGlu, false) => E::instance::<FORMAT, SWIGLU, false>(),
            (KernelInput::SwiGlu, true) => E::instance::<FORMAT, SWIGLU, true>(),
        }
    }
    match format {
        MatrixFormat::F16 => of::<E, { format::F16 }>(input, residual),
        MatrixFormat::Int4 => of::<E, { format::INT4 }>(input, residual),
        MatrixFormat::Int8 => of::<E, { format::INT8 }>(input, residual),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An entry that names its instance.
    struct Names;
    impl LinearEntry for Names {
        type Entry = (u8, u8, bool);
        fn instance<const FORMAT: u8, const INPUT: u8, const RESIDUAL: bool>() -> (u8, u8, bool) {
            (FORMAT, INPUT, RESIDUAL)
        }
    }

    #[test]
    fn every_target_gets_its_own_instance() {
        let mut seen = std::collections::HashSet::new();
        for (_, matrix, kernel_input, residual) in stablehlo_llama::linear_targets() {
            let (f, i, r) = linear_entry::<Names>(matrix, kernel_input, residual);
            let want = match matrix {
                MatrixFormat::F16 => format::F16,
                MatrixFormat::Int4 => format::INT4,
                MatrixFormat::Int8 => format::INT8,
            };
            assert_eq!((f, r), (want, residual), "{matrix:?}");
            assert!(seen.insert((f, i, r)), "{matrix:?} {kernel_input:?} {residual}");
        }
        assert_eq!(seen.len(), 18);
    }
}
