//! AdamW with linear warmup, cosine decay and gradient-norm clipping.
//!
//! The update is plain tensor arithmetic in a fixed order, so replicas that apply it to the
//! same parameters and the same gradient end bit-identical. The schedule is a pure function
//! of the step. Clipping is per stage: in a swarm a stage never sees the other stages'
//! gradients, so local training clips the same way to match.

use super::params::ParamSet;
use super::ModelError;
use crate::config::OptimizerConfig;
use candle_core::{DType, Tensor};

/// Learning rate at `step` (0-based): linear warmup to `lr`, then cosine to
/// `lr · min_lr_ratio` at `total_steps`, flat after.
pub fn lr_at(cfg: &OptimizerConfig, step: u64, total_steps: u64) -> f64 {
    if cfg.warmup_steps > 0 && step < cfg.warmup_steps {
        return cfg.lr * (step + 1) as f64 / cfg.warmup_steps as f64;
    }
    let span = total_steps.saturating_sub(cfg.warmup_steps).max(1);
    let progress = (step.saturating_sub(cfg.warmup_steps) as f64 / span as f64).min(1.0);
    let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
    let min = cfg.lr * cfg.min_lr_ratio;
    min + (cfg.lr - min) * cosine
}

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// The learning rate used.
    pub lr: f64,
    /// Global L2 norm of the gradient before clipping.
    pub grad_norm: f64,
    /// Whether the gradient was scaled down.
    pub clipped: bool,
}

/// A flat f32 vector read in ranges: a slice, or values decoded on demand.
pub trait FlatSource {
    /// Values in the vector.
    fn len(&self) -> usize;
    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Values `range`.
    fn read(&self, range: std::ops::Range<usize>) -> Result<Vec<f32>, ModelError>;
}

impl FlatSource for &[f32] {
    fn len(&self) -> usize {
        <[f32]>::len(self)
    }

    fn read(&self, range: std::ops::Range<usize>) -> Result<Vec<f32>, ModelError> {
        self.get(range)
            .map(<[f32]>::to_vec)
            .ok_or_else(|| ModelError::BadInput("a range past the end of the gradient".into()))
    }
}

/// AdamW state for one stage's parameters.
#[derive(Debug, Clone)]
pub struct AdamW {
    cfg: OptimizerConfig,
    total_steps: u64,
    step: u64,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
}

/// Global L2 norm of a set of tensors.
pub fn global_norm(tensors: &[Tensor]) -> Result<f64, ModelError> {
    let mut sum = 0.0f64;
    for t in tensors {
        sum += t
            .sqr()?
            .sum_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?;
    }
    Ok(sum.sqrt())
}

impl AdamW {
    /// Zeroed moments for `params`; the schedule ends at `total_steps`.
    pub fn new(
        cfg: &OptimizerConfig,
        total_steps: u64,
        params: &ParamSet,
    ) -> Result<Self, ModelError> {
        let zeros = || {
            params
                .vars()
                .iter()
                .map(|v| v.as_tensor().zeros_like())
                .collect::<candle_core::Result<Vec<_>>>()
        };
        Ok(Self {
            cfg: cfg.clone(),
            total_steps,
            step: 0,
            m: zeros()?,
            v: zeros()?,
        })
    }

    /// Steps taken so far.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// First and second moments, in parameter order.
    pub fn moments(&self) -> (&[Tensor], &[Tensor]) {
        (&self.m, &self.v)
    }

    /// Replaces the state (from a checkpoint or a peer); shapes must match.
    pub fn restore(&mut self, step: u64, m: Vec<Tensor>, v: Vec<Tensor>) -> Result<(), ModelError> {
        let same = |a: &[Tensor], b: &[Tensor]| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.dims() == y.dims())
        };
        if !same(&m, &self.m) || !same(&v, &self.v) {
            return Err(ModelError::BadInput(
                "optimizer state does not match the parameters".into(),
            ));
        }
        self.step = step;
        self.m = m;
        self.v = v;
        Ok(())
    }

    /// Replaces the state with first and second moments (f32, in parameter order) that
    /// `take(k)` hands over `k` values at a time: every first moment, then every second.
    /// One tensor at a time, so the state is never held twice beside its source. A source
    /// that runs short is an error with the moments partly replaced: check its length first.
    pub fn restore_with(
        &mut self,
        step: u64,
        take: &mut dyn FnMut(usize) -> Vec<f32>,
    ) -> Result<(), ModelError> {
        for moments in [&mut self.m, &mut self.v] {
            for t in moments.iter_mut() {
                let k = t.elem_count();
                let values = take(k);
                if values.len() != k {
                    return Err(ModelError::BadInput(
                        "optimizer state does not match the parameters".into(),
                    ));
                }
                *t = Tensor::from_vec(values, t.dims(), t.device())?.to_dtype(t.dtype())?;
            }
        }
        self.step = step;
        Ok(())
    }

    /// Clips `grads` to the configured norm and applies one AdamW update to `params`.
    pub fn step(&mut self, params: &ParamSet, grads: &[Tensor]) -> Result<StepStats, ModelError> {
        if grads.len() != params.len() {
            return Err(ModelError::BadInput(format!(
                "{} gradients for {} parameters",
                grads.len(),
                params.len()
            )));
        }
        let grad_norm = global_norm(grads)?;
        self.update(params, grad_norm, |i| Ok(grads[i].clone()))
    }

    /// [`Self::step`] with the gradient as one flat vector in parameter order (as averaging
    /// produces it), read from `flat` one parameter at a time: the gradient is never held
    /// whole beside the parameters when `flat` decodes on demand. Every range is read
    /// once for the norm before anything is updated, so a source that fails, fails before
    /// the parameters change.
    pub fn step_flat(
        &mut self,
        params: &ParamSet,
        flat: &dyn FlatSource,
    ) -> Result<StepStats, ModelError> {
        if flat.len() != params.numel() {
            return Err(ModelError::BadInput(format!(
                "{} gradient values for {} parameters",
                flat.len(),
                params.numel()
            )));
        }
        let starts: Vec<usize> = params
            .vars()
            .iter()
            .scan(0, |at, v| {
                let s = *at;
                *at += v.elem_count();
                Some(s)
            })
            .collect();
        let grad = |i: usize| -> Result<Tensor, ModelError> {
            let var = &params.vars()[i];
            let s = starts[i];
            let values = flat.read(s..s + var.elem_count())?;
            Ok(Tensor::from_vec(values, var.dims(), var.device())?.to_dtype(var.dtype())?)
        };
        // The same norm `global_norm` computes, one tensor at a time.
        let mut sum = 0.0f64;
        for i in 0..params.len() {
            sum += grad(i)?
                .sqr()?
                .sum_all()?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
        }
        self.update(params, sum.sqrt(), grad)
    }

    /// One AdamW update of every parameter, with gradient `grad(i)` of parameter `i`.
    fn update(
        &mut self,
        params: &ParamSet,
        grad_norm: f64,
        grad: impl Fn(usize) -> Result<Tensor, ModelError>,
    ) -> Result<StepStats, ModelError> {
        let c = &self.cfg;
        let scale = if c.grad_clip > 0.0 && grad_norm > c.grad_clip {
            c.grad_clip / grad_norm
        } else {
            1.0
        };
        let lr = lr_at(c, self.step, self.total_steps);
        self.step += 1;
        let t = self.step as i32;
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2 = 1.0 - c.beta2.powi(t);
        for (i, var) in params.vars().iter().enumerate() {
            let g = grad(i)?;
            let wd = if params.decay()[i] {
                c.weight_decay
            } else {
                0.0
            };
            let cpu = var.device().is_cpu()
                && [var.dtype(), g.dtype(), self.m[i].dtype(), self.v[i].dtype()]
                    .iter()
                    .all(|d| *d == DType::F32);
            if cpu {
                let h = Hyper {
                    scale: scale as f32,
                    lr: lr as f32,
                    decay: (1.0 - lr * wd) as f32,
                    beta1: c.beta1 as f32,
                    beta2: c.beta2 as f32,
                    bc1: bc1 as f32,
                    bc2: bc2 as f32,
                    eps: c.eps as f32,
                };
                let (m, v) = update_cpu(var, &g, &self.m[i], &self.v[i], &h)?;
                self.m[i] = m;
                self.v[i] = v;
                continue;
            }
            let g = if scale < 1.0 {
                g.affine(scale, 0.0)?
            } else {
                g
            };
            let m = (self.m[i].affine(c.beta1, 0.0)? + g.affine(1.0 - c.beta1, 0.0)?)?;
            let v = (self.v[i].affine(c.beta2, 0.0)? + g.sqr()?.affine(1.0 - c.beta2, 0.0)?)?;
            let denom = v.affine(1.0 / bc2, 0.0)?.sqrt()?.affine(1.0, c.eps)?;
            let update = m.affine(1.0 / bc1, 0.0)?.div(&denom)?;
            let p = var.as_tensor().affine(1.0 - lr * wd, 0.0)?;
            var.set(&(p - update.affine(lr, 0.0)?)?)?;
            self.m[i] = m;
            self.v[i] = v;
        }
        Ok(StepStats {
            lr,
            grad_norm,
            clipped: scale < 1.0,
        })
    }
}

/// One step's constants, in f32.
struct Hyper {
    scale: f32,
    lr: f32,
    decay: f32,
    beta1: f32,
    beta2: f32,
    bc1: f32,
    bc2: f32,
    eps: f32,
}

/// The AdamW update of one f32 CPU parameter in a single pass (the tensor form below is a
/// dozen ops, each a new tensor); returns the new moments.
fn update_cpu(
    var: &candle_core::Var,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    h: &Hyper,
) -> Result<(Tensor, Tensor), ModelError> {
    let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
    let (mut p, g, mut m, mut v) = (flat(var.as_tensor())?, flat(g)?, flat(m)?, flat(v)?);
    if g.len() != p.len() {
        return Err(ModelError::BadInput(format!(
            "a gradient of {} values for a parameter of {}",
            g.len(),
            p.len()
        )));
    }
    for j in 0..p.len() {
        let gj = g[j] * h.scale;
        m[j] = h.beta1 * m[j] + (1.0 - h.beta1) * gj;
        v[j] = h.beta2 * v[j] + (1.0 - h.beta2) * gj * gj;
        let denom = (v[j] / h.bc2).sqrt() + h.eps;
        p[j] = p[j] * h.decay - h.lr * (m[j] / h.bc1) / denom;
    }
    let (dims, dev) = (var.dims().to_vec(), var.device().clone());
    var.set(&Tensor::from_vec(p, dims.as_slice(), &dev)?)?;
    Ok((
        Tensor::from_vec(m, dims.as_slice(), &dev)?,
        Tensor::from_vec(v, dims.as_slice(), &dev)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> OptimizerConfig {
        crate::config::RunConfig::tiny().optimizer
    }

    #[test]
    fn schedule_warms_up_then_decays_to_min() {
        let c = cfg();
        let total = 600;
        assert!(lr_at(&c, 0, total) < lr_at(&c, c.warmup_steps - 1, total));
        assert!((lr_at(&c, c.warmup_steps - 1, total) - c.lr).abs() < 1e-12);
        assert!((lr_at(&c, total, total) - c.lr * c.min_lr_ratio).abs() < 1e-12);
        assert!((lr_at(&c, 10 * total, total) - c.lr * c.min_lr_ratio).abs() < 1e-12);
        let mid = lr_at(&c, c.warmup_steps + (total - c.warmup_steps) / 2, total);
        assert!((mid - c.lr * (1.0 + c.min_lr_ratio) / 2.0).abs() < 1e-6 * c.lr);
    }

    #[test]
    fn adamw_first_step_moves_by_lr_and_clips() -> Result<(), ModelError> {
        // With bias correction, Adam's first update is lr·sign(g) (for |g| ≫ ε).
        let mut c = cfg();
        c.warmup_steps = 0;
        c.weight_decay = 0.0;
        c.grad_clip = 1.0;
        let dev = candle_core::Device::Cpu;
        let mut params = ParamSet::new(1, &dev, DType::F32);
        let p = params.add("w", &[3], super::super::params::Init::Zeros, false)?;
        let mut opt = AdamW::new(&c, 100, &params)?;
        let g = Tensor::new(&[3.0f32, -4.0, 0.0], &dev)?;
        let stats = opt.step(&params, &[g])?;
        assert!((stats.grad_norm - 5.0).abs() < 1e-6 && stats.clipped);
        let after = p.to_vec1::<f32>()?;
        let lr = c.lr as f32;
        assert!((after[0] + lr).abs() < 1e-6 && (after[1] - lr).abs() < 1e-6 && after[2] == 0.0);
        Ok(())
    }

    #[test]
    fn the_one_pass_cpu_update_matches_the_tensor_form() -> Result<(), ModelError> {
        // f32 takes the one-pass path, f64 the tensor ops: the same three steps, with decay,
        // clipping and bias correction, agree to f32 precision.
        let mut c = cfg();
        c.warmup_steps = 0;
        c.grad_clip = 0.5;
        let dev = candle_core::Device::Cpu;
        let mut out = Vec::new();
        for dtype in [DType::F32, DType::F64] {
            let mut params = ParamSet::new(3, &dev, dtype);
            params.add("w", &[4, 5], super::super::params::Init::Normal(0.5), true)?;
            params.add("b", &[5], super::super::params::Init::Normal(0.5), false)?;
            let mut opt = AdamW::new(&c, 10, &params)?;
            for step in 0..3 {
                let grads = params
                    .vars()
                    .iter()
                    .map(|v| {
                        let n = v.elem_count();
                        let g: Vec<f64> =
                            (0..n).map(|j| ((j * 7 + step) % 5) as f64 - 2.0).collect();
                        Tensor::from_vec(g, v.dims(), &dev)?.to_dtype(dtype)
                    })
                    .collect::<candle_core::Result<Vec<_>>>()?;
                opt.step(&params, &grads)?;
            }
            let flat: Vec<f64> = params
                .vars()
                .iter()
                .map(|v| {
                    v.as_tensor()
                        .flatten_all()?
                        .to_dtype(DType::F64)?
                        .to_vec1::<f64>()
                })
                .collect::<candle_core::Result<Vec<_>>>()?
                .concat();
            out.push(flat);
        }
        for (a, b) in out[0].iter().zip(&out[1]) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        Ok(())
    }
}
