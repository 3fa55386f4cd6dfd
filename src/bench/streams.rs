//! `shoal bench streams`: bursts of concurrent calls at one replica, each on a stream of
//! its own, counting what became of every stream opened.
//!
//! One real stage service (stage 0 of the tiny model, real candle forwards) and several
//! callers, each its own libp2p node and so its own connection, in this process over
//! TCP on 127.0.0.1. Every call opens a fresh stream (no stream reuse, no retry) and sends a
//! dry forward. A stream is *answered* when a response came back (a result or a typed
//! refusal other than `overloaded`), *overloaded* when the answer was `overloaded` (the
//! queue or the lane was full), and *dropped* when it closed or reset without an answer or
//! none came within the call timeout. The replica's queue holds 8 calls, so a burst of
//! hundreds is mostly refused: the point is that every stream hears back.

use super::{bench_node, first_addr};
use crate::config::RunConfig;
use crate::dht::Manifest;
use crate::model::{ModelError, Stage};
use crate::net::streams::StreamCounts;
use crate::net::{NetError, NetHandle};
use crate::stage::exchange::exchange;
use crate::stage::replica::Replica;
use crate::stage::service::{ServiceConfig, StageService};
use crate::stage::{tensor, STAGE_PROTOCOL};
use crate::wire::msg::{Call, ErrorKind, Request, MSG_VERSION};
use crate::wire::{CodecSpec, Limits};
use candle_core::{DType, Device, Tensor};
use libp2p::PeerId;
use serde::Serialize;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Knobs of the streams benchmark.
#[derive(Debug, Clone)]
pub struct StreamsBenchConfig {
    /// Callers, each with its own connection to the replica.
    pub connections: usize,
    /// Calls each caller has in flight at once in a burst.
    pub at_once: usize,
    /// Bursts, one after another.
    pub bursts: usize,
    /// How long a call may wait for its answer before it counts as dropped.
    pub timeout: Duration,
}

impl Default for StreamsBenchConfig {
    fn default() -> Self {
        Self {
            connections: 8,
            at_once: 32,
            bursts: 5,
            timeout: Duration::from_secs(60),
        }
    }
}

/// What the benchmark reports (one JSON row).
#[derive(Debug, Clone, Serialize)]
pub struct StreamsReport {
    /// Always "streams".
    pub scenario: &'static str,
    /// Callers (connections).
    pub connections: usize,
    /// Calls in flight at once in a burst, all callers together.
    pub at_once: usize,
    /// Streams opened.
    pub opened: u64,
    /// Streams that got a response other than `overloaded`.
    pub answered: u64,
    /// Streams answered `overloaded`.
    pub overloaded: u64,
    /// Streams that closed or reset without an answer, or got none in time.
    pub dropped: u64,
    /// Streams that could not be opened at all.
    pub open_failed: u64,
    /// Of the answered, how many were a forward's result.
    pub served: u64,
    /// Seconds for every burst.
    pub seconds: f64,
    /// Streams opened per second.
    pub streams_per_s: f64,
    /// The replica's network layer: streams handed to its accept loop, answered by its
    /// lane's overflow answer, dropped.
    pub server: StreamCounts,
}

/// Why the benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum StreamsError {
    /// The network failed.
    #[error(transparent)]
    Net(#[from] NetError),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A bad setting.
    #[error("{0}")]
    Invalid(String),
}

enum Outcome {
    OpenFailed,
    Served,
    Refused,
    Overloaded,
    Dropped,
}

/// Runs the benchmark on the current tokio runtime.
pub async fn run(cfg: &StreamsBenchConfig) -> Result<StreamsReport, StreamsError> {
    if cfg.connections == 0 || cfg.at_once == 0 || cfg.bursts == 0 {
        return Err(StreamsError::Invalid(
            "--connections, --at-once and --bursts must be at least 1".into(),
        ));
    }
    let mut run_cfg = RunConfig::tiny();
    run_cfg.stages.count = 2;
    run_cfg.stages.cuts.clear();
    run_cfg
        .validate()
        .map_err(|e| StreamsError::Invalid(e.to_string()))?;
    let manifest =
        Manifest::from_config(&run_cfg).map_err(|e| StreamsError::Invalid(e.to_string()))?;
    let stage = Stage::new(&run_cfg, 0, &Device::Cpu)?;
    let replica = Arc::new(tokio::sync::Mutex::new(Replica::new(&run_cfg, stage)?));
    let server = bench_node(Some("/ip4/127.0.0.1/tcp/0"), None)?;
    let service = StageService::start(&server, &manifest, replica, ServiceConfig::default())?;
    let addr = first_addr(&server, "the replica").await?;
    let mut callers = Vec::new();
    for _ in 0..cfg.connections {
        let c = bench_node(None, None)?;
        c.dial(addr.clone()).await?;
        callers.push(c);
    }
    let peer = server.local_peer_id();
    let tokens = Tensor::zeros(
        (run_cfg.training.batch_size, run_cfg.model.seq_len),
        DType::U32,
        &Device::Cpu,
    )
    .map_err(ModelError::from)?;
    let frame = Arc::new(
        tensor::encode(&tokens, &CodecSpec::F32)
            .map_err(|e| StreamsError::Invalid(e.to_string()))?,
    );
    let req = Arc::new(Request {
        v: MSG_VERSION,
        run: manifest.id.clone(),
        stage: 0,
        step: 0,
        tensors: 1,
        call: Call::Forward {
            mb: 0,
            dry: true,
            push_to: None,
            pushed: false,
            sync: false,
        },
    });
    let t0 = Instant::now();
    let mut outcomes = Vec::new();
    for _ in 0..cfg.bursts {
        let mut calls = tokio::task::JoinSet::new();
        for c in &callers {
            for _ in 0..cfg.at_once {
                let (c, req, frame) = (c.clone(), Arc::clone(&req), Arc::clone(&frame));
                let timeout = cfg.timeout;
                calls.spawn(async move { call(&c, peer, &req, &frame, timeout).await });
            }
        }
        while let Some(o) = calls.join_next().await {
            outcomes.push(o.unwrap_or(Outcome::Dropped));
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    let count = |f: fn(&Outcome) -> bool| outcomes.iter().filter(|o| f(o)).count() as u64;
    let open_failed = count(|o| matches!(o, Outcome::OpenFailed));
    let served = count(|o| matches!(o, Outcome::Served));
    let answered = served + count(|o| matches!(o, Outcome::Refused));
    let overloaded = count(|o| matches!(o, Outcome::Overloaded));
    let dropped = count(|o| matches!(o, Outcome::Dropped));
    let opened = outcomes.len() as u64 - open_failed;
    let report = StreamsReport {
        scenario: "streams",
        connections: cfg.connections,
        at_once: cfg.connections * cfg.at_once,
        opened,
        answered,
        overloaded,
        dropped,
        open_failed,
        served,
        seconds,
        streams_per_s: opened as f64 / seconds.max(1e-9),
        server: server.stream_counts(&STAGE_PROTOCOL),
    };
    service.close().await;
    for c in callers {
        c.shutdown().await;
    }
    server.shutdown().await;
    Ok(report)
}

/// One call on a fresh stream, no retry.
async fn call(
    c: &NetHandle,
    peer: PeerId,
    req: &Request,
    frame: &[u8],
    timeout: Duration,
) -> Outcome {
    let Ok(stream) = c.open_stream(peer, STAGE_PROTOCOL).await else {
        return Outcome::OpenFailed;
    };
    let limits = Limits::default();
    let r = tokio::time::timeout(timeout, exchange(stream, req, &[frame], &limits)).await;
    match r {
        Err(_) => Outcome::Dropped,
        Ok(Ok((h, _))) => match h.error {
            None => Outcome::Served,
            Some(e) if e.kind == ErrorKind::Overloaded => Outcome::Overloaded,
            Some(_) => Outcome::Refused,
        },
        Ok(Err(e)) if e.kind() == Some(ErrorKind::Overloaded) => Outcome::Overloaded,
        Ok(Err(e)) if e.kind().is_some() => Outcome::Refused,
        Ok(Err(e)) => {
            tracing::debug!("call dropped: {e}");
            Outcome::Dropped
        }
    }
}

/// The report as a table.
pub fn table(r: &StreamsReport) -> String {
    format!(
        "{:>8} {:>9} {:>11} {:>8} {:>12} {:>8}\n{:>8} {:>9} {:>11} {:>8} {:>12} {:>8.0}\n\
         replica: {} streams accepted, {} answered overloaded by the lane, {} dropped\n",
        "opened",
        "answered",
        "overloaded",
        "dropped",
        "open failed",
        "str/s",
        r.opened,
        r.answered,
        r.overloaded,
        r.dropped,
        r.open_failed,
        r.streams_per_s,
        r.server.accepted,
        r.server.overflowed,
        r.server.dropped,
    )
}
