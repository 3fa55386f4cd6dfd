//! A served stage's announcement: built from the replica's state (step, queue, parameter
//! hash, banned stage mates, measured uplink) and refreshed in the DHT well before it
//! expires, so trainers and joiners see the replica as it is.

use crate::dht::{self, Announcement, Manifest};
use crate::net::{NetError, NetHandle};
use crate::stage::registry;
use crate::stage::service::StageService;
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// An announcement lives at least this long per stage mate. Each refresh is a DHT walk and
/// twenty stores: 180 replicas re-announcing every 10 s were 18 puts a second, about 800
/// DHT requests a second across the swarm. With many mates one replica's announcement being
/// a minute old (or a dead one's lingering) matters little, and trainers and stage mates
/// learn of deaths from calls and heartbeats, not from expiry: 45 mates announce every 45 s
/// (TTL 135 s); 3 mates keep the default 30 s.
pub const TTL_PER_MATE: Duration = Duration::from_secs(3);

/// When a replica provides its stage key a second time. The first provide goes to the
/// peers closest to the key as the replica's routing table had them at once, while it
/// joined: when 200 peers joined at once those were often not the closest, and trainers'
/// provider walks then found 4–9 of a stage's ~26 replicas (routing all their work to
/// those); provided again once the tables filled, they found 14–15 a walk and knew 20–45.
/// (Kademlia republishes on its own only every third of the provider TTL, a minute.)
pub const REPROVIDE_AFTER: Duration = Duration::from_secs(8);

/// What a served stage announces, and where it keeps its latest announcement.
pub(super) struct Refresh {
    pub(super) avg: Arc<crate::averaging::AvgStats>,
    pub(super) net: NetHandle,
    pub(super) service: Arc<StageService>,
    pub(super) manifest: Manifest,
    pub(super) device: String,
    pub(super) samples_per_s: f64,
    pub(super) ttl: Duration,
    pub(super) last: Arc<Mutex<Option<Announcement>>>,
}

impl Refresh {
    /// Announces the replica as it is now (and hands the same text to `info` calls); the
    /// first time (`provide`) also as a provider of its stage.
    pub(super) async fn once(&self, provide: bool) -> Result<(), NetError> {
        let addrs = self.net.listen_addrs().await?;
        let now = dht::now_ms();
        let ttl = self.ttl_now();
        let ann = Announcement {
            v: dht::record::ANN_VERSION,
            run: self.manifest.id.clone(),
            peer: self.net.local_peer_id().to_string(),
            addrs: addrs
                .iter()
                .take(dht::record::MAX_ADDRS)
                .map(|a| a.to_string())
                .collect(),
            stage: self.service.stage() as u32,
            stages: self.manifest.config.stages.count as u32,
            step: self.service.step(),
            samples_per_s: self.samples_per_s,
            device: self.device.clone(),
            queue: self.service.queue_len(),
            queue_cap: self.service.queue_cap(),
            params_hash: self.service.params_hash().to_string(),
            issued_ms: now,
            expires_ms: now + ttl.as_millis() as u64,
            banned: self
                .avg
                .banned_at(Instant::now())
                .into_iter()
                .take(dht::record::MAX_BANNED)
                .map(|b| dht::record::BanNote {
                    peer: b.peer,
                    reason: b.reason.chars().take(100).collect(),
                })
                .collect(),
            uplink: self.avg.uplink.load(std::sync::atomic::Ordering::Relaxed),
        };
        self.service
            .set_info(String::from_utf8_lossy(&ann.to_bytes()).into_owned());
        *self.last.lock() = Some(ann.clone());
        registry::announce(&self.net, &ann, ttl, provide).await
    }

    /// The TTL of the next announcement: the configured one, or [`TTL_PER_MATE`] per stage
    /// mate where that is longer.
    fn ttl_now(&self) -> Duration {
        let mates = self.avg.mates.load(std::sync::atomic::Ordering::Relaxed);
        self.ttl.max(TTL_PER_MATE * mates.min(1000) as u32)
    }

    /// Announces the replica as a provider of its stage, then again every third of the
    /// TTL, for as long as the task lives; the first re-announcement comes after at most
    /// [`REPROVIDE_AFTER`] and provides the stage again.
    pub(super) async fn run(self) {
        if let Err(e) = self.once(true).await {
            tracing::warn!(target: "shoal::peer", "cannot announce the replica: {e}");
        }
        let mut first = true;
        loop {
            let period = (self.ttl_now() / 3).max(Duration::from_millis(200));
            // (A short TTL re-announces sooner; the second provide then comes with it.)
            let period = if first {
                period.min(REPROVIDE_AFTER)
            } else {
                period
            };
            tokio::time::sleep(period).await;
            if let Err(e) = self.once(first).await {
                tracing::warn!(target: "shoal::peer", "cannot refresh the announcement: {e}");
            }
            first = false;
        }
    }
}
