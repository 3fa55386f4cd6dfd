//! Catching up by replay. Every replica keeps the averaged updates of its last few steps
//! (the reduced chunks exactly as every member applied them, in an unlinked temporary
//! file, not in memory); a replica that holds the state of step `s` (a joiner whose
//! download took longer than a step, a replica that missed a round) fetches the updates
//! of `s`, `s + 1`, … from a replica that has them and applies them with the same code,
//! which makes it bit-identical to that replica (each update names the parameters' hash
//! after it, and a replay that does not reach it is refused). Downloading a whole state
//! costs 12 bytes per parameter; an update costs one in int8.
//!
//! Here too is the averager's resync: a replica behind replays first and downloads the
//! whole state only when the donors no longer keep what it missed.

use super::round::{Frames, ReducedChunks};
use crate::stage::client::StageClient;
use crate::stage::replica::Replica;
use crate::wire::msg::UpdateInfo;
use futures::StreamExt;
use libp2p::PeerId;
use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

/// Updates kept, newest last: in int8, as many bytes as one whole state (12 per
/// parameter), so a joiner whose download took twelve steps still catches up by replay.
/// They are on disk: up to 12 bytes per parameter in `$TMPDIR` (48 with f32 gradients).
pub const KEPT: usize = 12;

/// Update chunks a replica catching up has in flight, per donor.
const IN_FLIGHT: usize = 8;

/// Donors an update's chunks are spread over, at most.
const SPREAD: usize = 4;

/// One applied update on disk.
struct Entry {
    step: u64,
    total: u64,
    lost: u64,
    hash: String,
    /// The replicas whose sums it holds.
    members: Vec<String>,
    /// Shared with reads in progress, which run without the log's lock.
    file: Arc<File>,
    /// Each chunk's range in the flat gradient, offset in the file and length.
    chunks: Vec<(Range<usize>, u64, usize)>,
}

/// Where one chunk of a kept update lies on disk.
pub struct ChunkAt {
    file: Arc<File>,
    offset: u64,
    len: usize,
}

impl ChunkAt {
    /// Reads the chunk (blocking file I/O: off the async runtime's threads).
    pub fn read(&self) -> Result<Vec<u8>, LogError> {
        let mut frame = vec![0u8; self.len];
        self.file
            .read_exact_at(&mut frame, self.offset)
            .map_err(|err| format!("reading the update log: {err}"))?;
        Ok(frame)
    }
}

/// The updates a replica applied last.
#[derive(Default)]
pub struct UpdateLog {
    entries: VecDeque<Entry>,
}

/// Why an update could not be kept or served.
pub type LogError = String;

impl UpdateLog {
    /// Keeps the update applied at `step` (its chunks, `total` and `lost` samples, and the
    /// parameters' hash after it) in a new unlinked file in the temporary directory.
    pub fn record(
        &mut self,
        step: u64,
        total: u64,
        lost: u64,
        hash: &str,
        members: &[PeerId],
        chunks: &ReducedChunks,
    ) -> Result<(), LogError> {
        let dir = std::env::temp_dir();
        let io = |e: std::io::Error| format!("update log in {}: {e}", dir.display());
        let mut file = super::spill::unlinked_file(&dir, "update").map_err(io)?;
        let mut at = 0u64;
        let mut index = Vec::with_capacity(chunks.len());
        for (range, frame) in chunks {
            file.write_all(frame).map_err(io)?;
            index.push((range.clone(), at, frame.len()));
            at += frame.len() as u64;
        }
        index.sort_by_key(|(r, _, _)| r.start);
        self.entries.retain(|e| e.step != step);
        self.entries.push_back(Entry {
            step,
            total,
            lost,
            hash: hash.to_string(),
            members: members.iter().map(|m| m.to_string()).collect(),
            file: Arc::new(file),
            chunks: index,
        });
        while self.entries.len() > KEPT {
            self.entries.pop_front();
        }
        Ok(())
    }

    /// Chunk `index` of the update applied at `step`, and its description.
    pub fn chunk(&self, step: u64, index: usize) -> Result<(UpdateInfo, Vec<u8>), LogError> {
        let (info, at) = self.locate(step, index)?;
        Ok((info, at.read()?))
    }

    /// Where chunk `index` of the update applied at `step` lies, and its description: read
    /// it ([`ChunkAt::read`]) without holding the log.
    pub fn locate(&self, step: u64, index: usize) -> Result<(UpdateInfo, ChunkAt), LogError> {
        let e = self
            .entries
            .iter()
            .find(|e| e.step == step)
            .ok_or_else(|| format!("no update of step {step} is kept"))?;
        let (range, offset, len) = e
            .chunks
            .get(index)
            .cloned()
            .ok_or("update chunk index out of range")?;
        Ok((
            UpdateInfo {
                step,
                total: e.total,
                lost: e.lost,
                hash: e.hash.clone(),
                chunks: u32::try_from(e.chunks.len()).unwrap_or(u32::MAX),
                start: range.start as u64,
                end: range.end as u64,
                members: e.members.clone(),
            },
            ChunkAt {
                file: Arc::clone(&e.file),
                offset,
                len,
            },
        ))
    }
}

/// Whether an update's chunk count is the one every update of a stage of `numel`
/// parameters has (a round cuts every gradient the same way): a donor's count is not
/// believed otherwise, since it sizes an allocation and a loop of calls.
fn check_chunks(info: &UpdateInfo, numel: usize) -> Result<(), LogError> {
    let want = numel.div_ceil(super::round::chunk_for(numel)).max(1);
    if info.chunks as usize != want {
        return Err(format!(
            "the update of step {} comes in {} chunks, not the {want} of this stage",
            info.step, info.chunks
        ));
    }
    Ok(())
}

/// Replays onto `replica` the updates `donors` kept, from its step on, until no donor has
/// the next one (it is then at their step, or further behind than they keep). Returns the
/// updates applied; an error leaves the replica at the last step that checked out.
pub async fn catch_up(
    client: &StageClient,
    stage: usize,
    me: PeerId,
    donors: &[PeerId],
    replica: &Arc<tokio::sync::Mutex<Replica>>,
) -> Result<u64, LogError> {
    let mut applied = 0;
    'steps: loop {
        let (step, numel) = {
            let r = replica.lock().await;
            (r.params_step(), r.stage().params().numel())
        };
        for &d in donors {
            let Ok((info, first)) = client.state_update(d, stage, step, 0).await else {
                continue;
            };
            check_chunks(&info, numel).map_err(|e| format!("donor {d}: {e}"))?;
            let mut chunks: ReducedChunks = Vec::with_capacity(info.chunks as usize);
            chunks.push((info.start as usize..info.end as usize, Arc::new(first)));
            // The other chunks spread over every donor (they hold the same update, checked
            // below), a few calls in flight per donor, so neither one donor's uplink (busy
            // with its own rounds) nor the link's round trip bounds the replay; a chunk a
            // donor does not serve is asked of `d`, which served the first. (At most
            // `SPREAD` donors: calls in flight, and their buffers, grow with them.)
            let per = donors.len().clamp(1, SPREAD);
            let rest: Vec<_> = futures::stream::iter(1..info.chunks)
                .map(|i| async move {
                    let by = donors[i as usize % per];
                    let got = match client.state_update(by, stage, step, i).await {
                        Err(_) if by != d => client.state_update(d, stage, step, i).await,
                        got => got,
                    };
                    (i, got)
                })
                .buffered(IN_FLIGHT * per)
                .collect()
                .await;
            for (i, got) in rest {
                let (ci, f) =
                    got.map_err(|e| format!("update chunk {i} of step {step} from {d}: {e}"))?;
                if ci.step != step || ci.total != info.total || ci.hash != info.hash {
                    return Err(format!("donor {d} changed its update of step {step}"));
                }
                chunks.push((ci.start as usize..ci.end as usize, Arc::new(f)));
            }
            let r = Arc::clone(replica);
            let me = me.to_string();
            let done = tokio::task::spawn_blocking(move || {
                let mut r = r.blocking_lock();
                let frames = Frames::new(chunks, r.stage().params().numel())?;
                replay_update(&mut r, &me, &info, &frames).map(|_| ())
            })
            .await
            .map_err(|e| e.to_string())?;
            done?;
            applied += 1;
            tracing::debug!(target: "shoal::averaging", stage, step, from = %d, "replayed the update of step {step}");
            continue 'steps;
        }
        return Ok(applied);
    }
}

/// Replays the update `info` describes (`frames`) onto `r`, a replica with peer id `me`.
/// A sum `r` froze for that step that the update's members leave out (the round went on
/// without it: an attempt it joined was abandoned and retried without it) is in no update
/// anyone applied, so it is counted as dropped first instead of vanishing in the replay.
/// Returns the samples dropped.
pub fn replay_update(
    r: &mut Replica,
    me: &str,
    info: &UpdateInfo,
    frames: &Frames,
) -> Result<u64, LogError> {
    let left_out = !info.members.is_empty() && !info.members.iter().any(|m| m == me);
    let dropped = if left_out {
        r.drop_unsent(info.step)
    } else {
        0
    } + r.drop_pending(info.step);
    r.replay(info.step, frames, info.total, info.lost, &info.hash)
        .map_err(|e| e.to_string())?;
    Ok(dropped)
}

impl super::actor::State {
    /// Catches up with `donors`, replicas ahead of this one (or the leader it disagrees
    /// with): by replaying their updates when they keep them, else by downloading the
    /// whole state (then replaying what they applied meanwhile).
    pub(super) async fn resync(&mut self, donors: &[PeerId]) {
        if donors.is_empty() {
            return;
        }
        // A sum frozen for this step that went to no round is in no update the donors
        // applied: a replay would drop it unseen, so it is counted as dropped here.
        let st = self.status();
        if st.frozen_count > 0 && self.joined != Some(st.params_step) {
            let step = st.params_step;
            let n = self.service.replica().lock().await.drop_unsent(step);
            self.service.refresh_status().await;
            self.debug(|| {
                format!("behind: dropped {n} samples frozen for {step}, sent to no round")
            });
        }
        // Replaying the updates missed moves a twelfth of the state per step (int8):
        // first that, then the whole state if the donors do not keep them.
        let replica = self.service.replica();
        let replayed = catch_up(&self.client, self.stage, self.me, donors, &replica).await;
        if let Err(e) = &replayed {
            self.debug(|| format!("behind: replaying the donors' updates failed: {e}"));
        }
        if let Ok(n) = replayed {
            if n > 0 {
                self.debug(|| format!("caught up by replaying {n} update(s)"));
                self.stats
                    .replays
                    .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                self.restart_from_new_state().await;
                return;
            }
        }
        // Parameters and the optimizer's moments, and in outer mode the outer parameters
        // and momentum as well.
        let len = replica.lock().await.snapshot_len();
        let r =
            super::sync::download(&self.client, self.stage, donors, len, &mut self.rng, None).await;
        if let Err(e) = &r {
            self.debug(|| format!("behind: downloading the state failed: {e}"));
            *self.stats.last_error.lock() = Some(e.to_string());
        }
        if let Ok((snap, parts, _)) = r {
            let r2 = Arc::clone(&replica);
            let ok = tokio::task::spawn_blocking(move || {
                r2.blocking_lock()
                    .restore_parts(&snap, parts)
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            })
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r);
            if let Err(e) = &ok {
                self.debug(|| format!("behind: the downloaded state did not restore: {e}"));
            }
            if ok.is_ok() {
                self.stats
                    .resyncs
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.debug(|| "behind: restored a donor's state".to_string());
                // The download took time: replay what the donors applied meanwhile.
                if let Ok(n) = catch_up(&self.client, self.stage, self.me, donors, &replica).await {
                    self.stats
                        .replays
                        .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                }
                self.restart_from_new_state().await;
            }
        }
    }

    /// After the replica's state moved under the averager (replayed or downloaded): its
    /// status read afresh, and the round, early parts and held `Members` of the old step
    /// dropped.
    async fn restart_from_new_state(&mut self) {
        self.service.refresh_status().await;
        self.end_round(false);
        self.early.clear();
        self.next_members = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RunConfig;
    use crate::model::{Stage, Upstream};
    use crate::wire::{self, CodecSpec};
    use candle_core::Device;

    fn replica() -> Replica {
        let cfg = RunConfig::tiny();
        let stage = Stage::new(&cfg, 0, &candle_core::Device::Cpu).unwrap();
        Replica::new(&cfg, stage).unwrap()
    }

    #[test]
    fn a_replayed_update_reaches_the_same_parameters_and_a_wrong_one_is_caught() {
        let (mut a, mut b) = (replica(), replica());
        let n = a.stage().params().numel();
        let grad: Vec<f32> = (0..n).map(|i| ((i % 97) as f32 - 48.0) * 1e-3).collect();
        // The update as a round leaves it: int8 chunks of 1000 values.
        let chunks: ReducedChunks = (0..n)
            .step_by(1000)
            .map(|s| {
                let e = (s + 1000).min(n);
                let mut f = Vec::new();
                wire::encode_f32(&[e - s], &grad[s..e], &CodecSpec::INT8, &mut f).unwrap();
                (s..e, Arc::new(f))
            })
            .collect();
        let frames = Frames::new(chunks.clone(), n).unwrap();
        a.apply(0, &frames, 16, 2).unwrap();
        let mut log = UpdateLog::default();
        log.record(0, 16, 2, a.params_hash(), &[], frames.chunks())
            .unwrap();
        // Served chunk by chunk, as a catching-up replica fetches it.
        let (info, first) = log.chunk(0, 0).unwrap();
        assert_eq!((info.step, info.total, info.lost), (0, 16, 2));
        assert_eq!(info.chunks as usize, chunks.len());
        assert!(log.chunk(1, 0).is_err() && log.chunk(0, chunks.len()).is_err());
        let mut got: ReducedChunks =
            vec![(info.start as usize..info.end as usize, Arc::new(first))];
        for i in 1..info.chunks as usize {
            let (ci, f) = log.chunk(0, i).unwrap();
            got.push((ci.start as usize..ci.end as usize, Arc::new(f)));
        }
        let replayed = Frames::new(got, n).unwrap();
        let mut c = replica();
        b.replay(0, &replayed, info.total, info.lost, &info.hash)
            .unwrap();
        assert_eq!(b.params_hash(), a.params_hash());
        assert_eq!(b.snapshot().unwrap(), a.snapshot().unwrap());
        // A donor's chunk count is checked against the stage's before anything is sized
        // by it.
        let cut = n.div_ceil(crate::averaging::round::chunk_for(n)) as u32;
        let honest = UpdateInfo {
            chunks: cut,
            ..info.clone()
        };
        assert!(check_chunks(&honest, n).is_ok());
        for lie in [0, cut + 1, u32::MAX] {
            let e = check_chunks(
                &UpdateInfo {
                    chunks: lie,
                    ..info.clone()
                },
                n,
            )
            .unwrap_err();
            assert!(e.contains("chunks"), "{e}");
        }
        // An update that does not reach the hash it names is refused.
        assert!(c.replay(0, &replayed, 16, 2, "0000000000000000").is_err());
        // Only the newest few are kept.
        for s in 1..=(KEPT as u64 + 2) {
            log.record(s, 1, 0, "h", &[], frames.chunks()).unwrap();
        }
        assert!(log.chunk(0, 0).is_err() && log.chunk(KEPT as u64 + 2, 0).is_ok());
    }

    /// Found by reading, not by a failing run: a replica that joined a round attempt the
    /// others then completed without it held a frozen sum the replay discarded, uncounted.
    #[test]
    fn a_frozen_sum_an_update_left_out_is_counted_as_dropped_in_the_replay() {
        let cfg = RunConfig::tiny();
        let (b, t, d) = (3, cfg.model.seq_len, cfg.model.d_model);
        let x = candle_core::Tensor::zeros((b, t), candle_core::DType::U32, &Device::Cpu).unwrap();
        let g = candle_core::Tensor::ones((b, t, d), candle_core::DType::F32, &Device::Cpu)
            .unwrap()
            .affine(1e-3, 0.0)
            .unwrap();
        let (me, other) = (PeerId::random(), PeerId::random());
        let mut donor = replica();
        let n = donor.stage().params().numel();
        let zeros = vec![0f32; n];
        let mut f = Vec::new();
        wire::encode_f32(&[n], &zeros, &CodecSpec::F32, &mut f).unwrap();
        let chunks: ReducedChunks = vec![(0..n, Arc::new(f))];
        let frames = Frames::new(chunks, n).unwrap();
        donor.apply(0, &frames, 8, 0).unwrap();
        for (members, dropped) in [(vec![other], b as u64), (vec![other, me], 0)] {
            let mut log = UpdateLog::default();
            log.record(0, 8, 0, donor.params_hash(), &members, frames.chunks())
                .unwrap();
            let (info, _) = log.chunk(0, 0).unwrap();
            let mut r = replica();
            r.backward(&x, Upstream::Grad(&g), 1).unwrap();
            r.freeze(0, 1000, &CodecSpec::F32).unwrap();
            assert_eq!(r.frozen_count(), b as u64);
            let got = replay_update(&mut r, &me.to_string(), &info, &frames).unwrap();
            assert_eq!(
                (got, r.samples_dropped()),
                (dropped, dropped),
                "{members:?}"
            );
            assert_eq!(r.params_hash(), donor.params_hash());
        }
    }
}
