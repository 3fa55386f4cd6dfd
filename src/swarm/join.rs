//! Joining a swarm and staying in it: dialling the bootstrap addresses with backoff, and
//! re-dialling the ones a running peer lost, so peers that started apart (or lost their
//! only link) end up in one DHT; taking up the run (its manifest fetched, and kept alive in
//! the DHT). Also the background tasks a peer holds.

use super::peer::{PeerConfig, PeerError, RunSource, MANIFEST_TTL};
use crate::dht::{self, Manifest};
use crate::net::{self, NetHandle};
use crate::stage::registry;
use crate::tasks::Tasks;
use libp2p::Multiaddr;
use std::time::Duration;

/// How long [`join`] keeps trying the bootstrap addresses before it gives up.
pub const BOOTSTRAP_PATIENCE: Duration = Duration::from_secs(8);
/// How often a peer checks that it is still connected to its bootstrap peers.
pub const REJOIN_EVERY: Duration = Duration::from_secs(30);

/// Dials every bootstrap address; succeeds if at least one answers. While none does, it
/// tries again with backoff (0.5 s, 1 s, 2 s, ...) for [`BOOTSTRAP_PATIENCE`]. A peer of
/// another wire version is not retried: its refusal is the answer.
pub async fn join(net: &NetHandle, bootstrap: &[Multiaddr]) -> Result<(), PeerError> {
    if bootstrap.is_empty() {
        return Ok(());
    }
    let deadline = tokio::time::Instant::now() + BOOTSTRAP_PATIENCE;
    let mut backoff = Duration::from_millis(500);
    loop {
        if let Some(errors) = dial_first(net, bootstrap).await {
            let refused = errors.iter().all(|(_, refused)| *refused);
            let now = tokio::time::Instant::now();
            if refused || now + backoff > deadline {
                let errors: Vec<String> = errors.into_iter().map(|(e, _)| e).collect();
                return Err(PeerError::Bootstrap(errors.join("; ")));
            }
            tracing::debug!(target: "shoal::peer", "no bootstrap peer answered; trying again in {backoff:?}");
            tokio::time::sleep(backoff).await;
            backoff *= 2;
            continue;
        }
        // No bootstrap of our own: Kademlia starts one half a second after a bootstrap
        // peer enters its routing table while that holds fewer than 20 peers (as a
        // joiner's does), and a second one here was ~7 more walks per joiner, ~1,400 as
        // 200 peers joined at once.
        return Ok(());
    }
}

/// The run this peer takes part in: `from_file` (the peer publishes it), or the manifest
/// fetched from the DHT by the id `cfg.run` names (stored again beside the start); either
/// way kept alive in the DHT for as long as `tasks` run.
pub(super) async fn take_up_run(
    net: &NetHandle,
    cfg: &PeerConfig,
    from_file: Option<Manifest>,
    tasks: &Tasks,
) -> Result<Manifest, PeerError> {
    let fetched = from_file.is_none();
    let manifest = match (from_file, &cfg.run) {
        (Some(m), _) => m,
        (None, RunSource::Id(id)) => {
            registry::fetch_manifest(net, id, Duration::from_secs(10)).await?
        }
        (None, RunSource::File(p)) => Manifest::load(p)?,
    };
    let ttl = cfg.announce_ttl.max(MANIFEST_TTL);
    // The run's publisher stores the manifest before anything else; a joiner stores the
    // copy it found beside its start, not before it (the walk took seconds of every
    // joiner's start when 200 joined at once).
    if fetched {
        let (net, manifest) = (net.clone(), manifest.clone());
        tasks.spawn(async move {
            if let Err(e) = registry::publish_manifest(&net, &manifest, ttl).await {
                tracing::warn!(target: "shoal::peer", "cannot store the manifest: {e}");
            }
        });
    } else {
        registry::publish_manifest(net, &manifest, ttl).await?;
    }
    // Every peer keeps the manifest alive (a bootstrap that serves no stage too), each
    // at its own random times within a third of the record's TTL.
    {
        let (net, manifest) = (net.clone(), manifest.clone());
        let mut rng = crate::rng::Rng::new(crate::rng::derive_seed(
            dht::now_ms(),
            &net.local_peer_id().to_string(),
        ));
        tasks.spawn(async move {
            loop {
                let period = (ttl / 3).mul_f64(0.5 + rng.next_f64() / 2.0);
                tokio::time::sleep(period.max(Duration::from_millis(200))).await;
                if let Err(e) = registry::publish_manifest(&net, &manifest, ttl).await {
                    tracing::warn!(target: "shoal::peer", "cannot republish the manifest: {e}");
                }
            }
        });
    }
    Ok(manifest)
}

/// Dials every address at once and returns as soon as one answers (`None`; the other dials
/// go on in the background), or with every failure. A swarm's few bootstrap peers are
/// busiest while many peers join at once: waiting for all of them made a joiner wait for
/// the slowest.
async fn dial_first(net: &NetHandle, addrs: &[Multiaddr]) -> Option<Vec<(String, bool)>> {
    let mut dials: futures::stream::FuturesUnordered<_> = addrs
        .iter()
        .map(|a| {
            let (net, a) = (net.clone(), a.clone());
            tokio::spawn(async move { dial_one(&net, a).await })
        })
        .collect();
    let mut errors = Vec::new();
    while let Some(r) = futures::StreamExt::next(&mut dials).await {
        match r {
            Ok(None) => return None,
            Ok(Some(e)) => errors.push(e),
            Err(e) => errors.push((e.to_string(), false)),
        }
    }
    Some(errors)
}

async fn dial_one(net: &NetHandle, a: Multiaddr) -> Option<(String, bool)> {
    match tokio::time::timeout(Duration::from_secs(15), net.dial(a.clone())).await {
        Ok(Ok(_)) => None,
        Ok(Err(e)) => Some((e.to_string(), matches!(e, net::NetError::Refused { .. }))),
        Err(_) => Some((format!("{a}: no answer in 15 s"), false)),
    }
}

/// Dials every address at once; the failures, each with whether it was a refusal.
async fn dial_all(net: &NetHandle, addrs: &[Multiaddr]) -> Vec<(String, bool)> {
    let dials = futures::future::join_all(addrs.iter().map(|a| dial_one(net, a.clone()))).await;
    dials.into_iter().flatten().collect()
}

/// Every `every` ([`REJOIN_EVERY`] by default), dials the bootstrap peers this peer lost its connection to and
/// refreshes the DHT through them: peers that bootstrapped apart (or lost their only link
/// to the rest) join the one swarm again instead of living on as separate DHTs.
pub(super) async fn rejoin_loop(net: NetHandle, bootstrap: Vec<Multiaddr>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let Ok(conns) = net.connections().await else {
            return;
        };
        let lost: Vec<Multiaddr> = bootstrap
            .iter()
            .filter(|a| match net::peer_of(a) {
                Some(p) => !conns.iter().any(|c| c.peer == p),
                None => conns.is_empty(),
            })
            .cloned()
            .collect();
        if lost.is_empty() {
            continue;
        }
        let failed = dial_all(&net, &lost).await;
        if failed.len() < lost.len() {
            tracing::info!(target: "shoal::peer", "rejoined through {} bootstrap peer(s)", lost.len() - failed.len());
            if net.bootstrap().await.is_err() {
                return;
            }
        }
    }
}
