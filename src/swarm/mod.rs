//! The peer process: the stage it serves, the averager that keeps its replicas identical,
//! and the trainer loops it may run beside them. `shoal peer` is [`peer::Peer`].
//!
//! - [`peer`]: start-up (run, stage choice, trainers), stop, kill.
//! - `join`: bootstrap dials with backoff, re-joining lost bootstrap peers.
//! - `serving`: one stage served (build, sync, announce, leave); `announce`: its
//!   announcement, refreshed in the DHT; `rebalance`: moving to the weakest stage.
//! - [`export`]: every stage's state from a live swarm into one model file.
//! - [`events`]: what a peer reports, as typed values (the `--events` JSON-lines stream).

mod announce;
pub mod events;
pub mod export;
mod join;
pub mod peer;
mod rebalance;
mod serving;
