//! Outer averaging in a replica (`averaging.mode = "outer"`, after DiLoCo and SparseLoCo).
//!
//! Between outer steps each replica applies its own gradients with its own inner AdamW:
//! when a step's round freezes it, the replica steps on the mean of the samples it took
//! itself, and the round carries nothing (zero chunks, a few bytes each). On an outer step
//! (every `outer_every` steps, and the run's last) the replica sends instead its
//! pseudo-gradient `Δ = θ_outer − θ` plus `outer_error_decay` (0.95) × the part of earlier
//! ones not yet sent (error feedback, decayed as SparseLoCo's), cut to the largest `outer_density` of each
//! chunk and coded by the gradient codec; the reducers average the members' copies member
//! by member. With the average
//! `Δ̄` every member takes the same outer Nesterov step, `m ← μ·m + Δ̄`,
//! `θ_outer ← θ_outer − lr·(Δ̄ + μ·m)`, and sets `θ ← θ_outer`: the replicas are identical
//! again. `θ_outer` and `m` are the same on every replica at all times (they change only by
//! averaged updates), so a replica's shared hash (the one its progress carries and rounds
//! and replays check) is `θ_outer`'s; `θ` differs between replicas mid-interval.

use super::{flatten, Frozen, Replica};
use crate::config::OuterSettings;
use crate::model::optim::FlatSource;
use crate::model::{ModelError, Stage};
use crate::stage::frozen::EncodedSum;
use crate::wire::{self, ChunkCodec, CodecSpec, Limits};
use std::sync::Arc;

/// The outer state of one replica.
#[derive(Debug)]
pub(super) struct Outer {
    settings: OuterSettings,
    /// The run's last step (`training.steps`): it is an outer step too.
    total_steps: u64,
    /// The outer parameters, flat, in parameter order.
    anchor: Vec<f32>,
    /// The outer momentum.
    momentum: Vec<f32>,
    /// What earlier pseudo-gradients did not send.
    error: Vec<f32>,
}

impl Outer {
    /// Outer state starting at parameters `params`, with no momentum.
    pub(super) fn new(settings: OuterSettings, total_steps: u64, params: Vec<f32>) -> Self {
        let n = params.len();
        Self {
            settings,
            total_steps,
            anchor: params,
            momentum: vec![0.0; n],
            error: vec![0.0; n],
        }
    }

    /// Whether the round of step `step` (taking the parameters from `step` to `step + 1`)
    /// is an outer step.
    pub(super) fn is_outer(&self, step: u64) -> bool {
        (step + 1) % self.settings.every.max(1) == 0 || step + 1 >= self.total_steps
    }

    /// The outer parameters.
    pub(super) fn anchor(&self) -> &[f32] {
        &self.anchor
    }

    /// The outer momentum.
    pub(super) fn momentum(&self) -> &[f32] {
        &self.momentum
    }

    /// Replaces the outer state (a download); the error feedback starts empty.
    pub(super) fn restore(&mut self, anchor: &[f32], momentum: &[f32]) {
        self.anchor = anchor.to_vec();
        self.momentum = momentum.to_vec();
        self.error.iter_mut().for_each(|e| *e = 0.0);
    }

    /// Starts over from `params` (a checkpoint resumed: the outer state is not saved).
    pub(super) fn reset(&mut self, params: Vec<f32>) {
        *self = Self::new(self.settings, self.total_steps, params);
    }

    /// This replica's pseudo-gradient at parameters `params`, with what earlier ones left
    /// unsent, cut to the largest values of each chunk of `chunk` and encoded with
    /// `codec`. What is not sent (cut, or lost to the codec) is kept for the next one.
    pub(super) fn pseudo_gradient(
        &mut self,
        params: &[f32],
        chunk: usize,
        codec: &ChunkCodec,
    ) -> Result<EncodedSum, ModelError> {
        if params.len() != self.anchor.len() {
            return Err(ModelError::BadInput(format!(
                "{} parameters for an outer state of {}",
                params.len(),
                self.anchor.len()
            )));
        }
        let chunk = chunk.max(1);
        let decay = self.settings.error_decay;
        let mut sent: Vec<f32> = self
            .anchor
            .iter()
            .zip(params)
            .zip(&self.error)
            .map(|((a, p), e)| decay * e + (a - p))
            .collect();
        let mut error = sent.clone();
        if self.settings.density < 1.0 {
            for c in sent.chunks_mut(chunk) {
                let k = ((c.len() as f64) * self.settings.density).ceil() as usize;
                wire::sparse::keep_top_k(c, k.max(1));
            }
        }
        let encoded = EncodedSum::encode_chunks(&sent, chunk, codec)?;
        // What the others will decode is what was sent: the rest stays here.
        let mut decoded = Vec::new();
        for (c, e) in error.chunks_mut(chunk).enumerate() {
            let frame = encoded
                .frame(c as u32)
                .ok_or_else(|| ModelError::BadInput(format!("no chunk {c} of the update")))?;
            wire::decode_f32_into(frame, &Limits::default(), &mut decoded)
                .map_err(|err| ModelError::BadInput(format!("decoding the update: {err}")))?;
            for (x, d) in e.iter_mut().zip(&decoded) {
                *x -= d;
            }
        }
        self.error = error;
        Ok(encoded)
    }

    /// The outer Nesterov step with the members' average pseudo-gradient `avg`; returns
    /// the new outer parameters.
    pub(super) fn step(&mut self, avg: &dyn FlatSource) -> Result<&[f32], ModelError> {
        let n = self.anchor.len();
        if avg.len() != n {
            return Err(ModelError::BadInput(format!(
                "an outer update of {} values for {n} parameters",
                avg.len()
            )));
        }
        let (lr, mu) = (self.settings.lr, self.settings.momentum);
        // Read whole before anything changes: a source that fails leaves the state as is.
        let delta = avg.read(0..n)?;
        for ((a, m), d) in self.anchor.iter_mut().zip(&mut self.momentum).zip(&delta) {
            *m = mu * *m + d;
            *a -= lr * (d + mu * *m);
        }
        Ok(&self.anchor)
    }
}

/// The stage's parameters as one flat vector, in parameter order.
pub(super) fn params_flat(stage: &Stage) -> Result<Vec<f32>, ModelError> {
    let ts: Vec<candle_core::Tensor> = stage
        .params()
        .vars()
        .iter()
        .map(|v| v.as_tensor().clone())
        .collect();
    flatten(&ts)
}

impl Replica {
    /// [`Replica::freeze`] in outer mode: the inner step on this replica's own samples,
    /// then the round's copy: the pseudo-gradient on an outer step, zeros otherwise.
    pub(super) fn freeze_outer(
        &mut self,
        step: u64,
        chunk: usize,
        codec: &CodecSpec,
    ) -> Result<Frozen, ModelError> {
        let (sum, count) = {
            let mut a = self.acc();
            if step != a.params_step {
                return Err(ModelError::BadInput(format!(
                    "cannot freeze step {step} at step {}",
                    a.params_step
                )));
            }
            if let Some(f) = a.frozen.as_ref().filter(|f| f.step == step) {
                return Ok(f.clone());
            }
            (a.sum.take(), std::mem::take(&mut a.count))
        };
        let stepped = match (&sum, count) {
            (Some(sum), 1..) => {
                let inv = 1.0 / count as f32;
                let mean: Vec<f32> = sum.iter().map(|x| x * inv).collect();
                self.inner_step(&&mean[..])
            }
            _ => Ok(()),
        };
        if let Err(e) = stepped {
            // Nothing frozen: the samples stay for a later attempt.
            let mut a = self.acc();
            a.sum = sum;
            a.count = count;
            return Err(e);
        }
        drop(sum);
        let Some(outer) = self.outer.as_ref() else {
            return Err(ModelError::BadInput("not in outer mode".into()));
        };
        // Sparse: the zero copies between outer steps take a few bytes a chunk (a copy with
        // more nonzeros than a quarter of a chunk travels dense all the same).
        let codec = ChunkCodec {
            values: *codec,
            sparse: true,
        };
        let encoded = if outer.is_outer(step) {
            let params = params_flat(&self.stage)?;
            match self.outer.as_mut() {
                Some(o) => o.pseudo_gradient(&params, chunk, &codec)?,
                None => return Err(ModelError::BadInput("not in outer mode".into())),
            }
        } else {
            // As few chunks as a frame may hold: a round of zeros is a frame or two per
            // member, whatever the stage's own chunking.
            EncodedSum::zeros(self.numel, crate::wire::msg::PART_CHUNK, &codec)?
        };
        let f = Frozen {
            step,
            sum: Arc::new(encoded),
            count,
        };
        self.acc().frozen = Some(f.clone());
        Ok(f)
    }

    /// [`Replica::apply`]'s update in outer mode: nothing between outer steps (the inner
    /// step was taken at the freeze), the outer step and the new outer parameters on one.
    pub(super) fn apply_outer(
        &mut self,
        step: u64,
        avg: &dyn FlatSource,
    ) -> Result<(), ModelError> {
        let Some(outer) = self.outer.as_mut() else {
            return Ok(());
        };
        if !outer.is_outer(step) {
            return Ok(());
        }
        outer.step(avg)?;
        if let Some(o) = &self.outer {
            super::state::load_flat(&self.stage, o.anchor())?;
        }
        // The parameters jumped: what the predictor learned of the last steps is moot.
        self.predict.reset();
        Ok(())
    }

    /// Recomputes the shared hash after the parameters or the outer state changed.
    pub(super) fn refresh_shared_hash(&mut self) {
        self.shared_hash = match &self.outer {
            Some(o) => format!("{:016x}", self.stage.params().hash_flat(o.anchor())),
            None => self.params_hash.clone(),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::CodecSpec;

    fn settings(density: f64) -> OuterSettings {
        OuterSettings {
            every: 4,
            lr: 1.0,
            momentum: 0.0,
            density,
            codec: CodecSpec::F32,
            error_decay: 0.95,
        }
    }

    #[test]
    fn outer_steps_come_every_h_steps_and_at_the_last() {
        let o = Outer::new(settings(1.0), 10, vec![0.0; 3]);
        let outer: Vec<u64> = (0..10).filter(|s| o.is_outer(*s)).collect();
        assert_eq!(outer, vec![3, 7, 9]);
    }

    #[test]
    fn what_is_not_sent_is_sent_later() -> Result<(), ModelError> {
        let codec = ChunkCodec {
            values: CodecSpec::F32,
            sparse: true,
        };
        let mut o = Outer::new(settings(0.25), 100, vec![0.0; 8]);
        // θ moved by −(1..8)/10: Δ = (1..8)/10; the 2 largest of each chunk of 4 go first.
        let params: Vec<f32> = (1..=8).map(|i| -(i as f32) / 10.0).collect();
        let sent = o.pseudo_gradient(&params, 4, &codec)?;
        let first: Vec<f32> = (0..2)
            .flat_map(|c| sent.decode(c).unwrap_or_default())
            .collect();
        assert_eq!(first, vec![0.0, 0.0, 0.0, 0.4, 0.0, 0.0, 0.0, 0.8]);
        // Nothing new moved: the next largest unsent values go (decayed by 0.95 for
        // each outer step they waited), and so on until all went.
        let mut total = first;
        for _ in 0..3 {
            let more = o.pseudo_gradient(&[0.0; 8], 4, &codec)?;
            // The anchor did not move, so Δ stays θ_outer − θ = 0 and only the error goes.
            let more: Vec<f32> = (0..2)
                .flat_map(|c| more.decode(c).unwrap_or_default())
                .collect();
            total.iter_mut().zip(&more).for_each(|(t, m)| *t += m);
        }
        let d = 0.95f32;
        let waited = [d * d * d, d * d, d, 1.0];
        let want: Vec<f32> = (1..=8)
            .map(|i| waited[(i - 1) % 4] * i as f32 / 10.0)
            .collect();
        for (t, w) in total.iter().zip(&want) {
            assert!((t - w).abs() < 1e-6, "{total:?} vs {want:?}");
        }
        Ok(())
    }

    #[test]
    fn the_outer_step_is_nesterov_on_the_average() -> Result<(), ModelError> {
        let mut o = Outer::new(
            OuterSettings {
                every: 2,
                lr: 0.5,
                momentum: 0.9,
                density: 1.0,
                codec: CodecSpec::F32,
                error_decay: 0.95,
            },
            100,
            vec![1.0, 2.0],
        );
        let avg = [0.2f32, -0.4];
        let a = o.step(&&avg[..])?.to_vec();
        // m = Δ; θ_outer −= lr·(Δ + μ·m) = 0.5·1.9·Δ.
        assert!((a[0] - (1.0 - 0.5 * 1.9 * 0.2)).abs() < 1e-6, "{a:?}");
        assert!((a[1] - (2.0 + 0.5 * 1.9 * 0.4)).abs() < 1e-6, "{a:?}");
        assert_eq!(o.momentum(), &[0.2, -0.4]);
        Ok(())
    }
}
