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
pub mod ann_cache;
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

use crate::wire::msg::Op;
use libp2p::StreamProtocol;

/// The stage call protocol (forward, backward, info, pushes); its version is the wire
/// format's ([`crate::wire::msg::MSG_VERSION`]), so peers of different formats never open a
/// stream to each other.
pub const STAGE_PROTOCOL: StreamProtocol =
    StreamProtocol::new(concat!("/shoal/stage/", crate::wire_version!()));

/// The averaging protocol (progress, round messages, parts): the same messages and
/// server as the stage protocol, in a lane of its own.
pub const AVG_PROTOCOL: StreamProtocol =
    StreamProtocol::new(concat!("/shoal/avg/", crate::wire_version!()));

/// The state download protocol (state info, hash pages, chunks, updates), in a lane of
/// its own.
pub const STATE_PROTOCOL: StreamProtocol =
    StreamProtocol::new(concat!("/shoal/state/", crate::wire_version!()));

/// Which of a replica's protocols carries a request: each has its own lane in the network
/// layer, so a burst of one kind (a joiner's state download, a round's parts) never
/// fills the queue the others wait in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lane {
    /// [`STAGE_PROTOCOL`].
    Stage,
    /// [`AVG_PROTOCOL`].
    Avg,
    /// [`STATE_PROTOCOL`].
    State,
}

impl Lane {
    /// Every lane.
    pub const ALL: [Lane; 3] = [Lane::Stage, Lane::Avg, Lane::State];

    /// The lane of a request of kind `op`.
    pub fn of(op: Op) -> Lane {
        match op {
            Op::Info | Op::Forward | Op::Backward | Op::Push => Lane::Stage,
            Op::Avg => Lane::Avg,
            Op::StateInfo | Op::StateChunk | Op::StateHashes | Op::StateUpdate => Lane::State,
        }
    }

    /// Its protocol name.
    pub fn protocol(self) -> StreamProtocol {
        match self {
            Lane::Stage => STAGE_PROTOCOL,
            Lane::Avg => AVG_PROTOCOL,
            Lane::State => STATE_PROTOCOL,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Lane;

    #[test]
    fn every_protocol_carries_the_wire_version() {
        for lane in Lane::ALL {
            let name = lane.protocol().to_string();
            assert_eq!(
                name.rsplit('/').next(),
                Some(crate::wire::msg::MSG_VERSION.to_string().as_str()),
                "{name} is built from the wire version"
            );
        }
    }
}
