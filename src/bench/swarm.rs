//! `shoal bench swarm`: a local swarm of separate processes (every peer behind an emulated
//! home link, stages the timed `sim` stand-in or the real model), measured against the
//! best any system could do with the same stages and links.
//!
//! The bound is the minimum, over every stage and over the trainers, of what that part
//! can carry: for a replica, `min(compute samples/s, down ÷ bytes it receives per sample,
//! up ÷ bytes it sends per sample)`, summed over the stage's replicas; for the trainers,
//! the same with the bytes of every hop. Our routing is trainer-centric: a trainer sends
//! each stage its input and receives its output, and sends the input again with the
//! gradient for backward, so every activation crosses a trainer's link twice and the
//! trainers' links are counted as a stage of their own. Bytes per hop are the raw tensor
//! sizes times the wire/raw ratio the trainers measured, so compression is counted as it
//! happened. Latency is not in the bound (enough microbatches in flight hide it).

use crate::config::{RunConfig, StageKind};
use crate::dht::Manifest;
use crate::net::link::LinkSpec;
use crate::stage::service::CounterValues;
use crate::swarm::demo::{peer_args, spawn_bootstrap, stop_all, sum, DemoError, Proc};
use crate::trainer::report::Progress;
use crate::wire::CodecSpec;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The scenarios `--scenario` knows.
pub const SCENARIOS: &[&str] = &[
    "homogeneous",
    "heterogeneous",
    "compression",
    "churn",
    "real",
];

/// One replica of a scenario.
#[derive(Debug, Clone)]
pub struct ReplicaSpec {
    /// Stage served.
    pub stage: usize,
    /// Its access link.
    pub link: LinkSpec,
    /// Multiplier of the sim time per sample (1 = as configured).
    pub slowdown: f64,
}

/// A swarm to measure.
#[derive(Debug, Clone)]
pub struct Setup {
    /// Row label.
    pub label: String,
    /// The run (its stage kind, codecs, model sizes).
    pub run: RunConfig,
    /// Stage peers.
    pub replicas: Vec<ReplicaSpec>,
    /// One link per trainer process.
    pub trainers: Vec<LinkSpec>,
    /// Microbatches each trainer keeps in flight.
    pub concurrency: usize,
    /// SIGKILL a replica this often and start a fresh peer.
    pub churn: Option<Duration>,
    /// The trainers' `--routing`.
    pub routing: &'static str,
    /// The trainers' `--call-timeout` (seconds); `None`: their default.
    pub call_timeout: Option<f64>,
}

/// What one setup measured.
#[derive(Debug, Clone)]
pub struct Row {
    /// Scenario (and variant) name.
    pub scenario: String,
    /// Samples/s completed in the measured window.
    pub samples_per_s: f64,
    /// The physical bound, samples/s.
    pub bound: f64,
    /// samples_per_s ÷ bound.
    pub efficiency: f64,
    /// Frame bytes on the trainers' links per completed sample.
    pub bytes_per_sample: f64,
    /// What the bound is made of: the limiting part.
    pub bottleneck: String,
    /// The slowest stage's compute utilisation (measured ÷ its compute throughput).
    pub utilisation: f64,
    /// Samples fed, completed and reported failed over the whole run.
    pub fed: u64,
    /// Completed samples.
    pub completed: u64,
    /// Failed samples (each with a reason in the trainer's output).
    pub failed: u64,
    /// fed − completed − failed after the trainers stopped: samples that vanished.
    pub vanished: i64,
    /// Replicas killed (churn).
    pub killed: usize,
    /// Calls the trainers repeated on another replica.
    pub swaps: u64,
    /// Per stage, the replicas' counters summed (from the lines they print on stop).
    pub stages: Vec<StageTimes>,
    /// The stage whose breakdown explains the row (the bottleneck, or the slowest).
    pub focus: usize,
}

/// Where a stage's replicas spent their time, summed over replicas.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StageTimes {
    /// Forward and backward jobs run.
    pub jobs: f64,
    /// Milliseconds computing.
    pub compute_ms: f64,
    /// Milliseconds jobs waited in the queue.
    pub queue_ms: f64,
    /// Milliseconds reading requests (waiting for the caller's bytes included).
    pub read_ms: f64,
    /// Milliseconds writing answers.
    pub write_ms: f64,
    /// Milliseconds decoding and encoding tensors.
    pub codec_ms: f64,
    /// Frame MB in and out of forward/backward calls.
    pub in_mb: f64,
    /// See `in_mb`.
    pub out_mb: f64,
    /// Milliseconds of wall time the counters cover, summed over replicas (0: unknown).
    pub window_ms: f64,
}

impl StageTimes {
    /// Parses `stage S replica counters: ...` (what a peer prints on stop: its stage, then
    /// [`crate::stage::service::Counters::line`]) into (S, times).
    pub fn parse(line: &str) -> Option<(usize, Self)> {
        let rest = line.trim().strip_prefix("stage ")?;
        let (stage, rest) = rest.split_once(' ')?;
        let v = CounterValues::parse(rest)?;
        Some((
            stage.parse().ok()?,
            Self {
                jobs: v.jobs,
                compute_ms: v.compute_ms,
                queue_ms: v.queue_ms,
                read_ms: v.read_ms,
                write_ms: v.write_ms,
                codec_ms: v.decode_ms + v.encode_ms,
                in_mb: v.stage_in_mb,
                out_mb: v.stage_out_mb,
                window_ms: 0.0,
            },
        ))
    }

    /// What happened between `earlier` and `self` (two readings of one replica's
    /// counters `ms` milliseconds apart).
    pub fn since(&self, earlier: &Self, ms: f64) -> Self {
        Self {
            jobs: self.jobs - earlier.jobs,
            compute_ms: self.compute_ms - earlier.compute_ms,
            queue_ms: self.queue_ms - earlier.queue_ms,
            read_ms: self.read_ms - earlier.read_ms,
            write_ms: self.write_ms - earlier.write_ms,
            codec_ms: self.codec_ms - earlier.codec_ms,
            in_mb: self.in_mb - earlier.in_mb,
            out_mb: self.out_mb - earlier.out_mb,
            window_ms: ms,
        }
    }

    /// Fraction of the window the replicas spent computing.
    pub fn busy(&self) -> Option<f64> {
        (self.window_ms > 0.0).then(|| self.compute_ms / self.window_ms)
    }

    fn add(&mut self, o: &Self) {
        self.jobs += o.jobs;
        self.compute_ms += o.compute_ms;
        self.queue_ms += o.queue_ms;
        self.read_ms += o.read_ms;
        self.write_ms += o.write_ms;
        self.codec_ms += o.codec_ms;
        self.in_mb += o.in_mb;
        self.out_mb += o.out_mb;
        self.window_ms += o.window_ms;
    }

    /// Busy fraction, then per job: compute, queue wait, network read and write, codec,
    /// in ms.
    pub fn line(&self) -> String {
        let j = self.jobs.max(1.0);
        let busy = self
            .busy()
            .map_or(String::new(), |b| format!("busy {b:.2}; "));
        format!(
            "{busy}per job: compute {:.1} ms, queue wait {:.1} ms, reading the request {:.1} ms, writing the answer {:.1} ms, encode+decode {:.2} ms; {:.0} jobs, {:.1} MB in, {:.1} MB out",
            self.compute_ms / j,
            self.queue_ms / j,
            self.read_ms / j,
            self.write_ms / j,
            self.codec_ms / j,
            self.jobs,
            self.in_mb,
            self.out_mb
        )
    }

    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "jobs": self.jobs,
            "compute_ms": self.compute_ms,
            "queue_ms": self.queue_ms,
            "read_ms": self.read_ms,
            "write_ms": self.write_ms,
            "codec_ms": self.codec_ms,
            "in_mb": self.in_mb,
            "out_mb": self.out_mb,
            "window_ms": self.window_ms,
            "busy": self.busy(),
        })
    }
}

impl Row {
    /// The JSON object of this row.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "scenario": self.scenario,
            "samples_per_s": self.samples_per_s,
            "bound": self.bound,
            "efficiency": self.efficiency,
            "bytes_per_sample": self.bytes_per_sample,
            "bottleneck": self.bottleneck,
            "utilisation": self.utilisation,
            "fed": self.fed,
            "completed": self.completed,
            "failed": self.failed,
            "vanished": self.vanished,
            "killed": self.killed,
            "swaps": self.swaps,
            "focus_stage": self.focus,
            "stages": self.stages.iter().map(|t| t.to_json()).collect::<Vec<_>>(),
        })
    }
}

/// Header of the table [`Row::line`] prints.
pub const HEADER: &str = "scenario                   samples/s    bound  efficiency  bytes/sample  bottleneck            util  failed  vanished   swaps";

impl Row {
    /// One table line.
    pub fn line(&self) -> String {
        format!(
            "{:<24} {:>11.1} {:>8.1} {:>11.2} {:>13.0}  {:<20} {:>5.2} {:>7} {:>9} {:>7}",
            self.scenario,
            self.samples_per_s,
            self.bound,
            self.efficiency,
            self.bytes_per_sample,
            self.bottleneck,
            self.utilisation,
            self.failed,
            self.vanished,
            self.swaps
        )
    }
}

/// Knobs shared by every scenario.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// The `shoal` binary.
    pub exe: PathBuf,
    /// Seconds of warm-up before measuring.
    pub warmup: f64,
    /// Seconds measured (at most, when `samples` is set).
    pub seconds: f64,
    /// Close the window once this many samples completed after the warm-up.
    pub samples: Option<u64>,
    /// Microbatches in flight per trainer.
    pub concurrency: usize,
}

fn link(s: &str) -> LinkSpec {
    LinkSpec::parse(s).unwrap_or_else(|_| LinkSpec::unlimited())
}

/// The run of the sim scenarios: the tiny model's tensor sizes, 4 stages, 4 ms per sample
/// (250 samples/s per replica).
pub fn sim_run(codec: CodecSpec) -> RunConfig {
    let mut cfg = RunConfig::tiny();
    cfg.stages.count = 4;
    cfg.stages.cuts.clear();
    cfg.stages.kind = StageKind::Sim;
    cfg.stages.sim_ms_per_sample = Some(4.0);
    cfg.codecs.activations = codec;
    cfg.training.steps = 1_000_000;
    cfg.training.target_batch_size = Some(SIM_TARGET_BATCH);
    cfg
}

/// Samples per optimizer step in the benchmark runs: large enough that the microbatches
/// in flight across the links (and the one step of staleness allowed) do not wait on
/// averaging rounds.
pub const SIM_TARGET_BATCH: usize = 512;

/// The setups of a scenario.
pub fn scenario(name: &str, opts: &BenchOptions) -> Option<Vec<Setup>> {
    let home = link("bw=100mbit,rtt=50ms");
    let int8z = CodecSpec::INT8.with_zstd(1);
    let homogeneous = |label: &str, codec: CodecSpec| Setup {
        label: label.to_string(),
        run: sim_run(codec),
        replicas: (0..8)
            .map(|i| ReplicaSpec {
                stage: i % 4,
                link: home,
                slowdown: 1.0,
            })
            .collect(),
        trainers: vec![home; 2],
        concurrency: opts.concurrency,
        churn: None,
        routing: "wiring",
        call_timeout: None,
    };
    Some(match name {
        "homogeneous" => vec![homogeneous("homogeneous", int8z)],
        "compression" => {
            let mut rows: Vec<Setup> = ["f32", "bf16", "int8", "int8+zstd1"]
                .iter()
                .filter_map(|c| c.parse::<CodecSpec>().ok().map(|spec| (c, spec)))
                .map(|(c, spec)| homogeneous(&format!("compression/{c}"), spec))
                .collect();
            // At 100 Mbit/s int8 already makes the swarm compute-bound, which caps what
            // compression can show; on 25 Mbit/s links every codec is link-bound.
            let slow = link("bw=25mbit,rtt=50ms");
            for (c, spec) in [("f32", CodecSpec::F32), ("int8+zstd1", int8z)] {
                let mut s = homogeneous(&format!("compression/{c}@25mbit"), spec);
                for r in &mut s.replicas {
                    r.link = slow;
                }
                s.trainers = vec![slow; s.trainers.len()];
                rows.push(s);
            }
            rows
        }
        "heterogeneous" => {
            let mut s = homogeneous("heterogeneous/wiring", int8z);
            // Replicas of stage 1 differ 4x in speed; links alternate 25 and 200 Mbit/s.
            for (i, r) in s.replicas.iter_mut().enumerate() {
                r.link = if i % 2 == 0 {
                    link("bw=25mbit,rtt=50ms")
                } else {
                    link("bw=200mbit,rtt=50ms")
                };
                if r.stage == 1 && i >= 4 {
                    r.slowdown = 4.0;
                }
            }
            // The fixed assignment: a blind rotation that never steers around the slow
            // replica. Its queue is deep enough never to refuse (see `replica_args`) and
            // calls never time out, so nothing adapts it.
            let mut fixed = s.clone();
            fixed.label = "heterogeneous/round-robin".into();
            fixed.routing = "round-robin";
            fixed.call_timeout = Some(3600.0);
            vec![s, fixed]
        }
        "churn" => {
            let mut s = homogeneous("churn", int8z);
            s.churn = Some(Duration::from_secs(20));
            vec![s]
        }
        "real" => {
            let mut s = homogeneous("real", int8z);
            let mut run = RunConfig::tiny();
            run.stages.count = 4;
            run.stages.cuts.clear();
            run.training.steps = 1_000_000;
            run.training.target_batch_size = Some(SIM_TARGET_BATCH);
            s.run = run;
            vec![s]
        }
        _ => return None,
    })
}

/// Raw (f32-sized) bytes per sample a replica of `stage` receives and sends, as our
/// trainer-centric routing moves them: forward input; for backward the input again and
/// the gradient of the output; out go the output and the input's gradient.
pub fn raw_bytes_per_sample(run: &RunConfig, stage: usize) -> (f64, f64) {
    let t = run.model.seq_len as f64;
    let act = 4.0 * t * run.model.d_model as f64;
    let ids = 4.0 * t;
    let last = run.stages.count - 1;
    match stage {
        0 if last == 0 => (2.0 * ids, 0.0),
        // Forward: ids in, activations out; backward: ids and the output gradient in.
        0 => (2.0 * ids + act, act),
        // Backward only, with the targets: input and ids in, input gradient out.
        s if s == last => (act + ids, act),
        _ => (3.0 * act, 2.0 * act),
    }
}

/// The bound of `setup` given each replica's compute throughput and the measured
/// wire/raw ratio; returns (bound, limiting part, slowest stage's compute).
pub fn bound(setup: &Setup, compute: &[f64], ratio: f64) -> (f64, String, f64) {
    let stages = setup.run.stages.count;
    let mut best = (f64::INFINITY, String::new());
    let mut slowest_compute = f64::INFINITY;
    let cap = |bw: Option<f64>, bytes: f64| match bw {
        Some(b) if bytes > 0.0 => b / bytes,
        _ => f64::INFINITY,
    };
    let (mut t_in, mut t_out) = (0.0, 0.0);
    for s in 0..stages {
        let (rin, rout) = raw_bytes_per_sample(&setup.run, s);
        let (win, wout) = (rin * ratio, rout * ratio);
        t_in += wout;
        t_out += win;
        let mut total = 0.0;
        let mut comp = 0.0;
        let mut compute_bound = true;
        for (r, &c) in setup.replicas.iter().zip(compute) {
            if r.stage != s {
                continue;
            }
            let net = cap(r.link.down, win).min(cap(r.link.up, wout));
            if net < c {
                compute_bound = false;
            }
            total += c.min(net);
            comp += c;
        }
        slowest_compute = slowest_compute.min(comp);
        if total < best.0 {
            let what = if compute_bound { "compute" } else { "links" };
            best = (total, format!("stage {s} {what}"));
        }
    }
    let trainers: f64 = setup
        .trainers
        .iter()
        .map(|l| cap(l.down, t_in).min(cap(l.up, t_out)))
        .sum();
    if trainers < best.0 {
        best = (trainers, "trainer links".into());
    }
    (best.0, best.1, slowest_compute)
}

fn trainer_args(setup: &Setup, id: &str, boot: &str, link: &LinkSpec, idx: usize) -> Vec<String> {
    let conc = setup.concurrency;
    [
        "train",
        "--run",
        id,
        "--bootstrap",
        boot,
        "--trainers",
        "1",
        "--concurrency",
        &conc.to_string(),
        "--data-index",
        &(idx as u64 * 1000).to_string(),
        "--report-ms",
        "250",
        "--no-sync-steps",
        "--routing",
        setup.routing,
        "--emulate-link",
        &link_arg(link),
    ]
    .iter()
    .map(|s| s.to_string())
    .chain(
        setup
            .call_timeout
            .into_iter()
            .flat_map(|t| ["--call-timeout".to_string(), t.to_string()]),
    )
    .collect()
}

fn link_arg(l: &LinkSpec) -> String {
    let mut parts = Vec::new();
    if let Some(u) = l.up {
        parts.push(format!("up={}kbit", (u * 8.0 / 1e3).round()));
    }
    if let Some(d) = l.down {
        parts.push(format!("down={}kbit", (d * 8.0 / 1e3).round()));
    }
    parts.push(format!("rtt={}us", l.rtt.as_micros()));
    parts.join(",")
}

/// Arguments of a stage peer. `in_flight` is the microbatches all trainers keep in flight:
/// every replica's queue holds them all, so a replica never refuses work for being full
/// (which would let the fixed round-robin baseline steer around a slow replica), and it
/// keeps as many forwards, so a backward never recomputes for want of room.
fn replica_args(
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

fn announced_throughput(line: &str) -> Option<f64> {
    // "serving stage S of N on DEV: X samples/s"
    let rest = line.rsplit_once(": ")?.1;
    rest.strip_suffix(" samples/s")?.trim().parse().ok()
}

/// Reads the trainers' output: their latest progress, and the reasons they print for
/// failed samples and swapped calls (`  failed N samples: why`) into `why`.
fn drain(trainers: &mut [Proc], last: &mut [Progress], why: &mut Vec<String>) {
    for (i, t) in trainers.iter_mut().enumerate() {
        while let Ok(l) = t.lines.try_recv() {
            if let Some(p) = Progress::parse(l.trim_start_matches("done: ")) {
                last[i] = p;
            } else if ["failed ", "swapped "]
                .iter()
                .any(|p| l.trim_start().starts_with(p))
            {
                why.push(format!("{}: {}", t.name, l.trim()));
            }
        }
    }
}

/// Each replica's latest counters (by process name): its stage, when they were read, and
/// their values.
type Readings = std::collections::HashMap<String, (usize, Instant, StageTimes)>;

/// Reads the counter lines the replicas print every `--counters-ms` into `latest`, and
/// each replica's first reading into `first` (their other output is consumed and
/// dropped).
fn read_counters(peers: &mut [(usize, Proc)], latest: &mut Readings, first: &mut Readings) {
    for (_, p) in peers.iter_mut() {
        while let Ok(l) = p.lines.try_recv() {
            if let Some((s, t)) = StageTimes::parse(&l) {
                let r = (s, Instant::now(), t);
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
) -> Result<Row, DemoError> {
    let dir = std::env::temp_dir().join(format!(
        "shoal-bench-{}-{}",
        std::process::id(),
        setup.label.replace('/', "-")
    ));
    std::fs::create_dir_all(&dir).map_err(|e| DemoError::Process(e.to_string()))?;
    let r = run_in(setup, opts, &dir, out);
    let _ = std::fs::remove_dir_all(&dir);
    r
}

fn run_in(
    setup: &Setup,
    opts: &BenchOptions,
    dir: &Path,
    out: &dyn Fn(String),
) -> Result<Row, DemoError> {
    let err = |e: &dyn std::fmt::Display| DemoError::Process(e.to_string());
    let m = Manifest::from_config(&setup.run).map_err(|e| err(&e))?;
    std::fs::write(dir.join("run.toml"), m.file_text()).map_err(|e| err(&e))?;
    let exe = &opts.exe;
    let (mut boot, baddr) = spawn_bootstrap(exe, dir)?;
    let in_flight = setup.concurrency * setup.trainers.len();
    let mut peers: Vec<(usize, Proc)> = Vec::new();
    let mut compute = Vec::new();
    for (i, r) in setup.replicas.iter().enumerate() {
        let name = format!("stage{}-replica{i}", r.stage);
        let args = replica_args(
            &m.id,
            &baddr,
            r,
            &format!("{name}.key"),
            &r.stage.to_string(),
            in_flight,
        );
        let mut p = Proc::spawn(exe, dir, &name, &args)?;
        let l = p.wait_line("samples/s", Duration::from_secs(60))?;
        compute.push(announced_throughput(&l).unwrap_or(0.0));
        peers.push((i, p));
    }
    for (_, p) in peers.iter_mut() {
        p.wait_line("ready", Duration::from_secs(60))?;
    }
    let mut trainers = Vec::new();
    for (t, l) in setup.trainers.iter().enumerate() {
        let args = trainer_args(setup, &m.id, &baddr, l, t);
        trainers.push(Proc::spawn(exe, dir, &format!("trainer{t}"), &args)?);
    }
    let mut last = vec![Progress::default(); trainers.len()];
    let mut why = Vec::new();
    let started = Instant::now();
    let warm_end = started + Duration::from_secs_f64(opts.warmup);
    // A churn window holds at least two kills and 5 s after the second, whatever
    // `--seconds` says (kills come every period from the start).
    let seconds = match setup.churn {
        Some(p) => {
            let p = p.as_secs_f64();
            let first_inside = (opts.warmup / p).floor() + 1.0;
            opts.seconds
                .max((first_inside + 1.0) * p + 5.0 - opts.warmup)
        }
        None => opts.seconds,
    };
    let end = warm_end + Duration::from_secs_f64(seconds);
    let mut at_warm: Option<(Instant, Progress)> = None;
    let (mut latest, mut first) = (Readings::new(), Readings::new());
    let mut warm_readings = Readings::new();
    let mut next_kill = setup.churn.map(|p| started + p);
    let mut killed = 0;
    let mut next_print = started;
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100));
        drain(&mut trainers, &mut last, &mut why);
        read_counters(&mut peers, &mut latest, &mut first);
        let now = Instant::now();
        if at_warm.is_none() && now >= warm_end {
            at_warm = Some((now, sum(&last)));
            warm_readings = latest.clone();
        }
        if let (Some(n), Some((_, p0))) = (opts.samples, &at_warm) {
            if sum(&last).completed.saturating_sub(p0.completed) >= n {
                break;
            }
        }
        if let (Some(k), Some(period)) = (next_kill, setup.churn) {
            if now >= k {
                next_kill = Some(now + period);
                // The oldest replica of stage 1 dies; a fresh peer joins where it is weakest.
                if let Some(pos) = peers
                    .iter()
                    .position(|(i, _)| setup.replicas.get(*i).map(|r| r.stage) == Some(1))
                {
                    let (i, mut victim) = peers.remove(pos);
                    let _ = victim.child.kill();
                    let _ = victim.child.wait();
                    killed += 1;
                    let spec = setup.replicas[i].clone();
                    let name = format!("joiner{killed}");
                    let key = format!("{name}.key");
                    let args = replica_args(&m.id, &baddr, &spec, &key, "auto", in_flight);
                    out(format!("churn: SIGKILLed {}, starting {name}", victim.name));
                    let p = Proc::spawn(exe, dir, &name, &args)?;
                    peers.push((i, p));
                }
            }
        }
        if now >= next_print {
            next_print = now + Duration::from_secs(5);
            let s = sum(&last);
            out(format!(
                "  [{:>4.0}s] {}: completed {} failed {} wire {:.1} MB",
                started.elapsed().as_secs_f64(),
                setup.label,
                s.completed,
                s.failed,
                s.wire as f64 / 1e6
            ));
        }
    }
    drain(&mut trainers, &mut last, &mut why);
    read_counters(&mut peers, &mut latest, &mut first);
    let end_readings = latest.clone();
    let fin = sum(&last);
    let (t0, p0) = at_warm.unwrap_or((started, Progress::default()));
    let secs = t0.elapsed().as_secs_f64().max(1e-9);
    let done = fin.completed.saturating_sub(p0.completed);
    let samples_per_s = done as f64 / secs;
    let bytes_per_sample = fin.wire.saturating_sub(p0.wire) as f64 / (done.max(1)) as f64;
    let ratio = if fin.raw > 0 {
        fin.wire as f64 / fin.raw as f64
    } else {
        1.0
    };
    // Stop the trainers gracefully (SIGTERM): in-flight microbatches finish, and the last
    // line gives the final accounting.
    stop_all(trainers.iter_mut(), Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(300));
    drain(&mut trainers, &mut last, &mut why);
    let end_p = sum(&last);
    for w in &why {
        out(format!("  {w}"));
    }
    stop_all(peers.iter_mut().map(|(_, p)| p), Duration::from_secs(15));
    // The breakdown covers the measured window only: the difference of the readings
    // taken as it opened and as it closed.
    let mut stages = vec![StageTimes::default(); setup.run.stages.count];
    for (name, s, t) in window(&warm_readings, &end_readings, &first) {
        out(format!("  {name}: {}", t.line()));
        if let Some(acc) = stages.get_mut(s) {
            acc.add(&t);
        }
    }
    boot.stop();
    let (b, what, slowest) = bound(setup, &compute, ratio);
    // Where compute binds, the busiest stage is the one holding the swarm back (stages
    // whose bounds tie differ in how busy they actually are).
    let busiest = (0..stages.len())
        .filter_map(|i| stages[i].busy().map(|b| (i, b)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(i, _)| i)
        .filter(|_| what.ends_with("compute"));
    let focus = busiest
        .or_else(|| {
            what.strip_prefix("stage ")
                .and_then(|r| r.split_whitespace().next())
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or_else(|| {
            // The trainers bind: explain the stage that waits longest on the network.
            (0..stages.len())
                .max_by(|&a, &b| stages[a].read_ms.total_cmp(&stages[b].read_ms))
                .unwrap_or(0)
        });
    Ok(Row {
        scenario: setup.label.clone(),
        samples_per_s,
        bound: b,
        efficiency: if b > 0.0 { samples_per_s / b } else { 0.0 },
        bytes_per_sample,
        bottleneck: what,
        utilisation: if slowest > 0.0 {
            samples_per_s / slowest
        } else {
            0.0
        },
        fed: end_p.fed,
        completed: end_p.completed,
        failed: end_p.failed,
        vanished: end_p.fed as i64 - end_p.completed as i64 - end_p.failed as i64,
        killed,
        swaps: end_p.swaps,
        stages,
        focus,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bound_counts_the_trainer_hops() {
        let opts = BenchOptions {
            exe: PathBuf::new(),
            warmup: 0.0,
            seconds: 0.0,
            samples: None,
            concurrency: 1,
        };
        let s = scenario("homogeneous", &opts).unwrap().remove(0);
        // Unlimited compute: links bound it. Per sample (f32 sizes, ratio 1): a middle
        // replica receives 3 activations of 16 KiB; a trainer sends every input twice.
        let (b, what, _) = bound(&s, &[f64::INFINITY; 8], 1.0);
        let act = 4.0 * 64.0 * 64.0;
        let ids = 4.0 * 64.0;
        let trainer_out: f64 = (2.0 * ids + act) + 2.0 * 3.0 * act + (act + ids);
        let want = 2.0 * 12.5e6 / trainer_out;
        assert_eq!(what, "trainer links");
        assert!((b - want).abs() < 1e-6 * want, "{b} vs {want}");
        // Slow compute: 250 samples/s per replica, 500 per stage, binds.
        let (b, what, slowest) = bound(&s, &[250.0; 8], 0.25);
        assert_eq!((b, slowest), (500.0, 500.0));
        assert!(what.contains("compute"), "{what}");
    }

    #[test]
    fn every_scenario_is_defined_and_link_args_round_trip() {
        let opts = BenchOptions {
            exe: PathBuf::new(),
            warmup: 0.0,
            seconds: 0.0,
            samples: None,
            concurrency: 1,
        };
        for name in SCENARIOS {
            let setups = scenario(name, &opts).unwrap();
            assert!(!setups.is_empty());
            for s in setups {
                s.run.validate().unwrap();
                for r in &s.replicas {
                    let back = LinkSpec::parse(&link_arg(&r.link)).unwrap();
                    assert!((back.up.unwrap() - r.link.up.unwrap()).abs() < 1.0);
                    assert_eq!(back.rtt, r.link.rtt);
                }
            }
        }
        assert!(scenario("nope", &opts).is_none());
        assert_eq!(
            announced_throughput("serving stage 1 of 4 on cpu: 250.0 samples/s"),
            Some(250.0)
        );
        use std::sync::atomic::Ordering::Relaxed;
        let c = crate::stage::service::Counters::default();
        c.jobs.store(10, Relaxed);
        c.compute_us.store(200_000, Relaxed);
        c.decode_us.store(1_000, Relaxed);
        c.encode_us.store(2_000, Relaxed);
        c.stage_in.store(1_500_000, Relaxed);
        // The line exactly as a peer prints it on stop.
        let (s, t) = StageTimes::parse(&format!("stage 2 {}", c.line())).unwrap();
        assert_eq!(s, 2);
        assert_eq!(
            (t.jobs, t.compute_ms, t.codec_ms, t.in_mb),
            (10.0, 200.0, 3.0, 1.5)
        );
        assert!(t.line().contains("compute 20.0 ms"));
        assert!(StageTimes::parse("stage x replica counters: jobs 1").is_none());
    }
}
