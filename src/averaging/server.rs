//! The replica's side of averaging and state download: it takes averaging messages into the
//! averager's bounded inbox and answers `state_info` / `state_chunk` from a snapshot of
//! the replica. Registered with the stage service as its [`Extension`]; the client side of
//! state download is [`super::sync`], and both use [`super::sync::chunk_hash`].

use super::sync::{chunk_hash, STATE_CHUNK};
use crate::stage::replica::{Replica, Snapshot};
use crate::stage::service::{Answer, Extension, Refusal};
use crate::wire::msg::{AvgMsg, ErrorKind, Op, Request, StateInfo};
use crate::wire::CodecSpec;
use futures::future::BoxFuture;
use libp2p::PeerId;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// An averaging message as the averager receives it.
#[derive(Debug)]
pub struct Inbound {
    /// The sender.
    pub from: PeerId,
    /// The message.
    pub msg: AvgMsg,
    /// Its frames.
    pub frames: Vec<Vec<u8>>,
}

/// Snapshots kept for joiners still downloading (the newest two steps).
const SNAPSHOTS_KEPT: usize = 2;

struct SnapshotEntry {
    info: StateInfo,
    snap: Snapshot,
}

/// Answers averaging and state calls for one replica.
pub struct AvgServer {
    inbox: mpsc::Sender<Inbound>,
    replica: Arc<tokio::sync::Mutex<Replica>>,
    snapshots: Mutex<VecDeque<Arc<SnapshotEntry>>>,
}

impl AvgServer {
    /// A server that puts averaging messages into `inbox` and snapshots `replica`.
    pub fn new(inbox: mpsc::Sender<Inbound>, replica: Arc<tokio::sync::Mutex<Replica>>) -> Self {
        Self {
            inbox,
            replica,
            snapshots: Mutex::new(VecDeque::new()),
        }
    }

    fn snapshots(&self) -> std::sync::MutexGuard<'_, VecDeque<Arc<SnapshotEntry>>> {
        self.snapshots.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn message(&self, peer: PeerId, req: Request, frames: Vec<Vec<u8>>) -> Result<Answer, Refusal> {
        let Some(msg) = req.avg else {
            return Err(Refusal::new(
                ErrorKind::BadRequest,
                "avg request without a message",
            ));
        };
        self.inbox
            .try_send(Inbound {
                from: peer,
                msg,
                frames,
            })
            .map_err(|_| Refusal::new(ErrorKind::Overloaded, "averaging inbox is full"))?;
        Ok(Answer::default())
    }

    async fn state_info(&self) -> Result<Answer, Refusal> {
        let replica = Arc::clone(&self.replica);
        let snap = tokio::task::spawn_blocking(move || replica.blocking_lock().snapshot())
            .await
            .map_err(|e| Refusal::new(ErrorKind::Internal, e.to_string()))?
            .map_err(|e| Refusal::new(ErrorKind::Internal, e.to_string()))?;
        let info = StateInfo {
            step: snap.step,
            len: snap.flat.len() as u64,
            chunk: STATE_CHUNK as u64,
            hashes: snap.flat.chunks(STATE_CHUNK).map(chunk_hash).collect(),
            params_hash: snap.params_hash.clone(),
            samples_applied: snap.samples_applied,
            samples_lost: snap.samples_lost,
        };
        {
            let mut cache = self.snapshots();
            cache.retain(|e| e.info.step != info.step);
            cache.push_back(Arc::new(SnapshotEntry {
                info: info.clone(),
                snap,
            }));
            while cache.len() > SNAPSHOTS_KEPT {
                cache.pop_front();
            }
        }
        Ok(Answer {
            state: Some(info),
            frames: Vec::new(),
        })
    }

    fn state_chunk(&self, req: &Request) -> Result<Answer, Refusal> {
        let Some(c) = req.chunk else {
            return Err(Refusal::new(
                ErrorKind::BadRequest,
                "state_chunk without a chunk",
            ));
        };
        let entry = self
            .snapshots()
            .iter()
            .find(|e| e.info.step == c.step)
            .cloned();
        let Some(entry) = entry else {
            return Err(Refusal::new(
                ErrorKind::StaleStep,
                format!(
                    "no snapshot of step {} is held; ask for state_info again",
                    c.step
                ),
            ));
        };
        let flat = &entry.snap.flat;
        let start = (c.index as usize).saturating_mul(STATE_CHUNK);
        if start >= flat.len() {
            return Err(Refusal::new(
                ErrorKind::BadRequest,
                "chunk index out of range",
            ));
        }
        let end = (start + STATE_CHUNK).min(flat.len());
        let mut frame = Vec::new();
        crate::wire::encode_f32(
            &[end - start],
            &flat[start..end],
            &CodecSpec::F32,
            &mut frame,
        )
        .map_err(|e| Refusal::new(ErrorKind::Internal, e.to_string()))?;
        Ok(Answer {
            state: None,
            frames: vec![frame],
        })
    }
}

impl Extension for AvgServer {
    fn call(
        &self,
        peer: PeerId,
        req: Request,
        frames: Vec<Vec<u8>>,
    ) -> BoxFuture<'_, Result<Answer, Refusal>> {
        Box::pin(async move {
            match req.op {
                Op::Avg => self.message(peer, req, frames),
                Op::StateInfo => self.state_info().await,
                Op::StateChunk => self.state_chunk(&req),
                other => Err(Refusal::new(
                    ErrorKind::BadRequest,
                    format!("{other:?} is not an averaging call"),
                )),
            }
        })
    }
}
