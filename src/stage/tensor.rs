//! candle tensors to wire frames and back.

use crate::wire::{self, CodecSpec, Limits, TensorData, WireError};
use candle_core::{DType, Device, Tensor};

/// Encodes a tensor: u32 ids raw, anything else as f32 through `spec`.
pub fn encode(t: &Tensor, spec: &CodecSpec) -> Result<Vec<u8>, WireError> {
    let shape = t.dims().to_vec();
    let flat = t
        .flatten_all()
        .map_err(|e| WireError::BadInput(e.to_string()))?;
    let mut out = Vec::new();
    if t.dtype() == DType::U32 {
        let data = flat
            .to_vec1::<u32>()
            .map_err(|e| WireError::BadInput(e.to_string()))?;
        wire::encode_u32(&shape, &data, 0, &mut out)?;
    } else {
        let data = flat
            .to_dtype(DType::F32)
            .and_then(|f| f.to_vec1::<f32>())
            .map_err(|e| WireError::BadInput(e.to_string()))?;
        wire::encode_f32(&shape, &data, spec, &mut out)?;
    }
    Ok(out)
}

/// A decoded tensor and whether every float in it is finite.
pub struct Decoded {
    /// The tensor on the requested device.
    pub tensor: Tensor,
    /// `false` when a float input holds NaN or ±inf.
    pub finite: bool,
}

/// Decodes a frame into a tensor on `device`.
pub fn decode(bytes: &[u8], limits: &Limits, device: &Device) -> Result<Decoded, WireError> {
    let wt = wire::decode(bytes, limits)?;
    let shape = wt.shape.clone();
    let (tensor, finite) = match wt.data {
        TensorData::F32(v) => {
            let finite = v.iter().all(|x| x.is_finite());
            (Tensor::from_vec(v, shape, device), finite)
        }
        TensorData::U32(v) => (Tensor::from_vec(v, shape, device), true),
    };
    let tensor = tensor.map_err(|e| WireError::BadInput(e.to_string()))?;
    Ok(Decoded { tensor, finite })
}
