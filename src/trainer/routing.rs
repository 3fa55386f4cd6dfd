//! Stochastic wiring: which replica of a stage gets the next microbatch.
//!
//! Pure: a function of the replicas' state, the time and a random draw. Each replica's
//! expected finish time for `work` samples is (requests ahead of ours + 1) × work over its
//! throughput (ahead: its queue, our calls in flight to it, and the backwards we owe it),
//! where throughput blends what this trainer measured with what the replica announced, and the queue is the one the replica reported in its latest answer (else its
//! announcement). A replica is drawn with probability ∝ 1 / finish⁴, which sends most work
//! to the fastest-finishing replica but keeps every live one in use, so load spreads and
//! fresh measurements keep coming (the spirit of SWARM's interleaved weighted round
//! robin). The power sets how evenly finish times end up: with 1/finish^k a replica 4×
//! slower settles where its finish time is 4^(1/k) times the fast one's, so k = 2 let a
//! slow replica's queue hold twice the wait of a fast one's, and k = 4 holds it to 1.4×.

use crate::rng::Rng;
use std::time::Instant;

/// What a trainer knows about one replica.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaState {
    /// Announced samples/s.
    pub announced: f64,
    /// Samples/s this trainer measured (EWMA), if any.
    pub measured: Option<f64>,
    /// Announced queue length.
    pub queue: u32,
    /// This trainer's calls in flight to it.
    pub in_flight: u32,
    /// Backward passes this trainer still owes it: microbatches whose forward it ran
    /// and whose backward will come back to it. Without them a replica looks free while
    /// the backwards of the forwards it already took are still on their way (up to a
    /// whole pipeline's worth with many microbatches in flight), and a slow replica is
    /// handed more forwards than it can keep up with.
    pub owed: u32,
    /// Not used before this instant (after a failure).
    pub banned_until: Option<Instant>,
}

impl ReplicaState {
    /// A replica known only by its announcement.
    pub fn announced(samples_per_s: f64, queue: u32) -> Self {
        Self {
            announced: samples_per_s,
            measured: None,
            queue,
            in_flight: 0,
            owed: 0,
            banned_until: None,
        }
    }

    /// The throughput used for planning.
    pub fn throughput(&self) -> f64 {
        let a = self.announced.max(1e-3);
        match self.measured {
            Some(m) => 0.5 * m.max(1e-3) + 0.5 * a,
            None => a,
        }
    }

    /// Seconds until `work` samples sent now would be done.
    pub fn expected_finish(&self, work: f64) -> f64 {
        let ahead = self.queue as f64 + self.in_flight as f64 + self.owed as f64;
        (ahead + 1.0) * work / self.throughput()
    }

    /// Whether it may be used at `now`.
    pub fn usable(&self, now: Instant) -> bool {
        self.banned_until.is_none_or(|t| now >= t)
    }

    /// Folds one measured call (samples over seconds) into the EWMA.
    pub fn observe(&mut self, samples: f64, seconds: f64) {
        let s = samples / seconds.max(1e-6);
        self.measured = Some(match self.measured {
            Some(m) => 0.7 * m + 0.3 * s,
            None => s,
        });
    }
}

/// How a trainer spreads microbatches over a stage's replicas.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Routing {
    /// Stochastic wiring ([`choose`]): by expected finish time.
    #[default]
    Wiring,
    /// Fixed round-robin over the usable replicas, blind to speed (a baseline for
    /// `shoal bench swarm`).
    RoundRobin,
}

impl std::str::FromStr for Routing {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "wiring" => Ok(Self::Wiring),
            "round-robin" => Ok(Self::RoundRobin),
            other => Err(format!(
                "routing must be `wiring` or `round-robin`, not {other:?}"
            )),
        }
    }
}

/// The `turn`-th usable replica in rotation; `None` when none is usable.
pub fn round_robin(replicas: &[ReplicaState], now: Instant, turn: usize) -> Option<usize> {
    let usable: Vec<usize> = (0..replicas.len())
        .filter(|&i| replicas[i].usable(now))
        .collect();
    if usable.is_empty() {
        return None;
    }
    Some(usable[turn % usable.len()])
}

/// Picks a replica for `work` samples; `None` when none is usable.
pub fn choose(replicas: &[ReplicaState], work: f64, now: Instant, rng: &mut Rng) -> Option<usize> {
    let weights: Vec<f64> = replicas
        .iter()
        .map(|r| {
            if r.usable(now) {
                let t = r.expected_finish(work);
                1.0 / (t * t * t * t).max(1e-30)
            } else {
                0.0
            }
        })
        .collect();
    let total: f64 = weights.iter().sum();
    if total <= 0.0 {
        return None;
    }
    let mut x = rng.next_f64() * total;
    for (i, w) in weights.iter().enumerate() {
        if *w > 0.0 && x < *w {
            return Some(i);
        }
        x -= w;
    }
    weights.iter().rposition(|w| *w > 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn round_robin_rotates_over_usable_replicas_only() {
        let now = Instant::now();
        let mut rs = vec![ReplicaState::announced(1.0, 0); 3];
        rs[1].banned_until = Some(now + Duration::from_secs(5));
        let picks: Vec<_> = (0..4).map(|t| round_robin(&rs, now, t)).collect();
        assert_eq!(picks, [Some(0), Some(2), Some(0), Some(2)]);
        for r in &mut rs {
            r.banned_until = Some(now + Duration::from_secs(5));
        }
        assert_eq!(round_robin(&rs, now, 0), None);
        assert_eq!("round-robin".parse::<Routing>(), Ok(Routing::RoundRobin));
        assert!("fastest".parse::<Routing>().is_err());
    }

    #[test]
    fn faster_and_less_loaded_replicas_get_more_work_but_all_get_some() {
        let now = Instant::now();
        let reps = vec![
            ReplicaState::announced(100.0, 0),
            ReplicaState::announced(200.0, 0),
            ReplicaState::announced(200.0, 3),
        ];
        let mut rng = Rng::new(1);
        let mut hits = [0usize; 3];
        for _ in 0..10_000 {
            hits[choose(&reps, 16.0, now, &mut rng).unwrap()] += 1;
        }
        assert!(hits[1] > hits[0] && hits[0] > hits[2], "{hits:?}");
        assert!(hits.iter().all(|&h| h > 0), "{hits:?}");
    }

    #[test]
    fn banned_replicas_are_skipped_until_their_ban_ends() {
        let now = Instant::now();
        let mut reps = vec![ReplicaState::announced(100.0, 0); 2];
        reps[0].banned_until = Some(now + Duration::from_secs(5));
        let mut rng = Rng::new(2);
        for _ in 0..100 {
            assert_eq!(choose(&reps, 1.0, now, &mut rng), Some(1));
        }
        reps[1].banned_until = Some(now + Duration::from_secs(5));
        assert_eq!(choose(&reps, 1.0, now, &mut rng), None);
        assert!(choose(&reps, 1.0, now + Duration::from_secs(6), &mut rng).is_some());
    }

    #[test]
    fn backwards_owed_count_as_work_ahead() {
        let now = Instant::now();
        let mut reps = vec![ReplicaState::announced(100.0, 0); 2];
        reps[0].owed = 6;
        assert!(reps[0].expected_finish(16.0) > 6.0 * reps[1].expected_finish(16.0));
        let mut rng = Rng::new(3);
        let owed_picks = (0..2_000)
            .filter(|_| choose(&reps, 16.0, now, &mut rng) == Some(0))
            .count();
        assert!(
            owed_picks < 20,
            "{owed_picks} of 2000 picks went to the owed replica"
        );
    }

    #[test]
    fn measurements_move_the_estimate() {
        let mut r = ReplicaState::announced(100.0, 0);
        r.observe(10.0, 1.0);
        assert!(r.throughput() < 100.0);
        assert!(r.expected_finish(10.0) > ReplicaState::announced(100.0, 0).expected_finish(10.0));
    }
}
