//! The arithmetic of a butterfly all-reduce, apart from any exchange: how the flat
//! gradient is cut into parts, and how one part is reduced from every member's sum.

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
