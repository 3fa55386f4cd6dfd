//! The `[model]` table: the decoder's family and shape, with its defaults and checks.
//!
//! Two families: `gpt` (pre-LayerNorm, GELU MLP, learned positions, biases: GPT-2's block)
//! and `llama` (RMSNorm, rotary positions, SwiGLU MLP, no biases, optional grouped-query
//! attention and tied embeddings). Fields a family does not use are refused, so a config
//! says what it trains.

use serde::{Deserialize, Serialize};

/// Which block the decoder is built from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// GPT-2's block: LayerNorm, GELU MLP, learned positions, biases.
    #[default]
    Gpt,
    /// Llama's block: RMSNorm, rotary positions, SwiGLU MLP, no biases.
    Llama,
}

impl Family {
    fn is_gpt(&self) -> bool {
        *self == Family::Gpt
    }
}

/// How parameters start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InitScheme {
    /// Scaled by width (PyTorch's default variance): weights N(0, 1/(3·fan_in)), token and
    /// position embeddings N(0, 1) (a tied embedding is the head's, so N(0, 1/(3·d))). At
    /// GPT-2 small's width this is GPT-2's 0.02; narrower models start larger and train
    /// markedly better (scripts/parity.sh, BENCHMARKS.md).
    #[default]
    FanIn,
    /// GPT-2's: every weight and the token embedding N(0, 0.02²), the residual projections
    /// scaled by 1/√(2·n_layers), positions N(0, 0.01²).
    Gpt2,
}

/// The decoder's shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// `gpt` (the default) or `llama`.
    #[serde(default, skip_serializing_if = "Family::is_gpt")]
    pub family: Family,
    /// `fan_in` (the default) or `gpt2`: see [`InitScheme`].
    #[serde(default)]
    pub init: InitScheme,
    /// Vocabulary size (token ids are below it).
    pub vocab: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Attention heads per block (must divide `d_model`).
    pub n_heads: usize,
    /// Sequence length the model is trained on.
    pub seq_len: usize,
    /// Seed of the deterministic parameter initialisation.
    #[serde(default = "d_seed")]
    pub seed: u64,
    /// MLP hidden width over `d_model` (default 4; a `llama` MLP of ratio r is
    /// 2·r·d_model/3 wide, the same parameter count as a GELU MLP of ratio r).
    #[serde(default = "d_mlp_ratio")]
    pub mlp_ratio: usize,
    /// `llama`: the MLP's hidden width, overriding `mlp_ratio` (Hugging Face's
    /// `intermediate_size`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ffn_hidden: Option<usize>,
    /// `llama`: key/value heads (grouped-query attention; default `n_heads`). Must divide
    /// `n_heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_kv_heads: Option<usize>,
    /// `llama`: the rotary embedding's base (default 10000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// `llama`: RMSNorm's ε (default 1e-5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm_eps: Option<f64>,
    /// `llama`: the LM head reuses the token embedding. Both live on one stage only when
    /// the run has one stage, so this needs `stages.count = 1`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tie_embeddings: bool,
}

impl Default for ModelConfig {
    /// The tiny GPT of `configs/tiny.toml`.
    fn default() -> Self {
        Self {
            family: Family::Gpt,
            init: InitScheme::FanIn,
            vocab: 16,
            d_model: 64,
            n_layers: 4,
            n_heads: 4,
            seq_len: 64,
            seed: d_seed(),
            mlp_ratio: d_mlp_ratio(),
            ffn_hidden: None,
            n_kv_heads: None,
            rope_theta: None,
            norm_eps: None,
            tie_embeddings: false,
        }
    }
}

fn d_seed() -> u64 {
    1
}

fn d_mlp_ratio() -> usize {
    4
}

impl ModelConfig {
    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads.max(1)
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.n_kv_heads.unwrap_or(self.n_heads)
    }

    /// The MLP's hidden width.
    pub fn ffn(&self) -> usize {
        match (self.family, self.ffn_hidden) {
            (_, Some(h)) => h,
            (Family::Gpt, None) => self.mlp_ratio * self.d_model,
            (Family::Llama, None) => (2 * self.mlp_ratio * self.d_model / 3).div_ceil(8) * 8,
        }
    }

    /// The rotary base.
    pub fn rope_base(&self) -> f64 {
        self.rope_theta.unwrap_or(10_000.0)
    }

    /// The norm's ε.
    pub fn eps(&self) -> f64 {
        self.norm_eps.unwrap_or(1e-5)
    }

    /// Checks the shape, for a run of `stages` stages; the message names the field.
    pub fn validate(&self, stages: usize) -> Result<(), String> {
        let m = self;
        if m.vocab < 2 || m.d_model == 0 || m.n_layers == 0 || m.n_heads == 0 || m.seq_len == 0 {
            return Err("model.vocab ≥ 2 and d_model, n_layers, n_heads, seq_len ≥ 1".into());
        }
        if m.vocab > u32::MAX as usize {
            return Err(format!(
                "model.vocab {} does not fit u32 token ids",
                m.vocab
            ));
        }
        if m.d_model % m.n_heads != 0 {
            return Err(format!(
                "model.n_heads ({}) must divide model.d_model ({})",
                m.n_heads, m.d_model
            ));
        }
        if m.mlp_ratio == 0 || m.ffn_hidden == Some(0) {
            return Err("model.mlp_ratio and model.ffn_hidden must be ≥ 1".into());
        }
        if m.family == Family::Gpt {
            let llama_only = [
                ("ffn_hidden", m.ffn_hidden.is_some()),
                ("n_kv_heads", m.n_kv_heads.is_some()),
                ("rope_theta", m.rope_theta.is_some()),
                ("norm_eps", m.norm_eps.is_some()),
                ("tie_embeddings", m.tie_embeddings),
            ];
            if let Some((f, _)) = llama_only.iter().find(|(_, set)| *set) {
                return Err(format!(
                    "model.{f} is for family = \"llama\"; this model is family = \"gpt\""
                ));
            }
            return Ok(());
        }
        let kv = m.kv_heads();
        if kv == 0 || m.n_heads % kv != 0 {
            return Err(format!(
                "model.n_kv_heads ({kv}) must divide model.n_heads ({})",
                m.n_heads
            ));
        }
        if m.head_dim() % 2 != 0 {
            return Err(format!(
                "rotary embeddings need an even head width; d_model / n_heads = {}",
                m.head_dim()
            ));
        }
        if !m.rope_base().is_finite() || m.rope_base() <= 1.0 {
            return Err("model.rope_theta must be a finite number > 1".into());
        }
        if !(m.eps() > 0.0 && m.eps() < 1.0) {
            return Err("model.norm_eps must be in (0, 1)".into());
        }
        if m.tie_embeddings && stages != 1 {
            return Err(format!(
                "model.tie_embeddings needs stages.count = 1 (the embedding and the head \
                 live on different stages of a {stages}-stage run)"
            ));
        }
        Ok(())
    }
}
