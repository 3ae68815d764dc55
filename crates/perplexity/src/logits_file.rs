//! The logits file of a base run (`seam perplexity --save-logits FILE`): per scored position, the
//! base model's distribution in compact form, for later KL-divergence comparisons.
//!
//! llama.cpp's `--kl-divergence-base` file keeps every log-probability of every scored position
//! (16 bits each, about 100 KB per position for a 49k vocabulary). This file keeps the `k` most
//! likely tokens with their log-probabilities and folds the rest of the vocabulary into one bucket,
//! which is what the KL divergence of [`crate::kl`] is computed over: 400 bytes per position at the
//! default `k = 32`.
//!
//! # Format, version 1 (all integers and floats little-endian)
//!
//! | offset | size | field                                                                 |
//! |--------|------|-----------------------------------------------------------------------|
//! | 0      | 8    | magic `SEAMLGTS`                                                      |
//! | 8      | 4    | version, u32 = 1                                                      |
//! | 12     | 4    | vocabulary size, u32                                                  |
//! | 16     | 4    | `ctx`, u32                                                            |
//! | 20     | 4    | chunks, u32                                                           |
//! | 24     | 4    | `k`, u32 (`min(--logits-top-k, vocabulary size)`, at least 1)         |
//! | 28     | 8    | scored positions, u64 (`chunks * (ctx - 1 - ctx / 2)`)                |
//! | 36     | 8    | fingerprint of the fed tokens, u64 ([`crate::WindowPlan::fingerprint`])|
//! | 44     | ...  | one record per scored position, in evaluation order                   |
//! | end-8  | 8    | xxh3-64 of every byte before it, u64                                  |
//!
//! A record is `16 + 12 k` bytes:
//!
//! | size  | field                                                                          |
//! |-------|--------------------------------------------------------------------------------|
//! | 8     | log-probability of the token that follows (the target), f64                    |
//! | 8     | log of the probability of every token outside the top k, f64 (`-inf` if none)  |
//! | 4 k   | the top-k token ids, u32, most likely first (ties: lower id first)             |
//! | 8 k   | their log-probabilities, f64, in the same order                                |
//!
//! Log-probabilities are kept in f64 so that a run compared with its own saved logits computes
//! bit-identical values on both sides and a KL divergence of exactly 0. The file is written to a
//! temporary file in the destination's folder and renamed into place when complete, so a path is
//! either absent, an older complete file, or the new complete one.

use crate::error::{PerplexityError, Result};
use crate::score::PositionScore;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

/// Distinct tokens kept per position when `--logits-top-k` is not given.
pub const DEFAULT_TOP_K: usize = 32;
/// The file's first 8 bytes.
pub const MAGIC: [u8; 8] = *b"SEAMLGTS";
/// The format version this build reads and writes.
pub const VERSION: u32 = 1;
/// Bytes before the first record.
pub const HEADER_BYTES: usize = 44;
const TRAILER_BYTES: usize = 8;

/// What a logits file was saved from: the facts a comparison must agree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogitsHeader {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Tokens per window.
    pub ctx: usize,
    /// Windows evaluated.
    pub chunks: usize,
    /// Tokens kept per position.
    pub top_k: usize,
    /// Scored positions (`chunks * (ctx - 1 - ctx / 2)`).
    pub positions: usize,
    /// [`crate::WindowPlan::fingerprint`] of the evaluation.
    pub fingerprint: u64,
}

impl LogitsHeader {
    /// The header of a run of `plan` (fingerprinted `fingerprint`) over a vocabulary of
    /// `vocab_size`, keeping `top_k` tokens per position (capped at the vocabulary, at least 1).
    pub fn new(plan: &crate::WindowPlan, fingerprint: u64, vocab_size: usize, top_k: usize) -> LogitsHeader {
        LogitsHeader {
            vocab_size,
            ctx: plan.ctx,
            chunks: plan.chunks,
            top_k: top_k.clamp(1, vocab_size.max(1)),
            positions: plan.scored_positions(),
            fingerprint,
        }
    }

    /// Bytes of one record.
    pub fn record_bytes(&self) -> usize {
        16 + 12 * self.top_k
    }

    fn encode(&self) -> Result<[u8; HEADER_BYTES], String> {
        let u32_field = |name: &str, value: usize| {
            u32::try_from(value).map_err(|_| format!("{name} {value} does not fit the file's 32-bit field"))
        };
        let mut bytes = [0u8; HEADER_BYTES];
        bytes[0..8].copy_from_slice(&MAGIC);
        bytes[8..12].copy_from_slice(&VERSION.to_le_bytes());
        bytes[12..16].copy_from_slice(&u32_field("vocabulary size", self.vocab_size)?.to_le_bytes());
        bytes[16..20].copy_from_slice(&u32_field("ctx", self.ctx)?.to_le_bytes());
        bytes[20..24].copy_from_slice(&u32_field("chunks", self.chunks)?.to_le_bytes());
        bytes[24..28].copy_from_slice(&u32_field("top-k", self.top_k)?.to_le_bytes());
        bytes[28..36].copy_from_slice(&(self.positions as u64).to_le_bytes());
        bytes[36..44].copy_from_slice(&self.fingerprint.to_le_bytes());
        Ok(bytes)
    }

    /// Reads and checks a header (magic, version, sizes that make sense).
    fn decode(bytes: &[u8], path: &Path) -> Result<LogitsHeader> {
        if bytes.len() < 8 || bytes[0..8] != MAGIC {
            return Err(PerplexityError::corrupt(path, "it does not start with the magic bytes SEAMLGTS"));
        }
        if bytes.len() < HEADER_BYTES {
            return Err(PerplexityError::corrupt(
                path,
                format!("truncated: {} bytes, shorter than the header", bytes.len()),
            ));
        }
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as usize;
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        let version = u32_at(8);
        if version != VERSION as usize {
            return Err(PerplexityError::corrupt(
                path,
                format!("format version {version}; this build reads version {VERSION} (save the logits again)"),
            ));
        }
        let header = LogitsHeader {
            vocab_size: u32_at(12),
            ctx: u32_at(16),
            chunks: u32_at(20),
            top_k: u32_at(24),
            positions: usize::try_from(u64_at(28))
                .map_err(|_| PerplexityError::corrupt(path, "the position count does not fit this machine"))?,
            fingerprint: u64_at(36),
        };
        let expected_positions = (header.ctx >= crate::MIN_CTX)
            .then(|| header.chunks.checked_mul(header.ctx - 1 - header.ctx / 2))
            .flatten();
        if header.vocab_size == 0 || header.top_k == 0 || header.top_k > header.vocab_size {
            return Err(PerplexityError::corrupt(
                path,
                format!("top-k {} of a vocabulary of {}", header.top_k, header.vocab_size),
            ));
        }
        if header.chunks == 0 || expected_positions != Some(header.positions) {
            return Err(PerplexityError::corrupt(
                path,
                format!(
                    "{} positions for {} chunks of ctx {} (a damaged header)",
                    header.positions, header.chunks, header.ctx
                ),
            ));
        }
        Ok(header)
    }
}

/// The base's distribution at one position: its top-k tokens and the mass of everything else.
#[derive(Debug, Clone, PartialEq)]
pub struct TopKDistribution {
    /// `log p(target)`, the token that follows (outside the top k or not).
    pub target_log_prob: f64,
    /// The most likely tokens, most likely first (ties: lower id first).
    pub ids: Vec<u32>,
    /// Their log-probabilities, in the same order.
    pub log_probs: Vec<f64>,
    /// `ln` of the total probability of every token not in `ids` (`-inf` when there is none).
    pub log_rest: f64,
}

impl TopKDistribution {
    /// The compact form of a scored position, keeping `k` tokens (at most the vocabulary).
    pub fn from_score(score: &PositionScore, k: usize) -> TopKDistribution {
        let lp = &score.log_probs;
        let k = k.clamp(1, lp.len());
        // Most likely first; among equals the lower id, which makes ids[0] the same token as
        // `score.argmax` (the first maximum).
        let order = |a: &u32, b: &u32| lp[*b as usize].total_cmp(&lp[*a as usize]).then(a.cmp(b));
        let mut ids: Vec<u32> = (0..lp.len() as u32).collect();
        if k < ids.len() {
            ids.select_nth_unstable_by(k - 1, order);
            ids.truncate(k);
        }
        ids.sort_unstable_by(order);
        let log_probs = ids.iter().map(|&id| lp[id as usize]).collect();
        let log_rest = log_rest_mass(lp, &ids);
        TopKDistribution { target_log_prob: lp[score.target as usize], ids, log_probs, log_rest }
    }

    /// The most likely token.
    pub fn top1(&self) -> u32 {
        self.ids[0]
    }
}

/// `ln(sum of exp(log_probs[i]) over every i not in ids)`: the remainder bucket of a top-k
/// distribution, for the base when it is saved and for a run compared against it. Summed over the
/// tokens outside the set rather than computed as `1 - sum(top k)`, which would cancel to 0 (or
/// below) when the top k hold nearly all the mass; both sides use this one function, in the same
/// order, so identical distributions give bit-identical remainders.
pub fn log_rest_mass(log_probs: &[f64], ids: &[u32]) -> f64 {
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    let mut rest = 0.0f64;
    let mut next = sorted.iter().peekable();
    for (i, &lp) in log_probs.iter().enumerate() {
        if next.peek().is_some_and(|&&id| id as usize == i) {
            // Skip this id and any duplicate of it.
            while next.peek().is_some_and(|&&id| id as usize == i) {
                next.next();
            }
            continue;
        }
        rest += lp.exp();
    }
    rest.ln()
}

/// Writes a logits file position by position, atomically: nothing appears at the destination until
/// [`LogitsWriter::finish`], and a writer dropped before it (an error, an interrupted run) leaves
/// the destination as it was and removes its temporary file.
pub struct LogitsWriter {
    path: PathBuf,
    header: LogitsHeader,
    out: BufWriter<atomic_write::TempFile>,
    hasher: Xxh3,
    written: usize,
}

impl LogitsWriter {
    /// Opens a temporary file beside `path` and writes the header, so an unwritable destination is
    /// reported before any evaluation runs.
    pub fn create(path: &Path, header: LogitsHeader) -> Result<LogitsWriter> {
        let encoded =
            header.encode().map_err(|message| PerplexityError::WriterMisuse { path: path.to_path_buf(), message })?;
        if path.is_dir() {
            return Err(PerplexityError::io(path, std::io::Error::other("is a directory, not a file path")));
        }
        let temp = atomic_write::TempFile::create(path).map_err(|e| PerplexityError::io(path, e))?;
        let mut writer = LogitsWriter {
            path: path.to_path_buf(),
            header,
            out: BufWriter::with_capacity(1 << 20, temp),
            hasher: Xxh3::new(),
            written: 0,
        };
        writer.write(&encoded)?;
        Ok(writer)
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.hasher.update(bytes);
        self.out.write_all(bytes).map_err(|e| PerplexityError::io(&self.path, e))
    }

    /// Appends the next scored position.
    pub fn push(&mut self, distribution: &TopKDistribution) -> Result<()> {
        let misuse = |message: String| PerplexityError::WriterMisuse { path: self.path.clone(), message };
        if self.written == self.header.positions {
            return Err(misuse(format!("more than the {} positions the header announced", self.header.positions)));
        }
        if distribution.ids.len() != self.header.top_k || distribution.log_probs.len() != self.header.top_k {
            return Err(misuse(format!(
                "a distribution of {} tokens in a file of top-{}",
                distribution.ids.len(),
                self.header.top_k
            )));
        }
        let mut record = Vec::with_capacity(self.header.record_bytes());
        record.extend_from_slice(&distribution.target_log_prob.to_le_bytes());
        record.extend_from_slice(&distribution.log_rest.to_le_bytes());
        for id in &distribution.ids {
            record.extend_from_slice(&id.to_le_bytes());
        }
        for lp in &distribution.log_probs {
            record.extend_from_slice(&lp.to_le_bytes());
        }
        self.write(&record)?;
        self.written += 1;
        Ok(())
    }

    /// Writes the checksum, flushes to disk and renames the file into place.
    pub fn finish(mut self) -> Result<PathBuf> {
        if self.written != self.header.positions {
            return Err(PerplexityError::WriterMisuse {
                path: self.path.clone(),
                message: format!("{} of the {} announced positions were written", self.written, self.header.positions),
            });
        }
        let checksum = self.hasher.digest().to_le_bytes();
        self.out.write_all(&checksum).map_err(|e| PerplexityError::io(&self.path, e))?;
        let temp = self.out.into_inner().map_err(|e| PerplexityError::io(&self.path, e.into_error()))?;
        temp.commit().map_err(|e| PerplexityError::io(&self.path, e))?;
        Ok(self.path)
    }
}

/// A saved base run, read whole and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct BaseLogits {
    /// Where it was read from.
    pub path: PathBuf,
    /// Its header.
    pub header: LogitsHeader,
    /// One distribution per scored position, in evaluation order.
    pub positions: Vec<TopKDistribution>,
}

impl BaseLogits {
    /// Reads a logits file. Anything but a complete, undamaged file of this format version is a
    /// [`PerplexityError::CorruptLogits`] saying what is wrong (a missing file is
    /// [`PerplexityError::Io`]).
    pub fn read(path: &Path) -> Result<BaseLogits> {
        let mut file = File::open(path).map_err(|e| PerplexityError::io(path, e))?;
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut file, &mut bytes).map_err(|e| PerplexityError::io(path, e))?;
        Self::parse(&bytes, path)
    }

    /// Parses the bytes of a logits file (`path` names it in errors).
    pub fn parse(bytes: &[u8], path: &Path) -> Result<BaseLogits> {
        let header = LogitsHeader::decode(bytes, path)?;
        let expected = header
            .positions
            .checked_mul(header.record_bytes())
            .and_then(|records| records.checked_add(HEADER_BYTES + TRAILER_BYTES));
        if expected != Some(bytes.len()) {
            let promised = expected.map_or_else(|| "more than this machine can address".to_string(), |n| n.to_string());
            return Err(PerplexityError::corrupt(
                path,
                format!("{} bytes where the header promises {promised} (truncated or damaged)", bytes.len()),
            ));
        }
        let (body, trailer) = bytes.split_at(bytes.len() - TRAILER_BYTES);
        if xxh3_64(body).to_le_bytes() != trailer {
            return Err(PerplexityError::corrupt(path, "the checksum does not match (the file is damaged)"));
        }
        let k = header.top_k;
        let f64_at = |b: &[u8], at: usize| f64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        let mut positions = Vec::with_capacity(header.positions);
        for (index, record) in body[HEADER_BYTES..].chunks_exact(header.record_bytes()).enumerate() {
            let ids: Vec<u32> = (0..k)
                .map(|i| u32::from_le_bytes(record[16 + 4 * i..20 + 4 * i].try_into().expect("4 bytes")))
                .collect();
            let log_probs: Vec<f64> = (0..k).map(|i| f64_at(record, 16 + 4 * k + 8 * i)).collect();
            let distribution =
                TopKDistribution { target_log_prob: f64_at(record, 0), log_rest: f64_at(record, 8), ids, log_probs };
            check_record(&distribution, header.vocab_size)
                .map_err(|message| PerplexityError::corrupt(path, format!("position {index}: {message}")))?;
            positions.push(distribution);
        }
        Ok(BaseLogits { path: path.to_path_buf(), header, positions })
    }

    /// Refuses a comparison with a run of another vocabulary, context, chunk count or token
    /// sequence, naming the first difference.
    pub fn check_compatible(&self, run: &LogitsHeader) -> Result<()> {
        let base = &self.header;
        let mismatch = |what: &'static str, base: String, run: String| PerplexityError::LogitsMismatch {
            path: self.path.clone(),
            what,
            base,
            run,
        };
        if base.vocab_size != run.vocab_size {
            return Err(mismatch("vocabulary size", base.vocab_size.to_string(), run.vocab_size.to_string()));
        }
        if base.ctx != run.ctx {
            return Err(mismatch("--ctx", base.ctx.to_string(), run.ctx.to_string()));
        }
        if base.chunks != run.chunks {
            return Err(mismatch("chunk count", base.chunks.to_string(), run.chunks.to_string()));
        }
        if base.fingerprint != run.fingerprint {
            return Err(mismatch(
                "token fingerprint",
                format!("{:016x}", base.fingerprint),
                format!("{:016x} (another text or tokenizer)", run.fingerprint),
            ));
        }
        Ok(())
    }
}

/// The checks a record must pass beyond its checksum (a file written by a buggy or foreign
/// writer): ids inside the vocabulary and distinct, no NaN, no log-probability above 0.
fn check_record(d: &TopKDistribution, vocab_size: usize) -> Result<(), String> {
    // Rounding can put a log-probability a hair above 0 when one token holds all the mass.
    const SLACK: f64 = 1e-9;
    let bad = |v: f64| v.is_nan() || v > SLACK;
    if bad(d.target_log_prob) || bad(d.log_rest) || d.log_probs.iter().any(|&v| bad(v)) {
        return Err("a log-probability that is NaN or above 0".into());
    }
    if let Some(id) = d.ids.iter().find(|&&id| id as usize >= vocab_size) {
        return Err(format!("token id {id} outside the vocabulary of {vocab_size}"));
    }
    let mut sorted = d.ids.clone();
    sorted.sort_unstable();
    if sorted.windows(2).any(|w| w[0] == w[1]) {
        return Err("a token listed twice".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::WindowPlan;

    fn score(logits: &[f32], target: u32) -> PositionScore {
        PositionScore::new(logits, target, 0).unwrap()
    }

    /// A plan of 2 chunks of ctx 4 (2 positions) and a header for it.
    fn header(vocab: usize, k: usize) -> LogitsHeader {
        let plan = WindowPlan::new(8, 4, None).unwrap();
        LogitsHeader::new(&plan, 0xfeed, vocab, k)
    }

    fn rows() -> Vec<(Vec<f32>, u32)> {
        vec![(vec![0.5, 3.0, -1.0, 3.0, 2.0, 0.0], 4), (vec![-2.0, 0.0, 1.0, 0.25, 9.0, 1.0], 1)]
    }

    fn write_file(path: &Path, k: usize) -> Vec<TopKDistribution> {
        let mut writer = LogitsWriter::create(path, header(6, k)).unwrap();
        let saved: Vec<TopKDistribution> =
            rows().iter().map(|(row, target)| TopKDistribution::from_score(&score(row, *target), k)).collect();
        for d in &saved {
            writer.push(d).unwrap();
        }
        assert_eq!(writer.finish().unwrap(), path);
        saved
    }

    #[test]
    fn top_k_keeps_the_most_likely_and_folds_the_rest() {
        let s = score(&[0.5, 3.0, -1.0, 3.0, 2.0, 0.0], 5);
        let d = TopKDistribution::from_score(&s, 3);
        // Ties between ids 1 and 3 go to the lower id first, which is also the argmax.
        assert_eq!(d.ids, vec![1, 3, 4]);
        assert_eq!(d.top1(), s.argmax);
        assert_eq!(d.target_log_prob, s.log_probs[5]);
        let rest: f64 = [0usize, 2, 5].iter().map(|&i| s.log_probs[i].exp()).sum();
        assert!((d.log_rest.exp() - rest).abs() < 1e-15);
        let total: f64 = d.log_probs.iter().map(|lp| lp.exp()).sum::<f64>() + d.log_rest.exp();
        assert!((total - 1.0).abs() < 1e-12);
        // k at or above the vocabulary: everything kept, no remainder.
        let all = TopKDistribution::from_score(&s, 100);
        assert_eq!(all.ids.len(), 6);
        assert_eq!(all.log_rest, f64::NEG_INFINITY);
    }

    #[test]
    fn a_written_file_reads_back_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("base.logits");
        let saved = write_file(&path, 3);
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len(), HEADER_BYTES + 2 * (16 + 12 * 3) + 8);
        let base = BaseLogits::read(&path).unwrap();
        assert_eq!(base.header, header(6, 3));
        assert_eq!(base.positions, saved);
        base.check_compatible(&header(6, 3)).unwrap();
        // Nothing but the file is left in the folder.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn truncated_or_damaged_files_are_typed_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("base.logits");
        write_file(&path, 2);
        let good = std::fs::read(&path).unwrap();
        let corrupt = |bytes: &[u8]| BaseLogits::parse(bytes, &path).unwrap_err();
        for cut in [0, 3, 8, 20, HEADER_BYTES, HEADER_BYTES + 5, good.len() - 1] {
            let error = corrupt(&good[..cut]);
            assert!(matches!(error, PerplexityError::CorruptLogits { .. }), "cut at {cut}: {error:?}");
        }
        assert!(corrupt(b"not a logits file at all, just some text").to_string().contains("magic"));
        let mut longer = good.clone();
        longer.push(0);
        assert!(corrupt(&longer).to_string().contains("promises"));
        // Every single flipped bit past the magic is caught (header checks or the checksum).
        for at in 8..good.len() {
            let mut flipped = good.clone();
            flipped[at] ^= 0x10;
            assert!(matches!(corrupt(&flipped), PerplexityError::CorruptLogits { .. }), "byte {at}");
        }
        let mut version = good.clone();
        version[8] = 2;
        assert!(corrupt(&version).to_string().contains("format version 2"));
        // A header promising absurd sizes does not allocate or panic.
        let mut huge = good.clone();
        huge[20..24].copy_from_slice(&u32::MAX.to_le_bytes());
        huge[28..36].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
        assert!(matches!(corrupt(&huge), PerplexityError::CorruptLogits { .. }));
        // A missing file is an I/O error naming it.
        let missing = BaseLogits::read(&dir.path().join("nope")).unwrap_err();
        assert!(matches!(missing, PerplexityError::Io { .. }) && missing.to_string().contains("nope"));
    }

    #[test]
    fn a_record_with_impossible_values_is_refused_even_with_a_valid_checksum() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("base.logits");
        let mut writer = LogitsWriter::create(&path, header(6, 2)).unwrap();
        let mut d = TopKDistribution::from_score(&score(&rows()[0].0, 4), 2);
        writer.push(&d).unwrap();
        d.ids[1] = 77;
        writer.push(&d).unwrap();
        writer.finish().unwrap();
        let error = BaseLogits::read(&path).unwrap_err();
        assert!(error.to_string().contains("position 1: token id 77 outside the vocabulary"), "{error}");
    }

    #[test]
    fn another_evaluation_is_a_mismatch() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("base.logits");
        write_file(&path, 2);
        let base = BaseLogits::read(&path).unwrap();
        let other_plan = WindowPlan::new(100, 8, Some(2)).unwrap();
        let cases = [
            (LogitsHeader { vocab_size: 7, ..header(6, 2) }, "vocabulary size 6, this run has 7"),
            (LogitsHeader::new(&other_plan, 0xfeed, 6, 2), "--ctx 4, this run has 8"),
            (LogitsHeader { chunks: 3, ..header(6, 2) }, "chunk count 2, this run has 3"),
            (LogitsHeader { fingerprint: 1, ..header(6, 2) }, "another text or tokenizer"),
        ];
        for (run, expected) in cases {
            let error = base.check_compatible(&run).unwrap_err();
            assert!(matches!(error, PerplexityError::LogitsMismatch { .. }));
            assert!(error.to_string().contains(expected), "{error}");
        }
    }

    #[test]
    fn an_unfinished_or_failed_write_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("base.logits");
        std::fs::write(&path, b"the previous file").unwrap();
        let mut writer = LogitsWriter::create(&path, header(6, 2)).unwrap();
        writer.push(&TopKDistribution::from_score(&score(&rows()[0].0, 1), 2)).unwrap();
        // One position short: refused, and the old file stays.
        assert!(matches!(writer.finish(), Err(PerplexityError::WriterMisuse { .. })));
        let writer = LogitsWriter::create(&path, header(6, 2)).unwrap();
        drop(writer);
        assert_eq!(std::fs::read(&path).unwrap(), b"the previous file");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "no temporary file is left");
        // A folder that does not exist, or a folder as the path: typed errors at creation.
        let nowhere = dir.path().join("no/such/dir/base.logits");
        assert!(matches!(LogitsWriter::create(&nowhere, header(6, 2)), Err(PerplexityError::Io { .. })));
        assert!(matches!(LogitsWriter::create(dir.path(), header(6, 2)), Err(PerplexityError::Io { .. })));
    }
}
