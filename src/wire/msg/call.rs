//! A request's header: its [`Call`] (what it asks, tagged by op, with exactly the fields
//! that op takes) and the fields every request has.

use super::{AvgMsg, ChunkReq};
use serde::{Deserialize, Serialize};

/// The header of a request: who it is for and what it asks ([`Call`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    /// Message format version.
    pub v: u8,
    /// The run id the caller trains.
    pub run: String,
    /// The stage it means to call.
    pub stage: u32,
    /// The optimizer step the caller is at (for a synchronous forward or backward, the
    /// step its microbatch belongs to).
    pub step: u64,
    /// Tensor frames that follow.
    pub tensors: u8,
    /// What to do.
    pub call: Call,
}

impl Request {
    /// Which kind of call.
    pub fn op(&self) -> Op {
        self.call.op()
    }

    /// A forward's or backward's fields; all zero for any other call.
    pub fn job(&self) -> Job {
        self.call.job().unwrap_or_default()
    }
}

/// Which kind of call a request is: [`Call`] without its fields (for lanes, logs and
/// metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// [`Call::Forward`].
    Forward,
    /// [`Call::Backward`].
    Backward,
    /// [`Call::Info`].
    Info,
    /// [`Call::Avg`].
    Avg,
    /// [`Call::StateInfo`].
    StateInfo,
    /// [`Call::StateChunk`].
    StateChunk,
    /// [`Call::StateHashes`].
    StateHashes,
    /// [`Call::StateUpdate`].
    StateUpdate,
    /// [`Call::Push`].
    Push,
}

/// What a request asks the stage to do, with exactly the fields that op takes: on the wire
/// the `call` object of a request, tagged by `op` (`{"op":"forward","mb":7}`); a field
/// another op takes is refused as unknown.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Call {
    /// `[input]` → `[output]`: activations, or logits on the last stage.
    Forward {
        /// Microbatch id (unique per trainer and microbatch).
        mb: u64,
        /// A probe (`shoal probe`): the replica keeps nothing and does not check the
        /// caller's step, so the run's training is untouched.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        dry: bool,
        /// Send the output to this replica of the next stage ([`Call::Push`]) instead of
        /// answering with it; the answer carries it only if that failed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        push_to: Option<String>,
        /// The input is not among the frames but pushed by the previous stage's replica;
        /// the replica waits for it.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        pushed: bool,
        /// The microbatch belongs to synchronous step `step` (every gradient of a step
        /// computed at that step's parameters). Stage 0 assigns a forward its step and
        /// holds it until a step has room (the answer's `step` says which); later stages
        /// hold a forward of a step they have not reached, and refuse one of a step they
        /// have closed (`step_closed`).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        sync: bool,
    },
    /// `[input, grad of output]` (or `[input, targets]` on the last stage) → `[grad of
    /// input]` (none on stage 0), the loss on the last stage. Accumulates the parameter
    /// gradients on the replica. The fields are a forward's, less `push_to`.
    Backward {
        /// Microbatch id.
        mb: u64,
        /// A probe: the loss and input gradient come back, nothing is accumulated.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        dry: bool,
        /// The input comes pushed by the previous stage's replica, not among the frames.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        pushed: bool,
        /// The microbatch belongs to synchronous step `step`.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        sync: bool,
    },
    /// No tensors → the replica's current announcement in `info`. (The calls without
    /// fields are written `{}` so that a stray field is refused: serde ignores one on a
    /// unit variant of a tagged enum.)
    Info {},
    /// An averaging message between replicas of a stage; answered with an empty success
    /// at once, handled asynchronously.
    Avg {
        /// The message.
        avg: AvgMsg,
    },
    /// No tensors → a fresh snapshot of the replica's state described in `state`.
    StateInfo {},
    /// No tensors → chunk `chunk.index` of the snapshot of step `chunk.step`, one frame.
    StateChunk {
        /// Which chunk.
        chunk: ChunkReq,
    },
    /// No tensors → page `chunk.index` of the chunk hashes of the snapshot of step
    /// `chunk.step` (at most [`HASH_PAGE`](super::HASH_PAGE) of them), in `hashes`.
    StateHashes {
        /// Which page.
        chunk: ChunkReq,
    },
    /// No tensors → chunk `chunk.index` of the averaged update that took the replica from
    /// step `chunk.step` to the next, one frame (exactly as every member applied it), and
    /// the update's description in `update`.
    StateUpdate {
        /// Which chunk of which update.
        chunk: ChunkReq,
    },
    /// `[input]` → no tensors: the output of the previous stage's forward of microbatch
    /// `mb` (at the request's `step`), sent by that stage's replica (a forward with
    /// `push_to`) and held here for the caller's `pushed` call of the same microbatch.
    Push {
        /// Microbatch id.
        mb: u64,
    },
}

/// The fields a forward and a backward share ([`Call::job`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Job {
    /// Microbatch id.
    pub mb: u64,
    /// A probe.
    pub dry: bool,
    /// The input is pushed.
    pub pushed: bool,
    /// Synchronous.
    pub sync: bool,
}

impl Call {
    /// Which kind of call.
    pub fn op(&self) -> Op {
        match self {
            Self::Forward { .. } => Op::Forward,
            Self::Backward { .. } => Op::Backward,
            Self::Info {} => Op::Info,
            Self::Avg { .. } => Op::Avg,
            Self::StateInfo {} => Op::StateInfo,
            Self::StateChunk { .. } => Op::StateChunk,
            Self::StateHashes { .. } => Op::StateHashes,
            Self::StateUpdate { .. } => Op::StateUpdate,
            Self::Push { .. } => Op::Push,
        }
    }

    /// A forward's or backward's fields; `None` for any other call.
    pub fn job(&self) -> Option<Job> {
        match *self {
            Self::Forward {
                mb,
                dry,
                pushed,
                sync,
                ..
            }
            | Self::Backward {
                mb,
                dry,
                pushed,
                sync,
            } => Some(Job {
                mb,
                dry,
                pushed,
                sync,
            }),
            _ => None,
        }
    }

    /// The microbatch a forward, backward or push is about (0 for any other call).
    pub fn mb(&self) -> u64 {
        match *self {
            Self::Forward { mb, .. } | Self::Backward { mb, .. } | Self::Push { mb } => mb,
            _ => 0,
        }
    }

    /// Where a forward's output is to be pushed.
    pub fn push_to(&self) -> Option<&str> {
        match self {
            Self::Forward { push_to, .. } => push_to.as_deref(),
            _ => None,
        }
    }

    /// The chunk or page a state call asks for.
    pub fn chunk(&self) -> Option<ChunkReq> {
        match *self {
            Self::StateChunk { chunk }
            | Self::StateHashes { chunk }
            | Self::StateUpdate { chunk } => Some(chunk),
            _ => None,
        }
    }
}
