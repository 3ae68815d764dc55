//! `linear_group`: several matrices over one input in one call give, bit for bit, what a call of
//! `linear` per matrix gives, whatever the pool and however its tasks cut the matrices' rows.

use cpu_kernels::pool::Pool;
use cpu_kernels::{
    int4_to_panels, int8_to_panels, linear, linear_group, Activations, F16Matrix, Int4Matrix, Int8Matrix, Isa,
    LinearInput, LinearWeights, GROUP_SIZE,
};

/// One matrix's arrays in every format (int4 and int8 both row-major and in panels).
struct Arrays {
    rows: usize,
    f16: Vec<u16>,
    packed: Vec<u8>,
    scales: Vec<u16>,
    biases: Vec<u16>,
    codes: Vec<i8>,
    panel_packed: Vec<u8>,
    panel_scales: Vec<u16>,
    panel_biases: Vec<u16>,
    panel_codes: Vec<i8>,
    panel_code_scales: Vec<u16>,
}

impl Arrays {
    fn new(rows: usize, k: usize, seed: usize) -> Arrays {
        let groups = k / GROUP_SIZE;
        let f16 = (0..rows * k).map(|i| half::f16::from_f32(((i * 31 + seed) % 97) as f32 / 97.0 - 0.5).to_bits());
        let packed: Vec<u8> = (0..rows * k / 2).map(|i| ((i * 37 + seed) % 251) as u8).collect();
        let scales: Vec<u16> =
            (0..rows * groups).map(|i| half::f16::from_f32(0.01 + ((i + seed) % 5) as f32 * 0.003).to_bits()).collect();
        let biases: Vec<u16> =
            (0..rows * groups).map(|i| half::f16::from_f32(-0.05 + ((i + seed) % 3) as f32 * 0.01).to_bits()).collect();
        let codes: Vec<i8> = (0..rows * k).map(|i| ((i * 53 + seed) % 255) as i8).collect();
        let (mut panel_packed, mut panel_scales, mut panel_biases) =
            (vec![0u8; packed.len()], vec![0u16; scales.len()], vec![0u16; biases.len()]);
        let int4 = Int4Matrix { rows, cols: k, packed: &packed, scales: &scales, biases: &biases };
        int4_to_panels(int4, &mut panel_packed, &mut panel_scales, &mut panel_biases).unwrap();
        let (mut panel_codes, mut panel_code_scales) = (vec![0i8; codes.len()], vec![0u16; scales.len()]);
        let int8 = Int8Matrix { rows, cols: k, codes: &codes, scales: &scales };
        int8_to_panels(int8, &mut panel_codes, &mut panel_code_scales).unwrap();
        Arrays {
            rows,
            f16: f16.collect(),
            packed,
            scales,
            biases,
            codes,
            panel_packed,
            panel_scales,
            panel_biases,
            panel_codes,
            panel_code_scales,
        }
    }

    /// The matrix in format `format` (0 f16, 1 int4, 2 int4 panels, 3 int8, 4 int8 panels).
    fn weights(&self, format: usize, k: usize, activations: Activations) -> LinearWeights<'_> {
        let rows = self.rows;
        match format {
            0 => LinearWeights::F16(F16Matrix { rows, cols: k, data: &self.f16 }),
            1 => LinearWeights::Int4(
                Int4Matrix { rows, cols: k, packed: &self.packed, scales: &self.scales, biases: &self.biases },
                activations,
            ),
            2 => LinearWeights::Int4Panels(
                Int4Matrix {
                    rows,
                    cols: k,
                    packed: &self.panel_packed,
                    scales: &self.panel_scales,
                    biases: &self.panel_biases,
                },
                activations,
            ),
            3 => {
                LinearWeights::Int8(Int8Matrix { rows, cols: k, codes: &self.codes, scales: &self.scales }, activations)
            }
            _ => LinearWeights::Int8Panels(
                Int8Matrix { rows, cols: k, codes: &self.panel_codes, scales: &self.panel_code_scales },
                activations,
            ),
        }
    }
}

#[test]
fn grouped_products_equal_one_call_per_matrix_bit_for_bit() {
    let k = 128;
    let weight: Vec<f32> = (0..k).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect();
    // A query, key and value of whole panels; a group with a matrix of part of a panel (which
    // the one-token path cannot cut, so it runs one matrix after another).
    for rows in [vec![96, 32, 32], vec![64, 176], vec![48, 40, 16]] {
        let arrays: Vec<Arrays> = rows.iter().enumerate().map(|(i, &r)| Arrays::new(r, k, i * 11)).collect();
        for tokens in [1, 3, 8, 11, 12, 16] {
            let x: Vec<f32> = (0..tokens * k).map(|i| ((i * 29 % 97) as f32 - 48.0) / 40.0).collect();
            let inputs = [LinearInput::Rows(&x), LinearInput::RmsNorm { x: &x, weight: &weight, eps: 1e-5 }];
            for (format, activations, input) in (0..5)
                .flat_map(|f| [(f, Activations::Exact), (f, Activations::Int8)])
                .filter(|&(f, a)| f != 0 || a == Activations::Exact)
                .flat_map(|(f, a)| inputs.map(|input| (f, a, input)))
            {
                let ws: Vec<LinearWeights<'_>> = arrays.iter().map(|a| a.weights(format, k, activations)).collect();
                let want: Vec<Vec<f32>> = ws
                    .iter()
                    .map(|w| {
                        let mut out = vec![f32::NAN; tokens * w.rows()];
                        linear(Isa::best(), &Pool::new(1), input, tokens, *w, None, &mut out).unwrap();
                        // The same product split over a pool's threads: the same bits.
                        let mut split = vec![f32::NAN; tokens * w.rows()];
                        linear(Isa::best(), &Pool::new(2), input, tokens, *w, None, &mut split).unwrap();
                        assert!(
                            split.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{tokens} tokens, format {format}"
                        );
                        out
                    })
                    .collect();
                for threads in [1, 2, 3] {
                    let pool = Pool::new(threads);
                    let mut got: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; tokens * w.rows()]).collect();
                    let mut outs: Vec<&mut [f32]> = got.iter_mut().map(Vec::as_mut_slice).collect();
                    linear_group(Isa::best(), &pool, input, tokens, &ws, &mut outs).unwrap();
                    for (i, (got, want)) in got.iter().zip(&want).enumerate() {
                        let same = got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "rows {rows:?}, {tokens} tokens, format {format}, {activations:?}, {threads} threads: matrix {i}");
                    }
                }
            }
        }
    }
}

#[test]
fn malformed_groups_are_errors() {
    let k = 64;
    let a = Arrays::new(32, k, 0);
    let w = a.weights(2, k, Activations::Exact);
    let x = vec![0.5f32; k];
    let pool = Pool::new(2);
    let mut one = vec![0.0f32; 32];
    let mut short = vec![0.0f32; 31];
    // Fewer results than matrices, and a result of the wrong length.
    assert!(linear_group(Isa::best(), &pool, LinearInput::Rows(&x), 1, &[w, w], &mut [&mut one]).is_err());
    assert!(linear_group(Isa::best(), &pool, LinearInput::Rows(&x), 1, &[w], &mut [&mut short]).is_err());
    // Rows cut inside a panel, or past the matrix, are no matrix.
    assert!(w.row_range(8..32).is_none() && w.row_range(16..40).is_none());
    assert_eq!(w.row_range(16..32).map(|p| p.rows()), Some(16));
}
