//! `fuzz-support`: seeded mutation fuzzing that runs inside `cargo test`.
//!
//! The parsers of untrusted model files (GGUF, safetensors, `config.json`, `tokenizer.json`,
//! chat templates) are fuzzed by ordinary integration tests, so that every `cargo test` runs a
//! bounded number of cases and a longer run is one environment variable away. No coverage
//! feedback, no nightly toolchain, no external tool: a deterministic RNG ([`Rng`]), mutators for
//! binary and JSON inputs ([`mutate_bytes`], [`mutate_json`]), a runner ([`Fuzz`]) that replays
//! the committed regression inputs first, then the seeds, then mutated cases, each under
//! `catch_unwind` and under a memory bound measured by [`CountingAllocator`].
//!
//! A test binary that uses [`Fuzz`] must install the allocator:
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOC: fuzz_support::CountingAllocator = fuzz_support::CountingAllocator;
//! ```
//!
//! Environment: `SEAM_FUZZ_CASES` (mutated cases per target, instead of the target's default),
//! `SEAM_FUZZ_SEED` (the starting seed, decimal or `0x` hex, or `random`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::fmt::Write as _;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The seed of the test command's runs: fixed, so that `cargo test` is deterministic.
pub const DEFAULT_SEED: u64 = 0x5EA3_F022_0017_0006;

// ---------------------------------------------------------------------------------------------
// Random numbers
// ---------------------------------------------------------------------------------------------

/// SplitMix64: tiny, fast, and good enough to pick mutations; the same seed always gives the same
/// sequence on every platform, which is what makes a failing run reproducible.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator started from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`0` when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }

    /// True with probability `numerator / denominator`.
    pub fn chance(&mut self, numerator: usize, denominator: usize) -> bool {
        self.below(denominator) < numerator
    }

    /// A random element of `items` (which must not be empty).
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// A length biased towards small values (most interesting edits are short, a few are long).
    pub fn small_len(&mut self, max: usize) -> usize {
        let cap = match self.below(4) {
            0..=1 => 8,
            2 => 64,
            _ => 4096,
        };
        1 + self.below(cap.min(max.max(1)))
    }
}

// ---------------------------------------------------------------------------------------------
// Mutations
// ---------------------------------------------------------------------------------------------

/// Byte values that sit on boundaries (sign bits, all ones, ASCII edges).
const INTERESTING_BYTES: &[u8] = &[0x00, 0x01, 0x7f, 0x80, 0xff, b'0', b'9', b'"', b'{', b'}', b'[', b']', b','];

/// Integers that break length and offset arithmetic: zero, one, sign boundaries, all ones, the
/// powers of two where 32- and 64-bit products overflow.
const INTERESTING_INTS: &[u64] = &[
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    16,
    31,
    32,
    255,
    256,
    4096,
    0x7fff,
    0xffff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 32,
    1 << 40,
    1 << 62,
    1 << 63,
    u64::MAX - 1,
    u64::MAX,
];

/// Applies one random binary mutation to `data` in place: a bit flip, a byte set to a boundary
/// value, a 2/4/8-byte little-endian integer overwritten with a boundary value, a length near the
/// input's size, or nudged by a small delta, a truncation, a deleted, inserted or duplicated run,
/// or a splice with one of `others` (the other seeds).
pub fn mutate_bytes(rng: &mut Rng, data: &mut Vec<u8>, others: &[Vec<u8>]) {
    let len = data.len();
    if len == 0 {
        let n = rng.small_len(64);
        data.extend((0..n).map(|_| rng.next_u64() as u8));
        return;
    }
    match rng.below(11) {
        0 => {
            let i = rng.below(len);
            data[i] ^= 1 << rng.below(8);
        }
        1 => {
            let i = rng.below(len);
            data[i] = *rng.pick(INTERESTING_BYTES);
        }
        2 => {
            let i = rng.below(len);
            data[i] = rng.next_u64() as u8;
        }
        3 | 4 => {
            // An integer field: either a boundary value or one near the input's own size, which is
            // what a length or offset that is almost right looks like.
            let width = *rng.pick(&[2usize, 4, 8, 8]);
            let value = if rng.chance(1, 3) {
                let near = [len as u64, len as u64 + 1, len as u64 - 1, 2 * len as u64, len as u64 / 2];
                *rng.pick(&near)
            } else {
                *rng.pick(INTERESTING_INTS)
            };
            // Real formats align their integers; misaligned writes are still useful now and then.
            let at = if rng.chance(3, 4) { rng.below(len) / width * width } else { rng.below(len) };
            write_le(data, at, width, value);
        }
        5 => {
            let width = *rng.pick(&[1usize, 2, 4, 8]);
            let at = rng.below(len);
            let delta = 1 + rng.below(32) as u64;
            let old = read_le(data, at, width);
            let new = if rng.chance(1, 2) { old.wrapping_add(delta) } else { old.wrapping_sub(delta) };
            write_le(data, at, width, new);
        }
        6 => data.truncate(rng.below(len)),
        7 => {
            let at = rng.below(len);
            let n = rng.small_len(len - at);
            data.drain(at..(at + n).min(len));
        }
        8 => {
            let at = rng.below(len + 1);
            let n = rng.small_len(256);
            let run: Vec<u8> = if rng.chance(1, 2) {
                vec![*rng.pick(INTERESTING_BYTES); n]
            } else {
                (0..n).map(|_| rng.next_u64() as u8).collect()
            };
            data.splice(at..at, run);
        }
        9 => {
            let from = rng.below(len);
            let n = rng.small_len(len - from);
            let chunk = data[from..(from + n).min(len)].to_vec();
            let at = rng.below(len + 1);
            data.splice(at..at, chunk);
        }
        _ => {
            let Some(other) = (!others.is_empty()).then(|| rng.pick(others)) else { return };
            if other.is_empty() {
                return;
            }
            let cut = rng.below(len + 1);
            let from = rng.below(other.len());
            data.truncate(cut);
            data.extend_from_slice(&other[from..]);
        }
    }
}

fn read_le(data: &[u8], at: usize, width: usize) -> u64 {
    let mut bytes = [0u8; 8];
    for (k, b) in bytes.iter_mut().take(width).enumerate() {
        *b = data.get(at + k).copied().unwrap_or(0);
    }
    u64::from_le_bytes(bytes)
}

fn write_le(data: &mut [u8], at: usize, width: usize, value: u64) {
    for (k, b) in value.to_le_bytes().iter().take(width).enumerate() {
        if let Some(slot) = data.get_mut(at + k) {
            *slot = *b;
        }
    }
}

/// JSON values that parsers of configs mishandle: zero, negatives, numbers past `u32`/`u64`/`f32`
/// range, fractions where integers are expected, spellings JSON does not allow (`NaN`), and every
/// other type in place of a number or a string.
const INTERESTING_JSON: &[&str] = &[
    "0",
    "1",
    "-1",
    "2",
    "3",
    "7",
    "64",
    "65535",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "18446744073709551615",
    "18446744073709551616",
    "1e308",
    "1e999",
    "-1e999",
    "1e-45",
    "1e-400",
    "0.5",
    "-0.0",
    "3.5",
    "NaN",
    "Infinity",
    "-Infinity",
    "null",
    "true",
    "false",
    "\"\"",
    "\"1\"",
    "\"llama\"",
    "\"\\u0000\"",
    "\"\\ud800\"",
    "\"{{ x }}\"",
    "\"{% for %}\"",
    "[]",
    "[0]",
    "[1, 2]",
    "[\"a\", null]",
    "{}",
    "{\"a\": 1}",
    "[[[[[[[[]]]]]]]]",
];

/// Where the values and the object members of a JSON text are (byte ranges), as far as it parses.
#[derive(Debug, Default, Clone)]
pub struct JsonSpans {
    /// Every value: scalars, strings, arrays and objects.
    pub values: Vec<Range<usize>>,
    /// Every object member, from the key's opening quote to the end of its value.
    pub members: Vec<Range<usize>>,
}

/// Scans `text` for [`JsonSpans`]. Tolerant: stops at the first syntax error and returns what it
/// found before, so it works on inputs that earlier mutations already broke.
pub fn json_spans(text: &[u8]) -> JsonSpans {
    let mut spans = JsonSpans::default();
    let mut scanner = Scanner { text, pos: 0, spans: &mut spans };
    scanner.value(0);
    spans
}

struct Scanner<'a> {
    text: &'a [u8],
    pos: usize,
    spans: &'a mut JsonSpans,
}

impl Scanner<'_> {
    fn skip_ws(&mut self) {
        while self.pos < self.text.len() && self.text[self.pos].is_ascii_whitespace() {
            self.pos += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.text.get(self.pos).copied()
    }

    fn string(&mut self) -> Option<()> {
        self.pos += 1;
        while let Some(c) = self.peek() {
            self.pos += 1;
            match c {
                b'\\' => self.pos += 1,
                b'"' => return Some(()),
                _ => {}
            }
        }
        None
    }

    fn value(&mut self, depth: usize) -> Option<()> {
        if depth > 64 {
            return None;
        }
        self.skip_ws();
        let start = self.pos;
        match self.peek()? {
            b'{' => {
                self.pos += 1;
                loop {
                    self.skip_ws();
                    match self.peek()? {
                        b'}' => {
                            self.pos += 1;
                            break;
                        }
                        b',' => self.pos += 1,
                        b'"' => {
                            let key = self.pos;
                            self.string()?;
                            self.skip_ws();
                            if self.peek()? != b':' {
                                return None;
                            }
                            self.pos += 1;
                            self.value(depth + 1)?;
                            self.spans.members.push(key..self.pos);
                        }
                        _ => return None,
                    }
                }
            }
            b'[' => {
                self.pos += 1;
                loop {
                    self.skip_ws();
                    match self.peek()? {
                        b']' => {
                            self.pos += 1;
                            break;
                        }
                        b',' => self.pos += 1,
                        _ => self.value(depth + 1)?,
                    }
                }
            }
            b'"' => self.string()?,
            _ => {
                while matches!(self.peek(), Some(c) if c.is_ascii_alphanumeric() || b"+-.".contains(&c)) {
                    self.pos += 1;
                }
                if self.pos == start {
                    return None;
                }
            }
        }
        self.spans.values.push(start..self.pos.min(self.text.len()));
        Some(())
    }
}

/// Applies one structural mutation to a JSON text: a value replaced by a boundary value or by
/// another value of the same document (a type change), a string's content replaced, an object
/// member deleted or duplicated. Falls back to [`mutate_bytes`] when nothing parses.
pub fn mutate_json(rng: &mut Rng, data: &mut Vec<u8>, others: &[Vec<u8>]) {
    let spans = json_spans(data);
    if spans.values.is_empty() {
        return mutate_bytes(rng, data, others);
    }
    match rng.below(6) {
        0..=1 => {
            let target = rng.pick(&spans.values).clone();
            let with = rng.pick(INTERESTING_JSON).as_bytes().to_vec();
            data.splice(target, with);
        }
        2 => {
            let target = rng.pick(&spans.values).clone();
            let source = rng.pick(&spans.values).clone();
            let with = data[source].to_vec();
            data.splice(target, with);
        }
        3 => {
            // A string's content: empty, long, control characters, template syntax, special-token
            // spellings.
            let strings: Vec<&Range<usize>> =
                spans.values.iter().filter(|r| data.get(r.start) == Some(&b'"') && r.len() >= 2).collect();
            if strings.is_empty() {
                return mutate_bytes(rng, data, others);
            }
            let target = (*rng.pick(&strings)).clone();
            let long = "a".repeat(1 + rng.below(5000));
            let choices =
                ["", "\\n", "\\u0000", "\\\\", "{{", "{%", "}}", "<|im_end|>", "\\u00e9\\ud83d\\ude00", &long];
            let content = rng.pick(&choices).as_bytes().to_vec();
            data.splice(target.start + 1..target.end - 1, content);
        }
        4 => {
            let Some(member) = (!spans.members.is_empty()).then(|| rng.pick(&spans.members).clone()) else {
                return mutate_bytes(rng, data, others);
            };
            // The member and the comma that separates it from the next one (or the previous one).
            let mut end = member.end;
            while end < data.len() && data[end].is_ascii_whitespace() {
                end += 1;
            }
            let mut start = member.start;
            if data.get(end) == Some(&b',') {
                end += 1;
            } else {
                let mut before = start;
                while before > 0 && data[before - 1].is_ascii_whitespace() {
                    before -= 1;
                }
                if before > 0 && data[before - 1] == b',' {
                    start = before - 1;
                }
            }
            data.drain(start..end);
        }
        _ => {
            let Some(member) = (!spans.members.is_empty()).then(|| rng.pick(&spans.members).clone()) else {
                return mutate_bytes(rng, data, others);
            };
            let mut copy = b", ".to_vec();
            copy.extend_from_slice(&data[member.clone()]);
            data.splice(member.end..member.end, copy);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Memory accounting
// ---------------------------------------------------------------------------------------------

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// A single allocation above this is refused (the process then aborts with Rust's "memory
/// allocation failed"), after a line on stderr names the target, seed and case. Far above any
/// bound a target sets; it exists so that a parser trusting a declared length of gigabytes stops
/// the test instead of exhausting the machine's memory.
pub const HARD_LIMIT: usize = 4 << 30;

static CURRENT_TARGET_PTR: AtomicPtr<u8> = AtomicPtr::new(std::ptr::null_mut());
static CURRENT_TARGET_LEN: AtomicUsize = AtomicUsize::new(0);
static CURRENT_SEED: AtomicU64 = AtomicU64::new(0);
static CURRENT_CASE: AtomicU64 = AtomicU64::new(u64::MAX);

/// A global allocator that forwards to [`System`] and counts: bytes live now, their peak since
/// the last [`reset_peak`], and the largest single request. Declare it as the
/// `#[global_allocator]` of each fuzz test binary; [`Fuzz::run`] refuses to run without it.
#[derive(Debug, Default, Clone, Copy)]
pub struct CountingAllocator;

fn record_alloc(size: usize) {
    INSTALLED.store(true, Ordering::Relaxed);
    let live = LIVE.fetch_add(size, Ordering::Relaxed) + size;
    PEAK.fetch_max(live, Ordering::Relaxed);
    LARGEST.fetch_max(size, Ordering::Relaxed);
}

/// Says on stderr which case asked for `size` bytes, without allocating (this runs inside the
/// allocator, where allocating again could recurse).
fn report_refusal(size: usize) {
    struct Buf {
        bytes: [u8; 512],
        len: usize,
    }
    impl std::fmt::Write for Buf {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            let n = s.len().min(self.bytes.len() - self.len);
            self.bytes[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
            self.len += n;
            Ok(())
        }
    }
    let mut buf = Buf { bytes: [0; 512], len: 0 };
    let ptr = CURRENT_TARGET_PTR.load(Ordering::Relaxed);
    let len = CURRENT_TARGET_LEN.load(Ordering::Relaxed);
    let target = if ptr.is_null() {
        "(no fuzz target running)"
    } else {
        // SAFETY: the pointer and length were stored together from a `&'static str`.
        unsafe { std::str::from_utf8_unchecked(std::slice::from_raw_parts(ptr, len)) }
    };
    let _ = write!(
        buf,
        "\nfuzz-support: refused an allocation of {size} bytes (limit {HARD_LIMIT}) in target '{target}', \
         seed {:#x}, case {} (u64::MAX: a regression or seed input); rerun with SEAM_FUZZ_SEED={:#x}\n",
        CURRENT_SEED.load(Ordering::Relaxed),
        CURRENT_CASE.load(Ordering::Relaxed),
        CURRENT_SEED.load(Ordering::Relaxed),
    );
    use std::io::Write as _;
    let _ = std::io::stderr().write_all(&buf.bytes[..buf.len]);
}

// SAFETY: every call is forwarded to `System` unchanged (or refused with null, which the
// `GlobalAlloc` contract allows); the counters are plain atomics.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > HARD_LIMIT {
            report_refusal(layout.size());
            return std::ptr::null_mut();
        }
        let p = System.alloc(layout);
        if !p.is_null() {
            record_alloc(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() > HARD_LIMIT {
            report_refusal(layout.size());
            return std::ptr::null_mut();
        }
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            record_alloc(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > HARD_LIMIT {
            report_refusal(new_size);
            return std::ptr::null_mut();
        }
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            if new_size >= layout.size() {
                record_alloc(new_size - layout.size());
                LARGEST.fetch_max(new_size, Ordering::Relaxed);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}

/// What [`CountingAllocator`] has counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes allocated and not yet freed.
    pub live: usize,
    /// The most bytes live at once since the last [`reset_peak`].
    pub peak: usize,
    /// The largest single allocation since the last [`reset_peak`].
    pub largest: usize,
}

/// The allocator's counters now.
pub fn memory() -> MemoryStats {
    MemoryStats {
        live: LIVE.load(Ordering::Relaxed),
        peak: PEAK.load(Ordering::Relaxed),
        largest: LARGEST.load(Ordering::Relaxed),
    }
}

/// Starts a new measurement: the peak becomes the bytes live now, the largest allocation 0.
pub fn reset_peak() {
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
    LARGEST.store(0, Ordering::Relaxed);
}

/// Whether [`CountingAllocator`] is this process's global allocator (it has counted something).
pub fn allocator_installed() -> bool {
    // Make sure at least one allocation has happened before asking.
    drop(std::hint::black_box(vec![0u8; 1]));
    INSTALLED.load(Ordering::Relaxed)
}

// ---------------------------------------------------------------------------------------------
// The runner
// ---------------------------------------------------------------------------------------------

/// A mutation: changes the input in place; the other argument is the target's seeds (to splice).
pub type Mutator = fn(&mut Rng, &mut Vec<u8>, &[Vec<u8>]);

/// How a target's inputs are mutated.
#[derive(Debug, Clone, Copy)]
pub enum InputKind {
    /// Binary files: [`mutate_bytes`] only.
    Binary,
    /// JSON (or JSON-like text): [`mutate_json`] most of the time, [`mutate_bytes`] otherwise.
    Json,
    /// A format-aware mutator of the target's own (which may call the ones above), for formats
    /// whose structure generic mutations rarely keep intact, such as a length-prefixed header.
    Custom(Mutator),
}

/// One fuzz target: a name, where its regression inputs live, how many cases to run, and the
/// memory a single input may make the process allocate.
#[derive(Debug, Clone)]
pub struct Fuzz {
    name: &'static str,
    regressions: PathBuf,
    extension: &'static str,
    kind: InputKind,
    default_cases: usize,
    memory_base: usize,
    memory_per_input_byte: usize,
    max_case_time: Duration,
}

/// Mutated inputs that a check accepted are kept to mutate further (they reach deeper code than
/// the seeds' first mutations do); this many at most.
const POOL_SIZE: usize = 64;
/// A run stops collecting after this many failing inputs (they are usually one bug).
const MAX_FAILURES: usize = 8;

/// The panic messages (with location) of the current case, recorded by the hook [`Fuzz::run`]
/// installs instead of printing them: a run reports them once, in its summary.
static PANIC_MESSAGE: Mutex<Option<String>> = Mutex::new(None);
/// One target at a time per process: the memory counters are process-wide, so two targets
/// running on parallel test threads would be charged each other's allocations.
static RUN_LOCK: Mutex<()> = Mutex::new(());

thread_local! {
    /// Whether this thread is inside a case, where panics are recorded rather than printed.
    static IN_CASE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn install_panic_hook() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !IN_CASE.with(|c| c.get()) {
                return default(info);
            }
            let backtrace = std::backtrace::Backtrace::capture();
            let mut message = info.to_string();
            if backtrace.status() == std::backtrace::BacktraceStatus::Captured {
                // The frames nearest the panic; the rest is the runner and the test harness.
                let text = backtrace.to_string();
                let frames: Vec<&str> = text.lines().take(40).collect();
                let _ = write!(message, "\n{}", frames.join("\n"));
            }
            *PANIC_MESSAGE.lock().unwrap_or_else(|e| e.into_inner()) = Some(message);
        }));
    });
}

/// FNV-1a: names a regression file by its content, so the same input is never saved twice.
fn content_hash(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

fn env_number(name: &str) -> Option<u64> {
    let text = std::env::var(name).ok()?;
    let text = text.trim().replace('_', "");
    if name == "SEAM_FUZZ_SEED" && text == "random" {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        return Some(nanos.as_nanos() as u64 ^ std::process::id() as u64);
    }
    let parsed = match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => text.parse(),
    };
    Some(parsed.unwrap_or_else(|_| panic!("{name}={text:?} is not a number")))
}

/// What one input cost: bytes allocated at peak beyond those live before it, and time.
struct Cost {
    memory: usize,
    time: Duration,
}

/// The outcome of one input.
enum Verdict {
    Ok { accepted: bool },
    Failed(String),
}

impl Fuzz {
    /// A target called `name` whose regression inputs live in
    /// `<manifest_dir>/tests/fuzz-regressions/<name>/` (pass `env!("CARGO_MANIFEST_DIR")`).
    ///
    /// Defaults: binary inputs, 1000 cases, a memory bound of 64 MiB plus 64 bytes per input byte
    /// (see [`Fuzz::memory_bound`]), 10 s per case.
    pub fn new(name: &'static str, manifest_dir: &str) -> Fuzz {
        Fuzz {
            name,
            regressions: Path::new(manifest_dir).join("tests").join("fuzz-regressions").join(name),
            extension: "bin",
            kind: InputKind::Binary,
            default_cases: 1000,
            memory_base: 64 << 20,
            memory_per_input_byte: 64,
            max_case_time: Duration::from_secs(10),
        }
    }

    /// The file extension of saved failing inputs (`gguf`, `json`, ...).
    pub fn extension(mut self, extension: &'static str) -> Fuzz {
        self.extension = extension;
        self
    }

    /// How inputs are mutated.
    pub fn kind(mut self, kind: InputKind) -> Fuzz {
        self.kind = kind;
        self
    }

    /// Mutated cases run by default (`SEAM_FUZZ_CASES` overrides it).
    pub fn cases(mut self, cases: usize) -> Fuzz {
        self.default_cases = cases;
        self
    }

    /// The most bytes one input may make the process allocate beyond what was live before it:
    /// `base + per_input_byte * input length`, checked for the peak of live bytes during the case.
    pub fn memory_bound(mut self, base: usize, per_input_byte: usize) -> Fuzz {
        self.memory_base = base;
        self.memory_per_input_byte = per_input_byte;
        self
    }

    /// The longest one case may take before it counts as a hang.
    pub fn max_case_time(mut self, limit: Duration) -> Fuzz {
        self.max_case_time = limit;
        self
    }

    /// The directory of this target's regression inputs.
    pub fn regression_dir(&self) -> &Path {
        &self.regressions
    }

    fn regression_inputs(&self) -> Vec<(PathBuf, Vec<u8>)> {
        let Ok(entries) = std::fs::read_dir(&self.regressions) else { return Vec::new() };
        let mut paths: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file())
            .filter(|p| {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                !name.starts_with('.') && !name.ends_with(".md")
            })
            .collect();
        paths.sort();
        paths
            .into_iter()
            .map(|p| {
                let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
                (p, bytes)
            })
            .collect()
    }

    fn check_one(&self, input: &[u8], check: &mut dyn FnMut(&[u8]) -> bool) -> (Verdict, Cost) {
        *PANIC_MESSAGE.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let before = memory().live;
        reset_peak();
        let start = Instant::now();
        IN_CASE.with(|c| c.set(true));
        let result = catch_unwind(AssertUnwindSafe(|| check(input)));
        IN_CASE.with(|c| c.set(false));
        let elapsed = start.elapsed();
        let stats = memory();
        let extra = stats.peak.saturating_sub(before);
        let bound = self.memory_base.saturating_add(self.memory_per_input_byte.saturating_mul(input.len()));
        let verdict = match result {
            Err(payload) => {
                let recorded = PANIC_MESSAGE.lock().unwrap_or_else(|e| e.into_inner()).take();
                let message = recorded.unwrap_or_else(|| {
                    payload
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| payload.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "a panic with a non-string payload".into())
                });
                Verdict::Failed(format!("panic: {message}"))
            }
            Ok(_) if extra > bound => Verdict::Failed(format!(
                "memory: the input ({} bytes) made the process allocate {extra} bytes at peak \
                 (largest single allocation {}), above the bound of {bound}",
                input.len(),
                stats.largest
            )),
            Ok(_) if elapsed > self.max_case_time => {
                Verdict::Failed(format!("time: the input took {elapsed:?}, above {:?}", self.max_case_time))
            }
            Ok(accepted) => Verdict::Ok { accepted },
        };
        (verdict, Cost { memory: extra, time: elapsed })
    }

    fn save(&self, input: &[u8]) -> PathBuf {
        let path = self.regressions.join(format!("{:016x}.{}", content_hash(input), self.extension));
        if !path.exists() {
            std::fs::create_dir_all(&self.regressions)
                .and_then(|()| std::fs::write(&path, input))
                .unwrap_or_else(|e| panic!("saving a failing input to {}: {e}", path.display()));
        }
        path
    }

    /// Runs the target: every regression input, then every seed as it is, then the mutated cases.
    /// `check` parses one input and asserts what must hold of the result (it panics otherwise);
    /// it returns whether the input was accepted as valid, and accepted mutants are mutated further.
    ///
    /// An input that panics, exceeds the memory bound or the time limit is saved under the
    /// regression directory (named by its hash) and the run fails at the end, naming the files,
    /// the seed and the case count so that the run can be repeated.
    pub fn run(self, seeds: Vec<Vec<u8>>, mut check: impl FnMut(&[u8]) -> bool) {
        assert!(!seeds.is_empty(), "fuzz target '{}' has no seeds", self.name);
        let _serial = RUN_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        assert!(
            allocator_installed(),
            "fuzz target '{}': declare `#[global_allocator] static A: fuzz_support::CountingAllocator = \
             fuzz_support::CountingAllocator;` in the test binary, or memory cannot be bounded",
            self.name
        );
        install_panic_hook();
        let cases = env_number("SEAM_FUZZ_CASES").map_or(self.default_cases, |n| n as usize);
        let seed = env_number("SEAM_FUZZ_SEED").unwrap_or(DEFAULT_SEED);
        CURRENT_TARGET_PTR.store(self.name.as_ptr() as *mut u8, Ordering::Relaxed);
        CURRENT_TARGET_LEN.store(self.name.len(), Ordering::Relaxed);
        CURRENT_SEED.store(seed, Ordering::Relaxed);
        CURRENT_CASE.store(u64::MAX, Ordering::Relaxed);

        let started = Instant::now();
        let mut failures: Vec<String> = Vec::new();
        let mut worst_memory = 0usize;
        let mut slowest = Duration::ZERO;

        let regressions = self.regression_inputs();
        for (path, input) in &regressions {
            if let (Verdict::Failed(message), _) = self.check_one(input, &mut check) {
                failures.push(format!("regression input {}: {message}", path.display()));
            }
        }

        // A known failure would dominate the mutated cases too, and save another copy of itself
        // under a new name on every run: until the regressions pass, only they run.
        let fuzz = failures.is_empty();
        let (seeds_to_check, cases_to_run) = if fuzz { (&seeds[..], cases) } else { (&[][..], 0) };

        let max_len = seeds.iter().map(Vec::len).max().unwrap_or(0).saturating_mul(4).max(64 << 10);
        let mut pool: Vec<Vec<u8>> = Vec::new();
        for input in seeds_to_check {
            match self.check_one(input, &mut check).0 {
                Verdict::Failed(message) => {
                    failures.push(format!("seed input, saved as {}: {message}", self.save(input).display()));
                }
                Verdict::Ok { accepted: false } => {
                    panic!("fuzz target '{}': a seed input is rejected; the seeds must be valid inputs", self.name)
                }
                Verdict::Ok { accepted: true } => {}
            }
        }

        let mut accepted_count = 0usize;
        let mut cases_run = 0usize;
        for case in 0..cases_to_run {
            if failures.len() >= MAX_FAILURES {
                break;
            }
            cases_run += 1;
            CURRENT_CASE.store(case as u64, Ordering::Relaxed);
            let mut rng = Rng::new(seed ^ (case as u64).wrapping_mul(0xD134_2543_DE82_EF95));
            let mut input =
                if !pool.is_empty() && rng.chance(1, 3) { rng.pick(&pool).clone() } else { rng.pick(&seeds).clone() };
            let rounds = if rng.chance(1, 8) { 1 + rng.below(16) } else { 1 + rng.below(3) };
            for _ in 0..rounds {
                match self.kind {
                    InputKind::Json if rng.chance(3, 4) => mutate_json(&mut rng, &mut input, &seeds),
                    InputKind::Custom(mutate) => mutate(&mut rng, &mut input, &seeds),
                    _ => mutate_bytes(&mut rng, &mut input, &seeds),
                }
                input.truncate(max_len);
            }
            let (verdict, cost) = self.check_one(&input, &mut check);
            slowest = slowest.max(cost.time);
            worst_memory = worst_memory.max(cost.memory);
            match verdict {
                Verdict::Failed(message) => {
                    failures.push(format!("case {case}, saved as {}: {message}", self.save(&input).display()));
                }
                Verdict::Ok { accepted: true } => {
                    accepted_count += 1;
                    if pool.len() < POOL_SIZE {
                        pool.push(input);
                    } else {
                        let slot = rng.below(POOL_SIZE);
                        pool[slot] = input;
                    }
                }
                Verdict::Ok { accepted: false } => {}
            }
        }
        CURRENT_CASE.store(u64::MAX, Ordering::Relaxed);
        CURRENT_TARGET_PTR.store(std::ptr::null_mut(), Ordering::Relaxed);

        eprintln!(
            "fuzz {}: {} regression inputs, {} seeds, {cases_run} cases from seed {seed:#x} in {:.1?}; \
             {accepted_count} mutants accepted; slowest case {slowest:.1?}; most bytes one case allocated at peak {worst_memory}",
            self.name,
            regressions.len(),
            seeds.len(),
            started.elapsed(),
        );
        if !failures.is_empty() {
            panic!(
                "fuzz target '{}' failed on {} input(s) (SEAM_FUZZ_SEED={seed:#x} SEAM_FUZZ_CASES={cases}); each \
                 is saved as a regression case, commit it with the fix{}:\n\n{}",
                self.name,
                failures.len(),
                if fuzz { "" } else { " (no mutated cases ran: regression inputs fail)" },
                failures.join("\n\n")
            );
        }
    }
}
