//! What a [`Launch`] computes, computed on the host from host memory: for a runtime whose arrays
//! are in host memory (XLA's CPU plugin) to run graphs that call the kernels, so that the calls
//! themselves (operands, their order, the grouped results, the folded norm) are checked against
//! the reference backend without a GPU. The kernels' own arithmetic is checked by the host
//! emulation of their source (`tests/emulate.cpp`); this is the formats' definition, in f32, as
//! the CPU kernels define it (`cpu_kernels::scalar`), written nowhere else.

use crate::{Kernel, Launch, Tiling, GROUP};
use cpu_kernels::scalar;

/// Computes `launch` on the host: each matrix's rows over the input (normalized first when the
/// launch has a norm), added to its residual if it has one, into its output.
///
/// # Safety
/// Every address of `launch` is host memory of the size [`Launch`] gives for its shapes, the
/// outputs writable and not overlapping the inputs.
pub unsafe fn compute(launch: &Launch) -> Result<(), String> {
    // The same checks as a launch on a device.
    launch.products(Tiling::DEFAULT)?;
    let k = launch.k;
    // SAFETY: the caller's promise: x is k floats.
    let x = unsafe { std::slice::from_raw_parts(launch.x as *const f32, k) };
    let (input, scale): (Vec<f32>, f32) = match launch.norm {
        Some(norm) => {
            // SAFETY: the caller's promise: the weight is k floats, epsilon one.
            let (weight, eps) =
                unsafe { (std::slice::from_raw_parts(norm.weight as *const f32, k), *(norm.eps as *const f32)) };
            let squares: f32 = x.iter().map(|v| v * v).sum();
            (x.iter().zip(weight).map(|(x, g)| x * g).collect(), 1.0 / (squares / k as f32 + eps).sqrt())
        }
        None => (x.to_vec(), 1.0),
    };
    let groups = k / GROUP;
    for matrix in launch.matrices {
        let rows = matrix.rows;
        // SAFETY: the caller's promise: the output is `rows` floats of its own.
        let y = unsafe { std::slice::from_raw_parts_mut(matrix.y as *mut f32, rows) };
        let halves = |index: usize, len: usize| {
            // SAFETY: the caller's promise on the format's arrays (f16 bits).
            unsafe { std::slice::from_raw_parts(matrix.arrays[index] as *const u16, len) }
        };
        let residual = matrix.residual.map(|r| {
            // SAFETY: the caller's promise: a residual is `rows` floats.
            unsafe { std::slice::from_raw_parts(r as *const f32, rows) }
        });
        for (r, out) in y.iter_mut().enumerate() {
            let sum: f32 = match launch.kernel {
                Kernel::F16 => scalar::dot_f16(&input, &halves(0, rows * k)[r * k..(r + 1) * k]),
                Kernel::Int8 => {
                    // SAFETY: as above; the codes are `rows * k` bytes.
                    let q = unsafe { std::slice::from_raw_parts(matrix.arrays[0] as *const i8, rows * k) };
                    let scales = &halves(1, rows * groups)[r * groups..(r + 1) * groups];
                    scalar::dot_int8(&input, &q[r * k..(r + 1) * k], scales, GROUP)
                }
                Kernel::Int4 => {
                    // SAFETY: as above; the packed codes are `rows * k / 2` bytes.
                    let packed = unsafe { std::slice::from_raw_parts(matrix.arrays[0] as *const u8, rows * k / 2) };
                    let scales = &halves(1, rows * groups)[r * groups..(r + 1) * groups];
                    let biases = &halves(2, rows * groups)[r * groups..(r + 1) * groups];
                    scalar::dot_int4(&input, &packed[r * k / 2..(r + 1) * k / 2], scales, biases, GROUP)
                }
            };
            *out = residual.map_or(0.0, |residual| residual[r]) + sum * scale;
        }
    }
    Ok(())
}
