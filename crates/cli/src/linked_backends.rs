//! The backends this crate ships with.
//!
//! Each backend registers itself through `inventory`; calling its `link()` makes sure the linker
//! keeps the crate (and with it the registration) even though nothing else names it.

/// Links seam's own backends into the binary: the reference backend always, iree and pjrt when
/// their features (default) are on. A binary calls this (and its own backends' `link()`) before
/// [`crate::main`].
pub fn link_builtin_backends() {
    backend_reference::link();
    #[cfg(feature = "iree")]
    backend_iree::link();
    #[cfg(feature = "pjrt")]
    backend_pjrt::link();
}
