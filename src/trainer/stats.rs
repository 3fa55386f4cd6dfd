//! What a trainer loop counts: samples fed, completed and failed (with reasons), losses,
//! swaps, and the steps its replicas reported. Read by [`super::report::Progress`].

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// What a trainer counted.
#[derive(Debug)]
pub struct TrainerStats {
    /// Samples started.
    pub fed: AtomicU64,
    /// Samples whose backward reached stage 0.
    pub completed: AtomicU64,
    /// Samples of microbatches that failed.
    pub failed: AtomicU64,
    /// Failed samples per reason.
    pub failures: Mutex<BTreeMap<String, u64>>,
    /// Per stage: samples whose backward a replica accepted.
    pub stage_backward: Vec<AtomicU64>,
    /// (step, loss) of the last [`LOSSES_KEPT`] completed microbatches, oldest first.
    pub losses: Mutex<std::collections::VecDeque<(u64, f32)>>,
    /// The highest step a replica reported.
    pub step: AtomicU64,
    /// Per stage: the highest step its replicas reported.
    pub stage_steps: Vec<AtomicU64>,
    /// Per stage: the replicas announced at the latest refresh (those the trainer uses).
    pub stage_replicas: Vec<AtomicU64>,
    /// Calls repeated on another replica.
    pub swaps: AtomicU64,
    /// Why calls were repeated elsewhere: error kind → count.
    pub swap_reasons: Mutex<BTreeMap<String, u64>>,
    /// Synchronous microbatches started again because their step closed on the way.
    pub restarts: AtomicU64,
}

/// Losses a trainer loop keeps.
pub const LOSSES_KEPT: usize = 4096;
/// Distinct failure or swap reasons kept.
pub const REASONS_KEPT: usize = 64;
/// Characters of a reason kept.
pub const REASON_LEN: usize = 200;

impl TrainerStats {
    pub(crate) fn new(stages: usize) -> Self {
        Self {
            fed: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            failures: Mutex::new(BTreeMap::new()),
            stage_backward: (0..stages).map(|_| AtomicU64::new(0)).collect(),
            losses: Mutex::new(std::collections::VecDeque::new()),
            step: AtomicU64::new(0),
            stage_steps: (0..stages).map(|_| AtomicU64::new(0)).collect(),
            stage_replicas: (0..stages).map(|_| AtomicU64::new(0)).collect(),
            swaps: AtomicU64::new(0),
            swap_reasons: Mutex::new(BTreeMap::new()),
            restarts: AtomicU64::new(0),
        }
    }

    /// The step of the slowest stage: the run is done when it reaches the last step.
    pub fn min_stage_step(&self) -> u64 {
        self.stage_steps
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
            .min()
            .unwrap_or(0)
    }

    /// Mean loss of the last `n` completed microbatches.
    pub fn recent_loss(&self, n: usize) -> Option<f64> {
        let l = self.losses.lock();
        if l.is_empty() {
            return None;
        }
        let k = n.clamp(1, l.len());
        Some(l.iter().rev().take(k).map(|(_, x)| *x as f64).sum::<f64>() / k as f64)
    }

    /// Records a completed microbatch's loss, forgetting the oldest past [`LOSSES_KEPT`].
    pub fn record_loss(&self, step: u64, loss: f32) {
        {
            let mut l = self.losses.lock();
            l.push_back((step, loss));
            while l.len() > LOSSES_KEPT {
                l.pop_front();
            }
        }
    }

    /// Adds `n` to `reason`'s count in `map`, a reason cut to [`REASON_LEN`] bytes; past
    /// [`REASONS_KEPT`] distinct reasons (a remote peer writes part of them) the rest are
    /// counted as "other".
    pub fn bump(map: &Mutex<BTreeMap<String, u64>>, reason: &str, n: u64) {
        let mut m = map.lock();
        let mut key: String = reason.chars().take(REASON_LEN).collect();
        if !m.contains_key(&key) && m.len() >= REASONS_KEPT {
            key = "other".into();
        }
        *m.entry(key).or_default() += n;
    }
}
