//! The decoder (GPT or Llama blocks), cut into pipeline stages, with its optimizer and checkpoints.
//!
//! Owns the math: layers ([`layers`]), deterministic parameters ([`params`]), one stage's
//! forward and backward ([`stage`]), AdamW ([`optim`]), safetensors checkpoints
//! ([`checkpoint`]), the exported model ([`export`]) and sampling from it ([`generate`]);
//! a residual stream kept in a low-rank subspace for small stage boundaries ([`subspace`]).
//! Knows nothing of the network or of where inputs come from.

pub mod checkpoint;
pub mod export;
pub mod fused;
pub mod generate;
pub mod layers;
pub mod llama;
pub mod optim;
pub mod params;
pub mod stage;
pub mod subspace;

pub use optim::{lr_at, AdamW, StepStats};
pub use params::ParamSet;
pub use stage::{Stage, StageGrads, Upstream};

use crate::config::RunConfig;
use candle_core::Device;

/// Why a model operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// candle refused an operation.
    #[error("tensor op failed: {0}")]
    Candle(#[from] candle_core::Error),
    /// An input of the wrong dtype, shape or range.
    #[error("bad input: {0}")]
    BadInput(String),
    /// A checkpoint could not be written or read.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
}

/// Every stage of a run, built in order.
pub fn build_stages(cfg: &RunConfig, device: &Device) -> Result<Vec<Stage>, ModelError> {
    (0..cfg.stages.count)
        .map(|i| Stage::new(cfg, i, device))
        .collect()
}

/// Parses `cpu`, `cuda[:N]` or `metal[:N]` into a candle device.
pub fn parse_device(name: &str) -> Result<Device, String> {
    let (kind, ordinal) = match name.split_once(':') {
        Some((k, n)) => (
            k,
            n.parse::<usize>()
                .map_err(|_| format!("bad device ordinal in '{name}'"))?,
        ),
        None => (name, 0),
    };
    match kind {
        "cpu" => Ok(Device::Cpu),
        "cuda" if cfg!(feature = "cuda") => {
            Device::new_cuda(ordinal).map_err(|e| format!("cannot open {name}: {e}"))
        }
        "metal" if cfg!(feature = "metal") => {
            Device::new_metal(ordinal).map_err(|e| format!("cannot open {name}: {e}"))
        }
        "cuda" | "metal" => Err(format!(
            "device '{name}' needs a build with `--features {kind}`; this build has CPU only"
        )),
        _ => Err(format!(
            "unknown device '{name}': expected cpu, cuda:N or metal"
        )),
    }
}
