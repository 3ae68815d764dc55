//! The fixed prompts: deterministic token ids of chosen lengths.
//!
//! Lengths sit at and around the prefill buckets a compiler backend is likely to compile
//! (16, 64, 128, 256, ...), since an off-by-one in padding or masking shows exactly there.

/// Prompt lengths of the greedy-parity case on the tiny models.
pub const TINY_PARITY_LENGTHS: &[usize] = &[1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257, 400];

/// Prompt lengths of the greedy-parity case on the real model, [`crate::RealModelParity::Full`]
/// (each costs a real prefill and 64 real decode steps on both the backend and the reference).
pub const REAL_PARITY_LENGTHS: &[usize] = &[1, 16, 17, 64, 65, 300];

/// Prompt lengths on the real model for [`crate::RealModelParity::Quick`], the default of tests:
/// one short prompt just past a bucket, one of several hundred tokens. About 15 s per backend and
/// format on 2 idle cores.
pub const QUICK_REAL_PARITY_LENGTHS: &[usize] = &[17, 300];

/// Greedy tokens generated (and compared) after each parity prompt.
pub const PARITY_STEPS: usize = 64;

/// A prompt of `len` token ids below `vocab_size`, the same on every run for a given `salt`.
/// The lowest ids are avoided because real vocabularies keep their special tokens there.
pub fn prompt(len: usize, vocab_size: usize, salt: u64) -> Vec<u32> {
    let low = (vocab_size / 4).min(32) as u64;
    let span = (vocab_size as u64).saturating_sub(low).max(1);
    // The project's one test-data generator: stable across releases, unlike a dependency's.
    let mut rng = llama_model::random::Rng::new(llama_model::random::mix64(salt) ^ len as u64);
    (0..len).map(|_| (low + rng.below(span)) as u32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_are_deterministic_and_in_range() {
        let a = prompt(300, 500, 1);
        assert_eq!(a, prompt(300, 500, 1));
        assert_ne!(a, prompt(300, 500, 2));
        assert!(a.iter().all(|&t| (32..500).contains(&t)));
        assert_eq!(prompt(5, 8, 0).len(), 5);
        assert!(prompt(50, 8, 0).iter().all(|&t| (2..8).contains(&t)));
    }
}
