//! The stage protocol server: one stream per call, a bounded queue, one compute thread.
//!
//! An inbound stream is read under a timeout and with every length checked before anything
//! is allocated (`net::io`). The request is checked (run, stage, step, tensor count) and
//! queued without waiting: when the queue is full the caller is told `overloaded` at once,
//! so a replica never buffers without bound. A single OS thread owns the candle stage and
//! works through the queue; a bad tensor, NaN input or failing op becomes a typed error
//! response, and the replica goes on with the next request.

use super::replica::{Accum, Frozen, Replica, Snapshot};
use super::tensor;
use super::STAGE_PROTOCOL;
use crate::dht::Manifest;
use crate::model::{ModelError, Stage, Upstream};
use crate::net::io::{self as netio, IoError};
use crate::net::{NetError, NetHandle};
use crate::wire::msg::{self, AvgMsg, ErrorKind, Op, Request, Response, StateInfo};
use crate::wire::{CodecSpec, Limits};
use candle_core::{DType, Tensor};
use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use libp2p::PeerId;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, Notify, Semaphore};

/// How far behind the replica's step a caller may be.
pub const MAX_STALENESS: u64 = 1;

/// Knobs of a stage service.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// Requests that may wait or run at once; more are answered `overloaded`.
    pub queue_cap: usize,
    /// Streams that may be reading their request at once; more wait (up to
    /// `read_timeout`) for their turn.
    pub max_readers: usize,
    /// Bounds on every tensor frame.
    pub limits: Limits,
    /// How long a caller may take to send its request.
    pub read_timeout: Duration,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        Self {
            queue_cap: 8,
            max_readers: 32,
            limits: Limits::default(),
            read_timeout: Duration::from_secs(30),
        }
    }
}

/// Counters a replica keeps about its work.
#[derive(Debug, Default)]
pub struct Counters {
    /// Requests answered successfully.
    pub served: AtomicU64,
    /// Requests refused with a typed error.
    pub refused: AtomicU64,
    /// Streams dropped without an answer (timeouts, resets).
    pub dropped: AtomicU64,
    /// Samples whose backward was applied to the accumulator.
    pub samples_accumulated: AtomicU64,
    /// Microseconds spent computing (decode and encode not included).
    pub compute_us: AtomicU64,
    /// Forward and backward jobs run.
    pub jobs: AtomicU64,
    /// Microseconds jobs waited in the queue before compute.
    pub queue_us: AtomicU64,
    /// Microseconds spent reading forward and backward requests off the network (waiting
    /// for the caller's bytes included: on a slow link this is where the time goes).
    pub read_us: AtomicU64,
    /// Microseconds spent writing answers.
    pub write_us: AtomicU64,
    /// Microseconds decoding tensors.
    pub decode_us: AtomicU64,
    /// Microseconds encoding tensors.
    pub encode_us: AtomicU64,
    /// Frame bytes in and out of forward and backward calls.
    pub stage_in: AtomicU64,
    /// See `stage_in`.
    pub stage_out: AtomicU64,
    /// Frame bytes of averaging messages received.
    pub avg_in: AtomicU64,
    /// Frame bytes of state chunks sent to joiners.
    pub state_out: AtomicU64,
}

impl Counters {
    /// One line for logs and `shoal bench`: `replica counters: jobs N compute_ms X ...`.
    pub fn line(&self) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let ms = |a: &AtomicU64| g(a) as f64 / 1e3;
        let mb = |a: &AtomicU64| g(a) as f64 / 1e6;
        format!(
            "replica counters: jobs {} compute_ms {:.1} queue_ms {:.1} read_ms {:.1} write_ms {:.1} decode_ms {:.1} encode_ms {:.1} stage_in_mb {:.2} stage_out_mb {:.2} avg_in_mb {:.2} state_out_mb {:.2} refused {} dropped {}",
            g(&self.jobs),
            ms(&self.compute_us),
            ms(&self.queue_us),
            ms(&self.read_us),
            ms(&self.write_us),
            ms(&self.decode_us),
            ms(&self.encode_us),
            mb(&self.stage_in),
            mb(&self.stage_out),
            mb(&self.avg_in),
            mb(&self.state_out),
            g(&self.refused),
            g(&self.dropped),
        )
    }
}

/// The values of a [`Counters::line`], read back (by `shoal bench`): the parser lives
/// beside the format so that the two change together.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CounterValues {
    /// Forward and backward jobs run.
    pub jobs: f64,
    /// Milliseconds computing.
    pub compute_ms: f64,
    /// Milliseconds jobs waited in the queue.
    pub queue_ms: f64,
    /// Milliseconds reading requests.
    pub read_ms: f64,
    /// Milliseconds writing answers.
    pub write_ms: f64,
    /// Milliseconds decoding tensors.
    pub decode_ms: f64,
    /// Milliseconds encoding tensors.
    pub encode_ms: f64,
    /// Frame MB into forward and backward calls.
    pub stage_in_mb: f64,
    /// Frame MB out of them.
    pub stage_out_mb: f64,
}

impl CounterValues {
    /// Parses `replica counters: jobs N compute_ms X ...` (what [`Counters::line`] prints).
    pub fn parse(line: &str) -> Option<Self> {
        let rest = line.trim().strip_prefix("replica counters:")?;
        let words: Vec<&str> = rest.split_whitespace().collect();
        let get = |k: &str| -> Option<f64> {
            let i = words.iter().position(|w| *w == k)?;
            words.get(i + 1)?.parse().ok()
        };
        Some(Self {
            jobs: get("jobs")?,
            compute_ms: get("compute_ms")?,
            queue_ms: get("queue_ms")?,
            read_ms: get("read_ms")?,
            write_ms: get("write_ms")?,
            decode_ms: get("decode_ms")?,
            encode_ms: get("encode_ms")?,
            stage_in_mb: get("stage_in_mb")?,
            stage_out_mb: get("stage_out_mb")?,
        })
    }
}

/// What a replica reports about its training state (cached for the async side).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplicaStatus {
    /// Applied optimizer steps.
    pub params_step: u64,
    /// The step backward passes accumulate toward.
    pub accum_step: u64,
    /// Samples accumulated toward it.
    pub accum_count: u64,
    /// Samples frozen for a round in progress.
    pub frozen_count: u64,
    /// Samples in every applied step.
    pub samples_applied: u64,
    /// Samples lost with dead replicas.
    pub samples_lost: u64,
    /// Samples dropped when this replica replaced its state.
    pub samples_dropped: u64,
    /// Parameter hash (hex).
    pub params_hash: String,
}

impl ReplicaStatus {
    /// Reads the status of a replica.
    pub fn of(r: &Replica) -> Self {
        Self {
            params_step: r.params_step(),
            accum_step: r.accum_step(),
            accum_count: r.accum_count(),
            frozen_count: r.frozen_count(),
            samples_applied: r.samples_applied(),
            samples_lost: r.samples_lost(),
            samples_dropped: r.samples_dropped(),
            params_hash: r.params_hash().to_string(),
        }
    }
}

/// An averaging message as the averager receives it.
#[derive(Debug)]
pub struct Inbound {
    /// The sender.
    pub from: PeerId,
    /// The message.
    pub msg: AvgMsg,
    /// Its frames.
    pub frames: Vec<Vec<u8>>,
}

/// Floats per state chunk (1 MiB).
pub const STATE_CHUNK: usize = 256 << 10;

struct SnapshotEntry {
    info: StateInfo,
    snap: Snapshot,
}

struct Shared {
    run: String,
    stage: u32,
    queue: AtomicU32,
    cfg: ServiceConfig,
    /// Taken when the service is dropped, so the compute thread sees the queue close.
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    readers: Arc<Semaphore>,
    info: Mutex<Option<String>>,
    counters: Counters,
    replica: Arc<tokio::sync::Mutex<Replica>>,
    status: Mutex<ReplicaStatus>,
    numel: usize,
    accum: Arc<Mutex<Accum>>,
    progress: Arc<Notify>,
    avg_tx: Mutex<Option<mpsc::Sender<Inbound>>>,
    snapshots: Mutex<VecDeque<Arc<SnapshotEntry>>>,
    /// Set when the replica is leaving: no new forward passes, no `info` answers.
    draining: AtomicBool,
}

impl Shared {
    fn step(&self) -> u64 {
        self.status.lock().map(|s| s.params_step).unwrap_or(0)
    }
}

struct Job {
    req: Request,
    frames: Vec<Vec<u8>>,
    reply: oneshot::Sender<Reply>,
    queued_at: Instant,
}

struct Reply {
    header: Response,
    frames: Vec<Vec<u8>>,
}

/// A running stage service. Dropping it stops accepting streams.
pub struct StageService {
    shared: Arc<Shared>,
    accept: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for StageService {
    fn drop(&mut self) {
        if let Some(a) = lock(&self.accept).take() {
            a.abort();
        }
        // Without the sender the compute thread finishes the queued jobs and exits.
        lock(&self.shared.jobs).take();
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding one of these locks cannot leave the data half-updated in a way
    // that matters more than stopping would; keep serving.
    m.lock().unwrap_or_else(|p| p.into_inner())
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
        let (tx, rx) = mpsc::channel(cfg.queue_cap.max(1));
        let shared = Arc::new(Shared {
            run: manifest.id.clone(),
            stage,
            queue: AtomicU32::new(0),
            readers: Arc::new(Semaphore::new(cfg.max_readers.max(1))),
            cfg,
            jobs: Mutex::new(Some(tx)),
            info: Mutex::new(None),
            counters: Counters::default(),
            replica,
            status: Mutex::new(status),
            numel,
            accum,
            progress: Arc::new(Notify::new()),
            avg_tx: Mutex::new(None),
            snapshots: Mutex::new(VecDeque::new()),
            draining: AtomicBool::new(false),
        });
        let codec = manifest.config.codecs.activations;
        let worker_shared = Arc::clone(&shared);
        std::thread::Builder::new()
            .name(format!("shoal-stage-{stage}"))
            .spawn(move || Worker::new(codec, worker_shared).run(rx))
            .map_err(|e| NetError::Invalid(format!("cannot start the compute thread: {e}")))?;
        let mut incoming = net.accept(STAGE_PROTOCOL)?;
        let accept_shared = Arc::clone(&shared);
        let accept = tokio::spawn(async move {
            while let Some((peer, stream)) = incoming.next().await {
                tokio::spawn(handle(Arc::clone(&accept_shared), peer, stream));
            }
        });
        Ok(Self {
            shared,
            accept: Mutex::new(Some(accept)),
        })
    }

    /// Starts leaving: forward and backward passes and `info` calls are refused from now
    /// on (trainers swap in another replica, which recomputes the forward from the input
    /// they kept), while queued jobs finish and averaging and state downloads are still
    /// served, so what this replica accumulated can still be averaged.
    pub fn drain(&self) {
        self.shared.draining.store(true, Ordering::Relaxed);
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
        lock(&self.shared.jobs).take();
        let accept = lock(&self.accept).take();
        if let Some(a) = accept {
            a.abort();
            let _ = a.await;
        }
    }

    /// The stage served.
    pub fn stage(&self) -> usize {
        self.shared.stage as usize
    }

    /// Requests waiting or running now.
    pub fn queue_len(&self) -> u32 {
        self.shared.queue.load(Ordering::Relaxed)
    }

    /// Queue capacity.
    pub fn queue_cap(&self) -> u32 {
        self.shared.cfg.queue_cap as u32
    }

    /// The replica's optimizer step.
    pub fn step(&self) -> u64 {
        self.shared.step()
    }

    /// The cached training status.
    pub fn status(&self) -> ReplicaStatus {
        lock(&self.shared.status).clone()
    }

    /// Freezes step `step`'s gradients (up to `quota` samples) without waiting for compute.
    pub fn freeze(&self, step: u64, quota: u64) -> Result<Frozen, ModelError> {
        let f = lock(&self.shared.accum).freeze(step, quota, self.shared.numel)?;
        let (accum_step, count, frozen) = lock(&self.shared.accum).counts();
        let mut st = lock(&self.shared.status);
        st.accum_step = accum_step;
        st.accum_count = count;
        st.frozen_count = frozen;
        Ok(f)
    }

    /// Parameters of the stage.
    pub fn numel(&self) -> usize {
        self.shared.numel
    }

    /// Re-reads the training status from the replica (waits its turn behind compute).
    pub async fn refresh_status(&self) -> ReplicaStatus {
        let st = ReplicaStatus::of(&*self.shared.replica.lock().await);
        *lock(&self.shared.status) = st.clone();
        self.shared.progress.notify_one();
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

    /// Routes averaging messages to `tx` from now on.
    pub fn attach_averager(&self, tx: mpsc::Sender<Inbound>) {
        *lock(&self.shared.avg_tx) = Some(tx);
    }

    /// Sets the announcement returned to `info` calls.
    pub fn set_info(&self, json: String) {
        *lock(&self.shared.info) = Some(json);
    }

    /// The replica's counters.
    pub fn counters(&self) -> &Counters {
        &self.shared.counters
    }
}

async fn read_request(
    stream: &mut libp2p::Stream,
    limits: &Limits,
    len: [u8; 4],
) -> Result<(Request, Vec<Vec<u8>>), IoError> {
    let head = netio::read_header_after(stream, len).await?;
    let req = msg::decode_request(&head)?;
    let mut frames = Vec::with_capacity(req.tensors as usize);
    for _ in 0..req.tensors {
        frames.push(netio::read_frame(stream, limits).await?);
    }
    Ok((req, frames))
}

/// How long a caller may take to read its answer before the stream is dropped.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a kept stream may wait for its caller's next request.
const IDLE_STREAM: Duration = Duration::from_secs(30);

/// Writes `reply`. A success leaves the stream open for the caller's next request (its
/// client keeps streams for reuse: no new stream, so no protocol negotiation, per call);
/// anything else closes it. Returns whether the stream may carry another request.
async fn respond(stream: &mut libp2p::Stream, reply: &Reply) -> bool {
    let frames: Vec<&[u8]> = reply.frames.iter().map(|f| f.as_slice()).collect();
    let keep = reply.header.error.is_none();
    let write = async {
        netio::write_message(&mut *stream, &reply.header, &frames).await?;
        if keep {
            stream.flush().await.map_err(IoError::from)
        } else {
            stream.close().await.map_err(IoError::from)
        }
    };
    matches!(tokio::time::timeout(WRITE_TIMEOUT, write).await, Ok(Ok(()))) && keep
}

fn refusal(shared: &Shared, kind: ErrorKind, message: impl Into<String>) -> Reply {
    shared.counters.refused.fetch_add(1, Ordering::Relaxed);
    Reply {
        header: Response::err(
            kind,
            message,
            shared.step(),
            shared.queue.load(Ordering::Relaxed),
        ),
        frames: Vec::new(),
    }
}

fn ok(shared: &Shared, tensors: u8) -> Response {
    Response::ok(shared.step(), shared.queue.load(Ordering::Relaxed), tensors)
}

/// Serves the requests of one stream, one after another, until the caller closes it,
/// goes quiet for [`IDLE_STREAM`], or a request is refused.
async fn handle(shared: Arc<Shared>, peer: PeerId, mut stream: libp2p::Stream) {
    loop {
        let mut len = [0u8; 4];
        match tokio::time::timeout(IDLE_STREAM, stream.read_exact(&mut len)).await {
            Ok(Ok(())) => {}
            _ => return,
        }
        if !serve_one(&shared, peer, &mut stream, len).await {
            return;
        }
    }
}

/// Serves one request whose length prefix `len` was read; whether the stream may carry
/// another.
async fn serve_one(
    shared: &Arc<Shared>,
    peer: PeerId,
    stream: &mut libp2p::Stream,
    len: [u8; 4],
) -> bool {
    // With more requests arriving than may be read at once, the rest wait their turn (their
    // bytes wait in the multiplexer's window, which pushes back on the sender) rather than
    // being refused: a refused request would be sent again in full elsewhere, over links
    // that are the bottleneck when requests pile up like this.
    let permit = tokio::time::timeout(
        shared.cfg.read_timeout,
        Arc::clone(&shared.readers).acquire_owned(),
    )
    .await;
    let Ok(Ok(permit)) = permit else {
        let r = refusal(shared, ErrorKind::Overloaded, "too many open calls");
        respond(stream, &r).await;
        return false;
    };
    let t_read = Instant::now();
    let read = tokio::time::timeout(
        shared.cfg.read_timeout,
        read_request(stream, &shared.cfg.limits, len),
    )
    .await;
    let read_us = t_read.elapsed().as_micros() as u64;
    // The permit bounds requests being read; once read, a call waits in the queue, whose
    // own cap bounds it.
    drop(permit);
    let (req, frames) = match read {
        Err(_) => {
            shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        Ok(Err(IoError::Io(_))) => {
            // Truncated or reset: there is nobody sensible to answer.
            shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
            let _ = stream.close().await;
            return false;
        }
        Ok(Err(e)) => {
            let kind = match e {
                IoError::FrameTooLarge { .. } => ErrorKind::TooLarge,
                _ => ErrorKind::BadRequest,
            };
            let r = refusal(shared, kind, e.to_string());
            respond(stream, &r).await;
            return false;
        }
        Ok(Ok(x)) => x,
    };
    if let Some(r) = check(shared, &req) {
        respond(stream, &r).await;
        return false;
    }
    let op = req.op;
    let in_bytes: u64 = frames.iter().map(|f| f.len() as u64).sum();
    let draining = shared.draining.load(Ordering::Relaxed);
    if draining && matches!(req.op, Op::Info | Op::Forward | Op::Backward) {
        let r = refusal(
            shared,
            ErrorKind::Overloaded,
            "this replica is leaving its stage; use another",
        );
        respond(stream, &r).await;
        return false;
    }
    let reply = match req.op {
        Op::Info => {
            let mut header = ok(shared, 0);
            header.info = lock(&shared.info).clone();
            shared.counters.served.fetch_add(1, Ordering::Relaxed);
            Reply {
                header,
                frames: Vec::new(),
            }
        }
        Op::Avg => avg_message(shared, peer, req, frames),
        Op::StateInfo => state_info(shared).await,
        Op::StateChunk => state_chunk(shared, &req).await,
        Op::Forward | Op::Backward => queue_job(shared, req, frames).await,
    };
    let out_bytes: u64 = reply.frames.iter().map(|f| f.len() as u64).sum();
    let c = &shared.counters;
    match op {
        Op::Forward | Op::Backward => {
            c.read_us.fetch_add(read_us, Ordering::Relaxed);
            c.stage_in.fetch_add(in_bytes, Ordering::Relaxed);
            c.stage_out.fetch_add(out_bytes, Ordering::Relaxed);
        }
        Op::Avg => {
            c.avg_in.fetch_add(in_bytes, Ordering::Relaxed);
        }
        Op::StateChunk => {
            c.state_out.fetch_add(out_bytes, Ordering::Relaxed);
        }
        Op::Info | Op::StateInfo => {}
    }
    let t_write = Instant::now();
    let more = respond(stream, &reply).await;
    c.write_us
        .fetch_add(t_write.elapsed().as_micros() as u64, Ordering::Relaxed);
    more
}

async fn queue_job(shared: &Arc<Shared>, req: Request, frames: Vec<Vec<u8>>) -> Reply {
    let (tx, rx) = oneshot::channel();
    let Some(jobs) = lock(&shared.jobs).clone() else {
        return refusal(shared, ErrorKind::Overloaded, "this replica is stopping");
    };
    shared.queue.fetch_add(1, Ordering::Relaxed);
    if jobs
        .try_send(Job {
            req,
            frames,
            reply: tx,
            queued_at: Instant::now(),
        })
        .is_err()
    {
        shared.queue.fetch_sub(1, Ordering::Relaxed);
        return refusal(shared, ErrorKind::Overloaded, "request queue is full");
    }
    match rx.await {
        Ok(reply) => reply,
        Err(_) => refusal(shared, ErrorKind::Internal, "the compute thread stopped"),
    }
}

fn avg_message(shared: &Shared, peer: PeerId, req: Request, frames: Vec<Vec<u8>>) -> Reply {
    let Some(msg) = req.avg else {
        return refusal(
            shared,
            ErrorKind::BadRequest,
            "avg request without a message",
        );
    };
    let tx = lock(&shared.avg_tx).clone();
    let Some(tx) = tx else {
        return refusal(
            shared,
            ErrorKind::Overloaded,
            "this replica is not averaging yet",
        );
    };
    if tx
        .try_send(Inbound {
            from: peer,
            msg,
            frames,
        })
        .is_err()
    {
        return refusal(shared, ErrorKind::Overloaded, "averaging inbox is full");
    }
    shared.counters.served.fetch_add(1, Ordering::Relaxed);
    Reply {
        header: ok(shared, 0),
        frames: Vec::new(),
    }
}

fn chunk_hashes(flat: &[f32]) -> Vec<String> {
    flat.chunks(STATE_CHUNK)
        .map(|c| {
            format!(
                "{:016x}",
                xxhash_rust::xxh3::xxh3_64(bytemuck::cast_slice(c))
            )
        })
        .collect()
}

async fn state_info(shared: &Arc<Shared>) -> Reply {
    let replica = Arc::clone(&shared.replica);
    let snap = tokio::task::spawn_blocking(move || replica.blocking_lock().snapshot()).await;
    let snap = match snap {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return refusal(shared, ErrorKind::Internal, e.to_string()),
        Err(e) => return refusal(shared, ErrorKind::Internal, e.to_string()),
    };
    let info = StateInfo {
        step: snap.step,
        len: snap.flat.len() as u64,
        chunk: STATE_CHUNK as u64,
        hashes: chunk_hashes(&snap.flat),
        params_hash: snap.params_hash.clone(),
        samples_applied: snap.samples_applied,
        samples_lost: snap.samples_lost,
    };
    {
        let mut cache = lock(&shared.snapshots);
        cache.retain(|e| e.info.step != info.step);
        cache.push_back(Arc::new(SnapshotEntry {
            info: info.clone(),
            snap,
        }));
        while cache.len() > 2 {
            cache.pop_front();
        }
    }
    let mut header = ok(shared, 0);
    header.state = Some(info);
    shared.counters.served.fetch_add(1, Ordering::Relaxed);
    Reply {
        header,
        frames: Vec::new(),
    }
}

async fn state_chunk(shared: &Arc<Shared>, req: &Request) -> Reply {
    let Some(c) = req.chunk else {
        return refusal(shared, ErrorKind::BadRequest, "state_chunk without a chunk");
    };
    let entry = lock(&shared.snapshots)
        .iter()
        .find(|e| e.info.step == c.step)
        .cloned();
    let Some(entry) = entry else {
        return refusal(
            shared,
            ErrorKind::StaleStep,
            format!(
                "no snapshot of step {} is held; ask for state_info again",
                c.step
            ),
        );
    };
    let start = c.index as usize * STATE_CHUNK;
    if start >= entry.snap.flat.len() {
        return refusal(shared, ErrorKind::BadRequest, "chunk index out of range");
    }
    let end = (start + STATE_CHUNK).min(entry.snap.flat.len());
    let mut frame = Vec::new();
    if let Err(e) = crate::wire::encode_f32(
        &[end - start],
        &entry.snap.flat[start..end],
        &CodecSpec::F32,
        &mut frame,
    ) {
        return refusal(shared, ErrorKind::Internal, e.to_string());
    }
    shared.counters.served.fetch_add(1, Ordering::Relaxed);
    Reply {
        header: ok(shared, 1),
        frames: vec![frame],
    }
}

fn check(shared: &Shared, req: &Request) -> Option<Reply> {
    if req.run != shared.run {
        return Some(refusal(
            shared,
            ErrorKind::UnknownRun,
            format!("this replica serves run {}, not {}", shared.run, req.run),
        ));
    }
    if req.stage != shared.stage {
        return Some(refusal(
            shared,
            ErrorKind::WrongStage,
            format!(
                "this replica serves stage {}, not {}",
                shared.stage, req.stage
            ),
        ));
    }
    let step = shared.step();
    if matches!(req.op, Op::Forward | Op::Backward) && req.step.saturating_add(MAX_STALENESS) < step
    {
        return Some(refusal(
            shared,
            ErrorKind::StaleStep,
            format!("caller is at step {}, this replica at {step}", req.step),
        ));
    }
    let want = match req.op {
        Op::Forward | Op::Avg => req.tensors.min(1).max(u8::from(req.op == Op::Forward)),
        Op::Backward => 2,
        Op::Info | Op::StateInfo | Op::StateChunk => 0,
    };
    if req.tensors != want {
        return Some(refusal(
            shared,
            ErrorKind::BadRequest,
            format!("{:?} takes {want} tensors, got {}", req.op, req.tensors),
        ));
    }
    None
}

/// The compute thread's state.
struct Worker {
    codec: CodecSpec,
    shared: Arc<Shared>,
}

enum Fail {
    Refuse(ErrorKind, String),
}

impl From<ModelError> for Fail {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::BadInput(m) => Fail::Refuse(ErrorKind::BadTensor, m),
            other => Fail::Refuse(ErrorKind::Internal, other.to_string()),
        }
    }
}

impl From<candle_core::Error> for Fail {
    fn from(e: candle_core::Error) -> Self {
        Fail::Refuse(ErrorKind::Internal, e.to_string())
    }
}

impl Worker {
    fn new(codec: CodecSpec, shared: Arc<Shared>) -> Self {
        Self { codec, shared }
    }

    fn run(self, mut rx: mpsc::Receiver<Job>) {
        let c = &self.shared.counters;
        let codec_us = || c.decode_us.load(Ordering::Relaxed) + c.encode_us.load(Ordering::Relaxed);
        while let Some(job) = rx.blocking_recv() {
            let t0 = Instant::now();
            c.queue_us.fetch_add(
                t0.saturating_duration_since(job.queued_at).as_micros() as u64,
                Ordering::Relaxed,
            );
            c.jobs.fetch_add(1, Ordering::Relaxed);
            let before = codec_us();
            let result = self.process(&job.req, &job.frames);
            let us = (t0.elapsed().as_micros() as u64).saturating_sub(codec_us() - before);
            c.compute_us.fetch_add(us, Ordering::Relaxed);
            self.shared.queue.fetch_sub(1, Ordering::Relaxed);
            let reply = match result {
                Ok(r) => {
                    self.shared.counters.served.fetch_add(1, Ordering::Relaxed);
                    r
                }
                Err(Fail::Refuse(kind, m)) => refusal(&self.shared, kind, m),
            };
            let _ = job.reply.send(reply);
        }
    }

    fn input(&self, r: &Replica, bytes: &[u8], what: &str) -> Result<Tensor, Fail> {
        let stage = r.stage();
        let t0 = Instant::now();
        let d = tensor::decode(bytes, &self.shared.cfg.limits, stage.device());
        self.shared
            .counters
            .decode_us
            .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        let d = d.map_err(|e| Fail::Refuse(ErrorKind::BadTensor, format!("{what}: {e}")))?;
        if !d.finite {
            return Err(Fail::Refuse(
                ErrorKind::NonFinite,
                format!("{what} holds NaN or infinite values"),
            ));
        }
        let t = d.tensor;
        if t.dtype() == DType::F32 && stage.dtype() != DType::F32 {
            Ok(t.to_dtype(stage.dtype())?)
        } else {
            Ok(t)
        }
    }

    fn encode(&self, t: &Tensor) -> Result<Vec<u8>, Fail> {
        let t0 = Instant::now();
        let r = tensor::encode(t, &self.codec);
        self.shared
            .counters
            .encode_us
            .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        r.map_err(|e| Fail::Refuse(ErrorKind::Internal, e.to_string()))
    }

    fn process(&self, req: &Request, frames: &[Vec<u8>]) -> Result<Reply, Fail> {
        let mut r = self.shared.replica.blocking_lock();
        let input = self.input(&r, &frames[0], "input")?;
        match req.op {
            Op::Forward => {
                let out = r.forward(&input, req.mb)?;
                drop(r);
                let frame = self.encode(&out)?;
                Ok(Reply {
                    header: ok(&self.shared, 1),
                    frames: vec![frame],
                })
            }
            Op::Backward => {
                let up = self.input(&r, &frames[1], "upstream")?;
                let upstream = if r.stage().is_last() {
                    Upstream::Targets(&up)
                } else {
                    Upstream::Grad(&up)
                };
                let (g, fresh) = r.backward(&input, upstream, req.mb)?;
                let status = ReplicaStatus::of(&r);
                drop(r);
                if fresh {
                    let samples = input.dims().first().copied().unwrap_or(0) as u64;
                    self.shared
                        .counters
                        .samples_accumulated
                        .fetch_add(samples, Ordering::Relaxed);
                }
                *lock(&self.shared.status) = status;
                self.shared.progress.notify_one();
                let frames = match &g.grad_input {
                    Some(t) => vec![self.encode(t)?],
                    None => Vec::new(),
                };
                let mut header = ok(&self.shared, frames.len() as u8);
                header.loss = g.loss;
                Ok(Reply { header, frames })
            }
            _ => Err(Fail::Refuse(
                ErrorKind::BadRequest,
                "only forward and backward are queued".into(),
            )),
        }
    }
}

/// Samples per second of forward + backward of `stage` on microbatches of `batch`,
/// measured over at least `min_iters` runs or `budget`, after one warm-up.
pub fn measure_throughput(
    stage: &Stage,
    batch: usize,
    seq_len: usize,
    d_model: usize,
    min_iters: usize,
    budget: Duration,
) -> Result<f64, ModelError> {
    let dev = stage.device();
    let input = if stage.is_first() {
        Tensor::zeros((batch, seq_len), DType::U32, dev)?
    } else {
        Tensor::randn(0f32, 1.0, (batch, seq_len, d_model), dev)?.to_dtype(stage.dtype())?
    };
    let up = if stage.is_last() {
        Tensor::zeros((batch, seq_len), DType::U32, dev)?
    } else {
        (Tensor::randn(0f32, 1.0, (batch, seq_len, d_model), dev)? * 1e-3)?
            .to_dtype(stage.dtype())?
    };
    let once = || -> Result<(), ModelError> {
        stage.forward(&input)?;
        let upstream = if stage.is_last() {
            Upstream::Targets(&up)
        } else {
            Upstream::Grad(&up)
        };
        stage.backward(&input, upstream)?;
        Ok(())
    };
    once()?;
    let t0 = Instant::now();
    let mut n = 0usize;
    while n < min_iters.max(1) || (t0.elapsed() < budget && n < 1000) {
        once()?;
        n += 1;
    }
    let secs = t0.elapsed().as_secs_f64().max(1e-9);
    Ok((n * batch) as f64 / secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_lines_parse_back() {
        let c = Counters::default();
        c.jobs.store(10, Ordering::Relaxed);
        c.compute_us.store(200_000, Ordering::Relaxed);
        c.queue_us.store(50_000, Ordering::Relaxed);
        c.decode_us.store(1_000, Ordering::Relaxed);
        c.encode_us.store(2_000, Ordering::Relaxed);
        c.stage_in.store(1_500_000, Ordering::Relaxed);
        let v = CounterValues::parse(&c.line()).unwrap();
        assert_eq!(
            (v.jobs, v.compute_ms, v.queue_ms, v.decode_ms, v.encode_ms),
            (10.0, 200.0, 50.0, 1.0, 2.0)
        );
        assert_eq!(v.stage_in_mb, 1.5);
        assert!(CounterValues::parse("replica counters: jobs 1").is_none());
        assert!(CounterValues::parse("jobs 1 compute_ms 2").is_none());
    }
}
