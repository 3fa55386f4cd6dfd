//! The averager task of one replica: it owns what the replica knows of its stage's other
//! replicas, takes their messages from a bounded inbox, sends through a bounded outbox,
//! asks [`plan::decide`] what to do on each tick, and runs the rounds ([`round`]) it leads
//! or joins.

use super::plan::{self, Decision, View};
use super::round::{self, Key, Layout, Round, Taken, Tally, PART_CHUNK};
use super::server::{Inbound, Inbox};
use super::sync;
use super::updates::{self, UpdateLog};
use super::{AveragerConfig, AvgStats};
use crate::rng::Rng;
use crate::stage::client::StageClient;
use crate::stage::registry;
use crate::stage::replica::Frozen;
use crate::stage::service::{ReplicaStatus, StageService};
use crate::wire::msg::{AvgMsg, ErrorKind};
use crate::wire::{self, CodecSpec, Limits};
use futures::StreamExt;
use libp2p::{Multiaddr, PeerId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Control messages waiting to be sent; beyond this, new ones are dropped (and counted):
/// progress is repeated by the heartbeat, and a round that loses a message retries at its
/// deadline.
pub(super) const OUTBOX: usize = 1024;

/// Bulk jobs (a round's parts, reduced chunks) waiting to be sent. A round queues one job
/// for its parts and one per reduced chunk of its own part.
pub(super) const BULK_OUTBOX: usize = 8192;

/// Messages being sent at once, per sender.
const SENDS_IN_FLIGHT: usize = 32;

/// A control message to one replica (never behind a round's bulk data).
pub(super) struct Outgoing {
    peer: PeerId,
    msg: AvgMsg,
}

/// Bulk data of a round.
pub(super) enum Bulk {
    /// This replica's sum, cut into the members' parts and sent chunk by chunk, encoded
    /// just before each chunk is sent (so the encoded parts are never all in memory).
    Parts {
        key: Key,
        count: u64,
        sum: Arc<Vec<f32>>,
        layout: Layout,
        /// (member index, peer) of every other member.
        to: Vec<(usize, PeerId)>,
    },
    /// One reduced chunk, to every other member.
    Reduced {
        key: Key,
        msg: AvgMsg,
        frame: Arc<Vec<u8>>,
        to: Vec<PeerId>,
    },
}

/// What a bulk job sends.
enum Payload {
    Frame(Arc<Vec<u8>>),
    Encode {
        sum: Arc<Vec<f32>>,
        range: std::ops::Range<usize>,
    },
}

/// One call of a bulk job.
struct Job {
    key: Key,
    peer: PeerId,
    msg: AvgMsg,
    payload: Payload,
}

impl Bulk {
    /// Its calls, the parts' chunks taken round-robin over the members.
    fn jobs(self) -> Vec<Job> {
        match self {
            Bulk::Parts {
                key,
                count,
                sum,
                layout,
                to,
            } => {
                let most = to.iter().map(|(i, _)| layout.chunks(*i)).max().unwrap_or(0);
                let mut out = Vec::new();
                for c in 0..most {
                    for &(i, peer) in &to {
                        if let Some(range) = layout.range(i, c) {
                            out.push(Job {
                                key,
                                peer,
                                msg: AvgMsg::Part {
                                    step: key.0,
                                    attempt: key.1,
                                    count,
                                    chunk: c,
                                },
                                payload: Payload::Encode {
                                    sum: Arc::clone(&sum),
                                    range,
                                },
                            });
                        }
                    }
                }
                out
            }
            Bulk::Reduced {
                key,
                msg,
                frame,
                to,
            } => to
                .into_iter()
                .map(|peer| Job {
                    key,
                    peer,
                    msg: msg.clone(),
                    payload: Payload::Frame(Arc::clone(&frame)),
                })
                .collect(),
        }
    }
}

/// Frames at least this long time the uplink (shorter ones mostly time the round trip).
const MEASURED_FRAME: usize = 64 << 10;

/// Measures the uplink while bulk data is being sent: bytes completed over the time some
/// were in flight (with many calls in flight, one call's time says little).
#[derive(Default)]
struct Meter {
    in_flight: usize,
    since: Option<Instant>,
    bytes: u64,
}

impl Meter {
    fn start(&mut self) {
        if self.in_flight == 0 {
            self.since = Some(Instant::now());
            self.bytes = 0;
        }
        self.in_flight += 1;
    }

    /// A call of `bytes` ended (sent, or not); folds a rate into `avg` every second of
    /// busy time and when the link goes idle.
    fn end(&mut self, bytes: u64, avg: &AtomicU64) {
        self.in_flight = self.in_flight.saturating_sub(1);
        self.bytes += bytes;
        let Some(since) = self.since else { return };
        let took = since.elapsed();
        if (self.in_flight == 0 || took >= Duration::from_secs(1))
            && self.bytes >= MEASURED_FRAME as u64
            && took >= Duration::from_millis(20)
        {
            fold_rate(avg, self.bytes as usize, took);
            self.since = Some(Instant::now());
            self.bytes = 0;
        }
        if self.in_flight == 0 {
            self.since = None;
        }
    }
}

/// Folds a measured rate into the moving average in `avg` (bytes/s).
fn fold_rate(avg: &AtomicU64, bytes: usize, took: Duration) {
    let rate = (bytes as f64 / took.as_secs_f64().max(1e-6)) as u64;
    let old = avg.load(Ordering::Relaxed);
    let new = if old == 0 { rate } else { (3 * old + rate) / 4 };
    avg.store(new.max(1), Ordering::Relaxed);
}

fn debug_avg() -> bool {
    std::env::var_os("SHOAL_DEBUG_AVG").is_some()
}

/// Sends one message, retrying a round message (a lost one stalls the round until its
/// deadline) while `live` says its attempt runs; true if it got through.
async fn send_one(
    client: &StageClient,
    stage: usize,
    peer: PeerId,
    msg: &AvgMsg,
    frame: Option<&[u8]>,
    live: impl Fn() -> bool,
) -> bool {
    let tries = if matches!(msg, AvgMsg::Progress { .. }) {
        1
    } else {
        8
    };
    for i in 0..tries {
        if !live() {
            return false;
        }
        match client.send_avg(peer, stage, msg.clone(), frame).await {
            Ok(()) => return true,
            // A part for a round that is over: sending it again cannot help.
            Err(e) if e.kind() == Some(ErrorKind::StaleStep) => return false,
            Err(e) => {
                if debug_avg() {
                    eprintln!("avg send to {peer} failed (try {i}): {e}");
                }
                tokio::time::sleep(Duration::from_millis((50u64 << i).min(1000))).await;
            }
        }
    }
    false
}

/// Sends the control outbox's messages, at most [`SENDS_IN_FLIGHT`] at once; ends when the
/// averager drops its side.
pub(super) async fn sender(client: StageClient, stage: usize, rx: mpsc::Receiver<Outgoing>) {
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) })
        .for_each_concurrent(SENDS_IN_FLIGHT, |o| {
            let client = client.clone();
            async move {
                send_one(&client, stage, o.peer, &o.msg, None, || true).await;
            }
        })
        .await;
}

/// Attempts abandoned (the newest few), shared by the averager and its bulk sender.
#[derive(Clone, Default)]
pub(super) struct Abandoned(Arc<std::sync::Mutex<std::collections::VecDeque<Key>>>);

impl Abandoned {
    fn add(&self, key: Key) {
        if let Ok(mut a) = self.0.lock() {
            a.push_back(key);
            while a.len() > 16 {
                a.pop_front();
            }
        }
    }

    fn has(&self, key: Key) -> bool {
        self.0.lock().map(|a| a.contains(&key)).unwrap_or(false)
    }
}

/// Sends the rounds' bulk data, at most [`SENDS_IN_FLIGHT`] calls at once, skipping jobs of
/// abandoned attempts, measuring the uplink into `stats`; ends when the averager drops its
/// side.
pub(super) async fn bulk_sender(
    client: StageClient,
    stage: usize,
    codec: CodecSpec,
    rx: mpsc::Receiver<Bulk>,
    abandoned: Abandoned,
    stats: Arc<AvgStats>,
) {
    let meter = Arc::new(std::sync::Mutex::new(Meter::default()));
    let is_live = move |key: Key| !abandoned.has(key);
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) })
        .flat_map(|b| futures::stream::iter(b.jobs()))
        .for_each_concurrent(SENDS_IN_FLIGHT, |job| {
            let (client, stats, meter) = (client.clone(), Arc::clone(&stats), Arc::clone(&meter));
            let is_live = is_live.clone();
            async move {
                if !is_live(job.key) {
                    return;
                }
                let frame = match job.payload {
                    Payload::Frame(f) => f,
                    Payload::Encode { sum, range } => {
                        let mut f = Vec::new();
                        let part = &sum[range];
                        if wire::encode_f32(&[part.len()], part, &codec, &mut f).is_err() {
                            return;
                        }
                        Arc::new(f)
                    }
                };
                let floats = wire::header::parse_header(&frame, &Limits::default())
                    .map_or(0, |(h, _)| h.elements());
                if let Ok(mut m) = meter.lock() {
                    m.start();
                }
                let ok = send_one(&client, stage, job.peer, &job.msg, Some(&frame), || {
                    is_live(job.key)
                })
                .await;
                let sent = if ok { frame.len() as u64 } else { 0 };
                if let Ok(mut m) = meter.lock() {
                    m.end(sent, &stats.uplink);
                }
                if ok {
                    stats.bytes_sent.fetch_add(sent, Ordering::Relaxed);
                    stats
                        .raw_bytes
                        .fetch_add(4 * floats as u64, Ordering::Relaxed);
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
    /// The rounds' bulk data.
    pub(super) bulk: mpsc::Sender<Bulk>,
    /// Attempts abandoned, shared with the bulk sender (which skips their jobs; those of
    /// an attempt this replica completed still go: the others may need them).
    pub(super) abandoned: Abandoned,
    /// The inbox's shared state (attempts that are over are refused there).
    pub(super) inbox: Inbox,
    /// The updates applied last, served to replicas catching up.
    pub(super) log: Arc<std::sync::Mutex<UpdateLog>>,
    /// The applied step, shared with the server (which refuses parts of other steps).
    pub(super) step: Arc<AtomicU64>,
    pub(super) views: HashMap<PeerId, View>,
    pub(super) known: Vec<PeerId>,
    pub(super) round: Option<Round>,
    /// What this replica received for its running round.
    pub(super) tally: Option<Tally>,
    /// The sum this replica froze for its running round.
    pub(super) frozen: Option<Frozen>,
    /// Parts of this step that came before their round's `Members` (they keep their
    /// share of the inbox's byte budget while they wait).
    pub(super) early: Vec<Inbound>,
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
                    Some(m) if !self.left => self.on_message(m).await,
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
                            self.send(p, msg.clone());
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

    fn send(&self, peer: PeerId, msg: AvgMsg) {
        if self.outbox.try_send(Outgoing { peer, msg }).is_err() {
            self.stats.dropped_sends.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn send_bulk(&self, b: Bulk) {
        if self.bulk.try_send(b).is_err() {
            self.stats.dropped_sends.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Ends the running attempt, `completed` or abandoned: its late parts are refused;
    /// the bulk data of an abandoned one is not sent.
    fn end_round(&mut self, completed: bool) {
        if let Some(r) = self.round.take() {
            self.inbox.close(r.key());
            if !completed {
                self.abandoned.add(r.key());
            }
        }
        self.tally = None;
        self.frozen = None;
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
                self.send(p, msg.clone());
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
                let (partial, missing) = self.tally.as_ref().map_or((0, 0), Tally::counts);
                self.debug(|| {
                    format!(
                        "round {}/{} timed out: {partial} chunks being reduced, {missing} reduced chunks missing, {} members",
                        r.step,
                        r.attempt,
                        r.members.len()
                    )
                });
                self.stats.failed_attempts.fetch_add(1, Ordering::Relaxed);
                self.end_round(false);
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
                        self.send(p, msg.clone());
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
        // Replaying the updates missed moves a twelfth of the state per step (int8):
        // first that, then the whole state if the donors do not keep them.
        let replica = self.service.replica();
        let replayed = updates::catch_up(&self.client, self.stage, donors, &replica).await;
        if let Ok(n) = replayed {
            if n > 0 {
                self.debug(|| format!("caught up by replaying {n} update(s)"));
                self.stats.replays.fetch_add(n, Ordering::Relaxed);
                self.service.refresh_status().await;
                self.end_round(false);
                self.early.clear();
                return;
            }
        }
        let len = self.n * 3;
        let r = sync::download(&self.client, self.stage, donors, len, &mut self.rng).await;
        if let Err(e) = &r {
            if let Ok(mut g) = self.stats.last_error.lock() {
                *g = Some(e.to_string());
            }
        }
        if let Ok((snap, _)) = r {
            let r2 = Arc::clone(&replica);
            let ok = tokio::task::spawn_blocking(move || {
                r2.blocking_lock()
                    .restore(&snap)
                    .map(|_| ())
                    .map_err(|_| ())
            })
            .await;
            if matches!(ok, Ok(Ok(()))) {
                self.stats.resyncs.fetch_add(1, Ordering::Relaxed);
                // The download took time: replay what the donors applied meanwhile.
                if let Ok(n) = updates::catch_up(&self.client, self.stage, donors, &replica).await {
                    self.stats.replays.fetch_add(n, Ordering::Relaxed);
                }
                self.service.refresh_status().await;
                self.end_round(false);
                self.early.clear();
            }
        }
    }

    async fn on_message(&mut self, m: Inbound) {
        let Inbound {
            from,
            msg,
            frames,
            permit,
        } = m;
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
            AvgMsg::Part { .. } | AvgMsg::Reduced { .. } => {
                self.on_round_data(Inbound {
                    from,
                    msg,
                    frames,
                    permit,
                })
                .await;
            }
        }
    }

    /// A part or reduced chunk: taken if it is for the running attempt, kept for later if
    /// it is for this step and came before its `Members`, else dropped.
    async fn on_round_data(&mut self, m: Inbound) {
        let key = match &m.msg {
            AvgMsg::Part { step, attempt, .. } | AvgMsg::Reduced { step, attempt, .. } => {
                (*step, *attempt)
            }
            _ => return,
        };
        if self.tally.as_ref().map(Tally::key) != Some(key) {
            if key.0 == self.status().params_step {
                self.early.push(m);
            }
            return;
        }
        let Some(frame) = m.frames.into_iter().next() else {
            return;
        };
        match m.msg {
            AvgMsg::Part { count, chunk, .. } => self.on_part(m.from, chunk, count, &frame),
            AvgMsg::Reduced {
                index,
                total,
                chunk,
                ..
            } => {
                if let Some(t) = &mut self.tally {
                    t.add_reduced(index as usize, chunk, Arc::new(frame), total);
                }
            }
            _ => {}
        }
        self.try_complete().await;
    }

    /// Chunk `chunk` of member `from`'s sum for this replica's part.
    fn on_part(&mut self, from: PeerId, chunk: u32, count: u64, frame: &[u8]) {
        let (Some(r), Some(frozen)) = (&self.round, &self.frozen) else {
            return;
        };
        let Some(m) = r.members.iter().position(|p| *p == from) else {
            return;
        };
        let Some(range) = self
            .tally
            .as_ref()
            .and_then(|t| t.layout().range(r.index, chunk))
        else {
            return;
        };
        let mut values = Vec::new();
        if wire::decode_f32_into(frame, &Limits::default(), &mut values).is_err() {
            return;
        }
        let own = (&frozen.sum[range], frozen.count);
        let taken = match &mut self.tally {
            Some(t) => t.add_part(m, chunk, count, &values, own),
            None => return,
        };
        self.on_taken(taken);
    }

    /// Sends a reduced chunk of this replica's part to the others and keeps it.
    fn on_taken(&mut self, taken: Taken) {
        let Taken::Reduced { chunk, avg, total } = taken else {
            if let Taken::Refused(why) = taken {
                self.debug(|| format!("part chunk refused: {why}"));
            }
            return;
        };
        let Some(r) = &self.round else { return };
        let mut frame = Vec::new();
        if wire::encode_f32(&[avg.len()], &avg, &self.cfg.codec, &mut frame).is_err() {
            return;
        }
        let frame = Arc::new(frame);
        let (key, index) = (r.key(), r.index as u32);
        let to: Vec<PeerId> = r
            .members
            .iter()
            .copied()
            .filter(|m| *m != self.me)
            .collect();
        let msg = AvgMsg::Reduced {
            step: key.0,
            attempt: key.1,
            index,
            total,
            chunk,
        };
        if let Some(t) = &mut self.tally {
            // Every member, this one too, applies exactly what was encoded.
            t.add_reduced(index as usize, chunk, Arc::clone(&frame), total);
        }
        if !to.is_empty() {
            self.send_bulk(Bulk::Reduced {
                key,
                msg,
                frame,
                to,
            });
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
        // A new attempt replaces any other.
        self.end_round(false);
        let layout = Layout::new(frozen.sum.len(), members.len(), PART_CHUNK);
        self.round = Some(Round {
            step,
            attempt,
            members: members.clone(),
            index,
            lost,
            deadline: Instant::now() + timeout,
            started: Instant::now(),
        });
        self.tally = Some(Tally::new(key, layout.clone(), index));
        let to: Vec<(usize, PeerId)> = members
            .iter()
            .copied()
            .enumerate()
            .filter(|(i, _)| *i != index)
            .collect();
        if to.is_empty() {
            // A round of one: its own sum is the average.
            for c in 0..layout.chunks(index) {
                let Some(range) = layout.range(index, c) else {
                    continue;
                };
                let taken = match &mut self.tally {
                    Some(t) => t.reduce_alone(c, (&frozen.sum[range], frozen.count)),
                    None => continue,
                };
                self.on_taken(taken);
            }
        } else {
            self.send_bulk(Bulk::Parts {
                key,
                count: frozen.count,
                sum: Arc::clone(&frozen.sum),
                layout,
                to,
            });
        }
        self.frozen = Some(frozen);
        // Parts that came before this round's members.
        let early = std::mem::take(&mut self.early);
        for m in early {
            let k = match &m.msg {
                AvgMsg::Part { step, attempt, .. } | AvgMsg::Reduced { step, attempt, .. } => {
                    (*step, *attempt)
                }
                _ => continue,
            };
            if k == key {
                self.on_round_data(m).await;
            } else if k.0 == step {
                self.early.push(m);
            }
        }
        self.try_complete().await;
    }

    async fn try_complete(&mut self) {
        let (Some(r), Some(t)) = (&self.round, &mut self.tally) else {
            return;
        };
        let Some((chunks, total)) = t.take_reduced() else {
            return;
        };
        let (step, lost, started, n) = (r.step, r.lost, r.started, self.n);
        let took = started.elapsed();
        // Communication is over: the frozen sum is no longer needed.
        self.end_round(true);
        self.early.retain(|m| {
            !matches!(&m.msg, AvgMsg::Part { step: s, .. } | AvgMsg::Reduced { step: s, .. } if *s <= step)
        });
        let replica = self.service.replica();
        let log = Arc::clone(&self.log);
        let applied = tokio::task::spawn_blocking(move || {
            let avg = round::Frames::new(chunks, n)?;
            let mut r = replica.blocking_lock();
            r.apply(step, &avg, total, lost)
                .map_err(|e| e.to_string())?;
            // Kept for replicas that catch up (losing it only costs them a download).
            if let Ok(mut l) = log.lock() {
                let _ = l.record(step, total, lost, r.params_hash(), avg.chunks());
            }
            Ok::<(), String>(())
        })
        .await;
        match applied {
            Ok(Ok(())) => {
                self.debug(|| {
                    format!(
                        "applied {step}: averaged in {:.1} ms, applied after {:.1} ms, {total} samples",
                        took.as_secs_f64() * 1e3,
                        started.elapsed().as_secs_f64() * 1e3
                    )
                });
                self.stats.rounds.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .round_us
                    .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
                self.stats.record_round(took.as_secs_f64() * 1e3);
            }
            Ok(Err(e)) => self.debug(|| format!("step {step} not applied: {e}")),
            Err(e) => self.debug(|| format!("step {step} not applied: {e}")),
        }
        self.service.refresh_status().await;
        self.step
            .store(self.status().params_step, Ordering::Relaxed);
    }
}
