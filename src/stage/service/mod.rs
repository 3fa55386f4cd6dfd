//! The stage protocol server: one stream per call, a bounded queue, one compute thread.
//!
//! An inbound stream is read under a timeout and with every length checked before anything
//! is allocated (`net::io`). The request is checked (run, stage, step, tensor count) and
//! queued without waiting: when the queue is full the caller is told `overloaded` at once,
//! so a replica never buffers without bound (backwards wait in a lane of their own and
//! are taken first, see `jobs`). A single OS thread owns the candle stage and
//! works through the queue; a bad tensor, NaN input or failing op becomes a typed error
//! response, and the replica goes on with the next request.
//!
//! - [`counters`]: what the replica counts, and its cached training status.
//! - `conn`: one inbound stream: read, check, dispatch, answer.
//! - `jobs`: the job queue, backwards before forwards.
//! - `mates`: the stage mates an `info` answer names.
//! - `worker`: the compute thread.
//! - [`push`]: activations a replica of the stage before pushes here, held for their call.
//! - this module: the service handle and what it shares with those.
//!
//! Averaging messages and state download are not answered here: the averaging layer
//! registers an [`Extension`] that answers them (`crate::averaging::server`).

mod budget;
mod conn;
pub mod counters;
pub mod expect;
mod hold;
mod jobs;
mod mates;
pub mod neighbours;
pub mod push;
mod worker;

pub use counters::{CounterSnapshot, Counters, ReplicaStatus};
pub use worker::measure_throughput;

use super::replica::{Accum, Frozen, Replica};
use super::Lane;
use crate::dht::Manifest;
use crate::model::ModelError;
use crate::net::{NetError, NetHandle};
use crate::wire::msg::{ErrorKind, Request, Response, StateInfo};
use crate::wire::{CodecSpec, Limits};
use futures::future::BoxFuture;
use futures::StreamExt;
use libp2p::PeerId;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Notify, Semaphore};

/// How far behind the replica's step a caller's forward or backward may be tagged before it
/// is refused (`stale_step`, which tells the caller the step). A caller's step is the one
/// it last heard of, and a trainer that never waits hears late: at a step every ~170 ms its
/// next stage-0 forward was often two steps behind, and at 1 a
/// fifth of the microbatches paid a refusal and a round trip on their way. The tag says
/// nothing about a gradient's staleness — the replica computes at its own parameters and
/// bounds that itself (`Replica::backward`) — so this only catches a caller that lost
/// track of the run.
pub const MAX_CALLER_LAG: u64 = 8;

/// Knobs of a stage service.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// Forwards that may wait at once, and as many backwards besides (each kind waits in
    /// a lane of its own, backwards taken first); more are answered `overloaded`.
    pub queue_cap: usize,
    /// Streams that may be reading their request at once; more wait (up to
    /// `read_timeout`) for their turn.
    pub max_readers: usize,
    /// Bounds on every tensor frame (tightened at start to the largest tensor the run
    /// sends a replica).
    pub limits: Limits,
    /// How long a caller may take to send its request.
    pub read_timeout: Duration,
    /// Frame bytes one caller's requests may hold here at once, from the first frame read
    /// until the answer is written; a request over it is answered `overloaded` before its
    /// next frame is read. `None`: 16 of the run's largest frames, at least 64 MiB.
    pub max_bytes_per_peer: Option<u64>,
}

impl ServiceConfig {
    /// Requests a replica queues by default before it answers `overloaded` (`--queue`).
    pub const QUEUE_CAP: usize = 8;
}

impl Default for ServiceConfig {
    fn default() -> Self {
        Self {
            queue_cap: Self::QUEUE_CAP,
            max_readers: 32,
            limits: Limits::default(),
            read_timeout: Duration::from_secs(30),
            max_bytes_per_peer: None,
        }
    }
}

/// [`ServiceConfig::max_bytes_per_peer`]'s default: this many of the run's largest frames,
/// and at least [`MIN_BYTES_PER_PEER`].
pub const FRAMES_PER_PEER: u64 = 16;
/// The least default byte budget of a caller.
pub const MIN_BYTES_PER_PEER: u64 = 64 << 20;

/// A successful answer of an [`Extension`]: what goes into the response besides the
/// service's own fields (step, queue).
#[derive(Debug, Default)]
pub struct Answer {
    /// A state download's description.
    pub state: Option<StateInfo>,
    /// A page of a state's chunk hashes.
    pub hashes: Option<Vec<String>>,
    /// The averaged update a chunk belongs to.
    pub update: Option<crate::wire::msg::UpdateInfo>,
    /// Tensor frames.
    pub frames: Vec<Vec<u8>>,
}

/// Why an [`Extension`] refused a call: the kind and message the caller gets.
#[derive(Debug)]
pub struct Refusal {
    /// Error kind.
    pub kind: ErrorKind,
    /// A human-readable reason.
    pub message: String,
}

impl Refusal {
    /// A refusal of `kind`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

/// Answers the calls of the stage protocol that belong to a layer above the stage
/// (averaging messages, state download). The request was read and checked (run, stage,
/// tensor count) before it gets here.
pub trait Extension: Send + Sync {
    /// Answers `req` from `peer`.
    fn call(
        &self,
        peer: PeerId,
        req: Request,
        frames: Vec<Vec<u8>>,
    ) -> BoxFuture<'_, Result<Answer, Refusal>>;
}

struct Shared {
    run: String,
    stage: u32,
    /// What requests of this stage carry.
    expect: expect::Expect,
    queue: AtomicU32,
    cfg: ServiceConfig,
    /// Closed when the service is dropped, so the compute thread finishes and exits.
    jobs: jobs::JobQueue<worker::Job>,
    readers: Arc<Semaphore>,
    info: Mutex<Option<String>>,
    /// The stage's other live replicas ([`StageService::set_mates`]).
    mates: Mutex<Vec<PeerId>>,
    counters: Counters,
    replica: Arc<tokio::sync::Mutex<Replica>>,
    status: Mutex<ReplicaStatus>,
    numel: usize,
    accum: Arc<Mutex<Accum>>,
    /// Outer averaging: freezing a step takes the inner step, so it goes through the
    /// replica (see `Replica::freeze`).
    outer: bool,
    progress: Arc<Notify>,
    extension: Mutex<Option<Arc<dyn Extension>>>,
    /// Set when the replica is leaving: no new forward passes, no `info` answers.
    draining: AtomicBool,
    /// Callers whose requests failed validation, and those refused for it a while.
    bans: Mutex<crate::guard::Guard>,
    /// Numbers the strikes (each refusal is one).
    strikes: std::sync::atomic::AtomicU64,
    /// Streams open per caller.
    streams: Mutex<std::collections::HashMap<PeerId, usize>>,
    /// Frame bytes held per caller ([`ServiceConfig::max_bytes_per_peer`]).
    held: Mutex<std::collections::HashMap<PeerId, u64>>,
    /// That budget, resolved.
    peer_budget: u64,
    /// Inputs pushed by replicas of the stage before.
    inbox: push::Inbox,
    /// Sends this replica's forward outputs on to the next stage when asked to.
    pusher: super::client::StageClient,
    /// The announced stages of the peers pushes go to and come from.
    neighbours: neighbours::Neighbours,
    /// The run's target batch (synchronous admission at stage 0).
    target: u64,
    /// What the stage's other replicas hold toward this one's step, from the averager.
    others: Mutex<super::sync::Others>,
    /// Woken when the step, the accumulator or `others` change: synchronous calls held for
    /// a step look again.
    sync_changed: Notify,
    /// Synchronous calls held here for a step after this replica's (a later stage's sign
    /// that stage 0 has moved on).
    held_ahead: AtomicU32,
    /// Why the compute thread died, once it has (a panic, caught).
    failed: Mutex<Option<String>>,
}

impl Shared {
    fn step(&self) -> u64 {
        self.status.lock().params_step
    }
}

/// An answer as it is written back.
struct Reply {
    header: Response,
    frames: Vec<Vec<u8>>,
}

/// A running stage service. Dropping it stops accepting streams.
pub struct StageService {
    shared: Arc<Shared>,
    /// The accept loop of each lane.
    accept: crate::tasks::Tasks,
}

impl Drop for StageService {
    fn drop(&mut self) {
        self.accept.cancel();
        // The compute thread finishes the queued jobs and exits.
        self.shared.jobs.close();
    }
}

impl std::fmt::Debug for StageService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageService")
            .field("run", &self.shared.run)
            .field("stage", &self.shared.stage)
            .finish()
    }
}

impl StageService {
    /// Starts serving `replica` (a stage of `manifest`) on `net`.
    pub fn start(
        net: &NetHandle,
        manifest: &Manifest,
        replica: Arc<tokio::sync::Mutex<Replica>>,
        cfg: ServiceConfig,
    ) -> Result<Self, NetError> {
        let (stage, status, numel, accum) = {
            let r = replica
                .try_lock()
                .map_err(|_| NetError::Invalid("the replica is in use".into()))?;
            (
                r.stage().index() as u32,
                ReplicaStatus::of(&r),
                r.stage().params().numel(),
                r.accumulator(),
            )
        };
        let expect = expect::Expect::of(&manifest.config, stage as usize);
        let mut cfg = cfg;
        let run_limits = expect.limits();
        cfg.limits.max_elements = cfg.limits.max_elements.min(run_limits.max_elements);
        cfg.limits.max_bytes = cfg.limits.max_bytes.min(run_limits.max_bytes);
        let peer_budget = cfg.max_bytes_per_peer.unwrap_or_else(|| {
            (FRAMES_PER_PEER.saturating_mul(cfg.limits.max_bytes)).max(MIN_BYTES_PER_PEER)
        });
        let queue_cap = cfg.queue_cap;
        let shared = Arc::new(Shared {
            run: manifest.id.clone(),
            stage,
            expect,
            queue: AtomicU32::new(0),
            readers: Arc::new(Semaphore::new(cfg.max_readers.max(1))),
            cfg,
            jobs: jobs::JobQueue::new(queue_cap),
            info: Mutex::new(None),
            mates: Mutex::new(Vec::new()),
            counters: Counters::default(),
            replica,
            status: Mutex::new(status),
            numel,
            accum,
            outer: manifest.config.averaging.outer().is_some(),
            progress: Arc::new(Notify::new()),
            extension: Mutex::new(None),
            draining: AtomicBool::new(false),
            bans: Mutex::new(crate::guard::Guard::default()),
            strikes: std::sync::atomic::AtomicU64::new(0),
            streams: Mutex::new(std::collections::HashMap::new()),
            held: Mutex::new(std::collections::HashMap::new()),
            peer_budget,
            inbox: push::Inbox::default(),
            pusher: super::client::StageClient::new(
                net.clone(),
                manifest.id.clone(),
                manifest.config.codecs.activations.wire(),
            )
            .with_timeout(push::SEND_TIMEOUT),
            neighbours: neighbours::Neighbours::new(net.clone(), manifest.id.clone()),
            target: manifest.config.target_batch_size() as u64,
            others: Mutex::new(super::sync::Others::default()),
            sync_changed: Notify::new(),
            held_ahead: AtomicU32::new(0),
            failed: Mutex::new(None),
        });
        let codec = manifest.config.codecs.activations.wire();
        let worker_shared = Arc::clone(&shared);
        std::thread::Builder::new()
            .name(format!("shoal-stage-{stage}"))
            .spawn(move || {
                let w = worker::Worker::new(codec, Arc::clone(&worker_shared));
                worker::run_guarded(&worker_shared, move || w.run());
            })
            .map_err(|e| NetError::Invalid(format!("cannot start the compute thread: {e}")))?;
        let span = tracing::info_span!("stage", index = stage);
        // Every lane is registered before any loop starts: a failure leaves nothing behind
        // (an `Incoming` dropped unregisters its protocol).
        let incomings = Lane::ALL
            .into_iter()
            .map(|lane| Ok((lane, net.accept_with(lane.protocol(), conn::lane(&shared))?)))
            .collect::<Result<Vec<_>, NetError>>()?;
        let accepts = crate::tasks::Tasks::new();
        for (lane, mut incoming) in incomings {
            let accept_shared = Arc::clone(&shared);
            accepts.spawn(tracing::Instrument::instrument(
                async move {
                    while let Some((peer, stream)) = incoming.next().await {
                        tokio::spawn(tracing::Instrument::in_current_span(conn::handle(
                            Arc::clone(&accept_shared),
                            lane,
                            peer,
                            stream,
                        )));
                    }
                },
                span.clone(),
            ));
        }
        Ok(Self {
            shared,
            accept: accepts,
        })
    }

    /// Starts leaving: forward and backward passes and `info` calls are refused from now
    /// on (trainers swap in another replica, which recomputes the forward from the input
    /// they kept), while queued jobs finish and averaging and state downloads are still
    /// served, so what this replica accumulated can still be averaged.
    pub fn drain(&self) {
        self.shared.draining.store(true, Ordering::Relaxed);
    }

    /// Why the compute thread died, if it has (a panic): the replica refuses every call
    /// from then on; its peer withdraws it and stops.
    pub fn failure(&self) -> Option<String> {
        self.shared.failed.lock().clone()
    }

    /// Whether [`drain`](Self::drain) was called.
    pub fn is_draining(&self) -> bool {
        self.shared.draining.load(Ordering::Relaxed)
    }

    /// Stops serving: no more streams are accepted (the protocol can be accepted again at
    /// once, e.g. by the service of another stage) and the compute thread exits after the
    /// jobs already queued.
    pub async fn close(&self) {
        self.drain();
        self.shared.jobs.close();
        // The loops end at once (each waits for its next stream); their per-stream tasks
        // finish the calls under way.
        self.accept.shutdown(Duration::from_secs(5)).await;
    }

    /// The stage served.
    pub fn stage(&self) -> usize {
        self.shared.stage as usize
    }

    /// Requests waiting or running now.
    pub fn queue_len(&self) -> u32 {
        self.shared.queue.load(Ordering::Relaxed)
    }

    /// Frame bytes of requests being read or waiting, held against `peer`'s byte budget
    /// ([`ServiceConfig::max_bytes_per_peer`]).
    pub fn held_bytes(&self, peer: &PeerId) -> u64 {
        self.shared.held.lock().get(peer).copied().unwrap_or(0)
    }

    /// Synchronous calls held now for a step after this replica's: stage 0 has opened a
    /// later step, so no more microbatches of this replica's step are coming from it.
    pub fn held_ahead(&self) -> u32 {
        self.shared.held_ahead.load(Ordering::Relaxed)
    }

    /// Queue capacity.
    pub fn queue_cap(&self) -> u32 {
        self.shared.cfg.queue_cap as u32
    }

    /// The replica's optimizer step.
    pub fn step(&self) -> u64 {
        self.shared.step()
    }

    /// The cached training status (what is owed toward the step read afresh: owed
    /// samples time out without an event).
    pub fn status(&self) -> ReplicaStatus {
        let mut st = self.shared.status.lock().clone();
        st.owed_count = self.shared.accum.lock().owed_now();
        st
    }

    /// The stage's other live replicas, as the averager hears them: an `info` answer names
    /// some of them ([`crate::wire::msg::Response::mates`]).
    pub fn set_mates(&self, mates: Vec<PeerId>) {
        *self.shared.mates.lock() = mates;
    }

    /// What the stage's other replicas hold toward this one's step, as the averager heard
    /// (stage 0's admission of synchronous microbatches reads it).
    pub fn set_others(&self, others: super::sync::Others) {
        let changed = {
            let mut o = self.shared.others.lock();
            let changed = *o != others;
            *o = others;
            changed
        };
        if changed {
            self.shared.sync_changed.notify_waiters();
        }
    }

    /// Freezes step `step`'s gradients (all accumulated so far), encoded in chunks of
    /// `chunk` values with `codec`, without waiting for compute; in outer mode the inner
    /// step is taken too, which waits for the replica behind compute (call it off the
    /// runtime).
    pub fn freeze(&self, step: u64, chunk: usize, codec: &CodecSpec) -> Result<Frozen, ModelError> {
        let f = if self.shared.outer {
            self.shared
                .replica
                .blocking_lock()
                .freeze(step, chunk, codec)?
        } else {
            self.shared
                .accum
                .lock()
                .freeze(step, self.shared.numel, chunk, codec)?
        };
        let (accum_step, count, frozen) = self.shared.accum.lock().counts();
        {
            let mut st = self.shared.status.lock();
            st.accum_step = accum_step;
            st.accum_count = count;
            st.frozen_count = frozen;
        }
        self.shared.sync_changed.notify_waiters();
        Ok(f)
    }

    /// Parameters of the stage.
    pub fn numel(&self) -> usize {
        self.shared.numel
    }

    /// Re-reads the training status from the replica (waits its turn behind compute).
    pub async fn refresh_status(&self) -> ReplicaStatus {
        let st = ReplicaStatus::of(&*self.shared.replica.lock().await);
        *self.shared.status.lock() = st.clone();
        self.shared.progress.notify_one();
        self.shared.sync_changed.notify_waiters();
        st
    }

    /// Hex hash of the parameters.
    pub fn params_hash(&self) -> String {
        self.status().params_hash
    }

    /// The replica's state. The lock is fair (first come, first served), so the averager
    /// gets its turn between two backward passes even under load.
    pub fn replica(&self) -> Arc<tokio::sync::Mutex<Replica>> {
        Arc::clone(&self.shared.replica)
    }

    /// Woken after every backward and state change.
    pub fn progress(&self) -> Arc<Notify> {
        Arc::clone(&self.shared.progress)
    }

    /// Answers averaging and state-download calls with `ext` from now on.
    pub fn attach(&self, ext: Arc<dyn Extension>) {
        *self.shared.extension.lock() = Some(ext);
    }

    /// Sets the announcement returned to `info` calls.
    pub fn set_info(&self, json: String) {
        *self.shared.info.lock() = Some(json);
    }

    /// The replica's counters.
    pub fn counters(&self) -> &Counters {
        &self.shared.counters
    }
}
