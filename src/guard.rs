//! What a replica checks in the gradients other replicas send it, and whom it stops
//! listening to. A member's copy of a chunk is rejected when it holds NaN or ±inf, or when
//! its norm per sample is beyond a multiple of the median of that chunk's recent norms; a
//! rejected chunk is reduced without that member. Each round attempt in which a peer sent
//! something rejected is a strike; three strikes ban the peer from the stage's rounds for a
//! period that doubles with every ban. Pure: the caller passes the time.

use libp2p::PeerId;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Norms kept per chunk for the median.
const HISTORY: usize = 16;
/// Norms a chunk needs before the norm check applies.
const MIN_HISTORY: usize = 4;
/// Strikes (round attempts with a rejected message) that ban a peer.
pub const STRIKES: u32 = 3;
/// The first ban's length; each further ban doubles it, up to [`MAX_BAN`].
pub const FIRST_BAN: Duration = Duration::from_secs(30);
/// The longest ban.
pub const MAX_BAN: Duration = Duration::from_secs(3600);

/// A peer's record.
#[derive(Debug, Clone, Default)]
struct Record {
    strikes: u32,
    /// The round attempt of the last strike (one strike per attempt).
    last: Option<(u64, u32)>,
    bans: u32,
    until: Option<Instant>,
    reason: String,
}

/// A banned peer as reported.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Banned {
    /// The peer.
    pub peer: String,
    /// Why (the last rejection).
    pub reason: String,
    /// Seconds left.
    pub seconds_left: f64,
    /// Bans so far, this one included.
    pub bans: u32,
}

/// The checks and the strike book of one averager.
#[derive(Debug, Default)]
pub struct Guard {
    max_norm_ratio: f64,
    /// Norms are of a whole copy, not per sample (outer averaging).
    per_copy: bool,
    norms: HashMap<u32, VecDeque<f64>>,
    records: HashMap<PeerId, Record>,
}

/// `Err(reason)` when `values` hold NaN or ±inf.
pub fn check_finite(values: &[f32]) -> Result<(), String> {
    match values.iter().position(|x| !x.is_finite()) {
        Some(i) => Err(format!("value {i} of the chunk is {}", values[i])),
        None => Ok(()),
    }
}

fn median(v: &VecDeque<f64>) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().collect();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

impl Guard {
    /// Checks with norm ratio `max_norm_ratio` (0: no norm check).
    pub fn new(max_norm_ratio: f64) -> Self {
        Self {
            max_norm_ratio,
            ..Self::default()
        }
    }

    /// The same checks on copies that are each one member's pseudo-gradient (outer
    /// averaging): a copy's norm is compared whole, and zero copies are not recorded.
    pub fn per_copy(self) -> Self {
        Self {
            per_copy: true,
            ..self
        }
    }

    /// Checks a member's copy of chunk `c`: the sum of `count` samples' mean gradients.
    /// An accepted copy's norm joins the chunk's history.
    pub fn check_part(&mut self, c: u32, values: &[f32], count: u64) -> Result<(), String> {
        check_finite(values)?;
        let norm = values
            .iter()
            .map(|&x| f64::from(x) * f64::from(x))
            .sum::<f64>()
            .sqrt();
        if self.per_copy {
            // Outer averaging: a copy is a pseudo-gradient, whatever its samples; the
            // zero copies of the steps between outer steps say nothing of its size.
            if norm == 0.0 {
                return Ok(());
            }
            return self.against_history(c, norm);
        }
        if count == 0 {
            return if norm == 0.0 {
                Ok(())
            } else {
                Err("a nonzero sum of no samples".into())
            };
        }
        self.against_history(c, norm / count as f64)
    }

    /// Checks `per` against chunk `c`'s recent norms and, accepted, records it.
    fn against_history(&mut self, c: u32, per: f64) -> Result<(), String> {
        let h = self.norms.entry(c).or_default();
        if self.max_norm_ratio > 0.0 && h.len() >= MIN_HISTORY {
            let m = median(h);
            if per > self.max_norm_ratio * m {
                return Err(format!(
                    "norm per sample {per:.3e} is over {} × the recent median {m:.3e}",
                    self.max_norm_ratio
                ));
            }
        }
        h.push_back(per);
        while h.len() > HISTORY {
            h.pop_front();
        }
        Ok(())
    }

    /// Counts a strike against `peer` for round attempt `key` (at most one per attempt);
    /// returns whether the peer is banned from now on.
    pub fn strike(&mut self, peer: PeerId, key: (u64, u32), reason: &str, now: Instant) -> bool {
        let r = self.records.entry(peer).or_default();
        r.reason = reason.to_string();
        if r.last == Some(key) {
            return false;
        }
        r.last = Some(key);
        r.strikes += 1;
        if r.strikes < STRIKES {
            return false;
        }
        r.strikes = 0;
        let ban = FIRST_BAN
            .saturating_mul(1u32 << r.bans.min(16))
            .min(MAX_BAN);
        r.bans += 1;
        r.until = Some(now + ban);
        true
    }

    /// Whether `peer` is banned at `now`.
    pub fn is_banned(&self, peer: &PeerId, now: Instant) -> bool {
        self.records
            .get(peer)
            .and_then(|r| r.until)
            .is_some_and(|u| now < u)
    }

    /// The peers banned at `now`.
    pub fn banned(&self, now: Instant) -> Vec<Banned> {
        banned_at(&self.bans(), now)
    }

    /// Every ban given, with when it ends (ended ones too: [`banned_at`] picks those in
    /// force at a later instant).
    pub fn bans(&self) -> Vec<(Banned, Instant)> {
        let mut out: Vec<(Banned, Instant)> = self
            .records
            .iter()
            .filter_map(|(p, r)| {
                let until = r.until?;
                let b = Banned {
                    peer: p.to_string(),
                    reason: r.reason.clone(),
                    seconds_left: 0.0,
                    bans: r.bans,
                };
                Some((b, until))
            })
            .collect();
        out.sort_by(|a, b| a.0.peer.cmp(&b.0.peer));
        out
    }
}

/// The bans of `bans` (from [`Guard::bans`]) in force at `now`, with the seconds left.
pub fn banned_at(bans: &[(Banned, Instant)], now: Instant) -> Vec<Banned> {
    bans.iter()
        .filter(|(_, until)| now < *until)
        .map(|(b, until)| Banned {
            seconds_left: (*until - now).as_secs_f64(),
            ..b.clone()
        })
        .collect()
}

#[cfg(test)]
#[path = "guard_tests.rs"]
mod tests;
