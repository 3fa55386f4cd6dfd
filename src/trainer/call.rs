//! One stage call with swap-in: the replica is picked (the preferred one when usable, else
//! by the trainer's routing), the call made, and on failure the replica is avoided for a
//! while and the call repeated on another until the stage deadline.

use super::routing::{self, ReplicaState, Routing};
use super::{Ctx, TrainerStats};
use crate::stage::client::CallError;
use crate::wire::msg::ErrorKind;
use libp2p::PeerId;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Why a stage call gave up.
#[derive(Debug)]
pub(super) enum Failure {
    /// A synchronous microbatch's step closed on the replica: start the microbatch again.
    Closed,
    /// No replica could take it: the microbatch fails for this reason.
    Failed(String),
}

impl From<String> for Failure {
    fn from(reason: String) -> Self {
        Self::Failed(reason)
    }
}

/// A short label of why a call is repeated elsewhere.
pub(super) fn swap_reason(e: &CallError) -> String {
    match e {
        CallError::Remote { kind, .. } => format!("refused ({kind})"),
        CallError::Timeout(_) => "timed out".into(),
        CallError::Io(_) => "stream broke".into(),
        CallError::Net(_) => "unreachable".into(),
        CallError::Wire(_) | CallError::Protocol(_) => "bad reply".into(),
    }
}

/// Times a call is repeated after a `stale_step` answer before the replica counts as failing.
const MAX_STALE_RETRIES: u32 = 3;

/// Picks a replica of stage `s` for a call of `samples` samples (`preferred` when usable,
/// else by the trainer's routing) and counts the call in flight there.
pub(super) fn pick(
    ctx: &Ctx,
    s: usize,
    preferred: Option<PeerId>,
    samples: u64,
    now: Instant,
) -> Result<Option<PeerId>, String> {
    let mut table = ctx.table.lock();
    let row = &mut table[s];
    let pref = preferred.and_then(|p| row.iter().position(|(q, st)| *q == p && st.usable(now)));
    let states: Vec<ReplicaState> = row.iter().map(|(_, st)| st.clone()).collect();
    let idx = pref.or_else(|| match ctx.cfg.routing {
        Routing::Wiring => routing::choose(&states, samples as f64, now, &mut ctx.rng.lock()),
        Routing::RoundRobin => {
            let turn = ctx.turns[s].fetch_add(1, Ordering::Relaxed);
            routing::round_robin(&states, now, turn)
        }
    });
    Ok(idx.map(|i| {
        row[i].1.in_flight += 1;
        row[i].0
    }))
}

/// Replicas of a stage slower than this fraction of the stage's fastest (as announced) get
/// no lane of their own: [`lane`] leaves them to the usual routing.
const LANE_SPEED: f64 = 0.7;

/// The replica of stage `s` a synchronous microbatch admitted by `first` (a replica of stage
/// 0) goes to: the one in the same place among its stage's replicas, ordered by peer id, as
/// `first` among stage 0's. Stage 0 deals a step's microbatches round its replicas in that
/// order, so every stage's replicas get an equal share of each step, where two trainers
/// routing on their own would often pile three of four on one replica. `None` (usual
/// routing) when `first` is unknown here or the replica is much slower than its stage's
/// fastest.
pub(super) fn lane(ctx: &Ctx, s: usize, first: PeerId) -> Option<PeerId> {
    let table = ctx.table.lock();
    let mut zero: Vec<PeerId> = table.first()?.iter().map(|(p, _)| *p).collect();
    zero.sort();
    let rank = zero.iter().position(|p| *p == first)?;
    let row = table.get(s)?;
    let mut ids: Vec<(PeerId, f64)> = row.iter().map(|(p, st)| (*p, st.announced)).collect();
    ids.sort_by_key(|(p, _)| *p);
    let fastest = ids.iter().map(|(_, a)| *a).fold(0.0, f64::max);
    let (peer, speed) = *ids.get(rank % ids.len().max(1))?;
    (speed >= LANE_SPEED * fastest).then_some(peer)
}

/// A call to `peer` (stage `s`, picked by [`pick`]) ended outside [`call_stage`]: it took
/// `secs` for `samples` samples when it succeeded; when it failed, the replica is avoided
/// for `ban`.
pub(super) fn settle(
    ctx: &Ctx,
    s: usize,
    peer: PeerId,
    samples: u64,
    outcome: Result<f64, Duration>,
) {
    let mut table = ctx.table.lock();
    if let Some((_, st)) = table[s].iter_mut().find(|(p, _)| *p == peer) {
        st.in_flight = st.in_flight.saturating_sub(1);
        match outcome {
            Ok(secs) => {
                st.observe(samples as f64, secs);
                if let Some(q) = ctx.client.counters().last_queue(&peer) {
                    st.queue = q;
                }
            }
            Err(ban) => st.banned_until = Some(Instant::now() + ban),
        }
    }
}

/// [`settle`] for a call of `samples` samples that failed with `e`: the replica is avoided
/// as [`ban_for`] says.
pub(super) fn settle_failed(ctx: &Ctx, s: usize, peer: PeerId, samples: u64, e: &CallError) {
    let ban = {
        let table = ctx.table.lock();
        let st = table[s].iter().find(|(p, _)| *p == peer).map(|(_, st)| st);
        ban_for(e, ctx.cfg.ban, st, samples)
    };
    settle(ctx, s, peer, samples, Err(ban));
}

/// The shortest and the longest a replica that refused a call as overloaded is avoided.
const OVERLOADED_BAN: (Duration, Duration) = (Duration::from_millis(200), Duration::from_secs(5));

/// How long a replica (`st`, as this trainer knows it) that failed a call of `samples`
/// samples with `e` is avoided (`ban`: the trainer's). One that refused as overloaded, the
/// time it takes for such a call ([`OVERLOADED_BAN`] bounds it): its queue has no room
/// sooner. (A fixed 200 ms was ~9 refused calls in a row per microbatch on stages of 1.8
/// s a call, 700 refusals a second at 200 peers, each carrying its activations.)
pub(super) fn ban_for(
    e: &CallError,
    ban: Duration,
    st: Option<&ReplicaState>,
    samples: u64,
) -> Duration {
    match e.kind() {
        Some(ErrorKind::Overloaded) => {
            let one = st.map_or(0.0, |st| samples as f64 / st.throughput());
            Duration::from_secs_f64(one.min(OVERLOADED_BAN.1.as_secs_f64())).max(OVERLOADED_BAN.0)
        }
        // The replica is fine: the microbatch's step moved on.
        Some(ErrorKind::StepClosed) => Duration::ZERO,
        _ => ban,
    }
}

/// Runs `call` on a replica of stage `s` (the preferred one when usable), swapping to
/// another replica on failure until the stage deadline.
pub(super) async fn call_stage<T, F, Fut>(
    ctx: &Ctx,
    s: usize,
    preferred: Option<PeerId>,
    samples: u64,
    call: F,
) -> Result<(PeerId, T), Failure>
where
    F: Fn(PeerId, u64) -> Fut,
    Fut: Future<Output = Result<T, CallError>>,
{
    let mut last_usable = Instant::now();
    // What this call last met; none when it never got to call (see below).
    let mut last_err: Option<String> = None;
    let mut first = true;
    let mut stale = 0u32;
    loop {
        let now = Instant::now();
        let pick = pick(ctx, s, preferred.filter(|_| first), samples, now)?;
        first = false;
        let Some(peer) = pick else {
            if last_usable.elapsed() >= ctx.cfg.stage_deadline {
                // Never called: either none is known, or every one known was avoided after
                // failures of other calls the whole time (the label said "no replica
                // announced" for both, which sent a diagnosis the wrong way).
                let why = last_err.unwrap_or_else(|| match ctx.table.lock()[s].len() {
                    0 => "no replica announced".to_string(),
                    n => format!("all {n} known avoided after failures"),
                });
                return Err(Failure::Failed(format!(
                    "stage {s}: no usable replica for {:?} ({why})",
                    ctx.cfg.stage_deadline
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        last_usable = Instant::now();
        let step = ctx.stats.stage_steps[s].load(Ordering::Relaxed);
        let t0 = Instant::now();
        // No retry at the same replica: a failure swaps in another (below).
        let r = call(peer, step).await;
        let secs = t0.elapsed().as_secs_f64();
        tracing::trace!(target: "shoal::trainer", stage = s, ms = secs * 1e3, "stage call");
        let pause = 'pause: {
            let mut table = ctx.table.lock();
            let entry = table[s].iter_mut().find(|(p, _)| *p == peer);
            match r {
                Ok(v) => {
                    if let Some((_, st)) = entry {
                        st.in_flight = st.in_flight.saturating_sub(1);
                        st.observe(samples as f64, secs);
                        if let Some(q) = ctx.client.counters().last_queue(&peer) {
                            st.queue = q;
                        }
                    }
                    return Ok((peer, v));
                }
                Err(e) => {
                    if e.kind() == Some(ErrorKind::StepClosed) {
                        tracing::debug!(target: "shoal::trainer", stage = s, "{e}");
                        if let Some((_, st)) = entry {
                            st.in_flight = st.in_flight.saturating_sub(1);
                        }
                        return Err(Failure::Closed);
                    }
                    if let CallError::Remote {
                        kind: ErrorKind::StaleStep,
                        step: theirs,
                        ..
                    } = &e
                    {
                        // We were behind: catch up and ask again, the replica is fine — a few
                        // times, with a growing pause (a replica that keeps saying so is not).
                        ctx.stats.stage_steps[s].fetch_max(*theirs, Ordering::Relaxed);
                        stale += 1;
                        if stale <= MAX_STALE_RETRIES {
                            if let Some((_, st)) = entry {
                                st.in_flight = st.in_flight.saturating_sub(1);
                            }
                            break 'pause Some(Duration::from_millis(5 << stale));
                        }
                    }
                    if matches!(
                        e.kind(),
                        Some(ErrorKind::BadTensor | ErrorKind::NonFinite | ErrorKind::BadRequest)
                    ) {
                        if let Some((_, st)) = entry {
                            st.in_flight = st.in_flight.saturating_sub(1);
                        }
                        return Err(Failure::Failed(format!("stage {s}: {e}")));
                    }
                    let ban = ban_for(&e, ctx.cfg.ban, entry.as_ref().map(|(_, st)| st), samples);
                    tracing::debug!(target: "shoal::trainer", stage = s, %peer, ms = secs * 1e3, "swap: {e}");
                    if let Some((_, st)) = entry {
                        st.in_flight = st.in_flight.saturating_sub(1);
                        st.banned_until = Some(Instant::now() + ban);
                    }
                    ctx.stats.swaps.fetch_add(1, Ordering::Relaxed);
                    if e.kind() == Some(ErrorKind::Overloaded) {
                        ctx.window.overloaded(Instant::now());
                    }
                    TrainerStats::bump(&ctx.stats.swap_reasons, &swap_reason(&e), 1);
                    last_err = Some(format!("{peer}: {e}"));
                    None
                }
            }
        };
        if let Some(p) = pause {
            tokio::time::sleep(p).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_overloaded_replica_is_avoided_for_the_time_one_call_takes_there() {
        let refused = |kind| CallError::Remote {
            kind,
            message: String::new(),
            step: 0,
        };
        let ban = Duration::from_secs(30);
        let slow = ReplicaState::announced(2.0, 0);
        let over = refused(ErrorKind::Overloaded);
        // 4 samples at 2 samples/s: its queue has room in ~2 s, not 200 ms.
        assert_eq!(ban_for(&over, ban, Some(&slow), 4), Duration::from_secs(2));
        // A fast replica: the floor; a very slow one: the cap; unknown: the floor.
        let fast = ReplicaState::announced(1000.0, 0);
        assert_eq!(ban_for(&over, ban, Some(&fast), 4), OVERLOADED_BAN.0);
        let crawl = ReplicaState::announced(0.01, 0);
        assert_eq!(ban_for(&over, ban, Some(&crawl), 4), OVERLOADED_BAN.1);
        assert_eq!(ban_for(&over, ban, None, 4), OVERLOADED_BAN.0);
        // Other failures keep their bans.
        assert_eq!(
            ban_for(&refused(ErrorKind::StepClosed), ban, Some(&slow), 4),
            Duration::ZERO
        );
        assert_eq!(ban_for(&CallError::Timeout(ban), ban, Some(&slow), 4), ban);
    }
}
