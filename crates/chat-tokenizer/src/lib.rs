//! The text layer above the seam: a model directory's tokenizer and chat template.
//!
//! Backends exchange token ids only. This crate turns text into ids and back
//! ([`Tokenizer`], loaded from a Hugging Face `tokenizer.json`) and renders a conversation into
//! the prompt text a chat model was trained on ([`ChatTemplate`], the Jinja template of
//! `tokenizer_config.json`, rendered the way Hugging Face transformers renders it).
//!
//! Both are used by the cli and the generation driver for every backend. [`Tokenizer`]
//! implements [`session_api::generate::Detokenizer`], so the driver can stream text.
//!
//! A chat template usually writes the BOS token itself (Llama 3 starts with `{{ bos_token }}`):
//! encode a rendered conversation with `add_special_tokens = false`, or the BOS appears twice.

pub mod bpe_file;
mod chat_template;
mod error;
mod json_dumps;
mod panic_guard;
mod tokenizer;

pub use chat_template::{ChatMessage, ChatTemplate, RenderedChat};
pub use error::{Result, TokenizerError};
pub use tokenizer::Tokenizer;
