//! The fuzz targets, shared by the stable-toolchain fuzzer (`tests/fuzz.rs`, which CI runs)
//! and this crate's libFuzzer targets (`cargo +nightly fuzz run decode|request|chunk`):
//! any bytes must give a value or a typed error, never a panic, and never an allocation
//! beyond the limits.

use futures::io::Cursor;
use shoal::averaging::sync::chunk_hash;
use shoal::config::RunConfig;
use shoal::net::io::{read_frame_checked, read_header, read_response};
use shoal::stage::service::expect::Expect;
use shoal::wire::msg::{self, Op};
use shoal::wire::{self, Limits, TensorData};
use std::sync::OnceLock;

/// Limits of the fuzzed decoders: small, so a decoder that honoured a wild length would
/// be caught by its allocation, not just slowed down.
pub const LIMITS: Limits = Limits {
    max_elements: 1 << 16,
    max_bytes: 1 << 18,
};

/// The tensor frame decoder.
pub fn frame(data: &[u8]) {
    if let Ok(t) = wire::decode(data, &LIMITS) {
        let n: usize = t.shape.iter().product();
        let len = match &t.data {
            TensorData::F32(v) => v.len(),
            TensorData::U32(v) => v.len(),
        };
        assert_eq!(n, len, "decoded length disagrees with the shape");
    }
    let mut out = Vec::new();
    let _ = wire::decode_f32_into(data, &LIMITS, &mut out);
    let _ = wire::parse_header(data, &LIMITS);
}

/// What a replica of stage 1 of the tiny run does with a request off the wire.
pub fn request(data: &[u8]) {
    static EXPECT: OnceLock<Expect> = OnceLock::new();
    let expect = EXPECT.get_or_init(|| Expect::of(&RunConfig::tiny(), 1));
    let limits = expect.limits();
    futures::executor::block_on(async {
        let mut r = Cursor::new(data);
        let Ok(head) = read_header(&mut r).await else {
            return;
        };
        let Ok(req) = msg::decode_request(&head) else {
            return;
        };
        let wants = expect.wants(req.op());
        for i in 0..req.tensors as usize {
            let want = wants.get(i).copied();
            let f = read_frame_checked(&mut r, &limits, |h| match want {
                Some(w) => expect.check(w, h),
                None => Err("no such tensor".into()),
            })
            .await;
            let Ok(f) = f else { return };
            if let Ok(t) = wire::decode(&f, &limits) {
                assert_eq!(t.shape.len(), if req.op() == Op::Avg { 1 } else { 3 });
            }
        }
    });
}

/// What a joiner does with a state chunk's response.
pub fn chunk(data: &[u8]) {
    futures::executor::block_on(async {
        let mut r = Cursor::new(data);
        if let Ok((_, frames)) = read_response(&mut r, &LIMITS).await {
            for f in frames {
                let mut v = Vec::new();
                if wire::decode_f32_into(&f, &LIMITS, &mut v).is_ok() {
                    assert!(!chunk_hash(&v).is_empty());
                }
            }
        }
    });
}
