//! Choosing a runtime's entry point for one of seam's linear kernel targets.
//!
//! Each runtime that calls seam's kernels (pjrt-cpu's XLA handlers, iree-cpu's executable
//! imports) has one entry point per linear target (`stablehlo_llama::linear_targets`), written
//! once as a function generic over the target's weight format, input and residual, so that each
//! instance is specialized. [`linear_entry`] maps a target's description to the instance; the
//! runtime says what an instance is through [`LinearEntry`].

use llama_model::MatrixFormat;
use stablehlo_llama::{KernelActivations, KernelInput, LinearTarget, MatrixOrder};

/// `FORMAT` of an instance: the weight format.
pub mod format {
    pub const F16: u8 = 0;
    pub const INT4: u8 = 1;
    pub const INT8: u8 = 2;
    /// int4 in panels of 16 rows (`stablehlo_llama::MatrixOrder::Panels`).
    pub const INT4_PANELS: u8 = 3;
    /// int8 in panels of 16 rows.
    pub const INT8_PANELS: u8 = 4;
}

/// `INPUT` of an instance: what the kernel reads before its product
/// ([`KernelInput`]).
pub mod input {
    pub const ROWS: u8 = 0;
    pub const RMS_NORM: u8 = 1;
    pub const SWIGLU: u8 = 2;
    pub const ATTENTION_PARTS: u8 = 3;
}

/// A runtime's generic entry point for linear targets.
pub trait LinearEntry {
    /// What the runtime registers for a target (a function pointer of its calling convention).
    type Entry;

    /// The instance for weight format `FORMAT` ([`format`](mod@format)), input `INPUT` ([`input`]), a
    /// residual operand when `RESIDUAL`, and activations rounded to int8 when `INT8_ACTIVATIONS`
    /// ([`KernelActivations::Int8`]; never for f16 weights).
    fn instance<const FORMAT: u8, const INPUT: u8, const RESIDUAL: bool, const INT8_ACTIVATIONS: bool>() -> Self::Entry;

    /// The instance of a grouped target (`stablehlo_llama::linear_group_target`): `PRODUCTS`
    /// matrices of format `FORMAT` over one input `INPUT` ([`input::ROWS`] or
    /// [`input::RMS_NORM`]), each with its own result, no residual; with `ROPE`, the first two
    /// results turned by the rope tables the call takes.
    fn group<const FORMAT: u8, const INPUT: u8, const INT8_ACTIVATIONS: bool, const PRODUCTS: usize, const ROPE: bool>(
    ) -> Self::Entry;
}

/// The instance of `E` for `target`.
pub fn linear_entry<E: LinearEntry>(target: &LinearTarget) -> E::Entry {
    let LinearTarget { format, input, residual, activations, order, products, rope, .. } = *target;
    let grouping = (products, rope);
    fn of<E: LinearEntry, const FORMAT: u8, const Q8: bool>(
        input: KernelInput,
        residual: bool,
        (products, rope): (usize, bool),
    ) -> E::Entry {
        use self::input::{ATTENTION_PARTS, RMS_NORM, ROWS, SWIGLU};
        if products > 1 {
            return match (input, products, rope) {
                (KernelInput::Rows, 2, false) => E::group::<FORMAT, ROWS, Q8, 2, false>(),
                (KernelInput::Rows, 3, false) => E::group::<FORMAT, ROWS, Q8, 3, false>(),
                (KernelInput::Rows, 3, true) => E::group::<FORMAT, ROWS, Q8, 3, true>(),
                (KernelInput::RmsNorm, 2, false) => E::group::<FORMAT, RMS_NORM, Q8, 2, false>(),
                (KernelInput::RmsNorm, 3, false) => E::group::<FORMAT, RMS_NORM, Q8, 3, false>(),
                (KernelInput::RmsNorm, 3, true) => E::group::<FORMAT, RMS_NORM, Q8, 3, true>(),
                other => unreachable!("no grouped linear target takes {other:?}"),
            };
        }
        match (input, residual) {
            (KernelInput::Rows, false) => E::instance::<FORMAT, ROWS, false, Q8>(),
            (KernelInput::Rows, true) => E::instance::<FORMAT, ROWS, true, Q8>(),
            (KernelInput::RmsNorm, false) => E::instance::<FORMAT, RMS_NORM, false, Q8>(),
            (KernelInput::RmsNorm, true) => E::instance::<FORMAT, RMS_NORM, true, Q8>(),
            (KernelInput::SwiGlu, false) => E::instance::<FORMAT, SWIGLU, false, Q8>(),
            (KernelInput::SwiGlu, true) => E::instance::<FORMAT, SWIGLU, true, Q8>(),
            (KernelInput::AttentionParts, false) => E::instance::<FORMAT, ATTENTION_PARTS, false, Q8>(),
            (KernelInput::AttentionParts, true) => E::instance::<FORMAT, ATTENTION_PARTS, true, Q8>(),
        }
    }
    use KernelActivations::{Exact, Int8};
    use MatrixOrder::{Panels, RowMajor};
    match (format, activations, order) {
        (MatrixFormat::F16, ..) => of::<E, { format::F16 }, false>(input, residual, grouping),
        (MatrixFormat::Int4, Exact, RowMajor) => of::<E, { format::INT4 }, false>(input, residual, grouping),
        (MatrixFormat::Int4, Int8, RowMajor) => of::<E, { format::INT4 }, true>(input, residual, grouping),
        (MatrixFormat::Int4, Exact, Panels) => of::<E, { format::INT4_PANELS }, false>(input, residual, grouping),
        (MatrixFormat::Int4, Int8, Panels) => of::<E, { format::INT4_PANELS }, true>(input, residual, grouping),
        (MatrixFormat::Int8, Exact, RowMajor) => of::<E, { format::INT8 }, false>(input, residual, grouping),
        (MatrixFormat::Int8, Int8, RowMajor) => of::<E, { format::INT8 }, true>(input, residual, grouping),
        (MatrixFormat::Int8, Exact, Panels) => of::<E, { format::INT8_PANELS }, false>(input, residual, grouping),
        (MatrixFormat::Int8, Int8, Panels) => of::<E, { format::INT8_PANELS }, true>(input, residual, grouping),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An entry that names its instance.
    struct Names;
    impl LinearEntry for Names {
        type Entry = (u8, u8, bool, bool, usize, bool);
        fn instance<const FORMAT: u8, const INPUT: u8, const RESIDUAL: bool, const Q8: bool>() -> Self::Entry {
            (FORMAT, INPUT, RESIDUAL, Q8, 1, false)
        }
        fn group<const FORMAT: u8, const INPUT: u8, const Q8: bool, const PRODUCTS: usize, const ROPE: bool>(
        ) -> Self::Entry {
            (FORMAT, INPUT, false, Q8, PRODUCTS, ROPE)
        }
    }

    #[test]
    fn every_target_gets_its_own_instance() {
        let mut seen = std::collections::HashSet::new();
        for target in stablehlo_llama::linear_targets() {
            let (f, i, r, q8, products, rope) = linear_entry::<Names>(&target);
            let want = match (target.format, target.order) {
                (MatrixFormat::F16, _) => format::F16,
                (MatrixFormat::Int4, MatrixOrder::Panels) => format::INT4_PANELS,
                (MatrixFormat::Int4, MatrixOrder::RowMajor) => format::INT4,
                (MatrixFormat::Int8, MatrixOrder::Panels) => format::INT8_PANELS,
                (MatrixFormat::Int8, MatrixOrder::RowMajor) => format::INT8,
            };
            let rounds = target.activations == KernelActivations::Int8;
            let grouping = (target.products, target.rope);
            assert_eq!((f, r, q8, (products, rope)), (want, target.residual, rounds, grouping), "{target:?}");
            assert!(seen.insert((f, i, r, q8, products, rope)), "{target:?}");
        }
        assert_eq!(seen.len(), 126);
    }
}
