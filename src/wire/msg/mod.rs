//! Stage-protocol messages as bytes: the request and response headers of one stream.
//!
//! A call on the stage protocol is one stream carrying one request and one response:
//!
//! ```text
//! u32 LE header length | header (JSON, ≤ MAX_HEADER) | n × (u64 LE frame length | frame)
//! ```
//!
//! `n` is the header's `tensors` field and each frame is a [`super::frame`] tensor frame.
//! Headers are small JSON objects (they carry ids and numbers, never tensor data); tensors
//! always travel as frames, so a reader checks each length against its limit before it
//! allocates. Pure code: the async reading and writing lives in `net::io`.

use serde::{Deserialize, Serialize};

mod call;

pub use call::{Call, Job, Op, Request};

/// Largest header a reader accepts.
pub const MAX_HEADER: usize = 64 << 10;

/// The wire version as a literal: the one place it is written. Every protocol name
/// (`/shoal/stage/N`, `/shoal/avg/N`, `/shoal/state/N`, `/shoal/kad/N`, identify's
/// `/shoal/wire/N`) and [`MSG_VERSION`] are built from it, so they change together.
/// (7: averaging and state download on protocols of their own; 8: a request's call is an
/// enum tagged by its op; 9: an `info` answer names stage mates, [`Response::mates`].)
#[macro_export]
macro_rules! wire_version {
    () => {
        9
    };
}

/// The version of this message format.
pub const MSG_VERSION: u8 = crate::wire_version!();

/// Most tensor frames one message may carry.
pub const MAX_TENSORS: u8 = 8;

/// Chunk hashes per [`Call::StateHashes`] page: a page stays far below [`MAX_HEADER`], and
/// the list of a state of any size travels in as many pages as it needs.
pub const HASH_PAGE: usize = 1024;

/// Mates an [`AvgMsg::Mates`] names at most (with two addresses each, ~25 KB of header).
pub const MAX_MATES: usize = 128;

/// Stage mates an `info` answer names at most ([`Response::mates`]).
pub const INFO_MATES: usize = 16;

/// Floats per chunk of an averaging part, at most (a part's chunk is one frame).
pub const PART_CHUNK: usize = 256 << 10;

/// Messages of the averaging protocol between the replicas of one stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum AvgMsg {
    /// A replica leaves the stage: forget it now, and count `pending` samples it could
    /// not have averaged as lost.
    Leave {
        /// Samples it still held.
        pending: u64,
    },
    /// Sent after each backward and as a heartbeat.
    Progress {
        /// Applied optimizer steps.
        params_step: u64,
        /// The step backward passes accumulate toward.
        accum_step: u64,
        /// Samples accumulated toward it.
        count: u64,
        /// Samples frozen for the round of `params_step`.
        frozen: u64,
        /// Parameter hash (hex).
        hash: String,
        /// The sender's measured uplink for averaging parts, bytes/s (0: not measured
        /// yet); rounds with it allow for the slowest member's link.
        #[serde(default)]
        uplink: u64,
        /// Samples of synchronous microbatches admitted toward `accum_step` whose backward
        /// has not come yet (stage 0's admission counts them as taken).
        #[serde(default)]
        owed: u64,
        /// Samples of `params_step`'s batch that replicas which died or left at that step
        /// held, as far as the sender saw them go (the leader may not have: it counts them
        /// toward the batch, which otherwise never fills).
        #[serde(default)]
        lost: u64,
        /// Synchronous calls held at the sender for a step after `params_step`: stage 0
        /// moved on, so no more microbatches of `params_step` are coming.
        #[serde(default)]
        ahead: u64,
    },
    /// The sender's stage mates and addresses it knows them at, sent to a replica it hears
    /// from for the first time: a replica joining a stage learns its mates from the first
    /// ones it reaches instead of reading each one's announcement from the DHT. A receiver
    /// keeps only those that also provide the stage in the DHT.
    Mates {
        /// Peer ids (at most [`MAX_MATES`] are taken).
        peers: Vec<String>,
        /// Their addresses, aligned with `peers`.
        addrs: Vec<Vec<String>>,
    },
    /// From the round's leader: the members of an attempt at averaging `step`, in the order
    /// that assigns each its part.
    Members {
        /// The step.
        step: u64,
        /// The attempt (random per attempt).
        attempt: u32,
        /// Peer ids, sorted.
        members: Vec<String>,
        /// Samples the leader saw each member hold toward the step, aligned with
        /// `members` (each member freezes and contributes everything it holds).
        quotas: Vec<u64>,
        /// Samples of replicas that died holding gradients of this step (lost).
        lost: u64,
    },
    /// Chunk `chunk` of one member's sum for the receiver's part, one frame; `count` is
    /// the member's samples.
    Part {
        /// The step.
        step: u64,
        /// The attempt.
        attempt: u32,
        /// Samples behind the sender's sum.
        count: u64,
        /// Which chunk of the gradient (numbered over the whole gradient; see `round::Layout`).
        chunk: u32,
    },
    /// Chunk `chunk` of the averaged part `index`, one frame, exactly as every member
    /// applies it.
    Reduced {
        /// The step.
        step: u64,
        /// The attempt.
        attempt: u32,
        /// Which part.
        index: u32,
        /// Samples in the step.
        total: u64,
        /// Which chunk of the gradient.
        chunk: u32,
    },
}

/// Which snapshot chunk a [`Call::StateChunk`] asks for (or which page of hashes an
/// [`Call::StateHashes`] does).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChunkReq {
    /// The snapshot's step.
    pub step: u64,
    /// The chunk.
    pub index: u32,
}

/// A replica's state snapshot, as offered to joiners.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateInfo {
    /// Applied optimizer steps.
    pub step: u64,
    /// Floats in the snapshot (parameters, then both moments).
    pub len: u64,
    /// Floats per chunk.
    pub chunk: u64,
    /// Chunks in the snapshot (`len / chunk`, rounded up); their hashes come in pages
    /// ([`Call::StateHashes`]).
    pub chunks: u64,
    /// The hash of the whole state: xxh3-64 (hex) of the chunk hashes (each the xxh3-64,
    /// in 16 hex digits, of a chunk's little-endian f32 bytes) in order.
    pub root: String,
    /// Hash of the parameters (hex).
    pub params_hash: String,
    /// Samples in every step applied so far.
    pub samples_applied: u64,
    /// Samples lost with dead replicas so far.
    pub samples_lost: u64,
}

/// Why a replica refused a request. Stable names: trainers branch on them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The replica does not serve this run.
    UnknownRun,
    /// The replica serves another stage.
    WrongStage,
    /// The caller's step is too far behind the replica's.
    StaleStep,
    /// A tensor has the wrong shape or dtype, or does not decode.
    BadTensor,
    /// An input holds NaN or ±inf.
    NonFinite,
    /// A frame is over the replica's size limit.
    TooLarge,
    /// The request queue is full; try another replica.
    Overloaded,
    /// The request itself is malformed.
    BadRequest,
    /// The replica failed while computing.
    Internal,
    /// The replica refuses this caller for a while: its requests failed validation
    /// repeatedly.
    Banned,
    /// A synchronous microbatch's step is closed on this replica (its batch was full):
    /// start the microbatch again from stage 0, in the step open now.
    StepClosed,
}

impl ErrorKind {
    /// The wire name, as in the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Self::UnknownRun => "unknown_run",
            Self::WrongStage => "wrong_stage",
            Self::StaleStep => "stale_step",
            Self::BadTensor => "bad_tensor",
            Self::NonFinite => "non_finite",
            Self::TooLarge => "too_large",
            Self::Overloaded => "overloaded",
            Self::BadRequest => "bad_request",
            Self::Internal => "internal",
            Self::Banned => "banned",
            Self::StepClosed => "step_closed",
        }
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The header of a response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Response {
    /// Message format version.
    pub v: u8,
    /// `None` on success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<RemoteError>,
    /// The loss, from a backward on the last stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<f32>,
    /// The replica's step when it answered.
    pub step: u64,
    /// Requests waiting or running on the replica when it answered.
    pub queue: u32,
    /// The replica's announcement (JSON record), for [`Call::Info`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub info: Option<String>,
    /// The snapshot offered, for [`Call::StateInfo`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<StateInfo>,
    /// A page of chunk hashes, for [`Call::StateHashes`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hashes: Option<Vec<String>>,
    /// The update a chunk belongs to, for [`Call::StateUpdate`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update: Option<UpdateInfo>,
    /// For [`Call::Info`]: live replicas of the same stage the replica hears from (at most
    /// [`INFO_MATES`], picked at random), so that a reader learns a stage from one of its
    /// replicas instead of a DHT walk. Hints only: a reader asks each for its own
    /// announcement before it counts it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mates: Vec<MateHint>,
    /// Tensor frames that follow.
    pub tensors: u8,
}

/// A stage mate named in an `info` answer: its peer id and addresses it may be dialled on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MateHint {
    /// Peer id (base58).
    pub peer: String,
    /// Multiaddrs (at most two are taken).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addrs: Vec<String>,
}

/// An averaged update a replica applied: what a replica that has the state of `step`
/// needs to reach the next step without downloading the whole state again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpdateInfo {
    /// The step it was applied at.
    pub step: u64,
    /// Samples in it.
    pub total: u64,
    /// Samples lost with dead replicas in that step.
    pub lost: u64,
    /// The parameters' hash after it (hex).
    pub hash: String,
    /// Reduced chunks it is made of.
    pub chunks: u32,
    /// The range of the flat gradient the chunk asked for covers.
    pub start: u64,
    /// See `start`.
    pub end: u64,
    /// The replicas whose sums it holds (peer ids); empty from peers before this field.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<String>,
}

/// A typed refusal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteError {
    /// What kind.
    pub kind: ErrorKind,
    /// One line for humans.
    pub message: String,
}

impl Response {
    /// A success header carrying `tensors` frames.
    pub fn ok(step: u64, queue: u32, tensors: u8) -> Self {
        Self {
            v: MSG_VERSION,
            error: None,
            loss: None,
            step,
            queue,
            info: None,
            state: None,
            hashes: None,
            update: None,
            mates: Vec::new(),
            tensors,
        }
    }

    /// A refusal.
    pub fn err(kind: ErrorKind, message: impl Into<String>, step: u64, queue: u32) -> Self {
        Self {
            error: Some(RemoteError {
                kind,
                message: message.into(),
            }),
            ..Self::ok(step, queue, 0)
        }
    }
}

/// Why a header did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MsgError {
    /// Longer than [`MAX_HEADER`].
    #[error("message header of {0} bytes is over the {MAX_HEADER}-byte limit")]
    HeaderTooLarge(u64),
    /// Not the JSON we expect.
    #[error("malformed message header: {0}")]
    Malformed(String),
    /// A version this build does not speak.
    #[error("message version {0} is not supported (this build speaks {MSG_VERSION})")]
    Version(u8),
    /// More frames than [`MAX_TENSORS`].
    #[error("message declares {0} tensors, at most {MAX_TENSORS} are allowed")]
    TooManyTensors(u8),
}

/// Serialises a header with its u32 length prefix.
pub fn encode_header<T: Serialize>(header: &T) -> Vec<u8> {
    // Serialising these plain structs cannot fail; an empty object keeps us panic-free.
    let json = serde_json::to_vec(header).unwrap_or_else(|_| b"{}".to_vec());
    let mut out = Vec::with_capacity(4 + json.len());
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&json);
    out
}

/// Checks a header length prefix before the header is read.
pub fn check_header_len(len: u32) -> Result<usize, MsgError> {
    if len as usize > MAX_HEADER {
        return Err(MsgError::HeaderTooLarge(len as u64));
    }
    Ok(len as usize)
}

/// The fields every header has, checked the same way for requests and responses.
trait Checked {
    fn version(&self) -> u8;
    fn tensor_count(&self) -> u8;
}

impl Checked for Request {
    fn version(&self) -> u8 {
        self.v
    }
    fn tensor_count(&self) -> u8 {
        self.tensors
    }
}

impl Checked for Response {
    fn version(&self) -> u8 {
        self.v
    }
    fn tensor_count(&self) -> u8 {
        self.tensors
    }
}

fn decode_checked<T: Checked + serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, MsgError> {
    let r: T = serde_json::from_slice(bytes).map_err(|e| MsgError::Malformed(e.to_string()))?;
    if r.version() != MSG_VERSION {
        return Err(MsgError::Version(r.version()));
    }
    if r.tensor_count() > MAX_TENSORS {
        return Err(MsgError::TooManyTensors(r.tensor_count()));
    }
    Ok(r)
}

/// Parses a request header (without its length prefix).
pub fn decode_request(bytes: &[u8]) -> Result<Request, MsgError> {
    decode_checked(bytes)
}

/// Parses a response header (without its length prefix).
pub fn decode_response(bytes: &[u8]) -> Result<Response, MsgError> {
    decode_checked(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trip() {
        let r = Request {
            v: MSG_VERSION,
            run: "ab".into(),
            stage: 2,
            step: 7,
            tensors: 1,
            call: Call::Forward {
                mb: 99,
                dry: false,
                push_to: Some("12D3KooWPeer".into()),
                pushed: true,
                sync: true,
            },
        };
        let bytes = encode_header(&r);
        let len = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        assert_eq!(len as usize, bytes.len() - 4);
        assert_eq!(decode_request(&bytes[4..]), Ok(r.clone()));
        let avg = Request {
            call: Call::Avg {
                avg: AvgMsg::Part {
                    step: 3,
                    attempt: 9,
                    count: 16,
                    chunk: 1,
                },
            },
            ..r
        };
        assert_eq!(decode_request(&encode_header(&avg)[4..]), Ok(avg));
    }

    #[test]
    fn a_field_another_op_takes_is_refused() {
        let with = |call: &str, tensors: u8| {
            let v = MSG_VERSION;
            let head = format!(r#""v":{v},"run":"r","stage":0,"step":0,"tensors":{tensors}"#);
            decode_request(format!("{{{head},{call}}}").as_bytes())
        };
        let malformed = |r: Result<Request, MsgError>| matches!(r, Err(MsgError::Malformed(_)));
        assert!(with(r#""call":{"op":"forward","mb":1,"push_to":"p"}"#, 1).is_ok());
        assert!(with(r#""call":{"op":"info"}"#, 0).is_ok());
        // push_to is a forward's field only.
        assert!(malformed(with(
            r#""call":{"op":"backward","mb":1,"push_to":"p"}"#,
            1
        )));
        // A call without fields takes none; a state chunk needs its chunk.
        let info_chunk = r#""call":{"op":"info","chunk":{"step":0,"index":0}}"#;
        assert!(malformed(with(info_chunk, 0)));
        assert!(malformed(with(r#""call":{"op":"state_chunk"}"#, 0)));
        // The fields of a call are not the request's.
        assert!(malformed(with(r#""op":"info","call":{"op":"info"}"#, 0)));
        assert!(malformed(with(r#""mb":1,"call":{"op":"info"}"#, 0)));
    }

    #[test]
    fn refuses_bad_headers() {
        assert!(matches!(
            decode_request(b"{\"v\":1}"),
            Err(MsgError::Malformed(_))
        ));
        assert!(matches!(
            check_header_len(MAX_HEADER as u32 + 1),
            Err(MsgError::HeaderTooLarge(_))
        ));
        let mut r = Response::ok(0, 0, 0);
        r.tensors = 200;
        let bytes = encode_header(&r);
        assert_eq!(
            decode_response(&bytes[4..]),
            Err(MsgError::TooManyTensors(200))
        );
        r.tensors = 0;
        r.v = MSG_VERSION + 1;
        assert_eq!(
            decode_response(&encode_header(&r)[4..]),
            Err(MsgError::Version(MSG_VERSION + 1))
        );
    }
}
