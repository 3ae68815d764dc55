//! The byte-level BPE pre-tokenizers llama.cpp knows by name (`tokenizer.ggml.pre`), as
//! Hugging Face `tokenizer.json` `pre_tokenizer` values: [`for_name`] (import) and [`name_of`]
//! (export).

use serde_json::{json, Value};

/// The Llama 3 pre-tokenizer regex, as in Meta's `tokenizer.json` (llama.cpp's `llama-bpe`).
pub const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The names [`for_name`] accepts (`llama3` and `default` are aliases llama.cpp also writes).
pub const SUPPORTED: &str = "smollm, llama-bpe, llama3, gpt2, default";

/// A `ByteLevel` pre-tokenizer, post-processor or decoder with the given flags.
pub(crate) fn byte_level(add_prefix_space: bool, trim_offsets: bool, use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": trim_offsets, "use_regex": use_regex})
}

/// The `pre_tokenizer` that llama.cpp's name `pre` stands for, or `None` for a name seam does not
/// know.
pub fn for_name(pre: &str) -> Option<Value> {
    Some(match pre {
        "smollm" => json!({
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(false, true, true),
            ]
        }),
        "llama-bpe" | "llama3" => json!({
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX}, "behavior": "Isolated", "invert": false},
                byte_level(false, true, false),
            ]
        }),
        "gpt2" | "default" => byte_level(false, true, true),
        _ => return None,
    })
}

/// llama.cpp's name for a `tokenizer.json` `pre_tokenizer`, for the shapes [`for_name`] produces.
/// Only what decides the tokenization is compared (the kind and order of the steps, the regex, the
/// digit split), not flags such as `trim_offsets` that real files set either way.
pub fn name_of(pre_tokenizer: &Value) -> Option<&'static str> {
    let is_byte_level = |v: &Value| v["type"] == "ByteLevel";
    if is_byte_level(pre_tokenizer) {
        return Some("gpt2");
    }
    let parts = pre_tokenizer["pretokenizers"].as_array().filter(|_| pre_tokenizer["type"] == "Sequence")?;
    match parts.as_slice() {
        [split, last]
            if is_byte_level(last) && split["type"] == "Split" && split["pattern"]["Regex"] == LLAMA3_REGEX =>
        {
            Some("llama-bpe")
        }
        [digits, last] if is_byte_level(last) && digits["type"] == "Digits" && digits["individual_digits"] == true => {
            Some("smollm")
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for name in ["smollm", "llama-bpe", "gpt2"] {
            assert_eq!(name_of(&for_name(name).unwrap()), Some(name));
        }
        assert_eq!(name_of(&for_name("llama3").unwrap()), Some("llama-bpe"));
        assert_eq!(for_name("deepseek-coder"), None);
        assert_eq!(name_of(&json!({"type": "Whitespace"})), None);
    }
}
