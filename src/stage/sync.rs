//! Synchronous steps kept busy: which step a microbatch joins, decided where it enters the
//! pipeline.
//!
//! A trainer keeps several microbatches in flight. Each one's first forward asks a replica
//! of stage 0 for a step; the replica admits it into the step it is accumulating while the
//! stage's replicas hold fewer than the target batch there (samples accumulated, frozen, or
//! admitted and still on their way back: [`Owed`]), and holds it otherwise until the next
//! step opens. The answer carries the step; every later stage computes the microbatch at
//! that step's parameters (holding it until it gets there) and refuses it once that step
//! has closed, so every gradient of step s is computed at parameters s. The next step's
//! microbatches wait at stage 0 while the current step's round runs, their input already
//! there: no trainer polls for a step.
//!
//! Two replicas of stage 0 admitting at once hear of each other only by their progress
//! messages, so each admits at most its share of the batch (the target split over the
//! stage's replicas at its step) until it has waited [`OVER_SHARE_AFTER`] and the step
//! still has room as far as it knows. A step may still take a microbatch more than its
//! target when two replicas race; the later stages then close the step on their own count
//! and the extra microbatch starts again in the next step (its forwards wasted, no sample
//! lost).
//!
//! Pure code: the service's admission loop and the averager, which tells the service what
//! the other replicas hold, call it.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A synchronous microbatch whose backward has not come this long after its forward is
/// given up (its trainer died or sent it elsewhere): its samples no longer hold room in
/// the step.
pub const OWED_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a forward held at stage 0 waits before it may take more than this replica's
/// share of a step that still has room (the other replicas' progress has arrived by then),
/// when no other replica is still applying the step before.
pub const OVER_SHARE_AFTER: Duration = Duration::from_millis(250);

/// What the other replicas of the stage at this replica's step hold toward it, as the
/// averager last heard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Others {
    /// The step this is about.
    pub step: u64,
    /// Samples they hold toward it: accumulated, frozen or owed.
    pub used: u64,
    /// Live replicas at that step or the one before besides this one.
    pub replicas: u64,
    /// Of those, the replicas still at the step before (about to take their share).
    pub behind: u64,
    /// This replica's place among them all (itself included), ordered by peer id: the
    /// step's microbatch slots go round the replicas in this order.
    pub rank: u64,
}

/// Why a replica whose parameters are at step `params` and whose gradients go into step
/// `accum` refuses a synchronous microbatch of step `step` (the `step_closed` message).
pub fn closed_message(step: u64, params: u64, accum: u64) -> String {
    format!(
        "step {step} is closed here (parameters at step {params}, gradients going into step {accum})"
    )
}

/// Bits of a microbatch id a trainer keeps when it starts the microbatch again under a new
/// id ([`restarted_id`]): a replica settles what the earlier attempt still held.
const ATTEMPT_SHIFT: u32 = 56;

/// The id of attempt `attempt` (1, 2, …) of microbatch `mb`: its low 56 bits are `mb`'s.
pub fn restarted_id(mb: u64, attempt: u64) -> u64 {
    mb ^ (attempt << ATTEMPT_SHIFT)
}

/// Whether two ids are attempts of one microbatch.
pub fn same_microbatch(a: u64, b: u64) -> bool {
    (a ^ b) >> ATTEMPT_SHIFT != 0 && ((a ^ b) << (64 - ATTEMPT_SHIFT)) == 0
}

/// What an admission decision reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    /// The run's target batch.
    pub target: u64,
    /// Samples this replica holds toward the step (accumulated and owed).
    pub own: u64,
    /// What the others hold (zero replicas when not heard of at this step).
    pub others: Others,
    /// Samples of the microbatch asking.
    pub samples: u64,
    /// How long it has waited since the step opened.
    pub waited: Duration,
}

/// Whether the microbatch joins the open step now.
///
/// The step's batch is cut into slots of the asking microbatch's size, dealt round the
/// stage's replicas by rank: this replica's share is its slots. More than the share only
/// once the others had time to say what they took, and none of them is still applying the
/// step before (it would take its share after).
pub fn admits(r: &Room) -> bool {
    let target = r.target.max(1);
    if r.own + r.others.used >= target {
        return false;
    }
    let n = r.others.replicas + 1;
    let slots = target.div_ceil(r.samples.max(1));
    let mine = slots.saturating_sub(r.others.rank).div_ceil(n);
    r.own + r.samples <= mine * r.samples.max(1)
        || (r.waited >= OVER_SHARE_AFTER && r.others.behind == 0)
}

/// Synchronous microbatches whose forward ran on this replica and whose backward has not
/// come yet, by microbatch id.
#[derive(Debug, Default, Clone)]
pub struct Owed {
    by_mb: HashMap<u64, (u64, u64, Instant)>,
}

impl Owed {
    /// Microbatch `mb` of `samples` samples ran its forward at `step`, at `now`. What an
    /// earlier attempt of the same microbatch ([`same_microbatch`]) was owed is settled: it
    /// was started again.
    pub fn add(&mut self, mb: u64, step: u64, samples: u64, now: Instant) {
        self.by_mb
            .retain(|&m, _| m == mb || !same_microbatch(m, mb));
        self.by_mb.insert(mb, (step, samples, now));
    }

    /// Its backward came (or it was refused): it holds no room any more.
    pub fn settle(&mut self, mb: u64) {
        self.by_mb.remove(&mb);
    }

    /// Samples owed toward `step` that have not timed out at `now`.
    pub fn at(&self, step: u64, now: Instant) -> u64 {
        self.by_mb
            .values()
            .filter(|(s, _, t)| *s == step && now.saturating_duration_since(*t) < OWED_TIMEOUT)
            .map(|(_, n, _)| n)
            .sum()
    }

    /// [`Owed::at`] without what microbatch `mb` (any attempt of it) holds: a microbatch
    /// whose forward runs again does not wait for room it holds itself.
    pub fn at_except(&self, step: u64, now: Instant, mb: u64) -> u64 {
        self.by_mb
            .iter()
            .filter(|(&m, _)| m != mb && !same_microbatch(m, mb))
            .map(|(_, v)| v)
            .filter(|(s, _, t)| *s == step && now.saturating_duration_since(*t) < OWED_TIMEOUT)
            .map(|(_, n, _)| n)
            .sum()
    }

    /// Forgets what was owed toward steps before `step`, and what timed out.
    pub fn prune(&mut self, step: u64, now: Instant) {
        self.by_mb
            .retain(|_, (s, _, t)| *s >= step && now.saturating_duration_since(*t) < OWED_TIMEOUT);
    }

    /// Forgets everything (the state was replaced).
    pub fn clear(&mut self) {
        self.by_mb.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn room(own: u64, used: u64, replicas: u64, waited_ms: u64) -> Room {
        Room {
            target: 64,
            own,
            others: Others {
                step: 3,
                used,
                replicas,
                behind: 0,
                rank: 0,
            },
            samples: 16,
            waited: Duration::from_millis(waited_ms),
        }
    }

    #[test]
    fn a_step_takes_microbatches_until_its_batch_is_held() {
        assert!(admits(&room(0, 0, 0, 0)));
        assert!(admits(&room(48, 0, 0, 0)));
        assert!(!admits(&room(64, 0, 0, 0)));
        // The others' samples count: their 48 and our 16 fill it.
        assert!(!admits(&room(16, 48, 1, 1000)));
        assert!(admits(&room(16, 32, 1, 0)));
    }

    #[test]
    fn two_replicas_each_take_their_share_before_waiting_for_the_other() {
        // Two replicas, 64 samples: 32 each at once.
        assert!(admits(&room(16, 0, 1, 0)));
        assert!(!admits(&room(32, 0, 1, 0)));
        // The other has not used its share, as far as this one heard after waiting.
        assert!(admits(&room(32, 16, 1, 300)));
        assert!(!admits(&room(32, 16, 1, 100)));
        // Never while the other is still applying the step before: it takes its share
        // once it has.
        let mut r = room(32, 0, 1, 1000);
        r.others.behind = 1;
        assert!(!admits(&r));
    }

    #[test]
    fn slots_larger_than_a_share_go_round_the_replicas_by_rank() {
        // Four replicas, a batch of 64 in microbatches of 16: one slot each.
        for rank in 0..4 {
            let mut r = room(0, 0, 3, 0);
            r.others.rank = rank;
            assert!(admits(&r), "rank {rank}");
            r.own = 16;
            assert!(!admits(&r), "rank {rank}");
        }
        // A batch of 32: two slots, for ranks 0 and 1; the others wait for them.
        let mut r = room(0, 0, 3, 0);
        r.target = 32;
        r.others.rank = 2;
        assert!(!admits(&r));
        r.waited = OVER_SHARE_AFTER;
        assert!(admits(&r));
        r.others.rank = 1;
        r.waited = Duration::ZERO;
        assert!(admits(&r));
    }

    #[test]
    fn owed_samples_expire_and_belong_to_their_step() {
        let t0 = Instant::now();
        let mut o = Owed::default();
        o.add(1, 5, 16, t0);
        o.add(2, 5, 16, t0);
        o.add(3, 6, 16, t0);
        assert_eq!(o.at(5, t0), 32);
        o.settle(1);
        assert_eq!(o.at(5, t0), 16);
        assert_eq!(o.at(5, t0 + OWED_TIMEOUT), 0);
        o.prune(6, t0);
        assert_eq!((o.at(5, t0), o.at(6, t0)), (0, 16));
        // A microbatch started again releases what its earlier attempt held.
        o.add(restarted_id(3, 1), 6, 16, t0);
        assert_eq!(o.at(6, t0), 16);
        assert!(same_microbatch(3, restarted_id(3, 2)));
        assert!(!same_microbatch(3, 3) && !same_microbatch(3, 4));
        assert_eq!((o.at_except(6, t0, 3), o.at_except(6, t0, 4)), (0, 16));
    }
}
