//! The arithmetic of a butterfly all-reduce, apart from any exchange: how the flat
//! gradient is cut into parts, and how one part is reduced from every member's sum — by
//! the sample-weighted mean, or by CenteredClip (Karimireddy et al., 2021; BTARD's robust
//! aggregator), which a minority of members sending garbage cannot drag far.

use std::ops::Range;

/// Cuts `n` values into `k` contiguous parts as evenly as possible (earlier parts take the
/// remainder). Every member computes the same cut from `n` and `k`.
pub fn partition(n: usize, k: usize) -> Vec<Range<usize>> {
    let k = k.max(1);
    let (base, extra) = (n / k, n % k);
    let mut out = Vec::with_capacity(k);
    let mut at = 0;
    for i in 0..k {
        let len = base + usize::from(i < extra);
        out.push(at..at + len);
        at += len;
    }
    out
}

/// Reduces one part: each member sends the sum over its samples of the per-sample mean
/// gradient (samples × microbatch mean) and its sample count; the result is the mean over
/// every sample of every member. With no samples at all the result is zero.
pub fn reduce_part(sums: &[(&[f32], u64)], len: usize) -> (Vec<f32>, u64) {
    let total: u64 = sums.iter().map(|(_, c)| c).sum();
    let mut acc = vec![0.0f64; len];
    for (s, _) in sums {
        for (a, &x) in acc.iter_mut().zip(s.iter()) {
            *a += x as f64;
        }
    }
    (average(&acc, total), total)
}

/// How the reducer of a part combines the members' contributions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Aggregate {
    /// The mean over every sample of every member.
    Mean,
    /// The mean over the members' copies, each weighing the same whatever its samples
    /// (outer averaging: every replica's pseudo-gradient counts once).
    MemberMean,
    /// CenteredClip over the members' mean gradients (each member weighs the same, so a
    /// member cannot buy weight by claiming samples).
    CenteredClip {
        /// Clipping radius, as a multiple of the median distance of the members' means
        /// from their coordinate-wise median.
        tau: f64,
        /// Fixed-point iterations.
        iters: u32,
    },
}

/// CenteredClip of the members' mean gradients `means` (each of `len` values): from the
/// coordinate-wise median `v`, `iters` times `v ← v + mean_i (x_i − v)·min(1, τ/‖x_i − v‖)`,
/// where `τ` is `tau` × the median of `‖x_i − median‖`. A member far from the others moves
/// `v` by at most `τ / k` per iteration. Deterministic: every replica that reduces the
/// same inputs gets the same bits. With no members the result is zero.
pub fn centered_clip(means: &[&[f32]], len: usize, tau: f64, iters: u32) -> Vec<f32> {
    let k = means.len();
    if k == 0 {
        return vec![0.0; len];
    }
    let mut v: Vec<f64> = (0..len)
        .map(|j| {
            let mut col: Vec<f64> = means.iter().map(|m| f64::from(m[j])).collect();
            col.sort_by(f64::total_cmp);
            if k % 2 == 1 {
                col[k / 2]
            } else {
                0.5 * (col[k / 2 - 1] + col[k / 2])
            }
        })
        .collect();
    let dist = |m: &[f32], v: &[f64]| -> f64 {
        m.iter()
            .zip(v)
            .map(|(&x, &c)| (f64::from(x) - c).powi(2))
            .sum::<f64>()
            .sqrt()
    };
    let mut d: Vec<f64> = means.iter().map(|m| dist(m, &v)).collect();
    d.sort_by(f64::total_cmp);
    let radius = tau * d[(k - 1) / 2];
    if radius <= 0.0 || !radius.is_finite() {
        // Half the members agree exactly (or there is one): the median is the answer.
        return v.iter().map(|&x| x as f32).collect();
    }
    let mut step = vec![0.0f64; len];
    for _ in 0..iters {
        step.iter_mut().for_each(|s| *s = 0.0);
        for m in means {
            let n = dist(m, &v);
            let w = if n > radius { radius / n } else { 1.0 };
            for ((s, &x), &c) in step.iter_mut().zip(m.iter()).zip(&v) {
                *s += w * (f64::from(x) - c);
            }
        }
        for (c, s) in v.iter_mut().zip(&step) {
            *c += s / k as f64;
        }
    }
    v.iter().map(|&x| x as f32).collect()
}

/// `sum ÷ count` in f32 (zero with no samples): a part's average from its f64 sum.
pub fn average(sum: &[f64], count: u64) -> Vec<f32> {
    let inv = if count == 0 { 0.0 } else { 1.0 / count as f64 };
    sum.iter().map(|&a| (a * inv) as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_covers_everything_once() {
        for n in [0usize, 1, 7, 100, 101] {
            for k in 1..6 {
                let p = partition(n, k);
                assert_eq!(p.len(), k);
                assert_eq!(p[0].start, 0);
                assert_eq!(p[k - 1].end, n);
                for w in p.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    assert!(w[0].len() >= w[1].len() && w[0].len() - w[1].len() <= 1);
                }
            }
        }
    }

    #[test]
    fn centered_clip_ignores_one_wild_member_of_four() {
        let honest: Vec<Vec<f32>> = (0..3)
            .map(|i| {
                (0..64)
                    .map(|j| 0.01 * (j as f32).sin() + 0.001 * i as f32)
                    .collect()
            })
            .collect();
        let mean: Vec<f32> = (0..64)
            .map(|j| honest.iter().map(|h| h[j]).sum::<f32>() / 3.0)
            .collect();
        let far = |x: &[f32]| -> f32 {
            x.iter()
                .zip(&mean)
                .map(|(a, b)| (a - b).powi(2))
                .sum::<f32>()
                .sqrt()
        };
        let scale: f32 = mean.iter().map(|x| x * x).sum::<f32>().sqrt();
        for wild in [
            honest[0].iter().map(|x| x * -1000.0).collect::<Vec<f32>>(),
            (0..64).map(|j| ((j * 7919) % 13) as f32 - 6.0).collect(),
        ] {
            let mut all: Vec<&[f32]> = honest.iter().map(|h| h.as_slice()).collect();
            all.push(&wild);
            let cc = centered_clip(&all, 64, 1.0, 10);
            assert!(far(&cc) < 0.1 * scale, "{} vs {}", far(&cc), scale);
            // The plain mean is dragged away.
            let plain: Vec<f32> = (0..64)
                .map(|j| all.iter().map(|m| m[j]).sum::<f32>() / 4.0)
                .collect();
            assert!(far(&plain) > 10.0 * scale);
            // Same inputs, same bits.
            assert_eq!(cc, centered_clip(&all, 64, 1.0, 10));
        }
        // Agreeing members: their common value.
        let same = [1.0f32, -2.0];
        assert_eq!(
            centered_clip(&[&same, &same, &same], 2, 1.0, 5),
            same.to_vec()
        );
        assert_eq!(centered_clip(&[], 2, 1.0, 5), vec![0.0, 0.0]);
    }

    #[test]
    fn reduce_is_the_sample_weighted_mean() {
        // Member a: 3 samples with mean gradient [1, 2]; member b: 1 sample with [5, -2].
        let a = [3.0f32, 6.0];
        let b = [5.0f32, -2.0];
        let (avg, total) = reduce_part(&[(&a, 3), (&b, 1)], 2);
        assert_eq!(total, 4);
        assert_eq!(avg, vec![2.0, 1.0]);
        let (z, t) = reduce_part(&[(&[0.0, 0.0], 0)], 2);
        assert_eq!((z, t), (vec![0.0, 0.0], 0));
    }
}
