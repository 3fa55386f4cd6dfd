//! Subspace activations: the residual stream kept in a fixed low-rank subspace, so a stage
//! boundary carries `rank` numbers per token instead of `d_model` (the idea of Protocol
//! Models' subspace networks, arXiv 2506.01260).
//!
//! Every weight that writes the residual stream (attention output, MLP down, the trained
//! part of the token embedding) writes into the span of one orthonormal basis `U`
//! (`d_model × rank`), the same on every stage: the weight is stored as `W̃` (`rank × in`)
//! and applied as `U·W̃`. The token embedding is a fixed high-rank table `F` (drawn from
//! the model's seed, never trained, recomputed from the token ids on every stage) plus the
//! trained `Ê·Uᵀ`. So at any depth the residual stream is exactly `F[tokens] + c·Uᵀ`, and a
//! stage sends `c` (`[B, T, rank]`) and the token ids, packed as one `[B, T, rank + 1]`
//! tensor whose last column holds the ids (the wire carries that column exactly:
//! [`crate::wire::CodecSpec::ids_last`]). The receiver rebuilds the stream without loss; the
//! gradient it returns is `g·U`, the exact gradient of `c`. Only the activation codec on
//! top (int8 by default) loses anything.
//!
//! Export to Hugging Face multiplies the factors back out (`o_proj = U·W̃`,
//! `embed_tokens = F + Ê·Uᵀ`): the exported model is a plain Llama.

use crate::config::{InitScheme, RunConfig};
use candle_core::{DType, Device, Result, Tensor};
use std::collections::HashMap;

/// The shared basis and fixed embedding of a subspace model.
#[derive(Debug, Clone)]
pub struct Subspace {
    rank: usize,
    d: usize,
    seed: u64,
    /// Half-width of the fixed embedding's uniform entries.
    half: f32,
    /// `U`, `[d, rank]`, orthonormal columns.
    basis: Tensor,
    /// `Uᵀ`, `[rank, d]`, contiguous.
    basis_t: Tensor,
    dtype: DType,
}

impl Subspace {
    /// The subspace of rank `rank` in a stream `d` wide, drawn from `seed`; the fixed
    /// embedding's entries have standard deviation `std`.
    pub fn new(
        d: usize,
        rank: usize,
        seed: u64,
        std: f64,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        if rank == 0 || rank > d {
            candle_core::bail!("subspace rank {rank} must be in 1..={d}");
        }
        let u = orthonormal(d, rank, crate::rng::derive_seed(seed, "subspace-basis"));
        let basis = Tensor::from_vec(u, (d, rank), device)?.to_dtype(dtype)?;
        let basis_t = basis.t()?.contiguous()?;
        Ok(Self {
            rank,
            d,
            seed: crate::rng::derive_seed(seed, "subspace-fixed-embedding"),
            half: (3.0f64.sqrt() * std) as f32,
            basis,
            basis_t,
            dtype,
        })
    }

    /// The subspace of `cfg`'s run, if it keeps its stream in one. The fixed embedding
    /// has the spread of an untied token embedding of the run's initialisation.
    pub fn of(cfg: &RunConfig, device: &Device, dtype: DType) -> Result<Option<Self>> {
        let Some(rank) = cfg.codecs.activations.subspace else {
            return Ok(None);
        };
        let m = &cfg.model;
        let std = match m.init {
            InitScheme::FanIn => 1.0,
            InitScheme::Gpt2 => 0.02,
        };
        Self::new(m.d_model, rank as usize, m.seed, std, device, dtype).map(Some)
    }

    /// The rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The last dim of a boundary tensor: the coefficients, then the token id.
    pub fn width(&self) -> usize {
        self.rank + 1
    }

    /// `F[ids]`: the fixed embedding of `ids` (`[B, T]` u32) as `[B, T, d]`.
    pub fn fixed(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let flat = ids.flatten_all()?.to_vec1::<u32>()?;
        let mut rows: HashMap<u32, usize> = HashMap::new();
        let mut table: Vec<f32> = Vec::new();
        let mut index = Vec::with_capacity(flat.len());
        for &id in &flat {
            let at = *rows.entry(id).or_insert_with(|| {
                let at = table.len() / self.d;
                table.extend((0..self.d).map(|j| self.entry(id, j)));
                at
            });
            index.push(at as u32);
        }
        let n = table.len() / self.d;
        let dev = ids.device();
        let table = Tensor::from_vec(table, (n, self.d), dev)?.to_dtype(self.dtype)?;
        let index = Tensor::from_vec(index, b * t, dev)?;
        table.index_select(&index, 0)?.reshape((b, t, self.d))
    }

    /// Entry `j` of the fixed embedding of token `id`: uniform in ±`half`, from a hash.
    fn entry(&self, id: u32, j: usize) -> f32 {
        let h = crate::rng::mix64(self.seed ^ ((id as u64) << 32) ^ j as u64);
        let unit = (h >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
        (2.0 * unit - 1.0) * self.half
    }

    /// The whole fixed table `[vocab, d]` (export only).
    pub fn fixed_table(&self, vocab: usize, device: &Device) -> Result<Tensor> {
        let v: Vec<f32> = (0..vocab as u32)
            .flat_map(|id| (0..self.d).map(move |j| (id, j)))
            .map(|(id, j)| self.entry(id, j))
            .collect();
        Tensor::from_vec(v, (vocab, self.d), device)?.to_dtype(self.dtype)
    }

    /// `y·Uᵀ`: a residual write of `[.., rank]` into the stream `[.., d]`.
    pub fn lift(&self, y: &Tensor) -> Result<Tensor> {
        y.broadcast_matmul(&self.basis_t)
    }

    /// The stream `F[ids] + c·Uᵀ` from coefficients `c` `[B, T, rank]`.
    pub fn expand(&self, fixed: &Tensor, c: &Tensor) -> Result<Tensor> {
        fixed + self.lift(c)?
    }

    /// The coefficients `(x − F[ids])·U` of a stream `x` `[B, T, d]`.
    pub fn project(&self, x: &Tensor, fixed: &Tensor) -> Result<Tensor> {
        (x - fixed)?.broadcast_matmul(&self.basis)
    }

    /// The boundary tensor `[B, T, rank + 1]`: `c`, then the ids as floats (no gradient
    /// flows into that column).
    pub fn pack(&self, c: &Tensor, ids: &Tensor) -> Result<Tensor> {
        let col = ids
            .to_dtype(DType::F32)?
            .to_dtype(c.dtype())?
            .unsqueeze(2)?;
        Tensor::cat(&[c, &col.detach()], 2)
    }

    /// Splits a boundary tensor into its coefficients (still attached to `input`'s graph)
    /// and its token ids; `None` when the id column does not hold ids below `vocab`.
    pub fn unpack(&self, input: &Tensor, vocab: usize) -> Result<Option<(Tensor, Tensor)>> {
        let c = input.narrow(2, 0, self.rank)?;
        let col = input
            .narrow(2, self.rank, 1)?
            .squeeze(2)?
            .detach()
            .to_dtype(DType::F32)?;
        let (b, t) = col.dims2()?;
        let v = col.flatten_all()?.to_vec1::<f32>()?;
        let valid = |x: f32| x.fract() == 0.0 && x >= 0.0 && (x as usize) < vocab;
        if !v.iter().all(|&x| valid(x)) {
            return Ok(None);
        }
        let ids: Vec<u32> = v.into_iter().map(|x| x as u32).collect();
        Ok(Some((c, Tensor::from_vec(ids, (b, t), input.device())?)))
    }

    /// `U·W̃`: the full weight `[d, in]` of a residual projection stored as `W̃` `[rank, in]`.
    pub fn full_weight(&self, w: &Tensor) -> Result<Tensor> {
        self.basis.matmul(&w.to_dtype(self.dtype)?)
    }
}

/// `k` orthonormal columns of a `d × k` matrix (row-major), by Gram–Schmidt (twice, for
/// accuracy) on Gaussian columns drawn from `seed`.
fn orthonormal(d: usize, k: usize, seed: u64) -> Vec<f32> {
    let mut rng = crate::rng::Rng::new(seed);
    let mut cols: Vec<Vec<f64>> = Vec::with_capacity(k);
    while cols.len() < k {
        let mut v: Vec<f64> = (0..d).map(|_| rng.normal()).collect();
        for _ in 0..2 {
            for c in &cols {
                let dot: f64 = v.iter().zip(c).map(|(a, b)| a * b).sum();
                for (x, y) in v.iter_mut().zip(c) {
                    *x -= dot * y;
                }
            }
        }
        let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        // A draw (almost) inside the span of the others is drawn again.
        if norm > 1e-6 {
            cols.push(v.into_iter().map(|x| x / norm).collect());
        }
    }
    (0..d)
        .flat_map(|i| cols.iter().map(move |c| c[i] as f32))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_in_the_subspace_crosses_a_boundary_exactly() -> Result<()> {
        let dev = Device::Cpu;
        let s = Subspace::new(32, 4, 9, 1.0, &dev, DType::F64)?;
        // Orthonormal: Uᵀ·U = I.
        let gram = s.basis_t.matmul(&s.basis)?;
        let eye = Tensor::eye(4, DType::F64, &dev)?;
        let err = (gram - eye)?.abs()?.max_all()?.to_scalar::<f64>()?;
        assert!(err < 1e-6, "{err}");
        // The same ids give the same fixed rows, on any call; other ids other rows.
        let ids = Tensor::new(&[[3u32, 7, 3], [0, 7, 1]], &dev)?;
        let f = s.fixed(&ids)?;
        let rows = f.to_vec3::<f64>()?;
        assert_eq!(rows[0][0], rows[0][2]);
        assert_eq!(rows[0][1], rows[1][1]);
        assert_ne!(rows[0][0], rows[1][0]);
        let table = s.fixed_table(8, &dev)?.to_vec2::<f64>()?;
        assert_eq!(table[3], rows[0][0]);
        // F + c·Uᵀ packed as c and ids, unpacked and expanded again: the same stream.
        let c = Tensor::randn(0f64, 1.0, (2, 3, 4), &dev)?;
        let x = s.expand(&f, &c)?;
        let packed = s.pack(&s.project(&x, &f)?, &ids)?;
        assert_eq!(packed.dims(), &[2, 3, 5]);
        let (c2, ids2) = s
            .unpack(&packed, 8)?
            .ok_or(candle_core::Error::Msg("ids".into()))?;
        assert_eq!(ids2.to_vec2::<u32>()?, ids.to_vec2::<u32>()?);
        let x2 = s.expand(&s.fixed(&ids2)?, &c2)?;
        let err = (x - x2)?.abs()?.max_all()?.to_scalar::<f64>()?;
        assert!(err < 1e-6, "{err}");
        // An id column that is not ids of this vocab is refused.
        assert!(s.unpack(&packed, 7)?.is_none());
        let half = (packed.clone() * 0.5)?;
        assert!(s.unpack(&half, 8)?.is_none());
        assert!(Subspace::new(8, 0, 1, 1.0, &dev, DType::F32).is_err());
        assert!(Subspace::new(8, 9, 1, 1.0, &dev, DType::F32).is_err());
        Ok(())
    }
}
