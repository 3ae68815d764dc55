//! The ggml block formats seam reads and writes: conversion to f32, quantization as llama.cpp's
//! reference quantizers define it, and direct access to Q4_1 blocks.
//!
//! Block layouts (32 elements per block; `d`, `m` are little-endian f16):
//! - Q8_0: `d`, 32 × i8 `q`; value = `d * q`.
//! - Q4_0: `d`, 16 bytes; value = `d * (q - 8)`.
//! - Q4_1: `d`, `m`, 16 bytes; value = `d * q + m`.
//!
//! In both 4-bit formats byte `j` of a block holds element `j` in its low nibble and element
//! `j + 16` in its high nibble.

use crate::error::GgufError;
use crate::ggml_type::GgmlType;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Elements per block of Q8_0, Q4_0 and Q4_1.
pub const QK: usize = 32;

/// One Q4_1 block, unpacked: `value[i] = f32(d) * q[i] + f32(m)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ4_1 {
    /// Scale.
    pub d: f16,
    /// Minimum (offset).
    pub m: f16,
    /// The 32 codes, element order, each in `0..=15`.
    pub q: [u8; QK],
}

impl BlockQ4_1 {
    /// Bytes of one block in a file.
    pub const BYTES: usize = 20;

    /// Decodes one block from its 20 bytes.
    pub fn parse(bytes: &[u8; Self::BYTES]) -> BlockQ4_1 {
        let d = f16::from_le_bytes([bytes[0], bytes[1]]);
        let m = f16::from_le_bytes([bytes[2], bytes[3]]);
        let mut q = [0u8; QK];
        for (j, &b) in bytes[4..].iter().enumerate() {
            q[j] = b & 0x0f;
            q[j + QK / 2] = b >> 4;
        }
        BlockQ4_1 { d, m, q }
    }

    /// Element `i` as f32, exactly as ggml computes it.
    pub fn value(&self, i: usize) -> f32 {
        f32::from(self.d) * self.q[i] as f32 + f32::from(self.m)
    }
}

/// The Q4_1 blocks of a tensor's data, in order (a row of `n` elements is `n / 32` blocks).
pub fn q4_1_blocks(data: &[u8]) -> Result<impl ExactSizeIterator<Item = BlockQ4_1> + '_, GgufError> {
    if !data.len().is_multiple_of(BlockQ4_1::BYTES) {
        return Err(GgufError::InvalidTensor {
            name: "<Q4_1 data>".into(),
            message: format!("{} bytes is not a whole number of 20-byte blocks", data.len()),
        });
    }
    Ok(data.chunks_exact(BlockQ4_1::BYTES).map(|c| BlockQ4_1::parse(c.try_into().expect("chunk size"))))
}

fn length_error(ty: GgmlType, bytes: usize, elements: usize) -> GgufError {
    GgufError::InvalidTensor {
        name: format!("<{ty} data>"),
        message: format!("{bytes} bytes cannot hold exactly {elements} elements"),
    }
}

/// Converts `data` of type `ty` to f32 into `out` (its length is the element count).
///
/// Supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1. The arithmetic is ggml's (`d * q`, `d * (q - 8)`,
/// `d * q + m` in f32), so results are bit-identical to llama.cpp's dequantization.
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<(), GgufError> {
    let n = out.len();
    if ty.row_bytes(n as u64) != Some(data.len() as u64) {
        return Err(length_error(ty, data.len(), n));
    }
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = f32::from_le_bytes(c.try_into().expect("4 bytes"));
            }
        }
        GgmlType::F16 => {
            // Bulk conversion: `half` uses the CPU's conversion instructions for slices when it can.
            let halves: Vec<f16> = data.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]])).collect();
            halves.convert_to_f32_slice(out);
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(data.chunks_exact(34)) {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                for (o, &q) in o.iter_mut().zip(&b[2..]) {
                    *o = q as i8 as f32 * d;
                }
            }
        }
        GgmlType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(data.chunks_exact(18)) {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                let (lo, hi) = o.split_at_mut(QK / 2);
                for ((l, h), &byte) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[2..]) {
                    *l = ((byte & 0x0f) as i32 - 8) as f32 * d;
                    *h = ((byte >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(data.chunks_exact(BlockQ4_1::BYTES)) {
                // Scale and minimum converted once per block (f16 → f32 is not free without F16C).
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                let m = f16::from_le_bytes([b[2], b[3]]).to_f32();
                let (lo, hi) = o.split_at_mut(QK / 2);
                for ((l, h), &byte) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[4..]) {
                    *l = d * (byte & 0x0f) as f32 + m;
                    *h = d * (byte >> 4) as f32 + m;
                }
            }
        }
        other => {
            return Err(GgufError::UnsupportedType { ty: other.to_string(), operation: "conversion to f32".into() })
        }
    }
    Ok(())
}

/// Quantizes (or converts) `values` to type `ty`, as llama.cpp's reference quantizers do.
///
/// Supported: F32, F16, BF16 (round to nearest even), Q8_0, Q4_0, Q4_1. For the block types the
/// length must be a multiple of 32 (each row of a tensor is a whole number of blocks, so quantizing
/// a whole tensor at once is the same as quantizing it row by row).
///
/// - Q8_0: `d = amax / 127`, `q = round(x / d)` (computed as `x * (1/d)`, rounding half away from zero).
/// - Q4_0: `d = max / -8` where `max` is the value of largest magnitude, `q = min(15, trunc(x/d + 8.5))`.
/// - Q4_1: `d = (max - min) / 15`, `m = min`, `q = min(15, trunc((x - min)/d + 0.5))`.
///
/// `d` and `m` are stored as f16 after the codes have been computed from their f32 values.
pub fn quantize(ty: GgmlType, values: &[f32]) -> Result<Vec<u8>, GgufError> {
    let n = values.len();
    let bytes = ty.row_bytes(n as u64).ok_or_else(|| GgufError::InvalidTensor {
        name: format!("<{ty} data>"),
        message: format!("{n} values are not a whole number of {}-element blocks", ty.block_size()),
    })? as usize;
    let mut out = Vec::with_capacity(bytes);
    match ty {
        GgmlType::F32 => values.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        GgmlType::F16 => values.iter().for_each(|&v| out.extend_from_slice(&f16::from_f32(v).to_le_bytes())),
        GgmlType::BF16 => values.iter().for_each(|&v| out.extend_from_slice(&bf16::from_f32(v).to_le_bytes())),
        GgmlType::Q8_0 => {
            for block in values.chunks_exact(QK) {
                let amax = block.iter().fold(0.0f32, |a, &x| a.max(x.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                // f32::round rounds half away from zero, like C's roundf.
                out.extend(block.iter().map(|&x| (x * id).round() as i8 as u8));
            }
        }
        GgmlType::Q4_0 => {
            for block in values.chunks_exact(QK) {
                let mut amax = 0.0f32;
                let mut max = 0.0f32;
                for &x in block {
                    if x.abs() > amax {
                        amax = x.abs();
                        max = x;
                    }
                }
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                let code = |x: f32| ((x * id + 8.5) as u8).min(15);
                for j in 0..QK / 2 {
                    out.push(code(block[j]) | (code(block[j + QK / 2]) << 4));
                }
            }
        }
        GgmlType::Q4_1 => {
            for block in values.chunks_exact(QK) {
                let min = block.iter().copied().fold(f32::INFINITY, f32::min);
                let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                // `as u8` truncates toward zero (and saturates), as the C cast of a non-negative float.
                let code = |x: f32| (((x - min) * id + 0.5) as u8).min(15);
                for j in 0..QK / 2 {
                    out.push(code(block[j]) | (code(block[j + QK / 2]) << 4));
                }
            }
        }
        other => return Err(GgufError::UnsupportedType { ty: other.to_string(), operation: "quantization".into() }),
    }
    debug_assert_eq!(out.len(), bytes);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0).collect()
    }

    #[test]
    fn q8_0_known_block() {
        let mut v = vec![0.0f32; 32];
        v[0] = 127.0;
        v[1] = -63.5; // exactly half: rounds away from zero
        v[2] = 1.0;
        let bytes = quantize(GgmlType::Q8_0, &v).unwrap();
        assert_eq!(bytes.len(), 34);
        assert_eq!(f16::from_le_bytes([bytes[0], bytes[1]]), f16::ONE);
        assert_eq!(bytes[2] as i8, 127);
        assert_eq!(bytes[3] as i8, -64);
        assert_eq!(bytes[4] as i8, 1);
        let mut back = vec![0.0; 32];
        dequantize(GgmlType::Q8_0, &bytes, &mut back).unwrap();
        assert_eq!(back[0], 127.0);
        assert_eq!(back[1], -64.0);
    }

    #[test]
    fn q4_nibble_layout_is_j_and_j_plus_16() {
        // Values 0..15 then 15..0: d = 1, m = 0, codes equal to the values.
        let v: Vec<f32> = (0..16).chain((0..16).rev()).map(|x| x as f32).collect();
        let bytes = quantize(GgmlType::Q4_1, &v).unwrap();
        assert_eq!(f16::from_le_bytes([bytes[0], bytes[1]]), f16::ONE);
        assert_eq!(f16::from_le_bytes([bytes[2], bytes[3]]), f16::ZERO);
        assert_eq!(bytes[4], 15 << 4); // element 0 = 0 low, element 16 = 15 high
        assert_eq!(bytes[4 + 15], 15); // element 15 = 15 low, element 31 = 0 high
        let block = BlockQ4_1::parse(bytes[..20].try_into().unwrap());
        assert_eq!(block.q.iter().map(|&q| q as f32).collect::<Vec<_>>(), v);
        let mut back = vec![0.0; 32];
        dequantize(GgmlType::Q4_1, &bytes, &mut back).unwrap();
        assert_eq!(back, v);
    }

    #[test]
    fn round_trips_are_close() {
        let v = ramp(256);
        for (ty, tol) in [
            (GgmlType::F32, 0.0),
            (GgmlType::F16, 2e-3),
            (GgmlType::BF16, 2e-2),
            (GgmlType::Q8_0, 0.02),
            // Q4_0 cannot reach +amax when the largest magnitude is negative: error up to one step (amax / 8).
            (GgmlType::Q4_0, 0.5),
            (GgmlType::Q4_1, 0.3),
        ] {
            let bytes = quantize(ty, &v).unwrap();
            assert_eq!(bytes.len() as u64, ty.row_bytes(256).unwrap());
            let mut back = vec![f32::NAN; 256];
            dequantize(ty, &bytes, &mut back).unwrap();
            let err = v.iter().zip(&back).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(err <= tol, "{ty}: max error {err}");
        }
    }

    #[test]
    fn constant_block_is_exact_for_q4_1() {
        let v = vec![-0.5f32; 32];
        let bytes = quantize(GgmlType::Q4_1, &v).unwrap();
        let mut back = vec![0.0; 32];
        dequantize(GgmlType::Q4_1, &bytes, &mut back).unwrap();
        assert_eq!(back, v);
    }

    #[test]
    fn bad_lengths_and_types_are_errors() {
        assert!(quantize(GgmlType::Q8_0, &[0.0; 31]).is_err());
        assert!(matches!(quantize(GgmlType::Q6_K, &[0.0; 256]), Err(GgufError::UnsupportedType { .. })));
        let mut out = vec![0.0; 32];
        assert!(dequantize(GgmlType::Q4_1, &[0; 19], &mut out).is_err());
        assert!(dequantize(GgmlType::F16, &[0; 63], &mut out).is_err());
        assert!(matches!(
            dequantize(GgmlType::Q4_K, &[0; 144], &mut vec![0.0; 256]),
            Err(GgufError::UnsupportedType { .. })
        ));
        assert!(q4_1_blocks(&[0; 21]).is_err());
        assert_eq!(q4_1_blocks(&[0; 40]).unwrap().len(), 2);
    }
}
