//! One averaging round's bookkeeping: which attempt is running, how the gradient is cut
//! into parts and the parts into chunks, the chunks of this replica's part being reduced,
//! and the reduced chunks received (kept encoded, as they travelled: a quarter of the f32
//! size in int8) until the whole averaged gradient is there. Pure: no sockets, no clock
//! reads.
//!
//! Parts travel and are reduced chunk by chunk, so a member never holds another member's
//! whole part: a chunk of its own part is summed as soon as every member's copy of it
//! arrived, and freed when its average is encoded.

use super::reduce::{self, Aggregate};
use crate::model::optim::FlatSource;
use crate::model::ModelError;
use crate::wire::{self, Limits};
use libp2p::PeerId;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

pub use crate::wire::msg::PART_CHUNK;

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
    /// Members this replica has had a part or a reduced chunk from in this attempt.
    pub heard: std::collections::HashSet<PeerId>,
    /// The attempt's tracing span (`round{step,attempt,members}`): what the averager logs
    /// while the attempt runs is inside it.
    pub span: tracing::Span,
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

/// A chunk of this replica's part while members' copies of it arrive: their running sum
/// (the mean), or each member's mean gradient (CenteredClip).
#[derive(Debug)]
struct Partial {
    sum: Vec<f64>,
    means: Vec<Vec<f32>>,
    from: Vec<bool>,
    /// Samples of the copies summed (what the average divides by).
    count: u64,
    /// Samples every member declared for the step, rejected copies included: the
    /// step's total, the same for every chunk whatever was left out of one.
    declared: u64,
}

impl Partial {
    fn add(&mut self, aggregate: Aggregate, values: &[f32], count: u64) {
        self.count += match aggregate {
            Aggregate::MemberMean => 1,
            _ => count,
        };
        match aggregate {
            Aggregate::Mean | Aggregate::MemberMean => {
                for (a, &x) in self.sum.iter_mut().zip(values) {
                    *a += f64::from(x);
                }
            }
            // A member without samples has no mean to weigh.
            Aggregate::CenteredClip { .. } if count > 0 => {
                let inv = 1.0 / count as f64;
                self.means.push(
                    values
                        .iter()
                        .map(|&x| (f64::from(x) * inv) as f32)
                        .collect(),
                );
            }
            Aggregate::CenteredClip { .. } => {}
        }
    }

    fn result(&self, aggregate: Aggregate, len: usize) -> Vec<f32> {
        match aggregate {
            Aggregate::Mean | Aggregate::MemberMean => reduce::average(&self.sum, self.count),
            Aggregate::CenteredClip { tau, iters } => {
                let means: Vec<&[f32]> = self.means.iter().map(Vec::as_slice).collect();
                reduce::centered_clip(&means, len, tau, iters)
            }
        }
    }
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
    own_declared: Option<u64>,
    aggregate: Aggregate,
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
            aggregate: Aggregate::Mean,
            own_declared: None,
        }
    }

    /// Reduces with `aggregate` (the mean by default).
    pub fn with_aggregate(mut self, aggregate: Aggregate) -> Self {
        self.aggregate = aggregate;
        self
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
        self.take(from, c, Some((values, count)), count, own)
    }

    /// Member `from`'s copy of chunk `c`, declared over `count` samples, was rejected (it
    /// did not pass the checks): the chunk is reduced without it. The reduced chunk's total
    /// still counts those samples, so every chunk of the round reports the same total (a
    /// member refuses reduced chunks whose totals disagree, and the round would never end).
    pub fn exclude_part(&mut self, from: usize, c: u32, count: u64, own: (&[f32], u64)) -> Taken {
        self.take(from, c, None, count, own)
    }

    /// This replica's own copy declares `count` samples whatever `own` holds (an own
    /// copy that overflowed is left out as zeros over 0 samples, its samples still in
    /// the step's total).
    pub fn with_own_declared(mut self, count: u64) -> Self {
        self.own_declared = Some(count);
        self
    }

    fn take(
        &mut self,
        from: usize,
        c: u32,
        part: Option<(&[f32], u64)>,
        declared: u64,
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
        if part.is_some_and(|(v, _)| v.len() != range.len()) || own.0.len() != range.len() {
            return Taken::Refused("a chunk of the wrong length");
        }
        if !self.open(c) {
            return Taken::Refused("chunk already reduced");
        }
        let aggregate = self.aggregate;
        let own_declared = self.own_declared.unwrap_or(own.1);
        let p = self.partial.entry(c).or_insert_with(|| {
            let mut p = Partial {
                sum: vec![0.0; range.len()],
                means: Vec::new(),
                from: vec![false; k],
                count: 0,
                declared: own_declared,
            };
            p.add(aggregate, own.0, own.1);
            p
        });
        if p.from[from] {
            return Taken::Refused("a member's chunk twice");
        }
        p.from[from] = true;
        p.declared += declared;
        if let Some((values, count)) = part {
            p.add(aggregate, values, count);
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
            avg: p.result(aggregate, range.len()),
            total: p.declared,
        }
    }

    /// Chunk `c` of this replica's part when it is the only member.
    pub fn reduce_alone(&mut self, c: u32, own: (&[f32], u64)) -> Taken {
        if self.layout.members() != 1 || !self.open(c) {
            return Taken::Refused("not a round of one");
        }
        self.close(c);
        let sum: Vec<f64> = own.0.iter().map(|&x| f64::from(x)).collect();
        let over = match self.aggregate {
            Aggregate::MemberMean => 1,
            _ => own.1,
        };
        Taken::Reduced {
            chunk: c,
            avg: reduce::average(&sum, over),
            total: self.own_declared.unwrap_or(own.1),
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
#[path = "round_tests.rs"]
mod tests;
