//! The built-in corpus: a seeded random order-2 Markov source with an exactly known entropy.
//!
//! Each token `b` has a pool of `pool` possible successors; each context (a, b) can be
//! followed by `branching` tokens from b's pool, with Dirichlet(1)-distributed
//! probabilities. The last token narrows the next one down and the one before pins it, so
//! a model can learn the source in stages (bigram, then trigram) instead of all at once. The stationary distribution over contexts is found
//! by iterating the (lazy) chain to convergence, which gives the entropy rate — the best
//! loss any model can reach — without sampling.
//!
//! That needs a table of every context's successors: V² rows. Above [`TABLE_CONTEXTS`]
//! contexts (a vocabulary over 4096, such as GPT-2's 50257, whose table would take
//! hundreds of GB), each row is derived when it is needed from the seed and the context
//! instead, the first context is drawn uniformly, and the entropy rate is not known.

use crate::rng::{derive_seed, Rng};

/// Contexts (V²) up to which the successors are tabled and the entropy rate computed.
pub const TABLE_CONTEXTS: usize = 1 << 24;

/// An order-2 Markov token source.
#[derive(Debug, Clone)]
pub struct MarkovSource {
    vocab: usize,
    /// Per context `a·V + b`: the possible next tokens and their cumulative probabilities.
    /// Empty when the rows are derived ([`Derived`]).
    next: Vec<Vec<(u32, f64)>>,
    /// Stationary probability of each context, and its cumulative sum for sampling (empty
    /// when the rows are derived).
    stationary: Vec<f64>,
    stationary_cum: Vec<f64>,
    derived: Option<Derived>,
}

/// The rows of a source too large to table: each context's row is drawn from a generator
/// seeded by the source's seed and the context.
#[derive(Debug, Clone)]
struct Derived {
    pools: Vec<Vec<u32>>,
    branching: usize,
    seed: u64,
}

impl Derived {
    /// The row of context `a·V + b` (`ctx`), into `tokens` and `cum` ([`draw_row`] from
    /// `b`'s pool with the context's own generator).
    fn row(&self, ctx: u64, b: usize, tokens: &mut Vec<u32>, cum: &mut Vec<f64>) {
        let mut rng = Rng::new(crate::rng::mix64(self.seed ^ crate::rng::mix64(ctx)));
        draw_row(&mut rng, &self.pools[b], self.branching, tokens, cum);
    }
}

/// Draws one context's successors: the first `branching` tokens of `pool` after a partial
/// shuffle (into `tokens`) and their Dirichlet(1) probabilities as cumulative sums (into
/// `cum`).
fn draw_row(
    rng: &mut Rng,
    pool: &[u32],
    branching: usize,
    tokens: &mut Vec<u32>,
    cum: &mut Vec<f64>,
) {
    tokens.clear();
    tokens.extend_from_slice(pool);
    for i in 0..branching {
        let j = i + rng.below((tokens.len() - i) as u64) as usize;
        tokens.swap(i, j);
    }
    tokens.truncate(branching);
    cum.clear();
    cum.extend((0..branching).map(|_| rng.exponential()));
    let total: f64 = cum.iter().sum();
    let mut acc = 0.0;
    for c in cum.iter_mut() {
        acc += *c / total;
        *c = acc;
    }
}

impl MarkovSource {
    /// Builds the source for `vocab` tokens from `seed`; needs
    /// 1 ≤ `branching` ≤ `pool` ≤ `vocab`.
    pub fn new(vocab: usize, branching: usize, pool: usize, seed: u64) -> Self {
        let mut rng = Rng::new(derive_seed(seed, "markov"));
        let mut all: Vec<u32> = (0..vocab as u32).collect();
        let mut shuffled_prefix = |rng: &mut Rng, k: usize| -> Vec<u32> {
            // Partial Fisher–Yates: the first k of a shuffled list.
            for i in 0..k {
                let j = i + rng.below((vocab - i) as u64) as usize;
                all.swap(i, j);
            }
            all[..k].to_vec()
        };
        let pools: Vec<Vec<u32>> = (0..vocab)
            .map(|_| shuffled_prefix(&mut rng, pool))
            .collect();
        if vocab.saturating_mul(vocab) > TABLE_CONTEXTS {
            return Self {
                vocab,
                next: Vec::new(),
                stationary: Vec::new(),
                stationary_cum: Vec::new(),
                derived: Some(Derived {
                    pools,
                    branching,
                    seed: rng.next_u64(),
                }),
            };
        }
        let mut next = Vec::with_capacity(vocab * vocab);
        let (mut tokens, mut cum) = (Vec::new(), Vec::new());
        for ctx in 0..vocab * vocab {
            draw_row(
                &mut rng,
                &pools[ctx % vocab],
                branching,
                &mut tokens,
                &mut cum,
            );
            next.push(tokens.iter().copied().zip(cum.iter().copied()).collect());
        }
        let stationary = Self::stationary_of(vocab, &next);
        let mut acc = 0.0;
        let stationary_cum = stationary
            .iter()
            .map(|p| {
                acc += p;
                acc
            })
            .collect();
        Self {
            vocab,
            next,
            stationary,
            stationary_cum,
            derived: None,
        }
    }

    fn probs(row: &[(u32, f64)]) -> impl Iterator<Item = (u32, f64)> + '_ {
        row.iter().scan(0.0, |prev, &(t, c)| {
            let p = c - *prev;
            *prev = c;
            Some((t, p))
        })
    }

    fn stationary_of(v: usize, next: &[Vec<(u32, f64)>]) -> Vec<f64> {
        let n = v * v;
        let mut pi = vec![1.0 / n as f64; n];
        let mut nxt = vec![0.0; n];
        for _ in 0..100_000 {
            nxt.iter_mut().for_each(|x| *x = 0.0);
            for (ctx, row) in next.iter().enumerate() {
                let b = ctx % v;
                for (t, p) in Self::probs(row) {
                    nxt[b * v + t as usize] += pi[ctx] * p;
                }
            }
            // Lazy chain (½I + ½P): same stationary law, and it converges even if P is periodic.
            let mut delta = 0.0;
            for (x, y) in pi.iter_mut().zip(&nxt) {
                let z = 0.5 * (*x + y);
                delta += (z - *x).abs();
                *x = z;
            }
            if delta < 1e-14 {
                break;
            }
        }
        let total: f64 = pi.iter().sum();
        pi.iter().map(|p| p / total).collect()
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Entropy rate in nats per token: Σ_ctx π(ctx) · H(next | ctx); unknown (`None`) for
    /// a source too large to table.
    pub fn entropy_rate(&self) -> Option<f64> {
        if self.derived.is_some() {
            return None;
        }
        let h = self
            .next
            .iter()
            .zip(&self.stationary)
            .map(|(row, &pi)| {
                pi * -Self::probs(row)
                    .map(|(_, p)| if p > 0.0 { p * p.ln() } else { 0.0 })
                    .sum::<f64>()
            })
            .sum();
        Some(h)
    }

    /// The lowest expected mean loss over a sequence of `seq_len` predictions: the first
    /// prediction sees one token of context (H(X₁|X₀)), the others see two (the entropy
    /// rate); unknown for a source too large to table.
    pub fn best_loss(&self, seq_len: usize) -> Option<f64> {
        let rate = self.entropy_rate()?;
        let v = self.vocab;
        let h = |ps: &mut dyn Iterator<Item = f64>| -> f64 {
            -ps.filter(|&p| p > 0.0).map(|p| p * p.ln()).sum::<f64>()
        };
        let h_pair = h(&mut self.stationary.iter().copied());
        let marg: Vec<f64> = (0..v)
            .map(|a| self.stationary[a * v..(a + 1) * v].iter().sum())
            .collect();
        let h_first = h_pair - h(&mut marg.into_iter());
        let t = seq_len.max(1) as f64;
        Some((h_first + (t - 1.0) * rate) / t)
    }

    fn pick(cum: &[f64], u: f64) -> usize {
        cum.partition_point(|&c| c <= u).min(cum.len() - 1)
    }

    /// Appends `len` tokens to `out`, starting from a context drawn from the stationary law
    /// (uniformly, for derived rows).
    pub fn sample_into(&self, rng: &mut Rng, len: usize, out: &mut Vec<u32>) {
        let (mut a, mut b) = match &self.derived {
            Some(d) => {
                let a = rng.below(self.vocab as u64) as usize;
                let pool = &d.pools[a];
                (a as u32, pool[rng.below(pool.len() as u64) as usize])
            }
            None => {
                let ctx = Self::pick(&self.stationary_cum, rng.next_f64());
                ((ctx / self.vocab) as u32, (ctx % self.vocab) as u32)
            }
        };
        let (mut tokens, mut cum) = (Vec::new(), Vec::new());
        for i in 0..len {
            let tok = match i {
                0 => a,
                1 => b,
                _ => {
                    let t = self.next_token(a, b, rng.next_f64(), &mut tokens, &mut cum);
                    a = b;
                    b = t;
                    t
                }
            };
            out.push(tok);
        }
    }

    /// The token after context (a, b) for the uniform draw `u` (`tokens` and `cum` are
    /// scratch space).
    fn next_token(&self, a: u32, b: u32, u: f64, tokens: &mut Vec<u32>, cum: &mut Vec<f64>) -> u32 {
        let ctx = a as usize * self.vocab + b as usize;
        match &self.derived {
            Some(d) => {
                d.row(ctx as u64, b as usize, tokens, cum);
                tokens[Self::pick(cum, u)]
            }
            None => {
                let row = &self.next[ctx];
                cum.clear();
                cum.extend(row.iter().map(|&(_, c)| c));
                row[Self::pick(cum, u)].0
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stationary_is_a_fixed_point_and_entropy_is_in_range() {
        let m = MarkovSource::new(16, 4, 8, 7);
        let total: f64 = m.stationary.iter().sum();
        assert!((total - 1.0).abs() < 1e-12);
        let h = m.entropy_rate().unwrap();
        assert!(h > 0.0 && h < (4f64).ln(), "entropy rate {h}");
        assert!(m.best_loss(64).unwrap() >= h);
    }

    #[test]
    fn empirical_log_loss_matches_entropy_rate() {
        // The true model's average log loss on samples converges to the entropy rate.
        let m = MarkovSource::new(16, 4, 6, 3);
        let mut rng = Rng::new(1);
        let mut seq = Vec::new();
        m.sample_into(&mut rng, 200_000, &mut seq);
        let mut nll = 0.0;
        for w in seq.windows(3) {
            let row = &m.next[w[0] as usize * 16 + w[1] as usize];
            let p = MarkovSource::probs(row)
                .find(|&(t, _)| t == w[2])
                .map(|(_, p)| p)
                .expect("seen");
            nll -= p.ln();
        }
        let emp = nll / (seq.len() - 2) as f64;
        let h = m.entropy_rate().unwrap();
        assert!((emp - h).abs() < 0.01, "empirical {emp} vs {h}");
    }

    #[test]
    fn a_vocabulary_too_large_to_table_derives_each_row_the_same_way_every_time() {
        // GPT-2's vocabulary: a table would hold 2.5 billion rows.
        let v = 50257;
        let t0 = std::time::Instant::now();
        let m = MarkovSource::new(v, 8, 16, 7);
        assert!(t0.elapsed() < std::time::Duration::from_secs(10));
        assert_eq!(m.entropy_rate(), None);
        let draw = |seed| {
            let mut seq = Vec::new();
            m.sample_into(&mut Rng::new(seed), 20_000, &mut seq);
            seq
        };
        let (a, b) = (draw(1), draw(1));
        assert_eq!(a, b, "the same stream for the same seed");
        assert_ne!(a, draw(2));
        assert!(a.iter().all(|&t| (t as usize) < v));
        // Order 2: a context is always followed by one of `branching` tokens from the
        // last token's pool, and a context seen often is followed by several of them.
        let d = m.derived.as_ref().unwrap();
        let mut after: std::collections::HashMap<(u32, u32), std::collections::HashSet<u32>> =
            Default::default();
        for w in a.windows(3) {
            assert!(d.pools[w[1] as usize].contains(&w[2]));
            after.entry((w[0], w[1])).or_default().insert(w[2]);
        }
        assert!(after.values().all(|s| s.len() <= 8));
        assert!(after.values().any(|s| s.len() > 1));
    }
}
