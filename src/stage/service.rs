//! The stage protocol server: one stream per call, a bounded queue, one compute thread.
//!
//! An inbound stream is read under a timeout and with every length checked before anything
//! is allocated (`net::io`). The request is checked (run, stage, step, tensor count) and
//! queued without waiting: when the queue is full the caller is told `overloaded` at once,
//! so a replica never buffers without bound. A single OS thread owns the candle stage and
//! works through the queue; a bad tensor, NaN input or failing op becomes a typed error
//! response, and the replica goes on with the next request.

use super::tensor;
use super::STAGE_PROTOCOL;
use crate::dht::Manifest;
use crate::model::{ModelError, Stage, Upstream};
use crate::net::io::{self as netio, IoError};
use crate::net::{NetError, NetHandle};
use crate::wire::msg::{self, ErrorKind, Op, Request, Response};
use crate::wire::{CodecSpec, Limits};
use candle_core::{DType, Tensor};
use futures::{AsyncWriteExt, StreamExt};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, Semaphore};

/// How far behind the replica's step a caller may be.
pub const MAX_STALENESS: u64 = 1;

/// Knobs of a stage service.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// Requests that may wait or run at once; more are answered `overloaded`.
    pub queue_cap: usize,
    /// Streams that may be reading their request at once.
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
    /// Microseconds spent computing.
    pub compute_us: AtomicU64,
}

struct Shared {
    run: String,
    stage: u32,
    step: AtomicU64,
    queue: AtomicU32,
    cfg: ServiceConfig,
    jobs: mpsc::Sender<Job>,
    readers: Arc<Semaphore>,
    info: Mutex<Option<String>>,
    counters: Counters,
}

struct Job {
    req: Request,
    frames: Vec<Vec<u8>>,
    reply: oneshot::Sender<Reply>,
}

struct Reply {
    header: Response,
    frames: Vec<Vec<u8>>,
}

/// A running stage service. Dropping it stops accepting streams.
pub struct StageService {
    shared: Arc<Shared>,
    accept: tokio::task::JoinHandle<()>,
    params_hash: String,
}

impl Drop for StageService {
    fn drop(&mut self) {
        self.accept.abort();
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
    /// Starts serving `stage` of `manifest` on `net`.
    pub fn start(
        net: &NetHandle,
        manifest: &Manifest,
        stage: Stage,
        cfg: ServiceConfig,
    ) -> Result<Self, NetError> {
        let params_hash = stage
            .params()
            .hash()
            .map(|h| format!("{h:016x}"))
            .map_err(|e| NetError::Invalid(format!("cannot hash parameters: {e}")))?;
        let (tx, rx) = mpsc::channel(cfg.queue_cap.max(1));
        let shared = Arc::new(Shared {
            run: manifest.id.clone(),
            stage: stage.index() as u32,
            step: AtomicU64::new(0),
            queue: AtomicU32::new(0),
            readers: Arc::new(Semaphore::new(cfg.max_readers.max(1))),
            cfg,
            jobs: tx,
            info: Mutex::new(None),
            counters: Counters::default(),
        });
        let codec = manifest.config.codecs.activations;
        let worker_shared = Arc::clone(&shared);
        std::thread::Builder::new()
            .name(format!("shoal-stage-{}", stage.index()))
            .spawn(move || Worker::new(stage, codec, worker_shared).run(rx))
            .map_err(|e| NetError::Invalid(format!("cannot start the compute thread: {e}")))?;
        let mut incoming = net.accept(STAGE_PROTOCOL)?;
        let accept_shared = Arc::clone(&shared);
        let accept = tokio::spawn(async move {
            while let Some((_peer, stream)) = incoming.next().await {
                tokio::spawn(handle(Arc::clone(&accept_shared), stream));
            }
        });
        Ok(Self {
            shared,
            accept,
            params_hash,
        })
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
        self.shared.step.load(Ordering::Relaxed)
    }

    /// Hex hash of the parameters.
    pub fn params_hash(&self) -> &str {
        &self.params_hash
    }

    /// Sets the announcement returned to `info` calls.
    pub fn set_info(&self, json: String) {
        if let Ok(mut g) = self.shared.info.lock() {
            *g = Some(json);
        }
    }

    /// The replica's counters.
    pub fn counters(&self) -> &Counters {
        &self.shared.counters
    }
}

async fn read_request(
    stream: &mut libp2p::Stream,
    limits: &Limits,
) -> Result<(Request, Vec<Vec<u8>>), IoError> {
    let head = netio::read_header(stream).await?;
    let req = msg::decode_request(&head)?;
    let mut frames = Vec::with_capacity(req.tensors as usize);
    for _ in 0..req.tensors {
        frames.push(netio::read_frame(stream, limits).await?);
    }
    Ok((req, frames))
}

async fn respond(stream: &mut libp2p::Stream, reply: &Reply) {
    let frames: Vec<&[u8]> = reply.frames.iter().map(|f| f.as_slice()).collect();
    if netio::write_message(stream, &reply.header, &frames)
        .await
        .is_ok()
    {
        let _ = stream.close().await;
    }
}

fn refusal(shared: &Shared, kind: ErrorKind, message: impl Into<String>) -> Reply {
    shared.counters.refused.fetch_add(1, Ordering::Relaxed);
    Reply {
        header: Response::err(
            kind,
            message,
            shared.step.load(Ordering::Relaxed),
            shared.queue.load(Ordering::Relaxed),
        ),
        frames: Vec::new(),
    }
}

async fn handle(shared: Arc<Shared>, mut stream: libp2p::Stream) {
    let Ok(_permit) = Arc::clone(&shared.readers).try_acquire_owned() else {
        let r = refusal(&shared, ErrorKind::Overloaded, "too many open calls");
        respond(&mut stream, &r).await;
        return;
    };
    let read = tokio::time::timeout(
        shared.cfg.read_timeout,
        read_request(&mut stream, &shared.cfg.limits),
    )
    .await;
    let (req, frames) = match read {
        Err(_) => {
            shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        Ok(Err(IoError::Io(_))) => {
            // Truncated or reset: there is nobody sensible to answer.
            shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
            let _ = stream.close().await;
            return;
        }
        Ok(Err(e)) => {
            let kind = match e {
                IoError::FrameTooLarge { .. } => ErrorKind::TooLarge,
                _ => ErrorKind::BadRequest,
            };
            let r = refusal(&shared, kind, e.to_string());
            respond(&mut stream, &r).await;
            return;
        }
        Ok(Ok(x)) => x,
    };
    if let Some(r) = check(&shared, &req) {
        respond(&mut stream, &r).await;
        return;
    }
    if req.op == Op::Info {
        let info = shared.info.lock().ok().and_then(|g| g.clone());
        let mut header = Response::ok(
            shared.step.load(Ordering::Relaxed),
            shared.queue.load(Ordering::Relaxed),
            0,
        );
        header.info = info;
        shared.counters.served.fetch_add(1, Ordering::Relaxed);
        respond(
            &mut stream,
            &Reply {
                header,
                frames: Vec::new(),
            },
        )
        .await;
        return;
    }
    let (tx, rx) = oneshot::channel();
    shared.queue.fetch_add(1, Ordering::Relaxed);
    if shared
        .jobs
        .try_send(Job {
            req,
            frames,
            reply: tx,
        })
        .is_err()
    {
        shared.queue.fetch_sub(1, Ordering::Relaxed);
        let r = refusal(&shared, ErrorKind::Overloaded, "request queue is full");
        respond(&mut stream, &r).await;
        return;
    }
    match rx.await {
        Ok(reply) => respond(&mut stream, &reply).await,
        Err(_) => {
            let r = refusal(&shared, ErrorKind::Internal, "the compute thread stopped");
            respond(&mut stream, &r).await;
        }
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
    let step = shared.step.load(Ordering::Relaxed);
    if req.step.saturating_add(MAX_STALENESS) < step {
        return Some(refusal(
            shared,
            ErrorKind::StaleStep,
            format!("caller is at step {}, this replica at {step}", req.step),
        ));
    }
    let want = match req.op {
        Op::Forward => 1,
        Op::Backward => 2,
        Op::Info => 0,
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
    stage: Stage,
    codec: CodecSpec,
    shared: Arc<Shared>,
    accum: Option<Vec<Tensor>>,
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
    fn new(stage: Stage, codec: CodecSpec, shared: Arc<Shared>) -> Self {
        Self {
            stage,
            codec,
            shared,
            accum: None,
        }
    }

    fn run(mut self, mut rx: mpsc::Receiver<Job>) {
        while let Some(job) = rx.blocking_recv() {
            let t0 = Instant::now();
            let result = self.process(&job.req, &job.frames);
            let us = t0.elapsed().as_micros() as u64;
            self.shared
                .counters
                .compute_us
                .fetch_add(us, Ordering::Relaxed);
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

    fn input(&self, bytes: &[u8], what: &str) -> Result<Tensor, Fail> {
        let d = tensor::decode(bytes, &self.shared.cfg.limits, self.stage.device())
            .map_err(|e| Fail::Refuse(ErrorKind::BadTensor, format!("{what}: {e}")))?;
        if !d.finite {
            return Err(Fail::Refuse(
                ErrorKind::NonFinite,
                format!("{what} holds NaN or infinite values"),
            ));
        }
        Ok(d.tensor)
    }

    fn encode(&self, t: &Tensor) -> Result<Vec<u8>, Fail> {
        tensor::encode(t, &self.codec).map_err(|e| Fail::Refuse(ErrorKind::Internal, e.to_string()))
    }

    fn process(&mut self, req: &Request, frames: &[Vec<u8>]) -> Result<Reply, Fail> {
        let step = self.shared.step.load(Ordering::Relaxed);
        let input = self.input(&frames[0], "input")?;
        let input = if input.dtype() == DType::F32 && self.stage.dtype() != DType::F32 {
            input.to_dtype(self.stage.dtype())?
        } else {
            input
        };
        match req.op {
            Op::Forward => {
                let out = self.stage.forward(&input)?;
                let frame = self.encode(&out)?;
                Ok(Reply {
                    header: Response::ok(step, self.shared.queue.load(Ordering::Relaxed), 1),
                    frames: vec![frame],
                })
            }
            Op::Backward => {
                let up = self.input(&frames[1], "upstream")?;
                let up = if up.dtype() == DType::F32 && self.stage.dtype() != DType::F32 {
                    up.to_dtype(self.stage.dtype())?
                } else {
                    up
                };
                let upstream = if self.stage.is_last() {
                    Upstream::Targets(&up)
                } else {
                    Upstream::Grad(&up)
                };
                let g = self.stage.backward(&input, upstream)?;
                self.accumulate(g.grads)?;
                let samples = input.dims().first().copied().unwrap_or(0) as u64;
                self.shared
                    .counters
                    .samples_accumulated
                    .fetch_add(samples, Ordering::Relaxed);
                let frames = match &g.grad_input {
                    Some(t) => vec![self.encode(t)?],
                    None => Vec::new(),
                };
                let mut header = Response::ok(
                    step,
                    self.shared.queue.load(Ordering::Relaxed),
                    frames.len() as u8,
                );
                header.loss = g.loss;
                Ok(Reply { header, frames })
            }
            Op::Info => Err(Fail::Refuse(
                ErrorKind::BadRequest,
                "info is answered without the queue".into(),
            )),
        }
    }

    fn accumulate(&mut self, grads: Vec<Tensor>) -> Result<(), Fail> {
        self.accum = Some(match self.accum.take() {
            None => grads,
            Some(acc) => acc
                .iter()
                .zip(&grads)
                .map(|(a, g)| a + g)
                .collect::<candle_core::Result<Vec<_>>>()?,
        });
        Ok(())
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
