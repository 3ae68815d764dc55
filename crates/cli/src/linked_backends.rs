//! The backends linked into this binary.
//!
//! Each backend registers itself through `inventory`; calling its `link()` makes sure the linker
//! keeps the crate (and with it the registration) even though nothing else here names it.

/// References every backend crate this binary ships with.
pub fn link_all() {
    backend_reference::link();
    backend_iree::link();
    backend_pjrt::link();
}
