//! Generation driver (in progress).
