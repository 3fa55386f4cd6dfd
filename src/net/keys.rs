//! Key files: the peer's ed25519 identity and the swarm's pre-shared key.
//!
//! Both are secrets: they are created with mode 0600, written atomically (temp file, fsync,
//! rename), and a file that does not parse is an error, never silently replaced.

use super::NetError;
use libp2p::identity::Keypair;
use libp2p::pnet::PreSharedKey;
use std::path::Path;

/// Writes a secret atomically with mode 0600.
fn write_secret(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    crate::files::write_atomic_mode(path, bytes, Some(0o600))
}

/// Loads the identity at `path`, creating a fresh ed25519 key there if the file is missing.
/// Returns the key and whether it was created.
pub fn load_or_create_identity(path: &Path) -> Result<(Keypair, bool), NetError> {
    match std::fs::read(path) {
        Ok(bytes) => {
            let kp = Keypair::from_protobuf_encoding(&bytes).map_err(|e| {
                NetError::Key(format!(
                    "{} is not a shoal identity key ({e}); move it away to create a new one",
                    path.display()
                ))
            })?;
            Ok((kp, false))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let kp = Keypair::generate_ed25519();
            let bytes = kp
                .to_protobuf_encoding()
                .map_err(|e| NetError::Key(format!("cannot encode a new identity: {e}")))?;
            write_secret(path, &bytes).map_err(|e| {
                NetError::Key(format!("cannot write identity {}: {e}", path.display()))
            })?;
            Ok((kp, true))
        }
        Err(e) => Err(NetError::Key(format!(
            "cannot read identity {}: {e}",
            path.display()
        ))),
    }
}

/// A fresh random swarm key.
pub fn new_swarm_key() -> Result<PreSharedKey, NetError> {
    let mut bytes = [0u8; 32];
    getrandom::getrandom(&mut bytes)
        .map_err(|e| NetError::Key(format!("no OS randomness for a swarm key: {e}")))?;
    Ok(PreSharedKey::new(bytes))
}

/// Writes a swarm key in the standard libp2p key-file format (`/key/swarm/psk/1.0.0/`).
/// Refuses to overwrite an existing file.
pub fn write_swarm_key(path: &Path, key: PreSharedKey) -> Result<(), NetError> {
    if path.exists() {
        return Err(NetError::Key(format!(
            "{} already exists; remove it or choose another --out",
            path.display()
        )));
    }
    let text = format!("{}\n", key.to_key_file());
    write_secret(path, text.as_bytes())
        .map_err(|e| NetError::Key(format!("cannot write swarm key {}: {e}", path.display())))
}

/// Reads a swarm key file.
pub fn read_swarm_key(path: &Path) -> Result<PreSharedKey, NetError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| NetError::Key(format!("cannot read swarm key {}: {e}", path.display())))?;
    text.trim().parse::<PreSharedKey>().map_err(|e| {
        NetError::Key(format!(
            "{} is not a libp2p swarm key ({e}); make one with `shoal swarm key --out FILE`",
            path.display()
        ))
    })
}
