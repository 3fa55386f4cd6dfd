//! The Llama block: RMSNorm, rotary position embeddings, grouped-query attention without
//! biases, and a SwiGLU MLP — from primitive candle ops with a backward (candle's fused
//! `rms_norm` and `rope` have none; LIBRARY-NOTES.md).
//!
//! Parameters carry Hugging Face's Llama names (`model.layers.{i}.self_attn.q_proj.weight`,
//! ...), and the rotary embedding rotates halves (`rotate_half`) as Hugging Face's does, so an
//! exported model loads in common tooling as it is.

use super::layers::{attend, with_cache, Builder, Ctx, KvCache, Role};
use crate::config::ModelConfig;
use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::Linear;

/// RMSNorm over the last dim: x / √(mean(x²) + ε) · weight.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// A norm with this weight.
    pub fn new(weight: Tensor, eps: f64) -> Self {
        Self { weight, eps }
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        super::fused::rms_norm(x, &self.weight, self.eps)
    }
}

/// Rotary tables: cos and sin of position × frequency, `[seq_len, head_dim]` (each
/// frequency twice, for the two halves).
#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    /// Tables for `seq_len` positions of heads `head_dim` wide, base `theta`.
    pub fn new(
        seq_len: usize,
        head_dim: usize,
        theta: f64,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        let half = head_dim / 2;
        let inv: Vec<f64> = (0..half)
            .map(|i| 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64))
            .collect();
        let mut cos = Vec::with_capacity(seq_len * head_dim);
        let mut sin = Vec::with_capacity(seq_len * head_dim);
        for p in 0..seq_len {
            for j in 0..head_dim {
                let a = p as f64 * inv[j % half.max(1)];
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let t = |v: Vec<f64>| Tensor::from_vec(v, (seq_len, head_dim), device)?.to_dtype(dtype);
        Ok(Self {
            cos: t(cos)?,
            sin: t(sin)?,
        })
    }

    /// Rotates `x` `[B, H, T, hd]` whose first token is at position `pos`.
    pub fn apply(&self, x: &Tensor, pos: usize) -> Result<Tensor> {
        let (t, hd) = (x.dim(2)?, x.dim(3)?);
        let cos = self.cos.narrow(0, pos, t)?;
        let sin = self.sin.narrow(0, pos, t)?;
        let half = hd / 2;
        let x1 = x.narrow(D::Minus1, 0, half)?;
        let x2 = x.narrow(D::Minus1, half, half)?;
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
    }
}

/// Grouped-query attention: `n_heads` query heads share `n_kv` key/value heads.
#[derive(Debug, Clone)]
struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    n_heads: usize,
    n_kv: usize,
}

impl Attention {
    fn forward(&self, x: &Tensor, ctx: &Ctx<'_>, cache: Option<&mut KvCache>) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let hd = self.q.weight().dim(0)? / self.n_heads;
        let heads = |l: &Linear, h: usize| -> Result<Tensor> {
            l.forward(x)?
                .reshape((b, t, h, hd))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (mut q, mut k) = (heads(&self.q, self.n_heads)?, heads(&self.k, self.n_kv)?);
        let v = heads(&self.v, self.n_kv)?;
        if let Some(rope) = ctx.rope {
            q = rope.apply(&q, ctx.pos)?;
            k = rope.apply(&k, ctx.pos)?;
        }
        let (k, v) = with_cache(k, v, cache)?;
        let (k, v) = (self.repeat_kv(k)?, self.repeat_kv(v)?);
        let y = attend(&q, &k, &v, ctx.mask, ctx.pos)?;
        let y = y.transpose(1, 2)?.reshape((b, t, self.n_heads * hd))?;
        self.o.forward(&y)
    }

    /// `[B, n_kv, S, hd]` → `[B, n_heads, S, hd]`, each key/value head serving its group.
    fn repeat_kv(&self, x: Tensor) -> Result<Tensor> {
        let rep = self.n_heads / self.n_kv;
        if rep == 1 {
            return Ok(x);
        }
        let (b, kv, s, hd) = x.dims4()?;
        x.unsqueeze(2)?
            .broadcast_as((b, kv, rep, s, hd))?
            .reshape((b, kv * rep, s, hd))
    }
}

/// A Llama block: x + attn(norm(x)), then + down(silu(gate(·)) ⊙ up(·)) of norm.
#[derive(Debug, Clone)]
pub struct LlamaBlock {
    input_norm: RmsNorm,
    attn: Attention,
    post_norm: RmsNorm,
    gate: Linear,
    up: Linear,
    down: Linear,
    /// Lifts the residual projections' `rank` outputs into the stream, under a subspace.
    subspace: Option<super::subspace::Subspace>,
}

impl LlamaBlock {
    /// Block `i`'s parameters under Hugging Face's names (o and down are the residual
    /// projections).
    pub(crate) fn new(b: &mut Builder<'_>, cfg: &ModelConfig, i: usize) -> Result<Self> {
        let (d, hd, f) = (cfg.d_model, cfg.head_dim(), cfg.ffn());
        let (h, kv) = (cfg.n_heads, cfg.kv_heads());
        let plain = Role::Plain;
        let p = format!("model.layers.{i}");
        let a = format!("{p}.self_attn");
        let m = format!("{p}.mlp");
        Ok(Self {
            input_norm: b.rms_norm(&format!("{p}.input_layernorm"), d, cfg.eps())?,
            attn: Attention {
                q: b.linear(&format!("{a}.q_proj"), d, h * hd, plain, false)?,
                k: b.linear(&format!("{a}.k_proj"), d, kv * hd, plain, false)?,
                v: b.linear(&format!("{a}.v_proj"), d, kv * hd, plain, false)?,
                o: b.residual_linear(&format!("{a}.o_proj"), h * hd, d)?,
                n_heads: h,
                n_kv: kv,
            },
            post_norm: b.rms_norm(&format!("{p}.post_attention_layernorm"), d, cfg.eps())?,
            gate: b.linear(&format!("{m}.gate_proj"), d, f, plain, false)?,
            up: b.linear(&format!("{m}.up_proj"), d, f, plain, false)?,
            down: b.residual_linear(&format!("{m}.down_proj"), f, d)?,
            subspace: b.subspace.clone(),
        })
    }

    /// Applies the block to `[B, T, D]`.
    pub fn forward(
        &self,
        x: &Tensor,
        ctx: &Ctx<'_>,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let a = self
            .attn
            .forward(&self.input_norm.forward(x)?, ctx, cache)?;
        let x = (x + self.lift(a)?)?;
        let h = self.post_norm.forward(&x)?;
        let g = super::fused::swiglu(&self.gate.forward(&h)?, &self.up.forward(&h)?)?;
        x + self.lift(self.down.forward(&g)?)?
    }

    /// A residual projection's output as a write into the stream.
    fn lift(&self, y: Tensor) -> Result<Tensor> {
        match &self.subspace {
            Some(s) => s.lift(&y),
            None => Ok(y),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotary_embedding_keeps_norms_and_depends_on_relative_position_only() {
        let dev = Device::Cpu;
        let rope = Rope::new(16, 8, 10_000.0, &dev, DType::F64).unwrap();
        let q = Tensor::from_vec(
            (0..8).map(|i| i as f64 * 0.3 - 1.0).collect::<Vec<_>>(),
            (1, 1, 1, 8),
            &dev,
        )
        .unwrap();
        let k = Tensor::from_vec(
            (0..8).map(|i| (i as f64).sin()).collect::<Vec<_>>(),
            (1, 1, 1, 8),
            &dev,
        )
        .unwrap();
        let dot = |a: &Tensor, b: &Tensor| -> f64 {
            (a * b)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        };
        // A rotation: the norm is kept.
        let r = rope.apply(&q, 5).unwrap();
        assert!((dot(&r, &r) - dot(&q, &q)).abs() < 1e-9);
        // q at m, k at n: the score depends on m − n only.
        let s1 = dot(&rope.apply(&q, 7).unwrap(), &rope.apply(&k, 3).unwrap());
        let s2 = dot(&rope.apply(&q, 12).unwrap(), &rope.apply(&k, 8).unwrap());
        assert!((s1 - s2).abs() < 1e-9, "{s1} vs {s2}");
        // Position 0 is the identity.
        let z = rope.apply(&q, 0).unwrap();
        assert!((dot(&z, &q) - dot(&q, &q)).abs() < 1e-12);
    }
}
