//! What each peer of `shoal bench sim` is given: the run it serves, where it listens, its
//! home link (drawn from a spread), and whether it is publicly reachable (and so serves the
//! DHT) or a home machine behind NAT (a DHT client, which its stage mates and trainers
//! still reach directly, as after a hole punch).

use libp2p::multiaddr::Protocol;
use libp2p::Multiaddr;
use shoal::config::{RunConfig, StageKind};
use shoal::net::link::LinkSpec;
use shoal::rng::Rng;
use std::time::Duration;

/// Samples per microbatch.
const MICROBATCH: usize = 4;

/// Samples per optimizer step: a step every ~10 s.
const TARGET_BATCH: usize = 1024;

/// The run: the tiny model's tensor sizes in `stages` sim stages, each stage's replicas
/// together doing `rate` samples/s.
pub fn sim_run(stages: usize, replicas_per_stage: f64, rate: f64) -> RunConfig {
    let mut cfg = RunConfig::tiny();
    cfg.model.n_layers = stages.max(1);
    cfg.stages.count = stages;
    cfg.stages.cuts.clear();
    cfg.stages.kind = StageKind::Sim;
    cfg.stages.sim_ms_per_sample = Some(1e3 * replicas_per_stage / rate);
    cfg.training.batch_size = MICROBATCH;
    cfg.training.steps = 1_000_000;
    cfg.training.target_batch_size = Some(TARGET_BATCH);
    cfg
}

/// A home link drawn from the spread: up and down log-uniform in 20–500 Mbit/s, the round
/// trip uniform in 10–150 ms.
pub fn draw_link(rng: &mut Rng) -> LinkSpec {
    let mbit = |rng: &mut Rng| 20.0 * (500.0f64 / 20.0).powf(rng.next_f64()) * 1e6 / 8.0;
    LinkSpec {
        up: Some(mbit(rng)),
        down: Some(mbit(rng)),
        rtt: Duration::from_millis(10 + rng.below(141)),
    }
}

/// Where a peer listens: libp2p's in-process memory transport, or TCP on 127.0.0.1.
pub fn listen_addr(tcp: bool) -> Multiaddr {
    if tcp {
        Multiaddr::from(std::net::Ipv4Addr::LOCALHOST).with(Protocol::Tcp(0))
    } else {
        Multiaddr::empty().with(Protocol::Memory(0))
    }
}

/// Whether the peer of `slot` is publicly reachable when a `fraction` of peers are: every
/// slot at which the running count of public peers (`slot × fraction`, rounded down)
/// steps up, so they spread evenly over the seeds', trainers' and stage peers' slots, and
/// over the peers that churn brings in.
pub fn is_public(slot: usize, fraction: f64) -> bool {
    let f = fraction.clamp(0.0, 1.0);
    ((slot + 1) as f64 * f).floor() > (slot as f64 * f).floor()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_peers_are_the_asked_fraction_spread_evenly() {
        let public: Vec<usize> = (0..200).filter(|&s| is_public(s, 0.2)).collect();
        assert_eq!(public.len(), 40);
        assert!(public.windows(2).all(|w| w[1] - w[0] == 5), "{public:?}");
        assert_eq!((0..200).filter(|&s| is_public(s, 1.0)).count(), 200);
        assert_eq!((0..200).filter(|&s| is_public(s, 0.0)).count(), 0);
        assert_eq!((0..1000).filter(|&s| is_public(s, 0.3)).count(), 300);
    }

    #[test]
    fn links_fall_in_the_spread() {
        let mut rng = Rng::new(7);
        for _ in 0..1000 {
            let l = draw_link(&mut rng);
            for rate in [l.up, l.down] {
                let mbit = rate.unwrap_or(0.0) * 8.0 / 1e6;
                assert!((20.0..=500.0).contains(&mbit), "{mbit}");
            }
            assert!((10..=150).contains(&l.rtt.as_millis()), "{:?}", l.rtt);
        }
    }
}
