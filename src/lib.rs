//! shoal trains one neural network on a swarm of volunteer machines.
//!
//! The model is cut into pipeline stages; each peer serves one stage; activations and
//! gradients travel compressed. This crate is the library behind the `shoal` binary.
//!
//! # Layout
//! - [`wire`]: tensor frames and codecs as bytes (pure, bounded, fuzzed).
//! - [`config`]: the TOML run config and its validation.
//! - [`model`]: the decoder cut into stages; AdamW; safetensors checkpoints.
//! - [`data`]: token sources (built-in Markov corpus, text, token shards) and sampling.
//! - [`dht`]: run manifests (canonical TOML, run id) and stage announcements, validated.
//! - [`net`]: the libp2p swarm in one task, a cloneable handle, keys, stream framing.
//! - [`stage`]: the replica (stage protocol server and client), `shoal status`, `shoal probe`.
//! - [`averaging`]: stage averaging rounds (butterfly all-reduce) and state download.
//! - [`trainer`]: trainer loops: stochastic wiring, swap-in, accounting.
//! - [`swarm`]: the peer process (`shoal peer`): stage, averager and trainers together.
//! - [`train`]: local training of all stages in one process, through the wire codec.
//! - [`bench`]: benchmarks that print tables (`shoal bench ...`).
//! - [`files`]: atomic file writes (checkpoints, manifests, keys).
//! - [`rng`]: the seeded generator every peer computes identically.
pub mod averaging;
pub mod bench;
pub mod config;
pub mod data;
pub mod dht;
pub mod files;
pub mod model;
pub mod net;
pub mod rng;
pub mod stage;
pub mod swarm;
pub mod train;
pub mod trainer;
pub mod wire;

/// candle allocates a fresh buffer for every op; glibc serves large ones with mmap and
/// hands them back at once, so training spent a third of its time in page faults.
/// mimalloc keeps freed memory for reuse.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;
