//! Getting the model out: every stage's parameters, from stage checkpoints, into one
//! safetensors file with the run's config in its metadata (`llama` parameters already carry
//! Hugging Face's names), and loading such a file back as a one-stage model.
//!
//! Tensors are copied one at a time from the checkpoints (read by offset when the writer
//! asks), so exporting never holds a whole stage; the file is written atomically. A run
//! whose residual stream lives in a subspace ([`super::subspace`]) is exported as the plain
//! Llama it computes: each factored projection `W̃` becomes `U·W̃` under its Hugging Face
//! name, the embedding `F + Ê·Uᵀ`, and the config in the metadata names a plain codec.

use super::checkpoint::{self, Info};
use super::stage::Stage;
use super::subspace::Subspace;
use super::ModelError;
use crate::config::RunConfig;
use candle_core::{DType, Device, Tensor};
use safetensors::tensor::{Dtype as StDtype, SafeTensors, View};
use std::borrow::Cow;
use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// The `shoal.format` of an exported model.
pub const MODEL_FORMAT: &str = "shoal-model-v1";

/// A tensor to export: read from a checkpoint when the writer asks for it, or computed.
enum OutTensor {
    File(FileTensor),
    /// f32 little-endian bytes.
    Made {
        shape: Vec<usize>,
        bytes: Vec<u8>,
    },
}

impl View for OutTensor {
    fn dtype(&self) -> StDtype {
        match self {
            Self::File(f) => f.dtype(),
            Self::Made { .. } => StDtype::F32,
        }
    }
    fn shape(&self) -> &[usize] {
        match self {
            Self::File(f) => f.shape(),
            Self::Made { shape, .. } => shape,
        }
    }
    fn data(&self) -> Cow<'_, [u8]> {
        match self {
            Self::File(f) => f.data(),
            Self::Made { bytes, .. } => Cow::Borrowed(bytes),
        }
    }
    fn data_len(&self) -> usize {
        match self {
            Self::File(f) => f.data_len(),
            Self::Made { bytes, .. } => bytes.len(),
        }
    }
}

/// A tensor of a checkpoint file, read when the writer asks for it.
struct FileTensor {
    path: PathBuf,
    offset: u64,
    len: usize,
    dtype: StDtype,
    shape: Vec<usize>,
}

impl View for FileTensor {
    fn dtype(&self) -> StDtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let mut buf = vec![0u8; self.len];
        let read = std::fs::File::open(&self.path).and_then(|mut f| {
            f.seek(SeekFrom::Start(self.offset))?;
            f.read_exact(&mut buf)
        });
        // A short buffer makes the writer fail: the export is not renamed into place.
        Cow::Owned(if read.is_ok() { buf } else { Vec::new() })
    }
    fn data_len(&self) -> usize {
        self.len
    }
}

/// What an export wrote.
#[derive(Debug, Clone)]
pub struct Exported {
    /// The run.
    pub run: String,
    /// Each stage's step.
    pub steps: Vec<u64>,
    /// Tensors written.
    pub tensors: usize,
    /// Parameters written.
    pub params: usize,
}

/// The parameter tensors (`param/<name>`) of checkpoint `path`, by name, as file ranges.
fn param_tensors(path: &Path) -> Result<Vec<(String, FileTensor)>, ModelError> {
    let bad = |m: String| ModelError::Checkpoint(format!("{}: {m}", path.display()));
    let (v, base) = checkpoint::read_header(path)?;
    let obj = v
        .as_object()
        .ok_or_else(|| bad("a header that is not a JSON object".into()))?;
    let mut out = Vec::new();
    for (key, t) in obj {
        let Some(name) = key.strip_prefix("param/") else {
            continue;
        };
        let field = |k: &str| t.get(k).cloned().unwrap_or(serde_json::Value::Null);
        let dtype: StDtype = serde_json::from_value(field("dtype"))
            .map_err(|_| bad(format!("{key} has no dtype")))?;
        let shape: Vec<usize> = serde_json::from_value(field("shape"))
            .map_err(|_| bad(format!("{key} has no shape")))?;
        let (start, end): (u64, u64) = serde_json::from_value(field("data_offsets"))
            .map_err(|_| bad(format!("{key} has no data offsets")))?;
        let len = usize::try_from(end.saturating_sub(start)).unwrap_or(0);
        if len != shape.iter().product::<usize>() * dtype.bitsize() / 8 {
            return Err(bad(format!("{key}'s data does not match its shape")));
        }
        out.push((
            name.to_string(),
            FileTensor {
                path: path.to_path_buf(),
                offset: base + start,
                len,
                dtype,
                shape,
            },
        ));
    }
    Ok(out)
}

/// Collects the parameters of every stage from `checkpoints` (one per stage, all of one
/// run) into `out`.
pub fn from_checkpoints(checkpoints: &[PathBuf], out: &Path) -> Result<Exported, ModelError> {
    let infos: Vec<Info> = checkpoints
        .iter()
        .map(|p| checkpoint::peek(p))
        .collect::<Result<_, _>>()?;
    let first = infos
        .first()
        .ok_or_else(|| ModelError::BadInput("no --checkpoints given".into()))?;
    let cfg = RunConfig::from_toml(&first.config, "the checkpoint's config")
        .map_err(|e| ModelError::Checkpoint(e.to_string()))?;
    let count = cfg.stages.count;
    let mut by_stage: Vec<Option<(&PathBuf, &Info)>> = vec![None; count];
    for (p, i) in checkpoints.iter().zip(&infos) {
        if i.run != first.run {
            return Err(ModelError::Checkpoint(format!(
                "{} is of run {}, {} of run {}: export one run at a time",
                p.display(),
                i.run,
                checkpoints[0].display(),
                first.run
            )));
        }
        match by_stage.get_mut(i.stage) {
            Some(slot @ None) => *slot = Some((p, i)),
            Some(Some((q, _))) => {
                return Err(ModelError::Checkpoint(format!(
                    "{} and {} both hold stage {}: give one checkpoint per stage",
                    q.display(),
                    p.display(),
                    i.stage
                )))
            }
            None => {
                return Err(ModelError::Checkpoint(format!(
                    "{} holds stage {} of a {count}-stage run",
                    p.display(),
                    i.stage
                )))
            }
        }
    }
    let missing: Vec<usize> = (0..count).filter(|&s| by_stage[s].is_none()).collect();
    if !missing.is_empty() {
        return Err(ModelError::Checkpoint(format!(
            "no checkpoint of stage(s) {missing:?} of this {count}-stage run"
        )));
    }
    let mut tensors = Vec::new();
    let mut steps = Vec::new();
    for (p, i) in by_stage.into_iter().flatten() {
        tensors.extend(param_tensors(p)?);
        steps.push(i.step);
    }
    let (tensors, config) = multiplied_out(&cfg, tensors, &first.config)?;
    let params = tensors
        .iter()
        .map(|(_, t)| t.shape().iter().product::<usize>())
        .sum();
    let meta = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("shoal.format".to_string(), MODEL_FORMAT.to_string()),
        ("shoal.run".to_string(), first.run.clone()),
        ("shoal.config".to_string(), config),
        (
            "shoal.steps".to_string(),
            steps
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(","),
        ),
    ]);
    let n = tensors.len();
    crate::files::write_atomic_with(out, |tmp| {
        safetensors::serialize_to_file(tensors, Some(meta), tmp)
            .map_err(|e| std::io::Error::other(e.to_string()))
    })
    .map_err(|e| ModelError::Checkpoint(format!("{}: {e}", out.display())))?;
    Ok(Exported {
        run: first.run.clone(),
        steps,
        tensors: n,
        params,
    })
}

/// The tensors to write and the config to record: as they are, or under a subspace with
/// every factored tensor multiplied out and the config's activation codec made plain.
fn multiplied_out(
    cfg: &RunConfig,
    tensors: Vec<(String, FileTensor)>,
    config: &str,
) -> Result<(Vec<(String, OutTensor)>, String), ModelError> {
    let Some(sub) = Subspace::of(cfg, &Device::Cpu, DType::F32)? else {
        let out = tensors.into_iter().map(|(n, t)| (n, OutTensor::File(t)));
        return Ok((out.collect(), config.to_string()));
    };
    let made = |t: &Tensor| -> Result<OutTensor, ModelError> {
        let v = t.flatten_all()?.to_vec1::<f32>()?;
        Ok(OutTensor::Made {
            shape: t.dims().to_vec(),
            bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        })
    };
    let mut out = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let factored = name == EMBED_SUB || name.ends_with(".sub.weight");
        if !factored {
            out.push((name, OutTensor::File(t)));
            continue;
        }
        if t.dtype != StDtype::F32 {
            return Err(ModelError::Checkpoint(format!("{name} is not f32")));
        }
        let bytes = t.data();
        let v: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let w = Tensor::from_vec(v, t.shape.as_slice(), &Device::Cpu)
            .map_err(|e| ModelError::Checkpoint(format!("{name}: {e}")))?;
        if name == EMBED_SUB {
            let full = (sub.fixed_table(cfg.model.vocab, &Device::Cpu)? + sub.lift(&w)?)?;
            out.push(("model.embed_tokens.weight".to_string(), made(&full)?));
        } else {
            let plain = name.replace(".sub.weight", ".weight");
            out.push((plain, made(&sub.full_weight(&w)?)?));
        }
    }
    let mut plain = cfg.clone();
    plain.codecs.activations = plain.codecs.activations.spec.into();
    let text = toml::to_string(&plain).map_err(|e| ModelError::Checkpoint(e.to_string()))?;
    Ok((out, text))
}

/// The trained part of a subspace model's token embedding.
const EMBED_SUB: &str = "model.embed_tokens.sub";

/// Loads an exported model as one stage holding every block, on `device`.
pub fn load_model(path: &Path, device: &Device) -> Result<(RunConfig, Stage), ModelError> {
    let bad = |m: String| ModelError::Checkpoint(format!("{}: {m}", path.display()));
    let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    let (_, meta) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| bad(format!("not a safetensors file ({e})")))?;
    let info = meta.metadata().clone().unwrap_or_default();
    if info.get("shoal.format").map(String::as_str) != Some(MODEL_FORMAT) {
        return Err(bad("not a model exported by `shoal export`".into()));
    }
    let text = info
        .get("shoal.config")
        .ok_or_else(|| bad("no config in its metadata".into()))?;
    let mut cfg =
        RunConfig::from_toml(text, "the model's config").map_err(|e| bad(e.to_string()))?;
    cfg.stages.count = 1;
    cfg.stages.cuts.clear();
    let stage = Stage::new(&cfg, 0, device)?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
    for (name, var) in stage.params().names().iter().zip(stage.params().vars()) {
        let t = checkpoint::tensor_like(&st, name, var.as_tensor(), &bad)?;
        var.set(&t)?;
    }
    Ok((cfg, stage))
}
