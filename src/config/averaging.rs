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

/// What the replicas of a stage average (`averaging.mode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AveragingMode {
    /// Every step's gradients (the replicas stay identical after every step).
    #[default]
    Step,
    /// Local steps and outer steps (DiLoCo/SparseLoCo): each replica applies its own
    /// gradients with the inner optimizer, and every `outer_every` steps the replicas
    /// average their compressed pseudo-gradients (the outer parameters minus their own)
    /// and take one outer Nesterov step, after which they are identical again.
    Outer,
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
    /// `step` (default) or `outer`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<AveragingMode>,
    /// Outer mode: steps between outer steps (default 16).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outer_every: Option<u64>,
    /// Outer mode: the outer learning rate (default 1 for a sparse pseudo-gradient, 0.7
    /// for a whole one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outer_lr: Option<f64>,
    /// Outer mode: the outer Nesterov momentum (default 0 for a sparse pseudo-gradient,
    /// whose error feedback already carries the past, as SparseLoCo; 0.9 for a whole one,
    /// as DiLoCo).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outer_momentum: Option<f64>,
    /// Outer mode: the fraction of each chunk of the pseudo-gradient sent (its largest
    /// values; the rest is carried to the next outer step by error feedback). 1 sends it
    /// whole. Default 0.1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outer_density: Option<f64>,
    /// Outer mode: how much of what earlier pseudo-gradients left unsent the next one
    /// carries (error feedback's decay, default 0.95 as SparseLoCo's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outer_error_decay: Option<f64>,
    /// Outer mode: the codec of the pseudo-gradient's values (default `int4+zstd1`: error
    /// feedback carries what the coarse codes miss).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outer_codec: Option<crate::wire::CodecSpec>,
}

impl AveragingConfig {
    /// CenteredClip's radius by default.
    pub const CLIP_TAU: f64 = 1.0;
    /// CenteredClip's iterations by default.
    pub const CLIP_ITERS: u32 = 10;
    /// The norm check's ratio by default.
    pub const MAX_NORM_RATIO: f64 = 50.0;
    /// Steps between outer steps by default.
    pub const OUTER_EVERY: u64 = 16;
    /// The outer learning rate by default: (sparse, whole) pseudo-gradients.
    pub const OUTER_LR: (f64, f64) = (1.0, 0.7);
    /// The outer momentum by default: (sparse, whole) pseudo-gradients.
    pub const OUTER_MOMENTUM: (f64, f64) = (0.0, 0.9);
    /// The pseudo-gradient's density by default.
    pub const OUTER_DENSITY: f64 = 0.1;
    /// The error feedback's decay by default.
    pub const OUTER_ERROR_DECAY: f64 = 0.95;
    /// The pseudo-gradient's codec by default: int4 (blocks of 64), then zstd level 1.
    pub const OUTER_CODEC: crate::wire::CodecSpec = crate::wire::CodecSpec {
        quant: crate::wire::Quant::Int4,
        block_size: crate::wire::codec::DEFAULT_BLOCK,
        zstd_level: 1,
        ids_last: false,
    };

    /// The outer-step settings when the mode is `outer`.
    pub fn outer(&self) -> Option<OuterSettings> {
        let density = self.outer_density.unwrap_or(Self::OUTER_DENSITY);
        let pick = |(sparse, whole): (f64, f64)| if density < 1.0 { sparse } else { whole };
        (self.mode == Some(AveragingMode::Outer)).then(|| OuterSettings {
            every: self.outer_every.unwrap_or(Self::OUTER_EVERY),
            lr: self.outer_lr.unwrap_or(pick(Self::OUTER_LR)) as f32,
            momentum: self.outer_momentum.unwrap_or(pick(Self::OUTER_MOMENTUM)) as f32,
            density,
            codec: self.outer_codec.unwrap_or(Self::OUTER_CODEC),
            error_decay: self.outer_error_decay.unwrap_or(Self::OUTER_ERROR_DECAY) as f32,
        })
    }

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
        )?;
        knob(
            "outer_every",
            self.outer_every,
            |h| (1..=100_000).contains(&h),
            "in 1..=100000",
        )?;
        knob(
            "outer_lr",
            self.outer_lr,
            |l| l.is_finite() && l > 0.0 && l <= 10.0,
            "in (0, 10]",
        )?;
        knob(
            "outer_momentum",
            self.outer_momentum,
            |m| m.is_finite() && (0.0..1.0).contains(&m),
            "in [0, 1)",
        )?;
        knob(
            "outer_error_decay",
            self.outer_error_decay,
            |d| d.is_finite() && (0.0..=1.0).contains(&d),
            "in [0, 1]",
        )?;
        knob(
            "outer_density",
            self.outer_density,
            |d| d.is_finite() && d > 0.0 && d <= 1.0,
            "in (0, 1]",
        )?;
        let outer_knob = [
            ("outer_every", self.outer_every.is_some()),
            ("outer_lr", self.outer_lr.is_some()),
            ("outer_momentum", self.outer_momentum.is_some()),
            ("outer_density", self.outer_density.is_some()),
            ("outer_codec", self.outer_codec.is_some()),
            ("outer_error_decay", self.outer_error_decay.is_some()),
        ]
        .into_iter()
        .find(|(_, set)| *set);
        match (self.mode.unwrap_or_default(), outer_knob) {
            (AveragingMode::Step, Some((name, _))) => Err(format!(
                "averaging.{name} applies to mode = \"outer\" only (set averaging.mode = \"outer\" or remove it)"
            )),
            (AveragingMode::Outer, _) if self.aggregate == Some(AggregateKind::CenteredClip) => {
                Err("averaging.aggregate = \"centered_clip\" is not supported with mode = \"outer\" (the outer step averages the replicas' pseudo-gradients)".into())
            }
            _ => Ok(()),
        }
    }
}

/// The outer-step knobs of a run in `outer` mode, defaults filled in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OuterSettings {
    /// Steps between outer steps.
    pub every: u64,
    /// Outer learning rate.
    pub lr: f32,
    /// Outer Nesterov momentum.
    pub momentum: f32,
    /// Fraction of each pseudo-gradient chunk sent.
    pub density: f64,
    /// Codec of the values sent.
    pub codec: crate::wire::CodecSpec,
    /// Error feedback's decay.
    pub error_decay: f32,
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
