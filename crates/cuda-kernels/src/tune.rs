//! Picking the kernels' tilings on the GPU at hand: every tiling of each launch shape a model's
//! decode step makes is timed on the device, and the fastest is chosen per shape ([`tune`]).
//! How fast a tiling is depends on the GPU (its SMs, its memory, its L2) and on the shape (a
//! block per row of a short matrix leaves SMs idle; a long one wants more bytes in flight), so
//! it is measured rather than guessed. The timing ([`Bench`]) is the probe's too.

use crate::device::{Device, DeviceBuffer};
use crate::{CudaError, Kernel, Launch, Matrix, Norm, Tiling, Tilings};
use std::ffi::c_void;

/// One kind of launch: a format, the rows of each of its matrices (one to
/// [`crate::MAX_MATRICES`]), their inputs, whether the input is RMS-normalized in the launch, and
/// whether each output is added to a residual.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LaunchShape {
    /// The matrices' format.
    pub kernel: Kernel,
    /// Each matrix's rows.
    pub matrices: Vec<usize>,
    /// Inputs per row.
    pub k: usize,
    /// Whether the launch applies an RMSNorm to its input.
    pub normed: bool,
    /// Whether each matrix's output is added to a residual.
    pub residual: bool,
}

impl LaunchShape {
    /// The rows of all its matrices: with the format and `k`, the key [`Tilings`] picks a launch's
    /// tiling by.
    pub fn rows(&self) -> usize {
        self.matrices.iter().sum()
    }

    /// The weights' bytes one launch reads.
    pub fn weight_bytes(&self) -> usize {
        self.matrices.iter().map(|rows| self.kernel.array_bytes(*rows, self.k).iter().sum::<usize>()).sum()
    }
}

/// Launches per timed graph, at least.
pub const LAUNCHES: usize = 50;

/// Bytes of weight copies a [`Bench`]'s launches cycle through: more than any GPU's L2 cache, so
/// that the weights come from the device's memory, as in a decode step (which reads every matrix
/// once).
pub const ROTATION_BYTES: usize = 256 << 20;

/// Timed graph launches per tiling, of which the shortest counts.
const REPEATS: usize = 3;

/// A launch shape's operands on the device, the matrices in enough copies to overflow the L2
/// cache, ready to time the shape's launches in each tiling.
pub struct Bench<'d> {
    device: &'d Device,
    shape: LaunchShape,
    x: DeviceBuffer<'d>,
    norm: Option<(DeviceBuffer<'d>, DeviceBuffer<'d>)>,
    ys: Vec<DeviceBuffer<'d>>,
    /// Per copy, the launch's matrices.
    copies: Vec<Vec<Matrix>>,
    _buffers: Vec<DeviceBuffer<'d>>,
}

impl<'d> Bench<'d> {
    /// A bench of `shape` whose first copy of the matrices is `originals` (per matrix, its
    /// arrays), the input `x` (f32 `[k]`), for a normed shape the norm's weight (f32 `[k]`) and
    /// epsilon (f32 `[1]`), and for a shape with residuals one per matrix (f32 `[rows]`, else
    /// none); the other copies of the matrices are copied from the first on the device.
    pub fn new(
        device: &'d Device,
        shape: &LaunchShape,
        originals: Vec<Vec<DeviceBuffer<'d>>>,
        x: DeviceBuffer<'d>,
        norm: Option<(DeviceBuffer<'d>, DeviceBuffer<'d>)>,
        residuals: Vec<DeviceBuffer<'d>>,
    ) -> Result<Bench<'d>, CudaError> {
        let matrices = shape.matrices.len();
        let wanted_residuals = if shape.residual { matrices } else { 0 };
        if originals.len() != matrices || norm.is_some() != shape.normed || residuals.len() != wanted_residuals {
            return Err(CudaError(format!(
                "a bench of {shape:?} given {} matrices, {} residuals and {} norm",
                originals.len(),
                residuals.len(),
                if norm.is_some() { "a" } else { "no" }
            )));
        }
        let ys = shape.matrices.iter().map(|rows| device.zeroed(rows * 4)).collect::<Result<Vec<_>, _>>()?;
        let mut buffers = Vec::new();
        let mut copies = Vec::new();
        for copy in 0..ROTATION_BYTES.div_ceil(shape.weight_bytes().max(1)) {
            let mut matrices = Vec::new();
            for (j, ((originals, rows), y)) in originals.iter().zip(&shape.matrices).zip(&ys).enumerate() {
                let mut arrays = Vec::new();
                for original in originals {
                    if copy == 0 {
                        arrays.push(original.ptr as *mut c_void);
                        continue;
                    }
                    let buffer = device.alloc(original.len)?;
                    device.copy(&buffer, original)?;
                    arrays.push(buffer.ptr as *mut c_void);
                    buffers.push(buffer);
                }
                let residual = residuals.get(j).map(|r| r.ptr as *mut c_void);
                matrices.push(Matrix { arrays, y: y.ptr as *mut c_void, residual, rows: *rows });
            }
            copies.push(matrices);
        }
        buffers.extend(originals.into_iter().flatten().chain(residuals));
        Ok(Bench { device, shape: shape.clone(), x, norm, ys, copies, _buffers: buffers })
    }

    /// A bench of `shape` over zeroed weights and input (a product's time does not depend on the
    /// values).
    pub fn zeroed(device: &'d Device, shape: &LaunchShape) -> Result<Bench<'d>, CudaError> {
        let originals = shape
            .matrices
            .iter()
            .map(|rows| shape.kernel.array_bytes(*rows, shape.k).into_iter().map(|len| device.zeroed(len)).collect())
            .collect::<Result<Vec<_>, _>>()?;
        let x = device.zeroed(shape.k * 4)?;
        let norm = if shape.normed { Some((device.zeroed(shape.k * 4)?, device.zeroed(4)?)) } else { None };
        let residuals = if shape.residual {
            shape.matrices.iter().map(|rows| device.zeroed(rows * 4)).collect::<Result<Vec<_>, _>>()?
        } else {
            Vec::new()
        };
        Bench::new(device, shape, originals, x, norm, residuals)
    }

    /// The launch of copy `copy` of the matrices.
    pub fn launch(&self, copy: usize) -> Launch<'_> {
        Launch {
            kernel: self.shape.kernel,
            x: self.x.ptr as *mut c_void,
            norm: self.norm.as_ref().map(|(g, eps)| Norm { weight: g.ptr as *mut c_void, eps: eps.ptr as *mut c_void }),
            matrices: &self.copies[copy],
            k: self.shape.k,
        }
    }

    /// The outputs (f32 `[rows]` per matrix), as the last launch left them.
    pub fn outputs(&self) -> &[DeviceBuffer<'d>] {
        &self.ys
    }

    /// The shape.
    pub fn shape(&self) -> &LaunchShape {
        &self.shape
    }

    /// Launches copy `copy` in `tiling` on the device's stream, uncaptured.
    pub fn launch_once(&self, copy: usize, tiling: Tiling) -> Result<(), CudaError> {
        // SAFETY: device arrays of the sizes the launch reads and writes, owned by the bench,
        // which outlives the stream's work (dropping a buffer frees it after the device's work).
        unsafe { self.device.driver().launch(self.device.stream(), &self.launch(copy), tiling) }
    }

    /// The device time of one launch in `tiling`, in microseconds: launches cycling through the
    /// copies, captured into a CUDA graph as XLA's command buffers capture them, the graph run
    /// once to warm up and then timed `REPEATS` times, the shortest counting.
    pub fn time(&self, tiling: Tiling) -> Result<f64, CudaError> {
        let copies = self.copies.len();
        let launches = LAUNCHES.max(copies);
        let graph = self.device.capture(|| (0..launches).try_for_each(|i| self.launch_once(i % copies, tiling)))?;
        graph.launch()?;
        let mut best = f64::MAX;
        for _ in 0..REPEATS {
            best = best.min(self.device.time(|| graph.launch())? as f64);
        }
        Ok(best * 1000.0 / launches as f64)
    }
}

/// Per shape, its launches per step and its times by tiling (in [`Tiling::ALL`]'s order).
pub type Timings = Vec<(LaunchShape, usize, Vec<f64>)>;

/// Times every tiling of each of `shapes` (with its launches per step) on `device`.
pub fn time_shapes(device: &Device, shapes: &[(LaunchShape, usize)]) -> Result<Timings, CudaError> {
    let mut timings = Vec::new();
    for (n, (shape, count)) in shapes.iter().enumerate() {
        let bench = Bench::zeroed(device, shape)?;
        if n == 0 {
            // The module is loaded into the context by a launch outside any capture: the timed
            // graphs then capture launches only, and XLA's first captured step, in the same
            // context, finds the kernels loaded.
            bench.launch_once(0, Tiling::DEFAULT)?;
            device.synchronize()?;
        }
        let us = Tiling::ALL.iter().map(|tiling| bench.time(*tiling)).collect::<Result<Vec<_>, _>>()?;
        timings.push((shape.clone(), *count, us));
    }
    Ok(timings)
}

/// The tilings that make a step of `timings` shortest: for each launch key (format, rows in all,
/// `k`) the tiling whose time summed over the key's shapes, each by its launches per step, is
/// least, set for that key alone (formats keep their default tiling for launches of other
/// shapes).
pub fn choose(timings: &Timings) -> Tilings {
    let mut tilings = Tilings::default();
    let mut keys: Vec<(Kernel, usize, usize)> = timings.iter().map(|(s, _, _)| (s.kernel, s.rows(), s.k)).collect();
    keys.sort();
    keys.dedup();
    for key in keys {
        let mut total = vec![0f64; Tiling::ALL.len()];
        for (shape, count, us) in timings.iter().filter(|(s, _, _)| (s.kernel, s.rows(), s.k) == key) {
            debug_assert_eq!(us.len(), Tiling::ALL.len(), "{shape:?}: a time per tiling");
            for (sum, us) in total.iter_mut().zip(us) {
                *sum += *count as f64 * us;
            }
        }
        tilings.set(key.0, key.1, key.2, Tiling::ALL[fastest(&total)]);
    }
    tilings
}

/// The index of the shortest of `us`.
pub fn fastest(us: &[f64]) -> usize {
    (0..us.len()).min_by(|&a, &b| us[a].total_cmp(&us[b])).expect("times of every tiling")
}

/// The tilings [`choose`] picks for `shapes` from times measured on `device`.
pub fn tune(device: &Device, shapes: &[(LaunchShape, usize)]) -> Result<Tilings, CudaError> {
    Ok(choose(&time_shapes(device, shapes)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(kernel: Kernel, matrices: &[usize], k: usize, normed: bool) -> LaunchShape {
        LaunchShape { kernel, matrices: matrices.to_vec(), k, normed, residual: false }
    }

    /// Times by tiling: `base` everywhere but `fast` at the tiling `at`.
    fn times(base: f64, at: Tiling, fast: f64) -> Vec<f64> {
        Tiling::ALL.iter().map(|t| if *t == at { fast } else { base }).collect()
    }

    #[test]
    fn weights_per_format() {
        let int4 = shape(Kernel::Int4, &[64, 32], 128, true);
        assert_eq!(int4.rows(), 96);
        // Per matrix: packed nibbles, then an f16 scale and bias per group of 32.
        assert_eq!(Kernel::Int4.array_bytes(64, 128), vec![64 * 64, 64 * 4 * 2, 64 * 4 * 2]);
        assert_eq!(int4.weight_bytes(), 96 * 64 + 2 * 96 * 4 * 2);
        assert_eq!(shape(Kernel::Int8, &[8], 64, false).weight_bytes(), 8 * 64 + 8 * 2 * 2);
        assert_eq!(shape(Kernel::F16, &[8], 64, false).weight_bytes(), 8 * 64 * 2);
    }

    #[test]
    fn each_launch_shape_takes_its_fastest_tiling() {
        let (r1t64, r8t128, r2t256) = ("r1t64".parse().unwrap(), "r8t128".parse().unwrap(), "r2t256".parse().unwrap());
        let qkv = shape(Kernel::F16, &[2048, 512, 512], 2048, true);
        let down = shape(Kernel::F16, &[2048], 8192, false);
        let head = shape(Kernel::Int8, &[128256], 2048, true);
        let timings: Timings = vec![
            (qkv.clone(), 16, times(10.0, r8t128, 6.0)),
            (down.clone(), 16, times(10.0, r1t64, 9.0)),
            (head.clone(), 1, times(300.0, r2t256, 250.0)),
        ];
        let tilings = choose(&timings);
        assert_eq!(tilings.of_launch(Kernel::F16, 3072, 2048), r8t128);
        assert_eq!(tilings.of_launch(Kernel::F16, 2048, 8192), r1t64);
        assert_eq!(tilings.of_launch(Kernel::Int8, 128256, 2048), r2t256);
        // Only the shapes tuned are set: other launches keep the default.
        assert_eq!(tilings.of_launch(Kernel::F16, 2048, 2048), Tiling::DEFAULT);
        assert_eq!(tilings.of(Kernel::Int4), Tiling::DEFAULT);
        assert_eq!(tilings.shapes().len(), 3);
        // What a cache stores and reads back.
        assert_eq!(Tilings::parse(&tilings.to_string()).unwrap(), tilings);
    }

    #[test]
    fn shapes_sharing_a_key_are_weighed_by_their_launches() {
        let (r1t64, r8t128) = ("r1t64".parse().unwrap(), "r8t128".parse().unwrap());
        // Two launches over 3072 rows of 2048 inputs, which the handlers cannot tell apart: one
        // three-matrix launch 16 times a step, one single matrix once.
        let grouped = shape(Kernel::F16, &[2048, 512, 512], 2048, true);
        let single = shape(Kernel::F16, &[3072], 2048, false);
        let timings: Timings =
            vec![(grouped.clone(), 16, times(10.0, r8t128, 9.0)), (single.clone(), 1, times(10.0, r1t64, 1.0))];
        // r8t128: 16 * 9 + 10 = 154 against r1t64's 16 * 10 + 1 = 161.
        assert_eq!(choose(&timings).of_launch(Kernel::F16, 3072, 2048), r8t128);
        let timings: Timings = vec![(grouped, 1, times(10.0, r8t128, 9.0)), (single, 16, times(10.0, r1t64, 1.0))];
        assert_eq!(choose(&timings).of_launch(Kernel::F16, 3072, 2048), r1t64);
    }
}
