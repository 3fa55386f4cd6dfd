//! A replica's training state: the stage, its optimizer, and the gradient accumulator.
//!
//! Shared (behind a mutex) by the compute thread, which runs backward passes into the
//! accumulator, and the averager, which freezes the accumulator for a step, applies the
//! averaged gradient, and exports or imports the whole state for joiners.
//!
//! Steps: `params_step` counts applied optimizer steps. Backward passes accumulate toward
//! `params_step` until the averager freezes that step's sum for its round; from then on
//! they accumulate toward `params_step + 1` (a gradient is at most one step stale).

pub use super::accum::Accum;
pub use super::frozen::Frozen;
use super::predict::{self, Predictor};
use super::sim::SimCompute;
use crate::config::RunConfig;
use crate::model::optim::FlatSource;
use crate::model::stage::Kept;
use crate::model::{AdamW, ModelError, Stage, StageGrads, Upstream};
use crate::wire::CodecSpec;
use candle_core::Tensor;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::Arc;

/// Forward graphs kept for their backward, unless [`Replica::with_kept_cap`] says otherwise.
pub const KEPT_CAP: usize = 32;

/// Stages of at least this many parameters give freed memory back to the OS after each
/// step ([`crate::release_memory`]; not after each backward, whose buffers the next one
/// reuses); smaller ones keep it for speed.
const RELEASE_NUMEL: usize = 1 << 24;

/// The mutable state of one replica.
pub struct Replica {
    stage: Stage,
    opt: AdamW,
    params_step: u64,
    accum: Arc<Mutex<Accum>>,
    /// Kept forwards, with the parameter step each ran at (moved by [`Predictor`]'s
    /// expected lag when it predicts).
    kept: std::collections::HashMap<u64, (Kept, u64)>,
    kept_order: VecDeque<u64>,
    kept_cap: usize,
    /// Whether a kept forward whose gradient would be two steps stale is recomputed (the
    /// one-step staleness bound; off only to measure what it buys).
    bound_staleness: bool,
    numel: usize,
    samples_applied: u64,
    samples_lost: u64,
    samples_dropped: u64,
    params_hash: String,
    history: Vec<(u64, String)>,
    sim: Option<SimCompute>,
    /// Kept forwards dropped as too stale and recomputed at the current parameters.
    stale_recomputed: u64,
    /// The largest staleness (steps between the parameters a gradient was computed at and
    /// the step it was accumulated into) seen so far.
    max_staleness: u64,
    /// Gradients computed at predicted parameters (delayed updates).
    predict: Predictor,
    /// Outer averaging's state, in `outer` mode.
    outer: Option<outer::Outer>,
    /// The hash the stage's replicas agree on: the parameters' (the outer parameters' in
    /// `outer` mode).
    shared_hash: String,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("stage", &self.stage.index())
            .field("params_step", &self.params_step)
            .field("accum_count", &self.accum_count())
            .finish()
    }
}

/// Flattens tensors (any float dtype) into one f32 vector.
pub fn flatten(ts: &[Tensor]) -> Result<Vec<f32>, ModelError> {
    let n: usize = ts.iter().map(|t| t.elem_count()).sum();
    let mut out = Vec::with_capacity(n);
    for t in ts {
        out.extend(
            t.flatten_all()?
                .to_dtype(candle_core::DType::F32)?
                .to_vec1::<f32>()?,
        );
    }
    Ok(out)
}

fn hash_of(stage: &Stage) -> Result<String, ModelError> {
    Ok(format!("{:016x}", stage.params().hash()?))
}

impl Replica {
    /// A fresh replica of `stage` at step 0 (the deterministic init).
    pub fn new(cfg: &RunConfig, stage: Stage) -> Result<Self, ModelError> {
        let opt = AdamW::new(&cfg.optimizer, cfg.training.steps, stage.params())?;
        let params_hash = hash_of(&stage)?;
        let shared_hash = params_hash.clone();
        let numel = stage.params().numel();
        let outer = match cfg.averaging.outer() {
            Some(o) => Some(outer::Outer::new(
                o,
                cfg.training.steps,
                outer::params_flat(&stage)?,
            )),
            None => None,
        };
        Ok(Self {
            stage,
            opt,
            params_step: 0,
            accum: Arc::new(Mutex::new(Accum::default())),
            kept: std::collections::HashMap::new(),
            kept_order: VecDeque::new(),
            kept_cap: KEPT_CAP,
            bound_staleness: true,
            numel,
            samples_applied: 0,
            samples_lost: 0,
            samples_dropped: 0,
            history: vec![(0, params_hash.clone())],
            params_hash,
            sim: SimCompute::of(cfg, 1.0),
            stale_recomputed: 0,
            max_staleness: 0,
            predict: Predictor::new(numel <= predict::MAX_NUMEL),
            outer,
            shared_hash,
        })
    }

    /// Replaces the timing of a `sim` stage (e.g. slowed down for one peer); no effect on a
    /// real model.
    pub fn with_sim(mut self, sim: Option<SimCompute>) -> Self {
        if self.sim.is_some() {
            self.sim = sim;
        }
        self
    }

    /// Keeps up to `cap` forward graphs (at least one) for their backward; beyond that the
    /// oldest are dropped and their backward recomputes the forward. More costs memory
    /// (a microbatch's activations each) and saves compute when many microbatches are in
    /// flight through this replica.
    pub fn with_kept_cap(mut self, cap: usize) -> Self {
        self.kept_cap = cap.max(1);
        self
    }

    /// Turns weight prediction off (it is on for stages of at most
    /// [`predict::MAX_NUMEL`] parameters with the staleness bound).
    pub fn with_prediction(mut self, on: bool) -> Self {
        if !on {
            self.predict = Predictor::new(false);
        }
        self
    }

    /// With `false`, a backward runs through its kept forward however many updates ago it
    /// ran, and the gradient goes into the step being accumulated: gradients may be
    /// several steps stale (shoal's "no-sync" mode before delayed updates; kept only so
    /// that `shoal bench converge` can show what the bound buys). Also turns weight
    /// prediction off.
    pub fn with_staleness_bound(mut self, bound: bool) -> Self {
        self.bound_staleness = bound;
        if !bound {
            self.predict = Predictor::new(false);
        }
        self
    }

    /// The stand-in's timing, for a `sim` run.
    pub fn sim(&self) -> Option<&SimCompute> {
        self.sim.as_ref()
    }

    /// The stage.
    pub fn stage(&self) -> &Stage {
        &self.stage
    }

    /// Applied optimizer steps.
    pub fn params_step(&self) -> u64 {
        self.params_step
    }

    fn acc(&self) -> parking_lot::MutexGuard<'_, Accum> {
        self.accum.lock()
    }

    /// The gradient accumulator, which the averager freezes without waiting for compute.
    pub fn accumulator(&self) -> Arc<Mutex<Accum>> {
        Arc::clone(&self.accum)
    }

    /// The step backward passes accumulate toward now.
    pub fn accum_step(&self) -> u64 {
        self.acc().accum_step()
    }

    /// Samples accumulated toward [`Self::accum_step`].
    pub fn accum_count(&self) -> u64 {
        self.acc().count
    }

    /// Samples of synchronous microbatches owed toward the step accumulated now.
    pub fn owed_count(&self) -> u64 {
        self.acc().owed_now()
    }

    /// Samples frozen for a round in progress.
    pub fn frozen_count(&self) -> u64 {
        self.acc().frozen.as_ref().map_or(0, |f| f.count)
    }

    /// Samples in every step applied so far.
    pub fn samples_applied(&self) -> u64 {
        self.samples_applied
    }

    /// Samples lost with dead replicas, as recorded by the rounds.
    pub fn samples_lost(&self) -> u64 {
        self.samples_lost
    }

    /// Samples this replica accumulated but dropped when it replaced its state.
    pub fn samples_dropped(&self) -> u64 {
        self.samples_dropped
    }

    /// (step, parameter hash) after every applied step and every state download.
    pub fn history(&self) -> &[(u64, String)] {
        &self.history
    }

    /// Hex hash of the parameters.
    pub fn params_hash(&self) -> &str {
        &self.params_hash
    }

    /// The hash every replica of the stage holds at the same step: the parameters' hash,
    /// or in `outer` mode the outer parameters' (the parameters themselves differ between
    /// outer steps).
    pub fn shared_hash(&self) -> &str {
        &self.shared_hash
    }

    /// Forward of microbatch `mb`; the graph is kept (a few dozen microbatches at most) so
    /// that its backward here needs no recomputation and matches the activations sent on.
    /// `mb` 0 (evaluation) keeps nothing.
    pub fn forward(&mut self, input: &Tensor, mb: u64) -> Result<Tensor, ModelError> {
        if let Some(sim) = self.sim {
            return self.sim_forward(sim, input, mb);
        }
        if mb == 0 {
            return self.stage.forward(input);
        }
        // At the parameters its gradient is expected to be applied to (see `predict`).
        let h = self.predict.horizon();
        let stage = &self.stage;
        let kept = self
            .predict
            .shifted(stage.params(), h, || stage.forward_kept(input))?;
        let out = kept.output().detach();
        if self.kept.insert(mb, (kept, self.params_step)).is_none() {
            self.kept_order.push_back(mb);
        }
        self.keep_within_cap();
        Ok(out)
    }

    /// The `sim` stand-in's forward of `mb`, remembered as a real stage keeps its graph so
    /// that its backward knows whether it would have had to recompute it (`mb` 0 keeps
    /// nothing).
    fn sim_forward(
        &mut self,
        sim: SimCompute,
        input: &Tensor,
        mb: u64,
    ) -> Result<Tensor, ModelError> {
        if mb != 0 && !self.kept_order.contains(&mb) {
            self.kept_order.push_back(mb);
            self.keep_within_cap();
        }
        sim.forward(&self.stage, input)
    }

    /// The backward of `mb` through `kept` when there is one, else `recompute`d; a `sim`
    /// stage times it as a recomputation when it never ran the forward.
    fn backward_of(
        &mut self,
        kept: Option<Kept>,
        input: &Tensor,
        upstream: Upstream<'_>,
        mb: u64,
        recompute: impl FnOnce(&Self) -> Result<StageGrads, ModelError>,
    ) -> Result<StageGrads, ModelError> {
        match (kept, self.sim) {
            (_, Some(sim)) => {
                let ran = self.kept_order.iter().position(|&m| m == mb);
                if let Some(i) = ran {
                    self.kept_order.remove(i);
                }
                sim.backward(&self.stage, input, upstream, ran.is_none())
            }
            (Some(k), None) => self.stage.backward_kept(k, upstream),
            (None, None) => recompute(self),
        }
    }

    /// Drops the oldest kept forwards beyond the cap.
    fn keep_within_cap(&mut self) {
        while self.kept_order.len() > self.kept_cap {
            if let Some(old) = self.kept_order.pop_front() {
                self.kept.remove(&old);
            }
        }
    }

    /// Backward of microbatch `mb` (`samples` sequences), through its kept forward when
    /// this replica ran it, else recomputing; accumulates the parameter gradients unless
    /// this replica already accumulated `mb`. The gradients returned hold the loss and the
    /// input gradient only: the parameter gradients are freed here, not held beside the
    /// accumulator while the answer is sent.
    pub fn backward(
        &mut self,
        input: &Tensor,
        upstream: Upstream<'_>,
        mb: u64,
    ) -> Result<(StageGrads, bool), ModelError> {
        let kept = self
            .kept
            .remove(&mb)
            .filter(|(k, _)| k.input_dims() == input.dims());
        // The step this gradient joins: this one, or the next while this one is frozen.
        let joins = self.acc().accum_step();
        if let Some((_, at)) = &kept {
            self.predict.observe(*at, joins);
        }
        // At most one step stale, by construction: gradients go into step `params_step`
        // or, while that step's sum is frozen for its round, `params_step + 1`. A kept
        // forward is used while its gradient would be at most one step stale now. With
        // prediction it ran at θ + h·Δ for the expected lag h, so whether its gradient
        // joins the step it ran at or the next one it is off by less than one update; a
        // replica that does not predict recomputes one from before the last update at the
        // current parameters, which are fresher.
        let kept = match kept {
            Some((_, at))
                if self.bound_staleness
                    && (joins > at + 1 || (at < self.params_step && !self.predict.active())) =>
            {
                tracing::debug!(mb, at, joins, params_step = self.params_step, "recomputed");
                self.stale_recomputed += 1;
                None
            }
            k => k,
        };
        // Kept or recomputed, the gradient is of the parameters its forward ran at.
        let mut computed_at = kept.as_ref().map_or(self.params_step, |(_, at)| *at);
        let kept = kept.map(|(k, _)| k);
        let mut g =
            self.backward_of(kept, input, upstream, mb, |r| r.recompute(input, upstream))?;
        let n = input.dims().first().copied().unwrap_or(0) as u64;
        let numel = self.numel;
        let mut acc = self.acc();
        if self.bound_staleness && acc.accum_step() > computed_at + 1 {
            // The averager froze the step since the choice above, which made a kept
            // forward from before the last update two steps stale: recomputed at the
            // current parameters, at most one step stale whatever the averager does next
            // (only this thread moves `params_step`).
            drop(acc);
            tracing::debug!(mb, computed_at, "recomputed: the step froze meanwhile");
            self.stale_recomputed += 1;
            g = self.recompute(input, upstream)?;
            computed_at = self.params_step;
            acc = self.acc();
        }
        let grads = std::mem::take(&mut g.grads);
        if !acc.admit(mb) {
            return Ok((g, false));
        }
        let staleness = acc.accum_step().saturating_sub(computed_at);
        if staleness > 1 && self.bound_staleness {
            // Unreachable by the construction above; checked, never accumulated.
            return Err(ModelError::BadInput(format!(
                "a gradient of step {computed_at} would go into step {}",
                acc.accum_step()
            )));
        }
        acc.add(n, &grads, numel)?;
        drop(acc);
        self.max_staleness = self.max_staleness.max(staleness);
        Ok((g, true))
    }

    /// Forward and backward of `input` at the current parameters, moved to those predicted
    /// for the step the gradient joins when that is a later one.
    fn recompute(&self, input: &Tensor, upstream: Upstream<'_>) -> Result<StageGrads, ModelError> {
        let ahead = self.acc().accum_step().saturating_sub(self.params_step) as f64;
        let stage = &self.stage;
        self.predict
            .shifted(stage.params(), ahead, || stage.backward(input, upstream))
    }

    /// A probe's backward: recomputed from `input` at the current parameters, the loss and
    /// input gradient returned, the parameter gradients dropped (nothing accumulated, no
    /// kept forward used or removed).
    pub fn probe_backward(
        &mut self,
        input: &Tensor,
        upstream: Upstream<'_>,
    ) -> Result<StageGrads, ModelError> {
        let mut g = match &self.sim {
            Some(sim) => sim.backward(&self.stage, input, upstream, true)?,
            None => self.stage.backward(input, upstream)?,
        };
        g.grads.clear();
        Ok(g)
    }

    /// (kept forwards recomputed as too stale, the largest staleness accumulated so far).
    pub fn staleness(&self) -> (u64, u64) {
        (self.stale_recomputed, self.max_staleness)
    }

    /// After a step on a large stage (or part of a restore), gives freed memory back at
    /// once.
    fn release_if_large(&self) {
        if self.numel >= RELEASE_NUMEL {
            crate::release_memory();
        }
    }

    /// Freezes the gradients of step `step` (the current `params_step`) and returns their
    /// sum: everything accumulated so far; later backward passes count toward the next
    /// step. The sum is encoded in chunks of `chunk` values with `codec` and the f32 copy
    /// freed. Repeated calls for the same step return the same sum (for retried rounds).
    pub fn freeze(
        &mut self,
        step: u64,
        chunk: usize,
        codec: &CodecSpec,
    ) -> Result<Frozen, ModelError> {
        if self.outer.is_some() {
            return self.freeze_outer(step, chunk, codec);
        }
        let numel = self.numel;
        self.acc().freeze(step, numel, chunk, codec)
    }

    /// Applies the averaged gradient of step `step`, which held `samples` samples; `lost`
    /// samples of the step died with a replica.
    pub fn apply(
        &mut self,
        step: u64,
        avg: &dyn FlatSource,
        samples: u64,
        lost: u64,
    ) -> Result<(), ModelError> {
        if step != self.params_step {
            return Err(ModelError::BadInput(format!(
                "cannot apply step {step} at step {}",
                self.params_step
            )));
        }
        if avg.len() != self.numel {
            return Err(ModelError::BadInput(format!(
                "an averaged gradient of {} values for {} parameters",
                avg.len(),
                self.numel
            )));
        }
        // The frozen sum is no longer needed: free it before the update's temporaries (the
        // step stays closed while the update is applied).
        {
            let mut a = self.acc();
            a.frozen = None;
            a.applying = true;
        }
        let updated = match self.outer.is_some() {
            // Outer mode: the inner step was taken when the step froze; an outer step
            // moves to the new outer parameters.
            true => self.apply_outer(step, avg),
            false => self.inner_step(avg),
        };
        if let Err(e) = updated {
            self.acc().applying = false;
            return Err(e);
        }
        self.params_step += 1;
        self.samples_applied += samples;
        self.samples_lost += lost;
        {
            let mut a = self.acc();
            a.frozen = None;
            a.applying = false;
            a.params_step = self.params_step;
        }
        self.params_hash = hash_of(&self.stage)?;
        self.history
            .push((self.params_step, self.params_hash.clone()));
        self.refresh_shared_hash();
        self.release_if_large();
        Ok(())
    }

    /// One optimizer step on the gradient `grad`, weight prediction kept in step.
    fn inner_step(&mut self, grad: &dyn FlatSource) -> Result<(), ModelError> {
        let before = self.predict.before_update(self.stage.params())?;
        self.opt.step_flat(self.stage.params(), grad)?;
        self.predict.after_update(self.stage.params(), before)?;
        Ok(())
    }

    /// Applies an update another replica applied at `step` (a replay, to catch up) and
    /// checks that the parameters reach `hash`, the hash it reached. A replay that misses
    /// it leaves this replica diverged (its hash then differs from the stage's, and it
    /// downloads the whole state) and is an error.
    pub fn replay(
        &mut self,
        step: u64,
        avg: &dyn FlatSource,
        samples: u64,
        lost: u64,
        hash: &str,
    ) -> Result<(), ModelError> {
        self.apply(step, avg, samples, lost)?;
        if self.shared_hash != hash {
            return Err(ModelError::BadInput(format!(
                "replaying step {step} reached parameters hashing to {}, not {hash}",
                self.shared_hash
            )));
        }
        Ok(())
    }

    /// Drops the samples accumulated toward step `step` and not frozen, before an update
    /// of that step made without them is replayed (this replica was behind while the others
    /// applied it): they belong to no step any more and count as dropped, instead of being
    /// carried into the next step (where, in a synchronous run, they took the room of that
    /// step's own microbatches). Returns them.
    pub fn drop_pending(&mut self, step: u64) -> u64 {
        let mut a = self.acc();
        if a.accum_step() != step || a.count == 0 {
            return 0;
        }
        let n = std::mem::take(&mut a.count);
        a.sum = None;
        drop(a);
        self.samples_dropped += n;
        n
    }

    /// Drops the sum frozen for step `step` when no round took it (the replica froze it
    /// when the step's batch was full, and the others applied the step without it): its
    /// samples count as dropped. Returns them.
    pub fn drop_unsent(&mut self, step: u64) -> u64 {
        let n = self.acc().drop_frozen(step);
        self.samples_dropped += n;
        n
    }
}

mod outer;
mod parts;
pub use parts::{Parts, PART};
mod state;
pub use state::Snapshot;

mod sync;
pub use sync::SyncError;

#[cfg(test)]
mod tests;
