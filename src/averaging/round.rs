//! One averaging round's bookkeeping: which attempt is running, the parts received for the
//! part this replica reduces, the reduced parts received from the others, and when each is
//! complete. Pure: no sockets, no clock reads.

use super::reduce;
use libp2p::PeerId;
use std::collections::HashMap;
use std::time::Instant;

/// A round attempt: `(step, attempt)`.
pub type Key = (u64, u32);

/// The round attempt this replica takes part in.
#[derive(Debug, Clone)]
pub struct Round {
    /// The step averaged.
    pub step: u64,
    /// The leader's attempt number (random, so attempts never collide).
    pub attempt: u32,
    /// The members, sorted; member `i` reduces part `i`.
    pub members: Vec<PeerId>,
    /// This replica's index in `members`.
    pub index: usize,
    /// Samples lost with dead replicas, counted in this step.
    pub lost: u64,
    /// When the attempt is abandoned.
    pub deadline: Instant,
    /// Whether this replica sent its reduced part.
    pub reduced_sent: bool,
    /// When this replica froze its gradients for it.
    pub started: Instant,
}

impl Round {
    /// Its key.
    pub fn key(&self) -> Key {
        (self.step, self.attempt)
    }
}

/// A part sum and the samples in it.
type Part = (Vec<f32>, u64);

/// Parts and reduced parts received, by round attempt.
#[derive(Debug, Default)]
pub struct Book {
    parts: HashMap<Key, HashMap<PeerId, Part>>,
    reduced: HashMap<Key, HashMap<u32, Part>>,
}

impl Book {
    /// Member `from`'s sum of this replica's part (over `count` samples).
    pub fn add_part(&mut self, key: Key, from: PeerId, sum: Vec<f32>, count: u64) {
        self.parts
            .entry(key)
            .or_default()
            .insert(from, (sum, count));
    }

    /// Member `index`'s reduced (averaged) part, over `total` samples.
    pub fn add_reduced(&mut self, key: Key, index: u32, avg: Vec<f32>, total: u64) {
        self.reduced
            .entry(key)
            .or_default()
            .insert(index, (avg, total));
    }

    /// (parts, reduced parts) received for `key`.
    pub fn counts(&self, key: Key) -> (usize, usize) {
        (
            self.parts.get(&key).map_or(0, |m| m.len()),
            self.reduced.get(&key).map_or(0, |m| m.len()),
        )
    }

    /// Every member's sum of this replica's part of an `n`-float gradient, once all arrived
    /// with the right length.
    pub fn parts_ready(&self, r: &Round, n: usize) -> Option<Vec<(&[f32], u64)>> {
        let parts = self.parts.get(&r.key())?;
        let len = reduce::partition(n, r.members.len()).get(r.index)?.len();
        r.members
            .iter()
            .map(|m| {
                parts
                    .get(m)
                    .filter(|(v, _)| v.len() == len)
                    .map(|(v, c)| (v.as_slice(), *c))
            })
            .collect()
    }

    /// The whole averaged gradient of `n` floats and its sample count, once every member's
    /// reduced part arrived with the right length.
    pub fn assembled(&self, r: &Round, n: usize) -> Option<(Vec<f32>, u64)> {
        let red = self.reduced.get(&r.key())?;
        let mut avg = Vec::with_capacity(n);
        let mut total = 0;
        for (i, range) in reduce::partition(n, r.members.len()).iter().enumerate() {
            let (v, t) = red
                .get(&(i as u32))
                .filter(|(v, _)| v.len() == range.len())?;
            avg.extend_from_slice(v);
            total = *t;
        }
        Some((avg, total))
    }

    /// Forgets the parts of `key` (once reduced they are not needed: a retry is a new
    /// attempt with new parts).
    pub fn drop_parts(&mut self, key: Key) {
        self.parts.remove(&key);
    }

    /// Forgets every attempt of steps up to `step`.
    pub fn forget_through(&mut self, step: u64) {
        self.parts.retain(|(s, _), _| *s > step);
        self.reduced.retain(|(s, _), _| *s > step);
    }

    /// Forgets everything (after a state download).
    pub fn clear(&mut self) {
        self.parts.clear();
        self.reduced.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(members: &[PeerId], index: usize) -> Round {
        Round {
            step: 4,
            attempt: 9,
            members: members.to_vec(),
            index,
            lost: 0,
            deadline: Instant::now(),
            reduced_sent: false,
            started: Instant::now(),
        }
    }

    #[test]
    fn parts_are_ready_only_when_every_member_sent_the_right_length() {
        let mut m: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
        m.sort();
        let r = round(&m, 1);
        let n = 10; // parts of 4, 3, 3: this replica reduces the second
        let mut b = Book::default();
        assert!(b.parts_ready(&r, n).is_none());
        b.add_part(r.key(), m[0], vec![1.0; 3], 2);
        b.add_part(r.key(), m[1], vec![2.0; 3], 3);
        assert!(b.parts_ready(&r, n).is_none());
        // A part of another attempt does not count; a wrong length does not either.
        b.add_part((4, 8), m[2], vec![3.0; 3], 1);
        assert!(b.parts_ready(&r, n).is_none());
        b.add_part(r.key(), m[2], vec![3.0; 4], 1);
        assert!(b.parts_ready(&r, n).is_none());
        b.add_part(r.key(), m[2], vec![3.0; 3], 1);
        let ready = b.parts_ready(&r, n).unwrap();
        assert_eq!(ready.iter().map(|(_, c)| c).sum::<u64>(), 6);
        assert_eq!(b.counts(r.key()), (3, 0));
        b.drop_parts(r.key());
        assert_eq!(b.counts(r.key()), (0, 0));
        assert_eq!(b.counts((4, 8)), (1, 0));
    }

    #[test]
    fn the_gradient_is_assembled_in_member_order() {
        let mut m: Vec<PeerId> = (0..2).map(|_| PeerId::random()).collect();
        m.sort();
        let r = round(&m, 0);
        let mut b = Book::default();
        b.add_reduced(r.key(), 1, vec![2.0; 2], 6);
        assert!(b.assembled(&r, 5).is_none());
        b.add_reduced(r.key(), 0, vec![1.0; 3], 6);
        assert_eq!(b.assembled(&r, 5), Some((vec![1.0, 1.0, 1.0, 2.0, 2.0], 6)));
        b.add_reduced((5, 1), 0, vec![0.0; 3], 1);
        b.forget_through(4);
        assert_eq!(b.counts(r.key()), (0, 0));
        assert_eq!(b.counts((5, 1)), (0, 1));
        b.clear();
        assert_eq!(b.counts((5, 1)), (0, 0));
    }
}
