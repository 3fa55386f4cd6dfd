//! `shoal bench swarm --scenario large`: stages of real size. A `sim` run whose stages
//! hold over 100M parameters each, 2 stages × 2 replicas and a trainer behind home links,
//! measured in three phases:
//! 1. averaging: the replicas train until each has applied a few rounds; the median round
//!    (freeze to the whole averaged gradient in hand) against its bound, 2(N−1)/N × the
//!    encoded gradient ÷ the link rate + two round trips (parts out, reduced parts back);
//! 2. state download: a fresh peer joins stage 1 and downloads its state (parameters and
//!    both AdamW moments) from the two replicas while they keep training; its time against
//!    the bound, the state's bytes ÷ min(the donors' combined uplink, the joiner's
//!    downlink);
//! 3. a last window in which training must keep stepping, and the joiner (which replays
//!    the updates its donors applied during its download) takes part in rounds.
//!
//! Memory is every replica's peak resident set, the joiner's included, against the stage's
//! state (parameters + two moments, f32).

use super::bench_swarm::{bench_trainer_args, in_scratch, replica_args, start_replicas, start_run};
use super::scenarios::{BenchOptions, ReplicaSpec, Row, Setup};
use super::{stop_all, HarnessError, Proc};
use shoal::averaging::AvgSnapshot;
use shoal::config::{RunConfig, StageKind};
use shoal::net::link::LinkSpec;
use shoal::swarm::events::Event;
use shoal::wire::CodecSpec;
use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// Rounds every replica applies in the averaging phase (the first, which also waits for
/// the uplink to be measured, is not counted in the median).
const ROUNDS: usize = 4;

/// The figures of the large scenario, beside the usual row.
#[derive(Debug, Clone, Default)]
pub struct LargeFigures {
    /// Parameters of the largest stage.
    pub stage_params: u64,
    /// Its state (parameters + two moments, f32), MiB.
    pub state_mib: f64,
    /// Median averaging round, seconds.
    pub avg_round_s: f64,
    /// Its bound, seconds.
    pub avg_bound_s: f64,
    /// Bound ÷ measured.
    pub avg_efficiency: f64,
    /// The joiner's download (and restore), seconds.
    pub sync_s: f64,
    /// Its bound, seconds.
    pub sync_bound_s: f64,
    /// Bound ÷ measured.
    pub sync_efficiency: f64,
    /// Round attempts abandoned at their deadline, over every replica and the whole run.
    pub failed_rounds: u64,
    /// Steps the stages applied in the last window (the fewest of the two stages).
    pub steps_last_window: u64,
    /// Rounds the joiner took part in by the end (0: it never caught up with the stage).
    pub joiner_rounds: u64,
}

impl LargeFigures {
    /// Its JSON keys.
    pub fn to_json(&self) -> serde_json::Map<String, serde_json::Value> {
        let v = serde_json::json!({
            "stage_params": self.stage_params,
            "state_mib": self.state_mib,
            "avg_round_s": self.avg_round_s,
            "avg_bound_s": self.avg_bound_s,
            "avg_efficiency": self.avg_efficiency,
            "sync_s": self.sync_s,
            "sync_bound_s": self.sync_bound_s,
            "sync_efficiency": self.sync_efficiency,
            "failed_rounds": self.failed_rounds,
            "steps_last_window": self.steps_last_window,
            "joiner_rounds": self.joiner_rounds,
        });
        match v {
            serde_json::Value::Object(m) => m,
            _ => serde_json::Map::new(),
        }
    }
}

/// What a replica last reported.
#[derive(Default, Clone)]
struct Seen {
    stage: usize,
    avg: AvgSnapshot,
    peak_rss: u64,
}

fn read(peers: &mut [Proc], seen: &mut HashMap<String, Seen>) -> Vec<(String, Event)> {
    let mut other = Vec::new();
    for p in peers.iter_mut() {
        for e in p.drain() {
            match e {
                Event::Counters {
                    stage,
                    averaging,
                    peak_rss_bytes,
                    ..
                } => {
                    let s = seen.entry(p.name.clone()).or_default();
                    s.stage = stage;
                    s.peak_rss = s.peak_rss.max(peak_rss_bytes);
                    if let Some(a) = averaging {
                        s.avg = a;
                    }
                }
                e => other.push((p.name.clone(), e)),
            }
        }
    }
    other
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the large scenario.
pub fn run(setup: &Setup, opts: &BenchOptions, out: &dyn Fn(String)) -> Result<Row, HarnessError> {
    in_scratch(setup, |dir| run_in(setup, opts, dir, out))
}

/// The processes of a running large scenario and what its replicas last reported.
struct Running {
    /// The replicas (the joiner too, once it started).
    peers: Vec<Proc>,
    trainers: Vec<Proc>,
    seen: HashMap<String, Seen>,
    started: Instant,
    /// How long a phase may take.
    limit: Duration,
}

impl Running {
    /// Reads every replica's events (returning those other than counters) and drains the
    /// trainers'.
    fn poll(&mut self) -> Vec<(String, Event)> {
        let other = read(&mut self.peers, &mut self.seen);
        for t in self.trainers.iter_mut() {
            t.drain();
        }
        other
    }

    /// Rounds each replica applied so far.
    fn rounds(&self) -> Vec<u64> {
        self.peers
            .iter()
            .map(|p| self.seen.get(&p.name).map_or(0, |s| s.avg.rounds))
            .collect()
    }
}

fn run_in(
    setup: &Setup,
    opts: &BenchOptions,
    dir: &Path,
    out: &dyn Fn(String),
) -> Result<Row, HarnessError> {
    let exe = &opts.exe;
    let (m, mut boot, baddr) = start_run(setup, exe, dir)?;
    let in_flight = setup.concurrency * setup.trainers.len();
    let params = stage_params(setup);
    let stage_params = params.iter().copied().max().unwrap_or(0);
    let state_bytes = 12.0 * stage_params as f64;
    out(format!(
        "  stages of {} parameters ({:.0} MiB of state each)",
        params
            .iter()
            .map(|p| format!("{:.1}M", *p as f64 / 1e6))
            .collect::<Vec<_>>()
            .join(", "),
        state_bytes / (1 << 20) as f64
    ));
    let start = |name: &str, r: &ReplicaSpec, stage: &str| -> Result<Proc, HarnessError> {
        let args = replica_args(&m.id, &baddr, r, &format!("{name}.key"), stage, in_flight);
        Proc::spawn(exe, dir, name, &args)
    };
    boot.wait_ready(Duration::from_secs(60))?;
    let (peers, _) = start_replicas(
        setup,
        (exe, dir),
        (&m.id, &baddr),
        in_flight,
        Duration::from_secs(300),
    )?;
    let peers: Vec<Proc> = peers.into_iter().map(|(_, p)| p).collect();
    let mut trainers = Vec::new();
    for (t, l) in setup.trainers.iter().enumerate() {
        let args = bench_trainer_args(setup, &m.id, &baddr, l, t);
        trainers.push(Proc::spawn(exe, dir, &format!("trainer{t}"), &args)?);
    }
    let mut run = Running {
        peers,
        trainers,
        seen: HashMap::new(),
        started: Instant::now(),
        limit: Duration::from_secs_f64(opts.seconds.max(600.0)),
    };
    let link = setup
        .replicas
        .first()
        .map_or_else(shoal::net::link::LinkSpec::unlimited, |r| r.link);
    let (avg_round_s, avg_bound_s) = averaging_phase(&mut run, setup, stage_params, link, out)?;
    // Phase 2: a fresh peer joins stage 1 and downloads its state.
    let joiner_spec = setup
        .replicas
        .iter()
        .find(|r| r.stage == 1)
        .cloned()
        .unwrap_or(ReplicaSpec {
            stage: 1,
            link,
            slowdown: 1.0,
        });
    let joiner = start("joiner", &joiner_spec, "1")?;
    let (sync_s, sync_bound_s) = download_phase(&mut run, joiner, &joiner_spec, link, out)?;
    // Phase 3: training keeps stepping with the joiner in (which first replays the
    // updates applied during its download).
    let steps_last_window = last_window(
        &mut run,
        Duration::from_secs_f64(opts.warmup.max(60.0)),
        out,
    );
    let seen = &run.seen;
    let failed_rounds: u64 = seen.values().map(|s| s.avg.failed_attempts).sum();
    let joiner_rounds = seen.get("joiner").map_or(0, |s| s.avg.rounds);
    let peak_rss = seen.values().map(|s| s.peak_rss).max().unwrap_or(0);
    report_replicas(seen, out);
    stop_all(run.trainers.iter_mut(), Duration::from_secs(30));
    stop_all(run.peers.iter_mut(), Duration::from_secs(15));
    boot.stop();
    let ratio = |bound: f64, measured: f64| {
        if measured > 0.0 {
            bound / measured
        } else {
            0.0
        }
    };
    let figures = LargeFigures {
        stage_params,
        state_mib: state_bytes / (1 << 20) as f64,
        avg_round_s,
        avg_bound_s,
        avg_efficiency: ratio(avg_bound_s, avg_round_s),
        sync_s,
        sync_bound_s,
        sync_efficiency: ratio(sync_bound_s, sync_s),
        failed_rounds,
        steps_last_window,
        joiner_rounds,
    };
    Ok(Row {
        scenario: setup.label.clone(),
        bottleneck: "averaging and state download".into(),
        peak_rss_mib: peak_rss as f64 / (1 << 20) as f64,
        large: Some(figures),
        ..Row::default()
    })
}

/// Phase 1: every replica applies [`ROUNDS`] rounds. Returns the median round (the first of
/// each replica left out) and its bound, in seconds.
fn averaging_phase(
    run: &mut Running,
    setup: &Setup,
    stage_params: u64,
    link: LinkSpec,
    out: &dyn Fn(String),
) -> Result<(f64, f64), HarnessError> {
    let mut next_print = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(200));
        run.poll();
        let rounds = run.rounds();
        if Instant::now() >= next_print {
            next_print = Instant::now() + Duration::from_secs(10);
            out(format!(
                "  [{:>4.0}s] averaging: rounds per replica {rounds:?}",
                run.started.elapsed().as_secs_f64()
            ));
        }
        if rounds.iter().all(|&r| r >= ROUNDS as u64) {
            break;
        }
        if run.started.elapsed() > run.limit {
            return Err(HarnessError::Process(format!(
                "the replicas applied only {rounds:?} rounds in {:?}",
                run.limit
            )));
        }
    }
    let rounds_ms: Vec<f64> = run
        .seen
        .values()
        .flat_map(|s| s.avg.recent_rounds_ms.iter().skip(1).copied())
        .collect();
    let avg_round_s = median(rounds_ms) / 1e3;
    let rate = link.up.unwrap_or(f64::INFINITY);
    let members = 2.0;
    let grad_bytes =
        shoal::wire::max_encoded_len(&[stage_params as usize], &setup.run.codecs.gradients)
            .unwrap_or(stage_params as usize * 4) as f64;
    let avg_bound_s =
        2.0 * (members - 1.0) / members * grad_bytes / rate + 2.0 * link.rtt.as_secs_f64();
    out(format!(
        "  averaging: median round {avg_round_s:.2} s, bound {avg_bound_s:.2} s ({:.0} MB encoded gradient)",
        grad_bytes / 1e6
    ));
    Ok((avg_round_s, avg_bound_s))
}

/// Phase 2: `joiner` downloads its state while the others keep training; it joins the
/// running replicas once done. Returns the download's seconds and its bound.
fn download_phase(
    run: &mut Running,
    mut joiner: Proc,
    joiner_spec: &ReplicaSpec,
    link: LinkSpec,
    out: &dyn Fn(String),
) -> Result<(f64, f64), HarnessError> {
    let sync_started = Instant::now();
    let (bytes, sync_s, donors, setup_s) = loop {
        run.poll();
        let got = joiner.wait_for("its download", Duration::from_secs(1), |e| match e {
            Event::Synced {
                bytes,
                seconds,
                donors,
                setup_s,
                ..
            } => Some((*bytes as f64, *seconds, *donors, *setup_s)),
            Event::SyncRetry { error, .. } => {
                out(format!("  joiner: download retried: {error}"));
                None
            }
            _ => None,
        });
        match got {
            Ok(v) => break v,
            Err(e) if joiner.exited() => return Err(e),
            Err(_) if sync_started.elapsed() > run.limit => {
                return Err(HarnessError::Process(format!(
                    "the joiner did not download its state within {:?}",
                    run.limit
                )))
            }
            Err(_) => {}
        }
    };
    let up: f64 = donors as f64 * link.up.unwrap_or(f64::INFINITY);
    let down = joiner_spec.link.down.unwrap_or(f64::INFINITY);
    let sync_bound_s = bytes / up.min(down);
    out(format!(
        "  state download: {:.0} MB from {donors} donors in {sync_s:.1} s ({setup_s:.1} s before the first chunk), bound {sync_bound_s:.1} s",
        bytes / 1e6
    ));
    run.peers.push(joiner);
    Ok((sync_s, sync_bound_s))
}

/// Phase 3: a window of at least `window`, and until the joiner has taken part in a round
/// (four minutes at most). Returns the steps the stages applied in it (the fewest of the
/// two stages, the joiner left out).
fn last_window(run: &mut Running, window: Duration, out: &dyn Fn(String)) -> u64 {
    run.poll();
    let before: HashMap<String, u64> = run
        .seen
        .iter()
        .map(|(k, s)| (k.clone(), s.avg.rounds))
        .collect();
    let opened = Instant::now();
    let joined =
        |seen: &HashMap<String, Seen>| seen.get("joiner").is_some_and(|s| s.avg.rounds > 0);
    while opened.elapsed() < window
        || (!joined(&run.seen) && opened.elapsed() < Duration::from_secs(240))
    {
        std::thread::sleep(Duration::from_millis(500));
        for (name, e) in run.poll() {
            if let Event::SyncRetry { error, .. } = e {
                out(format!("  {name}: download retried: {error}"));
            }
        }
    }
    run.poll();
    (0..2)
        .map(|stage| {
            run.seen
                .iter()
                .filter(|(k, s)| s.stage == stage && *k != "joiner")
                .map(|(k, s)| {
                    s.avg
                        .rounds
                        .saturating_sub(before.get(k).copied().unwrap_or(0))
                })
                .max()
                .unwrap_or(0)
        })
        .min()
        .unwrap_or(0)
}

/// One line per replica: its stage, rounds, abandoned attempts, resyncs, replays, memory.
fn report_replicas(seen: &HashMap<String, Seen>, out: &dyn Fn(String)) {
    let mut v: Vec<_> = seen.iter().collect();
    v.sort_by(|a, b| a.0.cmp(b.0));
    for (name, s) in v {
        out(format!(
            "  {name}: stage {}, {} rounds ({} abandoned, {} resyncs, {} updates replayed), peak RSS {:.0} MiB",
            s.stage,
            s.avg.rounds,
            s.avg.failed_attempts,
            s.avg.resyncs,
            s.avg.replays,
            s.peak_rss as f64 / (1 << 20) as f64
        ));
    }
}

/// Parameters of each stage of the run (built on the CPU; dropped at once).
fn stage_params(setup: &Setup) -> Vec<u64> {
    (0..setup.run.stages.count)
        .map(|s| {
            shoal::model::Stage::new(&setup.run, s, &candle_core::Device::Cpu)
                .map_or(0, |st| st.params().numel() as u64)
        })
        .collect()
}

/// The `large` scenario: a `sim` run of two stages of over 100M parameters each (d_model
/// 1024, 8 blocks per stage), 2 replicas per stage and a trainer, all on `home` links.
/// Gradients travel in int8 (zstd gains nothing on int8 gradients and costs CPU that
/// five processes on two cores do not have). A step takes about 20 s of trainer work, so
/// the donors' uplinks have room for a joiner's download between rounds.
pub fn setup(home: LinkSpec) -> Setup {
    let mut run = RunConfig::tiny();
    run.model.vocab = 256;
    run.model.d_model = 1024;
    run.model.n_heads = 16;
    run.model.n_layers = 16;
    run.model.seq_len = 32;
    run.stages.count = 2;
    run.stages.cuts.clear();
    run.stages.kind = StageKind::Sim;
    run.stages.sim_ms_per_sample = Some(250.0);
    run.codecs.gradients = CodecSpec::INT8;
    run.training.batch_size = 8;
    run.training.target_batch_size = Some(64);
    run.training.steps = 1_000_000;
    Setup {
        label: "large".into(),
        run,
        replicas: (0..4)
            .map(|i| ReplicaSpec {
                stage: i % 2,
                link: home,
                slowdown: 1.0,
            })
            .collect(),
        trainers: vec![home],
        concurrency: 2,
        churn: None,
        routing: "wiring",
        call_timeout: None,
        large: true,
        sync: false,
    }
}
