//! What peers tell each other through the DHT: run manifests and stage announcements.
//!
//! Pure types with validation ([`manifest`], [`record`]); no sockets. The network task
//! (`net`) stores and fetches the bytes and calls [`record::validate`] on everything it is
//! asked to store; readers validate again, since records expire.

pub mod manifest;
pub mod record;

pub use manifest::{is_run_id, run_id, Manifest, ManifestError};
pub use record::{
    announcement_key, manifest_key, now_ms, stage_key, validate, Announcement, RecordError,
    PEERS_KEY,
};
