//! Scratch buffers shared by every thread that calls the kernels.
//!
//! A thread-local buffer grows to the largest call its thread ever made and stays there; a
//! runtime that calls the kernels from many threads of its own (XLA runs custom calls on whichever
//! of its threads executes the graph) would then hold one large buffer per thread, and its
//! resident memory would creep up as more of its threads meet a long prefill. A shared free list
//! holds as many buffers as calls ever ran at once, whichever threads made them.

use std::sync::Mutex;

/// A free list of `T`s: [`Scratch::with`] lends one (or a new default one) for the length of a
/// closure and takes it back after.
pub(crate) struct Scratch<T> {
    free: Mutex<Vec<T>>,
}

impl<T: Default> Scratch<T> {
    pub(crate) const fn new() -> Scratch<T> {
        Scratch { free: Mutex::new(Vec::new()) }
    }

    /// Runs `f` with a buffer of the list, returned to it afterwards (not after a panic: the
    /// buffer is then dropped, which is harmless).
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        let mut item = self.lock().pop().unwrap_or_default();
        let result = f(&mut item);
        self.lock().push(item);
        result
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<T>> {
        // A panic while the lock is held cannot leave the list inconsistent (push and pop only).
        self.free.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
