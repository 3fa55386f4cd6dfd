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
//! The kernels: `pointwise` (GELU, SwiGLU), `norm` (LayerNorm, RMSNorm), `rows` (causal
//! softmax, cross-entropy).

use candle_core::{bail, CpuStorage, DType, Layout, Result, Tensor, D};

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

mod norm;
mod pointwise;
mod rows;

use norm::{LayerNormOp, Norm, RmsNormOp};
use pointwise::{Gelu, SwiGlu};
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
mod tests;
