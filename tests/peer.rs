//! Real peers on 127.0.0.1 in one process: discovery, remote stages, private swarms,
//! relays and bad input. Tiny models; every peer runs real candle stages.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests and benches fail by panicking"
)]

use candle_core::{DType, Device, Tensor};
use futures::{AsyncReadExt, AsyncWriteExt};
use libp2p::{Multiaddr, PeerId};
use shoal::averaging::server::{AvgServer, Inbox};
use shoal::averaging::sync::{chunk_hash, root_hash, STATE_CHUNK};
use shoal::config::RunConfig;
use shoal::data::{Sampler, TokenSource};
use shoal::dht::Manifest;
use shoal::model::{Stage, Upstream};
use shoal::net::{self, keys, NetConfig, NetHandle};
use shoal::stage::client::{exchange, CallError, StageClient};
use shoal::stage::service::{Answer, Extension, Refusal, MAX_CALLER_LAG};
use shoal::stage::{registry, Lane, STAGE_PROTOCOL};
use shoal::swarm::peer::{Peer, PeerConfig, PeerError, RunSource, StageChoice};
use shoal::train::{stage_checkpoint, train_local, LocalOptions};
use shoal::wire::msg::{Call, ErrorKind, Op, Request, HASH_PAGE, MSG_VERSION};
use shoal::wire::{CodecSpec, Limits};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn loopback() -> Vec<Multiaddr> {
    vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()]
}

fn manifest_file(dir: &tempfile::TempDir, cfg: &RunConfig) -> (Manifest, PathBuf) {
    let m = Manifest::from_config(cfg).unwrap();
    let path = dir.path().join(format!("run-{}.toml", &m.id[..8]));
    std::fs::write(&path, m.file_text()).unwrap();
    (m, path)
}

fn peer_config(run: RunSource, bootstrap: Vec<Multiaddr>, stage: StageChoice) -> PeerConfig {
    let net = NetConfig::new(libp2p::identity::Keypair::generate_ed25519(), loopback());
    let mut cfg = PeerConfig::new(run, net, bootstrap, stage);
    cfg.bench_budget = Duration::from_millis(30);
    cfg
}

async fn start(cfg: PeerConfig) -> Result<Peer, PeerError> {
    Peer::start(cfg, |_| {}).await
}

/// A DHT client (not serving) joined through `boot`.
async fn client(boot: &Multiaddr, key: Option<libp2p::pnet::PreSharedKey>) -> NetHandle {
    let mut cfg = NetConfig::new(libp2p::identity::Keypair::generate_ed25519(), Vec::new());
    cfg.dht_server = false;
    cfg.swarm_key = key;
    let h = net::start(cfg).unwrap();
    h.dial(boot.clone()).await.unwrap();
    h
}

fn three_stage(codec: CodecSpec) -> RunConfig {
    let mut cfg = RunConfig::tiny();
    cfg.stages.count = 3;
    cfg.stages.cuts.clear();
    cfg.training.batch_size = 4;
    cfg.codecs.activations = codec.into();
    cfg.validate().unwrap();
    cfg
}

fn batch(cfg: &RunConfig) -> (Tensor, Tensor) {
    let src = TokenSource::open(cfg).unwrap();
    let b = Sampler::new(cfg.training.data_seed, 0).next_batch(
        &src,
        cfg.training.batch_size,
        cfg.model.seq_len,
    );
    let shape = (b.batch, b.seq_len);
    (
        Tensor::from_vec(b.inputs, shape, &Device::Cpu).unwrap(),
        Tensor::from_vec(b.targets, shape, &Device::Cpu).unwrap(),
    )
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0.0, |m, (x, y)| m.max((x - y).abs()))
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64) * (*y as f64))
        .sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

struct Pass {
    a1: Vec<f32>,
    a2: Vec<f32>,
    loss: f32,
    g2: Vec<f32>,
    g1: Vec<f32>,
}

fn local_pass(cfg: &RunConfig, x: &Tensor, y: &Tensor) -> Pass {
    let s: Vec<Stage> = (0..3)
        .map(|i| Stage::new(cfg, i, &Device::Cpu).unwrap())
        .collect();
    let a1 = s[0].forward(x).unwrap();
    let a2 = s[1].forward(&a1).unwrap();
    let b2 = s[2].backward(&a2, Upstream::Targets(y)).unwrap();
    let g2 = b2.grad_input.unwrap();
    let b1 = s[1].backward(&a1, Upstream::Grad(&g2)).unwrap();
    let g1 = b1.grad_input.unwrap();
    s[0].backward(x, Upstream::Grad(&g1)).unwrap();
    Pass {
        a1: flat(&a1),
        a2: flat(&a2),
        loss: b2.loss.unwrap(),
        g2: flat(&g2),
        g1: flat(&g1),
    }
}

async fn remote_pass(c: &StageClient, peers: &[PeerId], x: &Tensor, y: &Tensor) -> Pass {
    let a1 = c.forward(peers[0], 0, 0, 1, x).await.unwrap();
    let a2 = c.forward(peers[1], 1, 0, 1, &a1).await.unwrap();
    let b2 = c.backward(peers[2], 2, 0, 1, &a2, y).await.unwrap();
    let g2 = b2.grad_input.unwrap();
    let b1 = c.backward(peers[1], 1, 0, 1, &a1, &g2).await.unwrap();
    let g1 = b1.grad_input.unwrap();
    let b0 = c.backward(peers[0], 0, 0, 1, x, &g1).await.unwrap();
    assert!(b0.grad_input.is_none(), "stage 0 has no input gradient");
    Pass {
        a1: flat(&a1),
        a2: flat(&a2),
        loss: b2.loss.unwrap(),
        g2: flat(&g2),
        g1: flat(&g1),
    }
}

/// Starts one peer per stage of `cfg`, the first as bootstrap.
async fn pipeline(dir: &tempfile::TempDir, cfg: &RunConfig) -> (Manifest, Vec<Peer>) {
    let (m, path) = manifest_file(dir, cfg);
    let boot = start(peer_config(
        RunSource::File(path.clone()),
        vec![],
        StageChoice::Index(0),
    ))
    .await
    .unwrap();
    let addr = boot.addrs()[0].clone();
    let mut peers = vec![boot];
    for s in 1..cfg.stages.count {
        let p = start(peer_config(
            RunSource::Id(m.id.clone()),
            vec![addr.clone()],
            StageChoice::Index(s),
        ))
        .await
        .unwrap();
        peers.push(p);
    }
    (m, peers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_peers_find_every_stage_and_the_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = RunConfig::tiny();
    cfg.stages.count = 4;
    cfg.stages.cuts.clear();
    cfg.training.batch_size = 2;
    let (m, path) = manifest_file(&dir, &cfg);
    let t0 = Instant::now();
    let boot = start(peer_config(
        RunSource::File(path),
        vec![],
        StageChoice::Index(0),
    ))
    .await
    .unwrap();
    let addr = boot.addrs()[0].clone();
    let rest = futures::future::join_all((1..8).map(|i| {
        start(peer_config(
            RunSource::Id(m.id.clone()),
            vec![addr.clone()],
            StageChoice::Index(i % 4),
        ))
    }))
    .await;
    let mut peers = vec![boot];
    for p in rest {
        peers.push(p.unwrap());
    }
    let ids: std::collections::BTreeSet<String> = peers
        .iter()
        .map(|p| p.net().local_peer_id().to_string())
        .collect();
    assert_eq!(ids.len(), 8);
    // Every peer must see every announcement of every stage, and the manifest.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut pending: Vec<usize> = (0..8).collect();
    while !pending.is_empty() && Instant::now() < deadline {
        let mut still = Vec::new();
        for &i in &pending {
            let net = peers[i].net();
            let per_stage = registry::read_run(net, &m.id, 4).await.unwrap();
            let seen: std::collections::BTreeSet<String> =
                per_stage.iter().flatten().map(|a| a.peer.clone()).collect();
            let stages_ok = per_stage.iter().all(|s| s.len() == 2);
            let manifest_ok = registry::fetch_manifest(net, &m.id, Duration::ZERO)
                .await
                .map(|got| got == m)
                .unwrap_or(false);
            if !(seen == ids && stages_ok && manifest_ok) {
                still.push(i);
            }
        }
        pending = still;
        if !pending.is_empty() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    assert!(
        pending.is_empty(),
        "peers {pending:?} did not see all 8 announcements and the manifest within 10 s"
    );
    eprintln!(
        "8 peers started and saw each other in {:.2} s",
        t0.elapsed().as_secs_f64()
    );
    for p in peers {
        p.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_pipeline_equals_local_exactly_with_f32() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = three_stage(CodecSpec::F32);
    let (m, peers) = pipeline(&dir, &cfg).await;
    let c = client(&peers[0].addrs()[0], None).await;
    let ids: Vec<PeerId> = peers.iter().map(|p| p.net().local_peer_id()).collect();
    for p in &peers {
        c.add_addresses(p.net().local_peer_id(), p.addrs().to_vec())
            .await
            .unwrap();
    }
    let sc = StageClient::new(c.clone(), m.id.clone(), CodecSpec::F32);
    let (x, y) = batch(&cfg);
    let local = local_pass(&cfg, &x, &y);
    let remote = remote_pass(&sc, &ids, &x, &y).await;
    assert_eq!(local.a1, remote.a1);
    assert_eq!(local.a2, remote.a2);
    assert_eq!(local.loss, remote.loss);
    assert_eq!(local.g2, remote.g2);
    assert_eq!(local.g1, remote.g1);
    for p in &peers {
        let n = p
            .service()
            .unwrap()
            .counters()
            .samples_accumulated
            .load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(n, cfg.training.batch_size as u64, "stage {:?}", p.stage());
    }
    for p in peers {
        p.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_pipeline_with_int8_is_within_the_codec_bound() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = three_stage(CodecSpec::INT8);
    let (m, peers) = pipeline(&dir, &cfg).await;
    let c = client(&peers[0].addrs()[0], None).await;
    let ids: Vec<PeerId> = peers.iter().map(|p| p.net().local_peer_id()).collect();
    for p in &peers {
        c.add_addresses(p.net().local_peer_id(), p.addrs().to_vec())
            .await
            .unwrap();
    }
    let sc = StageClient::new(c.clone(), m.id.clone(), CodecSpec::INT8);
    let (x, y) = batch(&cfg);
    let local = local_pass(&cfg, &x, &y);
    let remote = remote_pass(&sc, &ids, &x, &y).await;
    // One int8 hop: each value is off by at most half a block scale, ≤ absmax/127 overall.
    let bound = max_abs(&local.a1) * (1.0 + 1.0 / 128.0) / 254.0;
    let d1 = max_diff(&local.a1, &remote.a1);
    assert!(d1 <= bound * 1.0001, "a1 off by {d1}, bound {bound}");
    assert_ne!(local.a1, remote.a1, "int8 should not be exact");
    // Later values went through several quantized hops: close, not exact.
    assert!(cosine(&local.a2, &remote.a2) > 0.999);
    assert!((local.loss - remote.loss).abs() / local.loss < 0.01);
    assert!(cosine(&local.g2, &remote.g2) > 0.99);
    assert!(cosine(&local.g1, &remote.g1) > 0.99);
    for p in peers {
        p.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swarm_key_keeps_outsiders_out_both_ways() {
    let key = keys::new_swarm_key().unwrap();
    let other_key = keys::new_swarm_key().unwrap();
    let node = |k: Option<libp2p::pnet::PreSharedKey>| {
        let mut cfg = NetConfig::new(libp2p::identity::Keypair::generate_ed25519(), loopback());
        cfg.swarm_key = k;
        net::start(cfg).unwrap()
    };
    let keyed = node(Some(key));
    let keyed2 = node(Some(key));
    let wrong = node(Some(other_key));
    let open = node(None);
    let addr = |h: NetHandle| async move {
        h.wait_listening(1, Duration::from_secs(5)).await.unwrap()[0].clone()
    };
    let keyed_addr = addr(keyed.clone()).await;
    let open_addr = addr(open.clone()).await;
    let timeout = Duration::from_secs(30);
    // Same key: connects.
    let r = tokio::time::timeout(timeout, keyed2.dial(keyed_addr.clone())).await;
    assert_eq!(r.unwrap().unwrap(), keyed.local_peer_id());
    // No key into a private swarm, a private peer into an open one, a wrong key: all fail.
    let (a, b, c) = tokio::join!(
        tokio::time::timeout(timeout, open.dial(keyed_addr.clone())),
        tokio::time::timeout(timeout, keyed.dial(open_addr)),
        tokio::time::timeout(timeout, wrong.dial(keyed_addr)),
    );
    assert!(
        a.unwrap().is_err(),
        "a keyless peer connected to a keyed one"
    );
    assert!(
        b.unwrap().is_err(),
        "a keyed peer connected to a keyless one"
    );
    assert!(c.unwrap().is_err(), "a peer with another key connected");
    for h in [&keyed, &keyed2, &wrong, &open] {
        let conns = h.connections().await.unwrap();
        for c in conns {
            let pair = [h.local_peer_id(), c.peer];
            assert!(
                pair.contains(&keyed.local_peer_id()) && pair.contains(&keyed2.local_peer_id()),
                "unexpected connection {pair:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_swarm_peer_serves_and_outsider_cannot_join() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = three_stage(CodecSpec::F32);
    let (m, path) = manifest_file(&dir, &cfg);
    let key = keys::new_swarm_key().unwrap();
    let mut bcfg = peer_config(RunSource::File(path.clone()), vec![], StageChoice::Index(0));
    bcfg.net.swarm_key = Some(key);
    let boot = start(bcfg).await.unwrap();
    let addr = boot.addrs()[0].clone();
    let mut icfg = peer_config(
        RunSource::Id(m.id.clone()),
        vec![addr.clone()],
        StageChoice::Auto,
    );
    icfg.net.swarm_key = Some(key);
    let insider = start(icfg).await.unwrap();
    // Stages 1 and 2 are both empty; the tie is broken by peer id.
    assert!(
        matches!(insider.stage(), Some(1 | 2)),
        "auto picks an empty stage, got {:?}",
        insider.stage()
    );
    let outsider = start(peer_config(
        RunSource::File(path),
        vec![addr],
        StageChoice::Auto,
    ))
    .await;
    assert!(matches!(outsider, Err(PeerError::Bootstrap(_))));
    insider.stop().await.unwrap();
    boot.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_behind_a_relay_serves_a_forward_call() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = three_stage(CodecSpec::INT8);
    let (m, path) = manifest_file(&dir, &cfg);
    let mut rcfg = peer_config(RunSource::File(path), vec![], StageChoice::Index(0));
    rcfg.net.relay_server = true;
    let relay = start(rcfg).await.unwrap();
    let raddr = relay.addrs()[0].clone();
    // The hidden peer listens only through the relay: no direct address at all.
    let circuit: Multiaddr = format!("{raddr}/p2p-circuit").parse().unwrap();
    let mut hcfg = peer_config(
        RunSource::Id(m.id.clone()),
        vec![raddr.clone()],
        StageChoice::Index(1),
    );
    hcfg.net.listen = vec![circuit];
    let hidden = start(hcfg).await.unwrap();
    let hid = hidden.net().local_peer_id();
    assert!(!hidden.addrs().is_empty());
    for a in hidden.addrs() {
        assert!(a.to_string().contains("/p2p-circuit"), "direct address {a}");
    }
    // A caller learns the hidden peer's address from its announcement, as a trainer would.
    let c = client(&raddr, None).await;
    let mut anns = Vec::new();
    for _ in 0..50 {
        anns = registry::read_stage(&c, &m.id, 1).await.unwrap();
        if !anns.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(anns.len(), 1);
    let addrs: Vec<Multiaddr> = anns[0].addrs.iter().map(|a| a.parse().unwrap()).collect();
    c.add_addresses(hid, addrs).await.unwrap();
    let sc = StageClient::new(c.clone(), m.id.clone(), CodecSpec::INT8);
    let act = Tensor::randn(0f32, 1.0, (2, 16, cfg.model.d_model), &Device::Cpu).unwrap();
    let out = sc.forward(hid, 1, 0, 7, &act).await.unwrap();
    assert_eq!(out.dims(), &[2, 16, cfg.model.d_model]);
    let conns = c.connections().await.unwrap();
    let to_hidden: Vec<_> = conns.iter().filter(|c| c.peer == hid).collect();
    assert!(!to_hidden.is_empty());
    assert!(to_hidden.iter().all(|c| c.relayed), "{to_hidden:?}");
    hidden.stop().await.unwrap();
    relay.stop().await.unwrap();
}

/// A peer serving stage `stage` of `cfg`'s run (its manifest written in `dir`), and a DHT
/// client joined through it.
async fn serving(
    dir: &tempfile::TempDir,
    cfg: &RunConfig,
    stage: usize,
) -> (Manifest, Peer, NetHandle) {
    let (m, path) = manifest_file(dir, cfg);
    let p = start(peer_config(
        RunSource::File(path),
        vec![],
        StageChoice::Index(stage),
    ))
    .await
    .unwrap();
    let c = client(&p.addrs()[0], None).await;
    (m, p, c)
}

/// Sends raw bytes on a stream of the protocol their request belongs to (the stage
/// protocol when they hold no request) and returns whatever comes back.
async fn raw(c: &NetHandle, peer: PeerId, bytes: &[u8]) -> Vec<u8> {
    let op = bytes
        .get(..4)
        .map(|l| u32::from_le_bytes([l[0], l[1], l[2], l[3]]) as usize)
        .and_then(|n| bytes.get(4..4 + n))
        .and_then(|h| shoal::wire::msg::decode_request(h).ok())
        .map(|r| r.op());
    let protocol = op.map_or(STAGE_PROTOCOL, |op| Lane::of(op).protocol());
    let mut s = c.open_stream(peer, protocol).await.unwrap();
    // A replica that refused early stops reading: the rest of a large write then waits on
    // a full window, so the write gives up after a while and the answer is read anyway.
    if let Ok(Ok(())) = tokio::time::timeout(Duration::from_secs(3), s.write_all(bytes)).await {
        let _ = s.close().await;
    }
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
    out
}

/// A plain forward of microbatch `mb`.
fn forward_call(mb: u64) -> Call {
    Call::Forward {
        mb,
        dry: false,
        push_to: None,
        pushed: false,
        sync: false,
    }
}

fn header_bytes(req: &Request) -> Vec<u8> {
    shoal::wire::msg::encode_header(req)
}

fn response_kind(bytes: &[u8]) -> Option<ErrorKind> {
    if bytes.len() < 4 {
        return None;
    }
    let n = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
    let r = shoal::wire::msg::decode_response(&bytes[4..4 + n]).ok()?;
    r.error.map(|e| e.kind)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_gets_an_error_and_the_peer_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = three_stage(CodecSpec::F32);
    let (m, p, c) = serving(&dir, &cfg, 1).await;
    let pid = p.net().local_peer_id();
    // Each sender of garbage is a new peer: three invalid requests ban their sender.
    let addr = p.addrs()[0].clone();
    let fresh = || client(&addr, None);
    let sc = StageClient::new(c.clone(), m.id.clone(), CodecSpec::F32);
    let d = cfg.model.d_model;
    let good = Tensor::randn(0f32, 1.0, (2, 8, d), &Device::Cpu).unwrap();
    let req = |tensors: u8| Request {
        v: MSG_VERSION,
        run: m.id.clone(),
        stage: 1,
        step: 0,
        tensors,
        call: forward_call(1),
    };
    let check_alive = || async {
        let out = sc
            .forward(pid, 1, 0, 2, &good)
            .await
            .expect("a good request after garbage");
        assert_eq!(out.dims(), &[2, 8, d]);
    };
    check_alive().await;

    // 1. A truncated frame: the header promises 1000 bytes, 10 arrive, the stream closes.
    let mut bytes = header_bytes(&req(1));
    bytes.extend_from_slice(&1000u64.to_le_bytes());
    bytes.extend_from_slice(&[7u8; 10]);
    let dropped = |p: &Peer| {
        p.service()
            .unwrap()
            .counters()
            .dropped
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let before = dropped(&p);
    let back = raw(&fresh().await, pid, &bytes).await;
    // Nobody is left to answer a stream that ended mid-frame: it is dropped and counted.
    assert!(back.is_empty(), "{back:?}");
    assert_eq!(dropped(&p), before + 1);
    check_alive().await;

    // 2. A frame over the size limit: refused before anything is allocated, typed error.
    let mut bytes = header_bytes(&req(1));
    bytes.extend_from_slice(&(1u64 << 40).to_le_bytes());
    let back = raw(&fresh().await, pid, &bytes).await;
    assert_eq!(response_kind(&back), Some(ErrorKind::TooLarge));
    check_alive().await;
    // The client refuses to send one too, with its own typed error.
    let small = StageClient::new(c.clone(), m.id.clone(), CodecSpec::F32).with_limits(Limits {
        max_elements: 16,
        max_bytes: 64,
    });
    let e = small.forward(pid, 1, 0, 3, &good).await.unwrap_err();
    assert!(matches!(e, CallError::Io(_)), "{e}");

    // 3. A well-formed frame of the wrong shape and dtype.
    let wrong = Tensor::zeros((2, 8, d + 1), DType::F32, &Device::Cpu).unwrap();
    let bad = || async { StageClient::new(fresh().await, m.id.clone(), CodecSpec::F32) };
    let e = bad().await.forward(pid, 1, 0, 4, &wrong).await.unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::BadTensor), "{e}");
    let ids = Tensor::zeros((2, 8), DType::U32, &Device::Cpu).unwrap();
    let e = bad().await.forward(pid, 1, 0, 4, &ids).await.unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::BadTensor), "{e}");
    check_alive().await;

    // 4. Junk. Shorter than a length prefix: nothing to answer.
    assert!(raw(&fresh().await, pid, &[1, 2, 3]).await.is_empty());
    // A header length over the limit, then random bytes: refused as a bad request.
    let mut rng = shoal::rng::Rng::new(5);
    for len in [0usize, 100, 5000] {
        let mut junk = u32::MAX.to_le_bytes().to_vec();
        junk.extend((0..len).map(|_| rng.next_u64() as u8));
        let back = raw(&fresh().await, pid, &junk).await;
        assert_eq!(response_kind(&back), Some(ErrorKind::BadRequest), "{len}");
    }
    // A header of the right length that is not a header: a bad request too.
    let mut junk = 100u32.to_le_bytes().to_vec();
    junk.extend((0..100).map(|_| rng.next_u64() as u8));
    let back = raw(&fresh().await, pid, &junk).await;
    assert_eq!(response_kind(&back), Some(ErrorKind::BadRequest));
    check_alive().await;

    // 5. NaN input, the wrong run, the wrong stage, the wrong tensor count.
    let nan = (good.clone() * f64::NAN).unwrap();
    let e = bad().await.forward(pid, 1, 0, 5, &nan).await.unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::NonFinite), "{e}");
    let other = StageClient::new(fresh().await, "0".repeat(32), CodecSpec::F32);
    let e = other.forward(pid, 1, 0, 5, &good).await.unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::UnknownRun), "{e}");
    let e = sc.forward(pid, 2, 0, 5, &good).await.unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::WrongStage), "{e}");
    let h = fresh().await;
    let s = h.open_stream(pid, STAGE_PROTOCOL).await.unwrap();
    let r = exchange(s, &req(0), &[], &Limits::default()).await.unwrap();
    assert_eq!(r.0.error.map(|e| e.kind), Some(ErrorKind::BadRequest));
    check_alive().await;

    // 6. Checked before anything is read: a request of another run announcing a 100 MiB
    //    frame, a frame of 100 MiB (under the old global cap, far over this run's largest
    //    tensor), and a frame header of the wrong shape, none followed by a payload, are
    //    answered at once with their reason (a reader that waited for the payload would see
    //    the stream end and answer nothing).
    let mut stranger = req(1);
    stranger.run = "f".repeat(32);
    let mut bytes = header_bytes(&stranger);
    bytes.extend_from_slice(&(100u64 << 20).to_le_bytes());
    assert_eq!(
        response_kind(&raw(&fresh().await, pid, &bytes).await),
        Some(ErrorKind::UnknownRun)
    );
    let mut bytes = header_bytes(&req(1));
    bytes.extend_from_slice(&(100u64 << 20).to_le_bytes());
    assert_eq!(
        response_kind(&raw(&fresh().await, pid, &bytes).await),
        Some(ErrorKind::TooLarge)
    );
    let mut frame = Vec::new();
    shoal::wire::encode_f32(
        &[2, 8, d + 1],
        &vec![0.0; 16 * (d + 1)],
        &CodecSpec::F32,
        &mut frame,
    )
    .unwrap();
    let hlen = shoal::wire::header_len(&frame).unwrap();
    let mut bytes = header_bytes(&req(1));
    bytes.extend_from_slice(&(frame.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&frame[..hlen]);
    assert_eq!(
        response_kind(&raw(&fresh().await, pid, &bytes).await),
        Some(ErrorKind::BadTensor)
    );
    check_alive().await;

    let refused = p
        .service()
        .unwrap()
        .counters()
        .refused
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(refused >= 9, "refused {refused}");
    // 7. Repeated invalid requests ban their sender (`banned`, even for a good request),
    //    not anyone else.
    let pest = bad().await;
    for _ in 0..3 {
        let e = pest.forward(pid, 1, 0, 6, &wrong).await.unwrap_err();
        assert_eq!(e.kind(), Some(ErrorKind::BadTensor), "{e}");
    }
    let e = pest.forward(pid, 1, 0, 6, &good).await.unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::Banned), "{e}");
    check_alive().await;
    p.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_kind_refuses_bad_input_and_a_slow_sender_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = three_stage(CodecSpec::F32);
    let (m, path) = manifest_file(&dir, &cfg);
    let mut pc = peer_config(RunSource::File(path), vec![], StageChoice::Index(1));
    pc.service.read_timeout = Duration::from_secs(2);
    let p = start(pc).await.unwrap();
    let pid = p.net().local_peer_id();
    let addr = p.addrs()[0].clone();
    let c = client(&addr, None).await;
    let sc = StageClient::new(c.clone(), m.id.clone(), CodecSpec::F32);
    let d = cfg.model.d_model;
    let good = Tensor::randn(0f32, 1.0, (2, 8, d), &Device::Cpu).unwrap();
    let alive = || async {
        let out = sc
            .forward(pid, 1, 0, 2, &good)
            .await
            .expect("a good call after bad input");
        assert_eq!(out.dims(), &[2, 8, d]);
    };
    let frame = |shape: &[usize]| {
        let n: usize = shape.iter().product();
        let mut f = Vec::new();
        shoal::wire::encode_f32(shape, &vec![0.5; n], &CodecSpec::F32, &mut f).unwrap();
        f
    };
    let req = |op: Op, tensors: u8| Request {
        v: MSG_VERSION,
        run: m.id.clone(),
        stage: 1,
        step: 0,
        tensors,
        call: match op {
            Op::Forward => forward_call(9),
            Op::Backward => Call::Backward {
                mb: 9,
                dry: false,
                pushed: false,
                sync: false,
            },
            Op::Avg => Call::Avg {
                avg: shoal::wire::msg::AvgMsg::Part {
                    step: 0,
                    attempt: 1,
                    count: 1,
                    chunk: 0,
                },
            },
            Op::StateChunk => Call::StateChunk {
                chunk: shoal::wire::msg::ChunkReq { step: 0, index: 0 },
            },
            _ => Call::Info {},
        },
    };
    let message = |r: &Request, frames: &[Vec<u8>]| {
        let mut out = shoal::wire::msg::encode_header(r);
        for f in frames {
            out.extend_from_slice(&(f.len() as u64).to_le_bytes());
            out.extend_from_slice(f);
        }
        out
    };
    let mut rng = shoal::rng::Rng::new(11);
    let random: Vec<u8> = (0..300).map(|_| rng.next_u64() as u8).collect();
    let hidden = frame(&[2, 8, d]);
    let cases: Vec<(&str, Vec<u8>, ErrorKind)> = vec![
        (
            "backward, one tensor",
            message(&req(Op::Backward, 1), std::slice::from_ref(&hidden)),
            ErrorKind::BadRequest,
        ),
        (
            "backward, wrong width",
            message(
                &req(Op::Backward, 2),
                &[hidden.clone(), frame(&[2, 8, d + 1])],
            ),
            ErrorKind::BadTensor,
        ),
        (
            "backward, random bytes",
            message(&req(Op::Backward, 2), &[hidden.clone(), random.clone()]),
            ErrorKind::BadTensor,
        ),
        (
            "backward, wrong run",
            message(
                &Request {
                    run: "e".repeat(32),
                    ..req(Op::Backward, 2)
                },
                &[hidden.clone(), hidden.clone()],
            ),
            ErrorKind::UnknownRun,
        ),
        (
            "avg, rank-3 part",
            message(&req(Op::Avg, 1), std::slice::from_ref(&hidden)),
            ErrorKind::BadTensor,
        ),
        (
            "avg, two tensors",
            message(&req(Op::Avg, 2), &[frame(&[4]), frame(&[4])]),
            ErrorKind::BadRequest,
        ),
        (
            "avg, oversized part",
            message(&req(Op::Avg, 1), &[frame(&[300_000])]),
            ErrorKind::TooLarge,
        ),
        (
            "state chunk, a tensor",
            message(&req(Op::StateChunk, 1), &[frame(&[4])]),
            ErrorKind::BadRequest,
        ),
        (
            "info, random frame",
            message(&req(Op::Info, 1), std::slice::from_ref(&random)),
            ErrorKind::BadRequest,
        ),
        (
            "forward, truncated",
            {
                let mut b = message(&req(Op::Forward, 1), std::slice::from_ref(&hidden));
                b.truncate(b.len() - 100);
                b
            },
            ErrorKind::Internal,
        ),
    ];
    for (what, bytes, kind) in cases {
        // A new sender each time: three invalid requests would ban one.
        let h = client(&addr, None).await;
        let back = raw(&h, pid, &bytes).await;
        if kind == ErrorKind::Internal {
            // Truncated mid-frame: nobody is left to answer.
            assert!(back.is_empty(), "{what}: {back:?}");
        } else {
            assert_eq!(response_kind(&back), Some(kind), "{what}");
        }
        alive().await;
    }
    // One byte a second: dropped at the read timeout (2 s here), unanswered, counted.
    let dropped = || {
        p.service()
            .unwrap()
            .counters()
            .dropped
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let before = dropped();
    let h = client(&addr, None).await;
    let mut st = h.open_stream(pid, STAGE_PROTOCOL).await.unwrap();
    let bytes = message(&req(Op::Forward, 1), std::slice::from_ref(&hidden));
    let t0 = Instant::now();
    let mut i = 0;
    while t0.elapsed() < Duration::from_secs(5) && i < bytes.len() {
        if st.write_all(&bytes[i..i + 1]).await.is_err() || st.flush().await.is_err() {
            break;
        }
        i += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), st.read_to_end(&mut out)).await;
    assert!(out.is_empty(), "a slow sender was answered: {out:?}");
    assert!(dropped() > before, "the slow stream was not dropped");
    assert!(t0.elapsed() < Duration::from_secs(12));
    alive().await;
    p.stop().await.unwrap();
}

/// Polls `cond` every 20 ms until it holds; fails with `what` after 20 s.
async fn wait_until(cond: impl Fn() -> bool, what: impl Fn() -> String) {
    let t0 = std::time::Instant::now();
    while !cond() {
        assert!(t0.elapsed() < Duration::from_secs(20), "{}", what());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_over_its_byte_budget_is_answered_overloaded_and_others_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = three_stage(CodecSpec::F32);
    let (m, path) = manifest_file(&dir, &cfg);
    let d = cfg.model.d_model;
    let hidden = {
        let mut f = Vec::new();
        let n = 2 * 8 * d;
        shoal::wire::encode_f32(&[2, 8, d], &vec![0.5; n], &CodecSpec::F32, &mut f).unwrap();
        f
    };
    let mut pc = peer_config(RunSource::File(path), vec![], StageChoice::Index(1));
    // Room for two forward frames per caller, not three.
    pc.service.max_bytes_per_peer = Some(hidden.len() as u64 * 5 / 2);
    let p = start(pc).await.unwrap();
    let pid = p.net().local_peer_id();
    let addr = p.addrs()[0].clone();
    let greedy = client(&addr, None).await;
    let request = Request {
        v: MSG_VERSION,
        run: m.id.clone(),
        stage: 1,
        step: 0,
        tensors: 1,
        call: forward_call(1),
    };
    let mut bytes = shoal::wire::msg::encode_header(&request);
    bytes.extend_from_slice(&(hidden.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&hidden);
    // Two requests stall after their frame's header and half its payload: each holds a
    // whole frame of the caller's budget.
    let mut stalled = Vec::new();
    for _ in 0..2 {
        let mut st = greedy.open_stream(pid, STAGE_PROTOCOL).await.unwrap();
        st.write_all(&bytes[..bytes.len() - hidden.len() / 2])
            .await
            .unwrap();
        st.flush().await.unwrap();
        stalled.push(st);
    }
    // Wait until the replica has read both frames' headers (on a loaded machine that may
    // take longer than any fixed sleep).
    let svc = p.service().unwrap();
    let me = greedy.local_peer_id();
    wait_until(
        || svc.held_bytes(&me) >= 2 * hidden.len() as u64,
        || {
            format!(
                "the stalled requests were not read: {} bytes held",
                svc.held_bytes(&me)
            )
        },
    )
    .await;
    let x = Tensor::randn(0f32, 1.0, (2, 8, d), &Device::Cpu).unwrap();
    let sc = StageClient::new(greedy.clone(), m.id.clone(), CodecSpec::F32);
    let e = sc.forward(pid, 1, 0, 2, &x).await.unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::Overloaded), "{e}");
    // Another caller is served meanwhile, and no strike is counted against the greedy one.
    let other = client(&addr, None).await;
    let sc2 = StageClient::new(other, m.id.clone(), CodecSpec::F32);
    assert_eq!(
        sc2.forward(pid, 1, 0, 3, &x).await.unwrap().dims(),
        &[2, 8, d]
    );
    // Once its stalled requests are gone, the greedy caller is served again.
    drop(stalled);
    wait_until(
        || svc.held_bytes(&me) == 0,
        || "the stalled requests' bytes were not released".to_string(),
    )
    .await;
    assert_eq!(
        sc.forward(pid, 1, 0, 4, &x).await.unwrap().dims(),
        &[2, 8, d]
    );
    p.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_overloaded() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = three_stage(CodecSpec::F32);
    cfg.training.batch_size = 16;
    // No step during the burst: this test is about the queue, not about steps.
    cfg.training.target_batch_size = Some(1 << 20);
    let (m, path) = manifest_file(&dir, &cfg);
    let mut pc = peer_config(RunSource::File(path), vec![], StageChoice::Index(1));
    pc.service.queue_cap = 1;
    let p = start(pc).await.unwrap();
    let pid = p.net().local_peer_id();
    let c = client(&p.addrs()[0], None).await;
    let sc = StageClient::new(c.clone(), m.id.clone(), CodecSpec::F32);
    let x = Tensor::randn(
        0f32,
        1.0,
        (16, cfg.model.seq_len, cfg.model.d_model),
        &Device::Cpu,
    )
    .unwrap();
    let y = (x.clone() * 1e-3).unwrap();
    let results = futures::future::join_all((0..12).map(|i| {
        let sc = sc.clone();
        let (x, y) = (x.clone(), y.clone());
        async move { sc.backward(pid, 1, 0, i, &x, &y).await }
    }))
    .await;
    let ok = results.iter().filter(|r| r.is_ok()).count();
    let overloaded = results
        .iter()
        .filter(|r| matches!(r, Err(e) if e.kind() == Some(ErrorKind::Overloaded)))
        .count();
    // Every stream is answered: none sees a closed stream instead.
    assert!(ok >= 1, "nothing was served");
    assert!(overloaded >= 1, "no request was refused as overloaded");
    assert_eq!(ok + overloaded, 12, "{results:?}");
    assert_eq!(p.net().stream_counts(&STAGE_PROTOCOL).dropped, 0);
    p.stop().await.unwrap();
}

/// A forward asked to push its output on: the next stage's replica gets it and answers
/// the call that waited for it with only the targets sent, exactly as the plain way would.
/// A push that cannot be delivered leaves the output in the forward's answer instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_pushes_its_output_to_the_next_stage_or_answers_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = three_stage(CodecSpec::F32);
    // No step between the plain and the pushed pass: the same parameters for both.
    cfg.training.target_batch_size = Some(1 << 20);
    let (m, peers) = pipeline(&dir, &cfg).await;
    let ids: Vec<PeerId> = peers.iter().map(|p| p.net().local_peer_id()).collect();
    let c = client(&peers[0].addrs()[0], None).await;
    for p in &peers {
        c.add_addresses(p.net().local_peer_id(), p.addrs().to_vec())
            .await
            .unwrap();
    }
    let sc = StageClient::new(c.clone(), m.id.clone(), CodecSpec::F32);
    let (x, y) = batch(&cfg);
    let a1 = sc.forward(ids[0], 0, 0, 1, &x).await.unwrap();
    let a2 = sc.forward(ids[1], 1, 0, 1, &a1).await.unwrap();
    let plain = sc.backward(ids[2], 2, 0, 1, &a2, &y).await.unwrap();
    let (fwd, pushed) = tokio::join!(
        sc.forward_pushing(ids[1], 1, 0, 2, &a1, ids[2]),
        sc.backward_pushed(ids[2], 2, 0, 2, &y)
    );
    assert!(fwd.unwrap().0.is_none(), "the output went on, not back");
    let pushed = pushed.unwrap();
    assert_eq!(pushed.loss, plain.loss);
    let flat = |t: &Option<Tensor>| {
        t.as_ref()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    assert_eq!(flat(&pushed.grad_input), flat(&plain.grad_input));
    // Nobody to push to: the forward answers with its output.
    let nobody = libp2p::identity::Keypair::generate_ed25519()
        .public()
        .to_peer_id();
    let (out, _) = sc
        .forward_pushing(ids[1], 1, 0, 3, &a1, nobody)
        .await
        .unwrap();
    let back = out.expect("the output comes back when the push fails");
    assert_eq!(
        back.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        a2.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    );
    // Pushes go only to an announced replica of the next stage: not to stage 0's.
    let (out, _) = sc
        .forward_pushing(ids[1], 1, 0, 4, &a1, ids[0])
        .await
        .unwrap();
    assert!(out.is_some(), "no push to a replica of another stage");
    // And are taken only from an announced replica of the stage before: not from a client.
    let frame = shoal::stage::tensor::encode(&a2, &CodecSpec::F32).unwrap();
    let e = sc.push(ids[2], 2, 0, 5, &frame).await.unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::BadRequest), "{e}");
    // Nor at stage 0, which has no stage before.
    let e = sc.push(ids[0], 0, 0, 6, &frame).await.unwrap_err();
    assert!(e.kind().is_some(), "{e}");
    for p in peers {
        p.stop().await.unwrap();
    }
}

/// A caller's step is the one it last heard of. A trainer that never waits for steps hears
/// late and is often a step or two behind: it is served. One far behind (it lost track of
/// the run) is refused with `stale_step` and told the replica's step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_a_few_steps_behind_is_served_and_one_far_behind_is_told_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = three_stage(CodecSpec::F32);
    // A replica at step 12: stage 1 of a local run's checkpoint.
    let ckpt = dir.path().join("ckpt");
    let local = LocalOptions {
        steps: Some(12),
        eval_batches: 1,
        checkpoint: Some(ckpt.clone()),
        ..LocalOptions::default()
    };
    train_local(&cfg, &local, &mut |_| {}).unwrap();
    let (m, path) = manifest_file(&dir, &cfg);
    let mut pc = peer_config(RunSource::File(path), vec![], StageChoice::Index(1));
    pc.resume = Some(stage_checkpoint(&ckpt, 1));
    let p = start(pc).await.unwrap();
    let pid = p.net().local_peer_id();
    let c = client(&p.addrs()[0], None).await;
    let sc = StageClient::new(c.clone(), m.id.clone(), CodecSpec::F32);
    let x = Tensor::randn(0f32, 1.0, (2, 8, cfg.model.d_model), &Device::Cpu).unwrap();
    let info = sc.info(pid, 1).await.unwrap();
    assert_eq!(info.step, 12, "resumed at the checkpoint's step");
    for behind in [0, 1, 2, MAX_CALLER_LAG] {
        let out = sc.forward(pid, 1, 12 - behind, 2 + behind, &x).await;
        assert!(out.is_ok(), "{behind} steps behind: {out:?}");
    }
    match sc.forward(pid, 1, 12 - MAX_CALLER_LAG - 1, 20, &x).await {
        Err(CallError::Remote {
            kind: ErrorKind::StaleStep,
            step,
            ..
        }) => assert_eq!(step, 12),
        other => panic!("a caller far behind was not told the step: {other:?}"),
    }
    p.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_snapshot_chunks_download() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = three_stage(CodecSpec::F32);
    let (m, path) = manifest_file(&dir, &cfg);
    let p = start(peer_config(
        RunSource::File(path),
        vec![],
        StageChoice::Index(0),
    ))
    .await
    .unwrap();
    let pid = p.net().local_peer_id();
    let c = client(&p.addrs()[0], None).await;
    let sc = StageClient::new(c.clone(), m.id.clone(), CodecSpec::F32);
    let info = sc.state_info(pid, 0).await.unwrap();
    // Parameters and both AdamW moments, in chunks of STATE_CHUNK floats.
    let want = p.service().unwrap().numel() as u64 * 3;
    assert_eq!(info.len, want);
    assert_eq!(info.chunk, STATE_CHUNK as u64);
    assert_eq!(info.chunks as usize, (want as usize).div_ceil(STATE_CHUNK));
    // The chunk hashes come in pages; together they prove the root hash.
    let mut hashes = Vec::new();
    for page in 0..(info.chunks as usize).div_ceil(HASH_PAGE) {
        hashes.extend(
            sc.state_hashes(pid, 0, info.step, page as u32)
                .await
                .unwrap(),
        );
    }
    assert_eq!(hashes.len() as u64, info.chunks);
    assert_eq!(root_hash(&hashes), info.root);
    let mut total = 0;
    for (i, hash) in hashes.iter().enumerate() {
        let v = sc.state_chunk(pid, 0, info.step, i as u32).await.unwrap();
        assert_eq!(&chunk_hash(&v), hash, "chunk {i}");
        total += v.len() as u64;
    }
    assert_eq!(total, info.len);
    // The same chunks, all at once.
    let all = futures::future::join_all(
        (0..hashes.len()).map(|i| sc.state_chunk(pid, 0, info.step, i as u32)),
    )
    .await;
    for (i, v) in all.into_iter().enumerate() {
        let v = v.unwrap_or_else(|e| panic!("concurrent chunk {i}: {e}"));
        assert_eq!(chunk_hash(&v), hashes[i], "concurrent chunk {i}");
    }
    // A chunk or page past the end and a step not held are refused with their kinds.
    let n = hashes.len() as u32;
    let e = sc.state_hashes(pid, 0, info.step, n).await.unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::BadRequest), "{e}");
    let e = sc.state_chunk(pid, 0, info.step, n).await.unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::BadRequest), "{e}");
    let e = sc.state_chunk(pid, 0, info.step + 7, 0).await.unwrap_err();
    assert_eq!(e.kind(), Some(ErrorKind::StaleStep), "{e}");
    p.stop().await.unwrap();
}

/// A donor that serves every state chunk with one value changed (a well-formed frame with
/// the wrong contents), around the real averaging server.
struct Corrupting(AvgServer);

impl Extension for Corrupting {
    fn call(
        &self,
        peer: PeerId,
        req: Request,
        frames: Vec<Vec<u8>>,
    ) -> futures::future::BoxFuture<'_, Result<Answer, Refusal>> {
        Box::pin(async move {
            let op = req.op();
            let mut a = self.0.call(peer, req, frames).await?;
            if op == Op::StateChunk {
                for f in &mut a.frames {
                    let t = shoal::wire::decode(f, &Limits::default()).unwrap();
                    let shoal::wire::TensorData::F32(mut v) = t.data else {
                        panic!("state chunks are f32");
                    };
                    v[0] += 1.0;
                    f.clear();
                    shoal::wire::encode_f32(&t.shape, &v, &CodecSpec::F32, f).unwrap();
                }
            }
            Ok(a)
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_donor_serving_bad_chunks_is_dropped_and_the_state_checks_out() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = three_stage(CodecSpec::F32);
    cfg.averaging.state_chunk_floats = Some(1024);
    cfg.validate().unwrap();
    let (m, path) = manifest_file(&dir, &cfg);
    let quick = |mut c: PeerConfig| {
        c.announce_ttl = Duration::from_secs(3);
        c
    };
    let good = start(quick(peer_config(
        RunSource::File(path),
        vec![],
        StageChoice::Index(0),
    )))
    .await
    .unwrap();
    let boot = good.addrs()[0].clone();
    let bad = start(quick(peer_config(
        RunSource::Id(m.id.clone()),
        vec![boot.clone()],
        StageChoice::Index(0),
    )))
    .await
    .unwrap();
    let svc = bad.service().unwrap();
    let (tx, _rx) = tokio::sync::mpsc::channel(1);
    let inner = AvgServer::new(Inbox::new(tx, 1 << 20), svc.replica(), 1024);
    svc.attach(std::sync::Arc::new(Corrupting(inner)));
    // Both donors take the same step (a replica at the untouched init has nothing to
    // download), and announce it.
    for p in [&good, &bad] {
        let s = p.service().unwrap();
        {
            let r = s.replica();
            let mut g = r.lock().await;
            let zeros = vec![0f32; s.numel()];
            g.apply(0, &zeros.as_slice(), 0, 0).unwrap();
        }
        s.refresh_status().await;
    }
    let t0 = std::time::Instant::now();
    loop {
        let anns = shoal::stage::registry::read_stage(good.net(), &m.id, 0)
            .await
            .unwrap_or_default();
        if anns.len() == 2 && anns.iter().all(|a| a.step == 1) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "{anns:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let joiner = start(peer_config(
        RunSource::Id(m.id.clone()),
        vec![boot],
        StageChoice::Index(0),
    ))
    .await
    .unwrap();
    let r = joiner.synced().expect("the joiner downloads the state");
    assert_eq!(r.banned, vec![bad.net().local_peer_id()], "{r:?}");
    let chunks: usize = r.chunks_per_donor.iter().sum();
    let want = (svc.numel() * 3).div_ceil(1024);
    assert_eq!(chunks, want);
    assert_eq!(
        joiner.service().unwrap().params_hash(),
        good.service().unwrap().params_hash()
    );
    for p in [joiner, bad, good] {
        p.stop().await.unwrap();
    }
}

/// A donor that says its updates come in a billion chunks, and counts the calls it gets.
struct Inflating(std::sync::atomic::AtomicU32);

impl Extension for Inflating {
    fn call(
        &self,
        _: PeerId,
        req: Request,
        _: Vec<Vec<u8>>,
    ) -> futures::future::BoxFuture<'_, Result<Answer, Refusal>> {
        Box::pin(async move {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let step = req.call.chunk().map_or(0, |c| c.step);
            let mut frame = Vec::new();
            shoal::wire::encode_f32(&[4], &[0.0; 4], &CodecSpec::F32, &mut frame).unwrap();
            Ok(Answer {
                update: Some(shoal::wire::msg::UpdateInfo {
                    step,
                    total: 4,
                    lost: 0,
                    hash: "0".repeat(32),
                    chunks: 1 << 30,
                    start: 0,
                    end: 4,
                    members: Vec::new(),
                }),
                frames: vec![frame],
                ..Answer::default()
            })
        })
    }
}

/// Bad input on the state protocol: a donor's update chunk count sizes an allocation and a
/// loop of calls, so one that is not the stage's is refused after the first answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_donor_announcing_more_update_chunks_than_the_stage_has_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = three_stage(CodecSpec::F32);
    let (m, p, c) = serving(&dir, &cfg, 0).await;
    let donor = std::sync::Arc::new(Inflating(Default::default()));
    p.service().unwrap().attach(donor.clone());
    let pid = p.net().local_peer_id();
    let sc = StageClient::new(c.clone(), m.id.clone(), CodecSpec::F32);
    let stage = Stage::new(&cfg, 0, &Device::Cpu).unwrap();
    let replica = std::sync::Arc::new(tokio::sync::Mutex::new(
        shoal::stage::replica::Replica::new(&cfg, stage).unwrap(),
    ));
    let e = shoal::averaging::updates::catch_up(&sc, 0, c.local_peer_id(), &[pid], &replica)
        .await
        .unwrap_err();
    assert!(e.contains("chunks, not the"), "{e}");
    assert_eq!(
        donor.0.load(std::sync::atomic::Ordering::Relaxed),
        1,
        "no loop of calls"
    );
    assert_eq!(replica.lock().await.params_step(), 0);
    p.stop().await.unwrap();
}
