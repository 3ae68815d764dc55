//! Builds the IREE executable plugin through which IREE's CPU dispatches call seam's kernels
//! (`plugin/kernels_plugin.c`, a small shared library with no kernels of its own; see
//! `src/kernel_plugin.rs`). The library's bytes are embedded in the crate, which writes them to
//! the cache folder at run time for IREE to load.

use std::path::PathBuf;

fn main() {
    let source = PathBuf::from("plugin/kernels_plugin.c");
    println!("cargo:rerun-if-changed={}", source.display());
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("libseam_iree_kernels.so");
    let compiler = cc::Build::new().cargo_metadata(false).get_compiler();
    let status = compiler
        .to_command()
        .args(["-shared", "-fPIC", "-O2", "-fvisibility=hidden", "-o"])
        .arg(&out)
        .arg(&source)
        .status();
    match status {
        Ok(s) if s.success() => {}
        other => panic!("building {} with {:?} failed: {other:?}", source.display(), compiler.path()),
    }
}
