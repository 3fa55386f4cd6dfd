//! The one-line progress report of trainer loops, printed by `shoal train` and parsed by
//! the demo. Format (space separated `key value` pairs after `trainers:`):
//! `trainers: step S loss L fed F completed C failed X wire W raw R swaps N`.

use super::TrainerStats;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// Totals over some trainer loops.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Progress {
    /// Step of the slowest stage, as seen by the most advanced trainer.
    pub step: u64,
    /// Mean recent loss (NaN before the first microbatch completes).
    pub loss: f64,
    /// Samples started.
    pub fed: u64,
    /// Samples completed.
    pub completed: u64,
    /// Samples failed.
    pub failed: u64,
    /// Frame bytes sent and received by the trainers.
    pub wire: u64,
    /// The same tensors as f32.
    pub raw: u64,
    /// Calls repeated on another replica after one failed or refused.
    pub swaps: u64,
}

impl Progress {
    /// Sums loops; `bytes` is (wire, raw) of their clients.
    pub fn of(stats: &[Arc<TrainerStats>], bytes: (u64, u64)) -> Self {
        let losses: Vec<f64> = stats.iter().filter_map(|s| s.recent_loss(8)).collect();
        Self {
            step: stats.iter().map(|s| s.min_stage_step()).max().unwrap_or(0),
            loss: if losses.is_empty() {
                f64::NAN
            } else {
                losses.iter().sum::<f64>() / losses.len() as f64
            },
            fed: stats.iter().map(|s| s.fed.load(Relaxed)).sum(),
            completed: stats.iter().map(|s| s.completed.load(Relaxed)).sum(),
            failed: stats.iter().map(|s| s.failed.load(Relaxed)).sum(),
            wire: bytes.0,
            raw: bytes.1,
            swaps: stats.iter().map(|s| s.swaps.load(Relaxed)).sum(),
        }
    }

    /// The printed line.
    pub fn line(&self) -> String {
        format!(
            "trainers: step {} loss {:.4} fed {} completed {} failed {} wire {} raw {} swaps {}",
            self.step,
            self.loss,
            self.fed,
            self.completed,
            self.failed,
            self.wire,
            self.raw,
            self.swaps
        )
    }

    /// Parses a printed line.
    pub fn parse(line: &str) -> Option<Self> {
        let rest = line.trim().strip_prefix("trainers:")?;
        let words: Vec<&str> = rest.split_whitespace().collect();
        let get = |k: &str| -> Option<&str> {
            words
                .iter()
                .position(|w| *w == k)
                .and_then(|i| words.get(i + 1).copied())
        };
        Some(Self {
            step: get("step")?.parse().ok()?,
            loss: get("loss")?.parse().ok()?,
            fed: get("fed")?.parse().ok()?,
            completed: get("completed")?.parse().ok()?,
            failed: get("failed")?.parse().ok()?,
            wire: get("wire")?.parse().ok()?,
            raw: get("raw")?.parse().ok()?,
            swaps: get("swaps").and_then(|v| v.parse().ok()).unwrap_or(0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_round_trips() {
        let p = Progress {
            step: 3,
            loss: 1.25,
            fed: 64,
            completed: 48,
            failed: 16,
            wire: 1000,
            raw: 4000,
            swaps: 2,
        };
        assert_eq!(Progress::parse(&p.line()), Some(p));
        assert_eq!(Progress::parse("step 3"), None);
    }
}
