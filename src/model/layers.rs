//! The decoder's layers, written from primitive candle ops that all have a backward: the
//! GPT block here, the Llama block in [`super::llama`], and what both share (the attention
//! core, the causal mask, the key/value cache for generation).
//!
//! candle's fused `layer_norm`, `softmax_last_dim` and `sdpa` have no gradient and would cut
//! the graph silently (LIBRARY-NOTES.md), so the norm and the attention softmax here are
//! spelled out; the model tests check that every parameter receives a gradient.

use super::llama::{LlamaBlock, Rope};
use super::params::{Init, ParamSet};
use crate::config::{Family, InitScheme, ModelConfig};
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::Linear;

/// What a weight does, which sets its initial scale (see [`InitScheme`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// A projection into or inside a block, or the head.
    Plain,
    /// A projection back into the residual stream (attention output, MLP down).
    Residual,
}

/// Builds layers whose parameters go into a [`ParamSet`], initialised by `scheme`.
pub(crate) struct Builder<'a> {
    pub params: &'a mut ParamSet,
    pub scheme: InitScheme,
    pub n_layers: usize,
    /// The residual stream's subspace, when the run keeps it in one.
    pub subspace: Option<super::subspace::Subspace>,
}

impl Builder<'_> {
    fn param(&mut self, name: &str, shape: &[usize], init: Init, decay: bool) -> Result<Tensor> {
        self.params.add(name, shape, init, decay)
    }

    /// The standard deviation of a weight with `fan_in` inputs.
    pub fn weight_std(&self, fan_in: usize, role: Role) -> f64 {
        match (self.scheme, role) {
            (InitScheme::FanIn, _) => (3.0 * fan_in.max(1) as f64).sqrt().recip(),
            (InitScheme::Gpt2, Role::Plain) => 0.02,
            (InitScheme::Gpt2, Role::Residual) => 0.02 / (2.0 * self.n_layers.max(1) as f64).sqrt(),
        }
    }

    /// A linear layer `in → out`, weight initialised for its role, optional zero bias.
    pub fn linear(
        &mut self,
        name: &str,
        inp: usize,
        out: usize,
        role: Role,
        bias: bool,
    ) -> Result<Linear> {
        let std = self.weight_std(inp, role);
        let w = self.param(
            &format!("{name}.weight"),
            &[out, inp],
            Init::Normal(std),
            true,
        )?;
        let b = if bias {
            Some(self.param(&format!("{name}.bias"), &[out], Init::Zeros, false)?)
        } else {
            None
        };
        Ok(Linear::new(w, b))
    }

    /// A projection `inp → d` back into the residual stream. Under a subspace it is stored
    /// as `inp → rank` (`{name}.sub.weight`) and the block lifts its output with
    /// [`super::subspace::Subspace::lift`]. Its initial scale is the full projection's
    /// (raising it by √(d/rank), so the write starts as large as a full projection's,
    /// trained worse: BENCHMARKS.md, issue 31).
    pub fn residual_linear(&mut self, name: &str, inp: usize, d: usize) -> Result<Linear> {
        match self.subspace.as_ref().map(|s| s.rank()) {
            Some(rank) => self.linear(&format!("{name}.sub"), inp, rank, Role::Residual, false),
            None => self.linear(name, inp, d, Role::Residual, false),
        }
    }

    /// A LayerNorm over the last dim with unit weight and zero bias.
    pub fn layer_norm(&mut self, name: &str, dim: usize) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: self.param(&format!("{name}.weight"), &[dim], Init::Ones, false)?,
            bias: self.param(&format!("{name}.bias"), &[dim], Init::Zeros, false)?,
        })
    }

    /// An RMSNorm over the last dim with unit weight.
    pub fn rms_norm(&mut self, name: &str, dim: usize, eps: f64) -> Result<super::llama::RmsNorm> {
        let weight = self.param(&format!("{name}.weight"), &[dim], Init::Ones, false)?;
        Ok(super::llama::RmsNorm::new(weight, eps))
    }

    /// A token embedding table, not decayed; `tied` when it is also the head's weight.
    pub fn token_embedding(
        &mut self,
        name: &str,
        rows: usize,
        dim: usize,
        tied: bool,
    ) -> Result<Tensor> {
        let std = match (self.scheme, tied) {
            (InitScheme::FanIn, false) => 1.0,
            (_, true) => self.weight_std(dim, Role::Plain),
            (InitScheme::Gpt2, false) => 0.02,
        };
        self.param(name, &[rows, dim], Init::Normal(std), false)
    }

    /// A learned position table, not decayed.
    pub fn position_embedding(&mut self, name: &str, rows: usize, dim: usize) -> Result<Tensor> {
        let std = match self.scheme {
            InitScheme::FanIn => 1.0,
            InitScheme::Gpt2 => 0.01,
        };
        self.param(name, &[rows, dim], Init::Normal(std), false)
    }
}

/// LayerNorm, ε = 1e-5 (fused on the CPU, primitive ops elsewhere: [`super::fused`]).
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        super::fused::layer_norm(x, &self.weight, &self.bias, 1e-5)
    }
}

/// The final norm of either family.
#[derive(Debug, Clone)]
pub enum Norm {
    /// GPT's LayerNorm.
    Layer(LayerNorm),
    /// Llama's RMSNorm.
    Rms(super::llama::RmsNorm),
}

impl Module for Norm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Layer(n) => n.forward(x),
            Self::Rms(n) => n.forward(x),
        }
    }
}

/// What a block needs besides its input.
pub struct Ctx<'a> {
    /// The `[seq_len, seq_len]` causal mask.
    pub mask: &'a Tensor,
    /// The rotary tables (the Llama family).
    pub rope: Option<&'a Rope>,
    /// Position of the input's first token (non-zero when decoding with a cache).
    pub pos: usize,
}

/// One block's keys and values of the tokens seen so far (generation).
#[derive(Debug, Default)]
pub struct KvCache {
    kv: Option<(Tensor, Tensor)>,
}

impl KvCache {
    /// Tokens cached.
    pub fn len(&self) -> usize {
        self.kv
            .as_ref()
            .map_or(0, |(k, _)| k.dims().get(2).copied().unwrap_or(0))
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.kv.is_none()
    }
}

/// This call's keys and values `[B, H, T, hd]`, appended to `cache` when there is one;
/// returns every cached token's.
pub(crate) fn with_cache(
    k: Tensor,
    v: Tensor,
    cache: Option<&mut KvCache>,
) -> Result<(Tensor, Tensor)> {
    let Some(c) = cache else {
        return Ok((k, v));
    };
    let (k, v) = match c.kv.take() {
        Some((k0, v0)) => (Tensor::cat(&[&k0, &k], 2)?, Tensor::cat(&[&v0, &v], 2)?),
        None => (k, v),
    };
    c.kv = Some((k.clone(), v.clone()));
    Ok((k, v))
}

/// softmax(q·kᵀ/√hd + mask)·v for queries `[B, H, T, hd]` at positions `pos..pos+T` of
/// the `S` keys and values `[B, H, S, hd]`.
pub(crate) fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    pos: usize,
) -> Result<Tensor> {
    let hd = q.dim(3)?;
    let att = q.matmul(&k.t()?)?;
    super::fused::causal_softmax(&att, 1.0 / (hd as f64).sqrt(), pos, mask)?.matmul(v)
}

/// Causal multi-head self-attention.
#[derive(Debug, Clone)]
pub struct Attention {
    qkv: Linear,
    proj: Linear,
    n_heads: usize,
}

impl Attention {
    /// Attends over `x` `[B, T, D]` (and the cached tokens before it).
    pub fn forward(
        &self,
        x: &Tensor,
        ctx: &Ctx<'_>,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let (b, t, c) = x.dims3()?;
        let hd = c / self.n_heads;
        let qkv = super::fused::linear(x, &self.qkv)?
            .reshape((b, t, 3, self.n_heads, hd))?
            .permute((2, 0, 3, 1, 4))?; // [3, b, h, t, hd]
        let q = qkv.get(0)?.contiguous()?;
        let k = qkv.get(1)?.contiguous()?;
        let v = qkv.get(2)?.contiguous()?;
        let (k, v) = with_cache(k, v, cache)?;
        let y = attend(&q, &k, &v, ctx.mask, ctx.pos)?;
        let y = y.transpose(1, 2)?.reshape((b, t, c))?;
        super::fused::linear(&y, &self.proj)
    }
}

/// A block of either family.
#[derive(Debug, Clone)]
pub enum Block {
    /// GPT-2's.
    Gpt(GptBlock),
    /// Llama's.
    Llama(LlamaBlock),
}

impl Block {
    /// Block `i` of the config's family.
    pub(crate) fn new(b: &mut Builder<'_>, cfg: &ModelConfig, i: usize) -> Result<Self> {
        Ok(match cfg.family {
            Family::Gpt => Self::Gpt(GptBlock::new(b, cfg, i)?),
            Family::Llama => Self::Llama(LlamaBlock::new(b, cfg, i)?),
        })
    }

    /// Applies the block to `[B, T, D]`.
    pub fn forward(
        &self,
        x: &Tensor,
        ctx: &Ctx<'_>,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        match self {
            Self::Gpt(g) => g.forward(x, ctx, cache),
            Self::Llama(l) => l.forward(x, ctx, cache),
        }
    }
}

/// A pre-LayerNorm transformer block: x + attn(ln1(x)), then + mlp(ln2(·)).
#[derive(Debug, Clone)]
pub struct GptBlock {
    ln1: LayerNorm,
    attn: Attention,
    ln2: LayerNorm,
    fc: Linear,
    proj: Linear,
}

impl GptBlock {
    /// Block `i`'s parameters, named `h.{i}.*`.
    pub(crate) fn new(b: &mut Builder<'_>, cfg: &ModelConfig, i: usize) -> Result<Self> {
        let d = cfg.d_model;
        let (plain, residual) = (Role::Plain, Role::Residual);
        let p = format!("h.{i}");
        Ok(Self {
            ln1: b.layer_norm(&format!("{p}.ln1"), d)?,
            attn: Attention {
                qkv: b.linear(&format!("{p}.attn.qkv"), d, 3 * d, plain, true)?,
                proj: b.linear(&format!("{p}.attn.proj"), d, d, residual, true)?,
                n_heads: cfg.n_heads,
            },
            ln2: b.layer_norm(&format!("{p}.ln2"), d)?,
            fc: b.linear(&format!("{p}.mlp.fc"), d, cfg.ffn(), plain, true)?,
            proj: b.linear(&format!("{p}.mlp.proj"), cfg.ffn(), d, residual, true)?,
        })
    }

    /// Applies the block to `[B, T, D]`.
    pub fn forward(
        &self,
        x: &Tensor,
        ctx: &Ctx<'_>,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let x = (x + self.attn.forward(&self.ln1.forward(x)?, ctx, cache)?)?;
        let h = super::fused::gelu(&super::fused::linear(&self.ln2.forward(&x)?, &self.fc)?)?;
        x + super::fused::linear(&h, &self.proj)?
    }
}

/// `[T, T]` additive causal mask: 0 where key ≤ query, −1e9 above the diagonal.
pub fn causal_mask(t: usize, device: &Device, dtype: DType) -> Result<Tensor> {
    let v: Vec<f32> = (0..t)
        .flat_map(|q| (0..t).map(move |k| if k <= q { 0.0 } else { -1e9 }))
        .collect();
    Tensor::from_vec(v, (t, t), device)?.to_dtype(dtype)
}
