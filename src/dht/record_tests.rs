//! Signed announcements: a record a peer writes about another peer, a tampered one and an
//! unsigned one are refused; a genuine one is accepted.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests fail by panicking"
)]

use super::*;
use crate::dht::{self, Announcement};
use libp2p::identity::Keypair;

fn ann(run: &str, peer: &str, now: u64) -> Announcement {
    Announcement {
        v: ANN_VERSION,
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

#[test]
fn forged_announcement_for_another_peer_is_rejected() {
    // Peer B writes a record about peer A, under A's key, signed with its own key.
    let (_, a_id) = peer();
    let (b_key, _) = peer();
    let now = 1_000_000;
    let forged = ann(RUN, &a_id, now).signed(&b_key).unwrap();
    let rkey = dht::announcement_key(&a_id);
    assert!(matches!(
        dht::validate(rkey.as_bytes(), &forged, now),
        Err(RecordError::Forged(_))
    ));
    assert!(matches!(
        Announcement::from_bytes(&forged, &a_id, now),
        Err(RecordError::Forged(_))
    ));
}

#[test]
fn forged_announcement_with_a_tampered_field_is_rejected() {
    let (key, me) = peer();
    let now = 1_000_000;
    let a = ann(RUN, &me, now);
    let genuine = a.signed(&key).unwrap();
    // Change a field inside the signed bytes (the throughput, same length): the signature
    // no longer verifies.
    let at = genuine
        .windows(5)
        .position(|w| w == b"120.5")
        .expect("the payload is in the envelope");
    let mut tampered = genuine.clone();
    tampered[at..at + 5].copy_from_slice(b"999.5");
    assert!(matches!(
        Announcement::from_bytes(&tampered, &me, now),
        Err(RecordError::Forged(_))
    ));
    // An unsigned announcement (the JSON alone, as version 1 stored it) is refused too.
    assert!(matches!(
        Announcement::from_bytes(&a.to_bytes(), &me, now),
        Err(RecordError::Forged(_))
    ));
    // A different payload type or domain is not an announcement.
    let other = signed_payload(&key, "other", a.to_bytes());
    assert!(matches!(
        Announcement::from_bytes(&other, &me, now),
        Err(RecordError::Forged(_))
    ));
}

#[test]
fn forged_announcement_check_accepts_a_genuine_one() {
    let (key, me) = peer();
    let now = 1_000_000;
    let a = ann(RUN, &me, now);
    let bytes = a.signed(&key).unwrap();
    assert!(dht::validate(dht::announcement_key(&me).as_bytes(), &bytes, now).is_ok());
    assert_eq!(Announcement::from_bytes(&bytes, &me, now), Ok(a));
}
