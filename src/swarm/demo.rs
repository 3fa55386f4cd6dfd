//! `shoal demo`: a whole swarm on this machine, as separate processes of this binary.
//!
//! A bootstrap peer (DHT only), `replicas` peers for each of `stages` stages and `trainers`
//! trainer processes train `configs/tiny.toml` on the built-in corpus over 127.0.0.1.
//! With churn on, one replica of the middle stage is SIGKILLed at 40% of the steps and a
//! fresh peer with `--stage auto` is started: it joins the weakest stage and downloads its
//! state. The demo prints live progress, then evaluates the swarm's model on held-out
//! batches and compares replica parameter hashes.

use crate::config::RunConfig;
use crate::data::TokenSource;
use crate::dht::{Announcement, Manifest};
use crate::net::{self, NetConfig, NetHandle};
use crate::stage::{probe, registry};
use crate::trainer::report::Progress;
use libp2p::Multiaddr;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
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
}

/// Why the demo could not run.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// A process could not be started or failed.
    #[error("{0}")]
    Process(String),
    /// The swarm could not be read.
    #[error("{0}")]
    Swarm(String),
}

/// A child process of this binary, its stdout read line by line.
pub(crate) struct Proc {
    pub(crate) name: String,
    pub(crate) child: Child,
    pub(crate) lines: mpsc::Receiver<String>,
}

impl Proc {
    pub(crate) fn spawn(
        exe: &Path,
        dir: &Path,
        name: &str,
        args: &[String],
    ) -> Result<Self, DemoError> {
        let mut child = Command::new(exe)
            .args(args)
            .current_dir(dir)
            .env("RAYON_NUM_THREADS", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(match std::env::var_os("SHOAL_DEMO_LOGS") {
                Some(d) => std::fs::File::create(Path::new(&d).join(format!("{name}.err")))
                    .map(Stdio::from)
                    .unwrap_or_else(|_| Stdio::null()),
                None => Stdio::null(),
            })
            .spawn()
            .map_err(|e| DemoError::Process(format!("cannot start {}: {e}", exe.display())))?;
        let (tx, rx) = mpsc::channel();
        if let Some(out) = child.stdout.take() {
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        Ok(Self {
            name: name.to_string(),
            child,
            lines: rx,
        })
    }

    pub(crate) fn wait_line(
        &mut self,
        needle: &str,
        timeout: Duration,
    ) -> Result<String, DemoError> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            match self.lines.recv_timeout(Duration::from_millis(100)) {
                Ok(l) if l.contains(needle) => return Ok(l),
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Ok(Some(st)) = self.child.try_wait() {
                        return Err(DemoError::Process(format!("{} exited ({st})", self.name)));
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(DemoError::Process(format!(
                        "{} closed its output",
                        self.name
                    )))
                }
            }
        }
        Err(DemoError::Process(format!(
            "{} did not print {needle:?} within {timeout:?}",
            self.name
        )))
    }

    pub(crate) fn stop(&mut self) {
        self.stop_within(Duration::from_secs(3));
    }

    /// Sends SIGTERM (Unix) without waiting.
    pub(crate) fn terminate(&mut self) {
        #[cfg(unix)]
        {
            let _ = Command::new("kill")
                .arg(self.child.id().to_string())
                .status();
        }
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`.
    pub(crate) fn stop_within(&mut self, grace: Duration) {
        #[cfg(unix)]
        {
            // SIGTERM first: a peer withdraws its announcements and exits cleanly.
            self.terminate();
            let deadline = Instant::now() + grace;
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Starts the bootstrap peer (DHT only) of the run in `dir/run.toml`; returns it and the
/// address it listens on.
pub(crate) fn spawn_bootstrap(exe: &Path, dir: &Path) -> Result<(Proc, String), DemoError> {
    let mut boot = Proc::spawn(
        exe,
        dir,
        "bootstrap",
        &peer_args("run.toml", None, "none", "boot.key"),
    )?;
    let line = boot.wait_line("listening on /ip4/127.0.0.1/tcp/", Duration::from_secs(20))?;
    let addr = line.trim_start_matches("listening on ").to_string();
    Ok((boot, addr))
}

/// Stops processes all at once: SIGTERM to every one (each drains and writes its state),
/// then waits for each, SIGKILLing any still running after `grace`.
pub(crate) fn stop_all<'a>(procs: impl IntoIterator<Item = &'a mut Proc>, grace: Duration) {
    let mut procs: Vec<&mut Proc> = procs.into_iter().collect();
    for p in procs.iter_mut() {
        p.terminate();
    }
    for p in procs {
        p.stop_within(grace);
    }
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

pub(crate) fn peer_args(run: &str, boot: Option<&str>, stage: &str, key: &str) -> Vec<String> {
    let mut a: Vec<String> = [
        "peer",
        "--run",
        run,
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--identity",
        key,
        "--stage",
        stage,
        "--trainers",
        "0",
        "--announce-ttl",
        "6",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if let Some(b) = boot {
        a.push("--bootstrap".into());
        a.push(b.to_string());
    }
    a
}

async fn swarm_hashes(net: &NetHandle, m: &Manifest) -> Result<Vec<Vec<Announcement>>, DemoError> {
    registry::read_run(net, &m.id, m.config.stages.count)
        .await
        .map_err(|e| DemoError::Swarm(e.to_string()))
}

/// Runs the demo; `out` receives every line to print.
pub async fn run(cfg: &DemoConfig, out: &(dyn Fn(String) + Sync)) -> Result<DemoReport, DemoError> {
    let dir = std::env::temp_dir().join(format!("shoal-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| DemoError::Process(e.to_string()))?;
    let result = run_in(cfg, &dir, out).await;
    let _ = std::fs::remove_dir_all(&dir);
    result
}

async fn run_in(
    cfg: &DemoConfig,
    dir: &Path,
    out: &(dyn Fn(String) + Sync),
) -> Result<DemoReport, DemoError> {
    let run_cfg = demo_config(cfg.stages, cfg.steps);
    let m = Manifest::from_config(&run_cfg).map_err(|e| DemoError::Process(e.to_string()))?;
    let manifest_path = dir.join("run.toml");
    std::fs::write(&manifest_path, m.file_text()).map_err(|e| DemoError::Process(e.to_string()))?;
    let exe = &cfg.exe;
    out(format!(
        "run {}: {} stages x {} replicas, {} trainers, {} steps of {} samples, activations {}, gradients {}",
        m.id,
        cfg.stages,
        cfg.replicas,
        cfg.trainers,
        cfg.steps,
        run_cfg.target_batch_size(),
        run_cfg.codecs.activations,
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
        p.wait_line("ready", Duration::from_secs(60))?;
    }
    out(format!("{} stage peers ready", peers.len()));
    let mut client_cfg = NetConfig::new(libp2p::identity::Keypair::generate_ed25519(), Vec::new());
    client_cfg.dht_server = false;
    let net = net::start(client_cfg).map_err(|e| DemoError::Swarm(e.to_string()))?;
    let baddr_m: Multiaddr = baddr
        .parse()
        .map_err(|e| DemoError::Swarm(format!("{e}")))?;
    net.dial(baddr_m)
        .await
        .map_err(|e| DemoError::Swarm(e.to_string()))?;
    let started = Instant::now();
    let mut trainers = Vec::new();
    for t in 0..cfg.trainers {
        let args: Vec<String> = [
            "train",
            "--run",
            &m.id,
            "--bootstrap",
            &baddr,
            "--trainers",
            "1",
            "--data-index",
            &(t as u64 * 1000).to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        trainers.push(Proc::spawn(exe, dir, &format!("trainer{t}"), &args)?);
    }
    let mut last: Vec<Progress> = vec![Progress::default(); cfg.trainers];
    let mut churned = !cfg.churn;
    let mut joiner: Option<Proc> = None;
    let mut next_print = Instant::now();
    loop {
        for (i, t) in trainers.iter_mut().enumerate() {
            while let Ok(l) = t.lines.try_recv() {
                if let Some(p) = Progress::parse(&l) {
                    last[i] = p;
                }
            }
        }
        let step = last.iter().map(|p| p.step).max().unwrap_or(0);
        if !churned && step >= cfg.steps * 2 / 5 {
            churned = true;
            let mid = cfg.stages / 2;
            if let Some(pos) = peers.iter().position(|(s, _)| *s == mid) {
                let (_, mut victim) = peers.remove(pos);
                let _ = victim.child.kill();
                let _ = victim.child.wait();
                out(format!("churn: SIGKILLed {} at step {step}", victim.name));
                let args = peer_args(&m.id, Some(&baddr), "auto", "joiner.key");
                let mut j = Proc::spawn(exe, dir, "joiner", &args)?;
                // Report what the joiner did once it is ready (non-blocking below).
                if let Ok(l) = j.wait_line("synced stage", Duration::from_secs(30)) {
                    out(format!("churn: a fresh peer joined: {l}"));
                }
                joiner = Some(j);
            }
        }
        if Instant::now() >= next_print {
            next_print = Instant::now() + Duration::from_secs(5);
            let total = sum(&last);
            let secs = started.elapsed().as_secs_f64();
            let per_stage = swarm_hashes(&net, &m).await.unwrap_or_default();
            let counts: Vec<String> = per_stage.iter().map(|v| v.len().to_string()).collect();
            out(format!(
                "[{secs:>5.0}s] step {:>4}/{}  loss {:.4}  samples/s {:>6.1}  wire {:.1} MB (x{:.2} smaller than f32)  peers per stage [{}]",
                total.step,
                cfg.steps,
                total.loss,
                total.completed as f64 / secs.max(1e-9),
                total.wire as f64 / 1e6,
                total.raw as f64 / (total.wire.max(1)) as f64,
                counts.join(" ")
            ));
        }
        let all_done = trainers
            .iter_mut()
            .all(|t| matches!(t.child.try_wait(), Ok(Some(_))));
        if all_done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for (i, t) in trainers.iter_mut().enumerate() {
        while let Ok(l) = t.lines.try_recv() {
            if let Some(p) = Progress::parse(&l) {
                last[i] = p;
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    // Let the last rounds settle before comparing replicas.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let eval_loss = probe::evaluate(&net, &m, 8)
        .await
        .map_err(|e| DemoError::Swarm(e.to_string()))?;
    let per_stage = swarm_hashes(&net, &m).await?;
    let hashes: Vec<Vec<(String, u64, String)>> = per_stage
        .iter()
        .map(|v| {
            v.iter()
                .map(|a| (a.peer.clone(), a.step, a.params_hash.clone()))
                .collect()
        })
        .collect();
    let identical = hashes
        .iter()
        .all(|v| v.windows(2).all(|w| w[0].1 == w[1].1 && w[0].2 == w[1].2));
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
        progress: sum(&last),
        eval_loss,
        entropy,
        target: run_cfg.training.target_loss,
        hashes,
        identical,
    })
}

pub(crate) fn sum(ps: &[Progress]) -> Progress {
    let losses: Vec<f64> = ps
        .iter()
        .map(|p| p.loss)
        .filter(|l| l.is_finite())
        .collect();
    Progress {
        step: ps.iter().map(|p| p.step).max().unwrap_or(0),
        loss: if losses.is_empty() {
            f64::NAN
        } else {
            losses.iter().sum::<f64>() / losses.len() as f64
        },
        fed: ps.iter().map(|p| p.fed).sum(),
        completed: ps.iter().map(|p| p.completed).sum(),
        failed: ps.iter().map(|p| p.failed).sum(),
        swaps: ps.iter().map(|p| p.swaps).sum(),
        wire: ps.iter().map(|p| p.wire).sum(),
        raw: ps.iter().map(|p| p.raw).sum(),
    }
}
