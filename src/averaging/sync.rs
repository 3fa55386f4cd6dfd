//! State download for a joining (or lagging) replica: parameters and optimizer moments in
//! chunks, spread over every donor that holds the same snapshot, each chunk hash-checked,
//! and the whole state checked against its root hash.
//!
//! Donors are asked one after another (each is locked while it writes its snapshot), and
//! the download starts with the first offer; only donors whose snapshots agree (same step,
//! size, chunking and root hash) are used together, a late one joining as it offers. The
//! chunk hashes come in pages ([`HASH_PAGE`] per call), from one donor at a time until a
//! complete list matches the root; so the list of a state of any size never has to fit in
//! one message. Chunks come from a shared queue: each donor works through it with a few
//! calls in flight, writing each verified chunk into its place in the state's parts. A
//! chunk that fails goes back to the queue for the others (a download resumes from what it
//! has when a donor dies); a donor that served a chunk with the wrong hash is not asked
//! again in this download.

use crate::rng::Rng;
use crate::stage::client::StageClient;
use crate::stage::replica::{Parts, Snapshot, PART};
use crate::wire::msg::{StateInfo, HASH_PAGE};
use futures::stream::{FuturesUnordered, StreamExt};
use libp2p::PeerId;
use parking_lot::Mutex;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// Why no state could be downloaded.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// No donor answered.
    #[error("no replica answered a state request ({0})")]
    NoDonor(String),
    /// A chunk could not be fetched from any donor.
    #[error("chunk {index} could not be fetched from any donor: {cause}")]
    Chunk {
        /// The chunk.
        index: u32,
        /// The last error.
        cause: String,
    },
    /// The snapshot's size does not fit this stage.
    #[error("donors offer {got} values, this stage needs {want}")]
    Size {
        /// Floats offered.
        got: u64,
        /// Floats expected.
        want: usize,
    },
    /// No donor gave a chunk list that matches the state's root hash.
    #[error("no donor's chunk hashes match the state's root hash ({0})")]
    Corrupt(String),
}

/// What a download did.
#[derive(Debug, Clone)]
pub struct SyncReport {
    /// The donors used.
    pub donors: Vec<PeerId>,
    /// Chunks fetched from each donor, in `donors` order.
    pub chunks_per_donor: Vec<usize>,
    /// Donors dropped for serving a chunk that failed its hash.
    pub banned: Vec<PeerId>,
    /// Seconds before the first chunk was asked for (offers and chunk hashes).
    pub setup_s: f64,
}

/// Floats per state chunk (1 MiB) unless the run sets `averaging.state_chunk_floats`.
pub const STATE_CHUNK: usize = 256 << 10;

/// Chunk calls each donor has in flight, so a link's latency does not idle it.
const PER_DONOR: usize = 8;

/// Failed calls in a row after which a donor is given up for this download.
const DONOR_FAILURES: usize = 3;

/// The hash of one state chunk, as donors list it and joiners check it.
pub fn chunk_hash(values: &[f32]) -> String {
    format!(
        "{:016x}",
        xxhash_rust::xxh3::xxh3_64(bytemuck::cast_slice(values))
    )
}

/// The hash of a whole state: of its chunk hashes, in order.
pub fn root_hash(hashes: &[String]) -> String {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for c in hashes {
        h.update(c.as_bytes());
    }
    format!("{:016x}", h.digest())
}

/// Whether an offer is self-consistent and fits a stage of `want_len` floats.
fn check_offer(info: &StateInfo, want_len: usize) -> Result<(), SyncError> {
    let consistent = info.chunk > 0 && info.chunks == info.len.div_ceil(info.chunk.max(1));
    if info.len as usize != want_len || !consistent {
        return Err(SyncError::Size {
            got: info.len,
            want: want_len,
        });
    }
    Ok(())
}

/// The chunk list of `info`, from the first donor whose pages match its root hash.
async fn fetch_hashes(
    client: &StageClient,
    stage: usize,
    info: &StateInfo,
    donors: &[PeerId],
) -> Result<Vec<String>, SyncError> {
    let pages = (info.chunks as usize).div_ceil(HASH_PAGE);
    let mut why = Vec::new();
    for &d in donors {
        let mut hashes = Vec::with_capacity(info.chunks as usize);
        let mut failed = None;
        for page in 0..pages {
            match client.state_hashes(d, stage, info.step, page as u32).await {
                Ok(h) if h.len() == HASH_PAGE.min(info.chunks as usize - page * HASH_PAGE) => {
                    hashes.extend(h)
                }
                Ok(h) => {
                    failed = Some(format!("{d}: page {page} holds {} hashes", h.len()));
                    break;
                }
                Err(e) => {
                    failed = Some(format!("{d}: {e}"));
                    break;
                }
            }
        }
        match failed {
            None if root_hash(&hashes) == info.root => return Ok(hashes),
            None => why.push(format!("{d}: the list does not match the root hash")),
            Some(f) => why.push(f),
        }
    }
    Err(SyncError::Corrupt(why.join("; ")))
}

/// How far a download is, for whoever shows progress: read while it runs.
#[derive(Debug, Default)]
pub struct Fetched {
    /// The stage being downloaded.
    pub stage: AtomicU64,
    /// Bytes of state checked and in place.
    pub bytes: AtomicU64,
    /// Bytes of the whole state (0 until the donors' offer is known).
    pub total: AtomicU64,
}

impl Fetched {
    /// `(stage, bytes, total)` now.
    pub fn read(&self) -> (usize, u64, u64) {
        (
            self.stage.load(Ordering::Relaxed) as usize,
            self.bytes.load(Ordering::Relaxed),
            self.total.load(Ordering::Relaxed),
        )
    }

    fn start(&self, stage: usize, total: u64) {
        self.stage.store(stage as u64, Ordering::Relaxed);
        self.bytes.store(0, Ordering::Relaxed);
        self.total.store(total, Ordering::Relaxed);
    }
}

/// What the chunk workers share.
struct Work<'a> {
    queue: Mutex<VecDeque<usize>>,
    state: Mutex<Parts>,
    hashes: &'a [String],
    info: &'a StateInfo,
    /// Per donor: banned for a bad chunk.
    banned: Vec<AtomicBool>,
    /// Per donor: chunks it served.
    served: Vec<Mutex<usize>>,
    last_error: Mutex<String>,
    fetched: Option<&'a Fetched>,
}

impl Work<'_> {
    /// Chunks in place so far, from every donor.
    fn done(&self) -> usize {
        self.served.iter().map(|s| *s.lock()).sum()
    }

    fn next(&self) -> Option<usize> {
        self.queue.lock().pop_front()
    }

    fn give_back(&self, i: usize, why: String) {
        self.queue.lock().push_back(i);
        *self.last_error.lock() = why;
    }

    /// One worker of donor `k`: takes chunks until the queue is empty or the donor is
    /// given up.
    async fn worker(&self, client: &StageClient, stage: usize, k: usize, donor: PeerId) {
        let mut failures = 0;
        while !self.banned[k].load(Ordering::Relaxed) {
            let Some(i) = self.next() else { return };
            let want = self.info.chunk as usize;
            let start = i * want;
            let len = want.min(self.info.len as usize - start);
            match client
                .state_chunk(donor, stage, self.info.step, i as u32)
                .await
            {
                Ok(v) if v.len() == len && chunk_hash(&v) == self.hashes[i] => {
                    self.state.lock().write(start, &v);
                    *self.served[k].lock() += 1;
                    if let Some(f) = self.fetched {
                        f.bytes.fetch_add(4 * len as u64, Ordering::Relaxed);
                    }
                    failures = 0;
                }
                Ok(_) => {
                    // A donor that serves a bad chunk is not asked again.
                    self.banned[k].store(true, Ordering::Relaxed);
                    self.give_back(i, format!("{donor} served chunk {i} with a bad hash"));
                    return;
                }
                Err(e) => {
                    self.give_back(i, format!("{donor}: {e}"));
                    failures += 1;
                    if failures >= DONOR_FAILURES {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(100 << failures)).await;
                }
            }
        }
    }
}

/// How long a download waits, after the first donor's offer, for others to offer the
/// same snapshot before it starts; later offers of that snapshot still join as they come
/// (a donor writes its snapshot to disk before it answers: seconds for a large stage, and
/// the slowest of several must not hold up the rest).
const OFFER_GRACE: Duration = Duration::from_millis(500);

/// How long a download waits for a donor's offer before it asks the next donor as well.
const STAGGER: Duration = Duration::from_secs(1);

/// One donor's answer to a state request, by its index among the donors.
type Offer = (usize, Result<StateInfo, String>);

/// Asks donors for their snapshot one after another: the next once the last answered, or
/// after [`STAGGER`]. A donor is locked while it writes its snapshot, so donors asked all at
/// once all stall their training at once, and on shared disks and cores slow each other's
/// writing (two 1.2 GB snapshots written together took 6.3 and 9.3 s, one alone 0.7 s).
struct Asking<'a> {
    client: &'a StageClient,
    stage: usize,
    peers: &'a [PeerId],
    next: usize,
    pending: FuturesUnordered<futures::future::BoxFuture<'a, Offer>>,
    due: tokio::time::Instant,
}

impl<'a> Asking<'a> {
    fn new(client: &'a StageClient, stage: usize, peers: &'a [PeerId]) -> Self {
        let mut a = Self {
            client,
            stage,
            peers,
            next: 0,
            pending: FuturesUnordered::new(),
            due: tokio::time::Instant::now(),
        };
        a.ask_next();
        a
    }

    fn ask_next(&mut self) {
        let Some(&peer) = self.peers.get(self.next) else {
            return;
        };
        let (k, client, stage) = (self.next, self.client, self.stage);
        self.pending.push(Box::pin(async move {
            let r = client.state_info(peer, stage).await;
            (k, r.map_err(|e| e.to_string()))
        }));
        self.next += 1;
        self.due = tokio::time::Instant::now() + STAGGER;
    }

    /// Whether every donor has been asked and has answered.
    fn is_done(&self) -> bool {
        self.pending.is_empty() && self.next >= self.peers.len()
    }

    /// The next answer (`None` once every donor answered). Cancel-safe.
    async fn next(&mut self) -> Option<Offer> {
        loop {
            if self.is_done() {
                return None;
            }
            let more = self.next < self.peers.len();
            tokio::select! {
                Some(a) = self.pending.next(), if !self.pending.is_empty() => {
                    self.ask_next();
                    return Some(a);
                }
                () = tokio::time::sleep_until(self.due), if more => self.ask_next(),
            }
        }
    }
}

/// The offer to download: the newest step, and among offers of one step the one the most
/// donors made (by index into the donors' list).
fn best_offer(offers: &[(usize, StateInfo)]) -> Option<StateInfo> {
    let mut groups: BTreeMap<(u64, usize), StateInfo> = BTreeMap::new();
    for (_, info) in offers {
        let n = offers.iter().filter(|(_, i)| i == info).count();
        groups.insert((info.step, n), info.clone());
    }
    groups.into_values().next_back()
}

/// Downloads the newest agreed snapshot of `stage` from `candidates`, counting its
/// progress in `fetched` when given: its metadata (`flat` left empty) and its values, in
/// parts, for [`crate::stage::replica::Replica::restore_parts`]. It starts once the first
/// donors have offered (see [`OFFER_GRACE`]); donors that offer the same snapshot later
/// join the download.
pub async fn download(
    client: &StageClient,
    stage: usize,
    candidates: &[PeerId],
    want_len: usize,
    rng: &mut Rng,
    fetched: Option<&Fetched>,
) -> Result<(Snapshot, Parts, SyncReport), SyncError> {
    let started = std::time::Instant::now();
    // Shuffle so concurrent joiners spread over the donors.
    let mut peers = candidates.to_vec();
    for i in (1..peers.len()).rev() {
        peers.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut asking = Asking::new(client, stage, &peers);
    let mut errors = Vec::new();
    let mut offers: Vec<(usize, StateInfo)> = Vec::new();
    let mut grace: Option<tokio::time::Instant> = None;
    while !asking.is_done() {
        let answer = match grace {
            Some(at) => match tokio::time::timeout_at(at, asking.next()).await {
                Ok(a) => a,
                Err(_) => break,
            },
            None => asking.next().await,
        };
        match answer {
            Some((k, Ok(info))) => {
                grace.get_or_insert_with(|| tokio::time::Instant::now() + OFFER_GRACE);
                offers.push((k, info));
            }
            Some((k, Err(e))) => errors.push(format!("{}: {e}", peers[k])),
            None => break,
        }
    }
    let Some(info) = best_offer(&offers) else {
        return Err(SyncError::NoDonor(errors.join("; ")));
    };
    check_offer(&info, want_len)?;
    if let Some(f) = fetched {
        f.start(stage, 4 * want_len as u64);
    }
    let first: Vec<usize> = offers
        .iter()
        .filter(|(_, i)| *i == info)
        .map(|(k, _)| *k)
        .collect();
    let offered_s = started.elapsed().as_secs_f64();
    let first_peers: Vec<PeerId> = first.iter().map(|&k| peers[k]).collect();
    let hashes = fetch_hashes(client, stage, &info, &first_peers).await?;
    let setup_s = started.elapsed().as_secs_f64();
    tracing::debug!(
        target: "shoal::averaging",
        stage,
        donors = first.len(),
        asked = peers.len(),
        "state offers after {offered_s:.1} s, chunk hashes after {setup_s:.1} s"
    );
    // Start at a random chunk, so joiners arriving together do not all begin on one.
    let n = info.chunks as usize;
    let offset = rng.below(n.max(1) as u64) as usize;
    let work = Work {
        queue: Mutex::new((0..n).map(|i| (i + offset) % n).collect()),
        state: Mutex::new(Parts::zeros(want_len, PART)),
        hashes: &hashes,
        info: &info,
        banned: peers.iter().map(|_| AtomicBool::new(false)).collect(),
        served: peers.iter().map(|_| Mutex::new(0)).collect(),
        last_error: Mutex::new(String::new()),
        fetched,
    };
    // Workers in turn across donors (w0 of every donor, then w1, ...): each takes its
    // first chunk when first polled, so even a state of few chunks spreads over donors.
    let workers_of = |donors: &[usize]| -> Vec<_> {
        (0..PER_DONOR)
            .flat_map(|_| donors.iter().copied())
            .map(|k| work.worker(client, stage, k, peers[k]))
            .collect()
    };
    let mut donors = first;
    let mut workers: FuturesUnordered<_> = workers_of(&donors).into_iter().collect();
    // A second pass over the donors still standing picks up chunks given back late.
    let mut second_pass = false;
    loop {
        if workers.is_empty() {
            if work.done() == n {
                break;
            }
            if !second_pass {
                second_pass = true;
                workers.extend(workers_of(&donors));
                continue;
            }
            if asking.is_done() {
                break;
            }
        }
        tokio::select! {
            Some(()) = workers.next(), if !workers.is_empty() => {}
            Some((k, r)) = asking.next(), if !asking.is_done() => {
                // A late donor of the same snapshot joins with its own workers.
                if matches!(&r, Ok(late) if *late == info) && !work.queue.lock().is_empty() {
                    donors.push(k);
                    workers.extend(workers_of(&[k]));
                }
            }
            else => break,
        }
    }
    drop(workers);
    if work.done() < n {
        let index = work.queue.lock().front().copied().unwrap_or(0) as u32;
        return Err(SyncError::Chunk {
            index,
            cause: work.last_error.lock().clone(),
        });
    }
    let chunks_per_donor = donors.iter().map(|&k| *work.served[k].lock()).collect();
    let banned = donors
        .iter()
        .filter(|&&k| work.banned[k].load(Ordering::Relaxed))
        .map(|&k| peers[k])
        .collect();
    Ok((
        Snapshot {
            step: info.step,
            flat: Vec::new(),
            params_hash: info.params_hash.clone(),
            samples_applied: info.samples_applied,
            samples_lost: info.samples_lost,
        },
        work.state.into_inner(),
        SyncReport {
            donors: donors.iter().map(|&k| peers[k]).collect(),
            chunks_per_donor,
            banned,
            setup_s,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_hash_covers_every_chunk_and_their_order() {
        let a: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let h: Vec<String> = a.chunks(4).map(chunk_hash).collect();
        assert_eq!(h.len(), 3);
        let root = root_hash(&h);
        let mut swapped = h.clone();
        swapped.swap(0, 1);
        assert_ne!(root_hash(&swapped), root);
        let mut b = a.clone();
        b[9] = 0.5;
        let hb: Vec<String> = b.chunks(4).map(chunk_hash).collect();
        assert_ne!(root_hash(&hb), root);
        assert_eq!(root_hash(&h[..2]), root_hash(&h[..2]));
    }

    #[test]
    fn the_newest_snapshot_is_downloaded_and_of_one_step_the_one_most_donors_offer() {
        let at = |step, root: &str| StateInfo {
            step,
            len: 10,
            chunk: 4,
            chunks: 3,
            root: root.into(),
            params_hash: String::new(),
            samples_applied: 0,
            samples_lost: 0,
        };
        assert_eq!(best_offer(&[]), None);
        let offers = [(0, at(3, "a")), (1, at(4, "b")), (2, at(3, "a"))];
        assert_eq!(best_offer(&offers), Some(at(4, "b")));
        let offers = [(0, at(4, "c")), (1, at(4, "b")), (2, at(4, "b"))];
        assert_eq!(best_offer(&offers), Some(at(4, "b")));
    }

    #[test]
    fn offers_must_be_consistent_and_fit_the_stage() {
        let info = StateInfo {
            step: 1,
            len: 10,
            chunk: 4,
            chunks: 3,
            root: String::new(),
            params_hash: String::new(),
            samples_applied: 0,
            samples_lost: 0,
        };
        assert!(check_offer(&info, 10).is_ok());
        assert!(check_offer(&info, 11).is_err());
        assert!(check_offer(
            &StateInfo {
                chunks: 2,
                ..info.clone()
            },
            10
        )
        .is_err());
        assert!(check_offer(&StateInfo { chunk: 0, ..info }, 10).is_err());
    }
}
