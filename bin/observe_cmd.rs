//! `--metrics ADDR` and `--dashboard ADDR` of `shoal peer` and `shoal train`: the process's
//! counters as Prometheus metrics and a live dashboard, served over HTTP while it runs.

use crate::args::ObserveArgs;
use crate::peer_cmd::{Out, Trainers};
use anyhow::{Context, Result};
use parking_lot::Mutex;
use shoal::observe::http::{self, Pages, Server, State};
use shoal::observe::{CodecView, ReplicaView, Snapshot, Source};
use shoal::swarm::events::{peak_rss_bytes, Event};
use shoal::swarm::peer::{Peer, PeerConfig, PeerWatch};
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Eval batches per `--eval-every` measurement.
const EVAL_BATCHES: usize = 2;

/// What the source reads once the peer runs.
struct Parts {
    peer: String,
    run: String,
    /// The run's codecs: (activations, gradients).
    codecs: (String, String),
    watch: PeerWatch,
    trainers: Trainers,
    started: Instant,
    /// The swarm's latest held-out loss (`--eval-every`).
    eval: Arc<Mutex<Option<f64>>>,
}

/// The observers of one process (none without `--metrics`/`--dashboard`).
#[derive(Clone)]
pub struct Watch {
    state: Option<Arc<State>>,
    parts: Arc<OnceLock<Parts>>,
    metrics: Option<SocketAddr>,
    dashboard: Option<SocketAddr>,
    eval_every: Option<Duration>,
}

impl Watch {
    pub fn new(a: &ObserveArgs) -> Self {
        let parts: Arc<OnceLock<Parts>> = Arc::new(OnceLock::new());
        let p = Arc::clone(&parts);
        let source: Source = Arc::new(move || p.get().map(snapshot).unwrap_or_default());
        let wanted = a.metrics.is_some() || a.dashboard.is_some();
        Self {
            state: wanted.then(|| State::new(source, None)),
            parts,
            metrics: a.metrics,
            dashboard: a.dashboard,
            eval_every: (a.eval_every > 0).then(|| Duration::from_secs(a.eval_every)),
        }
    }

    /// Notes the events a dashboard shows (moves, state downloads, leaving).
    pub fn event(&self, e: &Event) {
        let Some(st) = &self.state else { return };
        if matches!(
            e,
            Event::Serving { .. }
                | Event::Synced { .. }
                | Event::Rebalancing { .. }
                | Event::MoveFailed { .. }
                | Event::Leaving { .. }
                | Event::Resumed { .. }
                | Event::Warning { .. }
        ) {
            st.event(e.to_string());
        }
    }

    /// Starts serving, for `peer` and its `trainers`.
    pub async fn serve(&self, peer: &Peer, trainers: &Trainers) -> Result<Vec<Server>> {
        let Some(state) = &self.state else {
            return Ok(Vec::new());
        };
        let eval = Arc::new(Mutex::new(None));
        if let (Some(every), false) = (self.eval_every, trainers.stats.is_empty()) {
            let (net, m, slot) = (
                peer.net().clone(),
                peer.manifest().clone(),
                Arc::clone(&eval),
            );
            // Ends with the runtime; a failed measurement waits for the next one.
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    match shoal::stage::probe::evaluate(&net, &m, EVAL_BATCHES).await {
                        Ok(l) => *slot.lock() = Some(l),
                        Err(e) => tracing::debug!("eval for the dashboard failed: {e}"),
                    }
                }
            });
        }
        let _ = self.parts.set(Parts {
            eval,
            peer: peer.net().local_peer_id().to_string(),
            run: peer.manifest().id.clone(),
            codecs: (
                peer.manifest().config.codecs.activations.to_string(),
                peer.manifest().config.codecs.gradients.to_string(),
            ),
            watch: peer.watch(),
            trainers: trainers.clone(),
            started: Instant::now(),
        });
        // The dashboard's swarm view reads the DHT through this peer.
        state.set_net(peer.net().clone(), peer.manifest().id.clone());
        let mut servers = Vec::new();
        let both = self.metrics.is_some() && self.metrics == self.dashboard;
        if let Some(addr) = self.metrics {
            servers.push(listen(addr, state, both, "--metrics").await?);
        }
        if let (Some(addr), false) = (self.dashboard, both) {
            servers.push(listen(addr, state, true, "--dashboard").await?);
        }
        Ok(servers)
    }
}

/// Serves `/metrics` of `state` on `addr` (given as `flag`), and the dashboard with it
/// when `dashboard`; says where.
pub async fn listen(
    addr: SocketAddr,
    state: &Arc<State>,
    dashboard: bool,
    flag: &str,
) -> Result<Server> {
    let pages = Pages {
        metrics: true,
        dashboard,
    };
    let s = http::serve(addr, Arc::clone(state), pages)
        .await
        .with_context(|| format!("cannot listen on {addr} for {flag}"))?;
    if dashboard {
        eprintln!("dashboard at http://{}/", s.addr);
    } else {
        eprintln!("metrics at http://{}/metrics", s.addr);
    }
    Ok(s)
}

/// Starts a peer (or trainer) with `cfg`: its events go to `out` and to the dashboard,
/// and `--metrics`/`--dashboard` are served once it runs.
pub async fn start(
    cfg: PeerConfig,
    out: &Out,
    observe: &ObserveArgs,
) -> Result<(Peer, Trainers, Vec<Server>)> {
    let watch = Watch::new(observe);
    let (o, w) = (out.clone(), watch.clone());
    let peer = Peer::start(cfg, move |e| {
        w.event(&e);
        o.emit(e)
    })
    .await?;
    let trainers = Trainers::of(&peer);
    let servers = watch.serve(&peer, &trainers).await?;
    Ok((peer, trainers, servers))
}

fn snapshot(p: &Parts) -> Snapshot {
    let replica = p.watch.service().map(|s| {
        let st = s.status();
        ReplicaView {
            stage: s.stage(),
            step: st.params_step,
            params_hash: st.params_hash,
            queue: (s.queue_len(), s.queue_cap()),
            samples_applied: st.samples_applied,
            samples_lost: st.samples_lost,
            counters: s.counters().snapshot(),
            averaging: p.watch.avg_stats().map(|a| a.snapshot()),
        }
    });
    let (failed, swapped) = p.trainers.reason_maps();
    let trainer = (!p.trainers.stats.is_empty()).then(|| p.trainers.progress());
    let mut compression = Vec::new();
    if let Some(t) = &trainer {
        compression.push(CodecView {
            kind: "activations".into(),
            codec: p.codecs.0.clone(),
            raw: t.raw,
            wire: t.wire,
        });
    }
    if let Some(a) = replica.as_ref().and_then(|r| r.averaging.as_ref()) {
        compression.push(CodecView {
            kind: "gradients".into(),
            codec: p.codecs.1.clone(),
            raw: a.raw_sent,
            wire: a.bytes_sent,
        });
    }
    Snapshot {
        peer: p.peer.clone(),
        run: p.run.clone(),
        seconds: p.started.elapsed().as_secs_f64(),
        replica,
        trainer,
        failed,
        swapped,
        peak_rss_bytes: peak_rss_bytes().unwrap_or(0),
        links: p.trainers.links(),
        compression,
        eval_loss: *p.eval.lock(),
        stage_replicas: p.trainers.stage_replicas(),
    }
}
