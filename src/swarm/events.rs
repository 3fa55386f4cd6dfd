//! What a peer or trainer process reports, as typed values: the library's [`super::peer::Peer`]
//! hands its events to an observer, and `shoal peer` / `shoal train` write every event
//! as one JSON object per line with `--events` (the status stream a harness or monitor
//! reads) and show it to people through its `Display`. Nothing reads the printed text.

use crate::averaging::AvgSnapshot;
use crate::net::reach::NetEvent;
use crate::stage::service::CounterSnapshot;
use crate::trainer::report::Progress;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One event, tagged by `"event"` in JSON (e.g. `{"event":"ready","peer":"12D3…"}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// A new identity key file was written.
    IdentityCreated {
        /// Its path.
        path: String,
    },
    /// The peer listens on this full address (with `/p2p/`).
    Listening {
        /// The multiaddr.
        addr: String,
    },
    /// The run was found (or published).
    Run {
        /// Its id.
        id: String,
    },
    /// A stage's state was downloaded from its replicas.
    Synced {
        /// The stage.
        stage: usize,
        /// The step downloaded.
        step: u64,
        /// Donors used.
        donors: usize,
        /// Chunks fetched from each donor.
        chunks_per_donor: Vec<usize>,
        /// Bytes of state downloaded.
        #[serde(default)]
        bytes: u64,
        /// Seconds the download took (retries included).
        #[serde(default)]
        seconds: f64,
        /// Of which before the first chunk was asked for (the donors' offers, the chunk
        /// hashes) in the last attempt.
        #[serde(default)]
        setup_s: f64,
    },
    /// A state download is under way (reported every second while it runs).
    Downloading {
        /// The stage.
        stage: usize,
        /// Bytes checked and in place.
        bytes: u64,
        /// Bytes of the whole state.
        total: u64,
    },
    /// A stage's state was loaded from a checkpoint (`--resume`).
    Resumed {
        /// The stage.
        stage: usize,
        /// The step it holds.
        step: u64,
        /// Its parameters' hash.
        params_hash: String,
        /// Whether it is served as it is (else a replica ahead of it was downloaded from).
        kept: bool,
    },
    /// A stage checkpoint was written.
    Checkpointed {
        /// The stage.
        stage: usize,
        /// The step it holds.
        step: u64,
        /// Its parameters' hash.
        params_hash: String,
        /// Where.
        path: String,
    },
    /// Something went wrong that the peer survives.
    Warning {
        /// What, on one line.
        message: String,
    },
    /// A state download failed and is tried again.
    SyncRetry {
        /// The stage.
        stage: usize,
        /// Why it failed.
        error: String,
    },
    /// The peer serves a stage.
    Serving {
        /// The stage.
        stage: usize,
        /// Stages in the run.
        stages: usize,
        /// The device's name.
        device: String,
        /// The throughput it announces.
        samples_per_s: f64,
    },
    /// Trainer loops run beside the stage.
    Trainers {
        /// How many.
        loops: usize,
    },
    /// The peer is up: serving (if it serves a stage) and announced.
    Ready {
        /// Its peer id.
        peer: String,
    },
    /// A leaving replica stopped waiting with work still held.
    Leaving {
        /// The stage left.
        stage: usize,
        /// Requests still queued.
        queued: u32,
        /// Samples not averaged yet.
        pending: u64,
        /// Whether the service was already closed.
        closed: bool,
    },
    /// Rebalancing: the peer moves to a weaker stage.
    Rebalancing {
        /// The stage left.
        from: usize,
        /// The stage joined.
        to: usize,
    },
    /// A move failed; the peer goes back to its stage.
    MoveFailed {
        /// The stage it could not serve.
        to: usize,
        /// The stage it goes back to.
        back: usize,
        /// Why.
        error: String,
    },
    /// Going back failed too: the peer serves nothing.
    ReturnFailed {
        /// The stage it could not serve again.
        stage: usize,
        /// Why.
        error: String,
    },
    /// The replica's counters (periodically with `--counters-ms`, and on stop).
    Counters {
        /// The stage served.
        stage: usize,
        /// The counters.
        counters: CounterSnapshot,
        /// The averager's counters, when it runs.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        averaging: Option<AvgSnapshot>,
        /// The process's peak resident memory so far, bytes (0 where unknown).
        #[serde(default)]
        peak_rss_bytes: u64,
    },
    /// The trainer loops' totals.
    Progress {
        /// The totals.
        progress: Progress,
        /// Seconds since the trainers started.
        seconds: f64,
    },
    /// The trainer loops finished: their final totals.
    Done {
        /// The totals.
        progress: Progress,
    },
    /// Why samples failed and calls were swapped (reason → count).
    Reasons {
        /// Failed samples by reason.
        failed: BTreeMap<String, u64>,
        /// Swapped calls by reason.
        swapped: BTreeMap<String, u64>,
    },
    /// What the network learned about reaching this peer, or about another peer: AutoNAT's
    /// verdict, a relay reservation, a relayed connection, a hole punch, a refused peer.
    Net {
        /// What (tagged by `"net"`: `{"event":"net","net":"hole_punch",...}`).
        #[serde(flatten)]
        what: NetEvent,
    },
    /// Ctrl-C or SIGTERM: the peer stops gracefully.
    Stopping,
    /// The peer stopped.
    Stopped,
}

impl std::fmt::Display for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Event::IdentityCreated { path } => write!(f, "created identity {path}"),
            Event::Listening { addr } => write!(f, "listening on {addr}"),
            Event::Run { id } => write!(f, "run {id}"),
            Event::Synced {
                stage,
                step,
                donors,
                chunks_per_donor,
                bytes,
                seconds,
                setup_s,
            } => write!(
                f,
                "synced stage {stage} at step {step} from {donors} donor(s), chunks {chunks_per_donor:?}, {:.1} MB in {seconds:.1} s ({setup_s:.1} s before the first chunk)",
                *bytes as f64 / 1e6
            ),
            Event::Downloading {
                stage,
                bytes,
                total,
            } => write!(
                f,
                "downloading stage {stage}'s state: {:.1} of {:.1} MB",
                *bytes as f64 / 1e6,
                *total as f64 / 1e6
            ),
            Event::Resumed {
                stage,
                step,
                params_hash,
                kept,
            } => write!(
                f,
                "resumed at step {step}: stage {stage}, parameters {params_hash}{}",
                if *kept {
                    ""
                } else {
                    " (replicas ahead of it: their state is downloaded instead)"
                }
            ),
            Event::Warning { message } => write!(f, "warning: {message}"),
            Event::Checkpointed {
                stage,
                step,
                params_hash,
                path,
            } => write!(
                f,
                "checkpoint of stage {stage} at step {step} ({params_hash}) written to {path}"
            ),
            Event::SyncRetry { stage, error } => write!(
                f,
                "cannot download stage {stage}'s state ({error}); trying again"
            ),
            Event::Serving {
                stage,
                stages,
                device,
                samples_per_s,
            } => write!(
                f,
                "serving stage {stage} of {stages} on {device}: {samples_per_s:.1} samples/s"
            ),
            Event::Trainers { loops } => write!(f, "running {loops} trainer loop(s)"),
            Event::Ready { peer } => write!(f, "peer {peer} ready; Ctrl-C to stop"),
            Event::Leaving {
                stage,
                queued,
                pending,
                closed,
            } => write!(
                f,
                "leaving stage {stage}{} with {queued} request(s) queued and {pending} sample(s) not yet averaged",
                if *closed { " after closing" } else { "" }
            ),
            Event::Rebalancing { from, to } => write!(
                f,
                "rebalancing: moving from stage {from} to the weakest stage {to}"
            ),
            Event::MoveFailed { to, back, error } => write!(
                f,
                "cannot serve stage {to} ({error}); going back to stage {back}"
            ),
            Event::ReturnFailed { stage, error } => write!(
                f,
                "cannot serve stage {stage} again: {error}; serving nothing"
            ),
            Event::Counters {
                stage,
                counters,
                peak_rss_bytes,
                ..
            } => write!(
                f,
                "stage {stage} {counters} peak_rss_mb {:.1}",
                *peak_rss_bytes as f64 / 1e6
            ),
            Event::Progress { progress, seconds } => write!(f, "{progress}  ({seconds:.0} s)"),
            Event::Done { progress } => write!(f, "done: {progress}"),
            Event::Reasons { failed, swapped } => {
                let mut lines = Vec::new();
                for (reason, n) in failed {
                    lines.push(format!("  failed {n} samples: {reason}"));
                }
                for (reason, n) in swapped {
                    lines.push(format!("  swapped {n} calls: {reason}"));
                }
                write!(f, "{}", lines.join("\n"))
            }
            Event::Net { what } => write!(f, "{what}"),
            Event::Stopping => write!(
                f,
                "stopping: finishing in-flight work, withdrawing announcements"
            ),
            Event::Stopped => write!(f, "stopped"),
        }
    }
}

/// The peak resident memory of this process so far (Linux `VmHWM`), bytes; `None` where
/// the platform does not say.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_status_bytes("VmHWM:")
}

/// The resident memory of this process now (Linux `VmRSS`), bytes; `None` where the
/// platform does not say.
pub fn rss_bytes() -> Option<u64> {
    proc_status_bytes("VmRSS:")
}

/// A `kB` field of `/proc/self/status`, in bytes.
fn proc_status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Reports what `net` learns as [`Event::Net`] until its network stops (a task of
/// `tasks`).
pub fn forward_net_events(
    net: &crate::net::NetHandle,
    emit: Observer,
    tasks: &crate::tasks::Tasks,
) {
    let mut rx = net.subscribe();
    tasks.spawn(async move {
        loop {
            match rx.recv().await {
                Ok(what) => emit(Event::Net { what }),
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                    tracing::debug!(target: "shoal::net", "{n} network events not reported");
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
            }
        }
    });
}

/// Receives a peer's events.
pub type Observer = std::sync::Arc<dyn Fn(Event) + Send + Sync>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_round_trip_as_tagged_json_lines() {
        let events = vec![
            Event::Listening {
                addr: "/ip4/127.0.0.1/tcp/1/p2p/x".into(),
            },
            Event::Ready { peer: "p".into() },
            Event::Downloading {
                stage: 1,
                bytes: 3 << 20,
                total: 7 << 20,
            },
            Event::Counters {
                stage: 2,
                counters: CounterSnapshot {
                    jobs: 3,
                    ..CounterSnapshot::default()
                },
                averaging: Some(AvgSnapshot {
                    rounds: 4,
                    recent_rounds_ms: vec![12.5, 8.0],
                    ..AvgSnapshot::default()
                }),
                peak_rss_bytes: 1 << 30,
            },
            Event::Progress {
                progress: Progress {
                    loss: f64::NAN,
                    ..Progress::default()
                },
                seconds: 1.5,
            },
            Event::Reasons {
                failed: BTreeMap::from([("timeout".to_string(), 4)]),
                swapped: BTreeMap::new(),
            },
            Event::Net {
                what: NetEvent::HolePunch {
                    peer: "p".into(),
                    ok: false,
                    error: Some("gave up".into()),
                },
            },
            Event::Stopped,
        ];
        for e in events {
            let line = serde_json::to_string(&e).unwrap();
            assert!(!line.contains('\n'));
            let back: Event = serde_json::from_str(&line).unwrap();
            match (&e, &back) {
                // NaN is never equal to itself: compare the rest.
                (Event::Progress { seconds: a, .. }, Event::Progress { progress, seconds }) => {
                    assert!(progress.loss.is_nan());
                    assert_eq!(a, seconds);
                }
                _ => assert_eq!(back, e),
            }
        }
        let ready: Event = serde_json::from_str(r#"{"event":"ready","peer":"12D3"}"#).unwrap();
        assert_eq!(ready.to_string(), "peer 12D3 ready; Ctrl-C to stop");
        assert!(serde_json::from_str::<Event>(r#"{"event":"nope"}"#).is_err());
        // The NAT lab reads these keys.
        let punch: Event =
            serde_json::from_str(r#"{"event":"net","net":"hole_punch","peer":"p","ok":true}"#)
                .unwrap();
        assert_eq!(punch.to_string(), "hole punch with p: direct connection");
        // This process has a peak resident set on Linux, and it is not tiny.
        if cfg!(target_os = "linux") {
            assert!(peak_rss_bytes().unwrap() > 1 << 20);
        }
    }
}
