//! One inbound stream of a replica protocol (stage, averaging or state; each op on its own): read each request under a timeout, its header
//! checked (run, stage, step, tensor count) before any frame is read and each frame's header
//! checked (dtype, shape, the run's limits) before its payload is read; hand it to the
//! compute queue or the registered [`Extension`](super::Extension); write the answer.

use super::budget::Held;
use super::{push, worker, Refusal, Reply, Shared, MAX_CALLER_LAG};
use crate::net::io::{self as netio, IoError};
use crate::stage::{sync, Lane};
use crate::wire::msg::{self, ErrorKind, Op, Request, Response};
use crate::wire::WireError;
use futures::{AsyncReadExt, AsyncWriteExt};
use libp2p::PeerId;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A request read whole (with the bytes it holds of its caller's budget), or refused
/// after its header or a frame's header (the rest unread).
enum Read {
    Whole(Request, Vec<Vec<u8>>, Held),
    Refused(Reply),
}

/// Reads a request: its header, which is checked (run, stage, step, tensor count) before
/// any frame is read; then each frame, whose header is checked against what the request
/// kind carries in this run before its payload is read.
async fn read_request(
    shared: &Arc<Shared>,
    (lane, peer): (Lane, PeerId),
    stream: &mut libp2p::Stream,
    len: [u8; 4],
) -> Result<Read, IoError> {
    let head = netio::read_header_after(stream, len).await?;
    let req = msg::decode_request(&head)?;
    if Lane::of(req.op()) != lane {
        return Ok(Read::Refused(refusal(
            shared,
            ErrorKind::BadRequest,
            format!(
                "{:?} goes on {}, not {}",
                req.op(),
                Lane::of(req.op()).protocol(),
                lane.protocol()
            ),
        )));
    }
    if let Some(r) = check(shared, &req) {
        return Ok(Read::Refused(r));
    }
    // A call that would find the queue full is refused before its tensors are read: the
    // caller sends them elsewhere, so reading them here only spent its link. (A
    // synchronous call may wait for its step first, and the queue may have room by then.)
    if let Some(job) = req.call.job() {
        if !job.sync && !shared.jobs.has_room(super::jobs::Lane::of(req.op())) {
            return Ok(Read::Refused(refusal(
                shared,
                ErrorKind::Overloaded,
                "request queue is full",
            )));
        }
    }
    let wants = shared.expect.wants_of(&req);
    let mut frames = Vec::with_capacity(req.tensors as usize);
    let mut held = Held::new(shared, peer);
    for i in 0..req.tensors as usize {
        let want = wants.get(i).copied();
        let mut over = false;
        let frame = netio::read_frame_checked(stream, &shared.cfg.limits, |h| {
            match want {
                Some(w) => shared.expect.check(w, h)?,
                None => return Err(format!("{:?} carries no tensor {i}", req.op())),
            }
            if !held.take(h.frame_len()) {
                over = true;
                return Err("over the caller's byte budget".into());
            }
            Ok(())
        })
        .await;
        let frame = match frame {
            Err(_) if over => {
                return Ok(Read::Refused(refusal(
                    shared,
                    ErrorKind::Overloaded,
                    format!(
                        "your requests already hold {} MB here; wait for their answers",
                        shared.peer_budget / 1_000_000
                    ),
                )))
            }
            f => f?,
        };
        frames.push(frame);
    }
    Ok(Read::Whole(req, frames, held))
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

pub(super) fn refusal(shared: &Shared, kind: ErrorKind, message: impl Into<String>) -> Reply {
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

pub(super) fn ok(shared: &Shared, tensors: u8) -> Response {
    Response::ok(shared.step(), shared.queue.load(Ordering::Relaxed), tensors)
}

/// Streams one caller may hold open at once; more are closed unread. (A replica sends up
/// to 32 averaging calls at once, and clients keep idle streams for reuse.)
pub const MAX_STREAMS_PER_PEER: usize = 128;

/// Counts a caller's open stream while it lives.
struct Open<'a> {
    shared: &'a Shared,
    peer: PeerId,
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        let mut m = self.shared.streams.lock();
        if let Some(n) = m.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.peer);
            }
        }
    }
}

/// Refusals that say the caller sent something invalid (not that this replica is busy,
/// behind or of another stage): each is a strike, and repeated strikes ban the caller.
fn is_invalid(kind: ErrorKind) -> bool {
    matches!(
        kind,
        ErrorKind::BadTensor
            | ErrorKind::NonFinite
            | ErrorKind::BadRequest
            | ErrorKind::TooLarge
            | ErrorKind::UnknownRun
    )
}

/// Notes a refusal of `kind` sent to `peer`.
fn note_refusal(shared: &Shared, peer: PeerId, kind: ErrorKind, why: &str) {
    if is_invalid(kind) {
        let seq = shared.strikes.fetch_add(1, Ordering::Relaxed);
        shared
            .bans
            .lock()
            .strike(peer, (seq, 0), why, Instant::now());
    }
}

/// A replica protocol's lane in the network layer: streams wait there for the accept loop
/// (which takes each at once); one the lane has no room for is answered `overloaded`,
/// unread, by the connection that negotiated it, never dropped.
pub(super) fn lane(shared: &Arc<Shared>) -> crate::net::streams::Lane {
    let weak = Arc::downgrade(shared);
    let cap = shared.cfg.max_readers + shared.cfg.queue_cap;
    crate::net::streams::Lane {
        capacity: 4 * cap,
        per_connection: MAX_STREAMS_PER_PEER,
        overflow: Some(Arc::new(move |_peer, mut stream| {
            let weak = weak.clone();
            Box::pin(async move {
                let Some(shared) = weak.upgrade() else {
                    return;
                };
                let r = refusal(&shared, ErrorKind::Overloaded, "too many calls at once");
                drop(shared);
                respond(&mut stream, &r).await;
            })
        })),
    }
}

/// Serves the requests of one stream, one after another, until the caller closes it,
/// goes quiet for [`IDLE_STREAM`], or a request is refused. A caller over
/// [`MAX_STREAMS_PER_PEER`] streams gets `overloaded`; a banned caller gets `banned`.
pub(super) async fn handle(
    shared: Arc<Shared>,
    lane: Lane,
    peer: PeerId,
    mut stream: libp2p::Stream,
) {
    let over = {
        let mut m = shared.streams.lock();
        let n = m.entry(peer).or_default();
        *n += 1;
        *n > MAX_STREAMS_PER_PEER
    };
    let _open = Open {
        shared: &shared,
        peer,
    };
    if over {
        let r = refusal(
            &shared,
            ErrorKind::Overloaded,
            format!("you hold {MAX_STREAMS_PER_PEER} streams here already; wait for their answers"),
        );
        respond(&mut stream, &r).await;
        return;
    }
    loop {
        let mut len = [0u8; 4];
        match tokio::time::timeout(IDLE_STREAM, stream.read_exact(&mut len)).await {
            Ok(Ok(())) => {}
            _ => return,
        }
        if !serve_one(&shared, (lane, peer), &mut stream, len).await {
            return;
        }
    }
}

/// Serves one request whose length prefix `len` was read; whether the stream may carry
/// another.
async fn serve_one(
    shared: &Arc<Shared>,
    (lane, peer): (Lane, PeerId),
    stream: &mut libp2p::Stream,
    len: [u8; 4],
) -> bool {
    let Some((req, frames, held, read_us)) = admit(shared, (lane, peer), stream, len).await else {
        return false;
    };
    let op = req.op();
    let in_bytes: u64 = frames.iter().map(|f| f.len() as u64).sum();
    let draining = shared.draining.load(Ordering::Relaxed);
    if draining && matches!(op, Op::Info | Op::Forward | Op::Backward) {
        let r = refusal(
            shared,
            ErrorKind::Overloaded,
            "this replica is leaving its stage; use another",
        );
        respond(stream, &r).await;
        return false;
    }
    // What the request holds of the caller's byte budget stays held until it is answered
    // (a pushed input takes it along).
    let mut held = Some(held);
    let reply = answer(shared, peer, req, frames, &mut held).await;
    let out_bytes: u64 = reply.frames.iter().map(|f| f.len() as u64).sum();
    let c = &shared.counters;
    match op {
        Op::Forward | Op::Backward | Op::Push => {
            c.read_us.fetch_add(read_us, Ordering::Relaxed);
            c.stage_in.fetch_add(in_bytes, Ordering::Relaxed);
            c.stage_out.fetch_add(out_bytes, Ordering::Relaxed);
        }
        Op::Avg => {
            c.avg_in.fetch_add(in_bytes, Ordering::Relaxed);
        }
        Op::StateChunk | Op::StateUpdate => {
            c.state_out.fetch_add(out_bytes, Ordering::Relaxed);
        }
        Op::Info | Op::StateInfo | Op::StateHashes => {}
    }
    if let Some(e) = &reply.header.error {
        note_refusal(shared, peer, e.kind, &e.message);
    }
    let t_write = Instant::now();
    let more = respond(stream, &reply).await;
    c.write_us
        .fetch_add(t_write.elapsed().as_micros() as u64, Ordering::Relaxed);
    more
}

/// Reads the request whose length prefix `len` was read, once a reader's permit is free:
/// the request, its frames, what it holds of the caller's byte budget, and the
/// microseconds its reading took. `None` when it was refused (answered here) or could not
/// be read; the stream then carries nothing more.
async fn admit(
    shared: &Arc<Shared>,
    (lane, peer): (Lane, PeerId),
    stream: &mut libp2p::Stream,
    len: [u8; 4],
) -> Option<(Request, Vec<Vec<u8>>, Held, u64)> {
    if shared.bans.lock().is_banned(&peer, Instant::now()) {
        let r = refusal(
            shared,
            ErrorKind::Banned,
            "refused for a while: your requests failed validation repeatedly",
        );
        respond(stream, &r).await;
        return None;
    }
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
        return None;
    };
    let t_read = Instant::now();
    let read = tokio::time::timeout(
        shared.cfg.read_timeout,
        read_request(shared, (lane, peer), stream, len),
    )
    .await;
    let read_us = t_read.elapsed().as_micros() as u64;
    // The permit bounds requests being read; once read, a call waits in the queue, whose
    // own cap bounds it.
    drop(permit);
    match read {
        Err(_) => {
            shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
            None
        }
        Ok(Err(IoError::Io(_))) => {
            // Truncated or reset: there is nobody sensible to answer.
            shared.counters.dropped.fetch_add(1, Ordering::Relaxed);
            let _ = stream.close().await;
            None
        }
        Ok(Err(e)) => {
            let kind = match e {
                IoError::FrameTooLarge { .. }
                | IoError::Frame(WireError::TooLarge { .. } | WireError::TooManyElements { .. }) => {
                    ErrorKind::TooLarge
                }
                IoError::Frame(_) | IoError::Unexpected(_) => ErrorKind::BadTensor,
                _ => ErrorKind::BadRequest,
            };
            note_refusal(shared, peer, kind, &e.to_string());
            let r = refusal(shared, kind, e.to_string());
            respond(stream, &r).await;
            None
        }
        Ok(Ok(Read::Refused(r))) => {
            if let Some(e) = &r.header.error {
                note_refusal(shared, peer, e.kind, &e.message);
            }
            respond(stream, &r).await;
            None
        }
        Ok(Ok(Read::Whole(req, frames, held))) => Some((req, frames, held, read_us)),
    }
}

/// The answer to a request read whole from `peer`; a pushed input takes `held` along.
async fn answer(
    shared: &Arc<Shared>,
    peer: PeerId,
    req: Request,
    frames: Vec<Vec<u8>>,
    held: &mut Option<Held>,
) -> Reply {
    match req.op() {
        Op::Info => {
            let mut header = ok(shared, 0);
            header.info = shared.info.lock().clone();
            if header.info.is_some() {
                header.mates = super::mates::hints(shared, peer).await;
            }
            shared.counters.served.fetch_add(1, Ordering::Relaxed);
            Reply {
                header,
                frames: Vec::new(),
            }
        }
        Op::Avg | Op::StateInfo | Op::StateChunk | Op::StateHashes | Op::StateUpdate => {
            extension(shared, peer, req, frames).await
        }
        Op::Push if !accepts_push_from(shared, peer).await => refusal(
            shared,
            ErrorKind::BadRequest,
            match shared.stage {
                0 => "stage 0 takes no pushed inputs".to_string(),
                s => format!(
                    "pushes are taken only from announced replicas of stage {}",
                    s - 1
                ),
            },
        ),
        Op::Push => match frames.into_iter().next() {
            Some(f) => {
                // Its bytes stay charged to the pusher while the input waits here.
                shared
                    .inbox
                    .put(req.call.mb(), req.step, f, Box::new(held.take()));
                shared.counters.served.fetch_add(1, Ordering::Relaxed);
                Reply {
                    header: ok(shared, 0),
                    frames: Vec::new(),
                }
            }
            None => refusal(shared, ErrorKind::BadRequest, "a push carries the input"),
        },
        Op::Forward | Op::Backward => compute(shared, req, frames).await,
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
    let (op, job) = (req.op(), req.job());
    if matches!(op, Op::Forward | Op::Backward)
        && !job.dry
        && req.step.saturating_add(MAX_CALLER_LAG) < step
    {
        // A synchronous microbatch's step (assigned by stage 0: not a first forward there,
        // nor a pushed call, whose step comes with its input) closed long ago here: its
        // trainer starts it again in the step open now (a stale-step refusal would only
        // send it to the other replicas, which are past it too, until it failed).
        let assigned = !job.pushed && (shared.stage != 0 || op == Op::Backward);
        if job.sync && assigned {
            return Some(refusal(
                shared,
                ErrorKind::StepClosed,
                sync::closed_message(req.step, step, step),
            ));
        }
        return Some(refusal(
            shared,
            ErrorKind::StaleStep,
            format!("caller is at step {}, this replica at {step}", req.step),
        ));
    }
    let base = match op {
        Op::Forward | Op::Avg => req.tensors.min(1).max(u8::from(op == Op::Forward)),
        Op::Backward => 2,
        Op::Push => 1,
        Op::Info | Op::StateInfo | Op::StateChunk | Op::StateHashes | Op::StateUpdate => 0,
    };
    let want = push::frames_of(op, base, job.pushed);
    if let Some(to) = req.call.push_to() {
        if job.dry || to.parse::<PeerId>().is_err() {
            return Some(refusal(
                shared,
                ErrorKind::BadRequest,
                "push_to takes a forward and a peer id",
            ));
        }
    }
    if req.tensors != want {
        return Some(refusal(
            shared,
            ErrorKind::BadRequest,
            format!("{op:?} takes {want} tensors, got {}", req.tensors),
        ));
    }
    None
}

/// Whether `peer` may push inputs here: an announced replica of the stage before.
async fn accepts_push_from(shared: &Shared, peer: PeerId) -> bool {
    match shared.stage.checked_sub(1) {
        Some(before) => shared.neighbours.serves(peer, before as usize).await,
        None => false,
    }
}

/// A forward or backward: its pushed input awaited when it has one, computed, and its
/// output pushed on when asked (the answer keeps the output only if the push failed, so
/// the caller can send it on itself).
async fn compute(shared: &Arc<Shared>, mut req: Request, mut frames: Vec<Vec<u8>>) -> Reply {
    let job = req.job();
    if job.pushed {
        match shared.inbox.take(job.mb, push::WAIT).await {
            Some((f, step)) => {
                frames.insert(0, f);
                // A synchronous microbatch's step is the one the stage before computed it
                // at (assigned on stage 0 after the caller sent this request).
                if job.sync {
                    req.step = step;
                }
            }
            None => {
                return refusal(
                    shared,
                    ErrorKind::Overloaded,
                    "the input pushed for this microbatch did not arrive; send it",
                )
            }
        }
    }
    // A synchronous forward waits for its step; so does a backward past stage 0 (the last
    // stage's, which runs the forward too, may come before that stage applied the step).
    let held = match req.op() {
        Op::Forward => true,
        Op::Backward => shared.stage != 0,
        _ => false,
    };
    if job.sync && !job.dry && held {
        if let Err(r) = super::hold::hold_for_step(shared, &mut req, &frames).await {
            return r;
        }
    }
    let to = req.call.push_to().and_then(|t| t.parse::<PeerId>().ok());
    let (stage, step, mb) = (req.stage, req.step, job.mb);
    let mut reply = worker::queue_job(shared, req, frames).await;
    let Some(to) = to else {
        return reply;
    };
    if reply.header.error.is_some() {
        return reply;
    }
    if let Some(f) = reply.frames.first() {
        let next = stage as usize + 1;
        // Only to an announced replica of the next stage (the caller names it): otherwise
        // the output goes back in the answer.
        if !shared.neighbours.serves(to, next).await {
            tracing::debug!(%to, "not pushing microbatch {mb}: not an announced replica of stage {next}");
            return reply;
        }
        match shared.pusher.push(to, next, step, mb, f).await {
            Ok(()) => {
                reply.frames.clear();
                reply.header.tensors = 0;
            }
            Err(e) => tracing::debug!(%to, "push of microbatch {mb} failed: {e}"),
        }
    }
    reply
}

/// Hands a call to the registered extension (the averaging layer).
async fn extension(shared: &Shared, peer: PeerId, req: Request, frames: Vec<Vec<u8>>) -> Reply {
    let ext = shared.extension.lock().clone();
    let Some(ext) = ext else {
        return refusal(
            shared,
            ErrorKind::Overloaded,
            "this replica is not averaging yet",
        );
    };
    match ext.call(peer, req, frames).await {
        Ok(answer) => {
            shared.counters.served.fetch_add(1, Ordering::Relaxed);
            let mut header = ok(shared, answer.frames.len() as u8);
            header.state = answer.state;
            header.hashes = answer.hashes;
            header.update = answer.update;
            Reply {
                header,
                frames: answer.frames,
            }
        }
        Err(Refusal { kind, message }) => refusal(shared, kind, message),
    }
}
