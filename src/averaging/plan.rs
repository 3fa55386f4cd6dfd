//! The averager's decisions, as pure functions of what a replica knows (its own status and
//! the progress it heard from the others), the time and the config: whether it is behind
//! and must download state, and whether it leads a round now (with whom). No sockets, no clock reads: tests drive them with made-up
//! views and instants.

use super::AveragerConfig;
use crate::stage::service::ReplicaStatus;
use libp2p::PeerId;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// What a replica last said about itself (its `Progress` message), and when it was heard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct View {
    /// Applied optimizer steps.
    pub params_step: u64,
    /// The step its accumulated samples count toward.
    pub accum_step: u64,
    /// Samples accumulated.
    pub count: u64,
    /// Samples frozen for a round in progress.
    pub frozen: u64,
    /// Parameter hash.
    pub hash: String,
    /// Its measured uplink for averaging parts, bytes/s (0: unknown).
    pub uplink: u64,
    /// Samples of synchronous microbatches owed toward `accum_step`.
    pub owed: u64,
    /// Samples of `params_step`'s batch it saw die or leave with other replicas.
    pub lost: u64,
    /// Synchronous calls held there for a step after `params_step`.
    pub ahead: u64,
    /// When it was heard.
    pub at: Instant,
}

impl View {
    /// This replica's own status as a view heard at `at`.
    pub fn of(st: &ReplicaStatus, at: Instant) -> Self {
        Self {
            params_step: st.params_step,
            accum_step: st.accum_step,
            count: st.accum_count,
            frozen: st.frozen_count,
            hash: st.shared_hash.clone(),
            uplink: 0,
            owed: st.owed_count,
            lost: 0,
            ahead: 0,
            at,
        }
    }

    /// Samples it holds toward step `step`: accumulated for it, plus frozen.
    pub fn pending_at(&self, step: u64) -> u64 {
        (if self.accum_step == step {
            self.count
        } else {
            0
        }) + self.frozen
    }

    /// Samples it holds or owes toward `step` (what stage 0's admission counts as taken).
    pub fn used_at(&self, step: u64) -> u64 {
        self.pending_at(step)
            + if self.accum_step == step {
                self.owed
            } else {
                0
            }
    }

    /// Whether it was heard within `timeout` of `now`.
    pub fn is_live(&self, now: Instant, timeout: Duration) -> bool {
        now.saturating_duration_since(self.at) < timeout
    }

    /// Whether it died (not live) at `step` or before: what it held is lost to `step`'s
    /// round, which the leader counts.
    pub fn died_by(&self, step: u64, now: Instant, timeout: Duration) -> bool {
        !self.is_live(now, timeout) && self.params_step <= step
    }
}

/// Everything a decision reads.
#[derive(Debug, Clone, Copy)]
pub struct Input<'a> {
    /// This replica.
    pub me: PeerId,
    /// Its own status.
    pub mine: &'a View,
    /// The other replicas as last heard.
    pub views: &'a HashMap<PeerId, View>,
    /// The other replicas known to exist (announced, or heard from).
    pub known: &'a [PeerId],
    /// When this averager started.
    pub started: Instant,
    /// Whether the first lookup of the stage's announced replicas has answered (before
    /// it, `known` may lack replicas that exist).
    pub looked_up: bool,
    /// Since when this replica has seen itself behind, if it does.
    pub behind_since: Option<Instant>,
    /// Since when, as leader, it has seen enough samples for a round, if it has.
    pub ready_since: Option<Instant>,
    /// Samples replicas said they held toward this step when they left gracefully.
    pub left_lost: u64,
    /// Since when, as leader, it has seen the step short of its batch after a replica
    /// died or left holding part of it, or with calls of a later step held, and the total
    /// it saw then.
    pub short_since: Option<(Instant, u64)>,
    /// Synchronous calls held at this replica for a step after its own.
    pub ahead: u64,
}

/// What to do now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Nothing.
    Wait,
    /// This replica is behind the stage: download the state from these donors.
    Resync {
        /// The replicas to download from.
        donors: Vec<PeerId>,
    },
    /// Lead a round of step `step`.
    Lead {
        /// The step averaged.
        step: u64,
        /// The members, sorted (this replica among them).
        members: Vec<PeerId>,
        /// Samples each member held toward the step as last heard, in `members` order
        /// (each contributes everything it holds when it freezes).
        held: Vec<u64>,
        /// Replicas gone silent at or before this step: forget them.
        dead: Vec<PeerId>,
        /// Samples the dead held, lost with them.
        lost: u64,
    },
}

/// The timers a decision carries forward (set on the first tick a condition holds, cleared
/// when it stops holding).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Timers {
    /// See [`Input::behind_since`].
    pub behind_since: Option<Instant>,
    /// See [`Input::ready_since`].
    pub ready_since: Option<Instant>,
    /// See [`Input::short_since`].
    pub short_since: Option<(Instant, u64)>,
}

/// A member of the running attempt of `step` that is heard, live, at a later step although
/// this replica has had nothing from it in the attempt (`heard`): it applied the step some
/// other way (another attempt without this replica, or a download), so this attempt can
/// never complete and waiting for its deadline only holds the stage. Read only when this
/// replica reduces a part of its own (`own_chunks` > 0): every other member then had to
/// send it that part's chunks before it could apply the step through this attempt, so a
/// member that did is always in `heard`.
pub fn passed_by(
    step: u64,
    members: &[PeerId],
    heard: &std::collections::HashSet<PeerId>,
    own_chunks: usize,
    views: &HashMap<PeerId, View>,
    now: Instant,
    cfg: &AveragerConfig,
) -> Option<PeerId> {
    if own_chunks == 0 {
        return None;
    }
    members.iter().copied().find(|p| {
        !heard.contains(p)
            && views
                .get(p)
                .is_some_and(|v| v.is_live(now, cfg.live_timeout) && v.params_step > step)
    })
}

/// The leader of the replicas at this replica's step: the smallest peer id among them.
pub fn leader(me: PeerId, same: &[(PeerId, &View)]) -> PeerId {
    same.iter()
        .map(|(p, _)| *p)
        .chain(std::iter::once(me))
        .min()
        .unwrap_or(me)
}

/// The attempt number of a step's first attempt when its members are those of the last
/// completed round and no samples were lost ([`expected_members`]): odd, and derived from
/// the step alone, so a replica that is not the leader can start it without waiting for
/// the leader's `Members`. Every other attempt's number is even ([`other_attempt`]).
pub fn first_attempt(step: u64) -> u32 {
    crate::rng::mix64(step) as u32 | 1
}

/// An attempt number from `random` that is never a [`first_attempt`].
pub fn other_attempt(random: u64) -> u32 {
    random as u32 & !1
}

/// The members of this replica's step's round when it can start the first attempt itself
/// (as [`first_attempt`], with no samples lost) right after freezing its sum, instead of a
/// one-way latency later when the leader's `Members` arrives: the members of the last
/// round it completed (`last`, itself among them) are all live and at its step, and no
/// other replica is live or died at that step, so the leader will lead exactly them.
/// Wrong guesses cost only bandwidth: the leader then leads another attempt, which
/// replaces this one. The other half of this agreement is the leader's choice of
/// [`first_attempt`] in the actor (no samples lost, the same members, not yet joined at
/// the step): the two change together.
pub fn expected_members(
    input: &Input<'_>,
    last: &[PeerId],
    now: Instant,
    cfg: &AveragerConfig,
) -> Option<Vec<PeerId>> {
    let s = input.mine.params_step;
    if last.len() < 2 || !last.contains(&input.me) {
        return None;
    }
    let all_here = last.iter().filter(|p| **p != input.me).all(|p| {
        input
            .views
            .get(p)
            .is_some_and(|v| v.is_live(now, cfg.live_timeout) && v.params_step == s)
    });
    let strangers = input.views.iter().any(|(p, v)| {
        !last.contains(p)
            && (v.is_live(now, cfg.live_timeout) || v.died_by(s, now, cfg.live_timeout))
    });
    (all_here && !strangers).then(|| last.to_vec())
}

/// How long a round of `members` members may take: four times the bytes each member
/// moves (its parts to the others and its reduced part to them: about 2(k−1)/k of the
/// encoded gradient of `gradient_bytes`) over the slowest measured uplink among them
/// (`0`: not measured), and never less than `floor`.
pub fn round_timeout(
    floor: Duration,
    gradient_bytes: u64,
    members: usize,
    uplinks: &[u64],
) -> Duration {
    let k = members.max(1) as f64;
    let moved = 2.0 * (k - 1.0) / k * gradient_bytes as f64;
    match uplinks.iter().copied().filter(|&u| u > 0).min() {
        Some(slowest) => floor.max(Duration::from_secs_f64(4.0 * moved / slowest as f64)),
        None => floor,
    }
}

/// A round's timeout after `failed` attempts of its step were abandoned at their
/// deadlines: doubled for each, up to [`MAX_BACKOFF`] times.
pub fn backoff(timeout: Duration, failed: u32) -> Duration {
    timeout.saturating_mul(1 << failed.min(MAX_BACKOFF.trailing_zeros()))
}

/// The most a round's timeout grows by [`backoff`] (a power of two).
pub const MAX_BACKOFF: u32 = 8;

/// Whether this replica should freeze what it holds for its step now, before any round
/// begins: its step's batch is full as far as it knows (its samples and those the live
/// replicas at its step said they hold reach `target`), and it holds unfrozen samples.
/// Later samples then count toward the next step, so a step holds the run's batch and not
/// also what arrives while its round forms (which, with trainers that never wait, made
/// steps a quarter to a half larger than asked, and fewer).
pub fn batch_full(input: &Input<'_>, now: Instant, cfg: &AveragerConfig) -> bool {
    let mine = input.mine;
    let unfrozen = mine.accum_step == mine.params_step && mine.count > 0 && mine.frozen == 0;
    unfrozen && known_total(input, now, cfg) >= cfg.target.max(1)
}

/// Samples held toward this replica's step by it and the live replicas at that step, as
/// last heard.
fn known_total(input: &Input<'_>, now: Instant, cfg: &AveragerConfig) -> u64 {
    let s = input.mine.params_step;
    let others: u64 = input
        .views
        .values()
        .filter(|v| v.is_live(now, cfg.live_timeout) && v.params_step == s)
        .map(|v| v.pending_at(s))
        .sum();
    input.mine.pending_at(s) + others
}

/// Samples of this replica's step's batch that replicas which died at that step (as it last
/// heard them) or left (as they said) held: what its `Progress` reports as `lost`.
pub fn seen_lost(input: &Input<'_>, now: Instant, cfg: &AveragerConfig) -> u64 {
    let s = input.mine.params_step;
    input
        .views
        .values()
        .filter(|v| v.died_by(s, now, cfg.live_timeout) && v.params_step == s)
        .map(|v| v.pending_at(s))
        .sum::<u64>()
        + input.left_lost
}

/// Heartbeats a leader waits, with its step short of the batch after a replica died or
/// left holding part of it and no sample arriving, before it leads without the rest.
pub const SHORT_AFTER: u32 = 5;

/// How long a leader waits, with its step short of the batch, no replica gone, calls of a
/// later step held and no sample arriving, before it leads with what the step holds:
/// under the 15 s a held call waits, over the time a step's last microbatch takes to come.
pub const AHEAD_AFTER: Duration = Duration::from_secs(8);

/// Decides what the averager does on this tick (no round in progress).
///
/// - Behind (a live replica at a later step, or the leader's hash differs at this step)
///   for two heartbeats: resync from the replicas at the highest step (or the leader).
/// - The leader, once the live replicas at its step hold `target` samples (any, to retry an
///   abandoned attempt whose samples are frozen): waits up to
///   five heartbeats for replicas that are catching up (and, just after start, for the
///   first lookup of the stage's replicas and every known replica to be heard from), then
///   leads a round of the replicas at its step.
pub fn decide(input: &Input<'_>, now: Instant, cfg: &AveragerConfig) -> (Decision, Timers) {
    let mine = input.mine;
    let s = mine.params_step;
    let live: Vec<(PeerId, &View)> = input
        .views
        .iter()
        .filter(|(_, v)| v.is_live(now, cfg.live_timeout))
        .map(|(p, v)| (*p, v))
        .collect();
    let same: Vec<(PeerId, &View)> = live
        .iter()
        .filter(|(_, v)| v.params_step == s)
        .copied()
        .collect();
    let lead = leader(input.me, &same);
    let ahead = live.iter().any(|(_, v)| v.params_step > s);
    let diverged = same
        .iter()
        .any(|(p, v)| *p == lead && *p < input.me && v.hash != mine.hash);
    // `ready_since` is carried only while this replica, as leader, keeps waiting for
    // laggards: one left over from an earlier wait would let it lead without them at once.
    let mut timers = Timers::default();
    if ahead || diverged {
        let since = input.behind_since.unwrap_or(now);
        if now.saturating_duration_since(since) < cfg.heartbeat * 2 {
            timers.behind_since = Some(since);
            return (Decision::Wait, timers);
        }
        let donors = if ahead {
            let top = live.iter().map(|(_, v)| v.params_step).max().unwrap_or(s);
            let mut d: Vec<PeerId> = live
                .iter()
                .filter(|(_, v)| v.params_step == top)
                .map(|(p, _)| *p)
                .collect();
            d.sort();
            d
        } else {
            vec![lead]
        };
        return (Decision::Resync { donors }, timers);
    }
    if lead != input.me {
        return (Decision::Wait, timers);
    }
    // What replicas that died or left at this step held was part of its batch: counted
    // toward it (as lost), or a synchronous step, whose microbatches stage 0 stopped
    // admitting once the batch was full, would wait for them for ever. The leader may not
    // have seen them go (it joined after): the others say what they saw.
    let told = same.iter().map(|(_, v)| v.lost).max().unwrap_or(0);
    let gone = seen_lost(input, now, cfg).max(told);
    let total = known_total(input, now, cfg) + gone;
    // Samples frozen for an abandoned attempt: the step's batch was full when its first
    // attempt began, so a retry goes ahead with what the live members hold (the rest went
    // with replicas that died or were banned, and later samples count toward the next step).
    let retry = mine.frozen > 0 || same.iter().any(|(_, v)| v.frozen > 0);
    // A replica's last progress message may be older than its last samples: when one died
    // or left at this step and the total has not moved for `SHORT_AFTER` heartbeats, what
    // is missing went with it, and the step goes ahead without it. Calls of a later step
    // held at a replica say stage 0 has moved on (what is missing was lost some other
    // way: dropped by a replica that fell behind and caught up): once the total has not
    // moved for `AHEAD_AFTER`, the step goes ahead with what it holds.
    let ahead = input.ahead > 0 || same.iter().any(|(_, v)| v.ahead > 0);
    let short = total < cfg.target.max(1) && (gone > 0 || ahead);
    timers.short_since = match input.short_since {
        Some((t, n)) if short && n == total => Some((t, n)),
        _ if short => Some((now, total)),
        _ => None,
    };
    let wait = if gone > 0 {
        cfg.heartbeat * SHORT_AFTER
    } else {
        AHEAD_AFTER
    };
    let stalled = timers
        .short_since
        .is_some_and(|(t, _)| now.saturating_duration_since(t) >= wait);
    // Stalled, it goes ahead even empty: the step must close for the next to open.
    let need = match (stalled, retry) {
        (true, _) => 0,
        (false, true) => 1,
        (false, false) => cfg.target.max(1),
    };
    if total < need {
        timers.ready_since = None;
        return (Decision::Wait, timers);
    }
    timers.short_since = None;
    let ready = input.ready_since.unwrap_or(now);
    let lagging = live.iter().any(|(_, v)| v.params_step < s);
    let unheard = input.known.iter().any(|p| !input.views.contains_key(p));
    let starting = now.saturating_duration_since(input.started) < cfg.live_timeout;
    if (lagging || ((unheard || !input.looked_up) && starting))
        && now.saturating_duration_since(ready) < cfg.heartbeat * 5
    {
        timers.ready_since = Some(ready);
        return (Decision::Wait, timers);
    }
    timers.ready_since = None;
    // Samples held by replicas that died at this step are lost; count them once. (A
    // replica that died holding gradients of an earlier step lost them too.)
    let mut dead: Vec<PeerId> = input
        .views
        .iter()
        .filter(|(_, v)| v.died_by(s, now, cfg.live_timeout))
        .map(|(p, _)| *p)
        .collect();
    dead.sort();
    let lost = (dead
        .iter()
        .filter_map(|p| input.views.get(p))
        .map(|v| v.count + v.frozen)
        .sum::<u64>()
        + input.left_lost)
        .max(told);
    let mut members: Vec<(PeerId, u64)> = same.iter().map(|(p, v)| (*p, v.pending_at(s))).collect();
    members.push((input.me, mine.pending_at(s)));
    members.sort_by_key(|(p, _)| *p);
    (
        Decision::Lead {
            step: s,
            held: members.iter().map(|(_, n)| *n).collect(),
            members: members.into_iter().map(|(p, _)| p).collect(),
            dead,
            lost,
        },
        timers,
    )
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
