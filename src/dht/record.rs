//! Typed DHT records: keys, the per-replica stage announcement, and validation on read.
//!
//! Keys (all UTF-8):
//! - `/shoal/run/<run id>`: the canonical manifest; valid when it hashes to the id.
//! - `/shoal/ann/<peer id>`: the announcement of the replica a peer serves (one per peer).
//! - provider key `/shoal/stage/<run id>/<stage>`: peers serving that stage provide it.
//! - provider key `/shoal/peers`: every serving peer provides it, so `shoal status` can list
//!   runs it was not told about.
//!
//! Every value is size-checked and parsed before it is trusted; the network task refuses to
//! store a record that does not validate, and readers validate again (a record may have
//! expired since).
//!
//! An announcement is stored signed: a libp2p signed envelope (RFC 0002) around its JSON,
//! made with the announcing peer's identity key. It is valid only when the signature
//! verifies and the signing key is the key of the peer named in the record's key, so no
//! peer can publish addresses, throughput or ban lists in another's name, and a changed
//! field breaks the signature ([`RecordError::Forged`]; the network task counts them).

use super::manifest::{is_run_id, Manifest};
use libp2p::core::SignedEnvelope;
use libp2p::identity::Keypair;
use serde::{Deserialize, Serialize};

/// Largest announcement value accepted.
pub const MAX_ANNOUNCEMENT: usize = 8 << 10;
/// Longest lifetime an announcement may claim.
pub const MAX_TTL_MS: u64 = 10 * 60 * 1000;
/// Most listen addresses an announcement may carry.
pub const MAX_ADDRS: usize = 32;
/// The announcement format version.
pub const ANN_VERSION: u8 = 2;
/// Domain separation string of announcement signatures.
const ANN_DOMAIN: &str = "shoal-announcement";
/// Payload type of a signed announcement.
const ANN_PAYLOAD_TYPE: &[u8] = b"/shoal/ann/2";
/// The provider key every serving peer provides.
pub const PEERS_KEY: &str = "/shoal/peers";

/// Why a record was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// The key is not one of ours.
    #[error("unknown record key")]
    UnknownKey,
    /// Over the size limit for its kind.
    #[error("record of {0} bytes is over its size limit")]
    TooLarge(usize),
    /// Does not parse, or parses to something inconsistent.
    #[error("malformed record: {0}")]
    Malformed(String),
    /// Past its expiry.
    #[error("record expired")]
    Expired,
    /// Not signed by the peer it is about, or changed since it was signed.
    #[error("forged record: {0}")]
    Forged(String),
}

/// What a replica says about itself, refreshed well before `expires_ms`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Announcement {
    /// Format version.
    pub v: u8,
    /// Run id.
    pub run: String,
    /// Peer id (base58) of the replica.
    pub peer: String,
    /// Multiaddrs it can be dialled on (with `/p2p/<peer>`).
    pub addrs: Vec<String>,
    /// Stage it serves.
    pub stage: u32,
    /// Stage count of the run (lets readers size tables without the manifest).
    pub stages: u32,
    /// Optimizer step it is at.
    pub step: u64,
    /// Samples per second of forward + backward, measured at start-up.
    pub samples_per_s: f64,
    /// Device the throughput was measured on, e.g. `cpu` or `cuda:0`.
    pub device: String,
    /// Requests waiting or running.
    pub queue: u32,
    /// Queue capacity.
    pub queue_cap: u32,
    /// Hash of its parameters (hex).
    pub params_hash: String,
    /// Unix ms when it was issued.
    pub issued_ms: u64,
    /// Unix ms after which readers ignore it.
    pub expires_ms: u64,
    /// Replicas of its stage it has banned from its rounds (bad gradients), with why; at
    /// most [`MAX_BANNED`]. Trainers avoid a replica that half its stage mates banned.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub banned: Vec<BanNote>,
    /// Its measured uplink for averaging parts, bytes/s (0 or absent: not measured yet).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub uplink: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// A banned replica as an announcement names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BanNote {
    /// Its peer id.
    pub peer: String,
    /// Why (at most 120 bytes).
    pub reason: String,
}

/// Banned replicas an announcement names at most.
pub const MAX_BANNED: usize = 8;

impl Announcement {
    /// An announcement of `peer` serving `stage` of a 2-stage run at 10 samples/s, for
    /// unit tests of the choices made over announcements.
    #[cfg(test)]
    pub(crate) fn for_tests(peer: &str, stage: u32) -> Self {
        Self {
            v: ANN_VERSION,
            run: "ab".repeat(16),
            peer: peer.into(),
            addrs: Vec::new(),
            stage,
            stages: 2,
            step: 4,
            samples_per_s: 10.0,
            device: "cpu".into(),
            queue: 0,
            queue_cap: 8,
            params_hash: "00".into(),
            issued_ms: 0,
            expires_ms: 1,
            banned: Vec::new(),
            uplink: 0,
        }
    }

    /// Its JSON text (what `info` calls answer, and the payload signed for the DHT).
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// The value stored in the DHT: its JSON in an envelope signed with `key`, which must be
    /// the identity key of the peer it announces.
    pub fn signed(&self, key: &Keypair) -> Result<Vec<u8>, RecordError> {
        SignedEnvelope::new(
            key,
            ANN_DOMAIN.to_string(),
            ANN_PAYLOAD_TYPE.to_vec(),
            self.to_bytes(),
        )
        .map(SignedEnvelope::into_protobuf_encoding)
        .map_err(|e| RecordError::Malformed(format!("cannot sign the announcement: {e}")))
    }

    /// Parses and validates an announcement stored under `/shoal/ann/<key_peer>`: the
    /// envelope's signature verifies, its signer is `key_peer`, and its JSON is well formed.
    pub fn from_bytes(bytes: &[u8], key_peer: &str, now_ms: u64) -> Result<Self, RecordError> {
        if bytes.len() > MAX_ANNOUNCEMENT {
            return Err(RecordError::TooLarge(bytes.len()));
        }
        let envelope = SignedEnvelope::from_protobuf_encoding(bytes)
            .map_err(|e| RecordError::Forged(format!("not a signed envelope ({e})")))?;
        let (payload, signer) = envelope
            .payload_and_signing_key(ANN_DOMAIN.to_string(), ANN_PAYLOAD_TYPE)
            .map_err(|e| RecordError::Forged(e.to_string()))?;
        let signer = signer.to_peer_id().to_string();
        if signer != key_peer {
            return Err(RecordError::Forged(format!(
                "signed by {signer}, not by the peer it announces"
            )));
        }
        let a = Self::from_info(payload, key_peer)?;
        if a.expires_ms <= now_ms {
            return Err(RecordError::Expired);
        }
        Ok(a)
    }

    /// Parses the announcement `peer` sent itself in an `info` answer (plain JSON: the
    /// connection it came over authenticated the peer, so no signature), checked as a
    /// DHT copy is except for its expiry (the peer just answered).
    pub fn from_info(json: &[u8], peer: &str) -> Result<Self, RecordError> {
        if json.len() > MAX_ANNOUNCEMENT {
            return Err(RecordError::TooLarge(json.len()));
        }
        let a: Self =
            serde_json::from_slice(json).map_err(|e| RecordError::Malformed(e.to_string()))?;
        a.check(peer)?;
        Ok(a)
    }

    fn check(&self, key_peer: &str) -> Result<(), RecordError> {
        let bad = |m: &str| Err(RecordError::Malformed(m.to_string()));
        if self.v != ANN_VERSION {
            return bad("unsupported announcement version");
        }
        if self.peer != key_peer {
            return bad("announcement peer differs from its key");
        }
        if !is_run_id(&self.run) {
            return bad("announcement run is not a run id");
        }
        if self.stages == 0 || self.stage >= self.stages || self.stages > 1024 {
            return bad("announcement stage out of range");
        }
        if !self.samples_per_s.is_finite() || self.samples_per_s < 0.0 {
            return bad("announcement throughput is not a finite non-negative number");
        }
        if self.addrs.len() > MAX_ADDRS || self.addrs.iter().any(|a| a.len() > 512) {
            return bad("announcement carries too many or too long addresses");
        }
        if self.device.len() > 64 || self.params_hash.len() > 64 {
            return bad("announcement device or hash too long");
        }
        if self.banned.len() > MAX_BANNED
            || self
                .banned
                .iter()
                .any(|b| b.peer.len() > 64 || b.reason.len() > 120)
        {
            return bad("announcement names too many banned peers, or too long");
        }
        if self.expires_ms < self.issued_ms || self.expires_ms - self.issued_ms > MAX_TTL_MS {
            return bad("announcement lifetime is negative or over 10 minutes");
        }
        Ok(())
    }
}

/// The key of a run's manifest.
pub fn manifest_key(run: &str) -> String {
    format!("/shoal/run/{run}")
}

/// The key of a peer's announcement.
pub fn announcement_key(peer: &str) -> String {
    format!("/shoal/ann/{peer}")
}

/// The provider key of a stage of a run.
pub fn stage_key(run: &str, stage: usize) -> String {
    format!("/shoal/stage/{run}/{stage}")
}

/// What a record key names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyKind<'a> {
    /// A manifest, with its run id.
    Manifest(&'a str),
    /// An announcement, with its peer id.
    Announcement(&'a str),
}

/// Classifies a record key.
pub fn parse_key(key: &[u8]) -> Result<KeyKind<'_>, RecordError> {
    let s = std::str::from_utf8(key).map_err(|_| RecordError::UnknownKey)?;
    if let Some(run) = s.strip_prefix("/shoal/run/") {
        return if is_run_id(run) {
            Ok(KeyKind::Manifest(run))
        } else {
            Err(RecordError::UnknownKey)
        };
    }
    if let Some(peer) = s.strip_prefix("/shoal/ann/") {
        return if !peer.is_empty()
            && peer.len() <= 128
            && peer.bytes().all(|b| b.is_ascii_alphanumeric())
        {
            Ok(KeyKind::Announcement(peer))
        } else {
            Err(RecordError::UnknownKey)
        };
    }
    Err(RecordError::UnknownKey)
}

/// Whether a provider key is one of ours.
pub fn is_provider_key(key: &[u8]) -> bool {
    let Ok(s) = std::str::from_utf8(key) else {
        return false;
    };
    if s == PEERS_KEY {
        return true;
    }
    let Some(rest) = s.strip_prefix("/shoal/stage/") else {
        return false;
    };
    match rest.split_once('/') {
        Some((run, stage)) => is_run_id(run) && stage.parse::<u16>().is_ok(),
        None => false,
    }
}

/// Validates a record before it is stored or used.
pub fn validate(key: &[u8], value: &[u8], now_ms: u64) -> Result<(), RecordError> {
    match parse_key(key)? {
        KeyKind::Manifest(run) => Manifest::from_fetched(value, run)
            .map(|_| ())
            .map_err(|e| RecordError::Malformed(e.to_string())),
        KeyKind::Announcement(peer) => Announcement::from_bytes(value, peer, now_ms).map(|_| ()),
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
#[path = "record_tests.rs"]
mod tests;
