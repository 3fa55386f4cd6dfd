//! What a replica counts about its work ([`Counters`], live atomics), a copy of them that
//! travels in a process's JSON status stream ([`CounterSnapshot`]), and the replica's
//! training status as the async side caches it ([`ReplicaStatus`]).

use crate::stage::replica::Replica;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};

/// Counters a replica keeps about its work.
#[derive(Debug, Default)]
pub struct Counters {
    /// Requests answered successfully.
    pub served: AtomicU64,
    /// Requests refused with a typed error.
    pub refused: AtomicU64,
    /// Streams dropped without an answer (timeouts, resets).
    pub dropped: AtomicU64,
    /// Samples whose backward was applied to the accumulator.
    pub samples_accumulated: AtomicU64,
    /// Microseconds spent computing (decode and encode not included).
    pub compute_us: AtomicU64,
    /// Forward and backward jobs run.
    pub jobs: AtomicU64,
    /// Microseconds jobs waited in the queue before compute.
    pub queue_us: AtomicU64,
    /// Microseconds spent reading forward and backward requests off the network (waiting
    /// for the caller's bytes included: on a slow link this is where the time goes).
    pub read_us: AtomicU64,
    /// Microseconds spent writing answers.
    pub write_us: AtomicU64,
    /// Microseconds decoding tensors.
    pub decode_us: AtomicU64,
    /// Microseconds encoding tensors.
    pub encode_us: AtomicU64,
    /// Frame bytes in and out of forward and backward calls.
    pub stage_in: AtomicU64,
    /// See `stage_in`.
    pub stage_out: AtomicU64,
    /// Frame bytes of averaging messages received.
    pub avg_in: AtomicU64,
    /// Frame bytes of state chunks sent to joiners.
    pub state_out: AtomicU64,
}

impl Counters {
    /// The counters' values now.
    pub fn snapshot(&self) -> CounterSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CounterSnapshot {
            served: g(&self.served),
            refused: g(&self.refused),
            dropped: g(&self.dropped),
            samples_accumulated: g(&self.samples_accumulated),
            jobs: g(&self.jobs),
            compute_us: g(&self.compute_us),
            queue_us: g(&self.queue_us),
            read_us: g(&self.read_us),
            write_us: g(&self.write_us),
            decode_us: g(&self.decode_us),
            encode_us: g(&self.encode_us),
            stage_in: g(&self.stage_in),
            stage_out: g(&self.stage_out),
            avg_in: g(&self.avg_in),
            state_out: g(&self.state_out),
        }
    }
}

/// The values of [`Counters`] at one moment (field meanings as there): what a peer reports
/// in its status stream, and what a benchmark takes differences of.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterSnapshot {
    /// Requests answered successfully.
    pub served: u64,
    /// Requests refused with a typed error.
    pub refused: u64,
    /// Streams dropped without an answer.
    pub dropped: u64,
    /// Samples whose backward was applied to the accumulator.
    pub samples_accumulated: u64,
    /// Forward and backward jobs run.
    pub jobs: u64,
    /// Microseconds computing.
    pub compute_us: u64,
    /// Microseconds jobs waited in the queue.
    pub queue_us: u64,
    /// Microseconds reading forward and backward requests.
    pub read_us: u64,
    /// Microseconds writing answers.
    pub write_us: u64,
    /// Microseconds decoding tensors.
    pub decode_us: u64,
    /// Microseconds encoding tensors.
    pub encode_us: u64,
    /// Frame bytes into forward and backward calls.
    pub stage_in: u64,
    /// Frame bytes out of them.
    pub stage_out: u64,
    /// Frame bytes of averaging messages received.
    pub avg_in: u64,
    /// Frame bytes of state chunks sent.
    pub state_out: u64,
}

impl std::fmt::Display for CounterSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |us: u64| us as f64 / 1e3;
        let mb = |b: u64| b as f64 / 1e6;
        write!(
            f,
            "replica counters: jobs {} compute_ms {:.1} queue_ms {:.1} read_ms {:.1} write_ms {:.1} decode_ms {:.1} encode_ms {:.1} stage_in_mb {:.2} stage_out_mb {:.2} avg_in_mb {:.2} state_out_mb {:.2} refused {} dropped {}",
            self.jobs,
            ms(self.compute_us),
            ms(self.queue_us),
            ms(self.read_us),
            ms(self.write_us),
            ms(self.decode_us),
            ms(self.encode_us),
            mb(self.stage_in),
            mb(self.stage_out),
            mb(self.avg_in),
            mb(self.state_out),
            self.refused,
            self.dropped,
        )
    }
}

/// What a replica reports about its training state (cached for the async side).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplicaStatus {
    /// Applied optimizer steps.
    pub params_step: u64,
    /// The step backward passes accumulate toward.
    pub accum_step: u64,
    /// Samples accumulated toward it.
    pub accum_count: u64,
    /// Samples frozen for a round in progress.
    pub frozen_count: u64,
    /// Samples of synchronous microbatches owed toward `accum_step` (forward run, backward
    /// not yet come).
    pub owed_count: u64,
    /// Samples in every applied step.
    pub samples_applied: u64,
    /// Samples lost with dead replicas.
    pub samples_lost: u64,
    /// Samples dropped when this replica replaced its state.
    pub samples_dropped: u64,
    /// Parameter hash (hex).
    pub params_hash: String,
    /// The hash the stage's replicas agree on at a step (see `Replica::shared_hash`).
    pub shared_hash: String,
    /// Kept forwards recomputed because their gradient would have been two steps stale.
    pub stale_recomputed: u64,
    /// The largest staleness of an accumulated gradient (0 or 1, by construction).
    pub max_staleness: u64,
}

impl ReplicaStatus {
    /// Reads the status of a replica.
    pub fn of(r: &Replica) -> Self {
        Self {
            params_step: r.params_step(),
            accum_step: r.accum_step(),
            accum_count: r.accum_count(),
            frozen_count: r.frozen_count(),
            owed_count: r.owed_count(),
            samples_applied: r.samples_applied(),
            samples_lost: r.samples_lost(),
            samples_dropped: r.samples_dropped(),
            params_hash: r.params_hash().to_string(),
            shared_hash: r.shared_hash().to_string(),
            stale_recomputed: r.staleness().0,
            max_staleness: r.staleness().1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_copies_every_counter_and_round_trips_as_json() {
        let c = Counters::default();
        c.jobs.store(10, Ordering::Relaxed);
        c.compute_us.store(200_000, Ordering::Relaxed);
        c.queue_us.store(50_000, Ordering::Relaxed);
        c.decode_us.store(1_000, Ordering::Relaxed);
        c.encode_us.store(2_000, Ordering::Relaxed);
        c.stage_in.store(1_500_000, Ordering::Relaxed);
        c.state_out.store(7, Ordering::Relaxed);
        let s = c.snapshot();
        assert_eq!(
            (s.jobs, s.compute_us, s.queue_us, s.decode_us, s.encode_us),
            (10, 200_000, 50_000, 1_000, 2_000)
        );
        assert_eq!((s.stage_in, s.state_out), (1_500_000, 7));
        let back: CounterSnapshot =
            serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
        assert!(s.to_string().contains("compute_ms 200.0"), "{s}");
    }
}
