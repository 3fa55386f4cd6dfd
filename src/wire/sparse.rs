//! Sparse vectors: a chunk of which only a few values are nonzero (a top-k compressed
//! pseudo-gradient of outer averaging, or the zero copies between outer steps) travels as
//! a frame whose payload holds its nonzero count, their positions and their values.
//!
//! A sparse frame is an ordinary f32 frame of shape `[n]` ([`super::frame`]) with header
//! byte 10 set; its payload (before zstd): `u32` nonzero count `k`, the `k` positions as
//! LEB128 gaps (the first position, then each position minus the previous one minus 1),
//! then the `k` values in the frame's codec (int8: codes, then scales). Every reader of
//! frames takes it as it is (its header declares `n` elements); decoding checks the count,
//! every position and the values' length before writing anything. A chunk with over a
//! quarter of its values nonzero gains nothing from this and is sent dense.

use super::codec::CodecSpec;
use super::frame::{encode_f32, encode_f32_sparse, WireError};

/// How the chunks of a flat vector are coded: the values' codec, and whether a mostly-zero
/// chunk travels as its nonzeros only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkCodec {
    /// Codec of the values (all of them, or the nonzero ones).
    pub values: CodecSpec,
    /// Send a mostly-zero chunk as its nonzero values and their positions.
    pub sparse: bool,
}

impl ChunkCodec {
    /// Every value, in `values`.
    pub fn dense(values: CodecSpec) -> Self {
        Self {
            values,
            sparse: false,
        }
    }
}

/// Appends the chunk `values` coded by `codec` to `out`, as one frame.
pub fn encode_chunk(
    values: &[f32],
    codec: &ChunkCodec,
    out: &mut Vec<u8>,
) -> Result<(), WireError> {
    let k = values.iter().filter(|v| **v != 0.0).count();
    if !codec.sparse || k > max_nonzeros(values.len()) {
        encode_f32(&[values.len()], values, &codec.values, out)?;
        return Ok(());
    }
    let mut positions = Vec::with_capacity(k);
    let mut kept = Vec::with_capacity(k);
    for (i, &v) in values.iter().enumerate() {
        if v != 0.0 {
            positions.push(i as u32);
            kept.push(v);
        }
    }
    encode_f32_sparse(values.len(), &positions, &kept, &codec.values, out)?;
    Ok(())
}

/// Most nonzeros a sparse vector of `n` values holds: a quarter (a chunk with more travels
/// dense), so a sparse frame is never larger than the dense one its header's shape bounds.
pub fn max_nonzeros(n: usize) -> usize {
    n / 4
}

/// The longest payload (before zstd) of a sparse vector of `n` values in `spec`: the most
/// nonzeros it may hold, every gap at its longest.
pub fn max_payload_len(spec: &CodecSpec, n: usize) -> Option<u64> {
    let k = max_nonzeros(n);
    let values = spec.raw_payload_len(k)?;
    k.checked_mul(5)?
        .checked_add(4)?
        .checked_add(values)
        .map(|l| l as u64)
}

/// Appends the nonzero count and the positions (increasing, each below `n`).
pub(super) fn push_positions(
    out: &mut Vec<u8>,
    n: usize,
    positions: &[u32],
) -> Result<(), WireError> {
    let k = u32::try_from(positions.len())
        .map_err(|_| WireError::BadInput("too many positions".into()))?;
    out.extend_from_slice(&k.to_le_bytes());
    let mut next = 0u64;
    for &p in positions {
        let p = u64::from(p);
        if p < next || p >= n as u64 {
            return Err(WireError::BadInput(format!(
                "position {p} out of order or past {n}"
            )));
        }
        push_varint(out, p - next);
        next = p + 1;
    }
    Ok(())
}

/// Reads the nonzero count and the positions of a vector of `n` values from the start of
/// `payload`; returns them with the bytes they took.
pub(super) fn read_positions(payload: &[u8], n: usize) -> Result<(Vec<u32>, usize), WireError> {
    let Some(head) = payload.get(..4) else {
        return Err(WireError::Truncated {
            needed: 4,
            have: payload.len() as u64,
        });
    };
    let k = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    // Each position takes at least a byte: a count beyond the bytes left is a lie.
    if k > max_nonzeros(n) || k > payload.len() - 4 {
        return Err(WireError::BadInput(format!(
            "{k} nonzeros in a vector of {n} ({} bytes left)",
            payload.len() - 4
        )));
    }
    let mut at = 4;
    let mut positions = Vec::with_capacity(k);
    let mut next = 0u64;
    for _ in 0..k {
        let gap = read_varint(payload, &mut at)?;
        let p = next
            .checked_add(gap)
            .filter(|&p| p < n as u64)
            .ok_or_else(|| {
                WireError::BadInput(format!("a position past the vector's {n} values"))
            })?;
        positions.push(p as u32);
        next = p + 1;
    }
    Ok((positions, at))
}

/// Zeroes all but the `k` values of largest magnitude (ties broken by position, so every
/// replica keeps the same ones of equal values). NaN counts as largest.
pub fn keep_top_k(values: &mut [f32], k: usize) {
    if k >= values.len() {
        return;
    }
    if k == 0 {
        values.iter_mut().for_each(|v| *v = 0.0);
        return;
    }
    let mut order: Vec<u32> = (0..values.len() as u32).collect();
    let key = |i: &u32| {
        let a = values[*i as usize].abs();
        (
            if a.is_nan() { f32::INFINITY } else { a },
            std::cmp::Reverse(*i),
        )
    };
    order.select_nth_unstable_by(k - 1, |a, b| {
        let (x, y) = (key(a), key(b));
        y.0.total_cmp(&x.0).then(y.1.cmp(&x.1))
    });
    let mut keep = vec![false; values.len()];
    for &i in &order[..k] {
        keep[i as usize] = true;
    }
    for (v, k) in values.iter_mut().zip(keep) {
        if !k {
            *v = 0.0;
        }
    }
}

fn push_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn read_varint(bytes: &[u8], at: &mut usize) -> Result<u64, WireError> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *bytes.get(*at).ok_or(WireError::Truncated {
            needed: *at as u64 + 1,
            have: bytes.len() as u64,
        })?;
        *at += 1;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(WireError::BadInput(
        "a position of more than 64 bits".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{decode_f32_into, Limits};

    /// A frame decoded into `out`; returns its length.
    fn decode_chunk_into(f: &[u8], lim: &Limits, out: &mut Vec<f32>) -> Result<usize, WireError> {
        decode_f32_into(f, lim, out)?;
        Ok(out.len())
    }

    fn sparse(values: CodecSpec) -> ChunkCodec {
        ChunkCodec {
            values,
            sparse: true,
        }
    }

    #[test]
    fn a_sparse_chunk_keeps_its_positions_and_values() {
        let mut v = vec![0.0f32; 1000];
        for (i, x) in [(0usize, 1.5f32), (3, -2.0), (130, 0.25), (999, 7.0)] {
            v[i] = x;
        }
        let mut f = Vec::new();
        encode_chunk(&v, &sparse(CodecSpec::F32), &mut f).unwrap();
        let (h, _) = crate::wire::parse_header(&f, &Limits::default()).unwrap();
        assert!(h.sparse && h.shape == vec![1000]);
        assert!(f.len() < 120, "{} bytes", f.len());
        let mut out = vec![9.0; 3];
        assert_eq!(
            decode_chunk_into(&f, &Limits::default(), &mut out).unwrap(),
            1000
        );
        assert_eq!(out, v);
        // int8 values: the positions stay exact, the values within the block's scale.
        let mut f = Vec::new();
        encode_chunk(&v, &sparse(CodecSpec::INT8), &mut f).unwrap();
        decode_chunk_into(&f, &Limits::default(), &mut out).unwrap();
        for (a, b) in out.iter().zip(&v) {
            assert_eq!(*a == 0.0, *b == 0.0);
            assert!((a - b).abs() <= 7.0 / 127.0, "{a} vs {b}");
        }
    }

    #[test]
    fn a_dense_or_empty_chunk_travels_as_a_frame() {
        let v: Vec<f32> = (0..100).map(|i| i as f32 + 1.0).collect();
        let mut f = Vec::new();
        encode_chunk(&v, &sparse(CodecSpec::F32), &mut f).unwrap();
        assert!(
            !crate::wire::parse_header(&f, &Limits::default())
                .unwrap()
                .0
                .sparse
        );
        let mut out = Vec::new();
        decode_chunk_into(&f, &Limits::default(), &mut out).unwrap();
        assert_eq!(out, v);
        let zeros = vec![0.0f32; 4096];
        let mut f = Vec::new();
        encode_chunk(&zeros, &sparse(CodecSpec::INT8), &mut f).unwrap();
        assert!(f.len() < 80, "{} bytes", f.len());
        decode_chunk_into(&f, &Limits::default(), &mut out).unwrap();
        assert_eq!(out, zeros);
    }

    #[test]
    fn damaged_sparse_chunks_are_refused() {
        let mut v = vec![0.0f32; 64];
        v[5] = 1.0;
        v[60] = 2.0;
        let mut f = Vec::new();
        encode_chunk(&v, &sparse(CodecSpec::F32), &mut f).unwrap();
        let mut out = Vec::new();
        let lim = Limits::default();
        // Truncated anywhere.
        for cut in 0..f.len() {
            assert!(
                decode_chunk_into(&f[..cut], &lim, &mut out).is_err(),
                "cut at {cut}"
            );
        }
        // More nonzeros than a sparse vector holds; a position past the end; a length over
        // the limit (the
        // payload starts after the 40-byte header of a vector; f32 frames carry no
        // checksum check until decoding, which fails first on the damage).
        let mut bad = f.clone();
        bad[40..44].copy_from_slice(&100u32.to_le_bytes());
        assert!(decode_chunk_into(&bad, &lim, &mut out).is_err());
        let mut bad = f.clone();
        bad[45] = 70;
        assert!(decode_chunk_into(&bad, &lim, &mut out).is_err());
        // zstd on top: the same values back.
        let mut z = Vec::new();
        encode_chunk(&v, &sparse(CodecSpec::INT8.with_zstd(1)), &mut z).unwrap();
        decode_chunk_into(&z, &lim, &mut out).unwrap();
        assert_eq!(out.iter().filter(|x| **x != 0.0).count(), 2);
        let small = Limits {
            max_elements: 10,
            max_bytes: 1 << 20,
        };
        assert!(decode_chunk_into(&f, &small, &mut out).is_err());
    }

    #[test]
    fn int4_values_land_within_half_a_step_of_their_block_scale() {
        let v: Vec<f32> = (0..200)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let spec: CodecSpec = "int4".parse().unwrap();
        let mut f = Vec::new();
        encode_chunk(&v, &ChunkCodec::dense(spec), &mut f).unwrap();
        assert!(f.len() < 40 + 100 + 8 + 8, "{} bytes", f.len());
        let mut out = Vec::new();
        decode_chunk_into(&f, &Limits::default(), &mut out).unwrap();
        for (block, got) in v.chunks(64).zip(out.chunks(64)) {
            let step = block.iter().fold(0.0f32, |m, x| m.max(x.abs())) / 7.0;
            for (a, b) in block.iter().zip(got) {
                assert!((a - b).abs() <= 0.5 * step * 1.01 + 1e-6, "{a} vs {b}");
            }
        }
        let mut bad = v.clone();
        bad[3] = f32::INFINITY;
        let mut f = Vec::new();
        encode_chunk(&bad, &ChunkCodec::dense(spec), &mut f).unwrap();
        decode_chunk_into(&f, &Limits::default(), &mut out).unwrap();
        assert!(out[..64].iter().all(|x| x.is_nan()) && out[64..].iter().all(|x| x.is_finite()));
    }

    #[test]
    fn a_sparse_chunk_fits_the_limits_of_its_dense_f32_chunk() {
        // A replica takes averaging frames up to a part chunk of f32: every sparse frame
        // of that many values must fit, whatever its codec.
        let n = crate::wire::msg::PART_CHUNK;
        let limits = Limits {
            max_elements: n as u64,
            max_bytes: 4 * n as u64,
        };
        for name in ["f32", "int8+zstd1", "int4+zstd1"] {
            let spec: CodecSpec = name.parse().unwrap();
            assert!(max_payload_len(&spec, n).unwrap() <= 4 * n as u64, "{name}");
            let mut v = vec![0.0f32; n];
            for i in (0..n).step_by(5) {
                v[i] = 1.0;
            }
            let mut f = Vec::new();
            encode_chunk(&v, &sparse(spec), &mut f).unwrap();
            let mut out = Vec::new();
            decode_chunk_into(&f, &limits, &mut out).unwrap();
            assert_eq!(out.len(), n);
            let off = out
                .iter()
                .zip(&v)
                .filter(|(a, b)| (*a - *b).abs() > 1e-2)
                .count();
            assert_eq!(off, 0, "{name}");
        }
    }

    #[test]
    fn top_k_keeps_the_largest_magnitudes() {
        let mut v = vec![0.1, -5.0, 0.3, 2.0, -0.2, 4.0];
        keep_top_k(&mut v, 3);
        assert_eq!(v, vec![0.0, -5.0, 0.0, 2.0, 0.0, 4.0]);
        let mut ties = vec![1.0f32; 6];
        keep_top_k(&mut ties, 2);
        assert_eq!(ties, vec![1.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
        let mut all = vec![1.0, 2.0];
        keep_top_k(&mut all, 5);
        assert_eq!(all, vec![1.0, 2.0]);
    }
}
