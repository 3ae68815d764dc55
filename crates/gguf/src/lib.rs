//! GGUF reading and writing (in progress).
