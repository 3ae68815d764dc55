//! Generates the PJRT C API bindings from the header a plugin wheel ships.
//!
//! The header is found at `$PJRT_C_API_HEADER`, else in the project's install of the pinned
//! `xla-cpu-pjrt==0.0.1` wheel (`$SEAM_HOME/pjrt`, by default `.seam/pjrt`, put there by
//! `scripts/build-prereqs.sh`). The
//! bindings are generated, never checked in, so they always match the header the plugins were
//! built against (see docs/adr/0007-pjrt-binding.md).

use std::path::PathBuf;

const HEADER_ENV: &str = "PJRT_C_API_HEADER";
/// seam's home folder (see `llama_model::home`, which a build script cannot depend on).
const SEAM_HOME_ENV: &str = "SEAM_HOME";
const WHEEL_HEADER: &str = "xla_plugins/xla_cpu_pjrt/include/pjrt_c_api.h";

fn main() {
    println!("cargo:rerun-if-env-changed={HEADER_ENV}");
    println!("cargo:rerun-if-env-changed={SEAM_HOME_ENV}");
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    // `llama_model::home::pjrt_plugin_dir()`, the same rule written by hand: `$SEAM_HOME/pjrt`, else
    // the checkout's `.seam/pjrt` (where build-prereqs.sh installs and the pjrt backends look).
    let pjrt_dir = match std::env::var_os(SEAM_HOME_ENV).filter(|v| !v.is_empty()) {
        Some(home) => PathBuf::from(home).join("pjrt"),
        None => manifest.join("../../.seam/pjrt"),
    };
    let header = match std::env::var_os(HEADER_ENV) {
        Some(path) => PathBuf::from(path),
        None => pjrt_dir.join(WHEEL_HEADER),
    };
    if !header.is_file() {
        panic!(
            "pjrt-runtime: the PJRT C API header was not found at {}.\n\
             Run `source scripts/build-prereqs.sh` from the repository root (it installs the pinned \
             xla-cpu-pjrt==0.0.1 wheel, which ships the header, into {}), or set {HEADER_ENV}.",
            header.display(),
            pjrt_dir.display()
        );
    }
    println!("cargo:rerun-if-changed={}", header.display());
    let bindings = bindgen::Builder::default()
        .header(header.to_string_lossy())
        .allowlist_type("PJRT_.*")
        .allowlist_var("PJRT_API_.*")
        .rustified_enum("PJRT_Error_Code")
        .rustified_enum("PJRT_Buffer_Type")
        .rustified_enum("PJRT_HostBufferSemantics")
        .derive_default(true)
        .layout_tests(false)
        .generate()
        .unwrap_or_else(|e| panic!("pjrt-runtime: bindgen failed on {}: {e}", header.display()));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("pjrt_c_api.rs");
    bindings.write_to_file(&out).unwrap_or_else(|e| panic!("pjrt-runtime: writing {}: {e}", out.display()));
}
