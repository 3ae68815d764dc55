//! The OpenAI wire format: request bodies as they arrive, responses and stream chunks as clients
//! expect them, and errors in OpenAI's `{"error": {...}}` shape.

use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    /// The model to run; absent means the one served.
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<ChatMessageIn>,
    /// Shared sampling and stopping parameters.
    #[serde(flatten)]
    pub params: Params,
    /// The newer name of `max_tokens` for chat.
    pub max_completion_tokens: Option<u64>,
}

/// A message of a chat request.
#[derive(Debug, Deserialize)]
pub struct ChatMessageIn {
    /// `system`, `user`, `assistant` (or what the model's template knows).
    pub role: String,
    /// Text, or a list of parts of which text parts are read.
    pub content: Option<Content>,
    /// Tool calls an assistant made; refused (this server calls no tools).
    pub tool_calls: Option<Vec<IgnoredAny>>,
}

/// A message's content.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Typed parts (`{"type": "text", "text": ...}`).
    Parts(Vec<ContentPart>),
}

/// One part of a message's content.
#[derive(Debug, Deserialize)]
pub struct ContentPart {
    /// The part's type; only `text` is read.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    pub text: Option<String>,
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    /// The model to run; absent means the one served.
    pub model: Option<String>,
    /// The prompt: a string or token ids, or a list of either, each prompt getting `n` choices.
    pub prompt: Prompt,
    /// Shared sampling and stopping parameters.
    #[serde(flatten)]
    pub params: Params,
    /// Echo the prompt before the completion (with its tokens' log-probabilities when
    /// `logprobs` is set: how evaluation harnesses score a text).
    #[serde(default)]
    pub echo: bool,
    /// Text after the completion (insertion); refused when not empty.
    pub suffix: Option<String>,
    /// Completions to choose the best of; refused above 1.
    pub best_of: Option<u64>,
}

/// A completion prompt.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// One prompt.
    Text(String),
    /// Several prompts.
    Texts(Vec<String>),
    /// Token ids.
    Tokens(Vec<u32>),
    /// Several prompts of token ids, as evaluation harnesses send them.
    TokenLists(Vec<Vec<u32>>),
}

/// `logprobs`: a flag for chat, a count of alternatives for completions.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(untagged)]
pub enum LogprobsParam {
    /// Chat's form: report the generated tokens' log-probabilities.
    Flag(bool),
    /// Completions' form: report them with this many most likely alternatives per token.
    Count(u64),
}

/// Parameters both endpoints take.
#[derive(Debug, Deserialize, Default)]
pub struct Params {
    /// Most tokens to generate.
    pub max_tokens: Option<u64>,
    /// Sampling temperature; 0 is greedy. OpenAI's default is 1.
    pub temperature: Option<f32>,
    /// Nucleus sampling mass.
    pub top_p: Option<f32>,
    /// Sampling from the k most likely tokens (an extension llama.cpp and vLLM accept too).
    pub top_k: Option<u64>,
    /// Makes sampling repeatable.
    pub seed: Option<i64>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Stream server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Stream options.
    pub stream_options: Option<StreamOptions>,
    /// Choices to generate per prompt, each sampled from its own seed (the request's `seed`,
    /// then the next ones).
    pub n: Option<u64>,
    /// Subtracted from the logit of every token generated so far (-2 to 2).
    pub presence_penalty: Option<f32>,
    /// Subtracted from a token's logit once per time it was generated (-2 to 2).
    pub frequency_penalty: Option<f32>,
    /// Divides the positive logits (multiplies the negative ones) of tokens in the prompt or
    /// the output; 1 is off (an extension vLLM and llama.cpp's server accept too).
    pub repetition_penalty: Option<f32>,
    /// Keep generating through EOS ids, to `max_tokens` (an extension vLLM and llama.cpp's server
    /// accept too; benchmarks use it).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Report log-probabilities: `true` for chat, a number of alternatives (0 to 20) for
    /// completions.
    pub logprobs: Option<LogprobsParam>,
    /// Chat: the most likely alternatives reported per token (0 to 20; needs `logprobs`).
    pub top_logprobs: Option<u64>,
    /// Added to the logits of token ids (given as strings, as OpenAI's clients send them), -100
    /// to 100.
    pub logit_bias: Option<std::collections::HashMap<String, f32>>,
    /// The output's format; only `{"type": "text"}` is served.
    pub response_format: Option<ResponseFormat>,
    /// Tools the model may call; refused when not empty (this server calls no tools).
    pub tools: Option<Vec<IgnoredAny>>,
    /// Which tool to call; only `none` and `auto` (without tools: no call) are served.
    pub tool_choice: Option<ToolChoice>,
    /// The older name of `tools`; refused when not empty.
    pub functions: Option<Vec<IgnoredAny>>,
    /// The older name of `tool_choice`.
    pub function_call: Option<ToolChoice>,
}

/// `response_format`.
#[derive(Debug, Deserialize)]
pub struct ResponseFormat {
    /// `text`, `json_object` or `json_schema`.
    #[serde(rename = "type")]
    pub kind: String,
}

/// `tool_choice` (or `function_call`): a mode, or a named tool.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ToolChoice {
    /// `none`, `auto` or `required`.
    Mode(String),
    /// A tool named to be called.
    Named(IgnoredAny),
}

/// `stop`: one string or several.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Deserialize, Default)]
pub struct StreamOptions {
    /// Send a last chunk with the usage counts.
    #[serde(default)]
    pub include_usage: bool,
}

/// Token counts of a request.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Both.
    pub total_tokens: usize,
}

/// A chat answer's message.
#[derive(Debug, Serialize)]
pub struct ChatMessageOut {
    /// Always `assistant`.
    pub role: &'static str,
    /// The generated text.
    pub content: String,
}

/// A choice of a non-streamed chat answer.
#[derive(Debug, Serialize)]
pub struct ChatChoice {
    /// The choice's place among the request's choices (prompt by prompt, `n` each), from 0.
    pub index: usize,
    /// The answer.
    pub message: ChatMessageOut,
    /// `stop` or `length`.
    pub finish_reason: &'static str,
    /// The tokens' log-probabilities, when asked for.
    pub logprobs: Option<ChatLogprobs>,
}

/// Chat's log-probabilities: one entry per generated token.
#[derive(Debug, Clone, Serialize, Default)]
pub struct ChatLogprobs {
    /// The tokens of the content, in order.
    pub content: Vec<ChatTokenLogprob>,
}

/// One token of chat's log-probabilities.
#[derive(Debug, Clone, Serialize)]
pub struct ChatTokenLogprob {
    /// The token and its log-probability under the model (before temperature, penalties or
    /// truncation).
    #[serde(flatten)]
    pub scored: ChatTokenScore,
    /// The most likely tokens at this position, most likely first.
    pub top_logprobs: Vec<ChatTokenScore>,
}

/// A token with its log-probability, as chat reports each token and each alternative.
#[derive(Debug, Clone, Serialize)]
pub struct ChatTokenScore {
    /// The token's text (a part of a character shows as U+FFFD; `bytes` has it whole).
    pub token: String,
    /// Its log-probability.
    pub logprob: f64,
    /// Its bytes.
    pub bytes: Vec<u8>,
}

/// Completions' log-probabilities (the legacy shape): parallel lists, one entry per token.
#[derive(Debug, Clone, Serialize, Default)]
pub struct CompletionLogprobs {
    /// The tokens' texts.
    pub tokens: Vec<String>,
    /// Their log-probabilities; null for an echoed prompt's first token (nothing precedes it).
    pub token_logprobs: Vec<Option<f64>>,
    /// The most likely tokens at each position, by text; null where `token_logprobs` is.
    pub top_logprobs: Vec<Option<TopLogprobs>>,
    /// Where each token's text starts in the choice's text, in characters.
    pub text_offset: Vec<usize>,
}

/// A position's most likely tokens as a JSON object from text to log-probability, most
/// likely first (a text two tokens share keeps the likelier).
#[derive(Debug, Clone, Default)]
pub struct TopLogprobs(pub Vec<(String, f64)>);

impl Serialize for TopLogprobs {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|(token, logprob)| (token, logprob)))
    }
}

/// A non-streamed chat answer.
#[derive(Debug, Serialize)]
pub struct ChatResponse {
    /// `chatcmpl-...`.
    pub id: String,
    /// `chat.completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The model's id.
    pub model: String,
    /// One choice per sequence asked for.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
}

/// The delta of a streamed chat chunk.
#[derive(Debug, Serialize, Default)]
pub struct Delta {
    /// `assistant` in the first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// A choice of a streamed chat chunk.
#[derive(Debug, Serialize)]
pub struct ChatChunkChoice {
    /// The choice's place among the request's choices (prompt by prompt, `n` each), from 0.
    pub index: usize,
    /// What is new.
    pub delta: Delta,
    /// Set in the last chunk.
    pub finish_reason: Option<&'static str>,
    /// The log-probabilities of the tokens whose text this chunk carries, when asked for.
    pub logprobs: Option<ChatLogprobs>,
}

/// A streamed chat chunk.
#[derive(Debug, Serialize)]
pub struct ChatChunk {
    /// The same in every chunk of a request.
    pub id: String,
    /// `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The model's id.
    pub model: String,
    /// One choice (chunks of several choices interleave), or none in the usage chunk.
    pub choices: Vec<ChatChunkChoice>,
    /// Only in the usage chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// A choice of a completion answer or chunk.
#[derive(Debug, Serialize)]
pub struct CompletionChoice {
    /// The choice's place among the request's choices (prompt by prompt, `n` each), from 0.
    pub index: usize,
    /// The generated text (new text, in a chunk).
    pub text: String,
    /// Set at the end.
    pub finish_reason: Option<&'static str>,
    /// The tokens' log-probabilities (in a chunk, those of the tokens whose text it carries),
    /// when asked for.
    pub logprobs: Option<CompletionLogprobs>,
}

/// A completion answer, or one chunk of a streamed one.
#[derive(Debug, Serialize)]
pub struct CompletionResponse {
    /// `cmpl-...`.
    pub id: String,
    /// `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The model's id.
    pub model: String,
    /// Every choice (a chunk: one), or none in the usage chunk.
    pub choices: Vec<CompletionChoice>,
    /// Token counts (in a stream, only in the usage chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// `GET /v1/models`.
#[derive(Debug, Serialize)]
pub struct ModelList {
    /// `list`.
    pub object: &'static str,
    /// The one model served.
    pub data: Vec<ModelCard>,
}

/// One model of `GET /v1/models`.
#[derive(Debug, Serialize)]
pub struct ModelCard {
    /// The id requests name.
    pub id: String,
    /// `model`.
    pub object: &'static str,
    /// Unix seconds the server started.
    pub created: u64,
    /// `seam`.
    pub owned_by: &'static str,
    /// The context length.
    pub max_model_len: usize,
}

/// OpenAI's error body.
#[derive(Debug, Serialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// What went wrong.
#[derive(Debug, Serialize)]
pub struct ErrorDetail {
    /// A sentence for the user.
    pub message: String,
    /// `invalid_request_error`, `not_found_error`, `server_error`, ...
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The request field at fault, when one is.
    pub param: Option<&'static str>,
    /// A stable code (`context_length_exceeded`, `model_not_found`, ...).
    pub code: Option<&'static str>,
}

/// `POST /tokenize` (vLLM's shape, which evaluation harnesses use as a remote tokenizer): a
/// prompt, or chat messages rendered by the model's template.
#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    /// The model; absent means the one served.
    pub model: Option<String>,
    /// Text to tokenize.
    pub prompt: Option<String>,
    /// Or a chat, rendered by the model's chat template first.
    pub messages: Option<Vec<ChatMessageIn>>,
    /// Add what the tokenizer puts around a sequence (a BOS token); a prompt only.
    #[serde(default = "default_true")]
    pub add_special_tokens: bool,
    /// Open the assistant's turn after the messages.
    #[serde(default = "default_true")]
    pub add_generation_prompt: bool,
}

fn default_true() -> bool {
    true
}

/// The answer to `POST /tokenize`.
#[derive(Debug, Serialize)]
pub struct TokenizeResponse {
    /// The token ids.
    pub tokens: Vec<u32>,
    /// How many.
    pub count: usize,
    /// The context length they must fit, with the completion.
    pub max_model_len: usize,
}

/// `POST /detokenize`.
#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    /// The model; absent means the one served.
    pub model: Option<String>,
    /// Token ids to turn into text (special tokens spelled out).
    pub tokens: Vec<u32>,
}

/// The answer to `POST /detokenize`.
#[derive(Debug, Serialize)]
pub struct DetokenizeResponse {
    /// The text.
    pub prompt: String,
}

/// `GET /tokenizer_info`: what a client needs to tokenize as the server does.
#[derive(Debug, Serialize)]
pub struct TokenizerInfo {
    /// The EOS token's text.
    pub eos_token: Option<String>,
    /// The BOS token's text.
    pub bos_token: Option<String>,
    /// The chat template's Jinja source.
    pub chat_template: Option<String>,
    /// The context length.
    pub model_max_length: usize,
    /// The number of tokens, special ones included.
    pub vocab_size: usize,
}
