//! The network task's side that deals with reachability: once a second it decides
//! whether this peer is private (observed, never dialled back) and reserves a relay slot
//! (found among connections or through the DHT); it handles identify (version refusal,
//! DHT addresses, relays), AutoNAT v2 results, DCUtR outcomes and relay reservations.
//! State lives in the task's [`super::task::State`].

use super::behaviour::{Behaviour, KAD_PROTOCOL};
use super::reach::{self, NetEvent};
use super::task::{answer_dials, emit, full_addr, one_line, Pending, State, IDENTIFY_WAIT};
use libp2p::kad;
use libp2p::multiaddr::Protocol;
use libp2p::swarm::ConnectionId;
use libp2p::{autonat, dcutr, identify, relay, Multiaddr, PeerId, Swarm};
use std::time::{Duration, Instant};

/// A peer that others observed but none dialled back for this long is private: behind a
/// NAT or firewall that drops inbound connections, a dial-back does not fail, it hangs
/// until AutoNAT's own timeout, which it does not report.
pub(super) const PRIVATE_AFTER: Duration = Duration::from_secs(15);
/// How long a refused peer stays connected: long enough to receive our identify.
const REFUSE_GRACE: Duration = Duration::from_millis(500);
/// A relay whose reservation failed or ended is tried again after this long.
const RELAY_RETRY: Duration = Duration::from_secs(60);
/// How often a private peer without a relay looks for one in the DHT.
const RELAY_SEARCH: Duration = Duration::from_secs(10);

/// Once a second: answer dials whose identify is late; a private peer without a relay
/// looks for one.
pub(super) fn on_tick(swarm: &mut Swarm<Behaviour>, st: &mut State) {
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
        answer_dials(st, p, Ok(()));
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
        .find(|(p, _)| {
            st.relays_failed
                .get(*p)
                .is_none_or(|t| t.elapsed() >= RELAY_RETRY)
        })
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
            st.relays_failed.insert(relay, Instant::now());
        }
    }
}

/// We are private: serve the DHT only once an address is confirmed (the relayed one).
fn became_private(swarm: &mut Swarm<Behaviour>, st: &State) {
    if st.dht_server {
        swarm.behaviour_mut().kad.set_mode(None);
    }
}

/// A peer's identify: refuse it if it speaks another wire version, learn its DHT
/// addresses, whether it relays, and what address it saw us at; answer dials waiting on it.
pub(super) fn on_identify(
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
        answer_dials(st, peer, Err(reason.clone()));
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
    answer_dials(st, peer, Ok(()));
    st.status.observed(&info.observed_addr);
    if is_memory(&info.observed_addr) && st.status.reachability != reach::Reachability::Public {
        // An in-process address: every peer that could learn it can dial it, and AutoNAT
        // cannot test it (it dials back IP addresses only).
        st.status.confirmed(&info.observed_addr);
    }
    st.first_observed.get_or_insert_with(Instant::now);
    st.status.remotes.entry(peer.to_string()).or_default().agent = info.agent_version.clone();
    // The address of this connection, unless it is relayed.
    let direct = st
        .conns
        .get(&conn)
        .filter(|c| !c.relayed)
        .map(|c| c.addr.clone());
    if info.protocols.contains(&KAD_PROTOCOL) {
        // Only addresses on the host we see it connect from: a peer behind NAT lists
        // its LAN and loopback addresses, which nobody else could dial.
        for a in &info.listen_addrs {
            if direct.as_ref().is_some_and(|s| same_host(a, s)) {
                swarm.behaviour_mut().kad.add_address(&peer, a.clone());
            }
        }
    }
    if info.protocols.contains(&relay::HOP_PROTOCOL_NAME) {
        // The address we reached it at is one that works for us.
        if let Some(a) = direct {
            st.relays.insert(peer, a);
        }
    }
}

/// An AutoNAT v2 test of one of our addresses ended.
pub(super) fn on_autonat(
    swarm: &mut Swarm<Behaviour>,
    st: &mut State,
    e: autonat::v2::client::Event,
) {
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
/// connection comes from), or are both in-process memory addresses (this process is
/// their host).
fn same_host(a: &Multiaddr, b: &Multiaddr) -> bool {
    if is_memory(a) && is_memory(b) {
        return true;
    }
    let ip = |m: &Multiaddr| {
        m.iter().find_map(|p| match p {
            Protocol::Ip4(x) => Some(std::net::IpAddr::V4(x)),
            Protocol::Ip6(x) => Some(std::net::IpAddr::V6(x)),
            _ => None,
        })
    };
    matches!((ip(a), ip(b)), (Some(x), Some(y)) if x == y)
}

/// Whether an address is libp2p's in-process memory transport's.
fn is_memory(a: &Multiaddr) -> bool {
    a.iter().any(|p| matches!(p, Protocol::Memory(_)))
}

/// A hole punch ended.
pub(super) fn on_dcutr(st: &mut State, e: dcutr::Event) {
    let dcutr::Event {
        remote_peer_id,
        result,
    } = e;
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

/// A relay accepted our reservation: we are reachable through it.
pub(super) fn on_relay(swarm: &mut Swarm<Behaviour>, st: &mut State, e: relay::client::Event) {
    let relay::client::Event::ReservationReqAccepted {
        relay_peer_id,
        renewal: false,
        ..
    } = e
    else {
        return;
    };
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
