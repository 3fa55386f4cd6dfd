//! Fuzzing that runs on the stable toolchain, and property tests of every message header.
//!
//! Three targets (`fuzz/targets.rs`, shared with the libFuzzer crate in `fuzz/`) are fuzzed
//! by blind mutation (no coverage feedback: bit flips, byte stores, truncation, insertion,
//! splicing, and interesting values written over 4- and 8-byte fields) of valid seeds,
//! each input under `catch_unwind`:
//! - `frame`: the tensor frame decoder;
//! - `request`: a replica reading a request off a stream (header, the checks on each
//!   frame's header before its payload, the frames' decoding, the averaging message);
//! - `chunk`: a joiner reading a state chunk's response and hashing the chunk.
//!
//! Each runs `SHOAL_FUZZ_SECS` seconds (default 3; `scripts/fuzz.sh` runs longer and
//! reports the executions). A panic is a failure, with the input saved under
//! `target/fuzz-crashes/`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests and benches fail by panicking"
)]

#[path = "../fuzz/targets.rs"]
mod targets;

use shoal::config::RunConfig;
use shoal::rng::Rng;
use shoal::wire::msg::{
    self, AvgMsg, Call, ChunkReq, ErrorKind, Op, Request, Response, StateInfo, UpdateInfo,
    MSG_VERSION,
};
use shoal::wire::{self, CodecSpec};
use std::time::{Duration, Instant};

fn frame_f32(shape: &[usize], codec: &str) -> Vec<u8> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut out = Vec::new();
    wire::encode_f32(shape, &v, &codec.parse::<CodecSpec>().unwrap(), &mut out).unwrap();
    out
}

fn frame_u32(shape: &[usize]) -> Vec<u8> {
    let n: usize = shape.iter().product();
    let v: Vec<u32> = (0..n as u32).map(|i| i % 16).collect();
    let mut out = Vec::new();
    wire::encode_u32(shape, &v, 0, &mut out).unwrap();
    out
}

/// A message as it travels: length-prefixed JSON header, then length-prefixed frames.
fn message<T: serde::Serialize>(header: &T, frames: &[Vec<u8>]) -> Vec<u8> {
    let mut out = msg::encode_header(header);
    for f in frames {
        out.extend_from_slice(&(f.len() as u64).to_le_bytes());
        out.extend_from_slice(f);
    }
    out
}

fn request(call: Call, tensors: u8) -> Request {
    Request {
        v: MSG_VERSION,
        run: "ab".repeat(16),
        stage: 1,
        step: 3,
        tensors,
        call,
    }
}

fn forward() -> Call {
    Call::Forward {
        mb: 7,
        dry: false,
        push_to: None,
        pushed: false,
        sync: false,
    }
}

fn backward() -> Call {
    Call::Backward {
        mb: 7,
        dry: false,
        pushed: false,
        sync: false,
    }
}

fn avg_msgs() -> Vec<AvgMsg> {
    vec![
        AvgMsg::Leave { pending: 5 },
        AvgMsg::Progress {
            params_step: 4,
            accum_step: 5,
            count: 16,
            frozen: 0,
            hash: "00ff".into(),
            uplink: 1000,
            owed: 0,
            lost: 3,
            ahead: 1,
        },
        AvgMsg::Mates {
            peers: vec!["a".into(), "b".into()],
            addrs: vec![vec!["/memory/7".into()], Vec::new()],
        },
        AvgMsg::Members {
            step: 4,
            attempt: 9,
            members: vec!["a".into(), "b".into()],
            quotas: vec![16, 16],
            lost: 0,
        },
        AvgMsg::Part {
            step: 4,
            attempt: 9,
            count: 16,
            chunk: 2,
        },
        AvgMsg::Reduced {
            step: 4,
            attempt: 9,
            index: 1,
            total: 32,
            chunk: 2,
        },
    ]
}

fn requests() -> Vec<Request> {
    let mut out = vec![
        request(forward(), 1),
        request(backward(), 2),
        request(Call::Info {}, 0),
        request(Call::Push { mb: 7 }, 1),
        request(Call::StateInfo {}, 0),
    ];
    for avg in avg_msgs() {
        let tensors = u8::from(matches!(avg, AvgMsg::Part { .. }));
        out.push(request(Call::Avg { avg }, tensors));
    }
    let chunk = ChunkReq { step: 4, index: 3 };
    for call in [
        Call::StateChunk { chunk },
        Call::StateHashes { chunk },
        Call::StateUpdate { chunk },
    ] {
        out.push(request(call, 0));
    }
    out
}

fn responses() -> Vec<Response> {
    let mut ok = Response::ok(4, 1, 1);
    ok.loss = Some(2.5);
    let mut state = Response::ok(4, 0, 0);
    state.state = Some(StateInfo {
        step: 4,
        len: 100,
        chunk: 10,
        chunks: 10,
        root: "r".into(),
        params_hash: "p".into(),
        samples_applied: 64,
        samples_lost: 0,
    });
    state.hashes = Some(vec!["h1".into(), "h2".into()]);
    let mut update = Response::ok(4, 0, 1);
    update.update = Some(UpdateInfo {
        step: 3,
        total: 64,
        lost: 0,
        hash: "x".into(),
        chunks: 2,
        start: 0,
        end: 10,
        members: vec!["12D3KooWPeer".into()],
    });
    update.info = Some("{}".into());
    vec![
        ok,
        state,
        update,
        Response::err(ErrorKind::StaleStep, "behind", 4, 2),
    ]
}

const INTERESTING: [u64; 9] = [
    0,
    1,
    7,
    255,
    65_535,
    u32::MAX as u64,
    1 << 40,
    u64::MAX,
    u64::MAX / 2,
];

fn mutate(rng: &mut Rng, seeds: &[Vec<u8>], input: &mut Vec<u8>) {
    let rounds = 1 + rng.below(4);
    for _ in 0..rounds {
        let len = input.len().max(1) as u64;
        match rng.below(8) {
            0 if !input.is_empty() => {
                let i = rng.below(len) as usize;
                input[i] ^= 1 << rng.below(8);
            }
            1 if !input.is_empty() => {
                let i = rng.below(len) as usize;
                input[i] = rng.next_u64() as u8;
            }
            2 => input.truncate(rng.below(len + 1) as usize),
            3 => {
                let at = rng.below(len + 1).min(input.len() as u64) as usize;
                let n = 1 + rng.below(16) as usize;
                let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
                input.splice(at..at, bytes);
            }
            4 => {
                let other = &seeds[rng.below(seeds.len() as u64) as usize];
                let at = rng.below(len + 1).min(input.len() as u64) as usize;
                let from = rng.below(other.len() as u64 + 1) as usize;
                input.truncate(at);
                input.extend_from_slice(&other[from..]);
            }
            5 | 6 if input.len() >= 8 => {
                let width = if rng.below(2) == 0 { 4 } else { 8 };
                let i = rng.below((input.len() - width + 1) as u64) as usize;
                let v = INTERESTING[rng.below(INTERESTING.len() as u64) as usize];
                let v = if rng.below(2) == 0 {
                    v
                } else {
                    v.wrapping_add(rng.below(3)).wrapping_sub(1)
                };
                input[i..i + width].copy_from_slice(&v.to_le_bytes()[..width]);
            }
            _ if input.len() >= 2 => {
                let a = rng.below(len) as usize;
                let b = (a + rng.below(64) as usize).min(input.len());
                let copy = input[a..b].to_vec();
                let at = rng.below(input.len() as u64) as usize;
                input.splice(at..at, copy);
            }
            _ => input.push(rng.next_u64() as u8),
        }
    }
}

/// Runs `target` on mutations of `seeds` for the configured time; returns the executions.
/// Fails on the first panic, saving the input.
fn fuzz(name: &str, seeds: Vec<Vec<u8>>, target: fn(&[u8])) -> u64 {
    let secs: f64 = std::env::var("SHOAL_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    let limit = Duration::from_secs_f64(secs.clamp(0.1, 3600.0));
    let mut rng = Rng::new(shoal::rng::derive_seed(std::process::id() as u64, name));
    let t0 = Instant::now();
    let mut execs = 0u64;
    // The seeds themselves, then mutations; a panic's message is kept, not printed.
    std::panic::set_hook(Box::new(|_| {}));
    let mut input = Vec::new();
    while t0.elapsed() < limit {
        for _ in 0..256 {
            let s = &seeds[rng.below(seeds.len() as u64) as usize];
            input.clear();
            input.extend_from_slice(s);
            if execs >= seeds.len() as u64 {
                mutate(&mut rng, &seeds, &mut input);
            }
            let r = std::panic::catch_unwind(|| target(&input));
            execs += 1;
            if let Err(p) = r {
                let _ = std::panic::take_hook();
                let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("../fuzz-crashes");
                let _ = std::fs::create_dir_all(&dir);
                let path = dir.join(format!("{name}-{execs}.bin"));
                let _ = std::fs::write(&path, &input);
                let why = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                panic!("fuzz {name}: panic on input {} ({why})", path.display());
            }
        }
    }
    let _ = std::panic::take_hook();
    let s = t0.elapsed().as_secs_f64();
    eprintln!(
        "fuzz {name}: {execs} executions in {s:.1} s ({:.0}/s), 0 crashes",
        execs as f64 / s
    );
    execs
}

#[test]
fn fuzz_frame_decoder() {
    let mut seeds = vec![frame_u32(&[2, 8]), frame_u32(&[0])];
    for codec in ["f32", "f16", "bf16", "int8", "int8+zstd", "f32+zstd"] {
        seeds.push(frame_f32(&[3, 5], codec));
        seeds.push(frame_f32(&[200], codec));
    }
    assert!(fuzz("frame", seeds, targets::frame) > 0);
}

#[test]
fn fuzz_request_reading() {
    let cfg = RunConfig::tiny();
    let (b, s, d) = (
        cfg.training.batch_size,
        cfg.model.seq_len,
        cfg.model.d_model,
    );
    let hidden = frame_f32(&[b, s, d], "int8");
    let mut seeds = vec![
        message(&request(forward(), 1), std::slice::from_ref(&hidden)),
        message(&request(backward(), 2), &[hidden.clone(), hidden]),
        message(&request(Call::Info {}, 0), &[]),
    ];
    for r in requests().into_iter().filter(|r| r.op() == Op::Avg) {
        let frames: Vec<Vec<u8>> = (0..r.tensors).map(|_| frame_f32(&[300], "int8")).collect();
        seeds.push(message(&r, &frames));
    }
    assert!(fuzz("request", seeds, targets::request) > 0);
}

#[test]
fn fuzz_state_chunk_response() {
    let mut r = Response::ok(4, 0, 1);
    r.state = responses()[1].state.clone();
    let seeds = vec![
        message(&r, &[frame_f32(&[500], "f32")]),
        message(
            &Response::ok(4, 0, 2),
            &[frame_f32(&[10], "f32"), frame_f32(&[3], "bf16")],
        ),
        message(&responses()[3], &[]),
    ];
    assert!(fuzz("chunk", seeds, targets::chunk) > 0);
}

/// Round trip, every truncation and every byte flipped, for one encoded header.
fn header_properties<T, E>(value: &T, decode: impl Fn(&[u8]) -> Result<T, E>)
where
    T: serde::Serialize + PartialEq + std::fmt::Debug,
{
    let bytes = msg::encode_header(value);
    let body = &bytes[4..];
    assert_eq!(
        u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize,
        body.len()
    );
    assert_eq!(decode(body).ok().as_ref(), Some(value), "round trip");
    for n in 0..body.len() {
        assert!(
            decode(&body[..n]).is_err(),
            "a {n}-byte prefix of {value:?} decoded"
        );
    }
    let mut flipped = body.to_vec();
    for i in 0..body.len() {
        for x in [0x01u8, 0x20, 0x80, 0xff] {
            flipped[i] ^= x;
            // Anything may come back but a panic; what decodes re-encodes to itself.
            if let Ok(v) = decode(&flipped) {
                let again = msg::encode_header(&v);
                assert_eq!(decode(&again[4..]).ok().as_ref(), Some(&v));
            }
            flipped[i] ^= x;
        }
    }
}

#[test]
fn every_message_header_round_trips_and_survives_truncation_and_flipped_bytes() {
    for r in requests() {
        header_properties(&r, msg::decode_request);
    }
    for r in responses() {
        header_properties(&r, msg::decode_response);
    }
    // A header of another version or with too many tensors is refused by its reader.
    let mut r = request(forward(), 1);
    r.v = MSG_VERSION + 1;
    assert!(msg::decode_request(&msg::encode_header(&r)[4..]).is_err());
    let mut r = request(forward(), 1);
    r.tensors = 200;
    assert!(msg::decode_request(&msg::encode_header(&r)[4..]).is_err());
}
