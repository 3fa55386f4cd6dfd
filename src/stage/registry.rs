//! The typed DHT operations of a replica and of `shoal status`: the run manifest and the
//! per-stage announcements, over the raw record and provider calls of `net`.

use crate::dht::{self, Announcement, Manifest, ManifestError};
use crate::net::{NetError, NetHandle};
use futures::future::join_all;
use libp2p::PeerId;
use std::time::Duration;

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

/// Publishes an announcement, signed with this peer's key, and provides its stage key and
/// the peers key.
pub async fn announce(net: &NetHandle, ann: &Announcement, ttl: Duration) -> Result<(), NetError> {
    let signed = ann
        .signed(net.identity())
        .map_err(|e| NetError::Dht(e.to_string()))?;
    net.put_record(dht::announcement_key(&ann.peer).into_bytes(), signed, ttl)
        .await?;
    net.start_providing(dht::stage_key(&ann.run, ann.stage as usize).into_bytes())
        .await?;
    net.start_providing(dht::PEERS_KEY.as_bytes().to_vec())
        .await
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
    let providers = net
        .get_providers(dht::stage_key(run, stage).into_bytes())
        .await?;
    let mut anns = read_peers(net, providers).await;
    anns.retain(|a| a.run == run && a.stage as usize == stage);
    anns.sort_by(|a, b| a.peer.cmp(&b.peer));
    Ok(anns)
}

/// The live announcements of every stage of a run, indexed by stage.
pub async fn read_run(
    net: &NetHandle,
    run: &str,
    stages: usize,
) -> Result<Vec<Vec<Announcement>>, NetError> {
    let all = join_all((0..stages).map(|s| read_stage(net, run, s))).await;
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
