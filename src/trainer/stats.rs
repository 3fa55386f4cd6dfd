//! What a trainer loop counts: samples fed, completed and failed (with reasons), losses,
//! swaps, and the steps its replicas reported. Read by [`super::report::Progress`].

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

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
    /// (step, loss) of every completed microbatch.
    pub losses: Mutex<Vec<(u64, f32)>>,
    /// The highest step a replica reported.
    pub step: AtomicU64,
    /// Per stage: the highest step its replicas reported.
    pub stage_steps: Vec<AtomicU64>,
    /// Calls repeated on another replica.
    pub swaps: AtomicU64,
    /// Why calls were repeated elsewhere: error kind → count.
    pub swap_reasons: Mutex<BTreeMap<String, u64>>,
}

impl TrainerStats {
    pub(crate) fn new(stages: usize) -> Self {
        Self {
            fed: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            failures: Mutex::new(BTreeMap::new()),
            stage_backward: (0..stages).map(|_| AtomicU64::new(0)).collect(),
            losses: Mutex::new(Vec::new()),
            step: AtomicU64::new(0),
            stage_steps: (0..stages).map(|_| AtomicU64::new(0)).collect(),
            swaps: AtomicU64::new(0),
            swap_reasons: Mutex::new(BTreeMap::new()),
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
        let l = self.losses.lock().ok()?;
        if l.is_empty() {
            return None;
        }
        let tail = &l[l.len().saturating_sub(n)..];
        Some(tail.iter().map(|(_, x)| *x as f64).sum::<f64>() / tail.len() as f64)
    }
}
