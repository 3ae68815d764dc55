//! A `tokenizer.json` whose model is BPE (Llama 3, GPT-2, SmolLM2, most chat models), read with
//! typed parses of its parts.
//!
//! Why: the `tokenizers` crate reads the model through untagged enums, which first copy the whole
//! vocabulary and merge list into generic JSON values and then read them again (twice for the
//! merges). For a vocabulary of 49152 tokens that took about 40 ms of a new process's start, more
//! than the rest of loading a small model. Here the vocabulary and merges are read once, straight
//! into what `BpeBuilder` takes; every other part (normalizer, pre-tokenizer, post-processor,
//! decoder, truncation, padding, added tokens) is read by the crate's own types, and the
//! tokenizer is put together as the crate's own reader does (`TokenizerBuilder`, then the added
//! tokens through `add_tokens`). A model of another kind is left to the crate.

use serde::de::{Deserializer, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{BpeBuilder, Vocab, BPE};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, ModelWrapper, PaddingParams, TokenizerBuilder, TruncationParams};

/// The top level of a `tokenizer.json`: the model left unread until its kind is known.
#[derive(Deserialize)]
struct TokenizerFile<'a> {
    version: Option<String>,
    #[serde(borrow)]
    model: &'a RawValue,
    #[serde(default)]
    added_tokens: Vec<AddedTokenWithId>,
    normalizer: Option<NormalizerWrapper>,
    pre_tokenizer: Option<PreTokenizerWrapper>,
    post_processor: Option<PostProcessorWrapper>,
    decoder: Option<DecoderWrapper>,
    truncation: Option<TruncationParams>,
    padding: Option<PaddingParams>,
}

/// An entry of `added_tokens`: the token and the id the file gives it (which `add_tokens`
/// recomputes, as the crate's reader does).
#[derive(Deserialize)]
struct AddedTokenWithId {
    #[serde(rename = "id")]
    _id: u32,
    #[serde(flatten)]
    token: AddedToken,
}

/// Only the model's kind.
#[derive(Deserialize)]
struct ModelKind<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<&'a str>,
}

/// A BPE model's fields, as the crate's BPE reader takes them.
#[derive(Deserialize)]
struct BpeModel {
    dropout: Option<f32>,
    unk_token: Option<String>,
    continuing_subword_prefix: Option<String>,
    end_of_word_suffix: Option<String>,
    fuse_unk: Option<bool>,
    byte_fallback: Option<bool>,
    ignore_merges: Option<bool>,
    vocab: Vocab,
    merges: Vec<Merge>,
}

/// One merge: a pair (`["a", "b"]`), or the older form, one string `"a b"`; `None` for the older
/// form's `#version` lines, which the crate skips.
struct Merge(Option<(String, String)>);

impl<'de> Deserialize<'de> for Merge {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MergeVisitor;
        impl<'de> Visitor<'de> for MergeVisitor {
            type Value = Merge;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a merge: a pair of strings, or one string of two parts")
            }
            fn visit_str<E: serde::de::Error>(self, line: &str) -> Result<Merge, E> {
                if line.starts_with("#version") {
                    return Ok(Merge(None));
                }
                let parts: Vec<&str> = line.split(' ').collect();
                match parts[..] {
                    [a, b] => Ok(Merge(Some((a.to_string(), b.to_string())))),
                    _ => Err(E::custom(format!("the merge {line:?} is not two parts"))),
                }
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Merge, A::Error> {
                let missing = || serde::de::Error::custom("a merge pair of fewer than two strings");
                let a: String = seq.next_element()?.ok_or_else(missing)?;
                let b: String = seq.next_element()?.ok_or_else(missing)?;
                if seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                    return Err(serde::de::Error::custom("a merge pair of more than two strings"));
                }
                Ok(Merge(Some((a, b))))
            }
        }
        deserializer.deserialize_any(MergeVisitor)
    }
}

/// The tokenizer of `bytes`, when its model is BPE; `None` for any other file (another model
/// kind, or JSON this reader does not take), which the caller reads with the crate's own reader
/// and its errors.
pub fn read(bytes: &[u8]) -> Option<Result<tokenizers::Tokenizer, String>> {
    let file: TokenizerFile<'_> = serde_json::from_slice(bytes).ok()?;
    let kind: ModelKind<'_> = serde_json::from_str(file.model.get()).ok()?;
    if kind.kind != Some("BPE") {
        return None;
    }
    Some(build(file))
}

fn build(file: TokenizerFile<'_>) -> Result<tokenizers::Tokenizer, String> {
    if let Some(version) = file.version.as_deref().filter(|v| *v != "1.0") {
        return Err(format!("Unknown tokenizer version '{version}'"));
    }
    let model: BpeModel = serde_json::from_str(file.model.get()).map_err(|e| e.to_string())?;
    let merges = model.merges.into_iter().filter_map(|m| m.0).collect();
    // Each field the file sets goes to the builder; one it leaves out keeps the builder's default,
    // as in the crate's reader.
    fn set<T>(builder: BpeBuilder, value: Option<T>, setter: fn(BpeBuilder, T) -> BpeBuilder) -> BpeBuilder {
        match value {
            Some(value) => setter(builder, value),
            None => builder,
        }
    }
    let bpe = BPE::builder().vocab_and_merges(model.vocab, merges);
    let bpe = set(bpe, model.dropout, BpeBuilder::dropout);
    let bpe = set(bpe, model.unk_token, BpeBuilder::unk_token);
    let bpe = set(bpe, model.continuing_subword_prefix, BpeBuilder::continuing_subword_prefix);
    let bpe = set(bpe, model.end_of_word_suffix, BpeBuilder::end_of_word_suffix);
    let bpe = set(bpe, model.fuse_unk, BpeBuilder::fuse_unk);
    let bpe = set(bpe, model.byte_fallback, BpeBuilder::byte_fallback);
    let bpe = set(bpe, model.ignore_merges, BpeBuilder::ignore_merges);
    let bpe = bpe.build().map_err(|e| e.to_string())?;
    let mut tokenizer = TokenizerBuilder::new()
        .with_model(ModelWrapper::BPE(bpe))
        .with_normalizer(file.normalizer)
        .with_pre_tokenizer(file.pre_tokenizer)
        .with_post_processor(file.post_processor)
        .with_decoder(file.decoder)
        .with_truncation(file.truncation)
        .with_padding(file.padding)
        .build()
        .map_err(|e| e.to_string())?;
    tokenizer.add_tokens(file.added_tokens.into_iter().map(|t| t.token)).map_err(|e| e.to_string())?;
    Ok(tokenizer.into())
}
