//! A stage's parameters and optimizer state as a safetensors file, written atomically.
//!
//! Tensors are stored as `param/<name>`, `adam.m/<name>` and `adam.v/<name>`; the metadata
//! ([`Info`]) holds the format, the run id, the run's canonical config, the stage, the
//! optimizer step, the parameters' hash and the sample counts. Tensors are converted one at a
//! time as the file is written (a copy of the state is never held), into a temporary name
//! beside the target, synced, then renamed over it, so a crash leaves either the old
//! checkpoint or the new one, never half of one. Loading checks the run, the stage, every
//! shape, and the parameters' hash after loading.

use super::optim::AdamW;
use super::stage::Stage;
use super::ModelError;
use candle_core::{DType, Tensor};
use safetensors::tensor::{Dtype as StDtype, SafeTensors, View};
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

const FORMAT: &str = "shoal-stage-v2";

/// What a checkpoint says about itself.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Info {
    /// The run id (the hash of the run's canonical config).
    pub run: String,
    /// The run's canonical config (TOML), so the file alone rebuilds the model.
    #[serde(skip)]
    pub config: String,
    /// The stage.
    pub stage: usize,
    /// The optimizer steps applied.
    pub step: u64,
    /// The parameters' hash (16 hex digits), as announced.
    pub params_hash: String,
    /// Samples in every step applied.
    pub samples_applied: u64,
    /// Samples lost with dead replicas.
    pub samples_lost: u64,
}

impl Info {
    fn to_map(&self) -> HashMap<String, String> {
        HashMap::from([
            ("format".into(), FORMAT.into()),
            ("run".into(), self.run.clone()),
            ("config".into(), self.config.clone()),
            ("stage".into(), self.stage.to_string()),
            ("step".into(), self.step.to_string()),
            ("params_hash".into(), self.params_hash.clone()),
            ("samples_applied".into(), self.samples_applied.to_string()),
            ("samples_lost".into(), self.samples_lost.to_string()),
        ])
    }

    fn from_map(m: &HashMap<String, String>, path: &Path) -> Result<Self, ModelError> {
        let bad = |what: &str| {
            ModelError::Checkpoint(format!(
                "{} is not a shoal stage checkpoint ({what})",
                path.display()
            ))
        };
        match m.get("format").map(String::as_str) {
            Some(FORMAT) => {}
            Some("shoal-stage-v1") => {
                return Err(ModelError::Checkpoint(format!(
                    "{} is an old-format checkpoint without a run id; it cannot be resumed",
                    path.display()
                )))
            }
            _ => return Err(bad("no shoal format in its metadata")),
        }
        let text = |k: &str| m.get(k).cloned().ok_or_else(|| bad(&format!("no {k}")));
        let num = |k: &str| -> Result<u64, ModelError> {
            text(k)?.parse().map_err(|_| bad(&format!("a bad {k}")))
        };
        Ok(Self {
            run: text("run")?,
            config: text("config")?,
            stage: num("stage")? as usize,
            step: num("step")?,
            params_hash: text("params_hash")?,
            samples_applied: num("samples_applied")?,
            samples_lost: num("samples_lost")?,
        })
    }
}

/// A tensor written as it is serialised: converted to bytes when the writer asks, so only
/// one tensor's bytes exist at a time.
struct Lazy {
    tensor: Tensor,
    dtype: StDtype,
    shape: Vec<usize>,
}

impl Lazy {
    fn new(t: &Tensor) -> Result<Self, ModelError> {
        let dtype = match t.dtype() {
            DType::F32 => StDtype::F32,
            DType::F64 => StDtype::F64,
            other => {
                return Err(ModelError::Checkpoint(format!(
                    "cannot store dtype {other:?}"
                )))
            }
        };
        Ok(Self {
            tensor: t.clone(),
            dtype,
            shape: t.dims().to_vec(),
        })
    }

    fn bytes(&self) -> candle_core::Result<Vec<u8>> {
        let flat = self.tensor.flatten_all()?;
        Ok(match self.dtype {
            StDtype::F64 => bytemuck::cast_slice(&flat.to_vec1::<f64>()?).to_vec(),
            _ => bytemuck::cast_slice(&flat.to_vec1::<f32>()?).to_vec(),
        })
    }
}

impl View for Lazy {
    fn dtype(&self) -> StDtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        // The dtype was checked in `new`; a failed read leaves the length short and the
        // writer refuses it.
        Cow::Owned(self.bytes().unwrap_or_default())
    }
    fn data_len(&self) -> usize {
        self.tensor.elem_count() * self.dtype.bitsize() / 8
    }
}

pub use crate::files::write_atomic;

/// Saves the stage's parameters and the optimizer's state to `path`, described by `info`.
pub fn save(stage: &Stage, opt: &AdamW, path: &Path, info: &Info) -> Result<(), ModelError> {
    let names = stage.params().names();
    let (m, v) = opt.moments();
    let mut tensors = Vec::with_capacity(3 * names.len());
    for (i, name) in names.iter().enumerate() {
        tensors.push((
            format!("param/{name}"),
            Lazy::new(stage.params().vars()[i].as_tensor())?,
        ));
        tensors.push((format!("adam.m/{name}"), Lazy::new(&m[i])?));
        tensors.push((format!("adam.v/{name}"), Lazy::new(&v[i])?));
    }
    crate::files::write_atomic_with(path, |tmp| {
        safetensors::serialize_to_file(tensors, Some(info.to_map()), tmp)
            .map_err(|e| std::io::Error::other(e.to_string()))
    })
    .map_err(|e| ModelError::Checkpoint(format!("{}: {e}", path.display())))
}

/// Tensor `key` of `st` as a tensor of `like`'s device and dtype, refused (through `bad`)
/// when it is missing, has another shape, or a dtype other than f32/f64.
pub(crate) fn tensor_like(
    st: &SafeTensors<'_>,
    key: &str,
    like: &Tensor,
    bad: &dyn Fn(String) -> ModelError,
) -> Result<Tensor, ModelError> {
    let view = st
        .tensor(key)
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
}

/// The JSON header of safetensors file `path` and the file offset its data starts at,
/// read without the data (a header over 100 MB is refused).
pub(crate) fn read_header(path: &Path) -> Result<(serde_json::Value, u64), ModelError> {
    use std::io::Read;
    let bad = |m: String| ModelError::Checkpoint(format!("{}: {m}", path.display()));
    let mut f = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let mut n = [0u8; 8];
    f.read_exact(&mut n)
        .map_err(|_| bad("not a safetensors file (too short)".into()))?;
    let n = u64::from_le_bytes(n);
    if n > 100 << 20 {
        return Err(bad("not a safetensors file (header size)".into()));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header)
        .map_err(|_| bad("not a safetensors file (truncated header)".into()))?;
    let v: serde_json::Value = serde_json::from_slice(&header)
        .map_err(|_| bad("not a safetensors file (header is not JSON)".into()))?;
    Ok((v, 8 + n))
}

/// Reads a checkpoint's [`Info`] from its header alone.
pub fn peek(path: &Path) -> Result<Info, ModelError> {
    let (v, _) = read_header(path)?;
    let meta: HashMap<String, String> = v
        .get("__metadata__")
        .and_then(|m| serde_json::from_value(m.clone()).ok())
        .unwrap_or_default();
    Info::from_map(&meta, path)
}

/// Loads a checkpoint written by [`save`] into `stage` and `opt`, refusing one of another
/// run than `run`, of another stage, with other shapes, or whose parameters do not hash to
/// what it says. Returns its [`Info`].
pub fn load(stage: &Stage, opt: &mut AdamW, path: &Path, run: &str) -> Result<Info, ModelError> {
    let bad = |m: String| ModelError::Checkpoint(format!("{}: {m}", path.display()));
    let info = peek(path)?;
    if info.run != run {
        return Err(bad(format!(
            "a checkpoint of run {}, not of this run {run} (another config)",
            info.run
        )));
    }
    if info.stage != stage.index() {
        return Err(bad(format!(
            "holds stage {}, not stage {}",
            info.stage,
            stage.index()
        )));
    }
    let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
    let get = |key: String, like: &Tensor| tensor_like(&st, &key, like, &bad);
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
    let hash = format!(
        "{:016x}",
        stage.params().hash_values(&p.iter().collect::<Vec<_>>())?
    );
    if hash != info.params_hash {
        return Err(bad(format!(
            "its parameters hash to {hash}, not the {} it records (a damaged file)",
            info.params_hash
        )));
    }
    for (var, t) in stage.params().vars().iter().zip(&p) {
        var.set(t)?;
    }
    opt.restore(info.step, m, v)?;
    Ok(info)
}
