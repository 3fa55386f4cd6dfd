//! Tokenizers, with Hugging Face's `tokenizers` crate: training a byte-level BPE on the
//! user's text, loading any `tokenizer.json` (ours or one from Hugging Face), and the hash
//! a run records so that data tokenized otherwise is refused.

use std::path::{Path, PathBuf};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer, TokenizerBuilder};

/// The token that separates documents (files) in prepared data.
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// Why a tokenizer could not be trained, read or used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// The file is missing or is not a tokenizer.
    #[error("{path} is not a tokenizer file (a Hugging Face tokenizer.json): {cause}")]
    Load {
        /// The path.
        path: PathBuf,
        /// What the parser said.
        cause: String,
    },
    /// Training failed.
    #[error("training the tokenizer failed: {0}")]
    Train(String),
    /// Writing the result failed.
    #[error("cannot write {path}: {cause}")]
    Write {
        /// The path.
        path: PathBuf,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// Encoding or decoding failed.
    #[error("tokenizer: {0}")]
    Codec(String),
}

/// A loaded tokenizer with the hash runs record.
pub struct Tok {
    inner: Tokenizer,
    hash: String,
}

impl Tok {
    /// Reads a `tokenizer.json`.
    pub fn load(path: &Path) -> Result<Self, TokenizerError> {
        let load = |cause: String| TokenizerError::Load {
            path: path.to_path_buf(),
            cause: first_line(&cause),
        };
        if !path.is_file() {
            return Err(load("no such file".into()));
        }
        let inner = Tokenizer::from_file(path).map_err(|e| load(e.to_string()))?;
        if inner.get_vocab_size(true) == 0 {
            return Err(load("its vocabulary is empty".into()));
        }
        let hash = hash_of(&inner)?;
        Ok(Self { inner, hash })
    }

    /// Token ids (including added tokens such as [`END_OF_TEXT`]).
    pub fn vocab(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The hash of the tokenizer's canonical JSON (16 hex digits): equal hashes, equal
    /// tokenization.
    pub fn hash(&self) -> &str {
        &self.hash
    }

    /// The id of [`END_OF_TEXT`], when the tokenizer has it.
    pub fn end_of_text(&self) -> Option<u32> {
        self.inner.token_to_id(END_OF_TEXT)
    }

    /// Token ids of `text` (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.inner
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Codec(e.to_string()))
    }

    /// Token ids of several texts, in parallel.
    pub fn encode_many(&self, texts: Vec<String>) -> Result<Vec<Vec<u32>>, TokenizerError> {
        self.inner
            .encode_batch_fast(texts, false)
            .map(|v| v.iter().map(|e| e.get_ids().to_vec()).collect())
            .map_err(|e| TokenizerError::Codec(e.to_string()))
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, true)
            .map_err(|e| TokenizerError::Codec(e.to_string()))
    }
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("").trim().to_string()
}

fn hash_of(t: &Tokenizer) -> Result<String, TokenizerError> {
    use sha2::Digest;
    let json = t
        .to_string(false)
        .map_err(|e| TokenizerError::Codec(e.to_string()))?;
    let digest = sha2::Sha256::digest(json.as_bytes());
    Ok(digest[..8].iter().map(|b| format!("{b:02x}")).collect())
}

/// Trains a byte-level BPE of at most `vocab` tokens (the 256 bytes, [`END_OF_TEXT`] and the
/// merges) on `files` and writes it to `out` as a `tokenizer.json` (atomically). Returns the
/// trained tokenizer.
pub fn train(files: &[PathBuf], vocab: usize, out: &Path) -> Result<Tok, TokenizerError> {
    if vocab < 258 {
        return Err(TokenizerError::Train(format!(
            "--vocab {vocab} is too small: a byte-level BPE needs 256 byte tokens and \
             the end-of-text token (258 or more)"
        )));
    }
    for f in files {
        if !f.is_file() {
            return Err(TokenizerError::Train(format!(
                "data file {} does not exist",
                f.display()
            )));
        }
    }
    let mut trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(vocab)
        .min_frequency(2)
        .special_tokens(vec![AddedToken::from(END_OF_TEXT.to_string(), true)])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tok = TokenizerBuilder::<BPE, _, _, _, _>::new()
        .with_model(BPE::default())
        .with_normalizer(None::<tokenizers::NormalizerWrapper>)
        .with_pre_tokenizer(Some(ByteLevel::new(false, true, true)))
        .with_post_processor(Some(ByteLevel::new(false, true, true)))
        .with_decoder(Some(ByteLevel::new(false, true, true)))
        .build()
        .map_err(|e| TokenizerError::Train(e.to_string()))?;
    let names = files.iter().map(|f| f.display().to_string()).collect();
    tok.train_from_files(&mut trainer, names)
        .map_err(|e| TokenizerError::Train(first_line(&e.to_string())))?;
    let json = tok
        .to_string(false)
        .map_err(|e| TokenizerError::Train(e.to_string()))?;
    crate::files::write_atomic(out, json.as_bytes()).map_err(|cause| TokenizerError::Write {
        path: out.to_path_buf(),
        cause,
    })?;
    Tok::load(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trained_tokenizer_round_trips_text_and_is_refused_when_not_one() {
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("t.txt");
        let body = "the quick brown fox jumps over the lazy dog. ".repeat(200) + "naïve café ✓";
        std::fs::write(&text, &body).unwrap();
        let out = dir.path().join("tok.json");
        let tok = train(std::slice::from_ref(&text), 300, &out).unwrap();
        assert!(tok.vocab() > 257 && tok.vocab() <= 300, "{}", tok.vocab());
        assert!(tok.end_of_text().is_some());
        let ids = tok.encode("the lazy fox ✓").unwrap();
        assert!(ids.len() < "the lazy fox ✓".len(), "merges shorten text");
        assert_eq!(tok.decode(&ids).unwrap(), "the lazy fox ✓");
        // Loading it again gives the same hash; a text file is not a tokenizer.
        assert_eq!(Tok::load(&out).unwrap().hash(), tok.hash());
        let e = Tok::load(&text).err().unwrap().to_string();
        assert!(e.contains("is not a tokenizer"), "{e}");
        assert!(train(&[text], 100, &out).is_err());
    }
}
