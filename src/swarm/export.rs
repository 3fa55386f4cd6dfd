//! `shoal export --run ID --bootstrap ADDR`: the current state of every stage, downloaded
//! from a live swarm (the state download joiners use: chunked, hash-checked, from every
//! replica at the newest step), into one model file.
//!
//! One stage at a time: its state is downloaded, checked against the parameter hash the
//! replicas announce, and written as a stage checkpoint beside the output; the checkpoints
//! are then collected by [`crate::model::export::from_checkpoints`] and removed, so the
//! export never holds more than one stage and leaves nothing behind when it fails.

use super::peer::PeerError;
use super::serving::peers_of;
use crate::averaging::sync;
use crate::dht::Manifest;
use crate::model::export::{self, Exported};
use crate::model::Stage;
use crate::net::NetHandle;
use crate::stage::client::StageClient;
use crate::stage::registry::{self, RegistryError};
use crate::stage::replica::Replica;
use candle_core::Device;
use libp2p::Multiaddr;
use std::path::{Path, PathBuf};

/// Removes the scratch checkpoints when dropped (an export that fails leaves nothing).
struct Scratch(Vec<PathBuf>);

impl Drop for Scratch {
    fn drop(&mut self) {
        for p in &self.0 {
            // Best effort: a file that cannot be removed is a hidden `.part` beside the
            // output, never mistaken for a model.
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The scratch checkpoint of stage `s` beside `out` (same file system, so the export's
/// disk is the one the user chose).
fn scratch_path(out: &Path, s: usize) -> PathBuf {
    let name = out
        .file_name()
        .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
    out.with_file_name(format!(".{name}.stage{s}.part"))
}

/// Downloads every stage of run `m` from the replicas serving it and writes `out`.
/// `fetched` counts the stage being downloaded as it goes; `progress` hears about each
/// stage as it is done (stage, step, MB downloaded).
pub async fn from_swarm(
    net: &NetHandle,
    m: &Manifest,
    out: &Path,
    fetched: &sync::Fetched,
    mut progress: impl FnMut(usize, u64, f64),
) -> Result<Exported, PeerError> {
    let cfg = &m.config;
    let count = cfg.stages.count;
    let per_stage = registry::read_run(net, &m.id, count)
        .await
        .map_err(RegistryError::from)?;
    if let Some(s) = per_stage.iter().position(Vec::is_empty) {
        return Err(PeerError::Invalid(format!(
            "stage {s} of run {} has no live replica to export from; start a peer with --stage {s} (or --resume its checkpoint)",
            m.id
        )));
    }
    let client = StageClient::new(net.clone(), m.id.clone(), cfg.codecs.activations.wire());
    let mut rng = crate::rng::Rng::new(crate::rng::derive_seed(
        crate::dht::now_ms(),
        &net.local_peer_id().to_string(),
    ));
    let mut scratch = Scratch(Vec::with_capacity(count));
    for (s, anns) in per_stage.iter().enumerate() {
        for a in anns {
            if let Ok(peer) = a.peer.parse() {
                let addrs: Vec<Multiaddr> = a.addrs.iter().filter_map(|x| x.parse().ok()).collect();
                net.add_addresses(peer, addrs)
                    .await
                    .map_err(RegistryError::from)?;
            }
        }
        let stage = Stage::new(cfg, s, &Device::Cpu)?;
        let mut replica = Replica::new(cfg, stage)?;
        let len = replica.snapshot_len();
        let (snap, parts, _) =
            sync::download(&client, s, &peers_of(anns), len, &mut rng, Some(fetched)).await?;
        // Checks the parameters against the hash the donors announced.
        replica.restore_parts(&snap, parts)?;
        let path = scratch_path(out, s);
        scratch.0.push(path.clone());
        let (replica, run, config) = (replica, m.id.clone(), m.canonical.clone());
        let info = tokio::task::spawn_blocking(move || replica.save(&path, &run, &config))
            .await
            .map_err(|e| PeerError::Invalid(format!("checkpoint task failed: {e}")))??;
        progress(s, info.step, len as f64 * 4.0 / 1e6);
    }
    let paths = scratch.0.clone();
    let out = out.to_path_buf();
    let exported = tokio::task::spawn_blocking(move || export::from_checkpoints(&paths, &out))
        .await
        .map_err(|e| PeerError::Invalid(format!("export task failed: {e}")))??;
    drop(scratch);
    Ok(exported)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_files_sit_hidden_beside_the_output() {
        let p = scratch_path(Path::new("/tmp/x/model.safetensors"), 2);
        assert_eq!(p, Path::new("/tmp/x/.model.safetensors.stage2.part"));
        let dir = std::env::temp_dir().join(format!("shoal-scratch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("a.part");
        std::fs::write(&f, b"x").unwrap();
        drop(Scratch(vec![f.clone(), dir.join("never-written")]));
        assert!(!f.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
