//! Stats (in progress).
