//! Criterion benchmark of the tensor codecs: encode+decode of a 16M-element N(0, 1) tensor.
//! `cargo bench --bench codec`; `shoal bench codec` prints the same figures as a table.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests and benches fail by panicking"
)]

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use shoal::wire::{self, CodecSpec, Limits};

fn codecs(c: &mut Criterion) {
    let n = 16 << 20;
    let data = shoal::bench::codec::normal_data(n, 1);
    let limits = Limits {
        max_elements: n as u64,
        max_bytes: u64::MAX,
    };
    let mut group = c.benchmark_group("encode+decode 16M f32");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(4 * n as u64));
    for name in ["f32", "f16", "bf16", "int8", "int8+zstd1"] {
        let spec: CodecSpec = name.parse().unwrap_or(CodecSpec::F32);
        let mut frame = Vec::new();
        let mut out = Vec::new();
        group.bench_with_input(BenchmarkId::from_parameter(name), &spec, |b, spec| {
            b.iter(|| {
                frame.clear();
                let _ = wire::encode_f32(&[n], &data, spec, &mut frame);
                let _ = wire::decode_f32_into(&frame, &limits, &mut out);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, codecs);
criterion_main!(benches);
