//! DHT records: manifests hash to their id, announcements validate, bad values are refused.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests and benches fail by panicking"
)]

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

const PEER: &str = "12D3KooWF6JZRfF6yvtKr3JL8dKPrhWzGyK1nEMtZAgZUAYfcgJd";

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
    let run = "0123456789abcdef0123456789abcdef";
    let now = 1_000_000;
    let a = ann(run, PEER, now);
    let key = dht::announcement_key(PEER);
    assert_eq!(parse_key(key.as_bytes()), Ok(KeyKind::Announcement(PEER)));
    let bytes = a.to_bytes();
    assert_eq!(
        Announcement::from_bytes(&bytes, PEER, now + 1),
        Ok(a.clone())
    );
    assert!(dht::validate(key.as_bytes(), &bytes, now + 1).is_ok());
    // Expired.
    assert_eq!(
        Announcement::from_bytes(&bytes, PEER, now + 30_000),
        Err(RecordError::Expired)
    );
    // Stored under another peer's key.
    assert!(matches!(
        Announcement::from_bytes(&bytes, "12D3KooWother", now),
        Err(RecordError::Malformed(_))
    ));
    // Inconsistent values.
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
            Announcement::from_bytes(&b.to_bytes(), PEER, now).is_err(),
            "case {i} accepted"
        );
    }
    // Oversized, garbage, unknown fields, unknown keys.
    let mut big = a.clone();
    big.device = "x".repeat(9000);
    assert!(matches!(
        Announcement::from_bytes(&big.to_bytes(), PEER, now),
        Err(RecordError::TooLarge(_))
    ));
    assert!(Announcement::from_bytes(b"\x00\x01junk", PEER, now).is_err());
    let extra = String::from_utf8(bytes.clone())
        .unwrap()
        .replacen('{', "{\"evil\":1,", 1);
    assert!(Announcement::from_bytes(extra.as_bytes(), PEER, now).is_err());
    assert_eq!(
        dht::validate(b"/other/key", &bytes, now),
        Err(RecordError::UnknownKey)
    );
    assert!(record::is_provider_key(dht::stage_key(run, 3).as_bytes()));
    assert!(record::is_provider_key(dht::PEERS_KEY.as_bytes()));
    assert!(!record::is_provider_key(b"/shoal/stage/zz/1"));
}
