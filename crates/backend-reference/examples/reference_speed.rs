//! Measures the reference backend's prefill and decode speed (by hand, in release mode):
//!
//! ```text
//! cargo run --release -p backend-reference --example reference_speed -- [MODEL_DIR] [f16|int4]
//! ```
//!
//! Without a model directory it builds a random model of SmolLM2-135M's shape in memory, which
//! runs at the same speed as the real one (the arithmetic does not depend on the values).

use backend_reference::{EngineOptions, ReferenceEngine};
use llama_model::random::{random_weights, smollm2_135m_config};
use session_api::{Backend, Engine, LoadRequest, SessionOptions, WeightFormat};
use std::sync::Arc;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let engine: Arc<dyn Engine> = match args.first() {
        Some(dir) => {
            let format: WeightFormat = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(WeightFormat::F16);
            backend_reference::ReferenceBackend.load(&LoadRequest::new(dir, format))?
        }
        None => Arc::new(ReferenceEngine::from_weights(
            &random_weights(&smollm2_135m_config(), 1)?,
            EngineOptions::default(),
        )?),
    };
    let info = engine.info();
    println!(
        "{} {} on {}: {:.0} MB resident",
        info.model,
        info.weights,
        backend_reference::cpu_device().name,
        info.weight_bytes as f64 / 1e6
    );
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
