//! seam's CUDA kernels, for runtimes that hand seam a CUDA stream (XLA's custom calls on
//! pjrt-cuda): decode's one-row products `y = W x` in the three weight formats, reading the
//! stored weights once ([`Kernel`]); up to three matrices over the same input in one launch, the
//! input optionally RMS-normalized on the way, each output optionally added to a residual
//! ([`Launch`]).
//!
//! The kernels are CUDA C (`kernels/products.cu`), compiled ahead to PTX by
//! `scripts/cuda-kernels.sh` and embedded here: neither the build machine nor a GPU machine needs
//! a CUDA compiler, and the NVIDIA driver compiles the PTX for the GPU it finds when a module is
//! first loaded. The driver library (`libcuda.so.1`) is opened at run time ([`Driver`]), so
//! nothing links against CUDA.

pub mod device;
mod driver;
pub mod host;
pub mod tune;

pub use driver::{driver_library, driver_symbol, CudaError, Driver, Stream};

use std::ffi::c_void;

/// The PTX of `kernels/products.cu` (compute capability 8.0 and up), NUL-terminated as the
/// driver's module loader wants it.
pub const PRODUCTS_PTX: &str = concat!(include_str!("../kernels/products.ptx"), "\0");

/// Inputs per quantization group of the int8 and int4 formats.
pub const GROUP: usize = 32;

/// The matrices one launch computes products of, at most.
pub const MAX_MATRICES: usize = 3;

/// One of the products' kernels, by weight format. Each computes `y[r] = sum_i w[r][i] x[i]` for
/// `x` f32 `[k]` and `y` f32 `[rows]`, with `k` a multiple of [`GROUP`] and every array 16-byte
/// aligned (but a [`Norm`]'s epsilon and a [`Matrix`]'s residual, read a float at a time); a
/// matrix's arrays are, in order:
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kernel {
    /// `w f16 [rows, k]`.
    F16,
    /// `q s8 [rows, k], scales f16 [rows, k / 32]`: `w = s q`.
    Int8,
    /// `packed u8 [rows, k / 2], scales f16 [rows, k / 32], biases f16 [rows, k / 32]`:
    /// `w = s q + b`, byte `i` of a group holding input `2i` in its low nibble.
    Int4,
}

impl Kernel {
    /// Every kernel.
    pub const ALL: [Kernel; 3] = [Kernel::F16, Kernel::Int8, Kernel::Int4];

    /// The format's name, as in the entry points and [`Tilings`]' settings.
    pub fn format(self) -> &'static str {
        match self {
            Kernel::F16 => "f16",
            Kernel::Int8 => "int8",
            Kernel::Int4 => "int4",
        }
    }

    /// The kernel's entry point in the PTX for `tiling`.
    pub fn entry(self, tiling: Tiling) -> String {
        format!("seam_rows_{}_{}", self.format(), tiling)
    }

    /// How many arrays a matrix of the format is.
    pub fn weight_arrays(self) -> usize {
        match self {
            Kernel::F16 => 1,
            Kernel::Int8 => 2,
            Kernel::Int4 => 3,
        }
    }

    /// The bytes of each of a matrix's arrays (in the order above), for `rows` rows of `k` inputs.
    pub fn array_bytes(self, rows: usize, k: usize) -> Vec<usize> {
        let groups = rows * k / GROUP;
        match self {
            Kernel::F16 => vec![rows * k * 2],
            Kernel::Int8 => vec![rows * k, groups * 2],
            Kernel::Int4 => vec![rows * k / 2, groups * 2, groups * 2],
        }
    }
}

/// Why a product's shape cannot go to the kernels (checked before every launch: a wrong launch
/// reads out of bounds on the device instead of failing).
pub fn check_shape(rows: usize, k: usize) -> Result<(), String> {
    if rows == 0 || k == 0 || !k.is_multiple_of(GROUP) {
        return Err(format!(
            "a product of {rows} rows of {k} inputs: the kernels take k a non-zero multiple of {GROUP}"
        ));
    }
    if rows > i32::MAX as usize || k > i32::MAX as usize {
        return Err(format!("a product of {rows} rows of {k} inputs is too large for the kernels' 32-bit indices"));
    }
    Ok(())
}

/// One matrix of a [`Launch`]: the device addresses of its arrays (in [`Kernel`]'s order), of its
/// output (f32 `[rows]`) and of a residual (f32 `[rows]`) the output is the sum of with the
/// product, if any; and its rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matrix {
    /// The format's arrays.
    pub arrays: Vec<*mut c_void>,
    /// The output.
    pub y: *mut c_void,
    /// The residual each output row is added to.
    pub residual: Option<*mut c_void>,
    /// Output rows.
    pub rows: usize,
}

/// An RMSNorm a [`Launch`] applies to its input before the products: device addresses of the
/// weight (f32 `[k]`) and of epsilon (f32 `[1]`). Each output row is then
/// `sum_i w[r][i] x[i] g[i] / sqrt(mean(x^2) + eps)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Norm {
    /// The norm's weight.
    pub weight: *mut c_void,
    /// Its epsilon.
    pub eps: *mut c_void,
}

/// One launch of a kernel: the products of up to [`MAX_MATRICES`] matrices of one format over the
/// same input `x` (f32 `[k]`), each into its own output.
#[derive(Debug, Clone)]
pub struct Launch<'a> {
    /// The matrices' format.
    pub kernel: Kernel,
    /// The input.
    pub x: *mut c_void,
    /// A norm to apply to the input first.
    pub norm: Option<Norm>,
    /// The matrices.
    pub matrices: &'a [Matrix],
    /// Inputs per row.
    pub k: usize,
}

/// The kernels' `seam_products` parameter (`kernels/products.cu`), field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProductsParam {
    arrays: [[u64; 3]; MAX_MATRICES],
    y: [u64; MAX_MATRICES],
    residual: [u64; MAX_MATRICES],
    rows: [i32; MAX_MATRICES],
    first_block: [i32; MAX_MATRICES],
    count: i32,
}

impl Launch<'_> {
    /// The kernel's `seam_products` parameter for `tiling`, and the blocks of the launch; why the
    /// launch cannot be made (checked before every launch: a wrong one reads out of bounds on the
    /// device instead of failing).
    pub fn products(&self, tiling: Tiling) -> Result<(ProductsParam, u32), String> {
        let count = self.matrices.len();
        if count == 0 || count > MAX_MATRICES {
            return Err(format!("a launch takes 1 to {MAX_MATRICES} matrices, given {count}"));
        }
        let mut param = ProductsParam {
            arrays: [[0; 3]; MAX_MATRICES],
            y: [0; MAX_MATRICES],
            residual: [0; MAX_MATRICES],
            rows: [0; MAX_MATRICES],
            first_block: [0; MAX_MATRICES],
            count: count as i32,
        };
        let mut blocks = 0usize;
        for (j, matrix) in self.matrices.iter().enumerate() {
            check_shape(matrix.rows, self.k)?;
            if matrix.arrays.len() != self.kernel.weight_arrays() {
                return Err(format!(
                    "a {} matrix is {} arrays, given {}",
                    self.kernel.format(),
                    self.kernel.weight_arrays(),
                    matrix.arrays.len()
                ));
            }
            for (a, array) in matrix.arrays.iter().enumerate() {
                param.arrays[j][a] = *array as u64;
            }
            param.y[j] = matrix.y as u64;
            param.residual[j] = matrix.residual.map_or(0, |r| r as u64);
            param.rows[j] = matrix.rows as i32;
            param.first_block[j] = blocks as i32;
            blocks += tiling.grid(matrix.rows).0 as usize;
        }
        let blocks = i32::try_from(blocks)
            .map_err(|_| format!("a launch of {blocks} blocks is too large for the kernels' 32-bit indices"))?;
        Ok((param, blocks as u32))
    }
}

/// How a kernel splits a product among the GPU's threads: each block of `threads` threads
/// computes `rows` consecutive output rows. More rows per block put more bytes in flight per
/// thread; fewer make more blocks of a small matrix. Every format is compiled for each of
/// [`Tiling::ALL`] (`SEAM_TILINGS` in the source); written `r<rows>t<threads>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tiling {
    /// Output rows per block.
    pub rows: u32,
    /// Threads per block.
    pub threads: u32,
}

impl Tiling {
    /// Every tiling the PTX has entry points for.
    pub const ALL: [Tiling; 12] = {
        let mut all = [Tiling { rows: 0, threads: 0 }; 12];
        let mut i = 0;
        while i < 12 {
            all[i] = Tiling { rows: 1 << (i / 3), threads: 64 << (i % 3) };
            i += 1;
        }
        all
    };

    /// The tiling used when nothing chose another.
    pub const DEFAULT: Tiling = Tiling { rows: 4, threads: 256 };

    /// The launch geometry of a product of `rows` rows: blocks, threads per block.
    pub fn grid(self, rows: usize) -> (u32, u32) {
        (rows.div_ceil(self.rows as usize) as u32, self.threads)
    }
}

impl std::fmt::Display for Tiling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "r{}t{}", self.rows, self.threads)
    }
}

impl std::str::FromStr for Tiling {
    type Err = String;

    fn from_str(text: &str) -> Result<Tiling, String> {
        let known = || Tiling::ALL.iter().map(Tiling::to_string).collect::<Vec<_>>().join(", ");
        Tiling::ALL
            .into_iter()
            .find(|t| t.to_string() == text)
            .ok_or_else(|| format!("unknown tiling {text:?}: the kernels are compiled for {}", known()))
    }
}

/// Which tiling each launch takes: per format, [`Tiling::DEFAULT`] unless a setting names
/// another, and per launch shape where a setting names one. A setting is either one tiling for
/// every format (`r8t128`) or a list of `format=tiling` (`f16=r4t256,int4=r8t64`, formats not
/// named keeping the default) and `format@ROWSxK=tiling` for the launches of that format whose
/// matrices have `ROWS` rows in all and `K` inputs (`int4@3072x2048=r2t128`): the form the tuner's
/// choice is printed and cached in.
///
/// A process's launches take its setting ([`Tilings::VARIABLE`]) where it has one; else the
/// tilings tuned for their shapes on its GPU ([`Tilings::install`], [`crate::tune`]); else
/// [`Tiling::DEFAULT`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tilings {
    by_kernel: [Tiling; 3],
    /// `((format, rows in all, k), tiling)`.
    by_shape: Vec<((Kernel, usize, usize), Tiling)>,
}

impl Default for Tilings {
    fn default() -> Tilings {
        Tilings { by_kernel: [Tiling::DEFAULT; 3], by_shape: Vec::new() }
    }
}

impl Tilings {
    /// The environment variable a process's tilings are read from, when it is set (nothing is
    /// tuned then).
    pub const VARIABLE: &'static str = "SEAM_CUDA_TILINGS";

    /// The tilings of a setting (see [`Tilings`]).
    pub fn parse(setting: &str) -> Result<Tilings, String> {
        let setting = setting.trim();
        if !setting.contains('=') {
            let tiling: Tiling = setting.parse()?;
            return Ok(Tilings { by_kernel: [tiling; 3], by_shape: Vec::new() });
        }
        let mut tilings = Tilings::default();
        for part in setting.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, tiling) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?}: format=tiling or format@ROWSxK=tiling expected (f16=r4t256)"))?;
            let (format, shape) = match key.trim().split_once('@') {
                Some((format, shape)) => (format, Some(shape)),
                None => (key.trim(), None),
            };
            let kernel = Kernel::ALL
                .into_iter()
                .find(|k| k.format() == format)
                .ok_or_else(|| format!("{part:?}: unknown format {format:?} (f16, int8 or int4)"))?;
            let tiling: Tiling = tiling.trim().parse()?;
            match shape {
                None => tilings.set_format(kernel, tiling),
                Some(shape) => {
                    let (rows, k) = shape
                        .split_once('x')
                        .and_then(|(rows, k)| Some((rows.parse().ok()?, k.parse().ok()?)))
                        .ok_or_else(|| {
                            format!("{part:?}: a launch shape's tiling is format@ROWSxK=tiling (int4@3072x2048=r2t128)")
                        })?;
                    tilings.set(kernel, rows, k, tiling);
                }
            }
        }
        Ok(tilings)
    }

    /// The process's setting ([`Tilings::VARIABLE`]), if it has one: launches take its tilings,
    /// and nothing is tuned. Read once; a malformed setting is an error every time it is asked
    /// for.
    pub fn setting() -> Result<Option<&'static Tilings>, String> {
        static SETTING: std::sync::OnceLock<Result<Option<Tilings>, String>> = std::sync::OnceLock::new();
        SETTING
            .get_or_init(|| match std::env::var(Tilings::VARIABLE) {
                Ok(setting) => Tilings::parse(&setting).map(Some).map_err(|e| format!("{}: {e}", Tilings::VARIABLE)),
                Err(_) => Ok(None),
            })
            .as_ref()
            .map(Option::as_ref)
            .map_err(Clone::clone)
    }

    /// The tilings tuned in this process ([`Tilings::install`]).
    fn tuned() -> &'static std::sync::RwLock<Tilings> {
        static TUNED: std::sync::OnceLock<std::sync::RwLock<Tilings>> = std::sync::OnceLock::new();
        TUNED.get_or_init(Default::default)
    }

    /// Makes the launches of each shape `tuned` names take its tiling in this process (where no
    /// setting overrides it): what [`crate::tune::tune`] picked for a model's step. Shapes
    /// installed before and not named in `tuned` keep theirs.
    pub fn install(tuned: &Tilings) {
        let mut installed = Tilings::tuned().write().unwrap_or_else(|e| e.into_inner());
        for ((kernel, rows, k), tiling) in &tuned.by_shape {
            installed.set(*kernel, *rows, *k, *tiling);
        }
    }

    /// The tiling a launch of `kernel` over matrices of `rows` rows in all and `k` inputs takes
    /// in this process: the setting's if there is one, else the tuned one for its shape, else
    /// [`Tiling::DEFAULT`].
    pub fn of_process_launch(kernel: Kernel, rows: usize, k: usize) -> Result<Tiling, String> {
        Ok(match Tilings::setting()? {
            Some(setting) => setting.of_launch(kernel, rows, k),
            None => Tilings::tuned().read().unwrap_or_else(|e| e.into_inner()).of_launch(kernel, rows, k),
        })
    }

    /// The launch shapes this names a tiling of, with theirs.
    pub fn shapes(&self) -> &[((Kernel, usize, usize), Tiling)] {
        &self.by_shape
    }

    /// The tiling `kernel` launches with where no shape of its is named.
    pub fn of(&self, kernel: Kernel) -> Tiling {
        self.by_kernel[kernel as usize]
    }

    /// The tiling a launch of `kernel` over matrices of `rows` rows in all and `k` inputs takes.
    pub fn of_launch(&self, kernel: Kernel, rows: usize, k: usize) -> Tiling {
        self.by_shape
            .iter()
            .find(|(shape, _)| *shape == (kernel, rows, k))
            .map_or_else(|| self.of(kernel), |(_, tiling)| *tiling)
    }

    /// Makes `kernel` launch with `tiling`.
    pub fn set_format(&mut self, kernel: Kernel, tiling: Tiling) {
        self.by_kernel[kernel as usize] = tiling;
    }

    /// Makes launches of `kernel` over `rows` rows in all of `k` inputs take `tiling`.
    pub fn set(&mut self, kernel: Kernel, rows: usize, k: usize, tiling: Tiling) {
        self.by_shape.retain(|(shape, _)| *shape != (kernel, rows, k));
        self.by_shape.push(((kernel, rows, k), tiling));
    }
}

impl std::fmt::Display for Tilings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts: Vec<String> = Kernel::ALL.iter().map(|k| format!("{}={}", k.format(), self.of(*k))).collect();
        parts.extend(
            self.by_shape.iter().map(|((kernel, rows, k), tiling)| format!("{}@{rows}x{k}={tiling}", kernel.format())),
        );
        write!(f, "{}", parts.join(","))
    }
}
