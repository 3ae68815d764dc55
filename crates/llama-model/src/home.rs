//! seam's home: every path seam reads or writes outside a model directory, in one place.
//!
//! Everything lives in one folder, [`root`], which is the project-local, git-ignored `.seam/` of
//! the checkout for seam's own commands and tests, the user's cache folder for a program that
//! depends on seam from outside, unless `SEAM_HOME` says otherwise; compiled-graph caches can be moved on their own
//! with `SEAM_CACHE_DIR`. Nothing else decides where seam's files go: backends, tests and the CLI
//! call the functions below.
//!
//! | function                   | default                              | environment override       |
//! |----------------------------|--------------------------------------|----------------------------|
//! | [`root`]                   | `<workspace>/.seam` or `~/.cache/seam` | `SEAM_HOME`              |
//! | [`models_dir`]             | `root/models`                        |                            |
//! | [`downloads_dir`]          | `root/downloads`                     |                            |
//! | [`cache_dir`]              | `root/cache`                         | `SEAM_CACHE_DIR`           |
//! | [`iree_cache_dir`]         | `cache_dir/iree`                     | (follows `cache_dir`)      |
//! | [`pjrt_cache_dir`]         | `cache_dir/pjrt`                     | (follows `cache_dir`)      |
//! | [`prepared_weights_dir`]   | `cache_dir/weights`                  | (follows `cache_dir`)      |
//! | [`py_iree_dir`]            | `root/py-iree`                       |                            |
//! | [`pjrt_plugin_dir`]        | `root/pjrt`                          |                            |
//! | [`pjrt_cuda_plugin_dir`]   | `root/pjrt-cuda`                     |                            |
//! | [`py_build_dir`]           | `root/py-build`                      |                            |
//! | [`conformance_models_dir`] | `root/conformance-models`            | `SEAM_CONFORMANCE_CACHE`   |
//!
//! Two places cannot call these functions and follow the same rule by hand (`$SEAM_HOME`, else the
//! checkout's `.seam`): `scripts/build-prereqs.sh`, which installs into [`py_build_dir`] and
//! [`pjrt_plugin_dir`], and `crates/pjrt-runtime/build.rs`, which reads the PJRT header from
//! [`pjrt_plugin_dir`]. `SEAM_HOME` should be an absolute path: a build script runs in its
//! crate's folder, not where cargo was started.
//!
//! An empty environment variable counts as unset.

use std::path::{Path, PathBuf};

/// Moves [`root`] (and with it everything below it).
pub const HOME_ENV: &str = "SEAM_HOME";
/// Moves [`cache_dir`] alone (`seam bench` points it at an empty folder to measure a cold load).
pub const CACHE_ENV: &str = "SEAM_CACHE_DIR";
/// Moves [`conformance_models_dir`] alone.
pub const CONFORMANCE_MODELS_ENV: &str = "SEAM_CONFORMANCE_CACHE";

/// The value of the environment variable `name`, unless unset or empty.
fn env_dir(name: &str) -> Option<PathBuf> {
    std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from)
}

/// The seam checkout this crate was built in, if it is one (a crate built from a registry has no
/// workspace around it, and must not write into cargo's source cache).
fn workspace_root() -> Option<PathBuf> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    // crates/llama-model → the workspace root two levels up.
    let workspace = manifest.parent()?.parent()?;
    workspace.join("crates/llama-model/Cargo.toml").is_file().then(|| workspace.to_path_buf())
}

/// seam's data folder: `$SEAM_HOME` if set; else, for a process run from a seam checkout (its
/// executable under the checkout, as `cargo run`, `cargo test` and `target/debug/seam` are, or its
/// working directory inside it), the checkout's git-ignored `.seam`; else the user's cache folder,
/// `$XDG_CACHE_HOME/seam` or `~/.cache/seam` (a vendor's binary or tests that depend on seam by
/// path or git never write into seam's source); else `<temp>/seam`.
pub fn root() -> PathBuf {
    choose_root(&Places {
        seam_home: env_dir(HOME_ENV),
        checkout: workspace_root(),
        exe: std::env::current_exe().ok(),
        cwd: std::env::current_dir().ok(),
        xdg_cache: env_dir("XDG_CACHE_HOME"),
        home: env_dir("HOME"),
    })
}

/// What [`root`] decides from.
#[derive(Debug, Default)]
struct Places {
    seam_home: Option<PathBuf>,
    checkout: Option<PathBuf>,
    exe: Option<PathBuf>,
    cwd: Option<PathBuf>,
    xdg_cache: Option<PathBuf>,
    home: Option<PathBuf>,
}

fn choose_root(p: &Places) -> PathBuf {
    if let Some(home) = &p.seam_home {
        return home.clone();
    }
    if let Some(checkout) = &p.checkout {
        let inside = |path: &Option<PathBuf>| path.as_ref().is_some_and(|path| path.starts_with(checkout));
        if inside(&p.exe) || inside(&p.cwd) {
            return checkout.join(".seam");
        }
    }
    match (&p.xdg_cache, &p.home) {
        (Some(cache), _) => cache.join("seam"),
        (None, Some(home)) => home.join(".cache").join("seam"),
        (None, None) => std::env::temp_dir().join("seam"),
    }
}

/// Installed model directories: `root/models` (the default model is
/// [`crate::default_model::default_model_dir`], one folder in it).
pub fn models_dir() -> PathBuf {
    root().join("models")
}

/// Downloaded files (wheels, GGUFs, fixtures): `root/downloads`.
pub fn downloads_dir() -> PathBuf {
    root().join("downloads")
}

/// The root of the compiled-graph caches: `$SEAM_CACHE_DIR` if set, else `root/cache`.
/// Each backend caches in its own folder below it ([`iree_cache_dir`], [`pjrt_cache_dir`]).
pub fn cache_dir() -> PathBuf {
    env_dir(CACHE_ENV).unwrap_or_else(|| root().join("cache"))
}

/// The IREE backends' compiled modules (`<sha256>.vmfb`): `cache_dir/iree`.
pub fn iree_cache_dir() -> PathBuf {
    cache_dir().join("iree")
}

/// The PJRT backends' compiled executables (`<key>.pjrtexe`): `cache_dir/pjrt`.
pub fn pjrt_cache_dir() -> PathBuf {
    cache_dir().join("pjrt")
}

/// Weights laid out as the graphs take them (`<key>.weights`), written by a model's first load
/// and memory-mapped by later ones: `cache_dir/weights`.
pub fn prepared_weights_dir() -> PathBuf {
    cache_dir().join("weights")
}

/// The project-local install of the IREE compiler wheel (`iree-base-compiler`, pip `--target`),
/// installed on a backend's first load: `root/py-iree`.
pub fn py_iree_dir() -> PathBuf {
    root().join("py-iree")
}

/// The project-local install of the PJRT CPU plugin wheel (`xla-cpu-pjrt`, which also ships the
/// PJRT C API header), put there by `scripts/build-prereqs.sh`: `root/pjrt`.
pub fn pjrt_plugin_dir() -> PathBuf {
    root().join("pjrt")
}

/// The project-local installs of a CUDA PJRT plugin and the NVIDIA libraries it loads, which
/// `pjrt-cuda` makes on its first load on a machine with an NVIDIA driver (`seam install
/// pjrt-cuda` ahead of time), one folder per pinned set: `root/pjrt-cuda`.
pub fn pjrt_cuda_plugin_dir() -> PathBuf {
    root().join("pjrt-cuda")
}

/// Build tools `scripts/build-prereqs.sh` installs when the system lacks them (cmake, libclang):
/// `root/py-build`. Only the script writes here; the function names the place for everything
/// else (documentation, cleanup).
pub fn py_build_dir() -> PathBuf {
    root().join("py-build")
}

/// The random-weight checkpoints the conformance suite generates (they are deterministic, so a
/// cache is safe to share): `$SEAM_CONFORMANCE_CACHE` if set, else `root/conformance-models`.
pub fn conformance_models_dir() -> PathBuf {
    env_dir(CONFORMANCE_MODELS_ENV).unwrap_or_else(|| root().join("conformance-models"))
}

/// The lock file that serializes installs of the default model across processes.
pub(crate) fn install_lock_file() -> PathBuf {
    root().join(".install.lock")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_project_local_by_default() {
        // Only meaningful when the caller did not move the folders.
        if std::env::var_os(HOME_ENV).is_none() {
            let home = root();
            assert!(home.ends_with(".seam"));
            assert!(home.parent().unwrap().join("Cargo.toml").is_file(), "{}", home.display());
        }
        let home = root();
        assert_eq!(models_dir(), home.join("models"));
        assert_eq!(downloads_dir(), home.join("downloads"));
        assert_eq!(py_iree_dir(), home.join("py-iree"));
        assert_eq!(pjrt_plugin_dir(), home.join("pjrt"));
        assert_eq!(pjrt_cuda_plugin_dir(), home.join("pjrt-cuda"));
        assert_eq!(py_build_dir(), home.join("py-build"));
        assert_eq!(iree_cache_dir(), cache_dir().join("iree"));
        assert_eq!(pjrt_cache_dir(), cache_dir().join("pjrt"));
        if std::env::var_os(CACHE_ENV).is_none() {
            assert_eq!(cache_dir(), home.join("cache"));
        }
        if std::env::var_os(CONFORMANCE_MODELS_ENV).is_none() {
            assert_eq!(conformance_models_dir(), home.join("conformance-models"));
        }
    }

    #[test]
    fn a_program_outside_the_checkout_writes_to_the_users_cache() {
        let checkout = Some(PathBuf::from("/src/seam"));
        let at = |exe: &str, cwd: &str| Places {
            checkout: checkout.clone(),
            exe: Some(PathBuf::from(exe)),
            cwd: Some(PathBuf::from(cwd)),
            home: Some(PathBuf::from("/home/u")),
            ..Places::default()
        };
        // seam's own binaries and tests, or any command run inside the checkout.
        assert_eq!(choose_root(&at("/src/seam/target/debug/seam", "/tmp")), PathBuf::from("/src/seam/.seam"));
        assert_eq!(choose_root(&at("/usr/bin/x", "/src/seam/crates/cli")), PathBuf::from("/src/seam/.seam"));
        // A vendor's binary or tests depending on seam by path or git.
        let vendor = at("/work/vendor/target/debug/deps/conformance-1a2b", "/work/vendor");
        assert_eq!(choose_root(&vendor), PathBuf::from("/home/u/.cache/seam"));
        assert_eq!(choose_root(&Places { xdg_cache: Some(PathBuf::from("/c")), ..vendor }), PathBuf::from("/c/seam"));
        // A prefix of the name is not inside: /src/seam-fork is another folder.
        assert_eq!(choose_root(&at("/src/seam-fork/target/x", "/")), PathBuf::from("/home/u/.cache/seam"));
        // SEAM_HOME wins everywhere.
        let moved = Places { seam_home: Some(PathBuf::from("/data/seam")), ..at("/src/seam/target/x", "/") };
        assert_eq!(choose_root(&moved), PathBuf::from("/data/seam"));
    }
}
