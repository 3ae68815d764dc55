//! Input reuse (`set_input_reuse`, what IREE's workgroup calls turn on): a call whose inputs
//! changed, even in place and in one value, computes from the new inputs; calls that share their
//! inputs give exactly what they give without reuse.

use cpu_kernels::pool::Pool;
use cpu_kernels::{
    int4_to_panels, int8_to_panels, linear, set_input_reuse, Activations, Int4Matrix, Int8Matrix, Isa, LinearInput,
    LinearWeights, GROUP_SIZE,
};

/// One call of `linear` on this thread, with reuse as given.
fn call(reuse: bool, input: LinearInput<'_>, w: LinearWeights<'_>, rows: usize) -> Vec<f32> {
    set_input_reuse(reuse);
    let mut out = vec![f32::NAN; rows];
    linear(Isa::best(), &Pool::new(1), input, 1, w, None, &mut out).unwrap();
    set_input_reuse(false);
    out
}

#[test]
fn reused_preparations_follow_their_inputs() {
    let (n, k) = (48, 256);
    let groups = k / GROUP_SIZE;
    let packed: Vec<u8> = (0..n * k / 2).map(|i| (i * 37 % 251) as u8).collect();
    let scales: Vec<u16> =
        (0..n * groups).map(|i| half::f16::from_f32(0.01 + (i % 5) as f32 * 0.003).to_bits()).collect();
    let biases: Vec<u16> =
        (0..n * groups).map(|i| half::f16::from_f32(-0.05 + (i % 3) as f32 * 0.01).to_bits()).collect();
    let codes: Vec<i8> = (0..n * k).map(|i| (i * 53 % 255) as i8).collect();
    let (mut pp, mut ps, mut pb) = (vec![0u8; packed.len()], vec![0u16; scales.len()], vec![0u16; biases.len()]);
    int4_to_panels(
        Int4Matrix { rows: n, cols: k, packed: &packed, scales: &scales, biases: &biases },
        &mut pp,
        &mut ps,
        &mut pb,
    )
    .unwrap();
    let (mut pc, mut pcs) = (vec![0i8; codes.len()], vec![0u16; scales.len()]);
    int8_to_panels(Int8Matrix { rows: n, cols: k, codes: &codes, scales: &scales }, &mut pc, &mut pcs).unwrap();
    let int4 = Int4Matrix { rows: n, cols: k, packed: &pp, scales: &ps, biases: &pb };
    let int8 = Int8Matrix { rows: n, cols: k, codes: &pc, scales: &pcs };

    for activations in [Activations::Exact, Activations::Int8] {
        for weights in [LinearWeights::Int4Panels(int4, activations), LinearWeights::Int8Panels(int8, activations)] {
            for kind in 0..3 {
                let plain = sequence(false, kind, weights, n, k);
                let reused = sequence(true, kind, weights, n, k);
                for (step, (plain, reused)) in plain.iter().zip(&reused).enumerate() {
                    assert_eq!(plain, reused, "{activations:?} kind {kind}, call {step}");
                }
            }
        }
    }
}

/// A sequence of calls of input kind `kind` (rows, RMSNorm, SwiGLU), each input changed in place
/// between them (one value of x, of up, of the norm's weight, then eps), every input called
/// twice; the outputs' bits.
fn sequence(reuse: bool, kind: usize, weights: LinearWeights<'_>, n: usize, k: usize) -> Vec<Vec<u32>> {
    let mut x: Vec<f32> = (0..k).map(|i| ((i * 29 % 97) as f32 - 48.0) / 40.0).collect();
    let mut up: Vec<f32> = (0..k).map(|i| ((i * 13 % 89) as f32 - 44.0) / 30.0).collect();
    let mut norm: Vec<f32> = (0..k).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect();
    let mut outputs = Vec::new();
    for step in 0..5 {
        match step {
            1 => x[5] += 0.25,
            2 => up[200] -= 0.5,
            3 => norm[17] *= 1.5,
            _ => {}
        }
        let eps = if step == 4 { 1e-3 } else { 1e-5 };
        let input = match kind {
            0 => LinearInput::Rows(&x),
            1 => LinearInput::RmsNorm { x: &x, weight: &norm, eps },
            _ => LinearInput::SwiGlu { gate: &x, up: &up },
        };
        for _ in 0..2 {
            outputs.push(call(reuse, input, weights, n).iter().map(|v| v.to_bits()).collect());
        }
    }
    outputs
}
