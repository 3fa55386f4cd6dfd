//! Streams and reachability on 127.0.0.1: a burst of streams past what a lane holds is
//! answered by its overflow answer, none dropped; peers of another wire version are refused on both sides with
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

const BURST: libp2p::StreamProtocol = libp2p::StreamProtocol::new("/shoal/test/burst/1");

/// Opens `n` streams of [`BURST`] to `to` at once; what each read back before it closed.
async fn burst(from: &NetHandle, to: libp2p::PeerId, n: usize) -> Vec<Result<Vec<u8>, String>> {
    use futures::AsyncReadExt;
    let calls = (0..n).map(|_| async {
        let mut s = from
            .open_stream(to, BURST)
            .await
            .map_err(|e| e.to_string())?;
        let mut got = Vec::new();
        s.read_to_end(&mut got).await.map_err(|e| e.to_string())?;
        Ok(got)
    });
    futures::future::join_all(calls).await
}

#[tokio::test]
async fn streams_past_a_full_lane_get_its_overflow_answer_and_none_is_dropped() {
    use futures::{AsyncWriteExt, StreamExt};
    let server = node(MSG_VERSION);
    let a = addr(&server).await;
    let overflow: net::streams::Overflow = std::sync::Arc::new(|_, mut s| {
        Box::pin(async move {
            let _ = s.write_all(b"busy").await;
            let _ = s.close().await;
        })
    });
    let lane = net::streams::Lane {
        capacity: 4,
        per_connection: 2,
        overflow: Some(overflow),
    };
    let mut incoming = server.accept_with(BURST, lane).unwrap();
    let (c1, c2) = (node(MSG_VERSION), node(MSG_VERSION));
    let to = c1.dial(a.clone()).await.unwrap();
    c2.dial(a).await.unwrap();
    // Nothing takes streams from the lane yet: each connection may park 2 there, the rest
    // of its 20 are answered "busy" by the lane at once, concurrently negotiated.
    let (r1, r2) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(3), burst(&c1, to, 20)),
        tokio::time::timeout(Duration::from_secs(3), burst(&c2, to, 20)),
    );
    // The parked streams are still waiting for an answer, so both bursts time out; count
    // what the lane did instead.
    assert!(
        r1.is_err() && r2.is_err(),
        "parked streams cannot have been answered"
    );
    let counts = server.stream_counts(&BURST);
    assert_eq!(counts.accepted, 4, "{counts:?}");
    assert_eq!(counts.overflowed, 36, "{counts:?}");
    assert_eq!(counts.dropped, 0, "{counts:?}");
    // The server takes the parked streams (their callers gave up: answering may fail).
    for _ in 0..4 {
        let (_, mut s) = incoming.next().await.unwrap();
        let _ = s.write_all(b"ok").await;
    }
    // With the lane served, a new burst is answered in full, from the server or the lane.
    let server_task = tokio::spawn(async move {
        while let Some((_, mut s)) = incoming.next().await {
            let _ = s.write_all(b"ok").await;
            let _ = s.close().await;
        }
    });
    let got = burst(&c1, to, 64).await;
    let ok = got
        .iter()
        .filter(|r| r.as_deref() == Ok(b"ok".as_slice()))
        .count();
    let busy = got
        .iter()
        .filter(|r| r.as_deref() == Ok(b"busy".as_slice()))
        .count();
    assert_eq!(ok + busy, 64, "every stream heard back: {got:?}");
    assert_eq!(server.stream_counts(&BURST).dropped, 0);
    server_task.abort();
}

#[tokio::test]
async fn a_stream_to_an_unaccepted_protocol_fails_to_open_with_a_reason() {
    let server = node(MSG_VERSION);
    let a = addr(&server).await;
    let c = node(MSG_VERSION);
    let to = c.dial(a).await.unwrap();
    let e = c.open_stream(to, BURST).await.unwrap_err().to_string();
    assert!(e.contains("does not speak /shoal/test/burst/1"), "{e}");
}
