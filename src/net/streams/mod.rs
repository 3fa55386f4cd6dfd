//! Our own stream protocols over libp2p: a [`Behaviour`] and its per-connection
//! [`handler::Handler`] (rust-libp2p's behaviour/handler split), in place of libp2p-stream.
//!
//! What it does that libp2p-stream 0.5 did not: an inbound stream is never dropped for
//! arriving while the server is busy. Each protocol accepted here has a *lane*: a bounded
//! queue of negotiated streams waiting for the server's accept loop, at most
//! [`Lane::per_connection`] of them from one connection. A stream over either bound is
//! handed to the lane's overflow answer (for the stage protocol: a typed `overloaded`
//! response), which its connection drives; only a lane with no overflow answer, or a
//! connection with [`MAX_ANSWERING`] overflow answers already in progress, drops one, and
//! that is counted ([`StreamCounts::dropped`]). Outbound streams are negotiated
//! concurrently, any number per connection (libp2p-stream negotiated one at a time).

mod behaviour;
pub mod handler;

pub use behaviour::Behaviour;

use futures::channel::oneshot;
use futures::future::BoxFuture;
use libp2p::swarm::ConnectionId;
use libp2p::{PeerId, Stream, StreamProtocol};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::mpsc;

/// Overflow answers one connection drives at once; a stream beyond them is dropped.
pub const MAX_ANSWERING: usize = 256;

/// Outbound streams asked of one connection and not yet taken by its handler (which takes
/// each at once); an opener waits for room.
const OPENS_QUEUED: usize = 256;

/// Peers being dialled for opens at once; an open that needs one more fails.
const DIALS: usize = 1024;

/// Answers a stream the server has no room for (e.g. writes a typed `overloaded` response
/// and closes it), instead of resetting it.
pub type Overflow = Arc<dyn Fn(PeerId, Stream) -> BoxFuture<'static, ()> + Send + Sync>;

/// How a protocol's inbound streams wait for the server.
#[derive(Clone)]
pub struct Lane {
    /// Streams waiting for the accept loop, from every connection together.
    pub capacity: usize,
    /// Of those, at most this many from one connection (one peer cannot fill the lane).
    pub per_connection: usize,
    /// Answers a stream over either bound; without one such a stream is dropped.
    pub overflow: Option<Overflow>,
}

impl Default for Lane {
    fn default() -> Self {
        Self {
            capacity: 256,
            per_connection: 128,
            overflow: None,
        }
    }
}

/// What happened to a protocol's inbound streams since it was accepted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct StreamCounts {
    /// Handed to the server's accept loop.
    pub accepted: u64,
    /// Answered by the lane's overflow answer.
    pub overflowed: u64,
    /// Dropped unanswered (no overflow answer, or too many in progress).
    pub dropped: u64,
}

#[derive(Default)]
struct Counters {
    accepted: AtomicU64,
    overflowed: AtomicU64,
    dropped: AtomicU64,
}

impl Counters {
    fn read(&self) -> StreamCounts {
        StreamCounts {
            accepted: self.accepted.load(Ordering::Relaxed),
            overflowed: self.overflowed.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
        }
    }
}

/// One stream waiting in a lane; holds its connection's place until it is taken.
struct Waiting {
    peer: PeerId,
    stream: Stream,
    _place: Place,
}

/// A connection's place in a lane; given back when the stream leaves the lane.
struct Place(Arc<AtomicUsize>);

impl Drop for Place {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

struct LaneState {
    tx: mpsc::Sender<Waiting>,
    lane: Lane,
    counters: Arc<Counters>,
}

/// A request for an outbound stream, answered on its own channel.
pub struct Open {
    protocol: StreamProtocol,
    reply: oneshot::Sender<Result<Stream, OpenError>>,
}

/// Why an outbound stream could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The remote does not speak the protocol.
    #[error("the peer does not speak {0}")]
    Unsupported(StreamProtocol),
    /// Negotiation failed or timed out, or the connection closed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// No connection to the peer could be made.
    #[error("cannot connect: {0}")]
    Dial(String),
}

/// What the behaviour, its handlers and every [`Control`] share.
struct Shared {
    lanes: HashMap<StreamProtocol, LaneState>,
    /// Counters of every protocol ever accepted (kept after its lane closes).
    counters: HashMap<StreamProtocol, Arc<Counters>>,
    /// Each connection's peer and the channel to its handler.
    connections: HashMap<ConnectionId, (PeerId, mpsc::Sender<Open>)>,
    /// Opens waiting for a connection to their peer (being dialled).
    pending: HashMap<PeerId, Vec<Open>>,
    /// Peers to dial, taken by the behaviour's poll (one entry per peer being dialled).
    dial: mpsc::Sender<PeerId>,
}

/// What to do with an inbound stream a handler negotiated.
pub(crate) enum Inbound {
    /// Queued for the server.
    Queued,
    /// To be answered by the lane's overflow answer.
    Answer(BoxFuture<'static, ()>),
    /// Dropped (counted).
    Dropped,
}

impl Shared {
    fn protocols(&mut self) -> Vec<StreamProtocol> {
        self.lanes.retain(|_, l| !l.tx.is_closed());
        self.lanes.keys().cloned().collect()
    }

    /// Places a negotiated inbound stream of `protocol` from `peer`'s connection, which has
    /// `queued` streams waiting in lanes now.
    fn inbound(
        &mut self,
        peer: PeerId,
        queued: &Arc<AtomicUsize>,
        stream: Stream,
        protocol: &StreamProtocol,
        answering: usize,
    ) -> Inbound {
        let Some(l) = self.lanes.get(protocol) else {
            tracing::debug!(%protocol, %peer, "inbound stream for a protocol no longer served");
            return Inbound::Dropped;
        };
        let over = |l: &LaneState, stream: Stream| match &l.overflow_answer(answering) {
            Some(f) => {
                l.counters.overflowed.fetch_add(1, Ordering::Relaxed);
                Inbound::Answer(f(peer, stream))
            }
            None => {
                l.counters.dropped.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%protocol, %peer, "inbound stream dropped: lane full");
                Inbound::Dropped
            }
        };
        if queued.load(Ordering::Relaxed) >= l.lane.per_connection {
            return over(l, stream);
        }
        queued.fetch_add(1, Ordering::Relaxed);
        let w = Waiting {
            peer,
            stream,
            _place: Place(Arc::clone(queued)),
        };
        match l.tx.try_send(w) {
            Ok(()) => {
                l.counters.accepted.fetch_add(1, Ordering::Relaxed);
                Inbound::Queued
            }
            Err(mpsc::error::TrySendError::Full(w)) => over(l, w.stream),
            Err(mpsc::error::TrySendError::Closed(_)) => {
                l.counters.dropped.fetch_add(1, Ordering::Relaxed);
                self.lanes.remove(protocol);
                Inbound::Dropped
            }
        }
    }

    /// A channel to a live connection to `peer`; else `open` waits in `pending` while
    /// the peer is dialled, or, when no dial can be asked for, is dropped (its opener
    /// then fails).
    fn route(&mut self, peer: PeerId, open: Open) -> Route {
        if let Some((_, tx)) = self
            .connections
            .values()
            .find(|(p, tx)| *p == peer && !tx.is_closed())
        {
            return Route::Connection(tx.clone(), open);
        }
        let waiting = self.pending.entry(peer).or_default();
        if waiting.is_empty() {
            if let Err(e) = self.dial.try_send(peer) {
                tracing::debug!(%peer, "cannot ask for a dial: {e}");
                return Route::Failed;
            }
        }
        waiting.push(open);
        Route::Dialling
    }
}

/// Where an open goes.
enum Route {
    /// To this connection's handler.
    Connection(mpsc::Sender<Open>, Open),
    /// It waits for the dial.
    Dialling,
    /// Too many dials in progress.
    Failed,
}

impl LaneState {
    fn overflow_answer(&self, answering: usize) -> Option<Overflow> {
        self.lane
            .overflow
            .clone()
            .filter(|_| answering < MAX_ANSWERING)
    }
}

/// Opens streams and accepts protocols; cheap to clone.
#[derive(Clone)]
pub struct Control {
    shared: Arc<Mutex<Shared>>,
}

impl Control {
    /// Opens a stream of `protocol` to `peer`, dialling it if there is no connection.
    /// Any number may be negotiating at once.
    pub async fn open_stream(
        &self,
        peer: PeerId,
        protocol: StreamProtocol,
    ) -> Result<Stream, OpenError> {
        let (reply, rx) = oneshot::channel();
        let mut open = Open { protocol, reply };
        loop {
            let route = self.shared.lock().route(peer, open);
            match route {
                Route::Connection(tx, o) => match tx.send(o).await {
                    Ok(()) => break,
                    // The connection closed meanwhile: route again.
                    Err(mpsc::error::SendError(o)) => open = o,
                },
                Route::Dialling => break,
                Route::Failed => {
                    return Err(OpenError::Dial("too many dials in progress".into()));
                }
            }
        }
        rx.await.map_err(|_| {
            OpenError::Io(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "the connection closed before the stream was opened",
            ))
        })?
    }

    /// Accepts inbound streams of `protocol` through `lane`, until the returned
    /// [`Incoming`] is dropped. Fails if the protocol is accepted already.
    pub fn accept(&self, protocol: StreamProtocol, lane: Lane) -> Result<Incoming, String> {
        let mut s = self.shared.lock();
        s.lanes.retain(|_, l| !l.tx.is_closed());
        if s.lanes.contains_key(&protocol) {
            return Err(format!("{protocol} is accepted already"));
        }
        let (tx, rx) = mpsc::channel(lane.capacity.max(1));
        let counters = Arc::clone(s.counters.entry(protocol.clone()).or_default());
        s.lanes.insert(protocol, LaneState { tx, lane, counters });
        Ok(Incoming { rx })
    }

    /// What happened to `protocol`'s inbound streams so far.
    pub fn counts(&self, protocol: &StreamProtocol) -> StreamCounts {
        self.shared
            .lock()
            .counters
            .get(protocol)
            .map(|c| c.read())
            .unwrap_or_default()
    }
}

/// A protocol's inbound streams, with the peer each came from.
#[must_use = "streams wait in their lane until taken"]
pub struct Incoming {
    rx: mpsc::Receiver<Waiting>,
}

impl futures::Stream for Incoming {
    type Item = (PeerId, Stream);

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx).map(|w| w.map(|w| (w.peer, w.stream)))
    }
}
