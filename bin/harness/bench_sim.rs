//! `shoal bench sim`: a swarm of hundreds of peers in this one process, each a full peer
//! (its own libp2p stack on libp2p's memory transport, or TCP over 127.0.0.1 with `--tcp`,
//! behind its own emulated home link; its own DHT node, stage service, averager and
//! rebalancer) serving `sim` stages, with trainer peers among them and churn. One process,
//! not one per peer: a `shoal` process costs ~15 MB and its own runtime threads, which 200
//! times over would measure the 2 cores' scheduler more than the swarm; here the peers
//! share one 2-thread runtime (as each process's would) and the sim stages sleep on their
//! own compute threads.
//!
//! The swarm: three seed peers (DHT and bootstrap only, as a public swarm's bootstrap
//! nodes), a tenth of the peers running a trainer loop each (no stage), and the rest
//! serving a stage they choose themselves (`--stage auto`: the weakest), every one joining
//! through the seeds at once. Each peer's link is drawn from a spread of home links
//! ([`draw_link`]); a fifth (`--public`) are publicly reachable and serve the DHT, the rest
//! are home machines behind NAT, DHT clients reached directly (as after a hole punch): with
//! every peer a DHT server, 200 end up ~97% fully connected and 2 cores never catch up
//! (BENCHMARKS.md, "Stop 55"). Churn: each minute `--churn` of the stage peers leave,
//! alternately gracefully and killed (no goodbye, as a crash), each replaced at once by a
//! fresh `auto` peer.
//!
//! Efficiency is samples/s completed in the measured window over the bound of the swarm
//! as it stood (sampled every second, averaged): per stage the sum over its serving
//! replicas of min(compute, link capacities), and the trainers' links
//! ([`super::scenarios::bound`]).

use super::bench_sim_row::{reasons, SimRow, Tick};
use super::scenarios::{bound, ReplicaSpec, Setup};
use super::sim_peers::{draw_link, is_public, listen_addr, sim_run};
use super::sim_probe::{self, median, mib, rss_mib, Role};
use futures::future::LocalBoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use libp2p::Multiaddr;
use shoal::dht::Manifest;
use shoal::net::link::LinkSpec;
use shoal::net::stats::LookupCounts;
use shoal::net::NetConfig;
use shoal::rng::Rng;
use shoal::swarm::peer::{Peer, PeerConfig, PeerError, RunSource, StageChoice};
use shoal::trainer::TrainerStats;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Seed peers: the bootstrap addresses every other peer is given.
const SEEDS: usize = 3;

/// Samples/s the whole pipeline is sized for by default (each stage's replicas together),
/// whatever the number of peers: the sim stages sleep, but every call costs the shared
/// cores its streams, encryption and codecs, and 2 cores carry ~100 samples/s of that.
pub const SWARM_RATE: f64 = 100.0;

/// Microbatches in flight per serving replica, summed over the trainers: enough that every
/// replica's queue holds one while the links' latency passes.
const IN_FLIGHT_PER_REPLICA: usize = 3;

/// What `shoal bench sim` is asked.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// Peers, seeds and trainers included.
    pub peers: usize,
    /// Pipeline stages.
    pub stages: usize,
    /// Seconds of warm-up after every peer joined.
    pub warmup: f64,
    /// Seconds measured.
    pub seconds: f64,
    /// Fraction of the stage peers replaced each minute.
    pub churn: f64,
    /// Seed of the links drawn.
    pub seed: u64,
    /// Scratch directory (the manifest file).
    pub dir: PathBuf,
    /// Peers talk over TCP on 127.0.0.1 (a file descriptor per connection end) instead of
    /// libp2p's in-process memory transport.
    pub tcp: bool,
    /// Close connections idle this long (default: the peers' own default).
    pub idle: Option<Duration>,
    /// Samples/s each stage's replicas do together.
    pub rate: f64,
    /// Fraction of the peers (seeds aside) publicly reachable, serving the DHT; the rest
    /// are DHT clients ([`is_public`]).
    pub public: f64,
}

struct Member {
    peer: Peer,
    link: LinkSpec,
    trainer: bool,
}

type Started = (usize, Result<Peer, PeerError>, Duration);

/// The sim swarm while it runs.
struct Sim {
    opts: SimOptions,
    manifest: Manifest,
    boot: Vec<Multiaddr>,
    rng: Rng,
    /// Every peer ever started, by slot; `None` once it left.
    members: Vec<Option<Member>>,
    links: Vec<LinkSpec>,
    starting: FuturesUnordered<LocalBoxFuture<'static, Started>>,
    leaving: FuturesUnordered<LocalBoxFuture<'static, ()>>,
    trainer_stats: Vec<Arc<TrainerStats>>,
    churn_joins: Vec<f64>,
    /// Why churn joiners failed to start.
    join_failures: Vec<String>,
    left: usize,
    killed: usize,
    /// Lookup counts of peers that left.
    gone_lookups: LookupCounts,
    replica_rate: f64,
    concurrency: usize,
    /// (event, seconds since that peer's start) of every start-up event reported.
    phases: Arc<parking_lot::Mutex<Vec<(String, f64)>>>,
}

impl Sim {
    fn peer_config(&self, slot: usize, trainer: bool) -> PeerConfig {
        let id = libp2p::identity::Keypair::generate_ed25519();
        let mut net = NetConfig::new(id, vec![listen_addr(self.opts.tcp)]);
        net.link = Some(self.links[slot]);
        // Autonat probes of 200 loopback peers are noise: they are all reachable.
        net.probe_interval = Duration::from_secs(3600);
        net.dht_server = self.serves_dht(slot);
        if let Some(idle) = self.opts.idle {
            net.idle_timeout = idle;
        }
        let stage = if trainer || slot < SEEDS {
            StageChoice::None
        } else {
            StageChoice::Auto
        };
        let run = RunSource::Id(self.manifest.id.clone());
        let mut cfg = PeerConfig::new(run, net, self.boot.clone(), stage);
        cfg.allow_sim = true;
        cfg.throughput = Some(self.replica_rate);
        cfg.rebalance = Some(PeerConfig::REBALANCE_EVERY);
        if trainer {
            cfg.trainers = 1;
            cfg.trainer.index = slot as u64;
            cfg.trainer.concurrency = self.concurrency;
            cfg.trainer.sync_steps = false;
        }
        // A replica holds every microbatch routed to it (see `bench_swarm::replica_args`).
        cfg.service.queue_cap = cfg.service.queue_cap.max(4 * IN_FLIGHT_PER_REPLICA);
        cfg.kept_forwards = cfg.kept_forwards.max(8 * IN_FLIGHT_PER_REPLICA);
        cfg
    }

    /// Whether the peer of `slot` serves the DHT: a seed, or a public peer.
    fn serves_dht(&self, slot: usize) -> bool {
        slot < SEEDS || is_public(slot, self.opts.public)
    }

    /// Starts the peer of `slot` (a new slot gets a fresh link).
    fn start(&mut self, slot: usize, trainer: bool) {
        while self.links.len() <= slot {
            let l = draw_link(&mut self.rng);
            self.links.push(l);
        }
        let cfg = self.peer_config(slot, trainer);
        let phases = Arc::clone(&self.phases);
        self.starting.push(Box::pin(async move {
            let t0 = Instant::now();
            let r = Peer::start(cfg, move |e| {
                if let Some(name) = serde_json::to_value(&e)
                    .ok()
                    .and_then(|v| v.get("event")?.as_str().map(String::from))
                {
                    phases.lock().push((name, t0.elapsed().as_secs_f64()));
                }
            })
            .await;
            (slot, r, t0.elapsed())
        }));
    }

    /// Takes in a peer that finished starting; returns its join time.
    fn started(&mut self, (slot, r, took): Started) -> Result<f64, String> {
        let peer = r.map_err(|e| format!("peer {slot} did not start: {e}"))?;
        let trainer = !peer.trainers().is_empty();
        self.trainer_stats
            .extend(peer.trainers().iter().map(|t| Arc::clone(t.stats())));
        while self.members.len() <= slot {
            self.members.push(None);
        }
        self.members[slot] = Some(Member {
            peer,
            link: self.links[slot],
            trainer,
        });
        Ok(took.as_secs_f64())
    }

    /// One stage peer leaves (gracefully or killed, alternately) and a fresh one starts.
    fn churn_one(&mut self) {
        let serving: Vec<usize> = (0..self.members.len())
            .filter(|&i| {
                self.members[i]
                    .as_ref()
                    .is_some_and(|m| !m.trainer && m.peer.stage().is_some())
            })
            .collect();
        if serving.is_empty() {
            return;
        }
        let slot = serving[self.rng.below(serving.len() as u64) as usize];
        let Some(m) = self.members[slot].take() else {
            return;
        };
        self.gone_lookups.add(&m.peer.net().lookups().snapshot());
        let kill = (self.left + self.killed) % 2 == 1;
        if kill {
            self.killed += 1;
            self.leaving.push(Box::pin(m.peer.kill()));
        } else {
            self.left += 1;
            self.leaving.push(Box::pin(async move {
                let _ = m.peer.stop().await;
            }));
        }
        let fresh = self.links.len();
        self.start(fresh, false);
    }

    fn live(&self) -> impl Iterator<Item = &Member> {
        self.members.iter().flatten()
    }

    /// The swarm's bound now (samples/s) and what sets it.
    fn bound_now(&self, ratio: f64) -> (f64, String) {
        let replicas: Vec<ReplicaSpec> = self
            .live()
            .filter_map(|m| {
                m.peer.stage().map(|stage| ReplicaSpec {
                    stage,
                    link: m.link,
                    slowdown: 1.0,
                })
            })
            .collect();
        let compute = vec![self.replica_rate; replicas.len()];
        let setup = Setup {
            label: "sim".into(),
            run: self.manifest.config.clone(),
            replicas,
            trainers: self.live().filter(|m| m.trainer).map(|m| m.link).collect(),
            concurrency: self.concurrency,
            churn: None,
            routing: "wiring",
            call_timeout: None,
            large: false,
            sync: false,
        };
        let (b, what, _) = bound(&setup, &compute, ratio, None);
        (b, what)
    }

    /// Averaging control messages the live replicas queued so far.
    fn avg_msgs(&self) -> u64 {
        self.live()
            .filter_map(|m| m.peer.avg_stats())
            .map(|a| a.control_sent.load(Relaxed))
            .sum()
    }

    fn completed(&self) -> u64 {
        self.trainer_stats
            .iter()
            .map(|s| s.completed.load(Relaxed))
            .sum()
    }

    fn swaps(&self) -> u64 {
        self.trainer_stats
            .iter()
            .map(|s| s.swaps.load(Relaxed))
            .sum()
    }

    /// Serving replicas per stage now.
    fn placement(&self) -> Vec<usize> {
        let mut p = vec![0; self.opts.stages];
        for s in self.live().filter_map(|m| m.peer.stage()) {
            if let Some(n) = p.get_mut(s) {
                *n += 1;
            }
        }
        p
    }

    fn lookups(&self) -> LookupCounts {
        let mut c = self.gone_lookups.clone();
        for m in self.live() {
            c.add(&m.peer.net().lookups().snapshot());
            for t in m.peer.trainers() {
                c.add(&t.client().net().lookups().snapshot());
            }
        }
        c
    }

    /// Wire bytes over raw on the trainers' clients (1 before any was sent).
    fn wire_ratio(&self) -> f64 {
        let (mut wire, mut raw) = (0u64, 0u64);
        for m in self.live() {
            for t in m.peer.trainers() {
                let c = t.client().counters();
                wire += c.sent.load(Relaxed) + c.received.load(Relaxed);
                raw += c.raw.load(Relaxed);
            }
        }
        if raw == 0 {
            1.0
        } else {
            wire as f64 / raw as f64
        }
    }
}

/// Runs the sim swarm and measures it.
pub async fn run(opts: SimOptions) -> Result<SimRow, String> {
    if opts.peers < SEEDS + 2 + opts.stages {
        return Err(format!(
            "--peers {} is too few: {SEEDS} seeds, 2 trainers and a replica per stage at least",
            opts.peers
        ));
    }
    let trainers = (opts.peers / 10).max(2);
    let stage_peers = opts.peers - SEEDS - trainers;
    let per_stage = stage_peers as f64 / opts.stages as f64;
    let rate = opts.rate;
    let cfg = sim_run(opts.stages, per_stage, rate);
    cfg.validate().map_err(|e| e.to_string())?;
    let manifest = Manifest::from_config(&cfg).map_err(|e| e.to_string())?;
    let path = opts.dir.join("sim-run.toml");
    std::fs::write(&path, manifest.file_text()).map_err(|e| format!("{}: {e}", path.display()))?;
    let rss0 = rss_mib();
    let concurrency = (IN_FLIGHT_PER_REPLICA * stage_peers).div_ceil(trainers);
    let mut sim = Sim {
        rng: Rng::new(opts.seed),
        replica_rate: rate / per_stage,
        concurrency,
        opts,
        manifest,
        boot: Vec::new(),
        members: Vec::new(),
        links: Vec::new(),
        starting: FuturesUnordered::new(),
        leaving: FuturesUnordered::new(),
        trainer_stats: Vec::new(),
        churn_joins: Vec::new(),
        join_failures: Vec::new(),
        left: 0,
        killed: 0,
        gone_lookups: LookupCounts::default(),
        phases: Default::default(),
    };
    let t0 = Instant::now();
    // The seeds, one by one: the first publishes the run.
    let mut joins = Vec::new();
    for slot in 0..SEEDS {
        sim.links.push(draw_link(&mut sim.rng));
        let mut cfg = sim.peer_config(slot, false);
        if slot == 0 {
            cfg.run = RunSource::File(path.clone());
        }
        let started = Instant::now();
        let r = Peer::start(cfg, |_| {}).await;
        joins.push(sim.started((slot, r, started.elapsed()))?);
        if let Some(m) = &sim.members[slot] {
            sim.boot.extend(m.peer.addrs().iter().take(1).cloned());
        }
    }
    for slot in SEEDS..sim.opts.peers {
        sim.start(slot, slot < SEEDS + trainers);
    }
    tracing::info!(target: "shoal::bench", peers = sim.opts.peers, stage_peers, trainers, "starting");
    while let Some(s) = sim.starting.next().await {
        joins.push(sim.started(s)?);
    }
    let joined_s = t0.elapsed().as_secs_f64();
    tracing::info!(target: "shoal::bench", joined_s, "every peer joined");
    let joined_p50_s = median(&mut joins);
    let mut by: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    for (e, t) in sim.phases.lock().drain(..) {
        by.entry(e).or_default().push(t);
    }
    for (e, mut t) in by {
        let max = t.iter().copied().fold(0.0, f64::max);
        tracing::info!(target: "shoal::bench", "start-up event {e}: {} peers, median {:.1} s, last {max:.1} s", t.len(), median(&mut t));
    }
    measure(
        &mut sim,
        joined_s,
        joined_p50_s,
        rss0,
        stage_peers,
        trainers,
    )
    .await
}

/// Warm-up, the measured window with churn, then the trainers' stop and the tally.
async fn measure(
    sim: &mut Sim,
    joined_s: f64,
    joined_p50_s: f64,
    rss0: f64,
    stage_peers: usize,
    trainers: usize,
) -> Result<SimRow, String> {
    let churn_every = (sim.opts.churn > 0.0)
        .then(|| Duration::from_secs_f64(60.0 / (sim.opts.churn * stage_peers as f64)));
    let joined = Instant::now();
    let w0 = joined + Duration::from_secs_f64(sim.opts.warmup);
    let end = w0 + Duration::from_secs_f64(sim.opts.seconds);
    let (mut c0, mut l0) = (sim.completed(), sim.lookups());
    let (mut bounds, mut what) = (Vec::new(), std::collections::BTreeMap::new());
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut next_churn = None;
    let mut in_window = false;
    let mut timeline = Vec::new();
    let (mut last_done, mut last_swaps, mut last_bounds) =
        (sim.completed(), sim.swaps(), Vec::new());
    let mut last_cpu = sim_probe::cpu_seconds().unwrap_or(0.0);
    let mut last_msgs = sim.avg_msgs();
    let mut ticks = 0u64;
    while Instant::now() < end {
        tokio::select! {
            _ = tick.tick() => {
                if !in_window && Instant::now() >= w0 {
                    in_window = true;
                    (c0, l0) = (sim.completed(), sim.lookups());
                    next_churn = churn_every.map(|d| Instant::now() + d);
                }
                let (b, w) = sim.bound_now(sim.wire_ratio());
                last_bounds.push(b);
                if in_window {
                    bounds.push(b);
                    *what.entry(w).or_insert(0usize) += 1;
                }
                ticks += 1;
                if ticks % 5 == 0 {
                    let (done, swaps) = (sim.completed(), sim.swaps());
                    let mean = last_bounds.iter().sum::<f64>() / last_bounds.len().max(1) as f64;
                    let cpu = sim_probe::cpu_seconds().unwrap_or(last_cpu);
                    let (samples_per_s, cpu_cores) = ((done - last_done) as f64 / 5.0, (cpu - last_cpu) / 5.0);
                    let msgs = sim.avg_msgs();
                    let t = Tick { t: ticks as f64, samples_per_s, bound: mean, swaps: swaps - last_swaps, placement: sim.placement(),
                        cpu_cores, trainers_know: sim_probe::known_fewest(&sim.trainer_stats),
                        avg_msgs_per_s: msgs.saturating_sub(last_msgs) as f64 / 5.0 };
                    last_msgs = msgs;
                    tracing::info!(target: "shoal::bench", ?t, "timeline");
                    timeline.push(t);
                    (last_done, last_swaps, last_cpu) = (done, swaps, cpu);
                    last_bounds.clear();
                }
                if let (Some(at), Some(every)) = (next_churn, churn_every) {
                    if Instant::now() >= at {
                        sim.churn_one();
                        next_churn = Some(at + every);
                    }
                }
            }
            Some(s) = sim.starting.next(), if !sim.starting.is_empty() => {
                match sim.started(s) {
                    Ok(took) => sim.churn_joins.push(took),
                    Err(e) => {
                        tracing::warn!(target: "shoal::bench", "{e}");
                        sim.join_failures.push(e);
                    }
                }
            }
            Some(()) = sim.leaving.next(), if !sim.leaving.is_empty() => {}
        }
    }
    let window_s = w0.elapsed().as_secs_f64();
    let done = sim.completed() - c0;
    let lookups = sim.lookups().since(&l0);
    let mut row = tally(sim, window_s).await;
    row.peers = sim.opts.peers;
    row.stage_peers = stage_peers;
    row.trainer_peers = trainers;
    row.stages = sim.opts.stages;
    row.dht_servers = (0..row.peers).filter(|&s| sim.serves_dht(s)).count();
    row.joined_s = joined_s;
    row.joined_p50_s = joined_p50_s;
    row.churn_join_p50_s = median(&mut sim.churn_joins.clone());
    row.churn_join_max_s = sim.churn_joins.iter().copied().fold(0.0, f64::max);
    row.join_failures = sim.join_failures.clone();
    row.samples_per_s = done as f64 / window_s;
    row.bound = bounds.iter().sum::<f64>() / bounds.len().max(1) as f64;
    row.efficiency = if row.bound > 0.0 {
        row.samples_per_s / row.bound
    } else {
        0.0
    };
    row.bottleneck = what
        .into_iter()
        .max_by_key(|(_, n)| *n)
        .map(|(w, _)| w)
        .unwrap_or_default();
    row.lookups = lookups.count();
    row.lookup_p50_ms = lookups.quantile_ms(0.5);
    row.lookup_p99_ms = lookups.quantile_ms(0.99);
    let per_peer_min = |n: u64| n as f64 / sim.opts.peers as f64 / (window_s / 60.0);
    row.lookups_per_peer_min = per_peer_min(lookups.count());
    row.dht_served_per_peer_min = shoal::net::stats::SERVED_KINDS
        .iter()
        .zip(&lookups.served)
        .map(|(k, n)| (k.to_string(), per_peer_min(*n)))
        .collect();
    row.dht_walks_per_peer_min = shoal::net::stats::WALK_KINDS
        .iter()
        .zip(&lookups.walks)
        .map(|(k, n)| (k.to_string(), per_peer_min(*n)))
        .collect();
    row.left = sim.left;
    row.killed = sim.killed;
    row.window_s = window_s;
    row.timeline = timeline;
    row.peak_rss_mib = mib(shoal::swarm::events::peak_rss_bytes());
    row.rss_per_peer_mib = (row.peak_rss_mib - rss0).max(0.0) / sim.opts.peers as f64;
    Ok(row)
}

/// What the live swarm says of itself; then every peer stops (trainers first) and the
/// trainers' accounting is read.
async fn tally(sim: &mut Sim, _window_s: f64) -> SimRow {
    let mut row = SimRow::default();
    let stages = sim.opts.stages;
    let (mut members, mut rounds) = (vec![0u64; stages], vec![0u64; stages]);
    let (mut tables, mut conns, mut links) = (Vec::new(), Vec::new(), Vec::new());
    row.placement = vec![0; stages];
    for (slot, m) in sim.members.iter().enumerate() {
        let Some(m) = m else { continue };
        row.rebalance_moves += m.peer.moves();
        if let Ok(st) = m.peer.net().status().await {
            tables.push(st.routing_table as f64);
        }
        if let Ok(c) = m.peer.net().connections().await {
            conns.push(c.len() as f64);
            let role = Role::of(slot < SEEDS, m.trainer, m.peer.stage());
            links.push((
                m.peer.net().local_peer_id(),
                role,
                c.into_iter().map(|c| c.peer).collect(),
            ));
        }
        let (Some(s), Some(a)) = (m.peer.stage(), m.peer.avg_stats()) else {
            continue;
        };
        if let Some(p) = row.placement.get_mut(s) {
            *p += 1;
            members[s] += a.members.load(Relaxed);
            rounds[s] += a.rounds.load(Relaxed);
        }
        row.avg_rounds += a.rounds.load(Relaxed);
        row.avg_failed_attempts += a.failed_attempts.load(Relaxed);
    }
    row.avg_group_sizes = (0..stages)
        .map(|s| members[s] as f64 / rounds[s].max(1) as f64)
        .collect();
    row.dht_routing_table_p50 = median(&mut tables);
    row.connections_p50 = median(&mut conns);
    row.connection_pairs = sim_probe::relations(&links);
    // Trainers first: their microbatches finish while every replica still serves.
    let (trainer_peers, others): (Vec<Member>, Vec<Member>) = sim
        .members
        .iter_mut()
        .filter_map(Option::take)
        .partition(|m| m.trainer);
    futures::future::join_all(trainer_peers.into_iter().map(|m| m.peer.stop())).await;
    row.fed = sim.trainer_stats.iter().map(|s| s.fed.load(Relaxed)).sum();
    row.completed = sim.completed();
    row.failed = sim
        .trainer_stats
        .iter()
        .map(|s| s.failed.load(Relaxed))
        .sum();
    row.swaps = sim.swaps();
    row.vanished = row.fed as i64 - row.completed as i64 - row.failed as i64;
    row.failures = reasons(sim.trainer_stats.iter().map(|s| &s.failures));
    row.swap_reasons = reasons(sim.trainer_stats.iter().map(|s| &s.swap_reasons));
    while sim.leaving.next().await.is_some() {}
    futures::future::join_all(others.into_iter().map(|m| m.peer.kill())).await;
    row
}
