//! How a replica learns its stage mates without reading each one's announcement from the
//! DHT: to a replica it hears from for the first time it sends `Mates` (the mates it knows,
//! with the addresses it knows them at); a replica that receives one adds them, and counts
//! them as heard for [`INTRODUCED_FOR`], so its membership read keeps those that provide
//! the stage without reading their records. A replica that joins a stage of 45 reads
//! [`MEMBER_READS`] announcements, not 44 (177 replicas joining 4 stages together read
//! 7,800).

use super::actor::State;
use super::send::Outgoing;
use crate::stage::registry;
use crate::wire::msg::{AvgMsg, MAX_MATES};
use libp2p::{Multiaddr, PeerId};
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Addresses sent per mate, at most.
const ADDRS_PER_MATE: usize = 2;

/// How long an introduced mate counts as heard without a word from it (it hears of this
/// replica's progress and answers within a heartbeat or two).
const INTRODUCED_FOR: Duration = Duration::from_secs(60);

/// Announcements of unheard providers a membership read fetches from the DHT, at most.
const MEMBER_READS: usize = 4;

/// The longest wait between membership reads that find no new mate ([`membership_wait`]).
const QUIET_MEMBERSHIP: Duration = Duration::from_secs(60);

/// The wait before the next membership read after `quiet` reads in a row that found no
/// mate not known before: `every`, doubled per such read, up to [`QUIET_MEMBERSHIP`] (or
/// `every` if longer). A joiner still meets its mates at once (it reads at its start, and
/// it calls them; they hear it), and a mate that died drops out at the next read. While 200
/// peers joined at once, 177 replicas reading every 2 s (each read a DHT walk of ~40
/// requests) were a third of the swarm's provider walks.
pub(super) fn membership_wait(every: Duration, quiet: u32) -> Duration {
    every
        .saturating_mul(1 << quiet.min(16))
        .min(QUIET_MEMBERSHIP.max(every))
}

impl State {
    /// Sends `to`, heard from for the first time, the mates this replica knows.
    pub(super) fn introduce(&self, to: PeerId) {
        let mut mates: Vec<PeerId> = self.others().into_iter().filter(|p| *p != to).collect();
        mates.truncate(MAX_MATES);
        if mates.is_empty() {
            return;
        }
        let net = self.client.net().clone();
        let outbox = self.outbox.clone();
        let stats = Arc::clone(&self.stats);
        tokio::spawn(async move {
            let Ok(known) = net.addresses_of(mates).await else {
                return;
            };
            let (peers, addrs) = known
                .into_iter()
                .map(|(p, a)| {
                    let a = a.iter().take(ADDRS_PER_MATE).map(|x| x.to_string());
                    (p.to_string(), a.collect())
                })
                .unzip();
            let msg = AvgMsg::Mates { peers, addrs };
            if outbox.try_send(Outgoing { peer: to, msg }).is_err() {
                stats.dropped_sends.fetch_add(1, Ordering::Relaxed);
            }
        });
    }

    /// Takes the mates another replica introduced: where to reach them, and that they are
    /// mates until the next membership read says whether they provide the stage.
    pub(super) async fn on_mates(&mut self, peers: &[String], addrs: &[Vec<String>]) {
        let now = Instant::now();
        for (p, a) in peers.iter().zip(addrs).take(MAX_MATES) {
            let Ok(p) = p.parse::<PeerId>() else {
                continue;
            };
            if p == self.me || self.known.contains(&p) {
                continue;
            }
            let a: Vec<Multiaddr> = a
                .iter()
                .take(ADDRS_PER_MATE)
                .filter_map(|x| x.parse().ok())
                .collect();
            if a.is_empty() {
                continue;
            }
            let _ = self.client.net().add_addresses(p, a).await;
            self.known.push(p);
            self.introduced.insert(p, now);
        }
    }

    /// Reads the stage's replicas in the background ([`registry::stage_members`]); they
    /// come through `tx`.
    pub(super) fn look_up_members(
        &mut self,
        cache: &registry::AnnCache,
        tx: mpsc::Sender<Vec<(PeerId, Vec<Multiaddr>)>>,
    ) -> tokio::task::JoinHandle<()> {
        let net = self.client.net().clone();
        let (run, stage) = (self.client.run().to_string(), self.stage);
        let (cache, heard) = (cache.clone(), self.vouched());
        tokio::spawn(async move {
            let read = registry::stage_members(&net, &run, stage, &heard, &cache, MEMBER_READS);
            if let Ok(m) = read.await {
                let _ = tx.try_send(m);
            }
        })
    }

    /// Forgets the mates that answered from another stage lately (they moved away).
    pub(super) fn forget_moved(&mut self) {
        for p in self.moved.recent() {
            self.known.retain(|k| *k != p);
            self.views.remove(&p);
            self.introduced.remove(&p);
        }
    }

    /// The mates a membership read counts as heard: heard from, or introduced lately.
    fn vouched(&mut self) -> HashSet<PeerId> {
        let now = Instant::now();
        self.introduced
            .retain(|_, t| now.duration_since(*t) < INTRODUCED_FOR);
        self.views
            .keys()
            .chain(self.introduced.keys())
            .copied()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn membership_reads_that_find_no_one_new_come_less_and_less_often() {
        let every = Duration::from_secs(2);
        let waits: Vec<u64> = (0..7)
            .map(|q| membership_wait(every, q).as_secs())
            .collect();
        assert_eq!(waits, [2, 4, 8, 16, 32, 60, 60]);
        // A stage of many mates reads rarely anyway: never more often than its own period.
        let slow = Duration::from_secs(90);
        assert_eq!(membership_wait(slow, 0), slow);
        assert_eq!(membership_wait(slow, 5), slow);
    }
}
