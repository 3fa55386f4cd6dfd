//! `shoal peer`: join the swarm, find or publish the run, pick a stage, serve and announce.
//!
//! Start-up order: listen and print the full addresses (so others can bootstrap from this
//! peer even while it is still starting), dial the bootstrap peers, get the manifest (from
//! the file, then publish it; or from the DHT by id, checked against its hash), choose the
//! stage, build it with the deterministic init, measure its throughput, start serving, then
//! announce and keep re-announcing at a third of the announcement's lifetime.

use crate::averaging::sync::{self, SyncError, SyncReport};
use crate::averaging::{Averager, AveragerConfig};
use crate::dht::{self, Announcement, Manifest, ManifestError};
use crate::model::{ModelError, Stage};
use crate::net::{self, NetConfig, NetError, NetHandle};
use crate::rng::Rng;
use crate::stage::client::StageClient;
use crate::stage::registry::{self, RegistryError};
use crate::stage::replica::Replica;
use crate::stage::select;
use crate::stage::service::{measure_throughput, ServiceConfig, StageService};
use crate::trainer::{Trainer, TrainerConfig, TrainerError};
use candle_core::Device;
use libp2p::{Multiaddr, PeerId};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

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
    net: NetHandle,
    service: Option<Arc<StageService>>,
    averager: Option<Averager>,
    trainers: Vec<Trainer>,
    manifest: Manifest,
    addrs: Vec<Multiaddr>,
    refresher: Option<tokio::task::JoinHandle<()>>,
    last: Arc<std::sync::Mutex<Option<Announcement>>>,
    checkpoint: Option<PathBuf>,
    synced: Option<SyncReport>,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("peer", &self.net.local_peer_id())
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
    /// Starts a peer; `log` receives one line per start-up event.
    pub async fn start(cfg: PeerConfig, log: &(dyn Fn(String) + Sync)) -> Result<Self, PeerError> {
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
        let count = manifest.config.stages.count;
        let per_stage = registry::read_run(&net, &manifest.id, count).await?;
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
                // Only replicas that answer count: a dead one's announcement lives until
                // it expires.
                let client = StageClient::new(
                    net.clone(),
                    manifest.id.clone(),
                    manifest.config.codecs.activations,
                )
                .with_timeout(Duration::from_secs(2));
                let checks = futures::future::join_all(per_stage.iter().flatten().map(|a| {
                    let client = client.clone();
                    let a = a.clone();
                    async move {
                        let peer: PeerId = a.peer.parse().ok()?;
                        let addrs: Vec<Multiaddr> =
                            a.addrs.iter().filter_map(|x| x.parse().ok()).collect();
                        client.net().add_addresses(peer, addrs).await.ok()?;
                        client.info(peer, a.stage as usize).await.ok().map(|_| a)
                    }
                }))
                .await;
                let anns: Vec<Announcement> = checks.into_iter().flatten().collect();
                Some(select::weakest(&select::loads(count, &anns)).unwrap_or(0))
            }
            StageChoice::None => None,
        };
        let last = Arc::new(std::sync::Mutex::new(None));
        let mut peer = Self {
            net: net.clone(),
            service: None,
            averager: None,
            trainers: Vec::new(),
            manifest: manifest.clone(),
            addrs,
            refresher: None,
            last: Arc::clone(&last),
            checkpoint: cfg.checkpoint.clone(),
            synced: None,
        };
        if let Some(stage_idx) = stage_idx {
            let donors: Vec<PeerId> = per_stage[stage_idx]
                .iter()
                .filter_map(|a| a.peer.parse().ok())
                .collect();
            peer.serve(&cfg, stage_idx, &donors, log).await?;
        }
        let me = net.local_peer_id().to_string();
        for i in 0..cfg.trainers {
            let mut tcfg = cfg.trainer.clone();
            tcfg.index = crate::rng::derive_seed(cfg.trainer.index, &format!("{me}/{i}"));
            peer.trainers
                .push(Trainer::spawn(net.clone(), &manifest, tcfg)?);
        }
        if cfg.trainers > 0 {
            log(format!("running {} trainer loop(s)", cfg.trainers));
        }
        Ok(peer)
    }

    async fn serve(
        &mut self,
        cfg: &PeerConfig,
        stage_idx: usize,
        donors: &[PeerId],
        log: &(dyn Fn(String) + Sync),
    ) -> Result<(), PeerError> {
        let manifest = &self.manifest;
        let count = manifest.config.stages.count;
        let stage = Stage::new(&manifest.config, stage_idx, &cfg.device)?;
        let m = &manifest.config.model;
        let samples_per_s = measure_throughput(
            &stage,
            manifest.config.training.batch_size,
            m.seq_len,
            m.d_model,
            2,
            cfg.bench_budget,
        )?;
        let mut replica = Replica::new(&manifest.config, stage)?;
        let client = StageClient::new(
            self.net.clone(),
            manifest.id.clone(),
            manifest.config.codecs.activations,
        );
        if !donors.is_empty() {
            // A stage that already has replicas: start from their state, not the init.
            let mut rng = Rng::new(crate::rng::derive_seed(
                crate::dht::now_ms(),
                &self.net.local_peer_id().to_string(),
            ));
            let len = replica.snapshot_len();
            let (snap, report) = sync::download(&client, stage_idx, donors, len, &mut rng).await?;
            replica.restore(&snap)?;
            log(format!(
                "synced stage {stage_idx} at step {} from {} donor(s), chunks {:?}",
                snap.step,
                report.donors.len(),
                report.chunks_per_donor
            ));
            self.synced = Some(report);
        }
        let replica = Arc::new(tokio::sync::Mutex::new(replica));
        let service = Arc::new(StageService::start(
            &self.net,
            manifest,
            replica,
            cfg.service.clone(),
        )?);
        let avg_cfg = AveragerConfig::new(
            manifest.config.target_batch_size() as u64,
            manifest.config.codecs.gradients,
        );
        let seed =
            crate::rng::derive_seed(crate::dht::now_ms(), &self.net.local_peer_id().to_string());
        self.averager = Some(Averager::spawn(client, Arc::clone(&service), avg_cfg, seed));
        log(format!(
            "serving stage {stage_idx} of {count} on {}: {samples_per_s:.1} samples/s",
            cfg.device_name
        ));
        let ctx = Refresh {
            net: self.net.clone(),
            service: Arc::clone(&service),
            manifest: manifest.clone(),
            device: cfg.device_name.clone(),
            samples_per_s,
            ttl: cfg.announce_ttl,
            last: Arc::clone(&self.last),
        };
        ctx.once().await?;
        self.refresher = Some(tokio::spawn(ctx.run()));
        self.service = Some(service);
        Ok(())
    }

    /// The trainer loops.
    pub fn trainers(&self) -> &[Trainer] {
        &self.trainers
    }

    /// The averager, when serving.
    pub fn averager(&self) -> Option<&Averager> {
        self.averager.as_ref()
    }

    /// How the state was downloaded at start, if it was.
    pub fn synced(&self) -> Option<&SyncReport> {
        self.synced.as_ref()
    }

    /// The network handle.
    pub fn net(&self) -> &NetHandle {
        &self.net
    }

    /// The full addresses printed at start.
    pub fn addrs(&self) -> &[Multiaddr] {
        &self.addrs
    }

    /// The run.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The stage served, if any.
    pub fn stage(&self) -> Option<usize> {
        self.service.as_ref().map(|s| s.stage())
    }

    /// The stage service, if serving.
    pub fn service(&self) -> Option<&StageService> {
        self.service.as_deref()
    }

    /// Stops gracefully: trainers finish their microbatches, the stage stops taking work
    /// when its announcements are withdrawn, the checkpoint is written atomically.
    pub async fn stop(self) -> Result<(), PeerError> {
        for t in self.trainers {
            t.stop().await;
        }
        if let Some(r) = &self.refresher {
            r.abort();
        }
        let last = self.last.lock().ok().and_then(|g| g.clone());
        if let Some(a) = last {
            let _ = registry::withdraw(&self.net, &a).await;
        }
        drop(self.averager);
        let mut result = Ok(());
        if let (Some(svc), Some(path)) = (&self.service, &self.checkpoint) {
            let replica = svc.replica();
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
        self.net.shutdown().await;
        result
    }

    /// Stops at once without withdrawing anything: what a crash looks like to the swarm.
    pub async fn kill(self) {
        if let Some(r) = &self.refresher {
            r.abort();
        }
        self.net.shutdown().await;
    }
}

struct Refresh {
    net: NetHandle,
    service: Arc<StageService>,
    manifest: Manifest,
    device: String,
    samples_per_s: f64,
    ttl: Duration,
    last: Arc<std::sync::Mutex<Option<Announcement>>>,
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
