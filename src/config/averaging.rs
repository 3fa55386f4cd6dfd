//! The run config's `[averaging]` table: round timing, state chunks, and how a stage's
//! replicas aggregate and check the gradients they exchange. Every knob is optional, and
//! absent knobs stay out of the canonical text (so they do not change the run id).

use serde::{Deserialize, Serialize};

/// How the reducer of a part combines the members' gradients (`averaging.aggregate`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AggregateKind {
    /// The mean over every sample (exact; one bad replica can move it anywhere).
    #[default]
    Mean,
    /// CenteredClip over the members' mean gradients: robust to a minority of replicas
    /// sending garbage, at the cost of keeping every member's copy of a chunk while it is
    /// reduced.
    CenteredClip,
}

/// How the replicas of a stage average. Every knob is optional: the defaults scale with
/// the stage (see `AveragerConfig::for_run` in the averaging layer).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AveragingConfig {
    /// Seconds a round attempt may take before it is abandoned and retried (default: 5,
    /// or four times the time the stage's gradient parts take over a 100 Mbit/s link).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub round_timeout_s: Option<f64>,
    /// Milliseconds between progress heartbeats (default 300); a replica silent for ten
    /// heartbeats is taken for dead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_ms: Option<u64>,
    /// Floats per chunk of a state download (default 262144, 1 MiB). Smaller chunks mean
    /// more calls; tests use them to make many chunks of a small state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_chunk_floats: Option<usize>,
    /// `mean` (default) or `centered_clip`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aggregate: Option<AggregateKind>,
    /// CenteredClip's radius, as a multiple of the median distance of the members' mean
    /// gradients from their coordinate-wise median (default 1.0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_tau: Option<f64>,
    /// CenteredClip's iterations (default 10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_iters: Option<u32>,
    /// A member's gradient chunk whose norm (per sample) exceeds this multiple of the
    /// median of the chunk's recent norms is rejected (default 50, as honest chunks of a
    /// small step reach 10×; 0 turns the check off).
    /// Chunks holding NaN or ±inf are always rejected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_norm_ratio: Option<f64>,
}

impl AveragingConfig {
    /// CenteredClip's radius by default.
    pub const CLIP_TAU: f64 = 1.0;
    /// CenteredClip's iterations by default.
    pub const CLIP_ITERS: u32 = 10;
    /// The norm check's ratio by default.
    pub const MAX_NORM_RATIO: f64 = 50.0;

    pub(super) fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// Checks the knobs' ranges; the error names the knob.
    pub(super) fn validate(&self) -> Result<(), String> {
        knob(
            "round_timeout_s",
            self.round_timeout_s,
            |t| t.is_finite() && t > 0.0 && t <= 86_400.0,
            "in (0, 86400] seconds",
        )?;
        knob(
            "state_chunk_floats",
            self.state_chunk_floats,
            |c| (1..=(16 << 20)).contains(&c),
            "in 1..=16777216",
        )?;
        knob(
            "heartbeat_ms",
            self.heartbeat_ms,
            |h| (10..=60_000).contains(&h),
            "in 10..=60000",
        )?;
        knob(
            "clip_tau",
            self.clip_tau,
            |t| t.is_finite() && t > 0.0 && t <= 1000.0,
            "in (0, 1000]",
        )?;
        knob(
            "clip_iters",
            self.clip_iters,
            |i| (1..=1000).contains(&i),
            "in 1..=1000",
        )?;
        knob(
            "max_norm_ratio",
            self.max_norm_ratio,
            |r| r == 0.0 || (r.is_finite() && r >= 1.0),
            "0 (off) or at least 1",
        )
    }
}

/// `Err("averaging.NAME must be WANT, got V")` when the knob is set and `ok` refuses it.
fn knob<T: Copy + std::fmt::Display>(
    name: &str,
    value: Option<T>,
    ok: impl Fn(T) -> bool,
    want: &str,
) -> Result<(), String> {
    match value {
        Some(v) if !ok(v) => Err(format!("averaging.{name} must be {want}, got {v}")),
        _ => Ok(()),
    }
}
