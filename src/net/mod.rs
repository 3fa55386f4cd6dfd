//! The network layer: one task owns the libp2p swarm; everyone else holds a [`NetHandle`].
//!
//! The handle is cheap to clone and talks to the task over a bounded command channel, each
//! command answered on its own oneshot (the shape of rust-libp2p's file-sharing example).
//! When every handle is dropped the task ends. Streams for our own protocols are opened
//! and accepted through [`streams::Control`], which the handle carries, so bulk bytes
//! never pass through the command channel. What this layer does not know: what a stage is,
//! what the bytes on a stream mean (that is `stage`, with framing from `io`).

pub mod behaviour;
pub mod doctor;
pub mod io;
pub mod keys;
pub mod link;
mod nat;
pub mod reach;
mod requests;
pub mod stats;
pub mod streams;
mod task;
mod walks;

use libp2p::identity::Keypair;
use libp2p::pnet::PreSharedKey;
use libp2p::{Multiaddr, PeerId, Stream, StreamProtocol};
use std::collections::HashSet;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// Why a network operation failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NetError {
    /// A key file is missing, unreadable or malformed.
    #[error("{0}")]
    Key(String),
    /// The transport could not be built.
    #[error("cannot build the transport: {0}")]
    Transport(String),
    /// A listen address was refused.
    #[error("cannot listen on {addr}: {cause}")]
    Listen {
        /// The address.
        addr: String,
        /// Why.
        cause: String,
    },
    /// A dial failed.
    #[error("cannot connect to {addr}: {cause}")]
    Dial {
        /// The address.
        addr: String,
        /// Why.
        cause: String,
    },
    /// The DHT refused an operation.
    #[error("dht: {0}")]
    Dht(String),
    /// A stream could not be opened.
    #[error("cannot open a stream to {peer}: {cause}")]
    Stream {
        /// The peer.
        peer: String,
        /// Why.
        cause: String,
    },
    /// No connection to the peer could be made (no address known, or every dial failed).
    #[error("cannot open a stream to {peer}: {cause}")]
    Unreachable {
        /// The peer.
        peer: String,
        /// Why.
        cause: String,
    },
    /// The remote peer speaks an incompatible protocol.
    #[error("refused {peer}: {reason}")]
    Refused {
        /// The peer.
        peer: String,
        /// Why.
        reason: String,
    },
    /// The network task has stopped.
    #[error("the network task has stopped")]
    Stopped,
    /// A bad argument.
    #[error("{0}")]
    Invalid(String),
}

/// How a peer joins the network.
#[derive(Clone)]
pub struct NetConfig {
    /// The peer's key.
    pub identity: Keypair,
    /// Addresses to listen on (TCP, QUIC, or `/p2p-circuit` through a relay).
    pub listen: Vec<Multiaddr>,
    /// Private swarm key: TCP wrapped in pnet, QUIC off.
    pub swarm_key: Option<PreSharedKey>,
    /// Offer relay service to others.
    pub relay_server: bool,
    /// Answer DHT queries (serving peers); `false` for `shoal status` and other clients.
    pub dht_server: bool,
    /// How often AutoNAT tests an untested address.
    pub probe_interval: Duration,
    /// The wire protocol version announced and required (tests change it).
    pub wire: u8,
    /// How long the DHT keeps provider records.
    pub provider_ttl: Duration,
    /// Close connections idle this long.
    pub idle_timeout: Duration,
    /// Most established connections.
    pub max_connections: u32,
    /// Emulate this access link on every TCP connection (QUIC off); tests and benchmarks.
    pub link: Option<link::LinkSpec>,
}

impl NetConfig {
    /// How long provider records live by default: republished every third of it, a walk
    /// and twenty stores for each key a peer provides. Readers tell a live replica by its
    /// announcement, which expires sooner; a dead provider only costs them one miss.
    pub const PROVIDER_TTL: Duration = Duration::from_secs(180);

    /// Defaults for a peer with `identity` listening on `listen`.
    pub fn new(identity: Keypair, listen: Vec<Multiaddr>) -> Self {
        Self {
            identity,
            listen,
            swarm_key: None,
            relay_server: false,
            dht_server: true,
            probe_interval: Duration::from_secs(1),
            wire: crate::wire::msg::MSG_VERSION,
            provider_ttl: Self::PROVIDER_TTL,
            idle_timeout: Duration::from_secs(120),
            max_connections: 512,
            link: None,
        }
    }
}

/// One established connection, as the task sees it.
#[derive(Debug, Clone)]
pub struct ConnectionInfo {
    /// The remote peer.
    pub peer: PeerId,
    /// The remote address.
    pub addr: Multiaddr,
    /// Whether it runs through a relay circuit.
    pub relayed: bool,
}

pub(crate) enum Command {
    ListenAddrs(oneshot::Sender<Vec<Multiaddr>>),
    Dial(Multiaddr, oneshot::Sender<Result<PeerId, NetError>>),
    AddAddresses(PeerId, Vec<Multiaddr>),
    AddressesOf(Vec<PeerId>, oneshot::Sender<Vec<(PeerId, Vec<Multiaddr>)>>),
    PutRecord {
        key: Vec<u8>,
        value: Vec<u8>,
        ttl: Duration,
        reply: oneshot::Sender<Result<(), NetError>>,
    },
    GetRecord(Vec<u8>, oneshot::Sender<Vec<Vec<u8>>>),
    RemoveRecord(Vec<u8>),
    StartProviding(Vec<u8>, oneshot::Sender<Result<(), NetError>>),
    StopProviding(Vec<u8>),
    /// A provider walk, ended after the patience if any (with what it found by then).
    GetProviders(Vec<u8>, Option<Duration>, oneshot::Sender<HashSet<PeerId>>),
    Bootstrap,
    Connections(oneshot::Sender<Vec<ConnectionInfo>>),
    Status(oneshot::Sender<reach::NetStatus>),
    Shutdown,
}

/// A cloneable handle on the network task.
#[derive(Clone)]
pub struct NetHandle {
    tx: mpsc::Sender<Command>,
    control: streams::Control,
    local: PeerId,
    /// The peer's identity key: signs the records it publishes about itself.
    identity: Keypair,
    events: tokio::sync::broadcast::Sender<reach::NetEvent>,
    /// Durations of this peer's DHT gets, and the DHT requests it answered.
    lookups: std::sync::Arc<stats::LookupStats>,
}

impl std::fmt::Debug for NetHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetHandle")
            .field("local", &self.local)
            .finish()
    }
}

/// Starts the network task on the current tokio runtime.
pub fn start(cfg: NetConfig) -> Result<NetHandle, NetError> {
    if cfg.swarm_key.is_some() {
        if let Some(a) = cfg.listen.iter().find(|a| is_quic(a)) {
            return Err(NetError::Invalid(format!(
                "{a}: QUIC cannot carry a swarm key; listen on TCP in a private swarm"
            )));
        }
    }
    if cfg.link.is_some() {
        if let Some(a) = cfg.listen.iter().find(|a| is_quic(a)) {
            return Err(NetError::Invalid(format!(
                "{a}: link emulation shapes TCP only; listen on TCP with --emulate-link"
            )));
        }
    }
    let mut swarm = behaviour::build_swarm(&cfg)?;
    for addr in &cfg.listen {
        swarm
            .listen_on(addr.clone())
            .map_err(|e| NetError::Listen {
                addr: addr.to_string(),
                cause: e.to_string(),
            })?;
    }
    let control = swarm.behaviour().stream.new_control();
    let local = *swarm.local_peer_id();
    let (tx, rx) = mpsc::channel(64);
    let (events, _) = tokio::sync::broadcast::channel(256);
    let lookups = std::sync::Arc::new(stats::LookupStats::default());
    tokio::spawn(tracing::Instrument::in_current_span(task::run(
        swarm,
        rx,
        (cfg.relay_server, cfg.dht_server, cfg.wire),
        events.clone(),
        std::sync::Arc::clone(&lookups),
    )));
    Ok(NetHandle {
        tx,
        control,
        local,
        identity: cfg.identity.clone(),
        events,
        lookups,
    })
}

/// Whether an address is QUIC.
pub fn is_quic(addr: &Multiaddr) -> bool {
    addr.iter()
        .any(|p| matches!(p, libp2p::multiaddr::Protocol::QuicV1))
}

/// The peer id at the end of a multiaddr, if any.
pub fn peer_of(addr: &Multiaddr) -> Option<PeerId> {
    match addr.iter().last() {
        Some(libp2p::multiaddr::Protocol::P2p(p)) => Some(p),
        _ => None,
    }
}

/// Parses a multiaddr given on the command line, with a one-line error.
pub fn parse_addr(s: &str) -> Result<Multiaddr, NetError> {
    s.parse::<Multiaddr>().map_err(|e| {
        NetError::Invalid(format!(
            "{s:?} is not a multiaddr ({e}); expected e.g. /ip4/127.0.0.1/tcp/4001/p2p/12D3Koo…"
        ))
    })
}

impl NetHandle {
    /// This peer's identity key (signs its announcements).
    pub fn identity(&self) -> &Keypair {
        &self.identity
    }

    /// This peer's id.
    pub fn local_peer_id(&self) -> PeerId {
        self.local
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, NetError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(make(reply))
            .await
            .map_err(|_| NetError::Stopped)?;
        rx.await.map_err(|_| NetError::Stopped)
    }

    async fn tell(&self, cmd: Command) -> Result<(), NetError> {
        self.tx.send(cmd).await.map_err(|_| NetError::Stopped)
    }

    /// Full addresses (ending in `/p2p/<id>`) this peer listens on now.
    pub async fn listen_addrs(&self) -> Result<Vec<Multiaddr>, NetError> {
        self.ask(Command::ListenAddrs).await
    }

    /// Waits until the peer listens on at least `n` addresses, or `timeout` passes.
    pub async fn wait_listening(
        &self,
        n: usize,
        timeout: Duration,
    ) -> Result<Vec<Multiaddr>, NetError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let addrs = self.listen_addrs().await?;
            if addrs.len() >= n || tokio::time::Instant::now() >= deadline {
                return Ok(addrs);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Dials an address and waits for the connection; returns the remote peer id.
    pub async fn dial(&self, addr: Multiaddr) -> Result<PeerId, NetError> {
        self.ask(|r| Command::Dial(addr, r)).await?
    }

    /// Tells the swarm where a peer can be reached (used when a stream is opened to it).
    pub async fn add_addresses(&self, peer: PeerId, addrs: Vec<Multiaddr>) -> Result<(), NetError> {
        self.tell(Command::AddAddresses(peer, addrs)).await
    }

    /// Where each of `peers` can be reached, as far as this peer knows (addresses it was
    /// told of, dialled, or heard from the peer's identify); peers it knows no address of
    /// are left out.
    pub async fn addresses_of(
        &self,
        peers: Vec<PeerId>,
    ) -> Result<Vec<(PeerId, Vec<Multiaddr>)>, NetError> {
        self.ask(|r| Command::AddressesOf(peers, r)).await
    }

    /// Stores a record locally and at the peers closest to its key, expiring after `ttl`.
    /// Succeeds when stored locally, even if no other peer took it yet.
    pub async fn put_record(
        &self,
        key: Vec<u8>,
        value: Vec<u8>,
        ttl: Duration,
    ) -> Result<(), NetError> {
        self.ask(|reply| Command::PutRecord {
            key,
            value,
            ttl,
            reply,
        })
        .await?
    }

    /// Valid, unexpired values found under `key` (possibly several versions; the walk ends
    /// after a few).
    pub async fn get_record(&self, key: Vec<u8>) -> Result<Vec<Vec<u8>>, NetError> {
        self.timed(self.ask(|r| Command::GetRecord(key, r))).await
    }

    /// `lookup`, its duration counted in [`Self::lookups`].
    async fn timed<T>(&self, lookup: impl std::future::Future<Output = T>) -> T {
        let t0 = std::time::Instant::now();
        let out = lookup.await;
        self.lookups.record(t0.elapsed());
        out
    }

    /// How long this peer's DHT gets (records and providers) took.
    pub fn lookups(&self) -> &stats::LookupStats {
        &self.lookups
    }

    /// Drops a record from the local store and stops republishing it.
    pub async fn remove_record(&self, key: Vec<u8>) -> Result<(), NetError> {
        self.tell(Command::RemoveRecord(key)).await
    }

    /// Announces this peer as a provider of `key`.
    pub async fn start_providing(&self, key: Vec<u8>) -> Result<(), NetError> {
        self.ask(|r| Command::StartProviding(key, r)).await?
    }

    /// Stops providing `key` (locally; remote copies expire).
    pub async fn stop_providing(&self, key: Vec<u8>) -> Result<(), NetError> {
        self.tell(Command::StopProviding(key)).await
    }

    /// The providers of `key` found in the DHT.
    pub async fn get_providers(&self, key: Vec<u8>) -> Result<HashSet<PeerId>, NetError> {
        self.get_providers_within(key, None).await
    }

    /// The providers of `key` found in the DHT within `patience` (the walk is ended then,
    /// with what it found), or by the whole walk.
    pub async fn get_providers_within(
        &self,
        key: Vec<u8>,
        patience: Option<Duration>,
    ) -> Result<HashSet<PeerId>, NetError> {
        self.timed(self.ask(|r| Command::GetProviders(key, patience, r)))
            .await
    }

    /// Starts a DHT bootstrap (refreshes the routing table).
    pub async fn bootstrap(&self) -> Result<(), NetError> {
        self.tell(Command::Bootstrap).await
    }

    /// The established connections.
    pub async fn connections(&self) -> Result<Vec<ConnectionInfo>, NetError> {
        self.ask(Command::Connections).await
    }

    /// What the network knows about this peer's reachability, relay and refused peers.
    pub async fn status(&self) -> Result<reach::NetStatus, NetError> {
        self.ask(Command::Status).await
    }

    /// Reachability changes, relay reservations, relayed connections, hole punches and
    /// refused peers, from now on.
    pub fn subscribe(&self) -> tokio::sync::broadcast::Receiver<reach::NetEvent> {
        self.events.subscribe()
    }

    /// Opens a stream to `peer` for `protocol`, dialling it if needed.
    pub async fn open_stream(
        &self,
        peer: PeerId,
        protocol: StreamProtocol,
    ) -> Result<Stream, NetError> {
        self.control.open_stream(peer, protocol).await.map_err(|e| {
            let (peer, cause) = (peer.to_string(), e.to_string());
            match e {
                streams::OpenError::Dial(_) => NetError::Unreachable { peer, cause },
                _ => NetError::Stream { peer, cause },
            }
        })
    }

    /// Accepts inbound streams of `protocol` (once per protocol) through a default lane:
    /// a stream the server has no room for is dropped (and counted).
    pub fn accept(&self, protocol: StreamProtocol) -> Result<streams::Incoming, NetError> {
        self.accept_with(protocol, streams::Lane::default())
    }

    /// Accepts inbound streams of `protocol` through `lane` (its bounds and its answer to
    /// a stream it has no room for).
    pub fn accept_with(
        &self,
        protocol: StreamProtocol,
        lane: streams::Lane,
    ) -> Result<streams::Incoming, NetError> {
        self.control
            .accept(protocol, lane)
            .map_err(|e| NetError::Invalid(format!("cannot accept streams: {e}")))
    }

    /// What happened to `protocol`'s inbound streams so far.
    pub fn stream_counts(&self, protocol: &StreamProtocol) -> streams::StreamCounts {
        self.control.counts(protocol)
    }

    /// Stops the network task.
    pub async fn shutdown(&self) {
        let _ = self.tell(Command::Shutdown).await;
    }
}
