//! candle tensors to wire frames and back.

use crate::wire::{self, CodecSpec, Limits, TensorData, WireError};
use candle_core::{CpuStorage, DType, Device, Storage, Tensor};

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
        let bad = |e: candle_core::Error| WireError::BadInput(e.to_string());
        // A contiguous f32 tensor in host memory is encoded where it lies, with no copy.
        {
            let (storage, layout) = flat.storage_and_layout();
            if let (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) =
                (&*storage, layout.contiguous_offsets())
            {
                wire::encode_f32(&shape, &v[a..b], spec, &mut out)?;
                return Ok(out);
            }
        }
        let data: Vec<f32> = match flat.dtype() {
            // Half-precision activations leave the device as they are (half the bytes of
            // an f32 copy, no widening on the GPU) and widen on the host.
            DType::BF16 => widened::<half::bf16>(&flat).map_err(bad)?,
            DType::F16 => widened::<half::f16>(&flat).map_err(bad)?,
            _ => flat
                .to_dtype(DType::F32)
                .and_then(|f| f.to_vec1::<f32>())
                .map_err(bad)?,
        };
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

/// A 1-D tensor of half floats copied to the host as it is and widened there.
fn widened<T: candle_core::WithDType>(flat: &Tensor) -> candle_core::Result<Vec<f32>>
where
    f32: From<T>,
{
    Ok(flat.to_vec1::<T>()?.into_iter().map(f32::from).collect())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_float_dtype_and_layout_encodes_the_same_values() {
        let dev = Device::Cpu;
        let v: Vec<f32> = (0..24).map(|i| i as f32 * 0.25 - 3.0).collect();
        let t = Tensor::from_vec(v.clone(), (2, 3, 4), &dev).unwrap();
        let want = encode(&t, &CodecSpec::F32).unwrap();
        // Borrowed in place (contiguous f32), through a copy (a transposed view), and
        // from half precision (exact for these values).
        let view = t.transpose(1, 2).unwrap().transpose(1, 2).unwrap();
        assert_eq!(encode(&view, &CodecSpec::F32).unwrap(), want);
        for dt in [DType::BF16, DType::F16] {
            let h = t.to_dtype(dt).unwrap();
            assert_eq!(encode(&h, &CodecSpec::F32).unwrap(), want, "{dt:?}");
        }
        let back = decode(&want, &Limits::default(), &dev).unwrap();
        assert_eq!(
            back.tensor.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            v
        );
        // A narrowed tensor (an offset into its storage) encodes its own values only.
        let part = t.narrow(0, 1, 1).unwrap();
        let got = decode(
            &encode(&part, &CodecSpec::F32).unwrap(),
            &Limits::default(),
            &dev,
        )
        .unwrap();
        assert_eq!(
            got.tensor.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            v[12..]
        );
    }
}
