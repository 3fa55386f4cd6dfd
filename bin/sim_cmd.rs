//! `shoal bench sim`: its flags, and the table it prints ([`crate::harness::bench_sim`]
//! runs the swarm).

use crate::harness::bench_sim::{self, SimOptions};
use crate::harness::bench_sim_row::SimRow;
use crate::peer_cmd::runtime;
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::process::ExitCode;

/// Flags of `shoal bench sim`.
#[derive(clap::Args)]
pub struct SimArgs {
    /// Peers in the swarm: 3 seeds, a tenth running trainers, the rest serving stages.
    #[arg(long, default_value_t = 200, value_name = "N")]
    peers: usize,
    /// Pipeline stages.
    #[arg(long, default_value_t = 4, value_name = "N")]
    stages: usize,
    /// Seconds measured (with churn), after every peer joined and the warm-up.
    #[arg(long, default_value_t = 90.0, value_name = "SECS")]
    seconds: f64,
    /// Seconds of warm-up once every peer joined.
    #[arg(long, default_value_t = 15.0, value_name = "SECS")]
    warmup: f64,
    /// Fraction of the stage peers that leave each minute (alternately gracefully and
    /// killed), each replaced by a fresh peer; 0: no churn.
    #[arg(long, default_value_t = 0.05, value_name = "FRACTION")]
    churn: f64,
    /// Seed of the links drawn per peer.
    #[arg(long, default_value_t = 1, value_name = "N")]
    seed: u64,
    /// Connect the peers over TCP on 127.0.0.1 instead of libp2p's in-process memory
    /// transport (each connection then costs two file descriptors: 200 peers need
    /// `ulimit -n` well above 20,000).
    #[arg(long)]
    tcp: bool,
    /// Fraction of the peers (seeds aside, which always are) publicly reachable, serving
    /// the DHT; the others are home machines behind NAT: DHT clients (`shoal peer
    /// --dht-client`) that their stage mates and trainers reach directly, as after a hole
    /// punch. 1: every peer serves the DHT.
    #[arg(long, default_value_t = 0.2, value_name = "FRACTION")]
    public: f64,
    /// Samples/s each stage's replicas do together (the sim stages' speed).
    #[arg(long, default_value_t = bench_sim::SWARM_RATE, value_name = "SAMPLES")]
    rate: f64,
    /// Close connections idle this many seconds (default: a peer's default, 120).
    #[arg(long, value_name = "SECS")]
    idle_timeout: Option<f64>,
    /// Also write the row as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

pub fn bench_sim(a: SimArgs) -> Result<ExitCode> {
    if a.stages == 0
        || a.seconds.is_nan()
        || a.seconds <= 0.0
        || a.warmup.is_nan()
        || a.warmup < 0.0
    {
        bail!("--stages and --seconds must be positive, --warmup at least 0");
    }
    if !(a.rate.is_finite() && a.rate > 0.0) {
        bail!(
            "--rate is the samples/s of each stage's replicas together, above 0, not {}",
            a.rate
        );
    }
    if !(0.0..=1.0).contains(&a.public) {
        bail!(
            "--public is the fraction of peers publicly reachable, 0 to 1, not {}",
            a.public
        );
    }
    if !(0.0..=1.0).contains(&a.churn) {
        bail!(
            "--churn is a fraction of the stage peers per minute, 0 to 1, not {}",
            a.churn
        );
    }
    let dir = tempfile_dir()?;
    let opts = SimOptions {
        peers: a.peers,
        stages: a.stages,
        warmup: a.warmup,
        seconds: a.seconds,
        churn: a.churn,
        seed: a.seed,
        dir: dir.clone(),
        tcp: a.tcp,
        idle: a
            .idle_timeout
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(std::time::Duration::from_secs_f64),
        rate: a.rate,
        public: a.public,
    };
    let rt = runtime()?;
    let row = rt.block_on(bench_sim::run(opts));
    rt.shutdown_timeout(std::time::Duration::from_secs(5));
    let _ = std::fs::remove_dir_all(&dir);
    let row = row.map_err(|e| anyhow::anyhow!(e))?;
    print_row(&row);
    if let Some(path) = a.json {
        let text = serde_json::to_string_pretty(&[row.to_json()])?;
        shoal::files::write_atomic(&path, text.as_bytes())
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

fn tempfile_dir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("shoal-sim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok(dir)
}

fn print_row(r: &SimRow) {
    println!(
        "{} peers ({} serving {} stages, {} with trainers, 3 seeds): every peer joined in {:.1} s (median {:.1} s)",
        r.peers, r.stage_peers, r.stages, r.trainer_peers, r.joined_s, r.joined_p50_s
    );
    println!(
        "{} of them serving the DHT (seeds and public peers), the rest DHT clients",
        r.dht_servers
    );
    println!(
        "{:.1} samples/s against a bound of {:.1} ({}): efficiency {:.2} over {:.0} s",
        r.samples_per_s, r.bound, r.bottleneck, r.efficiency, r.window_s
    );
    println!(
        "samples fed {}, completed {}, failed {}, vanished {}; {} calls swapped",
        r.fed, r.completed, r.failed, r.vanished, r.swaps
    );
    for (why, n) in r.failures.iter().take(3) {
        println!("  {n} failed: {why}");
    }
    for (why, n) in r.swap_reasons.iter().take(3) {
        println!("  {n} swapped: {why}");
    }
    println!(
        "churn: {} left, {} killed; joiners took {:.1} s (median), {:.1} s (longest); {} failed to join",
        r.left, r.killed, r.churn_join_p50_s, r.churn_join_max_s, r.join_failures.len()
    );
    for why in r.join_failures.iter().take(3) {
        println!("  {why}");
    }
    println!(
        "DHT: {} gets, p50 {:.0} ms, p99 {:.0} ms, {:.1} per peer per minute; routing table p50 {:.0} peers; {:.0} connections per peer (median)",
        r.lookups, r.lookup_p50_ms, r.lookup_p99_ms, r.lookups_per_peer_min, r.dht_routing_table_p50, r.connections_p50
    );
    let pairs: Vec<String> = r
        .connection_pairs
        .iter()
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
    println!("connected pairs by what joins them: {}", pairs.join(", "));
    let per_min = |kinds: &[(String, f64)]| -> String {
        let v: Vec<String> = kinds.iter().map(|(k, v)| format!("{k} {v:.1}")).collect();
        v.join(", ")
    };
    println!(
        "DHT requests answered per peer per minute: {}",
        per_min(&r.dht_served_per_peer_min)
    );
    println!(
        "DHT walks started per peer per minute: {}",
        per_min(&r.dht_walks_per_peer_min)
    );
    let groups: Vec<String> = r
        .avg_group_sizes
        .iter()
        .map(|g| format!("{g:.1}"))
        .collect();
    println!(
        "averaging: {} rounds, {} attempts abandoned, mean group size per stage [{}]; placement {:?}; {} rebalancing moves",
        r.avg_rounds, r.avg_failed_attempts, groups.join(", "), r.placement, r.rebalance_moves
    );
    println!(
        "memory: peak {:.0} MiB, {:.1} MiB per peer",
        r.peak_rss_mib, r.rss_per_peer_mib
    );
}
