//! shoal trains one neural network on a swarm of volunteer machines.
//!
//! # Layout
//! - [`wire`]: tensor frames and codecs as bytes (pure, bounded, fuzzed).
//! - [`rng`]: the seeded generator every peer computes identically.
pub mod bench;
pub mod rng;
pub mod wire;
