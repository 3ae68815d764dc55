//! Checks and times seam's CUDA kernels on GPU 0 outside XLA: each format's product on the
//! matrix shapes of Llama-3.2-1B (attention, MLP, the LM head), in every tiling the kernels are
//! compiled for, launched through the same [`Driver::launch`] the XLA custom calls use and
//! captured into a CUDA graph as XLA's command buffers capture them. Each result is compared with
//! the format's definition computed here in f64, and each launch's device time turned into the
//! bytes of weights read per second. The weights are read from the GPU's memory, not its L2
//! cache: the launches cycle through enough copies of the matrix to overflow any L2, as a decode
//! step, which reads every matrix once, does.
//!
//! Prints a table per format (microseconds per product by tiling), the time of a 1B decode step's
//! products by tiling, and the tilings that make it shortest as a `SEAM_CUDA_TILINGS` setting
//! (written to the file `--tilings-out` names, for `gpu-bundle/run.sh` to try in XLA's step).
//! Exits 1 if a result is wrong (or no GPU is there).

use cuda_kernels::device::Device;
use cuda_kernels::{Driver, Kernel, Tiling, Tilings, GROUP};
use half::f16;
use std::ffi::c_void;
use std::process::ExitCode;

/// (what, rows, inputs, products of the shape in a decode step): the 1B shape's products, 16
/// layers of them and the LM head.
const SHAPES: [(&str, usize, usize, usize); 5] = [
    ("q, o", 2048, 2048, 32),
    ("k, v", 512, 2048, 32),
    ("gate, up", 8192, 2048, 32),
    ("down", 2048, 8192, 16),
    ("lm head", 128256, 2048, 1),
];
/// Launches per timed graph, at least.
const LAUNCHES: usize = 50;
/// Bytes of weight copies the launches cycle through: more than any GPU's L2 cache.
const ROTATION_BYTES: usize = 256 << 20;

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
    let mut args = std::env::args().skip(1);
    let tilings_out = match (args.next().as_deref(), args.next()) {
        (None, _) => None,
        (Some("--tilings-out"), Some(path)) => Some(path),
        _ => {
            eprintln!("usage: cuda-kernels-probe [--tilings-out FILE]");
            return ExitCode::from(2);
        }
    };
    match run(tilings_out) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Each row of a product by the format's definition, and the sum of its terms' magnitudes (the
/// scale its error is measured against).
fn definition(case: &Case, x: &[f32], rows: usize) -> Vec<(usize, f64, f64)> {
    // The LM head's every 7th row: every position in a block, in a few seconds.
    let step = if rows > 8192 { 7 } else { 1 };
    (0..rows)
        .step_by(step)
        .map(|r| {
            let (mut want, mut magnitude) = (0f64, 0f64);
            for (i, &xi) in x.iter().enumerate() {
                let term = (case.weight)(r, i) * xi as f64;
                want += term;
                magnitude += term.abs();
            }
            (r, want, magnitude)
        })
        .collect()
}

fn run(tilings_out: Option<String>) -> Result<bool, String> {
    let err = |e: cuda_kernels::CudaError| e.to_string();
    let device = Device::open().map_err(err)?;
    let driver = Driver::get().map_err(err)?;
    println!(
        "seam CUDA kernels on {}: microseconds per product, each a launch in a CUDA graph of at least {LAUNCHES}, \
         cycling through {} MiB of weight copies; tilings r<rows per block>t<threads per block>",
        device.name(),
        ROTATION_BYTES >> 20
    );
    let mut rng = Rng(0x2545f4914f6cdd1d);
    let mut all_right = true;
    let mut fastest = Tilings::default();
    let mut first_capture = true;
    for kernel in Kernel::ALL {
        let names: Vec<String> = Tiling::ALL.iter().map(|t| format!("{t:>7}")).collect();
        println!(
            "\n{:<9} {:>7} {:>6} {:>7} {}  fastest   GB/s  result",
            kernel.format(),
            "rows",
            "k",
            "MB",
            names.join("")
        );
        let mut step_us = [0f64; Tiling::ALL.len()];
        for (what, rows, k, per_step) in SHAPES {
            let case = case(kernel, rows, k, &mut rng);
            let x: Vec<f32> = (0..k).map(|_| rng.unit()).collect();
            let x_bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
            let want = definition(&case, &x, rows);
            let weight_bytes: usize = case.arrays.iter().map(Vec::len).sum();
            let copies = ROTATION_BYTES.div_ceil(weight_bytes);
            let launches = LAUNCHES.max(copies);
            let x_dev = device.upload(&x_bytes).map_err(err)?;
            let y_dev = device.alloc(rows * 4).map_err(err)?;
            let mut copy_pointers = Vec::new();
            let mut buffers = Vec::new();
            for _ in 0..copies {
                let arrays =
                    case.arrays.iter().map(|a| device.upload(a)).collect::<Result<Vec<_>, _>>().map_err(err)?;
                let mut pointers: Vec<*mut c_void> = vec![x_dev.ptr as *mut c_void];
                pointers.extend(arrays.iter().map(|a| a.ptr as *mut c_void));
                pointers.push(y_dev.ptr as *mut c_void);
                copy_pointers.push(pointers);
                buffers.push(arrays);
            }
            let mut us = Vec::new();
            let mut wrong = Vec::new();
            for (t, tiling) in Tiling::ALL.into_iter().enumerate() {
                // The first capture also loads the module (the driver compiling the PTX) inside
                // it, as the first custom call of a captured XLA step does.
                let started = std::time::Instant::now();
                let capture = || {
                    device.capture(|| {
                        (0..launches).try_for_each(|i| {
                            // SAFETY: device arrays of the sizes the kernel reads for `rows` and
                            // `k`, alive until the stream is synchronized (the download below).
                            unsafe {
                                driver.launch(device.stream(), kernel, tiling, &copy_pointers[i % copies], rows, k)
                            }
                        })
                    })
                };
                let graph = match capture() {
                    Ok(graph) => graph,
                    Err(e) if first_capture => {
                        // What XLA's first captured step would meet: reported, then the module is
                        // loaded outside a capture so that the kernels are still measured.
                        println!("WRONG: loading the module inside a capture failed ({e}); loading it outside one");
                        all_right = false;
                        // SAFETY: as in the capture above.
                        unsafe { driver.launch(device.stream(), kernel, tiling, &copy_pointers[0], rows, k) }
                            .map_err(err)?;
                        device.synchronize().map_err(err)?;
                        capture().map_err(err)?
                    }
                    Err(e) => return Err(format!("{} captured into a graph: {e}", kernel.entry(tiling))),
                };
                if first_capture {
                    println!(
                        "(the first capture, loading the module, took {:.0} ms)",
                        started.elapsed().as_secs_f64() * 1e3
                    );
                    first_capture = false;
                }
                graph.launch().map_err(err)?;
                let ms = device.time(|| graph.launch()).map_err(err)?;
                let y: Vec<f32> = device
                    .download(&y_dev)
                    .map_err(err)?
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                let worst = want
                    .iter()
                    .map(|&(r, want, magnitude)| (y[r] as f64 - want).abs() / magnitude.max(f64::MIN_POSITIVE))
                    .fold(0f64, f64::max);
                // f32 sums of up to 8192 terms: far under this; a wrong index or nibble is far over.
                if worst.is_nan() || worst >= 1e-4 {
                    wrong.push(format!("{tiling} (worst error {worst:.1e} of a row's magnitude)"));
                }
                us.push(ms as f64 * 1000.0 / launches as f64);
                step_us[t] += per_step as f64 * us[t];
            }
            drop(buffers);
            all_right &= wrong.is_empty();
            let best = (0..us.len()).min_by(|&a, &b| us[a].total_cmp(&us[b])).expect("tilings");
            let cells: Vec<String> = us.iter().map(|u| format!("{u:>7.1}")).collect();
            println!(
                "{:<9} {:>7} {:>6} {:>7.1} {}  {:>7} {:>6.0}  {}",
                what,
                rows,
                k,
                weight_bytes as f64 / 1e6,
                cells.join(""),
                Tiling::ALL[best].to_string(),
                weight_bytes as f64 / (us[best] * 1e3),
                if wrong.is_empty() { "ok".to_string() } else { format!("WRONG: {}", wrong.join(", ")) }
            );
        }
        let cells: Vec<String> = step_us.iter().map(|u| format!("{u:>7.0}")).collect();
        let best = (0..step_us.len()).min_by(|&a, &b| step_us[a].total_cmp(&step_us[b])).expect("tilings");
        println!(
            "{:<9} {:>7} {:>6} {:>7} {}  {:>7}",
            "1B step",
            "",
            "",
            "",
            cells.join(""),
            Tiling::ALL[best].to_string()
        );
        let default_us =
            step_us[Tiling::ALL.iter().position(|t| *t == Tiling::DEFAULT).expect("the default is compiled")];
        println!(
            "{}: a 1B decode step's products take {:.0} us with {} ({:.2}x the default {}'s {:.0} us)",
            kernel.format(),
            step_us[best],
            Tiling::ALL[best],
            default_us / step_us[best],
            Tiling::DEFAULT,
            default_us
        );
        fastest = Tilings::parse(&format!("{fastest},{}={}", kernel.format(), Tiling::ALL[best]))?;
    }
    println!("\nfastest tilings for a 1B decode step: {}={fastest}", Tilings::VARIABLE);
    if let Some(path) = tilings_out {
        std::fs::write(&path, format!("{fastest}\n")).map_err(|e| format!("writing {path}: {e}"))?;
    }
    Ok(all_right)
}
