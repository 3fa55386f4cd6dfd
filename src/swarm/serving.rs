//! A peer's stage while it serves it: build (and sync) the stage, serve and announce it,
//! leave it gracefully, and what the rebalancer ([`super::rebalance`]) reads of the swarm.

use super::announce::Refresh;
use super::events::{Event, Observer};
use super::peer::{PeerConfig, PeerError};
use crate::averaging::sync::{self, SyncReport};
use crate::averaging::{Averager, AveragerConfig};
use crate::dht::{Announcement, Manifest};
use crate::model::checkpoint::Info;
use crate::model::Stage;
use crate::net::NetHandle;
use crate::rng::Rng;
use crate::stage::client::StageClient;
use crate::stage::registry;
use crate::stage::replica::Replica;
use crate::stage::select;
use crate::stage::service::{measure_throughput, ReplicaStatus, StageService};
use crate::stage::sim::SimCompute;
use libp2p::{Multiaddr, PeerId};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Writes `service`'s replica to `path` as a checkpoint of `manifest`'s run, off the async
/// threads, and reports it.
pub(super) async fn save_checkpoint(
    service: &StageService,
    manifest: &Manifest,
    path: &std::path::Path,
    emit: &Observer,
) -> Result<(), PeerError> {
    let replica = service.replica();
    let (to, id, config) = (
        path.to_path_buf(),
        manifest.id.clone(),
        manifest.canonical.clone(),
    );
    let info = tokio::task::spawn_blocking(move || replica.blocking_lock().save(&to, &id, &config))
        .await
        .map_err(|e| PeerError::Invalid(format!("checkpoint task failed: {e}")))??;
    emit(Event::Checkpointed {
        stage: info.stage,
        step: info.step,
        params_hash: info.params_hash,
        path: path.display().to_string(),
    });
    Ok(())
}

/// Checkpoints every `every` (a failure is reported and tried again next time).
async fn periodic_checkpoints(
    service: Arc<StageService>,
    manifest: Manifest,
    path: std::path::PathBuf,
    every: Duration,
    emit: Observer,
) {
    loop {
        tokio::time::sleep(every).await;
        if let Err(e) = save_checkpoint(&service, &manifest, &path, &emit).await {
            emit(Event::Warning {
                message: format!("periodic checkpoint failed: {e}"),
            });
        }
    }
}

/// State downloads tried before a peer gives up joining a stage.
const SYNC_ATTEMPTS: usize = 3;

/// What a peer has while it serves a stage.
pub(super) struct Serving {
    pub(super) service: Arc<StageService>,
    pub(super) averager: Averager,
    /// Announcements (and periodic checkpoints), cancelled when the stage is left.
    pub(super) refresher: crate::tasks::Tasks,
    pub(super) samples_per_s: f64,
    pub(super) synced: Option<SyncReport>,
}

/// The stage being served, shared with the rebalancer (empty while migrating).
pub(super) type Slot = Arc<Mutex<Option<Serving>>>;

/// What serving and migrating need, shared by the peer and its rebalancer.
pub(super) struct Ctx {
    pub(super) net: NetHandle,
    pub(super) manifest: Manifest,
    pub(super) cfg: PeerConfig,
    pub(super) last: Arc<Mutex<Option<Announcement>>>,
    pub(super) emit: Observer,
    /// The final status of every stage this peer left (migrations and stop).
    pub(super) departed: Mutex<Vec<(usize, ReplicaStatus)>>,
    /// Announcements read by [`Ctx::live`] lately ([`LIVE_MAX_AGE`]).
    pub(super) anns: registry::AnnCache,
}

pub(crate) fn peers_of(anns: &[Announcement]) -> Vec<PeerId> {
    anns.iter().filter_map(|a| a.peer.parse().ok()).collect()
}

impl Ctx {
    /// The live replicas of every stage, from a sample of at most `most` of each stage's
    /// providers ([`select::Sampled`]; the same ones from call to call while they
    /// provide): announcements whose peer answers `info` for that stage (a dead peer's
    /// announcement lives on until it expires, and a leaving one refuses `info`), as the
    /// peer's answer has it. The DHT is read only for replicas not read before; a copy is
    /// then refreshed by the replica's answers. This peer's own announcement counts without
    /// a call, and so does a replica whose copy the read just fetched from the replica
    /// itself (every read of a replica not cached yet was two calls otherwise: ~1,300 a
    /// second at 120 peers in the minute after the join).
    pub(super) async fn live(
        &self,
        most: usize,
        patience: Option<Duration>,
    ) -> Result<select::Sampled, PeerError> {
        let started = tokio::time::Instant::now();
        let count = self.manifest.config.stages.count;
        let me = self.net.local_peer_id().to_string();
        let how = registry::Reading {
            cache: Some(self.anns.clone()),
            sample: Some((most, crate::rng::derive_seed(LIVE_SEED, &me))),
            patience,
        };
        let read = futures::future::join_all(
            (0..count).map(|s| registry::read_stage_counted(&self.net, &self.manifest.id, s, &how)),
        )
        .await;
        let mut per_stage = Vec::with_capacity(count);
        let mut scale = Vec::with_capacity(count);
        let mut unread = Vec::with_capacity(count);
        for r in read {
            let (anns, providers) = r?;
            scale.push(providers as f64 / providers.clamp(1, most) as f64);
            unread.push(providers.min(most).saturating_sub(anns.len()));
            per_stage.push(anns);
        }
        let client = StageClient::new(
            self.net.clone(),
            self.manifest.id.clone(),
            self.manifest.config.codecs.activations.wire(),
        )
        .with_timeout(Duration::from_secs(2));
        let checks = futures::future::join_all(
            per_stage
                .into_iter()
                .flatten()
                .filter(|a| a.peer != me)
                .map(|a| {
                    let client = client.clone();
                    let anns = self.anns.clone();
                    async move {
                        let peer: PeerId = a.peer.parse().ok()?;
                        if anns.answered_since(&peer, started) {
                            return Some(a);
                        }
                        let addrs: Vec<Multiaddr> =
                            a.addrs.iter().filter_map(|x| x.parse().ok()).collect();
                        client.net().add_addresses(peer, addrs).await.ok()?;
                        let fresh = registry::ask_announcement(&client, peer, a.stage as usize)
                            .await
                            .ok()?
                            .filter(|f| f.run == a.run && f.stage == a.stage);
                        match fresh {
                            Some(f) => {
                                anns.refresh(peer, f.clone());
                                Some(f)
                            }
                            None => Some(a),
                        }
                    }
                }),
        )
        .await;
        let mut out: Vec<Vec<Announcement>> = vec![Vec::new(); count];
        let mine = self.last.lock().clone();
        for a in checks.into_iter().flatten().chain(mine) {
            if let Some(v) = out.get_mut(a.stage as usize) {
                v.push(a);
            }
        }
        Ok(select::Sampled {
            per_stage: out,
            scale,
            unread,
        })
    }

    /// Builds, syncs (from the replicas `announced`, if any), serves and announces stage
    /// `stage_idx`.
    pub(super) async fn serve(
        &self,
        stage_idx: usize,
        announced: &[Announcement],
    ) -> Result<Serving, PeerError> {
        let (mut replica, samples_per_s, resumed) = self.build_replica(stage_idx).await?;
        let client = StageClient::new(
            self.net.clone(),
            self.manifest.id.clone(),
            self.manifest.config.codecs.activations.wire(),
        );
        let donors = self
            .donors(&client, stage_idx, &replica, announced, resumed.as_ref())
            .await;
        let synced = self
            .download_state(&client, stage_idx, &mut replica, &donors)
            .await?;
        let replica = Arc::new(tokio::sync::Mutex::new(replica));
        if synced.is_some() {
            // The download took time: replay what the donors applied meanwhile, so the
            // replica starts at their step.
            let _ = crate::averaging::updates::catch_up(
                &client,
                stage_idx,
                client.local_peer_id(),
                &donors,
                &replica,
            )
            .await;
        }
        let (service, averager, refresher) =
            self.start_serving(client, replica, stage_idx, samples_per_s)?;
        Ok(Serving {
            service,
            averager,
            refresher,
            samples_per_s,
            synced,
        })
    }

    /// Builds stage `stage_idx`'s replica: its layers, its throughput (the configured one,
    /// the sim stage's, or measured off the async workers), and the checkpoint it resumed
    /// from, if the peer was given one.
    async fn build_replica(
        &self,
        stage_idx: usize,
    ) -> Result<(Replica, f64, Option<Info>), PeerError> {
        let (cfg, run) = (&self.cfg, &self.manifest.config);
        let stage = Stage::new(run, stage_idx, &cfg.device)?;
        let sim = SimCompute::of(run, cfg.sim_slowdown);
        let (stage, samples_per_s) = match (cfg.throughput, &sim) {
            (Some(t), _) => (stage, t),
            (None, Some(sim)) => (stage, sim.samples_per_s()),
            (None, None) => {
                // Compute off the async workers: peers and calls sharing this runtime
                // keep being served while the stage is measured.
                let (batch, seq) = (run.training.batch_size, run.model.seq_len);
                let budget = cfg.bench_budget;
                let (stage, tp) = tokio::task::spawn_blocking(move || {
                    let tp = measure_throughput(&stage, batch, seq, 2, budget);
                    (stage, tp)
                })
                .await
                .map_err(|e| PeerError::Invalid(format!("the throughput task failed: {e}")))?;
                (stage, tp?)
            }
        };
        let mut replica = Replica::new(run, stage)?
            .with_sim(sim)
            .with_kept_cap(cfg.kept_forwards)
            .with_staleness_bound(cfg.bound_staleness)
            .with_prediction(cfg.weight_prediction);
        let resumed = match &cfg.resume {
            Some(path) => Some(replica.resume(path, &self.manifest.id)?),
            None => None,
        };
        Ok((replica, samples_per_s, resumed))
    }

    /// The replicas `replica` should download its state from: none when no announced
    /// replica is ahead of it, else every announced one.
    ///
    /// Download only from replicas ahead of this one: a fresh replica skips it when every
    /// replica still holds the deterministic init (asked now: announcements may be a few
    /// seconds old), a resumed one when none is past its checkpoint. Replicas at the same
    /// step with other parameters win too (the live swarm's state is the run's).
    async fn donors(
        &self,
        client: &StageClient,
        stage_idx: usize,
        replica: &Replica,
        announced: &[Announcement],
        resumed: Option<&Info>,
    ) -> Vec<PeerId> {
        let mine = (replica.params_step(), replica.params_hash().to_string());
        let (mut answered, mut ahead) = (0, false);
        for p in peers_of(announced) {
            let Ok(r) = client.info(p, stage_idx).await else {
                continue;
            };
            answered += 1;
            let hash = r
                .info
                .as_deref()
                .and_then(|i| serde_json::from_str::<Announcement>(i).ok())
                .map(|a| a.params_hash);
            if r.step > mine.0 || (r.step == mine.0 && hash.as_deref() != Some(mine.1.as_str())) {
                ahead = true;
                break;
            }
        }
        // With no answer at all, a resumed replica serves its checkpoint (everyone else may
        // be restarting too); a fresh one still tries the announced donors.
        let keep = !ahead && (answered > 0 || resumed.is_some());
        if let Some(info) = resumed {
            (self.emit)(Event::Resumed {
                stage: stage_idx,
                step: info.step,
                params_hash: info.params_hash.clone(),
                kept: keep || announced.is_empty(),
            });
        }
        if keep {
            Vec::new()
        } else {
            peers_of(announced)
        }
    }

    /// Downloads the stage's state from `donors` into `replica` (nothing when there are
    /// none: a stage that already has replicas starts from their state, not the init),
    /// trying a few times: donors can be busy or leaving, and a peer never serves a
    /// state that did not download whole and check out.
    async fn download_state(
        &self,
        client: &StageClient,
        stage_idx: usize,
        replica: &mut Replica,
        donors: &[PeerId],
    ) -> Result<Option<SyncReport>, PeerError> {
        if donors.is_empty() {
            return Ok(None);
        }
        let mut rng = Rng::new(crate::rng::derive_seed(
            crate::dht::now_ms(),
            &self.net.local_peer_id().to_string(),
        ));
        let len = replica.snapshot_len();
        let mut attempt = 0;
        let sync_started = Instant::now();
        let (snap, report) = loop {
            attempt += 1;
            let span = tracing::info_span!("state_download", stage = stage_idx, attempt);
            let fetched = sync::Fetched::default();
            let fetch = sync::download(client, stage_idx, donors, len, &mut rng, Some(&fetched));
            let fetch = tracing::Instrument::instrument(fetch, span);
            let got = match self.with_progress(fetch, &fetched).await {
                Ok((snap, parts, report)) => replica
                    .restore_parts(&snap, parts)
                    .map(|_| (snap, report))
                    .map_err(PeerError::from),
                Err(e) => Err(e.into()),
            };
            match got {
                Ok(done) => break done,
                Err(e) if attempt < SYNC_ATTEMPTS => (self.emit)(Event::SyncRetry {
                    stage: stage_idx,
                    error: e.to_string(),
                }),
                Err(e) => return Err(e),
            }
            tokio::time::sleep(Duration::from_secs(attempt as u64)).await;
        };
        (self.emit)(Event::Synced {
            stage: stage_idx,
            step: snap.step,
            donors: report.donors.len(),
            chunks_per_donor: report.chunks_per_donor.clone(),
            bytes: 4 * len as u64,
            seconds: sync_started.elapsed().as_secs_f64(),
            setup_s: report.setup_s,
        });
        Ok(Some(report))
    }

    /// Starts serving `replica`: its service, its averager, and beside them its
    /// announcements (and periodic checkpoints, if configured).
    fn start_serving(
        &self,
        client: StageClient,
        replica: Arc<tokio::sync::Mutex<Replica>>,
        stage_idx: usize,
        samples_per_s: f64,
    ) -> Result<(Arc<StageService>, Averager, crate::tasks::Tasks), PeerError> {
        let (cfg, manifest) = (&self.cfg, &self.manifest);
        let service = Arc::new(StageService::start(
            &self.net,
            manifest,
            replica,
            cfg.service.clone(),
        )?);
        let avg_cfg = self.avg_config(service.numel());
        let seed =
            crate::rng::derive_seed(crate::dht::now_ms(), &self.net.local_peer_id().to_string());
        let averager = Averager::spawn(client, Arc::clone(&service), avg_cfg, seed);
        (self.emit)(Event::Serving {
            stage: stage_idx,
            stages: manifest.config.stages.count,
            device: cfg.device_name.clone(),
            samples_per_s,
        });
        let refresh = Refresh {
            avg: Arc::clone(averager.stats()),
            net: self.net.clone(),
            service: Arc::clone(&service),
            manifest: manifest.clone(),
            device: cfg.device_name.clone(),
            samples_per_s,
            ttl: cfg.announce_ttl,
            last: Arc::clone(&self.last),
        };
        // The first announcement's walks run beside the service (a joiner serves at once;
        // in a busy swarm of 200 they took ~10 s, and stored their records locally first).
        // Periodic checkpoints run beside the announcements and stop with them.
        let periodic = match (&cfg.checkpoint, cfg.checkpoint_every) {
            (Some(path), Some(every)) => Some(periodic_checkpoints(
                Arc::clone(&service),
                manifest.clone(),
                path.clone(),
                every,
                self.emit.clone(),
            )),
            _ => None,
        };
        let refresher = crate::tasks::Tasks::new();
        refresher.spawn(async move {
            match periodic {
                Some(p) => {
                    tokio::join!(refresh.run(), p);
                }
                None => refresh.run().await,
            }
        });
        Ok((service, averager, refresher))
    }

    /// Runs a state download, reporting how far it is every second (`downloading`).
    async fn with_progress<T>(
        &self,
        fetch: impl std::future::Future<Output = T>,
        fetched: &sync::Fetched,
    ) -> T {
        tokio::pin!(fetch);
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                r = &mut fetch => return r,
                _ = tick.tick() => {
                    let (stage, bytes, total) = fetched.read();
                    if total > 0 {
                        (self.emit)(Event::Downloading { stage, bytes, total });
                    }
                }
            }
        }
    }

    fn avg_config(&self, numel: usize) -> AveragerConfig {
        let mut c = AveragerConfig::for_run(&self.manifest.config, numel);
        c.tamper = self.cfg.tamper;
        c
    }

    /// Leaves a stage gracefully and returns its service (closed) for a checkpoint.
    pub(super) async fn leave(&self, serving: Serving) -> Arc<StageService> {
        serving.refresher.shutdown(Duration::from_secs(5)).await;
        let last = self.last.lock().take();
        if let Some(a) = last {
            if let Err(e) = registry::withdraw(&self.net, &a).await {
                // It expires with its TTL anyway.
                tracing::debug!(target: "shoal::peer", "cannot withdraw the announcement: {e}");
            }
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
        let mut wait_settled = async |closed: bool| loop {
            let (queued, pending) = settled(&service);
            // A replica whose compute thread died has nothing more to finish.
            if (queued == 0 && pending == 0) || service.failure().is_some() {
                return;
            }
            if service.step() != step.0 {
                step = (service.step(), Instant::now());
            }
            let stalled = queued == 0 && step.1.elapsed() >= Duration::from_secs(3);
            if Instant::now() >= deadline || stalled {
                if !warned {
                    (self.emit)(Event::Leaving {
                        stage: service.stage(),
                        queued,
                        pending,
                        closed,
                    });
                    warned = true;
                }
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        wait_settled(false).await;
        // Let the averager tell the stage that nothing is pending here any more, so the
        // others do not count this replica's last reported samples as lost.
        tokio::time::sleep(self.avg_config(service.numel()).heartbeat * 2).await;
        service.close().await;
        // A call that raced the drain may have queued a job: let it finish.
        wait_settled(true).await;
        // Then the others forget this replica at once rather than when its progress goes
        // stale (so no round waits on it), and count what it still holds as lost.
        serving.averager.leave();
        tokio::time::sleep(Duration::from_millis(200)).await;
        self.departed
            .lock()
            .push((service.stage(), service.status()));
        drop(serving.averager);
        service
    }

    /// Where this peer should move from `mine`, and the share of its stage that should
    /// ([`select::move_share`]), judged on the live swarm.
    pub(super) async fn target(
        &self,
        mine: usize,
        my_tp: f64,
    ) -> Option<(usize, f64, Vec<Vec<Announcement>>)> {
        let live = self.live(LIVE_SAMPLE, None).await.ok()?;
        let (loads, tps) = (live.loads(), live.throughputs());
        let t = select::rebalance(&loads, &tps, mine, my_tp, select::BALANCE_QUALITY)?;
        Some((
            t,
            select::move_share(&loads, mine, t, my_tp),
            live.per_stage,
        ))
    }
}

/// Providers of each stage a rebalancing peer reads and calls, at most.
pub(super) const LIVE_SAMPLE: usize = 16;

/// Providers of each stage a joining peer reads and calls, at most: its choice is refined
/// by rebalancing, and every joiner reading 16 a stage was 11,000 record walks when 177
/// joined a 4-stage swarm at once.
pub(super) const JOIN_SAMPLE: usize = 6;

/// How long a joiner's provider walks may take: they end then
/// with the providers found. When 200 peers joined at once each walk ran to the DHT's 10-s
/// timeout, for stages that mostly had no provider yet; a choice from part of the
/// providers is refined by rebalancing.
pub(super) const JOIN_PATIENCE: Duration = Duration::from_secs(3);

/// Seed of the providers a peer samples (with its own id: each peer samples others).
const LIVE_SEED: u64 = 0x11fe;

/// How long [`Ctx::live`] reuses an announcement it read. It takes from it what does not
/// change while the replica serves its stage (stage, throughput, addresses), asks the
/// replica itself (`info`) whether it is live, and keeps a copy only while the replica
/// provides the stage. Uncached, 177 rebalancing peers reading 64 announcements a minute
/// were 2,500 DHT record requests a second in a swarm of 200.
pub(super) const LIVE_MAX_AGE: Duration = Duration::from_secs(300);

/// How long [`Ctx::live`] takes a replica whose announcement was not found for absent. In a
/// busy swarm most misses are walks that timed out, and reading them again every 15 s was
/// most of the record walks of a swarm of 200 after it formed (800 every 10 s).
pub(super) const LIVE_MISSING: Duration = Duration::from_secs(60);
