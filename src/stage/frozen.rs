//! A step's gradient sum, frozen for its averaging round and kept encoded: cut into
//! chunks of a size fixed by the gradient's length (so every attempt of the round, whatever
//! its members, sends the same frames) and encoded once, in the run's gradient codec, when
//! it is frozen. The f32 sum is freed then; a replica holds a quarter of it (int8) while
//! the round runs, and decodes one chunk at a time where it reduces its own part.

use crate::model::ModelError;
use crate::wire::{self, ChunkCodec, CodecSpec, Limits};
use std::ops::Range;
use std::sync::Arc;

/// The sum of a step's gradients, frozen for its averaging round.
#[derive(Debug, Clone)]
pub struct Frozen {
    /// The step the sum belongs to.
    pub step: u64,
    /// Σ over microbatches of (samples × mean gradient), flattened in parameter order,
    /// encoded by chunk (shared: a retried round reuses it without a copy).
    pub sum: Arc<EncodedSum>,
    /// Samples in the sum.
    pub count: u64,
}

/// A flat f32 vector as frames of `chunk` values each (the last one shorter; one empty
/// frame for an empty vector).
#[derive(Debug)]
pub struct EncodedSum {
    n: usize,
    chunk: usize,
    frames: Vec<Arc<Vec<u8>>>,
}

impl EncodedSum {
    /// Encodes `values` in chunks of `chunk` values with `codec`.
    pub fn encode(values: &[f32], chunk: usize, codec: &CodecSpec) -> Result<Self, ModelError> {
        Self::encode_chunks(values, chunk, &ChunkCodec::dense(*codec))
    }

    /// Encodes `values` in chunks of `chunk` values, each coded by `codec` (sparse or not).
    pub fn encode_chunks(
        values: &[f32],
        chunk: usize,
        codec: &ChunkCodec,
    ) -> Result<Self, ModelError> {
        let (n, chunk) = (values.len(), chunk.max(1));
        let frames = (0..n.div_ceil(chunk).max(1))
            .map(|c| {
                let r = chunk_range(n, chunk, c);
                let mut f = Vec::new();
                wire::encode_chunk(&values[r], codec, &mut f)
                    .map_err(|e| ModelError::BadInput(format!("encoding a gradient: {e}")))?;
                Ok(Arc::new(f))
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(Self { n, chunk, frames })
    }

    /// `n` zeros in chunks of `chunk` (one frame per distinct chunk length, shared).
    pub fn zeros(n: usize, chunk: usize, codec: &ChunkCodec) -> Result<Self, ModelError> {
        let chunk = chunk.max(1);
        let count = n.div_ceil(chunk).max(1);
        let frame = |len: usize| -> Result<Arc<Vec<u8>>, ModelError> {
            let mut f = Vec::new();
            wire::encode_chunk(&vec![0.0; len], codec, &mut f)
                .map_err(|e| ModelError::BadInput(format!("encoding a gradient: {e}")))?;
            Ok(Arc::new(f))
        };
        let full = frame(chunk.min(n))?;
        let last = chunk_range(n, chunk, count - 1).len();
        let mut frames = vec![full.clone(); count];
        if last != chunk.min(n) {
            frames[count - 1] = frame(last)?;
        }
        Ok(Self { n, chunk, frames })
    }

    /// Values in all.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Values per chunk.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Chunk `c`'s frame.
    pub fn frame(&self, c: u32) -> Option<&Arc<Vec<u8>>> {
        self.frames.get(c as usize)
    }

    /// Chunk `c`, decoded.
    pub fn decode(&self, c: u32) -> Result<Vec<f32>, ModelError> {
        let frame = self
            .frame(c)
            .ok_or_else(|| ModelError::BadInput(format!("no chunk {c} of the frozen sum")))?;
        let mut out = Vec::new();
        wire::decode_f32_into(frame, &Limits::default(), &mut out)
            .map_err(|e| ModelError::BadInput(format!("decoding the frozen sum: {e}")))?;
        Ok(out)
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.frames.iter().map(|f| f.len()).sum()
    }
}

/// Values `c·chunk .. (c+1)·chunk` of `n`, clipped.
fn chunk_range(n: usize, chunk: usize, c: usize) -> Range<usize> {
    let start = (c * chunk).min(n);
    start..(start + chunk).min(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sum_is_encoded_by_chunk_and_decodes_back() {
        let v: Vec<f32> = (0..10).map(|i| i as f32 * 0.5).collect();
        let e = EncodedSum::encode(&v, 4, &CodecSpec::F32).unwrap();
        assert_eq!((e.len(), e.chunk()), (10, 4));
        assert_eq!(e.decode(0).unwrap(), v[0..4].to_vec());
        assert_eq!(e.decode(2).unwrap(), v[8..10].to_vec());
        assert!(e.decode(3).is_err());
        // An empty sum is one empty chunk.
        let z = EncodedSum::encode(&[], 4, &CodecSpec::F32).unwrap();
        assert!(z.is_empty());
        assert_eq!(z.decode(0).unwrap(), Vec::<f32>::new());
        // int8 holds about a quarter of the f32 bytes.
        let big: Vec<f32> = (0..4096).map(|i| (i as f32).sin()).collect();
        let q = EncodedSum::encode(&big, 1024, &CodecSpec::INT8).unwrap();
        assert!(q.bytes() < 4096 * 4 / 3, "{} bytes", q.bytes());
        let back = q.decode(1).unwrap();
        assert!(back
            .iter()
            .zip(&big[1024..2048])
            .all(|(a, b)| (a - b).abs() < 0.02));
    }
}
