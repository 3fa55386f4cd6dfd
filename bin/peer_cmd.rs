//! The long-running commands: `shoal peer` (serve a stage) and `shoal train` through a
//! swarm (trainer loops only). Both report [`Event`]s: shown as lines to people, and with
//! `--events` also written as JSON lines for harnesses and monitors.

use crate::args::{trainer_config, EventsArgs, PeerArgs, SwarmTrainArgs};
use crate::observe_cmd;
use crate::progress::DownloadBar;
use anyhow::{Context, Result};
use shoal::averaging::AvgStats;
use shoal::observe::LinkView;
use shoal::stage::client::StageClient;
use shoal::stage::service::StageService;
use shoal::swarm::events::{peak_rss_bytes, Event};
use shoal::swarm::peer::{Peer, PeerConfig};
use shoal::trainer::report::Progress;
use shoal::trainer::TrainerStats;
use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where a process's events go: people read their `Display` (stdout, or stderr when the
/// JSON goes to stdout); `--events` also writes each as a JSON line.
///
/// The writing happens on a thread of its own, fed over a bounded channel: `emit` is
/// called from async tasks, which must not block on a slow terminal or file. The thread
/// ends, with everything written, when the last clone is dropped.
#[derive(Clone)]
pub struct Out {
    inner: Arc<OutInner>,
}

struct OutInner {
    tx: Option<std::sync::mpsc::SyncSender<Event>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl Drop for OutInner {
    fn drop(&mut self) {
        // Closing the channel ends the writer once it has written what was sent.
        self.tx.take();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

/// Events waiting for the writer thread before `emit` waits for room.
const EVENTS_QUEUED: usize = 4096;

/// What the writer thread owns.
struct Writer {
    json: Option<Box<dyn Write + Send>>,
    human_to_stderr: bool,
    /// The bar of the state download under way (`downloading` events).
    download: DownloadBar,
}

impl Writer {
    fn write(&mut self, e: Event) {
        if let Some(w) = &mut self.json {
            if let Ok(line) = serde_json::to_string(&e) {
                // A reader that went away must not stop the peer.
                let _ = writeln!(w, "{line}").and_then(|()| w.flush());
            }
        }
        if matches!(&e, Event::Reasons { failed, swapped } if failed.is_empty() && swapped.is_empty())
        {
            return;
        }
        if let Event::Downloading {
            stage,
            bytes,
            total,
        } = e
        {
            self.download.show(stage, bytes, total);
            return;
        }
        self.download.clear();
        if self.human_to_stderr {
            eprintln!("{e}");
        } else {
            println!("{e}");
        }
    }
}

impl Out {
    /// From `--events`.
    pub fn new(a: &EventsArgs) -> Result<Self> {
        let (json, human_to_stderr): (Option<Box<dyn Write + Send>>, bool) = match &a.events {
            None => (None, false),
            Some(p) if p.as_os_str() == "-" => (Some(Box::new(std::io::stdout())), true),
            Some(p) => {
                let f = std::fs::File::create(p)
                    .with_context(|| format!("cannot write the events to {}", p.display()))?;
                (Some(Box::new(std::io::LineWriter::new(f))), false)
            }
        };
        let mut w = Writer {
            json,
            human_to_stderr,
            download: if human_to_stderr {
                DownloadBar::plain_on_stderr()
            } else {
                DownloadBar::default()
            },
        };
        let (tx, rx) = std::sync::mpsc::sync_channel::<Event>(EVENTS_QUEUED);
        let writer = std::thread::Builder::new()
            .name("shoal-events".into())
            .spawn(move || {
                while let Ok(e) = rx.recv() {
                    w.write(e);
                }
            })
            .context("cannot start the events writer")?;
        Ok(Self {
            inner: Arc::new(OutInner {
                tx: Some(tx),
                writer: Some(writer),
            }),
        })
    }

    /// Reports `e` (written by the writer thread, in order).
    pub fn emit(&self, e: Event) {
        if let Some(tx) = &self.inner.tx {
            // Waits only while the writer is thousands of events behind.
            let _ = tx.send(e);
        }
    }
}

/// The async runtime of the network commands.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// Resolves on Ctrl-C or SIGTERM. Create it once and keep polling the same future: a new
/// one per loop pass would miss a signal that arrives between passes.
pub async fn shutdown_signal() {
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

/// The trainer loops of a peer, as their totals are read: their stats and their clients
/// (whose byte counters they share, so they can be read after the peer stopped).
#[derive(Clone)]
pub(crate) struct Trainers {
    pub(crate) stats: Vec<Arc<TrainerStats>>,
    clients: Vec<StageClient>,
}

impl Trainers {
    pub(crate) fn of(peer: &Peer) -> Self {
        Self {
            stats: peer
                .trainers()
                .iter()
                .map(|t| Arc::clone(t.stats()))
                .collect(),
            clients: peer.trainers().iter().map(|t| t.client().clone()).collect(),
        }
    }

    /// Frame bytes per replica the trainers called, summed over the loops.
    pub(crate) fn links(&self) -> Vec<LinkView> {
        let mut by_peer: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        for c in &self.clients {
            for (peer, sent, received) in c.counters().links() {
                let e = by_peer.entry(peer.to_string()).or_default();
                e.0 += sent;
                e.1 += received;
            }
        }
        by_peer
            .into_iter()
            .map(|(peer, (sent, received))| LinkView {
                peer,
                sent,
                received,
            })
            .collect()
    }

    /// Replicas per stage at the latest refresh, the most any loop saw.
    pub(crate) fn stage_replicas(&self) -> Vec<u64> {
        use std::sync::atomic::Ordering::Relaxed;
        let mut out: Vec<u64> = Vec::new();
        for s in &self.stats {
            out.resize(out.len().max(s.stage_replicas.len()), 0);
            for (o, n) in out.iter_mut().zip(&s.stage_replicas) {
                *o = (*o).max(n.load(Relaxed));
            }
        }
        out
    }

    pub(crate) fn progress(&self) -> Progress {
        use std::sync::atomic::Ordering::Relaxed;
        let (mut wire, mut raw) = (0, 0);
        for c in &self.clients {
            let c = c.counters();
            wire += c.sent.load(Relaxed) + c.received.load(Relaxed);
            raw += c.raw.load(Relaxed);
        }
        Progress::of(&self.stats, (wire, raw))
    }

    /// Failed samples and swapped calls by reason, over every loop.
    fn reasons(&self) -> Event {
        let (failed, swapped) = self.reason_maps();
        Event::Reasons { failed, swapped }
    }

    /// (failed samples, swapped calls) by reason, over every loop.
    pub(crate) fn reason_maps(&self) -> (BTreeMap<String, u64>, BTreeMap<String, u64>) {
        let mut failed = BTreeMap::new();
        let mut swapped = BTreeMap::new();
        for s in &self.stats {
            for (reason, n) in s.failures.lock().iter() {
                *failed.entry(reason.clone()).or_insert(0) += n;
            }
            for (reason, n) in s.swap_reasons.lock().iter() {
                *swapped.entry(reason.clone()).or_insert(0) += n;
            }
        }
        (failed, swapped)
    }
}

/// The replica's counters, its averager's and the process's peak memory, when serving.
fn counters(service: Option<Arc<StageService>>, avg: Option<Arc<AvgStats>>) -> Option<Event> {
    let s = service?;
    Some(Event::Counters {
        stage: s.stage(),
        counters: s.counters().snapshot(),
        averaging: avg.map(|a| a.snapshot()),
        peak_rss_bytes: peak_rss_bytes().unwrap_or(0),
    })
}

/// The span every log line of a `shoal peer` or `shoal train` process is inside:
/// `peer{id=…}` with the last characters of its peer id.
fn process_span(kind: &'static str, cfg: &PeerConfig) -> tracing::Span {
    let id = cfg.net.identity.public().to_peer_id().to_string();
    let short = &id[id.len().saturating_sub(8)..];
    tracing::info_span!("peer", kind, id = short)
}

/// `shoal peer`.
pub fn peer(a: PeerArgs) -> Result<ExitCode> {
    let out = Out::new(&a.events)?;
    let existed = a.identity.exists();
    let cfg = PeerConfig::try_from(&a)?;
    if !existed {
        out.emit(Event::IdentityCreated {
            path: a.identity.display().to_string(),
        });
    }
    let counters_every = (a.counters_ms > 0).then(|| Duration::from_millis(a.counters_ms));
    let span = process_span("peer", &cfg);
    let rt = runtime()?;
    rt.block_on(tracing::Instrument::instrument(
        async move {
            let (peer, trainers, _servers) = observe_cmd::start(cfg, &out, &a.observe).await?;
            out.emit(Event::Ready {
                peer: peer.net().local_peer_id().to_string(),
            });
            let report_every = Duration::from_secs(5);
            let tick = counters_every.map_or(report_every, |c| c.min(report_every));
            let started = Instant::now();
            let mut reported = Instant::now();
            let stop = shutdown_signal();
            tokio::pin!(stop);
            let mut failed = None;
            let mut counted = Instant::now();
            loop {
                tokio::select! {
                    _ = &mut stop => break,
                    // At least every second: a replica whose compute thread died is
                    // withdrawn within one.
                    _ = tokio::time::sleep(tick.min(Duration::from_secs(1))) => {}
                }
                failed = peer.failure();
                if failed.is_some() {
                    break;
                }
                if counters_every.is_some() && counted.elapsed() >= tick {
                    counted = Instant::now();
                    if let Some(e) = counters(peer.service(), peer.avg_stats()) {
                        out.emit(e);
                    }
                }
                if !trainers.stats.is_empty() && reported.elapsed() >= report_every {
                    reported = Instant::now();
                    out.emit(Event::Progress {
                        progress: trainers.progress(),
                        seconds: started.elapsed().as_secs_f64(),
                    });
                }
            }
            out.emit(Event::Stopping);
            let (service, avg) = (peer.service(), peer.avg_stats());
            peer.stop().await?;
            // The counters once more, with what stopping finished.
            if let Some(e) = counters(service, avg) {
                out.emit(e);
            }
            out.emit(Event::Stopped);
            match failed {
                Some(why) => Err(anyhow::anyhow!(why)),
                None => Ok::<_, anyhow::Error>(()),
            }
        },
        span,
    ))?;
    Ok(ExitCode::SUCCESS)
}

/// `shoal train --run ... --bootstrap ...`.
pub fn train_swarm(a: SwarmTrainArgs) -> Result<ExitCode> {
    let cfg = trainer_config(&a)?;
    let out = Out::new(&a.events)?;
    let report = Duration::from_millis(a.report_ms.max(50));
    let span = process_span("trainer", &cfg);
    let rt = runtime()?;
    rt.block_on(tracing::Instrument::instrument(
        async move {
            let (peer, trainers, _servers) = observe_cmd::start(cfg, &out, &a.observe).await?;
            let started = Instant::now();
            let stop = shutdown_signal();
            tokio::pin!(stop);
            loop {
                tokio::select! {
                    _ = &mut stop => break,
                    _ = tokio::time::sleep(report) => {}
                }
                out.emit(Event::Progress {
                    progress: trainers.progress(),
                    seconds: started.elapsed().as_secs_f64(),
                });
                if peer.trainers().iter().all(|t| t.is_finished()) {
                    break;
                }
            }
            // The counters are shared with the trainers: read after stopping, the final totals
            // count the microbatches that finished (or failed) while stopping.
            peer.stop().await?;
            out.emit(Event::Done {
                progress: trainers.progress(),
            });
            out.emit(trainers.reasons());
            Ok::<_, anyhow::Error>(())
        },
        span,
    ))?;
    Ok(ExitCode::SUCCESS)
}
