//! The plugin search starts Python (to ask for its site-packages) only when no plugin in the
//! folders it knows without Python loads: with the project's CPU plugin installed, finding it
//! starts no `python3`. A `python3` that records being run is put first on the `PATH`.
//!
//! One test in its own binary: it changes `PATH`, which other tests' processes would see.

use backend_pjrt::plugin_search::find_plugin;
use backend_pjrt::PjrtDevice;

#[test]
fn the_projects_plugin_is_found_without_starting_python() {
    let folder = std::env::temp_dir().join(format!("seam-python-spy-{}", std::process::id()));
    std::fs::create_dir_all(&folder).expect("spy folder");
    let record = folder.join("ran");
    let spy = folder.join("python3");
    std::fs::write(&spy, format!("#!/bin/sh\ntouch '{}'\nexit 1\n", record.display())).expect("spy");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&spy, std::fs::Permissions::from_mode(0o755)).expect("spy mode");
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![folder.clone()];
    paths.extend(std::env::split_paths(&path));
    // SAFETY: the only test of this binary, and nothing else runs in it yet.
    unsafe {
        std::env::set_var("PATH", std::env::join_paths(paths).expect("PATH"));
        std::env::remove_var(PjrtDevice::Cpu.plugin_env());
    }
    // The spy runs when asked: the search would see it.
    assert!(std::process::Command::new("python3").status().is_ok_and(|s| !s.success()));
    assert!(record.exists(), "the spy did not record its run");
    std::fs::remove_file(&record).expect("reset the record");

    let found = find_plugin(PjrtDevice::Cpu);
    let started_python = record.exists();
    let _ = std::fs::remove_dir_all(&folder);
    assert!(found.is_ok(), "the project's CPU plugin (scripts/build-prereqs.sh): {:?}", found.err());
    assert!(!started_python, "the search started python3 though the project's plugin loads");
}
