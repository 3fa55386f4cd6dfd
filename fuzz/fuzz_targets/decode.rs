//! Fuzzes the tensor frame decoder: any bytes must give a tensor or a typed error, never a
//! panic, and never an allocation beyond the limits. Run: `cargo +nightly fuzz run decode`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shoal::wire::{self, Limits, TensorData};

fuzz_target!(|data: &[u8]| {
    let limits = Limits {
        max_elements: 1 << 16,
        max_bytes: 1 << 18,
    };
    if let Ok(t) = wire::decode(data, &limits) {
        let n: usize = t.shape.iter().product();
        let len = match &t.data {
            TensorData::F32(v) => v.len(),
            TensorData::U32(v) => v.len(),
        };
        assert_eq!(n, len, "decoded length disagrees with the shape");
    }
    let mut out = Vec::new();
    let _ = wire::decode_f32_into(data, &limits, &mut out);
});
