//! What `shoal bench sim` reads of its process and of the swarm besides the samples: the
//! CPU the process used (every simulated peer shares its cores), how many replicas the
//! trainers' last reads found, and what the connections join (stage mates, neighbouring
//! stages, trainers and replicas...). These show where a forming swarm spends its time:
//! a 200-peer swarm that completed no sample for its first ~40 s had both cores busy
//! throughout and trainers that knew no replica of some stage (BENCHMARKS.md, "Stop 55").

use libp2p::PeerId;
use shoal::trainer::TrainerStats;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// CPU seconds (user and system) this process has used, from `/proc/self/stat`; `None`
/// where that cannot be read. Its times count clock ticks of 1/100 s (Linux's `USER_HZ`).
pub fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may hold spaces and ends at the last `)`; after it come
    // field 3 on, so utime and stime (fields 14 and 15) are the 12th and 13th.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i)?.parse::<f64>().ok();
    Some((ticks(11)? + ticks(12)?) / 100.0)
}

/// This process's resident memory, MiB (0 where it cannot be read).
pub fn rss_mib() -> f64 {
    mib(shoal::swarm::events::rss_bytes())
}

/// `bytes` in MiB (0 when unknown).
pub fn mib(bytes: Option<u64>) -> f64 {
    bytes.map_or(0.0, |b| b as f64 / 1048576.0)
}

/// The median of `v` (0 when empty); sorts it.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The median over trainers of the replicas their last read found in their least-found
/// stage: what the trainers route over while the swarm forms.
pub fn known_fewest(trainers: &[Arc<TrainerStats>]) -> f64 {
    let mut fewest: Vec<f64> = trainers
        .iter()
        .map(|t| {
            t.stage_replicas
                .iter()
                .map(|n| n.load(Relaxed))
                .min()
                .unwrap_or(0) as f64
        })
        .collect();
    median(&mut fewest)
}

/// What a peer of the sim is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Seed,
    Trainer,
    /// Serving this stage.
    Stage(usize),
    /// Neither (a stage peer between stages).
    Idle,
}

impl Role {
    /// A seed, a trainer, or a peer serving `stage` (or between stages).
    pub fn of(seed: bool, trainer: bool, stage: Option<usize>) -> Self {
        match (seed, trainer, stage) {
            (true, ..) => Self::Seed,
            (_, true, _) => Self::Trainer,
            (.., Some(s)) => Self::Stage(s),
            _ => Self::Idle,
        }
    }
}

/// Connected pairs of peers by what joins them, each pair once however many connections
/// it holds: `mates` (one stage), `adjacent` (stages s and s + 1: the pipeline's pushes),
/// `other_stages`, `trainer_replica`, `trainer_trainer`, `seed` (either end a seed), and
/// `other` (an end that left or is between stages). `peers`: each live peer's role and
/// the peers it holds connections to.
pub fn relations(peers: &[(PeerId, Role, Vec<PeerId>)]) -> BTreeMap<&'static str, usize> {
    let roles: HashMap<PeerId, Role> = peers.iter().map(|(p, r, _)| (*p, *r)).collect();
    let mut pairs = HashSet::new();
    let mut out = BTreeMap::new();
    for (me, my_role, remotes) in peers {
        for them in remotes {
            let pair = if me < them {
                (*me, *them)
            } else {
                (*them, *me)
            };
            if !pairs.insert(pair) {
                continue;
            }
            let their_role = roles.get(them).copied().unwrap_or(Role::Idle);
            *out.entry(relation(*my_role, their_role)).or_default() += 1;
        }
    }
    out
}

fn relation(a: Role, b: Role) -> &'static str {
    use Role::*;
    match (a, b) {
        (Seed, _) | (_, Seed) => "seed",
        (Trainer, Trainer) => "trainer_trainer",
        (Trainer, Stage(_)) | (Stage(_), Trainer) => "trainer_replica",
        (Stage(x), Stage(y)) if x == y => "mates",
        (Stage(x), Stage(y)) if x.abs_diff(y) == 1 => "adjacent",
        (Stage(_), Stage(_)) => "other_stages",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_connected_pair_counts_once_by_what_joins_it() {
        let ids: Vec<PeerId> = (0..6).map(|_| PeerId::random()).collect();
        let roles = [
            Role::Seed,
            Role::Trainer,
            Role::Stage(0),
            Role::Stage(0),
            Role::Stage(1),
            Role::Stage(3),
        ];
        let gone = PeerId::random();
        // Every peer connected to every other (both ends report), and peer 5 to one that left.
        let peers: Vec<(PeerId, Role, Vec<PeerId>)> = (0..6)
            .map(|i| {
                let mut remotes: Vec<PeerId> = (0..6).filter(|&j| j != i).map(|j| ids[j]).collect();
                if i == 5 {
                    remotes.push(gone);
                }
                (ids[i], roles[i], remotes)
            })
            .collect();
        let r = relations(&peers);
        assert_eq!(r.get("seed"), Some(&5));
        assert_eq!(r.get("trainer_replica"), Some(&4));
        assert_eq!(r.get("mates"), Some(&1));
        // 0–1 twice (peers 2 and 3 with 4); 3 is two from 1, three from 0.
        assert_eq!(r.get("adjacent"), Some(&2));
        assert_eq!(r.get("other_stages"), Some(&3));
        assert_eq!(r.get("other"), Some(&1));
        assert_eq!(r.get("trainer_trainer"), None);
        assert_eq!(r.values().sum::<usize>(), 15 + 1);
    }

    #[test]
    fn this_process_cpu_time_is_read_and_grows() {
        let t0 = std::time::Instant::now();
        let first = cpu_seconds().expect("/proc/self/stat read");
        let mut spin = 0u64;
        while cpu_seconds().is_some_and(|s| s <= first) && t0.elapsed().as_secs() < 5 {
            spin = (0..100_000u64).fold(spin, |a, x| a.wrapping_add(x * x));
        }
        assert!(cpu_seconds().is_some_and(|s| s > first), "spun {spin}");
    }
}
