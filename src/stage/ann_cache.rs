//! The copies of announcements a reader keeps ([`AnnCache`]), and how a copy is fetched:
//! from the replica itself (an `info` answer, over a connection that authenticated it),
//! or from the DHT when the replica could not be reached.

use super::registry::{read_announcement, sample};
use crate::dht::{self, Announcement};
use crate::net::{NetError, NetHandle};
use crate::stage::client::CallError;
use futures::future::join_all;
use libp2p::PeerId;
use std::time::Duration;

/// Announcements read lately, by peer. A reader that re-reads its stages every second
/// (a trainer's routing table, an averager's membership) fetches a replica's record again
/// only once its copy is `max_age` old or has expired: in a swarm of 200 the trainers'
/// refreshes were otherwise ~180 record lookups a second each. A peer whose record was not
/// found is looked up again after 2 s, then after twice as long at each miss in a row, up
/// to the cache's miss age ([`MISS_AGE`] unless set; `miss_wait`). The providers are
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
    /// Stage mates the replicas' own answers named ([`crate::wire::msg::Response::mates`]),
    /// by run and stage, with when they were last named.
    hints: std::sync::Arc<parking_lot::Mutex<Hints>>,
}

type Hints = std::collections::HashMap<(String, usize), std::collections::HashMap<PeerId, Instant>>;

/// How long a mate named in an answer counts as a replica of its stage to look at.
const HINT_AGE: Duration = Duration::from_secs(60);

/// Mates remembered per stage, at most.
const HINTS_PER_STAGE: usize = 512;

/// A peer's announcement as last read.
#[derive(Debug, Clone)]
struct Cached {
    /// The announcement; `None`: not found.
    ann: Option<Announcement>,
    /// When it was read.
    at: Instant,
    /// Whether a read got it from the replica itself (an `info` answer).
    own: bool,
    /// Reads in a row that found nothing (0 with a copy).
    misses: u32,
}

impl Cached {
    fn new(ann: Option<Announcement>, at: Instant, own: bool) -> Self {
        Self {
            ann,
            at,
            own,
            misses: 0,
        }
    }
}

type Instant = tokio::time::Instant;

/// How long a peer whose announcement was not found is not looked up again (its record may
/// not have spread yet, so not long). The first misses in a row wait less
/// ([`miss_wait`]).
pub const MISS_AGE: Duration = Duration::from_secs(15);

/// The shortest wait before a peer not found is looked up again ([`miss_wait`]).
const FIRST_MISS_WAIT: Duration = Duration::from_secs(2);

/// How long a peer whose announcement was not found `misses` times in a row waits before it
/// is looked up again: [`FIRST_MISS_WAIT`], doubled per further miss, up to `most`. While
/// 200 peers joined at once, most replicas' answers and records were still missing at the
/// trainers' first reads; waiting a whole minute after each left their tables empty for
/// the swarm's first minute.
fn miss_wait(misses: u32, most: Duration) -> Duration {
    FIRST_MISS_WAIT
        .saturating_mul(1 << misses.saturating_sub(1).min(16))
        .min(most)
}

/// How old a cached copy that names another stage than the one read must be to be read
/// again (a replica that moved there is seen within it; with a miss's age, 60 s for a
/// rebalancer, a moved replica stayed invisible on its new stage long enough for others
/// to move after it).
pub const MOVED_AGE: Duration = Duration::from_secs(5);

/// Peers an [`AnnCache`] remembers at most (emptied past it).
const CACHED_PEERS: usize = 8192;

impl AnnCache {
    /// Copies are reused for `max_age`; a peer not found waits at most [`MISS_AGE`] (or
    /// `max_age` if shorter) before it is looked up again.
    pub fn new(max_age: Duration) -> Self {
        Self {
            max_age,
            miss_age: MISS_AGE.min(max_age),
            keep_expired: false,
            inner: Default::default(),
            hints: Default::default(),
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
            self.inner.lock().insert(
                peer,
                Cached::new(Some(ann), tokio::time::Instant::now(), false),
            );
        }
    }

    /// Whether `peer` gave its announcement itself (so was live) to a read of this cache
    /// at or after `since`.
    pub fn answered_since(&self, peer: &PeerId, since: Instant) -> bool {
        self.inner
            .lock()
            .get(peer)
            .is_some_and(|c| c.own && c.at >= since)
    }

    /// The stage mates of `stage` of `run` that replicas' own answers named lately: a reader
    /// looks at them besides the stage's providers. While 200 peers joined at once a
    /// trainer's provider walks took 5–14 s and found a replica or two per stage for the
    /// swarm's first 20 s; one answer of a replica names up to 16 of its mates.
    pub fn hints(&self, run: &str, stage: usize) -> Vec<PeerId> {
        let now = Instant::now();
        let mut h = self.hints.lock();
        let Some(m) = h.get_mut(&(run.to_string(), stage)) else {
            return Vec::new();
        };
        m.retain(|_, at| now.duration_since(*at) < HINT_AGE);
        m.keys().copied().collect()
    }

    /// Asks `peer`, a replica of `stage` of `run`, for its announcement and the mates it
    /// names (kept as [`hints`](Self::hints)); its answer refreshes its copy here.
    pub async fn ask_mates(&self, net: &NetHandle, (run, stage): (&str, usize), peer: PeerId) {
        if let Ok(Some((ann, mates))) = ask_with_mates(&asking_client(net, run), peer, stage).await
        {
            self.note_mates(net, (run, stage), &mates).await;
            self.inner
                .lock()
                .insert(peer, Cached::new(Some(ann), Instant::now(), true));
        }
    }

    /// Keeps `mates`, named by a replica of `stage` of `run`, as hints, and the addresses
    /// given for them.
    async fn note_mates(
        &self,
        net: &NetHandle,
        (run, stage): (&str, usize),
        mates: &[crate::wire::msg::MateHint],
    ) {
        let named: Vec<(PeerId, Vec<libp2p::Multiaddr>)> = mates
            .iter()
            .filter_map(|m| {
                let peer = m.peer.parse::<PeerId>().ok()?;
                let addrs = m
                    .addrs
                    .iter()
                    .take(2)
                    .filter_map(|x| x.parse().ok())
                    .collect();
                Some((peer, addrs))
            })
            .collect();
        let peers: Vec<PeerId> = named.iter().map(|(p, _)| *p).collect();
        self.hinted((run, stage), &peers);
        for (peer, addrs) in named {
            if !addrs.is_empty() {
                let _ = net.add_addresses(peer, addrs).await;
            }
        }
    }

    /// Notes the mates a replica of `stage` of `run` named.
    fn hinted(&self, (run, stage): (&str, usize), mates: &[PeerId]) {
        let now = Instant::now();
        let mut h = self.hints.lock();
        let m = h.entry((run.to_string(), stage)).or_default();
        for p in mates {
            if m.len() < HINTS_PER_STAGE || m.contains_key(p) {
                m.insert(*p, now);
            }
        }
    }

    /// A peer not found waits at most `d` before it is looked up again (the first misses
    /// in a row wait less: `miss_wait`).
    pub fn missing_for(mut self, d: Duration) -> Self {
        self.miss_age = d;
        self
    }

    /// The announcements of `peers`, providers of `stage` of `run` now, fetching at most
    /// `fetch` (picked at random) of those it holds no usable copy of. A copy that names
    /// another stage or run is read again once it is [`MOVED_AGE`] old: the replica may
    /// have moved here (or away: then its provider record here lingers until it expires,
    /// and its copy is not read at every call meanwhile).
    pub(super) async fn read(
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
        let moved = |a: &Announcement| a.run != run || a.stage as usize != stage;
        {
            let mut map = self.inner.lock();
            let now_ms = dht::now_ms();
            // A miss is kept past its wait (read again then) so that the next counts on.
            map.retain(|_, c| {
                let age = now.duration_since(c.at);
                match &c.ann {
                    Some(a) => age < self.max_age && (self.keep_expired || a.expires_ms > now_ms),
                    None => age < 2 * self.miss_age,
                }
            });
            if map.len() > CACHED_PEERS {
                map.clear();
            }
            for p in peers {
                let Some(c) = map.get(&p) else {
                    stale.push(p);
                    continue;
                };
                let age = now.duration_since(c.at);
                match &c.ann {
                    Some(a) if moved(a) && age >= MOVED_AGE => {
                        stale.push(p);
                        elsewhere.insert(p);
                    }
                    Some(a) if moved(a) => {}
                    Some(a) => out.push(a.clone()),
                    None if age >= miss_wait(c.misses, self.miss_age) => stale.push(p),
                    None => {}
                }
            }
        }
        if let Some(most) = fetch {
            sample(&mut stale, most, dht::now_ms());
        }
        let client = asking_client(net, run);
        let fetched = join_all(stale.into_iter().map(|p| {
            let client = client.clone();
            let moved = elsewhere.contains(&p);
            async move { (p, ask_or_read(&client, p, stage, moved).await) }
        }))
        .await;
        for (_, f) in &fetched {
            if let Fetched::Own(_, mates) = f {
                if !mates.is_empty() {
                    self.note_mates(net, (run, stage), mates).await;
                }
            }
        }
        let mut map = self.inner.lock();
        for (p, f) in fetched {
            let (a, own) = match f {
                Fetched::Own(a, _) => (Some(a), true),
                Fetched::Read(a) => (a, false),
                Fetched::Unanswered => (None, false),
                // Still where its copy says: the copy stays (a reader of that stage counts
                // it), read again here in another [`MOVED_AGE`].
                Fetched::Elsewhere => {
                    if let Some(c) = map.get_mut(&p) {
                        (c.at, c.own) = (now, false);
                    }
                    continue;
                }
            };
            let misses = match (&a, map.get(&p)) {
                (None, Some(c)) if c.ann.is_none() => c.misses + 1,
                (None, _) => 1,
                (Some(_), _) => 0,
            };
            out.extend(a.clone());
            map.insert(
                p,
                Cached {
                    misses,
                    ..Cached::new(a, now, own)
                },
            );
        }
        out
    }
}

/// How long a reader waits for a replica's own answer before it reads the DHT instead.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// A client for the `info` calls that ask replicas of `run` for their announcements.
fn asking_client(net: &NetHandle, run: &str) -> crate::stage::client::StageClient {
    crate::stage::client::StageClient::new(
        net.clone(),
        run.to_string(),
        crate::wire::CodecSpec::F32,
    )
    .with_timeout(ASK_TIMEOUT)
}

/// What [`ask_or_read`] found of a peer.
enum Fetched {
    /// Its announcement as the replica itself gave it, and the mates it named.
    Own(Announcement, Vec<crate::wire::msg::MateHint>),
    /// The DHT's copy, if any.
    Read(Option<Announcement>),
    /// It answered that it serves another stage, as the reader's copy already said.
    Elsewhere,
    /// It did not answer with an announcement (the call timed out or was refused, or the
    /// answer carried none); the DHT was not read.
    Unanswered,
}

/// `peer`'s announcement as the replica itself tells it (an `info` call on stage
/// `stage`); the DHT's copy only when it could not be reached (the copy may carry
/// addresses that reach it); [`Fetched::Elsewhere`] when it answers that it serves another
/// stage, as the reader's copy (`moved`) said. A walk for a record is a dozen or
/// more DHT requests, each answered with the twenty peers closest to the key; in a swarm of
/// 200 those answers were the largest share of the CPU, while most readers (stage mates,
/// trainers) are connected to the replica already.
async fn ask_or_read(
    client: &crate::stage::client::StageClient,
    peer: PeerId,
    stage: usize,
    moved: bool,
) -> Fetched {
    match ask_with_mates(client, peer, stage).await {
        Ok(Some((own, mates))) => return Fetched::Own(own, mates),
        // It moved away, and its provider record here lingers until it expires: every
        // reader of this stage asked it, was refused and walked the DHT for its record,
        // every few seconds, while the copy it held said as much.
        Err(e) if moved && e.kind() == Some(crate::wire::msg::ErrorKind::WrongStage) => {
            return Fetched::Elsewhere
        }
        // Its record may carry addresses that reach it.
        Err(CallError::Net(NetError::Unreachable { .. })) => {}
        // It is there and did not answer in time, or answered without an announcement
        // (it is starting, or leaving), or serves another stage now (where readers of
        // that stage find it): its record, if any, tells no more. While 200 peers joined
        // at once, most asks timed out on the busy cores and each was followed by a walk
        // for the record, ~2,000 DHT requests a second.
        _ => return Fetched::Unanswered,
    }
    Fetched::Read(read_announcement(client.net(), peer).await)
}

/// `peer`'s announcement if it serves `stage` of `run`: as the replica itself gives it (an
/// `info` call), or the DHT's copy when it cannot be reached; `None` when it answers that
/// it serves another stage or without an announcement, does not answer in time, or no copy
/// is found. For a peer this one exchanges stage calls with (connected, or about
/// to be): a replica checking its neighbours walked the DHT once per peer of the stages
/// beside it, 10–20 record walks a second in a swarm of 200.
pub async fn announcement_on(
    net: &NetHandle,
    run: &str,
    peer: PeerId,
    stage: usize,
) -> Option<Announcement> {
    match ask_or_read(&asking_client(net, run), peer, stage, true).await {
        Fetched::Own(a, _) => Some(a),
        Fetched::Read(a) => a,
        Fetched::Elsewhere | Fetched::Unanswered => None,
    }
}

/// The announcement replica `peer` gives of itself in an `info` answer on stage `stage`
/// (checked by [`Announcement::from_info`]); `None` when the answer carries none that
/// checks out, an error when the call failed.
pub async fn ask_announcement(
    client: &crate::stage::client::StageClient,
    peer: PeerId,
    stage: usize,
) -> Result<Option<Announcement>, crate::stage::client::CallError> {
    Ok(ask_with_mates(client, peer, stage).await?.map(|(a, _)| a))
}

/// [`ask_announcement`], and the stage mates the replica named with it.
async fn ask_with_mates(
    client: &crate::stage::client::StageClient,
    peer: PeerId,
    stage: usize,
) -> Result<Option<(Announcement, Vec<crate::wire::msg::MateHint>)>, crate::stage::client::CallError>
{
    let r = client.info(peer, stage).await?;
    let ann = r
        .info
        .as_deref()
        .and_then(|j| Announcement::from_info(j.as_bytes(), &peer.to_string()).ok());
    Ok(ann.map(|a| (a, r.mates)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_answers_since_a_read_began_count_as_that_reads_own() {
        let cache = AnnCache::new(Duration::from_secs(300));
        let (p, q) = (PeerId::random(), PeerId::random());
        let before = Instant::now();
        cache
            .inner
            .lock()
            .insert(p, Cached::new(None, Instant::now(), true));
        std::thread::sleep(Duration::from_millis(2));
        let started = Instant::now();
        assert!(cache.answered_since(&p, before));
        assert!(
            !cache.answered_since(&p, started),
            "an earlier answer is not this read's"
        );
        assert!(!cache.answered_since(&q, before), "q never answered");
        std::thread::sleep(Duration::from_millis(2));
        cache
            .inner
            .lock()
            .insert(p, Cached::new(None, Instant::now(), false));
        assert!(
            !cache.answered_since(&p, started),
            "a copy from the DHT is not an answer"
        );
        cache
            .inner
            .lock()
            .insert(p, Cached::new(None, Instant::now(), true));
        assert!(cache.answered_since(&p, started));
    }

    #[test]
    fn a_peer_not_found_is_looked_up_again_soon_then_less_and_less_often() {
        let most = Duration::from_secs(60);
        let waits: Vec<u64> = (1..=7).map(|n| miss_wait(n, most).as_secs()).collect();
        assert_eq!(waits, [2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(miss_wait(u32::MAX, most), most);
        // A cache whose misses wait less than the first wait: that.
        assert_eq!(miss_wait(1, Duration::from_secs(1)), Duration::from_secs(1));
    }
}
