//! Zeros for a new large buffer of host memory, paid for as it is used.
//!
//! A KV cache holds every position its context allows, but a conversation fills only the first
//! ones. Copying or writing zeros into a new cache touches every page of it before the first
//! token: a page fault and a page of zeros per 4 KiB of context. On Linux, private anonymous
//! memory (what `malloc` and the runtimes' allocators hand out) reads as zeros once its pages are
//! given back with `MADV_DONTNEED`, and the system maps a zero page only where the memory is next
//! touched. [`zero`] does that where it can and writes zeros elsewhere, so a new cache costs what
//! its session uses.
//!
//! It is for memory used from scratch. Memory reused soon after (a closed session's cache for
//! the next one) is cheaper to write over: its pages stay mapped, where given back they would
//! fault again one by one as the next session touches them.

#[cfg(target_os = "linux")]
use std::io;

/// Below this size the bytes are written: a system call and the refaults would cost more.
const RETURN_PAGES_FROM: usize = 256 << 10;

/// How [`zero`] zeroed a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Zeroed {
    /// Zeros were written over every byte.
    Written,
    /// The whole pages inside the buffer were given back to the system (they read as zeros and
    /// are mapped again when touched); zeros were written over the partial pages at its ends.
    PagesReturned,
}

/// Sets `len` bytes at `address` to zero, giving whole pages back to the system where the memory
/// is private and anonymous (see the crate's documentation) and writing zeros otherwise.
///
/// # Safety
/// The `len` bytes at `address` must be memory this process may write, used by nothing else
/// during the call (no computation reading or writing them), and not borrowed by Rust code.
pub unsafe fn zero(address: *mut u8, len: usize) -> Zeroed {
    // SAFETY: forwarded from the caller.
    if len >= RETURN_PAGES_FROM && unsafe { return_pages(address, len) } {
        return Zeroed::PagesReturned;
    }
    // SAFETY: by the caller's promise the bytes are writable and unused meanwhile.
    unsafe { std::ptr::write_bytes(address, 0, len) };
    Zeroed::Written
}

/// `MADV_DONTNEED` over the whole pages inside the buffer and zeros over the partial ones at its
/// ends, where every page lies in a private anonymous mapping; false (nothing changed) elsewhere.
#[cfg(target_os = "linux")]
unsafe fn return_pages(address: *mut u8, len: usize) -> bool {
    // SAFETY: sysconf takes no pointers.
    let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        size if size > 0 => size as usize,
        _ => return false,
    };
    let start = address as usize;
    let Some(end) = start.checked_add(len) else { return false };
    let (first, last) = (start.next_multiple_of(page), end / page * page);
    if first >= last {
        return false;
    }
    match private_anonymous(first, last) {
        Ok(true) => {}
        _ => return false,
    }
    // SAFETY: [first, last) lies inside the caller's buffer and in private anonymous mappings,
    // which read as zeros after MADV_DONTNEED; nothing else uses the bytes now.
    if unsafe { libc::madvise(first as *mut libc::c_void, last - first, libc::MADV_DONTNEED) } != 0 {
        // Locked pages, say: nothing was given back.
        return false;
    }
    // SAFETY: the partial pages at the ends lie inside the caller's buffer.
    unsafe {
        std::ptr::write_bytes(address, 0, first - start);
        std::ptr::write_bytes(last as *mut u8, 0, end - last);
    }
    true
}

#[cfg(not(target_os = "linux"))]
unsafe fn return_pages(_address: *mut u8, _len: usize) -> bool {
    // Elsewhere MADV_DONTNEED may keep the contents.
    false
}

/// Whether every byte of [first, last) lies in private anonymous mappings of this process
/// (`/proc/self/maps`: private, and no file behind it), where `MADV_DONTNEED` leaves zeros.
#[cfg(target_os = "linux")]
fn private_anonymous(first: usize, last: usize) -> io::Result<bool> {
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    Ok(covered_by_private_anonymous(&maps, first, last))
}

/// [`private_anonymous`] over the text of a maps file.
fn covered_by_private_anonymous(maps: &str, first: usize, last: usize) -> bool {
    let mut covered = first;
    for line in maps.lines() {
        // "start-end perms offset dev inode [path]"
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms), Some(_offset), Some(_dev), Some(inode)) =
            (fields.next(), fields.next(), fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let Some((from, to)) = range.split_once('-') else { continue };
        let (Ok(from), Ok(to)) = (usize::from_str_radix(from, 16), usize::from_str_radix(to, 16)) else {
            continue;
        };
        if to <= covered || from > covered {
            // The file lists mappings in address order: one that starts past `covered` leaves a gap.
            if from > covered {
                return false;
            }
            continue;
        }
        let private = perms.as_bytes().get(3) == Some(&b'p') && perms.as_bytes().get(1) == Some(&b'w');
        if !private || inode != "0" {
            return false;
        }
        covered = to;
        if covered >= last {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/seam
7f0000000000-7f0000100000 rw-p 00000000 00:00 0
7f0000100000-7f0000200000 rw-p 00000000 00:00 0 [heap]
7f0000200000-7f0000300000 rw-s 00000000 00:01 4242 /dev/zero (deleted)
7f0000300000-7f0000400000 rw-p 00000000 08:02 99 /data/file
7f0000500000-7f0000600000 rw-p 00000000 00:00 0
";

    #[test]
    fn only_private_anonymous_mappings_without_gaps_qualify() {
        let covered = |a: usize, b: usize| covered_by_private_anonymous(MAPS, a, b);
        assert!(covered(0x7f0000000000, 0x7f0000100000));
        assert!(covered(0x7f0000080000, 0x7f0000180000), "two adjacent anonymous mappings");
        assert!(!covered(0x7f0000180000, 0x7f0000280000), "runs into a shared mapping");
        assert!(!covered(0x7f0000300000, 0x7f0000310000), "a private file mapping");
        assert!(!covered(0x7f0000480000, 0x7f0000510000), "starts in a gap");
        assert!(!covered(0x7f0000580000, 0x7f0000700000), "runs past the last mapping");
        assert!(!covered(0x00400000, 0x00410000), "read-only code");
    }

    /// Resident bytes of the calling process, from `/proc/self/statm` (Linux).
    #[cfg(target_os = "linux")]
    fn resident_bytes() -> usize {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
        pages * 4096
    }

    #[test]
    fn zeroes_small_and_large_heap_buffers_at_any_offset() {
        for (len, offset) in [(1000, 0), (RETURN_PAGES_FROM + 12_345, 0), (3 << 20, 17), (3 << 20, 4096)] {
            let mut buffer = vec![0xa5u8; len + offset];
            let bytes = &mut buffer[offset..];
            // SAFETY: the bytes are this test's, and not borrowed across the call.
            let how = unsafe { zero(bytes.as_mut_ptr(), bytes.len()) };
            assert!(bytes.iter().all(|&b| b == 0), "{len} bytes at {offset}: a byte survived");
            assert!(buffer[..offset].iter().all(|&b| b == 0xa5), "{len} bytes at {offset}: zeroed before the buffer");
            #[cfg(target_os = "linux")]
            assert_eq!(how == Zeroed::PagesReturned, len >= RETURN_PAGES_FROM, "{len} bytes at {offset}");
            #[cfg(not(target_os = "linux"))]
            let _ = how;
        }
    }

    /// What makes it cheap: the written pages of a large buffer go back to the system.
    #[cfg(target_os = "linux")]
    #[test]
    fn gives_the_pages_back() {
        let mut buffer = vec![1u8; 64 << 20];
        let written = resident_bytes();
        // SAFETY: the bytes are this test's, and not borrowed across the call.
        assert_eq!(unsafe { zero(buffer.as_mut_ptr(), buffer.len()) }, Zeroed::PagesReturned);
        assert!(resident_bytes() < written - (60 << 20), "the pages stayed resident");
        assert!(buffer.iter().step_by(4096).all(|&b| b == 0));
    }
}
