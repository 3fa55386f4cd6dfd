//! `shoal bench compress`: the same model trained on the same samples of real text once per
//! activation codec (`train --local`, stages in one process, every boundary crossing
//! through the codec as on the wire), reporting the bytes a sample puts across stage
//! boundaries (both directions, as sent) against the loss it reaches.
//!
//! The text is this machine's documentation (as `scripts/parity.sh` reads it) unless a file
//! is given: byte tokens, so any text works and nothing is downloaded.

use crate::config::{DataConfig, Family, RunConfig};
use crate::train::{train_local, LocalOptions, TrainError};
use crate::wire::ActivationCodec;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// What `shoal bench compress` runs.
#[derive(Debug, Clone)]
pub struct CompressBenchConfig {
    /// A text file to train on; `None`: the machine's documentation.
    pub text: Option<PathBuf>,
    /// The codecs, the first the reference (int8 by default).
    pub codecs: Vec<ActivationCodec>,
    /// Optimizer steps per codec.
    pub steps: u64,
    /// The model's width (4 blocks in 2 stages, heads of 64).
    pub d_model: usize,
    /// Held-out batches the loss is measured on.
    pub eval_batches: usize,
}

impl Default for CompressBenchConfig {
    fn default() -> Self {
        Self {
            text: None,
            codecs: ["int8", "subspace:16", "subspace:6"]
                .iter()
                .filter_map(|c| c.parse().ok())
                .collect(),
            steps: 300,
            d_model: 256,
            eval_batches: 32,
        }
    }
}

/// One codec's run.
#[derive(Debug, Clone, Serialize)]
pub struct CompressRow {
    /// The activation codec.
    pub codec: String,
    /// Frame bytes across stage boundaries per sample, forward and backward.
    pub activation_bytes_per_sample: f64,
    /// The reference row's bytes per sample over this row's.
    pub fewer_bytes: f64,
    /// Mean loss on the held-out batches after training.
    pub eval_loss: f64,
    /// This row's eval loss over the reference row's.
    pub loss_ratio: f64,
    /// Mean training loss of the last 20 steps.
    pub train_loss: f64,
    /// Samples trained per second (stages in one process, 2 threads).
    pub samples_per_s: f64,
    /// Optimizer steps.
    pub steps: u64,
    /// Seconds of training.
    pub seconds: f64,
}

/// Why the benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum CompressError {
    /// No text to train on.
    #[error("{0}")]
    NoText(String),
    /// A codec or the model does not make a valid run.
    #[error("{0}")]
    Invalid(String),
    /// Training failed.
    #[error(transparent)]
    Train(#[from] TrainError),
}

/// The benchmark's model on `text`: a Llama of byte tokens, `d_model` wide, 4 blocks in 2
/// stages, sequences of 64, microbatches of 16.
pub fn bench_config(text: &Path, d_model: usize, steps: u64) -> RunConfig {
    let mut cfg = RunConfig::tiny();
    let heads = (d_model / 64).max(1);
    cfg.model.family = Family::Llama;
    cfg.model.vocab = 256;
    cfg.model.d_model = d_model;
    cfg.model.n_layers = 4;
    cfg.model.n_heads = heads;
    cfg.model.n_kv_heads = Some((heads / 2).max(1));
    cfg.model.seq_len = 64;
    cfg.model.seed = 1;
    cfg.optimizer.warmup_steps = 20;
    cfg.training.steps = steps;
    cfg.training.target_loss = None;
    cfg.data = DataConfig::Text {
        path: text.to_path_buf(),
    };
    cfg
}

/// Text files of the machine's documentation, concatenated in path order, at most
/// `max_bytes`.
pub fn docs_corpus(max_bytes: usize) -> Vec<u8> {
    let mut files = Vec::new();
    for root in ["/usr/share/doc", "/usr/share/common-licenses"] {
        collect(Path::new(root), &mut files, 0);
    }
    files.sort();
    let mut out = Vec::new();
    for f in files.iter().take(400) {
        if let Ok(bytes) = std::fs::read(f) {
            out.extend_from_slice(&bytes);
        }
        if out.len() >= max_bytes {
            out.truncate(max_bytes);
            break;
        }
    }
    out
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>, depth: usize) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let Ok(kind) = e.file_type() else { continue };
        if kind.is_dir() && depth < 4 {
            collect(&p, out, depth + 1);
        } else if kind.is_file() {
            let name = e.file_name().to_string_lossy().into_owned();
            let text = name.ends_with(".txt") || name.starts_with("README") || name == "copyright";
            if text && !name.ends_with(".gz") {
                out.push(p);
            }
        }
    }
}

/// Trains the benchmark's model once per codec; `on_row` sees each row as it is done.
pub fn run(
    cfg: &CompressBenchConfig,
    on_row: &mut dyn FnMut(&CompressRow),
) -> Result<Vec<CompressRow>, CompressError> {
    let scratch;
    let text = match &cfg.text {
        Some(p) => p.clone(),
        None => {
            scratch = docs_file()?;
            scratch.path().to_path_buf()
        }
    };
    let mut rows: Vec<CompressRow> = Vec::new();
    for &codec in &cfg.codecs {
        let mut run = bench_config(&text, cfg.d_model, cfg.steps);
        run.codecs.activations = codec;
        run.validate()
            .map_err(|e| CompressError::Invalid(format!("{codec}: {e}")))?;
        let opts = LocalOptions {
            eval_batches: cfg.eval_batches,
            ..LocalOptions::default()
        };
        let r = train_local(&run, &opts, &mut |_| {})?;
        let samples = (r.steps - r.first_step) as f64 * run.training.batch_size as f64;
        let bytes = r.wire_bytes as f64 / samples.max(1.0);
        let (ref_bytes, ref_loss) = rows.first().map_or((bytes, r.eval_loss), |f| {
            (f.activation_bytes_per_sample, f.eval_loss)
        });
        let row = CompressRow {
            codec: codec.to_string(),
            activation_bytes_per_sample: bytes,
            fewer_bytes: ref_bytes / bytes.max(1e-9),
            eval_loss: r.eval_loss,
            loss_ratio: r.eval_loss / ref_loss,
            train_loss: r.tail_loss(20),
            samples_per_s: samples / r.seconds.max(1e-9),
            steps: r.steps,
            seconds: r.seconds,
        };
        on_row(&row);
        rows.push(row);
    }
    Ok(rows)
}

/// The machine's documentation ([`docs_corpus`], 4 MB at most) in a scratch file.
pub fn docs_file() -> Result<Scratch, CompressError> {
    let corpus = docs_corpus(4 << 20);
    if corpus.len() < 1 << 20 {
        return Err(CompressError::NoText(format!(
            "only {} bytes of documentation found under /usr/share/doc: give --text FILE",
            corpus.len()
        )));
    }
    let path = std::env::temp_dir().join(format!("shoal-compress-{}.txt", std::process::id()));
    crate::files::write_atomic(&path, &corpus)
        .map_err(|e| CompressError::NoText(format!("{}: {e}", path.display())))?;
    Ok(Scratch(path))
}

/// A scratch file removed when dropped.
#[derive(Debug)]
pub struct Scratch(PathBuf);

impl Scratch {
    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The rows as a table.
pub fn table(rows: &[CompressRow]) -> String {
    let mut s = format!(
        "{:<24} {:>14} {:>12} {:>10} {:>10} {:>10}\n",
        "codec", "bytes/sample", "fewer bytes", "eval loss", "vs first", "samples/s"
    );
    for r in rows {
        s += &format!(
            "{:<24} {:>14.0} {:>11.1}x {:>10.4} {:>9.3}x {:>10.1}\n",
            r.codec,
            r.activation_bytes_per_sample,
            r.fewer_bytes,
            r.eval_loss,
            r.loss_ratio,
            r.samples_per_s
        );
    }
    s
}
