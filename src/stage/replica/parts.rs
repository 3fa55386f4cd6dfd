//! A downloaded state as it lands: parts of at most [`PART`] floats, read back in order by
//! a restore that frees each part once it has passed it. So a joiner of a large stage never
//! holds the whole state twice (the download and the state it becomes): a 100M-parameter
//! stage's joiner peaked at 2.4× its state with one flat buffer (BENCHMARKS.md, "Stop 53").

use std::collections::VecDeque;

/// Floats per part (64 MiB).
pub const PART: usize = 16 << 20;

/// A flat state of `len` floats in parts, written anywhere, then read once from the start.
#[derive(Debug, Default)]
pub struct Parts {
    parts: VecDeque<Vec<f32>>,
    len: usize,
    /// Floats already taken from the front part.
    pos: usize,
    /// Floats taken in all.
    taken: usize,
}

impl Parts {
    /// `len` zeros in parts of `part` floats.
    pub fn zeros(len: usize, part: usize) -> Self {
        let part = part.max(1);
        let parts = (0..len.div_ceil(part))
            .map(|i| vec![0.0; part.min(len - i * part)])
            .collect();
        Self {
            parts,
            len,
            ..Self::default()
        }
    }

    /// `flat` as one part.
    pub fn from_vec(flat: Vec<f32>) -> Self {
        Self {
            len: flat.len(),
            parts: VecDeque::from([flat]),
            ..Self::default()
        }
    }

    /// Floats in all.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no floats.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Floats not taken yet.
    pub fn left(&self) -> usize {
        self.len - self.taken
    }

    /// Copies `values` in at `start` (before anything is taken). False, and nothing
    /// written, when they do not fit.
    pub fn write(&mut self, start: usize, values: &[f32]) -> bool {
        if self.taken > 0 || start + values.len() > self.len {
            return false;
        }
        let part = self.parts.front().map_or(1, Vec::len).max(1);
        let (mut at, mut values) = (start, values);
        while !values.is_empty() {
            let (i, off) = (at / part, at % part);
            let Some(p) = self.parts.get_mut(i) else {
                return false;
            };
            let n = (p.len() - off).min(values.len());
            p[off..off + n].copy_from_slice(&values[..n]);
            (at, values) = (at + n, &values[n..]);
        }
        true
    }

    /// Calls `f` on `k` floats from `skip` past the next one to take, in slices, without
    /// taking them.
    pub fn peek(&self, skip: usize, k: usize, f: &mut dyn FnMut(&[f32])) {
        let (mut skip, mut left) = (skip + self.pos, k);
        for p in &self.parts {
            if left == 0 {
                break;
            }
            if skip >= p.len() {
                skip -= p.len();
                continue;
            }
            let n = (p.len() - skip).min(left);
            f(&p[skip..skip + n]);
            left -= n;
            skip = 0;
        }
    }

    /// Takes the next `k` floats (fewer when fewer are left); parts passed are freed.
    pub fn take(&mut self, k: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(k.min(self.left()));
        while out.len() < k {
            let Some(front) = self.parts.front() else {
                break;
            };
            let n = (front.len() - self.pos).min(k - out.len());
            out.extend_from_slice(&front[self.pos..self.pos + n]);
            self.pos += n;
            if self.pos == front.len() {
                self.parts.pop_front();
                self.pos = 0;
            }
        }
        self.taken += out.len();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_written_anywhere_read_back_in_order_and_freed_as_passed() {
        let mut p = Parts::zeros(10, 4);
        assert_eq!(p.parts.len(), 3);
        // A write across a part boundary, and one at the end.
        assert!(p.write(2, &[1.0, 2.0, 3.0, 4.0]));
        assert!(p.write(9, &[9.0]));
        assert!(!p.write(8, &[1.0, 2.0, 3.0]), "past the end");
        let mut seen = Vec::new();
        p.peek(0, 7, &mut |s| seen.extend_from_slice(s));
        assert_eq!(seen, [0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 0.0]);
        let mut seen = Vec::new();
        p.peek(5, 3, &mut |s| seen.extend_from_slice(s));
        assert_eq!(seen, [4.0, 0.0, 0.0]);
        assert_eq!(p.take(3), [0.0, 0.0, 1.0]);
        assert_eq!(p.parts.len(), 3);
        assert_eq!(p.take(3), [2.0, 3.0, 4.0]);
        assert_eq!(p.parts.len(), 2, "the first part is freed once passed");
        assert!(!p.write(0, &[1.0]), "no writes once reading has begun");
        let mut seen = Vec::new();
        p.peek(0, 10, &mut |s| seen.extend_from_slice(s));
        assert_eq!(seen, [0.0, 0.0, 0.0, 9.0]);
        assert_eq!(p.take(10), [0.0, 0.0, 0.0, 9.0]);
        assert_eq!((p.left(), p.parts.len()), (0, 0));
        let one = Parts::from_vec(vec![1.0, 2.0]);
        assert_eq!((one.len(), one.left()), (2, 2));
    }
}
