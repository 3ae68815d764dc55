//! Buffers on the CPU device: copies and imports hold the bytes given, an import keeps its host
//! memory alive exactly as long as IREE uses it, and bad shapes are errors.

use iree_runtime::{Device, ElementType, HostMemory};
use std::sync::Arc;

/// 64 bytes aligned to 64, so that a vector of them is aligned for import.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Block([u8; 64]);

/// Host memory aligned for import.
struct Aligned(Vec<Block>);

impl Aligned {
    fn new(bytes: usize, fill: impl Fn(usize) -> u8) -> Aligned {
        let mut blocks = vec![Block([0; 64]); bytes.div_ceil(64)];
        for (i, b) in blocks.iter_mut().flat_map(|b| b.0.iter_mut()).enumerate() {
            *b = fill(i);
        }
        Aligned(blocks)
    }
}

impl AsRef<[u8]> for Aligned {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `Block` is 64 plain bytes with no padding.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast(), self.0.len() * 64) }
    }
}

fn cpu() -> Device {
    Device::create("local-task").expect("the local-task device")
}

#[test]
fn an_upload_reads_back_what_was_given() {
    let device = cpu();
    assert!(device.host_memory());
    let values: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
    let view = device.upload(bytemuck::cast_slice(&values), ElementType::F32, &[2, 3, 4]).unwrap();
    assert_eq!(view.shape(), vec![2, 3, 4]);
    assert_eq!(view.element_type(), Some(ElementType::F32));
    assert!(!view.is_imported());
    assert_eq!(view.read::<f32>().unwrap(), values);
    // A scalar.
    let scalar = device.upload(&7i32.to_le_bytes(), ElementType::I32, &[]).unwrap();
    assert_eq!(scalar.shape(), Vec::<usize>::new());
    assert_eq!(scalar.read::<i32>().unwrap(), vec![7]);
}

#[test]
fn an_import_is_the_host_memory_and_keeps_it_alive() {
    let device = cpu();
    let memory = Arc::new(Aligned::new(512, |i| (i * 37 % 251) as u8));
    let range = 64..320;
    let view = device.import_host(memory.clone(), range.clone(), ElementType::I8, &[16, 16]).unwrap();
    assert!(view.is_imported());
    assert_eq!(view.read_bytes().unwrap(), (*memory).as_ref()[range].to_vec());
    assert_eq!(Arc::strong_count(&memory), 2, "the import holds the memory");
    // An unaligned range is copied instead, and holds nothing.
    let copied = device.import_host(memory.clone(), 3..259, ElementType::I8, &[256]).unwrap();
    assert!(!copied.is_imported());
    assert_eq!(copied.read_bytes().unwrap(), (*memory).as_ref()[3..259].to_vec());
    assert_eq!(Arc::strong_count(&memory), 2);
    let clone = view.clone();
    drop(view);
    assert_eq!(clone.read::<i8>().unwrap().len(), 256);
    drop(clone);
    assert_eq!(Arc::strong_count(&memory), 1, "released with the last view");
}

#[test]
fn shapes_that_do_not_match_the_bytes_are_errors() {
    let device = cpu();
    let err = device.upload(&[0u8; 12], ElementType::F32, &[2, 2]).unwrap_err();
    assert!(err.to_string().contains("12 bytes"), "{err}");
    let memory: HostMemory = Arc::new(Aligned::new(64, |_| 0));
    let err = device.import_host(memory.clone(), 0..128, ElementType::I8, &[128]).unwrap_err();
    assert!(err.to_string().contains("outside"), "{err}");
    let err = device.import_host(memory, 0..64, ElementType::F16, &[64]).unwrap_err();
    assert!(err.to_string().contains("64 bytes"), "{err}");
}

#[test]
fn an_unknown_driver_is_an_error_not_a_crash() {
    let err = Device::create("no-such-driver").unwrap_err();
    assert!(err.to_string().contains("no-such-driver"), "{err}");
}

#[test]
fn a_zeroed_buffer_reads_back_zeros_and_keeps_its_shape() {
    let device = cpu();
    let values: Vec<f32> = (0..24).map(|i| i as f32 + 1.0).collect();
    let view = device.upload(bytemuck::cast_slice(&values), ElementType::F32, &[4, 6]).unwrap();
    view.zero().unwrap();
    assert_eq!(view.shape(), vec![4, 6]);
    assert_eq!(view.read::<f32>().unwrap(), vec![0.0; 24]);
}

#[test]
fn new_zeros_read_back_as_zeros_at_any_size() {
    let device = cpu();
    for elements in [24usize, 3 << 20] {
        // Memory just freed, full of ones, is what the allocator is likely to hand out next.
        drop(device.upload(&vec![0xffu8; elements * 4], ElementType::F32, &[elements]).unwrap());
        let view = device.zeros(ElementType::F32, &[elements / 4, 4]).unwrap();
        assert_eq!(view.shape(), vec![elements / 4, 4]);
        assert!(view.read::<f32>().unwrap().iter().all(|&v| v == 0.0), "{elements} elements: not all zeros");
    }
    assert_eq!(device.zeros(ElementType::F16, &[0, 8]).unwrap().byte_length(), 0);
}
