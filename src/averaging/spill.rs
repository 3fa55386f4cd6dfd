//! A donor's snapshot of its state, written to a temporary file instead of held in memory:
//! a joiner's download takes minutes on a home link while the donor keeps training, so the
//! donor must keep serving one consistent step without a second copy of a state that may
//! be as large as its memory. The file is written tensor by tensor while the replica is
//! locked (one step, consistent), hashed chunk by chunk on the way, and unlinked at once:
//! the kernel frees it when the snapshot is dropped or the process dies, so nothing is left
//! on disk. Chunks are read back with positioned reads (no mapping, so they never count
//! as the process's resident memory).

use super::sync::{chunk_hash, root_hash};
use crate::stage::replica::{Replica, Snapshot};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Why a snapshot could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum SpillError {
    /// The temporary file.
    #[error("state snapshot file in {dir}: {source} (set TMPDIR to a disk with room for the stage's state)")]
    Io {
        /// Where it was written.
        dir: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Reading the replica's tensors.
    #[error("state snapshot: {0}")]
    Model(#[from] crate::model::ModelError),
}

/// A snapshot of one step's state in an unlinked temporary file.
#[derive(Debug)]
pub struct Spill {
    file: File,
    dir: PathBuf,
    /// Floats in the state.
    len: usize,
    /// Hashes of its chunks, in order.
    hashes: Vec<String>,
    /// Step, parameter hash and sample counts (`flat` empty).
    meta: Snapshot,
}

/// Buffers floats into chunks of `chunk`, hashing and writing each full one.
struct ChunkWriter<'a> {
    file: &'a File,
    chunk: usize,
    buf: Vec<f32>,
    hashes: Vec<String>,
    len: usize,
}

impl ChunkWriter<'_> {
    fn push(&mut self, mut values: &[f32]) -> std::io::Result<()> {
        while !values.is_empty() {
            let take = (self.chunk - self.buf.len()).min(values.len());
            self.buf.extend_from_slice(&values[..take]);
            values = &values[take..];
            if self.buf.len() == self.chunk {
                self.flush()?;
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        self.hashes.push(chunk_hash(&self.buf));
        let mut f = self.file;
        f.write_all(bytemuck::cast_slice(&self.buf))?;
        self.len += self.buf.len();
        self.buf.clear();
        Ok(())
    }
}

/// A new file in `dir`, open for reading and writing and already unlinked: it lives until
/// it is dropped and never outlives the process. `what` goes into its (short-lived) name.
pub fn unlinked_file(dir: &Path, what: &str) -> std::io::Result<File> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let path = dir.join(format!(
        "shoal-{what}-{}-{nanos}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)?;
    std::fs::remove_file(&path)?;
    Ok(file)
}

impl Spill {
    /// Writes `replica`'s state into a new unlinked file in `dir`, in chunks of `chunk`
    /// floats. The caller holds the replica's lock (the state is one step's).
    pub fn write(replica: &Replica, chunk: usize, dir: &Path) -> Result<Self, SpillError> {
        let io = |source| SpillError::Io {
            dir: dir.to_path_buf(),
            source,
        };
        let file = unlinked_file(dir, "state").map_err(io)?;
        let chunk = chunk.max(1);
        let mut w = ChunkWriter {
            file: &file,
            chunk,
            buf: Vec::with_capacity(chunk),
            hashes: Vec::new(),
            len: 0,
        };
        let meta = replica.write_state(&mut |v| w.push(v))?;
        w.flush().map_err(io)?;
        let (hashes, len) = (w.hashes, w.len);
        Ok(Self {
            file,
            dir: dir.to_path_buf(),
            len,
            hashes,
            meta,
        })
    }

    /// Floats in the state.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the state is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The chunks' hashes, in order.
    pub fn hashes(&self) -> &[String] {
        &self.hashes
    }

    /// The hash of the whole state.
    pub fn root(&self) -> String {
        root_hash(&self.hashes)
    }

    /// Step, parameter hash and sample counts.
    pub fn meta(&self) -> &Snapshot {
        &self.meta
    }

    /// Floats `start..end` of the state.
    pub fn read(&self, start: usize, end: usize) -> Result<Vec<f32>, SpillError> {
        let end = end.min(self.len);
        let mut out = vec![0f32; end.saturating_sub(start)];
        self.file
            .read_exact_at(bytemuck::cast_slice_mut(&mut out), start as u64 * 4)
            .map_err(|source| SpillError::Io {
                dir: self.dir.clone(),
                source,
            })?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RunConfig;
    use crate::model::Stage;

    #[test]
    fn a_spilled_state_reads_back_as_the_snapshot_and_leaves_no_file() {
        let cfg = RunConfig::tiny();
        let stage = Stage::new(&cfg, 0, &candle_core::Device::Cpu).unwrap();
        let replica = Replica::new(&cfg, stage).unwrap();
        let snap = replica.snapshot().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let chunk = 1000;
        let spill = Spill::write(&replica, chunk, dir.path()).unwrap();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        assert_eq!(spill.len(), snap.flat.len());
        assert_eq!(spill.meta().params_hash, snap.params_hash);
        let hashes: Vec<String> = snap.flat.chunks(chunk).map(chunk_hash).collect();
        assert_eq!(spill.hashes(), hashes.as_slice());
        assert_eq!(spill.root(), root_hash(&hashes));
        assert_eq!(spill.read(0, spill.len()).unwrap(), snap.flat);
        assert_eq!(spill.read(1500, 2500).unwrap(), snap.flat[1500..2500]);
        // A read past the end is cut at the end.
        let n = spill.len();
        assert_eq!(spill.read(n - 3, n + 10).unwrap(), snap.flat[n - 3..]);
    }
}
