//! The typed DHT operations of a replica and of `shoal status`: the run manifest and the
//! per-stage announcements, over the raw record and provider calls of `net`.

use crate::dht::{self, Announcement, Manifest, ManifestError};
use crate::net::{NetError, NetHandle};
use futures::future::join_all;
use libp2p::PeerId;
use std::time::Duration;

pub use super::ann_cache::{announcement_on, ask_announcement, AnnCache, MISS_AGE, MOVED_AGE};

/// Why the run could not be found.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The network failed.
    #[error(transparent)]
    Net(#[from] NetError),
    /// No peer holds the manifest.
    #[error("run {0} was not found in the DHT; start one peer with --run FILE (made by `shoal run new`) first")]
    NotFound(String),
    /// Every copy found was invalid (wrong hash or bad config).
    #[error(transparent)]
    Manifest(#[from] ManifestError),
}

/// Publishes the manifest under its run id.
pub async fn publish_manifest(
    net: &NetHandle,
    m: &Manifest,
    ttl: Duration,
) -> Result<(), NetError> {
    net.put_record(
        dht::manifest_key(&m.id).into_bytes(),
        m.canonical.clone().into_bytes(),
        ttl,
    )
    .await
}

/// Fetches and verifies the manifest of run `id`, retrying until `patience` passes.
pub async fn fetch_manifest(
    net: &NetHandle,
    id: &str,
    patience: Duration,
) -> Result<Manifest, RegistryError> {
    let deadline = tokio::time::Instant::now() + patience;
    let mut last_err = None;
    loop {
        let values = net.get_record(dht::manifest_key(id).into_bytes()).await?;
        for v in &values {
            match Manifest::from_fetched(v, id) {
                Ok(m) => return Ok(m),
                Err(e) => last_err = Some(e),
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(match last_err {
                Some(e) => e.into(),
                None => RegistryError::NotFound(id.to_string()),
            });
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Publishes an announcement, signed with this peer's key; with `provide`, also provides
/// its stage key and the peers key (the DHT then republishes those on its own, so a
/// re-announcement need not), all three at once.
pub async fn announce(
    net: &NetHandle,
    ann: &Announcement,
    ttl: Duration,
    provide: bool,
) -> Result<(), NetError> {
    let signed = ann
        .signed(net.identity())
        .map_err(|e| NetError::Dht(e.to_string()))?;
    let put = net.put_record(dht::announcement_key(&ann.peer).into_bytes(), signed, ttl);
    if !provide {
        return put.await;
    }
    let stage = net.start_providing(dht::stage_key(&ann.run, ann.stage as usize).into_bytes());
    let peers = net.start_providing(dht::PEERS_KEY.as_bytes().to_vec());
    tokio::try_join!(put, stage, peers).map(|_| ())
}

/// Withdraws an announcement locally (remote copies expire on their own).
pub async fn withdraw(net: &NetHandle, ann: &Announcement) -> Result<(), NetError> {
    net.remove_record(dht::announcement_key(&ann.peer).into_bytes())
        .await?;
    net.stop_providing(dht::stage_key(&ann.run, ann.stage as usize).into_bytes())
        .await?;
    net.stop_providing(dht::PEERS_KEY.as_bytes().to_vec()).await
}

/// The freshest valid announcement of `peer`, if any.
pub async fn read_announcement(net: &NetHandle, peer: PeerId) -> Option<Announcement> {
    let id = peer.to_string();
    let values = net
        .get_record(dht::announcement_key(&id).into_bytes())
        .await
        .ok()?;
    let now = dht::now_ms();
    values
        .iter()
        .filter_map(|v| Announcement::from_bytes(v, &id, now).ok())
        .max_by_key(|a| a.issued_ms)
}

async fn read_peers(net: &NetHandle, peers: impl IntoIterator<Item = PeerId>) -> Vec<Announcement> {
    join_all(peers.into_iter().map(|p| read_announcement(net, p)))
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// The live announcements of one stage of a run.
pub async fn read_stage(
    net: &NetHandle,
    run: &str,
    stage: usize,
) -> Result<Vec<Announcement>, NetError> {
    read_stage_with(net, run, stage, &Reading::default()).await
}

/// How a reader reads a stage: with a cache of announcements read lately, and at most so
/// many of them.
#[derive(Debug, Clone, Default)]
pub struct Reading {
    /// Reuse announcements read less than its age ago.
    pub cache: Option<AnnCache>,
    /// Read at most this many of the stage's providers, picked at random with this seed.
    pub sample: Option<(usize, u64)>,
    /// End the provider walk after this long, with the providers found by then.
    pub patience: Option<Duration>,
}

impl Reading {
    /// Every provider, through `cache`.
    pub fn cached(cache: &AnnCache) -> Self {
        Self {
            cache: Some(cache.clone()),
            sample: None,
            patience: None,
        }
    }
}

/// How long a provider walk is waited for when the stage's replicas have named mates.
const HINTED_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);

/// [`read_stage`] as `how` says.
pub async fn read_stage_with(
    net: &NetHandle,
    run: &str,
    stage: usize,
    how: &Reading,
) -> Result<Vec<Announcement>, NetError> {
    Ok(read_stage_counted(net, run, stage, how).await?.0)
}

/// [`read_stage_with`], and how many providers the stage has (more than returned when
/// sampled).
pub async fn read_stage_counted(
    net: &NetHandle,
    run: &str,
    stage: usize,
    how: &Reading,
) -> Result<(Vec<Announcement>, usize), NetError> {
    // Mates the stage's replicas named in their answers count as providers not found yet;
    // with some, a slow walk is not waited for to its end (a busy DHT's walks ran into
    // the 10-s query timeout).
    let hints = how
        .cache
        .as_ref()
        .map(|c| c.hints(run, stage))
        .unwrap_or_default();
    let patience = match how.patience {
        _ if hints.is_empty() => how.patience,
        Some(p) => Some(p.min(HINTED_PATIENCE)),
        None => Some(HINTED_PATIENCE),
    };
    let providers = net
        .get_providers_within(dht::stage_key(run, stage).into_bytes(), patience)
        .await?;
    let mut peers: Vec<PeerId> = providers.into_iter().collect();
    for p in hints {
        if !peers.contains(&p) {
            peers.push(p);
        }
    }
    let total = peers.len();
    if let Some((cap, seed)) = how.sample {
        sample(&mut peers, cap, seed);
    }
    let mut anns = match &how.cache {
        Some(c) => c.read(net, peers, (run, stage), None).await,
        None => read_peers(net, peers).await,
    };
    anns.retain(|a| a.run == run && a.stage as usize == stage);
    anns.sort_by(|a, b| a.peer.cmp(&b.peer));
    Ok((anns, total))
}

/// Keeps at most `cap` of `peers`: those ranked first by a hash of `seed` and the peer id.
/// A reader that samples with the same seed keeps the same peers while they stay providers
/// (a newcomer takes a place only if it ranks before one of them), so its cached copies of
/// their announcements are read again, not new ones at every sample.
pub(super) fn sample(peers: &mut Vec<PeerId>, cap: usize, seed: u64) {
    if peers.len() > cap {
        peers.sort_by_cached_key(|p| crate::rng::derive_seed(seed, &p.to_string()));
        peers.truncate(cap);
    }
}

/// The replicas of `stage`: its providers that are in `heard` (replicas whose own
/// messages reached the reader: a connection to them exists, and their record need not be
/// read) or have a live announcement (read through `cache`), each with the addresses that
/// gives. A provider that died drops out once its announcement expires and it is not
/// heard from; an averager reads its stage mates' records about once, when they join, and
/// at most `reads` records it has no copy of per call (a replica joining a stage of 45
/// read 44 records at once, 7,800 walks when 177 joined together; it learns the others
/// from the mates it reaches, [`crate::wire::msg::AvgMsg::Mates`]).
pub async fn stage_members(
    net: &NetHandle,
    run: &str,
    stage: usize,
    heard: &std::collections::HashSet<PeerId>,
    cache: &AnnCache,
    reads: usize,
) -> Result<Vec<(PeerId, Vec<libp2p::Multiaddr>)>, NetError> {
    let providers = net
        .get_providers(dht::stage_key(run, stage).into_bytes())
        .await?;
    let unheard = providers.iter().filter(|p| !heard.contains(p)).copied();
    let anns = cache
        .read(net, unheard.collect(), (run, stage), Some(reads))
        .await;
    Ok(providers
        .into_iter()
        .filter_map(|p| {
            let id = p.to_string();
            match anns.iter().find(|a| a.peer == id) {
                // A replica that moved away still has provider records here until they
                // expire; its announcement says where it went.
                Some(a) if a.run != run || a.stage as usize != stage => None,
                Some(a) => Some((p, a.addrs.iter().filter_map(|x| x.parse().ok()).collect())),
                None => heard.contains(&p).then(|| (p, Vec::new())),
            }
        })
        .collect())
}

/// The live announcements of every stage of a run, indexed by stage.
pub async fn read_run(
    net: &NetHandle,
    run: &str,
    stages: usize,
) -> Result<Vec<Vec<Announcement>>, NetError> {
    read_run_with(net, run, stages, &Reading::default()).await
}

/// [`read_run`] as `how` says.
pub async fn read_run_with(
    net: &NetHandle,
    run: &str,
    stages: usize,
    how: &Reading,
) -> Result<Vec<Vec<Announcement>>, NetError> {
    let all = join_all((0..stages).map(|s| read_stage_with(net, run, s, how))).await;
    all.into_iter().collect()
}

/// Every live announcement of any run (through the peers key).
pub async fn read_all(net: &NetHandle) -> Result<Vec<Announcement>, NetError> {
    let providers = net
        .get_providers(dht::PEERS_KEY.as_bytes().to_vec())
        .await?;
    let mut anns = read_peers(net, providers).await;
    anns.sort_by(|a, b| (a.stage, &a.peer).cmp(&(b.stage, &b.peer)));
    Ok(anns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sample_keeps_its_peers_while_they_provide() {
        let peers: Vec<PeerId> = (0..40).map(|_| PeerId::random()).collect();
        let mut first = peers.clone();
        sample(&mut first, 16, 7);
        assert_eq!(first.len(), 16);
        // The providers found in another order, one more among them: at most one of the
        // sample changes (the newcomer, if it ranks before one of them).
        let mut again: Vec<PeerId> = peers.iter().rev().copied().collect();
        again.push(PeerId::random());
        sample(&mut again, 16, 7);
        let kept = again.iter().filter(|p| first.contains(p)).count();
        assert!(kept >= 15, "only {kept} of 16 kept");
        // Another seed samples others.
        let mut other = peers.clone();
        sample(&mut other, 16, 8);
        assert_ne!(other, first);
        // Fewer providers than the cap: all of them.
        let mut few = peers[..5].to_vec();
        sample(&mut few, 16, 7);
        assert_eq!(few.len(), 5);
    }
}
