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
//! - [`net`]: the libp2p swarm in one task, a cloneable handle, keys, our stream protocols'
//!   behaviour (lanes that answer, never drop), stream framing.
//! - [`stage`]: the replica (stage protocol server and client), `shoal status`, `shoal probe`.
//!   The server answers forward/backward itself and hands averaging and state calls to the
//!   [`Extension`](stage::service::Extension) the averaging layer registers.
//! - [`averaging`]: stage averaging: a pure plan (leader, members, who is behind or dead),
//!   round bookkeeping, the averager task, its server side, and state download.
//! - [`trainer`]: trainer loops: stochastic wiring, swap-in, accounting, progress totals.
//! - [`swarm`]: the peer (`shoal peer`): stage, averager and trainers together, and the
//!   typed [`Event`](swarm::events::Event)s a peer reports (the `--events` JSON lines).
//! - [`train`]: local training of all stages in one process, through the wire codec.
//! - [`bench`]: in-process benchmarks that print tables (`shoal bench codec|transfer|allreduce|stage|streams`).
//! - [`files`]: atomic file writes (checkpoints, manifests, keys).
//! - [`guard`]: whom a peer stops listening to: strikes, bans, and the checks of gradients
//!   other replicas send (used by the stage server and the averager).
//! - [`rng`]: the seeded generator every peer computes identically.
//! - [`tasks`]: the one task model: groups of long-lived tasks, cancelled and awaited together.
//!
//! Each module only calls the ones listed before it (`config`, `files`, `guard`, `rng` and
//! `tasks` are used throughout). The library never starts `shoal` processes and never reads printed text:
//! the harness that spawns peers for `shoal demo` and `shoal bench swarm` lives in the
//! binary (`bin/harness/`) and reads the processes' JSON event streams.
pub mod averaging;
pub mod bench;
pub mod config;
pub mod data;
pub mod dht;
pub mod files;
pub mod guard;
pub mod model;
pub mod net;
pub mod observe;
pub mod rng;
pub mod stage;
pub mod swarm;
pub mod tasks;
pub mod train;
pub mod trainer;
pub mod wire;

/// candle allocates a fresh buffer for every op; glibc serves large ones with mmap and
/// hands them back at once, so training spent a third of its time in page faults.
/// mimalloc keeps freed memory for reuse. The crate builds mimalloc 3.3.2, which has known
/// multi-threading faults fixed only in 3.4 (mimalloc issue 1287); its 2.x line (the `v2`
/// feature) trained faster, but a large stage's replica peaked at 4.4× its state where
/// `../shared/checks/scale.sh` allows 2.5× (BENCHMARKS.md, "Stop 51"), so 3.3.2 stays until
/// a crate with 3.4 is available.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Hands memory freed since the last call back to the OS. mimalloc keeps blocks that one
/// thread allocated and another freed until the allocating thread collects them; a large
/// stage's gradient-sized buffers move between threads (a compute thread fills the
/// running sum, the averager frees it), so without this the process keeps hundreds of MB
/// it no longer uses. Called by replicas of large stages after their big frees.
pub fn release_memory() {
    // SAFETY: `mi_collect` takes no pointers and may be called from any thread at any time.
    unsafe { libmimalloc_sys::mi_collect(true) }
}

/// mimalloc's `purge_delay` option. The crate names no constant for it; in mimalloc 2 and
/// 3 alike it is the option just before `use_numa_nodes`.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t =
    libmimalloc_sys::mi_option_use_numa_nodes - 1;

/// How long freed memory stays with the process before mimalloc hands it back to the OS,
/// in milliseconds, unless `MIMALLOC_PURGE_DELAY` says otherwise. mimalloc purges every
/// range freed since its last purge once this delay has passed (default 1 s), while a
/// peer's working set swings within a second (microbatches in flight, rounds): each purge
/// handed back memory about to be used again, and the kernel zeroed it afresh, in 2 MiB
/// huge pages, on the next touch — 10–30 thousand page faults a second per replica in
/// `bench swarm --scenario real`, ~10% of the machine's CPU (`shoal bench swarm
/// --scenario real`: 429–475 samples/s at 1 s, 527–556 at 10 s, 565–571 at 60 s).
/// [`release_memory`] still hands memory back at once where a large stage asks.
pub const PURGE_DELAY_MS: i64 = 60_000;

/// Sets the allocator's purge delay ([`PURGE_DELAY_MS`]); call once, early in `main`.
pub fn tune_allocator() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: `mi_option_set` takes no pointers; options may be set at any time.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS as _) }
}
