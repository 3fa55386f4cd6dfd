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
//! 9       3         reserved, zero
//! 12      4         int8 block size (0 for other codecs)
//! 16      8·rank    dims
//! ..      8         payload length
//! ..      8         xxh3-64 of the payload as sent
//! ..      len       payload (int8: codes, then one bf16 scale per block)
//! ```
//! All integers are little-endian. The header is a multiple of 8 bytes long, so a payload in
//! an 8-aligned buffer is aligned for its elements. Decoding checks every limit before it
//! allocates and never panics. This module does no I/O: stream readers use
//! [`header_len`] to learn how many bytes to read next.

use super::codec::{CodecSpec, DType, Quant, MAX_BLOCK};
use super::kernels;
use xxhash_rust::xxh3::Xxh3;

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"SHTF";
/// The frame format version this build reads and writes.
pub const VERSION: u8 = 1;
/// Bytes before the dims: enough to learn the full header length.
pub const PREFIX_LEN: usize = 16;
/// Largest tensor rank a frame may carry.
pub const MAX_RANK: usize = 8;

/// Caller-given bounds on what a decoder will accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most elements a frame may declare.
    pub max_elements: u64,
    /// Most payload bytes a frame may declare (and most bytes it may decompress to).
    pub max_bytes: u64,
}

impl Default for Limits {
    /// 256 MiB of payload, 64 Mi elements.
    fn default() -> Self {
        Self {
            max_elements: 64 << 20,
            max_bytes: 256 << 20,
        }
    }
}

/// Why a frame was refused. Each kind of damage has its own variant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Fewer bytes than the header or the payload needs.
    #[error("truncated frame: needs {needed} bytes, has {have}")]
    Truncated {
        /// Bytes the frame needs so far.
        needed: u64,
        /// Bytes present.
        have: u64,
    },
    /// Not a shoal tensor frame.
    #[error("not a tensor frame (bad magic)")]
    BadMagic,
    /// Written by a newer or older format.
    #[error("unsupported frame version {0} (this build reads {VERSION})")]
    UnsupportedVersion(u8),
    /// The dtype byte names no dtype.
    #[error("unknown dtype code {0}")]
    UnknownDtype(u8),
    /// The codec byte names no codec.
    #[error("unknown codec code {0}")]
    UnknownCodec(u8),
    /// Codec parameters that make no sense (block size, zstd level, codec for dtype, reserved).
    #[error("bad codec parameters: {0}")]
    BadCodecParams(String),
    /// More than `MAX_RANK` dims.
    #[error("rank {0} exceeds the maximum of {MAX_RANK}")]
    RankTooLarge(u8),
    /// More elements than the caller allows.
    #[error("frame declares {elements} elements, limit is {limit}")]
    TooManyElements {
        /// Declared elements (saturated at u64::MAX on overflow).
        elements: u64,
        /// The caller's limit.
        limit: u64,
    },
    /// A payload larger than the caller allows.
    #[error("frame declares {bytes} payload bytes, limit is {limit}")]
    TooLarge {
        /// Declared bytes.
        bytes: u64,
        /// The caller's limit.
        limit: u64,
    },
    /// The payload length does not match what the shape and codec need.
    #[error("payload of {got} bytes does not match shape and codec ({expected} bytes)")]
    LengthMismatch {
        /// Bytes the shape and codec imply.
        expected: u64,
        /// Bytes present (after zstd, if any).
        got: u64,
    },
    /// Bytes after the end of the frame.
    #[error("{0} trailing bytes after the frame")]
    TrailingBytes(u64),
    /// The payload does not hash to the header's checksum.
    #[error("payload checksum mismatch")]
    ChecksumMismatch,
    /// zstd refused the payload.
    #[error("zstd: {0}")]
    Zstd(String),
    /// The caller asked for one dtype and the frame holds another.
    #[error("frame holds {got:?}, expected {expected:?}")]
    WrongDtype {
        /// What the caller wanted.
        expected: DType,
        /// What the frame holds.
        got: DType,
    },
    /// The encoder was given inconsistent input.
    #[error("cannot encode: {0}")]
    BadInput(String),
}

/// A parsed, validated frame header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Element type before compression.
    pub dtype: DType,
    /// Codec and parameters.
    pub spec: CodecSpec,
    /// Tensor shape.
    pub shape: Vec<usize>,
    /// Bytes of payload as sent.
    pub payload_len: u64,
    /// xxh3-64 of the payload as sent.
    pub checksum: u64,
}

impl Header {
    /// Number of elements the shape holds.
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes of the whole frame, header included.
    pub fn frame_len(&self) -> u64 {
        (header_len_for_rank(self.shape.len()) as u64).saturating_add(self.payload_len)
    }
}

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

fn header_len_for_rank(rank: usize) -> usize {
    PREFIX_LEN + 8 * rank + 16
}

fn read_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// The full header length implied by a frame's first [`PREFIX_LEN`] bytes, after checking
/// magic, version and rank. Stream readers call this before reading the rest of the header.
pub fn header_len(prefix: &[u8]) -> Result<usize, WireError> {
    if prefix.len() < PREFIX_LEN {
        return Err(WireError::Truncated {
            needed: PREFIX_LEN as u64,
            have: prefix.len() as u64,
        });
    }
    if prefix[0..4] != MAGIC {
        return Err(WireError::BadMagic);
    }
    if prefix[4] != VERSION {
        return Err(WireError::UnsupportedVersion(prefix[4]));
    }
    let rank = prefix[8];
    if rank as usize > MAX_RANK {
        return Err(WireError::RankTooLarge(rank));
    }
    Ok(header_len_for_rank(rank as usize))
}

/// Parses and validates a header against `limits`. Returns it with its length in bytes.
/// Checks everything that can be checked without the payload.
pub fn parse_header(bytes: &[u8], limits: &Limits) -> Result<(Header, usize), WireError> {
    let hlen = header_len(bytes)?;
    let dtype = DType::from_code(bytes[5]).ok_or(WireError::UnknownDtype(bytes[5]))?;
    let quant = Quant::from_code(bytes[6]).ok_or(WireError::UnknownCodec(bytes[6]))?;
    let zstd_level = bytes[7];
    if zstd_level > 22 {
        return Err(WireError::BadCodecParams(format!(
            "zstd level {zstd_level}"
        )));
    }
    if bytes[9..12] != [0, 0, 0] {
        return Err(WireError::BadCodecParams(
            "reserved bytes are not zero".into(),
        ));
    }
    let block_size = u32::from_le_bytes([bytes[12], bytes[13], bytes[14], bytes[15]]);
    match quant {
        Quant::Int8 if !(1..=MAX_BLOCK).contains(&block_size) => {
            return Err(WireError::BadCodecParams(format!(
                "int8 block size {block_size}"
            )));
        }
        Quant::Raw | Quant::F16 | Quant::Bf16 if block_size != 0 => {
            return Err(WireError::BadCodecParams(format!(
                "block size {block_size} on a non-int8 codec"
            )));
        }
        _ => {}
    }
    if dtype == DType::U32 && quant != Quant::Raw {
        return Err(WireError::BadCodecParams("u32 tensors travel raw".into()));
    }
    if bytes.len() < hlen {
        return Err(WireError::Truncated {
            needed: hlen as u64,
            have: bytes.len() as u64,
        });
    }
    let rank = bytes[8] as usize;
    let mut shape = Vec::with_capacity(rank);
    let mut elements: u64 = 1;
    for i in 0..rank {
        let d = read_u64(bytes, PREFIX_LEN + 8 * i);
        elements = elements.saturating_mul(d);
        shape.push(d);
    }
    if elements > limits.max_elements {
        return Err(WireError::TooManyElements {
            elements,
            limit: limits.max_elements,
        });
    }
    let payload_len = read_u64(bytes, PREFIX_LEN + 8 * rank);
    let checksum = read_u64(bytes, PREFIX_LEN + 8 * rank + 8);
    if payload_len > limits.max_bytes {
        return Err(WireError::TooLarge {
            bytes: payload_len,
            limit: limits.max_bytes,
        });
    }
    let spec = CodecSpec {
        quant,
        block_size,
        zstd_level,
    };
    // elements ≤ max_elements fits usize on every platform we build for; check anyway.
    let shape: Vec<usize> = shape
        .into_iter()
        .map(usize::try_from)
        .collect::<Result<_, _>>()
        .map_err(|_| WireError::TooManyElements {
            elements,
            limit: limits.max_elements,
        })?;
    let raw = raw_len(&spec, elements)?;
    if raw > limits.max_bytes {
        return Err(WireError::TooLarge {
            bytes: raw,
            limit: limits.max_bytes,
        });
    }
    if zstd_level == 0 && payload_len != raw {
        return Err(WireError::LengthMismatch {
            expected: raw,
            got: payload_len,
        });
    }
    let header = Header {
        dtype,
        spec,
        shape,
        payload_len,
        checksum,
    };
    Ok((header, hlen))
}

fn raw_len(spec: &CodecSpec, elements: u64) -> Result<u64, WireError> {
    let n = usize::try_from(elements).map_err(|_| WireError::TooManyElements {
        elements,
        limit: u64::MAX,
    })?;
    spec.raw_payload_len(n)
        .map(|l| l as u64)
        .ok_or(WireError::TooManyElements {
            elements,
            limit: u64::MAX,
        })
}

/// Exact frame length for a tensor without zstd; `None` when zstd makes it data-dependent.
pub fn encoded_len(shape: &[usize], spec: &CodecSpec) -> Option<usize> {
    if spec.zstd_level > 0 {
        return None;
    }
    let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
    header_len_for_rank(shape.len()).checked_add(spec.raw_payload_len(n)?)
}

/// An upper bound on the frame length for any codec, zstd included.
pub fn max_encoded_len(shape: &[usize], spec: &CodecSpec) -> Option<usize> {
    let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
    let raw = spec.raw_payload_len(n)?;
    let payload = if spec.zstd_level > 0 {
        zstd::zstd_safe::compress_bound(raw)
    } else {
        raw
    };
    header_len_for_rank(shape.len()).checked_add(payload)
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

fn push_header(out: &mut Vec<u8>, dtype: DType, spec: &CodecSpec, shape: &[usize]) -> usize {
    let start = out.len();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&[
        VERSION,
        dtype.code(),
        spec.quant.code(),
        spec.zstd_level,
        shape.len() as u8,
        0,
        0,
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
    let start = push_header(out, DType::F32, spec, shape);
    let mut hash = Xxh3::new();
    push_payload_f32(out, data, spec, &mut hash);
    finish(out, start, shape.len(), spec.zstd_level, hash)
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
    let start = push_header(out, DType::U32, &spec, shape);
    let bytes: &[u8] = bytemuck::cast_slice(data);
    out.extend_from_slice(bytes);
    let mut hash = Xxh3::new();
    hash.update(bytes);
    finish(out, start, shape.len(), zstd_level, hash)
}

fn validate_spec(spec: &CodecSpec) -> Result<(), WireError> {
    let ok_block = match spec.quant {
        Quant::Int8 => (1..=MAX_BLOCK).contains(&spec.block_size),
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
    let raw = raw_len(&header.spec, header.elements() as u64)? as usize;
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
    decode_payload_f32(&header.spec, &payload, out, &mut v);
    v.check(header.checksum)?;
    Ok(header)
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
            decode_payload_f32(&header.spec, &payload, &mut out, &mut v);
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
