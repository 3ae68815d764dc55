//! The kernels' source compiled for this machine's CPU (`tests/emulate.cpp`): every thread's
//! share of every block of the three products, summed as the kernels' reductions sum them, against
//! each weight format's definition. Tests the indexing and the dequantization without a GPU.

use std::path::Path;
use std::process::Command;

#[test]
fn the_kernels_threads_compute_each_formats_products() {
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("emulate");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/emulate.cpp");
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let built = Command::new(&compiler)
        .args(["-O1", "-std=c++17", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(&source)
        .output()
        .unwrap_or_else(|e| panic!("running the C++ compiler {compiler}: {e}"));
    assert!(built.status.success(), "compiling the emulation: {}", String::from_utf8_lossy(&built.stderr));
    let run = Command::new(&exe).output().unwrap();
    let report = String::from_utf8_lossy(&run.stdout);
    println!("{report}");
    assert!(run.status.success(), "the emulated kernels disagree with the formats:\n{report}");
    // Every format on every shape (a harness that checked nothing would print nothing).
    assert_eq!(report.lines().filter(|l| l.ends_with(": ok")).count(), 15, "{report}");
}

#[test]
fn the_embedded_ptx_has_every_entry_point() {
    for kernel in cuda_kernels::Kernel::ALL {
        let entry = format!(".visible .entry {}(", kernel.entry());
        assert!(cuda_kernels::PRODUCTS_PTX.contains(&entry), "{entry}");
        let params = cuda_kernels::PRODUCTS_PTX.split(&entry).nth(1).unwrap().split(')').next().unwrap();
        // The pointers, then rows and k.
        assert_eq!(params.matches(".param .u64").count(), kernel.pointers(), "{}", kernel.entry());
        assert_eq!(params.matches(".param .u32").count(), 2, "{}", kernel.entry());
    }
    assert!(cuda_kernels::PRODUCTS_PTX.ends_with('\0'));
}

#[test]
fn shapes_the_kernels_cannot_take_are_refused() {
    assert!(cuda_kernels::check_shape(8, 64).is_ok());
    assert!(cuda_kernels::check_shape(8, 48).is_err());
    assert!(cuda_kernels::check_shape(0, 64).is_err());
    assert_eq!(cuda_kernels::grid(9), (3, 256));
}

#[test]
fn without_a_driver_launching_is_an_error() {
    if Path::new("/proc/driver/nvidia").exists() {
        return; // a machine with the driver: nothing to check here
    }
    let error = cuda_kernels::Driver::get().err().expect("no driver on this machine");
    assert!(error.0.contains("libcuda.so.1"), "{error}");
}
