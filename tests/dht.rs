//! DHT records: manifests hash to their id, announcements validate, bad values are refused.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests and benches fail by panicking"
)]

use libp2p::identity::Keypair;
use shoal::config::RunConfig;
use shoal::dht::record;
use shoal::dht::{self, Announcement, Manifest, ManifestError};

fn ann(run: &str, peer: &str, now: u64) -> Announcement {
    Announcement {
        v: record::ANN_VERSION,
        run: run.to_string(),
        peer: peer.to_string(),
        addrs: vec![format!("/ip4/127.0.0.1/tcp/4001/p2p/{peer}")],
        stage: 1,
        stages: 2,
        step: 3,
        samples_per_s: 120.5,
        device: "cpu".into(),
        queue: 0,
        queue_cap: 8,
        params_hash: "00ff".into(),
        issued_ms: now,
        expires_ms: now + 30_000,
        banned: Vec::new(),
        uplink: 0,
    }
}

const RUN: &str = "0123456789abcdef0123456789abcdef";

// The record-level announcement tests (validation, expiry, forged_announcement_*) are unit
// tests of dht::record (src/dht/record_tests.rs).

#[test]
fn manifest_is_canonical_and_checked_against_its_id() {
    let m = Manifest::from_config(&RunConfig::tiny()).unwrap();
    assert!(dht::is_run_id(&m.id));
    assert_eq!(dht::run_id(m.canonical.as_bytes()), m.id);
    // Canonicalising the canonical form changes nothing; the file's comment is not hashed.
    let again = Manifest::from_bytes(m.file_text().as_bytes(), "file").unwrap();
    assert_eq!(again, m);
    assert_eq!(
        Manifest::from_fetched(m.canonical.as_bytes(), &m.id).unwrap(),
        m
    );
    // Derived values are written out.
    assert_eq!(m.config.stages.cuts.len(), m.config.stages.count - 1);
    assert!(m.config.training.target_batch_size.is_some());
    // Tampered bytes do not pass as the run.
    let tampered = m.canonical.replace("seq_len = 64", "seq_len = 32");
    assert_ne!(tampered, m.canonical);
    assert!(matches!(
        Manifest::from_fetched(tampered.as_bytes(), &m.id),
        Err(ManifestError::IdMismatch { .. })
    ));
    // Validation through the record key.
    let key = dht::manifest_key(&m.id);
    assert!(dht::validate(key.as_bytes(), m.canonical.as_bytes(), 0).is_ok());
    assert!(dht::validate(key.as_bytes(), tampered.as_bytes(), 0).is_err());
    assert!(dht::validate(key.as_bytes(), &[0xff; 10], 0).is_err());
}

/// A peer on 127.0.0.1 with a fresh key.
fn node() -> (shoal::net::NetHandle, Keypair) {
    let key = Keypair::generate_ed25519();
    let cfg =
        shoal::net::NetConfig::new(key.clone(), vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()]);
    (shoal::net::start(cfg).unwrap(), key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_announcement_stored_to_a_peer_is_refused_and_counted() {
    use std::time::Duration;
    let (a, _) = node();
    let (b, b_key) = node();
    let a_addr = a.wait_listening(1, Duration::from_secs(5)).await.unwrap()[0].clone();
    b.dial(a_addr).await.unwrap();
    let a_id = a.local_peer_id().to_string();
    let now = dht::now_ms();
    // B stores a record about A, in A's key, at A (the closest peer to the key it knows).
    let forged = ann(RUN, &a_id, now).signed(&b_key).unwrap();
    let key = dht::announcement_key(&a_id).into_bytes();
    let mut counted = false;
    for _ in 0..50 {
        let _ = b
            .put_record(key.clone(), forged.clone(), Duration::from_secs(30))
            .await;
        if a.status().await.unwrap().forged_records > 0 {
            counted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(counted, "A never counted the forged record");
    // A keeps nothing under its key, and B reads no announcement of A.
    assert!(
        shoal::stage::registry::read_announcement(&b, a.local_peer_id())
            .await
            .is_none()
    );
    // A's own, signed with its key, is stored and read back by B.
    let genuine = ann(RUN, &a_id, now);
    shoal::stage::registry::announce(&a, &genuine, Duration::from_secs(30), true)
        .await
        .unwrap();
    let mut read = None;
    for _ in 0..50 {
        read = shoal::stage::registry::read_announcement(&b, a.local_peer_id()).await;
        if read.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(read, Some(genuine));
}
