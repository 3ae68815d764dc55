//! [`ChatTemplate`]: renders a conversation into a chat model's prompt text with the model's
//! Jinja template, the way Hugging Face transformers' `apply_chat_template` does.

use crate::error::{read_model_file, Result, TokenizerError};
use crate::json_dumps;
use aho_corasick::{AhoCorasick, MatchKind};
use minijinja::{Environment, Value};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (templates may know more, such as `tool`).
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with any role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into() }
    }

    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// The name the template is stored under in its environment.
const TEMPLATE_NAME: &str = "chat_template";

/// A model's chat template, compiled, with the special tokens it refers to.
///
/// Rendering matches Hugging Face transformers: `trim_blocks` and `lstrip_blocks` on, no trailing
/// newline kept; the variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`;
/// the functions `raise_exception(message)` and `strftime_now(format)` (local time, as Python's
/// `datetime.now()`); Python's `str`, `dict` and `list` methods; `tojson` as Python's
/// `json.dumps`. The `{% generation %}` tag of training templates is not supported.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
    add_bos_token: Option<bool>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("add_bos_token", &self.add_bos_token)
            .field("source_len", &self.source.len())
            .finish()
    }
}

/// The error a template's `raise_exception` call carries, found again in the render error.
#[derive(Debug)]
struct RaisedException(String);

impl std::fmt::Display for RaisedException {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

fn raise_exception(message: Value) -> std::result::Result<Value, minijinja::Error> {
    let message = message.to_string();
    Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, format!("raise_exception: {message}"))
        .with_source(RaisedException(message)))
}

fn strftime_now(format: &str) -> std::result::Result<String, minijinja::Error> {
    let now = jiff::Zoned::now();
    jiff::fmt::strtime::format(format, &now).map_err(|e| {
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, format!("strftime_now({format:?}): {e}"))
    })
}

/// The message of a `raise_exception` call behind `err`, if that is what failed.
fn raised_message(err: &minijinja::Error) -> Option<String> {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = current {
        if let Some(raised) = e.downcast_ref::<RaisedException>() {
            return Some(raised.0.clone());
        }
        current = e.source();
    }
    None
}

/// A minijinja error with its detail and location on one line.
fn describe(err: &minijinja::Error) -> String {
    match (err.name(), err.line()) {
        (Some(name), Some(line)) => format!("{err} ({name} line {line})"),
        _ => err.to_string(),
    }
}

impl ChatTemplate {
    /// The file holding the chat template and special tokens in a Hugging Face model directory.
    pub const CONFIG_FILE_NAME: &'static str = "tokenizer_config.json";

    /// Loads the chat template of a Hugging Face model directory: `chat_template` of
    /// `tokenizer_config.json` (a string, or a list of `{name, template}` of which `default` is
    /// used), or else a `chat_template.jinja` or `chat_template.json` file beside it, as newer
    /// transformers versions save them; `bos_token`, `eos_token` and `add_bos_token` come from
    /// `tokenizer_config.json`.
    ///
    /// A directory without any template gives [`TokenizerError::NoChatTemplate`].
    pub fn from_model_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config_path = Self::config_path(dir);
        let config = match read_model_file(&config_path) {
            Ok(bytes) => Some(TokenizerConfig::parse(&config_path, &bytes)?),
            Err(TokenizerError::MissingFile { .. }) => None,
            Err(e) => return Err(e),
        };
        let template = match config.as_ref().and_then(|c| c.chat_template.clone()) {
            Some(template) => Some(template),
            None => Self::template_beside_config(dir)?,
        };
        let Some(template) = template else {
            return Err(match config {
                Some(_) => TokenizerError::NoChatTemplate { dir: dir.to_path_buf() },
                // Neither a config nor a template file: the config is the missing piece.
                None => TokenizerError::MissingFile { path: config_path },
            });
        };
        let config = config.unwrap_or_default();
        let mut chat = Self::from_source(template, config.bos_token, config.eos_token)?;
        chat.add_bos_token = config.add_bos_token;
        Ok(chat)
    }

    /// `chat_template.jinja`, else `chat_template.json`'s `chat_template`, in `dir`.
    fn template_beside_config(dir: &Path) -> Result<Option<String>> {
        let jinja_path = dir.join("chat_template.jinja");
        match read_model_file(&jinja_path) {
            Ok(bytes) => {
                return String::from_utf8(bytes).map(Some).map_err(|_| TokenizerError::MalformedConfig {
                    path: jinja_path,
                    message: "the template is not UTF-8".into(),
                })
            }
            Err(TokenizerError::MissingFile { .. }) => {}
            Err(e) => return Err(e),
        }
        let json_path = dir.join("chat_template.json");
        match read_model_file(&json_path) {
            Ok(bytes) => Ok(TokenizerConfig::parse(&json_path, &bytes)?.chat_template),
            Err(TokenizerError::MissingFile { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Compiles a template given as text (for example from a GGUF file's
    /// `tokenizer.chat_template`), with the special tokens it may refer to.
    pub fn from_source(
        template: impl Into<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self> {
        let source = template.into();
        let mut env = Environment::new();
        // Hugging Face's renderer: ImmutableSandboxedEnvironment(trim_blocks=True,
        // lstrip_blocks=True) with Jinja's default of dropping a single trailing newline.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| TokenizerError::TemplateSyntax { message: describe(&e) })?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", json_dumps::tojson);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| TokenizerError::TemplateSyntax { message: describe(&e) })?;
        Ok(ChatTemplate { env, source, bos_token, eos_token, add_bos_token: None })
    }

    /// Renders `messages` into prompt text. With `add_generation_prompt`, the text ends with the
    /// header of an assistant turn, so the model's next tokens are its answer.
    ///
    /// The result usually starts with the BOS token already: encode it with
    /// `add_special_tokens = false`.
    pub fn apply(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TokenizerError::TemplateRender { message: describe(&e) })?;
        let mut context: BTreeMap<&str, Value> = BTreeMap::new();
        context.insert("messages", Value::from(minijinja::value::Serde(messages)));
        context.insert("add_generation_prompt", Value::from(add_generation_prompt));
        // Transformers passes only the special tokens the tokenizer has: an absent one is
        // undefined (renders empty), not `none` (which would render as text).
        if let Some(bos) = &self.bos_token {
            context.insert("bos_token", Value::from(bos.as_str()));
        }
        if let Some(eos) = &self.eos_token {
            context.insert("eos_token", Value::from(eos.as_str()));
        }
        template.render(context).map_err(|e| match raised_message(&e) {
            Some(message) => TokenizerError::TemplateException { message },
            None => TokenizerError::TemplateRender { message: describe(&e) },
        })
    }

    /// Renders `messages` like [`ChatTemplate::apply`], but remembers where message text spells
    /// one of `special_tokens` (such as `<|im_end|>` typed by a user), so that
    /// [`crate::Tokenizer::encode_chat`] encodes those spans as plain text: a message cannot
    /// close its own turn or forge another. Special tokens the template itself writes stay
    /// special. `special_tokens` is usually [`crate::Tokenizer::special_tokens`].
    ///
    /// Message text is passed to the template with each special-token spelling replaced by a
    /// private-use marker, and the markers are turned back into the spelling after rendering,
    /// so a template that trims or slices messages still sees the rest of the text as it is.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        special_tokens: &[String],
    ) -> Result<RenderedChat> {
        let specials: Vec<&str> = special_tokens.iter().map(String::as_str).filter(|s| !s.is_empty()).collect();
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&specials)
            .map_err(|e| TokenizerError::TemplateRender { message: format!("special tokens: {e}") })?;
        let marker = Marker::unused_in(messages);
        let mut escaped_any = false;
        let escaped: Vec<ChatMessage> = messages
            .iter()
            .map(|m| {
                let (content, escaped) = marker.escape(&m.content, &matcher);
                escaped_any |= escaped;
                ChatMessage { role: m.role.clone(), content }
            })
            .collect();
        if !escaped_any {
            return Ok(RenderedChat { text: self.apply(messages, add_generation_prompt)?, literal_spans: Vec::new() });
        }
        let rendered = self.apply(&escaped, add_generation_prompt)?;
        marker.unescape(&rendered, &specials)
    }

    /// The path of `tokenizer_config.json` in `dir` (for callers' messages).
    pub fn config_path(dir: impl AsRef<Path>) -> PathBuf {
        dir.as_ref().join(Self::CONFIG_FILE_NAME)
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The BOS token's text, as the template sees it.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS token's text, as the template sees it.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// `add_bos_token` of `tokenizer_config.json`, when it says.
    pub fn add_bos_token(&self) -> Option<bool> {
        self.add_bos_token
    }
}

/// A conversation rendered into prompt text by [`ChatTemplate::render`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedChat {
    /// The prompt text, exactly as [`ChatTemplate::apply`] renders it.
    pub text: String,
    /// Byte ranges of `text` that came from message text and spell a special token: they are
    /// to be encoded as text, not as the special token. Sorted, not overlapping.
    pub literal_spans: Vec<Range<usize>>,
}

/// The private-use marker that stands for a special-token spelling inside message text while
/// the template renders: `\u{E000}` + a nonce + `:` + the token's index + `\u{E001}`. The nonce
/// is chosen so that no message contains the marker's opening, so a user cannot spell a marker.
struct Marker {
    open: String,
}

const MARKER_CLOSE: char = '\u{E001}';

impl Marker {
    fn unused_in(messages: &[ChatMessage]) -> Marker {
        (0u64..)
            .map(|nonce| Marker { open: format!("\u{E000}{nonce}:") })
            .find(|m| messages.iter().all(|msg| !msg.content.contains(&m.open)))
            .expect("some nonce is unused: each message rules out finitely many")
    }

    /// `text` with every special-token spelling replaced by a marker (leftmost, and the longest
    /// spelling where several start at one place), and whether any was.
    /// One pass over `text` whatever the number of spellings (a message is untrusted input: a
    /// search per spelling per occurrence would be quadratic in it).
    fn escape(&self, text: &str, specials: &AhoCorasick) -> (String, bool) {
        let mut out = String::with_capacity(text.len());
        let (mut copied, mut escaped) = (0, false);
        for found in specials.find_iter(text) {
            escaped = true;
            out.push_str(&text[copied..found.start()]);
            out.push_str(&self.open);
            out.push_str(&found.pattern().as_usize().to_string());
            out.push(MARKER_CLOSE);
            copied = found.end();
        }
        out.push_str(&text[copied..]);
        (out, escaped)
    }

    /// The rendered text with markers turned back into spellings, and where they are.
    fn unescape(&self, rendered: &str, specials: &[&str]) -> Result<RenderedChat> {
        let altered = || TokenizerError::TemplateRender {
            message: "the chat template altered message text that spells a special token; \
                      parse special tokens in messages instead (seam run --parse-special)"
                .into(),
        };
        let mut text = String::with_capacity(rendered.len());
        let mut literal_spans = Vec::new();
        let mut rest = rendered;
        while let Some(at) = rest.find(&self.open) {
            text.push_str(&rest[..at]);
            let after = &rest[at + self.open.len()..];
            let close = after.find(MARKER_CLOSE).ok_or_else(altered)?;
            let k: usize = after[..close].parse().map_err(|_| altered())?;
            let spelling = specials.get(k).ok_or_else(altered)?;
            literal_spans.push(text.len()..text.len() + spelling.len());
            text.push_str(spelling);
            rest = &after[close + MARKER_CLOSE.len_utf8()..];
        }
        text.push_str(rest);
        Ok(RenderedChat { text, literal_spans })
    }
}

/// The fields of `tokenizer_config.json` this crate reads.
#[derive(Debug, Default)]
struct TokenizerConfig {
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    add_bos_token: Option<bool>,
}

impl TokenizerConfig {
    fn parse(path: &Path, bytes: &[u8]) -> Result<Self> {
        let malformed = |message: String| TokenizerError::MalformedConfig { path: path.to_path_buf(), message };
        let json: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| malformed(e.to_string()))?;
        let object = json.as_object().ok_or_else(|| malformed("the file is not a JSON object".into()))?;
        let chat_template = match object.get("chat_template") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(named)) => Some(default_named_template(named).map_err(malformed)?),
            Some(_) => return Err(malformed("chat_template is neither a string nor a list of named templates".into())),
        };
        let token = |field: &str| -> Result<Option<String>> {
            match object.get(field) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                // An AddedToken object: {"content": "<s>", "lstrip": false, ...}.
                Some(serde_json::Value::Object(o)) => match o.get("content") {
                    Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                    _ => Err(malformed(format!("{field} is an object without a string 'content'"))),
                },
                Some(_) => Err(malformed(format!("{field} is neither a string nor a token object"))),
            }
        };
        let add_bos_token = match object.get("add_bos_token") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::Bool(b)) => Some(*b),
            Some(_) => return Err(malformed("add_bos_token is not a boolean".into())),
        };
        Ok(TokenizerConfig {
            chat_template,
            bos_token: token("bos_token")?,
            eos_token: token("eos_token")?,
            add_bos_token,
        })
    }
}

/// The template named `default` of a `[{name, template}, ...]` list (transformers' format for
/// models with several templates, such as `tool_use` and `rag`).
fn default_named_template(named: &[serde_json::Value]) -> std::result::Result<String, String> {
    let mut names = Vec::new();
    for entry in named {
        let name = entry.get("name").and_then(|n| n.as_str());
        let template = entry.get("template").and_then(|t| t.as_str());
        let (Some(name), Some(template)) = (name, template) else {
            return Err("chat_template lists an entry without a string 'name' and 'template'".into());
        };
        if name == "default" {
            return Ok(template.to_owned());
        }
        names.push(name.to_owned());
    }
    Err(format!("chat_template lists named templates ({}) but none named 'default'", names.join(", ")))
}
