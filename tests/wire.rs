//! The tensor frame: property-tested round trips and error bounds, and one test per kind
//! of damaged frame.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests and benches fail by panicking"
)]

use proptest::prelude::*;
use shoal::wire::{self, CodecSpec, Limits, Quant, TensorData, WireError};

fn shape_and_values(
    max_elems: usize,
    values: impl Strategy<Value = f32> + Clone,
) -> impl Strategy<Value = (Vec<usize>, Vec<f32>)> {
    prop::collection::vec(1usize..6, 0..4).prop_flat_map(move |mut shape| {
        let n: usize = shape.iter().product();
        if n > max_elems {
            shape = vec![max_elems];
        }
        let n: usize = shape.iter().product();
        (Just(shape), prop::collection::vec(values.clone(), n))
    })
}

fn zstd_level() -> impl Strategy<Value = u8> {
    prop_oneof![Just(0u8), 1u8..=3]
}

fn round_trip(shape: &[usize], data: &[f32], spec: &CodecSpec) -> Vec<f32> {
    let mut frame = Vec::new();
    let written = wire::encode_f32(shape, data, spec, &mut frame).expect("encode");
    assert_eq!(written, frame.len());
    match wire::encoded_len(shape, spec) {
        Some(len) => assert_eq!(len, written, "encoded_len for {spec}"),
        None => assert!(written <= wire::max_encoded_len(shape, spec).expect("bound")),
    }
    let t = wire::decode(&frame, &Limits::default()).expect("decode");
    assert_eq!(t.shape, shape);
    match t.data {
        TensorData::F32(v) => v,
        other => panic!("wrong dtype {other:?}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn f32_is_exact((shape, data) in shape_and_values(300, any::<f32>()), z in zstd_level()) {
        let got = round_trip(&shape, &data, &CodecSpec::F32.with_zstd(z));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(&got), bits(&data));
    }

    #[test]
    fn f16_within_bound((shape, data) in shape_and_values(300, -60000f32..60000f32), z in zstd_level()) {
        let spec = CodecSpec { quant: Quant::F16, block_size: 0, zstd_level: z, ids_last: false };
        let got = round_trip(&shape, &data, &spec);
        for (&x, &y) in data.iter().zip(&got) {
            let bound = (x.abs() * 2f32.powi(-11)).max(2f32.powi(-25));
            prop_assert!((x - y).abs() <= bound, "{} -> {}", x, y);
        }
    }

    #[test]
    fn bf16_within_bound((shape, data) in shape_and_values(300, prop_oneof![-1e30f32..1e30f32, -1f32..1f32, Just(0.0f32)]), z in zstd_level()) {
        let spec = CodecSpec { quant: Quant::Bf16, block_size: 0, zstd_level: z, ids_last: false };
        let got = round_trip(&shape, &data, &spec);
        for (&x, &y) in data.iter().zip(&got) {
            let bound = if x.abs() < 1e-37 { 1e-39 } else { x.abs() * 2f32.powi(-8) };
            prop_assert!((x - y).abs() <= bound, "{} -> {}", x, y);
        }
    }

    #[test]
    fn int8_within_half_a_step(
        (shape, data) in shape_and_values(500, prop_oneof![-1e6f32..1e6f32, -1f32..1f32, Just(0.0f32)]),
        block in prop_oneof![Just(1u32), Just(7), Just(32), Just(64), Just(100), Just(256)],
        z in zstd_level(),
    ) {
        let spec = CodecSpec { quant: Quant::Int8, block_size: block, zstd_level: z, ids_last: false };
        let got = round_trip(&shape, &data, &spec);
        for (xb, yb) in data.chunks(block as usize).zip(got.chunks(block as usize)) {
            let absmax = xb.iter().fold(0f32, |m, x| m.max(x.abs()));
            let step = absmax / 127.0 * (1.0 + 2f32.powi(-7));
            for (&x, &y) in xb.iter().zip(yb) {
                prop_assert!((x - y).abs() <= step * 0.5 * 1.0001 + 1e-30, "{} -> {} (absmax {})", x, y, absmax);
            }
        }
    }

    #[test]
    fn u32_is_exact(data in prop::collection::vec(any::<u32>(), 0..200), z in zstd_level()) {
        let mut frame = Vec::new();
        wire::encode_u32(&[data.len()], &data, z, &mut frame).expect("encode");
        let t = wire::decode(&frame, &Limits::default()).expect("decode");
        prop_assert_eq!(t.data, TensorData::U32(data));
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = wire::decode(&bytes, &Limits::default());
    }

    #[test]
    fn damaged_frames_are_refused_not_panics(
        (shape, data) in shape_and_values(64, -10f32..10f32),
        which in 0usize..4,
        at in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        let spec = ["f32", "bf16", "int8", "int8+zstd1"][which].parse::<CodecSpec>().expect("codec");
        let mut frame = Vec::new();
        wire::encode_f32(&shape, &data, &spec, &mut frame).expect("encode");
        let i = at.index(frame.len());
        let old = frame[i];
        frame[i] = byte;
        let r = wire::decode(&frame, &Limits::default());
        if old != byte {
            // Any change to header or payload is detected (the checksum covers the payload).
            prop_assert!(r.is_err() || i < 16 && r.is_ok(), "byte {} changed and decode succeeded", i);
        }
    }
}

fn frame_of(spec: &str, n: usize) -> Vec<u8> {
    let data: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut frame = Vec::new();
    wire::encode_f32(&[n], &data, &spec.parse().expect("codec"), &mut frame).expect("encode");
    frame
}

#[test]
fn truncated_frames() {
    let f = frame_of("int8", 100);
    for cut in [0, 3, 15, 20, f.len() - 1] {
        let e = wire::decode(&f[..cut], &Limits::default()).unwrap_err();
        assert!(
            matches!(e, WireError::Truncated { .. }),
            "cut at {cut}: {e:?}"
        );
    }
}

#[test]
fn corrupted_payload_fails_the_checksum() {
    for spec in ["f32", "f16", "int8", "int8+zstd1"] {
        let mut f = frame_of(spec, 100);
        let last = f.len() - 1;
        f[last] ^= 0x40;
        let e = wire::decode(&f, &Limits::default()).unwrap_err();
        assert_eq!(e, WireError::ChecksumMismatch, "{spec}");
    }
}

#[test]
fn oversized_frames_are_refused_before_allocating() {
    let f = frame_of("f32", 1000);
    let e = wire::decode(
        &f,
        &Limits {
            max_elements: 999,
            max_bytes: 1 << 20,
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            WireError::TooManyElements {
                elements: 1000,
                limit: 999
            }
        ),
        "{e:?}"
    );
    let e = wire::decode(
        &f,
        &Limits {
            max_elements: 1 << 20,
            max_bytes: 3999,
        },
    )
    .unwrap_err();
    assert!(
        matches!(e, WireError::TooLarge { bytes: 4000, .. }),
        "{e:?}"
    );
    // A header that claims 2^62 elements with no payload behind it is refused by the limit,
    // not by trying to allocate.
    let mut g = f.clone();
    g[16..24].copy_from_slice(&(1u64 << 62).to_le_bytes());
    let e = wire::decode(&g, &Limits::default()).unwrap_err();
    assert!(matches!(e, WireError::TooManyElements { .. }), "{e:?}");
}

#[test]
fn unknown_version_codec_dtype_and_bad_magic() {
    let f = frame_of("f32", 10);
    let mut g = f.clone();
    g[4] = 9;
    assert_eq!(
        wire::decode(&g, &Limits::default()).unwrap_err(),
        WireError::UnsupportedVersion(9)
    );
    let mut g = f.clone();
    g[6] = 7;
    assert_eq!(
        wire::decode(&g, &Limits::default()).unwrap_err(),
        WireError::UnknownCodec(7)
    );
    let mut g = f.clone();
    g[5] = 5;
    assert_eq!(
        wire::decode(&g, &Limits::default()).unwrap_err(),
        WireError::UnknownDtype(5)
    );
    let mut g = f.clone();
    g[0] = b'X';
    assert_eq!(
        wire::decode(&g, &Limits::default()).unwrap_err(),
        WireError::BadMagic
    );
    let mut g = f.clone();
    g[8] = 9;
    assert_eq!(
        wire::decode(&g, &Limits::default()).unwrap_err(),
        WireError::RankTooLarge(9)
    );
}

#[test]
fn shape_that_disagrees_with_the_payload() {
    let mut f = frame_of("f32", 10);
    f[16..24].copy_from_slice(&11u64.to_le_bytes());
    let e = wire::decode(&f, &Limits::default()).unwrap_err();
    assert_eq!(
        e,
        WireError::LengthMismatch {
            expected: 44,
            got: 40
        }
    );
    // With zstd the mismatch shows after decompression.
    let mut f = frame_of("int8+zstd1", 128);
    f[16..24].copy_from_slice(&100u64.to_le_bytes());
    let e = wire::decode(&f, &Limits::default()).unwrap_err();
    assert!(
        matches!(e, WireError::Zstd(_) | WireError::LengthMismatch { .. }),
        "{e:?}"
    );
}

#[test]
fn trailing_bytes_and_encoder_misuse() {
    let mut f = frame_of("bf16", 10);
    f.push(0);
    assert_eq!(
        wire::decode(&f, &Limits::default()).unwrap_err(),
        WireError::TrailingBytes(1)
    );
    let mut out = Vec::new();
    let e = wire::encode_f32(&[3, 3], &[0.0; 8], &CodecSpec::F32, &mut out).unwrap_err();
    assert!(matches!(e, WireError::BadInput(_)));
}

#[test]
fn header_len_lets_a_stream_reader_size_its_reads() {
    let f = frame_of("int8", 50);
    let hlen = wire::header_len(&f[..wire::frame::PREFIX_LEN]).expect("prefix");
    let (h, len) = wire::parse_header(&f[..hlen], &Limits::default()).expect("header");
    assert_eq!(len, hlen);
    assert_eq!(h.frame_len() as usize, f.len());
}

#[test]
fn decode_into_reuses_and_checks_dtype() {
    let f = frame_of("int8", 300);
    let mut out = vec![9.0f32; 300];
    wire::decode_f32_into(&f, &Limits::default(), &mut out).expect("decode");
    assert!((out[10] - (10.0f32 * 0.37).sin()).abs() < 0.01);
    let mut t = Vec::new();
    wire::encode_u32(&[2], &[1, 2], 0, &mut t).expect("encode");
    let e = wire::decode_f32_into(&t, &Limits::default(), &mut out).unwrap_err();
    assert!(matches!(e, WireError::WrongDtype { .. }));
}

#[test]
fn large_frames_decode_the_same_way_small_ones_do() {
    // 2.5 Mi values (10 MiB of f32) crosses the size where decoding switches to streaming
    // stores; the result must be what the codec promises all the same.
    let n = 5 << 19;
    let data = shoal::bench::codec::normal_data(n, 3);
    let limits = Limits::default();
    for name in ["f16", "bf16", "int8"] {
        let spec: CodecSpec = name.parse().expect("codec");
        let mut frame = Vec::new();
        wire::encode_f32(&[n], &data, &spec, &mut frame).expect("encode");
        let mut out = Vec::new();
        wire::decode_f32_into(&frame, &limits, &mut out).expect("decode");
        assert_eq!(out.len(), n);
        if spec.quant == Quant::Int8 {
            for (xb, yb) in data.chunks(64).zip(out.chunks(64)) {
                let absmax = xb.iter().fold(0f32, |m, x| m.max(x.abs()));
                let half_step = absmax / 127.0 * (1.0 + 2f32.powi(-7)) * 0.5 * 1.0001;
                assert!(xb.iter().zip(yb).all(|(x, y)| (x - y).abs() <= half_step));
            }
        } else {
            // f16 and bf16 are idempotent: re-encoding the decoded values gives the same frame.
            let mut again = Vec::new();
            wire::encode_f32(&[n], &out, &spec, &mut again).expect("encode");
            assert!(again == frame, "{name}: decode of a large frame differs");
        }
        // Decoding into a freshly allocated buffer agrees too.
        let t = wire::decode(&frame, &limits).expect("decode");
        assert_eq!(t.data, TensorData::F32(out));
    }
}
