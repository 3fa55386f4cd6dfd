//! `shoal bench codec`: encode+decode throughput, compression ratio and error per codec.
//!
//! Runs on one thread over a tensor drawn from N(0, 1), reusing the output buffers between
//! repetitions so the figures measure the codec, not the allocator's page faults.

use crate::rng::Rng;
use crate::wire::{self, CodecSpec, Limits};
use std::time::{Duration, Instant};

/// Knobs of the codec benchmark.
#[derive(Debug, Clone)]
pub struct CodecBenchConfig {
    /// Elements in the test tensor (default 16 Mi).
    pub elements: usize,
    /// Timed repetitions per codec; the fastest is reported.
    pub reps: usize,
    /// Codecs to measure.
    pub codecs: Vec<CodecSpec>,
    /// Seed of the N(0, 1) data.
    pub seed: u64,
}

impl Default for CodecBenchConfig {
    fn default() -> Self {
        let codecs = ["f32", "f16", "bf16", "int8", "int8+zstd1", "bf16+zstd1"]
            .iter()
            .filter_map(|s| s.parse().ok())
            .collect();
        Self {
            elements: 16 << 20,
            reps: 5,
            codecs,
            seed: 1,
        }
    }
}

/// One row of the table.
#[derive(Debug, Clone)]
pub struct CodecRow {
    /// Codec name.
    pub codec: String,
    /// Encode throughput in GB/s of f32 input.
    pub encode_gbps: f64,
    /// Decode throughput in GB/s of f32 output.
    pub decode_gbps: f64,
    /// Encode+decode throughput in GB/s of f32 input (bytes / (t_enc + t_dec)).
    pub roundtrip_gbps: f64,
    /// f32 bytes over frame bytes.
    pub ratio: f64,
    /// sqrt(Σ(x − x̂)² / Σx²).
    pub rel_rmse: f64,
}

/// Normal-distributed test data.
pub fn normal_data(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.normal() as f32).collect()
}

/// Relative RMSE of `got` against `want`.
pub fn rel_rmse(want: &[f32], got: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&a, &b) in want.iter().zip(got) {
        let d = (a - b) as f64;
        num += d * d;
        den += (a as f64) * (a as f64);
    }
    if den == 0.0 {
        return 0.0;
    }
    (num / den).sqrt()
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64().max(1e-12) / 1e9
}

/// Measures every codec in `cfg` and returns one row each, plus a memcpy reference row.
pub fn run(cfg: &CodecBenchConfig) -> Result<Vec<CodecRow>, wire::WireError> {
    let data = normal_data(cfg.elements, cfg.seed);
    let bytes = data.len() * 4;
    let shape = [data.len()];
    let limits = Limits {
        max_elements: data.len() as u64,
        max_bytes: u64::MAX,
    };
    let mut rows = Vec::new();
    let mut frame = Vec::new();
    let mut out = Vec::new();
    for spec in &cfg.codecs {
        let (mut best_enc, mut best_dec, mut best_rt) =
            (Duration::MAX, Duration::MAX, Duration::MAX);
        // One untimed pass warms the buffers (first-touch page faults are not the codec's).
        for rep in 0..=cfg.reps {
            frame.clear();
            let t0 = Instant::now();
            wire::encode_f32(&shape, &data, spec, &mut frame)?;
            let t1 = Instant::now();
            wire::decode_f32_into(&frame, &limits, &mut out)?;
            let t2 = Instant::now();
            if rep > 0 {
                best_enc = best_enc.min(t1 - t0);
                best_dec = best_dec.min(t2 - t1);
                best_rt = best_rt.min(t2 - t0);
            }
        }
        rows.push(CodecRow {
            codec: spec.to_string(),
            encode_gbps: gbps(bytes, best_enc),
            decode_gbps: gbps(bytes, best_dec),
            roundtrip_gbps: gbps(bytes, best_rt),
            ratio: bytes as f64 / frame.len() as f64,
            rel_rmse: rel_rmse(&data, &out),
        });
    }
    let mut copy = vec![0.0f32; data.len()];
    let mut best = Duration::MAX;
    for _ in 0..=cfg.reps {
        let t0 = Instant::now();
        copy.copy_from_slice(std::hint::black_box(&data));
        best = best.min(t0.elapsed());
    }
    std::hint::black_box(&copy);
    rows.push(CodecRow {
        codec: "memcpy (reference)".into(),
        encode_gbps: gbps(bytes, best),
        decode_gbps: gbps(bytes, best),
        roundtrip_gbps: gbps(bytes, 2 * best),
        ratio: 1.0,
        rel_rmse: 0.0,
    });
    Ok(rows)
}

/// The rows as a Markdown table.
pub fn table(rows: &[CodecRow]) -> String {
    let mut s = String::from(
        "| codec | encode GB/s | decode GB/s | encode+decode GB/s | ratio | rel. RMSE |\n\
         |---|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {:.2} | {:.2} | {:.2} | {:.3}x | {:.5} |\n",
            r.codec, r.encode_gbps, r.decode_gbps, r.roundtrip_gbps, r.ratio, r.rel_rmse
        ));
    }
    s
}
