//! Pure choices over the announced swarm: which stage a new peer serves, which is the
//! bottleneck. No I/O: the inputs are announcements, so tests need no sockets.

use crate::dht::Announcement;

/// What the swarm has on one stage.
#[derive(Debug, Clone, PartialEq)]
pub struct StageLoad {
    /// The stage.
    pub stage: usize,
    /// Live replicas.
    pub replicas: usize,
    /// Sum of their announced samples/s.
    pub total: f64,
}

/// Per-stage loads of a run with `stages` stages (announcements of other stages ignored).
pub fn loads(stages: usize, anns: &[Announcement]) -> Vec<StageLoad> {
    let mut out: Vec<StageLoad> = (0..stages)
        .map(|stage| StageLoad {
            stage,
            replicas: 0,
            total: 0.0,
        })
        .collect();
    for a in anns {
        if let Some(l) = out.get_mut(a.stage as usize) {
            l.replicas += 1;
            l.total += a.samples_per_s;
        }
    }
    out
}

/// The weakest stage: lowest total throughput; ties go to fewer replicas, then the lower
/// index. This is where a new peer helps most, and what limits the swarm.
pub fn weakest(loads: &[StageLoad]) -> Option<usize> {
    loads
        .iter()
        .min_by(|a, b| {
            a.total
                .total_cmp(&b.total)
                .then(a.replicas.cmp(&b.replicas))
                .then(a.stage.cmp(&b.stage))
        })
        .map(|l| l.stage)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(stage: usize, replicas: usize, total: f64) -> StageLoad {
        StageLoad {
            stage,
            replicas,
            total,
        }
    }

    #[test]
    fn picks_lowest_throughput_then_fewest_replicas_then_index() {
        assert_eq!(weakest(&[load(0, 1, 10.0), load(1, 1, 5.0)]), Some(1));
        assert_eq!(weakest(&[load(0, 2, 5.0), load(1, 1, 5.0)]), Some(1));
        assert_eq!(weakest(&[load(0, 1, 5.0), load(1, 1, 5.0)]), Some(0));
        assert_eq!(weakest(&[load(0, 0, 0.0), load(1, 0, 0.0)]), Some(0));
        assert_eq!(weakest(&[]), None);
    }
}
