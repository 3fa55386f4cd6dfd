//! Reading and writing stage-protocol messages on a stream, with every limit checked first.
//!
//! The layout is in `wire::msg`: a length-prefixed JSON header, then length-prefixed tensor
//! frames. A reader checks each length against its limit before it allocates, and grows
//! its buffer as bytes actually arrive, so a peer that announces 256 MiB and sends nothing
//! costs one chunk of memory, not 256 MiB.

use crate::wire::header::PREFIX_LEN;
use crate::wire::msg::{self, MsgError};
use crate::wire::{header_len, parse_header, Header, Limits, WireError};
use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use serde::Serialize;

/// Bytes a frame header may add to its payload (prefix, 8 dims, length and checksum).
const FRAME_OVERHEAD: u64 = 128;
/// Buffer growth step while reading a frame.
const CHUNK: usize = 1 << 20;

/// Why a message could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    /// The stream failed or closed early.
    #[error("stream: {0}")]
    Io(#[from] std::io::Error),
    /// The header is bad.
    #[error(transparent)]
    Msg(#[from] MsgError),
    /// A frame is longer than the limit allows; nothing was allocated for it.
    #[error("tensor frame of {len} bytes is over the {limit}-byte limit")]
    FrameTooLarge {
        /// Length the sender declared.
        len: u64,
        /// The limit.
        limit: u64,
    },
    /// A frame's header does not parse or is over the limits; its payload was not read.
    #[error("tensor frame: {0}")]
    Frame(#[from] WireError),
    /// A frame's header parses but is not what the request may carry (dtype, rank, a
    /// dimension); its payload was not read.
    #[error("tensor frame: {0}")]
    Unexpected(String),
}

/// Writes a header and its frames, then flushes.
pub async fn write_message<W, H>(w: &mut W, header: &H, frames: &[&[u8]]) -> Result<(), IoError>
where
    W: AsyncWrite + Unpin,
    H: Serialize,
{
    let mut head = msg::encode_header(header);
    match frames.split_first() {
        None => w.write_all(&head).await?,
        Some((first, rest)) => {
            // Small frames ride with the header in one write; big ones go straight from
            // their buffer.
            head.extend_from_slice(&(first.len() as u64).to_le_bytes());
            if first.len() < 64 << 10 {
                head.extend_from_slice(first);
                w.write_all(&head).await?;
            } else {
                w.write_all(&head).await?;
                w.write_all(first).await?;
            }
            for f in rest {
                w.write_all(&(f.len() as u64).to_le_bytes()).await?;
                w.write_all(f).await?;
            }
        }
    }
    w.flush().await?;
    Ok(())
}

/// Reads a header's bytes (after checking its length).
pub async fn read_header<R: AsyncRead + Unpin>(r: &mut R) -> Result<Vec<u8>, IoError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    read_header_after(r, len).await
}

/// Reads the rest of a header whose 4-byte length prefix `len` was already read (a
/// server waiting on a kept stream reads the prefix first, then times the rest).
pub async fn read_header_after<R: AsyncRead + Unpin>(
    r: &mut R,
    len: [u8; 4],
) -> Result<Vec<u8>, IoError> {
    let n = msg::check_header_len(u32::from_le_bytes(len))?;
    let mut buf = vec![0u8; n];
    r.read_exact(&mut buf).await?;
    Ok(buf)
}

/// Checks a frame length prefix against the limits.
pub fn check_frame_len(len: u64, limits: &Limits) -> Result<usize, IoError> {
    let limit = limits.max_bytes.saturating_add(FRAME_OVERHEAD);
    if len > limit {
        return Err(IoError::FrameTooLarge { len, limit });
    }
    Ok(len as usize)
}

/// Reads the length prefix of the next frame and checks it.
pub async fn read_frame_len<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: &Limits,
) -> Result<usize, IoError> {
    let mut len = [0u8; 8];
    r.read_exact(&mut len).await?;
    check_frame_len(u64::from_le_bytes(len), limits)
}

/// Reads `len` bytes of frame, growing the buffer as they arrive.
pub async fn read_frame_body<R: AsyncRead + Unpin>(
    r: &mut R,
    len: usize,
) -> Result<Vec<u8>, IoError> {
    let mut buf = Vec::with_capacity(len.min(CHUNK));
    read_to_len(r, &mut buf, len).await?;
    Ok(buf)
}

/// Reads into `buf` until it holds `len` bytes, growing it (at most doubling, in steps of
/// at least [`CHUNK`]) only as bytes arrive.
async fn read_to_len<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
    len: usize,
) -> Result<(), IoError> {
    while buf.len() < len {
        let start = buf.len();
        let n = (len - start).min(CHUNK.max(start));
        buf.resize(start + n, 0);
        r.read_exact(&mut buf[start..]).await?;
    }
    Ok(())
}

/// Reads one length-prefixed frame.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: &Limits,
) -> Result<Vec<u8>, IoError> {
    let len = read_frame_len(r, limits).await?;
    read_frame_body(r, len).await
}

/// Reads one length-prefixed frame whose header is parsed against `limits` and checked
/// with `check` before a byte of its payload is read: a frame of the wrong dtype or shape,
/// or over the limits, costs its header's bytes, not its payload's.
pub async fn read_frame_checked<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: &Limits,
    check: impl FnOnce(&Header) -> Result<(), String>,
) -> Result<Vec<u8>, IoError> {
    let len = read_frame_len(r, limits).await?;
    if len < PREFIX_LEN {
        return Err(WireError::Truncated {
            needed: PREFIX_LEN as u64,
            have: len as u64,
        }
        .into());
    }
    let mut buf = vec![0u8; PREFIX_LEN];
    r.read_exact(&mut buf).await?;
    let hlen = header_len(&buf)?;
    if hlen > len {
        return Err(WireError::Truncated {
            needed: hlen as u64,
            have: len as u64,
        }
        .into());
    }
    buf.resize(hlen, 0);
    r.read_exact(&mut buf[PREFIX_LEN..]).await?;
    let (h, _) = parse_header(&buf, limits)?;
    if h.frame_len() != len as u64 {
        return Err(IoError::Unexpected(format!(
            "the frame is {len} bytes, its header says {}",
            h.frame_len()
        )));
    }
    check(&h).map_err(IoError::Unexpected)?;
    read_to_len(r, &mut buf, len).await?;
    Ok(buf)
}

/// Reads a response: its header, then its frames (each length checked before it is read).
pub async fn read_response<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: &Limits,
) -> Result<(msg::Response, Vec<Vec<u8>>), IoError> {
    let head = read_header(r).await?;
    let header = msg::decode_response(&head)?;
    let mut out = Vec::with_capacity(header.tensors as usize);
    for _ in 0..header.tensors {
        out.push(read_frame(r, limits).await?);
    }
    Ok((header, out))
}
