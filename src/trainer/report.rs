//! The progress of trainer loops: their totals as one value, which a process reports in
//! its JSON status stream (`--events`) and shows as one line (its `Display`).

use super::TrainerStats;
use serde::{Deserialize, Serialize};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// Totals over some trainer loops.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// Step of the slowest stage, as seen by the most advanced trainer.
    pub step: u64,
    /// Mean recent loss (NaN before the first microbatch completes; `null` in JSON).
    #[serde(with = "nan_as_null")]
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
    /// Synchronous microbatches started again because their step closed on the way.
    #[serde(default)]
    pub restarts: u64,
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
            restarts: stats.iter().map(|s| s.restarts.load(Relaxed)).sum(),
        }
    }

    /// Sums the progress of several processes' trainers: steps are the most advanced,
    /// losses the mean of those known, counts the sums.
    pub fn sum(ps: &[Progress]) -> Progress {
        let losses: Vec<f64> = ps
            .iter()
            .map(|p| p.loss)
            .filter(|l| l.is_finite())
            .collect();
        Progress {
            step: ps.iter().map(|p| p.step).max().unwrap_or(0),
            loss: if losses.is_empty() {
                f64::NAN
            } else {
                losses.iter().sum::<f64>() / losses.len() as f64
            },
            fed: ps.iter().map(|p| p.fed).sum(),
            completed: ps.iter().map(|p| p.completed).sum(),
            failed: ps.iter().map(|p| p.failed).sum(),
            wire: ps.iter().map(|p| p.wire).sum(),
            raw: ps.iter().map(|p| p.raw).sum(),
            swaps: ps.iter().map(|p| p.swaps).sum(),
            restarts: ps.iter().map(|p| p.restarts).sum(),
        }
    }
}

impl std::fmt::Display for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
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
}

/// JSON has no NaN: a float that is not known yet travels as `null`.
pub(crate) mod nan_as_null {
    use serde::{Deserialize, Deserializer, Serializer};

    /// NaN and infinities as `null`.
    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_finite() {
            s.serialize_f64(*v)
        } else {
            s.serialize_none()
        }
    }

    /// `null` as NaN.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_round_trips_and_an_unknown_loss_is_null() {
        let p = Progress {
            step: 3,
            loss: 1.25,
            fed: 64,
            completed: 48,
            failed: 16,
            wire: 1000,
            raw: 4000,
            swaps: 2,
            restarts: 1,
        };
        let back: Progress = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
        let empty = Progress {
            loss: f64::NAN,
            ..Progress::default()
        };
        let text = serde_json::to_string(&empty).unwrap();
        assert!(text.contains("\"loss\":null"), "{text}");
        let back: Progress = serde_json::from_str(&text).unwrap();
        assert!(back.loss.is_nan());
        assert!(p.to_string().starts_with("trainers: step 3 loss 1.2500"));
    }

    #[test]
    fn sums_counts_and_averages_known_losses() {
        let a = Progress {
            step: 4,
            loss: 2.0,
            fed: 10,
            completed: 8,
            ..Progress::default()
        };
        let b = Progress {
            step: 6,
            loss: f64::NAN,
            fed: 5,
            completed: 5,
            ..Progress::default()
        };
        let c = Progress {
            step: 5,
            loss: 3.0,
            ..Progress::default()
        };
        let s = Progress::sum(&[a, b, c]);
        assert_eq!((s.step, s.fed, s.completed), (6, 15, 13));
        assert_eq!(s.loss, 2.5);
        assert!(Progress::sum(&[]).loss.is_nan());
    }
}
