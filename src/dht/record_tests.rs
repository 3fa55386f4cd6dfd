//! Signed announcements: a record a peer writes about another peer, a tampered one and an
//! unsigned one are refused; a genuine one is accepted.
use super::*;
use crate::dht::{self, Announcement};
use libp2p::identity::Keypair;

/// A test's outcome: a failed step is an error, not a panic.
type TestResult = Result<(), Box<dyn std::error::Error>>;

/// An announcement of `peer` in run `run`, issued at `now` (from its JSON form).
fn ann(run: &str, peer: &str, now: u64) -> Result<Announcement, serde_json::Error> {
    serde_json::from_value(serde_json::json!({
        "v": ANN_VERSION, "run": run, "peer": peer,
        "addrs": [format!("/ip4/127.0.0.1/tcp/4001/p2p/{peer}")],
        "stage": 1, "stages": 2, "step": 3, "samples_per_s": 120.5, "device": "cpu",
        "queue": 0, "queue_cap": 8, "params_hash": "00ff",
        "issued_ms": now, "expires_ms": now + 30_000, "banned": [], "uplink": 0,
    }))
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
fn signed_payload(
    key: &Keypair,
    domain: &str,
    payload: Vec<u8>,
) -> Result<Vec<u8>, libp2p::identity::SigningError> {
    libp2p::core::SignedEnvelope::new(key, domain.into(), b"/shoal/ann/2".to_vec(), payload)
        .map(|e| e.into_protobuf_encoding())
}

#[test]
fn forged_announcement_for_another_peer_is_rejected() -> TestResult {
    // Peer B writes a record about peer A, under A's key, signed with its own key.
    let (_, a_id) = peer();
    let (b_key, _) = peer();
    let now = 1_000_000;
    let forged = ann(RUN, &a_id, now)?.signed(&b_key)?;
    let rkey = dht::announcement_key(&a_id);
    assert!(matches!(
        dht::validate(rkey.as_bytes(), &forged, now),
        Err(RecordError::Forged(_))
    ));
    assert!(matches!(
        Announcement::from_bytes(&forged, &a_id, now),
        Err(RecordError::Forged(_))
    ));
    Ok(())
}

#[test]
fn forged_announcement_with_a_tampered_field_is_rejected() -> TestResult {
    let (key, me) = peer();
    let now = 1_000_000;
    let a = ann(RUN, &me, now)?;
    let genuine = a.signed(&key)?;
    // Change a field inside the signed bytes (the throughput, same length): the signature
    // no longer verifies.
    let at = genuine
        .windows(5)
        .position(|w| w == b"120.5")
        .ok_or("the payload is not in the envelope")?;
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
    let other = signed_payload(&key, "other", a.to_bytes())?;
    assert!(matches!(
        Announcement::from_bytes(&other, &me, now),
        Err(RecordError::Forged(_))
    ));
    Ok(())
}

#[test]
fn forged_announcement_check_accepts_a_genuine_one() -> TestResult {
    let (key, me) = peer();
    let now = 1_000_000;
    let a = ann(RUN, &me, now)?;
    let bytes = a.signed(&key)?;
    assert!(dht::validate(dht::announcement_key(&me).as_bytes(), &bytes, now).is_ok());
    assert_eq!(Announcement::from_bytes(&bytes, &me, now), Ok(a));
    Ok(())
}

#[test]
fn announcements_validate_and_expire() -> TestResult {
    let (key, me) = peer();
    let now = 1_000_000;
    let a = ann(RUN, &me, now)?;
    let rkey = dht::announcement_key(&me);
    assert_eq!(
        super::parse_key(rkey.as_bytes()),
        Ok(super::KeyKind::Announcement(me.as_str()))
    );
    let bytes = a.signed(&key)?;
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
            Announcement::from_bytes(&b.signed(&key)?, &me, now).is_err(),
            "case {i} accepted"
        );
    }
    // The peer field names another peer than the key (signed by the key's peer).
    let mut other = a.clone();
    other.peer = peer().1;
    assert!(matches!(
        Announcement::from_bytes(&other.signed(&key)?, &me, now),
        Err(RecordError::Malformed(_))
    ));
    // Oversized, garbage, unknown fields, unknown keys.
    let mut big = a.clone();
    big.device = "x".repeat(9000);
    assert!(matches!(
        Announcement::from_bytes(&big.signed(&key)?, &me, now),
        Err(RecordError::TooLarge(_))
    ));
    assert!(Announcement::from_bytes(b"\x00\x01junk", &me, now).is_err());
    let extra = String::from_utf8(a.to_bytes())?.replacen('{', "{\"evil\":1,", 1);
    let extra = signed_payload(&key, "shoal-announcement", extra.into_bytes())?;
    assert!(matches!(
        Announcement::from_bytes(&extra, &me, now),
        Err(RecordError::Malformed(_))
    ));
    assert_eq!(
        dht::validate(b"/other/key", &bytes, now),
        Err(RecordError::UnknownKey)
    );
    assert!(super::is_provider_key(dht::stage_key(RUN, 3).as_bytes()));
    assert!(super::is_provider_key(dht::PEERS_KEY.as_bytes()));
    assert!(!super::is_provider_key(b"/shoal/stage/zz/1"));
    Ok(())
}

#[test]
fn an_info_answer_is_checked_as_a_copy_is_but_never_expires() -> TestResult {
    let (_, me) = peer();
    let (_, other) = peer();
    let now = 1_000_000;
    let a = ann(RUN, &me, now)?;
    // Long expired by its own clock: the peer just answered, so it is still what it says.
    assert_eq!(Announcement::from_info(&a.to_bytes(), &me), Ok(a.clone()));
    // Another peer's announcement relayed by this one, or a malformed one, is refused.
    assert!(Announcement::from_info(&a.to_bytes(), &other).is_err());
    let mut bad = a.clone();
    bad.stage = 7;
    assert!(Announcement::from_info(&bad.to_bytes(), &me).is_err());
    assert!(Announcement::from_info(b"{", &me).is_err());
    Ok(())
}
