//! Benchmarks that print tables and run in one process: `shoal bench codec`,
//! `shoal bench transfer`, `shoal bench allreduce`, `shoal bench stage`, `shoal bench
//! streams` and `shoal bench compress`. (`shoal bench swarm` starts `shoal` processes, so it
//! lives in the binary's harness, not here.)
//!
//! A benchmark measures and reports; it never asserts a speed (tests do not fail on timing).

pub mod allreduce;
pub mod codec;
pub mod compress;
pub mod stage;
pub mod streams;
pub mod transfer;

use crate::net::link::LinkSpec;
use crate::net::{NetConfig, NetError, NetHandle};
use libp2p::Multiaddr;
use std::time::Duration;

/// A node of an in-process benchmark: a fresh key, no DHT service, listening on `listen`
/// (none: a caller only), every connection behind `link` if given.
pub(crate) fn bench_node(
    listen: Option<&str>,
    link: Option<LinkSpec>,
) -> Result<NetHandle, NetError> {
    let listen = match listen {
        Some(a) => vec![a
            .parse::<Multiaddr>()
            .map_err(|e| NetError::Invalid(format!("{a}: {e}")))?],
        None => Vec::new(),
    };
    let mut c = NetConfig::new(libp2p::identity::Keypair::generate_ed25519(), listen);
    c.dht_server = false;
    c.link = link;
    crate::net::start(c)
}

/// The first address `node` listens on (waiting up to 5 s); `who` names it in the error.
pub(crate) async fn first_addr(node: &NetHandle, who: &str) -> Result<Multiaddr, NetError> {
    node.wait_listening(1, Duration::from_secs(5))
        .await?
        .into_iter()
        .next()
        .ok_or_else(|| NetError::Invalid(format!("{who} is not listening")))
}
