//! The CUDA PJRT plugin seam installs itself: JAX's `jax-cuda13-pjrt` and the NVIDIA CUDA 13
//! libraries it loads at run time, pinned by version and sha256, installed with pip into a
//! project-local folder ([`install_dir`]) on `pjrt-cuda`'s first load on a machine whose NVIDIA
//! driver can run them (or ahead of time, GPU or not, by `seam install pjrt-cuda`).
//!
//! Why this set: the plugin `dlopen`s cuBLAS, cuDNN, the CUDA runtime, NCCL and the rest from
//! `nvidia/...` folders beside its own site-packages (its `RPATH`), and XLA finds `ptxas` and
//! libdevice there too; the wheels `jax-cuda13-plugin[with-cuda]` lists lay them out exactly so.
//! pip's `--target` makes the install folder such a site-packages. The versions are CUDA 13.0's
//! (update 2), which every driver that runs CUDA 13 supports; `jax-cuda13-pjrt` 0.11.2 is the
//! plugin seam ran on an H200 (docs/backends/pjrt.md). Each pin lists the sha256 of its Linux
//! x86_64 and aarch64 wheels, and pip installs nothing else (`--require-hashes --no-deps`).
//!
//! The install is whole or absent: pip fills a temporary folder beside the destination, which is
//! renamed into place only when the plugin is in it (a failure or an interrupt leaves nothing
//! that a later search would take for an install).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// One pinned wheel: a distribution, its version and the sha256 of its Linux wheels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinnedWheel {
    pub package: &'static str,
    pub version: &'static str,
    /// The sha256 of the version's manylinux x86_64 and aarch64 wheels (pip accepts either).
    pub sha256: [&'static str; 2],
}

const fn pin(package: &'static str, version: &'static str, sha256: [&'static str; 2]) -> PinnedWheel {
    PinnedWheel { package, version, sha256 }
}

/// A plugin and the libraries it needs, installed together into one folder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PluginSet {
    /// The install folder's name below [`llama_model::home::pjrt_cuda_plugin_dir`]: a changed pin
    /// makes a new name, so an old install is never mistaken for the new set.
    pub name: &'static str,
    /// The oldest CUDA version (as the driver reports it, `major * 1000 + minor * 10`) the set
    /// runs on.
    pub min_cuda: i32,
    /// The plugin library, relative to the install folder.
    pub plugin_file: &'static str,
    /// What the download comes to, for the message before it starts.
    pub download: &'static str,
    pub wheels: &'static [PinnedWheel],
}

/// The set `pjrt-cuda` installs.
pub const CUDA13: PluginSet = PluginSet {
    name: "jax-cuda13-pjrt-0.11.2",
    min_cuda: 13000,
    plugin_file: "jax_plugins/xla_cuda13/xla_cuda_plugin.so",
    download: "about 3 GB",
    wheels: &[
        pin(
            "jax-cuda13-pjrt",
            "0.11.2",
            [
                "63b55e50e5c2583a25e196ba06b034b63d2b2d8ad4c2f17935652c8d3ad2dd2d",
                "e5ff589d43064913bb74027682d89639c7ea48f9f81c2bae6fc75117e913f93e",
            ],
        ),
        pin(
            "nvidia-cuda-runtime",
            "13.0.96",
            [
                "ef9bcbe90493a2b9d810e43d249adb3d02e98dd30200d86607d8d02687c43f55",
                "7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548",
            ],
        ),
        pin(
            "nvidia-cublas",
            "13.1.0.3",
            [
                "c86fc7f7ae36d7528288c5d88098edcb7b02c633d262e7ddbb86b0ad91be5df2",
                "ee8722c1f0145ab246bccb9e452153b5e0515fd094c3678df50b2a0888b8b171",
            ],
        ),
        pin(
            "nvidia-cuda-cupti",
            "13.0.85",
            [
                "796bd679890ee55fb14a94629b698b6db54bcfd833d391d5e94017dd9d7d3151",
                "4eb01c08e859bf924d222250d2e8f8b8ff6d3db4721288cf35d14252a4d933c8",
            ],
        ),
        pin(
            "nvidia-cuda-nvcc",
            "13.0.88",
            [
                "c7ff28f86a24effdc6c034fa15230c549a273e4771b10a7fec14996f8cf3307f",
                "56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03",
            ],
        ),
        pin(
            "nvidia-cuda-nvrtc",
            "13.0.88",
            [
                "ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575",
                "d27f20a0ca67a4bb34268a5e951033496c5b74870b868bacd046b1b8e0c3267b",
            ],
        ),
        pin(
            "nvidia-nvjitlink",
            "13.0.88",
            [
                "13a74f429e23b921c1109976abefacc69835f2f433ebd323d3946e11d804e47b",
                "e931536ccc7d467a98ba1d8b89ff7fa7f1fa3b13f2b0069118cd7f47bff07d0c",
            ],
        ),
        pin(
            "nvidia-nvvm",
            "13.0.88",
            [
                "c5f41ffeb6466944a026dfa5317d7d85355c119bbec279205d22f1869d1054e0",
                "c4376a291d72d22a315d9d2f69bdae8f8cd83a627f75bad395cee49a0fe65dc1",
            ],
        ),
        pin(
            "nvidia-cudnn-cu13",
            "9.13.1.26",
            [
                "60689ff339611eb7e763a1eaeea81a2263071418bb49bcd080dddbf0ef9898d3",
                "a0f434a881ce8b35afe3a328634db1da4a3852fc6dfbe89577f3e78400ee10d0",
            ],
        ),
        pin(
            "nvidia-cufft",
            "12.0.0.61",
            [
                "2708c852ef8cd89d1d2068bdbece0aa188813a0c934db3779b9b1faa8442e5f5",
                "6c44f692dce8fd5ffd3e3df134b6cdb9c2f72d99cf40b62c32dde45eea9ddad3",
            ],
        ),
        pin(
            "nvidia-cusolver",
            "12.0.4.66",
            [
                "02c2457eaa9e39de20f880f4bd8820e6a1cfb9f9a34f820eb12a155aa5bc92d2",
                "0a759da5dea5c0ea10fd307de75cdeb59e7ea4fcb8add0924859b944babf1112",
            ],
        ),
        pin(
            "nvidia-cusparse",
            "12.6.3.3",
            [
                "80bcc4662f23f1054ee334a15c72b8940402975e0eab63178fc7e670aa59472c",
                "2b3c89c88d01ee0e477cb7f82ef60a11a4bcd57b6b87c33f789350b59759360b",
            ],
        ),
        pin(
            "nvidia-nccl-cu13",
            "2.28.7",
            [
                "7b386e887830666e6fce17287a00173cc78a7e9abf158138b99a45f59e9904e2",
                "f9988ff615aa2e21dffc606a8e5861fe41f4140b4540856a780009c4b1c3626f",
            ],
        ),
        pin(
            "nvidia-nvshmem-cu13",
            "3.4.5",
            [
                "6dc2a197f38e5d0376ad52cd1a2a3617d3cdc150fd5966f4aee9bcebb1d68fe9",
                "290f0a2ee94c9f3687a02502f3b9299a9f9fe826e6d0287ee18482e78d495b80",
            ],
        ),
    ],
};

/// The folder `set` is installed into.
pub fn install_dir(set: &PluginSet) -> PathBuf {
    llama_model::home::pjrt_cuda_plugin_dir().join(set.name)
}

/// The installed plugin of `set`, if it is there.
pub fn installed_plugin(set: &PluginSet) -> Option<PathBuf> {
    let plugin = install_dir(set).join(set.plugin_file);
    plugin.is_file().then_some(plugin)
}

/// pip's requirements for `set`: one line per wheel, every hash it may have.
pub fn requirements(set: &PluginSet) -> String {
    set.wheels
        .iter()
        .map(|wheel| {
            let hashes: Vec<String> = wheel.sha256.iter().map(|h| format!("--hash=sha256:{h}")).collect();
            format!("{}=={} {}\n", wheel.package, wheel.version, hashes.join(" "))
        })
        .collect()
}

/// What the NVIDIA driver of this machine reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Driver {
    /// The newest CUDA version the driver runs (`cuDriverGetVersion`: 13000 is 13.0).
    pub cuda: i32,
    /// How many GPUs it sees (0 when `cuInit` fails: no device, or none visible to this process).
    pub devices: i32,
}

/// A CUDA version as `cuDriverGetVersion` encodes it, as text (`13000` is `13.0`).
pub fn cuda_version_text(version: i32) -> String {
    format!("{}.{}", version / 1000, (version % 1000) / 10)
}

/// Asks the NVIDIA driver library (`libcuda.so.1`, [`cuda_kernels::driver_library`]) for its CUDA
/// version and GPU count; the error says why there is no driver to ask.
pub fn probe_driver() -> Result<Driver, String> {
    type GetVersion = unsafe extern "C" fn(*mut std::ffi::c_int) -> std::ffi::c_int;
    type Init = unsafe extern "C" fn(std::ffi::c_uint) -> std::ffi::c_int;
    type DeviceCount = unsafe extern "C" fn(*mut std::ffi::c_int) -> std::ffi::c_int;
    // SAFETY: the three are the CUDA driver API's functions of these signatures; each writes only
    // through the pointer it is given, which points at a live int.
    unsafe {
        let get_version = cuda_kernels::driver_symbol::<GetVersion>("cuDriverGetVersion").map_err(|e| e.0)?;
        let init = cuda_kernels::driver_symbol::<Init>("cuInit").map_err(|e| e.0)?;
        let device_count = cuda_kernels::driver_symbol::<DeviceCount>("cuDeviceGetCount").map_err(|e| e.0)?;
        let mut cuda = 0;
        if get_version(&mut cuda) != 0 {
            return Err("the NVIDIA driver did not report its CUDA version".into());
        }
        let mut devices = 0;
        if init(0) != 0 || device_count(&mut devices) != 0 {
            devices = 0;
        }
        Ok(Driver { cuda, devices })
    }
}

/// Why `set` cannot run with `driver`, if it cannot.
pub fn unsuitable(set: &PluginSet, driver: &Driver) -> Option<String> {
    if driver.devices == 0 {
        return Some("the NVIDIA driver sees no GPU".into());
    }
    (driver.cuda < set.min_cuda).then(|| {
        format!(
            "the NVIDIA driver runs CUDA {} and {} needs CUDA {} (driver 580 or newer); update the driver, \
             or install a plugin for the driver's CUDA yourself (`pip install jax-cuda12-pjrt \
             'jax-cuda12-plugin[with-cuda]'`) and seam finds it",
            cuda_version_text(driver.cuda),
            set.name,
            cuda_version_text(set.min_cuda)
        )
    })
}

/// `set`'s plugin, installed first if it is not there. Concurrent callers install once (a file
/// lock beside the install folders). pip's progress and errors go to stderr; `announce` is told
/// what is about to be installed where, before the download starts.
pub fn ensure_installed(set: &PluginSet, announce: &dyn Fn(&str)) -> Result<PathBuf, String> {
    if let Some(plugin) = installed_plugin(set) {
        return Ok(plugin);
    }
    let dest = install_dir(set);
    let parent = atomic_write::parent_of(&dest).to_path_buf();
    let io_error = |path: &Path, e: std::io::Error| format!("{}: {e}", path.display());
    std::fs::create_dir_all(&parent).map_err(|e| io_error(&parent, e))?;
    let lock_path = parent.join(".install.lock");
    let lock = std::fs::File::create(&lock_path).map_err(|e| io_error(&lock_path, e))?;
    lock.lock().map_err(|e| io_error(&lock_path, e))?;
    if let Some(plugin) = installed_plugin(set) {
        return Ok(plugin);
    }
    announce(&format!(
        "installing the CUDA PJRT plugin {} with NVIDIA's CUDA libraries ({}, once) into {}",
        set.name,
        set.download,
        dest.display()
    ));
    install_with(set, &dest, &pip_install)
}

/// Installs `set` into `dest` through `install` (pip, or a test's stand-in), which fills the
/// folder it is given from the requirements text.
pub fn install_with(
    set: &PluginSet,
    dest: &Path,
    install: &dyn Fn(&Path, &str) -> Result<(), String>,
) -> Result<PathBuf, String> {
    let staging = atomic_write::TempDir::create(dest).map_err(|e| format!("{}: {e}", dest.display()))?;
    install(staging.path(), &requirements(set))?;
    if !staging.path().join(set.plugin_file).is_file() {
        return Err(format!("the install of {} holds no {}", set.name, set.plugin_file));
    }
    // A folder at `dest` without the plugin (made by hand, or by an older seam) is replaced.
    staging.commit(atomic_write::Existing::Replace).map_err(|e| format!("{}: {e}", dest.display()))?;
    Ok(dest.join(set.plugin_file))
}

/// `python3 -m pip install --target DIR` of exactly the pinned wheels (the requirements on pip's
/// stdin). pip's output goes to stderr: stdout may be the generated text.
fn pip_install(target: &Path, requirements: &str) -> Result<(), String> {
    let mut child = Command::new("python3")
        .args(["-m", "pip", "install", "--disable-pip-version-check", "--no-deps", "--require-hashes"])
        .args(["--only-binary", ":all:", "--target"])
        .arg(target)
        .args(["-r", "/dev/stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::from(std::io::stderr()))
        .spawn()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => "python3 is not installed; seam needs it (with pip) once, to install \
                                             the CUDA PJRT plugin"
                .to_string(),
            _ => format!("running python3 -m pip: {e}"),
        })?;
    let written = child.stdin.take().map(|mut stdin| stdin.write_all(requirements.as_bytes()));
    let status = child.wait().map_err(|e| format!("waiting for pip: {e}"))?;
    if !status.success() {
        return Err(format!(
            "`python3 -m pip install --target {}` failed ({status}); pip's output is above",
            target.display()
        ));
    }
    written.transpose().map_err(|e| format!("writing pip's requirements: {e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requirements_pin_every_wheel_by_version_and_hash() {
        let text = requirements(&CUDA13);
        assert_eq!(text.lines().count(), CUDA13.wheels.len());
        for line in text.lines() {
            let mut words = line.split(' ');
            assert!(words.next().unwrap().contains("=="), "{line}");
            let hashes: Vec<&str> = words.collect();
            assert_eq!(hashes.len(), 2, "{line}");
            for hash in hashes {
                let hex = hash.strip_prefix("--hash=sha256:").unwrap();
                assert!(hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()), "{line}");
            }
        }
        assert!(text.starts_with("jax-cuda13-pjrt==0.11.2 "));
    }

    #[test]
    fn a_driver_is_suitable_only_with_a_gpu_and_cuda_13() {
        assert_eq!(unsuitable(&CUDA13, &Driver { cuda: 13000, devices: 1 }), None);
        assert_eq!(unsuitable(&CUDA13, &Driver { cuda: 13020, devices: 8 }), None);
        let old = unsuitable(&CUDA13, &Driver { cuda: 12080, devices: 1 }).unwrap();
        assert!(old.contains("CUDA 12.8") && old.contains("needs CUDA 13.0"), "{old}");
        let none = unsuitable(&CUDA13, &Driver { cuda: 13000, devices: 0 }).unwrap();
        assert!(none.contains("no GPU"), "{none}");
    }

    #[test]
    fn an_install_is_whole_or_absent() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join(CUDA13.name);
        // pip fails: nothing is left, not even the staging folder.
        let err = install_with(&CUDA13, &dest, &|_, _| Err("no network".into())).unwrap_err();
        assert_eq!(err, "no network");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        // pip succeeds without the plugin: refused, nothing left.
        let err = install_with(&CUDA13, &dest, &|target, _| {
            std::fs::write(target.join("something"), b"x").map_err(|e| e.to_string())
        })
        .unwrap_err();
        assert!(err.contains("holds no"), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        // A whole install: in place, with what pip was given.
        let fake_pip = |target: &Path, requirements: &str| {
            let plugin = target.join(CUDA13.plugin_file);
            std::fs::create_dir_all(plugin.parent().unwrap()).unwrap();
            std::fs::write(plugin, requirements).map_err(|e| e.to_string())
        };
        let plugin = install_with(&CUDA13, &dest, &fake_pip).unwrap();
        assert_eq!(plugin, dest.join(CUDA13.plugin_file));
        assert_eq!(std::fs::read_to_string(&plugin).unwrap(), requirements(&CUDA13));
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, [CUDA13.name], "only the install, no temporary");
    }

    #[test]
    fn cuda_versions_read_as_the_driver_means_them() {
        assert_eq!(cuda_version_text(13000), "13.0");
        assert_eq!(cuda_version_text(12080), "12.8");
        assert_eq!(cuda_version_text(13020), "13.2");
    }
}
