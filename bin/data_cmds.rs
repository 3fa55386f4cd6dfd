//! `shoal tokenizer train` and `shoal data prepare`: the user's text → a tokenizer → token
//! shards a run trains on.

use anyhow::{bail, Context, Result};
use clap::Subcommand;
use shoal::config::{DataConfig, RunConfig};
use shoal::data::prepare::{self, Progress};
use shoal::data::tokenizer::{self, Tok};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

#[derive(Subcommand)]
pub enum TokenizerCommand {
    /// Train a byte-level BPE tokenizer on text files and write it as a tokenizer.json.
    Train {
        /// UTF-8 text files to learn from.
        #[arg(long, value_name = "FILE", num_args = 1.., required = true)]
        data: Vec<PathBuf>,
        /// Tokens in the vocabulary, at most (the 256 bytes and <|endoftext|> included).
        #[arg(long, value_name = "N")]
        vocab: usize,
        /// Where to write the tokenizer.
        #[arg(long, value_name = "FILE", default_value = "tokenizer.json")]
        out: PathBuf,
    },
}

#[derive(Subcommand)]
pub enum DataCommand {
    /// Tokenize text files into shards (u16 or u32), a held-out validation shard and
    /// meta.json, for `--data DIR`.
    Prepare {
        /// A tokenizer.json (from `shoal tokenizer train` or Hugging Face).
        #[arg(long, value_name = "FILE")]
        tokenizer: PathBuf,
        /// UTF-8 text files.
        #[arg(long, value_name = "FILE", num_args = 1.., required = true)]
        data: Vec<PathBuf>,
        /// The folder to write.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
}

pub fn tokenizer(which: TokenizerCommand) -> Result<ExitCode> {
    let TokenizerCommand::Train { data, vocab, out } = which;
    let bytes: u64 = data
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .sum();
    eprintln!(
        "training a byte-level BPE of ≤{vocab} tokens on {} file(s), {:.1} MB",
        data.len(),
        bytes as f64 / 1e6
    );
    let started = Instant::now();
    let bar = crate::progress::Bar::spinner("tokenizer", "counting pairs and merging");
    let tok = tokenizer::train(&data, vocab, &out);
    bar.clear();
    let tok = tok?;
    println!(
        "wrote {}: {} tokens, hash {}, in {:.1} s",
        out.display(),
        tok.vocab(),
        tok.hash(),
        started.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

pub fn data(which: DataCommand) -> Result<ExitCode> {
    let DataCommand::Prepare {
        tokenizer,
        data,
        out,
    } = which;
    let tok = Tok::load(&tokenizer)?;
    eprintln!(
        "tokenizer {} ({} tokens, hash {})",
        tokenizer.display(),
        tok.vocab(),
        tok.hash()
    );
    let total: u64 = data
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .sum();
    let bar = crate::progress::Bar::bytes(total, "read");
    let meta = prepare::prepare(&tok, &data, &out, &mut |p: &Progress| {
        bar.set(p.bytes, || {
            format!(
                "files {}/{}, {} tokens, {:.1} MB/s",
                p.files_done,
                p.files,
                p.tokens,
                p.mb_per_s()
            )
        })
    })
    .with_context(|| format!("preparing {}", out.display()))?;
    bar.clear();
    println!(
        "wrote {}: {} training tokens in {} shard(s) ({}), {} held out; {}",
        out.display(),
        meta.train_tokens,
        meta.train.len(),
        meta.dtype,
        meta.val_tokens,
        meta.description
    );
    Ok(ExitCode::SUCCESS)
}

/// Points `cfg` at `path`: a prepared folder (recording its tokenizer's hash), a text file
/// (byte tokens), or u16 shards.
pub fn data_override(cfg: &mut RunConfig, path: &Path) -> Result<()> {
    if !path.exists() {
        bail!("data path {} does not exist", path.display());
    }
    if path.join("meta.json").is_file() {
        let meta = shoal::data::prepare::read_meta(path)?;
        if meta.vocab > cfg.model.vocab {
            bail!(
                "data {} was tokenized with a vocab of {}; the config's model.vocab is {}: \
                 use a config with model.vocab ≥ {} or a smaller tokenizer",
                path.display(),
                meta.vocab,
                cfg.model.vocab,
                meta.vocab
            );
        }
        cfg.data = DataConfig::Prepared {
            path: path.to_path_buf(),
            tokenizer: Some(meta.tokenizer),
        };
        return Ok(());
    }
    let shards = path.is_dir() || path.extension().is_some_and(|e| e == "bin");
    cfg.data = if shards {
        DataConfig::Shards {
            path: path.to_path_buf(),
        }
    } else {
        if cfg.model.vocab < 256 {
            eprintln!(
                "note: text is tokenised as bytes; model.vocab raised from {} to 256",
                cfg.model.vocab
            );
            cfg.model.vocab = 256;
        }
        DataConfig::Text {
            path: path.to_path_buf(),
        }
    };
    Ok(())
}
