//! A backend that scores a text only step by step (it does not claim `logits_per_position`): the
//! server then reads an echoed, scored prompt one token per batched decode step, and must report
//! what it reports where the backend scores a whole prefill in one call.

use backend_reference::{EngineOptions, ReferenceEngine};
use chat_tokenizer::Tokenizer;
use openai_server::scheduler::SchedulerConfig;
use openai_server::{ServedModel, Server, ServerOptions};
use serde_json::Value;
use session_api::{Capabilities, Engine, EngineInfo, Result, SessionOptions, SessionSteps, WeightFormat};
use std::sync::Arc;
use std::time::Duration;

/// An engine that hides the reference's scored prefills.
struct Stepwise(Arc<dyn Engine>);

impl Engine for Stepwise {
    fn info(&self) -> EngineInfo {
        self.0.info()
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities { logits_per_position: false, ..self.0.capabilities() }
    }
    fn open_steps(&self, options: &SessionOptions) -> Result<Box<dyn SessionSteps>> {
        self.0.open_steps(options)
    }
}

/// The `choices` of an echoed, scored completion of `prompt` on a server over `engine`.
async fn scored(engine: Arc<dyn Engine>, dir: &std::path::Path, prompts: &Value) -> Value {
    let model = ServedModel {
        engine,
        tokenizer: Arc::new(Tokenizer::from_model_dir(dir).unwrap()),
        chat_template: None,
        eos_ids: vec![2],
        id: "m".into(),
    };
    let options = ServerOptions {
        // A prefill chunk shorter than the prompt: the scored prefills take two calls.
        scheduler: SchedulerConfig {
            slots: 2,
            max_queue: 8,
            prefill_chunk: 7,
            request_time_limit: Duration::from_secs(300),
        },
        default_max_tokens: None,
        read_timeout: Duration::from_secs(30),
    };
    let server = Server::bind(model, options, "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let address = server.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(server.run(async move {
        let _ = stopped.await;
    }));
    let body = serde_json::json!({"prompt": prompts, "max_tokens": 2, "logprobs": 3, "echo": true, "temperature": 0});
    let answer = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(address).unwrap();
        let body = body.to_string();
        let head = format!(
            "POST /v1/completions HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).unwrap();
        stream.write_all(body.as_bytes()).unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        answer
    })
    .await
    .unwrap();
    let _ = stop.send(());
    running.await.unwrap().unwrap();
    let json = answer.split_once("\r\n\r\n").map(|(_, body)| body).unwrap_or_default();
    let value: Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {answer}"));
    value["choices"].clone()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_prompt_scored_step_by_step_scores_as_in_one_prefill() {
    let dir = llama_model::default_model::ensure_default_model(None).unwrap();
    let weights = llama_model::weights::load_weights(&dir, WeightFormat::F16, None).unwrap();
    let options = EngineOptions { model_name: "m".into(), max_context: Some(128), ..Default::default() };
    let reference: Arc<dyn Engine> = Arc::new(ReferenceEngine::from_weights(&weights, options).unwrap());
    assert!(reference.capabilities().logits_per_position);
    // Two prompts, so the stepwise one's decode steps share batches.
    let prompts =
        serde_json::json!([[504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 5029], [9064, 2115, 253, 655, 28]]);
    let in_one = scored(Arc::clone(&reference), &dir, &prompts).await;
    let stepwise = scored(Arc::new(Stepwise(reference)), &dir, &prompts).await;
    for i in 0..2 {
        let (a, b) = (&in_one[i]["logprobs"], &stepwise[i]["logprobs"]);
        assert_eq!(a["tokens"], b["tokens"], "prompt {i}");
        assert_eq!(in_one[i]["text"], stepwise[i]["text"], "prompt {i}");
        let (a, b) = (a["token_logprobs"].as_array().unwrap(), b["token_logprobs"].as_array().unwrap());
        assert_eq!(a.len(), b.len());
        assert!(a[0].is_null() && b[0].is_null());
        for (x, y) in a[1..].iter().zip(&b[1..]) {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            assert!((x - y).abs() < 1e-3, "prompt {i}: {x} in one prefill, {y} step by step");
        }
    }
}
