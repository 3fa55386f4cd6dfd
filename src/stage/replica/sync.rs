//! A replica's side of synchronous steps ([`crate::stage::sync`]): a microbatch of step s
//! is computed at parameters s and its gradient goes into step s, or it is refused.

use super::Replica;
use crate::model::{ModelError, StageGrads, Upstream};
use candle_core::Tensor;
use std::time::Instant;

/// Why a synchronous call was not computed.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// The microbatch's step is not open here: closed (its batch was full), or not
    /// reached.
    #[error("{0}")]
    Closed(String),
    /// The model refused the input or an op failed.
    #[error(transparent)]
    Model(#[from] ModelError),
}

impl Replica {
    /// Whether gradients of step `step` computed now would be of parameters `step` and go
    /// into step `step`.
    fn open_at(&self, step: u64) -> Result<(), SyncError> {
        let accum = self.acc().accum_step();
        if self.params_step != step || accum != step {
            return Err(SyncError::Closed(crate::stage::sync::closed_message(
                step,
                self.params_step,
                accum,
            )));
        }
        Ok(())
    }

    /// The forward of synchronous microbatch `mb` of step `step`, at that step's parameters
    /// exactly (no prediction), or refused when the step is not open here; its graph is
    /// kept for the backward and its samples are owed to the step until the backward comes.
    /// Returns the output and the step it was computed at.
    pub fn forward_sync(
        &mut self,
        input: &Tensor,
        mb: u64,
        step: u64,
    ) -> Result<(Tensor, u64), SyncError> {
        if let Err(e) = self.open_at(step) {
            self.acc().owed.settle(mb);
            return Err(e);
        }
        let n = input.dims().first().copied().unwrap_or(0) as u64;
        let out = match self.sim {
            Some(sim) => self.sim_forward(sim, input, mb)?,
            None => {
                let kept = self.stage.forward_kept(input)?;
                let out = kept.output().detach();
                if self.kept.insert(mb, (kept, step)).is_none() {
                    self.kept_order.push_back(mb);
                }
                self.keep_within_cap();
                out
            }
        };
        self.acc().owed.add(mb, step, n, Instant::now());
        Ok((out, step))
    }

    /// The backward of synchronous microbatch `mb` of step `step`: through its kept forward
    /// when it ran here at that step, else recomputed at the current parameters (which are
    /// step `step`'s, or it is refused). The gradient joins that step or nothing: when the averager froze the step
    /// meanwhile, the call is refused and nothing accumulated. Returns the gradients,
    /// whether they were accumulated, and the step they joined.
    pub fn backward_sync(
        &mut self,
        input: &Tensor,
        upstream: Upstream<'_>,
        mb: u64,
        step: u64,
    ) -> Result<(StageGrads, bool, u64), SyncError> {
        let kept = self
            .kept
            .remove(&mb)
            .filter(|(k, at)| k.input_dims() == input.dims() && *at == step);
        if let Err(e) = self.open_at(step) {
            self.acc().owed.settle(mb);
            return Err(e);
        }
        let kept = kept.map(|(k, _)| k);
        let mut g = self.backward_of(kept, input, upstream, mb, |r| {
            r.stage.backward(input, upstream)
        })?;
        let grads = std::mem::take(&mut g.grads);
        let n = input.dims().first().copied().unwrap_or(0) as u64;
        let numel = self.numel;
        let mut acc = self.acc();
        acc.owed.settle(mb);
        if acc.accum_step() != step {
            return Err(SyncError::Closed(format!(
                "step {step} closed while its gradient was computed"
            )));
        }
        if !acc.admit(mb) {
            return Ok((g, false, step));
        }
        acc.add(n, &grads, numel)?;
        drop(acc);
        Ok((g, true, step))
    }
}
