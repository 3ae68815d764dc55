//! seam's kernels inside an IREE dispatch: a module whose executable calls the `seam_f16_rows`
//! import (split over several workgroups) computes what the plain definition of `W x` computes.

use backend_iree::compiler::{ensure_compiler_library, load_compiler, LLVM_CPU_FLAGS};
use backend_iree::kernel_plugin::cpu_device_with_kernels;
use backend_iree::task_flags::TaskSettings;
use half::f16;
use iree_runtime::{ElementType, Program};

/// `out = W x` for `W` `[n, k]` f16 through one custom dispatch of `n / rows_per_group`
/// workgroups (the last one shorter when `rows_per_group` does not divide `n`).
fn module(n: usize, k: usize, rows_per_group: usize) -> String {
    format!(
        r#"module @seam_kernel_test {{
  stream.executable private @seam_kernels {{
    stream.executable.export public @f16_rows workgroups(%workload: index) -> (index, index, index) {{
      %groups = affine.apply affine_map<()[s0] -> (s0 ceildiv {rows_per_group})>()[%workload]
      %c1 = arith.constant 1 : index
      stream.return %groups, %c1, %c1 : index, index, index
    }}
    builtin.module {{
      func.func private @seam_f16_rows(memref<f32>, index, memref<f16>, index, memref<f32>, index, index, index, index)
          attributes {{llvm.bareptr = true}}
      func.func @f16_rows(%bx: !stream.binding, %bw: !stream.binding, %bo: !stream.binding) {{
        %c0 = arith.constant 0 : index
        %k = arith.constant {k} : index
        %id = stream.dispatch.workgroup.id[0] : index
        %row0 = affine.apply affine_map<()[s0] -> (s0 * {rows_per_group})>()[%id]
        %rows = affine.min affine_map<()[s0] -> ({rows_per_group}, {n} - s0 * {rows_per_group})>()[%id]
        %x = stream.binding.subspan %bx[%c0] : !stream.binding -> memref<{k}xf32>
        %w = stream.binding.subspan %bw[%c0] : !stream.binding -> memref<{n}x{k}xf16>
        %o = stream.binding.subspan %bo[%c0] : !stream.binding -> memref<{n}xf32>
        %xb, %xo, %xs, %xt = memref.extract_strided_metadata %x : memref<{k}xf32> -> memref<f32>, index, index, index
        %wb, %wo, %ws:2, %wt:2 = memref.extract_strided_metadata %w : memref<{n}x{k}xf16> -> memref<f16>, index, index, index, index, index
        %ob, %oo, %os, %ot = memref.extract_strided_metadata %o : memref<{n}xf32> -> memref<f32>, index, index, index
        func.call @seam_f16_rows(%xb, %xo, %wb, %wo, %ob, %oo, %k, %row0, %rows)
            : (memref<f32>, index, memref<f16>, index, memref<f32>, index, index, index, index) -> ()
        return
      }}
    }}
  }}
  func.func @main(%x: tensor<{k}xf32>, %w: tensor<{n}x{k}xf16>) -> tensor<{n}xf32> {{
    %n = arith.constant {n} : index
    %out = flow.dispatch @seam_kernels::@f16_rows[%n](%x, %w) : (tensor<{k}xf32>, tensor<{n}x{k}xf16>) -> tensor<{n}xf32>
    return %out : tensor<{n}xf32>
  }}
}}
"#
    )
}

#[test]
fn an_iree_dispatch_runs_the_f16_kernel() {
    let (n, k, rows_per_group) = (100, 96, 24);
    let library = ensure_compiler_library().expect("the IREE compiler");
    let (compiler, _) = load_compiler(&library).expect("loading the compiler");
    let vmfb = compiler.compile_str(&module(n, k, rows_per_group), &LLVM_CPU_FLAGS).expect("compiling");

    let device = cpu_device_with_kernels(&TaskSettings::default()).expect("the device");
    let program = Program::load(&device, vmfb).expect("loading the module");
    let x: Vec<f32> = (0..k).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.25).collect();
    let w: Vec<f16> = (0..n * k).map(|i| f16::from_f32(((i * 5 % 17) as f32 - 8.0) * 0.125)).collect();
    let xv = device.upload(bytemuck::cast_slice(&x), ElementType::F32, &[k]).unwrap();
    let wv = device.upload(bytemuck::cast_slice(&w), ElementType::F16, &[n, k]).unwrap();
    let out = program.function("seam_kernel_test.main").unwrap().invoke(&[&xv, &wv]).expect("the call");
    let got = out[0].read::<f32>().unwrap();
    let want: Vec<f32> = (0..n).map(|r| (0..k).map(|c| x[c] * w[r * k + c].to_f32()).sum()).collect();
    assert_eq!(got.len(), n);
    for (r, (g, e)) in got.iter().zip(&want).enumerate() {
        assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "row {r}: {g} vs {e}");
    }
}
