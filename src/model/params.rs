//! A stage's parameters: names, shapes, deterministic initialisation and hashing.
//!
//! Every parameter's initial values are a function of (model seed, parameter name) only, so
//! two peers that build the same stage hold bit-identical weights without talking, and a
//! stage's weights do not depend on which other stages exist.

use crate::rng::{derive_seed, Rng};
use candle_core::{DType, Device, Tensor, Var};

/// How a parameter starts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// N(0, std²).
    Normal(f64),
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
}

/// The parameters of one stage, in a fixed order (the order they were declared in).
#[derive(Debug, Clone)]
pub struct ParamSet {
    seed: u64,
    device: Device,
    dtype: DType,
    names: Vec<String>,
    vars: Vec<Var>,
    decay: Vec<bool>,
}

/// Hands the next `k` values, in slices, to a callback: `read(k, f)`.
pub type ReadValues<'a> = dyn FnMut(usize, &mut dyn FnMut(&[f32])) + 'a;

impl ParamSet {
    /// An empty set whose parameters will be initialised from `seed` on `device` in `dtype`.
    pub(crate) fn new(seed: u64, device: &Device, dtype: DType) -> Self {
        Self {
            seed,
            device: device.clone(),
            dtype,
            names: Vec::new(),
            vars: Vec::new(),
            decay: Vec::new(),
        }
    }

    /// Creates, initialises and records a parameter; returns its tensor (which tracks the
    /// variable, so layers built from it see optimizer updates).
    pub(crate) fn add(
        &mut self,
        name: &str,
        shape: &[usize],
        init: Init,
        decay: bool,
    ) -> candle_core::Result<Tensor> {
        let n: usize = shape.iter().product();
        let values: Vec<f64> = match init {
            Init::Normal(std) => {
                let mut rng = Rng::new(derive_seed(self.seed, name));
                (0..n).map(|_| rng.normal() * std).collect()
            }
            Init::Zeros => vec![0.0; n],
            Init::Ones => vec![1.0; n],
        };
        // Generated as f64 and rounded once, so f32 and f64 models start from the same point.
        let t = Tensor::from_vec(values, shape, &self.device)?.to_dtype(self.dtype)?;
        let var = Var::from_tensor(&t)?;
        let tensor = var.as_tensor().clone();
        self.names.push(name.to_string());
        self.vars.push(var);
        self.decay.push(decay);
        Ok(tensor)
    }

    /// Parameter names in order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The variables in order.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// Whether weight decay applies to each parameter (matrices yes; biases, norms,
    /// embeddings no).
    pub fn decay(&self) -> &[bool] {
        &self.decay
    }

    /// Number of parameter tensors.
    pub fn len(&self) -> usize {
        self.vars.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.vars.is_empty()
    }

    /// Total scalar parameters.
    pub fn numel(&self) -> usize {
        self.vars.iter().map(|v| v.elem_count()).sum()
    }

    /// xxh3-64 over every parameter's bytes in order: equal hashes mean bit-identical weights.
    pub fn hash(&self) -> candle_core::Result<u64> {
        let values: Vec<&Tensor> = self.vars.iter().map(|v| v.as_tensor()).collect();
        self.hash_values(&values)
    }

    /// The hash these parameters would have holding `flat` (f32, in parameter order):
    /// [`Self::hash`] of f32 values read straight from a downloaded state.
    pub fn hash_flat(&self, flat: &[f32]) -> u64 {
        let mut at = 0;
        self.hash_read(&mut |k, f| {
            let k = k.min(flat.len().saturating_sub(at));
            f(&flat[at..at + k]);
            at += k;
        })
    }

    /// [`Self::hash_flat`] of values that `read(k, f)` hands to `f`, in slices, `k` per
    /// parameter in order: a state that is not one slice is hashed where it lies.
    pub fn hash_read(&self, read: &mut ReadValues<'_>) -> u64 {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for (name, v) in self.names.iter().zip(&self.vars) {
            h.update(name.as_bytes());
            read(v.elem_count(), &mut |s| h.update(bytemuck::cast_slice(s)));
        }
        h.digest()
    }

    /// The hash these parameters would have holding `values` (in parameter order): lets a
    /// downloaded state be checked before it replaces anything.
    pub fn hash_values(&self, values: &[&Tensor]) -> candle_core::Result<u64> {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for (name, t) in self.names.iter().zip(values) {
            h.update(name.as_bytes());
            let flat = t.flatten_all()?;
            match flat.dtype() {
                DType::F64 => h.update(bytemuck::cast_slice(&flat.to_vec1::<f64>()?)),
                _ => h.update(bytemuck::cast_slice(
                    &flat.to_dtype(DType::F32)?.to_vec1::<f32>()?,
                )),
            }
        }
        Ok(h.digest())
    }
}
