//! The swarm's side of our stream protocols: one [`Handler`] per connection, each
//! registered with its peer so [`super::Control::open_stream`] can reach it; opens for a
//! peer with no connection wait while it is dialled and fail if the dial fails.

use super::handler::Handler;
use super::{Control, OpenError, Shared};
use libp2p::core::transport::PortUse;
use libp2p::core::Endpoint;
use libp2p::swarm::behaviour::ConnectionEstablished;
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::swarm::{
    ConnectionClosed, ConnectionDenied, ConnectionId, DialError, DialFailure, FromSwarm,
    NetworkBehaviour, THandler, THandlerInEvent, THandlerOutEvent, ToSwarm,
};
use libp2p::{Multiaddr, PeerId};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

/// Our stream protocols' behaviour.
pub struct Behaviour {
    shared: Arc<Mutex<Shared>>,
    dials: tokio::sync::mpsc::Receiver<PeerId>,
}

impl Default for Behaviour {
    fn default() -> Self {
        Self::new()
    }
}

impl Behaviour {
    /// A behaviour with no protocol accepted yet.
    pub fn new() -> Self {
        let (dial, dials) = tokio::sync::mpsc::channel(super::DIALS);
        Self {
            shared: Arc::new(Mutex::new(Shared {
                lanes: HashMap::new(),
                counters: HashMap::new(),
                connections: HashMap::new(),
                pending: HashMap::new(),
                dial,
            })),
            dials,
        }
    }

    /// A control that opens and accepts streams through this behaviour.
    pub fn new_control(&self) -> Control {
        Control {
            shared: Arc::clone(&self.shared),
        }
    }

    fn handler(&self, conn: ConnectionId, peer: PeerId) -> Handler {
        let (tx, rx) = tokio::sync::mpsc::channel(super::OPENS_QUEUED);
        let mut s = self.shared.lock();
        let waiting = s.pending.remove(&peer).unwrap_or_default();
        s.connections.insert(conn, (peer, tx));
        Handler::new(peer, Arc::clone(&self.shared), rx, waiting)
    }
}

impl NetworkBehaviour for Behaviour {
    type ConnectionHandler = Handler;
    type ToSwarm = Infallible;

    fn handle_established_inbound_connection(
        &mut self,
        conn: ConnectionId,
        peer: PeerId,
        _: &Multiaddr,
        _: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        Ok(self.handler(conn, peer))
    }

    fn handle_established_outbound_connection(
        &mut self,
        conn: ConnectionId,
        peer: PeerId,
        _: &Multiaddr,
        _: Endpoint,
        _: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        Ok(self.handler(conn, peer))
    }

    fn on_swarm_event(&mut self, event: FromSwarm) {
        match event {
            FromSwarm::ConnectionEstablished(ConnectionEstablished { .. }) => {}
            FromSwarm::ConnectionClosed(ConnectionClosed { connection_id, .. }) => {
                self.shared.lock().connections.remove(&connection_id);
            }
            FromSwarm::DialFailure(DialFailure {
                peer_id: Some(peer),
                error:
                    error @ (DialError::Transport(_)
                    | DialError::Denied { .. }
                    | DialError::NoAddresses
                    | DialError::WrongPeerId { .. }
                    | DialError::LocalPeerId { .. }
                    | DialError::Aborted),
                ..
            }) => {
                let why = super::super::task::one_line(&error.to_string());
                let waiting = self.shared.lock().pending.remove(&peer);
                for open in waiting.unwrap_or_default() {
                    let _ = open.reply.send(Err(OpenError::Dial(why.clone())));
                }
            }
            _ => {}
        }
    }

    fn on_connection_handler_event(
        &mut self,
        _: PeerId,
        _: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        match event {}
    }

    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<ToSwarm<Infallible, THandlerInEvent<Self>>> {
        match self.dials.poll_recv(cx) {
            Poll::Ready(Some(peer)) => Poll::Ready(ToSwarm::Dial {
                opts: DialOpts::peer_id(peer)
                    .condition(PeerCondition::DisconnectedAndNotDialing)
                    .build(),
            }),
            _ => Poll::Pending,
        }
    }
}
