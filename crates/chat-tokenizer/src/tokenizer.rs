//! [`Tokenizer`]: text to token ids and back, from a Hugging Face `tokenizer.json`.

use crate::chat_template::RenderedChat;
use crate::error::{read_model_file, Result, TokenizerError};
use crate::panic_guard::guarded;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A model's tokenizer, loaded from `tokenizer.json`.
///
/// # Incomplete UTF-8
///
/// Byte-level BPE tokenizers (Llama 3, GPT-2, SmolLM2) can split one multi-byte character over
/// several tokens. [`Tokenizer::decode`] of a prefix that ends inside such a character yields
/// U+FFFD (the replacement character) for the incomplete bytes; decoding the longer sequence
/// once the remaining tokens arrive gives the right character. This is expected: the
/// generation driver in `session_api::generate` holds back text that ends in U+FFFD until the
/// next token completes it, so callers that stream should go through it.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// A copy of `inner` that encodes special-token spellings as text; made on first use, as
    /// only a message that spells a special token needs it.
    as_text: OnceLock<tokenizers::Tokenizer>,
    path: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("path", &self.path).field("vocab_size", &self.vocab_size()).finish()
    }
}

impl Tokenizer {
    /// The file name of a Hugging Face tokenizer inside a model directory.
    pub const FILE_NAME: &'static str = "tokenizer.json";

    /// Loads `dir/tokenizer.json`.
    pub fn from_model_dir(dir: impl AsRef<Path>) -> Result<Self> {
        Self::from_file(dir.as_ref().join(Self::FILE_NAME))
    }

    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = read_model_file(path)?;
        // Parsing from bytes (rather than `tokenizers::Tokenizer::from_file`) keeps a missing
        // file and a malformed one apart: the crate reports both as one opaque error.
        let malformed = |message: String| TokenizerError::MalformedTokenizer { path: path.to_path_buf(), message };
        // A BPE model's file is read by the typed reader (`bpe_file`), anything else by the
        // crate's own.
        let inner = guarded(|| match crate::bpe_file::read(&bytes) {
            Some(read) => read,
            None => tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| e.to_string()),
        })
        .map_err(malformed)?
        .map_err(malformed)?;
        Ok(Tokenizer { inner, as_text: OnceLock::new(), path: path.to_path_buf() })
    }

    /// The file this tokenizer was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The token ids of `text`. With `add_special_tokens`, the tokenizer's post-processor adds
    /// what the model expects around a sequence (Llama 3: `<|begin_of_text|>` in front).
    /// Special tokens written in `text` (such as `<|eot_id|>`) encode to their single id.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = guarded(|| self.inner.encode(text, add_special_tokens))
            .map_err(|message| TokenizerError::Encode { message })?
            .map_err(|e| TokenizerError::Encode { message: e.to_string() })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The spellings of the special tokens (added tokens marked special: BOS, EOS, chat
    /// markers), sorted, for [`crate::ChatTemplate::render`].
    pub fn special_tokens(&self) -> Vec<String> {
        let mut specials: Vec<String> =
            self.inner.get_added_tokens_decoder().into_values().filter(|t| t.special).map(|t| t.content).collect();
        specials.sort();
        specials
    }

    /// The token ids of a rendered conversation, without adding special tokens (the template
    /// writes them). Special tokens the template wrote encode to their ids; the spans that
    /// [`crate::ChatTemplate::render`] marked as message text encode as text, as any other
    /// message text does. Without such spans this is `encode(&chat.text, false)`.
    ///
    /// The text is cut at the template's special tokens and each piece between them is encoded
    /// on its own, as the tokenizer itself does when it splits at special tokens, so pieces
    /// without a marked span encode exactly as in `encode(&chat.text, false)`.
    pub fn encode_chat(&self, chat: &RenderedChat) -> Result<Vec<u32>> {
        if chat.literal_spans.is_empty() {
            return self.encode(&chat.text, false);
        }
        let encode_err = |e: tokenizers::Error| TokenizerError::Encode { message: e.to_string() };
        let guard_err = |message: String| TokenizerError::Encode { message };
        let full = guarded(|| self.inner.encode(chat.text.as_str(), false)).map_err(guard_err)?.map_err(encode_err)?;
        let special_ids: std::collections::HashSet<u32> =
            self.inner.get_added_tokens_decoder().into_iter().filter(|(_, t)| t.special).map(|(id, _)| id).collect();
        // Token offsets and spans both ascend: one cursor walks the spans (a message may hold
        // many, and it is untrusted input).
        let mut spans = chat.literal_spans.iter().peekable();
        let as_text = self.as_text.get_or_init(|| {
            let mut copy = self.inner.clone();
            copy.set_encode_special_tokens(true);
            copy
        });
        let mut ids = Vec::with_capacity(full.len());
        let mut piece_start = 0;
        let encode_piece = |ids: &mut Vec<u32>, piece: &str| -> Result<()> {
            if !piece.is_empty() {
                let encoding = guarded(|| as_text.encode(piece, false)).map_err(guard_err)?.map_err(encode_err)?;
                ids.extend_from_slice(encoding.get_ids());
            }
            Ok(())
        };
        for (&id, &(start, end)) in full.get_ids().iter().zip(full.get_offsets()) {
            if !special_ids.contains(&id) {
                continue;
            }
            while spans.next_if(|s| s.end <= start).is_some() {}
            if spans.peek().is_none_or(|s| s.start >= end) {
                encode_piece(&mut ids, &chat.text[piece_start..start])?;
                ids.push(id);
                piece_start = end;
            }
        }
        encode_piece(&mut ids, &chat.text[piece_start..])?;
        Ok(ids)
    }

    /// The text of `ids`; with `skip_special_tokens`, special tokens (BOS, EOS, chat markers)
    /// are left out. An id outside the vocabulary is an error rather than silently dropped.
    /// See the type's documentation about U+FFFD at the end of a prefix.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        if let Some(&id) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            return Err(TokenizerError::UnknownTokenId { id, vocab_size: self.vocab_size() });
        }
        guarded(|| self.inner.decode(ids, skip_special_tokens))
            .map_err(|message| TokenizerError::Decode { message })?
            .map_err(|e| TokenizerError::Decode { message: e.to_string() })
    }

    /// The number of tokens, added (special) tokens included: Llama 3.2 has 128256.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token given in its vocabulary spelling (`"<|eot_id|>"`, or `"Ġworld"` for
    /// byte-level BPE, where `Ġ` stands for a leading space).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary spelling of a token id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The bytes one token stands for, special tokens spelled out: what a server reports as a
    /// token's `bytes` beside its log-probability. A byte-level BPE token that holds part of a
    /// multi-byte character gives that part (decoding it alone would give U+FFFD); for other
    /// tokenizers, the token decoded alone.
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>> {
        let piece =
            self.inner.id_to_token(id).ok_or(TokenizerError::UnknownTokenId { id, vocab_size: self.vocab_size() })?;
        if matches!(self.inner.get_decoder(), Some(tokenizers::DecoderWrapper::ByteLevel(_))) {
            let mut bytes = Vec::with_capacity(piece.len());
            for c in piece.chars() {
                match byte_level_byte(c) {
                    Some(byte) => bytes.push(byte),
                    // An added token's own characters (a space, say) stand for themselves.
                    None => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                }
            }
            return Ok(bytes);
        }
        Ok(self.decode(&[id], false)?.into_bytes())
    }
}

/// The byte a character of a byte-level BPE vocabulary stands for (GPT-2's table): printable
/// bytes (`!`..=`~`, `¡`..=`¬`, `®`..=`ÿ`) are their own character; the other 68 bytes, in
/// ascending order, are the characters from U+0100 on. `None` for a character outside the table.
fn byte_level_byte(c: char) -> Option<u8> {
    let code = c as u32;
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    if code < 256 {
        return printable(code).then_some(code as u8);
    }
    (0..=255u32).filter(|&b| !printable(b)).nth(code as usize - 256).map(|b| b as u8)
}

impl session_api::generate::Detokenizer for Tokenizer {
    /// Decodes with special tokens skipped, as the driver's streamed text should not show them.
    fn detokenize(&self, ids: &[u32]) -> session_api::Result<String> {
        Ok(self.decode(ids, true)?)
    }
}

#[cfg(test)]
mod tests {
    use super::byte_level_byte;

    #[test]
    fn the_byte_level_table_gives_every_byte_once() {
        let mut seen = [false; 256];
        let chars = (0u32..512).filter_map(char::from_u32);
        for byte in chars.filter_map(byte_level_byte) {
            assert!(!seen[byte as usize], "byte {byte} twice");
            seen[byte as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(byte_level_byte('Ġ'), Some(b' '));
        assert_eq!(byte_level_byte('Ċ'), Some(b'\n'));
        assert_eq!(byte_level_byte('a'), Some(b'a'));
        assert_eq!(byte_level_byte(' '), None);
    }
}
