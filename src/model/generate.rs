//! Sampling a continuation from a one-stage model with a key/value cache: the prompt is
//! run once, then one token per step; temperature and nucleus (top-p) sampling from a
//! seeded generator, so the same seed gives the same text. Past the model's context the
//! cache is rebuilt from the last half-context of tokens.

use super::layers::KvCache;
use super::stage::Stage;
use super::ModelError;
use crate::rng::Rng;
use candle_core::{DType, Tensor};
use std::time::Instant;

/// How to sample.
#[derive(Debug, Clone, Copy)]
pub struct Sampling {
    /// Tokens to generate, at most.
    pub tokens: usize,
    /// Softmax temperature; 0 picks the most likely token.
    pub temperature: f64,
    /// Keep the smallest set of tokens whose probability reaches this (1 keeps all).
    pub top_p: f64,
    /// Seed of the sampler.
    pub seed: u64,
    /// Stop at this token (end of text), if given.
    pub stop: Option<u32>,
}

/// What was generated.
#[derive(Debug, Clone)]
pub struct Generated {
    /// The new tokens.
    pub tokens: Vec<u32>,
    /// Seconds spent after the prompt was processed.
    pub seconds: f64,
}

impl Generated {
    /// New tokens per second.
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens.len() as f64 / self.seconds.max(1e-9)
    }
}

/// Picks a token from `logits` (one row).
pub fn pick(logits: &[f32], s: &Sampling, rng: &mut Rng) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |best, (i, &x)| {
                if x > best.1 {
                    (i, x)
                } else {
                    best
                }
            })
            .0 as u32
    };
    if s.temperature <= 0.0 {
        return argmax();
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut p: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &x)| (i, ((f64::from(x) - f64::from(max)) / s.temperature).exp()))
        .collect();
    let total: f64 = p.iter().map(|(_, w)| w).sum();
    p.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut kept = 0.0;
    let mut n = 0;
    for (_, w) in &p {
        kept += w / total;
        n += 1;
        if kept >= s.top_p {
            break;
        }
    }
    p.truncate(n.max(1));
    let mass: f64 = p.iter().map(|(_, w)| w).sum();
    let mut u = rng.next_f64() * mass;
    for (i, w) in &p {
        if u < *w {
            return *i as u32;
        }
        u -= w;
    }
    p.last().map_or_else(argmax, |(i, _)| *i as u32)
}

/// Continues `prompt` (token ids; at least one) with the one-stage `model`.
pub fn generate(model: &Stage, prompt: &[u32], s: &Sampling) -> Result<Generated, ModelError> {
    if !model.is_first() || !model.is_last() {
        return Err(ModelError::BadInput(
            "generation needs the whole model in one stage".into(),
        ));
    }
    if prompt.is_empty() {
        return Err(ModelError::BadInput("the prompt has no tokens".into()));
    }
    let ctx = model.seq_len();
    let mut rng = Rng::new(s.seed);
    let mut all: Vec<u32> = prompt.to_vec();
    let mut cache: Vec<KvCache> = Vec::new();
    // The tokens the cache holds, from `start` in `all`.
    let mut start = all.len().saturating_sub(ctx);
    let mut pending: Vec<u32> = all[start..].to_vec();
    let mut out = Vec::new();
    let mut began: Option<Instant> = None;
    while out.len() < s.tokens {
        let pos = all.len() - pending.len() - start;
        if pos + pending.len() > ctx {
            // Past the context: start again from the last half of it.
            start = all.len() - ctx / 2;
            cache.clear();
            pending = all[start..].to_vec();
            continue;
        }
        let input = Tensor::from_vec(pending.clone(), (1, pending.len()), model.device())?;
        let logits = model.forward_cached(&input, pos, &mut cache)?;
        let last = logits
            .get(0)?
            .get(pending.len() - 1)?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        began.get_or_insert_with(Instant::now);
        let next = pick(&last, s, &mut rng);
        if Some(next) == s.stop {
            break;
        }
        out.push(next);
        all.push(next);
        pending = vec![next];
    }
    Ok(Generated {
        tokens: out,
        seconds: began.map_or(0.0, |b| b.elapsed().as_secs_f64()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RunConfig;
    use candle_core::Device;

    #[test]
    fn sampling_follows_temperature_and_top_p() {
        let logits = [0.0f32, 3.0, 1.0, -2.0];
        let mut rng = Rng::new(1);
        let greedy = Sampling {
            tokens: 1,
            temperature: 0.0,
            top_p: 1.0,
            seed: 1,
            stop: None,
        };
        assert_eq!(pick(&logits, &greedy, &mut rng), 1);
        // A tiny top-p keeps the most likely token only.
        let narrow = Sampling {
            temperature: 1.0,
            top_p: 1e-6,
            ..greedy
        };
        assert!((0..50).all(|_| pick(&logits, &narrow, &mut rng) == 1));
        // Full sampling reaches other tokens too.
        let wide = Sampling {
            temperature: 2.0,
            ..greedy
        };
        let picks: std::collections::HashSet<u32> =
            (0..400).map(|_| pick(&logits, &wide, &mut rng)).collect();
        assert!(picks.len() >= 3, "{picks:?}");
    }

    #[test]
    fn cached_decoding_gives_the_uncached_logits() {
        for family in [crate::config::Family::Gpt, crate::config::Family::Llama] {
            let mut cfg = RunConfig::tiny();
            cfg.stages.count = 1;
            cfg.model.family = family;
            let model = Stage::new(&cfg, 0, &Device::Cpu).unwrap();
            let ids: Vec<u32> = (0..10).map(|i| (i * 7 % 16) as u32).collect();
            let full = model
                .forward(&Tensor::from_vec(ids.clone(), (1, 10), &Device::Cpu).unwrap())
                .unwrap();
            let mut cache = Vec::new();
            let head = Tensor::from_vec(ids[..6].to_vec(), (1, 6), &Device::Cpu).unwrap();
            model.forward_cached(&head, 0, &mut cache).unwrap();
            for (i, &id) in ids.iter().enumerate().skip(6) {
                let one = Tensor::from_vec(vec![id], (1, 1), &Device::Cpu).unwrap();
                let got = model.forward_cached(&one, i, &mut cache).unwrap();
                let want = full.get(0).unwrap().get(i).unwrap();
                let diff = (got.get(0).unwrap().get(0).unwrap() - want)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max(0)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert!(diff < 1e-4, "{family:?} position {i}: {diff}");
            }
            let s = Sampling {
                tokens: 100,
                temperature: 0.8,
                top_p: 0.9,
                seed: 3,
                stop: None,
            };
            // Past the 64-token context the cache is rebuilt; the same seed repeats.
            let a = generate(&model, &ids, &s).unwrap();
            assert_eq!(a.tokens.len(), 100);
            assert_eq!(generate(&model, &ids, &s).unwrap().tokens, a.tokens);
        }
    }
}
