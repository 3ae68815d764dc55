//! Test-only helpers shared by this crate's integration tests.
pub mod broken_backends;
