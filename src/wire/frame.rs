//! The self-describing frame for one tensor: layout, encoding and bounded decoding.
//!
//! ```text
//! offset  size      field
//! 0       4         magic "SHTF"
//! 4       1         format version (1)
//! 5       1         dtype (0 f32, 1 u32)
//! 6       1         codec (0 raw, 1 f16, 2 bf16, 3 int8)
//! 7       1         zstd level (0 = none)
//! 8       1         rank (≤ 8)
//! 9       1         id column (0 none, 1 zeros not sent, 2 u16, 3 u32: [`super::ids`])
//! 10      1         sparse (0 no, 1: the payload holds the nonzeros only: [`super::sparse`])
//! 11      1         reserved, zero
//! 12      4         int8 block size (0 for other codecs)
//! 16      8·rank    dims
//! ..      8         payload length
//! ..      8         xxh3-64 of the payload as sent
//! ..      len       payload (int8: codes, then one bf16 scale per block; then the ids)
//! ```
//! All integers are little-endian. The header is a multiple of 8 bytes long, so a payload in
//! an 8-aligned buffer is aligned for its elements. Decoding checks every limit before it
//! allocates and never panics. This module does no I/O: stream readers use
//! [`header_len`] to learn how many bytes to read next.

use super::codec::{CodecSpec, DType, Quant, MAX_BLOCK};
pub use super::header::{
    encoded_len, header_len, max_encoded_len, parse_header, Header, Limits, WireError, MAGIC,
    MAX_RANK, PREFIX_LEN, VERSION,
};
use super::header::{header_len_for_rank, raw_len};
use super::ids::{self, Ids};
use super::kernels;
use xxhash_rust::xxh3::Xxh3;

/// A decoded tensor's values.
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    /// Float values.
    F32(Vec<f32>),
    /// Integer values (token ids).
    U32(Vec<u32>),
}

/// A decoded tensor: its shape and values.
#[derive(Debug, Clone, PartialEq)]
pub struct WireTensor {
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Values in row-major order.
    pub data: TensorData,
}

fn check_shape(shape: &[usize], len: usize) -> Result<(), WireError> {
    if shape.len() > MAX_RANK {
        return Err(WireError::BadInput(format!(
            "rank {} > {MAX_RANK}",
            shape.len()
        )));
    }
    let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    if n != Some(len) {
        return Err(WireError::BadInput(format!(
            "shape {shape:?} does not hold {len} values"
        )));
    }
    Ok(())
}

fn push_header(
    out: &mut Vec<u8>,
    dtype: DType,
    spec: &CodecSpec,
    shape: &[usize],
    ids: Ids,
) -> usize {
    push_header_of(out, dtype, spec, shape, ids, false)
}

fn push_header_of(
    out: &mut Vec<u8>,
    dtype: DType,
    spec: &CodecSpec,
    shape: &[usize],
    ids: Ids,
    sparse: bool,
) -> usize {
    let start = out.len();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&[
        VERSION,
        dtype.code(),
        spec.quant.code(),
        spec.zstd_level,
        shape.len() as u8,
        ids.code(),
        u8::from(sparse),
        0,
    ]);
    out.extend_from_slice(&spec.block_size.to_le_bytes());
    for &d in shape {
        out.extend_from_slice(&(d as u64).to_le_bytes());
    }
    out.extend_from_slice(&[0u8; 16]); // payload length and checksum, patched at the end
    start
}

fn patch_header(out: &mut [u8], start: usize, rank: usize, checksum: u64) {
    let hlen = header_len_for_rank(rank);
    let len = (out.len() - start - hlen) as u64;
    let at = start + PREFIX_LEN + 8 * rank;
    out[at..at + 8].copy_from_slice(&len.to_le_bytes());
    out[at + 8..at + 16].copy_from_slice(&checksum.to_le_bytes());
}

/// Runs `f` over `bytes` viewed as u16s: in place when aligned (the usual case, since
/// headers are multiples of 8 bytes), else through a copy.
fn read_u16s<R>(bytes: &[u8], f: impl FnOnce(&[u16]) -> R) -> R {
    match bytemuck::try_cast_slice::<u8, u16>(bytes) {
        Ok(view) => f(view),
        Err(_) => {
            let tmp: Vec<u16> = bytes
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect();
            f(&tmp)
        }
    }
}

/// Values converted per pass through a stack buffer. Small enough for L1, so the payload is
/// written to memory once and hashed while it is still in cache.
const CHUNK: usize = 4096;

/// Decoded outputs at least this large are written with streaming (non-temporal) stores:
/// they exceed the caches anyway, and ordinary stores would read every line from memory
/// only to overwrite it. Smaller outputs, such as activations about to be consumed, stay
/// in cache.
const STREAM_MIN_BYTES: usize = 8 << 20;

/// Appends the element encoding of `data` (no zstd) to `out`, hashing what it appends.
/// int8 payloads hold the codes first, then the bf16 scales.
fn push_payload_f32(out: &mut Vec<u8>, data: &[f32], spec: &CodecSpec, hash: &mut Xxh3) {
    let n = data.len();
    match spec.quant {
        Quant::Raw => {
            out.reserve(4 * n);
            for chunk in data.chunks(CHUNK) {
                let bytes: &[u8] = bytemuck::cast_slice(chunk);
                hash.update(bytes);
                out.extend_from_slice(bytes);
            }
        }
        Quant::F16 | Quant::Bf16 => {
            let mut buf = [0u16; CHUNK];
            out.reserve(2 * n);
            for chunk in data.chunks(CHUNK) {
                let dst = &mut buf[..chunk.len()];
                if spec.quant == Quant::F16 {
                    kernels::f16_encode(chunk, dst)
                } else {
                    kernels::bf16_encode(chunk, dst)
                }
                let bytes: &[u8] = bytemuck::cast_slice(dst);
                hash.update(bytes);
                out.extend_from_slice(bytes);
            }
        }
        Quant::Int8 => {
            let block = spec.block_size as usize;
            let nb = kernels::int8_blocks(n, block);
            let mut scales = vec![0u16; nb];
            let per = (CHUNK / block).max(1) * block;
            let mut codes = vec![0u8; per];
            out.reserve(n + 2 * nb);
            for (chunk, sc) in data.chunks(per).zip(scales.chunks_mut(per / block)) {
                let dst = &mut codes[..chunk.len()];
                kernels::int8_encode(chunk, block, &mut sc[..chunk.len().div_ceil(block)], dst);
                hash.update(dst);
                out.extend_from_slice(dst);
            }
            let bytes: &[u8] = bytemuck::cast_slice(&scales);
            hash.update(bytes);
            out.extend_from_slice(bytes);
        }
        Quant::Int4 => {
            let (codes, scales) = kernels::int4_encode(data, spec.block_size as usize);
            hash.update(&codes);
            out.extend_from_slice(&codes);
            let bytes: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
            hash.update(&bytes);
            out.extend_from_slice(&bytes);
        }
    }
}

fn finish(
    out: &mut Vec<u8>,
    start: usize,
    rank: usize,
    level: u8,
    hash: Xxh3,
) -> Result<usize, WireError> {
    let checksum = if level > 0 {
        let payload_at = start + header_len_for_rank(rank);
        let compressed = zstd::bulk::compress(&out[payload_at..], level as i32)
            .map_err(|e| WireError::Zstd(e.to_string()))?;
        out.truncate(payload_at);
        out.extend_from_slice(&compressed);
        xxhash_rust::xxh3::xxh3_64(&compressed)
    } else {
        hash.digest()
    };
    patch_header(out, start, rank, checksum);
    Ok(out.len() - start)
}

/// Appends one frame holding an f32 tensor to `out`; returns the bytes written.
pub fn encode_f32(
    shape: &[usize],
    data: &[f32],
    spec: &CodecSpec,
    out: &mut Vec<u8>,
) -> Result<usize, WireError> {
    check_shape(shape, data.len())?;
    validate_spec(spec)?;
    let mut hash = Xxh3::new();
    if !spec.ids_last {
        let start = push_header(out, DType::F32, spec, shape, Ids::None);
        push_payload_f32(out, data, spec, &mut hash);
        return finish(out, start, shape.len(), spec.zstd_level, hash);
    }
    let (_, width) = ids::rows_of(shape)
        .ok_or_else(|| WireError::BadInput("an id column needs a last dim of at least 1".into()))?;
    let (values, list, mode) = ids::split(data, width)?;
    let start = push_header(out, DType::F32, spec, shape, mode);
    push_payload_f32(out, &values, spec, &mut hash);
    let bytes = ids::to_bytes(&list, mode);
    hash.update(&bytes);
    out.extend_from_slice(&bytes);
    finish(out, start, shape.len(), spec.zstd_level, hash)
}

/// Appends one sparse frame to `out`: an f32 vector of `n` values, zero but for `values`
/// at the increasing `positions` ([`super::sparse`]); returns the bytes written.
pub fn encode_f32_sparse(
    n: usize,
    positions: &[u32],
    values: &[f32],
    spec: &CodecSpec,
    out: &mut Vec<u8>,
) -> Result<usize, WireError> {
    validate_spec(spec)?;
    if spec.ids_last {
        return Err(WireError::BadInput(
            "a sparse vector has no id column".into(),
        ));
    }
    if positions.len() != values.len() {
        return Err(WireError::BadInput(format!(
            "{} positions for {} values",
            positions.len(),
            values.len()
        )));
    }
    let mut hash = Xxh3::new();
    let start = push_header_of(out, DType::F32, spec, &[n], Ids::None, true);
    let at = out.len();
    if let Err(e) = super::sparse::push_positions(out, n, positions) {
        out.truncate(start);
        return Err(e);
    }
    hash.update(&out[at..]);
    push_payload_f32(out, values, spec, &mut hash);
    finish(out, start, 1, spec.zstd_level, hash)
}

/// Appends one frame holding a u32 tensor (raw, optionally zstd) to `out`.
pub fn encode_u32(
    shape: &[usize],
    data: &[u32],
    zstd_level: u8,
    out: &mut Vec<u8>,
) -> Result<usize, WireError> {
    check_shape(shape, data.len())?;
    let spec = CodecSpec::F32.with_zstd(zstd_level);
    validate_spec(&spec)?;
    let start = push_header(out, DType::U32, &spec, shape, Ids::None);
    let bytes: &[u8] = bytemuck::cast_slice(data);
    out.extend_from_slice(bytes);
    let mut hash = Xxh3::new();
    hash.update(bytes);
    finish(out, start, shape.len(), zstd_level, hash)
}

fn validate_spec(spec: &CodecSpec) -> Result<(), WireError> {
    let ok_block = match spec.quant {
        Quant::Int8 | Quant::Int4 => (1..=MAX_BLOCK).contains(&spec.block_size),
        _ => spec.block_size == 0,
    };
    if !ok_block || spec.zstd_level > 22 {
        return Err(WireError::BadInput(format!("codec parameters {spec:?}")));
    }
    Ok(())
}

/// Checks the length and trailing bytes; for zstd frames also the checksum, then
/// decompresses. Returns the header, the element payload, and whether its checksum still
/// has to be verified (fused with decoding, so the payload is read from memory once).
fn open<'a>(
    bytes: &'a [u8],
    limits: &Limits,
) -> Result<(Header, std::borrow::Cow<'a, [u8]>, bool), WireError> {
    let (header, hlen) = parse_header(bytes, limits)?;
    let total = (hlen as u64).saturating_add(header.payload_len);
    let have = bytes.len() as u64;
    if have < total {
        return Err(WireError::Truncated {
            needed: total,
            have,
        });
    }
    if have > total {
        return Err(WireError::TrailingBytes(have - total));
    }
    let payload = &bytes[hlen..];
    if header.spec.zstd_level == 0 {
        return Ok((header, std::borrow::Cow::Borrowed(payload), true));
    }
    if xxhash_rust::xxh3::xxh3_64(payload) != header.checksum {
        return Err(WireError::ChecksumMismatch);
    }
    if header.sparse {
        // The nonzeros decide the length: at most the bound the header was checked against.
        let bound = super::sparse::max_payload_len(&header.spec, header.elements())
            .unwrap_or(u64::MAX) as usize;
        let mut buf = vec![0u8; bound];
        let got = zstd::bulk::decompress_to_buffer(payload, &mut buf[..])
            .map_err(|e| WireError::Zstd(e.to_string()))?;
        buf.truncate(got);
        return Ok((header, std::borrow::Cow::Owned(buf), false));
    }
    let raw = raw_len(&header.spec, header.ids, &header.shape)? as usize;
    let mut buf = vec![0u8; raw];
    let got = zstd::bulk::decompress_to_buffer(payload, &mut buf[..])
        .map_err(|e| WireError::Zstd(e.to_string()))?;
    if got != raw {
        return Err(WireError::LengthMismatch {
            expected: raw as u64,
            got: got as u64,
        });
    }
    Ok((header, std::borrow::Cow::Owned(buf), false))
}

/// A hasher that is fed only when the payload's checksum is still to be checked.
struct Verify(Option<Xxh3>);

impl Verify {
    fn feed(&mut self, bytes: &[u8]) {
        if let Some(h) = &mut self.0 {
            h.update(bytes);
        }
    }

    fn check(self, want: u64) -> Result<(), WireError> {
        match self.0 {
            Some(h) if h.digest() != want => Err(WireError::ChecksumMismatch),
            _ => Ok(()),
        }
    }
}

/// Decodes an f32 frame into `out` (resized to fit), reusing its allocation. On an error
/// the contents of `out` are unspecified.
pub fn decode_f32_into(
    bytes: &[u8],
    limits: &Limits,
    out: &mut Vec<f32>,
) -> Result<Header, WireError> {
    let (header, payload, verify) = open(bytes, limits)?;
    if header.dtype != DType::F32 {
        return Err(WireError::WrongDtype {
            expected: DType::F32,
            got: header.dtype,
        });
    }
    let n = header.elements();
    if out.len() != n {
        // Every element is overwritten below, so a buffer of the right size is reused as is.
        out.clear();
        out.resize(n, 0.0);
    }
    let mut v = Verify(verify.then(Xxh3::new));
    decode_values(&header, &payload, out, &mut v)?;
    v.check(header.checksum)?;
    Ok(header)
}

/// Decodes an f32 payload into `out`: the coded values, and the id column when the frame
/// has one.
fn decode_values(
    h: &Header,
    payload: &[u8],
    out: &mut [f32],
    v: &mut Verify,
) -> Result<(), WireError> {
    if h.sparse {
        let (positions, used) = super::sparse::read_positions(payload, out.len())?;
        v.feed(&payload[..used]);
        let values = &payload[used..];
        let want = h
            .spec
            .raw_payload_len(positions.len())
            .unwrap_or(usize::MAX);
        if values.len() != want {
            return Err(WireError::LengthMismatch {
                expected: want as u64,
                got: values.len() as u64,
            });
        }
        let mut kept = vec![0f32; positions.len()];
        decode_payload_f32(&h.spec, values, &mut kept, v);
        out.iter_mut().for_each(|x| *x = 0.0);
        for (p, x) in positions.into_iter().zip(kept) {
            out[p as usize] = x;
        }
        return Ok(());
    }
    let Some((rows, width)) = ids::rows_of(&h.shape).filter(|_| h.ids != Ids::None) else {
        decode_payload_f32(&h.spec, payload, out, v);
        return Ok(());
    };
    let coded = out.len() - rows;
    let split = h.spec.raw_payload_len(coded).unwrap_or(usize::MAX);
    if split > payload.len() || payload.len() - split != rows * h.ids.bytes() {
        return Err(WireError::LengthMismatch {
            expected: split.saturating_add(rows * h.ids.bytes()) as u64,
            got: payload.len() as u64,
        });
    }
    let (values, id_bytes) = payload.split_at(split);
    let mut tmp = vec![0f32; coded];
    decode_payload_f32(&h.spec, values, &mut tmp, v);
    v.feed(id_bytes);
    ids::merge(&tmp, id_bytes, h.ids, width, out);
    Ok(())
}

fn decode_payload_f32(spec: &CodecSpec, payload: &[u8], out: &mut [f32], v: &mut Verify) {
    match spec.quant {
        Quant::Raw => {
            for (o, src) in out.chunks_mut(CHUNK).zip(payload.chunks(4 * CHUNK)) {
                v.feed(src);
                match bytemuck::try_cast_slice::<u8, f32>(src) {
                    Ok(view) => o.copy_from_slice(view),
                    Err(_) => {
                        for (x, c) in o.iter_mut().zip(src.chunks_exact(4)) {
                            *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                        }
                    }
                }
            }
        }
        Quant::F16 | Quant::Bf16 => {
            let f16 = spec.quant == Quant::F16;
            // Large outputs go out with streaming stores from the first 32-byte boundary on.
            let stream = out.len() * 4 >= STREAM_MIN_BYTES;
            let head = if stream {
                out.as_ptr().align_offset(32).min(out.len())
            } else {
                0
            };
            let (out_head, out_rest) = out.split_at_mut(head);
            let (pay_head, pay_rest) = payload.split_at(2 * head);
            let mut convert = |o: &mut [f32], src: &[u8], streaming: bool| {
                v.feed(src);
                read_u16s(src, |s| match (f16, streaming) {
                    (true, false) => kernels::f16_decode(s, o),
                    (true, true) => kernels::f16_decode_streaming(s, o),
                    (false, false) => kernels::bf16_decode(s, o),
                    (false, true) => kernels::bf16_decode_streaming(s, o),
                });
            };
            convert(out_head, pay_head, false);
            for (o, src) in out_rest.chunks_mut(CHUNK).zip(pay_rest.chunks(2 * CHUNK)) {
                convert(o, src, stream);
            }
        }
        Quant::Int8 => {
            let block = spec.block_size as usize;
            let n = out.len();
            let (codes, scales) = payload.split_at(n);
            let per = (CHUNK / block).max(1) * block;
            let stream = n * 4 >= STREAM_MIN_BYTES;
            read_u16s(scales, |scales| {
                for ((o, c), s) in out
                    .chunks_mut(per)
                    .zip(codes.chunks(per))
                    .zip(scales.chunks(per / block))
                {
                    v.feed(c);
                    if stream {
                        kernels::int8_decode_streaming(s, c, block, o);
                    } else {
                        kernels::int8_decode(s, c, block, o);
                    }
                }
            });
            v.feed(scales);
        }
        Quant::Int4 => {
            let (codes, scales) = payload.split_at(out.len().div_ceil(2));
            v.feed(codes);
            v.feed(scales);
            read_u16s(scales, |scales| {
                kernels::int4_decode(scales, codes, spec.block_size as usize, out)
            });
        }
    }
}

/// Decodes any frame into a new tensor.
pub fn decode(bytes: &[u8], limits: &Limits) -> Result<WireTensor, WireError> {
    let (header, payload, verify) = open(bytes, limits)?;
    let n = header.elements();
    let mut v = Verify(verify.then(Xxh3::new));
    let data = match header.dtype {
        DType::F32 => {
            let mut out = vec![0.0f32; n];
            decode_values(&header, &payload, &mut out, &mut v)?;
            TensorData::F32(out)
        }
        DType::U32 => {
            v.feed(&payload);
            TensorData::U32(
                payload
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            )
        }
    };
    v.check(header.checksum)?;
    Ok(WireTensor {
        shape: header.shape,
        data,
    })
}
