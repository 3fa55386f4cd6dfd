//! Row kernels: the causal attention softmax and the cross-entropy, with their backwards.

use super::{f32s, par_rows, u32s};
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};

/// `out = times · softmax(scale · x)` for one row (`scale` > 0).
fn softmax_row(x: &[f32], scale: f32, times: f32, out: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) * scale;
    let mut sum = 0f32;
    for (o, &v) in out.iter_mut().zip(x) {
        *o = (v * scale - max).exp();
        sum += *o;
    }
    let inv = times / sum;
    out.iter_mut().for_each(|o| *o *= inv);
}

/// softmax(scale · x) over the last dim with the causal mask: in rows of `S` keys, the row
/// of query `q` (its index within each `T` rows, at absolute position `pos + q`) sees keys
/// `0..=pos + q` only; the rest are 0.
#[derive(Clone, Copy)]
pub(super) struct CausalSoftmax {
    pub(super) scale: f32,
    pub(super) t: usize,
    pub(super) s: usize,
    pub(super) pos: usize,
}

impl CausalSoftmax {
    fn visible(&self, row: usize) -> usize {
        (self.pos + row % self.t + 1).min(self.s)
    }
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "fused-causal-softmax"
    }

    fn cpu_fwd(&self, st: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32s(st, l, "softmax")?;
        let s = self.s;
        let mut y = vec![0f32; x.len()];
        par_rows(&mut y, s, |r0, out| {
            for (r, yr) in out.chunks_mut(s).enumerate() {
                let row = r0 + r;
                let k = self.visible(row);
                softmax_row(&x[row * s..row * s + k], self.scale, 1.0, &mut yr[..k]);
            }
        });
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(y.apply_op2_no_bwd(
            &g.contiguous()?,
            &CausalSoftmaxGrad(*self),
        )?))
    }
}

/// scale · y ⊙ (g − Σ y·g), row by row.
pub(super) struct CausalSoftmaxGrad(CausalSoftmax);

impl CustomOp2 for CausalSoftmaxGrad {
    fn name(&self) -> &'static str {
        "fused-causal-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (y, g) = (f32s(s1, l1, "softmax")?, f32s(s2, l2, "softmax")?);
        let op = self.0;
        let s = op.s;
        let mut dx = vec![0f32; y.len()];
        par_rows(&mut dx, s, |r0, out| {
            for (r, dr) in out.chunks_mut(s).enumerate() {
                let row = r0 + r;
                let k = op.visible(row);
                let (yr, gr) = (&y[row * s..row * s + k], &g[row * s..row * s + k]);
                let dot: f32 = yr.iter().zip(gr).map(|(a, b)| a * b).sum();
                for j in 0..k {
                    dr[j] = op.scale * yr[j] * (gr[j] - dot);
                }
            }
        });
        Ok((CpuStorage::F32(dx), l1.shape().clone()))
    }
}

/// Mean cross-entropy of logits `[N, V]` against targets `[N]` (u32).
pub(super) struct CrossEntropy;

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "fused-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, t) = (
            f32s(s1, l1, "cross-entropy")?,
            u32s(s2, l2, "cross-entropy")?,
        );
        let v = x.len() / t.len().max(1);
        let mut total = 0f64;
        for (row, &target) in x.chunks(v).zip(t) {
            let Some(&xt) = row.get(target as usize) else {
                bail!("target {target} is not below the vocab {v}")
            };
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &a| m.max(a));
            let sum: f32 = row.iter().map(|&a| (a - max).exp()).sum();
            total += f64::from(max + sum.ln() - xt);
        }
        Ok((
            CpuStorage::F32(vec![(total / t.len().max(1) as f64) as f32]),
            Shape::from(()),
        ))
    }

    fn bwd(
        &self,
        x: &Tensor,
        t: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let scale = g.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        Ok((
            Some(x.apply_op2_no_bwd(t, &CrossEntropyGrad { scale })?),
            None,
        ))
    }
}

/// (softmax(x) − onehot(t)) · scale / N.
pub(super) struct CrossEntropyGrad {
    scale: f32,
}

impl CustomOp2 for CrossEntropyGrad {
    fn name(&self) -> &'static str {
        "fused-cross-entropy-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, t) = (
            f32s(s1, l1, "cross-entropy")?,
            u32s(s2, l2, "cross-entropy")?,
        );
        let v = x.len() / t.len().max(1);
        let k = self.scale / t.len().max(1) as f32;
        let mut dx = vec![0f32; x.len()];
        par_rows(&mut dx, v, |r0, out| {
            for (r, dr) in out.chunks_mut(v).enumerate() {
                softmax_row(&x[(r0 + r) * v..(r0 + r + 1) * v], 1.0, k, dr);
                if let Some(o) = dr.get_mut(t[r0 + r] as usize) {
                    *o -= k;
                }
            }
        });
        Ok((CpuStorage::F32(dx), l1.shape().clone()))
    }
}
