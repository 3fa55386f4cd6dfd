//! The trainer's view of the swarm, re-read from the DHT every `refresh`: each stage's
//! replicas (minus those half their stage mates banned) with what was measured of them,
//! and each stage's announced step.

use super::routing::ReplicaState;
use super::{Ctx, Table};
use crate::stage::registry;
use libp2p::{Multiaddr, PeerId};
use std::sync::atomic::Ordering;

/// Refreshes come this many times less often once every stage has [`SETTLED_REPLICAS`]
/// replicas: a trainer then learns of dead replicas from its calls, and each refresh is a
/// DHT walk per stage (20 trainers refreshing every second were 80 walks a second in a
/// swarm of 200).
const SETTLED_SLOWDOWN: u32 = 5;
/// Replicas per stage from which the trainer's table counts as settled.
const SETTLED_REPLICAS: usize = 2;
/// With this many replicas in every stage a refresh comes [`CROWDED_SLOWDOWN`] times less
/// often than `refresh`: a replica joining a crowded stage adds little, and the trainer
/// learns of it within 20 s.
const CROWDED_REPLICAS: usize = 8;
/// See [`CROWDED_REPLICAS`].
const CROWDED_SLOWDOWN: u32 = 20;

/// While refreshes keep finding replicas the table did not hold, they come this many
/// times `refresh` apart, however full the table: a swarm is still forming.
const GROWING_SLOWDOWN: u32 = 2;

/// How long until the next refresh: `cfg.refresh`, or [`SETTLED_SLOWDOWN`] (then
/// [`CROWDED_SLOWDOWN`]) times it once every stage has enough replicas in the table —
/// unless the last refresh found new replicas ([`GROWING_SLOWDOWN`]). When 200 peers
/// joined at once a trainer's first reads held the first few replicas of each stage, and
/// at 20 s between refreshes every trainer sent its microbatches to those few (refused
/// `overloaded` again and again, queues of 10 s and more) while the rest idled: no sample
/// finished in the swarm's first ~40 s.
pub(super) fn period(ctx: &Ctx) -> std::time::Duration {
    let fewest = ctx.table.lock().iter().map(Vec::len).min().unwrap_or(0);
    if ctx.grew.load(Ordering::Relaxed) && fewest >= SETTLED_REPLICAS {
        ctx.cfg.refresh * GROWING_SLOWDOWN
    } else if fewest >= CROWDED_REPLICAS {
        ctx.cfg.refresh * CROWDED_SLOWDOWN
    } else if fewest >= SETTLED_REPLICAS {
        ctx.cfg.refresh * SETTLED_SLOWDOWN
    } else {
        ctx.cfg.refresh
    }
}

/// Re-reads the stage announcements into the routing table, keeping what was measured of
/// replicas still announced.
pub(super) async fn refresh(ctx: &Ctx) {
    let net = ctx.client.net();
    // A stage the table holds few replicas of: one of them names its mates (hints the
    // read below looks at besides the providers its walk finds).
    let ask: Vec<(usize, PeerId)> = {
        let table = ctx.table.lock();
        let mut rng = ctx.rng.lock();
        table
            .iter()
            .enumerate()
            .filter(|(_, row)| !row.is_empty() && row.len() < CROWDED_REPLICAS)
            .map(|(s, row)| (s, row[rng.below(row.len() as u64) as usize].0))
            .collect()
    };
    futures::future::join_all(
        ask.into_iter()
            .map(|(s, peer)| ctx.anns.ask_mates(net, (ctx.client.run(), s), peer)),
    )
    .await;
    let how = registry::Reading::cached(&ctx.anns);
    let Ok(per_stage) = registry::read_run_with(net, ctx.client.run(), ctx.stages, &how).await
    else {
        return;
    };
    let mut fresh: Table = Vec::with_capacity(ctx.stages);
    for (s, anns) in per_stage.into_iter().enumerate() {
        // A stage is at least at the step its replicas announce: a trainer that starts
        // after the run's last step sees so before it feeds anything.
        if let (Some(top), Some(seen)) = (
            anns.iter().map(|a| a.step).max(),
            ctx.stats.stage_steps.get(s),
        ) {
            seen.fetch_max(top, Ordering::Relaxed);
        }
        if let Some(n) = ctx.stats.stage_replicas.get(s) {
            n.store(anns.len() as u64, Ordering::Relaxed);
        }
        let mut row = Vec::new();
        for a in &anns {
            // A replica half its stage mates (at least one) banned from their rounds sends
            // bad gradients: its work would be lost, or worse.
            let banners = anns
                .iter()
                .filter(|o| o.peer != a.peer && o.banned.iter().any(|b| b.peer == a.peer))
                .count();
            if banners > 0 && 2 * banners >= anns.len() - 1 {
                continue;
            }
            let Ok(peer) = a.peer.parse::<PeerId>() else {
                continue;
            };
            let addrs: Vec<Multiaddr> = a.addrs.iter().filter_map(|x| x.parse().ok()).collect();
            let _ = net.add_addresses(peer, addrs).await;
            row.push((peer, ReplicaState::announced(a.samples_per_s, a.queue)));
        }
        fresh.push(row);
    }
    let mut table = ctx.table.lock();
    let grew = fresh
        .iter()
        .zip(table.iter())
        .any(|(row, old)| row.iter().any(|(p, _)| !old.iter().any(|(q, _)| q == p)));
    ctx.grew.store(grew, Ordering::Relaxed);
    for (s, row) in fresh.iter_mut().enumerate() {
        // A walk that found less than half the replicas known is more likely a slow or
        // partial DHT lookup (in a busy swarm of 200 many timed out empty) than half a
        // stage gone at once: the known ones stay, and calls find out which are dead.
        if row.len() * 2 < table[s].len() {
            let missing: Vec<_> = table[s]
                .iter()
                .filter(|(p, _)| !row.iter().any(|(q, _)| q == p))
                .cloned()
                .collect();
            row.extend(missing);
        }
        for (peer, st) in row.iter_mut() {
            if let Some((_, old)) = table[s].iter().find(|(p, _)| p == peer) {
                st.measured = old.measured;
                st.in_flight = old.in_flight;
                st.owed = old.owed;
                st.banned_until = old.banned_until;
                // A replica's own answer is fresher than its announcement.
                if ctx.client.counters().last_queue(peer).is_some() {
                    st.queue = old.queue;
                }
            }
        }
    }
    *table = fresh;
}
