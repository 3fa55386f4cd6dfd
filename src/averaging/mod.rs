//! Stage averaging: the replicas of a stage agree on a step, average their gradients with
//! a butterfly all-reduce, and apply the same update, so they stay bit-identical.
//!
//! - [`plan`]: the pure decisions (who leads, who is behind, who died).
//! - [`round`]: one round's bookkeeping (parts in, reduced parts in, completion).
//! - [`reduce`]: the pure arithmetic (how the flat gradient is cut, how a part is reduced).
//! - `actor`: the averager task of one replica (messages in and out, rounds run);
//!   `mates`: how it learns its stage mates from the first ones it reaches;
//!   `exchange`: a round as it runs; `send`: its senders (control messages, and a
//!   round's bulk data).
//! - [`server`]: the replica's answers to averaging messages and state requests.
//! - [`sync`]: state download for joiners and for replicas that fell behind.
//! - [`spill`]: the snapshot a donor serves, on disk.
//! - [`updates`]: the updates a replica applied last, replayed by replicas catching up.
//! - this module: the config, the counters and the handle.
//!
//! Protocol (all messages are `Call::Avg` calls between the replicas of one stage):
//! 1. Every replica sends `Progress` (steps, samples accumulated and frozen, parameter hash)
//!    after each backward and as a heartbeat. A replica is live while its progress is fresh.
//! 2. The leader, the live replica with the smallest peer id among those at its step, sees
//!    when the samples accumulated for the step reach `target_batch_size` and sends
//!    `Members` (the sorted member list, and samples lost with replicas that died). While
//!    the members are those of the last completed round and none died, the attempt's number
//!    is the step's own ([`plan::first_attempt`]) and every member starts it as soon as it
//!    sees the batch full, without waiting for `Members` ([`plan::expected_members`]): a
//!    one-way latency less per round (rounds of 2 replicas behind 50 ms links: 120–135 ms
//!    from freeze to applied before, ~62 ms with it).
//! 3. Each member freezes the sum it accumulated for the step (one running sum per stage,
//!    not one copy per microbatch: memory does not grow with the microbatches of a step)
//!    and encodes it in the run's gradient codec, in chunks whose size depends on the
//!    gradient's length only ([`round::chunk_for`], at most [`round::PART_CHUNK`] values);
//!    the f32 sum is freed. The chunks are cut into one contiguous part per member
//!    ([`round::Layout`]) and member i is sent the chunks of part i (`Part`). A retried
//!    attempt sends the same frames. Later backward passes count toward the next step, so a gradient
//!    is at most one step stale; a step holds at least the target batch, and more when
//!    microbatches arrive while the round forms (averaging weighs every sample the same).
//! 4. Member i sums each chunk of its part as soon as every member's copy of it arrived,
//!    (this member's own copy decoded from its frames, so every contribution went through
//!    the codec the same way), divides by the total sample count, encodes the result — what
//!    every member will apply, itself included — and sends it to all (`Reduced`). No member
//!    holds another's whole part; the reduced chunks are kept encoded.
//! 5. With every reduced chunk, a member applies the optimizer step, decoding the chunks
//!    one parameter at a time.
//!
//! A round that does not finish before its deadline is abandoned; the frozen sums stay, and
//! the leader starts a new attempt with the members still live (each attempt of a step
//! abandoned so doubles the next one's deadline, up to 8 times). A replica that finds
//! itself behind (a peer at a later step, or a different parameter hash at the same step as
//! the leader) downloads the state again ([`sync`]).

mod actor;
mod exchange;
mod mates;
pub use crate::guard;
pub mod plan;
mod progress;
pub mod reduce;
pub mod round;
mod send;
pub mod server;
pub mod spill;
pub mod sync;
pub mod updates;

use crate::config::{AggregateKind, AveragingConfig, RunConfig};
use crate::rng::Rng;
use crate::stage::client::StageClient;
use crate::stage::service::StageService;
use crate::wire::{self, CodecSpec};
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Averaging messages a replica holds before it refuses more (`overloaded`).
const INBOX: usize = 256;

/// Bytes of the inbox budget beyond the parts (progress and control messages).
const INBOX_SLACK: usize = 1 << 20;

/// Part chunks the inbox holds at most (with every member's 32 calls in flight, a few
/// members' worth; a sender whose chunk does not fit retries).
const INBOX_CHUNKS: usize = 128;

/// Knobs of the averager.
#[derive(Debug, Clone)]
pub struct AveragerConfig {
    /// Samples per step (the run's `target_batch_size`).
    pub target: u64,
    /// Codec of the parts.
    pub codec: CodecSpec,
    /// Progress is re-sent at least this often.
    pub heartbeat: Duration,
    /// A replica whose progress is older than this is not live.
    pub live_timeout: Duration,
    /// A round attempt is abandoned after at least this long; longer when the members'
    /// measured uplinks say its bytes need it ([`plan::round_timeout`]).
    pub round_timeout: Duration,
    /// How often the stage's replicas are re-read from the DHT.
    pub membership_every: Duration,
    /// Floats per chunk of the state this replica offers to joiners.
    pub state_chunk: usize,
    /// How a reducer combines the members' copies of a chunk.
    pub aggregate: reduce::Aggregate,
    /// A member's chunk whose per-sample norm exceeds this multiple of the chunk's recent
    /// median is rejected (0: no check).
    pub max_norm_ratio: f64,
    /// Outer averaging (`averaging.mode = "outer"`): rounds every step still close the
    /// stage's steps, but carry nothing but on outer steps, where the members' copies are
    /// sparse pseudo-gradients averaged member by member.
    pub outer: Option<crate::config::OuterSettings>,
    /// Makes this replica send corrupted parts: for tests of robust aggregation only (no
    /// command-line flag sets it).
    #[doc(hidden)]
    pub tamper: Option<Tamper>,
}

/// How a [`Tamper`]ing replica corrupts its parts.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TamperKind {
    /// Every value times this.
    Scale(f32),
    /// Every value NaN.
    NaN,
    /// Every value drawn uniformly from ±this.
    Random(f32),
}

/// A replica that sends corrupted gradient parts from step `from_step` on (its frozen sum
/// is replaced, so its own part is reduced from the corrupted copy too). Tests only.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tamper {
    /// The first step corrupted.
    pub from_step: u64,
    /// How.
    pub kind: TamperKind,
}

impl Tamper {
    /// The corrupted copy of `sum` for step `step` (`None`: not corrupted at this step),
    /// as raw f32 frames (an attacker picks its own codec; int8 would scrub NaN).
    pub fn corrupt(
        &self,
        step: u64,
        sum: &crate::stage::frozen::EncodedSum,
    ) -> Option<crate::stage::frozen::EncodedSum> {
        if step < self.from_step {
            return None;
        }
        let mut rng = Rng::new(step ^ 0x7a3d);
        let mut values = Vec::with_capacity(sum.len());
        for c in 0..sum.len().div_ceil(sum.chunk().max(1)).max(1) {
            values.extend(sum.decode(c as u32).ok()?);
        }
        for v in &mut values {
            *v = match self.kind {
                TamperKind::Scale(f) => *v * f,
                TamperKind::NaN => f32::NAN,
                TamperKind::Random(a) => a * (2.0 * rng.next_f64() as f32 - 1.0),
            };
        }
        crate::stage::frozen::EncodedSum::encode(&values, sum.chunk(), &CodecSpec::F32).ok()
    }
}

/// How long an averager reuses a stage mate's announcement before reading it again (a
/// tenth of it for a mate whose record was not found). It takes only the mate's addresses
/// from it, which do not change, and reads it only for a provider of the stage it has not
/// heard from ([`crate::stage::registry::stage_members`]). At 10 s, each membership read
/// re-read every mate's record: in a swarm of 200, 3,500 DHT record requests a second.
const MEMBERSHIP_MAX_AGE: Duration = Duration::from_secs(600);

/// Each replica sends a heartbeat to every stage mate: the period grows by this per mate,
/// so a replica sends at most ten heartbeats a second whatever the stage's size (at 45
/// replicas a stage, 300 ms heartbeats were 6,700 messages a second per stage, and the
/// swarm of 200 peers spent its two cores on them).
pub const HEARTBEAT_PER_MATE: Duration = Duration::from_millis(100);

/// Beyond [`CLOSE_MATES`] stage mates, each further one lengthens the heartbeat by this: a
/// replica among 44 mates sends ~4 heartbeats a second, not 10 (177 replicas in stages of
/// ~45 sent ~1,800 a second, the largest part of a 200-peer swarm's own traffic once it
/// formed). Small stages, where a round waits on every member, keep their quick heartbeat.
pub const HEARTBEAT_PER_FAR_MATE: Duration = Duration::from_millis(300);

/// See [`HEARTBEAT_PER_FAR_MATE`].
pub const CLOSE_MATES: usize = 8;

/// The stage's providers are read from the DHT at most once per this much per stage mate:
/// a new mate makes itself known by its heartbeats, so the walk (a few dozen DHT requests)
/// only backs them up; 45 mates read every 22.5 s instead of every 9 s.
pub const MEMBERSHIP_PER_MATE: Duration = Duration::from_millis(500);

impl AveragerConfig {
    /// This config in a stage where a replica has `mates` stage mates: the heartbeat at
    /// least [`HEARTBEAT_PER_MATE`] per mate and [`HEARTBEAT_PER_FAR_MATE`] per mate beyond
    /// [`CLOSE_MATES`], a replica live for at least three of them,
    /// and the stage's providers read from the DHT at most every two and every
    /// [`MEMBERSHIP_PER_MATE`] per mate (a new mate makes itself known sooner, by its own
    /// heartbeats). Small stages (up to 3 mates at the default 300 ms) are unchanged.
    pub fn fitted(&self, mates: usize) -> Self {
        let mut c = self.clone();
        let far = mates.saturating_sub(CLOSE_MATES) as u32;
        c.heartbeat = self
            .heartbeat
            .max(HEARTBEAT_PER_MATE * mates as u32)
            .max(HEARTBEAT_PER_FAR_MATE * far);
        c.live_timeout = self.live_timeout.max(c.heartbeat * 3);
        c.membership_every = self
            .membership_every
            .max(c.heartbeat * 2)
            .max(MEMBERSHIP_PER_MATE * mates as u32);
        c
    }

    /// Defaults for a run with `target` samples per step and gradient codec `codec`.
    pub fn new(target: u64, codec: CodecSpec) -> Self {
        Self {
            target,
            codec,
            heartbeat: Duration::from_millis(300),
            live_timeout: Duration::from_secs(3),
            round_timeout: Self::MIN_ROUND_TIMEOUT,
            membership_every: Duration::from_secs(2),
            state_chunk: sync::STATE_CHUNK,
            aggregate: reduce::Aggregate::Mean,
            max_norm_ratio: crate::config::AveragingConfig::MAX_NORM_RATIO,
            outer: None,
            tamper: None,
        }
    }

    /// How the chunks of parts and reduced parts are coded: the gradient codec, sparse
    /// (mostly-zero chunks as their nonzero values) in outer mode.
    pub fn chunk_codec(&self) -> wire::ChunkCodec {
        wire::ChunkCodec {
            values: self.codec,
            sparse: self.outer.is_some(),
        }
    }

    /// The shortest round timeout.
    pub const MIN_ROUND_TIMEOUT: Duration = Duration::from_secs(5);

    /// The link rate round timeouts are scaled by when the run does not set them
    /// (100 Mbit/s, in bytes per second).
    pub const REFERENCE_LINK: f64 = 12.5e6;

    /// The config of a stage of `numel` parameters in `run`: its target batch and gradient
    /// codec, and its `[averaging]` knobs or their defaults.
    pub fn for_run(run: &RunConfig, numel: usize) -> Self {
        let mut c = Self::new(run.target_batch_size() as u64, run.codecs.gradients);
        if let Some(ms) = run.averaging.heartbeat_ms {
            c.heartbeat = Duration::from_millis(ms);
            c.live_timeout = c.heartbeat * 10;
        }
        if let Some(f) = run.averaging.state_chunk_floats {
            c.state_chunk = f;
        }
        let a = &run.averaging;
        c.aggregate = match a.aggregate.unwrap_or_default() {
            AggregateKind::Mean => reduce::Aggregate::Mean,
            AggregateKind::CenteredClip => reduce::Aggregate::CenteredClip {
                tau: a.clip_tau.unwrap_or(AveragingConfig::CLIP_TAU),
                iters: a.clip_iters.unwrap_or(AveragingConfig::CLIP_ITERS),
            },
        };
        c.max_norm_ratio = a.max_norm_ratio.unwrap_or(AveragingConfig::MAX_NORM_RATIO);
        c.outer = a.outer();
        if let Some(o) = c.outer {
            c.aggregate = reduce::Aggregate::MemberMean;
            c.codec = o.codec;
        }
        c.round_timeout = match run.averaging.round_timeout_s {
            Some(s) => Duration::from_secs_f64(s),
            None => Self::round_timeout_for(numel, &c.codec),
        };
        c
    }

    /// A round moves about twice the stage's encoded gradient over each member's link
    /// (its parts out, the reduced parts back): allow four times that at
    /// [`Self::REFERENCE_LINK`], and never less than [`Self::MIN_ROUND_TIMEOUT`].
    pub fn round_timeout_for(numel: usize, codec: &CodecSpec) -> Duration {
        let bytes = wire::max_encoded_len(&[numel], codec).unwrap_or(numel.saturating_mul(4));
        let secs = 4.0 * 2.0 * bytes as f64 / Self::REFERENCE_LINK;
        Duration::from_secs_f64(secs).max(Self::MIN_ROUND_TIMEOUT)
    }
}

/// Round durations kept in [`AvgStats::recent_rounds_ms`].
const RECENT_ROUNDS: usize = 256;

/// A copy of an averager's counters, as a peer reports them.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AvgSnapshot {
    /// Steps applied through rounds.
    pub rounds: u64,
    /// Attempts abandoned at their deadline.
    pub failed_attempts: u64,
    /// Part and reduced-part bytes sent.
    pub bytes_sent: u64,
    /// The same values as f32.
    #[serde(default)]
    pub raw_sent: u64,
    /// State downloads after falling behind.
    pub resyncs: u64,
    /// Updates replayed to catch up.
    #[serde(default)]
    pub replays: u64,
    /// Measured uplink for parts, bytes/s (0: not yet).
    pub uplink: u64,
    /// Milliseconds of the latest rounds, oldest first.
    pub recent_rounds_ms: Vec<f64>,
    /// Members' chunks rejected by the checks.
    #[serde(default)]
    pub rejected: u64,
    /// Peers banned from the stage's rounds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub banned: Vec<guard::Banned>,
}

impl AvgStats {
    /// Records a round that took `ms` milliseconds.
    pub fn record_round(&self, ms: f64) {
        let mut r = self.recent_rounds_ms.lock();
        r.push_back(ms);
        while r.len() > RECENT_ROUNDS {
            r.pop_front();
        }
    }

    /// The peers banned from this stage's rounds at `now`.
    pub fn banned_at(&self, now: Instant) -> Vec<guard::Banned> {
        guard::banned_at(&self.bans.lock(), now)
    }

    /// The counters now.
    pub fn snapshot(&self) -> AvgSnapshot {
        let g = |a: &AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        AvgSnapshot {
            rounds: g(&self.rounds),
            failed_attempts: g(&self.failed_attempts),
            bytes_sent: g(&self.bytes_sent),
            raw_sent: g(&self.raw_bytes),
            resyncs: g(&self.resyncs),
            replays: g(&self.replays),
            rejected: g(&self.rejected),
            banned: self.banned_at(Instant::now()),
            uplink: g(&self.uplink),
            recent_rounds_ms: self.recent_rounds_ms.lock().iter().copied().collect(),
        }
    }
}

/// Counters of one averager.
#[derive(Debug, Default)]
pub struct AvgStats {
    /// Steps applied through rounds.
    pub rounds: AtomicU64,
    /// Members of those rounds, summed (÷ `rounds`: the mean group size).
    pub members: AtomicU64,
    /// Attempts abandoned at their deadline.
    pub failed_attempts: AtomicU64,
    /// The stage mates this replica knows of now (announced, or heard from).
    pub mates: AtomicU64,
    /// Part and reduced-part bytes sent.
    pub bytes_sent: AtomicU64,
    /// The same values as f32.
    pub raw_bytes: AtomicU64,
    /// State downloads after falling behind.
    pub resyncs: AtomicU64,
    /// Updates replayed to catch up.
    pub replays: AtomicU64,
    /// The measured uplink for averaging parts, bytes/s (a moving average; 0: not yet).
    pub uplink: AtomicU64,
    /// Microseconds from freezing to applying, summed over rounds.
    pub round_us: AtomicU64,
    /// Messages not sent because the outbox was full.
    pub dropped_sends: AtomicU64,
    /// Control messages queued for stage mates (progress and heartbeats, members, leave,
    /// mates): the averager's own traffic besides a round's parts.
    pub control_sent: AtomicU64,
    /// Milliseconds of the latest rounds (freeze to apply), oldest first.
    pub recent_rounds_ms: parking_lot::Mutex<std::collections::VecDeque<f64>>,
    /// Why the last state download failed, if it did.
    pub last_error: parking_lot::Mutex<Option<String>>,
    /// Members' chunks rejected (non-finite, outsized, or a non-finite reduced chunk).
    pub rejected: AtomicU64,
    /// Every ban this averager gave, with when it ends (see [`AvgStats::banned_at`]).
    pub bans: parking_lot::Mutex<Vec<(guard::Banned, Instant)>>,
}

/// A running averager. Dropping it stops its task; its senders then send what they hold
/// and end.
pub struct Averager {
    tasks: crate::tasks::Tasks,
    stats: Arc<AvgStats>,
    leave: tokio::sync::watch::Sender<bool>,
}

impl Drop for Averager {
    fn drop(&mut self) {
        self.tasks.cancel();
    }
}

impl Averager {
    /// Starts averaging for `service`'s replica.
    pub fn spawn(
        client: StageClient,
        service: Arc<StageService>,
        cfg: AveragerConfig,
        seed: u64,
    ) -> Self {
        let (tx, rx) = mpsc::channel(INBOX);
        let part_bytes = wire::max_encoded_len(&[service.numel()], &cfg.codec)
            .unwrap_or(service.numel().saturating_mul(4));
        let chunk_bytes = wire::max_encoded_len(&[round::PART_CHUNK], &cfg.codec)
            .unwrap_or(round::PART_CHUNK * 4);
        // Parts move in chunks: the inbox holds a round's worth of a small stage, and a
        // few senders' chunks in flight of a large one.
        let inbox_bytes =
            part_bytes.saturating_mul(2).min(INBOX_CHUNKS * chunk_bytes) + INBOX_SLACK;
        let inbox = server::Inbox::new(tx, inbox_bytes);
        let step = Arc::clone(&inbox.step);
        let log = Arc::new(parking_lot::Mutex::new(updates::UpdateLog::default()));
        service.attach(Arc::new(
            server::AvgServer::new(inbox.clone(), service.replica(), cfg.state_chunk)
                .with_log(Arc::clone(&log)),
        ));
        let stats = Arc::new(AvgStats::default());
        let span = tracing::info_span!("averager", stage = service.stage());
        let tasks = crate::tasks::Tasks::new();
        let (out_tx, out_rx) = mpsc::channel(send::OUTBOX);
        let moved = send::Moved::default();
        tasks.spawn_draining(send::sender(
            client.clone(),
            service.stage(),
            out_rx,
            moved.clone(),
        ));
        let (bulk_tx, bulk_rx) = mpsc::channel(send::BULK_OUTBOX);
        let abandoned = send::Abandoned::default();
        tasks.spawn_draining(send::bulk_sender(
            client.clone(),
            service.stage(),
            bulk_rx,
            abandoned.clone(),
            Arc::clone(&stats),
            moved.clone(),
        ));
        let st = actor::State {
            me: client.local_peer_id(),
            stage: service.stage(),
            n: service.numel(),
            gradient_bytes: part_bytes as u64,
            guard: match cfg.outer {
                Some(_) => guard::Guard::new(cfg.max_norm_ratio).per_copy(),
                None => guard::Guard::new(cfg.max_norm_ratio),
            },
            base_cfg: cfg.clone(),
            cfg,
            client,
            service,
            outbox: out_tx,
            bulk: bulk_tx,
            abandoned,
            inbox,
            log,
            step,
            views: HashMap::new(),
            known: Vec::new(),
            introduced: HashMap::new(),
            moved,
            round: None,
            timed_out: (0, 0),
            tally: None,
            frozen: None,
            early: Vec::new(),
            next_members: None,
            joined: None,
            froze: None,
            last_members: Vec::new(),
            last_sent: None,
            last_sent_at: Instant::now(),
            sent_at_step: 0,
            timers: plan::Timers::default(),
            started: Instant::now(),
            looked_up: false,
            stats: Arc::clone(&stats),
            rng: Rng::new(seed),
            left: false,
            left_lost: 0,
        };
        let (leave, leave_rx) = tokio::sync::watch::channel(false);
        tasks.spawn(tracing::Instrument::instrument(st.run(rx, leave_rx), span));
        Self {
            tasks,
            stats,
            leave,
        }
    }

    /// Tells the stage's other replicas that this one leaves (they forget it at once
    /// instead of waiting for its progress to go stale), and stops taking part in rounds.
    pub fn leave(&self) {
        let _ = self.leave.send(true);
    }

    /// The averager's counters.
    pub fn stats(&self) -> &Arc<AvgStats> {
        &self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_timeouts_scale_with_the_stage_and_the_run_can_set_them() {
        let mut run = RunConfig::tiny();
        let small = AveragerConfig::for_run(&run, 100_000);
        assert_eq!(small.round_timeout, AveragerConfig::MIN_ROUND_TIMEOUT);
        assert_eq!(small.heartbeat, Duration::from_millis(300));
        // 100M parameters in int8+zstd: ~100 MB each way, 8 s per pass at 100 Mbit/s.
        let big = AveragerConfig::for_run(&run, 100_000_000);
        let secs = big.round_timeout.as_secs_f64();
        assert!((60.0..80.0).contains(&secs), "{secs}");
        run.averaging.round_timeout_s = Some(12.5);
        run.averaging.heartbeat_ms = Some(100);
        let set = AveragerConfig::for_run(&run, 100_000_000);
        assert_eq!(set.round_timeout, Duration::from_millis(12_500));
        assert_eq!(set.live_timeout, Duration::from_secs(1));
    }

    #[test]
    fn heartbeats_slow_down_with_the_stage_mates() {
        let base = AveragerConfig::for_run(&RunConfig::tiny(), 1000);
        let small = base.fitted(3);
        assert_eq!(
            (small.heartbeat, small.live_timeout, small.membership_every),
            (base.heartbeat, base.live_timeout, base.membership_every),
            "a small stage keeps its config"
        );
        let mid = base.fitted(8);
        assert_eq!(mid.heartbeat, Duration::from_millis(800));
        let big = base.fitted(44);
        assert_eq!(big.heartbeat, Duration::from_millis(10_800));
        assert_eq!(big.live_timeout, Duration::from_millis(32_400));
        assert_eq!(big.membership_every, Duration::from_millis(22_000));
        // A replica's heartbeats to all its mates stay at ten a second or fewer.
        for mates in [1, 4, 10, 44, 200] {
            let c = base.fitted(mates);
            assert!(
                mates as f64 / c.heartbeat.as_secs_f64() <= 10.0 + 1e-9,
                "{mates}"
            );
            assert!(c.live_timeout >= c.heartbeat * 3);
            if mates >= 40 {
                let per_s = mates as f64 / c.heartbeat.as_secs_f64();
                assert!(per_s <= 4.5, "{mates} mates: {per_s} heartbeats a second");
            }
        }
    }
}
