//! A Hugging Face `tokenizer.json` and `tokenizer_config.json` from a GGUF's `tokenizer.*`
//! metadata (byte-level BPE, `tokenizer.ggml.model = "gpt2"`).

use super::gguf_error;
use crate::error::ModelError;
use crate::gguf_layout::pre_tokenizer::{self, byte_level};
use crate::gguf_layout::token_type;
use gguf::GgufFile;
use serde_json::{json, Map, Value};
use std::collections::HashSet;
use std::path::Path;

/// The two tokenizer files, as JSON text.
pub(crate) struct TokenizerFiles {
    pub tokenizer_json: String,
    pub tokenizer_config_json: String,
}

/// The pre-tokenizer llama.cpp's `tokenizer.ggml.pre` name stands for.
fn pre_tokenizer_json(pre: &str) -> Result<Value, ModelError> {
    pre_tokenizer::for_name(pre).ok_or_else(|| ModelError::Unsupported {
        what: format!("GGUF pre-tokenizer '{pre}' (supported: {})", pre_tokenizer::SUPPORTED),
    })
}

/// Builds both files. `context_length` becomes `model_max_length`.
pub(crate) fn build(f: &GgufFile, path: &Path, context_length: usize) -> Result<TokenizerFiles, ModelError> {
    let err = |e| gguf_error(path, e);
    let corrupt = |message: String| ModelError::Corrupt { path: path.to_path_buf(), message };
    let model = f.get_str("tokenizer.ggml.model").map_err(err)?;
    match model {
        "gpt2" => {}
        "llama" => {
            return Err(ModelError::Unsupported {
                what: "SentencePiece GGUF tokenizers (tokenizer.ggml.model = \"llama\"): converting their scores and \
                       byte-fallback pieces to tokenizer.json is not implemented; only byte-level BPE (\"gpt2\") is"
                    .into(),
            })
        }
        other => {
            return Err(ModelError::Unsupported {
                what: format!("GGUF tokenizer model '{other}' (only \"gpt2\" BPE is supported)"),
            })
        }
    }
    let tokens = f.get_strings("tokenizer.ggml.tokens").map_err(err)?;
    let types: Vec<i64> = match f.get("tokenizer.ggml.token_type") {
        Some(_) => f
            .get_array("tokenizer.ggml.token_type")
            .map_err(err)?
            .to_i64s()
            .ok_or_else(|| corrupt("tokenizer.ggml.token_type is not an integer array".into()))?,
        None => vec![1; tokens.len()],
    };
    if types.len() != tokens.len() {
        return Err(corrupt(format!("{} token types for {} tokens", types.len(), tokens.len())));
    }
    let merges = f.get_strings("tokenizer.ggml.merges").map_err(err)?;
    let pre = match f.get("tokenizer.ggml.pre") {
        Some(_) => f.get_str("tokenizer.ggml.pre").map_err(err)?,
        None => "default",
    };
    let pre_tokenizer = pre_tokenizer_json(pre)?;
    let token_id = |key: &str| -> Result<Option<usize>, ModelError> {
        if f.get(key).is_none() {
            return Ok(None);
        }
        let id = f.get_u64(key).map_err(err)? as usize;
        if id >= tokens.len() {
            return Err(corrupt(format!("{key} = {id} is outside the vocabulary of {}", tokens.len())));
        }
        Ok(Some(id))
    };
    let bos = token_id("tokenizer.ggml.bos_token_id")?;
    let eos = token_id("tokenizer.ggml.eos_token_id")?;
    let pad = token_id("tokenizer.ggml.padding_token_id")?;
    let unk = token_id("tokenizer.ggml.unknown_token_id")?;
    let flag = |key: &str, default: bool| -> Result<bool, ModelError> {
        if f.get(key).is_some() {
            f.get_bool(key).map_err(err)
        } else {
            Ok(default)
        }
    };
    let add_bos = flag("tokenizer.ggml.add_bos_token", false)?;
    let add_eos = flag("tokenizer.ggml.add_eos_token", false)?;

    let mut vocab = Map::new();
    let mut seen = HashSet::with_capacity(tokens.len());
    for (id, token) in tokens.iter().enumerate() {
        if !seen.insert(token.as_str()) {
            return Err(corrupt(format!("token {token:?} appears twice in tokenizer.ggml.tokens")));
        }
        vocab.insert(token.clone(), json!(id));
    }
    let merges: Vec<Value> = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| json!([a, b]))
                .ok_or_else(|| corrupt(format!("merge {m:?} is not two tokens separated by a space")))
        })
        .collect::<Result<_, _>>()?;

    let added: Vec<(usize, &String, bool)> = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, &t))| t == i64::from(token_type::CONTROL) || t == i64::from(token_type::USER_DEFINED))
        .map(|(id, (token, &t))| (id, token, t == i64::from(token_type::CONTROL)))
        .collect();
    let added_token = |id: usize, content: &str, special: bool| {
        json!({
            "id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
            // Control tokens match the raw text; user-defined ones are matched after normalization, as
            // transformers adds them by default.
            "normalized": !special, "special": special,
        })
    };
    let added_tokens: Vec<Value> = added.iter().map(|&(id, t, special)| added_token(id, t, special)).collect();

    let post_processor = if add_bos || add_eos {
        let mut single = Vec::new();
        let mut pair = Vec::new();
        let mut special_tokens = Map::new();
        let special = |id: usize, type_id: u32| json!({"SpecialToken": {"id": tokens[id], "type_id": type_id}});
        let bos_id = bos.filter(|_| add_bos);
        let eos_id = eos.filter(|_| add_eos);
        if add_bos && bos_id.is_none() || add_eos && eos_id.is_none() {
            return Err(corrupt("add_bos_token / add_eos_token is set but the token id is missing".into()));
        }
        for id in bos_id.into_iter().chain(eos_id) {
            special_tokens.insert(tokens[id].clone(), json!({"id": tokens[id], "ids": [id], "tokens": [tokens[id]]}));
        }
        if let Some(b) = bos_id {
            single.push(special(b, 0));
        }
        single.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
        if let Some(e) = eos_id {
            single.push(special(e, 0));
        }
        pair.extend(single.iter().cloned());
        if let Some(b) = bos_id {
            pair.push(special(b, 1));
        }
        pair.push(json!({"Sequence": {"id": "B", "type_id": 1}}));
        if let Some(e) = eos_id {
            pair.push(special(e, 1));
        }
        json!({
            "type": "Sequence",
            "processors": [
                byte_level(true, false, true),
                {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special_tokens},
            ]
        })
    } else {
        byte_level(true, false, true)
    };

    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": byte_level(true, true, true),
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": unk.map(|id| tokens[id].clone()),
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        },
    });

    let mut decoder = Map::new();
    for &(id, t, special) in &added {
        let mut entry = added_token(id, t, special);
        entry.as_object_mut().expect("object").remove("id");
        decoder.insert(id.to_string(), entry);
    }
    let name = |id: Option<usize>| id.map(|i| tokens[i].clone());
    let mut config = json!({
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "added_tokens_decoder": decoder,
        "bos_token": name(bos),
        "eos_token": name(eos),
        "pad_token": name(pad),
        "unk_token": name(unk),
        "clean_up_tokenization_spaces": false,
        "model_max_length": context_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    });
    if let Some(template) = f.get("tokenizer.chat_template") {
        let template = template.as_str().ok_or_else(|| corrupt("tokenizer.chat_template is not a string".into()))?;
        config["chat_template"] = json!(template);
    }
    Ok(TokenizerFiles {
        tokenizer_json: serde_json::to_string(&tokenizer).expect("JSON serializes"),
        tokenizer_config_json: serde_json::to_string_pretty(&config).expect("JSON serializes"),
    })
}
