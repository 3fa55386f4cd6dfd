//! The `shoal` command line: clap flags → a validated config → a library call.
//!
//! Only argument handling and terminal output live here; every decision is in the library.
//! Errors print as one line (`error: ...`) and exit with status 1.

mod args;
mod bench_args;
mod bench_cmds;
mod bench_run;
mod client_cmds;
mod data_cmds;
mod harness;
mod logging;
mod model_cmds;
mod observe_cmd;
mod peer_cmd;
mod progress;
mod sim_cmd;

use anyhow::{bail, Context, Result};
use bench_args::BenchCommand;
use clap::{Args, Parser, Subcommand};
use shoal::config::RunConfig;
use shoal::train::{LocalOptions, LocalReport};
use shoal::wire::CodecSpec;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "shoal",
    version,
    about = "Train one neural network on a swarm of volunteer GPUs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// More log lines on stderr (-v: info, -vv: debug, -vvv: trace); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    /// Only errors on stderr.
    #[arg(short, long, global = true)]
    quiet: bool,
    /// Log lines as text, or as one JSON object per line (for log collectors).
    #[arg(long, value_name = "text|json", default_value = "text", global = true)]
    log_format: logging::LogFormat,
}

#[derive(Subcommand)]
enum Command {
    /// Train a run. `--local` trains every stage in this process.
    Train(TrainArgs),
    /// A swarm on this machine (bootstrap, replicas per stage, trainers, a replica killed
    /// midway) trains the built-in tiny model; exits 0 if it reached the target loss.
    /// `--local` trains every stage in one process instead.
    Demo(DemoArgs),
    /// Run manifests: `run new CONFIG` prints the run id.
    Run {
        #[command(subcommand)]
        which: args::RunCommand,
    },
    /// Serve a stage of a run in a swarm.
    Peer(args::PeerArgs),
    /// Show the swarm: replicas per stage, throughput, the bottleneck.
    Status(args::StatusArgs),
    /// Push one microbatch forward and backward through the swarm, one replica per stage.
    Probe(args::ProbeArgs),
    /// Reachability self-test: what other peers see of this machine, and what to fix.
    Doctor(args::DoctorArgs),
    /// Private swarms: `swarm key --out FILE` makes a pre-shared key.
    Swarm {
        #[command(subcommand)]
        which: args::SwarmCommand,
    },
    /// Tokenizers: `tokenizer train --data FILE... --vocab N --out tokenizer.json`.
    Tokenizer {
        #[command(subcommand)]
        which: data_cmds::TokenizerCommand,
    },
    /// Training data: `data prepare --tokenizer T --data FILE... --out DIR`.
    Data {
        #[command(subcommand)]
        which: data_cmds::DataCommand,
    },
    /// Collect every stage's parameters into one model file: `export --checkpoints F... --out model.safetensors`.
    Export(model_cmds::ExportArgs),
    /// Continue a prompt with an exported model.
    Generate(model_cmds::GenerateArgs),
    /// Benchmarks that print tables.
    Bench {
        #[command(subcommand)]
        which: BenchCommand,
    },
}

#[derive(Args)]
struct TrainArgs {
    /// Train all stages in this process instead of through a swarm.
    #[arg(long, requires = "config")]
    local: bool,
    /// Run config (TOML) for --local, e.g. configs/tiny.toml.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Swarm training: trainer loops only (no stage, no GPU needed).
    #[command(flatten)]
    swarm: args::SwarmTrainArgs,
    #[command(flatten)]
    common: CommonArgs,
    /// Train on this data instead of the config's: a folder from `shoal data prepare`, a
    /// UTF-8 text file (byte tokens), or a `.bin` shard / folder of shards of
    /// little-endian u16 tokens. Through a swarm: this machine's copy of the run's
    /// prepared data (refused unless tokenized with the run's tokenizer).
    #[arg(long, value_name = "PATH")]
    data: Option<PathBuf>,
    /// --local: write every stage's checkpoint (FILE.stage0, FILE.stage1, ...) at the end
    /// and every --checkpoint-every seconds.
    #[arg(long, value_name = "FILE", requires = "local")]
    checkpoint: Option<PathBuf>,
    /// --local: also checkpoint this often.
    #[arg(long, value_name = "SECS", requires = "checkpoint")]
    checkpoint_every: Option<f64>,
    /// --local: continue from the checkpoints written with --checkpoint FILE.
    #[arg(long, value_name = "FILE", requires = "local")]
    resume: Option<PathBuf>,
}

#[derive(Args)]
struct DemoArgs {
    /// Train every stage in this one process instead of a swarm of processes.
    #[arg(long)]
    local: bool,
    /// Replicas per stage (swarm demo).
    #[arg(long, default_value_t = 2, value_name = "N")]
    replicas: usize,
    /// Trainer processes (swarm demo).
    #[arg(long, default_value_t = 2, value_name = "N")]
    trainers: usize,
    /// Do not kill and replace a replica midway (swarm demo).
    #[arg(long)]
    no_churn: bool,
    #[command(flatten)]
    common: CommonArgs,
}

#[derive(Args)]
struct CommonArgs {
    /// Optimizer steps (default: the config's training.steps).
    #[arg(long, value_name = "N")]
    steps: Option<u64>,
    /// Device: cpu, cuda:N or metal.
    #[arg(long, default_value = "cpu", value_name = "DEVICE")]
    device: String,
    /// Codec for activations between stages: f32, f16, bf16, int8[:BLOCK], optionally
    /// +zstd[1-3]; or subspace:RANK[+CODEC] (the model keeps its residual stream in a
    /// rank-RANK subspace; llama only).
    #[arg(long, value_name = "CODEC")]
    activations: Option<String>,
    /// Number of pipeline stages (default: the config's stages.count).
    #[arg(long, value_name = "S")]
    stages: Option<usize>,
    /// CPU threads each microbatch is split over, by sequences (default: the cores).
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
}

pub(crate) fn parse_codec(s: &str) -> Result<CodecSpec> {
    Ok(s.parse::<CodecSpec>()?)
}

fn apply_common(cfg: &mut RunConfig, c: &CommonArgs) -> Result<LocalOptions> {
    let device = shoal::model::parse_device(&c.device).map_err(anyhow::Error::msg)?;
    if let Some(a) = &c.activations {
        cfg.codecs.activations = a.parse::<shoal::wire::ActivationCodec>()?;
    }
    if let Some(s) = c.stages {
        cfg.stages.count = s;
        cfg.stages.cuts.clear();
    }
    if c.steps == Some(0) {
        bail!("--steps must be at least 1");
    }
    if c.threads == Some(0) {
        bail!("--threads must be at least 1");
    }
    cfg.validate()?;
    Ok(LocalOptions {
        steps: c.steps,
        device,
        threads: c.threads.unwrap_or_else(|| LocalOptions::default().threads),
        ..LocalOptions::default()
    })
}

fn summary(cfg: &RunConfig, r: &LocalReport) -> String {
    let mut s = format!(
        "done: {} steps in {:.1}s, train loss {:.4} (mean of last 20), eval loss {:.4}",
        r.steps,
        r.seconds,
        r.tail_loss(20),
        r.eval_loss
    );
    if let Some(h) = r.entropy_rate {
        s += &format!(", corpus entropy {h:.4} nats (gap {:.4})", r.eval_loss - h);
    }
    s += &format!(", {:.0} tok/s", r.tokens_per_s);
    if cfg.stages.count > 1 {
        s += &format!(
            ", activations {} {:.2}x smaller on the wire",
            cfg.codecs.activations,
            r.compression_ratio()
        );
    }
    s
}

/// `--events` of `train --local`: one JSON line per step (`step`) and one at the end
/// (`done`: train loss as the mean of the last 20 steps, eval loss, tokens/s).
struct LocalEvents(Option<std::io::LineWriter<std::fs::File>>);

impl LocalEvents {
    fn new(a: &args::EventsArgs) -> Result<Self> {
        Ok(Self(match &a.events {
            None => None,
            Some(p) if p.as_os_str() == "-" => {
                bail!("train --local writes its events to a file: give --events FILE")
            }
            Some(p) => Some(std::io::LineWriter::new(
                std::fs::File::create(p)
                    .with_context(|| format!("cannot write the events to {}", p.display()))?,
            )),
        }))
    }

    fn write(&mut self, v: serde_json::Value) {
        if let Some(w) = &mut self.0 {
            // A reader that went away must not stop training.
            let _ = writeln!(w, "{v}");
        }
    }
}

fn train(cfg: &RunConfig, opts: &LocalOptions, events: &mut LocalEvents) -> Result<LocalReport> {
    let steps = opts.steps.unwrap_or(cfg.training.steps);
    if let Some(r) = &opts.resume {
        println!(
            "resuming from {} (and the other stages' files)",
            shoal::train::stage_checkpoint(r, 0).display()
        );
    }
    println!(
        "training {} stage(s) of a {}-layer d{} model locally for {steps} steps on {:?}, activations {}",
        cfg.stages.count, cfg.model.n_layers, cfg.model.d_model, opts.device, cfg.codecs.activations
    );
    let bar = progress::Bar::new(steps, "step");
    let report = shoal::train::train_local(cfg, opts, &mut |p| {
        bar.set(p.step, || {
            format!(
                "loss {:.4}  lr {:.2e}  tok/s {:.0}",
                p.loss, p.lr, p.tokens_per_s
            )
        });
        events.write(serde_json::json!({
            "event": "step", "step": p.step, "loss": p.loss, "lr": p.lr,
            "tokens_per_s": p.tokens_per_s,
        }));
    })?;
    bar.finish();
    events.write(serde_json::json!({
        "event": "done", "steps": report.steps, "train_loss": report.tail_loss(20),
        "eval_loss": report.eval_loss, "tokens_per_s": report.tokens_per_s,
        "seconds": report.seconds,
    }));
    println!("{}", summary(cfg, &report));
    Ok(report)
}

/// Runs the parsed command.
fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Train(a) => train_cmd(a),
        Command::Demo(a) if !a.local => bench_cmds::demo(
            a.common.stages.unwrap_or(3),
            a.replicas,
            a.trainers,
            a.common.steps,
            !a.no_churn,
        ),
        Command::Demo(a) => local_demo(a),
        Command::Run {
            which: args::RunCommand::New { config, out, data },
        } => client_cmds::run_new(config, out, data),
        Command::Peer(a) => peer_cmd::peer(a),
        Command::Tokenizer { which } => data_cmds::tokenizer(which),
        Command::Data { which } => data_cmds::data(which),
        Command::Export(a) => model_cmds::export(a),
        Command::Generate(a) => model_cmds::generate(a),
        Command::Status(a) => client_cmds::status(a),
        Command::Probe(a) => client_cmds::probe(a),
        Command::Doctor(a) => client_cmds::doctor(a),
        Command::Swarm {
            which: args::SwarmCommand::Key { out },
        } => client_cmds::swarm_key(out),
        Command::Bench { which } => bench_run::bench(which),
    }
}

/// `shoal train`: `--local` with a config trains in this process; otherwise the swarm's
/// trainer.
fn train_cmd(a: TrainArgs) -> Result<ExitCode> {
    let Some(config) = a.config.as_ref().filter(|_| a.local) else {
        let mut swarm = a.swarm;
        swarm.data = a.data;
        return peer_cmd::train_swarm(swarm);
    };
    let mut cfg = RunConfig::load(config)?;
    if let Some(d) = &a.data {
        data_cmds::data_override(&mut cfg, d)?;
    }
    let mut opts = apply_common(&mut cfg, &a.common)?;
    opts.checkpoint = a.checkpoint.clone();
    opts.resume = a.resume.clone();
    opts.checkpoint_every = match a.checkpoint_every {
        None => None,
        Some(s) if s.is_finite() && s >= 1.0 => Some(std::time::Duration::from_secs_f64(s)),
        Some(s) => bail!("--checkpoint-every must be at least 1 second, not {s}"),
    };
    let mut events = LocalEvents::new(&a.swarm.events)?;
    let report = train(&cfg, &opts, &mut events)?;
    if let Some(path) = &opts.checkpoint {
        println!(
            "checkpoints at step {} written to {}",
            report.steps,
            shoal::train::stage_checkpoint(path, 0).display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `shoal demo --local`: the built-in tiny config on the built-in corpus, in this process,
/// failing when the eval loss misses the config's target.
fn local_demo(a: DemoArgs) -> Result<ExitCode> {
    let mut cfg = RunConfig::tiny();
    let opts = apply_common(&mut cfg, &a.common)?;
    println!("shoal demo: the built-in tiny config on the built-in Markov corpus");
    let report = train(&cfg, &opts, &mut LocalEvents(None))?;
    match cfg.training.target_loss {
        Some(t) if report.eval_loss > t => {
            println!(
                "demo FAILED: eval loss {:.4} did not reach the target {t}",
                report.eval_loss
            );
            Ok(ExitCode::FAILURE)
        }
        Some(t) => {
            println!(
                "demo ok: eval loss {:.4} reached the target {t}",
                report.eval_loss
            );
            Ok(ExitCode::SUCCESS)
        }
        None => Ok(ExitCode::SUCCESS),
    }
}

/// Local training runs candle's CPU kernels on one thread each unless `RAYON_NUM_THREADS`
/// (or `CANDLE_NUM_THREADS`) says otherwise: at the widths a CPU trains, candle's per-op
/// thread pool costs more than it gains (2 cores, the parity model: 9.8k tok/s with it,
/// 16k without), and `train --local` splits each microbatch's sequences over the cores
/// itself (`--threads`). A peer's stage still computes a microbatch on one thread, so
/// peers keep candle's per-op threads.
fn single_threaded_kernels(cli: &Cli) {
    let local = match &cli.command {
        Command::Train(a) => a.local,
        Command::Demo(a) => a.local,
        // Its reference row is a local run; its peers are processes of their own.
        Command::Bench {
            which: BenchCommand::Converge(_),
        } => true,
        _ => false,
    };
    if local
        && std::env::var_os("RAYON_NUM_THREADS").is_none()
        && std::env::var_os("CANDLE_NUM_THREADS").is_none()
    {
        // Before any other thread exists (parsing the command line starts none).
        std::env::set_var("RAYON_NUM_THREADS", "1");
    }
}

fn main() -> ExitCode {
    logging::quiet_panics();
    shoal::tune_allocator();
    let cli = Cli::parse();
    logging::init(cli.quiet, cli.verbose, cli.log_format);
    single_threaded_kernels(&cli);
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            let msg = format!("{e:#}").replace('\n', " ");
            eprintln!("error: {msg}");
            ExitCode::FAILURE
        }
    }
}
