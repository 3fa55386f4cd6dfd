//! The run manifest: the canonical TOML of a run config, and the run id that hashes it.
//!
//! Canonical means: parsed, validated, with every default and every derived value written
//! out (stage cuts, target batch size), serialised by one serializer in field order. Two
//! configs that mean the same run have the same canonical bytes and so the same id; any
//! change to what a run means changes its id, so nobody can alter a run under its id.

use crate::config::{ConfigError, RunConfig};
use sha2::{Digest, Sha256};
use std::path::Path;

/// Hex digits of a run id (128 bits of SHA-256).
pub const RUN_ID_HEX: usize = 32;

/// Largest manifest accepted from a file or the DHT.
pub const MAX_MANIFEST: usize = 32 << 10;

/// Why a manifest was refused.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// The config inside is not valid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The bytes do not hash to the id they were fetched under.
    #[error("run manifest hashes to {got}, not to the requested run id {want}")]
    IdMismatch {
        /// The id asked for.
        want: String,
        /// The id of the bytes received.
        got: String,
    },
    /// Over [`MAX_MANIFEST`] or not UTF-8.
    #[error("run manifest is not a UTF-8 TOML file of at most {MAX_MANIFEST} bytes")]
    Malformed,
    /// A string that is not a run id.
    #[error("{0:?} is not a run id (32 hex digits) or a readable manifest file")]
    BadId(String),
}

/// A run: its config, the canonical bytes, and the id.
#[derive(Debug, Clone, PartialEq)]
pub struct Manifest {
    /// The run config, with derived values filled in.
    pub config: RunConfig,
    /// Canonical TOML.
    pub canonical: String,
    /// Hex run id.
    pub id: String,
}

impl Manifest {
    /// The manifest of a validated config.
    pub fn from_config(config: &RunConfig) -> Result<Self, ManifestError> {
        let mut c = config.clone();
        c.validate()?;
        let ranges = c.stage_ranges();
        c.stages.cuts = ranges.iter().skip(1).map(|r| r.0).collect();
        c.training.target_batch_size = Some(c.target_batch_size());
        let canonical = toml::to_string(&c)
            .map_err(|e| ConfigError::Invalid(format!("cannot serialise the run config: {e}")))?;
        // Round-trip once: what peers parse from the canonical text must be what we hash.
        let reparsed = RunConfig::from_toml(&canonical, "canonical manifest")?;
        let id = run_id(canonical.as_bytes());
        Ok(Self {
            config: reparsed,
            canonical,
            id,
        })
    }

    /// Parses manifest (or plain config) bytes and canonicalises them.
    pub fn from_bytes(bytes: &[u8], origin: &str) -> Result<Self, ManifestError> {
        if bytes.len() > MAX_MANIFEST {
            return Err(ManifestError::Malformed);
        }
        let text = std::str::from_utf8(bytes).map_err(|_| ManifestError::Malformed)?;
        Self::from_config(&RunConfig::from_toml(text, origin)?)
    }

    /// Parses bytes fetched under `want` and checks that they hash to it.
    pub fn from_fetched(bytes: &[u8], want: &str) -> Result<Self, ManifestError> {
        let got = run_id(bytes);
        if got != want {
            return Err(ManifestError::IdMismatch {
                want: want.to_string(),
                got,
            });
        }
        let m = Self::from_bytes(bytes, &format!("run {want}"))?;
        if m.id != want {
            return Err(ManifestError::IdMismatch {
                want: want.to_string(),
                got: m.id,
            });
        }
        Ok(m)
    }

    /// Reads a manifest or config file.
    pub fn load(path: &Path) -> Result<Self, ManifestError> {
        Self::from_config(&RunConfig::load(path)?)
    }

    /// The file a user keeps: a comment naming the id, then the canonical TOML. The comment
    /// is not part of the hash; readers re-canonicalise.
    pub fn file_text(&self) -> String {
        format!(
            "# shoal run manifest; run id {} (SHA-256 of the canonical TOML below)\n{}",
            self.id, self.canonical
        )
    }
}

/// The run id of canonical manifest bytes: the first 128 bits of SHA-256, as hex.
pub fn run_id(canonical: &[u8]) -> String {
    let digest = Sha256::digest(canonical);
    digest[..RUN_ID_HEX / 2]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Whether `s` has the form of a run id.
pub fn is_run_id(s: &str) -> bool {
    s.len() == RUN_ID_HEX
        && s.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}
