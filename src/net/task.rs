//! The event loop that owns the swarm: commands in, swarm events handled, answers out.
//!
//! A dial is answered once the remote peer's identify arrived (or 5 s passed), so a peer
//! of another wire version is refused at the dial with its reason rather than later with
//! a decode error. Reachability, relays and hole punching are kept in a
//! [`super::reach::NetStatus`] and reported as [`super::reach::NetEvent`]s.

use super::behaviour::{Behaviour, BehaviourEvent};
use super::reach::{self, NetEvent, NetStatus};
use super::stats::Walk;
use super::{Command, ConnectionInfo, NetError};
use crate::dht;
use futures::StreamExt;
use libp2p::core::transport::ListenerId;
use libp2p::kad::{self, GetProvidersOk, GetRecordOk, QueryId, QueryResult, Quorum, Record};
use libp2p::multiaddr::Protocol;
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::swarm::{ConnectionId, SwarmEvent};
use libp2p::{identify, Multiaddr, PeerId, Swarm};
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};
use tokio::sync::{broadcast, mpsc, oneshot};

pub(super) type DialReply = oneshot::Sender<Result<PeerId, NetError>>;

/// How long a dial waits for the remote identify before it is answered anyway.
pub(super) const IDENTIFY_WAIT: Duration = Duration::from_secs(5);

/// A record get ends once it found this many valid copies: the walk to the closest peers
/// would only find more copies of the same record (in a 200-peer swarm it took 3–15× longer
/// and as many more messages). Callers take the freshest of what came; a manifest get ends
/// at its first valid copy (every valid copy is the same). A provider get, unlike
/// it, walks to the end: each peer may hold a different subset of the providers (stopping
/// after 3 answering peers left 8-peer swarms missing one for good).
const ENOUGH_RECORDS: usize = 3;

pub(super) enum Pending {
    GetRecord(Vec<Vec<u8>>, oneshot::Sender<Vec<Vec<u8>>>),
    GetProviders(HashSet<PeerId>, oneshot::Sender<HashSet<PeerId>>),
    Put(oneshot::Sender<Result<(), NetError>>),
    /// A manifest was found and handed over; the rest of the walk names the closest peers
    /// it asked that lacked a copy, and the copy is stored there (Kademlia's caching).
    CacheCopy(Box<Record>),
    /// Looking for relays; the providers found are looked up and dialled.
    Relays,
    /// Looking up a relay's addresses, to dial it.
    RelayAddrs(PeerId),
    /// A bootstrap this peer asked for (told apart from Kademlia's own in the counts).
    Bootstrap,
}

pub(super) struct State {
    pub(super) listen: Vec<Multiaddr>,
    pub(super) dials: HashMap<ConnectionId, (Multiaddr, DialReply)>,
    /// Dials connected, waiting for the peer's identify: peer → (since, replies).
    pub(super) identifying: HashMap<PeerId, (Instant, Vec<DialReply>)>,
    pub(super) queries: HashMap<QueryId, Pending>,
    /// Walks to end early, and when: each reports what it found at its end.
    pub(super) walk_ends: Vec<(Instant, QueryId)>,
    pub(super) conns: HashMap<ConnectionId, ConnectionInfo>,
    pub(super) relay_server: bool,
    pub(super) dht_server: bool,
    pub(super) protocol: String,
    pub(super) status: NetStatus,
    pub(super) events: broadcast::Sender<NetEvent>,
    /// Relays by peer id, with the address we reached each at.
    pub(super) relays: HashMap<PeerId, Multiaddr>,
    /// The reservation being made or held: (listener, relay).
    pub(super) reservation: Option<(ListenerId, PeerId)>,
    /// Relays whose reservation failed or ended, and when (tried again a minute later).
    pub(super) relays_failed: HashMap<PeerId, Instant>,
    pub(super) last_relay_search: Option<Instant>,
    /// When another peer first told us the address it sees us at.
    pub(super) first_observed: Option<Instant>,
    /// Refused peers to disconnect once [`REFUSE_GRACE`] passed (so that they receive our
    /// identify too, and say why on their side).
    pub(super) to_disconnect: Vec<(PeerId, Instant)>,
    /// Where the DHT requests this peer answers are counted.
    pub(super) lookups: std::sync::Arc<super::stats::LookupStats>,
}

pub(crate) async fn run(
    mut swarm: Swarm<Behaviour>,
    mut rx: mpsc::Receiver<Command>,
    (relay_server, dht_server, wire): (bool, bool, u8),
    events: broadcast::Sender<NetEvent>,
    lookups: std::sync::Arc<super::stats::LookupStats>,
) {
    let mut st = State {
        listen: Vec::new(),
        dials: HashMap::new(),
        identifying: HashMap::new(),
        queries: HashMap::new(),
        walk_ends: Vec::new(),
        conns: HashMap::new(),
        relay_server,
        dht_server,
        protocol: reach::protocol_version(wire),
        status: NetStatus::default(),
        events,
        relays: HashMap::new(),
        reservation: None,
        relays_failed: HashMap::new(),
        last_relay_search: None,
        first_observed: None,
        to_disconnect: Vec::new(),
        lookups,
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
    let mut ends = tokio::time::interval(super::walks::WALK_END_CHECK);
    loop {
        tokio::select! {
            cmd = rx.recv() => match cmd {
                None | Some(Command::Shutdown) => break,
                Some(cmd) => on_command(&mut swarm, &mut st, cmd),
            },
            event = swarm.select_next_some() => on_event(&mut swarm, &mut st, event),
            _ = tick.tick() => super::nat::on_tick(&mut swarm, &mut st),
            _ = ends.tick(), if !st.walk_ends.is_empty() => super::walks::end_walks(&mut swarm, &mut st),
        }
    }
}

pub(super) fn emit(st: &State, e: NetEvent) {
    // No subscriber is fine: the status keeps the same facts.
    let _ = st.events.send(e);
}

fn refused(peer: PeerId, reason: String) -> NetError {
    NetError::Refused {
        peer: peer.to_string(),
        reason,
    }
}

/// Answers the dials waiting for `peer`'s identify: connected, or refused with a reason.
pub(super) fn answer_dials(st: &mut State, peer: PeerId, outcome: Result<(), String>) {
    let Some((_, replies)) = st.identifying.remove(&peer) else {
        return;
    };
    for r in replies {
        let _ = r.send(match &outcome {
            Ok(()) => Ok(peer),
            Err(reason) => Err(refused(peer, reason.clone())),
        });
    }
}

pub(super) fn full_addr(addr: &Multiaddr, local: PeerId) -> Multiaddr {
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
        Command::AddressesOf(peers, reply) => {
            let store = &swarm.behaviour().addresses;
            let known = peers
                .into_iter()
                .filter_map(|p| {
                    let addrs: Vec<Multiaddr> = store.address_of_peer(&p)?.cloned().collect();
                    (!addrs.is_empty()).then_some((p, addrs))
                })
                .collect();
            let _ = reply.send(known);
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
            st.lookups.walked(Walk::PutRecord);
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
            st.lookups.walked(Walk::GetRecord);
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
            st.lookups.walked(Walk::Provide);
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
        Command::GetProviders(key, patience, reply) => {
            st.lookups.walked(Walk::GetProviders);
            let q = swarm
                .behaviour_mut()
                .kad
                .get_providers(kad::RecordKey::new(&key));
            st.queries
                .insert(q, Pending::GetProviders(HashSet::new(), reply));
            if let Some(p) = patience {
                st.walk_ends.push((Instant::now() + p, q));
            }
        }
        Command::Bootstrap => match swarm.behaviour_mut().kad.bootstrap() {
            Ok(q) => {
                st.lookups.walked(Walk::Bootstrap);
                st.queries.insert(q, Pending::Bootstrap);
            }
            Err(e) => tracing::debug!(target: "shoal::net", "no DHT bootstrap: {e:?}"),
        },
        Command::Connections(reply) => {
            let _ = reply.send(st.conns.values().cloned().collect());
        }
        Command::Status(reply) => {
            let mut s = st.status.clone();
            s.relays = st.relays.keys().map(|p| p.to_string()).collect();
            s.routing_table = swarm
                .behaviour_mut()
                .kad
                .kbuckets()
                .map(|b| b.num_entries())
                .sum();
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
            if let Some(reason) = st.status.refusal(&peer_id) {
                if let Some((_, reply)) = st.dials.remove(&connection_id) {
                    let _ = reply.send(Err(refused(peer_id, reason)));
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
                let reason = st
                    .status
                    .refusal(&peer_id)
                    .unwrap_or_else(|| "it closed the connection".into());
                answer_dials(st, peer_id, Err(reason));
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
                    st.relays_failed.insert(relay, Instant::now());
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
        })) => super::nat::on_identify(swarm, st, peer_id, connection_id, info),
        SwarmEvent::Behaviour(BehaviourEvent::Kad(e)) => on_kad(swarm, st, e),
        SwarmEvent::Behaviour(BehaviourEvent::Autonat(e)) => super::nat::on_autonat(swarm, st, e),
        SwarmEvent::Behaviour(BehaviourEvent::Ping(libp2p::ping::Event {
            peer,
            result: Ok(rtt),
            ..
        })) => {
            if let Some(r) = st.status.remotes.get_mut(&peer.to_string()) {
                r.rtt_ms = Some(rtt.as_secs_f64() * 1e3);
            }
        }
        SwarmEvent::Behaviour(BehaviourEvent::Dcutr(e)) => super::nat::on_dcutr(st, e),
        SwarmEvent::Behaviour(BehaviourEvent::RelayClient(e)) => super::nat::on_relay(swarm, st, e),
        _ => {}
    }
}

pub(super) fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn on_kad(swarm: &mut Swarm<Behaviour>, st: &mut State, event: kad::Event) {
    let now = dht::now_ms();
    match event {
        kad::Event::InboundRequest { request } => {
            st.lookups.served(&request);
            super::requests::on_request(swarm, st, request, now);
        }
        kad::Event::OutboundQueryProgressed {
            id, result, step, ..
        } => {
            let Some(pending) = st.queries.remove(&id) else {
                if matches!(result, QueryResult::Bootstrap(_)) && step.count.get() == 1 {
                    st.lookups.walked(Walk::AutoBootstrap);
                }
                return;
            };
            match (pending, result) {
                (Pending::GetRecord(mut found, reply), QueryResult::GetRecord(r)) => {
                    let mut enough = ENOUGH_RECORDS;
                    let mut cache = None;
                    if let Ok(GetRecordOk::FoundRecord(pr)) = r {
                        // A manifest is named by its hash: any valid copy is the copy.
                        if let Ok(dht::record::KeyKind::Manifest(_)) =
                            dht::record::parse_key(pr.record.key.as_ref())
                        {
                            enough = 1;
                        }
                        match dht::validate(pr.record.key.as_ref(), &pr.record.value, now) {
                            Ok(()) => {
                                if enough == 1 {
                                    cache = Some(Box::new(pr.record.clone()));
                                }
                                found.push(pr.record.value)
                            }
                            Err(e) => {
                                super::requests::count_forged(st, &e);
                                tracing::debug!(target: "shoal::net", "ignored a record: {e}");
                            }
                        }
                    }
                    if step.last || found.len() >= enough {
                        if !step.last {
                            // The rest of the walk would only find more copies.
                            if let Some(mut q) = swarm.behaviour_mut().kad.query_mut(&id) {
                                q.finish();
                            }
                            if let Some(record) = cache {
                                st.queries.insert(id, Pending::CacheCopy(record));
                            }
                        }
                        let _ = reply.send(found);
                    } else {
                        st.queries.insert(id, Pending::GetRecord(found, reply));
                    }
                }
                (Pending::CacheCopy(record), QueryResult::GetRecord(r)) => {
                    if let Ok(GetRecordOk::FinishedWithNoAdditionalRecord { cache_candidates }) = r
                    {
                        if !cache_candidates.is_empty() {
                            swarm.behaviour_mut().kad.put_record_to(
                                *record,
                                cache_candidates.into_values(),
                                Quorum::One,
                            );
                        }
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
                (Pending::Bootstrap, QueryResult::Bootstrap(_)) => {
                    if !step.last {
                        st.queries.insert(id, Pending::Bootstrap);
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
