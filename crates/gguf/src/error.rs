//! [`GgufError`]: what can be wrong with a GGUF file or a request made of it.

use std::path::PathBuf;

/// An error while reading, decoding or writing a GGUF file.
///
/// A malformed file always ends up here (never in a panic or an oversized allocation): every count,
/// length and offset the file declares is checked against the bytes actually present.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// Opening, mapping, reading or writing a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The file ends before a structure it declares (an interrupted download or copy).
    #[error("truncated: {what} needs {needed} bytes at offset {offset}, the file has {len}")]
    Truncated { what: String, offset: u64, needed: u64, len: u64 },

    /// The file does not start with the GGUF magic.
    #[error("not a GGUF file (magic {found:02x?}, expected \"GGUF\")")]
    BadMagic { found: [u8; 4] },

    /// A GGUF version this reader does not implement (v1 used 32-bit counts; big-endian files
    /// show up here with a byte-swapped version number).
    #[error("unsupported GGUF version {version} (this reader handles little-endian versions 2 and 3)")]
    UnsupportedVersion { version: u32 },

    /// The file's structure is inconsistent (overlapping tensors, bad alignment, absurd counts...).
    #[error("corrupt GGUF: {message}")]
    Corrupt { message: String },

    /// A metadata value has a type id outside the GGUF specification.
    #[error("metadata key '{key}': unknown value type {type_id}")]
    UnknownValueType { key: String, type_id: u32 },

    /// A tensor has a ggml type id this crate does not know the block size of.
    #[error("tensor '{name}': unknown ggml type {type_id}")]
    UnknownTensorType { name: String, type_id: u32 },

    /// A metadata key the caller needs is absent.
    #[error("metadata key '{key}' is missing")]
    MissingKey { key: String },

    /// A metadata value has another type than the caller needs.
    #[error("metadata key '{key}' is {found}, expected {expected}")]
    WrongType { key: String, expected: String, found: String },

    /// No tensor of that name is in the file.
    #[error("tensor '{name}' is not in the file")]
    TensorNotFound { name: String },

    /// Converting this ggml type to f32 (or quantizing to it) is not implemented.
    #[error("ggml type {ty} is not supported for {operation}")]
    UnsupportedType { ty: String, operation: String },

    /// A tensor handed to the writer, or a buffer handed to a block decoder, is inconsistent.
    #[error("tensor '{name}': {message}")]
    InvalidTensor { name: String, message: String },
}

impl GgufError {
    pub(crate) fn corrupt(message: impl Into<String>) -> Self {
        GgufError::Corrupt { message: message.into() }
    }
}
