//! seam's CPU kernels called from inside IREE's dispatches, through an executable plugin.
//!
//! IREE's llvm-cpu executables can call functions they declare but do not define ("imports");
//! the local devices resolve them through executable plugins, shared libraries named by the
//! runtime flag `--executable_plugin`. seam's plugin (`plugin/kernels_plugin.c`, built by
//! `build.rs` and embedded here) holds no kernels: [`install`] writes it to the cache folder,
//! loads it into this process and hands it a table of the import functions below, which run
//! the kernels of `cpu-kernels` (the ones pjrt-cpu calls as XLA custom calls). When IREE later
//! loads the same path it gets the same loaded copy, table included.
//!
//! An import receives one pointer to a packed struct of its arguments, in the order the
//! executable's `func.call` passes them (memrefs as bare pointers, `llvm.bareptr`, each followed
//! by its element offset; `index` values as `usize`). Each call is one IREE workgroup's share of
//! the output rows (of a linear layer), of the query heads (of a prefill chunk's attention), of
//! the spans of KV heads (of a decode's attention, ADR 0049) or of the rows of logits (of the
//! greedy tokens' argmax), run on the calling IREE worker thread (the kernels' own pool is not
//! used: IREE's workgroups are the split over the cores).

use crate::error::IreeError;
use cpu_kernels::pool::Pool;
use cpu_kernels::{
    Activations, AttentionShape, CacheElement, CausalQueries, F16Matrix, Int4Matrix, Int8Matrix, Isa, LinearInput,
    LinearWeights,
};
use graph_engine::linear_kernels::format::{F16, INT4, INT4_PANELS, INT8_PANELS};
use graph_engine::linear_kernels::input::{ATTENTION_PARTS, RMS_NORM, ROWS};
use graph_engine::linear_kernels::{linear_entry, LinearEntry};
use llama_model::home;
use sha2::{Digest, Sha256};
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

/// The plugin library, as `build.rs` compiled it.
static PLUGIN_LIBRARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libseam_iree_kernels.so"));

/// An import function's C signature (`iree_hal_executable_import_v0_t`): the packed arguments,
/// the context the plugin gave at resolution (none here), reserved; 0 for success.
type ImportFn = unsafe extern "C" fn(params: *mut c_void, context: *mut c_void, reserved: *mut c_void) -> c_int;

/// One entry of the plugin's table (`seam_kernel_entry_t` in the C source).
#[repr(C)]
struct Entry {
    name: *const c_char,
    function: ImportFn,
    /// What the import's calls receive as their context: the batch size of a batched
    /// attention's import, else nothing.
    context: usize,
}

/// The imports seam provides, by the names the executables declare.
struct Table(Vec<Entry>);
// SAFETY: the table is never changed once built, and its pointers are to leaked strings and to
// functions.
unsafe impl Sync for Table {}
// SAFETY: as above.
unsafe impl Send for Table {}

/// Every import: each linear target of `stablehlo_llama::linear_targets`, the attention
/// targets and the greedy tokens' argmax.
fn table() -> &'static Table {
    static TABLE: OnceLock<Table> = OnceLock::new();
    TABLE.get_or_init(|| {
        let entry = |name: &str, function: ImportFn, context: usize| Entry {
            // Leaked once per process: the plugin keeps pointers to the names.
            name: CString::new(name).expect("import names have no NUL").into_raw(),
            function,
            context,
        };
        let entries = stablehlo_llama::linear_targets()
            .into_iter()
            .map(|target| entry(&target.name, linear_entry::<LinearImports>(&target), 0))
            .chain([
                entry(stablehlo_llama::ATTENTION_CAUSAL_TARGET, attention_causal, 0),
                entry(stablehlo_llama::WRITE_ENTRIES_TARGET, write_entries, 0),
                entry(stablehlo_llama::ARGMAX_TARGET, argmax, 0),
            ])
            // A batched attention's operands are counted by its batch, which its words (after
            // them) cannot tell: each batch size has its import, its size the context.
            .chain((1..=stablehlo_llama::MAX_DECODE_BATCH).map(|sequences| {
                entry(&stablehlo_llama::attention_decode_many_target(sequences), attention_many, sequences)
            }))
            .collect();
        Table(entries)
    })
}

/// Writes the plugin into the cache folder (once per process; the file is named by its hash, so
/// a seam of another version never loads this one's), loads it and hands it the import table.
/// Returns the path to pass to IREE as `--executable_plugin`.
pub fn install() -> Result<PathBuf, IreeError> {
    static INSTALLED: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    INSTALLED.get_or_init(|| install_once().map_err(|e| e.to_string())).clone().map_err(IreeError::Runtime)
}

fn install_once() -> Result<PathBuf, IreeError> {
    let digest = Sha256::digest(PLUGIN_LIBRARY);
    let hash: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    let name = format!("kernels-plugin-{hash}.so");
    // The cache folder, or where it cannot be written (a read-only cache), the temporary folder.
    let mut last_error = None;
    let mut written = None;
    for dir in [home::iree_cache_dir(), std::env::temp_dir()] {
        let path = dir.join(&name);
        if std::fs::read(&path).is_ok_and(|bytes| bytes == PLUGIN_LIBRARY) {
            written = Some(path);
            break;
        }
        match std::fs::create_dir_all(&dir).and_then(|()| atomic_write::write(&path, PLUGIN_LIBRARY)) {
            Ok(()) => {
                written = Some(path);
                break;
            }
            Err(e) => last_error = Some(IreeError::io(&path, e)),
        }
    }
    let path = match (written, last_error) {
        (Some(path), _) => path,
        (None, Some(e)) => return Err(e),
        (None, None) => unreachable!("two folders were tried"),
    };
    // SAFETY: the library is seam's own plugin (checked byte for byte above); loading it runs no
    // initializers beyond the C runtime's.
    let library = unsafe { libloading::Library::new(&path) }
        .map_err(|e| IreeError::Runtime(format!("loading the kernels plugin {}: {e}", path.display())))?;
    {
        // SAFETY: the symbol has this signature in plugin/kernels_plugin.c.
        let set_table: libloading::Symbol<'_, unsafe extern "C" fn(*const Entry, usize)> =
            unsafe { library.get(b"seam_kernels_plugin_set_table\0") }
                .map_err(|e| IreeError::Runtime(format!("the kernels plugin {} is not seam's: {e}", path.display())))?;
        let table = table();
        // SAFETY: the table lives for the rest of the process, as the plugin requires.
        unsafe { set_table(table.0.as_ptr(), table.0.len()) };
    }
    // Never unloaded: IREE's executables hold pointers into it for the life of the process.
    std::mem::forget(library);
    Ok(path)
}

/// The kernels' instruction set, chosen once.
fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(Isa::best)
}

thread_local! {
    /// A one-thread pool per IREE worker: each call runs on its caller alone.
    static ONE_THREAD: Pool = Pool::new(1);
}

/// Runs `body`, turning a panic into a failed call (it must not unwind into IREE's C frames).
fn guarded(body: impl FnOnce() -> bool) -> c_int {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(true) => 0,
        _ => 1,
    }
}

/// The imports of the linear targets, as [`graph_engine::linear_kernels`] picks them.
struct LinearImports;

impl LinearEntry for LinearImports {
    type Entry = ImportFn;
    fn instance<const FORMAT: u8, const INPUT: u8, const RESIDUAL: bool, const Q8: bool>() -> ImportFn {
        linear::<FORMAT, INPUT, RESIDUAL, Q8>
    }
    fn group<const FORMAT: u8, const INPUT: u8, const Q8: bool, const PRODUCTS: usize, const ROPE: bool>() -> ImportFn {
        linear_group::<FORMAT, INPUT, Q8, PRODUCTS, ROPE>
    }
}

thread_local! {
    /// A workgroup's residual columns and result, when its rows are not contiguous in the
    /// result (calls of several tokens).
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// The packed arguments of an import (`stablehlo_llama::mlir::KernelDispatches`): a pointer
/// and an element offset per operand and for the result, then the call's shape words, then this
/// workgroup's `first` and `count`.
struct Packed(*const usize);

impl Packed {
    /// Operand `i`'s elements from its offset on, as `T`, `len` of them.
    ///
    /// # Safety
    /// Operand `i` is a buffer of at least `offset + len` elements of type `T`.
    unsafe fn operand<'a, T>(&self, i: usize, len: usize) -> &'a [T] {
        unsafe {
            let base = *self.0.add(2 * i) as *const T;
            std::slice::from_raw_parts(base.add(*self.0.add(2 * i + 1)), len)
        }
    }

    /// Operand `i`'s pointer from its offset on, writable.
    ///
    /// # Safety
    /// As [`Packed::operand`].
    unsafe fn operand_mut<T>(&self, i: usize) -> *mut T {
        unsafe { (*self.0.add(2 * i) as *mut T).add(*self.0.add(2 * i + 1)) }
    }

    /// KV head `kvh`'s part (`span` elements from `kvh * span`) of the keys at operand `keys` and
    /// of the values at the next operand: what a workgroup that owns that head writes.
    ///
    /// # Safety
    /// Both operands are caches of more than `kvh` heads of `span` elements, and nothing else
    /// reads or writes that head's part while the slices live.
    unsafe fn head_caches<'a, E>(&self, keys: usize, kvh: usize, span: usize) -> (&'a mut [E], &'a mut [E]) {
        unsafe {
            let part = |i| std::slice::from_raw_parts_mut(self.operand_mut::<E>(i).add(kvh * span), span);
            (part(keys), part(keys + 1))
        }
    }

    /// Word `i` after the `pairs` pointer/offset pairs.
    ///
    /// # Safety
    /// The struct has that many words.
    unsafe fn word(&self, pairs: usize, i: usize) -> usize {
        unsafe { *self.0.add(2 * pairs + i) }
    }
}

/// The operands of a matrix of weight format `FORMAT` ([`graph_engine::linear_kernels`]'s
/// numbering).
const fn weight_operands(format: u8) -> usize {
    match format {
        F16 => 1,
        INT4 | INT4_PANELS => 3,
        _ => 2,
    }
}

/// The input operands of a linear import whose input is `INPUT`.
const fn input_operands(input: u8) -> usize {
    match input {
        ROWS | ATTENTION_PARTS => 1,
        RMS_NORM => 3,
        _ => 2,
    }
}

/// The input of a linear import (`INPUT`, from operand 0 on): `real` rows of `k` columns, or
/// for a decode attention's parts those of `heads` query heads. `None` for heads that do not
/// divide `k`.
///
/// # Safety
/// The operands are buffers of the shapes the graph emitter gave the dispatch.
unsafe fn linear_input<'a, const INPUT: u8>(
    p: &Packed,
    real: usize,
    k: usize,
    heads: usize,
) -> Option<LinearInput<'a>> {
    // SAFETY: the caller's promise.
    unsafe {
        Some(match INPUT {
            ATTENTION_PARTS => {
                if heads == 0 || !k.is_multiple_of(heads) {
                    return None;
                }
                let per_token = cpu_kernels::DECODE_PARTS * heads * (2 + k / heads);
                LinearInput::AttentionParts { parts: p.operand::<f32>(0, real * per_token), heads }
            }
            ROWS => LinearInput::Rows(p.operand::<f32>(0, real * k)),
            RMS_NORM => LinearInput::RmsNorm {
                x: p.operand::<f32>(0, real * k),
                weight: p.operand::<f32>(1, k),
                eps: p.operand::<f32>(2, 1)[0],
            },
            _ => LinearInput::SwiGlu { gate: p.operand::<f32>(0, real * k), up: p.operand::<f32>(1, real * k) },
        })
    }
}

/// Rows `row0..row0 + count` of the `[n, k]` matrix of format `FORMAT` whose operands start at
/// operand `w`; `None` for a share that starts inside a panel (which cannot be sliced out of it).
///
/// # Safety
/// The operands from `w` on are that matrix's.
unsafe fn matrix_rows<'a, const FORMAT: u8, const Q8: bool>(
    p: &Packed,
    w: usize,
    (n, k): (usize, usize),
    row0: usize,
    count: usize,
) -> Option<LinearWeights<'a>> {
    let groups = k / cpu_kernels::GROUP_SIZE;
    // SAFETY: the caller's promise.
    let whole = unsafe {
        match FORMAT {
            F16 => LinearWeights::F16(F16Matrix { rows: n, cols: k, data: p.operand::<u16>(w, n * k) }),
            INT4 | INT4_PANELS => {
                let m = Int4Matrix {
                    rows: n,
                    cols: k,
                    packed: p.operand::<u8>(w, n * k / 2),
                    scales: p.operand::<u16>(w + 1, n * groups),
                    biases: p.operand::<u16>(w + 2, n * groups),
                };
                match FORMAT {
                    INT4_PANELS => LinearWeights::Int4Panels(m, Activations::int8_when(Q8)),
                    _ => LinearWeights::Int4(m, Activations::int8_when(Q8)),
                }
            }
            _ => {
                let m = Int8Matrix {
                    rows: n,
                    cols: k,
                    codes: p.operand::<i8>(w, n * k),
                    scales: p.operand::<u16>(w + 1, n * groups),
                };
                match FORMAT {
                    INT8_PANELS => LinearWeights::Int8Panels(m, Activations::int8_when(Q8)),
                    _ => LinearWeights::Int8(m, Activations::int8_when(Q8)),
                }
            }
        }
    };
    whole.row_range(row0..row0 + count)
}

/// The rope tables of a call's rows (`cos`, `sin`, `[tokens, head_dim]`).
struct RopeTables<'a> {
    cos: &'a [f32],
    sin: &'a [f32],
    head_dim: usize,
}

/// Columns `row0..row0 + weights' rows` of the `[tokens, n]` result at `out`: the product of
/// the first `real` rows of `input` with `weights` (plus the residual's same columns; turned by
/// each row's rope tables, where given, the columns being whole heads), the padding rows zero,
/// on the calling thread.
///
/// # Safety
/// `out` is a `[tokens, n]` f32 buffer whose columns this workgroup alone writes; `residual`,
/// when given, is `[tokens, n]`.
unsafe fn product_columns(
    input: LinearInput<'_>,
    (tokens, real): (usize, usize),
    weights: LinearWeights<'_>,
    residual: Option<&[f32]>,
    rope: Option<&RopeTables<'_>>,
    (out, n, row0): (*mut f32, usize, usize),
) -> bool {
    let count = weights.rows();
    SCRATCH.with(|scratch| {
        let (res_cols, out_cols) = &mut *scratch.borrow_mut();
        // This workgroup's columns of the residual, token by token.
        let residual = residual.map(|r| {
            res_cols.clear();
            for t in 0..real {
                res_cols.extend_from_slice(&r[t * n + row0..t * n + row0 + count]);
            }
            &res_cols[..]
        });
        out_cols.resize(real * count, 0.0);
        // Every workgroup of the dispatch passes the same input: the first call on a thread
        // prepares it, the others take that preparation.
        cpu_kernels::set_input_reuse(true);
        let mut ok =
            ONE_THREAD.with(|pool| cpu_kernels::linear(isa(), pool, input, real, weights, residual, out_cols).is_ok());
        if let Some(RopeTables { cos, sin, head_dim: d }) = rope.filter(|_| real > 0) {
            ok &= cpu_kernels::rope_rows(isa(), out_cols, &cos[..real * d], &sin[..real * d], *d).is_ok();
        }
        for t in 0..tokens {
            // SAFETY: the caller's promise: these columns of row `t` are this workgroup's.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.add(t * n + row0), count) };
            if t < real {
                dst.copy_from_slice(&out_cols[t * count..(t + 1) * count]);
            } else {
                // Padding rows of a bucket: zero, as the XLA form gives them.
                dst.fill(0.0);
            }
        }
        ok
    })
}

/// One workgroup's share of a linear layer (`FORMAT` and `INPUT` as
/// [`graph_engine::linear_kernels`] numbers them): output columns `row0..row0 + rows` of every token,
/// through `cpu_kernels::linear` on the calling thread.
unsafe extern "C" fn linear<const FORMAT: u8, const INPUT: u8, const RESIDUAL: bool, const Q8: bool>(
    params: *mut c_void,
    _context: *mut c_void,
    _reserved: *mut c_void,
) -> c_int {
    let inputs = input_operands(INPUT);
    // Words: tokens, k, n (and heads, for attention parts), then this workgroup's share.
    let share = if INPUT == ATTENTION_PARTS { 4 } else { 3 };
    let rows_operand = inputs + weight_operands(FORMAT) + usize::from(RESIDUAL);
    let result = rows_operand + 1;
    let p = Packed(params as *const usize);
    guarded(|| {
        // SAFETY: the executable passes `result + 1` pointer/offset pairs and `share + 2` words,
        // over buffers of the shapes the graph emitter gave the dispatch: inputs `[tokens, k]`
        // (RMSNorm: norm `[k]`, eps `[]`; attention parts `[tokens, P * heads, 2 + k / heads]`),
        // weights of `n` rows, residual and result `[tokens, n]`, rows `[]`; this workgroup
        // alone writes its columns of the result.
        unsafe {
            let word = |i| p.word(result + 1, i);
            let (tokens, k, n, row0, count) = (word(0), word(1), word(2), word(share), word(share + 1));
            let real = usize::try_from(p.operand::<i32>(rows_operand, 1)[0]).unwrap_or(0).min(tokens);
            let heads = if INPUT == ATTENTION_PARTS { word(3) } else { 0 };
            let Some(input) = linear_input::<INPUT>(&p, real, k, heads) else { return false };
            let Some(weights) = matrix_rows::<FORMAT, Q8>(&p, inputs, (n, k), row0, count) else { return false };
            let residual = RESIDUAL.then(|| p.operand::<f32>(rows_operand - 1, tokens * n));
            product_columns(input, (tokens, real), weights, residual, None, (p.operand_mut(result), n, row0))
        }
    })
}

/// One workgroup's share of a grouped linear call (`stablehlo_llama::linear_group_target`):
/// share columns `first..first + count` of the `PRODUCTS` results taken in turn, each matrix's
/// part through `cpu_kernels::linear` on the calling thread (the input is prepared once per
/// thread); with `ROPE`, the first two results' heads turned by the call's rope tables.
unsafe extern "C" fn linear_group<
    const FORMAT: u8,
    const INPUT: u8,
    const Q8: bool,
    const PRODUCTS: usize,
    const ROPE: bool,
>(
    params: *mut c_void,
    _context: *mut c_void,
    _reserved: *mut c_void,
) -> c_int {
    let inputs = input_operands(INPUT);
    let rows_operand = inputs + PRODUCTS * weight_operands(FORMAT) + if ROPE { 2 } else { 0 };
    let results = rows_operand + 1;
    let p = Packed(params as *const usize);
    guarded(|| {
        // SAFETY: the executable passes `results + PRODUCTS` pointer/offset pairs and `PRODUCTS +
        // 4` words (tokens, k, each result's columns, [head_dim], first, count), over buffers of
        // the shapes the graph emitter gave the dispatch: inputs `[tokens, k]` (RMSNorm: norm
        // `[k]`, eps `[]`), each matrix's weights of its result's columns in rows, [cos and sin
        // `[tokens, head_dim]`], rows `[]`, results `[tokens, n_i]`; this workgroup alone writes
        // its share's columns.
        unsafe {
            let word = |i| p.word(results + PRODUCTS, i);
            let share = 2 + PRODUCTS + usize::from(ROPE);
            let (tokens, k, first, count) = (word(0), word(1), word(share), word(share + 1));
            let real = usize::try_from(p.operand::<i32>(rows_operand, 1)[0]).unwrap_or(0).min(tokens);
            let Some(input) = linear_input::<INPUT>(&p, real, k, 0) else { return false };
            let rope = ROPE.then(|| {
                let head_dim = word(2 + PRODUCTS);
                let table = |i| p.operand::<f32>(i, tokens * head_dim);
                RopeTables { cos: table(rows_operand - 2), sin: table(rows_operand - 1), head_dim }
            });
            let rows: [usize; PRODUCTS] = std::array::from_fn(|i| word(2 + i));
            let all_ok = cpu_kernels::share_parts(&rows, first..first + count).all(|(i, part)| {
                let (n, w) = (rows[i], inputs + i * weight_operands(FORMAT));
                let Some(weights) = matrix_rows::<FORMAT, Q8>(&p, w, (n, k), part.start, part.len()) else {
                    return false;
                };
                // The query's and key's heads turn; a share of them is whole heads.
                let rope = rope.as_ref().filter(|_| i < 2);
                if rope.is_some_and(|r| r.head_dim == 0 || part.start % r.head_dim + part.len() % r.head_dim != 0) {
                    return false;
                }
                let out = (p.operand_mut(results + i), n, part.start);
                product_columns(input, (tokens, real), weights, None, rope, out)
            });
            all_ok
        }
    })
}

thread_local! {
    /// One query head's rows and attention output, gathered from and scattered to the call's
    /// `[tokens, heads, head_dim]` arrays.
    static HEAD_ROWS: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// `f32_body` or `f16_body`, by the element size the dispatch's `cache_bytes` word gives (4: f32,
/// 2: f16; see `stablehlo_llama::mlir::KernelDispatches`); any other size fails the call.
fn by_cache_bytes(cache_bytes: usize, f32_body: impl FnOnce() -> bool, f16_body: impl FnOnce() -> bool) -> bool {
    match cache_bytes {
        4 => f32_body(),
        2 => f16_body(),
        _ => false,
    }
}

/// One workgroup's query heads of a causal attention call: `(q f32[T, H, D], keys [KVH, D, C],
/// values [KVH, C, D], position i32[], rows i32[]) -> f32[T, H, D]`, the caches f32 or f16, row
/// `t` over cache positions `0..=position + t` and zero from `rows` on, as
/// `cpu_kernels::attention_causal` on the calling thread, one head at a time.
unsafe extern "C" fn attention_causal(params: *mut c_void, _context: *mut c_void, _reserved: *mut c_void) -> c_int {
    let p = Packed(params as *const usize);
    // SAFETY: the executable passes six pointer/offset pairs and eight words (see `causal_heads`).
    let bytes = unsafe { p.word(6, 5) };
    // SAFETY: as above; the word says the caches' type.
    guarded(|| unsafe { by_cache_bytes(bytes, || causal_heads::<f32>(&p), || causal_heads::<half::f16>(&p)) })
}

/// [`attention_causal`] over caches of `E`.
///
/// # Safety
/// `p` is the packed arguments of that import, its caches of `E`.
unsafe fn causal_heads<E: CacheElement>(p: &Packed) -> bool {
    let result = 5;
    // SAFETY: the executable passes `result + 1` pointer/offset pairs and eight words,
    // over buffers of the shapes the graph emitter gave the dispatch (its words, the
    // caches of `E`); this workgroup alone writes its heads' rows of the result.
    unsafe {
        let word = |i| p.word(result + 1, i);
        let (tokens, heads, kv_heads, d, capacity, first, count) =
            (word(0), word(1), word(2), word(3), word(4), word(6), word(7));
        if kv_heads == 0 || heads % kv_heads != 0 || first + count > heads {
            return false;
        }
        let position = p.operand::<i32>(3, 1)[0];
        let rows = p.operand::<i32>(4, 1)[0];
        let (Ok(position), Ok(rows)) = (usize::try_from(position), usize::try_from(rows)) else {
            return false;
        };
        let q = p.operand::<f32>(0, tokens * heads * d);
        let keys = p.operand::<E>(1, kv_heads * d * capacity);
        let values = p.operand::<E>(2, kv_heads * capacity * d);
        let out = p.operand_mut::<f32>(result);
        let group = heads / kv_heads;
        let span = d * capacity;
        let shape = AttentionShape { heads: 1, kv_heads: 1, head_dim: d, capacity };
        let queries = CausalQueries { tokens, position, rows };
        HEAD_ROWS.with(|rows_buffers| {
            let (q_head, out_head) = &mut *rows_buffers.borrow_mut();
            (first..first + count).all(|h| {
                let kvh = h / group;
                q_head.clear();
                for t in 0..tokens {
                    q_head.extend_from_slice(&q[(t * heads + h) * d..(t * heads + h + 1) * d]);
                }
                out_head.resize(tokens * d, 0.0);
                let ok = ONE_THREAD.with(|pool| {
                    cpu_kernels::attention_causal(
                        isa(),
                        pool,
                        shape,
                        q_head,
                        queries,
                        &keys[kvh * span..(kvh + 1) * span],
                        &values[kvh * span..(kvh + 1) * span],
                        out_head,
                    )
                    .is_ok()
                });
                for t in 0..tokens {
                    let dst = std::slice::from_raw_parts_mut(out.add((t * heads + h) * d), d);
                    dst.copy_from_slice(&out_head[t * d..(t + 1) * d]);
                }
                ok
            })
        })
    }
}

/// One workgroup's share of a prefill chunk's cache writes (`stablehlo_llama::WRITE_ENTRIES_TARGET`):
/// `(k f32[T, KVH, D], v f32[T, KVH, D], position i32[], rows i32[], keys [KVH, D, C], values [KVH,
/// C, D])`, the caches (f32 or f16) being the dispatch's tied operands: for KV heads
/// `first..first + count`, rows `0..rows` of `k` and `v` at positions `position..`.
unsafe extern "C" fn write_entries(params: *mut c_void, _context: *mut c_void, _reserved: *mut c_void) -> c_int {
    let p = Packed(params as *const usize);
    // SAFETY: the executable passes six pointer/offset pairs and seven words (see `write_heads`).
    let bytes = unsafe { p.word(6, 4) };
    // SAFETY: as above; the word says the caches' type.
    guarded(|| unsafe { by_cache_bytes(bytes, || write_heads::<f32>(&p), || write_heads::<half::f16>(&p)) })
}

/// [`write_entries`] into caches of `E`.
///
/// # Safety
/// `p` is the packed arguments of that import, its caches of `E`.
unsafe fn write_heads<E: CacheElement>(p: &Packed) -> bool {
    // SAFETY: the executable passes six pointer/offset pairs and seven words, over buffers
    // of the shapes the graph emitter gave the dispatch (its words, the caches of `E`);
    // this workgroup alone writes its KV heads' parts of the caches.
    unsafe {
        let word = |i| p.word(6, i);
        let (tokens, kv_heads, d, capacity, first, count) = (word(0), word(1), word(2), word(3), word(5), word(6));
        if first + count > kv_heads {
            return false;
        }
        let (Ok(position), Ok(rows)) =
            (usize::try_from(p.operand::<i32>(2, 1)[0]), usize::try_from(p.operand::<i32>(3, 1)[0]))
        else {
            return false;
        };
        if rows > tokens {
            return false;
        }
        let (k, v) = (p.operand::<f32>(0, tokens * kv_heads * d), p.operand::<f32>(1, tokens * kv_heads * d));
        let span = d * capacity;
        let one = AttentionShape { heads: 1, kv_heads: 1, head_dim: d, capacity };
        (first..first + count).all(|kvh| {
            // This KV head's part of the caches, which no other workgroup touches.
            let (keys, values) = p.head_caches::<E>(4, kvh, span);
            (0..rows).all(|t| {
                let entry = (t * kv_heads + kvh) * d..(t * kv_heads + kvh + 1) * d;
                // `write_cache_entries` refuses a position outside the caches.
                cpu_kernels::write_cache_entries(one, keys, values, (&k[entry.clone()], &v[entry]), position + t, 1)
                    .is_ok()
            })
        })
    }
}

/// One workgroup's share of a decode's attention, one sequence's or a batch's
/// (`stablehlo_llama::attention_decode_many_target`): `(q f32[S, H, D], positions i32[S], k f32[S,
/// KVH, D], v f32[S, KVH, D], keys_0 [KVH, D, C], values_0 [KVH, C, D], ...) -> parts f32[S, P * H,
/// 2 + D]`, the caches (f32 or f16) being the dispatch's tied operands. The workgroup's units
/// `first..first + count` of the `S * KVH * P` are spans of KV heads (unit `u`: span `u % P` of KV
/// head `u / P % KVH` of sequence `u / (P * KVH)`): for each, it writes that KV head's new entry
/// of its sequence at the sequence's position if the span holds that position, then attends over
/// the span for that KV head's query heads in one kernel call, which reads its keys and values
/// once for all of them (ADR 0031), and leaves the span's softmax parts for the output
/// projection to merge (`cpu_kernels::merge_decode_parts`). `context` is `S`, as the import's
/// table entry gives it.
unsafe extern "C" fn attention_many(params: *mut c_void, context: *mut c_void, _reserved: *mut c_void) -> c_int {
    let p = Packed(params as *const usize);
    let sequences = context as usize;
    // SAFETY: the executable of this batch size passes `4 + 2 * sequences + 1` pointer/offset
    // pairs and eight words (see `attend_many`).
    let bytes = unsafe { p.word(4 + 2 * sequences + 1, 5) };
    // SAFETY: as above; the word says the caches' type.
    guarded(|| unsafe {
        by_cache_bytes(bytes, || attend_many::<f32>(&p, sequences), || attend_many::<half::f16>(&p, sequences))
    })
}

/// [`attention_many`] over caches of `E`, for a batch of `sequences`.
///
/// # Safety
/// `p` is the packed arguments of that import for this batch size, its caches of `E`.
unsafe fn attend_many<E: CacheElement>(p: &Packed, sequences: usize) -> bool {
    const P: usize = cpu_kernels::DECODE_PARTS;
    const _: () = assert!(P == stablehlo_llama::ATTENTION_DECODE_PARTS);
    let result = 4 + 2 * sequences;
    // SAFETY: the executable of this batch size passes `result + 1` pointer/offset pairs
    // and eight words, over buffers of the shapes the graph emitter gave the dispatch (its
    // words, the caches of `E`; positions checked against the capacity below); this workgroup
    // alone writes its units' parts of the result, and the entries of the KV heads whose last
    // span it takes, which only that unit reads; no unit reads a cache position another unit
    // writes, and the caches are written through bare pointers only, read through shared
    // slices.
    unsafe {
        let word = |i| p.word(result + 1, i);
        let (batch, heads, kv_heads, d, capacity, first, count) =
            (word(0), word(1), word(2), word(3), word(4), word(6), word(7));
        if batch != sequences || kv_heads == 0 || heads % kv_heads != 0 || first + count > sequences * kv_heads * P {
            return false;
        }
        let group = heads / kv_heads;
        let per = heads * d;
        let stride = 2 + d;
        let q = p.operand::<f32>(0, sequences * per);
        let positions = p.operand::<i32>(1, sequences);
        let (k, v) = (p.operand::<f32>(2, sequences * kv_heads * d), p.operand::<f32>(3, sequences * kv_heads * d));
        let parts = p.operand_mut::<f32>(result);
        let span = d * capacity;
        let one = AttentionShape { heads: group, kv_heads: 1, head_dim: d, capacity };
        for unit in first..first + count {
            let (s, kvh, part) = (unit / (P * kv_heads), unit / P % kv_heads, unit % P);
            let Ok(position) = usize::try_from(positions[s]) else { return false };
            if position >= capacity {
                return false;
            }
            // The last span that holds positions holds the new one: a context of one span
            // has it in span 0, of two in span 1 (spans hold whole runs from 0 up). Its unit
            // writes the entry through the bare pointers, with no slice of the head alive,
            // since the head's other unit may be reading its own span on another worker; no
            // unit ever holds a mutable slice of a head it shares.
            if cpu_kernels::decode_spans(isa(), one, position + 1) == part + 1 {
                let sequence = s * kv_heads * d..(s + 1) * kv_heads * d;
                let (keys, values) = (p.operand_mut::<E>(4 + 2 * s), p.operand_mut::<E>(4 + 2 * s + 1));
                let all = AttentionShape { heads, kv_heads, head_dim: d, capacity };
                cpu_kernels::write_cache_entry(keys, values, &k[sequence.clone()], &v[sequence], all, kvh, position);
            }
            // Read only, from here on: this head's span, and the entry when it is this unit's.
            let keys = p.operand::<E>(4 + 2 * s, (kvh + 1) * span).get(kvh * span..).unwrap_or_default();
            let values = p.operand::<E>(4 + 2 * s + 1, (kvh + 1) * span).get(kvh * span..).unwrap_or_default();
            let q = &q[s * per + kvh * group * d..s * per + (kvh + 1) * group * d];
            let out = std::slice::from_raw_parts_mut(
                parts.add(((s * P + part) * heads + kvh * group) * stride),
                group * stride,
            );
            if cpu_kernels::attention_decode_part(isa(), one, q, keys, values, position + 1, part, out).is_err() {
                return false;
            }
        }
        true
    }
}

/// One workgroup's rows of a greedy pick: `(logits f32[R, V]) -> i32[R]`, row `r` the first index
/// of its largest value, as `cpu_kernels::argmax_rows` on the calling thread (the numbers of
/// `session_api`'s argmax, and of pjrt-cpu's custom call).
unsafe extern "C" fn argmax(params: *mut c_void, _context: *mut c_void, _reserved: *mut c_void) -> c_int {
    let p = Packed(params as *const usize);
    guarded(|| {
        // SAFETY: the executable passes two pointer/offset pairs and four words, over buffers of
        // the shapes the graph emitter gave the dispatch; this workgroup alone writes its rows of
        // the result.
        unsafe {
            let (rows, cols, first, count) = (p.word(2, 0), p.word(2, 1), p.word(2, 2), p.word(2, 3));
            if first + count > rows {
                return false;
            }
            let logits = &p.operand::<f32>(0, rows * cols)[first * cols..(first + count) * cols];
            let mut ids = vec![0u32; count];
            if ONE_THREAD.with(|pool| cpu_kernels::argmax_rows(isa(), pool, logits, cols, &mut ids)).is_err() {
                return false;
            }
            let out = p.operand_mut::<i32>(1).add(first);
            for (r, id) in ids.into_iter().enumerate() {
                let Ok(id) = i32::try_from(id) else { return false };
                *out.add(r) = id;
            }
            true
        }
    })
}
