//! `shoal bench stage`: one stage's forward + backward throughput on a device and dtype
//! (tokens/s), and, first, a check that on that device the stages' gradients equal the
//! unsplit model's (the staged gradient test, runnable on a GPU without the test suite).

use crate::config::RunConfig;
use crate::model::optim::global_norm;
use crate::model::{ModelError, Stage, Upstream};
use crate::rng::Rng;
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::time::Instant;

/// What was measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StageBench {
    /// The stage measured.
    pub stage: usize,
    /// Its parameters.
    pub params: usize,
    /// The dtype.
    pub dtype: String,
    /// Microbatch size.
    pub batch: usize,
    /// Forward + backward passes timed.
    pub passes: usize,
    /// Tokens per second through forward + backward.
    pub tokens_per_s: f64,
}

fn random_tokens(
    cfg: &RunConfig,
    b: usize,
    seed: u64,
    dev: &Device,
) -> Result<(Tensor, Tensor), ModelError> {
    let t = cfg.model.seq_len;
    let mut rng = Rng::new(seed);
    let v: Vec<u32> = (0..b * (t + 1))
        .map(|_| rng.below(cfg.model.vocab as u64) as u32)
        .collect();
    let all = Tensor::from_vec(v, (b, t + 1), dev)?;
    Ok((
        all.narrow(1, 0, t)?.contiguous()?,
        all.narrow(1, 1, t)?.contiguous()?,
    ))
}

/// The largest relative error (‖staged − unsplit‖ / ‖unsplit‖ over each parameter) between
/// a `stages`-stage cut of `cfg` and the unsplit model, on `device` in f32.
pub fn gradient_check(cfg: &RunConfig, stages: usize, device: &Device) -> Result<f64, ModelError> {
    let mut one = cfg.clone();
    one.stages.count = 1;
    one.stages.cuts.clear();
    let mut cut = cfg.clone();
    cut.stages.count = stages.min(cfg.model.n_layers).max(1);
    cut.stages.cuts.clear();
    let (x, y) = random_tokens(cfg, 2, 7, device)?;
    let full = Stage::new(&one, 0, device)?;
    let store = full.loss(&x, &y)?.backward()?;
    let parts: Vec<Stage> = (0..cut.stages.count)
        .map(|i| Stage::new(&cut, i, device))
        .collect::<Result<_, _>>()?;
    let mut inputs = vec![x];
    for s in &parts[..parts.len() - 1] {
        let h = s.forward(
            inputs
                .last()
                .ok_or_else(|| ModelError::BadInput("no input".into()))?,
        )?;
        inputs.push(h);
    }
    let mut grads: HashMap<String, Tensor> = HashMap::new();
    let mut up: Option<Tensor> = None;
    for (i, s) in parts.iter().enumerate().rev() {
        let g = match &up {
            None => s.backward(&inputs[i], Upstream::Targets(&y))?,
            Some(u) => s.backward(&inputs[i], Upstream::Grad(u))?,
        };
        for (n, t) in s.params().names().iter().zip(g.grads) {
            grads.insert(n.clone(), t);
        }
        up = g.grad_input;
    }
    let mut worst = 0.0f64;
    for (n, v) in full.params().names().iter().zip(full.params().vars()) {
        let want = store
            .get(v.as_tensor())
            .ok_or_else(|| ModelError::BadInput(format!("{n} got no gradient")))?;
        let got = grads
            .get(n)
            .ok_or_else(|| ModelError::BadInput(format!("{n} is in no stage")))?;
        let d = global_norm(&[(want - got)?])?;
        worst = worst.max(d / global_norm(std::slice::from_ref(want))?.max(1e-30));
    }
    Ok(worst)
}

/// Times forward + backward of stage `stage` of `cfg` on `device` in `dtype` with
/// microbatches of `batch`, for about `seconds` after one warm-up pass.
pub fn throughput(
    cfg: &RunConfig,
    stage: usize,
    device: &Device,
    dtype: DType,
    batch: usize,
    seconds: f64,
) -> Result<StageBench, ModelError> {
    let s = Stage::with_dtype(cfg, stage, device, dtype)?;
    let (ids, targets) = random_tokens(cfg, batch, 3, device)?;
    let input = if s.is_first() {
        ids
    } else {
        s.example_input(batch, cfg.model.seq_len)?
    };
    let g = s.example_upstream(batch, cfg.model.seq_len)?;
    let pass = || -> Result<(), ModelError> {
        if s.is_last() {
            s.backward(&input, Upstream::Targets(&targets))?;
        } else {
            s.backward(&input, Upstream::Grad(&g))?;
        }
        device.synchronize()?;
        Ok(())
    };
    pass()?;
    let started = Instant::now();
    let mut passes = 0;
    while passes == 0 || started.elapsed().as_secs_f64() < seconds {
        pass()?;
        passes += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    Ok(StageBench {
        stage,
        params: s.params().numel(),
        dtype: format!("{dtype:?}").to_lowercase(),
        batch,
        passes,
        tokens_per_s: (passes * batch * cfg.model.seq_len) as f64 / secs.max(1e-9),
    })
}
