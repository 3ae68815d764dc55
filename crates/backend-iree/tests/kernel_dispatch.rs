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
    use stablehlo_llama::mlir::{arg, Elem, FnBuilder, Ty};
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
    let x: Vec<f32> = (0..t * k).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.25).collect();
    let norm: Vec<f32> = (0..k).map(|i| 0.5 + (i % 5) as f32 * 0.1).collect();
    let w: Vec<f16> = (0..n * k).map(|i| f16::from_f32(((i * 5 % 17) as f32 - 8.0) * 0.125)).collect();
    let residual: Vec<f32> = (0..t * n).map(|i| (i % 7) as f32 - 3.0).collect();
    let inputs = [
        (bytemuck::cast_slice(&x), ElementType::F32),
        (bytemuck::cast_slice(&norm), ElementType::F32),
        (bytemuck::cast_slice(&w), ElementType::F16),
        (bytemuck::cast_slice(&residual), ElementType::F32),
    ];
    let got = run(b, &vals, &[&y], &inputs).remove(0);

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

/// Compiles the function `b` built (arguments `vals`, results `results`) with its kernel
/// dispatches, runs it on seam's plugin with `inputs` (bytes and element type per argument, of
/// the arguments' shapes) and returns its f32 results.
fn run(
    mut b: stablehlo_llama::mlir::FnBuilder,
    vals: &[stablehlo_llama::mlir::Val],
    results: &[&stablehlo_llama::mlir::Val],
    inputs: &[(&[u8], ElementType)],
) -> Vec<Vec<f32>> {
    use stablehlo_llama::mlir::FnArg;
    let executable = b.take_dispatches().expect("dispatch mode").executable();
    let fn_args: Vec<FnArg> =
        vals.iter().map(|v| FnArg { val: v.clone(), attrs: String::new(), doc: String::new() }).collect();
    let text = format!("module @m {{\n{}{executable}}}\n", b.finish("main", &fn_args, results));

    let library = ensure_compiler_library().expect("the IREE compiler");
    let (compiler, _) = load_compiler(&library).expect("loading the compiler");
    // One compilation at a time: the compiler library's compilations on two threads at once
    // crash (seam's own compiles are serialized the same way, `backend_iree::compiler`).
    static COMPILING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let vmfb = {
        let _one = COMPILING.lock().unwrap_or_else(|e| e.into_inner());
        compiler.compile_str(&text, LLVM_CPU_FLAGS).unwrap_or_else(|e| panic!("{e}\n{text}"))
    };
    let task = TaskSettings { plugin: Some(install().expect("the kernels plugin")), ..TaskSettings::default() };
    let device = create_cpu_device(&task).expect("the device");
    let program = Program::load(&device, vmfb).expect("loading the module");
    let views: Vec<_> =
        inputs.iter().zip(vals).map(|((bytes, elem), v)| device.upload(bytes, *elem, v.dims()).unwrap()).collect();
    let views: Vec<_> = views.iter().collect();
    let outputs = program.function("m.main").unwrap().invoke(&views).expect("the call");
    outputs.iter().map(|o| o.read::<f32>().unwrap()).collect()
}

/// A grouped target (`stablehlo_llama::linear_group_target`) as the emitter dispatches it: three
/// int4 matrices in panels over one RMS-normalized input, the workgroups' shares crossing from
/// one matrix into the next, equal bit for bit to a call of `cpu_kernels::linear` per matrix;
/// the padding row of each result zero. The query and key's rope (`_rope`, shares of whole
/// heads) equal to `cpu_kernels::rope_heads` of the products.
#[test]
fn grouped_linear_dispatches_equal_a_call_per_matrix() {
    grouped_dispatch(&[160, 48, 48], None);
    grouped_dispatch(&[96, 64, 64], Some(32));
}

/// [`grouped_linear_dispatches_equal_a_call_per_matrix`] for matrices of `rows`, roped with heads
/// of `head_dim` if given.
fn grouped_dispatch(rows: &[usize], head_dim: Option<usize>) {
    use cpu_kernels::{Activations, Int4Matrix, LinearWeights};
    use stablehlo_llama::mlir::{arg, Elem, FnBuilder, Ty};
    let (t, k) = (2, 64);
    let groups = k / cpu_kernels::GROUP_SIZE;
    let mut args = vec![Ty::new(&[t, k], Elem::F32), Ty::new(&[k], Elem::F32)];
    for &n in rows {
        args.extend([
            Ty::new(&[n, k / 2], Elem::I8),
            Ty::new(&[n, groups], Elem::F16),
            Ty::new(&[n, groups], Elem::F16),
        ]);
    }
    if let Some(d) = head_dim {
        args.extend([Ty::new(&[t, d], Elem::F32), Ty::new(&[t, d], Elem::F32)]);
    }
    let vals: Vec<_> = args.iter().enumerate().map(|(i, ty)| arg(i, ty.clone())).collect();
    let mut b = FnBuilder::new();
    b.dispatch_kernels_into(Default::default());
    let eps = b.const_f32(1e-5, &[]);
    let real = b.const_int(1, Elem::I32, &[]);
    let mut operands = vec![&vals[0], &vals[1], &eps];
    operands.extend(&vals[2..]);
    operands.push(&real);
    let target = match head_dim {
        Some(_) => "seam_linear_int4p_rmsnorm_x3_rope",
        None => "seam_linear_int4p_rmsnorm_x3",
    };
    let tys: Vec<Ty> = rows.iter().map(|&n| Ty::new(&[t, n], Elem::F32)).collect();
    let results = b.custom_call_results(target, &operands, &[], &tys);

    let x: Vec<f32> = (0..t * k).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.25).collect();
    let norm: Vec<f32> = (0..k).map(|i| 0.5 + (i % 5) as f32 * 0.1).collect();
    let matrices: Vec<(Vec<u8>, Vec<u16>, Vec<u16>)> = rows
        .iter()
        .enumerate()
        .map(|(m, &n)| {
            let packed = (0..n * k / 2).map(|i| ((i * 37 + m * 11) % 251) as u8).collect();
            let scale = |i: usize| f16::from_f32(0.01 + ((i + m) % 5) as f32 * 0.003).to_bits();
            let bias = |i: usize| f16::from_f32(-0.05 + ((i + m) % 3) as f32 * 0.01).to_bits();
            (packed, (0..n * groups).map(scale).collect(), (0..n * groups).map(bias).collect())
        })
        .collect();
    // The packed nibbles and their scales as they are: any bytes are a matrix in panels.
    let mut inputs: Vec<(&[u8], ElementType)> =
        vec![(bytemuck::cast_slice(&x), ElementType::F32), (bytemuck::cast_slice(&norm), ElementType::F32)];
    for (packed, scales, biases) in &matrices {
        inputs.push((packed, ElementType::I8));
        inputs.push((bytemuck::cast_slice(scales), ElementType::F16));
        inputs.push((bytemuck::cast_slice(biases), ElementType::F16));
    }
    let d = head_dim.unwrap_or(0);
    let cos: Vec<f32> = (0..t * d).map(|i| ((i * 3 % 11) as f32 / 11.0).cos()).collect();
    let sin: Vec<f32> = (0..t * d).map(|i| ((i * 3 % 11) as f32 / 11.0).sin()).collect();
    if head_dim.is_some() {
        inputs.extend([(bytemuck::cast_slice(&cos), ElementType::F32), (bytemuck::cast_slice(&sin), ElementType::F32)]);
    }
    let got = run(b, &vals, &results.iter().collect::<Vec<_>>(), &inputs);

    for (m, ((n, (packed, scales, biases)), got)) in rows.iter().zip(&matrices).zip(&got).enumerate() {
        let n = *n;
        let w = Int4Matrix { rows: n, cols: k, packed, scales, biases };
        let mut want = vec![0f32; n];
        cpu_kernels::linear(
            cpu_kernels::Isa::best(),
            &cpu_kernels::pool::Pool::new(1),
            cpu_kernels::LinearInput::RmsNorm { x: &x[..k], weight: &norm, eps: 1e-5 },
            1,
            LinearWeights::Int4Panels(w, Activations::Exact),
            None,
            &mut want,
        )
        .unwrap();
        if head_dim.is_some() && m < 2 {
            cpu_kernels::rope_heads(cpu_kernels::Isa::best(), &mut want, &cos[..d], &sin[..d]).unwrap();
        }
        assert_eq!(got.len(), t * n, "matrix {m}");
        assert!(got[..n].iter().zip(&want).all(|(g, e)| g.to_bits() == e.to_bits()), "matrix {m}");
        assert!(got[n..].iter().all(|&v| v == 0.0), "matrix {m}: the padding row is zero");
    }
}
