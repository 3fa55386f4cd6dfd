//! The commands that start many peers or measure: `demo` (the swarm one), `bench
//! transfer`, `bench allreduce`, `bench swarm` and `bench converge`, with their tables.

use crate::harness::bench_converge::{self as bc, ConvergeRow};
use crate::harness::{bench_large, bench_swarm, demo as swarm_demo, scenarios as bs};
use crate::peer_cmd::runtime;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

pub fn bench_transfer(
    mib: usize,
    reps: usize,
    codecs: Option<String>,
    quic: bool,
) -> Result<ExitCode> {
    if mib == 0 || mib > 256 {
        bail!("--mib must be between 1 and 256 (the frame limit)");
    }
    let mut cfg = shoal::bench::transfer::TransferBenchConfig {
        mib,
        reps: reps.max(1),
        quic,
        ..Default::default()
    };
    if let Some(list) = codecs {
        cfg.codecs = list
            .split(',')
            .map(crate::parse_codec)
            .collect::<Result<_>>()?;
    }
    println!(
        "transfer benchmark: one {mib} MiB f32 tensor between two peers on 127.0.0.1 over {}, median of {}",
        if quic { "QUIC" } else { "TCP+noise+yamux" },
        cfg.reps
    );
    let rt = runtime()?;
    let rows = rt.block_on(shoal::bench::transfer::run(&cfg))?;
    print!("{}", shoal::bench::transfer::table(&cfg, &rows));
    Ok(ExitCode::SUCCESS)
}

pub fn bench_streams(
    connections: usize,
    at_once: usize,
    bursts: usize,
    json: Option<PathBuf>,
) -> Result<ExitCode> {
    let cfg = shoal::bench::streams::StreamsBenchConfig {
        connections,
        at_once,
        bursts,
        ..Default::default()
    };
    println!(
        "streams benchmark: {bursts} bursts of {connections} callers × {at_once} calls at once, each on a fresh stream, at one stage-0 replica (tiny model, queue of 8) on 127.0.0.1"
    );
    let rt = runtime()?;
    let report = rt.block_on(shoal::bench::streams::run(&cfg))?;
    print!("{}", shoal::bench::streams::table(&report));
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&[&report])?;
        shoal::files::write_atomic(&path, text.as_bytes())
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The home link of `bench compress`'s swarm rows.
const SLOW_LINK: &str = "bw=20mbit,rtt=50ms";

pub fn bench_compress(
    codecs: &str,
    (steps, swarm_samples, averaging): (u64, u64, &str),
    d_model: usize,
    text: Option<PathBuf>,
    json: Option<PathBuf>,
) -> Result<ExitCode> {
    use shoal::bench::compress::{self as bc, CompressBenchConfig};
    if steps == 0 || d_model < 64 || d_model % 64 != 0 {
        bail!("--steps must be at least 1 and --d-model a multiple of 64");
    }
    let mode = match averaging {
        "step" => "synchronous",
        "outer" => "outer",
        other => bail!("--averaging must be step or outer, not {other:?}"),
    };
    let scratch = match &text {
        Some(_) => None,
        None => Some(bc::docs_file()?),
    };
    let text = text.or_else(|| scratch.as_ref().map(|s| s.path().to_path_buf()));
    let cfg = CompressBenchConfig {
        text: text.clone(),
        codecs: codecs
            .split(',')
            .map(|c| c.parse::<shoal::wire::ActivationCodec>())
            .collect::<Result<_, _>>()?,
        steps,
        d_model,
        ..Default::default()
    };
    println!(
        "compress benchmark: a Llama of byte tokens, d{d_model}, 4 blocks in 2 stages, {steps} steps of 16 × 64 tokens per codec, `train --local` (boundaries through the codec)"
    );
    let rows = bc::run(&cfg, &mut |r| {
        eprintln!(
            "{}: {:.0} bytes/sample, eval loss {:.4}",
            r.codec, r.activation_bytes_per_sample, r.eval_loss
        )
    })?;
    print!("{}", bc::table(&rows));
    let mut all: Vec<serde_json::Value> = rows
        .iter()
        .map(serde_json::to_value)
        .collect::<Result<_, _>>()?;
    if swarm_samples > 0 {
        let link = shoal::net::link::LinkSpec::parse(SLOW_LINK).map_err(anyhow::Error::msg)?;
        let file = text.clone().unwrap_or_default();
        let runs: Vec<(String, shoal::config::RunConfig)> = cfg
            .codecs
            .iter()
            .map(|&c| {
                let mut run = bc::bench_config(&file, d_model, steps);
                run.codecs.activations = c;
                (c.to_string(), run)
            })
            .collect();
        println!("\nswarm rows: 2 stages x 2 replicas, 2 trainers, synchronous steps of 32 ({averaging} averaging), every process behind {SLOW_LINK}");
        let exe = std::env::current_exe().context("cannot find the shoal binary to start peers")?;
        let swarm = runtime()?.block_on(crate::harness::bench_compress::swarm_rows(
            exe,
            &runs,
            (swarm_samples, mode),
            link,
        ))?;
        print!("{}", crate::harness::bench_compress::table(&swarm));
        for r in &swarm {
            all.push(serde_json::to_value(r)?);
        }
    }
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&all)?;
        shoal::files::write_atomic(&path, text.as_bytes())
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

pub fn demo(
    stages: usize,
    replicas: usize,
    trainers: usize,
    steps: Option<u64>,
    churn: bool,
) -> Result<ExitCode> {
    if stages == 0 || replicas == 0 || trainers == 0 {
        bail!("--stages, --replicas and --trainers must be at least 1");
    }
    if churn && replicas < 2 {
        bail!("churn needs at least 2 replicas per stage (or pass --no-churn)");
    }
    let exe = std::env::current_exe().context("cannot find the shoal binary to start peers")?;
    let steps = steps.unwrap_or(swarm_demo::DEMO_STEPS);
    let cfg = swarm_demo::DemoConfig {
        exe,
        stages,
        replicas,
        trainers,
        steps,
        churn,
    };
    println!("shoal demo: a swarm of processes on 127.0.0.1 trains the built-in tiny model on the built-in Markov corpus");
    let rt = runtime()?;
    let bar = crate::progress::Bar::new(steps, "step");
    let r = rt.block_on(swarm_demo::run(&cfg, &bar))?;
    let p = &r.progress;
    println!(
        "done: {} steps in {:.1} s, {:.1} samples/s; samples fed {} completed {} failed {}",
        p.step,
        r.seconds,
        p.completed as f64 / r.seconds.max(1e-9),
        p.fed,
        p.completed,
        p.failed
    );
    if let Some(s) = r.first_step_s {
        println!("first step applied {s:.1} s after launch");
    }
    println!(
        "wire: trainers moved {:.1} MB of frames for {:.1} MB of f32 tensors ({:.2}x smaller)",
        p.wire as f64 / 1e6,
        p.raw as f64 / 1e6,
        p.raw as f64 / p.wire.max(1) as f64
    );
    for (s, reps) in r.hashes.iter().enumerate() {
        let list: Vec<String> = reps
            .iter()
            .map(|(peer, step, hash)| format!("{}..@{step}:{hash}", &peer[..12.min(peer.len())]))
            .collect();
        println!("stage {s} replicas: {}", list.join("  "));
    }
    println!(
        "replica parameters {}",
        if r.identical {
            "identical within every stage"
        } else {
            "DIFFER within a stage"
        }
    );
    let entropy = r
        .entropy
        .map(|h| format!(", corpus entropy {h:.4} (gap {:.4})", r.eval_loss - h))
        .unwrap_or_default();
    match r.target {
        Some(t) if r.eval_loss <= t && r.identical => {
            println!(
                "demo ok: eval loss {:.4} reached the target {t}{entropy}",
                r.eval_loss
            );
            Ok(ExitCode::SUCCESS)
        }
        Some(t) => {
            println!(
                "demo FAILED: eval loss {:.4} (target {t}){entropy}",
                r.eval_loss
            );
            Ok(ExitCode::FAILURE)
        }
        None => Ok(ExitCode::SUCCESS),
    }
}

pub fn bench_swarm(
    scenarios: &str,
    (seconds, samples): (f64, Option<u64>),
    warmup: f64,
    concurrency: usize,
    json: Option<PathBuf>,
) -> Result<ExitCode> {
    if !(seconds.is_finite() && seconds >= 1.0 && warmup.is_finite() && warmup >= 0.0) {
        bail!("--seconds must be at least 1 and --warmup at least 0");
    }
    if concurrency == 0 {
        bail!("--concurrency must be at least 1");
    }
    if samples == Some(0) {
        bail!("--samples must be at least 1");
    }
    let names: Vec<&str> = if scenarios == "all" {
        bs::SCENARIOS.to_vec()
    } else {
        scenarios.split(',').map(str::trim).collect()
    };
    let opts = bs::BenchOptions {
        exe: std::env::current_exe().context("cannot find the shoal binary to start peers")?,
        warmup,
        seconds,
        samples,
        concurrency,
    };
    let mut setups = Vec::new();
    for n in &names {
        match bs::scenario(n, &opts) {
            Some(s) => setups.extend(s),
            None => bail!(
                "unknown scenario {n:?}; known: {}, all",
                bs::SCENARIOS.join(", ")
            ),
        }
    }
    let mut rows = Vec::new();
    for s in &setups {
        println!(
            "running {} ({} replicas, {} trainers)",
            s.label,
            s.replicas.len(),
            s.trainers.len()
        );
        let row = if s.large {
            bench_large::run(s, &opts, &|l| println!("{l}"))?
        } else {
            bench_swarm::run_setup(s, &opts, &|l| println!("{l}"))?
        };
        println!("{}", bs::HEADER);
        println!("{}", row.line());
        if let Some(t) = row.stages.get(row.focus) {
            println!(
                "  stage {} (bound: {}) {}",
                row.focus,
                row.bottleneck,
                t.line()
            );
        }
        rows.push(row);
    }
    println!();
    println!("{}", bs::HEADER);
    for r in &rows {
        println!("{}", r.line());
    }
    if let Some(path) = json {
        let v = serde_json::Value::Array(rows.iter().map(|r| r.to_json()).collect());
        let text = serde_json::to_string_pretty(&v)?;
        shoal::files::write_atomic(&path, text.as_bytes())
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

pub fn bench_allreduce(
    peers: usize,
    floats: usize,
    codec: &str,
    link: Option<&str>,
    reps: usize,
) -> Result<ExitCode> {
    use shoal::bench::allreduce as ar;
    let cfg = ar::AllreduceConfig {
        peers,
        floats,
        codec: codec.parse()?,
        link: link.map(shoal::net::link::LinkSpec::parse).transpose()?,
        reps,
    };
    let rt = runtime()?;
    let r = rt.block_on(ar::run(&cfg))?;
    let link = cfg
        .link
        .map_or_else(|| "no emulation".to_string(), |l| l.to_string());
    println!(
        "all-reduce of {floats} floats among {peers} peers, {} ({link})",
        cfg.codec
    );
    println!(
        "median {:.1} ms, best {:.1} ms; vector {:.2} MB encoded",
        r.median_s * 1e3,
        r.best_s * 1e3,
        r.vector_bytes as f64 / 1e6
    );
    match r.bound_s {
        Some(b) => println!(
            "bound 2(N-1)/N x bytes / bandwidth = {:.1} ms: efficiency {:.2}",
            b * 1e3,
            b / r.median_s
        ),
        None => println!("no bandwidth limit: no bound"),
    }
    println!(
        "error vs the exact mean: max abs {:.2e}, relative RMS {:.2e}",
        r.max_abs_err, r.rel_rms_err
    );
    Ok(ExitCode::SUCCESS)
}

/// `shoal bench stage`.
pub fn bench_stage(
    config: &std::path::Path,
    stage: usize,
    device: &str,
    dtypes: &str,
    batch: Option<usize>,
    seconds: f64,
    json: bool,
) -> Result<ExitCode> {
    use shoal::bench::stage;
    let cfg = shoal::config::RunConfig::load(config)?;
    let dev = shoal::model::parse_device(device).map_err(anyhow::Error::msg)?;
    if stage >= cfg.stages.count {
        bail!("--stage {stage}: the run has {} stages", cfg.stages.count);
    }
    if !(seconds.is_finite() && seconds > 0.0) {
        bail!("--seconds must be positive");
    }
    // The gradient check on a small model of the same family, on this device.
    let mut small = shoal::config::RunConfig::tiny();
    small.model.family = cfg.model.family;
    small.model.n_kv_heads = (cfg.model.family == shoal::config::Family::Llama).then_some(2);
    let err = stage::gradient_check(&small, 2, &dev)?;
    let mut rows = Vec::new();
    for d in dtypes.split(',') {
        let dtype = match d.trim() {
            "f32" => candle_core::DType::F32,
            "bf16" => candle_core::DType::BF16,
            "f16" => candle_core::DType::F16,
            other => bail!("unknown dtype {other:?} (f32, bf16, f16)"),
        };
        let b = batch.unwrap_or(cfg.training.batch_size).max(1);
        let r = stage::throughput(&cfg, stage, &dev, dtype, b, seconds)?;
        if !json {
            println!(
                "stage {} of {} ({:.1}M parameters) on {device}, {}: batch {} x {} tokens, {} passes, {:.0} tokens/s forward+backward",
                r.stage,
                config.display(),
                r.params as f64 / 1e6,
                r.dtype,
                r.batch,
                cfg.model.seq_len,
                r.passes,
                r.tokens_per_s
            );
        }
        rows.push(r);
    }
    if json {
        println!(
            "{}",
            serde_json::json!({"gradient_check_max_rel_err": err, "rows": rows})
        );
    } else {
        println!(
            "staged gradients = unsplit on {device}: max relative error {err:.2e} ({})",
            if err < 1e-3 { "ok" } else { "TOO LARGE" }
        );
    }
    Ok(if err < 1e-3 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

#[derive(Args)]
pub struct ConvergeArgs {
    /// Samples every mode trains.
    #[arg(long, default_value_t = 12800, value_name = "N")]
    samples: u64,
    /// Comma-separated modes: synchronous, no-sync, delayed, delayed-plain (delayed without
    /// weight prediction), outer[:H[:DENSITY[:LR[:MOMENTUM[:CODEC[:DECAY]]]]]] (local steps, an outer step of the
    /// replicas' compressed pseudo-gradients every H).
    #[arg(
        long,
        default_value = "synchronous,no-sync,delayed",
        value_name = "LIST"
    )]
    modes: String,
    /// Microbatches each of the 2 trainers keeps in flight (1: a synchronous step holds
    /// exactly the run's 32 samples).
    #[arg(long, default_value_t = 1, value_name = "N")]
    concurrency: usize,
    /// Every process's emulated link.
    #[arg(long, default_value = "bw=100mbit,rtt=50ms", value_name = "SPEC")]
    emulate_link: String,
    /// Samples a step holds at least (the run's target batch).
    #[arg(long, default_value_t = 32, value_name = "N")]
    target_batch: usize,
    /// Skip the `train --local` reference row.
    #[arg(long)]
    no_local: bool,
    /// Give up on a mode after this many seconds.
    #[arg(long, default_value_t = 900, value_name = "SECS")]
    timeout: u64,
    /// Also write the rows as a JSON array here.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
}

/// `shoal bench converge`.
pub fn bench_converge(a: ConvergeArgs) -> Result<ExitCode> {
    if a.samples == 0 || a.concurrency == 0 || a.timeout == 0 || a.target_batch == 0 {
        bail!("--samples, --concurrency, --target-batch and --timeout must be at least 1");
    }
    let modes: Vec<String> = a.modes.split(',').map(|m| m.trim().to_string()).collect();
    if let Some(m) = modes.iter().find(|m| {
        !bc::MODES.contains(&m.as_str()) && m.as_str() != bc::PLAIN_DELAYED && !bc::is_outer(m)
    }) {
        bail!(
            "unknown mode {m:?}; known: {}, {}, outer[:H[:DENSITY[:LR[:MOMENTUM[:CODEC[:DECAY]]]]]]",
            bc::MODES.join(", "),
            bc::PLAIN_DELAYED
        );
    }
    for m in modes.iter().filter(|m| bc::is_outer(m)) {
        let mut cfg = bc::converge_config(a.samples, a.target_batch);
        cfg.averaging = bc::outer_averaging(m).map_err(|e| anyhow::anyhow!(e))?;
        cfg.validate()
            .map_err(|e| anyhow::anyhow!("mode {m:?}: {e}"))?;
    }
    let link = shoal::net::link::LinkSpec::parse(&a.emulate_link)
        .map_err(|e| anyhow::anyhow!("--emulate-link: {e}"))?;
    let opts = bc::ConvergeOptions {
        exe: std::env::current_exe().context("cannot find the shoal binary to start peers")?,
        samples: a.samples,
        modes,
        concurrency: a.concurrency,
        link,
        local: !a.no_local,
        timeout: std::time::Duration::from_secs(a.timeout),
        target_batch: a.target_batch,
    };
    let cfg = bc::converge_config(a.samples, a.target_batch);
    println!(
        "bench converge: tiny model, 2 stages x 2 replicas, 2 trainers (concurrency {}, {} microbatches of {} each), every process behind {}; steps of at least {} samples at lr {} after warm-up; target loss {}",
        a.concurrency,
        bc::microbatches(&cfg, a.samples),
        cfg.training.batch_size,
        a.emulate_link,
        cfg.target_batch_size(),
        cfg.optimizer.lr,
        cfg.training.target_loss.unwrap_or(f64::NAN)
    );
    let rt = runtime()?;
    let mut rows: Vec<ConvergeRow> = Vec::new();
    for mode in &opts.modes {
        println!("running {mode}");
        let row = rt.block_on(bc::run_mode(mode, &opts))?;
        println!("{}", row.line());
        rows.push(row);
    }
    if opts.local {
        println!("running local (train --local, same run)");
        let row = bc::run_local(&opts)?;
        println!("{}", row.line());
        rows.push(row);
    }
    println!();
    println!("{}", ConvergeRow::HEADER);
    for r in &rows {
        println!("{}", r.line());
    }
    let find = |m: &str| rows.iter().find(|r| r.mode == m);
    if let (Some(s), Some(d)) = (find("synchronous"), find("delayed")) {
        let time = match (d.seconds_to_target, s.seconds_to_target) {
            (Some(d), Some(s)) => format!("{:.2}x the synchronous time to target", d / s),
            (None, _) => "never reached the target".into(),
            (Some(_), None) => "reached the target; synchronous did not".into(),
        };
        println!(
            "delayed: eval loss {:.3}x synchronous at equal samples; {time}",
            d.eval_loss / s.eval_loss
        );
    }
    if let Some(path) = a.json {
        let text = serde_json::to_string_pretty(&rows)?;
        shoal::files::write_atomic(&path, text.as_bytes())
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}
