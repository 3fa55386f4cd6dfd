//! State download for a joining (or lagging) replica: parameters and optimizer moments in
//! chunks, spread over every donor that holds the same snapshot, each chunk hash-checked.
//!
//! Donors are the replicas at the highest step; only those whose snapshots agree (same
//! step, same chunk hashes) are used together. Chunk `i` goes to donor `(i + offset) % d`
//! with a random offset, so joiners arriving together do not all start on one donor, and
//! a failed or corrupt chunk is retried on the next donor.

use crate::rng::Rng;
use crate::stage::client::{CallError, StageClient};
use crate::stage::replica::Snapshot;
use crate::wire::msg::StateInfo;
use futures::future::join_all;
use libp2p::PeerId;
use std::collections::BTreeMap;

/// Why no state could be downloaded.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// No donor answered.
    #[error("no replica answered a state request ({0})")]
    NoDonor(String),
    /// A chunk failed on every donor.
    #[error("chunk {index} could not be fetched from any donor: {cause}")]
    Chunk {
        /// The chunk.
        index: u32,
        /// The last error.
        cause: String,
    },
    /// The snapshot's size does not fit this stage.
    #[error("donors offer {got} values, this stage needs {want}")]
    Size {
        /// Floats offered.
        got: u64,
        /// Floats expected.
        want: usize,
    },
}

/// What a download did.
#[derive(Debug, Clone)]
pub struct SyncReport {
    /// The donors used.
    pub donors: Vec<PeerId>,
    /// Chunks fetched from each donor, in `donors` order.
    pub chunks_per_donor: Vec<usize>,
}

/// Floats per state chunk (1 MiB).
pub const STATE_CHUNK: usize = 256 << 10;

/// The hash of one state chunk, as donors list it and joiners check it.
pub fn chunk_hash(values: &[f32]) -> String {
    format!(
        "{:016x}",
        xxhash_rust::xxh3::xxh3_64(bytemuck::cast_slice(values))
    )
}

/// Downloads the newest agreed snapshot of `stage` from `candidates`.
pub async fn download(
    client: &StageClient,
    stage: usize,
    candidates: &[PeerId],
    want_len: usize,
    rng: &mut Rng,
) -> Result<(Snapshot, SyncReport), SyncError> {
    let infos = join_all(
        candidates
            .iter()
            .map(|&p| async move { (p, client.state_info(p, stage).await) }),
    )
    .await;
    let mut errors = Vec::new();
    // Group donors by what they offer; the newest step with the most donors wins.
    let mut groups: BTreeMap<(u64, usize), (StateInfo, Vec<PeerId>)> = BTreeMap::new();
    let mut offers: Vec<(StateInfo, Vec<PeerId>)> = Vec::new();
    for (p, r) in infos {
        match r {
            Ok(info) => match offers.iter_mut().find(|(i, _)| *i == info) {
                Some((_, ps)) => ps.push(p),
                None => offers.push((info, vec![p])),
            },
            Err(e) => errors.push(format!("{p}: {e}")),
        }
    }
    for (info, ps) in offers {
        groups.insert((info.step, ps.len()), (info, ps));
    }
    let Some((_, (info, mut donors))) = groups.into_iter().next_back() else {
        return Err(SyncError::NoDonor(errors.join("; ")));
    };
    if info.len as usize != want_len || info.chunk == 0 {
        return Err(SyncError::Size {
            got: info.len,
            want: want_len,
        });
    }
    // Shuffle so concurrent joiners spread over the donors.
    for i in (1..donors.len()).rev() {
        donors.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let n_chunks = info.hashes.len();
    let offset = rng.below(donors.len() as u64) as usize;
    // Each donor serves its share of chunks in order; donors work in parallel. A chunk that
    // fails (error or hash mismatch) is retried on the next donors, then once more on all.
    let d = donors.len();
    let shares = join_all((0..d).map(|k| {
        let donors = &donors;
        let info = &info;
        async move {
            let mut got = Vec::new();
            for i in (0..n_chunks).filter(|i| (i + offset) % d == k) {
                let mut last: Option<CallError> = None;
                let mut done = None;
                'tries: for round in 0..2 {
                    // The assigned donor twice (a dropped stream is usually transient),
                    // then the others.
                    for j in std::iter::once(0).chain(0..d) {
                        let who = (k + j) % d;
                        match client
                            .state_chunk(donors[who], stage, info.step, i as u32)
                            .await
                        {
                            Ok(v) if chunk_hash(&v) == info.hashes[i] => {
                                done = Some((who, v));
                                break 'tries;
                            }
                            Ok(_) => {
                                last = Some(CallError::Protocol(format!("chunk {i} hash mismatch")))
                            }
                            Err(e) => last = Some(e),
                        }
                    }
                    if round == 0 {
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    }
                }
                match done {
                    Some((who, v)) => got.push((i, who, v)),
                    None => {
                        return Err(SyncError::Chunk {
                            index: i as u32,
                            cause: last.map(|e| e.to_string()).unwrap_or_default(),
                        })
                    }
                }
            }
            Ok(got)
        }
    }))
    .await;
    let mut fetched: Vec<(usize, usize, Vec<f32>)> = Vec::with_capacity(n_chunks);
    for share in shares {
        fetched.extend(share?);
    }
    fetched.sort_by_key(|(i, _, _)| *i);
    let mut flat = Vec::with_capacity(want_len);
    let mut per = vec![0usize; donors.len()];
    for (_, who, v) in fetched {
        per[who] += 1;
        flat.extend(v);
    }
    if flat.len() != want_len {
        return Err(SyncError::Size {
            got: flat.len() as u64,
            want: want_len,
        });
    }
    Ok((
        Snapshot {
            step: info.step,
            flat,
            params_hash: info.params_hash.clone(),
            samples_applied: info.samples_applied,
            samples_lost: info.samples_lost,
        },
        SyncReport {
            donors,
            chunks_per_donor: per,
        },
    ))
}
