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

/// The live replicas of each stage as read from a sample of its providers: `per_stage`
/// holds those read and found live, `scale` how many providers each one read stands for
/// (1 where every provider was read). A peer that joins or rebalances in a large swarm
/// reads a few replicas per stage, not all of them (at 200 peers, every joiner reading and
/// calling every replica was ~35,000 lookups and calls while the swarm formed).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sampled {
    /// Per stage, the live replicas read.
    pub per_stage: Vec<Vec<Announcement>>,
    /// Per stage, providers ÷ providers read (≥ 1), or 0 where no provider was found.
    pub scale: Vec<f64>,
    /// Per stage, sampled providers whose announcement could not be read (unknown, not
    /// known dead: a busy DHT's walks time out).
    pub unread: Vec<usize>,
}

impl Sampled {
    /// Every replica read, stage by stage.
    pub fn all(&self) -> impl Iterator<Item = &Announcement> {
        self.per_stage.iter().flatten()
    }

    /// The per-stage loads the sample stands for: replicas and throughput scaled up.
    pub fn loads(&self) -> Vec<StageLoad> {
        let mut out = loads(
            self.per_stage.len(),
            &self.all().cloned().collect::<Vec<_>>(),
        );
        for (l, k) in out.iter_mut().zip(&self.scale) {
            l.replicas = (l.replicas as f64 * k).round() as usize;
            l.total *= k;
        }
        out
    }

    /// The throughputs of every replica the sample stands for (those read, repeated as
    /// the scale says).
    pub fn throughputs(&self) -> Vec<f64> {
        let mut out = Vec::new();
        for (anns, k) in self.per_stage.iter().zip(&self.scale) {
            let n = (anns.len() as f64 * k).round() as usize;
            out.extend(anns.iter().cycle().take(n).map(|a| a.samples_per_s));
        }
        out
    }
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

/// [`weakest`], with ties (equal totals and replica counts) broken by `pick` (a number
/// that differs between peers) instead of the lower index.
pub fn weakest_of(loads: &[StageLoad], pick: usize) -> Option<usize> {
    let w = loads.iter().find(|l| Some(l.stage) == weakest(loads))?;
    let tied: Vec<usize> = loads
        .iter()
        .filter(|l| l.total == w.total && l.replicas == w.replicas)
        .map(|l| l.stage)
        .collect();
    tied.get(pick % tied.len().max(1)).copied()
}

/// Balance quality below which peers move: the swarm's minimum stage throughput over the
/// best minimum its replicas could reach (Petals uses the same 0.75).
pub const BALANCE_QUALITY: f64 = 0.75;

/// The lowest stage total: what bounds the swarm's samples/s.
pub fn min_total(loads: &[StageLoad]) -> f64 {
    loads.iter().map(|l| l.total).fold(f64::INFINITY, f64::min)
}

/// The best minimum stage total the swarm's replicas (their announced throughputs) could
/// reach over `stages` stages, as the greedy largest-first placement finds it: each
/// replica, fastest first, goes to the stage with the lowest total so far.
pub fn ideal_min(stages: usize, throughputs: &[f64]) -> f64 {
    if stages == 0 {
        return 0.0;
    }
    let mut sorted: Vec<f64> = throughputs
        .iter()
        .copied()
        .filter(|t| t.is_finite())
        .collect();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let mut totals = vec![0.0f64; stages];
    for t in sorted {
        if let Some(low) = totals.iter_mut().min_by(|a, b| a.total_cmp(b)) {
            *low += t;
        }
    }
    totals.into_iter().fold(f64::INFINITY, f64::min)
}

/// Where a peer serving `mine` with throughput `my_tp` should move, if anywhere;
/// `throughputs` are those of every live replica (this one included).
///
/// It moves to the weakest stage only when all of these hold:
/// - its stage keeps at least one other replica (a stage is never emptied);
/// - the swarm is unbalanced: the minimum stage total is below `quality` × the best
///   reachable minimum ([`ideal_min`] of every replica's throughput);
/// - the move strictly evens the stages: what its stage keeps (`total − my_tp`) stays above
///   what the target had, by a margin of 5% of `my_tp`. Each move then lowers the sum of
///   squared stage totals by at least `0.1 · my_tp²`, so a swarm whose announcements are
///   current cannot move back and forth forever (no flapping).
pub fn rebalance(
    loads: &[StageLoad],
    throughputs: &[f64],
    mine: usize,
    my_tp: f64,
    quality: f64,
) -> Option<usize> {
    let me = loads.get(mine)?;
    if me.replicas < 2 || !my_tp.is_finite() || my_tp <= 0.0 {
        return None;
    }
    let target = weakest(loads)?;
    if target == mine {
        return None;
    }
    let t = &loads[target];
    if me.total - my_tp <= t.total + 0.05 * my_tp {
        return None;
    }
    let ideal = ideal_min(loads.len(), throughputs);
    if ideal <= 0.0 || min_total(loads) >= quality * ideal {
        return None;
    }
    Some(target)
}

/// The share of stage `mine`'s replicas that should move to `target` to even the two:
/// the moves needed (each takes `my_tp` from one and gives it to the other) over the
/// replicas of `mine`, at most 1. When every replica of an over-full stage saw the same
/// weakest stage and moved, they piled up there (200 peers: 61 replicas on one stage of
/// four after 46 moves); each now moves with this probability.
pub fn move_share(loads: &[StageLoad], mine: usize, target: usize, my_tp: f64) -> f64 {
    let (Some(m), Some(t)) = (loads.get(mine), loads.get(target)) else {
        return 0.0;
    };
    if m.replicas == 0 || !my_tp.is_finite() || my_tp <= 0.0 {
        return 0.0;
    }
    let needed = ((m.total - t.total) / (2.0 * my_tp)).ceil().max(1.0);
    (needed / m.replicas as f64).min(1.0)
}

/// Which empty stage, if any, this peer (`me`) should move to: the swarm cannot train
/// while a stage has nobody. `placed` is every serving peer's (id, stage), this one
/// included. Every stage with two replicas or more keeps its lowest id; the others are
/// the surplus, in id order, and the k-th of them fills the k-th empty stage. Every peer
/// computes the same answer from the same view, so peers that started together (and all
/// chose the same stage before anyone had announced) spread out at once, without a herd.
pub fn fill_empty(stages: usize, placed: &[(String, usize)], me: &str) -> Option<usize> {
    let (empty, surplus) = holes(stages, placed);
    let k = surplus.iter().position(|p| *p == me)?;
    empty.get(k).copied()
}

/// Whether [`fill_empty`] would move someone: a stage is empty and another has a replica
/// to spare.
pub fn fillable(stages: usize, placed: &[(String, usize)]) -> bool {
    let (empty, surplus) = holes(stages, placed);
    !empty.is_empty() && !surplus.is_empty()
}

/// (the empty stages, the surplus replicas in id order: all but the lowest id of each
/// stage).
fn holes(stages: usize, placed: &[(String, usize)]) -> (Vec<usize>, Vec<&str>) {
    let mut by_stage: Vec<Vec<&str>> = vec![Vec::new(); stages];
    for (peer, s) in placed {
        if let Some(v) = by_stage.get_mut(*s) {
            if !v.contains(&peer.as_str()) {
                v.push(peer.as_str());
            }
        }
    }
    let empty: Vec<usize> = (0..stages).filter(|&s| by_stage[s].is_empty()).collect();
    let mut surplus: Vec<&str> = by_stage
        .iter_mut()
        .flat_map(|v| {
            v.sort_unstable();
            v.iter().skip(1).copied()
        })
        .collect();
    surplus.sort_unstable();
    (empty, surplus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crowded_stage_sends_only_the_share_that_evens_it() {
        let load = |stage, replicas: usize| StageLoad {
            stage,
            replicas,
            total: 10.0 * replicas as f64,
        };
        // 60 against 30 replicas of 10 samples/s: 15 moves even them, a quarter of 60.
        let loads = [load(0, 60), load(1, 30)];
        assert!((move_share(&loads, 0, 1, 10.0) - 0.25).abs() < 1e-9);
        // Four against one: two moves of four.
        let loads = [load(0, 4), load(1, 1)];
        assert!((move_share(&loads, 0, 1, 10.0) - 0.5).abs() < 1e-9);
        // At least one move, never more than everyone.
        assert!((move_share(&[load(0, 3), load(1, 3)], 0, 1, 10.0) - 1.0 / 3.0).abs() < 1e-9);
        assert_eq!(move_share(&[load(0, 1), load(1, 0)], 0, 1, 1e-3), 1.0);
        assert_eq!(move_share(&loads, 0, 7, 10.0), 0.0);
        assert_eq!(move_share(&loads, 0, 1, f64::NAN), 0.0);
    }

    fn ann(peer: &str, stage: u32, samples_per_s: f64) -> Announcement {
        Announcement {
            samples_per_s,
            ..Announcement::for_tests(peer, stage)
        }
    }

    #[test]
    fn a_sample_stands_for_the_whole_stage() {
        // Stage 0: 2 of 8 providers read (scale 4); stage 1: all 3 read.
        let s = Sampled {
            per_stage: vec![
                vec![ann("a", 0, 10.0), ann("b", 0, 20.0)],
                vec![ann("c", 1, 5.0), ann("d", 1, 5.0), ann("e", 1, 5.0)],
            ],
            scale: vec![4.0, 1.0],
            unread: Vec::new(),
        };
        let l = s.loads();
        assert_eq!((l[0].replicas, l[0].total), (8, 120.0));
        assert_eq!((l[1].replicas, l[1].total), (3, 15.0));
        assert_eq!(weakest(&l), Some(1));
        let tps = s.throughputs();
        assert_eq!(tps.len(), 11);
        assert!((tps.iter().sum::<f64>() - 135.0).abs() < 1e-9);
        assert_eq!(s.all().count(), 5);
    }

    #[test]
    fn ties_for_the_weakest_stage_are_broken_by_the_pick() {
        let load = |stage, replicas, total| StageLoad {
            stage,
            replicas,
            total,
        };
        let l = [load(0, 1, 50.0), load(1, 0, 0.0), load(2, 0, 0.0)];
        assert_eq!(super::weakest_of(&l, 0), Some(1));
        assert_eq!(super::weakest_of(&l, 1), Some(2));
        assert_eq!(super::weakest_of(&l, 7), Some(2));
        let l = [load(0, 1, 50.0), load(1, 0, 0.0), load(2, 1, 0.0)];
        assert_eq!(super::weakest_of(&l, 1), Some(1));
    }

    #[test]
    fn empty_stages_are_filled_by_the_surplus_in_id_order() {
        let placed = |v: &[(&str, usize)]| -> Vec<(String, usize)> {
            v.iter().map(|(p, s)| (p.to_string(), *s)).collect()
        };
        // Three peers on stage 0 of 3: a stays, b fills 1, c fills 2.
        let all0 = placed(&[("c", 0), ("a", 0), ("b", 0)]);
        assert_eq!(super::fill_empty(3, &all0, "a"), None);
        assert_eq!(super::fill_empty(3, &all0, "b"), Some(1));
        assert_eq!(super::fill_empty(3, &all0, "c"), Some(2));
        assert!(super::fillable(3, &all0));
        // More surplus than holes: only the first moves.
        let two = placed(&[("a", 0), ("b", 0), ("c", 1), ("d", 1)]);
        let moved: Vec<_> = ["a", "b", "c", "d"]
            .iter()
            .map(|p| super::fill_empty(3, &two, p))
            .collect();
        assert_eq!(moved, [None, Some(2), None, None]);
        // No empty stage, or nobody to spare: nobody moves.
        let full = placed(&[("a", 0), ("b", 1), ("c", 1)]);
        assert!(["a", "b", "c"]
            .iter()
            .all(|p| super::fill_empty(2, &full, p).is_none()));
        let thin = placed(&[("a", 0), ("b", 1)]);
        assert!(["a", "b"]
            .iter()
            .all(|p| super::fill_empty(3, &thin, p).is_none()));
        assert!(!super::fillable(2, &full) && !super::fillable(3, &thin));
    }

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

    /// Loads of peers with these throughputs per stage.
    fn swarm(stages: &[&[f64]]) -> (Vec<StageLoad>, Vec<f64>) {
        let loads = stages
            .iter()
            .enumerate()
            .map(|(i, tps)| load(i, tps.len(), tps.iter().sum()))
            .collect();
        (
            loads,
            stages.iter().flat_map(|t| t.iter().copied()).collect(),
        )
    }

    /// Applies one move of the peer with throughput `tp` from `from` to `to`.
    fn apply(stages: &mut [Vec<f64>], from: usize, to: usize, tp: f64) {
        let pos = stages[from].iter().position(|&t| t == tp).unwrap();
        stages[from].remove(pos);
        stages[to].push(tp);
    }

    #[test]
    fn ideal_places_fastest_first() {
        assert_eq!(ideal_min(3, &[1.0; 6]), 2.0);
        assert_eq!(ideal_min(2, &[4.0, 1.0, 1.0, 1.0]), 3.0);
        assert_eq!(ideal_min(2, &[1.0]), 0.0);
        assert_eq!(ideal_min(0, &[1.0]), 0.0);
    }

    #[test]
    fn four_on_one_stage_spread_in_two_moves_and_then_stay() {
        let mut stages = vec![vec![1.0; 4], vec![1.0], vec![1.0]];
        let mut moves = 0;
        // Every peer checks in turn, many rounds: the swarm settles and then nobody moves.
        for _round in 0..10 {
            for s in 0..stages.len() {
                for i in 0..stages[s].len() {
                    let (loads, tps) =
                        swarm(&stages.iter().map(|v| v.as_slice()).collect::<Vec<_>>());
                    if i >= stages[s].len() {
                        break;
                    }
                    let tp = stages[s][i];
                    if let Some(to) = rebalance(&loads, &tps, s, tp, BALANCE_QUALITY) {
                        apply(&mut stages, s, to, tp);
                        moves += 1;
                    }
                }
            }
        }
        assert_eq!(moves, 2);
        assert!(stages.iter().all(|s| s.len() == 2), "{stages:?}");
    }

    #[test]
    fn never_empties_a_stage_nor_moves_without_gain() {
        // Alone on its stage: stays, however strong it is.
        let (loads, tps) = swarm(&[&[10.0], &[1.0, 1.0]]);
        assert_eq!(rebalance(&loads, &tps, 0, 10.0, BALANCE_QUALITY), None);
        // [2, 1] peers: moving would only mirror the imbalance.
        let (loads, tps) = swarm(&[&[1.0, 1.0], &[1.0]]);
        assert_eq!(rebalance(&loads, &tps, 0, 1.0, BALANCE_QUALITY), None);
        // Balanced enough (quality 0.8 ≥ 0.75): stays.
        let (loads, tps) = swarm(&[&[1.0, 1.0, 1.0], &[1.0, 0.6]]);
        assert_eq!(rebalance(&loads, &tps, 0, 1.0, BALANCE_QUALITY), None);
        // Already on the weakest stage: stays.
        let (loads, tps) = swarm(&[&[1.0, 1.0, 1.0], &[1.0]]);
        assert_eq!(rebalance(&loads, &tps, 1, 1.0, BALANCE_QUALITY), None);
        // An empty stage pulls a replica from a stage with two.
        let (loads, tps) = swarm(&[&[1.0, 1.0], &[]]);
        assert_eq!(rebalance(&loads, &tps, 0, 1.0, BALANCE_QUALITY), Some(1));
    }

    #[test]
    fn heterogeneous_moves_the_peer_that_fits() {
        // Stage 0 holds a fast and a slow peer, stage 1 one medium one: the fast peer would
        // leave too little behind, the slow one moves.
        let (loads, tps) = swarm(&[&[4.0, 1.0], &[1.5]]);
        assert_eq!(rebalance(&loads, &tps, 0, 4.0, BALANCE_QUALITY), None);
        assert_eq!(rebalance(&loads, &tps, 0, 1.0, BALANCE_QUALITY), Some(1));
    }

    #[test]
    fn random_swarms_settle_without_flapping() {
        let mut rng = crate::rng::Rng::new(11);
        for _case in 0..200 {
            let n_stages = 2 + (rng.next_u64() % 3) as usize;
            let mut stages: Vec<Vec<f64>> = vec![Vec::new(); n_stages];
            for _ in 0..(n_stages + (rng.next_u64() % 8) as usize) {
                let s = (rng.next_u64() % n_stages as u64) as usize;
                stages[s].push(1.0 + (rng.next_u64() % 4) as f64);
            }
            let mut moves = 0;
            let mut settled = false;
            for _round in 0..100 {
                let mut moved = false;
                for s in 0..n_stages {
                    let mut i = 0;
                    while i < stages[s].len() {
                        let (loads, tps) =
                            swarm(&stages.iter().map(|v| v.as_slice()).collect::<Vec<_>>());
                        let tp = stages[s][i];
                        if let Some(to) = rebalance(&loads, &tps, s, tp, BALANCE_QUALITY) {
                            let before = loads.iter().filter(|l| l.replicas > 0).count();
                            apply(&mut stages, s, to, tp);
                            let after = stages.iter().filter(|v| !v.is_empty()).count();
                            assert!(after >= before, "a move emptied a stage");
                            moves += 1;
                            moved = true;
                        } else {
                            i += 1;
                        }
                    }
                }
                if !moved {
                    settled = true;
                    break;
                }
            }
            assert!(settled, "no fixed point after {moves} moves: {stages:?}");
        }
    }
}
