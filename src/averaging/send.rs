//! The averager's outgoing side: control messages (progress, members, leave) on one
//! sender, a round's bulk data (parts chunk by chunk, reduced chunks) on another, so a
//! heartbeat never waits behind megabytes of parts. The bulk sender sends the frozen sum's
//! chunks (encoded when it was frozen), skips the jobs of abandoned attempts, and measures
//! the uplink.

use super::round::{Key, Layout};
use super::AvgStats;
use crate::stage::client::{Retry, StageClient};
use crate::stage::frozen::EncodedSum;
use crate::wire::msg::AvgMsg;
use crate::wire::{self, Limits};
use futures::StreamExt;
use libp2p::PeerId;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Control messages waiting to be sent; beyond this, new ones are dropped (and counted):
/// progress is repeated by the heartbeat, and a round that loses a message retries at its
/// deadline.
pub(super) const OUTBOX: usize = 1024;

/// Bulk jobs (a round's parts, reduced chunks) waiting to be sent. A round queues one job
/// for its parts and one per reduced chunk of its own part.
pub(super) const BULK_OUTBOX: usize = 8192;

/// Messages being sent at once, per sender.
const SENDS_IN_FLIGHT: usize = 32;

/// A control message to one replica (never behind a round's bulk data).
pub(super) struct Outgoing {
    pub(super) peer: PeerId,
    pub(super) msg: AvgMsg,
}

/// Bulk data of a round.
pub(super) enum Bulk {
    /// This replica's sum, encoded by chunk, each chunk sent to the member whose part
    /// holds it.
    Parts {
        key: Key,
        count: u64,
        sum: Arc<EncodedSum>,
        layout: Layout,
        /// (member index, peer) of every other member.
        to: Vec<(usize, PeerId)>,
    },
    /// One reduced chunk, to every other member.
    Reduced {
        key: Key,
        msg: AvgMsg,
        frame: Arc<Vec<u8>>,
        to: Vec<PeerId>,
    },
}

/// One call of a bulk job.
struct Job {
    key: Key,
    peer: PeerId,
    msg: AvgMsg,
    frame: Arc<Vec<u8>>,
}

impl Bulk {
    /// Its calls, the parts' chunks taken round-robin over the members.
    fn jobs(self) -> Vec<Job> {
        match self {
            Bulk::Parts {
                key,
                count,
                sum,
                layout,
                to,
            } => {
                let most = to.iter().map(|(i, _)| layout.chunks(*i).len()).max();
                let mut out = Vec::new();
                for j in 0..most.unwrap_or(0) {
                    for &(i, peer) in &to {
                        let Some(c) = layout.chunks(i).nth(j) else {
                            continue;
                        };
                        if let Some(frame) = sum.frame(c) {
                            out.push(Job {
                                key,
                                peer,
                                msg: AvgMsg::Part {
                                    step: key.0,
                                    attempt: key.1,
                                    count,
                                    chunk: c,
                                },
                                frame: Arc::clone(frame),
                            });
                        }
                    }
                }
                out
            }
            Bulk::Reduced {
                key,
                msg,
                frame,
                to,
            } => to
                .into_iter()
                .map(|peer| Job {
                    key,
                    peer,
                    msg: msg.clone(),
                    frame: Arc::clone(&frame),
                })
                .collect(),
        }
    }
}

/// Frames at least this long time the uplink (shorter ones mostly time the round trip).
const MEASURED_FRAME: usize = 64 << 10;

/// Measures the uplink while bulk data is being sent: bytes completed over the time some
/// were in flight (with many calls in flight, one call's time says little).
#[derive(Default)]
struct Meter {
    in_flight: usize,
    since: Option<Instant>,
    bytes: u64,
}

impl Meter {
    /// A call starts at `now`.
    fn start(&mut self, now: Instant) {
        if self.in_flight == 0 {
            self.since = Some(now);
            self.bytes = 0;
        }
        self.in_flight += 1;
    }

    /// The call that started at `started` ended at `now` having sent `bytes` (0: not
    /// sent); folds a rate into `avg` every second of busy time and when the link goes
    /// idle.
    fn end(&mut self, bytes: u64, started: Instant, now: Instant, avg: &AtomicU64) {
        self.in_flight = self.in_flight.saturating_sub(1);
        let Some(since) = self.since else { return };
        // A call that began before this interval (a fold while it was in flight began a
        // new one) sent only part of its bytes within it: counted in proportion to its
        // time inside. Counted whole, the last of several calls sharing the link, which
        // ends just after the first, read as several times the link.
        let inside = now.saturating_duration_since(since).as_secs_f64();
        let all = now.saturating_duration_since(started).as_secs_f64();
        self.bytes += if started >= since || all <= 0.0 {
            bytes
        } else {
            (bytes as f64 * inside / all) as u64
        };
        let took = now.saturating_duration_since(since);
        if (self.in_flight == 0 || took >= Duration::from_secs(1))
            && self.bytes >= MEASURED_FRAME as u64
            && took >= Duration::from_millis(20)
        {
            fold_rate(avg, self.bytes as usize, took);
            self.since = Some(now);
            self.bytes = 0;
        }
        if self.in_flight == 0 {
            self.since = None;
        }
    }
}

/// Folds a measured rate into the moving average in `avg` (bytes/s).
fn fold_rate(avg: &AtomicU64, bytes: usize, took: Duration) {
    let rate = (bytes as f64 / took.as_secs_f64().max(1e-6)) as u64;
    let old = avg.load(Ordering::Relaxed);
    let new = if old == 0 { rate } else { (3 * old + rate) / 4 };
    avg.store(new.max(1), Ordering::Relaxed);
}

/// Sends one message, retrying a round message (a lost one stalls the round until its
/// deadline; [`Retry::ROUND_MESSAGE`]) while `live` says its attempt runs; true if it got
/// through. Progress is sent once: the heartbeat repeats it; so are mates (other mates
/// introduce them too).
async fn send_one(
    client: &StageClient,
    stage: usize,
    peer: PeerId,
    msg: &AvgMsg,
    frame: Option<&[u8]>,
    moved: &Moved,
    live: impl Fn() -> bool,
) -> bool {
    let policy = if matches!(msg, AvgMsg::Progress { .. } | AvgMsg::Mates { .. }) {
        Retry::ONCE
    } else {
        Retry::ROUND_MESSAGE
    };
    let sent = policy
        .run(live, || client.send_avg(peer, stage, msg.clone(), frame))
        .await;
    match sent {
        Some(Ok(())) => true,
        Some(Err(e)) => {
            tracing::debug!(target: "shoal::averaging", %peer, "send failed: {e}");
            if e.kind() == Some(crate::wire::msg::ErrorKind::WrongStage) {
                moved.add(peer);
            }
            false
        }
        None => false,
    }
}

/// Sends the control outbox's messages, at most [`SENDS_IN_FLIGHT`] at once; ends when the
/// averager drops its side.
pub(super) async fn sender(
    client: StageClient,
    stage: usize,
    rx: mpsc::Receiver<Outgoing>,
    moved: Moved,
) {
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) })
        .for_each_concurrent(SENDS_IN_FLIGHT, |o| {
            let (client, moved) = (client.clone(), moved.clone());
            async move {
                send_one(&client, stage, o.peer, &o.msg, None, &moved, || true).await;
            }
        })
        .await;
}

/// How long a mate that answered from another stage stays forgotten unless it is heard
/// from again: its provider record here lives as long.
const MOVED_FOR: Duration = Duration::from_secs(180);

/// Mates that answered from another stage (they moved away), and when; shared by the
/// senders, which note them, and the averager, which forgets them (`forget_moved`):
/// their lingering provider records, cached announcements and other mates' introductions
/// brought them back otherwise (in a ~70-s run of 200 peers one moved replica drew 409
/// refused messages).
#[derive(Clone, Default)]
pub(super) struct Moved(Arc<parking_lot::Mutex<std::collections::HashMap<PeerId, Instant>>>);

impl Moved {
    fn add(&self, peer: PeerId) {
        self.0.lock().insert(peer, Instant::now());
    }

    /// The peers that answered from another stage lately.
    pub(super) fn recent(&self) -> Vec<PeerId> {
        let mut m = self.0.lock();
        if m.is_empty() {
            return Vec::new();
        }
        m.retain(|_, at| at.elapsed() < MOVED_FOR);
        m.keys().copied().collect()
    }

    /// `peer` spoke from this stage: it is (back) here.
    pub(super) fn clear(&self, peer: &PeerId) {
        let mut m = self.0.lock();
        if !m.is_empty() {
            m.remove(peer);
        }
    }
}

/// Attempts abandoned (the newest few), shared by the averager and its bulk sender.
#[derive(Clone, Default)]
pub(super) struct Abandoned(Arc<parking_lot::Mutex<std::collections::VecDeque<Key>>>);

impl Abandoned {
    pub(super) fn add(&self, key: Key) {
        {
            let mut a = self.0.lock();
            a.push_back(key);
            while a.len() > 16 {
                a.pop_front();
            }
        }
    }

    fn has(&self, key: Key) -> bool {
        self.0.lock().contains(&key)
    }
}

/// Sends the rounds' bulk data, at most [`SENDS_IN_FLIGHT`] calls at once, skipping jobs of
/// abandoned attempts, measuring the uplink into `stats`; ends when the averager drops its
/// side.
pub(super) async fn bulk_sender(
    client: StageClient,
    stage: usize,
    rx: mpsc::Receiver<Bulk>,
    abandoned: Abandoned,
    stats: Arc<AvgStats>,
    moved: Moved,
) {
    let meter = Arc::new(parking_lot::Mutex::new(Meter::default()));
    let is_live = move |key: Key| !abandoned.has(key);
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) })
        .flat_map(|b| futures::stream::iter(b.jobs()))
        .for_each_concurrent(SENDS_IN_FLIGHT, |job| {
            let (client, stats, meter) = (client.clone(), Arc::clone(&stats), Arc::clone(&meter));
            let moved = moved.clone();
            let is_live = is_live.clone();
            async move {
                if !is_live(job.key) {
                    return;
                }
                let frame = job.frame;
                let floats = wire::header::parse_header(&frame, &Limits::default())
                    .map_or(0, |(h, _)| h.elements());
                let started = Instant::now();
                meter.lock().start(started);
                let ok = send_one(
                    &client,
                    stage,
                    job.peer,
                    &job.msg,
                    Some(&frame),
                    &moved,
                    || is_live(job.key),
                )
                .await;
                let sent = if ok { frame.len() as u64 } else { 0 };
                meter
                    .lock()
                    .end(sent, started, Instant::now(), &stats.uplink);
                if ok {
                    stats.bytes_sent.fetch_add(sent, Ordering::Relaxed);
                    stats
                        .raw_bytes
                        .fetch_add(4 * floats as u64, Ordering::Relaxed);
                }
            }
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mate_that_answered_from_another_stage_is_forgotten_until_heard_again() {
        let moved = Moved::default();
        let (a, b) = (PeerId::random(), PeerId::random());
        assert!(moved.recent().is_empty());
        moved.add(a);
        moved.add(b);
        let mut r = moved.recent();
        r.sort();
        let mut both = vec![a, b];
        both.sort();
        assert_eq!(r, both);
        // `b` spoke from this stage again.
        moved.clear(&b);
        assert_eq!(moved.recent(), vec![a]);
    }

    #[test]
    fn calls_sharing_the_link_never_read_as_a_multiple_of_it() {
        // Two calls share a 1 MB/s link from t = 0: one of 500 kB ends at 1.00 s, the
        // other of 530 kB at 1.03 s (its last 30 kB alone on the link).
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let avg = AtomicU64::new(0);
        let mut m = Meter::default();
        m.start(at(0));
        m.start(at(0));
        m.end(500_000, at(0), at(1000), &avg);
        // A second of busy time: the first call's bytes over it.
        assert_eq!(avg.load(Ordering::Relaxed), 500_000);
        m.end(530_000, at(0), at(1030), &avg);
        // The second call counts for its 30 ms inside the new interval (15 kB, too few to
        // time a link), not whole: 530 kB over 30 ms would have read as 17.7 MB/s.
        assert_eq!(avg.load(Ordering::Relaxed), 500_000);
        // Alone, a call is timed whole.
        m.start(at(2000));
        m.end(400_000, at(2000), at(2500), &avg);
        assert_eq!(avg.load(Ordering::Relaxed), (3 * 500_000 + 800_000) / 4);
    }
}
