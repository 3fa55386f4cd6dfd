//! Which stage of this run a peer serves, as its signed announcement says (the one it
//! gives of itself when asked, the DHT's copy if it cannot be reached; one that does not
//! answer in time counts as unannounced until [`RETRY`]; [`registry::announcement_on`]),
//! cached: a replica pushes its activations only to an announced replica of the next
//! stage, and takes pushes only from an announced replica of the stage before. Without the
//! check a caller could make a replica send activations to any peer it names, and any peer
//! could park inputs here.
//!
//! An answer is kept [`FRESH`] (a peer that moves to another stage is looked up again
//! once its cached stage stops matching, at most every [`RETRY`]); a peer with no valid
//! announcement is looked up again after [`RETRY`]. A refused push costs nothing but a
//! hop: the forward answers with its output and the trainer sends it on itself.

use crate::net::NetHandle;
use crate::stage::registry;
use libp2p::PeerId;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How long a peer's announced stage is believed without looking again. Each look is a
/// call to the peer (a DHT walk when it cannot be reached); a replica exchanges pushes with
/// every replica of the stages beside it, so at 30 s, when each look was a walk, a swarm of
/// 120 spent 200 record lookups a second on these checks alone.
pub const FRESH: Duration = Duration::from_secs(300);

/// How long before a peer with no announcement, or another stage than asked, is looked up
/// again. A lookup that finds nothing walks the whole DHT path; at 2 s, replicas of a busy
/// swarm of 200 whose neighbours' records had not spread re-read them without end.
pub const RETRY: Duration = Duration::from_secs(20);

/// Peers remembered at most (the table is emptied past it).
const REMEMBERED: usize = 4096;

/// The announced stages of the peers this replica exchanged pushes with.
pub struct Neighbours {
    net: NetHandle,
    run: String,
    /// Peer → (its announced stage in this run, if any; when looked up).
    seen: Mutex<HashMap<PeerId, (Option<u32>, Instant)>>,
}

impl std::fmt::Debug for Neighbours {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Neighbours")
            .field("run", &self.run)
            .finish()
    }
}

/// Whether a cached answer `(stage, at)` still decides whether a peer serves `want` at
/// `now`: `Some(answer)`, or `None` to look it up again.
pub fn cached(entry: Option<(Option<u32>, Instant)>, want: u32, now: Instant) -> Option<bool> {
    let (stage, at) = entry?;
    let age = now.saturating_duration_since(at);
    match stage {
        Some(s) if s == want && age < FRESH => Some(true),
        _ if age < RETRY => Some(false),
        _ => None,
    }
}

impl Neighbours {
    /// Looks peers up through `net`, for run `run`.
    pub fn new(net: NetHandle, run: String) -> Self {
        Self {
            net,
            run,
            seen: Mutex::new(HashMap::new()),
        }
    }

    /// Whether `peer` is an announced replica of `stage` in this run.
    pub async fn serves(&self, peer: PeerId, stage: usize) -> bool {
        let want = stage as u32;
        let entry = self.seen.lock().get(&peer).copied();
        if let Some(answer) = cached(entry, want, Instant::now()) {
            return answer;
        }
        let announced = registry::announcement_on(&self.net, &self.run, peer, stage)
            .await
            .filter(|a| a.run == self.run)
            .map(|a| a.stage);
        let mut m = self.seen.lock();
        if m.len() >= REMEMBERED {
            m.clear();
        }
        m.insert(peer, (announced, Instant::now()));
        announced == Some(want)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cached_stage_decides_until_it_is_old_or_wrong() {
        let t0 = Instant::now();
        assert_eq!(cached(None, 1, t0), None);
        // Announced at the stage asked: believed for FRESH.
        assert_eq!(cached(Some((Some(1), t0)), 1, t0 + FRESH / 2), Some(true));
        assert_eq!(cached(Some((Some(1), t0)), 1, t0 + FRESH), None);
        // Another stage, or none: refused, and looked up again after RETRY (it may have
        // moved, or its announcement may not have spread yet).
        assert_eq!(cached(Some((Some(2), t0)), 1, t0), Some(false));
        assert_eq!(cached(Some((None, t0)), 1, t0 + RETRY / 2), Some(false));
        assert_eq!(cached(Some((None, t0)), 1, t0 + RETRY), None);
        assert_eq!(cached(Some((Some(2), t0)), 1, t0 + RETRY), None);
    }
}
