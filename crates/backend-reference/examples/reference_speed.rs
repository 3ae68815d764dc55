//! Measures the reference backend's prefill and decode speed (by hand, in release mode):
//!
//! ```text
//! cargo run --release -p backend-reference --example reference_speed -- [MODEL_DIR] [f16|int4]
//! ```
//!
//! Without a model directory it builds a random model of SmolLM2-135M's shape in memory, which
//! runs at the same speed as the real one (the arithmetic does not depend on the values).

use backend_reference::{EngineOptions, ReferenceEngine};
use half::f16;
use llama_model::{LayerWeights, LlamaConfig, LlamaWeights, Matrix};
use session_api::{Backend, Engine, LoadRequest, SessionOptions, WeightFormat};
use std::sync::Arc;
use std::time::Instant;

fn smollm2_shape() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 49152,
        hidden_size: 576,
        intermediate_size: 1536,
        num_hidden_layers: 30,
        num_attention_heads: 9,
        num_key_value_heads: 3,
        head_dim: 64,
        max_position_embeddings: 8192,
        rms_norm_eps: 1e-5,
        rope_theta: 100000.0,
        rope_scaling: None,
        tie_word_embeddings: true,
        bos_token_ids: vec![1],
        eos_token_ids: vec![2],
    }
}

fn random_weights(config: &LlamaConfig) -> LlamaWeights {
    let mut state = 1u32;
    let mut matrix = |rows: usize, cols: usize| {
        let data = (0..rows * cols)
            .map(|_| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                f16::from_f32(((state >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 0.1)
            })
            .collect();
        Matrix::F16 { rows, cols, data }
    };
    let (h, f, v) = (config.hidden_size, config.intermediate_size, config.vocab_size);
    let (q, kv) = (config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim);
    let layers = (0..config.num_hidden_layers)
        .map(|_| LayerWeights {
            attn_norm: vec![1.0; h],
            wq: matrix(q, h),
            wk: matrix(kv, h),
            wv: matrix(kv, h),
            wo: matrix(h, q),
            mlp_norm: vec![1.0; h],
            w_gate: matrix(f, h),
            w_up: matrix(f, h),
            w_down: matrix(h, f),
        })
        .collect();
    LlamaWeights { config: config.clone(), embed: matrix(v, h), layers, final_norm: vec![1.0; h], lm_head: None }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let engine: Arc<dyn Engine> = match args.first() {
        Some(dir) => {
            let format: WeightFormat = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(WeightFormat::F16);
            backend_reference::ReferenceBackend.load(&LoadRequest::new(dir, format))?
        }
        None => Arc::new(ReferenceEngine::from_weights(&random_weights(&smollm2_shape()), EngineOptions::default())?),
    };
    let info = engine.info();
    println!("{} {} on {}: {:.0} MB resident", info.model, info.weights, backend_reference::cpu_device().name, info.weight_bytes as f64 / 1e6);
    for prompt_len in [16usize, 128] {
        let mut session = engine.new_session(SessionOptions::default())?;
        let prompt: Vec<u32> = (0..prompt_len as u32).map(|i| (i * 7919) % info.vocab_size as u32).collect();
        let t = Instant::now();
        let mut token = session.prefill(&prompt)?.token;
        let prefill = t.elapsed().as_secs_f64();
        let steps = 32;
        let t = Instant::now();
        for _ in 0..steps {
            token = session.decode(token)?.token;
        }
        let decode = t.elapsed().as_secs_f64();
        println!(
            "prompt {prompt_len:>4}: prefill {:>7.1} tok/s ({:.0} ms)   decode {:>6.1} tok/s ({:.1} ms/token)",
            prompt_len as f64 / prefill,
            prefill * 1e3,
            steps as f64 / decode,
            decode * 1e3 / steps as f64
        );
    }
    Ok(())
}
