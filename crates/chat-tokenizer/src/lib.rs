//! Tokenizer and chat template (in progress).
