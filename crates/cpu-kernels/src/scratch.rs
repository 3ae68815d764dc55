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
//! cannot (a slot in use, or shared by two threads past the first [`SLOTS`]). Only small buffers
//! (a decode step's, up to [`SLOT_MAX_BYTES`]) stay in a slot: a buffer grown by a long call
//! first gives back what its last call did not use, and one still large (its last call was a
//! prefill's) goes back to the list. A thread thus keeps at most one small buffer per scratch,
//! and the list at most one large buffer per call that ran at once plus one per thread whose slot
//! buffer grew in a long call.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Home slots per scratch: more than the threads that call the kernels at once on most
/// machines, few enough that idle slots cost little.
const SLOTS: usize = 16;

/// The largest buffer a home slot keeps, in bytes: a few decode tokens' preparations of a model
/// of SmolLM2's size fit; a prefill chunk's do not.
const SLOT_MAX_BYTES: usize = 256 << 10;

/// The heap memory a scratch buffer holds, for [`SLOT_MAX_BYTES`].
pub(crate) trait Footprint {
    /// Bytes allocated (capacities, not lengths: what the buffer keeps).
    fn bytes(&self) -> usize;
    /// Gives back what the last call did not use (capacities down to lengths).
    fn shrink(&mut self);
}

impl<T> Footprint for Vec<T> {
    fn bytes(&self) -> usize {
        self.capacity() * std::mem::size_of::<T>()
    }
    fn shrink(&mut self) {
        self.shrink_to_fit();
    }
}

/// [`Footprint`] for a struct of buffers: the sum of its fields' footprints.
macro_rules! footprint {
    ($type:ty: $($field:ident),+) => {
        impl $crate::scratch::Footprint for $type {
            fn bytes(&self) -> usize {
                0 $(+ $crate::scratch::Footprint::bytes(&self.$field))+
            }
            fn shrink(&mut self) {
                $($crate::scratch::Footprint::shrink(&mut self.$field);)+
            }
        }
    };
}
pub(crate) use footprint;

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

impl<T: Default + Footprint> Scratch<T> {
    pub(crate) const fn new() -> Scratch<T> {
        Scratch { slots: [const { Slot(Mutex::new(None)) }; SLOTS], free: Mutex::new(Vec::new()) }
    }

    /// Runs `f` with a buffer (this thread's home slot's, else one of the list's, else a new
    /// default one), returned afterwards to the home slot if it is empty and the buffer small,
    /// else to the list (not after a panic: the buffer is then dropped, which is harmless).
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        let slot = &self.slots[home()].0;
        // A slot another thread holds (two threads sharing it) is passed over, not waited on.
        let mine = slot.try_lock().ok().and_then(|mut held| held.take());
        let mut item = match mine {
            Some(item) => item,
            None => lock(&self.free).pop().unwrap_or_default(),
        };
        let result = f(&mut item);
        // A buffer grown by an earlier long call keeps only what this call used before it may
        // stay in a slot: one realloc when the next long call comes, against a thread holding a
        // prefill's buffers for good.
        if item.bytes() > SLOT_MAX_BYTES {
            item.shrink();
        }
        let small = item.bytes() <= SLOT_MAX_BYTES;
        match slot.try_lock() {
            Ok(mut held) if small && held.is_none() => *held = Some(item),
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
    fn a_large_buffer_goes_back_to_the_shared_list() {
        static S: Scratch<Vec<u8>> = Scratch::new();
        S.with(|b| b.resize(super::SLOT_MAX_BYTES + 1, 1));
        assert!(S.slots.iter().all(|slot| slot.0.lock().unwrap().is_none()), "a slot kept a large buffer");
        assert_eq!(S.free.lock().unwrap().len(), 1);
        // And it is lent again from there.
        assert_eq!(S.with(|b| b.len()), super::SLOT_MAX_BYTES + 1);
    }

    #[test]
    fn a_grown_buffer_is_shrunk_to_its_last_use_before_a_slot_keeps_it() {
        static S: Scratch<Vec<u8>> = Scratch::new();
        S.with(|b| b.resize(super::SLOT_MAX_BYTES + 1, 1));
        S.with(|b| b.truncate(16));
        let kept =
            S.slots.iter().filter_map(|slot| slot.0.lock().unwrap().as_ref().map(|b| b.capacity())).collect::<Vec<_>>();
        assert_eq!(kept, vec![16], "the slot must keep the buffer, shrunk");
        assert!(S.free.lock().unwrap().is_empty());
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
