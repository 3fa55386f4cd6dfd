//! The setups `shoal bench swarm` measures (scenarios of replicas, links and trainers),
//! the physical bound each is measured against, and the rows it reports. Pure: nothing
//! here starts a process. Every peer sits behind an emulated home link; stages are the
//! timed `sim` stand-in or the real model.
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

use shoal::config::{RunConfig, StageKind};
use shoal::net::link::LinkSpec;
use shoal::stage::service::CounterSnapshot;
use shoal::wire::CodecSpec;
use std::path::PathBuf;
use std::time::Duration;

/// The scenarios `--scenario` knows.
pub const SCENARIOS: &[&str] = &[
    "homogeneous",
    "heterogeneous",
    "compression",
    "churn",
    "real",
    "pipeline",
    "large",
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
    /// Measured as the `large` scenario ([`super::bench_large`]): averaging rounds and a
    /// joiner's state download instead of throughput.
    pub large: bool,
    /// The trainers keep synchronous steps (every gradient of step s computed at
    /// parameters s); otherwise they never wait and replicas bound staleness at one step
    /// (delayed updates).
    pub sync: bool,
}

impl Setup {
    /// How its steps go: `synchronous` or `delayed`.
    pub fn mode(&self) -> &'static str {
        if self.sync {
            "synchronous"
        } else {
            "delayed"
        }
    }
}

/// What one setup measured.
#[derive(Debug, Clone, Default)]
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
    /// Per stage, the replicas' counters summed over the measured window.
    pub stages: Vec<StageTimes>,
    /// The stage whose breakdown explains the row (the bottleneck, or the slowest).
    pub focus: usize,
    /// The highest peak resident memory a replica reported, MiB (0: unknown).
    pub peak_rss_mib: f64,
    /// The `large` scenario's figures.
    pub large: Option<super::bench_large::LargeFigures>,
    /// Pipeline stages of the run.
    pub stage_count: usize,
    /// `synchronous` or `delayed`.
    pub mode: String,
    /// Samples per microbatch.
    pub microbatch: usize,
    /// Samples per optimizer step.
    pub target_batch: usize,
    /// Synchronous microbatches started again because their step closed on the way.
    pub restarts: u64,
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
    /// The times in a replica's counters (as it reports them in its status stream).
    pub fn of(c: &CounterSnapshot) -> Self {
        let ms = |us: u64| us as f64 / 1e3;
        let mb = |b: u64| b as f64 / 1e6;
        Self {
            jobs: c.jobs as f64,
            compute_ms: ms(c.compute_us),
            queue_ms: ms(c.queue_us),
            read_ms: ms(c.read_us),
            write_ms: ms(c.write_us),
            codec_ms: ms(c.decode_us + c.encode_us),
            in_mb: mb(c.stage_in),
            out_mb: mb(c.stage_out),
            window_ms: 0.0,
        }
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

    pub fn add(&mut self, o: &Self) {
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
        let mut v = self.base_json();
        if let (Some(l), serde_json::Value::Object(m)) = (&self.large, &mut v) {
            m.extend(l.to_json());
        }
        v
    }

    fn base_json(&self) -> serde_json::Value {
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
            "peak_rss_mib": self.peak_rss_mib,
            "stages": self.stage_count,
            "mode": self.mode,
            "microbatch": self.microbatch,
            "target_batch": self.target_batch,
            "restarts": self.restarts,
            "stage_times": self.stages.iter().map(|t| t.to_json()).collect::<Vec<_>>(),
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

pub fn link(s: &str) -> LinkSpec {
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
    cfg.codecs.activations = codec.into();
    cfg.training.steps = 1_000_000;
    cfg.training.target_batch_size = Some(SIM_TARGET_BATCH);
    cfg
}

/// Samples per optimizer step in the benchmark runs: large enough that the microbatches
/// in flight across the links (and the one step of staleness allowed) do not wait on
/// averaging rounds.
pub const SIM_TARGET_BATCH: usize = 512;

/// Microbatches each trainer keeps in flight in the `real` scenario, at most. A real stage
/// keeps every in-flight microbatch's forward graph: at the sim scenarios' 96 each peer grew
/// to 1.4 GB within seconds, the page faults of that growth took a fifth of the CPU, and
/// the swarm did 121–155 samples/s; at 8 it waited on latency, and 12 did best of 8–16
/// (BENCHMARKS.md).
pub const REAL_CONCURRENCY: usize = 12;

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
        large: false,
        sync: false,
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
            s.concurrency = opts.concurrency.min(REAL_CONCURRENCY);
            let mut run = RunConfig::tiny();
            run.stages.count = 4;
            run.stages.cuts.clear();
            run.training.steps = 1_000_000;
            run.training.target_batch_size = Some(SIM_TARGET_BATCH);
            s.run = run;
            vec![s]
        }
        "pipeline" => {
            // The homogeneous swarm (4 stages x 2 replicas, 2 trainers, home links) on
            // real stages, its trainers keeping synchronous steps.
            let mut s = homogeneous("pipeline", int8z);
            s.run = pipeline_run();
            s.concurrency = 4;
            s.sync = true;
            vec![s]
        }
        "large" => vec![super::bench_large::setup(home)],
        _ => return None,
    })
}

/// The run of the `pipeline` scenario: real candle stages of a small Llama (d256, 16
/// blocks, 4 per stage, seq 128, vocabulary 512) in 4 stages, synchronous steps of 4
/// microbatches of 8. Each stage's forward and backward of a microbatch costs a few hundred
/// milliseconds of one core, so the cores, not the 50 ms links, should bind: the question
/// is whether synchronous steps keep them busy.
fn pipeline_run() -> RunConfig {
    let mut run = RunConfig::tiny();
    run.model.family = shoal::config::Family::Llama;
    run.model.vocab = 512;
    run.model.d_model = 256;
    run.model.n_heads = 8;
    run.model.n_kv_heads = Some(4);
    run.model.n_layers = 16;
    run.model.seq_len = 128;
    run.stages.count = 4;
    run.stages.cuts.clear();
    run.training.batch_size = PIPELINE_MICROBATCH;
    run.training.target_batch_size = Some(4 * PIPELINE_MICROBATCH);
    run.training.steps = 1_000_000;
    run
}

/// Samples per microbatch of the `pipeline` scenario.
pub const PIPELINE_MICROBATCH: usize = 8;

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
///
/// `cores`: the cores every process of the swarm shares, when its stages compute for real
/// (a `sim` stage sleeps and uses none). Each replica's throughput was measured alone on
/// one thread, so a sample costs Σ over stages of 1/(its replicas' mean throughput) core
/// seconds, and the machine does at most `cores` of those per second, whatever the
/// replicas would do each on a core of its own.
pub fn bound(setup: &Setup, compute: &[f64], ratio: f64, cores: Option<f64>) -> (f64, String, f64) {
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
    if let Some(cores) = cores {
        let mut core_s = 0.0;
        for s in 0..stages {
            let own: Vec<f64> = setup
                .replicas
                .iter()
                .zip(compute)
                .filter(|(r, _)| r.stage == s)
                .map(|(_, &c)| c)
                .collect();
            let mean = own.iter().sum::<f64>() / own.len().max(1) as f64;
            core_s += 1.0 / mean;
        }
        let shared = cores / core_s;
        if shared < best.0 {
            best = (shared, format!("{cores:.0} shared cores compute"));
        }
        slowest_compute = slowest_compute.min(shared);
    }
    (best.0, best.1, slowest_compute)
}

pub fn link_arg(l: &LinkSpec) -> String {
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

#[cfg(test)]
#[path = "scenarios_tests.rs"]
mod tests;
