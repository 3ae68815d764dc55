//! FFI registration against JAX's CUDA plugin, where `seam install pjrt-cuda` has put it
//! (`.seam/pjrt-cuda`): the registration layout seam hands it (ADR 0042), read from its machine
//! code, is the one it takes. Registration needs no GPU. Without the install the test says so and
//! checks nothing (the install is 2.9 GB; CI does not make it).

use pjrt_runtime::ffi::{CallFrame, XlaError, TRAIT_COMMAND_BUFFER_COMPATIBLE};
use pjrt_runtime::Plugin;
use std::sync::atomic::{AtomicUsize, Ordering};

static METADATA_QUERIES: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn handler(frame: *mut CallFrame) -> *mut XlaError {
    // SAFETY: XLA passes a live call frame.
    let frame = unsafe { &mut *frame };
    if frame.answer_metadata_with(TRAIT_COMMAND_BUFFER_COMPATIBLE) {
        METADATA_QUERIES.fetch_add(1, Ordering::SeqCst);
    }
    std::ptr::null_mut()
}

#[test]
fn handlers_register_with_the_installed_cuda_plugin() {
    let installs = llama_model::home::pjrt_cuda_plugin_dir();
    let plugin = std::fs::read_dir(&installs)
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path().join("jax_plugins/xla_cuda13/xla_cuda_plugin.so"))
        .find(|path| path.exists());
    let Some(path) = plugin else {
        eprintln!("no CUDA plugin installed under {} (seam install pjrt-cuda): nothing checked", installs.display());
        return;
    };
    let plugin = Plugin::load(&path).expect("the CUDA plugin loads without a GPU");
    plugin
        .register_ffi_handler("seam_registration_test", "CUDA", handler, TRAIT_COMMAND_BUFFER_COMPATIBLE)
        .expect("registration");
    assert_eq!(METADATA_QUERIES.load(Ordering::SeqCst), 1, "XLA asked the handler for its metadata once");
}
