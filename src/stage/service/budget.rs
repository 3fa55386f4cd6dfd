//! A caller's byte budget ([`super::ServiceConfig::max_bytes_per_peer`]): the frame bytes
//! of its requests being read or waiting here, and of the inputs it pushed that wait for
//! their request, are charged to it while they live.

use super::Shared;
use libp2p::PeerId;
use std::sync::Arc;

/// Frame bytes of one request counted against its caller's budget while it lives.
pub(super) struct Held {
    shared: Arc<Shared>,
    peer: PeerId,
    bytes: u64,
}

impl Held {
    /// Nothing held yet for `peer`.
    pub(super) fn new(shared: &Arc<Shared>, peer: PeerId) -> Self {
        Self {
            shared: Arc::clone(shared),
            peer,
            bytes: 0,
        }
    }

    /// Adds `bytes` if the caller's total stays within the budget.
    pub(super) fn take(&mut self, bytes: u64) -> bool {
        let mut m = self.shared.held.lock();
        let total = m.entry(self.peer).or_default();
        if total.saturating_add(bytes) > self.shared.peer_budget {
            if *total == 0 {
                m.remove(&self.peer);
            }
            return false;
        }
        *total += bytes;
        self.bytes += bytes;
        true
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return;
        }
        let mut m = self.shared.held.lock();
        if let Some(t) = m.get_mut(&self.peer) {
            *t = t.saturating_sub(self.bytes);
            if *t == 0 {
                m.remove(&self.peer);
            }
        }
    }
}
