//! Scratch buffers shared by every thread that calls the kernels.
//!
//! A thread-local buffer grows to the largest call its thread ever made and stays there; a
//! runtime that calls the kernels from many threads of its own (XLA runs custom calls on whichever
//! of its threads executes the graph) would then hold one large buffer per thread, and its
//! resident memory would creep up as more of its threads meet a long prefill. A shared free list
//! holds as many buffers as calls ever ran at once, whichever threads made them.
//!
//! One list alone is a lock that every call takes twice, and IREE calls the kernels once per
//! workgroup from each of its workers: the lock's cache line then moves between the cores on
//! every call. So each thread first tries a home slot of its own ([`SLOTS`] of them, threads
//! numbered in turn), which stays in that thread's cache; the shared list takes what a slot
//! cannot (a slot in use, or shared by two threads past the first [`SLOTS`]). The buffers held
//! are still at most the calls ever made at once plus one per slot.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Home slots per scratch: more than the threads that call the kernels at once on most
/// machines, few enough that idle slots cost little.
const SLOTS: usize = 16;

/// A slot on a cache line of its own, so that two threads' slots never share one.
#[repr(align(128))]
struct Slot<T>(Mutex<Option<T>>);

/// A free list of `T`s: [`Scratch::with`] lends one (or a new default one) for the length of a
/// closure and takes it back after.
pub(crate) struct Scratch<T> {
    slots: [Slot<T>; SLOTS],
    free: Mutex<Vec<T>>,
}

/// This thread's home slot, numbered when it first asks.
fn home() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static HOME: usize = NEXT.fetch_add(1, Ordering::Relaxed) % SLOTS;
    }
    HOME.with(|h| *h)
}

impl<T: Default> Scratch<T> {
    pub(crate) const fn new() -> Scratch<T> {
        Scratch { slots: [const { Slot(Mutex::new(None)) }; SLOTS], free: Mutex::new(Vec::new()) }
    }

    /// Runs `f` with a buffer (this thread's home slot's, else one of the list's, else a new
    /// default one), returned afterwards to the home slot if it is empty, else to the list (not
    /// after a panic: the buffer is then dropped, which is harmless).
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        let slot = &self.slots[home()].0;
        // A slot another thread holds (two threads sharing it) is passed over, not waited on.
        let mine = slot.try_lock().ok().and_then(|mut held| held.take());
        let mut item = match mine {
            Some(item) => item,
            None => lock(&self.free).pop().unwrap_or_default(),
        };
        let result = f(&mut item);
        match slot.try_lock() {
            Ok(mut held) if held.is_none() => *held = Some(item),
            _ => lock(&self.free).push(item),
        }
        result
    }
}

fn lock<V>(mutex: &Mutex<V>) -> std::sync::MutexGuard<'_, V> {
    // A panic while the lock is held cannot leave a slot or the list inconsistent (they only
    // take and put whole buffers).
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::Scratch;

    #[test]
    fn a_thread_gets_its_own_buffer_back() {
        static S: Scratch<Vec<u8>> = Scratch::new();
        S.with(|b| b.push(7));
        assert_eq!(S.with(|b| b.clone()), vec![7]);
    }

    #[test]
    fn nested_calls_get_distinct_buffers_and_keep_both() {
        static S: Scratch<Vec<u8>> = Scratch::new();
        S.with(|outer| {
            outer.push(1);
            S.with(|inner| {
                assert!(inner.is_empty(), "the inner call must not see the outer call's buffer");
                inner.push(2);
            });
        });
        // One buffer went back to the home slot, the other to the shared list: both are kept.
        let mut seen = vec![S.with(|b| b.clone())];
        S.with(|a| S.with(|b| seen.extend([a.clone(), b.clone()])));
        seen.sort();
        assert!(seen.contains(&vec![1]) && seen.contains(&vec![2]), "{seen:?}");
    }

    #[test]
    fn many_threads_at_once() {
        static S: Scratch<Vec<usize>> = Scratch::new();
        std::thread::scope(|scope| {
            for t in 0..40 {
                scope.spawn(move || {
                    for _ in 0..200 {
                        S.with(|b| {
                            b.clear();
                            b.extend(std::iter::repeat_n(t, 64));
                            assert!(b.iter().all(|&v| v == t), "two threads shared a buffer");
                        });
                    }
                });
            }
        });
    }
}
