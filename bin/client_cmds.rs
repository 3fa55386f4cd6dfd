//! The short commands: `run new`, `swarm key`, `status`, `probe` and `doctor`.

use crate::args::{
    client_config, default_listen, require_bootstrap, DoctorArgs, ProbeArgs, StatusArgs,
};
use crate::peer_cmd::runtime;
use anyhow::{bail, Context, Result};
use shoal::dht::Manifest;
use shoal::net::{self, keys};
use shoal::stage::status;
use shoal::swarm::peer::RunSource;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

pub fn run_new(config: PathBuf, out: PathBuf, data: Option<PathBuf>) -> Result<ExitCode> {
    let m = match data {
        None => Manifest::load(&config)?,
        Some(d) => {
            let mut cfg = shoal::config::RunConfig::load(&config)?;
            crate::data_cmds::data_override(&mut cfg, &d)?;
            Manifest::from_config(&cfg)?
        }
    };
    shoal::model::checkpoint::write_atomic(&out, m.file_text().as_bytes())
        .with_context(|| format!("cannot write {}", out.display()))?;
    eprintln!(
        "wrote the manifest of run {} ({} stages) to {}",
        m.id,
        m.config.stages.count,
        out.display()
    );
    println!("{}", m.id);
    Ok(ExitCode::SUCCESS)
}

pub fn swarm_key(out: PathBuf) -> Result<ExitCode> {
    keys::write_swarm_key(&out, keys::new_swarm_key()?)?;
    eprintln!(
        "wrote a new swarm key to {}; give it to every peer of the private swarm (--swarm-key)",
        out.display()
    );
    Ok(ExitCode::SUCCESS)
}

pub fn status(a: StatusArgs) -> Result<ExitCode> {
    require_bootstrap(&a.net)?;
    if let Some(r) = &a.run {
        if !shoal::dht::is_run_id(r) {
            bail!("--run {r:?} is not a run id (32 hex digits, printed by `shoal run new`)");
        }
    }
    let (cfg, bootstrap) = client_config(&a.net)?;
    let tried: Vec<String> = bootstrap.iter().map(|b| b.to_string()).collect();
    let rt = runtime()?;
    rt.block_on(async move {
        let handle = net::start(cfg)?;
        shoal::swarm::peer::join(&handle, &bootstrap).await?;
        let mut runs = status::gather(&handle, a.run.as_deref()).await?;
        let _server = match a.serve {
            Some(addr) => Some(serve_dashboard(&handle, addr, a.run.as_deref(), &runs).await?),
            None => None,
        };
        if a.serve.is_none() && !a.watch {
            show(&a, &runs, &tried);
            handle.shutdown().await;
            return Ok(());
        }
        let stop = crate::peer_cmd::shutdown_signal();
        tokio::pin!(stop);
        loop {
            if a.watch {
                if std::io::IsTerminal::is_terminal(&std::io::stdout()) {
                    print!("\x1b[2J\x1b[H");
                }
                show(&a, &runs, &tried);
            }
            tokio::select! {
                _ = &mut stop => break,
                _ = tokio::time::sleep(Duration::from_secs(2)) => {}
            }
            if a.watch {
                runs = status::gather(&handle, a.run.as_deref()).await?;
            }
        }
        handle.shutdown().await;
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// Prints the status once: JSON, the table, or what to check when nothing is announced.
fn show(a: &StatusArgs, runs: &[status::RunView], tried: &[String]) {
    if a.json {
        println!("{}", status::to_json(runs));
    } else if runs.is_empty() {
        let which = a
            .run
            .as_deref()
            .map_or(String::new(), |r| format!(" of run {r}"));
        println!(
            "no serving peers{which} found through {}: the bootstrap peer answered, but no replica is announced in the DHT; peers announce within seconds of printing `ready` — check that they run (with this swarm's --swarm-key, if private){}",
            tried.join(", "),
            if which.is_empty() { "" } else { " and that the run id is right" }
        );
    } else {
        print!("{}", status::render(runs));
    }
}

/// `status --serve`: the dashboard of a watcher holding no stage (the swarm map and events;
/// no loss curve, which comes from trainers).
async fn serve_dashboard(
    net: &net::NetHandle,
    addr: std::net::SocketAddr,
    run: Option<&str>,
    runs: &[status::RunView],
) -> Result<shoal::observe::http::Server> {
    use shoal::observe::http::State;
    use shoal::observe::Snapshot;
    let run = match run {
        Some(r) => r.to_string(),
        None => runs
            .first()
            .map(|r| r.run.clone())
            .context("--serve: no run is announced yet; pass --run ID")?,
    };
    let (me, id, started) = (
        net.local_peer_id().to_string(),
        run.clone(),
        std::time::Instant::now(),
    );
    let source: shoal::observe::Source = std::sync::Arc::new(move || Snapshot {
        peer: me.clone(),
        run: id.clone(),
        seconds: started.elapsed().as_secs_f64(),
        ..Snapshot::default()
    });
    let state = State::new(source, Some((net.clone(), run)));
    crate::observe_cmd::listen(addr, &state, true, "--serve").await
}

/// The manifest of `--run`: its file, or fetched from the DHT by id.
pub async fn manifest_of(net: &net::NetHandle, source: RunSource) -> Result<Manifest> {
    Ok(match source {
        RunSource::Id(id) => {
            shoal::stage::registry::fetch_manifest(net, &id, Duration::from_secs(5)).await?
        }
        RunSource::File(p) => Manifest::load(&p)?,
    })
}

pub fn probe(a: ProbeArgs) -> Result<ExitCode> {
    require_bootstrap(&a.net)?;
    let source = RunSource::parse(&a.run);
    if let RunSource::File(p) = &source {
        Manifest::load(p)?;
    }
    let (cfg, bootstrap) = client_config(&a.net)?;
    let rt = runtime()?;
    let (m, report) = rt.block_on(async move {
        let handle = net::start(cfg)?;
        shoal::swarm::peer::join(&handle, &bootstrap).await?;
        let m = manifest_of(&handle, source).await?;
        let report = shoal::stage::probe::probe(&handle, &m, a.check).await?;
        handle.shutdown().await;
        Ok::<_, anyhow::Error>((m, report))
    })?;
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "probe of run {}: one microbatch of {} sequences (a probe: nothing is trained)",
        m.id, m.config.training.batch_size
    );
    println!("  stage  step  replica                                                rtt ms  fwd ms  bwd ms  sent KiB  recv KiB  codec");
    for s in &report.stages {
        let fwd = s.forward_ms.map_or("-".into(), |f| format!("{f:.1}"));
        println!(
            "  {:>5}  {:>4}  {:<52}  {:>6.1}  {:>6}  {:>6.1}  {:>8.1}  {:>8.1}  {:>4.1}x",
            s.stage,
            s.step,
            s.peer,
            s.rtt_ms,
            fwd,
            s.backward_ms,
            s.bytes_sent as f64 / 1024.0,
            s.bytes_received as f64 / 1024.0,
            s.codec_ratio
        );
    }
    let total: f64 = report
        .stages
        .iter()
        .map(|s| s.forward_ms.unwrap_or(0.0) + s.backward_ms)
        .sum();
    println!("loss {:.6} after {total:.1} ms of calls", report.loss);
    if let Some(l) = report.local_loss {
        let diff = (l - report.loss).abs();
        println!("local loss {l:.6} (difference {diff:.2e}; exact with f32 activations at step 0)");
    } else if a.check {
        println!(
            "check: every stage answered with finite values (no local comparison past step 0)"
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `shoal doctor --bootstrap ADDR`: what others see of this machine; exits 1 when no
/// bootstrap peer answered.
pub fn doctor(a: DoctorArgs) -> Result<ExitCode> {
    require_bootstrap(&a.net)?;
    let (mut cfg, bootstrap) = client_config(&a.net)?;
    cfg.listen = default_listen(&a.net)?;
    let rt = runtime()?;
    let report = rt.block_on(shoal::net::doctor::diagnose(
        cfg,
        &bootstrap,
        Duration::from_secs(a.wait),
    ))?;
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{report}");
    }
    Ok(if report.joined() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
