//! Token sources and deterministic sampling of training sequences.
//!
//! Sources: the built-in Markov corpus ([`markov`]), a UTF-8 text file tokenised as bytes,
//! nanoGPT-style shards of little-endian u16 tokens, and folders written by `shoal data
//! prepare` ([`prepare`], with a [`tokenizer`]) whose validation shard is held out. A [`Sampler`] draws (input, target)
//! batches as a pure function of (data seed, trainer index, draw count), so two trainers never
//! feed the same sequence order and a rerun feeds the same one. Does not know about tensors.

pub mod markov;
pub mod prepare;
pub mod tokenizer;

pub use markov::MarkovSource;

use crate::config::{DataConfig, RunConfig};
use crate::rng::{derive_seed, Rng};
use std::path::{Path, PathBuf};

/// Why a data source could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The path does not exist or cannot be read.
    #[error("cannot read data {path}: {cause}")]
    Read {
        /// The path.
        path: PathBuf,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// The file holds no tokens.
    #[error("data file {0} is empty")]
    Empty(PathBuf),
    /// Fewer tokens than one training sequence needs.
    #[error("data {path} has {tokens} tokens; one sequence needs {need} (seq_len + 1)")]
    TooShort {
        /// The path.
        path: PathBuf,
        /// Tokens found.
        tokens: usize,
        /// Tokens needed.
        need: usize,
    },
    /// A shard's byte length is not a whole number of u16 tokens.
    #[error("shard {0} has an odd number of bytes; shards hold little-endian u16 tokens")]
    OddShard(PathBuf),
    /// A token id at or above the model's vocab.
    #[error("data {path} holds token {token}, outside the model's vocab of {vocab}")]
    TokenOutOfRange {
        /// The path.
        path: PathBuf,
        /// The offending token.
        token: u32,
        /// The vocab size.
        vocab: usize,
    },
    /// A folder without `.bin` shards.
    #[error("folder {0} holds no .bin shards")]
    NoShards(PathBuf),
    /// A file could not be written.
    #[error("cannot write {path}: {cause}")]
    Write {
        /// The path.
        path: PathBuf,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// Preparing or reading prepared data failed.
    #[error("{0}")]
    Prepare(String),
    /// Data tokenized otherwise than the run.
    #[error("data {path} was tokenized with tokenizer {found}; the run uses {want}: prepare it with the run's tokenizer")]
    OtherTokenizer {
        /// The folder.
        path: PathBuf,
        /// Its tokenizer's hash.
        found: String,
        /// The run's.
        want: String,
    },
}

/// Where sequences come from.
#[derive(Debug, Clone)]
pub enum TokenSource {
    /// The built-in Markov corpus (infinite).
    Markov(MarkovSource),
    /// A finite token array from a file or shards.
    Tokens {
        /// Where it came from, for messages.
        origin: PathBuf,
        /// The tokens.
        tokens: Vec<u32>,
        /// Held-out tokens for evaluation (prepared data's validation shard).
        held_out: Option<Box<TokenSource>>,
    },
}

fn read(path: &Path) -> Result<Vec<u8>, DataError> {
    std::fs::read(path).map_err(|cause| DataError::Read {
        path: path.to_path_buf(),
        cause,
    })
}

fn shard_files(path: &Path) -> Result<Vec<PathBuf>, DataError> {
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let entries = std::fs::read_dir(path).map_err(|cause| DataError::Read {
        path: path.to_path_buf(),
        cause,
    })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "bin"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(DataError::NoShards(path.to_path_buf()));
    }
    Ok(files)
}

impl TokenSource {
    /// Opens the source a config names, checked against its vocab and sequence length.
    pub fn open(cfg: &RunConfig) -> Result<Self, DataError> {
        let vocab = cfg.model.vocab;
        let need = cfg.model.seq_len + 1;
        let (origin, tokens) = match &cfg.data {
            DataConfig::Markov {
                seed, branching, ..
            } => {
                let pool = cfg.data.markov_pool(vocab).unwrap_or(vocab);
                return Ok(Self::Markov(MarkovSource::new(
                    vocab, *branching, pool, *seed,
                )));
            }
            DataConfig::Text { path } => {
                let bytes = read(path)?;
                (
                    path.clone(),
                    bytes.into_iter().map(u32::from).collect::<Vec<_>>(),
                )
            }
            DataConfig::Shards { path } => {
                let mut tokens = Vec::new();
                for file in shard_files(path)? {
                    let bytes = read(&file)?;
                    if bytes.len() % 2 != 0 {
                        return Err(DataError::OddShard(file));
                    }
                    tokens.extend(
                        bytes
                            .chunks_exact(2)
                            .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32),
                    );
                }
                (path.clone(), tokens)
            }
            DataConfig::Prepared { path, tokenizer } => {
                let meta = prepare::read_meta(path)?;
                if let Some(want) = tokenizer.as_ref().filter(|w| **w != meta.tokenizer) {
                    return Err(DataError::OtherTokenizer {
                        path: path.clone(),
                        found: meta.tokenizer,
                        want: want.clone(),
                    });
                }
                if meta.vocab > vocab {
                    return Err(DataError::Prepare(format!(
                        "data {} was tokenized with a vocab of {}; model.vocab is {vocab}: \
                         set model.vocab to at least {}",
                        path.display(),
                        meta.vocab,
                        meta.vocab
                    )));
                }
                let (tokens, val) = prepare::load(path, &meta)?;
                let held_out = (val.len() >= need).then(|| {
                    Box::new(Self::Tokens {
                        origin: path.join(&meta.val),
                        tokens: val,
                        held_out: None,
                    })
                });
                return Self::checked(path.clone(), tokens, vocab, need, held_out);
            }
        };
        Self::checked(origin, tokens, vocab, need, None)
    }

    fn checked(
        origin: PathBuf,
        tokens: Vec<u32>,
        vocab: usize,
        need: usize,
        held_out: Option<Box<TokenSource>>,
    ) -> Result<Self, DataError> {
        if tokens.is_empty() {
            return Err(DataError::Empty(origin));
        }
        if tokens.len() < need {
            return Err(DataError::TooShort {
                path: origin,
                tokens: tokens.len(),
                need,
            });
        }
        if let Some(&token) = tokens.iter().max().filter(|&&t| t as usize >= vocab) {
            return Err(DataError::TokenOutOfRange {
                path: origin,
                token,
                vocab,
            });
        }
        Ok(Self::Tokens {
            origin,
            tokens,
            held_out,
        })
    }

    /// Where evaluation batches come from: the held-out tokens when there are some, else
    /// this source itself (drawn by a stream of its own, [`Sampler::eval`]).
    pub fn eval_source(&self) -> &TokenSource {
        match self {
            Self::Tokens {
                held_out: Some(h), ..
            } => h,
            _ => self,
        }
    }

    /// The Markov source's best achievable mean loss at `seq_len`, if this is the Markov corpus.
    pub fn best_loss(&self, seq_len: usize) -> Option<f64> {
        match self {
            Self::Markov(m) => m.best_loss(seq_len),
            Self::Tokens { .. } => None,
        }
    }

    /// The Markov source's entropy rate, if this is the Markov corpus.
    pub fn entropy_rate(&self) -> Option<f64> {
        match self {
            Self::Markov(m) => m.entropy_rate(),
            Self::Tokens { .. } => None,
        }
    }
}

/// A batch of `batch` sequences: inputs and next-token targets, row-major `[batch, seq_len]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Sequences in the batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Input token ids.
    pub inputs: Vec<u32>,
    /// Target token ids (inputs shifted by one).
    pub targets: Vec<u32>,
}

/// Draws batches for one trainer, deterministically.
#[derive(Debug, Clone)]
pub struct Sampler {
    rng: Rng,
}

impl Sampler {
    /// The stream of trainer `trainer` under `data_seed`.
    pub fn new(data_seed: u64, trainer: u64) -> Self {
        Self {
            rng: Rng::new(derive_seed(data_seed, &format!("trainer/{trainer}"))),
        }
    }

    /// A held-out stream for evaluation, disjoint from every trainer's.
    pub fn eval(data_seed: u64) -> Self {
        Self {
            rng: Rng::new(derive_seed(data_seed, "eval")),
        }
    }

    /// The next batch of `batch` sequences of `seq_len` tokens.
    pub fn next_batch(&mut self, source: &TokenSource, batch: usize, seq_len: usize) -> Batch {
        let mut inputs = Vec::with_capacity(batch * seq_len);
        let mut targets = Vec::with_capacity(batch * seq_len);
        let mut seq = Vec::with_capacity(seq_len + 1);
        for _ in 0..batch {
            seq.clear();
            match source {
                TokenSource::Markov(m) => m.sample_into(&mut self.rng, seq_len + 1, &mut seq),
                TokenSource::Tokens { tokens, .. } => {
                    let starts = (tokens.len() - seq_len) as u64; // open() checked len > seq_len
                    let at = self.rng.below(starts) as usize;
                    seq.extend_from_slice(&tokens[at..at + seq_len + 1]);
                }
            }
            inputs.extend_from_slice(&seq[..seq_len]);
            targets.extend_from_slice(&seq[1..]);
        }
        Batch {
            batch,
            seq_len,
            inputs,
            targets,
        }
    }
}
