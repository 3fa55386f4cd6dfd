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
            expires_ms: now + self.ttl.as_millis() as u64,
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
        registry::announce(&self.net, &ann, self.ttl, provide).await?;
        *self.last.lock() = Some(ann);
        Ok(())
    }

    /// Announces again every third of the TTL, for as long as the task lives.
    pub(super) async fn run(self) {
        let period = (self.ttl / 3).max(Duration::from_millis(200));
        loop {
            tokio::time::sleep(period).await;
            if let Err(e) = self.once(false).await {
                tracing::warn!(target: "shoal::peer", "cannot refresh the announcement: {e}");
            }
        }
    }
}
