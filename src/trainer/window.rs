//! How many microbatches a trainer keeps in flight right now ([`Window`]): at most its
//! `--concurrency`, fewer while the replicas it knows refuse work as `overloaded`.
//!
//! Why: microbatches beyond what the replicas can take only wait in their queues (each
//! hop then waits a whole queue) or are refused, sent again elsewhere and refused again,
//! each refusal a stream and a round trip on busy links. When 200 peers joined at once,
//! 20 trainers that each knew one or two replicas per stage sent those few their 27
//! microbatches each: every queue full, ~60 s from a microbatch's first forward to its last
//! backward, no sample finished for the swarm's first 40 s, and 5,000 calls were refused
//! in 90 s. The window is TCP's: one more per microbatch finished, a quarter less on an
//! `overloaded` refusal (at most once per [`CUT_EVERY`], so that a burst of refusals of
//! calls sent together counts once).

use parking_lot::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The window shrinks at most this often.
const CUT_EVERY: Duration = Duration::from_secs(1);

/// The trainer's window of microbatches in flight.
#[derive(Debug)]
pub(super) struct Window {
    limit: AtomicUsize,
    min: usize,
    max: usize,
    last_cut: Mutex<Option<Instant>>,
}

impl Window {
    /// A window between `min` and `max` (`min` is raised to `max` if above it), open to
    /// `max` at first.
    pub(super) fn new(min: usize, max: usize) -> Self {
        let max = max.max(1);
        Self {
            limit: AtomicUsize::new(max),
            min: min.clamp(1, max),
            max,
            last_cut: Mutex::new(None),
        }
    }

    /// A trainer's window: up to [`in_flight`]; with synchronous steps it stays open (the
    /// replicas hold microbatches for their step and refuse none for being busy).
    pub(super) fn of(
        cfg: &super::TrainerConfig,
        stages: usize,
        run: &crate::config::RunConfig,
    ) -> Self {
        let most = in_flight(
            cfg,
            stages,
            run.training.batch_size,
            run.target_batch_size(),
        );
        let fewest = if cfg.sync_steps && stages > 1 {
            most
        } else {
            stages
        };
        Self::new(fewest, most)
    }

    /// The most microbatches ever in flight ([`in_flight`] for a trainer).
    pub(super) fn most(&self) -> usize {
        self.max
    }

    /// Microbatches that may be in flight now.
    pub(super) fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    /// A microbatch finished: one more may be in flight.
    pub(super) fn finished(&self) {
        let _ = self
            .limit
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| {
                Some((l + 1).min(self.max))
            });
    }

    /// A replica refused a call as `overloaded`: a quarter fewer in flight, unless the
    /// window was cut less than [`CUT_EVERY`] ago.
    pub(super) fn overloaded(&self, now: Instant) {
        let mut last = self.last_cut.lock();
        if last.is_some_and(|t| now.saturating_duration_since(t) < CUT_EVERY) {
            return;
        }
        *last = Some(now);
        let _ = self
            .limit
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| {
                Some((l - l / 4).max(self.min))
            });
    }
}

/// Microbatches a trainer keeps in flight: `--concurrency`, and with synchronous steps in a
/// pipeline at least one per stage and a step's worth (`target` samples in microbatches of
/// `batch`), so that every stage has work and the next step's microbatches wait at stage 0
/// while the current step's round runs. (Without synchronous steps more in flight made
/// steps larger and fewer, not training faster: `shoal bench converge`, stop 34.)
fn in_flight(cfg: &super::TrainerConfig, stages: usize, batch: usize, target: usize) -> usize {
    let c = cfg.concurrency.max(1);
    if cfg.sync_steps && stages > 1 {
        c.max(stages).max(target.div_ceil(batch.max(1)))
    } else {
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_shrinks_on_refusals_and_grows_with_finished_work() {
        let w = Window::new(4, 24);
        let t0 = Instant::now();
        // Open at first.
        assert_eq!(w.limit(), 24);
        // A refusal cuts a quarter; more refusals within a second do not cut again.
        w.overloaded(t0);
        assert_eq!(w.limit(), 18);
        w.overloaded(t0 + Duration::from_millis(500));
        assert_eq!(w.limit(), 18);
        // Later refusals cut again, down to the floor and no further.
        for i in 1..20 {
            w.overloaded(t0 + Duration::from_secs(i));
        }
        assert_eq!(w.limit(), 4);
        // Finished microbatches open it one by one, up to the most.
        for _ in 0..3 {
            w.finished();
        }
        assert_eq!(w.limit(), 7);
        for _ in 0..100 {
            w.finished();
        }
        assert_eq!(w.limit(), 24);
        // A floor above the most is the most.
        assert_eq!(Window::new(8, 2).limit(), 2);
    }
}
