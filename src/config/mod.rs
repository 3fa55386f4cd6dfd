//! The run config: model shape, stage cuts, optimizer, training, data and codecs, as TOML.
//!
//! Owns parsing and validation only: a [`RunConfig`] that comes out of [`RunConfig::from_toml`]
//! or [`RunConfig::load`] is internally consistent (heads divide the width, stage cuts are
//! in range, codecs parse). Every field has a documented default so configs stay short.

mod averaging;
mod model;

pub use averaging::{AggregateKind, AveragingConfig, AveragingMode, OuterSettings};
pub use model::{Family, InitScheme, ModelConfig};

use crate::wire::{ActivationCodec, CodecSpec};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Why a config was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}: {cause}")]
    Read {
        /// The path given.
        path: PathBuf,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// The TOML did not parse or has unknown or ill-typed fields.
    #[error("bad config {path}: {message}")]
    Parse {
        /// Where it came from.
        path: String,
        /// What the parser said, on one line.
        message: String,
    },
    /// The values are inconsistent.
    #[error("invalid config: {0}")]
    Invalid(String),
}

/// How the blocks are cut into pipeline stages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StagesConfig {
    /// Number of stages (default 1). Stage 0 also holds the embeddings, the last the head.
    #[serde(default = "d_one")]
    pub count: usize,
    /// Explicit cut points: stage i holds blocks `[cuts[i-1], cuts[i])`. Empty (the default)
    /// cuts the blocks as evenly as possible, earlier stages taking the remainder.
    #[serde(default)]
    pub cuts: Vec<usize>,
    /// `model` (the default): real candle stages. `sim`: a stand-in for benchmarks and
    /// tests only, which sleeps `sim_ms_per_sample` per sample (a third in forward, two
    /// thirds in backward) and exchanges tensors of the model's real sizes, so that its
    /// throughput, and a swarm's bound, is known exactly. `shoal peer` refuses it unless
    /// given `--allow-sim`.
    #[serde(default, skip_serializing_if = "StageKind::is_model")]
    pub kind: StageKind,
    /// Milliseconds of forward + backward per sample of a `sim` stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sim_ms_per_sample: Option<f64>,
}

/// What computes a stage.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StageKind {
    /// The real model on candle.
    #[default]
    Model,
    /// A timed stand-in (benchmarks and tests only).
    Sim,
}

impl StageKind {
    /// Whether the stages are the real model (not the `sim` stand-in).
    pub fn is_model(&self) -> bool {
        *self == StageKind::Model
    }
}

/// AdamW with linear warmup and cosine decay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    /// Peak learning rate (default 1e-3).
    #[serde(default = "d_lr")]
    pub lr: f64,
    /// Steps of linear warmup from 0 (default 20).
    #[serde(default = "d_warmup")]
    pub warmup_steps: u64,
    /// Learning rate at the end of the cosine, as a fraction of `lr` (default 0.1).
    #[serde(default = "d_min_lr")]
    pub min_lr_ratio: f64,
    /// Decoupled weight decay on matrices (default 0.1; biases, norms and embeddings none).
    #[serde(default = "d_wd")]
    pub weight_decay: f64,
    /// Adam β₁ (default 0.9).
    #[serde(default = "d_b1")]
    pub beta1: f64,
    /// Adam β₂ (default 0.95).
    #[serde(default = "d_b2")]
    pub beta2: f64,
    /// Adam ε (default 1e-8).
    #[serde(default = "d_eps")]
    pub eps: f64,
    /// Clip each stage's gradient to this global L2 norm; 0 disables (default 1.0).
    #[serde(default = "d_clip")]
    pub grad_clip: f64,
}

/// The training schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainingConfig {
    /// Sequences per microbatch (default 16).
    #[serde(default = "d_batch")]
    pub batch_size: usize,
    /// Samples the swarm accumulates per optimizer step (default: `batch_size`).
    #[serde(default)]
    pub target_batch_size: Option<usize>,
    /// Optimizer steps of the run; the cosine ends here (default 1000).
    #[serde(default = "d_steps")]
    pub steps: u64,
    /// Loss the run counts as success (the demo's exit code); none by default.
    #[serde(default)]
    pub target_loss: Option<f64>,
    /// Seed of data sampling (default 1).
    #[serde(default = "d_seed")]
    pub data_seed: u64,
}

/// Where tokens come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "source", rename_all = "lowercase", deny_unknown_fields)]
pub enum DataConfig {
    /// The built-in order-2 Markov corpus.
    Markov {
        /// Seed of the transition table (default 7).
        #[serde(default = "d_markov_seed")]
        seed: u64,
        /// Next tokens each context (previous two tokens) can take (default 4).
        #[serde(default = "d_branching")]
        branching: usize,
        /// Successors each token can have at all; contexts pick from their last token's
        /// pool (default: 2 × branching, capped at the vocab).
        #[serde(default)]
        pool: Option<usize>,
    },
    /// A UTF-8 text file, one token per byte.
    Text {
        /// Path of the file.
        path: PathBuf,
    },
    /// nanoGPT-style shards: little-endian u16 tokens in a file or a folder of `.bin` files.
    Shards {
        /// A `.bin` file or a folder of them.
        path: PathBuf,
    },
    /// A folder written by `shoal data prepare`: token shards, a held-out validation shard
    /// and `meta.json`.
    Prepared {
        /// The folder.
        path: PathBuf,
        /// The hash of the tokenizer the run trains with (recorded by `--data`): data
        /// tokenized otherwise is refused.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tokenizer: Option<String>,
    },
}

impl Default for DataConfig {
    fn default() -> Self {
        Self::Markov {
            seed: d_markov_seed(),
            branching: d_branching(),
            pool: None,
        }
    }
}

/// How tensors travel between stages and between replicas.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CodecsConfig {
    /// Activations and their gradients between stages (default int8), or a subspace of
    /// the residual stream (`subspace:RANK[+CODEC]`; see `model::subspace`).
    #[serde(default = "d_act")]
    pub activations: ActivationCodec,
    /// Averaged parameter gradients between replicas (default int8+zstd1).
    #[serde(default = "d_grad")]
    pub gradients: CodecSpec,
}

impl Default for CodecsConfig {
    fn default() -> Self {
        Self {
            activations: d_act(),
            gradients: d_grad(),
        }
    }
}

/// A whole run config, as in `configs/*.toml`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// Model shape.
    pub model: ModelConfig,
    /// Stage cuts.
    #[serde(default = "d_stages")]
    pub stages: StagesConfig,
    /// Optimizer.
    #[serde(default)]
    pub optimizer: OptimizerConfig,
    /// Training schedule.
    #[serde(default)]
    pub training: TrainingConfig,
    /// Data source.
    #[serde(default)]
    pub data: DataConfig,
    /// Codecs.
    #[serde(default)]
    pub codecs: CodecsConfig,
    /// Averaging knobs (absent from the canonical text while all are defaults).
    #[serde(default, skip_serializing_if = "AveragingConfig::is_default")]
    pub averaging: AveragingConfig,
}

fn d_seed() -> u64 {
    1
}
fn d_one() -> usize {
    1
}
fn d_lr() -> f64 {
    1e-3
}
fn d_warmup() -> u64 {
    20
}
fn d_min_lr() -> f64 {
    0.1
}
fn d_wd() -> f64 {
    0.1
}
fn d_b1() -> f64 {
    0.9
}
fn d_b2() -> f64 {
    0.95
}
fn d_eps() -> f64 {
    1e-8
}
fn d_clip() -> f64 {
    1.0
}
fn d_batch() -> usize {
    16
}
fn d_steps() -> u64 {
    1000
}
fn d_markov_seed() -> u64 {
    7
}
fn d_branching() -> usize {
    4
}
fn d_act() -> ActivationCodec {
    CodecSpec::INT8.into()
}
fn d_grad() -> CodecSpec {
    CodecSpec::INT8.with_zstd(1)
}
fn d_stages() -> StagesConfig {
    StagesConfig {
        count: 1,
        cuts: Vec::new(),
        kind: StageKind::Model,
        sim_ms_per_sample: None,
    }
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            lr: d_lr(),
            warmup_steps: d_warmup(),
            min_lr_ratio: d_min_lr(),
            weight_decay: d_wd(),
            beta1: d_b1(),
            beta2: d_b2(),
            eps: d_eps(),
            grad_clip: d_clip(),
        }
    }
}

impl Default for TrainingConfig {
    fn default() -> Self {
        Self {
            batch_size: d_batch(),
            target_batch_size: None,
            steps: d_steps(),
            target_loss: None,
            data_seed: d_seed(),
        }
    }
}

impl DataConfig {
    /// The Markov pool size this config implies, if it is the Markov corpus.
    pub fn markov_pool(&self, vocab: usize) -> Option<usize> {
        match self {
            Self::Markov {
                branching, pool, ..
            } => Some(pool.unwrap_or(2 * branching).min(vocab)),
            _ => None,
        }
    }
}

impl RunConfig {
    /// Parses and validates TOML text; `origin` names it in errors.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let cfg: Self = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: origin.to_string(),
            message: e.message().replace('\n', " "),
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads, parses and validates a config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|cause| ConfigError::Read {
            path: path.to_path_buf(),
            cause,
        })?;
        Self::from_toml(&text, &path.display().to_string())
    }

    /// The built-in tiny config, for the demo and tests: the same run as
    /// `configs/tiny.toml` (a test keeps the two equal).
    pub fn tiny() -> Self {
        Self {
            model: ModelConfig {
                vocab: 16,
                d_model: 64,
                n_layers: 4,
                n_heads: 4,
                seq_len: 64,
                ..ModelConfig::default()
            },
            stages: StagesConfig {
                count: 2,
                ..d_stages()
            },
            optimizer: OptimizerConfig {
                lr: 3e-3,
                warmup_steps: 30,
                min_lr_ratio: 0.1,
                weight_decay: 0.05,
                grad_clip: 1.0,
                ..OptimizerConfig::default()
            },
            training: TrainingConfig {
                batch_size: 16,
                steps: 600,
                target_loss: Some(1.05),
                ..TrainingConfig::default()
            },
            data: DataConfig::Markov {
                seed: 7,
                branching: 3,
                pool: Some(6),
            },
            codecs: CodecsConfig {
                activations: CodecSpec::INT8.into(),
                gradients: CodecSpec::INT8.with_zstd(1),
            },
            averaging: AveragingConfig::default(),
        }
    }

    /// Samples per optimizer step.
    pub fn target_batch_size(&self) -> usize {
        self.training
            .target_batch_size
            .unwrap_or(self.training.batch_size)
    }

    /// The last dim of the tensors between stages: `d_model`, or under a subspace its rank
    /// and the token id.
    pub fn boundary_width(&self) -> usize {
        match self.codecs.activations.subspace {
            Some(r) => r as usize + 1,
            None => self.model.d_model,
        }
    }

    /// What a subspace of rank `rank` needs of the model.
    fn check_subspace(&self, rank: u32) -> Result<(), String> {
        let m = &self.model;
        let name = self.codecs.activations;
        if rank == 0 || rank as usize > m.d_model {
            return Err(format!(
                "codecs.activations = \"{name}\": the rank must be in 1..={} (model.d_model)",
                m.d_model
            ));
        }
        if m.family != Family::Llama || m.tie_embeddings || self.stages.kind == StageKind::Sim {
            return Err(format!(
                "codecs.activations = \"{name}\" needs model.family = \"llama\", untied \
                 embeddings and model stages (stages.kind = \"model\")"
            ));
        }
        Ok(())
    }

    /// Block ranges of each stage, `[start, end)`.
    pub fn stage_ranges(&self) -> Vec<(usize, usize)> {
        let n = self.model.n_layers;
        let s = self.stages.count;
        let cuts: Vec<usize> = if self.stages.cuts.is_empty() {
            // Even split; the first `n % s` stages take one block more.
            let (base, extra) = (n / s, n % s);
            (1..s).map(|i| i * base + i.min(extra)).collect()
        } else {
            self.stages.cuts.clone()
        };
        let mut bounds = vec![0];
        bounds.extend(cuts);
        bounds.push(n);
        bounds.windows(2).map(|w| (w[0], w[1])).collect()
    }

    /// Checks that the values are consistent.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        self.averaging.validate().map_err(ConfigError::Invalid)?;
        let m = &self.model;
        m.validate(self.stages.count)
            .map_err(ConfigError::Invalid)?;
        let s = &self.stages;
        if s.count == 0 || s.count > m.n_layers {
            return bad(format!(
                "stages.count ({}) must be between 1 and model.n_layers ({})",
                s.count, m.n_layers
            ));
        }
        if !s.cuts.is_empty() {
            let ok = s.cuts.len() + 1 == s.count
                && s.cuts.windows(2).all(|w| w[0] < w[1])
                && s.cuts.first().is_some_and(|&c| c > 0)
                && s.cuts.last().is_some_and(|&c| c < m.n_layers);
            if !ok {
                return bad(format!(
                    "stages.cuts {:?} must be {} increasing block indices in 1..{}",
                    s.cuts,
                    s.count - 1,
                    m.n_layers
                ));
            }
        }
        match (s.kind, s.sim_ms_per_sample) {
            (StageKind::Sim, Some(ms)) if ms.is_finite() && ms > 0.0 && ms <= 10_000.0 => {}
            (StageKind::Sim, Some(ms)) => {
                return bad(format!(
                    "stages.sim_ms_per_sample must be in (0, 10000], got {ms}"
                ))
            }
            (StageKind::Sim, None) => {
                return bad("stages.kind = \"sim\" needs stages.sim_ms_per_sample".into())
            }
            (StageKind::Model, Some(_)) => {
                return bad("stages.sim_ms_per_sample is only for stages.kind = \"sim\"".into())
            }
            (StageKind::Model, None) => {}
        }
        if let Some(rank) = self.codecs.activations.subspace {
            self.check_subspace(rank).map_err(ConfigError::Invalid)?;
        }
        let o = &self.optimizer;
        if !(o.lr > 0.0 && o.lr.is_finite()) {
            return bad(format!("optimizer.lr must be positive, got {}", o.lr));
        }
        if !(0.0..1.0).contains(&o.beta1) || !(0.0..1.0).contains(&o.beta2) {
            return bad("optimizer.beta1 and beta2 must be in [0, 1)".into());
        }
        if !(0.0..=1.0).contains(&o.min_lr_ratio) || o.weight_decay < 0.0 || o.grad_clip < 0.0 {
            return bad("optimizer.min_lr_ratio in [0, 1], weight_decay and grad_clip ≥ 0".into());
        }
        if o.eps <= 0.0 || o.eps.is_nan() {
            return bad("optimizer.eps must be positive".into());
        }
        let t = &self.training;
        if t.batch_size == 0 || t.steps == 0 || self.target_batch_size() == 0 {
            return bad("training.batch_size, target_batch_size and steps must be ≥ 1".into());
        }
        match &self.data {
            DataConfig::Markov { branching, .. } if *branching == 0 || *branching > m.vocab => bad(
                format!("data.branching must be in 1..={} (the vocab)", m.vocab),
            ),
            DataConfig::Markov {
                branching,
                pool: Some(p),
                ..
            } if *p < *branching || *p > m.vocab => bad(format!(
                "data.pool must be in {branching}..={} (branching..=vocab)",
                m.vocab
            )),
            DataConfig::Text { .. } if m.vocab < 256 => bad(format!(
                "text data is tokenised as bytes and needs model.vocab ≥ 256, got {}",
                m.vocab
            )),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests;
