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
    let providers = net
        .get_providers_within(dht::stage_key(run, stage).into_bytes(), how.patience)
        .await?;
    let total = providers.len();
    let mut peers: Vec<PeerId> = providers.into_iter().collect();
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
fn sample(peers: &mut Vec<PeerId>, cap: usize, seed: u64) {
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

/// Announcements read lately, by peer. A reader that re-reads its stages every second
/// (a trainer's routing table, an averager's membership) fetches a replica's record again
/// only once its copy is `max_age` old or has expired: in a swarm of 200 the trainers'
/// refreshes were otherwise ~180 record lookups a second each. A peer
/// whose record was not found is not looked up again for [`MISS_AGE`]. The providers are
/// read every time and only theirs are returned, so a replica that withdrew drops out at
/// once (one that died, when its provider record expires), and a new one is read at once.
/// A copy stays cached while its peer is missing from a walk's providers: under load a
/// walk returns a part of them (at 200 peers, averagers dropping and re-reading the rest
/// were 3,000 record lookups a second).
#[derive(Debug, Clone)]
pub struct AnnCache {
    max_age: Duration,
    miss_age: Duration,
    keep_expired: bool,
    inner: std::sync::Arc<parking_lot::Mutex<std::collections::HashMap<PeerId, Cached>>>,
}

/// A peer's announcement as last read (`None`: not found), when, and whether a read got it
/// from the replica itself (an `info` answer).
type Cached = (Option<Announcement>, Instant, bool);

type Instant = tokio::time::Instant;

/// How long a peer whose announcement was not found is not looked up again (its record may
/// not have spread yet, so not long).
pub const MISS_AGE: Duration = Duration::from_secs(15);

/// How old a cached copy that names another stage than the one read must be to be read
/// again (a replica that moved there is seen within it; with a miss's age, 60 s for a
/// rebalancer, a moved replica stayed invisible on its new stage long enough for others
/// to move after it).
pub const MOVED_AGE: Duration = Duration::from_secs(5);

/// Peers an [`AnnCache`] remembers at most (emptied past it).
const CACHED_PEERS: usize = 8192;

impl AnnCache {
    /// Copies are reused for `max_age`; a peer not found is looked up again after
    /// [`MISS_AGE`] (or `max_age` if shorter).
    pub fn new(max_age: Duration) -> Self {
        Self {
            max_age,
            miss_age: MISS_AGE.min(max_age),
            keep_expired: false,
            inner: Default::default(),
        }
    }

    /// Copies are kept for `max_age` even once the announcement expired: for readers that
    /// learn whether the replica is live otherwise (they call it, or it is still a
    /// provider), and refresh the copy from the replica itself ([`Self::refresh`]). In a
    /// stage of 45 an announcement lives 135 s, and readers re-read every copy from the
    /// DHT as often.
    pub fn past_expiry(mut self) -> Self {
        self.keep_expired = true;
        self
    }

    /// Replaces the copy of `peer`'s announcement by `ann`, which the replica itself sent
    /// (an `info` answer over a connection that authenticated it).
    pub fn refresh(&self, peer: PeerId, ann: Announcement) {
        if ann.peer == peer.to_string() {
            self.inner
                .lock()
                .insert(peer, (Some(ann), tokio::time::Instant::now(), false));
        }
    }

    /// Whether `peer` gave its announcement itself (so was live) to a read of this cache
    /// at or after `since`.
    pub fn answered_since(&self, peer: &PeerId, since: Instant) -> bool {
        self.inner
            .lock()
            .get(peer)
            .is_some_and(|(_, at, own)| *own && *at >= since)
    }

    /// A peer not found is looked up again after `d`.
    pub fn missing_for(mut self, d: Duration) -> Self {
        self.miss_age = d;
        self
    }

    /// The announcements of `peers`, providers of `stage` of `run` now, fetching at most
    /// `fetch` (picked at random) of those it holds no usable copy of. A copy that names
    /// another stage or run is read again once it is [`MOVED_AGE`] old: the replica may
    /// have moved here (or away: then its provider record here lingers until it expires,
    /// and its copy is not read at every call meanwhile).
    async fn read(
        &self,
        net: &NetHandle,
        peers: Vec<PeerId>,
        (run, stage): (&str, usize),
        fetch: Option<usize>,
    ) -> Vec<Announcement> {
        let now = tokio::time::Instant::now();
        let mut out = Vec::with_capacity(peers.len());
        let mut stale = Vec::new();
        // Stale peers whose copy names another stage or run.
        let mut elsewhere = std::collections::HashSet::new();
        {
            let mut map = self.inner.lock();
            let now_ms = dht::now_ms();
            map.retain(|_, (a, at, _)| {
                let age = now.duration_since(*at);
                match a {
                    Some(a) => age < self.max_age && (self.keep_expired || a.expires_ms > now_ms),
                    None => age < self.miss_age,
                }
            });
            if map.len() > CACHED_PEERS {
                map.clear();
            }
            for p in peers {
                match map.get(&p) {
                    Some((Some(a), at, _)) if a.run != run || a.stage as usize != stage => {
                        if now.duration_since(*at) >= MOVED_AGE {
                            stale.push(p);
                            elsewhere.insert(p);
                        }
                    }
                    Some((a, _, _)) => out.extend(a.clone()),
                    None => stale.push(p),
                }
            }
        }
        if let Some(most) = fetch {
            sample(&mut stale, most, dht::now_ms());
        }
        let client = crate::stage::client::StageClient::new(
            net.clone(),
            run.to_string(),
            crate::wire::CodecSpec::F32,
        )
        .with_timeout(ASK_TIMEOUT);
        let fetched = join_all(stale.into_iter().map(|p| {
            let client = client.clone();
            let moved = elsewhere.contains(&p);
            async move { (p, ask_or_read(&client, p, stage, moved).await) }
        }))
        .await;
        let mut map = self.inner.lock();
        for (p, f) in fetched {
            let (a, own) = match f {
                Fetched::Own(a) => (Some(a), true),
                Fetched::Read(a) => (a, false),
                // Still where its copy says: the copy stays (a reader of that stage counts
                // it), read again here in another [`MOVED_AGE`].
                Fetched::Elsewhere => {
                    if let Some(e) = map.get_mut(&p) {
                        (e.1, e.2) = (now, false);
                    }
                    continue;
                }
            };
            out.extend(a.clone());
            map.insert(p, (a, now, own));
        }
        out
    }
}

/// How long a reader waits for a replica's own answer before it reads the DHT instead.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// What [`ask_or_read`] found of a peer.
enum Fetched {
    /// Its announcement as the replica itself gave it.
    Own(Announcement),
    /// The DHT's copy, if any.
    Read(Option<Announcement>),
    /// It answered that it serves another stage, as the reader's copy already said.
    Elsewhere,
}

/// `peer`'s announcement as the replica itself tells it (an `info` call on stage
/// `stage`), else the DHT's copy; no walk when it answers that it serves another stage and
/// the reader's copy (`moved`) already names another. A walk for a record is a dozen or
/// more DHT requests, each answered with the twenty peers closest to the key; in a swarm of
/// 200 those answers were the largest share of the CPU, while most readers (stage mates,
/// trainers) are connected to the replica already.
async fn ask_or_read(
    client: &crate::stage::client::StageClient,
    peer: PeerId,
    stage: usize,
    moved: bool,
) -> Fetched {
    match ask_announcement(client, peer, stage).await {
        Ok(Some(own)) => return Fetched::Own(own),
        // It moved away, and its provider record here lingers until it expires: every
        // reader of this stage asked it, was refused and walked the DHT for its record,
        // every few seconds, while the copy it held said as much.
        Err(e) if moved && e.kind() == Some(crate::wire::msg::ErrorKind::WrongStage) => {
            return Fetched::Elsewhere
        }
        _ => {}
    }
    Fetched::Read(read_announcement(client.net(), peer).await)
}

/// The announcement replica `peer` gives of itself in an `info` answer on stage `stage`
/// (checked by [`Announcement::from_info`]); `None` when the answer carries none that
/// checks out, an error when the call failed.
pub async fn ask_announcement(
    client: &crate::stage::client::StageClient,
    peer: PeerId,
    stage: usize,
) -> Result<Option<Announcement>, crate::stage::client::CallError> {
    let r = client.info(peer, stage).await?;
    Ok(r.info
        .as_deref()
        .and_then(|j| Announcement::from_info(j.as_bytes(), &peer.to_string()).ok()))
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

    #[test]
    fn only_answers_since_a_read_began_count_as_that_reads_own() {
        let cache = AnnCache::new(Duration::from_secs(300));
        let (p, q) = (PeerId::random(), PeerId::random());
        let before = Instant::now();
        cache.inner.lock().insert(p, (None, Instant::now(), true));
        std::thread::sleep(Duration::from_millis(2));
        let started = Instant::now();
        assert!(cache.answered_since(&p, before));
        assert!(
            !cache.answered_since(&p, started),
            "an earlier answer is not this read's"
        );
        assert!(!cache.answered_since(&q, before), "q never answered");
        std::thread::sleep(Duration::from_millis(2));
        cache.inner.lock().insert(p, (None, Instant::now(), false));
        assert!(
            !cache.answered_since(&p, started),
            "a copy from the DHT is not an answer"
        );
        cache.inner.lock().insert(p, (None, Instant::now(), true));
        assert!(cache.answered_since(&p, started));
    }
}
