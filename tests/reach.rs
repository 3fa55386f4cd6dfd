//! Reachability on 127.0.0.1: peers of another wire version are refused on both sides with
//! a one-line reason; AutoNAT confirms a joiner's address; a
//! joiner whose bootstrap peer is refused gets that reason, not a decode error; a peer
//! that started apart from its bootstrap list's other peers joins them into one DHT.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests and benches fail by panicking"
)]

use libp2p::Multiaddr;
use shoal::config::RunConfig;
use shoal::dht::Manifest;
use shoal::net::reach::Reachability;
use shoal::net::{self, NetConfig, NetError, NetHandle};
use shoal::stage::registry;
use shoal::swarm::peer::{Peer, PeerConfig, PeerError, RunSource, StageChoice};
use shoal::wire::msg::MSG_VERSION;
use std::time::{Duration, Instant};

fn node(wire: u8) -> NetHandle {
    let mut cfg = NetConfig::new(
        libp2p::identity::Keypair::generate_ed25519(),
        vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()],
    );
    cfg.wire = wire;
    net::start(cfg).unwrap()
}

async fn addr(h: &NetHandle) -> Multiaddr {
    h.wait_listening(1, Duration::from_secs(5)).await.unwrap()[0].clone()
}

/// Polls `f` every 100 ms until it holds or `secs` pass; whether it held.
async fn eventually<F, Fut>(secs: u64, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_of_another_wire_version_is_refused_on_both_sides() {
    let old = node(MSG_VERSION);
    let new = node(MSG_VERSION + 1);
    let mut events = old.subscribe();
    let err = new.dial(addr(&old).await).await.unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, NetError::Refused { .. }), "{msg}");
    assert!(!msg.contains('\n'), "{msg}");
    assert!(
        msg.contains(&format!("shoal wire protocol {MSG_VERSION}"))
            && msg.contains(&format!("this peer speaks {}", MSG_VERSION + 1)),
        "the dialler says which versions: {msg}"
    );
    // The other side refused it too, with the versions the other way round.
    let (old_c, new_id) = (old.clone(), new.local_peer_id().to_string());
    let refused = eventually(5, || {
        let (h, id) = (old_c.clone(), new_id.clone());
        async move {
            h.status()
                .await
                .unwrap()
                .refused
                .iter()
                .any(|(p, why)| p == &id && why.contains("run the same shoal version"))
        }
    })
    .await;
    assert!(refused, "{:?}", old.status().await.unwrap().refused);
    let e = tokio::time::timeout(Duration::from_secs(5), events.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(&e, net::reach::NetEvent::Refused { peer, .. } if peer == &new_id),
        "{e:?}"
    );
    let closed = eventually(5, || {
        let h = old.clone();
        async move { h.connections().await.unwrap().is_empty() }
    })
    .await;
    assert!(closed, "the refused connection stays open");
    // Same version: connects.
    let same = node(MSG_VERSION);
    same.dial(addr(&old).await).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn autonat_confirms_a_joiner_that_others_can_dial() {
    let boot = node(MSG_VERSION);
    let joiner = node(MSG_VERSION);
    joiner.dial(addr(&boot).await).await.unwrap();
    let before = joiner.status().await.unwrap();
    assert_ne!(before.reachability, Reachability::Private);
    let j = joiner.clone();
    let public = eventually(20, || {
        let j = j.clone();
        async move { j.status().await.unwrap().reachability == Reachability::Public }
    })
    .await;
    let st = joiner.status().await.unwrap();
    assert!(public, "{st:?}");
    assert!(!st.external.is_empty() && !st.observed.is_empty(), "{st:?}");
    let mine = addr(&joiner).await.to_string();
    assert!(
        st.external.iter().any(|e| mine.starts_with(e.as_str())),
        "confirmed {:?}, listening on {mine}",
        st.external
    );
    // The bootstrap knows the joiner's agent.
    let b = boot.status().await.unwrap();
    let r = &b.remotes[&joiner.local_peer_id().to_string()];
    assert!(r.agent.starts_with("shoal/"), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joining_through_a_peer_of_another_version_fails_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manifest::from_config(&RunConfig::tiny()).unwrap();
    let path = dir.path().join("run.toml");
    std::fs::write(&path, m.file_text()).unwrap();
    let other = node(MSG_VERSION + 1);
    let boot = addr(&other).await;
    let net = NetConfig::new(
        libp2p::identity::Keypair::generate_ed25519(),
        vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()],
    );
    let cfg = PeerConfig::new(RunSource::File(path), net, vec![boot], StageChoice::None);
    let t = Instant::now();
    let err = Peer::start(cfg, |_| {}).await.unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, PeerError::Bootstrap(_)), "{msg}");
    assert!(msg.contains("run the same shoal version"), "{msg}");
    assert!(!msg.contains('\n'), "{msg}");
    // A refusal is an answer: no retries with backoff.
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

fn run_file(dir: &tempfile::TempDir, steps: u64) -> (Manifest, std::path::PathBuf) {
    let mut cfg = RunConfig::tiny();
    cfg.training.steps = steps;
    let m = Manifest::from_config(&cfg).unwrap();
    let path = dir.path().join(format!("run-{steps}.toml"));
    std::fs::write(&path, m.file_text()).unwrap();
    (m, path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_started_apart_joins_the_dht_through_its_bootstrap_list() {
    let dir = tempfile::tempdir().unwrap();
    let (run_a, path_a) = run_file(&dir, 100);
    let (_, path_b) = run_file(&dir, 200);
    let listen = |port: u16| -> Vec<Multiaddr> {
        vec![format!("/ip4/127.0.0.1/tcp/{port}").parse().unwrap()]
    };
    let key = || libp2p::identity::Keypair::generate_ed25519();
    // A: the first DHT, publishing run A.
    let a = Peer::start(
        PeerConfig::new(
            RunSource::File(path_a),
            NetConfig::new(key(), listen(0)),
            vec![],
            StageChoice::None,
        ),
        |_| {},
    )
    .await
    .unwrap();
    // B will start later at a known address, as a DHT of its own.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let b_key = key();
    let b_addr: Multiaddr = format!(
        "/ip4/127.0.0.1/tcp/{port}/p2p/{}",
        b_key.public().to_peer_id()
    )
    .parse()
    .unwrap();
    // C knows both; only A answers when it joins.
    let mut c_cfg = PeerConfig::new(
        RunSource::Id(run_a.id.clone()),
        NetConfig::new(key(), listen(0)),
        vec![a.addrs()[0].clone(), b_addr],
        StageChoice::None,
    );
    c_cfg.rejoin_every = Duration::from_millis(500);
    let c = Peer::start(c_cfg, |_| {}).await.unwrap();
    let b = Peer::start(
        PeerConfig::new(
            RunSource::File(path_b),
            NetConfig::new(b_key, listen(port)),
            vec![],
            StageChoice::None,
        ),
        |_| {},
    )
    .await
    .unwrap();
    // C re-dials B and refreshes the DHT through it: B now finds run A's manifest, which
    // only A and C hold.
    let found = registry::fetch_manifest(b.net(), &run_a.id, Duration::from_secs(20)).await;
    assert_eq!(found.map(|m| m.id).ok(), Some(run_a.id.clone()));
    let conns = c.net().connections().await.unwrap();
    assert!(conns.iter().any(|x| x.peer == b.net().local_peer_id()));
    for p in [a, b, c] {
        p.stop().await.unwrap();
    }
}
