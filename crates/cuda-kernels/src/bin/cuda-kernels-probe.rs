//! Checks and times seam's CUDA kernels on GPU 0 outside XLA: each format's launches on the
//! matrix shapes of Llama-3.2-1B (attention, MLP, the LM head; one matrix at a time, a layer's
//! q, k and v or gate and up in one launch with their RMSNorm, and o or down added to a
//! residual), in every tiling the kernels
//! are compiled for, launched through the same `Driver::launch` the XLA custom calls use and
//! captured into a CUDA graph as XLA's command buffers capture them (the tuner's timing,
//! [`cuda_kernels::tune::Bench`]). Each result is compared with
//! the format's definition computed here in f64, and each launch's device time turned into the
//! bytes of weights read per second. The weights are read from the GPU's memory, not its L2
//! cache: the launches cycle through enough copies of the matrices to overflow any L2, as a
//! decode step, which reads every matrix once, does.
//!
//! Prints the device's memory bandwidth by a device-to-device copy (each launch's best rate is
//! given as a share of it), a table per format (microseconds per launch by tiling), the time of a 1B decode step's
//! products by tiling (one launch per product, and launches grouped as `vector_products=
//! cuda-kernels` groups them), and the tilings the tuner picks for the grouped step, as a
//! `SEAM_CUDA_TILINGS` setting. Exits 1 if a result is wrong (or no GPU is there).

use cuda_kernels::device::Device;
use cuda_kernels::tune::{self, Bench, LaunchShape, Timings, LAUNCHES, ROTATION_BYTES};
use cuda_kernels::{Kernel, Tiling, Tilings, GROUP};
use half::f16;
use std::process::ExitCode;

/// A kind of launch on the 1B shape: the rows of its matrices, their inputs, whether the input is
/// normalized in the launch and the outputs added to residuals, and how many of it a decode step
/// makes with one launch per product and with the grouped launches (16 layers and the LM head).
struct Row {
    what: &'static str,
    matrices: &'static [usize],
    k: usize,
    normed: bool,
    residual: bool,
    each: usize,
    grouped: usize,
}

const ROWS: [Row; 9] = [
    Row { what: "q, o", matrices: &[2048], k: 2048, normed: false, residual: false, each: 32, grouped: 0 },
    Row { what: "k, v", matrices: &[512], k: 2048, normed: false, residual: false, each: 32, grouped: 0 },
    Row { what: "gate, up", matrices: &[8192], k: 2048, normed: false, residual: false, each: 32, grouped: 0 },
    Row { what: "down", matrices: &[2048], k: 8192, normed: false, residual: false, each: 16, grouped: 0 },
    // (The grouped step's LM head is normalized in its launch; the norm's loads are the
    // activations', so it is counted at the plain head's time.)
    Row { what: "lm head", matrices: &[128256], k: 2048, normed: false, residual: false, each: 1, grouped: 1 },
    Row { what: "qkv+norm", matrices: &[2048, 512, 512], k: 2048, normed: true, residual: false, each: 0, grouped: 16 },
    Row { what: "o+residual", matrices: &[2048], k: 2048, normed: false, residual: true, each: 0, grouped: 16 },
    Row { what: "gate,up+norm", matrices: &[8192, 8192], k: 2048, normed: true, residual: false, each: 0, grouped: 16 },
    Row { what: "down+residual", matrices: &[2048], k: 8192, normed: false, residual: true, each: 0, grouped: 16 },
];

/// The norms' epsilon.
const EPS: f32 = 1e-5;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 16) as u32
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() % 65536) as f32 / 32768.0 - 1.0
    }
    fn halves(&mut self, n: usize, scale: f32) -> Vec<f16> {
        (0..n).map(|_| f16::from_f32(self.unit() * scale)).collect()
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// A product's operands on the host, and each row's weight `i` by the format's definition.
struct Case {
    arrays: Vec<Vec<u8>>,
    weight: Box<dyn Fn(usize, usize) -> f64>,
}

fn case(kernel: Kernel, rows: usize, k: usize, rng: &mut Rng) -> Case {
    let groups = k / GROUP;
    let half_bytes = |v: &[f16]| v.iter().flat_map(|h| h.to_le_bytes()).collect::<Vec<u8>>();
    match kernel {
        Kernel::F16 => {
            let w = rng.halves(rows * k, 0.1);
            Case { arrays: vec![half_bytes(&w)], weight: Box::new(move |r, i| w[r * k + i].to_f64()) }
        }
        Kernel::Int8 => {
            let q = rng.bytes(rows * k);
            let s = rng.halves(rows * groups, 0.01);
            let arrays = vec![q.clone(), half_bytes(&s)];
            Case {
                arrays,
                weight: Box::new(move |r, i| s[r * groups + i / GROUP].to_f64() * (q[r * k + i] as i8) as f64),
            }
        }
        Kernel::Int4 => {
            let packed = rng.bytes(rows * k / 2);
            let (s, b) = (rng.halves(rows * groups, 0.01), rng.halves(rows * groups, 0.05));
            let arrays = vec![packed.clone(), half_bytes(&s), half_bytes(&b)];
            Case {
                arrays,
                weight: Box::new(move |r, i| {
                    let byte = packed[(r * k + i) / 2];
                    let q = if i % 2 == 0 { byte & 15 } else { byte >> 4 };
                    let g = r * groups + i / GROUP;
                    s[g].to_f64() * q as f64 + b[g].to_f64()
                }),
            }
        }
    }
}

fn main() -> ExitCode {
    if std::env::args().len() > 1 {
        eprintln!("usage: cuda-kernels-probe");
        return ExitCode::from(2);
    }
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn err(e: cuda_kernels::CudaError) -> String {
    e.to_string()
}

fn as_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// One row's launch on the device (a [`Bench`] of its shape over the row's random operands), and
/// what each output row should be.
struct OnDevice<'d> {
    bench: Bench<'d>,
    /// Per matrix: (row, definition, sum of the terms' magnitudes) of the rows checked.
    want: Vec<Vec<(usize, f64, f64)>>,
}

fn shape(kernel: Kernel, row: &Row) -> LaunchShape {
    LaunchShape { kernel, matrices: row.matrices.to_vec(), k: row.k, normed: row.normed, residual: row.residual }
}

fn prepare<'d>(device: &'d Device, kernel: Kernel, row: &Row, rng: &mut Rng) -> Result<OnDevice<'d>, String> {
    let k = row.k;
    let x: Vec<f32> = (0..k).map(|_| rng.unit()).collect();
    let g: Vec<f32> = (0..k).map(|_| rng.unit()).collect();
    // The input the products are defined over: x, or x normalized.
    let input: Vec<f64> = if row.normed {
        let mean = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / k as f64;
        let scale = 1.0 / (mean + EPS as f64).sqrt();
        x.iter().zip(&g).map(|(x, g)| *x as f64 * scale * *g as f64).collect()
    } else {
        x.iter().map(|v| *v as f64).collect()
    };
    let cases: Vec<Case> = row.matrices.iter().map(|rows| case(kernel, *rows, k, rng)).collect();
    // Of about the products' size (sums of k terms of about 0.1 or less).
    let residuals: Vec<Vec<f32>> = if row.residual {
        row.matrices.iter().map(|rows| (0..*rows).map(|_| rng.unit()).collect()).collect()
    } else {
        Vec::new()
    };
    let want = cases
        .iter()
        .zip(row.matrices)
        .enumerate()
        .map(|(j, (case, &rows))| {
            // The LM head's every 7th row: every position in a block, in a few seconds.
            let step = if rows > 8192 { 7 } else { 1 };
            (0..rows)
                .step_by(step)
                .map(|r| {
                    let added = residuals.get(j).map_or(0.0, |residual| residual[r] as f64);
                    let (mut sum, mut magnitude) = (added, added.abs());
                    for (i, xi) in input.iter().enumerate() {
                        let term = (case.weight)(r, i) * xi;
                        sum += term;
                        magnitude += term.abs();
                    }
                    (r, sum, magnitude)
                })
                .collect()
        })
        .collect();
    let x = device.upload(&as_bytes(&x)).map_err(err)?;
    let norm = if row.normed {
        Some((device.upload(&as_bytes(&g)).map_err(err)?, device.upload(&as_bytes(&[EPS])).map_err(err)?))
    } else {
        None
    };
    let originals = cases
        .iter()
        .map(|case| case.arrays.iter().map(|a| device.upload(a)).collect::<Result<Vec<_>, _>>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(err)?;
    let residuals =
        residuals.iter().map(|r| device.upload(&as_bytes(r))).collect::<Result<Vec<_>, _>>().map_err(err)?;
    let bench = Bench::new(device, &shape(kernel, row), originals, x, norm, residuals).map_err(err)?;
    Ok(OnDevice { bench, want })
}

impl OnDevice<'_> {
    /// The worst error of the outputs, relative to each row's magnitude.
    fn worst_error(&self, device: &Device) -> Result<f64, String> {
        let mut worst = 0f64;
        for (y, want) in self.bench.outputs().iter().zip(&self.want) {
            let got: Vec<f32> = device
                .download(y)
                .map_err(err)?
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            for &(r, sum, magnitude) in want {
                let error = (got[r] as f64 - sum).abs() / magnitude.max(f64::MIN_POSITIVE);
                worst = if error.is_nan() { f64::INFINITY } else { worst.max(error) };
            }
        }
        Ok(worst)
    }
}

/// Bytes the bandwidth probe copies.
const COPY_BYTES: usize = 1 << 30;

/// The device's memory bandwidth by a device-to-device copy (the best of 5): bytes read and
/// written per second, in GB/s, what the kernels' rates are a fraction of.
fn copy_bandwidth(device: &Device) -> Result<f64, String> {
    let (from, to) = (device.alloc(COPY_BYTES).map_err(err)?, device.alloc(COPY_BYTES).map_err(err)?);
    device.copy(&to, &from).map_err(err)?;
    let mut best = f64::MAX;
    for _ in 0..5 {
        best = best.min(device.time(|| device.copy(&to, &from)).map_err(err)? as f64);
    }
    Ok(2.0 * COPY_BYTES as f64 / (best * 1e6))
}

/// Whether the module loads inside a capture (global mode), as where the first custom call of a
/// captured XLA step is the kernels' first launch in its context. When it does not, that is
/// reported and the module is loaded outside a capture, so that the kernels are still measured.
fn loads_in_capture(device: &Device, bench: &Bench) -> Result<bool, String> {
    let started = std::time::Instant::now();
    match device.capture(|| bench.launch_once(0, Tiling::DEFAULT)) {
        Ok(_graph) => {
            println!("(the first capture, loading the module, took {:.0} ms)", started.elapsed().as_secs_f64() * 1e3);
            Ok(true)
        }
        Err(e) => {
            println!("WRONG: loading the module inside a capture failed ({e}); loading it outside one");
            bench.launch_once(0, Tiling::DEFAULT).map_err(err)?;
            device.synchronize().map_err(err)?;
            Ok(false)
        }
    }
}

fn run() -> Result<bool, String> {
    let device = Device::open().map_err(err)?;
    println!(
        "seam CUDA kernels on {}: microseconds per launch, each in a CUDA graph of at least {LAUNCHES}, \
         cycling through {} MiB of weight copies; tilings r<rows per block>t<threads per block>",
        device.name(),
        ROTATION_BYTES >> 20
    );
    let bandwidth = copy_bandwidth(&device)?;
    println!(
        "device memory bandwidth: {bandwidth:.0} GB/s (a copy of {} MiB on the device, bytes read and written)",
        COPY_BYTES >> 20
    );
    let mut rng = Rng(0x2545f4914f6cdd1d);
    let mut all_right = true;
    let mut module_checked = false;
    let mut picked = Tilings::default();
    for kernel in Kernel::ALL {
        let names: Vec<String> = Tiling::ALL.iter().map(|t| format!("{t:>7}")).collect();
        println!("\n{:<13} {:>6} {:>7} {}  fastest   GB/s   %bw  result", kernel.format(), "k", "MB", names.join(""));
        let (mut each_us, mut grouped_us) = ([0f64; Tiling::ALL.len()], [0f64; Tiling::ALL.len()]);
        // The grouped step's launches, with their times, as the tuner takes them.
        let mut grouped: Timings = Vec::new();
        for row in &ROWS {
            let on_device = prepare(&device, kernel, row, &mut rng)?;
            if !module_checked {
                all_right &= loads_in_capture(&device, &on_device.bench)?;
                module_checked = true;
            }
            let mut us = Vec::new();
            let mut wrong = Vec::new();
            for (t, tiling) in Tiling::ALL.into_iter().enumerate() {
                us.push(on_device.bench.time(tiling).map_err(err)?);
                let worst = on_device.worst_error(&device)?;
                // f32 sums of up to 8192 terms: far under this; a wrong index or nibble is far over.
                if worst >= 1e-4 {
                    wrong.push(format!("{tiling} (worst error {worst:.1e} of a row's magnitude)"));
                }
                each_us[t] += row.each as f64 * us[t];
                grouped_us[t] += row.grouped as f64 * us[t];
            }
            all_right &= wrong.is_empty();
            if row.grouped > 0 {
                grouped.push((shape(kernel, row), row.grouped, us.clone()));
            }
            let best = tune::fastest(&us);
            let cells: Vec<String> = us.iter().map(|u| format!("{u:>7.1}")).collect();
            let weight_bytes = on_device.bench.shape().weight_bytes();
            let rate = weight_bytes as f64 / (us[best] * 1e3);
            println!(
                "{:<13} {:>6} {:>7.1} {}  {:>7} {:>6.0} {:>4.0}%  {}",
                row.what,
                row.k,
                weight_bytes as f64 / 1e6,
                cells.join(""),
                Tiling::ALL[best].to_string(),
                rate,
                100.0 * rate / bandwidth,
                if wrong.is_empty() { "ok".to_string() } else { format!("WRONG: {}", wrong.join(", ")) }
            );
        }
        let default = Tiling::ALL.iter().position(|t| *t == Tiling::DEFAULT).expect("the default is compiled");
        for (form, step_us) in [("each", &each_us), ("grouped", &grouped_us)] {
            let cells: Vec<String> = step_us.iter().map(|u| format!("{u:>7.0}")).collect();
            let best = tune::fastest(step_us);
            println!(
                "{:<13} {:>6} {:>7} {}  {:>7}",
                format!("1B {form}"),
                "",
                "",
                cells.join(""),
                Tiling::ALL[best].to_string()
            );
            println!(
                "{}: a 1B decode step's products, {form}, take {:.0} us with {} ({:.2}x the default {}'s {:.0} us)",
                kernel.format(),
                step_us[best],
                Tiling::ALL[best],
                step_us[default] / step_us[best],
                Tiling::DEFAULT,
                step_us[default]
            );
        }
        // What the tuner picks for the grouped step: each launch shape's fastest tiling.
        let tuned = tune::choose(&grouped);
        let step: f64 = grouped
            .iter()
            .map(|(shape, count, us)| {
                let tiling = tuned.of_launch(shape.kernel, shape.rows(), shape.k);
                let t = Tiling::ALL.iter().position(|t| *t == tiling).expect("a compiled tiling");
                *count as f64 * us[t]
            })
            .sum();
        println!(
            "{}: in the tilings the tuner picks, the grouped step's products take {step:.0} us ({:.2}x the default's)",
            kernel.format(),
            grouped_us[default] / step
        );
        for ((kernel, rows, k), tiling) in tuned.shapes() {
            picked.set(*kernel, *rows, *k, *tiling);
        }
    }
    println!("\ntilings the tuner picks for a 1B decode step of grouped launches: {}={picked}", Tilings::VARIABLE);
    Ok(all_right)
}
