//! Unit tests of the averager's pure decisions.

use super::*;
use crate::wire::CodecSpec;

fn cfg(target: u64) -> AveragerConfig {
    AveragerConfig::new(target, CodecSpec::F32)
}

/// `n` peer ids in increasing order.
fn peers(n: usize) -> Vec<PeerId> {
    let mut p: Vec<PeerId> = (0..n).map(|_| PeerId::random()).collect();
    p.sort();
    p
}

fn view(step: u64, count: u64, hash: &str, at: Instant) -> View {
    View {
        owed: 0,
        lost: 0,
        ahead: 0,
        params_step: step,
        accum_step: step,
        count,
        frozen: 0,
        hash: hash.into(),
        uplink: 0,
        at,
    }
}

struct World {
    t0: Instant,
    me: PeerId,
    mine: View,
    views: HashMap<PeerId, View>,
    known: Vec<PeerId>,
    timers: Timers,
    looked_up: bool,
    left_lost: u64,
    ahead: u64,
}

impl World {
    fn new(me: PeerId, mine: View, t0: Instant) -> Self {
        Self {
            t0,
            me,
            mine,
            views: HashMap::new(),
            known: Vec::new(),
            timers: Timers::default(),
            looked_up: true,
            left_lost: 0,
            ahead: 0,
        }
    }

    fn hear(&mut self, p: PeerId, v: View) {
        self.views.insert(p, v);
        if !self.known.contains(&p) {
            self.known.push(p);
        }
    }

    /// What a decision reads.
    fn input(&self) -> Input<'_> {
        Input {
            me: self.me,
            mine: &self.mine,
            views: &self.views,
            known: &self.known,
            started: self.t0,
            looked_up: self.looked_up,
            behind_since: self.timers.behind_since,
            ready_since: self.timers.ready_since,
            short_since: self.timers.short_since,
            left_lost: self.left_lost,
            ahead: self.ahead,
        }
    }

    /// Decides at `now`, carrying the timers forward as the averager does.
    fn decide(&mut self, now: Instant, cfg: &AveragerConfig) -> Decision {
        let (d, t) = decide(&self.input(), now, cfg);
        self.timers = t;
        d
    }

    /// Whether this replica's step's batch is full as it knows it.
    fn full(&self, now: Instant, cfg: &AveragerConfig) -> bool {
        batch_full(&self.input(), now, cfg)
    }
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[test]
fn the_smallest_live_peer_at_the_step_leads() {
    let c = cfg(32);
    let t0 = Instant::now();
    let now = t0 + ms(5_000);
    let p = peers(4);
    // p[0] is at another step and p[1] went silent: p[2] (this replica) leads over p[3].
    let mut w = World::new(p[2], view(7, 20, "h", now), t0);
    w.hear(p[0], view(6, 0, "old", now));
    w.hear(p[1], view(7, 5, "h", now - c.live_timeout - ms(1)));
    w.hear(p[3], view(7, 20, "h", now));
    assert_eq!(leader(p[2], &[(p[3], &w.views[&p[3]])]), p[2]);
    // p[0] is behind (lagging): the leader waits for it, within the grace.
    assert_eq!(w.decide(now, &c), Decision::Wait);
    match w.decide(now + c.heartbeat * 5, &c) {
        Decision::Lead {
            step,
            members,
            held,
            dead,
            lost,
        } => {
            assert_eq!(step, 7);
            assert_eq!(members, vec![p[2], p[3]]);
            assert_eq!(held, vec![20, 20]);
            assert_eq!(dead, vec![p[1]]);
            assert_eq!(lost, 5);
        }
        d => panic!("expected a round, got {d:?}"),
    }
    // The replica with the larger id never leads.
    let mut follower = World::new(p[3], view(7, 20, "h", now), t0);
    follower.hear(p[2], view(7, 20, "h", now));
    assert_eq!(follower.decide(now, &c), Decision::Wait);
}

#[test]
fn no_round_below_the_target() {
    let c = cfg(32);
    let t0 = Instant::now();
    let now = t0 + ms(10_000);
    let p = peers(2);
    let mut w = World::new(p[0], view(3, 10, "h", now), t0);
    w.hear(p[1], view(3, 21, "h", now));
    w.timers.ready_since = Some(now - ms(50));
    assert_eq!(w.decide(now, &c), Decision::Wait);
    assert_eq!(w.timers.ready_since, None);
    w.hear(p[1], view(3, 22, "h", now));
    assert!(matches!(w.decide(now, &c), Decision::Lead { .. }));
    // A retry: samples frozen for an abandoned attempt (a member with the rest of the
    // batch died or was banned) are averaged without waiting for a full batch.
    let mut w = World::new(p[0], view(3, 0, "h", now), t0);
    w.mine.frozen = 10;
    w.hear(p[1], view(3, 2, "h", now));
    assert!(matches!(w.decide(now, &c), Decision::Lead { .. }));
}

#[test]
fn samples_that_died_or_left_with_a_replica_count_toward_its_step() {
    // A synchronous step: stage 0 admitted the batch and stopped; the replica that
    // accumulated 12 of its 32 samples here was SIGKILLed, so they never come.
    let c = cfg(32);
    let t0 = Instant::now();
    let now = t0 + ms(20_000);
    let p = peers(3);
    let mut w = World::new(p[0], view(3, 20, "h", now), t0);
    w.hear(p[2], view(3, 12, "h", now - c.live_timeout - ms(1)));
    match w.decide(now, &c) {
        Decision::Lead { dead, lost, .. } => assert_eq!((dead, lost), (vec![p[2]], 12)),
        d => panic!("expected a round, got {d:?}"),
    }
    // Its last message said 8 (four more came after it): short by 4, the leader waits
    // `SHORT_AFTER` heartbeats in which no sample arrives, then leads without them.
    let mut w = World::new(p[0], view(3, 20, "h", now), t0);
    w.hear(p[2], view(3, 8, "h", now - c.live_timeout - ms(1)));
    assert_eq!(w.decide(now, &c), Decision::Wait);
    let later = now + c.heartbeat * SHORT_AFTER;
    // A sample arriving restarts the wait.
    w.mine.count = 21;
    assert_eq!(w.decide(later - ms(1), &c), Decision::Wait);
    assert_eq!(w.decide(later, &c), Decision::Wait);
    assert!(matches!(
        w.decide(later - ms(1) + c.heartbeat * SHORT_AFTER, &c),
        Decision::Lead { .. }
    ));
    // No replica gone: below the target it waits however long.
    let mut w = World::new(p[0], view(3, 20, "h", now), t0);
    w.hear(p[1], view(3, 8, "h", now));
    assert_eq!(w.decide(now, &c), Decision::Wait);
    assert_eq!(w.decide(now + c.heartbeat * 50, &c), Decision::Wait);
    // A replica that left gracefully said what it held.
    w.left_lost = 4;
    assert!(matches!(
        w.decide(now + c.heartbeat * 51, &c),
        Decision::Lead { .. }
    ));
    // The leader joined after the replica died and never heard of it: the survivor that
    // saw it die says so in its progress, and the leader counts that.
    let mut w = World::new(p[0], view(3, 0, "h", now), t0);
    let mut survivor = view(3, 20, "h", now);
    w.hear(p[1], survivor.clone());
    assert_eq!(w.decide(now, &c), Decision::Wait);
    survivor.lost = 12;
    w.hear(p[1], survivor);
    match w.decide(now, &c) {
        Decision::Lead { members, lost, .. } => {
            assert_eq!((members, lost), (vec![p[0], p[1]], 12));
        }
        d => panic!("expected a round, got {d:?}"),
    }
    let mut inp = World::new(p[1], view(3, 20, "h", now), t0);
    inp.hear(p[2], view(3, 12, "h", now - c.live_timeout - ms(1)));
    inp.left_lost = 1;
    assert_eq!(seen_lost(&inp.input(), now, &c), 13);
}

#[test]
fn a_step_stage_0_moved_on_from_goes_ahead_with_what_it_holds() {
    // Stage 0 opened the next step (calls of it are held at the other replica), but this
    // stage's step holds 16 of 32 samples: the rest were lost some other way.
    let c = cfg(32);
    let t0 = Instant::now();
    let now = t0 + ms(20_000);
    let p = peers(2);
    let mut w = World::new(p[0], view(3, 16, "h", now), t0);
    // The other replica, heard at `at`, holding `ahead` calls of a later step.
    let other = |at: Instant, ahead: u64| View {
        ahead,
        ..view(3, 0, "h", at)
    };
    // Nothing held for a later step: it waits however long.
    for k in 0..4 {
        let t = now + AHEAD_AFTER * k;
        w.hear(p[1], other(t, 0));
        assert_eq!(w.decide(t, &c), Decision::Wait);
    }
    // Calls of step 4 held there: the step goes ahead once no sample came for AHEAD_AFTER.
    let t = now + AHEAD_AFTER * 4;
    w.hear(p[1], other(t, 1));
    assert_eq!(w.decide(t, &c), Decision::Wait);
    let late = t + AHEAD_AFTER - ms(1);
    w.hear(p[1], other(late, 1));
    assert_eq!(w.decide(late, &c), Decision::Wait);
    w.hear(p[1], other(t + AHEAD_AFTER, 1));
    match w.decide(t + AHEAD_AFTER, &c) {
        Decision::Lead { held, lost, .. } => assert_eq!((held, lost), (vec![16, 0], 0)),
        d => panic!("expected a round, got {d:?}"),
    }
    // Held here, with nothing at all in the step (a single replica): it goes ahead empty.
    let mut w = World::new(p[0], view(3, 0, "h", now), t0);
    w.ahead = 2;
    assert_eq!(w.decide(now, &c), Decision::Wait);
    assert!(matches!(
        w.decide(now + AHEAD_AFTER, &c),
        Decision::Lead { .. }
    ));
}

#[test]
fn a_hash_that_disagrees_with_the_leader_resyncs_from_it() {
    let c = cfg(32);
    let t0 = Instant::now();
    let now = t0 + ms(10_000);
    let p = peers(2);
    let mut w = World::new(p[1], view(5, 0, "mine", now), t0);
    w.hear(p[0], view(5, 0, "theirs", now));
    // Behind for less than two heartbeats: wait.
    assert_eq!(w.decide(now, &c), Decision::Wait);
    assert_eq!(w.timers.behind_since, Some(now));
    let later = now + c.heartbeat * 2;
    if let Some(v) = w.views.get_mut(&p[0]) {
        v.at = later;
    }
    assert_eq!(w.decide(later, &c), Decision::Resync { donors: vec![p[0]] });
    assert_eq!(w.timers.behind_since, None);
    // The leader itself never resyncs from a follower that disagrees.
    let mut leader = World::new(p[0], view(5, 40, "theirs", now), t0);
    leader.hear(p[1], view(5, 0, "mine", now));
    assert!(matches!(leader.decide(now, &c), Decision::Lead { .. }));
}

#[test]
fn a_replica_behind_downloads_from_the_most_advanced() {
    let c = cfg(32);
    let t0 = Instant::now();
    let now = t0 + ms(10_000);
    let p = peers(4);
    let mut w = World::new(p[0], view(2, 50, "a", now), t0);
    w.hear(p[1], view(4, 0, "b", now));
    w.hear(p[2], view(3, 0, "c", now));
    w.hear(p[3], view(4, 0, "b", now));
    w.timers.behind_since = Some(now - c.heartbeat * 2);
    assert_eq!(
        w.decide(now, &c),
        Decision::Resync {
            donors: vec![p[1], p[3]]
        }
    );
    // A dead peer at a later step does not count.
    let mut w = World::new(p[0], view(2, 50, "a", now), t0);
    w.hear(p[1], view(9, 0, "b", now - c.live_timeout));
    assert!(matches!(w.decide(now, &c), Decision::Lead { .. }));
}

#[test]
fn at_start_the_leader_waits_to_hear_every_known_replica() {
    let c = cfg(8);
    let t0 = Instant::now();
    let p = peers(2);
    let mut w = World::new(p[0], view(0, 8, "h", t0), t0);
    w.known.push(p[1]);
    assert_eq!(w.decide(t0 + ms(10), &c), Decision::Wait);
    // Within the grace it keeps waiting; after it, it goes ahead alone.
    assert_eq!(w.decide(t0 + c.heartbeat * 4, &c), Decision::Wait);
    match w.decide(t0 + ms(10) + c.heartbeat * 5, &c) {
        Decision::Lead { members, .. } => assert_eq!(members, vec![p[0]]),
        d => panic!("expected a round, got {d:?}"),
    }
    // Past the start-up window nobody unheard is waited for.
    let mut w = World::new(p[0], view(0, 8, "h", t0), t0);
    w.known.push(p[1]);
    assert!(matches!(
        w.decide(t0 + c.live_timeout, &c),
        Decision::Lead { .. }
    ));
}

#[test]
fn round_timeouts_follow_the_slowest_measured_link() {
    let floor = Duration::from_secs(5);
    // 100 MB of gradient, two members: each moves 100 MB; at 1 MB/s that is 400 s.
    let t = round_timeout(floor, 100_000_000, 2, &[0, 1_000_000, 50_000_000]);
    assert_eq!(t, Duration::from_secs(400));
    // Fast links, or nothing measured yet: the floor.
    assert_eq!(round_timeout(floor, 1_000_000, 4, &[1_000_000_000]), floor);
    assert_eq!(round_timeout(floor, 100_000_000, 2, &[0, 0]), floor);
    // A round of one moves nothing.
    assert_eq!(round_timeout(floor, 100_000_000, 1, &[1]), floor);
}

#[test]
fn each_attempt_abandoned_at_its_deadline_doubles_the_next_ones_up_to_a_cap() {
    let t = Duration::from_secs(1);
    let grown: Vec<u64> = (0..6).map(|n| backoff(t, n).as_secs()).collect();
    assert_eq!(grown, [1, 2, 4, 8, 8, 8]);
    assert_eq!(backoff(t, u32::MAX), t * MAX_BACKOFF);
}

#[test]
fn a_wait_for_a_laggard_long_ago_does_not_let_a_leader_skip_the_next_one() {
    let c = cfg(32);
    let t0 = Instant::now();
    let p = peers(2);
    // p[1] waited as leader for p[0] once (p[0] was a step behind), then p[0] caught up
    // and led the rounds that followed.
    let then = t0 + ms(5_000);
    let mut w = World::new(p[1], view(4, 32, "h", then), t0);
    w.hear(p[0], view(3, 0, "old", then));
    assert_eq!(w.decide(then, &c), Decision::Wait);
    w.hear(p[0], view(4, 32, "h", then));
    assert_eq!(w.decide(then, &c), Decision::Wait);
    // Much later p[1] applied step 9 just before p[0] did: it waits for p[0] again
    // rather than averaging alone, for the grace counted from now.
    let now = then + ms(20_000);
    w.mine = view(10, 32, "h10", now);
    w.hear(p[0], view(9, 0, "h9", now));
    assert_eq!(w.decide(now, &c), Decision::Wait);
    assert_eq!(w.decide(now + c.heartbeat * 4, &c), Decision::Wait);
    match w.decide(now + c.heartbeat * 5, &c) {
        Decision::Lead { members, .. } => assert_eq!(members, vec![p[1]]),
        d => panic!("expected a round without the laggard after the grace, got {d:?}"),
    }
}

#[test]
fn just_after_start_a_leader_waits_for_the_first_lookup_of_its_stage() {
    let c = cfg(32);
    let t0 = Instant::now();
    let p = peers(2);
    // Nothing known yet: a replica that exists may simply not be looked up.
    let mut w = World::new(p[0], view(0, 32, "h", t0), t0);
    w.looked_up = false;
    assert_eq!(w.decide(t0 + ms(10), &c), Decision::Wait);
    // A lookup that never answers delays the first round by the grace only.
    assert!(matches!(
        w.decide(t0 + ms(10) + c.heartbeat * 5, &c),
        Decision::Lead { .. }
    ));
    // Looked up, and no other replica: it leads at once.
    let mut w = World::new(p[0], view(0, 32, "h", t0), t0);
    assert!(matches!(w.decide(t0 + ms(10), &c), Decision::Lead { .. }));
}

#[test]
fn a_replica_freezes_its_step_once_the_batch_it_knows_of_is_full() {
    let c = cfg(32);
    let t0 = Instant::now();
    let now = t0 + ms(10_000);
    let p = peers(3);
    // The leader or not, a replica freezes once its samples and those the live replicas
    // at its step hold reach the batch.
    let mut w = World::new(p[1], view(4, 16, "h", now), t0);
    w.hear(p[0], view(4, 8, "h", now));
    assert!(!w.full(now, &c));
    w.hear(p[0], view(4, 16, "h", now));
    assert!(w.full(now, &c));
    // A replica that froze for this step's round counts with what it froze.
    let mut v = view(4, 0, "h", now);
    v.frozen = 16;
    w.hear(p[0], v);
    assert!(w.full(now, &c));
    // Silent replicas, and replicas at another step, do not count.
    w.hear(p[0], view(4, 16, "h", now - c.live_timeout - ms(1)));
    w.hear(p[2], view(5, 16, "h", now));
    assert!(!w.full(now, &c));
    // Nothing to freeze: no samples of its own, or already frozen (its next samples
    // count toward the next step).
    w.hear(p[0], view(4, 32, "h", now));
    w.mine.count = 0;
    assert!(!w.full(now, &c));
    w.mine.count = 16;
    w.mine.frozen = 16;
    w.mine.accum_step = 5;
    assert!(!w.full(now, &c));
}

#[test]
fn first_attempts_are_the_steps_own_and_never_another_attempts_number() {
    let firsts: Vec<u32> = (0..1000).map(first_attempt).collect();
    assert!(firsts.iter().all(|a| a % 2 == 1));
    assert_eq!(firsts[7], first_attempt(7), "derived from the step alone");
    let distinct: std::collections::HashSet<u32> = firsts.iter().copied().collect();
    assert!(
        distinct.len() > 990,
        "steps share first attempts: {}",
        distinct.len()
    );
    let mut rng = crate::rng::Rng::new(3);
    assert!((0..1000).all(|_| other_attempt(rng.next_u64()) % 2 == 0));
}

#[test]
fn a_replica_expects_the_last_rounds_members_only_while_none_joined_left_or_lags() {
    let t0 = Instant::now();
    let now = t0 + Duration::from_millis(10);
    let c = cfg(32);
    let p = peers(4);
    let last = vec![p[0], p[1], p[2]];
    let mut w = World::new(p[1], view(5, 20, "h", t0), t0);
    // Nothing to expect before a round completed, or when this replica was not in it.
    assert_eq!(expected_members(&w.input(), &[], now, &c), None);
    w.hear(p[0], view(5, 10, "h", t0));
    w.hear(p[2], view(5, 4, "h", t0));
    assert_eq!(expected_members(&w.input(), &[p[0], p[2]], now, &c), None);
    assert_eq!(
        expected_members(&w.input(), &last, now, &c),
        Some(last.clone())
    );
    // A member still at the step before: the leader may wait for it.
    w.hear(p[2], view(4, 4, "h", t0));
    assert_eq!(expected_members(&w.input(), &last, now, &c), None);
    w.hear(p[2], view(5, 4, "h", t0));
    // A member not heard from for longer than the live timeout.
    let late = t0 + c.live_timeout + Duration::from_millis(1);
    w.hear(p[0], view(5, 10, "h", late));
    assert_eq!(expected_members(&w.input(), &last, late, &c), None);
    w.hear(p[0], view(5, 10, "h", t0));
    // A replica that was not in the last round: the leader leads it too.
    w.hear(p[3], view(5, 0, "h", t0));
    assert_eq!(expected_members(&w.input(), &last, now, &c), None);
    // One that died at this step: its samples are lost, which the leader counts.
    let later = t0 + c.live_timeout + Duration::from_millis(1);
    w.hear(p[3], view(5, 3, "h", t0));
    w.hear(p[0], view(5, 10, "h", later));
    w.hear(p[2], view(5, 4, "h", later));
    assert_eq!(expected_members(&w.input(), &last, later, &c), None);
    // One that died at a later step lost nothing of this one, and is no member.
    w.hear(p[3], view(6, 3, "h", t0));
    assert_eq!(expected_members(&w.input(), &last, later, &c), Some(last));
}

#[test]
fn an_attempt_a_member_passed_by_without_it_is_over() {
    let t0 = Instant::now();
    let c = cfg(8);
    let p = peers(3);
    let (me, a, b) = (p[0], p[1], p[2]);
    let members = vec![me, a, b];
    let mut views = HashMap::new();
    views.insert(a, view(5, 0, "h", t0));
    views.insert(b, view(6, 0, "h", t0));
    let mut heard = std::collections::HashSet::new();
    // b is at step 6 and sent nothing in the attempt of step 5: it applied 5 elsewhere.
    assert_eq!(passed_by(5, &members, &heard, 3, &views, t0, &c), Some(b));
    // Had it sent a part here, it may have applied 5 through this very attempt.
    heard.insert(b);
    assert_eq!(passed_by(5, &members, &heard, 3, &views, t0, &c), None);
    heard.clear();
    // With no part of its own, this replica cannot tell: no member had to send it anything.
    assert_eq!(passed_by(5, &members, &heard, 0, &views, t0, &c), None);
    // A view gone quiet says nothing of where the member is now.
    let late = t0 + c.live_timeout + ms(1);
    assert_eq!(passed_by(5, &members, &heard, 3, &views, late, &c), None);
    // Members still at the step are waited for.
    views.insert(b, view(5, 0, "h", t0));
    assert_eq!(passed_by(5, &members, &heard, 3, &views, t0, &c), None);
}
