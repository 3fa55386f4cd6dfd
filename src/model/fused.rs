//! Fused CPU kernels, each with its own backward: the GELU, LayerNorm, RMSNorm, SwiGLU,
//! the causal attention softmax and the cross-entropy, one pass over memory apiece.
//!
//! Spelled out from primitive candle ops, each of these is five to fifteen ops forward and
//! as many backward, every one a fresh tensor and a trip through candle's thread pool; at
//! the widths a CPU trains, that overhead, not arithmetic, was most of a step (the GELU's
//! backward alone called `powf` per element). Here each is a [`CustomOp1`]/[`CustomOp2`]/
//! [`CustomOp3`] whose `bwd` is another fused kernel.
//!
//! They run for contiguous f32 tensors on the CPU; the functions at the bottom fall back to
//! the primitive-op forms elsewhere (CUDA, Metal, f64 numerical tests), so every device
//! keeps a gradient. `tests` checks each kernel's value and gradient against that form.

use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, D,
};

/// Rows at or above which a kernel splits its rows over the threads.
const PAR_ELEMS: usize = 1 << 15;

fn f32s<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        bail!("fused {what}: f32 only")
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => bail!("fused {what}: contiguous tensors only"),
    }
}

fn u32s<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [u32]> {
    let CpuStorage::U32(v) = s else {
        bail!("fused {what}: u32 targets only")
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => bail!("fused {what}: contiguous tensors only"),
    }
}

/// Runs `f(first_row, rows_out)` over `out` cut into whole rows of `row` values, on the
/// available threads when there is enough work.
fn par_rows(out: &mut [f32], row: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    let rows = out.len() / row.max(1);
    let threads = candle_core::utils::get_num_threads().clamp(1, 16);
    if threads == 1 || out.len() < PAR_ELEMS || rows < 2 {
        f(0, out);
        return;
    }
    let per = rows.div_ceil(threads);
    std::thread::scope(|s| {
        for (i, chunk) in out.chunks_mut(per * row).enumerate() {
            let f = &f;
            s.spawn(move || f(i * per, chunk));
        }
    });
}

const GELU_C: f32 = 0.797_884_6; // √(2/π)
const GELU_A: f32 = 0.044_715;

/// GELU, tanh approximation (candle's `gelu`).
struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "fused-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32s(s, l, "gelu")?;
        let mut y = vec![0f32; x.len()];
        par_rows(&mut y, 1024, |r0, out| {
            let x = &x[r0 * 1024..r0 * 1024 + out.len()];
            for (o, &v) in out.iter_mut().zip(x) {
                // 0.5·(1 + tanh(u)) = σ(2u): one `exp` instead of glibc's slower `tanhf`.
                *o = v * sigmoid(2.0 * GELU_C * (v + GELU_A * v * v * v));
            }
        });
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(&g.contiguous()?, &GeluGrad)?))
    }
}

/// dGELU/dx · g, with no `powf`.
struct GeluGrad;

impl CustomOp2 for GeluGrad {
    fn name(&self) -> &'static str {
        "fused-gelu-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, g) = (f32s(s1, l1, "gelu")?, f32s(s2, l2, "gelu")?);
        let mut dx = vec![0f32; x.len()];
        par_rows(&mut dx, 1024, |r0, out| {
            let at = r0 * 1024;
            for (i, o) in out.iter_mut().enumerate() {
                let v = x[at + i];
                // With s = σ(2u) = 0.5·(1 + tanh u): 1 − tanh²u = 4·s·(1 − s).
                let s = sigmoid(2.0 * GELU_C * (v + GELU_A * v * v * v));
                let du = GELU_C * (1.0 + 3.0 * GELU_A * v * v);
                *o = g[at + i] * (s + 2.0 * v * s * (1.0 - s) * du);
            }
        });
        Ok((CpuStorage::F32(dx), l1.shape().clone()))
    }
}

/// Row statistics of a norm over rows of `d` values: LayerNorm's (mean, 1/σ) or RMSNorm's
/// (0, 1/rms).
fn row_stats(x: &[f32], eps: f32, centred: bool) -> (f32, f32) {
    let d = x.len() as f32;
    let mean = if centred { x.iter().sum::<f32>() / d } else { 0.0 };
    let var = x.iter().map(|&v| (v - mean) * (v - mean)).sum::<f32>() / d;
    (mean, 1.0 / (var + eps).sqrt())
}

/// LayerNorm (`centred`) or RMSNorm over the last dim: `(x − mean)/σ · w (+ b)`.
struct Norm {
    eps: f32,
    centred: bool,
}

impl Norm {
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

struct LayerNormOp(Norm);

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
        let d = w.elem_count();
        let n = x.elem_count();
        let all = x.apply_op3_no_bwd(
            w,
            &g.contiguous()?,
            &NormGrad(Norm {
                eps: self.0.eps,
                centred: true,
            }),
        )?;
        Ok((
            Some(all.narrow(0, 0, n)?.reshape(x.shape())?),
            Some(all.narrow(0, n, d)?),
            Some(all.narrow(0, n + d, d)?),
        ))
    }
}

struct RmsNormOp(Norm);

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
        Ok((CpuStorage::F32(self.0.forward(x, w, None)), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (d, n) = (w.elem_count(), x.elem_count());
        let all = x.apply_op3_no_bwd(
            w,
            &g.contiguous()?,
            &NormGrad(Norm {
                eps: self.0.eps,
                centred: false,
            }),
        )?;
        Ok((
            Some(all.narrow(0, 0, n)?.reshape(x.shape())?),
            Some(all.narrow(0, n, d)?),
        ))
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

/// softmax(scale · x) over the last dim with the causal mask: in rows of `S` keys, the row
/// of query `q` (its index within each `T` rows, at absolute position `pos + q`) sees keys
/// `0..=pos + q` only; the rest are 0.
#[derive(Clone, Copy)]
struct CausalSoftmax {
    scale: f32,
    t: usize,
    s: usize,
    pos: usize,
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
                let xr = &x[row * s..row * s + k];
                let max = xr.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) * self.scale;
                let mut sum = 0f32;
                for (o, &v) in yr[..k].iter_mut().zip(xr) {
                    *o = (v * self.scale - max).exp();
                    sum += *o;
                }
                let inv = 1.0 / sum;
                yr[..k].iter_mut().for_each(|o| *o *= inv);
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
struct CausalSoftmaxGrad(CausalSoftmax);

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

/// silu(gate) ⊙ up.
struct SwiGlu;

fn sigmoid(v: f32) -> f32 {
    1.0 / (1.0 + (-v).exp())
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "fused-swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (a, u) = (f32s(s1, l1, "swiglu")?, f32s(s2, l2, "swiglu")?);
        let mut y = vec![0f32; a.len()];
        par_rows(&mut y, 1024, |r0, out| {
            let at = r0 * 1024;
            for (i, o) in out.iter_mut().enumerate() {
                let v = a[at + i];
                *o = v * sigmoid(v) * u[at + i];
            }
        });
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        a: &Tensor,
        u: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let n = a.elem_count();
        let all = a.apply_op3_no_bwd(u, &g.contiguous()?, &SwiGluGrad)?;
        Ok((
            Some(all.narrow(0, 0, n)?.reshape(a.shape())?),
            Some(all.narrow(0, n, n)?.reshape(u.shape())?),
        ))
    }
}

/// `[d gate, d up]`, packed flat.
struct SwiGluGrad;

impl CustomOp3 for SwiGluGrad {
    fn name(&self) -> &'static str {
        "fused-swiglu-grad"
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
        let (a, u, g) = (
            f32s(s1, l1, "swiglu")?,
            f32s(s2, l2, "swiglu")?,
            f32s(s3, l3, "swiglu")?,
        );
        let n = a.len();
        let mut out = vec![0f32; 2 * n];
        let (da, du) = out.split_at_mut(n);
        for i in 0..n {
            let (v, s) = (a[i], sigmoid(a[i]));
            da[i] = g[i] * u[i] * s * (1.0 + v * (1.0 - s));
            du[i] = g[i] * v * s;
        }
        Ok((CpuStorage::F32(out), Shape::from(2 * n)))
    }
}

/// Mean cross-entropy of logits `[N, V]` against targets `[N]` (u32).
struct CrossEntropy;

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
        let (x, t) = (f32s(s1, l1, "cross-entropy")?, u32s(s2, l2, "cross-entropy")?);
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
struct CrossEntropyGrad {
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
        let (x, t) = (f32s(s1, l1, "cross-entropy")?, u32s(s2, l2, "cross-entropy")?);
        let v = x.len() / t.len().max(1);
        let k = self.scale / t.len().max(1) as f32;
        let mut dx = vec![0f32; x.len()];
        par_rows(&mut dx, v, |r0, out| {
            for (r, dr) in out.chunks_mut(v).enumerate() {
                let row = &x[(r0 + r) * v..(r0 + r + 1) * v];
                let max = row.iter().fold(f32::NEG_INFINITY, |m, &a| m.max(a));
                let mut sum = 0f32;
                for (o, &a) in dr.iter_mut().zip(row) {
                    *o = (a - max).exp();
                    sum += *o;
                }
                let inv = k / sum;
                dr.iter_mut().for_each(|o| *o *= inv);
                if let Some(o) = dr.get_mut(t[r0 + r] as usize) {
                    *o -= k;
                }
            }
        });
        Ok((CpuStorage::F32(dx), l1.shape().clone()))
    }
}

/// Whether `t` takes the fused path.
fn fused(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32
}

/// GELU (tanh approximation).
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    if fused(x) {
        x.contiguous()?.apply_op1(Gelu)
    } else {
        x.gelu()
    }
}

/// LayerNorm over the last dim.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    if fused(x) {
        let op = LayerNormOp(Norm {
            eps: eps as f32,
            centred: true,
        });
        return x.contiguous()?.apply_op3(w, b, op);
    }
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let xn = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
    xn.broadcast_mul(w)?.broadcast_add(b)
}

/// RMSNorm over the last dim.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    if fused(x) {
        let op = RmsNormOp(Norm {
            eps: eps as f32,
            centred: false,
        });
        return x.contiguous()?.apply_op2(w, op);
    }
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)
}

/// silu(gate) ⊙ up.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if fused(gate) {
        gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
    } else {
        candle_nn::ops::silu(gate)? * up
    }
}

/// softmax(scale · att + causal mask) over the last dim, for scores `[B, H, T, S]` of
/// queries at positions `pos..pos+T`; `mask` is the model's `[seq, seq]` additive mask (used
/// off the fused path).
pub fn causal_softmax(att: &Tensor, scale: f64, pos: usize, mask: &Tensor) -> Result<Tensor> {
    let (t, s) = (att.dim(D::Minus2)?, att.dim(D::Minus1)?);
    if fused(att) {
        let op = CausalSoftmax {
            scale: scale as f32,
            t,
            s,
            pos,
        };
        return att.contiguous()?.apply_op1(op);
    }
    let att = (att * scale)?.broadcast_add(&mask.narrow(0, pos, t)?.narrow(1, 0, s)?)?;
    candle_nn::ops::softmax(&att, D::Minus1)
}

/// Mean cross-entropy of logits `[N, V]` against targets `[N]`.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if fused(logits) {
        let t = targets.to_dtype(DType::U32)?.contiguous()?;
        return logits.contiguous()?.apply_op2(&t, CrossEntropy);
    }
    candle_nn::loss::cross_entropy(logits, targets)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// A random f32 tensor.
    fn rand(shape: &[usize], seed: u64) -> Tensor {
        let mut rng = crate::rng::Rng::new(seed);
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn close(a: &Tensor, b: &Tensor, tol: f32) {
        let (a, b) = (
            a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() <= tol * (1.0 + y.abs()),
                "element {i}: fused {x}, reference {y}"
            );
        }
    }

    /// Compares `fused_f` with `reference` on `inputs`: values, and the gradients of
    /// Σ(out ⊙ r) for a random r with respect to every input.
    fn check(
        inputs: &[Tensor],
        fused_f: impl Fn(&[Tensor]) -> Result<Tensor>,
        reference: impl Fn(&[Tensor]) -> Result<Tensor>,
    ) {
        let run = |f: &dyn Fn(&[Tensor]) -> Result<Tensor>| {
            let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
            let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            let out = f(&ts).unwrap();
            let r = rand(out.dims(), 99);
            let grads = (&out * &r).unwrap().sum_all().unwrap().backward().unwrap();
            let g: Vec<Tensor> = ts.iter().map(|t| grads.get(t).unwrap().clone()).collect();
            (out, g)
        };
        let (a, ga) = run(&fused_f);
        let (b, gb) = run(&reference);
        close(&a, &b, 1e-5);
        for (x, y) in ga.iter().zip(&gb) {
            close(x, y, 1e-4);
        }
    }

    #[test]
    fn gelu_matches_candles() {
        // Large enough to take the threaded path.
        let x = rand(&[64, 1024], 1);
        check(&[x], |t| gelu(&t[0]), |t| t[0].gelu());
    }

    #[test]
    fn norms_match_the_primitive_forms() {
        let x = (rand(&[8, 16, 64], 2) * 3.0).unwrap();
        let w = (rand(&[64], 3) + 1.0).unwrap();
        let b = rand(&[64], 4);
        let refln = |t: &[Tensor]| {
            let mean = t[0].mean_keepdim(D::Minus1)?;
            let xc = t[0].broadcast_sub(&mean)?;
            let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
            xc.broadcast_div(&(var + 1e-5)?.sqrt()?)?
                .broadcast_mul(&t[1])?
                .broadcast_add(&t[2])
        };
        check(
            &[x.clone(), w.clone(), b],
            |t| layer_norm(&t[0], &t[1], &t[2], 1e-5),
            refln,
        );
        let refrms = |t: &[Tensor]| {
            let ms = t[0].sqr()?.mean_keepdim(D::Minus1)?;
            t[0].broadcast_div(&(ms + 1e-5)?.sqrt()?)?
                .broadcast_mul(&t[1])
        };
        check(&[x, w], |t| rms_norm(&t[0], &t[1], 1e-5), refrms);
    }

    #[test]
    fn swiglu_matches_silu_times_up() {
        let (a, u) = (rand(&[4, 8, 96], 5), rand(&[4, 8, 96], 6));
        check(
            &[a, u],
            |t| swiglu(&t[0], &t[1]),
            |t| candle_nn::ops::silu(&t[0])? * &t[1],
        );
    }

    #[test]
    fn causal_softmax_matches_the_masked_softmax_also_with_a_cache_offset() {
        let seq = 12;
        let mask = super::super::layers::causal_mask(seq, &Device::Cpu, DType::F32).unwrap();
        for (t, s, pos) in [(12, 12, 0), (3, 10, 7), (1, 6, 5)] {
            let att = rand(&[2, 3, t, s], 7);
            let reference = |x: &[Tensor]| {
                let a = (&x[0] * 0.25)?
                    .broadcast_add(&mask.narrow(0, pos, t)?.narrow(1, 0, s)?)?;
                candle_nn::ops::softmax(&a, D::Minus1)
            };
            check(
                &[att],
                |x| causal_softmax(&x[0], 0.25, pos, &mask),
                reference,
            );
        }
    }

    #[test]
    fn cross_entropy_matches_candles() {
        let logits = (rand(&[20, 33], 8) * 4.0).unwrap();
        let targets: Vec<u32> = (0..20).map(|i| (i * 7 % 33) as u32).collect();
        let t = Tensor::from_vec(targets, 20, &Device::Cpu).unwrap();
        check(
            &[logits.clone()],
            |x| cross_entropy(&x[0], &t),
            |x| candle_nn::loss::cross_entropy(&x[0], &t),
        );
        // A target past the vocab is an error, not a read out of bounds.
        let bad = Tensor::from_vec(vec![40u32; 20], 20, &Device::Cpu).unwrap();
        assert!(cross_entropy(&logits, &bad).is_err());
    }
}
