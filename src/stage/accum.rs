//! A replica's gradient accumulator: one running sum per stage (memory does not grow with
//! the microbatches of a step), the sum frozen for the averaging round in progress, and the
//! microbatch ids already taken (each is accumulated at most once).

use super::frozen::{EncodedSum, Frozen};
use crate::model::ModelError;
use crate::wire::CodecSpec;
use candle_core::Tensor;
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;

/// Microbatch ids remembered for at-most-once accumulation.
const SEEN_CAP: usize = 1 << 16;

/// Gradients waiting for their step: one running sum per parameter (so memory does not
/// grow with the microbatches of a step), the sum frozen for the round in progress, and the
/// microbatch ids already taken (each is accumulated at most once).
#[derive(Default)]
pub struct Accum {
    pub(super) sum: Option<Vec<f32>>,
    /// The last frozen step's sum buffer, zeroed, kept for the next step's sum: a large
    /// stage's sum is hundreds of MB, and freeing it at every freeze and allocating it again
    /// a moment later left the allocator holding both (BENCHMARKS.md, "Stop 53").
    spare: Option<Vec<f32>>,
    pub(super) count: u64,
    pub(super) frozen: Option<Frozen>,
    pub(super) params_step: u64,
    seen: HashSet<u64>,
    seen_order: VecDeque<u64>,
    /// Synchronous microbatches whose forward ran here and whose backward has not come.
    pub(super) owed: super::sync::Owed,
    /// The step's update is being applied (its frozen sum already freed): the step stays
    /// closed meanwhile, so nothing is admitted into it.
    pub(super) applying: bool,
}

impl Accum {
    /// Adds a microbatch's gradients (one tensor per parameter, the mean over its
    /// `samples` samples) times `samples` into the running sum of `numel` floats, in
    /// place, one tensor at a time.
    pub(super) fn add(
        &mut self,
        samples: u64,
        grads: &[Tensor],
        numel: usize,
    ) -> Result<(), ModelError> {
        let have: usize = grads.iter().map(|t| t.elem_count()).sum();
        if have != numel {
            return Err(ModelError::BadInput(format!(
                "{have} gradient values for {numel} parameters"
            )));
        }
        let spare = self.spare.take().filter(|v| v.len() == numel);
        let sum = self
            .sum
            .get_or_insert_with(|| spare.unwrap_or_else(|| vec![0.0; numel]));
        let w = samples as f32;
        let mut at = 0;
        for t in grads {
            let g = t
                .flatten_all()?
                .to_dtype(candle_core::DType::F32)?
                .to_vec1::<f32>()?;
            for (s, x) in sum[at..at + g.len()].iter_mut().zip(&g) {
                *s += w * x;
            }
            at += g.len();
        }
        self.count += samples;
        Ok(())
    }

    /// (accum_step, pending samples, frozen samples).
    pub fn counts(&self) -> (u64, u64, u64) {
        (
            self.accum_step(),
            self.count,
            self.frozen.as_ref().map_or(0, |f| f.count),
        )
    }

    /// Samples of synchronous microbatches owed toward the step accumulated now.
    pub fn owed_now(&self) -> u64 {
        self.owed.at(self.accum_step(), std::time::Instant::now())
    }

    pub(super) fn accum_step(&self) -> u64 {
        match &self.frozen {
            _ if self.applying => self.params_step + 1,
            Some(f) if f.step == self.params_step => self.params_step + 1,
            _ => self.params_step,
        }
    }

    /// Empties it for parameters at `step` (the state was replaced); returns the samples
    /// dropped.
    pub(super) fn reset(&mut self, step: u64) -> u64 {
        let dropped = self.count + self.frozen.as_ref().map_or(0, |f| f.count);
        self.sum = None;
        self.spare = None;
        self.count = 0;
        self.frozen = None;
        self.params_step = step;
        self.owed.clear();
        dropped
    }

    /// Drops the sum frozen for `step`, if that is the step frozen; returns its samples.
    pub(super) fn drop_frozen(&mut self, step: u64) -> u64 {
        match &self.frozen {
            Some(f) if f.step == step => {
                let n = f.count;
                self.frozen = None;
                n
            }
            _ => 0,
        }
    }

    /// Whether `mb` is new (and remembers it).
    pub(super) fn admit(&mut self, mb: u64) -> bool {
        if !self.seen.insert(mb) {
            return false;
        }
        self.seen_order.push_back(mb);
        if self.seen_order.len() > SEEN_CAP {
            if let Some(old) = self.seen_order.pop_front() {
                self.seen.remove(&old);
            }
        }
        true
    }

    /// See [`Replica::freeze`].
    pub fn freeze(
        &mut self,
        step: u64,
        numel: usize,
        chunk: usize,
        codec: &CodecSpec,
    ) -> Result<Frozen, ModelError> {
        if step != self.params_step {
            return Err(ModelError::BadInput(format!(
                "cannot freeze step {step} at step {}",
                self.params_step
            )));
        }
        if let Some(f) = &self.frozen {
            if f.step == step {
                return Ok(f.clone());
            }
        }
        let mut sum = self.sum.take().unwrap_or_else(|| vec![0.0; numel]);
        let encoded = EncodedSum::encode(&sum, chunk, codec);
        let encoded = match encoded {
            Ok(e) => e,
            Err(e) => {
                // Nothing frozen: the sum stays for a later attempt.
                self.sum = Some(sum);
                return Err(e);
            }
        };
        sum.fill(0.0);
        self.spare = Some(sum);
        let f = Frozen {
            step,
            sum: Arc::new(encoded),
            count: std::mem::take(&mut self.count),
        };
        self.frozen = Some(f.clone());
        Ok(f)
    }
}
