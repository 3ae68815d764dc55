//! Checks and times seam's CUDA kernels on GPU 0 outside XLA: each format's product on the
//! matrix shapes of Llama-3.2-1B (attention, MLP, the LM head), launched through the same
//! [`Driver::launch`] the XLA custom calls use, its result compared with the format's definition
//! computed here in f64 for every row, and its device time over repeated launches turned into the
//! bytes of weights read per second. Prints one line per case; exits 1 if a result is wrong (or
//! no GPU is there). `gpu-bundle/run.sh` runs it first: what the kernels reach on their own,
//! apart from what XLA's step around them costs.

use cuda_kernels::device::Device;
use cuda_kernels::{Driver, Kernel, GROUP};
use half::f16;
use std::ffi::c_void;
use std::process::ExitCode;

/// (what, rows, inputs): the 1B shape's products.
const SHAPES: [(&str, usize, usize); 5] = [
    ("q, o", 2048, 2048),
    ("k, v", 512, 2048),
    ("gate, up", 8192, 2048),
    ("down", 2048, 8192),
    ("lm head", 128256, 2048),
];
const LAUNCHES: usize = 50;

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
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<bool, String> {
    let device = Device::open().map_err(|e| e.to_string())?;
    let driver = Driver::get().map_err(|e| e.to_string())?;
    println!("seam CUDA kernels on {}: {LAUNCHES} launches per case after 3 warm-up ones", device.name());
    println!(
        "{:<9} {:<8} {:>7} {:>6} {:>10} {:>9} {:>10}  result",
        "format", "matrix", "rows", "k", "weights MB", "us", "GB/s"
    );
    let mut rng = Rng(0x2545f4914f6cdd1d);
    let mut all_right = true;
    for kernel in Kernel::ALL {
        for (what, rows, k) in SHAPES {
            let case = case(kernel, rows, k, &mut rng);
            let x: Vec<f32> = (0..k).map(|_| rng.unit()).collect();
            let x_bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
            let err = |e: cuda_kernels::CudaError| e.to_string();
            let x_dev = device.upload(&x_bytes).map_err(err)?;
            let arrays = case.arrays.iter().map(|a| device.upload(a)).collect::<Result<Vec<_>, _>>().map_err(err)?;
            let y_dev = device.alloc(rows * 4).map_err(err)?;
            let mut pointers: Vec<*mut c_void> = vec![x_dev.ptr as *mut c_void];
            pointers.extend(arrays.iter().map(|a| a.ptr as *mut c_void));
            pointers.push(y_dev.ptr as *mut c_void);
            // SAFETY: device arrays of the sizes the kernel reads for `rows` and `k`, alive until
            // the stream is synchronized below.
            let launch = || unsafe { driver.launch(device.stream(), kernel, &pointers, rows, k) };
            for _ in 0..3 {
                launch().map_err(err)?;
            }
            let ms = device.time(|| (0..LAUNCHES).try_for_each(|_| launch())).map_err(err)?;
            let y: Vec<f32> = device
                .download(&y_dev)
                .map_err(err)?
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            // Each row against the definition, relative to the sum of its terms' magnitudes (the
            // LM head's every 7th row: every position in a block, in a few seconds).
            let mut worst = 0f64;
            let step = if rows > 8192 { 7 } else { 1 };
            for (r, &got) in y.iter().enumerate().step_by(step) {
                let (mut want, mut magnitude) = (0f64, 0f64);
                for (i, &xi) in x.iter().enumerate() {
                    let term = (case.weight)(r, i) * xi as f64;
                    want += term;
                    magnitude += term.abs();
                }
                worst = worst.max((got as f64 - want).abs() / magnitude.max(f64::MIN_POSITIVE));
            }
            // f32 sums of up to 8192 terms: far under this; a wrong index or nibble is far over.
            let right = worst < 1e-4;
            all_right &= right;
            let weight_bytes: usize = case.arrays.iter().map(Vec::len).sum();
            let us = ms as f64 * 1000.0 / LAUNCHES as f64;
            println!(
                "{:<9} {:<8} {:>7} {:>6} {:>10.1} {:>9.1} {:>10.0}  {} (worst error {:.1e} of a row's magnitude)",
                format!("{kernel:?}").to_lowercase(),
                what,
                rows,
                k,
                weight_bytes as f64 / 1e6,
                us,
                weight_bytes as f64 / (us * 1e3),
                if right { "ok" } else { "WRONG" },
                worst
            );
        }
    }
    Ok(all_right)
}
