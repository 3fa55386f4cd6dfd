//! One averaging round's bookkeeping: which attempt is running, how the gradient is cut
//! into parts and the parts into chunks, the chunks of this replica's part being reduced,
//! and the reduced chunks received (kept encoded, as they travelled: a quarter of the f32
//! size in int8) until the whole averaged gradient is there. Pure: no sockets, no clock
//! reads.
//!
//! Parts travel and are reduced chunk by chunk, so a member never holds another member's
//! whole part: a chunk of its own part is summed as soon as every member's copy of it
//! arrived, and freed when its average is encoded.

use super::reduce;
use crate::model::optim::FlatSource;
use crate::model::ModelError;
use crate::wire::{self, Limits};
use libp2p::PeerId;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// Floats per chunk, at most.
pub const PART_CHUNK: usize = 256 << 10;

/// A gradient is cut into at least this many chunks when it is large enough, so even a
/// small stage's reduction is spread over up to this many members.
const MIN_CHUNKS: usize = 16;

/// Floats per chunk, at least (but for a gradient smaller than that).
const MIN_CHUNK: usize = 1024;

/// Floats per chunk for a gradient of `n` floats. Depends on `n` only, so every attempt
/// of a round, whatever its members, cuts the gradient the same way: a replica encodes
/// its sum once, when it freezes it, and every attempt sends those frames.
pub fn chunk_for(n: usize) -> usize {
    n.div_ceil(MIN_CHUNKS).clamp(MIN_CHUNK, PART_CHUNK)
}

/// Reduced chunks, encoded, each with its range in the flat gradient.
pub type ReducedChunks = Vec<(Range<usize>, Arc<Vec<u8>>)>;

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
    /// When this replica froze its gradients for it.
    pub started: Instant,
}

impl Round {
    /// Its key.
    pub fn key(&self) -> Key {
        (self.step, self.attempt)
    }
}

/// How a gradient of `n` floats is cut for a round of `k` members: into chunks of
/// `chunk` floats (the last one shorter; one empty chunk when `n` is 0), numbered from 0
/// over the whole gradient, and the chunks into `k` contiguous parts
/// ([`reduce::partition`] of the chunk count): member `i` reduces the chunks of part `i`.
/// A part may have no chunks (more members than chunks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    n: usize,
    chunk: usize,
    parts: Vec<Range<usize>>,
}

impl Layout {
    /// The layout every member of a `k`-member round computes for `n` floats.
    pub fn new(n: usize, k: usize, chunk: usize) -> Self {
        let chunk = chunk.max(1);
        let count = n.div_ceil(chunk).max(1);
        Self {
            n,
            chunk,
            parts: reduce::partition(count, k),
        }
    }

    /// Members (= parts).
    pub fn members(&self) -> usize {
        self.parts.len()
    }

    /// Chunks of the whole gradient.
    pub fn count(&self) -> u32 {
        u32::try_from(self.parts.last().map_or(0, |p| p.end)).unwrap_or(u32::MAX)
    }

    /// The chunks of part `part` (none for a part that does not exist).
    pub fn chunks(&self, part: usize) -> Range<u32> {
        self.parts.get(part).map_or(0..0, |r| {
            let lo = u32::try_from(r.start).unwrap_or(u32::MAX);
            lo..u32::try_from(r.end).unwrap_or(u32::MAX)
        })
    }

    /// The part chunk `c` belongs to.
    pub fn owner(&self, c: u32) -> Option<usize> {
        self.parts.iter().position(|r| r.contains(&(c as usize)))
    }

    /// The range of chunk `c` in the flat gradient.
    pub fn range(&self, c: u32) -> Option<Range<usize>> {
        if c >= self.count() {
            return None;
        }
        let start = (c as usize * self.chunk).min(self.n);
        Some(start..(start + self.chunk).min(self.n))
    }
}

/// A chunk of this replica's part while members' copies of it arrive.
#[derive(Debug)]
struct Partial {
    sum: Vec<f64>,
    from: Vec<bool>,
    count: u64,
}

/// What taking a member's chunk did.
#[derive(Debug, Clone, PartialEq)]
pub enum Taken {
    /// Summed; other members' copies are still missing.
    Waiting,
    /// Every member's copy is in: the chunk's average over `total` samples.
    Reduced {
        /// The chunk.
        chunk: u32,
        /// Σ sums ÷ total samples.
        avg: Vec<f32>,
        /// Samples of every member.
        total: u64,
    },
    /// Dropped: why.
    Refused(&'static str),
}

/// What one replica received for its round in progress.
#[derive(Debug)]
pub struct Tally {
    key: Key,
    layout: Layout,
    index: usize,
    partial: HashMap<u32, Partial>,
    /// Chunks of this replica's part already reduced, from its first chunk.
    done: Vec<bool>,
    /// Reduced chunks, encoded, by chunk.
    reduced: Vec<Option<Arc<Vec<u8>>>>,
    missing: usize,
    total: Option<u64>,
}

impl Tally {
    /// Nothing received yet for round `key`, where this replica is member `index`.
    pub fn new(key: Key, layout: Layout, index: usize) -> Self {
        let reduced = vec![None; layout.count() as usize];
        Self {
            key,
            done: vec![false; layout.chunks(index).len()],
            missing: reduced.len(),
            reduced,
            layout,
            index,
            partial: HashMap::new(),
            total: None,
        }
    }

    /// The round attempt.
    pub fn key(&self) -> Key {
        self.key
    }

    /// The layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Whether chunk `c` is one of this replica's part's, not reduced yet.
    fn open(&self, c: u32) -> bool {
        let mine = self.layout.chunks(self.index);
        mine.contains(&c) && !self.done[(c - mine.start) as usize]
    }

    fn close(&mut self, c: u32) {
        let first = self.layout.chunks(self.index).start;
        if let Some(d) = self.done.get_mut(c.wrapping_sub(first) as usize) {
            *d = true;
        }
    }

    /// Member `from`'s sum for chunk `c` (of this replica's part), over `count` samples;
    /// `own` is this replica's sum of the same chunk and its samples.
    pub fn add_part(
        &mut self,
        from: usize,
        c: u32,
        count: u64,
        values: &[f32],
        own: (&[f32], u64),
    ) -> Taken {
        let k = self.layout.members();
        let Some(range) = self.layout.range(c) else {
            return Taken::Refused("no such chunk");
        };
        if from >= k || from == self.index {
            return Taken::Refused("not a member's part");
        }
        if !self.layout.chunks(self.index).contains(&c) {
            return Taken::Refused("a chunk of another part");
        }
        if values.len() != range.len() || own.0.len() != range.len() {
            return Taken::Refused("a chunk of the wrong length");
        }
        if !self.open(c) {
            return Taken::Refused("chunk already reduced");
        }
        let p = self.partial.entry(c).or_insert_with(|| Partial {
            sum: own.0.iter().map(|&x| f64::from(x)).collect(),
            from: vec![false; k],
            count: own.1,
        });
        if p.from[from] {
            return Taken::Refused("a member's chunk twice");
        }
        p.from[from] = true;
        p.count += count;
        for (a, &x) in p.sum.iter_mut().zip(values) {
            *a += f64::from(x);
        }
        if p.from.iter().filter(|&&f| f).count() + 1 < k {
            return Taken::Waiting;
        }
        let Some(p) = self.partial.remove(&c) else {
            return Taken::Waiting;
        };
        self.close(c);
        Taken::Reduced {
            chunk: c,
            avg: reduce::average(&p.sum, p.count),
            total: p.count,
        }
    }

    /// Chunk `c` of this replica's part when it is the only member.
    pub fn reduce_alone(&mut self, c: u32, own: (&[f32], u64)) -> Taken {
        if self.layout.members() != 1 || !self.open(c) {
            return Taken::Refused("not a round of one");
        }
        self.close(c);
        let sum: Vec<f64> = own.0.iter().map(|&x| f64::from(x)).collect();
        Taken::Reduced {
            chunk: c,
            avg: reduce::average(&sum, own.1),
            total: own.1,
        }
    }

    /// Chunk `c` of the average, reduced by member `part`, encoded, over `total` samples.
    /// Returns whether it was taken (a duplicate, an unknown chunk, a chunk of another
    /// member's part, a frame that does not declare the chunk's length or a total that
    /// disagrees with earlier ones is not).
    pub fn add_reduced(&mut self, part: usize, c: u32, frame: Arc<Vec<u8>>, total: u64) -> bool {
        let Some(range) = self.layout.range(c) else {
            return false;
        };
        if self.layout.owner(c) != Some(part) {
            return false;
        }
        let fits = wire::header::parse_header(&frame, &Limits::default())
            .is_ok_and(|(h, _)| h.elements() == range.len() && h.frame_len() == frame.len() as u64);
        if !fits || self.total.is_some_and(|t| t != total) {
            return false;
        }
        let Some(slot) = self.reduced.get_mut(c as usize) else {
            return false;
        };
        if slot.is_some() {
            return false;
        }
        *slot = Some(frame);
        self.total = Some(total);
        self.missing -= 1;
        true
    }

    /// (chunks of this replica's part being summed, reduced chunks still missing).
    pub fn counts(&self) -> (usize, usize) {
        (self.partial.len(), self.missing)
    }

    /// Whether every reduced chunk is in.
    pub fn complete(&self) -> bool {
        self.missing == 0
    }

    /// Every reduced chunk with its range, and the step's samples, once complete.
    pub fn take_reduced(&mut self) -> Option<(ReducedChunks, u64)> {
        if !self.complete() {
            return None;
        }
        let mut out = Vec::new();
        for (c, slot) in self.reduced.iter_mut().enumerate() {
            let range = self.layout.range(c as u32)?;
            out.push((range, slot.take()?));
        }
        self.missing = out.len();
        Some((out, self.total.unwrap_or(0)))
    }
}

/// The averaged gradient as its reduced chunks, decoded range by range when the optimizer
/// reads it: the whole gradient is never decoded at once.
pub struct Frames {
    chunks: ReducedChunks,
    n: usize,
    /// The chunk decoded last (a parameter's range may end inside it).
    last: std::cell::RefCell<Option<(usize, Vec<f32>)>>,
}

impl Frames {
    /// The reduced chunks of a gradient of `n` floats; they must cover it exactly once.
    pub fn new(mut chunks: ReducedChunks, n: usize) -> Result<Self, String> {
        chunks.sort_by_key(|(r, _)| r.start);
        let mut at = 0;
        for (r, _) in &chunks {
            if r.start != at {
                return Err(format!("reduced chunks leave a gap or overlap at {at}"));
            }
            at = r.end;
        }
        if at != n {
            return Err(format!("reduced chunks cover {at} of {n} values"));
        }
        Ok(Self {
            chunks,
            n,
            last: std::cell::RefCell::new(None),
        })
    }

    /// The reduced chunks, by range.
    pub fn chunks(&self) -> &ReducedChunks {
        &self.chunks
    }

    fn with_chunk<T>(&self, i: usize, f: impl FnOnce(&[f32]) -> T) -> Result<T, String> {
        let mut last = self.last.borrow_mut();
        if last.as_ref().map(|(j, _)| *j) != Some(i) {
            let (range, frame) = &self.chunks[i];
            let mut v = last.take().map(|(_, v)| v).unwrap_or_default();
            wire::decode_f32_into(frame, &Limits::default(), &mut v)
                .map_err(|e| format!("a reduced chunk does not decode: {e}"))?;
            if v.len() != range.len() {
                return Err("a reduced chunk of the wrong length".into());
            }
            *last = Some((i, v));
        }
        Ok(f(last.as_ref().map_or(&[][..], |(_, v)| v.as_slice())))
    }
}

impl FlatSource for Frames {
    fn len(&self) -> usize {
        self.n
    }

    fn read(&self, range: Range<usize>) -> Result<Vec<f32>, ModelError> {
        if range.end > self.n || range.start > range.end {
            return Err(ModelError::BadInput(format!(
                "values {range:?} of a gradient of {}",
                self.n
            )));
        }
        let mut out = Vec::with_capacity(range.len());
        let first = self.chunks.partition_point(|(r, _)| r.end <= range.start);
        for i in first..self.chunks.len() {
            let c = self.chunks[i].0.clone();
            if c.start >= range.end {
                break;
            }
            let (a, b) = (range.start.max(c.start), range.end.min(c.end));
            self.with_chunk(i, |v| out.extend_from_slice(&v[a - c.start..b - c.start]))
                .map_err(ModelError::BadInput)?;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::CodecSpec;

    fn frame(values: &[f32]) -> Arc<Vec<u8>> {
        let mut f = Vec::new();
        wire::encode_f32(&[values.len()], values, &CodecSpec::F32, &mut f).unwrap();
        Arc::new(f)
    }

    #[test]
    fn a_layout_cuts_the_gradient_into_chunks_and_the_chunks_into_parts() {
        let l = Layout::new(25, 3, 4);
        // Seven chunks (six of 4 floats, one of 1), parts of 3, 2 and 2 chunks.
        assert_eq!(l.count(), 7);
        assert_eq!((l.chunks(0), l.chunks(1), l.chunks(2)), (0..3, 3..5, 5..7));
        assert_eq!(l.range(2), Some(8..12));
        assert_eq!(l.range(6), Some(24..25));
        assert_eq!(l.range(7), None);
        assert_eq!((l.owner(4), l.owner(7)), (Some(1), None));
        assert_eq!(l.chunks(3), 0..0);
        let mut seen = [0; 25];
        for p in 0..3 {
            for c in l.chunks(p) {
                for i in l.range(c).unwrap() {
                    seen[i] += 1;
                }
            }
        }
        assert!(seen.iter().all(|&s| s == 1));
        // Chunks do not depend on the members: a retry with other members sends the same
        // frames.
        let two = Layout::new(25, 2, 4);
        assert!((0..7).all(|c| two.range(c) == l.range(c)));
        // More members than chunks: some parts have none.
        let tiny = Layout::new(1, 2, 4);
        assert_eq!((tiny.chunks(0), tiny.chunks(1)), (0..1, 1..1));
        assert_eq!(Layout::new(0, 2, 4).range(0), Some(0..0));
    }

    #[test]
    fn chunks_are_sized_by_the_gradient_alone() {
        assert_eq!(chunk_for(0), MIN_CHUNK);
        assert_eq!(chunk_for(5_000), MIN_CHUNK);
        assert_eq!(chunk_for(200_000), 12_500);
        assert_eq!(chunk_for(1 << 30), PART_CHUNK);
    }

    #[test]
    fn a_chunk_is_reduced_when_every_member_sent_it_and_not_twice() {
        // Three members, this replica is member 1: its part is chunk 1, values 3..6.
        let l = Layout::new(9, 3, 3);
        let mut t = Tally::new((4, 9), l, 1);
        let own = [3.0f32, 3.0, 3.0];
        assert_eq!(
            t.add_part(0, 1, 2, &[1.0, 2.0, 3.0], (&own, 1)),
            Taken::Waiting
        );
        assert!(matches!(
            t.add_part(0, 1, 2, &[1.0, 2.0, 3.0], (&own, 1)),
            Taken::Refused(_)
        ));
        assert!(matches!(
            t.add_part(2, 1, 1, &[1.0], (&own, 1)),
            Taken::Refused(_)
        ));
        assert!(matches!(
            t.add_part(2, 0, 1, &[1.0; 3], (&own, 1)),
            Taken::Refused("a chunk of another part")
        ));
        assert!(matches!(
            t.add_part(1, 1, 1, &[1.0; 3], (&own, 1)),
            Taken::Refused(_)
        ));
        assert_eq!(
            t.add_part(2, 1, 1, &[4.0, 3.0, 2.0], (&own, 1)),
            Taken::Reduced {
                chunk: 1,
                avg: vec![2.0, 2.0, 2.0],
                total: 4
            }
        );
        assert!(matches!(
            t.add_part(2, 1, 1, &[4.0, 3.0, 2.0], (&own, 1)),
            Taken::Refused(_)
        ));
        assert_eq!(t.counts(), (0, 3));
    }

    #[test]
    fn the_gradient_is_assembled_once_every_reduced_chunk_is_in() {
        // Chunks 0..2, 2..4, 4..5; part 0 has chunks 0 and 1, part 1 chunk 2.
        let l = Layout::new(5, 2, 2);
        let mut t = Tally::new((1, 1), l, 0);
        assert!(t.add_reduced(1, 2, frame(&[5.0]), 6));
        assert!(!t.add_reduced(1, 2, frame(&[5.0]), 6), "duplicate");
        assert!(!t.add_reduced(0, 0, frame(&[1.0]), 6), "wrong length");
        assert!(!t.add_reduced(0, 0, frame(&[1.0, 2.0]), 7), "other total");
        assert!(!t.add_reduced(0, 5, frame(&[1.0, 2.0]), 6), "no such chunk");
        assert!(!t.add_reduced(1, 0, frame(&[1.0, 2.0]), 6), "not its part");
        assert!(t.add_reduced(0, 0, frame(&[1.0, 2.0]), 6));
        assert!(!t.complete());
        assert!(t.take_reduced().is_none());
        assert!(t.add_reduced(0, 1, frame(&[3.0, 4.0]), 6));
        let (chunks, total) = t.take_reduced().unwrap();
        assert_eq!(total, 6);
        assert!(Frames::new(chunks[1..].to_vec(), 5).is_err(), "a gap");
        let f = Frames::new(chunks, 5).unwrap();
        assert_eq!(f.read(0..5).unwrap(), vec![1.0, 2.0, 3.0, 4.0, 5.0]);
        // Ranges across chunk boundaries, in any order.
        assert_eq!(f.read(3..5).unwrap(), vec![4.0, 5.0]);
        assert_eq!(f.read(1..4).unwrap(), vec![2.0, 3.0, 4.0]);
        assert_eq!(f.read(2..2).unwrap(), Vec::<f32>::new());
        assert!(f.read(4..6).is_err());
    }

    #[test]
    fn a_round_of_one_reduces_its_own_sum() {
        let l = Layout::new(3, 1, 2);
        let mut t = Tally::new((0, 1), l, 0);
        let own = [2.0f32, 4.0, 6.0];
        let r = t.reduce_alone(1, (&own[2..], 2));
        assert_eq!(
            r,
            Taken::Reduced {
                chunk: 1,
                avg: vec![3.0],
                total: 2
            }
        );
        assert!(matches!(
            t.reduce_alone(1, (&own[2..], 2)),
            Taken::Refused(_)
        ));
    }
}
