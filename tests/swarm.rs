//! Swarm training with real peers and real candle stages on 127.0.0.1.

use libp2p::Multiaddr;
use shoal::config::RunConfig;
use shoal::dht::Manifest;
use shoal::net::NetConfig;
use shoal::swarm::peer::{Peer, PeerConfig, RunSource, StageChoice};
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

fn loopback() -> Vec<Multiaddr> {
    vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()]
}

fn manifest_file(dir: &tempfile::TempDir, cfg: &RunConfig) -> (Manifest, PathBuf) {
    let m = Manifest::from_config(cfg).unwrap();
    let path = dir.path().join("run.toml");
    std::fs::write(&path, m.file_text()).unwrap();
    (m, path)
}

fn pc(run: RunSource, bootstrap: Vec<Multiaddr>, stage: StageChoice) -> PeerConfig {
    let net = NetConfig::new(libp2p::identity::Keypair::generate_ed25519(), loopback());
    let mut cfg = PeerConfig::new(run, net, bootstrap, stage);
    cfg.bench_budget = Duration::from_millis(30);
    cfg
}

async fn start(cfg: PeerConfig) -> Peer {
    Peer::start(cfg, &|l: String| eprintln!("{l}")).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smoke_three_stages_two_replicas_two_trainers() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = RunConfig::tiny();
    cfg.stages.count = 3;
    cfg.stages.cuts.clear();
    cfg.training.steps = 40;
    let (m, path) = manifest_file(&dir, &cfg);
    let boot = start(pc(RunSource::File(path), vec![], StageChoice::None)).await;
    let addr = boot.addrs()[0].clone();
    let mut peers = Vec::new();
    for i in 0..6 {
        peers.push(start(pc(RunSource::Id(m.id.clone()), vec![addr.clone()], StageChoice::Index(i % 3))).await);
    }
    let mut tc = pc(RunSource::Id(m.id.clone()), vec![addr.clone()], StageChoice::None);
    tc.net.listen.clear();
    tc.trainers = 2;
    let trainer = start(tc).await;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let s = trainer.trainers()[0].stats();
        eprintln!(
            "step {} fed {} completed {} failed {} swaps {} loss {:?}",
            s.step.load(Relaxed),
            s.fed.load(Relaxed),
            s.completed.load(Relaxed),
            s.failed.load(Relaxed),
            s.swaps.load(Relaxed),
            s.recent_loss(8)
        );
        for p in &peers {
            let st = p.service().unwrap().status();
            eprint!(" [{}:{} {} {}]", p.stage().unwrap(), st.params_step, st.accum_count, &st.params_hash[..6]);
        }
        eprintln!();
        if trainer.trainers().iter().all(|t| t.is_finished()) {
            break;
        }
    }
    for t in trainer.trainers() {
        eprintln!("failures {:?}", t.stats().failures.lock().unwrap());
    }
    for p in &peers {
        let a = p.averager().unwrap().stats();
        let c = p.service().unwrap().counters();
        eprintln!(
            "stage {:?}: compute {:.1} s served {} rounds {} failed {} resyncs {} err {:?}",
            p.stage(),
            c.compute_us.load(Relaxed) as f64 / 1e6,
            c.served.load(Relaxed),
            a.rounds.load(Relaxed),
            a.failed_attempts.load(Relaxed),
            a.resyncs.load(Relaxed),
            a.last_error.lock().unwrap()
        );
    }
}
