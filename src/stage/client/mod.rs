//! Calling a remote stage: forward, backward and info over the stage protocol.
//!
//! A call writes its request while it reads the response, so a replica that refuses early
//! (a frame over its limit, a full queue) is heard at once instead of leaving the caller
//! blocked on a write nobody reads.
//!
//! - [`retry`]: the one retry policy of stage-protocol calls.

pub use super::exchange::{exchange, exchange_kept};
use super::{tensor, Lane};
use crate::net::io::{self as netio, IoError};
use crate::net::{NetError, NetHandle};
use crate::wire::msg::{
    AvgMsg, Call, ChunkReq, ErrorKind, Request, Response, StateInfo, MSG_VERSION,
};
use crate::wire::{CodecSpec, Limits, WireError};
use candle_core::{Device, Tensor};
use libp2p::PeerId;
pub use retry::{may_resend, may_retry, Retry};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why a remote call failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The peer could not be reached.
    #[error(transparent)]
    Net(#[from] NetError),
    /// The stream broke or a message was malformed.
    #[error(transparent)]
    Io(#[from] IoError),
    /// No answer in time.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The replica refused with a typed error.
    #[error("replica refused ({kind}): {message}")]
    Remote {
        /// What kind of refusal.
        kind: ErrorKind,
        /// The replica's message.
        message: String,
        /// The replica's step when it answered.
        step: u64,
    },
    /// A tensor in the reply did not decode.
    #[error("bad tensor in reply: {0}")]
    Wire(#[from] WireError),
    /// The reply does not fit the request.
    #[error("unexpected reply: {0}")]
    Protocol(String),
}

impl CallError {
    /// The replica's error kind, when it refused.
    pub fn kind(&self) -> Option<ErrorKind> {
        match self {
            Self::Remote { kind, .. } => Some(*kind),
            _ => None,
        }
    }
}

/// The result of a remote backward.
#[derive(Debug)]
pub struct BackwardReply {
    /// The loss, from the last stage.
    pub loss: Option<f32>,
    /// d(loss)/d(input); none from stage 0.
    pub grad_input: Option<Tensor>,
    /// The replica's step.
    pub step: u64,
}

/// Bytes a client moved, shared by its clones.
#[derive(Debug, Default)]
pub struct ClientCounters {
    /// Frame bytes sent.
    pub sent: AtomicU64,
    /// Frame bytes received.
    pub received: AtomicU64,
    /// The same tensors as f32 (u32 ids as 4 bytes).
    pub raw: AtomicU64,
    /// The highest step any replica answered with.
    pub step: AtomicU64,
    /// Per replica called, what it last reported and the bytes moved with it; at most
    /// [`MAX_LINKS`] replicas.
    replicas: parking_lot::Mutex<std::collections::HashMap<PeerId, PerReplica>>,
}

/// What a client knows of one replica it called.
#[derive(Debug, Default, Clone, Copy)]
struct PerReplica {
    /// The queue it reported in its latest answer.
    queue: u32,
    /// Frame bytes sent to it.
    sent: u64,
    /// Frame bytes received from it.
    received: u64,
}

/// Replicas a client keeps counts of apiece (a run's replicas are far fewer; the bound is
/// for a client that calls whatever the DHT offers).
pub const MAX_LINKS: usize = 1024;

impl ClientCounters {
    /// Frame bytes (sent, received) per replica this client called.
    pub fn links(&self) -> Vec<(PeerId, u64, u64)> {
        self.replicas
            .lock()
            .iter()
            .map(|(p, r)| (*p, r.sent, r.received))
            .collect()
    }

    /// Notes an answer of `peer` (its queue) and the bytes the call moved.
    fn count_call(&self, peer: PeerId, queue: u32, sent: u64, received: u64) {
        {
            let mut m = self.replicas.lock();
            if m.len() < MAX_LINKS || m.contains_key(&peer) {
                let r = m.entry(peer).or_default();
                r.queue = queue;
                r.sent += sent;
                r.received += received;
            }
        }
    }

    /// The queue `peer` reported in its latest answer to this client, if it answered.
    pub fn last_queue(&self, peer: &PeerId) -> Option<u32> {
        self.replicas.lock().get(peer).map(|r| r.queue)
    }
}

/// Streams kept open per replica and protocol after a successful call, for the next call
/// to it on that protocol.
type Pool =
    parking_lot::Mutex<std::collections::HashMap<(PeerId, Lane), Vec<(libp2p::Stream, Instant)>>>;

/// Idle streams kept per replica.
const POOL_CAP: usize = 64;

/// A kept stream idle longer than this is dropped rather than reused (the server gives up
/// on a quiet stream after 30 s).
const POOL_IDLE: Duration = Duration::from_secs(10);

/// Calls stages of one run.
///
/// A stream that carried a successful call is kept and reused for the next call to the
/// same replica: opening a stream costs a round trip of protocol negotiation, and
/// libp2p-stream negotiates one outbound stream per connection at a time, which capped a
/// trainer at about one call per round trip to each replica.
#[derive(Clone)]
pub struct StageClient {
    net: NetHandle,
    run: String,
    codec: CodecSpec,
    limits: Limits,
    timeout: Duration,
    device: Device,
    counters: Arc<ClientCounters>,
    pool: Arc<Pool>,
    sending: Arc<tokio::sync::Semaphore>,
    /// Forwards and backwards belong to synchronous steps ([`Call::Forward`]'s `sync`).
    sync: bool,
}

/// Requests a client writes at once. Its uplink is shared by every call in flight: with all
/// of them writing together, each crawls at a fraction of the link and none reaches its
/// replica early (over a slow link, not before the call times out); a few at a time go
/// out at full speed, one after another, and replicas start on them sooner.
const SENDING: usize = 4;

impl std::fmt::Debug for StageClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageClient")
            .field("run", &self.run)
            .field("codec", &self.codec)
            .finish()
    }
}

impl StageClient {
    /// A client for run `run`, sending tensors with `codec`.
    pub fn new(net: NetHandle, run: String, codec: CodecSpec) -> Self {
        Self {
            net,
            run,
            codec,
            limits: Limits::default(),
            timeout: Duration::from_secs(60),
            device: Device::Cpu,
            counters: Arc::new(ClientCounters::default()),
            pool: Arc::new(Pool::default()),
            sending: Arc::new(tokio::sync::Semaphore::new(SENDING)),
            sync: false,
        }
    }

    /// Marks this client's forwards and backwards as synchronous ([`Call::Forward`]'s `sync`): the
    /// `step` they carry is the step their microbatch belongs to (on stage 0's forward, the
    /// step it asks for at the earliest).
    pub fn with_sync(mut self, sync: bool) -> Self {
        self.sync = sync;
        self
    }

    /// A kept stream to `peer`, if one is fresh enough.
    fn pooled(&self, key: (PeerId, Lane)) -> Option<libp2p::Stream> {
        let mut pool = self.pool.lock();
        let idle = pool.get_mut(&key)?;
        while let Some((s, at)) = idle.pop() {
            if at.elapsed() < POOL_IDLE {
                return Some(s);
            }
        }
        None
    }

    fn keep(&self, key: (PeerId, Lane), stream: libp2p::Stream) {
        {
            let mut pool = self.pool.lock();
            let idle = pool.entry(key).or_default();
            idle.retain(|(_, at)| at.elapsed() < POOL_IDLE);
            if idle.len() < POOL_CAP {
                idle.push((stream, Instant::now()));
            }
        }
    }

    /// One exchange on a kept stream when there is one (a stale one, closed by the
    /// server, fails at once with an I/O error and, for a request that may arrive twice
    /// ([`may_resend`]), a fresh stream is used), else on a new stream; the stream is kept
    /// again when the call succeeded.
    async fn exchange_pooled(
        &self,
        peer: PeerId,
        req: &Request,
        frames: &[&[u8]],
    ) -> Result<(Response, Vec<Vec<u8>>), CallError> {
        let lane = Lane::of(req.op());
        let key = (peer, lane);
        if let Some(stream) = self.pooled(key) {
            let (r, back) = exchange_kept(stream, req, frames, &self.limits, &self.sending).await;
            if !matches!(r, Err(CallError::Io(_))) || !may_resend(req) {
                if let Some(b) = back {
                    self.keep(key, b);
                }
                return r;
            }
        }
        let stream = self.net.open_stream(peer, lane.protocol()).await?;
        let (r, back) = exchange_kept(stream, req, frames, &self.limits, &self.sending).await;
        if let Some(b) = back {
            self.keep(key, b);
        }
        r
    }

    /// Bytes moved by this client and its clones.
    pub fn counters(&self) -> &ClientCounters {
        &self.counters
    }

    fn count_raw(&self, tensors: &[&Tensor]) {
        let n: usize = tensors.iter().map(|t| 4 * t.elem_count()).sum();
        self.counters.raw.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// The network handle.
    pub fn net(&self) -> &NetHandle {
        &self.net
    }

    /// The run id.
    pub fn run(&self) -> &str {
        &self.run
    }

    /// This peer's id.
    pub fn local_peer_id(&self) -> PeerId {
        self.net.local_peer_id()
    }

    /// Sets the per-call timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the frame limits applied to requests and replies.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    fn request(&self, stage: usize, step: u64, call: Call, tensors: u8) -> Request {
        Request {
            v: MSG_VERSION,
            run: self.run.clone(),
            stage: stage as u32,
            step,
            tensors,
            call,
        }
    }

    /// A forward of microbatch `mb` (synchronous when the client is), its output pushed to
    /// `push_to` when given.
    fn forward_call(&self, mb: u64, dry: bool, push_to: Option<String>) -> Call {
        Call::Forward {
            mb,
            dry,
            push_to,
            pushed: false,
            sync: self.sync,
        }
    }

    /// A backward of microbatch `mb` (synchronous when the client is).
    fn backward_call(&self, mb: u64, dry: bool, pushed: bool) -> Call {
        Call::Backward {
            mb,
            dry,
            pushed,
            sync: self.sync,
        }
    }

    /// Sends a request with its frames; returns the success header and reply frames.
    pub async fn call(
        &self,
        peer: PeerId,
        req: &Request,
        frames: &[&[u8]],
    ) -> Result<(Response, Vec<Vec<u8>>), CallError> {
        for f in frames {
            netio::check_frame_len(f.len() as u64, &self.limits)?;
        }
        let work = self.exchange_pooled(peer, req, frames);
        let (header, reply) = tokio::time::timeout(self.timeout, work)
            .await
            .map_err(|_| CallError::Timeout(self.timeout))??;
        let sent: usize = frames.iter().map(|f| f.len()).sum();
        let got: usize = reply.iter().map(|f| f.len()).sum();
        self.counters.sent.fetch_add(sent as u64, Ordering::Relaxed);
        self.counters
            .received
            .fetch_add(got as u64, Ordering::Relaxed);
        self.counters.step.fetch_max(header.step, Ordering::Relaxed);
        self.counters
            .count_call(peer, header.queue, sent as u64, got as u64);
        if let Some(e) = header.error {
            return Err(CallError::Remote {
                kind: e.kind,
                message: e.message,
                step: header.step,
            });
        }
        Ok((header, reply))
    }

    /// Forward through `stage` on `peer`.
    pub async fn forward(
        &self,
        peer: PeerId,
        stage: usize,
        step: u64,
        mb: u64,
        input: &Tensor,
    ) -> Result<Tensor, CallError> {
        Ok(self.forward_step(peer, stage, step, mb, input).await?.0)
    }

    /// Forward, also returning the replica's step.
    pub async fn forward_step(
        &self,
        peer: PeerId,
        stage: usize,
        step: u64,
        mb: u64,
        input: &Tensor,
    ) -> Result<(Tensor, u64), CallError> {
        let req = self.request(stage, step, self.forward_call(mb, false, None), 1);
        self.forward_req(peer, &req, input).await
    }

    /// A probe's forward (`dry`): the replica keeps nothing, whatever its step.
    pub async fn probe_forward(
        &self,
        peer: PeerId,
        stage: usize,
        input: &Tensor,
    ) -> Result<Tensor, CallError> {
        let req = self.request(stage, 0, self.forward_call(0, true, None), 1);
        Ok(self.forward_req(peer, &req, input).await?.0)
    }

    async fn forward_req(
        &self,
        peer: PeerId,
        req: &Request,
        input: &Tensor,
    ) -> Result<(Tensor, u64), CallError> {
        let frame = tensor::encode(input, &self.codec)?;
        let (header, frames) = self.call(peer, req, &[frame.as_slice()]).await?;
        let f = frames
            .first()
            .ok_or_else(|| CallError::Protocol("forward reply has no tensor".into()))?;
        let out = finite_reply(tensor::decode(f, &self.limits, &self.device)?, "forward")?;
        self.count_raw(&[input, &out]);
        Ok((out, header.step))
    }

    /// Backward through `stage` on `peer`: `upstream` is the gradient of its output, or
    /// the targets on the last stage.
    pub async fn backward(
        &self,
        peer: PeerId,
        stage: usize,
        step: u64,
        mb: u64,
        input: &Tensor,
        upstream: &Tensor,
    ) -> Result<BackwardReply, CallError> {
        let req = self.request(stage, step, self.backward_call(mb, false, false), 2);
        self.backward_req(peer, &req, input, upstream).await
    }

    /// A probe's backward (`dry`): the loss and input gradient come back, the
    /// replica accumulates nothing (the run's training is untouched), whatever its step.
    pub async fn probe_backward(
        &self,
        peer: PeerId,
        stage: usize,
        input: &Tensor,
        upstream: &Tensor,
    ) -> Result<BackwardReply, CallError> {
        let req = self.request(stage, 0, self.backward_call(0, true, false), 2);
        self.backward_req(peer, &req, input, upstream).await
    }

    async fn backward_req(
        &self,
        peer: PeerId,
        req: &Request,
        input: &Tensor,
        upstream: &Tensor,
    ) -> Result<BackwardReply, CallError> {
        let frames = [
            tensor::encode(input, &self.codec)?,
            tensor::encode(upstream, &self.codec)?,
        ];
        let (header, frames) = self
            .call(peer, req, &[frames[0].as_slice(), frames[1].as_slice()])
            .await?;
        self.count_raw(&[input, upstream]);
        let grad_input = self.reply_tensor(&frames, "backward")?;
        Ok(BackwardReply {
            loss: header.loss,
            grad_input,
            step: header.step,
        })
    }

    /// Sends an averaging message (with at most one frame) to a replica of `stage`.
    pub async fn send_avg(
        &self,
        peer: PeerId,
        stage: usize,
        msg: AvgMsg,
        frame: Option<&[u8]>,
    ) -> Result<(), CallError> {
        let frames: Vec<&[u8]> = frame.into_iter().collect();
        let req = self.request(stage, 0, Call::Avg { avg: msg }, frames.len() as u8);
        self.call(peer, &req, &frames).await.map(|_| ())
    }

    /// Asks a replica for a snapshot of its state.
    pub async fn state_info(&self, peer: PeerId, stage: usize) -> Result<StateInfo, CallError> {
        let req = self.request(stage, 0, Call::StateInfo {}, 0);
        let (header, _) = self.call(peer, &req, &[]).await?;
        header
            .state
            .ok_or_else(|| CallError::Protocol("state_info reply without a state".into()))
    }

    /// Fetches one chunk of a snapshot, as raw f32 values.
    pub async fn state_chunk(
        &self,
        peer: PeerId,
        stage: usize,
        step: u64,
        index: u32,
    ) -> Result<Vec<f32>, CallError> {
        let chunk = ChunkReq { step, index };
        let req = self.request(stage, 0, Call::StateChunk { chunk }, 0);
        let (_, frames) = self.call(peer, &req, &[]).await?;
        let f = frames
            .first()
            .ok_or_else(|| CallError::Protocol("state_chunk reply without a frame".into()))?;
        match crate::wire::decode(f, &self.limits)?.data {
            crate::wire::TensorData::F32(v) => Ok(v),
            crate::wire::TensorData::U32(_) => {
                Err(CallError::Protocol("state chunk is not f32".into()))
            }
        }
    }

    /// Fetches page `page` of the chunk hashes of a snapshot.
    pub async fn state_hashes(
        &self,
        peer: PeerId,
        stage: usize,
        step: u64,
        page: u32,
    ) -> Result<Vec<String>, CallError> {
        let chunk = ChunkReq { step, index: page };
        let req = self.request(stage, 0, Call::StateHashes { chunk }, 0);
        let (header, _) = self.call(peer, &req, &[]).await?;
        header
            .hashes
            .ok_or_else(|| CallError::Protocol("state_hashes reply without hashes".into()))
    }

    /// Chunk `index` of the averaged update the replica applied at step `step`, and the
    /// update's description.
    pub async fn state_update(
        &self,
        peer: PeerId,
        stage: usize,
        step: u64,
        index: u32,
    ) -> Result<(crate::wire::msg::UpdateInfo, Vec<u8>), CallError> {
        let chunk = ChunkReq { step, index };
        let req = self.request(stage, 0, Call::StateUpdate { chunk }, 0);
        let (header, frames) = self.call(peer, &req, &[]).await?;
        match (header.update, frames.into_iter().next()) {
            (Some(u), Some(f)) => Ok((u, f)),
            _ => Err(CallError::Protocol(
                "state_update reply without an update or its chunk".into(),
            )),
        }
    }

    /// The replica's own announcement, as JSON.
    pub async fn info(&self, peer: PeerId, stage: usize) -> Result<Response, CallError> {
        let req = self.request(stage, 0, Call::Info {}, 0);
        Ok(self.call(peer, &req, &[]).await?.0)
    }
}

impl StageClient {
    /// The tensor a reply may carry (its first frame), decoded, refused when not finite,
    /// and counted.
    fn reply_tensor(&self, frames: &[Vec<u8>], what: &str) -> Result<Option<Tensor>, CallError> {
        let Some(f) = frames.first() else {
            return Ok(None);
        };
        let t = finite_reply(tensor::decode(f, &self.limits, &self.device)?, what)?;
        self.count_raw(&[&t]);
        Ok(Some(t))
    }
}

/// A reply's tensor, refused when it holds NaN or ±inf: a replica that answers with those
/// is broken or hostile, and its answer would poison everything downstream.
fn finite_reply(d: tensor::Decoded, what: &str) -> Result<Tensor, CallError> {
    if d.finite {
        Ok(d.tensor)
    } else {
        Err(CallError::Protocol(format!(
            "{what} reply holds NaN or infinite values"
        )))
    }
}

mod push;
pub mod retry;
