//! A small HTTP/1.1 server for watchers: `GET /metrics` (Prometheus text), and with the
//! dashboard `GET /` (one page, every asset inside the binary), `GET /api/status` (this
//! process's snapshot and the swarm as the DHT shows it) and `GET /api/history` (loss and
//! throughput over time). Requests are read with a size and time limit, at most
//! [`MAX_CONNECTIONS`] at once; anything else is answered 404 or dropped.

use super::{render, Snapshot, Source};
use crate::net::NetHandle;
use parking_lot::Mutex;
use prometheus_client::registry::Registry;
use serde::Serialize;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Connections served at once; more are closed unanswered.
pub const MAX_CONNECTIONS: usize = 32;
/// The most a request head may hold.
const MAX_HEAD: usize = 8 * 1024;
/// How long a client may take to send its request or read the answer.
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Points of history kept (one a second: an hour).
const HISTORY: usize = 3600;
/// Events kept for the dashboard.
const EVENTS: usize = 200;

const PAGE: &str = include_str!("dashboard.html");

/// One point of the history.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    /// Seconds since the server started.
    pub t: f64,
    /// The replica's step, or the trainers' when no replica is served.
    pub step: u64,
    /// The trainers' recent loss (null when none).
    pub loss: Option<f64>,
    /// The swarm's held-out loss, when a new measurement came since the last point.
    pub eval_loss: Option<f64>,
    /// Samples per second completed by the trainers, or accumulated by the replica.
    pub samples_per_s: f64,
    /// Wire bytes per second of this process's tensors (trainers' frames, or the
    /// replica's stage traffic in and out).
    pub wire_per_s: f64,
    /// Raw (f32) over wire bytes so far, for the trainers' frames (0 when unknown).
    pub ratio: f64,
}

/// What the server shows.
pub struct State {
    source: Source,
    registry: Registry,
    net: std::sync::OnceLock<(NetHandle, String)>,
    started: Instant,
    history: Mutex<VecDeque<Point>>,
    swarm: Mutex<serde_json::Value>,
    events: Mutex<VecDeque<(f64, String)>>,
    /// Bytes/s on each link of the trainers over the last sampling second.
    link_rates: Mutex<Vec<LinkRate>>,
}

/// Bytes per second between this process's trainers and one replica.
#[derive(Debug, Clone, Serialize)]
pub struct LinkRate {
    /// The replica.
    pub peer: String,
    /// Sent to it.
    pub out_per_s: f64,
    /// Received from it.
    pub in_per_s: f64,
}

impl State {
    /// A state reading `source`; with `net` and a run id, the dashboard also shows the
    /// run's swarm as the DHT announces it.
    pub fn new(source: Source, net: Option<(NetHandle, String)>) -> Arc<Self> {
        Arc::new(Self {
            registry: super::registry(Arc::clone(&source)),
            source,
            net: net.map_or_else(std::sync::OnceLock::new, std::sync::OnceLock::from),
            started: Instant::now(),
            history: Mutex::new(VecDeque::new()),
            swarm: Mutex::new(serde_json::Value::Null),
            events: Mutex::new(VecDeque::new()),
            link_rates: Mutex::new(Vec::new()),
        })
    }

    /// The dashboard also shows run `run`'s swarm as the DHT seen through `net`
    /// announces it (set once, before [`serve`]).
    pub fn set_net(&self, net: NetHandle, run: String) {
        let _ = self.net.set((net, run));
    }

    /// Notes an event for the dashboard (a join, a move, a ban...).
    pub fn event(&self, text: impl Into<String>) {
        {
            let mut e = self.events.lock();
            if e.len() >= EVENTS {
                e.pop_front();
            }
            e.push_back((self.started.elapsed().as_secs_f64(), text.into()));
        }
    }

    /// The metrics page.
    pub fn metrics(&self) -> String {
        render(&self.registry)
    }

    /// The `/api/status` document.
    pub fn status_json(&self) -> String {
        let snap = (self.source)();
        let swarm = self.swarm.lock().clone();
        let events: Vec<(f64, String)> = self.events.lock().iter().cloned().collect();
        let links = self.link_rates.lock().clone();
        serde_json::json!({ "self": snap, "swarm": swarm, "events": events, "link_rates": links })
            .to_string()
    }

    /// The `/api/history` document.
    pub fn history_json(&self) -> String {
        let h: Vec<Point> = self.history.lock().iter().cloned().collect();
        serde_json::to_string(&h).unwrap_or_else(|_| "[]".into())
    }

    fn sample(&self, last: &mut Option<(f64, Snapshot)>) {
        let now = self.started.elapsed().as_secs_f64();
        let s = (self.source)();
        let (done, wire) = totals(&s);
        if let Some((t, prev)) = last.as_ref().filter(|(t, _)| now > *t) {
            let dt = now - *t;
            let rates = s
                .links
                .iter()
                .map(|l| {
                    let before = prev.links.iter().find(|p| p.peer == l.peer);
                    let (s0, r0) = before.map_or((0, 0), |p| (p.sent, p.received));
                    LinkRate {
                        peer: l.peer.clone(),
                        out_per_s: l.sent.saturating_sub(s0) as f64 / dt,
                        in_per_s: l.received.saturating_sub(r0) as f64 / dt,
                    }
                })
                .collect();
            *self.link_rates.lock() = rates;
        }
        let (rate, wire_rate) = match last {
            Some((t, prev)) if now > *t => {
                let (d0, w0) = totals(prev);
                let dt = now - *t;
                (
                    done.saturating_sub(d0) as f64 / dt,
                    wire.saturating_sub(w0) as f64 / dt,
                )
            }
            _ => (0.0, 0.0),
        };
        let step = s
            .replica
            .as_ref()
            .map(|r| r.step)
            .or(s.trainer.as_ref().map(|t| t.step))
            .unwrap_or(0);
        let loss = s.trainer.as_ref().map(|t| t.loss).filter(|l| l.is_finite());
        let ratio = s
            .trainer
            .as_ref()
            .filter(|t| t.wire > 0)
            .map_or(0.0, |t| t.raw as f64 / t.wire as f64);
        {
            let mut h = self.history.lock();
            if h.len() >= HISTORY {
                h.pop_front();
            }
            let eval_loss = s
                .eval_loss
                .filter(|e| last.as_ref().and_then(|(_, p)| p.eval_loss) != Some(*e));
            h.push_back(Point {
                eval_loss,
                t: now,
                step,
                loss,
                samples_per_s: rate,
                wire_per_s: wire_rate,
                ratio,
            });
        }
        let before: Vec<String> = last
            .as_ref()
            .map(|(_, p)| super::banned(p).into_iter().map(|b| b.peer).collect())
            .unwrap_or_default();
        for b in super::banned(&s) {
            if !before.contains(&b.peer) {
                self.event(format!("banned {}: {}", b.peer, b.reason));
            }
        }
        *last = Some((now, s));
    }
}

/// (samples done, wire bytes) of a snapshot: the trainers' when they run, else the
/// replica's.
fn totals(s: &Snapshot) -> (u64, u64) {
    match (&s.trainer, &s.replica) {
        (Some(t), _) => (t.completed, t.wire),
        (None, Some(r)) => (
            r.counters.samples_accumulated,
            r.counters.stage_in + r.counters.stage_out,
        ),
        (None, None) => (0, 0),
    }
}

/// Which pages a server answers.
#[derive(Debug, Clone, Copy)]
pub struct Pages {
    /// `/metrics`.
    pub metrics: bool,
    /// `/`, `/api/status`, `/api/history`.
    pub dashboard: bool,
}

/// A running server.
pub struct Server {
    /// The address it listens on.
    pub addr: SocketAddr,
    /// The listener and the dashboard's refreshers; cancelled when the server is dropped.
    _tasks: tokio_util::sync::DropGuard,
}

/// Listens on `addr` and serves `pages` from `state` until the [`Server`] is dropped;
/// the dashboard's history and swarm view are refreshed in the background.
pub async fn serve(addr: SocketAddr, state: Arc<State>, pages: Pages) -> std::io::Result<Server> {
    let listener = TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let tasks = crate::tasks::Tasks::new();
    if pages.dashboard {
        let st = Arc::clone(&state);
        tasks.spawn(async move {
            let mut last = None;
            loop {
                st.sample(&mut last);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
    }
    if let (true, Some((net, run))) = (pages.dashboard, state.net.get().cloned()) {
        let st = Arc::clone(&state);
        tasks.spawn(async move {
            let mut seen: Vec<String> = Vec::new();
            loop {
                if let Ok(runs) = crate::stage::status::gather(&net, Some(&run)).await {
                    let now: Vec<String> = replicas(&runs);
                    if !seen.is_empty() || st.started.elapsed() > Duration::from_secs(5) {
                        for p in now.iter().filter(|p| !seen.contains(p)) {
                            st.event(format!("joined: {p}"));
                        }
                        for p in seen.iter().filter(|p| !now.contains(p)) {
                            st.event(format!("left or died: {p}"));
                        }
                    }
                    seen = now;
                    if let Ok(v) = serde_json::to_value(&runs) {
                        *st.swarm.lock() = v;
                    }
                }
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        });
    }
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    tasks.spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
                continue;
            };
            let st = Arc::clone(&state);
            tokio::spawn(async move {
                let _ = tokio::time::timeout(IO_TIMEOUT * 2, answer(stream, &st, pages)).await;
                drop(permit);
            });
        }
    });
    Ok(Server {
        addr,
        _tasks: tasks.cancel_on_drop(),
    })
}

/// "stage/peer" of every replica in a status view.
fn replicas(runs: &[crate::stage::status::RunView]) -> Vec<String> {
    let v = serde_json::to_value(runs).unwrap_or_default();
    let mut out = Vec::new();
    for r in v.as_array().into_iter().flatten() {
        for s in r["stages"].as_array().into_iter().flatten() {
            for a in s["replicas"].as_array().into_iter().flatten() {
                out.push(format!(
                    "stage {} replica {}",
                    s["stage"],
                    a["peer"].as_str().unwrap_or("?")
                ));
            }
        }
    }
    out
}

async fn answer(mut stream: TcpStream, st: &State, pages: Pages) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(IO_TIMEOUT, stream.read(&mut buf))
            .await
            .map_err(|_| std::io::Error::other("request timed out"))??;
        if n == 0 || head.len() + n > MAX_HEAD {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&head);
    let mut words = line.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, kind, body) = match (method, path) {
        ("GET", "/metrics") if pages.metrics => (
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            st.metrics(),
        ),
        ("GET", "/") if pages.dashboard => ("200 OK", "text/html; charset=utf-8", PAGE.to_string()),
        ("GET", "/api/status") if pages.dashboard => {
            ("200 OK", "application/json", st.status_json())
        }
        ("GET", "/api/history") if pages.dashboard => {
            ("200 OK", "application/json", st.history_json())
        }
        _ => ("404 Not Found", "text/plain", "not found\n".to_string()),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n",
        body.len()
    );
    tokio::time::timeout(IO_TIMEOUT, async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await
    })
    .await
    .map_err(|_| std::io::Error::other("answer timed out"))?
}
