//! A fence around the `tokenizers` crate: a malformed `tokenizer.json` can make it panic (at load
//! on a broken `decoder` section, at encode on a post-processor naming a missing token, at decode
//! on an inconsistent `Strip` decoder; found by this crate's fuzz test). A user's bad file must be
//! a typed error, so every call into it runs under [`guarded`].

use std::cell::Cell;
use std::panic::AssertUnwindSafe;
use std::sync::Once;

thread_local! {
    /// Whether this thread is inside [`guarded`], where a panic is an expected outcome.
    static GUARDED: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f`, returning the panic's message as an error if it panics. The process's panic hook
/// stays in place, except that it stays silent for a panic caught here (it would otherwise print
/// "panicked at ..." for what is reported as an ordinary error).
pub(crate) fn guarded<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    static QUIET_HOOK: Once = Once::new();
    QUIET_HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !GUARDED.with(Cell::get) {
                previous(info);
            }
        }));
    });
    let was = GUARDED.with(|g| g.replace(true));
    let result = std::panic::catch_unwind(AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(was));
    result.map_err(|payload| {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "an internal error".into());
        format!("the tokenizer library failed on this file: {message}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_its_message() {
        assert_eq!(guarded(|| 7), Ok(7));
        let err = guarded(|| -> u32 { panic!("no entry found for key") }).unwrap_err();
        assert!(err.contains("no entry found for key"), "{err}");
        let err = guarded(|| -> u32 { panic!("{}", String::from("owned")) }).unwrap_err();
        assert!(err.contains("owned"), "{err}");
    }
}
