//! A replica's whole state in and out: snapshots streamed to joiners and restored from a
//! download, checkpoints saved and resumed.

use super::parts::Parts;
use super::{hash_of, Replica};
use crate::model::checkpoint::{self, Info};
use crate::model::ModelError;
use candle_core::Tensor;

/// Parameters and optimizer state as flat vectors, for state transfer.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    /// Applied optimizer steps.
    pub step: u64,
    /// Parameters, then first moments, then second moments, each in parameter order (in
    /// `outer` mode then the outer parameters and the outer momentum).
    pub flat: Vec<f32>,
    /// Hash of the parameters (hex), as announced.
    pub params_hash: String,
    /// Samples in every step applied so far.
    pub samples_applied: u64,
    /// Samples lost with dead replicas so far.
    pub samples_lost: u64,
}

impl Replica {
    /// The whole state, for a joiner, in memory (the layout [`Self::write_state`] streams).
    pub fn snapshot(&self) -> Result<Snapshot, ModelError> {
        let mut flat = Vec::with_capacity(self.snapshot_len());
        let mut snap = self.write_state(&mut |v| {
            flat.extend_from_slice(v);
            Ok(())
        })?;
        snap.flat = flat;
        Ok(snap)
    }

    /// Streams the whole state (parameters, then first moments, then second moments, in
    /// parameter order, as f32) to `sink`, one tensor at a time: a copy of the state is
    /// never held in memory. Returns the snapshot's metadata (its `flat` left empty).
    pub fn write_state(
        &self,
        sink: &mut dyn FnMut(&[f32]) -> std::io::Result<()>,
    ) -> Result<Snapshot, ModelError> {
        let (m, v) = self.opt.moments();
        let params = self.stage.params().vars().iter().map(|v| v.as_tensor());
        let write = |sink: &mut dyn FnMut(&[f32]) -> std::io::Result<()>, v: &[f32]| {
            sink(v).map_err(|e| ModelError::BadInput(format!("writing the state: {e}")))
        };
        for t in params.chain(m.iter()).chain(v.iter()) {
            let flat = t
                .flatten_all()?
                .to_dtype(candle_core::DType::F32)?
                .to_vec1::<f32>()?;
            write(sink, &flat)?;
        }
        if let Some(o) = &self.outer {
            write(sink, o.anchor())?;
            write(sink, o.momentum())?;
        }
        Ok(Snapshot {
            step: self.params_step,
            flat: Vec::new(),
            params_hash: self.params_hash.clone(),
            samples_applied: self.samples_applied,
            samples_lost: self.samples_lost,
        })
    }

    /// Writes the stage's parameters and optimizer state to `path` atomically, as a
    /// checkpoint of run `run` (whose canonical config is `config`).
    pub fn save(
        &self,
        path: &std::path::Path,
        run: &str,
        config: &str,
    ) -> Result<Info, ModelError> {
        let info = Info {
            run: run.to_string(),
            config: config.to_string(),
            stage: self.stage.index(),
            step: self.params_step,
            params_hash: self.params_hash.clone(),
            samples_applied: self.samples_applied,
            samples_lost: self.samples_lost,
        };
        checkpoint::save(&self.stage, &self.opt, path, &info)?;
        Ok(info)
    }

    /// Replaces the state with checkpoint `path` of run `run` (refused if it is of another
    /// run or stage, has other shapes, or does not hash to what it records); drops
    /// accumulated gradients.
    pub fn resume(&mut self, path: &std::path::Path, run: &str) -> Result<Info, ModelError> {
        let info = checkpoint::load(&self.stage, &mut self.opt, path, run)?;
        self.predict.reset();
        self.params_step = info.step;
        self.samples_applied = info.samples_applied;
        self.samples_lost = info.samples_lost;
        self.params_hash = hash_of(&self.stage)?;
        self.history = vec![(self.params_step, self.params_hash.clone())];
        // The outer state is not in a checkpoint: the next interval starts here.
        if self.outer.is_some() {
            let params = super::outer::params_flat(&self.stage)?;
            if let Some(o) = self.outer.as_mut() {
                o.reset(params);
            }
        }
        self.refresh_shared_hash();
        self.acc().reset(info.step);
        Ok(info)
    }

    /// Floats in a snapshot.
    pub fn snapshot_len(&self) -> usize {
        let copies = if self.outer.is_some() { 5 } else { 3 };
        copies * self.stage.params().numel()
    }

    /// Replaces the state with a snapshot; drops accumulated and frozen gradients (they
    /// were computed on other parameters) and returns the samples dropped.
    pub fn restore(&mut self, snap: &Snapshot) -> Result<u64, ModelError> {
        self.restore_parts(snap, Parts::from_vec(snap.flat.clone()))
    }

    /// [`Self::restore`] from a downloaded state in `parts` (`snap` gives the rest, its
    /// `flat` unread): each part is freed once read, and on a large stage its memory handed
    /// back, so the state is never held twice.
    pub fn restore_parts(&mut self, snap: &Snapshot, mut parts: Parts) -> Result<u64, ModelError> {
        let n = self.stage.params().numel();
        if parts.left() != self.snapshot_len() {
            return Err(ModelError::BadInput(format!(
                "snapshot of {} values for a stage of {n} parameters",
                parts.left()
            )));
        }
        // Check the parameters against the hash the donors announced before anything is
        // replaced: a bad download never becomes the replica's state.
        let mut at = 0;
        let hash = self.stage.params().hash_read(&mut |k, f| {
            parts.peek(at, k, f);
            at += k;
        });
        let hash = format!("{hash:016x}");
        if hash != snap.params_hash {
            return Err(ModelError::BadInput(format!(
                "the downloaded parameters hash to {hash}, not the donors' {}",
                snap.params_hash
            )));
        }
        load_with(&self.stage, &mut |k| parts.take(k))?;
        self.release_if_large();
        self.opt.restore_with(snap.step, &mut |k| parts.take(k))?;
        self.release_if_large();
        if let Some(o) = self.outer.as_mut() {
            let anchor = parts.take(n);
            o.restore(&anchor, &parts.take(n));
        }
        self.predict.reset();
        self.params_step = snap.step;
        self.samples_applied = snap.samples_applied;
        self.samples_lost = snap.samples_lost;
        self.params_hash = hash_of(&self.stage)?;
        self.history
            .push((self.params_step, self.params_hash.clone()));
        self.refresh_shared_hash();
        let dropped = self.acc().reset(snap.step);
        self.samples_dropped += dropped;
        Ok(dropped)
    }
}

/// Sets the stage's parameters from `flat` (in parameter order), one tensor at a time, so
/// the state is never held twice beside `flat`.
pub(super) fn load_flat(stage: &crate::model::Stage, flat: &[f32]) -> Result<(), ModelError> {
    let n = stage.params().numel();
    if flat.len() != n {
        return Err(ModelError::BadInput(format!(
            "{} values for a stage of {n} parameters",
            flat.len()
        )));
    }
    let mut at = 0;
    load_with(stage, &mut |k| {
        at += k;
        flat[at - k..at].to_vec()
    })
}

/// Sets the stage's parameters, in order, from the values `take(k)` hands over `k` at a
/// time, one tensor at a time. A source that runs short is an error with the parameters
/// partly replaced: check its length first.
fn load_with(
    stage: &crate::model::Stage,
    take: &mut dyn FnMut(usize) -> Vec<f32>,
) -> Result<(), ModelError> {
    for var in stage.params().vars() {
        let k = var.elem_count();
        let values = take(k);
        if values.len() != k {
            return Err(ModelError::BadInput(
                "the state does not match the parameters".into(),
            ));
        }
        var.set(&Tensor::from_vec(values, var.dims(), var.device())?.to_dtype(var.dtype())?)?;
    }
    Ok(())
}
