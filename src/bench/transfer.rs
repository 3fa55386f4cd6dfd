//! `shoal bench transfer`: one tensor frame between two real peers over loopback.
//!
//! Two libp2p nodes in this process, connected over TCP (noise, yamux) or QUIC on
//! 127.0.0.1. Each repetition encodes the tensor with the codec, opens a stream, sends the
//! length-prefixed frame, and the receiver reads it (with the size check), decodes it and
//! answers one byte. The time covers all of that, so it is what a stage call pays for the
//! tensor, minus compute.

use super::{bench_node, first_addr};
use crate::bench::codec::normal_data;
use crate::net::{io as netio, NetError};
use crate::wire::{self, CodecSpec, Limits};
use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use libp2p::StreamProtocol;
use std::time::Instant;

const PROTOCOL: StreamProtocol = StreamProtocol::new("/shoal/bench/transfer/1.0.0");

/// Knobs of the transfer benchmark.
#[derive(Debug, Clone)]
pub struct TransferBenchConfig {
    /// Tensor size in MiB of f32 (default 32).
    pub mib: usize,
    /// Timed repetitions (the median is reported, the best too).
    pub reps: usize,
    /// Codecs to send the tensor with.
    pub codecs: Vec<CodecSpec>,
    /// Use QUIC instead of TCP.
    pub quic: bool,
}

impl Default for TransferBenchConfig {
    fn default() -> Self {
        Self {
            mib: 32,
            reps: 5,
            codecs: vec![CodecSpec::F32, CodecSpec::INT8],
            quic: false,
        }
    }
}

/// One row of the table.
#[derive(Debug, Clone)]
pub struct TransferRow {
    /// The codec.
    pub codec: CodecSpec,
    /// Bytes on the wire per transfer.
    pub wire_bytes: usize,
    /// Median seconds per transfer (encode, send, receive, decode, ack).
    pub median_s: f64,
    /// Fastest.
    pub best_s: f64,
}

impl TransferRow {
    /// Tensor (f32) MB/s at the median.
    pub fn tensor_mb_s(&self, mib: usize) -> f64 {
        (mib << 20) as f64 / self.median_s / 1e6
    }
}

/// Runs the benchmark on the current tokio runtime.
pub async fn run(cfg: &TransferBenchConfig) -> Result<Vec<TransferRow>, NetError> {
    let listen = if cfg.quic {
        "/ip4/127.0.0.1/udp/0/quic-v1"
    } else {
        "/ip4/127.0.0.1/tcp/0"
    };
    let rx = bench_node(Some(listen), None)?;
    let tx = bench_node(None, None)?;
    let addr = first_addr(&rx, "the receiver").await?;
    let mut incoming = rx.accept(PROTOCOL)?;
    let server = tokio::spawn(async move {
        let limits = Limits::default();
        while let Some((_, mut s)) = incoming.next().await {
            let Ok(frame) = netio::read_frame(&mut s, &limits).await else {
                continue;
            };
            let ok = wire::decode(&frame, &limits).is_ok();
            let _ = s.write_all(&[u8::from(ok)]).await;
            let _ = s.close().await;
        }
    });
    let peer = tx.dial(addr).await?;
    let data = normal_data((cfg.mib << 20) / 4, 7);
    let shape = [data.len()];
    let mut rows = Vec::new();
    for spec in &cfg.codecs {
        let mut times = Vec::new();
        let mut wire_bytes = 0;
        // One untimed warm-up, then the timed repetitions.
        for rep in 0..=cfg.reps.max(1) {
            let t0 = Instant::now();
            let mut frame = Vec::new();
            wire::encode_f32(&shape, &data, spec, &mut frame)
                .map_err(|e| NetError::Invalid(e.to_string()))?;
            wire_bytes = frame.len();
            let mut s = tx.open_stream(peer, PROTOCOL).await?;
            let io = |e: std::io::Error| NetError::Stream {
                peer: peer.to_string(),
                cause: e.to_string(),
            };
            s.write_all(&(frame.len() as u64).to_le_bytes())
                .await
                .map_err(io)?;
            s.write_all(&frame).await.map_err(io)?;
            s.flush().await.map_err(io)?;
            let mut ack = [0u8; 1];
            s.read_exact(&mut ack).await.map_err(io)?;
            if ack[0] != 1 {
                return Err(NetError::Invalid(
                    "the receiver could not decode the frame".into(),
                ));
            }
            if rep > 0 {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        rows.push(TransferRow {
            codec: *spec,
            wire_bytes,
            median_s: times[times.len() / 2],
            best_s: times[0],
        });
    }
    server.abort();
    tx.shutdown().await;
    rx.shutdown().await;
    Ok(rows)
}

/// The printed table.
pub fn table(cfg: &TransferBenchConfig, rows: &[TransferRow]) -> String {
    let mut out = format!(
        "{:<12} {:>12} {:>11} {:>10} {:>14} {:>13}\n",
        "codec", "wire MiB", "median ms", "best ms", "tensor MB/s", "wire MB/s"
    );
    for r in rows {
        out.push_str(&format!(
            "{:<12} {:>12.2} {:>11.1} {:>10.1} {:>14.0} {:>13.0}\n",
            r.codec.to_string(),
            r.wire_bytes as f64 / (1 << 20) as f64,
            r.median_s * 1e3,
            r.best_s * 1e3,
            r.tensor_mb_s(cfg.mib),
            r.wire_bytes as f64 / r.median_s / 1e6
        ));
    }
    out
}
