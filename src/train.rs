//! Local training: every stage in one process, activations passed through the wire codec.
//!
//! Between stages, activations (forward) and their gradients (backward) are encoded and
//! decoded with the run's activation codec exactly as they will be on the network, so the
//! effect of compression on training shows here first. One optimizer step accumulates
//! `target_batch_size` samples in microbatches of `batch_size`. Reporting is a callback; this
//! module prints nothing.

use crate::config::RunConfig;
use crate::data::{Batch, DataError, Sampler, TokenSource};
use crate::model::{build_stages, AdamW, ModelError, Stage, Upstream};
use crate::wire::{self, CodecSpec, Limits, WireError};
use candle_core::{Device, Tensor};
use std::time::Instant;

/// Why local training stopped.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The model refused an input or an op failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A tensor did not survive the codec.
    #[error("wire: {0}")]
    Wire(#[from] WireError),
    /// The data source could not be opened.
    #[error(transparent)]
    Data(#[from] DataError),
    /// The loss became NaN or infinite.
    #[error("loss diverged to {loss} at step {step}; try a lower optimizer.lr")]
    Diverged {
        /// Step at which it happened.
        step: u64,
        /// The loss.
        loss: f32,
    },
}

impl From<candle_core::Error> for TrainError {
    fn from(e: candle_core::Error) -> Self {
        Self::Model(ModelError::Candle(e))
    }
}

/// Options beyond the run config.
#[derive(Debug, Clone)]
pub struct LocalOptions {
    /// Optimizer steps to run (default: the config's `training.steps`).
    pub steps: Option<u64>,
    /// Device for every stage.
    pub device: Device,
    /// Held-out batches for the final evaluation.
    pub eval_batches: usize,
    /// Write every stage's checkpoint at the end (and every `checkpoint_every`) to
    /// [`stage_checkpoint`]`(path, stage)`.
    pub checkpoint: Option<std::path::PathBuf>,
    /// Also checkpoint this often.
    pub checkpoint_every: Option<std::time::Duration>,
    /// Start from the checkpoints written with this path (every stage at one step).
    pub resume: Option<std::path::PathBuf>,
    /// Threads each microbatch's backward is split over, by sequences (CPU; default: the
    /// cores available).
    pub threads: usize,
}

impl Default for LocalOptions {
    fn default() -> Self {
        Self {
            steps: None,
            device: Device::Cpu,
            eval_batches: 8,
            checkpoint: None,
            checkpoint_every: None,
            resume: None,
            threads: std::thread::available_parallelism().map_or(1, usize::from),
        }
    }
}

/// Where a local run keeps stage `stage`'s checkpoint: `PATH.stageN`.
pub fn stage_checkpoint(path: &std::path::Path, stage: usize) -> std::path::PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".stage{stage}"));
    name.into()
}

/// Writes every stage's checkpoint of the local run `run` (canonical config `config`).
fn save_all(
    path: &std::path::Path,
    stages: &[Stage],
    opts: &[AdamW],
    run: &crate::dht::Manifest,
    samples: u64,
) -> Result<(), TrainError> {
    for (stage, opt) in stages.iter().zip(opts) {
        let info = crate::model::checkpoint::Info {
            run: run.id.clone(),
            config: run.canonical.clone(),
            stage: stage.index(),
            step: opt.step_count(),
            params_hash: format!("{:016x}", stage.params().hash()?),
            samples_applied: samples,
            samples_lost: 0,
        };
        crate::model::checkpoint::save(stage, opt, &stage_checkpoint(path, stage.index()), &info)?;
    }
    Ok(())
}

/// One step's figures, for progress display.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Steps done (1-based).
    pub step: u64,
    /// Steps planned.
    pub steps: u64,
    /// Mean training loss of this step's samples.
    pub loss: f32,
    /// Learning rate used.
    pub lr: f64,
    /// Tokens per second since the start.
    pub tokens_per_s: f64,
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct LocalReport {
    /// The step training started from (0, or the resumed checkpoints' step).
    pub first_step: u64,
    /// The step training ended at.
    pub steps: u64,
    /// Training loss of every step.
    pub losses: Vec<f32>,
    /// Mean loss on held-out batches after training.
    pub eval_loss: f64,
    /// The corpus's entropy rate (built-in corpus only).
    pub entropy_rate: Option<f64>,
    /// The best achievable mean loss at this sequence length (built-in corpus only).
    pub best_loss: Option<f64>,
    /// Tokens trained on per second.
    pub tokens_per_s: f64,
    /// Seconds of training.
    pub seconds: f64,
    /// f32 bytes that crossed stage boundaries.
    pub raw_bytes: u64,
    /// Frame bytes that crossed stage boundaries.
    pub wire_bytes: u64,
}

impl LocalReport {
    /// f32 bytes over frame bytes across stage boundaries (1 for a single stage).
    pub fn compression_ratio(&self) -> f64 {
        if self.wire_bytes == 0 {
            1.0
        } else {
            self.raw_bytes as f64 / self.wire_bytes as f64
        }
    }

    /// Mean training loss over the last `n` steps.
    pub fn tail_loss(&self, n: usize) -> f64 {
        let tail = &self.losses[self.losses.len().saturating_sub(n)..];
        tail.iter().map(|&l| l as f64).sum::<f64>() / tail.len().max(1) as f64
    }
}

/// Sends a tensor through encode → decode as a stage boundary would.
struct Boundary {
    spec: CodecSpec,
    frame: Vec<u8>,
    values: Vec<f32>,
    raw_bytes: u64,
    wire_bytes: u64,
}

impl Boundary {
    fn new(spec: CodecSpec) -> Self {
        Self {
            spec,
            frame: Vec::new(),
            values: Vec::new(),
            raw_bytes: 0,
            wire_bytes: 0,
        }
    }

    fn cross(&mut self, t: &Tensor) -> Result<Tensor, TrainError> {
        let shape = t.dims().to_vec();
        let data = t.flatten_all()?.to_vec1::<f32>()?;
        self.frame.clear();
        wire::encode_f32(&shape, &data, &self.spec, &mut self.frame)?;
        wire::decode_f32_into(&self.frame, &Limits::default(), &mut self.values)?;
        self.raw_bytes += 4 * data.len() as u64;
        self.wire_bytes += self.frame.len() as u64;
        Ok(Tensor::from_slice(&self.values, shape, t.device())?)
    }
}

fn batch_tensors(b: &Batch, device: &Device) -> Result<(Tensor, Tensor), TrainError> {
    let x = Tensor::from_slice(&b.inputs, (b.batch, b.seq_len), device)?;
    let y = Tensor::from_slice(&b.targets, (b.batch, b.seq_len), device)?;
    Ok((x, y))
}

fn forward_all(
    stages: &[Stage],
    x: Tensor,
    wire: &mut Boundary,
) -> Result<Vec<Tensor>, TrainError> {
    let mut acts = vec![x.clone()];
    let mut cur = x;
    for s in &stages[..stages.len() - 1] {
        cur = wire.cross(&s.forward(&cur)?)?;
        acts.push(cur.clone());
    }
    Ok(acts)
}

/// One microbatch through every stage and back: its mean loss, each stage's parameter
/// gradients (of the mean loss) and the bytes that crossed stage boundaries.
struct Microbatch {
    loss: f32,
    grads: Vec<Vec<Tensor>>,
    raw_bytes: u64,
    wire_bytes: u64,
}

/// A part of a microbatch through the whole pipeline on the calling thread: each stage's
/// forward keeps its graph and its backward runs through it (nothing is computed twice);
/// activations and their gradients cross every boundary through the codec, as on the wire.
fn pipeline(
    stages: &[Stage],
    x: &Tensor,
    y: &Tensor,
    spec: CodecSpec,
) -> Result<Microbatch, TrainError> {
    let mut wire = Boundary::new(spec);
    let last = stages.len() - 1;
    let mut kept = Vec::with_capacity(stages.len());
    let mut cur = x.clone();
    for (i, s) in stages.iter().enumerate() {
        let k = s.forward_kept(&cur)?;
        if i < last {
            cur = wire.cross(&k.output().detach())?;
        }
        kept.push(k);
    }
    let mut grads = vec![Vec::new(); stages.len()];
    let mut loss = 0.0;
    let mut grad: Option<Tensor> = None;
    for (i, k) in kept.into_iter().enumerate().rev() {
        let up = match &grad {
            None => Upstream::Targets(y),
            Some(g) => Upstream::Grad(g),
        };
        let out = stages[i].backward_kept(k, up)?;
        loss += out.loss.unwrap_or(0.0);
        grads[i] = out.grads;
        grad = match out.grad_input {
            Some(g) => Some(wire.cross(&g)?),
            None => None,
        };
    }
    Ok(Microbatch {
        loss,
        grads,
        raw_bytes: wire.raw_bytes,
        wire_bytes: wire.wire_bytes,
    })
}

/// A microbatch cut into `shards` parts along the batch, each through the whole pipeline on
/// its own thread (CPU only; elsewhere, or for one part, on this thread). Each part's loss is
/// its mean, so the parts' losses and gradients are weighted by their share of the batch:
/// the sums are the whole microbatch's up to float rounding. Staging costs no extra compute
/// and no serialization beyond the codec's own rounding.
fn microbatch(
    stages: &[Stage],
    x: &Tensor,
    y: &Tensor,
    spec: CodecSpec,
    shards: usize,
) -> Result<Microbatch, TrainError> {
    let batch = x.dims().first().copied().unwrap_or(0);
    let shards = shards.min(batch);
    if shards <= 1 || !x.device().is_cpu() {
        return pipeline(stages, x, y, spec);
    }
    let parts: Vec<(usize, usize)> = (0..shards)
        .map(|k| {
            (
                k * batch / shards,
                (k + 1) * batch / shards - k * batch / shards,
            )
        })
        .collect();
    let run = |(at, n): (usize, usize)| -> Result<Microbatch, TrainError> {
        pipeline(stages, &x.narrow(0, at, n)?, &y.narrow(0, at, n)?, spec)
    };
    let outs: Vec<Result<Microbatch, TrainError>> = std::thread::scope(|s| {
        let handles: Vec<_> = parts[1..]
            .iter()
            .map(|&p| s.spawn(move || run(p)))
            .collect();
        let mut outs = vec![run(parts[0])];
        for h in handles {
            outs.push(h.join().unwrap_or_else(|_| {
                Err(ModelError::BadInput("a microbatch thread panicked".into()).into())
            }));
        }
        outs
    });
    let mut total = Microbatch {
        loss: 0.0,
        grads: vec![Vec::new(); stages.len()],
        raw_bytes: 0,
        wire_bytes: 0,
    };
    for (out, &(_, n)) in outs.into_iter().zip(&parts) {
        let out = out?;
        let w = n as f64 / batch as f64;
        total.loss += w as f32 * out.loss;
        total.raw_bytes += out.raw_bytes;
        total.wire_bytes += out.wire_bytes;
        for (acc, g) in total.grads.iter_mut().zip(&out.grads) {
            if acc.is_empty() {
                *acc = g
                    .iter()
                    .map(|t| t.affine(w, 0.0))
                    .collect::<candle_core::Result<_>>()?;
            } else {
                for (a, t) in acc.iter_mut().zip(g) {
                    *a = (&*a + t.affine(w, 0.0)?)?;
                }
            }
        }
    }
    Ok(total)
}

/// Mean loss over `n` held-out batches.
pub fn evaluate(
    cfg: &RunConfig,
    stages: &[Stage],
    source: &TokenSource,
    n: usize,
) -> Result<f64, TrainError> {
    let mut sampler = Sampler::eval(cfg.training.data_seed);
    let source = source.eval_source();
    let mut wire = Boundary::new(cfg.codecs.activations.wire());
    let device = stages[0].device().clone();
    let mut total = 0.0;
    for _ in 0..n {
        let b = sampler.next_batch(source, cfg.training.batch_size, cfg.model.seq_len);
        let (x, y) = batch_tensors(&b, &device)?;
        let acts = forward_all(stages, x, &mut wire)?;
        let last = stages.len() - 1;
        total += stages[last].loss(&acts[last], &y)?.to_scalar::<f32>()? as f64;
    }
    Ok(total / n.max(1) as f64)
}

/// Trains every stage of `cfg` in this process; calls `progress` after each step.
pub fn train_local(
    cfg: &RunConfig,
    opts: &LocalOptions,
    progress: &mut dyn FnMut(&Progress),
) -> Result<LocalReport, TrainError> {
    let source = TokenSource::open(cfg)?;
    let stages = build_stages(cfg, &opts.device)?;
    let steps = opts.steps.unwrap_or(cfg.training.steps);
    let total_steps = cfg.training.steps.max(steps);
    let mut opts_per_stage = stages
        .iter()
        .map(|s| AdamW::new(&cfg.optimizer, total_steps, s.params()))
        .collect::<Result<Vec<_>, _>>()?;
    let mut sampler = Sampler::new(cfg.training.data_seed, 0);
    let mut wire = Boundary::new(cfg.codecs.activations.wire());
    let (batch, seq) = (cfg.training.batch_size, cfg.model.seq_len);
    let micro_per_step = cfg.target_batch_size().div_ceil(batch);
    let run =
        crate::dht::Manifest::from_config(cfg).map_err(|e| ModelError::BadInput(e.to_string()))?;
    let mut first = 0;
    if let Some(path) = &opts.resume {
        let mut at = Vec::new();
        for (stage, opt) in stages.iter().zip(&mut opts_per_stage) {
            let file = stage_checkpoint(path, stage.index());
            at.push(crate::model::checkpoint::load(stage, opt, &file, &run.id)?.step);
        }
        first = at[0];
        if at.iter().any(|&s| s != first) {
            return Err(ModelError::Checkpoint(format!(
                "the stage checkpoints of {} are at different steps {at:?}",
                path.display()
            ))
            .into());
        }
        // The same data stream as an uninterrupted run.
        for _ in 0..first * micro_per_step as u64 {
            sampler.next_batch(&source, batch, seq);
        }
    }
    let start = Instant::now();
    let mut saved = Instant::now();
    let mut losses = Vec::with_capacity(steps as usize);
    let mut tokens = 0u64;
    for step in first..steps {
        let mut acc: Vec<Option<Vec<Tensor>>> = vec![None; stages.len()];
        let mut loss_sum = 0.0f32;
        for _ in 0..micro_per_step {
            let b = sampler.next_batch(&source, batch, seq);
            let (x, y) = batch_tensors(&b, &opts.device)?;
            let mb = microbatch(&stages, &x, &y, cfg.codecs.activations.wire(), opts.threads)?;
            loss_sum += mb.loss;
            wire.raw_bytes += mb.raw_bytes;
            wire.wire_bytes += mb.wire_bytes;
            for (slot, grads) in acc.iter_mut().zip(mb.grads) {
                *slot = Some(match slot.take() {
                    None => grads,
                    Some(prev) => prev
                        .iter()
                        .zip(&grads)
                        .map(|(a, b)| a + b)
                        .collect::<candle_core::Result<Vec<_>>>()?,
                });
            }
            tokens += (batch * seq) as u64;
        }
        let loss = loss_sum / micro_per_step as f32;
        if !loss.is_finite() {
            return Err(TrainError::Diverged { step, loss });
        }
        let mut lr = 0.0;
        for ((stage, opt), grads) in stages.iter().zip(&mut opts_per_stage).zip(acc) {
            let mut grads = grads.unwrap_or_default();
            if micro_per_step > 1 {
                let k = 1.0 / micro_per_step as f64;
                grads = grads
                    .iter()
                    .map(|g| g.affine(k, 0.0))
                    .collect::<candle_core::Result<_>>()?;
            }
            lr = opt.step(stage.params(), &grads)?.lr;
        }
        losses.push(loss);
        if let (Some(path), Some(every)) = (&opts.checkpoint, opts.checkpoint_every) {
            if saved.elapsed() >= every {
                save_all(
                    path,
                    &stages,
                    &opts_per_stage,
                    &run,
                    (step + 1) * (micro_per_step * batch) as u64,
                )?;
                saved = Instant::now();
            }
        }
        progress(&Progress {
            step: step + 1,
            steps,
            loss,
            lr,
            tokens_per_s: tokens as f64 / start.elapsed().as_secs_f64().max(1e-9),
        });
    }
    let seconds = start.elapsed().as_secs_f64();
    if let Some(path) = &opts.checkpoint {
        save_all(
            path,
            &stages,
            &opts_per_stage,
            &run,
            steps * (micro_per_step * batch) as u64,
        )?;
    }
    let eval_loss = evaluate(cfg, &stages, &source, opts.eval_batches)?;
    Ok(LocalReport {
        first_step: first,
        steps,
        losses,
        eval_loss,
        entropy_rate: source.entropy_rate(),
        best_loss: source.best_loss(seq),
        tokens_per_s: tokens as f64 / seconds.max(1e-9),
        seconds,
        raw_bytes: wire.raw_bytes,
        wire_bytes: wire.wire_bytes,
    })
}
