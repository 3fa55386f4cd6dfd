//! Element-wise kernels: the GELU (tanh form, as σ(2u)) and SwiGLU, with their backwards.

use super::{f32s, par_map, unpack};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

const GELU_C: f32 = 0.797_884_6; // √(2/π)
const GELU_A: f32 = 0.044_715;

/// 0.5·(1 + tanh(u)) for GELU's u = √(2/π)·(v + 0.044715·v³), as σ(2u): one `exp`
/// instead of glibc's slower `tanhf`.
fn gelu_gate(v: f32) -> f32 {
    sigmoid(2.0 * GELU_C * (v + GELU_A * v * v * v))
}

/// GELU, tanh approximation (candle's `gelu`).
pub(super) struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "fused-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32s(s, l, "gelu")?;
        let y = par_map(x.len(), |i| x[i] * gelu_gate(x[i]));
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(&g.contiguous()?, &GeluGrad)?))
    }
}

/// dGELU/dx · g, with no `powf`.
pub(super) struct GeluGrad;

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
        let dx = par_map(x.len(), |i| {
            let v = x[i];
            // With s = σ(2u) = 0.5·(1 + tanh u): 1 − tanh²u = 4·s·(1 − s).
            let s = gelu_gate(v);
            let du = GELU_C * (1.0 + 3.0 * GELU_A * v * v);
            g[i] * (s + 2.0 * v * s * (1.0 - s) * du)
        });
        Ok((CpuStorage::F32(dx), l1.shape().clone()))
    }
}

/// silu(gate) ⊙ up.
pub(super) struct SwiGlu;

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
        let y = par_map(a.len(), |i| a[i] * sigmoid(a[i]) * u[i]);
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        a: &Tensor,
        u: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let all = a.apply_op3_no_bwd(u, &g.contiguous()?, &SwiGluGrad)?;
        let mut parts = unpack(&all, &[a.shape(), u.shape()])?.into_iter();
        Ok((parts.next(), parts.next()))
    }
}

/// `[d gate, d up]`, packed flat.
pub(super) struct SwiGluGrad;

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

/// x + b, with `b` the shape of `x`'s trailing dims (a bias, or a position table) repeated
/// over its rows. Spelled out, the broadcast's backward sums the gradient over the leading
/// dims with candle's reduction over non-last dims: a division per element, which was a
/// sixth of a GPT stage's CPU time.
pub(super) struct BiasAdd;

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "fused-bias-add"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, b) = (f32s(s1, l1, "bias add")?, f32s(s2, l2, "bias add")?);
        // Row by row: an index modulo the bias's length per element cost a division each.
        let mut y = x.to_vec();
        for row in y.chunks_exact_mut(b.len().max(1)) {
            for (v, c) in row.iter_mut().zip(b) {
                *v += c;
            }
        }
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let db = g
            .contiguous()?
            .apply_op1_no_bwd(&RowSum(b.shape().clone()))?;
        Ok((Some(g.clone()), Some(db)))
    }
}

/// Σ over rows of `g` cut into rows of the given shape's size: the bias's gradient.
struct RowSum(Shape);

impl CustomOp1 for RowSum {
    fn name(&self) -> &'static str {
        "fused-row-sum"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = f32s(s, l, "bias add")?;
        let n = self.0.elem_count().max(1);
        let mut out = vec![0f32; n];
        for row in g.chunks_exact(n) {
            for (o, v) in out.iter_mut().zip(row) {
                *o += v;
            }
        }
        Ok((CpuStorage::F32(out), self.0.clone()))
    }
}
