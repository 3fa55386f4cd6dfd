//! The stage mates an `info` answer names ([`crate::wire::msg::Response::mates`]): a
//! reader (a trainer, a joiner) learns a stage's replicas from one of them instead of only
//! from DHT walks, which took 5–14 s each while 200 peers joined at once. The averager
//! keeps the list ([`super::StageService::set_mates`]: the replicas it hears).

use super::Shared;
use crate::wire::msg::{MateHint, INFO_MATES};
use libp2p::PeerId;
use std::sync::atomic::Ordering;

/// Up to [`INFO_MATES`] of the stage's other live replicas (not `asker`), picked at random,
/// with the addresses this peer knows them at.
pub(super) async fn hints(shared: &Shared, asker: PeerId) -> Vec<MateHint> {
    let mut mates: Vec<PeerId> = shared
        .mates
        .lock()
        .iter()
        .filter(|p| **p != asker)
        .copied()
        .collect();
    if mates.len() > INFO_MATES {
        let seed = crate::dht::now_ms() ^ u64::from(shared.queue.load(Ordering::Relaxed));
        mates.sort_by_cached_key(|p| crate::rng::derive_seed(seed, &p.to_string()));
        mates.truncate(INFO_MATES);
    }
    if mates.is_empty() {
        return Vec::new();
    }
    let known = shared
        .pusher
        .net()
        .addresses_of(mates.clone())
        .await
        .unwrap_or_default();
    mates
        .into_iter()
        .map(|p| MateHint {
            peer: p.to_string(),
            addrs: known
                .iter()
                .find(|(q, _)| *q == p)
                .map(|(_, a)| a.iter().take(2).map(|x| x.to_string()).collect())
                .unwrap_or_default(),
        })
        .collect()
}
