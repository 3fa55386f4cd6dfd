//! The event loop that owns the swarm: commands in, swarm events handled, answers out.
//!
//! A dial is answered once the remote peer's identify arrived (or 5 s passed), so a peer
//! of another wire version is refused at the dial with its reason rather than later with
//! a decode error. Reachability, relays and hole punching are kept in a
//! [`super::reach::NetStatus`] and reported as [`super::reach::NetEvent`]s.

use super::behaviour::{Behaviour, BehaviourEvent, KAD_PROTOCOL};
use super::reach::{self, NetEvent, NetStatus};
use super::{Command, ConnectionInfo, NetError};
use crate::dht;
use futures::StreamExt;
use libp2p::core::transport::ListenerId;
use libp2p::kad::store::RecordStore;
use libp2p::kad::{self, GetProvidersOk, GetRecordOk, QueryId, QueryResult, Quorum, Record};
use libp2p::multiaddr::Protocol;
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::swarm::{ConnectionId, SwarmEvent};
use libp2p::{autonat, dcutr, identify, relay, Multiaddr, PeerId, Swarm};
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};
use tokio::sync::{broadcast, mpsc, oneshot};

type DialReply = oneshot::Sender<Result<PeerId, NetError>>;

/// How long a dial waits for the remote identify before it is answered anyway.
const IDENTIFY_WAIT: Duration = Duration::from_secs(5);
/// A peer that others observed but none dialled back for this long is private: behind a
/// NAT or firewall that drops inbound connections, a dial-back does not fail, it hangs
/// until AutoNAT's own timeout, which it does not report.
const PRIVATE_AFTER: Duration = Duration::from_secs(15);
/// How long a refused peer stays connected: long enough to receive our identify.
const REFUSE_GRACE: Duration = Duration::from_millis(500);
/// How often a private peer without a relay looks for one in the DHT.
const RELAY_SEARCH: Duration = Duration::from_secs(10);

enum Pending {
    GetRecord(Vec<Vec<u8>>, oneshot::Sender<Vec<Vec<u8>>>),
    GetProviders(HashSet<PeerId>, oneshot::Sender<HashSet<PeerId>>),
    Put(oneshot::Sender<Result<(), NetError>>),
    /// Looking for relays; the providers found are looked up and dialled.
    Relays,
    /// Looking up a relay's addresses, to dial it.
    RelayAddrs(PeerId),
}

struct State {
    listen: Vec<Multiaddr>,
    dials: HashMap<ConnectionId, (Multiaddr, DialReply)>,
    /// Dials connected, waiting for the peer's identify: peer → (since, replies).
    identifying: HashMap<PeerId, (Instant, Vec<DialReply>)>,
    queries: HashMap<QueryId, Pending>,
    conns: HashMap<ConnectionId, ConnectionInfo>,
    relay_server: bool,
    dht_server: bool,
    protocol: String,
    status: NetStatus,
    events: broadcast::Sender<NetEvent>,
    /// Relays by peer id, with the address we reached each at.
    relays: HashMap<PeerId, Multiaddr>,
    /// The reservation being made or held: (listener, relay).
    reservation: Option<(ListenerId, PeerId)>,
    /// Relays whose reservation failed (not tried again).
    relays_failed: HashSet<PeerId>,
    refused: HashMap<PeerId, String>,
    last_relay_search: Option<Instant>,
    /// When another peer first told us the address it sees us at.
    first_observed: Option<Instant>,
    /// Refused peers to disconnect once [`REFUSE_GRACE`] passed (so that they receive our
    /// identify too, and say why on their side).
    to_disconnect: Vec<(PeerId, Instant)>,
}

pub(crate) async fn run(
    mut swarm: Swarm<Behaviour>,
    mut rx: mpsc::Receiver<Command>,
    (relay_server, dht_server, wire): (bool, bool, u8),
    events: broadcast::Sender<NetEvent>,
) {
    let mut st = State {
        listen: Vec::new(),
        dials: HashMap::new(),
        identifying: HashMap::new(),
        queries: HashMap::new(),
        conns: HashMap::new(),
        relay_server,
        dht_server,
        protocol: reach::protocol_version(wire),
        status: NetStatus::default(),
        events,
        relays: HashMap::new(),
        reservation: None,
        relays_failed: HashSet::new(),
        refused: HashMap::new(),
        last_relay_search: None,
        first_observed: None,
        to_disconnect: Vec::new(),
    };
    if st.relay_server {
        // Private peers find relays as providers of this key.
        if let Err(e) = swarm
            .behaviour_mut()
            .kad
            .start_providing(kad::RecordKey::new(&reach::RELAY_KEY))
        {
            tracing::warn!(target: "shoal::net", "cannot announce the relay service: {e:?}");
        }
    }
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            cmd = rx.recv() => match cmd {
                None | Some(Command::Shutdown) => break,
                Some(cmd) => on_command(&mut swarm, &mut st, cmd),
            },
            event = swarm.select_next_some() => on_event(&mut swarm, &mut st, event),
            _ = tick.tick() => on_tick(&mut swarm, &mut st),
        }
    }
}

/// Once a second: answer dials whose identify is late; a private peer without a relay
/// looks for one.
fn on_tick(swarm: &mut Swarm<Behaviour>, st: &mut State) {
    st.to_disconnect.retain(|(p, since)| {
        let due = since.elapsed() >= REFUSE_GRACE;
        if due {
            let _ = swarm.disconnect_peer_id(*p);
        }
        !due
    });
    let late: Vec<PeerId> = st
        .identifying
        .iter()
        .filter(|(_, (since, _))| since.elapsed() >= IDENTIFY_WAIT)
        .map(|(p, _)| *p)
        .collect();
    for p in late {
        if let Some((_, replies)) = st.identifying.remove(&p) {
            for r in replies {
                let _ = r.send(Ok(p));
            }
        }
    }
    let silent = st
        .first_observed
        .is_some_and(|t| t.elapsed() >= PRIVATE_AFTER);
    if st.status.reachability == reach::Reachability::Unknown && silent {
        let addr = st
            .status
            .observed
            .first()
            .and_then(|a| a.parse::<Multiaddr>().ok())
            .unwrap_or_else(Multiaddr::empty);
        let why = format!("no dial-back succeeded in {} s", PRIVATE_AFTER.as_secs());
        tracing::info!(target: "shoal::net", "not reachable from outside: {why}");
        if st.status.probe_failed(&addr, why) {
            became_private(swarm, st);
            emit(
                st,
                NetEvent::Reachability {
                    public: false,
                    addr: addr.to_string(),
                },
            );
        }
    }
    if st.status.reachability == reach::Reachability::Private && st.reservation.is_none() {
        reserve(swarm, st);
        let due = st
            .last_relay_search
            .is_none_or(|t| t.elapsed() >= RELAY_SEARCH);
        if st.reservation.is_none() && due {
            st.last_relay_search = Some(Instant::now());
            let q = swarm
                .behaviour_mut()
                .kad
                .get_providers(kad::RecordKey::new(&reach::RELAY_KEY));
            st.queries.insert(q, Pending::Relays);
        }
    }
}

/// Listens through the first known relay not yet tried.
fn reserve(swarm: &mut Swarm<Behaviour>, st: &mut State) {
    let Some((relay, addr)) = st
        .relays
        .iter()
        .find(|(p, _)| !st.relays_failed.contains(p))
        .map(|(p, a)| (*p, a.clone()))
    else {
        return;
    };
    let circuit = reach::circuit_addr(&addr, relay);
    match swarm.listen_on(circuit.clone()) {
        Ok(id) => {
            tracing::info!(target: "shoal::net", %relay, "reserving a relay slot: {circuit}");
            st.reservation = Some((id, relay));
        }
        Err(e) => {
            tracing::warn!(target: "shoal::net", %relay, "cannot listen through the relay: {e}");
            st.relays_failed.insert(relay);
        }
    }
}

/// We are private: serve the DHT only once an address is confirmed (the relayed one).
fn became_private(swarm: &mut Swarm<Behaviour>, st: &State) {
    if st.dht_server {
        swarm.behaviour_mut().kad.set_mode(None);
    }
}

fn emit(st: &State, e: NetEvent) {
    // No subscriber is fine: the status keeps the same facts.
    let _ = st.events.send(e);
}

fn full_addr(addr: &Multiaddr, local: PeerId) -> Multiaddr {
    match addr.iter().last() {
        Some(Protocol::P2p(p)) if p == local => addr.clone(),
        _ => addr.clone().with(Protocol::P2p(local)),
    }
}

fn on_command(swarm: &mut Swarm<Behaviour>, st: &mut State, cmd: Command) {
    let local = *swarm.local_peer_id();
    match cmd {
        Command::ListenAddrs(reply) => {
            let mut addrs: Vec<Multiaddr> = st.listen.iter().map(|a| full_addr(a, local)).collect();
            for a in swarm.external_addresses() {
                let a = full_addr(a, local);
                if !addrs.contains(&a) {
                    addrs.push(a);
                }
            }
            let _ = reply.send(addrs);
        }
        Command::Dial(addr, reply) => {
            if let Some(peer) = super::peer_of(&addr).filter(|p| swarm.is_connected(p)) {
                swarm.behaviour_mut().kad.add_address(&peer, addr);
                let _ = reply.send(Ok(peer));
                return;
            }
            let opts = match super::peer_of(&addr) {
                Some(peer) => DialOpts::peer_id(peer)
                    .addresses(vec![addr.clone()])
                    .condition(PeerCondition::Always)
                    .build(),
                None => DialOpts::unknown_peer_id().address(addr.clone()).build(),
            };
            let id = opts.connection_id();
            match swarm.dial(opts) {
                Ok(()) => {
                    st.dials.insert(id, (addr, reply));
                }
                Err(e) => {
                    let _ = reply.send(Err(NetError::Dial {
                        addr: addr.to_string(),
                        cause: e.to_string(),
                    }));
                }
            }
        }
        Command::AddAddresses(peer, addrs) => {
            for a in addrs {
                swarm.add_peer_address(peer, a);
            }
        }
        Command::PutRecord {
            key,
            value,
            ttl,
            reply,
        } => {
            let mut record = Record::new(key, value);
            record.publisher = Some(local);
            record.expires = Some(Instant::now() + ttl);
            match swarm.behaviour_mut().kad.put_record(record, Quorum::One) {
                Ok(q) => {
                    st.queries.insert(q, Pending::Put(reply));
                }
                Err(e) => {
                    let _ = reply.send(Err(NetError::Dht(format!("cannot store record: {e:?}"))));
                }
            }
        }
        Command::GetRecord(key, reply) => {
            let q = swarm
                .behaviour_mut()
                .kad
                .get_record(kad::RecordKey::new(&key));
            st.queries.insert(q, Pending::GetRecord(Vec::new(), reply));
        }
        Command::RemoveRecord(key) => swarm
            .behaviour_mut()
            .kad
            .remove_record(&kad::RecordKey::new(&key)),
        Command::StartProviding(key, reply) => {
            match swarm
                .behaviour_mut()
                .kad
                .start_providing(kad::RecordKey::new(&key))
            {
                Ok(q) => {
                    st.queries.insert(q, Pending::Put(reply));
                }
                Err(e) => {
                    let _ = reply.send(Err(NetError::Dht(format!("cannot provide: {e:?}"))));
                }
            }
        }
        Command::StopProviding(key) => swarm
            .behaviour_mut()
            .kad
            .stop_providing(&kad::RecordKey::new(&key)),
        Command::GetProviders(key, reply) => {
            let q = swarm
                .behaviour_mut()
                .kad
                .get_providers(kad::RecordKey::new(&key));
            st.queries
                .insert(q, Pending::GetProviders(HashSet::new(), reply));
        }
        Command::Bootstrap => {
            let _ = swarm.behaviour_mut().kad.bootstrap();
        }
        Command::Connections(reply) => {
            let _ = reply.send(st.conns.values().cloned().collect());
        }
        Command::Status(reply) => {
            let mut s = st.status.clone();
            s.relays = st.relays.keys().map(|p| p.to_string()).collect();
            let _ = reply.send(s);
        }
        Command::Shutdown => {}
    }
}

fn on_event(swarm: &mut Swarm<Behaviour>, st: &mut State, event: SwarmEvent<BehaviourEvent>) {
    match event {
        SwarmEvent::NewListenAddr { address, .. } if !st.listen.contains(&address) => {
            // A relay advertises its service only with a confirmed external address; the
            // operator who turned it on vouches that its listen addresses are reachable.
            let circuit = address.iter().any(|p| matches!(p, Protocol::P2pCircuit));
            if st.relay_server && !circuit {
                swarm.add_external_address(address.clone());
            }
            st.listen.push(address);
        }
        SwarmEvent::ExpiredListenAddr { address, .. } => st.listen.retain(|a| a != &address),
        SwarmEvent::ListenerError { error, .. } => {
            tracing::warn!(target: "shoal::net", "listener error: {error}");
        }
        SwarmEvent::ConnectionEstablished {
            peer_id,
            connection_id,
            endpoint,
            ..
        } => {
            let addr = endpoint.get_remote_address().clone();
            let relayed = addr.iter().any(|p| matches!(p, Protocol::P2pCircuit));
            if let Some(reason) = st.refused.get(&peer_id) {
                if let Some((_, reply)) = st.dials.remove(&connection_id) {
                    let _ = reply.send(Err(NetError::Refused {
                        peer: peer_id.to_string(),
                        reason: reason.clone(),
                    }));
                }
                let _ = swarm.disconnect_peer_id(peer_id);
                return;
            }
            st.conns.insert(
                connection_id,
                ConnectionInfo {
                    peer: peer_id,
                    addr: addr.clone(),
                    relayed,
                },
            );
            if relayed {
                emit(
                    st,
                    NetEvent::Relayed {
                        peer: peer_id.to_string(),
                    },
                );
            }
            if let Some((_, reply)) = st.dials.remove(&connection_id) {
                if endpoint.is_dialer() {
                    swarm.behaviour_mut().kad.add_address(&peer_id, addr);
                }
                st.identifying
                    .entry(peer_id)
                    .or_insert_with(|| (Instant::now(), Vec::new()))
                    .1
                    .push(reply);
            }
        }
        SwarmEvent::ConnectionClosed {
            connection_id,
            peer_id,
            num_established,
            ..
        } => {
            st.conns.remove(&connection_id);
            if num_established == 0 {
                st.status.remotes.remove(&peer_id.to_string());
                if let Some((_, replies)) = st.identifying.remove(&peer_id) {
                    let reason = st
                        .refused
                        .get(&peer_id)
                        .cloned()
                        .unwrap_or_else(|| "it closed the connection".into());
                    for r in replies {
                        let _ = r.send(Err(NetError::Refused {
                            peer: peer_id.to_string(),
                            reason: reason.clone(),
                        }));
                    }
                }
            }
        }
        SwarmEvent::ListenerClosed {
            listener_id,
            reason,
            ..
        } => {
            if let Some((id, relay)) = st.reservation {
                if id == listener_id {
                    tracing::warn!(target: "shoal::net", %relay, "the relay reservation ended: {reason:?}");
                    st.reservation = None;
                    st.status.relayed_addr = None;
                    st.relays_failed.insert(relay);
                }
            }
        }
        SwarmEvent::OutgoingConnectionError {
            connection_id,
            error,
            ..
        } => {
            if let Some((addr, reply)) = st.dials.remove(&connection_id) {
                let _ = reply.send(Err(NetError::Dial {
                    addr: addr.to_string(),
                    cause: one_line(&error.to_string()),
                }));
            }
        }
        SwarmEvent::Behaviour(BehaviourEvent::Identify(identify::Event::Received {
            peer_id,
            info,
            connection_id,
        })) => on_identify(swarm, st, peer_id, connection_id, info),
        SwarmEvent::Behaviour(BehaviourEvent::Kad(e)) => on_kad(swarm, st, e),
        SwarmEvent::Behaviour(BehaviourEvent::Autonat(e)) => on_autonat(swarm, st, e),
        SwarmEvent::Behaviour(BehaviourEvent::Ping(libp2p::ping::Event {
            peer,
            result: Ok(rtt),
            ..
        })) => {
            if let Some(r) = st.status.remotes.get_mut(&peer.to_string()) {
                r.rtt_ms = Some(rtt.as_secs_f64() * 1e3);
            }
        }
        SwarmEvent::Behaviour(BehaviourEvent::Dcutr(dcutr::Event {
            remote_peer_id,
            result,
        })) => {
            let error = result.as_ref().err().map(|e| one_line(&e.to_string()));
            if error.is_none() {
                st.status.hole_punched += 1;
            } else {
                st.status.hole_punch_failed += 1;
            }
            tracing::info!(target: "shoal::net", peer = %remote_peer_id, ?error, "hole punch");
            emit(
                st,
                NetEvent::HolePunch {
                    peer: remote_peer_id.to_string(),
                    ok: error.is_none(),
                    error,
                },
            );
        }
        SwarmEvent::Behaviour(BehaviourEvent::RelayClient(
            relay::client::Event::ReservationReqAccepted {
                relay_peer_id,
                renewal,
                ..
            },
        )) => {
            if renewal {
                return;
            }
            let local = *swarm.local_peer_id();
            let addr = st
                .relays
                .get(&relay_peer_id)
                .map(|a| full_addr(&reach::circuit_addr(a, relay_peer_id), local).to_string())
                .unwrap_or_default();
            tracing::info!(target: "shoal::net", relay = %relay_peer_id, "relay slot reserved: {addr}");
            st.status.relayed_addr = Some(addr.clone());
            emit(
                st,
                NetEvent::RelayReserved {
                    relay: relay_peer_id.to_string(),
                    addr,
                },
            );
        }
        _ => {}
    }
}

/// A peer's identify: refuse it if it speaks another wire version, learn its DHT
/// addresses, whether it relays, and what address it saw us at; answer dials waiting on it.
fn on_identify(
    swarm: &mut Swarm<Behaviour>,
    st: &mut State,
    peer: PeerId,
    conn: ConnectionId,
    info: identify::Info,
) {
    if let Some(reason) =
        reach::incompatible(&st.protocol, &info.protocol_version, &info.agent_version)
    {
        tracing::warn!(target: "shoal::net", %peer, "refused: {reason}");
        st.status.refuse(peer, reason.clone());
        st.refused.insert(peer, reason.clone());
        if let Some((_, replies)) = st.identifying.remove(&peer) {
            for r in replies {
                let _ = r.send(Err(NetError::Refused {
                    peer: peer.to_string(),
                    reason: reason.clone(),
                }));
            }
        }
        emit(
            st,
            NetEvent::Refused {
                peer: peer.to_string(),
                reason,
            },
        );
        st.to_disconnect.push((peer, Instant::now()));
        return;
    }
    if let Some((_, replies)) = st.identifying.remove(&peer) {
        for r in replies {
            let _ = r.send(Ok(peer));
        }
    }
    st.status.observed(&info.observed_addr);
    st.first_observed.get_or_insert_with(Instant::now);
    st.status.remotes.entry(peer.to_string()).or_default().agent = info.agent_version.clone();
    if info.protocols.contains(&KAD_PROTOCOL) {
        // Only addresses on the host we see it connect from: a peer behind NAT lists
        // its LAN and loopback addresses, which nobody else could dial.
        let seen = st
            .conns
            .get(&conn)
            .filter(|c| !c.relayed)
            .map(|c| c.addr.clone());
        for a in &info.listen_addrs {
            if seen.as_ref().is_some_and(|s| same_host(a, s)) {
                swarm.behaviour_mut().kad.add_address(&peer, a.clone());
            }
        }
    }
    if info.protocols.contains(&relay::HOP_PROTOCOL_NAME) {
        // The address we reached it at (a direct connection) is one that works for us.
        let direct = st
            .conns
            .get(&conn)
            .filter(|c| !c.relayed)
            .map(|c| c.addr.clone());
        if let Some(a) = direct {
            st.relays.insert(peer, a);
        }
    }
}

/// An AutoNAT v2 test of one of our addresses ended.
fn on_autonat(swarm: &mut Swarm<Behaviour>, st: &mut State, e: autonat::v2::client::Event) {
    match e.result {
        Ok(()) => {
            let was = st.status.reachability;
            st.status.confirmed(&e.tested_addr);
            tracing::info!(target: "shoal::net", addr = %e.tested_addr, "reachable: a peer dialled us back");
            if was != reach::Reachability::Public {
                emit(
                    st,
                    NetEvent::Reachability {
                        public: true,
                        addr: e.tested_addr.to_string(),
                    },
                );
            }
        }
        Err(err) => {
            let why = one_line(&err.to_string());
            tracing::info!(target: "shoal::net", addr = %e.tested_addr, "dial-back failed: {why}");
            if st.status.probe_failed(&e.tested_addr, why) {
                became_private(swarm, st);
                emit(
                    st,
                    NetEvent::Reachability {
                        public: false,
                        addr: e.tested_addr.to_string(),
                    },
                );
            }
        }
    }
}

/// Whether two addresses name the same IP (a peer's listen address and the address its
/// connection comes from).
fn same_host(a: &Multiaddr, b: &Multiaddr) -> bool {
    let ip = |m: &Multiaddr| {
        m.iter().find_map(|p| match p {
            Protocol::Ip4(x) => Some(std::net::IpAddr::V4(x)),
            Protocol::Ip6(x) => Some(std::net::IpAddr::V6(x)),
            _ => None,
        })
    };
    matches!((ip(a), ip(b)), (Some(x), Some(y)) if x == y)
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn on_kad(swarm: &mut Swarm<Behaviour>, st: &mut State, event: kad::Event) {
    let now = dht::now_ms();
    match event {
        kad::Event::InboundRequest { request } => match request {
            kad::InboundRequest::PutRecord {
                source,
                record: Some(record),
                ..
            } => match dht::validate(record.key.as_ref(), &record.value, now) {
                Ok(()) => {
                    let _ = swarm.behaviour_mut().kad.store_mut().put(record);
                }
                Err(e) => {
                    tracing::debug!(target: "shoal::net", %source, "refused a record: {e}");
                }
            },
            kad::InboundRequest::AddProvider {
                record: Some(record),
            } if dht::record::is_provider_key(record.key.as_ref()) => {
                let _ = swarm.behaviour_mut().kad.store_mut().add_provider(record);
            }
            _ => {}
        },
        kad::Event::OutboundQueryProgressed {
            id, result, step, ..
        } => {
            let Some(pending) = st.queries.remove(&id) else {
                return;
            };
            match (pending, result) {
                (Pending::GetRecord(mut found, reply), QueryResult::GetRecord(r)) => {
                    if let Ok(GetRecordOk::FoundRecord(pr)) = r {
                        match dht::validate(pr.record.key.as_ref(), &pr.record.value, now) {
                            Ok(()) => found.push(pr.record.value),
                            Err(e) => {
                                tracing::debug!(target: "shoal::net", "ignored a record: {e}");
                            }
                        }
                    }
                    if step.last {
                        let _ = reply.send(found);
                    } else {
                        st.queries.insert(id, Pending::GetRecord(found, reply));
                    }
                }
                (Pending::GetProviders(mut found, reply), QueryResult::GetProviders(r)) => {
                    if let Ok(GetProvidersOk::FoundProviders { providers, .. }) = r {
                        found.extend(providers);
                    }
                    if step.last {
                        let _ = reply.send(found);
                    } else {
                        st.queries.insert(id, Pending::GetProviders(found, reply));
                    }
                }
                (Pending::Relays, QueryResult::GetProviders(r)) => {
                    if let Ok(GetProvidersOk::FoundProviders { providers, .. }) = r {
                        for p in providers {
                            if p != *swarm.local_peer_id() && !swarm.is_connected(&p) {
                                // Provider records carry no addresses: find the relay's.
                                let q = swarm.behaviour_mut().kad.get_closest_peers(p);
                                st.queries.insert(q, Pending::RelayAddrs(p));
                            }
                        }
                    }
                    if !step.last {
                        st.queries.insert(id, Pending::Relays);
                    }
                }
                (Pending::RelayAddrs(relay), QueryResult::GetClosestPeers(r)) => {
                    let found = r.ok().and_then(|ok| {
                        ok.peers
                            .into_iter()
                            .find(|p| p.peer_id == relay)
                            .map(|p| p.addrs)
                    });
                    match found {
                        Some(addrs) if !addrs.is_empty() && !swarm.is_connected(&relay) => {
                            // Once connected, its identify shows the hop protocol.
                            let opts = DialOpts::peer_id(relay).addresses(addrs).build();
                            if let Err(e) = swarm.dial(opts) {
                                tracing::debug!(target: "shoal::net", %relay, "cannot dial the relay: {e}");
                            }
                        }
                        _ if !step.last => {
                            st.queries.insert(id, Pending::RelayAddrs(relay));
                        }
                        _ => {}
                    }
                }
                (Pending::Put(reply), QueryResult::PutRecord(_))
                | (Pending::Put(reply), QueryResult::StartProviding(_)) => {
                    // A quorum failure still leaves the record stored here and at whatever
                    // peers took it; a tiny or just-started swarm is not an error.
                    let _ = reply.send(Ok(()));
                }
                (p, _) => {
                    if !step.last {
                        st.queries.insert(id, p);
                    }
                }
            }
        }
        _ => {}
    }
}
