//! Async wrapper (in progress).
