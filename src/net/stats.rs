//! How long this peer's DHT lookups took: a fixed log-scale histogram of the durations of
//! record and provider gets, shared by every clone of a [`super::NetHandle`], and how many
//! DHT requests of each kind the peer answered. Benchmarks of large swarms read its
//! quantiles (`shoal bench sim`'s `lookup_p99_ms`) and rates; its memory is fixed whatever
//! the number of lookups.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Buckets: bucket `i` holds durations up to `FIRST_MS × GROWTH^i` ms; the last holds
/// everything longer (about 10 minutes and up).
const BUCKETS: usize = 64;
const FIRST_MS: f64 = 0.5;
const GROWTH: f64 = 1.25;

/// The kinds of DHT requests a peer answers, in [`LookupCounts::served`]'s order.
pub const SERVED_KINDS: [&str; 5] = [
    "find_node",
    "get_providers",
    "add_provider",
    "get_record",
    "put_record",
];

/// The kinds of DHT walks a peer starts, in [`LookupCounts::walks`]'s order: its own
/// record gets, provider gets, record puts and provides, the bootstraps it asks for, and
/// those Kademlia starts on its own (every few minutes, and while its table is small).
pub const WALK_KINDS: [&str; 6] = [
    "get_record",
    "get_providers",
    "put_record",
    "provide",
    "bootstrap",
    "auto_bootstrap",
];

/// A kind of DHT walk, as counted ([`LookupStats::walked`]; named by [`WALK_KINDS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Walk {
    /// A record get.
    GetRecord,
    /// A provider get.
    GetProviders,
    /// A record put.
    PutRecord,
    /// A provide.
    Provide,
    /// A bootstrap this peer asked for.
    Bootstrap,
    /// A bootstrap Kademlia started on its own.
    AutoBootstrap,
}

/// Durations of DHT lookups, walks started and requests answered.
#[derive(Debug)]
pub struct LookupStats {
    counts: [AtomicU64; BUCKETS],
    total_us: AtomicU64,
    served: [AtomicU64; SERVED_KINDS.len()],
    walks: [AtomicU64; WALK_KINDS.len()],
}

impl Default for LookupStats {
    fn default() -> Self {
        Self {
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            total_us: AtomicU64::new(0),
            served: std::array::from_fn(|_| AtomicU64::new(0)),
            walks: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

/// Upper edge of bucket `i`, in ms.
fn edge_ms(i: usize) -> f64 {
    FIRST_MS * GROWTH.powi(i as i32)
}

impl LookupStats {
    /// Counts one lookup that took `d`.
    pub fn record(&self, d: Duration) {
        let ms = d.as_secs_f64() * 1e3;
        let i = (0..BUCKETS - 1)
            .find(|&i| ms <= edge_ms(i))
            .unwrap_or(BUCKETS - 1);
        self.counts[i].fetch_add(1, Relaxed);
        self.total_us.fetch_add(d.as_micros() as u64, Relaxed);
    }

    /// Counts one DHT request this peer answers, by kind.
    pub fn served(&self, r: &libp2p::kad::InboundRequest) {
        use libp2p::kad::InboundRequest as R;
        let i = match r {
            R::FindNode { .. } => 0,
            R::GetProvider { .. } => 1,
            R::AddProvider { .. } => 2,
            R::GetRecord { .. } => 3,
            R::PutRecord { .. } => 4,
        };
        self.served[i].fetch_add(1, Relaxed);
    }

    /// Counts one DHT walk this peer started.
    pub fn walked(&self, kind: Walk) {
        self.walks[kind as usize].fetch_add(1, Relaxed);
    }

    /// The counts so far, to be subtracted from a later reading or summed with other
    /// peers' ([`LookupCounts`]).
    pub fn snapshot(&self) -> LookupCounts {
        LookupCounts {
            counts: self.counts.iter().map(|c| c.load(Relaxed)).collect(),
            total_us: self.total_us.load(Relaxed),
            served: self.served.iter().map(|c| c.load(Relaxed)).collect(),
            walks: self.walks.iter().map(|c| c.load(Relaxed)).collect(),
        }
    }
}

/// Adds `b` into `a` element by element (`a` grown to `b`'s length).
fn add_into(a: &mut Vec<u64>, b: &[u64]) {
    if a.len() < b.len() {
        a.resize(b.len(), 0);
    }
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

/// `a − b` element by element, at least 0 (`b` missing counts as 0).
fn minus(a: &[u64], b: &[u64]) -> Vec<u64> {
    a.iter()
        .enumerate()
        .map(|(i, c)| c.saturating_sub(b.get(i).copied().unwrap_or(0)))
        .collect()
}

/// A reading of [`LookupStats`], or several peers' summed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LookupCounts {
    counts: Vec<u64>,
    total_us: u64,
    /// DHT requests answered, by kind ([`SERVED_KINDS`]).
    pub served: Vec<u64>,
    /// DHT walks started, by kind ([`WALK_KINDS`]).
    pub walks: Vec<u64>,
}

impl LookupCounts {
    /// Adds another reading (another peer's).
    pub fn add(&mut self, o: &Self) {
        add_into(&mut self.counts, &o.counts);
        add_into(&mut self.served, &o.served);
        add_into(&mut self.walks, &o.walks);
        self.total_us += o.total_us;
    }

    /// What happened since `earlier` (a reading of the same peers).
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            counts: minus(&self.counts, &earlier.counts),
            total_us: self.total_us.saturating_sub(earlier.total_us),
            served: minus(&self.served, &earlier.served),
            walks: minus(&self.walks, &earlier.walks),
        }
    }

    /// Lookups counted.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Mean duration, ms (0 without lookups).
    pub fn mean_ms(&self) -> f64 {
        match self.count() {
            0 => 0.0,
            n => self.total_us as f64 / 1e3 / n as f64,
        }
    }

    /// The `q` quantile (0..=1), ms: the upper edge of the bucket that holds it (at most
    /// 25% above the true value); 0 without lookups.
    pub fn quantile_ms(&self, q: f64) -> f64 {
        let n = self.count();
        if n == 0 {
            return 0.0;
        }
        let rank = ((q.clamp(0.0, 1.0) * n as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return edge_ms(i);
            }
        }
        edge_ms(self.counts.len().saturating_sub(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_land_in_the_bucket_of_the_value() {
        let s = LookupStats::default();
        for ms in 1..=100u64 {
            s.record(Duration::from_millis(ms));
        }
        let c = s.snapshot();
        assert_eq!(c.count(), 100);
        let p50 = c.quantile_ms(0.5);
        assert!((50.0..=62.5).contains(&p50), "p50 {p50}");
        let p99 = c.quantile_ms(0.99);
        assert!((99.0..=124.0).contains(&p99), "p99 {p99}");
        assert!((c.mean_ms() - 50.5).abs() < 0.01);
        let later = {
            s.record(Duration::from_secs(2));
            s.snapshot()
        };
        let d = later.since(&c);
        assert_eq!(d.count(), 1);
        assert!((2000.0..=2500.0).contains(&d.quantile_ms(0.99)));
        let mut sum = c.clone();
        sum.add(&d);
        assert_eq!(sum, later);
        assert_eq!(LookupCounts::default().quantile_ms(0.99), 0.0);
    }

    #[test]
    fn walks_are_counted_by_kind_and_named_in_order() {
        assert_eq!(WALK_KINDS.len(), Walk::AutoBootstrap as usize + 1);
        assert_eq!(WALK_KINDS[Walk::GetProviders as usize], "get_providers");
        let s = LookupStats::default();
        s.walked(Walk::GetProviders);
        let before = s.snapshot();
        s.walked(Walk::GetProviders);
        s.walked(Walk::AutoBootstrap);
        let d = s.snapshot().since(&before);
        assert_eq!(d.walks, vec![0, 1, 0, 0, 0, 1]);
        let mut sum = before.clone();
        sum.add(&d);
        assert_eq!(sum.walks, vec![0, 2, 0, 0, 0, 1]);
    }
}
