//! `shoal bench compress`'s swarm rows: the benchmark's model and text, once per activation
//! codec, on a swarm of real stages (2 stages × 2 replicas, 2 trainers, synchronous steps)
//! with every process behind the same slow home link, and the time each codec takes to
//! reach the first codec's final training loss.

use super::bench_converge::{run_swarm, ConvergeOptions, ConvergeRow};
use super::HarnessError;
use shoal::config::RunConfig;
use shoal::net::link::LinkSpec;
use std::path::PathBuf;
use std::time::Duration;

/// Samples a synchronous step of the swarm rows holds.
const TARGET_BATCH: usize = 32;

/// One codec's swarm run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SwarmRow {
    /// The activation codec.
    pub codec: String,
    /// Always `true`: told apart from the `train --local` rows.
    pub swarm: bool,
    /// Every process's emulated link.
    pub link: String,
    /// Samples the trainers completed.
    pub samples: u64,
    /// Wall seconds from the trainers' start to their exit.
    pub seconds: f64,
    /// Samples completed per second.
    pub samples_per_s: f64,
    /// The swarm's held-out loss after the last step.
    pub eval_loss: f64,
    /// The trainers' recent training loss when they finished.
    pub final_train_loss: f64,
    /// Seconds until the recent training loss first reached the first row's final one
    /// (`None`: never).
    pub seconds_to_reference_loss: Option<f64>,
    /// This row's seconds to that loss over the first row's.
    pub time_vs_reference: Option<f64>,
    /// Whether every stage's replicas ended at one step and one parameter hash.
    pub identical: bool,
}

/// Trains `runs` (label, run config) one after another on the swarm in converge mode
/// `mode` (`synchronous` or `outer`): the first on `samples` samples, the others on twice
/// as many; the first is the reference whose final training loss every row is timed to.
pub async fn swarm_rows(
    exe: PathBuf,
    runs: &[(String, RunConfig)],
    (samples, mode): (u64, &str),
    link: LinkSpec,
) -> Result<Vec<SwarmRow>, HarnessError> {
    let opts = ConvergeOptions {
        exe,
        samples,
        modes: vec!["synchronous".into()],
        concurrency: 1,
        link,
        local: false,
        timeout: Duration::from_secs(1200),
        target_batch: TARGET_BATCH,
    };
    let mut raw: Vec<(String, ConvergeRow)> = Vec::new();
    for (i, (codec, run)) in runs.iter().enumerate() {
        // The later codecs may need more samples than the first to reach its final loss:
        // they get twice as many, and are timed to that loss wherever they reach it.
        let samples = if i == 0 { samples } else { 2 * samples };
        let opts = ConvergeOptions {
            samples,
            ..opts.clone()
        };
        let mut cfg = run.clone();
        cfg.training.target_batch_size = Some(TARGET_BATCH);
        cfg.training.steps = samples.div_ceil(TARGET_BATCH as u64).max(1);
        let label = format!("compress-{}", codec.replace([':', '+'], "-"));
        println!("running {codec} on the swarm ({samples} samples)");
        let row = run_swarm(mode, &cfg, None, &opts, &label).await?;
        println!(
            "{codec}: {:.1} samples/s, eval loss {:.4}",
            row.samples_per_s, row.eval_loss
        );
        raw.push((codec.clone(), row));
    }
    let final_loss = |r: &ConvergeRow| r.curve.last().map_or(f64::NAN, |c| c.2);
    let reference = raw.first().map_or(f64::NAN, |(_, r)| final_loss(r));
    let time_to = |r: &ConvergeRow| r.curve.iter().find(|c| c.2 <= reference).map(|c| c.0);
    let ref_time = raw.first().and_then(|(_, r)| time_to(r));
    Ok(raw
        .iter()
        .map(|(codec, r)| {
            let t = time_to(r);
            SwarmRow {
                codec: codec.clone(),
                swarm: true,
                link: super::scenarios::link_arg(&opts.link),
                samples: r.samples,
                seconds: r.seconds,
                samples_per_s: r.samples_per_s,
                eval_loss: r.eval_loss,
                final_train_loss: final_loss(r),
                seconds_to_reference_loss: t,
                time_vs_reference: t.zip(ref_time).map(|(a, b)| a / b.max(1e-9)),
                identical: r.identical,
            }
        })
        .collect())
}

/// The swarm rows as a table.
pub fn table(rows: &[SwarmRow]) -> String {
    let mut s = format!(
        "{:<24} {:>9} {:>9} {:>10} {:>11} {:>16} {:>9}\n",
        "codec (swarm)",
        "samples/s",
        "seconds",
        "eval loss",
        "final loss",
        "to first's (s)",
        "vs first"
    );
    for r in rows {
        s += &format!(
            "{:<24} {:>9.1} {:>9.1} {:>10.4} {:>11.4} {:>16} {:>9}\n",
            r.codec,
            r.samples_per_s,
            r.seconds,
            r.eval_loss,
            r.final_train_loss,
            r.seconds_to_reference_loss
                .map_or("never".into(), |t| format!("{t:.1}")),
            r.time_vs_reference
                .map_or("-".into(), |x| format!("{x:.2}x")),
        );
    }
    s
}
