//! `shoal bench …`: each benchmark subcommand handed to the code that runs it.

use crate::bench_args::BenchCommand;
use crate::{bench_cmds, parse_codec, sim_cmd};
use anyhow::{bail, Context, Result};
use std::process::ExitCode;

/// Runs benchmark `which`.
pub fn bench(which: BenchCommand) -> Result<ExitCode> {
    match which {
        BenchCommand::Allreduce {
            peers,
            floats,
            codec,
            emulate_link,
            reps,
        } => bench_cmds::bench_allreduce(peers, floats, &codec, emulate_link.as_deref(), reps),
        BenchCommand::Converge(a) => bench_cmds::bench_converge(a),
        BenchCommand::Sim(a) => sim_cmd::bench_sim(a),
        BenchCommand::Swarm {
            scenario,
            seconds,
            samples,
            warmup,
            concurrency,
            json,
        } => bench_cmds::bench_swarm(&scenario, (seconds, samples), warmup, concurrency, json),
        BenchCommand::Stage {
            config,
            stage,
            device,
            dtypes,
            batch,
            seconds,
            json,
        } => bench_cmds::bench_stage(&config, stage, &device, &dtypes, batch, seconds, json),
        BenchCommand::Compress {
            codecs,
            steps,
            swarm_samples,
            averaging,
            d_model,
            text,
            json,
        } => bench_cmds::bench_compress(
            &codecs,
            (steps, swarm_samples, &averaging),
            d_model,
            text,
            json,
        ),
        BenchCommand::Streams {
            connections,
            at_once,
            bursts,
            json,
        } => bench_cmds::bench_streams(connections, at_once, bursts, json),
        BenchCommand::Transfer {
            mib,
            reps,
            codecs,
            quic,
        } => bench_cmds::bench_transfer(mib, reps, codecs, quic),
        BenchCommand::Codec {
            elements,
            reps,
            codecs,
        } => {
            let mut cfg = shoal::bench::codec::CodecBenchConfig {
                elements,
                reps: reps.max(1),
                ..Default::default()
            };
            if elements == 0 {
                bail!("--elements must be at least 1");
            }
            if let Some(list) = codecs {
                cfg.codecs = list.split(',').map(parse_codec).collect::<Result<_>>()?;
            }
            println!(
                "codec benchmark: {} f32 values from N(0,1), one thread, best of {} (buffers reused)",
                cfg.elements, cfg.reps
            );
            let rows = shoal::bench::codec::run(&cfg).context("codec benchmark")?;
            print!("{}", shoal::bench::codec::table(&rows));
            Ok(ExitCode::SUCCESS)
        }
    }
}
