//! Reusing a prepared input across calls that share it.
//!
//! IREE cuts each product into workgroups, and each workgroup calls the kernels for its share of
//! the output rows with the whole input: every call normalized (or gated) the input and laid it
//! out for the integer products again, up to eight times per product. A thread that makes such
//! calls turns on [`set_input_reuse`]: a preparation then remembers the inputs it was made from,
//! and a call whose inputs equal them bit for bit takes it as it is. The comparison reads the
//! inputs once, which costs a fraction of preparing them. Products that share an input across
//! calls gain too: a layer's query, key and value products normalize and lay out the same rows,
//! as do its gate and up products, so pjrt-cpu's custom calls turn it on as well (ADR 0031); a
//! caller whose calls never share an input leaves it off and pays nothing.

use std::cell::Cell;

thread_local! {
    static ENABLED: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calls this thread makes from now on may reuse a preparation made from the same
/// inputs (see the module's documentation). Off unless turned on.
pub fn set_input_reuse(on: bool) {
    ENABLED.with(|e| e.set(on));
}

/// Whether this thread's calls may reuse preparations.
pub(crate) fn enabled() -> bool {
    ENABLED.with(|e| e.get())
}

/// Largest inputs remembered, in values: a decode step's or a small batch's rows, not a prefill
/// chunk's (which no two calls share in a way worth a copy).
const MAX_VALUES: usize = 1 << 16;

/// What a preparation was made from: key words (shapes, settings) and the input values' bits.
#[derive(Default)]
pub(crate) struct Source {
    key: Vec<u64>,
    bits: Vec<u32>,
    valid: bool,
}

impl Source {
    /// Whether this thread may reuse and the remembered inputs are `key` and `inputs` (in turn).
    pub(crate) fn matches(&self, key: &[u64], inputs: &[&[f32]]) -> bool {
        if !self.valid || !enabled() || self.key != key {
            return false;
        }
        let mut at = 0;
        for input in inputs {
            let Some(remembered) = self.bits.get(at..at + input.len()) else { return false };
            if remembered != bits(input) {
                return false;
            }
            at += input.len();
        }
        at == self.bits.len()
    }

    /// Remembers `key` and `inputs` as what the preparation now holds was made from, where this
    /// thread may reuse and the inputs are small enough; else forgets.
    pub(crate) fn remember(&mut self, key: &[u64], inputs: &[&[f32]]) {
        let values: usize = inputs.iter().map(|i| i.len()).sum();
        self.valid = enabled() && values <= MAX_VALUES;
        if !self.valid {
            return;
        }
        self.key.clear();
        self.key.extend_from_slice(key);
        self.bits.clear();
        for input in inputs {
            self.bits.extend_from_slice(bits(input));
        }
    }
}

crate::scratch::footprint!(Source: key, bits);

/// The values' bits, to compare and copy as plain memory.
fn bits(values: &[f32]) -> &[u32] {
    // SAFETY: f32 and u32 have the same size and alignment, and every bit pattern is a u32.
    unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u32, values.len()) }
}
