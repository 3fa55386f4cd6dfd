//! DHT records: manifests hash to their id, announcements validate, bad values are refused.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests and benches fail by panicking"
)]

use libp2p::identity::Keypair;
use shoal::config::RunConfig;
use shoal::dht::record::{self, parse_key, KeyKind, RecordError};
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

/// A peer's key and its id as text.
fn peer() -> (Keypair, String) {
    let k = Keypair::generate_ed25519();
    let id = k.public().to_peer_id().to_string();
    (k, id)
}

/// `payload` in an envelope of an announcement's payload type, signed with `key` for
/// `domain` (announcements use "shoal-announcement").
fn signed_payload(key: &Keypair, domain: &str, payload: Vec<u8>) -> Vec<u8> {
    libp2p::core::SignedEnvelope::new(key, domain.into(), b"/shoal/ann/2".to_vec(), payload)
        .unwrap()
        .into_protobuf_encoding()
}

// The record-level forged_announcement_* tests are unit tests (src/dht/record_tests.rs).

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

#[test]
fn announcements_validate_and_expire() {
    let (key, me) = peer();
    let now = 1_000_000;
    let a = ann(RUN, &me, now);
    let rkey = dht::announcement_key(&me);
    assert_eq!(
        parse_key(rkey.as_bytes()),
        Ok(KeyKind::Announcement(me.as_str()))
    );
    let bytes = a.signed(&key).unwrap();
    assert_eq!(
        Announcement::from_bytes(&bytes, &me, now + 1),
        Ok(a.clone())
    );
    assert!(dht::validate(rkey.as_bytes(), &bytes, now + 1).is_ok());
    // Expired.
    assert_eq!(
        Announcement::from_bytes(&bytes, &me, now + 30_000),
        Err(RecordError::Expired)
    );
    // Inconsistent values, signed by the right key.
    let bad: [fn(&mut Announcement); 8] = [
        |a| a.stage = 2,
        |a| a.stages = 0,
        |a| a.samples_per_s = f64::NAN,
        |a| a.samples_per_s = -1.0,
        |a| a.run = "xyz".into(),
        |a| a.expires_ms = a.issued_ms + 11 * 60 * 1000,
        |a| a.addrs = vec!["/ip4/1.2.3.4/tcp/1".into(); 33],
        |a| a.v = 9,
    ];
    for (i, f) in bad.iter().enumerate() {
        let mut b = a.clone();
        f(&mut b);
        assert!(
            Announcement::from_bytes(&b.signed(&key).unwrap(), &me, now).is_err(),
            "case {i} accepted"
        );
    }
    // The peer field names another peer than the key (signed by the key's peer).
    let mut other = a.clone();
    other.peer = peer().1;
    assert!(matches!(
        Announcement::from_bytes(&other.signed(&key).unwrap(), &me, now),
        Err(RecordError::Malformed(_))
    ));
    // Oversized, garbage, unknown fields, unknown keys.
    let mut big = a.clone();
    big.device = "x".repeat(9000);
    assert!(matches!(
        Announcement::from_bytes(&big.signed(&key).unwrap(), &me, now),
        Err(RecordError::TooLarge(_))
    ));
    assert!(Announcement::from_bytes(b"\x00\x01junk", &me, now).is_err());
    let extra = String::from_utf8(a.to_bytes())
        .unwrap()
        .replacen('{', "{\"evil\":1,", 1);
    let extra = signed_payload(&key, "shoal-announcement", extra.into_bytes());
    assert!(matches!(
        Announcement::from_bytes(&extra, &me, now),
        Err(RecordError::Malformed(_))
    ));
    assert_eq!(
        dht::validate(b"/other/key", &bytes, now),
        Err(RecordError::UnknownKey)
    );
    assert!(record::is_provider_key(dht::stage_key(RUN, 3).as_bytes()));
    assert!(record::is_provider_key(dht::PEERS_KEY.as_bytes()));
    assert!(!record::is_provider_key(b"/shoal/stage/zz/1"));
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
    shoal::stage::registry::announce(&a, &genuine, Duration::from_secs(30))
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
