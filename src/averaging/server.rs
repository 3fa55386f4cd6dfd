//! The replica's side of averaging and state download: it takes averaging messages into the
//! averager's bounded inbox and answers `state_info` / `state_chunk` from a snapshot of
//! the replica spilled to disk ([`super::spill`]). Registered with the stage service as its [`Extension`]; the client side of
//! state download is [`super::sync`], and both use [`super::sync::chunk_hash`].

use super::spill::Spill;
use super::updates::UpdateLog;
use crate::stage::replica::Replica;
use crate::stage::service::{Answer, Extension, Refusal};
use crate::wire::msg::{AvgMsg, Call, ChunkReq, ErrorKind, Request, StateInfo, HASH_PAGE};
use crate::wire::CodecSpec;
use futures::future::BoxFuture;
use libp2p::PeerId;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

/// An averaging message as the averager receives it.
#[derive(Debug)]
pub struct Inbound {
    /// The sender.
    pub from: PeerId,
    /// The message.
    pub msg: AvgMsg,
    /// Its frames.
    pub frames: Vec<Vec<u8>>,
    /// Its share of the inbox's byte budget, given back when the message is dropped.
    pub permit: Option<OwnedSemaphorePermit>,
}

/// The inbox's byte budget is counted in units of this many bytes.
const BUDGET_UNIT: usize = 1024;

/// What the averager shares with its server: the inbox, its byte budget, and the step of
/// the round parts may be for.
#[derive(Debug, Clone)]
pub struct Inbox {
    /// Where messages go.
    pub tx: mpsc::Sender<Inbound>,
    /// Bytes of frames the inbox may hold, in [`BUDGET_UNIT`]s.
    pub budget: Arc<Semaphore>,
    /// The replica's applied step, as the averager last saw it: parts and reduced parts
    /// are for rounds of this step only.
    pub step: Arc<AtomicU64>,
    /// Round attempts of this step that are over (abandoned or applied): their parts are
    /// refused.
    pub closed: Arc<Mutex<VecDeque<(u64, u32)>>>,
}

/// Attempts remembered as over.
const CLOSED_KEPT: usize = 16;

impl Inbox {
    /// Marks attempt `key` as over: its late parts are refused from now on.
    pub fn close(&self, key: (u64, u32)) {
        let mut c = self.closed.lock();
        c.push_back(key);
        while c.len() > CLOSED_KEPT {
            c.pop_front();
        }
    }

    fn is_closed(&self, key: (u64, u32)) -> bool {
        self.closed.lock().contains(&key)
    }
}

impl Inbox {
    /// An inbox for `tx` that holds at most `bytes` bytes of frames.
    pub fn new(tx: mpsc::Sender<Inbound>, bytes: usize) -> Self {
        let units = bytes.div_ceil(BUDGET_UNIT).clamp(1, Semaphore::MAX_PERMITS);
        Self {
            tx,
            budget: Arc::new(Semaphore::new(units)),
            step: Arc::new(AtomicU64::new(0)),
            closed: Arc::new(Mutex::new(VecDeque::new())),
        }
    }
}

/// Snapshots kept for joiners still downloading (the newest two steps).
const SNAPSHOTS_KEPT: usize = 2;

struct SnapshotEntry {
    info: StateInfo,
    spill: Spill,
}

/// Answers averaging and state calls for one replica.
pub struct AvgServer {
    inbox: Inbox,
    replica: Arc<tokio::sync::Mutex<Replica>>,
    /// Floats per state chunk.
    chunk: usize,
    /// Where snapshots are spilled.
    dir: PathBuf,
    snapshots: Mutex<VecDeque<Arc<SnapshotEntry>>>,
    /// The updates this replica applied last, for replicas catching up.
    log: Arc<Mutex<UpdateLog>>,
}

impl AvgServer {
    /// A server that puts averaging messages into `inbox` and offers snapshots of
    /// `replica` in chunks of `chunk` floats, spilled to the temporary directory.
    pub fn new(inbox: Inbox, replica: Arc<tokio::sync::Mutex<Replica>>, chunk: usize) -> Self {
        Self {
            inbox,
            replica,
            chunk: chunk.max(1),
            dir: std::env::temp_dir(),
            snapshots: Mutex::new(VecDeque::new()),
            log: Arc::default(),
        }
    }

    /// Serves the updates in `log` (the averager records what it applies there).
    pub fn with_log(mut self, log: Arc<Mutex<UpdateLog>>) -> Self {
        self.log = log;
        self
    }

    /// A kept update's chunk: found under the log's lock, read from disk off the runtime.
    async fn state_update(&self, c: ChunkReq) -> Result<Answer, Refusal> {
        let found = self.log.lock().locate(c.step, c.index as usize);
        let (info, at) = found.map_err(|e| Refusal::new(ErrorKind::StaleStep, e))?;
        let frame = tokio::task::spawn_blocking(move || at.read())
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r)
            .map_err(|e| Refusal::new(ErrorKind::Internal, e))?;
        Ok(Answer {
            update: Some(info),
            frames: vec![frame],
            ..Answer::default()
        })
    }

    fn snapshots(&self) -> parking_lot::MutexGuard<'_, VecDeque<Arc<SnapshotEntry>>> {
        self.snapshots.lock()
    }

    fn message(&self, peer: PeerId, msg: AvgMsg, frames: Vec<Vec<u8>>) -> Result<Answer, Refusal> {
        if let AvgMsg::Part { step, attempt, .. } | AvgMsg::Reduced { step, attempt, .. } = &msg {
            let now = self.inbox.step.load(Ordering::Relaxed);
            if *step < now {
                return Err(Refusal::new(
                    ErrorKind::StaleStep,
                    format!("a part for step {step}, but this replica averages step {now}"),
                ));
            }
            if *step > now + 1 {
                // About to apply step `now`: the sender tries again shortly.
                return Err(Refusal::new(
                    ErrorKind::Overloaded,
                    format!("a part for step {step}, but this replica is still at step {now}"),
                ));
            }
            if self.inbox.is_closed((*step, *attempt)) {
                return Err(Refusal::new(
                    ErrorKind::StaleStep,
                    format!("a part for attempt {attempt} of step {step}, which is over"),
                ));
            }
        }
        let bytes: usize = frames.iter().map(Vec::len).sum();
        let units = u32::try_from(bytes.div_ceil(BUDGET_UNIT).max(1)).unwrap_or(u32::MAX);
        let permit = Arc::clone(&self.inbox.budget)
            .try_acquire_many_owned(units)
            .map_err(|_| {
                Refusal::new(
                    ErrorKind::Overloaded,
                    format!("averaging inbox is full (a message of {bytes} bytes waits)"),
                )
            })?;
        self.inbox
            .tx
            .try_send(Inbound {
                from: peer,
                msg,
                frames,
                permit: Some(permit),
            })
            .map_err(|_| Refusal::new(ErrorKind::Overloaded, "averaging inbox is full"))?;
        Ok(Answer::default())
    }

    /// Offers the state at the replica's current step: the newest snapshot if it is of
    /// that step, else a new one spilled to disk (the replica is locked while it is
    /// written, so it is one step's).
    async fn state_info(&self) -> Result<Answer, Refusal> {
        let internal = |e: String| Refusal::new(ErrorKind::Internal, e);
        let newest = self.snapshots().back().cloned();
        let cached_step = newest.as_ref().map(|e| e.info.step);
        let (replica, chunk, dir) = (Arc::clone(&self.replica), self.chunk, self.dir.clone());
        let spill = tokio::task::spawn_blocking(move || {
            let asked = std::time::Instant::now();
            let r = replica.blocking_lock();
            if Some(r.params_step()) == cached_step {
                return Ok(None);
            }
            let locked = asked.elapsed().as_secs_f64();
            let spill = Spill::write(&r, chunk, &dir).map(Some);
            tracing::debug!(
                target: "shoal::averaging",
                step = r.params_step(),
                "state offered: replica locked after {locked:.1} s, spilled after {:.1} s",
                asked.elapsed().as_secs_f64()
            );
            spill
        })
        .await
        .map_err(|e| internal(e.to_string()))?
        .map_err(|e| internal(e.to_string()))?;
        let entry = match (spill, newest) {
            (Some(spill), _) => {
                let meta = spill.meta();
                let info = StateInfo {
                    step: meta.step,
                    len: spill.len() as u64,
                    chunk: self.chunk as u64,
                    chunks: spill.hashes().len() as u64,
                    root: spill.root(),
                    params_hash: meta.params_hash.clone(),
                    samples_applied: meta.samples_applied,
                    samples_lost: meta.samples_lost,
                };
                let entry = Arc::new(SnapshotEntry { info, spill });
                let mut cache = self.snapshots();
                cache.retain(|e| e.info.step != entry.info.step);
                cache.push_back(Arc::clone(&entry));
                while cache.len() > SNAPSHOTS_KEPT {
                    cache.pop_front();
                }
                entry
            }
            (None, Some(newest)) => newest,
            (None, None) => return Err(internal("no snapshot".into())),
        };
        Ok(Answer {
            state: Some(entry.info.clone()),
            ..Answer::default()
        })
    }

    /// The snapshot a chunk or hash-page request names.
    fn entry(&self, c: ChunkReq) -> Result<(Arc<SnapshotEntry>, usize), Refusal> {
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
        Ok((entry, c.index as usize))
    }

    fn state_hashes(&self, c: ChunkReq) -> Result<Answer, Refusal> {
        let (entry, page) = self.entry(c)?;
        let hashes = entry.spill.hashes();
        let start = page.saturating_mul(HASH_PAGE);
        if start >= hashes.len() {
            return Err(Refusal::new(
                ErrorKind::BadRequest,
                "hash page index out of range",
            ));
        }
        let end = (start + HASH_PAGE).min(hashes.len());
        Ok(Answer {
            hashes: Some(hashes[start..end].to_vec()),
            ..Answer::default()
        })
    }

    async fn state_chunk(&self, c: ChunkReq) -> Result<Answer, Refusal> {
        let (entry, index) = self.entry(c)?;
        let start = index.saturating_mul(self.chunk);
        if start >= entry.spill.len() {
            return Err(Refusal::new(
                ErrorKind::BadRequest,
                "chunk index out of range",
            ));
        }
        let end = start + self.chunk;
        let frame = tokio::task::spawn_blocking(move || {
            let values = entry.spill.read(start, end).map_err(|e| e.to_string())?;
            let mut frame = Vec::new();
            crate::wire::encode_f32(&[values.len()], &values, &CodecSpec::F32, &mut frame)
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(frame)
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r)
        .map_err(|e| Refusal::new(ErrorKind::Internal, e))?;
        Ok(Answer {
            frames: vec![frame],
            ..Answer::default()
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
            match req.call {
                Call::Avg { avg } => self.message(peer, avg, frames),
                Call::StateInfo {} => self.state_info().await,
                Call::StateChunk { chunk } => self.state_chunk(chunk).await,
                Call::StateHashes { chunk } => self.state_hashes(chunk),
                Call::StateUpdate { chunk } => self.state_update(chunk).await,
                other => Err(Refusal::new(
                    ErrorKind::BadRequest,
                    format!("{:?} is not an averaging call", other.op()),
                )),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RunConfig;
    use crate::model::Stage;

    fn server(budget_bytes: usize) -> (AvgServer, mpsc::Receiver<Inbound>, Inbox) {
        let cfg = RunConfig::tiny();
        let stage = Stage::new(&cfg, 0, &candle_core::Device::Cpu).unwrap();
        let replica = Arc::new(tokio::sync::Mutex::new(Replica::new(&cfg, stage).unwrap()));
        let (tx, rx) = mpsc::channel(16);
        let inbox = Inbox::new(tx, budget_bytes);
        (AvgServer::new(inbox.clone(), replica, 64), rx, inbox)
    }

    fn part(step: u64) -> AvgMsg {
        AvgMsg::Part {
            step,
            attempt: 1,
            count: 4,
            chunk: 0,
        }
    }

    #[test]
    fn parts_of_other_steps_are_refused_and_the_inbox_is_bounded_by_bytes() {
        let (srv, mut rx, inbox) = server(8 * BUDGET_UNIT);
        let peer = PeerId::random();
        inbox.step.store(3, Ordering::Relaxed);
        // Step 4's parts are taken (a member finishing step 3 keeps them for its next
        // round); step 5's are too early.
        for (step, kind) in [(2, ErrorKind::StaleStep), (5, ErrorKind::Overloaded)] {
            let e = srv
                .message(peer, part(step), vec![vec![0u8; 100]])
                .unwrap_err();
            assert_eq!(e.kind, kind);
            assert!(e.message.contains(&format!("step {step}")), "{}", e.message);
        }
        assert_eq!(
            inbox.budget.available_permits(),
            8,
            "a refused part holds nothing"
        );
        // The current step's parts are taken until their bytes fill the budget.
        srv.message(peer, part(3), vec![vec![0u8; 5 * BUDGET_UNIT]])
            .unwrap();
        assert_eq!(inbox.budget.available_permits(), 3);
        let e = srv
            .message(peer, part(3), vec![vec![0u8; 4 * BUDGET_UNIT]])
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::Overloaded);
        // Handling a message gives its bytes back.
        drop(rx.try_recv().unwrap());
        assert_eq!(inbox.budget.available_permits(), 8);
        srv.message(peer, part(3), vec![vec![0u8; 4 * BUDGET_UNIT]])
            .unwrap();
        // An attempt that is over takes nothing either.
        inbox.close((3, 1));
        let e = srv.message(peer, part(3), vec![vec![0u8; 10]]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::StaleStep);
        assert!(e.message.contains("attempt 1"), "{}", e.message);
        drop(rx.try_recv().unwrap());
        srv.message(peer, part(4), vec![vec![0u8; 10]]).unwrap();
        // Control messages are not tied to a step.
        srv.message(peer, AvgMsg::Leave { pending: 1 }, Vec::new())
            .unwrap();
    }
}
