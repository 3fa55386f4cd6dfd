//! The averager task of one replica: it owns what the replica knows of its stage's other
//! replicas, takes their messages from a bounded inbox, sends through a bounded outbox,
//! asks [`plan::decide`] what to do on each tick, and runs the rounds ([`round`]) it leads
//! or joins.

use super::plan::{self, Decision, View};
use super::reduce;
use super::round::{Book, Key, Round};
use super::server::Inbound;
use super::sync;
use super::{AveragerConfig, AvgStats};
use crate::rng::Rng;
use crate::stage::client::StageClient;
use crate::stage::registry;
use crate::stage::service::{ReplicaStatus, StageService};
use crate::wire::msg::{AvgMsg, ErrorKind};
use crate::wire::{self, Limits, TensorData};
use futures::StreamExt;
use libp2p::{Multiaddr, PeerId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Messages waiting to be sent; beyond this, new ones are dropped (and counted): progress
/// is repeated by the heartbeat, and a round that loses a message retries at its deadline.
pub(super) const OUTBOX: usize = 1024;

/// Messages being sent at once.
const SENDS_IN_FLIGHT: usize = 32;

/// A message to one replica.
pub(super) struct Outgoing {
    peer: PeerId,
    msg: AvgMsg,
    frame: Option<Vec<u8>>,
}

/// Frames at least this long time the uplink (shorter ones mostly time the round trip).
const MEASURED_FRAME: usize = 64 << 10;

/// Folds a measured rate into the moving average in `avg` (bytes/s).
fn fold_rate(avg: &AtomicU64, bytes: usize, took: Duration) {
    let rate = (bytes as f64 / took.as_secs_f64().max(1e-6)) as u64;
    let old = avg.load(Ordering::Relaxed);
    let new = if old == 0 { rate } else { (3 * old + rate) / 4 };
    avg.store(new.max(1), Ordering::Relaxed);
}

/// Sends the outbox's messages, at most [`SENDS_IN_FLIGHT`] at once, timing the big ones
/// (the uplink rate in `stats`); ends when the averager drops its side.
pub(super) async fn sender(
    client: StageClient,
    stage: usize,
    rx: mpsc::Receiver<Outgoing>,
    stats: Arc<AvgStats>,
) {
    let debug = std::env::var_os("SHOAL_DEBUG_AVG").is_some();
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) })
        .for_each_concurrent(SENDS_IN_FLIGHT, |o| {
            let client = client.clone();
            let stats = Arc::clone(&stats);
            async move {
                // Progress is repeated by the heartbeat anyway; round messages are retried,
                // since a lost part stalls the round until its deadline.
                let tries = if matches!(o.msg, AvgMsg::Progress { .. }) {
                    1
                } else {
                    4
                };
                let bytes = o.frame.as_ref().map_or(0, Vec::len);
                for i in 0..tries {
                    let t0 = Instant::now();
                    match client
                        .send_avg(o.peer, stage, o.msg.clone(), o.frame.clone())
                        .await
                    {
                        Ok(()) => {
                            if bytes >= MEASURED_FRAME {
                                fold_rate(&stats.uplink, bytes, t0.elapsed());
                            }
                            return;
                        }
                        // A part for a round that is over: sending it again cannot help.
                        Err(e) if e.kind() == Some(ErrorKind::StaleStep) => return,
                        Err(e) => {
                            if debug {
                                eprintln!("avg send to {} failed (try {i}): {e}", o.peer);
                            }
                            tokio::time::sleep(Duration::from_millis(50 << i)).await;
                        }
                    }
                }
            }
        })
        .await;
}

pub(super) struct State {
    /// This replica announced that it leaves.
    pub(super) left: bool,
    /// Samples replicas said they held when they left, to count as lost in the next round.
    pub(super) left_lost: u64,
    pub(super) me: PeerId,
    pub(super) stage: usize,
    pub(super) n: usize,
    /// Bytes of the stage's whole gradient in the gradient codec (at most).
    pub(super) gradient_bytes: u64,
    pub(super) cfg: AveragerConfig,
    pub(super) client: StageClient,
    pub(super) service: Arc<StageService>,
    pub(super) outbox: mpsc::Sender<Outgoing>,
    /// The applied step, shared with the server (which refuses parts of other steps).
    pub(super) step: Arc<AtomicU64>,
    pub(super) views: HashMap<PeerId, View>,
    pub(super) known: Vec<PeerId>,
    pub(super) round: Option<Round>,
    pub(super) book: Book,
    pub(super) last_sent: Option<(u64, u64, u64, u64, String)>,
    pub(super) last_sent_at: Instant,
    pub(super) timers: plan::Timers,
    pub(super) started: Instant,
    pub(super) stats: Arc<AvgStats>,
    pub(super) rng: Rng,
}

impl State {
    pub(super) async fn run(
        mut self,
        mut rx: mpsc::Receiver<Inbound>,
        mut leave: tokio::sync::watch::Receiver<bool>,
    ) {
        let progress = self.service.progress();
        let (mtx, mut mrx) = mpsc::channel::<Vec<(PeerId, Vec<Multiaddr>)>>(1);
        let mut next_membership = Instant::now();
        // One DHT lookup of the stage's replicas at a time.
        let mut lookup: Option<tokio::task::JoinHandle<()>> = None;
        loop {
            tokio::select! {
                m = rx.recv() => match m {
                    Some(m) if !self.left => self.on_message(m.from, m.msg, m.frames).await,
                    Some(_) => {}
                    None => return,
                },
                Some(peers) = mrx.recv() => {
                    for (p, addrs) in peers {
                        if p != self.me {
                            let _ = self.client.net().add_addresses(p, addrs).await;
                            if !self.known.contains(&p) {
                                self.known.push(p);
                            }
                        }
                    }
                }
                _ = progress.notified() => {}
                Ok(()) = leave.changed() => {
                    if *leave.borrow() && !self.left {
                        self.left = true;
                        let st = self.status();
                        let msg = AvgMsg::Leave {
                            pending: st.accum_count + st.frozen_count,
                        };
                        for p in self.others() {
                            self.send(p, msg.clone(), None);
                        }
                    }
                }
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
            if self.left {
                // Gone from the stage: answer nothing, start nothing.
                continue;
            }
            let idle = lookup.as_ref().is_none_or(|h| h.is_finished());
            if Instant::now() >= next_membership && idle {
                next_membership = Instant::now() + self.cfg.membership_every;
                let net = self.client.net().clone();
                let (run, stage, tx) = (self.client.run().to_string(), self.stage, mtx.clone());
                lookup = Some(tokio::spawn(async move {
                    if let Ok(anns) = registry::read_stage(&net, &run, stage).await {
                        let peers = anns
                            .into_iter()
                            .filter_map(|a| {
                                let p: PeerId = a.peer.parse().ok()?;
                                let addrs = a.addrs.iter().filter_map(|x| x.parse().ok()).collect();
                                Some((p, addrs))
                            })
                            .collect();
                        let _ = tx.try_send(peers);
                    }
                }));
            }
            self.tick().await;
        }
    }

    fn status(&self) -> ReplicaStatus {
        self.service.status()
    }

    /// Every other replica of the stage this one knows of: announced, or heard from.
    fn others(&self) -> Vec<PeerId> {
        let mut out = self.known.clone();
        out.extend(self.views.keys().filter(|p| !self.known.contains(p)));
        out
    }

    fn send(&self, peer: PeerId, msg: AvgMsg, frame: Option<Vec<u8>>) {
        if self.outbox.try_send(Outgoing { peer, msg, frame }).is_err() {
            self.stats.dropped_sends.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn debug(&self, what: impl FnOnce() -> String) {
        if std::env::var_os("SHOAL_DEBUG_AVG").is_some() {
            let me = self.me.to_string();
            let short = &me[me.len().saturating_sub(6)..];
            eprintln!("avg {short} s{}: {}", self.stage, what());
        }
    }

    /// Sends progress on change (at most every 100 ms) or as a heartbeat.
    fn heartbeat(&mut self, st: &ReplicaStatus) {
        let now_sig = (
            st.params_step,
            st.accum_step,
            st.accum_count,
            st.frozen_count,
            st.params_hash.clone(),
        );
        // libp2p-stream drops inbound streams that arrive faster than they are accepted, so
        // changes are sent at most every 100 ms.
        let since = self.last_sent_at.elapsed();
        let changed = self.last_sent.as_ref() != Some(&now_sig);
        let stepped = self.last_sent.as_ref().map(|l| l.0) != Some(st.params_step);
        if stepped
            || (changed && since >= Duration::from_millis(100))
            || since >= self.cfg.heartbeat
        {
            let msg = AvgMsg::Progress {
                params_step: st.params_step,
                accum_step: st.accum_step,
                count: st.accum_count,
                frozen: st.frozen_count,
                hash: st.params_hash.clone(),
                uplink: self.stats.uplink.load(Ordering::Relaxed),
            };
            for p in self.others() {
                self.send(p, msg.clone(), None);
            }
            self.last_sent = Some(now_sig);
            self.last_sent_at = Instant::now();
        }
    }

    async fn tick(&mut self) {
        let st = self.status();
        self.step.store(st.params_step, Ordering::Relaxed);
        self.heartbeat(&st);
        // Abandon a round past its deadline (frozen sums stay for the next attempt).
        if let Some(r) = &self.round {
            if Instant::now() > r.deadline {
                let (parts, have) = self.book.counts(r.key());
                self.debug(|| {
                    format!(
                        "round {}/{} timed out: parts {parts} reduced {have} of {}",
                        r.step,
                        r.attempt,
                        r.members.len()
                    )
                });
                self.stats.failed_attempts.fetch_add(1, Ordering::Relaxed);
                self.round = None;
            }
        }
        if self.round.is_some() {
            return;
        }
        let mine = View::of(&st, Instant::now());
        let input = plan::Input {
            me: self.me,
            mine: &mine,
            views: &self.views,
            known: &self.known,
            started: self.started,
            behind_since: self.timers.behind_since,
            ready_since: self.timers.ready_since,
        };
        let (decision, timers) = plan::decide(&input, Instant::now(), &self.cfg);
        self.timers = timers;
        match decision {
            Decision::Wait => {}
            Decision::Resync { donors } => {
                self.debug(|| format!("behind: resync from {} donor(s)", donors.len()));
                self.resync(&donors).await;
            }
            Decision::Lead {
                step,
                members,
                held,
                dead,
                lost,
            } => {
                let lost = lost + std::mem::take(&mut self.left_lost);
                for p in dead {
                    self.views.remove(&p);
                    self.known.retain(|k| *k != p);
                }
                let attempt = self.rng.next_u64() as u32;
                self.debug(|| format!("round {step}/{attempt} members {}", members.len()));
                let msg = AvgMsg::Members {
                    step,
                    attempt,
                    members: members.iter().map(|p| p.to_string()).collect(),
                    quotas: held,
                    lost,
                };
                for &p in &members {
                    if p != self.me {
                        self.send(p, msg.clone(), None);
                    }
                }
                self.on_members(step, attempt, members, lost).await;
            }
        }
    }

    async fn resync(&mut self, donors: &[PeerId]) {
        if donors.is_empty() {
            return;
        }
        let len = self.n * 3;
        let r = sync::download(&self.client, self.stage, donors, len, &mut self.rng).await;
        if let Err(e) = &r {
            if let Ok(mut g) = self.stats.last_error.lock() {
                *g = Some(e.to_string());
            }
        }
        if let Ok((snap, _)) = r {
            let replica = self.service.replica();
            let ok = tokio::task::spawn_blocking(move || {
                replica
                    .blocking_lock()
                    .restore(&snap)
                    .map(|_| ())
                    .map_err(|_| ())
            })
            .await;
            if matches!(ok, Ok(Ok(()))) {
                self.stats.resyncs.fetch_add(1, Ordering::Relaxed);
                self.service.refresh_status().await;
                self.book.clear();
            }
        }
    }

    async fn on_message(&mut self, from: PeerId, msg: AvgMsg, frames: Vec<Vec<u8>>) {
        match msg {
            AvgMsg::Leave { pending } => {
                self.views.remove(&from);
                self.known.retain(|k| *k != from);
                self.left_lost += pending;
            }
            AvgMsg::Progress {
                params_step,
                accum_step,
                count,
                frozen,
                hash,
                uplink,
            } => {
                self.views.insert(
                    from,
                    View {
                        params_step,
                        accum_step,
                        count,
                        frozen,
                        hash,
                        uplink,
                        at: Instant::now(),
                    },
                );
                if !self.known.contains(&from) {
                    self.known.push(from);
                }
            }
            AvgMsg::Members {
                step,
                attempt,
                members,
                quotas,
                lost,
            } => {
                // The leader counted the samples of replicas that left; do not again.
                self.left_lost = 0;
                let members: Vec<PeerId> = members.iter().filter_map(|m| m.parse().ok()).collect();
                if members.len() == quotas.len() {
                    self.on_members(step, attempt, members, lost).await;
                }
            }
            AvgMsg::Part {
                step,
                attempt,
                count,
            } => {
                if let Some(v) = frames.first().and_then(|f| decode(f)) {
                    self.book.add_part((step, attempt), from, v, count);
                    self.try_reduce();
                    self.try_complete().await;
                }
            }
            AvgMsg::Reduced {
                step,
                attempt,
                index,
                total,
            } => {
                if let Some(v) = frames.first().and_then(|f| decode(f)) {
                    self.book.add_reduced((step, attempt), index, v, total);
                    self.try_complete().await;
                }
            }
        }
    }

    async fn on_members(&mut self, step: u64, attempt: u32, members: Vec<PeerId>, lost: u64) {
        let st = self.status();
        if step != st.params_step {
            self.debug(|| {
                format!(
                    "ignored members {step}/{attempt} at step {}",
                    st.params_step
                )
            });
            return;
        }
        let Some(index) = members.iter().position(|p| *p == self.me) else {
            return;
        };
        if self.round.as_ref().map(Round::key) == Some((step, attempt)) {
            return;
        }
        let Ok(frozen) = self.service.freeze(step) else {
            self.debug(|| format!("freeze {step} failed"));
            return;
        };
        let key: Key = (step, attempt);
        let uplinks: Vec<u64> = members
            .iter()
            .map(|m| match self.views.get(m) {
                Some(v) => v.uplink,
                None => self.stats.uplink.load(Ordering::Relaxed),
            })
            .collect();
        let timeout = plan::round_timeout(
            self.cfg.round_timeout,
            self.gradient_bytes,
            members.len(),
            &uplinks,
        );
        self.round = Some(Round {
            step,
            attempt,
            members: members.clone(),
            index,
            lost,
            deadline: Instant::now() + timeout,
            reduced_sent: false,
            started: Instant::now(),
        });
        let ranges = reduce::partition(frozen.sum.len(), members.len());
        for (i, (&p, range)) in members.iter().zip(ranges).enumerate() {
            let part = &frozen.sum[range];
            if i == index {
                self.book
                    .add_part(key, self.me, part.to_vec(), frozen.count);
                continue;
            }
            let mut frame = Vec::new();
            if wire::encode_f32(&[part.len()], part, &self.cfg.codec, &mut frame).is_ok() {
                self.count_sent(frame.len(), part.len());
                let msg = AvgMsg::Part {
                    step,
                    attempt,
                    count: frozen.count,
                };
                self.send(p, msg, Some(frame));
            }
        }
        self.try_reduce();
        self.try_complete().await;
    }

    fn count_sent(&self, frame_bytes: usize, floats: usize) {
        self.stats
            .bytes_sent
            .fetch_add(frame_bytes as u64, Ordering::Relaxed);
        self.stats
            .raw_bytes
            .fetch_add(4 * floats as u64, Ordering::Relaxed);
    }

    fn try_reduce(&mut self) {
        let Some(r) = &self.round else { return };
        if r.reduced_sent {
            return;
        }
        let Some(sums) = self.book.parts_ready(r, self.n) else {
            return;
        };
        let len = reduce::partition(self.n, r.members.len())[r.index].len();
        let (avg, total) = reduce::reduce_part(&sums, len);
        // The members' parts are summed: free them before the reduced parts arrive.
        self.book.drop_parts(r.key());
        let mut frame = Vec::new();
        if wire::encode_f32(&[avg.len()], &avg, &self.cfg.codec, &mut frame).is_err() {
            return;
        }
        // Apply exactly what the others will decode.
        let Some(exact) = decode(&frame) else { return };
        let (key, index) = (r.key(), r.index as u32);
        let others: Vec<PeerId> = r
            .members
            .iter()
            .copied()
            .filter(|m| *m != self.me)
            .collect();
        for p in others {
            self.count_sent(frame.len(), avg.len());
            let msg = AvgMsg::Reduced {
                step: key.0,
                attempt: key.1,
                index,
                total,
            };
            self.send(p, msg, Some(frame.clone()));
        }
        self.book.add_reduced(key, index, exact, total);
        if let Some(r) = &mut self.round {
            r.reduced_sent = true;
        }
    }

    async fn try_complete(&mut self) {
        let Some(r) = &self.round else { return };
        let Some((avg, total)) = self.book.assembled(r, self.n) else {
            return;
        };
        let (step, lost, started) = (r.step, r.lost, r.started);
        let replica = self.service.replica();
        let applied = tokio::task::spawn_blocking(move || {
            replica
                .blocking_lock()
                .apply(step, &avg, total, lost)
                .map_err(|_| ())
        })
        .await;
        self.round = None;
        self.book.forget_through(step);
        if matches!(applied, Ok(Ok(()))) {
            self.debug(|| {
                format!(
                    "applied {step} in {:.1} ms, {total} samples",
                    started.elapsed().as_secs_f64() * 1e3
                )
            });
            self.stats.rounds.fetch_add(1, Ordering::Relaxed);
            self.stats
                .round_us
                .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
            self.stats
                .record_round(started.elapsed().as_secs_f64() * 1e3);
        }
        self.service.refresh_status().await;
    }
}

fn decode(frame: &[u8]) -> Option<Vec<f32>> {
    match wire::decode(frame, &Limits::default()).ok()?.data {
        TensorData::F32(v) => Some(v),
        TensorData::U32(_) => None,
    }
}
