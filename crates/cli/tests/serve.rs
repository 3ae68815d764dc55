//! `seam serve` from the outside: the real binary on the default model (reference backend),
//! called with curl, with the official `openai` Python client (pinned, installed into the
//! project-local `.seam/py-openai` on first use) and with plain HTTP from threads.
//!
//! Checked: greedy output through the server equals `seam run`'s, streamed and not; log-probabilities
//! agree with the text and tokens generated, and an echoed prompt's scores with the scores the
//! same tokens got when generated; `/tokenize` and `/detokenize` invert each other; penalties
//! change greedy picks; several prompts and choices equal their single requests; concurrent
//! requests (more than the slots, so some queue) each equal their output alone; a client that
//! hangs up frees its slot; errors carry OpenAI's body and status (400, 404, 405, 408, 413, 429
//! with Retry-After); parameters the server does not serve are refused; a client that stops
//! sending is cut off after the read timeout; SIGTERM lets a running request finish, then the process exits 0; resident
//! memory stays flat over 1,000 requests.

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const OPENAI_CLIENT: &str = "openai==3.57.0";

fn default_model() -> PathBuf {
    llama_model::default_model::ensure_default_model(None).unwrap()
}

/// A `seam serve` process, killed when dropped.
struct Served {
    child: Child,
    address: String,
}

impl Served {
    fn start(extra: &[&str]) -> Served {
        let model = default_model();
        let mut child = Command::new(env!("CARGO_BIN_EXE_seam"))
            .args(["serve", "--backend", "reference", "--port", "0", "--model"])
            .arg(&model)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = BufReader::new(child.stderr.take().unwrap());
        let (found, address) = mpsc::channel();
        std::thread::spawn(move || {
            let mut found = Some(found);
            for line in stderr.lines().map_while(Result::ok) {
                if let Some(rest) = line.split("at http://").nth(1) {
                    if let Some(found) = found.take() {
                        let _ = found.send(rest.split('/').next().unwrap_or_default().to_string());
                    }
                }
                eprintln!("[seam serve] {line}");
            }
        });
        let address = address.recv_timeout(Duration::from_secs(120)).expect("seam serve printed its address");
        Served { child, address }
    }

    fn base_url(&self) -> String {
        format!("http://{}/v1", self.address)
    }

    fn post(&self, path: &str, body: &str) -> Response {
        request(&self.address, "POST", path, Some(body))
    }

    fn get(&self, path: &str) -> Response {
        request(&self.address, "GET", path, None)
    }

    /// A metric's value from `/metrics` (the first sample whose line starts with `name`).
    fn metric(&self, name: &str) -> f64 {
        let text = self.get("/metrics").body;
        text.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no metric {name} in:\n{text}"))
    }

    /// Waits until `metric` reads `value`.
    fn wait_for(&self, metric: &str, value: f64) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.metric(metric) != value {
            assert!(Instant::now() < deadline, "{metric} did not reach {value} (now {})", self.metric(metric));
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn resident_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP answer.
struct Response {
    status: u16,
    head: String,
    body: String,
}

impl Response {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// The concatenated text of a stream's chunks, its finish reason, and whether it ended with `[DONE]`.
    fn stream_text(&self) -> (String, Option<String>, bool) {
        let (mut text, mut finish, mut done) = (String::new(), None, false);
        for data in self.body.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let chunk: Value = serde_json::from_str(data).unwrap();
            for choice in chunk["choices"].as_array().unwrap() {
                text.push_str(choice["text"].as_str().or(choice["delta"]["content"].as_str()).unwrap_or(""));
                if let Some(reason) = choice["finish_reason"].as_str() {
                    finish = Some(reason.to_string());
                }
            }
        }
        (text, finish, done)
    }
}

/// One HTTP/1.0 request (the answer's end is the connection's end, so no chunked decoding).
fn request(address: &str, method: &str, path: &str, body: Option<&str>) -> Response {
    let mut stream = TcpStream::connect(address).unwrap();
    let body = body.unwrap_or("");
    write!(
        stream,
        "{method} {path} HTTP/1.0\r\nHost: {address}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    Response { status, head: head.to_string(), body: body.to_string() }
}

/// `seam run --json` on the reference backend: the generated text.
fn seam_run(prompt: &str, chat: bool, max_tokens: usize) -> String {
    let mut command = Command::new(env!("CARGO_BIN_EXE_seam"));
    command.args(["run", "--backend", "reference", "--json", "--model"]).arg(default_model());
    command.args(["--prompt", prompt, "--max-tokens", &max_tokens.to_string()]);
    if chat {
        command.arg("--chat");
    }
    let output = command.output().unwrap();
    assert!(output.status.success(), "seam run failed: {}", String::from_utf8_lossy(&output.stderr));
    let json: Value = serde_json::from_slice(&output.stdout).unwrap();
    json["text"].as_str().unwrap().to_string()
}

fn completion_body(prompt: &str, max_tokens: usize, stream: bool) -> String {
    serde_json::json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}).to_string()
}

/// A request that runs until its client goes away (or for minutes).
fn endless_body(prompt: &str) -> String {
    serde_json::json!({"prompt": prompt, "max_tokens": 4000, "temperature": 0, "stream": true, "ignore_eos": true})
        .to_string()
}

/// `.seam/py-openai` with the pinned openai client, installed whole or not at all.
fn openai_client_dir() -> PathBuf {
    let dir = llama_model::home::root().join("py-openai");
    if !dir.join("openai").is_dir() {
        let staging = atomic_write::TempDir::create(&dir).unwrap();
        let status = Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target"])
            .arg(staging.path())
            .arg(OPENAI_CLIENT)
            .status()
            .expect("python3 must be installed to test with the openai client");
        assert!(status.success(), "pip install {OPENAI_CLIENT} failed");
        staging.commit(atomic_write::Existing::Replace).unwrap();
    }
    dir
}

#[test]
fn curl_and_the_openai_client_get_what_seam_run_prints() {
    let (chat_prompt, completion_prompt, max_tokens) = ("Name three rivers in Europe.", "The capital of France is", 24);
    let expected_chat = seam_run(chat_prompt, true, max_tokens);
    let expected_completion = seam_run(completion_prompt, false, max_tokens);
    let served = Served::start(&["--parallel", "4"]);

    let chat_body = serde_json::json!({
        "messages": [{"role": "user", "content": chat_prompt}], "temperature": 0, "max_tokens": max_tokens
    })
    .to_string();
    let curl = Command::new("curl")
        .args(["-sS", "--fail-with-body", "-H", "Content-Type: application/json", "-d", &chat_body])
        .arg(format!("{}/chat/completions", served.base_url()))
        .output()
        .expect("curl must be installed");
    assert!(curl.status.success(), "curl: {}", String::from_utf8_lossy(&curl.stderr));
    let answer: Value = serde_json::from_slice(&curl.stdout).unwrap();
    assert_eq!(answer["choices"][0]["message"]["content"], expected_chat);
    assert_eq!(answer["object"], "chat.completion");
    assert_eq!(answer["usage"]["completion_tokens"], max_tokens);

    let curl_stream = Command::new("curl")
        .args(["-sSN", "--fail-with-body", "-d", &completion_body(completion_prompt, max_tokens, true)])
        .arg(format!("{}/completions", served.base_url()))
        .output()
        .unwrap();
    let streamed = Response { status: 200, head: String::new(), body: String::from_utf8(curl_stream.stdout).unwrap() };
    assert_eq!(streamed.stream_text(), (expected_completion.clone(), Some("length".into()), true));

    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/openai_client.py");
    let output = Command::new("python3")
        .arg(&script)
        .args([served.base_url().as_str(), chat_prompt, completion_prompt, &max_tokens.to_string()])
        .env("PYTHONPATH", openai_client_dir())
        .output()
        .unwrap();
    assert!(output.status.success(), "the openai client failed:\n{}", String::from_utf8_lossy(&output.stderr));
    let got: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(got["model"], "SmolLM2-135M-Instruct");
    for key in ["chat", "chat_stream"] {
        assert_eq!(got[key], expected_chat, "{key}");
    }
    for key in ["completion", "completion_stream"] {
        assert_eq!(got[key], expected_completion, "{key}");
    }
    for key in ["chat_finish", "chat_stream_finish", "completion_finish", "completion_stream_finish"] {
        assert_eq!(got[key], "length", "{key}");
    }
    assert_eq!(got["chat_completion_tokens"], max_tokens);
    assert_eq!(got["chat_stream_completion_tokens"], max_tokens);
    assert_eq!(got["missing_model_status"], 404);
}

/// A completion's `logprobs` as (token text, log-probability or null, top alternatives).
fn completion_scores(answer: &Value) -> Vec<(String, Option<f64>, Value)> {
    let logprobs = &answer["choices"][0]["logprobs"];
    let tokens = logprobs["tokens"].as_array().unwrap();
    (0..tokens.len())
        .map(|i| {
            let token = tokens[i].as_str().unwrap().to_string();
            (token, logprobs["token_logprobs"][i].as_f64(), logprobs["top_logprobs"][i].clone())
        })
        .collect()
}

#[test]
fn logprobs_agree_with_the_generated_text_and_an_echoed_prompt_scores_as_generated() {
    let served = Served::start(&["--parallel", "2"]);
    let prompt = "The capital of France is";
    let body = serde_json::json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 5});
    let answer = served.post("/v1/completions", &body.to_string());
    assert_eq!(answer.status, 200, "{}", answer.body);
    let answer = answer.json();
    let text = answer["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(text, seam_run(prompt, false, 8));
    let generated = completion_scores(&answer);
    assert_eq!(generated.len(), 8);

    // The remote tokenizer a harness may use instead of its own: the prompt's tokens, back to text.
    let tokenized = served.post("/tokenize", &serde_json::json!({"prompt": prompt}).to_string()).json();
    assert_eq!(tokenized["count"], answer["usage"]["prompt_tokens"]);
    let back = served.post("/detokenize", &serde_json::json!({"tokens": tokenized["tokens"]}).to_string()).json();
    assert_eq!(back["prompt"], prompt);
    assert_eq!(served.get("/tokenizer_info").json()["eos_token"], "<|im_end|>");
    assert_eq!(served.post("/detokenize", r#"{"tokens": [4000000000]}"#).status, 400);
    assert_eq!(generated.iter().map(|g| g.0.as_str()).collect::<String>(), text, "the tokens spell the text");
    for (token, logprob, top) in &generated {
        let logprob = logprob.unwrap();
        let top = top.as_object().unwrap();
        assert!(top.len() <= 5 && !top.is_empty());
        let mass: f64 = top.values().map(|v| v.as_f64().unwrap().exp()).sum();
        assert!(logprob <= 0.0 && mass <= 1.0 + 1e-9, "{token:?}: {logprob}, top mass {mass}");
        // Greedy: the token picked is the most likely one.
        let best = top.values().map(|v| v.as_f64().unwrap()).fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(logprob, best, "{token:?} is not the most likely of {top:?}");
    }

    // The same text echoed: its prompt scores, position by position, as it scored when generated.
    let body = serde_json::json!({"prompt": format!("{prompt}{text}"), "max_tokens": 0, "logprobs": 1, "echo": true});
    let echoed = served.post("/v1/completions", &body.to_string());
    assert_eq!(echoed.status, 200, "{}", echoed.body);
    let echoed = echoed.json();
    assert_eq!(echoed["choices"][0]["text"], format!("{prompt}{text}"));
    assert_eq!(echoed["usage"]["completion_tokens"], 0);
    let scored = completion_scores(&echoed);
    assert_eq!(scored[0].1, None, "nothing precedes the first token");
    let tail = &scored[scored.len() - generated.len()..];
    for ((token, logprob, _), (echoed_token, echoed_logprob, _)) in generated.iter().zip(tail) {
        assert_eq!(token, echoed_token);
        let (a, b) = (logprob.unwrap(), echoed_logprob.unwrap());
        assert!((a - b).abs() < 1e-3, "{token:?}: {a} generated, {b} echoed");
    }

    // Chat: the tokens' bytes make the content (here "水" is three tokens of a byte each), and a
    // stream reports the same tokens and scores.
    let chat = serde_json::json!({
        "messages": [{"role": "user", "content": "Write the Chinese word for water."}],
        "max_tokens": 24, "temperature": 0, "logprobs": true, "top_logprobs": 3
    });
    let answer = served.post("/v1/chat/completions", &chat.to_string());
    assert_eq!(answer.status, 200, "{}", answer.body);
    let answer = answer.json();
    let content = answer["choices"][0]["message"]["content"].as_str().unwrap();
    let entries = answer["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
    let bytes: Vec<u8> =
        entries.iter().flat_map(|e| e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8)).collect();
    assert_eq!(String::from_utf8(bytes).unwrap(), content);
    assert!(entries.iter().all(|e| e["top_logprobs"].as_array().unwrap().len() == 3));
    let mut stream_body = chat.clone();
    stream_body["stream"] = Value::Bool(true);
    let streamed = served.post("/v1/chat/completions", &stream_body.to_string());
    let streamed_entries: Vec<Value> = streamed
        .body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .flat_map(|d| {
            let chunk: Value = serde_json::from_str(d).unwrap();
            chunk["choices"][0]["logprobs"]["content"].as_array().cloned().unwrap_or_default()
        })
        .collect();
    assert_eq!(streamed_entries, entries);
}

#[test]
fn several_prompts_and_choices_each_equal_their_own_request() {
    let served = Served::start(&["--parallel", "3"]);
    let complete = |body: Value| {
        let answer = served.post("/v1/completions", &body.to_string());
        assert_eq!(answer.status, 200, "{}", answer.body);
        answer.json()
    };
    let texts = |answer: &Value| -> Vec<String> {
        let choices = answer["choices"].as_array().unwrap();
        assert!(choices.iter().enumerate().all(|(i, c)| c["index"] == i), "choices in index order");
        choices.iter().map(|c| c["text"].as_str().unwrap().to_string()).collect()
    };
    // Two prompts, two sampled choices each: choice j samples from seed 40 + j.
    let prompts = ["The capital of France is", "Once upon a time"];
    let body = serde_json::json!({"prompt": prompts, "max_tokens": 6, "temperature": 0.9, "seed": 40, "n": 2});
    let together = complete(body.clone());
    let alone: Vec<String> = (0..4)
        .flat_map(|j| {
            let one =
                serde_json::json!({"prompt": prompts[j / 2], "max_tokens": 6, "temperature": 0.9, "seed": 40 + j});
            texts(&complete(one))
        })
        .collect();
    assert_eq!(texts(&together), alone);
    assert_ne!(alone[0], alone[1], "two choices of one prompt sample differently");

    // A prompt long enough to share (`SHARE_FROM_RUNNING`): its choices after the first start
    // from a copy of the first one's session, and still equal their single requests.
    let long = "The history of the river begins in the mountains, where snow melts each spring and \
                feeds a hundred small streams that join in the valley below. "
        .repeat(3);
    let reused = served.metric("seam_prompt_tokens_reused_total");
    let shared = complete(serde_json::json!({"prompt": long, "max_tokens": 5, "temperature": 0.9, "seed": 7, "n": 3}));
    let long_tokens = shared["usage"]["prompt_tokens"].as_f64().unwrap();
    assert!(long_tokens > 64.0, "{long_tokens} tokens");
    assert!(
        served.metric("seam_prompt_tokens_reused_total") >= reused + 2.0 * (long_tokens - 1.0),
        "the second and third choices reuse the first one's prompt"
    );
    let singles: Vec<String> = (0..3)
        .flat_map(|j| {
            texts(&complete(serde_json::json!({"prompt": long, "max_tokens": 5, "temperature": 0.9, "seed": 7 + j})))
        })
        .collect();
    assert_eq!(texts(&shared), singles);
    let prompt_tokens = together["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(together["usage"]["completion_tokens"], 24);
    assert_eq!(together["usage"]["total_tokens"], prompt_tokens + 24);

    // Streamed: each choice's chunks make its text; one usage chunk, one [DONE].
    let mut streamed_body = body.clone();
    streamed_body["stream"] = Value::Bool(true);
    streamed_body["stream_options"] = serde_json::json!({"include_usage": true});
    let streamed = served.post("/v1/completions", &streamed_body.to_string());
    let mut by_choice = vec![String::new(); 4];
    let mut usage = Vec::new();
    let data: Vec<&str> = streamed.body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.iter().filter(|d| **d == "[DONE]").count(), 1);
    for chunk in data.iter().filter(|d| **d != "[DONE]") {
        let chunk: Value = serde_json::from_str(chunk).unwrap();
        for choice in chunk["choices"].as_array().unwrap() {
            by_choice[choice["index"].as_u64().unwrap() as usize].push_str(choice["text"].as_str().unwrap());
        }
        if !chunk["usage"].is_null() {
            usage.push(chunk["usage"].clone());
        }
    }
    assert_eq!(by_choice, alone);
    assert_eq!(usage, vec![together["usage"].clone()]);

    // An evaluation harness' batch: token-id prompts, echoed and scored, several in a request.
    let scored = |prompt: Value| {
        complete(serde_json::json!({"prompt": prompt, "max_tokens": 1, "logprobs": 1, "echo": true, "temperature": 0}))
    };
    let batch = scored(serde_json::json!([[504, 3575, 282, 4649, 314], [9064, 2115, 253, 655]]));
    for (i, prompt) in [serde_json::json!([504, 3575, 282, 4649, 314]), serde_json::json!([9064, 2115, 253, 655])]
        .into_iter()
        .enumerate()
    {
        let single = scored(prompt);
        assert_eq!(batch["choices"][i]["logprobs"], single["choices"][0]["logprobs"], "prompt {i}");
        assert_eq!(batch["choices"][i]["text"], single["choices"][0]["text"], "prompt {i}");
    }
    let echoed = batch["choices"][0]["text"].as_str().unwrap();
    assert!(echoed.starts_with("The capital of France is"), "the echo is the ids' text: {echoed:?}");
}

#[test]
fn penalties_and_biases_change_greedy_picks() {
    let served = Served::start(&[]);
    let text = |extra: Value| {
        let mut body = serde_json::json!({"prompt": "1, 1, 1, 1, 1, 1,", "max_tokens": 12, "temperature": 0});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let answer = served.post("/v1/completions", &body.to_string());
        assert_eq!(answer.status, 200, "{}", answer.body);
        answer.json()["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let plain = text(serde_json::json!({}));
    assert_eq!(plain, text(serde_json::json!({"presence_penalty": 0, "repetition_penalty": 1})));
    for penalty in [serde_json::json!({"frequency_penalty": 2}), serde_json::json!({"repetition_penalty": 1.5})] {
        let penalized = text(penalty.clone());
        assert_ne!(penalized, plain, "{penalty}");
        assert_eq!(penalized, text(penalty.clone()), "{penalty}: greedy with penalties is deterministic");
    }
    // A bias of 100 makes a token every pick; -100 keeps the plain text's first token out.
    let body = serde_json::json!({"prompt": "1, 1,", "max_tokens": 6, "temperature": 0, "logprobs": 0, "logit_bias": {"28": 100}});
    let forced = served.post("/v1/completions", &body.to_string()).json();
    let tokens = forced["choices"][0]["logprobs"]["tokens"].as_array().unwrap().clone();
    let comma = served.post("/detokenize", r#"{"tokens": [28]}"#).json()["prompt"].clone();
    assert!(tokens.len() == 6 && tokens.iter().all(|t| *t == comma), "{tokens:?}");
    let first =
        served.post("/tokenize", &serde_json::json!({"prompt": plain, "add_special_tokens": false}).to_string());
    let first = first.json()["tokens"][0].clone();
    let banned = text(serde_json::json!({"logit_bias": {first.to_string(): -100}}));
    let banned_tokens =
        served.post("/tokenize", &serde_json::json!({"prompt": banned, "add_special_tokens": false}).to_string());
    assert_ne!(banned_tokens.json()["tokens"][0], first, "{banned:?}");
}

#[test]
fn concurrent_requests_equal_their_solo_output_and_a_hang_up_frees_its_slot() {
    let served = Served::start(&["--parallel", "4"]);
    // More requests than slots, of different lengths, so requests queue, join and leave.
    let requests: Vec<(String, usize)> =
        (0..10).map(|i| (format!("Fact number {i} about the ocean:"), 3 + (i * 5) % 17)).collect();
    let solo: Vec<String> = requests
        .iter()
        .map(|(prompt, n)| {
            let answer = served.post("/v1/completions", &completion_body(prompt, *n, false));
            assert_eq!(answer.status, 200, "{}", answer.body);
            answer.json()["choices"][0]["text"].as_str().unwrap().to_string()
        })
        .collect();
    let together: Vec<(u16, Value)> = std::thread::scope(|scope| {
        let handles: Vec<_> = requests
            .iter()
            .map(|(prompt, n)| {
                let served = &served;
                scope.spawn(move || {
                    let answer = served.post("/v1/completions", &completion_body(prompt, *n, false));
                    (answer.status, answer.json())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, ((status, answer), solo)) in together.iter().zip(&solo).enumerate() {
        assert_eq!(*status, 200, "request {i}: {answer}");
        assert_eq!(answer["choices"][0]["text"], *solo, "request {i} together differs from alone");
        assert_eq!(answer["usage"]["completion_tokens"], requests[i].1, "request {i}");
    }
    assert!(served.metric("seam_batch_size_sum") > served.metric("seam_batch_size_count"), "no step batched two");

    // A streaming client that reads its first chunk and hangs up.
    let mut stream = TcpStream::connect(&served.address).unwrap();
    let body = endless_body("Write a long story about a lighthouse.");
    write!(stream, "POST /v1/completions HTTP/1.0\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut first = [0u8; 256];
    let _ = stream.read(&mut first).unwrap();
    served.wait_for("seam_running_requests", 1.0);
    drop(stream);
    served.wait_for("seam_running_requests", 0.0);
    assert_eq!(served.metric("seam_requests_cancelled_total"), 1.0);
    let after = served.post("/v1/completions", &completion_body(&requests[0].0, requests[0].1, false));
    assert_eq!(after.json()["choices"][0]["text"], solo[0], "a slot freed by a hang-up serves the next request");
}

#[test]
fn a_prompt_that_extends_an_earlier_one_reuses_its_cache_and_gets_seam_runs_text() {
    let served = Served::start(&["--parallel", "1"]);
    let first = "The lighthouse keeper opened the door and";
    let answer = served.post("/v1/completions", &completion_body(first, 6, false));
    assert_eq!(answer.status, 200, "{}", answer.body);
    // The conversation so far and one more turn, as a chat client resends it.
    let longer = format!("{first}{} Then the keeper", answer.json()["choices"][0]["text"].as_str().unwrap());
    let again = served.post("/v1/completions", &completion_body(&longer, 6, false));
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.json()["choices"][0]["text"], seam_run(&longer, false, 6), "reused prefix changed the text");
    let reused = served.metric("seam_prompt_tokens_reused_total");
    assert!(reused >= 8.0, "{reused} prompt tokens reused");
    // The first prompt again: all of it but its last token is reused, and that token goes in
    // as a decode step.
    let repeat = served.post("/v1/completions", &completion_body(first, 6, false));
    assert_eq!(repeat.json()["choices"][0]["text"], answer.json()["choices"][0]["text"], "a repeated prompt");
    assert_eq!(repeat.json()["usage"]["prompt_tokens"], answer.json()["usage"]["prompt_tokens"]);
    let prompt_tokens = answer.json()["usage"]["prompt_tokens"].as_f64().unwrap();
    assert!(served.metric("seam_prompt_tokens_reused_total") >= reused + prompt_tokens - 1.0);
}

#[test]
fn mistakes_get_openai_errors_and_a_full_queue_gets_429() {
    let served = Served::start(&["--parallel", "1", "--max-queue", "1"]);
    let error = |answer: &Response| answer.json()["error"].clone();

    let malformed = served.post("/v1/chat/completions", "{\"messages\": [");
    assert_eq!(malformed.status, 400);
    assert_eq!(error(&malformed)["type"], "invalid_request_error");
    let missing =
        served.post("/v1/chat/completions", r#"{"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}"#);
    assert_eq!(missing.status, 404);
    assert_eq!(error(&missing)["code"], "model_not_found");
    let too_long = served.post("/v1/completions", &completion_body("Hello", 1_000_000, false));
    assert_eq!(too_long.status, 400);
    assert_eq!(error(&too_long)["code"], "context_length_exceeded");
    let message = error(&too_long)["message"].as_str().unwrap().to_string();
    assert!(message.contains("8192") && message.contains("1000000"), "{message}");
    for (body, param) in [
        (r#"{"prompt": "x", "n": 2}"#, "n"),
        (r#"{"prompt": "x", "max_tokens": 0}"#, "max_tokens"),
        (r#"{"prompt": [99999999]}"#, "prompt"),
        (r#"{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}"#, "stop"),
    ] {
        let answer = served.post("/v1/completions", body);
        assert_eq!(answer.status, 400, "{body}: {}", answer.body);
        assert_eq!(error(&answer)["param"], param, "{body}");
    }
    let bad_temperature = served.post("/v1/completions", r#"{"prompt": "x", "temperature": -1}"#);
    assert_eq!(bad_temperature.status, 400);
    assert_eq!(served.get("/v1/nothing").status, 404);

    // One running, one queued: the third is refused at once.
    let long = endless_body("Tell me about the sea.");
    let mut running = TcpStream::connect(&served.address).unwrap();
    write!(running, "POST /v1/completions HTTP/1.0\r\nContent-Length: {}\r\n\r\n{long}", long.len()).unwrap();
    served.wait_for("seam_running_requests", 1.0);
    let queued_address = served.address.clone();
    let queued = std::thread::spawn(move || {
        request(&queued_address, "POST", "/v1/completions", Some(&completion_body("Hi", 2, false)))
    });
    served.wait_for("seam_queue_depth", 1.0);
    let refused = served.post("/v1/completions", &completion_body("Hi", 2, false));
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert!(refused.head.to_ascii_lowercase().contains("retry-after: 1"), "{}", refused.head);
    assert_eq!(error(&refused)["code"], "queue_full");
    drop(running);
    let queued = queued.join().unwrap();
    assert_eq!(queued.status, 200, "the queued request runs once the slot is free: {}", queued.body);
}

#[test]
fn what_the_server_does_not_do_is_refused_and_slow_clients_are_cut_off() {
    let served = Served::start(&["--read-timeout", "1"]);
    let error = |answer: &Response| answer.json()["error"].clone();
    let user = r#"[{"role": "user", "content": "hi"}]"#;
    // Asked for, not done: refused, never answered as if not asked.
    for (path, body, param) in [
        ("/v1/chat/completions", format!(r#"{{"messages": {user}, "tools": [{{"type": "function"}}]}}"#), "tools"),
        ("/v1/chat/completions", format!(r#"{{"messages": {user}, "tool_choice": "required"}}"#), "tool_choice"),
        (
            "/v1/chat/completions",
            format!(r#"{{"messages": {user}, "response_format": {{"type": "json_object"}}}}"#),
            "response_format",
        ),
        ("/v1/chat/completions", format!(r#"{{"messages": {user}, "logit_bias": {{"x": 5}}}}"#), "logit_bias"),
        ("/v1/chat/completions", format!(r#"{{"messages": {user}, "logit_bias": {{"49152": 5}}}}"#), "logit_bias"),
        ("/v1/chat/completions", format!(r#"{{"messages": {user}, "logit_bias": {{"42": 101}}}}"#), "logit_bias"),
        ("/v1/chat/completions", format!(r#"{{"messages": {user}, "top_logprobs": 2}}"#), "top_logprobs"),
        ("/v1/chat/completions", r#"{"messages": [{"role": "wizard", "content": "hi"}]}"#.into(), "messages"),
        ("/v1/chat/completions", r#"{"messages": [{"role": "tool", "content": "42"}]}"#.into(), "messages"),
        ("/v1/chat/completions", r#"{"messages": [{"role": "user", "content": null}]}"#.into(), "messages"),
        ("/v1/chat/completions", format!(r#"{{"messages": {user}, "logprobs": 3}}"#), "logprobs"),
        (
            "/v1/chat/completions",
            format!(r#"{{"messages": {user}, "logprobs": true, "top_logprobs": 21}}"#),
            "top_logprobs",
        ),
        ("/v1/chat/completions", format!(r#"{{"messages": {user}, "presence_penalty": 2.5}}"#), "presence_penalty"),
        ("/v1/chat/completions", format!(r#"{{"messages": {user}, "repetition_penalty": 0}}"#), "repetition_penalty"),
        ("/v1/completions", r#"{"prompt": "x", "logprobs": true}"#.into(), "logprobs"),
        ("/v1/completions", r#"{"prompt": "x", "logprobs": 21}"#.into(), "logprobs"),
        ("/v1/completions", r#"{"prompt": "x", "max_tokens": 0}"#.into(), "max_tokens"),
        ("/v1/completions", r#"{"prompt": "x", "n": 0}"#.into(), "n"),
        ("/v1/completions", r#"{"prompt": "x", "n": 65}"#.into(), "n"),
        ("/v1/completions", r#"{"prompt": ["x", "y"], "n": 18446744073709551615}"#.into(), "prompt"),
        ("/v1/completions", r#"{"prompt": ["x", "y"], "n": 33}"#.into(), "prompt"),
        ("/v1/completions", r#"{"prompt": []}"#.into(), "prompt"),
        ("/v1/completions", r#"{"prompt": "x", "suffix": "y"}"#.into(), "suffix"),
        ("/v1/completions", r#"{"prompt": "x", "best_of": 3}"#.into(), "best_of"),
        ("/v1/completions", format!(r#"{{"prompt": "{}"}}"#, "hello ".repeat(9000)), "prompt"),
    ] {
        let answer = served.post(path, &body);
        assert_eq!(answer.status, 400, "{body:.80}: {}", answer.body);
        assert_eq!(error(&answer)["param"], param, "{body:.80}");
    }
    // What is a no-op without tools, and the newer name of `system`, are served.
    let served_anyway = served.post(
        "/v1/chat/completions",
        r#"{"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}],
            "tool_choice": "none", "response_format": {"type": "text"}, "logit_bias": {}, "max_tokens": 2}"#,
    );
    assert_eq!(served_anyway.status, 200, "{}", served_anyway.body);

    let wrong_method = served.get("/v1/completions");
    assert_eq!(wrong_method.status, 405);
    assert_eq!(error(&wrong_method)["type"], "invalid_request_error");

    // A body declared over the limit is refused before any of it arrives.
    let mut huge = TcpStream::connect(&served.address).unwrap();
    write!(huge, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n\r\n{{").unwrap();
    huge.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut answer = String::new();
    let _ = huge.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("request_too_large"), "{answer}");

    // A client that stops sending gets 408 (body) or loses the connection (headers) after the
    // read timeout, instead of holding it.
    for (partial, expect) in [
        ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"", "HTTP/1.1 408"),
        ("POST /v1/completions HTTP/1.1\r\nHost: x\r\n", ""),
    ] {
        let mut slow = TcpStream::connect(&served.address).unwrap();
        slow.write_all(partial.as_bytes()).unwrap();
        slow.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let started = Instant::now();
        let mut answer = String::new();
        let _ = slow.read_to_string(&mut answer);
        assert!(started.elapsed() < Duration::from_secs(20), "{partial:?}: held for {:?}", started.elapsed());
        assert!(answer.starts_with(expect), "{partial:?}: {answer}");
    }
    assert_eq!(served.get("/health").status, 200);
}

#[test]
fn sigterm_lets_the_running_request_finish_then_exits() {
    let mut served = Served::start(&["--parallel", "2"]);
    let address = served.address.clone();
    let running = std::thread::spawn(move || {
        request(&address, "POST", "/v1/completions", Some(&completion_body("The history of bridges", 40, false)))
    });
    served.wait_for("seam_running_requests", 1.0);
    let status = Command::new("kill").args(["-TERM", &served.child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let answer = running.join().unwrap();
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["usage"]["completion_tokens"], 40);
    let deadline = Instant::now() + Duration::from_secs(30);
    let exit = loop {
        if let Some(exit) = served.child.try_wait().unwrap() {
            break exit;
        }
        assert!(Instant::now() < deadline, "seam serve did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(exit.success(), "seam serve exited with {exit}");
}

#[test]
fn resident_memory_stays_flat_over_a_thousand_requests() {
    const REQUESTS: usize = 1000;
    const CLIENTS: usize = 8;
    let served = Served::start(&["--parallel", "8"]);
    let run = |count: usize| {
        std::thread::scope(|scope| {
            for client in 0..CLIENTS {
                let served = &served;
                scope.spawn(move || {
                    for i in (client..count).step_by(CLIENTS) {
                        let stream = i % 2 == 0;
                        let body = completion_body(&format!("Request {i} says"), 2, stream);
                        let answer = served.post("/v1/completions", &body);
                        assert_eq!(answer.status, 200, "request {i}: {}", answer.body);
                        if stream {
                            let (_, finish, done) = answer.stream_text();
                            assert!(done && finish.is_some(), "request {i}: truncated stream {}", answer.body);
                        } else {
                            assert_eq!(answer.json()["usage"]["completion_tokens"], 2, "request {i}");
                        }
                    }
                });
            }
        })
    };
    run(100);
    let warm = served.resident_bytes();
    run(REQUESTS);
    let after = served.resident_bytes();
    let growth = after as f64 / warm as f64 - 1.0;
    eprintln!("resident: {warm} bytes after 100 requests, {after} after {REQUESTS} more ({:+.2}%)", growth * 100.0);
    assert!(growth < 0.05, "resident memory grew {:.1}% over {REQUESTS} requests", growth * 100.0);
    assert_eq!(served.metric("seam_requests_completed_total"), (100 + REQUESTS) as f64);
}
