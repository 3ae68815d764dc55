//! A persistent pool of worker threads for the kernels: one call splits into numbered tasks that
//! the caller and the workers take in turn.
//!
//! Why not rayon or a fresh scope per call: a decode step makes a few hundred kernel calls of tens
//! of microseconds each, so waking workers must cost about a microsecond, not the tens that a
//! futex wake-up or a thread spawn costs. Workers spin for a short while after each call (the next
//! call usually follows within microseconds) and only then sleep on a condition variable.
//!
//! One call runs on the pool at a time. A call made while another holds the pool (two sessions
//! stepping at once, or a runtime running two kernels side by side) runs on its own thread
//! instead of waiting: correct, and no slower than the serial work it is.

use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The environment variable that sets the number of threads a call uses (the caller included);
/// by default the machine's available parallelism.
pub const THREADS_ENV: &str = "SEAM_CPU_THREADS";

/// How long an idle worker spins before it sleeps.
const SPIN: Duration = Duration::from_micros(200);

// The call being run is one word: its sequence number (24 bits), its task count (20 bits) and the
// next task to hand out (20 bits). Taking a task is one compare-and-swap that also proves the call
// is still the one the taker read, so a worker that wakes late can never run a task of a call
// that has finished.
const INDEX_BITS: u32 = 20;
const MAX_TASKS: usize = (1 << INDEX_BITS) - 1;
const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;

fn pack(seq: u64, tasks: usize, next: usize) -> u64 {
    (seq << (2 * INDEX_BITS)) | ((tasks as u64) << INDEX_BITS) | next as u64
}

fn unpack(word: u64) -> (u64, usize, usize) {
    (word >> (2 * INDEX_BITS), ((word >> INDEX_BITS) & INDEX_MASK) as usize, (word & INDEX_MASK) as usize)
}

type Task<'a> = dyn Fn(usize) + Sync + 'a;

struct Shared {
    /// The current call (see `pack`).
    call: AtomicU64,
    /// The current call's function: a pointer to a `&Task` on the caller's stack, valid while the
    /// call has unfinished tasks.
    task: AtomicPtr<&'static Task<'static>>,
    /// Tasks of the current call finished so far.
    done: AtomicUsize,
    /// Workers asleep on `wake`.
    sleeping: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

/// A pool of `threads - 1` workers plus the calling thread.
pub struct Pool {
    shared: Arc<Shared>,
    threads: usize,
    /// Held by the call running on the pool.
    busy: Mutex<()>,
}

impl Pool {
    /// A pool whose calls use `threads` threads (the caller and `threads - 1` workers).
    pub fn new(threads: usize) -> Pool {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            call: AtomicU64::new(0),
            task: AtomicPtr::new(std::ptr::null_mut()),
            done: AtomicUsize::new(0),
            sleeping: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        for i in 1..threads {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("seam-kernels-{i}"))
                .spawn(move || worker(&shared))
                .expect("spawning a kernel worker thread");
        }
        Pool { shared, threads, busy: Mutex::new(()) }
    }

    /// The process's pool: [`THREADS_ENV`] threads, else the available parallelism.
    pub fn global() -> &'static Pool {
        static POOL: OnceLock<Pool> = OnceLock::new();
        POOL.get_or_init(|| {
            let from_env = std::env::var(THREADS_ENV).ok().and_then(|v| v.parse::<usize>().ok()).filter(|&n| n > 0);
            let threads =
                from_env.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
            Pool::new(threads)
        })
    }

    /// Threads a call uses, the caller included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f(0..tasks)`, each index exactly once, on the pool; returns when all have run.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks == 0 {
            return;
        }
        let guard = if self.threads > 1 && tasks > 1 && tasks <= MAX_TASKS { self.busy.try_lock().ok() } else { None };
        let Some(_guard) = guard else {
            (0..tasks).for_each(f);
            return;
        };
        let shared = &*self.shared;
        // SAFETY of the lifetime erasure: workers dereference `task` only after taking a task of
        // this call, and this function does not return until every task has finished.
        let task: &'static Task<'static> = unsafe { std::mem::transmute::<&Task<'_>, &'static Task<'static>>(f) };
        let slot = &task as *const &'static Task<'static> as *mut &'static Task<'static>;
        shared.done.store(0, Ordering::Relaxed);
        shared.task.store(slot, Ordering::Release);
        let (seq, _, _) = unpack(shared.call.load(Ordering::Relaxed));
        let seq = (seq + 1) & ((1 << (64 - 2 * INDEX_BITS)) - 1);
        shared.call.store(pack(seq, tasks, 0), Ordering::SeqCst);
        if shared.sleeping.load(Ordering::SeqCst) > 0 {
            let _lock = shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            shared.wake.notify_all();
        }
        take_tasks(shared, seq);
        while shared.done.load(Ordering::Acquire) < tasks {
            std::hint::spin_loop();
        }
    }
}

/// Takes and runs tasks of call `seq` until none is left; returns how many it ran.
fn take_tasks(shared: &Shared, seq: u64) -> usize {
    let mut ran = 0;
    loop {
        let word = shared.call.load(Ordering::Acquire);
        let (s, tasks, next) = unpack(word);
        if s != seq || next >= tasks {
            return ran;
        }
        let task = shared.task.load(Ordering::Acquire);
        if shared.call.compare_exchange_weak(word, word + 1, Ordering::AcqRel, Ordering::Relaxed).is_err() {
            continue;
        }
        // SAFETY: the task index was taken from call `seq`, which cannot finish before this task
        // does, so its caller is still waiting and `task` (stored before the call was published)
        // still points at its function.
        let f = unsafe { *task };
        f(next);
        shared.done.fetch_add(1, Ordering::Release);
        ran += 1;
    }
}

fn worker(shared: &Shared) {
    let mut seen = unpack(shared.call.load(Ordering::Acquire)).0;
    loop {
        let started = Instant::now();
        let mut spins = 0u32;
        let seq = loop {
            let (seq, _, _) = unpack(shared.call.load(Ordering::Acquire));
            if seq != seen {
                break seq;
            }
            spins += 1;
            if spins.is_multiple_of(256) && started.elapsed() > SPIN {
                let mut lock = shared.lock.lock().unwrap_or_else(|e| e.into_inner());
                shared.sleeping.fetch_add(1, Ordering::SeqCst);
                while unpack(shared.call.load(Ordering::SeqCst)).0 == seen {
                    lock = shared.wake.wait(lock).unwrap_or_else(|e| e.into_inner());
                }
                shared.sleeping.fetch_sub(1, Ordering::SeqCst);
                drop(lock);
                break unpack(shared.call.load(Ordering::Acquire)).0;
            }
            std::hint::spin_loop();
        };
        seen = seq;
        take_tasks(shared, seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_task_runs_exactly_once() {
        let pool = Pool::new(3);
        for tasks in [1usize, 2, 3, 7, 64, 1000] {
            let counts: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            pool.run(tasks, &|i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1), "{tasks} tasks");
        }
    }

    #[test]
    fn concurrent_callers_and_sleeping_workers() {
        let pool = Pool::new(2);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    for round in 0..200 {
                        let sum = AtomicUsize::new(0);
                        pool.run(17, &|i| {
                            sum.fetch_add(i, Ordering::Relaxed);
                        });
                        assert_eq!(sum.load(Ordering::Relaxed), 136);
                        if round % 50 == 0 {
                            // Long enough for the worker to go to sleep.
                            std::thread::sleep(Duration::from_millis(2));
                        }
                    }
                });
            }
        });
    }
}
