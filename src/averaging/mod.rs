//! Stage averaging: the replicas of a stage agree on a step, average their gradients with
//! a butterfly all-reduce, and apply the same update, so they stay bit-identical.
//!
//! - [`reduce`]: the pure arithmetic (how the flat gradient is cut, how a part is reduced).
//! - [`sync`]: state download for joiners and for replicas that fell behind.
//! - this module: the averager task of one replica.
//!
//! Protocol (all messages are `Op::Avg` calls between the replicas of one stage):
//! 1. Every replica sends `Progress` (steps, samples accumulated and frozen, parameter hash)
//!    after each backward and as a heartbeat. A replica is live while its progress is fresh.
//! 2. The leader, the live replica with the smallest peer id among those at its step, sees
//!    when the samples accumulated for the step reach `target_batch_size` and sends
//!    `Members` (the sorted member list, and samples lost with replicas that died).
//! 3. Each member freezes its oldest microbatches up to its quota (the leader splits the
//!    target batch fairly over the members' pending samples), cuts their sum into one part
//!    per member and sends part i to member i (`Part`, in the run's gradient codec). Later
//!    backward passes, and microbatches beyond the quota, count toward the next step, so a
//!    gradient is usually one step stale; when twice the target is waiting the round takes
//!    everything to catch up, and a gradient can then be two or more steps stale.
//! 4. Member i sums the parts and divides by the total sample count, encodes the result in
//!    the gradient codec, decodes it again — what every member will apply, itself included
//!    — and sends it to all (`Reduced`).
//! 5. With every reduced part, a member applies the optimizer step.
//!
//! A round that does not finish before its deadline is abandoned; the frozen sums stay, and
//! the leader starts a new attempt with the members still live. A replica that finds
//! itself behind (a peer at a later step, or a different parameter hash at the same step as
//! the leader) downloads the state again ([`sync`]).

pub mod reduce;
pub mod sync;

use crate::rng::Rng;
use crate::stage::client::StageClient;
use crate::stage::registry;
use crate::stage::service::{Inbound, ReplicaStatus, StageService};
use crate::wire::msg::AvgMsg;
use crate::wire::{self, CodecSpec, Limits, TensorData};
use libp2p::{Multiaddr, PeerId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Knobs of the averager.
#[derive(Debug, Clone)]
pub struct AveragerConfig {
    /// Samples per step (the run's `target_batch_size`).
    pub target: u64,
    /// Codec of the parts.
    pub codec: CodecSpec,
    /// Progress is re-sent at least this often.
    pub heartbeat: Duration,
    /// A replica whose progress is older than this is not live.
    pub live_timeout: Duration,
    /// A round attempt not finished by then is abandoned.
    pub round_timeout: Duration,
    /// How often the stage's replicas are re-read from the DHT.
    pub membership_every: Duration,
}

impl AveragerConfig {
    /// Defaults for a run with `target` samples per step and gradient codec `codec`.
    pub fn new(target: u64, codec: CodecSpec) -> Self {
        Self {
            target,
            codec,
            heartbeat: Duration::from_millis(300),
            live_timeout: Duration::from_secs(3),
            round_timeout: Duration::from_secs(5),
            membership_every: Duration::from_secs(2),
        }
    }
}

/// Counters of one averager.
#[derive(Debug, Default)]
pub struct AvgStats {
    /// Steps applied through rounds.
    pub rounds: AtomicU64,
    /// Attempts abandoned at their deadline.
    pub failed_attempts: AtomicU64,
    /// Part and reduced-part bytes sent.
    pub bytes_sent: AtomicU64,
    /// The same values as f32.
    pub raw_bytes: AtomicU64,
    /// State downloads after falling behind.
    pub resyncs: AtomicU64,
    /// Microseconds from freezing to applying, summed over rounds.
    pub round_us: AtomicU64,
    /// Why the last state download failed, if it did.
    pub last_error: std::sync::Mutex<Option<String>>,
}

#[derive(Clone)]
struct View {
    params_step: u64,
    accum_step: u64,
    count: u64,
    frozen: u64,
    hash: String,
    at: Instant,
}

struct Round {
    step: u64,
    attempt: u32,
    members: Vec<PeerId>,
    index: usize,
    lost: u64,
    deadline: Instant,
    reduced_sent: bool,
    started: Instant,
}

type Key = (u64, u32);

/// A running averager. Dropping it stops the task.
pub struct Averager {
    task: tokio::task::JoinHandle<()>,
    stats: Arc<AvgStats>,
    leave: tokio::sync::watch::Sender<bool>,
}

impl Drop for Averager {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Averager {
    /// Starts averaging for `service`'s replica.
    pub fn spawn(
        client: StageClient,
        service: Arc<StageService>,
        cfg: AveragerConfig,
        seed: u64,
    ) -> Self {
        let (tx, rx) = mpsc::channel(256);
        service.attach_averager(tx);
        let stats = Arc::new(AvgStats::default());
        let me = client.local_peer_id();
        let n = service.numel();
        let st = State {
            me,
            stage: service.stage(),
            n,
            cfg,
            client,
            service,
            views: HashMap::new(),
            known: Vec::new(),
            round: None,
            parts: HashMap::new(),
            reduced: HashMap::new(),
            last_sent: None,
            last_sent_at: Instant::now(),
            behind_since: None,
            ready_since: None,
            started: Instant::now(),
            stats: Arc::clone(&stats),
            rng: Rng::new(seed),
            left: false,
            left_lost: 0,
        };
        let (leave, leave_rx) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(st.run(rx, leave_rx));
        Self { task, stats, leave }
    }

    /// Tells the stage's other replicas that this one leaves (they forget it at once
    /// instead of waiting for its progress to go stale), and stops taking part in rounds.
    pub fn leave(&self) {
        let _ = self.leave.send(true);
    }

    /// The averager's counters.
    pub fn stats(&self) -> &Arc<AvgStats> {
        &self.stats
    }
}

struct State {
    /// This replica announced that it leaves.
    left: bool,
    /// Samples replicas said they held when they left, to count as lost in the next round.
    left_lost: u64,
    me: PeerId,
    stage: usize,
    n: usize,
    cfg: AveragerConfig,
    client: StageClient,
    service: Arc<StageService>,
    views: HashMap<PeerId, View>,
    known: Vec<PeerId>,
    round: Option<Round>,
    parts: HashMap<Key, HashMap<PeerId, (Vec<f32>, u64)>>,
    reduced: HashMap<Key, HashMap<u32, (Vec<f32>, u64)>>,
    last_sent: Option<(u64, u64, u64, u64, String)>,
    last_sent_at: Instant,
    behind_since: Option<Instant>,
    ready_since: Option<Instant>,
    started: Instant,
    stats: Arc<AvgStats>,
    rng: Rng,
}

impl State {
    async fn run(
        mut self,
        mut rx: mpsc::Receiver<Inbound>,
        mut leave: tokio::sync::watch::Receiver<bool>,
    ) {
        let progress = self.service.progress();
        let (mtx, mut mrx) = mpsc::channel::<Vec<(PeerId, Vec<Multiaddr>)>>(1);
        let mut next_membership = Instant::now();
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
            if Instant::now() >= next_membership {
                next_membership = Instant::now() + self.cfg.membership_every;
                let net = self.client.net().clone();
                let (run, stage, tx) = (self.client.run().to_string(), self.stage, mtx.clone());
                tokio::spawn(async move {
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
                });
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

    fn live(&self) -> impl Iterator<Item = (&PeerId, &View)> {
        let t = self.cfg.live_timeout;
        self.views.iter().filter(move |(_, v)| v.at.elapsed() < t)
    }

    fn send(&self, peer: PeerId, msg: AvgMsg, frame: Option<Vec<u8>>) {
        let client = self.client.clone();
        let stage = self.stage;
        let debug = std::env::var_os("SHOAL_DEBUG_AVG").is_some();
        // Progress is repeated by the heartbeat anyway; round messages are retried, since a
        // lost part stalls the round until its deadline.
        let tries = if matches!(msg, AvgMsg::Progress { .. }) {
            1
        } else {
            4
        };
        tokio::spawn(async move {
            for i in 0..tries {
                match client
                    .send_avg(peer, stage, msg.clone(), frame.clone())
                    .await
                {
                    Ok(()) => return,
                    Err(e) => {
                        if debug {
                            eprintln!("avg send to {peer} failed (try {i}): {e}");
                        }
                        tokio::time::sleep(Duration::from_millis(50 << i)).await;
                    }
                }
            }
        });
    }

    fn debug(&self, what: impl FnOnce() -> String) {
        if std::env::var_os("SHOAL_DEBUG_AVG").is_some() {
            eprintln!(
                "avg {} s{}: {}",
                &self.me.to_string()[46..],
                self.stage,
                what()
            );
        }
    }

    async fn tick(&mut self) {
        let st = self.status();
        // Progress: on change, or as a heartbeat.
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
            };
            for p in self.others() {
                self.send(p, msg.clone(), None);
            }
            self.last_sent = Some(now_sig);
            self.last_sent_at = Instant::now();
        }
        // Abandon a round past its deadline (frozen sums stay for the next attempt).
        if let Some(r) = &self.round {
            if Instant::now() > r.deadline {
                let have = self
                    .reduced
                    .get(&(r.step, r.attempt))
                    .map_or(0, |m| m.len());
                let parts = self.parts.get(&(r.step, r.attempt)).map_or(0, |m| m.len());
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
        // Behind? A live peer at a later step, or the leader's hash differs at our step.
        let ahead = self
            .live()
            .filter(|(_, v)| v.params_step > st.params_step)
            .map(|(p, _)| *p)
            .collect::<Vec<_>>();
        let same: Vec<(PeerId, View)> = self
            .live()
            .filter(|(_, v)| v.params_step == st.params_step)
            .map(|(p, v)| (*p, v.clone()))
            .collect();
        let leader = same
            .iter()
            .map(|(p, _)| *p)
            .chain(std::iter::once(self.me))
            .min();
        let diverged = same
            .iter()
            .any(|(p, v)| Some(*p) == leader && *p < self.me && v.hash != st.params_hash);
        if !ahead.is_empty() || diverged {
            self.debug(|| format!("behind: ahead {} diverged {diverged}", ahead.len()));
            let since = *self.behind_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= self.cfg.heartbeat * 2 {
                let donors = if ahead.is_empty() {
                    leader.into_iter().collect()
                } else {
                    let top = self.live().map(|(_, v)| v.params_step).max().unwrap_or(0);
                    self.live()
                        .filter(|(_, v)| v.params_step == top)
                        .map(|(p, _)| *p)
                        .collect::<Vec<_>>()
                };
                self.resync(&donors).await;
                self.behind_since = None;
            }
            return;
        }
        self.behind_since = None;
        if leader != Some(self.me) {
            return;
        }
        if st.accum_count + st.frozen_count >= self.cfg.target {
            self.debug(|| {
                format!(
                    "leader at {} same {} known {} views {}",
                    st.params_step,
                    same.len(),
                    self.known.len(),
                    self.views.len()
                )
            });
        }
        let s = st.params_step;
        let mut total = if st.accum_step == s {
            st.accum_count
        } else {
            0
        } + st.frozen_count;
        for (_, v) in &same {
            total += if v.accum_step == s { v.count } else { 0 } + v.frozen;
        }
        if total < self.cfg.target.max(1) {
            self.ready_since = None;
            return;
        }
        let ready = *self.ready_since.get_or_insert_with(Instant::now);
        // Wait a little for replicas that are catching up (behind us, downloading state) and,
        // at start, for every known replica to be heard from: a round without them would
        // leave them behind again.
        let grace = self.cfg.heartbeat * 5;
        let lagging = self.live().any(|(_, v)| v.params_step < st.params_step);
        let unheard = self.known.iter().any(|p| !self.views.contains_key(p));
        if (lagging || (unheard && self.started.elapsed() < self.cfg.live_timeout))
            && ready.elapsed() < grace
        {
            return;
        }
        if ready.elapsed() > Duration::from_millis(100) {
            self.debug(|| {
                format!(
                    "round {s} waited {:.0} ms (lagging {lagging})",
                    ready.elapsed().as_secs_f64() * 1e3
                )
            });
        }
        self.ready_since = None;
        // Samples held by replicas that died at this step are lost; count them once.
        // (A replica that died holding gradients of an earlier step lost them too.)
        let dead: Vec<PeerId> = self
            .views
            .iter()
            .filter(|(_, v)| v.at.elapsed() >= self.cfg.live_timeout && v.params_step <= s)
            .map(|(p, _)| *p)
            .collect();
        let mut lost = std::mem::take(&mut self.left_lost);
        for p in dead {
            if let Some(v) = self.views.remove(&p) {
                lost += v.count + v.frozen;
            }
            self.known.retain(|k| *k != p);
        }
        let mut members: Vec<PeerId> = same.iter().map(|(p, _)| *p).collect();
        members.push(self.me);
        members.sort();
        // Quotas: the target batch, taken from the members' pending samples in order. When
        // rounds fall behind (twice the target waiting), take everything to catch up.
        let pending_of = |p: &PeerId| -> u64 {
            if *p == self.me {
                (if st.accum_step == s {
                    st.accum_count
                } else {
                    0
                }) + st.frozen_count
            } else {
                same.iter().find(|(q, _)| q == p).map_or(0, |(_, v)| {
                    (if v.accum_step == s { v.count } else { 0 }) + v.frozen
                })
            }
        };
        let target = self.cfg.target.max(1);
        let mut left = if total >= 2 * target { total } else { target };
        // Fair shares: smallest pending first, each taking at most an equal share of what
        // is left, so no replica's samples wait behind another's (staleness).
        let pend: Vec<u64> = members.iter().map(pending_of).collect();
        let mut order: Vec<usize> = (0..members.len()).collect();
        order.sort_by_key(|&i| pend[i]);
        let mut quotas = vec![0u64; members.len()];
        for (k, &i) in order.iter().enumerate() {
            let share = left.div_ceil((members.len() - k) as u64);
            quotas[i] = pend[i].min(share);
            left -= quotas[i];
        }
        let attempt = self.rng.next_u64() as u32;
        self.debug(|| {
            format!(
                "round {s}/{attempt} members {} total {total}",
                members.len()
            )
        });
        let msg = AvgMsg::Members {
            step: s,
            attempt,
            members: members.iter().map(|p| p.to_string()).collect(),
            quotas: quotas.clone(),
            lost,
        };
        for &p in &members {
            if p != self.me {
                self.send(p, msg.clone(), None);
            }
        }
        self.on_members(s, attempt, members, quotas, lost).await;
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
                self.parts.clear();
                self.reduced.clear();
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
            } => {
                self.views.insert(
                    from,
                    View {
                        params_step,
                        accum_step,
                        count,
                        frozen,
                        hash,
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
                    self.on_members(step, attempt, members, quotas, lost).await;
                }
            }
            AvgMsg::Part {
                step,
                attempt,
                count,
            } => {
                if let Some(v) = frames.first().and_then(|f| decode(f)) {
                    self.parts
                        .entry((step, attempt))
                        .or_default()
                        .insert(from, (v, count));
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
                    self.reduced
                        .entry((step, attempt))
                        .or_default()
                        .insert(index, (v, total));
                    self.try_complete().await;
                }
            }
        }
    }

    async fn on_members(
        &mut self,
        step: u64,
        attempt: u32,
        members: Vec<PeerId>,
        quotas: Vec<u64>,
        lost: u64,
    ) {
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
        if let Some(r) = &self.round {
            if r.step == step && r.attempt == attempt {
                return;
            }
        }
        let quota = quotas.get(index).copied().unwrap_or(u64::MAX);
        let frozen = self.service.freeze(step, quota);
        let Ok(frozen) = frozen else {
            self.debug(|| format!("freeze {step} failed"));
            return;
        };
        self.round = Some(Round {
            step,
            attempt,
            members: members.clone(),
            index,
            lost,
            deadline: Instant::now() + self.cfg.round_timeout,
            reduced_sent: false,
            started: Instant::now(),
        });
        let ranges = reduce::partition(frozen.sum.len(), members.len());
        for (i, (&p, range)) in members.iter().zip(ranges).enumerate() {
            let part = &frozen.sum[range];
            if i == index {
                self.parts
                    .entry((step, attempt))
                    .or_default()
                    .insert(self.me, (part.to_vec(), frozen.count));
                continue;
            }
            let mut frame = Vec::new();
            if wire::encode_f32(&[part.len()], part, &self.cfg.codec, &mut frame).is_ok() {
                self.stats
                    .bytes_sent
                    .fetch_add(frame.len() as u64, Ordering::Relaxed);
                self.stats
                    .raw_bytes
                    .fetch_add(4 * part.len() as u64, Ordering::Relaxed);
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

    fn try_reduce(&mut self) {
        let Some(r) = &self.round else { return };
        if r.reduced_sent {
            return;
        }
        let key = (r.step, r.attempt);
        let Some(parts) = self.parts.get(&key) else {
            return;
        };
        if !r.members.iter().all(|m| parts.contains_key(m)) {
            return;
        }
        let len = reduce::partition(self.n, r.members.len())[r.index].len();
        let sums: Vec<(&[f32], u64)> = r
            .members
            .iter()
            .filter_map(|m| parts.get(m).map(|(v, c)| (v.as_slice(), *c)))
            .collect();
        if sums.iter().any(|(v, _)| v.len() != len) {
            return;
        }
        let (avg, total) = reduce::reduce_part(&sums, len);
        let mut frame = Vec::new();
        if wire::encode_f32(&[avg.len()], &avg, &self.cfg.codec, &mut frame).is_err() {
            return;
        }
        // Apply exactly what the others will decode.
        let Some(exact) = decode(&frame) else { return };
        let (step, attempt, index) = (r.step, r.attempt, r.index as u32);
        let others: Vec<PeerId> = r
            .members
            .iter()
            .copied()
            .filter(|m| *m != self.me)
            .collect();
        for p in others {
            self.stats
                .bytes_sent
                .fetch_add(frame.len() as u64, Ordering::Relaxed);
            self.stats
                .raw_bytes
                .fetch_add(4 * avg.len() as u64, Ordering::Relaxed);
            let msg = AvgMsg::Reduced {
                step,
                attempt,
                index,
                total,
            };
            self.send(p, msg, Some(frame.clone()));
        }
        self.reduced
            .entry(key)
            .or_default()
            .insert(index, (exact, total));
        if let Some(r) = &mut self.round {
            r.reduced_sent = true;
        }
    }

    async fn try_complete(&mut self) {
        let Some(r) = &self.round else { return };
        let key = (r.step, r.attempt);
        let Some(red) = self.reduced.get(&key) else {
            return;
        };
        let k = r.members.len();
        if red.len() < k {
            return;
        }
        let ranges = reduce::partition(self.n, k);
        let mut avg = Vec::with_capacity(self.n);
        let mut total = 0;
        for (i, range) in ranges.iter().enumerate() {
            match red.get(&(i as u32)) {
                Some((v, t)) if v.len() == range.len() => {
                    avg.extend_from_slice(v);
                    total = *t;
                }
                _ => return,
            }
        }
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
        self.parts.retain(|(s, _), _| *s > step);
        self.reduced.retain(|(s, _), _| *s > step);
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
