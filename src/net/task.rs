//! The event loop that owns the swarm: commands in, swarm events handled, answers out.

use super::behaviour::{Behaviour, BehaviourEvent, KAD_PROTOCOL};
use super::{Command, ConnectionInfo, NetError};
use crate::dht;
use futures::StreamExt;
use libp2p::kad::store::RecordStore;
use libp2p::kad::{self, GetProvidersOk, GetRecordOk, QueryId, QueryResult, Quorum, Record};
use libp2p::multiaddr::Protocol;
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::swarm::{ConnectionId, SwarmEvent};
use libp2p::{identify, Multiaddr, PeerId, Swarm};
use std::collections::{HashMap, HashSet};
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};

enum Pending {
    GetRecord(Vec<Vec<u8>>, oneshot::Sender<Vec<Vec<u8>>>),
    GetProviders(HashSet<PeerId>, oneshot::Sender<HashSet<PeerId>>),
    Put(oneshot::Sender<Result<(), NetError>>),
}

struct State {
    listen: Vec<Multiaddr>,
    dials: HashMap<ConnectionId, (Multiaddr, oneshot::Sender<Result<PeerId, NetError>>)>,
    queries: HashMap<QueryId, Pending>,
    conns: HashMap<ConnectionId, ConnectionInfo>,
    relay_server: bool,
}

pub(crate) async fn run(
    mut swarm: Swarm<Behaviour>,
    mut rx: mpsc::Receiver<Command>,
    relay_server: bool,
) {
    let mut st = State {
        listen: Vec::new(),
        dials: HashMap::new(),
        queries: HashMap::new(),
        conns: HashMap::new(),
        relay_server,
    };
    loop {
        tokio::select! {
            cmd = rx.recv() => match cmd {
                None | Some(Command::Shutdown) => break,
                Some(cmd) => on_command(&mut swarm, &mut st, cmd),
            },
            event = swarm.select_next_some() => on_event(&mut swarm, &mut st, event),
        }
    }
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
            st.conns.insert(
                connection_id,
                ConnectionInfo {
                    peer: peer_id,
                    addr: addr.clone(),
                    relayed,
                },
            );
            if let Some((_, reply)) = st.dials.remove(&connection_id) {
                if endpoint.is_dialer() {
                    swarm.behaviour_mut().kad.add_address(&peer_id, addr);
                }
                let _ = reply.send(Ok(peer_id));
            }
        }
        SwarmEvent::ConnectionClosed { connection_id, .. } => {
            st.conns.remove(&connection_id);
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
            ..
        })) if info.protocols.contains(&KAD_PROTOCOL) => {
            for a in info.listen_addrs {
                swarm.behaviour_mut().kad.add_address(&peer_id, a);
            }
        }
        SwarmEvent::Behaviour(BehaviourEvent::Kad(e)) => on_kad(swarm, st, e),
        _ => {}
    }
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
