//! A stage's parameters and optimizer state as a safetensors file, written atomically.
//!
//! Tensors are stored as `param/<name>`, `adam.m/<name>` and `adam.v/<name>`; the metadata
//! holds the format, the stage index and the optimizer step. The file is written to a
//! temporary name beside the target, synced, then renamed over it, so a crash leaves either
//! the old checkpoint or the new one, never half of one.

use super::optim::AdamW;
use super::stage::Stage;
use super::ModelError;
use candle_core::{DType, Tensor};
use safetensors::tensor::{Dtype as StDtype, SafeTensors, View};
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

const FORMAT: &str = "shoal-stage-v1";

struct Raw {
    dtype: StDtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for Raw {
    fn dtype(&self) -> StDtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn raw(t: &Tensor) -> Result<Raw, ModelError> {
    let flat = t.flatten_all()?;
    let (dtype, data) = match t.dtype() {
        DType::F32 => (
            StDtype::F32,
            bytemuck::cast_slice(&flat.to_vec1::<f32>()?).to_vec(),
        ),
        DType::F64 => (
            StDtype::F64,
            bytemuck::cast_slice(&flat.to_vec1::<f64>()?).to_vec(),
        ),
        other => {
            return Err(ModelError::Checkpoint(format!(
                "cannot store dtype {other:?}"
            )))
        }
    };
    Ok(Raw {
        dtype,
        shape: t.dims().to_vec(),
        data,
    })
}

pub use crate::files::write_atomic;

/// Saves the stage's parameters and the optimizer's state to `path`.
pub fn save(stage: &Stage, opt: &AdamW, path: &Path) -> Result<(), ModelError> {
    let names = stage.params().names();
    let (m, v) = opt.moments();
    let mut tensors = Vec::with_capacity(3 * names.len());
    for (i, name) in names.iter().enumerate() {
        tensors.push((
            format!("param/{name}"),
            raw(stage.params().vars()[i].as_tensor())?,
        ));
        tensors.push((format!("adam.m/{name}"), raw(&m[i])?));
        tensors.push((format!("adam.v/{name}"), raw(&v[i])?));
    }
    let meta = HashMap::from([
        ("format".to_string(), FORMAT.to_string()),
        ("stage".to_string(), stage.index().to_string()),
        ("step".to_string(), opt.step_count().to_string()),
    ]);
    let bytes = safetensors::serialize(tensors, Some(meta))
        .map_err(|e| ModelError::Checkpoint(e.to_string()))?;
    write_atomic(path, &bytes)
        .map_err(|e| ModelError::Checkpoint(format!("{}: {e}", path.display())))
}

/// Loads a checkpoint written by [`save`] into `stage` and `opt`; returns the step.
pub fn load(stage: &Stage, opt: &mut AdamW, path: &Path) -> Result<u64, ModelError> {
    let bad = |m: String| ModelError::Checkpoint(format!("{}: {m}", path.display()));
    let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| bad(e.to_string()))?;
    let info = meta.metadata().clone().unwrap_or_default();
    if info.get("format").map(String::as_str) != Some(FORMAT) {
        return Err(bad("not a shoal stage checkpoint".into()));
    }
    if info.get("stage") != Some(&stage.index().to_string()) {
        return Err(bad(format!(
            "holds stage {:?}, not {}",
            info.get("stage"),
            stage.index()
        )));
    }
    let step: u64 = info
        .get("step")
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("missing step".into()))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
    let get = |key: String, like: &Tensor| -> Result<Tensor, ModelError> {
        let view = st
            .tensor(&key)
            .map_err(|_| bad(format!("missing tensor {key}")))?;
        if view.shape() != like.dims() {
            return Err(bad(format!(
                "{key} has shape {:?}, want {:?}",
                view.shape(),
                like.dims()
            )));
        }
        let dtype = match view.dtype() {
            StDtype::F32 => DType::F32,
            StDtype::F64 => DType::F64,
            other => return Err(bad(format!("{key} has dtype {other:?}"))),
        };
        Ok(
            Tensor::from_raw_buffer(view.data(), dtype, view.shape(), like.device())?
                .to_dtype(like.dtype())?,
        )
    };
    let (m0, v0) = opt.moments();
    let (mut m, mut v, mut p) = (Vec::new(), Vec::new(), Vec::new());
    for (i, name) in stage.params().names().iter().enumerate() {
        p.push(get(
            format!("param/{name}"),
            stage.params().vars()[i].as_tensor(),
        )?);
        m.push(get(format!("adam.m/{name}"), &m0[i])?);
        v.push(get(format!("adam.v/{name}"), &v0[i])?);
    }
    for (var, t) in stage.params().vars().iter().zip(&p) {
        var.set(t)?;
    }
    opt.restore(step, m, v)?;
    Ok(step)
}
