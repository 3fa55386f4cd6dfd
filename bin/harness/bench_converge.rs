//! `shoal bench converge`: the wall time to a target loss, per way of stepping.
//!
//! Each mode trains the same run (real candle stages of the tiny config, 2 stages × 2
//! replicas, 2 trainer processes, every process behind an emulated link) on the same
//! samples: each trainer feeds the same microbatches of its own data stream, then stops.
//! A step holds at least the run's 32 samples and more when microbatches arrive while its
//! round forms, so modes end at different steps; the learning rate is held constant after
//! warm-up so that this does not favour one mode's schedule. The modes:
//! - `synchronous`: after each microbatch a trainer waits until stage 0 applied the step it
//!   went into (the exact mode);
//! - `delayed`: trainers never wait; a replica keeps computing gradients for step s+1 while
//!   step s is averaged and applied, and a backward whose kept forward would make its
//!   gradient two steps stale recomputes it, so every gradient is at most one step stale
//!   (forwards run at the parameters predicted for the expected lag);
//! - `no-sync`: trainers never wait and kept forwards are used however old (gradients may
//!   be several steps stale; what shoal did before delayed updates);
//! - `delayed-plain` (only when asked): `delayed` without weight prediction, every
//!   gradient computed at the parameters as they are;
//! - `outer[:H[:DENSITY[:LR[:MOMENTUM[:CODEC[:DECAY]]]]]]` (only when asked): synchronous
//!   steps with `averaging.mode = "outer"`: each replica steps on its own samples, and
//!   every H steps (default 16) the replicas average their pseudo-gradients, the largest
//!   DENSITY of each chunk (default 0.1, 1 = whole) in CODEC (default int4+zstd1) with
//!   error feedback decayed by DECAY (default 0.95), and take an outer step at LR with
//!   Nesterov MOMENTUM (defaults 1 and 0 when sparse, 0.7 and 0.9 when whole). Its run
//!   ends at step 0.98 × samples ÷ target batch, an outer step (every step from the run's
//!   last on is one), where the trainers stop: the replicas end identical, having trained
//!   about the samples of the other modes (a step holds a little over the target batch).
//!
//! Per mode: samples/s, the swarm's held-out loss after the last step (the demo's
//! evaluation, on the same batches for every mode), and the seconds from the trainers'
//! start until their recent training loss (each trainer's last 8 microbatches, averaged
//! over trainers) first reached the target. `train --local` on the same run is the
//! reference row.

use super::bench_swarm::in_scratch_dir;
use super::demo::demo_config;
use super::{
    client, peer_args, replica_hashes, spawn_bootstrap, stop_all, trainer_args, HarnessError, Proc,
};
use shoal::config::RunConfig;
use shoal::dht::Manifest;
use shoal::net::link::LinkSpec;
use shoal::stage::probe;
use shoal::trainer::report::Progress;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Ways of stepping, in the order they run by default.
pub const MODES: [&str; 3] = ["synchronous", "no-sync", "delayed"];

/// Also known, run when asked: delayed updates without weight prediction.
pub const PLAIN_DELAYED: &str = "delayed-plain";

/// Stages, replicas per stage and trainer processes of every mode.
const STAGES: usize = 2;
const REPLICAS: usize = 2;
const TRAINERS: usize = 2;

/// Held-out batches of the final evaluation (the demo's).
const EVAL_BATCHES: usize = 8;

/// Steps of the local reference whose mean loss is compared with the target: 4 steps of
/// 32 samples, the 128 samples of one trainer's last 8 microbatches.
const LOCAL_WINDOW: usize = 4;

/// Knobs of the benchmark.
#[derive(Debug, Clone)]
pub struct ConvergeOptions {
    /// The `shoal` binary to start.
    pub exe: PathBuf,
    /// Samples every mode trains (rounded to whole microbatches of every trainer).
    pub samples: u64,
    /// The modes to run (names from [`MODES`]).
    pub modes: Vec<String>,
    /// Microbatches each trainer keeps in flight.
    pub concurrency: usize,
    /// Every process's emulated link.
    pub link: LinkSpec,
    /// Also run `train --local` on the same run.
    pub local: bool,
    /// Longest a mode may take before the benchmark gives up on it.
    pub timeout: Duration,
    /// Samples a step holds at least (the run's target batch).
    pub target_batch: usize,
}

/// One mode's figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ConvergeRow {
    /// `synchronous`, `no-sync`, `delayed` or `local`.
    pub mode: String,
    /// Optimizer steps applied.
    pub steps: u64,
    /// Samples the trainers completed.
    pub samples: u64,
    /// Wall seconds from the trainers' start to the last one's exit.
    pub seconds: f64,
    /// Samples completed per second.
    pub samples_per_s: f64,
    /// Held-out loss after the last step.
    pub eval_loss: f64,
    /// Seconds until the recent training loss first reached the target (`None`: never).
    pub seconds_to_target: Option<f64>,
    /// Whether every stage's replicas ended at one step and one parameter hash.
    pub identical: bool,
    /// The same, under the name the low-communication check reads.
    pub replicas_identical: bool,
    /// Bytes the replicas sent for averaging (parts and reduced parts, every replica)
    /// per sample completed.
    pub averaging_bytes_per_sample: f64,
    /// The training curve: (seconds, samples completed, recent training loss), about one
    /// point a second.
    pub curve: Vec<(f64, u64, f64)>,
}

impl ConvergeRow {
    /// The table's header.
    pub const HEADER: &'static str =
        "mode           steps  samples  seconds  samples/s  eval loss  to target (s)  replicas";

    /// One line of the table.
    pub fn line(&self) -> String {
        format!(
            "{:<13} {:>6} {:>8} {:>8.1} {:>10.1} {:>10.4} {:>14} {:>9}",
            self.mode,
            self.steps,
            self.samples,
            self.seconds,
            self.samples_per_s,
            self.eval_loss,
            self.seconds_to_target
                .map_or("never".to_string(), |s| format!("{s:.1}")),
            if self.mode == "local" {
                "-"
            } else if self.identical {
                "identical"
            } else {
                "DIFFER"
            }
        )
    }
}

/// The run every mode trains: the demo's (tiny model, at least 32 samples a step) in 2
/// stages, at a constant learning rate after warm-up, with room for as many steps as
/// `samples` could make.
pub fn converge_config(samples: u64, target_batch: usize) -> RunConfig {
    let mut cfg = demo_config(STAGES, 1);
    cfg.training.target_batch_size = Some(target_batch);
    cfg.training.steps = samples.div_ceil(cfg.target_batch_size() as u64).max(1);
    cfg.optimizer.min_lr_ratio = 1.0;
    cfg
}

/// Microbatches each trainer feeds for `samples` samples in all.
pub fn microbatches(cfg: &RunConfig, samples: u64) -> u64 {
    samples
        .div_ceil((TRAINERS * cfg.training.batch_size) as u64)
        .max(1)
}

/// The target loss of [`converge_config`].
fn target(cfg: &RunConfig) -> Result<f64, HarnessError> {
    cfg.training
        .target_loss
        .ok_or_else(|| HarnessError::Process("the tiny run has no target loss".into()))
}

/// Runs one swarm mode of [`converge_config`].
pub async fn run_mode(mode: &str, opts: &ConvergeOptions) -> Result<ConvergeRow, HarnessError> {
    let cfg = converge_config(opts.samples, opts.target_batch);
    let target = target(&cfg)?;
    run_swarm(mode, &cfg, Some(target), opts, &format!("converge-{mode}")).await
}

/// Runs one swarm mode of `cfg` (2 stages × 2 replicas, 2 trainers feeding `opts.samples`
/// samples), timing when the trainers' recent loss first reaches `target`.
pub async fn run_swarm(
    mode: &str,
    cfg: &RunConfig,
    target: Option<f64>,
    opts: &ConvergeOptions,
    label: &str,
) -> Result<ConvergeRow, HarnessError> {
    let dir = in_scratch_dir(label)?;
    let r = run_in(mode, cfg, target.unwrap_or(f64::NEG_INFINITY), opts, &dir).await;
    super::bench_swarm::leave_scratch(&dir);
    r
}

async fn run_in(
    mode: &str,
    cfg: &RunConfig,
    target: f64,
    opts: &ConvergeOptions,
    dir: &std::path::Path,
) -> Result<ConvergeRow, HarnessError> {
    let err = |e: &dyn std::fmt::Display| HarnessError::Process(e.to_string());
    let (cfg, feed, wait, bounded) = mode_run(mode, cfg, opts).map_err(|e| err(&e))?;
    let cfg = &cfg;
    let m = Manifest::from_config(cfg).map_err(|e| err(&e))?;
    std::fs::write(dir.join("run.toml"), m.file_text()).map_err(|e| err(&e))?;
    let exe = &opts.exe;
    let link = super::scenarios::link_arg(&opts.link);
    let (mut boot, baddr) = spawn_bootstrap(exe, dir)?;
    let mut peers = Vec::new();
    for s in 0..STAGES {
        for r in 0..REPLICAS {
            let name = format!("stage{s}-replica{r}");
            let mut a = peer_args(&m.id, Some(&baddr), &s.to_string(), &format!("{name}.key"));
            a.extend(
                [
                    "--rebalance-every",
                    "0",
                    "--emulate-link",
                    &link,
                    "--counters-ms",
                    "500",
                ]
                .map(String::from),
            );
            if !bounded {
                a.push("--unbounded-staleness".into());
            }
            if mode == PLAIN_DELAYED {
                a.push("--no-weight-prediction".into());
            }
            peers.push(Proc::spawn(exe, dir, &name, &a)?);
        }
    }
    for p in peers.iter_mut() {
        p.wait_ready(Duration::from_secs(60))?;
    }
    let net = client(&baddr).await?;
    let started = Instant::now();
    let mut trainers = Vec::new();
    for t in 0..TRAINERS {
        let mut a = trainer_args(&m.id, &baddr, t);
        a.extend(
            [
                "--concurrency",
                &opts.concurrency.to_string(),
                "--report-ms",
                "250",
                "--microbatches",
                &feed.to_string(),
                "--emulate-link",
                &link,
            ]
            .map(String::from),
        );
        if !wait {
            a.push("--no-sync-steps".into());
        }
        trainers.push(Proc::spawn(exe, dir, &format!("trainer{t}"), &a)?);
    }
    let Watched {
        last,
        to_target,
        curve,
    } = watch(mode, &mut trainers, started, target, opts).await?;
    let seconds = started.elapsed().as_secs_f64();
    let total = Progress::sum(&last);
    // Let the last round settle before evaluating and comparing replicas.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let eval_loss = probe::evaluate(&net, &m, EVAL_BATCHES)
        .await
        .map_err(|e| HarnessError::Swarm(e.to_string()))?;
    let (hashes, identical) = replica_hashes(&net, &m).await?;
    let averaging_bytes = averaging_bytes(&mut peers);
    let steps = hashes
        .iter()
        .flat_map(|v| v.iter().map(|h| h.1))
        .min()
        .unwrap_or(0);
    stop_all(peers.iter_mut(), Duration::from_secs(8));
    boot.stop();
    net.shutdown().await;
    Ok(ConvergeRow {
        mode: mode.to_string(),
        steps,
        samples: total.completed,
        seconds,
        samples_per_s: total.completed as f64 / seconds.max(1e-9),
        eval_loss,
        seconds_to_target: to_target,
        identical,
        replicas_identical: identical,
        averaging_bytes_per_sample: averaging_bytes as f64 / total.completed.max(1) as f64,
        curve,
    })
}

/// The run config, microbatches per trainer, and whether trainers wait for steps and
/// staleness is bounded, of `mode` on `cfg`.
fn mode_run(
    mode: &str,
    cfg: &RunConfig,
    opts: &ConvergeOptions,
) -> Result<(RunConfig, u64, bool, bool), String> {
    let (wait, bounded) = match mode {
        "synchronous" => (true, true),
        "delayed" | PLAIN_DELAYED => (false, true),
        "no-sync" => (false, false),
        _ if is_outer(mode) => (true, true),
        other => return Err(format!("unknown mode {other:?}")),
    };
    let mut cfg = cfg.clone();
    let mut feed = microbatches(&cfg, opts.samples);
    if is_outer(mode) {
        cfg.averaging = outer_averaging(mode)?;
        // The run's last step (an outer step) comes a little before the samples run out,
        // since a step holds at least the target batch: the trainers stop there with
        // about the samples the other modes train (the row says how many).
        cfg.training.steps = (cfg.training.steps * 49 / 50).max(1);
        feed += feed / 8 + 1;
    }
    Ok((cfg, feed, wait, bounded))
}

/// What the trainers reported until they all exited.
struct Watched {
    /// Each trainer's last progress.
    last: Vec<Progress>,
    /// Seconds until their recent loss first reached the target.
    to_target: Option<f64>,
    /// (seconds, samples completed, recent loss), about one point a second.
    curve: Vec<(f64, u64, f64)>,
}

/// Follows the trainers' progress until they all exit (or the mode's time runs out).
async fn watch(
    mode: &str,
    trainers: &mut [Proc],
    started: Instant,
    target: f64,
    opts: &ConvergeOptions,
) -> Result<Watched, HarnessError> {
    let mut last = vec![Progress::default(); TRAINERS];
    let mut to_target = None;
    let mut curve: Vec<(f64, u64, f64)> = Vec::new();
    let bar = crate::progress::Bar::new(opts.samples, "samples");
    while !trainers.iter_mut().all(Proc::exited) {
        if started.elapsed() > opts.timeout {
            return Err(HarnessError::Process(format!(
                "{mode}: not done after {:.0} s (raise --timeout or lower --samples)",
                opts.timeout.as_secs_f64()
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        super::demo::latest_progress(trainers, &mut last);
        // Every trainer must have reported a loss: one trainer's alone is half the data.
        let losses: Vec<f64> = last.iter().map(|p| p.loss).collect();
        let reported = last.iter().all(|p| p.completed > 0);
        if to_target.is_none() && reported && losses.iter().all(|l| l.is_finite()) {
            let mean = losses.iter().sum::<f64>() / losses.len() as f64;
            if mean <= target {
                to_target = Some(started.elapsed().as_secs_f64());
            }
        }
        let p = Progress::sum(&last);
        let t = started.elapsed().as_secs_f64();
        if reported && curve.last().is_none_or(|c| t - c.0 >= 1.0) {
            let mean = losses.iter().sum::<f64>() / losses.len() as f64;
            curve.push((t, p.completed, mean));
        }
        bar.set(p.completed, || {
            format!(
                "[{:>4.0}s] {mode}: step {:>4}  loss {}",
                started.elapsed().as_secs_f64(),
                p.step,
                crate::progress::loss_text(p.completed, p.loss)
            )
        });
    }
    bar.clear();
    super::demo::latest_progress(trainers, &mut last);
    Ok(Watched {
        last,
        to_target,
        curve,
    })
}

/// Whether `mode` names outer averaging (`outer`, `outer:H`, `outer:H:DENSITY`, ...).
pub fn is_outer(mode: &str) -> bool {
    mode == "outer" || mode.starts_with("outer:")
}

/// The `[averaging]` table of an outer mode's name.
pub fn outer_averaging(mode: &str) -> Result<shoal::config::AveragingConfig, String> {
    let mut a = shoal::config::AveragingConfig {
        mode: Some(shoal::config::AveragingMode::Outer),
        ..Default::default()
    };
    let bad =
        || format!("mode {mode:?}: expected outer[:H[:DENSITY[:LR[:MOMENTUM[:CODEC[:DECAY]]]]]]");
    let mut parts = mode.split(':').skip(1);
    a.outer_every = field(parts.next(), &bad)?;
    a.outer_density = field(parts.next(), &bad)?;
    a.outer_lr = field(parts.next(), &bad)?;
    a.outer_momentum = field(parts.next(), &bad)?;
    a.outer_codec = field(parts.next(), &bad)?;
    a.outer_error_decay = field(parts.next(), &bad)?;
    if parts.next().is_some() {
        return Err(bad());
    }
    Ok(a)
}

/// A field of an outer mode's name, if present.
fn field<T: std::str::FromStr>(
    part: Option<&str>,
    bad: &dyn Fn() -> String,
) -> Result<Option<T>, String> {
    part.map(|p| p.parse().map_err(|_| bad())).transpose()
}

/// The part and reduced-part bytes every replica reported sending, summed (each
/// replica's latest counters).
fn averaging_bytes(peers: &mut [Proc]) -> u64 {
    let mut latest = std::collections::HashMap::new();
    for p in peers.iter_mut() {
        for e in p.drain() {
            if let shoal::swarm::events::Event::Counters {
                averaging: Some(a), ..
            } = e
            {
                latest.insert(p.name.clone(), a.bytes_sent);
            }
        }
    }
    latest.values().sum()
}

/// The reference: `train --local` on the same run, in this process.
pub fn run_local(opts: &ConvergeOptions) -> Result<ConvergeRow, HarnessError> {
    let cfg = converge_config(opts.samples, opts.target_batch);
    let target = target(&cfg)?;
    let started = Instant::now();
    let mut recent = std::collections::VecDeque::new();
    let mut to_target = None;
    let mut curve: Vec<(f64, u64, f64)> = Vec::new();
    let batch = cfg.target_batch_size() as u64;
    let mut done = 0u64;
    let lo = shoal::train::LocalOptions {
        steps: Some(cfg.training.steps),
        eval_batches: EVAL_BATCHES,
        ..Default::default()
    };
    let report = shoal::train::train_local(&cfg, &lo, &mut |p| {
        recent.push_back(p.loss as f64);
        if recent.len() > LOCAL_WINDOW {
            recent.pop_front();
        }
        let mean = recent.iter().sum::<f64>() / recent.len() as f64;
        let t = started.elapsed().as_secs_f64();
        if to_target.is_none() && recent.len() == LOCAL_WINDOW && mean <= target {
            to_target = Some(t);
        }
        done += batch;
        if curve.last().is_none_or(|c| t - c.0 >= 1.0) {
            curve.push((t, done, mean));
        }
    })
    .map_err(|e| HarnessError::Process(format!("train --local: {e}")))?;
    let samples = report.steps.saturating_sub(report.first_step) * cfg.target_batch_size() as u64;
    Ok(ConvergeRow {
        mode: "local".into(),
        steps: report.steps,
        samples,
        seconds: report.seconds,
        samples_per_s: samples as f64 / report.seconds.max(1e-9),
        eval_loss: report.eval_loss,
        seconds_to_target: to_target,
        identical: true,
        replicas_identical: true,
        averaging_bytes_per_sample: 0.0,
        curve,
    })
}
