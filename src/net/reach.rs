//! Reachability, relays, hole punching and version checks: what the network task learns
//! about how others can reach this peer, and which peers it refused.
//!
//! - **Reachability.** AutoNAT v2 asks connected peers to dial back each address others
//!   observed for us (identify's observed addresses). One success confirms an external
//!   address: Kademlia, left in automatic mode, then serves the DHT (it is a client until
//!   then, so peers behind NAT never enter others' routing tables). A failed dial-back with
//!   nothing confirmed makes the peer `private`.
//! - **Relays.** A private peer reserves a slot on a relay (a peer whose identify lists
//!   the relay hop protocol; relays also provide [`RELAY_KEY`] in the DHT so they can be
//!   found) and listens on its `/p2p-circuit` address, which its announcements then carry.
//! - **Hole punching.** DCUtR upgrades relayed connections; each outcome is counted.
//! - **Versions.** Identify's protocol version is [`protocol_version`]: the wire format's
//!   version. A peer speaking another one is disconnected and remembered with a one-line
//!   reason (both sides do the same), before any stage message could fail to decode.

use libp2p::{Multiaddr, PeerId};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// The DHT key relays provide, so that private peers find them.
pub const RELAY_KEY: &[u8] = b"/shoal/relays";

/// How many refused peers and failed probes are kept.
const KEEP: usize = 16;

/// The wire protocol this build speaks, as identify's protocol version.
pub fn protocol_version(wire: u8) -> String {
    format!("/shoal/wire/{wire}")
}

/// This build's agent version (`shoal/X.Y.Z`).
pub fn agent_version() -> String {
    format!("shoal/{}", env!("CARGO_PKG_VERSION"))
}

/// Why a peer announcing `theirs` (with agent `agent`) cannot talk to us, speaking
/// `ours`; `None` when it can.
pub fn incompatible(ours: &str, theirs: &str, agent: &str) -> Option<String> {
    if ours == theirs {
        return None;
    }
    let me = agent_version();
    Some(if theirs.starts_with("/shoal/wire/") {
        format!(
            "it speaks shoal wire protocol {} ({agent}), this peer speaks {} ({me}); run the same shoal version on both",
            theirs.trim_start_matches("/shoal/wire/"),
            ours.trim_start_matches("/shoal/wire/"),
        )
    } else {
        format!("it is not a shoal peer (protocol {theirs:?}, agent {agent:?})")
    })
}

/// Whether others can dial this peer, as far as AutoNAT tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Reachability {
    /// Not tested yet (no address observed, or no peer to test with).
    #[default]
    Unknown,
    /// A peer dialled one of our addresses back.
    Public,
    /// Dial-backs failed and none succeeded: behind NAT or a firewall.
    Private,
}

/// What the network task knows about this peer's reachability.
#[derive(Debug, Clone, Default, Serialize)]
pub struct NetStatus {
    /// Whether others can dial us.
    pub reachability: Reachability,
    /// Addresses confirmed by a dial-back.
    pub external: Vec<String>,
    /// Addresses other peers observed us at.
    pub observed: Vec<String>,
    /// The latest failed dial-backs: (address, why).
    pub failed_probes: Vec<(String, String)>,
    /// The relayed address we listen on, once a relay accepted our reservation.
    pub relayed_addr: Option<String>,
    /// Relays known (connected peers offering the hop protocol).
    pub relays: Vec<String>,
    /// Relayed connections upgraded to direct ones by hole punching.
    pub hole_punched: u64,
    /// Hole punching attempts that failed.
    pub hole_punch_failed: u64,
    /// Peers refused (wrong wire version, not shoal): (peer, why), the latest last.
    pub refused: Vec<(String, String)>,
    /// DHT records refused as forged (not signed by the peer they are about, or changed
    /// since), stored to us or fetched by us.
    pub forged_records: u64,
    /// Peers in the DHT routing table.
    pub routing_table: usize,
    /// Connected peers that identified themselves: peer id → what we know of them.
    pub remotes: std::collections::BTreeMap<String, Remote>,
}

/// A connected peer, as identify and ping tell.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Remote {
    /// Its agent version (`shoal/X.Y.Z`).
    pub agent: String,
    /// The latest ping round trip, milliseconds.
    pub rtt_ms: Option<f64>,
}

impl NetStatus {
    /// Records an observed address.
    pub(crate) fn observed(&mut self, a: &Multiaddr) {
        push_unique(&mut self.observed, a.to_string());
    }

    /// A dial-back to `a` succeeded.
    pub(crate) fn confirmed(&mut self, a: &Multiaddr) {
        push_unique(&mut self.external, a.to_string());
        self.reachability = Reachability::Public;
    }

    /// A dial-back to `a` failed; true when that makes us private.
    pub(crate) fn probe_failed(&mut self, a: &Multiaddr, why: String) -> bool {
        bounded_push(&mut self.failed_probes, (a.to_string(), why));
        if self.external.is_empty() && self.reachability != Reachability::Private {
            self.reachability = Reachability::Private;
            return true;
        }
        false
    }

    /// Why `peer` was refused, if it is among the latest refused.
    pub(crate) fn refusal(&self, peer: &PeerId) -> Option<String> {
        let p = peer.to_string();
        self.refused
            .iter()
            .find(|(q, _)| q == &p)
            .map(|(_, why)| why.clone())
    }

    /// A peer was refused.
    pub(crate) fn refuse(&mut self, peer: PeerId, why: String) {
        let p = peer.to_string();
        self.refused.retain(|(q, _)| q != &p);
        bounded_push(&mut self.refused, (p, why));
    }
}

fn push_unique(v: &mut Vec<String>, s: String) {
    if !v.contains(&s) {
        bounded_push(v, s);
    }
}

fn bounded_push<T>(v: &mut Vec<T>, x: T) {
    let mut q: VecDeque<T> = std::mem::take(v).into();
    q.push_back(x);
    while q.len() > KEEP {
        q.pop_front();
    }
    *v = q.into();
}

/// Something the network learned that a peer reports (see `swarm::events`), written in
/// the events' JSON tagged by `"net"` (`"net": "hole_punch"`, ...).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "net", rename_all = "snake_case")]
pub enum NetEvent {
    /// AutoNAT's verdict changed.
    Reachability {
        /// Public or private.
        public: bool,
        /// The address confirmed (public) or whose dial-back failed (private).
        addr: String,
    },
    /// A relay accepted our reservation; we listen on `addr` through it.
    RelayReserved {
        /// The relay's peer id.
        relay: String,
        /// The relayed address others can dial.
        addr: String,
    },
    /// A peer connected to us through a relay, or we to it.
    Relayed {
        /// The remote peer.
        peer: String,
    },
    /// A hole punch with `peer` ended.
    HolePunch {
        /// The remote peer.
        peer: String,
        /// Whether a direct connection was made.
        ok: bool,
        /// Why not, if it failed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    /// A peer was refused.
    Refused {
        /// The remote peer.
        peer: String,
        /// Why.
        reason: String,
    },
}

impl std::fmt::Display for NetEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Reachability { public: true, addr } => {
                write!(f, "reachable: a peer dialled {addr} back")
            }
            Self::Reachability {
                public: false,
                addr,
            } => write!(
                f,
                "not reachable from outside (a dial-back to {addr} failed): looking for a relay"
            ),
            Self::RelayReserved { addr, .. } => write!(f, "reachable through a relay: {addr}"),
            Self::Relayed { peer } => write!(f, "relayed connection with {peer}"),
            Self::HolePunch { peer, ok: true, .. } => {
                write!(f, "hole punch with {peer}: direct connection")
            }
            Self::HolePunch { peer, error, .. } => write!(
                f,
                "hole punch with {peer} failed ({}); staying relayed",
                error.as_deref().unwrap_or("no reason")
            ),
            Self::Refused { peer, reason } => write!(f, "refused {peer}: {reason}"),
        }
    }
}

/// The `/p2p-circuit` listen address through `relay` reached at `addr`.
pub fn circuit_addr(addr: &Multiaddr, relay: PeerId) -> Multiaddr {
    use libp2p::multiaddr::Protocol;
    let base: Multiaddr = addr
        .iter()
        .filter(|p| !matches!(p, Protocol::P2p(_)))
        .collect();
    base.with(Protocol::P2p(relay)).with(Protocol::P2pCircuit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_match_or_say_why_not() {
        let ours = protocol_version(4);
        assert_eq!(incompatible(&ours, &ours, "shoal/0.1.0"), None);
        let why = incompatible(&ours, &protocol_version(5), "shoal/9.0.0").unwrap_or_default();
        assert!(
            why.contains("wire protocol 5") && why.contains("this peer speaks 4"),
            "{why}"
        );
        assert!(!why.contains('\n'));
        let why = incompatible(&ours, "/ipfs/0.1.0", "kubo").unwrap_or_default();
        assert!(why.contains("not a shoal peer"), "{why}");
    }

    #[test]
    fn a_failed_probe_makes_a_peer_private_only_without_a_confirmed_address() {
        let a: Multiaddr = "/ip4/10.0.0.11/tcp/4001"
            .parse()
            .unwrap_or_else(|_| Multiaddr::empty());
        let mut s = NetStatus::default();
        assert!(s.probe_failed(&a, "timeout".into()));
        assert_eq!(s.reachability, Reachability::Private);
        assert!(!s.probe_failed(&a, "timeout".into()), "said twice");
        s.confirmed(&a);
        assert_eq!(s.reachability, Reachability::Public);
        assert!(!s.probe_failed(&a, "timeout".into()));
        assert_eq!(s.reachability, Reachability::Public);
        for i in 0..40 {
            s.refuse(PeerId::random(), format!("r{i}"));
        }
        assert_eq!(s.refused.len(), KEEP);
    }

    #[test]
    fn circuit_addresses_name_the_relay() {
        let relay = PeerId::random();
        let a: Multiaddr = format!("/ip4/10.0.0.1/tcp/4001/p2p/{relay}")
            .parse()
            .unwrap_or_else(|_| Multiaddr::empty());
        let c = circuit_addr(&a, relay);
        assert_eq!(
            c.to_string(),
            format!("/ip4/10.0.0.1/tcp/4001/p2p/{relay}/p2p-circuit")
        );
    }
}
