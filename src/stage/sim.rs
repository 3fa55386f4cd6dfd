//! The `sim` stage kind: a stand-in for benchmarks and tests that sleeps a known time per
//! sample and exchanges tensors of the model's real sizes, so that a swarm's throughput
//! bound is known exactly even when eight stages share two cores.
//!
//! Forward sleeps a third of `sim_ms_per_sample` per sample, backward two thirds (the usual
//! 1:2 split of a transformer), and a backward that must recompute its forward (the last
//! stage, whose forward is fused into its backward, or a replica that swapped in) sleeps
//! both, as a real stage would compute both. Forward's time is counted from the call's
//! start, so its tensor work is inside it; backward makes its gradients after its time,
//! as a real backward ends with them. Outputs are Gaussian noise of the real activation shape on
//! stage 0, the input passed through on later stages (logit-sized noise on the last);
//! backward returns a gradient of the input's shape (the upstream one passed through, or
//! small noise from the last stage) and parameter gradients proportional to the
//! parameters (of the real size, not compressible to nothing), which flow through
//! accumulation, averaging and the optimizer like real ones. Nothing here is on the path
//! of a real run: `shoal peer` refuses a `sim` manifest unless given `--allow-sim`.

use crate::config::{RunConfig, StageKind};
use crate::model::{ModelError, Stage, StageGrads, Upstream};
use candle_core::{DType, Tensor};
use std::time::{Duration, Instant};

/// A sim stage's parameter gradients are its parameters times this: cheap, of the real
/// size, and as incompressible as real gradients (zeros would make every codec look free).
const SIM_GRAD_SCALE: f64 = 1e-3;

/// A sim stage's timing and shapes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimCompute {
    /// Sleep per sample in forward.
    pub forward: Duration,
    /// Sleep per sample in backward.
    pub backward: Duration,
    d_model: usize,
    vocab: usize,
}

impl SimCompute {
    /// The sim settings of `cfg`, slowed by `slowdown` (1 = as configured), or `None` for a
    /// real model.
    pub fn of(cfg: &RunConfig, slowdown: f64) -> Option<Self> {
        if cfg.stages.kind != StageKind::Sim {
            return None;
        }
        let ms = cfg.stages.sim_ms_per_sample? * slowdown.max(1e-3);
        Some(Self {
            forward: Duration::from_secs_f64(ms / 3e3),
            backward: Duration::from_secs_f64(ms * 2.0 / 3e3),
            d_model: cfg.model.d_model,
            vocab: cfg.model.vocab,
        })
    }

    /// Samples per second of forward + backward: exact, by construction.
    pub fn samples_per_s(&self) -> f64 {
        1.0 / (self.forward + self.backward).as_secs_f64()
    }

    /// Sleeps until `per_sample` × the batch of `input` has passed since `start`.
    fn finish(start: Instant, per_sample: Duration, input: &Tensor) {
        let n = input.dims().first().copied().unwrap_or(1) as u32;
        let left = (per_sample * n).saturating_sub(start.elapsed());
        if !left.is_zero() {
            std::thread::sleep(left);
        }
    }

    /// Forward of `input` through `stage`'s stand-in.
    pub fn forward(&self, stage: &Stage, input: &Tensor) -> Result<Tensor, ModelError> {
        let start = Instant::now();
        let out = self.forward_now(stage, input);
        Self::finish(start, self.forward, input);
        out
    }

    fn forward_now(&self, stage: &Stage, input: &Tensor) -> Result<Tensor, ModelError> {
        let (b, t) = (
            input.dims().first().copied().unwrap_or(1),
            input.dims().get(1).copied().unwrap_or(1),
        );
        let dev = stage.device();
        if stage.is_last() {
            return Ok(Tensor::randn(0f32, 1.0, (b, t, self.vocab), dev)?);
        }
        if stage.is_first() {
            return Ok(Tensor::randn(0f32, 1.0, (b, t, self.d_model), dev)?);
        }
        Ok(input.to_dtype(DType::F32)?.copy()?)
    }

    /// Backward of `input` through `stage`'s stand-in; `recompute` when this replica did
    /// not run the forward of this microbatch (it then takes the forward's time too).
    pub fn backward(
        &self,
        stage: &Stage,
        input: &Tensor,
        upstream: Upstream<'_>,
        recompute: bool,
    ) -> Result<StageGrads, ModelError> {
        let start = Instant::now();
        let time = if recompute {
            self.forward + self.backward
        } else {
            self.backward
        };
        // The parameter gradients appear at the end, as a real backward's do: they are not
        // held through the sleep.
        Self::finish(start, time, input);
        self.backward_now(stage, input, upstream)
    }

    fn backward_now(
        &self,
        stage: &Stage,
        input: &Tensor,
        upstream: Upstream<'_>,
    ) -> Result<StageGrads, ModelError> {
        let grads = stage
            .params()
            .vars()
            .iter()
            .map(|v| v.as_tensor().affine(SIM_GRAD_SCALE, 0.0))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let grad_input = if stage.is_first() {
            None
        } else {
            match upstream {
                Upstream::Grad(g) if g.dims() == input.dims() => Some(g.copy()?),
                _ => Some((Tensor::randn(0f32, 1.0, input.dims(), stage.device())? * 1e-3)?),
            }
        };
        let loss = stage.is_last().then_some((self.vocab as f32).ln());
        Ok(StageGrads {
            loss,
            grad_input,
            grads,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn sim_cfg() -> RunConfig {
        let mut cfg = RunConfig::tiny();
        cfg.stages.count = 2;
        cfg.stages.kind = StageKind::Sim;
        cfg.stages.sim_ms_per_sample = Some(3.0);
        cfg.validate().unwrap();
        cfg
    }

    #[test]
    fn sleeps_its_time_and_keeps_real_shapes() {
        let cfg = sim_cfg();
        let sim = SimCompute::of(&cfg, 2.0).unwrap();
        assert!((sim.samples_per_s() - 1000.0 / 6.0).abs() < 1e-6);
        let dev = Device::Cpu;
        let s0 = Stage::new(&cfg, 0, &dev).unwrap();
        let s1 = Stage::new(&cfg, 1, &dev).unwrap();
        let (b, t, d) = (4, cfg.model.seq_len, cfg.model.d_model);
        let tokens = Tensor::zeros((b, t), DType::U32, &dev).unwrap();
        let t0 = std::time::Instant::now();
        let h = sim.forward(&s0, &tokens).unwrap();
        // 4 samples × 2 ms of forward.
        assert!(t0.elapsed() >= Duration::from_millis(8));
        assert_eq!(h.dims(), [b, t, d]);
        let logits = sim.forward(&s1, &h).unwrap();
        assert_eq!(logits.dims(), [b, t, cfg.model.vocab]);
        // The last stage recomputes its forward: 4 × (2 + 4) ms.
        let t0 = std::time::Instant::now();
        let g = sim
            .backward(&s1, &h, Upstream::Targets(&tokens), true)
            .unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(24));
        assert_eq!(g.grad_input.as_ref().unwrap().dims(), [b, t, d]);
        assert!(g.loss.unwrap() > 0.0);
        assert_eq!(g.grads.len(), s1.params().len());
        let g0 = sim
            .backward(
                &s0,
                &tokens,
                Upstream::Grad(g.grad_input.as_ref().unwrap()),
                false,
            )
            .unwrap();
        assert!(g0.grad_input.is_none());
    }

    #[test]
    fn a_model_run_has_no_sim_and_bad_sim_configs_are_refused() {
        assert!(SimCompute::of(&RunConfig::tiny(), 1.0).is_none());
        let mut cfg = sim_cfg();
        cfg.stages.sim_ms_per_sample = None;
        assert!(cfg.validate().is_err());
        cfg.stages.sim_ms_per_sample = Some(-1.0);
        assert!(cfg.validate().is_err());
        let mut cfg = RunConfig::tiny();
        cfg.stages.sim_ms_per_sample = Some(1.0);
        assert!(cfg.validate().is_err());
    }
}
