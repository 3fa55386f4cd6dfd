//! LayerNorm and RMSNorm over the last dim, and their backward (input, weight and bias
//! gradients packed in one flat tensor).

use super::{f32s, par_rows, unpack};
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

/// Row statistics of a norm over rows of `d` values: LayerNorm's (mean, 1/σ) or RMSNorm's
/// (0, 1/rms).
fn row_stats(x: &[f32], eps: f32, centred: bool) -> (f32, f32) {
    let d = x.len() as f32;
    let mean = if centred {
        x.iter().sum::<f32>() / d
    } else {
        0.0
    };
    let var = x.iter().map(|&v| (v - mean) * (v - mean)).sum::<f32>() / d;
    (mean, 1.0 / (var + eps).sqrt())
}

/// LayerNorm (`centred`) or RMSNorm over the last dim: `(x − mean)/σ · w (+ b)`.
#[derive(Clone, Copy)]
pub(super) struct Norm {
    pub(super) eps: f32,
    pub(super) centred: bool,
}

impl Norm {
    /// The gradients of x, w (and b, when centred) for upstream `g`, through [`NormGrad`].
    fn grads(self, x: &Tensor, w: &Tensor, g: &Tensor) -> Result<Vec<Tensor>> {
        let all = x.apply_op3_no_bwd(w, &g.contiguous()?, &NormGrad(self))?;
        let mut shapes = vec![x.shape(), w.shape()];
        if self.centred {
            shapes.push(w.shape());
        }
        unpack(&all, &shapes)
    }

    fn forward(&self, x: &[f32], w: &[f32], b: Option<&[f32]>) -> Vec<f32> {
        let d = w.len();
        let mut y = vec![0f32; x.len()];
        par_rows(&mut y, d, |r0, out| {
            for (r, yr) in out.chunks_mut(d).enumerate() {
                let xr = &x[(r0 + r) * d..(r0 + r + 1) * d];
                let (mean, rstd) = row_stats(xr, self.eps, self.centred);
                for j in 0..d {
                    yr[j] = (xr[j] - mean) * rstd * w[j] + b.map_or(0.0, |b| b[j]);
                }
            }
        });
        y
    }

    /// `[dx..., dw..., db...]` (db only when centred) for upstream `g`.
    fn backward(&self, x: &[f32], w: &[f32], g: &[f32]) -> Vec<f32> {
        let d = w.len();
        let n = x.len();
        let extra = if self.centred { 2 * d } else { d };
        let mut out = vec![0f32; n + extra];
        let (dx, dwb) = out.split_at_mut(n);
        par_rows(dx, d, |r0, out| {
            for (r, dxr) in out.chunks_mut(d).enumerate() {
                let at = (r0 + r) * d;
                let (xr, gr) = (&x[at..at + d], &g[at..at + d]);
                let (mean, rstd) = row_stats(xr, self.eps, self.centred);
                let (mut s1, mut s2) = (0f32, 0f32);
                for j in 0..d {
                    let gw = gr[j] * w[j];
                    s1 += gw;
                    s2 += gw * (xr[j] - mean) * rstd;
                }
                let (m1, m2) = (s1 / d as f32, s2 / d as f32);
                for j in 0..d {
                    let xh = (xr[j] - mean) * rstd;
                    let gw = gr[j] * w[j];
                    dxr[j] = if self.centred {
                        rstd * (gw - m1 - xh * m2)
                    } else {
                        rstd * (gw - xh * m2)
                    };
                }
            }
        });
        let (dw, db) = dwb.split_at_mut(d);
        for (xr, gr) in x.chunks(d).zip(g.chunks(d)) {
            let (mean, rstd) = row_stats(xr, self.eps, self.centred);
            for j in 0..d {
                dw[j] += gr[j] * (xr[j] - mean) * rstd;
                if self.centred {
                    db[j] += gr[j];
                }
            }
        }
        out
    }
}

pub(super) struct LayerNormOp(pub(super) Norm);

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        "fused-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w, b) = (
            f32s(s1, l1, "layer norm")?,
            f32s(s2, l2, "layer norm")?,
            f32s(s3, l3, "layer norm")?,
        );
        Ok((
            CpuStorage::F32(self.0.forward(x, w, Some(b))),
            l1.shape().clone(),
        ))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut parts = self.0.grads(x, w, g)?.into_iter();
        Ok((parts.next(), parts.next(), parts.next()))
    }
}

pub(super) struct RmsNormOp(pub(super) Norm);

impl CustomOp2 for RmsNormOp {
    fn name(&self) -> &'static str {
        "fused-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (f32s(s1, l1, "rms norm")?, f32s(s2, l2, "rms norm")?);
        Ok((
            CpuStorage::F32(self.0.forward(x, w, None)),
            l1.shape().clone(),
        ))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut parts = self.0.grads(x, w, g)?.into_iter();
        Ok((parts.next(), parts.next()))
    }
}

/// A norm's backward, packed flat: `[dx, dw, (db)]`.
struct NormGrad(Norm);

impl CustomOp3 for NormGrad {
    fn name(&self) -> &'static str {
        "fused-norm-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w, g) = (
            f32s(s1, l1, "norm")?,
            f32s(s2, l2, "norm")?,
            f32s(s3, l3, "norm")?,
        );
        let out = self.0.backward(x, w, g);
        let len = out.len();
        Ok((CpuStorage::F32(out), Shape::from(len)))
    }
}
