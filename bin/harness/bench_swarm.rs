//! `shoal bench swarm`: a local swarm of separate processes measured against its bound
//! ([`super::scenarios`]). The bench reads the processes' status streams: the replicas'
//! counters (every 500 ms), the trainers' progress and their reasons for failures.

use super::scenarios::{bound, link_arg, BenchOptions, ReplicaSpec, Row, Setup, StageTimes};
use super::{peer_args, spawn_bootstrap, stop_all, trainer_args, HarnessError, Proc};
use shoal::dht::Manifest;
use shoal::net::link::LinkSpec;
use shoal::swarm::events::Event;
use shoal::trainer::report::Progress;
use std::path::Path;
use std::time::{Duration, Instant};

/// Arguments of trainer `idx` of `setup`: synchronous steps or never waiting for one, as the
/// setup says; reports every 250 ms.
pub(super) fn bench_trainer_args(
    setup: &Setup,
    id: &str,
    boot: &str,
    link: &LinkSpec,
    idx: usize,
) -> Vec<String> {
    let mut a = trainer_args(id, boot, idx);
    a.extend(
        [
            "--concurrency",
            &setup.concurrency.to_string(),
            "--report-ms",
            "250",
            "--routing",
            setup.routing,
            "--emulate-link",
            &link_arg(link),
        ]
        .map(String::from),
    );
    if !setup.sync {
        a.push("--no-sync-steps".into());
    }
    if let Some(t) = setup.call_timeout {
        a.extend(["--call-timeout".to_string(), t.to_string()]);
    }
    a
}

/// Arguments of a stage peer. `in_flight` is the microbatches all trainers keep in flight:
/// every replica's queue holds them all, so a replica never refuses work for being full
/// (which would let the fixed round-robin baseline steer around a slow replica), and it
/// keeps as many forwards, so a backward never recomputes for want of room.
pub(super) fn replica_args(
    id: &str,
    boot: &str,
    r: &ReplicaSpec,
    key: &str,
    stage: &str,
    in_flight: usize,
) -> Vec<String> {
    let mut a = peer_args(id, Some(boot), stage, key);
    let room = in_flight.max(8).to_string();
    a.extend(
        [
            "--allow-sim",
            "--rebalance-every",
            "0",
            "--queue",
            &room,
            "--keep-forwards",
            &room,
            "--counters-ms",
            "500",
            "--sim-slowdown",
            &r.slowdown.to_string(),
            "--emulate-link",
            &link_arg(&r.link),
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    a
}

/// Reads the trainers' events: their latest progress, and the reasons they report for
/// failed samples and swapped calls into `why`.
fn drain(trainers: &mut [Proc], last: &mut [Progress], why: &mut Vec<String>) {
    for (t, l) in trainers.iter_mut().zip(last.iter_mut()) {
        for e in t.drain() {
            match e {
                Event::Progress { progress, .. } | Event::Done { progress } => *l = progress,
                Event::Reasons { failed, swapped } => {
                    for (reason, n) in failed {
                        why.push(format!("{}: failed {n} samples: {reason}", t.name));
                    }
                    for (reason, n) in swapped {
                        why.push(format!("{}: swapped {n} calls: {reason}", t.name));
                    }
                }
                _ => {}
            }
        }
    }
}

/// Each replica's latest counters (by process name): its stage, when they were read, and
/// their values.
type Readings = std::collections::HashMap<String, (usize, Instant, StageTimes)>;

/// What the replicas' counter reports tell beside their times.
#[derive(Default)]
struct Seen {
    /// The highest peak resident memory any replica reported, bytes.
    peak_rss: u64,
}

/// Reads the counters the replicas report every `--counters-ms` into `latest`, and each
/// replica's first reading into `first` (their other events are consumed and dropped).
fn read_counters(
    peers: &mut [(usize, Proc)],
    latest: &mut Readings,
    first: &mut Readings,
    seen: &mut Seen,
) {
    for (_, p) in peers.iter_mut() {
        for e in p.drain() {
            if let Event::Counters {
                stage,
                counters,
                peak_rss_bytes,
                ..
            } = e
            {
                seen.peak_rss = seen.peak_rss.max(peak_rss_bytes);
                let r = (stage, Instant::now(), StageTimes::of(&counters));
                first.entry(p.name.clone()).or_insert_with(|| r.clone());
                latest.insert(p.name.clone(), r);
            }
        }
    }
}

/// Per replica, the counters over the window between two sets of readings. A replica
/// that joined inside the window counts from its first reading (`first`), one that died
/// inside it up to its last.
fn window(start: &Readings, end: &Readings, first: &Readings) -> Vec<(String, usize, StageTimes)> {
    let mut names: Vec<&String> = end.keys().collect();
    names.sort();
    names
        .into_iter()
        .filter_map(|name| {
            let (s, t1, c1) = end.get(name)?;
            let (_, t0, c0) = start.get(name).or_else(|| first.get(name))?;
            let w = c1.since(c0, t1.saturating_duration_since(*t0).as_secs_f64() * 1e3);
            Some((name.clone(), *s, w))
        })
        .collect()
}

/// Runs one setup; `out` receives progress lines.
pub fn run_setup(
    setup: &Setup,
    opts: &BenchOptions,
    out: &dyn Fn(String),
) -> Result<Row, HarnessError> {
    in_scratch(setup, |dir| run_in(setup, opts, dir, out))
}

/// Runs `f` in a fresh scratch folder for `setup` ([`in_scratch_dir`], [`leave_scratch`]).
pub(super) fn in_scratch<T>(
    setup: &Setup,
    f: impl FnOnce(&Path) -> Result<T, HarnessError>,
) -> Result<T, HarnessError> {
    let dir = in_scratch_dir(&setup.label)?;
    let r = f(&dir);
    leave_scratch(&dir);
    r
}

/// A fresh scratch folder for a benchmark's processes, named after `label`.
pub(super) fn in_scratch_dir(label: &str) -> Result<std::path::PathBuf, HarnessError> {
    let dir = std::env::temp_dir().join(format!(
        "shoal-bench-{}-{}",
        std::process::id(),
        label.replace('/', "-")
    ));
    std::fs::create_dir_all(&dir).map_err(|e| HarnessError::Process(e.to_string()))?;
    Ok(dir)
}

/// Removes a scratch folder (kept, with the processes' logs, when `SHOAL_BENCH_KEEP` is
/// set).
pub(super) fn leave_scratch(dir: &Path) {
    if std::env::var_os("SHOAL_BENCH_KEEP").is_some() {
        eprintln!("scratch folder kept: {}", dir.display());
    } else {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Writes `setup`'s manifest into `dir` and starts its bootstrap peer: the manifest, the
/// bootstrap and its address.
pub(super) fn start_run(
    setup: &Setup,
    exe: &Path,
    dir: &Path,
) -> Result<(Manifest, Proc, String), HarnessError> {
    let err = |e: &dyn std::fmt::Display| HarnessError::Process(e.to_string());
    let m = Manifest::from_config(&setup.run).map_err(|e| err(&e))?;
    std::fs::write(dir.join("run.toml"), m.file_text()).map_err(|e| err(&e))?;
    let (boot, baddr) = spawn_bootstrap(exe, dir)?;
    Ok((m, boot, baddr))
}

/// How long a window of synchronous steps waits past its end for the completion it closes
/// on (a step that long has stalled: the window closes anyway).
const MAX_CLOSE_WAIT: Duration = Duration::from_secs(60);

/// The measured window. It opens after the warm-up once the trainers have completed
/// samples (a trainer of a large vocabulary spends its first seconds building the corpus),
/// at most a minute late, and closes `seconds` later.
///
/// With synchronous steps samples complete in bursts, one burst a step: closed at a fixed
/// time the window would end part-way through a step whose samples have not completed yet
/// (half a step short on average: ~10% of a 30 s window of 6 s steps). So it opens on a
/// completion (a warm-up that ends between bursts waits for the next) and closes on the
/// first completion after its end: both ends sit at the start of a burst.
struct Window {
    sync: bool,
    warm_end: Instant,
    latest_open: Instant,
    seconds: f64,
    /// When it is due to close, once open.
    end: Option<Instant>,
    /// Samples completed at the first poll past `end` (synchronous steps).
    closing: Option<u64>,
    /// Samples completed at the last poll before it opened.
    seen: u64,
}

/// What a poll of the [`Window`] found.
enum Edge {
    Opens,
    Closes,
    Neither,
}

impl Window {
    fn new(sync: bool, warm_end: Instant, seconds: f64) -> Self {
        Self {
            sync,
            warm_end,
            latest_open: warm_end + Duration::from_secs(60),
            seconds,
            end: None,
            closing: None,
            seen: 0,
        }
    }

    /// The window at `now`, with `completed` samples completed so far.
    fn poll(&mut self, now: Instant, completed: u64) -> Edge {
        if let Some(end) = self.end {
            let waited_enough = now >= end + MAX_CLOSE_WAIT;
            return match self.closing {
                _ if now < end => Edge::Neither,
                Some(c0) if completed <= c0 && self.sync && !waited_enough => Edge::Neither,
                None if self.sync && !waited_enough => {
                    self.closing = Some(completed);
                    Edge::Neither
                }
                _ => Edge::Closes,
            };
        }
        let started_work = if self.sync {
            completed > self.seen
        } else {
            completed > 0
        };
        self.seen = completed;
        if now >= self.warm_end && (started_work || now >= self.latest_open) {
            self.end = Some(now + Duration::from_secs_f64(self.seconds));
            Edge::Opens
        } else {
            Edge::Neither
        }
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
    let (mut peers, compute) = start_replicas(
        setup,
        (exe, dir),
        (&m.id, &baddr),
        in_flight,
        Duration::from_secs(60),
    )?;
    let mut trainers = Vec::new();
    for (t, l) in setup.trainers.iter().enumerate() {
        let args = bench_trainer_args(setup, &m.id, &baddr, l, t);
        trainers.push(Proc::spawn(exe, dir, &format!("trainer{t}"), &args)?);
    }
    let mut last = vec![Progress::default(); trainers.len()];
    let mut why = Vec::new();
    let started = Instant::now();
    let warm_end = started + Duration::from_secs_f64(opts.warmup);
    let seconds = window_seconds(setup, opts);
    let mut at_warm: Option<(Instant, Progress)> = None;
    let mut measured = Window::new(setup.sync, warm_end, seconds);
    let (mut latest, mut first) = (Readings::new(), Readings::new());
    let mut seen = Seen::default();
    let mut warm_readings = Readings::new();
    let mut next_kill = setup.churn.map(|p| started + p);
    let mut killed = 0;
    let bar = crate::progress::Bar::new((opts.warmup + seconds).ceil() as u64, "seconds");
    let closed_at = loop {
        std::thread::sleep(Duration::from_millis(100));
        drain(&mut trainers, &mut last, &mut why);
        read_counters(&mut peers, &mut latest, &mut first, &mut seen);
        let now = Instant::now();
        let progress = Progress::sum(&last);
        match measured.poll(now, progress.completed) {
            Edge::Closes => break (now, progress),
            Edge::Opens => {
                at_warm = Some((now, progress));
                warm_readings = latest.clone();
            }
            Edge::Neither => {}
        }
        if let (Some(n), Some((_, p0))) = (opts.samples, &at_warm) {
            let progress = Progress::sum(&last);
            if progress.completed.saturating_sub(p0.completed) >= n {
                break (now, progress);
            }
        }
        if let (Some(k), Some(period)) = (next_kill, setup.churn) {
            if now >= k {
                next_kill = Some(now + period);
                let (id, exe) = (m.id.as_str(), exe.as_path());
                if let Some(name) =
                    churn_kill(setup, &mut peers, (id, &baddr, exe, dir), in_flight, killed)?
                {
                    killed += 1;
                    bar.println(&format!("churn: SIGKILLed {name}, starting joiner{killed}"));
                }
            }
        }
        let s = Progress::sum(&last);
        bar.set(started.elapsed().as_secs(), || {
            format!(
                "{}: completed {} failed {} wire {:.1} MB",
                setup.label,
                s.completed,
                s.failed,
                s.wire as f64 / 1e6
            )
        });
    };
    bar.clear();
    drain(&mut trainers, &mut last, &mut why);
    read_counters(&mut peers, &mut latest, &mut first, &mut seen);
    let end_readings = latest.clone();
    let rates = Rates::between(
        &at_warm.unwrap_or((started, Progress::default())),
        &closed_at,
    );
    // Stop the trainers gracefully (SIGTERM): in-flight microbatches finish, and the last
    // line gives the final accounting.
    stop_all(trainers.iter_mut(), Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(300));
    drain(&mut trainers, &mut last, &mut why);
    for w in &why {
        out(format!("  {w}"));
    }
    stop_all(peers.iter_mut().map(|(_, p)| p), Duration::from_secs(15));
    let stages = breakdown(setup, (&warm_readings, &end_readings, &first), out);
    boot.stop();
    Ok(assemble(
        setup,
        &compute,
        rates,
        Progress::sum(&last),
        (killed, seen.peak_rss),
        stages,
    ))
}

/// The window's rates: samples/s and wire bytes per sample between its opening and its
/// closing (instant, trainers' summed progress), and the run's wire/raw byte ratio.
struct Rates {
    samples_per_s: f64,
    bytes_per_sample: f64,
    /// Wire bytes over raw bytes over the whole run (1 when nothing was sent).
    ratio: f64,
}

impl Rates {
    fn between((t0, p0): &(Instant, Progress), (t1, fin): &(Instant, Progress)) -> Self {
        let secs = t1.saturating_duration_since(*t0).as_secs_f64().max(1e-9);
        let done = fin.completed.saturating_sub(p0.completed);
        Self {
            samples_per_s: done as f64 / secs,
            bytes_per_sample: fin.wire.saturating_sub(p0.wire) as f64 / (done.max(1)) as f64,
            ratio: if fin.raw > 0 {
                fin.wire as f64 / fin.raw as f64
            } else {
                1.0
            },
        }
    }
}

/// Per stage, the replicas' counters over the measured window only: the difference of the
/// readings taken as it opened and as it closed (`first` for replicas that joined inside
/// it); one line per replica to `out`.
fn breakdown(
    setup: &Setup,
    (warm, end, first): (&Readings, &Readings, &Readings),
    out: &dyn Fn(String),
) -> Vec<StageTimes> {
    let mut stages = vec![StageTimes::default(); setup.run.stages.count];
    for (name, s, t) in window(warm, end, first) {
        out(format!("  {name}: {}", t.line()));
        if let Some(acc) = stages.get_mut(s) {
            acc.add(&t);
        }
    }
    stages
}

/// The row: the window's `rates` against the bound the replicas' measured `compute` and
/// the links allow, with the trainers' final accounting `end`, the replicas killed and the
/// highest peak memory, and the per-stage breakdown.
fn assemble(
    setup: &Setup,
    compute: &[f64],
    rates: Rates,
    end: Progress,
    (killed, peak_rss): (usize, u64),
    stages: Vec<StageTimes>,
) -> Row {
    // Real stages share this machine's cores (sim stages sleep).
    let real = setup.run.stages.kind.is_model();
    let cores = real.then(|| std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64));
    let (b, what, slowest) = bound(setup, compute, rates.ratio, cores);
    let focus = focus_stage(&stages, &what);
    let per = |x: f64, of: f64| if of > 0.0 { x / of } else { 0.0 };
    Row {
        scenario: setup.label.clone(),
        samples_per_s: rates.samples_per_s,
        bound: b,
        efficiency: per(rates.samples_per_s, b),
        bytes_per_sample: rates.bytes_per_sample,
        bottleneck: what,
        utilisation: per(rates.samples_per_s, slowest),
        fed: end.fed,
        completed: end.completed,
        failed: end.failed,
        vanished: end.fed as i64 - end.completed as i64 - end.failed as i64,
        killed,
        swaps: end.swaps,
        stages,
        focus,
        peak_rss_mib: peak_rss as f64 / (1 << 20) as f64,
        large: None,
        stage_count: setup.run.stages.count,
        mode: setup.mode().into(),
        microbatch: setup.run.training.batch_size,
        target_batch: setup.run.target_batch_size(),
        restarts: end.restarts,
    }
}

/// The replicas running, each with its index in `setup.replicas`.
pub(super) type Replicas = Vec<(usize, Proc)>;

/// Starts every replica of `setup` (of run `id`, bootstrapped at `baddr`) one after
/// another, each once the one before reported its throughput (`serving`), then waits until
/// every one is ready, each wait at most `wait`; returns them (with their index in
/// `setup.replicas`) and those throughputs.
pub(super) fn start_replicas(
    setup: &Setup,
    (exe, dir): (&Path, &Path),
    (id, baddr): (&str, &str),
    in_flight: usize,
    wait: Duration,
) -> Result<(Replicas, Vec<f64>), HarnessError> {
    let mut peers: Replicas = Vec::new();
    let mut compute = Vec::new();
    for (i, r) in setup.replicas.iter().enumerate() {
        let name = format!("stage{}-replica{i}", r.stage);
        let args = replica_args(
            id,
            baddr,
            r,
            &format!("{name}.key"),
            &r.stage.to_string(),
            in_flight,
        );
        let mut p = Proc::spawn(exe, dir, &name, &args)?;
        let tp = p.wait_for("its throughput", wait, |e| match e {
            Event::Serving { samples_per_s, .. } => Some(*samples_per_s),
            _ => None,
        })?;
        compute.push(tp);
        peers.push((i, p));
    }
    for (_, p) in peers.iter_mut() {
        p.wait_ready(wait)?;
    }
    Ok((peers, compute))
}

/// Seconds the measured window lasts: `--seconds`, but a churn window holds at least two
/// kills and 5 s after the second (kills come every period from the start).
fn window_seconds(setup: &Setup, opts: &BenchOptions) -> f64 {
    match setup.churn {
        Some(p) => {
            let p = p.as_secs_f64();
            let first_inside = (opts.warmup / p).floor() + 1.0;
            opts.seconds
                .max((first_inside + 1.0) * p + 5.0 - opts.warmup)
        }
        None => opts.seconds,
    }
}

/// Churn: the oldest replica of stage 1 dies (SIGKILL) and a fresh peer, `joiner{killed+1}`,
/// joins where the swarm is weakest. Returns the victim's name (`None`: stage 1 has no
/// replica left to kill).
fn churn_kill(
    setup: &Setup,
    peers: &mut Replicas,
    (id, baddr, exe, dir): (&str, &str, &Path, &Path),
    in_flight: usize,
    killed: usize,
) -> Result<Option<String>, HarnessError> {
    let Some(pos) = peers
        .iter()
        .position(|(i, _)| setup.replicas.get(*i).map(|r| r.stage) == Some(1))
    else {
        return Ok(None);
    };
    let (i, mut victim) = peers.remove(pos);
    victim.kill();
    let spec = setup.replicas[i].clone();
    let name = format!("joiner{}", killed + 1);
    let key = format!("{name}.key");
    let args = replica_args(id, baddr, &spec, &key, "auto", in_flight);
    let p = Proc::spawn(exe, dir, &name, &args)?;
    peers.push((i, p));
    Ok(Some(victim.name.clone()))
}

/// The stage a row explains: where compute binds (`what` ends in "compute"), the busiest
/// stage (stages whose bounds tie differ in how busy they actually are); else the stage
/// `what` names; else, when the trainers bind, the stage that waits longest on the network.
fn focus_stage(stages: &[StageTimes], what: &str) -> usize {
    let busiest = (0..stages.len())
        .filter_map(|i| stages[i].busy().map(|b| (i, b)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(i, _)| i)
        .filter(|_| what.ends_with("compute"));
    busiest
        .or_else(|| {
            what.strip_prefix("stage ")
                .and_then(|r| r.split_whitespace().next())
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or_else(|| {
            (0..stages.len())
                .max_by(|&a, &b| stages[a].read_ms.total_cmp(&stages[b].read_ms))
                .unwrap_or(0)
        })
}
