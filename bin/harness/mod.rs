//! Starting `shoal` processes on this machine and reading what they report: the harness of
//! `shoal demo` and `shoal bench swarm`. A child runs with `--events -`, so its stdout is a
//! stream of JSON events ([`Event`]) and its human-readable lines go to its stderr (dropped,
//! or kept in `$SHOAL_DEMO_LOGS/NAME.err`). Nothing here reads printed text.
//!
//! - [`demo`]: `shoal demo`.
//! - [`bench_swarm`] and [`scenarios`]: `shoal bench swarm`; [`bench_large`]: its `large`
//!   scenario (averaging and state download of stages of real size).
//! - [`bench_converge`]: `shoal bench converge` (time to a target loss per way of stepping).
//! - [`bench_sim`]: `shoal bench sim` (hundreds of peers in this process, not children);
//!   [`sim_peers`]: the links and reachability its peers are given; [`sim_probe`]: what it
//!   reads of its process and the swarm besides the samples.

pub mod bench_compress;
pub mod bench_converge;
pub mod bench_large;
pub mod bench_sim;
pub mod bench_sim_row;
pub mod bench_swarm;
pub mod demo;
pub mod scenarios;
pub mod sim_peers;
pub mod sim_probe;

use shoal::dht::Manifest;
use shoal::net::{self, NetConfig, NetHandle};
use shoal::stage::registry;
use shoal::swarm::events::Event;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Why a harness could not run.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A process could not be started or failed.
    #[error("{0}")]
    Process(String),
    /// The swarm could not be read.
    #[error("{0}")]
    Swarm(String),
}

/// Events a child may report before the harness reads them; beyond this, new ones are
/// dropped (the periodic ones carry totals, so a later one replaces a lost one).
const EVENTS_QUEUED: usize = 4096;

/// A child process of this binary and the events it reports.
pub struct Proc {
    /// Its name in logs and errors.
    pub name: String,
    /// The process.
    pub child: Child,
    events: mpsc::Receiver<Event>,
}

impl Proc {
    /// Starts `exe args... --events -` in `dir`.
    pub fn spawn(
        exe: &Path,
        dir: &Path,
        name: &str,
        args: &[String],
    ) -> Result<Self, HarnessError> {
        let stderr = match std::env::var_os("SHOAL_DEMO_LOGS") {
            Some(d) => std::fs::File::create(Path::new(&d).join(format!("{name}.err")))
                .map(Stdio::from)
                .unwrap_or_else(|_| Stdio::null()),
            None => Stdio::null(),
        };
        let mut child = Command::new(exe)
            .args(args)
            .args(["--events", "-"])
            .current_dir(dir)
            .env("RAYON_NUM_THREADS", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .map_err(|e| HarnessError::Process(format!("cannot start {}: {e}", exe.display())))?;
        let (tx, rx) = mpsc::sync_channel(EVENTS_QUEUED);
        if let Some(out) = child.stdout.take() {
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    let Ok(event) = serde_json::from_str::<Event>(&line) else {
                        continue;
                    };
                    match tx.try_send(event) {
                        Ok(()) | Err(mpsc::TrySendError::Full(_)) => {}
                        Err(mpsc::TrySendError::Disconnected(_)) => break,
                    }
                }
            });
        }
        Ok(Self {
            name: name.to_string(),
            child,
            events: rx,
        })
    }

    /// The events reported since the last call, without waiting.
    pub fn drain(&mut self) -> Vec<Event> {
        self.events.try_iter().collect()
    }

    /// Waits up to `timeout` for an event that `pick` maps to a value; the events before
    /// it are consumed.
    pub fn wait_for<T>(
        &mut self,
        what: &str,
        timeout: Duration,
        mut pick: impl FnMut(&Event) -> Option<T>,
    ) -> Result<T, HarnessError> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            match self.events.recv_timeout(Duration::from_millis(100)) {
                Ok(e) => {
                    if let Some(v) = pick(&e) {
                        return Ok(v);
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if let Ok(Some(st)) = self.child.try_wait() {
                        return Err(HarnessError::Process(format!(
                            "{} exited ({st})",
                            self.name
                        )));
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(HarnessError::Process(format!(
                        "{} closed its output",
                        self.name
                    )))
                }
            }
        }
        Err(HarnessError::Process(format!(
            "{} did not report {what} within {timeout:?}",
            self.name
        )))
    }

    /// Waits until the peer reports that it is ready.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<(), HarnessError> {
        self.wait_for("ready", timeout, |e| {
            matches!(e, Event::Ready { .. }).then_some(())
        })
    }

    /// SIGTERM, then SIGKILL if it has not exited within 3 s.
    pub fn stop(&mut self) {
        self.stop_within(Duration::from_secs(3));
    }

    /// SIGKILL: what a crash looks like to the swarm.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether the process has exited.
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// Sends SIGTERM (Unix) without waiting.
    pub fn terminate(&mut self) {
        #[cfg(unix)]
        {
            let _ = Command::new("kill")
                .arg(self.child.id().to_string())
                .status();
        }
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`.
    pub fn stop_within(&mut self, grace: Duration) {
        #[cfg(unix)]
        {
            // SIGTERM first: a peer withdraws its announcements and exits cleanly.
            self.terminate();
            let deadline = Instant::now() + grace;
            while Instant::now() < deadline {
                if self.exited() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        self.kill();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill();
        }
    }
}

/// Starts the bootstrap peer (DHT only) of the run in `dir/run.toml`; returns it and the
/// loopback address it listens on.
pub fn spawn_bootstrap(exe: &Path, dir: &Path) -> Result<(Proc, String), HarnessError> {
    let mut boot = Proc::spawn(
        exe,
        dir,
        "bootstrap",
        &peer_args("run.toml", None, "none", "boot.key"),
    )?;
    let addr = boot.wait_for("its address", Duration::from_secs(20), |e| match e {
        Event::Listening { addr } if addr.starts_with("/ip4/127.0.0.1/tcp/") => Some(addr.clone()),
        _ => None,
    })?;
    Ok((boot, addr))
}

/// Stops processes all at once: SIGTERM to every one (each drains and writes its state),
/// then waits for each, SIGKILLing any still running after `grace`.
pub fn stop_all<'a>(procs: impl IntoIterator<Item = &'a mut Proc>, grace: Duration) {
    let mut procs: Vec<&mut Proc> = procs.into_iter().collect();
    for p in procs.iter_mut() {
        p.terminate();
    }
    for p in procs {
        p.stop_within(grace);
    }
}

/// Arguments of a `shoal peer` on loopback serving `stage` (`auto`, `none` or an index)
/// with no trainers and short-lived announcements (so a killed peer is forgotten fast).
pub fn peer_args(run: &str, boot: Option<&str>, stage: &str, key: &str) -> Vec<String> {
    let mut a: Vec<String> = [
        "peer",
        "--run",
        run,
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--identity",
        key,
        "--stage",
        stage,
        "--trainers",
        "0",
        "--announce-ttl",
        "6",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if let Some(b) = boot {
        a.push("--bootstrap".into());
        a.push(b.to_string());
    }
    a
}

/// A DHT client (no stage, not a DHT server) joined through `bootstrap`, to read and
/// probe a harness's swarm.
pub async fn client(bootstrap: &str) -> Result<NetHandle, HarnessError> {
    let swarm = |e: &dyn std::fmt::Display| HarnessError::Swarm(e.to_string());
    let mut cfg = NetConfig::new(libp2p::identity::Keypair::generate_ed25519(), Vec::new());
    cfg.dht_server = false;
    let net = net::start(cfg).map_err(|e| swarm(&e))?;
    let addr: libp2p::Multiaddr = bootstrap.parse().map_err(|e| swarm(&e))?;
    net.dial(addr).await.map_err(|e| swarm(&e))?;
    Ok(net)
}

/// Per stage, (peer, step, parameter hash) of every announced replica, and whether every
/// stage's replicas agree on step and hash.
pub async fn replica_hashes(
    net: &NetHandle,
    m: &Manifest,
) -> Result<(Vec<Vec<(String, u64, String)>>, bool), HarnessError> {
    let per_stage = registry::read_run(net, &m.id, m.config.stages.count)
        .await
        .map_err(|e| HarnessError::Swarm(e.to_string()))?;
    let hashes: Vec<Vec<(String, u64, String)>> = per_stage
        .iter()
        .map(|v| {
            v.iter()
                .map(|a| (a.peer.clone(), a.step, a.params_hash.clone()))
                .collect()
        })
        .collect();
    let identical = hashes
        .iter()
        .all(|v| v.windows(2).all(|w| w[0].1 == w[1].1 && w[0].2 == w[1].2));
    Ok((hashes, identical))
}

/// Arguments of a `shoal train` process of one loop on loopback, the `t`-th of a harness
/// (each reads its own data stream, `t × 1000`).
pub fn trainer_args(run: &str, boot: &str, t: usize) -> Vec<String> {
    [
        "train",
        "--run",
        run,
        "--bootstrap",
        boot,
        "--trainers",
        "1",
        "--data-index",
        &(t as u64 * 1000).to_string(),
    ]
    .map(String::from)
    .to_vec()
}
