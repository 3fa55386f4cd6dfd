//! One pipeline stage: a contiguous slice of the decoder with its own parameters.
//!
//! Stage 0 holds the token and position embeddings, the last stage the final norm, the LM
//! head and the loss. A stage computes; it never calls the network. Backward recomputes
//! the forward from the input it is given (what a remote replica does: it keeps no
//! activations between calls), so `backward(input, ·)` needs only the input and the
//! upstream gradient or targets.

use super::layers::{causal_mask, Block, Builder, Ctx, KvCache, Norm, Role};
use super::llama::Rope;
use super::params::ParamSet;
use super::subspace::Subspace;
use super::ModelError;
use crate::config::{Family, ModelConfig, RunConfig};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::Linear;

/// What flows into a stage's backward from downstream.
#[derive(Debug, Clone, Copy)]
pub enum Upstream<'a> {
    /// d(loss)/d(output), for every stage but the last.
    Grad(&'a Tensor),
    /// Target token ids `[B, T]` (u32), for the last stage, which computes the loss itself.
    Targets(&'a Tensor),
}

/// A forward pass kept with its graph for a later backward.
#[derive(Debug)]
pub struct Kept {
    input: Tensor,
    input_var: Option<Var>,
    out: Tensor,
}

impl Kept {
    /// The forward's output (still attached to the graph; detach before sending).
    pub fn output(&self) -> &Tensor {
        &self.out
    }

    /// The shape of the input it was computed from.
    pub fn input_dims(&self) -> &[usize] {
        self.input.dims()
    }
}

/// The result of a stage's backward.
#[derive(Debug, Clone)]
pub struct StageGrads {
    /// The loss, when this stage computed it.
    pub loss: Option<f32>,
    /// d(loss)/d(input); `None` on stage 0, whose input is token ids.
    pub grad_input: Option<Tensor>,
    /// One gradient per parameter, in [`ParamSet`] order (zeros where none flowed).
    pub grads: Vec<Tensor>,
}

struct Embed {
    wte: Tensor,
    /// Learned positions (GPT).
    wpe: Option<Tensor>,
}

struct Head {
    norm: Norm,
    lm_head: Linear,
}

/// A stage of the model.
pub struct Stage {
    index: usize,
    count: usize,
    blocks_range: (usize, usize),
    cfg: ModelConfig,
    params: ParamSet,
    embed: Option<Embed>,
    blocks: Vec<Block>,
    head: Option<Head>,
    mask: Tensor,
    rope: Option<Rope>,
    /// The residual stream's subspace (`codecs.activations = "subspace:R"`).
    sub: Option<Subspace>,
    device: Device,
    dtype: DType,
}

impl std::fmt::Debug for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stage")
            .field("index", &self.index)
            .field("count", &self.count)
            .field("blocks", &self.blocks_range)
            .field("params", &self.params.numel())
            .finish()
    }
}

impl Stage {
    /// Builds stage `index` of the config's cut, in f32.
    pub fn new(cfg: &RunConfig, index: usize, device: &Device) -> Result<Self, ModelError> {
        Self::with_dtype(cfg, index, device, DType::F32)
    }

    /// Builds stage `index` in `dtype` (f64 is for numerical tests).
    pub fn with_dtype(
        cfg: &RunConfig,
        index: usize,
        device: &Device,
        dtype: DType,
    ) -> Result<Self, ModelError> {
        let ranges = cfg.stage_ranges();
        let &(lo, hi) = ranges.get(index).ok_or_else(|| {
            ModelError::BadInput(format!("stage {index} of a {}-stage run", ranges.len()))
        })?;
        let m = cfg.model.clone();
        let mut params = ParamSet::new(m.seed, device, dtype);
        let mut b = Builder {
            params: &mut params,
            scheme: m.init,
            n_layers: m.n_layers,
            subspace: None,
        };
        b.subspace = Subspace::of(cfg, device, dtype)?;
        let sub = b.subspace.clone();
        let llama = m.family == Family::Llama;
        let embed = match (index, llama) {
            (0, false) => Some(Embed {
                wte: b.token_embedding("wte", m.vocab, m.d_model, false)?,
                wpe: Some(b.position_embedding("wpe", m.seq_len, m.d_model)?),
            }),
            (0, true) => Some(Embed {
                // Under a subspace the trained part of the embedding, Ê (`[vocab, rank]`).
                wte: match &sub {
                    Some(s) => {
                        b.token_embedding("model.embed_tokens.sub", m.vocab, s.rank(), false)?
                    }
                    None => b.token_embedding(
                        "model.embed_tokens.weight",
                        m.vocab,
                        m.d_model,
                        m.tie_embeddings,
                    )?,
                },
                wpe: None,
            }),
            _ => None,
        };
        // The last stage's blocks write the stream at full rank: nothing leaves it but
        // logits.
        if index + 1 == ranges.len() {
            b.subspace = None;
        }
        let blocks = (lo..hi)
            .map(|i| Block::new(&mut b, &m, i))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let head = match (index + 1 == ranges.len(), llama) {
            (false, _) => None,
            (true, false) => Some(Head {
                norm: Norm::Layer(b.layer_norm("ln_f", m.d_model)?),
                lm_head: b.linear("lm_head", m.d_model, m.vocab, Role::Plain, false)?,
            }),
            (true, true) => Some(Head {
                norm: Norm::Rms(b.rms_norm("model.norm", m.d_model, m.eps())?),
                lm_head: match (&embed, m.tie_embeddings) {
                    (Some(e), true) => Linear::new(e.wte.clone(), None),
                    _ => b.linear("lm_head", m.d_model, m.vocab, Role::Plain, false)?,
                },
            }),
        };
        let rope = if llama {
            Some(Rope::new(
                m.seq_len,
                m.head_dim(),
                m.rope_base(),
                device,
                dtype,
            )?)
        } else {
            None
        };
        let mask = causal_mask(m.seq_len, device, dtype)?;
        Ok(Self {
            index,
            count: ranges.len(),
            blocks_range: (lo, hi),
            cfg: m,
            params,
            embed,
            blocks,
            head,
            mask,
            rope,
            sub,
            device: device.clone(),
            dtype,
        })
    }

    /// This stage's index.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Whether this stage takes token ids.
    pub fn is_first(&self) -> bool {
        self.index == 0
    }

    /// Whether this stage computes the loss.
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.count
    }

    /// The blocks this stage holds, `[start, end)`.
    pub fn blocks(&self) -> (usize, usize) {
        self.blocks_range
    }

    /// The longest sequence the model takes.
    pub fn seq_len(&self) -> usize {
        self.cfg.seq_len
    }

    /// The parameters.
    pub fn params(&self) -> &ParamSet {
        &self.params
    }

    /// The device the stage computes on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The parameter dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Checks an input's dtype, rank and size before computing on it.
    pub fn check_input(&self, input: &Tensor) -> Result<(), ModelError> {
        let dims = input.dims();
        if self.is_first() {
            let ok = input.dtype() == DType::U32
                && dims.len() == 2
                && dims[1] >= 1
                && dims[1] <= self.cfg.seq_len;
            if !ok {
                return Err(ModelError::BadInput(format!(
                    "stage 0 takes u32 token ids [batch, ≤{}], got {:?} {dims:?}",
                    self.cfg.seq_len,
                    input.dtype()
                )));
            }
            self.check_ids(input, "token")?;
        } else {
            let width = self.boundary_width();
            let ok = input.dtype() == self.dtype
                && dims.len() == 3
                && dims[1] >= 1
                && dims[1] <= self.cfg.seq_len
                && dims[2] == width;
            if !ok {
                return Err(ModelError::BadInput(format!(
                    "stage {} takes {:?} activations [batch, ≤{}, {width}], got {:?} {dims:?}",
                    self.index,
                    self.dtype,
                    self.cfg.seq_len,
                    input.dtype()
                )));
            }
            if let Some(s) = &self.sub {
                if s.unpack(input, self.cfg.vocab)?.is_none() {
                    return Err(ModelError::BadInput(format!(
                        "the last column of stage {}'s input must hold token ids below {}",
                        self.index, self.cfg.vocab
                    )));
                }
            }
        }
        Ok(())
    }

    /// The last dim of the tensors this stage takes from or sends to a neighbour:
    /// `d_model`, or the subspace's rank and the token id.
    pub fn boundary_width(&self) -> usize {
        self.sub.as_ref().map_or(self.cfg.d_model, Subspace::width)
    }

    /// A valid input of `batch × seq` for this stage, for measuring it: token ids on stage
    /// 0, else random activations (with token ids in their last column under a subspace).
    pub fn example_input(&self, batch: usize, seq: usize) -> Result<Tensor, ModelError> {
        let dev = &self.device;
        if self.is_first() {
            return Ok(Tensor::zeros((batch, seq), DType::U32, dev)?);
        }
        let acts = Tensor::randn(0f32, 1.0, (batch, seq, self.boundary_width()), dev)?;
        let acts = match &self.sub {
            Some(s) => {
                let ids = Tensor::zeros((batch, seq), DType::U32, dev)?;
                s.pack(&acts.narrow(2, 0, s.rank())?, &ids)?
            }
            None => acts,
        };
        Ok(acts.to_dtype(self.dtype)?)
    }

    /// A gradient of this stage's output for measuring it (the targets on the last stage).
    pub fn example_upstream(&self, batch: usize, seq: usize) -> Result<Tensor, ModelError> {
        let dev = &self.device;
        if self.is_last() {
            return Ok(Tensor::zeros((batch, seq), DType::U32, dev)?);
        }
        let g = Tensor::randn(0f32, 1.0, (batch, seq, self.boundary_width()), dev)? * 1e-3;
        Ok(g?.to_dtype(self.dtype)?)
    }

    /// Every id in a u32 tensor is below the vocab size.
    fn check_ids(&self, ids: &Tensor, what: &str) -> Result<(), ModelError> {
        let max = ids.flatten_all()?.max(0)?.to_scalar::<u32>()?;
        if max as usize >= self.cfg.vocab {
            return Err(ModelError::BadInput(format!(
                "{what} id {max} is outside the vocab of {}",
                self.cfg.vocab
            )));
        }
        Ok(())
    }

    fn check_targets(&self, input: &Tensor, targets: &Tensor) -> Result<(), ModelError> {
        let want = &input.dims()[..2];
        if targets.dtype() != DType::U32 || targets.dims() != want {
            return Err(ModelError::BadInput(format!(
                "targets must be u32 {want:?}, got {:?} {:?}",
                targets.dtype(),
                targets.dims()
            )));
        }
        self.check_ids(targets, "target")
    }

    fn run(&self, input: &Tensor) -> candle_core::Result<Tensor> {
        self.run_at(input, 0, None)
    }

    /// The forward of tokens at positions `pos..`, through `cache` (one per block) when
    /// decoding.
    fn run_at(
        &self,
        input: &Tensor,
        pos: usize,
        cache: Option<&mut [KvCache]>,
    ) -> candle_core::Result<Tensor> {
        if let Some(s) = &self.sub {
            return self.run_subspace(s, input, pos, cache);
        }
        let x = match &self.embed {
            Some(e) => {
                let (b, t) = input.dims2()?;
                let tok = e.wte.index_select(&input.flatten_all()?, 0)?;
                let tok = tok.reshape((b, t, self.cfg.d_model))?;
                match &e.wpe {
                    Some(wpe) => super::fused::bias_add(&tok, &wpe.narrow(0, pos, t)?)?,
                    None => tok,
                }
            }
            None => input.clone(),
        };
        let x = self.blocks_at(x, pos, cache)?;
        match &self.head {
            Some(h) => h.lm_head.forward(&h.norm.forward(&x)?),
            None => Ok(x),
        }
    }

    /// The stream `x` through this stage's blocks at positions `pos..`.
    fn blocks_at(
        &self,
        mut x: Tensor,
        pos: usize,
        mut cache: Option<&mut [KvCache]>,
    ) -> candle_core::Result<Tensor> {
        let ctx = Ctx {
            mask: &self.mask,
            rope: self.rope.as_ref(),
            pos,
        };
        for (i, block) in self.blocks.iter().enumerate() {
            let c = cache.as_deref_mut().and_then(|c| c.get_mut(i));
            x = block.forward(&x, &ctx, c)?;
        }
        Ok(x)
    }

    /// [`Self::run_at`] under a subspace: the stream is rebuilt from the token ids and the
    /// coefficients (stage 0: the trained embedding's), and leaves as coefficients and ids.
    fn run_subspace(
        &self,
        s: &Subspace,
        input: &Tensor,
        pos: usize,
        cache: Option<&mut [KvCache]>,
    ) -> candle_core::Result<Tensor> {
        let (coef, ids) = match &self.embed {
            Some(e) => {
                let (b, t) = input.dims2()?;
                let c = e.wte.index_select(&input.flatten_all()?, 0)?;
                (c.reshape((b, t, s.rank()))?, input.clone())
            }
            None => s
                .unpack(input, self.cfg.vocab)?
                .ok_or_else(|| candle_core::Error::Msg("not token ids in the id column".into()))?,
        };
        let fixed = s.fixed(&ids)?;
        let x = self.blocks_at(s.expand(&fixed, &coef)?, pos, cache)?;
        match &self.head {
            Some(h) => h.lm_head.forward(&h.norm.forward(&x)?),
            None => s.pack(&s.project(&x, &fixed)?, &ids),
        }
    }

    /// Generation: the forward of `input` (token ids on stage 0, else activations) at
    /// positions `pos..pos+T`, keeping each block's keys and values in `cache` (grown to one
    /// per block). `pos + T` must not pass the model's `seq_len`.
    pub fn forward_cached(
        &self,
        input: &Tensor,
        pos: usize,
        cache: &mut Vec<KvCache>,
    ) -> Result<Tensor, ModelError> {
        let t = input.dims().get(1).copied().unwrap_or(0);
        if pos + t > self.cfg.seq_len {
            return Err(ModelError::BadInput(format!(
                "positions {pos}..{} pass the model's context of {}",
                pos + t,
                self.cfg.seq_len
            )));
        }
        self.check_input(input)?;
        cache.resize_with(self.blocks.len(), KvCache::default);
        Ok(self.run_at(input, pos, Some(cache))?.detach())
    }

    /// Activations `[B, T, D]`, or logits `[B, T, vocab]` on the last stage.
    pub fn forward(&self, input: &Tensor) -> Result<Tensor, ModelError> {
        self.check_input(input)?;
        Ok(self.run(input)?.detach())
    }

    /// Mean cross-entropy of the last stage's logits against `targets`.
    pub fn loss(&self, input: &Tensor, targets: &Tensor) -> Result<Tensor, ModelError> {
        self.check_input(input)?;
        self.check_targets(input, targets)?;
        self.loss_of(&self.run(input)?, targets)
    }

    fn loss_of(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor, ModelError> {
        if !self.is_last() {
            return Err(ModelError::BadInput(format!(
                "stage {} is not the last stage and has no loss",
                self.index
            )));
        }
        let (b, t, v) = logits.dims3()?;
        let flat = logits.reshape((b * t, v))?;
        Ok(super::fused::cross_entropy(&flat, &targets.flatten_all()?)?)
    }

    /// A forward that keeps its autograd graph, so a later [`Stage::backward_kept`] needs
    /// no recomputation and sees exactly the activations this forward produced.
    pub fn forward_kept(&self, input: &Tensor) -> Result<Kept, ModelError> {
        self.check_input(input)?;
        let input_var = if self.is_first() {
            None
        } else {
            Some(Var::from_tensor(input)?)
        };
        let x = input_var.as_ref().map_or(input, |v| v.as_tensor());
        let out = self.run(x)?;
        Ok(Kept {
            input: input.clone(),
            input_var,
            out,
        })
    }

    /// Back-propagates `upstream` through a kept forward.
    pub fn backward_kept(
        &self,
        kept: Kept,
        upstream: Upstream<'_>,
    ) -> Result<StageGrads, ModelError> {
        let Kept {
            input,
            input_var,
            out,
        } = kept;
        self.backward_from(&input, input_var, out, upstream)
    }

    /// Recomputes the forward from `input` and back-propagates `upstream` through it.
    pub fn backward(
        &self,
        input: &Tensor,
        upstream: Upstream<'_>,
    ) -> Result<StageGrads, ModelError> {
        let kept = self.forward_kept(input)?;
        self.backward_kept(kept, upstream)
    }

    fn backward_from(
        &self,
        input: &Tensor,
        input_var: Option<Var>,
        out: Tensor,
        upstream: Upstream<'_>,
    ) -> Result<StageGrads, ModelError> {
        let (objective, loss) = match upstream {
            Upstream::Targets(targets) => {
                self.check_targets(input, targets)?;
                let loss = self.loss_of(&out, targets)?;
                let value = loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
                (loss, Some(value))
            }
            Upstream::Grad(g) => {
                if self.is_last() {
                    return Err(ModelError::BadInput(
                        "the last stage takes targets, not an output gradient".into(),
                    ));
                }
                if g.dims() != out.dims() || g.dtype() != out.dtype() {
                    return Err(ModelError::BadInput(format!(
                        "output gradient must be {:?} {:?}, got {:?} {:?}",
                        out.dtype(),
                        out.dims(),
                        g.dtype(),
                        g.dims()
                    )));
                }
                // d/dθ of Σ(out ⊙ g) is the vector-Jacobian product we want.
                ((&out * g)?.sum_all()?, None)
            }
        };
        let store = objective.backward()?;
        let grads = self
            .params
            .vars()
            .iter()
            .map(|v| match store.get(v.as_tensor()) {
                Some(g) => Ok(g.clone()),
                None => v.as_tensor().zeros_like(),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let grad_input = match &input_var {
            Some(v) => Some(match store.get(v.as_tensor()) {
                Some(g) => g.clone(),
                None => input.zeros_like()?,
            }),
            None => None,
        };
        Ok(StageGrads {
            loss,
            grad_input,
            grads,
        })
    }
}
