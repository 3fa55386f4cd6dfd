//! What `shoal bench sim` reports: one row of figures ([`SimRow`]), and its JSON.

/// What `shoal bench sim` measured.
#[derive(Debug, Clone, Default)]
pub struct SimRow {
    pub peers: usize,
    pub stage_peers: usize,
    pub trainer_peers: usize,
    pub stages: usize,
    /// Peers of the initial swarm serving the DHT (the seeds and the public peers).
    pub dht_servers: usize,
    /// Seconds from the first start until every peer of the initial swarm served its
    /// stage (or ran its trainer).
    pub joined_s: f64,
    /// Median join time of the initial peers, s.
    pub joined_p50_s: f64,
    /// Join times of the peers that came in by churn: median and longest, s.
    pub churn_join_p50_s: f64,
    pub churn_join_max_s: f64,
    /// Churn joiners that failed to start, with why.
    pub join_failures: Vec<String>,
    pub samples_per_s: f64,
    pub bound: f64,
    pub efficiency: f64,
    pub bottleneck: String,
    pub fed: u64,
    pub completed: u64,
    pub failed: u64,
    pub vanished: i64,
    /// Failed samples by reason, most first.
    pub failures: Vec<(String, u64)>,
    /// Calls repeated elsewhere, by reason, most first.
    pub swap_reasons: Vec<(String, u64)>,
    pub swaps: u64,
    pub left: usize,
    pub killed: usize,
    pub lookups: u64,
    pub lookup_p50_ms: f64,
    pub lookup_p99_ms: f64,
    /// DHT gets per peer per minute in the window.
    pub lookups_per_peer_min: f64,
    /// DHT requests each peer answered per minute in the window, by kind.
    pub dht_served_per_peer_min: Vec<(String, f64)>,
    /// DHT walks each peer started per minute in the window, by kind.
    pub dht_walks_per_peer_min: Vec<(String, f64)>,
    pub rebalance_moves: u64,
    /// Mean members per averaging round, per stage.
    pub avg_group_sizes: Vec<f64>,
    pub avg_rounds: u64,
    pub avg_failed_attempts: u64,
    pub dht_routing_table_p50: f64,
    /// Established connections per peer at the end, median.
    pub connections_p50: f64,
    /// Serving replicas per stage at the end.
    pub placement: Vec<usize>,
    pub peak_rss_mib: f64,
    pub rss_per_peer_mib: f64,
    pub window_s: f64,
    /// Every 5 s of the warm-up and the window.
    pub timeline: Vec<Tick>,
    /// Connected pairs of peers at the end, by what joins them
    /// ([`super::sim_probe::relations`]).
    pub connection_pairs: std::collections::BTreeMap<&'static str, usize>,
}

/// Five seconds of the sim swarm.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Tick {
    /// Seconds since every peer joined.
    pub t: f64,
    /// Samples/s completed over these 5 s.
    pub samples_per_s: f64,
    /// The bound over them (mean of the per-second samples).
    pub bound: f64,
    /// Calls swapped over them.
    pub swaps: u64,
    /// Serving replicas per stage.
    pub placement: Vec<usize>,
    /// Cores the process kept busy over them (of the machine's).
    pub cpu_cores: f64,
    /// The replicas the trainers' last reads found in their least-found stage (median).
    pub trainers_know: f64,
    /// Averaging control messages (progress, heartbeats, members) the replicas queued per
    /// second over them, all together.
    pub avg_msgs_per_s: f64,
}

impl SimRow {
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = self.figures();
        v["timeline"] = serde_json::json!(self.timeline);
        v["connection_pairs"] = serde_json::json!(self.connection_pairs);
        v
    }

    fn figures(&self) -> serde_json::Value {
        serde_json::json!({
            "peers": self.peers, "stage_peers": self.stage_peers,
            "trainer_peers": self.trainer_peers, "stages": self.stages,
            "dht_servers": self.dht_servers,
            "joined_s": self.joined_s, "joined_p50_s": self.joined_p50_s,
            "churn_join_p50_s": self.churn_join_p50_s, "churn_join_max_s": self.churn_join_max_s,
            "join_failures": self.join_failures,
            "samples_per_s": self.samples_per_s, "bound": self.bound,
            "efficiency": self.efficiency, "bottleneck": self.bottleneck,
            "fed": self.fed, "completed": self.completed, "failed": self.failed,
            "vanished": self.vanished, "failures": self.failures, "swap_reasons": self.swap_reasons, "swaps": self.swaps, "left": self.left,
            "killed": self.killed, "lookups": self.lookups,
            "lookup_p50_ms": self.lookup_p50_ms, "lookup_p99_ms": self.lookup_p99_ms,
            "lookups_per_peer_min": self.lookups_per_peer_min,
            "dht_served_per_peer_min": self.dht_served_per_peer_min.iter().map(|(k, v)| (k.clone(), serde_json::json!(v))).collect::<serde_json::Map<_, _>>(),
            "dht_walks_per_peer_min": self.dht_walks_per_peer_min.iter().map(|(k, v)| (k.clone(), serde_json::json!(v))).collect::<serde_json::Map<_, _>>(),
            "rebalance_moves": self.rebalance_moves,
            "avg_group_sizes": self.avg_group_sizes, "avg_rounds": self.avg_rounds,
            "avg_failed_attempts": self.avg_failed_attempts,
            "dht_routing_table_p50": self.dht_routing_table_p50,
            "connections_p50": self.connections_p50,
            "placement": self.placement, "peak_rss_mib": self.peak_rss_mib,
            "rss_per_peer_mib": self.rss_per_peer_mib, "window_s": self.window_s,
        })
    }
}

type Reasons = parking_lot::Mutex<std::collections::BTreeMap<String, u64>>;

/// Reasons summed over trainers, most frequent first.
pub fn reasons<'a>(maps: impl Iterator<Item = &'a Reasons>) -> Vec<(String, u64)> {
    let mut why = std::collections::BTreeMap::<String, u64>::new();
    for m in maps {
        for (k, n) in m.lock().iter() {
            *why.entry(k.clone()).or_default() += n;
        }
    }
    let mut out: Vec<(String, u64)> = why.into_iter().collect();
    out.sort_by_key(|r| std::cmp::Reverse(r.1));
    out
}
