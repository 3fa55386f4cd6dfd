//! The averager task of one replica: it owns what the replica knows of its stage's other
//! replicas, takes their messages from a bounded inbox, sends through a bounded outbox,
//! asks [`plan::decide`] what to do on each tick, and runs the rounds ([`round`]) it leads
//! or joins.

use super::plan::{self, Decision, View};
use super::round::{self, Round, Tally};
use super::send::{Abandoned, Bulk, Outgoing};
use super::server::{Inbound, Inbox};
use super::updates::UpdateLog;
use super::{AveragerConfig, AvgStats};
use crate::rng::Rng;
use crate::stage::client::StageClient;
use crate::stage::registry;
use crate::stage::replica::Frozen;
use crate::stage::service::{ReplicaStatus, StageService};
use crate::wire::msg::AvgMsg;
use libp2p::{Multiaddr, PeerId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tracing::Instrument;

/// A replica whose progress has not been heard for this long leaves the views.
const FORGET_AFTER: Duration = Duration::from_secs(60);

/// A `Members` message held for the next step: step, attempt, members, samples lost.
pub(super) type NextMembers = (u64, u32, Vec<PeerId>, u64);

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
    pub(super) base_cfg: AveragerConfig, // `cfg` is it `fitted` to the stage's size
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
    pub(super) log: Arc<parking_lot::Mutex<UpdateLog>>,
    /// The applied step, shared with the server (which refuses parts of other steps).
    pub(super) step: Arc<AtomicU64>,
    pub(super) views: HashMap<PeerId, View>,
    pub(super) known: Vec<PeerId>,
    /// Mates other replicas introduced, and when ([`super::mates`]).
    pub(super) introduced: HashMap<PeerId, Instant>,
    /// Mates that answered from another stage, noted by the senders.
    pub(super) moved: super::send::Moved,
    pub(super) round: Option<Round>,
    /// The step of the latest attempt abandoned at its deadline, and how many in a row.
    pub(super) timed_out: (u64, u32),
    /// What this replica received for its running round.
    pub(super) tally: Option<Tally>,
    /// The sum this replica froze for its running round.
    pub(super) frozen: Option<Frozen>,
    /// Parts of this step (or the next) that came before their round's `Members` (they
    /// keep their share of the inbox's byte budget while they wait).
    pub(super) early: Vec<Inbound>,
    /// A round of the next step whose `Members` came while this replica was still
    /// finishing its step (the leader got its reduced chunks first): joined once this
    /// replica applied its step, instead of ignored (which cost the attempt's timeout).
    pub(super) next_members: Option<NextMembers>,
    /// The step of the last round attempt this replica joined (its frozen sum went out).
    pub(super) joined: Option<u64>,
    /// The step this replica froze its sum for in the last tick: the next one decides.
    pub(super) froze: Option<u64>,
    /// The members of the last round this replica completed (sorted): the next round's
    /// members while none joins or leaves ([`plan::expected_members`]).
    pub(super) last_members: Vec<PeerId>,
    pub(super) last_sent: Option<(u64, u64, u64, u64, u64, String)>,
    pub(super) last_sent_at: Instant,
    /// Progress messages sent since this replica's step last changed.
    pub(super) sent_at_step: u32,
    pub(super) timers: plan::Timers,
    pub(super) started: Instant,
    /// The first lookup of the stage's replicas answered.
    pub(super) looked_up: bool,
    pub(super) stats: Arc<AvgStats>,
    pub(super) rng: Rng,
    /// The checks on members' chunks, and the peers banned from rounds.
    pub(super) guard: super::guard::Guard,
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
        // Membership reads in a row that found no mate not known before.
        let mut quiet = 0;
        // One DHT lookup of the stage's replicas at a time.
        let mut lookup: Option<tokio::task::JoinHandle<()>> = None;
        let cache = registry::AnnCache::new(super::MEMBERSHIP_MAX_AGE)
            .missing_for(super::MEMBERSHIP_MAX_AGE / 10);
        loop {
            tokio::select! {
                m = rx.recv() => match m {
                    Some(m) => self.take(m).await,
                    None => return,
                },
                Some(peers) = mrx.recv() => {
                    // The stage's replicas are its providers now: a replica that died
                    // without a word drops out when its provider record expires (else
                    // heartbeats went to it for ever, a failed dial each).
                    self.looked_up = true;
                    // A mate heard from within its live timeout stays whatever the read
                    // found: in a busy swarm a walk misses some providers, and dropping
                    // them only to find them "new" at the next read kept every replica
                    // of 45 reading at its fastest (~10 provider walks a second at 200).
                    let now = Instant::now();
                    let live = self.cfg.live_timeout;
                    let views = &self.views;
                    self.known.retain(|k| {
                        peers.iter().any(|(p, _)| p == k)
                            || views.get(k).is_some_and(|v| v.is_live(now, live))
                    });
                    quiet += 1;
                    for (p, addrs) in peers {
                        if p != self.me {
                            let _ = self.client.net().add_addresses(p, addrs).await;
                            if !self.known.contains(&p) {
                                self.known.push(p);
                                quiet = 0;
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
            self.forget_moved();
            self.cfg = self.base_cfg.fitted(self.known.len());
            self.stats
                .mates
                .store(self.known.len() as u64, Ordering::Relaxed);
            if self.left {
                // Gone from the stage: answer nothing, start nothing.
                continue;
            }
            let idle = lookup.as_ref().is_none_or(|h| h.is_finished());
            if Instant::now() >= next_membership && idle {
                next_membership = Instant::now()
                    + super::mates::membership_wait(self.cfg.membership_every, quiet);
                lookup = Some(self.look_up_members(&cache, mtx.clone()));
            }
            // A step just frozen is decided on only once what came during the freeze (a
            // large stage's takes seconds) has been read: views of the others as fresh as
            // the messages waiting, and a leader's `Members` waiting here joined rather
            // than led past. (Only then: read in a row at every tick, a round's parts kept
            // the worker thread from its sends, and rounds took ~20% longer.)
            if self.froze.is_some() {
                for _ in 0..super::INBOX {
                    match rx.try_recv() {
                        Ok(m) => self.take(m).await,
                        Err(_) => break,
                    }
                    tokio::task::yield_now().await;
                }
            }
            let span = self.round_span();
            self.tick().instrument(span).await;
        }
    }

    /// One message from the inbox: dropped while its sender is banned or once this
    /// replica left its stage.
    async fn take(&mut self, m: Inbound) {
        if self.guard.is_banned(&m.from, Instant::now()) || self.left {
            return;
        }
        self.moved.clear(&m.from);
        let span = self.round_span();
        self.on_message(m).instrument(span).await;
    }

    /// The running attempt's span (none between attempts).
    fn round_span(&self) -> tracing::Span {
        self.round
            .as_ref()
            .map_or_else(tracing::Span::none, |r| r.span.clone())
    }

    pub(super) fn status(&self) -> ReplicaStatus {
        self.service.status()
    }

    /// Every other replica of the stage this one knows of: announced, or heard from.
    pub(super) fn others(&self) -> Vec<PeerId> {
        let mut out = self.known.clone();
        out.extend(self.views.keys().filter(|p| !self.known.contains(p)));
        out
    }

    pub(super) fn send(&self, peer: PeerId, msg: AvgMsg) {
        self.stats.control_sent.fetch_add(1, Ordering::Relaxed);
        if self.outbox.try_send(Outgoing { peer, msg }).is_err() {
            self.stats.dropped_sends.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(super) fn send_bulk(&self, b: Bulk) {
        if self.bulk.try_send(b).is_err() {
            self.stats.dropped_sends.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Ends the running attempt, `completed` or abandoned: its late parts are refused;
    /// the bulk data of an abandoned one is not sent.
    pub(super) fn end_round(&mut self, completed: bool) {
        if let Some(r) = self.round.take() {
            self.inbox.close(r.key());
            if !completed {
                self.abandoned.add(r.key());
            }
        }
        self.tally = None;
        self.frozen = None;
    }

    /// A debug line of this averager (`RUST_LOG=shoal::averaging=debug`, or `-vv`).
    pub(super) fn debug(&self, what: impl FnOnce() -> String) {
        if tracing::enabled!(target: "shoal::averaging", tracing::Level::DEBUG) {
            let me = self.me.to_string();
            let short = &me[me.len().saturating_sub(6)..];
            tracing::debug!(target: "shoal::averaging", replica = short, stage = self.stage, "{}", what());
        }
    }

    /// Tells the service what the other live replicas at this one's step hold or owe
    /// toward it (stage 0 admits synchronous microbatches by it). A replica still applying
    /// the step before counts as one that will share this step: right after a step, each
    /// replica would otherwise take the whole batch before hearing of the others.
    fn tell_service_others(&self, st: &ReplicaStatus, now: Instant) {
        let s = st.params_step;
        let mut others = crate::stage::sync::Others {
            step: s,
            used: 0,
            replicas: 0,
            behind: 0,
            rank: 0,
        };
        for (p, v) in &self.views {
            if v.is_live(now, self.cfg.live_timeout)
                && (v.params_step == s || v.params_step + 1 == s)
            {
                others.replicas += 1;
                others.used += v.used_at(s);
                others.behind += u64::from(v.params_step + 1 == s);
                others.rank += u64::from(*p < self.me);
            }
        }
        self.service.set_others(others);
        let mates: Vec<PeerId> = self
            .views
            .iter()
            .filter(|(_, v)| v.is_live(now, self.cfg.live_timeout))
            .map(|(p, _)| *p)
            .collect();
        self.service.set_mates(mates);
    }

    async fn tick(&mut self) {
        // A replica not heard from for long is forgotten (any leader counted what it held
        // as lost within seconds); it is heard from again if it is alive.
        let now = Instant::now();
        self.views
            .retain(|_, v| now.saturating_duration_since(v.at) < FORGET_AFTER);
        let st = self.status();
        self.step.store(st.params_step, Ordering::Relaxed);
        self.tell_service_others(&st, now);
        self.heartbeat(&st);
        // Members of the next step that came early: join now that this replica is there.
        match self.next_members.take() {
            Some((step, attempt, members, lost)) if step == st.params_step => {
                self.on_members(step, attempt, members, lost).await;
                return;
            }
            Some(m) if m.0 > st.params_step => self.next_members = Some(m),
            _ => {}
        }
        // Abandon an attempt a member passed by without it: it cannot complete.
        if let (Some(r), Some(t)) = (&self.round, &self.tally) {
            let own = t.layout().chunks(r.index).len();
            let cfg = &self.cfg;
            if let Some(p) =
                plan::passed_by(r.step, &r.members, &r.heard, own, &self.views, now, cfg)
            {
                let (step, attempt) = r.key();
                self.debug(|| {
                    format!("round {step}/{attempt}: member {p} is past step {step} without it: abandoned")
                });
                self.stats.failed_attempts.fetch_add(1, Ordering::Relaxed);
                self.end_round(false);
            }
        }
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
                let (step, n) = (r.step, self.timed_out);
                self.timed_out = (step, if n.0 == step { n.1 + 1 } else { 1 });
                self.end_round(false);
            }
        }
        // Set by the last tick's freeze; spent by this one (a round may have started since).
        let froze = self.froze.take();
        if self.round.is_some() {
            return;
        }
        if plan::batch_full(&self.input(&View::of(&st, now)), now, &self.cfg) {
            // Off the async threads: encoding a large stage's sum takes a while. A failed
            // freeze leaves the sum to the round's own.
            let (service, codec) = (Arc::clone(&self.service), self.cfg.codec);
            let (step, chunk) = (st.params_step, round::chunk_for(self.n));
            let job = tokio::task::spawn_blocking(move || service.freeze(step, chunk, &codec));
            let _ = self.beating(&st, job).await;
            self.debug(|| format!("step {step}'s batch is full: froze {}", st.accum_count));
            let st = self.status();
            self.heartbeat(&st);
            // The freeze may have taken seconds: the next tick decides, once what came
            // meanwhile has been read.
            self.froze = Some(step);
            return;
        }
        if froze == Some(st.params_step) && st.frozen_count > 0 {
            let step = st.params_step;
            // Not the leader, and the leader will lead the last round's members: start
            // that attempt now rather than when its `Members` arrives.
            let mine = View::of(&st, Instant::now());
            let expected = plan::expected_members(
                &self.input(&mine),
                &self.last_members,
                Instant::now(),
                &self.cfg,
            );
            if let Some(members) = expected.filter(|m| {
                m.first() != Some(&self.me) && self.left_lost == 0 && self.joined != Some(step)
            }) {
                let attempt = plan::first_attempt(step);
                self.debug(|| format!("round {step}/{attempt}: the last round's members, not waiting for the leader"));
                self.on_members(step, attempt, members, 0).await;
                return;
            }
        }
        // A banned replica is in no view (forgotten when banned, its messages dropped
        // while the ban lasts), so it is no member, leader or donor of this one.
        let mine = View::of(&st, Instant::now());
        let input = self.input(&mine);
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
                // `lost` counts the samples of replicas that left, as `decide` read them.
                self.left_lost = 0;
                for p in dead {
                    self.views.remove(&p);
                    self.known.retain(|k| *k != p);
                }
                // The attempt the others may have started already, if it is that one.
                let first = lost == 0 && members == self.last_members && self.joined != Some(step);
                let attempt = if first {
                    plan::first_attempt(step)
                } else {
                    plan::other_attempt(self.rng.next_u64())
                };
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

    /// What [`plan`] reads, with `mine` as this replica's status.
    pub(super) fn input<'a>(&'a self, mine: &'a View) -> plan::Input<'a> {
        plan::Input {
            me: self.me,
            mine,
            views: &self.views,
            known: &self.known,
            started: self.started,
            looked_up: self.looked_up,
            behind_since: self.timers.behind_since,
            ready_since: self.timers.ready_since,
            short_since: self.timers.short_since,
            left_lost: self.left_lost,
            ahead: u64::from(self.service.held_ahead()),
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
                owed,
                lost,
                ahead,
            } => {
                if !self.views.contains_key(&from) {
                    self.introduce(from);
                }
                self.views.insert(
                    from,
                    View {
                        params_step,
                        accum_step,
                        count,
                        frozen,
                        hash,
                        uplink,
                        owed,
                        lost,
                        ahead,
                        at: Instant::now(),
                    },
                );
                if !self.known.contains(&from) {
                    self.known.push(from);
                }
            }
            AvgMsg::Mates { peers, addrs } => self.on_mates(&peers, &addrs).await,
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
}
