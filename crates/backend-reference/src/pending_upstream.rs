//! TEMPORARY stand-ins for llama-model functions that are being written right now
//! (`LlamaConfig::rope_cos_sin`, `Int4Matrix::dequantize_row`). Inherent methods win over trait
//! methods, so once llama-model defines them this module is unused and will be deleted.

use llama_model::{Int4Matrix, LlamaConfig, RopeScaling};

pub trait RopeCosSin {
    fn rope_cos_sin(&self, position: usize) -> (Vec<f32>, Vec<f32>);
}

impl RopeCosSin for LlamaConfig {
    fn rope_cos_sin(&self, position: usize) -> (Vec<f32>, Vec<f32>) {
        let d = self.head_dim;
        let inv: Vec<f32> = (0..d / 2)
            .map(|i| {
                let f = 1.0 / self.rope_theta.powf((2 * i) as f32 / d as f32);
                match self.rope_scaling {
                    None => f,
                    Some(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }) => {
                        let old = original_max_position_embeddings as f32;
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        let (low_w, high_w) = (old / low_freq_factor, old / high_freq_factor);
                        if wavelen > low_w {
                            f / factor
                        } else if wavelen < high_w {
                            f
                        } else {
                            let s = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - s) * f / factor + s * f
                        }
                    }
                }
            })
            .collect();
        let angles: Vec<f32> = inv.iter().map(|f| position as f32 * f).collect();
        (angles.iter().map(|a| a.cos()).collect(), angles.iter().map(|a| a.sin()).collect())
    }
}

pub trait DequantizeRow {
    fn dequantize_row(&self, row: usize, out: &mut [f32]);
}

impl DequantizeRow for Int4Matrix {
    fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        let groups = self.cols / 32;
        for c in 0..self.cols {
            let byte = self.packed[(row * self.cols + c) / 2];
            let q = if c % 2 == 0 { byte & 15 } else { byte >> 4 };
            let g = row * groups + c / 32;
            out[c] = f32::from(self.scales[g]) * q as f32 + f32::from(self.biases[g]);
        }
    }
}
