//! The rebalancer: now and then a serving peer checks whether its stage has more than its
//! share and another less (an empty one first), and moves there ([`rebalance_loop`]).

use super::events::Event;
use super::serving::{Ctx, Slot};
use crate::dht::Announcement;
use crate::rng::Rng;
use crate::stage::select;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Stage mates per unit of the rebalancing period: a replica with more mates checks less
/// often (every `period` × mates ÷ this), so the swarm as a whole checks about as often
/// whatever its size (each check reads and calls up to [`LIVE_SAMPLE`](super::serving::LIVE_SAMPLE) replicas a stage).
const MATES_PER_PERIOD: u64 = 8;

/// How soon a peer checks for an empty stage after it starts serving (randomised
/// ×0.5–1.5); while one looks empty and another stage has a replica to spare, each check
/// that moved nothing doubles the wait before the next ([`fill_pause`]).
const FILL_CHECK: Duration = Duration::from_secs(1);

/// The wait before a fast check after `idle` fast checks in a row that moved nothing:
/// [`FILL_CHECK`] doubled per such check, at most `period`. While 200 peers joined at
/// once, every stage looked empty to most of them until the replicas' provider records
/// spread (a minute on the busy cores), and 177 peers checking every second walked the DHT
/// and called replicas ~700 times a second, which slowed the spreading they waited for.
fn fill_pause(idle: u32, period: Duration) -> Duration {
    FILL_CHECK.saturating_mul(1 << idle.min(16)).min(period)
}

/// A replica that vanished from the announcements is still counted where it was for this
/// long when filling empty stages: it may be moving (it withdrew, and announces on its new
/// stage once it serves there), and peers that do not see it would fill its target again.
const IN_TRANSIT: Duration = Duration::from_secs(5);

/// Checks now and then whether to move to the weakest stage, and moves. An empty stage
/// comes first and is checked for within about a second of serving: peers that started
/// together may all have chosen one stage before any of them had announced, and the swarm
/// cannot train until every stage has a replica ([`select::fill_empty`]).
pub(super) async fn rebalance_loop(
    ctx: Arc<Ctx>,
    slot: Slot,
    moving: Arc<tokio::sync::Mutex<()>>,
    moves: Arc<AtomicU64>,
    period: Duration,
    seed: u64,
) {
    let mut rng = Rng::new(seed);
    let me = ctx.net.local_peer_id().to_string();
    let count = ctx.manifest.config.stages.count;
    let mut fast = true;
    // Fast checks in a row that moved nothing.
    let mut idle = 0;
    let mut seen: std::collections::HashMap<String, (usize, Instant)> = Default::default();
    loop {
        let pause = if fast {
            fill_pause(idle, period)
        } else {
            period * crowd(&slot)
        };
        tokio::time::sleep(pause.mul_f64(0.5 + rng.next_f64())).await;
        let current = slot
            .lock()
            .as_ref()
            .map(|s| (s.service.stage(), s.samples_per_s));
        let Some((mine, tp)) = current else {
            continue;
        };
        if fast {
            // Whether a stage is empty: the joiner's sample (the same replicas it read to
            // choose) answers that, at a third of the full check's reads.
            let Ok(live) = ctx.live(super::serving::JOIN_SAMPLE, None).await else {
                continue;
            };
            let now = Instant::now();
            for a in live.all() {
                seen.insert(a.peer.clone(), (a.stage as usize, now));
            }
            seen.insert(me.clone(), (mine, now));
            seen.retain(|_, (_, at)| now.duration_since(*at) < IN_TRANSIT);
            let placed: Vec<(String, usize)> =
                seen.iter().map(|(p, (s, _))| (p.clone(), *s)).collect();
            // Check again soon while a stage is empty and another has a replica to spare.
            fast = select::fillable(count, &placed);
            // A stage with providers whose announcements could not be read (walks that
            // timed out in a busy swarm) is unknown, not empty: in a swarm of 200, peers
            // that filled such stages piled 70 replicas onto one. (One whose replicas were
            // read and did not answer is empty: filled at once.)
            let unknown = |s: usize| live.unread.get(s).is_some_and(|&n| n > 0);
            idle += 1;
            if let Some(target) = select::fill_empty(count, &placed, &me).filter(|&t| !unknown(t)) {
                idle = 0;
                move_to(
                    &ctx,
                    &slot,
                    &moving,
                    &moves,
                    (mine, target),
                    &live.per_stage,
                )
                .await;
            }
            continue;
        }
        if ctx.target(mine, tp).await.is_none() {
            continue;
        }
        // Confirm after a random pause, so peers that decided together see each other move.
        tokio::time::sleep(period.mul_f64(0.25 * rng.next_f64())).await;
        let Some((target, share, live)) = ctx.target(mine, tp).await else {
            continue;
        };
        // Only the share of the stage that evens it moves (each replica by chance).
        if rng.next_f64() >= share {
            continue;
        }
        move_to(&ctx, &slot, &moving, &moves, (mine, target), &live).await;
        (fast, idle) = (true, 0);
    }
}

/// How many rebalancing periods a replica waits between checks ([`MATES_PER_PERIOD`]).
fn crowd(slot: &Slot) -> u32 {
    let mates = slot.lock().as_ref().map_or(0, |s| {
        s.averager
            .stats()
            .mates
            .load(std::sync::atomic::Ordering::Relaxed)
    });
    (mates / MATES_PER_PERIOD).clamp(1, 60) as u32
}

/// Leaves stage `from` and serves `to` (back to `from` if that fails).
async fn move_to(
    ctx: &Ctx,
    slot: &Slot,
    moving: &tokio::sync::Mutex<()>,
    moves: &AtomicU64,
    (from, to): (usize, usize),
    live: &[Vec<Announcement>],
) {
    let me = ctx.net.local_peer_id().to_string();
    let _guard = moving.lock().await;
    let Some(serving) = slot.lock().take() else {
        return;
    };
    (ctx.emit)(Event::Rebalancing { from, to });
    ctx.leave(serving).await;
    let others = |s: usize| -> Vec<Announcement> {
        live[s].iter().filter(|a| a.peer != me).cloned().collect()
    };
    let serving = match ctx.serve(to, &others(to)).await {
        Ok(s) => {
            moves.fetch_add(1, Ordering::Relaxed);
            Some(s)
        }
        Err(e) => {
            (ctx.emit)(Event::MoveFailed {
                to,
                back: from,
                error: e.to_string(),
            });
            match ctx.serve(from, &others(from)).await {
                Ok(s) => Some(s),
                Err(e) => {
                    (ctx.emit)(Event::ReturnFailed {
                        stage: from,
                        error: e.to_string(),
                    });
                    None
                }
            }
        }
    };
    *slot.lock() = serving;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_checks_that_move_nothing_come_less_and_less_often_up_to_the_period() {
        let period = Duration::from_secs(60);
        let waits: Vec<u64> = (0..9).map(|n| fill_pause(n, period).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        // A short period (tests rebalance every second or two) bounds even the first.
        assert_eq!(
            fill_pause(0, Duration::from_millis(500)),
            Duration::from_millis(500)
        );
        assert_eq!(fill_pause(u32::MAX, period), period);
    }
}
