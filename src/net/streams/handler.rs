//! One connection's side of [`super::Behaviour`]: offers the accepted protocols to inbound
//! streams and places each negotiated one in its lane (or answers it with the lane's
//! overflow answer, which this handler drives); negotiates every outbound stream asked for
//! at once, each answered on its own channel.

use super::{Inbound, Open, OpenError, Shared};
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use libp2p::core::{InboundUpgrade, OutboundUpgrade, UpgradeInfo};
use libp2p::swarm::handler::{
    ConnectionEvent, DialUpgradeError, FullyNegotiatedInbound, FullyNegotiatedOutbound,
};
use libp2p::swarm::{
    ConnectionHandler, ConnectionHandlerEvent, StreamUpgradeError, SubstreamProtocol,
};
use libp2p::{PeerId, Stream, StreamProtocol};
use parking_lot::Mutex;
use std::convert::Infallible;
use std::future::{ready, Ready};
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::task::{Context, Poll};

/// Negotiates one of a list of protocols; the stream comes out as it is.
pub struct Upgrade(Vec<StreamProtocol>);

impl UpgradeInfo for Upgrade {
    type Info = StreamProtocol;
    type InfoIter = std::vec::IntoIter<StreamProtocol>;

    fn protocol_info(&self) -> Self::InfoIter {
        self.0.clone().into_iter()
    }
}

impl InboundUpgrade<Stream> for Upgrade {
    type Output = (Stream, StreamProtocol);
    type Error = Infallible;
    type Future = Ready<Result<Self::Output, Self::Error>>;

    fn upgrade_inbound(self, socket: Stream, info: StreamProtocol) -> Self::Future {
        ready(Ok((socket, info)))
    }
}

impl OutboundUpgrade<Stream> for Upgrade {
    type Output = (Stream, StreamProtocol);
    type Error = Infallible;
    type Future = Ready<Result<Self::Output, Self::Error>>;

    fn upgrade_outbound(self, socket: Stream, info: StreamProtocol) -> Self::Future {
        ready(Ok((socket, info)))
    }
}

/// One connection's stream handling.
pub struct Handler {
    peer: PeerId,
    shared: Arc<Mutex<Shared>>,
    opens: tokio::sync::mpsc::Receiver<Open>,
    /// Opens that waited for this connection while its peer was dialled.
    waiting: Vec<Open>,
    /// This connection's streams waiting in lanes.
    queued: Arc<AtomicUsize>,
    /// Overflow answers in progress.
    answering: FuturesUnordered<BoxFuture<'static, ()>>,
}

impl Handler {
    pub(super) fn new(
        peer: PeerId,
        shared: Arc<Mutex<Shared>>,
        opens: tokio::sync::mpsc::Receiver<Open>,
        waiting: Vec<Open>,
    ) -> Self {
        Self {
            peer,
            shared,
            opens,
            waiting,
            queued: Arc::new(AtomicUsize::new(0)),
            answering: FuturesUnordered::new(),
        }
    }
}

impl ConnectionHandler for Handler {
    type FromBehaviour = Infallible;
    type ToBehaviour = Infallible;
    type InboundProtocol = Upgrade;
    type OutboundProtocol = Upgrade;
    type InboundOpenInfo = ();
    type OutboundOpenInfo = Open;

    fn listen_protocol(&self) -> SubstreamProtocol<Upgrade, ()> {
        SubstreamProtocol::new(Upgrade(self.shared.lock().protocols()), ())
    }

    fn poll(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<ConnectionHandlerEvent<Upgrade, Open, Infallible>> {
        while let Poll::Ready(Some(())) = self.answering.poll_next_unpin(cx) {}
        let next = match self.waiting.pop() {
            Some(o) => Poll::Ready(Some(o)),
            None => self.opens.poll_recv(cx),
        };
        match next {
            Poll::Ready(Some(open)) => {
                Poll::Ready(ConnectionHandlerEvent::OutboundSubstreamRequest {
                    protocol: SubstreamProtocol::new(Upgrade(vec![open.protocol.clone()]), open),
                })
            }
            _ => Poll::Pending,
        }
    }

    fn on_behaviour_event(&mut self, event: Infallible) {
        match event {}
    }

    fn on_connection_event(&mut self, event: ConnectionEvent<Upgrade, Upgrade, (), Open>) {
        match event {
            ConnectionEvent::FullyNegotiatedInbound(FullyNegotiatedInbound {
                protocol: (stream, protocol),
                ..
            }) => {
                let placed = self.shared.lock().inbound(
                    self.peer,
                    &self.queued,
                    stream,
                    &protocol,
                    self.answering.len(),
                );
                if let Inbound::Answer(f) = placed {
                    self.answering.push(f);
                }
            }
            ConnectionEvent::FullyNegotiatedOutbound(FullyNegotiatedOutbound {
                protocol: (stream, _),
                info: open,
            }) => {
                let _ = open.reply.send(Ok(stream));
            }
            ConnectionEvent::DialUpgradeError(DialUpgradeError { info: open, error }) => {
                let e = match error {
                    StreamUpgradeError::Timeout => OpenError::Io(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "stream negotiation timed out",
                    )),
                    StreamUpgradeError::NegotiationFailed => OpenError::Unsupported(open.protocol),
                    StreamUpgradeError::Io(e) => OpenError::Io(e),
                    StreamUpgradeError::Apply(v) => match v {},
                };
                let _ = open.reply.send(Err(e));
            }
            _ => {}
        }
    }
}
