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
    // Every format on every shape in every tiling, one matrix with a residual and a normed set of
    // three (a harness that checked nothing would print nothing).
    let cases = 2 * 3 * 5 * cuda_kernels::Tiling::ALL.len();
    assert_eq!(report.lines().filter(|l| l.ends_with(": ok")).count(), cases, "{report}");
    for tiling in cuda_kernels::Tiling::ALL {
        assert!(report.contains(&format!(" {tiling} ")), "the emulation skipped {tiling}:\n{report}");
    }
}

#[test]
fn the_embedded_ptx_has_every_entry_point() {
    for kernel in cuda_kernels::Kernel::ALL {
        for tiling in cuda_kernels::Tiling::ALL {
            let name = kernel.entry(tiling);
            let entry = format!(".visible .entry {name}(");
            assert!(cuda_kernels::PRODUCTS_PTX.contains(&entry), "{entry}");
            let params = cuda_kernels::PRODUCTS_PTX.split(&entry).nth(1).unwrap().split(')').next().unwrap();
            // x, norm and eps, the products (as `ProductsParam` lays them out), then k.
            assert_eq!(params.matches(".param .u64").count(), 3, "{name}");
            let size = std::mem::size_of::<cuda_kernels::ProductsParam>();
            assert!(params.contains(&format!(".param .align 8 .b8 {name}_param_3[{size}]")), "{name}: {params}");
            assert_eq!(params.matches(".param .u32").count(), 1, "{name}");
            // The block size the entry point was compiled for is the one it is launched with.
            let body = cuda_kernels::PRODUCTS_PTX.split(&entry).nth(1).unwrap();
            let bounds = body.lines().find(|l| l.contains(".maxntid")).unwrap_or_else(|| panic!("{name}: no .maxntid"));
            assert!(bounds.contains(&format!(".maxntid {}, 1, 1", tiling.threads)), "{name}: {bounds}");
        }
    }
    assert_eq!(cuda_kernels::PRODUCTS_PTX.matches(".visible .entry").count(), 3 * cuda_kernels::Tiling::ALL.len());
    assert!(cuda_kernels::PRODUCTS_PTX.ends_with('\0'));
}

#[test]
fn a_launchs_matrices_take_consecutive_blocks() {
    use cuda_kernels::{Kernel, Launch, Matrix, Tiling};
    let at = |a: usize| a as *mut std::ffi::c_void;
    let matrix = |rows, base: usize, arrays: usize| Matrix {
        arrays: (0..arrays).map(|i| at(base + 16 * i)).collect(),
        y: at(base + 256),
        residual: None,
        rows,
    };
    let mut matrices = [matrix(2048, 0x1000, 3), matrix(512, 0x2000, 3), matrix(9, 0x3000, 3)];
    matrices[1].residual = Some(at(0x2200));
    let launch = Launch { kernel: Kernel::Int4, x: at(0x10), norm: None, matrices: &matrices, k: 2048 };
    let tiling: Tiling = "r4t128".parse().unwrap();
    let (param, blocks) = launch.products(tiling).unwrap();
    assert_eq!(blocks, 512 + 128 + 3);
    // The fields as the kernels read them (`seam_products`): arrays, outputs, residuals (null for
    // none), rows, first blocks, count.
    let words: Vec<u64> = unsafe { std::mem::transmute::<cuda_kernels::ProductsParam, [u64; 19]>(param) }.to_vec();
    assert_eq!(&words[..3], &[0x1000, 0x1010, 0x1020]);
    assert_eq!(&words[6..9], &[0x3000, 0x3010, 0x3020]);
    assert_eq!(&words[9..12], &[0x1100, 0x2100, 0x3100]);
    assert_eq!(&words[12..15], &[0, 0x2200, 0]);
    let ints: Vec<i32> = words[15..].iter().flat_map(|w| [*w as u32 as i32, (*w >> 32) as u32 as i32]).collect();
    assert_eq!(&ints[..7], &[2048, 512, 9, 0, 512, 640, 3]);
    // What cannot be launched.
    let wrong_arrays = [matrix(8, 0x1000, 2)];
    let too_many = [matrix(8, 0, 3), matrix(8, 0, 3), matrix(8, 0, 3), matrix(8, 0, 3)];
    for (matrices, k) in [(&wrong_arrays[..], 64), (&too_many[..], 64), (&[][..], 64), (&matrices[..1], 48)] {
        let launch = Launch { kernel: Kernel::Int4, x: at(0x10), norm: None, matrices, k };
        assert!(launch.products(tiling).is_err(), "{} matrices, k {k}", matrices.len());
    }
}

#[test]
fn shapes_the_kernels_cannot_take_are_refused() {
    assert!(cuda_kernels::check_shape(8, 64).is_ok());
    assert!(cuda_kernels::check_shape(8, 48).is_err());
    assert!(cuda_kernels::check_shape(0, 64).is_err());
    assert_eq!(cuda_kernels::Tiling::DEFAULT.grid(9), (3, 256));
    assert_eq!("r8t64".parse::<cuda_kernels::Tiling>().unwrap().grid(9), (2, 64));
}

#[test]
fn tilings_are_chosen_per_format_by_a_setting() {
    use cuda_kernels::{Kernel, Tiling, Tilings};
    let names: Vec<String> = Tiling::ALL.iter().map(Tiling::to_string).collect();
    assert_eq!(names.len(), 12);
    assert!(names.contains(&"r1t64".to_string()) && names.contains(&"r8t256".to_string()), "{names:?}");
    let one = Tilings::parse("r8t128").unwrap();
    assert!(Kernel::ALL.iter().all(|k| one.of(*k).to_string() == "r8t128"));
    let some = Tilings::parse("int4=r2t64, f16=r1t256").unwrap();
    assert_eq!(some.of(Kernel::Int4).to_string(), "r2t64");
    assert_eq!(some.of(Kernel::F16).to_string(), "r1t256");
    assert_eq!(some.of(Kernel::Int8), Tiling::DEFAULT);
    // What a setting prints is a setting that reads back the same.
    assert_eq!(Tilings::parse(&some.to_string()).unwrap(), some);
    // A launch shape's own tiling, for that format and shape only.
    let shaped = Tilings::parse("int4=r2t64,int4@3072x2048=r8t128,f16@3072x2048=r1t64").unwrap();
    assert_eq!(shaped.of_launch(Kernel::Int4, 3072, 2048).to_string(), "r8t128");
    assert_eq!(shaped.of_launch(Kernel::Int4, 2048, 2048).to_string(), "r2t64");
    assert_eq!(shaped.of_launch(Kernel::F16, 3072, 2048).to_string(), "r1t64");
    assert_eq!(shaped.of_launch(Kernel::Int8, 3072, 2048), Tiling::DEFAULT);
    assert_eq!(Tilings::parse(&shaped.to_string()).unwrap(), shaped);
    for bad in ["r3t64", "int5=r1t64", "f16:r1t64,int4=r1t64", "f16=", "", "f16@3072=r1t64", "f16@ax2=r1t64"] {
        let error = Tilings::parse(bad).expect_err(bad);
        assert!(error.contains("tiling") || error.contains("format"), "{bad}: {error}");
    }
}

#[test]
fn without_a_driver_launching_is_an_error() {
    if Path::new("/proc/driver/nvidia").exists() {
        return; // a machine with the driver: nothing to check here
    }
    let error = cuda_kernels::Driver::get().err().expect("no driver on this machine");
    assert!(error.0.contains("libcuda.so.1"), "{error}");
}

#[test]
fn launches_take_the_tilings_installed_for_their_shapes() {
    use cuda_kernels::{Kernel, Tiling, Tilings};
    if Tilings::setting().unwrap().is_some() {
        eprintln!("skipped: {} is set, and overrides what is installed", Tilings::VARIABLE);
        return;
    }
    assert_eq!(Tilings::of_process_launch(Kernel::Int4, 3072, 2048).unwrap(), Tiling::DEFAULT);
    let r2t128: Tiling = "r2t128".parse().unwrap();
    Tilings::install(&Tilings::parse("int4@3072x2048=r2t128,f16=r1t64").unwrap());
    assert_eq!(Tilings::of_process_launch(Kernel::Int4, 3072, 2048).unwrap(), r2t128);
    // Another shape of the format, and the format named without a shape: the default still.
    assert_eq!(Tilings::of_process_launch(Kernel::Int4, 2048, 2048).unwrap(), Tiling::DEFAULT);
    assert_eq!(Tilings::of_process_launch(Kernel::F16, 3072, 2048).unwrap(), Tiling::DEFAULT);
    // A later install adds its shapes and keeps the others.
    Tilings::install(&Tilings::parse("f16@3072x2048=r8t64").unwrap());
    assert_eq!(Tilings::of_process_launch(Kernel::F16, 3072, 2048).unwrap(), "r8t64".parse().unwrap());
    assert_eq!(Tilings::of_process_launch(Kernel::Int4, 3072, 2048).unwrap(), r2t128);
}
