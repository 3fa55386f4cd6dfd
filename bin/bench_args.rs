//! The flags of `shoal bench` (clap): one subcommand per benchmark; `bench_cmds` runs them.

use crate::bench_cmds;
use clap::Subcommand;
use std::path::PathBuf;

#[derive(Subcommand)]
pub(crate) enum BenchCommand {
    /// One stage's forward + backward tokens/s on a device (after checking, on that device,
    /// that staged gradients equal the unsplit model's).
    Stage {
        /// Run config, e.g. configs/gpt2-124m.toml.
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
        /// The stage to time.
        #[arg(long, default_value_t = 0, value_name = "I")]
        stage: usize,
        /// Device: cpu, cuda:N or metal.
        #[arg(long, default_value = "cpu", value_name = "DEVICE")]
        device: String,
        /// Comma-separated dtypes: f32, bf16, f16.
        #[arg(long, default_value = "f32", value_name = "LIST")]
        dtypes: String,
        /// Microbatch size (default: the config's training.batch_size).
        #[arg(long, value_name = "N")]
        batch: Option<usize>,
        /// Seconds timed per dtype.
        #[arg(long, default_value_t = 10.0, value_name = "SECS")]
        seconds: f64,
        /// Print JSON instead of lines.
        #[arg(long)]
        json: bool,
    },
    /// Bursts of concurrent calls, each on a fresh stream, at one replica: how many
    /// streams were answered, answered `overloaded`, or dropped.
    Streams {
        /// Callers, each with its own connection.
        #[arg(long, default_value_t = 8)]
        connections: usize,
        /// Calls each caller has in flight at once.
        #[arg(long, default_value_t = 32)]
        at_once: usize,
        /// Bursts, one after another.
        #[arg(long, default_value_t = 5)]
        bursts: usize,
        /// Also write the report as JSON to this file.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
    },
    /// The same model on the same text once per activation codec: bytes per sample across
    /// stage boundaries against the loss reached.
    Compress {
        /// Comma-separated activation codecs, the first the reference.
        #[arg(
            long,
            default_value = "int8,subspace:16,subspace:6",
            value_name = "LIST"
        )]
        codecs: String,
        /// Optimizer steps per codec.
        #[arg(long, default_value_t = 300, value_name = "N")]
        steps: u64,
        /// Samples each codec trains on the swarm rows (0: no swarm rows).
        #[arg(long, default_value_t = 3200, value_name = "N")]
        swarm_samples: u64,
        /// How the swarm rows' replicas average: `step` (every step's gradients) or
        /// `outer` (`[averaging] mode = "outer"` with its defaults).
        #[arg(long, default_value = "step", value_name = "MODE")]
        averaging: String,
        /// The model's width (4 blocks in 2 stages).
        #[arg(long, default_value_t = 256, value_name = "D")]
        d_model: usize,
        /// Text to train on (default: this machine's documentation).
        #[arg(long, value_name = "FILE")]
        text: Option<PathBuf>,
        /// Also write the rows as JSON to this file.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
    },
    /// Encode+decode speed, compression ratio and error of every tensor codec.
    Codec {
        /// Elements in the N(0, 1) test tensor.
        #[arg(long, default_value_t = 16 << 20)]
        elements: usize,
        /// Timed repetitions per codec (the fastest is reported).
        #[arg(long, default_value_t = 5)]
        reps: usize,
        /// Comma-separated codecs (default: f32,f16,bf16,int8,int8+zstd1,bf16+zstd1).
        #[arg(long, value_name = "LIST")]
        codecs: Option<String>,
    },
    /// One tensor between two real peers over loopback: encode, send, receive, decode.
    Transfer {
        /// Tensor size in MiB of f32.
        #[arg(long, default_value_t = 32)]
        mib: usize,
        /// Timed repetitions (median and best are reported).
        #[arg(long, default_value_t = 5)]
        reps: usize,
        /// Comma-separated codecs (default: f32,int8).
        #[arg(long, value_name = "LIST")]
        codecs: Option<String>,
        /// QUIC instead of TCP.
        #[arg(long)]
        quic: bool,
    },
    /// One butterfly all-reduce among N peers in this process, against its bandwidth bound.
    Allreduce {
        /// Peers taking part.
        #[arg(long, default_value_t = 4)]
        peers: usize,
        /// Floats in the vector.
        #[arg(long, default_value_t = 4 << 20)]
        floats: usize,
        /// Codec of the parts.
        #[arg(long, default_value = "int8+zstd1")]
        codec: String,
        /// Emulated link of every peer, e.g. bw=100mbit,rtt=50ms.
        #[arg(long, value_name = "SPEC")]
        emulate_link: Option<String>,
        /// Timed repetitions (the median is reported).
        #[arg(long, default_value_t = 3)]
        reps: usize,
    },
    /// Time to a target loss: synchronous, no-sync and delayed steps on a swarm of real
    /// tiny stages behind emulated links, and `train --local` for reference.
    Converge(bench_cmds::ConvergeArgs),
    /// Hundreds of peers in this process (real libp2p stacks, sim stages, home links,
    /// churn): join time, efficiency against the bound, DHT lookups, averaging groups.
    Sim(crate::sim_cmd::SimArgs),
    /// A local swarm (separate processes, emulated home links) against its physical bound.
    Swarm {
        /// Comma-separated: homogeneous, heterogeneous, compression, churn, real, or all.
        #[arg(long, default_value = "homogeneous", value_name = "NAME")]
        scenario: String,
        /// Seconds measured per setup, after the warm-up (with `--samples`, at most).
        #[arg(long, default_value_t = 30.0, value_name = "SECS")]
        seconds: f64,
        /// Close the measured window once this many samples completed after the warm-up
        /// (or after `--seconds`, whichever comes first).
        #[arg(long, value_name = "N")]
        samples: Option<u64>,
        /// Seconds of warm-up before measuring.
        #[arg(long, default_value_t = 8.0, value_name = "SECS")]
        warmup: f64,
        /// Microbatches each trainer keeps in flight: enough that every replica's queue
        /// stays fed across the links' latency (see BENCHMARKS.md for a sweep).
        #[arg(long, default_value_t = 96, value_name = "N")]
        concurrency: usize,
        /// Also write the rows as a JSON array here.
        #[arg(long, value_name = "PATH")]
        json: Option<PathBuf>,
    },
}
