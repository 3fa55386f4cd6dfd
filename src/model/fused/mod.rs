//! Fused CPU kernels, each with its own backward: the GELU, LayerNorm, RMSNorm, SwiGLU,
//! the causal attention softmax, the cross-entropy and the bias add, one pass over memory
//! apiece.
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
//! The kernels: `pointwise` (GELU, SwiGLU, bias add), `norm` (LayerNorm, RMSNorm), `rows` (causal
//! softmax, cross-entropy).

use candle_core::{bail, CpuStorage, DType, Layout, Result, Shape, Tensor, WithDType, D};

/// Rows at or above which a kernel splits its rows over the threads.
const PAR_ELEMS: usize = 1 << 15;

/// The contiguous values of a storage of `T`s (e.g. `f32`, `u32`).
fn slice<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [T]> {
    let Ok(v) = s.as_slice::<T>() else {
        bail!("fused {what}: {} only", T::DTYPE.as_str())
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => bail!("fused {what}: contiguous tensors only"),
    }
}

fn f32s<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    slice(s, l, what)
}

fn u32s<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [u32]> {
    slice(s, l, what)
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

/// `f(i)` for every `i` below `len`, on the available threads when there is enough work.
fn par_map(len: usize, f: impl Fn(usize) -> f32 + Sync) -> Vec<f32> {
    const ROW: usize = 1024;
    let mut out = vec![0f32; len];
    par_rows(&mut out, ROW, |r0, part| {
        for (i, o) in part.iter_mut().enumerate() {
            *o = f(r0 * ROW + i);
        }
    });
    out
}

/// Cuts a flat tensor of packed results into consecutive pieces of these shapes (a
/// backward kernel returns the gradients of all its inputs as one tensor).
fn unpack(all: &Tensor, shapes: &[&Shape]) -> Result<Vec<Tensor>> {
    let mut at = 0;
    shapes
        .iter()
        .map(|s| {
            let n = s.elem_count();
            let t = all.narrow(0, at, n)?.reshape(*s)?;
            at += n;
            Ok(t)
        })
        .collect()
}

mod norm;
mod pointwise;
mod rows;

use norm::{LayerNormOp, Norm, RmsNormOp};
use pointwise::{BiasAdd, Gelu, SwiGlu};
use rows::{CausalSoftmax, CrossEntropy};

/// Whether `t` takes the fused path.
fn fused(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32
}

/// GELU (tanh approximation).
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    if fused(x) {
        x.contiguous()?.apply_op1(Gelu)
    } else {
        primitive::gelu(x)
    }
}

/// x + b for `b` of the shape of `x`'s trailing dims (a bias, a position table).
pub fn bias_add(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    let trailing = &x.dims()[x.rank().saturating_sub(b.rank())..];
    if fused(x) && fused(b) && trailing == b.dims() {
        return x.contiguous()?.apply_op2(&b.contiguous()?, BiasAdd);
    }
    primitive::bias_add(x, b)
}

/// `lin` applied to `x`, its bias (if any) added by [`bias_add`].
pub fn linear(x: &Tensor, lin: &candle_nn::Linear) -> Result<Tensor> {
    use candle_core::Module;
    match lin.bias() {
        Some(b) => bias_add(
            &candle_nn::Linear::new(lin.weight().clone(), None).forward(x)?,
            b,
        ),
        None => lin.forward(x),
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
    primitive::layer_norm(x, w, b, eps)
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
    primitive::rms_norm(x, w, eps)
}

/// silu(gate) ⊙ up.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if fused(gate) {
        gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
    } else {
        primitive::swiglu(gate, up)
    }
}

/// softmax(scale · att + causal mask) over the last dim, for scores `[B, H, T, S]` of
/// queries at positions `pos..pos+T`; `mask` is the model's `[seq, seq]` additive mask (used
/// off the fused path).
pub fn causal_softmax(att: &Tensor, scale: f64, pos: usize, mask: &Tensor) -> Result<Tensor> {
    if fused(att) {
        let op = CausalSoftmax {
            scale: scale as f32,
            t: att.dim(D::Minus2)?,
            s: att.dim(D::Minus1)?,
            pos,
        };
        return att.contiguous()?.apply_op1(op);
    }
    primitive::causal_softmax(att, scale, pos, mask)
}

/// Mean cross-entropy of logits `[N, V]` against targets `[N]`.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if fused(logits) {
        let t = targets.to_dtype(DType::U32)?.contiguous()?;
        return logits.contiguous()?.apply_op2(&t, CrossEntropy);
    }
    primitive::cross_entropy(logits, targets)
}

/// The same functions from primitive candle ops (each with a backward on every device): the
/// path off the CPU, and what the tests hold the kernels to.
mod primitive {
    use candle_core::{Result, Tensor, D};

    pub(super) fn gelu(x: &Tensor) -> Result<Tensor> {
        x.gelu()
    }

    pub(super) fn bias_add(x: &Tensor, b: &Tensor) -> Result<Tensor> {
        x.broadcast_add(b)
    }

    pub(super) fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
        let mean = x.mean_keepdim(D::Minus1)?;
        let xc = x.broadcast_sub(&mean)?;
        let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
        let xn = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
        xn.broadcast_mul(w)?.broadcast_add(b)
    }

    pub(super) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
        x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)
    }

    pub(super) fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        candle_nn::ops::silu(gate)? * up
    }

    pub(super) fn causal_softmax(
        att: &Tensor,
        scale: f64,
        pos: usize,
        mask: &Tensor,
    ) -> Result<Tensor> {
        let (t, s) = (att.dim(D::Minus2)?, att.dim(D::Minus1)?);
        let att = (att * scale)?.broadcast_add(&mask.narrow(0, pos, t)?.narrow(1, 0, s)?)?;
        candle_nn::ops::softmax(&att, D::Minus1)
    }

    pub(super) fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        candle_nn::loss::cross_entropy(logits, targets)
    }
}

#[cfg(test)]
mod tests;
