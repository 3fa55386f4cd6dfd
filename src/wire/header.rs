//! The frame header: its constants and limits, the typed errors of every frame operation,
//! and parsing with every length checked before anything is allocated. The layout is in
//! [`super::frame`]; encoding and decoding the payload live there too.

use super::codec::{CodecSpec, DType, Quant, MAX_BLOCK};
use super::ids::Ids;

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
    /// How the id column travels (`spec.ids_last` exactly when it is not [`Ids::None`]).
    pub ids: Ids,
    /// The payload holds only the nonzero values and their positions ([`super::sparse`]):
    /// an f32 vector of rank 1, whose payload length depends on its nonzeros.
    pub sparse: bool,
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

pub(super) fn header_len_for_rank(rank: usize) -> usize {
    PREFIX_LEN + 8 * rank + 16
}

pub(super) fn read_u64(b: &[u8], at: usize) -> u64 {
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
    let ids = Ids::from_code(bytes[9])
        .ok_or_else(|| WireError::BadCodecParams(format!("id column mode {}", bytes[9])))?;
    if bytes[10] > 1 || bytes[11] != 0 {
        return Err(WireError::BadCodecParams(
            "reserved bytes are not zero".into(),
        ));
    }
    let sparse = bytes[10] == 1;
    let block_size = u32::from_le_bytes([bytes[12], bytes[13], bytes[14], bytes[15]]);
    match quant {
        Quant::Int8 | Quant::Int4 if !(1..=MAX_BLOCK).contains(&block_size) => {
            return Err(WireError::BadCodecParams(format!(
                "{quant:?} block size {block_size}"
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
        ids_last: ids != Ids::None,
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
    if ids != Ids::None && (dtype != DType::F32 || super::ids::rows_of(&shape).is_none()) {
        return Err(WireError::BadCodecParams(
            "an id column needs an f32 tensor of rank ≥ 1 with a last dim ≥ 1".into(),
        ));
    }
    if sparse && (dtype != DType::F32 || ids != Ids::None || shape.len() != 1) {
        return Err(WireError::BadCodecParams(
            "a sparse payload needs an f32 vector without an id column".into(),
        ));
    }
    let raw = match sparse {
        true => {
            super::sparse::max_payload_len(&spec, shape[0]).ok_or(WireError::TooManyElements {
                elements,
                limit: limits.max_elements,
            })?
        }
        false => raw_len(&spec, ids, &shape)?,
    };
    if raw > limits.max_bytes {
        return Err(WireError::TooLarge {
            bytes: raw,
            limit: limits.max_bytes,
        });
    }
    if sparse && zstd_level == 0 && payload_len > raw {
        return Err(WireError::LengthMismatch {
            expected: raw,
            got: payload_len,
        });
    }
    if !sparse && zstd_level == 0 && payload_len != raw {
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
        ids,
        sparse,
    };
    Ok((header, hlen))
}

/// Bytes of a payload before zstd: the coded values (all but the id column when there is
/// one), then the ids.
pub(super) fn raw_len(spec: &CodecSpec, ids: Ids, shape: &[usize]) -> Result<u64, WireError> {
    let too_many = || WireError::TooManyElements {
        elements: u64::MAX,
        limit: u64::MAX,
    };
    let n = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(too_many)?;
    let (coded, extra) = match (ids, super::ids::rows_of(shape)) {
        (Ids::None, _) => (n, 0),
        (_, Some((rows, _))) => (n - rows, rows * ids.bytes()),
        (_, None) => return Err(too_many()),
    };
    spec.raw_payload_len(coded)
        .and_then(|l| l.checked_add(extra))
        .map(|l| l as u64)
        .ok_or_else(too_many)
}

/// The id column mode the encoder picks at most (for size bounds): u32 ids.
fn ids_bound(spec: &CodecSpec) -> Ids {
    if spec.ids_last {
        Ids::U32
    } else {
        Ids::None
    }
}

/// Exact frame length for a tensor without zstd; `None` when zstd or an id column (whose
/// width depends on the ids) makes it data-dependent.
pub fn encoded_len(shape: &[usize], spec: &CodecSpec) -> Option<usize> {
    if spec.zstd_level > 0 || spec.ids_last {
        return None;
    }
    let raw = raw_len(spec, Ids::None, shape).ok()?;
    header_len_for_rank(shape.len()).checked_add(raw as usize)
}

/// An upper bound on the frame length for any codec, zstd included.
pub fn max_encoded_len(shape: &[usize], spec: &CodecSpec) -> Option<usize> {
    let raw = raw_len(spec, ids_bound(spec), shape).ok()? as usize;
    let payload = if spec.zstd_level > 0 {
        zstd::zstd_safe::compress_bound(raw)
    } else {
        raw
    };
    header_len_for_rank(shape.len()).checked_add(payload)
}
