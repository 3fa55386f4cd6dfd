//! `shoal peer`: join the swarm, find or publish the run, pick a stage, serve and announce.
//!
//! Start-up order: listen and print the full addresses (so others can bootstrap from this
//! peer even while it is still starting), dial the bootstrap peers, get the manifest (from
//! the file, then publish it; or from the DHT by id, checked against its hash), choose the
//! stage, build it with the deterministic init, measure its throughput, start serving, then
//! announce and keep re-announcing at a third of the announcement's lifetime.
//!
//! Rebalancing: every `rebalance` period (randomised ±50%) a serving peer reads the live
//! swarm and asks [`select::rebalance`] whether moving to the weakest stage would even the
//! stages out; it confirms after a short random pause, then leaves its stage gracefully
//! (no new forward passes, in-flight backward passes finished, its accumulated gradients
//! averaged) and joins the target stage like a new peer, syncing its state from the
//! replicas there.

use crate::averaging::sync::{self, SyncError, SyncReport};
use crate::averaging::{Averager, AveragerConfig, AvgStats};
use crate::config::StageKind;
use crate::dht::{self, Announcement, Manifest, ManifestError};
use crate::model::{ModelError, Stage};
use crate::net::{self, NetConfig, NetError, NetHandle};
use crate::rng::Rng;
use crate::stage::client::StageClient;
use crate::stage::registry::{self, RegistryError};
use crate::stage::replica::Replica;
use crate::stage::select;
use crate::stage::service::{measure_throughput, ServiceConfig, StageService};
use crate::stage::sim::SimCompute;
use crate::trainer::{Trainer, TrainerConfig, TrainerError};
use candle_core::Device;
use libp2p::{Multiaddr, PeerId};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Receives one line per notable event: start-up steps, migrations.
pub type Logger = Arc<dyn Fn(String) + Send + Sync>;

/// Where the run comes from.
#[derive(Debug, Clone)]
pub enum RunSource {
    /// A manifest (or config) file; the peer publishes it.
    File(PathBuf),
    /// A run id; the manifest is fetched from the DHT.
    Id(String),
}

impl RunSource {
    /// `--run` as given: a run id, or else a path.
    pub fn parse(s: &str) -> Self {
        if dht::is_run_id(s) && !std::path::Path::new(s).exists() {
            Self::Id(s.to_string())
        } else {
            Self::File(PathBuf::from(s))
        }
    }
}

/// Which stage to serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageChoice {
    /// The weakest stage of the swarm.
    Auto,
    /// This one.
    Index(usize),
    /// None: a DHT and bootstrap node (and trainers, if any) only.
    None,
}

/// Everything `shoal peer` needs.
#[derive(Clone)]
pub struct PeerConfig {
    /// The run.
    pub run: RunSource,
    /// Network settings.
    pub net: NetConfig,
    /// Peers to join through.
    pub bootstrap: Vec<Multiaddr>,
    /// Stage to serve.
    pub stage: StageChoice,
    /// Compute device.
    pub device: Device,
    /// Its name, as announced.
    pub device_name: String,
    /// Lifetime of announcements (refreshed at a third of it).
    pub announce_ttl: Duration,
    /// The stage service's knobs.
    pub service: ServiceConfig,
    /// Time spent measuring throughput at start-up.
    pub bench_budget: Duration,
    /// Trainer loops to run beside the stage.
    pub trainers: usize,
    /// Their knobs (`index` is derived per loop).
    pub trainer: TrainerConfig,
    /// Where to write the stage's checkpoint on stop.
    pub checkpoint: Option<PathBuf>,
    /// Samples/s to announce instead of measuring the stage at start-up.
    pub throughput: Option<f64>,
    /// Mean time between rebalancing checks (each randomised ±50%); `None`: never move.
    pub rebalance: Option<Duration>,
    /// How long a leaving replica waits for its in-flight work and accumulated gradients.
    pub drain_timeout: Duration,
    /// Serve a `sim` run (the benchmark stand-in stage).
    pub allow_sim: bool,
    /// A `sim` stage's time per sample is multiplied by this (benchmarks of uneven swarms).
    pub sim_slowdown: f64,
    /// Forward graphs the replica keeps for their backward (see [`Replica::with_kept_cap`]).
    pub kept_forwards: usize,
}

impl PeerConfig {
    /// Defaults: serve `stage` of `run`, joining through `bootstrap`.
    pub fn new(
        run: RunSource,
        net: NetConfig,
        bootstrap: Vec<Multiaddr>,
        stage: StageChoice,
    ) -> Self {
        Self {
            run,
            net,
            bootstrap,
            stage,
            device: Device::Cpu,
            device_name: "cpu".into(),
            announce_ttl: Duration::from_secs(30),
            service: ServiceConfig::default(),
            bench_budget: Duration::from_millis(800),
            trainers: 0,
            trainer: TrainerConfig::default(),
            checkpoint: None,
            throughput: None,
            rebalance: None,
            drain_timeout: Duration::from_secs(10),
            allow_sim: false,
            sim_slowdown: 1.0,
            kept_forwards: crate::stage::replica::KEPT_CAP,
        }
    }
}

/// Why a peer could not start.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// Network trouble.
    #[error(transparent)]
    Net(#[from] NetError),
    /// The run manifest is bad.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// The run could not be found.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// The stage could not be built.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// No bootstrap peer answered.
    #[error("cannot reach any bootstrap peer ({0}); check the address, and pass the swarm's --swarm-key if it is private")]
    Bootstrap(String),
    /// The stage's state could not be downloaded.
    #[error("cannot download the stage's state: {0}")]
    Sync(#[from] SyncError),
    /// A trainer could not start.
    #[error(transparent)]
    Trainer(#[from] TrainerError),
    /// A bad argument.
    #[error("{0}")]
    Invalid(String),
}

/// What a peer has while it serves a stage.
struct Serving {
    service: Arc<StageService>,
    averager: Averager,
    refresher: tokio::task::JoinHandle<()>,
    samples_per_s: f64,
    synced: Option<SyncReport>,
}

/// The stage being served, shared with the rebalancer (empty while migrating).
type Slot = Arc<Mutex<Option<Serving>>>;

fn slot_lock(slot: &Slot) -> std::sync::MutexGuard<'_, Option<Serving>> {
    slot.lock().unwrap_or_else(|p| p.into_inner())
}

/// What serving and migrating need, shared by the peer and its rebalancer.
struct Ctx {
    net: NetHandle,
    manifest: Manifest,
    cfg: PeerConfig,
    last: Arc<Mutex<Option<Announcement>>>,
    log: Logger,
    /// The final status of every stage this peer left (migrations and stop).
    departed: Mutex<Vec<(usize, crate::stage::service::ReplicaStatus)>>,
}

/// A serving peer.
pub struct Peer {
    ctx: Arc<Ctx>,
    addrs: Vec<Multiaddr>,
    slot: Slot,
    /// Held for the whole of a migration, so that stopping waits for one to finish.
    moving: Arc<tokio::sync::Mutex<()>>,
    rebalancer: Option<tokio::task::JoinHandle<()>>,
    moves: Arc<AtomicU64>,
    trainers: Vec<Trainer>,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("peer", &self.ctx.net.local_peer_id())
            .field("stage", &self.stage())
            .finish()
    }
}

/// Dials every bootstrap address; succeeds if at least one answers.
pub async fn join(net: &NetHandle, bootstrap: &[Multiaddr]) -> Result<(), PeerError> {
    if bootstrap.is_empty() {
        return Ok(());
    }
    let dials = futures::future::join_all(bootstrap.iter().map(|a| {
        let net = net.clone();
        let a = a.clone();
        async move {
            match tokio::time::timeout(Duration::from_secs(15), net.dial(a.clone())).await {
                Ok(r) => r.map_err(|e| e.to_string()),
                Err(_) => Err(format!("{a}: no answer in 15 s")),
            }
        }
    }))
    .await;
    let errors: Vec<String> = dials.iter().filter_map(|r| r.clone().err()).collect();
    if errors.len() == dials.len() {
        return Err(PeerError::Bootstrap(errors.join("; ")));
    }
    net.bootstrap().await?;
    Ok(())
}

impl Peer {
    /// Starts a peer; `log` receives one line per start-up event (and per migration).
    pub async fn start(
        cfg: PeerConfig,
        log: impl Fn(String) + Send + Sync + 'static,
    ) -> Result<Self, PeerError> {
        let log: Logger = Arc::new(log);
        if let Some(t) = cfg.throughput {
            if !t.is_finite() || t <= 0.0 {
                return Err(PeerError::Invalid(format!(
                    "the throughput must be a positive number of samples/s, not {t}"
                )));
            }
        }
        // Read the manifest file first: a typo should not cost a network start.
        let from_file = match &cfg.run {
            RunSource::File(p) => Some(Manifest::load(p)?),
            RunSource::Id(_) => None,
        };
        let n_listen = cfg.net.listen.len();
        let net = net::start(cfg.net.clone())?;
        let addrs = net
            .wait_listening(n_listen, Duration::from_secs(10))
            .await?;
        if addrs.is_empty() && n_listen > 0 {
            return Err(PeerError::Invalid(
                "the peer is not listening on any address; check --listen".into(),
            ));
        }
        for a in &addrs {
            log(format!("listening on {a}"));
        }
        join(&net, &cfg.bootstrap).await?;
        let manifest = match (from_file, &cfg.run) {
            (Some(m), _) => m,
            (None, RunSource::Id(id)) => {
                registry::fetch_manifest(&net, id, Duration::from_secs(10)).await?
            }
            (None, RunSource::File(p)) => Manifest::load(p)?,
        };
        registry::publish_manifest(&net, &manifest, cfg.announce_ttl).await?;
        log(format!("run {}", manifest.id));
        if manifest.config.stages.kind == StageKind::Sim
            && cfg.stage != StageChoice::None
            && !cfg.allow_sim
        {
            return Err(PeerError::Invalid(format!(
                "run {} uses the `sim` stand-in stage, which is for benchmarks only; pass --allow-sim to serve it",
                manifest.id
            )));
        }
        let count = manifest.config.stages.count;
        let ctx = Arc::new(Ctx {
            net: net.clone(),
            manifest: manifest.clone(),
            cfg: cfg.clone(),
            last: Arc::new(Mutex::new(None)),
            log,
            departed: Mutex::new(Vec::new()),
        });
        let per_stage = match cfg.stage {
            StageChoice::None => Vec::new(),
            _ => ctx.live().await?,
        };
        let stage_idx = match cfg.stage {
            StageChoice::Index(i) if i < count => Some(i),
            StageChoice::Index(i) => {
                return Err(PeerError::Invalid(format!(
                    "--stage {i} is out of range: run {} has stages 0..{}",
                    manifest.id,
                    count - 1
                )))
            }
            StageChoice::Auto => {
                let anns: Vec<Announcement> = per_stage.iter().flatten().cloned().collect();
                Some(select::weakest(&select::loads(count, &anns)).unwrap_or(0))
            }
            StageChoice::None => None,
        };
        let mut peer = Self {
            ctx: Arc::clone(&ctx),
            addrs,
            slot: Arc::new(Mutex::new(None)),
            moving: Arc::new(tokio::sync::Mutex::new(())),
            rebalancer: None,
            moves: Arc::new(AtomicU64::new(0)),
            trainers: Vec::new(),
        };
        if let Some(stage_idx) = stage_idx {
            let donors = peers_of(&per_stage[stage_idx]);
            let serving = ctx.serve(stage_idx, &donors).await?;
            *slot_lock(&peer.slot) = Some(serving);
            if let Some(period) = cfg.rebalance {
                let seed = crate::rng::derive_seed(
                    crate::dht::now_ms(),
                    &format!("{}/rebalance", net.local_peer_id()),
                );
                peer.rebalancer = Some(tokio::spawn(rebalance_loop(
                    Arc::clone(&ctx),
                    Arc::clone(&peer.slot),
                    Arc::clone(&peer.moving),
                    Arc::clone(&peer.moves),
                    period,
                    seed,
                )));
            }
        }
        let me = net.local_peer_id().to_string();
        for i in 0..cfg.trainers {
            let mut tcfg = cfg.trainer.clone();
            tcfg.index = crate::rng::derive_seed(cfg.trainer.index, &format!("{me}/{i}"));
            peer.trainers
                .push(Trainer::spawn(net.clone(), &manifest, tcfg)?);
        }
        if cfg.trainers > 0 {
            (ctx.log)(format!("running {} trainer loop(s)", cfg.trainers));
        }
        Ok(peer)
    }

    /// The trainer loops.
    pub fn trainers(&self) -> &[Trainer] {
        &self.trainers
    }

    /// The averager's counters, when serving.
    pub fn avg_stats(&self) -> Option<Arc<AvgStats>> {
        slot_lock(&self.slot)
            .as_ref()
            .map(|s| Arc::clone(s.averager.stats()))
    }

    /// How the state of the stage served now was downloaded, if it was.
    pub fn synced(&self) -> Option<SyncReport> {
        slot_lock(&self.slot)
            .as_ref()
            .and_then(|s| s.synced.clone())
    }

    /// The network handle.
    pub fn net(&self) -> &NetHandle {
        &self.ctx.net
    }

    /// The full addresses printed at start.
    pub fn addrs(&self) -> &[Multiaddr] {
        &self.addrs
    }

    /// The run.
    pub fn manifest(&self) -> &Manifest {
        &self.ctx.manifest
    }

    /// The stage served, if any (none for a moment while migrating).
    pub fn stage(&self) -> Option<usize> {
        slot_lock(&self.slot).as_ref().map(|s| s.service.stage())
    }

    /// The stage service, if serving.
    pub fn service(&self) -> Option<Arc<StageService>> {
        slot_lock(&self.slot)
            .as_ref()
            .map(|s| Arc::clone(&s.service))
    }

    /// The final status of every stage replica this peer left by migrating: their
    /// accounting (samples dropped on a state download, samples still held) leaves the
    /// stage with them.
    pub fn departed(&self) -> Vec<(usize, crate::stage::service::ReplicaStatus)> {
        self.ctx
            .departed
            .lock()
            .map(|d| d.clone())
            .unwrap_or_default()
    }

    /// Migrations done by rebalancing.
    pub fn moves(&self) -> u64 {
        self.moves.load(Ordering::Relaxed)
    }

    /// Stops gracefully: trainers finish their microbatches; the stage withdraws its
    /// announcements, refuses new forward passes, finishes the queued work and waits (up
    /// to `drain_timeout`) for its accumulated gradients to be averaged; then the
    /// checkpoint is written atomically.
    pub async fn stop(mut self) -> Result<(), PeerError> {
        for t in std::mem::take(&mut self.trainers) {
            t.stop().await;
        }
        let _moving = self.moving.lock().await;
        if let Some(r) = self.rebalancer.take() {
            r.abort();
        }
        let serving = slot_lock(&self.slot).take();
        let mut result = Ok(());
        if let Some(serving) = serving {
            let service = self.ctx.leave(serving).await;
            if let Some(path) = &self.ctx.cfg.checkpoint {
                let replica = service.replica();
                let path = path.clone();
                let r = tokio::task::spawn_blocking(move || replica.blocking_lock().save(&path))
                    .await
                    .map_err(|e| PeerError::Invalid(format!("checkpoint task failed: {e}")));
                result = match r {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(e.into()),
                    Err(e) => Err(e),
                };
            }
        }
        self.ctx.net.shutdown().await;
        result
    }

    /// Stops at once without withdrawing anything: what a crash looks like to the swarm.
    pub async fn kill(mut self) {
        if let Some(r) = self.rebalancer.take() {
            r.abort();
        }
        if let Some(s) = slot_lock(&self.slot).take() {
            s.refresher.abort();
        }
        self.ctx.net.shutdown().await;
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Some(r) = self.rebalancer.take() {
            r.abort();
        }
        if let Some(s) = slot_lock(&self.slot).take() {
            s.refresher.abort();
        }
    }
}

fn peers_of(anns: &[Announcement]) -> Vec<PeerId> {
    anns.iter().filter_map(|a| a.peer.parse().ok()).collect()
}

impl Ctx {
    /// The live replicas of every stage: announcements whose peer answers `info` for that
    /// stage (a dead peer's announcement lives on until it expires, and a leaving one
    /// refuses `info`). This peer's own announcement counts without a call.
    async fn live(&self) -> Result<Vec<Vec<Announcement>>, PeerError> {
        let count = self.manifest.config.stages.count;
        let per_stage = registry::read_run(&self.net, &self.manifest.id, count).await?;
        let me = self.net.local_peer_id().to_string();
        let client = StageClient::new(
            self.net.clone(),
            self.manifest.id.clone(),
            self.manifest.config.codecs.activations,
        )
        .with_timeout(Duration::from_secs(2));
        let checks = futures::future::join_all(
            per_stage
                .into_iter()
                .flatten()
                .filter(|a| a.peer != me)
                .map(|a| {
                    let client = client.clone();
                    async move {
                        let peer: PeerId = a.peer.parse().ok()?;
                        let addrs: Vec<Multiaddr> =
                            a.addrs.iter().filter_map(|x| x.parse().ok()).collect();
                        client.net().add_addresses(peer, addrs).await.ok()?;
                        // A burst of calls can drop a stream; a live replica answers a retry.
                        for attempt in 0..3u64 {
                            if client.info(peer, a.stage as usize).await.is_ok() {
                                return Some(a);
                            }
                            tokio::time::sleep(Duration::from_millis(60 * (attempt + 1))).await;
                        }
                        None
                    }
                }),
        )
        .await;
        let mut out: Vec<Vec<Announcement>> = vec![Vec::new(); count];
        let mine = self.last.lock().ok().and_then(|g| g.clone());
        for a in checks.into_iter().flatten().chain(mine) {
            if let Some(v) = out.get_mut(a.stage as usize) {
                v.push(a);
            }
        }
        Ok(out)
    }

    /// Builds, syncs (from `donors`, if any), serves and announces stage `stage_idx`.
    async fn serve(&self, stage_idx: usize, donors: &[PeerId]) -> Result<Serving, PeerError> {
        let cfg = &self.cfg;
        let manifest = &self.manifest;
        let count = manifest.config.stages.count;
        let stage = Stage::new(&manifest.config, stage_idx, &cfg.device)?;
        let m = &manifest.config.model;
        let sim = SimCompute::of(&manifest.config, cfg.sim_slowdown);
        let samples_per_s = match (cfg.throughput, &sim) {
            (Some(t), _) => t,
            (None, Some(sim)) => sim.samples_per_s(),
            (None, None) => measure_throughput(
                &stage,
                manifest.config.training.batch_size,
                m.seq_len,
                m.d_model,
                2,
                cfg.bench_budget,
            )?,
        };
        let mut replica = Replica::new(&manifest.config, stage)?
            .with_sim(sim)
            .with_kept_cap(cfg.kept_forwards);
        let client = StageClient::new(
            self.net.clone(),
            manifest.id.clone(),
            manifest.config.codecs.activations,
        );
        let mut synced = None;
        if !donors.is_empty() {
            // A stage that already has replicas: start from their state, not the init.
            let mut rng = Rng::new(crate::rng::derive_seed(
                crate::dht::now_ms(),
                &self.net.local_peer_id().to_string(),
            ));
            let len = replica.snapshot_len();
            let (snap, report) = sync::download(&client, stage_idx, donors, len, &mut rng).await?;
            replica.restore(&snap)?;
            (self.log)(format!(
                "synced stage {stage_idx} at step {} from {} donor(s), chunks {:?}",
                snap.step,
                report.donors.len(),
                report.chunks_per_donor
            ));
            synced = Some(report);
        }
        let replica = Arc::new(tokio::sync::Mutex::new(replica));
        let service = Arc::new(StageService::start(
            &self.net,
            manifest,
            replica,
            cfg.service.clone(),
        )?);
        let avg_cfg = self.avg_config();
        let seed =
            crate::rng::derive_seed(crate::dht::now_ms(), &self.net.local_peer_id().to_string());
        let averager = Averager::spawn(client, Arc::clone(&service), avg_cfg, seed);
        (self.log)(format!(
            "serving stage {stage_idx} of {count} on {}: {samples_per_s:.1} samples/s",
            cfg.device_name
        ));
        let refresh = Refresh {
            net: self.net.clone(),
            service: Arc::clone(&service),
            manifest: manifest.clone(),
            device: cfg.device_name.clone(),
            samples_per_s,
            ttl: cfg.announce_ttl,
            last: Arc::clone(&self.last),
        };
        refresh.once().await?;
        Ok(Serving {
            service,
            averager,
            refresher: tokio::spawn(refresh.run()),
            samples_per_s,
            synced,
        })
    }

    fn avg_config(&self) -> AveragerConfig {
        AveragerConfig::new(
            self.manifest.config.target_batch_size() as u64,
            self.manifest.config.codecs.gradients,
        )
    }

    /// Leaves a stage gracefully and returns its service (closed) for a checkpoint.
    async fn leave(&self, serving: Serving) -> Arc<StageService> {
        serving.refresher.abort();
        let last = self.last.lock().ok().and_then(|mut g| g.take());
        if let Some(a) = last {
            let _ = registry::withdraw(&self.net, &a).await;
        }
        let service = Arc::clone(&serving.service);
        service.drain();
        let deadline = Instant::now() + self.cfg.drain_timeout;
        let settled = |service: &StageService| {
            let st = service.status();
            (service.queue_len(), st.accum_count + st.frozen_count)
        };
        let mut warned = false;
        // Rounds need the rest of the stage: when its step stands still for 3 s (training
        // has stopped), what is pending here will not be averaged; stop waiting for it.
        let mut step = (service.step(), Instant::now());
        let mut wait_settled = async |what: &str| loop {
            let (queued, pending) = settled(&service);
            if queued == 0 && pending == 0 {
                return;
            }
            if service.step() != step.0 {
                step = (service.step(), Instant::now());
            }
            let stalled = queued == 0 && step.1.elapsed() >= Duration::from_secs(3);
            if Instant::now() >= deadline || stalled {
                if !warned {
                    (self.log)(format!(
                        "leaving stage {} {what} with {queued} request(s) queued and {pending} sample(s) not yet averaged",
                        service.stage()
                    ));
                    warned = true;
                }
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        wait_settled("").await;
        // Let the averager tell the stage that nothing is pending here any more, so the
        // others do not count this replica's last reported samples as lost.
        tokio::time::sleep(self.avg_config().heartbeat * 2).await;
        service.close().await;
        // A call that raced the drain may have queued a job: let it finish.
        wait_settled("after closing").await;
        // Then the others forget this replica at once rather than when its progress goes
        // stale (so no round waits on it), and count what it still holds as lost.
        serving.averager.leave();
        tokio::time::sleep(Duration::from_millis(200)).await;
        if let Ok(mut d) = self.departed.lock() {
            d.push((service.stage(), service.status()));
        }
        drop(serving.averager);
        service
    }

    /// Where this peer should move from `mine`, judged on the live swarm.
    async fn target(&self, mine: usize, my_tp: f64) -> Option<(usize, Vec<Vec<Announcement>>)> {
        let live = self.live().await.ok()?;
        let anns: Vec<Announcement> = live.iter().flatten().cloned().collect();
        let loads = select::loads(self.manifest.config.stages.count, &anns);
        let tps: Vec<f64> = anns.iter().map(|a| a.samples_per_s).collect();
        select::rebalance(&loads, &tps, mine, my_tp, select::BALANCE_QUALITY).map(|t| (t, live))
    }
}

/// Checks now and then whether to move to the weakest stage, and moves.
async fn rebalance_loop(
    ctx: Arc<Ctx>,
    slot: Slot,
    moving: Arc<tokio::sync::Mutex<()>>,
    moves: Arc<AtomicU64>,
    period: Duration,
    seed: u64,
) {
    let mut rng = Rng::new(seed);
    let me = ctx.net.local_peer_id().to_string();
    loop {
        tokio::time::sleep(period.mul_f64(0.5 + rng.next_f64())).await;
        let current = slot_lock(&slot)
            .as_ref()
            .map(|s| (s.service.stage(), s.samples_per_s));
        let Some((mine, tp)) = current else {
            continue;
        };
        if ctx.target(mine, tp).await.is_none() {
            continue;
        }
        // Confirm after a random pause, so peers that decided together see each other move.
        tokio::time::sleep(period.mul_f64(0.25 * rng.next_f64())).await;
        let Some((target, live)) = ctx.target(mine, tp).await else {
            continue;
        };
        let _guard = moving.lock().await;
        let Some(serving) = slot_lock(&slot).take() else {
            continue;
        };
        (ctx.log)(format!(
            "rebalancing: moving from stage {mine} to the weakest stage {target}"
        ));
        ctx.leave(serving).await;
        let others = |s: usize| -> Vec<PeerId> {
            let anns: Vec<Announcement> =
                live[s].iter().filter(|a| a.peer != me).cloned().collect();
            peers_of(&anns)
        };
        let serving = match ctx.serve(target, &others(target)).await {
            Ok(s) => {
                moves.fetch_add(1, Ordering::Relaxed);
                Some(s)
            }
            Err(e) => {
                (ctx.log)(format!(
                    "cannot serve stage {target} ({e}); going back to stage {mine}"
                ));
                match ctx.serve(mine, &others(mine)).await {
                    Ok(s) => Some(s),
                    Err(e) => {
                        (ctx.log)(format!(
                            "cannot serve stage {mine} again: {e}; serving nothing"
                        ));
                        None
                    }
                }
            }
        };
        *slot_lock(&slot) = serving;
    }
}

struct Refresh {
    net: NetHandle,
    service: Arc<StageService>,
    manifest: Manifest,
    device: String,
    samples_per_s: f64,
    ttl: Duration,
    last: Arc<Mutex<Option<Announcement>>>,
}

impl Refresh {
    async fn once(&self) -> Result<(), NetError> {
        let addrs = self.net.listen_addrs().await?;
        let now = dht::now_ms();
        let ann = Announcement {
            v: dht::record::ANN_VERSION,
            run: self.manifest.id.clone(),
            peer: self.net.local_peer_id().to_string(),
            addrs: addrs
                .iter()
                .take(dht::record::MAX_ADDRS)
                .map(|a| a.to_string())
                .collect(),
            stage: self.service.stage() as u32,
            stages: self.manifest.config.stages.count as u32,
            step: self.service.step(),
            samples_per_s: self.samples_per_s,
            device: self.device.clone(),
            queue: self.service.queue_len(),
            queue_cap: self.service.queue_cap(),
            params_hash: self.service.params_hash().to_string(),
            issued_ms: now,
            expires_ms: now + self.ttl.as_millis() as u64,
        };
        self.service
            .set_info(String::from_utf8_lossy(&ann.to_bytes()).into_owned());
        registry::announce(&self.net, &ann, self.ttl).await?;
        if let Ok(mut g) = self.last.lock() {
            *g = Some(ann);
        }
        Ok(())
    }

    async fn run(self) {
        let period = (self.ttl / 3).max(Duration::from_millis(200));
        loop {
            tokio::time::sleep(period).await;
            let _ = registry::publish_manifest(&self.net, &self.manifest, self.ttl).await;
            let _ = self.once().await;
        }
    }
}
