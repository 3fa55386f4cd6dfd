//! The network commands' flags (clap), and their validation into the library's configs:
//! `TryFrom<&PeerArgs> for PeerConfig` for `shoal peer`, [`trainer_config`] for
//! `shoal train`. Defaults come from the library's config constants.

use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use shoal::dht::Manifest;
use shoal::net::{self, keys, NetConfig};
use shoal::stage::replica::KEPT_CAP;
use shoal::stage::service::ServiceConfig;
use shoal::swarm::peer::{PeerConfig, RunSource, StageChoice};
use shoal::trainer::TrainerConfig;
use std::path::PathBuf;
use std::time::Duration;

/// Where a process reports what it does, as JSON lines.
#[derive(Args, Clone, Debug)]
pub struct EventsArgs {
    /// Write every event (listening, ready, counters, progress, ...) as one JSON object per
    /// line to FILE; `-` writes them to stdout and moves the human-readable lines to stderr.
    #[arg(long, value_name = "FILE|-")]
    pub events: Option<PathBuf>,
}

/// Where a process serves its metrics and dashboard.
#[derive(Args, Clone, Debug)]
pub struct ObserveArgs {
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9100).
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<std::net::SocketAddr>,
    /// Serve the live dashboard at http://ADDR/ (and its JSON at /api/status, /api/history).
    #[arg(long, value_name = "ADDR")]
    pub dashboard: Option<std::net::SocketAddr>,
    /// With --metrics or --dashboard and trainers here: measure the swarm's held-out loss
    /// every SECS seconds (2 eval batches, forward only; 0: never).
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub eval_every: u64,
}

#[derive(Subcommand)]
pub enum RunCommand {
    /// Write the canonical manifest of a config and print its run id.
    New {
        /// Run config (TOML), e.g. configs/tiny.toml.
        config: PathBuf,
        /// Where to write the manifest.
        #[arg(long, value_name = "FILE", default_value = "run.toml")]
        out: PathBuf,
        /// Train on this data (a folder from `shoal data prepare`; its tokenizer's hash is
        /// recorded, so trainers with other data are refused).
        #[arg(long, value_name = "DIR")]
        data: Option<PathBuf>,
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
    pub bootstrap: Vec<String>,
    /// Private swarm key file (made by `shoal swarm key`): TCP with pnet only, no QUIC.
    #[arg(long, value_name = "FILE")]
    pub swarm_key: Option<PathBuf>,
    /// Emulate a home link on every connection (tests and benchmarks), e.g.
    /// `bw=100mbit,rtt=50ms` or `up=20mbit,down=100mbit,rtt=30ms`; TCP only.
    #[arg(long, value_name = "SPEC", hide = true)]
    pub emulate_link: Option<String>,
}

#[derive(Args)]
pub struct PeerArgs {
    /// The run: a manifest file (made by `shoal run new`) or a run id to fetch from the DHT.
    #[arg(long, value_name = "ID|FILE")]
    pub run: String,
    #[command(flatten)]
    pub net: NetArgs,
    /// Multiaddrs to listen on (default: TCP and QUIC on every interface, random ports).
    /// A `/p2p-circuit` address listens through a relay.
    #[arg(long, value_name = "MULTIADDR", num_args = 1..)]
    pub listen: Vec<String>,
    /// Stage to serve: `auto` (the swarm's weakest stage), an index, or `none` (DHT only).
    #[arg(long, default_value = "auto", value_name = "auto|N")]
    pub stage: String,
    /// Compute device: cpu, cuda:N or metal.
    #[arg(long, default_value = "cpu", value_name = "DEVICE")]
    pub device: String,
    /// Identity key file; created (mode 0600) if missing, so the peer id survives restarts.
    #[arg(long, value_name = "FILE", default_value = "shoal-identity.key")]
    pub identity: PathBuf,
    /// Offer relay service to peers that cannot be dialled directly.
    #[arg(long)]
    pub relay_server: bool,
    /// Use the DHT without serving it (Kademlia client mode): for a machine behind NAT, or
    /// any peer that should not carry others' DHT traffic. The swarm's reachable peers keep
    /// the table; a swarm where every peer serves it ends up nearly fully connected
    /// (BENCHMARKS.md, "Stop 55").
    #[arg(long)]
    pub dht_client: bool,
    /// Forwards (and, apart, backwards) the stage may queue before it answers `overloaded`.
    #[arg(long, default_value_t = ServiceConfig::QUEUE_CAP, value_name = "N")]
    pub queue: usize,
    /// Seconds an announcement lives (refreshed at a third of it).
    #[arg(long, default_value_t = PeerConfig::ANNOUNCE_TTL.as_secs(), value_name = "SECS", hide = true)]
    pub announce_ttl: u64,
    /// Trainer loops to run beside the stage (0 for none).
    #[arg(long, default_value_t = PeerConfig::CLI_TRAINERS, value_name = "N")]
    pub trainers: usize,
    /// Write the stage's checkpoint (safetensors) here on Ctrl-C / SIGTERM (and every
    /// `--checkpoint-every` seconds).
    #[arg(long, value_name = "FILE")]
    pub checkpoint: Option<PathBuf>,
    /// Also checkpoint this often while serving (atomic; the step and hash are inside).
    #[arg(long, value_name = "SECS", requires = "checkpoint")]
    pub checkpoint_every: Option<f64>,
    /// Start from this stage checkpoint (its stage, unless --stage says the same). A
    /// replica that finds live replicas ahead of it downloads their state instead.
    #[arg(long, value_name = "FILE")]
    pub resume: Option<PathBuf>,
    /// Samples/s to announce: `auto` measures the stage at start-up, a number declares it.
    #[arg(long, default_value = "auto", value_name = "auto|N")]
    pub throughput: String,
    /// Mean seconds between checks whether moving to the weakest stage would balance the
    /// swarm (randomised ±50%); 0 never moves.
    #[arg(long, default_value_t = PeerConfig::REBALANCE_EVERY.as_secs(), value_name = "SECS")]
    pub rebalance_every: u64,
    /// Serve a run whose stages are the `sim` stand-in (benchmarks and tests only).
    #[arg(long)]
    pub allow_sim: bool,
    /// Multiply a `sim` stage's time per sample (benchmarks of uneven swarms).
    #[arg(long, default_value_t = 1.0, value_name = "X", hide = true)]
    pub sim_slowdown: f64,
    /// Forward graphs kept for their backward (memory: one microbatch's activations
    /// each); a backward whose forward was dropped recomputes it. Raise it when many
    /// microbatches are in flight through this peer.
    #[arg(long, default_value_t = KEPT_CAP, value_name = "N")]
    pub keep_forwards: usize,
    /// Backward through kept forwards of any age, so gradients may be several steps stale
    /// (benchmarks only: the "no-sync" mode of `shoal bench converge`).
    #[arg(long, hide = true)]
    pub unbounded_staleness: bool,
    /// Compute every gradient at the parameters as they are, never at those predicted for
    /// the step it joins (benchmarks only: `shoal bench converge`'s delayed modes).
    #[arg(long, hide = true)]
    pub no_weight_prediction: bool,
    /// Print the replica's counters every this many milliseconds (0: only on stop), so a
    /// benchmark can take the difference over its measured window.
    #[arg(long, default_value_t = 0, value_name = "MS", hide = true)]
    pub counters_ms: u64,
    #[command(flatten)]
    pub events: EventsArgs,
    #[command(flatten)]
    pub observe: ObserveArgs,
}

#[derive(Args)]
pub struct SwarmTrainArgs {
    /// The run: a run id or its manifest file.
    #[arg(long, value_name = "ID|FILE")]
    pub run: Option<String>,
    #[command(flatten)]
    pub net: NetArgs,
    /// Trainer loops in this process.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub trainers: usize,
    /// Microbatches each loop keeps in flight (more is faster but staler; with
    /// --no-sync-steps the next one starts as one's last backward goes out).
    #[arg(long, default_value_t = TrainerConfig::CONCURRENCY, value_name = "N")]
    pub concurrency: usize,
    /// First data stream index (each loop reads its own stream).
    #[arg(long, default_value_t = 0, value_name = "I")]
    pub data_index: u64,
    /// Milliseconds between progress reports.
    #[arg(long, default_value_t = 2000, value_name = "MS", hide = true)]
    pub report_ms: u64,
    /// Stop each loop after it fed this many microbatches (default: when the run reaches
    /// its last step).
    #[arg(long, value_name = "N")]
    pub microbatches: Option<u64>,
    /// Do not wait, after a microbatch, for the step it joined to be applied (delayed
    /// updates: more throughput; gradients at most one step stale, computed at the
    /// parameters the replicas predict for the step they join).
    #[arg(long)]
    pub no_sync_steps: bool,
    /// How replicas are picked: `wiring` (stochastic, by expected finish time) or
    /// `round-robin` (a blind baseline for benchmarks).
    #[arg(long, default_value = "wiring", value_name = "HOW", hide = true)]
    pub routing: String,
    /// Send the last stage its input through this trainer, instead of having the stage
    /// before it push its output there directly (one link and one one-way latency more per
    /// microbatch; for comparisons, and for swarms with peers older than pushes).
    #[arg(long)]
    pub no_push: bool,
    /// Seconds a stage call may take before the microbatch is swapped to another replica.
    #[arg(long, default_value_t = TrainerConfig::CALL_TIMEOUT.as_secs_f64(), value_name = "SECS")]
    pub call_timeout: f64,
    /// This machine's copy of the run's prepared data (`shoal train --data DIR`).
    #[arg(skip)]
    pub data: Option<PathBuf>,
    #[command(flatten)]
    pub events: EventsArgs,
    #[command(flatten)]
    pub observe: ObserveArgs,
}

#[derive(Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub net: NetArgs,
    /// Only this run (default: every run that a serving peer announces).
    #[arg(long, value_name = "ID")]
    pub run: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Refresh the table every 2 s until Ctrl-C.
    #[arg(long)]
    pub watch: bool,
    /// Serve the live dashboard of the run (--run, or the first run found) at
    /// http://ADDR/ until Ctrl-C, as a watcher that holds no stage.
    #[arg(long, value_name = "ADDR")]
    pub serve: Option<std::net::SocketAddr>,
}

#[derive(Args)]
pub struct DoctorArgs {
    #[command(flatten)]
    pub net: NetArgs,
    /// Seconds to wait for a dial-back (and a relay slot when it fails).
    #[arg(long, default_value_t = 30, value_name = "SECONDS")]
    pub wait: u64,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct ProbeArgs {
    #[command(flatten)]
    pub net: NetArgs,
    /// The run id (or its manifest file).
    #[arg(long, value_name = "ID|FILE")]
    pub run: String,
    /// Fail unless every stage answers with finite values; at step 0 also compute the
    /// pass locally from the initial parameters and compare the loss.
    #[arg(long)]
    pub check: bool,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn parse_addrs(list: &[String]) -> Result<Vec<libp2p::Multiaddr>> {
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
    cfg.link = a
        .emulate_link
        .as_deref()
        .map(shoal::net::link::LinkSpec::parse)
        .transpose()?;
    Ok(cfg)
}

pub fn require_bootstrap(a: &NetArgs) -> Result<()> {
    if a.bootstrap.is_empty() {
        bail!("--bootstrap MULTIADDR is required: the address of any peer in the swarm");
    }
    Ok(())
}

/// TCP and QUIC on every interface at random ports (TCP only in a private swarm or with
/// link emulation).
pub fn default_listen(a: &NetArgs) -> Result<Vec<libp2p::Multiaddr>> {
    let mut listen = vec![net::parse_addr("/ip4/0.0.0.0/tcp/0")?];
    if a.swarm_key.is_none() && a.emulate_link.is_none() {
        listen.push(net::parse_addr("/ip4/0.0.0.0/udp/0/quic-v1")?);
    }
    Ok(listen)
}

/// A throwaway identity that only queries the swarm (not a DHT server, no listener), and
/// the bootstrap addresses to join through.
pub fn client_config(a: &NetArgs) -> Result<(NetConfig, Vec<libp2p::Multiaddr>)> {
    let bootstrap = parse_addrs(&a.bootstrap)?;
    let mut cfg = net_config(a, libp2p::identity::Keypair::generate_ed25519(), Vec::new())?;
    cfg.dht_server = false;
    Ok((cfg, bootstrap))
}

impl TryFrom<&PeerArgs> for PeerConfig {
    type Error = anyhow::Error;

    /// Validates `shoal peer`'s flags; loads (or creates) the identity key.
    fn try_from(a: &PeerArgs) -> Result<Self> {
        let mut stage = match a.stage.as_str() {
            "auto" => StageChoice::Auto,
            "none" => StageChoice::None,
            s => StageChoice::Index(s.parse().map_err(|_| {
                anyhow::anyhow!("--stage must be `auto`, `none` or a stage index, not {s:?}")
            })?),
        };
        if let Some(path) = &a.resume {
            let info = shoal::model::checkpoint::peek(path)?;
            stage = match stage {
                StageChoice::Auto => StageChoice::Index(info.stage),
                StageChoice::Index(s) if s == info.stage => stage,
                _ => bail!(
                    "--resume {} holds stage {}, but --stage is {}",
                    path.display(),
                    info.stage,
                    a.stage
                ),
            };
        }
        let checkpoint_every = match a.checkpoint_every {
            None => None,
            Some(s) if s.is_finite() && s >= 1.0 => Some(Duration::from_secs_f64(s)),
            Some(s) => bail!("--checkpoint-every must be at least 1 second, not {s}"),
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
        if a.keep_forwards == 0 {
            bail!("--keep-forwards must be at least 1");
        }
        let throughput = match a.throughput.as_str() {
            "auto" => None,
            t => match t.parse::<f64>() {
                Ok(x) if x.is_finite() && x > 0.0 => Some(x),
                _ => bail!(
                    "--throughput must be `auto` or a positive number of samples/s, not {t:?}"
                ),
            },
        };
        let mut listen = parse_addrs(&a.listen)?;
        if listen.is_empty() {
            listen = default_listen(&a.net)?;
        }
        let run = RunSource::parse(&a.run);
        if let RunSource::File(p) = &run {
            // A typo in the run file should fail before any key is created.
            Manifest::load(p)?;
        }
        let (identity, _created) = keys::load_or_create_identity(&a.identity)?;
        let mut netcfg = net_config(&a.net, identity, listen)?;
        netcfg.relay_server = a.relay_server;
        netcfg.dht_server = !a.dht_client;
        let ttl = Duration::from_secs(a.announce_ttl);
        // Providers outlive announcements (a reader tells a live replica by its
        // announcement); republished every third of it.
        netcfg.provider_ttl = (ttl * 3).max(Duration::from_secs(5));
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
        cfg.checkpoint_every = checkpoint_every;
        cfg.resume = a.resume.clone();
        cfg.throughput = throughput;
        cfg.rebalance = (a.rebalance_every > 0).then(|| Duration::from_secs(a.rebalance_every));
        cfg.allow_sim = a.allow_sim;
        cfg.sim_slowdown = a.sim_slowdown;
        cfg.kept_forwards = a.keep_forwards;
        cfg.bound_staleness = !a.unbounded_staleness;
        cfg.weight_prediction = !a.no_weight_prediction;
        Ok(cfg)
    }
}

/// Validates `shoal train`'s swarm flags into a peer config that serves no stage and runs
/// the trainer loops.
pub fn trainer_config(a: &SwarmTrainArgs) -> Result<PeerConfig> {
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
    if !(a.call_timeout.is_finite() && a.call_timeout > 0.0 && a.call_timeout <= 86_400.0) {
        bail!("--call-timeout must be a number of seconds between 0 and 86400");
    }
    let (mut netcfg, bootstrap) = client_config(&a.net)?;
    // A trainer listens too (not to be dialled, it serves nothing): its calls then leave
    // from that port, so a NAT maps them to one address that hole punching can reach.
    netcfg.listen = default_listen(&a.net)?;
    let mut cfg = PeerConfig::new(source, netcfg, bootstrap, StageChoice::None);
    cfg.trainers = a.trainers;
    cfg.trainer.concurrency = a.concurrency;
    cfg.trainer.index = a.data_index;
    cfg.trainer.sync_steps = !a.no_sync_steps;
    if a.microbatches == Some(0) {
        bail!("--microbatches must be at least 1");
    }
    cfg.trainer.max_microbatches = a.microbatches;
    cfg.trainer.routing = a.routing.parse().map_err(anyhow::Error::msg)?;
    cfg.trainer.push = !a.no_push;
    cfg.trainer.call_timeout = Duration::from_secs_f64(a.call_timeout);
    cfg.trainer.data = a.data.clone();
    Ok(cfg)
}
