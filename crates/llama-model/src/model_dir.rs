//! The on-disk layout of a seam model directory (a Hugging Face checkpoint directory plus seam's
//! own int4 weight file).

/// The model's `config.json`.
pub const CONFIG_FILE: &str = "config.json";
/// Generation defaults (`generation_config.json`); optional.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
/// The Hugging Face `tokenizers` file.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// Tokenizer settings and chat template.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// Single-file weights (f16, bf16 or f32).
pub const SAFETENSORS_FILE: &str = "model.safetensors";
/// Index of a sharded checkpoint: `{"weight_map": {tensor: shard}}`.
pub const SAFETENSORS_INDEX_FILE: &str = "model.safetensors.index.json";
/// seam's int4 weights (see [`crate::int4`]).
pub const INT4_WEIGHTS_FILE: &str = "model.int4.safetensors";

use crate::config::{GenerationConfig, LlamaConfig};
use crate::error::ModelError;
use crate::weights::{load_weights, LlamaWeights};
use session_api::WeightFormat;
use std::path::{Path, PathBuf};

/// An opened model directory: its config and generation config are read and validated.
#[derive(Debug, Clone)]
pub struct ModelDir {
    path: PathBuf,
    config: LlamaConfig,
    generation_config: GenerationConfig,
}

impl ModelDir {
    /// Opens `path`: it must be a directory with a valid `config.json`; `generation_config.json`
    /// is optional (defaults when absent, an error when malformed).
    pub fn open(path: &Path) -> Result<ModelDir, ModelError> {
        let meta = std::fs::metadata(path).map_err(|e| ModelError::from_io(path, e))?;
        if !meta.is_dir() {
            return Err(ModelError::NotADirectory { path: path.to_path_buf() });
        }
        let config = LlamaConfig::from_file(&path.join(CONFIG_FILE))?;
        let generation_config = GenerationConfig::from_dir_or_default(path)?;
        let dir = ModelDir { path: path.to_path_buf(), config, generation_config };
        // Generation stops at an EOS token; a model naming none would run to the context's end
        // on every prompt, which no user wants and none notices until it happens.
        if dir.eos_token_ids().is_empty() {
            return Err(ModelError::Config {
                path: Some(path.join(CONFIG_FILE)),
                message: format!(
                    "no eos_token_id in {CONFIG_FILE} or {GENERATION_CONFIG_FILE}: generation would never stop at \
                     an end of text"
                ),
            });
        }
        Ok(dir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The model's name: the directory's name.
    pub fn name(&self) -> String {
        self.path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.path.display().to_string())
    }

    /// The validated `config.json`.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// `generation_config.json`, or the default when the file is absent.
    pub fn generation_config(&self) -> &GenerationConfig {
        &self.generation_config
    }

    /// The EOS ids of the config and the generation config together, config first, no repeats.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        let mut ids = self.config.eos_token_ids.clone();
        for id in &self.generation_config.eos_token_ids {
            if !ids.contains(id) {
                ids.push(*id);
            }
        }
        ids
    }

    /// Path of `tokenizer.json`.
    pub fn tokenizer_path(&self) -> PathBuf {
        self.path.join(TOKENIZER_FILE)
    }

    /// Path of `tokenizer_config.json`.
    pub fn tokenizer_config_path(&self) -> PathBuf {
        self.path.join(TOKENIZER_CONFIG_FILE)
    }

    /// Path of seam's int4 weight file (which may not exist yet).
    pub fn int4_weights_path(&self) -> PathBuf {
        self.path.join(INT4_WEIGHTS_FILE)
    }

    /// Whether float weights (single file or sharded) are present.
    pub fn has_float_weights(&self) -> bool {
        has_float_weights(&self.path)
    }

    /// Whether seam's int4 weight file is present.
    pub fn has_int4_weights(&self) -> bool {
        self.int4_weights_path().is_file()
    }

    /// The [`crate::Int4Layout`] an int4 load of this model gets: the int4 file's, from its header,
    /// when the file exists; else [`crate::Int4Layout::DEFAULT`], what quantizing the float
    /// weights at load produces.
    pub fn int4_layout(&self) -> Result<crate::Int4Layout, ModelError> {
        let int4 = self.int4_weights_path();
        if int4.is_file() {
            crate::weights::int4_file_layout(&int4, &self.config)
        } else {
            Ok(crate::Int4Layout::DEFAULT.normalized(self.config.tie_word_embeddings))
        }
    }

    /// The files a load of the weights in `format` reads, sorted: `config.json` and the weight
    /// files (the float safetensors, one file or the index and its shards, for f16; seam's int4
    /// file for int4 when it exists, else the float files it will be quantized from). What a
    /// cache of anything derived from the weights fingerprints to notice a changed model.
    pub fn weight_source_files(&self, format: WeightFormat) -> Result<Vec<PathBuf>, ModelError> {
        let int4 = self.int4_weights_path();
        let mut files = vec![self.path.join(CONFIG_FILE)];
        if format == WeightFormat::Int4 && int4.is_file() {
            files.push(int4);
        } else {
            let entries = std::fs::read_dir(&self.path).map_err(|e| ModelError::from_io(&self.path, e))?;
            for entry in entries {
                let path = entry.map_err(|e| ModelError::from_io(&self.path, e))?.path();
                let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                let float = name.ends_with(".safetensors") || name == SAFETENSORS_INDEX_FILE;
                if float && name != INT4_WEIGHTS_FILE && path.is_file() {
                    files.push(path);
                }
            }
        }
        files.sort();
        Ok(files)
    }

    /// Loads the weights in `format` (see [`crate::weights::load_weights`]).
    pub fn load_weights(
        &self,
        format: WeightFormat,
        progress: Option<&(dyn Fn(u64, u64) + Sync)>,
    ) -> Result<LlamaWeights, ModelError> {
        load_weights(&self.path, format, progress)
    }
}

/// Whether `dir` holds float weights: `model.safetensors` or a shard index.
pub fn has_float_weights(dir: &Path) -> bool {
    dir.join(SAFETENSORS_FILE).is_file() || dir.join(SAFETENSORS_INDEX_FILE).is_file()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_reads_both_configs() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("my-model");
        std::fs::create_dir(&model).unwrap();
        let config = crate::random::tiny_config();
        std::fs::write(model.join(CONFIG_FILE), config.to_json()).unwrap();
        let m = ModelDir::open(&model).unwrap();
        assert_eq!(m.name(), "my-model");
        assert_eq!(m.config(), &config);
        assert_eq!(m.generation_config(), &GenerationConfig::default());
        assert!(!m.has_float_weights() && !m.has_int4_weights());

        let generation = GenerationConfig { eos_token_ids: vec![2, 7], ..Default::default() };
        std::fs::write(model.join(GENERATION_CONFIG_FILE), generation.to_json()).unwrap();
        let m = ModelDir::open(&model).unwrap();
        assert_eq!(m.generation_config(), &generation);
        assert_eq!(m.eos_token_ids(), vec![2, 7]);

        // No EOS anywhere: refused, naming the key.
        let mut no_eos = config.clone();
        no_eos.eos_token_ids.clear();
        std::fs::write(model.join(CONFIG_FILE), no_eos.to_json()).unwrap();
        assert_eq!(ModelDir::open(&model).unwrap().eos_token_ids(), vec![2, 7], "the generation config's count");
        std::fs::remove_file(model.join(GENERATION_CONFIG_FILE)).unwrap();
        let err = ModelDir::open(&model).unwrap_err().to_string();
        assert!(err.contains("no eos_token_id"), "{err}");
    }

    #[test]
    fn missing_dir_and_config_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let absent = dir.path().join("absent");
        match ModelDir::open(&absent) {
            Err(ModelError::MissingFile { path }) => assert_eq!(path, absent),
            other => panic!("{other:?}"),
        }
        match ModelDir::open(dir.path()) {
            Err(ModelError::MissingFile { path }) => assert_eq!(path, dir.path().join(CONFIG_FILE)),
            other => panic!("{other:?}"),
        }
        let file = dir.path().join("file");
        std::fs::write(&file, "x").unwrap();
        assert!(matches!(ModelDir::open(&file), Err(ModelError::NotADirectory { .. })));
    }
}
