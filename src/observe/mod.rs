//! What a running peer or trainer exposes to watchers: one [`Snapshot`] of its counters,
//! read on demand, rendered as Prometheus metrics (`/metrics`) and as the JSON the
//! dashboard polls (`/api/status`); [`http`] serves both and the dashboard page.
//!
//! The counters live where they are counted (the stage service, the averager, the trainer
//! loops); a scrape reads them through a [`Source`] and encodes the values it finds, so
//! there is one copy of each number and nothing to keep in sync.

pub mod http;

use crate::averaging::{guard::Banned, AvgSnapshot};
use crate::stage::service::CounterSnapshot;
use crate::trainer::report::Progress;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeCounterValue, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;

/// The replica this process serves, as a snapshot reports it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReplicaView {
    /// The stage.
    pub stage: usize,
    /// Optimizer steps applied.
    pub step: u64,
    /// Parameter hash.
    pub params_hash: String,
    /// Requests waiting, and the queue's capacity.
    pub queue: (u32, u32),
    /// Samples in every applied step.
    pub samples_applied: u64,
    /// Samples lost with dead replicas.
    pub samples_lost: u64,
    /// The service's counters.
    pub counters: CounterSnapshot,
    /// The averager's counters.
    pub averaging: Option<AvgSnapshot>,
}

/// The bytes this process's trainers moved with one replica.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LinkView {
    /// The replica's peer id.
    pub peer: String,
    /// Frame bytes sent to it.
    pub sent: u64,
    /// Frame bytes received from it.
    pub received: u64,
}

/// Tensors this process sent or received in one codec: f32 bytes against wire bytes.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CodecView {
    /// What the codec carries: `activations` (the trainers' calls) or `gradients`
    /// (this replica's averaging parts).
    pub kind: String,
    /// The codec, e.g. `int8` or `int8+zstd1`.
    pub codec: String,
    /// The tensors as f32.
    pub raw: u64,
    /// Their frames on the wire.
    pub wire: u64,
}

/// Everything a process reports at one moment.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Snapshot {
    /// This peer's id.
    pub peer: String,
    /// The run.
    pub run: String,
    /// Seconds since the process started serving or training.
    pub seconds: f64,
    /// The replica served, if any.
    pub replica: Option<ReplicaView>,
    /// The trainer loops' totals, if any run here.
    pub trainer: Option<Progress>,
    /// Failed samples by reason (trainers).
    pub failed: BTreeMap<String, u64>,
    /// Calls repeated elsewhere by reason (trainers).
    pub swapped: BTreeMap<String, u64>,
    /// Peak resident memory, bytes (0 where unknown).
    pub peak_rss_bytes: u64,
    /// The trainers' bytes per replica called.
    #[serde(default)]
    pub links: Vec<LinkView>,
    /// Raw against wire bytes per codec.
    #[serde(default)]
    pub compression: Vec<CodecView>,
    /// The swarm's latest held-out loss as this process measured it (`--eval-every`).
    #[serde(default)]
    pub eval_loss: Option<f64>,
    /// Replicas announced per stage, as the trainers here last read the DHT (empty
    /// without trainers).
    #[serde(default)]
    pub stage_replicas: Vec<u64>,
}

/// Link metrics name at most this many replicas (the busiest), so that a scrape stays
/// small in a large swarm.
pub const METRIC_LINKS: usize = 32;

/// Reads a fresh snapshot.
pub type Source = Arc<dyn Fn() -> Snapshot + Send + Sync>;

/// A registry whose collector reads `source` at every scrape (metric names carry the
/// `shoal_` prefix; counters end in `_total`, times in `_seconds`, sizes in `_bytes`).
pub fn registry(source: Source) -> Registry {
    let mut r = Registry::with_prefix("shoal");
    r.register_collector(Box::new(SnapshotCollector(source)));
    r
}

/// The registry in the Prometheus/OpenMetrics text format.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, registry).is_err() {
        out.clear();
    }
    out
}

struct SnapshotCollector(Source);

impl std::fmt::Debug for SnapshotCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SnapshotCollector")
    }
}

type Labels<'a> = [(&'static str, &'a str)];

/// Writes metrics into one scrape.
struct Out<'a, 'b> {
    enc: &'b mut DescriptorEncoder<'a>,
}

impl Out<'_, '_> {
    fn counter<N: EncodeCounterValue>(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        v: N,
    ) -> std::fmt::Result {
        let m = self
            .enc
            .encode_descriptor(name, help, unit.as_ref(), MetricType::Counter)?;
        ConstCounter::new(v).encode(m)
    }

    fn seconds(&mut self, name: &str, help: &str, us: u64) -> std::fmt::Result {
        self.counter(name, help, Some(Unit::Seconds), secs(us))
    }

    fn gauge(&mut self, name: &str, help: &str, unit: Option<Unit>, v: f64) -> std::fmt::Result {
        let m = self
            .enc
            .encode_descriptor(name, help, unit.as_ref(), MetricType::Gauge)?;
        ConstGauge::new(v).encode(m)
    }

    /// A counter family: one sample per label set.
    fn counters<N: EncodeCounterValue + Copy>(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        rows: &[(&Labels<'_>, N)],
    ) -> std::fmt::Result {
        let mut m = self
            .enc
            .encode_descriptor(name, help, unit.as_ref(), MetricType::Counter)?;
        for (labels, v) in rows {
            let labels: Vec<(&str, &str)> = labels.to_vec();
            ConstCounter::new(*v).encode(m.encode_family(&labels)?)?;
        }
        Ok(())
    }

    /// A counter family labelled by `reason`.
    fn by_reason(
        &mut self,
        name: &str,
        help: &str,
        counts: &BTreeMap<String, u64>,
    ) -> std::fmt::Result {
        let labels: Vec<[(&'static str, &str); 1]> =
            counts.keys().map(|k| [("reason", k.as_str())]).collect();
        let rows: Vec<(&Labels<'_>, u64)> = labels
            .iter()
            .zip(counts.values())
            .map(|(l, v)| (&l[..], *v))
            .collect();
        self.counters(name, help, None, &rows)
    }
}

/// Microseconds as seconds.
fn secs(us: u64) -> f64 {
    us as f64 / 1e6
}

impl Collector for SnapshotCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let s = (self.0)();
        let mut o = Out { enc: &mut encoder };
        o.gauge(
            "uptime",
            "Seconds since the process started",
            Some(Unit::Seconds),
            s.seconds,
        )?;
        o.gauge(
            "peak_resident_memory",
            "Peak resident memory of the process",
            Some(Unit::Bytes),
            s.peak_rss_bytes as f64,
        )?;
        if let Some(r) = &s.replica {
            encode_replica(&mut o, r)?;
        }
        if !s.compression.is_empty() {
            let rows: Vec<([(&'static str, &str); 3], u64)> = s
                .compression
                .iter()
                .flat_map(|c| {
                    [
                        (
                            [
                                ("kind", c.kind.as_str()),
                                ("codec", c.codec.as_str()),
                                ("form", "raw"),
                            ],
                            c.raw,
                        ),
                        (
                            [
                                ("kind", c.kind.as_str()),
                                ("codec", c.codec.as_str()),
                                ("form", "wire"),
                            ],
                            c.wire,
                        ),
                    ]
                })
                .collect();
            let rows: Vec<(&Labels<'_>, u64)> = rows.iter().map(|(l, v)| (&l[..], *v)).collect();
            o.counters(
                "codec_tensor",
                "Tensor bytes by codec, as f32 (raw) and as sent (wire)",
                Some(Unit::Bytes),
                &rows,
            )?;
        }
        if let Some(t) = &s.trainer {
            o.gauge(
                "trainer_step",
                "Step of the slowest stage as the trainers see it",
                None,
                t.step as f64,
            )?;
            o.gauge(
                "trainer_loss",
                "Mean recent training loss (NaN before the first)",
                None,
                t.loss,
            )?;
            if let Some(e) = s.eval_loss {
                o.gauge(
                    "trainer_eval_loss",
                    "The swarm's latest held-out loss (2 eval batches)",
                    None,
                    e,
                )?;
            }
            o.counter(
                "trainer_samples_fed",
                "Samples started by the trainers",
                None,
                t.fed,
            )?;
            o.counter(
                "trainer_samples_completed",
                "Samples through forward and backward",
                None,
                t.completed,
            )?;
            o.counter(
                "trainer_samples_failed",
                "Samples that failed",
                None,
                t.failed,
            )?;
            o.counter(
                "trainer_swaps",
                "Calls repeated on another replica",
                None,
                t.swaps,
            )?;
            o.counter(
                "trainer_wire",
                "Tensor frame bytes sent and received by the trainers",
                Some(Unit::Bytes),
                t.wire,
            )?;
            o.counter(
                "trainer_raw",
                "The same tensors as f32",
                Some(Unit::Bytes),
                t.raw,
            )?;
            o.by_reason("trainer_failures", "Failed samples by reason", &s.failed)?;
            encode_links(&mut o, &s.links)?;
            if !s.stage_replicas.is_empty() {
                let labels: Vec<String> =
                    (0..s.stage_replicas.len()).map(|i| i.to_string()).collect();
                let mut m = o.enc.encode_descriptor(
                    "stage_replicas",
                    "Replicas announced per stage, as the trainers last read the DHT",
                    None,
                    MetricType::Gauge,
                )?;
                for (l, v) in labels.iter().zip(&s.stage_replicas) {
                    ConstGauge::new(*v as f64)
                        .encode(m.encode_family(&[("stage", l.as_str())])?)?;
                }
            }
            o.by_reason(
                "trainer_swap_reasons",
                "Swapped calls by reason",
                &s.swapped,
            )?;
        }
        Ok(())
    }
}

/// The busiest [`METRIC_LINKS`] links, by peer and direction.
fn encode_links(o: &mut Out<'_, '_>, links: &[LinkView]) -> std::fmt::Result {
    let mut busiest: Vec<&LinkView> = links.iter().collect();
    busiest.sort_by_key(|l| std::cmp::Reverse(l.sent + l.received));
    busiest.truncate(METRIC_LINKS);
    let labels: Vec<[(&'static str, &str); 2]> = busiest
        .iter()
        .flat_map(|l| {
            [
                [("peer", l.peer.as_str()), ("direction", "out")],
                [("peer", l.peer.as_str()), ("direction", "in")],
            ]
        })
        .collect();
    let values = busiest.iter().flat_map(|l| [l.sent, l.received]);
    let rows: Vec<(&Labels<'_>, u64)> = labels.iter().map(|l| &l[..]).zip(values).collect();
    o.counters(
        "trainer_link",
        "Frame bytes the trainers moved with each replica (the busiest 32)",
        Some(Unit::Bytes),
        &rows,
    )
}

fn encode_replica(o: &mut Out<'_, '_>, r: &ReplicaView) -> std::fmt::Result {
    let c = &r.counters;
    o.gauge("stage", "The pipeline stage served", None, r.stage as f64)?;
    o.gauge(
        "step",
        "Optimizer steps applied by this replica",
        None,
        r.step as f64,
    )?;
    o.gauge(
        "queue_depth",
        "Forward and backward requests waiting",
        None,
        f64::from(r.queue.0),
    )?;
    o.gauge(
        "queue_capacity",
        "Requests the queue holds",
        None,
        f64::from(r.queue.1),
    )?;
    o.counter(
        "samples_applied",
        "Samples in every applied step",
        None,
        r.samples_applied,
    )?;
    o.counter(
        "samples_lost",
        "Samples lost with dead replicas",
        None,
        r.samples_lost,
    )?;
    o.counter(
        "samples_accumulated",
        "Samples whose gradients this replica accumulated",
        None,
        c.samples_accumulated,
    )?;
    o.counter("requests_served", "Requests answered", None, c.served)?;
    o.counter(
        "requests_refused",
        "Requests refused with a reason",
        None,
        c.refused,
    )?;
    o.counter(
        "requests_dropped",
        "Streams dropped unanswered",
        None,
        c.dropped,
    )?;
    o.counter("jobs", "Forward and backward jobs computed", None, c.jobs)?;
    o.seconds(
        "compute",
        "Time computing forward and backward",
        c.compute_us,
    )?;
    o.seconds(
        "queue_wait",
        "Time requests waited in the queue",
        c.queue_us,
    )?;
    o.seconds("read", "Time reading requests", c.read_us)?;
    o.seconds("write", "Time writing replies", c.write_us)?;
    o.counters(
        "codec",
        "Time in the tensor codec",
        Some(Unit::Seconds),
        &[
            (&[("op", "decode")], secs(c.decode_us)),
            (&[("op", "encode")], secs(c.encode_us)),
        ],
    )?;
    o.counters(
        "network",
        "Bytes moved by kind and direction",
        Some(Unit::Bytes),
        &[
            (&[("kind", "stage"), ("direction", "in")], c.stage_in),
            (&[("kind", "stage"), ("direction", "out")], c.stage_out),
            (&[("kind", "averaging"), ("direction", "in")], c.avg_in),
            (&[("kind", "state"), ("direction", "out")], c.state_out),
        ],
    )?;
    if let Some(a) = &r.averaging {
        o.counter(
            "averaging_rounds",
            "Averaging rounds completed",
            None,
            a.rounds,
        )?;
        o.counter(
            "averaging_failed_attempts",
            "Round attempts abandoned",
            None,
            a.failed_attempts,
        )?;
        o.counter(
            "averaging_sent",
            "Bytes this replica sent in rounds",
            Some(Unit::Bytes),
            a.bytes_sent,
        )?;
        o.counter(
            "averaging_resyncs",
            "State downloads after falling behind",
            None,
            a.resyncs,
        )?;
        o.counter(
            "averaging_rejected",
            "Gradient chunks rejected (NaN/inf, norm)",
            None,
            a.rejected,
        )?;
        let last = a.recent_rounds_ms.last().copied().unwrap_or(0.0) / 1e3;
        o.gauge(
            "averaging_last_round",
            "Duration of the last round",
            Some(Unit::Seconds),
            last,
        )?;
        o.gauge(
            "banned_peers",
            "Peers banned from this stage's rounds now",
            None,
            a.banned.len() as f64,
        )?;
    }
    Ok(())
}

/// The banned peers of a snapshot (for the dashboard's events).
pub fn banned(s: &Snapshot) -> Vec<Banned> {
    s.replica
        .as_ref()
        .and_then(|r| r.averaging.as_ref())
        .map(|a| a.banned.clone())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scrape_reads_the_source_and_names_follow_the_conventions() {
        let source: Source = Arc::new(|| Snapshot {
            peer: "p".into(),
            seconds: 2.5,
            replica: Some(ReplicaView {
                stage: 1,
                step: 42,
                queue: (3, 8),
                counters: CounterSnapshot {
                    served: 7,
                    compute_us: 1_500_000,
                    stage_in: 1024,
                    ..CounterSnapshot::default()
                },
                averaging: Some(AvgSnapshot {
                    rounds: 5,
                    ..AvgSnapshot::default()
                }),
                ..ReplicaView::default()
            }),
            trainer: Some(Progress {
                step: 40,
                loss: 1.25,
                fed: 64,
                ..Progress::default()
            }),
            failed: BTreeMap::from([("stage 1 timed out".to_string(), 16)]),
            links: vec![LinkView {
                peer: "r1".into(),
                sent: 100,
                received: 50,
            }],
            compression: vec![CodecView {
                kind: "activations".into(),
                codec: "int8".into(),
                raw: 400,
                wire: 104,
            }],
            eval_loss: Some(1.5),
            stage_replicas: vec![2, 3],
            ..Snapshot::default()
        });
        let text = render(&registry(source));
        for line in [
            "# TYPE shoal_step gauge",
            "shoal_step 42.0",
            "shoal_requests_served_total 7",
            "shoal_compute_seconds_total 1.5",
            "shoal_network_bytes_total{kind=\"stage\",direction=\"in\"} 1024",
            "shoal_averaging_rounds_total 5",
            "shoal_queue_depth 3.0",
            "shoal_trainer_loss 1.25",
            "shoal_trainer_eval_loss 1.5",
            "shoal_stage_replicas{stage=\"1\"} 3.0",
            "shoal_trainer_samples_fed_total 64",
            "shoal_trainer_failures_total{reason=\"stage 1 timed out\"} 16",
            "shoal_trainer_link_bytes_total{peer=\"r1\",direction=\"out\"} 100",
            "shoal_trainer_link_bytes_total{peer=\"r1\",direction=\"in\"} 50",
            "shoal_codec_tensor_bytes_total{kind=\"activations\",codec=\"int8\",form=\"raw\"} 400",
            "shoal_codec_tensor_bytes_total{kind=\"activations\",codec=\"int8\",form=\"wire\"} 104",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
    }
}
