//! The peer process: the stage it serves, the averager that keeps its replicas identical,
//! and the trainer loops it may run beside them. `shoal peer` is [`peer::Peer`].

pub mod demo;
pub mod peer;
