//! seam's kernels inside IREE dispatches: what the graph emitter writes for a kernel call
//! (`KernelCalls::IreeDispatch`: a `stream.executable` whose workgroups call the target as an
//! import, for a share of the output rows each), compiled by IREE and run with seam's executable
//! plugin, equals the kernel called directly. The graphs' own use of it is the conformance
//! suite's (`tests/conformance.rs`).

use backend_iree::compiler::{ensure_compiler_library, load_compiler, LLVM_CPU_FLAGS};
use backend_iree::kernel_plugin::install;
use backend_iree::task_flags::{create_cpu_device, TaskSettings};
use half::f16;
use iree_runtime::{ElementType, Program};

/// `seam_linear_*` targets as the graph emitter dispatches them (`KernelCalls::IreeDispatch`),
/// against `cpu_kernels::linear` called directly: RMSNorm input, f16 weights, two tokens with
/// one real (the padding row must come back zero), and a residual.
#[test]
fn emitted_linear_dispatches_equal_the_kernels() {
    use stablehlo_llama::mlir::{arg, Elem, FnArg, FnBuilder, Ty};
    let (t, k, n) = (2, 64, 200);
    let args = [
        Ty::new(&[t, k], Elem::F32),
        Ty::new(&[k], Elem::F32),
        Ty::new(&[n, k], Elem::F16),
        Ty::new(&[t, n], Elem::F32),
    ];
    let vals: Vec<_> = args.iter().enumerate().map(|(i, ty)| arg(i, ty.clone())).collect();
    let mut b = FnBuilder::new();
    b.dispatch_kernels_into(Default::default());
    let eps = b.const_f32(1e-5, &[]);
    let rows = b.const_int(1, Elem::I32, &[]);
    let target = "seam_linear_f16_rmsnorm_residual";
    let y = b.custom_call(target, &[&vals[0], &vals[1], &eps, &vals[2], &vals[3], &rows], Ty::new(&[t, n], Elem::F32));
    let executable = b.take_dispatches().expect("dispatch mode").executable();
    let fn_args: Vec<FnArg> =
        vals.iter().map(|v| FnArg { val: v.clone(), attrs: String::new(), doc: String::new() }).collect();
    let text = format!("module @m {{\n{}{executable}}}\n", b.finish("main", &fn_args, &[&y]));

    let library = ensure_compiler_library().expect("the IREE compiler");
    let (compiler, _) = load_compiler(&library).expect("loading the compiler");
    let vmfb = compiler.compile_str(&text, LLVM_CPU_FLAGS).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let task = TaskSettings { plugin: Some(install().expect("the kernels plugin")), ..TaskSettings::default() };
    let device = create_cpu_device(&task).expect("the device");
    let program = Program::load(&device, vmfb).expect("loading the module");

    let x: Vec<f32> = (0..t * k).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.25).collect();
    let norm: Vec<f32> = (0..k).map(|i| 0.5 + (i % 5) as f32 * 0.1).collect();
    let w: Vec<f16> = (0..n * k).map(|i| f16::from_f32(((i * 5 % 17) as f32 - 8.0) * 0.125)).collect();
    let residual: Vec<f32> = (0..t * n).map(|i| (i % 7) as f32 - 3.0).collect();
    let views = [
        device.upload(bytemuck::cast_slice(&x), ElementType::F32, &[t, k]).unwrap(),
        device.upload(bytemuck::cast_slice(&norm), ElementType::F32, &[k]).unwrap(),
        device.upload(bytemuck::cast_slice(&w), ElementType::F16, &[n, k]).unwrap(),
        device.upload(bytemuck::cast_slice(&residual), ElementType::F32, &[t, n]).unwrap(),
    ];
    let inputs: Vec<_> = views.iter().collect();
    let got = program.function("m.main").unwrap().invoke(&inputs).expect("the call")[0].read::<f32>().unwrap();

    let bits: Vec<u16> = w.iter().map(|v| v.to_bits()).collect();
    let mut want = vec![0f32; n];
    cpu_kernels::linear(
        cpu_kernels::Isa::best(),
        &cpu_kernels::pool::Pool::new(1),
        cpu_kernels::LinearInput::RmsNorm { x: &x[..k], weight: &norm, eps: 1e-5 },
        1,
        cpu_kernels::LinearWeights::F16(cpu_kernels::F16Matrix { rows: n, cols: k, data: &bits }),
        Some(&residual[..n]),
        &mut want,
    )
    .unwrap();
    assert_eq!(got.len(), t * n);
    for (c, (g, e)) in got[..n].iter().zip(&want).enumerate() {
        assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "column {c}: {g} vs {e}");
    }
    assert!(got[n..].iter().all(|&v| v == 0.0), "the padding row is zero");
}
