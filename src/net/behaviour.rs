//! The libp2p behaviour of a shoal peer and how its swarm is built.
//!
//! Transports: TCP (noise, yamux) and QUIC, or in a private swarm TCP wrapped in pnet
//! before noise (QUIC cannot carry pnet, so it is off), plus the relay client transport in
//! both cases. With link emulation ([`super::link`]) it is TCP only too, every socket
//! shaped before pnet and noise; such a peer also speaks libp2p's in-process memory
//! transport (`/memory/N` addresses, shaped the same way), on which `shoal bench sim` runs
//! hundreds of peers in one process without a file descriptor per connection. Behaviours: Kademlia (`/shoal/kad/<wire version>`, records validated before they are
//! stored; a peer found private serves it only through a relay, see [`super::reach`]), identify
//! (carrying the wire version), ping, AutoNAT v2 (client and server), relay client,
//! optional relay server, DCUtR, connection limits, and [`super::streams`] for our own stage
//! and transfer protocols.

use super::link::{Shaped, SharedLink};
use super::{NetConfig, NetError};
use futures::future::Either;
use libp2p::core::transport::MemoryTransport;
use libp2p::core::upgrade::Version;
use libp2p::core::Transport;
use libp2p::identity::Keypair;
use libp2p::kad::store::{MemoryStore, MemoryStoreConfig};
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::NetworkBehaviour;
use libp2p::{
    autonat, connection_limits, dcutr, identify, kad, noise, peer_store, ping, pnet, relay, tcp,
    yamux, StreamProtocol, Swarm, SwarmBuilder,
};
use std::time::Duration;

/// The Kademlia protocol name of shoal swarms, versioned with the wire format (a DHT
/// record's format changes with it: announcements are signed since version 6).
pub const KAD_PROTOCOL: StreamProtocol =
    StreamProtocol::new(concat!("/shoal/kad/", crate::wire_version!()));

/// How long one relayed circuit may last on a `--relay-server` peer.
pub const RELAY_CIRCUIT_DURATION: Duration = Duration::from_secs(60 * 60);
/// How many bytes one relayed circuit may carry on a `--relay-server` peer.
pub const RELAY_CIRCUIT_BYTES: u64 = 4 << 30;

/// Everything a peer speaks.
#[derive(NetworkBehaviour)]
pub struct Behaviour {
    /// Refuses connections over the configured limits.
    pub limits: connection_limits::Behaviour,
    /// The DHT.
    pub kad: kad::Behaviour<MemoryStore>,
    /// Tells peers our listen addresses and learns theirs.
    pub identify: identify::Behaviour,
    /// Liveness.
    pub ping: ping::Behaviour,
    /// Learns whether we are reachable from outside: asks peers to dial us back.
    pub autonat: autonat::v2::client::Behaviour,
    /// Dials others back when they ask.
    pub autonat_server: autonat::v2::server::Behaviour,
    /// Listens and dials through relays.
    pub relay_client: relay::client::Behaviour,
    /// Offers relay service when `--relay-server` is on.
    pub relay_server: Toggle<relay::Behaviour>,
    /// Upgrades relayed connections to direct ones by hole punching.
    pub dcutr: dcutr::Behaviour,
    /// Raw streams for stage calls and bulk transfers.
    pub stream: super::streams::Behaviour,
    /// Addresses of peers we were told about ([`super::NetHandle::add_addresses`]: from
    /// announcements), so a stream to a peer not connected yet can dial it.
    pub addresses: peer_store::Behaviour<peer_store::memory_store::MemoryStore>,
}

/// Peers a found manifest is copied to: the closest that were asked and lacked it.
const CACHE_PEERS: u16 = 2;

/// How often each connection is pinged.
const PING_EVERY: Duration = Duration::from_secs(60);

fn behaviour(key: &Keypair, relay_client: relay::client::Behaviour, cfg: &NetConfig) -> Behaviour {
    let id = key.public().to_peer_id();
    let mut kad_cfg = kad::Config::new(KAD_PROTOCOL);
    kad_cfg
        .set_query_timeout(Duration::from_secs(10))
        .set_record_filtering(kad::StoreInserts::FilterBoth)
        .set_provider_record_ttl(Some(cfg.provider_ttl))
        .set_provider_publication_interval(Some(cfg.provider_ttl / 3))
        .set_max_packet_size(64 << 10)
        // The closest peers a manifest walk asked without finding a copy get one (see
        // `task::Pending::CacheCopy`): joiners spread the run's manifest toward its key as
        // they read it, instead of every joiner storing it again at the twenty closest.
        .set_caching(kad::Caching::Enabled {
            max_peers: CACHE_PEERS,
        });
    let store = MemoryStore::with_config(
        id,
        MemoryStoreConfig {
            max_records: 4096,
            max_value_bytes: 64 << 10,
            max_providers_per_key: 256,
            max_provided_keys: 64,
        },
    );
    let mut kad = kad::Behaviour::with_config(id, store, kad_cfg);
    // A server from the start (a client for `status` and other clients); a peer that
    // AutoNAT finds private switches to automatic mode (see the task): a client until an
    // address is confirmed, e.g. the relayed address its relay reservation gives it.
    kad.set_mode(Some(if cfg.dht_server {
        kad::Mode::Server
    } else {
        kad::Mode::Client
    }));
    let limits = connection_limits::ConnectionLimits::default()
        .with_max_pending_incoming(Some(128))
        .with_max_pending_outgoing(Some(128))
        .with_max_established(Some(cfg.max_connections))
        .with_max_established_per_peer(Some(4));
    let relay_server = cfg.relay_server.then(|| {
        // Generous circuits: a relayed replica moves activations and gradients, megabytes
        // per call, for as long as hole punching fails. libp2p's defaults (2 minutes,
        // 128 KiB per circuit) are for signalling only. The operator chose to relay; these
        // bound it per circuit, not in total.
        let rcfg = relay::Config {
            max_circuit_duration: RELAY_CIRCUIT_DURATION,
            max_circuit_bytes: RELAY_CIRCUIT_BYTES,
            max_circuits: 64,
            max_circuits_per_peer: 8,
            ..relay::Config::default()
        };
        relay::Behaviour::new(id, rcfg)
    });
    Behaviour {
        limits: connection_limits::Behaviour::new(limits),
        kad,
        identify: identify::Behaviour::new(
            identify::Config::new(super::reach::protocol_version(cfg.wire), key.public())
                .with_agent_version(super::reach::agent_version()),
        ),
        // Pings only measure round trips for `status`: one a minute per connection (the
        // default 15 s was 2,800 pings a second across a simulated swarm of 200).
        ping: ping::Behaviour::new(ping::Config::new().with_interval(PING_EVERY)),
        autonat: autonat::v2::client::Behaviour::new(
            rand::make_rng::<rand::rngs::StdRng>(),
            autonat::v2::client::Config::default().with_probe_interval(cfg.probe_interval),
        ),
        autonat_server: autonat::v2::server::Behaviour::default(),
        relay_client,
        relay_server: Toggle::from(relay_server),
        dcutr: dcutr::Behaviour::new(id),
        stream: super::streams::Behaviour::new(),
        // Announcements re-add addresses every refresh; a failed dial (a restarting peer)
        // does not forget one.
        addresses: peer_store::Behaviour::new(peer_store::memory_store::MemoryStore::new(
            peer_store::memory_store::Config::default().set_remove_addr_on_dial_error(false),
        )),
    }
}

/// Builds the swarm for `cfg`.
pub fn build_swarm(cfg: &NetConfig) -> Result<Swarm<Behaviour>, NetError> {
    let err = |e: &dyn std::fmt::Display| NetError::Transport(e.to_string());
    let idle = cfg.idle_timeout;
    let tcp_cfg = tcp::Config::default().nodelay(true);
    let swarm = match (&cfg.swarm_key, &cfg.link) {
        (None, None) => SwarmBuilder::with_existing_identity(cfg.identity.clone())
            .with_tokio()
            .with_tcp(tcp_cfg, noise::Config::new, yamux::Config::default)
            .map_err(|e| err(&e))?
            .with_quic()
            .with_relay_client(noise::Config::new, yamux::Config::default)
            .map_err(|e| err(&e))?
            .with_behaviour(|key, relay| behaviour(key, relay, cfg))
            .map_err(|e| err(&e))?
            .with_swarm_config(|c| c.with_idle_connection_timeout(idle))
            .build(),
        _ => {
            // TCP only, through the link emulator and then pnet where they are asked for.
            let psk = cfg.swarm_key;
            // One set of buckets for every connection: the bandwidth is the peer's.
            let link = cfg.link.map(SharedLink::new);
            SwarmBuilder::with_existing_identity(cfg.identity.clone())
                .with_tokio()
                .with_other_transport(|key| {
                    let noise = noise::Config::new(key)?;
                    let mem_link = link.clone();
                    Ok::<_, Box<dyn std::error::Error + Send + Sync>>(
                        MemoryTransport::default()
                            .map(move |socket, _| Shaped::new(socket, mem_link.clone()))
                            .or_transport(
                                tcp::tokio::Transport::new(tcp_cfg)
                                    .map(move |socket, _| Shaped::new(socket, link.clone())),
                            )
                            .and_then(move |socket, _| async move {
                                match psk {
                                    Some(k) => pnet::PnetConfig::new(k)
                                        .handshake(socket)
                                        .await
                                        .map(Either::Left),
                                    None => Ok(Either::Right(socket)),
                                }
                            })
                            .upgrade(Version::V1)
                            .authenticate(noise)
                            .multiplex(yamux::Config::default())
                            .timeout(Duration::from_secs(20)),
                    )
                })
                .map_err(|e| err(&e))?
                .with_relay_client(noise::Config::new, yamux::Config::default)
                .map_err(|e| err(&e))?
                .with_behaviour(|key, relay| behaviour(key, relay, cfg))
                .map_err(|e| err(&e))?
                .with_swarm_config(|c| c.with_idle_connection_timeout(idle))
                .build()
        }
    };
    Ok(swarm)
}
