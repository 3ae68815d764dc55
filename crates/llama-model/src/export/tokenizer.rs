//! `tokenizer.ggml.*` metadata for an exported GGUF: copied from another GGUF, or built from a
//! byte-level BPE `tokenizer.json` (the inverse of the importer's `tokenizer.json` from a GGUF).

use super::{gguf_error, ExportError};
use crate::config::LlamaConfig;
use crate::error::ModelError;
use crate::gguf_layout::{pre_tokenizer, token_type};
use crate::model_dir::{TOKENIZER_CONFIG_FILE, TOKENIZER_FILE};
use gguf::{Array, GgufFile, GgufWriter, Value};
use serde_json::Value as Json;
use std::path::Path;

/// Copies every `tokenizer.*` key of the GGUF at `path`; returns its `tokenizer.ggml.pre`.
pub(super) fn copy_from_gguf(w: &mut GgufWriter, path: &Path, vocab_size: usize) -> Result<String, ExportError> {
    let f = GgufFile::open(path).map_err(|source| gguf_error(path, source))?;
    let tokens = f.get_strings("tokenizer.ggml.tokens").map_err(|source| gguf_error(path, source))?;
    if tokens.len() != vocab_size {
        return Err(ExportError::Tokenizer {
            path: path.to_path_buf(),
            message: format!(
                "{} tokens, but the model has {vocab_size} embedding rows (llama.cpp needs one token per row)",
                tokens.len()
            ),
        });
    }
    for (key, value) in f.metadata().iter().filter(|(k, _)| k.starts_with("tokenizer.")) {
        w.add_metadata(key.clone(), value.clone()).map_err(|source| gguf_error(path, source))?;
    }
    Ok(f.get("tokenizer.ggml.pre").and_then(|v| v.as_str()).unwrap_or("default").to_string())
}

/// `tokenizer.ggml.*` from the byte-level BPE `tokenizer.json` of the model directory `dir` (as
/// llama.cpp's converter builds it for `gpt2`-model tokenizers); returns the pre-tokenizer name
/// used and the added tokens left out.
pub(super) fn from_model_dir(
    w: &mut GgufWriter,
    dir: &Path,
    config: &LlamaConfig,
    pre: Option<&str>,
) -> Result<(String, Vec<String>), ExportError> {
    let path = dir.join(TOKENIZER_FILE);
    let bad = |message: String| ExportError::Tokenizer { path: path.clone(), message };
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    let tok: Json = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let model = &tok["model"];
    if model["type"] != "BPE" {
        return Err(bad(format!("a {} tokenizer; only byte-level BPE can be exported", model["type"])));
    }
    let vocab = model["vocab"].as_object().ok_or_else(|| bad("model.vocab is not an object".into()))?;
    let n = config.vocab_size;
    // llama.cpp needs one token per embedding row: ids without a token are unused padding, named
    // as llama.cpp's converter names them.
    let mut tokens: Vec<String> = (0..n).map(|i| format!("[PAD{i}]")).collect();
    let mut types = vec![token_type::UNUSED; n];
    let mut place = |id: &Json, text: &str, ty: i32| -> Result<(), ExportError> {
        let id = id.as_u64().ok_or_else(|| bad(format!("token {text:?} has no integer id")))? as usize;
        if id >= n {
            return Err(bad(format!("token {text:?} has id {id}, outside the model's {n} embedding rows")));
        }
        tokens[id] = text.to_string();
        types[id] = ty;
        Ok(())
    };
    for (text, id) in vocab {
        place(id, text, token_type::NORMAL)?;
    }
    let mut dropped = Vec::new();
    for added in tok["added_tokens"].as_array().into_iter().flatten() {
        let content = added["content"].as_str().ok_or_else(|| bad("an added token has no content".into()))?;
        let ty = if added["special"] == true { token_type::CONTROL } else { token_type::USER_DEFINED };
        // An added token past the embedding rows can never be fed to the model; the base
        // vocabulary past them is a mismatch, and an error.
        if added["id"].as_u64().is_some_and(|id| id >= n as u64) {
            dropped.push(content.to_string());
            continue;
        }
        place(&added["id"], content, ty)?;
    }
    let merges = model["merges"]
        .as_array()
        .ok_or_else(|| bad("model.merges is not an array".into()))?
        .iter()
        .map(|m| match m {
            Json::String(s) => Ok(s.clone()),
            Json::Array(pair) if pair.len() == 2 && pair.iter().all(Json::is_string) => {
                Ok(format!("{} {}", pair[0].as_str().unwrap_or_default(), pair[1].as_str().unwrap_or_default()))
            }
            other => Err(bad(format!("merge {other} is neither \"a b\" nor [\"a\", \"b\"]"))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let pre = match pre {
        Some(p) => p.to_string(),
        None => pre_tokenizer::name_of(&tok["pre_tokenizer"]).map(str::to_string).ok_or_else(|| {
            bad("cannot tell llama.cpp's pre-tokenizer name from pre_tokenizer (known: Llama 3's llama-bpe, \
                 SmolLM's smollm, plain gpt2); give it with --tokenizer-pre"
                .into())
        })?,
    };

    let add = |w: &mut GgufWriter, key: &str, value: Value| {
        w.add_metadata(key, value).map_err(|source| gguf_error(&path, source))
    };
    add(w, "tokenizer.ggml.model", "gpt2".into())?;
    add(w, "tokenizer.ggml.pre", pre.clone().into())?;
    add(w, "tokenizer.ggml.tokens", Array::String(tokens).into())?;
    add(w, "tokenizer.ggml.token_type", Array::I32(types).into())?;
    add(w, "tokenizer.ggml.merges", Array::String(merges).into())?;
    if let Some(&bos) = config.bos_token_ids.first() {
        add(w, "tokenizer.ggml.bos_token_id", bos.into())?;
    }
    if let Some(&eos) = config.eos_token_ids.first() {
        add(w, "tokenizer.ggml.eos_token_id", eos.into())?;
    }
    let config_path = dir.join(TOKENIZER_CONFIG_FILE);
    if let Ok(text) = std::fs::read_to_string(&config_path) {
        let tc: Json = serde_json::from_str(&text)
            .map_err(|e| ExportError::Tokenizer { path: config_path.clone(), message: format!("not JSON: {e}") })?;
        if let Some(flag) = tc["add_bos_token"].as_bool() {
            add(w, "tokenizer.ggml.add_bos_token", flag.into())?;
        }
        if let Some(template) = tc["chat_template"].as_str() {
            add(w, "tokenizer.chat_template", template.into())?;
        }
    }
    Ok((pre, dropped))
}
