//! `shoal demo`: a whole swarm on this machine, as separate processes of this binary.
//!
//! A bootstrap peer (DHT only), `replicas` peers for each of `stages` stages and `trainers`
//! trainer processes train `configs/tiny.toml` on the built-in corpus over 127.0.0.1.
//! With churn on, one replica of the middle stage is SIGKILLed at 40% of the steps and a
//! fresh peer with `--stage auto` is started: it joins the weakest stage and downloads its
//! state. The demo prints live progress, then evaluates the swarm's model on held-out
//! batches and compares replica parameter hashes.

use super::{
    client, peer_args, replica_hashes, spawn_bootstrap, stop_all, trainer_args, HarnessError, Proc,
};
use crate::progress::Bar;
use shoal::config::RunConfig;
use shoal::data::TokenSource;
use shoal::dht::Manifest;
use shoal::stage::{probe, registry};
use shoal::swarm::events::Event;
use shoal::trainer::report::Progress;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Steps the demo trains by default.
pub const DEMO_STEPS: u64 = 400;

/// Samples per optimizer step in the demo (two microbatches of 16).
pub const DEMO_TARGET_BATCH: usize = 32;

/// Knobs of the demo.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    /// The `shoal` binary to start.
    pub exe: PathBuf,
    /// Pipeline stages.
    pub stages: usize,
    /// Replicas per stage.
    pub replicas: usize,
    /// Trainer processes.
    pub trainers: usize,
    /// Optimizer steps.
    pub steps: u64,
    /// Kill a replica midway and start a fresh peer.
    pub churn: bool,
}

/// What the demo measured.
#[derive(Debug, Clone)]
pub struct DemoReport {
    /// Wall seconds of training (from the first trainer start to the last trainer exit).
    pub seconds: f64,
    /// The trainers' totals at the end.
    pub progress: Progress,
    /// Held-out loss of the swarm's model.
    pub eval_loss: f64,
    /// The corpus entropy rate, when known.
    pub entropy: Option<f64>,
    /// The run's target loss.
    pub target: Option<f64>,
    /// Per stage: (peer, step, hash) of every live replica.
    pub hashes: Vec<Vec<(String, u64, String)>>,
    /// Whether every stage's replicas agree on step and hash.
    pub identical: bool,
    /// Seconds from the demo's launch (before the bootstrap peer starts) until a trainer
    /// saw the first step applied; `None` if none was.
    pub first_step_s: Option<f64>,
}

/// The run the demo trains.
pub fn demo_config(stages: usize, steps: u64) -> RunConfig {
    let mut cfg = RunConfig::tiny();
    cfg.stages.count = stages;
    cfg.stages.cuts.clear();
    cfg.training.steps = steps;
    cfg.training.target_batch_size = Some(DEMO_TARGET_BATCH);
    cfg.optimizer.warmup_steps = 15;
    cfg
}

/// Runs the demo; `out` receives every line to print.
pub async fn run(cfg: &DemoConfig, bar: &Bar) -> Result<DemoReport, HarnessError> {
    let dir = std::env::temp_dir().join(format!("shoal-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| HarnessError::Process(e.to_string()))?;
    let result = run_in(cfg, &dir, bar).await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn run_in(cfg: &DemoConfig, dir: &Path, bar: &Bar) -> Result<DemoReport, HarnessError> {
    let out = |line: String| bar.println(&line);
    let launched = Instant::now();
    let run_cfg = demo_config(cfg.stages, cfg.steps);
    let m = Manifest::from_config(&run_cfg).map_err(|e| HarnessError::Process(e.to_string()))?;
    let manifest_path = dir.join("run.toml");
    std::fs::write(&manifest_path, m.file_text())
        .map_err(|e| HarnessError::Process(e.to_string()))?;
    let exe = &cfg.exe;
    out(format!(
        "run {}: {} stages x {} replicas, {} trainers, {} steps of {} samples, activations {}, gradients {}",
        m.id,
        cfg.stages,
        cfg.replicas,
        cfg.trainers,
        cfg.steps,
        run_cfg.target_batch_size(),
        run_cfg.codecs.activations.wire(),
        run_cfg.codecs.gradients
    ));
    let (mut boot, baddr) = spawn_bootstrap(exe, dir)?;
    out(format!("bootstrap peer {baddr}"));
    let mut peers: Vec<(usize, Proc)> = Vec::new();
    for s in 0..cfg.stages {
        for r in 0..cfg.replicas {
            let name = format!("stage{s}-replica{r}");
            let args = peer_args(&m.id, Some(&baddr), &s.to_string(), &format!("{name}.key"));
            peers.push((s, Proc::spawn(exe, dir, &name, &args)?));
        }
    }
    for (_, p) in peers.iter_mut() {
        p.wait_ready(Duration::from_secs(60))?;
    }
    out(format!("{} stage peers ready", peers.len()));
    let net = client(&baddr).await?;
    let started = Instant::now();
    let mut trainers = Vec::new();
    for t in 0..cfg.trainers {
        let args = trainer_args(&m.id, &baddr, t);
        trainers.push(Proc::spawn(exe, dir, &format!("trainer{t}"), &args)?);
    }
    let mut last: Vec<Progress> = vec![Progress::default(); cfg.trainers];
    let mut churned = !cfg.churn;
    let mut joiner: Option<Proc> = None;
    let (mut next_tick, mut next_count) = (Instant::now(), Instant::now());
    let mut counts: Vec<String> = Vec::new();
    let mut first_step_s = None;
    loop {
        latest_progress(&mut trainers, &mut last);
        let step = last.iter().map(|p| p.step).max().unwrap_or(0);
        if step >= 1 && first_step_s.is_none() {
            let s = launched.elapsed().as_secs_f64();
            first_step_s = Some(s);
            out(format!("first step applied {s:.1} s after launch"));
        }
        if !churned && step >= cfg.steps * 2 / 5 {
            churned = true;
            let mid = cfg.stages / 2;
            if let Some(pos) = peers.iter().position(|(s, _)| *s == mid) {
                let (_, mut victim) = peers.remove(pos);
                victim.kill();
                out(format!("churn: SIGKILLed {} at step {step}", victim.name));
                let args = peer_args(&m.id, Some(&baddr), "auto", "joiner.key");
                let mut j = Proc::spawn(exe, dir, "joiner", &args)?;
                let synced = j.wait_for("its state download", Duration::from_secs(30), |e| {
                    matches!(e, Event::Synced { .. }).then(|| e.clone())
                });
                if let Ok(e) = synced {
                    out(format!("churn: a fresh peer joined: {e}"));
                }
                joiner = Some(j);
            }
        }
        if Instant::now() >= next_tick {
            next_tick = Instant::now() + Duration::from_secs(1);
            let total = Progress::sum(&last);
            let secs = started.elapsed().as_secs_f64();
            if Instant::now() >= next_count {
                next_count = Instant::now() + Duration::from_secs(5);
                let per_stage = registry::read_run(&net, &m.id, m.config.stages.count)
                    .await
                    .unwrap_or_default();
                counts = per_stage.iter().map(|v| v.len().to_string()).collect();
            }
            bar.set(total.step, || {
                format!(
                    "[{secs:>4.0}s] loss {}  samples/s {:>6.1}  wire {:.1} MB (x{} smaller than f32)  peers per stage [{}]",
                    crate::progress::loss_text(total.completed, total.loss),
                    total.completed as f64 / secs.max(1e-9),
                    total.wire as f64 / 1e6,
                    if total.wire == 0 {
                        "-".to_string()
                    } else {
                        format!("{:.2}", total.raw as f64 / total.wire as f64)
                    },
                    counts.join(" ")
                )
            });
        }
        if trainers.iter_mut().all(Proc::exited) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    latest_progress(&mut trainers, &mut last);
    bar.clear();
    let seconds = started.elapsed().as_secs_f64();
    // Let the last rounds settle before comparing replicas.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let eval_loss = probe::evaluate(&net, &m, 8)
        .await
        .map_err(|e| HarnessError::Swarm(e.to_string()))?;
    let (hashes, identical) = replica_hashes(&net, &m).await?;
    let entropy = TokenSource::open(&run_cfg)
        .ok()
        .and_then(|s| s.entropy_rate());
    stop_all(
        peers.iter_mut().map(|(_, p)| p).chain(joiner.as_mut()),
        Duration::from_secs(8),
    );
    boot.stop();
    net.shutdown().await;
    Ok(DemoReport {
        seconds,
        progress: Progress::sum(&last),
        eval_loss,
        entropy,
        target: run_cfg.training.target_loss,
        hashes,
        identical,
        first_step_s,
    })
}

/// Takes each trainer's latest totals from the events it reported since the last call.
pub(super) fn latest_progress(trainers: &mut [Proc], last: &mut [Progress]) {
    for (t, l) in trainers.iter_mut().zip(last.iter_mut()) {
        for e in t.drain() {
            match e {
                Event::Progress { progress, .. } | Event::Done { progress } => *l = progress,
                _ => {}
            }
        }
    }
}
