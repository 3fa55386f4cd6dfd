//! `shoal peer`: join the swarm, find or publish the run, pick a stage, serve and announce.
//!
//! Start-up order: listen and print the full addresses (so others can bootstrap from this
//! peer even while it is still starting), dial the bootstrap peers, get the manifest (from
//! the file, then publish it; or from the DHT by id, checked against its hash), choose the
//! stage, build it with the deterministic init, measure its throughput, start serving, then
//! announce and keep re-announcing at a third of the announcement's lifetime.

use super::registry::{self, RegistryError};
use super::replica::Replica;
use super::select;
use super::service::{measure_throughput, ServiceConfig, StageService};
use crate::dht::{self, Announcement, Manifest, ManifestError};
use crate::model::{ModelError, Stage};
use crate::net::{self, NetConfig, NetError, NetHandle};
use candle_core::Device;
use libp2p::Multiaddr;
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
    /// A bad argument.
    #[error("{0}")]
    Invalid(String),
}

/// A serving peer.
pub struct Peer {
    net: NetHandle,
    service: Arc<StageService>,
    manifest: Manifest,
    addrs: Vec<Multiaddr>,
    refresher: tokio::task::JoinHandle<()>,
    last: Arc<std::sync::Mutex<Option<Announcement>>>,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("peer", &self.net.local_peer_id())
            .field("stage", &self.service.stage())
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
        if addrs.is_empty() {
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
        let stage_idx = match cfg.stage {
            StageChoice::Index(i) if i < count => i,
            StageChoice::Index(i) => {
                return Err(PeerError::Invalid(format!(
                    "--stage {i} is out of range: run {} has stages 0..{}",
                    manifest.id,
                    count - 1
                )))
            }
            StageChoice::Auto => {
                let per_stage = registry::read_run(&net, &manifest.id, count).await?;
                let anns: Vec<Announcement> = per_stage.into_iter().flatten().collect();
                select::weakest(&select::loads(count, &anns)).unwrap_or(0)
            }
        };
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
        let replica = Arc::new(std::sync::Mutex::new(Replica::new(
            &manifest.config,
            stage,
        )?));
        let service = Arc::new(StageService::start(
            &net,
            &manifest,
            replica,
            cfg.service.clone(),
        )?);
        log(format!(
            "serving stage {stage_idx} of {count} on {}: {samples_per_s:.1} samples/s",
            cfg.device_name
        ));
        let last = Arc::new(std::sync::Mutex::new(None));
        let ctx = Refresh {
            net: net.clone(),
            service: Arc::clone(&service),
            manifest: manifest.clone(),
            device: cfg.device_name.clone(),
            samples_per_s,
            ttl: cfg.announce_ttl,
            last: Arc::clone(&last),
        };
        ctx.once().await?;
        let refresher = tokio::spawn(ctx.run());
        Ok(Self {
            net,
            service,
            manifest,
            addrs,
            refresher,
            last,
        })
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

    /// The stage served.
    pub fn stage(&self) -> usize {
        self.service.stage()
    }

    /// The stage service.
    pub fn service(&self) -> &StageService {
        &self.service
    }

    /// Withdraws the announcements and stops the network.
    pub async fn stop(self) {
        self.refresher.abort();
        let last = self.last.lock().ok().and_then(|g| g.clone());
        if let Some(a) = last {
            let _ = registry::withdraw(&self.net, &a).await;
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
