//! Swarm training with real peers and real candle stages on 127.0.0.1: three stages × two
//! replicas and two trainers against the single-process run, churn, and joiners.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests and benches fail by panicking"
)]

use libp2p::Multiaddr;
use shoal::averaging::{Tamper, TamperKind};
use shoal::config::{AggregateKind, AveragingMode, RunConfig};
use shoal::dht::Manifest;
use shoal::net::{self, NetConfig};
use shoal::stage::probe;
use shoal::swarm::peer::{Peer, PeerConfig, RunSource, StageChoice};
use shoal::train::{train_local, LocalOptions};
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

/// The swarm tests share two cores; run them one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn loopback() -> Vec<Multiaddr> {
    vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()]
}

fn run_config(steps: u64) -> RunConfig {
    run_config_of(3, steps)
}

/// The tests' run in `stages` stages.
fn run_config_of(stages: usize, steps: u64) -> RunConfig {
    let mut cfg = RunConfig::tiny();
    cfg.stages.count = stages;
    cfg.stages.cuts.clear();
    cfg.training.steps = steps;
    cfg.training.target_batch_size = Some(32);
    cfg.optimizer.warmup_steps = 5;
    cfg.validate().unwrap();
    cfg
}

/// The tests' run in 2 stages with outer averaging every 4 steps.
fn outer_config(steps: u64) -> RunConfig {
    let mut cfg = run_config_of(2, steps);
    cfg.averaging.mode = Some(AveragingMode::Outer);
    cfg.averaging.outer_every = Some(4);
    cfg.validate().unwrap();
    cfg
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
    cfg.announce_ttl = Duration::from_secs(6);
    cfg
}

async fn start(cfg: PeerConfig) -> Peer {
    // `RUST_LOG` shows the peers' logs (captured per test, printed for a failing one).
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    Peer::start(cfg, |_| {}).await.unwrap()
}

struct Swarm {
    boot: Peer,
    addr: Multiaddr,
    peers: Vec<Peer>,
    m: Manifest,
}

async fn swarm(dir: &tempfile::TempDir, cfg: &RunConfig, replicas: usize) -> Swarm {
    swarm_with(dir, cfg, replicas, |_, _| {}).await
}

/// [`swarm`] with peer `i`'s config adjusted by `adjust(i, config)`.
async fn swarm_with(
    dir: &tempfile::TempDir,
    cfg: &RunConfig,
    replicas: usize,
    adjust: impl Fn(usize, &mut PeerConfig),
) -> Swarm {
    let (m, path) = manifest_file(dir, cfg);
    let boot = start(pc(RunSource::File(path), vec![], StageChoice::None)).await;
    let addr = boot.addrs()[0].clone();
    let mut peers = Vec::new();
    for i in 0..cfg.stages.count * replicas {
        let stage = StageChoice::Index(i % cfg.stages.count);
        let mut c = pc(RunSource::Id(m.id.clone()), vec![addr.clone()], stage);
        adjust(i, &mut c);
        peers.push(start(c).await);
    }
    Swarm {
        boot,
        addr,
        peers,
        m,
    }
}

/// Stops the trainers' peer `t`, then every replica, then the bootstrap peer.
async fn stop_all(t: Peer, s: Swarm) {
    t.stop().await.unwrap();
    for p in s.peers {
        p.stop().await.unwrap();
    }
    s.boot.stop().await.unwrap();
}

async fn trainers(s: &Swarm, n: usize, microbatches: u64) -> Peer {
    trainers_for(&s.m, &s.addr, n, microbatches).await
}

async fn trainers_for(m: &Manifest, addr: &Multiaddr, n: usize, microbatches: u64) -> Peer {
    trainers_with(m, addr, n, microbatches, |_| {}).await
}

/// [`trainers_for`] with the trainer config adjusted by `adjust`.
async fn trainers_with(
    m: &Manifest,
    addr: &Multiaddr,
    n: usize,
    microbatches: u64,
    adjust: impl FnOnce(&mut shoal::trainer::TrainerConfig),
) -> Peer {
    let mut tc = pc(
        RunSource::Id(m.id.clone()),
        vec![addr.clone()],
        StageChoice::None,
    );
    tc.net.listen.clear();
    tc.net.dht_server = false;
    tc.trainers = n;
    tc.trainer.max_microbatches = Some(microbatches);
    adjust(&mut tc.trainer);
    start(tc).await
}

async fn wait_trainers(t: &Peer, limit: Duration) {
    let t0 = Instant::now();
    while !t.trainers().iter().all(|t| t.is_finished()) {
        assert!(
            t0.elapsed() < limit,
            "trainers did not finish within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits (up to 20 s, else fails saying what it saw) until no round is pending: no stage
/// holds a full batch, and replicas of each stage agree on step and hash.
async fn settle(peers: &[&Peer]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut ok = true;
        let mut per_stage = std::collections::HashMap::new();
        for p in peers {
            let st = p.service().unwrap().status();
            *per_stage.entry(p.stage()).or_insert(0) += st.accum_count + st.frozen_count;
        }
        ok &= per_stage.values().all(|&n| n < 32);
        for a in peers {
            for b in peers {
                if a.stage() == b.stage() {
                    let (x, y) = (a.service().unwrap().status(), b.service().unwrap().status());
                    ok &= x.params_step == y.params_step && x.params_hash == y.params_hash;
                }
            }
        }
        if ok {
            return;
        }
        if Instant::now() >= deadline {
            let seen: Vec<String> = peers
                .iter()
                .map(|p| {
                    let st = p.service().unwrap().status();
                    format!(
                        "stage {:?} step {} hash {} pending {}",
                        p.stage(),
                        st.params_step,
                        st.params_hash,
                        st.accum_count + st.frozen_count
                    )
                })
                .collect();
            panic!(
                "replicas did not settle within 20 s (want: under a full batch pending per stage, equal step and hash per stage); saw {seen:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn histories_agree(peers: &[&Peer]) -> usize {
    let mut compared = 0;
    for a in peers {
        for b in peers {
            if a.stage() != b.stage() || a.net().local_peer_id() >= b.net().local_peer_id() {
                continue;
            }
            let ha = a
                .service()
                .unwrap()
                .replica()
                .blocking_lock()
                .history()
                .to_vec();
            let hb = b
                .service()
                .unwrap()
                .replica()
                .blocking_lock()
                .history()
                .to_vec();
            for (step, h) in &ha {
                for (s2, h2) in &hb {
                    if step == s2 {
                        assert_eq!(
                            h,
                            h2,
                            "stage {:?} replicas differ at step {step}",
                            a.stage()
                        );
                        compared += 1;
                    }
                }
            }
        }
    }
    compared
}

/// Per stage: Σ trainers' accepted backward samples == applied + pending + lost + dropped,
/// where `killed` is (stage, samples the killed replica held when it died): those are lost
/// whether or not the survivors managed to record them.
fn check_accounting(
    peers: &[&Peer],
    trainers: &Peer,
    stages: usize,
    killed: Option<(usize, u64)>,
) -> (u64, u64, u64) {
    let mut fed = 0;
    let mut done = 0;
    let mut failed = 0;
    let mut backward = vec![0u64; stages];
    for t in trainers.trainers() {
        let s = t.stats();
        fed += s.fed.load(Relaxed);
        done += s.completed.load(Relaxed);
        failed += s.failed.load(Relaxed);
        for (i, b) in s.stage_backward.iter().enumerate() {
            backward[i] += b.load(Relaxed);
        }
    }
    assert_eq!(fed, done + failed, "fed = completed + failed");
    for (stage, &b) in backward.iter().enumerate() {
        let reps: Vec<_> = peers
            .iter()
            .filter(|p| p.stage() == Some(stage))
            .map(|p| p.service().unwrap().status())
            .collect();
        let applied = reps.iter().map(|r| r.samples_applied).max().unwrap_or(0);
        let recorded = reps.iter().map(|r| r.samples_lost).max().unwrap_or(0);
        // Replicas that migrated away took their records with them.
        let gone: Vec<_> = peers
            .iter()
            .flat_map(|p| p.departed())
            .filter(|(s, _)| *s == stage)
            .map(|(_, st)| st)
            .collect();
        // (What a leaving replica still held it reported, and the stage counts it as lost.)
        let pending: u64 = reps.iter().map(|r| r.accum_count + r.frozen_count).sum();
        let dropped: u64 = reps.iter().chain(&gone).map(|r| r.samples_dropped).sum();
        match killed {
            Some((s, held)) if s == stage => {
                // What the killed replica held is lost, except microbatches whose answer
                // it never sent: the trainer repeated those elsewhere. So the samples not
                // applied, pending or dropped lie between 0 and what it held.
                let accounted = applied + pending + dropped;
                assert!(
                    accounted <= b && b <= accounted + held,
                    "stage {stage}: backward {b}, applied {applied} + pending {pending} + dropped {dropped}, killed replica held {held}"
                );
                assert!(recorded <= held, "stage {stage}: recorded loss {recorded} > {held} held");
            }
            _ => assert_eq!(
                b,
                applied + pending + recorded + dropped,
                "stage {stage}: backward {b} = applied {applied} + pending {pending} + lost {recorded} + dropped {dropped}"
            ),
        }
    }
    (fed, done, failed)
}

/// Kills a replica of `stage` without warning; returns the samples it held when it died
/// (lost: the trainers' backward calls already returned).
async fn kill_one_of(s: &mut Swarm, stage: usize) -> u64 {
    let pos = s
        .peers
        .iter()
        .position(|p| p.stage() == Some(stage))
        .unwrap();
    let victim = s.peers.remove(pos);
    let replica = victim.service().unwrap().replica();
    let guard = replica.lock().await;
    victim.kill().await;
    let held = guard.accum_count() + guard.frozen_count();
    drop(guard);
    held
}

/// The single-process run of `cfg`, evaluated on 8 held-out batches.
fn local_run(cfg: &RunConfig) -> shoal::train::LocalReport {
    let opts = LocalOptions {
        eval_batches: 8,
        ..LocalOptions::default()
    };
    train_local(cfg, &opts, &mut |_| {}).unwrap()
}

async fn eval(s: &Swarm) -> f64 {
    let mut c = NetConfig::new(libp2p::identity::Keypair::generate_ed25519(), Vec::new());
    c.dht_server = false;
    let h = net::start(c).unwrap();
    h.dial(s.addr.clone()).await.unwrap();
    let l = probe::evaluate(&h, &s.m, 8).await.unwrap();
    h.shutdown().await;
    l
}

/// `shoal probe --check` of the swarm, as the command runs it.
async fn probe_check(s: &Swarm) -> probe::ProbeReport {
    let mut c = NetConfig::new(libp2p::identity::Keypair::generate_ed25519(), Vec::new());
    c.dht_server = false;
    let h = net::start(c).unwrap();
    h.dial(s.addr.clone()).await.unwrap();
    let r = probe::probe(&h, &s.m, true).await.unwrap();
    h.shutdown().await;
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_stages_two_replicas_two_trainers_match_the_local_run() {
    let _g = SERIAL.lock().await;
    let steps = 40;
    let cfg = run_config(steps);
    // The single-process run over the same number of samples.
    let local = local_run(&cfg);
    let samples = steps * 32;
    let dir = tempfile::tempdir().unwrap();
    let s = swarm(&dir, &cfg, 2).await;
    let t0 = Instant::now();
    let t = trainers(&s, 2, samples / 16 / 2).await;
    // A probe of the training swarm passes and changes nothing: the accounting below
    // (every sample that went backward is applied, pending or lost, exactly) and the
    // match with the local run would both see its microbatch.
    while t.trainers()[0].stats().step.load(Relaxed) < 3 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let report = probe_check(&s).await;
    assert_eq!(report.stages.len(), 3);
    assert!(report.loss.is_finite() && report.local_loss.is_none());
    assert!(report.stages.iter().any(|st| st.step >= 3), "{report:?}");
    assert!(report
        .stages
        .iter()
        .all(|st| st.bytes_sent > 0 && st.codec_ratio > 0.0));
    wait_trainers(&t, Duration::from_secs(240)).await;
    let secs = t0.elapsed().as_secs_f64();
    let refs: Vec<&Peer> = s.peers.iter().collect();
    settle(&refs).await;
    let swarm_loss = eval(&s).await;
    let (fed, done, failed) = check_accounting(&refs, &t, 3, None);
    assert_eq!(fed, samples);
    assert_eq!(failed, 0);
    assert_eq!(done, samples);
    let compared = tokio::task::block_in_place(|| histories_agree(&refs));
    let steps_done: Vec<u64> = refs
        .iter()
        .map(|p| p.service().unwrap().status().params_step)
        .collect();
    eprintln!(
        "swarm: {samples} samples in {secs:.1} s, steps {steps_done:?}, eval {swarm_loss:.4}; local eval {:.4}; {compared} step hashes compared",
        local.eval_loss
    );
    assert!(compared >= 3 * 10, "too few steps compared: {compared}");
    let rel = (swarm_loss - local.eval_loss) / local.eval_loss;
    assert!(
        rel < 0.05,
        "swarm eval loss {swarm_loss:.4} is {:.1}% above the local {:.4}",
        100.0 * rel,
        local.eval_loss
    );
    stop_all(t, s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subspace_run_trains_in_the_swarm_as_it_does_locally() {
    let _g = SERIAL.lock().await;
    // Boundaries of 4 coefficients and the token id instead of 64 floats per token.
    let mut cfg = run_config_of(2, 30);
    cfg.model.family = shoal::config::Family::Llama;
    cfg.codecs.activations = "subspace:4".parse().unwrap();
    cfg.validate().unwrap();
    let local = local_run(&cfg);
    let samples = 30 * 32;
    let dir = tempfile::tempdir().unwrap();
    let s = swarm(&dir, &cfg, 2).await;
    let t = trainers(&s, 2, samples / 16 / 2).await;
    wait_trainers(&t, Duration::from_secs(240)).await;
    let refs: Vec<&Peer> = s.peers.iter().collect();
    settle(&refs).await;
    let swarm_loss = eval(&s).await;
    let (fed, done, failed) = check_accounting(&refs, &t, 2, None);
    assert_eq!((fed, done, failed), (samples, samples, 0));
    // Replicas of a stage hold the same parameters at every step.
    let compared = tokio::task::block_in_place(|| histories_agree(&refs));
    assert!(compared >= 2 * 10, "too few steps compared: {compared}");
    let rel = (swarm_loss - local.eval_loss) / local.eval_loss;
    eprintln!(
        "subspace swarm eval {swarm_loss:.4}, local {:.4}",
        local.eval_loss
    );
    assert!(
        rel.abs() < 0.05,
        "swarm {swarm_loss:.4} vs local {:.4}",
        local.eval_loss
    );
    stop_all(t, s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trainers_that_never_wait_keep_replicas_identical_and_gradients_one_step_stale() {
    let _g = SERIAL.lock().await;
    let cfg = run_config_of(2, 200);
    let dir = tempfile::tempdir().unwrap();
    let s = swarm(&dir, &cfg, 2).await;
    // Two trainers, two microbatches in flight each, never waiting for a step: forwards
    // and backwards straddle the rounds, which is where staleness comes from.
    let t = trainers_with(&s.m, &s.addr, 2, 24, |t| {
        t.sync_steps = false;
        t.concurrency = 2;
    })
    .await;
    wait_trainers(&t, Duration::from_secs(240)).await;
    let refs: Vec<&Peer> = s.peers.iter().collect();
    settle(&refs).await;
    let (fed, done, failed) = check_accounting(&refs, &t, 2, None);
    assert_eq!((fed, done, failed), (24 * 2 * 16, 24 * 2 * 16, 0));
    let compared = tokio::task::block_in_place(|| histories_agree(&refs));
    assert!(compared >= 2 * 4, "too few steps compared: {compared}");
    let mut stale = 0;
    for p in &refs {
        let st = p.service().unwrap().status();
        assert!(st.max_staleness <= 1, "staleness {}", st.max_staleness);
        stale += st.max_staleness;
    }
    // The overlap did happen: some gradient went into the step after its parameters'.
    assert!(stale > 0, "no gradient was computed during a round");
    // A replica's `info` answer names its live stage mate (with addresses to dial it): a
    // reader learns a stage from one replica, not only from DHT walks.
    let client = shoal::stage::client::StageClient::new(
        t.net().clone(),
        s.m.id.clone(),
        shoal::wire::CodecSpec::F32,
    );
    let (a, b) = (&s.peers[0], &s.peers[2]);
    assert_eq!((a.stage(), b.stage()), (Some(0), Some(0)));
    let info = client.info(a.net().local_peer_id(), 0).await.unwrap();
    let mate = b.net().local_peer_id().to_string();
    assert!(
        info.mates
            .iter()
            .any(|h| h.peer == mate && !h.addrs.is_empty()),
        "the info answer names {:?}, not its mate {mate}",
        info.mates
    );
    stop_all(t, s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_is_replaced_and_nothing_vanishes() {
    let _g = SERIAL.lock().await;
    let cfg = run_config(60);
    let dir = tempfile::tempdir().unwrap();
    let mut s = swarm(&dir, &cfg, 2).await;
    let t = trainers(&s, 2, 40).await;
    // Mid-run, kill one replica of the middle stage without warning.
    let t0 = Instant::now();
    while t
        .trainers()
        .iter()
        .map(|t| t.stats().completed.load(Relaxed))
        .sum::<u64>()
        < 400
    {
        assert!(t0.elapsed() < Duration::from_secs(120));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let held = kill_one_of(&mut s, 1).await;
    // A fresh peer picks the weakest stage (the victim no longer answers, so it does not
    // count) and downloads its state.
    let mut jc = pc(
        RunSource::Id(s.m.id.clone()),
        vec![s.addr.clone()],
        StageChoice::Auto,
    );
    jc.bench_budget = Duration::from_millis(30);
    let joiner = start(jc).await;
    // The weakest stage by announced throughput: stage 0 (two blocks and the embeddings)
    // or the weakened stage 1, whose dead replica's announcement may not have expired yet.
    eprintln!("churn: the joiner took stage {:?}", joiner.stage());
    assert!(
        joiner.synced().is_some(),
        "the joiner should download the stage's state"
    );
    wait_trainers(&t, Duration::from_secs(240)).await;
    s.peers.push(joiner);
    let refs: Vec<&Peer> = s.peers.iter().collect();
    settle(&refs).await;
    let (fed, done, failed) = check_accounting(&refs, &t, 3, Some((1, held)));
    eprintln!(
        "churn: replica killed holding {held} samples; fed {fed} completed {done} failed {failed}"
    );
    for tr in t.trainers() {
        for (reason, n) in tr.stats().failures.lock().iter() {
            eprintln!("  failed {n}: {reason}");
        }
    }
    let joined = s.peers.last().unwrap();
    let served = joined.service().unwrap().counters().served.load(Relaxed);
    assert!(served > 0, "the joiner served no request");
    let loss = eval(&s).await;
    eprintln!("churn: eval loss {loss:.4}");
    assert!(loss < 2.2, "training did not continue: eval loss {loss:.4}");
    stop_all(t, s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outer_run_loses_no_sample_to_a_replica_killed_mid_interval() {
    let _g = SERIAL.lock().await;
    let cfg = outer_config(24);
    let dir = tempfile::tempdir().unwrap();
    let mut s = swarm(&dir, &cfg, 2).await;
    // More microbatches than the run needs: the trainers stop at its last step (an outer
    // step, so the replicas end identical).
    let t = trainers(&s, 2, 400).await;
    let of_stage = |s: &Swarm, i: usize| -> Vec<shoal::stage::service::ReplicaStatus> {
        s.peers
            .iter()
            .filter(|p| p.stage() == Some(i))
            .map(|p| p.service().unwrap().status())
            .collect()
    };
    // Between outer steps the replicas step on their own samples: their parameters differ.
    // Kill a replica of stage 1 in the middle of an interval.
    let t0 = Instant::now();
    let mut differed = false;
    let at_kill = loop {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the run did not get going"
        );
        for i in 0..2 {
            let st = of_stage(&s, i);
            if st[0].params_step == st[1].params_step && st[0].params_step % 4 != 0 {
                differed |= st[0].params_hash != st[1].params_hash;
            }
        }
        let st = of_stage(&s, 1);
        if differed && st[0].params_step >= 6 && st[0].params_step % 4 == 2 {
            break st[0].params_step;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let held = kill_one_of(&mut s, 1).await;
    wait_trainers(&t, Duration::from_secs(240)).await;
    let refs: Vec<&Peer> = s.peers.iter().collect();
    settle(&refs).await;
    let (fed, done, failed) = check_accounting(&refs, &t, 2, Some((1, held)));
    eprintln!(
        "outer churn: killed at step {at_kill} holding {held}; fed {fed} completed {done} failed {failed}"
    );
    // The survivor of stage 1 went on through outer steps of its own.
    let survivor = s.peers.iter().find(|p| p.stage() == Some(1)).unwrap();
    let st = survivor.service().unwrap().status();
    assert!(
        st.params_step >= 24,
        "stage 1 stopped at step {}",
        st.params_step
    );
    assert_eq!(
        st.shared_hash, st.params_hash,
        "stage 1 did not end on an outer step"
    );
    // Stage 0's replicas meet at every outer step: identical at the end (settled above),
    // and their step histories agree at the outer steps they both took.
    let st0 = of_stage(&s, 0);
    assert_eq!(st0[0].params_hash, st0[1].params_hash);
    let loss = eval(&s).await;
    eprintln!("outer churn: eval loss {loss:.4}");
    assert!(loss < 2.3, "training did not go on: eval loss {loss:.4}");
    stop_all(t, s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "experiment: SWARM_R replicas, SWARM_T trainers, SWARM_C concurrency, SWARM_G grad codec"]
async fn experiment() {
    let _g = SERIAL.lock().await;
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let (r, tn, c) = (env("SWARM_R", 1), env("SWARM_T", 1), env("SWARM_C", 1));
    let steps = env("SWARM_S", 40) as u64;
    let mut cfg = run_config(steps);
    if let Ok(g) = std::env::var("SWARM_G") {
        cfg.codecs.gradients = g.parse().unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let s = swarm(&dir, &cfg, r).await;
    let mut tc = pc(
        RunSource::Id(s.m.id.clone()),
        vec![s.addr.clone()],
        StageChoice::None,
    );
    tc.net.listen.clear();
    tc.trainers = tn;
    tc.trainer.concurrency = c;
    tc.trainer.sync_steps = std::env::var_os("SWARM_ASYNC").is_none();
    tc.trainer.max_microbatches = Some(steps * 2 / tn as u64);
    let t = start(tc).await;
    let t0 = Instant::now();
    wait_trainers(&t, Duration::from_secs(240)).await;
    eprintln!("trained in {:.1} s", t0.elapsed().as_secs_f64());
    let refs: Vec<&Peer> = s.peers.iter().collect();
    settle(&refs).await;
    let steps: Vec<u64> = refs
        .iter()
        .map(|p| p.service().unwrap().status().params_step)
        .collect();
    eprintln!(
        "r{r} t{tn} c{c}: steps {steps:?} eval {:.4}",
        eval(&s).await
    );
    for p in &refs {
        let a = p.avg_stats().unwrap();
        let n = a.rounds.load(Relaxed).max(1);
        eprintln!(
            "  stage {:?}: {} rounds, {:.1} ms each",
            p.stage(),
            n,
            a.round_us.load(Relaxed) as f64 / n as f64 / 1e3
        );
    }
    if std::env::var_os("SWARM_LOCAL").is_some() {
        let local = local_run(&cfg);
        eprintln!("local eval {:.4}", local.eval_loss);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_joiners_spread_their_downloads_over_the_donors() {
    let _g = SERIAL.lock().await;
    let cfg = run_config(20);
    let dir = tempfile::tempdir().unwrap();
    let (m, path) = manifest_file(&dir, &cfg);
    let boot = start(pc(RunSource::File(path), vec![], StageChoice::None)).await;
    let addr = boot.addrs()[0].clone();
    let mut donors = Vec::new();
    for _ in 0..2 {
        donors.push(
            start(pc(
                RunSource::Id(m.id.clone()),
                vec![addr.clone()],
                StageChoice::Index(0),
            ))
            .await,
        );
    }
    // The donors take a step (the same one): replicas at the untouched init would have
    // nothing to download.
    for d in &donors {
        let s = d.service().unwrap();
        {
            let r = s.replica();
            let mut g = r.lock().await;
            let zeros = vec![0f32; s.numel()];
            g.apply(0, &zeros.as_slice(), 0, 0).unwrap();
        }
        s.refresh_status().await;
    }
    // Three joiners of stage 0 at once.
    let joiners = futures::future::join_all((0..3).map(|_| {
        start(pc(
            RunSource::Id(m.id.clone()),
            vec![addr.clone()],
            StageChoice::Index(0),
        ))
    }))
    .await;
    let want = donors[0].service().unwrap().params_hash();
    let mut per_donor: std::collections::HashMap<String, usize> = Default::default();
    for j in &joiners {
        let r = j
            .synced()
            .expect("every joiner downloads the stage's state");
        // A joiner that announced early may serve as a donor to the later ones too.
        assert!(
            r.donors.len() >= 2,
            "a joiner used {} donor(s)",
            r.donors.len()
        );

        for (d, n) in r.donors.iter().zip(&r.chunks_per_donor) {
            *per_donor.entry(d.to_string()).or_default() += n;
        }
        assert_eq!(j.service().unwrap().params_hash(), want);
    }
    eprintln!("chunks per donor over three joiners: {per_donor:?}");
    // Chunks are assigned round-robin from a random offset; a chunk that fails (a stream
    // dropped under this burst) is fetched from another donor, so shares can be uneven,
    // but both original donors must have served.
    for d in &donors {
        let id = d.net().local_peer_id().to_string();
        assert!(
            per_donor.get(&id).copied().unwrap_or(0) >= 1,
            "{id} served nothing: {per_donor:?}"
        );
    }
    for p in joiners.into_iter().chain(donors) {
        p.stop().await.unwrap();
    }
    boot.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rebalancing_spreads_a_piled_up_stage_without_flapping() {
    let _g = SERIAL.lock().await;
    let cfg = run_config(1000);
    let dir = tempfile::tempdir().unwrap();
    let (m, path) = manifest_file(&dir, &cfg);
    let boot = start(pc(RunSource::File(path), vec![], StageChoice::None)).await;
    let addr = boot.addrs()[0].clone();
    let period = Duration::from_millis(1500);
    let mut peers = Vec::new();
    // Four peers on stage 0, one on each other stage; all announce the same throughput so
    // the balanced end state is known: two replicas per stage.
    for stage in [0, 0, 0, 0, 1, 2] {
        let mut c = pc(
            RunSource::Id(m.id.clone()),
            vec![addr.clone()],
            StageChoice::Index(stage),
        );
        c.throughput = Some(100.0);
        c.rebalance = Some(period);
        c.drain_timeout = Duration::from_secs(10);
        peers.push(start(c).await);
    }
    // Training runs through the moves: migrating replicas must finish their work.
    let t = trainers_for(&m, &addr, 2, 50).await;
    let counts = |peers: &[Peer]| -> Vec<usize> {
        let mut c = vec![0; 3];
        for p in peers {
            if let Some(s) = p.stage() {
                c[s] += 1;
            }
        }
        c
    };
    let t0 = Instant::now();
    while counts(&peers) != [2, 2, 2] {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "not balanced after 60 s: {:?}",
            counts(&peers)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let balanced_after = t0.elapsed();
    let moves: u64 = peers.iter().map(|p| p.moves()).sum();
    // Watch for several more periods: nobody moves again.
    tokio::time::sleep(period * 4).await;
    let later: u64 = peers.iter().map(|p| p.moves()).sum();
    eprintln!(
        "balanced after {balanced_after:?} with {moves} move(s); {later} after 4 more periods"
    );
    assert_eq!(counts(&peers), [2, 2, 2]);
    assert_eq!(later, moves, "a balanced swarm kept moving");
    assert!(
        (2..=4).contains(&moves),
        "{moves} moves for 2 misplaced peers"
    );
    wait_trainers(&t, Duration::from_secs(120)).await;
    let refs: Vec<&Peer> = peers.iter().collect();
    settle(&refs).await;
    let (fed, _done, failed) = check_accounting(&refs, &t, 3, None);
    assert_eq!(failed, 0, "no microbatch may fail while replicas migrate");
    assert!(fed > 0);
    tokio::task::block_in_place(|| assert!(histories_agree(&refs) > 0));
    t.stop().await.unwrap();
    for p in peers {
        p.stop().await.unwrap();
    }
    boot.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trained_state_of_more_chunks_than_one_header_holds_is_downloaded_whole() {
    let _g = SERIAL.lock().await;
    let mut cfg = run_config_of(2, 20);
    // 32 floats a chunk: stage 0's state is ~10k chunks, whose hashes (19 bytes each in
    // JSON) are more than twice what one 64 KiB message header could hold.
    cfg.averaging.state_chunk_floats = Some(32);
    // One microbatch a step: every microbatch steps the run.
    cfg.training.target_batch_size = Some(cfg.training.batch_size);
    cfg.validate().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let s = swarm(&dir, &cfg, 1).await;
    // Train a few steps, so the state differs from the init a joiner starts with.
    let t = trainers(&s, 1, 3).await;
    wait_trainers(&t, Duration::from_secs(120)).await;
    let donor = s.peers.iter().find(|p| p.stage() == Some(0)).unwrap();
    let t0 = Instant::now();
    // Every microbatch done and applied (none held toward a step): the donor's state no
    // longer moves. (Waiting for step 2 alone let the third step land between the reading
    // below and the joiner's download once, on a loaded machine.)
    loop {
        let st = donor.service().unwrap().status();
        if st.params_step >= 2 && st.accum_count + st.frozen_count == 0 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "stage 0 did not step: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (step, hash) = {
        let st = donor.service().unwrap().status();
        (st.params_step, st.params_hash)
    };
    let started = Instant::now();
    let joiner = start(pc(
        RunSource::Id(s.m.id.clone()),
        vec![s.addr.clone()],
        StageChoice::Index(0),
    ))
    .await;
    let r = joiner.synced().expect("the joiner downloads the state");
    let chunks: usize = r.chunks_per_donor.iter().sum();
    let numel = donor.service().unwrap().numel();
    assert_eq!(chunks, (3 * numel).div_ceil(32));
    assert!(
        chunks * 19 > 2 * shoal::wire::msg::MAX_HEADER,
        "{chunks} chunks"
    );
    let st = joiner.service().unwrap().status();
    assert_eq!((st.params_step, st.params_hash), (step, hash));
    eprintln!(
        "{chunks} chunks of 32 floats downloaded and checked in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rounds_whose_parts_cross_a_slow_link_complete() {
    let _g = SERIAL.lock().await;
    let mut cfg = RunConfig::tiny();
    // ~0.8M parameters: 0.8 MB of int8 gradient, which one replica's 4 Mbit/s uplink needs
    // ~1.6 s to send in a round (its part and its reduced part), past the 1 s floor.
    cfg.model.d_model = 128;
    cfg.stages.count = 1;
    cfg.stages.kind = shoal::config::StageKind::Sim;
    cfg.stages.sim_ms_per_sample = Some(0.5);
    // Sim gradients are zeros: without zstd their bytes still cross the link.
    cfg.codecs.gradients = shoal::wire::CodecSpec::INT8;
    cfg.training.target_batch_size = Some(cfg.training.batch_size);
    cfg.training.steps = 1_000;
    cfg.averaging.round_timeout_s = Some(1.0);
    cfg.validate().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (m, path) = manifest_file(&dir, &cfg);
    let mut fast = pc(RunSource::File(path), vec![], StageChoice::Index(0));
    fast.allow_sim = true;
    let fast = start(fast).await;
    let addr = fast.addrs()[0].clone();
    // The slow replica joins second: it downloads the state over its fast downlink.
    let mut slow = pc(
        RunSource::Id(m.id.clone()),
        vec![addr.clone()],
        StageChoice::Index(0),
    );
    slow.allow_sim = true;
    slow.net.link =
        Some(shoal::net::link::LinkSpec::parse("up=4mbit,down=1000mbit,rtt=10ms").unwrap());
    let slow = start(slow).await;
    let t = trainers_for(&m, &addr, 1, 8).await;
    let t0 = Instant::now();
    let step = |p: &Peer| p.service().unwrap().step();
    while step(&fast).min(step(&slow)) < 5 {
        assert!(
            t0.elapsed() < Duration::from_secs(150),
            "steps stalled at {} / {} (failed attempts {} / {})",
            step(&fast),
            step(&slow),
            fast.avg_stats().unwrap().failed_attempts.load(Relaxed),
            slow.avg_stats().unwrap().failed_attempts.load(Relaxed)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (f, s) = (fast.avg_stats().unwrap(), slow.avg_stats().unwrap());
    let uplink = s.uplink.load(Relaxed);
    let failed = f.failed_attempts.load(Relaxed) + s.failed_attempts.load(Relaxed);
    eprintln!(
        "5 steps in {:.1} s; slow uplink measured {:.0} KB/s; failed attempts {failed}",
        t0.elapsed().as_secs_f64(),
        uplink as f64 / 1e3
    );
    // The slow replica measured its link (4 Mbit/s is 500 KB/s; sends share it)... It
    // read 1.31 MB/s once in six runs with the other tests of this file running, not
    // diagnosed (likely the emulator's token bucket letting a burst through after idle
    // time, rounds being further apart on a loaded machine). Up to 4x the link.
    assert!(uplink > 50_000 && uplink < 2_000_000, "uplink {uplink} B/s");
    // ...and, told it, rounds allow for it: only attempts that started before the first
    // part send finished (nothing measured yet) time out, a few at most, each counted by
    // both replicas; each doubles the next one's deadline, so three of each at most reach
    // 8 s, past the ~3.5 s these need. (With a fixed timeout the same swarm stalls at step
    // 1 with hundreds of failed attempts. Without the doubling CI once counted 7.)
    assert!(failed <= 6, "{failed} attempts timed out");
    wait_trainers(&t, Duration::from_secs(120)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_replica_stopped_and_resumed_continues_at_its_step_and_hash() {
    let _g = SERIAL.lock().await;
    let cfg = run_config_of(2, 200);
    let dir = tempfile::tempdir().unwrap();
    let (m, path) = manifest_file(&dir, &cfg);
    let boot = start(pc(RunSource::File(path), vec![], StageChoice::None)).await;
    let addr = boot.addrs()[0].clone();
    let ckpt = |i: usize| dir.path().join(format!("r{i}.ckpt"));
    let replica = |i: usize, resume: bool| {
        let mut c = pc(
            RunSource::Id(m.id.clone()),
            vec![addr.clone()],
            StageChoice::Index(i % 2),
        );
        c.checkpoint = Some(ckpt(i));
        c.resume = resume.then(|| ckpt(i));
        // Nothing is pending at the stops here (the replicas settled first).
        c.drain_timeout = Duration::from_secs(2);
        c
    };
    let mut peers = Vec::new();
    for i in 0..4 {
        peers.push(start(replica(i, false)).await);
    }
    let t = trainers_for(&m, &addr, 1, 12).await;
    wait_trainers(&t, Duration::from_secs(120)).await;
    t.stop().await.unwrap();
    let refs: Vec<&Peer> = peers.iter().collect();
    settle(&refs).await;
    let saved: Vec<(u64, String)> = peers
        .iter()
        .map(|p| {
            let st = p.service().unwrap().status();
            (st.params_step, st.params_hash)
        })
        .collect();
    assert!(saved.iter().all(|(s, _)| *s >= 3), "steps {saved:?}");
    for p in peers {
        p.stop().await.unwrap();
    }
    // Every checkpoint records what its replica had.
    for (i, (step, hash)) in saved.iter().enumerate() {
        let info = shoal::model::checkpoint::peek(&ckpt(i)).unwrap();
        assert_eq!(
            (info.step, &info.params_hash, &info.run),
            (*step, hash, &m.id)
        );
    }
    // Kept aside: stage 0's checkpoint as it is now, soon older than the swarm.
    let old = dir.path().join("old.ckpt");
    std::fs::copy(ckpt(0), &old).unwrap();
    // All back from their checkpoints: the same steps and hashes, nothing downloaded.
    let mut back = Vec::new();
    for i in 0..4 {
        back.push(start(replica(i, true)).await);
    }
    for (p, (step, hash)) in back.iter().zip(&saved) {
        assert!(p.synced().is_none(), "a resumed replica downloaded");
        let st = p.service().unwrap().status();
        assert_eq!((st.params_step, &st.params_hash), (*step, hash));
    }
    // Training goes on from there.
    let t = trainers_for(&m, &addr, 1, 8).await;
    wait_trainers(&t, Duration::from_secs(120)).await;
    t.stop().await.unwrap();
    let refs: Vec<&Peer> = back.iter().collect();
    settle(&refs).await;
    for (p, (step, _)) in back.iter().zip(&saved) {
        assert!(p.service().unwrap().status().params_step > *step);
    }
    // A replica resumed from the older checkpoint downloads the live replicas' state.
    let mut late = replica(0, false);
    late.checkpoint = None;
    late.resume = Some(old.clone());
    let late = start(late).await;
    assert!(
        late.synced().is_some(),
        "resumed behind the swarm without a download"
    );
    let live = back[0].service().unwrap().status();
    let got = late.service().unwrap().status();
    assert_eq!(
        (got.params_step, got.params_hash),
        (live.params_step, live.params_hash)
    );
    late.stop().await.unwrap();
    // A checkpoint of another stage is refused by a replica of this one.
    let mut wrong = replica(0, false);
    wrong.resume = Some(ckpt(1));
    let Err(err) = Peer::start(wrong, |_| {}).await else {
        panic!("a checkpoint of another stage was accepted");
    };
    assert!(err.to_string().contains("stage"), "{err}");
    // Exported from the live swarm (through the bootstrap peer's network), the model holds
    // what the replicas hold: the same tensors as the export of the checkpoints they write
    // when they stop.
    let live = dir.path().join("live.safetensors");
    let e =
        shoal::swarm::export::from_swarm(boot.net(), &m, &live, &Default::default(), |_, _, _| {})
            .await
            .unwrap();
    let steps: Vec<u64> = (0..2)
        .map(|i| back[i].service().unwrap().status().params_step)
        .collect();
    assert_eq!(e.steps, steps);
    for p in back {
        p.stop().await.unwrap();
    }
    let stored = dir.path().join("stored.safetensors");
    shoal::model::export::from_checkpoints(&[ckpt(0), ckpt(1)], &stored).unwrap();
    let (a, b) = (
        std::fs::read(&live).unwrap(),
        std::fs::read(&stored).unwrap(),
    );
    let (a, b) = (
        safetensors::SafeTensors::deserialize(&a).unwrap(),
        safetensors::SafeTensors::deserialize(&b).unwrap(),
    );
    assert_eq!(a.len(), b.len());
    assert!(!a.is_empty());
    for (name, t) in a.tensors() {
        assert_eq!(t.data(), b.tensor(&name).unwrap().data(), "{name}");
    }
    // Nothing but the model is left beside it.
    let left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".part"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    boot.stop().await.unwrap();
}

/// One stage of 4 replicas and 2 trainers (40 steps); peer 0 sends `tamper`ed parts from
/// step 3 on. Returns the eval loss through the 3 honest replicas (the tamperer is stopped
/// first), after checking that they agree on step and hash, and the chunks they rejected.
async fn robust_run(
    aggregate: AggregateKind,
    norm_check: bool,
    tamper: Option<TamperKind>,
) -> (f64, u64) {
    let steps = 30;
    let mut cfg = run_config_of(1, steps);
    // Steps of 8 microbatches over 4 replicas: nearly every member holds samples (a
    // round where the bad replica and one honest one alone hold samples has no majority
    // for any robust rule to find).
    cfg.training.batch_size = 8;
    cfg.training.target_batch_size = Some(64);
    cfg.averaging.aggregate = Some(aggregate);
    if !norm_check {
        cfg.averaging.max_norm_ratio = Some(0.0);
    }
    cfg.validate().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let s = swarm_with(&dir, &cfg, 4, |i, c| {
        if i == 0 {
            c.tamper = tamper.map(|kind| Tamper { from_step: 3, kind });
        }
    })
    .await;
    // 2 trainers × 4 in flight × 8 samples: one step's batch. They do not wait for steps:
    // a banned replica is left out of its stage's rounds, and a trainer waiting for its
    // step would wait in vain.
    let t = trainers_with(&s.m, &s.addr, 2, steps * 4, |t| {
        t.concurrency = 4;
        t.sync_steps = false;
    })
    .await;
    wait_trainers(&t, Duration::from_secs(240)).await;
    t.stop().await.unwrap();
    let mut peers = s.peers;
    let bad = peers.remove(0);
    let honest: Vec<&Peer> = peers.iter().collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let st: Vec<_> = honest
            .iter()
            .map(|p| p.service().unwrap().status())
            .collect();
        let pending: u64 = st.iter().map(|s| s.accum_count + s.frozen_count).sum();
        if pending < 64
            && st.windows(2).all(|w| {
                (w[0].params_step, &w[0].params_hash) == (w[1].params_step, &w[1].params_hash)
            })
        {
            // Not stalled at the tamper step (3). Trainers that never wait put whatever
            // arrived during a round into the next step, so a loaded machine makes fewer,
            // larger steps than the 30 of 64 samples fed (10 once in a full test run).
            assert!(st[0].params_step >= 8, "only {} steps", st[0].params_step);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "honest replicas disagree: {:?}",
            st.iter()
                .map(|s| (s.params_step, s.params_hash.clone()))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let rejected: u64 = honest
        .iter()
        .map(|p| p.avg_stats().unwrap().rejected.load(Relaxed))
        .sum();
    // Through an honest replica (they are identical), not one the DHT picks.
    let mut c = NetConfig::new(libp2p::identity::Keypair::generate_ed25519(), Vec::new());
    c.dht_server = false;
    let h = net::start(c).unwrap();
    let id = h.dial(honest[0].addrs()[0].clone()).await.unwrap();
    let loss = probe::evaluate_on(&h, &s.m, &[id], 8).await.unwrap();
    h.shutdown().await;
    bad.stop().await.unwrap();
    for p in peers {
        p.stop().await.unwrap();
    }
    s.boot.stop().await.unwrap();
    (loss, rejected)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn centered_clip_keeps_one_bad_replica_of_four_from_ruining_the_run() {
    let _g = SERIAL.lock().await;
    let (honest, none) = robust_run(AggregateKind::Mean, true, None).await;
    assert_eq!(none, 0, "an honest run had chunks rejected");
    // The mean has no defence once the norm check is off: a replica sending its gradient
    // times -1000 turns the step into ascent.
    let (ruined, _) =
        robust_run(AggregateKind::Mean, false, Some(TamperKind::Scale(-1000.0))).await;
    eprintln!("honest {honest:.4}, mean under x-1000 parts {ruined:.4}");
    assert!(
        !ruined.is_finite() || ruined > 1.05 * honest,
        "x-1000 parts did no damage to the mean: {ruined:.4} vs {honest:.4}"
    );
    // CenteredClip alone (norm check off) against scaled and random parts; NaN parts are
    // rejected whatever the aggregate, and their sender banned from the rounds.
    for (kind, norm_check) in [
        (TamperKind::Scale(-1000.0), false),
        (TamperKind::Random(1.0), false),
        (TamperKind::NaN, true),
    ] {
        let (loss, rejected) =
            robust_run(AggregateKind::CenteredClip, norm_check, Some(kind)).await;
        eprintln!("centered_clip under {kind:?}: {loss:.4} ({rejected} chunks rejected)");
        assert!(
            loss <= 1.05 * honest,
            "centered_clip under {kind:?}: eval {loss:.4} vs honest {honest:.4}"
        );
        if kind == TamperKind::NaN {
            assert!(rejected > 0, "NaN parts were not rejected");
        }
    }
}

/// In outer mode a replica that starts while the stage is mid-interval, or falls behind,
/// downloads the whole state (parameters, moments, outer parameters and momentum): its
/// resync once asked for the size of the first three only and failed for ever, and with
/// it the trainers whose calls it held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outer_run_takes_in_a_replica_that_joins_mid_interval() {
    let _g = SERIAL.lock().await;
    let cfg = outer_config(16);
    let dir = tempfile::tempdir().unwrap();
    let mut s = swarm(&dir, &cfg, 1).await;
    let t = trainers(&s, 2, 400).await;
    let t0 = Instant::now();
    while s.peers[1].service().unwrap().status().params_step < 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the run did not get going"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let c = pc(
        RunSource::Id(s.m.id.clone()),
        vec![s.addr.clone()],
        StageChoice::Index(1),
    );
    s.peers.push(start(c).await);
    wait_trainers(&t, Duration::from_secs(120)).await;
    let refs: Vec<&Peer> = s.peers.iter().collect();
    settle(&refs).await;
    let joiner = s.peers[2].service().unwrap().status();
    assert!(
        joiner.params_step >= 16,
        "the joiner stopped at step {}",
        joiner.params_step
    );
    stop_all(t, s).await;
}
