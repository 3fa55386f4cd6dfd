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

use super::events::{Event, Observer};
pub use super::join::{join, BOOTSTRAP_PATIENCE, REJOIN_EVERY};
use super::join::{rejoin_loop, take_up_run};
use super::rebalance::rebalance_loop;
use super::serving::{Ctx, Slot};
use crate::averaging::sync::{SyncError, SyncReport};
use crate::averaging::AvgStats;
use crate::config::StageKind;
use crate::dht::{self, Manifest, ManifestError};
use crate::model::ModelError;
use crate::net::{self, NetConfig, NetError, NetHandle};
use crate::stage::registry::RegistryError;
use crate::stage::select;
use crate::stage::service::{ReplicaStatus, ServiceConfig, StageService};
use crate::tasks::Tasks;
use crate::trainer::{Trainer, TrainerConfig, TrainerError};
use candle_core::Device;
use libp2p::Multiaddr;
use parking_lot::Mutex;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Lifetime of the manifest's DHT record: a run's manifest never changes (its id is its
/// hash), so it lives long and is republished seldom. With the announcements' 30 s, every
/// peer republished it every 10 s: in a swarm of 200, 20 stores a second at the same 20
/// peers (those closest to its key), whose answers to everything else then ran late.
pub const MANIFEST_TTL: Duration = Duration::from_secs(5 * 60);

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
    /// Where to write the stage's checkpoint on stop (and every `checkpoint_every`).
    pub checkpoint: Option<PathBuf>,
    /// Checkpoint this often while serving, besides on stop.
    pub checkpoint_every: Option<Duration>,
    /// Start the stage from this checkpoint (unless replicas ahead of it are live).
    pub resume: Option<PathBuf>,
    /// Samples/s to announce instead of measuring the stage at start-up.
    pub throughput: Option<f64>,
    /// Mean time between rebalancing checks (each randomised ±50%); `None`: never move.
    pub rebalance: Option<Duration>,
    /// How long a leaving replica waits for its in-flight work and accumulated gradients.
    pub drain_timeout: Duration,
    /// Serve a `sim` run (the benchmark stand-in stage).
    pub allow_sim: bool,
    /// How often the peer re-dials bootstrap peers it is not connected to (and refreshes
    /// the DHT through them when one answers).
    pub rejoin_every: Duration,
    /// A `sim` stage's time per sample is multiplied by this (benchmarks of uneven swarms).
    pub sim_slowdown: f64,
    /// Forward graphs the replica keeps for their backward (see [`Replica::with_kept_cap`]).
    pub kept_forwards: usize,
    /// Recompute a kept forward older than the last update (gradients at most one step
    /// stale); off only in benchmarks ([`crate::stage::replica::Replica::with_staleness_bound`]).
    pub bound_staleness: bool,
    /// Compute gradients that will be applied after further updates at the parameters
    /// predicted for them ([`crate::stage::predict`]); off only in benchmarks.
    pub weight_prediction: bool,
    /// Makes this peer's replica send corrupted gradient parts: tests of robust
    /// aggregation only (no command-line flag sets it).
    #[doc(hidden)]
    pub tamper: Option<crate::averaging::Tamper>,
}

impl PeerConfig {
    /// Lifetime of announcements by default (`--announce-ttl`).
    pub const ANNOUNCE_TTL: Duration = Duration::from_secs(30);
    /// Mean time between rebalancing checks of `shoal peer` (`--rebalance-every`). A
    /// config made by [`PeerConfig::new`] does not rebalance until `rebalance` is set.
    pub const REBALANCE_EVERY: Duration = Duration::from_secs(60);
    /// Trainer loops `shoal peer` runs beside its stage by default (`--trainers`). A
    /// config made by [`PeerConfig::new`] runs none.
    pub const CLI_TRAINERS: usize = 1;

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
            announce_ttl: Self::ANNOUNCE_TTL,
            service: ServiceConfig::default(),
            bench_budget: Duration::from_millis(800),
            trainers: 0,
            trainer: TrainerConfig::default(),
            checkpoint: None,
            checkpoint_every: None,
            resume: None,
            throughput: None,
            rebalance: None,
            drain_timeout: Duration::from_secs(10),
            allow_sim: false,
            rejoin_every: REJOIN_EVERY,
            sim_slowdown: 1.0,
            kept_forwards: crate::stage::replica::KEPT_CAP,
            bound_staleness: true,
            weight_prediction: true,
            tamper: None,
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

/// A serving peer.
pub struct Peer {
    ctx: Arc<Ctx>,
    addrs: Vec<Multiaddr>,
    slot: Slot,
    /// Held for the whole of a migration, so that stopping waits for one to finish.
    moving: Arc<tokio::sync::Mutex<()>>,
    /// The rebalancer, stopped before the stage is left.
    rebalancer: Tasks,
    /// The manifest republisher, the bootstrap re-dialler, the network events' forwarder:
    /// cancelled when the peer is dropped (also when it fails to start), with every group
    /// made from it.
    tasks: Tasks,
    _cancel: tokio_util::sync::DropGuard,
    moves: Arc<AtomicU64>,
    trainers: Vec<Trainer>,
    /// The trainers' own network node, beside a stage (see [`Peer::start`]).
    trainer_net: Option<NetHandle>,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("peer", &self.ctx.net.local_peer_id())
            .field("stage", &self.stage())
            .finish()
    }
}

impl Peer {
    /// Starts a peer; `observe` receives its start-up events (and its migrations).
    pub async fn start(
        cfg: PeerConfig,
        observe: impl Fn(Event) + Send + Sync + 'static,
    ) -> Result<Self, PeerError> {
        let emit: Observer = Arc::new(observe);
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
        let tasks = Tasks::new();
        let cancel = tasks.cancel_on_drop();
        super::events::forward_net_events(&net, Arc::clone(&emit), &tasks);
        let addrs = net
            .wait_listening(n_listen, Duration::from_secs(10))
            .await?;
        if addrs.is_empty() && n_listen > 0 {
            return Err(PeerError::Invalid(
                "the peer is not listening on any address; check --listen".into(),
            ));
        }
        for a in &addrs {
            emit(Event::Listening {
                addr: a.to_string(),
            });
        }
        join(&net, &cfg.bootstrap).await?;
        tasks.spawn(rejoin_loop(
            net.clone(),
            cfg.bootstrap.clone(),
            cfg.rejoin_every,
        ));
        let manifest = take_up_run(&net, &cfg, from_file, &tasks).await?;
        emit(Event::Run {
            id: manifest.id.clone(),
        });
        if manifest.config.stages.kind == StageKind::Sim
            && cfg.stage != StageChoice::None
            && !cfg.allow_sim
        {
            return Err(PeerError::Invalid(format!(
                "run {} uses the `sim` stand-in stage, which is for benchmarks only; pass --allow-sim to serve it",
                manifest.id
            )));
        }
        let ctx = Arc::new(Ctx {
            net: net.clone(),
            manifest: manifest.clone(),
            cfg: cfg.clone(),
            last: Arc::new(Mutex::new(None)),
            emit,
            departed: Mutex::new(Vec::new()),
            anns: crate::stage::registry::AnnCache::new(super::serving::LIVE_MAX_AGE)
                .missing_for(super::serving::LIVE_MISSING)
                .past_expiry(),
        });
        let live = match cfg.stage {
            StageChoice::None => select::Sampled::default(),
            _ => {
                ctx.live(
                    super::serving::JOIN_SAMPLE,
                    Some(super::serving::JOIN_PATIENCE),
                )
                .await?
            }
        };
        let stage_idx = choose_stage(&cfg, &manifest, &net, &live)?;
        let mut peer = Self {
            ctx: Arc::clone(&ctx),
            addrs,
            slot: Arc::new(Mutex::new(None)),
            moving: Arc::new(tokio::sync::Mutex::new(())),
            rebalancer: tasks.child(),
            tasks,
            _cancel: cancel,
            moves: Arc::new(AtomicU64::new(0)),
            trainers: Vec::new(),
            trainer_net: None,
        };
        if let Some(stage_idx) = stage_idx {
            let serving = ctx.serve(stage_idx, &live.per_stage[stage_idx]).await?;
            *peer.slot.lock() = Some(serving);
            if let Some(period) = cfg.rebalance {
                peer.start_rebalancer(period);
            }
        }
        peer.start_trainers(&cfg).await?;
        Ok(peer)
    }

    /// Starts moving this peer's replica where the swarm needs it, now and then
    /// ([`rebalance_loop`]).
    fn start_rebalancer(&mut self, period: Duration) {
        let net = &self.ctx.net;
        let seed = crate::rng::derive_seed(
            crate::dht::now_ms(),
            &format!("{}/rebalance", net.local_peer_id()),
        );
        self.rebalancer.spawn(rebalance_loop(
            Arc::clone(&self.ctx),
            Arc::clone(&self.slot),
            Arc::clone(&self.moving),
            Arc::clone(&self.moves),
            period,
            seed,
        ));
    }

    /// Starts the `cfg.trainers` trainer loops. Trainers beside a stage get a network node
    /// of their own (a fresh identity, joined through this peer): a libp2p node cannot dial
    /// itself, so on this peer's node they could never call its own stage, and a swarm of
    /// one replica per stage with a trainer in every peer never trained.
    async fn start_trainers(&mut self, cfg: &PeerConfig) -> Result<(), PeerError> {
        let net = self.ctx.net.clone();
        let me = net.local_peer_id().to_string();
        let serving = self.slot.lock().is_some();
        let tnet = if cfg.trainers > 0 && serving && !self.addrs.is_empty() {
            let mut tc = cfg.net.clone();
            tc.identity = libp2p::identity::Keypair::generate_ed25519();
            tc.listen.clear();
            tc.dht_server = false;
            let tnet = net::start(tc)?;
            join(&tnet, &self.addrs).await?;
            self.trainer_net = Some(tnet.clone());
            tnet
        } else {
            net
        };
        for i in 0..cfg.trainers {
            let mut tcfg = cfg.trainer.clone();
            tcfg.index = crate::rng::derive_seed(cfg.trainer.index, &format!("{me}/{i}"));
            self.trainers
                .push(Trainer::spawn(tnet.clone(), &self.ctx.manifest, tcfg)?);
        }
        if cfg.trainers > 0 {
            (self.ctx.emit)(Event::Trainers {
                loops: cfg.trainers,
            });
        }
        Ok(())
    }

    /// The trainer loops.
    pub fn trainers(&self) -> &[Trainer] {
        &self.trainers
    }

    /// The averager's counters, when serving.
    pub fn avg_stats(&self) -> Option<Arc<AvgStats>> {
        self.watch().avg_stats()
    }

    /// How the state of the stage served now was downloaded, if it was.
    pub fn synced(&self) -> Option<SyncReport> {
        self.slot.lock().as_ref().and_then(|s| s.synced.clone())
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
        self.slot.lock().as_ref().map(|s| s.service.stage())
    }

    /// A handle that reads what this peer serves now (its stage service and averager's
    /// counters), for observers that outlive a borrow of the peer (metrics, dashboard).
    pub fn watch(&self) -> PeerWatch {
        PeerWatch {
            slot: Arc::clone(&self.slot),
        }
    }

    /// The stage service, if serving.
    pub fn service(&self) -> Option<Arc<StageService>> {
        self.watch().service()
    }

    /// Why this peer's replica can no longer serve (its compute thread died), if so: the
    /// peer should [`stop`](Self::stop) (which withdraws it) and exit with this reason.
    pub fn failure(&self) -> Option<String> {
        let s = self.service()?;
        let why = s.failure()?;
        Some(format!(
            "stage {}: the compute thread failed ({why}); the replica withdrew from the swarm",
            s.stage()
        ))
    }

    /// The final status of every stage replica this peer left by migrating: their
    /// accounting (samples dropped on a state download, samples still held) leaves the
    /// stage with them.
    pub fn departed(&self) -> Vec<(usize, ReplicaStatus)> {
        self.ctx.departed.lock().clone()
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
        if let Some(n) = self.trainer_net.take() {
            n.shutdown().await;
        }
        let _moving = self.moving.lock().await;
        self.rebalancer.shutdown(Duration::from_secs(5)).await;
        let serving = self.slot.lock().take();
        let mut result = Ok(());
        if let Some(serving) = serving {
            let service = self.ctx.leave(serving).await;
            // A replica whose compute thread died mid-job may hold half-updated
            // parameters: no checkpoint of it.
            let sound = service.failure().is_none();
            if let Some(path) = self.ctx.cfg.checkpoint.as_ref().filter(|_| sound) {
                result = super::serving::save_checkpoint(
                    &service,
                    &self.ctx.manifest,
                    path,
                    &self.ctx.emit,
                )
                .await;
            }
        }
        // The keepers end before the network does (they use it).
        self.tasks.shutdown(Duration::from_secs(5)).await;
        self.ctx.net.shutdown().await;
        result
    }

    /// Stops at once without withdrawing anything: what a crash looks like to the swarm.
    pub async fn kill(mut self) {
        self.tasks.cancel();
        if let Some(s) = self.slot.lock().take() {
            s.refresher.cancel();
        }
        if let Some(n) = self.trainer_net.take() {
            n.shutdown().await;
        }
        self.ctx.net.shutdown().await;
    }
}

/// The stage a starting peer serves, if any: the one `cfg.stage` names, or with `auto` the
/// weakest in `live` (ties, such as empty stages when peers start together, broken by peer
/// id, so joiners spread; the rebalancer fills a stage still empty in seconds).
fn choose_stage(
    cfg: &PeerConfig,
    manifest: &Manifest,
    net: &NetHandle,
    live: &select::Sampled,
) -> Result<Option<usize>, PeerError> {
    let count = manifest.config.stages.count;
    Ok(match cfg.stage {
        StageChoice::Index(i) if i < count => Some(i),
        StageChoice::Index(i) => {
            return Err(PeerError::Invalid(format!(
                "--stage {i} is out of range: run {} has stages 0..{}",
                manifest.id,
                count - 1
            )))
        }
        StageChoice::Auto => {
            let me = net.local_peer_id().to_string();
            let pick = crate::rng::derive_seed(0, &me) as usize;
            Some(select::weakest_of(&live.loads(), pick).unwrap_or(0))
        }
        StageChoice::None => None,
    })
}

impl Drop for Peer {
    fn drop(&mut self) {
        // The keepers and the rebalancer are cancelled by `_cancel`.
        if let Some(s) = self.slot.lock().take() {
            s.refresher.cancel();
        }
    }
}

/// What a peer serves now, read without holding the peer ([`Peer::watch`]).
#[derive(Clone)]
pub struct PeerWatch {
    slot: super::serving::Slot,
}

impl PeerWatch {
    /// The stage service, if serving.
    pub fn service(&self) -> Option<Arc<StageService>> {
        self.slot.lock().as_ref().map(|s| Arc::clone(&s.service))
    }

    /// The averager's counters, when serving.
    pub fn avg_stats(&self) -> Option<Arc<AvgStats>> {
        self.slot
            .lock()
            .as_ref()
            .map(|s| Arc::clone(s.averager.stats()))
    }
}
