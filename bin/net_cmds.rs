//! The network commands: `run new`, `peer`, `status`, `swarm key`.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use shoal::dht::Manifest;
use shoal::net::{self, keys, NetConfig};
use shoal::stage::service::ServiceConfig;
use shoal::stage::status;
use shoal::swarm::peer::{Peer, PeerConfig, RunSource, StageChoice};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Subcommand)]
pub enum RunCommand {
    /// Write the canonical manifest of a config and print its run id.
    New {
        /// Run config (TOML), e.g. configs/tiny.toml.
        config: PathBuf,
        /// Where to write the manifest.
        #[arg(long, value_name = "FILE", default_value = "run.toml")]
        out: PathBuf,
    },
}

#[derive(Subcommand)]
pub enum SwarmCommand {
    /// Write a fresh pre-shared key for a private swarm (libp2p swarm key format).
    Key {
        /// Where to write it (created with mode 0600; never overwritten).
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
    },
}

#[derive(Args)]
pub struct NetArgs {
    /// Multiaddrs of peers already in the swarm (with /p2p/<peer id>).
    #[arg(long, value_name = "MULTIADDR", num_args = 1..)]
    bootstrap: Vec<String>,
    /// Private swarm key file (made by `shoal swarm key`): TCP with pnet only, no QUIC.
    #[arg(long, value_name = "FILE")]
    swarm_key: Option<PathBuf>,
    /// Print network events to stderr.
    #[arg(long, hide = true)]
    verbose: bool,
    /// Emulate a home link on every connection (tests and benchmarks), e.g.
    /// `bw=100mbit,rtt=50ms` or `up=20mbit,down=100mbit,rtt=30ms`; TCP only.
    #[arg(long, value_name = "SPEC", hide = true)]
    emulate_link: Option<String>,
}

#[derive(Args)]
pub struct PeerArgs {
    /// The run: a manifest file (made by `shoal run new`) or a run id to fetch from the DHT.
    #[arg(long, value_name = "ID|FILE")]
    run: String,
    #[command(flatten)]
    net: NetArgs,
    /// Multiaddrs to listen on (default: TCP and QUIC on every interface, random ports).
    /// A `/p2p-circuit` address listens through a relay.
    #[arg(long, value_name = "MULTIADDR", num_args = 1..)]
    listen: Vec<String>,
    /// Stage to serve: `auto` (the swarm's weakest stage), an index, or `none` (DHT only).
    #[arg(long, default_value = "auto", value_name = "auto|N")]
    stage: String,
    /// Compute device: cpu, cuda:N or metal.
    #[arg(long, default_value = "cpu", value_name = "DEVICE")]
    device: String,
    /// Identity key file; created (mode 0600) if missing, so the peer id survives restarts.
    #[arg(long, value_name = "FILE", default_value = "shoal-identity.key")]
    identity: PathBuf,
    /// Offer relay service to peers that cannot be dialled directly.
    #[arg(long)]
    relay_server: bool,
    /// Requests the stage may queue before it answers `overloaded`.
    #[arg(long, default_value_t = 8, value_name = "N")]
    queue: usize,
    /// Seconds an announcement lives (refreshed at a third of it).
    #[arg(long, default_value_t = 30, value_name = "SECS", hide = true)]
    announce_ttl: u64,
    /// Trainer loops to run beside the stage (0 for none).
    #[arg(long, default_value_t = 1, value_name = "N")]
    trainers: usize,
    /// Write the stage's checkpoint (safetensors) here on Ctrl-C / SIGTERM.
    #[arg(long, value_name = "FILE")]
    checkpoint: Option<PathBuf>,
    /// Samples/s to announce: `auto` measures the stage at start-up, a number declares it.
    #[arg(long, default_value = "auto", value_name = "auto|N")]
    throughput: String,
    /// Mean seconds between checks whether moving to the weakest stage would balance the
    /// swarm (randomised ±50%); 0 never moves.
    #[arg(long, default_value_t = 60, value_name = "SECS")]
    rebalance_every: u64,
    /// Serve a run whose stages are the `sim` stand-in (benchmarks and tests only).
    #[arg(long)]
    allow_sim: bool,
    /// Multiply a `sim` stage's time per sample (benchmarks of uneven swarms).
    #[arg(long, default_value_t = 1.0, value_name = "X", hide = true)]
    sim_slowdown: f64,
    /// Forward graphs kept for their backward (memory: one microbatch's activations
    /// each); a backward whose forward was dropped recomputes it. Raise it when many
    /// microbatches are in flight through this peer.
    #[arg(long, default_value_t = 32, value_name = "N")]
    keep_forwards: usize,
    /// Print the replica's counters every this many milliseconds (0: only on stop), so a
    /// benchmark can take the difference over its measured window.
    #[arg(long, default_value_t = 0, value_name = "MS", hide = true)]
    counters_ms: u64,
}

#[derive(Args)]
pub struct SwarmTrainArgs {
    /// The run: a run id or its manifest file.
    #[arg(long, value_name = "ID|FILE")]
    run: Option<String>,
    #[command(flatten)]
    net: NetArgs,
    /// Trainer loops in this process.
    #[arg(long, default_value_t = 1, value_name = "N")]
    trainers: usize,
    /// Microbatches each loop keeps in flight (more is faster but staler).
    #[arg(long, default_value_t = 1, value_name = "N")]
    concurrency: usize,
    /// First data stream index (each loop reads its own stream).
    #[arg(long, default_value_t = 0, value_name = "I")]
    data_index: u64,
    /// Milliseconds between progress lines.
    #[arg(long, default_value_t = 2000, value_name = "MS", hide = true)]
    report_ms: u64,
    /// Do not wait, after a microbatch, for the step it joined to be applied (more
    /// throughput, gradients up to one step stale).
    #[arg(long)]
    no_sync_steps: bool,
    /// How replicas are picked: `wiring` (stochastic, by expected finish time) or
    /// `round-robin` (a blind baseline for benchmarks).
    #[arg(long, default_value = "wiring", value_name = "HOW", hide = true)]
    routing: String,
    /// Seconds a stage call may take before the microbatch is swapped to another replica.
    #[arg(long, default_value_t = 20.0, value_name = "SECS")]
    call_timeout: f64,
}

#[derive(Args)]
pub struct StatusArgs {
    #[command(flatten)]
    net: NetArgs,
    /// Only this run (default: every run that a serving peer announces).
    #[arg(long, value_name = "ID")]
    run: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ProbeArgs {
    #[command(flatten)]
    net: NetArgs,
    /// The run id (or its manifest file).
    #[arg(long, value_name = "ID|FILE")]
    run: String,
    /// Also compute the pass locally from the initial parameters and compare the loss.
    #[arg(long)]
    check: bool,
}

pub fn run_new(config: PathBuf, out: PathBuf) -> Result<ExitCode> {
    let m = Manifest::load(&config)?;
    shoal::model::checkpoint::write_atomic(&out, m.file_text().as_bytes())
        .with_context(|| format!("cannot write {}", out.display()))?;
    eprintln!(
        "wrote the manifest of run {} ({} stages) to {}",
        m.id,
        m.config.stages.count,
        out.display()
    );
    println!("{}", m.id);
    Ok(ExitCode::SUCCESS)
}

pub fn swarm_key(out: PathBuf) -> Result<ExitCode> {
    keys::write_swarm_key(&out, keys::new_swarm_key()?)?;
    eprintln!(
        "wrote a new swarm key to {}; give it to every peer of the private swarm (--swarm-key)",
        out.display()
    );
    Ok(ExitCode::SUCCESS)
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

fn parse_addrs(list: &[String]) -> Result<Vec<libp2p::Multiaddr>> {
    Ok(list
        .iter()
        .map(|s| net::parse_addr(s))
        .collect::<Result<_, _>>()?)
}

fn net_config(
    a: &NetArgs,
    identity: libp2p::identity::Keypair,
    listen: Vec<libp2p::Multiaddr>,
) -> Result<NetConfig> {
    let mut cfg = NetConfig::new(identity, listen);
    cfg.swarm_key = a
        .swarm_key
        .as_deref()
        .map(keys::read_swarm_key)
        .transpose()?;
    cfg.verbose = a.verbose;
    cfg.link = a
        .emulate_link
        .as_deref()
        .map(shoal::net::link::LinkSpec::parse)
        .transpose()?;
    Ok(cfg)
}

fn require_bootstrap(a: &NetArgs) -> Result<()> {
    if a.bootstrap.is_empty() {
        bail!("--bootstrap MULTIADDR is required: the address of any peer in the swarm");
    }
    Ok(())
}

/// A throwaway identity that only queries the swarm (not a DHT server, no listener), and
/// the bootstrap addresses to join through.
fn client_config(a: &NetArgs) -> Result<(NetConfig, Vec<libp2p::Multiaddr>)> {
    let bootstrap = parse_addrs(&a.bootstrap)?;
    let mut cfg = net_config(a, libp2p::identity::Keypair::generate_ed25519(), Vec::new())?;
    cfg.dht_server = false;
    Ok((cfg, bootstrap))
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

pub fn peer(a: PeerArgs) -> Result<ExitCode> {
    let stage = match a.stage.as_str() {
        "auto" => StageChoice::Auto,
        "none" => StageChoice::None,
        s => StageChoice::Index(s.parse().map_err(|_| {
            anyhow::anyhow!("--stage must be `auto`, `none` or a stage index, not {s:?}")
        })?),
    };
    let device = shoal::model::parse_device(&a.device).map_err(anyhow::Error::msg)?;
    if a.queue == 0 {
        bail!("--queue must be at least 1");
    }
    if a.announce_ttl == 0 || a.announce_ttl > 600 {
        bail!("--announce-ttl must be between 1 and 600 seconds");
    }
    let bootstrap = parse_addrs(&a.net.bootstrap)?;
    if !(a.sim_slowdown.is_finite() && a.sim_slowdown > 0.0) {
        bail!("--sim-slowdown must be a positive number");
    }
    let mut listen = parse_addrs(&a.listen)?;
    if listen.is_empty() {
        listen.push(net::parse_addr("/ip4/0.0.0.0/tcp/0")?);
        if a.net.swarm_key.is_none() && a.net.emulate_link.is_none() {
            listen.push(net::parse_addr("/ip4/0.0.0.0/udp/0/quic-v1")?);
        }
    }
    let run = RunSource::parse(&a.run);
    if let RunSource::File(p) = &run {
        // A typo in the run file should fail before any key is created.
        Manifest::load(p)?;
    }
    let (identity, created) = keys::load_or_create_identity(&a.identity)?;
    if created {
        println!("created identity {}", a.identity.display());
    }
    let mut netcfg = net_config(&a.net, identity, listen)?;
    netcfg.relay_server = a.relay_server;
    let ttl = Duration::from_secs(a.announce_ttl);
    netcfg.provider_ttl = ttl.max(Duration::from_secs(5));
    let mut cfg = PeerConfig::new(run, netcfg, bootstrap, stage);
    cfg.device = device;
    cfg.device_name = a.device.clone();
    cfg.announce_ttl = ttl;
    cfg.service = ServiceConfig {
        queue_cap: a.queue,
        ..ServiceConfig::default()
    };
    cfg.trainers = a.trainers;
    cfg.checkpoint = a.checkpoint.clone();
    cfg.throughput = match a.throughput.as_str() {
        "auto" => None,
        t => match t.parse::<f64>() {
            Ok(x) if x.is_finite() && x > 0.0 => Some(x),
            _ => bail!("--throughput must be `auto` or a positive number of samples/s, not {t:?}"),
        },
    };
    cfg.rebalance = (a.rebalance_every > 0).then(|| Duration::from_secs(a.rebalance_every));
    cfg.allow_sim = a.allow_sim;
    cfg.sim_slowdown = a.sim_slowdown;
    if a.keep_forwards == 0 {
        bail!("--keep-forwards must be at least 1");
    }
    cfg.kept_forwards = a.keep_forwards;
    let rt = runtime()?;
    rt.block_on(async move {
        let log = |line: String| println!("{line}");
        let peer = Peer::start(cfg, log).await?;
        println!("peer {} ready; Ctrl-C to stop", peer.net().local_peer_id());
        let stats: Vec<_> = peer
            .trainers()
            .iter()
            .map(|t| std::sync::Arc::clone(t.stats()))
            .collect();
        let counters_every = (a.counters_ms > 0).then(|| Duration::from_millis(a.counters_ms));
        let report_every = Duration::from_secs(5);
        let tick = counters_every.map_or(report_every, |c| c.min(report_every));
        let mut reported = std::time::Instant::now();
        let stop = shutdown_signal();
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => break,
                _ = tokio::time::sleep(tick) => {}
            }
            if counters_every.is_some() {
                if let Some(s) = peer.service() {
                    println!("stage {} {}", s.stage(), s.counters().line());
                }
            }
            if !stats.is_empty() && reported.elapsed() >= report_every {
                reported = std::time::Instant::now();
                println!("{}", trainer_line(&stats, &peer));
            }
        }
        println!("stopping: finishing in-flight work, withdrawing announcements");
        let service = peer.service();
        peer.stop().await?;
        if let Some(s) = service {
            println!("stage {} {}", s.stage(), s.counters().line());
        }
        println!("stopped");
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(ExitCode::SUCCESS)
}

fn trainer_line(stats: &[std::sync::Arc<shoal::trainer::TrainerStats>], peer: &Peer) -> String {
    let clients: Vec<_> = peer.trainers().iter().map(|t| t.client().clone()).collect();
    progress_line(stats, &clients)
}

fn progress_line(
    stats: &[std::sync::Arc<shoal::trainer::TrainerStats>],
    clients: &[shoal::stage::client::StageClient],
) -> String {
    use std::sync::atomic::Ordering::Relaxed;
    let (mut wire, mut raw) = (0, 0);
    for c in clients {
        let c = c.counters();
        wire += c.sent.load(Relaxed) + c.received.load(Relaxed);
        raw += c.raw.load(Relaxed);
    }
    shoal::trainer::report::Progress::of(stats, (wire, raw)).line()
}

pub fn train_swarm(a: SwarmTrainArgs) -> Result<ExitCode> {
    let Some(run) = a.run.clone() else {
        bail!("pass --run ID --bootstrap MULTIADDR to train through a swarm, or --local --config FILE");
    };
    require_bootstrap(&a.net)?;
    if a.trainers == 0 || a.concurrency == 0 {
        bail!("--trainers and --concurrency must be at least 1");
    }
    let source = RunSource::parse(&run);
    if let RunSource::File(p) = &source {
        Manifest::load(p)?;
    }
    let (netcfg, bootstrap) = client_config(&a.net)?;
    let mut cfg = PeerConfig::new(source, netcfg, bootstrap, StageChoice::None);
    cfg.trainers = a.trainers;
    cfg.trainer.concurrency = a.concurrency;
    cfg.trainer.index = a.data_index;
    cfg.trainer.sync_steps = !a.no_sync_steps;
    cfg.trainer.routing = a.routing.parse().map_err(anyhow::Error::msg)?;
    if !(a.call_timeout.is_finite() && a.call_timeout > 0.0 && a.call_timeout <= 86_400.0) {
        bail!("--call-timeout must be a number of seconds between 0 and 86400");
    }
    cfg.trainer.call_timeout = Duration::from_secs_f64(a.call_timeout);
    let report_ms = a.report_ms.max(50);
    let rt = runtime()?;
    rt.block_on(async move {
        let log = |line: String| println!("{line}");
        let peer = Peer::start(cfg, log).await?;
        let stats: Vec<_> = peer
            .trainers()
            .iter()
            .map(|t| std::sync::Arc::clone(t.stats()))
            .collect();
        let started = std::time::Instant::now();
        loop {
            tokio::select! {
                _ = shutdown_signal() => break,
                _ = tokio::time::sleep(Duration::from_millis(report_ms)) => {}
            }
            println!(
                "{}  ({:.0} s)",
                trainer_line(&stats, &peer),
                started.elapsed().as_secs_f64()
            );
            if peer.trainers().iter().all(|t| t.is_finished()) {
                break;
            }
        }
        // Counters shared with the trainers' clients: the final line counts the microbatches
        // that finished (or failed) while stopping.
        let clients: Vec<_> = peer.trainers().iter().map(|t| t.client().clone()).collect();
        peer.stop().await?;
        println!("done: {}", progress_line(&stats, &clients));
        for s in &stats {
            if let Ok(f) = s.failures.lock() {
                for (reason, n) in f.iter() {
                    println!("  failed {n} samples: {reason}");
                }
            }
            if let Ok(r) = s.swap_reasons.lock() {
                for (reason, n) in r.iter() {
                    println!("  swapped {n} calls: {reason}");
                }
            }
        }
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(ExitCode::SUCCESS)
}

pub fn status(a: StatusArgs) -> Result<ExitCode> {
    require_bootstrap(&a.net)?;
    if let Some(r) = &a.run {
        if !shoal::dht::is_run_id(r) {
            bail!("--run {r:?} is not a run id (32 hex digits, printed by `shoal run new`)");
        }
    }
    let (cfg, bootstrap) = client_config(&a.net)?;
    let rt = runtime()?;
    let runs = rt.block_on(async move {
        let handle = net::start(cfg)?;
        shoal::swarm::peer::join(&handle, &bootstrap).await?;
        let runs = status::gather(&handle, a.run.as_deref()).await?;
        handle.shutdown().await;
        Ok::<_, anyhow::Error>(runs)
    })?;
    if a.json {
        println!("{}", status::to_json(&runs));
    } else {
        print!("{}", status::render(&runs));
    }
    Ok(ExitCode::SUCCESS)
}

pub fn probe(a: ProbeArgs) -> Result<ExitCode> {
    require_bootstrap(&a.net)?;
    let source = RunSource::parse(&a.run);
    let from_file = match &source {
        RunSource::File(p) => Some(Manifest::load(p)?),
        RunSource::Id(_) => None,
    };
    let (cfg, bootstrap) = client_config(&a.net)?;
    let rt = runtime()?;
    let (m, report) = rt.block_on(async move {
        let handle = net::start(cfg)?;
        shoal::swarm::peer::join(&handle, &bootstrap).await?;
        let m = match (from_file, source) {
            (Some(m), _) => m,
            (None, RunSource::Id(id)) => {
                shoal::stage::registry::fetch_manifest(&handle, &id, Duration::from_secs(5)).await?
            }
            (None, RunSource::File(p)) => Manifest::load(&p)?,
        };
        let report = shoal::stage::probe::probe(&handle, &m, a.check).await?;
        handle.shutdown().await;
        Ok::<_, anyhow::Error>((m, report))
    })?;
    println!(
        "probe of run {}: one microbatch of {} sequences",
        m.id, m.config.training.batch_size
    );
    for h in &report.hops {
        println!(
            "  stage {} {:<8} on {}  {:>8.1} ms",
            h.stage, h.op, h.peer, h.ms
        );
    }
    let total: f64 = report.hops.iter().map(|h| h.ms).sum();
    println!("loss {:.6} after {total:.1} ms of calls", report.loss);
    if let Some(l) = report.local_loss {
        let diff = (l - report.loss).abs();
        println!("local loss {l:.6} (difference {diff:.2e}; exact with f32 activations at step 0)");
    }
    Ok(ExitCode::SUCCESS)
}

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
    let steps = steps.unwrap_or(shoal::swarm::demo::DEMO_STEPS);
    let cfg = shoal::swarm::demo::DemoConfig {
        exe,
        stages,
        replicas,
        trainers,
        steps,
        churn,
    };
    println!("shoal demo: a swarm of processes on 127.0.0.1 trains the built-in tiny model on the built-in Markov corpus");
    let rt = runtime()?;
    let r = rt.block_on(shoal::swarm::demo::run(&cfg, &|l| println!("{l}")))?;
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
    use shoal::bench::swarm as bs;
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
        let row = bs::run_setup(s, &opts, &|l| println!("{l}"))?;
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
