//! `stats::release_freed_memory` gives freed heap memory back: many small blocks (below the
//! allocator's mmap threshold, so they live in its heap) written, freed, then released, leave
//! the process's resident set lower than before the release. A test binary of its own, so that
//! no other test allocates meanwhile.

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn freed_heap_memory_leaves_the_resident_set() {
    use session_api::stats::{release_freed_memory, ProcessMemory};
    let resident = || ProcessMemory::now().expect("/proc/self/status").resident_bytes as i64;
    const BLOCK: usize = 4096;
    const BLOCKS: usize = 32 * 1024; // 128 MiB
    let mut blocks: Vec<Vec<u8>> = (0..BLOCKS).map(|i| vec![(i % 251) as u8; BLOCK]).collect();
    // Keep every 64th block so the heap's top stays in use and only trimming inside it helps.
    let kept: Vec<Vec<u8>> = blocks.iter_mut().step_by(64).map(std::mem::take).collect();
    drop(blocks);
    let before = resident();
    release_freed_memory();
    let after = resident();
    assert!(kept.iter().all(|b| b.len() == BLOCK));
    assert!(before - after > 64 << 20, "released {} MiB of 126", (before - after) >> 20);
}
