//! IREE statuses as Rust errors.

use crate::sys;

/// A failure of the IREE runtime: what seam was doing, and IREE's own message (status code,
/// source location and annotations, as `iree_status_format` writes them).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Error(pub String);

/// This crate's result.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn new(message: impl Into<String>) -> Error {
        Error(message.into())
    }
}

/// `Ok` for an OK status; otherwise the status's message, prefixed with `what` (the status is
/// consumed either way).
pub(crate) fn check(status: sys::iree_status_t, what: &str) -> Result<()> {
    if status.is_null() {
        return Ok(());
    }
    Err(Error(format!("{what}: {}", consume(status))))
}

/// The message of a non-OK `status`, which is freed.
fn consume(status: sys::iree_status_t) -> String {
    let mut length = 0usize;
    // SAFETY: a first call with no buffer asks for the length only.
    let sized = unsafe { sys::iree_status_format(status, 0, std::ptr::null_mut(), &mut length) };
    let message = if sized {
        let mut buffer = vec![0u8; length + 1];
        let mut written = 0usize;
        // SAFETY: `buffer` has room for `length` bytes and the terminating NUL.
        let ok = unsafe { sys::iree_status_format(status, buffer.len(), buffer.as_mut_ptr().cast(), &mut written) };
        if ok {
            buffer.truncate(written.min(length));
            String::from_utf8_lossy(&buffer).into_owned()
        } else {
            format!("IREE status code {}", status_code(status))
        }
    } else {
        format!("IREE status code {}", status_code(status))
    };
    // SAFETY: `status` is a non-OK status owned here; freed exactly once.
    unsafe { sys::iree_status_free(status) };
    message
}

/// The code of a status: its low bits, as IREE packs it (`iree_status_code`).
fn status_code(status: sys::iree_status_t) -> usize {
    (status as usize) & 0x1F
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ok_status_is_ok_and_a_code_is_an_error() {
        assert!(check(std::ptr::null_mut(), "nothing").is_ok());
        // A bare code (no allocated payload) is a valid status: INVALID_ARGUMENT is 3.
        let err = check(3usize as sys::iree_status_t, "trying").unwrap_err();
        assert!(err.0.starts_with("trying: "), "{err}");
        assert!(err.0.to_ascii_uppercase().contains("INVALID_ARGUMENT"), "{err}");
    }
}
