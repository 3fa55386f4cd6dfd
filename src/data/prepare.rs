//! `shoal data prepare`: text files → token shards (u16 when the vocab fits, u32
//! otherwise), a held-out validation shard, and `meta.json` naming the tokenizer's hash, the
//! vocab and where the tokens came from; and reading such a folder back.
//!
//! Text is read in blocks (about a thousandth of the corpus, 4 KB to 1 MB, cut after a
//! newline), encoded in parallel batches, and every [`VAL_EVERY`]-th block goes to the
//! validation shard, so the held-out text (~2%) is spread over the whole corpus and the
//! split is the same on every run. Files are
//! separated by the end-of-text token. Every file is written atomically and `meta.json`
//! last: a folder without it is not prepared data, and an interrupted run leaves none.

use super::tokenizer::{Tok, TokenizerError};
use super::DataError;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Text bytes per block for a corpus of `total` bytes: about a thousandth of it, so the
/// held-out blocks sample the whole corpus, within 4 KB..1 MB.
pub fn block_size(total: u64) -> usize {
    (total / 1000).clamp(4 << 10, 1 << 20) as usize
}

/// One block in this many is held out for validation.
pub const VAL_EVERY: u64 = 50;

/// Blocks encoded per parallel batch.
const BATCH: usize = 32;

/// Tokens per training shard.
const SHARD_TOKENS: usize = 64 << 20;

/// The format name in `meta.json`.
pub const FORMAT: &str = "shoal-tokens-1";

/// What `meta.json` says about a prepared folder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// [`FORMAT`].
    pub format: String,
    /// The tokenizer's hash ([`Tok::hash`]).
    pub tokenizer: String,
    /// The tokenizer's vocabulary size (every token id is below it).
    pub vocab: usize,
    /// `u16` or `u32`, little-endian.
    pub dtype: String,
    /// Training shards, in order, relative to the folder.
    pub train: Vec<String>,
    /// The validation shard.
    pub val: String,
    /// Tokens in the training shards.
    pub train_tokens: u64,
    /// Tokens in the validation shard.
    pub val_tokens: u64,
    /// The text files read, with their sizes.
    pub sources: Vec<(String, u64)>,
    /// One line for people.
    pub description: String,
}

impl Meta {
    fn width(&self) -> Result<usize, String> {
        match self.dtype.as_str() {
            "u16" => Ok(2),
            "u32" => Ok(4),
            d => Err(format!("unknown token dtype {d:?} (u16 or u32)")),
        }
    }
}

/// How far preparing has got.
#[derive(Debug, Clone, Copy, Default)]
pub struct Progress {
    /// Files finished.
    pub files_done: usize,
    /// Files in all.
    pub files: usize,
    /// Text bytes read.
    pub bytes: u64,
    /// Tokens written or buffered.
    pub tokens: u64,
    /// Seconds since the start.
    pub seconds: f64,
}

impl Progress {
    /// Text read per second, in MB.
    pub fn mb_per_s(&self) -> f64 {
        self.bytes as f64 / 1e6 / self.seconds.max(1e-9)
    }
}

struct Shards {
    dir: PathBuf,
    wide: bool,
    buf: Vec<u32>,
    names: Vec<String>,
    total: u64,
}

impl Shards {
    fn push(&mut self, tokens: &[u32]) -> Result<(), DataError> {
        self.buf.extend_from_slice(tokens);
        self.total += tokens.len() as u64;
        if self.buf.len() >= SHARD_TOKENS {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), DataError> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let name = format!("train-{:04}.bin", self.names.len());
        write_tokens(&self.dir.join(&name), &self.buf, self.wide)?;
        self.names.push(name);
        self.buf.clear();
        Ok(())
    }
}

fn write_tokens(path: &Path, tokens: &[u32], wide: bool) -> Result<(), DataError> {
    let mut bytes = Vec::with_capacity(tokens.len() * if wide { 4 } else { 2 });
    for &t in tokens {
        if wide {
            bytes.extend_from_slice(&t.to_le_bytes());
        } else {
            bytes.extend_from_slice(&(t as u16).to_le_bytes());
        }
    }
    crate::files::write_atomic(path, &bytes).map_err(|cause| DataError::Write {
        path: path.to_path_buf(),
        cause,
    })
}

fn tok_err(e: TokenizerError) -> DataError {
    DataError::Prepare(e.to_string())
}

/// Reads one block: about `size` bytes, completed to the end of the line.
fn read_block(r: &mut impl BufRead, size: usize, out: &mut Vec<u8>) -> std::io::Result<usize> {
    out.clear();
    r.by_ref().take(size as u64).read_to_end(out)?;
    if out.len() == size {
        r.read_until(b'\n', out)?;
    }
    Ok(out.len())
}

/// Tokenizes `files` with `tok` into `out` (created if needed), calling `progress` now
/// and then. Returns what it wrote into `meta.json`.
pub fn prepare(
    tok: &Tok,
    files: &[PathBuf],
    out: &Path,
    progress: &mut dyn FnMut(&Progress),
) -> Result<Meta, DataError> {
    if files.is_empty() {
        return Err(DataError::Prepare("no --data files given".into()));
    }
    let write_err = |path: &Path| {
        let path = path.to_path_buf();
        move |cause| DataError::Write { path, cause }
    };
    std::fs::create_dir_all(out).map_err(write_err(out))?;
    // An older meta.json would describe shards this run overwrites.
    let meta_path = out.join("meta.json");
    if meta_path.exists() {
        std::fs::remove_file(&meta_path).map_err(write_err(&meta_path))?;
    }
    let wide = tok.vocab() > 1 << 16;
    let eot = tok.end_of_text();
    let mut train = Shards {
        dir: out.to_path_buf(),
        wide,
        buf: Vec::new(),
        names: Vec::new(),
        total: 0,
    };
    let mut val: Vec<u32> = Vec::new();
    let started = Instant::now();
    let mut p = Progress {
        files: files.len(),
        ..Progress::default()
    };
    let mut sources = Vec::new();
    let mut block_no: u64 = 0;
    let total: u64 = files
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .sum();
    let block_len = block_size(total);
    let mut last_shown = Instant::now();
    for (i, path) in files.iter().enumerate() {
        let f = std::fs::File::open(path).map_err(|cause| DataError::Read {
            path: path.clone(),
            cause,
        })?;
        let size = f.metadata().map(|m| m.len()).unwrap_or(0);
        sources.push((path.display().to_string(), size));
        let mut r = BufReader::with_capacity(1 << 20, f);
        let mut block = Vec::new();
        loop {
            let mut texts = Vec::with_capacity(BATCH);
            while texts.len() < BATCH {
                let n =
                    read_block(&mut r, block_len, &mut block).map_err(|cause| DataError::Read {
                        path: path.clone(),
                        cause,
                    })?;
                if n == 0 {
                    break;
                }
                p.bytes += n as u64;
                texts.push(String::from_utf8_lossy(&block).into_owned());
            }
            if texts.is_empty() {
                break;
            }
            for ids in tok.encode_many(texts).map_err(tok_err)? {
                p.tokens += ids.len() as u64;
                block_no += 1;
                if block_no % VAL_EVERY == 0 {
                    val.extend_from_slice(&ids);
                } else {
                    train.push(&ids)?;
                }
            }
            if last_shown.elapsed().as_secs_f64() >= 1.0 {
                p.seconds = started.elapsed().as_secs_f64();
                progress(&p);
                last_shown = Instant::now();
            }
        }
        if let Some(e) = eot {
            train.push(&[e])?;
            p.tokens += 1;
        }
        p.files_done = i + 1;
    }
    // A corpus of fewer than VAL_EVERY blocks: hold out the tail of the training tokens
    // (still in the buffer, as such a corpus fills less than one shard).
    if val.is_empty() && train.names.is_empty() {
        let keep = train.buf.len() - train.buf.len() / 20;
        val = train.buf.split_off(keep);
        train.total -= val.len() as u64;
    }
    train.flush()?;
    write_tokens(&out.join("val.bin"), &val, wide)?;
    p.seconds = started.elapsed().as_secs_f64();
    progress(&p);
    let meta = Meta {
        format: FORMAT.into(),
        tokenizer: tok.hash().to_string(),
        vocab: tok.vocab(),
        dtype: if wide { "u32" } else { "u16" }.into(),
        description: format!(
            "{} file(s), {:.1} MB of text, {} tokens ({} held out), tokenizer {} of {} tokens",
            files.len(),
            p.bytes as f64 / 1e6,
            train.total + val.len() as u64,
            val.len(),
            tok.hash(),
            tok.vocab()
        ),
        train: train.names,
        val: "val.bin".into(),
        train_tokens: train.total,
        val_tokens: val.len() as u64,
        sources,
    };
    let json = serde_json::to_vec_pretty(&meta).map_err(|e| DataError::Prepare(e.to_string()))?;
    crate::files::write_atomic(&meta_path, &json).map_err(write_err(&meta_path))?;
    Ok(meta)
}

/// Reads a prepared folder's `meta.json`.
pub fn read_meta(dir: &Path) -> Result<Meta, DataError> {
    let path = dir.join("meta.json");
    let bytes = std::fs::read(&path).map_err(|_| {
        DataError::Prepare(format!(
            "{} has no meta.json: it is not a folder written by `shoal data prepare` \
             (or preparing it did not finish)",
            dir.display()
        ))
    })?;
    let meta: Meta = serde_json::from_slice(&bytes).map_err(|e| {
        DataError::Prepare(format!("{} is not a valid meta.json: {e}", path.display()))
    })?;
    if meta.format != FORMAT {
        return Err(DataError::Prepare(format!(
            "{} is format {:?}; this build reads {FORMAT:?}",
            path.display(),
            meta.format
        )));
    }
    meta.width().map_err(DataError::Prepare)?;
    Ok(meta)
}

/// A prepared folder's (training, validation) tokens, every id checked against the
/// tokenizer's vocab.
pub fn load(dir: &Path, meta: &Meta) -> Result<(Vec<u32>, Vec<u32>), DataError> {
    let width = meta.width().map_err(DataError::Prepare)?;
    let read = |name: &str, into: &mut Vec<u32>| -> Result<(), DataError> {
        let path = dir.join(name);
        let bytes = std::fs::read(&path).map_err(|cause| DataError::Read {
            path: path.clone(),
            cause,
        })?;
        if bytes.len() % width != 0 {
            return Err(DataError::Prepare(format!(
                "shard {} is {} bytes, not a whole number of {} tokens",
                path.display(),
                bytes.len(),
                meta.dtype
            )));
        }
        let start = into.len();
        if width == 2 {
            into.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32),
            );
        } else {
            into.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
        }
        if let Some(&token) = into[start..].iter().find(|&&t| t as usize >= meta.vocab) {
            return Err(DataError::TokenOutOfRange {
                path,
                token,
                vocab: meta.vocab,
            });
        }
        Ok(())
    };
    let mut train = Vec::new();
    for name in &meta.train {
        read(name, &mut train)?;
    }
    let mut val = Vec::new();
    read(&meta.val, &mut val)?;
    Ok((train, val))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_becomes_shards_a_held_out_shard_and_meta_that_load_back() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.txt");
        let b = dir.path().join("b.txt");
        let line = "a shoal of fish swims past the reef, and the reef stays. ";
        std::fs::write(&a, line.repeat(3000)).unwrap();
        std::fs::write(&b, line.repeat(50)).unwrap();
        let tok = super::super::tokenizer::train(
            std::slice::from_ref(&a),
            400,
            &dir.path().join("t.json"),
        )
        .unwrap();
        let out = dir.path().join("data");
        let mut calls = 0;
        let meta = prepare(&tok, &[a, b], &out, &mut |_| calls += 1).unwrap();
        assert!(calls >= 1);
        assert_eq!((meta.dtype.as_str(), meta.vocab), ("u16", tok.vocab()));
        assert!(meta.train_tokens > 0 && meta.val_tokens > 0, "{meta:?}");
        let back = read_meta(&out).unwrap();
        assert_eq!(back, meta);
        let (train, val) = load(&out, &meta).unwrap();
        assert_eq!(
            (train.len() as u64, val.len() as u64),
            (meta.train_tokens, meta.val_tokens)
        );
        // A run opens it when the tokenizer matches (evaluating on the held-out shard when
        // it holds a sequence), and refuses it, on one line, when it does not.
        let mut cfg = crate::config::RunConfig::tiny();
        cfg.model.vocab = 512;
        cfg.model.seq_len = 16;
        cfg.data = crate::config::DataConfig::Prepared {
            path: out.clone(),
            tokenizer: Some(meta.tokenizer.clone()),
        };
        let src = super::super::TokenSource::open(&cfg).unwrap();
        assert!(
            !std::ptr::eq(src.eval_source(), &src),
            "held-out tokens for eval"
        );
        cfg.data = crate::config::DataConfig::Prepared {
            path: out.clone(),
            tokenizer: Some("0123456789abcdef".into()),
        };
        let e = super::super::TokenSource::open(&cfg)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("tokenized with tokenizer") && !e.contains('\n'),
            "{e}"
        );
        cfg.model.vocab = meta.vocab - 1;
        cfg.data = crate::config::DataConfig::Prepared {
            path: out.clone(),
            tokenizer: None,
        };
        assert!(
            super::super::TokenSource::open(&cfg).is_err(),
            "a vocab smaller than the data's"
        );
        // Both files end with the end-of-text token (a corpus this small is held out from
        // its tail, so the second may be in the validation shard).
        let eot = tok.end_of_text().unwrap();
        assert_eq!(train.iter().chain(&val).filter(|&&t| t == eot).count(), 2);
        // A shard with a token outside the vocab, a torn shard, a folder without meta.json.
        std::fs::write(out.join("val.bin"), [0xff, 0xff]).unwrap();
        assert!(matches!(
            load(&out, &meta),
            Err(DataError::TokenOutOfRange { .. })
        ));
        std::fs::write(out.join("val.bin"), [1]).unwrap();
        assert!(load(&out, &meta).is_err());
        assert!(read_meta(dir.path()).is_err());
    }
}
