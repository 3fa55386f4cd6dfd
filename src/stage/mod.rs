//! A replica: serves one stage of one run over the network, and the peer built around it.
//!
//! - [`service`]: the stage protocol server: streams in, a bounded queue, one compute
//!   thread that owns the candle stage, typed errors out.
//! - [`client`]: calls a remote stage (forward, backward, info).
//! - [`exchange`]: one request and its answer on a stream.
//! - [`registry`]: the typed DHT operations (manifest, announcements, swarm view).
//! - [`select`]: pure choice of the stage to serve and the bottleneck.
//! - [`replica`]: the replica's training state (stage, optimizer, accumulator).
//! - [`status`]: what `shoal status` prints.
//! - [`probe`]: one microbatch through the swarm (`shoal probe`).
//! - [`tensor`]: candle tensors to wire frames.
//! - [`sync`]: which synchronous step a microbatch joins (admission at stage 0).
//! - [`sim`]: the timed stand-in stage for benchmarks (`stages.kind = "sim"`).
//!
//! Not here: routing of microbatches across replicas and gradient averaging (trainer and
//! averaging layers).

pub mod accum;
pub mod client;
pub mod exchange;
pub mod frozen;
pub mod predict;
pub mod probe;
pub mod registry;
pub mod replica;
pub mod select;
pub mod service;
pub mod sim;
pub mod status;
pub mod sync;
pub mod tensor;

use libp2p::StreamProtocol;

/// The stage call protocol; its version is the wire format's ([`crate::wire::msg::MSG_VERSION`]),
/// so peers of different formats never open a stream to each other.
pub const STAGE_PROTOCOL: StreamProtocol =
    StreamProtocol::new(concat!("/shoal/stage/", crate::wire_version!()));

#[cfg(test)]
mod tests {
    #[test]
    fn the_stage_protocol_carries_the_wire_version() {
        let name = super::STAGE_PROTOCOL.to_string();
        assert_eq!(
            name.rsplit('/').next(),
            Some(crate::wire::msg::MSG_VERSION.to_string().as_str()),
            "STAGE_PROTOCOL is built from the wire version"
        );
    }
}
